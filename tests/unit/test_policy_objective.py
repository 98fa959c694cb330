"""The live policy service with the operator objectives (``gpu-hours``, ``latency``): the real
decision core (``policy.scale.decide_scale``), a virtual clock (``tick(now)``), and an in-memory
controller and decision store behind the service's ports (``ControllerPort``,
``DecisionStorePort``) that behave like the real ones for what the policy calls: Reconfigure
refuses a target that is not a candidate and switches the node otherwise."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from policy.calibrate import CalibrationConfig, calibrated_profile, mean_ttft
from policy.config import PolicySettings
from policy.decide import DAY_S, PolicyConfig
from policy.profiles import Profile
from policy.scale import CapacityTable, ScaleConfig, observed_growth
from policy.service import (DecisionRecord, NodeView, ObjectiveDecision, PolicyService,
                            ReconfigureResult, Sample, SwitchResult, Window, error_budget,
                            scale_inputs)
from policy.servicer import recommendation_to_proto
from remp.errors import InvalidArgument, NotFound
from remp.topology import Topology
from tests.policy_profiles import two_gpu_profile

TP1PP1, TP2PP1, TP1PP2 = Topology(1, 1), Topology(2, 1), Topology(1, 2)
W = 10.0


def scale_profile() -> Profile:
    """Synthetic (not measured): one and two GPUs; SLO capacities 1.48 (TP1PP1), 2.96 (TP2PP1)
    and 3.33 req/s (TP1PP2, the whole host's best); TPOT grows with load."""
    return two_gpu_profile("scale-test", tpot_p50_ms=(10, 12, 15, 30))


class MemoryController:
    """The controller as the policy sees it: nodes, their heartbeat samples, Reconfigure (refuses
    a non-candidate, switches at once otherwise: GetSwitch says SUCCEEDED) and
    RecordRecommendation."""

    def __init__(self) -> None:
        self.views: dict[str, NodeView] = {}
        self.samples: dict[str, list[Sample]] = {}
        self.calls: list[tuple] = []
        self.outcomes: list[SwitchResult] = []  # GetSwitch answers to give first, in order

    def add(self, name: str, at: Topology, candidates=(TP1PP1, TP2PP1, TP1PP2)) -> None:
        self.views[name] = NodeView(name, at, tuple(candidates), "ready")
        self.samples[name] = []

    def push(self, name: str, rate: float, t_from: float, t_to: float,
             tpot_s: float = 0.0, ttft_s: float = 0.0) -> None:
        """One-second heartbeat samples at ``rate`` req/s over (t_from, t_to]; with ``tpot_s``
        (``ttft_s``), every request finished (at its first token) in a sample had that mean
        TPOT (TTFT)."""
        for i in range(int(t_from) + 1, int(t_to) + 1):
            n = math.floor(rate * i + 1e-9) - math.floor(rate * (i - 1) + 1e-9)
            self.samples[name].append(Sample(float(i), 1.0, n, tpot_s_sum=n * tpot_s,
                                             tpot_requests=n if tpot_s > 0 else 0,
                                             ttft_s_sum=n * ttft_s,
                                             ttft_requests=n if ttft_s > 0 else 0))

    async def list_nodes(self) -> list[NodeView]:
        return list(self.views.values())

    async def traffic(self, node, since_s, limit):
        if node not in self.views:
            raise NotFound(node)
        return [s for s in self.samples[node] if since_s is None or s.at_s > since_s]

    async def reconfigure(self, node, target, request_id, reason) -> ReconfigureResult:
        self.calls.append(("reconfigure", node, target, request_id, reason))
        v = self.views[node]
        if target not in v.candidates:
            raise InvalidArgument(f"target {target} is not a candidate of this node")
        if v.observed == target:
            return ReconfigureResult("", noop=True)
        self.views[node] = replace(v, observed=target)
        return ReconfigureResult(f"sw-{len(self.calls)}")

    async def switch(self, switch_id) -> SwitchResult:
        self.calls.append(("get_switch", switch_id))
        return self.outcomes.pop(0) if self.outcomes else SwitchResult("succeeded")

    async def record_recommendation(self, node, recommended, reason, decision_id) -> None:
        self.calls.append(("recommend", node, recommended, reason, decision_id))


class MemoryStore:
    def __init__(self) -> None:
        self.docs: list[str] = []
        self.modes: dict[str, str] = {}

    async def load(self, limit):
        return [json.loads(d) for d in self.docs[-limit:]], dict(self.modes)

    async def append(self, doc, keep):
        self.docs = (self.docs + [json.dumps(doc)])[-keep:]

    async def save_modes(self, modes):
        self.modes = dict(modes)


def cfg(**kw) -> ScaleConfig:
    """Spans of a few 10-s windows so a test runs in virtual minutes: recent 3 windows, peak
    over 6, horizon 10, dwell 2 windows (the defaults' windows scaled down)."""
    base = dict(horizon_s=100.0, up_lookahead_s=30.0, down_cover_s=30.0, recent_s=30.0,
                peak_s=60.0)
    base.update(kw)
    return ScaleConfig(**base)


def service(ctl, objective="gpu-hours", store=None, mode="advisory", follow_s=10.0,
            **kw) -> PolicyService:
    return PolicyService(scale_profile(), ctl, config=PolicyConfig(horizon_s=100.0), window_s=W,
                         default_mode=mode, objective=objective, scale=cfg(**kw), store=store,
                         follow_s=follow_s)


# ------------------------------------------------------------------------------ gpu-hours

async def test_low_load_scales_down_one_world_size_after_warm_up_with_its_impact():
    ctl = MemoryController()
    ctl.add("n1", TP2PP1)
    svc = service(ctl)
    ctl.push("n1", 0.3, 1000, 1025)
    (first,) = await svc.tick(1025.0)  # two windows seen: not enough to release GPUs
    assert isinstance(first.decision, ObjectiveDecision)
    assert first.decision.reason == "hold-warmup" and not first.decision.switch
    ctl.push("n1", 0.3, 1025, 1060)
    (rec,) = await svc.tick(1060.0)
    d, imp = rec.decision, rec.impact
    assert d.switch and d.reason == "scale-down" and d.recommended == TP1PP1
    assert d.objective == "gpu-hours" and d.scale.profile == "scale-test"
    # what it states: saving vs the whole host, risk, released ranks, profile
    assert imp.objective == "gpu-hours" and imp.profile == "scale-test"
    assert (imp.gpus, imp.host_gpus, imp.released_gpus) == (1, 2, (1,))
    assert imp.expected_saving_gpu_hours == pytest.approx(1 * imp.saving_horizon_s / 3600)
    assert imp.saving_horizon_s >= W and imp.expected_slo_loss <= 0.008
    assert imp.error_budget > 0 and 0 <= imp.overload_risk <= 1
    # per candidate: the expected loss and SLO capacity the choice came from
    by = {c.topology: c for c in d.scores}
    assert set(by) == {TP1PP1, TP2PP1, TP1PP2} and by[TP1PP2].expected_slo_loss == 0
    assert by[TP1PP1].slo_capacity_rps == pytest.approx(1.479, abs=0.01)
    # advisory: recorded at the controller once, with the numbers in the reason
    assert rec.outcome == "recommended TP1PP1"
    (call,) = [c for c in ctl.calls if c[0] == "recommend"]
    assert call[2] == TP1PP1 and call[4] == rec.id
    assert "releases GPU 1" in call[3] and "profile scale-test" in call[3]
    assert "GPU-h vs the whole host" in call[3] and "expected SLO loss" in call[3]
    # GetRecommendation states the same
    r = recommendation_to_proto(await svc.get_recommendation("n1"))
    assert r.objective == "gpu-hours" and r.profile == "scale-test" and r.decision_id == rec.id
    assert r.expected_saving_gpu_hours == pytest.approx(imp.expected_saving_gpu_hours)
    assert r.expected_slo_loss == pytest.approx(imp.expected_slo_loss)
    assert (r.gpus, r.host_gpus, list(r.released_gpus)) == (1, 2, [1])
    assert {(s.topology.tp, s.topology.pp): s.gpus for s in r.scores}[(1, 1)] == 1
    assert not [c for c in ctl.calls if c[0] == "reconfigure"]


async def scaled_down_in_auto(ctl: MemoryController) -> tuple[PolicyService, DecisionRecord]:
    """A 2-GPU node in auto mode at 0.3 req/s: after the warm-up, its scale-down to one GPU."""
    ctl.add("n1", TP2PP1)
    svc = service(ctl, mode="auto")
    ctl.push("n1", 0.3, 1000, 1060)
    await svc.tick(1025.0)
    (down,) = await svc.tick(1060.0)
    return svc, down


async def test_auto_releases_gpus_then_scales_up_at_once():
    ctl = MemoryController()
    svc, down = await scaled_down_in_auto(ctl)
    assert down.decision.recommended == TP1PP1
    assert down.outcome == f"accepted: switch {down.switch_id} succeeded"
    (call,) = [c for c in ctl.calls if c[0] == "reconfigure"]
    assert call[2] == TP1PP1 and call[3] == down.id  # request id = decision id
    assert ctl.views["n1"].observed == TP1PP1 and down.switch_id
    st = svc.nodes["n1"].scale_state
    assert st.current == TP1PP1 and st.last_switch_s == 1060.0 and st.switch_times_s == (1060.0,)
    # the load jumps past TP1PP1's SLO capacity: up at once (no dwell), to the whole host
    ctl.push("n1", 3.0, 1060, 1082)
    (up,) = await svc.tick(1082.0)
    assert up.decision.reason == "scale-up" and up.decision.switch, up.decision.text
    assert up.decision.recommended.world_size == 2
    assert up.outcome == f"accepted: switch {up.switch_id} succeeded"
    assert up.impact.released_gpus == () and up.impact.expected_saving_gpu_hours == 0
    assert ctl.views["n1"].observed == up.decision.recommended
    assert svc.nodes["n1"].scale_state.switch_times_s == (1060.0, 1082.0)


async def test_parked_ranks_that_keep_their_memory_save_nothing_and_hold_the_next_scale_down():
    """The agents report what each parked rank holds (NodeState.workers). A node whose parked rank
    kept its memory (e.g. --cache-runners) is not credited with a saving, and once it is back on
    the whole host the policy does not park ranks again to free no GPU (a scale-up is never held:
    its decision is unchanged)."""
    ctl = MemoryController()
    svc, down = await scaled_down_in_auto(ctl)
    assert down.decision.recommended == TP1PP1 and down.impact.expected_saving_gpu_hours > 0
    assert down.impact.unreleased_gpus == ()  # nothing was reported parked yet
    # the agent's next heartbeat: rank 1 is STANDBY but still holds its runner
    ctl.views["n1"] = replace(ctl.views["n1"], unreleased=(1,))
    ctl.push("n1", 0.3, 1060, 1070)
    (stay,) = await svc.tick(1070.0)
    assert stay.decision.recommended == TP1PP1 and not stay.decision.switch
    i = stay.impact
    assert (i.released_gpus, i.unreleased_gpus, i.expected_saving_gpu_hours) == ((1,), (1,), 0)
    assert "not released: 1 keep their memory" in i.line()
    assert list(recommendation_to_proto(stay).unreleased_gpus) == [1]
    # an operator switches it back to the whole host: every rank active, none reported parked
    ctl.views["n1"] = replace(ctl.views["n1"], observed=TP2PP1, unreleased=())
    # still quiet, long past the dwell: the scale-down it would take is held, saying why
    ctl.push("n1", 0.3, 1070, 1400)
    recs = [await svc.tick(t) for t in range(1080, 1401, 10)]
    held = [r for (r,) in recs if r.decision.reason == "hold-unreleased"]
    assert held and not any(r.decision.switch for (r,) in recs)
    assert "parked ranks 1 were not released" in held[-1].decision.text
    assert held[-1].impact.expected_saving_gpu_hours == 0
    assert ctl.views["n1"].observed.world_size == 2
    # a later report shows a parked rank released (the cache let go): scale-downs resume
    ctl.views["n1"] = replace(ctl.views["n1"], released=(1,))
    ctl.push("n1", 0.3, 1400, 1410)
    (again,) = await svc.tick(1410.0)
    assert again.decision.reason == "scale-down" and again.decision.recommended == TP1PP1


async def _calibrated_run(rate: float, host_slowdown: float, enabled: bool = True,
                          host_ttft_slowdown: float | None = None):
    """A 2-GPU node at ``rate`` whose requests show the TPOT of the profile taken as
    ``host_slowdown`` x slower (and, with ``host_ttft_slowdown``, the mean TTFT of its TTFT
    taken as that much slower): the decisions of ticks 1020 ... 1100 s and the service."""
    ctl = MemoryController()
    ctl.add("n1", TP2PP1)
    svc = PolicyService(scale_profile(), ctl, config=PolicyConfig(horizon_s=100.0), window_s=W,
                        objective="gpu-hours", scale=cfg(),
                        calibration=CalibrationConfig(enabled=enabled, min_requests=5,
                                                      min_total=30))
    tpot = scale_profile().slowed(host_slowdown).curve(TP2PP1).at(rate)[2]
    ttft = 0.0
    if host_ttft_slowdown is not None:
        host = calibrated_profile(scale_profile(), host_slowdown, host_ttft_slowdown)
        ttft = mean_ttft(host.curve(TP2PP1), rate)
    ctl.push("n1", rate, 1000, 1100, tpot, ttft)
    return [(await svc.tick(float(t)))[0] for t in range(1020, 1101, 10)], svc


async def test_a_host_slower_than_its_profile_is_calibrated_from_its_tpot(caplog):
    """The node's heartbeats carry its requests' TPOT; once enough requests finished, the policy
    decides on the profile taken as the observed slowdown x slower and says so."""
    blind, _ = await _calibrated_run(1.0, 1.6, enabled=False)
    assert {r.decision.reason for r in blind} == {"stay"}
    assert {r.impact.profile for r in blind} == {"scale-test"}
    seen, svc = await _calibrated_run(1.0, 1.6)
    assert svc.nodes["n1"].slowdown == pytest.approx(1.6)
    # the first tick has too few finished requests to say anything: the profile as given
    assert seen[0].impact.profile == "scale-test" and seen[0].decision.reason == "stay"
    # then: TP2PP1 at 1.0 req/s loses more than the budget on a 1.6x slower host, so the
    # policy moves to the 2-GPU topology with the higher SLO capacity, stating the profile
    last = seen[-1]
    assert last.decision.reason == "scale-up" and last.decision.recommended == TP1PP2
    assert last.impact.profile == "scale-test-calibrated1.6"
    assert last.decision.scale.profile == "scale-test-calibrated1.6"
    assert recommendation_to_proto(last).profile == "scale-test-calibrated1.6"
    assert "calibrated" in svc.nodes["n1"].last.impact.profile
    # a host as fast as its profile: nothing changes (and never faster than configured)
    same, svc1 = await _calibrated_run(0.5, 1.0)
    plain, _ = await _calibrated_run(0.5, 1.0, enabled=False)
    assert svc1.nodes["n1"].slowdown == 1.0
    assert [(r.decision.reason, r.decision.recommended, r.impact.profile) for r in same] == \
        [(r.decision.reason, r.decision.recommended, r.impact.profile) for r in plain]
    fast, svc2 = await _calibrated_run(0.5, 0.7)
    assert svc2.nodes["n1"].slowdown == 1.0 and {r.impact.profile for r in fast} == {"scale-test"}
    # the gauge operators watch (the same process-wide registry the service reports to)
    from prometheus_client import REGISTRY
    assert REGISTRY.get_sample_value("remp_policy_profile_slowdown", {"node": "n1"}) == 1.0
    await svc.tick(1110.0)
    assert REGISTRY.get_sample_value("remp_policy_profile_slowdown", {"node": "n1"}) == \
        pytest.approx(1.6)


async def test_a_host_whose_ttft_alone_is_slower_than_its_profile_is_calibrated_from_its_ttft():
    """TPOT as the profile says, TTFT 1.6x the profile's: the policy decides on the profile
    with its TTFT taken as 1.6x slower (its TPOT as is) and names it so; with heartbeats that
    carry no TTFT, or a TTFT faster than the TPOT says, the TTFT follows the TPOT's slowdown."""
    seen, svc = await _calibrated_run(1.0, 1.0, host_ttft_slowdown=1.6)
    n = svc.nodes["n1"]
    assert (n.slowdown, n.ttft_slowdown) == (1.0, pytest.approx(1.6))
    assert seen[0].impact.profile == "scale-test"
    assert seen[-1].impact.profile == "scale-test-calibrated1-ttft1.6"
    assert seen[-1].decision.scale.profile == "scale-test-calibrated1-ttft1.6"
    from prometheus_client import REGISTRY
    assert REGISTRY.get_sample_value("remp_policy_profile_ttft_slowdown", {"node": "n1"}) == \
        pytest.approx(1.6)
    both, svc2 = await _calibrated_run(1.0, 1.6, host_ttft_slowdown=1.6)
    assert (svc2.nodes["n1"].slowdown, svc2.nodes["n1"].ttft_slowdown) == \
        (pytest.approx(1.6), pytest.approx(1.6))
    assert both[-1].impact.profile == "scale-test-calibrated1.6"
    only_tpot, svc3 = await _calibrated_run(1.0, 1.6)
    assert svc3.nodes["n1"].ttft_slowdown == pytest.approx(1.6)
    # a TTFT that says faster than the TPOT does: the TTFT is taken as slow as the TPOT says
    fast_ttft, svc4 = await _calibrated_run(1.0, 1.6, host_ttft_slowdown=1.0)
    assert svc4.nodes["n1"].ttft_slowdown == pytest.approx(1.6)
    assert fast_ttft[-1].impact.profile == "scale-test-calibrated1.6"


def test_windows_carry_the_tpot_and_ttft_of_the_requests_that_finished_in_them():
    from policy.service import WindowAggregator
    a = WindowAggregator(10.0)
    for i in range(1, 21):  # 1-s samples, 2 requests each, TPOT 20 ms then 40 ms; TTFT 0.3 / 0.5 s
        tpot, ttft = (0.02, 0.3) if i <= 10 else (0.04, 0.5)
        a.add(Sample(float(i), 1.0, 2, tpot_s_sum=2 * tpot, tpot_requests=2, ttft_s_sum=ttft,
                     ttft_requests=1))
    a.add(Sample(21.0, 1.0, 0))
    (w0, r0, t0, n0, f0, m0), (w1, r1, t1, n1, f1, m1) = a.complete_latency(21.0)
    assert (w0, r0, n0, m0, w1, n1, m1) == (0.0, 2.0, 20.0, 10.0, 10.0, 20.0, 10.0)
    assert t0 == pytest.approx(0.02) and t1 == pytest.approx(0.04)
    assert f0 == pytest.approx(0.3) and f1 == pytest.approx(0.5)
    b = WindowAggregator(10.0)
    b.add(Sample(10.0, 10.0, 5))
    b.add(Sample(20.0, 10.0, 5))
    (_, rate, tpot, n, ttft, m), _ = b.complete_latency(20.0)  # none reported: NaN, none
    assert rate == 0.5 and math.isnan(tpot) and n == 0 and math.isnan(ttft) and m == 0
    assert b.complete(20.0) == []  # emitted once


def test_node_view_reads_which_parked_ranks_the_agent_reported_released():
    from policy.controller_client import node_view
    from remp.common.v1 import types_pb2
    from remp.controller.v1 import controller_pb2
    S, A = types_pb2.WORKER_STATE_STANDBY, types_pb2.WORKER_STATE_ACTIVE
    st = controller_pb2.NodeState(node="n1", workers=[
        types_pb2.WorkerInfo(rank=0, state=A),
        types_pb2.WorkerInfo(rank=3, state=S, released=True),
        types_pb2.WorkerInfo(rank=1, state=S, model_bytes=7),
        types_pb2.WorkerInfo(rank=2, state=S)])
    v = node_view(st)
    assert (v.released, v.unreleased) == ((3,), (1, 2))
    assert (node_view(controller_pb2.NodeState(node="n1")).released, v.name) == ((), "n1")


async def test_auto_commits_a_switch_only_once_it_succeeds():
    """The controller answers Reconfigure before the agent has switched: the policy follows the
    switch (GetSwitch) and commits its state, dwell and budget only on SUCCEEDED — in the same
    tick when it ends within follow_s, else on the tick that finds it over."""
    ctl = MemoryController()
    ctl.add("n1", TP2PP1)
    svc = service(ctl, mode="auto", follow_s=0.05)
    ctl.push("n1", 0.3, 1000, 1060)
    await svc.tick(1025.0)
    ctl.outcomes = [SwitchResult("running")] * 1000  # still running when the tick gives up
    (down,) = await svc.tick(1060.0)
    assert down.decision.recommended == TP1PP1 and down.switch_id
    assert down.outcome == (f"accepted: switch {down.switch_id} still running after 0.05 s "
                            "(committed when it succeeds)")
    n = svc.nodes["n1"]
    assert n.scale_state.current == TP2PP1 and n.scale_state.switch_times_s == ()
    assert n.following is not None and n.following.switch_id == down.switch_id
    # next tick: still running, so no decision for the node (and no second Reconfigure)
    ctl.outcomes = [SwitchResult("running")]
    ctl.push("n1", 0.3, 1060, 1070)
    assert await svc.tick(1070.0) == []
    assert len([c for c in ctl.calls if c[0] == "reconfigure"]) == 1
    # then it succeeded: committed (the switch counted from its decision), the node decided again
    ctl.outcomes = []
    ctl.push("n1", 0.3, 1070, 1080)
    recs = await svc.tick(1080.0)
    assert down.outcome == f"accepted: switch {down.switch_id} succeeded"
    assert n.following is None and n.scale_state.current == TP1PP1
    assert n.scale_state.switch_times_s == (1060.0,)
    assert all(not r.decision.switch for r in recs)


async def test_auto_rolled_back_switch_commits_nothing_and_is_asked_again_later():
    ctl = MemoryController()
    ctl.add("n1", TP2PP1)
    svc = service(ctl, mode="auto")
    svc.retry_backoff_s = 30.0
    ctl.push("n1", 0.3, 1000, 1060)
    await svc.tick(1025.0)
    ctl.outcomes = [SwitchResult("running"),
                    SwitchResult("rolled_back", "KV_MIGRATION_FAILED", "injected")]
    (down,) = await svc.tick(1060.0)
    ctl.views["n1"] = replace(ctl.views["n1"], observed=TP2PP1)  # the agent rolled back
    assert down.outcome == (f"rolled back: switch {down.switch_id} (request {down.id}) ended "
                            "ROLLED_BACK KV_MIGRATION_FAILED: injected; nothing committed (a new "
                            "request after 30 s if still wanted)")
    n = svc.nodes["n1"]
    assert n.scale_state.current == TP2PP1 and n.scale_state.switch_times_s == ()
    ctl.push("n1", 0.3, 1060, 1070)
    (wait,) = await svc.tick(1070.0)
    assert wait.outcome.startswith(f"waiting: switch {down.switch_id} to TP1PP1 ended "
                                   "rolled_back; asking again in 20 s"), wait.outcome
    ctl.push("n1", 0.3, 1070, 1100)
    (again,) = await svc.tick(1100.0)
    calls = [c for c in ctl.calls if c[0] == "reconfigure"]
    assert len(calls) == 2 and calls[1][3] == again.id != down.id  # a new request id
    assert again.outcome == f"accepted: switch {again.switch_id} succeeded"
    assert n.scale_state.current == TP1PP1


async def test_only_the_nodes_candidates_are_recommended():
    ctl = MemoryController()
    ctl.add("no-one", TP2PP1, candidates=(TP2PP1, TP1PP2))  # cannot run on one GPU
    ctl.add("no-best", TP1PP1, candidates=(TP1PP1, TP2PP1))  # the profile's best is not offered
    svc = service(ctl)
    ctl.push("no-one", 0.3, 1000, 1100)
    ctl.push("no-best", 2.8, 1000, 1100)
    recs = {r.node: r for r in await svc.tick(1100.0)}
    a, b = recs["no-one"], recs["no-best"]
    assert a.decision.recommended.world_size == 2 and not a.decision.switch
    assert {c.topology for c in a.decision.scores} == {TP2PP1, TP1PP2}
    assert a.impact.host_gpus == 2 and a.impact.released_gpus == ()
    assert b.decision.switch and b.decision.recommended == TP2PP1, b.decision.text
    assert TP1PP2 not in {c.topology for c in b.decision.scores}
    # a Reconfigure for a non-candidate would be refused: none was asked for
    assert all(c[2] in ctl.views[c[1]].candidates for c in ctl.calls)


async def test_latency_keeps_the_whole_host_and_says_so():
    ctl = MemoryController()
    ctl.add("n1", TP1PP1)
    svc = service(ctl, objective="latency")
    ctl.push("n1", 0.3, 1000, 1100)
    (rec,) = await svc.tick(1100.0)
    d = rec.decision
    assert d.objective == "latency" and d.recommended.world_size == 2 and d.switch
    assert rec.impact.objective == "latency" and rec.impact.gpus == 2
    assert rec.impact.expected_saving_gpu_hours == 0 and rec.impact.released_gpus == ()


async def test_goodput_objective_states_its_impact_too():
    ctl = MemoryController()
    ctl.add("n1", TP2PP1)
    svc = service(ctl, objective="goodput")
    ctl.push("n1", 3.2, 1000, 1100)
    (rec,) = await svc.tick(1100.0)
    assert not isinstance(rec.decision, ObjectiveDecision)  # the SLO-goodput core
    assert rec.decision.recommended.world_size == 2  # same world size only
    assert rec.impact.objective == "goodput" and rec.impact.profile == "scale-test"
    assert math.isnan(rec.impact.error_budget)
    assert "objective goodput" in rec.reason_line()


async def test_decisions_and_switch_times_survive_a_restart():
    ctl, store = MemoryController(), MemoryStore()
    ctl.add("n1", TP2PP1)
    svc = service(ctl, store=store, mode="auto")
    await svc.start()
    ctl.push("n1", 0.3, 1000, 1060)
    await svc.tick(1025.0)
    (down,) = await svc.tick(1060.0)
    assert down.outcome == f"accepted: switch {down.switch_id} succeeded"
    again = service(ctl, store=store, mode="advisory")
    await again.start()
    back = {d.id: d for d in again.decisions}[down.id]
    assert isinstance(back.decision, ObjectiveDecision) and back.impact == down.impact
    assert back.decision.scale == down.decision.scale
    assert back.decision.scores == down.decision.scores
    assert back.reason_line() == down.reason_line()
    ctl.push("n1", 0.3, 1060, 1100)
    await again.tick(1100.0)
    # the switch made before the restart still counts against the daily budget
    assert again.nodes["n1"].scale_state.switch_times_s == (1060.0,)


# ------------------------------------------------------------------------------ pure inputs

def test_error_budget_counts_the_last_day_and_todays_losses():
    prof = scale_profile()
    table = CapacityTable(prof, prof.default_slo)
    Wd = 600.0
    day0 = 10 * DAY_S
    # yesterday on the whole host's best at 1 req/s: nothing lost; the budget is 1 % of it
    hist = [Window(day0 - DAY_S + i * Wd, 1.0, table.fixed_best) for i in range(144)]
    now = day0 + Wd
    full = error_budget(table, hist, Wd, day0, 0.99)
    g = float(table.scorer.goodput_rps(table.fixed_best, 1.0)) * Wd
    assert full == pytest.approx(0.01 * 144 * g)
    # today on one GPU above its SLO capacity: what it lost comes off the budget
    hist2 = hist + [Window(day0, 2.0, TP1PP1)]
    lost = (float(table.scorer.goodput_rps(table.fixed_best, 2.0))
            - float(table.scorer.goodput_rps(TP1PP1, 2.0))) * Wd
    lost += table.scorer.switch_cost(table.fixed_best, TP1PP1, 2.0)
    gb2 = float(table.scorer.goodput_rps(table.fixed_best, 2.0)) * Wd
    assert lost > 0
    assert error_budget(table, hist2, Wd, now, 0.99) == pytest.approx(
        0.01 * (143 * g + gb2) - lost)
    # yesterday's losses do not count today; nothing observed: no budget
    assert error_budget(table, [], Wd, now, 0.99) == 0.0


def test_scale_inputs_recent_peak_and_yesterdays_slot():
    prof = scale_profile()
    table = CapacityTable(prof, prof.default_slo)
    Wd = 600.0
    c = ScaleConfig(recent_s=1800.0, peak_s=3600.0)  # 3 recent windows, peak over 6
    n = 144 + 10
    rates = [float(i % 17) for i in range(n)]
    rates[-2] = math.nan
    hist = [Window(i * Wd, r, TP1PP2) for i, r in enumerate(rates)]
    inp = scale_inputs(hist, Wd, c, table, n * Wd)
    assert inp.last_rate == rates[-1]
    assert np.array_equal(inp.recent, np.array(rates[-3:]), equal_nan=True)
    assert inp.recent_peak == np.nanmax(rates[-6:])
    assert inp.seasonal == rates[n - 144]  # the coming window, one day earlier
    day = [r for r in rates[n - 144:] if not math.isnan(r)]  # the last 24 h's observed windows
    assert inp.day_goodput == pytest.approx(float(np.mean(table.scorer.goodput_rps(table.fixed_best, np.array(day)))))
    short = scale_inputs(hist[-20:], Wd, c, table, n * Wd)
    assert math.isnan(short.seasonal) and short.recent.size == 3
    # the last 24 h's peak sizes the day's last scale-up: known once a whole day is observed
    assert inp.day_peak == max(day)
    assert math.isnan(short.day_peak)
    # ... before that, the highest rate so far sizes it (last_up_partial_margin; stop 46)
    assert math.isnan(inp.partial_peak)
    assert short.partial_peak == np.nanmax([w.rate for w in hist[-20:]])
    # the bet's growth from the last 24 h's jumps, the replay's way (missing windows: no traffic)
    # and at least the largest jump of the last bet_recent_s (30 min: 3 windows)
    assert c.bet_recent_windows(Wd) == 3 and ScaleConfig(bet_recent_s=0.0).bet_recent_windows(Wd) == 0
    assert inp.growth == pytest.approx(observed_growth(np.array(rates[n - 144:]), 6, c.bet_growth_quantile, 3))
    quantile_only = scale_inputs(hist, Wd, replace(c, bet_recent_s=0.0), table, n * Wd).growth
    assert quantile_only == pytest.approx(observed_growth(np.array(rates[n - 144:]), 6, c.bet_growth_quantile))
    # the burst memory spans burst_span_s (2 days), not the last 24 h
    long = [Window(i * Wd, 1.0, TP1PP2) for i in range(3 * 144)]
    long[140] = Window(140 * Wd, 41.0, TP1PP2)  # 40 req/s over the hour before: a burst, 2 days + 40 min ago
    assert scale_inputs(long, Wd, c, table, 3 * 144 * Wd).burst == 0.0
    long[150] = Window(150 * Wd, 31.0, TP1PP2)  # inside the 2 days
    assert scale_inputs(long, Wd, c, table, 3 * 144 * Wd).burst == pytest.approx(30.0)
    assert math.isnan(scale_inputs(long, Wd, replace(c, burst_span_s=0.0), table, 3 * 144 * Wd).burst)


def test_settings_objective_defaults():
    s = PolicySettings(controller="127.0.0.1:1")
    assert s.objective == "gpu-hours"
    sc = s.scale_config()
    assert sc.objective == "gpu-hours" and sc.max_switches_per_day == 12 and sc.min_dwell_s == 0
    pc = s.policy_config()
    assert pc.min_dwell_s == 1800 and pc.max_switches_per_day == 6  # goodput's own defaults
    lat = PolicySettings(controller="127.0.0.1:1", objective="latency", min_dwell_seconds=60,
                         max_switches_per_day=4, loss_budget=0.005)
    sc = lat.scale_config()
    assert (sc.objective, sc.min_dwell_s, sc.max_switches_per_day, sc.loss_budget) == (
        "latency", 60, 4, 0.005)
    with pytest.raises(ValueError):
        PolicySettings(controller="127.0.0.1:1", objective="cheapest")
    with pytest.raises(ValueError):
        PolicySettings(controller="127.0.0.1:1", max_switches_per_day=0)
    # the operator's knowledge: a declared burst and a GPU floor reach the core
    op = PolicySettings(controller="127.0.0.1:1", burst_rps=12.5, min_gpus=4).scale_config()
    assert (op.burst_rps, op.min_gpus) == (12.5, 4)
    assert op.over_budget_up and not PolicySettings(controller="127.0.0.1:1",
                                                    hard_switch_budget=True).scale_config().over_budget_up
    assert (sc.burst_rps, sc.min_gpus) == (0.0, 0)
    for bad in ({"burst_rps": float("inf")}, {"burst_rps": -1}, {"min_gpus": -1}):
        with pytest.raises(ValueError):
            PolicySettings(controller="127.0.0.1:1", **bad)


def test_record_json_round_trip_keeps_old_documents_readable():
    # a decision logged before objectives existed (no "kind", no "impact") still loads
    old = {"id": "pd-x-1", "seq": 1, "node": "n", "mode": "advisory", "decision": {
        "t_s": 5.0, "current": "TP2PP1", "recommended": "TP1PP2", "switch": True,
        "reason": "switch", "text": "t", "scores": [["TP2PP1", 1.0, 0.0, 1.0]], "gain": 1.0,
        "threshold": 0.5, "dwell_left_s": 0.0, "switches_last_day": 0, "forecaster": "ewma",
        "forecast_rps": 1.0}}
    rec = DecisionRecord.from_json(old)
    assert rec.impact is None and rec.decision.recommended == TP1PP2
    assert DecisionRecord.from_json(json.loads(json.dumps(rec.to_json()))).to_json() == \
        rec.to_json()
    r = recommendation_to_proto(rec)
    assert r.objective == "" and r.scores[0].gpus == 2
