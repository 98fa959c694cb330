"""The policy service's logic (gRPC-free): one tick reads every node's traffic from the
controller, aggregates it into fixed windows, forecasts, decides, and acts by mode.

- AUTO: a switch decision calls ``Controller.Reconfigure`` with the decision id as request id
  (idempotent at the controller); the switch id and the answer go into the decision. A call that
  got no answer (UNAVAILABLE) is not re-sent blindly: it is asked again, with the *same* request
  id, after ``retry_backoff_s`` and only while the policy still wants the same target.
  The controller accepts a switch before it reaches the agent, so an accepted switch is
  followed (``GetSwitch``) to its outcome — up to ``follow_s`` within the tick, then once per
  tick — and only a SUCCEEDED one commits the policy's state, dwell and daily budget. One that
  ended otherwise (ROLLED_BACK, e.g. AGENT_UNAVAILABLE before anything was sent) changes
  nothing; it is asked for again under a new request id after ``retry_backoff_s``.
- ADVISORY: a switch decision is recorded with ``Controller.RecordRecommendation`` (once per
  target; withdrawn by recording the current topology when the policy no longer wants it);
  Reconfigure is never called.
- OFF: forecasts and decides (GetRecommendation answers) but calls nothing.

Objectives (``objective``): ``gpu-hours`` (default) and ``latency`` decide with
``policy.scale.decide_scale`` over every candidate the node registered that the profile knows
(any world size: a smaller one leaves the other ranks STANDBY), fed what the trace replay
(``policy.savings``) feeds it, counted from the windows this service aggregated: the recent
observed rates, the peak of the last ``peak_s``, yesterday's rate for the coming slot, and the
day's remaining SLO error budget. ``goodput`` is the older SLO-goodput core
(``policy.decide.AutoPolicy``, same world size only). Every decision carries an :class:`Impact`:
its expected GPU-hour saving against the whole host, its risk (expected SLO loss), the ranks it
releases and the profile it came from.

The controller is behind :class:`ControllerPort` (adapter: ``policy.controller_client``) and the
decision log behind :class:`DecisionStorePort` (adapter: ``policy.store``), so this module is
tested against fakes or the real thing alike. Time is an argument (``tick(now)``) or the
injected clock. Errors are the typed ``remp.errors`` ones.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, Sequence

import numpy as np

from policy.calibrate import (CalibrationConfig, Observation, calibrated_profile,
                              calibrated_slowdown, implied_slowdown, implied_ttft_slowdown)
from policy.decide import (DAY_S, AutoPolicy, CandidateScore, Decision, PolicyConfig, PolicyState,
                           Scorer)
from policy.forecast import Chooser
from policy.profiles import SLO, Profile
from policy.scale import (Band, CapacityTable, ScaleConfig, ScaleDecision, decide_scale, observed_burst,
                          observed_growth)
from policy.scale import after as scale_after
from remp import logs
from remp import metrics
from remp.errors import (FailedPrecondition, InvalidArgument, NotFound, RempError, Unauthenticated,
                         Unavailable)
from remp.topology import Topology

log = logs.get_logger("remp.policy")

MODES = ("auto", "advisory", "off")
OBJECTIVES = ("gpu-hours", "latency", "goodput")
DEFAULT_PAGE, MAX_PAGE = 50, 1000
MAX_FORECAST_WINDOWS = 20_000
OBSERVED_KEEP = 500  # samples kept per node for GetForecast.observed


# ------------------------------------------------------------------------------ ports

@dataclass(frozen=True)
class Sample:
    """One heartbeat's traffic (``TrafficSample``): it covers (at_s - window_s, at_s]."""

    at_s: float
    window_s: float
    requests: int
    input_tokens: int = 0
    output_tokens: int = 0
    running: int = 0
    waiting: int = 0
    tpot_s_sum: float = 0.0  # the finished requests' mean TPOTs, summed (s)
    tpot_requests: int = 0  # ... over this many requests
    ttft_s_sum: float = 0.0  # the TTFTs of the requests that reached their first token, summed (s)
    ttft_requests: int = 0  # ... over this many requests


@dataclass(frozen=True)
class NodeView:
    """What the controller says about a node (``NodeState``)."""

    name: str
    observed: Topology | None
    candidates: tuple[Topology, ...]
    health: str  # ready | switching | lost | unknown
    recommendation: str = ""
    rollout_id: str = ""  # the active rollout holding the node ("" when none)
    # STANDBY ranks as the agent's last heartbeat reports them (measured by the workers; empty
    # before the first report and while every rank is active): released, or not released — still
    # holding weights, KV or device memory (a runner kept by --cache-runners).
    released: tuple[int, ...] = ()
    unreleased: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReconfigureResult:
    switch_id: str
    noop: bool = False
    duplicate: bool = False


@dataclass(frozen=True)
class SwitchResult:
    """Where a switch the policy asked for stands (``Controller.GetSwitch``): ``state`` is a
    ``remp.transaction.Outcome`` value, or "missing" (the controller has no such record), with
    the record's error."""

    state: str
    code: str = ""
    message: str = ""

    @property
    def done(self) -> bool:
        return self.state != "running"


class ControllerPort(Protocol):
    async def list_nodes(self) -> list[NodeView]: ...

    async def traffic(self, node: str, since_s: float | None, limit: int) -> list[Sample]: ...

    async def reconfigure(self, node: str, target: Topology, request_id: str,
                          reason: str) -> ReconfigureResult: ...

    async def switch(self, switch_id: str) -> SwitchResult:
        """Where one switch stands (Unavailable when the controller did not answer)."""
        ...

    async def rollout(self, nodes: list[str], target: Topology, capacity_floor: float,
                      max_parallel: int, capacity_rps: dict[str, float], request_id: str,
                      reason: str) -> tuple[str, bool]:
        """Start a rollout; (rollout id, duplicate)."""
        ...

    async def record_recommendation(self, node: str, recommended: Topology, reason: str,
                                    decision_id: str) -> None: ...


class DecisionStorePort(Protocol):
    async def load(self, limit: int) -> tuple[list[dict[str, Any]], dict[str, str]]: ...

    async def append(self, doc: dict[str, Any], keep: int) -> None: ...

    async def save_modes(self, modes: dict[str, str]) -> None: ...


# ------------------------------------------------------------------------------ windows

class WindowAggregator:
    """Heartbeat samples → one rate per fixed window [k·W, (k+1)·W) (pure).

    A sample's requests are spread over the windows it overlaps, in proportion to the overlap.
    A window is emitted once a sample reaches its end, or ``stale_s`` after its end without one
    (the node stopped reporting); its rate is requests / covered seconds, NaN when less than
    ``min_coverage`` of the window was covered. Samples older than the last emitted window or
    not newer than the last sample are ignored."""

    def __init__(self, window_s: float, min_coverage: float = 0.5, stale_s: float | None = None):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.W = window_s
        self.min_coverage = min_coverage
        self.stale_s = stale_s
        self.acc: dict[int, list[float]] = {}
        self.next_k: int | None = None
        self.latest_at = -math.inf
        self.interval = window_s  # last heartbeat interval seen

    def add(self, s: Sample) -> None:
        if s.at_s <= self.latest_at or s.window_s <= 0:
            return
        start = s.at_s - s.window_s
        if self.next_k is None:
            self.next_k = int(math.floor(start / self.W))
        k = int(math.floor(start / self.W))
        while k * self.W < s.at_s:
            lo, hi = max(start, k * self.W), min(s.at_s, (k + 1) * self.W)
            if hi > lo and k >= self.next_k:
                a = self.acc.setdefault(k, [0.0] * 6)
                share = (hi - lo) / s.window_s
                a[0] += s.requests * share
                a[1] += hi - lo
                a[2] += s.tpot_s_sum * share
                a[3] += s.tpot_requests * share
                a[4] += s.ttft_s_sum * share
                a[5] += s.ttft_requests * share
            k += 1
        self.latest_at, self.interval = s.at_s, s.window_s

    def complete(self, now_s: float) -> list[tuple[float, float]]:
        """(window start, rate req/s) of every window finished by ``now_s``, oldest first."""
        return [(t0, rate) for t0, rate, *_ in self.complete_latency(now_s)]

    def complete_latency(self, now_s: float) -> list[tuple[float, float, float, float, float, float]]:
        """As :meth:`complete`, with the window's mean TPOT of the requests that finished in it
        (NaN: none) and how many they were (spread over windows like the requests), then its
        mean TTFT of the requests that reached their first token in it and how many they were."""
        out: list[tuple[float, float, float, float, float, float]] = []
        if self.next_k is None:
            return out
        stale = self.stale_s if self.stale_s is not None else max(3 * self.interval, self.W)
        while True:
            end = (self.next_k + 1) * self.W
            if not (end <= self.latest_at or end + stale <= now_s):
                return out
            req, cov, tsum, tn, fsum, fn = self.acc.pop(self.next_k, (0.0,) * 6)
            ok = cov >= self.min_coverage * self.W
            rate = req / cov if ok else math.nan
            tpot = tsum / tn if ok and tn > 0 else math.nan
            ttft = fsum / fn if ok and fn > 0 else math.nan
            out.append((self.next_k * self.W, rate, tpot, tn if ok else 0.0, ttft, fn if ok else 0.0))
            self.next_k += 1


