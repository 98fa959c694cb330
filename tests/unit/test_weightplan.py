"""remp.weightplan: every new shard reassembled from the planned slices is bit-exact.

Each checkpoint tensor is filled with its global element indices (unique over the whole model);
the old shards are cut from it, the plan is executed into NaN-like poisoned new shards (-1), and
the result is compared with the new shards cut from the full tensors directly. The tiny model is
checked at its real shapes; the Llama-2 shapes with the dimension the plan never cuts (the other
dimension of every 2-D weight) reduced to ``cross`` elements, which every move copies whole."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remp.topology import ModelShape, Topology, candidate_topologies
from remp.weightplan import (LLAMA2_7B, LLAMA2_13B, LLAMA2_70B, TINY, WeightShape, plan_weights,
                             same_host, shard)


def model_shape(s: WeightShape) -> ModelShape:
    return ModelShape(s.num_layers, s.num_attention_heads, s.num_kv_heads, s.hidden_size,
                      s.head_dim)


def topos_at(s: WeightShape, worlds=(1, 2, 4, 8)) -> list[Topology]:
    return [t for t in candidate_topologies(model_shape(s), max(worlds)) if t.world_size in worlds]


class Full:
    """The full checkpoint as int32 arrays of global indices; ``cross`` replaces the uncut
    dimension of the 2-D weights (None: real shapes)."""

    def __init__(self, s: WeightShape, cross: int | None = None):
        self.s, self.cross = s, cross
        self.t: dict[str, np.ndarray] = {}
        self._cuts: dict[tuple[Topology, int], dict[str, np.ndarray]] = {}
        base = 0
        for key, shape in s.checkpoint().items():
            shape = self._shape(key, shape)
            n = int(np.prod(shape))
            self.t[key] = np.arange(base, base + n, dtype=np.int32).reshape(shape)
            base += n

    def _shape(self, key: str, shape: tuple) -> tuple:
        if self.cross is None or len(shape) == 1:
            return shape
        split = 1 if key.endswith(("o_proj.weight", "down_proj.weight")) else 0
        out = list(shape)
        out[1 - split] = self.cross
        return tuple(out)

    def param_shape(self, name: str, shape: tuple) -> tuple:
        return self._shape(name, shape)

    def cut(self, topo: Topology, rank: int) -> dict[str, np.ndarray]:
        """A rank's shard cut from the full tensors (padding zero; cached, read-only)."""
        if (topo, rank) not in self._cuts:
            self._cuts[(topo, rank)] = self._cut(topo, rank)
        return self._cuts[(topo, rank)]

    def _cut(self, topo: Topology, rank: int) -> dict[str, np.ndarray]:
        params, pieces = shard(self.s, topo, rank)
        out = {n: np.full(self.param_shape(n, sh), -1, dtype=np.int32) for n, sh in params.items()}
        for p in pieces:
            dst = out[p.param]
            if p.dim is None:
                dst[...] = self.t[p.key]
                continue
            sl = [slice(None)] * 2
            sl[p.dim] = slice(p.param_start, p.param_start + p.length)
            if p.key is None:
                dst[tuple(sl)] = 0
            else:
                src = [slice(None)] * 2
                src[p.dim] = slice(p.key_start, p.end)
                dst[tuple(sl)] = self.t[p.key][tuple(src)]
        return out


def _sl(dim, start, length):
    if dim is None:
        return (Ellipsis,)
    s = [slice(None)] * 2
    s[dim] = slice(start, start + length)
    return tuple(s)


def execute(full: Full, plan, old_shards: list[dict]) -> list[dict]:
    new = [{n: np.full(full.param_shape(n, sh), -1, dtype=np.int32)
            for n, sh in plan.new_params[r].items()} for r in range(plan.new.world_size)]
    for m in plan.moves:
        dst = new[m.dst][m.param]
        ds = _sl(m.dim, m.dst_start, m.length)
        if m.kind == "zero":
            dst[ds] = 0
        elif m.kind == "store":
            dst[ds] = full.t[m.key][_sl(m.dim, m.key_start, m.length)]
        else:
            dst[ds] = old_shards[m.src][m.src_param][_sl(m.dim, m.src_start, m.length)]
    return new


def check_pair(full: Full, old: Topology, new: Topology, **kw):
    plan = plan_weights(full.s, old, new, **kw)
    old_shards = [full.cut(old, r) for r in range(old.world_size)]
    got = execute(full, plan, old_shards)
    for r in range(new.world_size):
        want = full.cut(new, r)
        assert got[r].keys() == want.keys()
        for name in want:
            assert (got[r][name] >= 0).all(), f"{old}->{new} rank {r} {name}: unwritten"
            assert np.array_equal(got[r][name], want[name]), f"{old}->{new} rank {r} {name}"
    # byte accounting: the moves write each new shard exactly once
    for r in range(new.world_size):
        assert sum(m.nbytes for m in plan.for_rank(r)) == plan.shard_bytes(r)
    k = plan.bytes_by_kind()
    assert sum(plan.pair_bytes().values()) + k["zero"] == sum(
        plan.shard_bytes(r) for r in range(new.world_size))
    assert sum(plan.receive_bytes().values()) == k["peer"] + k["store"]
    assert sum(plan.send_bytes().values()) == k["peer"]
    return plan


