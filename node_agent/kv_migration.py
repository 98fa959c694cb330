"""2D KV migration executor: engine-agnostic (torch only; no vLLM), runs on every rank.

Given this rank's per-layer KV tensors in the old topology and the plan from
:func:`remp.kvplan.migration_plan`, it builds this rank's per-layer tensors of the new topology,
layer by layer: for global layer ℓ the new owners allocate the new layer, every slice is moved
(worker-to-worker through the transport, or copied locally), then the old layer is released. The
peak extra memory is therefore about one layer (the new layer allocated before the old one is
released, plus the staging buffers of that layer's slices).

KV tensor layout per layer (vLLM CPU, and the GPU flash layout after a permute): dimension 0 is the
block id, dimension 1 the local KV head; whatever follows is moved as is. Only the rows of
``block_ids`` (the blocks holding live or cached tokens) are moved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from remp.kvplan import RankView, Slice, layer_order


class Transport(Protocol):
    """Point-to-point tensor transfer between ranks; ``wait`` blocks until all posted ops end."""

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> object: ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> object: ...

    def wait(self, handles: list) -> None: ...


class TorchDistTransport:
    """torch.distributed isend/irecv on one process group (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group, rank_of: Callable[[int], int] = lambda r: r):
        self.group = group
        self.rank_of = rank_of  # plan rank -> rank in ``group`` (global ranks for a world group)

    def isend(self, tensor, dst, tag):
        return torch.distributed.isend(tensor, self.rank_of(dst), group=self.group, tag=tag)

    def irecv(self, tensor, src, tag):
        return torch.distributed.irecv(tensor, self.rank_of(src), group=self.group, tag=tag)

    def wait(self, handles):
        for h in handles:
            h.wait()


class InjectedFault(RuntimeError):
    """Raised on purpose by test-only fault injection."""


@dataclass
class MigrationStats:
    layers: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied_locally: int = 0
    peak_extra_bytes: int = 0
    seconds: float = 0.0
    per_layer_seconds: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "layers": self.layers,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "bytes_copied_locally": self.bytes_copied_locally,
            "peak_extra_bytes": self.peak_extra_bytes,
            "seconds": self.seconds,
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
) -> tuple[dict[int, torch.Tensor], MigrationStats]:
    """Move KV from ``old_layers`` (global layer → tensor, this rank's old slices) into new tensors.

    ``old_layers`` is consumed: each old layer is removed from it once moved, so the caller's
    dict must hold the only reference for the memory to be released. ``layers`` restricts the
    work to some global layers (rollback); ``fail_after_layers`` raises :class:`InjectedFault`
    after that many layers (test-only). On any error ``new_layers`` holds what was built so far
    and ``done`` (appended to as layers complete) says which layers fully moved.
    Returns (new layers of this rank, stats).
    """
    stats = MigrationStats()
    t0 = time.perf_counter()
    new_layers = {} if new_layers is None else new_layers
    ids = block_ids.to(device=_device_of(old_layers, new_layers), dtype=torch.long)
    baseline = sum(_nbytes(t) for t in old_layers.values()) + sum(_nbytes(t) for t in new_layers.values())
    by_layer: dict[int, list[Slice]] = {}
    for s in plan:
        by_layer.setdefault(s.layer, []).append(s)
    order = layer_order(old_view.topo, new_view.topo, old_view.num_layers)
    wanted = set(by_layer) if layers is None else set(layers)
    todo = [ly for ly in order if ly in wanted]
    for n_done, layer in enumerate(todo):
        if fail_after_layers is not None and n_done >= fail_after_layers:
            raise InjectedFault(f"injected fault in MIGRATE_KV after {n_done} layers")
        tl = time.perf_counter()
        slices = by_layer[layer]
        mine_new = rank in {s.dst for s in slices}
        if mine_new and layer not in new_layers:
            new_layers[layer] = alloc_layer(layer)
        old_t = old_layers.get(layer)
        new_t = new_layers.get(layer)
        handles, recvs, staging = [], [], 0
        for s in slices:
            if (s.src != rank and s.dst != rank) or ids.numel() == 0:
                continue
            if s.src == rank and s.dst == rank:
                o_lo = old_view.local_head(s.head_start)
                n_lo = new_view.local_head(s.head_start)
                part = old_t[ids, o_lo:o_lo + s.heads]
                new_t[ids, n_lo:n_lo + s.heads] = part
                stats.bytes_copied_locally += _nbytes(part)
                staging = max(staging, _nbytes(part))
            elif s.src == rank:
                o_lo = old_view.local_head(s.head_start)
                buf = old_t[ids, o_lo:o_lo + s.heads].contiguous()
                handles.append(transport.isend(buf, s.dst, tag=layer))
                recvs.append((None, buf))  # keep the send buffer alive until waited
                stats.bytes_sent += _nbytes(buf)
                staging += _nbytes(buf)
            else:
                shape = (ids.numel(), s.heads, *new_t.shape[2:])
                buf = torch.empty(shape, dtype=new_t.dtype, device=new_t.device)
                handles.append(transport.irecv(buf, s.src, tag=layer))
                recvs.append((s, buf))
                stats.bytes_received += _nbytes(buf)
                staging += _nbytes(buf)
        current = sum(_nbytes(t) for t in old_layers.values()) + sum(
            _nbytes(t) for t in new_layers.values())
        stats.peak_extra_bytes = max(stats.peak_extra_bytes, current + staging - baseline)
        transport.wait(handles)
        for s, buf in recvs:
            if s is not None:
                n_lo = new_view.local_head(s.head_start)
                new_t[ids, n_lo:n_lo + s.heads] = buf
        del recvs, handles
        old_layers.pop(layer, None)  # release the old layer as soon as it has moved
        del old_t, new_t
        if done is not None:
            done.append(layer)
        stats.layers += 1
        stats.per_layer_seconds.append(time.perf_counter() - tl)
    stats.seconds = time.perf_counter() - t0
    return new_layers, stats


def _device_of(*dicts: dict[int, torch.Tensor]) -> torch.device:
    for d in dicts:
        for t in d.values():
            return t.device
    return torch.device("cpu")