# ------------------------------------------------------------------------------ objectives

@dataclass(frozen=True)
class Window:
    """One aggregated window of a node: its start, rate (NaN: not covered) and the topology the
    controller observed when it was aggregated (None: unknown)."""

    t0: float
    rate: float
    topology: Topology | None
    tpot_s: float = math.nan  # mean TPOT of the requests that finished in it (NaN: none)
    tpot_requests: float = 0.0  # ... how many
    implied: float = math.nan  # the slowdown that TPOT implies (policy.calibrate; NaN: unusable)
    ttft_requests: float = 0.0  # requests that reached their first token in it
    # their mean TTFT, for calibration (NaN: unusable; its implied slowdown depends on the TPOT's
    # slowdown then, so it is read at calibration)
    ttft_s: float = math.nan


@dataclass(frozen=True)
class ScaleInputs:
    """What ``decide_scale`` is fed besides the state, the forecast and the table (the same
    quantities ``policy.savings.auto_topologies`` feeds it in a replay)."""

    last_rate: float
    recent: np.ndarray  # the last max(recent_windows, recent_s) windows' rates, NaN kept
    recent_peak: float  # the highest rate of the last peak_s (NaN: none observed)
    error_budget: float  # requests: the day's remaining SLO error budget
    seasonal: float  # yesterday's rate for the coming window (NaN: no day of history)
    day_goodput: float = math.nan  # fixed-best's mean in-SLO rate over the last 24 h's observed windows
    day_peak: float = math.nan  # the highest rate of the last 24 h (NaN until a whole day is observed)
    growth: float = math.nan  # policy.scale.observed_growth of the last 24 h
    burst: float = math.nan  # policy.scale.observed_burst of the last burst_span_s (req/s)
    partial_peak: float = math.nan  # until a whole day is observed, the highest rate so far


def error_budget(table: CapacityTable, history: Sequence[Window], window_s: float, now_s: float,
                 bar: float) -> float:
    """The day's remaining SLO error budget in requests, as ``policy.savings`` counts it: (1 - bar)
    x the in-SLO requests fixed-best would have served over the windows of the last 24 h, minus
    the requests the topologies actually held lost against it since the start of today (UTC),
    switches included. Windows whose topology is unknown or not in the profile lose nothing."""
    rows = [w for w in history if w.t0 >= now_s - DAY_S - 1e-9 and not math.isnan(w.rate)]
    if not rows:
        return 0.0
    sc = table.scorer
    rates = np.array([w.rate for w in rows])
    gbest = sc.goodput_rps(table.fixed_best, rates) * window_s
    today = np.array([w.t0 for w in rows]) >= math.floor(now_s / DAY_S) * DAY_S
    topos = [w.topology for w in rows]
    lost = 0.0
    for t in set(topos):
        m = today & np.array([x == t for x in topos])
        if t is not None and t in sc.curves and m.any():
            lost += float(np.maximum(gbest[m] - sc.goodput_rps(t, rates[m]) * window_s, 0.0).sum())
    prev = None
    for i, t in enumerate(topos):  # switches (rare): the requests each one cost
        if today[i] and t is not None and prev is not None and prev != t \
                and t in sc.curves and prev in sc.curves:
            lost += sc.switch_cost(prev, t, float(rates[i]))
        prev = t if t is not None else prev
    return max((1.0 - bar) * float(gbest.sum()) - lost, 0.0)


def scale_inputs(history: Sequence[Window], window_s: float, cfg: ScaleConfig,
                 table: CapacityTable, now_s: float) -> ScaleInputs:
    """``decide_scale``'s observed inputs from a node's window history (oldest first, one
    window after the other, as the aggregator emits them)."""
    W = window_s
    rec_n = max(cfg.recent_windows, cfg.windows(cfg.recent_s, W))
    peak_n = cfg.windows(cfg.peak_s, W)
    tail = list(history)[-max(rec_n, peak_n):]
    rates = np.array([w.rate for w in tail], dtype=float)
    last = next((float(r) for r in rates[::-1] if not math.isnan(r)), math.nan)
    past = rates[-peak_n:]
    peak = float(np.nanmax(past)) if np.any(~np.isnan(past)) else math.nan
    seasonal = math.nan
    if history:
        first, end = history[0].t0, history[-1].t0 + W
        i = int(round((end - DAY_S - first) / W))
        if 0 <= i < len(history) and abs(history[i].t0 - (end - DAY_S)) < W / 2:
            seasonal = history[i].rate
    budget = (error_budget(table, history, W, now_s, cfg.attainment_bar)
              if cfg.sizing == "risk" else math.inf)
    # every window kept (the burst memory's span, or the last 24 h) and, of them, the last 24 h,
    # window after window as the aggregator emitted them (NaN = missing)
    t_all = np.array([w.t0 for w in history], dtype=float)
    r_all = np.array([w.rate for w in history], dtype=float)
    last_day = r_all[t_all >= now_s - DAY_S - 1e-9]
    day = last_day[~np.isnan(last_day)]
    day_good = float(np.mean(table.scorer.goodput_rps(table.fixed_best, day))) if day.size else math.nan
    whole_day = bool(history) and history[0].t0 <= now_s - DAY_S + 1e-6
    pk = float(day.max()) if day.size else math.nan
    day_peak, partial_peak = (pk, math.nan) if whole_day else (math.nan, pk)
    # its jumps (missing windows count as no traffic, as in a replay)
    growth = observed_growth(last_day, peak_n, cfg.bet_growth_quantile, cfg.bet_recent_windows(W))
    burst = math.nan
    if cfg.burst_span_s > 0:
        burst = observed_burst(r_all[t_all >= now_s - cfg.burst_span_s - 1e-9], peak_n, 1.0 + cfg.bet_growth_max)
    return ScaleInputs(last, rates[-rec_n:], peak, budget, seasonal, day_good, day_peak, growth,
                       burst, partial_peak)


