"""bench/gpu_pair_vs_model.py: the same bench run on two GPUs, matched row by row, against the
model's H100 -> H200 scaling. Here the committed H200 run is paired with itself relabelled as an
H100 run: every measured ratio is 1, and the model's ratios are its roofline scaling beyond a
fixed 12 us per kernel (0.698 = 3.35 / 4.8 TB/s for the memory-bound rest, 1.0 for
compute-bound GEMMs)."""

import copy
import json
from pathlib import Path

import pytest

from bench.gpu_pair_vs_model import pair, summary, table_md
from policy.perfmodel import FIXED_KERNEL_MS, H100, MODELS, PerfModel

ROOT = Path(__file__).resolve().parents[2]


def test_pairing_a_run_with_itself_gives_ratio_one_and_the_models_roofline_scaling():
    h200 = json.loads((ROOT / "bench/results/attention_h200-2026-12-02.json").read_text())
    h100 = copy.deepcopy(h200)
    h100["env"]["gpu"] = "NVIDIA H100 80GB HBM3"
    res = pair(h100, h200)
    assert (res["a"]["gpu"], res["b"]["gpu"]) == ("h100", "h200")
    rows = [r for r in res["rows"] if not r["what"].startswith("attention:")]
    assert len(rows) == 9 + 72 * 4 + 36 * 4  # the 7B stack cases, every operator row
    assert all(r["measured_ratio"] == 1.0 for r in res["rows"])
    # attention rows: decode scales by the HBM ratio beyond the fixed part, prefill not at all
    att = [r for r in res["rows"] if r["what"].startswith("attention:")]
    assert len(att) == len([r for r in h200["attention"] if r["median_ms"] > 0])
    bw = 3.35 / 4.8
    for r in att:
        if r["what"] == "attention:decode":
            t0 = min(r["a_ms"], FIXED_KERNEL_MS)
            assert r["model_ratio"] == pytest.approx((t0 + (r["a_ms"] - t0) * bw) / r["a_ms"], abs=1e-4)
    long = [r["model_ratio"] for r in att if r["what"] == "attention:decode" and r["a_ms"] > 1.0]
    assert long and all(bw < x < bw + 0.01 for x in long)
    assert {r["model_ratio"] for r in att if r["what"] == "attention:prefill"} == {1.0}
    assert "| attention:decode | all shapes | – | cudnn, ≥ 50 µs |" in table_md(res)
    by = {(r["what"], r["model"], r["tp"], r["tokens"]): r["model_ratio"] for r in rows}

    def fixed_then(model: str, op: str, tokens: int, factor: float) -> float:
        t = PerfModel(MODELS[model], H100).op_ms(op, 1, tokens)
        return (FIXED_KERNEL_MS + (t - FIXED_KERNEL_MS) * factor) / t

    assert by[("op:add", "llama2-7b", 1, 4096)] == pytest.approx(fixed_then("llama2-7b", "add", 4096, bw), abs=1e-3)
    assert by[("op:mlp_up_proj", "llama2-70b", 1, 1)] == pytest.approx(
        fixed_then("llama2-70b", "mlp_up_proj", 1, bw), abs=1e-3)
    assert by[("op:mlp_up_proj", "llama2-70b", 1, 1)] < 0.72  # a 1-token 70B GEMM: weight-bound
    assert by[("op:mlp_up_proj", "llama2-70b", 1, 4096)] == pytest.approx(1.0, abs=1e-3)
    assert {s["band"] for s in summary(res)} >= {"decode", "prefill", "≤64 tok", "≥1024 tok"}
    assert "| layer_stack_graph | llama2-7b | 1 | decode |" in table_md(res)
    json.dumps(res)


def test_a_run_without_a_known_gpu_name_is_refused():
    run = {"env": {"gpu": "Some Accelerator"}, "layer_stack": []}
    with pytest.raises(SystemExit, match="cannot tell the GPU"):
        pair(run, run)
