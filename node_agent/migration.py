"""Cross-host request migration between node agents (the agent side; decisions are pure, in
:mod:`remp.recovery`).

Source (``migrate_out``): check the target is a node this agent may send requests to (registered
with the controller, or one of ``--migration-peers``), decide MIGRATE / RECOMPUTE / ABORT for the
request from measured costs (bandwidth EWMA per target, throttle, prefill table), take it out of
the engine (a short pause), send it to the target's ``ImportRequest`` — state, plus the KV payload
when migrating — over a link that carries this agent's own credential (and mutual TLS when
configured), and relay the continuation. Target (``import_in``): check the header and the
payload (:func:`check_header`, :func:`check_payload`: pure, before anything reaches the engine),
keep the payload in a private directory under a generated name, continue the request in its
engine (the remp import connector loads the KV), stream the tokens back.
"""

from __future__ import annotations

import asyncio
import math
import mmap
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import grpc

from node_agent.faults import NO_MIGRATION_FAULT
from node_agent.kv import int8
from node_agent.kv.codec import (FULL, INT8, KV_DTYPES, ImportLimits, ImportPlan, check_payload,
                                 kv_bytes_estimate)
from remp import logs, validate
from remp.auth import Role, aio_channel, channel_tls
from remp.errors import (FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                         ResourceExhausted, Unavailable)
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.grpc_util import channel_options
from remp.node_agent.v1 import node_agent_pb2 as pb
from remp.node_agent.v1 import node_agent_pb2_grpc
from remp.recovery import (Action, BandwidthEstimator, DisplacedRequest, KvFormat, PrefillTable,
                           RecoveryConfig, decide, int8_payload_bytes)

log = logs.get_logger("remp.node_agent.migration")
CHUNK = 256 * 1024
ACTIONS = {Action.MIGRATE: types_pb2.RECOVERY_ACTION_MIGRATE, Action.RECOMPUTE: types_pb2.RECOVERY_ACTION_RECOMPUTE,
           Action.ABORT: types_pb2.RECOVERY_ACTION_ABORT}
# ImportHeader.kv_format → payload format (UNSPECIFIED: a sender from before INT8, full width)
KV_FORMATS = {pb.KV_FORMAT_UNSPECIFIED: FULL, pb.KV_FORMAT_FULL: FULL, pb.KV_FORMAT_INT8: INT8}
KV_INT8_MODES = {pb.KV_INT8_MODE_OFF: "off", pb.KV_INT8_MODE_ON: "on",
                 pb.KV_INT8_MODE_AUTO: "auto"}
# quantise + dequantise seconds per byte of full-width KV: the codec's time in the cost model
# (quantize_file + dequantize_file, files included, 0.5-4 MiB payloads of the tiny model on this
# 2-core CPU host, fp32 and bf16: 1.9-2.5e-8; docs/int8_kv.md). Auto picks INT8 below ~38 MB/s
# (fp32) or ~25 MB/s (bf16)
INT8_CODEC_S_PER_BYTE = 2e-8


@dataclass
class MigrationState:
    """What the agent keeps between migrations: the bandwidth it measured per target and the
    prefill table it decides with."""

    bandwidth: BandwidthEstimator = field(default_factory=BandwidthEstimator)
    prefill: PrefillTable | None = None
    bandwidth_limit_bps: float = 0.0
    max_concurrent: int = 32
    active: int = 0
    importing: int = 0  # ImportRequests holding a slot (payload received or being continued)
    tasks: set = field(default_factory=set)  # continuations being relayed to local clients


# ---------------------------------------------------------------------------- import checks (pure)

MAX_TEMPERATURE = 100.0
MAX_ADDRESS = 255


def _bad(msg: str) -> InvalidArgument:
    return InvalidArgument(f"ImportRequest: {msg}")