def load_samples(band: Band, recent: np.ndarray, weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Loads for the next window and their weights (sum 1): the forecast scenarios, mixed with
    the recent observed rates at ``weight`` (as ``decide_scale`` weighs them)."""
    sc = band.scenarios[:, :1].ravel() if band.scenarios.size else np.asarray(band.upper[:1])
    rec = recent[~np.isnan(recent)] if recent.size else recent
    if rec.size == 0 or weight <= 0:
        return sc, np.full(sc.size, 1.0 / max(sc.size, 1))
    return (np.concatenate([sc, rec]),
            np.concatenate([np.full(sc.size, (1 - weight) / sc.size),
                            np.full(rec.size, weight / rec.size)]))


@dataclass(frozen=True)
class ScaleCandidate:
    """Per candidate, for a gpu-hours / latency decision (remp.policy.v1.CandidateScore): the
    expected in-SLO requests over the next window, the switch's cost, their difference, the
    expected SLO loss against the whole host's best (share), the SLO capacity and its GPUs."""

    topology: Topology
    expected_goodput: float
    switch_cost: float
    score: float
    expected_slo_loss: float = math.nan
    slo_capacity_rps: float = math.nan
    gpus: int = 0


@dataclass(frozen=True)
class ObjectiveDecision:
    """A ``policy.scale.ScaleDecision`` with what the service adds (the forecaster, the forecast
    rate, per-candidate numbers); reads like ``policy.decide.Decision`` where they share names."""

    scale: ScaleDecision
    forecaster: str
    forecast_rps: float
    scores: tuple[ScaleCandidate, ...] = ()

    t_s = property(lambda self: self.scale.t_s)
    current = property(lambda self: self.scale.current)
    recommended = property(lambda self: self.scale.recommended)
    switch = property(lambda self: self.scale.switch)
    reason = property(lambda self: self.scale.reason)
    text = property(lambda self: self.scale.text)
    switches_last_day = property(lambda self: self.scale.switches_last_day)
    objective = property(lambda self: self.scale.objective)


@dataclass(frozen=True)
class Impact:
    """What a recommendation is expected to do, stated with every decision (every objective)."""

    objective: str
    profile: str
    host_gpus: int  # the whole host: the largest world size among the node's candidates
    gpus: int  # held by the recommended topology
    released_gpus: tuple[int, ...]  # ranks left STANDBY by it (rank r runs on the agent's GPU r)
    expected_saving_gpu_hours: float  # vs the whole host, over saving_horizon_s
    saving_horizon_s: float  # windows of the horizon until the forecast mean leaves its capacity
    expected_slo_loss: float  # risk: expected share of the whole host's in-SLO requests lost
    overload_risk: float  # share of forecast scenarios above its SLO capacity next window
    error_budget: float  # requests left of the day's SLO error budget (NaN: not counted)
    expected_tpot_saving_ms: float = 0.0  # latency: TPOT vs the current topology
    # of released_gpus, the ranks expected to keep their memory when parked: the node's last
    # report showed parked ranks that were not released (measured); not counted as saved
    unreleased_gpus: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["released_gpus"] = list(self.released_gpus)
        d["unreleased_gpus"] = list(self.unreleased_gpus)
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Impact":
        f = {k: (math.nan if v is None else v) for k, v in d.items()}
        f["released_gpus"] = tuple(int(x) for x in d.get("released_gpus") or ())
        f["unreleased_gpus"] = tuple(int(x) for x in d.get("unreleased_gpus") or ())
        return cls(**f)

    def line(self) -> str:
        rel = (f"releases GPU{'s' if len(self.released_gpus) > 1 else ''} "
               f"{_ranges(self.released_gpus)}" if self.released_gpus else "whole host")
        if self.unreleased_gpus:
            rel += (f" (parked, not released: {_ranges(self.unreleased_gpus)} keep their memory, "
                    f"as the node's parked ranks did)")
        return (f"objective {self.objective}; {self.gpus}/{self.host_gpus} GPUs, {rel}; saves "
                f"{self.expected_saving_gpu_hours:.3g} GPU-h vs the whole host over "
                f"{self.saving_horizon_s / 60:.0f} min; expected SLO loss "
                f"{self.expected_slo_loss:.2%}; profile {self.profile}")


def _ranges(xs: Sequence[int]) -> str:
    xs = sorted(xs)
    return f"{xs[0]}-{xs[-1]}" if len(xs) > 1 and xs[-1] - xs[0] == len(xs) - 1 else \
        ",".join(map(str, xs))


def impact_of(table: CapacityTable, objective: str, current: Topology, target: Topology,
              host_gpus: int, band: Band, recent: np.ndarray, cfg: ScaleConfig,
              budget: float, keeps_parked: bool = False
              ) -> tuple[Impact, tuple[ScaleCandidate, ...]]:
    """The impact of choosing ``target`` now, and per-candidate numbers (pure).
    ``keeps_parked``: the node's last worker report showed parked ranks still holding memory, so
    the ranks ``target`` parks are expected to keep theirs too and save nothing."""
    sc, W = table.scorer, band.window_s
    x, wt = load_samples(band, recent, cfg.recent_weight)
    x = np.maximum(np.nan_to_num(x), 0.0)
    gb = sc.goodput_rps(table.fixed_best, x)
    base = float(np.dot(wt, gb))
    rate0 = float(np.dot(wt, x))

    def loss(t: Topology) -> float:
        if base <= 0:
            return 0.0
        return float(np.dot(wt, np.maximum(gb - sc.goodput_rps(t, x), 0.0))) / base

    cands = []
    for t in table.profile.topologies:
        g = float(np.dot(wt, sc.goodput_rps(t, x))) * W
        c = sc.switch_cost(current, t, rate0)
        cands.append(ScaleCandidate(t, g, c, g - c, loss(t), table.slo_cap.get(t, 0.0),
                                    t.world_size))
    cap = table.slo_cap.get(target, 0.0)
    H = min(cfg.windows(cfg.horizon_s, W), len(band.mean))
    mean = np.nan_to_num(np.asarray(band.mean[:H], dtype=float))
    covered = mean <= cap
    run = max(int(np.argmin(covered)) if H and not covered.all() else H, 1)
    gpus = target.world_size
    first = band.scenarios[:, 0] if band.scenarios.size else np.asarray(band.upper[:1])
    risk = float(np.mean(np.nan_to_num(first) > cap)) if first.size else 0.0
    tpot = 0.0
    if objective == "latency" and target in sc.curves and current in sc.curves:
        tpot = (table.tpot_s(current, rate0) - table.tpot_s(target, rate0)) * 1e3
    parked = tuple(range(gpus, host_gpus))
    kept = parked if keeps_parked else ()
    imp = Impact(objective, table.profile.name, host_gpus, gpus, parked,
                 (host_gpus - gpus - len(kept)) * run * W / 3600.0, run * W,
                 loss(target) if target in sc.curves else math.nan, risk, budget, tpot, kept)
    return imp, tuple(cands)


# ------------------------------------------------------------------------------ decisions

@dataclass
class DecisionRecord:
    """One decision of the log (``remp.policy.v1.Decision``)."""

    id: str
    seq: int
    node: str
    mode: str
    decision: Decision | ObjectiveDecision
    switch_id: str = ""
    outcome: str = ""
    impact: Impact | None = None

    def to_json(self) -> dict[str, Any]:
        d = self.decision
        doc: dict[str, Any] = {
            "id": self.id, "seq": self.seq, "node": self.node, "mode": self.mode,
            "switch_id": self.switch_id, "outcome": self.outcome,
        }
        if isinstance(d, ObjectiveDecision):
            sd = d.scale
            doc["decision"] = {
                "kind": "scale", "t_s": sd.t_s, "objective": sd.objective,
                "current": str(sd.current), "recommended": str(sd.recommended),
                "switch": sd.switch, "reason": sd.reason, "text": sd.text,
                "need_rps": sd.need_rps, "capacity_rps": sd.capacity_rps,
                "expected_saving": sd.expected_saving, "saving_unit": sd.saving_unit,
                "risk": sd.risk, "profile": sd.profile,
                "switches_last_day": sd.switches_last_day, "forecaster": d.forecaster,
                "forecast_rps": _num(d.forecast_rps),
                "scores": [[str(c.topology), c.expected_goodput, c.switch_cost, c.score,
                            _num(c.expected_slo_loss), _num(c.slo_capacity_rps), c.gpus]
                           for c in d.scores]}
        else:
            doc["decision"] = {
                "t_s": d.t_s, "current": str(d.current), "recommended": str(d.recommended),
                "switch": d.switch, "reason": d.reason, "text": d.text,
                "scores": [[str(c.topology), c.expected_goodput, c.switch_cost, c.score]
                           for c in d.scores],
                "gain": d.gain, "threshold": d.threshold, "dwell_left_s": d.dwell_left_s,
                "switches_last_day": d.switches_last_day, "forecaster": d.forecaster,
                "forecast_rps": d.forecast_rps,
            }
        if self.impact is not None:
            doc["impact"] = self.impact.to_json()
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "DecisionRecord":
        d = doc["decision"]
        dec: Decision | ObjectiveDecision
        if d.get("kind") == "scale":
            sd = ScaleDecision(
                t_s=float(d["t_s"]), objective=d["objective"], current=Topology.parse(d["current"]),
                recommended=Topology.parse(d["recommended"]), switch=bool(d["switch"]),
                reason=d["reason"], text=d["text"], need_rps=float(d["need_rps"]),
                capacity_rps=float(d["capacity_rps"]), expected_saving=float(d["expected_saving"]),
                saving_unit=d["saving_unit"], risk=float(d["risk"]), profile=d["profile"],
                switches_last_day=int(d["switches_last_day"]))
            dec = ObjectiveDecision(sd, d["forecaster"], _unnum(d["forecast_rps"]), tuple(
                ScaleCandidate(Topology.parse(t), g, c, s, _unnum(lo), _unnum(cap), int(n))
                for t, g, c, s, lo, cap, n in d["scores"]))
        else:
            dec = Decision(
                t_s=float(d["t_s"]), current=Topology.parse(d["current"]),
                recommended=Topology.parse(d["recommended"]), switch=bool(d["switch"]),
                reason=d["reason"], text=d["text"],
                scores=tuple(CandidateScore(Topology.parse(t), g, c, s)
                             for t, g, c, s in d["scores"]),
                gain=float(d["gain"]), threshold=float(d["threshold"]),
                dwell_left_s=float(d["dwell_left_s"]),
                switches_last_day=int(d["switches_last_day"]),
                forecaster=d["forecaster"], forecast_rps=float(d["forecast_rps"]))
        imp = Impact.from_json(doc["impact"]) if doc.get("impact") else None
        return cls(doc["id"], int(doc["seq"]), doc["node"], doc["mode"], dec,
                   doc.get("switch_id", ""), doc.get("outcome", ""), imp)

    def reason_line(self) -> str:
        """Numbers and the short text, as the controller shows a recommendation."""
        d = self.decision
        imp = f"; {self.impact.line()}" if self.impact is not None else ""
        if isinstance(d, ObjectiveDecision):
            return (f"{d.text} ({d.reason}; forecast {d.forecast_rps:.3g} req/s by "
                    f"{d.forecaster}{imp}; policy decision {self.id})")
        return (f"{d.text} (gain {d.gain:.3g} req vs threshold {d.threshold:.3g}; forecast "
                f"{d.forecast_rps:.3g} req/s by {d.forecaster}{imp}; policy decision {self.id})")


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _unnum(x: float | None) -> float:
    return math.nan if x is None else float(x)


@dataclass(frozen=True)
class ForecastView:
    node: str
    forecaster: str
    window_s: float
    starts_s: tuple[float, ...]
    mean: tuple[float, ...]
    lower: tuple[float, ...]
    upper: tuple[float, ...]
    observed: tuple[Sample, ...]
    backtest_error: float  # chosen forecaster's rolling MAE / mean; NaN until known


def fleet_groups(items, min_nodes: int) -> list[list[str]]:
    """Which auto-mode decisions go as one rollout: ``items`` are (node, mode, switch, current,
    recommended); nodes in auto mode making the same move (same current and target topology,
    not to more GPUs — a scale-up goes at once, node by node), ``min_nodes`` or more of them."""
    groups: dict[tuple, list[str]] = {}
    for name, mode, switch, cur, target in items:
        if mode == "auto" and switch and cur is not None and target is not None \
                and target.world_size <= cur.world_size:
            groups.setdefault((cur, target), []).append(name)
    return [sorted(g) for g in groups.values() if len(g) >= max(2, min_nodes)]


def rollout_floor(loads: list[float], capacities: list[float], headroom: float,
                  targets: list[float] | None = None) -> float:
    """A rollout's capacity floor: the share of the nodes' serving capacity now
    (``capacities``) that their forecast load x ``headroom`` needs — at most what one node at a
    time can keep (a floor no wave can keep would stop the rollout before it starts: the node
    switching counts 0, every other one the lower of its capacity now and on the target,
    ``targets``) and at most 0.9."""
    total = sum(c for c in capacities if c > 0)
    if total <= 0:
        return 0.0
    need = headroom * sum(x for x in loads if math.isfinite(x) and x > 0) / total
    low = [max(0.0, min(c, t)) for c, t in zip(capacities, targets or capacities)]
    reachable = (sum(low) - max(low)) / total
    return max(0.0, min(need, reachable - 1e-6, 0.9))


def forecast_of(n: "_Node", rec: "DecisionRecord") -> float:
    """The rate a decision expects next window (the last observed one where it has none)."""
    d = rec.decision
    if isinstance(d, ObjectiveDecision) and math.isfinite(d.forecast_rps):
        return d.forecast_rps
    rates = [w.rate for w in n.history if math.isfinite(w.rate)]
    return rates[-1] if rates else 0.0


@dataclass
class _Pending:
    """A switch to ask for again after a back-off: a Reconfigure that got no answer (asked
    again with the same ``request_id``, not re-sent blindly) or a switch that ended without
    succeeding (``request_id`` "": a new request, under the decision's id)."""

    target: Topology
    request_id: str
    retry_at_s: float
    why: str = ""


@dataclass
class _Following:
    """An accepted switch (``rec.switch_id``) not finished yet: the decision commits when it
    SUCCEEDS."""

    rec: "DecisionRecord"
    request_id: str
    duplicate: bool = False

    @property
    def switch_id(self) -> str:
        return self.rec.switch_id

    @property
    def target(self) -> Topology:
        return self.rec.decision.recommended


@dataclass
class _Node:
    name: str
    view: NodeView
    agg: WindowAggregator
    chooser: Chooser
    policy: AutoPolicy | None = None
    topo_key: tuple[Topology, ...] = ()
    since_s: float | None = None  # newest sample fetched (GetTraffic since)
    observed: deque = field(default_factory=lambda: deque(maxlen=OBSERVED_KEEP))
    last_window_s: float | None = None
    last: DecisionRecord | None = None
    logged_key: tuple | None = None
    recommended: Topology | None = None  # last recommendation recorded at the controller
    pending: _Pending | None = None
    following: _Following | None = None
    problem: str = ""
    history: deque = field(default_factory=deque)  # Window, oldest first (the last day, or burst_span_s)
    scale_state: PolicyState | None = None  # gpu-hours / latency: current, switch times
    # the node's parked ranks keep their memory (the last report that showed parked ranks had
    # one not released): remembered while every rank is active, as --cache-runners is for life
    keeps_parked: tuple[int, ...] = ()
    slowdown: float = 1.0  # calibrated from the node's observed TPOT (policy.calibrate)
    ttft_slowdown: float = 1.0  # ... its TTFT side, from the observed TTFT


class PolicyService:
    """Forecasts and decisions for every node the controller knows; see the module docstring."""

    def __init__(self, profile: Profile, controller: ControllerPort, *, slo: SLO | None = None,
                 config: PolicyConfig = PolicyConfig(), window_s: float = 60.0,
                 default_mode: str = "advisory", store: DecisionStorePort | None = None,
                 retry_backoff_s: float = 30.0, max_decisions: int = 50_000, clock=time.time,
                 objective: str = "gpu-hours", scale: ScaleConfig | None = None,
                 rollout_min_nodes: int = 2, rollout_headroom: float = 1.2,
                 follow_s: float = 10.0, calibration: CalibrationConfig | None = None):
        if default_mode not in MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(MODES)}, got {default_mode!r}")
        if objective not in OBJECTIVES:
            raise InvalidArgument(f"objective must be one of {', '.join(OBJECTIVES)}, "
                                  f"got {objective!r}")
        self.profile, self.controller, self.store = profile, controller, store
        self.slo = slo or profile.default_slo
        self.config, self.window_s, self.clock = config, window_s, clock
        self.objective = objective
        base = scale or ScaleConfig(horizon_s=config.horizon_s)
        # the scale config of the impact (goodput) and the decision (gpu-hours, latency)
        self.scale = base if objective == "goodput" else replace(base, objective=objective)
        # the last day (the error budget, yesterday's slot, the jumps), or the burst memory's span
        self.history_keep = int(math.ceil(max(DAY_S, self.scale.burst_span_s) / window_s)) + 2
        # gpu-hours / latency: each node's profile taken as slower when its observed TPOT says so
        self.calibration = calibration or CalibrationConfig()
        self._tables: dict[tuple[tuple[Topology, ...], float], CapacityTable | str] = {}
        self._profile_topos = frozenset(profile.topologies)
        self._switch_times: dict[str, tuple[float, ...]] = {}  # from the log, for the budget
        self.retry_backoff_s, self.max_decisions = retry_backoff_s, max_decisions
        self.follow_s = follow_s  # how long a tick waits for the switches it started
        # auto mode: this many nodes or more making the same move (not a scale-up) go as one
        # rollout, with a capacity floor of their forecast load x headroom (0 or 1: never)
        self.rollout_min_nodes, self.rollout_headroom = rollout_min_nodes, rollout_headroom
        self.default_mode = default_mode
        self.modes: dict[str, str] = {}  # per-node overrides
        self.nodes: dict[str, _Node] = {}
        self.decisions: deque[DecisionRecord] = deque(maxlen=max_decisions)
        self.seq = 0
        self.instance = uuid.uuid4().hex[:8]  # decision ids stay unique across restarts
        self.ticks = 0
        self.controller_ok = True
        self._scorers: dict[tuple[Topology, ...], Scorer] = {}
        self._lock = asyncio.Lock()

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Load the decision log and the modes from the store (if any)."""
        if self.store is None:
            return
        try:
            docs, modes = await self.store.load(self.max_decisions)
        except Unavailable as exc:
            log.warning("policy.store_unreachable", error=str(exc), note="starting empty")
            return
        for doc in docs:
            try:
                self.decisions.append(DecisionRecord.from_json(doc))
            except (KeyError, ValueError, TypeError):
                log.warning("policy.store_bad_decision", doc=str(doc)[:200])
        self.seq = max((d.seq for d in self.decisions), default=0)
        for d in self.decisions:  # the switches auto mode made count against the daily budget
            if d.mode == "auto" and d.switch_id and d.outcome.startswith("accepted"):
                self._switch_times[d.node] = self._switch_times.get(d.node, ()) + (d.decision.t_s,)
        if modes.get("*") in MODES:
            self.default_mode = modes["*"]
        self.modes = {k: v for k, v in modes.items() if k != "*" and v in MODES}
        log.info("policy.loaded", decisions=len(self.decisions), default_mode=self.default_mode,
                 overrides=len(self.modes))

    async def run(self, tick_s: float, stop: asyncio.Event) -> None:
        """Tick every ``tick_s`` until ``stop`` is set; a failing tick never ends the loop."""
        while not stop.is_set():
            try:
                await self.tick()
            except RempError as exc:
                log.warning("policy.tick_failed", error=str(exc), code=exc.code.name)
            except Exception as exc:  # noqa: BLE001 - a bug in one tick must not stop the loop
                log.error("policy.tick_crashed", error=repr(exc), exc_info=True)
            try:
                await asyncio.wait_for(stop.wait(), timeout=tick_s)
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- modes
    def mode_of(self, node: str) -> str:
        return self.modes.get(node, self.default_mode)

    async def set_mode(self, mode: str, node: str = "") -> str:
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {', '.join(MODES)} (got {mode!r})")
        if node:
            await self._known(node)
            self.modes[node] = mode
        else:
            self.default_mode, self.modes = mode, {}
        log.info("policy.mode_set", node=node or "*", mode=mode)
        if self.store is not None:
            try:
                await self.store.save_modes({"*": self.default_mode, **self.modes})
            except Unavailable as exc:
                log.warning("policy.store_unreachable", error=str(exc), what="modes")
        return mode

    # ---------------------------------------------------------------- the tick
    async def tick(self, now: float | None = None) -> list[DecisionRecord]:
        """One pass over every node; returns the decisions made (logged or not)."""
        async with self._lock:
            now = self.clock() if now is None else now
            self.ticks += 1
            try:
                views = await self.controller.list_nodes()
            except Unavailable as exc:
                if self.controller_ok:
                    log.warning("policy.controller_unreachable", error=str(exc))
                self.controller_ok = False
                return []
            if not self.controller_ok:
                log.info("policy.controller_back")
            self.controller_ok = True
            decided: list[tuple[_Node, DecisionRecord]] = []
            for v in views:
                n = self._upsert(v)
                try:
                    await self._fetch(n, now)
                except Unavailable as exc:
                    log.warning("policy.traffic_unavailable", node=n.name, error=str(exc))
                    continue
                except NotFound:
                    continue
                if n.following is not None and not await self._settle_earlier(n, now):
                    continue  # its switch is still running: decide again once it is over
                if n.view.health in ("switching", "lost") or n.view.rollout_id:
                    continue  # decide again once the switch / rollout is over, the node back
                rec = self._decide(n, now)
                if rec is not None:
                    decided.append((n, rec))
            in_rollout = await self._rollouts(decided, now)
            acted = {}
            for n, rec in decided:
                acted[n.name] = await self._act_by_mode(n, rec, now, n.name in in_rollout)
            await self._follow([n for n, rec in decided
                                if n.following is not None and n.following.rec is rec], now)
            return [await self._finish(n, rec, now, acted[n.name]) for n, rec in decided]

    def _upsert(self, v: NodeView) -> _Node:
        n = self.nodes.get(v.name)
        if n is None:
            H = self.config.horizon_windows(self.window_s)
            n = _Node(v.name, v, WindowAggregator(self.window_s), Chooser(self.window_s, H),
                      history=deque(maxlen=self.history_keep))
            self.nodes[v.name] = n
        n.view = v
        if v.unreleased:
            n.keeps_parked = v.unreleased
        elif v.released:
            n.keeps_parked = ()
        return n

    async def _fetch(self, n: _Node, now: float) -> None:
        samples = await self.controller.traffic(n.name, n.since_s, 0 if n.since_s is None else 5000)
        for s in samples:
            n.agg.add(s)
            n.observed.append(s)
            n.since_s = max(n.since_s or -math.inf, s.at_s)
        for t0, rate, tpot, tn, ttft, fn in n.agg.complete_latency(now):
            n.chooser.update(t0, rate)
            n.last_window_s = t0
            # the topology held then: the controller's observed one now (windows read back at
            # a restart are counted on the topology the node has when they are read)
            topo = n.view.observed
            implied = ttft_mean = math.nan  # calibration: not a window right after a switch
            if topo in self._profile_topos and n.history and n.history[-1].topology == topo:
                if tn > 0:
                    implied = implied_slowdown(self.profile.curve(topo), rate, tpot)
                if fn > 0:
                    ttft_mean = ttft
            n.history.append(Window(t0, rate, topo, tpot, tn, implied, fn, ttft_mean))

    def _scorer(self, topos: tuple[Topology, ...]) -> Scorer:
        sc = self._scorers.get(topos)
        if sc is None:
            sub = replace(self.profile, curves=tuple(c for c in self.profile.curves
                                                     if c.topology in topos))
            sc = self._scorers[topos] = Scorer(sub, self.slo)
        return sc

    def _topologies(self, n: _Node) -> tuple[Topology, ...] | None:
        """The node's candidates (and its current topology) that the profile knows, in the
        profile's order; None, with ``problem`` set, when there is nothing to decide."""
        cur = n.view.observed
        if cur is None:
            n.problem = "the controller knows no observed topology for this node yet"
            return None
        prof = set(self.profile.topologies)
        if cur not in prof:
            n.problem = (f"{cur} is not in profile {self.profile.name!r} "
                         f"({', '.join(map(str, self.profile.topologies))})")
            return None
        cands = set(n.view.candidates) | {cur}
        n.problem = ""
        return tuple(t for t in self.profile.topologies if t in cands)

    def _table(self, topos: tuple[Topology, ...], slowdown: tuple[float, float] = (1.0, 1.0)
               ) -> CapacityTable | str:
        """SLO capacities over these topologies (cached) on the profile taken as ``slowdown[0]``
        x slower, its TTFT as ``slowdown[1]`` x slower (calibrated), or why there are none."""
        tb = self._tables.get((topos, slowdown))
        if tb is None:
            prof = calibrated_profile(self.profile, *slowdown)
            sub = replace(prof, curves=tuple(c for c in prof.curves if c.topology in topos))
            try:
                tb = CapacityTable(sub, self.slo, self.scale.attainment_bar)
            except ValueError as exc:
                tb = f"{exc} (candidates {', '.join(map(str, topos))})"
            self._tables[(topos, slowdown)] = tb
        return tb

    def _calibrate(self, n: _Node, now: float) -> tuple[float, float]:
        """The node's slowdowns against the profile, from the TPOT and the TTFT its windows of
        the last span showed (``policy.calibrate``; 1 when off or not yet observed; the TTFT's
        is at least the TPOT's, and the TPOT's until enough TTFTs were seen). A window is used when requests finished (or
        reached their first token) in it and it held the topology of the window before it (the
        TPOT's implied slowdown is computed once, as it is aggregated; the TTFT's here, at the
        TPOT's slowdown now, which sets the load the profile's queue sees)."""
        cfg, W = self.calibration, self.window_s
        if not cfg.enabled:
            return 1.0, 1.0
        k = int(math.ceil(cfg.span_s / W)) + 1
        recent = list(itertools.islice(reversed(n.history), k))
        obs = [Observation(b.t0 + W, b.tpot_requests, b.implied) for b in recent
               if math.isfinite(b.implied)]
        s = calibrated_slowdown(obs, now, 1.0, cfg)
        # the TTFT's factor read at the load the TPOT's slowdown puts the host at
        obs_ttft = [Observation(b.t0 + W, b.ttft_requests, implied_ttft_slowdown(
                        self.profile.curve(b.topology), b.rate, b.ttft_s, s)) for b in recent
                    if math.isfinite(b.ttft_s)]
        # the TTFT: at least as slow as the TPOT, from enough windows
        t = calibrated_slowdown(obs_ttft, now, s, cfg, cfg.ttft_min_windows)
        if (s, t) != (n.slowdown, n.ttft_slowdown):
            log.info("policy.calibrated", node=n.name, slowdown=s, was=n.slowdown,
                     ttft_slowdown=t, ttft_was=n.ttft_slowdown,
                     profile=self.profile.name, windows=len(obs),
                     requests=round(sum(o.requests for o in obs)),
                     ttft_requests=round(sum(o.requests for o in obs_ttft)))
            n.slowdown, n.ttft_slowdown = s, t
        return s, t

    @staticmethod
    def _host_gpus(n: _Node) -> int:
        """The whole host: the engine starts the largest candidate world size."""
        cur = n.view.observed
        return max(t.world_size for t in (*n.view.candidates, *((cur,) if cur else ())))

    def _ensure_policy(self, n: _Node) -> AutoPolicy | None:
        """The node's AutoPolicy (objective goodput) over the candidates it can switch to that the
        profile knows (same world size as now); None, with ``problem`` set, when there is nothing
        to decide."""
        topos = self._topologies(n)
        if topos is None:
            return None
        cur = n.view.observed
        topos = tuple(t for t in topos if t.world_size == cur.world_size)
        if n.policy is None or n.topo_key != topos:
            state = n.policy.state if n.policy is not None else PolicyState(cur)
            n.policy = AutoPolicy(self._scorer(topos), self.window_s, replace(state, current=cur),
                                  self.config, chooser=n.chooser)
            n.topo_key = topos
        elif n.policy.state.current != cur:
            # a switch finished (ours or someone's) or rolled back: the controller is the truth
            n.policy.state = replace(n.policy.state, current=cur)
        return n.policy

    def _recent(self, n: _Node) -> np.ndarray:
        cfg = self.scale
        k = max(cfg.recent_windows, cfg.windows(cfg.recent_s, self.window_s))
        return np.array([w.rate for w in list(n.history)[-k:]], dtype=float)

    def _decide_goodput(self, n: _Node, now: float) -> tuple[Decision, Impact | None] | None:
        pol = self._ensure_policy(n)
        if pol is None:
            return None
        d = pol.tick(now, commit=False)
        topos = self._topologies(n)
        table = self._table(topos) if topos else "no topologies"
        if isinstance(table, str):
            return d, None
        band = Band.from_forecast(n.chooser.forecast(), self.scale.band_quantile)
        imp, _ = impact_of(table, "goodput", d.current, d.recommended, self._host_gpus(n), band,
                           self._recent(n), self.scale, math.nan)
        return d, imp

    def _decide_scale(self, n: _Node, now: float) -> tuple[ObjectiveDecision, Impact] | None:
        topos = self._topologies(n)
        if topos is None:
            return None
        table = self._table(topos, self._calibrate(n, now))
        if isinstance(table, str):
            n.problem = f"profile {self.profile.name!r}: {table}"
            return None
        cur = n.view.observed
        st = n.scale_state
        if st is None:  # the dwell counts from the first sight, as in a replay
            times = self._switch_times.get(n.name, ())
            st = PolicyState(cur, max((now, *times)), times)
        elif st.current != cur:  # a switch finished or rolled back: the controller is the truth
            st = replace(st, current=cur)
        n.scale_state = st
        cfg = self.scale
        fc = n.chooser.forecast()
        band = Band.from_forecast(fc, cfg.band_quantile)
        inp = scale_inputs(n.history, self.window_s, cfg, table, now)
        sd = decide_scale(st, now, inp.last_rate, band, table, cfg, inp.recent_peak,
                          inp.recent if cfg.sizing == "risk" else None, inp.error_budget,
                          inp.seasonal, inp.day_goodput, inp.day_peak, inp.growth, inp.burst,
                          inp.partial_peak)
        if sd.recommended not in topos:  # never recommend what the node cannot take
            sd = replace(sd, recommended=cur, switch=False, reason="stay",
                         text=f"{sd.recommended} is not a candidate of this node; staying")
        keeps = bool(n.keeps_parked)
        if keeps and sd.reason == "scale-down":  # fewer GPUs would free none: no saving to take
            sd = replace(sd, recommended=cur, switch=False, reason="hold-unreleased",
                         text=f"{sd.text}; held: the node's parked ranks "
                              f"{_ranges(n.keeps_parked)} were not released (they kept their "
                              f"memory, e.g. --cache-runners), so parking ranks frees no GPU")
        imp, cands = impact_of(table, cfg.objective, cur, sd.recommended, self._host_gpus(n),
                               band, inp.recent, cfg, inp.error_budget, keeps)
        mean0 = float(band.mean[0]) if len(band.mean) else math.nan
        return ObjectiveDecision(sd, fc.forecaster, mean0, cands), imp

    def _decide(self, n: _Node, now: float) -> DecisionRecord | None:
        got = (self._decide_goodput(n, now) if self.objective == "goodput"
               else self._decide_scale(n, now))
        if got is None:
            return None
        d, imp = got
        self.seq += 1  # every decision gets its own id; only some are logged (gaps are fine)
        return DecisionRecord(f"pd-{self.instance}-{self.seq}", self.seq, n.name,
                              self.mode_of(n.name), d, impact=imp)

    async def _act_by_mode(self, n: _Node, rec: DecisionRecord, now: float,
                           in_rollout: bool) -> bool:
        """Act on one node's decision (``in_rollout``: a rollout already did)."""
        if in_rollout:
            return True
        if rec.mode == "advisory":
            return await self._advise(n, rec)
        if rec.mode == "auto":
            return await self._act(n, rec, now)
        rec.outcome = "off: no action"
        return False

    async def _finish(self, n: _Node, rec: DecisionRecord, now: float, acted: bool
                      ) -> DecisionRecord:
        """Record and log one node's decision."""
        n.last = rec
        metrics.policy().decided(n, rec, self.window_s, now)
        d = rec.decision
        key = (rec.mode, d.reason, d.current, d.recommended)
        if acted or key != n.logged_key:
            n.logged_key = key
            await self._log(rec)
        return rec

    def _capacity(self, n: _Node, t: Topology) -> float:
        """SLO capacity (req/s) of ``t`` on this node's candidates, per the profile."""
        topos = self._topologies(n)
        table = self._table(topos, (n.slowdown, n.ttft_slowdown)) if topos else "no topologies"
        if not isinstance(table, str) and t in table.slo_cap:
            return float(table.slo_cap[t])
        return float(self.profile.capacity(t)) if t in self.profile.topologies else 0.0

    async def _rollouts(self, decided: list[tuple[_Node, DecisionRecord]], now: float
                        ) -> set[str]:
        """Auto mode: the same move on several nodes (not a scale-up, which goes at once, node
        by node) becomes one rollout whose capacity floor keeps the nodes' forecast load x
        headroom served. Returns the nodes a rollout took (started, waiting or unanswered)."""
        if self.rollout_min_nodes < 2:
            return set()
        by_name = {n.name: (n, rec) for n, rec in decided}
        taken: set[str] = set()
        for names in fleet_groups([(n.name, rec.mode, rec.decision.switch, rec.decision.current,
                                    rec.decision.recommended) for n, rec in decided],
                                   self.rollout_min_nodes):
            group = [by_name[x] for x in names]
            cur, target = group[0][1].decision.current, group[0][1].decision.recommended
            pend = [n.pending for n, _ in group if n.pending is not None
                    and n.pending.target == target]
            if pend and now < min(p.retry_at_s for p in pend):
                for n, rec in group:
                    rec.outcome = (f"waiting: {pend[0].why}; asking again in "
                                   f"{pend[0].retry_at_s - now:.0f} s")
                taken.update(names)
                continue
            unanswered = [p for p in pend if p.request_id.startswith("pr-")]
            rid = unanswered[0].request_id if unanswered else f"pr-{group[0][1].id}"
            loads = [forecast_of(n, rec) for n, rec in group]
            caps = [self._capacity(n, cur) for n, _ in group]
            floor = rollout_floor(loads, caps, self.rollout_headroom,
                                  [self._capacity(n, target) for n, _ in group])
            cap_rps = {str(t): self._capacity(group[0][0], t) for t in group[0][0].view.candidates}
            reason = (f"policy: {len(group)} nodes {cur} → {target} "
                      f"({group[0][1].decision.reason}); floor {floor:.2f} of "
                      f"{sum(caps):.1f} req/s for a forecast {sum(loads):.1f} req/s")
            try:
                rollout_id, dup = await self.controller.rollout(
                    names, target, floor, len(names), cap_rps, rid, reason)
            except Unavailable as exc:
                for n, rec in group:
                    n.pending = _Pending(target, rid, now + self.retry_backoff_s,
                                         f"rollout request {rid} got no answer")
                    rec.outcome = (f"unavailable: rollout request {rid}: {exc} (asked again, "
                                   f"same id, after {self.retry_backoff_s:g} s if still wanted)")
                log.warning("policy.rollout_unavailable", nodes=names, request_id=rid,
                            error=str(exc))
                taken.update(names)
                continue
            except (FailedPrecondition, InvalidArgument, NotFound, Unauthenticated) as exc:
                # the controller will not take it as a rollout: node by node, as without one
                log.warning("policy.rollout_refused", nodes=names, code=exc.code.name,
                            error=str(exc), detail="switching node by node instead")
                continue
            for n, rec in group:
                n.pending = None
                rec.outcome = (f"rollout {rollout_id}{' (duplicate request)' if dup else ''}: "
                               f"{len(group)} nodes {cur} → {target}, capacity floor {floor:.2f}")
                self._committed(n, rec)
            log.info("policy.rollout_started", rollout_id=rollout_id, nodes=names,
                     target=str(target), capacity_floor=round(floor, 3), request_id=rid,
                     duplicate=dup)
            taken.update(names)
        return taken

    def _committed(self, n: _Node, rec: DecisionRecord) -> None:
        """A switch toward the decision was accepted: dwell and budget start now."""
        d = rec.decision
        if isinstance(d, ObjectiveDecision) and n.scale_state is not None:
            n.scale_state = scale_after(n.scale_state, d.scale)
        elif isinstance(d, Decision) and n.policy is not None:
            n.policy.state = n.policy.state.after(d)

    async def _advise(self, n: _Node, rec: DecisionRecord) -> bool:
        d = rec.decision
        if d.switch and n.recommended != d.recommended:
            target, reason = d.recommended, rec.reason_line()
        elif not d.switch and n.recommended is not None and n.recommended != d.current:
            target, reason = d.current, f"stay: {rec.reason_line()}"  # withdraw the advice
        else:
            rec.outcome = "recommended earlier" if d.switch else ""
            return False
        try:
            await self.controller.record_recommendation(n.name, target, reason, rec.id)
        except (Unavailable, NotFound, InvalidArgument, Unauthenticated) as exc:
            rec.outcome = f"recommendation not recorded ({exc.code.name}): {exc}"
            log.warning("policy.recommend_failed", node=n.name, decision_id=rec.id,
                        error=str(exc))
            return True
        n.recommended = target
        rec.outcome = f"recommended {target}"
        log.info("policy.recommended", node=n.name, decision_id=rec.id, current=str(d.current),
                 recommended=str(target), reason=d.reason, **_impact_fields(rec))
        return True

    async def _act(self, n: _Node, rec: DecisionRecord, now: float) -> bool:
        d = rec.decision
        if not d.switch:
            return False
        p = n.pending if n.pending is not None and n.pending.target == d.recommended else None
        if p is not None and now < p.retry_at_s:
            rec.outcome = f"waiting: {p.why}; asking again in {p.retry_at_s - now:.0f} s"
            return False
        rid = p.request_id if p is not None and p.request_id else rec.id
        try:
            r = await self.controller.reconfigure(n.name, d.recommended, rid,
                                                  rec.reason_line())
        except Unavailable as exc:
            n.pending = _Pending(d.recommended, rid, now + self.retry_backoff_s,
                                 f"Reconfigure {rid} got no answer")
            rec.outcome = f"unavailable: {exc} (request {rid}; asked again, same id, after " \
                          f"{self.retry_backoff_s:g} s if still wanted)"
            log.warning("policy.reconfigure_unavailable", node=n.name, decision_id=rec.id,
                        request_id=rid, error=str(exc))
            return True
        except (FailedPrecondition, InvalidArgument, NotFound, Unauthenticated) as exc:
            n.pending = None
            rec.outcome = f"refused ({exc.code.name}): {exc}"
            log.warning("policy.reconfigure_refused", node=n.name, decision_id=rec.id,
                        code=exc.code.name, error=str(exc))
            return True
        n.pending = None
        rec.switch_id = r.switch_id
        if r.noop:
            rec.outcome = "noop: already on the target"
        else:  # committed once it succeeds (_follow, _settle)
            n.following = _Following(rec, rid, r.duplicate)
            rec.outcome = self._accepted(n.following, "running")
        log.info("policy.reconfigured", node=n.name, decision_id=rec.id, switch_id=r.switch_id,
                 request_id=rid, target=str(d.recommended), outcome=rec.outcome,
                 **_impact_fields(rec))
        return True

    @staticmethod
    def _accepted(f: _Following, how: str) -> str:
        head = (f"duplicate: request {f.request_id} was accepted earlier"
                if f.duplicate else "accepted")
        return f"{head}: switch {f.switch_id} {how}"

    async def _switch_state(self, switch_id: str) -> SwitchResult:
        try:
            return await self.controller.switch(switch_id)
        except Unavailable as exc:  # not known yet: still following
            log.warning("policy.switch_unreadable", switch_id=switch_id, error=str(exc))
            return SwitchResult("running")
        except RempError as exc:  # any other answer: not followed further, nothing committed
            log.warning("policy.switch_unreadable", switch_id=switch_id, error=str(exc),
                        code=exc.code.name)
            return SwitchResult("unknown", exc.code.name, str(exc))

    async def _follow(self, nodes: list[_Node], now: float) -> None:
        """Wait up to ``follow_s`` for the switches this tick started, settling each that ends;
        the others are settled on a later tick (_settle_earlier)."""
        if not nodes:
            return
        deadline = time.monotonic() + self.follow_s

        async def one(n: _Node) -> None:
            assert n.following is not None
            pause = 0.02
            while True:
                res = await self._switch_state(n.following.switch_id)
                left = deadline - time.monotonic()
                if res.done or left <= 0:
                    break
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 1.5, 0.5)
            if res.done:
                self._settle(n, res, now)
            else:
                n.following.rec.outcome = self._accepted(
                    n.following, f"still running after {self.follow_s:g} s (committed when it "
                                 f"succeeds)")

        await asyncio.gather(*(one(n) for n in nodes))

    async def _settle_earlier(self, n: _Node, now: float) -> bool:
        """A switch an earlier tick left running: settle it if it is over (True: decide now)."""
        assert n.following is not None
        res = await self._switch_state(n.following.switch_id)
        if not res.done:
            return False
        rec = n.following.rec
        self._settle(n, res, now)
        log.info("policy.switch_settled", node=n.name, decision_id=rec.id,
                 switch_id=rec.switch_id, outcome=rec.outcome)
        return True

    def _settle(self, n: _Node, res: SwitchResult, now: float) -> None:
        """A followed switch ended: SUCCEEDED commits the decision; anything else changes
        nothing and the target is asked for again, under a new request id, after the back-off."""
        f = n.following
        assert f is not None and res.done
        n.following = None
        rec = f.rec
        if res.state == "succeeded":
            rec.outcome = self._accepted(f, "succeeded")
            self._committed(n, rec)  # dwell and budget start now
            return
        if res.state == "noop":
            rec.outcome = f"noop: switch {f.switch_id} found the node already on the target"
            return
        error = f" {res.code}: {res.message}" if res.code or res.message else ""
        head = "unavailable" if res.code == "AGENT_UNAVAILABLE" else res.state.replace("_", " ")
        n.pending = _Pending(f.target, "", now + self.retry_backoff_s,
                             f"switch {f.switch_id} to {f.target} ended {res.state}")
        rec.outcome = (f"{head}: switch {f.switch_id} (request {f.request_id}) ended "
                       f"{res.state.upper()}{error}; nothing committed (a new request after "
                       f"{self.retry_backoff_s:g} s if still wanted)")
        log.warning("policy.switch_not_succeeded", node=n.name, decision_id=rec.id,
                    switch_id=f.switch_id, state=res.state, code=res.code)

    async def _log(self, rec: DecisionRecord) -> None:
        d = rec.decision
        log.info("policy.decision", node=rec.node, decision_id=rec.id, mode=rec.mode,
                 current=str(d.current), recommended=str(d.recommended), switch=d.switch,
                 reason=d.reason, text=d.text, outcome=rec.outcome, **_impact_fields(rec))
        self.decisions.append(rec)
        if self.store is not None:
            try:
                await self.store.append(rec.to_json(), self.max_decisions)
            except Unavailable as exc:
                log.warning("policy.store_unreachable", error=str(exc), decision_id=rec.id)

    # ---------------------------------------------------------------- queries
    async def _known(self, node: str) -> _Node:
        if not node:
            raise InvalidArgument("node is required")
        n = self.nodes.get(node)
        if n is None:
            for v in await self.controller.list_nodes():  # Unavailable propagates
                if v.name not in self.nodes:
                    self._upsert(v)
            n = self.nodes.get(node)
        if n is None:
            raise NotFound(f"unknown node {node!r} (the controller's ListNodes shows the "
                           "registered ones)")
        return n

    async def get_recommendation(self, node: str) -> DecisionRecord:
        n = await self._known(node)
        if n.last is not None:
            return n.last
        rec = self._decide(n, self.clock())  # no side effects: not logged, nothing called
        if rec is None:
            raise FailedPrecondition(f"no recommendation for {node}: {n.problem}")
        rec.outcome = "not acted on: computed on request before the first tick"
        return rec

    async def get_forecast(self, node: str, horizon_s: float = 0.0) -> ForecastView:
        if not (horizon_s >= 0 and math.isfinite(horizon_s)):
            raise InvalidArgument("horizon_seconds must be >= 0 (0: the decision horizon)")
        n = await self._known(node)
        H = (self.config.horizon_windows(self.window_s) if horizon_s == 0
             else max(1, int(math.ceil(horizon_s / self.window_s - 1e-9))))
        if H > MAX_FORECAST_WINDOWS:
            raise InvalidArgument(f"horizon_seconds covers {H} windows of {self.window_s:g} s; "
                                  f"at most {MAX_FORECAST_WINDOWS}")
        fc = n.chooser.forecast(H)
        base = n.last_window_s if n.last_window_s is not None else \
            math.floor(self.clock() / self.window_s) * self.window_s - self.window_s
        starts = tuple(base + self.window_s * (h + 1) for h in range(H))
        return ForecastView(node, fc.forecaster, self.window_s, starts,
                            tuple(float(x) for x in fc.mean), tuple(float(x) for x in fc.lower),
                            tuple(float(x) for x in fc.upper), tuple(n.observed),
                            float(fc.backtest_error))

    async def list_decisions(self, node: str, page_size: int, page_token: str
                             ) -> tuple[list[DecisionRecord], str]:
        size = page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            raise InvalidArgument(f"page_size must be at most {MAX_PAGE}")
        try:
            before = int(page_token) if page_token else math.inf
            if before < 0:
                raise ValueError
        except ValueError:
            raise InvalidArgument("page_token is not one this server returned") from None
        if node and not any(d.node == node for d in self.decisions):
            await self._known(node)  # NOT_FOUND for a node nobody knows
        items: list[DecisionRecord] = []
        for d in reversed(self.decisions):
            if d.seq < before and (not node or d.node == node):
                items.append(d)
                if len(items) > size:
                    break
        nxt = str(items[size - 1].seq) if len(items) > size else ""
        return items[:size], nxt



def _impact_fields(rec: DecisionRecord) -> dict[str, Any]:
    """A decision's impact as log fields (empty when it has none)."""
    i = rec.impact
    if i is None:
        return {}
    return {"objective": i.objective, "profile": i.profile, "gpus": i.gpus,
            "host_gpus": i.host_gpus, "released_gpus": list(i.released_gpus),
            "unreleased_gpus": list(i.unreleased_gpus),
            "expected_saving_gpu_hours": round(i.expected_saving_gpu_hours, 4),
            "saving_horizon_s": i.saving_horizon_s,
            "expected_slo_loss": round(i.expected_slo_loss, 6) if math.isfinite(
                i.expected_slo_loss) else None,
            "overload_risk": round(i.overload_risk, 4),
            "error_budget_requests": round(i.error_budget, 1) if math.isfinite(
                i.error_budget) else None}
