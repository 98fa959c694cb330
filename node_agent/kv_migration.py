"""2D KV migration executor: engine-agnostic (torch only; no vLLM), runs on every rank.

Given this rank's per-layer KV tensors in the old topology and the plan from
:func:`remp.kvplan.migration_plan`, it builds this rank's per-layer tensors of the new topology,
layer by layer: for global layer ℓ the new owners allocate the new layer, every slice is moved
(worker-to-worker through the transport, or copied locally), then the old layer is released. The
peak extra memory is therefore about one layer (the new layer allocated before the old one is
released, plus the staging buffer of that layer's rounds; by default the two together stay within one
full layer's KV + 10 %, see :func:`migrate_kv`).

Slices are gathered / scattered per run of consecutive block ids or by one index op on the
tensor's memory-order view reinterpreted as 16-byte elements (see :func:`migrate_kv`);
:func:`migrate_kv_reference` keeps the first executor (advanced indexing) as the reference.

KV tensor layout per layer (vLLM CPU, and the GPU flash layout after a permute): dimension 0 is the
block id, dimension 1 the local KV head; whatever follows is moved as is. Only the rows of
``block_ids`` (the blocks holding live or cached tokens) are moved.
"""

from __future__ import annotations

import bisect
import math
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


STAGING_FRACTION = 0.1
"""Default staging limit: this share of one full layer's KV (all KV heads, the whole block pool)."""
RUN_COPY_MAX_RUNS = 8
"""A chunk whose block ids form at most this many runs of consecutive ids is gathered / scattered
by one strided slice copy per run; more runs: one index op (``index_select`` / ``index_copy_``)
for the whole chunk, whose cost does not grow with the number of runs."""
_MAX_WIDE_BYTES = 16
_SCATTER_OP = "index_copy"  # or "index_put"
_WIDE = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))
_ALIGN = 256


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
) -> tuple[dict[int, torch.Tensor], MigrationStats]:
    """Move KV from ``old_layers`` (global layer → tensor, this rank's old slices) into new tensors.

    ``old_layers`` is consumed: each old layer is removed from it once moved, so the caller's
    dict must hold the only reference for the memory to be released. ``layers`` restricts the
    work to some global layers (rollback); ``fail_after_layers`` raises :class:`InjectedFault`
    after that many layers (test-only). On any error ``new_layers`` holds what was built so far
    and ``done`` (appended to as layers complete) says which layers fully moved.

    ``staging_limit_bytes`` (every rank must pass the same value): ``"auto"`` (default) = every
    rank's new per-rank layer plus its staging stays within one full layer's KV (all KV heads,
    whole pool) × (1 + :data:`STAGING_FRACTION`) — layers split across more ranks move in one
    round, ranks that gather a large share of a layer (TP8 → TP1) in several; an int = each rank's
    staging stays under that many bytes; ``None`` = no limit (each layer in one round, staging up
    to the rank's whole share of the layer). Rounds are blocks of ids, the same on every rank.

    How a slice moves (the wire format is the slice's bytes in the tensors' memory order, which
    must be the same dimension order on every rank: one engine's KV layout): block ids are split
    into runs of consecutive ids; a chunk that is one run whose bytes are contiguous in memory is
    sent from / received into the layer tensor itself (no staging, no gather); a chunk of at most
    :data:`RUN_COPY_MAX_RUNS` runs is gathered / scattered by one strided copy per run; otherwise
    by one ``index_select`` / ``index_copy_`` over the block dimension. Views are reinterpreted as
    16- or 8-byte elements where the layout allows (bit-exact; far fewer elements to index). The
    send / receive staging is one buffer per call, reused by every chunk and layer.
    Returns (new layers of this rank, stats).
    """
    stats = MigrationStats()
    t0 = time.perf_counter()
    new_layers = {} if new_layers is None else new_layers
    if isinstance(staging_limit_bytes, str) and staging_limit_bytes != "auto":
        raise ValueError(f"staging_limit_bytes must be 'auto', None or an int, not {staging_limit_bytes!r}")
    ids_host = block_ids.to(device="cpu", dtype=torch.long)
    id_list = ids_host.tolist()
    n_ids = len(id_list)
    starts = _run_starts(ids_host)
    ids = None  # on the layers' device, made at the first layer this rank works on
    baseline = sum(_nbytes(t) for t in old_layers.values()) + sum(_nbytes(t) for t in new_layers.values())
    by_layer: dict[int, list[Slice]] = {}
    for s in plan:
        by_layer.setdefault(s.layer, []).append(s)
    order = layer_order(old_view.topo, new_view.topo, old_view.num_layers)
    wanted = set(by_layer) if layers is None else set(layers)
    todo = [ly for ly in order if ly in wanted]
    stage = _Staging()
    chunks: dict[int, list] = {}  # step → [(cids, runs)], the same for every layer of that step
    for n_done, layer in enumerate(todo):
        if fail_after_layers is not None and n_done >= fail_after_layers:
            raise InjectedFault(f"injected fault in MIGRATE_KV after {n_done} layers")
        tl = time.perf_counter()
        slices = by_layer[layer]
        mine = [s for s in slices if rank in (s.src, s.dst)]
        if any(s.dst == rank for s in slices) and layer not in new_layers:
            new_layers[layer] = alloc_layer(layer)
        old_t = old_layers.get(layer)
        new_t = new_layers.get(layer)
        if mine and n_ids:
            proto = old_t if old_t is not None else new_t
            if ids is None or ids.device != proto.device:
                ids = block_ids.to(device=proto.device, dtype=torch.long)
                chunks.clear()
                stage.bind(proto.device)
            per_block_head = proto[0, 0].numel() * proto.element_size()
            layer_bytes = proto.shape[0] * old_view.num_kv_heads * per_block_head
            step, local_step, beside = _chunk_blocks(rank, slices, new_view.heads_per_rank, proto.shape[0],
                                             layer_bytes, per_block_head, staging_limit_bytes, n_ids)
            current = sum(_nbytes(t) for t in old_layers.values()) + sum(
                _nbytes(t) for t in new_layers.values()) - baseline
            src_perm = _memory_order(old_t) if old_t is not None else None
            dst_perm = _memory_order(new_t) if new_t is not None else None
            local, remote = [], []
            for s in mine:
                sv = dv = None
                if s.src == rank:
                    sv = _SliceView(old_t, src_perm, old_view.local_head(s.head_start), s.heads)
                if s.dst == rank:
                    dv = _SliceView(new_t, dst_perm, new_view.local_head(s.head_start), s.heads)
                (local if s.src == s.dst else remote).append((s, sv, dv))
            # this layer's staging, sized once (exactly: a buffer left from a layer that could
            # afford more would break this layer's bound)
            n0, l0 = min(step, n_ids), min(local_step, n_ids)
            need = sum(_aligned((sv if s.src == rank else dv).nbytes(n0)) for s, sv, dv in remote)
            lneed = max((_aligned(sv.nbytes(l0)) for _, sv, _ in local), default=0)
            stage.fit(need + lneed if beside else max(need, lneed))
            rounds = _chunk_list(chunks, step, ids, id_list, starts) if remote else [None]
            for i, rnd in enumerate(rounds):
                posted = _post_round(rank, layer, remote, *rnd, stage, transport, stats) if rnd else None
                if i == 0 and posted and not beside:
                    _finish_round(*rnd, *posted, transport)
                    posted = None
                if i == 0:  # local copies (no peer: any piece size), beside or after the first round
                    busy = stage.used if posted else 0
                    for _, sv, dv in local:
                        for cids, runs in _chunk_list(chunks, local_step, ids, id_list, starts):
                            temp = _copy_local(sv, dv, cids, runs, stage, busy)
                            stats.bytes_copied_locally += sv.nbytes(cids.numel())
                            stats.peak_extra_bytes = max(stats.peak_extra_bytes,
                                                         current + stage.capacity + temp)
                if posted:
                    _finish_round(*rnd, *posted, transport)
                stats.peak_extra_bytes = max(stats.peak_extra_bytes, current + stage.capacity)
            # drop every view of this layer's tensors now: a view left until the next layer's
            # allocation would keep the old layer alive next to the new one
            del local, remote, posted, sv, dv, proto
        old_layers.pop(layer, None)  # release the old layer as soon as it has moved
        del old_t, new_t
        if done is not None:
            done.append(layer)
        stats.layers += 1
        stats.per_layer_seconds.append(time.perf_counter() - tl)
    stats.seconds = time.perf_counter() - t0
    return new_layers, stats


