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

import threading
import time
from collections import deque
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


class LocalTransport:
    """In-process transport for ranks emulated as threads of one process (benchmarks, tests).

    Every rank gets an :meth:`endpoint`; an ``isend`` and the ``irecv`` with the same
    ``(src, dst, tag)`` are paired in posting order and the data is copied once into the receive
    buffer. On CUDA the copy is enqueued on the receiver's current stream after the sender's
    stream reached the ``isend``; ``wait`` makes the caller's stream wait for the copy, so a send
    buffer freed after ``wait`` is never reused too early. Nothing here blocks the GPU: ``wait``
    blocks the calling thread only until its peer has posted the matching call.
    """

    def __init__(self, timeout_s: float = 120.0, copy: str = "memcpy"):
        """``copy``: ``memcpy`` (``Tensor.copy_``: a copy-engine transfer on CUDA) or ``kernel``
        (a bit-exact SM kernel, as NCCL's point-to-point over NVLink is: it does not queue behind
        host→device DMAs on the copy engines)."""
        if copy not in ("memcpy", "kernel"):
            raise ValueError(f"LocalTransport copy must be memcpy or kernel, not {copy!r}")
        self.timeout_s, self.copy = timeout_s, copy
        self._lock = threading.Lock()
        self._sends: dict[tuple[int, int, int], deque] = {}
        self._recvs: dict[tuple[int, int, int], deque] = {}
        self.bytes_copied = 0

    def endpoint(self, rank: int) -> "_LocalEndpoint":
        return _LocalEndpoint(self, rank)

    def _post(self, op: "_LocalOp", mine: dict, theirs: dict) -> "_LocalOp":
        with self._lock:
            q = theirs.get(op.key)
            if q:
                peer = q.popleft()
                send, recv = (op, peer) if op.is_send else (peer, op)
                self._copy(send, recv)
            else:
                mine.setdefault(op.key, deque()).append(op)
        return op

    def _copy(self, send: "_LocalOp", recv: "_LocalOp") -> None:
        if send.tensor.shape != recv.tensor.shape or send.tensor.dtype != recv.tensor.dtype:
            err = ValueError(f"LocalTransport {send.key}: sent {tuple(send.tensor.shape)} "
                             f"{send.tensor.dtype}, receiver expects {tuple(recv.tensor.shape)} "
                             f"{recv.tensor.dtype}")
            send.error = recv.error = err
        elif recv.tensor.is_cuda:
            with torch.cuda.stream(recv.stream):
                recv.stream.wait_event(send.ready)
                src, dst = send.tensor, recv.tensor
                if self.copy == "kernel" and src.is_contiguous() and dst.is_contiguous():
                    torch.bitwise_or(src.view(torch.uint8), 0, out=dst.view(torch.uint8))
                else:
                    recv.tensor.copy_(send.tensor, non_blocking=True)
                done = torch.cuda.Event()
                done.record(recv.stream)
            send.copied = recv.copied = done
        else:
            recv.tensor.copy_(send.tensor)
        self.bytes_copied += _nbytes(recv.tensor)
        send.matched.set()
        recv.matched.set()


class _LocalOp:
    def __init__(self, tensor: torch.Tensor, key: tuple[int, int, int], is_send: bool):
        self.tensor, self.key, self.is_send = tensor, key, is_send
        self.matched = threading.Event()
        self.error: BaseException | None = None
        self.stream = self.ready = self.copied = None
        if tensor.is_cuda:
            self.stream = torch.cuda.current_stream(tensor.device)
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)


