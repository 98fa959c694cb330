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


def test_rejects_uneven_split():
    with pytest.raises(ValueError):
        migration_plan(Topology(3, 1), Topology(1, 1), L, H)


def test_layer_order_interleaves_stages():
    from remp.kvplan import layer_order

    assert layer_order(Topology(2, 1), Topology(1, 2), 4) == [0, 2, 1, 3]
    assert layer_order(Topology(1, 2), Topology(2, 1), 4) == [0, 2, 1, 3]
    assert layer_order(Topology(4, 1), Topology(1, 4), 4) == [0, 1, 2, 3]
    assert sorted(layer_order(Topology(2, 2), Topology(1, 4), 8)) == list(range(8))
