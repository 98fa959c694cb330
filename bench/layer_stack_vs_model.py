"""A measured layer stack against the policy's performance model (issue 16: "check the model
against measurements where possible").

    python bench/layer_stack_vs_model.py RUN_DIR --gpu h100 [--out bench/results/NAME.md]

RUN_DIR holds what ``bench/attention_h200.py --sections layer --layer-model M --layer-tp 1,2,4,8
--layer-count K`` wrote on one GPU (layer_stack.csv and attention_<tag>.json): K decoder layers
of one TP rank's shard, timed under CUDA-graph replay (what vLLM runs for decode). For each case
the model's prediction for the same work on that rank is

    K x (the Vidur operators at n tokens and that TP + the attention source's time)

— ``PerfModel.layer_ms`` without its two all-reduces (one GPU has no peer; the all-reduce rows
are Vidur's NCCL tables, not checked here). A second column swaps the model's attention for the
attention measured alone at the same shape in the same run, so the operator tables and the
attention source can be told apart. Batched prefill (b prompts of s tokens) is b prefills of s.
Writes the table (.md) and the rows (.md.json, with the run's date and GPU).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policy.perfmodel import GPUS, MODELS, OPS, PerfModel  # noqa: E402

NAMES = {"Llama-2-7B": "llama2-7b", "Llama-2-70B": "llama2-70b", "Llama-3-8B": "llama3-8b",
         "Llama-3-70B": "llama3-70b"}


def predict(pm: PerfModel, tp: int, phase: str, batch: int, q_len: int, context: int,
            layers: int) -> tuple[float, float]:
    """(operators ms, attention ms) of ``layers`` layers on one rank, the model's sources."""
    m = pm.m
    n = batch * q_len
    qh, kh = m.heads / tp, m.kv_heads_per_rank(tp)
    ops = sum(pm.op_ms(op, tp, n) for op in OPS)
    if phase == "decode":
        att = pm.attn.decode_ms(qh, kh, m.head_dim, batch, context)
    else:
        att = batch * pm.attn.prefill_ms(qh, kh, m.head_dim, q_len, q_len)
    return layers * ops, layers * att


def compare(run_dir: Path, gpu: str) -> dict:
    with open(run_dir / "layer_stack.csv") as f:
        rows = list(csv.DictReader(f))
    meta = {}
    for p in sorted(run_dir.glob("attention_*.json")):
        meta = json.loads(p.read_text())
    cfg = meta.get("layer_config", {})
    layers = int(cfg.get("layers", 0))
    if not layers:
        raise SystemExit(f"{run_dir}: no layer_config with a layer count in attention_*.json")
    # attention alone: a decode row's context counts the new token (ctx + 1)
    alone = {(r["tp"], r["phase"], r["batch"], r["q_len"],
              str(int(r["context"]) - (r["phase"] == "decode"))): float(r["median_ms"])
             for r in rows if r["what"] == "layer_attention_default"}
    eager = {(r["tp"], r["phase"], r["batch"], r["q_len"], r["context"]): float(r["median_ms"])
             for r in rows if r["what"] == "layer_stack_eager"}
    compiled = {(r["tp"], r["phase"], r["batch"], r["q_len"], r["context"]): float(r["median_ms"])
                for r in rows if r["what"] == "layer_stack_compiled"}
    out, models = [], {}  # one PerfModel per model shape (each reads its tables)
    for r in rows:
        if r["what"] != "layer_stack_graph":
            continue
        model = NAMES[r["model"]]
        if model not in models:
            models[model] = PerfModel(MODELS[model], GPUS[gpu])
        pm = models[model]
        tp, b, q, ctx = int(r["tp"]), int(r["batch"]), int(r["q_len"]), int(r["context"])
        ops, att = predict(pm, tp, r["phase"], b, q, ctx, layers)
        measured = float(r["median_ms"])
        att_alone = alone.get((r["tp"], r["phase"], r["batch"], r["q_len"], r["context"]))
        row = dict(model=model, tp=tp, phase=r["phase"], batch=b, q_len=q, context=ctx,
                   layers=layers, graph_ms=measured,
                   eager_ms=eager.get((r["tp"], r["phase"], r["batch"], r["q_len"], r["context"])),
                   model_ops_ms=round(ops, 4), model_attention_ms=round(att, 4),
                   model_ms=round(ops + att, 4), model_err=round((ops + att) / measured - 1, 4))
        comp = compiled.get((r["tp"], r["phase"], r["batch"], r["q_len"], r["context"]))
        if comp is not None:  # --layer-compile: the fused-kernel stack, same case, same run
            row.update(compiled_ms=comp, compiled_vs_graph=round(comp / measured, 4),
                       model_err_compiled=round((ops + att) / comp - 1, 4))
        if att_alone is not None:
            with_measured = ops + layers * att_alone
            row.update(measured_attention_ms=round(layers * att_alone, 4),
                       ops_plus_measured_attention_ms=round(with_measured, 4),
                       ops_plus_measured_attention_err=round(with_measured / measured - 1, 4))
        out.append(row)
    env = meta.get("env", {})
    source = models[out[0]["model"]].attn.name if out else ""
    return dict(date=env.get("date_utc", ""), gpu=env.get("gpu", ""), profile_gpu=gpu,
                attention_source=source, command=meta.get("command", ""), layer_config=cfg,
                rows=out)


