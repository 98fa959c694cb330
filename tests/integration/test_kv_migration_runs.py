"""The KV executor's gather/scatter by runs of block ids, checked bit for bit against the first
executor (``migrate_kv_reference``: advanced indexing) and against the source, with ranks emulated
as threads over ``LocalTransport`` (CPU). Layouts: vLLM CPU (block-first, contiguous) and the GPU
flash layout ([2, blocks, block_size, heads, head_size] seen through the executor's permute)."""

import itertools
import random
import threading
import weakref

import pytest
import torch

from node_agent.kv import common as kcommon
from node_agent.kv import executor_collective as kc
from node_agent.kv import migrate as km
from node_agent.kv import plan as kplan
from node_agent.kv import transport as kt
from remp.kvplan import RankView, layer_order, migration_plan
from remp.topology import Topology

L, H, NB, BS, D = 4, 8, 40, 4, 8  # layers, KV heads, pool blocks, block size, head size
DT = torch.bfloat16


def global_kv(seed=1):
    """Random bit patterns (NaN payloads included): a copy that is not bit-exact shows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**15, 2**15, (L, NB, H, BS, 2 * D), generator=g, dtype=torch.int16).view(DT)


def to_layout(x, layout):
    """[NB, h, BS, 2D] block-first → the executor's view of that layout."""
    if layout == "flash":
        h = x.shape[1]
        st = x.reshape(NB, h, BS, 2, D).permute(3, 0, 2, 1, 4).contiguous()  # [2, NB, BS, h, D]
        return st.permute(1, 3, 0, 2, 4)  # [NB, h, 2, BS, D]
    return x.clone()


def alloc_for(layout, heads):
    def alloc(_layer):
        if layout == "flash":
            return torch.full((2, NB, BS, heads, D), float("nan"), dtype=DT).permute(1, 3, 0, 2, 4)
        return torch.full((NB, heads, BS, 2 * D), float("nan"), dtype=DT)
    return alloc


def emulate(fn, old, new, ids, layout, on_alloc=None, **kw):
    G = global_kv()
    a, b = RankView(old, L, H), RankView(new, L, H)
    plan = migration_plan(old, new, L, H)
    world = max(old.world_size, new.world_size)
    hub = kt.LocalTransport(timeout_s=30)
    old_layers = {r: {} for r in range(world)}
    for r in range(old.world_size):
        hs = a.heads_of(r)
        old_layers[r] = {ly: to_layout(G[ly][:, hs.start:hs.stop], layout) for ly in a.layers_of(r)}
    res, errors = [None] * world, []

    def work(r):
        alloc = alloc_for(layout, b.heads_per_rank)
        if on_alloc:
            alloc = on_alloc(r, old_layers[r], alloc)
        try:
            res[r] = fn(r, old_layers[r], a, b, plan, torch.tensor(ids, dtype=torch.long), alloc,
                        hub.endpoint(r), **kw)
        except BaseException as exc:  # noqa: BLE001
            errors.append((r, exc))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return G, b, res


def bits(t):
    return t.contiguous().view(torch.int16)


def check_exact(G, b, res, ids, layout):
    live = torch.tensor(sorted(set(ids)), dtype=torch.long)
    dead = [i for i in range(NB) if i not in set(ids)]
    for r in range(b.topo.world_size):
        hs = b.heads_of(r)
        assert sorted(res[r][0]) == list(b.layers_of(r))
        for ly in b.layers_of(r):
            t = res[r][0][ly]
            want = to_layout(G[ly][:, hs.start:hs.stop], layout)
            assert torch.equal(bits(t[live]), bits(want[live])), (r, ly)
            if dead:
                assert bool(t[dead].isnan().all()), (r, ly)  # free blocks never written


random.seed(5)
ID_SETS = {
    "all": list(range(NB)),
    "single": [17],
    "first": [0],
    "last": [NB - 1],
    "gaps": sorted(random.sample(range(NB), 25)),
    "two_runs": list(range(3, 12)) + list(range(20, 33)),
    "one_run": list(range(5, 30)),
    "unsorted": random.sample(range(NB), 20),
}
PAIRS = [(Topology(2, 1), Topology(1, 2)), (Topology(1, 2), Topology(4, 1)), (Topology(4, 1), Topology(2, 2)),
         (Topology(8, 1), Topology(1, 4)), (Topology(2, 2), Topology(8, 1)), (Topology(1, 1), Topology(2, 2))]


@pytest.mark.parametrize("layout", ["block", "flash"])
@pytest.mark.parametrize("ids_name", list(ID_SETS))
def test_identical_to_reference_every_id_set(layout, ids_name):
    ids = ID_SETS[ids_name]
    for old, new in PAIRS:
        for limit in ("auto", None, 700, 1):
            G, b, res = emulate(km.migrate_kv, old, new, ids, layout, staging_limit_bytes=limit)
            check_exact(G, b, res, ids, layout)
        _, _, ref = emulate(kc.migrate_kv_reference, old, new, ids, layout)
        for r in range(b.topo.world_size):
            for ly, t in ref[r][0].items():
                assert torch.equal(bits(t), bits(res[r][0][ly]))  # dead blocks: NaN in both


@pytest.mark.parametrize("max_runs", [0, 10**9])
@pytest.mark.parametrize("layout", ["block", "flash"])
def test_both_gather_paths(monkeypatch, max_runs, layout):
    """Per-run copies (any number of runs) and index ops (even for one run) give the same bytes."""
    monkeypatch.setattr(kcommon, "RUN_COPY_MAX_RUNS", max_runs)
    for ids in (ID_SETS["gaps"], ID_SETS["two_runs"], ID_SETS["single"], ID_SETS["all"]):
        for old, new in PAIRS[:4]:
            G, b, res = emulate(km.migrate_kv, old, new, ids, layout, staging_limit_bytes=900)
            check_exact(G, b, res, ids, layout)


