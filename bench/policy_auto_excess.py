"""Where auto's GPU-hours go beyond the oracle's, by the reason of auto's decision (issue 16)

    .venv/bin/python bench/policy_auto_excess.py [--gpu h100|h200] [--out bench/results/NAME.md]

Every grid run (every trace in ../shared/traces x {7B, 70B} x K in {0.6, 0.9, 1.2}, auto with its
defaults, the profile taken as right). Per observed window: the GPUs auto holds minus the GPUs
the issue's per-window oracle holds, as a share of the run's whole-host GPU-hours, filed under
the reason of auto's decision for that window (``ScaleDecision.reason``: ``stay`` — auto already
holds the fewest GPUs its loss budget and its bet on the day's SLO error budget allow;
``hold-budget`` — a scale-down held to keep switches for scale-ups; ``hold-pace``,
``hold-warmup``, ``hold-dwell``, ``hold-saving``; ``scale-down`` / ``scale-up`` — the window of a
switch; ``start`` — the first window, on the whole host). A run's entries sum to auto's GPU-hour fraction minus the oracle's (negative where
auto held fewer GPUs than the oracle in that window). It shows which rule the shortfall
against the oracle sits in: the sizing under an unknown next window, or the switch budget.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.policy_model_error import grid_args, write_results  # noqa: E402
from bench.policy_savings_table import TUNE, grid_cases  # noqa: E402
from policy.savings import run_savings  # noqa: E402


def excess_by_reason(ev) -> dict[str, float]:
    """Auto's GPUs beyond the oracle's, per decision reason, as shares of the run's whole-host
    GPU-hours over its observed windows (``ev``: a ``run_savings`` result with auto and oracle)."""
    auto, orc = ev.runs["auto"], ev.runs["oracle"]
    seen = ~np.isnan(ev.rates)
    per_gpu = ev.window_s / ev.runs["fixed-best"].gpu_s  # a GPU for one window, as the fractions count it
    out: dict[str, float] = collections.defaultdict(float)
    # the first window has no decision (a node starts on the whole host); window w >= 1 holds
    # what decision w - 1 chose
    reasons = ["start"] + [d.reason for d in auto.decisions]
    for w, reason in enumerate(reasons):
        if seen[w]:
            out[reason] += (auto.topologies[w].world_size - orc.topologies[w].world_size) * per_gpu
    return dict(out)


def main() -> None:
    a = grid_args(__doc__, "h100")
    t0, runs = time.time(), []
    for series, model, K, prof in grid_cases(a.traces, a.gpu):
        ev = run_savings(series, prof, "gpu-hours", K, policies=("fixed-best", "auto", "oracle"))
        g = ev.result()["gpu_hours_fraction"]
        runs.append(dict(trace=series.name, set="tune" if series.name in TUNE else "held-out", model=model,
                         K=K, auto=g["auto"], oracle=g["oracle"], excess=excess_by_reason(ev)))
    total: dict[str, float] = collections.defaultdict(float)
    for r in runs:
        for k, v in r["excess"].items():
            total[k] += v
    reasons = sorted(total, key=lambda k: -total[k])
    gap = sum(r["auto"] - r["oracle"] for r in runs)
    lines = [f"# Auto's GPU-hours beyond the oracle's, by decision reason ({a.gpu}x8 profiles, {len(runs)} runs)",
             "", f"`python {' '.join(sys.argv)}`. Shares of each run's whole-host GPU-hours; the total row "
             f"sums them over the runs (auto − oracle summed: {gap:.2f}).", "",
             "| reason | summed over the runs | share of the gap |", "|---|---:|---:|"]
    lines += [f"| {k} | {total[k]:.2f} | {100 * total[k] / gap:.0f} % |" for k in reasons]
    lines += ["", "| trace | model | K | auto | oracle | " + " | ".join(reasons) + " |",
              "|---|---|---|---:|---:|" + "---:|" * len(reasons)]
    for r in runs:
        lines.append(f"| {r['trace']} | {r['model']} | {r['K']} | {r['auto']:.3f} | {r['oracle']:.3f} | "
                     + " | ".join(f"{r['excess'].get(k, 0.0):.3f}" for k in reasons) + " |")
    write_results(a.out, "\n".join(lines) + "\n", t0, runs=runs, total=dict(total))


if __name__ == "__main__":
    main()