def _chunk_list(cache: dict, step: int, ids: torch.Tensor, id_list: list[int],
                starts: list[int]) -> list:
    """The rounds of ``step`` blocks: (block ids on the device, their runs); built once per step."""
    got = cache.get(step)
    if got is None:
        n = len(id_list)
        got = cache[step] = [(ids[a:min(n, a + step)], _Runs(id_list, starts, a, min(n, a + step)))
                             for a in range(0, n, step)]
    return got


def _copy_local(sv: "_SliceView", dv: "_SliceView", cids, runs: "_Runs", stage: "_Staging",
                busy: int) -> int:
    """Heads staying on this rank (maybe at another head offset), staged after the first ``busy``
    bytes of the staging buffer (the round in flight); returns temporary bytes used outside it."""
    n = cids.numel()
    if sv.same_layout(dv):
        if runs.count <= RUN_COPY_MAX_RUNS and sv.same_width(dv):
            for _, b0, ln in runs.list():
                dv.m.narrow(dv.pb, b0, ln).copy_(sv.m.narrow(sv.pb, b0, ln))
            return 0
        stage.ensure(_aligned(busy + sv.nbytes(n)))
        sv.gather(cids, runs, stage.view(busy, sv.buffer_shape(n), sv.m.dtype))
        dv.scatter(cids, runs, stage.view(busy, dv.buffer_shape(n), dv.m.dtype))
        return 0
    part = sv.exec.index_select(0, cids)  # old and new tensors laid out differently
    dv.exec.index_copy_(0, cids, part)
    return _nbytes(part)


