"""The controller against a real Redis server and real gRPC, without an engine: registration,
leases, validation, auth, paging, Redis outages. (Switches through a real agent are in
tests/e2e/test_controller_e2e.py; Watch caps and Redis pool lanes in test_controller_limits.py;
an unreachable agent — accepted, then rolled back by the background check — in
test_controller_accept_first.py.)"""

import secrets
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devstack.agentproc import ControllerProcess, free_port, grpcurl
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.redisproc import RedisServer


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
    c = ControllerProcess(redis_server.url, log_dir=artifacts_dir, lease_seconds=1.0,
                          name="ctl-integration")
    with c:
        yield c


@pytest.fixture
def stub(ctl):
    """Sends the role each method needs (agent for RegisterNode/Heartbeat, operator for
    Reconfigure/Abort/DrainNode, policy for RecordRecommendation)."""
    with grpc.insecure_channel(ctl.addr) as ch:
        yield ctl.stub(ch)


def code_of(fn, *a, **kw):
    with pytest.raises(grpc.RpcError) as ei:
        fn(*a, **kw)
    return ei.value.code(), ei.value.details()


def test_register_list_and_state(stub):
    r = stub.RegisterNode(reg("a1"), timeout=5)
    assert r.lease_seconds == 1.0
    st = stub.GetState(controller_pb2.GetStateRequest(node="a1"), timeout=5)
    assert (st.observed.tp, st.observed.pp) == (2, 1) and not st.stale
    assert st.health == controller_pb2.NODE_HEALTH_READY
    assert "a1" in [n.node for n in stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes]


# Who may call what, written out by hand (not read from remp.auth.RPC_ACCESS, so a change to
# the table shows up here): the roles allowed on each Controller RPC; () means open to anyone.
ALLOWED = {
    "RegisterNode": ("agent",), "Heartbeat": ("agent",),
    "Reconfigure": ("operator", "policy"), "Abort": ("operator",),
    "RecordRecommendation": ("policy",), "DrainNode": ("operator",),
    "ListRecoveries": ("operator", "policy", "controller"),
    "ListNodes": (), "GetState": (), "Plan": (), "GetSwitch": (), "ListSwitches": (),
    "GetTraffic": (), "Watch": (),
    "Rollout": ("operator", "policy"), "ControlRollout": ("operator", "policy"),
    "GetRollout": (), "ListRollouts": (),
}
GHOST = "auth-ghost"  # never registered: an allowed call gets past auth and answers NOT_FOUND
AUTH_REQUESTS = {
    "RegisterNode": reg("auth-reg"),
    "Heartbeat": controller_pb2.HeartbeatRequest(node=GHOST),
    "Reconfigure": controller_pb2.ReconfigureRequest(node=GHOST,
                                                     target=types_pb2.Topology(tp=1, pp=2)),
    "Abort": controller_pb2.AbortRequest(switch_id="sw-ghost"),
    "RecordRecommendation": controller_pb2.RecordRecommendationRequest(
        node=GHOST, recommended=types_pb2.Topology(tp=1, pp=2)),
    "DrainNode": controller_pb2.DrainNodeRequest(node=GHOST),
    "ListRecoveries": controller_pb2.ListRecoveriesRequest(),
    "ListNodes": controller_pb2.ListNodesRequest(),
    "GetState": controller_pb2.GetStateRequest(node=GHOST),
    "Plan": controller_pb2.PlanRequest(node=GHOST, target=types_pb2.Topology(tp=1, pp=2)),
    "GetSwitch": controller_pb2.GetSwitchRequest(switch_id="sw-ghost"),
    "ListSwitches": controller_pb2.ListSwitchesRequest(),
    "GetTraffic": controller_pb2.GetTrafficRequest(node=GHOST),
    "Watch": controller_pb2.WatchRequest(node=GHOST),
    "Rollout": controller_pb2.RolloutRequest(nodes=[GHOST], target=types_pb2.Topology(tp=1, pp=2),
                                             capacity_rps={"TP1PP2": 1.0}, dry_run=True),
    "ControlRollout": controller_pb2.ControlRolloutRequest(
        rollout_id="ro-ghost", action=controller_pb2.ROLLOUT_ACTION_PAUSE),
    "GetRollout": controller_pb2.GetRolloutRequest(rollout_id="ro-ghost"),
    "ListRollouts": controller_pb2.ListRolloutsRequest(),
}
ROLES = ("operator", "controller", "agent", "policy")


