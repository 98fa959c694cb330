"""Control-plane overhead per switch, and planning time at fleet scale.

    python bench/control_plane.py [--switches 20] [--nodes 1000] [--json] [--out FILE]

Overhead: a real Redis, controller and node agent (tiny model, vLLM CPU, TP2PP1 ↔ TP1PP2, no
load). For each switch: the client's wall time from sending Reconfigure to receiving the
SWITCH_DONE event on Watch, minus the agent-reported engine time of the switch
(SwitchRecord.total_seconds). What remains is the controller's share: auth, validation, the
agent health check, Redis compare-and-set writes for every phase, the event stream and the
driver's ExecuteSwitch round trips. p50 / p99 over --switches.

Planning: --nodes nodes shaped like an 8-GPU H200 host serving a Llama-2-70B-shaped model (80
layers, 8 KV heads, 64 heads, hidden 8192, bf16, 40k live blocks) are registered with the same
controller; the pure planner plans TP1PP8 → TP4PP2 for every one of them (total ms), and the Plan
RPC's latency is measured with all of them registered (p50).

With --json the last line is one JSON object: overhead_p50_ms, overhead_p99_ms, switches,
plan_1000_nodes_ms, plus details.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controller.planner import NodeFacts, _moves, plan_switch  # noqa: E402
from remp.agentproc import AgentProcess, ControllerProcess, free_port  # noqa: E402
from remp.common.v1 import types_pb2  # noqa: E402
from remp.controller.v1 import controller_pb2  # noqa: E402
from remp.modelgen import make_model  # noqa: E402
from remp.redisproc import RedisServer  # noqa: E402
from remp.topology import ModelShape, Topology  # noqa: E402

NODE = "bench-cp"
DONE = {controller_pb2.EVENT_TYPE_SWITCH_DONE, controller_pb2.EVENT_TYPE_SWITCH_FAILED,
        controller_pb2.EVENT_TYPE_SWITCH_ROLLED_BACK, controller_pb2.EVENT_TYPE_SWITCH_ABORTED}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def measure_overhead(ctl: ControllerProcess, n: int) -> list[dict]:
    out = []
    with grpc.insecure_channel(ctl.addr) as ch:
        stub = ctl.stub(ch)
        for i in range(n):
            target = types_pb2.Topology(tp=1, pp=2) if i % 2 == 0 else types_pb2.Topology(tp=2, pp=1)
            got: dict = {}
            opened = threading.Event()

            def watch():
                stream = stub.Watch(controller_pb2.WatchRequest(node=NODE), timeout=120)
                opened.set()
                for ev in stream:
                    if ev.switch_id and ev.switch_id == got.get("sid") and ev.type in DONE:
                        got["t_done"] = time.perf_counter()
                        got["event"] = ev
                        stream.cancel()
                        return
                    if ev.type in DONE:  # done before we learnt the id: keep it
                        got.setdefault("early", []).append((time.perf_counter(), ev))
            th = threading.Thread(target=watch)
            th.start()
            opened.wait(10)
            time.sleep(0.2)  # the stream is registered server-side
            t0 = time.perf_counter()
            r = stub.Reconfigure(controller_pb2.ReconfigureRequest(node=NODE, target=target),
                                 timeout=30)
            got["sid"] = r.switch_id
            th.join(120)
            if "t_done" not in got:
                for t, ev in got.get("early", []):
                    if ev.switch_id == r.switch_id:
                        got["t_done"], got["event"] = t, ev
            rec = stub.GetSwitch(controller_pb2.GetSwitchRequest(switch_id=r.switch_id), timeout=10)
            if rec.outcome != types_pb2.SWITCH_OUTCOME_SUCCEEDED:
                raise RuntimeError(f"switch {r.switch_id} ended {rec.outcome}: {rec.error.message}")
            e2e = got["t_done"] - t0
            out.append({"e2e_s": e2e, "engine_s": rec.total_seconds,
                        "overhead_ms": (e2e - rec.total_seconds) * 1e3})
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
    # cold: the planner's per-shape cache cleared before every node (a fleet of 1000 different
    # models); warm: one model everywhere, as fleets usually are
    t = time.perf_counter()
    for f in facts:
        _moves.cache_clear()
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--switches", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="remp-bench-cp-") as tmp, RedisServer() as redis:
        logs = Path(tmp)
        model = make_model(logs / "tiny-llama")
        ctl = ControllerProcess(redis.url, log_dir=logs, name="ctl-bench")
        ctl.start().wait_ready()
        agent = AgentProcess(model, tp=2, pp=1, dtype="float32", log_dir=logs, node=NODE,
                             extra=["--controller", ctl.addr])
        try:
            with agent:
                deadline = time.monotonic() + 60
                with grpc.insecure_channel(ctl.addr) as ch:
                    while time.monotonic() < deadline:
                        try:
                            ctl.stub(ch).GetState(controller_pb2.GetStateRequest(node=NODE),
                                                  timeout=5)
                            break
                        except grpc.RpcError:
                            time.sleep(0.2)
                rows = measure_overhead(ctl, a.switches)
            planning = measure_planning(ctl, a.nodes)
        finally:
            ctl.stop()
    ov = [r["overhead_ms"] for r in rows]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} cpus={len(__import__('os').sched_getaffinity(0))}",
        "switches": len(rows),
        "overhead_p50_ms": statistics.median(ov),
        "overhead_p99_ms": pct(ov, 0.99),
        "overhead_all_ms": [round(x, 2) for x in ov],
        "engine_p50_s": statistics.median(r["engine_s"] for r in rows),
        "e2e_p50_s": statistics.median(r["e2e_s"] for r in rows),
        **planning,
    }
    print(f"\nremp control plane — {result['switches']} switches TP2PP1↔TP1PP2 (tiny model, CPU), "
          f"{result['plan_nodes']} H200x8 nodes registered")
    print(f"{'':34}{'p50':>10}{'p99':>10}")
    print(f"{'overhead per switch (ms)':34}{result['overhead_p50_ms']:>10.1f}"
          f"{result['overhead_p99_ms']:>10.1f}   target p50 <= 20")
    print(f"{'Reconfigure -> done (s)':34}{result['e2e_p50_s']:>10.3f}")
    print(f"{'agent-reported switch (s)':34}{result['engine_p50_s']:>10.3f}")
    print(f"{'plan 1000 nodes (ms, pure, cold)':34}{result['plan_1000_nodes_ms']:>10.1f}"
          f"{'':10}   target <= 100")
    print(f"{'plan 1000 nodes (ms, one model)':34}{result['plan_1000_nodes_warm_ms']:>10.1f}")
    print(f"{'Plan RPC, 1000 nodes registered':34}{result['plan_rpc_p50_ms']:>10.1f}")
    if a.out:
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    if a.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