def test_old_layer_released_before_the_next_is_allocated():
    """No view of a moved layer outlives it: when a rank allocates its next new layer, every old
    layer it finished is gone (peak extra = one new layer + staging, not + an old layer)."""
    seen = []

    def on_alloc(rank, old_layers, alloc):
        refs = {ly: weakref.ref(t) for ly, t in old_layers.items()}
        done_before: list[int] = []

        def wrapped(layer):
            for ly in list(refs):
                if ly not in old_layers and refs[ly]() is not None:
                    import gc
                    gc.collect()
                    assert refs[ly]() is None, f"rank {rank}: old layer {ly} still alive at layer {layer}"
            done_before.append(layer)
            seen.append(rank)
            return alloc(layer)
        return wrapped

    for layout in ("block", "flash"):
        for old, new in PAIRS:
            for ids in (ID_SETS["gaps"], ID_SETS["one_run"]):
                emulate(km.migrate_kv, old, new, ids, layout, on_alloc=on_alloc)
    assert seen


@pytest.mark.parametrize("old,new", list(itertools.permutations(
    [Topology(1, 4), Topology(2, 2), Topology(4, 1), Topology(8, 1)], 2)), ids=str)
def test_default_staging_keeps_one_layer_plus_10pct(old, new):
    """Extra memory = what the layer order itself needs (a new per-rank layer allocated while the
    old one is held; more where a rank receives layers before it sends its own) + staging; the
    default staging keeps a new per-rank layer + staging within one full layer + 10 %."""
    ids = ID_SETS["all"]
    head_layer = NB * BS * 2 * D * 2  # one head of one layer, whole pool
    _, b, res = emulate(km.migrate_kv, old, new, ids, "flash")
    a = RankView(old, L, H)
    plan = migration_plan(old, new, L, H)
    order = layer_order(old, new, L)
    for r in range(b.topo.world_size):
        held = {ly: a.heads_per_rank for ly in a.layers_of(r)} if r < old.world_size else {}
        base, cur, structural = sum(held.values()), sum(held.values()), 0
        for ly in order:
            if any(s.dst == r for s in plan if s.layer == ly):
                cur += b.heads_per_rank
            structural = max(structural, cur - base)
            cur -= held.pop(ly, 0)
        slack = 16 * kc._ALIGN  # buffer alignment
        stats = res[r][1]
        bound = (max(structural, b.heads_per_rank) - b.heads_per_rank + 1.1 * H) * head_layer
        assert stats.peak_extra_bytes <= bound + slack, (r, structural, stats.as_dict())


def test_unlimited_staging_is_one_round_and_default_bounds_it():
    plan = migration_plan(Topology(8, 1), Topology(1, 4), L, H)
    sl = [s for s in plan if s.layer == 0]
    bph = BS * 2 * D * 2
    layer_bytes = NB * H * bph
    steps = {kplan.chunk_blocks(r, sl, H, NB, layer_bytes, bph, "auto", NB)[0] for r in range(8)}
    assert len(steps) == 1  # every rank splits the layer the same way
    step = steps.pop()
    assert 1 <= step < NB  # the TP1 receiver has a whole new layer: staging only 10 % → rounds
    assert kplan.chunk_blocks(0, sl, H, NB, layer_bytes, bph, None, NB)[0] == NB
    # a split (TP1 → TP8) needs no rounds under the default bound
    plan = migration_plan(Topology(1, 4), Topology(8, 1), L, H)
    sl = [s for s in plan if s.layer == 0]
    assert {kplan.chunk_blocks(r, sl, 1, NB, layer_bytes, bph, "auto", NB)[0] for r in range(8)} == {NB}


def test_runs_of_consecutive_ids():
    ids = [3, 4, 5, 9, 10, 2, 7, 8, 8]
    starts = kcommon.run_starts(torch.tensor(ids))
    assert starts == [3, 5, 6, 8]
    r = kcommon.Runs(ids, starts, 0, len(ids))
    assert r.count == 5
    assert r.list() == [(0, 3, 3), (3, 9, 2), (5, 2, 1), (6, 7, 2), (8, 8, 1)]
    r = kcommon.Runs(ids, starts, 1, 4)  # a chunk cuts runs
    assert r.list() == [(0, 4, 2), (2, 9, 1)] and r.count == 2
    assert kcommon.Runs(ids, starts, 4, 4).count == 0
    assert kcommon.run_starts(torch.tensor([5])) == [] and kcommon.run_starts(torch.tensor([], dtype=torch.long)) == []


def test_widen_is_a_bit_exact_reinterpretation():
    x = global_kv()[0]  # [NB, H, BS, 2D] bf16
    st = x.reshape(NB, H, BS, 2, D).permute(3, 0, 2, 1, 4).contiguous()
    ex = st.permute(1, 3, 0, 2, 4)
    perm = kcommon.memory_order(ex)
    assert ex.permute(perm).is_contiguous()
    sv = kcommon.SliceView(ex, perm, 2, 3)
    assert sv.m.dtype == torch.complex128  # D = 8 bf16 = 16 bytes
    assert torch.equal(sv.m.contiguous().view(torch.int16), st[:, :, :, 2:5].contiguous().view(torch.int16))
    odd = torch.zeros(4, 3, dtype=DT)  # 6-byte rows: 2-byte elements at most
    assert kcommon.widen(odd).dtype == torch.int16 or kcommon.widen(odd).dtype == DT
    assert kcommon.widen(odd[:, 1:]).element_size() <= 4
