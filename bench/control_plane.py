"""Control-plane overhead per switch, and planning time at fleet scale.

    python bench/control_plane.py [--switches 20] [--nodes 1000] [--json] [--out FILE]
                                  [--log-dir DIR] [--engine-priority low|equal|both]
                                  [--no-spin-agent]
    python bench/control_plane.py --ha [--baseline-rev REV] [--switches N] [--out FILE] ...

--ha: with HA in the path (main_ha): a Redis primary, replica and three sentinels (RedisHA, as
`remp up --ha`), controllers with a leader lease reaching Redis through redis+sentinel:// and
waiting for a replica (WAIT 1); with --baseline-rev the controller of that commit runs side by
side with this tree's, each with its own agent, switches interleaved per engine priority. Also
the Reconfigure RPC's own latency, and the controller's timeline of each switch (its log).

Overhead: a real Redis, controller and node agent (tiny model, vLLM CPU, TP2PP1 ↔ TP1PP2, no
load). For each switch: the client's wall time from sending Reconfigure to receiving the
SWITCH_DONE event on Watch, minus the agent-reported engine time of the switch
(SwitchRecord.total_seconds). What remains is the controller's share: auth, validation, the
agent health check, Redis compare-and-set writes for every phase, the event stream and the
driver's ExecuteSwitch round trips. p50 / p99 over --switches.

Where it goes: every switch is split by the timestamps the processes themselves report (all on
this host's clock): client call → the controller's "accepted" event (validation, Redis read,
agent health check) → the agent starts the switch (Redis writes, ExecuteSwitch) | engine | the
agent's record is complete → the controller's SWITCH_DONE event → the client has it (Redis
write, Watch). Per switch also every event as the controller wrote it and the client got it.

Engine priority. Everything shares this machine's CPUs (2 on the reference box), and vLLM's
workers busy-wait (sched_yield) for 1 s after every message they read — after a switch's last
engine call they occupy both cores for a second. The harness starts the agent at nice 5 in its
own session, but with autogroup scheduling (Linux's default, see
/proc/sys/kernel/sched_autogroup_enabled) nice only ranks tasks inside one session, so the
controller, Redis and the client wait for CPU behind the spinning workers (measured with
perf sched: 1.0-1.3 s of run-queue wait for the controller's gRPC threads, ending when the
spin ends). "low": the agent's session gets autogroup nice 19, so the engine only takes CPU the
control plane does not want — the situation of a controller on its own host. "equal": the
agent's session as started (autogroup nice 0). "both" (default) interleaves the two over
2 × --switches switches; the headline numbers are "low", the "equal" ones are reported beside
them. "equal-spin20ms" (unless --no-spin-agent): a second agent, started with
--worker-spin-seconds 0.02 (its workers sleep on their socket 20 ms after a message), at equal
priority — the fix for a shared CPU host; its switches are interleaved with the others. Then the
engine processes' CPU use is sampled around one more switch: 0.5 s before it
starts and 1.5 s from the end of the agent's record (the spin shows as ≈ 2 CPUs busy for ≈ 1 s
while the engine has nothing to do), and the CPU used by processes outside this benchmark
during the measured switches is reported (other work on a shared machine).

Planning: --nodes nodes shaped like an 8-GPU H200 host serving a Llama-2-70B-shaped model (80
layers, 8 KV heads, 64 heads, hidden 8192, bf16, 40k live blocks) are registered with the same
controller; the pure planner plans TP1PP8 → TP4PP2 for every one of them (total ms), and the Plan
RPC's latency is measured with all of them registered (p50). --nodes 0 skips planning.

With --json the last line is one JSON object: overhead_p50_ms, overhead_p99_ms, switches,
plan_1000_nodes_ms, plus details.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import psutil

ROOT = Path(__file__).resolve().parent.parent
NODE = "bench-cp"
sys.path.insert(0, str(ROOT))

from controller.planner import (NodeFacts, clear_shape_caches,  # noqa: E402
                                plan_switch)
from devstack.agentproc import (AgentProcess, ControllerProcess, ensure_credentials,  # noqa: E402
                                favour_this_session, free_port)
from remp.common.v1 import types_pb2  # noqa: E402
from remp.controller.v1 import controller_pb2  # noqa: E402
from devstack.modelgen import make_model  # noqa: E402
from remp.redisproc import RedisHA, RedisServer  # noqa: E402
from remp.topology import ModelShape, Topology  # noqa: E402

DONE = {controller_pb2.EVENT_TYPE_SWITCH_DONE, controller_pb2.EVENT_TYPE_SWITCH_FAILED,
        controller_pb2.EVENT_TYPE_SWITCH_ROLLED_BACK, controller_pb2.EVENT_TYPE_SWITCH_ABORTED}


def write_result(a, result: dict) -> int:
    """--out: the result as JSON, one line per switch; --json: one line on stdout."""
    if a.out:
        rows_txt = ",\n    ".join(json.dumps(r, ensure_ascii=False) for r in result["per_switch"])
        text = json.dumps({**result, "per_switch": "@ROWS@"}, indent=2, ensure_ascii=False)
        a.out.write_text(text.replace('"@ROWS@"', f"[\n    {rows_txt}\n  ]") + "\n")
    if a.json:
        print(json.dumps(result))
    return 0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _wall(ts) -> float:
    return ts.ToNanoseconds() / 1e9


def measure_overhead(ctl: ControllerProcess, modes: list[str], set_mode,
                     ctl_for: dict[str, ControllerProcess] | None = None,
                     node_for: dict[str, str] | None = None,
                     failures: list[dict] | None = None) -> list[dict]:
    """One switch at a time, switch i under ``modes[i]`` (``set_mode`` applies it, on the node
    ``MODES[mode]`` names — or ``node_for[mode]``, through ``ctl_for[mode]``: the --ha run's
    two controllers); per switch the client's wall times plus the timestamps the system
    itself reports (the controller's Event.at, the agent's record started_at / finished_at; all
    processes share this host's clock), so the overhead splits into where it was spent. With
    ``failures`` a switch refused or not SUCCEEDED is listed there and the run goes on."""
    out = []
    count: dict[str, int] = {}
    prev = None
    ctls = {m: (ctl_for or {}).get(m, ctl) for m in set(modes)}
    with contextlib.ExitStack() as chans:
        stubs = {m: c.stub(chans.enter_context(grpc.insecure_channel(c.addr)))
                 for m, c in ctls.items()}
        for mode in modes:
            stub = stubs[mode]
            node = (node_for or {}).get(mode) or MODES[mode][0]
            if prev is not None and node != prev:
                time.sleep(1.2)  # the other engine's workers may still spin after its switch
            prev = node
            set_mode(mode)
            i = count[node] = count.get(node, -1) + 1
            target = types_pb2.Topology(tp=1, pp=2) if i % 2 == 0 else types_pb2.Topology(tp=2, pp=1)
            got: dict = {"events": []}
            opened = threading.Event()

            def watch():
                stream = got["stream"] = stub.Watch(controller_pb2.WatchRequest(node=node),
                                                    timeout=120)
                opened.set()
                try:
                    for ev in stream:
                        got["events"].append((time.time(), ev))
                        if ev.switch_id and ev.switch_id == got.get("sid") and ev.type in DONE:
                            got["t_done"] = time.perf_counter()
                            stream.cancel()
                            return
                        if ev.type in DONE:  # done before we learnt the id: keep it
                            got.setdefault("early", []).append((time.perf_counter(), ev))
                except grpc.RpcError as exc:  # cancelled by the caller: a refused Reconfigure
                    if exc.code() != grpc.StatusCode.CANCELLED:
                        raise
            th = threading.Thread(target=watch)
            th.start()
            opened.wait(10)
            time.sleep(0.2)  # the stream is registered server-side
            w0, t0 = time.time(), time.perf_counter()
            try:
                r = stub.Reconfigure(controller_pb2.ReconfigureRequest(node=node, target=target),
                                     timeout=30)
            except grpc.RpcError as exc:
                if failures is None:
                    raise
                got["stream"].cancel()
                th.join(30)
                count[node] -= 1  # the same target again next time
                failures.append({"mode": mode, "error": f"{exc.code().name}: "
                                 f"{(exc.details() or '')[:300]}"})
                continue
            t_returned = time.perf_counter()
            got["sid"] = r.switch_id
            th.join(120)
            if "t_done" not in got:
                for t, ev in got.get("early", []):
                    if ev.switch_id == r.switch_id:
                        got["t_done"] = t
            rec = stub.GetSwitch(controller_pb2.GetSwitchRequest(switch_id=r.switch_id), timeout=10)
            if rec.outcome != types_pb2.SWITCH_OUTCOME_SUCCEEDED:
                if failures is None:
                    raise RuntimeError(f"switch {r.switch_id} ended {rec.outcome}: "
                                       f"{rec.error.message}")
                if rec.outcome in (types_pb2.SWITCH_OUTCOME_ROLLED_BACK,
                                   types_pb2.SWITCH_OUTCOME_ABORTED):
                    count[node] -= 1
                failures.append({"mode": mode, "switch_id": r.switch_id,
                                 "error": f"{types_pb2.SwitchOutcome.Name(rec.outcome)}: "
                                          f"{rec.error.message[:300]}"})
                continue
            e2e = got["t_done"] - t0
            mine = [(t, ev) for t, ev in got["events"] if ev.switch_id == r.switch_id]
            accepted = next(ev for _, ev in mine if ev.phase == types_pb2.PHASE_SERVING_OLD)
            done = next(ev for _, ev in mine if ev.type in DONE)
            w_done = w0 + e2e
            ms = lambda a, b: round((b - a) * 1e3, 2)  # noqa: E731
            out.append({
                "switch_id": r.switch_id, "engine_priority": mode, "e2e_s": e2e,
                "engine_s": rec.total_seconds,
                "overhead_ms": (e2e - rec.total_seconds) * 1e3,
                "reconfigure_rpc_ms": round((t_returned - t0) * 1e3, 2), "sent_wall": w0,
                # where the overhead went, by the reporting processes' own clocks
                "split_ms": {
                    "client_to_accepted": ms(w0, _wall(accepted.at)),
                    "accepted_to_agent_start": ms(_wall(accepted.at), _wall(rec.started_at)),
                    "agent_end_to_done_event": ms(_wall(rec.finished_at), _wall(done.at)),
                    "done_event_to_client": ms(_wall(done.at), w_done),
                },
                "agent_wall_minus_total_ms": ms(rec.total_seconds,
                                                _wall(rec.finished_at) - _wall(rec.started_at)),
                # each event: phase, written by the controller (ms after the client's call),
                # received by the client; the agent's phases: started (ms after the call)
                "events_ms": [[types_pb2.Phase.Name(ev.phase)[6:], ms(w0, _wall(ev.at)),
                               ms(w0, t)] for t, ev in mine],
                "agent_phases_ms": [[types_pb2.Phase.Name(pt.phase)[6:],
                                     ms(w0, _wall(pt.started_at))] for pt in rec.phase_timings],
            })
    return out


def h200_node(i: int) -> controller_pb2.RegisterNodeRequest:
    return controller_pb2.RegisterNodeRequest(
        node=f"h200-{i:04d}", agent_address=f"127.0.0.1:{free_port() if i == 0 else 1}",
        topology=types_pb2.Topology(tp=1, pp=8),
        candidates=[types_pb2.Topology(tp=t, pp=8 // t) for t in (1, 2, 4, 8)],
        host=types_pb2.HostFacts(hostname=f"h{i}", device_type="cuda", device_count=8),
        model=types_pb2.ModelFacts(num_layers=80, num_attention_heads=64, num_kv_heads=8,
                                   head_size=128, hidden_size=8192, dtype="bfloat16",
                                   weight_bytes=138_000_000_000),
        kv_bandwidth_bps=360e9, weight_bandwidth_bps=50e9)


def measure_planning(ctl: ControllerProcess, nodes: int) -> dict:
    regs = [h200_node(i) for i in range(nodes)]
    with grpc.insecure_channel(ctl.addr) as ch:
        stub = ctl.stub(ch)
        t = time.perf_counter()
        for r in regs:
            stub.RegisterNode(r, timeout=10)
        reg_s = time.perf_counter() - t
        lat = []
        for i in range(50):
            t = time.perf_counter()
            stub.Plan(controller_pb2.PlanRequest(node=regs[i * (nodes // 50)].node,
                                                 target=types_pb2.Topology(tp=4, pp=2)), timeout=10)
            lat.append(time.perf_counter() - t)
    facts = [NodeFacts(ModelShape(80, 64, 8, 8192, 128), 8,
                       tuple(Topology(t, 8 // t) for t in (1, 2, 4, 8)), 138_000_000_000,
                       16 * 2 * 128 * 2, 40_000, 360e9, 50e9) for _ in regs]
    # cold: the planner's per-shape caches cleared before every node (a fleet of 1000 different
    # models); warm: one model everywhere, as fleets usually are
    t = time.perf_counter()
    for f in facts:
        clear_shape_caches()
        plan_switch(f, Topology(1, 8), Topology(4, 2))
    cold_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    plans = [plan_switch(f, Topology(1, 8), Topology(4, 2)) for f in facts]
    warm_ms = (time.perf_counter() - t) * 1e3
    return {"plan_1000_nodes_ms": cold_ms * 1000 / nodes, "plan_nodes": nodes,
            "plan_1000_nodes_warm_ms": warm_ms * 1000 / nodes,
            "plan_rpc_p50_ms": statistics.median(lat) * 1e3,
            "register_per_node_ms": reg_s * 1e3 / nodes,
            "example_plan": {"kv_bytes_total": plans[0].kv_bytes_total,
                             "weight_bytes_total": plans[0].weight_bytes_total,
                             "transfers": len(plans[0].transfers),
                             "predicted_total_s": plans[0].predicted_total_s}}


# per mode: the node switched and the autogroup nice of its agent's session (module docstring);
# "equal-spin20ms": a second agent started with --worker-spin-seconds 0.02
NODE_NOSPIN = "bench-cp-nospin"
MODES = {"low": (NODE, 19), "equal": (NODE, 0), "equal-spin20ms": (NODE_NOSPIN, 0)}


def cpu_busy_s() -> float:
    """CPU seconds spent by everything on this machine (all CPUs), from /proc/stat."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = f
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_s(procs: dict[int, psutil.Process]) -> dict[int, float]:
    out = {}
    for pid, p in procs.items():
        try:
            t = p.cpu_times()
            out[pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def own_tree() -> dict[int, psutil.Process]:
    me = psutil.Process()
    return {p.pid: p for p in [me, *me.children(recursive=True)]}


def engine_cpu_around_a_switch(ctl: ControllerProcess, agent: AgentProcess, set_mode,
                               step: float = 0.1, before: float = 0.5, after: float = 1.5
                               ) -> tuple[str, list[float], list[float]]:
    """One more switch (equal priority) while the agent's engine processes (engine core,
    workers) are sampled: CPUs busy per ``step`` in the ``before`` s up to the agent's record
    start, and in the ``after`` s from the record's end (the agent's own timestamps)."""
    procs = {p.pid: p for p in agent.descendants()}
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.time(), sum(cpu_s(procs).values())))
            time.sleep(step / 4)
    th = threading.Thread(target=sample)
    th.start()
    time.sleep(before + 0.2)
    row = measure_overhead(ctl, ["equal"], set_mode)[0]
    with grpc.insecure_channel(ctl.addr) as ch:
        rec = ctl.stub(ch).GetSwitch(controller_pb2.GetSwitchRequest(switch_id=row["switch_id"]),
                                     timeout=10)
    end = _wall(rec.finished_at)
    while time.time() < end + after + step:
        time.sleep(step)
    stop.set()
    th.join()

    def busy(t0: float, t1: float) -> float:
        a = min(samples, key=lambda s: abs(s[0] - t0))
        b = min(samples, key=lambda s: abs(s[0] - t1))
        return round((b[1] - a[1]) / (b[0] - a[0]), 2) if b[0] > a[0] else 0.0

    start = _wall(rec.started_at)
    idle = [busy(start - before + i * step, start - before + (i + 1) * step)
            for i in range(int(round(before / step)))]
    spin = [busy(end + i * step, end + (i + 1) * step) for i in range(int(round(after / step)))]
    return row["switch_id"], idle, spin


