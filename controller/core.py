"""The controller: registration and leases, planning, and the switch driver with its Redis
state machine and crash recovery. gRPC-free (the servicer is a thin mapping); talks to Redis
through :class:`Store` and to agents through :class:`AgentClients`.

A switch's life in Redis (every step one compare-and-set script, its event appended atomically):
ACCEPTED (current slot taken, epoch +1) → DISPATCHED (written *before* ExecuteSwitch is sent) →
each phase the agent streams → finished (outcome, record, observed topology, slot freed).
After a crash the controller never re-sends: it asks the agent (GetSwitch) what happened.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from controller.agents import AgentClients
from controller.config import ControllerSettings
from controller.planner import NodeFacts, Plan, check_target, plan_switch
from controller.store import Store, SwitchRow, decode_reg, from_json, to_json
from remp import logs
from remp import metrics
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from remp.node_agent.v1 import node_agent_pb2
from remp.topology import ModelShape, Topology
from remp.transaction import Phase

log = logs.get_logger("remp.controller")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OUTCOME_NAME = {
    types_pb2.SWITCH_OUTCOME_SUCCEEDED: "succeeded",
    types_pb2.SWITCH_OUTCOME_ROLLED_BACK: "rolled_back",
    types_pb2.SWITCH_OUTCOME_FAILED: "failed",
    types_pb2.SWITCH_OUTCOME_ABORTED: "aborted",
    types_pb2.SWITCH_OUTCOME_NOOP: "noop",
    types_pb2.SWITCH_OUTCOME_UNKNOWN: "unknown",
}
FINISH_EVENT = {
    "succeeded": controller_pb2.EVENT_TYPE_SWITCH_DONE,
    "noop": controller_pb2.EVENT_TYPE_SWITCH_DONE,
    "rolled_back": controller_pb2.EVENT_TYPE_SWITCH_ROLLED_BACK,
    "aborted": controller_pb2.EVENT_TYPE_SWITCH_ABORTED,
    "failed": controller_pb2.EVENT_TYPE_SWITCH_FAILED,
    "unknown": controller_pb2.EVENT_TYPE_SWITCH_FAILED,
}
MAX_PAGE = 1000
DEFAULT_PAGE = 50


def topo_str(t) -> str:
    return f"TP{t.tp}PP{t.pp}"


def topo_parse(s: str) -> types_pb2.Topology:
    t = Topology.parse(s) if s else None
    return types_pb2.Topology(tp=t.tp, pp=t.pp) if t else types_pb2.Topology()


def _now_ts(wall: float | None = None) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int((wall or time.time()) * 1e9))
    return ts


def facts_of(reg: controller_pb2.RegisterNodeRequest, engine: node_agent_pb2.EngineInfo | None
             ) -> NodeFacts:
    m = reg.model
    shape = ModelShape(m.num_layers, m.num_attention_heads, m.num_kv_heads, m.hidden_size,
                       m.head_size)
    block_size = engine.block_size if engine is not None else 16
    live = (engine.num_blocks - engine.free_blocks) if engine is not None else 0
    return NodeFacts(
        shape=shape, devices=reg.host.device_count,
        candidates=tuple(Topology(c.tp, c.pp) for c in reg.candidates),
        weight_bytes=m.weight_bytes,
        kv_bytes_per_block_head=block_size * 2 * m.head_size * DTYPE_BYTES.get(m.dtype, 4),
        live_blocks=live, kv_bandwidth_bps=reg.kv_bandwidth_bps,
        weight_bandwidth_bps=reg.weight_bandwidth_bps)


class Controller:
    def __init__(self, settings: ControllerSettings, store: Store, agents: AgentClients,
                 clock=time.time):
        self.s, self.store, self.agents, self.clock = settings, store, agents, clock
        self._tasks: set[asyncio.Task] = set()
        self._cache: dict[str, controller_pb2.NodeState] = {}  # last known, for stale reads
        self._paused = asyncio.Event()  # test hook: set when a driver froze
        self._t: dict[str, dict[str, float]] = {}  # per-switch driver timestamps (logged)
        from controller.recovery import RecoveryCoordinator

        self.recovery = RecoveryCoordinator(self)

    # ------------------------------------------------------------------ lifecycle
    def spawn(self, coro) -> asyncio.Task:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def start(self) -> None:
        """Recover unfinished switches and start the lease sweeper."""
        for sid in await self.store.unfinished():
            row = await self.store.switch(sid)
            if row is not None:
                log.info("controller.recovering", switch_id=sid, phase=Phase(row.phase).name,
                         dispatched=row.dispatched)
                self.spawn(self._reconcile_forever(row))
        self.spawn(self._sweep_leases())

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ nodes
    async def register(self, req: controller_pb2.RegisterNodeRequest) -> tuple[float, int]:
        _check_registration(req)
        ev = self._event(controller_pb2.EVENT_TYPE_NODE_REGISTERED, req.node,
                         detail=f"{req.agent_address} {topo_str(req.topology)}")
        epoch = await self.store.register(req.node, req, self.clock() + self.s.lease_seconds,
                                          topo_str(req.topology), ev)
        await self.store.clear_draining(req.node)
        log.info("controller.node_registered", node=req.node, agent=req.agent_address,
                 topology=topo_str(req.topology))
        return self.s.lease_seconds, epoch

    async def heartbeat(self, req: controller_pb2.HeartbeatRequest) -> float:
        if not req.node:
            raise InvalidArgument("node is required")
        observed = topo_str(req.topology) if req.topology.tp and req.topology.pp else ""
        traffic = to_json(req.traffic) if req.HasField("traffic") else ""
        await self.store.heartbeat(req.node, self.clock() + self.s.lease_seconds, observed, traffic)
        # the journal a lost node's requests are recovered from (replaced every heartbeat)
        await self.store.set_inflight(req.node, to_json(
            controller_pb2.HeartbeatRequest(inflight=req.inflight)))
        return self.s.lease_seconds

    def _state(self, name: str, h: dict[str, str], current: SwitchRow | None
               ) -> controller_pb2.NodeState:
        reg = decode_reg(h)
        health = controller_pb2.NODE_HEALTH_READY
        if h.get("health") == "lost":
            health = controller_pb2.NODE_HEALTH_LOST
        elif h.get("current"):
            health = controller_pb2.NODE_HEALTH_SWITCHING
        lease_until = float(h.get("lease_until", 0) or 0)
        st = controller_pb2.NodeState(
            node=name, agent_address=reg.agent_address, http_address=reg.http_address,
            desired=topo_parse(h.get("desired", "")), observed=topo_parse(h.get("observed", "")),
            candidates=reg.candidates, health=health,
            lease_age_seconds=max(0.0, self.clock() - (lease_until - self.s.lease_seconds)),
            epoch=int(h.get("epoch", 0) or 0), host=reg.host, model=reg.model,
            recommendation=h.get("recommendation", ""))
        if current is not None:
            st.current_switch.CopyFrom(from_json(current.record_json, types_pb2.SwitchRecord))
        return st

    async def get_state(self, name: str) -> controller_pb2.NodeState:
        if not name:
            raise InvalidArgument("node is required")
        try:
            h = await self.store.node(name)
            if h is None:
                raise NotFound(f"unknown node {name!r} (ListNodes shows the registered ones)")
            cur = await self.store.switch(h["current"]) if h.get("current") else None
        except Unavailable:
            if name in self._cache:
                st = controller_pb2.NodeState()
                st.CopyFrom(self._cache[name])
                st.stale = True
                return st
            raise
        st = self._state(name, h, cur)
        self._cache[name] = st
        return st

    async def list_nodes(self) -> list[controller_pb2.NodeState]:
        try:
            rows = await self.store.nodes()
            out = []
            for name, h in rows.items():
                cur = await self.store.switch(h["current"]) if h.get("current") else None
                out.append(self._state(name, h, cur))
        except Unavailable:
            if not self._cache:
                raise
            out = []
            for st in self._cache.values():
                c = controller_pb2.NodeState()
                c.CopyFrom(st)
                c.stale = True
                out.append(c)
            return out
        for st in out:
            self._cache[st.node] = st
        return out

    async def _node(self, name: str) -> tuple[dict[str, str], controller_pb2.RegisterNodeRequest]:
        if not name:
            raise InvalidArgument("node is required")
        h = await self.store.node(name)
        if h is None:
            raise NotFound(f"unknown node {name!r} (ListNodes shows the registered ones)")
        return h, decode_reg(h)

    # ------------------------------------------------------------------ planning
    async def plan(self, name: str, target: types_pb2.Topology) -> Plan:
        h, reg = await self._node(name)
        _check_topology_fields(target)
        engine = None
        try:
            engine = (await self.agents.describe(reg.agent_address)).engine
        except Unavailable:
            log.info("controller.plan_without_engine_facts", node=name)
        current = Topology.parse(h.get("observed") or topo_str(reg.topology))
        return plan_switch(facts_of(reg, engine), current, Topology(target.tp, target.pp),
                           await self._phase_history(name))

    async def _phase_history(self, name: str, n: int = 20) -> dict[Phase, list[float]]:
        hist: dict[Phase, list[float]] = {}
        for row in await self.store.history(name, 0, n):
            if row.outcome != "succeeded":
                continue
            rec = from_json(row.record_json, types_pb2.SwitchRecord)
            for pt in rec.phase_timings:
                hist.setdefault(Phase(pt.phase), []).append(pt.seconds)
        return hist

    # ------------------------------------------------------------------ switching
    async def reconfigure(self, name: str, target: types_pb2.Topology, request_id: str,
                          reason: str, test_start_when_running: int = 0
                          ) -> controller_pb2.ReconfigureResponse:
        tl = {"rpc_in": time.perf_counter()}  # this switch's timeline (logged when it finishes)
        for _ in range(3):
            resp = await self._reconfigure(name, target, request_id, reason,
                                           test_start_when_running, tl)
            if resp is not None:
                return resp
        raise FailedPrecondition(f"the topology of node {name!r} kept changing while the "
                                 "switch was being planned; retry")

    async def _reconfigure(self, name: str, target: types_pb2.Topology, request_id: str,
                           reason: str, test_start_when_running: int, tl: dict[str, float]
                           ) -> controller_pb2.ReconfigureResponse | None:
        """One attempt; None when the node's topology changed between reading it and taking
        the switch slot (the decision — noop or from which topology — is made again)."""
        h, reg = await self._node(name)
        tl["node_read"] = time.perf_counter()
        _check_topology_fields(target)
        current = Topology.parse(h.get("observed") or topo_str(reg.topology))
        tgt = Topology(target.tp, target.pp)
        check_target(facts_of(reg, None), current, tgt)
        if request_id:
            prev = await self.store.switch_for_request(name, request_id)
            if prev:
                return controller_pb2.ReconfigureResponse(switch_id=prev, duplicate=True)
        if h.get("health") == "lost":
            raise Unavailable(f"node {name!r} is lost (its lease expired); it must re-register")
        if h.get("draining") == "1":
            raise FailedPrecondition(f"node {name!r} is draining; it must re-register to serve")
        sid = "sw-" + uuid.uuid4().hex[:16]
        now = self.clock()
        rec = types_pb2.SwitchRecord(
            switch_id=sid, node=name, from_topology=topo_parse(str(current)), to_topology=target,
            outcome=types_pb2.SWITCH_OUTCOME_RUNNING, phase=types_pb2.PHASE_SERVING_OLD,
            started_at=_now_ts(now), request_id=request_id, reason=reason)
        if tgt == current and not h.get("current"):
            rec.outcome = types_pb2.SWITCH_OUTCOME_NOOP
            rec.finished_at.CopyFrom(_now_ts(now))
            ev = self._event(controller_pb2.EVENT_TYPE_SWITCH_DONE, name, sid, rec=rec,
                             detail="noop: target is the current topology")
            status, other = await self.store.noop(name, sid, request_id, to_json(rec), now, ev)
            if status == "dup":
                return controller_pb2.ReconfigureResponse(switch_id=other, duplicate=True)
            return controller_pb2.ReconfigureResponse(switch_id=sid, noop=True)
        await self.agents.check_serving(reg.agent_address)  # unreachable → no state change
        tl["agent_checked"] = time.perf_counter()
        ev = self._event(controller_pb2.EVENT_TYPE_SWITCH_PHASE, name, sid,
                         phase=types_pb2.PHASE_SERVING_OLD, detail=f"accepted {current} → {tgt}")
        status, other = await self.store.begin(name, sid, request_id, to_json(rec), now,
                                               str(tgt), ev, observed=h.get("observed", ""))
        if status == "notfound":
            raise NotFound(f"unknown node {name!r}")
        if status == "dup":
            return controller_pb2.ReconfigureResponse(switch_id=other, duplicate=True)
        if status == "busy":
            raise FailedPrecondition(f"switch {other} is running on node {name}; wait for it "
                                     "(Watch) or abort it")
        if status == "moved":
            log.info("controller.topology_moved", node=name, read=str(current), now=other)
            return None
        rec.epoch = int(other)
        tl["begun"] = time.perf_counter()
        self._t[sid] = tl
        log.info("controller.switch_accepted", switch_id=sid, node=name, target=str(tgt),
                 epoch=rec.epoch, request_id=request_id)
        self.spawn(self._drive(reg.agent_address, rec, test_start_when_running))
        return controller_pb2.ReconfigureResponse(switch_id=sid)

    async def _pause_point(self, name: str) -> None:
        if self.s.test_pause_at == name:
            log.warning("controller.test_paused", at=name)
            self._paused.set()
            await asyncio.Event().wait()  # until the test kills us

    async def _drive(self, address: str, rec: types_pb2.SwitchRecord, start_gate: int = 0) -> None:
        sid, node = rec.switch_id, rec.node
        self._t.setdefault(sid, {})["accepted"] = time.perf_counter()
        try:
            await self._pause_point("ACCEPTED")
            if not await self.store.dispatch(sid):
                log.info("controller.not_dispatched", switch_id=sid)  # aborted meanwhile
                return
            await self._pause_point("DISPATCHED")
            req = node_agent_pb2.ExecuteSwitchRequest(
                target=rec.to_topology, switch_id=sid, epoch=rec.epoch, reason=rec.reason,
                test_start_when_running=start_gate)
            phase, final = int(types_pb2.PHASE_SERVING_OLD), None
            self._t[sid]["dispatched"] = time.perf_counter()
            try:
                async for ev in self.agents.execute_switch(address, req):
                    self._t[sid].setdefault("first_event", time.perf_counter())
                    if ev.HasField("record"):
                        final = ev.record
                        self._t[sid]["final_event"] = time.perf_counter()
                        break
                    if ev.phase != phase:
                        phase = await self._advance(rec, phase, ev.phase, ev.detail)
                        await self._pause_point(types_pb2.Phase.Name(ev.phase)[len("PHASE_"):])
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.INVALID_ARGUMENT) and final is None \
                        and phase == types_pb2.PHASE_SERVING_OLD:
                    # the agent refused before starting (busy, stale epoch, invalid target)
                    rec.outcome = types_pb2.SWITCH_OUTCOME_ROLLED_BACK
                    rec.phase = types_pb2.PHASE_ROLLED_BACK
                    rec.error.CopyFrom(types_pb2.Error(code="AGENT_REFUSED", message=exc.details(),
                                                       phase=types_pb2.PHASE_SERVING_OLD))
                    await self._finish(rec)
                    return
                log.warning("controller.stream_lost", switch_id=sid, code=exc.code().name)
                row = await self.store.switch(sid)
                if row is not None:
                    await self._reconcile_forever(row)
                return
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

    async def _advance(self, rec: types_pb2.SwitchRecord, expected: int, phase: int,
                       detail: str) -> int:
        rec.phase = phase
        ev = self._event(controller_pb2.EVENT_TYPE_SWITCH_PHASE, rec.node, rec.switch_id,
                         phase=phase, detail=detail)
        if not await self.store.advance(rec.switch_id, expected, phase, to_json(rec), ev):
            raise FailedPrecondition(f"switch {rec.switch_id} changed under us (another "
                                     "controller, or an abort)")
        return phase

    async def _finish(self, rec: types_pb2.SwitchRecord) -> None:
        outcome = OUTCOME_NAME.get(rec.outcome, "unknown")
        if not rec.HasField("finished_at"):
            rec.finished_at.CopyFrom(_now_ts())
        observed = ""
        if outcome == "succeeded":
            observed = topo_str(rec.to_topology)
        elif outcome in ("rolled_back", "aborted"):
            observed = topo_str(rec.from_topology)
        ev = self._event(FINISH_EVENT[outcome], rec.node, rec.switch_id, phase=rec.phase, rec=rec,
                         detail=outcome)
        done = await self.store.finish(rec.switch_id, rec.node, outcome, rec.phase, to_json(rec),
                                       observed, ev)
        if done:
            metrics.controller().switch_finished(rec, outcome)
        t = self._t.pop(rec.switch_id, {})
        t["finished"] = time.perf_counter()
        t0 = t.get("rpc_in", t.get("accepted", t["finished"]))
        log.info("controller.switch_finished", switch_id=rec.switch_id, outcome=outcome,
                 recorded=done, total_s=round(rec.total_seconds, 3),
                 t0_mono=round(t0, 6),
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
        rec = from_json(row.record_json, types_pb2.SwitchRecord)
        if row.outcome != "running":
            return True
        if not row.dispatched:
            # the intent to send was never written: ExecuteSwitch was never sent
            rec.outcome, rec.phase = types_pb2.SWITCH_OUTCOME_ABORTED, types_pb2.PHASE_ROLLED_BACK
            rec.error.CopyFrom(types_pb2.Error(code="NOT_DISPATCHED", message=(
                "the controller stopped before sending the switch to the agent; not re-sent"),
                phase=types_pb2.PHASE_SERVING_OLD, retryable=True))
            await self._finish(rec)
            return True
        h = await self.store.node(row.node)
        reg = decode_reg(h or {})
        agent_rec = await self.agents.get_switch(reg.agent_address, row.switch_id)
        if agent_rec is None:
            d = await self.agents.describe(reg.agent_address)
            if (d.topology.tp, d.topology.pp) == (rec.to_topology.tp, rec.to_topology.pp):
                rec.outcome = types_pb2.SWITCH_OUTCOME_UNKNOWN
                msg = "the agent has no record of it (restarted?) but runs the target topology"
            else:
                rec.outcome, rec.phase = types_pb2.SWITCH_OUTCOME_ABORTED, types_pb2.PHASE_ROLLED_BACK
                msg = "the agent never received it; not re-sent"
            rec.error.CopyFrom(types_pb2.Error(code="NOT_RECEIVED", message=msg,
                                               phase=rec.phase, retryable=True))
            await self._finish(rec)
            return True
        while agent_rec.outcome == types_pb2.SWITCH_OUTCOME_RUNNING:
            if agent_rec.phase != row.phase:
                try:
                    row.phase = await self._advance(rec, row.phase, agent_rec.phase, "recovered")
                except FailedPrecondition:
                    return True  # someone else completed it
            await asyncio.sleep(0.1)
            agent_rec = await self.agents.get_switch(reg.agent_address, row.switch_id)
            if agent_rec is None:
                return False
        await self._finish(_merge(rec, agent_rec))
        return True

    async def abort(self, switch_id: str, reason: str) -> controller_pb2.AbortResponse:
        if not switch_id:
            raise InvalidArgument("switch_id is required")
        row = await self.store.switch(switch_id)
        if row is None:
            raise NotFound(f"no switch with id {switch_id!r}")
        if row.outcome != "running":
            raise FailedPrecondition(f"switch {switch_id} has finished ({row.outcome})")
        rec = from_json(row.record_json, types_pb2.SwitchRecord)
        if not row.dispatched:
            rec.outcome, rec.phase = types_pb2.SWITCH_OUTCOME_ABORTED, types_pb2.PHASE_ROLLED_BACK
            rec.error.CopyFrom(types_pb2.Error(code="ABORTED", message=reason or "aborted",
                                               phase=types_pb2.PHASE_SERVING_OLD))
            await self._finish(rec)
            return controller_pb2.AbortResponse(aborted=True, phase=types_pb2.PHASE_SERVING_OLD)
        if row.phase >= types_pb2.PHASE_MIGRATE_KV:
            raise FailedPrecondition(f"switch {switch_id} is in {types_pb2.Phase.Name(row.phase)}:"
                                     " abort is allowed only before MIGRATE_KV starts")
        h = await self.store.node(row.node)
        try:
            r = await self.agents.abort_switch(decode_reg(h or {}).agent_address, switch_id,
                                               reason)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise FailedPrecondition(exc.details()) from None
            raise
        return controller_pb2.AbortResponse(aborted=r.aborted, phase=r.phase)

    async def get_switch(self, switch_id: str) -> types_pb2.SwitchRecord:
        if not switch_id:
            raise InvalidArgument("switch_id is required")
        row = await self.store.switch(switch_id)
        if row is None:
            raise NotFound(f"no switch with id {switch_id!r}")
        return from_json(row.record_json, types_pb2.SwitchRecord)

    async def list_switches(self, node: str, page_size: int, page_token: str
                            ) -> tuple[list[types_pb2.SwitchRecord], str]:
        size = page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            raise InvalidArgument(f"page_size must be at most {MAX_PAGE}")
        try:
            offset = int(page_token) if page_token else 0
            if not 0 <= offset < 2**31:
                raise ValueError
        except ValueError:
            raise InvalidArgument("page_token is not one this server returned") from None
        if node and await self.store.node(node) is None:
            raise NotFound(f"unknown node {node!r}")
        rows = await self.store.history(node or None, offset, size)
        total = await self.store.history_count(node or None)
        nxt = str(offset + size) if offset + size < total else ""
        return [from_json(r.record_json, types_pb2.SwitchRecord) for r in rows], nxt

    async def traffic(self, name: str, since: float, limit: int) -> list[types_pb2.TrafficSample]:
        await self._node(name)
        out = [from_json(t, types_pb2.TrafficSample) for t in await self.store.traffic(name, limit)]
        if since:
            out = [t for t in out if t.at.ToNanoseconds() / 1e9 > since]
        return out

    async def record_recommendation(self, name: str, recommended: types_pb2.Topology,
                                    reason: str, decision_id: str) -> None:
        _, reg = await self._node(name)
        _check_topology_fields(recommended)
        text = f"{topo_str(recommended)}: {reason}" if reason else topo_str(recommended)
        ev = self._event(controller_pb2.EVENT_TYPE_RECOMMENDATION, name, detail=text)
        ev.record.to_topology.CopyFrom(recommended)
        ev.record.reason = reason
        ev.record.switch_id = decision_id
        if not await self.store.recommend(name, text, ev):
            raise NotFound(f"unknown node {name!r}")

    # ------------------------------------------------------------------ recovery
    async def drain(self, name: str, target: str, slo_s: float, reason: str,
                    start_when_running: int = 0) -> list[types_pb2.RecoveryDecision]:
        return await self.recovery.drain(name, target, slo_s, reason, start_when_running)

    async def list_recoveries(self, node: str) -> list[controller_pb2.Recovery]:
        return await self.recovery.list(node)

    # ------------------------------------------------------------------ events
    def _event(self, etype, node: str, switch_id: str = "", phase: int = 0,
               rec: types_pb2.SwitchRecord | None = None, detail: str = ""
               ) -> controller_pb2.Event:
        ev = controller_pb2.Event(type=etype, node=node, switch_id=switch_id, phase=phase,
                                  at=_now_ts(self.clock()), detail=detail)
        if rec is not None:
            ev.record.CopyFrom(rec)
        return ev

    async def watch(self, node: str, switch_id: str, include_history: bool
                    ) -> AsyncIterator[controller_pb2.Event]:
        last = "0-0" if include_history else await self.store.last_event_id()
        while True:
            for eid, ev in await self.store.read_events(last, block_ms=1000):
                last = eid
                if node and ev.node != node:
                    continue
                if switch_id and ev.switch_id != switch_id:
                    continue
                yield ev

    async def _sweep_leases(self) -> None:
        period = max(0.2, self.s.lease_seconds / 4)
        while True:
            await asyncio.sleep(period)
            try:
                now = self.clock()
                for name, h in (await self.store.nodes()).items():
                    if h.get("health") != "lost" and float(h.get("lease_until", 0) or 0) < now:
                        ev = self._event(controller_pb2.EVENT_TYPE_NODE_LOST, name,
                                         detail="lease expired")
                        if await self.store.expire(name, now, ev):
                            log.warning("controller.node_lost", node=name)
                            self.spawn(self.recovery.recover_lost(name))
            except Unavailable as exc:
                log.warning("controller.sweep_failed", error=str(exc))


NODE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")
LIMIT = 65536  # sanity bound on every count a registration carries


def _check_registration(req: controller_pb2.RegisterNodeRequest) -> None:
    if not NODE_NAME.match(req.node):
        raise InvalidArgument("node must be 1-253 characters of letters, digits, '.', '_' or '-' "
                              f"(got {req.node[:64]!r})")
    if not req.agent_address or len(req.agent_address) > 256:
        raise InvalidArgument("agent_address is required (host:port of the NodeAgent)")
    m, h = req.model, req.host
    for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_size", "hidden_size"):
        if not 1 <= getattr(m, name) <= LIMIT:
            raise InvalidArgument(f"model.{name} must be in 1..{LIMIT}, got {getattr(m, name)}")
    if not 1 <= h.device_count <= 4096:
        raise InvalidArgument(f"host.device_count must be in 1..4096, got {h.device_count}")
    if len(req.candidates) > 256:
        raise InvalidArgument("at most 256 candidate topologies")
    for t in [req.topology, *req.candidates]:
        if t.tp < 1 or t.pp < 1 or t.tp * t.pp > h.device_count:
            raise InvalidArgument(f"topology TP{t.tp}PP{t.pp} does not fit {h.device_count} "
                                  "devices (topology and candidates need tp, pp >= 1)")
    if req.kv_bandwidth_bps < 0 or req.weight_bandwidth_bps < 0:
        raise InvalidArgument("bandwidths must be >= 0")


def _check_topology_fields(t: types_pb2.Topology) -> None:
    if t.tp < 1 or t.pp < 1:
        raise InvalidArgument("target needs tp >= 1 and pp >= 1, e.g. {\"tp\": 1, \"pp\": 2}")


def _merge(ours: types_pb2.SwitchRecord, agent: types_pb2.SwitchRecord) -> types_pb2.SwitchRecord:
    """The agent's record is the truth about the engine; ours adds request id and reason."""
    out = types_pb2.SwitchRecord()
    out.CopyFrom(agent)
    out.request_id, out.reason = ours.request_id, ours.reason or agent.reason
    out.node = ours.node or agent.node
    return out
