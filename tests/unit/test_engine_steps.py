"""The switch steps' boundary to the engine: a failure crosses worker → engine core → front end as
data carrying its phase (no text parsing), and every engine-core utility is in the one table."""

import pytest

from node_agent.engine_plugin import Utility, core_side
from node_agent.engine_plugin.steps import (EngineStepFailed, StepError, earliest, failure,
                                            success, unwrap)
from remp.transaction import Phase


def test_every_utility_in_the_table_is_implemented():
    assert set(core_side.UTILITIES) == set(Utility)


def test_a_worker_failure_keeps_its_phase_to_the_front_end():
    def data_path(self):
        raise core_side.WorkerStepFailed(earliest(["RELOAD_SHARDS", "MIGRATE_KV", None]),
                                         "rank 1: InjectedFault: injected fault in MIGRATE_KV")

    reply = core_side._step(data_path)(None)
    assert reply == {"failed": {"phase": "MIGRATE_KV",
                                "message": "rank 1: InjectedFault: injected fault in MIGRATE_KV"}}
    with pytest.raises(EngineStepFailed) as info:
        unwrap(reply, Phase.RELOAD_SHARDS)
    assert info.value.phase is Phase.MIGRATE_KV and "injected fault" in str(info.value)


def test_a_failure_without_a_phase_takes_the_steps_own():
    def begin(self):
        raise RuntimeError("PP batch queue not drained")

    reply = core_side._step(begin)(None)
    assert reply["failed"]["phase"] is None
    with pytest.raises(EngineStepFailed) as info:
        unwrap(reply, Phase.PREPARING_WORKERS)
    assert info.value.phase is Phase.PREPARING_WORKERS
    assert str(info.value) == "RuntimeError: PP batch queue not drained"


def test_success_and_phase_helpers():
    assert unwrap(success({"held": 2}), Phase.REBINDING) == {"held": 2}
    assert earliest([None]) is None
    assert failure(StepError(Phase.RELOAD_SHARDS, "x"))["failed"] == {"phase": "RELOAD_SHARDS",
                                                                       "message": "x"}
