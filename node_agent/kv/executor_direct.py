"""The direct executor: every receiving rank pulls each slice of a layer straight from the source
tensors (through the transport's :class:`~node_agent.kv.transport.PeerAccess`) into its new
tensor, in one pass — one kernel launch per layer (Triton where importable on CUDA, else torch
ops); no staging, so the extra memory is the new layer alone."""

from __future__ import annotations

import math
import threading

import torch

from node_agent.kv import common
from node_agent.kv.common import (IdMap, MigrationStats, SliceView, as_bytes, each_layer,
                                  held_bytes, memory_order, nbytes)
from node_agent.kv.transport import PeerAccess

DIRECT_KERNEL = "auto"
"""What moves the bytes on the direct path: ``"auto"`` (the Triton kernel for CUDA tensors where
Triton imports and the layout suits it, else torch ops), ``"triton"`` (an error where it cannot)
or ``"torch"`` (one strided copy per run of consecutive ids where there are at most
:data:`~node_agent.kv.common.RUN_COPY_MAX_RUNS`: one pass; else ``index_select`` /
``index_copy_`` in pieces of at most :data:`~node_agent.kv.common.STAGING_FRACTION` of the new
layer: two passes through that temporary)."""


def migrate_direct(rank, old_layers, old_view, new_view, todo, by_layer, idmap: IdMap, alloc_layer,
                   peer: PeerAccess, stats: MigrationStats, new_layers, done, fail_after_layers,
                   baseline: int) -> None:
    """The direct path of :func:`node_agent.kv.migrate.migrate_kv`. First every old layer of this
    rank that peers read is shared (all at once: a reader never waits for its source to reach a
    layer, so ranks do not advance in lock-step); then, layer by layer in the common layer order, a
    rank that receives allocates its new layer and pulls all its slices (local ones too) from the
    source tensors into it, closes what it opened, and a rank whose layer is read waits until its
    readers are done before it releases that old layer (the memory bound: the same release points as
    the staged path)."""
    n_ids = idmap.n
    kernels: set[str] = set()
    steps = {}
    for layer in todo:
        slices = by_layer[layer]
        incoming = [(s.src, old_view.local_head(s.head_start), new_view.local_head(s.head_start), s.heads)
                    for s in slices if s.dst == rank]
        outgoing = [s for s in slices if s.src == rank and s.dst != rank]
        steps[layer] = (incoming, len({s.dst for s in outgoing}), sum(s.heads for s in outgoing))
    last = len(todo) if fail_after_layers is None else min(len(todo), fail_after_layers)
    if n_ids:
        for layer in todo[:last]:
            incoming, readers, _ = steps[layer]
            needs_old = readers or any(src == rank for src, *_ in incoming)
            if needs_old and layer not in old_layers:
                raise RuntimeError(f"rank {rank}: the plan moves layer {layer} from it, but it holds no old layer {layer}")
            if readers:
                peer.share(layer, old_layers[layer], readers)
    held = held_bytes(old_layers, new_layers)
    per_block_head = None
    for layer in each_layer(todo, old_layers, stats, done, fail_after_layers):
        incoming, readers, out_heads = steps[layer]
        if incoming and layer not in new_layers:
            new_layers[layer] = alloc_layer(layer)
            held += nbytes(new_layers[layer])
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
        if old_t is not None:  # each_layer releases it next: its readers are done
            held -= nbytes(old_t)
        del old_t, new_t
    stats.kernel = "mixed" if len(kernels) > 1 else (kernels.pop() if kernels else "")


def _pull(work: list, new_t: torch.Tensor, idmap: IdMap) -> tuple[str, int]:
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


def _pull_torch(src_t, lo_s, dst_t, lo_d, heads, idmap: IdMap) -> int:
    sv = SliceView(src_t, memory_order(src_t), lo_s, heads)
    dv = SliceView(dst_t, memory_order(dst_t), lo_d, heads)
    same = sv.same_layout(dv)
    whole = idmap.rounds(dst_t.device, idmap.n)[0]
    if whole.jruns.count <= common.RUN_COPY_MAX_RUNS:  # one strided copy per joint run: one pass
        wide = same and sv.same_width(dv)  # memory-order views as wide elements: fewer of them
        for _, s0, d0, ln in whole.jruns.pairs():
            if wide:
                dv.m.narrow(dv.pb, d0, ln).copy_(sv.m.narrow(sv.pb, s0, ln))
            else:
                dv.exec.narrow(0, d0, ln).copy_(sv.exec.narrow(0, s0, ln))
        return 0
    step = max(1, min(idmap.n, int(common.STAGING_FRACTION * nbytes(dst_t)) // max(1, sv.nbytes(1))))
    rs = idmap.rounds(src_t.device, step)
    rd = idmap.rounds(dst_t.device, step) if dst_t.device != src_t.device else rs
    temp = 0
    for a, b in zip(rs, rd):
        if same:
            part = torch.index_select(sv.m, sv.pb, a.cids).to(dst_t.device)
            if part.dtype != dv.m.dtype or list(part.shape) != dv.buffer_shape(b.n):
                part = as_bytes(part).view(dv.m.dtype).view(dv.buffer_shape(b.n))
            dv.m.index_copy_(dv.pb, b.dcids, part)
        else:  # old and new tensors laid out differently
            part = sv.exec.index_select(0, a.cids).to(dst_t.device)
            dv.exec.index_copy_(0, b.dcids, part)
        temp = max(temp, nbytes(part))
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


def _pull_triton(work: list, new_t: torch.Tensor, idmap: IdMap) -> bool:
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