def check_header(h: pb.ImportHeader, lim: ImportLimits) -> ImportPlan:
    """Everything the header claims, checked against this agent before any byte of payload is
    read or anything reaches the engine. Raises InvalidArgument (FailedPrecondition for a KV
    block size this engine does not use)."""
    validate.name("request_id", h.request_id, required=True)
    prompt, out = h.prompt_token_ids, h.output_token_ids
    if not prompt:
        raise _bad("prompt_token_ids is required")
    if h.max_tokens < 1:
        raise _bad("max_tokens (the original request's) is required")
    if len(prompt) + h.max_tokens > lim.max_model_len:
        raise _bad(f"{len(prompt)} prompt tokens + max_tokens {h.max_tokens} exceed this "
                   f"agent's max_model_len {lim.max_model_len}")
    if len(out) >= h.max_tokens:
        raise _bad(f"{len(out)} output tokens already reach max_tokens {h.max_tokens}: "
                   "nothing is left to generate")
    if lim.vocab_size <= 0:
        raise FailedPrecondition("this model's vocabulary size is unknown (config.json has no "
                                 "vocab_size): imports are refused")
    top = max(max(prompt), max(out, default=0))
    if top >= lim.vocab_size:
        raise _bad(f"token id {top} is outside this model's vocabulary "
                   f"(0..{lim.vocab_size - 1})")
    t = h.temperature
    if not math.isfinite(t) or not 0.0 <= t <= MAX_TEMPERATURE:
        raise _bad(f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}] (got {t})")
    fmt = KV_FORMATS.get(h.kv_format)
    if fmt is None:
        raise _bad(f"kv_format {h.kv_format} is not a known KV payload format")
    if not h.kv_bytes:
        return ImportPlan(h.request_id, 0)
    if lim.block_size <= 0:
        raise FailedPrecondition("the engine is not ready for KV imports yet")
    if h.block_size != lim.block_size:
        raise FailedPrecondition(f"KV from block size {h.block_size} cannot load into block "
                                 f"size {lim.block_size}; migrate with RECOMPUTE")
    if lim.kv_dtype not in KV_DTYPES:
        raise FailedPrecondition(f"this engine's KV dtype {lim.kv_dtype} cannot be imported; "
                                 "migrate with RECOMPUTE")
    tokens = len(prompt) + len(out)
    if tokens < 2:
        raise _bad("a KV payload needs at least 2 tokens (it holds all but the last)")
    block_bytes, max_header = lim.format_block_bytes(fmt), lim.format_max_header_bytes(fmt)
    blocks = tuple(b for b in lim.blocks_for(tokens)
                   if 2 <= h.kv_bytes - 8 - b * block_bytes <= max_header)
    if not blocks:
        want = [8 + b * block_bytes for b in lim.blocks_for(tokens)]
        raise _bad(f"kv_bytes {h.kv_bytes} is not the size of {tokens - 1} tokens of this "
                   f"model's KV in format {fmt} ({' or '.join(map(str, want))} bytes of "
                   f"tensors plus a safetensors header of at most {max_header} bytes)")
    return ImportPlan(h.request_id, h.kv_bytes, blocks, fmt)




# ---------------------------------------------------------------------------- migration targets

def check_address(field_name: str, value: str) -> str:
    host, _, port = value.rpartition(":")
    if (len(value) > MAX_ADDRESS or not host or not port.isdigit()
            or not 0 < int(port) < 65536 or not value.isprintable() or " " in value):
        raise InvalidArgument(f"{field_name} must be host:port (at most {MAX_ADDRESS} "
                              f"characters), got {value[:32]!r}")
    return value


def match_target(nodes: Iterable[tuple[str, str]], target_node: str, target_address: str,
                 self_node: str) -> tuple[str, str]:
    """(node, address) of the registered node a MigrateRequest names — by name (its registered
    address is used; a different ``target_address`` is refused) or by address. Pure.
    Raises PermissionDenied when it is no registered node."""
    nodes = list(nodes)
    if target_node:
        addr = next((a for n, a in nodes if n == target_node), None)
        if addr is None:
            raise PermissionDenied(f"target node {target_node!r} is not registered with the "
                                   "controller: requests go only to registered nodes")
        if target_address and target_address != addr:
            raise PermissionDenied(f"target_address {target_address!r} is not the address node "
                                   f"{target_node!r} registered ({addr})")
        name = target_node
    else:
        name = next((n for n, a in nodes if a == target_address), None)
        if name is None:
            raise PermissionDenied(f"target {target_address!r} is not the address of a node "
                                   "registered with the controller: requests go only to "
                                   "registered nodes")
        addr = target_address
    if name == self_node:
        raise FailedPrecondition(f"target {name} is this node")
    return name, addr


