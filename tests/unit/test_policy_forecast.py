"""Forecasters on synthetic series with known answers."""

import math

import numpy as np
import pytest

from policy.forecast import EWMA, Chooser, HoltWinters, LastValue, Seasonal, fit

W = 600.0
DAY = 144  # windows per day


def sine(days: int, noise: float = 0.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(0, days * 86400, W)
    r = 100 + 50 * np.sin(2 * np.pi * t / 86400)
    if noise:
        r = r * (1 + noise * np.random.default_rng(seed).standard_normal(len(t)))
    return t, r


@pytest.mark.parametrize("cls", [Seasonal, HoltWinters])
def test_pure_daily_sine_is_learned_for_a_whole_day_ahead(cls):
    t, r = sine(4)
    f = fit(cls(W), t[: 3 * DAY], r[: 3 * DAY])
    pred = f.predict(DAY)
    assert np.max(np.abs(pred - r[3 * DAY:])) / 100 < 0.01


@pytest.mark.parametrize("cls", [Seasonal, HoltWinters])
def test_noisy_sine_is_learned_within_the_noise(cls):
    t, r = sine(6, noise=0.05)
    t_clean, clean = sine(6)
    f = fit(cls(W), t[: 5 * DAY], r[: 5 * DAY])
    mae = np.mean(np.abs(f.predict(DAY) - clean[5 * DAY:])) / 100
    assert mae < 0.05


def test_flat_forecasters_and_missing_windows():
    lv, ew = LastValue(W), EWMA(W)
    for f in (lv, ew):
        fit(f, [0, 600, 1200], [10.0, 20.0, math.nan])
    assert list(lv.predict(3)) == [20.0] * 3
    assert 10.0 < ew.predict(1)[0] < 20.0


def test_seasonal_learns_day_of_week_after_a_week():
    t = np.arange(0, 21 * 86400, W)
    weekend = ((t // 86400) % 7) >= 5
    r = np.where(weekend, 50.0, 100.0)
    f = fit(Seasonal(W), t[: 14 * DAY], r[: 14 * DAY])
    pred = f.predict(7 * DAY)
    wk = weekend[14 * DAY: 21 * DAY]
    assert pred[wk].mean() / pred[~wk].mean() < 0.65  # truth 0.5; without the factor it is 1
    assert np.mean(np.abs(pred - r[14 * DAY: 21 * DAY])) / 100 < 0.15  # week 1 profile predates the factor


def test_chooser_picks_a_seasonal_model_on_a_sine_and_reports_its_error():
    t, r = sine(4, noise=0.02)
    c = Chooser(W, horizon=18)
    for a, b in zip(t, r):
        c.update(a, b)
    fc = c.forecast()
    assert fc.forecaster in ("seasonal", "holt_winters")
    assert fc.backtest_error < 0.05
    assert fc.scenarios.shape == (len(Chooser.QUANTILES), 18)
    assert np.all(fc.lower <= fc.mean + 1e-9) and np.all(fc.upper >= fc.mean - 1e-9)


def test_chooser_picks_last_value_on_a_random_walk():
    rng = np.random.default_rng(3)
    r = 100 * np.exp(np.cumsum(0.05 * rng.standard_normal(600)))
    c = Chooser(W, horizon=3)
    for i, x in enumerate(r):
        c.update(i * W, x)
    assert c.forecast().forecaster in ("last", "ewma")


def test_the_chooser_does_not_score_forecasts_made_before_it_was_warm():
    """A trace's first window is often partial (a tenth of the next one's rate). A forecast made
    from it alone is an artefact of the start, not an error the spread should keep: scenarios
    from such residuals put a 10x burst in every later window's tail (an hour of 60-s windows
    never ages it out). The chooser scores only predictions made from 3 windows or more."""
    r = np.concatenate([[3.0], 30.0 * np.exp(0.05 * np.random.default_rng(1).standard_normal(30))])

    def top(c: Chooser) -> float:
        for i, x in enumerate(r):
            c.update(i * 60.0, float(x))
        fc = c.forecast()
        return float(fc.scenarios[:, 0].max() / fc.mean[0])

    assert Chooser(60.0, horizon=3).warmup == 2
    assert top(Chooser(60.0, horizon=3)) < 1.5
    assert top(Chooser(60.0, horizon=3, warmup=0)) > 2.5
