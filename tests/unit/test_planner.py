"""The controller's pure planner: validity, the 2D plan's transfers and shard loads, bytes and
time prediction."""

from collections import defaultdict

import pytest

from controller.planner import NodeFacts, _moves, check_target, plan_switch
from remp.errors import InvalidArgument
from remp.kvplan import migration_plan, plan_bytes
from remp.topology import ModelShape, Topology, candidate_topologies
from remp.transaction import Phase

TINY = ModelShape(4, 8, 4, 256, 32)
L70 = ModelShape(80, 64, 8, 8192, 128)


def facts(shape=TINY, devices=2, live=10, kvbw=1e9, wbw=2e9, weight=10_000_000):
    return NodeFacts(shape, devices, tuple(candidate_topologies(shape, devices)), weight,
                     16 * 2 * shape.head_size * 4, live, kvbw, wbw)


@pytest.mark.parametrize("shape,devices", [(TINY, 2), (TINY, 4), (L70, 8)])
def test_moves_equal_the_per_layer_plan(shape, devices):
    cands = candidate_topologies(shape, devices)
    for a in cands:
        for b in cands:  # world-size changes included
            ref = defaultdict(list)
            for sl in migration_plan(a, b, shape.num_layers, shape.num_kv_heads):
                if not sl.local:
                    ref[(sl.src, sl.dst, sl.head_start, sl.head_end)].append(sl.layer)
            got = {k: list(v) for k, v in _moves(a, b, shape.num_layers, shape.num_kv_heads)}
            assert got == dict(ref), (a, b)


def test_plan_bytes_match_kvplan_and_shards_cover_the_model():
    f = facts(live=10)
    p = plan_switch(f, Topology(2, 1), Topology(1, 2))
    per = f.kv_bytes_per_block_head
    want = plan_bytes(migration_plan(Topology(2, 1), Topology(1, 2), 4, 4), 10, per)["remote"]
    assert p.kv_bytes_total == want > 0
    # every (layer, tp slice) of the target loaded exactly once
    covered = sorted((ly, s.tp_rank) for s in p.shard_loads for ly in s.layers)
    assert covered == sorted((ly, r) for ly in range(4) for r in range(1))
    assert p.weight_bytes_total == pytest.approx(f.weight_bytes, rel=1e-6)


def test_prediction_uses_bandwidths_history_and_overlap():
    f = facts(live=1000, kvbw=1e8, wbw=1e8)
    ov = plan_switch(f, Topology(2, 1), Topology(1, 2))
    seq = plan_switch(f, Topology(2, 1), Topology(1, 2), overlap=False)
    kv, rl = ov.predicted[Phase.MIGRATE_KV], ov.predicted[Phase.RELOAD_SHARDS]
    assert kv > 0 and rl == pytest.approx(f.weight_bytes / 1e8)
    assert seq.predicted_total_s - ov.predicted_total_s == pytest.approx(min(kv, rl))
    hist = plan_switch(f, Topology(2, 1), Topology(1, 2), history={Phase.QUIESCING: [1.0, 3.0, 2.0]})
    assert hist.predicted[Phase.QUIESCING] == 2.0


def test_noop_and_invalid_targets():
    f = facts()
    assert plan_switch(f, Topology(2, 1), Topology(2, 1)).noop
    with pytest.raises(InvalidArgument, match="valid targets: TP1PP1, TP2PP1, TP1PP2"):
        plan_switch(f, Topology(2, 1), Topology(3, 1))


def test_world_size_changes_are_planned():
    """TP2PP1 → TP1PP1 parks rank 1: every KV slice ends on rank 0, one rank loads weights."""
    f = facts(live=10)
    check_target(f, Topology(2, 1), Topology(1, 1))
    shrink = plan_switch(f, Topology(2, 1), Topology(1, 1))
    assert {t.dst_rank for t in shrink.transfers} == {0} and {t.src_rank for t in shrink.transfers} == {1}
    assert [s.rank for s in shrink.shard_loads] == [0]
    want = plan_bytes(migration_plan(Topology(2, 1), Topology(1, 1), 4, 4), 10,
                      f.kv_bytes_per_block_head)["remote"]
    assert shrink.kv_bytes_total == want > 0
    grow = plan_switch(f, Topology(1, 1), Topology(1, 2))
    assert {(t.src_rank, t.dst_rank) for t in grow.transfers} == {(0, 1)}
    assert [s.rank for s in grow.shard_loads] == [0, 1]
