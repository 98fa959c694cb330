"""What every KV executor shares: the layer loop (order, test-only fault injection, release of
each old layer once moved, per-layer stats), the tuning constants, and the views of a layer's
tensors it moves bytes with — old → new block id maps and their runs of consecutive ids, and a
slice of heads seen in the tensor's memory order (the staged path's wire format: the slice's bytes
in that order, reinterpreted as wide elements where the layout allows)."""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


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


def nbytes(t: torch.Tensor) -> int:
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


def held_bytes(*layer_dicts: dict[int, torch.Tensor]) -> int:
    """Bytes of every layer tensor in ``layer_dicts`` (what a rank holds of the KV right now)."""
    return sum(nbytes(t) for d in layer_dicts for t in d.values())


def each_layer(todo: list[int], old_layers: dict[int, torch.Tensor], stats: MigrationStats,
               done: list[int] | None, fail_after_layers: int | None) -> Iterator[int]:
    """The layer loop of every executor: yields the layers of ``todo`` in order. Before a layer,
    the test-only fault: :class:`InjectedFault` once ``fail_after_layers`` layers are done. After
    the caller's work on a layer (the caller drops its own references to the layer's tensors
    first), the old layer is released from ``old_layers``, the layer appended to ``done`` and
    counted in ``stats``. A layer whose work raised is neither released nor counted."""
    for n_done, layer in enumerate(todo):
        if fail_after_layers is not None and n_done >= fail_after_layers:
            raise InjectedFault(f"injected fault in MIGRATE_KV after {n_done} layers")
        t = time.perf_counter()
        yield layer
        old_layers.pop(layer, None)  # release the old layer as soon as it has moved
        if done is not None:
            done.append(layer)
        stats.layers += 1
        stats.per_layer_seconds.append(time.perf_counter() - t)


class Round:
    """Positions [a, b) of the id lists: the source ids (on the device, and as runs of
    consecutive ids), the destination ids likewise, and the joint runs (both consecutive)."""

    __slots__ = ("n", "cids", "runs", "dcids", "druns", "jruns")

    def __init__(self, n, cids, runs, dcids, druns, jruns):
        self.n, self.cids, self.runs, self.dcids, self.druns, self.jruns = n, cids, runs, dcids, druns, jruns


class IdMap:
    """Old block ``src[i]`` → new block ``dst[i]``; host lists, runs, device copies and rounds."""

    def __init__(self, block_ids: torch.Tensor, dst_block_ids: torch.Tensor | None):
        src = torch.as_tensor(block_ids).to(device="cpu", dtype=torch.long).reshape(-1)
        self._src_in = block_ids
        self.src = src.tolist()
        self.n = len(self.src)
        self.src_starts = run_starts(src)
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
                self.dst, self.dst_starts = dl, run_starts(dst)
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

    def rounds(self, device: torch.device, step: int) -> list[Round]:
        """Pieces of ``step`` positions; built once per (device, step)."""
        key = (device, step)
        got = self._rounds.get(key)
        if got is None:
            sids, dids = self.on(device)
            got = []
            for a in range(0, self.n, step):
                b = min(self.n, a + step)
                runs = Runs(self.src, self.src_starts, a, b)
                if self.same:
                    c = sids[a:b]
                    got.append(Round(b - a, c, runs, c, runs, runs))
                else:
                    got.append(Round(b - a, sids[a:b], runs, dids[a:b], Runs(self.dst, self.dst_starts, a, b),
                                      Runs(self.src, self.joint, a, b, self.dst)))
            self._rounds[key] = got
        return got


class Runs:
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


def run_starts(ids: torch.Tensor) -> list[int]:
    """Positions i > 0 where ids[i] != ids[i-1] + 1 (a new run of consecutive ids starts)."""
    if ids.numel() < 2:
        return []
    return ((ids[1:] - ids[:-1]) != 1).nonzero().flatten().add(1).tolist()


class SliceView:
    """Heads [lo, lo + heads) of one layer tensor, in the tensor's memory order (``m``, dims
    permuted by stride, reinterpreted as wide elements where possible; ``pb`` = its block dim)
    and in executor order (``exec``: block, head, rest)."""

    def __init__(self, t: torch.Tensor, perm: list[int], lo: int, heads: int):
        self.exec = t.narrow(1, lo, heads)
        self.perm = perm
        self.pb = perm.index(0)
        m = t.permute(perm).narrow(perm.index(1), lo, heads)
        self.m = m if perm[-1] in (0, 1) else widen(m)
        self.elem = self.m.element_size()
        self.row_bytes = nbytes(self.m) // max(1, self.m.shape[self.pb]) if self.m.numel() else 0

    def nbytes(self, n: int) -> int:
        return n * self.row_bytes

    def buffer_shape(self, n: int) -> list[int]:
        shape = list(self.m.shape)
        shape[self.pb] = n
        return shape

    def same_layout(self, other: "SliceView") -> bool:
        """Same memory order of the dims that are not of size 1 in either tensor."""
        big = {d for d in range(self.exec.dim()) if self.exec.shape[d] > 1 and other.exec.shape[d] > 1}
        return [d for d in self.perm if d in big] == [d for d in other.perm if d in big]

    def same_width(self, other: "SliceView") -> bool:
        """Same element type and shape except the block dim (the pools may differ in size)."""
        if self.m.dtype != other.m.dtype or self.pb != other.pb or self.m.dim() != other.m.dim():
            return False
        return all(a == b for d, (a, b) in enumerate(zip(self.m.shape, other.m.shape)) if d != self.pb)

    def region(self, runs: Runs) -> torch.Tensor | None:
        """The chunk's bytes in the tensor itself, when they are one contiguous range."""
        if runs.count != 1:
            return None
        _, b0, ln = runs.list()[0]
        r = self.m.narrow(self.pb, b0, ln)
        return r if r.is_contiguous() else None

    def gather(self, cids: torch.Tensor, runs: Runs, buf: torch.Tensor) -> None:
        if runs.count <= RUN_COPY_MAX_RUNS:
            for o, b0, ln in runs.list():
                buf.narrow(self.pb, o, ln).copy_(self.m.narrow(self.pb, b0, ln))
        else:
            torch.index_select(self.m, self.pb, cids, out=buf)

    def scatter(self, cids: torch.Tensor, runs: Runs, buf: torch.Tensor) -> None:
        if runs.count <= RUN_COPY_MAX_RUNS:
            for o, b0, ln in runs.list():
                self.m.narrow(self.pb, b0, ln).copy_(buf.narrow(self.pb, o, ln))
        elif _SCATTER_OP == "index_put":
            self.m[(slice(None),) * self.pb + (cids,)] = buf
        else:
            self.m.index_copy_(self.pb, cids, buf)



def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as flat bytes: the wire format, whatever element type each side uses."""
    return t.reshape(-1).view(torch.uint8)


def memory_order(t: torch.Tensor) -> list[int]:
    """Dims ordered outermost → innermost in memory (by stride; size-1 dims, whose stride is
    meaningless, first)."""
    ones = [d for d in range(t.dim()) if t.shape[d] == 1]
    rest = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: -t.stride(d))
    return ones + rest


def widen(v: torch.Tensor) -> torch.Tensor:
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