async def resolve_target(agent, request: pb.MigrateRequestRequest) -> tuple[str, str]:
    """Where a MigrateRequest may send the request: (node name, address). A ``--migration-peers``
    address as given; otherwise a node the controller has registered (asked with this agent's
    credential). Nothing is sent anywhere else."""
    s = agent.cfg.settings
    addr, node = request.target_address, request.target_node
    if addr and addr in (s.migration_peers or ()):
        return node or addr, addr
    if not s.controller:
        raise FailedPrecondition(
            f"target {addr or node!r} is not one of this agent's migration peers and the agent "
            "has no controller to ask whether it is a registered node (set --migration-peers "
            "or --controller)")
    resp, code = None, ""
    for ctl in s.controller.split(","):  # any controller answers reads (controller HA)
        try:
            async with aio_channel(ctl, agent.cfg.credentials.only(Role.AGENT),
                                   options=channel_options()) as ch:
                resp = await controller_pb2_grpc.ControllerStub(ch).ListNodes(
                    controller_pb2.ListNodesRequest(), timeout=5)
            break
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
    if resp is None:
        raise Unavailable(f"cannot ask the controller {s.controller} whether the target is a "
                          f"registered node ({code}); the request stays here")
    return match_target(((n.node, n.agent_address) for n in resp.nodes), node, addr, s.node)


def peer_channel_credentials(settings) -> grpc.ChannelCredentials | None:
    """TLS for agent-to-agent links: the target's certificate checked against ``peer_tls_ca``;
    with ``tls_client_cert`` this agent presents its own (mutual TLS)."""
    if not settings.peer_tls_ca:
        return None
    return channel_tls(settings.peer_tls_ca, settings.tls_client_cert, settings.tls_client_key)


def decide_one(st: MigrationState, info: dict, kv_bytes: int, mode: int, limit_bps: float,
               budget_s: float | None, src: str, dst: str, kv_int8: str = "off",
               int8_bytes: int | None = None,
               ) -> tuple[types_pb2.RecoveryDecision, KvFormat, int]:
    """The request's decision, and how a MIGRATE sends its KV: (decision, format, predicted
    payload bytes). ``kv_int8``: off / on / auto (:class:`RecoveryConfig`); ``int8_bytes``: the
    request's INT8 payload (:func:`int8_payload_bytes`)."""
    tokens = info["prompt_tokens"] + info["output_tokens"]
    req = DisplacedRequest(info["request_id"], kv_bytes, tokens, budget_s=budget_s,
                           remaining_tokens=max(0, info["max_tokens"] - info["output_tokens"]),
                           src=src, dst=dst, int8_bytes=int8_bytes)
    cap = limit_bps or st.bandwidth_limit_bps or None
    prefill = st.prefill or PrefillTable.fit([(1, 0.0), (2, 0.0)])
    d = decide([req], prefill, st.bandwidth, RecoveryConfig(
        max_concurrent_migrations=st.max_concurrent, bandwidth_cap_bps=cap, kv_int8=kv_int8,
        int8_codec_s_per_byte=INT8_CODEC_S_PER_BYTE),
        busy_slots=[1.0] * st.active)[0]
    action, reason = d.action, d.reason.value
    if mode == pb.RECOVERY_MODE_MIGRATE and action is not Action.ABORT:
        action, reason = Action.MIGRATE, "forced_migrate"
    elif mode == pb.RECOVERY_MODE_RECOMPUTE and action is not Action.ABORT:
        action, reason = Action.RECOMPUTE, "forced_recompute"
    elif st.prefill is None and action is Action.RECOMPUTE:
        action, reason = Action.MIGRATE, "no_prefill_table"
    return types_pb2.RecoveryDecision(
        request_id=info["request_id"], action=ACTIONS[action], reason=reason,
        migrate_seconds=d.migrate_s, recompute_seconds=d.recompute_s,
        bandwidth_bps=d.bandwidth_bps, kv_bytes=kv_bytes, tokens=tokens,
        retry_after_seconds=d.retry_after_s or 0, source_node=src, target_node=dst,
        detail=d.detail), d.kv_format, d.payload_bytes


