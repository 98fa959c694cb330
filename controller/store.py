"""Controller state in Redis. Every transition is one Lua script (atomic compare-and-set) that
also appends its event to the one event stream, so state and events never disagree.

Keys (prefix ``remp:`` by default; values are readable with redis-cli — records are stored as the
protobuf JSON of their message, :func:`controller.convert.to_json`; methods take the
:mod:`controller.model` dataclasses, or the messages themselves):

- ``node:{n}`` hash: ``reg`` (RegisterNodeRequest JSON), ``observed``/``desired`` ("TPxPPy"),
  ``lease_until`` (unix s), ``health`` (ready | lost), ``current`` (running switch id or ""),
  ``epoch`` (fencing epoch, +1 per switch), ``traffic`` (last TrafficSample JSON)
- ``nodes`` set of node names
- ``switch:{id}`` hash: ``node``, ``record`` (SwitchRecord JSON), ``phase`` (Phase number),
  ``outcome`` (a :class:`remp.transaction.Outcome` value: running | succeeded | rolled_back |
  failed | aborted | noop | unknown; the scripts below write 'running' and 'noop' literally),
  ``dispatched`` (0/1: written *before* ExecuteSwitch is sent), ``epoch``, ``request_id``
- ``reqid:{n}:{request_id}`` → switch id (idempotency, 7 days)
- ``history:{n}`` and ``history`` sorted sets of switch ids by start time
- ``unfinished`` set of switch ids whose outcome is still running (crash recovery)
- ``events`` stream: field ``e`` = Event JSON (without its id; the stream id is the Event id)
- ``rollout:{id}`` hash: ``state`` (RolloutState JSON), ``version``, ``status``, ``request_id``,
  ``created``, ``capacity`` (JSON), ``description``; ``rollouts`` sorted set of ids by creation
  time; ``rollouts:active`` set of ids not finished (resumed at start);
  ``rollout_req:{request_id}`` → id (7 days); ``node:{n}`` field ``rollout``: the active rollout
  holding the node ("" when none)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from controller.convert import from_json, to_json
from controller.model import Event, Registration
from remp.errors import NotFound, NotLeader, Unavailable
from remp import logs, redisconn
from remp.redisproc import redact_url
from remp.transaction import Outcome

EVENTS_MAXLEN = 100_000
TRAFFIC_KEEP = 20_000  # heartbeat samples kept per node (a week at 30 s)
REQID_TTL_S = 7 * 24 * 3600

_BEGIN = """
-- KEYS: node, reqid (or ""), switch, unfinished, history_node, history_all, events
-- ARGV: switch_id, record_json, started, target, request_id, event_json, maxlen, node, ttl,
--       observed (the topology the switch was planned from: it must still be the node's),
--       reg (the registration JSON it was planned from, "": not checked; another → 'moved'),
--       dispatched ('1': the intent to send ExecuteSwitch is written with it, one write less)
-- Refuses ('held', rollout id) a node an active rollout holds unless the request id is that
-- rollout's; ('lost') a node whose lease expired, ('draining') one being drained.
if redis.call('EXISTS', KEYS[1]) == 0 then return {'notfound', ''} end
if KEYS[2] ~= '' then
  local prev = redis.call('GET', KEYS[2])
  if prev then return {'dup', prev} end
end
if redis.call('HGET', KEYS[1], 'health') == 'lost' then return {'lost', ''} end
if redis.call('HGET', KEYS[1], 'draining') == '1' then return {'draining', ''} end
if ARGV[11] ~= '' and redis.call('HGET', KEYS[1], 'reg') ~= ARGV[11] then
  return {'moved', redis.call('HGET', KEYS[1], 'observed') or ''}
end
local cur = redis.call('HGET', KEYS[1], 'current')
if cur and cur ~= '' then return {'busy', cur} end
-- a node held by a rollout switches only for that rollout (request id 'rollout:{id}:...')
local held = redis.call('HGET', KEYS[1], 'rollout')
if held and held ~= '' then
  local prefix = 'rollout:' .. held .. ':'
  if string.sub(ARGV[5], 1, string.len(prefix)) ~= prefix then return {'held', held} end
end
local observed = redis.call('HGET', KEYS[1], 'observed') or ''
if observed ~= ARGV[10] then return {'moved', observed} end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('HSET', KEYS[1], 'current', ARGV[1], 'desired', ARGV[4])
redis.call('HSET', KEYS[3], 'node', ARGV[8], 'record', ARGV[2], 'phase', 1, 'outcome', 'running',
           'dispatched', (ARGV[12] == '1') and 1 or 0, 'epoch', epoch, 'request_id', ARGV[5])
if KEYS[2] ~= '' then redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[9]) end
redis.call('SADD', KEYS[4], ARGV[1])
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[6], ARGV[3], ARGV[1])
redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[7], '*', 'e', ARGV[6])
return {'ok', tostring(epoch)}
"""

_NOOP = """
-- KEYS: node, reqid (or ""), switch, history_node, history_all, events
-- ARGV: switch_id, record_json, started, node_name, request_id, event_json, maxlen, ttl
if redis.call('EXISTS', KEYS[1]) == 0 then return {'notfound', ''} end
if KEYS[2] ~= '' then
  local prev = redis.call('GET', KEYS[2])
  if prev then return {'dup', prev} end
  redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[8])
