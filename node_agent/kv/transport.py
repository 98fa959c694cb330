"""How ranks reach each other's KV during a migration: the :class:`Transport` protocol (point to
point sends and receives, the staged path) and :class:`PeerAccess` (direct reads of a peer's layer
tensors, the direct path); :class:`TorchDistTransport` over a torch.distributed group and
:class:`LocalTransport` for ranks emulated as threads of one process (tests, benchmarks)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from node_agent.kv.common import nbytes


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
        self.bytes_copied += nbytes(recv.tensor)
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

