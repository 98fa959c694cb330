"""The multi-GPU data-path benchmark's code path on CPU: 2 processes over gloo, tiny shapes.

The script runs once on the borrowed multi-GPU machine (NCCL there); this guards everything that
is not NCCL-specific: the process layout, the executor over ``TorchDistTransport`` between real
processes for every ordered pair of the 2-GPU topologies (TP1PP1 on rank 0 only), the checks, the
shared weight store and the concurrent shard reload, the data-path timing and the JSON/markdown.
No timing asserts (CPU numbers mean nothing).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
PAIRS = {"TP1PP1→TP1PP2", "TP1PP2→TP1PP1", "TP1PP1→TP2PP1", "TP2PP1→TP1PP1", "TP1PP2→TP2PP1", "TP2PP1→TP1PP2"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_gpu")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "--device", "cpu", "--small", "--world", "2",
         "--out", str(out), "--store-root", str(out / "shm"), "--kv-plan", "0:200,2:120",
         "--reload-models", "tiny-7b-shape", "--kv-reps", "2", "--reload-reps", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "multi_gpu_cpu.json").read_text()), out, proc.stdout


def test_every_check_passes(report):
    rep, _, _ = report
    c = rep["correctness"]
    assert c["all_ok"], c
    assert c["kv_directions_checked"] == 2 * 6  # two cases × every ordered pair of the three topologies
    assert c["datapath_checked"] == 6  # the model with a store: every pair's switch checked once
    assert c["reload_checks"] == 3  # its three topologies' shards, loaded by both ranks at once
    assert c["rng_identical_across_ranks"] and c["p2p_ok"]
    assert not rep["errors"] and not rep["skipped"]


def test_json_keys_and_pair_table(report):
    rep, out, stdout = report
    for key in ("date", "kind", "world_size", "backend", "device", "devices", "torch", "ceilings", "reload",
                "kv", "table", "correctness", "goals", "wall_seconds", "topologies", "cycle"):
        assert key in rep, key
    assert rep["world_size"] == 2 and rep["backend"] == "gloo"
    assert rep["topologies"] == ["TP1PP1", "TP1PP2", "TP2PP1"]
    assert {r["direction"] for r in rep["ceilings"]["p2p"]} == {"0→1", "1→0", "both"}
    assert rep["ceilings"]["p2p_unidir_GBps"] > 0
    rows = rep["table"]
    assert {(r["model"], r["tokens"]) for r in rows} == {("tiny-7b-shape", 200), ("tiny-70b-shape", 120)}
    for model in ("tiny-7b-shape", "tiny-70b-shape"):
        assert {r["pair"] for r in rows if r["model"] == model} == PAIRS
    for r in rows:
        assert r["ok"], r
        for key in ("remote_GB", "local_GB", "migrate_ms", "link_GBps", "pct_p2p", "plan_ms"):
            assert r[key] is not None and r[key] >= 0, (key, r)
        assert r["remote_GB"] > 0  # every pair of these moves KV between the two processes
        assert len(r["migrate_ms_all"]) == 2
        if r["model"] == "tiny-7b-shape":  # store, concurrent reload, data path end to end
            assert r["e2e_ms"] > 0 and len(r["e2e_ms_all"]) == 2 and r["reload_alone_GBps"] > 0
            assert r["dp_reload_GBps"] > 0 and "meets_7b_goal" in r
        else:  # no store: the reload estimated from the measured rate
            assert r["e2e_ms"] is None and r["reload_est_ms"] > 0 and len(r["e2e_est_ms"]) == 2
    # TP1PP1 lives on rank 0 alone: rank 1 sends nothing when leaving it
    for r in rows:
        if r["old"] == "TP1PP1":
            assert r["sent_by_rank_GB"][1] == 0
    for case in rep["kv"]:
        for leg in case["checked"]:
            assert leg["old_layers_left"] == 0 and leg["sent_equals_received"]
    md = (out / "multi_gpu_cpu.md").read_text()
    assert "per pair" in md and "x4" in md and "x8" in md and "not lent" in md
    assert "TP2PP1→TP1PP2" in stdout  # the table printed last


def test_checks_catch_a_wrong_block(tmp_path):
    """The KV check is not vacuous: a changed live element or a written free block fails it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import multi_gpu as mg

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(mg._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        args = mg.parse_args(["--device", "cpu", "--small", "--out", str(tmp_path)])
        r = mg.Runner(0, 1, args)
        cfg = mg.SMALL_MODELS["tiny-7b-shape"]
        case = mg.gd.KVCase(cfg, 200, torch.device("cpu"))
        topo = mg.Topology(1, 1)
        layers = r.fill(case, topo)
        assert r.check_kv(case, topo, layers, poisoned=False)
        live = int(case.ids[3])
        layers[2][live, 0, 1, 3, 5] += 1  # one element of one live block
        assert not r.check_kv(case, topo, layers, poisoned=False)
        layers = r.fill(case, topo)
        for t in layers.values():
            t[case.dead] = float("nan")
        assert r.check_kv(case, topo, layers, poisoned=True)
        layers[1][int(case.dead[0])].zero_()  # a free block written
        assert not r.check_kv(case, topo, layers, poisoned=True)
    finally:
        dist.destroy_process_group()
