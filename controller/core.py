"""The controller: registration and leases, planning, and the switch driver with its Redis
state machine and crash recovery. Proto- and gRPC-free: it takes and returns the dataclasses of
:mod:`controller.model` (the servicer converts); talks to Redis through :class:`Store` and to
agents through an :class:`~controller.ports.AgentPort` (over gRPC: :class:`AgentClients`).

A switch's life in Redis (every step one compare-and-set script, its event appended atomically):
ACCEPTED (current slot taken, epoch +1) → DISPATCHED (written *before* ExecuteSwitch is sent) →
each phase the agent streams → finished (outcome, record, observed topology, slot freed).
After a crash the controller never re-sends: it asks the agent (GetSwitch) what happened.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from controller.config import ControllerSettings
from controller.convert import from_json, to_json
from controller.leader import Solo
from controller.model import (AbortResult, EngineInfo, Error, Event, EventType, Heartbeat,
                              HostFacts, ModelFacts, NodeHealth, NodeState, ReconfigureResult,
                              Recovery, RecoveryDecision, Registration, SwitchOrder,
                              SwitchProgress, SwitchRecord, TrafficSample)
from controller.planner import NodeFacts, Plan, check_target, plan_switch
from controller.ports import AgentPort
from controller.store import EVENTS_MAXLEN, Store, SwitchRow, decode_reg, parse_event
from controller.validation import NODE_NAME, journal_entries
from controller.watch import EventHub, WatchLimits, id_key, maybe_trimmed, stream_id
from remp import logs
from remp import metrics
from remp import validate
from remp.errors import (FailedPrecondition, InvalidArgument, NotFound, RempError,
                         ResourceExhausted, Unavailable, not_sent)
from remp.topology import ModelShape, Topology
from remp.transaction import (Outcome, Phase, abort_accepted, finished_outcomes,
                              rolled_back_outcomes)

log = logs.get_logger("remp.controller")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FINISH_EVENT = {
    Outcome.SUCCEEDED: EventType.SWITCH_DONE,
    Outcome.NOOP: EventType.SWITCH_DONE,
    Outcome.ROLLED_BACK: EventType.SWITCH_ROLLED_BACK,
    Outcome.ABORTED: EventType.SWITCH_ABORTED,
    Outcome.FAILED: EventType.SWITCH_FAILED,
    Outcome.UNKNOWN: EventType.SWITCH_FAILED,
}
MAX_PAGE = 1000
DEFAULT_PAGE = 50


NO_TOPOLOGY = Topology(0, 0)  # what an unset topology field reads as


def topo_str(t: Topology | None) -> str:
    t = t or NO_TOPOLOGY
    return f"TP{t.tp}PP{t.pp}"


def topo_parse(s: str) -> Topology:
    return Topology.parse(s) if s else NO_TOPOLOGY


def _now_ns(wall: float | None = None) -> int:
    return int((wall or time.time()) * 1e9)


def facts_of(reg: Registration, engine: EngineInfo | None) -> NodeFacts:
    m = reg.model or ModelFacts()
    shape = ModelShape(m.num_layers, m.num_attention_heads, m.num_kv_heads, m.hidden_size,
                       m.head_size)
    block_size = engine.block_size if engine is not None else 16
    live = (engine.num_blocks - engine.free_blocks) if engine is not None else 0
    return NodeFacts(
        shape=shape, devices=(reg.host or HostFacts()).device_count,
        candidates=tuple(Topology(c.tp, c.pp) for c in reg.candidates),
        weight_bytes=m.weight_bytes,
        kv_bytes_per_block_head=block_size * 2 * m.head_size * DTYPE_BYTES.get(m.dtype, 4),
        live_blocks=live, kv_bandwidth_bps=reg.kv_bandwidth_bps,
        weight_bandwidth_bps=reg.weight_bandwidth_bps)


class Controller:
    """``store``: the switch lane (Reconfigure, Abort, the driver, recovery); ``leases``:
    registration, heartbeats and lease expiry; ``reads``: the read RPCs; ``hub``: the one
    event reader behind every Watch stream. Each has its own Redis connections (default: all
    ``store``'s)."""

    def __init__(self, settings: ControllerSettings, store: Store, agents: AgentPort,
                 clock=time.time, *, leases: Store | None = None, reads: Store | None = None,
                 hub: EventHub | None = None):
        self.s, self.store, self.agents, self.clock = settings, store, agents, clock
        self.leases, self.reads = leases or store, reads or store
        self.hub = hub or EventHub(store, settings.watch_queue_events)
        self.hub.on_drop = lambda n: metrics.controller().watch_dropped.inc(n)
        self.watch_limits = WatchLimits(settings.watch_max_per_caller, settings.watch_max_total)
        self._tasks: set[asyncio.Task] = set()
        self._cache: dict[str, NodeState] = {}  # last known, for stale reads
        # the leader's last read of each node's hash (reg, observed, ...) that Reconfigure
        # plans from without reading it again; the slot-taking script checks it is still
        # current (registration and observed topology), else it is read afresh
        self._known: dict[str, tuple[dict[str, str], Registration]] = {}
        self._paused = asyncio.Event()  # test hook: set when a driver froze
        self._t: dict[str, dict[str, float]] = {}  # per-switch driver timestamps (logged)
        from controller.recovery import RecoveryCoordinator
        from controller.rollouts import Rollouts

        self.recovery = RecoveryCoordinator(self)
        self.rollouts = Rollouts(self)
        # controller HA (controller.leader): who may write and drive; one controller: always
        self.leadership = Solo()
        self._hub_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def start(self, lead: bool = True) -> None:
        """The event reader (Watch streams; every controller serves them), and, when this
        controller leads (``lead``; with controller HA the lease loop calls :meth:`lead`
        instead), the leader's work."""
        self._hub_task = asyncio.create_task(self.hub.run())
        if lead:
            await self.lead()

    async def lead(self) -> None:
        """Taking over: recover unfinished switches (each finished or rolled back from its
        agent's truth, never run twice), start the lease sweeper, resume active rollouts."""
        self._known.clear()
        for sid in await self.store.unfinished():
            row = await self.store.switch(sid)
            if row is not None:
                log.info("controller.recovering", switch_id=sid, phase=Phase(row.phase).name,
                         dispatched=row.dispatched)
                self.spawn(self._reconcile_forever(row))
        self.spawn(self._sweep_leases())
        self.spawn(self._keep_switch_lane_warm())
        await self.rollouts.resume_all()

    async def step_down(self) -> None:
        """No longer the leader: every driver stops (the agents finish their switches alone;
        the next leader reconciles them and resumes the rollouts)."""
        await self._cancel_tasks()
        self.rollouts.forget_drivers()
        self._known.clear()

    async def stop(self) -> None:
        await self._cancel_tasks()
        if self._hub_task is not None:
            self._hub_task.cancel()
            await asyncio.gather(self._hub_task, return_exceptions=True)

    async def _cancel_tasks(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ nodes
    async def register(self, req: Registration) -> tuple[float, int]:
        _check_registration(req)
        ev = self._event(EventType.NODE_REGISTERED, req.node,
                         detail=f"{req.agent_address} {topo_str(req.topology)}")
        # the stored registration leaves last_epoch out (it changes with every switch; the
        # begin script compares the stored registration with the one a plan was made from)
        epoch = await self.leases.register(req.node, replace(req, last_epoch=0),
                                           self.clock() + self.s.lease_seconds,
                                           topo_str(req.topology), ev, req.last_epoch)
        await self.leases.clear_draining(req.node)
        log.info("controller.node_registered", node=req.node, agent=req.agent_address,
                 topology=topo_str(req.topology))
        return self.s.lease_seconds, epoch

    async def heartbeat(self, req: Heartbeat) -> float:
        if not req.node:
            raise InvalidArgument("node is required")
        t = req.topology
        observed = topo_str(t) if t is not None and t.tp and t.pp else ""
        traffic = to_json(req.traffic) if req.traffic is not None else ""
        workers = to_json(Heartbeat(workers=req.workers)) if req.workers else ""
        await self.leases.heartbeat(req.node, self.clock() + self.s.lease_seconds, observed,
                                    traffic, req.topology_epoch, workers)
        # the journal a lost node's requests are recovered from (replaced every heartbeat)
        kept, dropped = journal_entries(req.inflight)
        if dropped:
            log.warning("controller.journal_entries_dropped", node=req.node, dropped=dropped,
                        kept=len(kept), detail="request id unusable or journal over its budget;"
                        " these cannot be recovered if the node is lost")
        await self.leases.set_inflight(req.node, to_json(Heartbeat(inflight=tuple(kept))))
        return self.s.lease_seconds

    def _state(self, name: str, h: dict[str, str], current: SwitchRow | None) -> NodeState:
        reg = decode_reg(h)
        health = NodeHealth.READY
        if h.get("health") == "lost":
            health = NodeHealth.LOST
        elif h.get("current"):
            health = NodeHealth.SWITCHING
        lease_until = float(h.get("lease_until", 0) or 0)
        return NodeState(
            node=name, agent_address=reg.agent_address, http_address=reg.http_address,
            desired=topo_parse(h.get("desired", "")), observed=topo_parse(h.get("observed", "")),
            candidates=reg.candidates, health=health,
            lease_age_seconds=max(0.0, self.clock() - (lease_until - self.s.lease_seconds)),
            epoch=int(h.get("epoch", 0) or 0), host=reg.host or HostFacts(),
            model=reg.model or ModelFacts(), recommendation=h.get("recommendation", ""),
            labels=reg.labels, rollout_id=h.get("rollout", ""),
            workers=from_json(h["workers"], Heartbeat).workers if h.get("workers") else (),
            current_switch=(from_json(current.record_json, SwitchRecord)
                            if current is not None else None))

    async def get_state(self, name: str) -> NodeState:
        if not name:
            raise InvalidArgument("node is required")
        try:
            h = await self.reads.node(name)
            if h is None:
                raise NotFound(f"unknown node {name!r} (ListNodes shows the registered ones)")
            cur = await self.reads.switch(h["current"]) if h.get("current") else None
        except Unavailable:
            if name in self._cache:
                return replace(self._cache[name], stale=True)
            raise
        st = self._state(name, h, cur)
        self._cache[name] = st
        return st

    async def list_nodes(self) -> list[NodeState]:
        try:
            rows = await self.reads.nodes()
            out = []
            for name, h in rows.items():
                cur = await self.reads.switch(h["current"]) if h.get("current") else None
                out.append(self._state(name, h, cur))
        except Unavailable:
            if not self._cache:
                raise
            return [replace(st, stale=True) for st in self._cache.values()]
        for st in out:
            self._cache[st.node] = st
        return out

    async def _node(self, name: str, store: Store | None = None
                    ) -> tuple[dict[str, str], Registration]:
        if not name:
            raise InvalidArgument("node is required")
        h = await (store or self.store).node(name)
        if h is None:
            raise NotFound(f"unknown node {name!r} (ListNodes shows the registered ones)")
        return h, decode_reg(h)

    # ------------------------------------------------------------------ planning
    async def plan(self, name: str, target: Topology) -> Plan:
        h, reg = await self._node(name, self.reads)
        _check_topology_fields(target)
        engine = None
        try:
            # an agent whose engine is still starting reports no engine facts: all zeros
            engine = (await self.agents.describe(reg.agent_address)).engine or EngineInfo()
        except Unavailable:
            log.info("controller.plan_without_engine_facts", node=name)
        current = Topology.parse(h.get("observed") or topo_str(reg.topology))
        return plan_switch(facts_of(reg, engine), current, Topology(target.tp, target.pp),
                           await self._phase_history(name))

    async def _phase_history(self, name: str, n: int = 20) -> dict[Phase, list[float]]:
        hist: dict[Phase, list[float]] = {}
        for row in await self.reads.history(name, 0, n):
            if row.outcome != Outcome.SUCCEEDED:
                continue
            rec = from_json(row.record_json, SwitchRecord)
            for pt in rec.phase_timings:
                hist.setdefault(Phase(pt.phase), []).append(pt.seconds)
        return hist

    # ------------------------------------------------------------------ switching
    async def reconfigure(self, name: str, target: Topology, request_id: str,
                          reason: str) -> ReconfigureResult:
        self.leadership.require()
        tl = {"rpc_in": time.perf_counter()}  # this switch's timeline (logged when it finishes)
        for _ in range(4):  # the first may have planned from this controller's last read
            resp = await self._reconfigure(name, target, request_id, reason, tl)
            if resp is not None:
                return resp
        raise FailedPrecondition(f"the topology of node {name!r} kept changing while the "
                                 "switch was being planned; retry")

    async def _reconfigure(self, name: str, target: Topology, request_id: str,
                           reason: str, tl: dict[str, float]) -> ReconfigureResult | None:
        """One attempt; None when the node's topology changed between reading it and taking
        the switch slot (the decision — noop or from which topology — is made again).

        Accept first, check asynchronously: what Redis knows is checked before the answer
        (unknown node, target, a duplicate request id, lost, draining — one round trip, none
        when this leader read the node before: the slot-taking script then checks that the
        registration and the observed topology are still those, and lost, draining, busy and
        held by a rollout as always); the switch is then recorded (acknowledged by a replica
        when configured) and answered. The driver then asks the agent's health while it
        writes the intent to dispatch; an agent that does not answer SERVING ends the switch
        ROLLED_BACK before anything is sent (``AGENT_UNAVAILABLE``: the node keeps its
        topology)."""
        if not name:
            raise InvalidArgument("node is required")
        prev, known = None, self._known.get(name)
        if known is not None:
            h, reg = known
        else:
            h, prev = await self.store.node_and_request(name, request_id)
            if h is None:
                raise NotFound(f"unknown node {name!r} (ListNodes shows the registered ones)")
            reg = decode_reg(h)
            self._known[name] = (h, reg)
        tl["node_read"] = time.perf_counter()
        _check_topology_fields(target)
        current = Topology.parse(h.get("observed") or topo_str(reg.topology))
        tgt = Topology(target.tp, target.pp)
        if known and (tgt == current or h.get("health") == "lost" or h.get("draining") == "1"):
            self._known.pop(name, None)  # a noop or a refusal: decided on a fresh read
            return None
        try:
            check_target(facts_of(reg, None), current, tgt)
        except InvalidArgument:
            if not known:
                raise
            self._known.pop(name, None)  # a refusal: decided on a fresh read
            return None
        if prev:
            return ReconfigureResult(switch_id=prev, duplicate=True)
        if h.get("health") == "lost":
            raise Unavailable(f"node {name!r} is lost (its lease expired); it must re-register")
        if h.get("draining") == "1":
            raise FailedPrecondition(f"node {name!r} is draining; it must re-register to serve")
        sid = "sw-" + uuid.uuid4().hex[:16]
        now = self.clock()
        rec = SwitchRecord(
            switch_id=sid, node=name, from_topology=current, to_topology=tgt,
            outcome=Outcome.RUNNING, phase=Phase.SERVING_OLD, started_at=_now_ns(now),
            request_id=request_id, reason=reason)
        if tgt == current and not h.get("current"):
            rec = replace(rec, outcome=Outcome.NOOP, finished_at=_now_ns(now))
            ev = self._event(EventType.SWITCH_DONE, name, sid, rec=rec,
                             detail="noop: target is the current topology")
            status, other = await self.store.noop(name, sid, request_id, to_json(rec), now, ev)
            if status == "dup":
                return ReconfigureResult(switch_id=other, duplicate=True)
            return ReconfigureResult(switch_id=sid, noop=True)
        ev = self._event(EventType.SWITCH_PHASE, name, sid,
                         phase=Phase.SERVING_OLD, detail=f"accepted {current} → {tgt}")
        # the intent to send is written with the switch (one write less on the control path)
        # unless a test pause point wants the accepted-not-dispatched state to exist
        dispatched = not self.s.test_pause_at
        status, other = await self.store.begin(name, sid, request_id, to_json(rec), now,
                                               str(tgt), ev, observed=h.get("observed", ""),
                                               reg_json=h.get("reg", ""), dispatched=dispatched)
        if status != "ok":
            self._known.pop(name, None)
        if status == "notfound":
            raise NotFound(f"unknown node {name!r}")
        if status == "dup":
            return ReconfigureResult(switch_id=other, duplicate=True)
        if status == "lost":
            raise Unavailable(f"node {name!r} is lost (its lease expired); it must re-register")
        if status == "draining":
            raise FailedPrecondition(f"node {name!r} is draining; it must re-register to serve")
        if status == "busy":
            raise FailedPrecondition(f"switch {other} is running on node {name}; wait for it "
                                     "(Watch) or abort it")
        if status == "held":
            raise FailedPrecondition(f"node {name} is held by rollout {other}: only its own "
                                     "switches run there (ControlRollout ABORT it, or wait)")
        if status == "moved":
            log.info("controller.topology_moved", node=name, read=str(current), now=other)
            return None
        rec = replace(rec, epoch=int(other))
        tl["begun"] = time.perf_counter()
        self._t[sid] = tl
        log.info("controller.switch_accepted", switch_id=sid, node=name, target=str(tgt),
                 epoch=rec.epoch, request_id=request_id)
        self.spawn(self._drive(reg.agent_address, rec, dispatched))
        return ReconfigureResult(switch_id=sid)

    async def _pause_point(self, name: str) -> None:
        if self.s.test_pause_at == name:
            log.warning("controller.test_paused", at=name)
            self._paused.set()
            await asyncio.Event().wait()  # until the test kills us

    async def _drive(self, address: str, rec: SwitchRecord, dispatched: bool = False) -> None:
        """Dispatch the accepted switch and follow the agent's progress to the finished record.
        Unless this controller holds a live connection to the agent (its channel READY), the
        agent's health is asked while the intent to dispatch is written; an agent that is not
        SERVING, or that ExecuteSwitch cannot connect to, ends the switch before anything is
        sent (ROLLED_BACK, AGENT_UNAVAILABLE). A connected agent whose engine is not serving
        refuses the order itself (ROLLED_BACK, AGENT_REFUSED). Phases the agent reported while
        the previous write was under way are written together (one script, every event
        kept). ``dispatched``: the intent to send was written with the switch (begin)."""
        sid = rec.switch_id
        self._t.setdefault(sid, {})["accepted"] = time.perf_counter()
        health = None if self.agents.connected(address) else \
            asyncio.ensure_future(self.agents.check_serving(address))
        pump = None
        try:
            if not dispatched:
                await self._pause_point("ACCEPTED")
                if not await self.store.dispatch(sid):
                    log.info("controller.not_dispatched", switch_id=sid)  # aborted meanwhile
                    return
                self._t[sid]["dispatch_written"] = time.perf_counter()
                await self._pause_point("DISPATCHED")
            if not await self._agent_serving(rec, health):
                return
            order = SwitchOrder(target=rec.to_topology, switch_id=sid, epoch=rec.epoch,
                                reason=rec.reason)
            phase, final = Phase.SERVING_OLD, None
            self._t[sid]["dispatched"] = time.perf_counter()
            pump = _Pump(self.agents.execute_switch(address, order))
            one = bool(self.s.test_pause_at)  # pause points: every phase written alone
            while final is None:
                steps: list[tuple[int, str]] = []  # phases reported, not written yet
                end = None  # _EOF or the exception that ended the stream
                for item in await pump.take(one):
                    if not isinstance(item, SwitchProgress):
                        end = item
                        break
                    self._t[sid].setdefault("first_event", time.perf_counter())
                    if item.record is not None:
                        final = item.record
                        self._t[sid]["final_event"] = time.perf_counter()
                        break
                    if item.phase != (steps[-1][0] if steps else phase):
                        steps.append((item.phase, item.detail))
                if steps:
                    rec = await self._advance_many(rec, phase, steps)
                    phase = rec.phase
                    await self._pause_point(Phase(phase).name)
                if end is _EOF:
                    break
                if isinstance(end, RempError):  # the stream failed: the agent's answer, typed
                    err = end
                    if isinstance(err, Unavailable) and final is None \
                            and phase == Phase.SERVING_OLD and not_sent(err):
                        # the call never reached the agent (no connection could be made)
                        await self._agent_unavailable(rec, Unavailable(
                            f"agent at {address} unreachable: {err.details or err}"))
                        return
                    if isinstance(err, (FailedPrecondition, InvalidArgument)) and final is None \
                            and phase == Phase.SERVING_OLD:
                        # the agent refused before starting (busy, stale epoch, invalid target)
                        rec = replace(rec, outcome=Outcome.ROLLED_BACK, phase=Phase.ROLLED_BACK,
                                      error=Error(code="AGENT_REFUSED",
                                                  message=err.details or str(err),
                                                  phase=Phase.SERVING_OLD))
                        await self._finish(rec)
                        return
                    log.warning("controller.stream_lost", switch_id=sid, code=err.code.name)
                    row = await self.store.switch(sid)
                    if row is not None:
                        await self._reconcile_forever(row)
                    return
                if end is not None:
                    raise end
            if final is None:
                row = await self.store.switch(sid)
                if row is not None:
                    await self._reconcile_forever(row)
                return
            await self._finish(_merge(rec, final))
        except asyncio.CancelledError:
            raise
        except Unavailable as exc:
            # Redis went away mid-switch: the agent finishes on its own; recovery (on restart
            # or the retry below) completes the record from the agent's truth.
            log.error("controller.redis_lost_mid_switch", switch_id=sid, error=str(exc))
            row = None
            while row is None:
                await asyncio.sleep(1.0)
                try:
                    row = await self.store.switch(sid)
                except Unavailable:
                    continue
            await self._reconcile_forever(row)
        except Exception as exc:  # noqa: BLE001 - keep the controller up; record stays unfinished
            log.error("controller.driver_failed", switch_id=sid, error=repr(exc))
        finally:
            _drop(health)
            if pump is not None:
                pump.close()

    async def _agent_serving(self, rec: SwitchRecord, health: asyncio.Future | None) -> bool:
        """Whether the agent answered its health check SERVING (None: not asked, the agent is
        connected); if not, the switch is finished ROLLED_BACK before anything was sent
        (AGENT_UNAVAILABLE, retryable)."""
        if health is None:
            return True
        try:
            await health
        except RempError as exc:  # check_serving: Unavailable (unreachable, not serving)
            self._t.get(rec.switch_id, {})["agent_checked"] = time.perf_counter()
            await self._agent_unavailable(rec, exc)
            return False
        self._t.get(rec.switch_id, {})["agent_checked"] = time.perf_counter()
        return True

    async def _agent_unavailable(self, rec: SwitchRecord, exc: RempError) -> None:
        """The switch ends ROLLED_BACK before anything reached the agent (retryable)."""
        log.warning("controller.agent_check_failed", switch_id=rec.switch_id,
                    node=rec.node, phase="SERVING_OLD", error=str(exc))
        await self._finish(replace(
            rec, outcome=Outcome.ROLLED_BACK, phase=Phase.ROLLED_BACK, error=Error(
                code="AGENT_UNAVAILABLE",
                message=(f"{exc}; the switch was not sent: node {rec.node} keeps "
                         f"{topo_str(rec.from_topology)}")[:1024],
                phase=Phase.SERVING_OLD, retryable=True)))

    async def _advance(self, rec: SwitchRecord, expected: int, phase: int,
                       detail: str) -> SwitchRecord:
        """``rec`` in ``phase``, persisted (compare-and-set on the ``expected`` phase)."""
        return await self._advance_many(rec, expected, [(phase, detail)])

    async def _advance_many(self, rec: SwitchRecord, expected: int,
                            steps: list[tuple[int, str]]) -> SwitchRecord:
        """``rec`` through each (phase, detail) of ``steps``, each with its event, persisted
        in one compare-and-set on the ``expected`` phase; ``rec`` in the last phase."""
        rec = replace(rec, phase=steps[-1][0])
        evs = [(phase, self._event(EventType.SWITCH_PHASE, rec.node, rec.switch_id,
                                   phase=phase, detail=detail)) for phase, detail in steps]
        if not await self.store.advance_many(rec.switch_id, expected, evs, to_json(rec)):
            raise FailedPrecondition(f"switch {rec.switch_id} changed under us (another "
                                     "controller, or an abort)")
        return rec

    async def _finish(self, rec: SwitchRecord) -> None:
        # the outcome recorded: anything not final (RUNNING, unset) is UNKNOWN
        outcome = rec.outcome if rec.outcome in finished_outcomes() else Outcome.UNKNOWN
        if rec.finished_at is None:
            rec = replace(rec, finished_at=_now_ns())
        observed = ""
        if outcome is Outcome.SUCCEEDED:
            observed = topo_str(rec.to_topology)
        elif outcome in rolled_back_outcomes():
            observed = topo_str(rec.from_topology)
        ev = self._event(FINISH_EVENT[outcome], rec.node, rec.switch_id, phase=rec.phase, rec=rec,
                         detail=outcome)
        done = await self.store.finish(rec.switch_id, rec.node, outcome, rec.phase, to_json(rec),
                                       observed, ev)
        if done:
            metrics.controller().observe(_switch_facts(rec, outcome))
            if observed and rec.node in self._known:  # the next switch plans from it
                h, reg = self._known[rec.node]
                self._known[rec.node] = ({**h, "observed": observed, "current": ""}, reg)
        t = self._t.pop(rec.switch_id, {})
        t["finished"] = time.perf_counter()
        t0 = t.get("rpc_in", t.get("accepted", t["finished"]))
        log.info("controller.switch_finished", switch_id=rec.switch_id, outcome=outcome,
                 recorded=done, total_s=round(rec.total_seconds, 3),
                 t0_mono=round(t0, 6),
                 t0_wall=round(time.time() - (time.perf_counter() - t0), 6),
                 controller_ms={k: round((v - t0) * 1e3, 2) for k, v in t.items()})

    async def _reconcile_forever(self, row: SwitchRow) -> None:
        """Complete an unfinished switch from the agent's truth; retry while it is unreachable."""
        delay = 0.2
        while True:
            try:
                if await self._reconcile(row):
                    return
            except Unavailable as exc:
                log.info("controller.reconcile_retry", switch_id=row.switch_id, error=str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _reconcile(self, row: SwitchRow) -> bool:
        rec = from_json(row.record_json, SwitchRecord)
        if row.outcome != Outcome.RUNNING:
            return True
        if not row.dispatched:
            # the intent to send was never written: ExecuteSwitch was never sent
            await self._finish(replace(
                rec, outcome=Outcome.ABORTED, phase=Phase.ROLLED_BACK, error=Error(
                    code="NOT_DISPATCHED", message=("the controller stopped before sending the "
                                                    "switch to the agent; not re-sent"),
                    phase=Phase.SERVING_OLD, retryable=True)))
            return True
        h = await self.store.node(row.node)
        reg = decode_reg(h or {})
        agent_rec = await self.agents.get_switch(reg.agent_address, row.switch_id)
        if agent_rec is None:
            d = await self.agents.describe(reg.agent_address)
            if (d.topology or NO_TOPOLOGY) == (rec.to_topology or NO_TOPOLOGY):
                rec = replace(rec, outcome=Outcome.UNKNOWN)
                msg = "the agent has no record of it (restarted?) but runs the target topology"
            else:
                rec = replace(rec, outcome=Outcome.ABORTED, phase=Phase.ROLLED_BACK)
                msg = "the agent never received it; not re-sent"
            await self._finish(replace(rec, error=Error(code="NOT_RECEIVED", message=msg,
                                                        phase=rec.phase, retryable=True)))
            return True
        while agent_rec.outcome == Outcome.RUNNING:
            if agent_rec.phase != row.phase:
                try:
                    rec = await self._advance(rec, row.phase, agent_rec.phase, "recovered")
                    row.phase = rec.phase
                except FailedPrecondition:
                    return True  # someone else completed it
            await asyncio.sleep(0.1)
            agent_rec = await self.agents.get_switch(reg.agent_address, row.switch_id)
            if agent_rec is None:
                return False
        await self._finish(_merge(rec, agent_rec))
        return True

    async def abort(self, switch_id: str, reason: str) -> AbortResult:
        self.leadership.require()
        if not switch_id:
            raise InvalidArgument("switch_id is required")
        row = await self.store.switch(switch_id)
        if row is None:
            raise NotFound(f"no switch with id {switch_id!r}")
        if row.outcome != Outcome.RUNNING:
            raise FailedPrecondition(f"switch {switch_id} has finished ({row.outcome})")
        rec = from_json(row.record_json, SwitchRecord)
        if not row.dispatched:
            await self._finish(replace(
                rec, outcome=Outcome.ABORTED, phase=Phase.ROLLED_BACK,
                error=Error(code="ABORTED", message=reason or "aborted",
                            phase=Phase.SERVING_OLD)))
            return AbortResult(aborted=True, phase=Phase.SERVING_OLD)
        if not abort_accepted(row.phase):
            raise FailedPrecondition(f"switch {switch_id} is in PHASE_{Phase(row.phase).name}:"
                                     " abort is allowed only before MIGRATE_KV starts")
        h = await self.store.node(row.node)
        # the agent's refusal (e.g. FailedPrecondition: it moved on to MIGRATE_KV) is passed on
        try:
            r = await self.agents.abort_switch(decode_reg(h or {}).agent_address, switch_id,
                                               reason)
        except NotFound:
            # written as sent (with the switch), not at the agent yet: a moment from now it is
            raise FailedPrecondition(f"switch {switch_id} is on its way to the agent of node "
                                     f"{row.node}; retry the abort") from None
        return AbortResult(aborted=r.aborted, phase=r.phase)

    async def get_switch(self, switch_id: str) -> SwitchRecord:
        if not switch_id:
            raise InvalidArgument("switch_id is required")
        row = await self.reads.switch(switch_id)
        if row is None:
            raise NotFound(f"no switch with id {switch_id!r}")
        return from_json(row.record_json, SwitchRecord)

    async def list_switches(self, node: str, page_size: int, page_token: str
                            ) -> tuple[list[SwitchRecord], str]:
        size = page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            raise InvalidArgument(f"page_size must be at most {MAX_PAGE}")
        try:
            offset = int(page_token) if page_token else 0
            if not 0 <= offset < 2**31:
                raise ValueError
        except ValueError:
            raise InvalidArgument("page_token is not one this server returned") from None
        if node and await self.reads.node(node) is None:
            raise NotFound(f"unknown node {node!r}")
        rows = await self.reads.history(node or None, offset, size)
        total = await self.reads.history_count(node or None)
        nxt = str(offset + size) if offset + size < total else ""
        return [from_json(r.record_json, SwitchRecord) for r in rows], nxt

    async def traffic(self, name: str, since: float, limit: int) -> list[TrafficSample]:
        await self._node(name, self.reads)
        out = [from_json(t, TrafficSample) for t in await self.reads.traffic(name, limit)]
        if since:
            out = [t for t in out if (t.at or 0) / 1e9 > since]
        return out

    async def record_recommendation(self, name: str, recommended: Topology,
                                    reason: str, decision_id: str) -> None:
        self.leadership.require()
        _, reg = await self._node(name)
        _check_topology_fields(recommended)
        text = f"{topo_str(recommended)}: {reason}" if reason else topo_str(recommended)
        ev = self._event(EventType.RECOMMENDATION, name, detail=text, rec=SwitchRecord(
            to_topology=recommended, reason=reason, switch_id=decision_id))
        if not await self.store.recommend(name, text, ev):
            raise NotFound(f"unknown node {name!r}")

    # ------------------------------------------------------------------ recovery
    async def drain(self, name: str, target: str, slo_s: float, reason: str
                    ) -> list[RecoveryDecision]:
        self.leadership.require()
        return await self.recovery.drain(name, target, slo_s, reason)

    async def list_recoveries(self, node: str) -> list[Recovery]:
        return await self.recovery.list(node)

    # ------------------------------------------------------------------ events
    def _event(self, etype: EventType, node: str, switch_id: str = "",
               phase: int = Phase.UNSPECIFIED, rec: SwitchRecord | None = None,
               detail: str = "", rollout_id: str = "") -> Event:
        return Event(type=etype, node=node, switch_id=switch_id, phase=phase,
                     at=_now_ns(self.clock()), detail=detail, record=rec,
                     rollout_id=rollout_id)

    async def watch(self, node: str, switch_id: str, include_history: bool, caller: str,
                    rollout_id: str = "", after_id: str = "") -> AsyncIterator[Event]:
        """Events (filtered by node, switch id and rollout id) from now on, from the oldest
        retained with ``include_history``, or from just after ``after_id`` (a client resuming:
        no event lost or repeated; FailedPrecondition when events after it may have been
        trimmed). Holds no Redis connection while it waits: the hub reads the stream once for
        every open Watch. Capped per ``caller`` and in total."""
        resume = stream_id(after_id) if after_id else None
        m = metrics.controller()
        try:
            self.watch_limits.acquire(caller)
        except ResourceExhausted:
            m.watch_refused.inc()
            raise
        m.watch_streams.inc()
        sub = None
        try:
            sub = self.hub.subscribe(node, switch_id, rollout_id)
            if resume is not None or include_history:
                async for ev in self._replay(sub, after_id or "0-0", resume is not None):
                    yield ev
            floor = resume or (0, 0)  # a client ahead of this controller's reader: no repeats
            while True:
                ev = await sub.get()
                if id_key(ev.id) > floor:
                    yield ev
        finally:
            if sub is not None:
                self.hub.unsubscribe(sub)
            self.watch_limits.release(caller)
            m.watch_streams.dec()

    async def _replay(self, sub, after: str, exact: bool) -> AsyncIterator[Event]:
        """What the hub handed out before ``sub`` subscribed and after ``after``, in pages (the
        rest is in the subscription's queue: every id there is after its start_id). ``exact``
        (a resume): FailedPrecondition when events after the cursor were trimmed before a page
        was read."""
        end = id_key(sub.start_id)
        while id_key(after) < end:
            page, first, removed = await self.reads.read_events_page(after, 500)
            if exact and maybe_trimmed(after, first, removed):
                raise FailedPrecondition(
                    f"after_id {after}: events after it are no longer retained (the oldest is "
                    f"{first}; the stream keeps the newest ~{EVENTS_MAXLEN}): some were missed;"
                    " reconnect without after_id (include_history replays all retained)")
            if not page:
                return
            for eid, raw in page:
                if id_key(eid) > end:
                    return
                after = eid
                ev = parse_event(eid, raw)
                if sub.matches(ev):
                    yield ev

    async def _keep_switch_lane_warm(self, period: float = 0.5) -> None:
        """A PING on the switch lane every ``period`` s while leading: a pooled connection idle
        for more than a second is PINGed before its next command (the stale-connection check,
        controller.store), which would otherwise be one more round trip inside the first
        Reconfigure after a quiet second."""
        while True:
            await asyncio.sleep(period)
            await self.store.ping()

    async def _sweep_leases(self) -> None:
        period = max(0.2, self.s.lease_seconds / 4)
        # While no controller ran, no agent could renew its lease: a lease that ran out then is
        # the controller's gap, not a dead host. Every node gets one full lease from this start
        # to reach us before it is declared lost (and its requests recomputed elsewhere).
        grace_until = self.clock() + self.s.lease_seconds
        while True:
            await asyncio.sleep(period)
            try:
                now = self.clock()
                for name, h in (await self.leases.nodes()).items():
                    lease_until = max(float(h.get("lease_until", 0) or 0), grace_until)
                    if h.get("health") != "lost" and lease_until < now:
                        ev = self._event(EventType.NODE_LOST, name,
                                         detail="lease expired")
                        if await self.leases.expire(name, now, ev):
                            log.warning("controller.node_lost", node=name)
                            self.spawn(self.recovery.recover_lost_retrying(name))
            except Unavailable as exc:
                log.warning("controller.sweep_failed", error=str(exc))


_EOF = object()  # _Pump: the agent's stream ended


class _Pump:
    """An agent's ExecuteSwitch stream read ahead into a queue (its own task), so that the
    driver takes every message that has arrived at once; the stream's end is :data:`_EOF`, a
    failure the exception it raised."""

    def __init__(self, stream: AsyncIterator[SwitchProgress]):
        self.q: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self._run(stream))

    async def _run(self, stream: AsyncIterator[SwitchProgress]) -> None:
        try:
            async for ev in stream:
                self.q.put_nowait(ev)
            self.q.put_nowait(_EOF)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the driver, which decides
            self.q.put_nowait(exc)

    async def take(self, one: bool = False) -> list:
        """The next message, and (unless ``one``) every one queued behind it."""
        items = [await self.q.get()]
        while not one and not self.q.empty():
            items.append(self.q.get_nowait())
        return items

    def close(self) -> None:
        self.task.cancel()


def _drop(fut: asyncio.Future | None) -> None:
    """A background check no longer wanted (None: none was started): cancelled, its outcome
    (if any) consumed."""
    if fut is None:
        return
    if fut.done():
        if not fut.cancelled():
            fut.exception()
    else:
        fut.cancel()


LIMIT = 65536  # sanity bound on every count a registration carries


def _check_registration(req: Registration) -> None:
    if not NODE_NAME.fullmatch(req.node):
        raise InvalidArgument("node must be 1-253 characters of letters, digits, '.', '_' or '-' "
                              f"(got {req.node[:64]!r})")
    if not req.agent_address or len(req.agent_address) > 256:
        raise InvalidArgument("agent_address is required (host:port of the NodeAgent)")
    m, h = req.model or ModelFacts(), req.host or HostFacts()
    for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_size", "hidden_size"):
        if not 1 <= getattr(m, name) <= LIMIT:
            raise InvalidArgument(f"model.{name} must be in 1..{LIMIT}, got {getattr(m, name)}")
    if not 1 <= h.device_count <= 4096:
        raise InvalidArgument(f"host.device_count must be in 1..4096, got {h.device_count}")
    if len(req.candidates) > 256:
        raise InvalidArgument("at most 256 candidate topologies")
    for t in [req.topology or NO_TOPOLOGY, *req.candidates]:
        if t.tp < 1 or t.pp < 1 or t.tp * t.pp > h.device_count:
            raise InvalidArgument(f"topology TP{t.tp}PP{t.pp} does not fit {h.device_count} "
                                  "devices (topology and candidates need tp, pp >= 1)")
    if req.kv_bandwidth_bps < 0 or req.weight_bandwidth_bps < 0:
        raise InvalidArgument("bandwidths must be >= 0")
    validate.labels("labels", dict(req.labels))


def _check_topology_fields(t: Topology) -> None:
    if t.tp < 1 or t.pp < 1:
        raise InvalidArgument("target needs tp >= 1 and pp >= 1, e.g. {\"tp\": 1, \"pp\": 2}")


def _merge(ours: SwitchRecord, agent: SwitchRecord) -> SwitchRecord:
    """The agent's record is the truth about the engine; ours adds request id and reason."""
    return replace(agent, request_id=ours.request_id, reason=ours.reason or agent.reason,
                   node=ours.node or agent.node)


def _switch_facts(rec: SwitchRecord, outcome: Outcome) -> metrics.SwitchFacts:
    """What the switch metrics count of a finished record (phase names without a prefix)."""
    phases: dict[str, float] = {}
    for pt in rec.phase_timings:
        name = Phase(pt.phase).name
        phases[name] = phases.get(name, 0.0) + pt.seconds
    return metrics.SwitchFacts(outcome, phases, rec.total_seconds, rec.downtime_seconds,
                               rec.kv_bytes_moved, rec.weight_bytes_loaded, rec.requests_held,
                               rec.requests_preempted, rec.requests_in_flight)
