"""The node agent's data plane under attack (issue 14), against one real agent (vLLM CPU, TP1PP1):

* switches and epochs only from the controller's identity (the epoch-poisoning attempt is refused
  and the controller can still switch);
* ImportRequest: hostile headers and payloads (random "KV", NaNs, path traversal, tokens outside
  the vocabulary, more bytes than announced) are INVALID_ARGUMENT and the engine keeps serving; a
  well-formed payload of this engine's layout is accepted; ``kv_transfer_params`` sent to the
  OpenAI API cannot make the import connector read a file;
* MigrateRequest sends only to allowed targets, with the agent's own credential, over mutual TLS
  checked against the CA; the continuation is relayed into the client's response, which went
  through vLLM's API key (``VLLM_API_KEY``);
* an engine that dies anyway: readiness NOT_SERVING, restarted in process, SERVING again.

The targets are stand-in gRPC servers on loopback (they record what reaches them), so one engine
serves the whole module.
"""

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
from safetensors.numpy import save

from remp.auth import Credentials, Role, aio_channel
from remp.common.v1 import types_pb2 as T
from remp.node_agent.v1 import node_agent_pb2 as pb
from remp.node_agent.v1 import node_agent_pb2_grpc
from tests.helpers import AgentProcess, arm_migration, prompt, stream_completion
from tests.tlscerts import TestCA

pytestmark = pytest.mark.e2e

API_KEY = "sec-openai-key-0123456789"
HTTP_AUTH = {"Authorization": f"Bearer {API_KEY}"}
RELAYED = [100, 101, 102]  # what the stand-in target "generates"


class RecordingTarget(node_agent_pb2_grpc.NodeAgentServicer):
    """A stand-in target agent: records each ImportRequest (metadata, client certificate, header)
    and answers with RELAYED."""

    def __init__(self):
        self.calls: list[dict] = []
        self.addr = ""  # host:port, once bound (_server)

    def ImportRequest(self, request_iterator, context):
        chunks = list(request_iterator)
        self.calls.append({"metadata": dict(context.invocation_metadata()),
                           "cn": [c.decode() for c in
                                  context.auth_context().get("x509_common_name", [])],
                           "header": chunks[0].header})
        yield pb.ImportEvent(token_ids=RELAYED[:1], receive_seconds=0.01)
        yield pb.ImportEvent(token_ids=RELAYED[1:], finished=True, finish_reason="length")


def _server(creds: grpc.ServerCredentials | None):
    """Bound to a port of the kernel's choice here (a port picked at import time was seen
    taken by the time the module ran); ``target.addr`` is where it listens."""
    target = RecordingTarget()
    server = grpc.server(ThreadPoolExecutor(4))
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(target, server)
    port = (server.add_secure_port("127.0.0.1:0", creds) if creds is not None
            else server.add_insecure_port("127.0.0.1:0"))
    assert port > 0
    target.addr = f"127.0.0.1:{port}"
    server.start()
    return server, target


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = TestCA(d), TestCA(d, "rogue-ca")
    return {"ca": ca, "rogue": rogue, "agent": ca.issue("agent-sec", server=False),
            "target": ca.issue("target-ok", server=True),
            "rogue_target": rogue.issue("target-rogue", server=True)}


@pytest.fixture(scope="module")
def targets(pki):
    """GOOD: mutual TLS with our CA; ROGUE: a certificate from another CA (both migration peers
    of the agent); OTHER: plaintext, not a peer."""
    ca = pki["ca"].cert_path.read_bytes()

    def tls(cert_key):
        cert, key = cert_key
        return grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())],
                                           root_certificates=ca, require_client_auth=True)
    servers = {"good": _server(tls(pki["target"])),
               "rogue": _server(tls(pki["rogue_target"])),
               "other": _server(None)}
    yield {k: t for k, (_, t) in servers.items()}
    for s, _ in servers.values():
        s.stop(0)


