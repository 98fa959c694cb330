"""Proto converters for the shared pure types (the services' own converters live in each
service's package and use these). :mod:`remp.transaction` stays proto-free; this is its one
mapping onto ``remp.common.v1``."""

from __future__ import annotations

from remp.common.v1 import types_pb2
from remp.transaction import Outcome, finished_outcomes

# Outcome.X ↔ SWITCH_OUTCOME_X, every member both ways (pinned by tests/unit/test_transaction.py)
OUTCOME_TO_PROTO: dict[Outcome, int] = {
    o: types_pb2.SwitchOutcome.Value("SWITCH_OUTCOME_" + o.name) for o in Outcome
}
OUTCOME_FROM_PROTO: dict[int, Outcome] = {v: o for o, v in OUTCOME_TO_PROTO.items()}


def outcome_to_proto(outcome: Outcome | str) -> int:
    return OUTCOME_TO_PROTO[Outcome(outcome)]


def outcome_from_proto(value: int) -> Outcome:
    """The outcome a proto value stands for; UNSPECIFIED (or a value this build does not know)
    is UNKNOWN."""
    return OUTCOME_FROM_PROTO.get(value, Outcome.UNKNOWN)


def finished_outcome_from_proto(value: int) -> Outcome:
    """The outcome to record for a switch being finished: anything not a final outcome (RUNNING,
    UNSPECIFIED) is UNKNOWN."""
    o = outcome_from_proto(value)
    return o if o in finished_outcomes() else Outcome.UNKNOWN
