"""The node agent on a real vLLM CPU engine: HTTP completions, gRPC facts, health, lifecycle."""

import asyncio
import json

import grpc
import httpx
import pytest

from remp.auth import Credentials, Role
from remp.common.v1 import types_pb2
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc
from tests.helpers import AgentProcess, arm_switch, complete, execute_switch, grpcurl

pytestmark = pytest.mark.e2e

PROMPTS = ["t5 t6 t7 t8 t9 t10", "t100 t200 t300", "t1500 t3 t77 t1024 t9 t9 t9 t12"]
TOPOLOGIES = [(1, 1), (2, 1), (1, 2)]
N_TOKENS = 12


@pytest.fixture(scope="module")
def native(tiny_model, artifacts_dir, reaper):
    """The agents started natively on TP1PP2 for the two topology tests below: started with the
    module (their starts overlap those of tp2_agent and the session's plain TP1PP1 agent); each
    test waits for its own."""
    agents = {
        # no world changes, no warm-up visits of other topologies
        "fp32": AgentProcess(tiny_model, tp=1, pp=2, dtype="float32", log_dir=artifacts_dir,
                             node="e2e-native-fp32",
                             extra=["--no-world-changes", "--no-warm-up-candidates"]),
        "bf16": AgentProcess(tiny_model, tp=1, pp=2, dtype="bfloat16", log_dir=artifacts_dir,
                             node="e2e-native-bf16")}
    try:
        for a in agents.values():
            a.start()
        yield agents
    finally:
        reaper.stop(*agents.values(), check=False)


@pytest.fixture(scope="module")
def tp2_agent(tp2_started, native, plain_tp1_started):
    """The session's TP2PP1 fp32 agent (tests/e2e/conftest.py; test_switch_e2e switches it
    later), observed from the moment it starts (health before ready). The other engines of this
    module start meanwhile (``native``, ``plain_tp1_started``); its stop (exit code, no
    orphans) is checked when the session ends."""
    return tp2_started.wait_ready()


def as_controller() -> list[str]:
    """grpcurl's flag that sends the controller's credential (switches come only from it)."""
    return ["-H", f"authorization: Bearer {Credentials.load().tokens[Role.CONTROLLER]}"]


def generate_all(agent) -> list[str]:
    outs = []
    for p in PROMPTS:
        body = complete(agent.http, p, max_tokens=N_TOKENS)
        assert body["usage"]["completion_tokens"] == N_TOKENS
        text = body["choices"][0]["text"]
        assert len(text.split()) == N_TOKENS  # word-level tokenizer: one word per token
        outs.append(text)
    return outs


def test_health_not_serving_until_engine_ready(tp2_agent):
    assert tp2_agent.seen_health[0] == "NOT_SERVING"
    assert tp2_agent.seen_health[-1] == "SERVING"
    assert "ENGINE_STATUS_STARTING" in tp2_agent.seen_status
    assert tp2_agent.health("") == "SERVING"  # liveness


def test_grpcurl_lists_services(tp2_agent):
    r = grpcurl("-plaintext", tp2_agent.grpc_addr, "list")
    assert r.returncode == 0, r.stderr
    services = r.stdout.split()
    assert "remp.node_agent.v1.NodeAgent" in services and "grpc.health.v1.Health" in services
    r = grpcurl("-plaintext", tp2_agent.grpc_addr, "describe", "remp.node_agent.v1.NodeAgent")
    assert "rpc ExecuteSwitch" in r.stdout and "stream .remp.node_agent.v1.SwitchEvent" in r.stdout


def test_grpcurl_describe_reports_facts(tp2_agent):
    r = grpcurl("-plaintext", tp2_agent.grpc_addr, "remp.node_agent.v1.NodeAgent/Describe")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["node"] == "e2e-tp2"
    assert d["host"]["device_type"] == "cpu" and d["host"]["cpu_cores"] >= 1
    assert int(d["host"]["memory_bytes"]) > 2**30
    m = d["model"]
    assert (m["num_layers"], m["num_attention_heads"], m["num_kv_heads"], m["head_size"]) == (4, 8, 4, 32)
    assert m["dtype"] == "float32" and m["architecture"] == "LlamaForCausalLM"
    assert d["topology"] == {"tp": 2, "pp": 1}
    cands = [(c.get("tp", 0), c.get("pp", 0)) for c in d["candidates"]]
    assert (2, 1) in cands and (1, 2) in cands and (1, 1) in cands
    assert all(tp * pp <= d["host"]["device_count"] for tp, pp in cands)
    assert d["engine_status"] == "ENGINE_STATUS_SERVING"
    assert d["vllm_version"] == "0.32.0"
    workers = d["workers"]
    assert [w.get("tp_rank", 0) for w in workers] == [0, 1]
    assert len({w["pid"] for w in workers}) == 2
    assert int(d["engine"]["num_blocks"]) > 0 and d["engine"]["block_size"] > 0


