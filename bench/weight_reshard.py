"""Peer-to-peer weight resharding against reloading from pinned host memory (issue 18).

    PYTHONPATH=. python bench/weight_reshard.py --out DIR            # one H200 (plain torch)
    PYTHONPATH=. python bench/weight_reshard.py --smoke --out DIR    # CPU, tiny shapes
    python bench/weight_reshard.py --md-from results/weight_reshard_h200-DATE.json  # rewrite .md

One process, one GPU, the 8 ranks of each topology emulated on it as separate allocations (as
``bench/gpu_datapath.py`` does). Per model (Llama-2-7B, 13B and 70B shapes, random bf16; 70B with
fewer layers so that the old shards, the new shards and the reference fit) the checkpoint is
written into the project's weight store, mapped and page-locked (``gpu_datapath.write_store``,
``MappedStore``). Per ordered pair of topologies:

1. the old topology's shards are loaded by the project's loader (``ShardLoader``, direct DMA from
   the page-locked store) and checked against the reference;
2. the plan (``remp.weightplan.plan_weights``) is executed as device-to-device copies into the new
   ranks' NaN-poisoned parameters (vLLM's merged layout): row ranges contiguous in both arenas
   merged into one copy, column ranges (o_proj, down_proj) as strided 2-D copies, the vocabulary
   padding zero-filled; every element of every new shard checked against the reference, bit for
   bit; then timed: eager (one CUDA stream per new rank, issued from one thread) and as one CUDA
   graph replay (the same copies captured once, one branch per new rank);
3. in the same run, the new shards are reloaded from the page-locked store by the existing reload
   measurement (``gpu_datapath.reload_topology``: every rank in turn, direct DMA, checked).

All ranks share one HBM and one PCIe link here, so the measured ratio compares the whole switch's
weight bytes through one device's copy engine / SMs against the same new shards through one PCIe
link. It is *not* NVLink: remote slices between GPUs would cross NVLink (measured NCCL p2p on a
2 × H200 host: ``bench/results/multi_gpu_h200x2.json``), local slices stay in one GPU's HBM. The
report adds a projection for an 8-GPU host from the plan's per-rank bytes and those link figures.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu_datapath import (GB, alloc_params, check_shard, device_info,  # noqa: E402
                                measure_ceilings, reload_topology, store_root, sync, write_store)
from node_agent.weight_store import MappedStore, ShardLoader, llama_shard_pieces  # noqa: E402
from remp.topology import Topology  # noqa: E402
from remp.weightplan import (LLAMA2_7B, LLAMA2_13B, LLAMA2_70B, WeightShape,  # noqa: E402
                             plan_weights)

T = Topology.parse
PAIRS = [("TP8PP1", "TP4PP2"), ("TP4PP2", "TP2PP4"), ("TP8PP1", "TP1PP8"), ("TP1PP8", "TP8PP1"),
         ("TP2PP4", "TP4PP2"), ("TP4PP1", "TP8PP1"), ("TP8PP1", "TP2PP2")]
SMOKE_PAIRS = [("TP8PP1", "TP4PP2"), ("TP4PP2", "TP2PP4"), ("TP4PP1", "TP8PP1"),
               ("TP8PP1", "TP2PP2")]
MULTI_GPU_JSON = ROOT / "bench/results/multi_gpu_h200x2.json"
FALLBACK_LINK = {"p2p_GBps": 357.2, "source": "assumed (multi_gpu_h200x2.json not found)"}


def models(args) -> dict[str, tuple[WeightShape, str]]:
    if args.smoke:
        return {"tiny-mha": (WeightShape(8, 64, 8, 8, 128, 256), "smoke"),
                "tiny-gqa": (WeightShape(16, 128, 16, 8, 192, 512), "smoke")}
    out = {}
    for name in args.models.split(","):
        if name == "7b":
            out["llama2-7b"] = (LLAMA2_7B, "full: 32 layers")
        elif name == "13b":
            out["llama2-13b"] = (LLAMA2_13B, "full: 40 layers")
        elif name == "70b":
            L = args.layers_70b
            s = LLAMA2_70B if L == 80 else WeightShape(L, 8192, 64, 8, 28672, 32000)
            out[f"llama2-70b-{L}L"] = (s, f"{L} of 80 layers (old + new shards + the reference on "
                                          "one GPU); the per-layer bytes scale with the layers, "
                                          "embedding and LM head are whole")
        else:
            raise SystemExit(f"unknown model {name!r}")
    return out


def log(*a) -> None:
    print(*a, flush=True)


# ----------------------------------------------------------------------- plan → copy ops


def build_ops(plan, old_arenas, new_arenas, cfg):
    """Per new rank: (flat copies [(dst 1-D view, src 1-D view)], 2-D copies, zero fills).
    Row ranges (dim 0, whole rows) and 1-D tensors are flat ranges of the arenas; consecutive
    flat ranges contiguous on both sides (same old rank) are merged."""
    h = cfg["hidden_size"]
    offs = {}

    def off(arena, params, name):
        key = (id(arena), name)
        if key not in offs:
            offs[key] = (params[name].data_ptr() - arena.data_ptr()) // arena.element_size()
        return offs[key]

    per = {r: {"flat": [], "strided": [], "zero": []} for r in range(plan.new.world_size)}
    flat: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in per}  # (src, dst0, src0, n)
    for m in plan.moves:
        na, np_ = new_arenas[m.dst]
        cross = 1 if m.dim is None else h
        if m.kind == "zero":
            per[m.dst]["zero"].append(np_[m.param].narrow(m.dim, m.dst_start, m.length))
            continue
        if m.kind == "store":
            raise RuntimeError("the bench plans one host: nothing comes from the store")
        oa, op = old_arenas[m.src]
        if m.dim == 1:
            per[m.dst]["strided"].append((np_[m.param].narrow(1, m.dst_start, m.length),
                                          op[m.src_param].narrow(1, m.src_start, m.length)))
            continue
        d0 = off(na, np_, m.param) + m.dst_start * cross
        s0 = off(oa, op, m.src_param) + m.src_start * cross
        flat[m.dst].append((m.src, d0, s0, m.length * cross))
    merged = 0
    for r, runs in flat.items():
        runs.sort(key=lambda x: (x[0], x[2]))
        out: list[list[int]] = []
        for src, d0, s0, n in runs:
            if out and out[-1][0] == src and out[-1][1] + out[-1][3] == d0 and out[-1][2] + out[-1][3] == s0:
                out[-1][3] += n
                merged += 1
            else:
                out.append([src, d0, s0, n])
        na = new_arenas[r][0]
        per[r]["flat"] = [(na.narrow(0, d0, n), old_arenas[src][0].narrow(0, s0, n))
                          for src, d0, s0, n in out]
    return per, merged


def run_ops(per, streams):
    for r, ops in per.items():
        ctx = torch.cuda.stream(streams[r]) if streams else _Null()
        with ctx:
            for d in ops["zero"]:
                d.zero_()
            for d, s in ops["flat"]:
                d.copy_(s, non_blocking=True)
            for d, s in ops["strided"]:
                d.copy_(s, non_blocking=True)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def capture(per, streams, dev):
    """The same copies as one CUDA graph, one fork-join branch per new rank."""
    g = torch.cuda.CUDAGraph()
    main = torch.cuda.Stream(dev)
    sync(dev)
    with torch.cuda.graph(g, stream=main):
        fork = torch.cuda.Event()
        fork.record(main)
        joins = []
        for r, ops in per.items():
            s = streams[r]
            s.wait_event(fork)
            with torch.cuda.stream(s):
                for d in ops["zero"]:
                    d.zero_()
                for d, src in ops["flat"]:
                    d.copy_(src, non_blocking=True)
                for d, src in ops["strided"]:
                    d.copy_(src, non_blocking=True)
            e = torch.cuda.Event()
            e.record(s)
            joins.append(e)
        for e in joins:
            main.wait_event(e)
    return g


def timed(fn, dev, reps):
    fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), ts


# ----------------------------------------------------------------------- one pair


def load_topology(loader, cfg, topo, ref, dev, stream):
    out = []
    for r in range(topo.world_size):
        shapes, pieces = llama_shard_pieces(cfg, topo.tp, topo.pp, r)
        arena, params = alloc_params(shapes, dev)
        loader.load(pieces, params)
        if stream is not None:
            stream.synchronize()
        if not check_shard(arena, params, pieces, ref):
            raise RuntimeError(f"old shard {topo} rank {r} wrong after load")
        out.append((arena, params))
    return out


def bench_pair(shape, cfg, old, new, loader, ref, dev, stream, args, link) -> dict:
    cuda = dev.type == "cuda"
    t = time.perf_counter()
    plan = plan_weights(shape, old, new)
    plan_s = time.perf_counter() - t
    summ = plan.summary()
    olds = load_topology(loader, cfg, old, ref, dev, stream)
    news, pieces = [], []
    for r in range(new.world_size):
        shapes, pcs = llama_shard_pieces(cfg, new.tp, new.pp, r)
        if shapes != plan.new_params[r]:
            raise RuntimeError(f"{new} rank {r}: the plan's layout differs from the loader's")
        news.append(alloc_params(shapes, dev))  # NaN-poisoned
        pieces.append(pcs)
    per, merged = build_ops(plan, olds, news, cfg)
    streams = [torch.cuda.Stream(dev) for _ in range(new.world_size)] if cuda else None
    n_ops = sum(len(o["flat"]) + len(o["strided"]) + len(o["zero"]) for o in per.values())
    run_ops(per, streams)
    sync(dev)
    ok_eager = all(check_shard(a, p, pcs, ref) for (a, p), pcs in zip(news, pieces))
    eager_s, eager_all = timed(lambda: run_ops(per, streams), dev, args.reps)
    res = {"old": str(old), "new": str(new), "plan_seconds": plan_s, "plan": summ,
           "copy_ops": n_ops, "merged_runs": merged, "ok_eager": ok_eager,
           "eager_seconds": eager_s, "eager_all": eager_all}
    moved = summ["local_bytes"] + summ["peer_bytes"]
    res["bytes_moved"] = moved
    res["eager_GBps"] = moved / eager_s / GB
    best = eager_s
    if cuda and not args.no_graph:
        try:
            for a, _ in news:
                a.fill_(float("nan"))
            g = capture(per, streams, dev)
            g.replay()
            sync(dev)
            res["ok_graph"] = all(check_shard(a, p, pcs, ref) for (a, p), pcs in zip(news, pieces))
            res["graph_seconds"], res["graph_all"] = timed(g.replay, dev, args.reps)
            res["graph_GBps"] = moved / res["graph_seconds"] / GB
            best = min(best, res["graph_seconds"])
            del g
        except RuntimeError as exc:  # the eager leg stands; reported
            res["graph_error"] = f"{type(exc).__name__}: {exc}"
            log(f"graph leg failed: {res['graph_error']}")
            sync(dev)
    res["p2p_seconds"] = best
    del per, olds, news
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    # the existing reload measurement, same run: every new rank in turn from the pinned store
    rel = [reload_topology(loader.store, loader, cfg, new, ref, dev, stream)
           for _ in range(args.reload_reps)]
    res["reload_ok"] = all(x["ok"] for x in rel)
    res["reload_seconds"] = statistics.median(x["seconds"] for x in rel)
    res["reload_all"] = [x["seconds"] for x in rel]
    res["reload_bytes"] = rel[0]["bytes"]
    res["reload_GBps"] = rel[0]["bytes"] / res["reload_seconds"] / GB
    res["reload_max_rank_seconds"] = statistics.median(max(r["seconds"] for r in x["ranks"]) for x in rel)
    res["ratio"] = res["reload_seconds"] / best
    res["projection"] = project(plan, res, link)
    return res


def project(plan, res, link) -> dict:
    """An 8-GPU host, one rank per GPU, each GPU with its own PCIe link (the x2 host showed no
    sharing: concurrent pinned H2D 52.9 GB/s per GPU). P2P: a rank's local bytes at this run's
    d2d rate, its remote bytes in and out at the measured NVLink p2p rate (both directions at once);
    reload: its new shard at this run's pinned H2D rate. Not measured on such a host."""
    d2d, h2d, p2p = link["d2d_GBps"], link["h2d_GBps"], link["p2p_GBps"]
    local = {r: 0 for r in range(plan.new.world_size)}
    for m in plan.moves:
        if m.kind == "local":
            local[m.dst] += m.nbytes
    recv, send = plan.receive_bytes(), plan.send_bytes()
    rank_s = {r: local[r] / d2d / GB + max(recv[r], send.get(r, 0)) / p2p / GB for r in local}
    old_only = {r: send[r] / p2p / GB for r in send if r not in local}
    p2p_s = max([*rank_s.values(), *old_only.values()])
    reload_s = max(plan.shard_bytes(r) for r in local) / h2d / GB
    return {"p2p_seconds": p2p_s, "reload_seconds": reload_s, "ratio": reload_s / p2p_s,
            "max_receive_bytes": max(recv.values()), "max_send_bytes": max(send.values())}


