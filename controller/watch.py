"""Watch streams: ONE reader of the Redis event stream per controller process, fanned out in
process to a bounded queue per stream, and the caps on how many streams may be open.

A Watch stream holds no Redis connection: :class:`EventHub` reads the ``events`` stream with
one XREAD loop on its own connection and hands each event to every :class:`Subscription` whose
filter matches (:class:`Fanout`, pure). A subscription whose queue is full (a reader slower
than the events) is dropped with RESOURCE_EXHAUSTED; it never holds the others up. When Redis
goes away every open stream ends with UNAVAILABLE (clients reconnect; ``include_history``
replays what they missed; ``after_id`` resumes exactly after the last event received).
:class:`WatchLimits` caps concurrent streams per caller
(:attr:`remp.auth.Caller.key`) and in total.
"""

from __future__ import annotations

import asyncio
import re
from collections import deque
from collections.abc import Iterable

from controller.model import Event
from controller.store import parse_event
from remp import logs
from remp.errors import InvalidArgument, RempError, ResourceExhausted, Unavailable

log = logs.get_logger("remp.controller.watch")


def id_key(event_id: str) -> tuple[int, int]:
    """A Redis stream id ("1700000000000-3") as a comparable pair."""
    ms, _, seq = event_id.partition("-")
    return int(ms or 0), int(seq or 0)


U64_MAX = 2**64 - 1
_DIGITS = re.compile(r"[0-9]{1,20}")


def stream_id(text: str, field: str = "after_id") -> tuple[int, int]:
    """A caller's stream id "<ms>-<seq>" (the syntax and length are
    :data:`controller.validation.STREAM_ID`'s) as a pair; InvalidArgument when a part is out
    of Redis's range."""
    ms, sep, seq = text.partition("-")
    if not (sep and len(text) <= 41 and _DIGITS.fullmatch(ms) and _DIGITS.fullmatch(seq)):
        raise InvalidArgument(f"{field}: a Redis stream id <ms>-<seq> as Event.id carries it "
                              f"(got {text[:41]!r})")
    key = int(ms), int(seq)
    if max(key) > U64_MAX:
        raise InvalidArgument(f"{field}: each part of a stream id is at most {U64_MAX} "
                              f"(got {text[:41]!r})")
    return key


def maybe_trimmed(after: str, first_retained: str, removed: int) -> bool:
    """Whether events after ``after`` may have been trimmed from the stream: some were removed
    (``removed`` > 0: XADD MAXLEN trims the oldest) and ``after`` is older than the oldest
    retained event. Conservative by one case: when exactly the events up to ``after`` were
    trimmed, nothing was missed, but that cannot be told from the stream (pure)."""
    return removed > 0 and bool(first_retained) and id_key(after) < id_key(first_retained)


class WatchLimits:
    """Concurrent Watch streams, per caller and in total (pure)."""

    def __init__(self, per_caller: int, total: int):
        self.per_caller, self.total = per_caller, total
        self.open: dict[str, int] = {}
        self.count = 0

    def acquire(self, key: str) -> None:
        mine = self.open.get(key, 0)
        if mine >= self.per_caller:
            raise ResourceExhausted(
                f"too many Watch streams from {key}: {mine} open, at most {self.per_caller} per "
                "caller; close one (or filter one stream by node) and retry")
        if self.count >= self.total:
            raise ResourceExhausted(
                f"too many Watch streams on this controller: {self.count} open, at most "
                f"{self.total} in total; retry later")
        self.open[key] = mine + 1
        self.count += 1

    def release(self, key: str) -> None:
        n = self.open.get(key, 0) - 1
        if n > 0:
            self.open[key] = n
        else:
            self.open.pop(key, None)
        self.count = max(0, self.count - 1)