async def _throttled(chunks: list[bytes], header: pb.ImportHeader, rate_bps: float,
                     ) -> AsyncIterator[pb.ImportChunk]:
    yield pb.ImportChunk(header=header)
    t0, sent = time.perf_counter(), 0
    for c in chunks:
        if rate_bps:
            ahead = sent / rate_bps - (time.perf_counter() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
        sent += len(c)
        yield pb.ImportChunk(kv=c)


async def _wait_for_request(agent, rid: str, tokens: int, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in await agent.engine.list_requests():
            if r["status"] == "RUNNING" and r["output_tokens"] >= tokens and rid in ("", r["request_id"]):
                return r["request_id"]
        await asyncio.sleep(0.002)
    raise FailedPrecondition(f"no running request reached {tokens} output tokens in {timeout:.0f} s")


async def migrate_out(agent, request: pb.MigrateRequestRequest) -> AsyncIterator[pb.MigrateRequestEvent]:
    st: MigrationState = agent.migration
    node = agent.cfg.settings.node
    # a test-only control armed through the FaultInjection service (that setting only); the
    # call takes it whatever happens next, so a refused call leaves nothing armed behind
    armed = (agent.faults.take_migration(request.request_id) if agent.faults is not None
             else NO_MIGRATION_FAULT)
    wait_tokens = armed.wait_output_tokens
    if not (request.target_address or request.target_node) or not (request.request_id
                                                                      or wait_tokens):
        raise InvalidArgument("request_id and target_address (or target_node) are required")
    validate.name("request_id", request.request_id)
    validate.name("target_node", request.target_node)
    for name in ("bandwidth_limit_bps", "slo_budget_seconds"):
        v = getattr(request, name)
        if not math.isfinite(v) or v < 0:
            raise InvalidArgument(f"{name} must be a finite number >= 0 (got {v})")
    if request.mode not in pb.RecoveryMode.values():
        raise InvalidArgument(f"unknown mode {request.mode}")
    if request.kv_int8 not in pb.KvInt8Mode.values():
        raise InvalidArgument(f"unknown kv_int8 {request.kv_int8}")
    kv_int8 = KV_INT8_MODES.get(request.kv_int8, agent.cfg.settings.kv_int8)
    if request.target_address:
        check_address("target_address", request.target_address)
    rid = request.request_id
    # only to a registered node (or a configured peer): nothing is sent before this
    dst, address = await resolve_target(agent, request)
    channel = aio_channel(address, agent.cfg.credentials.only(Role.AGENT),
                          channel_credentials=peer_channel_credentials(agent.cfg.settings),
                          options=channel_options())
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout=5)
    except asyncio.TimeoutError:
        await channel.close()
        raise Unavailable(f"target agent {address} unreachable (or its TLS certificate was "
                          f"not accepted); the request stays here") from None
    try:
        if wait_tokens:
            rid = await _wait_for_request(agent, rid, wait_tokens)
        elif rid not in {r["request_id"] for r in await agent.engine.list_requests()}:
            raise NotFound(f"no request {rid!r} in this engine")
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(agent.cfg.dtype, 4)

        def choose(info: dict):
            if info["status"] != "RUNNING":
                raise FailedPrecondition(f"request {rid} is {info['status']}, not RUNNING")
            shape = agent.cfg.model.shape
            kv = kv_bytes_estimate(info["blocks"], shape, agent.block_size, dtype_bytes)
            i8 = int8_payload_bytes(kv, dtype_bytes, agent.block_size * 2 * shape.head_size)
            d, fmt, payload_bytes = decide_one(
                st, info, kv, request.mode, request.bandwidth_limit_bps,
                request.slo_budget_seconds or None, node, dst, kv_int8, i8)
            d = (d, fmt, payload_bytes)
            if d[0].action == types_pb2.RECOVERY_ACTION_ABORT:
                return d, None
            return d, d[0].action == types_pb2.RECOVERY_ACTION_MIGRATE

        async with agent.engine_exclusive():
            (decision, kv_format, payload_bytes), state = await agent.engine.take_out(
                rid, agent.state_dir, choose)
    except (FailedPrecondition, NotFound, InvalidArgument):
        await channel.close()
        raise
    except KeyError as exc:
        await channel.close()
        raise NotFound(str(exc).strip("'\"")) from None
    except Exception as exc:  # noqa: BLE001 - it stays where it was
        await channel.close()
        raise FailedPrecondition(f"could not take request {rid} out of the engine: {exc}") from None
    log.info("migration.decided", request_id=rid, target=dst,
             action=types_pb2.RecoveryAction.Name(decision.action), reason=decision.reason,
             migrate_s=round(decision.migrate_seconds, 6),
             recompute_s=round(decision.recompute_seconds, 6), kv_bytes=decision.kv_bytes,
             kv_format=kv_format.value, payload_bytes=payload_bytes)
    migrating = decision.action == types_pb2.RECOVERY_ACTION_MIGRATE
    fmt_pb = (pb.KV_FORMAT_INT8 if migrating and kv_format is KvFormat.INT8
              else pb.KV_FORMAT_FULL)
    if state is not None:
        state["kv_format"] = fmt_pb
    # The request has left the engine core; its client waits on this node's front end. Settle
    # that before the first yield (a caller that goes away closes this generator there): a
    # drop answers the client now, a move runs in a task of its own that relays the
    # continuation to the client whether or not the caller (the controller) stays to watch.
    events: asyncio.Queue = asyncio.Queue()
    if state is None:  # ABORT: retryable; the client gets 503 + Retry-After (or a stream error)
        agent.engine.fail_request(
            rid, f"request {rid} could not be moved off node {node} within its budget "
            f"({decision.reason}); retry", decision.retry_after_seconds or 1)
        await channel.close()
    else:
        task = asyncio.create_task(_continue_elsewhere(agent, channel, rid, dst, decision, state,
                                                       request, events, armed.poison_kv))
        st.tasks.add(task)
        task.add_done_callback(st.tasks.discard)
    yield pb.MigrateRequestEvent(decision=decision, kv_format=fmt_pb,
                                 payload_bytes=(payload_bytes if fmt_pb == pb.KV_FORMAT_INT8
                                                else decision.kv_bytes) if migrating else 0)
    if state is None:
        return
    while True:
        ev = await events.get()
        if ev is None:
            return
        if isinstance(ev, Exception):
            raise ev
        yield ev


async def _continue_elsewhere(agent, channel, rid: str, dst: str, decision, state: dict,
                              request: pb.MigrateRequestRequest, events: asyncio.Queue,
                              poison_kv: bool = False) -> None:
    """Send the request (state, KV payload when migrating) to the target's ImportRequest; relay
    each continuation event to this node's client (:meth:`EngineHandle.relay`) and to
    ``events``. The client's stream ends with the target's finish, or with a retryable error
    when the target fails; if the client goes away (or a stop string ends it here) the import is
    cancelled and the target drops the request."""
    st: MigrationState = agent.migration
    node = agent.cfg.settings.node
    migrate = decision.action == types_pb2.RECOVERY_ACTION_MIGRATE
    kv_format = state.get("kv_format", pb.KV_FORMAT_FULL)
    rate = request.bandwidth_limit_bps or st.bandwidth_limit_bps
    st.active += 1 if migrate else 0
    t0 = time.perf_counter()
    first, ended, call = True, False, None
    try:
        chunks, quantize_s = await asyncio.get_running_loop().run_in_executor(
            None, _payload_chunks, state.get("payload"), kv_format, poison_kv)
        header = pb.ImportHeader(
            request_id=rid, prompt_token_ids=state["prompt_token_ids"],
            output_token_ids=state["output_token_ids"], max_tokens=state["max_tokens"],
            temperature=state["temperature"], ignore_eos=state["ignore_eos"],
            kv_bytes=sum(len(c) for c in chunks), block_size=state["block_size"],
            kv_format=kv_format if chunks else pb.KV_FORMAT_FULL)
        stub = node_agent_pb2_grpc.NodeAgentStub(channel)
        call = stub.ImportRequest(_throttled(chunks, header, rate), timeout=3600)
        async for ev in call:
            ev_out = pb.MigrateRequestEvent(token_ids=ev.token_ids, text=ev.text,
                                            finished=ev.finished, finish_reason=ev.finish_reason)
            if first:
                first = False
                took = time.perf_counter() - t0
                ev_out.transfer_seconds, ev_out.export_seconds = took, state["paused_seconds"]
                ev_out.receive_seconds = ev.receive_seconds
                ev_out.kv_format, ev_out.payload_bytes = header.kv_format, header.kv_bytes
                # the link's bandwidth: unthrottled transfers only (a throttle is a cap the
                # decision applies on its own), timed by the receiver
                if migrate and header.kv_bytes and not rate and ev.receive_seconds > 0:
                    st.bandwidth.observe(node, dst, header.kv_bytes, ev.receive_seconds)
                log.info("migration.transferred", request_id=rid,
                         kv_bytes=header.kv_bytes, kv_format=pb.KvFormat.Name(header.kv_format),
                         quantize_s=round(quantize_s, 4), seconds=round(took, 4),
                         paused_s=round(state["paused_seconds"], 4))
            vocab = agent.cfg.model.vocab_size
            if vocab and any(t >= vocab for t in ev.token_ids):
                raise Unavailable(f"target {dst} sent token ids outside the vocabulary")
            wants_more = agent.engine.relay(rid, list(ev.token_ids),
                                            ev.finish_reason if ev.finished else "")
            if ev.finished:
                ended = True
            elif not wants_more:  # the client went away, or a stop string ended it here
                ended = True
                log.info("migration.client_done", request_id=rid, target=dst)
                ev_out.finished, ev_out.finish_reason = True, "client"
            events.put_nowait(ev_out)
            if ended:
                break
        if not ended:
            raise Unavailable(f"the continuation on {dst} ended without finishing")
    except grpc.aio.AioRpcError as exc:
        events.put_nowait(Unavailable(f"target agent failed during import: {exc.details()}"))
    except Unavailable as exc:
        events.put_nowait(exc)
    except asyncio.CancelledError:
        events.put_nowait(Unavailable("the agent is shutting down"))
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the caller, the client gets a 503
        log.error("migration.relay_failed", request_id=rid, error=repr(exc))
        events.put_nowait(Unavailable(f"relaying the continuation failed: {exc}"))
    finally:
        if call is not None:
            call.cancel()  # no-op when it finished; otherwise the target drops the request
        if not ended:
            agent.engine.fail_request(rid, f"request {rid} moved to node {dst}, which could not "
                                      "continue it; retry")
        st.active -= 1 if migrate else 0
        await channel.close()
        events.put_nowait(None)


def _payload_chunks(payload: str | None, kv_format: int, poison_kv: bool,
                    ) -> tuple[list[bytes], float]:
    """The exported payload file (removed) as chunks to send — quantised first when the format
    is INT8 — and the seconds quantising took. Blocking: run on an executor thread."""
    if not payload:
        return [], 0.0
    t0 = time.perf_counter()
    try:
        if kv_format == pb.KV_FORMAT_INT8:
            payload = int8.quantize_file(payload, payload.removesuffix(".safetensors")
                                         + ".int8.safetensors")
        quantize_s = time.perf_counter() - t0
        with open(payload, "rb") as f:
            data = f.read()
    finally:
        if os.path.exists(payload):
            os.unlink(payload)
    if poison_kv:  # test-only control: same size, KV zeroed (header valid)
        head = 8 + int.from_bytes(data[:8], "little")
        data = data[:head] + bytes(len(data) - head)
    return [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)], quantize_s


