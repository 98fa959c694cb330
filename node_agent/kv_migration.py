"""2D KV migration executor: engine-agnostic (torch only; no vLLM), runs on every rank.

Given this rank's per-layer KV tensors in the old topology and the plan from
:func:`remp.kvplan.migration_plan`, it builds this rank's per-layer tensors of the new topology,
layer by layer: for global layer ℓ the new owners allocate the new layer, every slice is moved
(worker-to-worker through the transport, or copied locally), then the old layer is released. The
peak extra memory is therefore about one layer (the new layer allocated before the old one is
released, plus the staging buffer of that layer's rounds; by default the two together stay within one
full layer's KV + 10 %, see :func:`migrate_kv`).

Two ways to move a slice (see :func:`migrate_kv`): *staged* (any transport: gathered into a
staging buffer per run of consecutive block ids or by one index op on the tensor's memory-order
view reinterpreted as 16-byte elements, sent, scattered on the receiver) and *direct* (the
transport gives direct access to the peers' layer tensors — ranks on one device here, CUDA-IPC
peer mappings over NVLink on a real host: the receiver pulls every slice of a layer straight from
the source tensors into its new tensor in one pass, one kernel launch per layer, no staging).
:func:`migrate_kv_reference` keeps the first executor (advanced indexing) as the reference.

KV tensor layout per layer (vLLM CPU, and the GPU flash layout after a permute): dimension 0 is the
block id, dimension 1 the local KV head; whatever follows is moved as is. Only the rows of
``block_ids`` (the blocks holding live or cached tokens) are moved; block ``block_ids[i]`` of the
old pool lands in block ``dst_block_ids[i]`` of the new one (default: the same id), so the new
pool may be compacted and smaller than the old.
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


class PeerAccess(Protocol):
    """Direct access to other ranks' layer tensors (what a transport whose ranks can address each
    other's buffers offers as ``transport.peer_access``; ``None`` or absent: staged path only).

    Ranks on one device (threads of one process) share the tensors themselves; on an NVLink host
    the same four calls map to CUDA-IPC (``share`` exports the buffer's IPC handle and an IPC event,
    ``open`` maps the peer's buffer once and waits for its event, ``close`` records an event the
    owner waits for before it frees or reuses the buffer), like vLLM's custom all-reduce buffers.
    """

    def share(self, layer: int, tensor: torch.Tensor, readers: int) -> None:
        """This rank's old ``layer`` may be read by ``readers`` peers (after the work already
        enqueued on the caller's current stream)."""

    def open(self, layer: int, src: int) -> torch.Tensor:
        """Rank ``src``'s shared ``layer`` (blocks until shared); reads enqueued on the caller's
        current stream from now on see its data."""

    def close(self, layer: int, src: int) -> None:
        """The caller's reads of ``src``'s ``layer`` are enqueued on its current stream: the last use."""

    def reclaim(self, layer: int) -> None:
        """Blocks until every reader closed this rank's shared ``layer``; the caller's current
        stream then runs after their reads (as a CUDA-IPC owner waits on its readers' IPC events),
        so the tensor may be freed and its memory reused in that stream's order."""


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

    def __init__(self, timeout_s: float = 120.0, copy: str = "memcpy", direct: bool = False):
        """``copy``: ``memcpy`` (``Tensor.copy_``: a copy-engine transfer on CUDA) or ``kernel``
        (a bit-exact SM kernel, as NCCL's point-to-point over NVLink is: it does not queue behind
        host→device DMAs on the copy engines). ``direct``: the endpoints also offer
        :class:`PeerAccess` (``endpoint.peer_access``), so :func:`migrate_kv` takes its direct
        path (receivers pull slices straight from the peers' tensors)."""
        if copy not in ("memcpy", "kernel"):
            raise ValueError(f"LocalTransport copy must be memcpy or kernel, not {copy!r}")
        self.timeout_s, self.copy, self.direct = timeout_s, copy, direct
        self._lock = threading.Lock()
        self._sends: dict[tuple[int, int, int], deque] = {}
        self._recvs: dict[tuple[int, int, int], deque] = {}
        self.bytes_copied = 0
        self._shared: dict[tuple[int, int], "_Shared"] = {}  # (src rank, layer) → shared layer
        self._changed = threading.Condition(self._lock)

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


class _Shared:
    def __init__(self, tensor: torch.Tensor, readers: int):
        self.tensor, self.readers = tensor, readers
        self.ready = _record_event(tensor)
        self.closed: list = []  # one entry (an event after its reads on CUDA, else None) per reader done


def _record_event(t: torch.Tensor):
    if not t.is_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


