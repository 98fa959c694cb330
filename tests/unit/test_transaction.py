import pytest

from remp.common.v1 import types_pb2
from remp.transaction import (
    FORWARD, TRANSITIONS, IllegalTransition, Phase, SwitchMachine, abortable_phases,
    terminal_phases,
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
