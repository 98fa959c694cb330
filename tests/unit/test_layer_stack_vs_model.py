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


def test_compiled_stacks_get_their_own_columns(h200_run):
    """A run with --layer-compile has a layer_stack_compiled row per case: the comparison adds the
    compiled time, its ratio to the graph-replayed stack and the model's error against it."""
    import csv

    path = h200_run / "layer_stack.csv"
    with open(path) as f:
        rows = list(csv.DictReader(f))
    extra = [dict(r, what="layer_stack_compiled", median_ms=str(float(r["median_ms"]) * 0.9))
             for r in rows if r["what"] == "layer_stack_graph"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows + extra)
    res = compare(h200_run, "h200")
    assert len(res["rows"]) == 9
    for r in res["rows"]:
        assert r["compiled_vs_graph"] == pytest.approx(0.9, abs=1e-3)
        assert r["model_err_compiled"] == pytest.approx(r["model_ms"] / r["compiled_ms"] - 1, abs=1e-3)
    md = table_md(res)
    assert "model error vs compiled" in md and "against the compiled stacks: median" in md
