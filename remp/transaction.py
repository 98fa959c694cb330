"""The switch transaction as one table-driven state machine (pure: no I/O, injectable clock).

    SERVING_OLD → QUIESCING → PREPARING_WORKERS → MPU_APPLIED
        → [ MIGRATE_KV ‖ RELOAD_SHARDS ] → REBINDING → SERVING_NEW
    any failure before SERVING_NEW → ROLLING_BACK → ROLLED_BACK (or FAILED if rollback fails)

The node agent executes it; the controller persists it. Both use this table, so they cannot drift.
Phase numbers equal the proto enum ``remp.common.v1.Phase``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum


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


def terminal_phases() -> frozenset[Phase]:
    return frozenset(p for p, nxt in TRANSITIONS.items() if not nxt)


def abortable_phases() -> frozenset[Phase]:
    """An operator may abort until the data path starts (nothing has moved yet)."""
    return frozenset({Phase.SERVING_OLD, Phase.QUIESCING, Phase.PREPARING_WORKERS, Phase.MPU_APPLIED})


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
