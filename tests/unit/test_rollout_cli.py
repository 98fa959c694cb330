"""ops/rollout_cli.py without a controller: the capacity table (profile, overrides, errors)
and the text/JSON views of a RolloutState."""

from __future__ import annotations

import pytest

from controller import convert
from controller.rollout import (RolloutNode, capacity_table as table_of, new_rollout,
                                plan_rollout, start, switch_finished, switch_started)
from ops.rollout_cli import capacity_table, rollout_text, rollout_view
from remp.topology import Topology
from remp.transaction import Outcome

TP2, PP2 = Topology(2, 1), Topology(1, 2)


def test_capacity_table_from_a_shipped_profile_with_overrides():
    assert capacity_table("tiny-cpu-2core", "") == {"TP2PP1": 9.0, "TP1PP2": 10.0}
    assert capacity_table("tiny-cpu-2core", "TP1PP2=12, TP1PP1=4") == {
        "TP2PP1": 9.0, "TP1PP2": 12.0, "TP1PP1": 4.0}
    assert capacity_table(None, "tp2pp1=3")["TP2PP1"] == 3.0
    for profile, text in ((None, ""), (None, "TP2PP1"), (None, "XX=1"),
                          ("no-such-profile", "")):
        with pytest.raises(ValueError):
            capacity_table(profile, text)


def test_views_of_a_failed_rollout():
    cap = {"TP2PP1": 9.0, "TP1PP2": 10.0}
    nodes = [RolloutNode(n, TP2, (TP2, PP2)) for n in ("a", "b", "c")]
    plan = plan_rollout(nodes, PP2, 0.5, 3, table_of(cap))
    s = start(new_rollout("ro-1", plan)).state
    s = switch_started(s, "a", "sw-1")
    s = switch_finished(s, "a", Outcome.ROLLED_BACK, "injected").state
    v = rollout_view(convert.rollout_to_proto(s))
    assert (v["status"], v["failed_node"], v["target"]) == ("failed", "a", "TP1PP2")
    assert [w["nodes"] for w in v["waves"]] == [["a"], ["b"], ["c"]]
    assert [n["status"] for n in v["nodes"]] == ["rolled_back", "pending", "pending"]
    text = rollout_text(v)
    assert "failed on a" in text and "sw-1" in text and "injected" in text
