"""This rank's share of a migration plan (:func:`remp.kvplan.migration_plan`): which layers it
works on, in which order, and how each layer's blocks are split into staging rounds."""

from __future__ import annotations

import torch

from node_agent.kv import common
from remp.kvplan import RankView, Slice, layer_order


def layers_todo(plan: list[Slice], old_view: RankView, new_view: RankView,
                layers: list[int] | None) -> tuple[dict[int, list[Slice]], list[int]]:
    """The plan's slices by global layer, and the layers to move (all the plan's, or only
    ``layers``: a rollback) in :func:`remp.kvplan.layer_order` — the same on every rank."""
    by_layer: dict[int, list[Slice]] = {}
    for s in plan:
        by_layer.setdefault(s.layer, []).append(s)
    order = layer_order(old_view.topo, new_view.topo, old_view.num_layers)
    wanted = set(by_layer) if layers is None else set(layers)
    return by_layer, [ly for ly in order if ly in wanted]


def chunk_blocks(rank: int, slices: list[Slice], new_heads_per_rank: int, num_blocks: int,
                  layer_bytes: int, per_block_head: int, limit: int | str | None,
                  n_ids: int) -> tuple[int, int, bool]:
    """(blocks per round of the remote slices, blocks per piece of this rank's local copies,
    whether the local copies run beside the first round in flight or after it).

    The round size depends only on the layer's plan and shape, so every rank splits the same way
    and sends pair with receives round by round. ``None``: one round. An int: the rank staging
    the most remote heads stays under it. ``"auto"``: every rank's extra memory stays under one
    full layer + :data:`~node_agent.kv.common.STAGING_FRACTION` — its new per-rank layer (if it
    gets one) plus its
    staging — so layers that split across ranks usually move in one round and only ranks that
    gather a large share of a layer (e.g. TP8 → TP1) take several. Local copies use the same
    buffer: beside the first round where the budget leaves room for pieces of at least half the
    fraction, else after it in pieces of the round's staging or the fraction, whichever is larger."""
    if limit is None:
        return max(1, n_ids), max(1, n_ids), True
    remote: dict[int, int] = {}
    new_owner: set[int] = set()
    for s in slices:
        new_owner.add(s.dst)
        if s.src != s.dst:
            remote[s.src] = remote.get(s.src, 0) + s.heads
            remote[s.dst] = remote.get(s.dst, 0) + s.heads
    step = n_ids
    for r, heads in remote.items():
        if limit == "auto":
            budget = (1 + common.STAGING_FRACTION) * layer_bytes
            if r in new_owner:
                budget -= new_heads_per_rank * num_blocks * per_block_head
        else:
            budget = int(limit)
        step = min(step, int(budget // (heads * per_block_head)))
    step = max(1, step)
    local_block = max(1, sum(s.heads for s in slices if s.src == s.dst == rank) * per_block_head)
    own = remote.get(rank, 0) * per_block_head * step
    if limit == "auto":
        budget = (1 + common.STAGING_FRACTION) * layer_bytes - (
            new_heads_per_rank * num_blocks * per_block_head if rank in new_owner else 0)
    else:
        budget = int(limit)
    beside = int((budget - own) // local_block)  # local pieces that fit beside a round in flight
    floor = int(common.STAGING_FRACTION * layer_bytes) if limit == "auto" else int(limit)
    if beside >= max(1, min(n_ids, floor // local_block) // 2):
        return step, min(beside, n_ids), True
    return step, max(1, min(n_ids, max(own, floor) // local_block)), False

def reference_chunks(ids: torch.Tensor, num_kv_heads: int, old_t, new_t,
            limit: int | None) -> list[torch.Tensor]:
    """``ids`` split into chunks whose staging fits ``limit`` on any rank. The chunk size depends
    only on the layer's shape (a rank sends at most all heads and receives at most all heads of a
    block), so every rank splits the same way and sends pair with receives chunk by chunk."""
    t = old_t if old_t is not None else new_t
    if limit is None or ids.numel() == 0 or t is None:
        return [ids]
    per_block = 2 * num_kv_heads * t[0, 0].numel() * t.element_size()
    return list(ids.split(max(1, limit // per_block)))