def summary(rows: list[dict]) -> dict:
    ov = [r["overhead_ms"] for r in rows]
    splits = [k for k in rows[0]["split_ms"] if all(k in r["split_ms"] for r in rows)]
    return {
        "switches": len(rows),
        "overhead_p50_ms": statistics.median(ov),
        "overhead_p99_ms": pct(ov, 0.99),
        "overhead_all_ms": [round(x, 2) for x in ov],
        "overhead_split_p50_ms": {k: statistics.median(r["split_ms"][k] for r in rows)
                                  for k in splits},
        "overhead_split_max_ms": {k: max(r["split_ms"][k] for r in rows) for k in splits},
        "engine_p50_s": statistics.median(r["engine_s"] for r in rows),
        "e2e_p50_s": statistics.median(r["e2e_s"] for r in rows),
        "reconfigure_rpc_p50_ms": statistics.median(r["reconfigure_rpc_ms"] for r in rows),
    }


# ----------------------------------------------------------------------------- --ha
# Two controllers side by side on one Redis HA group (primary, replica, three sentinels: RedisHA,
# as `remp up --ha` starts it), each as an HA deployment runs it — a leader lease
# (REMP_CONTROLLER_LEADER_LEASE_SECONDS), Redis through the redis+sentinel:// location, WAIT for
# one replica (REMP_CONTROLLER_REDIS_WAIT_REPLICAS=1, what `remp up --ha` sets) — and every other
# setting at its default. "baseline": the code of --baseline-rev (git archive of that commit, run
# from its own tree); "current": this working tree. Each has its own key prefix and its own agent
# (equal priority, --worker-spin-seconds 0.02 as `remp up` starts CPU agents); the switches
# alternate between them in pairs, so both see the same machine at the same time.
HA_NODES = {"baseline": "bench-cp-base", "current": "bench-cp-ha"}
HA_ENV = {"REMP_CONTROLLER_LEADER_LEASE_SECONDS": "3",
          "REMP_CONTROLLER_REDIS_WAIT_REPLICAS": "1"}


