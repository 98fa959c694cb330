"""NodeAgent gRPC servicer: converts, calls the agent, converts back (no logic here)."""

from __future__ import annotations

import grpc

from remp.errors import FailedPrecondition, InvalidArgument, NotFound
from remp.grpc_util import rpc_errors, rpc_errors_stream
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc
from remp.topology import format_topologies

from node_agent import convert
from node_agent.agent import NodeAgent


class NodeAgentServicer(node_agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, agent: NodeAgent):
        self.agent = agent

    @rpc_errors
    async def Describe(self, request, context):
        return convert.describe_to_proto(await self.agent.snapshot())

    @rpc_errors_stream
    async def ExecuteSwitch(self, request, context):
        target = convert.topology_from_proto(request.target)
        if target not in self.agent.cfg.candidates:
            raise InvalidArgument(
                f"target {target} is not a candidate topology of node {self.agent.cfg.settings.node}"
                f" (valid targets: {format_topologies(self.agent.cfg.candidates)})"
            )
        if self.agent.status != "serving":
            raise FailedPrecondition(f"engine is {self.agent.status}, not serving")
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "in-place switching is not available in this build of the agent yet",
        )
        yield node_agent_pb2.SwitchEvent()  # pragma: no cover - unreachable, makes this a generator

    @rpc_errors
    async def GetSwitch(self, request, context):
        raise NotFound(f"no switch with id {request.switch_id!r} on this node")


def add_to_server(servicer: NodeAgentServicer, server: grpc.aio.Server) -> None:
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
