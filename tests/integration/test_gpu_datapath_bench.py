"""The GPU data-path benchmark's core on CPU with tiny shapes: every check passes, JSON complete.

No timing asserts: the numbers on a CPU mean nothing; this guards the script that runs once on the
borrowed GPU (it must work the first time there).
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_datapath", ROOT / "bench" / "gpu_datapath.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_datapath")
    g = _bench()
    args = g.parse_args(["--device", "cpu", "--small", "--out", str(out), "--store-root", str(out / "shm"),
                         "--kv-plan", "0:100:x8,1:40:x8"])
    rep = g.run_all(args)
    return rep, out


def test_all_checks_pass(report):
    rep, _ = report
    c = rep["correctness"]
    assert c["all_ok"], c
    assert c["reload_checks"] == 2 * 10  # two models × every TP×PP with TP·PP ≤ 8
    assert c["kv_directions_checked"] == 2 * 12  # two models × every ordered pair of the x8 set
    # default (staged) executor, unlimited staging, the first (reference) executor, the direct path
    assert c["kv_checks"] == 4 * c["kv_directions_checked"]
    assert c["kv_ops_direct_ok"]
    for run in rep["kv"]["runs"]:
        assert not run["skipped"] and not run["errors"]
        for row in run["rows"]:
            assert row["ok"] and row["ok_unlimited"] and row["ok_reference"] and row["ok_direct"], row
            assert row["bytes_moved"] > 0
            assert row["reference"]["GBps"] > 0 and row["unlimited"]["GBps"] > 0 and row["direct"]["GBps"] > 0
            d = row["direct"]
            assert d["kernel"] == "torch"  # CPU: the torch ops (the Triton kernel runs on CUDA)
            assert d["hbm_copy_GBps"] == d["GBps"]  # one pass
            assert d["peak"]["executor_max_rank_vs_layer"] <= 1.10


def test_json_and_markdown_written(report):
    rep, out = report
    data = json.loads((out / "gpu_datapath_cpu.json").read_text())
    for key in ("date", "device", "torch", "ceilings", "reload", "kv", "overlap", "targets", "correctness",
                "prediction", "wall_seconds"):
        assert key in data, key
    assert data["torch"] == torch.__version__
    assert "d2d_copy_GBps" in data["ceilings"]
    for model in data["reload"].values():
        rows = model["modes"]["staged"]["topologies"]
        assert [r["topology"] for r in rows] == ["TP1PP1", "TP1PP2", "TP1PP4", "TP1PP8", "TP2PP1", "TP2PP2",
                                                 "TP2PP4", "TP4PP1", "TP4PP2", "TP8PP1"]
        assert all(r["ok"] and r["bytes"] > 0 for r in rows)
        assert model["baseline_remp_shm"]["ok"]
    row = data["kv"]["runs"][0]["rows"][0]
    for key in ("old", "new", "seconds", "GBps", "bytes_moved", "peak", "unlimited", "reference", "direct",
                "pct_of_d2d"):
        assert key in row, key
    assert "kv_direct_pct_of_d2d" in data["targets"] and "peak_extra_direct_vs_one_layer" in data["targets"]
    assert data["kv_ops"]["direct"]["ok"]
    assert data["overlap"]["ok"]
    md = (out / "gpu_datapath_cpu.md").read_text()
    assert "## Shard reload" in md and "## KV migration" in md and "## Overlap" in md
    assert "direct GB/s" in md


def test_shard_pieces_cover_every_weight_once():
    """Across the ranks of a topology the pieces tile every checkpoint tensor exactly (norms once
    per rank that needs them)."""
    from node_agent.weight_store import llama_shard_pieces

    g = _bench()
    cfg = g.SMALL_MODELS["tiny-13b-shape"]
    full = dict(g.checkpoint_entries(cfg))
    for topo in g.TOPOS:
        cover: dict[str, int] = {}
        for rank in range(topo.world_size):
            shapes, pieces = llama_shard_pieces(cfg, topo.tp, topo.pp, rank)
            filled = {}
            for p in pieces:
                shape = full[p.key]
                n = 1
                for i, d in enumerate(shape):
                    n *= p.length if i == p.dim else d
                if p.dim is not None or "norm" not in p.key:
                    cover[p.key] = cover.get(p.key, 0) + n
                filled[p.param] = filled.get(p.param, 0) + n
            for name, s in shapes.items():
                numel = 1
                for d in s:
                    numel *= d
                assert filled[name] == numel, (topo, rank, name)
        for key, shape in full.items():
            if "norm" in key:
                continue
            numel = 1
            for d in shape:
                numel *= d
            assert cover[key] == numel, (topo, key)
