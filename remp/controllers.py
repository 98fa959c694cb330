"""Clients of a group of controllers (controller HA, docs/rollout.md §5): one list of addresses,
writes that follow the leader, and Watch streams that resume after the last event id.

Every controller answers reads, Watch, RegisterNode and Heartbeat; only the leader takes the
other writes. A follower refuses them with UNAVAILABLE ``not the leader; leader at HOST:PORT``
and the trailing metadata ``remp-leader`` (:class:`remp.errors.NotLeader`). A client here:

- sends the call to the controller it talks to now (the first address at the start);
- refused by a follower naming a leader it has not tried: sends it once more there;
- a controller it cannot connect to (the call never left), or a follower that knows no leader:
  tries the next address it has not tried;
- anything else (the leader's own answer, an UNAVAILABLE about an agent or Redis, a call cut
  off mid-way whose effect is unknown) is the answer, raised as it is;
- it stays with the controller that answered.

With ``retry_s`` a round in which a follower refused the call and no controller acted on it
(leadership changing hands: the leader it names was killed a moment ago) starts again after a
short pause, until ``retry_s`` has passed: a new leader is elected within the lease (3 s by
default). When no controller answers at all the call fails at once.

:meth:`AioControllers.watch` is ``Controller.Watch`` that outlives its controller: when the
stream breaks it reconnects — to the same controller or the next — with ``after_id`` = the id
of the last event it yielded, so no event is lost or repeated. When the events after that id
are no longer retained it says so (``on_gap``) and starts over with every retained event.

The CLI uses :class:`SyncControllers` (blocking calls) and runs :meth:`AioControllers.watch` in
a thread; the policy and the dashboard use :class:`AioControllers`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from remp.auth import Credentials, aio_channel, sync_channel
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.errors import NOT_SENT
from remp.grpc_util import channel_options

MAX_CONTROLLERS = 16
# what the operator's clients (CLI, dashboard) give a write while leadership changes hands
LEADER_RETRY_S = 10.0
MAX_ADDRESS = 255
LEADER_KEY = "remp-leader"
# Watch streams end with these when their controller goes away or drops them: resume
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNKNOWN,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.DEADLINE_EXCEEDED})


def address_ok(a: str) -> bool:
    host, _, port = a.rpartition(":")
    return (bool(host) and port.isdigit() and 0 < int(port) < 65536 and len(a) <= MAX_ADDRESS
            and a.isprintable() and not any(c.isspace() or c in ",/@" for c in a))


def addresses(text: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` (or a list) as a list: 1 to :data:`MAX_CONTROLLERS` host:port, duplicates
    dropped. ValueError naming the first bad one."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for a in (x.strip() for x in items):
        if not a:
            continue
        if not address_ok(a):
            raise ValueError(f"controller address {a[:64]!r} is not host:port")
        if a not in out:
            out.append(a)
    if not 1 <= len(out) <= MAX_CONTROLLERS:
        raise ValueError(f"controller: 1 to {MAX_CONTROLLERS} host:port addresses, "
                         f"comma-separated (got {len(out)})")
    return out


def leader_of(exc: grpc.RpcError) -> str:
    """The leader a follower named (trailing metadata ``remp-leader``), "" when none or when
    it is not a host:port."""
    try:
        md = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - a failed call may carry no metadata at all
        return ""
    leader = next((v for k, v in md if k == LEADER_KEY), "")
    return leader if isinstance(leader, str) and address_ok(leader) else ""


def refused_unsent(exc: grpc.RpcError) -> bool:
    """The call was not acted on: a follower refused it (not the leader) or it never reached
    the controller."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    d = (exc.details() or "").lower()
    return "not the leader" in d or any(t in d for t in NOT_SENT)