class _LocalEndpoint:
    """One rank's view of a :class:`LocalTransport` (implements :class:`Transport`, and
    :class:`PeerAccess` as ``peer_access`` when the hub was made with ``direct=True``)."""

    def __init__(self, hub: LocalTransport, rank: int):
        self.hub, self.rank = hub, rank

    @property
    def peer_access(self) -> "_LocalEndpoint | None":
        return self if self.hub.direct else None

    # PeerAccess: the ranks are threads of this process, so a peer's tensor is the tensor itself
    def share(self, layer, tensor, readers):
        with self.hub._changed:
            key = (self.rank, layer)
            if key in self.hub._shared:
                raise RuntimeError(f"LocalTransport: rank {self.rank} shared layer {layer} twice")
            self.hub._shared[key] = _Shared(tensor, readers)
            self.hub._changed.notify_all()

    def _wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        if not self.hub._changed.wait_for(ready, self.hub.timeout_s):
            raise TimeoutError(f"LocalTransport: rank {self.rank} waited {self.hub.timeout_s} s for {what}")

    def open(self, layer, src):
        key = (src, layer)
        with self.hub._changed:
            self._wait_for(f"rank {src} to share layer {layer}", lambda: key in self.hub._shared)
            sh = self.hub._shared[key]
        if sh.ready is not None:
            torch.cuda.current_stream(sh.tensor.device).wait_event(sh.ready)
        return sh.tensor

    def close(self, layer, src):
        with self.hub._changed:
            sh = self.hub._shared[(src, layer)]
            sh.closed.append(_record_event(sh.tensor))
            self.hub._changed.notify_all()

    def reclaim(self, layer):
        key = (self.rank, layer)
        with self.hub._changed:
            sh = self.hub._shared[key]
            self._wait_for(f"{sh.readers} readers of its layer {layer}", lambda: len(sh.closed) >= sh.readers)
            del self.hub._shared[key]
        # stream order (what a CUDA-IPC owner can do: wait on its readers' events) rather than
        # record_stream on the readers' streams; on the H200 neither was consistently faster
        for ev in sh.closed:
            if ev is not None:
                torch.cuda.current_stream(sh.tensor.device).wait_event(ev)

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
    path: str = "staged"  # or "direct" (see migrate_kv)
    kernel: str = ""  # direct path: "triton" or "torch" (what moved the bytes; "mixed" if both)

    def as_dict(self) -> dict:
        return {
            "path": self.path,
            "kernel": self.kernel,
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
    dst_block_ids: torch.Tensor | None = None,
    pool_blocks: tuple[int, int] | None = None,
    path: str = "auto",
) -> tuple[dict[int, torch.Tensor], MigrationStats]:
    """Move KV from ``old_layers`` (global layer → tensor, this rank's old slices) into new tensors.

    ``old_layers`` is consumed: each old layer is removed from it once moved, so the caller's
    dict must hold the only reference for the memory to be released. ``layers`` restricts the
    work to some global layers (rollback); ``fail_after_layers`` raises :class:`InjectedFault`
    after that many layers (test-only). On any error ``new_layers`` holds what was built so far
    and ``done`` (appended to as layers complete) says which layers fully moved.

    ``dst_block_ids`` (every rank must pass the same; default: ``block_ids``): old block
    ``block_ids[i]`` lands in new block ``dst_block_ids[i]`` — distinct ids, within the new pool,
    which may hold fewer blocks than the old (a pool compacted at a world-size change).
    ``pool_blocks`` = (old pool, new pool) block counts, used only to size the staging rounds
    (every rank must split alike, and a rank that holds only one of the two tensors cannot see the
    other's size): default = the layer tensor's when both pools are the same, else the smallest
    pools that hold the ids (pass the real sizes to keep the ``"auto"`` bound exact).

    ``path``: ``"direct"`` = the transport's :class:`PeerAccess` (``transport.peer_access``):
    each rank pulls every slice of a layer that it receives (local ones included) straight from
    the source tensors into its new tensor, in one pass (each byte read once, written once), one
    kernel launch per layer (Triton where importable on CUDA; else one strided copy per run of
    consecutive ids, or index ops in bounded pieces); no staging, so the extra memory is the new
    layer alone. ``"staged"`` = through ``isend`` / ``irecv`` (below). ``"auto"`` (default) =
    direct when the transport offers peer access, else staged (every rank sees the same
    transport kind, so all take the same path).

    ``staging_limit_bytes`` (staged path; every rank must pass the same value): ``"auto"``
    (default) = every rank's new per-rank layer plus its staging stays within one full layer's KV
    (all KV heads, whole pool) × (1 + :data:`STAGING_FRACTION`) — layers split across more ranks
    move in one round, ranks that gather a large share of a layer (TP8 → TP1) in several; an int =
    each rank's staging stays under that many bytes; ``None`` = no limit (each layer in one round,
    staging up to the rank's whole share of the layer). Rounds are blocks of ids, the same on every
    rank.

    How a slice moves on the staged path (the wire format is the slice's bytes in the tensors'
    memory order, which must be the same dimension order on every rank: one engine's KV layout):
    block ids are split into runs of consecutive ids; a chunk that is one run whose bytes are
    contiguous in memory is sent from / received into the layer tensor itself (no staging, no
    gather); a chunk of at most :data:`RUN_COPY_MAX_RUNS` runs is gathered / scattered by one
    strided copy per run; otherwise by one ``index_select`` / ``index_copy_`` over the block
    dimension. Views are reinterpreted as 16- or 8-byte elements where the layout allows
    (bit-exact; far fewer elements to index). The send / receive staging is one buffer per call,
    reused by every chunk and layer.
    Returns (new layers of this rank, stats).
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
    idmap = _IdMap(block_ids, dst_block_ids)
    n_ids = idmap.n
    baseline = sum(_nbytes(t) for t in old_layers.values()) + sum(_nbytes(t) for t in new_layers.values())
    by_layer: dict[int, list[Slice]] = {}
    for s in plan:
        by_layer.setdefault(s.layer, []).append(s)
    order = layer_order(old_view.topo, new_view.topo, old_view.num_layers)
    wanted = set(by_layer) if layers is None else set(layers)
    todo = [ly for ly in order if ly in wanted]
    if direct:
        _migrate_direct(rank, old_layers, old_view, new_view, todo, by_layer, idmap, alloc_layer, peer,
                        stats, new_layers, done, fail_after_layers, baseline)
        stats.seconds = time.perf_counter() - t0
        return new_layers, stats
    stage = _Staging()
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
            stage.bind(proto.device)
            if new_t is not None:
                idmap.check_pool(new_t.shape[0])
            per_block_head = proto[0, 0].numel() * proto.element_size()
            nb_old, nb_new = idmap.pools(proto.shape[0], pool_blocks)
            layer_bytes = max(nb_old, nb_new) * old_view.num_kv_heads * per_block_head
            step, local_step, beside = _chunk_blocks(rank, slices, new_view.heads_per_rank, nb_new,
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
            rounds = idmap.rounds(proto.device, step) if remote else [None]
            for i, rnd in enumerate(rounds):
                posted = _post_round(rank, layer, remote, rnd, stage, transport, stats) if rnd else None
                if i == 0 and posted and not beside:
                    _finish_round(rnd, *posted, transport)
                    posted = None
                if i == 0:  # local copies (no peer: any piece size), beside or after the first round
                    busy = stage.used if posted else 0
                    for _, sv, dv in local:
                        for piece in idmap.rounds(proto.device, local_step):
                            temp = _copy_local(sv, dv, piece, stage, busy)
                            stats.bytes_copied_locally += sv.nbytes(piece.n)
                            stats.peak_extra_bytes = max(stats.peak_extra_bytes,
                                                         current + stage.capacity + temp)
                if posted:
                    _finish_round(rnd, *posted, transport)
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


class _Round:
    """Positions [a, b) of the id lists: the source ids (on the device, and as runs of
    consecutive ids), the destination ids likewise, and the joint runs (both consecutive)."""

    __slots__ = ("n", "cids", "runs", "dcids", "druns", "jruns")

    def __init__(self, n, cids, runs, dcids, druns, jruns):
        self.n, self.cids, self.runs, self.dcids, self.druns, self.jruns = n, cids, runs, dcids, druns, jruns


class _IdMap:
    """Old block ``src[i]`` → new block ``dst[i]``; host lists, runs, device copies and rounds."""

    def __init__(self, block_ids: torch.Tensor, dst_block_ids: torch.Tensor | None):
        src = torch.as_tensor(block_ids).to(device="cpu", dtype=torch.long).reshape(-1)
        self._src_in = block_ids
        self.src = src.tolist()
        self.n = len(self.src)
        self.src_starts = _run_starts(src)
        self.same = True
        self.dst, self.dst_starts, self.joint = self.src, self.src_starts, self.src_starts
        self._dst_in = None
        if dst_block_ids is not None:
            dst = torch.as_tensor(dst_block_ids).to(device="cpu", dtype=torch.long).reshape(-1)
            if dst.numel() != self.n:
                raise ValueError(f"dst_block_ids has {dst.numel()} ids, block_ids {self.n}")
            dl = dst.tolist()
            if len(set(dl)) != self.n:
                raise ValueError("dst_block_ids must be distinct (two old blocks into one new block)")
            if self.n and min(dl) < 0:
                raise ValueError("dst_block_ids must be non-negative")
            if dl != self.src:
                self.same = False
                self._dst_in = dst_block_ids
                self.dst, self.dst_starts = dl, _run_starts(dst)
                self.joint = sorted(set(self.src_starts) | set(self.dst_starts))
        self._dev: dict = {}
        self._rounds: dict = {}

    def pools(self, shape0: int, given: tuple[int, int] | None) -> tuple[int, int]:
        if given is not None:
            return int(given[0]), int(given[1])
        if self.same:
            return shape0, shape0
        return (max(self.src) + 1 if self.n else 1), (max(self.dst) + 1 if self.n else 1)

    def check_pool(self, new_blocks: int) -> None:
        if self.n and not self.same and max(self.dst) >= new_blocks:
            raise ValueError(f"dst_block_ids reach block {max(self.dst)}, the new pool has {new_blocks}")

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        got = self._dev.get(device)
        if got is None:
            s = self._src_in.to(device=device, dtype=torch.long).reshape(-1) if isinstance(
                self._src_in, torch.Tensor) else torch.tensor(self.src, dtype=torch.long, device=device)
            d = s if self.same else (self._dst_in.to(device=device, dtype=torch.long).reshape(-1) if isinstance(
                self._dst_in, torch.Tensor) else torch.tensor(self.dst, dtype=torch.long, device=device))
            got = self._dev[device] = (s, d)
        return got

    def rounds(self, device: torch.device, step: int) -> list[_Round]:
        """Pieces of ``step`` positions; built once per (device, step)."""
        key = (device, step)
        got = self._rounds.get(key)
        if got is None:
            sids, dids = self.on(device)
            got = []
            for a in range(0, self.n, step):
                b = min(self.n, a + step)
                runs = _Runs(self.src, self.src_starts, a, b)
                if self.same:
                    c = sids[a:b]
                    got.append(_Round(b - a, c, runs, c, runs, runs))
                else:
                    got.append(_Round(b - a, sids[a:b], runs, dids[a:b], _Runs(self.dst, self.dst_starts, a, b),
                                      _Runs(self.src, self.joint, a, b, self.dst)))
            self._rounds[key] = got
        return got


def _copy_local(sv: "_SliceView", dv: "_SliceView", rnd: _Round, stage: "_Staging", busy: int) -> int:
    """Heads staying on this rank (maybe at another head offset or block id), staged after the
    first ``busy`` bytes of the staging buffer (the round in flight); returns temporary bytes used
    outside it."""
    n = rnd.n
    if sv.same_layout(dv):
        if rnd.jruns.count <= RUN_COPY_MAX_RUNS and sv.same_width(dv):
            for _, s0, d0, ln in rnd.jruns.pairs():
                dv.m.narrow(dv.pb, d0, ln).copy_(sv.m.narrow(sv.pb, s0, ln))
            return 0
        stage.ensure(_aligned(busy + sv.nbytes(n)))
        sv.gather(rnd.cids, rnd.runs, stage.view(busy, sv.buffer_shape(n), sv.m.dtype))
        dv.scatter(rnd.dcids, rnd.druns, stage.view(busy, dv.buffer_shape(n), dv.m.dtype))
        return 0
    part = sv.exec.index_select(0, rnd.cids)  # old and new tensors laid out differently
    dv.exec.index_copy_(0, rnd.dcids, part)
    return _nbytes(part)


def _post_round(rank, layer, work, rnd: _Round, stage, transport, stats):
    """Post one round: every remote slice of this rank for the round's blocks, in plan order
    (gathers into the staging buffer, then isend; irecv into staging or straight into place)."""
    n = rnd.n
    # decide first (in place or staged), so that the staging buffer is sized once for the round
    acts, need = [], 0
    for s, sv, dv in work:
        v = sv if s.src == rank else dv
        region = v.region(rnd.runs if s.src == rank else rnd.druns)
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
                v.gather(rnd.cids, rnd.runs, buf)
            handles.append(transport.isend(wire, s.dst, tag=layer))
            stats.bytes_sent += wire.numel()
        else:
            handles.append(transport.irecv(wire, s.src, tag=layer))
            if region is None:
                scatters.append((v, buf))
            stats.bytes_received += wire.numel()
        keep.append(wire)  # alive until waited
    return handles, keep, scatters


def _finish_round(rnd: _Round, handles, keep, scatters, transport) -> None:
    transport.wait(handles)
    for v, buf in scatters:
        v.scatter(rnd.dcids, rnd.druns, buf)


class _Runs:
    """Runs of consecutive block ids in positions [a, b) of the id list: (offset, first id, length).
    With ``dst`` (a second id list, runs cut where either list breaks): :meth:`pairs` gives
    (offset, first source id, first destination id, length)."""

    def __init__(self, ids: list[int], starts: list[int], a: int, b: int, dst: list[int] | None = None):
        self.ids, self.a, self.b, self.dst = ids, a, b, dst
        self.starts = starts[bisect.bisect_right(starts, a):bisect.bisect_left(starts, b)]
        self.count = len(self.starts) + 1 if b > a else 0
        self._list = None

    def list(self) -> list[tuple[int, int, int]]:
        if self._list is None:
            cuts = [self.a, *self.starts, self.b]
            self._list = [(c - self.a, self.ids[c], d - c) for c, d in zip(cuts, cuts[1:])]
        return self._list

    def pairs(self) -> list[tuple[int, int, int, int]]:
        dst = self.ids if self.dst is None else self.dst
        return [(o, b0, dst[self.a + o], ln) for o, b0, ln in self.list()]


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
        """Same element type and shape except the block dim (the pools may differ in size)."""
        if self.m.dtype != other.m.dtype or self.pb != other.pb or self.m.dim() != other.m.dim():
            return False
        return all(a == b for d, (a, b) in enumerate(zip(self.m.shape, other.m.shape)) if d != self.pb)

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


DIRECT_KERNEL = "auto"
"""What moves the bytes on the direct path: ``"auto"`` (the Triton kernel for CUDA tensors where
Triton imports and the layout suits it, else torch ops), ``"triton"`` (an error where it cannot)
or ``"torch"`` (one strided copy per run of consecutive ids where there are at most
:data:`RUN_COPY_MAX_RUNS`: one pass; else ``index_select`` / ``index_copy_`` in pieces of at most
:data:`STAGING_FRACTION` of the new layer: two passes through that temporary)."""


def _migrate_direct(rank, old_layers, old_view, new_view, todo, by_layer, idmap, alloc_layer, peer,
                    stats, new_layers, done, fail_after_layers, baseline) -> None:
    """The direct path of :func:`migrate_kv`. First every old layer of this rank that peers read
    is shared (all at once: a reader never waits for its source to reach a layer, so ranks do
    not advance in lock-step); then, layer by layer in the common layer order, a rank that
    receives allocates its new layer and pulls all its slices (local ones too) from the source
    tensors into it, closes what it opened, and a rank whose layer is read waits until its readers
    are done before it releases that old layer (the memory bound: the same release points as the
    staged path)."""
    n_ids = idmap.n
    kernels: set[str] = set()
    steps = []
    for layer in todo:
        slices = by_layer[layer]
        incoming = [(s.src, old_view.local_head(s.head_start), new_view.local_head(s.head_start), s.heads)
                    for s in slices if s.dst == rank]
        outgoing = [s for s in slices if s.src == rank and s.dst != rank]
        steps.append((layer, incoming, len({s.dst for s in outgoing}), sum(s.heads for s in outgoing)))
    last = len(steps) if fail_after_layers is None else min(len(steps), fail_after_layers)
    if n_ids:
        for layer, incoming, readers, _ in steps[:last]:
            needs_old = readers or any(src == rank for src, *_ in incoming)
            if needs_old and layer not in old_layers:
                raise RuntimeError(f"rank {rank}: the plan moves layer {layer} from it, but it holds no old layer {layer}")
            if readers:
                peer.share(layer, old_layers[layer], readers)
    held = sum(_nbytes(t) for t in old_layers.values()) + sum(_nbytes(t) for t in new_layers.values())
    per_block_head = None
    for n_done, (layer, incoming, readers, out_heads) in enumerate(steps):
        if fail_after_layers is not None and n_done >= fail_after_layers:
            raise InjectedFault(f"injected fault in MIGRATE_KV after {n_done} layers")
        tl = time.perf_counter()
        if incoming and layer not in new_layers:
            new_layers[layer] = alloc_layer(layer)
            held += _nbytes(new_layers[layer])
        old_t = old_layers.get(layer)
        new_t = new_layers.get(layer)
        if per_block_head is None and (old_t is not None or new_t is not None):
            shape, es = (old_t.shape, old_t.element_size()) if old_t is not None else (new_t.shape, new_t.element_size())
            per_block_head = math.prod(shape[2:]) * es
        if n_ids and incoming:
            idmap.check_pool(new_t.shape[0])
            srcs: dict[int, torch.Tensor] = {}
            try:
                for src, *_ in incoming:
                    if src not in srcs:
                        srcs[src] = old_t if src == rank else peer.open(layer, src)
                kernel, temp = _pull([(srcs[src], lo_s, lo_d, h) for src, lo_s, lo_d, h in incoming], new_t, idmap)
                kernels.add(kernel)
                stats.peak_extra_bytes = max(stats.peak_extra_bytes, held - baseline + temp)
            finally:  # also on error: a source must not wait for a reader that failed
                opened = [src for src in srcs if src != rank]
                srcs.clear()  # no reference left here once the source may free its layer
                for src in opened:
                    peer.close(layer, src)
            for src, _, _, h in incoming:
                if src == rank:
                    stats.bytes_copied_locally += h * n_ids * per_block_head
                else:
                    stats.bytes_received += h * n_ids * per_block_head
        if n_ids and readers:
            peer.reclaim(layer)
            stats.bytes_sent += out_heads * n_ids * per_block_head
        gone = old_layers.pop(layer, None)  # release the old layer as soon as its readers are done
        if gone is not None:
            held -= _nbytes(gone)
        del old_t, new_t, gone
        if done is not None:
            done.append(layer)
        stats.layers += 1
        stats.per_layer_seconds.append(time.perf_counter() - tl)
    stats.kernel = "mixed" if len(kernels) > 1 else (kernels.pop() if kernels else "")


def _pull(work: list, new_t: torch.Tensor, idmap: _IdMap) -> tuple[str, int]:
    """Copy every (source tensor, source local head, destination local head, heads) slice of
    ``work`` into ``new_t`` for all ids; returns (what copied, temporary bytes used)."""
    if new_t.is_cuda and DIRECT_KERNEL != "torch":
        if _pull_triton(work, new_t, idmap):
            return "triton", 0
        if DIRECT_KERNEL == "triton":
            raise RuntimeError("DIRECT_KERNEL='triton' but Triton is not importable or the layout does not suit it")
    temp = 0
    for src_t, lo_s, lo_d, heads in work:
        temp = max(temp, _pull_torch(src_t, lo_s, new_t, lo_d, heads, idmap))
    return "torch", temp


def _pull_torch(src_t, lo_s, dst_t, lo_d, heads, idmap: _IdMap) -> int:
    sv = _SliceView(src_t, _memory_order(src_t), lo_s, heads)
    dv = _SliceView(dst_t, _memory_order(dst_t), lo_d, heads)
    same = sv.same_layout(dv)
    whole = idmap.rounds(dst_t.device, idmap.n)[0]
    if whole.jruns.count <= RUN_COPY_MAX_RUNS:  # one strided copy per joint run: one pass
        wide = same and sv.same_width(dv)  # memory-order views as wide elements: fewer of them
        for _, s0, d0, ln in whole.jruns.pairs():
            if wide:
                dv.m.narrow(dv.pb, d0, ln).copy_(sv.m.narrow(sv.pb, s0, ln))
            else:
                dv.exec.narrow(0, d0, ln).copy_(sv.exec.narrow(0, s0, ln))
        return 0
    step = max(1, min(idmap.n, int(STAGING_FRACTION * _nbytes(dst_t)) // max(1, sv.nbytes(1))))
    rs = idmap.rounds(src_t.device, step)
    rd = idmap.rounds(dst_t.device, step) if dst_t.device != src_t.device else rs
    temp = 0
    for a, b in zip(rs, rd):
        if same:
            part = torch.index_select(sv.m, sv.pb, a.cids).to(dst_t.device)
            if part.dtype != dv.m.dtype or list(part.shape) != dv.buffer_shape(b.n):
                part = _as_bytes(part).view(dv.m.dtype).view(dv.buffer_shape(b.n))
            dv.m.index_copy_(dv.pb, b.dcids, part)
        else:  # old and new tensors laid out differently
            part = sv.exec.index_select(0, a.cids).to(dst_t.device)
            dv.exec.index_copy_(0, b.dcids, part)
        temp = max(temp, _nbytes(part))
        del part
    return temp


# ---------------------------------------------------------------- the Triton pull kernel

_TRITON: tuple | bool | None = None  # (triton, kernel) once imported; False: not importable
_PLANS: dict = {}  # launch signature → _PullPlan (tables on the device), shared by all migrations
_PLAN_LOCK = threading.Lock()
_MAX_SOURCES = 8  # source tensors per launch (kernel arguments s0..s7)
_MAX_ROWS = 1 << 16
tl = None  # triton.language, bound on first use (the kernel below reads it as a global)


def _kv_pull(dst, s0, s1, s2, s3, s4, s5, s6, s7, tab, roff_s, roff_d, sids, dids,
             TAB: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, VEC: tl.constexpr):
    """One program = one (block position i, slice j): rows x columns of the slice's block copied
    from its source tensor to ``dst`` (same element type), ``VEC``-element aligned throughout."""
    i = tl.program_id(0).to(tl.int64)
    t = tab + tl.program_id(1) * TAB
    k = tl.load(t)
    so = tl.multiple_of(tl.load(t + 1) + tl.load(sids + i) * tl.load(t + 3), VEC)
    do = tl.multiple_of(tl.load(t + 2) + tl.load(dids + i) * tl.load(t + 4), VEC)
    w = tl.multiple_of(tl.load(t + 5), VEC)
    nrows = tl.load(t + 6)
    r0 = tl.load(t + 7)
    src = s0
    if k == 1:
        src = s1
    if k == 2:
        src = s2
    if k == 3:
        src = s3
    if k == 4:
        src = s4
    if k == 5:
        src = s5
    if k == 6:
        src = s6
    if k == 7:
        src = s7
    for r in range(0, nrows, RB):
        rows = r + tl.arange(0, RB)
        rmask = rows < nrows
        ro_s = tl.multiple_of(tl.load(roff_s + r0 + rows, mask=rmask, other=0), VEC)
        ro_d = tl.multiple_of(tl.load(roff_d + r0 + rows, mask=rmask, other=0), VEC)
        for c in range(0, w, CB):
            cols = tl.max_contiguous(tl.multiple_of(c + tl.arange(0, CB), CB), CB)
            m = rmask[:, None] & (cols < w)[None, :]
            x = tl.load(src + (so + ro_s[:, None] + cols[None, :]), mask=m, eviction_policy="evict_first")
            tl.store(dst + (do + ro_d[:, None] + cols[None, :]), x, mask=m)


def _triton():
    global _TRITON, tl
    if _TRITON is None:
        with _PLAN_LOCK:
            if _TRITON is None:
                try:
                    import triton
                    import triton.language as language
                    tl = language
                    _TRITON = (triton, triton.jit(_kv_pull))
                except Exception:  # noqa: BLE001 - not installed, or a CPU host's broken build
                    _TRITON = False
    return _TRITON


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NATIVE = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64)  # element types the kernel takes as they are (no arithmetic on them)


def _rows(src_t: torch.Tensor, dst_t: torch.Tensor, heads: int):
    """A slice's per-block region (heads × the dims after it) as rows: (row width in elements,
    row offsets in the source, in the destination), the width being the innermost dims that are
    contiguous in both tensors."""
    shape = [heads] + list(src_t.shape[2:])
    ss = [src_t.stride(d) for d in range(1, src_t.dim())]
    ds = [dst_t.stride(d) for d in range(1, dst_t.dim())]
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: (-ds[d], -ss[d]))
    inner, k = 1, len(dims)
    while k and ss[dims[k - 1]] == inner and ds[dims[k - 1]] == inner:
        inner *= shape[dims[k - 1]]
        k -= 1
    so, do = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    for d in dims[:k]:
        idx = torch.arange(shape[d], dtype=torch.long)
        so = (so[:, None] + idx * ss[d]).reshape(-1)
        do = (do[:, None] + idx * ds[d]).reshape(-1)
    return inner, so, do


class _PullPlan:
    """The device tables of one launch signature (shapes, strides and head offsets of a layer's
    slices: the same for every layer of a migration)."""

    def __init__(self, slices: list, dst_t: torch.Tensor):
        es = dst_t.element_size()
        tab, so_all, do_all, widths, nrows, quanta = [], [], [], [], [], []
        for k, src_t, lo_s, lo_d, heads in slices:
            w, so, do = _rows(src_t, dst_t, heads)
            if w * es < 16 or so.numel() > _MAX_ROWS:
                raise _Unsuited(f"rows of {w * es} bytes × {so.numel()}")
            r0 = sum(x.numel() for x in so_all)
            ho_s, ho_d = lo_s * src_t.stride(1), lo_d * dst_t.stride(1)
            tab.append([k, ho_s, ho_d, src_t.stride(0), dst_t.stride(0), w, so.numel(), r0])
            so_all.append(so)
            do_all.append(do)
            widths.append(w)
            nrows.append(so.numel())
            quanta += [ho_s, ho_d, src_t.stride(0), dst_t.stride(0), w] + so.tolist()[:64] + do.tolist()[:64]
            quanta += [math.gcd(*so.tolist()), math.gcd(*do.tolist())]
        g = 0
        for q in quanta:
            g = math.gcd(g, int(q))
        vec = 1
        while vec * 2 * es <= 16 and g % (vec * 2) == 0:
            vec *= 2
        wg = 0
        for w in widths:
            wg = math.gcd(wg, w)
        cap = max(1, 2048 // es)
        cb = 1
        while cb * 2 <= cap and wg % (cb * 2) == 0:
            cb *= 2
        if cb * es < 256:  # odd widths: a wider masked tile
            cb = min(cap, 1 << (max(widths) - 1).bit_length())
        cb = max(cb, vec)
        rb = max(1, min(1 << (max(nrows) - 1).bit_length(), max(1, (16384 // es) // cb)))
        dev = dst_t.device
        self.tab = torch.tensor(tab, dtype=torch.long).to(dev)
        self.roff_s = torch.cat(so_all).to(dev)
        self.roff_d = torch.cat(do_all).to(dev)
        self.idt = _INT_OF_SIZE[es]
        self.meta = dict(TAB=8, RB=rb, CB=cb, VEC=vec, num_warps=8 if rb * cb * es >= 16384 else 4)


class _Unsuited(Exception):
    pass


def _pull_triton(work: list, new_t: torch.Tensor, idmap: _IdMap) -> bool:
    """One launch per layer (per :data:`_MAX_SOURCES` source tensors): grid = ids × slices.
    False where Triton is missing or the layout does not suit the kernel (caller falls back)."""
    tri = _triton()
    es = new_t.element_size()
    if not tri or es not in _INT_OF_SIZE:
        return False
    if any(src_t.dtype != new_t.dtype or src_t.device != new_t.device or src_t.dim() != new_t.dim()
           or src_t.shape[2:] != new_t.shape[2:] for src_t, *_ in work):
        return False
    _, kernel = tri
    sids, dids = idmap.on(new_t.device)
    groups: list[list] = []
    order: dict[int, int] = {}
    for src_t, lo_s, lo_d, heads in work:
        key = id(src_t)
        if key not in order:
            if len(order) % _MAX_SOURCES == 0:
                groups.append([])
            order[key] = len(order)
        groups[order[key] // _MAX_SOURCES].append((order[key] % _MAX_SOURCES, src_t, lo_s, lo_d, heads))
    launches = []
    for group in groups:
        sig = (new_t.device, new_t.dtype, tuple(new_t.shape[1:]), new_t.stride(),
               tuple((k, tuple(s.shape[1:]), s.stride(), lo_s, lo_d, h) for k, s, lo_s, lo_d, h in group))
        plan = _PLANS.get(sig)
        if plan is None:
            try:
                plan = _PullPlan(group, new_t)
            except _Unsuited:
                plan = False
            with _PLAN_LOCK:
                if len(_PLANS) > 512:
                    _PLANS.clear()
                _PLANS[sig] = plan
        if not plan:
            return False
        native = new_t.dtype in _NATIVE  # loaded and stored as raw bits either way
        dst = new_t if native else new_t.view(plan.idt)
        srcs = [dst] * _MAX_SOURCES
        for k, s, *_ in group:
            srcs[k] = s if native else s.view(plan.idt)
        launches.append((plan, dst, srcs, len(group)))
    for plan, dst, srcs, n_slices in launches:
        kernel[(idmap.n, n_slices)](dst, *srcs, plan.tab, plan.roff_s, plan.roff_d, sids, dids, **plan.meta)
    return True


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
    dst_block_ids: torch.Tensor | None = None,
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
    the peak extra memory is then one new per-rank layer plus that limit. ``dst_block_ids``: as
    for :func:`migrate_kv` (old block ``block_ids[i]`` → new block ``dst_block_ids[i]``).
    Returns (new layers of this rank, stats).
    """
    stats = MigrationStats()
    t0 = time.perf_counter()
    new_layers = {} if new_layers is None else new_layers
    ids = block_ids.to(device=_device_of(old_layers, new_layers), dtype=torch.long)
    dids = ids if dst_block_ids is None else dst_block_ids.to(device=ids.device, dtype=torch.long)
    if dids.numel() != ids.numel():
        raise ValueError(f"dst_block_ids has {dids.numel()} ids, block_ids {ids.numel()}")
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
        pieces = _chunks(ids, old_view.num_kv_heads, old_t, new_t, staging_limit_bytes)
        dpieces = _chunks(dids, old_view.num_kv_heads, old_t, new_t, staging_limit_bytes)
        for cids, dcids in zip(pieces, dpieces):
            handles, recvs, staging = [], [], 0
            for s in slices:
                if (s.src != rank and s.dst != rank) or cids.numel() == 0:
                    continue
                if s.src == rank and s.dst == rank:
                    o_lo = old_view.local_head(s.head_start)
                    n_lo = new_view.local_head(s.head_start)
                    part = old_t[cids, o_lo:o_lo + s.heads]
                    new_t[dcids, n_lo:n_lo + s.heads] = part
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
                    new_t[dcids, n_lo:n_lo + s.heads] = buf
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
