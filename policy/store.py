"""The decision log and the modes in Redis (I/O edge behind ``policy.service.DecisionStorePort``).

Keys (prefix ``remp:policy:`` by default): ``decisions`` list of Decision JSON, oldest first,
trimmed to the newest ``keep``; ``modes`` hash node → mode (``*`` is the default mode).
An unreachable Redis is :class:`remp.errors.Unavailable`; the service then keeps going in memory.
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from remp import redisconn
from remp.redisproc import redact_url
from remp.errors import Unavailable


class RedisDecisionStore:
    def __init__(self, url: str, prefix: str = "remp:policy:", timeout: float = 2.0):
        self.url, self.p = url, prefix
        # one server, or redis+sentinel://… (follows the primary across a failover)
        self.r = redisconn.client(url, max_connections=8, timeout=timeout,
                                  decode_responses=True, socket_timeout=timeout,
                                  socket_connect_timeout=timeout)

    @property
    def k_decisions(self) -> str:
        return f"{self.p}decisions"

    @property
    def k_modes(self) -> str:
        return f"{self.p}modes"

    async def _call(self, aw):
        try:
            out = await aw
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as exc:
            raise Unavailable(f"redis at {redact_url(self.url)} unreachable: {exc}") from None
        redisconn.raise_if_cancelling()  # redis-py may have dropped a cancel (remp.redisconn)
        return out

    async def load(self, limit: int) -> tuple[list[dict[str, Any]], dict[str, str]]:
        rows = await self._call(self.r.lrange(self.k_decisions, -limit, -1))
        modes = await self._call(self.r.hgetall(self.k_modes))
        docs = []
        for row in rows:
            try:
                docs.append(json.loads(row))
            except json.JSONDecodeError:
                continue
        return docs, dict(modes)

    async def append(self, doc: dict[str, Any], keep: int) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.rpush(self.k_decisions, json.dumps(doc))
        pipe.ltrim(self.k_decisions, -keep, -1)
        await self._call(pipe.execute())

    async def save_modes(self, modes: dict[str, str]) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.k_modes)
        if modes:
            pipe.hset(self.k_modes, mapping=modes)
        await self._call(pipe.execute())

    async def close(self) -> None:
        await self.r.aclose()