def _code(stub, method, req, metadata):
    try:
        if method == "Watch":  # an open stream with nothing to say ends at the deadline
            for _ in stub.Watch(req, metadata=metadata, timeout=0.5):
                pass
        else:
            getattr(stub, method)(req, metadata=metadata, timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_each_role_may_call_only_its_rpcs(ctl):
    assert set(ALLOWED) == set(controller_pb2.DESCRIPTOR.services_by_name[
        "Controller"].methods_by_name)
    denied = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    got = {}
    with grpc.insecure_channel(ctl.addr) as ch:
        raw = controller_pb2_grpc.ControllerStub(ch)  # sends only the metadata given
        for method, req in AUTH_REQUESTS.items():
            for who in (*ROLES, None, "wrong"):
                md = (ctl.metadata(who) if who in ROLES else
                      (("authorization", "Bearer not-a-valid-token-at-all"),) if who else None)
                got[method, who] = _code(raw, method, req, md)
    for method, roles in ALLOWED.items():
        for who in ROLES:
            if not roles or who in roles:
                assert got[method, who] not in denied, (method, who, got[method, who])
            else:  # e.g. operator cannot Heartbeat, agent cannot Reconfigure
                assert got[method, who] == grpc.StatusCode.PERMISSION_DENIED, (method, who)
        # no credential: refused where a role is needed, reads stay open
        assert got[method, None] == (grpc.StatusCode.UNAUTHENTICATED if roles else
                                     got[method, ROLES[0]]), (method, got[method, None])
        # a credential that is not accepted is refused everywhere, reads included
        assert got[method, "wrong"] == grpc.StatusCode.UNAUTHENTICATED, method
    with grpc.insecure_channel(ctl.addr) as ch:
        raw = controller_pb2_grpc.ControllerStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            raw.Heartbeat(controller_pb2.HeartbeatRequest(node=GHOST),
                          metadata=ctl.metadata("operator"), timeout=5)
        assert "Heartbeat is not allowed for role operator" in ei.value.details()
        with pytest.raises(grpc.RpcError) as ei:
            raw.Reconfigure(AUTH_REQUESTS["Reconfigure"], timeout=5)
        assert "Bearer" in ei.value.details()


def test_strings_are_bounded_before_they_reach_redis(stub, ctl, redis_server):
    """A 100 kB request id (and other oversized or odd strings) → INVALID_ARGUMENT naming the
    field and its bounds; nothing of it lands in a Redis key or the controller's log."""
    stub.RegisterNode(reg("v1"), timeout=5)
    big = "r" * 100_000
    code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="v1", target=types_pb2.Topology(tp=2, pp=1), request_id=big), timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
    assert msg.startswith("request_id: at most 128 characters of [A-Za-z0-9._:-]"), msg
    assert len(msg) < 300
    bad = [
        (stub.Reconfigure, controller_pb2.ReconfigureRequest(
            node="v1", target=types_pb2.Topology(tp=2, pp=1), request_id="a b"), "request_id"),
        (stub.Reconfigure, controller_pb2.ReconfigureRequest(
            node="v1", target=types_pb2.Topology(tp=2, pp=1), reason="x" * 5000), "reason"),
        (stub.Reconfigure, controller_pb2.ReconfigureRequest(
            node="v1", target=types_pb2.Topology(tp=2, pp=1), reason="two\nlines"), "reason"),
        (stub.GetState, controller_pb2.GetStateRequest(node=big), "node"),
        (stub.GetSwitch, controller_pb2.GetSwitchRequest(switch_id="sw/../x"), "switch_id"),
        (stub.Abort, controller_pb2.AbortRequest(switch_id=big), "switch_id"),
        (stub.ListSwitches, controller_pb2.ListSwitchesRequest(page_token="9" * 50), "page_token"),
        (stub.Heartbeat, controller_pb2.HeartbeatRequest(node="v1\x00"), "node"),
        (stub.RecordRecommendation, controller_pb2.RecordRecommendationRequest(
            node="v1", recommended=types_pb2.Topology(tp=1, pp=2), decision_id=big),
         "decision_id"),
        (stub.RegisterNode, controller_pb2.RegisterNodeRequest(
            node="v2", agent_address="127.0.0.1:1 ; rm", http_address="http://x"),
         "agent_address"),
        (stub.RegisterNode, controller_pb2.RegisterNodeRequest(
            node="v2", agent_address="127.0.0.1:1", http_address="javascript:alert(1)"),
         "http_address"),
        (stub.RegisterNode, controller_pb2.RegisterNodeRequest(
            node="v2", agent_address="127.0.0.1:1",
            model=types_pb2.ModelFacts(dtype="float32" * 100)), "model.dtype"),
        (stub.DrainNode, controller_pb2.DrainNodeRequest(node="v1", target_node=big),
         "target_node"),
    ]
    for fn, req, field in bad:
        code, msg = code_of(fn, req, timeout=5)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and msg.startswith(field + ":"), \
            (field, code, msg)
    for ev_stream in [stub.Watch(controller_pb2.WatchRequest(node=big), timeout=5)]:
        with pytest.raises(grpc.RpcError) as ei:
            list(ev_stream)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        keys = list(r.scan_iter(count=1000))
        assert keys and max(len(k) for k in keys) < 300, max(keys, key=len)[:80]
        assert not [k for k in keys if "rrrr" in k or "v2" in k]
    finally:
        r.close()
    assert "r" * 200 not in ctl.log_path.read_text()
    # in bounds, the same call works
    ok = stub.Reconfigure(controller_pb2.ReconfigureRequest(
        node="v1", target=types_pb2.Topology(tp=2, pp=1), request_id="r" * 128,
        reason="fits: 1024 printable characters → ok"), timeout=5)
    assert ok.noop


