"""One way to reach Redis, plain or through Redis Sentinel (issue 17: Redis high availability).

A Redis *location* is one string, kept like every secret (environment or a 0600 file, never
argv):

- ``redis://[:password@]host:port/db`` (or ``rediss://``, ``unix://``): one server;
- ``redis+sentinel://[:password@]host:port[,host:port…]/service[/db]``: the primary of
  ``service`` as the sentinels at those addresses name it (``remp up --ha`` starts three
  sentinels and prints such a location). The password is the primary's (and its replicas');
  the sentinels are asked with the same one unless ``sentinel_password`` is given.

:func:`blocking_pool` gives what the controller's and the policy's stores build their clients
on: a pool that waits up to ``timeout`` for a free connection and then raises (the stores map
that to UNAVAILABLE). Through Sentinel the pool re-resolves the primary after a failover: the
next connection after the old one broke goes to the promoted replica.

:func:`write_acknowledged` runs a write and ``WAIT numreplicas timeout`` on one connection (WAIT
counts the writes of the connection that calls it): a record is acknowledged to a caller only
once a replica has it, so a failover to that replica loses no acknowledged record.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

SENTINEL_SCHEME = "redis+sentinel"
MAX_SENTINELS = 16
DEFAULT_SERVICE = "remp"


class NotReplicated(Exception):
    """``WAIT`` saw fewer replicas take a write than asked for, within its timeout."""

    def __init__(self, got: int, want: int, timeout_ms: int):
        super().__init__(f"the write reached {got} of {want} replica(s) within {timeout_ms} ms")
        self.got, self.want = got, want


@dataclass(frozen=True)
class SentinelLocation:
    sentinels: tuple[tuple[str, int], ...]
    service: str = DEFAULT_SERVICE
    db: int = 0
    password: str | None = field(default=None, repr=False)
    username: str | None = None


def raise_if_cancelling() -> None:
    """Raise CancelledError when the running task has a cancel request that was swallowed.

    A redis-py call cancelled at the moment its reply arrives can return the reply and leave
    the task's cancel request unanswered (seen on the controller's rollout driver: a task
    cancelled at a step-down read the switch's row and went on to its next step). Call it after
    an awaited Redis call in a loop that must stop when cancelled."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def is_sentinel_url(url: str) -> bool:
    return url.split(":", 1)[0].lower() == SENTINEL_SCHEME


def parse_sentinel_url(url: str) -> SentinelLocation:
    """``redis+sentinel://[:pw@]h1:p1,h2:p2/service[/db]`` → :class:`SentinelLocation`; a
    ValueError (without the password) for anything else."""
    parts = urlsplit(url)
    if parts.scheme.lower() != SENTINEL_SCHEME:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// location")
    netloc = parts.netloc
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, _, pw = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) or None)
    addrs = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel address {item.strip()[:64]!r} is not host:port")
        addrs.append((host.strip("[]"), int(port)))
    if not addrs or len(addrs) > MAX_SENTINELS:
        raise ValueError(f"1 to {MAX_SENTINELS} sentinel addresses are required")
    path = [p for p in parts.path.split("/") if p]
    service = unquote(path[0]) if path else DEFAULT_SERVICE
    if not service or len(service) > 64 or not service.replace("-", "").replace(
            "_", "").replace(".", "").isalnum():
        raise ValueError("the service name must be 1-64 characters of [A-Za-z0-9._-]")
    db = 0
    if len(path) > 1:
        if not path[1].isdigit():
            raise ValueError("the database must be a number")
        db = int(path[1])
    if len(path) > 2:
        raise ValueError("expected redis+sentinel://host:port[,host:port]/service[/db]")
    return SentinelLocation(tuple(addrs), service, db, password, username)


class BlockingSentinelConnectionPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """redis-py's Sentinel pool (finds the primary, follows failovers) with the blocking
    pool's bound: at most ``max_connections``, a caller waits up to ``timeout`` for one.
    (``SentinelConnectionPool`` alone raises at once when the pool is full.)"""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # the client's close (not a failover's reconnect): the
            # connections to the sentinels go too (they reconnect if the pool is used again)
            for s in self.sentinel_manager.sentinels:
                await s.connection_pool.disconnect()


def blocking_pool(url: str, *, max_connections: int, timeout: float,
                  sentinel_password: str | None = None, **connection_kwargs):
    """A connection pool for ``url`` (plain or ``redis+sentinel://``); ``connection_kwargs``
    are redis-py's (``decode_responses``, ``socket_timeout``, ``health_check_interval``,
    ``retry``…)."""
    if not is_sentinel_url(url):
        return aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **connection_kwargs)
    loc = parse_sentinel_url(url)
    auth = {"password": loc.password, "username": loc.username}
    s_pw = sentinel_password if sentinel_password is not None else loc.password
    sentinel_kwargs = {"password": s_pw,
                       "socket_timeout": connection_kwargs.get("socket_timeout", 2.0),
                       "socket_connect_timeout": connection_kwargs.get(
                           "socket_connect_timeout", 2.0)}
    manager = Sentinel(list(loc.sentinels), sentinel_kwargs=sentinel_kwargs, db=loc.db,
                       **auth, **connection_kwargs)
    return BlockingSentinelConnectionPool(
        loc.service, manager, max_connections=max_connections, timeout=timeout,
        **manager.connection_kwargs)


def client(url: str, *, max_connections: int = 32, timeout: float = 5.0,
           **connection_kwargs) -> aioredis.Redis:
    """A client on its own :func:`blocking_pool` (closing the client closes the pool)."""
    return aioredis.Redis.from_pool(blocking_pool(
        url, max_connections=max_connections, timeout=timeout, **connection_kwargs))


async def write_acknowledged(r: aioredis.Redis, replicas: int, timeout_ms: int,
                             command: tuple, *more: tuple):
    """Run ``command`` (and ``more``), then ``WAIT replicas timeout_ms`` on the same
    connection (a non-transactional pipeline); returns the first command's result, or raises
    :class:`NotReplicated`. ``replicas`` 0 runs the commands alone."""
    pipe = r.pipeline(transaction=False)
    for cmd in (command, *more):
        pipe.execute_command(*cmd)
    if replicas > 0:
        pipe.execute_command("WAIT", replicas, timeout_ms)
    results = await pipe.execute()
    if replicas > 0 and int(results[-1]) < replicas:
        raise NotReplicated(int(results[-1]), replicas, timeout_ms)
    return results[0]
