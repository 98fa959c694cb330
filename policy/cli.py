"""``remp policy …`` commands (I/O edge: reads the trace and profile, prints the result).

    python -m policy.cli evaluate --trace FILE [--format F] [--window-s S] --profile P
        [--peak-utilization 0.9] [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--json]

With ``--json`` the last stdout line is one JSON object with exactly the keys goodput,
slo_attainment, switches_per_day, forecast_error, auto_vs_oracle. Errors: one line
``remp: error: …`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from policy.decide import PolicyConfig
from policy.evaluate import run_evaluation
from policy.profiles import SLO, BUILTIN_PROFILES, load_profile
from policy.traces import FORMATS, read_trace


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remp policy", description="traffic forecasting and topology policy")
    sub = p.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("evaluate", help="replay a trace: auto policy vs fixed, reactive, schedule, oracle")
    ev.add_argument("--trace", required=True, help="trace file")
    ev.add_argument("--format", default="auto", choices=FORMATS, help="trace format (default: detect)")
    ev.add_argument("--window-s", type=float, default=None,
                    help="window length (per-request traces: default 60; windowed: re-bin)")
    ev.add_argument("--profile", required=True,
                    help=f"built-in ({', '.join(BUILTIN_PROFILES)}) or a measured profile JSON file")
    ev.add_argument("--peak-utilization", type=float, default=0.9,
                    help="scale the trace so its peak window offers this fraction of the best capacity")
    ev.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT target (default: the profile's)")
    ev.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT target (default: the profile's)")
    ev.add_argument("--min-dwell-s", type=float, default=PolicyConfig.min_dwell_s)
    ev.add_argument("--max-switches-per-day", type=int, default=PolicyConfig.max_switches_per_day)
    ev.add_argument("--horizon-s", type=float, default=PolicyConfig.horizon_s)
    ev.add_argument("--json", action="store_true", help="last line: one JSON object")
    return p


def _table(ev) -> str:  # noqa: ANN001 - Evaluation
    r = ev.result()
    oracle = r["goodput"]["oracle"] or 1.0
    lines = [f"trace {ev.trace}: {ev.windows} windows of {ev.window_s:g} s ({ev.days:.2f} days), "
             f"rates x{ev.scale:.4g}; profile {ev.profile}; SLO TTFT {ev.slo.ttft_s * 1e3:g} ms, "
             f"TPOT {ev.slo.tpot_s * 1e3:g} ms",
             f"{'policy':16s} {'goodput req/s':>14s} {'vs oracle':>10s} {'SLO att.':>9s} {'switches/day':>13s}"]
    for name in r["goodput"]:
        lines.append(f"{name:16s} {r['goodput'][name]:14.4f} {r['goodput'][name] / oracle:10.3f} "
                     f"{r['slo_attainment'][name]:9.3f} {r['switches_per_day'][name]:13.2f}")
    lines.append("forecast error (MAE/mean): " + ", ".join(
        f"{k} {v['1_window']}/{v['1_hour']}" for k, v in r["forecast_error"].items()) + "  [1 window / 1 h]")
    lines.append(f"auto_vs_oracle {r['auto_vs_oracle']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        series = read_trace(args.trace, args.format, args.window_s)
        profile = load_profile(args.profile)
        d = profile.default_slo
        slo = SLO(args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else d.ttft_s,
                  args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else d.tpot_s)
        cfg = PolicyConfig(horizon_s=args.horizon_s, min_dwell_s=args.min_dwell_s,
                           max_switches_per_day=args.max_switches_per_day)
        ev = run_evaluation(series, profile, args.peak_utilization, slo, cfg)
    except (ValueError, OSError) as e:
        print(f"remp: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(ev.result(), sort_keys=False))
    else:
        print(_table(ev))
    return 0


if __name__ == "__main__":
    sys.exit(main())
