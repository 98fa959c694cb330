"""The controller against a real Redis server and real gRPC, without an engine: registration,
leases, validation, auth, paging, Redis outages, agent unreachable. (Switches through a real
agent are in tests/e2e/test_controller_e2e.py.)"""

import threading
import time

import grpc
import pytest

from remp.agentproc import ControllerProcess, free_port, grpcurl
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.redisproc import RedisServer

TOKEN = "s3cret"


def reg(node="n1", agent=None, tp=2, pp=1, candidates=((1, 1), (2, 1), (1, 2))):
    return controller_pb2.RegisterNodeRequest(
        node=node, agent_address=agent or f"127.0.0.1:{free_port()}", http_address="http://x",
        topology=types_pb2.Topology(tp=tp, pp=pp),
        candidates=[types_pb2.Topology(tp=t, pp=p) for t, p in candidates],
        host=types_pb2.HostFacts(hostname="h", device_type="cpu", device_count=2, cpu_cores=2),
        model=types_pb2.ModelFacts(num_layers=4, num_attention_heads=8, num_kv_heads=4,
                                   head_size=32, hidden_size=256, dtype="float32",
                                   weight_bytes=10_000_000))


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as r:
        yield r


@pytest.fixture(scope="module")
def ctl(redis_server, artifacts_dir):
    c = ControllerProcess(redis_server.url, log_dir=artifacts_dir, token=TOKEN,
                          lease_seconds=1.0, name="ctl-integration")
    with c:
        yield c


@pytest.fixture
def stub(ctl):
    with grpc.insecure_channel(ctl.addr) as ch:
        yield ctl.stub(ch)


MD = (("authorization", f"Bearer {TOKEN}"),)


def code_of(fn, *a, **kw):
    with pytest.raises(grpc.RpcError) as ei:
        fn(*a, **kw)
    return ei.value.code(), ei.value.details()


def test_register_list_and_state(stub):
    r = stub.RegisterNode(reg("a1"), metadata=MD, timeout=5)
    assert r.lease_seconds == 1.0
    st = stub.GetState(controller_pb2.GetStateRequest(node="a1"), timeout=5)
    assert (st.observed.tp, st.observed.pp) == (2, 1) and not st.stale
    assert st.health == controller_pb2.NODE_HEALTH_READY
    assert "a1" in [n.node for n in stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes]


def test_mutating_rpcs_need_the_token(stub):
    code, msg = code_of(stub.RegisterNode, reg("a2"), timeout=5)
    assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in msg
    code, _ = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="a2", target=types_pb2.Topology(tp=1, pp=2)), metadata=(("authorization", "Bearer x"),),
        timeout=5)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # reads need no token
    stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5)