async def import_in(agent, chunks: AsyncIterator[pb.ImportChunk]) -> AsyncIterator[pb.ImportEvent]:
    """Continue a request that started elsewhere. The header and the payload are checked in full
    (:func:`check_header`, :func:`check_payload`) before anything reaches the engine; the payload
    lives in the agent's private import directory under a generated name while the engine loads
    it. At most ``max_concurrent_migrations`` imports at once (RESOURCE_EXHAUSTED beyond)."""
    it = chunks.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        raise InvalidArgument("ImportRequest needs a header chunk") from None
    if not first.HasField("header"):
        raise InvalidArgument("the first ImportRequest chunk must carry the header")
    if first.kv:
        raise InvalidArgument("the header chunk carries no KV bytes")
    h = first.header
    lim = agent.import_limits()
    plan = check_header(h, lim)
    if agent.status not in ("serving", "switching"):
        raise FailedPrecondition(f"engine is {agent.status}, not serving")
    st: MigrationState = agent.migration
    if st.importing >= st.max_concurrent:
        raise ResourceExhausted(f"{st.importing} imports are running (at most "
                                f"{st.max_concurrent}); retry later")
    st.importing += 1
    payload, t0 = None, time.perf_counter()
    try:
        if plan.kv_bytes:
            s = agent.cfg.settings
            payload = await _receive_payload(
                agent.import_dir, it, plan.kv_bytes,
                s.import_receive_seconds + plan.kv_bytes / s.import_min_receive_bps)
            await asyncio.get_running_loop().run_in_executor(
                None, _check_payload_file, payload, plan, lim)
            if plan.kv_format == INT8:  # into the engine's dtype: what the connector loads
                payload = await asyncio.get_running_loop().run_in_executor(
                    None, _dequantize_payload_file, payload, lim)
        if agent.status not in ("serving", "switching"):
            raise FailedPrecondition(f"engine is {agent.status}, not serving")
        received = time.perf_counter()
        sent_text, sent_tokens, first_ev = 0, 0, True
        async for out in agent.engine.import_request(
                h.request_id, list(h.prompt_token_ids), list(h.output_token_ids), h.max_tokens,
                h.temperature, h.ignore_eos, payload):
            o = out.outputs[0]
            ev = pb.ImportEvent(token_ids=list(o.token_ids[sent_tokens:]), text=o.text[sent_text:],
                                finished=out.finished, finish_reason=o.finish_reason or "")
            if first_ev:
                ev.loaded_tokens = (len(h.prompt_token_ids) + len(h.output_token_ids) - 1
                                    if payload else 0)
                ev.receive_seconds = received - t0
                first_ev = False
                log.info("migration.imported", request_id=h.request_id, kv_bytes=h.kv_bytes,
                         kv_format=plan.kv_format,
                         receive_s=round(received - t0, 4),
                         first_token_s=round(time.perf_counter() - received, 4))
            sent_tokens, sent_text = len(o.token_ids), len(o.text)
            yield ev
    finally:
        st.importing -= 1
        if payload and os.path.exists(payload):
            os.unlink(payload)