def _post_round(rank, layer, work, cids, runs, stage, transport, stats):
    """Post one round: every remote slice of this rank for the blocks ``cids``, in plan order
    (gathers into the staging buffer, then isend; irecv into staging or straight into place)."""
    n = cids.numel()
    # decide first (in place or staged), so that the staging buffer is sized once for the round
    acts, need = [], 0
    for s, sv, dv in work:
        v = sv if s.src == rank else dv
        region = v.region(runs)
        if region is not None:
            acts.append((s, v, region, None))
        else:
            acts.append((s, v, None, need))
            need += _aligned(v.nbytes(n))
    stage.ensure(need)
    stage.used = need
    handles, keep, scatters = [], [], []
    for s, v, region, off in acts:
        if region is not None:
            buf, wire = region, _as_bytes(region)
        else:
            buf, wire = stage.view(off, v.buffer_shape(n), v.m.dtype, with_bytes=True)
        if s.src == rank:
            if region is None:
                v.gather(cids, runs, buf)
            handles.append(transport.isend(wire, s.dst, tag=layer))
            stats.bytes_sent += wire.numel()
        else:
            handles.append(transport.irecv(wire, s.src, tag=layer))
            if region is None:
                scatters.append((v, buf))
            stats.bytes_received += wire.numel()
        keep.append(wire)  # alive until waited
    return handles, keep, scatters


def _finish_round(cids, runs, handles, keep, scatters, transport) -> None:
    transport.wait(handles)
    for v, buf in scatters:
        v.scatter(cids, runs, buf)


class _Runs:
    """Runs of consecutive block ids in positions [a, b) of the id list: (offset, first id, length)."""

    def __init__(self, ids: list[int], starts: list[int], a: int, b: int):
        self.ids, self.a, self.b = ids, a, b
        self.starts = starts[bisect.bisect_right(starts, a):bisect.bisect_left(starts, b)]
        self.count = len(self.starts) + 1 if b > a else 0
        self._list = None

    def list(self) -> list[tuple[int, int, int]]:
        if self._list is None:
            cuts = [self.a, *self.starts, self.b]
            self._list = [(c - self.a, self.ids[c], d - c) for c, d in zip(cuts, cuts[1:])]
        return self._list


