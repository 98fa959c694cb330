"""The pure core of a fleet rollout (no I/O, no clock, no Redis, no protobuf): plan the waves
that switch a set of nodes to one target topology without letting the set's serving capacity
fall below a floor, and the rollout's life as transitions over frozen dataclasses.

Planning (:func:`plan_rollout`). Inputs: the nodes (:class:`RolloutNode`: name, current
topology, candidates, labels, health), the target, the floor (a fraction of the set's serving
capacity now), the most nodes switching at once, and ``capacity(node, topology) -> float`` (e.g.
the SLO capacity of the node's policy profile; :func:`capacity_table` for one table for all).
Rules:

* the *base* is the summed capacity of the set's READY nodes on their current topologies; the
  *required* capacity is ``floor × base``;
* a node on the target already is skipped; a node that is not READY (lost, draining, in a
  switch of its own) serves nothing, counts 0 and is excluded (listed with the reason, never
  switched); a READY node whose candidates lack the target is an error;
* while a wave runs, its nodes count 0, earlier waves' nodes count the target's capacity, later
  ones their current capacity; every wave keeps that sum ≥ required;
* order: nodes that gain capacity (target ≥ current) first, smallest current capacity (the
  least taken out while it switches) first; then nodes that lose capacity, largest target
  capacity first; ties by name (so one table for all nodes gives name order within each
  group; the rest matters for mixed hosts). One at a time, this order keeps the floor whenever
  any order does (an exchange argument: a gainer only adds headroom, and of two adjacent losers
  the one with the larger target capacity first needs the least headroom), so when it fails the
  floor cannot be kept one node at a time, and :class:`RolloutInfeasible` names the node;
* waves are filled in that order: a node joins the open wave while the wave has fewer than
  ``max_parallel`` nodes and the floor still holds with it, else it opens the next wave.

Life (:class:`RolloutState`, transitions return a :class:`Step`: the new state and the nodes
the driver must start now)::

    PLANNED ─start→ RUNNING(wave k) ─wave k done→ RUNNING(k+1) … → DONE
                      │  a node failed: the wave's others finish, then FAILED(node)
                      │  pause: the wave finishes, then PAUSED ─resume→ RUNNING(k+1)
                      │  abort: the wave finishes, then ABORTED (PLANNED/PAUSED: at once)

Before each wave the driver re-checks the floor with the health of now
(:func:`wave_keeps_floor`). Every transition bumps ``version`` (the value a store compares
before it writes, like the switch scripts of :mod:`controller.store`); a transition not allowed
from the state raises :class:`IllegalRolloutTransition` (FAILED_PRECONDITION).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from controller.model import NodeHealth
from remp.errors import FailedPrecondition, InvalidArgument, NotFound
from remp.topology import Topology, format_topologies
from remp.transaction import Outcome

EPS = 1e-9  # relative slack on capacity sums (float addition order)

Capacity = Callable[["RolloutNode", Topology], float]


# ---------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class RolloutNode:
    name: str
    topology: Topology
    candidates: tuple[Topology, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()  # (key, value) pairs, sorted
    health: NodeHealth = NodeHealth.READY


def capacity_table(table: Mapping[Topology | str, float]) -> Capacity:
    """``capacity`` from one table for every node, keyed by Topology or "TPxPPy" (e.g. a
    profile's capacities)."""
    by_topo = {(Topology.parse(k) if isinstance(k, str) else k): float(v)
               for k, v in table.items()}

    def capacity(node: RolloutNode, t: Topology) -> float:
        return by_topo[t]
    return capacity


def select_nodes(nodes: Iterable[RolloutNode], names: Iterable[str] = (),
                 labels: Mapping[str, str] | None = None) -> tuple[RolloutNode, ...]:
    """The rollout's set: the nodes named, or those whose labels match every ``key=value`` of
    ``labels`` (exactly one of the two), sorted by name."""
    by_name = {n.name: n for n in nodes}
    names = tuple(names)
    if bool(names) == bool(labels):
        raise InvalidArgument("a rollout names its nodes or gives a label selector (one of them)")
    if names:
        unknown = sorted(set(names) - set(by_name))
        if unknown:
            raise NotFound(f"unknown node(s) {', '.join(unknown)} (ListNodes shows the "
                           "registered ones)")
        picked = [by_name[n] for n in set(names)]
    else:
        want = dict(labels or {})
        picked = [n for n in by_name.values()
                  if all(dict(n.labels).get(k) == v for k, v in want.items())]
        if not picked:
            sel = ",".join(f"{k}={v}" for k, v in sorted(want.items()))
            raise NotFound(f"no registered node matches the labels {sel}")
    return tuple(sorted(picked, key=lambda n: n.name))


# ---------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Wave:
    index: int
    nodes: tuple[str, ...]
    capacity_during: float  # the set's capacity while this wave's nodes switch
    capacity_after: float  # … once they serve the target


@dataclass(frozen=True)
class RolloutPlan:
    target: Topology
    floor: float
    max_parallel: int
    base_capacity: float
    required_capacity: float
    waves: tuple[Wave, ...]
    skipped: tuple[str, ...] = ()  # already on the target
    excluded: tuple[tuple[str, str], ...] = ()  # (node, why): not serving, not switched

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(n for w in self.waves for n in w.nodes)


class RolloutInfeasible(FailedPrecondition):
    """The floor cannot be kept even switching one node at a time: ``node`` is the first one
    whose switch alone would leave ``capacity`` < ``required``."""

    def __init__(self, node: str, capacity: float, required: float, message: str):
        super().__init__(message)
        self.node, self.capacity, self.required = node, capacity, required


def _cap(capacity: Capacity, node: RolloutNode, topo: Topology) -> float:
    try:
        c = float(capacity(node, topo))
    except KeyError:
        raise InvalidArgument(f"no capacity known for {topo} (node {node.name}): the profile "
                              "must cover every topology of the rollout") from None
    if not c >= 0:
        raise InvalidArgument(f"capacity of {topo} must be >= 0, got {c}")
    return c


def _keeps(cap: float, required: float) -> bool:
    return cap >= required - EPS * max(1.0, abs(required))


def order_key(current: float, target: float, name: str) -> tuple:
    """The documented order: gainers first by current capacity, then losers by target
    capacity descending, then name."""
    return (0, current, name) if target >= current else (1, -target, name)


def plan_rollout(nodes: Iterable[RolloutNode], target: Topology, floor: float,
                 max_parallel: int, capacity: Capacity) -> RolloutPlan:
    if not 0.0 <= floor <= 1.0:
        raise InvalidArgument(f"capacity floor must be a fraction in [0, 1], got {floor}")
    if max_parallel < 1:
        raise InvalidArgument(f"max_parallel must be >= 1, got {max_parallel}")
    nodes = sorted(nodes, key=lambda n: n.name)
    if len({n.name for n in nodes}) != len(nodes):
        raise InvalidArgument("a node is listed twice")
    skipped, excluded, todo = [], [], []
    base = 0.0
    for n in nodes:
        if n.health != NodeHealth.READY:
            excluded.append((n.name, f"not serving ({NodeHealth(n.health).name.lower()})"))
            continue
        c = _cap(capacity, n, n.topology)
        base += c
        if n.topology == target:
            skipped.append(n.name)
            continue
        if target not in n.candidates:
            raise InvalidArgument(f"target {target} is not a candidate of node {n.name} "
                                  f"(valid targets: {format_topologies(list(n.candidates))})")
        todo.append((n.name, c, _cap(capacity, n, target)))
    required = floor * base
    todo.sort(key=lambda x: order_key(x[1], x[2], x[0]))
    waves: list[Wave] = []
    settled = base  # capacity with every earlier wave on the target and nothing switching
    cur: list[str] = []
    out = 0.0  # capacity the open wave takes out
    gain = 0.0  # what the open wave adds once done
    for name, c, t in todo:
        if cur and len(cur) < max_parallel and _keeps(settled - out - c, required):
            cur.append(name)
            out, gain = out + c, gain + t - c
            continue
        if cur:
            waves.append(Wave(len(waves), tuple(cur), settled - out, settled + gain))
            settled += gain
        if not _keeps(settled - c, required):
            raise RolloutInfeasible(
                name, settled - c, required,
                f"the capacity floor {floor:g} cannot be kept even one node at a time: "
                f"switching {name} (capacity {c:g} while it switches) would leave "
                f"{settled - c:g} of the required {required:g} (base {base:g})"
                + (f" after {sum(len(w.nodes) for w in waves)} node(s) switched" if waves
                   else ""))
        cur, out, gain = [name], c, t - c
    if cur:
        waves.append(Wave(len(waves), tuple(cur), settled - out, settled + gain))
    return RolloutPlan(target, floor, max_parallel, base, required, tuple(waves),
                       tuple(skipped), tuple(excluded))


# ---------------------------------------------------------------------- the life
class RolloutStatus(StrEnum):
    PLANNED = "planned"
    RUNNING = "running"
    PAUSED = "paused"
    ABORTED = "aborted"
    FAILED = "failed"
    DONE = "done"


class NodeStatus(StrEnum):
    PENDING = "pending"  # not started (yet, or never: the rollout stopped)
    SWITCHING = "switching"
    SUCCEEDED = "succeeded"  # serves the target (switch succeeded, or it already did: noop)
    ROLLED_BACK = "rolled_back"  # its switch failed or was aborted; back on the old topology
    FAILED = "failed"  # its switch failed and did not roll back, the outcome is unknown, or
    #                    it could not be started


def terminal_statuses() -> frozenset[RolloutStatus]:
    return frozenset({RolloutStatus.ABORTED, RolloutStatus.FAILED, RolloutStatus.DONE})


class IllegalRolloutTransition(FailedPrecondition):
    pass


@dataclass(frozen=True)
class NodeProgress:
    node: str
    wave: int
    status: NodeStatus = NodeStatus.PENDING
    switch_id: str = ""
    outcome: Outcome | None = None
    error: str = ""


@dataclass(frozen=True)
class RolloutState:
    rollout_id: str
    plan: RolloutPlan
    status: RolloutStatus = RolloutStatus.PLANNED
    wave: int = -1  # the wave running or last run; -1 before the first
    nodes: tuple[NodeProgress, ...] = ()
    failed_node: str = ""
    pause_requested: bool = False
    abort_requested: bool = False
    reason: str = ""
    version: int = 0

    def node(self, name: str) -> NodeProgress:
        for p in self.nodes:
            if p.node == name:
                return p
        raise NotFound(f"node {name!r} is not part of rollout {self.rollout_id}")

    def in_wave(self, k: int) -> tuple[NodeProgress, ...]:
        return tuple(p for p in self.nodes if p.wave == k)

    @property
    def switching(self) -> tuple[str, ...]:
        return tuple(p.node for p in self.nodes if p.status is NodeStatus.SWITCHING)

    @property
    def terminal(self) -> bool:
        return self.status in terminal_statuses()


@dataclass(frozen=True)
class Step:
    """A transition's result: persist ``state`` (compare-and-set on the old version), then
    start a switch on each node of ``start`` (idempotency key :func:`request_id`)."""

    state: RolloutState
    start: tuple[str, ...] = ()


def request_id(rollout_id: str, node: str) -> str:
    """The Reconfigure request id of a rollout's switch on a node: a leader that re-sends it
    after a crash gets the same switch back (the controller's reqid dedup), never a second."""
    return f"rollout:{rollout_id}:{node}"


def new_rollout(rollout_id: str, plan: RolloutPlan) -> RolloutState:
    return RolloutState(rollout_id, plan, nodes=tuple(
        NodeProgress(n, w.index) for w in plan.waves for n in w.nodes))


def _next(s: RolloutState, **changes) -> RolloutState:
    return replace(s, version=s.version + 1, **changes)


def _illegal(s: RolloutState, what: str) -> IllegalRolloutTransition:
    detail = f" (failed node: {s.failed_node})" if s.failed_node else ""
    return IllegalRolloutTransition(f"rollout {s.rollout_id} is {s.status}{detail}: "
                                    f"cannot {what}")


def _enter_wave(s: RolloutState, k: int) -> Step:
    if k >= len(s.plan.waves):
        return Step(_next(s, status=RolloutStatus.DONE, wave=k - 1, pause_requested=False))
    names = s.plan.waves[k].nodes
    nodes = tuple(replace(p, status=NodeStatus.SWITCHING) if p.node in names else p
                  for p in s.nodes)
    return Step(_next(s, status=RolloutStatus.RUNNING, wave=k, nodes=nodes), names)


def start(s: RolloutState) -> Step:
    if s.status is not RolloutStatus.PLANNED:
        raise _illegal(s, "start")
    return _enter_wave(s, 0)


def switch_started(s: RolloutState, node: str, switch_id: str) -> RolloutState:
    """The controller accepted the node's switch (the id to reconcile it by after a crash)."""
    p = s.node(node)
    if p.status is not NodeStatus.SWITCHING:
        raise _illegal(s, f"record a switch on {node}, which is {p.status}")
    if p.switch_id == switch_id:
        return s
    return _next(s, nodes=_put(s, replace(p, switch_id=switch_id)))


def _put(s: RolloutState, q: NodeProgress) -> tuple[NodeProgress, ...]:
    return tuple(q if p.node == q.node else p for p in s.nodes)


NODE_STATUS = {
    Outcome.SUCCEEDED: NodeStatus.SUCCEEDED,
    Outcome.NOOP: NodeStatus.SUCCEEDED,
    Outcome.ROLLED_BACK: NodeStatus.ROLLED_BACK,
    Outcome.ABORTED: NodeStatus.ROLLED_BACK,
    Outcome.FAILED: NodeStatus.FAILED,
    Outcome.UNKNOWN: NodeStatus.FAILED,
}


def switch_finished(s: RolloutState, node: str, outcome: Outcome | None,
                    error: str = "") -> Step:
    """A node's switch ended (``outcome`` None: it could not be started, ``error`` says why).
    The first node that does not succeed is the rollout's failed node — unless an abort was
    asked for and the node's switch was aborted. Once the wave has no node switching, the
    rollout moves on: FAILED, ABORTED, PAUSED, the next wave, or DONE."""
    p = s.node(node)
    if p.status is not NodeStatus.SWITCHING:
        if p.status is not NodeStatus.PENDING and p.outcome == outcome:
            return Step(s)  # told twice (a driver that restarted): nothing changes
        raise _illegal(s, f"finish a switch on {node}, which is {p.status}")
    if outcome is Outcome.RUNNING:
        raise InvalidArgument("a running switch has not finished")
    status = NODE_STATUS.get(outcome, NodeStatus.FAILED) if outcome else NodeStatus.FAILED
    failed = s.failed_node
    if status is not NodeStatus.SUCCEEDED and not failed and not (
            s.abort_requested and outcome is Outcome.ABORTED):
        failed = node
    s = _next(s, nodes=_put(s, replace(p, status=status, outcome=outcome, error=error)),
              failed_node=failed)
    if s.switching:
        return Step(s)
    if s.failed_node:
        why = s.node(s.failed_node)
        return Step(_next(s, status=RolloutStatus.FAILED, pause_requested=False,
                          reason=f"node {s.failed_node}: {why.outcome or 'not started'}"
                                 + (f": {why.error}" if why.error else "")))
    if s.abort_requested:
        return Step(_next(s, status=RolloutStatus.ABORTED, pause_requested=False))
    if s.pause_requested and s.wave + 1 < len(s.plan.waves):
        return Step(_next(s, status=RolloutStatus.PAUSED, pause_requested=False))
    return _enter_wave(s, s.wave + 1)


def pause(s: RolloutState, reason: str = "") -> Step:
    """PLANNED → PAUSED; RUNNING → PAUSED once the running wave has finished (nothing new
    starts); PAUSED: unchanged."""
    if s.status is RolloutStatus.PAUSED:
        return Step(s)
    if s.status is RolloutStatus.PLANNED:
        return Step(_next(s, status=RolloutStatus.PAUSED, reason=reason))
    if s.status is not RolloutStatus.RUNNING:
        raise _illegal(s, "pause")
    if s.switching:
        return Step(_next(s, pause_requested=True, reason=reason))
    return Step(_next(s, status=RolloutStatus.PAUSED, reason=reason))


def resume(s: RolloutState) -> Step:
    """PAUSED → the next wave (the first, if it never started); RUNNING with a pause asked
    for: the request is dropped; RUNNING: unchanged."""
    if s.status is RolloutStatus.RUNNING:
        return Step(_next(s, pause_requested=False) if s.pause_requested else s)
    if s.status is not RolloutStatus.PAUSED:
        raise _illegal(s, "resume")
    return _enter_wave(replace(s, reason=""), s.wave + 1)


def abort(s: RolloutState, reason: str = "") -> Step:
    """PLANNED/PAUSED → ABORTED at once; RUNNING → ABORTED once the running wave has finished
    (the driver may also abort its switches still in an abortable phase: remp.transaction's
    RULES); nothing further starts. Aborting an aborted rollout: unchanged."""
    if s.status is RolloutStatus.ABORTED:
        return Step(s)
    if s.status in (RolloutStatus.PLANNED, RolloutStatus.PAUSED):
        return Step(_next(s, status=RolloutStatus.ABORTED, reason=reason))
    if s.status is not RolloutStatus.RUNNING:
        raise _illegal(s, "abort")
    if s.switching:
        return Step(_next(s, abort_requested=True, pause_requested=False, reason=reason))
    return Step(_next(s, status=RolloutStatus.ABORTED, reason=reason))


def resume_after_restart(s: RolloutState) -> Step:
    """What a (new) leader does with a stored rollout: a RUNNING one whose wave has nodes
    switching re-drives exactly those (same request ids, so the switches already accepted come
    back as duplicates and are followed, not re-run); every other state starts nothing."""
    if s.status is RolloutStatus.RUNNING:
        return Step(s, s.switching)
    return Step(s)


def wave_keeps_floor(s: RolloutState, k: int, nodes_now: Iterable[RolloutNode],
                     capacity: Capacity) -> str:
    """Before wave ``k`` starts, with the set as it is *now* (health and topology re-read):
    "" when the capacity while it runs stays ≥ the plan's required capacity, else why not (the
    driver then pauses with this reason instead of starting it). Nodes of the wave count 0,
    nodes not READY count 0, the others their current topology's capacity."""
    wave = set(s.plan.waves[k].nodes)
    have, down = 0.0, []
    for n in sorted(nodes_now, key=lambda n: n.name):
        if n.health != NodeHealth.READY:
            down.append(n.name)
        elif n.name not in wave:
            have += _cap(capacity, n, n.topology)
    if _keeps(have, s.plan.required_capacity):
        return ""
    why = f" (not serving: {', '.join(down)})" if down else ""
    return (f"wave {k} would leave {have:g} of the required {s.plan.required_capacity:g}"
            f"{why}")
