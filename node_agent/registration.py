"""Registration with the controller: RegisterNode once ready, then Heartbeat every third of the
lease; re-register when the controller forgot us (NOT_FOUND) and retry with backoff while it is
unreachable. The agent keeps serving whatever happens here."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from node_agent import convert
from remp import logs
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.auth import Credentials, aio_channel
from remp.errors import (DeadlineExceeded, InvalidArgument, NotFound, Unauthenticated,
                         Unavailable, error_from_rpc)
from remp.grpc_util import channel_options
from remp.transaction import Outcome

if TYPE_CHECKING:
    from node_agent.agent import NodeAgent

log = logs.get_logger("remp.node_agent")


def measured_bandwidths(agent: "NodeAgent") -> tuple[float, float]:
    """Bytes/s of KV migration and of shard reload over this agent's succeeded switches (the
    warm-up visits included): what the controller's planner predicts with."""
    kv_b = kv_s = w_b = w_s = 0.0
    for rec in agent.records.values():
        if rec.outcome != Outcome.SUCCEEDED:
            continue
        secs = rec.phase_seconds()
        kv_b += rec.kv_bytes_moved
        kv_s += secs.get("MIGRATE_KV", 0.0)
        w_b += rec.weight_bytes_loaded
        w_s += secs.get("RELOAD_SHARDS", 0.0)
    return (kv_b / kv_s if kv_s else 0.0, w_b / w_s if w_s else 0.0)


def register_request(agent: "NodeAgent", agent_address: str) -> controller_pb2.RegisterNodeRequest:
    cfg = agent.cfg
    kv_bw, w_bw = measured_bandwidths(agent)
    return controller_pb2.RegisterNodeRequest(
        node=cfg.settings.node, agent_address=agent_address, http_address=agent.http_address,
        topology=convert.topology_to_proto(agent.topology),
        candidates=[convert.topology_to_proto(t) for t in cfg.candidates],
        host=convert.host_to_proto(cfg.host),
        model=convert.model_to_proto(cfg.model, cfg.dtype, cfg.settings.max_model_len),
        kv_bandwidth_bps=kv_bw, weight_bandwidth_bps=w_bw, labels=cfg.settings.labels,
        last_epoch=agent.last_epoch)


class TrafficWindow:
    """Turns vLLM's cumulative counters into per-heartbeat-window samples."""

    def __init__(self):
        from node_agent.engine_plugin import traffic_counters

        self._read = traffic_counters
        self._last, self._t = self._read(), time.monotonic()

    async def sample(self, agent: "NodeAgent") -> types_pb2.TrafficSample:
        now, cur = time.monotonic(), self._read()
        delta = {k: max(0.0, cur.get(k, 0.0) - self._last.get(k, 0.0))
                 for k in ("requests", "input_tokens", "output_tokens", "tpot_sum", "tpot_count",
                           "ttft_sum", "ttft_count")}
        window, self._last, self._t = now - self._t, cur, now
        running, waiting = int(cur.get("running", 0)), int(cur.get("waiting", 0))
        at = Timestamp()
        at.FromNanoseconds(time.time_ns())
        return types_pb2.TrafficSample(
            at=at, window_seconds=window, requests=int(delta["requests"]),
            input_tokens=int(delta["input_tokens"]), output_tokens=int(delta["output_tokens"]),
            running=running, waiting=waiting,
            tpot_seconds_sum=delta["tpot_sum"], tpot_requests=int(delta["tpot_count"]),
            ttft_seconds_sum=delta["ttft_sum"], ttft_requests=int(delta["ttft_count"]))


async def heartbeat_request(agent: "NodeAgent", window: TrafficWindow
                            ) -> controller_pb2.HeartbeatRequest:
    traffic = await window.sample(agent)
    inflight = []
    if agent.engine is not None and agent.engine.engine is not None:
        inflight = [controller_pb2.InflightRequest(**r) for r in agent.engine.journal()]
    return controller_pb2.HeartbeatRequest(
        node=agent.cfg.settings.node, topology=convert.topology_to_proto(agent.topology),
        engine_status=convert.ENGINE_STATUS.get(agent.status, 0), traffic=traffic,
        inflight=inflight, topology_epoch=agent.topology_epoch,
        workers=[convert.worker_to_proto(w) for w in agent.worker_facts_nowait()])


async def keep_registered(agent: "NodeAgent", controller: str, agent_address: str,
                          creds: Credentials) -> None:
    """``controller``: one host:port, or several separated by commas (controller HA: every
    controller takes registrations and heartbeats; the agent stays with the one that answers
    and moves to the next when it stops answering)."""
    md = None  # the channel sends the agent's token (remp.auth)
    backoff = 0.5
    window = TrafficWindow()
    addresses = [a.strip() for a in controller.split(",") if a.strip()]
    registered, lease, i = False, 10.0, 0
    while True:
        controller = addresses[i % len(addresses)]
        async with aio_channel(controller, creds, options=channel_options()) as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            registered = False  # a controller we were not talking to: register with it
            while True:
                try:
                    if not registered:
                        r = await stub.RegisterNode(register_request(agent, agent_address),
                                                    metadata=md, timeout=5)
                        lease, registered, backoff = r.lease_seconds or lease, True, 0.5
                        # our topology was written as the node's at this epoch
                        agent.topology_epoch = max(agent.topology_epoch, r.epoch)
                        log.info("agent.registered", controller=controller, lease_s=lease)
                    else:
                        r = await stub.Heartbeat(await heartbeat_request(agent, window),
                                                 metadata=md, timeout=5)
                        lease = r.lease_seconds or lease
                    await asyncio.sleep(max(0.1, min(
                        lease / 3, agent.cfg.settings.heartbeat_seconds or lease / 3)))
                except grpc.aio.AioRpcError as exc:
                    err = error_from_rpc(exc)
                    if isinstance(err, NotFound):
                        registered = False  # the controller forgot us (new Redis): again
                        continue
                    if isinstance(err, (Unauthenticated, InvalidArgument)):
                        log.error("agent.registration_refused", code=err.code.name,
                                  detail=err.details)
                        await asyncio.sleep(30)
                        continue
                    log.warning("agent.controller_unreachable", controller=controller,
                                code=err.code.name, retry_s=backoff,
                                next=addresses[(i + 1) % len(addresses)])
                    registered = False if isinstance(err, Unavailable) else registered
                    await asyncio.sleep(backoff)
                    # never wait longer than a heartbeat interval: a controller restart must
                    # not cost this node its lease (it would be marked lost and its requests
                    # recovered)
                    backoff = min(backoff * 2, 10.0, max(0.5, lease / 3))
                    if len(addresses) > 1 and isinstance(err, (Unavailable, DeadlineExceeded)):
                        i += 1  # the next controller
                        break
