"""The KV executor's direct (single-pass, peer-access) path and ``dst_block_ids``, on CPU.

Ranks are threads over ``LocalTransport(direct=True)``: each receiver pulls its slices straight from
the source ranks' tensors (on CPU through torch ops; the Triton kernel's host-side tables are
checked here too, the kernel itself by ``bench/gpu_datapath.py`` on the GPU). Destinations are
poisoned with NaN, every element is compared bit for bit with the source, free blocks must stay
NaN, and the result must equal the staged executor's and the reference executor's.
"""

import itertools
import random
import threading
import weakref

import pytest
import torch

from node_agent.kv import common as kcommon
from node_agent.kv import executor_collective as kc
from node_agent.kv import executor_direct as kd
from node_agent.kv import migrate as km
from node_agent.kv import transport as kt
from remp.kvplan import RankView, layer_order, migration_plan
from remp.topology import Topology

L, H, NB, BS, D = 8, 8, 24, 2, 4  # layers, KV heads, pool blocks, block size, head size
DT = torch.bfloat16
WORLD4 = [Topology(1, 4), Topology(2, 2), Topology(4, 1)]
WORLD8 = [Topology(1, 8), Topology(2, 4), Topology(4, 2), Topology(8, 1)]
PAIRS = list(itertools.permutations(WORLD4, 2)) + list(itertools.permutations(WORLD8, 2)) + [
    (Topology(1, 1), Topology(8, 1)), (Topology(8, 1), Topology(1, 1)), (Topology(2, 1), Topology(1, 4))]
ODD_RUNS = [1, 2, 3, 7, 9, 10, 15, 16, 17, 18, 19, 23]  # runs of 3, 1, 2, 5 and 1 ids, gaps between
ID_SETS = {
    "odd_runs": ODD_RUNS,
    "unsorted": random.Random(11).sample(range(NB), 13),
    "one_run": list(range(4, 20)),
    "single": [NB - 1],
}


def global_kv(seed=1, nb=NB):
    """Random bit patterns (NaN payloads included): a copy that is not bit-exact shows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**15, 2**15, (L, nb, H, BS, 2 * D), generator=g, dtype=torch.int16).view(DT)


def to_layout(x, layout):
    """[nb, h, BS, 2D] block-first → the executor's view of that layout."""
    if layout == "flash":
        nb, h = x.shape[0], x.shape[1]
        st = x.reshape(nb, h, BS, 2, D).permute(3, 0, 2, 1, 4).contiguous()  # [2, nb, BS, h, D]
        return st.permute(1, 3, 0, 2, 4)  # [nb, h, 2, BS, D]
    return x.clone()


def alloc_for(layout, heads, nb=NB):
    def alloc(_layer):
        if layout == "flash":
            return torch.full((2, nb, BS, heads, D), float("nan"), dtype=DT).permute(1, 3, 0, 2, 4)
        return torch.full((nb, heads, BS, 2 * D), float("nan"), dtype=DT)
    return alloc


def emulate(fn, old, new, ids, layout, *, direct=False, new_nb=NB, on_alloc=None, **kw):
    G = global_kv()
    a, b = RankView(old, L, H), RankView(new, L, H)
    plan = migration_plan(old, new, L, H)
    world = max(old.world_size, new.world_size)
    hub = kt.LocalTransport(timeout_s=30, direct=direct)
    old_layers = {r: {} for r in range(world)}
    for r in range(old.world_size):
        hs = a.heads_of(r)
        old_layers[r] = {ly: to_layout(G[ly][:, hs.start:hs.stop], layout) for ly in a.layers_of(r)}
    res, errors = [None] * world, []

    def work(r):
        alloc = alloc_for(layout, b.heads_per_rank, new_nb)
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
    assert not hub._shared, "every shared layer reclaimed"
    return G, b, res, old_layers


def bits(t):
    return t.contiguous().view(torch.int16)


def check_exact(G, b, res, ids, layout, dst_ids=None, new_nb=NB):
    """Every element of every moved block equals the source's; every other block is still NaN."""
    dst_ids = list(ids) if dst_ids is None else list(dst_ids)
    live = set(dst_ids)
    dead = [i for i in range(new_nb) if i not in live]
    for r in range(b.topo.world_size):
        hs = b.heads_of(r)
        assert sorted(res[r][0]) == list(b.layers_of(r))
        for ly in b.layers_of(r):
            t = res[r][0][ly]
            assert t.shape[0] == new_nb
            want = to_layout(G[ly][:, hs.start:hs.stop], layout)
            for i, j in zip(ids, dst_ids):
                assert torch.equal(bits(t[j]), bits(want[i])), (r, ly, i, j)
            if dead:
                assert bool(t[dead].isnan().all()), (r, ly)  # free blocks never written


