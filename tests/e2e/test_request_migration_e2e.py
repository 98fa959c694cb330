"""Cross-host request migration between two node agents on vLLM CPU (loopback): A serves TP2PP1,
B serves TP1PP1 (one worker), so the KV also changes layout on the way.

A request is taken out of A mid-decode and continues on B: with its KV (MIGRATE, loaded by the
remp import connector) or re-prefilled (RECOMPUTE). Either way the text A streamed before plus
what B continues with must equal an uninterrupted run. With the KV zeroed in flight the output
diverges (the migrated KV is what B uses). B's prefill table is measured (``remp profile``)
before A starts and A decides with it: throttling the transfer moves the decision from MIGRATE
to RECOMPUTE exactly where the cost model's crossover says; an SLO nothing can meet aborts the
request with a retryable decision.
"""

import asyncio
import subprocess
import sys

import grpc
import httpx
import pytest

from remp.common.v1 import types_pb2 as T
from remp.node_agent.v1 import node_agent_pb2 as pb
from remp.node_agent.v1 import node_agent_pb2_grpc
from remp.recovery import PrefillTable, crossover_bandwidth
from tests.helpers import AgentProcess, prompt, stream_completion

pytestmark = pytest.mark.e2e

MAX_TOKENS = 200
PROMPT = prompt(3)
FI = {"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"}


