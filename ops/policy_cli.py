"""``remp policy …`` commands (I/O edge).

    remp policy evaluate --trace FILE [--format F] [--column C] [--window-s S] [--profile P]
        [--objective gpu-hours|latency|goodput] [--load-scale K] [--slo-ttft-ms MS]
        [--slo-tpot-ms MS] [--json] [--png FILE [--day N]]
    remp policy profiles
    remp policy serve --controller HOST:PORT [--profile P] [--mode advisory|auto|off]
        [--objective gpu-hours|latency|goodput] ...
        (every option also as REMP_POLICY_<NAME>, e.g. REMP_POLICY_TICK_SECONDS)
    remp policy profile --agent HOST:PORT [--http URL] --out FILE.json [--name N] ...

With ``--json`` the last stdout line is one JSON object. Objectives gpu-hours (default) and
latency (policy/savings.py): keys gpu_hours_fraction, relative_attainment_min_day,
switches_per_day (each a map by policy: fixed-best, fixed-cheapest, reactive, seasonal, auto,
oracle), captured_share, then relative_attainment_mean, mean_tpot_ms, mean_ttft_ms,
switches_max_day (the most switches in one day of the trace; switches_per_day is the mean) and
switches_max_24h (the most in any 24 h). Objective
goodput (the older SLO-goodput replay, policy/evaluate.py): exactly goodput, slo_attainment,
switches_per_day, forecast_error, auto_vs_oracle. Errors: one line
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
from remp.cliargs import invalid_setting


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="remp policy", description="traffic forecasting and topology policy")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("profiles", help="list the built-in profiles, one a line")
    ev = sub.add_parser("evaluate", help="replay a trace: every policy side by side")
    ev.add_argument("--trace", required=True, help="trace file")
    ev.add_argument("--format", default="auto", choices=FORMATS, help="trace format (default: detect)")
    ev.add_argument("--column", default=None, metavar="NAME",
                    help="hourly count traces (day,hour,<count columns>): the column to replay "
                    "(default: conversation, else all/total, else the only one)")
    ev.add_argument("--window-s", type=float, default=None,
                    help="window length (per-request traces: default 60; windowed: re-bin)")
    ev.add_argument("--profile", default="h100x8-llama2-7b",
                    help=f"built-in ({', '.join(BUILTIN_PROFILES)}) or a measured profile JSON file")
    ev.add_argument("--objective", default="gpu-hours", choices=("gpu-hours", "latency", "goodput"),
                    help="gpu-hours (default): fewest GPUs covering the load; latency: lowest TPOT on "
                    "the whole host; goodput: the older SLO-goodput replay")
    ev.add_argument("--load-scale", type=float, default=0.9,
                    help="K: the trace's peak window = K x fixed-best's SLO capacity (gpu-hours, latency)")
    ev.add_argument("--peak-utilization", type=float, default=0.9,
                    help="goodput objective: the peak window offers this fraction of the best capacity")
    ev.add_argument("--profile-slowdown", type=float, default=1.0,
                    help="take the profile as S x slower (capacities / S, latencies x S), as "
                    "'remp policy serve --profile-slowdown' does (default 1)")
    ev.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT target (default: the profile's)")
    ev.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT target (default: the profile's)")
    ev.add_argument("--min-dwell-s", type=float, default=None,
                    help="default 1800 (gpu-hours, latency) / 1800 (goodput)")
    ev.add_argument("--max-switches-per-day", type=int, default=None, help="default 12 / 6 (goodput)")
    ev.add_argument("--horizon-s", type=float, default=None, help="default 10800")
    ev.add_argument("--burst-rps", type=float, default=0.0,
                    help="gpu-hours / latency: auto sizes for a burst of this many req/s (of the "
                    "replayed, load-scaled traffic) from the first window (default 0)")
    ev.add_argument("--min-gpus", type=int, default=0, help="gpu-hours: auto never holds fewer GPUs")
    ev.add_argument("--hard-switch-budget", action="store_true",
                    help="gpu-hours: auto never goes over --max-switches-per-day in any 24 h (by "
                    "default one scale-up over it is allowed when the day's SLO bar is at stake)")
    ev.add_argument("--json", action="store_true", help="last line: one JSON object")
    ev.add_argument("--png", metavar="FILE", default=None,
                    help="gpu-hours, latency: also draw one day to FILE (PNG): load, the topology "
                    "chosen by auto and by the oracle, the GPUs each holds (needs matplotlib)")
    ev.add_argument("--day", type=int, default=0,
                    help="the day --png draws: 0 = the trace's first 24 h from its first window (default 0)")
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
    from remp.cliargs import add_credentials_arg

    add_credentials_arg(md)
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
        from remp.auth import Role, sync_channel
        from remp.cliargs import cli_credentials
        from remp.errors import ConfigError

        try:
            creds = cli_credentials(args.credentials_file)
        except ConfigError as exc:
            return _fail(str(exc), 2)
        with sync_channel(addr, creds.only(Role.OPERATOR)) as ch:
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
    from remp.cliargs import add_credentials_arg

    add_credentials_arg(sv)
    sv.add_argument("--controller-timeout-s", type=float)
    sv.add_argument("--redis-url", help="keep decisions and modes in Redis (unset: in memory)")
    sv.add_argument("--redis-prefix")
    sv.add_argument("--profile", help=f"built-in ({', '.join(BUILTIN_PROFILES)}) or a measured "
                    "profile JSON file")
    sv.add_argument("--profile-slowdown", type=float, help="take the profile as S x slower "
                    "(capacities / S, latencies x S; default 1): a margin for model error")
    sv.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                    help="gpu-hours / latency: correct the profile from the TPOT the host shows, "
                    "never below --profile-slowdown (default: on)")
    sv.add_argument("--slo-ttft-ms", type=float)
    sv.add_argument("--slo-tpot-ms", type=float)
    sv.add_argument("--mode", help="initial mode: auto | advisory (default) | off")
    sv.add_argument("--objective", choices=("gpu-hours", "latency", "goodput"),
                    help="gpu-hours (default): the fewest GPUs keeping the SLO, the rest released; "
                    "latency: the whole host, lowest TPOT; goodput: the older SLO-goodput core")
    sv.add_argument("--loss-budget", type=float, help="gpu-hours: expected share of the whole "
                    "host's in-SLO requests a choice may lose (default 0.0095)")
    sv.add_argument("--burst-rps", type=float, help="gpu-hours / latency: a burst of this many "
                    "req/s may come at any time (batch jobs); sized for from the start (default 0)")
    sv.add_argument("--min-gpus", type=int, help="gpu-hours: never fewer GPUs than this (default 0)")
    sv.add_argument("--hard-switch-budget", action="store_const", const=True, default=None,
                    help="gpu-hours: never more than --max-switches-per-day in any 24 h (by default "
                    "one scale-up over it is allowed when the day's SLO bar is at stake)")
    sv.add_argument("--tick-seconds", type=float)
    sv.add_argument("--window-seconds", type=float)
    sv.add_argument("--horizon-seconds", type=float)
    sv.add_argument("--min-dwell-seconds", type=float)
    sv.add_argument("--max-switches-per-day", type=int)
    sv.add_argument("--hysteresis", type=float, help="goodput only")
    sv.add_argument("--dwell-override", type=float, help="goodput only")
    sv.add_argument("--retry-backoff-seconds", type=float)
    sv.add_argument("--follow-switch-seconds", type=float,
                    help="auto mode: how long a tick waits for a switch it asked for to end "
                         "(default 10; the policy commits only a switch that succeeded)")
    sv.add_argument("--max-decisions", type=int)
    sv.add_argument("--rollout-min-nodes", type=int,
                    help="auto mode: this many nodes or more making the same move (not a "
                         "scale-up) go as one rollout with a capacity floor (0 or 1: never)")
    sv.add_argument("--rollout-headroom", type=float,
                    help="a rollout's floor covers the nodes' forecast load times this")


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
              if v is not None and k not in ("command", "_removed")}
    try:
        settings = PolicySettings(**fields)
    except ValidationError as exc:
        return _fail(invalid_setting(exc))
    try:
        logs.configure(node="policy")
    except ValueError as exc:
        return _fail(str(exc))
    from policy import server

    try:
        return asyncio.run(server.serve(settings, watchdog_s=15.0))
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


def _savings_table(ev, cfg=None) -> str:  # noqa: ANN001 - SavingsEvaluation, ScaleConfig
    r = ev.result()
    told = []
    if cfg is not None and cfg.burst_rps > 0:
        told.append(f"a declared burst of {cfg.burst_rps:g} req/s")
    if cfg is not None and cfg.min_gpus > 0:
        told.append(f"at least {cfg.min_gpus} GPUs")
    if cfg is not None and not cfg.over_budget_up:
        told.append(f"a hard limit of {cfg.max_switches_per_day} switches in any 24 h")
    lines = [f"trace {ev.trace}: {ev.windows} windows of {ev.window_s:g} s ({ev.days:.2f} days); profile "
             f"{ev.profile}; objective {ev.objective}; load scale K={ev.load_scale:g} (peak = K x "
             f"{ev.fixed_best}'s SLO capacity; the trace's rates x {ev.scale:.4g}); SLO TTFT "
             f"{ev.slo.ttft_s * 1e3:g} ms, TPOT {ev.slo.tpot_s * 1e3:g} ms"
             + (f"; auto told: {', '.join(told)}" if told else ""),
             f"{'policy':15s} {'GPU-h frac':>10s} {'rel.att mean':>12s} {'worst day':>10s} {'switches/day':>12s} "
             f"{'busiest day':>11s} {'TPOT ms':>8s} {'TTFT ms':>8s}"]
    for n in r["gpu_hours_fraction"]:
        lines.append(f"{n:15s} {r['gpu_hours_fraction'][n]:10.3f} {r['relative_attainment_mean'][n]:12.4f} "
                     f"{r['relative_attainment_min_day'][n]:10.4f} {r['switches_per_day'][n]:12.2f} "
                     f"{r['switches_max_day'][n]:11d} {r['mean_tpot_ms'][n]:8.1f} {r['mean_ttft_ms'][n]:8.1f}")
    lines.append(f"auto captures {r['captured_share']} of the oracle's GPU-hour saving")
    return "\n".join(lines)


def _replay_inputs(args):
    """The trace's load series, the profile and the SLO (the profile's unless given) a replay
    runs on; ValueError/OSError for a bad trace or profile."""
    series = read_trace(args.trace, args.format, args.window_s, args.column)
    profile = load_profile(args.profile).slowed(args.profile_slowdown)
    d = profile.default_slo
    slo = SLO(args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else d.ttft_s,
              args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else d.tpot_s)
    return series, profile, slo


def cmd_savings(args) -> int:
    from policy.savings import run_savings
    from policy.scale import ScaleConfig

    if args.png:
        from policy.savings_plot import PlotUnavailable, pyplot

        try:
            pyplot()  # before the replay: a missing matplotlib fails at once
        except PlotUnavailable as e:
            return _fail(str(e))
        if args.day < 0:
            return _fail(f"--day {args.day}: days are numbered from 0")
    try:
        series, profile, slo = _replay_inputs(args)
        base = ScaleConfig(objective=args.objective)
        cfg = ScaleConfig(objective=args.objective,
                          min_dwell_s=base.min_dwell_s if args.min_dwell_s is None else args.min_dwell_s,
                          max_switches_per_day=args.max_switches_per_day or base.max_switches_per_day,
                          horizon_s=args.horizon_s or base.horizon_s,
                          burst_rps=args.burst_rps, min_gpus=args.min_gpus,
                          over_budget_up=not args.hard_switch_budget)
        ev = run_savings(series, profile, args.objective, args.load_scale, slo, cfg)
        if args.png:
            from policy.savings_plot import render_png

            v = render_png(ev, args.day, args.png)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    print(json.dumps(ev.result()) if args.json else _savings_table(ev, cfg), flush=True)
    if args.png:
        # on stderr: with --json the last stdout line stays the one JSON object
        print(f"wrote {args.png}: day {v.day} of {v.days}, auto {v.gpu_hours_fraction['auto']:.3f} / "
              f"oracle {v.gpu_hours_fraction['oracle']:.3f} of the host's GPU-hours that day", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "profile":
        return cmd_profile(args)
    if args.command == "mode":
        return cmd_mode(args)
    if args.command == "profiles":
        for name in BUILTIN_PROFILES:
            print(name)
        return 0
    if args.objective != "goodput":
        return cmd_savings(args)
    if args.png:
        return _fail("--png draws a gpu-hours or latency replay, not --objective goodput")
    try:
        series, profile, slo = _replay_inputs(args)
        d_cfg = PolicyConfig()
        cfg = PolicyConfig(horizon_s=args.horizon_s or d_cfg.horizon_s,
                           min_dwell_s=d_cfg.min_dwell_s if args.min_dwell_s is None else args.min_dwell_s,
                           max_switches_per_day=args.max_switches_per_day or d_cfg.max_switches_per_day)
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
