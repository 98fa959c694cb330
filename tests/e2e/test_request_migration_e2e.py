"""Cross-host request migration between two node agents on vLLM CPU (loopback): A serves TP2PP1,
B serves TP1PP1 (one worker), so the KV also changes layout on the way.

A request is taken out of A mid-decode and continues on B: with its KV (MIGRATE, loaded by the
remp import connector) or re-prefilled (RECOMPUTE). A relays B's tokens into the client's own
stream, so either way the client's one response must equal an uninterrupted run. With the KV zeroed in flight the output
diverges (the migrated KV is what B uses). B's prefill table is measured (``remp profile``)
before A starts and A decides with it: throttling the transfer moves the decision from MIGRATE
to RECOMPUTE exactly where the cost model's crossover says; an SLO nothing can meet aborts the
request with a retryable error (503 + Retry-After, or an error event on the stream).

A serves its OpenAI API with vLLM's ``--api-key`` (passed after ``--``): every client here sends
the key, and the migrated requests' relayed continuations reach them through it. The tests call
the agents with the session's credentials (remp.auth); A may send requests only to the peers it
is configured with (``REMP_AGENT_MIGRATION_PEERS``: B and the dying stand-in below).
"""

import asyncio
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import httpx
import psutil
import pytest

from remp.auth import Credentials, aio_channel
from remp.common.v1 import types_pb2 as T
from remp.node_agent.v1 import node_agent_pb2 as pb
from remp.node_agent.v1 import node_agent_pb2_grpc
from remp.recovery import PrefillTable, crossover_bandwidth, int8_payload_bytes
from tests.helpers import AgentProcess, arm_migration, prompt, stream_completion

pytestmark = pytest.mark.e2e

MAX_TOKENS = 200
SHORT_PROMPT, LONG_TOKENS = prompt(0, 12), 490  # 12 + 490 tokens: the agents' 512 context
PROMPT = prompt(3)
FI = {"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"}
API_KEY = "test-openai-key-0123456789"  # A's OpenAI API (vLLM --api-key)


def api_client(**kw) -> httpx.AsyncClient:
    """An HTTP client of A's OpenAI API (with its key)."""
    return httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}, **kw)


def agent_channel(addr: str) -> grpc.aio.Channel:
    return aio_channel(addr, Credentials.load())