@pytest.mark.parametrize("layout", ["flash", "block"])
@pytest.mark.parametrize("old,new", PAIRS, ids=str)
def test_direct_exact_every_pair(old, new, layout):
    """Every ordered pair of the world-4 and world-8 sets (and some across world sizes), block ids
    in odd runs: exact, free blocks untouched, equal to the staged executor bit for bit."""
    ids = ID_SETS["odd_runs"]
    G, b, res, left = emulate(km.migrate_kv, old, new, ids, layout, direct=True)
    check_exact(G, b, res, ids, layout)
    assert all(not x for x in left.values())  # every old layer released
    for r in range(b.topo.world_size):
        assert res[r][1].path == "direct" and res[r][1].kernel == "torch"
    _, _, staged, _ = emulate(km.migrate_kv, old, new, ids, layout)
    for r in range(b.topo.world_size):
        assert staged[r][1].path == "staged"
        for ly, t in staged[r][0].items():
            assert torch.equal(bits(t), bits(res[r][0][ly]))  # dead blocks: NaN in both
    sent = sum(r[1].bytes_sent for r in res if r)
    assert sent == sum(r[1].bytes_received for r in res if r) == sum(r[1].bytes_sent for r in staged if r)
    assert sum(r[1].bytes_copied_locally for r in res if r) == sum(r[1].bytes_copied_locally for r in staged if r)


@pytest.mark.parametrize("max_runs", [0, 10**9])
@pytest.mark.parametrize("ids_name", list(ID_SETS))
def test_direct_both_torch_ways(monkeypatch, max_runs, ids_name):
    """One strided copy per joint run (single pass) and bounded index ops give the same bytes."""
    monkeypatch.setattr(kcommon, "RUN_COPY_MAX_RUNS", max_runs)
    ids = ID_SETS[ids_name]
    for layout in ("flash", "block"):
        for old, new in [(Topology(8, 1), Topology(1, 8)), (Topology(2, 2), Topology(4, 1))]:
            G, b, res, _ = emulate(km.migrate_kv, old, new, ids, layout, direct=True)
            check_exact(G, b, res, ids, layout)


def test_direct_peak_is_the_new_layer_alone():
    """No staging on the direct path: the extra memory is what the layer order itself holds
    (new layers allocated before old ones are released), never more than one layer + 10 %."""
    head_layer = NB * BS * 2 * D * 2  # one head of one layer, whole pool
    for old, new in itertools.permutations(WORLD8 + [Topology(1, 1)], 2):
        _, b, res, _ = emulate(km.migrate_kv, old, new, ID_SETS["odd_runs"], "flash", direct=True)
        a = RankView(old, L, H)
        plan = migration_plan(old, new, L, H)
        for r in range(b.topo.world_size):
            held = {ly: a.heads_per_rank for ly in a.layers_of(r)} if r < old.world_size else {}
            base = cur = sum(held.values())
            structural = 0
            for ly in layer_order(old, new, L):
                if any(s.dst == r for s in plan if s.layer == ly):
                    cur += b.heads_per_rank
                structural = max(structural, cur - base)
                cur -= held.pop(ly, 0)
            assert res[r][1].peak_extra_bytes == structural * head_layer, (old, new, r)


def test_direct_old_layer_released_before_the_next_is_allocated():
    def on_alloc(rank, old_layers, alloc):
        refs = {ly: weakref.ref(t) for ly, t in old_layers.items()}

        def wrapped(layer):
            import gc
            for ly in list(refs):
                if ly not in old_layers and refs[ly]() is not None:
                    gc.collect()
                    assert refs[ly]() is None, f"rank {rank}: old layer {ly} still alive at layer {layer}"
            return alloc(layer)
        return wrapped

    for old, new in [(Topology(8, 1), Topology(1, 8)), (Topology(1, 8), Topology(2, 4)), (Topology(4, 1), Topology(1, 4))]:
        emulate(km.migrate_kv, old, new, ID_SETS["odd_runs"], "flash", direct=True, on_alloc=on_alloc)


