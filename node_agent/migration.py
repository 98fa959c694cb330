"""Cross-host request migration between node agents (the agent side; decisions are pure, in
:mod:`remp.recovery`).

Source (``migrate_out``): decide MIGRATE / RECOMPUTE / ABORT for the request from measured costs
(bandwidth EWMA per target, throttle, prefill table), take it out of the engine (a short pause),
send it to the target's ``ImportRequest`` — state, plus the KV payload when migrating — and relay
the continuation. Target (``import_in``): write the payload, continue the request in its engine
(the remp import connector loads the KV), stream the tokens back.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from remp import logs
from remp.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from remp.common.v1 import types_pb2
from remp.node_agent.v1 import node_agent_pb2 as pb
from remp.node_agent.v1 import node_agent_pb2_grpc
from remp.recovery import (Action, BandwidthEstimator, DisplacedRequest, PrefillTable,
                           RecoveryConfig, decide)

log = logs.get_logger("remp.node_agent.migration")
CHUNK = 256 * 1024
ACTIONS = {Action.MIGRATE: types_pb2.RECOVERY_ACTION_MIGRATE, Action.RECOMPUTE: types_pb2.RECOVERY_ACTION_RECOMPUTE,
           Action.ABORT: types_pb2.RECOVERY_ACTION_ABORT}


@dataclass
class MigrationState:
    """What the agent keeps between migrations: the bandwidth it measured per target and the
    prefill table it decides with."""

    bandwidth: BandwidthEstimator = field(default_factory=BandwidthEstimator)
    prefill: PrefillTable | None = None
    bandwidth_limit_bps: float = 0.0
    max_concurrent: int = 32
    active: int = 0
    tasks: set = field(default_factory=set)  # continuations being relayed to local clients


def kv_bytes_estimate(blocks: int, shape, block_size: int, dtype_bytes: int) -> int:
    """A request's KV over every layer and KV head (what a MIGRATE sends)."""
    return blocks * shape.num_layers * shape.num_kv_heads * block_size * 2 * shape.head_size * dtype_bytes


