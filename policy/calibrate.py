"""The profile corrected from the host's own latencies (issue 16; pure).

The policy decides on a profile (a model, or a measurement of another host); the host is what it
is. Every window the agent reports the mean TPOT of the requests that finished in it (vLLM's
``vllm:request_time_per_output_token_seconds`` histogram) next to the rate it served. For the
topology the host held, the profile taken as ``s`` x slower (``Profile.slowed``: latencies x s at
load x s) predicts ``s · tpot_p50(s · rate)``; the ``s`` that makes this equal to what was
observed is the window's *implied slowdown* (:func:`implied_slowdown`). The policy then decides on
the profile taken as ``max(floor, median of the implied slowdowns of the last span_s)`` x slower,
rounded to ``step`` (:func:`calibrated_slowdown`; the median weighs each window by its finished
requests) — ``floor`` being the operator's
``--profile-slowdown``, so calibration only ever makes the policy more careful than configured,
never less: a host that looks faster than its profile keeps the profile.

The agent reports the mean TTFT of the requests that reached their first token in each window
too; the TTFT side is calibrated the same way, with one difference: the TTFT's *level* gets its own
factor, the *load* the queue sees does not. :func:`implied_ttft_slowdown` is the ``t`` with which
the profile's *mean* TTFT (a lognormal through its p50 and p90, :func:`mean_ttft`) at ``s · rate``
— ``s`` the TPOT's slowdown in effect — times ``t`` equals the observed mean; ``t`` is at least
``s`` (the one-factor assumption, all there was before TTFT was read), more when the TTFT says so,
from at least ``ttft_min_windows`` windows. The policy then decides on
:func:`calibrated_profile` ``(profile, s, t)``: every curve taken as ``s`` x slower (latencies x s
at load x s), its TTFT at load λ ``t · ttft(s · λ)``. Where the queue sets in is the host's
throughput, which the TPOT under load reads (prefill that is slower than modelled takes decode
time in chunked prefill and shows there); until stop 46 the TTFT's factor moved the queue's onset
as well (``t · ttft(t · λ)``), so a host whose prefill alone was slower read as *less* slow in the
windows a gpu-hours policy holds near capacity (the steep M/M/c queue: H200 70B runs with the TTFT
1.5 x the model's read 1.25-1.3, and a topology that never meets a 1-s TTFT looked feasible).

What it corrects and what not: a profile that is wrong by one factor on every engine time (the
model's kernels slower or faster than the host's, the traffic's requests longer than the profile's
reference request), and one whose prefill (TTFT) is wrong by another factor than its decode
(TPOT). A TPOT error that shows only under load the host has not carried yet is not seen. Windows
with fewer than ``min_requests`` finished requests, across a switch (the requests finishing
there ran partly on the old topology), or above the profile's capacity for the topology held (it
predicts no latency there; an overloaded host would read as a slow one) are not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np

from policy.profile_types import Profile, TopologyCurve

LO, HI = 0.25, 4.0  # Profile.slowed's range


@dataclass(frozen=True)
class CalibrationConfig:
    enabled: bool = True
    span_s: float = 3600.0  # the implied slowdowns of the windows of the last span_s ...
    min_total: int = 100  # ... their finished requests at least this many, else the floor alone
    min_requests: int = 20  # a window counts with at least this many finished requests
    step: float = 0.025  # the calibrated slowdown is rounded to this
    ceiling: float = HI
    # the TTFT side needs this many windows in the span (a TTFT factor other than the TPOT's
    # reorders the topologies, so one noisy window must not set it; the span's bounds are
    # inclusive, so 1-h windows give it 2 from the second hour on)
    ttft_min_windows: int = 2

    def __post_init__(self) -> None:
        if not (self.span_s > 0 and self.min_total >= 1 and self.min_requests >= 1
                and 0 < self.step <= 0.5 and LO <= self.ceiling <= HI and self.ttft_min_windows >= 1):
            raise ValueError("span_s > 0, min_total >= 1, min_requests >= 1, 0 < step <= 0.5, "
                             f"ceiling within [{LO}, {HI}], ttft_min_windows >= 1")


@dataclass(frozen=True)
class Observation:
    """One window as the host served it: its end (s), how many requests finished in it, and the
    slowdown their mean TPOT implies (:func:`implied_slowdown` against the base profile; NaN: not
    determinable)."""

    at_s: float
    requests: float
    implied: float


# the TTFT is read only where the profile's mean TTFT is not steep in the load: at most
# STEEP_MAX % more for 1 % more load (tested over a STEEP_STEP step). Where the queue takes off, a
# small error in the load the queue sees (the TPOT's slowdown read with noise) moves the TTFT by
# much more, and the window's factor would say that instead of the host's prefill.
STEEP_STEP, STEEP_MAX = 1.05, 1.0
Z90 = 1.2815515655446004  # the standard normal's 0.9 quantile


def implied_slowdown(curve: TopologyCurve, rate: float, tpot_s: float) -> float:
    """The ``s`` with ``s · tpot_p50(s · rate) = tpot_s`` on ``curve`` (the base profile's),
    clamped into [0.25, 4]; NaN when the observation says nothing (no rate, no TPOT) or when the
    window ran above the curve's own capacity: the profile predicts no latency there, and an
    overloaded host's TPOT, held against the curve's at capacity, would read as a slower host
    (vLLM on an H100 at 1.18x the model's capacity read as 1.12x slower while it was 0.81-0.89x
    below it; bench/results/vllm_gpu_vs_model_h100-2026-12-07.md)."""
    if not _observed(curve, rate, tpot_s):
        return math.nan
    x, y = np.asarray(curve.load_rps), np.asarray(curve.tpot_p50_s)
    # non-decreasing in s (TPOT never falls with load)
    return _invert(lambda s: s * float(np.interp(min(s * rate, curve.capacity_rps), x, y)), tpot_s)


def _observed(curve: TopologyCurve, rate: float, latency_s: float) -> bool:
    """Whether a window's mean latency at ``rate`` says anything against ``curve``: a rate and a
    latency, and the rate within the curve's capacity."""
    return (math.isfinite(rate) and 0 <= rate <= curve.capacity_rps and math.isfinite(latency_s)
            and latency_s > 0)


def lognormal_mean(p50: float, p90: float) -> float:
    """The mean of the lognormal through a median ``p50`` and a 0.9 quantile ``p90`` (p90 <= p50:
    no spread, the median)."""
    sigma = math.log(max(p90 / p50, 1.0)) / Z90 if p50 > 0 else 0.0
    return p50 * math.exp(0.5 * sigma * sigma)


def mean_ttft(curve: TopologyCurve, rate: float, s: float = 1.0) -> float:
    """The mean TTFT ``curve`` predicts at ``rate`` on the profile taken as ``s`` x slower: the
    mean of a lognormal through its TTFT p50 and p90 at ``s · rate``, times ``s``. (The agent
    reports a mean; TTFT's tail — long prompts, queueing — puts it above the median.)"""
    p50, p90 = curve.at(min(s * rate, curve.capacity_rps))[:2]
    return s * lognormal_mean(p50, p90)


def implied_ttft_slowdown(curve: TopologyCurve, rate: float, ttft_s: float,
                          s: float = 1.0) -> float:
    """The ``t`` with ``t · lognormal mean of the TTFT at s · rate = ttft_s`` (the observed mean
    TTFT; ``s`` the TPOT's slowdown in effect, which sets the load the queue sees), clamped into
    [0.25, 4]; NaN when the observation says nothing or ``s · rate`` is above the curve's capacity
    (as :func:`implied_slowdown`)."""
    if not (math.isfinite(s) and s > 0 and _observed(curve, s * rate * STEEP_STEP, ttft_s)):
        return math.nan
    base = mean_ttft(curve, s * rate)
    if not base > 0 or mean_ttft(curve, s * rate * STEEP_STEP) > base * STEEP_STEP ** STEEP_MAX:
        return math.nan
    return float(min(max(ttft_s / base, LO), HI))


def _invert(f, target: float) -> float:  # noqa: ANN001 - f: non-decreasing float -> float
    """The ``s`` in [LO, HI] with ``f(s) = target`` (bisection in log s), clamped."""
    if f(LO) >= target:
        return LO
    if f(HI) <= target:
        return HI
    lo, hi = math.log(LO), math.log(HI)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if f(math.exp(mid)) < target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def calibrated_slowdown(observations: Iterable[Observation], now_s: float, floor: float,
                        cfg: CalibrationConfig, min_windows: int = 1) -> float:
    """The slowdown to decide on: ``max(floor, median implied slowdown over the last span_s)`` —
    the median of the windows weighted by their finished requests — rounded to ``cfg.step``, at
    most ``cfg.ceiling``; ``floor`` while those windows hold fewer than ``cfg.min_total``
    requests or are fewer than ``min_windows`` (or calibration is off)."""
    if not cfg.enabled:
        return floor
    use = [(o.implied, o.requests) for o in observations
           if now_s - cfg.span_s - 1e-9 <= o.at_s <= now_s + 1e-9 and o.requests >= cfg.min_requests
           and math.isfinite(o.implied)]
    if sum(n for _, n in use) < cfg.min_total or len(use) < min_windows:
        return floor
    s, n = np.array(sorted(use)).T
    est = float(s[np.searchsorted(np.cumsum(n), 0.5 * n.sum())])
    est = round(round(est / cfg.step) * cfg.step, 6)
    return float(min(max(floor, est), max(floor, cfg.ceiling)))


def calibrated_profile(profile: Profile, s: float, s_ttft: float | None = None) -> Profile:
    """``profile`` taken as ``s`` x slower (latencies x s at load x s) and its TTFT at load λ
    ``s_ttft · ttft(s · λ)`` (None: ``s``): the TTFT's level has its own factor, the queue's onset
    is the TPOT's. Named for what it is: ``<name>-calibrated<s>[-ttft<s_ttft>]``."""
    t = s if s_ttft is None else s_ttft
    if s == 1.0 and t == 1.0:
        return profile
    p = profile.slowed(s)
    name, says = f"{profile.name}-calibrated{s:g}", f"TPOT says {s:g}x"
    if t != s:
        name, says = f"{name}-ttft{t:g}", f"{says}, its TTFT {t:g}x"
        k = t / s
        p = replace(p, curves=tuple(replace(c, ttft_p50_s=tuple(k * v for v in c.ttft_p50_s),
                                            ttft_p90_s=tuple(k * v for v in c.ttft_p90_s))
                                    for c in p.curves))
    return replace(p, name=name,
                   notes=f"{profile.notes}; calibrated: the host's observed {says} "
                         f"slower than {profile.name}",
                   params={**profile.params, "calibrated": s, "calibrated_ttft": t,
                           "slowdown": float(profile.params.get("slowdown", 1.0)) * s})
