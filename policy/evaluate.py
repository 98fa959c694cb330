"""Trace replay: the auto policy against fixed topologies, a reactive threshold policy, a
time-of-day schedule and a clairvoyant oracle (pure; the trace is an argument, time is virtual).

Accounting, identical for every policy: the trace's rates are scaled so the peak window offers
``peak_utilization`` x the best topology's capacity. A policy picks a topology per window before
the window starts (auto and reactive know only the past). Window w contributes
g_T(λ_w) * window_s requests of SLO goodput; a switch into window w subtracts the switch cost at
λ_w (``Scorer.switch_cost``). Missing windows count for nothing. Because the oracle is the exact
DP over that same accounting (it knows every λ_w, pays every switch, has no dwell or budget), its
goodput bounds every other policy's from above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from policy.decide import AutoPolicy, PolicyConfig, PolicyState, Scorer
from policy.forecast import DAY_S, Chooser
from policy.profiles import SLO, Profile
from policy.traces import WindowSeries
from remp.topology import Topology

RESULT_KEYS = ("goodput", "slo_attainment", "switches_per_day", "forecast_error", "auto_vs_oracle")


@dataclass(frozen=True)
class ReactiveConfig:
    up: float = 0.85  # leave the current topology when last window's load > up x its capacity
    down: float = 0.65  # move to a lower-latency one only when load < down x its capacity


@dataclass
class PolicyRun:
    name: str
    topologies: list[Topology]
    goodput_req: float = 0.0
    offered_req: float = 0.0
    switches: int = 0
    decisions: list = field(default_factory=list)


@dataclass
class Evaluation:
    trace: str
    profile: str
    window_s: float
    windows: int
    scale: float  # factor applied to the trace's rates
    slo: SLO
    days: float
    runs: dict[str, PolicyRun]
    forecast_error: dict[str, dict[str, float | None]]
    forecaster_choice: dict[str, int]

    def goodput_rps(self, name: str) -> float:
        return self.runs[name].goodput_req / (self.days * DAY_S)

    def result(self) -> dict:
        """The evaluation as one JSON-able object with exactly ``RESULT_KEYS``."""
        names = list(self.runs)
        oracle = self.runs["oracle"].goodput_req
        return {
            "goodput": {n: round(self.goodput_rps(n), 6) for n in names},
            "slo_attainment": {n: round(self.runs[n].goodput_req / max(self.runs[n].offered_req, 1e-12), 6)
                               for n in names},
            "switches_per_day": {n: round(self.runs[n].switches / self.days, 4) for n in names},
            "forecast_error": self.forecast_error,
            "auto_vs_oracle": round(self.runs["auto"].goodput_req / oracle, 6) if oracle > 0 else None,
        }


def _account(scorer: Scorer, rates: np.ndarray, window_s: float, name: str,
             topos: Sequence[Topology]) -> PolicyRun:
    run = PolicyRun(name, list(topos))
    valid = ~np.isnan(rates)
    for w, t in enumerate(topos):
        if not valid[w]:
            continue
        lam = float(rates[w])
        run.offered_req += lam * window_s
        run.goodput_req += float(scorer.goodput_rps(t, lam)) * window_s
        if w > 0 and topos[w - 1] != t:
            run.goodput_req -= scorer.switch_cost(topos[w - 1], t, lam)
    run.switches = sum(1 for a, b in zip(topos, topos[1:]) if a != b)
    return run


def oracle_topologies(scorer: Scorer, rates: np.ndarray, window_s: float) -> list[Topology]:
    """Exact DP over windows: max sum of goodput minus switch costs, future known."""
    topos = list(scorer.topologies)
    n, k = len(rates), len(topos)
    r = np.nan_to_num(rates)
    G = np.stack([scorer.goodput_rps(t, r) * window_s for t in topos])  # [k, n]
    V = G[:, 0].copy()
    back = np.zeros((n, k), dtype=int)
    for w in range(1, n):
        cost = np.array([[scorer.switch_cost(a, b, float(r[w])) for b in topos] for a in topos])  # [from, to]
        cand = V[:, None] - cost  # [from, to]
        back[w] = np.argmax(cand, axis=0)
        V = cand[back[w], np.arange(k)] + G[:, w]
    path = [int(np.argmax(V))]
    for w in range(n - 1, 0, -1):
        path.append(int(back[w, path[-1]]))
    return [topos[i] for i in reversed(path)]


def reactive_topologies(scorer: Scorer, rates: np.ndarray, start: Topology,
                        cfg: ReactiveConfig = ReactiveConfig()) -> list[Topology]:
    """Threshold policy on last window's observed load, with a hysteresis band. Preference order:
    best low-load SLO attainment first (the latency topologies), capacity breaks ties."""
    prof = scorer.profile
    low = 0.05 * prof.best_capacity_rps
    pref = sorted(scorer.topologies, key=lambda t: (-float(scorer.goodput_rps(t, low)), -prof.capacity(t)))
    cur, last, out = start, math.nan, []
    for w in range(len(rates)):
        if not math.isnan(last):
            if last > cfg.up * prof.capacity(cur):
                fits = [t for t in pref if last <= cfg.up * prof.capacity(t)]
                cur = fits[0] if fits else max(pref, key=prof.capacity)
            else:
                better = [t for t in pref[: pref.index(cur)] if last <= cfg.down * prof.capacity(t)]
                if better:
                    cur = better[0]
        out.append(cur)
        if not math.isnan(rates[w]):
            last = float(rates[w])
    return out


def schedule_topologies(scorer: Scorer, series: WindowSeries, rates: np.ndarray) -> tuple[list[Topology], str]:
    """Time-of-day schedule: per hour of day, the best topology for that hour's mean load over the
    training part (the first day when the trace has at least two, else the whole trace, which is
    then in-sample)."""
    hours = ((series.t_start_s % DAY_S) // 3600).astype(int)
    days = series.duration_s / DAY_S
    train = series.t_start_s < series.t_start_s[0] + DAY_S if days >= 2 else np.ones(len(rates), bool)
    plan: dict[int, Topology] = {}
    valid = ~np.isnan(rates)
    for h in range(24):
        m = train & (hours == h) & valid
        if m.any():
            lam = float(np.mean(rates[m]))
            plan[h] = max(scorer.topologies, key=lambda t: float(scorer.goodput_rps(t, lam)))
    fallback = max(scorer.topologies, key=lambda t: float(scorer.goodput_rps(t, np.nan_to_num(rates)).sum()))
    note = "trained on day 0" if days >= 2 else "in-sample (trace shorter than 2 days)"
    return [plan.get(int(h), fallback) for h in hours], note


def run_evaluation(series: WindowSeries, profile: Profile, peak_utilization: float = 0.9,
                   slo: SLO | None = None, config: PolicyConfig = PolicyConfig(),
                   reactive: ReactiveConfig = ReactiveConfig()) -> Evaluation:
    if not 0 < peak_utilization:
        raise ValueError("peak utilization must be positive")
    slo = slo or profile.default_slo
    scorer = Scorer(profile, slo)
    raw = series.rates
    if np.all(np.isnan(raw)) or np.nanmax(raw) <= 0:
        raise ValueError(f"trace {series.name!r} has no traffic")
    scale = peak_utilization * profile.best_capacity_rps / float(np.nanmax(raw))
    rates = raw * scale
    W = series.window_s
    n = len(rates)
    days = float((~np.isnan(rates)).sum()) * W / DAY_S

    first = float(rates[~np.isnan(rates)][0])
    start = max(scorer.topologies, key=lambda t: float(scorer.goodput_rps(t, first)))
    runs: dict[str, PolicyRun] = {}

    # auto, plus forecast-error bookkeeping from the same chooser
    hour = max(1, int(round(3600.0 / W)))
    H = max(config.horizon_windows(W), hour)
    chooser = Chooser(W, H)
    auto = AutoPolicy(scorer, W, PolicyState(start), config, chooser)
    names = chooser.names + ["chooser"]
    preds = np.full((len(names), n, 2), np.nan)  # prediction for window w made at w-1 / w-hour
    topos, decisions = [], []
    choice: dict[str, int] = {}
    for w in range(n):
        if w > 0:
            auto.observe(float(series.t_start_s[w - 1]), float(rates[w - 1]))
            cur = np.array([f.predict(H) for f in chooser.forecasters] + [chooser.predict(H)])
            preds[:, w, 0] = cur[:, 0]
            if w - 1 + hour < n:
                preds[:, w - 1 + hour, 1] = cur[:, hour - 1]
            choice[chooser.names[chooser.chosen]] = choice.get(chooser.names[chooser.chosen], 0) + 1
        if w == 0:
            d = None
        else:
            d = auto.tick(float(series.t_start_s[w]))
            decisions.append(d)
        topos.append(auto.state.current)
    runs["auto"] = _account(scorer, rates, W, "auto", topos)
    runs["auto"].decisions = decisions

    runs["oracle"] = _account(scorer, rates, W, "oracle", oracle_topologies(scorer, rates, W))
    runs["reactive"] = _account(scorer, rates, W, "reactive", reactive_topologies(scorer, rates, start, reactive))
    sched, _ = schedule_topologies(scorer, series, rates)
    runs["schedule"] = _account(scorer, rates, W, "schedule", sched)
    for t in scorer.topologies:
        runs[f"fixed:{t}"] = _account(scorer, rates, W, f"fixed:{t}", [t] * n)

    errors: dict[str, dict[str, float | None]] = {}
    actual = rates
    for i, name in enumerate(names):
        row: dict[str, float | None] = {}
        for j, key in enumerate(("1_window", "1_hour")):
            m = ~np.isnan(preds[i, :, j]) & ~np.isnan(actual)
            row[key] = (round(float(np.abs(preds[i, m, j] - actual[m]).sum() / actual[m].sum()), 6)
                        if m.sum() >= 3 and actual[m].sum() > 0 else None)
        errors[name] = row
    return Evaluation(series.name, profile.name, W, n, scale, slo, days, runs, errors, choice)


def evaluate(series: WindowSeries, profile: Profile, peak_utilization: float = 0.9,
             slo: SLO | None = None, config: PolicyConfig = PolicyConfig()) -> dict:
    """One replay; the dict has exactly the keys goodput, slo_attainment, switches_per_day
    (per policy: auto, oracle, reactive, schedule, fixed:TPxPPy), forecast_error (per forecaster:
    MAE/mean at 1 window and at 1 h; None when the trace is too short) and auto_vs_oracle."""
    return run_evaluation(series, profile, peak_utilization, slo, config).result()