class _LocalEndpoint:
    """One rank's view of a :class:`LocalTransport` (implements :class:`Transport`)."""

    def __init__(self, hub: LocalTransport, rank: int):
        self.hub, self.rank = hub, rank

    def isend(self, tensor, dst, tag):
        op = _LocalOp(tensor, (self.rank, dst, tag), True)
        return self.hub._post(op, self.hub._sends, self.hub._recvs)

    def irecv(self, tensor, src, tag):
        op = _LocalOp(tensor, (src, self.rank, tag), False)
        return self.hub._post(op, self.hub._recvs, self.hub._sends)

    def wait(self, handles):
        for h in handles:
            if not h.matched.wait(self.hub.timeout_s):
                raise TimeoutError(f"LocalTransport: rank {self.rank} waited "
                                   f"{self.hub.timeout_s} s for {h.key} (peer never posted)")
            if h.error is not None:
                raise h.error
            if h.copied is not None:
                torch.cuda.current_stream(h.tensor.device).wait_event(h.copied)


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
    staging_limit_bytes: int | None = None,
) -> tuple[dict[int, torch.Tensor], MigrationStats]:
    """Move KV from ``old_layers`` (global layer → tensor, this rank's old slices) into new tensors.

    ``old_layers`` is consumed: each old layer is removed from it once moved, so the caller's
    dict must hold the only reference for the memory to be released. ``layers`` restricts the
    work to some global layers (rollback); ``fail_after_layers`` raises :class:`InjectedFault`
    after that many layers (test-only). On any error ``new_layers`` holds what was built so far
    and ``done`` (appended to as layers complete) says which layers fully moved.
    ``staging_limit_bytes`` (default: no limit) moves each layer in chunks of blocks so that this
    rank's staging buffers stay under about that many bytes (every rank must pass the same value);
    the peak extra memory is then one new per-rank layer plus that limit.
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
        for cids in _chunks(ids, old_view.num_kv_heads, old_t, new_t, staging_limit_bytes):
            handles, recvs, staging = [], [], 0
            for s in slices:
                if (s.src != rank and s.dst != rank) or cids.numel() == 0:
                    continue
                if s.src == rank and s.dst == rank:
                    o_lo = old_view.local_head(s.head_start)
                    n_lo = new_view.local_head(s.head_start)
                    part = old_t[cids, o_lo:o_lo + s.heads]
                    new_t[cids, n_lo:n_lo + s.heads] = part
                    stats.bytes_copied_locally += _nbytes(part)
                    staging = max(staging, _nbytes(part))
                elif s.src == rank:
                    o_lo = old_view.local_head(s.head_start)
                    buf = old_t[cids, o_lo:o_lo + s.heads].contiguous()
                    handles.append(transport.isend(buf, s.dst, tag=layer))
                    recvs.append((None, buf))  # keep the send buffer alive until waited
                    stats.bytes_sent += _nbytes(buf)
                    staging += _nbytes(buf)
                else:
                    shape = (cids.numel(), s.heads, *new_t.shape[2:])
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
                    new_t[cids, n_lo:n_lo + s.heads] = buf
            del recvs, handles
        old_layers.pop(layer, None)  # release the old layer as soon as it has moved
        del old_t, new_t
        if done is not None:
            done.append(layer)
        stats.layers += 1
        stats.per_layer_seconds.append(time.perf_counter() - tl)
    stats.seconds = time.perf_counter() - t0
    return new_layers, stats


def _chunks(ids: torch.Tensor, num_kv_heads: int, old_t, new_t,
            limit: int | None) -> list[torch.Tensor]:
    """``ids`` split into chunks whose staging fits ``limit`` on any rank. The chunk size depends
    only on the layer's shape (a rank sends at most all heads and receives at most all heads of a
    block), so every rank splits the same way and sends pair with receives chunk by chunk."""
    t = old_t if old_t is not None else new_t
    if limit is None or ids.numel() == 0 or t is None:
        return [ids]
    per_block = 2 * num_kv_heads * t[0, 0].numel() * t.element_size()
    return list(ids.split(max(1, limit // per_block)))


def _device_of(*dicts: dict[int, torch.Tensor]) -> torch.device:
    for d in dicts:
        for t in d.values():
            return t.device
    return torch.device("cpu")
