"""Property-based fuzzing of every NodeAgent RPC against a live vLLM engine (request migration on,
fault injection off): random and hostile messages — ImportRequest headers and "KV" payloads
included — with the right credential, none, or a wrong one. Never UNKNOWN/INTERNAL, never a
hang; afterwards the agent is SERVING and still generates."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devstack.agentproc import AgentProcess, complete
from remp.auth import Credentials, intercept
from remp.node_agent.v1 import node_agent_pb2
from tests import fuzzing

pytestmark = pytest.mark.e2e
SVC = node_agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"]
AUTH = st.sampled_from(["right", "right", "right", "none", "wrong"])


@pytest.fixture(scope="module")
def agent(tiny_model, artifacts_dir, reaper):
    a = AgentProcess(tiny_model, tp=1, pp=1, dtype="float32", log_dir=artifacts_dir,
                     node="fuzz", extra=["--request-migration", "--no-warm-up-candidates",
                                         "--worker-spin-seconds", "0.02"])
    try:
        a.start().wait_ready()
        raw = grpc.insecure_channel(a.grpc_addr)
        try:
            yield a, {"raw": raw, "right": intercept(raw, Credentials.load())}
        finally:
            raw.close()
    finally:
        reaper.stop(a, check=False)


@pytest.mark.parametrize("method", fuzzing.methods(SVC), ids=lambda m: m.name)
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_agent_rpc_fuzz(agent, method, data):
    a, chans = agent
    req = data.draw(fuzzing.request_strategy(method), label="request")
    how = data.draw(AUTH, label="auth")
    ch = chans["right"] if how == "right" else chans["raw"]
    if how == "wrong":
        ch = intercept(chans["raw"], Credentials.generate())
    code = fuzzing.call(ch, SVC, method, req, timeout=60)
    if how != "right" and method.name in ("ExecuteSwitch", "AbortSwitch", "ImportRequest",
                                          "MigrateRequest", "SetDraining", "ListRequests"):
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), \
            (method.name, how, code)


def test_agent_serves_after_the_fuzz(agent):
    a, chans = agent
    assert a.health() == "SERVING"
    assert a.proc.poll() is None
    from remp.node_agent.v1 import node_agent_pb2_grpc

    # the fuzz may have left it draining (SetDraining is a legitimate call): serve again
    node_agent_pb2_grpc.NodeAgentStub(chans["right"]).SetDraining(
        node_agent_pb2.SetDrainingRequest(draining=False), timeout=10)
    out = complete(a.http, "t5 t6 t7", max_tokens=4)
    assert out["choices"][0]["text"]