end
redis.call('HSET', KEYS[3], 'node', ARGV[4], 'record', ARGV[2], 'phase', 1, 'outcome', 'noop',
           'dispatched', 0, 'epoch', 0, 'request_id', ARGV[5])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[1])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[7], '*', 'e', ARGV[6])
return {'ok', ''}
"""

_DISPATCH = """
-- KEYS: switch;  ARGV: -  (the intent to send ExecuteSwitch, written before it is sent)
if redis.call('HGET', KEYS[1], 'outcome') ~= 'running' then return 0 end
if redis.call('HGET', KEYS[1], 'dispatched') == '1' then return 0 end
redis.call('HSET', KEYS[1], 'dispatched', 1)
return 1
"""

_ADVANCE = """
-- KEYS: switch, events;  ARGV: expected_phase, record_json, maxlen, then one or more pairs
-- (new_phase, event_json) in order: the phases the agent reported since, each its event; the
-- record (with the last phase) replaces the stored one
if redis.call('HGET', KEYS[1], 'outcome') ~= 'running' then return 0 end
if redis.call('HGET', KEYS[1], 'phase') ~= ARGV[1] then return 0 end
local last = ARGV[1]
for i = 4, #ARGV - 1, 2 do
  last = ARGV[i]
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'e', ARGV[i + 1])
end
redis.call('HSET', KEYS[1], 'phase', last, 'record', ARGV[2])
return 1
"""

_FINISH = """
-- KEYS: switch, node, unfinished, events
-- ARGV: switch_id, outcome, phase, record_json, observed ("" keeps it), event_json, maxlen
if redis.call('HGET', KEYS[1], 'outcome') ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'outcome', ARGV[2], 'phase', ARGV[3], 'record', ARGV[4])
if redis.call('HGET', KEYS[2], 'current') == ARGV[1] then
  redis.call('HSET', KEYS[2], 'current', '')
end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[2], 'observed', ARGV[5], 'desired', ARGV[5]) end
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'e', ARGV[6])
return 1
"""

_REGISTER = """
-- KEYS: node, nodes, events;  ARGV: name, reg_json, lease_until, observed, event_json, maxlen,
--   epoch_floor (the agent's last seen epoch: the node's is raised to it)
redis.call('HSET', KEYS[1], 'reg', ARGV[2], 'lease_until', ARGV[3], 'health', 'ready')
local cur = redis.call('HGET', KEYS[1], 'current')
if not cur or cur == '' then
  redis.call('HSET', KEYS[1], 'observed', ARGV[4], 'desired', ARGV[4], 'current', '')
end
redis.call('HSETNX', KEYS[1], 'epoch', 0)
if (tonumber(ARGV[7]) or 0) > (tonumber(redis.call('HGET', KEYS[1], 'epoch')) or 0) then
  redis.call('HSET', KEYS[1], 'epoch', ARGV[7])