async def _receive_payload(directory: str, it, kv_bytes: int,
                           deadline_s: float = float("inf")) -> str:
    """The KV chunks into a new 0600 file with a generated name in ``directory`` (the agent's
    private import directory); refused as soon as they pass ``kv_bytes``, or when they have not
    all arrived within ``deadline_s`` (UNAVAILABLE: the sender or its link is too slow; the
    import slot is freed). Returns its path."""
    path = os.path.join(directory, f"import-{uuid.uuid4().hex}.safetensors")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    got, ok = 0, False
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                async with asyncio.timeout(deadline_s if math.isfinite(deadline_s) else None):
                    async for c in it:
                        if c.HasField("header"):
                            raise InvalidArgument("ImportRequest: only the first chunk carries "
                                                  "a header")
                        got += len(c.kv)
                        if got > kv_bytes:
                            raise InvalidArgument(f"ImportRequest: KV payload exceeds the "
                                                  f"announced kv_bytes {kv_bytes}")
                        f.write(c.kv)
            except TimeoutError:
                raise Unavailable(f"ImportRequest: {got} of {kv_bytes} KV bytes arrived in "
                                  f"{deadline_s:.0f} s; the sender is too slow (retry, or "
                                  "RECOMPUTE)") from None
        if got != kv_bytes:
            raise InvalidArgument(f"KV payload incomplete: {got} of {kv_bytes} bytes")
        ok = True
        return path
    finally:
        if not ok:
            os.unlink(path)


def _check_payload_file(path: str, plan: ImportPlan, lim: ImportLimits) -> None:
    """:func:`check_payload` on the received file (mapped, read-only); removes it if refused."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            check_payload(m, plan, lim)
    except Exception:
        os.unlink(path)
        raise


def _dequantize_payload_file(path: str, lim: ImportLimits) -> str:
    """A checked INT8 payload as a payload of the engine's KV dtype under a new generated name in
    the same private directory; the INT8 file is removed (also on failure)."""
    out = os.path.join(os.path.dirname(path), f"import-{uuid.uuid4().hex}.safetensors")
    try:
        return int8.dequantize_file(path, out, lim.kv_dtype, lim.num_layers)
    except Exception:
        for p in (path, out):
            if os.path.exists(p):
                os.unlink(p)
        raise
