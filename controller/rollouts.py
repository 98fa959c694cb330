"""Fleet rollouts: the I/O edge of :mod:`controller.rollout` (docs/rollout.md §4).

The pure core decides; this module reads the nodes, persists each transition with one
compare-and-set script (:meth:`Store.rollout_step`, the event appended atomically) and *then*
acts on it: a node's switch is started through the existing single-node path,
:meth:`Controller.reconfigure`, with the idempotency key :func:`controller.rollout.request_id`
(so a re-sent start after a crash gets the same switch back, never a second one), and followed
until its row in Redis is final. The first node that does not succeed stops the rollout (the
wave's others finish; nothing further starts). Before each later wave the floor is checked
again with the nodes' health of now; if it would not hold, the rollout pauses with the reason.

After a restart :meth:`Rollouts.resume_all` re-drives every rollout in ``rollouts:active``: the
nodes still SWITCHING get their Reconfigure again with the same request id (a duplicate: the
existing switch is followed; the controller's own reconcile completes a switch the old process
left unfinished).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controller.convert import from_json, rollout_from_json, rollout_to_json
from controller.model import Event, EventType, NodeHealth, RolloutMeta, SwitchRecord
from controller.rollout import (NodeStatus, RolloutNode, RolloutState, RolloutStatus, Step,
                                abort, capacity_table, new_rollout, pause, plan_rollout,
                                request_id, resume, resume_after_restart, select_nodes, start,
                                switch_finished, switch_started, wave_keeps_floor)
from remp import logs
from remp.errors import FailedPrecondition, InvalidArgument, NotFound, RempError, Unavailable
from remp.topology import Topology
from remp.transaction import Outcome

if TYPE_CHECKING:
    from controller.core import Controller

log = logs.get_logger("remp.controller.rollouts")

MAX_LIST = 1000
DEFAULT_LIST = 50
CAS_ATTEMPTS = 3
FOLLOW_POLL_S = 2.0  # a switch's row is re-read at least this often while it is followed
NOT_RECEIVED_RETRIES = 3  # a node's switch that never reached its agent is started again
POLL_WITHOUT_EVENTS_S = 0.2  # … and this often when the event hub cannot be subscribed to
STATUS_EVENT = {
    RolloutStatus.RUNNING: EventType.ROLLOUT_WAVE,
    RolloutStatus.PAUSED: EventType.ROLLOUT_PAUSED,
    RolloutStatus.DONE: EventType.ROLLOUT_DONE,
    RolloutStatus.FAILED: EventType.ROLLOUT_FAILED,
    RolloutStatus.ABORTED: EventType.ROLLOUT_ABORTED,
}


class Action:
    PAUSE, RESUME, ABORT = 1, 2, 3  # the RolloutAction numbers


@dataclass(frozen=True)
class RolloutSpec:
    """A ``RolloutRequest``: the set (``nodes`` or ``labels``), the target, the floor, the
    most nodes switching at once, the capacity table ("TPxPPy" → capacity)."""

    target: Topology
    floor: float
    max_parallel: int = 1
    capacity: Mapping[str, float] = field(default_factory=dict)
    nodes: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    request_id: str = ""
    reason: str = ""
    dry_run: bool = False


@dataclass(frozen=True)
class RolloutView:
    state: RolloutState
    meta: RolloutMeta
    duplicate: bool = False
    dry_run: bool = False


def check_spec(spec: RolloutSpec) -> None:
    if spec.target.tp < 1 or spec.target.pp < 1:
        raise InvalidArgument("target needs tp >= 1 and pp >= 1, e.g. {\"tp\": 1, \"pp\": 2}")
    if not (math.isfinite(spec.floor) and 0.0 <= spec.floor <= 1.0):
        raise InvalidArgument(f"capacity_floor must be a fraction in [0, 1], got {spec.floor}")
    if spec.max_parallel < 1:
        raise InvalidArgument(f"max_parallel must be >= 1, got {spec.max_parallel}")
    if not spec.capacity:
        raise InvalidArgument("capacity_rps is required: the SLO capacity of each topology "
                              "(remp rollout --profile NAME fills it from a policy profile)")
    for k, v in spec.capacity.items():
        try:
            Topology.parse(k)
        except ValueError:
            raise InvalidArgument(f"capacity_rps: {k[:32]!r} is not a topology like "
                                  "TP2PP1") from None
        if not (math.isfinite(v) and v >= 0):
            raise InvalidArgument(f"capacity_rps[{k}] must be finite and >= 0, got {v}")


NODE_FIELDS = ("reg", "observed", "health", "current", "draining")


def rollout_nodes(rows: Mapping[str, Mapping[str, str]]) -> list[RolloutNode]:
    """The registered nodes as the planner sees them (topology: the observed one). Reads the
    registration's JSON directly (only topology, candidates, labels): the protobuf parser
    took 0.1 ms a node, most of a 1,000-node dry run."""
    out = []
    for name, h in rows.items():
        try:
            reg = json.loads(h.get("reg") or "{}")
        except ValueError:
            reg = {}
        t = reg.get("topology") or {}
        observed = h.get("observed") or (f"TP{t.get('tp', 0)}PP{t.get('pp', 0)}" if t else "")
        try:
            topo = Topology.parse(observed)
        except ValueError:
            topo, health = Topology(1, 1), NodeHealth.UNSPECIFIED
        else:
            health = NodeHealth.READY
        if h.get("health") == "lost":
            health = NodeHealth.LOST
        elif h.get("draining") == "1":
            health = NodeHealth.DRAINING
        elif h.get("current"):
            health = NodeHealth.SWITCHING
        cands = tuple(Topology(c.get("tp", 0), c.get("pp", 0))
                      for c in reg.get("candidates", ()))
        labels = tuple(sorted((reg.get("labels") or {}).items()))
        out.append(RolloutNode(name, topo, cands, labels, health))
    return out


def _set(s: RolloutState) -> set[str]:
    return {*s.plan.order, *s.plan.skipped, *(n for n, _ in s.plan.excluded)}


def _summary(s: RolloutState) -> str:
    waves = "; ".join(",".join(w.nodes) for w in s.plan.waves)
    text = (f"→ {s.plan.target}: {len(s.plan.waves)} wave(s) [{waves}], floor "
            f"{s.plan.floor:g} (required {s.plan.required_capacity:g} of "
            f"{s.plan.base_capacity:g})")
    return text if len(text) <= 900 else text[:899] + "…"


class Rollouts:
    """The controller's rollouts (one per process; the core holds it as ``ctl.rollouts``)."""

    def __init__(self, ctl: "Controller"):
        self.ctl, self.store = ctl, ctl.store
        self._locks: dict[str, asyncio.Lock] = {}
        self._following: set[tuple[str, str]] = set()
        # the last state this process read or wrote, by rollout: (version, state, meta); used
        # while Redis still holds that version (parsing the state is 13 ms at 1,000 nodes)
        self._states: dict[str, tuple[int, RolloutState, RolloutMeta]] = {}

    def forget_drivers(self) -> None:
        """After a step-down (the driver tasks are cancelled): nothing is followed here."""
        self._following.clear()

    # ------------------------------------------------------------------ the API
    async def create(self, spec: RolloutSpec) -> RolloutView:
        check_spec(spec)
        if not spec.dry_run:
            self.ctl.leadership.require()
        if spec.request_id and not spec.dry_run:
            prev = await self.store.rollout_for_request(spec.request_id)
            if prev:
                return RolloutView(*await self._read(prev), duplicate=True)
        nodes = rollout_nodes(await self.store.nodes_fields(NODE_FIELDS))
        chosen = select_nodes(nodes, spec.nodes, dict(spec.labels) or None)
        t0 = time.perf_counter()
        plan = plan_rollout(chosen, spec.target, spec.floor, spec.max_parallel,
                            capacity_table(spec.capacity))
        plan_ms = (time.perf_counter() - t0) * 1e3
        now = self.ctl.clock()
        meta = RolloutMeta(request_id=spec.request_id, created_at=int(now * 1e9),
                           capacity_rps=tuple(sorted(spec.capacity.items())),
                           description=spec.reason)
        if spec.dry_run:
            return RolloutView(new_rollout("", plan), meta, dry_run=True)
        rid = "ro-" + uuid.uuid4().hex[:12]
        st = new_rollout(rid, plan)
        ev = self._event(EventType.ROLLOUT_PLANNED, rid, detail=_summary(st))
        status, other, node = await self.store.rollout_create(
            rid, rollout_to_json(st, meta), st.status, spec.request_id, now,
            json.dumps(dict(meta.capacity_rps)), spec.reason, list(plan.order), ev)
        if status == "dup":
            return RolloutView(*await self._read(other), duplicate=True)
        if status == "busy":
            raise FailedPrecondition(f"node {node} is held by rollout {other} (one rollout per "
                                     "node at a time; ControlRollout ABORT it, or wait)")
        if status == "notfound":
            raise NotFound(f"unknown node {node!r}")
        log.info("controller.rollout_created", rollout_id=rid, nodes=len(plan.order),
                 waves=len(plan.waves), plan_ms=round(plan_ms, 2), target=str(plan.target))
        step, meta = await self._apply(rid, start)
        self._act(rid, step)
        return RolloutView(step.state, meta)

    async def get(self, rollout_id: str) -> RolloutView:
        if not rollout_id:
            raise InvalidArgument("rollout_id is required")
        return RolloutView(*await self._read(rollout_id, self.ctl.reads))

    async def list(self, active_only: bool, limit: int) -> list[RolloutView]:
        limit = limit or DEFAULT_LIST
        if limit > MAX_LIST:
            raise InvalidArgument(f"limit must be at most {MAX_LIST}")
        reads = self.ctl.reads
        if active_only:
            ids = await reads.active_rollouts()
        else:
            ids = await reads.rollout_ids(limit)
        out = []
        for rid in ids:
            row = await reads.rollout(rid)
            if row is not None:
                out.append(RolloutView(*rollout_from_json(row.state_json)))
        out.sort(key=lambda v: -(v.meta.created_at or 0))
        return out[:limit]

    async def control(self, rollout_id: str, action: int, reason: str) -> RolloutView:
        self.ctl.leadership.require()
        if not rollout_id:
            raise InvalidArgument("rollout_id is required")
        if action == Action.PAUSE:
            step, meta = await self._apply(rollout_id, lambda s: pause(s, reason or "paused"))
        elif action == Action.RESUME:
            nodes = await self._nodes_now()
            _, meta = await self._read(rollout_id)

            def go(s: RolloutState) -> Step:
                if s.status is RolloutStatus.PAUSED and s.wave + 1 < len(s.plan.waves):
                    why = self._floor(s, s.wave + 1, nodes, meta)
                    if why:
                        raise FailedPrecondition(f"rollout {s.rollout_id} cannot resume: {why}")
                return resume(s)
            step, meta = await self._apply(rollout_id, go)
        elif action == Action.ABORT:
            step, meta = await self._apply(rollout_id, lambda s: abort(s, reason or "aborted"))
            await self._abort_switches(step.state, reason or "rollout aborted")
        else:
            raise InvalidArgument("action must be PAUSE, RESUME or ABORT")
        self._act(rollout_id, step)
        return RolloutView(step.state, meta)

    async def resume_all(self) -> None:
        """Re-drive every active rollout (at start, or when this process takes over)."""
        for rid in await self.store.active_rollouts():
            await self._resume(rid)

    async def _resume(self, rid: str) -> None:
        row = await self.store.rollout(rid)
        if row is None:
            return
        st, _ = rollout_from_json(row.state_json)
        if st.terminal:
            return
        step = resume_after_restart(st)
        log.info("controller.rollout_resumed", rollout_id=rid, status=st.status,
                 wave=st.wave, switching=list(step.start))
        self._act(rid, step)

    # ------------------------------------------------------------------ persistence
    async def _read(self, rollout_id: str, store=None) -> tuple[RolloutState, RolloutMeta]:
        row = await (store or self.store).rollout(rollout_id)
        if row is None:
            raise NotFound(f"no rollout with id {rollout_id!r} (ListRollouts shows them)")
        return rollout_from_json(row.state_json)

    async def _current(self, rollout_id: str) -> tuple[int, RolloutState, RolloutMeta]:
        """The stored state: one HGET of its version when this process holds that version
        already, else read and parsed."""
        version = await self.store.rollout_version(rollout_id)
        if version is None:
            raise NotFound(f"no rollout with id {rollout_id!r} (ListRollouts shows them)")
        held = self._states.get(rollout_id)
        if held is not None and held[0] == version:
            return held
        row = await self.store.rollout(rollout_id)
        if row is None:
            raise NotFound(f"no rollout with id {rollout_id!r}")
        st, meta = rollout_from_json(row.state_json)
        self._states[rollout_id] = (row.version, st, meta)
        return row.version, st, meta

    def _lock(self, rollout_id: str) -> asyncio.Lock:
        return self._locks.setdefault(rollout_id, asyncio.Lock())

    async def _apply(self, rollout_id: str, fn: Callable[..., Step | RolloutState],
                     node: str = "", switch_id: str = "", detail: str = "", prepare=None
                     ) -> tuple[Step, RolloutMeta]:
        """Read, apply the pure transition, write with compare-and-set on the version read;
        on a lost race read again and re-apply (at most :data:`CAS_ATTEMPTS` times).
        ``prepare(state, meta)``, when given, is awaited on the state read (under the lock)
        and its result passed to ``fn`` as a second argument."""
        async with self._lock(rollout_id):
            for _ in range(CAS_ATTEMPTS):
                version, st, meta = await self._current(rollout_id)
                out = fn(st) if prepare is None else fn(st, await prepare(st, meta))
                step = out if isinstance(out, Step) else Step(out)
                new = step.state
                if new.version == st.version:
                    return step, meta
                etype = (STATUS_EVENT.get(new.status, EventType.ROLLOUT_PROGRESS)
                         if new.status != st.status else
                         EventType.ROLLOUT_WAVE if new.wave != st.wave else
                         EventType.ROLLOUT_PROGRESS)
                text = detail
                if etype is EventType.ROLLOUT_WAVE:
                    text = f"wave {new.wave}: {', '.join(step.start)}"
                elif new.status != st.status:
                    text = f"{new.status}" + (f": {new.reason}" if new.reason else "")
                ev = self._event(etype, rollout_id, node, switch_id, text)
                if await self.store.rollout_step(
                        rollout_id, version, new.version, rollout_to_json(new, meta),
                        new.status, new.terminal, sorted(_set(new)), ev):
                    self._states[rollout_id] = (new.version, new, meta)
                    if new.terminal:
                        self._states.pop(rollout_id, None)
                    log.info("controller.rollout_step", rollout_id=rollout_id,
                             status=new.status, wave=new.wave, version=new.version,
                             node=node, detail=text)
                    return step, meta
            raise FailedPrecondition(f"rollout {rollout_id} kept changing under this request; "
                                     "retry")

    def _event(self, etype: EventType, rollout_id: str, node: str = "", switch_id: str = "",
               detail: str = "") -> Event:
        return Event(type=etype, node=node, switch_id=switch_id, rollout_id=rollout_id,
                     at=int(self.ctl.clock() * 1e9), detail=detail)

    # ------------------------------------------------------------------ the driver
    def _act(self, rollout_id: str, step: Step) -> None:
        if step.start:
            names = step.start
            self.ctl.spawn(self._guard(rollout_id, lambda: self._start_wave(rollout_id, names)))

    async def _guard(self, rollout_id: str, make) -> None:
        """Run ``make()`` (a coroutine factory: each step of the driver is idempotent — the
        state is re-read and a node's switch re-sent with its request id); while Redis is
        unreachable wait and run it again, as the switch driver waits for its record."""
        delay = 0.5
        while True:
            try:
                await make()
                return
            except asyncio.CancelledError:
                raise
            except Unavailable as exc:
                log.warning("controller.rollout_driver_waiting", rollout_id=rollout_id,
                            error=str(exc), retry_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            except RempError as exc:  # a refused write (kept changing, gone): as stored
                log.error("controller.rollout_driver_stopped", rollout_id=rollout_id,
                          error=f"{type(exc).__name__}: {exc}")
                return
            except Exception as exc:  # noqa: BLE001 - keep the controller up
                log.error("controller.rollout_driver_failed", rollout_id=rollout_id,
                          error=repr(exc))
                return

    async def _start_wave(self, rollout_id: str, names: tuple[str, ...]) -> None:
        await asyncio.gather(*(self._guard(rollout_id, lambda n=n: self._drive_node(rollout_id, n))
                               for n in names))

    async def _drive_node(self, rollout_id: str, node: str) -> None:
        """Start (or, after a restart, find again) the node's switch, then follow it."""
        _, st, meta = await self._current(rollout_id)
        if st.node(node).status is not NodeStatus.SWITCHING:
            return
        try:
            res = await self.ctl.reconfigure(
                node, st.plan.target, request_id(rollout_id, node),
                f"rollout {rollout_id} wave {st.wave}"
                + (f": {meta.description}" if meta.description else ""))
        except Unavailable as err:
            if not await self.store.ping():
                raise  # Redis, not the node: resumed at the next start
            await self._finished(rollout_id, node, None, f"UNAVAILABLE: {err}")
            return
        except RempError as err:
            await self._finished(rollout_id, node, None, f"{err.code.name}: {err}")
            return
        sid = res.switch_id
        step, _ = await self._apply(
            rollout_id, lambda s: switch_started(s, node, sid)
            if s.node(node).status is NodeStatus.SWITCHING else Step(s),
            node=node, switch_id=sid, detail=f"{node}: switch {sid} started"
            + (" (duplicate: followed)" if res.duplicate else ""))
        if step.state.abort_requested:
            await self._abort_switches(step.state, step.state.reason or "rollout aborted")
        await self._follow(rollout_id, node, sid)

    async def _follow(self, rollout_id: str, node: str, switch_id: str) -> None:
        key = (rollout_id, node)
        if key in self._following:
            return
        self._following.add(key)
        try:
            retries = 0
            while True:
                row = await self._wait_final(node, switch_id)
                rec = from_json(row.record_json, SwitchRecord)
                outcome = Outcome(row.outcome)
                if (outcome is Outcome.ABORTED and rec.error is not None
                        and rec.error.code in ("NOT_RECEIVED", "NOT_DISPATCHED")
                        and retries < NOT_RECEIVED_RETRIES):
                    # the order never reached the agent (the control plane lost Redis between
                    # taking the node's slot and dispatching, or the leader died before it
                    # sent it): nothing ran there, so this is not the node failing; the
                    # rollout switches it again
                    retries += 1
                    again = await self._switch_again(rollout_id, node, switch_id)
                    if again:
                        switch_id = again
                        continue
                error = rec.error.message if rec.error is not None else ""
                await self._finished(rollout_id, node, outcome, error, switch_id)
                return
        finally:
            self._following.discard(key)

    async def _switch_again(self, rollout_id: str, node: str, not_received: str) -> str:
        """A new switch for a node whose switch ``not_received`` never reached its agent; ""
        when the rollout no longer wants it (aborted, or the node is no longer switching). Its
        request id names the switch it replaces: a driver that re-follows ``not_received``
        after a restart gets this same switch back, never a second one."""
        _, st, meta = await self._current(rollout_id)
        if st.abort_requested or st.node(node).status is not NodeStatus.SWITCHING:
            return ""
        rid = f"{request_id(rollout_id, node)}:again:{not_received}"
        try:
            res = await self.ctl.reconfigure(
                node, st.plan.target, rid, f"rollout {rollout_id} wave {st.wave} "
                f"(again: {not_received} never reached the agent)")
        except RempError as err:
            log.warning("controller.rollout_switch_again_refused", rollout_id=rollout_id,
                        node=node, error=f"{err.code.name}: {err}")
            return ""
        await self._apply(rollout_id, lambda s: switch_started(s, node, res.switch_id)
                          if s.node(node).status is NodeStatus.SWITCHING else Step(s),
                          node=node, switch_id=res.switch_id,
                          detail=f"{node}: switch {res.switch_id} started (again: "
                                 f"{not_received} never reached the agent)")
        return res.switch_id

    async def _wait_final(self, node: str, switch_id: str):
        """The switch's row once final: subscribed to its events first, then read (an event
        may have passed before the subscription), re-read on each event and every
        :data:`FOLLOW_POLL_S` (a dropped subscription falls back to polling)."""
        try:
            sub = self.ctl.hub.subscribe(node, switch_id)
        except Unavailable:
            sub = None
        try:
            while True:
                row = await self.store.switch(switch_id)
                if row is None:
                    raise NotFound(f"switch {switch_id} has no record")
                if row.outcome != Outcome.RUNNING:
                    return row
                if sub is None:
                    await asyncio.sleep(POLL_WITHOUT_EVENTS_S)
                    continue
                try:
                    await asyncio.wait_for(sub.get(), FOLLOW_POLL_S)
                except TimeoutError:
                    pass
                except RempError:
                    self.ctl.hub.unsubscribe(sub)
                    sub = None
        finally:
            if sub is not None:
                self.ctl.hub.unsubscribe(sub)

    async def _finished(self, rollout_id: str, node: str, outcome: Outcome | None,
                        error: str, switch_id: str = "") -> None:
        async def nodes_if_a_wave_starts(s: RolloutState, meta: RolloutMeta):
            # the nodes of now (one read of every node) only when this finish starts a wave
            if switch_finished(s, node, outcome, error).start:
                return await self._nodes_now(), meta
            return None, meta

        def fin(s: RolloutState, ctx) -> Step:
            nodes, meta = ctx
            step = switch_finished(s, node, outcome, error)
            if step.start:  # the next wave would start now: with the health of now?
                why = self._floor(s, step.state.wave, nodes, meta)
                if why:
                    step = switch_finished(pause(s, why).state, node, outcome, error)
            return step
        step, _ = await self._apply(rollout_id, fin, node=node, switch_id=switch_id,
                                    detail=f"{node}: {outcome or 'not started'}"
                                    + (f": {error}" if error else ""),
                                    prepare=nodes_if_a_wave_starts)
        self._act(rollout_id, step)

    async def _nodes_now(self) -> list[RolloutNode]:
        return rollout_nodes(await self.store.nodes_fields(NODE_FIELDS))

    @staticmethod
    def _floor(s: RolloutState, wave: int, nodes: list[RolloutNode], meta: RolloutMeta) -> str:
        members = _set(s)
        now = [n for n in nodes if n.name in members]
        try:
            return wave_keeps_floor(s, wave, now, capacity_table(dict(meta.capacity_rps)))
        except RempError as exc:
            return str(exc)

    async def _abort_switches(self, s: RolloutState, reason: str) -> None:
        for p in s.nodes:
            if p.status is not NodeStatus.SWITCHING or not p.switch_id:
                continue
            try:
                await self.ctl.abort(p.switch_id, reason)
            except RempError as exc:  # past MIGRATE_KV, or finished: it finishes on its own
                log.info("controller.rollout_abort_refused", rollout_id=s.rollout_id,
                         node=p.node, switch_id=p.switch_id, error=str(exc))