@pytest.fixture(scope="module")
def agent(tiny_model, artifacts_dir, pki, targets, reaper):
    cert, key = pki["agent"]
    env = {"REMP_AGENT_ENABLE_FAULT_INJECTION": "1", "VLLM_API_KEY": API_KEY,
           "REMP_AGENT_MIGRATION_PEERS": f"{targets['good'].addr},{targets['rogue'].addr}",
           "REMP_AGENT_PEER_TLS_CA": str(pki["ca"].cert_path),
           "REMP_AGENT_TLS_CLIENT_CERT": str(cert), "REMP_AGENT_TLS_CLIENT_KEY": str(key),
           "REMP_AGENT_MAX_ENGINE_RESTARTS": "1"}
    a = AgentProcess(tiny_model, tp=1, pp=1, dtype="float32", log_dir=artifacts_dir,
                     node="sec-a", env=env,
                     extra=["--no-world-changes", "--no-warm-up-candidates",
                            "--request-migration", "--worker-spin-seconds", "0.02"])
    a.start().wait_ready()
    yield a
    reaper.stop(a)


def token(role: Role) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {Credentials.load().tokens[role]}"),)


def complete(agent, n=4, **kw) -> httpx.Response:
    return httpx.post(f"{agent.http}/v1/completions", timeout=120, headers=HTTP_AUTH, json={
        "model": "tiny", "prompt": prompt(1, 20), "max_tokens": n, "temperature": 0.0,
        "ignore_eos": True, **kw})


def still_serving(agent) -> None:
    assert agent.health() == "SERVING"
    r = complete(agent)
    assert r.status_code == 200, r.text
    assert not [r for r in agent.log_records() if r.get("event") == "agent.engine_dead"]


# ---------------------------------------------------------------------------- OpenAI API key