end
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'e', ARGV[5])
return redis.call('HGET', KEYS[1], 'epoch')
"""

_HEARTBEAT = """
-- KEYS: node, traffic list;  ARGV: lease_until, observed ("" keeps it), traffic_json, keep,
--   topology_epoch (the node epoch the agent's topology is known to be current for: the last
--   switch it finished, or the epoch its registration was answered with), workers_json (""
--   keeps the last: an agent that sent none)
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', ARGV[1], 'health', 'ready')
local cur = redis.call('HGET', KEYS[1], 'current')
local epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0') or 0
local seen = tonumber(ARGV[5]) or 0
-- a heartbeat built before the node's latest switch finished carries the old topology
local fresh = seen >= epoch
if ARGV[2] ~= '' and (not cur or cur == '') and fresh then
  redis.call('HSET', KEYS[1], 'observed', ARGV[2])
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'traffic', ARGV[3])
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('LTRIM', KEYS[2], -tonumber(ARGV[4]), -1)
end
if ARGV[6] and ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'workers', ARGV[6]) end
return 1
"""

_RECOMMEND = """
-- KEYS: node, events;  ARGV: text, event_json, maxlen
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'recommendation', ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'e', ARGV[2])
return 1
"""

_DRAIN = """
-- KEYS: node, events;  ARGV: draining flag ("1" / "0"), event_json, maxlen
redis.call('HSET', KEYS[1], 'draining', ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'e', ARGV[2])
return 1
"""

_CLEAR_INFLIGHT = """
-- KEYS: inflight.  The lost node's journal, once its requests were handed on (the leader's)
redis.call('DEL', KEYS[1])
return 1
"""

_RECOVERY = """
-- KEYS: recovery, recoveries (by time), events;  ARGV: record_json, now, request_id,
--   event_json, maxlen.  One request's recovery record (replaced as it progresses), its event.
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'e', ARGV[4])
return 1
"""

_EXPIRE = """
-- KEYS: node, events;  ARGV: now, event_json, maxlen
local until_ = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0')
if redis.call('HGET', KEYS[1], 'health') == 'lost' or until_ >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'health', 'lost')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'e', ARGV[2])
return 1
"""

_ROLLOUT_CREATE = """
-- KEYS: rollout hash, rollouts zset, active set, rollout_req (or ""), events, node hashes...
-- ARGV: id, state_json, status, request_id, created, event_json, maxlen, ttl, capacity_json,
--       description, node names... (one per node key, same order)
-- The nodes the rollout switches are held (node field 'rollout'), all or none.
if KEYS[4] ~= '' then
  local prev = redis.call('GET', KEYS[4])
  if prev then return {'dup', prev, ''} end
end
for i = 6, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return {'notfound', '', ARGV[i + 5]} end
  local held = redis.call('HGET', KEYS[i], 'rollout')
  if held and held ~= '' then return {'busy', held, ARGV[i + 5]} end
end
for i = 6, #KEYS do redis.call('HSET', KEYS[i], 'rollout', ARGV[1]) end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'version', 0, 'status', ARGV[3],
           'request_id', ARGV[4], 'created', ARGV[5], 'capacity', ARGV[9],
           'description', ARGV[10])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
