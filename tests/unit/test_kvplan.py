import itertools

import pytest

from remp.kvplan import RankView, layer_bytes, migration_plan, plan_bytes
from remp.topology import Topology

L, H = 4, 4
WORLD4 = [Topology(4, 1), Topology(2, 2), Topology(1, 4)]
WORLD2 = [Topology(2, 1), Topology(1, 2)]


def test_owner_formula_matches_design():
    v = RankView(Topology(2, 2), 4, 4)
    # g = s*TP + r, s = layer // (L/PP), r = head // (H/TP)
    assert v.owner(0, 0) == 0 and v.owner(0, 2) == 1 and v.owner(2, 0) == 2 and v.owner(3, 3) == 3
    assert list(v.layers_of(3)) == [2, 3] and list(v.heads_of(3)) == [2, 3]


@pytest.mark.parametrize("old,new", list(itertools.permutations(WORLD4, 2))
                         + list(itertools.permutations(WORLD2, 2)))
def test_plan_covers_every_layer_head_exactly_once(old, new):
    plan = migration_plan(old, new, L, H)
    a, b = RankView(old, L, H), RankView(new, L, H)
    seen = set()
    for s in plan:
        for h in range(s.head_start, s.head_end):
            assert (s.layer, h) not in seen
            seen.add((s.layer, h))
            assert a.owner(s.layer, h) == s.src and b.owner(s.layer, h) == s.dst
    assert seen == {(ly, h) for ly in range(L) for h in range(H)}
    assert [s.layer for s in plan] == sorted(s.layer for s in plan)  # layer-major


def test_tp2_to_pp2_moves_half():
    plan = migration_plan(Topology(2, 1), Topology(1, 2), L, H)
    remote = [s for s in plan if not s.local]
    # layers 0,1 -> rank 0: heads 2,3 come from rank 1; layers 2,3 -> rank 1: heads 0,1 from rank 0
    assert {(s.layer, s.head_start, s.src, s.dst) for s in remote} == {
        (0, 2, 1, 0), (1, 2, 1, 0), (2, 0, 0, 1), (3, 0, 0, 1)}
    b = plan_bytes(plan, num_blocks=10, bytes_per_block_head=100)
    assert b == {"remote": 4 * 2 * 10 * 100, "local": 4 * 2 * 10 * 100}
    assert layer_bytes(H, 10, 100) == 4000


def test_identity_plan_is_all_local():
    assert all(s.local for s in migration_plan(Topology(2, 2), Topology(2, 2), L, H))


def test_rejects_a_split_of_heads_or_more_stages_than_layers():
    with pytest.raises(ValueError):
        migration_plan(Topology(3, 1), Topology(1, 1), L, H)
    with pytest.raises(ValueError):
        migration_plan(Topology(1, 5), Topology(1, 1), L, H)


def test_layer_order_interleaves_stages():
    from remp.kvplan import layer_order

    assert layer_order(Topology(2, 1), Topology(1, 2), 4) == [0, 2, 1, 3]
    assert layer_order(Topology(1, 2), Topology(2, 1), 4) == [0, 2, 1, 3]
    assert layer_order(Topology(4, 1), Topology(1, 4), 4) == [0, 1, 2, 3]
    assert sorted(layer_order(Topology(2, 2), Topology(1, 4), 8)) == list(range(8))


def test_stage_layers_is_vllms_default_layout():
    from remp.topology import stage_layers, stage_starts

    assert stage_layers(4, 3) == (1, 2, 1)
    assert stage_layers(32, 3) == (11, 11, 10)
    assert stage_layers(80, 7) == (11, 11, 11, 12, 12, 12, 11)
    assert stage_layers(80, 6) == (13, 13, 13, 14, 14, 13)
    assert stage_layers(32, 8) == (4,) * 8
    assert stage_starts(10, 4) == (0, 2, 5, 8, 10)
    with pytest.raises(ValueError):
        stage_layers(4, 5)


UNEVEN = [Topology(1, 3), Topology(2, 3), Topology(1, 4), Topology(1, 7), Topology(2, 2),
          Topology(4, 1), Topology(1, 1)]


@pytest.mark.parametrize("old,new", list(itertools.permutations(UNEVEN, 2)))
def test_uneven_stages_plan_covers_every_layer_head_once(old, new):
    from remp.kvplan import layer_order, remote_moves
    from remp.topology import stage_layers

    L10 = 10
    plan = migration_plan(old, new, L10, H)
    a, b = RankView(old, L10, H), RankView(new, L10, H)
    assert [len(a.layers_of(r)) for r in range(0, old.world_size, old.tp)] == list(
        stage_layers(L10, old.pp))
    assert a.max_layers_per_stage == max(stage_layers(L10, old.pp))
    seen = set()
    for s in plan:
        for h in range(s.head_start, s.head_end):
            assert (s.layer, h) not in seen
            seen.add((s.layer, h))
            assert s.layer in a.layers_of(s.src) and h in a.heads_of(s.src)
            assert s.layer in b.layers_of(s.dst) and h in b.heads_of(s.dst)
    assert seen == {(ly, h) for ly in range(L10) for h in range(H)}
    grouped: dict = {}
    for s in plan:
        if not s.local:
            grouped.setdefault((s.src, s.dst, s.head_start, s.head_end), []).append(s.layer)
    assert remote_moves(old, new, L10, H) == grouped
    assert sorted(layer_order(old, new, L10)) == list(range(L10))