def table_md(res: dict) -> str:
    lines = [f"# Layer stack measured vs the policy's model ({res['gpu']}, {res['date']})", "",
             f"Run: `{res['command']}`. Model: `PerfModel` for `{res['profile_gpu']}` "
             f"(Vidur operators, attention source `{res['attention_source']}`), per rank, without "
             "all-reduces. Measured: CUDA-graph replay, median. Error = model / measured − 1.", "",
             "| model | TP | case | layers | measured ms | model ms (ops + attention) | error "
             "| ops + attention measured alone | error |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["rows"]:
        case = (f"decode b{r['batch']}, ctx {r['context']}" if r["phase"] == "decode"
                else f"prefill {r['batch']}×{r['q_len']}")
        alt = (f"{r['ops_plus_measured_attention_ms']:.3f} | "
               f"{r['ops_plus_measured_attention_err']:+.0%}"
               if "ops_plus_measured_attention_ms" in r else "– | –")
        lines.append(f"| {r['model']} | {r['tp']} | {case} | {r['layers']} | {r['graph_ms']:.3f} | "
                     f"{r['model_ms']:.3f} ({r['model_ops_ms']:.3f} + "
                     f"{r['model_attention_ms']:.3f}) | {r['model_err']:+.0%} | {alt} |")
    errs = [abs(r["model_err"]) for r in res["rows"]]
    if errs:
        lines += ["", f"|error| of the model: median {sorted(errs)[len(errs) // 2]:.0%}, "
                      f"max {max(errs):.0%} over {len(errs)} cases."]
    comp = [r for r in res["rows"] if "compiled_ms" in r]
    if comp:
        lines += ["", "The same stacks with the parts around attention compiled (`--layer-compile`: "
                      "torch.compile fuses norm + residual, RoPE and SiLU × mul; attention eager; one "
                      "CUDA graph), the proxy for vLLM's fused kernels:", "",
                  "| model | TP | case | graph ms | compiled ms | compiled / graph | model error vs compiled |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
        for r in comp:
            case = (f"decode b{r['batch']}, ctx {r['context']}" if r["phase"] == "decode"
                    else f"prefill {r['batch']}×{r['q_len']}")
            lines.append(f"| {r['model']} | {r['tp']} | {case} | {r['graph_ms']:.3f} | "
                         f"{r['compiled_ms']:.3f} | {r['compiled_vs_graph']:.3f} | "
                         f"{r['model_err_compiled']:+.0%} |")
        ce = sorted(abs(r["model_err_compiled"]) for r in comp)
        lines += ["", f"|error| of the model against the compiled stacks: median {ce[len(ce) // 2]:.0%}, "
                      f"max {ce[-1]:.0%} over {len(ce)} cases."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    res = compare(a.run_dir, a.gpu)
    md = table_md(res)
    if a.out:
        a.out.write_text(md)
        Path(str(a.out) + ".json").write_text(json.dumps(res, indent=1))
    print(md)


if __name__ == "__main__":
    main()