TINY_TOPOS = topos_at(TINY)


def test_tiny_candidates_are_the_expected_set():
    assert {str(t) for t in TINY_TOPOS} == {"TP1PP1", "TP2PP1", "TP1PP2", "TP4PP1", "TP2PP2",
                                            "TP1PP4", "TP4PP2", "TP2PP4"}


def test_tiny_every_ordered_pair_bit_exact_at_real_shapes():
    full = Full(TINY)
    for old, new in itertools.product(TINY_TOPOS, TINY_TOPOS):
        plan = check_pair(full, old, new)
        assert plan.bytes_by_kind()["store"] == 0  # every old rank reachable: never the store
        if old == new:
            assert plan.bytes_by_kind()["peer"] == 0


@pytest.mark.parametrize("shape", [LLAMA2_7B, LLAMA2_13B, LLAMA2_70B], ids=["7b", "13b", "70b"])
def test_llama_every_ordered_pair_bit_exact(shape):
    full = Full(shape, cross=1)
    topos = topos_at(shape)
    assert len(topos) == 10
    for old, new in itertools.product(topos, topos):
        plan = check_pair(full, old, new)
        s = plan.summary()
        assert s["store_bytes"] == 0
        if old.world_size == new.world_size:
            assert all(v == 0 for v in s["store_bytes_per_rank"].values())


def test_llama_byte_totals_at_real_shapes():
    """Real byte counts (hidden not reduced): 7B TP8→TP4PP2 moves the whole checkpoint once."""
    plan = plan_weights(LLAMA2_7B, Topology(8, 1), Topology(4, 2))
    s = plan.summary()
    # the whole checkpoint once, the replicated norms once per TP rank
    assert s["local_bytes"] + s["peer_bytes"] == sum(plan.shard_bytes(r) for r in range(8))
    norms = (2 * 32 + 1) * 4096 * 2
    assert sum(plan.shard_bytes(r) for r in range(8)) == LLAMA2_7B.checkpoint_bytes() + 3 * norms
    assert s["store_bytes"] == 0 and s["zero_bytes"] == 0
    assert s["max_receive_bytes"] <= s["new_shard_bytes_max"]
    same = plan_weights(LLAMA2_70B, Topology(2, 4), Topology(2, 4)).summary()
    assert same["peer_bytes"] == 0 and same["store_bytes"] == 0
    assert same["local_bytes"] == LLAMA2_70B.checkpoint_bytes() + (2 * 80 + 1) * 8192 * 2
    assert same["max_receive_bytes"] == 0


def test_agrees_with_the_loaders_pieces():
    """The layout is the one the project's shard loader (vLLM's merged parameters) uses."""
    from node_agent.weight_store import llama_shard_pieces

    for s in (TINY, LLAMA2_7B, LLAMA2_70B):
        for topo in topos_at(s):
            for rank in range(topo.world_size):
                params, pieces = shard(s, topo, rank)
                lp, lpieces = llama_shard_pieces(s.hf(), topo.tp, topo.pp, rank)
                assert params == lp
                mine = {(p.key, p.dim, p.key_start, p.length, p.param,
                         p.param_start if p.dim == 0 else 0) for p in pieces}
                theirs = {(q.key, q.dim, q.start, q.length, q.param, q.row) for q in lpieces}
                assert mine == theirs


def test_vocab_padding_is_zero_filled():
    s = WeightShape(2, 64, 4, 4, 128, 1000)  # 1000 → padded 1024
    full = Full(s)
    for old, new in [(Topology(1, 1), Topology(4, 1)), (Topology(4, 1), Topology(2, 2)),
                     (Topology(2, 1), Topology(1, 2))]:
        plan = check_pair(full, old, new)
        assert plan.bytes_by_kind()["zero"] > 0  # rows 1000..1023 of the last TP rank


