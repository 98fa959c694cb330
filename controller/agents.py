"""The controller's client for node agents: one cached grpc.aio channel per agent address,
optionally mTLS. Every call has a deadline; an unreachable agent is :class:`Unavailable`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remp.common.v1 import types_pb2
from remp.errors import Unavailable
from remp.grpc_util import channel_options
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc

AGENT_SERVICE = "remp.node_agent.v1.NodeAgent"
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class TlsFiles:
    """Client side of mTLS: the CA that signed the agents' certificates, and our own pair."""

    ca: Path
    cert: Path
    key: Path

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(), private_key=self.key.read_bytes(),
            certificate_chain=self.cert.read_bytes())


class AgentClients:
    def __init__(self, tls: TlsFiles | None = None, timeout: float = 5.0):
        self.tls, self.timeout = tls, timeout
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            if self.tls is not None:
                ch = grpc.aio.secure_channel(address, self.tls.credentials(), options=channel_options())
            else:
                ch = grpc.aio.insecure_channel(address, options=channel_options())
            self._channels[address] = ch
        return ch

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

    async def describe(self, address: str) -> node_agent_pb2.DescribeResponse:
        try:
            return await self.stub(address).Describe(node_agent_pb2.DescribeRequest(),
                                                     timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in UNREACHABLE:
                raise Unavailable(f"agent at {address} unreachable: {exc.code().name}") from None
            raise

    def execute_switch(self, address: str, req: node_agent_pb2.ExecuteSwitchRequest
                       ) -> AsyncIterator[node_agent_pb2.SwitchEvent]:
        return self.stub(address).ExecuteSwitch(req, timeout=900)

    async def get_switch(self, address: str, switch_id: str) -> types_pb2.SwitchRecord | None:
        """The agent's record, or None when the agent has never seen this switch id."""
        try:
            r = await self.stub(address).GetSwitch(
                node_agent_pb2.GetSwitchRequest(switch_id=switch_id), timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            if exc.code() in UNREACHABLE:
                raise Unavailable(f"agent at {address} unreachable: {exc.code().name}") from None
            raise
        return r.record

    async def abort_switch(self, address: str, switch_id: str, reason: str
                           ) -> node_agent_pb2.AbortSwitchResponse:
        try:
            return await self.stub(address).AbortSwitch(
                node_agent_pb2.AbortSwitchRequest(switch_id=switch_id, reason=reason),
                timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in UNREACHABLE:
                raise Unavailable(f"agent at {address} unreachable: {exc.code().name}") from None
            raise
