"""The controller core without sockets to agents: driven with an in-memory agent port
(:class:`FakeAgent`, a fake of :class:`controller.ports.AgentPort` only — real agents are the
e2e tests') against a real redis-server. Plus the proto <-> dataclass mapping the servicer and
the store use (:mod:`controller.convert`): complete and lossless, so Redis keeps its JSON."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from controller import convert
from controller.config import ControllerSettings
from controller.core import Controller
from controller.model import (AbortResult, AgentDescription, Continuation, EngineInfo, Event,
                              EventType, Heartbeat, HostFacts, ImportOrder, InflightRequest,
                              MigrateOrder, ModelFacts, NodeHealth, Outcome, Phase, PhaseTiming,
                              RecoveryAction, RecoveryDecision, Registration, RequestInfo,
                              SwitchOrder, SwitchProgress, SwitchRecord, Topology)
from controller.ports import AgentPort
from controller.store import Store
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.errors import FailedPrecondition, NotFound, Unavailable
from remp.redisproc import RedisServer

FORWARD = (Phase.QUIESCING, Phase.PREPARING_WORKERS, Phase.MPU_APPLIED, Phase.MIGRATE_KV,
           Phase.RELOAD_SHARDS, Phase.REBINDING, Phase.SERVING_NEW)


class FakeAgent:
    """The agent port in memory: runs every switch to SERVING_NEW at once (or refuses with
    ``refuse``), keeps the records GetSwitch answers from, and logs every call."""

    def __init__(self, topology: Topology = Topology(2, 1)):
        self.topology = topology
        self.calls: list[tuple[str, object]] = []
        self.records: dict[str, SwitchRecord] = {}
        self.refuse: Exception | None = None
        self.refuse_abort: Exception | None = None
        self.requests: list[RequestInfo] = []
        self.draining = False
        self.live = False  # connected(): True skips the health check
        self.hold: asyncio.Event | None = None  # execute_switch waits for it (order in transit)

    def connected(self, address: str) -> bool:
        return self.live

    async def check_serving(self, address: str, timeout: float = 2.0) -> None:
        self.calls.append(("check_serving", address))

    async def describe(self, address: str) -> AgentDescription:
        self.calls.append(("describe", address))
        return AgentDescription(topology=self.topology,
                                engine=EngineInfo(num_blocks=64, free_blocks=60, block_size=16))

    async def execute_switch(self, address: str, order: SwitchOrder
                             ) -> AsyncIterator[SwitchProgress]:
        self.calls.append(("execute_switch", order))
        if self.hold is not None:
            await self.hold.wait()
        if self.refuse is not None:
            raise self.refuse
        t0 = time.time_ns()
        for ph in FORWARD:
            yield SwitchProgress(switch_id=order.switch_id, phase=ph, detail=ph.name.lower())
        rec = SwitchRecord(
            switch_id=order.switch_id, from_topology=self.topology, to_topology=order.target,
            outcome=Outcome.SUCCEEDED, phase=Phase.SERVING_NEW, epoch=order.epoch,
            phase_timings=tuple(PhaseTiming(phase=p, seconds=0.01) for p in FORWARD),
            kv_bytes_moved=4096, total_seconds=0.07, started_at=t0, finished_at=time.time_ns(),
            reason="the agent's reason")
        self.records[order.switch_id] = rec
        self.topology = order.target
        yield SwitchProgress(switch_id=order.switch_id, phase=Phase.SERVING_NEW, record=rec)

    async def get_switch(self, address: str, switch_id: str) -> SwitchRecord | None:
        self.calls.append(("get_switch", switch_id))
        return self.records.get(switch_id)

    async def abort_switch(self, address: str, switch_id: str, reason: str) -> AbortResult:
        self.calls.append(("abort_switch", switch_id))
        if self.refuse_abort is not None:
            raise self.refuse_abort
        return AbortResult(aborted=True, phase=Phase.QUIESCING)

    async def set_draining(self, address: str, draining: bool) -> None:
        self.calls.append(("set_draining", draining))
        self.draining = draining

    async def list_requests(self, address: str) -> list[RequestInfo]:
        return list(self.requests)

    async def migrate_request(self, address: str, order: MigrateOrder
                              ) -> AsyncIterator[Continuation]:
        self.calls.append(("migrate_request", order))
        yield Continuation(decision=RecoveryDecision(
            request_id=order.request_id, action=RecoveryAction.MIGRATE, reason="migrate_cheaper",
            tokens=12, target_node=order.target_node))
        yield Continuation(token_ids=(5, 6), text="ab")
        yield Continuation(token_ids=(7,), text="c", finished=True, finish_reason="length")

    async def import_request(self, address: str, order: ImportOrder
                             ) -> AsyncIterator[Continuation]:
        self.calls.append(("import_request", order))
        yield Continuation(token_ids=(9,), text="z", finished=True, finish_reason="stop")

    def called(self, name: str) -> list:
        return [a for n, a in self.calls if n == name]


def registration(node: str = "n1", topology: Topology = Topology(2, 1)) -> Registration:
    return Registration(
        node=node, agent_address=f"{node}.agent:1", http_address=f"http://{node}",
        topology=topology, candidates=(Topology(1, 1), Topology(2, 1), Topology(1, 2)),
        host=HostFacts(hostname=node, device_type="cpu", device_count=2, cpu_cores=2),
        model=ModelFacts(num_layers=4, num_attention_heads=8, num_kv_heads=4, head_size=32,
                         hidden_size=256, dtype="float32", weight_bytes=10_000_000))


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as r:
        yield r


@pytest.fixture
async def store(redis_server):
    s = Store(redis_server.url, prefix=f"t-core-{uuid.uuid4().hex[:8]}:")
    yield s
    await s.close()


@pytest.fixture
def agent() -> FakeAgent:
    return FakeAgent()


def controller(store: Store, agent: AgentPort, pause: str | None = None) -> Controller:
    return Controller(ControllerSettings(lease_seconds=30.0, test_pause_at=pause), store, agent)


@pytest.fixture
async def core(store, agent):
    c = controller(store, agent)
    await c.register(registration())
    yield c
    await c.stop()


async def finished(core: Controller, switch_id: str, timeout: float = 10.0) -> SwitchRecord:
    deadline = time.monotonic() + timeout
    while True:
        rec = await core.get_switch(switch_id)
        if rec.outcome not in (Outcome.RUNNING, None):
            return rec
        assert time.monotonic() < deadline, f"switch {switch_id} still {rec.outcome}"
        await asyncio.sleep(0.02)


async def events_of(store: Store, switch_id: str):
    return [ev for _, ev in await store.read_events("0-0", None, 1000)
            if ev.switch_id == switch_id]


# ---------------------------------------------------------------------------- switches
async def test_reconfigure_drives_the_switch_to_a_succeeded_record(core, agent, store):
    res = await core.reconfigure("n1", Topology(1, 2), "req-1", "more layers per rank")
    assert res.switch_id.startswith("sw-") and not res.noop and not res.duplicate
    rec = await finished(core, res.switch_id)
    assert rec.outcome is Outcome.SUCCEEDED and rec.phase is Phase.SERVING_NEW
    # the agent's record, with our request id, node and reason
    assert (rec.request_id, rec.node, rec.reason) == ("req-1", "n1", "more layers per rank")
    assert rec.kv_bytes_moved == 4096 and rec.epoch == 1 and rec.finished_at is not None
    (order,) = agent.called("execute_switch")
    assert order == SwitchOrder(target=Topology(1, 2), switch_id=res.switch_id, epoch=1,
                                reason="more layers per rank")
    st = await core.get_state("n1")
    assert st.observed == st.desired == Topology(1, 2) and st.health is NodeHealth.READY
    assert st.current_switch is None and st.epoch == 1
    # every phase persisted as an event, then the outcome
    evs = await events_of(store, res.switch_id)
    assert [e.phase for e in evs if e.type is EventType.SWITCH_PHASE] == \
        [Phase.SERVING_OLD, *FORWARD]
    assert evs[-1].type is EventType.SWITCH_DONE and evs[-1].record.outcome is Outcome.SUCCEEDED
    recs, nxt = await core.list_switches("n1", 0, "")
    assert [r.switch_id for r in recs] == [res.switch_id] and nxt == ""


async def test_a_noop_is_recorded_without_calling_the_agent(core, agent):
    res = await core.reconfigure("n1", Topology(2, 1), "", "")
    assert res.noop and not res.duplicate
    rec = await core.get_switch(res.switch_id)
    assert rec.outcome is Outcome.NOOP and rec.finished_at is not None
    assert agent.calls == []


async def test_a_duplicate_request_id_returns_the_earlier_switch(core, agent):
    first = await core.reconfigure("n1", Topology(1, 2), "same-id", "")
    await finished(core, first.switch_id)
    again = await core.reconfigure("n1", Topology(1, 1), "same-id", "")
    assert again.duplicate and again.switch_id == first.switch_id
    assert len(agent.called("execute_switch")) == 1


async def test_abort_before_dispatch_never_reaches_the_agent(store, agent):
    core = controller(store, agent, pause="ACCEPTED")
    try:
        await core.register(registration())
        res = await core.reconfigure("n1", Topology(1, 2), "", "")
        await asyncio.wait_for(core._paused.wait(), 5)
        assert await core.abort(res.switch_id, "changed my mind") == \
            AbortResult(aborted=True, phase=Phase.SERVING_OLD)
        rec = await core.get_switch(res.switch_id)
        assert rec.outcome is Outcome.ABORTED and rec.phase is Phase.ROLLED_BACK
        assert rec.error.code == "ABORTED" and rec.error.message == "changed my mind"
        assert (await core.get_state("n1")).observed == Topology(2, 1)
        assert agent.called("execute_switch") == [] and agent.called("abort_switch") == []
        with pytest.raises(FailedPrecondition, match="has finished"):
            await core.abort(res.switch_id, "")
    finally:
        await core.stop()


async def test_an_agent_refusal_rolls_the_switch_back_with_its_message(core, agent):
    agent.refuse = FailedPrecondition("epoch 1 is older than the last seen 4")
    res = await core.reconfigure("n1", Topology(1, 2), "", "")
    rec = await finished(core, res.switch_id)
    assert rec.outcome is Outcome.ROLLED_BACK and rec.phase is Phase.ROLLED_BACK
    assert rec.error.code == "AGENT_REFUSED" and "older than the last seen" in rec.error.message
    assert (await core.get_state("n1")).observed == Topology(2, 1)


async def test_a_connected_agent_is_not_health_checked_first(core, agent):
    agent.live = True
    spawned: list[asyncio.Task] = []
    spawn = core.spawn
    core.spawn = lambda coro: spawned.append(spawn(coro)) or spawned[-1]
    res = await core.reconfigure("n1", Topology(1, 2), "", "")
    assert (await finished(core, res.switch_id)).outcome is Outcome.SUCCEEDED
    assert agent.called("check_serving") == [] and len(agent.called("execute_switch")) == 1
    (driver,) = spawned
    await asyncio.wait_for(driver, 5)  # the driver itself ended cleanly (no health check to drop)


async def test_an_execute_switch_that_never_connected_rolls_back_agent_unavailable(core, agent):
    """The channel was live, then ExecuteSwitch could not connect (the agent went away): the
    order never left, so the switch ends ROLLED_BACK (AGENT_UNAVAILABLE, retryable) at once
    instead of asking the unreachable agent what happened."""
    agent.live = True
    err = Unavailable("failed to connect to all addresses; last error: Connection refused")
    err.details = str(err)
    agent.refuse = err
    res = await core.reconfigure("n1", Topology(1, 2), "", "")
    rec = await finished(core, res.switch_id)
    assert rec.outcome is Outcome.ROLLED_BACK and rec.phase is Phase.ROLLED_BACK
    assert rec.error.code == "AGENT_UNAVAILABLE" and rec.error.retryable
    assert "was not sent" in rec.error.message and "Connection refused" in rec.error.message
    assert (await core.get_state("n1")).observed == Topology(2, 1)
    assert agent.called("get_switch") == []


async def test_the_switch_is_written_dispatched_and_an_abort_before_it_arrives_says_retry(
        core, agent, store):
    """Without a test pause point the switch is written with its intent to send (one Redis
    write less); an abort while the order is still on its way (the agent does not know the
    switch yet) is FAILED_PRECONDITION 'retry', then reaches the agent."""
    agent.live, agent.hold = True, asyncio.Event()
    res = await core.reconfigure("n1", Topology(1, 2), "", "")
    assert (await store.switch(res.switch_id)).dispatched
    agent.refuse_abort = NotFound(f"no switch with id {res.switch_id!r} on this node")
    with pytest.raises(FailedPrecondition, match="on its way to the agent.*retry the abort"):
        await core.abort(res.switch_id, "")
    agent.refuse_abort = None
    assert (await core.abort(res.switch_id, "")).aborted
    agent.hold.set()
    assert (await finished(core, res.switch_id)).outcome is Outcome.SUCCEEDED  # fake ignores it


async def test_the_agents_abort_refusal_is_raised_as_its_typed_error(store, agent):
    core = controller(store, agent, pause="QUIESCING")
    try:
        await core.register(registration())
        res = await core.reconfigure("n1", Topology(1, 2), "", "")
        await asyncio.wait_for(core._paused.wait(), 5)
        assert await core.abort(res.switch_id, "") == AbortResult(True, Phase.QUIESCING)
        agent.refuse_abort = FailedPrecondition("it moved on to MIGRATE_KV")
        with pytest.raises(FailedPrecondition, match="moved on to MIGRATE_KV"):
            await core.abort(res.switch_id, "")
        with pytest.raises(NotFound):
            await core.abort("sw-nope", "")
    finally:
        await core.stop()


@pytest.mark.parametrize("crash_at, agent_knows, outcome, code", [
    ("DISPATCHED", True, Outcome.SUCCEEDED, ""),
    ("DISPATCHED", False, Outcome.ABORTED, "NOT_RECEIVED"),
    ("ACCEPTED", False, Outcome.ABORTED, "NOT_DISPATCHED"),
])
async def test_a_restarted_controller_reconciles_by_asking_the_agent(store, agent, crash_at,
                                                                     agent_knows, outcome, code):
    """A controller that stopped mid-switch never re-sends it: the next one asks the agent
    (GetSwitch) when ExecuteSwitch may have been sent, and finishes the record from that."""
    first = controller(store, agent, pause=crash_at)
    await first.register(registration())
    res = await first.reconfigure("n1", Topology(1, 2), "req-crash", "")
    await asyncio.wait_for(first._paused.wait(), 5)
    await first.stop()  # the "crash": the driver is gone, the record unfinished
    assert (await store.switch(res.switch_id)).outcome == Outcome.RUNNING
    if agent_knows:  # it ran the switch to the end after the controller went away
        agent.records[res.switch_id] = SwitchRecord(
            switch_id=res.switch_id, from_topology=Topology(2, 1), to_topology=Topology(1, 2),
            outcome=Outcome.SUCCEEDED, phase=Phase.SERVING_NEW, epoch=1, total_seconds=0.2)
        agent.topology = Topology(1, 2)
    second = controller(store, agent)
    try:
        await second.start()
        rec = await finished(second, res.switch_id)
    finally:
        await second.stop()
    assert rec.outcome is outcome and rec.request_id == "req-crash"
    assert (rec.error.code if rec.error else "") == code
    assert agent.called("execute_switch") == []
    assert agent.called("get_switch") == ([res.switch_id] if crash_at == "DISPATCHED" else [])
    assert await store.unfinished() == []
    want = Topology(1, 2) if outcome is Outcome.SUCCEEDED else Topology(2, 1)
    assert (await second.get_state("n1")).observed == want


# ---------------------------------------------------------------------------- recovery
async def test_drain_moves_running_requests_and_records_the_continuation(core, agent):
    await core.register(registration("n2"))
    agent.requests = [RequestInfo(request_id="r1", status="RUNNING", prompt_tokens=10,
                                  output_tokens=1),
                      RequestInfo(request_id="r2", status="WAITING")]
    (d,) = await core.drain("n1", "", 0.0, "maintenance")
    assert d.action is RecoveryAction.MIGRATE and d.request_id == "r1" and agent.draining
    (order,) = agent.called("migrate_request")
    assert (order.target_node, order.target_address) == ("n2", "n2.agent:1")
    deadline = time.monotonic() + 5
    while (recs := await core.list_recoveries("n1"))[0].status == "running":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    (r,) = recs
    assert (r.status, r.token_ids, r.text, r.finish_reason) == ("finished", (5, 6, 7), "abc",
                                                                "length")
    assert r.tokens_before == 2 and r.decision == d and r.cause == "drain"


async def test_a_lost_nodes_journal_is_recomputed_elsewhere(core, agent):
    await core.register(registration("n2"))
    await core.heartbeat(Heartbeat(node="n1", inflight=(
        InflightRequest(request_id="j1", prompt_token_ids=(1, 2, 3), output_token_ids=(4,),
                        max_tokens=8),)))
    await core.store.expire("n1", time.time() + 3600, core._event(EventType.NODE_LOST, "n1"))

    async def unreachable(address, timeout=2.0):
        raise Unavailable("gone")
    agent.check_serving = unreachable
    assert await core.recovery.recover_lost("n1") == 1
    (order,) = agent.called("import_request")
    assert order.prompt_token_ids == (1, 2, 3) and order.output_token_ids == (4,)
    deadline = time.monotonic() + 5
    while (recs := await core.list_recoveries("n1"))[0].status == "running":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert recs[0].status == "finished" and recs[0].token_ids == (9,)
    assert recs[0].decision.action is RecoveryAction.RECOMPUTE


async def test_a_lost_nodes_recovery_is_retried_while_redis_is_unreachable(core, agent):
    """Redis failing under the recovery (a restart) neither drops the journal nor hands a
    request out twice: the second attempt skips what the first already handed out."""
    await core.register(registration("n2"))
    await core.heartbeat(Heartbeat(node="n1", inflight=tuple(
        InflightRequest(request_id=f"j{i}", prompt_token_ids=(1, 2), max_tokens=4)
        for i in range(2))))
    await core.store.expire("n1", time.time() + 3600, core._event(EventType.NODE_LOST, "n1"))

    async def unreachable(address, timeout=2.0):
        raise Unavailable("gone")
    agent.check_serving = unreachable
    rec = core.recovery
    real_inflight, real_record = rec.store.inflight, rec._record
    fails = {"inflight": 1, "record": 1}

    async def flaky_inflight(node):
        if fails["inflight"]:
            fails["inflight"] -= 1
            raise Unavailable("redis unavailable: Connection closed by server.")
        return await real_inflight(node)

    async def flaky_record(r, *a):
        if r.request_id == "j1" and fails["record"]:
            fails["record"] -= 1
            raise Unavailable("redis unavailable: Connection closed by server.")
        return await real_record(r, *a)
    rec.store.inflight, rec._record = flaky_inflight, flaky_record
    try:
        assert await rec.recover_lost_retrying("n1") == 2
    finally:
        del rec.store.inflight, rec._record
    assert sorted(o.request_id for o in agent.called("import_request")) == ["j0", "j1"]
    assert fails == {"inflight": 0, "record": 0} and not rec._handed


# ---------------------------------------------------------------------------- the mapping
def _populate(msg, depth: int = 0) -> None:
    """Every field of ``msg`` set to a non-default value (submessages recursively)."""
    for i, f in enumerate(msg.DESCRIPTOR.fields, start=1):
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            val = 0.25 * i if vf.type in (vf.TYPE_DOUBLE, vf.TYPE_FLOAT) else f"{f.name}-v"
            getattr(msg, f.name).update({f"{f.name}-b": val, f"{f.name}-a": val})
            continue
        if f.message_type is not None:
            if f.message_type.full_name == "google.protobuf.Timestamp":
                subs = [getattr(msg, f.name).add() for _ in range(2)] if f.is_repeated \
                    else [getattr(msg, f.name)]
                for k, s in enumerate(subs):
                    s.FromNanoseconds(1_764_654_321_123_456_789 + k)
                continue
            if depth > 3:
                continue
            subs = [getattr(msg, f.name).add() for _ in range(2)] if f.is_repeated \
                else [getattr(msg, f.name)]
            for s in subs:
                s.SetInParent()
                _populate(s, depth + 1)
            continue
        if f.enum_type is not None:
            v = f.enum_type.values[-1].number
        elif f.type == f.TYPE_STRING:
            v = f"{f.name}-{i}"
        elif f.type == f.TYPE_BYTES:
            v = b"\x01\x02"
        elif f.type == f.TYPE_BOOL:
            v = True
        elif f.type in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
            v = 0.25 * i + 0.5
        else:
            v = i + 1
        if f.is_repeated:
            getattr(msg, f.name).extend([v, v])
        else:
            setattr(msg, f.name, v)


@pytest.mark.parametrize("dc, pb", convert.PAIRS, ids=[d.__name__ for d, _ in convert.PAIRS])
def test_every_mirrored_message_round_trips_byte_for_byte(dc, pb):
    msg = pb()
    _populate(msg)
    obj = convert.from_proto(msg, dc)
    names = {f.name for f in pb.DESCRIPTOR.fields}
    assert set(vars(obj)) <= names  # a dataclass field the message lacks would be lost
    if dc in convert.PARTIAL:
        return
    assert set(vars(obj)) == names, "the mirror misses fields of its message"
    back = convert.to_proto(obj)
    assert back == msg and back.SerializeToString(deterministic=True) == \
        msg.SerializeToString(deterministic=True)
    # the same JSON (as parsed: protobuf's JSON writes a map's entries in no defined order)
    assert json.loads(convert.to_json(obj)) == json.loads(convert.to_json(msg))
    # and an empty message stays empty (unset fields are not written as set)
    assert convert.to_json(convert.from_proto(pb(), dc)) == convert.to_json(pb())


def test_json_written_by_earlier_controllers_reads_back_unchanged():
    """The store's format: a record as the proto-based controller wrote it."""
    rec = types_pb2.SwitchRecord(switch_id="sw-1", node="n", outcome=types_pb2.SWITCH_OUTCOME_RUNNING,
                                 phase=types_pb2.PHASE_SERVING_OLD, request_id="r",
                                 from_topology=types_pb2.Topology(tp=2, pp=1),
                                 to_topology=types_pb2.Topology(tp=1, pp=2))
    rec.started_at.FromNanoseconds(1_764_654_321_987_654_321)
    text = convert.to_json(rec)
    got = convert.from_json(text, SwitchRecord)
    assert got.outcome is Outcome.RUNNING and got.started_at == 1_764_654_321_987_654_321
    assert convert.to_json(got) == text
    ev = controller_pb2.Event(type=controller_pb2.EVENT_TYPE_RECOMMENDATION, node="n",
                              detail="TP1PP2")
    ev.record.to_topology.CopyFrom(types_pb2.Topology(tp=1, pp=2))
    assert convert.to_json(convert.from_json(convert.to_json(ev), Event)) == \
        convert.to_json(ev)


