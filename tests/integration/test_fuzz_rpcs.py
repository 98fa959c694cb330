"""Property-based fuzzing of every RPC of the controller and the policy service (real processes,
real Redis, real gRPC over loopback): random and hostile request messages, with the right
credential, none, or a wrong one. Never UNKNOWN/INTERNAL, never a hang; healthy afterwards.
The node agent's RPCs are fuzzed against a live engine in tests/e2e/test_fuzz_agent_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devstack.agentproc import ControllerProcess, free_port
from remp.auth import Credentials, intercept
from remp.controller.v1 import controller_pb2
from remp.policy.v1 import policy_pb2
from remp.redisproc import RedisServer
from tests import fuzzing

CTL = controller_pb2.DESCRIPTOR.services_by_name["Controller"]
POL = policy_pb2.DESCRIPTOR.services_by_name["Policy"]
AUTH = st.sampled_from(["right", "right", "right", "none", "wrong"])


def serving(addr: str, service: str) -> bool:
    with grpc.insecure_channel(addr) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def stack(artifacts_dir):
    with RedisServer() as redis, ControllerProcess(redis.url, log_dir=artifacts_dir,
                                                   name="ctl-fuzz") as ctl:
        port = free_port()
        log = open(artifacts_dir / "policy-fuzz.log", "w")
        pol = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "policy", "serve", "--port", str(port),
             "--controller", ctl.addr, "--profile", "h200x8-analytic", "--tick-seconds", "0.5",
             "--controller-timeout-s", "2"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "REMP_LOG_FORMAT": "json"},
            start_new_session=True)
        addr = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not serving(addr, "remp.policy.v1.Policy"):
            assert pol.poll() is None and time.monotonic() < deadline, \
                (artifacts_dir / "policy-fuzz.log").read_text()[-2000:]
            time.sleep(0.2)
        creds = Credentials.load()
        chans = {}
        for name, a in (("ctl", ctl.addr), ("pol", addr)):
            raw = grpc.insecure_channel(a)
            chans[name] = {"raw": raw, "right": intercept(raw, creds)}
        try:
            yield ctl, addr, chans
        finally:
            for c in chans.values():
                c["raw"].close()
            pol.terminate()
            assert pol.wait(30) == 0, (artifacts_dir / "policy-fuzz.log").read_text()[-2000:]
            log.close()


def _fuzz(chans, service, method, data):
    req = data.draw(fuzzing.request_strategy(method), label="request")
    how = data.draw(AUTH, label="auth")
    ch = chans["right"] if how == "right" else chans["raw"]
    if how == "wrong":
        ch = intercept(chans["raw"], Credentials.generate())  # a valid-looking foreign token
    code = fuzzing.call(ch, service, method, req, timeout=20)
    if how != "right" and method.name in ("Reconfigure", "SetMode", "RegisterNode",
                                          "DrainNode", "Abort", "Heartbeat"):
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), \
            (method.name, how, code)


@pytest.mark.parametrize("method", fuzzing.methods(CTL), ids=lambda m: m.name)
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_controller_rpc_fuzz(stack, method, data):
    _fuzz(stack[2]["ctl"], CTL, method, data)


@pytest.mark.parametrize("method", fuzzing.methods(POL), ids=lambda m: m.name)
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_policy_rpc_fuzz(stack, method, data):
    _fuzz(stack[2]["pol"], POL, method, data)


def test_both_still_serving_after_the_fuzz(stack):
    ctl, pol_addr, chans = stack
    assert serving(ctl.addr, "remp.controller.v1.Controller")
    assert serving(pol_addr, "remp.policy.v1.Policy")
    from remp.controller.v1 import controller_pb2_grpc

    controller_pb2_grpc.ControllerStub(chans["ctl"]["right"]).ListNodes(
        controller_pb2.ListNodesRequest(), timeout=5)
