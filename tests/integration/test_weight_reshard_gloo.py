"""Peer-to-peer weight resharding across real processes over gloo (the CPU transport remp uses):
every ordered pair of the candidate topologies of worlds 1 to 4 (TP1PP3 with uneven stages of 1, 2
and 1 layers), each new shard bit-exact against the host store's bytes, none of them read from
the store."""

from __future__ import annotations

import itertools
import os

import torch.distributed as dist
import torch.multiprocessing as mp

from node_agent.kv.transport import TorchDistTransport
from node_agent.weight_reshard import check, execute, verify
from remp.weightplan import WeightShape, plan_weights
from tests.helpers import free_port
from tests.reshard_cases import checkpoint, cut, empty_shard, topologies

SHAPES = {"float32": WeightShape(4, 256, 8, 4, 512, 2000, dtype="float32"),
          "bfloat16": WeightShape(4, 256, 8, 4, 512, 2000, dtype="bfloat16")}


def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = []
        for dtype, shape in SHAPES.items():
            full = checkpoint(shape)  # the same seed on every rank: the host store
            topos = topologies(shape, world)
            for old, new in itertools.product(topos, topos):
                plan = plan_weights(shape, old, new)
                mine = cut(shape, full, old, rank) if rank < old.world_size else None
                fresh = empty_shard(shape, new, rank) if rank < new.world_size else None
                check(plan, rank, mine, fresh)
                st = execute(plan, rank, mine, fresh, TorchDistTransport(None),
                             store=full.__getitem__)
                ok = fresh is None or verify(shape, new, rank, fresh, full.__getitem__) \
                    == plan.shard_bytes(rank)
                out.append((dtype, str(old), str(new), bool(ok), st.as_dict()))
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def run(world):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return got


def _check(world, pairs):
    got = run(world)
    rows = list(zip(*(got[r] for r in range(world))))
    assert len(rows) == 2 * pairs
    for per_rank in rows:
        dtype, old, new = per_rank[0][:3]
        assert all(x[3] for x in per_rank), f"{dtype} {old}->{new}: a shard differs"
        stats = [x[4] for x in per_rank]
        assert sum(s["store_bytes"] for s in stats) == 0, f"{old}->{new} read the store"
        assert sum(s["peer_sent_bytes"] for s in stats) == sum(s["peer_recv_bytes"] for s in stats)
        if old == new:
            assert sum(s["peer_recv_bytes"] for s in stats) == 0
    return rows


def test_world_4_every_ordered_pair():
    # the 7 candidates of worlds 1-4 (TP1PP3: 4 layers as 1/2/1): smaller worlds run with the
    # other ranks idle (a real world-2 engine reshards in tests/e2e/test_switch_e2e.py and
    # test_world_change_e2e.py, a world-3 one in test_switch_world3.py)
    rows = _check(4, 49)
    moved = {(r[0][1], r[0][2]): sum(x[4]["peer_recv_bytes"] for x in r) for r in rows
             if r[0][0] == "float32"}
    assert moved[("TP4PP1", "TP1PP4")] > 0 and moved[("TP1PP1", "TP4PP1")] > 0
    assert moved[("TP1PP4", "TP1PP3")] > 0 and moved[("TP1PP3", "TP2PP2")] > 0