def link_figures(ceil: dict) -> dict:
    out = {"d2d_GBps": ceil["d2d_copy_GBps"], "h2d_GBps": ceil.get("h2d_pinned_GBps", 55.0)}
    try:
        c = json.loads(MULTI_GPU_JSON.read_text())["ceilings"]
        out.update(p2p_GBps=c["p2p_bidir_per_direction_GBps"],
                   source=f"{MULTI_GPU_JSON.name}: NCCL p2p per direction, both at once, 1 GiB")
    except (OSError, KeyError, ValueError):
        out.update(FALLBACK_LINK)
    return out


# ----------------------------------------------------------------------- report


def markdown(rep: dict) -> str:
    d = rep["device"]
    lines = [f"# Peer-to-peer weight resharding vs pinned-host reload ({rep['date']})", "",
             f"{d.get('name')}; torch {rep['torch']}"
             + (f", CUDA {rep['cuda']}, driver {d.get('driver')}, PCIe {d.get('pcie')}" if rep["cuda"] else "")
             + f". `bench/weight_reshard.py {' '.join(rep['argv'])}`, {rep['seconds']:.0f} s. "
             f"Correctness: **{'all checks passed' if rep['all_ok'] else 'FAILURES'}** (every "
             "element of every new shard against the reference, NaN-poisoned first; eager, graph "
             "and reload legs).", "",
             f"Ceilings, same run: d2d {rep['ceilings']['d2d_copy_GBps']:.0f} GB/s (bytes copied/s), "
             f"pinned H2D {rep['ceilings'].get('h2d_pinned_GBps', float('nan')):.1f} GB/s.", "",
             "All 8 emulated ranks share the one GPU: *P2P* = the plan's copies (local + peer "
             "bytes) through one device's memory, best of eager and CUDA-graph replay; *reload* = "
             "every new rank's shard through the one PCIe link from the page-locked store "
             "(`gpu_datapath.reload_topology`, ranks in turn, summed). *ratio* = reload ÷ P2P, "
             "the whole switch's weight part both ways on one device. *projected* = an 8-GPU host "
             "(one rank per GPU, own PCIe link each), slowest rank, from the plan's per-rank bytes "
             f"with local bytes at the d2d rate and remote ones at {rep['link']['p2p_GBps']:.0f} GB/s "
             f"({rep['link']['source']}) — a projection, not measured.", ""]
    for name, m in rep["models"].items():
        lines += [f"## {name} ({m['checkpoint_bytes'] / GB:.1f} GB bf16 checkpoint; {m['note']})", "",
                  "| old → new | moved GB | peer GB | local GB | store GB | max recv GB | copy ops | "
                  "eager ms | graph ms | P2P GB/s | % d2d | reload ms | reload GB/s | **ratio** | "
                  "projected P2P ms | projected reload ms | projected ratio | ok |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
                  "---: | ---: | ---: | ---: | ---: | --- |"]
        for p in m["pairs"]:
            pl, pr = p["plan"], p["projection"]
            g = p.get("graph_seconds")
            best_GBps = p["bytes_moved"] / p["p2p_seconds"] / GB
            ok = p["ok_eager"] and p.get("ok_graph", True) and p["reload_ok"]
            lines.append(
                f"| {p['old']} → {p['new']} | {p['bytes_moved'] / GB:.2f} | {pl['peer_bytes'] / GB:.2f} | "
                f"{pl['local_bytes'] / GB:.2f} | {pl['store_bytes'] / GB:.2f} | "
                f"{pl['max_receive_bytes'] / GB:.2f} | {p['copy_ops']} | {p['eager_seconds'] * 1e3:.1f} | "
                f"{'–' if g is None else f'{g * 1e3:.1f}'} | {best_GBps:.0f} | "
                f"{100 * best_GBps / rep['ceilings']['d2d_copy_GBps']:.0f} | {p['reload_seconds'] * 1e3:.0f} | "
                f"{p['reload_GBps']:.1f} | **{p['ratio']:.1f}×** | {pr['p2p_seconds'] * 1e3:.2f} | "
                f"{pr['reload_seconds'] * 1e3:.1f} | {pr['ratio']:.1f}× | {ok} |")
        lines.append("")
    if rep.get("skipped"):
        lines += ["Skipped (time budget): " + ", ".join(rep["skipped"]), ""]
    lines += ["## Findings", ""] + [f"- {f}" for f in rep.get("findings", [])] + [""]
    return "\n".join(lines)