@pytest.fixture(scope="module")
def dying():
    """A target agent whose engine dies after its first continuation token (one of A's
    migration peers): bound where the kernel chooses before A starts (a port picked at import
    time can be taken by the time the module runs); only the dying-target test calls it."""
    server = grpc.server(ThreadPoolExecutor(2))
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(_TargetThatDies(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def agents(tiny_model, artifacts_dir, plain_tp1_agent, dying, reaper):
    # B's prefill table (A's recovery decision reads it), measured on the session's plain TP1PP1
    # fp32 engine: the same model, topology and dtype as B, already running, so that A and B
    # start at once instead of A waiting for B's start and its profile
    table = artifacts_dir / "prefill-mig-b.json"
    r = subprocess.run([sys.executable, "-m", "ops.cli", "profile", "--agent",
                        plain_tp1_agent.grpc_addr, "--out", str(table),
                        "--lengths", "16,128,256,511", "--repeats", "3"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    b = AgentProcess(tiny_model, tp=1, pp=1, dtype="float32", log_dir=artifacts_dir, node="mig-b",
                     env=FI, extra=["--no-world-changes", "--request-migration",
                                    "--worker-spin-seconds", "0.02"])
    a = AgentProcess(tiny_model, tp=2, pp=1, dtype="float32", log_dir=artifacts_dir, node="mig-a",
                     env={**FI, "REMP_AGENT_MIGRATION_PEERS": f"{b.grpc_addr},{dying}"},
                     extra=["--no-warm-up-candidates", "--request-migration", "--prefill-table",
                            str(table), "--worker-spin-seconds", "0.02",
                            "--", "--api-key", API_KEY])
    b.start()
    a.start()
    b.wait_ready()
    a.wait_ready()
    yield a, b, PrefillTable.loads(table.read_text())
    reaper.stop(a, b)


@pytest.fixture(scope="module")
def reference(agents):
    a, _, _ = agents
    async def go():
        async with api_client() as c:
            return await stream_completion(c, a.http, PROMPT, MAX_TOKENS)
    return asyncio.run(go())


def migrate(a, b, text=PROMPT, stream=True, rpc_errors=None, poison_kv=False, **kw):
    """Send PROMPT to A; once the engine has it decoding (≥ 10 tokens), A migrates it to B (any
    object with a ``grpc_addr``). Returns (what A's client received — streamed text, or the
    non-streaming response —, continuation from B as the MigrateRequest caller saw it, decision,
    first continuation event, error events on A's stream). A failed MigrateRequest raises, or
    with ``rpc_errors`` (a list) its status code goes there."""
    async def go():
        # the agent's test-only gate (FaultInjection) picks the request once it has 10 tokens
        await arm_migration(a.grpc_addr, wait_output_tokens=10, poison_kv=poison_kv)
        async with api_client() as c, agent_channel(a.grpc_addr) as ch:
            call = node_agent_pb2_grpc.NodeAgentStub(ch).MigrateRequest(pb.MigrateRequestRequest(
                target_address=b.grpc_addr, target_node="mig-b", **kw))
            await asyncio.sleep(0.2)  # the agent's gate waits for the request below
            errors: list = []
            client = asyncio.create_task(
                stream_completion(c, a.http, text, MAX_TOKENS, errors=errors) if stream else
                c.post(f"{a.http}/v1/completions", json={
                    "model": "tiny", "prompt": text, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True}))
            cont, decision, first = "", None, None
            try:
                async for ev in call:
                    if ev.HasField("decision"):
                        decision = ev.decision
                    if first is None and (ev.text or ev.finished):
                        first = ev
                    cont += ev.text
            except grpc.aio.AioRpcError as exc:
                if rpc_errors is None:
                    raise
                rpc_errors.append(exc.code())
            return await client, cont, decision, first, errors
    return asyncio.run(go())


@pytest.mark.parametrize("mode", [pb.RECOVERY_MODE_MIGRATE, pb.RECOVERY_MODE_RECOMPUTE])
def test_request_continues_on_the_other_agent_token_exact(agents, reference, mode):
    a, b, _ = agents
    got, cont, d, first, errors = migrate(a, b, mode=mode)
    want = T.RECOVERY_ACTION_MIGRATE if mode == pb.RECOVERY_MODE_MIGRATE else T.RECOVERY_ACTION_RECOMPUTE
    assert d.action == want and d.source_node == "mig-a" and d.target_node == "mig-b"
    # it really moved mid-decode: B produced the tail, A the rest
    assert cont and len(cont) < len(reference) and reference.endswith(cont)
    # the client's one stream on A carried all of it (B's tokens relayed), exactly
    assert got == reference and not errors
    assert first.export_seconds > 0
    # A no longer has it; B finished it
    with a.channel() as ch:
        left = node_agent_pb2_grpc.NodeAgentStub(ch).ListRequests(pb.ListRequestsRequest(), timeout=30)
    assert not [r for r in left.requests if r.status == "RUNNING"]


def test_non_streaming_client_gets_the_whole_completion(agents, reference):
    a, b, _ = agents
    r, cont, d, _, _ = migrate(a, b, stream=False, mode=pb.RECOVERY_MODE_MIGRATE)
    assert d.action == T.RECOVERY_ACTION_MIGRATE and cont and len(cont) < len(reference)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == reference and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_zeroed_kv_diverges(agents):
    # its own prompt: B's prefix cache keeps the zeroed blocks for it (imported KV is cached)
    a, b, _ = agents
    text = prompt(4)

    async def ref():
        async with api_client() as c:
            return await stream_completion(c, a.http, text, MAX_TOKENS)
    reference = asyncio.run(ref())
    got, cont, d, _, _ = migrate(a, b, mode=pb.RECOVERY_MODE_MIGRATE, poison_kv=True,
                                 text=text)
    assert d.action == T.RECOVERY_ACTION_MIGRATE
    assert got != reference and got.endswith(cont)
    assert reference.startswith(got[:len(got) - len(cont)])


def test_int8_kv_migration_sends_a_smaller_payload_and_the_request_completes(agents, reference):
    # issue 18: the call's kv_int8 override (A runs with the default --kv-int8 off)
    a, b, _ = agents
    got, cont, d, first, errors = migrate(a, b, mode=pb.RECOVERY_MODE_MIGRATE,
                                          kv_int8=pb.KV_INT8_MODE_ON)
    assert d.action == T.RECOVERY_ACTION_MIGRATE and first.kv_format == pb.KV_FORMAT_INT8
    # the payload: one byte per element + a float32 scale per (layer, block, KV head), plus its
    # safetensors header; the tiny fp32 model's full width is 3.98x that
    desc = a.describe()
    group = desc.engine.block_size * 2 * desc.model.head_size  # one (block, KV head)
    tensors = int8_payload_bytes(d.kv_bytes, 4, group)
    assert tensors + 10 <= first.payload_bytes <= tensors + 1024 + 320 * 4
    assert d.kv_bytes / first.payload_bytes >= 3.9
    # the continuation completed on B and reached the client; before the move it is A's
    assert cont and got.endswith(cont) and not errors
    assert reference.startswith(got[:len(got) - len(cont)])
    # auto on a slow link: INT8 (the smaller payload wins once the link, not the codec, binds)
    got, cont, d, first, errors = migrate(a, b, mode=pb.RECOVERY_MODE_MIGRATE,
                                          kv_int8=pb.KV_INT8_MODE_AUTO,
                                          bandwidth_limit_bps=20e6)
    assert first.kv_format == pb.KV_FORMAT_INT8 and cont and got.endswith(cont) and not errors
    # off (the call asks for it): full width, token-exact as before
    got, cont, d, first, errors = migrate(a, b, mode=pb.RECOVERY_MODE_MIGRATE,
                                          kv_int8=pb.KV_INT8_MODE_OFF)
    assert first.kv_format == pb.KV_FORMAT_FULL and got == reference
    assert first.payload_bytes > d.kv_bytes  # tensors + header


def test_throttle_flips_the_decision_at_the_predicted_crossover(agents, reference):
    a, b, table = agents
    # the first run measures the request's size at the decision (KV bytes, tokens) at full speed
    got, cont, d0, _, _ = migrate(a, b)
    assert got == reference and reference.endswith(cont)
    crossover = crossover_bandwidth(d0.kv_bytes, table.seconds(d0.tokens))
    seen = {}
    # just below and just above the crossover: above it, the throttle must be what binds, so
    # the link's own measured bandwidth (EWMA, d0's) has to stay above the upper limit. In CI,
    # with vLLM's workers spinning a core each after the export, it measured < 2× the
    # crossover (both agents here run with --worker-spin-seconds 0.02), and on one slow CI
    # machine below 1.25×: the upper point is then put under the EWMA (at least 5 % above the
    # crossover); where the EWMA itself is what binds, the decision must still be the model's
    upper = min(1.25, max(1.05, 0.95 * d0.bandwidth_bps / crossover))
    for factor in (0.8, upper):
        limit = crossover * factor
        got, cont, d, first, _ = migrate(a, b, bandwidth_limit_bps=limit)
        assert got == reference and cont and reference.endswith(cont)
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
        throttled = d.bandwidth_bps == pytest.approx(limit, rel=1e-9)
    why = (f"crossover {crossover:.3g} B/s; link EWMA at the first decision "
           f"{d0.bandwidth_bps:.3g}; upper point {upper:.3g}×", seen)
    assert seen[0.8] == T.RECOVERY_ACTION_RECOMPUTE, why
    if throttled:  # the flip itself, where the throttle (not the link) bound above the crossover
        assert seen[upper] == T.RECOVERY_ACTION_MIGRATE, why


def test_slo_infeasible_request_is_aborted_with_a_retryable_error(agents, reference):
    a, b, _ = agents
    got, cont, d, _, errors = migrate(a, b, slo_budget_seconds=1e-9)
    assert d.action == T.RECOVERY_ACTION_ABORT and d.reason == "slo_infeasible"
    assert d.retry_after_seconds >= 1
    # the streaming client got what was generated, then a retryable error event
    assert cont == "" and reference.startswith(got) and len(got) < len(reference)
    assert len(errors) == 1 and errors[0]["code"] == 503 and "retry" in errors[0]["message"]
    # a non-streaming client gets HTTP 503 with Retry-After
    r, _, d, _, _ = migrate(a, b, stream=False, slo_budget_seconds=1e-9)
    assert d.action == T.RECOVERY_ACTION_ABORT
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    assert "retry" in r.json()["error"]["message"]
    # the engine keeps serving
    assert asyncio.run(_one(a, PROMPT)) == reference


def test_client_gone_mid_relay_drops_the_request_on_the_target(agents):
    a, b, _ = agents

    async def go():
        await arm_migration(a.grpc_addr, wait_output_tokens=10)
        async with api_client() as c, agent_channel(a.grpc_addr) as ch:
            call = node_agent_pb2_grpc.NodeAgentStub(ch).MigrateRequest(pb.MigrateRequestRequest(
                target_address=b.grpc_addr, target_node="mig-b",
                mode=pb.RECOVERY_MODE_RECOMPUTE))
            await asyncio.sleep(0.2)
            # a long request (almost the whole 512-token context): B's continuation must outlast
            # the hang-up's detection (a 200-token request once finished on B before A saw the
            # client go, after A's HTTP socket stopped waiting for delayed ACKs)
            client = asyncio.create_task(stream_completion(c, a.http, SHORT_PROMPT,
                                                           LONG_TOKENS))
            evs = []
            async for ev in call:
                evs.append(ev)
                if not ev.HasField("decision") and ev.token_ids and not client.done():
                    client.cancel()  # the client hangs up while B continues its request
            return evs
    evs = asyncio.run(go())
    assert evs[-1].finished and evs[-1].finish_reason == "client"
    with b.channel() as ch:
        stub = node_agent_pb2_grpc.NodeAgentStub(ch)
        deadline = time.monotonic() + 30
        # the engine core's own view (exact): the front end's drops the request first
        while stub.ListRequests(pb.ListRequestsRequest(exact=True), timeout=30).requests:
            assert time.monotonic() < deadline, "B still runs a request nobody waits for"
            time.sleep(0.2)


class _TargetThatDies(node_agent_pb2_grpc.NodeAgentServicer):
    """A target agent whose engine dies after its first continuation token (a real gRPC
    server on loopback, standing in for a host that fails mid-import)."""

    def ImportRequest(self, request_iterator, context):
        for _ in request_iterator:
            pass
        yield pb.ImportEvent(token_ids=[5], text="", receive_seconds=0.01)
        context.abort(grpc.StatusCode.UNAVAILABLE, "target engine died")


def test_target_failing_mid_relay_ends_the_client_with_a_retryable_error(agents, reference,
                                                                          dying):
    a, _, _ = agents
    codes: list = []
    got, _, _, _, errors = migrate(a, SimpleNamespace(grpc_addr=dying),
                                   mode=pb.RECOVERY_MODE_RECOMPUTE, rpc_errors=codes)
    assert codes == [grpc.StatusCode.UNAVAILABLE]
    assert len(errors) == 1 and errors[0]["code"] == 503, errors
    assert got and len(got) < len(reference)
    assert asyncio.run(_one(a, PROMPT)) == reference  # A keeps serving


def test_worker_spin_setting_frees_the_cores_after_a_step(agents, reference):
    # A runs with --worker-spin-seconds 0.02: vLLM's workers otherwise busy-wait 1 s after every
    # message (a core each; 2 workers here) — measured over the second after a generation
    a, _, _ = agents
    assert asyncio.run(_one(a, PROMPT)) == reference
    procs = a.descendants()
    assert len(procs) >= 3  # engine core + 2 workers

    def cpu():
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total
    time.sleep(0.1)
    c0 = cpu()
    time.sleep(0.8)
    used = cpu() - c0
    assert used < 0.3, f"engine processes used {used:.2f} CPU-s in the 0.8 s after a generation"


async def _one(agent, text):
    async with api_client() as c:
        return await stream_completion(c, agent.http, text, MAX_TOKENS)


def test_bad_requests_get_clear_statuses(agents):
    a, b, _ = agents
    with a.channel() as ch:
        stub = node_agent_pb2_grpc.NodeAgentStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.MigrateRequest(pb.MigrateRequestRequest(request_id="nope",
                                                              target_address=b.grpc_addr), timeout=30))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            list(stub.MigrateRequest(pb.MigrateRequestRequest(request_id="x"), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # a target that is neither a migration peer nor known to a controller (A has none)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.MigrateRequest(pb.MigrateRequestRequest(
                request_id="x", target_address="127.0.0.1:1"), timeout=30))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not one of this agent's migration peers" in e.value.details()
        # enum values this agent does not know (a newer client's, or garbage)
        for bad in ({"mode": 99}, {"kv_int8": 99}):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.MigrateRequest(pb.MigrateRequestRequest(
                    request_id="x", target_address=b.grpc_addr, **bad), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert f"unknown {next(iter(bad))}" in e.value.details()
    with b.channel() as ch:
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
        hdr.kv_format = 99  # a payload format this agent does not know
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ImportRequest(iter([pb.ImportChunk(header=hdr),
                                          pb.ImportChunk(kv=b"x" * 10)]), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a known KV payload format" in e.value.details()


def test_openai_api_key_is_enforced_through_remp_agent(agents):
    # vLLM's --api-key, given to `remp agent` after --: no key or a wrong one is 401
    a, _, _ = agents
    body = {"model": "tiny", "prompt": "t5 t6", "max_tokens": 2}
    assert httpx.post(f"{a.http}/v1/completions", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{a.http}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.post(f"{a.http}/v1/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
