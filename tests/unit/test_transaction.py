import json

import pytest

from remp.common.v1 import types_pb2
from remp.convert import (OUTCOME_FROM_PROTO, OUTCOME_TO_PROTO, finished_outcome_from_proto,
                          outcome_from_proto, outcome_to_proto)
from remp.transaction import (
    DATA_PATH, FORWARD, RULES, TRANSITIONS, IllegalTransition, Outcome, Phase, Rollback,
    SwitchMachine, abort_accepted, abort_honoured_on_entry, abortable_phases, finished_outcomes,
    rollback_from, rolled_back_outcomes, terminal_phases,
)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_phase_numbers_equal_proto_enum():
    for p in Phase:
        assert types_pb2.Phase.Value("PHASE_" + p.name) == p.value


def test_happy_path_records_timings():
    clk = FakeClock()
    m = SwitchMachine(clock=clk)
    for i, p in enumerate(FORWARD):
        clk.t += 1 + i
        m.advance(p)
    assert m.done and m.phase is Phase.SERVING_NEW
    t = {p: s for p, _, s in m.timings()}
    assert t[Phase.QUIESCING] == 2  # entered at +1, left at +1+2
    assert set(t) == set(FORWARD) - {Phase.SERVING_NEW}


def test_data_path_phases_overlap():
    clk = FakeClock()
    m = SwitchMachine(clock=clk)
    for p in FORWARD[:3]:
        m.advance(p)
    m.advance(Phase.MIGRATE_KV)
    clk.t += 1
    m.advance(Phase.RELOAD_SHARDS)  # migrate keeps running
    clk.t += 2
    m.advance(Phase.REBINDING)
    assert m.seconds(Phase.MIGRATE_KV) == 3 and m.seconds(Phase.RELOAD_SHARDS) == 2


@pytest.mark.parametrize("bad", [Phase.MIGRATE_KV, Phase.SERVING_NEW, Phase.ROLLING_BACK])
def test_illegal_transitions_rejected(bad):
    m = SwitchMachine()
    with pytest.raises(IllegalTransition):
        m.advance(bad)


def test_every_non_terminal_phase_can_roll_back():
    for p, nxt in TRANSITIONS.items():
        if p in terminal_phases() or p in (Phase.SERVING_OLD, Phase.ROLLING_BACK):
            continue
        assert Phase.ROLLING_BACK in nxt, p


def test_rollback_path():
    m = SwitchMachine()
    m.advance(Phase.QUIESCING)
    m.advance(Phase.ROLLING_BACK)
    m.advance(Phase.ROLLED_BACK)
    assert m.done and m.history[-1] is Phase.ROLLED_BACK
    with pytest.raises(IllegalTransition):
        m.advance(Phase.QUIESCING)


def test_abortable_only_before_data_path():
    assert Phase.MPU_APPLIED in abortable_phases()
    assert not abortable_phases() & {Phase.MIGRATE_KV, Phase.RELOAD_SHARDS, Phase.REBINDING}


# ---------------------------------------------------------------- the phase rules (one table)

def test_rules_cover_every_phase_a_switch_can_be_in():
    assert set(RULES) == set(TRANSITIONS)


def test_abort_accepted_exactly_before_migrate_kv():
    accepted = {p for p in Phase if abort_accepted(p)}
    assert accepted == {Phase.SERVING_OLD, Phase.QUIESCING, Phase.PREPARING_WORKERS,
                        Phase.MPU_APPLIED}
    assert accepted == abortable_phases()
    # the controller passes the proto int it stored; unknown numbers are refused
    assert abort_accepted(int(types_pb2.PHASE_MPU_APPLIED))
    assert not abort_accepted(int(types_pb2.PHASE_MIGRATE_KV))
    assert not abort_accepted(0) and not abort_accepted(99)


def test_pending_abort_is_honoured_entering_the_phase_after_an_abortable_one():
    honoured = {p for p in Phase if p in RULES and abort_honoured_on_entry(p)}
    assert honoured == {Phase.QUIESCING, Phase.PREPARING_WORKERS, Phase.MPU_APPLIED,
                        Phase.MIGRATE_KV}
    # an abort accepted in P always stops the switch at P's next forward phase
    for p in abortable_phases():
        nxt = FORWARD[FORWARD.index(p) + 1] if p in FORWARD else FORWARD[0]
        assert abort_honoured_on_entry(nxt), p


def test_rollback_from_each_phase():
    assert rollback_from(Phase.SERVING_OLD) is Rollback.NOTHING
    assert rollback_from(Phase.QUIESCING) is Rollback.RESUME
    assert {p for p in RULES if rollback_from(p).touches_workers} == {
        Phase.PREPARING_WORKERS, Phase.MPU_APPLIED, Phase.MIGRATE_KV, Phase.RELOAD_SHARDS,
        Phase.REBINDING}
    assert {p for p in RULES if rollback_from(p) is Rollback.WORKERS_AND_KV} == DATA_PATH | {
        Phase.REBINDING}
    for p in terminal_phases() | {Phase.ROLLING_BACK}:
        assert rollback_from(p) is Rollback.NONE
    # every phase with a rollback can actually enter ROLLING_BACK (or, before QUIESCING,
    # finish as ROLLED_BACK)
    for p, rule in RULES.items():
        if rule.rollback is Rollback.NOTHING:
            assert Phase.ROLLED_BACK in TRANSITIONS[p]
        elif rule.rollback is not Rollback.NONE:
            assert Phase.ROLLING_BACK in TRANSITIONS[p], p


# ---------------------------------------------------------------- outcomes

def test_outcome_values_are_the_stored_strings():
    assert [o.value for o in Outcome] == ["running", "succeeded", "rolled_back", "failed",
                                          "aborted", "noop", "unknown"]
    assert Outcome.SUCCEEDED == "succeeded" and Outcome("rolled_back") is Outcome.ROLLED_BACK
    assert f"{Outcome.ABORTED}" == str(Outcome.ABORTED) == "aborted"
    assert json.dumps({"o": Outcome.NOOP}) == '{"o": "noop"}'
    assert {"failed": 1}[Outcome.FAILED] == 1
    assert finished_outcomes() == set(Outcome) - {Outcome.RUNNING}
    assert rolled_back_outcomes() == {Outcome.ROLLED_BACK, Outcome.ABORTED}


def test_every_proto_outcome_maps_both_ways():
    for name, value in types_pb2.SwitchOutcome.items():
        if value == types_pb2.SWITCH_OUTCOME_UNSPECIFIED:
            assert outcome_from_proto(value) is Outcome.UNKNOWN
            continue
        o = outcome_from_proto(value)
        assert name == "SWITCH_OUTCOME_" + o.name
        assert outcome_to_proto(o) == value and outcome_to_proto(o.value) == value
    assert len(OUTCOME_TO_PROTO) == len(Outcome) == len(types_pb2.SwitchOutcome.values()) - 1
    assert outcome_from_proto(999) is Outcome.UNKNOWN


def test_finishing_a_switch_never_records_running():
    assert finished_outcome_from_proto(types_pb2.SWITCH_OUTCOME_RUNNING) is Outcome.UNKNOWN
    assert finished_outcome_from_proto(types_pb2.SWITCH_OUTCOME_ABORTED) is Outcome.ABORTED


def test_views_show_the_outcome_values():
    from dashboard import views

    for value, o in OUTCOME_FROM_PROTO.items():
        assert views.outcome_name(value) == o.value
