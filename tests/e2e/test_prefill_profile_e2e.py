"""``remp profile`` against a real node agent on vLLM CPU (tiny model, TP1PP1, plain vLLM): the
prefill table the recovery decision reads is measured, written, loaded back, and drives
``decide`` — the crossover it predicts is where the decision flips."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from remp.recovery import (Action, DisplacedRequest, PrefillTable, crossover_bandwidth, decide)

pytestmark = pytest.mark.e2e

LENGTHS = [16, 128, 511]  # 511: the longest prompt max_model_len 512 accepts


@pytest.fixture(scope="module")
def agent(plain_tp1_agent):
    """TP1PP1 on plain vLLM, shared with test_agent_e2e (tests/e2e/conftest.py)."""
    return plain_tp1_agent


def remp_profile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.cli", "profile", *args],
                          capture_output=True, text=True, timeout=300)


def test_remp_profile_measures_the_prefill_table(agent, tmp_path):
    out = tmp_path / "prefill.json"
    r = remp_profile("--agent", agent.grpc_addr, "--out", str(out),
                     "--lengths", ",".join(map(str, LENGTHS)), "--repeats", "3")
    assert r.returncode == 0, r.stderr
    table = PrefillTable.loads(out.read_text())
    assert [n for n, _ in table.points] == LENGTHS
    secs = [s for _, s in table.points]
    assert all(0 < s < 5 for s in secs) and secs == sorted(secs)
    meta = table.meta
    assert meta["topology"] == "TP1PP1" and meta["source"] == "remp profile"
    assert meta["http"] == agent.http
    # 4 layers x 4 KV heads x head size 32 x K and V x 4 bytes (float32)
    assert meta["kv_bytes_per_token"] == 2 * 4 * 4 * 32 * 4
    raw = meta["measurements"]
    assert [m["tokens"] for m in raw] == LENGTHS and all(m["n"] == 3 for m in raw)
    assert meta["seconds_source"] == "engine"  # the default: the engine's own prefill time
    medians = [m["engine_median_s"] for m in raw]
    assert min(medians) <= min(secs) and max(secs) <= max(medians)  # a monotone fit of these
    for m in raw:
        assert 0 < m["engine_min_s"] <= m["engine_median_s"] <= m["engine_max_s"]
        assert m["ttft_min_s"] <= m["ttft_median_s"] <= m["ttft_max_s"]
        # the engine's prefill is part of the time to first token the client saw
        assert m["engine_median_s"] <= m["ttft_median_s"]
    # 32x the tokens cost more prefill (engine time: no HTTP noise in it). The fastest sample of
    # each length: a median of 3 on a shared 2-core CI box once read 0.129 s for 16 tokens
    # against 0.038 s for 511 (another engine's workers were busy beside it).
    assert raw[-1]["engine_min_s"] > raw[0]["engine_min_s"]
    assert f"prefill table (3 lengths, TP1PP1) written to {out}" in r.stdout
    assert r.stdout.count("cheaper above") == 3
    print(json.dumps({"points": table.points, "measurements": raw}, indent=1))

    # the measured table drives the decision: the crossover it predicts is where it flips
    per_tok = meta["kv_bytes_per_token"]
    req = DisplacedRequest("r", kv_bytes=300 * per_tok, tokens=300)
    c = crossover_bandwidth(req.kv_bytes, table.seconds(300))
    [at], [below] = decide([req], table, c), decide([req], table, c * (1 - 1e-9))
    assert (at.action, below.action) == (Action.MIGRATE, Action.RECOMPUTE)


def test_remp_profile_ttft_source_over_http_only(agent, tmp_path):
    out = tmp_path / "ttft.json"
    r = remp_profile("--http", agent.http, "--out", str(out), "--lengths", "8,64",
                     "--repeats", "2", "--source", "ttft", "--vocab-size", "2048")
    assert r.returncode == 0, r.stderr
    table = PrefillTable.loads(out.read_text())
    assert table.meta["seconds_source"] == "ttft" and "topology" not in table.meta
    assert [n for n, _ in table.points] == [8, 64]
    raw = table.meta["measurements"]
    assert min(m["ttft_median_s"] for m in raw) <= table.points[0][1]
    assert table.points[1][1] <= max(m["ttft_median_s"] for m in raw)
    assert "prefill table (2 lengths, ?) written to" in r.stdout


def test_remp_profile_rejects_lengths_beyond_the_engine_limit(agent, tmp_path):
    r = remp_profile("--agent", agent.grpc_addr, "--out", str(tmp_path / "x.json"),
                     "--lengths", "16,512")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "remp: error: prompt lengths [512] do not fit max_model_len 512 (at most 511)")
    assert not (tmp_path / "x.json").exists()
