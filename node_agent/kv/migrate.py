"""The entry point of a KV migration on one rank: :func:`migrate_kv` checks its arguments, takes
the direct path (:mod:`node_agent.kv.executor_direct`) when the transport offers peer access and
the staged one (:mod:`node_agent.kv.executor_collective`) otherwise."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from node_agent.kv import executor_collective, executor_direct
from node_agent.kv.common import IdMap, MigrationStats, held_bytes
from node_agent.kv.plan import layers_todo
from node_agent.kv.transport import Transport
from remp.kvplan import RankView, Slice


def migrate_kv(
    rank: int,
    old_layers: dict[int, torch.Tensor],
    old_view: RankView,
    new_view: RankView,
    plan: list[Slice],
    block_ids: torch.Tensor,
    alloc_layer: Callable[[int], torch.Tensor],
    transport: Transport,
    *,
    layers: list[int] | None = None,
    fail_after_layers: int | None = None,
    new_layers: dict[int, torch.Tensor] | None = None,
    done: list[int] | None = None,
    staging_limit_bytes: int | str | None = "auto",
    dst_block_ids: torch.Tensor | None = None,
    pool_blocks: tuple[int, int] | None = None,
    path: str = "auto",
) -> tuple[dict[int, torch.Tensor], MigrationStats]:
    """Move KV from ``old_layers`` (global layer → tensor, this rank's old slices) into new tensors.

    ``old_layers`` is consumed: each old layer is removed from it once moved, so the caller's dict
    must hold the only reference for the memory to be released. ``layers`` restricts the work to
    some global layers (rollback); ``fail_after_layers`` raises
    :class:`~node_agent.kv.common.InjectedFault` after that many layers (test-only). On any error
    ``new_layers`` holds what was built so far and ``done`` (appended to as layers complete) says
    which layers fully moved.

    ``dst_block_ids`` (every rank must pass the same; default: ``block_ids``): old block
    ``block_ids[i]`` lands in new block ``dst_block_ids[i]`` — distinct ids, within the new pool,
    which may hold fewer blocks than the old (a pool compacted at a world-size change).
    ``pool_blocks`` = (old pool, new pool) block counts, used only to size the staging rounds (every
    rank must split alike, and a rank that holds only one of the two tensors cannot see the other's
    size): default = the layer tensor's when both pools are the same, else the smallest pools that
    hold the ids (pass the real sizes to keep the ``"auto"`` bound exact).

    ``path``: ``"direct"`` = the transport's :class:`~node_agent.kv.transport.PeerAccess`
    (``transport.peer_access``): each rank pulls every slice of a layer that it receives (local ones
    included) straight from the source tensors into its new tensor, in one pass (each byte read
    once, written once), one kernel launch per layer (Triton where importable on CUDA; else one
    strided copy per run of consecutive ids, or index ops in bounded pieces); no staging, so the
    extra memory is the new layer alone. ``"staged"`` = through ``isend`` / ``irecv`` (below).
    ``"auto"`` (default) = direct when the transport offers peer access, else staged (every rank
    sees the same transport kind, so all take the same path).

    ``staging_limit_bytes`` (staged path; every rank must pass the same value): ``"auto"`` (default)
    = every rank's new per-rank layer plus its staging stays within one full layer's KV (all KV
    heads, whole pool) × (1 + :data:`~node_agent.kv.common.STAGING_FRACTION`) — layers split across
    more ranks move in one round, ranks that gather a large share of a layer (TP8 → TP1) in several;
    an int = each rank's staging stays under that many bytes; ``None`` = no limit (each layer in one
    round, staging up to the rank's whole share of the layer). Rounds are blocks of ids, the same on
    every rank.

    How a slice moves on the staged path (the wire format is the slice's bytes in the tensors'
    memory order, which must be the same dimension order on every rank: one engine's KV layout):
    block ids are split into runs of consecutive ids; a chunk that is one run whose bytes are
    contiguous in memory is sent from / received into the layer tensor itself (no staging, no
    gather); a chunk of at most :data:`~node_agent.kv.common.RUN_COPY_MAX_RUNS` runs is gathered /
    scattered by one strided copy per run; otherwise by one ``index_select`` / ``index_copy_`` over
    the block dimension. Views are reinterpreted as 16- or 8-byte elements where the layout allows
    (bit-exact; far fewer elements to index). The send / receive staging is one buffer per call,
    reused by every chunk and layer. Returns (new layers of this rank, stats).
    """
    stats = MigrationStats()
    t0 = time.perf_counter()
    new_layers = {} if new_layers is None else new_layers
    if isinstance(staging_limit_bytes, str) and staging_limit_bytes != "auto":
        raise ValueError(f"staging_limit_bytes must be 'auto', None or an int, not {staging_limit_bytes!r}")
    if path not in ("auto", "direct", "staged"):
        raise ValueError(f"path must be 'auto', 'direct' or 'staged', not {path!r}")
    peer = getattr(transport, "peer_access", None)
    if path == "direct" and peer is None:
        raise ValueError("path='direct' needs a transport with peer access (transport.peer_access)")
    direct = peer is not None and path != "staged"
    stats.path = "direct" if direct else "staged"
    idmap = IdMap(block_ids, dst_block_ids)
    baseline = held_bytes(old_layers, new_layers)
    by_layer, todo = layers_todo(plan, old_view, new_view, layers)
    if direct:
        executor_direct.migrate_direct(rank, old_layers, old_view, new_view, todo, by_layer, idmap,
                                       alloc_layer, peer, stats, new_layers, done,
                                       fail_after_layers, baseline)
    else:
        executor_collective.migrate_staged(rank, old_layers, old_view, new_view, todo, by_layer,
                                           idmap, alloc_layer, transport, stats, new_layers, done,
                                           fail_after_layers, baseline, staging_limit_bytes,
                                           pool_blocks)
    stats.seconds = time.perf_counter() - t0
    return new_layers, stats
