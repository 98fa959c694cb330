"""INT8 KV for cross-host request migration (issue 18): how much smaller, how close, and when the
cost model picks it.

For each dtype (fp32, bf16) one real agent (tiny model, TP1PP1, ``--request-migration``, vLLM's
prefix cache off so that no import reuses another's blocks) serves requests; for each request:

1. a greedy streaming request runs on the agent; after k output tokens (the FaultInjection gate)
   the agent's ``MigrateRequest`` (``kv_int8`` OFF) exports it to a capturing stand-in target in
   this process, which keeps the ImportRequest header and the full-width KV payload;
2. the same state is imported back into the agent twice (``ImportRequest``): the captured
   payload as is (an uncompressed migration), and the same payload quantised by the agent's own
   code (``node_agent.kv.int8.quantize_file``, format INT8: checked and dequantised by the
   target agent into its dtype). Both continuations (greedy, same length) are compared token by
   token: token-identical share, first divergence position (tokens after the import);
3. the KL of the next-token distribution at the first step after the import, computed offline
   with HuggingFace transformers on the same tokens: the model's own KV of every token but the
   last, once as is and once quantised/dequantised with the same grouping (one scale per
   (layer, engine block of ``block_size`` tokens, KV head), K and V together), then the last
   token's full-vocabulary distribution; KL(full || INT8) in float64.

The decision table: :func:`remp.recovery.decide` (kv_int8 auto, the agent's codec seconds per
byte, the agent's measured prefill table from ``remp profile``) for a mean request of the run as
the throttled bandwidth falls; and the real agent's choice (``MigrateRequest`` kv_int8 AUTO,
RECOVERY_MODE_MIGRATE, ``bandwidth_limit_bps``) at a few throttles.

    .venv/bin/python bench/int8_kv_quality.py --requests 200 --time-budget 600
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from devstack.agentproc import (
    AgentProcess,
    arm_migration,
    ensure_credentials,
    prompt,
    stream_completion,
)
from devstack.modelgen import make_model
from node_agent.kv import int8
from node_agent.migration import INT8_CODEC_S_PER_BYTE
from remp.auth import Credentials, Role, aio_channel
from remp.node_agent.v1 import node_agent_pb2 as pb
from remp.node_agent.v1 import node_agent_pb2_grpc
from remp.recovery import (
    BandwidthEstimator,
    DisplacedRequest,
    PrefillTable,
    RecoveryConfig,
    decide,
    int8_payload_bytes,
)

RESULTS = Path(__file__).resolve().parent / "results"
BANDWIDTHS = (1e9, 1e8, 5e7, 4e7, 3.5e7, 3e7, 2.5e7, 2e7, 1.5e7, 1e7, 5e6, 1e6, 1e5)
AGENT_THROTTLES = (0, 1e8, 2e7, 5e6)


class Capture(node_agent_pb2_grpc.NodeAgentServicer):
    """A stand-in target: keeps each ImportRequest's header and payload, answers 'finished'."""

    def __init__(self):
        self.got: list[tuple[pb.ImportHeader, bytes]] = []

    def ImportRequest(self, request_iterator, context):
        header, kv = None, bytearray()
        for c in request_iterator:
            if c.HasField("header"):
                header = c.header
            kv += c.kv
        self.got.append((header, bytes(kv)))
        yield pb.ImportEvent(finished=True, finish_reason="length", receive_seconds=1e-3)


def agent_md():
    return (("authorization", f"Bearer {Credentials.load().tokens[Role.AGENT]}"),)


def import_tokens(addr: str, header: pb.ImportHeader, payload: bytes) -> list[int]:
    chunks = [pb.ImportChunk(header=header)]
    chunks += [pb.ImportChunk(kv=payload[i:i + (256 << 10)])
               for i in range(0, len(payload), 256 << 10)]
    with grpc.insecure_channel(addr) as ch:
        evs = list(node_agent_pb2_grpc.NodeAgentStub(ch).ImportRequest(
            iter(chunks), metadata=agent_md(), timeout=120))
    assert evs and evs[-1].finished, evs[-1:]
    return [t for e in evs for t in e.token_ids]


def to_int8(payload: bytes, tmp: str) -> bytes:
    src = os.path.join(tmp, "full.safetensors")
    with open(src, "wb") as f:
        f.write(payload)
    out = int8.quantize_file(src, os.path.join(tmp, "int8.safetensors"))
    with open(out, "rb") as f:
        data = f.read()
    os.unlink(out)
    return data


