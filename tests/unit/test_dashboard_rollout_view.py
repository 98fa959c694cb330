"""The dashboard's rollout view without a server: the JSON of a RolloutState made by the pure
core (progress counts, waves done, the set's capacity now against the floor) and the rollout id
check, which must accept exactly what the controller accepts (controller/validation.py ID)."""

from __future__ import annotations

import pytest

from controller import convert, validation
from controller.rollout import (RolloutNode, capacity_table, new_rollout, plan_rollout,
                                start, switch_finished, switch_started)
from dashboard import security, views
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.topology import Topology
from remp.transaction import Outcome

TP2, PP2 = Topology(2, 1), Topology(1, 2)
CAP = {"TP2PP1": 9.0, "TP1PP2": 10.0}


def state(n: int = 3):
    nodes = [RolloutNode(f"n{i}", TP2, (TP2, PP2)) for i in range(1, n + 1)]
    return start(new_rollout("ro-1", plan_rollout(nodes, PP2, 0.5, 3, capacity_table(CAP)))).state


def proto(s) -> controller_pb2.RolloutState:
    m = convert.rollout_to_proto(s)
    m.capacity_rps.update(CAP)
    return m


def node(name: str, topo: Topology, health=controller_pb2.NODE_HEALTH_READY):
    return controller_pb2.NodeState(node=name, health=health,
                                    observed=types_pb2.Topology(tp=topo.tp, pp=topo.pp))


def test_progress_counts_and_waves_done():
    s = switch_started(state(), "n1", "sw-1")
    v = views.rollout_view(proto(s))
    assert (v["rollout_id"], v["status"], v["target"], v["terminal"]) == \
        ("ro-1", "running", "TP1PP2", False)
    assert (v["floor"], v["max_parallel"], v["required_capacity"], v["base_capacity"]) == \
        (0.5, 3, 13.5, 27.0)
    assert v["nodes_in_set"] == ["n1", "n2", "n3"] and len(v["waves"]) == 3
    assert v["progress"] == {"waves_done": 0, "waves": 3, "switched": 0, "failed": 0,
                             "switching": 1, "pending": 2}
    assert v["nodes"][0] == {"node": "n1", "wave": 0, "status": "switching",
                             "switch_id": "sw-1", "outcome": "", "error": ""}
    assert "capacity_now" not in v  # only when the nodes are given
    row = views.rollout_row(proto(s))
    assert row["progress"] == v["progress"] and row["nodes_in_set"] == v["nodes_in_set"]
    assert not {"waves", "nodes", "excluded"} & set(row)

    s = switch_finished(s, "n1", Outcome.SUCCEEDED, "").state  # wave 1 (n2) entered
    s = switch_started(s, "n2", "sw-2")
    s = switch_finished(s, "n2", Outcome.ROLLED_BACK, "injected at MIGRATE_KV").state
    v = views.rollout_view(proto(s))
    assert (v["status"], v["failed_node"], v["terminal"]) == ("failed", "n2", True)
    assert v["progress"] == {"waves_done": 2, "waves": 3, "switched": 1, "failed": 1,
                             "switching": 0, "pending": 1}
    assert v["nodes"][1]["outcome"] == "rolled_back" and "injected" in v["nodes"][1]["error"]


def test_capacity_now_counts_ready_members_by_the_rollouts_table():
    s = switch_started(state(), "n1", "sw-1")
    nodes = [node("n1", TP2, controller_pb2.NODE_HEALTH_SWITCHING), node("n2", TP2),
             node("n3", PP2), node("other", TP2)]  # not in the set: not counted
    assert views.rollout_view(proto(s), nodes)["capacity_now"] == 19.0
    nodes[2] = node("n3", PP2, controller_pb2.NODE_HEALTH_LOST)
    assert views.capacity_now(proto(s), nodes) == 9.0
    assert views.capacity_now(proto(s), [node("n2", Topology(1, 1))]) is None  # not in the table


def test_an_event_carries_its_rollout_id():
    ev = controller_pb2.Event(id="1-0", type=controller_pb2.EVENT_TYPE_ROLLOUT_WAVE,
                              rollout_id="ro-1", detail="wave 1: n2")
    v = views.event_view(ev)
    assert (v["type"], v["rollout_id"]) == ("rollout_wave", "ro-1")


SAMPLES = ["ro-0123456789ab", "a", "A.b_c:d-e", "0", "a" * 128, "a" * 129, "", "-a", ".a",
           ":a", "a b", "a/b", "a\n", "a\x00", "é", "ro-1;", "a%2F", " a", "a" * 10_000]


@pytest.mark.parametrize("value", SAMPLES, ids=range(len(SAMPLES)))
def test_rollout_ids_are_checked_by_the_controllers_rule(value):
    controller_ok = value != "" and validation.ID.ok(value)
    try:
        assert security.rollout_id(value) == value
        dashboard_ok = True
    except security.BadInput as exc:
        dashboard_ok = False
        assert len(str(exc)) < 300  # the message never echoes a long value
    assert dashboard_ok == controller_ok
    assert validation.rule_for("remp.controller.v1.GetRolloutRequest", "rollout_id") is \
        validation.ID


def test_other_inputs_of_the_rollout_routes():
    for bad in (None, 42, ["a"], {"a": 1}):
        with pytest.raises(security.BadInput):
            security.rollout_id(bad)
    assert [security.rollout_action(a) for a in ("pause", "resume", "abort")] == \
        ["pause", "resume", "abort"]
    for bad in ("PAUSE", "restart", "", None, 1, ["pause"]):
        with pytest.raises(security.BadInput):
            security.rollout_action(bad)