def _run_starts(ids: torch.Tensor) -> list[int]:
    """Positions i > 0 where ids[i] != ids[i-1] + 1 (a new run of consecutive ids starts)."""
    if ids.numel() < 2:
        return []
    return ((ids[1:] - ids[:-1]) != 1).nonzero().flatten().add(1).tolist()


class _SliceView:
    """Heads [lo, lo + heads) of one layer tensor, in the tensor's memory order (``m``, dims
    permuted by stride, reinterpreted as wide elements where possible; ``pb`` = its block dim)
    and in executor order (``exec``: block, head, rest)."""

    def __init__(self, t: torch.Tensor, perm: list[int], lo: int, heads: int):
        self.exec = t.narrow(1, lo, heads)
        self.perm = perm
        self.pb = perm.index(0)
        m = t.permute(perm).narrow(perm.index(1), lo, heads)
        self.m = m if perm[-1] in (0, 1) else _widen(m)
        self.elem = self.m.element_size()
        self.row_bytes = _nbytes(self.m) // max(1, self.m.shape[self.pb]) if self.m.numel() else 0

    def nbytes(self, n: int) -> int:
        return n * self.row_bytes

    def buffer_shape(self, n: int) -> list[int]:
        shape = list(self.m.shape)
        shape[self.pb] = n
        return shape

    def same_layout(self, other: "_SliceView") -> bool:
        """Same memory order of the dims that are not of size 1 in either tensor."""
        big = {d for d in range(self.exec.dim()) if self.exec.shape[d] > 1 and other.exec.shape[d] > 1}
        return [d for d in self.perm if d in big] == [d for d in other.perm if d in big]

    def same_width(self, other: "_SliceView") -> bool:
        return self.m.dtype == other.m.dtype and self.m.shape == other.m.shape and self.pb == other.pb

    def region(self, runs: _Runs) -> torch.Tensor | None:
        """The chunk's bytes in the tensor itself, when they are one contiguous range."""
        if runs.count != 1:
            return None
        _, b0, ln = runs.list()[0]
        r = self.m.narrow(self.pb, b0, ln)
        return r if r.is_contiguous() else None

    def gather(self, cids: torch.Tensor, runs: _Runs, buf: torch.Tensor) -> None:
        if runs.count <= RUN_COPY_MAX_RUNS:
            for o, b0, ln in runs.list():
                buf.narrow(self.pb, o, ln).copy_(self.m.narrow(self.pb, b0, ln))
        else:
            torch.index_select(self.m, self.pb, cids, out=buf)

    def scatter(self, cids: torch.Tensor, runs: _Runs, buf: torch.Tensor) -> None:
        if runs.count <= RUN_COPY_MAX_RUNS:
            for o, b0, ln in runs.list():
                self.m.narrow(self.pb, b0, ln).copy_(buf.narrow(self.pb, o, ln))
        elif _SCATTER_OP == "index_put":
            self.m[(slice(None),) * self.pb + (cids,)] = buf
        else:
            self.m.index_copy_(self.pb, cids, buf)


class _Staging:
    """One flat byte buffer per migration, carved into each round's send / receive buffers. A
    round starts after the previous one was waited for, and on CUDA the transports order the
    next use after the previous transfer (stream order), so the buffer is simply reused; the
    views of it are cached (the same shapes recur every layer)."""

    def __init__(self):
        self.buf, self.capacity, self._views, self._device = None, 0, {}, None
        self.used = 0  # bytes of the round in flight

    def ensure(self, nbytes: int) -> None:
        if nbytes > self.capacity:
            self.buf = None  # release before allocating the larger one
            self._views.clear()
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            self.capacity = nbytes

    def fit(self, nbytes: int) -> None:
        """Exactly ``nbytes`` (the previous round was waited for: its buffer may go)."""
        if nbytes != self.capacity:
            self.buf = None
            self._views.clear()
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device) if nbytes else None
            self.capacity = nbytes

    def bind(self, device: torch.device) -> None:
        if device != self._device:
            self.buf, self.capacity, self._device = None, 0, device
            self._views.clear()

    def view(self, offset: int, shape: list[int], dtype: torch.dtype, with_bytes: bool = False):
        key = (offset, tuple(shape), dtype)
        got = self._views.get(key)
        if got is None:
            size = math.prod(shape) * _ELEM_SIZE[dtype]
            raw = self.buf[offset:offset + size]
            got = self._views[key] = (raw.view(dtype).view(shape), raw)
        return got if with_bytes else got[0]


