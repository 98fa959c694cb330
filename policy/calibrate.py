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

What it corrects and what not: a profile that is wrong by one factor on every engine time (the
model's kernels slower or faster than the host's, the traffic's requests longer than the profile's
reference request). It reads decode (TPOT) only; a prefill-only error is not seen. Windows with
fewer than ``min_requests`` finished requests, or across a switch (the requests finishing there
ran partly on the old topology), are not used.
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

    def __post_init__(self) -> None:
        if not (self.span_s > 0 and self.min_total >= 1 and self.min_requests >= 1
                and 0 < self.step <= 0.5 and LO <= self.ceiling <= HI):
            raise ValueError("span_s > 0, min_total >= 1, min_requests >= 1, 0 < step <= 0.5, "
                             f"ceiling within [{LO}, {HI}]")


@dataclass(frozen=True)
class Observation:
    """One window as the host served it: its end (s), how many requests finished in it, and the
    slowdown their mean TPOT implies (:func:`implied_slowdown` against the base profile; NaN: not
    determinable)."""

    at_s: float
    requests: float
    implied: float


def implied_slowdown(curve: TopologyCurve, rate: float, tpot_s: float) -> float:
    """The ``s`` with ``s · tpot_p50(s · rate) = tpot_s`` on ``curve`` (the base profile's),
    clamped into [0.25, 4]; NaN when the observation says nothing (no rate, no TPOT)."""
    if not (math.isfinite(rate) and rate >= 0 and math.isfinite(tpot_s) and tpot_s > 0):
        return math.nan
    x, y = np.asarray(curve.load_rps), np.asarray(curve.tpot_p50_s)

    def f(s: float) -> float:  # non-decreasing in s (TPOT never falls with load)
        return s * float(np.interp(min(s * rate, curve.capacity_rps), x, y))

    if f(LO) >= tpot_s:
        return LO
    if f(HI) <= tpot_s:
        return HI
    lo, hi = math.log(LO), math.log(HI)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if f(math.exp(mid)) < tpot_s:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


def calibrated_slowdown(observations: Iterable[Observation], now_s: float, floor: float,
                        cfg: CalibrationConfig) -> float:
    """The slowdown to decide on: ``max(floor, median implied slowdown over the last span_s)`` —
    the median of the windows weighted by their finished requests — rounded to ``cfg.step``, at
    most ``cfg.ceiling``; ``floor`` while those windows hold fewer than ``cfg.min_total``
    requests (or calibration is off)."""
    if not cfg.enabled:
        return floor
    use = [(o.implied, o.requests) for o in observations
           if now_s - cfg.span_s - 1e-9 <= o.at_s <= now_s + 1e-9 and o.requests >= cfg.min_requests
           and math.isfinite(o.implied)]
    if sum(n for _, n in use) < cfg.min_total:
        return floor
    s, n = np.array(sorted(use)).T
    est = float(s[np.searchsorted(np.cumsum(n), 0.5 * n.sum())])
    est = round(est / cfg.step) * cfg.step
    return float(min(max(floor, est), max(floor, cfg.ceiling)))


def calibrated_profile(profile: Profile, s: float) -> Profile:
    """``profile`` taken as ``s`` x slower, named for what it is: ``<name>-calibrated<s>``."""
    if s == 1.0:
        return profile
    p = profile.slowed(s)
    return replace(p, name=f"{profile.name}-calibrated{s:g}",
                   notes=f"{profile.notes}; calibrated: the host's observed TPOT says {s:g}x "
                         f"slower than {profile.name}",
                   params={**profile.params, "calibrated": s,
                           "slowdown": float(profile.params.get("slowdown", 1.0)) * s})
