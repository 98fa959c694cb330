"""NodeAgent gRPC servicer: converts, calls the agent, converts back (no logic here)."""

from __future__ import annotations

import grpc

from remp.errors import InvalidArgument, NotFound
from remp.grpc_util import rpc_errors, rpc_errors_stream
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc

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
        if not request.HasField("target"):
            raise InvalidArgument("target is required, e.g. {\"target\": {\"tp\": 1, \"pp\": 2}}")
        try:
            fail_at = convert.phase_from_proto(request.fail_at_phase)
        except ValueError:
            raise InvalidArgument(f"unknown phase {request.fail_at_phase}") from None
        events = self.agent.execute_switch(
            convert.topology_from_proto(request.target), switch_id=request.switch_id,
            reason=request.reason, epoch=request.epoch,
            overlap=not request.sequential_data_path, fail_at=fail_at,
            skip_kv=request.test_skip_kv_migration,
            start_when_running=request.test_start_when_running)
        async for ev in events:
            yield convert.event_to_proto(ev)

    @rpc_errors
    async def AbortSwitch(self, request, context):
        if not request.switch_id:
            raise InvalidArgument("switch_id is required")
        phase = self.agent.abort_switch(request.switch_id, request.reason)
        return node_agent_pb2.AbortSwitchResponse(aborted=True, phase=int(phase))

    @rpc_errors
    async def GetSwitch(self, request, context):
        rec = self.agent.get_switch(request.switch_id)
        if rec is None:
            raise NotFound(f"no switch with id {request.switch_id!r} on this node")
        return node_agent_pb2.GetSwitchResponse(record=convert.record_to_proto(rec))


def add_to_server(servicer: NodeAgentServicer, server: grpc.aio.Server) -> None:
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
