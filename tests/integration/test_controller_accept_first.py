"""Reconfigure accepts first and checks the agent asynchronously (issue 17: the control path
stays fast with HA in it). A real controller process (leader lease on: its writes fenced by the
term) on a real redis-server, real gRPC; the agent is a grpc.health.v1 server in this process
whose answer the test holds back, or an address nobody listens on. Timing is the bench's
(bench/control_plane.py --ha), never asserted here: these tests check the order of things."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devstack.agentproc import ControllerProcess, free_port
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from tests.integration.test_controller import code_of, reg

DONE = {controller_pb2.EVENT_TYPE_SWITCH_DONE, controller_pb2.EVENT_TYPE_SWITCH_FAILED,
        controller_pb2.EVENT_TYPE_SWITCH_ROLLED_BACK, controller_pb2.EVENT_TYPE_SWITCH_ABORTED}


class HeldHealth(health_pb2_grpc.HealthServicer):
    """An agent's health service that answers ``status`` only once ``release`` is set."""

    def __init__(self, status=health_pb2.HealthCheckResponse.NOT_SERVING):
        self.status = status
        self.entered, self.release, self.answered = (threading.Event(), threading.Event(),
                                                     threading.Event())

    def Check(self, request, context):
        self.entered.set()
        self.release.wait(30)
        self.answered.set()
        return health_pb2.HealthCheckResponse(status=self.status)


class Calls(grpc.GenericRpcHandler):
    """Every other method called on the fake agent (answered UNIMPLEMENTED)."""

    def __init__(self):
        self.methods: list[str] = []

    def service(self, handler_call_details):
        self.methods.append(handler_call_details.method)
        return None


@pytest.fixture
def held_agent():
    health = HeldHealth()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    health.calls = Calls()
    server.add_generic_rpc_handlers((health.calls,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    health.address = f"127.0.0.1:{port}"
    yield health
    health.release.set()
    server.stop(0)


@pytest.fixture(scope="module")
def ctl(redis_server, artifacts_dir):
    # a node lease longer than the module (the nodes never heartbeat); a leader lease, as an
    # HA controller runs: the switch scripts carry its term
    c = ControllerProcess(redis_server.url, log_dir=artifacts_dir, lease_seconds=600,
                          name="ctl-accept-first",
                          env={"REMP_CONTROLLER_LEADER_LEASE_SECONDS": "1.5"})
    with c:
        with grpc.insecure_channel(c.addr) as ch:
            stub, deadline = c.stub(ch), time.monotonic() + 30
            while True:  # leading once a write is answered by the leader (NOT_FOUND)
                code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
                    node="nobody", target=types_pb2.Topology(tp=1, pp=2)), timeout=5)
                if code == grpc.StatusCode.NOT_FOUND:
                    break
                assert code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, msg
                time.sleep(0.1)
        yield c


@pytest.fixture
def stub(ctl):
    with grpc.insecure_channel(ctl.addr) as ch:
        yield ctl.stub(ch)


@pytest.fixture
def r(redis_server):
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as client:
        yield client


def to_tp1pp2(node, request_id=""):
    return controller_pb2.ReconfigureRequest(node=node, target=types_pb2.Topology(tp=1, pp=2),
                                             request_id=request_id, reason="accept-first test")


class Watcher:
    """A Watch on one node, read in a thread until the switch ``sid`` ends."""

    def __init__(self, stub, node):
        self.events, self.opened = [], threading.Event()
        self.sid, self.done = None, threading.Event()
        self._stream = stub.Watch(controller_pb2.WatchRequest(node=node), timeout=60)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        try:
            for ev in self._stream:
                self.events.append(ev)
                if ev.type in DONE and ev.switch_id == self.sid:
                    self.done.set()
                    return
        except grpc.RpcError:
            pass

    def final(self, sid, timeout=30):
        self.sid = sid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # the id may be learnt after the event arrived
            hit = [e for e in self.events if e.type in DONE and e.switch_id == sid]
            if hit:
                self._stream.cancel()
                return hit[0]
            self.done.wait(0.05)
        raise AssertionError(f"no final event for {sid} in {timeout} s: {self.events}")