def test_errors_have_the_right_status(stub):
    stub.RegisterNode(reg("a3"), metadata=MD, timeout=5)
    code, _ = code_of(stub.GetState, controller_pb2.GetStateRequest(node="nope"), timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND
    code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="a3", target=types_pb2.Topology(tp=3, pp=1)), metadata=MD, timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "TP1PP2" in msg and "valid targets" in msg
    # an agent without world-size changes (--no-world-changes) offers only its own world
    stub.RegisterNode(reg("a3w", candidates=((2, 1), (1, 2))), metadata=MD, timeout=5)
    code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="a3w", target=types_pb2.Topology(tp=1, pp=1)), metadata=MD, timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a candidate" in msg, msg
    assert "valid targets: TP2PP1, TP1PP2" in msg
    code, _ = code_of(stub.GetSwitch, controller_pb2.GetSwitchRequest(switch_id="sw-x"), timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = code_of(stub.ListSwitches, controller_pb2.ListSwitchesRequest(page_token="zz"),
                      timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = code_of(stub.Abort, controller_pb2.AbortRequest(switch_id="sw-x"), metadata=MD,
                      timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND


def test_agent_unreachable_is_unavailable_and_changes_nothing(stub):
    stub.RegisterNode(reg("a4"), metadata=MD, timeout=5)
    before = stub.ListSwitches(controller_pb2.ListSwitchesRequest(node="a4"), timeout=5)
    code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="a4", target=types_pb2.Topology(tp=1, pp=2), request_id="r1"), metadata=MD, timeout=10)
    assert code == grpc.StatusCode.UNAVAILABLE and "unreachable" in msg
    st = stub.GetState(controller_pb2.GetStateRequest(node="a4"), timeout=5)
    assert (st.observed.tp, st.observed.pp) == (2, 1) and not st.HasField("current_switch")
    after = stub.ListSwitches(controller_pb2.ListSwitchesRequest(node="a4"), timeout=5)
    assert len(after.switches) == len(before.switches) == 0


def test_noop_is_recorded_and_idempotent(stub):
    stub.RegisterNode(reg("a5"), metadata=MD, timeout=5)
    req = controller_pb2.ReconfigureRequest(node="a5", target=types_pb2.Topology(tp=2, pp=1),
                                            request_id="same", reason="test")
    r1 = stub.Reconfigure(req, metadata=MD, timeout=5)
    r2 = stub.Reconfigure(req, metadata=MD, timeout=5)
    assert r1.noop and r2.duplicate and r1.switch_id == r2.switch_id
    rec = stub.GetSwitch(controller_pb2.GetSwitchRequest(switch_id=r1.switch_id), timeout=5)
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_NOOP and rec.request_id == "same"


def test_history_pages_newest_first(stub):
    stub.RegisterNode(reg("a6"), metadata=MD, timeout=5)
    ids = [stub.Reconfigure(controller_pb2.ReconfigureRequest(
        node="a6", target=types_pb2.Topology(tp=2, pp=1)), metadata=MD, timeout=5).switch_id
        for _ in range(5)]
    seen, token = [], ""
    while True:
        page = stub.ListSwitches(controller_pb2.ListSwitchesRequest(
            node="a6", page_size=2, page_token=token), timeout=5)
        seen += [s.switch_id for s in page.switches]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids[::-1]


def test_lease_expiry_marks_the_node_lost_and_watch_says_so(stub, ctl):
    events = []

    def watch():
        with grpc.insecure_channel(ctl.addr) as ch:
            try:
                for ev in ctl.stub(ch).Watch(controller_pb2.WatchRequest(node="a7"), timeout=8):
                    events.append(ev)
                    if ev.type == controller_pb2.EVENT_TYPE_NODE_LOST:
                        return
            except grpc.RpcError:
                pass
    t = threading.Thread(target=watch)
    t.start()
    time.sleep(0.5)
    stub.RegisterNode(reg("a7"), metadata=MD, timeout=5)
    t.join(10)
    types = [e.type for e in events]
    assert controller_pb2.EVENT_TYPE_NODE_REGISTERED in types
    assert controller_pb2.EVENT_TYPE_NODE_LOST in types
    st = stub.GetState(controller_pb2.GetStateRequest(node="a7"), timeout=5)
    assert st.health == controller_pb2.NODE_HEALTH_LOST
    code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="a7", target=types_pb2.Topology(tp=1, pp=2)), metadata=MD, timeout=5)
    assert code == grpc.StatusCode.UNAVAILABLE and "lost" in msg
    # a heartbeat revives it
    stub.Heartbeat(controller_pb2.HeartbeatRequest(node="a7"), metadata=MD, timeout=5)
    st = stub.GetState(controller_pb2.GetStateRequest(node="a7"), timeout=5)
    assert st.health == controller_pb2.NODE_HEALTH_READY
    code, _ = code_of(stub.Heartbeat, controller_pb2.HeartbeatRequest(node="ghost"),
                      metadata=MD, timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND


def test_grpcurl_reflection_lists_the_service(ctl):
    r = grpcurl("-plaintext", ctl.addr, "list")
    assert "remp.controller.v1.Controller" in r.stdout and "grpc.health.v1.Health" in r.stdout


def test_redis_down_mutations_unavailable_reads_stale(artifacts_dir):
    r = RedisServer().start()
    c = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-redis-down")
    with c:
        with grpc.insecure_channel(c.addr) as ch:
            s = c.stub(ch)
            s.RegisterNode(reg("b1"), timeout=5)
            s.GetState(controller_pb2.GetStateRequest(node="b1"), timeout=5)  # warms the cache
            r.stop()
            code, msg = code_of(s.RegisterNode, reg("b2"), timeout=10)
            assert code == grpc.StatusCode.UNAVAILABLE and "redis" in msg
            code, _ = code_of(s.Reconfigure, controller_pb2.ReconfigureRequest(
                node="b1", target=types_pb2.Topology(tp=1, pp=2)), timeout=10)
            assert code == grpc.StatusCode.UNAVAILABLE
            st = s.GetState(controller_pb2.GetStateRequest(node="b1"), timeout=10)
            assert st.stale and st.node == "b1"
            nodes = s.ListNodes(controller_pb2.ListNodesRequest(), timeout=10).nodes
            assert [n.node for n in nodes] == ["b1"] and nodes[0].stale
            code, _ = code_of(s.GetState, controller_pb2.GetStateRequest(node="never-seen"),
                              timeout=10)
            assert code == grpc.StatusCode.UNAVAILABLE


def test_traffic_and_recommendations(stub, ctl):
    from google.protobuf.timestamp_pb2 import Timestamp
    stub.RegisterNode(reg("a8"), metadata=MD, timeout=5)
    for i in range(3):
        at = Timestamp()
        at.FromSeconds(1_700_000_000 + 30 * i)
        stub.Heartbeat(controller_pb2.HeartbeatRequest(
            node="a8", traffic=types_pb2.TrafficSample(at=at, window_seconds=30, requests=10 + i)),
            metadata=MD, timeout=5)
    got = stub.GetTraffic(controller_pb2.GetTrafficRequest(node="a8"), timeout=5).samples
    assert [s.requests for s in got] == [10, 11, 12]
    got = stub.GetTraffic(controller_pb2.GetTrafficRequest(node="a8", limit=2), timeout=5).samples
    assert [s.requests for s in got] == [11, 12]
    code, _ = code_of(stub.RecordRecommendation, controller_pb2.RecordRecommendationRequest(
        node="a8", recommended=types_pb2.Topology(tp=1, pp=2)), timeout=5)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    stub.RecordRecommendation(controller_pb2.RecordRecommendationRequest(
        node="a8", recommended=types_pb2.Topology(tp=1, pp=2), reason="peak: +12% goodput"),
        metadata=MD, timeout=5)
    st = stub.GetState(controller_pb2.GetStateRequest(node="a8"), timeout=5)
    assert st.recommendation == "TP1PP2: peak: +12% goodput"


def test_begin_refuses_a_topology_that_moved_since_it_was_read(redis_server):
    """Reconfigure plans from the observed topology it read; when a switch finished (or a
    heartbeat reported another topology) before it takes the node's switch slot, begin writes
    nothing and says 'moved', and Reconfigure decides again (found by the 20-concurrent e2e)."""
    import asyncio

    from controller.store import Store

    async def go():
        store = Store(redis_server.url, prefix="t-moved:")
        ev = controller_pb2.Event(type=controller_pb2.EVENT_TYPE_SWITCH_PHASE, node="m1")
        try:
            await store.register("m1", reg("m1"), time.time() + 10, "TP1PP2", ev)
            args = ("m1", "sw-m1", "", "{}", time.time(), "TP1PP2", ev)
            assert await store.begin(*args, observed="TP2PP1") == ("moved", "TP1PP2")
            assert (await store.node("m1")).get("current", "") == ""
            assert await store.switch("sw-m1") is None
            status, epoch = await store.begin(*args, observed="TP1PP2")
            assert status == "ok" and int(epoch) >= 1
            assert (await store.node("m1"))["current"] == "sw-m1"
        finally:
            await store.close()
    asyncio.run(go())
