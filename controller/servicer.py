"""Controller gRPC servicer: checks the bearer token on mutating RPCs, converts, calls
:class:`controller.core.Controller`, converts back (no logic here)."""

from __future__ import annotations

import hmac

from controller.core import Controller
from controller.planner import Plan
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.errors import InvalidArgument, Unauthenticated
from remp.grpc_util import rpc_errors, rpc_errors_stream


def _check_token(context, token: str | None) -> None:
    if not token:
        return
    md = dict(context.invocation_metadata() or ())
    got = md.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
        raise Unauthenticated("this call changes state: send 'authorization: Bearer <token>'")


def plan_to_proto(node: str, p: Plan) -> controller_pb2.PlanResponse:
    return controller_pb2.PlanResponse(
        node=node,
        from_topology=types_pb2.Topology(tp=p.source.tp, pp=p.source.pp),
        to_topology=types_pb2.Topology(tp=p.target.tp, pp=p.target.pp),
        transfers=[controller_pb2.Transfer(src_rank=t.src_rank, dst_rank=t.dst_rank,
                                           layers=t.layers, kv_head_start=t.kv_head_start,
                                           kv_head_end=t.kv_head_end, kv_bytes=t.kv_bytes)
                   for t in p.transfers],
        shard_loads=[controller_pb2.ShardLoad(rank=s.rank, layers=s.layers, tp_rank=s.tp_rank,
                                              tp_size=s.tp_size, weight_bytes=s.weight_bytes)
                     for s in p.shard_loads],
        kv_bytes_total=p.kv_bytes_total, weight_bytes_total=p.weight_bytes_total,
        predicted=[types_pb2.PhaseTiming(phase=int(ph), seconds=s) for ph, s in
                   sorted(p.predicted.items())],
        predicted_total_seconds=p.predicted_total_s,
        requests_to_preempt=p.requests_to_preempt, noop=p.noop)


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(self, core: Controller, token: str | None):
        self.core, self.token = core, token

    @rpc_errors
    async def RegisterNode(self, request, context):
        _check_token(context, self.token)
        lease, epoch = await self.core.register(request)
        return controller_pb2.RegisterNodeResponse(lease_seconds=lease, epoch=epoch)

    @rpc_errors
    async def Heartbeat(self, request, context):
        _check_token(context, self.token)
        return controller_pb2.HeartbeatResponse(lease_seconds=await self.core.heartbeat(request))

    @rpc_errors
    async def ListNodes(self, request, context):
        return controller_pb2.ListNodesResponse(nodes=await self.core.list_nodes())

    @rpc_errors
    async def GetState(self, request, context):
        return await self.core.get_state(request.node)

    @rpc_errors
    async def Plan(self, request, context):
        return plan_to_proto(request.node, await self.core.plan(request.node, request.target))

    @rpc_errors
    async def Reconfigure(self, request, context):
        _check_token(context, self.token)
        return await self.core.reconfigure(request.node, request.target, request.request_id,
                                           request.reason, request.test_start_when_running)

    @rpc_errors_stream
    async def Watch(self, request, context):
        async for ev in self.core.watch(request.node, request.switch_id, request.include_history):
            yield ev

    @rpc_errors
    async def Abort(self, request, context):
        _check_token(context, self.token)
        return await self.core.abort(request.switch_id, request.reason)

    @rpc_errors
    async def GetSwitch(self, request, context):
        return await self.core.get_switch(request.switch_id)

    @rpc_errors
    async def ListSwitches(self, request, context):
        recs, nxt = await self.core.list_switches(request.node, request.page_size,
                                                  request.page_token)
        return controller_pb2.ListSwitchesResponse(switches=recs, next_page_token=nxt)

    @rpc_errors
    async def GetTraffic(self, request, context):
        since = request.since.ToNanoseconds() / 1e9 if request.HasField("since") else 0.0
        return controller_pb2.GetTrafficResponse(
            samples=await self.core.traffic(request.node, since, request.limit))

    @rpc_errors
    async def RecordRecommendation(self, request, context):
        _check_token(context, self.token)
        await self.core.record_recommendation(request.node, request.recommended, request.reason,
                                              request.decision_id)
        return controller_pb2.RecordRecommendationResponse()

    @rpc_errors
    async def DrainNode(self, request, context):
        _check_token(context, self.token)
        if not request.node:
            raise InvalidArgument("node is required")
        if request.slo_budget_seconds < 0 or request.slo_budget_seconds != request.slo_budget_seconds:
            raise InvalidArgument("slo_budget_seconds must be >= 0")
        return controller_pb2.DrainNodeResponse(decisions=await self.core.drain(
            request.node, request.target_node, request.slo_budget_seconds, request.reason,
            request.test_start_when_running))

    @rpc_errors
    async def ListRecoveries(self, request, context):
        return controller_pb2.ListRecoveriesResponse(
            recoveries=await self.core.list_recoveries(request.node))