def next_address(exc: grpc.RpcError, addrs: Sequence[str], tried: set[str]) -> str:
    """Where a call that failed with ``exc`` goes next ("": nowhere, ``exc`` is the answer):
    the leader a follower named, unless tried; else, when the call was not acted on, the next
    address not tried (pure)."""
    leader = leader_of(exc)
    if leader and leader not in tried:
        return leader
    if refused_unsent(exc):
        return next((a for a in addrs if a not in tried), "")
    return ""


class _Attempt:
    """One call's attempts: the addresses tried this round, when it started, and whether a
    follower refused it this round (leadership changing hands: worth another round)."""

    def __init__(self):
        self.tried: set[str] = set()
        self.started = time.monotonic()
        self.follower = False


class _Route:
    """The addresses and the one talked to now."""

    def __init__(self, address: str | Sequence[str], retry_s: float):
        self.addresses = addresses(address)
        self.address = self.addresses[0]
        self.retry_s = retry_s

    def advance(self, exc: grpc.RpcError, at: _Attempt) -> tuple[str, float]:
        """(the next address, seconds to wait first); ("", 0) to give up with ``exc``."""
        at.tried.add(self.address)
        at.follower = at.follower or "not the leader" in (exc.details() or "").lower()
        nxt = next_address(exc, self.addresses, at.tried)
        if nxt:
            return nxt, 0.0
        if self.retry_s and at.follower and refused_unsent(exc) and \
                time.monotonic() - at.started < self.retry_s:
            at.tried.clear()  # a new round: a leader may be elected meanwhile
            at.follower = False
            return leader_of(exc) or self.addresses[0], 0.25
        return "", 0.0


class _Controllers:
    """What both clients hold: the route over the addresses, the credentials, one channel per
    address, the default timeout."""

    def __init__(self, address: str | Sequence[str], creds: Credentials | None,
                 timeout: float, retry_s: float):
        self._route = _Route(address, retry_s)
        self.timeout, self._creds = timeout, creds
        self._channels: dict = {}

    @property
    def addresses(self) -> list[str]:
        return self._route.addresses

    @property
    def address(self) -> str:
        """The controller talked to now (the leader after a write was redirected)."""
        return self._route.address


class AioControllers(_Controllers):
    """grpc.aio client of the controllers. ``address``: one host:port, several
    comma-separated, or a list. ``call("Reconfigure", req)`` follows the leader; ``stub``
    attribute-style: ``await c.stub.ListNodes(req, timeout=5)`` does the same."""

    def __init__(self, address: str | Sequence[str], creds: Credentials | None = None, *,
                 timeout: float = 10.0, retry_s: float = 0.0):
        super().__init__(address, creds, timeout, retry_s)
        self.stub = _AioProxy(self)

    def _stub(self, address: str) -> controller_pb2_grpc.ControllerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = aio_channel(address, self._creds,
                                                       options=channel_options())
        return controller_pb2_grpc.ControllerStub(ch)

    def channel(self, address: str | None = None) -> grpc.aio.Channel:
        self._stub(address or self.address)
        return self._channels[address or self.address]

    async def call(self, name: str, req, timeout: float | None = None, **kw):
        at = _Attempt()
        while True:
            try:
                return await getattr(self._stub(self.address), name)(
                    req, timeout=self.timeout if timeout is None else timeout, **kw)
            except grpc.aio.AioRpcError as exc:
                nxt, wait = self._route.advance(exc, at)
                if not nxt:
                    raise
                if wait:
                    await asyncio.sleep(wait)
                self._route.address = nxt

    async def watch(self, req: controller_pb2.WatchRequest, *, give_up_s: float = 30.0,
                    on_gap: Callable[[str, str], None] | None = None,
                    on_resume: Callable[[str, str], None] | None = None
                    ) -> AsyncIterator[controller_pb2.Event]:
        """``Controller.Watch(req)`` that reconnects when its stream breaks (any controller
        serves it), resuming with ``after_id`` = the last event yielded: across a controller's
        death no event is lost or repeated. Raises the stream's error when it is not one a
        reconnect mends (bad request, credentials) or when no controller took the stream back
        for ``give_up_s``. ``on_gap(after_id, details)``: the events after the last one were
        trimmed before it could resume (it then replays every retained event).
        ``on_resume(address, after_id)``: after each reconnect."""
        last = req.after_id
        broken_since: float | None = None  # since when no controller has held the stream
        tried: set[str] = set()
        while True:
            r = controller_pb2.WatchRequest()
            r.CopyFrom(req)
            r.after_id = last
            call = self._stub(self.address).Watch(r)
            err: grpc.aio.AioRpcError | None = None
            opened: float | None = None
            try:
                await call.initial_metadata()  # the controller sends it once it took the stream
                if not call.done():
                    opened = time.monotonic()
                    if broken_since is not None and on_resume is not None:
                        on_resume(self.address, last)
                async for ev in call:
                    broken_since, tried = None, set()
                    last = ev.id
                    yield ev
            except grpc.aio.AioRpcError as exc:
                err = exc
            finally:
                call.cancel()
            if err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION and \
                    last and "no longer retained" in (err.details() or ""):
                if on_gap is not None:
                    on_gap(last, err.details() or "")
                last, req = "", _with_history(req)
                continue
            if err is not None and err.code() not in RESUMABLE:
                raise err
            now = time.monotonic()
            if opened is not None and now - opened >= 1.0:
                broken_since, tried = None, set()  # it held a while: a new break
            broken_since = broken_since if broken_since is not None else now
            if now - broken_since > give_up_s:
                if err is not None:
                    raise err
                return
            tried.add(self.address)
            leader = leader_of(err) if err is not None else ""
            self._route.address = next(
                (a for a in (leader, *self.addresses) if a and a not in tried), self.address)
            if len(tried) >= len(self.addresses):
                tried.clear()
                await asyncio.sleep(min(1.0, 0.1 + (now - broken_since) / 4))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


