"""What the TTFT calibration reads on a host exactly as modelled (issue 16).

    .venv/bin/python bench/policy_ttft_mean_check.py [--out bench/results/NAME.md]

The agent reports each window's *mean* TTFT; a profile holds TTFT p50 and p90. The calibration
(``policy.calibrate``) compares the observed mean with the mean of a lognormal through the
profile's p50 and p90 (``mean_ttft``). The modelled profiles' TTFT is not lognormal: it is a
lognormal prompt's chunked prefill plus half a round plus an M/M/c wait (``policy/perfmodel.py``;
M/M/1 before 2026-12-07),
and their p50 / p90 are sums of per-part quantiles. This bench computes the model's own mean TTFT
(the prefill averaged over the prompt-length distribution by 24-point Gauss-Hermite quadrature,
+ R / 2, + the M/M/c mean wait C(c, rho) / (capacity - rate), C the Erlang C probability) for every topology of the built-in
modelled profiles at 10-90 % of its capacity, and the TTFT slowdown the calibration would imply
from it (the observed mean over ``mean_ttft``, as ``implied_ttft_slowdown`` reads it where the
TTFT is not steep in the load; the table says on how many topologies it is read): 1 means no
bias; above 1 a host exactly as modelled reads as slower (more GPUs than needed), below 1 the floor hides that much TTFT optimism. ~5 s.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.policy_model_error import write_results  # noqa: E402
from policy.calibrate import implied_ttft_slowdown, mean_ttft  # noqa: E402
from policy.perfmodel import GPUS, MODELS, PerfModel, attention_source  # noqa: E402
from policy.profiles import load_profile  # noqa: E402

SHARES = (0.1, 0.3, 0.5, 0.7, 0.9)


def model_mean_ttft_s(pm: PerfModel, topo, rate: float) -> float | None:
    """The model's mean TTFT at ``rate`` (s): prefill over lognormal prompts + R/2 + M/M/c wait."""
    R = pm.steady_round_ms(topo, rate)
    if R is None:
        return None
    x, w = np.polynomial.hermite_e.hermegauss(24)
    w = w / w.sum()
    I, sig = pm.req.input_tokens, pm.req.prompt_sigma
    pre = sum(float(wi) * pm.prefill_ms(topo, rate, I * math.exp(sig * float(xi)), R)
              for xi, wi in zip(x, w))
    return (pre + R / 2) / 1e3 + pm.mean_queue_wait_s(topo, rate)


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    t0, runs = time.time(), []
    lines = ["# The TTFT calibration on a host exactly as modelled", "",
             "Implied TTFT slowdown (1: unbiased) from the model's own mean TTFT, per built-in modelled "
             "profile and load share, over its topologies: median [min, max]; (k/n read): on how "
             "many topologies the calibration reads it (since stop 46 not where the profile's mean "
             "TTFT is steep in the load, policy.calibrate.STEEP_MAX).", "",
             "| profile | " + " | ".join(f"{int(100 * s)} % load" for s in SHARES) + " | all |",
             "|---|" + "---|" * (len(SHARES) + 1)]
    for gpu in ("h100", "h200"):
        for model in ("llama2-7b", "llama2-70b"):
            prof = load_profile(f"{gpu}x8-{model}")
            pm = PerfModel(MODELS[model], GPUS[gpu], attention_source(GPUS[gpu], None))
            for c in prof.curves:
                for share in SHARES:
                    rate = share * pm.capacity_rps(c.topology)
                    true = model_mean_ttft_s(pm, c.topology, rate)
                    if true is None:
                        continue
                    runs.append(dict(profile=prof.name, topology=str(c.topology), share=share,
                                     model_mean_ttft_s=round(true, 6),
                                     lognormal_mean_ttft_s=round(mean_ttft(c, rate), 6),
                                     # the factor the window implies, and whether the
                                     # calibration reads it (not where the TTFT is steep)
                                     implied=round(true / mean_ttft(c, rate), 4),
                                     read=bool(math.isfinite(
                                         implied_ttft_slowdown(c, rate, true)))))
            cells = []
            for share in (*SHARES, None):
                rs = [r for r in runs if r["profile"] == prof.name
                      and (share is None or r["share"] == share)]
                v = np.array([r["implied"] for r in rs])
                cells.append(f"{np.median(v):.3f} [{v.min():.3f}, {v.max():.3f}] "
                             f"({sum(r['read'] for r in rs)}/{len(rs)} read)")
            lines.append(f"| {prof.name} | " + " | ".join(cells) + " |")
    write_results(a.out, "\n".join(lines) + "\n", t0, runs=runs)


if __name__ == "__main__":
    main()
