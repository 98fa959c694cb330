"""NodeAgent gRPC servicer: converts, calls the agent, converts back (no logic here)."""

from __future__ import annotations

import time

import grpc

from remp import logs, validate
from remp.errors import FailedPrecondition, InvalidArgument, NotFound
from remp.grpc_util import rpc_errors, rpc_errors_stream
from remp.node_agent.v1 import fault_injection_pb2 as fi_pb2
from remp.node_agent.v1 import fault_injection_pb2_grpc as fi_grpc
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc

from node_agent import convert, migration
from node_agent.agent import SERVICE_NAME, NodeAgent
from node_agent.faults import MigrationFault, SwitchFault

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
        validate.name("switch_id", request.switch_id)
        validate.text("reason", request.reason)
        events = self.agent.execute_switch(
            convert.topology_from_proto(request.target), switch_id=request.switch_id,
            reason=request.reason, epoch=request.epoch,
            overlap=not request.sequential_data_path, take_armed=True)
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
        validate.name("switch_id", request.switch_id, required=True)
        validate.text("reason", request.reason)
        phase = self.agent.abort_switch(request.switch_id, request.reason)
        return node_agent_pb2.AbortSwitchResponse(aborted=True, phase=int(phase))

    @rpc_errors
    async def GetSwitch(self, request, context):
        validate.name("switch_id", request.switch_id, required=True)
        rec = self.agent.get_switch(request.switch_id)
        if rec is None:
            raise NotFound(f"no switch with id {request.switch_id!r} on this node")
        return node_agent_pb2.GetSwitchResponse(record=convert.record_to_proto(rec))

    @rpc_errors
    async def ListRequests(self, request, context):
        reqs = await self.agent.list_requests(exact=request.exact)
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
        self.agent.engine.draining_retry_after = min(request.retry_after_seconds or 5, 3600) \
            if request.draining else 0
        log.info("agent.draining", draining=request.draining)
        return node_agent_pb2.SetDrainingResponse(draining=request.draining)


class FaultInjectionServicer(fi_grpc.FaultInjectionServicer):
    """Test-only controls (served only with the agent's fault-injection setting)."""

    def __init__(self, agent: NodeAgent):
        assert agent.faults is not None, "fault injection is not enabled on this agent"
        self.faults = agent.faults

    @rpc_errors
    async def ArmSwitch(self, request, context):
        validate.name("switch_id", request.switch_id)
        try:
            fail_at = convert.phase_from_proto(request.fail_at_phase)
        except ValueError:
            raise InvalidArgument(f"unknown phase {request.fail_at_phase}") from None
        armed = self.faults.arm_switch(request.switch_id, SwitchFault(
            fail_at=fail_at, skip_kv=request.skip_kv_migration,
            start_when_running=request.start_when_running))
        log.warning("agent.fault_armed", kind="switch", switch_id=request.switch_id or "(next)",
                    fail_at=fail_at.name, skip_kv=request.skip_kv_migration,
                    start_when_running=request.start_when_running)
        return fi_pb2.ArmSwitchResponse(armed=armed)

    @rpc_errors
    async def ArmMigration(self, request, context):
        validate.name("request_id", request.request_id)
        armed = self.faults.arm_migration(request.request_id, MigrationFault(
            poison_kv=request.poison_kv, wait_output_tokens=request.wait_output_tokens))
        log.warning("agent.fault_armed", kind="migration",
                    request_id=request.request_id or "(next)", poison_kv=request.poison_kv,
                    wait_output_tokens=request.wait_output_tokens)
        return fi_pb2.ArmMigrationResponse(armed=armed)

    @rpc_errors
    async def Disarm(self, request, context):
        return fi_pb2.DisarmResponse(dropped=self.faults.disarm())


FAULT_SERVICE_NAME = fi_pb2.DESCRIPTOR.services_by_name["FaultInjection"].full_name


def add_to_server(servicer: NodeAgentServicer, server: grpc.aio.Server) -> None:
    """The NodeAgent service, and FaultInjection when the agent's setting enables it."""
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(servicer, server)
    if servicer.agent.faults is not None:
        fi_grpc.add_FaultInjectionServicer_to_server(FaultInjectionServicer(servicer.agent),
                                                     server)


def service_names(agent: NodeAgent) -> list[str]:
    """The services this agent serves (reflection lists them)."""
    return [SERVICE_NAME, *([FAULT_SERVICE_NAME] if agent.faults is not None else [])]