def test_openai_api_key_from_the_environment(agent):
    body = {"model": "tiny", "prompt": "t5 t6", "max_tokens": 2}
    assert httpx.post(f"{agent.http}/v1/completions", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{agent.http}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    assert complete(agent).status_code == 200


# ---------------------------------------------------------------------------- switches

def _switch(agent, md, epoch):
    with grpc.insecure_channel(agent.grpc_addr) as ch:
        return list(node_agent_pb2_grpc.NodeAgentStub(ch).ExecuteSwitch(
            pb.ExecuteSwitchRequest(target=T.Topology(tp=1, pp=1), epoch=epoch), metadata=md,
            timeout=60))


def test_switches_and_epochs_only_from_the_controller(agent):
    poison = 2**64 - 1
    for md, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                     (token(Role.OPERATOR), grpc.StatusCode.PERMISSION_DENIED),
                     (token(Role.AGENT), grpc.StatusCode.PERMISSION_DENIED),
                     (token(Role.POLICY), grpc.StatusCode.PERMISSION_DENIED),
                     ((("authorization", "Bearer not-a-token-at-all"),),
                      grpc.StatusCode.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as e:
            _switch(agent, md, poison)
        assert e.value.code() == code, e.value.details()
    with grpc.insecure_channel(agent.grpc_addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            node_agent_pb2_grpc.NodeAgentStub(ch).AbortSwitch(
                pb.AbortSwitchRequest(switch_id="x"), metadata=token(Role.OPERATOR), timeout=30)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # the poisoned epoch never landed: the controller still switches with a small one
    events = _switch(agent, token(Role.CONTROLLER), 5)
    assert events[-1].record.outcome == T.SWITCH_OUTCOME_NOOP, events[-1]


# ---------------------------------------------------------------------------- ImportRequest

def _import(agent, header, *kv, md=None):
    chunks = [pb.ImportChunk(header=header), *(pb.ImportChunk(kv=c) for c in kv)]
    with grpc.insecure_channel(agent.grpc_addr) as ch:
        return list(node_agent_pb2_grpc.NodeAgentStub(ch).ImportRequest(
            iter(chunks), metadata=md or token(Role.AGENT), timeout=60))


def _import_refused(agent, header, *kv, code=grpc.StatusCode.INVALID_ARGUMENT):
    with pytest.raises(grpc.RpcError) as e:
        _import(agent, header, *kv)
    assert e.value.code() == code, e.value.details()
    return e.value.details()


def _layout(agent):
    d = agent.describe()
    return d.engine.block_size, d.model


def _kv(agent, tokens: int, value=0.0) -> bytes:
    """A payload of this engine's layout: per layer [blocks, KV heads, block size, 2·head]."""
    bs, m = _layout(agent)
    blocks = -(-(tokens - 1) // bs)
    return save({f"L{i}": np.full((blocks, m.num_kv_heads, bs, 2 * m.head_size), value,
                                  np.float32)
                 for i in range(m.num_layers)})


def _header(agent, ids, out=(), kv=b"", **kw):
    bs, _ = _layout(agent)
    h = dict(request_id=f"imp-{time.monotonic_ns()}", prompt_token_ids=ids,
             output_token_ids=list(out), max_tokens=len(out) + 4, temperature=0.0,
             ignore_eos=True, kv_bytes=len(kv), block_size=bs if kv else 0)
    h.update(kw)
    return pb.ImportHeader(**h)


def test_import_needs_an_agent_or_the_controller(agent):
    ids = list(range(3, 30))
    for md, code in ((token(Role.OPERATOR), grpc.StatusCode.PERMISSION_DENIED),
                     ((), grpc.StatusCode.UNAUTHENTICATED)):
        with pytest.raises(grpc.RpcError) as e:
            with grpc.insecure_channel(agent.grpc_addr) as ch:
                list(node_agent_pb2_grpc.NodeAgentStub(ch).ImportRequest(
                    iter([pb.ImportChunk(header=_header(agent, ids))]), metadata=md or None,
                    timeout=30))
        assert e.value.code() == code


def test_hostile_imports_are_invalid_arguments_and_the_engine_keeps_serving(agent, tmp_path):
    ids, out = list(range(3, 40)), [7, 8, 9]
    good = _kv(agent, len(ids) + len(out))
    rnd = np.random.default_rng(1)
    # 1 MiB of random "KV" (what used to kill the engine)
    mib = rnd.bytes(1 << 20)
    assert "is not the size of" in _import_refused(agent, _header(agent, ids, out, mib), mib)
    # random bytes of exactly the size this model's KV takes
    same = rnd.bytes(len(good))
    assert "header length" in _import_refused(agent, _header(agent, ids, out, same), same)
    # a well-formed payload holding NaNs
    nan = _kv(agent, len(ids) + len(out), value=float("nan"))
    assert "NaN" in _import_refused(agent, _header(agent, ids, out, nan), nan)
    # more bytes than announced
    assert "exceeds" in _import_refused(agent, _header(agent, ids, out, good), good, b"x" * 64)
    # the request id never becomes a path
    pwn = f"../../../../{tmp_path}/pwn"
    assert "request_id" in _import_refused(agent, _header(agent, ids, out, good,
                                                          request_id=pwn), good)
    assert not list(tmp_path.iterdir())
    # tokens the model does not have, a budget beyond max_model_len, a NaN temperature
    assert "vocabulary" in _import_refused(agent, _header(agent, [1, 2, 10**9]))
    assert "max_model_len" in _import_refused(agent, _header(agent, ids, max_tokens=10**6))
    assert "temperature" in _import_refused(agent, _header(agent, ids, temperature=float("nan")))
    still_serving(agent)


def test_a_well_formed_import_runs(agent):
    ids, out = list(range(3, 40)), [7, 8, 9]
    kv = _kv(agent, len(ids) + len(out))
    events = _import(agent, _header(agent, ids, out, kv, max_tokens=len(out) + 3), kv)
    assert events[0].loaded_tokens == len(ids) + len(out) - 1
    assert events[-1].finished and sum(len(e.token_ids) for e in events) == 3
    # recompute (no KV) too
    events = _import(agent, _header(agent, ids, out))
    assert events[-1].finished and sum(len(e.token_ids) for e in events) == 4
    still_serving(agent)


def _int8_kv(agent, tokens: int, q=1, scale=0.01) -> bytes:
    """An INT8 payload of this engine's layout: per layer ``L<i>`` int8 and ``L<i>.scale``."""
    bs, m = _layout(agent)
    blocks = -(-(tokens - 1) // bs)
    t = {}
    for i in range(m.num_layers):
        t[f"L{i}"] = np.full((blocks, m.num_kv_heads, bs, 2 * m.head_size), q, np.int8)
        t[f"L{i}.scale"] = np.full((blocks, m.num_kv_heads), scale, np.float32)
    return save(t)


def test_hostile_int8_imports_are_invalid_arguments_and_the_engine_keeps_serving(agent):
    ids, out = list(range(3, 40)), [7, 8, 9]
    n = len(ids) + len(out)
    i8 = {"kv_format": pb.KV_FORMAT_INT8}
    # scales that are NaN, infinite, negative, or too large for the engine's dtype
    for scale in (float("nan"), float("inf"), -1.0, 1e37):
        bad = _int8_kv(agent, n, scale=scale)
        assert "L0.scale" in _import_refused(agent, _header(agent, ids, out, bad, **i8), bad)
    # a zero scale over a group that is not zero; -128 (the quantiser never makes it)
    bad = _int8_kv(agent, n, q=3, scale=0.0)
    assert "is 0 where" in _import_refused(agent, _header(agent, ids, out, bad, **i8), bad)
    bad = _int8_kv(agent, n, q=-128)
    assert "-128" in _import_refused(agent, _header(agent, ids, out, bad, **i8), bad)
    # the full format's size announced as INT8, an INT8 payload cut short, an unknown format
    full = _kv(agent, n)
    assert "is not the size" in _import_refused(agent, _header(agent, ids, out, full, **i8),
                                                 full)
    good = _int8_kv(agent, n)
    assert "incomplete" in _import_refused(agent, _header(agent, ids, out, good, **i8),
                                           good[:-1])
    assert "kv_format" in _import_refused(agent, _header(agent, ids, out, good, kv_format=9),
                                          good)
    # a well-formed INT8 payload is dequantised and runs
    events = _import(agent, _header(agent, ids, out, good, max_tokens=len(out) + 3, **i8), good)
    assert events[0].loaded_tokens == n - 1
    assert events[-1].finished and sum(len(e.token_ids) for e in events) == 3
    still_serving(agent)


def test_kv_transfer_params_from_http_never_reach_the_connector(agent):
    # an OpenAI client naming a file for the import connector: an ordinary request
    for path in ("/etc/passwd", f"/tmp/import-{'0' * 32}.safetensors"):
        r = complete(agent, kv_transfer_params={"remp_import": path, "tokens": 3})
        assert r.status_code == 200, r.text
    still_serving(agent)


# ---------------------------------------------------------------------------- MigrateRequest

def _migrate(agent, md=None, **kw):
    with grpc.insecure_channel(agent.grpc_addr) as ch:
        return list(node_agent_pb2_grpc.NodeAgentStub(ch).MigrateRequest(
            pb.MigrateRequestRequest(**kw), metadata=md or token(Role.CONTROLLER), timeout=60))


def test_migrate_request_goes_only_to_allowed_targets(agent, targets):
    cases = [
        # not a peer, and no controller to ask: nothing is sent
        ({"target_address": targets["other"].addr}, None,
         grpc.StatusCode.FAILED_PRECONDITION, "not one of this agent's migration peers"),
        # a peer whose certificate is not from our CA: the TLS handshake fails
        ({"target_address": targets["rogue"].addr}, None, grpc.StatusCode.UNAVAILABLE,
         "certificate"),
        # roles: an agent may not move requests; anonymous callers may do nothing
        ({"target_address": targets["good"].addr}, token(Role.AGENT),
         grpc.StatusCode.PERMISSION_DENIED, "not allowed for role agent"),
        ({"target_address": "no-port"}, None, grpc.StatusCode.INVALID_ARGUMENT, "host:port"),
    ]
    for kw, md, code, msg in cases:
        with pytest.raises(grpc.RpcError) as e:
            _migrate(agent, md, request_id="nope", **kw)
        assert e.value.code() == code and msg in e.value.details(), e.value.details()
    assert not targets["other"].calls and not targets["rogue"].calls


def test_migrated_request_is_relayed_over_mtls_with_the_agents_credential(agent, targets, pki):
    async def go():
        await arm_migration(agent.grpc_addr, wait_output_tokens=5)  # test-only gate
        async with httpx.AsyncClient(timeout=300, headers=HTTP_AUTH) as c, \
                aio_channel(agent.grpc_addr, Credentials.load().only(Role.OPERATOR)) as ch:
            call = node_agent_pb2_grpc.NodeAgentStub(ch).MigrateRequest(pb.MigrateRequestRequest(
                target_address=targets["good"].addr, target_node="target-ok",
                mode=pb.RECOVERY_MODE_RECOMPUTE), timeout=300)
            await asyncio.sleep(0.2)  # the agent's gate waits for the request below
            client = asyncio.create_task(c.post(f"{agent.http}/v1/completions", json={
                "model": "tiny", "prompt": prompt(2, 60), "max_tokens": 100,
                "temperature": 0.0, "ignore_eos": True}))
            events = [ev async for ev in call]
            return await client, events
    r, events = asyncio.run(go())
    d = events[0].decision
    assert d.action == T.RECOVERY_ACTION_RECOMPUTE and d.target_node == "target-ok"
    assert [t for e in events[1:] for t in e.token_ids] == RELAYED
    # the target saw this agent: its own credential, its client certificate (mutual TLS)
    (call,) = targets["good"].calls
    assert call["metadata"]["authorization"] == f"Bearer {Credentials.load().tokens[Role.AGENT]}"
    assert call["cn"] == ["agent-sec"]
    # the client (with the API key) got the target's tokens in its one response
    assert r.status_code == 200, r.text
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    assert usage["completion_tokens"] == d.tokens - usage["prompt_tokens"] + len(RELAYED)
    assert choice["finish_reason"] == "length"
    still_serving(agent)


# ---------------------------------------------------------------------------- engine death

def test_dead_engine_is_restarted_in_process(agent):
    old = agent.describe().engine.engine_core_pid
    assert old > 0
    os.kill(old, signal.SIGKILL)
    seen, deadline = set(), time.monotonic() + 240
    while True:
        assert agent.proc.poll() is None, agent.log_tail()
        try:
            h = agent.health()
        except grpc.RpcError:
            h = "?"
        seen.add(h)
        if h == "SERVING" and "NOT_SERVING" in seen:
            break
        assert time.monotonic() < deadline, agent.log_tail()
        time.sleep(0.2)
    assert agent.describe().engine.engine_core_pid not in (0, old)
    assert complete(agent).status_code == 200
    events = [r.get("event") for r in agent.log_records()]
    assert "agent.engine_dead" in events and "agent.engine_restarted" in events

    async def stream():
        async with httpx.AsyncClient(timeout=300, headers=HTTP_AUTH) as c:
            return await stream_completion(c, agent.http, prompt(1, 20), 4)
    assert asyncio.run(stream())  # the API key still applies to the new engine's app
    assert httpx.post(f"{agent.http}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "t5", "max_tokens": 2}).status_code == 401
