"""Property-based tests: every Controller RPC with arbitrary field values (hypothesis) gets a
deliberate status — never INTERNAL or UNKNOWN, never a hang — whoever calls (each role, none, a
wrong token), with strings far past their bounds (INVALID_ARGUMENT, nothing written). Real
controller, real Redis; afterwards the controller is healthy and serving."""

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from google.protobuf.timestamp_pb2 import Timestamp

from grpc_health.v1 import health_pb2, health_pb2_grpc

from devstack.agentproc import ControllerProcess, free_port
from remp.auth import Credentials, Role
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.redisproc import RedisServer

OK_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.RESOURCE_EXHAUSTED}
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

u32 = st.integers(min_value=0, max_value=2**32 - 1)
small = st.integers(min_value=0, max_value=9)
# short text, and strings far past every bound (node 253, ids 128, reason 1024 characters)
long = st.builds(lambda c, n: c * n, st.sampled_from(["r", "é", "-", " ", "\n", "\x00"]),
                 st.integers(100, 200_000))
text = st.one_of(st.text(max_size=80), long,
                 st.sampled_from(["a b", "x/../y", "ok-id_1:2.3", "sw-1\r\nX: y", "*", "%s"]))
names = st.one_of(st.just("prop-node"), st.just(""), text)
topo = st.builds(types_pb2.Topology, tp=st.one_of(small, u32), pp=st.one_of(small, u32))
# who calls: a role (the session's credentials, tests/conftest.py), nobody, or a bad header
md = st.sampled_from([None, "wrong", "malformed", *(r.value for r in Role)])


def metadata(who):
    if who is None:
        return None
    if who == "wrong":
        return (("authorization", "Bearer not-a-valid-token-at-all"),)
    if who == "malformed":
        return (("authorization", "x"),)
    return (("authorization", f"Bearer {Credentials.load().tokens[Role(who)]}"),)


@pytest.fixture(scope="module")
def stub(artifacts_dir):
    with RedisServer() as r:
        c = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-props")
        with c:
            with grpc.insecure_channel(c.addr) as ch:
                s = controller_pb2_grpc.ControllerStub(ch)
                s.addr, s.redis_url = c.addr, r.url
                s.RegisterNode(controller_pb2.RegisterNodeRequest(
                    node="prop-node", agent_address=f"127.0.0.1:{free_port()}",
                    topology=types_pb2.Topology(tp=2, pp=1),
                    candidates=[types_pb2.Topology(tp=2, pp=1), types_pb2.Topology(tp=1, pp=2)],
                    host=types_pb2.HostFacts(device_count=2),
                    model=types_pb2.ModelFacts(num_layers=4, num_attention_heads=8,
                                               num_kv_heads=4, head_size=32, hidden_size=256,
                                               weight_bytes=1000)),
                    metadata=c.metadata("agent"), timeout=5)
                yield s


def status(fn, req, who=None, timeout=10.0):
    try:
        fn(req, metadata=metadata(who), timeout=timeout)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        assert exc.code() in OK_CODES, f"{exc.code()} {exc.details()}"
        return exc.code()


model = st.builds(types_pb2.ModelFacts, num_layers=st.one_of(small, u32),
                  num_attention_heads=st.one_of(small, u32), num_kv_heads=st.one_of(small, u32),
                  head_size=st.one_of(small, u32), hidden_size=st.one_of(small, u32),
                  dtype=text, path=text, architecture=text, weight_bytes=st.integers(0, 2**63))
host = st.builds(types_pb2.HostFacts, device_count=st.one_of(small, u32), hostname=text,
                 device_type=text, device_names=st.lists(text, max_size=3))


@SETTINGS
@given(node=names, addr=text, http=st.one_of(text, st.just("http://127.0.0.1:8000")), t=topo,
       cands=st.lists(topo, max_size=6), m=model, h=host, kvbw=st.floats(allow_nan=True),
       meta=md)
def test_register(stub, node, addr, http, t, cands, m, h, kvbw, meta):
    status(stub.RegisterNode, controller_pb2.RegisterNodeRequest(
        node=node, agent_address=addr, http_address=http, topology=t, candidates=cands,
        model=m, host=h, kv_bandwidth_bps=kvbw), meta)