def test_direct_injected_fault_and_path_choice():
    old, new = Topology(2, 2), Topology(4, 1)
    a, b = RankView(old, L, H), RankView(new, L, H)
    plan = migration_plan(old, new, L, H)
    hub = kt.LocalTransport(timeout_s=30, direct=True)
    G = global_kv()
    results, errors = {}, []

    def work(r):
        hs = a.heads_of(r)
        mine = {ly: to_layout(G[ly][:, hs.start:hs.stop], "flash") for ly in a.layers_of(r)}
        built: dict = {}
        try:
            km.migrate_kv(r, mine, a, b, plan, torch.tensor(ODD_RUNS), alloc_for("flash", b.heads_per_rank),
                          hub.endpoint(r), fail_after_layers=3, new_layers=built)
        except kcommon.InjectedFault:
            results[r] = (sorted(built), sorted(mine))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    assert not hub._shared
    for r, (built, left) in results.items():
        assert len(left) == L // 2 - sum(1 for ly in layer_order(old, new, L)[:3] if ly in a.layers_of(r))
    with pytest.raises(ValueError, match="peer access"):
        km.migrate_kv(0, {}, a, b, plan, torch.tensor([1]), alloc_for("flash", 2),
                      kt.LocalTransport().endpoint(0), path="direct")
    with pytest.raises(ValueError, match="path"):
        km.migrate_kv(0, {}, a, b, plan, torch.tensor([1]), alloc_for("flash", 2),
                      kt.LocalTransport().endpoint(0), path="fast")
    # path="staged" on a transport with peer access: the staged executor
    ids = ID_SETS["odd_runs"]
    G, b, res, _ = emulate(km.migrate_kv, old, new, ids, "flash", direct=True, path="staged")
    check_exact(G, b, res, ids, "flash")
    assert {res[r][1].path for r in range(4)} == {"staged"}


# ------------------------------------------------------------------ dst_block_ids


def compacted(ids, seed):
    """The live ids mapped onto a compacted pool of len(ids) + 2 blocks, in a scrambled order."""
    new_nb = len(ids) + 2
    dst = random.Random(seed).sample(range(new_nb), len(ids))
    return dst, new_nb


@pytest.mark.parametrize("mode", ["direct", "staged", "reference"])
@pytest.mark.parametrize("layout", ["flash", "block"])
def test_dst_block_ids_into_a_smaller_pool(mode, layout):
    """Block ids[i] of the old pool lands in block dst[i] of a new pool with fewer blocks."""
    fn = kc.migrate_kv_reference if mode == "reference" else km.migrate_kv
    for n, (old, new) in enumerate(PAIRS[::2]):
        for ids_name in ("odd_runs", "unsorted", "one_run"):
            ids = ID_SETS[ids_name]
            dst, new_nb = compacted(ids, n)
            assert new_nb < NB
            kw = {"dst_block_ids": torch.tensor(dst)}
            if mode == "staged":
                kw["staging_limit_bytes"] = [None, "auto", 300][n % 3]
            G, b, res, left = emulate(fn, old, new, ids, layout, direct=mode == "direct", new_nb=new_nb, **kw)
            check_exact(G, b, res, ids, layout, dst_ids=dst, new_nb=new_nb)
            assert all(not x for x in left.values())


@pytest.mark.parametrize("max_runs", [0, 10**9])
def test_dst_block_ids_runs_and_identity(monkeypatch, max_runs):
    """Joint runs (both id lists consecutive) copied per run or by index ops alike; an identity
    mapping is the default behaviour; a shift keeps runs whole."""
    monkeypatch.setattr(kcommon, "RUN_COPY_MAX_RUNS", max_runs)
    ids = ODD_RUNS
    for dst in ([i - 1 for i in ids], list(range(len(ids))), list(ids)):
        for direct in (True, False):
            G, b, res, _ = emulate(km.migrate_kv, Topology(2, 4), Topology(4, 2), ids, "flash", direct=direct,
                                   new_nb=NB, dst_block_ids=torch.tensor(dst))
            check_exact(G, b, res, ids, "flash", dst_ids=dst)


