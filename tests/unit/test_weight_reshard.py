"""node_agent.weight_reshard: the executor builds every new shard bit for bit from the old ones
(ranks as threads over LocalTransport here; real processes over gloo in
tests/integration/test_weight_reshard_gloo.py), and ``verify`` catches a single flipped bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from node_agent.kv.transport import LocalTransport
from node_agent.weight_reshard import ReshardError, WeightMismatch, check, execute, verify
from remp.topology import Topology
from remp.weightplan import WeightShape, plan_weights, same_host
from tests.reshard_cases import PADDED, checkpoint, cut, empty_shard, on_threads, topologies


def run_pair(shape: WeightShape, full, old: Topology, new: Topology, **kw):
    plan = plan_weights(shape, old, new, **kw)
    world = max(old.world_size, new.world_size)
    olds = [cut(shape, full, old, r) if r < old.world_size else None for r in range(world)]
    news = [empty_shard(shape, new, r) if r < new.world_size else None for r in range(world)]
    hub = LocalTransport(timeout_s=30)

    def rank(r):
        check(plan, r, olds[r], news[r])
        return execute(plan, r, olds[r], news[r], hub.endpoint(r), store=full.__getitem__)

    out = on_threads(world, rank)
    errors = [x for x in out.values() if isinstance(x, BaseException)]
    assert not errors, errors
    stats = [out[r] for r in range(world)]
    for r in range(new.world_size):
        assert verify(shape, new, r, news[r], full.__getitem__) == plan.shard_bytes(r)
    return plan, stats


@pytest.mark.parametrize("shape", [PADDED, WeightShape(4, 256, 8, 4, 512, 2000, dtype="bfloat16")],
                         ids=["fp32", "bf16"])
def test_every_ordered_pair_up_to_world_4_is_bit_exact_without_the_store(shape):
    full = checkpoint(shape)
    topos = topologies(shape, 4)
    assert len(topos) == 7  # TP1PP3 included: uneven stages [1, 2, 1]
    for old, new in itertools.product(topos, topos):
        plan, stats = run_pair(shape, full, old, new)
        assert sum(s.store_bytes for s in stats) == 0
        moved = sum(s.local_bytes + s.peer_recv_bytes + s.zero_bytes for s in stats)
        assert moved == sum(plan.shard_bytes(r) for r in range(new.world_size))
        assert sum(s.peer_sent_bytes for s in stats) == sum(s.peer_recv_bytes for s in stats)
        if old == new:
            assert sum(s.peer_recv_bytes for s in stats) == 0


def test_unreachable_ranks_read_only_what_they_lack_from_the_store():
    full = checkpoint(PADDED)
    # two hosts of 2: TP2PP1 on host 0 grows to TP4PP1; ranks 2 and 3 (host 1) reach no old rank
    plan, stats = run_pair(PADDED, full, Topology(2, 1), Topology(4, 1), reachable=same_host(2))
    assert stats[0].store_bytes == stats[1].store_bytes == 0
    assert stats[2].store_bytes == plan.shard_bytes(2) - stats[2].zero_bytes
    assert stats[3].store_bytes > 0


def test_verify_names_the_first_flipped_bit():
    full = checkpoint(PADDED)
    topo = Topology(2, 2)
    shard = cut(PADDED, full, topo, 3)
    assert verify(PADDED, topo, 3, shard, full.__getitem__) > 0
    name = "model.layers.2.self_attn.o_proj.weight"
    shard[name].view(torch.int32)[5, 7] ^= 1
    with pytest.raises(WeightMismatch, match="o_proj.*differs"):
        verify(PADDED, topo, 3, shard, full.__getitem__)
    shard = cut(PADDED, full, Topology(4, 1), 3)
    shard["lm_head.weight"][-1, 0] = 1.0  # padding row not zero
    with pytest.raises(WeightMismatch, match="padding"):
        verify(PADDED, Topology(4, 1), 3, shard, full.__getitem__)
    shard.pop("model.norm.weight")
    with pytest.raises(WeightMismatch, match="model.norm.weight"):
        verify(PADDED, Topology(4, 1), 3, shard, full.__getitem__)


def test_check_refuses_a_shard_that_lost_its_weights():
    # vLLM on CPU replaces each linear layer's weight with an empty tensor after packing it
    full = checkpoint(PADDED)
    plan = plan_weights(PADDED, Topology(2, 1), Topology(1, 2))
    old = cut(PADDED, full, Topology(2, 1), 1)
    old["model.layers.0.mlp.down_proj.weight"] = torch.empty(0)
    with pytest.raises(ValueError, match="down_proj.*too small"):
        check(plan, 1, old, None)
    with pytest.raises(ValueError, match="new shard has no parameter"):
        check(plan, 0, cut(PADDED, full, Topology(2, 1), 0), {})


def test_a_rank_that_fails_a_move_still_serves_its_peers_then_raises():
    # rank 1 lost a parameter it must send: rank 0 still completes (zeros where it was) and
    # rank 1 raises after the exchange, instead of leaving rank 0 waiting for a send
    full = checkpoint(PADDED)
    old_t, new_t = Topology(2, 1), Topology(1, 2)
    plan = plan_weights(PADDED, old_t, new_t)
    olds = [cut(PADDED, full, old_t, r) for r in range(2)]
    gone = "model.layers.0.mlp.down_proj.weight"
    olds[1][gone] = torch.empty(0)
    news = [empty_shard(PADDED, new_t, r) for r in range(2)]
    hub = LocalTransport(timeout_s=20)
    out = on_threads(2, lambda r: execute(plan, r, olds[r], news[r], hub.endpoint(r),
                                          store=full.__getitem__), timeout=30)
    assert isinstance(out[1], ReshardError) and "down_proj" in str(out[1])
    assert not isinstance(out[0], Exception)
    with pytest.raises(WeightMismatch, match="down_proj"):
        verify(PADDED, new_t, 0, news[0], full.__getitem__)


def test_parameters_that_require_grad_are_filled():
    # nn.Parameter defaults to requires_grad=True (vLLM's norms): in-place copies need no_grad
    full = checkpoint(PADDED)
    topo = Topology(1, 1)
    plan = plan_weights(PADDED, topo, topo)
    new = {n: torch.nn.Parameter(t) for n, t in empty_shard(PADDED, topo, 0).items()}
    execute(plan, 0, cut(PADDED, full, topo, 0), new, LocalTransport().endpoint(0),
            store=full.__getitem__)
    assert verify(PADDED, topo, 0, new, full.__getitem__) == plan.shard_bytes(0)