class Subscription:
    """One Watch stream's filter and bounded queue. ``start_id``: the last event id delivered
    before it subscribed (history up to it is read separately; everything after arrives here)."""

    def __init__(self, node: str, switch_id: str, maxsize: int, start_id: str,
                 rollout_id: str = ""):
        self.node, self.switch_id, self.maxsize, self.start_id = node, switch_id, maxsize, start_id
        self.rollout_id = rollout_id
        self._items: deque[Event] = deque()
        self._wake = asyncio.Event()
        self.error: RempError | None = None

    def matches(self, ev: Event) -> bool:
        return (not self.node or ev.node == self.node) and \
            (not self.switch_id or ev.switch_id == self.switch_id) and \
            (not self.rollout_id or ev.rollout_id == self.rollout_id)

    def offer(self, ev: Event) -> bool:
        """Queue ``ev``; False when the queue is full (the caller drops this subscription)."""
        if len(self._items) >= self.maxsize:
            return False
        self._items.append(ev)
        self._wake.set()
        return True

    def fail(self, err: RempError) -> None:
        if self.error is None:
            self.error = err
        self._wake.set()

    async def get(self) -> Event:
        """The next event; raises the error the subscription was ended with."""
        while True:
            if self.error is not None:
                raise self.error
            if self._items:
                return self._items.popleft()
            self._wake.clear()
            await self._wake.wait()


class Fanout:
    """The subscriptions and the hand-out of events to them (pure: no I/O)."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self.subs: set[Subscription] = set()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.subs)

    def subscribe(self, node: str, switch_id: str, start_id: str,
                  rollout_id: str = "") -> Subscription:
        sub = Subscription(node, switch_id, self.maxsize, start_id, rollout_id)
        self.subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subs.discard(sub)

    def publish(self, events: Iterable[Event]) -> list[Subscription]:
        """Offer each event to every matching subscription; those whose queue is full are
        ended (RESOURCE_EXHAUSTED) and removed. Returns the dropped ones."""
        dropped = []
        for ev in events:
            for sub in list(self.subs):
                if sub.matches(ev) and not sub.offer(ev):
                    sub.fail(ResourceExhausted(
                        f"this Watch stream fell {sub.maxsize} events behind (the client reads "
                        f"slower than events arrive) and was closed so that it holds no one "
                        f"up; reconnect with after_id = the id of the last event received to "
                        f"replay what was missed"))
                    self.subs.discard(sub)
                    dropped.append(sub)
        self.dropped += len(dropped)
        return dropped

    def fail_all(self, err: RempError) -> None:
        for sub in self.subs:
            sub.fail(err)
        self.subs.clear()


class EventHub:
    """The process's one reader of the event stream. ``reader`` is a :class:`Store` (its own
    connection pool: this loop is its only user): ``last_event_id()`` and
    ``read_raw_events(after, block_ms, count)``."""

    def __init__(self, reader, queue_size: int = 1000, block_ms: int = 1000, batch: int = 500):
        self.reader, self.block_ms, self.batch = reader, block_ms, batch
        self.fanout = Fanout(queue_size)
        self.last_id: str | None = None
        self.ready = False
        self.on_drop = None  # hook: called with the number of dropped subscriptions

    def subscribe(self, node: str, switch_id: str, rollout_id: str = "") -> Subscription:
        if not self.ready or self.last_id is None:
            raise Unavailable("the controller cannot read its event stream (Redis unreachable);"
                              " retry Watch shortly")
        return self.fanout.subscribe(node, switch_id, self.last_id, rollout_id)

    def unsubscribe(self, sub: Subscription) -> None:
        self.fanout.unsubscribe(sub)

    async def run(self) -> None:
        delay, down_logged = 0.2, False
        while True:
            try:
                if self.last_id is None:
                    self.last_id = await self.reader.last_event_id()
                self.ready = True
                batch = await self.reader.read_raw_events(self.last_id, self.block_ms, self.batch)
            except Unavailable as exc:
                self.ready = False
                self.fanout.fail_all(Unavailable(
                    f"the event stream was interrupted (Redis unreachable); reconnect with "
                    f"after_id = the id of the last event received to replay what was missed: "
                    f"{exc}"))
                if not down_logged:
                    log.warning("controller.watch_reader_down", error=str(exc))
                    down_logged = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            if down_logged:
                log.info("controller.watch_reader_up", last_id=self.last_id)
                down_logged = False
            delay = 0.2
            if not batch:
                continue
            self.last_id = batch[-1][0]
            if not self.fanout.subs:
                continue  # nobody listens: advance without parsing
            dropped = self.fanout.publish(parse_event(eid, raw) for eid, raw in batch)
            if dropped:
                log.warning("controller.watch_slow_reader_dropped", streams=len(dropped),
                            last_id=self.last_id)
                if self.on_drop is not None:
                    self.on_drop(len(dropped))
