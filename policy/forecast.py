"""Traffic forecasters behind one interface, and a chooser that picks one by rolling backtest.

Pure (numpy only, no clock, no I/O). A forecaster sees one observation per fixed window
(``update(t_start_s, rate)``, rate in req/s, NaN = missing window) and predicts the rates of the
next ``horizon`` windows (``predict(horizon)``: index 0 is the window right after the last one
seen). ``t_start_s`` is seconds since local midnight of day 0, so time of day is t mod 86400.

- ``LastValue``: the last observed rate, flat.
- ``EWMA``: exponentially weighted level, flat.
- ``Seasonal``: a time-of-day profile (per-slot EWMA across days), times a day-of-week factor
  once a week has been seen, times a level correction that decays with the horizon.
- ``HoltWinters``: additive Holt-Winters with damped trend on log(1 + rate) (multiplicative in
  rate), daily season; plain damped Holt until one day has been seen.
- ``Chooser``: runs all of them, keeps each one's rolling error per horizon (predictions made h
  windows ago against what arrived) and forecasts with the one whose error is lowest over the
  decision horizon. It also gives forecast scenarios from its own recent errors, so the decision
  core can weigh uncertainty.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

DAY_S = 86400.0
WEEK_S = 7 * DAY_S


class Forecaster(Protocol):
    name: str

    def update(self, t_start_s: float, rate: float) -> None: ...

    def predict(self, horizon: int) -> np.ndarray: ...


def fit(f: Forecaster, t_start_s: Sequence[float], rates: Sequence[float]) -> Forecaster:
    """Feed a whole series (oldest first); returns ``f`` for chaining."""
    for t, r in zip(t_start_s, rates):
        f.update(float(t), float(r))
    return f


class LastValue:
    name = "last"

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.value = math.nan

    def update(self, t_start_s: float, rate: float) -> None:
        if not math.isnan(rate):
            self.value = rate

    def predict(self, horizon: int) -> np.ndarray:
        return np.full(horizon, 0.0 if math.isnan(self.value) else self.value)


class EWMA:
    name = "ewma"

    def __init__(self, window_s: float, halflife_s: float = 1800.0) -> None:
        self.window_s = window_s
        # at least one window of memory; with hourly windows this is ~0.5 per update
        self.alpha = 1.0 - 0.5 ** (window_s / max(halflife_s, window_s))
        self.level = math.nan

    def update(self, t_start_s: float, rate: float) -> None:
        if math.isnan(rate):
            return
        self.level = rate if math.isnan(self.level) else self.level + self.alpha * (rate - self.level)

    def predict(self, horizon: int) -> np.ndarray:
        return np.full(horizon, 0.0 if math.isnan(self.level) else self.level)


def _slots_per_day(window_s: float) -> int | None:
    k = DAY_S / window_s
    return int(round(k)) if abs(k - round(k)) < 1e-6 and round(k) >= 2 else None


class Seasonal:
    """rate(t) ~ level * dow[day(t)] * profile[slot(t)]."""

    name = "seasonal"

    def __init__(self, window_s: float, day_gain: float = 0.35, level_gain: float = 0.15,
                 level_decay_s: float = 3 * 3600.0) -> None:
        self.window_s = window_s
        self.m = _slots_per_day(window_s)
        self.day_gain = day_gain  # weight of the newest day in the per-slot profile
        self.level_gain = level_gain
        self.level_decay = 0.5 ** (window_s / level_decay_s)
        self.profile = np.full(self.m or 1, np.nan)
        self.dow = np.ones(7)
        self.dow_sum = np.zeros(7)
        self.dow_n = np.zeros(7)
        self.ratio = 1.0  # recent actual / profile, decays toward 1 with the horizon
        self.last_t = math.nan
        self.fallback = EWMA(window_s)
        self.first_t = math.nan

    def _slot(self, t: float) -> int:
        return int(round((t % DAY_S) / self.window_s)) % (self.m or 1)

    def _dow(self, t: float) -> int:
        return int(t // DAY_S) % 7

    def update(self, t_start_s: float, rate: float) -> None:
        self.last_t = t_start_s
        if math.isnan(self.first_t):
            self.first_t = t_start_s
        self.fallback.update(t_start_s, rate)
        if self.m is None or math.isnan(rate):
            return
        s, d = self._slot(t_start_s), self._dow(t_start_s)
        weeks = (t_start_s - self.first_t) >= WEEK_S
        dowf = self.dow[d] if weeks else 1.0
        base = rate / dowf
        p = self.profile[s]
        if not math.isnan(p) and p > 0:
            self.ratio += self.level_gain * (rate / (p * dowf) - self.ratio)
            self.profile[s] = p + self.day_gain * (base / self.ratio - p) if self.ratio > 0 else p
        else:
            self.profile[s] = base
        # day-of-week factor: daily mean of that weekday over the mean of all days
        self.dow_sum[d] += rate
        self.dow_n[d] += 1
        if weeks and np.all(self.dow_n > 0):
            means = self.dow_sum / self.dow_n
            self.dow = np.clip(means / means.mean(), 0.3, 3.0)

    def ready(self) -> bool:
        return self.m is not None and not np.any(np.isnan(self.profile))

    def predict(self, horizon: int) -> np.ndarray:
        if not self.ready():
            return self.fallback.predict(horizon)
        ts = self.last_t + self.window_s * np.arange(1, horizon + 1)
        slots = np.round((ts % DAY_S) / self.window_s).astype(int) % self.m  # type: ignore[operator]
        weeks = (self.last_t - self.first_t) >= WEEK_S
        dowf = self.dow[(ts // DAY_S).astype(int) % 7] if weeks else 1.0
        corr = 1.0 + (self.ratio - 1.0) * self.level_decay ** np.arange(1, horizon + 1)
        return np.maximum(self.profile[slots] * dowf * corr, 0.0)


class HoltWinters:
    """Additive damped-trend Holt-Winters on y = log(1 + rate), daily season."""

    name = "holt_winters"

    def __init__(self, window_s: float, alpha: float = 0.25, beta: float = 0.02, gamma: float = 0.3,
                 phi: float = 0.9) -> None:
        self.window_s = window_s
        self.m = _slots_per_day(window_s)
        self.alpha, self.beta, self.gamma, self.phi = alpha, beta, gamma, phi
        self.level = math.nan
        self.trend = 0.0
        self.season = np.zeros(self.m or 1)
        self.ready = False  # seasonal indices initialised from the first full day
        self._first_day: list[tuple[int, float]] = []
        self.last_t = math.nan

    def _slot(self, t: float) -> int:
        return int(round((t % DAY_S) / self.window_s)) % (self.m or 1)

    def update(self, t_start_s: float, rate: float) -> None:
        self.last_t = t_start_s
        if math.isnan(rate):
            # missing window: the level carries its trend forward
            if not math.isnan(self.level):
                self.level += self.phi * self.trend
                self.trend *= self.phi
            return
        y = math.log1p(max(rate, 0.0))
        if math.isnan(self.level):
            self.level = y
        s = self._slot(t_start_s) if self.m else 0
        if self.m and not self.ready:
            # first day: plain damped Holt, while collecting the day for the seasonal start
            self._first_day.append((s, y))
            self._holt(y, 0.0)
            if len({k for k, _ in self._first_day}) == self.m:
                vals = np.array([v for _, v in self._first_day])
                mean = float(vals[-self.m:].mean())
                for k, v in self._first_day[-self.m:]:
                    self.season[k] = v - mean
                self.level, self.trend, self.ready = mean, 0.0, True
            return
        seas = self.season[s] if self.m else 0.0
        self._holt(y, seas)
        if self.m:
            self.season[s] = self.gamma * (y - self.level) + (1 - self.gamma) * seas

    def _holt(self, y: float, seas: float) -> None:
        prev = self.level
        self.level = self.alpha * (y - seas) + (1 - self.alpha) * (prev + self.phi * self.trend)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.phi * self.trend

    def predict(self, horizon: int) -> np.ndarray:
        if math.isnan(self.level):
            return np.zeros(horizon)
        h = np.arange(1, horizon + 1)
        damp = np.cumsum(self.phi ** h)
        y = self.level + damp * self.trend
        if self.m and self.ready:
            ts = self.last_t + self.window_s * h
            slots = np.round((ts % DAY_S) / self.window_s).astype(int) % self.m
            y = y + self.season[slots]
        return np.maximum(np.expm1(y), 0.0)


def _nanquantile_cols(a: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Per-column quantiles ignoring NaN (linear interpolation), fast: one sort."""
    srt = np.sort(a, axis=0)  # NaN sort last
    cnt = np.sum(~np.isnan(a), axis=0)
    out = np.empty((len(qs), a.shape[1]))
    cols = np.arange(a.shape[1])
    for i, q in enumerate(qs):
        pos = q * (cnt - 1)
        lo = np.floor(pos).astype(int)
        hi = np.minimum(lo + 1, cnt - 1)
        w = pos - lo
        out[i] = srt[lo, cols] * (1 - w) + srt[hi, cols] * w
    return out