def test_cold_host_reads_the_store():
    """Ranks 4 per host: TP4PP1 → TP8PP1 wakes ranks 4–7 on a host with no old rank, so their
    whole shards come from that host's store; ranks 0–3 get theirs from peers and themselves."""
    plan = check_pair(Full(TINY), Topology(4, 1), Topology(4, 2), reachable=same_host(4))
    store = plan.store_bytes()
    for r in range(4):
        assert store[r] == 0
    for r in range(4, 8):
        assert store[r] == plan.shard_bytes(r)
    # same world size over four hosts of 2: each rank reads from the store what its host lacks
    # (new rank 1 = layer 0, heads 4-7: old ranks 2, 3, on the second host)
    plan = check_pair(Full(TINY), Topology(4, 2), Topology(2, 4), reachable=same_host(2))
    assert plan.store_bytes()[0] == 0 and plan.store_bytes()[1] > 0
    assert all(m.src is None or m.src // 2 == m.dst // 2 for m in plan.moves)
    # with 4 a host the same pair stays inside each host: nothing from the store
    plan = check_pair(Full(TINY), Topology(4, 2), Topology(2, 4), reachable=same_host(4))
    assert plan.bytes_by_kind()["store"] == 0


def test_lost_rank_is_read_from_the_store():
    plan = check_pair(Full(TINY), Topology(2, 2), Topology(2, 2), reachable=lambda s, d: s != 3)
    into3 = plan.for_rank(3)
    # rank 3's slices are held by nobody else, but for the norms rank 2 also holds (replicated)
    assert all(m.kind == "store" or (m.src == 2 and m.param.endswith("norm.weight"))
               for m in into3)
    assert plan.store_bytes()[3] == sum(m.nbytes for m in into3 if m.kind == "store") > 0
    assert all(plan.store_bytes()[r] == 0 for r in range(3))


def test_replicated_norms_prefer_the_rank_itself():
    plan = plan_weights(TINY, Topology(2, 2), Topology(4, 1))
    for m in plan.moves:
        if m.param.endswith("layernorm.weight") and m.kind != "local":
            held = {r for r in range(4) if m.param in shard(TINY, Topology(2, 2), r)[0]}
            assert m.dst not in held


def test_invalid_topology_rejected():
    with pytest.raises(ValueError):
        plan_weights(TINY, Topology(8, 1), Topology(1, 1))
    with pytest.raises(ValueError):
        shard(TINY, Topology(1, 5), 0)  # more stages than layers


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_shapes_bit_exact(data):
    kv = data.draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv * data.draw(st.sampled_from([1, 2]))
    hd = data.draw(st.sampled_from([2, 4]))
    layers = data.draw(st.sampled_from([1, 2, 4, 8]))
    s = WeightShape(layers, heads * hd, heads, kv, data.draw(st.sampled_from([8, 16, 24])),
                    data.draw(st.integers(8, 200)), dtype=data.draw(st.sampled_from(
                        ["bfloat16", "float32"])), vocab_padding=8)
    tps = [t for t in (1, 2, 4, 8) if kv % t == 0 and s.intermediate_size % t == 0]
    pps = [p for p in (1, 2, 4, 8) if layers % p == 0]
    pick = st.tuples(st.sampled_from(tps), st.sampled_from(pps)).filter(lambda x: x[0] * x[1] <= 8)
    a, b = Topology(*data.draw(pick)), Topology(*data.draw(pick))
    gph = data.draw(st.sampled_from([None, 1, 2, 4]))
    plan = check_pair(Full(s), a, b, reachable=None if gph is None else same_host(gph))
    if gph is None:
        assert plan.bytes_by_kind()["store"] == 0


def test_bench_smoke_runs_on_cpu(tmp_path):
    """bench/weight_reshard.py's CPU path (one pair): the plan executed, checked, timed."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from bench import weight_reshard

    rc = weight_reshard.main(["--smoke", "--pairs", "TP8PP1->TP4PP2,TP4PP1->TP8PP1",
                              "--out", str(tmp_path), "--store-root", str(tmp_path), "--tag", "t"])
    rep = json.loads((tmp_path / "weight_reshard_t.json").read_text())
    assert rc == 0 and rep["all_ok"] and not rep["errors"]
    assert all(p["plan"]["store_bytes"] == 0 for m in rep["models"].values() for p in m["pairs"])
    assert (tmp_path / "weight_reshard_t.md").read_text().startswith("# Peer-to-peer")


UNEVEN = WeightShape(10, 256, 8, 4, 512, 2048)  # 10 layers: PP3 [3, 4, 3], PP4 [2, 3, 3, 2], PP7
UNEVEN_TOPOS = [Topology(1, 3), Topology(2, 3), Topology(1, 4), Topology(2, 2), Topology(1, 7),
                Topology(4, 2), Topology(1, 1)]


def test_uneven_stages_every_ordered_pair_bit_exact():
    """PP that does not divide the layers (vLLM's layout: remp.topology.stage_layers): every
    pair among uneven and even layouts moves each new shard's bytes exactly once, bit exact."""
    full = Full(UNEVEN)
    for old, new in itertools.product(UNEVEN_TOPOS, UNEVEN_TOPOS):
        plan = check_pair(full, old, new)
        assert plan.bytes_by_kind()["store"] == 0
    params, _ = shard(UNEVEN, Topology(1, 3), 1)
    assert sorted({int(n.split(".")[2]) for n in params if n.startswith("model.layers.")}) == [
        3, 4, 5, 6]
