"""node_agent.faults: the test-only controls the FaultInjection service arms (one-shot, by id or
for the next call, bounded)."""

import pytest

from node_agent.faults import (NO_MIGRATION_FAULT, NO_SWITCH_FAULT, ArmedFaults, MigrationFault,
                               SwitchFault)
from remp.errors import InvalidArgument, ResourceExhausted
from remp.controller.v1 import controller_pb2
from remp.node_agent.v1 import node_agent_pb2
from remp.transaction import Phase


def test_a_control_is_taken_once_by_its_id_before_the_next_one():
    f = ArmedFaults()
    f.arm_switch("", SwitchFault(start_when_running=2))
    f.arm_switch("s1", SwitchFault(fail_at=Phase.MIGRATE_KV))
    assert f.take_switch("s1").fail_at == Phase.MIGRATE_KV
    assert f.take_switch("s1").start_when_running == 2  # then the 'next switch' one
    assert f.take_switch("s1") == NO_SWITCH_FAULT and f.take_switch("") == NO_SWITCH_FAULT
    assert len(f) == 0


def test_arming_an_id_again_replaces_it_and_disarm_drops_all():
    f = ArmedFaults()
    assert f.arm_migration("r1", MigrationFault(wait_output_tokens=5)) == 1
    assert f.arm_migration("r1", MigrationFault(poison_kv=True)) == 1
    assert f.arm_switch("", SwitchFault(skip_kv=True)) == 2
    assert f.take_migration("other") == NO_MIGRATION_FAULT  # no 'next' migration armed
    assert f.disarm() == 2 and len(f) == 0
    assert f.take_migration("r1") == NO_MIGRATION_FAULT


def test_bad_controls_are_refused_and_the_store_is_bounded():
    f = ArmedFaults(max_armed=3)
    with pytest.raises(InvalidArgument, match="cannot inject a fault in SERVING_NEW"):
        f.arm_switch("", SwitchFault(fail_at=Phase.SERVING_NEW))
    with pytest.raises(InvalidArgument, match="start_when_running"):
        f.arm_switch("", SwitchFault(start_when_running=10**6))
    with pytest.raises(InvalidArgument, match="wait_output_tokens"):
        f.arm_migration("", MigrationFault(wait_output_tokens=10**9))
    for i in range(3):
        f.arm_switch(f"s{i}", SwitchFault(skip_kv=True))
    with pytest.raises(ResourceExhausted):
        f.arm_migration("r", MigrationFault(poison_kv=True))
    f.arm_switch("s0", SwitchFault())  # replacing an armed id needs no room
    assert len(f) == 3


def test_the_production_messages_carry_no_test_fields():
    for msg in (node_agent_pb2.ExecuteSwitchRequest, node_agent_pb2.MigrateRequestRequest,
                controller_pb2.ReconfigureRequest, controller_pb2.DrainNodeRequest):
        names = {f.name for f in msg.DESCRIPTOR.fields}
        assert not any(n.startswith("test_") or n == "fail_at_phase" for n in names), names