def _with_history(req: controller_pb2.WatchRequest) -> controller_pb2.WatchRequest:
    r = controller_pb2.WatchRequest()
    r.CopyFrom(req)
    r.after_id = ""
    r.include_history = True
    return r


class _AioProxy:
    def __init__(self, c: AioControllers):
        self._c = c

    def __getattr__(self, name: str):
        async def call(req, timeout: float | None = None, **kw):
            return await self._c.call(name, req, timeout, **kw)
        return call


class SyncControllers(_Controllers):
    """Blocking client of the controllers (the CLI), with the same following as
    :class:`AioControllers`. A context manager; ``stub.Reconfigure(req, timeout=30)`` follows
    the leader; the exception of the last attempt (grpc.RpcError) is raised as it is."""

    def __init__(self, address: str | Sequence[str], creds: Credentials | None = None, *,
                 timeout: float = 10.0, retry_s: float = 0.0):
        super().__init__(address, creds, timeout, retry_s)
        self.stub = _SyncProxy(self)

    def channel(self, address: str | None = None) -> grpc.Channel:
        a = address or self.address
        ch = self._channels.get(a)
        if ch is None:
            ch = self._channels[a] = sync_channel(a, self._creds, options=channel_options())
        return ch

    def call(self, name: str, req, timeout: float | None = None, **kw):
        at = _Attempt()
        while True:
            stub = controller_pb2_grpc.ControllerStub(self.channel())
            try:
                return getattr(stub, name)(
                    req, timeout=self.timeout if timeout is None else timeout, **kw)
            except grpc.RpcError as exc:
                nxt, wait = self._route.advance(exc, at)
                if not nxt:
                    raise
                if wait:
                    time.sleep(wait)
                self._route.address = nxt

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def __enter__(self) -> "SyncControllers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SyncProxy:
    def __init__(self, c: SyncControllers):
        self._c = c

    def __getattr__(self, name: str):
        def call(req, timeout: float | None = None, **kw):
            return self._c.call(name, req, timeout, **kw)
        return call
