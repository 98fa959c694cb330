"""The switch transaction as one table-driven state machine (pure: no I/O, injectable clock).

    SERVING_OLD → QUIESCING → PREPARING_WORKERS → MPU_APPLIED
        → [ MIGRATE_KV ‖ RELOAD_SHARDS ] → REBINDING → SERVING_NEW
    any failure before SERVING_NEW → ROLLING_BACK → ROLLED_BACK (or FAILED if rollback fails)

The node agent executes it; the controller persists it. Both use this table, so they cannot drift.
Phase numbers equal the proto enum ``remp.common.v1.Phase``; :class:`Outcome` values are the
strings stored in Redis and shown in JSON (the proto mapping is in :mod:`remp.convert`).

Per phase, :data:`RULES` says whether an operator's abort is accepted while the switch is in it,
whether a pending abort is honoured on entering it, and what the rollback does after a failure in
it. The controller (``Abort``), the agent (``AbortSwitch``) and the switch driver all read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, IntEnum, StrEnum


class Phase(IntEnum):
    UNSPECIFIED = 0
    SERVING_OLD = 1
    QUIESCING = 2
    PREPARING_WORKERS = 3
    MPU_APPLIED = 4
    MIGRATE_KV = 5
    RELOAD_SHARDS = 6
    REBINDING = 7
    SERVING_NEW = 8
    ROLLING_BACK = 9
    ROLLED_BACK = 10
    FAILED = 11


# The forward path, in order. MIGRATE_KV and RELOAD_SHARDS form one step that may run concurrently.
FORWARD: tuple[Phase, ...] = (
    Phase.QUIESCING,
    Phase.PREPARING_WORKERS,
    Phase.MPU_APPLIED,
    Phase.MIGRATE_KV,
    Phase.RELOAD_SHARDS,
    Phase.REBINDING,
    Phase.SERVING_NEW,
)
DATA_PATH: frozenset[Phase] = frozenset({Phase.MIGRATE_KV, Phase.RELOAD_SHARDS})

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.SERVING_OLD: frozenset({Phase.QUIESCING, Phase.ROLLED_BACK}),
    Phase.QUIESCING: frozenset({Phase.PREPARING_WORKERS, Phase.ROLLING_BACK}),
    Phase.PREPARING_WORKERS: frozenset({Phase.MPU_APPLIED, Phase.ROLLING_BACK}),
    Phase.MPU_APPLIED: frozenset({Phase.MIGRATE_KV, Phase.RELOAD_SHARDS, Phase.ROLLING_BACK}),
    Phase.MIGRATE_KV: frozenset({Phase.RELOAD_SHARDS, Phase.REBINDING, Phase.ROLLING_BACK}),
    Phase.RELOAD_SHARDS: frozenset({Phase.MIGRATE_KV, Phase.REBINDING, Phase.ROLLING_BACK}),
    Phase.REBINDING: frozenset({Phase.SERVING_NEW, Phase.ROLLING_BACK}),
    Phase.ROLLING_BACK: frozenset({Phase.ROLLED_BACK, Phase.FAILED}),
    Phase.SERVING_NEW: frozenset(),
    Phase.ROLLED_BACK: frozenset(),
    Phase.FAILED: frozenset(),
}


class Outcome(StrEnum):
    """How a switch ended (or that it has not). A ``str``: equal to, and stored as, its value."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"  # failed; back on the old topology, KV intact (retryable)
    FAILED = "failed"  # failed and could not roll back: the engine is in an unknown state
    ABORTED = "aborted"  # an operator aborted it before MIGRATE_KV; rolled back
    NOOP = "noop"  # the target was the current topology
    UNKNOWN = "unknown"  # the controller lost track and the agent could not say


def finished_outcomes() -> frozenset[Outcome]:
    return frozenset(o for o in Outcome if o is not Outcome.RUNNING)


def rolled_back_outcomes() -> frozenset[Outcome]:
    """Outcomes after which the node serves its old topology again."""
    return frozenset({Outcome.ROLLED_BACK, Outcome.ABORTED})


class Rollback(Enum):
    """What ROLLING_BACK undoes after a failure in a phase (node_agent.switch runs it; the
    workers' part is the engine plugin's ``remp_sw_rollback``)."""

    NOTHING = "nothing ran yet: straight to ROLLED_BACK"
    RESUME = "resume the paused engine on the old topology"
    WORKERS = ("workers reinstall the old communicator groups, model runner and forward "
               "context, the engine core its old topology; then resume")
    WORKERS_AND_KV = ("as WORKERS, after reverse-migrating every KV layer already moved to the "
                      "new owners and restoring renumbered block tables")
    NONE = "no rollback from here (finished, or the rollback itself failed → FAILED)"

    @property
    def touches_workers(self) -> bool:
        return self in (Rollback.WORKERS, Rollback.WORKERS_AND_KV)


