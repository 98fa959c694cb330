"""The staged (collective) executors: slices travel through the transport's ``isend`` /
``irecv`` (gloo on CPU, NCCL on GPU, or :class:`~node_agent.kv.transport.LocalTransport`), gathered
into and scattered out of one staging buffer per migration, round by round.

:func:`migrate_staged` is the path :func:`node_agent.kv.migrate.migrate_kv` takes when the
transport offers no peer access; :func:`migrate_kv_reference` keeps the first executor (advanced
indexing) as the reference the fast ones are checked and benchmarked against."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from node_agent.kv import common
from node_agent.kv.common import (IdMap, MigrationStats, Round, SliceView, as_bytes, each_layer,
                                  held_bytes, memory_order, nbytes)
from node_agent.kv.plan import chunk_blocks, layers_todo, reference_chunks
from node_agent.kv.transport import Transport
from remp.kvplan import RankView, Slice

_ALIGN = 256


def migrate_staged(rank, old_layers, old_view, new_view, todo, by_layer, idmap: IdMap, alloc_layer,
                   transport: Transport, stats: MigrationStats, new_layers, done, fail_after_layers,
                   baseline: int, staging_limit_bytes, pool_blocks) -> None:
    """The staged path of :func:`node_agent.kv.migrate.migrate_kv`: layer by layer, each layer's
    blocks in rounds (:func:`~node_agent.kv.plan.chunk_blocks`, the same on every rank), every
    remote slice of a round gathered into the staging buffer (or sent from / received into the
    layer tensor itself when its bytes are one contiguous range), sent, received and scattered;
    the local slices copied beside or after the first round in flight."""
    n_ids = idmap.n
    stage = _Staging()
    for layer in each_layer(todo, old_layers, stats, done, fail_after_layers):
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
            step, local_step, beside = chunk_blocks(rank, slices, new_view.heads_per_rank, nb_new,
                                                    layer_bytes, per_block_head, staging_limit_bytes, n_ids)
            current = held_bytes(old_layers, new_layers) - baseline
            src_perm = memory_order(old_t) if old_t is not None else None
            dst_perm = memory_order(new_t) if new_t is not None else None
            local, remote = [], []
            for s in mine:
                sv = dv = None
                if s.src == rank:
                    sv = SliceView(old_t, src_perm, old_view.local_head(s.head_start), s.heads)
                if s.dst == rank:
                    dv = SliceView(new_t, dst_perm, new_view.local_head(s.head_start), s.heads)
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
        del old_t, new_t  # each_layer releases the old layer next


def _copy_local(sv: "SliceView", dv: "SliceView", rnd: Round, stage: "_Staging", busy: int) -> int:
    """Heads staying on this rank (maybe at another head offset or block id), staged after the
    first ``busy`` bytes of the staging buffer (the round in flight); returns temporary bytes used
    outside it."""
    n = rnd.n
    if sv.same_layout(dv):
        if rnd.jruns.count <= common.RUN_COPY_MAX_RUNS and sv.same_width(dv):
            for _, s0, d0, ln in rnd.jruns.pairs():
                dv.m.narrow(dv.pb, d0, ln).copy_(sv.m.narrow(sv.pb, s0, ln))
            return 0
        stage.ensure(_aligned(busy + sv.nbytes(n)))
        sv.gather(rnd.cids, rnd.runs, stage.view(busy, sv.buffer_shape(n), sv.m.dtype))
        dv.scatter(rnd.dcids, rnd.druns, stage.view(busy, dv.buffer_shape(n), dv.m.dtype))
        return 0
    part = sv.exec.index_select(0, rnd.cids)  # old and new tensors laid out differently
    dv.exec.index_copy_(0, rnd.dcids, part)
    return nbytes(part)


def _post_round(rank, layer, work, rnd: Round, stage, transport, stats):
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
            buf, wire = region, as_bytes(region)
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


def _finish_round(rnd: Round, handles, keep, scatters, transport) -> None:
    transport.wait(handles)
    for v, buf in scatters:
        v.scatter(rnd.dcids, rnd.druns, buf)

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
    :func:`~node_agent.kv.migrate.migrate_kv` at the tensor level (not wire-compatible with it: do
    not mix the two), and the same arguments (``old_layers`` consumed, ``layers``,
    ``fail_after_layers``, ``new_layers``, ``done``, ``dst_block_ids``) but these two:
    ``staging_limit_bytes`` (default: no limit) moves each layer in chunks of blocks so that this
    rank's staging buffers stay under about that many bytes (every rank must pass the same value);
    the peak extra memory is then one new per-rank layer plus that limit; there is no ``path``.
    Returns (new layers of this rank, stats).
    """
    stats = MigrationStats()
    t0 = time.perf_counter()
    new_layers = {} if new_layers is None else new_layers
    ids = block_ids.to(device=_device_of(old_layers, new_layers), dtype=torch.long)
    dids = ids if dst_block_ids is None else dst_block_ids.to(device=ids.device, dtype=torch.long)
    if dids.numel() != ids.numel():
        raise ValueError(f"dst_block_ids has {dids.numel()} ids, block_ids {ids.numel()}")
    baseline = held_bytes(old_layers, new_layers)
    by_layer, todo = layers_todo(plan, old_view, new_view, layers)
    for layer in each_layer(todo, old_layers, stats, done, fail_after_layers):
        slices = by_layer[layer]
        mine_new = rank in {s.dst for s in slices}
        if mine_new and layer not in new_layers:
            new_layers[layer] = alloc_layer(layer)
        old_t = old_layers.get(layer)
        new_t = new_layers.get(layer)
        pieces = reference_chunks(ids, old_view.num_kv_heads, old_t, new_t, staging_limit_bytes)
        dpieces = reference_chunks(dids, old_view.num_kv_heads, old_t, new_t, staging_limit_bytes)
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
                    stats.bytes_copied_locally += nbytes(part)
                    staging = max(staging, nbytes(part))
                elif s.src == rank:
                    o_lo = old_view.local_head(s.head_start)
                    buf = old_t[cids, o_lo:o_lo + s.heads].contiguous()
                    handles.append(transport.isend(buf, s.dst, tag=layer))
                    recvs.append((None, buf))  # keep the send buffer alive until waited
                    stats.bytes_sent += nbytes(buf)
                    staging += nbytes(buf)
                else:
                    shape = (cids.numel(), s.heads, *new_t.shape[2:])
                    buf = torch.empty(shape, dtype=new_t.dtype, device=new_t.device)
                    handles.append(transport.irecv(buf, s.src, tag=layer))
                    recvs.append((s, buf))
                    stats.bytes_received += nbytes(buf)
                    staging += nbytes(buf)
            current = held_bytes(old_layers, new_layers)
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, current + staging - baseline)
            transport.wait(handles)
            for s, buf in recvs:
                if s is not None:
                    n_lo = new_view.local_head(s.head_start)
                    new_t[dcids, n_lo:n_lo + s.heads] = buf
            del recvs, handles
        del old_t, new_t  # each_layer releases the old layer next
    stats.seconds = time.perf_counter() - t0
    return new_layers, stats


def _device_of(*dicts: dict[int, torch.Tensor]) -> torch.device:
    for d in dicts:
        for t in d.values():
            return t.device
    return torch.device("cpu")
