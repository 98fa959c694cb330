"""Decision core: which topology for the coming horizon (pure; the clock is an argument).

Inputs per tick: the policy state (current topology, past switch times), the time now, and a
forecast (mean and scenario rates for the next windows). Output: a ``Decision`` with a score per
candidate, in requests (numbers, not prose), plus a short text.

Objective, in requests over the horizon:
- G[T, h] = expected SLO goodput of topology T in window h = sum_k w_k g_T(scenario_k[h]) * window
  (g_T from the profile; scenarios from the forecaster's recent errors, so a topology that would be
  overloaded if traffic came in 20 % above the forecast pays for that risk).
- Switch cost c(S -> T, λ) = requests arriving during the measured downtime D that would have met
  the SLO (λ·D·A_T(λ)) + in-flight requests whose TPOT the stall pushes over the target
  (B_S(λ)·(A_S(λ) - A_S(λ; TPOT + D/output_tokens))).
- Commitment: a switch binds for the minimum dwell time, so candidates are compared on equal
  terms: score(T) = sum over the dwell windows of G[T, h] - c(current -> T) + V(T), where V is the
  best continuation after the dwell (a small DP over the rest of the horizon, switches allowed,
  costs paid). The current topology's score is the same with no switch cost.
- Switch iff the best candidate's gain over the current one exceeds the hysteresis threshold
  (a fraction of the current topology's expected goodput over the dwell windows, raised as the
  daily budget is used up), the dwell time since the last switch has passed (unless the gain is
  an emergency: above ``dwell_override`` of that goodput) and the rolling-24-h budget has room.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from policy.forecast import Forecast
from policy.profiles import SLO, GoodputCurve, Profile
from remp.topology import Topology

DAY_S = 86400.0


@dataclass(frozen=True)
class PolicyConfig:
    horizon_s: float = 3 * 3600.0  # how far the forecast and the continuation DP look
    min_dwell_s: float = 1800.0  # no switch sooner than this after the last one (but emergencies)
    max_switches_per_day: int = 6  # rolling 24 h
    hysteresis: float = 0.05  # required gain / expected goodput over the dwell windows
    dwell_override: float = 0.25  # a gain this large may break the dwell time (never the budget)

    def __post_init__(self) -> None:
        if self.horizon_s <= 0 or self.min_dwell_s < 0 or self.max_switches_per_day < 0:
            raise ValueError("horizon must be positive, dwell and budget non-negative")
        if self.hysteresis < 0 or self.dwell_override <= 0:
            raise ValueError("hysteresis must be >= 0 and dwell_override > 0")

    def horizon_windows(self, window_s: float) -> int:
        return max(1, int(math.ceil(self.horizon_s / window_s - 1e-9)))

    def dwell_windows(self, window_s: float) -> int:
        return max(1, int(math.ceil(self.min_dwell_s / window_s - 1e-9)))


@dataclass(frozen=True)
class PolicyState:
    current: Topology
    last_switch_s: float = -math.inf
    switch_times_s: tuple[float, ...] = ()

    def switches_in_last(self, now_s: float, span_s: float) -> int:
        """Switches in the ``span_s`` before ``now_s`` (0 for a span of 0)."""
        return sum(1 for t in self.switch_times_s if now_s - t < span_s)

    def switches_in_last_day(self, now_s: float) -> int:
        return self.switches_in_last(now_s, DAY_S)

    def after(self, decision: "Decision") -> "PolicyState":
        """The state once the decision is carried out (a switch that completed)."""
        if not decision.switch:
            return self
        recent = tuple(t for t in self.switch_times_s if decision.t_s - t < DAY_S)
        return PolicyState(decision.recommended, decision.t_s, recent + (decision.t_s,))


@dataclass(frozen=True)
class CandidateScore:
    """Field names follow remp.policy.v1.CandidateScore; all in requests over the horizon."""

    topology: Topology
    expected_goodput: float
    switch_cost: float
    score: float


@dataclass(frozen=True)
class Decision:
    t_s: float
    current: Topology
    recommended: Topology
    switch: bool
    reason: str  # switch | stay-best | hold-hysteresis | hold-dwell | hold-budget
    text: str
    scores: tuple[CandidateScore, ...]
    gain: float  # score(best) - score(current), requests
    threshold: float  # gain needed to switch, requests
    dwell_left_s: float
    switches_last_day: int
    forecaster: str
    forecast_rps: float  # mean forecast rate over the dwell windows


class Scorer:
    """Goodput curves and switch costs for one profile and SLO (precomputed once)."""

    def __init__(self, profile: Profile, slo: SLO) -> None:
        self.profile = profile
        self.slo = slo
        self.topologies = profile.topologies
        self.curves: Mapping[Topology, GoodputCurve] = profile.goodput_curves(slo)
        self._grid = np.linspace(0.0, 1.5 * profile.best_capacity_rps, 121)
        self._cost_grid: dict[tuple[Topology, Topology], np.ndarray] = {}

    def goodput_rps(self, topo: Topology, rates: np.ndarray | float) -> np.ndarray:
        return self.curves[topo](np.nan_to_num(np.asarray(rates, dtype=float)))

    def attainment(self, topo: Topology, rate: float, tpot_extra_s: float = 0.0) -> float:
        c = self.profile.curve(topo)
        return float(c.attainment(np.array([rate]), self.slo, tpot_extra_s=tpot_extra_s)[0])

    def switch_cost(self, src: Topology, dst: Topology, rate: float) -> float:
        """Requests that miss the SLO because of one switch at offered ``rate`` (req/s)
        (interpolated on a precomputed grid)."""
        if src == dst or not rate > 0:
            return 0.0
        key = (src, dst)
        if key not in self._cost_grid:
            self._cost_grid[key] = np.array([self.switch_cost_exact(src, dst, float(x)) for x in self._grid])
        return float(np.interp(rate, self._grid, self._cost_grid[key]))

    def switch_cost_exact(self, src: Topology, dst: Topology, rate: float) -> float:
        if src == dst or not rate > 0:
            return 0.0
        d = self.profile.downtime_s(src, dst)
        held = rate * d * self.attainment(dst, rate)
        stall = d / max(self.profile.output_tokens, 1)
        inflight = self.profile.in_flight(src, rate) * max(
            0.0, self.attainment(src, rate) - self.attainment(src, rate, tpot_extra_s=stall))
        return held + inflight

    def expected_goodput(self, forecast: Forecast, horizon: int) -> np.ndarray:
        """G[T, h] in requests per window, expectation over the forecast scenarios."""
        sc = forecast.scenarios[:, :horizon]
        w = forecast.weights[:, None]
        return np.stack([(w * self.goodput_rps(t, sc)).sum(axis=0) * forecast.window_s
                         for t in self.topologies])


def decide(state: PolicyState, now_s: float, forecast: Forecast, scorer: Scorer,
           config: PolicyConfig = PolicyConfig()) -> Decision:
    topos = list(scorer.topologies)
    if state.current not in topos:
        raise ValueError(f"current topology {state.current} is not in the profile")
    W = forecast.window_s
    H = min(config.horizon_windows(W), len(forecast.mean))
    D = min(config.dwell_windows(W), H)
    G = scorer.expected_goodput(forecast, H)  # [T, H]
    n = len(topos)
    mean = forecast.mean[:H]
    # continuation after the dwell: V[h][T] = best goodput from window h on, starting in T
    V = np.zeros(n)
    for h in range(H - 1, D - 1, -1):
        cost = np.array([[scorer.switch_cost(a, b, float(mean[h])) for b in topos] for a in topos])
        V = G[:, h] + np.max(V[None, :] - cost, axis=1)
    cur = topos.index(state.current)
    rate0 = float(mean[0])
    committed = G[:, :D].sum(axis=1)
    costs = np.array([scorer.switch_cost(state.current, t, rate0) for t in topos])
    total = committed + V
    score = total - costs
    best = int(np.argmax(score))
    gain = float(score[best] - score[cur])

    used = state.switches_in_last_day(now_s)
    budget = config.max_switches_per_day
    left = budget - used
    # the last switches of the day are kept for larger gains: threshold x budget / switches left
    scale = budget / left if left > 0 else math.inf
    base = max(float(committed[cur]), 1e-9)
    threshold = config.hysteresis * base * scale
    dwell_left = max(0.0, state.last_switch_s + config.min_dwell_s - now_s)
    emergency = gain > config.dwell_override * base

    if best == cur:
        reason, switch = "stay-best", False
    elif left <= 0:
        reason, switch = "hold-budget", False
    elif gain <= threshold:
        reason, switch = "hold-hysteresis", False
    elif dwell_left > 0 and not emergency:
        reason, switch = "hold-dwell", False
    else:
        reason, switch = "switch", True
    target = topos[best] if switch else state.current
    fr = float(mean[:D].mean())
    texts = {
        "stay-best": f"{state.current} is best for the forecast {fr:.3g} req/s",
        "hold-budget": f"{topos[best]} would gain {gain:.0f} req but {used}/{budget} switches used in 24 h",
        "hold-hysteresis": f"{topos[best]} gains {gain:.0f} req <= threshold {threshold:.0f}",
        "hold-dwell": f"{topos[best]} gains {gain:.0f} req but dwell has {dwell_left:.0f} s left",
        "switch": (f"switch {state.current} -> {topos[best]}: +{gain:.0f} req over the horizon "
                   f"(cost {costs[best]:.0f}) at {fr:.3g} req/s" + (" [emergency]" if emergency and dwell_left > 0 else "")),
    }
    scores = tuple(CandidateScore(t, float(total[i]), float(costs[i]), float(score[i])) for i, t in enumerate(topos))
    return Decision(now_s, state.current, target, switch, reason, texts[reason], scores, gain,
                    threshold, dwell_left, used, forecast.forecaster, fr)


@dataclass
class AutoPolicy:
    """Forecaster chooser + decision core for one node, fed one window at a time."""

    scorer: Scorer
    window_s: float
    state: PolicyState
    config: PolicyConfig = field(default_factory=PolicyConfig)
    chooser: object = None  # policy.forecast.Chooser; built in __post_init__ when None

    def __post_init__(self) -> None:
        from policy.forecast import Chooser

        if self.chooser is None:
            self.chooser = Chooser(self.window_s, self.config.horizon_windows(self.window_s))

    def observe(self, t_start_s: float, rate: float) -> None:
        self.chooser.update(t_start_s, rate)  # type: ignore[attr-defined]

    def tick(self, now_s: float, commit: bool = True) -> Decision:
        """Decide for the window starting at ``now_s``; ``commit`` applies a switch to the state
        (auto mode); advisory mode passes False and only records the decision."""
        fc = self.chooser.forecast()  # type: ignore[attr-defined]
        d = decide(self.state, now_s, fc, self.scorer, self.config)
        if commit:
            self.state = self.state.after(d)
        return d


def best_static(scorer: Scorer, rates: Sequence[float]) -> Topology:
    """The topology with the most goodput at these rates (no switching)."""
    r = np.nan_to_num(np.asarray(rates, dtype=float))
    vals = [float(scorer.goodput_rps(t, r).sum()) for t in scorer.topologies]
    return scorer.topologies[int(np.argmax(vals))]


__all__ = ["AutoPolicy", "CandidateScore", "Decision", "PolicyConfig", "PolicyState", "Scorer",
           "best_static", "decide", "replace"]
