"""vLLM on a GPU against the performance model (bench/vllm_gpu_vs_model.py compare): each
measured row gets the model's prediction for the same work, and a load row the slowdown the
live calibration would take from it — 1 when vLLM is exactly the model, s when it is s x slower."""

import json

import pytest

from bench.vllm_gpu_vs_model import main
from policy.perfmodel import GPUS, MODELS, PerfModel, attention_source, topologies


def _run(tmp_path, tpot_scale: float) -> str:
    spec, g = MODELS["llama2-7b"], GPUS["h100"]
    pm = PerfModel(spec, g, attention_source(g))
    topo = next(t for t in topologies(spec, 8) if t.tp == 1 and t.pp == 1)
    rate = 0.5 * pm.capacity_rps(topo)
    # the built-in profile's own prediction at that rate (fixed 1024/256 requests)
    t50, t90, d50, d90 = pm.point(topo, rate)
    res = {"model": "llama2-7b", "gpu": "NVIDIA H100 80GB HBM3", "vllm": "0.25.0", "torch": "2.11.0",
           "date": "2026-12-07", "engine_start_s": 80.0,
           "kv": {"num_gpu_blocks": 7000, "block_size": 16, "kv_tokens": 112000},
           "decode": [{"batch": 32, "ctx": 1024, "new": 64, "step_ms": 12.0, "gaps": 60}],
           "prefill": [{"prompt": 1024, "ttft_ms": 30.0, "runs_ms": [30.0]}],
           "load": [{"rate": rate, "kept": 300, "input": 1024, "output": 256,
                     "ttft_p50_ms": 1e3 * t50, "ttft_p90_ms": 1e3 * t90,
                     "tpot_p50_ms": 1e3 * d50 * tpot_scale, "tpot_p90_ms": 1e3 * d90 * tpot_scale,
                     "ttft_mean_ms": 1e3 * t50, "tpot_mean_ms": 1e3 * d50 * tpot_scale}]}
    p = tmp_path / f"vllm_llama2-7b-{tpot_scale}.json"
    p.write_text(json.dumps(res))
    return str(p)


def test_every_measured_row_gets_the_models_prediction(tmp_path):
    out = tmp_path / "cmp.md"
    main(["compare", _run(tmp_path, 1.0), "--out", str(out)])
    rows = json.loads((tmp_path / "cmp.md.json").read_text())["rows"]
    assert [r["what"] for r in rows] == ["kv_tokens", "decode", "prefill", "load"]
    spec, g = MODELS["llama2-7b"], GPUS["h100"]
    pm = PerfModel(spec, g, attention_source(g))
    topo = next(t for t in topologies(spec, 8) if t.tp == 1 and t.pp == 1)
    assert rows[0]["model_value"] == round(pm.kv_tokens(topo))
    assert rows[1]["model_value"] == pytest.approx(pm.round_ms(topo, 32, 0.0, ctx=1024 + 32), abs=1e-3)
    assert rows[2]["model_value"] > 0 and rows[3]["capacity_model"] > 0
    md = out.read_text()
    assert "| 32 | 1024+64 | 12.00 |" in md and "implied TPOT / TTFT slowdown" in md


@pytest.mark.parametrize("scale", [1.0, 1.3])
def test_a_load_row_tells_what_the_calibration_would_take(tmp_path, scale):
    """A vLLM TPOT s x the profile's at the same rate implies a slowdown near s (the profile's
    TPOT also grows with load, so the implied s is a little under the ratio)."""
    main(["compare", _run(tmp_path, scale), "--out", str(tmp_path / "c.md")])
    row = json.loads((tmp_path / "c.md.json").read_text())["rows"][-1]
    s_tpot, _ = row["implied_slowdown"]
    if scale == 1.0:
        assert s_tpot == pytest.approx(1.0, abs=0.05), row
    else:
        assert 1.0 < s_tpot <= scale, row


def test_a_load_row_above_the_profiles_capacity_is_not_read_by_the_calibration(tmp_path):
    """vLLM at 1.18 x the model's capacity (stop 45, H100) is overloaded, not slow: the row says
    so and carries no implied slowdown."""
    from policy.profiles import load_profile

    cap = load_profile("h100x8-llama2-7b").curves[0].capacity_rps
    res = {"model": "llama2-7b", "gpu": "NVIDIA H100 80GB HBM3", "vllm": "0.25.0", "torch": "2.11.0",
           "date": "2026-12-07", "engine_start_s": 40.0,
           "load": [{"rate": 1.18 * cap, "kept": 400, "input": 1024, "output": 256,
                     "ttft_p50_ms": 1104.0, "ttft_p90_ms": 3280.0, "tpot_p50_ms": 35.2,
                     "tpot_p90_ms": 36.1, "ttft_mean_ms": 1247.0, "tpot_mean_ms": 33.8}]}
    p = tmp_path / "vllm_llama2-7b.json"
    p.write_text(json.dumps(res))
    main(["compare", str(p), "--out", str(tmp_path / "c.md")])
    row = json.loads((tmp_path / "c.md.json").read_text())["rows"][-1]
    assert row["implied_slowdown"] is None and row["model_value"] is None
    assert "not used (above the profile's capacity)" in (tmp_path / "c.md").read_text()
