"""Shared by the weight-resharding tests: a random checkpoint and the shards cut from it."""

from __future__ import annotations

import threading

import torch

from remp.topology import ModelShape, Topology, candidate_topologies
from remp.weightplan import WeightShape, shard

# the tiny model with a vocabulary that leaves padding at TP 4 (2000 → 2048 padded: 512 a rank)
PADDED = WeightShape(4, 256, 8, 4, 512, 2000, dtype="float32")
TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def topologies(shape: WeightShape, max_world: int) -> list[Topology]:
    ms = ModelShape(shape.num_layers, shape.num_attention_heads, shape.num_kv_heads,
                    shape.hidden_size, shape.head_dim)
    return [t for t in candidate_topologies(ms, max_world) if t.world_size <= max_world]


def checkpoint(shape: WeightShape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(TORCH_DTYPE[shape.dtype])
            for k, s in shape.checkpoint().items()}


def cut(shape: WeightShape, full: dict[str, torch.Tensor], topo: Topology, rank: int
        ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shard of ``topo`` as the host store would give it (padding zero)."""
    params, pieces = shard(shape, topo, rank)
    out = {n: torch.full(s, float("nan"), dtype=TORCH_DTYPE[shape.dtype])
           for n, s in params.items()}
    for p in pieces:
        dst = out[p.param] if p.dim is None else out[p.param].narrow(p.dim, p.param_start, p.length)
        if p.key is None:
            dst.zero_()
        else:
            src = full[p.key] if p.dim is None else full[p.key].narrow(p.dim, p.key_start, p.length)
            dst.copy_(src)
    return out


def empty_shard(shape: WeightShape, topo: Topology, rank: int) -> dict[str, torch.Tensor]:
    params, _ = shard(shape, topo, rank)
    return {n: torch.full(s, float("nan"), dtype=TORCH_DTYPE[shape.dtype])
            for n, s in params.items()}


def on_threads(world: int, fn, timeout: float = 60) -> dict:
    """Run ``fn(rank)`` for every rank on its own thread; rank → its result or its exception."""
    out: dict = {}

    def one(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 - returned to the caller
            out[r] = exc

    ts = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    assert not any(t.is_alive() for t in ts), "a rank is still running"
    return out
