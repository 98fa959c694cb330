"""Peer-to-peer weight resharding: build this rank's new shard from the old shards the ranks
already hold (engine-agnostic: plain torch and a :class:`~node_agent.kv.transport.Transport`).

:func:`remp.weightplan.plan_weights` says, for every new rank, which slice of its new shard
sits on which old rank (or, only where no reachable old rank holds it, in the host store);
:func:`execute` runs that plan on one rank. Every rank of the world calls it with the same plan
(a rank outside the old topology holds nothing and only receives, a rank outside the new one
only sends). Moves run layer by layer in the plan's order (embedding, layers, final norm and LM
head): each layer's sends and receives are posted, then waited for, so at most one layer's
staging buffers exist at a time, and since every rank walks the same order no rank waits on a
move its peer has not reached. Tags are the moves' indices in the plan. Tensors travel as bytes
(``uint8`` views), so any dtype crosses gloo or NCCL unchanged, bit for bit.

:func:`verify` compares a rank's parameters with what the host store holds for its shard, bit
for bit (``--verify-weights``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from remp.topology import Topology
from remp.weightplan import Move, WeightPlan, WeightShape, shard

StoreTensor = Callable[[str], torch.Tensor]  # checkpoint tensor name -> the whole tensor


class ReshardError(RuntimeError):
    """A move of this rank failed (raised after its peers were served)."""


class WeightMismatch(RuntimeError):
    """A parameter differs from the host store's bytes for it (``verify``)."""


@dataclass
class ReshardStats:
    local_bytes: int = 0       # copied from this rank's own old shard
    peer_recv_bytes: int = 0   # received from other ranks
    peer_sent_bytes: int = 0   # sent to other ranks
    store_bytes: int = 0       # read from the host store (what no reachable rank held)
    zero_bytes: int = 0        # vocabulary padding, zero-filled
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(vars(self))


def _cut(t: torch.Tensor, dim: int | None, start: int, length: int) -> torch.Tensor:
    return t if dim is None else t.narrow(dim, start, length)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _need(params: Mapping[str, torch.Tensor] | None, name: str, dim: int | None, end: int,
          side: str) -> torch.Tensor:
    t = None if params is None else params.get(name)
    if t is None:
        raise ValueError(f"{side} shard has no parameter {name}")
    if dim is not None and (t.dim() <= dim or t.shape[dim] < end):
        raise ValueError(f"{side} parameter {name} {tuple(t.shape)} is too small for "
                         f"[{end}) along dimension {dim}")
    return t


def check(plan: WeightPlan, rank: int, old: Mapping[str, torch.Tensor] | None,
          new: Mapping[str, torch.Tensor] | None) -> None:
    """Raise ValueError unless ``old`` / ``new`` hold every parameter this rank's moves touch,
    large enough (call before :func:`execute`, and agree across ranks: a rank that raises
    inside ``execute`` leaves its peers waiting)."""
    for m in plan.moves:
        if m.dst == rank:
            _need(new, m.param, m.dim, m.dst_start + m.length, "the new")
        if m.src == rank and m.key is not None:
            _need(old, m.src_param, m.dim, m.src_start + m.length, "the old")