def test_health_check_via_grpcurl(tp2_agent):
    r = grpcurl("-plaintext", "-d", '{"service": "remp.node_agent.v1.NodeAgent"}',
                tp2_agent.grpc_addr, "grpc.health.v1.Health/Check")
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "SERVING"


def test_execute_switch_rejects_non_candidate(tp2_agent):
    r = grpcurl("-plaintext", *as_controller(), "-d",
                '{"target": {"tp": 4, "pp": 1}, "switch_id": "s1"}',
                tp2_agent.grpc_addr, "remp.node_agent.v1.NodeAgent/ExecuteSwitch")
    assert r.returncode != 0
    assert "InvalidArgument" in r.stderr
    assert "valid targets: TP1PP1, TP2PP1, TP1PP2" in r.stderr


def test_execute_switch_without_a_credential_is_unauthenticated(tp2_agent):
    r = grpcurl("-plaintext", "-d", '{"target": {"tp": 1, "pp": 2}}',
                tp2_agent.grpc_addr, "remp.node_agent.v1.NodeAgent/ExecuteSwitch")
    assert r.returncode != 0 and "Unauthenticated" in r.stderr, r.stderr
    assert tp2_agent.describe().topology.tp == 2  # nothing switched


def test_get_unknown_switch_is_not_found(tp2_agent):
    with tp2_agent.channel() as ch:
        with pytest.raises(grpc.RpcError) as e:
            node_agent_pb2_grpc.NodeAgentStub(ch).GetSwitch(
                node_agent_pb2.GetSwitchRequest(switch_id="nope"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_chat_completion(tp2_agent):
    r = httpx.post(f"{tp2_agent.http}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "t5 t9 t11"}],
        "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    r.raise_for_status()
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6
    assert len(body["choices"][0]["message"]["content"].split()) == 6


def test_agent_log_lines_carry_node(tp2_agent):
    recs = tp2_agent.log_records()
    assert any(r["event"] == "agent.ready" for r in recs)
    assert recs and all(r.get("node") == "e2e-tp2" for r in recs)


def test_fp32_greedy_identical_across_topologies(tp2_agent, plain_tp1_agent, native):
    # each started natively on its topology: TP1PP1 the session's plain-vLLM agent
    # (tests/e2e/conftest.py), TP1PP2 the module's (no world changes, no warm-up visits)
    outputs = {(2, 1): generate_all(tp2_agent)}
    for (tp, pp), a in (((1, 1), plain_tp1_agent), ((1, 2), native["fp32"].wait_ready())):
        d = a.describe()
        assert (d.topology.tp, d.topology.pp) == (tp, pp) and d.model.dtype == "float32"
        outputs[(tp, pp)] = generate_all(a)
    native["fp32"].stop()
    assert outputs[(1, 1)] == outputs[(2, 1)] == outputs[(1, 2)], outputs
    assert len(set(outputs[(1, 1)])) == len(PROMPTS)  # different prompts, different outputs


def test_bf16_serves_every_topology(native):
    # bf16 started natively with pipeline parallelism (vLLM's own PP start: the case that once
    # died with SIGILL on an AMX host), then every other topology by switching in place
    a = native["bf16"].wait_ready()
    try:
        assert a.describe().model.dtype == "bfloat16"
        outs = {(1, 2): generate_all(a)}
        for tp, pp in TOPOLOGIES:
            if (tp, pp) in outs:
                continue
            _, rec = asyncio.run(execute_switch(a.grpc_addr, tp, pp))
            assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED, rec.error.message
            d = a.describe()
            assert (d.topology.tp, d.topology.pp) == (tp, pp)
            outs[(tp, pp)] = generate_all(a)
    finally:
        a.stop()
    assert all(all(o) for o in outs.values()) and len(outs) == len(TOPOLOGIES)
    rc, orphans = a.stop()  # already stopped above: idempotent
    assert rc == 0 and orphans == []


def test_fault_injection_needs_the_setting(tp2_agent, plain_tp1_agent):
    # the production messages carry no test-only fields
    r = grpcurl("-plaintext", *as_controller(), "-d",
                '{"target": {"tp": 1, "pp": 2}, "fail_at_phase": "PHASE_QUIESCING"}',
                tp2_agent.grpc_addr, "remp.node_agent.v1.NodeAgent/ExecuteSwitch")
    assert r.returncode != 0 and "fail_at_phase" in r.stderr
    # the service exists only with the setting (the TP2PP1 agent has it) ...
    r = grpcurl("-plaintext", tp2_agent.grpc_addr, "list")
    assert r.returncode == 0 and "remp.node_agent.v1.FaultInjection" in r.stdout
    # ... and an agent without it (the session's plain TP1PP1 one) serves none
    r = grpcurl("-plaintext", plain_tp1_agent.grpc_addr, "list")
    assert r.returncode == 0 and "remp.node_agent.v1.NodeAgent" in r.stdout
    assert "FaultInjection" not in r.stdout
    with pytest.raises(grpc.RpcError) as e:
        asyncio.run(arm_switch(plain_tp1_agent.grpc_addr, start_when_running=2))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
