"""Batch-job bursts on a quiet interactive service: what the burst memory buys (issue 16).

    .venv/bin/python bench/policy_burst_synthetic.py [--gpu h100|h200] [--out bench/results/NAME.md]

A synthetic 61-day hourly trace, the shape of public hourly aggregates of a chat service that
also takes API batch jobs (columns ``conversation`` / ``all``): a diurnal conversation series
(Poisson, mean 200 x (0.1 + exp(-((h - 14) / 4)^2)) requests an hour, halved on 2 days of 7)
plus, at 10 % of the hours (seed 1), a burst of Poisson(2000) requests. Both series are replayed
(7B and 70B, K = 0.9) with the burst memory off (``burst_span_s`` 0, the seventh round), 1 day
and 2 days (the default), for both objectives: worst day, GPU-hour fraction, and the days below
99 % after the first burst's day. ~1 min.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.policy_model_error import grid_args, write_results  # noqa: E402
from policy.profiles import load_profile  # noqa: E402
from policy.savings import run_savings, worst_day  # noqa: E402
from policy.scale import ScaleConfig  # noqa: E402
from policy.traces import WindowSeries  # noqa: E402

DAYS = 61
SPANS = (0.0, 86400.0, 2 * 86400.0)


def synthetic(days: int = DAYS, seed: int = 1) -> dict[str, WindowSeries]:
    """The two hourly series: ``conversation`` alone and ``all`` (with the bursts)."""
    rng = np.random.default_rng(seed)
    conv, burst = [], []
    for d in range(days):
        week = 0.5 if d % 7 in (3, 4) else 1.0
        for h in range(24):
            conv.append(rng.poisson(week * 200 * (0.1 + np.exp(-((h - 14) / 4) ** 2))))
            burst.append(rng.poisson(2000) if rng.random() < 0.1 else 0)
    c, b = np.array(conv, dtype=float), np.array(burst, dtype=float)
    t = 3600.0 * np.arange(len(c))
    none = np.zeros(len(c), dtype=bool)
    return {"conversation": WindowSeries("synthetic_hourly-conversation", 3600.0, t, c, none),
            "all": WindowSeries("synthetic_hourly-all", 3600.0, t, c + b, none.copy())}


def replay(s: WindowSeries, model: str, gpu: str, objective: str, span: float, K: float = 0.9) -> dict:
    cfg = replace(ScaleConfig(objective=objective), burst_span_s=span)
    ev = run_savings(s, load_profile(f"{gpu}x8-{model}"), objective, K, config=cfg,
                     policies=("fixed-best", "reactive", "auto"))
    r = ev.result()
    att = ev.attainment_by_day("auto")
    first = int(np.argmax(s.requests > 1000)) // 24 if np.any(s.requests > 1000) else len(att)
    return dict(trace=s.name, model=model, objective=objective, burst_span_h=span / 3600,
                auto_worst_day=round(worst_day(att), 4),
                auto_days_below_after_first_burst=int(np.sum(att[first + 1:] < 0.99)),
                auto_gpu_hours_fraction=round(float(r["gpu_hours_fraction"]["auto"]), 3),
                reactive_worst_day=round(float(r["relative_attainment_min_day"]["reactive"]), 4),
                auto_tpot_ms=round(float(r["mean_tpot_ms"]["auto"]), 1),
                fixed_best_tpot_ms=round(float(r["mean_tpot_ms"]["fixed-best"]), 1))


def main() -> None:
    a = grid_args(__doc__, "h100")
    t0, runs = time.time(), []
    for col, s in synthetic().items():
        for model in ("llama2-7b", "llama2-70b"):
            for objective in ("gpu-hours", "latency"):
                for span in SPANS:
                    runs.append(replay(s, model, a.gpu, objective, span))
    lines = [f"# Batch-job bursts on a quiet service ({a.gpu}x8 profiles, K = 0.9, {DAYS} hourly days)", "",
             "| series | model | objective | burst memory (h) | auto worst day | days < 99 % after the first "
             "burst's | auto GPU-h | auto TPOT ms (fixed-best) | reactive worst day |",
             "|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in runs:
        lines.append(f"| {r['trace']} | {r['model']} | {r['objective']} | {r['burst_span_h']:g} | "
                     f"{r['auto_worst_day']:.4f} | {r['auto_days_below_after_first_burst']} | "
                     f"{r['auto_gpu_hours_fraction']:.3f} | {r['auto_tpot_ms']} ({r['fixed_best_tpot_ms']}) | "
                     f"{r['reactive_worst_day']:.4f} |")
    write_results(a.out, "\n".join(lines) + "\n", t0, runs=runs)


if __name__ == "__main__":
    main()
