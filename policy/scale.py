"""Objectives chosen by the operator, and the decision that serves them (pure; clock and forecast
are arguments).

- ``gpu-hours`` (default): hold the fewest GPUs (any world size the profile has; the rest released)
  whose SLO capacity covers the forecast load with headroom.
- ``latency``: keep the whole host; among its topologies whose SLO capacity covers the forecast
  load with headroom, the one with the lowest TPOT at that load.

**SLO capacity** of a topology (``CapacityTable``): the largest offered load up to which its SLO
attainment (from the profile's latency curves, ``TopologyCurve.attainment``) stays at or above
``attainment_bar`` x the best attainment any topology reaches at near-zero load. A topology that
never reaches the bar (too slow for the SLO even when idle) has SLO capacity 0.

**Decision** (``decide_scale``), per window. ``gpu-hours`` with sizing ``risk`` (the default):

- Scenarios for the next window: the forecast scenarios mixed (``recent_weight``) with the rates
  observed over the last max(``recent_windows``, ``recent_s``) and yesterday's rate for the coming
  slot where known. Per topology the expected in-SLO requests lost against fixed-best over them,
  as a share of fixed-best's (``CapacityTable.relative_loss``).
- A topology qualifies when that share is <= ``loss_budget`` (x mean / next, at most
  ``quiet_budget_max``, in a window whose expected fixed-best in-SLO rate "next" is below the
  last 24 h's mean ``day_goodput``: the day's bar counts requests, so a quiet window may lose a
  larger share of its own), its loss in one window at (1 + g) x the peak of the last ``peak_s``
  is <= ``budget_share`` x the day's remaining SLO error budget (argument ``error_budget``,
  requests), and it covers the absolute floor ``floor_rps``. The bet's growth g is
  ``bet_growth``, or the ``bet_growth_quantile`` of the jumps the last 24 h showed
  (``observed_growth``: a window's rate over the peak of the ``peak_s`` before it), or the
  largest jump of the last ``bet_recent_s`` (30 min), where that is larger, at most
  ``bet_growth_max``: traffic that has leapt before is bet to leap again. Where
  the last ``burst_span_s`` (2 days) held a burst — a window above (1 + ``bet_growth_max``) x
  the peak of the hour before it — the bet is at least that peak plus the largest such rise in
  req/s (``observed_burst``): batch-job bursts on a quiet service are absolute, not a ratio of
  the quiet hour, and come back after a burst-free day. An operator's ``burst_rps`` (``--burst-rps``)
  counts as such a burst from the first window (the larger of the two counts); ``min_gpus``
  (``--min-gpus``) keeps every choice at that many GPUs or more.
- **Scale up at once** (no dwell, never held by the budget while a switch is left) when the current one does not
  qualify, to the cheapest one qualifying over ``up_lookahead_s``. When this is the rolling
  day's last switch, at least to the cheapest one covering ``last_up_margin`` x the last 24 h's
  peak (``last_up`` "day-peak", once a whole day is observed; before that
  ``last_up_partial_margin`` x the highest rate observed so far, 0: the largest), else to the
  largest. With no
  switch left (load passed even that), to the largest, one switch over the day's budget, only
  when one window at the bet would spend the whole SLO error budget left ("hold-budget" until
  then), only on a calendar day (from ``day_origin_s``) with fewer than the budget, so no day
  has more, and never with ``over_budget_up`` off (``--hard-switch-budget``: the budget a hard
  limit in every 24 h).
- **Scale down** (with ``step_down``, to no fewer GPUs than ``step_ratio`` x those held, or the
  next smaller world size when none lies between: 8 -> 6 -> 5 -> 4 -> 3 -> 2 -> 1 on a host with
  every world size, 8 -> 4 -> 2 -> 1 on one with 1, 2, 4, 8) when a smaller one qualifies,
  after the dwell (max(``min_dwell_s``, ``min_dwell_windows`` windows)), after a warm-up of as many
  observed windows in a row as the recent span (at the start and after a gap), with one switch of
  the rolling-24-h budget kept for a scale-up (``down_reserve``, 2, once the last scale-up is
  sized by the day's peak, or before a whole day by the peak so far: the one before it must not be spent on a scale-down, or a load past the
  day's peak would need a switch over the budget), at the budget's pace (fewer switches in the last
  ``pace_span_s`` than ``max_switches_per_day`` x ``pace_span_s`` / 24 h + ``pace_slack``: with
  12/day, 3 h and 1, a scale-down waits once 3 switches fell in the last 3 h, so a ladder with
  many sizes does not spend the day's switches in its morning), and when the saving over the
  forecast mean's run under the target's capacity exceeds the switch's cost scaled by budget /
  switches left.

Sizing ``band`` (the older rule) and ``latency``:

- need(span) = headroom x max(last observed rate, band over the span), never below the absolute
  floor ``floor_rps`` (so near-zero traffic never drives a recommendation below what the floor
  load needs: the floor, not noise, decides).
- **Scale up at once** when need over the next window exceeds the current SLO capacity; the
  target is sized for the band over ``up_lookahead_s``, so one step up suffices.
- **Scale down** only when the dwell since the last switch has passed, the smaller target also
  covers the peak observed over the last dwell span with headroom, the budget keeps one switch in
  reserve, the smaller target covers the band for ``down_cover_s``, and the expected saving over
  the horizon exceeds the switch's cost (requests the switch makes miss the SLO, valued at
  ``request_cost_gpu_s`` each, plus the downtime x GPUs held), scaled up by budget / switches left.
- Every decision states its expected saving (GPU-hours over the horizon, or TPOT ms for
  ``latency``), its risk (share of forecast scenarios whose peak over the covered span exceeds the
  target's SLO capacity) and the profile it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policy.decide import DAY_S, PolicyState, Scorer
from policy.profiles import SLO, Profile
from remp.topology import Topology

OBJECTIVES = ("gpu-hours", "latency")


@dataclass(frozen=True)
class ScaleConfig:
    objective: str = "gpu-hours"
    headroom: float = 1.1  # capacity must cover this x the band
    band_quantile: float = 0.95  # the forecast band's upper edge (scenario quantile)
    up_lookahead_s: float = 1800.0  # a scale-up is sized for the band over this span
    min_dwell_s: float = 0.0  # no scale-down sooner than this after the last switch (and min_dwell_windows)
    down_cover_s: float = 1800.0  # a scale-down target must cover the band this long
    horizon_s: float = 3 * 3600.0  # saving is counted over at most this
    max_switches_per_day: int = 12  # rolling 24 h; scale-ups are held by it only with none left (see _decide_risk)
    floor_rps: float = 0.05  # absolute floor of the load the policy sizes for
    attainment_bar: float = 0.99
    request_cost_gpu_s: float | None = None  # a lost request's value; None: 50 x GPU-s/request at best capacity
    # sizing "risk": the cheapest topology whose expected in-SLO loss vs fixed-best over the
    # next window(s), under the forecast scenarios mixed with the recent observed rates, stays
    # within loss_budget; "band": headroom x the band's upper edge (the older rule)
    sizing: str = "risk"
    loss_budget: float = 0.0095  # expected share of fixed-best's in-SLO requests a choice may lose
    recent_windows: int = 3  # the observed rates of the last max(this many windows, recent_s) ...
    recent_s: float = 600.0  # ... are scenarios too ...
    recent_weight: float = 0.6  # ... with this total weight
    peak_s: float = 3600.0  # the recent peak (for the bet below) is the highest rate of this span
    budget_share: float = 0.5  # of the day's SLO error budget ((1 - bar) x fixed-best's in-SLO requests
    #                            over the last 24 h) a choice may risk in one window at the recent peak
    quiet_budget_max: float = 2.0  # in a window quieter than the last 24 h, loss_budget x (24-h mean / next) up to this
    min_dwell_windows: int = 2  # the dwell is at least this many windows
    step_down: bool = True  # a scale-down goes in steps (step_ratio); off: straight to the cheapest
    bet_growth: float = 0.1  # the bet above is at the recent peak x (1 + this): the next window may rise
    step_ratio: float = 0.7  # with step_down, a scale-down goes no lower than this x the GPUs held
    #                          (or the next smaller world size, when none lies between)
    pace_span_s: float = 3 * 3600.0  # a scale-down waits while the switches of this span reach ...
    pace_slack: float = 1.0  # ... the day's budget spread over it plus this (0 span: no pacing)
    last_up: str = "day-peak"  # the rolling day's last scale-up goes at least to the cheapest topology
    #                            covering last_up_margin x the last 24 h's peak ("day-peak", once a
    #                            day is observed), or to the largest ("largest")
    last_up_margin: float = 1.1
    # ... and before a whole day is observed (stop 46), at least the cheapest covering this x the
    # highest rate observed so far (0: the largest, the rule before it): a service's first day, and
    # traces a day long or shorter, held the whole host from the day's last switch on
    last_up_partial_margin: float = 1.5
    # a scale-down waits while the rolling day has this many switches or fewer left, once the day's
    # last scale-up is sized by the day (last_up "day-peak" with a day, or since stop 46 part of
    # one, observed; 1 otherwise)
    down_reserve: int = 2
    # the bet's growth is at least this quantile of the jumps the last 24 h showed (a window's
    # rate over the peak of the peak_s before it, minus 1), at most bet_growth_max: a trace
    # whose rate has tripled within an hour before is bet to do so again (0: bet_growth alone)
    bet_growth_quantile: float = 0.99
    bet_growth_max: float = 1.0
    # ... and at least the largest jump of the last bet_recent_s (0: the quantile alone): a day's
    # 0.99 quantile is about its second-largest jump, so a leap seen in the last 30 min is bet to
    # come again while it is fresh, not only once it has happened twice
    bet_recent_s: float = 1800.0
    # bursts: a window above (1 + bet_growth_max) x the peak of the peak_s before it; the largest
    # such rise (req/s) of the last burst_span_s is added to the bet's peak: traffic that took
    # batch-job bursts (a rise no ratio of a quiet hour foresees) is bet to take one again, for
    # this long after the last (0: no burst memory)
    burst_span_s: float = 2 * 86400.0
    # the operator's own knowledge, for what no replay of the past foresees (0: none):
    # a burst of this many req/s may come at any time (the bet and the scale-down's cover include
    # it from the first window, as if the burst memory had seen one), and never fewer GPUs than
    # min_gpus (Kubernetes' minReplicas)
    burst_rps: float = 0.0
    min_gpus: int = 0
    # with no switch left in the rolling 24 h, a scale-up may still go (one over the budget, to
    # the largest) when one window at the bet would spend the day's whole SLO error budget left;
    # off: max_switches_per_day is a hard limit in every 24 h. Either way a calendar day (from
    # day_origin_s: UTC midnight; the replay sets its first window, as its report counts days)
    # never gets more than max_switches_per_day: the over-budget switch goes only on a day that
    # has fewer (the rolling 24 h filled by yesterday's)
    over_budget_up: bool = True
    day_origin_s: float = 0.0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}: choose one of {', '.join(OBJECTIVES)}")
        if self.sizing not in ("risk", "band"):
            raise ValueError(f"unknown sizing {self.sizing!r}: risk or band")
        if not (0 <= self.bet_growth_quantile <= 1 and self.bet_growth_max >= self.bet_growth
                and self.bet_recent_s >= 0):
            raise ValueError("0 <= bet_growth_quantile <= 1, bet_growth_max >= bet_growth, bet_recent_s >= 0")
        if not self.burst_span_s >= 0:
            raise ValueError("burst_span_s >= 0")
        if not math.isfinite(self.day_origin_s):
            raise ValueError("day_origin_s: a finite time (s)")
        if not (0 <= self.burst_rps < math.inf and self.min_gpus >= 0):
            raise ValueError("burst_rps: a number >= 0; min_gpus >= 0")
        if self.last_up not in ("day-peak", "largest") or not self.last_up_margin >= 1:
            raise ValueError(f"last_up {self.last_up!r}: day-peak or largest, with last_up_margin >= 1")
        if not (self.last_up_partial_margin == 0 or 1 <= self.last_up_partial_margin < math.inf):
            raise ValueError("last_up_partial_margin: 0 (off) or >= 1")
        if not self.down_reserve >= 1:
            raise ValueError("down_reserve >= 1")
        if not (0 < self.loss_budget < 1 and 0 <= self.recent_weight < 1 and self.min_dwell_windows >= 0
                and self.quiet_budget_max >= 1 and self.bet_growth >= 0
                and 0 < self.step_ratio <= 1 and self.pace_span_s >= 0 and self.pace_slack >= 0):
            raise ValueError("0 < loss_budget < 1, 0 <= recent_weight < 1, min_dwell_windows >= 0, "
                             "quiet_budget_max >= 1, bet_growth >= 0, 0 < step_ratio <= 1, "
                             "pace_span_s >= 0, pace_slack >= 0")
        if not (self.headroom >= 1.0 and 0 < self.band_quantile < 1 and self.min_dwell_s >= 0
                and self.max_switches_per_day >= 1 and self.floor_rps >= 0 and 0 < self.attainment_bar <= 1):
            raise ValueError("headroom >= 1, 0 < band_quantile < 1, dwell >= 0, budget >= 1, "
                             "floor >= 0, 0 < attainment_bar <= 1")

    def windows(self, span_s: float, window_s: float) -> int:
        return max(1, int(math.ceil(span_s / window_s - 1e-9)))

    def bet_recent_windows(self, window_s: float) -> int:
        """The windows whose jumps count at once in the bet (``observed_growth``'s ``recent``; 0: off)."""
        return self.windows(self.bet_recent_s, window_s) if self.bet_recent_s > 0 else 0


class CapacityTable:
    """SLO capacities, cost order and TPOTs of one profile under one SLO (precomputed once)."""

    def __init__(self, profile: Profile, slo: SLO, attainment_bar: float = 0.99,
                 max_world: int | None = None) -> None:
        self.profile, self.slo = profile, slo
        self.scorer = Scorer(profile, slo)
        curves = self.scorer.curves
        a0 = max(float(c.attainment[0]) for c in curves.values())
        self.bar = attainment_bar * a0
        self.slo_cap: dict[Topology, float] = {}
        for t, c in curves.items():
            ok = c.attainment >= self.bar
            if not ok[0]:
                self.slo_cap[t] = 0.0
                continue
            first_bad = int(np.argmin(ok)) if not ok.all() else len(ok)
            self.slo_cap[t] = float(c.grid_rps[first_bad - 1])
        worlds = {t.world_size for t in profile.topologies}
        self.max_world = max_world or max(worlds)
        self.order = sorted((t for t in profile.topologies if self.slo_cap[t] > 0 and t.world_size <= self.max_world),
                            key=lambda t: (t.world_size, -self.slo_cap[t]))
        if not self.order:
            raise ValueError(f"profile {profile.name!r}: no topology meets the SLO even at zero load")
        host = [t for t in self.order if t.world_size == self.max_world]
        if not host:
            raise ValueError(f"profile {profile.name!r}: no topology of the full world size {self.max_world} meets the SLO")
        self.fixed_best = max(host, key=lambda t: (self.slo_cap[t], profile.capacity(t)))
        self.host = host

    def world(self, t: Topology) -> int:
        return t.world_size

    @property
    def best_capacity(self) -> float:
        return self.slo_cap[self.fixed_best]

    def cheapest_covering(self, need: float, among: list[Topology] | None = None) -> Topology:
        cands = among if among is not None else self.order
        for t in cands:
            if self.slo_cap[t] >= need:
                return t
        return max(cands, key=lambda t: self.slo_cap[t])

    def tpot_s(self, t: Topology, rate: float) -> float:
        return self.profile.curve(t).at(min(rate, self.profile.capacity(t)))[2]

    def ttft_s(self, t: Topology, rate: float) -> float:
        return self.profile.curve(t).at(min(rate, self.profile.capacity(t)))[0]

    def lowest_tpot_covering(self, need: float, rate: float) -> Topology:
        cov = [t for t in self.host if self.slo_cap[t] >= need]
        if not cov:
            return self.fixed_best
        return min(cov, key=lambda t: (self.tpot_s(t, rate), -self.slo_cap[t]))

    def relative_loss(self, samples: np.ndarray, weights: np.ndarray) -> dict[Topology, float]:
        """Per topology, the expected in-SLO requests it loses against fixed-best over load
        ``samples`` (req/s, any shape; ``weights`` alike, summing to 1), as a share of
        fixed-best's expected in-SLO requests: sum w (g_best - g_T)+ / sum w g_best."""
        x = np.maximum(np.nan_to_num(np.asarray(samples, dtype=float)), 0.0).ravel()
        wt = np.asarray(weights, dtype=float).ravel()
        gb = self.scorer.goodput_rps(self.fixed_best, x)
        base = float(np.dot(wt, gb))
        out = {}
        for t in self.order:
            lost = float(np.dot(wt, np.maximum(gb - self.scorer.goodput_rps(t, x), 0.0)))
            out[t] = lost / base if base > 0 else 0.0
        return out

    def request_cost_gpu_s(self, cfg: ScaleConfig) -> float:
        if cfg.request_cost_gpu_s is not None:
            return cfg.request_cost_gpu_s
        return 50.0 * self.max_world / max(self.best_capacity, 1e-9)


@dataclass(frozen=True)
class Band:
    """Forecast for the coming windows: mean, the band's upper edge, and the scenario paths."""

    window_s: float
    mean: np.ndarray  # [H]
    upper: np.ndarray  # [H]
    scenarios: np.ndarray  # [K, H]
    forecaster: str = ""

    @classmethod
    def from_forecast(cls, fc, quantile: float) -> "Band":  # noqa: ANN001 - policy.forecast.Forecast
        sc = np.maximum(np.asarray(fc.scenarios, dtype=float), 0.0)
        return cls(fc.window_s, np.asarray(fc.mean, dtype=float), weighted_quantile(sc, fc.weights, quantile),
                   sc, fc.forecaster)


def weighted_quantile(scen: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """Per column of ``scen`` [K, H], the q-quantile of the K scenarios under ``weights``."""
    order = np.argsort(scen, axis=0)
    s = np.take_along_axis(scen, order, axis=0)
    w = np.asarray(weights, dtype=float)[order]
    cw = np.cumsum(w, axis=0) / np.sum(w, axis=0)
    idx = np.argmax(cw >= q - 1e-12, axis=0)
    return s[idx, np.arange(scen.shape[1])]


@dataclass(frozen=True)
class ScaleDecision:
    t_s: float
    objective: str
    current: Topology
    recommended: Topology
    switch: bool
    # scale-up | scale-down | lower-latency | stay | hold-dwell | hold-budget | hold-saving, and
    # (the live service only) hold-unreleased
    reason: str
    text: str
    need_rps: float
    capacity_rps: float  # SLO capacity of the recommended topology
    expected_saving: float  # GPU-hours over the horizon (gpu-hours) or TPOT ms (latency)
    saving_unit: str
    risk: float  # share of scenarios whose peak over the covered span exceeds the target's capacity
    profile: str
    switches_last_day: int


def _risk(band: Band, n: int, cap: float, headroom: float) -> float:
    if band.scenarios.size == 0:
        return 0.0
    peak = band.scenarios[:, :n].max(axis=1)
    return float(np.mean(peak * headroom > cap))


def decide_scale(state: PolicyState, now_s: float, last_rate: float, band: Band,
                 table: CapacityTable, cfg: ScaleConfig = ScaleConfig(),
                 recent_peak: float = math.nan, recent: np.ndarray | None = None,
                 error_budget: float = math.inf, seasonal: float = math.nan,
                 day_goodput: float = math.nan, day_peak: float = math.nan,
                 growth: float = math.nan, burst: float = math.nan,
                 partial_peak: float = math.nan) -> ScaleDecision:
    """One decision for the window starting at ``now_s`` (see the module docstring).
    ``recent_peak``: the highest rate observed over the last ``min_dwell_s`` (NaN: unknown); a
    scale-down target must also cover it with headroom (bursty traffic makes the multiplicative
    forecast band collapse after a quiet window; the recent peak does not). ``day_goodput``:
    fixed-best's mean in-SLO rate over the observed windows of the last 24 h (req/s; NaN: the
    loss budget is not scaled for quiet windows). ``day_peak``: the highest rate of the last
    24 h, NaN until a whole day has been observed (sizes the day's last scale-up);
    ``partial_peak``: until then, the highest rate observed so far (sizes it with
    ``last_up_partial_margin``; NaN: none observed). ``growth``:
    ``observed_growth`` of the last 24 h (NaN: bet_growth alone). ``burst``: ``observed_burst``
    of the last ``burst_span_s`` (req/s added to the bet's peak; NaN or 0: none)."""
    W = band.window_s
    H = len(band.upper)
    last = 0.0 if math.isnan(last_rate) else float(last_rate)
    if cfg.burst_rps > 0:  # the operator's declared burst, or a larger one observed
        burst = cfg.burst_rps if math.isnan(burst) else max(burst, cfg.burst_rps)
    # the topologies the operator allows (min_gpus); the largest always is one
    allowed = [t for t in table.order if t.world_size >= cfg.min_gpus] or [table.fixed_best]
    up_n = min(cfg.windows(cfg.up_lookahead_s, W), H)
    cover_n = min(cfg.windows(cfg.down_cover_s, W), H)
    hz_n = min(cfg.windows(cfg.horizon_s, W), H)

    def need(n: int) -> float:
        return max(cfg.headroom * max(last, float(np.max(band.upper[:n]))), cfg.floor_rps)

    cur = state.current
    cap = table.slo_cap.get(cur, 0.0)
    used = state.switches_in_last_day(now_s)
    left = cfg.max_switches_per_day - used
    dwell_left = max(0.0, state.last_switch_s + max(cfg.min_dwell_s, cfg.min_dwell_windows * W) - now_s)
    mean0 = float(band.mean[0]) if H else last
    n_now, n_plan, n_down = need(1), need(up_n), need(cover_n)
    if not math.isnan(recent_peak):
        n_down = max(n_down, cfg.headroom * recent_peak)
        if not math.isnan(burst):  # a burst of the last burst_span_s may come again
            n_down = max(n_down, recent_peak + burst)
    prof = table.profile.name

    def out(target: Topology, reason: str, text: str, saving: float = 0.0, unit: str = "gpu-hours",
            n_risk: int = 1, need_rps: float = n_now) -> ScaleDecision:
        return ScaleDecision(now_s, cfg.objective, cur, target, target != cur, reason, text, need_rps,
                             table.slo_cap.get(target, 0.0), saving, unit,
                             _risk(band, n_risk, table.slo_cap.get(target, 0.0), 1.0), prof, used)

    if cfg.objective == "latency":
        if n_now > cap or cur not in table.host:
            # the day's last switch goes to the largest, so no second scale-up can be needed
            tgt = table.lowest_tpot_covering(n_plan, mean0) if left > 1 else table.fixed_best
            return out(tgt, "scale-up", f"load {last:.3g} req/s nears {cur}'s SLO capacity {cap:.3g}: "
                       f"-> {tgt} (capacity {table.slo_cap[tgt]:.3g})", 0.0, "tpot-ms", up_n, n_plan)
        tgt = table.lowest_tpot_covering(n_down, mean0)
        gain_ms = (table.tpot_s(cur, mean0) - table.tpot_s(tgt, mean0)) * 1e3
        if tgt == cur or gain_ms < 0.05 * table.tpot_s(cur, mean0) * 1e3:
            return out(cur, "stay", f"{cur} is the lowest-TPOT topology covering {n_down:.3g} req/s",
                       0.0, "tpot-ms", cover_n, n_down)
        if dwell_left > 0:
            return out(cur, "hold-dwell", f"{tgt} would cut TPOT by {gain_ms:.1f} ms; dwell {dwell_left:.0f} s left",
                       gain_ms, "tpot-ms", cover_n, n_down)
        if left <= 1:
            return out(cur, "hold-budget", f"{tgt} would cut TPOT by {gain_ms:.1f} ms; {used} switches in 24 h",
                       gain_ms, "tpot-ms", cover_n, n_down)
        return out(tgt, "lower-latency", f"{cur} -> {tgt}: TPOT -{gain_ms:.1f} ms at {mean0:.3g} req/s",
                   gain_ms, "tpot-ms", cover_n, n_down)

    # the load the day's last scale-up must cover (NaN: the largest topology); a known one makes
    # scale-downs keep down_reserve switches
    last_need = _last_need(cfg, day_peak, partial_peak)
    if cfg.sizing == "risk":
        return _decide_risk(state, now_s, last, band, table, cfg, recent, recent_peak, out, used, left, dwell_left,
                            up_n, cover_n, hz_n, mean0, n_now, error_budget, seasonal, day_goodput, last_need,
                            growth, burst, allowed)

    # gpu-hours, sizing "band"
    if n_now > cap or cur not in allowed:
        return _scale_up(out, table, cur, table.cheapest_covering(n_plan, allowed), up_n, W,
                         f"load {n_now:.3g} req/s with headroom",
                         f"need {n_now:.3g} req/s > {cur}'s SLO capacity {cap:.3g}", n_plan, left,
                         last_need)
    tgt = table.cheapest_covering(n_down, allowed)
    if tgt.world_size >= cur.world_size:
        return out(cur, "stay", f"{cur} is the fewest GPUs covering {n_down:.3g} req/s", 0.0, "gpu-hours",
                   cover_n, n_down)
    tcap = table.slo_cap[tgt]
    covered = cfg.headroom * np.maximum(band.upper[:hz_n], last) <= tcap
    run = int(np.argmin(covered)) if not covered.all() else hz_n
    saving = (cur.world_size - tgt.world_size) * run * W / 3600.0
    lost = table.scorer.switch_cost(cur, tgt, max(mean0, last)) + table.scorer.switch_cost(tgt, cur, max(mean0, last))
    cost = (lost * table.request_cost_gpu_s(cfg)
            + table.profile.downtime_s(cur, tgt) * cur.world_size) / 3600.0
    risk_n = max(run, 1)
    held = _hold_scale_down(out, cur, tgt, saving, cost, dwell_left, used, left, cfg, risk_n, n_down,
                            state.switches_in_last(now_s, cfg.pace_span_s), not math.isnan(last_need))
    if held is not None:
        return held
    return out(tgt, "scale-down", f"{cur} -> {tgt}: release {cur.world_size - tgt.world_size} GPUs, "
               f"save {saving:.2f} GPU-h over {run * W / 60:.0f} min (switch cost {cost:.3f}) at "
               f"{mean0:.3g} req/s, need {n_down:.3g}", saving, "gpu-hours", risk_n, n_down)


def _scale_up(out, table: CapacityTable, cur: Topology, tgt: Topology, up_n: int, W: float,
              state_text: str, why: str, need: float, left: int,
              last_need: float = math.nan) -> "ScaleDecision":
    """Scale up to ``tgt`` now (no dwell, never held by the budget); a target no larger than
    ``cur`` means the largest topology, and staying when ``cur`` already is it.

    With ``left`` <= 1 this is the rolling day's last switch (the one a scale-down keeps in
    reserve): it must make a second scale-up unlikely before the day's switches age out (with
    world sizes 1, 2, 4, 8, two steps up, 2 -> 4 -> 8, would break the budget). It goes at least
    to the cheapest topology covering ``last_need`` (``last_up`` "day-peak": last_up_margin x the
    highest rate of the last 24 h, known once a whole day has been observed), or to the largest
    (``last_up`` "largest", or nothing observed yet; before a whole day is observed ``last_need``
    is last_up_partial_margin x the highest rate so far). Should load pass that anyway
    (``left`` 0), the scale-up goes to the largest: one switch over the day's budget rather than the SLO lost."""
    largest = max(table.order, key=lambda t: table.slo_cap[t])
    if table.slo_cap[tgt] <= table.slo_cap.get(cur, 0.0) or left <= 0:
        tgt = largest
    elif left <= 1:
        floor = largest if math.isnan(last_need) else table.cheapest_covering(last_need)
        if table.slo_cap[floor] > table.slo_cap[tgt]:
            tgt = floor
    if tgt == cur:
        return out(cur, "stay", f"{cur} is already the largest; {state_text}")
    extra = (tgt.world_size - cur.world_size) * up_n * W / 3600.0
    return out(tgt, "scale-up", f"{why}: -> {tgt} (capacity {table.slo_cap[tgt]:.3g}; "
               f"+{extra:.2f} GPU-h over {up_n * W / 60:.0f} min)", -extra, "gpu-hours", up_n, need)


def _last_need(cfg: ScaleConfig, day_peak: float, partial_peak: float = math.nan) -> float:
    """The load the day's last scale-up must cover at least (NaN: the largest topology):
    last_up_margin x the last 24 h's peak once a whole day is observed, before that
    last_up_partial_margin x the highest rate observed so far (where on)."""
    if cfg.last_up != "day-peak":
        return math.nan
    if not math.isnan(day_peak):
        return cfg.last_up_margin * day_peak
    if cfg.last_up_partial_margin > 0 and not math.isnan(partial_peak):
        return cfg.last_up_partial_margin * partial_peak
    return math.nan


def _hold_scale_down(out, cur: Topology, tgt: Topology, saving: float, cost: float,
                     dwell_left: float, used: int, left: int, cfg: ScaleConfig, risk_n: int,
                     need: float, paced: int = 0, sized_last: bool = False) -> "ScaleDecision | None":
    """Why a worthwhile scale-down to ``tgt`` waits (a hold decision), or None when it may go:
    the dwell since the last switch, the day's switch budget (one switch kept for a scale-up;
    ``down_reserve`` when ``sized_last``, the day's last scale-up sized by the day's peak rather
    than the whole host: a scale-down that left one would make the next scale-up that last one,
    and a load past the day's peak after it would need a switch over the budget),
    the pace (``paced`` switches in the last ``pace_span_s`` already at the day's budget spread
    evenly over that span, plus ``pace_slack``), a saving that does not beat the switch's cost
    weighted by the budget left."""
    if dwell_left > 0:
        return out(cur, "hold-dwell", f"{tgt} would save {saving:.2f} GPU-h; dwell {dwell_left:.0f} s left",
                   saving, "gpu-hours", risk_n, need)
    # never all of a small budget: with 2 switches a day, one scale-down and one scale-up
    reserve = min(cfg.down_reserve, max(cfg.max_switches_per_day - 1, 1)) if sized_last else 1
    if left <= reserve:
        return out(cur, "hold-budget", f"{tgt} would save {saving:.2f} GPU-h; {used}/{cfg.max_switches_per_day} "
                   f"switches in 24 h ({reserve} kept for scale-ups)", saving, "gpu-hours", risk_n, need)
    pace = cfg.pace_slack + cfg.max_switches_per_day * cfg.pace_span_s / DAY_S
    if cfg.pace_span_s > 0 and paced >= pace:
        return out(cur, "hold-pace", f"{tgt} would save {saving:.2f} GPU-h; {paced} switches in the "
                   f"last {cfg.pace_span_s / 3600:.3g} h (pace {pace:.3g})", saving, "gpu-hours", risk_n,
                   need)
    threshold = cost * cfg.max_switches_per_day / left
    if saving <= threshold:
        return out(cur, "hold-saving", f"{tgt} would save {saving:.2f} GPU-h <= switch cost {threshold:.2f}",
                   saving, "gpu-hours", risk_n, need)
    return None


def observed_growth(rates: np.ndarray, peak_n: int, quantile: float, recent: int = 0) -> float:
    """How far a window's rate rose above the highest of the ``peak_n`` windows before it
    (rate / that peak - 1), the ``quantile`` of it over ``rates`` (the last 24 h, oldest first,
    NaN = missing, counted as no traffic); NaN with fewer than 6 such windows or quantile 0.
    With ``recent`` > 0, at least the largest such rise of the last ``recent`` windows (where one
    had a peak before it to measure against): a jump just seen is bet to come again, however rare
    the day's quantile makes it."""
    x = np.nan_to_num(np.asarray(rates, dtype=float))
    if len(x) <= peak_n or peak_n < 1:
        return math.nan
    prev = np.lib.stride_tricks.sliding_window_view(x[:-1], peak_n).max(axis=1)
    ok = prev > 0
    jumps = x[peak_n:] / np.where(ok, prev, 1.0) - 1.0
    g = math.nan
    if quantile > 0 and ok.sum() >= 6:
        g = float(np.quantile(jumps[ok], quantile))
    if recent > 0 and ok[-recent:].any():
        r = float(jumps[-recent:][ok[-recent:]].max())
        g = r if math.isnan(g) else max(g, r)
    return g


def burst_rises(rates: np.ndarray, peak_n: int, ratio: float) -> np.ndarray:
    """Per window of ``rates`` (oldest first, NaN = missing) from the ``peak_n``-th on (entry j is
    window j + peak_n): how far (req/s) it rose above the highest of the ``peak_n`` windows before
    it, where it rose above ``ratio`` x that peak and those windows were all observed (a rise
    after a data gap is traffic coming back, not a burst); 0 elsewhere."""
    x = np.asarray(rates, dtype=float)
    if len(x) <= peak_n or peak_n < 1:
        return np.zeros(0)
    hours = np.lib.stride_tricks.sliding_window_view(x[:-1], peak_n)
    seen = ~np.isnan(hours).any(axis=1)
    before = np.where(seen, np.nan_to_num(hours).max(axis=1), np.inf)
    cur = x[peak_n:]
    burst = seen & ~np.isnan(cur) & (cur > ratio * np.maximum(before, 0.0))
    return np.where(burst, cur - np.where(burst, before, 0.0), 0.0)


def observed_burst(rates: np.ndarray, peak_n: int, ratio: float) -> float:
    """The largest burst in ``rates`` (``burst_rises``): 0 when none, NaN with fewer than
    ``peak_n`` + 6 windows. The live service calls this; a replay computes the rises once and
    takes ``span_burst`` of each window's span."""
    x = np.asarray(rates, dtype=float)
    return span_burst(burst_rises(x, peak_n, ratio), len(x), peak_n)


def span_burst(rises: np.ndarray, windows: int, peak_n: int) -> float:
    """``observed_burst`` of a span of ``windows`` windows from its rises (``burst_rises`` of the
    span, or the same entries sliced from a longer series' rises)."""
    if windows < peak_n + 6 or peak_n < 1:
        return math.nan
    return float(rises.max()) if rises.size else 0.0


def _mixture(band: Band, n: int, recent: np.ndarray, weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Load samples for the next ``n`` windows: every forecast scenario's path over them, and the
    recent observed rates (each assumed possible in any of them); weights sum to 1."""
    sc = band.scenarios[:, :n] if band.scenarios.size else np.asarray(band.upper[:n])[None, :]
    rec = recent[~np.isnan(recent)] if recent.size else recent
    if rec.size == 0 or weight <= 0:
        return sc.ravel(), np.full(sc.size, 1.0 / sc.size)
    rs = np.repeat(rec[:, None], sc.shape[1], axis=1)
    w = np.concatenate([np.full(sc.size, (1 - weight) / sc.size), np.full(rs.size, weight / rs.size)])
    return np.concatenate([sc.ravel(), rs.ravel()]), w


def _decide_risk(state, now_s, last, band, table, cfg, recent, recent_peak, out, used, left, dwell_left,
                 up_n, cover_n, hz_n, mean0, n_now, error_budget, seasonal, day_goodput,
                 last_need, growth, burst, allowed):  # noqa: ANN001 - see decide_scale (last_need: _last_need)
    """gpu-hours with sizing "risk" (see the module docstring)."""
    W = band.window_s
    cur = state.current
    rec = np.asarray([last] if recent is None else recent, dtype=float)
    if recent is None and not math.isnan(recent_peak):
        rec = np.append(rec, recent_peak)
    eps = cfg.loss_budget

    # yesterday's rate for the coming slot (where the trace has a day of history) is one more
    # recent sample: traffic that collapsed (an outage, a gap) may come back at its usual level
    mix = rec if math.isnan(seasonal) else np.append(rec, seasonal)

    def ok(n: int) -> dict:
        x, wt = _mixture(band, n, mix, cfg.recent_weight)
        return table.relative_loss(x, wt)

    # the day's bar counts requests, not windows: a window quieter than the last 24 h's mean may
    # lose a larger share of its own requests for the same share of the day's
    if cfg.quiet_budget_max > 1.0 and not math.isnan(day_goodput) and day_goodput > 0:
        x1, w1 = _mixture(band, 1, mix, cfg.recent_weight)
        nxt = float(np.dot(w1, table.scorer.goodput_rps(table.fixed_best, np.maximum(np.nan_to_num(x1), 0.0))))
        if nxt > 0:
            eps *= min(max(day_goodput / nxt, 1.0), cfg.quiet_budget_max)

    pk = np.append(rec, recent_peak) if recent_peak is not None else rec
    peak = float(np.nanmax(pk)) if pk.size and np.any(~np.isnan(pk)) else last
    # the bet: one window at the recent peak, allowed to rise by bet_growth (with 1-h windows and
    # no day of history, a morning ramp of +30 % an hour is not in the recent peak yet)
    g = cfg.bet_growth if math.isnan(growth) else min(max(cfg.bet_growth, growth), cfg.bet_growth_max)
    # and, where the traffic took bursts lately, at the recent peak plus the largest of them
    peak = max(peak * (1.0 + g), peak + (0.0 if math.isnan(burst) else burst))
    gb_peak = float(table.scorer.goodput_rps(table.fixed_best, peak))

    def bet(t: Topology) -> float:
        """Requests ``t`` loses against fixed-best in one window at the recent peak."""
        return max(gb_peak - float(table.scorer.goodput_rps(t, peak)), 0.0) * W

    def qualifies(t: Topology, loss: dict) -> bool:
        return (loss[t] <= eps and table.slo_cap[t] >= cfg.floor_rps
                and bet(t) <= cfg.budget_share * error_budget)

    def cheapest(loss: dict) -> Topology:
        for t in allowed:
            if qualifies(t, loss):
                return t
        return max(table.order, key=lambda t: table.slo_cap[t])

    now = ok(1)
    cur_bet = bet(cur)
    over_loss = now.get(cur, math.inf) > eps
    over_bet = cur_bet > cfg.budget_share * error_budget
    if over_loss or over_bet or table.slo_cap.get(cur, 0.0) < cfg.floor_rps or cur not in allowed:
        # what calls for the scale-up, said as it is: the expected loss past the loss budget, or
        # the bet (one window at the recent peak) past its share of the day's SLO error budget left
        why_up = (f"expected in-SLO loss {now.get(cur, 1.0):.2%} on {cur} > {eps:.2%}"
                  if over_loss or not over_bet else
                  f"one window at {peak:.3g} req/s would lose {cur_bet:.3g} requests on {cur}, more than "
                  f"{cfg.budget_share:g} x the day's SLO error budget left ({error_budget:.3g})")
        day_start = now_s - (now_s - cfg.day_origin_s) % DAY_S
        day_used = sum(1 for t in state.switch_times_s if t >= day_start)
        if left <= 0 and (not cfg.over_budget_up or day_used >= cfg.max_switches_per_day
                          or (table.slo_cap.get(cur, 0.0) >= cfg.floor_rps and cur_bet <= error_budget)):
            # no switch left in the rolling day: a scale-up goes over the budget only when the
            # day's bar is at stake (one window at the bet would spend the whole SLO error budget
            # left), not for an expected loss just past loss_budget, and only on a calendar day
            # with fewer than the budget (so no day has more); never with over_budget_up off
            stake = ("the budget is a hard limit (over_budget_up off)" if not cfg.over_budget_up else
                     f"this calendar day already has {day_used} (the most a day may have)"
                     if day_used >= cfg.max_switches_per_day else
                     f"the day's SLO error budget ({error_budget:.3g} requests) absorbs a window at the "
                     f"recent peak")
            return out(cur, "hold-budget", f"{why_up}, but {used}/{cfg.max_switches_per_day} switches in 24 h "
                       f"and {stake}", 0.0, "gpu-hours", 1, n_now)
        return _scale_up(out, table, cur, cheapest(ok(up_n)), up_n, W,
                         f"expected loss {now.get(cur, 1.0):.2%}", why_up, n_now, left, last_need)
    tgt = cheapest(now)
    if tgt.world_size >= cur.world_size:
        seen = (f"the declared burst of {burst:.3g} req/s (--burst-rps) is bet to come" if burst == cfg.burst_rps
                else f"a burst of {burst:.3g} req/s in the last {cfg.burst_span_s / 3600:g} h is bet to come again")
        why = f"; {seen} (one window at {peak:.3g} req/s)" if not math.isnan(burst) and burst > 0 else ""
        return out(cur, "stay", f"{cur} is the fewest GPUs within the loss budget {eps:.2%} and the SLO error "
                   f"budget's bet{why}", 0.0, "gpu-hours", 1, n_now)
    need_n = max(cfg.recent_windows, cfg.windows(cfg.recent_s, W))
    # warm-up: a scale-down needs need_n windows observed in a row (at the start, after a gap)
    seen = need_n if recent is None else (len(rec) if not np.isnan(rec).any()
                                           else len(rec) - 1 - int(np.flatnonzero(np.isnan(rec))[-1]))
    if seen < need_n:
        return out(cur, "hold-warmup", f"{tgt} may fit, but only {seen} of {need_n} recent windows observed in a row",
                   0.0, "gpu-hours", 1, n_now)
    if cfg.step_down:
        below = [t.world_size for t in table.order if t.world_size < cur.world_size]
        within = [w for w in below if w >= cfg.step_ratio * cur.world_size]
        step = max(tgt.world_size, min(within) if within else max(below))
        # the highest-capacity one of that size that itself qualifies (a higher SLO capacity does
        # not always mean a lower expected loss past it)
        fits = [t for t in table.order if t.world_size == step and qualifies(t, now)]
        if not fits:
            return out(cur, "stay", f"{tgt} may fit, but no {step}-GPU topology is within the loss budget "
                       f"{eps:.2%}", 0.0, "gpu-hours", 1, n_now)
        tgt = fits[0]
    tcap = table.slo_cap[tgt]
    # expected run: windows until the forecast mean leaves the target's SLO capacity
    covered = np.asarray(band.mean[:hz_n]) <= tcap
    run = max(int(np.argmin(covered)) if not covered.all() else hz_n, 1)
    saving = (cur.world_size - tgt.world_size) * run * W / 3600.0
    lost = table.scorer.switch_cost(cur, tgt, max(mean0, last)) + table.scorer.switch_cost(tgt, cur, max(mean0, last))
    cost = (lost * table.request_cost_gpu_s(cfg)
            + table.profile.downtime_s(cur, tgt) * cur.world_size) / 3600.0
    held = _hold_scale_down(out, cur, tgt, saving, cost, dwell_left, used, left, cfg, run, n_now,
                            state.switches_in_last(now_s, cfg.pace_span_s), not math.isnan(last_need))
    if held is not None:
        return held
    return out(tgt, "scale-down", f"{cur} -> {tgt}: release {cur.world_size - tgt.world_size} GPUs, "
               f"save {saving:.2f} GPU-h over {run * W / 60:.0f} min (switch cost {cost:.3f}); expected in-SLO "
               f"loss {now[tgt]:.2%} <= {eps:.2%}", saving, "gpu-hours", run, n_now)


def after(state: PolicyState, d: ScaleDecision) -> PolicyState:
    if not d.switch:
        return state
    recent = tuple(t for t in state.switch_times_s if d.t_s - t < DAY_S)
    return PolicyState(d.recommended, d.t_s, recent + (d.t_s,))