def test_errors_have_the_right_status(stub):
    stub.RegisterNode(reg("a3"), timeout=5)
    code, _ = code_of(stub.GetState, controller_pb2.GetStateRequest(node="nope"), timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND
    code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="a3", target=types_pb2.Topology(tp=3, pp=1)), timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "TP1PP2" in msg and "valid targets" in msg
    # an agent without world-size changes (--no-world-changes) offers only its own world
    stub.RegisterNode(reg("a3w", candidates=((2, 1), (1, 2))), timeout=5)
    code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="a3w", target=types_pb2.Topology(tp=1, pp=1)), timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a candidate" in msg, msg
    assert "valid targets: TP2PP1, TP1PP2" in msg
    code, _ = code_of(stub.GetSwitch, controller_pb2.GetSwitchRequest(switch_id="sw-x"), timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = code_of(stub.ListSwitches, controller_pb2.ListSwitchesRequest(page_token="zz"),
                      timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = code_of(stub.Abort, controller_pb2.AbortRequest(switch_id="sw-x"),
                      timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND


def test_noop_is_recorded_and_idempotent(stub):
    stub.RegisterNode(reg("a5"), timeout=5)
    req = controller_pb2.ReconfigureRequest(node="a5", target=types_pb2.Topology(tp=2, pp=1),
                                            request_id="same", reason="test")
    r1 = stub.Reconfigure(req, timeout=5)
    r2 = stub.Reconfigure(req, timeout=5)
    assert r1.noop and r2.duplicate and r1.switch_id == r2.switch_id
    rec = stub.GetSwitch(controller_pb2.GetSwitchRequest(switch_id=r1.switch_id), timeout=5)
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_NOOP and rec.request_id == "same"


def test_history_pages_newest_first(stub):
    stub.RegisterNode(reg("a6"), timeout=5)
    ids = [stub.Reconfigure(controller_pb2.ReconfigureRequest(
        node="a6", target=types_pb2.Topology(tp=2, pp=1)), timeout=5).switch_id
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
    stub.RegisterNode(reg("a7"), timeout=5)
    t.join(10)
    types = [e.type for e in events]
    assert controller_pb2.EVENT_TYPE_NODE_REGISTERED in types
    assert controller_pb2.EVENT_TYPE_NODE_LOST in types
    st = stub.GetState(controller_pb2.GetStateRequest(node="a7"), timeout=5)
    assert st.health == controller_pb2.NODE_HEALTH_LOST
    code, msg = code_of(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node="a7", target=types_pb2.Topology(tp=1, pp=2)), timeout=5)
    assert code == grpc.StatusCode.UNAVAILABLE and "lost" in msg
    # a heartbeat revives it
    stub.Heartbeat(controller_pb2.HeartbeatRequest(node="a7"), timeout=5)
    st = stub.GetState(controller_pb2.GetStateRequest(node="a7"), timeout=5)
    assert st.health == controller_pb2.NODE_HEALTH_READY
    code, _ = code_of(stub.Heartbeat, controller_pb2.HeartbeatRequest(node="ghost"),
                      timeout=5)
    assert code == grpc.StatusCode.NOT_FOUND


def test_grpcurl_reflection_lists_the_service(ctl):
    r = grpcurl("-plaintext", ctl.addr, "list")
    assert "remp.controller.v1.Controller" in r.stdout and "grpc.health.v1.Health" in r.stdout


def _health(addr: str) -> str:
    with grpc.insecure_channel(addr) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="remp.controller.v1.Controller"), timeout=2)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def _wait_health(addr: str, want: str, timeout: float = 10) -> float:
    t0 = time.monotonic()
    while _health(addr) != want:
        assert time.monotonic() - t0 < timeout, f"health never became {want}"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_redis_down_not_serving_unavailable_reads_stale_and_back(artifacts_dir):
    """Redis killed: health NOT_SERVING within ~1 s, every RPC UNAVAILABLE (never UNKNOWN),
    reads served stale from the cache; Redis restarted on the same port: SERVING again and the
    same controller (its pools, its Watch reader) works. The Redis password is in no message."""
    pw = "pw-" + secrets.token_hex(12)
    r = RedisServer(password=pw).start()
    c = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-redis-down",
                          env={"REMP_CONTROLLER_REDIS_PING_SECONDS": "0.5"})
    with c:
        with grpc.insecure_channel(c.addr) as ch:
            s = c.stub(ch)
            s.RegisterNode(reg("b1"), timeout=5)
            s.GetState(controller_pb2.GetStateRequest(node="b1"), timeout=5)  # warms the cache
            assert _health(c.addr) == "SERVING"
            r.stop()
            assert _wait_health(c.addr, "NOT_SERVING") < 5
            T = types_pb2.Topology
            calls = [
                (s.RegisterNode, reg("b2")),
                (s.Heartbeat, controller_pb2.HeartbeatRequest(node="b1")),
                (s.Reconfigure, controller_pb2.ReconfigureRequest(node="b1", target=T(tp=1, pp=2))),
                (s.Plan, controller_pb2.PlanRequest(node="b1", target=T(tp=1, pp=2))),
                (s.Abort, controller_pb2.AbortRequest(switch_id="sw-1")),
                (s.GetSwitch, controller_pb2.GetSwitchRequest(switch_id="sw-1")),
                (s.ListSwitches, controller_pb2.ListSwitchesRequest()),
                (s.GetTraffic, controller_pb2.GetTrafficRequest(node="b1")),
                (s.RecordRecommendation, controller_pb2.RecordRecommendationRequest(
                    node="b1", recommended=T(tp=1, pp=2))),
                (s.DrainNode, controller_pb2.DrainNodeRequest(node="b1")),
                (s.ListRecoveries, controller_pb2.ListRecoveriesRequest()),
                (s.GetState, controller_pb2.GetStateRequest(node="never-seen")),
            ]
            for fn, req in calls:
                code, msg = code_of(fn, req, timeout=10)
                assert code == grpc.StatusCode.UNAVAILABLE, (fn, code, msg)
                assert "redis" in msg.lower() and pw not in msg, msg
            with pytest.raises(grpc.RpcError) as ei:
                list(s.Watch(controller_pb2.WatchRequest(), timeout=10))
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
            st = s.GetState(controller_pb2.GetStateRequest(node="b1"), timeout=10)
            assert st.stale and st.node == "b1"
            nodes = s.ListNodes(controller_pb2.ListNodesRequest(), timeout=10).nodes
            assert [n.node for n in nodes] == ["b1"] and nodes[0].stale
            # back on the same port (empty: nothing was persisted)
            r2 = RedisServer(port=r.port, password=pw).start()
            try:
                assert _wait_health(c.addr, "SERVING") < 5
                s.RegisterNode(reg("b3"), timeout=5)
                st = s.GetState(controller_pb2.GetStateRequest(node="b3"), timeout=5)
                assert not st.stale and st.health == controller_pb2.NODE_HEALTH_READY
                events = []
                for ev in s.Watch(controller_pb2.WatchRequest(include_history=True), timeout=2):
                    events.append(ev)
                    break
                assert events and events[0].node == "b3"
            finally:
                c.stop()
                r2.stop()
            assert c.log_has("controller.redis_down") and c.log_has("controller.redis_back")
            assert pw not in c.log_path.read_text()