class TreeControllerProcess(ControllerProcess):
    """A controller run from another source tree (``tree``: a git archive of an older commit)."""

    tree: Path | None = None

    def launch(self, env: dict[str, str]) -> None:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", *self.command()], stdout=self._log,
            stderr=subprocess.STDOUT, cwd=self.tree, start_new_session=True,
            env={**os.environ, "REMP_LOG_FORMAT": "json", **env, "PYTHONPATH": str(self.tree)})


def export_tree(rev: str, dest: Path) -> str:
    """The repository at ``rev`` in ``dest`` (no .git); its full commit id."""
    full = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout.strip()
    dest.mkdir(parents=True)
    arc = subprocess.Popen(["git", "archive", full], cwd=ROOT, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=arc.stdout, check=True)
    if arc.wait() != 0:
        raise RuntimeError(f"git archive {full} failed")
    return full


def wait_leading(ctl: ControllerProcess, timeout: float = 30) -> None:
    """Until the controller has taken its lease (a no-op write answers, not 'not the leader')."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(ctl.addr) as ch:
        stub = ctl.stub(ch)
        while True:
            try:
                stub.Reconfigure(controller_pb2.ReconfigureRequest(node="no-such-node",
                                 target=types_pb2.Topology(tp=1, pp=1)), timeout=5)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)


def controller_timelines(log_dir: Path) -> dict[str, dict]:
    """Per switch id the controller's own timeline (its controller.switch_finished log line:
    ms after the RPC came in, on the controller's monotonic clock)."""
    out = {}
    for path in log_dir.glob("ctl-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if '"controller.switch_finished"' not in line:
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            out[d.get("switch_id", "")] = (d.get("controller_ms", {}), d.get("t0_wall"))
    return out


def main_ha(a) -> int:
    # the client (this process: Reconfigure, Watch, the clock) as if on another host: its session
    # ahead of the agents', controllers' and Redis servers' (devstack.agentproc)
    client_session = favour_this_session()
    codes = ["baseline", "current"] if a.baseline_rev else ["current"]
    prios = ["low", "equal"] if a.engine_priority == "both" else [a.engine_priority]
    kinds = [f"{c}-{p}" for p in prios for c in codes]
    modes = [kinds[(i // 2) % len(kinds)] for i in range(len(kinds) * a.switches)]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "controller"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory(prefix="remp-bench-cp-ha-") as tmp, \
            RedisHA(persist=True) as group:
        logs = a.log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        model = make_model(Path(tmp) / "tiny-llama")
        ensure_credentials(Path(tmp))
        ctls: dict[str, ControllerProcess] = {}
        base_rev = ""
        if a.baseline_rev:
            base = TreeControllerProcess(group.url, log_dir=logs, name="ctl-ha-baseline",
                                         env={**HA_ENV, "REMP_CONTROLLER_REDIS_PREFIX": "base:"})
            base.tree = Path(tmp) / "baseline"
            base_rev = export_tree(a.baseline_rev, base.tree)
            ctls["baseline"] = base
        ctls["current"] = ControllerProcess(group.url, log_dir=logs, name="ctl-ha-current",
                                            env={**HA_ENV, "REMP_CONTROLLER_REDIS_PREFIX": "cur:"})
        try:
            for c in ctls.values():
                c.start().wait_ready()
                wait_leading(c)
            with contextlib.ExitStack() as stack:
                agents = {}
                for k, c in ctls.items():
                    agents[k] = AgentProcess(model, tp=2, pp=1, dtype="float32", log_dir=logs,
                                             node=HA_NODES[k], extra=["--controller", c.addr],
                                             kv_cache_gib=1)  # worker spin 0.02: AgentProcess's
                    stack.enter_context(agents[k])
                for k, c in ctls.items():
                    c.wait_node_ready(HA_NODES[k], timeout=600)
                autogroup = {k: Path(f"/proc/{ag.proc.pid}/autogroup")
                             for k, ag in agents.items()}

                def set_mode(mode: str) -> None:
                    # the switched agent's session at the mode's autogroup nice (the module
                    # docstring's "low": a controller on its own host), the other at 0
                    code, prio = mode.split("-")
                    for k, path in autogroup.items():
                        path.write_text(str(19 if k == code and prio == "low" else 0))

                tree = own_tree()
                busy0, tree0, t0 = cpu_busy_s(), cpu_s(tree), time.monotonic()
                failures: list[dict] = []
                rows = measure_overhead(ctls["current"], modes, set_mode,
                                        ctl_for={m: ctls[m.split("-")[0]] for m in kinds},
                                        node_for={m: HA_NODES[m.split("-")[0]] for m in kinds},
                                        failures=failures)
                busy1, tree1, t1 = cpu_busy_s(), cpu_s(tree), time.monotonic()
        finally:
            for c in ctls.values():
                c.stop()
    timelines = controller_timelines(logs)
    for r in rows:
        r["controller_ms"], t0_wall = timelines.get(r["switch_id"], ({}, None))
        if t0_wall is not None and "final_event" in r["controller_ms"]:
            # the overhead's last legs by the controller's clock: the agent's record complete
            # → the controller's driver has it (the agent's stream, which vLLM's spinning
            # workers can hold up) → its SWITCH_DONE event written
            got = t0_wall + r["controller_ms"]["final_event"] / 1e3
            end = r["sent_wall"] + r["engine_s"] + r["split_ms"]["accepted_to_agent_start"] / 1e3 \
                + r["split_ms"]["client_to_accepted"] / 1e3
            r["split_ms"]["agent_end_to_controller_has_record"] = round((got - end) * 1e3, 2)
            r["split_ms"]["controller_has_record_to_done_event"] = round(
                r["split_ms"]["agent_end_to_done_event"] - (got - end) * 1e3, 2)
        if t0_wall is not None and "begun" in r["controller_ms"]:
            # the RPC's two network legs (controllers that log their rpc_in wall time)
            r["rpc_legs_ms"] = {
                "client_to_rpc_in": round((t0_wall - r["sent_wall"]) * 1e3, 2),
                "begun_to_client": round(r["reconfigure_rpc_ms"] - r["controller_ms"]["begun"]
                                         - (t0_wall - r["sent_wall"]) * 1e3, 2)}
    ours = sum(tree1[k] - tree0.get(k, 0.0) for k in tree1)
    by = {k: [r for r in rows if r["engine_priority"] == k] for k in kinds}

    def timeline_p50(rs: list[dict]) -> dict:
        keys = [k for k in (rs[0]["controller_ms"] if rs else {}) if
                all(k in r["controller_ms"] for r in rs)]
        return {k: statistics.median(r["controller_ms"][k] for r in rs) for k in keys}

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} cpus={len(os.sched_getaffinity(0))} "
                   f"{platform.processor() or platform.node()}".strip(),
        "command": "python bench/control_plane.py " + " ".join(sys.argv[1:]),
        "setup": ("Redis HA (primary, replica, 3 sentinels; redis+sentinel:// location), "
                  "leader lease 3 s, WAIT 1 replica, other settings default; one agent per "
                  "controller (TP2PP1<->TP1PP2, tiny model, vLLM CPU, equal priority, worker spin "
                  "0.02 s); switches alternate between the two in pairs"),
        "client_session": client_session,
        "baseline_rev": base_rev, "current_rev": head + ("+uncommitted" if dirty else ""),
        **{k: {**summary(by[k]), "controller_timeline_p50_ms": timeline_p50(by[k]),
               "failed": [f for f in failures if f["mode"] == k]} for k in kinds},
        "other_load_cpus": round(max(0.0, (busy1 - busy0) - ours) / (t1 - t0), 2),
        "per_switch": [{k: v for k, v in r.items() if k not in ("e2e_s", "engine_s")}
                       | {"code": r["engine_priority"], "e2e_ms": round(r["e2e_s"] * 1e3, 2),
                          "engine_ms": round(r["engine_s"] * 1e3, 2),
                          "overhead_ms": round(r["overhead_ms"], 2)} for r in rows],
    }
    for r in result["per_switch"]:
        r.pop("engine_priority", None)
    print(f"\nremp control plane with HA in the path — {result['setup']}")
    print(f"{'':36}" + "".join(f"{k + ' p50':>18}{k + ' p99':>18}" for k in kinds))
    for label, key, p99 in (("overhead per switch (ms)", "overhead_p50_ms", "overhead_p99_ms"),):
        print(f"{label:36}" + "".join(f"{result[k][key]:>18.1f}{result[k][p99]:>18.1f}"
                                      for k in kinds) + "   target p50 <= 10")
    print(f"{'Reconfigure RPC (ms)':36}" + "".join(
        f"{result[k]['reconfigure_rpc_p50_ms']:>18.1f}{'':18}" for k in kinds) + "   target <= 5")
    for s in dict.fromkeys(x for k in kinds for x in result[k]["overhead_split_p50_ms"]):
        print(f"{'  ' + s:36}" + "".join(
            f"{result[k]['overhead_split_p50_ms'].get(s, float('nan')):>18.1f}" f"{'':18}"
            for k in kinds))
    for k in kinds:
        print(f"controller timeline p50, {k} (ms after the RPC came in): "
              + ", ".join(f"{n} {v:.1f}" for n, v in result[k]["controller_timeline_p50_ms"].items()))
    print(f"other work on this machine during the switches: {result['other_load_cpus']} CPUs")
    for f in failures:  # refused or not SUCCEEDED: not in the figures above
        print(f"failed ({f['mode']}): {f['error']}")
    return write_result(a, result)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--switches", type=int, default=20, help="per engine priority")
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--log-dir", type=Path, help="keep the controller and agent logs here")
    ap.add_argument("--engine-priority", choices=("low", "equal", "both"), default="both")
    ap.add_argument("--no-spin-agent", dest="spin_agent", action="store_false",
                    help="skip the second agent (--worker-spin-seconds 0.02, equal priority)")
    ap.add_argument("--ha", action="store_true",
                    help="with HA in the path: Redis primary+replica+3 sentinels, leader lease, "
                         "WAIT 1 replica (see main_ha); overhead and the Reconfigure RPC only")
    ap.add_argument("--baseline-rev", metavar="REV",
                    help="--ha: also run the controller of this commit, side by side")
    a = ap.parse_args()
    if a.ha:
        return main_ha(a)
    kinds = ["low", "equal"] if a.engine_priority == "both" else [a.engine_priority]
    if a.spin_agent:
        kinds.append("equal-spin20ms")
    # interleaved in pairs, so each mode sees both directions
    modes = [kinds[(i // 2) % len(kinds)] for i in range(len(kinds) * a.switches)]
    with tempfile.TemporaryDirectory(prefix="remp-bench-cp-") as tmp, RedisServer() as redis:
        logs = Path(tmp)
        if a.log_dir:
            logs = a.log_dir
            logs.mkdir(parents=True, exist_ok=True)
        model = make_model(logs / "tiny-llama")
        ensure_credentials(Path(tmp))
        ctl = ControllerProcess(redis.url, log_dir=logs, name="ctl-bench")
        ctl.start().wait_ready()
        agent = AgentProcess(model, tp=2, pp=1, dtype="float32", log_dir=logs, node=NODE,
                             extra=["--controller", ctl.addr], worker_spin=None,  # vLLM's own
                             kv_cache_gib=1)
        nospin = AgentProcess(model, tp=2, pp=1, dtype="float32", log_dir=logs, node=NODE_NOSPIN,
                              extra=["--controller", ctl.addr, "--worker-spin-seconds", "0.02"],
                              kv_cache_gib=1)
        agents = {NODE: agent, **({NODE_NOSPIN: nospin} if a.spin_agent else {})}
        try:
            with contextlib.ExitStack() as stack:
                for name, ag in agents.items():
                    stack.enter_context(ag)
                    ctl.wait_node_ready(name)
                # agent = its session's leader
                autogroup = {n: Path(f"/proc/{ag.proc.pid}/autogroup") for n, ag in agents.items()}

                def set_mode(mode: str) -> None:
                    node, nice = MODES[mode]
                    for n, path in autogroup.items():
                        path.write_text(str(nice if n == node else 0))

                tree = own_tree()
                busy0, tree0, t0 = cpu_busy_s(), cpu_s(tree), time.monotonic()
                rows = measure_overhead(ctl, modes, set_mode)
                busy1, tree1, t1 = cpu_busy_s(), cpu_s(tree), time.monotonic()
                # the engine's CPU use around one more switch (at equal priority)
                set_mode("equal")
                time.sleep(1.5)
                probe, idle, spin = engine_cpu_around_a_switch(ctl, agent, set_mode)
            planning = measure_planning(ctl, a.nodes) if a.nodes else {}
        finally:
            ctl.stop()
    ours = sum(tree1[k] - tree0.get(k, 0.0) for k in tree1)
    headline = "low" if "low" in modes else "equal"
    by_mode = {m: [r for r in rows if r["engine_priority"] == m] for m in MODES}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} cpus={len(os.sched_getaffinity(0))}",
        "engine_priority": headline,
        **summary(by_mode[headline]),
        **({"equal_priority": summary(by_mode["equal"])}
           if headline == "low" and by_mode["equal"] else {}),
        **({"equal_priority_worker_spin_20ms": summary(by_mode["equal-spin20ms"])}
           if by_mode["equal-spin20ms"] else {}),
        "engine_cpus_busy_before_switch": idle,
        "engine_cpus_busy_after_switch": spin,
        "engine_cpus_probe_switch": probe,
        "other_load_cpus": round(max(0.0, (busy1 - busy0) - ours) / (t1 - t0), 2),
        "per_switch": [{k: v for k, v in r.items() if k not in ("e2e_s", "engine_s")}
                       | {"e2e_ms": round(r["e2e_s"] * 1e3, 2),
                          "engine_ms": round(r["engine_s"] * 1e3, 2),
                          "overhead_ms": round(r["overhead_ms"], 2)} for r in rows],
        **planning,
    }
    cols = [m for m in MODES if by_mode[m]]
    sums = {m: summary(by_mode[m]) for m in cols}
    print("\nremp control plane — TP2PP1↔TP1PP2 (tiny model, CPU), engine priority: "
          + ", ".join(f"{m} ({len(by_mode[m])} switches)" for m in cols)
          + (f"; {result['plan_nodes']} H200x8 nodes registered" if planning else ""))
    print(f"{'':36}" + "".join(f"{m + ' p50':>18}{m + ' p99':>18}" for m in cols))
    print(f"{'overhead per switch (ms)':36}" + "".join(
        f"{sums[m]['overhead_p50_ms']:>18.1f}{sums[m]['overhead_p99_ms']:>18.1f}" for m in cols)
        + "   target p50 <= 20")
    for k in sums[cols[0]]["overhead_split_p50_ms"]:
        print(f"{'  ' + k:36}" + "".join(
            f"{sums[m]['overhead_split_p50_ms'][k]:>18.1f}"
            f"{sums[m]['overhead_split_max_ms'][k]:>15.1f}max" for m in cols))
    print(f"{'Reconfigure -> done (s)':36}" + "".join(
        f"{sums[m]['e2e_p50_s']:>18.3f}{'':18}" for m in cols))
    print(f"{'agent-reported switch (s)':36}" + "".join(
        f"{sums[m]['engine_p50_s']:>18.3f}{'':18}" for m in cols))
    print(f"engine processes, CPUs busy per 0.1 s: before a switch {idle}; from the end of the "
          f"agent's switch record {spin}")
    print(f"other work on this machine during the switches: {result['other_load_cpus']} CPUs")
    if planning:
        print(f"{'plan 1000 nodes (ms, pure, cold)':36}{result['plan_1000_nodes_ms']:>12.1f}"
              f"{'':12}   target <= 100")
        print(f"{'plan 1000 nodes (ms, one model)':36}{result['plan_1000_nodes_warm_ms']:>12.1f}")
        print(f"{'Plan RPC, 1000 nodes registered':36}{result['plan_rpc_p50_ms']:>12.1f}")
    return write_result(a, result)


if __name__ == "__main__":
    sys.exit(main())
