"""Synthetic policy profiles for the tests (not measured): one GPU (TP1PP1, SLO capacity ≈1.5
req/s) or two (TP2PP1 ≈3, TP1PP2 ≈3.3, the whole host's best)."""

from policy.profiles import Profile

LOAD_FRACTIONS = (0, 0.5, 0.8, 0.95)  # of capacity, per point
TTFT_MS = ((20, 30), (25, 40), (40, 70), (150, 400))  # (p50, p90) at those loads


def two_gpu_profile(name: str, tpot_p50_ms=(10, 10, 10, 10)) -> Profile:
    """``tpot_p50_ms`` per load point (p90 = 1.2 × p50)."""
    def pts(cap):
        return [{"load_rps": f * cap, "ttft_p50_ms": t50, "ttft_p90_ms": t90, "tpot_p50_ms": d,
                 "tpot_p90_ms": d * 1.2}
                for f, (t50, t90), d in zip(LOAD_FRACTIONS, TTFT_MS, tpot_p50_ms)]
    return Profile.from_json({
        "name": name, "kind": "synthetic",
        "request": {"input_tokens": 24, "output_tokens": 8}, "switch_downtime_s": 0.5,
        "default_slo": {"ttft_ms": 100, "tpot_ms": 100},
        "topologies": {"TP1PP1": {"capacity_rps": 2.0, "points": pts(2.0)},
                       "TP2PP1": {"capacity_rps": 4.0, "points": pts(4.0)},
                       "TP1PP2": {"capacity_rps": 4.5, "points": pts(4.5)}}})
