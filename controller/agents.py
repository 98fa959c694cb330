"""The controller's client for node agents (:class:`controller.ports.AgentPort` over gRPC): one
cached grpc.aio channel per agent address, optionally mTLS; messages in and out as
:mod:`controller.model` dataclasses (:mod:`controller.convert`). Every unary call has a deadline;
an unreachable agent is :class:`Unavailable`, any other failed call the typed error of its
status (:func:`agent_error`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller.convert import from_proto, to_proto
from controller.model import (AbortResult, AgentDescription, Continuation, ImportOrder,
                              MigrateOrder, RequestInfo, SwitchOrder, SwitchProgress,
                              SwitchRecord)
from remp.auth import Credentials, aio_channel, channel_tls
from remp.errors import NotFound, RempError, Unavailable, error_from_rpc
from remp.grpc_util import channel_options
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc

AGENT_SERVICE = "remp.node_agent.v1.NodeAgent"
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def agent_error(exc: grpc.RpcError, address: str) -> RempError:
    """A failed call to an agent as a typed error: no answer in time is :class:`Unavailable`
    (the agent is unreachable); anything else is the agent's own answer, status kept."""
    if exc.code() in UNREACHABLE:
        err = Unavailable(f"agent at {address} unreachable: {exc.code().name}")
        err.details = exc.details() or ""
        return err
    return error_from_rpc(exc)


@dataclass(frozen=True)
class TlsFiles:
    """Client side of mTLS: the CA that signed the agents' certificates, and our own pair."""

    ca: Path
    cert: Path
    key: Path

    def credentials(self) -> grpc.ChannelCredentials:
        return channel_tls(self.ca, self.cert, self.key)


class AgentClients:
    def __init__(self, tls: TlsFiles | None = None, timeout: float = 5.0,
                 creds: Credentials | None = None):
        self.tls, self.timeout, self.creds = tls, timeout, creds
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = aio_channel(address, self.creds, options=channel_options(),
                             channel_credentials=self.tls.credentials() if self.tls else None)
            self._channels[address] = ch
        return ch

    def connected(self, address: str) -> bool:
        """Whether this controller holds a live connection to the agent (its channel READY:
        connected, TLS handshake done, not broken since)."""
        ch = self._channels.get(address)
        return ch is not None and \
            ch.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY

    def stub(self, address: str) -> node_agent_pb2_grpc.NodeAgentStub:
        return node_agent_pb2_grpc.NodeAgentStub(self._channel(address))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def check_serving(self, address: str, timeout: float = 2.0) -> None:
        """UNAVAILABLE unless the agent answers grpc.health.v1 with SERVING in time."""
        try:
            r = await health_pb2_grpc.HealthStub(self._channel(address)).Check(
                health_pb2.HealthCheckRequest(service=AGENT_SERVICE), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"agent at {address} unreachable: {exc.code().name} "
                              f"{exc.details() or ''}".strip()) from None
        if r.status != health_pb2.HealthCheckResponse.SERVING:
            raise Unavailable(f"agent at {address} is not serving "
                              f"({health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)})")

    async def describe(self, address: str) -> AgentDescription:
        try:
            r = await self.stub(address).Describe(node_agent_pb2.DescribeRequest(),
                                                  timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise agent_error(exc, address) from None
        return from_proto(r, AgentDescription)

    async def execute_switch(self, address: str, order: SwitchOrder
                             ) -> AsyncIterator[SwitchProgress]:
        call = self.stub(address).ExecuteSwitch(to_proto(order), timeout=900)
        try:
            async for ev in call:
                yield from_proto(ev, SwitchProgress)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def get_switch(self, address: str, switch_id: str) -> SwitchRecord | None:
        """The agent's record, or None when the agent has never seen this switch id."""
        try:
            r = await self.stub(address).GetSwitch(
                node_agent_pb2.GetSwitchRequest(switch_id=switch_id), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            err = agent_error(exc, address)
            if isinstance(err, NotFound):
                return None
            raise err from None
        return from_proto(r.record, SwitchRecord)

    async def abort_switch(self, address: str, switch_id: str, reason: str) -> AbortResult:
        try:
            r = await self.stub(address).AbortSwitch(
                node_agent_pb2.AbortSwitchRequest(switch_id=switch_id, reason=reason),
                timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise agent_error(exc, address) from None
        return from_proto(r, AbortResult)

    async def set_draining(self, address: str, draining: bool) -> None:
        try:
            await self.stub(address).SetDraining(
                node_agent_pb2.SetDrainingRequest(draining=draining), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise agent_error(exc, address) from None

    async def list_requests(self, address: str) -> list[RequestInfo]:
        try:
            r = await self.stub(address).ListRequests(node_agent_pb2.ListRequestsRequest(),
                                                      timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise agent_error(exc, address) from None
        return [from_proto(x, RequestInfo) for x in r.requests]

    async def migrate_request(self, address: str, order: MigrateOrder
                              ) -> AsyncIterator[Continuation]:
        async for ev in _read(self.stub(address).MigrateRequest(to_proto(order))):
            yield ev

    async def import_request(self, address: str, order: ImportOrder
                             ) -> AsyncIterator[Continuation]:
        chunk = node_agent_pb2.ImportChunk(header=to_proto(order))
        async for ev in _read(self.stub(address).ImportRequest(iter([chunk]))):
            yield ev


async def _read(call) -> AsyncIterator[Continuation]:
    """A MigrateRequest / ImportRequest stream as continuation events, with ``read()``
    throughout (grpc.aio does not allow mixing it with iteration); a failed stream raises the
    typed error of its status (code and details as the agent sent them)."""
    while True:
        try:
            ev = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None
        if ev is grpc.aio.EOF:
            return
        yield from_proto(ev, Continuation)