def findings(rep: dict) -> list[str]:
    out = []
    ceil = rep["ceilings"]["d2d_copy_GBps"]
    for name, m in rep["models"].items():
        ps = m["pairs"]
        rs = [p["ratio"] for p in ps]
        pj = [p["projection"]["ratio"] for p in ps]
        out.append(f"{name}: measured ratio (one device, all ranks) {min(rs):.1f}–{max(rs):.1f}× "
                   f"(median {statistics.median(rs):.1f}×); projected 8-GPU ratio "
                   f"{min(pj):.1f}–{max(pj):.1f}× (median {statistics.median(pj):.1f}×); store "
                   f"bytes {sum(p['plan']['store_bytes'] for p in ps)} over all pairs.")
        g = [p["graph_seconds"] for p in ps if "graph_seconds" in p]
        e = [p["eager_seconds"] for p in ps]
        if g:
            gb = [p["bytes_moved"] / p["graph_seconds"] / GB for p in ps if "graph_seconds" in p]
            out.append(f"{name}: the copies as one CUDA graph take {min(g) * 1e3:.1f}–{max(g) * 1e3:.1f} ms "
                       f"({100 * min(gb) / ceil:.0f}–{100 * max(gb) / ceil:.0f} % of d2d: bound by the "
                       f"bytes, not the number of copies); issued eagerly from one thread "
                       f"{min(e) * 1e3:.1f}–{max(e) * 1e3:.1f} ms (above the graph where ~2,000 "
                       f"small copies make the issuing loop the bound).")
    for n, m in rep["models"].items():
        if not n.startswith("llama2-7b"):
            continue
        rs = [p["ratio"] for p in m["pairs"]]
        pj = [p["projection"]["ratio"] for p in m["pairs"]]
        met = sum(r >= 5 for r in pj)
        each = ", ".join(f"{p['old']}→{p['new']} {p['projection']['ratio']:.1f}×" for p in m["pairs"])
        out.append(f"Target (the 7B weight part ≥ 5× faster than pinned-host reload): on this one "
                   f"device {min(rs):.1f}–{max(rs):.1f}× (all {len(rs)} pairs); projected for an "
                   f"8-GPU host ≥ 5× for {met} of {len(pj)} pairs "
                   f"({each}).")
    growth = [(n, p) for n, m in rep["models"].items() for p in m["pairs"]
              if T(p["old"]).world_size < T(p["new"]).world_size]
    for n, p in growth:
        pl = p["plan"]
        out.append(f"{n} {p['old']} → {p['new']} (growth onto woken ranks) projects only "
                   f"{p['projection']['ratio']:.1f}×: it is sender-bound — new rank k needs old rank "
                   f"k//2's slices, so each old rank sends to two new ranks (max send "
                   f"{pl['max_send_bytes'] / GB:.2f} GB vs max receive {pl['max_receive_bytes'] / GB:.2f} GB) "
                   "and only new rank 0 keeps its own. Reading part of the woken ranks' shards "
                   "from their own PCIe link at the same time (store bytes > 0 by choice, a "
                   "cost-model split the planner's `reachable` does not make yet) would balance it.")
    out.append("What the single-GPU figure measures: device-to-device copy bandwidth inside one "
               "H200 (all remote and local slices through one HBM), not NVLink. On an 8-GPU host "
               "the weight part would depend on the NVLink rate per direction with every GPU "
               "sending and receiving at once (the 2 × H200 host measured here gives one link "
               "pair, not the 8-way switch fabric), on whether the copies are pulled by peer "
               "access or sent through NCCL (NCCL p2p reached 357–367 GB/s, about a sixth of local "
               "d2d), on the busiest rank's receive and send bytes (the plan's max receive / max "
               "send), and on launch overhead per copy (hundreds of copies per rank: the CUDA-graph "
               "column); the reload side on whether the GPUs' PCIe links are shared by a switch "
               "(the projection gives each GPU its own, at this run's pinned H2D rate: "
               "favourable to reload).")
    return out