@SETTINGS
@given(node=names, t=topo, rid=text, reason=text, meta=md)
def test_reconfigure(stub, node, t, rid, reason, meta):
    status(stub.Reconfigure, controller_pb2.ReconfigureRequest(
        node=node, target=t, request_id=rid, reason=reason), meta)


@SETTINGS
@given(node=names, t=topo)
def test_plan_and_state(stub, node, t):
    status(stub.Plan, controller_pb2.PlanRequest(node=node, target=t))
    status(stub.GetState, controller_pb2.GetStateRequest(node=node))


@SETTINGS
@given(sid=text, reason=text, meta=md)
def test_switch_lookups(stub, sid, reason, meta):
    status(stub.GetSwitch, controller_pb2.GetSwitchRequest(switch_id=sid))
    status(stub.Abort, controller_pb2.AbortRequest(switch_id=sid, reason=reason), meta)


@SETTINGS
@given(node=names, size=u32, token=st.one_of(text, st.integers(-10, 10**30).map(str)))
def test_list_switches(stub, node, size, token):
    status(stub.ListSwitches, controller_pb2.ListSwitchesRequest(
        node=node, page_size=size, page_token=token))


inflight = st.lists(st.builds(controller_pb2.InflightRequest, request_id=text,
                              prompt_token_ids=st.lists(u32, max_size=5),
                              max_tokens=u32), max_size=3)


@SETTINGS
@given(node=names, t=topo, secs=st.integers(-62135596800, 253402300799), limit=u32,
       reason=text, did=text, journal=inflight, meta=md)
def test_traffic_heartbeat_recommendation(stub, node, t, secs, limit, reason, did, journal,
                                          meta):
    at = Timestamp(seconds=secs)
    status(stub.Heartbeat, controller_pb2.HeartbeatRequest(
        node=node, topology=t, traffic=types_pb2.TrafficSample(at=at, requests=3),
        inflight=journal), meta)
    status(stub.GetTraffic, controller_pb2.GetTrafficRequest(node=node, since=at, limit=limit))
    status(stub.RecordRecommendation, controller_pb2.RecordRecommendationRequest(
        node=node, recommended=t, reason=reason, decision_id=did), meta)


@SETTINGS
@given(node=names, target=names, slo=st.floats(allow_nan=True), reason=text, meta=md)
def test_drain_and_recoveries(stub, node, target, slo, reason, meta):
    # an unreachable agent: a drain that gets past validation answers UNAVAILABLE
    status(stub.DrainNode, controller_pb2.DrainNodeRequest(
        node=node, target_node=target, slo_budget_seconds=slo, reason=reason), meta)
    status(stub.ListRecoveries, controller_pb2.ListRecoveriesRequest(node=node), meta)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(node=names, sid=text, hist=st.booleans(), meta=md)
def test_watch_opens_or_refuses_cleanly(stub, node, sid, hist, meta):
    try:
        for _ in stub.Watch(controller_pb2.WatchRequest(node=node, switch_id=sid,
                                                        include_history=hist),
                            metadata=metadata(meta), timeout=0.3):
            pass
    except grpc.RpcError as exc:
        # an open stream with nothing (more) to say ends at the client's deadline
        assert exc.code() in OK_CODES | {grpc.StatusCode.DEADLINE_EXCEEDED}, exc.details()


def test_still_healthy_and_nothing_oversized_stored(stub):
    nodes = stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10).nodes
    assert "prop-node" in [n.node for n in nodes]
    with grpc.insecure_channel(stub.addr) as ch:
        h = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="remp.controller.v1.Controller"), timeout=5)
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    import redis

    r = redis.Redis.from_url(stub.redis_url, decode_responses=True)
    try:
        keys = list(r.scan_iter(count=1000))
        assert max(len(k) for k in keys) <= 300, max(keys, key=len)[:80]
        # nothing stored anywhere near the fuzzed sizes (journals, records, events)
        big = [k for k in keys if r.type(k) == "string" and r.strlen(k) > 100_000]
        assert not big, big
    finally:
        r.close()