def test_dst_block_ids_validation():
    a, b = RankView(Topology(1, 1), L, H), RankView(Topology(1, 1), L, H)
    plan = migration_plan(Topology(1, 1), Topology(1, 1), L, H)
    old = {ly: to_layout(global_kv()[ly], "flash") for ly in range(L)}
    ep = kt.LocalTransport().endpoint(0)
    with pytest.raises(ValueError, match="distinct"):
        km.migrate_kv(0, dict(old), a, b, plan, torch.tensor([1, 2]), alloc_for("flash", H), ep,
                      dst_block_ids=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="ids"):
        km.migrate_kv(0, dict(old), a, b, plan, torch.tensor([1, 2]), alloc_for("flash", H), ep,
                      dst_block_ids=torch.tensor([0]))
    with pytest.raises(ValueError, match="new pool"):
        km.migrate_kv(0, dict(old), a, b, plan, torch.tensor([1, 2]), alloc_for("flash", H, nb=4), ep,
                      dst_block_ids=torch.tensor([0, 9]))


def test_joint_runs():
    ids, dst = [3, 4, 5, 9, 10, 11], [0, 1, 7, 8, 9, 2]
    im = kcommon.IdMap(torch.tensor(ids), torch.tensor(dst))
    (rnd,) = im.rounds(torch.device("cpu"), 6)
    assert rnd.runs.count == 2 and rnd.druns.count == 3
    assert rnd.jruns.pairs() == [(0, 3, 0, 2), (2, 5, 7, 1), (3, 9, 8, 2), (5, 11, 2, 1)]
    same = kcommon.IdMap(torch.tensor(ids), torch.tensor(ids))
    assert same.same and same.rounds(torch.device("cpu"), 4)[1].dcids is same.rounds(torch.device("cpu"), 4)[1].cids


# ------------------------------------------------------------------ the Triton path's host side


def test_pull_plan_tables_for_both_layouts():
    """Rows as the Triton kernel sees them: flash layout = 2 × block size rows of heads × head
    size contiguous elements (offsets from the strides), block-first layout = one row."""
    src = to_layout(global_kv()[0], "flash")                                  # [NB, 8, 2, BS, D]
    dst = alloc_for("flash", 2)(0)                                            # [NB, 2, 2, BS, D]
    w, so, do = kd._rows(src, dst, 2)
    assert w == 2 * D and so.numel() == do.numel() == 2 * BS
    st, dt = src.permute(2, 0, 3, 1, 4), dst.permute(2, 0, 3, 1, 4)  # back to [2, NB, BS, h, D]
    assert sorted(so.tolist()) == sorted(k * st.stride(0) + t * st.stride(2) for k in range(2) for t in range(BS))
    assert sorted(do.tolist()) == sorted(k * dt.stride(0) + t * dt.stride(2) for k in range(2) for t in range(BS))
    w, so, do = kd._rows(to_layout(global_kv()[0], "block"), alloc_for("block", 4)(0), 4)
    assert w == 4 * BS * 2 * D and so.tolist() == do.tolist() == [0]
    big_s = torch.empty(2, 64, 16, 40, 128, dtype=DT).permute(1, 3, 0, 2, 4)  # 13B-shaped, TP1
    big_d = torch.empty(2, 64, 16, 5, 128, dtype=DT).permute(1, 3, 0, 2, 4)   # TP8 rank
    plan = kd._PullPlan([(0, big_s, 5, 0, 5)], big_d)
    assert plan.meta["VEC"] == 8 and plan.meta["CB"] == 128 and plan.meta["RB"] == 32  # 16-byte vectors
    row = plan.tab[0].tolist()
    assert row[:6] == [0, 5 * 128, 0, big_s.stride(0), big_d.stride(0), 5 * 128] and row[6] == 32
    # each row: the kernel's address arithmetic reaches exactly the slice's elements
    ref = big_s[:, 5:10]
    for r in (0, 7, 31):
        k, t = divmod(r, 16)
        off = row[1] + 3 * row[3] + plan.roff_s[r].item()
        assert off == (ref[3, :, k, t].reshape(-1).data_ptr() - big_s.data_ptr()) // 2
    with pytest.raises(kd._Unsuited):  # 2-byte rows: not worth a kernel (torch ops instead)
        kd._PullPlan([(0, torch.empty(4, 2, 3, dtype=DT).permute(0, 2, 1), 0, 0, 1)],
                     torch.empty(4, 1, 3, dtype=DT).permute(0, 2, 1))
