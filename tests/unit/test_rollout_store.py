"""Rollouts with I/O: the Redis scripts (controller/store.py, against a private redis-server),
the driver (controller/rollouts.py) over the real Controller with agents simulated at the
AgentPort boundary, and the RolloutState <-> proto mapping."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from controller import convert, validation
from controller.config import ControllerSettings
from controller.core import Controller
from controller.model import (AbortResult, AgentDescription, EngineInfo, Event, EventType,
                              HostFacts, ModelFacts, Outcome, Phase, PhaseTiming, Registration,
                              RolloutMeta, SwitchOrder, SwitchProgress, SwitchRecord, Topology)
from controller.rollout import (NodeStatus, RolloutStatus, new_rollout, plan_rollout,
                                capacity_table, RolloutNode, request_id)
from controller.rollouts import Action, RolloutSpec
from controller.store import Store
from remp.controller.v1 import controller_pb2
from remp.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from remp.redisproc import RedisServer

TP2, PP2 = Topology(2, 1), Topology(1, 2)
CAP = {"TP2PP1": 9.0, "TP1PP2": 10.0, "TP1PP1": 5.0}
FORWARD = (Phase.QUIESCING, Phase.PREPARING_WORKERS, Phase.MPU_APPLIED, Phase.MIGRATE_KV,
           Phase.RELOAD_SHARDS, Phase.REBINDING, Phase.SERVING_NEW)


class Fleet:
    """Agents at the AgentPort boundary, one per address: each switch runs its phases (held at
    QUIESCING while ``hold`` is set), a node in ``fail`` rolls back at MIGRATE_KV, and every
    ExecuteSwitch is logged (``executed``)."""

    def __init__(self):
        self.topology: dict[str, Topology] = {}
        self.records: dict[str, SwitchRecord] = {}
        self.executed: list[tuple[str, str]] = []  # (node, switch id) in start order
        self.fail: set[str] = set()
        self.hold = asyncio.Event()
        self.hold.set()
        self.aborted: set[str] = set()

    @staticmethod
    def node(address: str) -> str:
        return address.split(".", 1)[0]

    def connected(self, address: str) -> bool:
        return False  # every switch asks check_serving first

    async def check_serving(self, address: str, timeout: float = 2.0) -> None:
        pass

    async def describe(self, address: str) -> AgentDescription:
        return AgentDescription(topology=self.topology[self.node(address)],
                                engine=EngineInfo(num_blocks=64, free_blocks=64, block_size=16))

    async def execute_switch(self, address: str, order: SwitchOrder
                             ) -> AsyncIterator[SwitchProgress]:
        n = self.node(address)
        self.executed.append((n, order.switch_id))
        src, t0 = self.topology[n], time.time_ns()
        outcome, phase = Outcome.SUCCEEDED, Phase.SERVING_NEW
        for ph in FORWARD:
            yield SwitchProgress(switch_id=order.switch_id, phase=ph)
            if ph is Phase.QUIESCING:
                await self.hold.wait()
                if order.switch_id in self.aborted:
                    outcome, phase = Outcome.ABORTED, Phase.ROLLED_BACK
                    break
            if ph is Phase.MIGRATE_KV and n in self.fail:
                outcome, phase = Outcome.ROLLED_BACK, Phase.ROLLED_BACK
                break
        rec = SwitchRecord(switch_id=order.switch_id, node=n, from_topology=src,
                           to_topology=order.target, outcome=outcome, phase=phase,
                           epoch=order.epoch, started_at=t0, finished_at=time.time_ns(),
                           phase_timings=(PhaseTiming(phase=Phase.QUIESCING, seconds=0.001),))
        self.records[order.switch_id] = rec
        if outcome is Outcome.SUCCEEDED:
            self.topology[n] = order.target
        yield SwitchProgress(switch_id=order.switch_id, phase=phase, record=rec)

    async def get_switch(self, address: str, switch_id: str) -> SwitchRecord | None:
        return self.records.get(switch_id)

    async def abort_switch(self, address: str, switch_id: str, reason: str) -> AbortResult:
        self.aborted.add(switch_id)
        return AbortResult(aborted=True, phase=Phase.QUIESCING)


def registration(node: str, topology: Topology = TP2, labels=()) -> Registration:
    return Registration(
        node=node, agent_address=f"{node}.agent:1", http_address=f"http://{node}",
        topology=topology, candidates=(Topology(1, 1), TP2, PP2),
        host=HostFacts(hostname=node, device_type="cpu", device_count=2, cpu_cores=2),
        model=ModelFacts(num_layers=4, num_attention_heads=8, num_kv_heads=4, head_size=32,
                         hidden_size=256, dtype="float32", weight_bytes=10_000_000),
        labels=tuple(labels))


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as r:
        yield r


@pytest.fixture
async def store(redis_server):
    s = Store(redis_server.url, prefix=f"t-ro-{uuid.uuid4().hex[:8]}:")
    yield s
    await s.close()


@pytest.fixture
def fleet() -> Fleet:
    return Fleet()


async def make_core(store: Store, fleet: Fleet, nodes=("n1", "n2", "n3"), labels=()
                    ) -> Controller:
    # not started: no lease sweeper, no event hub (the driver follows switches by reading
    # their rows then); resume_all is what start() adds for rollouts
    c = Controller(ControllerSettings(lease_seconds=30.0), store, fleet)
    for n in nodes:
        fleet.topology.setdefault(n, TP2)
        await c.register(registration(n, fleet.topology[n], labels))
    return c


@pytest.fixture
async def core(store, fleet):
    c = await make_core(store, fleet, labels=(("zone", "a"),))
    yield c
    await c.stop()


def spec(**kw) -> RolloutSpec:
    base = dict(target=PP2, floor=0.5, max_parallel=3, capacity=CAP, nodes=("n1", "n2", "n3"))
    base.update(kw)
    return RolloutSpec(**base)


async def until_final(core: Controller, rid: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        v = await core.rollouts.get(rid)
        if v.state.terminal or v.state.status is RolloutStatus.PAUSED:
            return v.state
        assert time.monotonic() < deadline, v.state
        await asyncio.sleep(0.02)


async def events(store: Store, rid: str) -> list[Event]:
    return [e for _, e in await store.read_events("0-0", None, 10_000) if e.rollout_id == rid]


# ---------------------------------------------------------------------- the scripts
def _state(rid: str, names=("n1", "n2")):
    nodes = [RolloutNode(n, TP2, (TP2, PP2)) for n in names]
    return new_rollout(rid, plan_rollout(nodes, PP2, 0.0, 1, capacity_table(CAP)))


async def test_create_holds_the_nodes_dedups_by_request_id_and_refuses_a_held_node(store, core):
    st = _state("ro-a")
    ev = Event(type=EventType.ROLLOUT_PLANNED, rollout_id="ro-a")
    assert await store.rollout_create("ro-a", convert.rollout_to_json(st), st.status, "req-1",
                                      1.0, "{}", "", ["n1", "n2"], ev) == ("ok", "ro-a", "")
    assert (await store.node("n1"))["rollout"] == "ro-a"
    assert await store.active_rollouts() == ["ro-a"]
    # the same request id: the earlier rollout, nothing written
    assert (await store.rollout_create("ro-b", "{}", "planned", "req-1", 2.0, "{}", "",
                                       ["n3"], ev))[:2] == ("dup", "ro-a")
    assert await store.rollout("ro-b") is None
    # a node of another rollout: refused, and nothing of the new one is held
    assert await store.rollout_create("ro-c", "{}", "planned", "", 3.0, "{}", "",
                                      ["n3", "n2"], ev) == ("busy", "ro-a", "n2")
    assert (await store.node("n3")).get("rollout", "") == ""
    assert await store.rollout_ids(10) == ["ro-a"]
    assert [e.type for e in await events(store, "ro-a")] == [EventType.ROLLOUT_PLANNED]


async def test_step_is_compare_and_set_and_a_terminal_step_releases_the_nodes(store, core):
    st = _state("ro-s")
    ev = Event(type=EventType.ROLLOUT_PROGRESS, rollout_id="ro-s")
    await store.rollout_create("ro-s", convert.rollout_to_json(st), st.status, "", 1.0, "{}",
                               "", ["n1", "n2"], ev)
    assert await store.rollout_step("ro-s", 0, 1, "{}", "running", False, ["n1", "n2"], ev)
    assert not await store.rollout_step("ro-s", 0, 1, "{}", "running", False, ["n1"], ev)
    assert (await store.node("n1"))["rollout"] == "ro-s"  # not terminal: still held
    assert await store.rollout_step("ro-s", 1, 2, "{}", "done", True, ["n1", "n2", "n3"], ev)
    row = await store.rollout("ro-s")
    assert (row.version, row.status) == (2, "done")
    assert await store.active_rollouts() == []
    assert [(await store.node(n)).get("rollout", "") for n in ("n1", "n2")] == ["", ""]
    assert len(await events(store, "ro-s")) == 3  # one event per change
    with pytest.raises(NotFound):
        await store.rollout_step("ro-none", 0, 1, "{}", "done", True, [], ev)


async def test_a_held_node_refuses_other_switches_but_takes_its_rollouts(store, core):
    st = _state("ro-h", ("n1",))
    await store.rollout_create("ro-h", convert.rollout_to_json(st), st.status, "", 1.0, "{}",
                               "", ["n1"], Event(rollout_id="ro-h"))
    with pytest.raises(FailedPrecondition, match="held by rollout ro-h"):
        await core.reconfigure("n1", PP2, "manual-1", "operator")
    with pytest.raises(FailedPrecondition, match="held by rollout ro-h"):
        await core.reconfigure("n1", PP2, "rollout:ro-other:n1", "another rollout's id")
    r = await core.reconfigure("n1", PP2, request_id("ro-h", "n1"), "its own")
    assert r.switch_id and not r.noop
    assert (await core.reconfigure("n2", PP2, "manual-2", "not held")).switch_id


# ---------------------------------------------------------------------- the driver
async def test_floor_one_at_a_time_switches_in_order_and_keeps_the_floor(core, fleet, store):
    v = await core.rollouts.create(spec(request_id="r-1", reason="evening peak"))
    assert [w.nodes for w in v.state.plan.waves] == [("n1",), ("n2",), ("n3",)]
    st = await until_final(core, v.state.rollout_id)
    assert st.status is RolloutStatus.DONE and not st.failed_node
    assert [n for n, _ in fleet.executed] == ["n1", "n2", "n3"]
    assert all(p.status is NodeStatus.SUCCEEDED and p.outcome is Outcome.SUCCEEDED
               for p in st.nodes)
    for p in st.nodes:  # each node's switch record: the rollout's request id, succeeded
        rec = await core.get_switch(p.switch_id)
        assert rec.outcome is Outcome.SUCCEEDED and rec.request_id == request_id(
            st.rollout_id, p.node) and rec.reason.startswith(f"rollout {st.rollout_id} wave")
    # the switches never overlapped: capacity never below 18 (of 27, floor 13.5)
    recs = sorted([fleet.records[s] for _, s in fleet.executed], key=lambda r: r.started_at)
    assert all(a.finished_at <= b.started_at for a, b in zip(recs, recs[1:]))
    # the nodes are released; the same request id returns the same rollout
    assert all(not n.rollout_id for n in await core.list_nodes())
    again = await core.rollouts.create(spec(request_id="r-1"))
    assert again.duplicate and again.state.rollout_id == st.rollout_id
    types = [e.type for e in await events(store, st.rollout_id)]
    assert types[0] is EventType.ROLLOUT_PLANNED and types[-1] is EventType.ROLLOUT_DONE
    assert types.count(EventType.ROLLOUT_WAVE) == 3
    listed = await core.rollouts.list(False, 10)
    assert [x.state.rollout_id for x in listed] == [st.rollout_id]
    assert listed[0].meta.description == "evening peak"


async def test_failure_on_the_second_node_stops_the_rollout(core, fleet):
    fleet.fail.add("n2")
    v = await core.rollouts.create(spec())
    st = await until_final(core, v.state.rollout_id)
    assert st.status is RolloutStatus.FAILED and st.failed_node == "n2"
    assert [p.status for p in st.nodes] == [NodeStatus.SUCCEEDED, NodeStatus.ROLLED_BACK,
                                            NodeStatus.PENDING]
    assert [n for n, _ in fleet.executed] == ["n1", "n2"]  # n3 untouched
    assert fleet.topology == {"n1": PP2, "n2": TP2, "n3": TP2}
    assert "n2" in st.reason and "rolled_back" in st.reason


async def test_pause_resume_and_abort(core, fleet):
    fleet.hold.clear()  # switches wait at QUIESCING
    v = await core.rollouts.create(spec(nodes=("n1", "n2", "n3")))
    rid = v.state.rollout_id
    while not fleet.executed:
        await asyncio.sleep(0.01)
    p = await core.rollouts.control(rid, Action.PAUSE, "operator pause")
    assert p.state.status is RolloutStatus.RUNNING and p.state.pause_requested
    fleet.hold.set()
    st = await until_final(core, rid)
    assert st.status is RolloutStatus.PAUSED and st.wave == 0
    await asyncio.sleep(0.1)
    assert [n for n, _ in fleet.executed] == ["n1"]  # nothing further started
    with pytest.raises(FailedPrecondition):  # a paused rollout holds its nodes
        await core.reconfigure("n3", PP2, "manual", "")
    fleet.hold.clear()
    r = await core.rollouts.control(rid, Action.RESUME, "")
    assert r.state.status is RolloutStatus.RUNNING and r.state.wave == 1
    while len(fleet.executed) < 2:
        await asyncio.sleep(0.01)
    a = await core.rollouts.control(rid, Action.ABORT, "operator abort")
    assert a.state.abort_requested
    fleet.hold.set()
    st = await until_final(core, rid)
    assert st.status is RolloutStatus.ABORTED and not st.failed_node
    assert [p.status for p in st.nodes] == [NodeStatus.SUCCEEDED, NodeStatus.ROLLED_BACK,
                                            NodeStatus.PENDING]
    assert [n for n, _ in fleet.executed] == ["n1", "n2"]
    with pytest.raises(FailedPrecondition):
        await core.rollouts.control(rid, Action.RESUME, "")
    assert (await core.reconfigure("n3", PP2, "manual", "")).switch_id  # released


async def test_labels_dry_run_errors(core, fleet):
    v = await core.rollouts.create(spec(nodes=(), labels={"zone": "a"}, dry_run=True))
    assert v.dry_run and v.state.rollout_id == "" and v.state.plan.order == ("n1", "n2", "n3")
    assert not fleet.executed and await core.rollouts.list(False, 10) == []
    with pytest.raises(NotFound):
        await core.rollouts.create(spec(nodes=(), labels={"zone": "b"}))
    with pytest.raises(NotFound):
        await core.rollouts.create(spec(nodes=("n9",)))
    with pytest.raises(InvalidArgument):
        await core.rollouts.create(spec(capacity={}))
    with pytest.raises(InvalidArgument):
        await core.rollouts.create(spec(floor=float("nan")))
    with pytest.raises(FailedPrecondition, match="cannot be kept"):
        await core.rollouts.create(spec(floor=0.9))
    with pytest.raises(NotFound):
        await core.rollouts.get("ro-nope")
    assert (await core.get_state("n1")).labels == (("zone", "a"),)


async def test_a_restarted_controller_resumes_without_running_a_switch_twice(store, fleet):
    a = await make_core(store, fleet)
    gate, reached = asyncio.Event(), asyncio.Event()
    real_finished = a.rollouts._finished

    async def stuck_after_n2(rid, node, *args, **kw):  # the process "dies" here for n2
        if node == "n2":
            reached.set()
            await gate.wait()
        return await real_finished(rid, node, *args, **kw)
    a.rollouts._finished = stuck_after_n2
    v = await a.rollouts.create(spec())
    rid = v.state.rollout_id
    # the driver read n2's finished switch (its row is final: the agent's record, then the
    # controller's) and is about to record it; not when the agent alone has finished, or the
    # stop below could cut the controller's own switch driver before it wrote the row
    await asyncio.wait_for(reached.wait(), 10)
    assert any(r.outcome is Outcome.SUCCEEDED and r.node == "n2" for r in fleet.records.values())
    await a.stop()  # n2's switch finished; the rollout never heard of it
    st = (await a.rollouts.get(rid)).state
    assert st.status is RolloutStatus.RUNNING and st.switching == ("n2",)
    b = await make_core(store, fleet, nodes=())
    await b.rollouts.resume_all()
    try:
        st = await until_final(b, rid)
    finally:
        await b.stop()
    assert st.status is RolloutStatus.DONE
    assert [n for n, _ in fleet.executed] == ["n1", "n2", "n3"]  # n2 once: followed again


async def test_the_driver_waits_out_redis_errors_and_runs_each_switch_once(core, fleet, store,
                                                                         monkeypatch):
    real_step, fails = store.rollout_step, {"n": 0}

    async def flaky_step(rid, expected, new, state_json, status, terminal, nodes, ev):
        if '"n2"' in ev.detail or "n2:" in ev.detail:  # every write about n2 fails twice
            if fails["n"] < 2:
                fails["n"] += 1
                raise Unavailable("redis unavailable: Connection closed by server.")
        return await real_step(rid, expected, new, state_json, status, terminal, nodes, ev)
    monkeypatch.setattr(store, "rollout_step", flaky_step)
    monkeypatch.setattr("controller.rollouts.FOLLOW_POLL_S", 0.2)
    v = await core.rollouts.create(spec())
    st = await until_final(core, v.state.rollout_id, timeout=20)
    assert st.status is RolloutStatus.DONE and fails["n"] == 2
    assert [n for n, _ in fleet.executed] == ["n1", "n2", "n3"]


async def test_a_wave_that_would_break_the_floor_now_pauses(core, fleet, store):
    fleet.hold.clear()
    v = await core.rollouts.create(spec())
    rid = v.state.rollout_id
    while not fleet.executed:
        await asyncio.sleep(0.01)
    await store.expire("n3", time.time() + 3600, Event(node="n3"))  # n3 lost meanwhile
    fleet.hold.set()
    st = await until_final(core, rid)
    assert st.status is RolloutStatus.PAUSED and "not serving: n3" in st.reason
    assert [n for n, _ in fleet.executed] == ["n1"]


# ---------------------------------------------------------------------- mapping, validation
def test_rollout_state_round_trips_through_its_message():
    nodes = [RolloutNode(n, TP2, (TP2, PP2)) for n in ("a", "b", "c")]
    plan = plan_rollout(nodes + [RolloutNode("d", PP2, (PP2,))], PP2, 0.5, 2, capacity_table(CAP))
    from controller.rollout import start, switch_finished, switch_started
    s = start(new_rollout("ro-x", plan)).state
    s = switch_started(s, "a", "sw-1")
    s = switch_finished(s, "a", Outcome.ROLLED_BACK, "boom").state
    meta = RolloutMeta(request_id="r", created_at=1_764_654_321_123_456_789,
                       capacity_rps=tuple(sorted(CAP.items())), description="why")
    msg = convert.rollout_to_proto(s, meta)
    assert convert.rollout_from_proto(msg) == (s, meta)
    assert convert.rollout_from_json(convert.rollout_to_json(s, meta)) == (s, meta)
    assert msg.status == controller_pb2.ROLLOUT_STATUS_RUNNING and msg.failed_node == "a"


def test_rollout_requests_are_bounded():
    validation.check(controller_pb2.RolloutRequest(nodes=["n1"], labels={"zone": "eu-1"},
                                                   capacity_rps={"TP2PP1": 9.0}))
    for bad in (controller_pb2.RolloutRequest(nodes=["n 1"]),
                controller_pb2.RolloutRequest(labels={"zone": "a b"}),
                controller_pb2.RolloutRequest(labels={"": "a"}),
                controller_pb2.RolloutRequest(capacity_rps={"TPxPP1": 1.0}),
                controller_pb2.RolloutRequest(request_id="r" * 200),
                controller_pb2.ControlRolloutRequest(rollout_id="../x"),
                controller_pb2.RegisterNodeRequest(labels={f"k{i}": "v" for i in range(65)})):
        with pytest.raises(InvalidArgument):
            validation.check(bad)


def test_watch_filters_by_rollout_id():
    from controller.watch import Fanout

    f = Fanout(10)
    mine, every = f.subscribe("", "", "0-0", rollout_id="ro-1"), f.subscribe("", "", "0-0")
    f.publish([Event(id="1-0", rollout_id="ro-1", type=EventType.ROLLOUT_WAVE),
               Event(id="2-0", rollout_id="ro-2"), Event(id="3-0", node="n1")])
    assert [e.id for e in mine._items] == ["1-0"]
    assert [e.id for e in every._items] == ["1-0", "2-0", "3-0"]


async def test_a_switch_the_dead_leader_never_dispatched_is_started_again(store, fleet):
    """The leader dies after taking a node's slot and before sending the switch: the next one
    ends that switch NOT_DISPATCHED (nothing ran) and the rollout switches the node again
    instead of failing (bench/control_plane_faults.py's K0 left the rollout FAILED)."""
    a = await make_core(store, fleet)

    async def dies_at_accepted(point):  # the process "dies" here: never dispatches
        if point == "ACCEPTED":
            await asyncio.Event().wait()
    a._pause_point = dies_at_accepted
    # a pause point configured: the switch is written accepted, its dispatch separately
    a.s = a.s.model_copy(update={"test_pause_at": "ACCEPTED"})
    v = await a.rollouts.create(spec(max_parallel=1))
    rid = v.state.rollout_id
    while not (await a.rollouts.get(rid)).state.switching:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    await a.stop()
    assert not fleet.executed
    b = await make_core(store, fleet, nodes=())
    await b.lead()  # reconciles the undispatched switch, resumes the rollout
    try:
        st = await until_final(b, rid)
    finally:
        await b.stop()
    assert st.status is RolloutStatus.DONE, st
    assert sorted(n for n, _ in fleet.executed) == ["n1", "n2", "n3"]  # each once


async def test_a_task_cancelled_inside_a_store_call_stops(redis_server):
    """redis-py (8.2) answers most cancels that land inside a call by finishing the call and
    dropping the cancel (measured here: 199 of 200 looping tasks ran on); the store re-raises it
    when the call returns (``redisconn.raise_if_cancelling``), so a cancelled driver stops —
    as a step-down or stop() expects."""
    store = Store(redis_server.url, prefix=f"t-cancel-{uuid.uuid4().hex[:6]}:")

    async def loop():
        while True:
            await store.switch("sw-none")
    try:
        for _ in range(40):
            t = asyncio.create_task(loop())
            await asyncio.sleep(0.001)
            t.cancel()
            done, _ = await asyncio.wait({t}, timeout=2)
            assert done, "a cancelled task went on calling Redis"
    finally:
        t.cancel()
        await store.close()
