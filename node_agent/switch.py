"""Runs one switch transaction against the live engine, phase by phase (front-end side).

The order and legality of phases come from :mod:`remp.transaction` (one table); each phase is one
typed call into the engine (:class:`~node_agent.engine_plugin.EngineHandle`: pause, or a switch
step the engine core runs on the workers). A failure before SERVING_NEW rolls back to the old
topology with the KV intact and resumes serving; an
:class:`~node_agent.engine_plugin.steps.EngineStepFailed` says in which phase it failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from node_agent.engine_plugin.steps import EngineStepFailed
from remp import logs
from remp.kvplan import layer_bytes
from remp.topology import Topology
from remp.transaction import (Outcome, Phase, Rollback, SwitchMachine, abort_honoured_on_entry,
                              rollback_from)

log = logs.get_logger("remp.node_agent.switch")
PHASE_TIMEOUT_S = 300.0
FIRST_TOKEN_WAIT_S = 30.0


@dataclass
class SwitchRecord:
    switch_id: str
    node: str
    from_topology: Topology
    to_topology: Topology
    outcome: Outcome = Outcome.RUNNING
    phase: Phase = Phase.SERVING_OLD
    timings: list[tuple[Phase, float, float]] = field(default_factory=list)  # phase, wall start, s
    kv_bytes_moved: int = 0
    weight_bytes_loaded: int = 0
    weight_bytes_from_store: int = 0
    weight_bytes_peer: int = 0
    weight_bytes_verified: int = 0
    peak_extra_mem_bytes: int = 0
    layer_kv_bytes: int = 0
    requests_held: int = 0
    requests_preempted: int = 0
    pool_blocks_before: int = 0
    pool_blocks_after: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)
    ranks_woken: list[int] = field(default_factory=list)
    ranks_parked: list[int] = field(default_factory=list)
    requests_in_flight: int = 0
    downtime_s: float = 0.0
    total_s: float = 0.0
    error: tuple[str, str, Phase] | None = None  # code, message, phase
    started_wall: float = 0.0
    finished_wall: float = 0.0
    reason: str = ""
    epoch: int = 0
    overlapped: bool = True
    data_path_s: float = 0.0
    abort_reason: str | None = None  # set by AbortSwitch; honoured at the next phase boundary
    workers: list[dict] = field(default_factory=list)

    def phase_seconds(self) -> dict[str, float]:
        return {p.name: s for p, _, s in self.timings}


@dataclass(frozen=True)
class SwitchEvent:
    switch_id: str
    phase: Phase
    elapsed_s: float
    detail: str = ""
    record: SwitchRecord | None = None


Emit = Callable[[SwitchEvent], Awaitable[None]]


class InjectedFrontEndFault(RuntimeError):
    pass


class SwitchAborted(RuntimeError):
    """An operator aborted the switch before MIGRATE_KV; it rolls back, outcome ``aborted``."""


async def _call(coro, what: str):
    try:
        return await asyncio.wait_for(coro, timeout=PHASE_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{what} did not finish in {PHASE_TIMEOUT_S:.0f} s") from None


async def run_switch(engine, record: SwitchRecord, *, overlap: bool, fault: str, emit: Emit,
                     model_shape, kv_block_bytes_per_head: int) -> SwitchRecord:
    """Drive ``engine`` (an EngineHandle) from ``record.from_topology`` to ``record.to_topology``."""
    tgt = record.to_topology
    m = SwitchMachine(clock=time.monotonic)
    wall0, mono0 = time.time(), time.monotonic()
    record.started_wall, record.overlapped = wall0, overlap

    def wall(mono: float) -> float:
        return wall0 + (mono - mono0)

    async def enter(phase: Phase, detail: str = "") -> None:
        if record.abort_reason is not None and abort_honoured_on_entry(phase):
            raise SwitchAborted(f"aborted before {phase.name}: {record.abort_reason}")
        m.advance(phase)
        record.phase = phase
        log.info("switch.phase", switch_id=record.switch_id, phase=phase.name, detail=detail)
        await emit(SwitchEvent(record.switch_id, phase, m.elapsed(), detail))

    freeze_wall = time.time()
    try:
        await enter(Phase.QUIESCING)
        freeze_wall = time.time()
        await _call(engine.pause(), "QUIESCING")
        if fault == "QUIESCING":
            raise InjectedFrontEndFault("injected fault in QUIESCING")

        await enter(Phase.PREPARING_WORKERS)
        begin = await _call(engine.begin_switch(record.switch_id, tgt.tp, tgt.pp, freeze_wall,
                                                fault), "PREPARING_WORKERS")
        record.requests_in_flight = begin.running
        log.info("switch.quiesced", switch_id=record.switch_id, running=begin.running,
                 waiting=begin.waiting)

        old_w, new_w = record.from_topology.world_size, tgt.world_size
        record.ranks_woken = list(range(old_w, new_w))
        record.ranks_parked = list(range(new_w, old_w))
        await enter(Phase.MPU_APPLIED, _ranks_detail(record))
        await _call(engine.activate(tgt.tp, tgt.pp, fault), "MPU_APPLIED")

        await enter(Phase.MIGRATE_KV, "concurrent with RELOAD_SHARDS" if overlap else "")
        if overlap:
            await enter(Phase.RELOAD_SHARDS, "concurrent with MIGRATE_KV")
        dp = await _call(engine.data_path(overlap, fault), "data path")
        workers = dp.workers
        record.workers = list(workers)
        log.info("switch.data_path", switch_id=record.switch_id, live_blocks=dp.live_blocks,
                 workers=[{k: w.get(k) for k in ("rank", "kv_seconds", "reload_seconds",
                                                 "reload_breakdown", "weights")}
                          for w in workers])
        kv_window = (min(w["kv_window"][0] for w in workers), max(w["kv_window"][1] for w in workers))
        rl_window = (min(w["reload_window"][0] for w in workers),
                     max(w["reload_window"][1] for w in workers))
        if not overlap:
            await enter(Phase.RELOAD_SHARDS, "after MIGRATE_KV")
        m.mark(Phase.MIGRATE_KV, *kv_window)
        m.mark(Phase.RELOAD_SHARDS, *rl_window)
        record.data_path_s = max(w["seconds"] for w in workers)
        record.kv_bytes_moved = sum(w["kv"]["bytes_sent"] for w in workers)
        record.weight_bytes_loaded = sum(w.get("weight_bytes", 0) for w in workers)
        weights = [w.get("weights") or {} for w in workers]
        record.weight_bytes_from_store = sum(x.get("store_bytes", 0) for x in weights)
        record.weight_bytes_peer = sum(x.get("peer_recv_bytes", 0) for x in weights)
        record.weight_bytes_verified = sum(x.get("verified_bytes", 0) for x in weights)
        record.peak_extra_mem_bytes = max(w["kv"]["peak_extra_bytes"] for w in workers)
        record.layer_kv_bytes = layer_bytes(model_shape.num_kv_heads, dp.num_blocks,
                                            kv_block_bytes_per_head)
        record.pool_blocks_before = dp.num_blocks
        record.pool_blocks_after = dp.new_num_blocks

        await enter(Phase.REBINDING)
        rb = await _call(engine.rebind(fault), "REBINDING")
        engine.set_topology(tgt.tp, tgt.pp)
        record.requests_preempted = rb.preempted
        record.preempted_request_ids = list(rb.displaced)
        record.pool_blocks_after = rb.num_blocks
        if record.pool_blocks_after != record.pool_blocks_before:
            log.info("switch.pool_resized", switch_id=record.switch_id,
                     blocks_before=record.pool_blocks_before, blocks_after=record.pool_blocks_after,
                     displaced=record.preempted_request_ids, renumbered=rb.renumbered,
                     ranks_woken=record.ranks_woken, ranks_parked=record.ranks_parked)
        record.requests_held = rb.held
        await _call(engine.resume(), "resume")
        await enter(Phase.SERVING_NEW)
        record.outcome = Outcome.SUCCEEDED
    except Exception as exc:  # noqa: BLE001 - every failure before SERVING_NEW rolls back
        # the engine says where it failed (MIGRATE_KV and RELOAD_SHARDS may run at once)
        failed_at = exc.phase if isinstance(exc, EngineStepFailed) else record.phase
        log.warning("switch.failed", switch_id=record.switch_id, phase=failed_at.name,
                    error=f"{type(exc).__name__}: {exc}")
        record.error = (_code(exc), f"{type(exc).__name__}: {exc}"[:500], failed_at)
        rollback = rollback_from(record.phase)
        if rollback is Rollback.NOTHING:  # aborted before anything happened
            m.advance(Phase.ROLLED_BACK)
            record.phase, record.outcome = Phase.ROLLED_BACK, Outcome.ROLLED_BACK
        else:
            await _roll_back(engine, record, m, enter, rollback.touches_workers)
        if record.outcome == Outcome.ROLLED_BACK and isinstance(exc, SwitchAborted):
            record.outcome = Outcome.ABORTED
    if record.outcome == Outcome.SUCCEEDED:
        # serving on the new topology already: what follows only measures and tidies up
        try:
            await _call(engine.commit_switch(), "commit")
        except Exception as exc:  # noqa: BLE001 - old objects stay referenced; harmless
            log.warning("switch.commit_failed", switch_id=record.switch_id, error=repr(exc))
        start = min(freeze_wall, rb.first_held_arrival or freeze_wall)
        if rb.in_flight or rb.held:
            first = await _first_token(engine)
            record.downtime_s = (first or time.time()) - start
        else:
            record.downtime_s = wall(m.started[Phase.SERVING_NEW]) - start
    record.timings = [(p, wall(t), s) for p, t, s in m.timings()]
    record.total_s = m.elapsed()
    record.finished_wall = time.time()
    await emit(SwitchEvent(record.switch_id, record.phase, record.total_s, record.outcome, record))
    return record


def _ranks_detail(record: SwitchRecord) -> str:
    parts = []
    if record.ranks_woken:
        parts.append(f"waking ranks {record.ranks_woken} (STANDBY → ACTIVE)")
    if record.ranks_parked:
        parts.append(f"parking ranks {record.ranks_parked} (ACTIVE → STANDBY)")
    return "; ".join(parts)


async def _roll_back(engine, record: SwitchRecord, m: SwitchMachine, enter, touched: bool) -> None:
    from_ = record.from_topology
    try:
        await enter(Phase.ROLLING_BACK)
        if touched:
            await _call(engine.rollback_switch(), "rollback")
        engine.set_topology(from_.tp, from_.pp)
        await _call(engine.resume(), "resume")
        await enter(Phase.ROLLED_BACK)
        record.outcome = Outcome.ROLLED_BACK
    except Exception as exc:  # noqa: BLE001 - the engine is in an unknown state
        log.error("switch.rollback_failed", switch_id=record.switch_id, error=repr(exc))
        record.error = ("ROLLBACK_FAILED", f"{type(exc).__name__}: {exc}"[:500], record.phase)
        if m.can(Phase.FAILED):
            await enter(Phase.FAILED)
        record.outcome = Outcome.FAILED


async def _first_token(engine) -> float | None:
    deadline = time.monotonic() + FIRST_TOKEN_WAIT_S
    while time.monotonic() < deadline:
        t = await engine.first_token_wall()
        if t is not None:
            return t
        await asyncio.sleep(0.002)
    return None


def _code(exc: BaseException) -> str:
    name = type(exc).__name__
    if isinstance(exc, SwitchAborted):
        return "ABORTED"
    if "InjectedFault" in name or "InjectedFrontEndFault" in name or "injected fault" in str(exc):
        return "INJECTED_FAULT"
    if isinstance(exc, TimeoutError):
        return "PHASE_TIMEOUT"
    return "SWITCH_FAILED"