@pytest.mark.parametrize("enum, proto", [
    (NodeHealth, controller_pb2.NodeHealth), (EventType, controller_pb2.EventType),
    (RecoveryAction, types_pb2.RecoveryAction), (Phase, types_pb2.Phase)])
def test_enum_numbers_are_the_protos(enum, proto):
    prefix = {NodeHealth: "NODE_HEALTH_", EventType: "EVENT_TYPE_",
              RecoveryAction: "RECOVERY_ACTION_", Phase: "PHASE_"}[enum]
    assert {prefix + e.name: int(e) for e in enum} == dict(proto.items())


def test_an_event_this_process_wrote_is_read_back_without_parsing_and_equal():
    """store.event_json splices the record JSON already made for the switch key into the event,
    and remembers the event: parse_event takes it (once) instead of parsing; both ways give the
    same message as parsing what protobuf itself would have written."""
    from controller.store import event_json, parse_event

    rec = SwitchRecord(
        switch_id="sw-1", node="n1", from_topology=Topology(2, 1), to_topology=Topology(1, 2),
        outcome=Outcome.SUCCEEDED, phase=Phase.SERVING_NEW, epoch=3,
        phase_timings=tuple(PhaseTiming(phase=p, seconds=0.01) for p in FORWARD),
        kv_bytes_moved=4096, total_seconds=0.07, started_at=1, finished_at=2, reason="r")
    for ev in (Event(type=EventType.SWITCH_DONE, node="n1", switch_id="sw-1", at=5,
                     phase=Phase.SERVING_NEW, detail="succeeded", record=rec),
               Event(type=EventType.SWITCH_PHASE, node="n1", switch_id="sw-1", at=6,
                     phase=Phase.QUIESCING)):
        raw = event_json(ev, convert.to_json(rec) if ev.record else "")
        assert json.loads(raw) == json.loads(convert.to_json(ev))
        want = convert.to_proto(convert.from_json(convert.to_json(ev), Event))
        want.id = "7-0"
        cached = parse_event("7-0", raw)
        assert convert.to_proto(cached) == want
        parsed = parse_event("7-0", raw)  # used once: parsed this time
        assert convert.to_proto(parsed) == want and parsed is not cached