@pytest.fixture(scope="module")
def agents(tiny_model, artifacts_dir):
    b = AgentProcess(tiny_model, tp=1, pp=1, dtype="float32", log_dir=artifacts_dir, node="mig-b",
                     env=FI, extra=["--no-world-changes", "--request-migration"])
    b.start().wait_ready()
    table = artifacts_dir / "prefill-mig-b.json"
    r = subprocess.run([sys.executable, "-m", "remp.cli", "profile", "--agent", b.grpc_addr,
                        "--out", str(table), "--lengths", "16,128,256,511", "--repeats", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    a = AgentProcess(tiny_model, tp=2, pp=1, dtype="float32", log_dir=artifacts_dir, node="mig-a",
                     env=FI, extra=["--no-warm-up-candidates", "--request-migration", "--prefill-table", str(table)])
    a.start().wait_ready()
    yield a, b, PrefillTable.loads(table.read_text())
    for x in (a, b):
        rc, orphans = x.stop()
        assert rc == 0 and not orphans, x.log_tail()


@pytest.fixture(scope="module")
def reference(agents):
    a, _, _ = agents
    async def go():
        async with httpx.AsyncClient(timeout=300) as c:
            return await stream_completion(c, a.http, PROMPT, MAX_TOKENS)
    return asyncio.run(go())


def migrate(a, b, text=PROMPT, **kw):
    """Stream PROMPT on A; once the engine has it decoding (≥ 10 tokens), A migrates it to B.
    Returns (text A streamed, continuation from B, decision, first continuation event)."""
    async def go():
        async with httpx.AsyncClient(timeout=300) as c, grpc.aio.insecure_channel(a.grpc_addr) as ch:
            call = node_agent_pb2_grpc.NodeAgentStub(ch).MigrateRequest(pb.MigrateRequestRequest(
                target_address=b.grpc_addr, target_node="mig-b", test_wait_output_tokens=10, **kw))
            await asyncio.sleep(0.2)  # the agent's gate waits for the stream below
            stream = asyncio.create_task(stream_completion(c, a.http, text, MAX_TOKENS))
            cont, decision, first = "", None, None
            async for ev in call:
                if ev.HasField("decision"):
                    decision = ev.decision
                if first is None and (ev.text or ev.finished):
                    first = ev
                cont += ev.text
            return await stream, cont, decision, first
    return asyncio.run(go())


@pytest.mark.parametrize("mode", [pb.RECOVERY_MODE_MIGRATE, pb.RECOVERY_MODE_RECOMPUTE])
def test_request_continues_on_the_other_agent_token_exact(agents, reference, mode):
    a, b, _ = agents
    part, cont, d, first = migrate(a, b, mode=mode)
    want = T.RECOVERY_ACTION_MIGRATE if mode == pb.RECOVERY_MODE_MIGRATE else T.RECOVERY_ACTION_RECOMPUTE
    assert d.action == want and d.source_node == "mig-a" and d.target_node == "mig-b"
    assert part and cont  # it really moved mid-decode
    assert part + cont == reference
    assert len(part) < len(reference)
    assert first.export_seconds > 0
    # A no longer has it; B finished it
    with grpc.insecure_channel(a.grpc_addr) as ch:
        left = node_agent_pb2_grpc.NodeAgentStub(ch).ListRequests(pb.ListRequestsRequest(), timeout=30)
    assert not [r for r in left.requests if r.status == "RUNNING"]


def test_zeroed_kv_diverges(agents):
    # its own prompt: B's prefix cache keeps the zeroed blocks for it (imported KV is cached)
    a, b, _ = agents
    text = prompt(4)

    async def ref():
        async with httpx.AsyncClient(timeout=300) as c:
            return await stream_completion(c, a.http, text, MAX_TOKENS)
    reference = asyncio.run(ref())
    part, cont, d, _ = migrate(a, b, mode=pb.RECOVERY_MODE_MIGRATE, test_poison_kv=True,
                               text=text)
    assert d.action == T.RECOVERY_ACTION_MIGRATE
    assert part + cont != reference and reference.startswith(part)


def test_throttle_flips_the_decision_at_the_predicted_crossover(agents, reference):
    a, b, table = agents
    # the first run measures the request's size at the decision (KV bytes, tokens) at full speed
    part, cont, d0, _ = migrate(a, b)
    assert part + cont == reference
    crossover = crossover_bandwidth(d0.kv_bytes, table.seconds(d0.tokens))
    seen = {}
    for factor in (0.5, 2.0):
        limit = crossover * factor
        part, cont, d, first = migrate(a, b, bandwidth_limit_bps=limit)
        assert part + cont == reference
        # the decision's costs are the cost model's: bytes / throttled bandwidth, measured table
        assert d.bandwidth_bps == pytest.approx(min(limit, d.bandwidth_bps), rel=1e-9)
        assert d.migrate_seconds == pytest.approx(d.kv_bytes / d.bandwidth_bps, rel=1e-9)
        assert d.recompute_seconds == pytest.approx(table.seconds(d.tokens), rel=1e-9)
        here = crossover_bandwidth(d.kv_bytes, d.recompute_seconds)
        expect = T.RECOVERY_ACTION_MIGRATE if d.bandwidth_bps >= here else T.RECOVERY_ACTION_RECOMPUTE
        assert d.action == expect, (factor, d)
        seen[factor] = d.action
        if d.action == T.RECOVERY_ACTION_MIGRATE:  # the throttle is real: the transfer took it
            assert first.transfer_seconds >= d.kv_bytes / limit * 0.9
    assert seen == {0.5: T.RECOVERY_ACTION_RECOMPUTE, 2.0: T.RECOVERY_ACTION_MIGRATE}


def test_slo_infeasible_request_is_aborted_with_a_retryable_decision(agents, reference):
    a, b, _ = agents
    part, cont, d, _ = migrate(a, b, slo_budget_seconds=1e-9)
    assert d.action == T.RECOVERY_ACTION_ABORT and d.reason == "slo_infeasible"
    assert d.retry_after_seconds >= 1
    assert cont == "" and reference.startswith(part) and len(part) < len(reference)


def test_bad_requests_get_clear_statuses(agents):
    a, b, _ = agents
    with grpc.insecure_channel(a.grpc_addr) as ch:
        stub = node_agent_pb2_grpc.NodeAgentStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.MigrateRequest(pb.MigrateRequestRequest(request_id="nope",
                                                              target_address=b.grpc_addr), timeout=30))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            list(stub.MigrateRequest(pb.MigrateRequestRequest(request_id="x"), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(b.grpc_addr) as ch:
        stub = node_agent_pb2_grpc.NodeAgentStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ImportRequest(iter([pb.ImportChunk(kv=b"x")]), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        hdr = pb.ImportHeader(request_id="r", prompt_token_ids=[1, 2, 3], max_tokens=4,
                              kv_bytes=10, block_size=128)
        with pytest.raises(grpc.RpcError) as e:  # payload shorter than announced
            list(stub.ImportRequest(iter([pb.ImportChunk(header=hdr), pb.ImportChunk(kv=b"abc")]),
                                    timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
