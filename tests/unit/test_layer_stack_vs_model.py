"""The policy's performance model against a layer stack measured on a GPU (bench/
layer_stack_vs_model.py): the committed H200 run (4 × Llama-2-7B at TP 1, CUDA-graph replay)
stays within 25 % of the model's per-rank prediction in every case, and the comparison's
columns add up."""

import json
import shutil
from pathlib import Path

import pytest

from bench.layer_stack_vs_model import compare, table_md

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def h200_run(tmp_path):
    shutil.copy(ROOT / "policy/perfdata/h200/layer_stack.csv", tmp_path / "layer_stack.csv")
    shutil.copy(ROOT / "bench/results/attention_h200-2026-12-02.json",
                tmp_path / "attention_h200.json")
    return tmp_path


def test_the_model_is_within_25_percent_of_the_measured_h200_stack(h200_run):
    res = compare(h200_run, "h200")
    rows = res["rows"]
    assert len(rows) == 9 and {r["phase"] for r in rows} == {"prefill", "decode"}
    assert res["attention_source"] == "measured-h200" and "H200" in res["gpu"]
    for r in rows:
        assert r["layers"] == 4 and r["tp"] == 1
        assert r["model_ms"] == pytest.approx(r["model_ops_ms"] + r["model_attention_ms"], abs=1e-3)
        assert abs(r["model_err"]) <= 0.25, r
        assert abs(r["ops_plus_measured_attention_err"]) <= 0.25, r
    md = table_md(res)
    assert md.count("| llama2-7b | 1 |") == 9
    json.dumps(res)
