"""Mutual TLS between controller and node agent (generated test certificates): the controller
with a client certificate drives a switch; plaintext, a certificate from another CA, and a
controller without a certificate are all refused (UNAVAILABLE at the agent; the controller
without one accepts the switch, cannot reach the agent and rolls it back with AGENT_UNAVAILABLE
before anything is sent: no state change)."""

import time

import grpc
import pytest

from devstack.agentproc import AgentProcess, ControllerProcess
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc
from remp.redisproc import RedisServer
from tests.tlscerts import TestCA

pytestmark = pytest.mark.e2e
NODE = "e2e-mtls"


def until_over(stub, sid: str, within_s: float = 60.0):
    deadline = time.monotonic() + within_s
    while True:
        rec = stub.GetSwitch(controller_pb2.GetSwitchRequest(switch_id=sid), timeout=5)
        if rec.outcome != types_pb2.SWITCH_OUTCOME_RUNNING:
            return rec
        assert time.monotonic() < deadline, f"switch {sid} still running"
        time.sleep(0.05)


def test_controller_drives_an_agent_over_mtls(tiny_model, artifacts_dir, tmp_path):
    ca = TestCA(tmp_path)
    srv_cert, srv_key = ca.issue("agent", server=True)
    cli_cert, cli_key = ca.issue("controller", server=False)
    rogue = TestCA(tmp_path, "rogue-ca")
    rogue_cert, rogue_key = rogue.issue("intruder", server=False)
    with RedisServer() as r:
        ctl = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-mtls", env={
            "REMP_CONTROLLER_AGENT_TLS_CA": str(ca.cert_path),
            "REMP_CONTROLLER_AGENT_TLS_CERT": str(cli_cert),
            "REMP_CONTROLLER_AGENT_TLS_KEY": str(cli_key)})
        plain = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-no-cert")
        agent = AgentProcess(tiny_model, tp=2, pp=1, dtype="float32", log_dir=artifacts_dir,
                             node=NODE, tls=(ca.cert_path, cli_cert, cli_key),
                             extra=["--tls-cert", str(srv_cert), "--tls-key", str(srv_key),
                                    "--tls-client-ca", str(ca.cert_path),
                                    "--controller", "PLACEHOLDER"])
        with ctl, plain:
            agent.extra[-1] = ctl.addr
            with agent:
                with grpc.insecure_channel(ctl.addr) as ch:
                    stub = ctl.stub(ch)
                    ctl.wait_node_ready(NODE)
                    # the controller without a client certificate cannot reach the agent
                    with grpc.insecure_channel(plain.addr) as pch:
                        pstub = plain.stub(pch)
                        bad = pstub.Reconfigure(controller_pb2.ReconfigureRequest(
                            node=NODE, target=types_pb2.Topology(tp=1, pp=2)), timeout=15)
                        rec = until_over(pstub, bad.switch_id)
                    assert rec.outcome == types_pb2.SWITCH_OUTCOME_ROLLED_BACK
                    assert rec.error.code == "AGENT_UNAVAILABLE", rec.error
                    assert "was not sent" in rec.error.message and rec.error.retryable
                    st = stub.GetState(controller_pb2.GetStateRequest(node=NODE), timeout=5)
                    assert (st.observed.tp, st.observed.pp) == (2, 1)
                    assert not st.HasField("current_switch")
                    # the one with a certificate drives the switch
                    sid = stub.Reconfigure(controller_pb2.ReconfigureRequest(
                        node=NODE, target=types_pb2.Topology(tp=1, pp=2)), timeout=15).switch_id
                    rec = until_over(stub, sid)
                    assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED, rec.error.message
                assert (agent.describe().topology.tp, agent.describe().topology.pp) == (1, 2)
                # plaintext and a foreign client certificate are refused by the agent
                for creds in (None, grpc.ssl_channel_credentials(
                        ca.cert_path.read_bytes(), rogue_key.read_bytes(),
                        rogue_cert.read_bytes())):
                    ch = (grpc.insecure_channel(agent.grpc_addr) if creds is None
                          else grpc.secure_channel(agent.grpc_addr, creds))
                    with ch:
                        with pytest.raises(grpc.RpcError) as ei:
                            node_agent_pb2_grpc.NodeAgentStub(ch).Describe(
                                node_agent_pb2.DescribeRequest(), timeout=5)
                    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
