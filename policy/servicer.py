"""Policy gRPC servicer: converts, calls :class:`policy.service.PolicyService`, converts back.
Converters (``to_proto``) live here, in one place; no logic."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from policy.controller_client import sample_to_proto, topo_to_proto
from policy.service import DecisionRecord, ForecastView, PolicyService
from remp import validate
from remp.grpc_util import rpc_errors
from remp.policy.v1 import policy_pb2, policy_pb2_grpc

MODE_TO_PROTO = {"off": policy_pb2.MODE_OFF, "advisory": policy_pb2.MODE_ADVISORY,
                 "auto": policy_pb2.MODE_AUTO}
MODE_FROM_PROTO = {v: k for k, v in MODE_TO_PROTO.items()}


def _ts(t_s: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(t_s * 1e9))
    return ts


def _score_to_proto(c) -> policy_pb2.CandidateScore:  # noqa: ANN001 - either score type
    return policy_pb2.CandidateScore(
        topology=topo_to_proto(c.topology), expected_goodput=c.expected_goodput,
        switch_cost=c.switch_cost, score=c.score,
        expected_slo_loss=getattr(c, "expected_slo_loss", 0.0),
        slo_capacity_rps=getattr(c, "slo_capacity_rps", 0.0),
        gpus=getattr(c, "gpus", 0) or c.topology.world_size)


def recommendation_to_proto(rec: DecisionRecord) -> policy_pb2.Recommendation:
    d = rec.decision
    r = policy_pb2.Recommendation(
        node=rec.node, current=topo_to_proto(d.current), recommended=topo_to_proto(d.recommended),
        switch=d.switch, reason=f"[{d.reason}] {rec.reason_line()}",
        scores=[_score_to_proto(c) for c in d.scores], at=_ts(d.t_s),
        forecaster=d.forecaster, forecast_rps=d.forecast_rps, decision_id=rec.id)
    i = rec.impact
    if i is not None:
        r.objective, r.profile = i.objective, i.profile
        r.expected_saving_gpu_hours = i.expected_saving_gpu_hours
        r.saving_horizon_seconds = i.saving_horizon_s
        r.expected_slo_loss, r.overload_risk = i.expected_slo_loss, i.overload_risk
        r.gpus, r.host_gpus = i.gpus, i.host_gpus
        r.released_gpus.extend(i.released_gpus)
        r.unreleased_gpus.extend(i.unreleased_gpus)
        r.error_budget_requests = i.error_budget
        r.expected_tpot_saving_ms = i.expected_tpot_saving_ms
    return r


def decision_to_proto(rec: DecisionRecord) -> policy_pb2.Decision:
    return policy_pb2.Decision(id=rec.id, recommendation=recommendation_to_proto(rec),
                               mode=MODE_TO_PROTO.get(rec.mode, policy_pb2.MODE_UNSPECIFIED),
                               switch_id=rec.switch_id, outcome=rec.outcome)


def forecast_to_proto(f: ForecastView) -> policy_pb2.Forecast:
    return policy_pb2.Forecast(
        node=f.node, forecaster=f.forecaster,
        points=[policy_pb2.ForecastPoint(at=_ts(t), requests_per_second=m, lower=lo, upper=hi)
                for t, m, lo, hi in zip(f.starts_s, f.mean, f.lower, f.upper)],
        observed=[sample_to_proto(s) for s in f.observed], backtest_mae=f.backtest_error)


class PolicyServicer(policy_pb2_grpc.PolicyServicer):
    def __init__(self, core: PolicyService):
        self.core = core

    @rpc_errors
    async def GetForecast(self, request, context):
        validate.name("node", request.node, required=True)
        return forecast_to_proto(await self.core.get_forecast(request.node,
                                                              request.horizon_seconds))

    @rpc_errors
    async def GetRecommendation(self, request, context):
        validate.name("node", request.node, required=True)
        return recommendation_to_proto(await self.core.get_recommendation(request.node))

    @rpc_errors
    async def SetMode(self, request, context):
        validate.name("node", request.node)
        mode = await self.core.set_mode(MODE_FROM_PROTO.get(request.mode, str(request.mode)),
                                        request.node)
        return policy_pb2.SetModeResponse(mode=MODE_TO_PROTO[mode])

    @rpc_errors
    async def ListDecisions(self, request, context):
        validate.name("node", request.node)
        validate.name("page_token", request.page_token, max_len=32)
        recs, nxt = await self.core.list_decisions(request.node, request.page_size,
                                                   request.page_token)
        return policy_pb2.ListDecisionsResponse(decisions=[decision_to_proto(r) for r in recs],
                                                next_page_token=nxt)
