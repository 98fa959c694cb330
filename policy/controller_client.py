"""The policy's client of the controller (I/O edge behind ``policy.service.ControllerPort``):
grpc.aio channels to the controllers (remp.controllers: it follows the leader), a deadline on
every call, the policy's credential (remp.auth), and gRPC
statuses turned back into the typed ``remp.errors`` (one table)."""

from __future__ import annotations

import math

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from policy.service import NodeView, ReconfigureResult, Sample, SwitchResult
from remp.auth import Credentials
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.controllers import AioControllers
from remp.convert import OUTCOME_FROM_PROTO
from remp.errors import (ConfigError, FailedPrecondition, InvalidArgument, NotFound, RempError,
                         Unauthenticated, Unavailable, error_from_rpc)
from remp.topology import Topology
from remp.transaction import Outcome

# The controller's answers the policy acts on; any other failure (a deadline, the controller
# misbehaving) is Unavailable to it: try again later, same request id.
ANSWERS = (Unavailable, NotFound, InvalidArgument, FailedPrecondition, Unauthenticated)
_HEALTH = {
    controller_pb2.NODE_HEALTH_READY: "ready",
    controller_pb2.NODE_HEALTH_SWITCHING: "switching",
    controller_pb2.NODE_HEALTH_LOST: "lost",
    controller_pb2.NODE_HEALTH_DRAINING: "switching",
}


def _typed(exc: grpc.aio.AioRpcError, address: str) -> RempError:
    err = error_from_rpc(exc)
    if not isinstance(err, ANSWERS):
        return Unavailable(f"controller at {address}: {exc.code().name} {err}")
    if isinstance(err, Unavailable) and "failed to connect" in str(err).lower():
        return Unavailable(f"controller at {address} unreachable: {err}")
    return err


def topo_to_proto(t: Topology) -> types_pb2.Topology:
    return types_pb2.Topology(tp=t.tp, pp=t.pp)


def _topo(t: types_pb2.Topology) -> Topology | None:
    return Topology(t.tp, t.pp) if t.tp and t.pp else None


def switch_result(r) -> SwitchResult:
    """A SwitchRecord as the policy follows it (an unset outcome is still running)."""
    return SwitchResult(OUTCOME_FROM_PROTO.get(r.outcome, Outcome.RUNNING).value, r.error.code,
                        r.error.message)


def node_view(st: controller_pb2.NodeState) -> NodeView:
    parked = [w for w in st.workers if w.state == types_pb2.WORKER_STATE_STANDBY]
    return NodeView(st.node, _topo(st.observed),
                    tuple(t for t in (_topo(c) for c in st.candidates) if t is not None),
                    _HEALTH.get(st.health, "unknown") if not st.HasField("current_switch")
                    else "switching", st.recommendation, st.rollout_id,
                    released=tuple(sorted(w.rank for w in parked if w.released)),
                    unreleased=tuple(sorted(w.rank for w in parked if not w.released)))


def sample_of(t: types_pb2.TrafficSample) -> Sample:
    """The policy's view of a heartbeat's traffic; a latency sum that is not a positive finite
    number reads as no latency reported (with its count 0)."""
    tpot_sum = t.tpot_seconds_sum if math.isfinite(t.tpot_seconds_sum) else 0.0
    ttft_sum = t.ttft_seconds_sum if math.isfinite(t.ttft_seconds_sum) else 0.0
    return Sample(t.at.ToNanoseconds() / 1e9, t.window_seconds, t.requests, t.input_tokens,
                  t.output_tokens, t.running, t.waiting, max(tpot_sum, 0.0),
                  t.tpot_requests if tpot_sum > 0 else 0, max(ttft_sum, 0.0),
                  t.ttft_requests if ttft_sum > 0 else 0)


def sample_to_proto(s: Sample) -> types_pb2.TrafficSample:
    at = Timestamp()
    at.FromNanoseconds(int(s.at_s * 1e9))
    return types_pb2.TrafficSample(at=at, window_seconds=s.window_s, requests=s.requests,
                                   input_tokens=s.input_tokens, output_tokens=s.output_tokens,
                                   running=s.running, waiting=s.waiting,
                                   tpot_seconds_sum=s.tpot_s_sum, tpot_requests=s.tpot_requests,
                                   ttft_seconds_sum=s.ttft_s_sum, ttft_requests=s.ttft_requests)


class GrpcController:
    """``address``: one controller, or several comma-separated (controller HA). Reads go to
    whichever answers; a write refused by a follower (NotLeader) is sent once more to the
    leader it names, and the client stays with the leader after that (remp.controllers)."""

    def __init__(self, address: str, creds: Credentials | None = None, timeout: float = 10.0):
        # the channels send the policy's token where the access table asks for one
        try:
            self._ctl = AioControllers(address, creds, timeout=timeout)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.timeout = timeout

    @property
    def addresses(self) -> list[str]:
        return self._ctl.addresses

    @property
    def address(self) -> str:
        return self._ctl.address

    async def close(self) -> None:
        await self._ctl.close()

    async def _call(self, name: str, req):
        try:
            return await self._ctl.call(name, req)
        except grpc.aio.AioRpcError as exc:
            raise _typed(exc, self.address) from None

    async def list_nodes(self) -> list[NodeView]:
        r = await self._call("ListNodes", controller_pb2.ListNodesRequest())
        return [node_view(st) for st in r.nodes]

    async def traffic(self, node: str, since_s: float | None, limit: int) -> list[Sample]:
        req = controller_pb2.GetTrafficRequest(node=node, limit=limit)
        if since_s is not None:
            req.since.FromNanoseconds(int(since_s * 1e9))
        r = await self._call("GetTraffic", req)
        return [sample_of(t) for t in r.samples]

    async def reconfigure(self, node: str, target: Topology, request_id: str,
                          reason: str) -> ReconfigureResult:
        r = await self._call("Reconfigure", controller_pb2.ReconfigureRequest(
            node=node, target=topo_to_proto(target), request_id=request_id, reason=reason))
        return ReconfigureResult(r.switch_id, r.noop, r.duplicate)

    async def switch(self, switch_id: str) -> SwitchResult:
        try:
            r = await self._call("GetSwitch", controller_pb2.GetSwitchRequest(switch_id=switch_id))
        except NotFound:
            return SwitchResult("missing")
        return switch_result(r)

    async def rollout(self, nodes: list[str], target: Topology, capacity_floor: float,
                      max_parallel: int, capacity_rps: dict[str, float], request_id: str,
                      reason: str) -> tuple[str, bool]:
        r = await self._call("Rollout", controller_pb2.RolloutRequest(
            nodes=nodes, target=topo_to_proto(target), capacity_floor=capacity_floor,
            max_parallel=max_parallel, capacity_rps=capacity_rps, request_id=request_id,
            reason=reason))
        return r.rollout.rollout_id, r.duplicate

    async def record_recommendation(self, node: str, recommended: Topology, reason: str,
                                    decision_id: str) -> None:
        await self._call("RecordRecommendation",
                         controller_pb2.RecordRecommendationRequest(
                             node=node, recommended=topo_to_proto(recommended), reason=reason,
                             decision_id=decision_id))