def wait_final(stub, sid, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        rec = stub.GetSwitch(controller_pb2.GetSwitchRequest(switch_id=sid), timeout=5)
        if rec.outcome != types_pb2.SWITCH_OUTCOME_RUNNING:
            return rec
        assert time.monotonic() < deadline, rec
        time.sleep(0.05)


def test_reconfigure_answers_before_the_agent_check_and_a_failed_check_rolls_back(
        stub, held_agent, r):
    stub.RegisterNode(reg("af1", agent=held_agent.address), timeout=5)
    watch = Watcher(stub, "af1")
    time.sleep(0.2)  # the stream is registered server-side
    res = stub.Reconfigure(to_tp1pp2("af1", "af-req-1"), timeout=10)
    # answered while the agent's health check is still unanswered: accepted, recorded
    assert not held_agent.answered.is_set()
    assert res.switch_id and not res.duplicate and not res.noop
    rec = stub.GetSwitch(controller_pb2.GetSwitchRequest(switch_id=res.switch_id), timeout=5)
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_RUNNING
    assert rec.phase == types_pb2.PHASE_SERVING_OLD and rec.request_id == "af-req-1"
    st = stub.GetState(controller_pb2.GetStateRequest(node="af1"), timeout=5)
    assert st.current_switch.switch_id == res.switch_id
    # the same request again while it runs: the same switch; another switch: the node is busy
    dup = stub.Reconfigure(to_tp1pp2("af1", "af-req-1"), timeout=10)
    assert dup.duplicate and dup.switch_id == res.switch_id
    code, msg = code_of(stub.Reconfigure, to_tp1pp2("af1", "af-req-2"), timeout=10)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and res.switch_id in msg, msg
    assert held_agent.entered.wait(10), "the controller never asked the agent's health"
    held_agent.release.set()  # the agent answers NOT_SERVING
    ev = watch.final(res.switch_id)
    assert ev.type == controller_pb2.EVENT_TYPE_SWITCH_ROLLED_BACK
    assert ev.record.error.code == "AGENT_UNAVAILABLE"
    rec = wait_final(stub, res.switch_id)
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_ROLLED_BACK
    assert rec.phase == types_pb2.PHASE_ROLLED_BACK
    assert rec.error.code == "AGENT_UNAVAILABLE" and rec.error.retryable
    assert held_agent.address in rec.error.message and "not sent" in rec.error.message
    assert rec.error.phase == types_pb2.PHASE_SERVING_OLD
    # nothing was sent, nothing changed: the old topology, the slot free
    assert held_agent.calls.methods == []
    st = stub.GetState(controller_pb2.GetStateRequest(node="af1"), timeout=5)
    assert (st.observed.tp, st.observed.pp) == (2, 1) and not st.HasField("current_switch")
    assert not r.sismember("remp:unfinished", res.switch_id)
    # after it ended the request id still names that switch
    again = stub.Reconfigure(to_tp1pp2("af1", "af-req-1"), timeout=10)
    assert again.duplicate and again.switch_id == res.switch_id


def test_an_unreachable_agent_ends_the_switch_rolled_back_and_changes_nothing(stub):
    address = f"127.0.0.1:{free_port()}"  # nobody listens
    stub.RegisterNode(reg("af2", agent=address), timeout=5)
    res = stub.Reconfigure(to_tp1pp2("af2", "af2-r1"), timeout=10)
    assert res.switch_id and not res.duplicate
    rec = wait_final(stub, res.switch_id)
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_ROLLED_BACK
    assert rec.error.code == "AGENT_UNAVAILABLE" and "unreachable" in rec.error.message
    assert address in rec.error.message
    st = stub.GetState(controller_pb2.GetStateRequest(node="af2"), timeout=5)
    assert (st.observed.tp, st.observed.pp) == (2, 1) and not st.HasField("current_switch")
    hist = stub.ListSwitches(controller_pb2.ListSwitchesRequest(node="af2"), timeout=5)
    assert [s.switch_id for s in hist.switches] == [res.switch_id]
    # the slot is free: the next switch is accepted (and ends the same way)
    nxt = stub.Reconfigure(to_tp1pp2("af2", "af2-r2"), timeout=10)
    assert nxt.switch_id != res.switch_id and not nxt.duplicate
    assert wait_final(stub, nxt.switch_id).error.code == "AGENT_UNAVAILABLE"


def test_concurrent_duplicates_get_one_switch(ctl, held_agent):
    """Eight callers with one request id at once: one switch, every caller its id."""
    with grpc.insecure_channel(ctl.addr) as ch:
        stub = ctl.stub(ch)
        stub.RegisterNode(reg("af3", agent=held_agent.address), timeout=5)
        got, barrier = [], threading.Barrier(8)

        def call():
            barrier.wait()
            got.append(stub.Reconfigure(to_tp1pp2("af3", "af3-same"), timeout=10))
        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(got) == 8
        assert len({g.switch_id for g in got}) == 1
        assert sum(not g.duplicate for g in got) == 1
        held_agent.release.set()
        assert wait_final(stub, got[0].switch_id).error.code == "AGENT_UNAVAILABLE"
        hist = stub.ListSwitches(controller_pb2.ListSwitchesRequest(node="af3"), timeout=5)
        assert [s.switch_id for s in hist.switches] == [got[0].switch_id]


def test_what_redis_knows_is_still_answered_synchronously(stub):
    code, _ = code_of(stub.Reconfigure, to_tp1pp2("af-nobody"), timeout=10)
    assert code == grpc.StatusCode.NOT_FOUND
    stub.RegisterNode(reg("af4"), timeout=5)
    code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="af4", target=types_pb2.Topology(tp=4, pp=4)), timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
    code, _ = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="af4", target=types_pb2.Topology(tp=1, pp=2), request_id="x" * 10_000), timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_plan_from_the_leaders_last_read_is_checked_when_the_slot_is_taken(stub, r):
    """The leader plans a node's next switch from its last read of it, without reading again;
    the slot-taking script refuses that plan when the node changed meanwhile, and the switch
    is decided on a fresh read: another registration, a topology a heartbeat reported, a
    lost node."""
    address = f"127.0.0.1:{free_port()}"  # nobody listens: every switch ends rolled back
    stub.RegisterNode(reg("af5", agent=address), timeout=5)
    first = stub.Reconfigure(to_tp1pp2("af5"), timeout=10)  # the node read, remembered
    assert wait_final(stub, first.switch_id).error.code == "AGENT_UNAVAILABLE"
    # registered again without TP1PP2 among its candidates: refused by the new registration
    stub.RegisterNode(reg("af5", agent=address, candidates=((1, 1), (2, 1))), timeout=5)
    code, msg = code_of(stub.Reconfigure, to_tp1pp2("af5"), timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a candidate" in msg, msg
    stub.RegisterNode(reg("af5", agent=address), timeout=5)
    again = stub.Reconfigure(to_tp1pp2("af5"), timeout=10)
    assert wait_final(stub, again.switch_id).error.code == "AGENT_UNAVAILABLE"
    # a heartbeat reports TP1PP2 (the agent moved on its own): the same target is a noop now
    stub.Heartbeat(controller_pb2.HeartbeatRequest(
        node="af5", topology=types_pb2.Topology(tp=1, pp=2), topology_epoch=1000), timeout=5)
    noop = stub.Reconfigure(to_tp1pp2("af5"), timeout=10)
    assert noop.noop, noop
    # back on TP2PP1 and remembered; then the node is lost: UNAVAILABLE, nothing begun
    stub.RegisterNode(reg("af5", agent=address), timeout=5)
    third = stub.Reconfigure(to_tp1pp2("af5"), timeout=10)
    assert wait_final(stub, third.switch_id).error.code == "AGENT_UNAVAILABLE"
    r.hset("remp:node:af5", "health", "lost")
    code, msg = code_of(stub.Reconfigure, to_tp1pp2("af5"), timeout=10)
    assert code == grpc.StatusCode.UNAVAILABLE and "lost" in msg, msg
    hist = stub.ListSwitches(controller_pb2.ListSwitchesRequest(node="af5"), timeout=5)
    assert len(hist.switches) == 4  # three rolled back, one noop