_ELEM_SIZE: dict = {dt: torch.empty((), dtype=dt).element_size() for dt in (
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8, torch.bool,
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64)}


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as flat bytes: the wire format, whatever element type each side uses."""
    return t.reshape(-1).view(torch.uint8)


def _memory_order(t: torch.Tensor) -> list[int]:
    """Dims ordered outermost → innermost in memory (by stride; size-1 dims, whose stride is
    meaningless, first)."""
    ones = [d for d in range(t.dim()) if t.shape[d] == 1]
    rest = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: -t.stride(d))
    return ones + rest


def _widen(v: torch.Tensor) -> torch.Tensor:
    """``v`` reinterpreted with the widest element (≤ 16 bytes) its last dim, strides and
    address allow: the same bytes, fewer elements for the index and copy kernels."""
    if v.dim() == 0 or v.numel() == 0 or v.stride(-1) != 1:
        return v
    es = v.element_size()
    for w, dt in _WIDE:
        if w > _MAX_WIDE_BYTES:
            continue
        if w <= es:
            break
        if (v.shape[-1] * es) % w or (v.storage_offset() * es) % w or v.data_ptr() % w:
            continue
        if any((v.stride(d) * es) % w for d in range(v.dim() - 1) if v.shape[d] > 1):
            continue
        try:
            return v.view(dt)
        except RuntimeError:
            continue
    return v


def _chunk_blocks(rank: int, slices: list[Slice], new_heads_per_rank: int, num_blocks: int,
                  layer_bytes: int, per_block_head: int, limit: int | str | None,
                  n_ids: int) -> tuple[int, int, bool]:
    """(blocks per round of the remote slices, blocks per piece of this rank's local copies,
    whether the local copies run beside the first round in flight or after it).

    The round size depends only on the layer's plan and shape, so every rank splits the same way
    and sends pair with receives round by round. ``None``: one round. An int: the rank staging
    the most remote heads stays under it. ``"auto"``: every rank's extra memory stays under one
    full layer + :data:`STAGING_FRACTION` — its new per-rank layer (if it gets one) plus its
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
            budget = (1 + STAGING_FRACTION) * layer_bytes
            if r in new_owner:
                budget -= new_heads_per_rank * num_blocks * per_block_head
        else:
            budget = int(limit)
        step = min(step, int(budget // (heads * per_block_head)))
    step = max(1, step)
    local_block = max(1, sum(s.heads for s in slices if s.src == s.dst == rank) * per_block_head)
    own = remote.get(rank, 0) * per_block_head * step
    if limit == "auto":
        budget = (1 + STAGING_FRACTION) * layer_bytes - (
            new_heads_per_rank * num_blocks * per_block_head if rank in new_owner else 0)
    else:
        budget = int(limit)
    beside = int((budget - own) // local_block)  # local pieces that fit beside a round in flight
    floor = int(STAGING_FRACTION * layer_bytes) if limit == "auto" else int(limit)
    if beside >= max(1, min(n_ids, floor // local_block) // 2):
        return step, min(beside, n_ids), True
    return step, max(1, min(n_ids, max(own, floor) // local_block)), False


def migrate_kv_reference(
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
    """The first executor, kept as the reference the fast one is checked (and benchmarked) against:
    it gathers each slice by block-index advanced indexing, makes the gather contiguous (a second
    copy) and scatters by ``index_put``; staging is the whole layer's slices unless
    ``staging_limit_bytes`` (here ``None`` = no limit) splits it. Same results and wire pairing as
    :func:`migrate_kv` at the tensor level (not wire-compatible with it: do not mix the two).

    Move KV from ``old_layers`` (global layer → tensor, this rank's old slices) into new tensors.

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