def default_forecasters(window_s: float) -> list[Forecaster]:
    return [LastValue(window_s), EWMA(window_s), Seasonal(window_s), HoltWinters(window_s)]


@dataclass(frozen=True)
class Forecast:
    """Rates (req/s) for the ``len(mean)`` windows after the last one seen, and scenarios:
    ``scenarios[k, h]`` with weights ``weights[k]`` (sum 1) spanning the recent error spread."""

    forecaster: str
    window_s: float
    mean: np.ndarray
    scenarios: np.ndarray
    weights: np.ndarray
    backtest_error: float  # chosen forecaster's rolling MAE / mean over the horizon

    @property
    def lower(self) -> np.ndarray:
        return self.scenarios.min(axis=0)

    @property
    def upper(self) -> np.ndarray:
        return self.scenarios.max(axis=0)


class Chooser:
    """Runs several forecasters, scores them by rolling backtest, forecasts with the best.

    For every forecaster and every horizon h = 1..H it compares the prediction made h windows
    ago with the rate that arrived, keeping exponentially weighted |error| and actual sums
    (``memory`` windows). The choice minimises mean(|err|)/mean(actual) averaged over h = 1..H
    (H = the decision horizon). Scenarios: quantiles of the recent log-ratios actual/predicted of
    the chosen forecaster at each horizon (at least ``min_spread`` either side); with fewer than
    10 errors at a horizon, a log-normal prior of width ``prior_sigma``.
    """

    QUANTILES = tuple(float(q) for q in np.linspace(0.02, 0.98, 25))

    def __init__(self, window_s: float, horizon: int, forecasters: Sequence[Forecaster] | None = None,
                 memory: int = 144, residuals: int = 288, min_spread: float = 0.05,
                 prior_sigma: float = 0.5, warmup: int = 2) -> None:
        if horizon < 1:
            raise ValueError("horizon must be at least one window")
        self.window_s = window_s
        self.H = horizon
        self.forecasters = list(forecasters) if forecasters is not None else default_forecasters(window_s)
        F = len(self.forecasters)
        self.decay = 1.0 - 1.0 / memory
        self.preds = np.full((F, horizon, horizon), np.nan)  # [f, ring slot, h-1]
        self.err = np.zeros((F, horizon))
        self.act = np.zeros((F, horizon))
        self.logres = np.full((F, residuals, horizon), np.nan)  # ring of log(actual/pred)
        self.n = 0  # windows seen
        self.min_spread = min_spread
        self.prior_sigma = prior_sigma
        self.warmup = warmup  # predictions made from fewer windows than this are not scored
        self.chosen = 0

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.forecasters]

    def update(self, t_start_s: float, rate: float) -> None:
        n, H = self.n, self.H
        if not math.isnan(rate):
            hs = np.arange(1, H + 1)
            made = n - hs  # window index at which each prediction was made
            ok = made >= self.warmup
            slots = np.where(ok, made % H, 0)
            p = self.preds[:, slots, hs - 1]  # [F, H]
            valid = ok[None, :] & ~np.isnan(p)
            e = np.where(valid, np.abs(p - rate), 0.0)
            self.err = np.where(valid, self.err * self.decay + e, self.err)
            self.act = np.where(valid, self.act * self.decay + rate, self.act)
            with np.errstate(divide="ignore", invalid="ignore"):
                lr = np.where(valid & (p > 0) & (rate > 0), np.log(rate / np.maximum(p, 1e-12)), np.nan)
            self.logres[:, n % self.logres.shape[1], :] = lr
        for f in self.forecasters:
            f.update(t_start_s, rate)
        self.n += 1
        for i, f in enumerate(self.forecasters):
            self.preds[i, (self.n - 1) % H, :] = f.predict(H)
        self.chosen = int(np.argmin(self.scores()))

    def scores(self) -> np.ndarray:
        """Rolling relative MAE per forecaster, averaged over horizons 1..H (NaN-free)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(self.act > 0, self.err / self.act, np.nan)
        out = np.nanmean(np.where(np.isnan(rel), np.nan, rel), axis=1) if np.any(~np.isnan(rel)) else None
        if out is None:
            return np.arange(len(self.forecasters), dtype=float)  # no evidence yet: list order
        return np.where(np.isnan(out), np.inf, out)

    def predict(self, horizon: int | None = None) -> np.ndarray:
        return self.forecasters[self.chosen].predict(horizon or self.H)

    def forecast(self, horizon: int | None = None) -> Forecast:
        H = horizon or self.H
        mean = self.predict(H)
        lr = self.logres[self.chosen]  # [N, H]
        qs = np.full((len(self.QUANTILES), self.H), np.nan)
        have = np.sum(~np.isnan(lr), axis=0) >= 10
        if np.any(have):
            qs[:, have] = _nanquantile_cols(lr[:, have], self.QUANTILES)
        # horizons without enough evidence borrow the nearest shorter horizon that has it
        z = np.array([NormalDist().inv_cdf(q) for q in self.QUANTILES])
        for h in range(self.H):
            if not have[h]:
                prev = [j for j in range(h) if have[j]]
                # no evidence yet: a wide uninformed prior, log-normal with sigma prior_sigma
                qs[:, h] = qs[:, prev[-1]] if prev else z * self.prior_sigma
        mid = len(self.QUANTILES) // 2
        med = qs[mid:mid + 1, :]  # keeps the median (bias) and widens the spread to at least min_spread
        qs = med + np.sign(z)[:, None] * np.maximum(np.abs(qs - med), np.abs(z)[:, None] * self.min_spread)
        if H > self.H:  # beyond the tracked horizon: keep the last spread
            qs = np.concatenate([qs, np.repeat(qs[:, -1:], H - self.H, axis=1)], axis=1)
        scen = mean[None, :] * np.exp(qs[:, :H])
        s = self.scores()
        err = float(s[self.chosen]) if np.isfinite(s[self.chosen]) else math.nan
        return Forecast(self.forecasters[self.chosen].name, self.window_s, mean, scen,
                        np.full(len(self.QUANTILES), 1.0 / len(self.QUANTILES)), err)
