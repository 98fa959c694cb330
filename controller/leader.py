"""Controller high availability: one leader among the controllers, through a lease in Redis
(docs/rollout.md §5; the Kubernetes-Lease / etcd-election pattern, on the Redis every
controller already shares — no consensus protocol of our own).

- ``leader`` key: ``{"id", "address", "term"}`` with a TTL of ``lease_s``; ``leader:term`` an
  integer, +1 per new leader (a fencing term: the agents' per-node epoch stays the fence of
  the switches themselves).
- A follower tries to take the key every ``poll_s``; the leader renews it every ``lease_s/3``
  and counts its own lease from *before* each renew, on its monotonic clock: once
  ``lease_s - margin_s`` has passed without a successful renew it steps down on its own, before
  any other controller can have taken over (the key outlives that by ``margin_s``).
- Handover after the leader's kill -9: at most ``lease_s`` (the key's TTL) + ``poll_s`` + what
  the new leader does on taking over (recovering unfinished switches, resuming rollouts).

:class:`Leadership` is what the core asks (``is_leader``, ``require``); :class:`Solo` is the
single-controller default (always the leader), :class:`LeaderLease` the Redis one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from remp import logs
from remp.errors import NotLeader
from remp.redisconn import raise_if_cancelling

log = logs.get_logger("remp.controller.leader")


_ACQUIRE = """
-- KEYS: leader, term;  ARGV: id, address, ttl_ms
local cur = redis.call('GET', KEYS[1])
if cur then
  local c = cjson.decode(cur)
  if c['id'] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return {1, c['term'], cur}
  end
  return {0, c['term'], cur}
end
local term = redis.call('INCR', KEYS[2])
local v = cjson.encode({id = ARGV[1], address = ARGV[2], term = term})
redis.call('SET', KEYS[1], v, 'PX', ARGV[3])
return {1, term, v}
"""

_RENEW = """
-- KEYS: leader;  ARGV: id, term, ttl_ms
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local c = cjson.decode(cur)
if c['id'] ~= ARGV[1] or tostring(c['term']) ~= ARGV[2] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

_RESIGN = """
-- KEYS: leader;  ARGV: id
local cur = redis.call('GET', KEYS[1])
if cur and cjson.decode(cur)['id'] == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""


class Solo:
    """One controller: always the leader."""

    is_leader = True
    term = 0
    leader_address = ""

    def require(self) -> None:
        pass


class LeaderLease:
    """The lease loop of one controller. ``on_elected`` runs when it becomes the leader (the
    core starts its drivers), ``on_deposed`` when it stops being it (the core stops them)."""

    def __init__(self, r: aioredis.Redis, prefix: str, ident: str, address: str, *,
                 lease_s: float = 3.0, poll_s: float = 0.25, margin_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < margin_s < lease_s:
            raise ValueError("margin_s must be in (0, lease_s)")
        self.r, self.ident, self.address = r, ident, address
        self.k_leader, self.k_term = f"{prefix}leader", f"{prefix}leader:term"
        self.lease_s, self.poll_s, self.margin_s, self.clock = lease_s, poll_s, margin_s, clock
        self._acquire = r.register_script(_ACQUIRE)
        self._renew = r.register_script(_RENEW)
        self._resign = r.register_script(_RESIGN)
        self.is_leader = False
        self.term = 0
        self.leader_address = ""
        self.changed = asyncio.Event()  # set at every change of leadership (tests, metrics)

    def require(self) -> None:
        """Writes are the leader's: anywhere else NotLeader (UNAVAILABLE) naming the leader."""
        if not self.is_leader:
            raise NotLeader(self.leader_address)

    @property
    def _ttl_ms(self) -> int:
        return int(self.lease_s * 1000)

    async def try_acquire(self) -> bool:
        ok, term, raw = await self._acquire(keys=[self.k_leader, self.k_term],
                                            args=[self.ident, self.address, self._ttl_ms])
        try:
            self.leader_address = json.loads(raw).get("address", "")
        except (TypeError, ValueError):
            self.leader_address = ""
        if ok:
            self.term = int(term)
        return bool(ok)

    async def renew(self) -> bool:
        return bool(await self._renew(keys=[self.k_leader],
                                      args=[self.ident, self.term, self._ttl_ms]))

    async def resign(self) -> None:
        try:
            await self._resign(keys=[self.k_leader], args=[self.ident])
        except (aioredis.RedisError, OSError):
            pass

    async def run(self, on_elected: Callable[[], Awaitable[None]],
                  on_deposed: Callable[[], Awaitable[None]]) -> None:
        """Until cancelled: follow, lead, step down when the lease cannot be kept.

        A cancellation is honoured even where something below swallowed it: Python 3.11's
        ``asyncio.wait_for`` can drop one that lands as the renew completes, and a client may
        turn it into a connection error. The task's pending cancel count says so; the loop checks
        it at every turn (a shutdown that hung there kept a test waiting forever)."""
        try:
            while True:
                raise_if_cancelling()
                if not self.is_leader:
                    try:
                        got = await self.try_acquire()
                    except (aioredis.RedisError, OSError):
                        raise_if_cancelling()
                        got = False
                    if not got:
                        await asyncio.sleep(self.poll_s)
                        continue
                    valid_until = self.clock() + self.lease_s - self.margin_s
                    self.is_leader = True
                    self.changed.set()
                    log.info("controller.leading", term=self.term, address=self.address)
                    await on_elected()
                # leading: renew every lease/3; step down when the lease may have run out
                await asyncio.sleep(self.lease_s / 3)
                sent = self.clock()
                try:
                    ok = await asyncio.wait_for(self.renew(), timeout=max(
                        0.05, valid_until - self.clock()))
                    lost = not ok  # the key is gone or another controller's: no longer ours
                except (aioredis.RedisError, OSError, TimeoutError):
                    raise_if_cancelling()
                    ok, lost = False, False
                if ok:
                    valid_until = sent + self.lease_s - self.margin_s
                    continue
                if not lost and self.clock() < valid_until:
                    continue  # Redis did not answer, with lease left: try again
                self.is_leader = False
                self.leader_address = ""
                self.changed.set()
                log.warning("controller.stepped_down", term=self.term,
                            detail="the lease could not be renewed in time")
                await on_deposed()
        finally:
            if self.is_leader:
                self.is_leader = False
                await self.resign()