def decide_one(st: MigrationState, info: dict, kv_bytes: int, mode: int, limit_bps: float,
               budget_s: float | None, src: str, dst: str) -> types_pb2.RecoveryDecision:
    tokens = info["prompt_tokens"] + info["output_tokens"]
    req = DisplacedRequest(info["request_id"], kv_bytes, tokens, budget_s=budget_s,
                           remaining_tokens=max(0, info["max_tokens"] - info["output_tokens"]),
                           src=src, dst=dst)
    cap = limit_bps or st.bandwidth_limit_bps or None
    prefill = st.prefill or PrefillTable.fit([(1, 0.0), (2, 0.0)])
    d = decide([req], prefill, st.bandwidth, RecoveryConfig(
        max_concurrent_migrations=st.max_concurrent, bandwidth_cap_bps=cap),
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
        detail=d.detail)


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
    poison, wait_tokens = request.test_poison_kv, request.test_wait_output_tokens
    if (poison or wait_tokens) and not agent.cfg.settings.enable_fault_injection:
        raise InvalidArgument("test_poison_kv / test_wait_output_tokens need the agent's fault "
                              "injection setting (tests only)")
    if not request.target_address or not (request.request_id or wait_tokens):
        raise InvalidArgument("request_id and target_address are required")
    rid = request.request_id
    dst = request.target_node or request.target_address
    channel = grpc.aio.insecure_channel(request.target_address)
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout=5)
    except asyncio.TimeoutError:
        await channel.close()
        raise Unavailable(f"target agent {request.target_address} unreachable; "
                          f"the request stays here") from None
    try:
        if wait_tokens:
            rid = await _wait_for_request(agent, rid, wait_tokens)
        elif rid not in {r["request_id"] for r in await agent.engine.list_requests()}:
            raise NotFound(f"no request {rid!r} in this engine")
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(agent.cfg.dtype, 4)

        def choose(info: dict):
            if info["status"] != "RUNNING":
                raise FailedPrecondition(f"request {rid} is {info['status']}, not RUNNING")
            kv = kv_bytes_estimate(info["blocks"], agent.cfg.model.shape, agent.block_size,
                                   dtype_bytes)
            d = decide_one(st, info, kv, request.mode, request.bandwidth_limit_bps,
                           request.slo_budget_seconds or None, node, dst)
            if d.action == types_pb2.RECOVERY_ACTION_ABORT:
                return d, None
            return d, d.action == types_pb2.RECOVERY_ACTION_MIGRATE

        async with agent.engine_exclusive():
            decision, state = await agent.engine.take_out(rid, agent.state_dir, choose)
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
             recompute_s=round(decision.recompute_seconds, 6), kv_bytes=decision.kv_bytes)
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
                                                       request, events))
        st.tasks.add(task)
        task.add_done_callback(st.tasks.discard)
    yield pb.MigrateRequestEvent(decision=decision)
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
                              request: pb.MigrateRequestRequest, events: asyncio.Queue) -> None:
    """Send the request (state, KV payload when migrating) to the target's ImportRequest; relay
    each continuation event to this node's client (:meth:`EngineHandle.relay`) and to
    ``events``. The client's stream ends with the target's finish, or with a retryable error
    when the target fails; if the client goes away (or a stop string ends it here) the import is
    cancelled and the target drops the request."""
    st: MigrationState = agent.migration
    node = agent.cfg.settings.node
    migrate = decision.action == types_pb2.RECOVERY_ACTION_MIGRATE
    payload = state.get("payload")
    chunks: list[bytes] = []
    if payload:
        with open(payload, "rb") as f:
            data = f.read()
        os.unlink(payload)
        if request.test_poison_kv:  # test-only control: same size, KV zeroed (header valid)
            head = 8 + int.from_bytes(data[:8], "little")
            data = data[:head] + bytes(len(data) - head)
        chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    header = pb.ImportHeader(
        request_id=rid, prompt_token_ids=state["prompt_token_ids"],
        output_token_ids=state["output_token_ids"], max_tokens=state["max_tokens"],
        temperature=state["temperature"], ignore_eos=state["ignore_eos"],
        kv_bytes=sum(len(c) for c in chunks), block_size=state["block_size"])
    rate = request.bandwidth_limit_bps or st.bandwidth_limit_bps
    st.active += 1 if migrate else 0
    t0 = time.perf_counter()
    first, ended, call = True, False, None
    try:
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
                # the link's bandwidth: unthrottled transfers only (a throttle is a cap the
                # decision applies on its own), timed by the receiver
                if migrate and header.kv_bytes and not rate and ev.receive_seconds > 0:
                    st.bandwidth.observe(node, dst, header.kv_bytes, ev.receive_seconds)
                log.info("migration.transferred", request_id=rid,
                         kv_bytes=header.kv_bytes, seconds=round(took, 4),
                         paused_s=round(state["paused_seconds"], 4))
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


async def import_in(agent, chunks: AsyncIterator[pb.ImportChunk]) -> AsyncIterator[pb.ImportEvent]:
    it = chunks.__aiter__()
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        raise InvalidArgument("ImportRequest needs a header chunk") from None
    if not first.HasField("header"):
        raise InvalidArgument("the first ImportRequest chunk must carry the header")
    h = first.header
    if not h.request_id or not h.prompt_token_ids:
        raise InvalidArgument("header needs request_id and prompt_token_ids")
    if h.kv_bytes and h.block_size != agent.block_size:
        raise FailedPrecondition(f"KV from block size {h.block_size} cannot load into block "
                                 f"size {agent.block_size}; migrate with RECOMPUTE")
    payload, t0 = None, time.perf_counter()
    if h.kv_bytes:
        payload = os.path.join(agent.state_dir, f"import-{h.request_id}-{time.monotonic_ns()}.st")
        got = 0
        with open(payload, "wb") as f:
            async for c in it:
                f.write(c.kv)
                got += len(c.kv)
        if got != h.kv_bytes:
            os.unlink(payload)
            raise InvalidArgument(f"KV payload incomplete: {got} of {h.kv_bytes} bytes")
    if agent.status not in ("serving", "switching"):
        raise FailedPrecondition(f"engine is {agent.status}, not serving")
    received = time.perf_counter()
    sent_text, sent_tokens, first_ev = 0, 0, True
    try:
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
                         receive_s=round(received - t0, 4),
                         first_token_s=round(time.perf_counter() - received, 4))
            sent_tokens, sent_text = len(o.token_ids), len(o.text)
            yield ev
    finally:
        if payload and os.path.exists(payload):
            os.unlink(payload)