@dataclass(frozen=True)
class PhaseRule:
    abort_while_in: bool  # AbortSwitch / Abort accepted while the switch is in this phase
    abort_on_entry: bool  # a pending abort stops the switch before it enters this phase
    rollback: Rollback  # what a failure in this phase rolls back


# Abort is allowed until MIGRATE_KV starts: after that, finishing is faster and safer than
# undoing (KV has moved). An abort accepted in phase P is honoured when entering the next one.
RULES: dict[Phase, PhaseRule] = {
    Phase.SERVING_OLD: PhaseRule(True, False, Rollback.NOTHING),
    Phase.QUIESCING: PhaseRule(True, True, Rollback.RESUME),
    Phase.PREPARING_WORKERS: PhaseRule(True, True, Rollback.WORKERS),
    Phase.MPU_APPLIED: PhaseRule(True, True, Rollback.WORKERS),
    Phase.MIGRATE_KV: PhaseRule(False, True, Rollback.WORKERS_AND_KV),
    Phase.RELOAD_SHARDS: PhaseRule(False, False, Rollback.WORKERS_AND_KV),
    Phase.REBINDING: PhaseRule(False, False, Rollback.WORKERS_AND_KV),
    Phase.SERVING_NEW: PhaseRule(False, False, Rollback.NONE),
    Phase.ROLLING_BACK: PhaseRule(False, False, Rollback.NONE),
    Phase.ROLLED_BACK: PhaseRule(False, False, Rollback.NONE),
    Phase.FAILED: PhaseRule(False, False, Rollback.NONE),
}


def terminal_phases() -> frozenset[Phase]:
    return frozenset(p for p, nxt in TRANSITIONS.items() if not nxt)


def abort_accepted(phase: int) -> bool:
    """May an operator abort a running switch that is in ``phase`` (a Phase or its proto int)?"""
    try:
        return RULES[Phase(phase)].abort_while_in
    except (ValueError, KeyError):  # not a phase a switch can be in
        return False


def abort_honoured_on_entry(phase: Phase) -> bool:
    """Does a pending abort stop the switch before it enters ``phase``?"""
    return RULES[phase].abort_on_entry


def rollback_from(phase: Phase) -> Rollback:
    return RULES[phase].rollback


def abortable_phases() -> frozenset[Phase]:
    """An operator may abort until the data path starts (nothing has moved yet)."""
    return frozenset(p for p, r in RULES.items() if r.abort_while_in)


def fault_injectable_phases() -> tuple[Phase, ...]:
    """Phases where the test-only fault injection can fail a switch (all before SERVING_NEW)."""
    return FORWARD[:-1]


class IllegalTransition(RuntimeError):
    pass


@dataclass
class SwitchMachine:
    """Tracks one switch through the table; records when each phase started and ended."""

    clock: Callable[[], float] = time.monotonic
    phase: Phase = Phase.SERVING_OLD
    started: dict[Phase, float] = field(default_factory=dict)
    ended: dict[Phase, float] = field(default_factory=dict)
    history: list[Phase] = field(default_factory=lambda: [Phase.SERVING_OLD])

    def __post_init__(self) -> None:
        self.t0 = self.clock()

    def can(self, to: Phase) -> bool:
        return to in TRANSITIONS[self.phase]

    def advance(self, to: Phase) -> Phase:
        if not self.can(to):
            raise IllegalTransition(f"{self.phase.name} → {to.name} is not a legal transition")
        now = self.clock()
        if self.phase not in DATA_PATH or to not in DATA_PATH:
            for p in list(self.started):
                self.ended.setdefault(p, now)
        self.phase = to
        self.started.setdefault(to, now)
        self.history.append(to)
        if to in terminal_phases():
            self.ended.setdefault(to, now)
        return to

    def mark(self, phase: Phase, start: float, end: float) -> None:
        """Record a phase measured elsewhere (e.g. a data-path phase timed inside the workers)."""
        self.started[phase], self.ended[phase] = start, end

    @property
    def done(self) -> bool:
        return self.phase in terminal_phases()

    def seconds(self, phase: Phase) -> float | None:
        if phase not in self.started:
            return None
        return self.ended.get(phase, self.clock()) - self.started[phase]

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def timings(self) -> list[tuple[Phase, float, float]]:
        """(phase, started at, seconds) for every phase entered except terminal ones, in order."""
        out = []
        for p in sorted(self.started, key=lambda q: (self.started[q], q)):
            if p in terminal_phases() or p is Phase.SERVING_OLD:
                continue
            out.append((p, self.started[p], self.seconds(p) or 0.0))
        return out