async def migrate_to(a: AgentProcess, target: str, text: str, k: int, max_tokens: int,
                     **kw) -> pb.MigrateRequestEvent:
    """Start ``text`` on ``a``; once it has ``k`` tokens, MigrateRequest it to ``target``.
    Returns the decision event."""
    await arm_migration(a.grpc_addr, wait_output_tokens=k)
    async with httpx.AsyncClient(timeout=300) as c, aio_channel(a.grpc_addr,
                                                               Credentials.load()) as ch:
        call = node_agent_pb2_grpc.NodeAgentStub(ch).MigrateRequest(pb.MigrateRequestRequest(
            target_address=target, target_node="capture", **kw))
        await asyncio.sleep(0.05)
        client = asyncio.create_task(stream_completion(c, a.http, text, max_tokens, errors=[]))
        first = None
        async for ev in call:
            if first is None:
                first = ev
        await client
        return first


def hf_kl(model_dir: Path, dtype: torch.dtype, seqs: list[list[int]], block_size: int) -> list:
    """Per sequence: (KL(full || INT8) of the next-token distribution after seq[:-1]'s KV and
    seq[-1], whether the argmax agrees). HF transformers, the cache quantised with the
    payload's grouping (:func:`node_agent.kv.int8.quantize` over [blocks, KV heads, 2, block,
    head size])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = []

    def roundtrip(k: torch.Tensor, v: torch.Tensor):
        _, h, t, d = k.shape
        nb = -(-t // block_size)
        pad = nb * block_size - t
        kv = torch.stack([torch.nn.functional.pad(x[0], (0, 0, 0, pad)) for x in (k, v)])
        kv = kv.view(2, h, nb, block_size, d).permute(2, 1, 0, 3, 4).contiguous()
        q, s = int8.quantize(kv)
        back = int8.dequantize(q, s, k.dtype).permute(2, 1, 0, 3, 4).reshape(2, h, -1, d)
        return back[0, :, :t].unsqueeze(0), back[1, :, :t].unsqueeze(0)

    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            logits = []
            for quant in (False, True):
                r = model(ids[:, :-1], use_cache=True)
                cache = r.past_key_values
                if quant:
                    for layer in cache.layers:
                        layer.keys, layer.values = roundtrip(layer.keys, layer.values)
                logits.append(model(ids[:, -1:], past_key_values=cache).logits[0, -1].double())
            p, q = (torch.log_softmax(x, -1) for x in logits)
            kl = float((p.exp() * (p - q)).sum())
            out.append((max(kl, 0.0), bool(logits[0].argmax() == logits[1].argmax())))
    return out


def profile(a: AgentProcess, path: Path) -> PrefillTable:
    r = subprocess.run([sys.executable, "-m", "ops.cli", "profile", "--agent", a.grpc_addr,
                        "--out", str(path), "--lengths", "16,128,256,511", "--repeats", "3"],
                       capture_output=True, text=True, timeout=300, check=False)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return PrefillTable.loads(path.read_text())


def decision_table(kv_bytes: int, tokens: int, dtype_bytes: int, group: int,
                   table: PrefillTable) -> list[dict]:
    i8 = int8_payload_bytes(kv_bytes, dtype_bytes, group)
    rows = []
    for bw in BANDWIDTHS:
        est = BandwidthEstimator(default_bps=bw)
        d = decide([DisplacedRequest("r", kv_bytes, tokens, int8_bytes=i8)], table, est,
                   RecoveryConfig(kv_int8="auto", int8_codec_s_per_byte=INT8_CODEC_S_PER_BYTE,
                                  bandwidth_cap_bps=bw))[0]
        rows.append({"bandwidth_bps": bw, "action": d.action.value,
                     "kv_format": d.kv_format.value if d.action.value == "MIGRATE" else "-",
                     "payload_bytes": d.payload_bytes if d.action.value == "MIGRATE" else 0,
                     "full_s": kv_bytes / bw,
                     "int8_s": i8 / bw + kv_bytes * INT8_CODEC_S_PER_BYTE,
                     "recompute_s": d.recompute_s})
    return rows


def run_dtype(dtype: str, model: Path, logs: Path, n: int, budget_s: float, capture: Capture,
              target: str) -> dict:
    a = AgentProcess(model, tp=1, pp=1, dtype=dtype, log_dir=logs, node=f"q-{dtype}",
                     env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1",
                          "REMP_AGENT_MIGRATION_PEERS": target},
                     extra=["--no-world-changes", "--no-warm-up-candidates",
                            "--request-migration", "--", "--no-enable-prefix-caching"])
    a.start().wait_ready()
    try:
        desc = a.describe()
        bs, head = desc.engine.block_size, desc.model.head_size
        dtype_bytes = 4 if dtype == "float32" else 2
        rows, t0, tmp = [], time.monotonic(), tempfile.mkdtemp()
        for i in range(n):
            if time.monotonic() - t0 > budget_s:
                break
            k, cont = 4 + (i * 5) % 29, 32
            text = prompt(i % 37, 30 + (i * 11) % 200)
            capture.got.clear()
            asyncio.run(migrate_to(a, target, text, k, k + cont, mode=pb.RECOVERY_MODE_MIGRATE,
                                   kv_int8=pb.KV_INT8_MODE_OFF))
            (h, full), = capture.got
            assert h.kv_format in (pb.KV_FORMAT_FULL, pb.KV_FORMAT_UNSPECIFIED) and full
            q = to_int8(full, tmp)
            hf = pb.ImportHeader()
            hf.CopyFrom(h)
            hf.request_id = f"q{i}-full"
            hq = pb.ImportHeader()
            hq.CopyFrom(h)
            hq.request_id, hq.kv_format, hq.kv_bytes = f"q{i}-int8", pb.KV_FORMAT_INT8, len(q)
            tf, tq = import_tokens(a.grpc_addr, hf, full), import_tokens(a.grpc_addr, hq, q)
            div = next((j for j, (x, y) in enumerate(zip(tf, tq)) if x != y), None)
            rows.append({"i": i, "prompt_tokens": len(h.prompt_token_ids),
                         "output_tokens": len(h.output_token_ids), "full_bytes": len(full),
                         "int8_bytes": len(q), "continuation": len(tf),
                         "identical": tf == tq, "first_divergence": div,
                         "seq": list(h.prompt_token_ids) + list(h.output_token_ids)})
        elapsed = time.monotonic() - t0
        # the real agent's choice as the throttle falls (no prefill table: full or INT8)
        agent_choice = []
        for bw in AGENT_THROTTLES:
            capture.got.clear()
            ev = asyncio.run(migrate_to(a, target, prompt(3, 120), 10, 40,
                                        mode=pb.RECOVERY_MODE_MIGRATE,
                                        kv_int8=pb.KV_INT8_MODE_AUTO, bandwidth_limit_bps=bw))
            (h, payload), = capture.got
            agent_choice.append({"bandwidth_limit_bps": bw,
                                 "link_bps": ev.decision.bandwidth_bps,
                                 "kv_format": pb.KvFormat.Name(h.kv_format),
                                 "payload_bytes": len(payload),
                                 "full_kv_bytes": ev.decision.kv_bytes,
                                 "migrate_s": ev.decision.migrate_seconds})
        table = profile(a, logs / f"prefill-{dtype}.json")
    finally:
        a.stop()
    kls = hf_kl(model, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype],
                [r.pop("seq") for r in rows], bs)
    for r, (kl, top1) in zip(rows, kls):
        r["kl"], r["hf_top1_same"] = kl, top1
    divs = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    mid = sorted(rows, key=lambda r: r["full_bytes"])[len(rows) // 2]
    kv_tensor = mid["full_bytes"]  # the median request (payload incl. its small header)
    tokens = mid["prompt_tokens"] + mid["output_tokens"]
    # and one of 511 tokens (the prefill table's longest): its KV over every layer and head
    m = desc.model
    big = -(-510 // bs) * m.num_layers * m.num_kv_heads * bs * 2 * head * dtype_bytes
    return {
        "dtype": dtype, "requests": len(rows), "seconds": round(elapsed, 1),
        "block_size": bs, "continuation_tokens": 32,
        "payload_ratio_mean": sum(r["full_bytes"] / r["int8_bytes"] for r in rows) / len(rows),
        "payload_ratio_min": min(r["full_bytes"] / r["int8_bytes"] for r in rows),
        "identical_share": sum(r["identical"] for r in rows) / len(rows),
        "diverged": len(divs),
        "first_divergence_min": min(divs) if divs else None,
        "first_divergence_median": sorted(divs)[len(divs) // 2] if divs else None,
        "first_divergence_positions": divs,
        "first_token_same_share": sum(r["first_divergence"] != 0 for r in rows) / len(rows),
        "kl_mean": sum(r["kl"] for r in rows) / len(rows),
        "kl_max": max(r["kl"] for r in rows),
        "hf_top1_same_share": sum(r["hf_top1_same"] for r in rows) / len(rows),
        "decision_request": {"kv_bytes": kv_tensor, "tokens": tokens},
        "decisions": decision_table(kv_tensor, tokens, dtype_bytes, bs * 2 * head, table),
        "decision_request_511": {"kv_bytes": big, "tokens": 511},
        "decisions_511": decision_table(big, 511, dtype_bytes, bs * 2 * head, table),
        # illustrative only: the same KV with a prefill 10x slower than measured (a larger
        # model's compute per KV byte); shows the INT8 band between full and recompute
        "decision_request_511_prefill_x10": {"kv_bytes": big, "tokens": 511},
        "decisions_511_prefill_x10": decision_table(
            big, 511, dtype_bytes, bs * 2 * head,
            PrefillTable(tuple((n, 10 * t) for n, t in table.points))),
        "agent_decisions": agent_choice,
        "prefill_table": json.loads((logs / f"prefill-{dtype}.json").read_text()),
        "rows": rows,
    }


def fmt_table(res: dict) -> str:
    lines = [
        (f"## {res['dtype']}: {res['requests']} migrated requests in {res['seconds']} s "
         f"(block size {res['block_size']}, {res['continuation_tokens']} tokens continued)"),
        (f"payload ratio full/INT8: mean {res['payload_ratio_mean']:.3f}, min "
         f"{res['payload_ratio_min']:.3f}"),
        (f"token-identical continuations: {res['identical_share']:.1%} "
         f"({res['requests'] - res['diverged']}/{res['requests']}); first token same: "
         f"{res['first_token_same_share']:.1%}"),
        (f"first divergence (tokens after import) where diverged: min "
         f"{res['first_divergence_min']}, median {res['first_divergence_median']}"),
        (f"KL(full || INT8) next token after import (HF, full vocab): mean "
         f"{res['kl_mean']:.3g}, max {res['kl_max']:.3g}; argmax same "
         f"{res['hf_top1_same_share']:.1%}"),
    ]
    for key in ("", "_511", "_511_prefill_x10"):
        req = res["decision_request" + key]
        which = ("ILLUSTRATIVE: prefill table x10" if key.endswith("x10")
                 else "measured prefill table")
        lines += [(f"cost model (auto, codec {INT8_CODEC_S_PER_BYTE:g} s/B, {which}), request "
                   f"of {req['kv_bytes']} B of KV / {req['tokens']} tokens:"),
                  ("| bandwidth B/s | action | format | payload B | full s | int8 s | "
                   "recompute s |"), "|---|---|---|---|---|---|---|"]
        for d in res["decisions" + key]:
            lines.append(f"| {d['bandwidth_bps']:.2g} | {d['action']} | {d['kv_format']} | "
                         f"{d['payload_bytes']} | {d['full_s']:.4f} | {d['int8_s']:.4f} | "
                         f"{d['recompute_s']:.4f} |")
    lines += ["agent (MigrateRequest kv_int8 AUTO, mode MIGRATE):",
              "| throttle B/s | format | payload B | full KV B |", "|---|---|---|---|"]
    for d in res["agent_decisions"]:
        lines.append(f"| {d['bandwidth_limit_bps']:.0e} (link {d['link_bps']:.3g}) | "
                     f"{d['kv_format']} | {d['payload_bytes']} | {d['full_kv_bytes']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--time-budget", type=float, default=600,
                    help="seconds of migrations per dtype (stops early, counts reported)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="int8q-"))
    ensure_credentials(work)
    model = make_model(work / "tiny-llama")
    server = grpc.server(ThreadPoolExecutor(4))
    capture = Capture()
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(capture, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    results = []
    try:
        for dtype in args.dtypes.split(","):
            results.append(run_dtype(dtype, model, work, args.requests, args.time_budget,
                                     capture, f"127.0.0.1:{port}"))
            print(fmt_table(results[-1]), flush=True)
    finally:
        server.stop(0)
    now = datetime.datetime.now(datetime.UTC)
    out = {"date": now.isoformat(timespec="seconds"), "machine": {
        "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__}, "int8_codec_s_per_byte": INT8_CODEC_S_PER_BYTE,
        "results": results}
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"int8_kv_quality-{now:%Y%m%d-%H%M}"
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1))
    stem.with_suffix(".md").write_text(
        f"# INT8 KV quality ({out['date']}, {out['machine']['cores']} cores, "
        f"{out['machine']['cpu']})\n\n" + "\n\n".join(fmt_table(r) for r in results) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