def test_traffic_and_recommendations(stub, ctl):
    from google.protobuf.timestamp_pb2 import Timestamp
    stub.RegisterNode(reg("a8"), timeout=5)
    for i in range(3):
        at = Timestamp()
        at.FromSeconds(1_700_000_000 + 30 * i)
        stub.Heartbeat(controller_pb2.HeartbeatRequest(
            node="a8", traffic=types_pb2.TrafficSample(at=at, window_seconds=30, requests=10 + i)),
            timeout=5)
    got = stub.GetTraffic(controller_pb2.GetTrafficRequest(node="a8"), timeout=5).samples
    assert [s.requests for s in got] == [10, 11, 12]
    got = stub.GetTraffic(controller_pb2.GetTrafficRequest(node="a8", limit=2), timeout=5).samples
    assert [s.requests for s in got] == [11, 12]
    code, _ = code_of(stub.RecordRecommendation, controller_pb2.RecordRecommendationRequest(
        node="a8", recommended=types_pb2.Topology(tp=1, pp=2)),
        metadata=ctl.metadata("operator"), timeout=5)
    assert code == grpc.StatusCode.PERMISSION_DENIED  # the policy's call, not the operator's
    stub.RecordRecommendation(controller_pb2.RecordRecommendationRequest(
        node="a8", recommended=types_pb2.Topology(tp=1, pp=2), reason="peak: +12% goodput"),
        timeout=5)
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


