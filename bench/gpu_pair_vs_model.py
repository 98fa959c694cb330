"""One bench, two GPUs: how much faster the second GPU ran the same work, against how much faster
the policy's performance model says it runs (issue 16: the H100 -> H200 scaling).

    python bench/gpu_pair_vs_model.py A.json B.json [--out bench/results/NAME.md]

A.json and B.json are what ``bench/attention_h200.py`` wrote (attention_<tag>.json) on two GPUs,
e.g. an H100 and an H200. Rows are matched on (what, model, TP, phase, batch, q_len, context):
the layer's operators timed alone (``op:*``) and the layer stacks under CUDA-graph replay
(``layer_stack_graph``); attention rows are matched on (kind, heads, KV heads, batch, q_len, KV
length, backend) and summarised per kind and backend, against the model's scaling of a measured
attention table to another GPU (decode by the HBM bandwidth ratio beyond a fixed 12 µs per kernel,
prefill unchanged). Per row: measured ratio B / A (same bench, same method, so the bench's
own floor — L2 flush, isolated calls — cancels to first order) and the model's ratio
(``PerfModel`` for B's GPU / for A's: Vidur's H100 operator times, each rescaled by its own
roofline for the H200 beyond a fixed 12 µs, and the attention source). Which GPU a run was on comes from its
``env.gpu`` (H100 / H200 in the name).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.layer_stack_vs_model import NAMES, predict  # noqa: E402
from policy.perfmodel import GPUS, MODELS, PerfModel, rescale_kernel_ms  # noqa: E402

KEY = ("what", "model", "tp", "phase", "batch", "q_len", "context")


def gpu_of(run: dict) -> str:
    name = str(run.get("env", {}).get("gpu", "")).upper()
    for g in GPUS:
        if g.upper() in name:
            return g
    raise SystemExit(f"cannot tell the GPU from env.gpu {name!r} (want one of {sorted(GPUS)})")


def rows_of(run: dict) -> dict[tuple, dict]:
    return {tuple(r[k] for k in KEY): r for r in run.get("layer_stack", [])
            if r["what"].startswith("op:") or r["what"] == "layer_stack_graph"}


def pair(a: dict, b: dict) -> dict:
    ga, gb = gpu_of(a), gpu_of(b)
    ra, rb = rows_of(a), rows_of(b)
    la = int(a.get("layer_config", {}).get("layers", 0))
    lb = int(b.get("layer_config", {}).get("layers", 0))
    models: dict[tuple[str, str], PerfModel] = {}

    def pm(model: str, g: str) -> PerfModel:
        if (model, g) not in models:
            models[(model, g)] = PerfModel(MODELS[model], GPUS[g])
        return models[(model, g)]

    out = []
    for k in sorted(set(ra) & set(rb), key=lambda k: tuple(str(x) for x in k)):
        x, y = ra[k], rb[k]
        model = NAMES[x["model"]]
        tp, n = int(x["tp"]), int(x["tokens"])
        if x["what"].startswith("op:"):
            op = x["what"][3:]
            ma, mb = pm(model, ga).op_ms(op, tp, n), pm(model, gb).op_ms(op, tp, n)
        else:
            if la != lb or x.get("shape") != y.get("shape"):
                continue  # not the same stack
            case = (tp, x["phase"], int(x["batch"]), int(x["q_len"]), int(x["context"]), la)
            ma, mb = sum(predict(pm(model, ga), *case)), sum(predict(pm(model, gb), *case))
        meas = float(y["median_ms"]) / float(x["median_ms"])
        out.append(dict(what=x["what"], model=model, tp=tp, phase=x["phase"],
                        batch=int(x["batch"]), q_len=int(x["q_len"]),
                        context=int(x["context"]), tokens=n, a_ms=float(x["median_ms"]),
                        b_ms=float(y["median_ms"]), measured_ratio=round(meas, 4),
                        model_ratio=round(mb / ma, 4) if ma > 0 else None))
    akey = ("kind", "q_heads", "kv_heads", "head_dim", "batch", "q_len", "kv_len", "backend")
    aa = {tuple(r[k] for k in akey): r for r in a.get("attention", [])}
    bw = GPUS[ga].hbm_bytes_s / GPUS[gb].hbm_bytes_s
    ab = {tuple(r[k] for k in akey): r for r in b.get("attention", [])}
    for k in sorted(set(aa) & set(ab), key=lambda k: tuple(str(x) for x in k)):
        x, y = aa[k], ab[k]
        if not (float(x["median_ms"]) > 0 and float(y["median_ms"]) > 0):
            continue
        out.append(dict(what=f"attention:{x['kind']}", model=f"{x['q_heads']}/{x['kv_heads']} heads",
                        tp=0, phase=x["backend"], batch=int(x["batch"]), q_len=int(x["q_len"]),
                        context=int(x["kv_len"]), tokens=int(x["batch"]) * int(x["q_len"]),
                        a_ms=float(x["median_ms"]), b_ms=float(y["median_ms"]),
                        measured_ratio=round(float(y["median_ms"]) / float(x["median_ms"]), 4),
                        model_ratio=round(rescale_kernel_ms(float(x["median_ms"]), bw)
                                          / float(x["median_ms"])
                                          if x["kind"].startswith("decode") else 1.0, 4)))

    def side(run: dict, g: str) -> dict:
        e = run.get("env", {})
        return dict(gpu=g, gpu_name=e.get("gpu", ""), date_utc=e.get("date_utc", ""),
                    command=run.get("command", ""))

    return dict(a=side(a, ga), b=side(b, gb), rows=out)


def summary(res: dict) -> list[dict]:
    """Median measured and model ratio per (what, model, TP), weight-bound (<= 64 tokens) and
    compute-bound (>= 1024 tokens) token counts apart for the operators."""
    groups: dict[tuple, list[dict]] = {}
    for r in res["rows"]:
        if r["what"].startswith("attention:"):
            band = f"{r['phase']}, {'≥' if r['a_ms'] >= 0.05 else '<'} 50 µs"
            groups.setdefault((r["what"], "all shapes", "–", band), []).append(r)
            continue
        if r["what"].startswith("op:"):
            band = "≤64 tok" if r["tokens"] <= 64 else ("≥1024 tok" if r["tokens"] >= 1024
                                                        else None)
            if band is None:
                continue
        else:
            band = r["phase"]
        groups.setdefault((r["what"], r["model"], r["tp"], band), []).append(r)
    return [dict(what=w, model=m, tp=t, band=bd, n=len(rs),
                 measured=statistics.median(r["measured_ratio"] for r in rs),
                 modelled=statistics.median(r["model_ratio"] for r in rs))
            for (w, m, t, bd), rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0])))]


def table_md(res: dict) -> str:
    a, b = res["a"], res["b"]
    lines = [f"# {b['gpu'].upper()} / {a['gpu'].upper()}: the same bench on two GPUs vs the "
             "model's scaling", "",
             f"- A: {a['gpu_name']} ({a['date_utc']}), `{a['command']}`",
             f"- B: {b['gpu_name']} ({b['date_utc']}), `{b['command']}`", "",
             "Ratio = B time / A time (median of each). Model = `PerfModel` for B / for A at the "
             "same shape (operators: Vidur H100 times, rescaled per operator roofline beyond a "
             "fixed 12 µs; stacks: operators + attention source, per rank, no all-reduce; "
             "measured decode attention: the HBM ratio beyond the same fixed 12 µs).", "",
             "| what | model | TP | tokens / case | n | measured B/A | model B/A |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: |"]
    for s in summary(res):
        lines.append(f"| {s['what']} | {s['model']} | {s['tp']} | {s['band']} | {s['n']} | "
                     f"{s['measured']:.3f} | {s['modelled']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    o = ap.parse_args()
    res = pair(json.loads(o.a.read_text()), json.loads(o.b.read_text()))
    md = table_md(res)
    if o.out:
        o.out.write_text(md)
        Path(str(o.out) + ".json").write_text(json.dumps(res, indent=1))
    print(md)


if __name__ == "__main__":
    main()
