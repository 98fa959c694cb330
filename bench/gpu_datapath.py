"""GPU data-path benchmark (issue 8): shard reload and 2D KV migration against the copy ceilings.

    PYTHONPATH=. python bench/gpu_datapath.py --out DIR            # one H200 (plain torch, no vLLM)
    PYTHONPATH=. python bench/gpu_datapath.py --device cpu --small --out DIR   # CPU check, tiny

One process, one GPU. In order:
1. ceilings: pinned host→device, pageable host→device, device→host and device→device copies;
2. shard reload: a Llama-2-7B- and a 13B-shaped random bf16 checkpoint is written into the
   project's weight store (safetensors files in /dev/shm), mapped and page-locked once
   (``MappedStore``), and every rank's shard of every TP×PP (TP·PP ≤ 8) is loaded into vLLM's
   merged parameter layout by the project's loader (``ShardLoader``: ``direct`` = DMA straight
   from the page-locked store, pitched DMA for column cuts; ``staged`` = pinned bounce ring);
   destinations poisoned with NaN first, every element checked against the source after;
3. KV migration: vLLM's GPU (flash) KV layout per layer [2, blocks, block_size, kv_heads, head]
   for the same shapes; the project's plan (``remp.kvplan``) executed by the project's executor
   (``node_agent.kv.migrate.migrate_kv``), one thread and one CUDA stream per emulated rank,
   ranks' buffers as separate allocations on the one GPU, ``LocalTransport`` between them. Each
   unordered pair {A, B} runs A→B (poisoned, checked, memory traced), B→A and A→B (timed),
   B→A (poisoned, checked, traced), and the two directions again with a staging limit (chunked);
4. overlap: MIGRATE_KV and RELOAD_SHARDS on separate streams at once vs one after the other;
5. a predicted data-path time for an 8-GPU host from these numbers and stated link bandwidths.

Writes DIR/gpu_datapath_h200.json (or gpu_datapath_cpu.json) and the matching .md, prints the
tables last. ``--budget-s`` bounds the whole run: optional sweeps are skipped (and listed as
skipped) once it is spent.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from node_agent.kv import common as kvc  # noqa: E402
from node_agent.kv import executor_direct as kvd  # noqa: E402
from node_agent.kv.executor_collective import migrate_kv_reference  # noqa: E402
from node_agent.kv.migrate import migrate_kv  # noqa: E402
from node_agent.kv.transport import LocalTransport  # noqa: E402
from node_agent.weight_store import (MappedStore, ShardLoader, WeightStore,  # noqa: E402
                                     llama_shard_pieces)
from remp.kvplan import RankView, migration_plan  # noqa: E402
from remp.topology import Topology  # noqa: E402

GB = 1e9
DTYPE = torch.bfloat16
BLOCK_SIZE = 16

MODELS = {
    "llama2-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=32, intermediate_size=11008, vocab_size=32000),
    "llama2-13b": dict(num_hidden_layers=40, hidden_size=5120, num_attention_heads=40,
                       num_key_value_heads=40, intermediate_size=13824, vocab_size=32000),
}
SMALL_MODELS = {
    "tiny-7b-shape": dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=8,
                          num_key_value_heads=8, intermediate_size=128, vocab_size=256),
    "tiny-13b-shape": dict(num_hidden_layers=16, hidden_size=128, num_attention_heads=8,
                           num_key_value_heads=8, intermediate_size=192, vocab_size=512),
}
TOPOS = [Topology(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if tp * pp <= 8]
X8 = [Topology(1, 8), Topology(2, 4), Topology(4, 2), Topology(8, 1)]
DEFAULT_PLAN = "0:10000:all,1:10000:all,0:100000:x8,1:100000:x8,1:50000:x8,1:100000:all"
SMALL_PLAN = "0:300:all,1:300:x8"
# assumed for the 8-GPU prediction (not measured here)
ASSUMED = {
    "nvlink_GBps_per_dir": 450.0,   # H100/H200 NVLink 4: 18 links x 25 GB/s per direction
    "nvlink_efficiency": 0.8,       # achievable fraction for large point-to-point transfers
    "pcie_GBps_per_gpu": 55.0,      # PCIe Gen5 x16 host->device, per GPU (shared uplinks: less)
}


# --------------------------------------------------------------------------- helpers


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()


def log(*a) -> None:
    print(*a, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_time(fn, dev, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (device-synchronized)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def gen(seed: int, dev: torch.device) -> torch.Generator:
    return torch.Generator(device=dev).manual_seed(seed)


# --------------------------------------------------------------------------- 1. ceilings


def measure_ceilings(dev: torch.device, small: bool) -> dict:
    n = (8 << 20) if small else (2 << 30)
    reps = 5 if small else 10
    out: dict = {"bytes": n}
    src = torch.randn(n // 2, device=dev, dtype=DTYPE).view(torch.uint8)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), dev, reps)
    out["d2d_copy_GBps"] = n / t / GB                # bytes copied per second
    out["d2d_read_plus_write_GBps"] = 2 * n / t / GB  # the usual HBM figure (read + write)
    if dev.type == "cuda":
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(src.cpu())
        pageable = torch.empty(n, dtype=torch.uint8)
        pageable.copy_(pinned)
        out["pageable_is_pinned"] = pageable.is_pinned()
        t = median_time(lambda: dst.copy_(pinned, non_blocking=True), dev, reps)
        out["h2d_pinned_GBps"] = n / t / GB
        t = median_time(lambda: pinned.copy_(src, non_blocking=True), dev, reps)
        out["d2h_pinned_GBps"] = n / t / GB
        t = median_time(lambda: dst.copy_(pageable), dev, 3, warmup=1)
        out["h2d_pageable_GBps"] = n / t / GB
        del pinned, pageable
    del src, dst
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- 2. weight store + reload


def checkpoint_entries(cfg: dict) -> list[tuple[str, tuple]]:
    h, L, i, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h))]
    for ly in range(L):
        p = f"model.layers.{ly}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def write_store(store_dir: Path, cfg: dict, dev: torch.device, file_bytes: int, seed: int
                ) -> tuple[WeightStore, dict[str, torch.Tensor]]:
    """A random bf16 checkpoint as safetensors files straight into the store folder (what
    ``WeightStore.create`` copies there at agent start-up). Returns the store and the reference
    tensors (on ``dev``) for the checks."""
    import mmap

    store_dir.mkdir(parents=True, exist_ok=True)
    entries = checkpoint_entries(cfg)
    groups, cur, size = [], [], 0
    for key, shape in entries:
        nb = math.prod(shape) * 2
        if cur and size + nb > file_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append((key, shape))
        size += nb
    groups.append(cur)
    ref: dict[str, torch.Tensor] = {}
    g = gen(seed, dev)
    total = 0
    for fi, group in enumerate(groups):
        header, off = {}, 0
        for key, shape in group:
            nb = math.prod(shape) * 2
            header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
        header["__metadata__"] = {"format": "pt"}
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        path = store_dir / f"model-{fi + 1:05d}-of-{len(groups):05d}.safetensors"
        length = 8 + len(hb) + off
        with open(path, "wb+") as f:
            f.truncate(length)
            mm = mmap.mmap(f.fileno(), length)
        mm[:8] = struct.pack("<Q", len(hb))
        mm[8:8 + len(hb)] = hb
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        for key, shape in group:
            b, e = header[key]["data_offsets"]
            t = torch.randn(shape, generator=g, device=dev, dtype=DTYPE)
            buf[8 + len(hb) + b:8 + len(hb) + e].view(DTYPE).view(shape).copy_(t)
            ref[key] = t
        del buf
        mm.close()
        total += length
    return WeightStore(store_dir, total), ref


def alloc_params(shapes: dict[str, tuple], dev: torch.device) -> tuple[torch.Tensor, dict]:
    """One flat arena per rank (poisoned with NaN), parameters as views into it."""
    n = sum(math.prod(s) for s in shapes.values())
    arena = torch.full((n,), float("nan"), dtype=DTYPE, device=dev)
    params, off = {}, 0
    for name, s in shapes.items():
        k = math.prod(s)
        params[name] = arena[off:off + k].view(s)
        off += k
    return arena, params


def check_shard(arena, params, pieces, ref) -> bool:
    if bool(arena.isnan().any()):
        return False  # some element was never written
    for p in pieces:
        want = ref[p.key] if p.dim is None else ref[p.key].narrow(p.dim, p.start, p.length)
        got = params[p.param].narrow(0, p.row, want.shape[0])
        if not torch.equal(got, want):
            return False
    return True


def reload_topology(store, loader, cfg, topo, ref, dev, stream, only=None) -> dict:
    ranks = []
    for rank in (range(topo.world_size) if only is None else only):
        shapes, pieces = llama_shard_pieces(cfg, topo.tp, topo.pp, rank)
        arena, params = alloc_params(shapes, dev)
        sync(dev)
        t = time.perf_counter()
        n = loader.load(pieces, params)
        if dev.type == "cuda":
            stream.synchronize()
        dt = time.perf_counter() - t
        ok = check_shard(arena, params, pieces, ref)
        ranks.append({"rank": rank, "bytes": n, "seconds": dt, "GBps": n / dt / GB, "ok": ok})
        del arena, params
    tot_b, tot_s = sum(r["bytes"] for r in ranks), sum(r["seconds"] for r in ranks)
    return {"topology": str(topo), "ranks": ranks, "bytes": tot_b, "seconds": tot_s,
            "GBps": tot_b / tot_s / GB, "min_rank_GBps": min(r["GBps"] for r in ranks),
            "max_rank_bytes": max(r["bytes"] for r in ranks), "ok": all(r["ok"] for r in ranks)}


def baseline_remp_shm(store, cfg, topo, rank, ref, dev) -> dict:
    """The engine path's way (``remp_shm`` loader): safetensors ``get_tensor`` of each whole
    tensor, then the cut is copied to the device (vLLM's weight_loader does the cut)."""
    from safetensors import safe_open

    from node_agent.weight_store import read_safetensors_header

    where = {}
    for f in sorted(Path(store.path).glob("*.safetensors")):
        for k in read_safetensors_header(f)[1]:
            where[k] = f
    shapes, pieces = llama_shard_pieces(cfg, topo.tp, topo.pp, rank)
    arena, params = alloc_params(shapes, dev)
    sync(dev)
    t = time.perf_counter()
    n = 0
    handles = {}
    for p in pieces:
        f = where[p.key]
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        full = handles[f].get_tensor(p.key)
        cut = full if p.dim is None else full.narrow(p.dim, p.start, p.length)
        params[p.param].narrow(0, p.row, cut.shape[0]).copy_(cut)
        n += nbytes(cut)
    sync(dev)
    dt = time.perf_counter() - t
    ok = check_shard(arena, params, pieces, ref)
    del arena, params, handles
    return {"topology": str(topo), "rank": rank, "bytes": n, "seconds": dt, "GBps": n / dt / GB, "ok": ok}


def store_root(need: int, prefer: str) -> Path:
    for root in (prefer, "/dev/shm", "/tmp"):
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(root).free > need * 1.05 + (1 << 30):
                return Path(root)
        except OSError:
            continue
    return Path("/tmp")


def bench_reload(name, cfg, dev, args, budget, report, keep_open=False, sweep=True):
    need = sum(math.prod(s) * 2 for _, s in checkpoint_entries(cfg))
    root = store_root(need, args.store_root)
    res: dict = {"model": name, "checkpoint_bytes": need, "store_root": str(root)}
    t = time.perf_counter()
    store, ref = write_store(root / f"remp-bench-{name}", cfg, dev, args.file_bytes, seed=1234)
    res["store_write_seconds"] = time.perf_counter() - t
    log(f"[reload {name}] store {need / GB:.1f} GB in {root}: written in {res['store_write_seconds']:.1f} s")
    cuda = dev.type == "cuda"
    mapped = None
    if cuda:
        try:
            mapped = MappedStore.open(store.path, pin=True)
        except Exception as exc:  # noqa: BLE001 - fall back to the staging ring, reported
            res["pin_error"] = f"{type(exc).__name__}: {exc}"
            log(f"[reload {name}] page-locking the store failed: {res['pin_error']}")
    if mapped is None:
        mapped = MappedStore.open(store.path, pin=False)
    res.update(map_seconds=mapped.map_seconds, pin_seconds=mapped.pin_seconds, pinned=mapped.pinned)
    stream = torch.cuda.Stream(dev) if cuda else None
    if mapped.pinned:
        big = max(mapped.keys(), key=lambda k: nbytes(mapped.tensor(k)))
        src = mapped.tensor(big)
        dst = torch.empty_like(src, device=dev)
        t = median_time(lambda: dst.copy_(src, non_blocking=True), dev, 5)
        res["h2d_registered_store_GBps"] = nbytes(src) / t / GB
        del dst, src
    modes = ["direct", "staged"] if mapped.pinned else ["staged"]
    if not sweep:
        modes = []
    res["modes"] = {}
    for mode in modes:
        loader = ShardLoader(mapped, dev, mode=mode, stream=stream)
        res["pitched_dma"] = loader._memcpy2d is not None if mode == "direct" else res.get("pitched_dma")
        # warm-up: one small rank (first-touch, allocator, kernels)
        reload_topology(mapped, loader, cfg, Topology(8, 1), ref, dev, stream, only=[0])
        rows = []
        for topo in TOPOS:
            if budget.left() < args.reserve_s and rows:
                res.setdefault("skipped", []).append(f"{mode} {topo}")
                continue
            r = reload_topology(mapped, loader, cfg, topo, ref, dev, stream)
            rows.append(r)
            log(f"[reload {name} {mode}] {topo}: {r['bytes'] / GB:6.2f} GB  {r['GBps']:6.1f} GB/s"
                f"  (min rank {r['min_rank_GBps']:.1f})  ok={r['ok']}")
        res["modes"][mode] = {"topologies": rows, "loader_stats": dict(loader.stats)}
        del loader
    try:
        if not sweep:
            raise RuntimeError("reload sweep not run (--only)")
        res["baseline_remp_shm"] = baseline_remp_shm(store, cfg, Topology(2, 2), 0, ref, dev)
        b = res["baseline_remp_shm"]
        log(f"[reload {name} remp_shm-style get_tensor] TP2PP2 rank 0: {b['GBps']:.1f} GB/s ok={b['ok']}")
    except Exception as exc:  # noqa: BLE001
        res["baseline_remp_shm"] = {"error": f"{type(exc).__name__}: {exc}"}
    del ref
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if sweep:
        report.setdefault("reload", {})[name] = res
    if keep_open:
        return store, mapped
    mapped.close()
    store.close()
    return None, None


# --------------------------------------------------------------------------- 3. KV migration


class KVCase:
    """One model's KV (vLLM GPU flash layout per layer: [2, blocks, block_size, kv_heads, head])."""

    def __init__(self, cfg: dict, tokens: int, dev: torch.device, seed: int = 7):
        self.L = cfg["num_hidden_layers"]
        self.H = cfg["num_key_value_heads"]
        self.D = cfg["hidden_size"] // cfg["num_attention_heads"]
        self.tokens, self.dev, self.seed = tokens, dev, seed
        live = -(-tokens // BLOCK_SIZE)
        self.NB = live + max(1, live // 10)  # pool with 10 % free blocks
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(self.NB, generator=g)[:live].sort().values
        self.ids = ids.to(dev)
        dead = torch.ones(self.NB, dtype=torch.bool)
        dead[ids] = False
        self.dead = dead.nonzero().flatten().to(dev)
        self.layer_bytes = 2 * self.NB * BLOCK_SIZE * self.H * self.D * 2  # one full layer (pool)
        self.live_layer_bytes = 2 * live * BLOCK_SIZE * self.H * self.D * 2

    def shape(self, heads: int) -> tuple:
        return (2, self.NB, BLOCK_SIZE, heads, self.D)

    @staticmethod
    def exec_view(t: torch.Tensor) -> torch.Tensor:
        """[2, NB, BS, h, D] → the executor's [NB, h, 2, BS, D] (block first, head second)."""
        return t.permute(1, 3, 0, 2, 4)

    def global_layer(self, layer: int) -> torch.Tensor:
        return torch.randn(self.shape(self.H), generator=gen(self.seed * 100003 + layer, self.dev),
                           device=self.dev, dtype=DTYPE)

    def fill(self, topo: Topology, streams) -> dict[int, dict[int, torch.Tensor]]:
        v = RankView(topo, self.L, self.H)
        out: dict[int, dict[int, torch.Tensor]] = {r: {} for r in range(topo.world_size)}
        for ly in range(self.L):
            G = self.global_layer(ly)
            for r in range(topo.world_size):
                if ly not in v.layers_of(r):
                    continue
                hs = v.heads_of(r)
                with stream_ctx(streams, r):
                    if streams:
                        streams[r].wait_stream(torch.cuda.default_stream(self.dev))
                    out[r][ly] = self.exec_view(G[:, :, :, hs.start:hs.stop].contiguous())
            sync(self.dev)
            del G
        return out

    def check(self, topo: Topology, layers: dict[int, dict[int, torch.Tensor]], poisoned: bool) -> bool:
        v = RankView(topo, self.L, self.H)
        for r in list(layers):
            if r >= topo.world_size and layers[r]:
                return False
        for r in range(topo.world_size):
            if sorted(layers.get(r, {})) != list(v.layers_of(r)):
                return False
        ok = True
        for ly in range(self.L):
            G = self.exec_view(self.global_layer(ly))
            for r in range(topo.world_size):
                if ly not in v.layers_of(r):
                    continue
                hs = v.heads_of(r)
                t = layers[r][ly]
                ok &= torch.equal(t[self.ids], G[self.ids, hs.start:hs.stop])
                if poisoned and self.dead.numel():
                    ok &= bool(t[self.dead].isnan().all())  # blocks without live data untouched
            del G
        return bool(ok)


def stream_ctx(streams, r):
    from contextlib import nullcontext

    return torch.cuda.stream(streams[r]) if streams else nullcontext()


class MemTrace:
    """Per-stream (= per emulated rank) allocator peaks from the caching allocator's history."""

    MARK = 4096 * 1237

    def __init__(self, dev):
        self.dev, self.ok = dev, dev.type == "cuda"

    def start(self):
        if not self.ok:
            return
        kw = dict(enabled="all", context=None, stacks="python", max_entries=500_000)
        try:
            try:
                torch.cuda.memory._record_memory_history(**kw, clear_history=True)
            except TypeError:
                torch.cuda.memory._record_memory_history(**kw)
        except Exception as exc:  # noqa: BLE001 - other signature: no per-rank numbers
            log(f"[kv] no allocator history: {exc!r}")
            self.ok = False
            return
        m = torch.empty(self.MARK, dtype=torch.uint8, device=self.dev)
        del m

    def stop(self, streams) -> list[int] | None:
        """Per stream: peak bytes allocated above both the start and the end of the leg."""
        if not self.ok:
            return None
        try:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            idx = self.dev.index if self.dev.index is not None else torch.cuda.current_device()
            trace = snap["device_traces"][idx]
            start = max((i for i, e in enumerate(trace) if e.get("action") == "alloc"
                         and self.MARK <= e.get("size", 0) < self.MARK + (2 << 20)), default=-1)
            sid = {s.cuda_stream: r for r, s in enumerate(streams)}
            cur, peak = [0] * len(streams), [0] * len(streams)
            for e in trace[start + 1:]:
                r = sid.get(e.get("stream"))
                if r is None:
                    continue
                if e["action"] == "alloc":
                    cur[r] += e["size"]
                    peak[r] = max(peak[r], cur[r])
                elif e["action"] == "free_requested":
                    cur[r] -= e["size"]
            return [p - max(0, c) for p, c in zip(peak, cur)]  # transient: over max(before, after)
        except Exception as exc:  # noqa: BLE001
            log(f"[kv] memory trace unavailable: {type(exc).__name__}: {exc}")
            self.ok = False
            return None


def migrate_leg(case: KVCase, old: Topology, new: Topology, layers, streams, *, poison: bool,
                staging_limit="auto", trace: MemTrace | None, copy: str = "memcpy",
                presync: bool = True, reference: bool = False, direct: bool = False) -> tuple[dict, dict]:
    """One migration of every rank (threads); ``reference`` runs the first executor
    (``migrate_kv_reference``: advanced-index gather, ``.contiguous()``, ``index_put`` scatter);
    ``direct`` the executor's direct path (``LocalTransport(direct=True)``: every receiver pulls
    its slices straight from the source ranks' tensors, one pass, one kernel launch per layer)."""
    a, b = RankView(old, case.L, case.H), RankView(new, case.L, case.H)
    plan = migration_plan(old, new, case.L, case.H)
    world = max(old.world_size, new.world_size)
    hub = LocalTransport(timeout_s=60.0, copy=copy, direct=direct)
    results: list = [None] * world
    errors: list = []

    def alloc_for(_layer):
        if poison:
            t = torch.full(case.shape(b.heads_per_rank), float("nan"), dtype=DTYPE, device=case.dev)
        else:
            t = torch.empty(case.shape(b.heads_per_rank), dtype=DTYPE, device=case.dev)
        return case.exec_view(t)

    host = [0.0] * world

    def work(r):
        t_cpu = time.thread_time()
        try:
            with stream_ctx(streams, r):
                if reference:
                    results[r] = migrate_kv_reference(r, layers.get(r, {}), a, b, plan, case.ids, alloc_for,
                                                      hub.endpoint(r), staging_limit_bytes=staging_limit)
                else:
                    results[r] = migrate_kv(r, layers.get(r, {}), a, b, plan, case.ids, alloc_for,
                                            hub.endpoint(r), staging_limit_bytes=staging_limit,
                                            path="direct" if direct else "staged")
        except BaseException as exc:  # noqa: BLE001
            errors.append((r, exc))
        host[r] = time.thread_time() - t_cpu

    before = [sum(nbytes(t) for t in layers.get(r, {}).values()) for r in range(world)]
    cuda = case.dev.type == "cuda"
    if presync:  # not while a reload runs on another stream (a device sync would wait for it)
        sync(case.dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(case.dev)
        base = torch.cuda.memory_allocated(case.dev)
        ms0 = torch.cuda.memory_stats(case.dev)
    if trace:
        trace.start()
    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    sync(case.dev)
    dt = time.perf_counter() - t0
    per_rank_peak = trace.stop(streams[:world]) if (trace and streams) else None
    if errors:
        raise RuntimeError(f"{old}→{new}: rank {errors[0][0]} failed: {errors[0][1]!r}") from errors[0][1]
    new_layers = {r: results[r][0] for r in range(world) if results[r][0]}
    stats = [results[r][1] for r in range(world)]
    sent = sum(s.bytes_sent for s in stats)
    local = sum(s.bytes_copied_locally for s in stats)
    kernels = sorted({getattr(s, "kernel", "") for s in stats} - {""})
    info = {"seconds": dt, "bytes_remote": sent, "bytes_local": local, "bytes_moved": sent + local,
            "GBps": (sent + local) / dt / GB,
            # HBM passes on one GPU: staged remote = gather + transport copy + scatter, staged
            # local = gather + scatter; direct = one pass (read once, write once) for every byte
            "hbm_copy_GBps": ((sent + local) if direct else (3 * sent + 2 * local)) / dt / GB,
            "kernel": ",".join(kernels) if kernels else None,
            # CPU time of the rank threads (Python + launches, one GIL): summed ≈ serialized host work
            "host_cpu_s_sum": sum(host), "host_cpu_s_max": max(host),
            # transient: the peak above the larger of this rank's KV before and after (a rank whose
            # share grows, e.g. TP1PP8 → TP1PP1, ends with more KV: that is not overhead)
            "executor_peak_extra_bytes": [
                s.peak_extra_bytes - max(0, sum(nbytes(t) for t in new_layers.get(r, {}).values()) - before[r])
                for r, s in enumerate(stats)]}
    if cuda:
        info["global_peak_extra_bytes"] = torch.cuda.max_memory_allocated(case.dev) - base
        ms1 = torch.cuda.memory_stats(case.dev)
        # the caching allocator during the leg: cudaMalloc / cudaFree calls, cache flushes (retries)
        info["allocator"] = {k: ms1.get(k, 0) - ms0.get(k, 0) for k in
                             ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}
    if per_rank_peak is not None:
        info["rank_peak_extra_bytes"] = per_rank_peak
    return new_layers, info


def kv_pair(case, A, B, streams, trace, ceil_copy, variants=("unlimited", "reference", "direct")) -> list[dict]:
    """Legs over {A, B}; returns one record per direction. The executor's default (staging limit
    ``"auto"`` = ``node_agent.kv.common.STAGING_FRACTION`` of a layer): A→B poisoned, checked and memory
    traced; B→A and A→B timed; B→A poisoned, checked, traced. ``unlimited`` (no staging limit):
    both directions poisoned/checked/traced, then both timed. ``reference`` (the first executor,
    no limit): both directions timed, the live blocks checked after. ``direct`` (the single-pass
    peer-access path): both directions poisoned/checked/traced, then both timed."""
    rec = {(A, B): {"old": str(A), "new": str(B)}, (B, A): {"old": str(B), "new": str(A)}}
    layers = case.fill(A, streams)
    layers, i1 = migrate_leg(case, A, B, layers, streams, poison=True, trace=trace)
    rec[(A, B)]["ok"] = case.check(B, layers, poisoned=True)
    layers, i2 = migrate_leg(case, B, A, layers, streams, poison=False, trace=None)
    layers, i3 = migrate_leg(case, A, B, layers, streams, poison=False, trace=None)
    layers, i4 = migrate_leg(case, B, A, layers, streams, poison=True, trace=trace)
    rec[(B, A)]["ok"] = case.check(A, layers, poisoned=True)
    extra: dict = {(A, B): {}, (B, A): {}}
    if "unlimited" in variants:
        layers, u1 = migrate_leg(case, A, B, layers, streams, poison=True, staging_limit=None, trace=trace)
        ok_ab = case.check(B, layers, poisoned=True)
        layers, u2 = migrate_leg(case, B, A, layers, streams, poison=True, staging_limit=None, trace=trace)
        ok_ba = case.check(A, layers, poisoned=True)
        layers, u3 = migrate_leg(case, A, B, layers, streams, poison=False, staging_limit=None, trace=None)
        layers, u4 = migrate_leg(case, B, A, layers, streams, poison=False, staging_limit=None, trace=None)
        for key, timed, checked, ok in (((A, B), u3, u1, ok_ab), ((B, A), u4, u2, ok_ba)):
            extra[key]["unlimited"] = {"seconds": timed["seconds"], "GBps": timed["GBps"],
                                       "hbm_copy_GBps": timed["hbm_copy_GBps"], "peak": _peaks(case, checked),
                                       "ok": ok}
            rec[key]["ok_unlimited"] = ok
    if "reference" in variants:
        layers, r1 = migrate_leg(case, A, B, layers, streams, poison=False, staging_limit=None, trace=None,
                                 reference=True)
        ok_ab = case.check(B, layers, poisoned=False)
        layers, r2 = migrate_leg(case, B, A, layers, streams, poison=False, staging_limit=None, trace=None,
                                 reference=True)
        ok_ba = case.check(A, layers, poisoned=False)
        for key, timed, ok in (((A, B), r1, ok_ab), ((B, A), r2, ok_ba)):
            extra[key]["reference"] = {"seconds": timed["seconds"], "GBps": timed["GBps"],
                                       "hbm_copy_GBps": timed["hbm_copy_GBps"], "ok": ok}
            rec[key]["ok_reference"] = ok
    if "direct" in variants:
        layers, d1 = migrate_leg(case, A, B, layers, streams, poison=True, trace=trace, direct=True)
        ok_ab = case.check(B, layers, poisoned=True)
        layers, d2 = migrate_leg(case, B, A, layers, streams, poison=True, trace=trace, direct=True)
        ok_ba = case.check(A, layers, poisoned=True)
        layers, d3 = migrate_leg(case, A, B, layers, streams, poison=False, trace=None, direct=True)
        layers, d4 = migrate_leg(case, B, A, layers, streams, poison=False, trace=None, direct=True)
        for key, timed, checked, ok in (((A, B), d3, d1, ok_ab), ((B, A), d4, d2, ok_ba)):
            extra[key]["direct"] = {"seconds": timed["seconds"], "GBps": timed["GBps"],
                                    "hbm_copy_GBps": timed["hbm_copy_GBps"], "peak": _peaks(case, checked),
                                    "host_cpu_s_sum": timed["host_cpu_s_sum"], "host_cpu_s_max": timed["host_cpu_s_max"],
                                    "allocator": timed.get("allocator"),
                                    "seconds_poisoned": checked["seconds"], "kernel": timed["kernel"], "ok": ok}
            rec[key]["ok_direct"] = ok
    legs = {(A, B): (i3, i1), (B, A): (i2, i4)}
    del layers
    out = []
    for key, (timed, checked) in legs.items():
        r = rec[key]
        r.update(seconds=timed["seconds"], bytes_moved=timed["bytes_moved"], host_cpu_s_sum=timed["host_cpu_s_sum"],
                 allocator=timed.get("allocator"),
                 bytes_remote=timed["bytes_remote"], bytes_local=timed["bytes_local"],
                 GBps=timed["GBps"], hbm_copy_GBps=timed["hbm_copy_GBps"],
                 seconds_poisoned=checked["seconds"], staging="auto")
        r["peak"] = _peaks(case, checked)
        r.update(extra[key])
        for sub in [r] + [r[k] for k in ("unlimited", "reference", "direct") if k in r]:
            if ceil_copy:
                sub["pct_of_d2d"] = 100 * sub["GBps"] / ceil_copy
                sub["hbm_pct_of_d2d"] = 100 * sub["hbm_copy_GBps"] / ceil_copy
        out.append(r)
    return out


def _peak_of(p: dict) -> float:
    """Peak extra ÷ one layer: the allocator's per-rank figure where there is one, else the executor's."""
    return p["alloc_max_rank_vs_layer"] if "alloc_max_rank_vs_layer" in p else p["executor_max_rank_vs_layer"]


def _peaks(case: KVCase, info: dict) -> dict:
    lb = case.layer_bytes
    p = {"one_layer_kv_bytes": lb,
         "executor_max_rank_bytes": max(info["executor_peak_extra_bytes"]),
         "executor_max_rank_vs_layer": max(info["executor_peak_extra_bytes"]) / lb}
    if "global_peak_extra_bytes" in info:
        p["global_bytes"] = info["global_peak_extra_bytes"]
        p["global_vs_layer"] = info["global_peak_extra_bytes"] / lb
    if "rank_peak_extra_bytes" in info:
        p["alloc_max_rank_bytes"] = max(info["rank_peak_extra_bytes"])
        p["alloc_max_rank_vs_layer"] = max(info["rank_peak_extra_bytes"]) / lb
    return p


def bench_kv(models, dev, args, budget, report, ceil_copy, streams):
    names = list(models)
    plan = []
    for spec in args.kv_plan.split(","):
        mi, tokens, which = spec.split(":")
        plan.append((names[int(mi)], int(tokens), which))
    trace = MemTrace(dev)
    runs = report.setdefault("kv", {"runs": []})["runs"]
    for name, tokens, which in plan:
        topos = TOPOS if which == "all" else X8
        case = KVCase(models[name], tokens, dev)
        chunk = int(case.layer_bytes * kvc.STAGING_FRACTION)
        variants = tuple(v for v in args.kv_variants.split(",") if v)
        rows, skipped = [], []
        log(f"[kv {name} {tokens} tokens, {which}] one layer {case.layer_bytes / GB:.3f} GB, "
            f"all layers {case.layer_bytes * case.L / GB:.1f} GB, default staging limit {chunk / GB:.3f} GB")
        errors = []
        for A, B in itertools.combinations(topos, 2):
            if budget.left() < args.reserve_s:
                skipped.append(f"{A}<->{B}")
                continue
            try:
                pair_rows = kv_pair(case, A, B, streams, trace, ceil_copy, variants)
            except Exception as exc:  # noqa: BLE001 - recorded as a failure, the sweep goes on
                errors.append({"pair": f"{A}<->{B}", "error": f"{type(exc).__name__}: {exc}"})
                log(f"  {A}<->{B} FAILED: {exc!r}")
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            for r in pair_rows:
                rows.append(r)
                pk = r["peak"]
                un, ref, di = r.get("unlimited", {}), r.get("reference", {}), r.get("direct", {})
                log(f"  {r['old']:>7}→{r['new']:<7} {r['bytes_moved'] / GB:7.2f} GB"
                    f" direct {di.get('seconds', float('nan')) * 1e3:7.1f} ms {di.get('GBps', float('nan')):7.1f} GB/s"
                    f" ({di.get('pct_of_d2d', float('nan')):4.1f}% d2d) peak {_peak_of(di['peak']) if di else float('nan'):.2f}"
                    f" [{di.get('kernel')}, host {di.get('host_cpu_s_sum', float('nan')) * 1e3:.0f} ms,"
                    f" alloc {(di.get('allocator') or {}).get('num_device_alloc')}/{(di.get('allocator') or {}).get('num_alloc_retries')}]; staged {r['seconds'] * 1e3:7.1f} ms {r['GBps']:6.1f} GB/s"
                    f" ({r.get('pct_of_d2d', 0):4.1f}%) peak {_peak_of(pk):.2f};"
                    f" unlimited {un.get('GBps', float('nan')):6.1f}; reference {ref.get('GBps', float('nan')):6.1f} GB/s"
                    f" ok={r['ok']}/{r.get('ok_unlimited')}/{r.get('ok_reference')}/{r.get('ok_direct')}")
        runs.append({"model": name, "tokens": tokens, "pairs": which, "num_blocks": case.NB, "layers": case.L,
                     "live_blocks": int(case.ids.numel()), "block_size": BLOCK_SIZE,
                     "one_layer_kv_bytes": case.layer_bytes, "all_layers_kv_bytes": case.layer_bytes * case.L,
                     "staging_fraction": kvc.STAGING_FRACTION, "staging_limit_bytes": chunk,
                     "run_copy_max_runs": kvc.RUN_COPY_MAX_RUNS, "runs_of_consecutive_ids": len(kvc.run_starts(case.ids.cpu())) + 1,
                     "variants": list(variants), "rows": rows, "skipped": skipped, "errors": errors})
        if skipped:
            runs[-1]["skipped_reason"] = "time budget"
            log(f"  skipped {len(skipped)} pairs (time budget)")
        del case
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def direct_selfcheck(dev: torch.device, streams, small: bool = False) -> dict:
    """The direct path on this device with small shapes (head size 128, bf16): every ordered pair
    of the world-4 and world-8 sets and two across world sizes, vLLM's GPU (flash) layout and the
    block-first layout, block ids in odd runs / scrambled / all, each both to the same ids and
    compacted into a smaller destination pool (``dst_block_ids``); destinations NaN-poisoned, every
    element compared bit for bit, free blocks checked untouched, and which copy ran recorded."""
    import random

    Lc, Hc, NBc, BSc, Dc = (8, 8, 12, 2, 8) if small else (8, 8, 40, 16, 128)
    w4, w8 = [Topology(1, 4), Topology(2, 2), Topology(4, 1)], X8
    pairs = list(itertools.permutations(w4, 2)) + list(itertools.permutations(w8, 2)) + [
        (Topology(1, 1), Topology(8, 1)), (Topology(8, 1), Topology(1, 1))]
    rng = random.Random(3)
    odd = sorted(rng.sample(range(NBc), NBc // 2 + 3))
    id_sets = {"odd_runs": odd, "scrambled": rng.sample(range(NBc), NBc // 3), "all": list(range(NBc))}
    if small:  # the CPU check of this script: a few of each
        pairs, id_sets = pairs[:2] + pairs[6:8] + pairs[-1:], {k: id_sets[k] for k in ("odd_runs", "scrambled")}

    def to_layout(x, layout):  # x: [nb, h, BS, 2D] block-first
        if layout == "flash":
            nb, h = x.shape[0], x.shape[1]
            return x.reshape(nb, h, BSc, 2, Dc).permute(3, 0, 2, 1, 4).contiguous().permute(1, 3, 0, 2, 4)
        return x.contiguous()

    def poisoned(layout, heads, nb):
        if layout == "flash":
            return torch.full((2, nb, BSc, heads, Dc), float("nan"), dtype=DTYPE, device=dev).permute(1, 3, 0, 2, 4)
        return torch.full((nb, heads, BSc, 2 * Dc), float("nan"), dtype=DTYPE, device=dev)

    G = torch.randint(-2**15, 2**15, (Lc, NBc, Hc, BSc, 2 * Dc), dtype=torch.int16, device=dev).view(DTYPE)
    res = {"cases": 0, "failures": [], "kernels": set()}
    t0 = time.perf_counter()
    for (old, new), layout, (iname, ids) in itertools.product(pairs, ("flash", "block"), id_sets.items()):
        for compact in (False, True):
            new_nb = len(ids) + 3 if compact else NBc
            dst = rng.sample(range(new_nb), len(ids)) if compact else list(ids)
            a, b = RankView(old, Lc, Hc), RankView(new, Lc, Hc)
            plan = migration_plan(old, new, Lc, Hc)
            world = max(old.world_size, new.world_size)
            hub = LocalTransport(timeout_s=60.0, direct=True)
            layers = {r: {} for r in range(world)}
            for r in range(old.world_size):
                hs = a.heads_of(r)
                with stream_ctx(streams, r):
                    streams[r].wait_stream(torch.cuda.default_stream(dev)) if streams else None
                    layers[r] = {ly: to_layout(G[ly][:, hs.start:hs.stop], layout) for ly in a.layers_of(r)}
            sync(dev)
            out, errs = [None] * world, []

            def work(r):
                try:
                    with stream_ctx(streams, r):
                        out[r] = migrate_kv(r, layers[r], a, b, plan, torch.tensor(ids, device=dev),
                                            lambda _ly: poisoned(layout, b.heads_per_rank, new_nb), hub.endpoint(r),
                                            dst_block_ids=torch.tensor(dst, device=dev) if compact else None,
                                            path="direct")
                except BaseException as exc:  # noqa: BLE001
                    errs.append(exc)

            ths = [threading.Thread(target=work, args=(r,)) for r in range(world)]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            sync(dev)
            ok = not errs and not hub._shared
            if ok:
                dead = torch.ones(new_nb, dtype=torch.bool, device=dev)
                dead[torch.tensor(dst, device=dev)] = False
                for r in range(new.world_size):
                    hs = b.heads_of(r)
                    res["kernels"].add(out[r][1].kernel)
                    for ly in b.layers_of(r):
                        t = out[r][0][ly]
                        want = to_layout(G[ly][:, hs.start:hs.stop], layout)
                        ok &= torch.equal(t[torch.tensor(dst, device=dev)].contiguous().view(torch.int16),
                                          want[torch.tensor(ids, device=dev)].contiguous().view(torch.int16))
                        ok &= bool(t[dead].isnan().all())
            res["cases"] += 1
            if not ok:
                res["failures"].append(f"{old}→{new} {layout} {iname} compact={compact}: {errs[:1]!r}")
    res["kernels"] = sorted(res["kernels"])
    res["seconds"] = time.perf_counter() - t0
    res["ok"] = not res["failures"]
    log(f"[kv selfcheck] direct path: {res['cases']} migrations, kernels {res['kernels']}, "
        f"{len(res['failures'])} failures, {res['seconds']:.1f} s" + (f": {res['failures'][:3]}" if res["failures"] else ""))
    return res


def bench_host_cost(cfg, dev, args, streams) -> dict:
    """Where the direct path's host time goes, without rank threads competing for the GIL: CPU
    microseconds per call of the pieces one (rank, layer) step runs, with the GPU kept busy so the
    calls never wait for it; then one rank's whole direct migration (TP1PP1 → TP1PP1: every slice
    local, 1 thread) and a profile of one rank thread inside an 8-rank leg (TP1PP8 → TP8PP1)."""
    import cProfile
    import io
    import pstats

    case = KVCase(cfg, args.small_tokens if args.small else 10000, dev)
    H = case.H
    idmap = kvc.IdMap(case.ids, None)
    src = case.exec_view(torch.randn(case.shape(H), device=dev, dtype=DTYPE))
    dst = case.exec_view(torch.empty(case.shape(H // 8), device=dev, dtype=DTYPE))
    out: dict = {"tokens": case.tokens, "per_call_us": {}}
    busy = torch.empty(1 << 28, dtype=torch.uint8, device=dev)

    def per_call(name, fn, n=300):
        for _ in range(5):
            fn()
        sync(dev)
        if dev.type == "cuda":  # keep the GPU busy: the calls below only enqueue
            for _ in range(40):
                busy.add_(1)
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        us = (time.thread_time() - t0) / n * 1e6
        sync(dev)
        out["per_call_us"][name] = us
        log(f"[host cost] {name:<60} {us:8.1f} µs per call")

    per_call("direct pull of one layer slice (kv_migration._pull)", lambda: kvd._pull([(src, 0, 0, H // 8)], dst, idmap))
    if dev.type == "cuda" and kvd._PLANS:
        plan = list(kvd._PLANS.values())[-1]
        sids, dids = idmap.on(dev)
        kernel = kvd._TRITON[1]
        per_call("  of which the Triton launch alone", lambda: kernel[(idmap.n, 1)](
            dst, *([src] * 8), plan.tab, plan.roff_s, plan.roff_d, sids, dids, **plan.meta))
        ev = torch.cuda.Event()
        per_call("torch.cuda.Event() + record", lambda: torch.cuda.Event().record())
        ev.record()
        per_call("stream.wait_event", lambda: torch.cuda.current_stream().wait_event(ev))
    per_call("new layer: torch.empty + permute (the bench's alloc)", lambda: case.exec_view(
        torch.empty(case.shape(H // 8), device=dev, dtype=DTYPE)))
    del busy
    # one rank alone: every slice local
    a = RankView(Topology(1, 1), case.L, H)
    plan1 = migration_plan(Topology(1, 1), Topology(1, 1), case.L, H)
    layers = {ly: case.exec_view(torch.randn(case.shape(H), device=dev, dtype=DTYPE)) for ly in range(case.L)}
    for rep in range(2):
        hub = LocalTransport(direct=True)
        sync(dev)
        t0, c0 = time.perf_counter(), time.thread_time()
        new, st = migrate_kv(0, layers, a, a, plan1, case.ids,
                             lambda _ly: case.exec_view(torch.empty(case.shape(H), device=dev, dtype=DTYPE)),
                             hub.endpoint(0), path="direct")
        c1 = time.thread_time()
        sync(dev)
        layers = new
    out["one_rank_migration"] = {"layers": case.L, "wall_ms": (time.perf_counter() - t0) * 1e3,
                                 "host_cpu_ms": (c1 - c0) * 1e3, "host_cpu_us_per_layer": (c1 - c0) / case.L * 1e6,
                                 "bytes": st.bytes_copied_locally}
    log(f"[host cost] one rank, {case.L} layers, direct, alone: {out['one_rank_migration']}")
    del layers, new
    gc.collect()
    # one rank thread profiled inside an 8-rank leg
    A, B = Topology(1, 8), Topology(8, 1)
    lay = case.fill(A, streams)
    lay, _ = migrate_leg(case, A, B, lay, streams, poison=False, trace=None, direct=True)
    lay, _ = migrate_leg(case, B, A, lay, streams, poison=False, trace=None, direct=True)
    prof = cProfile.Profile()
    orig = kvd.migrate_direct

    def profiled(rank, *a, **k):
        if rank != 3:
            return orig(rank, *a, **k)
        prof.enable()
        try:
            return orig(rank, *a, **k)
        finally:
            prof.disable()
    kvd.migrate_direct = profiled
    try:
        lay, info = migrate_leg(case, A, B, lay, streams, poison=False, trace=None, direct=True)
    finally:
        kvd.migrate_direct = orig
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    out["profile_rank3_of_8"] = {"leg_ms": info["seconds"] * 1e3, "host_cpu_ms_sum": info["host_cpu_s_sum"] * 1e3,
                                 "top": buf.getvalue()[-4000:]}
    log(f"[host cost] TP1PP8→TP8PP1 leg {info['seconds'] * 1e3:.1f} ms; rank 3's profile:\n{buf.getvalue()[-2500:]}")
    del lay
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_kv_ops(cfg, dev, args) -> dict:
    """The executors' gather/scatter ops on one 13B-shaped layer (vLLM flash layout), each timed
    alone, against a plain copy of the same bytes: the first executor's (advanced indexing on the
    permuted view, ``.contiguous()``, ``index_put``) and this executor's (``_SliceView``: one
    ``index_select`` / ``index_copy_`` on the memory-order view as 16- or 8-byte elements, or one
    strided copy per run of consecutive ids)."""
    case = KVCase(cfg, args.ops_tokens if not args.small else args.small_tokens, dev)
    H, ids = case.H, case.ids
    ids_host = ids.cpu()
    starts = kvc.run_starts(ids_host)
    runs = kvc.Runs(ids_host.tolist(), starts, 0, ids.numel())
    base = torch.randn(case.shape(H), device=dev, dtype=DTYPE)      # [2, NB, BS, H, D] storage
    ex = case.exec_view(base)                                          # [NB, H, 2, BS, D] executor view
    out: dict = {"model_layer": f"{cfg['num_key_value_heads']} KV heads × {case.NB} blocks × {BLOCK_SIZE}",
                 "live_blocks": int(ids.numel()), "runs": runs.count, "ops": []}
    reps = 5

    def rec(name, fn, nbytes_moved, note=""):
        t = median_time(fn, dev, reps)
        out["ops"].append({"op": name, "bytes": nbytes_moved, "ms": t * 1e3, "GBps": nbytes_moved / t / GB,
                           "note": note})
        log(f"[kv ops] {name:<58} {nbytes_moved / GB:6.2f} GB {t * 1e3:8.2f} ms {nbytes_moved / t / GB:8.1f} GB/s")

    perm = kvc.memory_order(ex)
    for h in (H, H // 2, H // 8):
        part = ex[ids, 0:h]
        nb = nbytes(part)
        rec(f"reference gather old_t[ids, 0:{h}]", lambda h=h: ex[ids, 0:h], nb, "advanced index on the permuted view")
        rec(f"reference gather + .contiguous() (send), {h} heads", lambda h=h: ex[ids, 0:h].contiguous(), nb)
        newb = torch.empty(case.shape(h), device=dev, dtype=DTYPE)
        nex = case.exec_view(newb)

        def scatter(nex=nex, part=part, h=h):
            nex[ids, 0:h] = part
        rec(f"reference scatter new_t[ids, 0:{h}] = buf", scatter, nb, "index_put on the permuted view")
        flat = torch.empty(nb, dtype=torch.uint8, device=dev)
        src_flat = torch.randn(nb // 2, device=dev, dtype=DTYPE).view(torch.uint8)
        rec(f"plain contiguous copy, same bytes ({h} heads)", lambda flat=flat, s=src_flat: flat.copy_(s), nb)
        nperm = kvc.memory_order(nex)
        for wide in (16, 8):
            kvc._MAX_WIDE_BYTES = wide
            try:
                sv = kvc.SliceView(ex, perm, 0, h)
                dv = kvc.SliceView(nex, nperm, 0, h)
            finally:
                kvc._MAX_WIDE_BYTES = 16
            buf = flat.view(sv.m.dtype).view(sv.buffer_shape(ids.numel()))
            dbuf = flat.view(dv.m.dtype).view(dv.buffer_shape(ids.numel()))
            rec(f"new gather index_select, {sv.m.element_size()}-byte elements, {h} heads",
                lambda sv=sv, buf=buf: torch.index_select(sv.m, sv.pb, ids, out=buf), nb,
                f"memory-order view {tuple(sv.m.shape)} {sv.m.dtype}")
            rec(f"new scatter index_copy_, {dv.m.element_size()}-byte elements, {h} heads",
                lambda dv=dv, dbuf=dbuf: dv.m.index_copy_(dv.pb, ids, dbuf), nb)
            idx = (slice(None),) * dv.pb + (ids,)

            def put(dv=dv, dbuf=dbuf, idx=idx):
                dv.m[idx] = dbuf
            rec(f"new scatter index_put_, {dv.m.element_size()}-byte elements, {h} heads", put, nb)
        kvc._MAX_WIDE_BYTES = 16
        sv = kvc.SliceView(ex, perm, 0, h)
        buf = flat.view(sv.m.dtype).view(sv.buffer_shape(ids.numel()))
        rec(f"new gather, one strided copy per run ({runs.count} runs), {h} heads",
            lambda sv=sv, buf=buf: [buf.narrow(sv.pb, o, n).copy_(sv.m.narrow(sv.pb, b0, n))
                                    for o, b0, n in runs.list()], nb, "launch-bound when runs are short")
        del part, newb, nex, flat, src_flat, buf, dbuf, sv, dv
    out["direct"] = direct_ops(case, ex, rec, dev)
    del base, ex
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def direct_ops(case: KVCase, ex: torch.Tensor, rec, dev) -> dict:
    """The direct path's pull (``node_agent.kv.executor_direct._pull``: one launch per receiving rank and layer)
    on one layer, timed alone: a receiver of h heads pulling them from one full-layer source, and a
    TP1 receiver pulling all heads from 8 TP8 sources in one launch; each checked bit for bit."""
    H, ids = case.H, case.ids
    idmap = kvc.IdMap(ids, None)
    res: dict = {"kernel": None, "ok": True}
    for h in (H, H // 8):
        t = torch.full(case.shape(h), float("nan"), device=dev, dtype=DTYPE)
        nex = case.exec_view(t)
        res["kernel"], _ = kvd._pull([(ex, 0, 0, h)], nex, idmap)
        res["ok"] &= torch.equal(nex[ids].view(torch.int16), ex[ids, 0:h].view(torch.int16))
        nb = nbytes(nex[ids])
        rec(f"direct pull ({res['kernel']}), 1 source → {h} heads, one launch",
            lambda nex=nex, h=h: kvd._pull([(ex, 0, 0, h)], nex, idmap), nb, "single pass: read once, write once")
        plan = list(kvd._PLANS.values())[-1] if res["kernel"] == "triton" and kvd._PLANS else None
        if plan:  # the tile and warps the executor chose, against a few others (same kernel)
            chosen = dict(plan.meta)
            res.setdefault("tiles", {})[h] = {"chosen": chosen, "variants": []}
            for rb, cb, nw in ((8, 128, 4), (32, 128, 8), (32, 256, 8), (64, 256, 8), (16, 512, 4)):
                plan.meta = dict(chosen, RB=rb, CB=cb, num_warps=nw)
                t.fill_(float("nan"))
                kvd._pull([(ex, 0, 0, h)], nex, idmap)
                good = torch.equal(nex[ids].view(torch.int16), ex[ids, 0:h].view(torch.int16))
                res["ok"] &= good
                ms = median_time(lambda nex=nex, h=h: kvd._pull([(ex, 0, 0, h)], nex, idmap), dev, 5) * 1e3
                res["tiles"][h]["variants"].append({"RB": rb, "CB": cb, "num_warps": nw, "ms": ms,
                                                    "GBps": nb / ms / 1e6, "ok": good})
                log(f"[kv ops]   tile {rb}x{cb}, {nw} warps: {ms:.3f} ms {nb / ms / 1e6:.0f} GB/s ok={good}")
            plan.meta = chosen
        del t, nex
    hs = H // 8
    srcs = [case.exec_view(ex[:, k * hs:(k + 1) * hs].permute(2, 0, 3, 1, 4).contiguous()) for k in range(8)]
    t = torch.full(case.shape(H), float("nan"), device=dev, dtype=DTYPE)
    nex = case.exec_view(t)
    work = [(srcs[k], 0, k * hs, hs) for k in range(8)]
    kvd._pull(work, nex, idmap)
    res["ok"] &= torch.equal(nex[ids].view(torch.int16), ex[ids].view(torch.int16))
    rec(f"direct pull ({res['kernel']}), 8 sources × {hs} heads → {H} heads, one launch",
        lambda: kvd._pull(work, nex, idmap), nbytes(nex[ids]), "TP8 → TP1 layer")
    del srcs, t, nex, work
    if not res["ok"]:
        log("[kv ops] direct pull: WRONG RESULT")
    return res


# --------------------------------------------------------------------------- 4. overlap


def bench_overlap(name, cfg, mapped, dev, args, report, streams):
    A, B = Topology(2, 4), Topology(4, 2)
    case = KVCase(cfg, args.overlap_tokens, dev)
    reload_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    loader = ShardLoader(mapped, dev, stream=reload_stream)
    shards = []
    for rank in range(B.world_size):
        shapes, pieces = llama_shard_pieces(cfg, B.tp, B.pp, rank)
        arena, params = alloc_params(shapes, dev)
        shards.append((pieces, params, arena))

    def reload_all():
        n = 0
        for pieces, params, _ in shards:
            n += loader.load(pieces, params)
        if reload_stream is not None:
            reload_stream.synchronize()
        return n

    layers = case.fill(A, streams)
    sync(dev)
    t = time.perf_counter()
    layers, mig = migrate_leg(case, A, B, layers, streams, poison=False, trace=None)
    t_mig = time.perf_counter() - t
    t = time.perf_counter()
    n_reload = reload_all()
    sync(dev)
    t_rel = time.perf_counter() - t
    seq = t_mig + t_rel
    ok = True
    variants = {}

    def variant(how: str, copy: str):
        nonlocal layers, ok
        layers, _ = migrate_leg(case, B, A, layers, streams, poison=False, trace=None)
        for _, _, arena in shards:
            arena.fill_(float("nan"))
        sync(dev)
        box: dict = {}
        t0 = time.perf_counter()
        if how == "threads":  # reload in its own thread, as the worker does
            def rel_thread():
                reload_all()
                box["reload_s"] = time.perf_counter() - t0

            th = threading.Thread(target=rel_thread)
            th.start()
            layers, m = migrate_leg(case, A, B, layers, streams, poison=False,
                                    trace=None, copy=copy, presync=False)
            th.join()
        else:  # every reload DMA issued first (asynchronous), then the migration
            for pieces, params, _ in shards:
                loader.load(pieces, params)
            box["issue_s"] = time.perf_counter() - t0
            layers, m = migrate_leg(case, A, B, layers, streams, poison=False,
                                    trace=None, copy=copy, presync=False)
            if reload_stream is not None:
                reload_stream.synchronize()
        sync(dev)
        t_par = time.perf_counter() - t0
        good = case.check(B, layers, poisoned=False) and all(
            not bool(arena.isnan().any()) for _, _, arena in shards)
        ok = ok and good
        v = {"overlapped_s": t_par, "migrate_s": m["seconds"], "saving_s": seq - t_par,
             "saving_pct": 100 * (seq - t_par) / seq,
             "hidden_fraction_of_shorter": (seq - t_par) / min(t_mig, t_rel), "ok": good, **box}
        variants[f"{how}/{copy}"] = v
        log(f"[overlap {how}, transport {copy}] {t_par * 1e3:.0f} ms (sequential {seq * 1e3:.0f} ms): saves "
            f"{v['saving_pct']:.0f} %, {100 * v['hidden_fraction_of_shorter']:.0f} % of the shorter hidden, ok={good}")

    for how, copy in (("threads", "memcpy"), ("issue_first", "memcpy"), ("threads", "kernel"),
                      ("issue_first", "kernel")):
        variant(how, copy)
    main = variants["threads/memcpy"]
    res = {"model": name, "pair": f"{A}→{B}", "tokens": case.tokens, "kv_bytes_moved": mig["bytes_moved"],
           "reload_bytes": n_reload, "migrate_s": t_mig, "reload_s": t_rel, "sequential_s": seq,
           "overlapped_s": main["overlapped_s"], "saving_s": main["saving_s"], "saving_pct": main["saving_pct"],
           "ideal_saving_s": min(t_mig, t_rel), "hidden_fraction_of_shorter": main["hidden_fraction_of_shorter"],
           "best_hidden_fraction_of_shorter": max(v["hidden_fraction_of_shorter"] for v in variants.values()),
           "variants": variants, "ok": bool(ok)}
    report["overlap"] = res
    log(f"[overlap {name} {A}→{B} {case.tokens} tok] migrate {t_mig * 1e3:.0f} ms + reload {t_rel * 1e3:.0f} ms"
        f" = {seq * 1e3:.0f} ms sequential; overlapped (threads, memcpy transport) {res['overlapped_s'] * 1e3:.0f} ms"
        f" ok={res['ok']}")
    del layers, shards, case
    gc.collect()


# --------------------------------------------------------------------------- 5. prediction


def per_rank_kv_bytes(cfg, tokens, old: Topology, new: Topology) -> list[dict]:
    L, H = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // cfg["num_attention_heads"]
    live = -(-tokens // BLOCK_SIZE)
    per_head = 2 * live * BLOCK_SIZE * D * 2  # K and V of one head, one layer, live blocks
    world = max(old.world_size, new.world_size)
    out = [{"send": 0, "recv": 0, "local": 0} for _ in range(world)]
    for s in migration_plan(old, new, L, H):
        b = s.heads * per_head
        if s.local:
            out[s.src]["local"] += b
        else:
            out[s.src]["send"] += b
            out[s.dst]["recv"] += b
    return out


def predict(report, args) -> dict:
    """Data-path time on an 8-GPU host (one rank per GPU, ranks in parallel): measured rates from
    this run where they exist, assumed link bandwidths (ASSUMED) for what one GPU cannot show."""
    models = MODELS
    ceil = report.get("ceilings", {})
    pinned = ceil.get("h2d_pinned_GBps")
    kv_runs = report.get("kv", {}).get("runs", [])
    hbm_rates = [r["hbm_copy_GBps"] for run in kv_runs for r in run["rows"] if run["tokens"] >= 50000]
    hbm_rate = statistics.median(hbm_rates) if hbm_rates else None
    d_rates = [r["direct"]["GBps"] for run in kv_runs for r in run["rows"] if run["tokens"] >= 50000 and "direct" in r]
    d_rate = statistics.median(d_rates) if d_rates else None
    ov = report.get("overlap", {})
    hidden = min(1.0, max(0.0, ov.get("hidden_fraction_of_shorter", 0.0))) if ov else 0.0
    out = {"assumed": dict(ASSUMED), "measured_inputs": {
        "kv_gather_scatter_hbm_copy_GBps": hbm_rate, "kv_direct_GBps": d_rate, "h2d_pinned_GBps": pinned,
        "overlap_hidden_fraction": hidden}, "rows": []}
    nv = ASSUMED["nvlink_GBps_per_dir"] * ASSUMED["nvlink_efficiency"]
    for name, cfg in models.items():
        rel = report.get("reload", {}).get(name, {}).get("modes", {})
        mode = "direct" if "direct" in rel else "staged"
        eff = {r["topology"]: r["GBps"] / pinned for r in rel.get(mode, {}).get("topologies", [])} if pinned else {}
        for tokens in (10000, 100000):
            for A, B in itertools.permutations(X8, 2):
                ranks = per_rank_kv_bytes(cfg, tokens, A, B)
                t_kv = None
                if hbm_rate:
                    t_kv = max((r["send"] + r["recv"] + 2 * r["local"]) / (hbm_rate * GB)
                               + max(r["send"], r["recv"]) / (nv * GB) for r in ranks)
                t_kvd = None
                if d_rate:  # direct: one pass; a GPU's HBM serves its sent bytes' reads, its received
                    # bytes' writes and its local copies (d_rate = bytes copied/s, a read plus a write each)
                    t_kvd = max(max(max(r["send"], r["recv"]) / (nv * GB),
                                    (0.5 * (r["send"] + r["recv"]) + r["local"]) / (d_rate * GB)) for r in ranks)
                shard = max(sum(math.prod(s) * 2 for s in llama_shard_pieces(cfg, B.tp, B.pp, r)[0].values())
                            for r in range(B.world_size))
                e = eff.get(str(B))
                t_rel = shard / (ASSUMED["pcie_GBps_per_gpu"] * e * GB) if e else None
                t_dp = None
                if t_kv is not None and t_rel is not None:
                    t_dp = max(t_kv, t_rel) + (1 - hidden) * min(t_kv, t_rel)
                t_dpd = None
                if t_kvd is not None and t_rel is not None:
                    t_dpd = max(t_kvd, t_rel) + (1 - hidden) * min(t_kvd, t_rel)
                out["rows"].append({"model": name, "tokens": tokens, "pair": f"{A}→{B}",
                                    "kv_s": t_kv, "reload_s": t_rel, "data_path_s": t_dp,
                                    "kv_direct_s": t_kvd, "data_path_direct_s": t_dpd,
                                    "max_rank_shard_bytes": shard,
                                    "max_rank_kv_send_bytes": max(r["send"] for r in ranks),
                                    "reload_efficiency": e})
    return out


# --------------------------------------------------------------------------- report


def targets(report) -> dict:
    ceil = report.get("ceilings", {})
    t: dict = {}
    pinned = ceil.get("h2d_pinned_GBps")
    if pinned:
        for name, r in report.get("reload", {}).items():
            for mode, m in r.get("modes", {}).items():
                rows = m["topologies"]
                if rows:
                    pct = [100 * x["GBps"] / pinned for x in rows]
                    t[f"reload_{name}_{mode}_pct_of_pinned"] = {"min": min(pct), "median": statistics.median(pct),
                                                                "max": max(pct), "target": 80}
    t.update(kv_targets(report.get("kv", {})))
    return t


def _rows_of(kv: dict) -> list[dict]:
    return [r for run in kv.get("runs", []) for r in run["rows"]]


def kv_targets(kv: dict) -> dict:
    """KV figures against the targets (≥ 70 % of the d2d copy ceiling; peak extra ≤ one layer +
    10 %). Reads this executor's rows (default = staging limit ``auto``; ``unlimited``;
    ``reference``) and the first run's schema (default = no limit; ``chunked``) alike."""
    t: dict = {}
    kv_rows = _rows_of(kv)
    if not kv_rows or "pct_of_d2d" not in kv_rows[0]:
        return t
    big = [r for run in kv["runs"] if run["tokens"] >= 50000 for r in run["rows"]] or kv_rows
    t["kv_pct_of_d2d"] = {"median_all": statistics.median(r["pct_of_d2d"] for r in kv_rows),
                          "median_ge_50k_tokens": statistics.median(r["pct_of_d2d"] for r in big),
                          "max": max(r["pct_of_d2d"] for r in kv_rows), "target": 70}
    t["kv_hbm_pct_of_d2d"] = {"median_ge_50k_tokens": statistics.median(r["hbm_pct_of_d2d"] for r in big),
                              "max": max(r["hbm_pct_of_d2d"] for r in kv_rows)}
    for var in ("unlimited", "reference"):
        sub = [r[var] for r in big if var in r and "pct_of_d2d" in r[var]]
        if sub:
            t[f"kv_{var}_pct_of_d2d"] = {"median_ge_50k_tokens": statistics.median(x["pct_of_d2d"] for x in sub),
                                         "hbm_median_ge_50k_tokens": statistics.median(x["hbm_pct_of_d2d"] for x in sub)}
    dr = [(run, r["direct"]) for run in kv["runs"] for r in run["rows"] if "pct_of_d2d" in r.get("direct", {})]
    if dr:
        per = {}
        for run, x in dr:
            per.setdefault(f"{run['model']}_{run['tokens']}_{run['pairs']}", []).append(x["pct_of_d2d"])
        t["kv_direct_pct_of_d2d"] = {
            "median_ge_50k_tokens": statistics.median([x["pct_of_d2d"] for run, x in dr if run["tokens"] >= 50000]
                                                      or [x["pct_of_d2d"] for _, x in dr]),
            "min": min(x["pct_of_d2d"] for _, x in dr), "max": max(x["pct_of_d2d"] for _, x in dr),
            **{f"median_{k}": statistics.median(v) for k, v in per.items()}, "target": 70}
        dp = [_peak_of(x["peak"]) for _, x in dr if "peak" in x]
        if dp:
            t["peak_extra_direct_vs_one_layer"] = {"max": max(dp), "target": 1.10,
                                                   "pairs_within": sum(x <= 1.10 for x in dp), "pairs": len(dp)}
    alt = "unlimited" if any("unlimited" in r for r in kv_rows) else "chunked"
    for key, label in (("alloc_max_rank_vs_layer", "per_rank_allocator"),
                       ("executor_max_rank_vs_layer", "per_rank_executor")):
        d = [r["peak"][key] for r in kv_rows if key in r["peak"]]
        c = [r[alt]["peak"][key] for r in kv_rows if alt in r and key in r[alt].get("peak", {})]
        if d:
            t[f"peak_extra_{label}_vs_one_layer"] = {
                "default_max": max(d), f"{alt}_max": max(c) if c else None, "target": 1.10,
                "default_pairs_within": sum(x <= 1.10 for x in d), "pairs": len(d),
                f"{alt}_pairs_within": sum(x <= 1.10 for x in c) if c else None}
    return t


_OK_KEYS = ("ok_unlimited", "ok_reference", "ok_chunked", "ok_direct")


def correctness(report) -> dict:
    rel = [(n, m, r["topology"], r["ok"]) for n, x in report.get("reload", {}).items()
           for m, mm in x.get("modes", {}).items() for r in mm["topologies"]]
    kv = [r for run in report.get("kv", {}).get("runs", []) for r in run["rows"]]
    ok_kv = all(r["ok"] and all(r.get(k, True) for k in _OK_KEYS) for r in kv) and not any(
        run.get("errors") for run in report.get("kv", {}).get("runs", []))
    ok_kv = ok_kv and "error" not in report.get("kv", {})
    ov = report.get("overlap", {}).get("ok", True)
    rel_err = any("error" in x for x in report.get("reload", {}).values())
    base = all(x.get("baseline_remp_shm", {}).get("ok", True) for x in report.get("reload", {}).values())
    base = base and not rel_err
    ops = report.get("kv_ops", {}).get("direct", {}).get("ok", True)
    ops = ops and report.get("kv_selfcheck", {}).get("ok", True)
    return {"reload_checks": len(rel), "reload_all_ok": all(x[3] for x in rel) and base,
            "kv_directions_checked": len(kv), "kv_checks": sum(1 + sum(k in r for k in _OK_KEYS) for r in kv),
            "kv_all_ok": ok_kv, "overlap_ok": ov, "kv_ops_direct_ok": ops,
            "kv_selfcheck_cases": report.get("kv_selfcheck", {}).get("cases", 0),
            "all_ok": all(x[3] for x in rel) and base and ok_kv and ov and ops}


def fmt(x, f="{:.1f}"):
    return "–" if x is None else f.format(x)


def markdown(report) -> str:
    c = report.get("ceilings", {})
    L = [f"# GPU data path on {report['device']['name']} ({report['date']})", "",
         f"torch {report['torch']}, CUDA {report['cuda']}, driver {report['device'].get('driver', '?')}, "
         f"PCIe {report['device'].get('pcie', '?')}. Produced by `bench/gpu_datapath.py` in "
         f"{len(report.get('runs', [])) or 'one'} run{'s' if len(report.get('runs', [])) > 1 else ''} "
         f"({report['wall_seconds']:.0f} s of script time). Correctness: **{'all checks passed' if report['correctness']['all_ok'] else 'FAILURES'}** "
         f"({report['correctness']['reload_checks']} shard loads, {report['correctness']['kv_checks']} migrations checked "
         "element by element against the source, destinations poisoned with NaN first).", "",
         "## Ceilings (measured)", "", "| copy | GB/s |", "| --- | ---: |"]
    if report.get("runs"):
        L[3:3] = ["Merged from " + "; ".join(f"{r['file']} ({r['date']}: {', '.join(r['sections'])})"
                                            for r in report["runs"]) + ". Ceilings below from the first.", ""]
    for k, label in (("h2d_pinned_GBps", "host→device, pinned"), ("h2d_pageable_GBps", "host→device, pageable"),
                     ("d2h_pinned_GBps", "device→host, pinned"), ("d2d_copy_GBps", "device→device, bytes copied/s"),
                     ("d2d_read_plus_write_GBps", "device→device, read + write")):
        if k in c:
            L.append(f"| {label} | {c[k]:.1f} |")
    L += ["", "KV percentages below are of the device→device *bytes copied/s* figure (a copy reads and "
          "writes each byte once); reload percentages are of pinned host→device.", ""]
    pinned = c.get("h2d_pinned_GBps")
    for name, r in report.get("reload", {}).items():
        if "checkpoint_bytes" not in r:
            L += [f"## Shard reload: {name}", "", f"Failed: {r.get('error')}", ""]
            continue
        if r.get("error"):
            L += [f"Shard reload {name} stopped early: {r['error']}", ""]
        L += [f"## Shard reload: {name} ({r['checkpoint_bytes'] / GB:.1f} GB bf16 checkpoint)", "",
              f"Store in `{r['store_root']}`: written in {r['store_write_seconds']:.1f} s, mapped in "
              f"{r['map_seconds']:.1f} s, page-locked in {r['pin_seconds']:.1f} s (once per worker process, at "
              f"start-up; not on the switch path). Host→device from the page-locked store: "
              f"{fmt(r.get('h2d_registered_store_GBps'))} GB/s. Pitched DMA for column cuts: {r.get('pitched_dma')}."
              + (f" Page-locking failed: {r['pin_error']}." if r.get("pin_error") else ""), "",
              "Per topology, ranks loaded one after another (each rank's shard into its own NaN-poisoned "
              "arena); GB/s = all ranks' bytes / their summed load times.", ""]
        modes = list(r.get("modes", {}))
        head = "| topology | shard GB (max rank) |" + "".join(f" {m} GB/s | {m} % pinned | {m} min rank GB/s |" for m in modes) + " ok |"
        L += [head, "| --- | ---: |" + " ---: | ---: | ---: |" * len(modes) + " --- |"]
        by = {m: {x["topology"]: x for x in r["modes"][m]["topologies"]} for m in modes}
        for topo in TOPOS:
            s = str(topo)
            rows = [by[m].get(s) for m in modes]
            if not any(rows):
                continue
            first = next(x for x in rows if x)
            cells = ""
            for x in rows:
                cells += (f" {x['GBps']:.1f} | {fmt(100 * x['GBps'] / pinned if pinned else None)} | {x['min_rank_GBps']:.1f} |"
                          if x else " – | – | – |")
            L.append(f"| {s} | {first['max_rank_bytes'] / GB:.2f} |{cells} {all(x['ok'] for x in rows if x)} |")
        b = r.get("baseline_remp_shm", {})
        if "GBps" in b:
            L += ["", f"For reference, the engine path's way (`remp_shm`: `safe_open().get_tensor()` of each "
                  f"whole tensor, then the cut copied from pageable memory), TP2PP2 rank 0: {b['GBps']:.1f} GB/s."]
        L.append("")
    sc = report.get("kv_selfcheck")
    if sc:
        L += ["## Direct KV path: self-check on this device" + _src_note(report, "selfcheck"), "",
              f"{sc.get('cases', 0)} small migrations (head size 128, bf16; every ordered pair of the world-4 and "
              "world-8 sets and TP1PP1 ↔ TP8PP1; vLLM's GPU layout and the block-first layout; block ids in odd "
              "runs, scrambled, all; each to the same ids and compacted into a smaller pool through "
              "`dst_block_ids`), destinations NaN-poisoned, every element compared bit for bit, free blocks "
              f"checked untouched: **{'all exact' if sc.get('ok') else 'FAILURES'}**; copies by "
              f"{', '.join(sc.get('kernels', [])) or '?'}; {sc.get('seconds', 0):.1f} s."
              + (f" Failures: {sc['failures'][:5]}." if sc.get("failures") else "")
              + (f" Error: {sc['error']}." if sc.get("error") else ""), ""]
    L += kv_markdown(report)
    ov = report.get("overlap")
    if ov:
        L += ["## Overlap of MIGRATE_KV and RELOAD_SHARDS" + _src_note(report, "overlap"), "",
              f"{ov['model']}, {ov['pair']}, {ov['tokens']} live tokens ({ov['kv_bytes_moved'] / GB:.1f} GB KV moved), "
              f"reload of all 8 new shards ({ov['reload_bytes'] / GB:.1f} GB) on its own stream and thread.", "",
              "| migrate | reload | sequential | overlapped | saving | share of the shorter phase hidden | ok |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
              f"| {ov['migrate_s'] * 1e3:.0f} ms | {ov['reload_s'] * 1e3:.0f} ms | {ov['sequential_s'] * 1e3:.0f} ms | "
              f"{ov['overlapped_s'] * 1e3:.0f} ms | {ov['saving_s'] * 1e3:.0f} ms ({ov['saving_pct']:.0f} %) | "
              f"{100 * ov['hidden_fraction_of_shorter']:.0f} % | {ov['ok']} |", ""]
        if ov.get("variants"):
            L += ["Variants: *threads* = reload issued from its own thread while 8 rank threads migrate (as "
                  "the worker does); *issue_first* = every reload DMA issued first (they are asynchronous), then "
                  "the migration; transport *memcpy* = `Tensor.copy_` (a copy-engine transfer, the same engines as "
                  "the host→device DMAs), *kernel* = a bit-exact SM copy kernel (NCCL over NVLink uses SM "
                  "kernels).", "", "| variant | overlapped | saving | shorter phase hidden | ok |",
                  "| --- | ---: | ---: | ---: | --- |"]
            for k, v in ov["variants"].items():
                L.append(f"| {k} | {v['overlapped_s'] * 1e3:.0f} ms | {v['saving_s'] * 1e3:.0f} ms ({v['saving_pct']:.0f} %) | "
                         f"{100 * v['hidden_fraction_of_shorter']:.0f} % | {v['ok']} |")
            L.append("")
    ops = report.get("kv_ops", {})
    if ops.get("ops"):
        L += ["## The executors' gather/scatter ops on one layer" + _src_note(report, "ops"), "",
              f"One 13B-shaped layer ({ops['model_layer']}, {ops['live_blocks']} live blocks in "
              f"{ops.get('runs', '?')} runs of consecutive ids), each op "
              "timed alone (median of 5), GB/s of the bytes gathered / scattered:", "",
              "| op | GB | ms | GB/s | % of d2d copy |", "| --- | ---: | ---: | ---: | ---: |"]
        cc = c.get("d2d_copy_GBps")
        for o in ops["ops"]:
            L.append(f"| {o['op']} | {o['bytes'] / GB:.2f} | {o['ms']:.2f} | {o['GBps']:.0f} | "
                     f"{fmt(100 * o['GBps'] / cc if cc else None)} |")
        L.append("")
    t = report.get("targets", {})
    if t:
        L += ["## Targets", "", "| target | reached |", "| --- | --- |"]
        for k, v in t.items():
            L.append(f"| {k} | " + ", ".join(f"{a}={fmt(b, '{:.2f}') if isinstance(b, float) else b}" for a, b in v.items()) + " |")
        L.append("")
    pr = report.get("prediction")
    if pr and pr["rows"]:
        mi = pr["measured_inputs"]
        L += ["## Predicted data-path time on an 8-GPU H200 host", "",
              f"Measured here: KV gather/scatter HBM rate {fmt(mi['kv_gather_scatter_hbm_copy_GBps'], '{:.0f}')} GB/s "
              f"(bytes copied/s, median of runs with ≥ 50 k tokens), reload efficiency per topology (reload GB/s ÷ pinned "
              f"ceiling), overlap {100 * mi['overlap_hidden_fraction']:.0f} % of the shorter phase hidden. Assumed: NVLink "
              f"{ASSUMED['nvlink_GBps_per_dir']:.0f} GB/s per direction at {ASSUMED['nvlink_efficiency']:.0%}, PCIe Gen5 "
              f"{ASSUMED['pcie_GBps_per_gpu']:.0f} GB/s per GPU (not shared; two GPUs behind one switch would halve it). "
              "Per GPU: staged KV = (send + receive + 2·local bytes) / HBM rate + max(send, receive) / NVLink; direct "
              f"KV (pull over CUDA-IPC peer mappings; measured direct rate {fmt(mi.get('kv_direct_GBps'), '{:.0f}')} GB/s, "
              "all ranks of one GPU together) = max(max(send, receive) / NVLink, (½·(send + receive) + local) / direct rate); reload = "
              "largest shard / (PCIe × efficiency); data path = max + (1 − hidden) · min. Quiesce, MPU apply and "
              "rebind are not included.", "",
              "| model | live tokens | pair | KV ms (staged) | KV ms (direct) | reload ms | data path ms (staged) | "
              "data path ms (direct) |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]

        def ms(v):
            return fmt(v * 1e3 if v is not None else None, '{:.0f}')
        for x in pr["rows"]:
            L.append(f"| {x['model']} | {x['tokens']} | {x['pair']} | {ms(x['kv_s'])} | {ms(x.get('kv_direct_s'))} | "
                     f"{ms(x['reload_s'])} | {ms(x['data_path_s'])} | {ms(x.get('data_path_direct_s'))} |")
        L.append("")
    if report.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in report["notes"]] + [""]
    return "\n".join(L)


def _src_note(report, sec: str) -> str:
    src = report.get("sources", {}).get(sec)
    return f" *(from {src['file']}, {src['date']})*" if src else ""


def kv_markdown(report) -> list[str]:
    kv = report.get("kv", {})
    L: list[str] = []
    if not kv.get("runs"):
        return L
    L += ["## KV migration (all emulated ranks on the one GPU)" + _src_note(report, "kv"), "",
          "Executors, each run per rank in its own thread and CUDA stream, ranks' buffers as separate "
          "allocations on the one GPU: *direct* = `migrate_kv` over `LocalTransport(direct=True)`: the "
          "single-pass peer-access path (each receiver pulls every slice of a layer straight from the source "
          "ranks' layer tensors into its new tensor: each byte read once and written once, one Triton launch "
          "per receiving rank and layer, grid = live blocks × slices, 16-byte vector loads/stores; no staging; on "
          "an NVLink host the same pull through CUDA-IPC peer mappings); *staged* = the executor's default path "
          "(staging limit `auto` = "
          f"{kv['runs'][0].get('staging_fraction', 0.1):.0%} of one full layer; runs of ≤ "
          f"{kv['runs'][0].get('run_copy_max_runs', '?')} consecutive-id runs copied per run, more by one "
          "`index_select` / `index_copy_` on the memory-order view as 16-byte elements, `LocalTransport` copies "
          "between ranks); *unlimited* = staged, no staging limit; *reference* = the first executor "
          "(`migrate_kv_reference`: advanced-index gather, `.contiguous()`, `index_put` scatter). GB/s = live KV "
          "bytes moved (remote + local slices) / wall time of a timed (unpoisoned) leg, all ranks together. "
          f"*% d2d* = that ÷ the d2d copy ceiling (bytes copied/s; {fmt(_ceil_of(report, 'kv'), '{:.0f}')} GB/s, measured "
          "in the same run as these tables); *hbm %* counts the HBM passes the staged path "
          "makes on one GPU (remote: gather → transport copy → scatter = 3; local: gather → scatter = 2), so "
          "staged *% d2d* cannot exceed ~33 % for remote bytes; the direct path makes one pass, so its % d2d is "
          "its hbm %. Peak extra: allocator history per rank stream, the peak above the larger of the rank's KV "
          "before and after the switch (max over ranks) ÷ one full layer's KV (all KV heads, whole pool). Every "
          "direction of every pair: destinations NaN-poisoned, every live block compared bit for bit with the "
          "source, every free block checked still NaN (direct, staged, unlimited); reference legs check the "
          "live blocks.", "",
          "| model | live tokens | pairs | one layer GB | id runs | direct GB/s median (min–max) | direct % d2d "
          "median (min–max) | direct peak/layer max | staged GB/s median (min–max) | staged % d2d median | staged "
          "hbm % median | staged peak/layer max | unlimited GB/s | reference GB/s | direct ÷ staged | direct ÷ "
          "reference | all ok |",
          "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def span(xs, f="{:.0f}"):
        xs = [x for x in xs if x is not None]
        return f"{f.format(statistics.median(xs))} ({f.format(min(xs))}–{f.format(max(xs))})" if xs else "–"

    def row_ok(x):
        return x["ok"] and all(x.get(k, True) for k in _OK_KEYS)

    for run in kv["runs"]:
        rows = run["rows"]
        if not rows:
            continue
        g = [x["GBps"] for x in rows]
        di = [x["direct"] for x in rows if "direct" in x]
        un = [x["unlimited"] for x in rows if "unlimited" in x]
        ref = [x["reference"] for x in rows if "reference" in x]
        pk = [_peak_of(x["peak"]) for x in rows]
        pd = [_peak_of(d["peak"]) for d in di if "peak" in d]
        vs_staged = med([x["direct"]["GBps"] / x["GBps"] for x in rows if "direct" in x])
        vs_ref = med([x["direct"]["GBps"] / x["reference"]["GBps"] for x in rows if "direct" in x and "reference" in x])
        ok = all(row_ok(x) for x in rows) and not run.get("errors")
        L.append(f"| {run['model']} | {run['tokens']} | {len(rows)} | {run['one_layer_kv_bytes'] / GB:.3f} | "
                 f"{run.get('runs_of_consecutive_ids', '–')} | {span([d['GBps'] for d in di])} | "
                 f"{span([d.get('pct_of_d2d') for d in di], '{:.1f}')} | {fmt(max(pd) if pd else None, '{:.2f}')} | "
                 f"{span(g)} | {fmt(med(x.get('pct_of_d2d') for x in rows))} | "
                 f"{fmt(med(x.get('hbm_pct_of_d2d') for x in rows))} | {max(pk):.2f} | "
                 f"{fmt(med(u['GBps'] for u in un), '{:.0f}')} | {fmt(med(r['GBps'] for r in ref), '{:.0f}')} | "
                 f"{fmt(vs_staged, '{:.1f}×')} | {fmt(vs_ref, '{:.1f}×')} | {ok} |")
    for run in [r for r in kv["runs"] if r["rows"]]:
        which = "the x8 set" if run["pairs"] == "x8" else "every TP×PP with TP·PP ≤ 8"
        L += ["", f"### {run['model']}, {run['tokens']} live tokens, {which} (every ordered pair)", "",
              "| old → new | GB moved | direct ms | direct host CPU ms | direct GB/s | direct % d2d | direct peak/layer "
              "| staged ms | staged GB/s | staged % d2d | staged hbm % | staged peak/layer | unlimited GB/s | "
              "reference GB/s | ok |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for x in run["rows"]:
            un, ref, di = x.get("unlimited", {}), x.get("reference", {}), x.get("direct", {})
            L.append(f"| {x['old']} → {x['new']} | {x['bytes_moved'] / GB:.2f} | "
                     f"{fmt(di['seconds'] * 1e3 if di else None)} | "
                     f"{fmt(di['host_cpu_s_sum'] * 1e3 if 'host_cpu_s_sum' in di else None, '{:.0f}')} | "
                     f"{fmt(di.get('GBps'), '{:.0f}')} | "
                     f"{fmt(di.get('pct_of_d2d'))} | {fmt(_peak_of(di['peak']) if di else None, '{:.2f}')} | "
                     f"{x['seconds'] * 1e3:.1f} | {x['GBps']:.0f} | {fmt(x.get('pct_of_d2d'))} | "
                     f"{fmt(x.get('hbm_pct_of_d2d'))} | {_peak_of(x['peak']):.2f} | "
                     f"{fmt(un.get('GBps'), '{:.0f}')} | {fmt(ref.get('GBps'), '{:.0f}')} | {row_ok(x)} |")
    sk = [f"{run['model']} {run['tokens']}: {len(run['skipped'])} pairs ({run.get('skipped_reason', 'time budget')})"
          for run in kv["runs"] if run["skipped"]]
    if sk:
        L += ["", "Not run: " + "; ".join(sk) + "."]
    errs = [f"{run['model']} {run['tokens']} {e['pair']}: {e['error']}" for run in kv["runs"] for e in run.get("errors", [])]
    if errs:
        L += ["", "Errors: " + "; ".join(errs) + "."]
    if kv.get("note"):
        L += ["", f"Note: {kv['note']}."]
    why = direct_analysis(report)
    if why:
        L += ["", "### What limits the direct path (computed from the numbers above)", ""] + [f"- {a}" for a in why]
    L.append("")
    sup = report.get("superseded", {}).get("kv") or []
    # the first executor's sweep, and earlier versions of the direct path (what changed between them)
    for before in sup[:1] + [b for b in sup[1:] if _has_direct(b)]:
        L += _before_kv(before)
    return L


def _ceil_of(report, sec: str) -> float | None:
    """The d2d ceiling measured in the run that produced section ``sec`` (merged reports keep
    every run's ceilings), else the report's."""
    src = report.get("sources", {}).get(sec, {}).get("file")
    for r in report.get("runs", []):
        if r.get("file") == src and (r.get("ceilings") or {}).get("d2d_copy_GBps"):
            return r["ceilings"]["d2d_copy_GBps"]
    return report.get("ceilings", {}).get("d2d_copy_GBps")


def direct_analysis(report) -> list[str]:
    """Where the direct path's time goes, from this report's own numbers: the kernel alone (ops)
    against the d2d ceiling, and per sweep the host CPU time of the rank threads against the wall
    time (the ranks are threads of one Python process here: their host work is serialized by the
    GIL, where a real host runs one process per GPU)."""
    out: list[str] = []
    ceil = _ceil_of(report, "ops")
    ops = [o for o in report.get("kv_ops", {}).get("ops", []) if o["op"].startswith("direct pull")]
    if ops and ceil:
        out.append("The pull kernel alone (one launch on one 13B-shaped layer, ops table below): " + "; ".join(
            f"{o['op'].split(', ', 1)[1]}: {o['GBps']:.0f} GB/s = {100 * o['GBps'] / ceil:.0f} % of d2d "
            f"({o['ms']:.2f} ms)" for o in ops) + ". Each byte is read once and written once, as in the "
            "d2d copy; what the kernel loses is the per-block address arithmetic, masked tile edges and, "
            "for small launches, the Python launch itself.")
    hc = report.get("kv_host_cost", {})
    one = hc.get("one_rank_migration")
    if one:
        c1 = _ceil_of(report, "hostcost")
        rate = one["bytes"] / (one["wall_ms"] / 1e3) / GB
        out.append(f"One rank alone (one thread, no other rank competing for the interpreter; every slice local): "
                   f"{one['layers']} layers at {hc['tokens']} live tokens ({one['bytes'] / GB:.2f} GB) in "
                   f"{one['wall_ms']:.2f} ms = {rate:.0f} GB/s = {100 * rate / c1:.0f} % of d2d, "
                   f"{one['host_cpu_us_per_layer']:.0f} µs of host CPU per layer. Host CPU per call, uncontended: "
                   + ", ".join(f"{k.strip()} {v:.0f} µs" for k, v in hc.get("per_call_us", {}).items())
                   + _src_note(report, "hostcost") + ".")
    tiles = report.get("kv_ops", {}).get("direct", {}).get("tiles", {})
    for h, tv in tiles.items():
        best = max(tv["variants"], key=lambda v: v["GBps"], default=None)
        if best and ceil:
            c = tv["chosen"]
            out.append(f"Tiles for {h} heads: chosen {c['RB']}×{c['CB']} with {c['num_warps']} warps; best of the "
                       f"others {best['RB']}×{best['CB']}/{best['num_warps']} warps at {best['GBps']:.0f} GB/s "
                       f"({100 * best['GBps'] / ceil:.0f} % of d2d).")
    for run in report.get("kv", {}).get("runs", []):
        di = [(x, x["direct"]) for x in run["rows"] if "host_cpu_s_sum" in x.get("direct", {})]
        if not di or not ceil:
            continue
        share = [d["host_cpu_s_sum"] / d["seconds"] for _, d in di]
        rate = max((o["GBps"] for o in ops), default=ceil)  # the kernel's measured rate, else the ceiling
        gpu = [x["bytes_moved"] / (rate * GB) for x, _ in di]
        per_world: dict[int, list[float]] = {}
        for x, d in di:
            a, b = Topology.parse(x["old"]), Topology.parse(x["new"])
            pulls = run.get("layers", MODELS.get(run["model"], {}).get("num_hidden_layers", 0)) * b.tp
            if pulls:
                per_world.setdefault(max(a.world_size, b.world_size), []).append(d["host_cpu_s_sum"] / pulls)
        slow = [(x, d) for x, d in di if d["pct_of_d2d"] < statistics.median(e["pct_of_d2d"] for _, e in di)]
        out.append(f"{run['model']}, {run['tokens']} tokens ({run['pairs']}): the rank threads' summed host CPU "
                   f"time is {statistics.median(share):.0%} of the leg's wall time (median over pairs; "
                   f"{min(share):.0%}–{max(share):.0%}); the bytes alone at the kernel's best measured rate "
                   f"({rate:.0f} GB/s) would take "
                   f"{statistics.median(gpu) * 1e3:.1f} ms against {statistics.median(d['seconds'] for _, d in di) * 1e3:.1f} "
                   f"ms measured (medians). Below-median pairs: "
                   + ", ".join(f"{x['old']}→{x['new']}" for x, _ in slow[:6]) + (" …" if len(slow) > 6 else "") + "."
                   + (" Host CPU per (receiving rank, layer) pull, median by world size: " + ", ".join(
                       f"{w} ranks {statistics.median(v) * 1e6:.0f} µs" for w, v in sorted(per_world.items()))
                      + " (it grows with the number of rank threads sharing one interpreter)." if per_world else ""))
    return out


def _has_direct(before) -> bool:
    return any("direct" in x for run in before.get("data", {}).get("runs", []) for x in run["rows"])


def _before_kv(before) -> list[str]:
    """A superseded KV sweep, summarized (the first executor's, or an earlier direct path's)."""
    b = before.get("data", {})
    if not b.get("runs"):
        return []
    direct = _has_direct(before)
    what = "an earlier version of the direct path" if direct else "the first executor"
    L = [f"### Before: {what} *(from {before.get('file')}, {before.get('date')}; replaced by the tables above)*", ""]
    if b.get("note"):
        L += [f"Note: {b['note']}.", ""]
    if not direct:
        L += ["Default = no staging limit (then the only behaviour); *chunked* = `staging_limit_bytes` = 10 % of a layer.", ""]
    L += ["| model | live tokens | pairs | default GB/s median (min–max) | % d2d median | hbm % median | "
          "peak/layer max (default) | reference GB/s median | direct GB/s median (min–max) | direct % d2d median |",
          "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for run in b["runs"]:
        rows = run["rows"]
        if not rows:
            continue
        g = [x["GBps"] for x in rows]
        ref = [x["reference"]["GBps"] for x in rows if "reference" in x]
        dg = [x["direct"]["GBps"] for x in rows if "direct" in x]
        dp = [x["direct"]["pct_of_d2d"] for x in rows if "pct_of_d2d" in x.get("direct", {})]
        L.append(f"| {run['model']} | {run['tokens']} | {len(rows)} | {statistics.median(g):.0f} "
                 f"({min(g):.0f}–{max(g):.0f}) | {fmt(statistics.median(x.get('pct_of_d2d', 0) for x in rows))} | "
                 f"{fmt(statistics.median(x.get('hbm_pct_of_d2d', 0) for x in rows))} | "
                 f"{max(_peak_of(x['peak']) for x in rows):.2f} | "
                 f"{fmt(statistics.median(ref) if ref else None, '{:.0f}')} | "
                 + (f"{statistics.median(dg):.0f} ({min(dg):.0f}–{max(dg):.0f})" if dg else "–")
                 + f" | {fmt(statistics.median(dp) if dp else None)} |")
    bt = kv_targets(b)
    if bt.get("kv_pct_of_d2d"):
        L += ["", f"Then: {bt['kv_pct_of_d2d']['median_ge_50k_tokens']:.1f} % of d2d (median, ≥ 50 k tokens), "
              f"hbm {bt['kv_hbm_pct_of_d2d']['median_ge_50k_tokens']:.1f} %."]
    L.append("")
    return L


def device_info(dev) -> dict:
    if dev.type != "cuda":
        return {"name": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"}
    p = torch.cuda.get_device_properties(dev)
    info = {"name": p.name, "memory_bytes": p.total_memory, "sms": p.multi_processor_count,
            "capability": f"{p.major}.{p.minor}", "host_cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}
    try:
        info["dev_shm_bytes"] = shutil.disk_usage("/dev/shm").total
    except OSError:
        pass
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,pcie.link.gen.max,"
                            "pcie.link.width.current,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20).stdout.strip().split(", ")
        info.update(driver=q[0], pcie=f"Gen{q[1]} (max Gen{q[2]}) x{q[3]}", max_sm_clock=q[4], max_mem_clock=q[5])
    except Exception:  # noqa: BLE001
        pass
    return info


def run_all(args) -> dict:
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    budget = Budget(args.budget_s)
    models = SMALL_MODELS if args.small else MODELS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "h200" if dev.type == "cuda" else "cpu"
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "device": device_info(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
                    "python": platform.python_version(), "args": vars(args), "notes": []}

    def save():
        report["wall_seconds"] = budget.elapsed()
        report["targets"] = targets(report)
        report["correctness"] = correctness(report)
        (out / f"gpu_datapath_{tag}.json").write_text(json.dumps(report, indent=1, default=str))
        try:
            md = markdown(report)
        except Exception as exc:  # noqa: BLE001 - the JSON is the record; say why the tables are missing
            import traceback

            md = f"# GPU data path\n\nTables failed: {exc!r}\n\n```\n{traceback.format_exc()}```\n"
        (out / f"gpu_datapath_{tag}.md").write_text(md)

    streams = [torch.cuda.Stream(dev) for _ in range(8)] if dev.type == "cuda" else None
    report["ceilings"] = measure_ceilings(dev, args.small)
    log("[ceilings] " + ", ".join(f"{k}={v:.1f}" for k, v in report["ceilings"].items() if k != "bytes"))
    save()
    only = set(args.only.split(",")) if args.only else {"selfcheck", "ops", "reload", "overlap", "kv"}
    if "selfcheck" in only:
        try:
            report["kv_selfcheck"] = direct_selfcheck(dev, streams, small=args.small)
        except Exception as exc:  # noqa: BLE001
            report["kv_selfcheck"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            log(f"[kv selfcheck] FAILED: {exc!r}")
        save()
    if "hostcost" in only:
        try:
            report["kv_host_cost"] = bench_host_cost(models[list(models)[-1]], dev, args, streams)
        except Exception as exc:  # noqa: BLE001
            report["kv_host_cost"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"[host cost] FAILED: {exc!r}")
        save()
    if "ops" in only:
        try:
            report["kv_ops"] = bench_kv_ops(models[list(models)[-1]], dev, args)
        except Exception as exc:  # noqa: BLE001
            report["kv_ops"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"[kv ops] FAILED: {exc!r}")
        save()
    names = list(models) if "reload" in only else (list(models)[-1:] if "overlap" in only else [])
    kept = None
    for i, name in enumerate(names):
        last = i == len(names) - 1
        try:
            store, mapped = bench_reload(name, models[name], dev, args, budget, report, keep_open=last,
                                         sweep="reload" in only)
        except Exception as exc:  # noqa: BLE001 - recorded; the KV part still runs
            report.setdefault("reload", {}).setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"
            log(f"[reload {name}] FAILED: {exc!r}")
            store = mapped = None
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if last and mapped is not None:
            kept = (name, store, mapped)
        save()
    if kept:
        name, store, mapped = kept
        try:
            bench_overlap(name, models[name], mapped, dev, args, report, streams)
        except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
            report["overlap"] = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"[overlap] failed: {exc!r}")
        try:
            mapped.close()
            store.close()
        except Exception as exc:  # noqa: BLE001
            report["notes"].append(f"closing the {name} store failed: {exc!r}")
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        save()
    if "kv" in only:
        try:
            bench_kv(models, dev, args, budget, report, report["ceilings"].get("d2d_copy_GBps"), streams)
        except Exception as exc:  # noqa: BLE001
            report.setdefault("kv", {"runs": []})["error"] = f"{type(exc).__name__}: {exc}"
            log(f"[kv] FAILED: {exc!r}")
        save()
    try:
        report["prediction"] = predict(report, args) if not args.small else {"rows": []}
    except Exception as exc:  # noqa: BLE001
        report["prediction"] = {"rows": [], "error": f"{type(exc).__name__}: {exc}"}
    save()
    return report


_SECTIONS = (("selfcheck", "kv_selfcheck"), ("hostcost", "kv_host_cost"), ("ops", "kv_ops"), ("reload", "reload"),
             ("overlap", "overlap"), ("kv", "kv"))


def merge_reports(paths: list[str], out: Path) -> dict:
    """One report from several runs (e.g. a full run, then ``--only ops,overlap`` after a fix):
    each later run's sections replace the earlier's; the runs are listed under ``runs``."""
    merged: dict = {}
    runs = []
    for p in paths:
        rep = json.loads(Path(p).read_text())
        secs = [sec for sec, key in _SECTIONS if key in rep]
        runs.append({"file": Path(p).name, "date": rep["date"], "sections": ["ceilings"] + secs,
                     "wall_seconds": rep.get("wall_seconds"), "ceilings": rep.get("ceilings")})
        src = {"file": Path(p).name, "date": rep["date"]}
        if not merged:
            merged = rep
            merged.pop("superseded", None)
            merged["sources"] = {sec: src for sec in secs}
            continue
        for sec, key in _SECTIONS:
            if sec in secs and key in rep:
                if key in merged:  # keep what a later run replaces (before/after tables), oldest first
                    merged.setdefault("superseded", {}).setdefault(sec, []).append(
                        {**merged["sources"].get(sec, {}), "data": merged[key]})
                merged[key] = rep[key]
                merged["sources"][sec] = src
    merged["runs"] = runs
    merged["wall_seconds"] = sum(r["wall_seconds"] or 0 for r in runs)
    merged["prediction"] = predict(merged, None)
    merged["targets"] = targets(merged)
    merged["correctness"] = correctness(merged)
    tag = "h200" if "H200" in merged["device"].get("name", "") else "cpu"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_datapath_{tag}.json").write_text(json.dumps(merged, indent=1, default=str))
    (out / f"gpu_datapath_{tag}.md").write_text(markdown(merged))
    return merged


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU check)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip optional sweeps after this")
    ap.add_argument("--reserve-s", type=float, default=25.0, help="time kept back for the report")
    ap.add_argument("--store-root", default="/dev/shm")
    ap.add_argument("--file-bytes", type=int, default=4 << 30, help="safetensors file size in the store")
    ap.add_argument("--kv-plan", default=None,
                    help="model index:live tokens:all|x8, comma-separated, in priority order "
                         "(default: " + DEFAULT_PLAN + "; with --small: " + SMALL_PLAN + ")")
    ap.add_argument("--kv-variants", default="unlimited,reference,direct",
                    help="besides the default (staged) executor: unlimited (no staging limit), reference "
                         "(first executor), direct (the single-pass peer-access path)")
    ap.add_argument("--overlap-tokens", type=int, default=50000)
    ap.add_argument("--small-tokens", type=int, default=300)
    ap.add_argument("--only", default=None, help="comma list of sections: selfcheck,ops,reload,overlap,kv "
                                                "(ceilings always run; default all)")
    ap.add_argument("--ops-tokens", type=int, default=100000, help="live tokens of the KV op microbench")
    a = ap.parse_args(argv)
    if a.kv_plan is None:
        a.kv_plan = SMALL_PLAN if a.small else DEFAULT_PLAN
    if a.small:
        a.file_bytes = min(a.file_bytes, 200_000)
        a.overlap_tokens = min(a.overlap_tokens, a.small_tokens)
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--merge"]:  # --merge OUT_DIR RUN1.json RUN2.json ...
        rep = merge_reports(argv[2:], Path(argv[1]))
        print(markdown(rep))
        return 0 if rep["correctness"]["all_ok"] else 1
    args = parse_args(argv)
    rep = run_all(args)
    tag = "h200" if args.device.startswith("cuda") else "cpu"
    print(Path(args.out, f"gpu_datapath_{tag}.md").read_text())
    return 0 if rep["correctness"]["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