def test_a_heartbeat_older_than_the_last_switch_does_not_overwrite_its_topology(redis_server):
    """A heartbeat the agent built before a switch finished carries the old topology; when
    Redis applies it after the switch's finish it must not move ``observed`` back (a CI run saw
    the next Reconfigure to the old topology answered as a noop). The agent sends the epoch of
    the last switch it finished (or the one its registration returned); the controller takes the
    topology only when it is not older than the node's epoch."""
    import asyncio

    from controller.store import Store

    async def go():
        store = Store(redis_server.url, prefix="t-hb-epoch:")
        ev = controller_pb2.Event(type=controller_pb2.EVENT_TYPE_SWITCH_PHASE, node="e1")
        try:
            await store.register("e1", reg("e1"), time.time() + 10, "TP1PP2", ev)
            status, epoch = await store.begin("e1", "sw-e1", "", "{}", time.time(), "TP2PP1", ev,
                                              observed="TP1PP2")
            assert status == "ok"
            epoch = int(epoch)
            assert await store.finish("sw-e1", "e1", "succeeded", 0, "{}", "TP2PP1", ev)
            # built before the switch finished: epoch of the previous switch, old topology
            await store.heartbeat("e1", time.time() + 10, "TP1PP2", "", epoch - 1)
            assert (await store.node("e1"))["observed"] == "TP2PP1"
            # built after: taken
            await store.heartbeat("e1", time.time() + 10, "TP2PP1", "", epoch)
            assert (await store.node("e1"))["observed"] == "TP2PP1"
            # an agent that knows nothing newer (0) is not believed: it re-registers instead
            await store.heartbeat("e1", time.time() + 10, "TP1PP2", "", 0)
            assert (await store.node("e1"))["observed"] == "TP2PP1"
            assert await store.register("e1", reg("e1"), time.time() + 10, "TP1PP2", ev) == epoch
            assert (await store.node("e1"))["observed"] == "TP1PP2"
        finally:
            await store.close()
    asyncio.run(go())