if KEYS[4] ~= '' then redis.call('SET', KEYS[4], ARGV[1], 'EX', ARGV[8]) end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[7], '*', 'e', ARGV[6])
return {'ok', ARGV[1], ''}
"""

_ROLLOUT_STEP = """
-- KEYS: rollout hash, active set, events, node hashes... (only when terminal: released)
-- ARGV: expected_version, new_version, state_json, status, terminal (0/1), event_json, maxlen,
--       id
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'version', ARGV[2], 'status', ARGV[4])
if ARGV[5] == '1' then
  redis.call('SREM', KEYS[2], ARGV[8])
  for i = 4, #KEYS do
    if redis.call('HGET', KEYS[i], 'rollout') == ARGV[8] then
      redis.call('HSET', KEYS[i], 'rollout', '')
    end
  end
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*', 'e', ARGV[6])
return 1
"""


# Fenced writes (controller HA, docs/rollout.md §5): every script only the leader runs carries,
# as its last key and last argument, the key ``leader:term`` and the term the writer leads in
# ("" and "" when not fenced: one controller). Anything but the current term and the write is
# refused — a deposed leader that has not noticed yet (a long pause, a partition) cannot take
# a slot, advance a phase, finish a record or step a rollout. The preamble strips both, so the
# script below it sees its own KEYS and ARGV.
_FENCE = """
local fence_key, fence_term = KEYS[#KEYS], ARGV[#ARGV]
local KEYS, ARGV = {unpack(KEYS, 1, #KEYS - 1)}, {unpack(ARGV, 1, #ARGV - 1)}
if fence_key ~= '' and redis.call('GET', fence_key) ~= fence_term then
  return redis.error_reply('FENCED leader term ' .. fence_term .. ' is no longer the current one')
end
"""
# the scripts only the leader runs (registration and heartbeats: every controller)
FENCED = frozenset({"begin", "noop", "dispatch", "advance", "finish", "expire", "recommend",
                    "rollout_create", "rollout_step", "drain", "recovery", "clear_inflight"})


class Fence:
    """The leader term this controller's fenced writes carry; 0: not fenced (one controller,
    or not elected yet). Shared by the controller's stores; the lease loop sets it when this
    controller is elected (controller.server)."""

    def __init__(self, term: int = 0):
        self.term = term


@dataclass
class RolloutRow:
    rollout_id: str
    state_json: str  # the RolloutState message's JSON (controller.convert.rollout_from_json)
    version: int
    status: str
    request_id: str
    created: float
    capacity_json: str  # {"TPxPPy": capacity}
    description: str


# A pooled connection left over from before a Redis restart answers its first command with
# "Connection closed by server". Before a connection idle for more than a second is used it is
# PINGed, and a failed PING (or a command failing to reach the server on a dead socket) gets ONE
# reconnect: the pool heals itself after Redis comes back instead of failing one call per
# pooled connection (found: a lost node's recovery died on one). Only connection errors are
# retried, never timeouts (a timed-out script may have run).
log = logs.get_logger("remp.controller.store")

# the scripts whose writes a caller is told about (Store.wait_replicas)
ACKNOWLEDGED = frozenset({"begin", "noop", "dispatch", "finish", "rollout_create",
                          "rollout_step"})

STALE_CONNECTION_RECOVERY = dict(
    health_check_interval=1.0,
    retry=Retry(NoBackoff(), 1, supported_errors=(aioredis.ConnectionError,)))


@dataclass
class SwitchRow:
    switch_id: str
    node: str
    record_json: str
    phase: int
    outcome: str  # an Outcome value (compares equal to the Outcome member)
    dispatched: bool
    epoch: int
    request_id: str


class Store:
    """Async access to the controller's Redis state. Raises Unavailable when Redis is down.

    Each Store has its own connection pool (``max_connections``; a call waits up to
    ``pool_timeout`` for a free connection, then answers UNAVAILABLE): the controller keeps
    one per lane (agents' registration and heartbeats, switches, public reads, the event
    reader) so that load on one cannot starve another."""

    def __init__(self, url: str, prefix: str = "remp:", *, max_connections: int = 32,
                 pool_timeout: float = 5.0, socket_timeout: float = 5.0, lane: str = "",
                 wait_replicas: int = 0, wait_ms: int = 1000, fence: Fence | None = None):
        self.url, self.p, self.lane = redact_url(url), prefix, lane  # never the password
        self.fence = fence or Fence()
        # ``url``: one server, or redis+sentinel://… (the primary as Sentinel names it now;
        # after a failover the next connection goes to the promoted replica)
        pool = redisconn.blocking_pool(
            url, max_connections=max_connections, timeout=pool_timeout, decode_responses=True,
            socket_timeout=socket_timeout, socket_connect_timeout=min(2.0, socket_timeout),
            **STALE_CONNECTION_RECOVERY)
        # the writes a caller is told about (a switch begun, dispatched, finished; a rollout's
        # steps) are acknowledged only once ``wait_replicas`` replicas have them (WAIT on the
        # same connection), so a failover to a replica loses none of them
        self.wait_replicas, self.wait_ms = wait_replicas, wait_ms
        self._replicas_seen, self._degraded_logged = wait_replicas, False
        self.r = aioredis.Redis.from_pool(pool)  # closing the client closes the pool
        self._scripts = {name: self.r.register_script(_FENCE + src if name in FENCED else src)
                         for name, src in (
            ("begin", _BEGIN), ("noop", _NOOP), ("dispatch", _DISPATCH), ("advance", _ADVANCE),
            ("finish", _FINISH), ("register", _REGISTER), ("heartbeat", _HEARTBEAT),
            ("expire", _EXPIRE), ("recommend", _RECOMMEND),
            ("rollout_create", _ROLLOUT_CREATE), ("rollout_step", _ROLLOUT_STEP),
            ("drain", _DRAIN), ("recovery", _RECOVERY), ("clear_inflight", _CLEAR_INFLIGHT))}

    async def close(self) -> None:
        await self.r.aclose()

    # key helpers
    def k_node(self, n: str) -> str: return f"{self.p}node:{n}"
    def k_switch(self, s: str) -> str: return f"{self.p}switch:{s}"
    def k_reqid(self, n: str, rid: str) -> str: return f"{self.p}reqid:{n}:{rid}" if rid else ""
    def k_traffic(self, n: str) -> str: return f"{self.p}traffic:{n}"
    def k_hist(self, n: str | None) -> str: return f"{self.p}history:{n}" if n else f"{self.p}history"
    @property
    def k_events(self) -> str: return f"{self.p}events"
    @property
    def k_unfinished(self) -> str: return f"{self.p}unfinished"
    @property
    def k_nodes(self) -> str: return f"{self.p}nodes"
    def k_rollout(self, r: str) -> str: return f"{self.p}rollout:{r}"
    def k_rollout_req(self, rid: str) -> str: return f"{self.p}rollout_req:{rid}" if rid else ""
    @property
    def k_rollouts(self) -> str: return f"{self.p}rollouts"
    @property
    def k_rollouts_active(self) -> str: return f"{self.p}rollouts:active"
    @property
    def k_term(self) -> str: return f"{self.p}leader:term"  # controller.leader's

    def _unavailable(self, exc: BaseException) -> Unavailable:
        if isinstance(exc, (aioredis.ConnectionError, aioredis.TimeoutError, OSError)):
            return Unavailable(f"redis unavailable at {self.url}: {exc}")
        # any other Redis error (OOM, read-only replica, LOADING…): the store cannot serve
        return Unavailable(f"redis error at {self.url}: {type(exc).__name__}: {exc}")

    async def _run(self, name: str, keys: list[str], args: list):
        if name in FENCED:
            term = self.fence.term
            keys, args = [*keys, self.k_term if term else ""], [*args, term if term else ""]
        try:
            if self.wait_replicas and name in ACKNOWLEDGED:
                out = await self._run_acknowledged(name, keys, args)
            else:
                out = await self._scripts[name](keys=keys, args=args)
            redisconn.raise_if_cancelling()
            return out
        except aioredis.ResponseError as exc:
            if "FENCED leader term" in str(exc):  # (a pipeline's error names the command)
                log.warning("controller.write_fenced", script=name, term=self.fence.term,
                            lane=self.lane)
                raise NotLeader() from None
            raise self._unavailable(exc) from exc
        except (aioredis.RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc

    async def _run_acknowledged(self, name: str, keys: list[str], args: list):
        """The script, then WAIT on the same connection (ROLE first, in the same pipeline:
        how many replicas the primary has now). Acknowledged when the write reached
        ``wait_replicas`` replicas, or every replica connected now when fewer are (the group
        after a failover, before the old primary is back as a replica: the control plane
        keeps working with one copy, as it survives the loss of any one process, and logs
        it); otherwise Unavailable, and the caller is not told the write happened."""
        want = min(self.wait_replicas, self._replicas_seen)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.execute_command("ROLE")
            await self._scripts[name](keys=keys, args=args, client=pipe)
            if want:
                pipe.execute_command("WAIT", want, self.wait_ms)
            out = await pipe.execute()
        role, res = out[0], out[1]
        connected = len(role[2]) if len(role) > 2 and isinstance(role[2], list) else 0
        self._replicas_seen = connected
        got = int(out[2]) if want else 0
        if got < min(self.wait_replicas, connected):
            raise Unavailable(f"redis at {self.url}: the {name} write reached {got} of "
                              f"{min(self.wait_replicas, connected)} replica(s) in "
                              f"{self.wait_ms} ms; not acknowledged")
        if connected < self.wait_replicas and not self._degraded_logged:
            self._degraded_logged = True
            log.warning("controller.redis_replicas_missing", want=self.wait_replicas,
                        connected=connected, lane=self.lane,
                        detail="acknowledged writes have fewer copies until a replica returns")
        elif connected >= self.wait_replicas:
            self._degraded_logged = False
        return res

    async def _call(self, coro):
        try:
            out = await coro
        except (aioredis.RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc
        redisconn.raise_if_cancelling()
        return out

    async def ping(self) -> bool:
        try:
            return bool(await self.r.ping())
        except (aioredis.RedisError, OSError):
            return False

    # ---------------------------------------------------------------- nodes
    async def register(self, name: str, reg: Registration, lease_until: float,
                       observed: str, event: Event, epoch_floor: int = 0) -> int:
        """The node's epoch: raised to ``epoch_floor`` (the agent's last seen) if below."""
        epoch = await self._run("register", [self.k_node(name), self.k_nodes, self.k_events],
                                [name, to_json(reg), lease_until, observed, event_json(event),
                                 EVENTS_MAXLEN, int(epoch_floor)])
        return int(epoch or 0)

    async def heartbeat(self, name: str, lease_until: float, observed: str, traffic: str,
                        topology_epoch: int = 0, workers: str = "") -> None:
        ok = await self._run("heartbeat", [self.k_node(name), self.k_traffic(name)],
                             [lease_until, observed, traffic, TRAFFIC_KEEP, topology_epoch,
                              workers])
        if not ok:
            raise NotFound(f"node {name!r} is not registered (register first)")

    async def traffic(self, name: str, limit: int) -> list[str]:
        return await self._call(self.r.lrange(self.k_traffic(name), -limit if limit else 0, -1))

    async def recommend(self, name: str, text: str, event: Event) -> bool:
        return bool(await self._run("recommend", [self.k_node(name), self.k_events],
                                    [text, event_json(event), EVENTS_MAXLEN]))

    async def expire(self, name: str, now: float, event: Event) -> bool:
        return bool(await self._run("expire", [self.k_node(name), self.k_events],
                                    [now, event_json(event), EVENTS_MAXLEN]))

    async def node_names(self) -> list[str]:
        return sorted(await self._call(self.r.smembers(self.k_nodes)))

    async def node(self, name: str) -> dict[str, str] | None:
        h = await self._call(self.r.hgetall(self.k_node(name)))
        return h or None

    async def nodes(self) -> dict[str, dict[str, str]]:
        names = await self.node_names()
        if not names:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(self.k_node(n))
        rows = await self._call(pipe.execute())
        return {n: h for n, h in zip(names, rows) if h}

    async def nodes_fields(self, fields: tuple[str, ...]) -> dict[str, dict[str, str]]:
        """Only ``fields`` of every node's hash (one pipeline): what a rollout plans from,
        without the heartbeats' traffic samples."""
        names = await self.node_names()
        if not names:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hmget(self.k_node(n), list(fields))
        rows = await self._call(pipe.execute())
        return {n: {f: v for f, v in zip(fields, vals) if v is not None}
                for n, vals in zip(names, rows) if any(v is not None for v in vals)}

    # ---------------------------------------------------------------- switches
    async def begin(self, node: str, switch_id: str, request_id: str, record_json: str,
                    started: float, target: str, event: Event,
                    observed: str, reg_json: str = "", dispatched: bool = False
                    ) -> tuple[str, str]:
        """('ok', epoch) | ('dup', earlier id) | ('busy', running id) | ('notfound', '') |
        ('held', rollout id) | ('lost', '') | ('draining', '') | ('moved', observed now): the
        node's observed topology is no longer ``observed`` (a switch finished or a heartbeat
        reported another one since it was read), or its registration no longer ``reg_json``
        (when given: the agent registered again). ``dispatched``: the switch is written with
        its intent to send ExecuteSwitch (no separate :meth:`dispatch`)."""
        res = await self._run("begin", [
            self.k_node(node), self.k_reqid(node, request_id), self.k_switch(switch_id),
            self.k_unfinished, self.k_hist(node), self.k_hist(None), self.k_events,
        ], [switch_id, record_json, started, target, request_id, event_json(event), EVENTS_MAXLEN,
            node, REQID_TTL_S, observed, reg_json, "1" if dispatched else "0"])
        return res[0], res[1]

    async def noop(self, node: str, switch_id: str, request_id: str, record_json: str,
                   started: float, event: Event) -> tuple[str, str]:
        res = await self._run("noop", [
            self.k_node(node), self.k_reqid(node, request_id), self.k_switch(switch_id),
            self.k_hist(node), self.k_hist(None), self.k_events,
        ], [switch_id, record_json, started, node, request_id, event_json(event, record_json),
            EVENTS_MAXLEN, REQID_TTL_S])
        return res[0], res[1]

    async def node_and_request(self, node: str, request_id: str
                               ) -> tuple[dict[str, str] | None, str | None]:
        """The node's hash (None: unknown) and the switch an earlier request with
        ``request_id`` started there (None: none, or no request id), in one round trip."""
        if not request_id:
            return await self.node(node), None
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(self.k_node(node))
        pipe.get(self.k_reqid(node, request_id))
        h, prev = await self._call(pipe.execute())
        return h or None, prev

    async def dispatch(self, switch_id: str) -> bool:
        return bool(await self._run("dispatch", [self.k_switch(switch_id)], []))

    async def advance(self, switch_id: str, expected_phase: int, new_phase: int,
                      record_json: str, event: Event) -> bool:
        return await self.advance_many(switch_id, expected_phase, [(new_phase, event)],
                                       record_json)

    async def advance_many(self, switch_id: str, expected_phase: int,
                           steps: list[tuple[int, Event]], record_json: str) -> bool:
        """The switch from ``expected_phase`` through each of ``steps`` (phase, its event) in
        one script: the phases an agent reported while the previous write was under way cost
        one round trip, every event kept. False: not running, or not in ``expected_phase``."""
        # phases as plain numbers (redis-py writes an IntEnum member as its repr)
        pairs = [x for phase, ev in steps for x in (int(phase), event_json(ev))]
        return bool(await self._run("advance", [self.k_switch(switch_id), self.k_events],
                                    [int(expected_phase), record_json, EVENTS_MAXLEN, *pairs]))

    async def finish(self, switch_id: str, node: str, outcome: Outcome, phase: int, record_json: str,
                     observed: str, event: Event) -> bool:
        return bool(await self._run("finish", [
            self.k_switch(switch_id), self.k_node(node), self.k_unfinished, self.k_events,
        ], [switch_id, outcome, int(phase), record_json, observed,
            event_json(event, record_json), EVENTS_MAXLEN]))

    async def switch(self, switch_id: str) -> SwitchRow | None:
        h = await self._call(self.r.hgetall(self.k_switch(switch_id)))
        if not h:
            return None
        return SwitchRow(switch_id, h.get("node", ""), h.get("record", "{}"), int(h.get("phase", 0)),
                         h.get("outcome", ""), h.get("dispatched") == "1", int(h.get("epoch", 0)),
                         h.get("request_id", ""))

    async def unfinished(self) -> list[str]:
        return sorted(await self._call(self.r.smembers(self.k_unfinished)))

    async def history(self, node: str | None, offset: int, count: int) -> list[SwitchRow]:
        ids = await self._call(self.r.zrevrange(self.k_hist(node), offset, offset + count - 1))
        rows = []
        for sid in ids:
            row = await self.switch(sid)
            if row is not None:
                rows.append(row)
        return rows

    async def history_count(self, node: str | None) -> int:
        return int(await self._call(self.r.zcard(self.k_hist(node))))

    # ---------------------------------------------------------------- rollouts
    async def rollout_create(self, rollout_id: str, state_json: str, status: str,
                             request_id: str, created: float, capacity_json: str,
                             description: str, nodes: list[str], event: Event
                             ) -> tuple[str, str, str]:
        """('ok', id, '') | ('dup', the earlier rollout's id, '') | ('busy', the rollout
        holding it, node) | ('notfound', '', node). Holds every node of ``nodes``."""
        res = await self._run("rollout_create", [
            self.k_rollout(rollout_id), self.k_rollouts, self.k_rollouts_active,
            self.k_rollout_req(request_id), self.k_events, *map(self.k_node, nodes),
        ], [rollout_id, state_json, status, request_id, created, event_json(event), EVENTS_MAXLEN,
            REQID_TTL_S, capacity_json, description, *nodes])
        return res[0], res[1], res[2]

    async def rollout_step(self, rollout_id: str, expected_version: int, new_version: int,
                           state_json: str, status: str, terminal: bool, nodes: list[str],
                           event: Event) -> bool:
        """Compare-and-set on the version: False when another writer got there first. A
        terminal status leaves the active set and releases the ``nodes`` still held by it."""
        res = await self._run("rollout_step", [
            self.k_rollout(rollout_id), self.k_rollouts_active, self.k_events,
            *(map(self.k_node, nodes) if terminal else ()),
        ], [int(expected_version), int(new_version), state_json, status,
            1 if terminal else 0, event_json(event), EVENTS_MAXLEN, rollout_id])
        if res == -1:
            raise NotFound(f"no rollout with id {rollout_id!r}")
        return bool(res)

    async def rollout(self, rollout_id: str) -> RolloutRow | None:
        h = await self._call(self.r.hgetall(self.k_rollout(rollout_id)))
        if not h:
            return None
        return RolloutRow(rollout_id, h.get("state", "{}"), int(h.get("version", 0)),
                          h.get("status", ""), h.get("request_id", ""),
                          float(h.get("created", 0) or 0), h.get("capacity", "{}"),
                          h.get("description", ""))

    async def rollout_version(self, rollout_id: str) -> int | None:
        v = await self._call(self.r.hget(self.k_rollout(rollout_id), "version"))
        return int(v) if v is not None else None

    async def rollout_for_request(self, request_id: str) -> str | None:
        return await self._call(self.r.get(self.k_rollout_req(request_id)))

    async def active_rollouts(self) -> list[str]:
        return sorted(await self._call(self.r.smembers(self.k_rollouts_active)))

    async def rollout_ids(self, limit: int) -> list[str]:
        """Newest first."""
        return await self._call(self.r.zrevrange(self.k_rollouts, 0, limit - 1))

    # ---------------------------------------------------------------- events
    # ---------------------------------------------------------------- recovery
    def k_inflight(self, n: str) -> str: return f"{self.p}inflight:{n}"
    def k_recovery(self, rid: str) -> str: return f"{self.p}recovery:{rid}"
    @property
    def k_recoveries(self) -> str: return f"{self.p}recoveries"

    async def set_inflight(self, name: str, journal_json: str) -> None:
        """The node's in-flight journal (its last heartbeat's requests)."""
        await self._call(self.r.set(self.k_inflight(name), journal_json))

    async def inflight(self, name: str) -> str | None:
        return await self._call(self.r.get(self.k_inflight(name)))

    async def clear_inflight(self, name: str) -> None:
        """The journal of a lost node whose requests were handed on (the leader's: fenced)."""
        await self._run("clear_inflight", [self.k_inflight(name)], [])

    async def set_draining(self, name: str, draining: bool, event: Event) -> None:
        """The node's drain flag and its event (the leader's: fenced)."""
        await self._run("drain", [self.k_node(name), self.k_events],
                        ["1" if draining else "0", event_json(event), EVENTS_MAXLEN])

    async def clear_draining(self, name: str) -> None:
        """A (re-)registered agent serves again: it restarted or was returned to service."""
        await self._call(self.r.hdel(self.k_node(name), "draining"))

    async def put_recovery(self, request_id: str, record_json: str, now: float,
                           event: Event) -> None:
        """One request's recovery record (replaced as it progresses) and its event, at once
        (the leader's: fenced)."""
        await self._run("recovery", [self.k_recovery(request_id), self.k_recoveries,
                                     self.k_events],
                        [record_json, now, request_id, event_json(event), EVENTS_MAXLEN])

    async def recoveries(self, limit: int = 1000) -> list[str]:
        ids = await self._call(self.r.zrevrange(self.k_recoveries, 0, limit - 1))
        if not ids:
            return []
        vals = await self._call(self.r.mget([self.k_recovery(i) for i in ids]))
        return [v for v in vals if v]

    async def last_event_id(self) -> str:
        last = await self._call(self.r.xrevrange(self.k_events, count=1))
        return last[0][0] if last else "0-0"

    async def read_raw_events(self, after: str, block_ms: int | None, count: int = 500
                              ) -> list[tuple[str, str]]:
        """(id, Event JSON) of the events after ``after``; waits up to ``block_ms`` for one
        (None: does not wait). The event hub's loop (its own connection) is the one blocking
        reader of a controller process."""
        res = await self._call(self.r.xread({self.k_events: after}, block=block_ms,
                                            count=count))
        return [(eid, fields.get("e", "{}"))
                for _stream, entries in res or [] for eid, fields in entries]

    async def read_events_page(self, after: str, count: int = 500
                               ) -> tuple[list[tuple[str, str]], str, int]:
        """(id, Event JSON) of up to ``count`` events after ``after``, the oldest event
        retained ("" none) and how many the stream has had removed (MAXLEN trims the oldest;
        remp never deletes one) — read in one transaction, so whether events after ``after``
        were trimmed before this page was read is known exactly
        (:func:`controller.watch.maybe_trimmed`)."""
        async with self.r.pipeline(transaction=True) as p:
            p.xinfo_stream(self.k_events)
            p.xread({self.k_events: after}, count=count)
            try:
                info, res = await p.execute(raise_on_error=False)
            except (aioredis.RedisError, OSError) as exc:
                raise self._unavailable(exc) from exc
        redisconn.raise_if_cancelling()
        if isinstance(info, aioredis.ResponseError):  # no stream yet: nothing retained
            return [], "", 0
        if isinstance(info, Exception):
            raise self._unavailable(info)
        if isinstance(res, Exception):
            raise self._unavailable(res)
        first = (info.get("first-entry") or ("",))[0] or ""
        length = int(info.get("length", 0))
        added = info.get("entries-added")  # Redis >= 7; before: a full stream was trimmed
        removed = (int(added) - length) if added is not None else int(length >= EVENTS_MAXLEN)
        return ([(eid, fields.get("e", "{}")) for _s, entries in res or [] for eid, fields in
                 entries], first, removed)

    async def read_events(self, after: str, block_ms: int | None = None, count: int = 500
                          ) -> list[tuple[str, Event]]:
        return [(eid, parse_event(eid, raw))
                for eid, raw in await self.read_raw_events(after, block_ms, count)]


# The events this process wrote, by their stream entry: its own event hub reads each back soon
# after (controller.watch) and takes the Event instead of parsing the JSON again (protobuf's
# JSON parser is pure Python: ~0.7 ms for an event carrying a switch record on the reference box,
# on the path of every SWITCH_DONE to its Watch clients). Bounded; an entry is used once.
_WRITTEN: OrderedDict[str, Event] = OrderedDict()
_WRITTEN_KEEP = 1024


def event_json(event: Event, record_json: str = "") -> str:
    """The stream entry of ``event`` (its protobuf JSON), remembered for :func:`parse_event`.
    ``record_json``: the protobuf JSON of ``event.record``, already made for the switch's own
    key — put in as it is instead of encoding the record a second time. (An Event message, as
    some tests pass, is written as it is and not remembered.)"""
    if not isinstance(event, Event):
        return to_json(event)
    if event.record is not None and record_json:
        head = to_json(replace(event, record=None))
        raw = head[:-1] + (", " if head != "{}" else "") + f'"record": {record_json}}}'
    else:
        raw = to_json(event)
    _WRITTEN[raw] = replace(event, id="")
    if len(_WRITTEN) > _WRITTEN_KEEP:
        _WRITTEN.popitem(last=False)
    return raw


def parse_event(eid: str, raw: str) -> Event:
    ev = _WRITTEN.pop(raw, None)
    if ev is None:
        ev = from_json(raw, Event)
    return replace(ev, id=eid)


def decode_reg(h: dict[str, str]) -> Registration:
    return from_json(h.get("reg", "{}"), Registration)


def check_found(h, name: str):
    if h is None:
        raise NotFound(f"unknown node {name!r} (ListNodes shows the registered ones)")
    return h

