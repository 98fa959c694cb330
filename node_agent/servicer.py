"""NodeAgent gRPC servicer: converts, calls the agent, converts back (no logic here)."""

from __future__ import annotations

import time

import grpc

from remp import logs
from remp.errors import FailedPrecondition, InvalidArgument, NotFound
from remp.grpc_util import rpc_errors, rpc_errors_stream
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc

from node_agent import convert, migration
from node_agent.agent import NodeAgent

log = logs.get_logger("remp.node_agent")


class NodeAgentServicer(node_agent_pb2_grpc.NodeAgentServicer):
    def __init__(self, agent: NodeAgent):
        self.agent = agent

    @rpc_errors
    async def Describe(self, request, context):
        return convert.describe_to_proto(await self.agent.snapshot())

    @rpc_errors_stream
    async def ExecuteSwitch(self, request, context):
        rpc_in = time.time()
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
            msg = convert.event_to_proto(ev)
            if ev.record is not None:
                # where the time between the controller's call and the engine's work went
                r = ev.record
                log.info("agent.switch_streamed", switch_id=r.switch_id, rpc_in=round(rpc_in, 6),
                         started=round(r.started_wall, 6), finished=round(r.finished_wall, 6),
                         final_out=round(time.time(), 6))
            yield msg

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


    @rpc_errors
    async def ListRequests(self, request, context):
        reqs = await self.agent.engine.list_requests() if self.agent.engine else []
        return node_agent_pb2.ListRequestsResponse(requests=[
            node_agent_pb2.RequestInfo(request_id=r["request_id"], status=r["status"],
                                       prompt_tokens=r["prompt_tokens"],
                                       output_tokens=r["output_tokens"],
                                       max_tokens=r["max_tokens"], blocks=r["blocks"])
            for r in reqs])

    @rpc_errors_stream
    async def MigrateRequest(self, request, context):
        self.agent.require_serving()
        async for ev in migration.migrate_out(self.agent, request):
            yield ev

    @rpc_errors_stream
    async def ImportRequest(self, request_iterator, context):
        self.agent.require_serving()
        async for ev in migration.import_in(self.agent, request_iterator):
            yield ev


    @rpc_errors
    async def SetDraining(self, request, context):
        if self.agent.engine is None:
            raise FailedPrecondition("engine is not started")
        self.agent.engine.draining_retry_after = (request.retry_after_seconds or 5) \
            if request.draining else 0
        log.info("agent.draining", draining=request.draining)
        return node_agent_pb2.SetDrainingResponse(draining=request.draining)


def add_to_server(servicer: NodeAgentServicer, server: grpc.aio.Server) -> None:
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