def test_a_restarted_controller_gives_every_node_a_lease_before_calling_it_lost(artifacts_dir):
    """While no controller runs, no agent can renew its lease. A controller that comes back
    after the leases ran out gives each node one full lease from its own start to reach it
    before declaring it lost (which would recompute its requests elsewhere); a node that
    still does not come is lost as before (a CI run lost a live node to a slow restart)."""
    with RedisServer() as r:
        c = ControllerProcess(r.url, log_dir=artifacts_dir, lease_seconds=3.0,
                              name="ctl-grace")
        with c:
            with grpc.insecure_channel(c.addr) as ch:
                c.stub(ch).RegisterNode(reg("g1"), timeout=5)
            c.stop()
            time.sleep(3.5)  # the lease runs out while no controller runs
            c.start().wait_ready()
            with grpc.insecure_channel(c.addr) as ch:
                s = c.stub(ch)
                time.sleep(1.0)  # four sweeps (every lease / 4)
                st = s.GetState(controller_pb2.GetStateRequest(node="g1"), timeout=5)
                assert st.health == controller_pb2.NODE_HEALTH_READY
                deadline = time.monotonic() + 15
                while st.health != controller_pb2.NODE_HEALTH_LOST:
                    assert time.monotonic() < deadline, "the node was never declared lost"
                    time.sleep(0.2)
                    st = s.GetState(controller_pb2.GetStateRequest(node="g1"), timeout=5)