def md_from(path: str) -> int:
    """Rewrite the markdown (and findings) of a saved report."""
    src = Path(path)
    rep = json.loads(src.read_text())
    rep["findings"] = findings(rep)
    src.write_text(json.dumps(rep, indent=1, default=str))
    src.with_suffix(".md").write_text(markdown(rep))
    return 0


def run(args) -> dict:
    dev = torch.device("cpu" if args.smoke else args.device)
    t0 = time.perf_counter()
    rep = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "argv": sys.argv[1:], "torch": torch.__version__, "cuda": torch.version.cuda if dev.type == "cuda" else None,
           "device": device_info(dev), "models": {}, "errors": []}
    log("[ceilings] ...")
    rep["ceilings"] = measure_ceilings(dev, small=args.smoke)
    rep["link"] = link_figures(rep["ceilings"])
    log(f"[ceilings] {json.dumps({k: round(v, 1) for k, v in rep['ceilings'].items() if isinstance(v, float)})}")
    pairs = [(T(a), T(b)) for a, b in (SMOKE_PAIRS if args.smoke else PAIRS)]
    if args.pairs:
        pairs = [tuple(T(x) for x in p.split("->")) for p in args.pairs.split(",")]
    for name, (shape, note) in models(args).items():
        cfg = shape.hf()
        need = shape.checkpoint_bytes()
        root = store_root(need, args.store_root)
        t = time.perf_counter()
        store, ref = write_store(root / f"remp-reshard-{name}", cfg, dev, args.file_bytes, seed=7)
        m = {"checkpoint_bytes": need, "note": note, "store_root": str(root),
             "store_write_seconds": time.perf_counter() - t, "pairs": []}
        log(f"[{name}] store {need / GB:.1f} GB written in {m['store_write_seconds']:.1f} s")
        mapped = MappedStore.open(store.path, pin=dev.type == "cuda")
        stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        loader = ShardLoader(mapped, dev, stream=stream)
        m["loader_mode"] = loader.mode
        for old, new in pairs:
            if time.perf_counter() - t0 > args.budget_s:
                rep.setdefault("skipped", []).append(f"{name} {old}->{new}")
                continue
            try:
                p = bench_pair(shape, cfg, old, new, loader, ref, dev, stream, args, rep["link"])
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                rep["errors"].append(f"{name} {old}->{new}: {type(exc).__name__}: {exc}")
                log(f"[{name}] {old} -> {new}: ERROR {exc}")
                continue
            m["pairs"].append(p)
            log(f"[{name}] {old} -> {new}: {p['bytes_moved'] / GB:.2f} GB ({p['copy_ops']} copies) "
                f"eager {p['eager_seconds'] * 1e3:.1f} ms graph "
                f"{p.get('graph_seconds', float('nan')) * 1e3:.1f} ms | reload "
                f"{p['reload_seconds'] * 1e3:.0f} ms ({p['reload_GBps']:.1f} GB/s) | ratio "
                f"{p['ratio']:.1f}x, projected {p['projection']['ratio']:.1f}x | ok "
                f"{p['ok_eager'] and p.get('ok_graph', True) and p['reload_ok']}")
        rep["models"][name] = m
        if args.partial:
            Path(args.partial).write_text(json.dumps(rep, indent=1, default=str))
        del ref, loader
        mapped.close()
        store.close()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    rep["seconds"] = time.perf_counter() - t0
    rep["all_ok"] = not rep["errors"] and all(
        p["ok_eager"] and p.get("ok_graph", True) and p["reload_ok"]
        for m in rep["models"].values() for p in m["pairs"])
    rep["findings"] = findings(rep) if rep["models"] else []
    return rep


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default=None, help="file name tag (default h200-DATE or cpu-smoke)")
    ap.add_argument("--models", default="7b,13b,70b")
    ap.add_argument("--layers-70b", type=int, default=16)
    ap.add_argument("--pairs", default=None, help="OLD->NEW,... (default: a representative set)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--reload-reps", type=int, default=2)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining pairs after this")
    ap.add_argument("--partial", default=None, help="write the report so far here after each model")
    ap.add_argument("--store-root", default="/dev/shm")
    ap.add_argument("--file-bytes", type=int, default=4 << 30)
    a = ap.parse_args(argv)
    if a.smoke:
        a.file_bytes = min(a.file_bytes, 200_000)
        a.reps = min(a.reps, 3)
        a.reload_reps = 1
    return a


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--md-from"]:
        return md_from(argv[1])
    args = parse_args(argv)
    rep = run(args)
    tag = args.tag or ("cpu-smoke" if args.smoke else f"h200-{rep['date'][:10]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"weight_reshard_{tag}.json").write_text(json.dumps(rep, indent=1, default=str))
    md = markdown(rep)
    (out / f"weight_reshard_{tag}.md").write_text(md)
    print(md)
    for e in rep["errors"]:
        print("ERROR", e)
    return 0 if rep["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
