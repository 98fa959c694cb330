"""``remp policy …`` commands (I/O edge).

    remp policy evaluate --trace FILE [--format F] [--window-s S] --profile P
        [--peak-utilization 0.9] [--slo-ttft-ms MS] [--slo-tpot-ms MS] [--json]
    remp policy serve --controller HOST:PORT [--profile P] [--mode advisory|auto|off] ...
        (every option also as REMP_POLICY_<NAME>, e.g. REMP_POLICY_TICK_SECONDS)
    remp policy profile --agent HOST:PORT [--http URL] --out FILE.json [--name N] ...

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
    _serve_parser(sub)
    _profile_parser(sub)
    _mode_parser(sub)
    return p


def _mode_parser(sub) -> None:
    md = sub.add_parser("mode", help="set the running policy service's mode (SetMode)",
                        description="Set the mode of every node, or of one with --node: auto "
                        "(switches), advisory (recommends), off (decides, calls nothing).")
    md.add_argument("mode", choices=["auto", "advisory", "off"])
    md.add_argument("--node", default="", help="one node (default: every node)")
    md.add_argument("--policy", default=None, help="policy service host:port (default "
                    "$REMP_POLICY_ADDRESS or 127.0.0.1:50071)")


def cmd_mode(args) -> int:
    import os

    import grpc

    from remp.policy.v1 import policy_pb2, policy_pb2_grpc

    addr = args.policy or os.environ.get("REMP_POLICY_ADDRESS", "127.0.0.1:50071")
    mode = {"auto": policy_pb2.MODE_AUTO, "advisory": policy_pb2.MODE_ADVISORY,
            "off": policy_pb2.MODE_OFF}[args.mode]
    try:
        with grpc.insecure_channel(addr) as ch:
            r = policy_pb2_grpc.PolicyStub(ch).SetMode(
                policy_pb2.SetModeRequest(mode=mode, node=args.node), timeout=10)
    except grpc.RpcError as exc:
        return _fail(f"policy {addr}: {exc.code().name}: {exc.details()}", 1)
    print(f"{args.node or 'every node'}: mode {policy_pb2.Mode.Name(r.mode)[5:].lower()}")
    return 0


def _serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="run the Policy gRPC service (forecast, decide, act by mode)",
                        description="Run the policy service. Every option can also be set as "
                                    "REMP_POLICY_<OPTION> (e.g. REMP_POLICY_CONTROLLER).")
    sv.add_argument("--host")
    sv.add_argument("--port", type=int)
    sv.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port "
                    "(0: a free one, logged; default: off)")
    sv.add_argument("--controller", help="controller host:port")
    sv.add_argument("--token", help="bearer token the controller requires")
    sv.add_argument("--controller-timeout-s", type=float)
    sv.add_argument("--redis-url", help="keep decisions and modes in Redis (unset: in memory)")
    sv.add_argument("--redis-prefix")
    sv.add_argument("--profile", help=f"built-in ({', '.join(BUILTIN_PROFILES)}) or a measured "
                    "profile JSON file")
    sv.add_argument("--slo-ttft-ms", type=float)
    sv.add_argument("--slo-tpot-ms", type=float)
    sv.add_argument("--mode", help="initial mode: auto | advisory (default) | off")
    sv.add_argument("--tick-seconds", type=float)
    sv.add_argument("--window-seconds", type=float)
    sv.add_argument("--horizon-seconds", type=float)
    sv.add_argument("--min-dwell-seconds", type=float)
    sv.add_argument("--max-switches-per-day", type=int)
    sv.add_argument("--hysteresis", type=float)
    sv.add_argument("--dwell-override", type=float)
    sv.add_argument("--retry-backoff-seconds", type=float)
    sv.add_argument("--max-decisions", type=int)


def _profile_parser(sub) -> None:
    pr = sub.add_parser("profile", help="measure a per-topology profile on a live node agent",
                        description="Switch a node agent through each candidate topology and "
                        "measure TTFT, TPOT and throughput over a sweep of offered load; write a "
                        "measured profile JSON. Use an agent no controller is switching.")
    pr.add_argument("--agent", required=True, help="node agent gRPC host:port")
    pr.add_argument("--http", help="OpenAI API base URL (default: what the agent reports)")
    pr.add_argument("--out", required=True, help="profile JSON file to write")
    pr.add_argument("--name", help="profile name (default: the file name)")
    pr.add_argument("--topologies", help="comma-separated, e.g. TP2PP1,TP1PP2 (default: every "
                    "candidate with the current world size)")
    pr.add_argument("--fractions", default="0.1,0.3,0.5,0.7,0.85",
                    help="offered load points as fractions of the measured capacity")
    pr.add_argument("--point-seconds", type=float, default=8.0)
    pr.add_argument("--warmup-seconds", type=float, default=1.5)
    pr.add_argument("--capacity-seconds", type=float, default=6.0)
    pr.add_argument("--concurrency", type=int, default=8,
                    help="closed-loop clients for the capacity measurement")
    pr.add_argument("--input-words", type=int, default=24)
    pr.add_argument("--output-tokens", type=int, default=16)
    pr.add_argument("--model", default="tiny", help="served model name")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--slo-ttft-ms", type=float, help="default SLO stored in the profile "
                    "(default: 3x the best lowest-load p90)")
    pr.add_argument("--slo-tpot-ms", type=float)


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


def _fail(message: str, code: int = 2) -> int:
    print(f"remp: error: {message}", file=sys.stderr)
    return code


def cmd_serve(args) -> int:
    import asyncio

    from pydantic import ValidationError

    from policy.config import PolicySettings
    from remp import logs
    from remp.errors import ConfigError

    fields = {k.replace("-", "_"): v for k, v in vars(args).items()
              if v is not None and k != "command"}
    try:
        settings = PolicySettings(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err["loc"]) or "settings"
        return _fail(f"invalid setting {where}: {err['msg']}")
    try:
        logs.configure(node="policy")
    except ValueError as exc:
        return _fail(str(exc))
    from policy import server

    try:
        return asyncio.run(server.serve(settings))
    except ConfigError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(str(exc), 1)


def cmd_profile(args) -> int:
    import asyncio
    from pathlib import Path

    from policy.profiler import SweepConfig, dumps, profile_agent
    from remp import logs
    from remp.errors import RempError
    from remp.topology import Topology

    try:
        cfg = SweepConfig(fractions=tuple(float(x) for x in args.fractions.split(",") if x.strip()),
                          point_s=args.point_seconds, warmup_s=args.warmup_seconds,
                          capacity_s=args.capacity_seconds, concurrency=args.concurrency,
                          input_words=args.input_words, output_tokens=args.output_tokens,
                          seed=args.seed, model=args.model)
        topos = ([Topology.parse(t) for t in args.topologies.split(",") if t.strip()]
                 if args.topologies else None)
        slo = None
        if args.slo_ttft_ms or args.slo_tpot_ms:
            if not (args.slo_ttft_ms and args.slo_tpot_ms):
                raise ValueError("give both --slo-ttft-ms and --slo-tpot-ms, or neither")
            slo = SLO(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    except ValueError as exc:
        return _fail(str(exc))
    out = Path(args.out)
    logs.configure(node="profile")
    try:
        prof = asyncio.run(profile_agent(args.agent, args.http, cfg, args.name or out.stem,
                                         topos, slo))
    except (RempError, ValueError, OSError) as exc:
        return _fail(str(exc), 1)
    out.write_text(dumps(prof))
    for c in prof.curves:
        print(f"{c.topology}: capacity {c.capacity_rps:.3g} req/s; TTFT p50 "
              f"{c.ttft_p50_s[0] * 1e3:.1f}..{c.ttft_p50_s[-1] * 1e3:.1f} ms, TPOT p50 "
              f"{c.tpot_p50_s[0] * 1e3:.2f}..{c.tpot_p50_s[-1] * 1e3:.2f} ms over "
              f"{c.load_rps[0]:.3g}..{c.load_rps[-1]:.3g} req/s")
    print(f"switch downtime {prof.switch_downtime_s:.3f} s; default SLO TTFT "
          f"{prof.default_slo.ttft_s * 1e3:.0f} ms, TPOT {prof.default_slo.tpot_s * 1e3:.1f} ms; "
          f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "profile":
        return cmd_profile(args)
    if args.command == "mode":
        return cmd_mode(args)
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
