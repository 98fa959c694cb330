"""Controller gRPC servicer: bounds-checks the request's strings (:mod:`controller.validation`),
converts (:mod:`controller.convert`), calls :class:`controller.core.Controller`, converts back (no
logic here; who may call what is checked before, by :mod:`remp.auth`)."""

from __future__ import annotations

import functools

from controller import validation
from controller.convert import from_proto, plan_to_proto, rollout_to_proto, to_proto, topology
from controller.core import Controller
from controller.model import Heartbeat, Registration
from controller.rollouts import RolloutSpec
from remp.auth import current_caller
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.errors import InvalidArgument
from remp.grpc_util import rpc_errors, rpc_errors_stream


def checked(fn):
    """Every string field of the request within its bounds before the method sees it."""

    @functools.wraps(fn)
    async def unary(self, request, context):
        validation.check(request)
        return await fn(self, request, context)
    return unary


def checked_stream(fn):
    @functools.wraps(fn)
    async def stream(self, request, context):
        validation.check(request)
        async for item in fn(self, request, context):
            yield item
    return stream


def caller_key(context) -> str:
    """What the per-caller limits count by (remp.auth sets the caller of every RPC)."""
    c = current_caller()
    return c.key if c is not None else f"anon@{context.peer()[:64]}"


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(self, core: Controller):
        self.core = core

    @rpc_errors
    @checked
    async def RegisterNode(self, request, context):
        lease, epoch = await self.core.register(from_proto(request, Registration))
        return controller_pb2.RegisterNodeResponse(lease_seconds=lease, epoch=epoch)

    @rpc_errors
    @checked
    async def Heartbeat(self, request, context):
        return controller_pb2.HeartbeatResponse(
            lease_seconds=await self.core.heartbeat(from_proto(request, Heartbeat)))

    @rpc_errors
    @checked
    async def ListNodes(self, request, context):
        return controller_pb2.ListNodesResponse(
            nodes=[to_proto(n) for n in await self.core.list_nodes()])

    @rpc_errors
    @checked
    async def GetState(self, request, context):
        return to_proto(await self.core.get_state(request.node))

    @rpc_errors
    @checked
    async def Plan(self, request, context):
        return plan_to_proto(request.node,
                             await self.core.plan(request.node, topology(request.target)))

    @rpc_errors
    @checked
    async def Reconfigure(self, request, context):
        return to_proto(await self.core.reconfigure(request.node, topology(request.target),
                                                    request.request_id, request.reason))

    @rpc_errors_stream
    @checked_stream
    async def Watch(self, request, context):
        # headers now: a client knows the stream is open before the first event arrives
        await context.send_initial_metadata(())
        async for ev in self.core.watch(request.node, request.switch_id, request.include_history,
                                        caller_key(context), request.rollout_id,
                                        request.after_id):
            yield to_proto(ev)

    @rpc_errors
    @checked
    async def Abort(self, request, context):
        return to_proto(await self.core.abort(request.switch_id, request.reason))

    @rpc_errors
    @checked
    async def GetSwitch(self, request, context):
        return to_proto(await self.core.get_switch(request.switch_id))

    @rpc_errors
    @checked
    async def ListSwitches(self, request, context):
        recs, nxt = await self.core.list_switches(request.node, request.page_size,
                                                  request.page_token)
        return controller_pb2.ListSwitchesResponse(switches=[to_proto(r) for r in recs],
                                                   next_page_token=nxt)

    @rpc_errors
    @checked
    async def GetTraffic(self, request, context):
        since = request.since.ToNanoseconds() / 1e9 if request.HasField("since") else 0.0
        return controller_pb2.GetTrafficResponse(samples=[
            to_proto(t) for t in await self.core.traffic(request.node, since, request.limit)])

    @rpc_errors
    @checked
    async def RecordRecommendation(self, request, context):
        await self.core.record_recommendation(request.node, topology(request.recommended),
                                              request.reason, request.decision_id)
        return controller_pb2.RecordRecommendationResponse()

    @rpc_errors
    @checked
    async def DrainNode(self, request, context):
        if not request.node:
            raise InvalidArgument("node is required")
        if request.slo_budget_seconds < 0 or request.slo_budget_seconds != request.slo_budget_seconds:
            raise InvalidArgument("slo_budget_seconds must be >= 0")
        decisions = await self.core.drain(request.node, request.target_node,
                                          request.slo_budget_seconds, request.reason)
        return controller_pb2.DrainNodeResponse(decisions=[to_proto(d) for d in decisions])

    @rpc_errors
    @checked
    async def ListRecoveries(self, request, context):
        return controller_pb2.ListRecoveriesResponse(
            recoveries=[to_proto(r) for r in await self.core.list_recoveries(request.node)])

    @rpc_errors
    @checked
    async def Rollout(self, request, context):
        v = await self.core.rollouts.create(RolloutSpec(
            target=topology(request.target), floor=request.capacity_floor,
            max_parallel=request.max_parallel or 1, capacity=dict(request.capacity_rps),
            nodes=tuple(request.nodes), labels=dict(request.labels),
            request_id=request.request_id, reason=request.reason, dry_run=request.dry_run))
        return controller_pb2.RolloutResponse(rollout=rollout_to_proto(v.state, v.meta),
                                              duplicate=v.duplicate, dry_run=v.dry_run)

    @rpc_errors
    @checked
    async def GetRollout(self, request, context):
        v = await self.core.rollouts.get(request.rollout_id)
        return rollout_to_proto(v.state, v.meta)

    @rpc_errors
    @checked
    async def ListRollouts(self, request, context):
        return controller_pb2.ListRolloutsResponse(rollouts=[
            rollout_to_proto(v.state, v.meta)
            for v in await self.core.rollouts.list(request.active_only, request.limit)])

    @rpc_errors
    @checked
    async def ControlRollout(self, request, context):
        v = await self.core.rollouts.control(request.rollout_id, request.action, request.reason)
        return rollout_to_proto(v.state, v.meta)