@torch.no_grad()
def execute(plan: WeightPlan, rank: int, old: Mapping[str, torch.Tensor] | None,
            new: Mapping[str, torch.Tensor] | None, transport, *,
            store: StoreTensor | None = None) -> ReshardStats:
    """Run ``plan`` on ``rank``: fill ``new`` (name → tensor, this rank's new shard; None when the
    rank leaves the topology) from ``old`` (its old shard; None when it held none), the peers
    (``transport``) and, for store moves, ``store``. Returns what it moved.

    A move that fails on this rank (a missing parameter, a store read) does not leave its peers
    waiting: its send or receive is still posted (zeros sent, bytes received into scratch) and
    the remaining moves run; the first error is raised at the end."""
    st = ReshardStats()
    t0 = time.perf_counter()
    errors: list[BaseException] = []
    indexed = list(enumerate(plan.moves))
    for _, layer_moves in itertools.groupby(indexed, key=lambda im: im[1].layer):
        handles: list = []
        keep: list[torch.Tensor] = []
        land: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tag, m in layer_moves:
            if m.dst != rank and m.src != rank:
                continue
            try:
                _one(m, tag, rank, old, new, transport, store, st, handles, keep, land)
            except Exception as exc:  # noqa: BLE001 - raised once the peers are served
                err = ReshardError(f"rank {rank}, {m.kind} move of {m.param} "
                                   f"(from {m.src_param or m.key}): {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                errors.append(err)
                if m.kind == "peer":  # keep the pairing: the peer's op must still complete
                    scratch = torch.zeros(m.nbytes, dtype=torch.uint8, device=_device(old, new))
                    keep.append(scratch)
                    post = transport.isend if m.src == rank else transport.irecv
                    handles.append(post(scratch, m.dst if m.src == rank else m.src, tag))
        if handles:
            transport.wait(handles)
        for dst, tmp in land:
            dst.copy_(tmp)
    st.seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return st


def _device(*shards) -> torch.device:
    for s in shards:
        for t in (s or {}).values():
            return t.device
    return torch.device("cpu")


def _one(m: Move, tag: int, rank: int, old, new, transport, store, st: ReshardStats,
         handles: list, keep: list, land: list) -> None:
    dim = m.dim
    if m.dst == rank:
        dst = _cut(new[m.param], dim, m.dst_start, m.length)
    if m.kind == "zero":
        dst.zero_()
        st.zero_bytes += m.nbytes
    elif m.kind == "store":
        if store is None:
            raise ValueError(f"{m.param}: the plan reads the host store and there is none")
        dst.copy_(_cut(store(m.key), dim, m.key_start, m.length))
        st.store_bytes += m.nbytes
    elif m.kind == "local":
        dst.copy_(_cut(old[m.src_param], dim, m.src_start, m.length))
        st.local_bytes += m.nbytes
    elif m.src == rank:  # peer: this rank sends
        buf = _cut(old[m.src_param], dim, m.src_start, m.length).contiguous()
        keep.append(buf)
        handles.append(transport.isend(_bytes(buf), m.dst, tag))
        st.peer_sent_bytes += m.nbytes
    else:  # peer: this rank receives
        tmp = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype,
                                                          device=dst.device)
        if tmp is not dst:
            land.append((dst, tmp))
        handles.append(transport.irecv(_bytes(tmp), m.src, tag))
        st.peer_recv_bytes += m.nbytes


@torch.no_grad()
def verify(shape: WeightShape, topo: Topology, rank: int, params: Mapping[str, torch.Tensor],
           store: StoreTensor) -> int:
    """Compare rank ``rank``'s parameters of ``topo`` with the host store's bytes for its shard
    (padding: zeros; the store's tensors cast to the parameters' dtype); raise :class:`WeightMismatch` naming the first difference. Returns the
    bytes compared."""
    names, pieces = shard(shape, topo, rank)
    for name, dims in names.items():
        got = params.get(name)
        if got is None or tuple(got.shape) != tuple(dims):
            raise WeightMismatch(f"rank {rank}: {name} is "
                                 f"{None if got is None else tuple(got.shape)}, expected {dims}")
    n = 0
    for p in pieces:
        got = _cut(params[p.param], p.dim, p.param_start, p.length)
        if p.key is None:
            ok = not bool(_bytes(got.contiguous()).any())
        else:
            # the store's dtype cast to the engine's, as a loader casts it (no-op when equal)
            want = _cut(store(p.key), p.dim, p.key_start, p.length).to(got.dtype)
            ok = torch.equal(_bytes(got.contiguous()), _bytes(want.contiguous()))
        if not ok:
            what = "padding" if p.key is None else f"{p.key}[{p.key_start}:{p.end}]"
            raise WeightMismatch(f"rank {rank}: {p.param} [{p.param_start}:"
                                 f"{p.param_start + p.length}] differs from the store's {what}")
        n += got.numel() * got.element_size()
    return n