def test_rollout_errors_answer_their_status_and_labels_are_registered(stub):
    """docs/rollout.md §2: invalid input INVALID_ARGUMENT, unknown node / no label match
    NOT_FOUND, a floor no order keeps FAILED_PRECONDITION; labels kept and shown."""
    r = reg("ro-int")
    r.labels["fleet"] = "int"
    stub.RegisterNode(r, timeout=5)
    st = stub.GetState(controller_pb2.GetStateRequest(node="ro-int"), timeout=5)
    assert dict(st.labels) == {"fleet": "int"} and not st.rollout_id
    bad = reg("ro-bad")
    bad.labels["fleet"] = "has space"
    assert code_of(stub.RegisterNode, bad, timeout=5)[0] == grpc.StatusCode.INVALID_ARGUMENT

    def rollout(**kw):
        base = dict(target=types_pb2.Topology(tp=1, pp=2), capacity_floor=0.5,
                    capacity_rps={"TP2PP1": 9.0, "TP1PP2": 10.0}, dry_run=True)
        base.update(kw)
        return code_of(stub.Rollout, controller_pb2.RolloutRequest(**base), timeout=5)
    for kw in (dict(), dict(nodes=["ro-int"], labels={"fleet": "int"}),
               dict(nodes=["ro-int"], capacity_rps={}), dict(nodes=["ro-int"], capacity_floor=2),
               dict(nodes=["ro-int"], target=types_pb2.Topology()),
               dict(labels={"fleet": "a b"})):
        code, msg = rollout(**kw)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (kw, code, msg)
    code, msg = rollout(nodes=["ro-nobody"])
    assert code == grpc.StatusCode.NOT_FOUND and "ro-nobody" in msg
    code, msg = rollout(labels={"fleet": "none"})
    assert code == grpc.StatusCode.NOT_FOUND and "fleet=none" in msg
    stub.RegisterNode(r, timeout=5)  # a fresh lease (1 s here): READY for the next call
    code, msg = rollout(nodes=["ro-int"], capacity_floor=1.0)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "ro-int" in msg, msg
    for method, req in (("GetRollout", controller_pb2.GetRolloutRequest(rollout_id="ro-none")),
                        ("ControlRollout", controller_pb2.ControlRolloutRequest(
                            rollout_id="ro-none", action=controller_pb2.ROLLOUT_ACTION_PAUSE))):
        assert code_of(getattr(stub, method), req, timeout=5)[0] == grpc.StatusCode.NOT_FOUND
    code, _ = code_of(stub.ControlRollout, controller_pb2.ControlRolloutRequest(
        rollout_id="ro-none"), timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # no action
    assert not stub.ListRollouts(controller_pb2.ListRolloutsRequest(), timeout=5).rollouts


def test_heartbeat_workers_are_kept_until_the_next_report(stub):
    """Each worker's facts (released ranks among them) reach GetState; a heartbeat without any
    keeps the last; a device name outside its bounds is INVALID_ARGUMENT."""
    stub.RegisterNode(reg("a9"), timeout=5)
    workers = [types_pb2.WorkerInfo(rank=0, state=types_pb2.WORKER_STATE_ACTIVE, device="cpu",
                                    model_bytes=1 << 20),
               types_pb2.WorkerInfo(rank=1, state=types_pb2.WORKER_STATE_STANDBY, device="cpu",
                                    released=True)]
    stub.Heartbeat(controller_pb2.HeartbeatRequest(node="a9", workers=workers), timeout=5)
    stub.Heartbeat(controller_pb2.HeartbeatRequest(node="a9"), timeout=5)
    st = stub.GetState(controller_pb2.GetStateRequest(node="a9"), timeout=5)
    assert [(w.rank, w.released, w.model_bytes, w.device) for w in st.workers] == [
        (0, False, 1 << 20, "cpu"), (1, True, 0, "cpu")]
    assert st.workers[1].state == types_pb2.WORKER_STATE_STANDBY
    listed = {n.node: n for n in stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=5).nodes}
    assert [w.released for w in listed["a9"].workers] == [False, True]
    code, details = code_of(stub.Heartbeat, controller_pb2.HeartbeatRequest(
        node="a9", workers=[types_pb2.WorkerInfo(rank=0, device="cuda:0\n; rm -rf /")]),
        timeout=5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "workers[0].device" in details


def test_the_redis_password_is_never_in_the_controllers_argv(artifacts_dir):
    """The test and bench launcher hands the Redis location (with its password) over in the
    environment, as deploy/ does: nothing in /proc/PID/cmdline names it."""
    with RedisServer(generate_password=True) as r, \
            ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-argv") as c:
        password = r.url.split("@")[0].rsplit(":", 1)[1]
        assert len(password) >= 16 and c.ready()
        argv = Path(f"/proc/{c.proc.pid}/cmdline").read_bytes().decode()
        assert password not in argv and "redis" not in argv.lower(), argv


def test_an_agents_last_epoch_raises_the_nodes_epoch_on_registration(stub):
    """A controller whose Redis lost a node's state (new or restored Redis) would issue epochs
    from 1 again, and the agent — which refuses orders below the highest epoch it has seen —
    would refuse every switch for good. The agent reports that epoch when it registers and the
    node's epoch is raised to it: the next switch is numbered above it. Never lowered."""
    node = "ep-" + secrets.token_hex(3)
    r = reg(node)
    r.last_epoch = 41
    assert stub.RegisterNode(r, timeout=5).epoch == 41
    sid = stub.Reconfigure(controller_pb2.ReconfigureRequest(
        node=node, target=types_pb2.Topology(tp=1, pp=2)), timeout=5).switch_id
    # the agent is unreachable: the switch rolls back, nothing sent; the finished record
    # carries the epoch it ran under (the running one is written before the epoch is taken)
    deadline = time.monotonic() + 10
    while (rec := stub.GetSwitch(controller_pb2.GetSwitchRequest(switch_id=sid), timeout=5)
           ).outcome == types_pb2.SWITCH_OUTCOME_RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert rec.epoch == 42
    r.last_epoch = 3  # an agent that saw less (restarted) does not lower it
    assert stub.RegisterNode(r, timeout=5).epoch == 42
    r.last_epoch = 0
    assert stub.RegisterNode(r, timeout=5).epoch == 42
