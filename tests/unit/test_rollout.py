"""controller/rollout.py: the wave planner and the rollout's life, as pure functions."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import policy
from controller.model import NodeHealth
from controller.rollout import (IllegalRolloutTransition, NodeStatus, RolloutInfeasible,
                                RolloutNode, RolloutStatus, abort, capacity_table, new_rollout,
                                pause, plan_rollout, request_id, resume, resume_after_restart,
                                select_nodes, start, switch_finished, switch_started,
                                wave_keeps_floor)
from policy.profiles import load_profile
from remp.errors import InvalidArgument, NotFound
from remp.topology import Topology
from remp.transaction import Outcome

TP2, PP2, TP1, TP2PP2 = (Topology(2, 1), Topology(1, 2), Topology(1, 1), Topology(2, 2))
TOPOS = (TP1, TP2, PP2, TP2PP2)


def node(name, topo=TP2, health=NodeHealth.READY, labels=(), candidates=TOPOS):
    return RolloutNode(name, topo, tuple(candidates), tuple(labels), health)


# ---------------------------------------------------------------------- an oracle
def wave_capacities(nodes, plan, cap):
    """The set's capacity while each wave switches, simulated from scratch."""
    ready = {n.name: n for n in nodes if n.health == NodeHealth.READY}
    now = {name: cap(n, n.topology) for name, n in ready.items()}
    out = []
    for w in plan.waves:
        out.append(sum(c for name, c in now.items() if name not in w.nodes))
        for name in w.nodes:
            now[name] = cap(ready[name], plan.target)
    return out, sum(now.values())


def one_at_a_time_feasible(nodes, target, floor, cap):
    ready = [n for n in nodes if n.health == NodeHealth.READY]
    base = sum(cap(n, n.topology) for n in ready)
    todo = [n for n in ready if n.topology != target]
    for perm in itertools.permutations(todo):
        c, ok = base, True
        for n in perm:
            if c - cap(n, n.topology) < floor * base - 1e-9 * max(1.0, floor * base):
                ok = False
                break
            c += cap(n, target) - cap(n, n.topology)
        if ok:
            return True
    return False


nodes_st = st.lists(
    st.tuples(st.sampled_from(TOPOS),
              st.sampled_from([NodeHealth.READY] * 4 + [NodeHealth.LOST, NodeHealth.DRAINING,
                                                        NodeHealth.SWITCHING])),
    max_size=6).map(lambda xs: [node(f"n{i}", t, h) for i, (t, h) in enumerate(xs)])
caps_st = st.fixed_dictionaries({t: st.integers(0, 10) for t in TOPOS})
weights_st = st.lists(st.integers(1, 3), min_size=6, max_size=6)


def per_node(caps, weights):
    """Mixed hosts: a node's capacity is the table's times its own weight."""
    return lambda n, t: caps[t] * weights[int(n.name[1:])]


# ---------------------------------------------------------------------- planner properties
@settings(max_examples=400, deadline=None)
@given(nodes_st, caps_st, weights_st, st.sampled_from(TOPOS),
       st.sampled_from([0, .25, .5, .6, .75, .9, 1]), st.integers(1, 4))
def test_waves_keep_the_floor_and_cover_every_node_once(nodes, caps, weights, target, floor,
                                                        par):
    cap = per_node(caps, weights)
    try:
        plan = plan_rollout(nodes, target, floor, par, cap)
    except RolloutInfeasible as e:
        # reported only when no order of one node at a time keeps the floor
        assert not one_at_a_time_feasible(nodes, target, floor, cap)
        assert e.node in {n.name for n in nodes} and e.capacity < e.required
        return
    assert one_at_a_time_feasible(nodes, target, floor, cap)
    during, final = wave_capacities(nodes, plan, cap)
    for w, c in zip(plan.waves, during):
        assert 1 <= len(w.nodes) <= par
        assert c >= plan.required_capacity - 1e-9 * max(1.0, plan.required_capacity)
        assert c == pytest.approx(w.capacity_during)
    assert final == pytest.approx(plan.waves[-1].capacity_after if plan.waves
                                  else plan.base_capacity)
    ready = [n for n in nodes if n.health == NodeHealth.READY]
    need = sorted(n.name for n in ready if n.topology != target)
    assert sorted(plan.order) == need and len(set(plan.order)) == len(plan.order)
    assert list(plan.skipped) == sorted(n.name for n in ready if n.topology == target)
    assert [x for x, _ in plan.excluded] == sorted(n.name for n in nodes
                                                   if n.health != NodeHealth.READY)
    assert plan.base_capacity == sum(cap(n, n.topology) for n in ready)
    # a wave is closed only when full or when its next node would break the floor
    for w, nxt in zip(plan.waves, plan.waves[1:]):
        first = next(n for n in nodes if n.name == nxt.nodes[0])
        assert len(w.nodes) == par or (w.capacity_during - cap(first, first.topology)
                                       < plan.required_capacity)


@settings(max_examples=100, deadline=None)
@given(nodes_st, caps_st, weights_st, st.sampled_from(TOPOS), st.integers(1, 4))
def test_plan_is_deterministic_and_independent_of_input_order(nodes, caps, weights, target,
                                                              par):
    cap = per_node(caps, weights)
    a = plan_rollout(nodes, target, 0.0, par, cap)
    b = plan_rollout(list(reversed(nodes)), target, 0.0, par, cap)
    assert a == b
    # floor 0: only max_parallel limits a wave
    assert [len(w.nodes) for w in a.waves] == [
        min(par, len(a.order) - i) for i in range(0, len(a.order), par)]


# ---------------------------------------------------------------------- planner examples
def test_three_agents_floor_one_at_a_time_gives_three_waves_of_one():
    # the measured CPU profile the must-show runs with: TP2PP1 9.0, TP1PP2 10.0 req/s
    prof = load_profile(str(Path(policy.__file__).parent / "profiles" / "tiny-cpu-2core.json"))
    nodes = [node("agent-c"), node("agent-a"), node("agent-b")]
    plan = plan_rollout(nodes, PP2, 0.5, 3, lambda n, t: prof.capacity(t))
    assert [w.nodes for w in plan.waves] == [("agent-a",), ("agent-b",), ("agent-c",)]
    assert (plan.base_capacity, plan.required_capacity) == (27.0, 13.5)
    assert [w.capacity_during for w in plan.waves] == [18.0, 19.0, 20.0]
    # the same floor with a lower-capacity target still allows one at a time
    plan = plan_rollout(nodes, PP2, 0.5, 3, capacity_table({"TP2PP1": 9.9, "TP1PP2": 8.2}))
    assert [round(w.capacity_during, 1) for w in plan.waves] == [19.8, 18.1, 16.4]


def test_a_looser_floor_packs_waves_up_to_max_parallel():
    nodes = [node(f"n{i}") for i in range(5)]
    plan = plan_rollout(nodes, PP2, 0.5, 2, capacity_table({TP2: 1, PP2: 1}))
    assert [w.nodes for w in plan.waves] == [("n0", "n1"), ("n2", "n3"), ("n4",)]


def test_infeasible_floor_names_the_node():
    nodes = [node("a"), node("b"), node("c")]
    with pytest.raises(RolloutInfeasible, match=r"even one node at a time: switching a ") as e:
        plan_rollout(nodes, PP2, 0.9, 1, capacity_table({TP2: 1, PP2: 1}))
    assert (e.value.node, e.value.capacity, e.value.required) == ("a", 2, pytest.approx(2.7))


def test_a_target_with_less_capacity_becomes_infeasible_later_and_says_after_how_many():
    nodes = [node("a"), node("b"), node("c")]
    with pytest.raises(RolloutInfeasible, match=r"switching c .* after 2 node\(s\) switched"):
        plan_rollout(nodes, PP2, 0.5, 1, capacity_table({TP2: 10, PP2: 6}))


def test_order_gainers_smallest_first_then_losers_largest_target_first():
    nodes = [node("big", TP2PP2), node("small", TP1), node("mid", TP2), node("pp", PP2)]
    caps = capacity_table({TP1: 1, TP2: 3, PP2: 4, TP2PP2: 8})
    assert plan_rollout(nodes, PP2, 0, 1, caps).order == ("small", "mid", "big")
    assert plan_rollout(nodes, TP2, 0, 1, caps).order == ("small", "big", "pp")  # name tie
    # mixed hosts (capacity per node): losers with the larger target capacity go first
    host = {"h1": 2, "h2": 1, "h3": 3}
    mixed = [node(n, TP2) for n in host]
    per_node = lambda n, t: (4 if t == TP2 else 2) * host[n.name]  # noqa: E731
    assert plan_rollout(mixed, PP2, 0, 1, per_node).order == ("h3", "h1", "h2")


def test_skips_nodes_on_target_and_excludes_nodes_not_serving():
    nodes = [node("on", PP2), node("lost", health=NodeHealth.LOST), node("x"),
             node("drain", health=NodeHealth.DRAINING)]
    plan = plan_rollout(nodes, PP2, 0.4, 1, capacity_table({TP2: 1, PP2: 1}))
    assert plan.order == ("x",) and plan.skipped == ("on",)
    assert plan.excluded == (("drain", "not serving (draining)"), ("lost", "not serving (lost)"))
    assert plan.base_capacity == 2


def test_input_errors():
    cap = capacity_table({TP2: 1, PP2: 1})
    with pytest.raises(InvalidArgument, match="not a candidate of node x .*TP2PP1"):
        plan_rollout([node("x", candidates=(TP2,))], PP2, 0, 1, cap)
    with pytest.raises(InvalidArgument, match="no capacity known for TP2PP2"):
        plan_rollout([node("x")], TP2PP2, 0, 1, cap)
    with pytest.raises(InvalidArgument, match="floor"):
        plan_rollout([node("x")], PP2, 1.5, 1, cap)
    with pytest.raises(InvalidArgument, match="max_parallel"):
        plan_rollout([node("x")], PP2, 0.5, 0, cap)
    with pytest.raises(InvalidArgument, match="twice"):
        plan_rollout([node("x"), node("x")], PP2, 0.5, 1, cap)


def test_select_by_names_or_labels():
    fleet = [node("a", labels=(("model", "70b"), ("zone", "1"))),
             node("b", labels=(("model", "70b"),)), node("c", labels=(("model", "7b"),))]
    assert [n.name for n in select_nodes(fleet, labels={"model": "70b"})] == ["a", "b"]
    assert [n.name for n in select_nodes(fleet, ["c", "a"])] == ["a", "c"]
    with pytest.raises(NotFound, match="zz"):
        select_nodes(fleet, ["a", "zz"])
    with pytest.raises(NotFound, match="model=13b"):
        select_nodes(fleet, labels={"model": "13b"})
    with pytest.raises(InvalidArgument, match="one of them"):
        select_nodes(fleet, ["a"], {"model": "7b"})


# ---------------------------------------------------------------------- the life: examples
def three_one_at_a_time():
    plan = plan_rollout([node("n1"), node("n2"), node("n3")], PP2, 0.6, 3,
                        capacity_table({TP2: 1, PP2: 1}))
    return new_rollout("r1", plan)


def test_failure_on_the_second_node_stops_with_first_switched_second_rolled_back_third_untouched():
    step = start(three_one_at_a_time())
    assert step.start == ("n1",) and step.state.status is RolloutStatus.RUNNING
    s = switch_started(step.state, "n1", "sw-1")
    step = switch_finished(s, "n1", Outcome.SUCCEEDED)
    assert step.start == ("n2",) and step.state.wave == 1
    s = switch_started(step.state, "n2", "sw-2")
    step = switch_finished(s, "n2", Outcome.ROLLED_BACK, "injected failure in MIGRATE_KV")
    s = step.state
    assert step.start == () and s.status is RolloutStatus.FAILED and s.failed_node == "n2"
    assert [(p.node, p.status, p.switch_id) for p in s.nodes] == [
        ("n1", NodeStatus.SUCCEEDED, "sw-1"), ("n2", NodeStatus.ROLLED_BACK, "sw-2"),
        ("n3", NodeStatus.PENDING, "")]
    assert "n2" in s.reason and "MIGRATE_KV" in s.reason
    for op in (start, resume, pause, abort):
        with pytest.raises(IllegalRolloutTransition, match="failed node: n2"):
            op(s)


def test_a_failed_node_lets_its_wave_finish_and_starts_nothing_more():
    plan = plan_rollout([node(f"n{i}") for i in range(5)], PP2, 0, 3,
                        capacity_table({TP2: 1, PP2: 1}))
    step = start(new_rollout("r", plan))
    assert step.start == ("n0", "n1", "n2")
    step = switch_finished(step.state, "n1", Outcome.FAILED)
    assert step.state.status is RolloutStatus.RUNNING and step.start == ()
    step = switch_finished(step.state, "n0", Outcome.SUCCEEDED)
    step = switch_finished(step.state, "n2", Outcome.ROLLED_BACK)  # a second failure
    assert step.state.status is RolloutStatus.FAILED and step.state.failed_node == "n1"
    assert step.start == ()
    assert [p.status for p in step.state.in_wave(1)] == [NodeStatus.PENDING] * 2


def test_pause_waits_for_the_wave_then_resume_starts_the_next():
    step = start(three_one_at_a_time())
    s = pause(step.state, "peak").state
    assert s.status is RolloutStatus.RUNNING and s.pause_requested
    step = switch_finished(s, "n1", Outcome.SUCCEEDED)
    assert step.start == () and step.state.status is RolloutStatus.PAUSED
    assert pause(step.state).state == step.state  # idempotent
    step = resume(step.state)
    assert step.start == ("n2",) and step.state.wave == 1


def test_resume_cancels_a_pending_pause_and_pause_of_planned_then_resume_starts_wave_zero():
    step = start(three_one_at_a_time())
    s = resume(pause(step.state).state).state
    assert not s.pause_requested
    assert switch_finished(s, "n1", Outcome.SUCCEEDED).start == ("n2",)
    p = pause(three_one_at_a_time()).state
    assert p.status is RolloutStatus.PAUSED and resume(p).start == ("n1",)


def test_abort_stops_after_the_wave_and_an_aborted_switch_is_not_a_failure():
    step = start(three_one_at_a_time())
    s = abort(step.state, "operator").state
    assert s.status is RolloutStatus.RUNNING and s.abort_requested
    step = switch_finished(s, "n1", Outcome.ABORTED)
    assert step.state.status is RolloutStatus.ABORTED and step.state.failed_node == ""
    assert step.start == () and abort(step.state).state == step.state
    assert abort(three_one_at_a_time()).state.status is RolloutStatus.ABORTED


def test_last_wave_done_and_a_pause_asked_in_the_last_wave_still_ends_done():
    step = start(three_one_at_a_time())
    for n in ("n1", "n2", "n3"):
        assert step.start == (n,)
        st_ = pause(step.state).state if n == "n3" else step.state
        step = switch_finished(st_, n, Outcome.SUCCEEDED)
    assert step.state.status is RolloutStatus.DONE and step.state.terminal


def test_restart_re_drives_the_switching_nodes_with_the_same_request_ids():
    step = start(three_one_at_a_time())
    s = switch_started(step.state, "n1", "sw-1")
    again = resume_after_restart(s)
    assert again.state == s and again.start == ("n1",)
    assert request_id("r1", "n1") == request_id("r1", "n1") != request_id("r1", "n2")
    assert switch_started(s, "n1", "sw-1") == s  # told twice: unchanged
    done = switch_finished(s, "n1", Outcome.SUCCEEDED).state
    assert switch_finished(done, "n1", Outcome.SUCCEEDED).state == done
    assert resume_after_restart(pause(three_one_at_a_time()).state).start == ()


def test_a_node_that_could_not_be_started_fails_the_rollout():
    step = start(three_one_at_a_time())
    step = switch_finished(step.state, "n1", None, "node n1 is lost (its lease expired)")
    assert step.state.status is RolloutStatus.FAILED
    assert step.state.reason == "node n1: not started: node n1 is lost (its lease expired)"


def test_nothing_to_do_is_done_at_once():
    plan = plan_rollout([node("a", PP2)], PP2, 1, 1, capacity_table({PP2: 1}))
    assert start(new_rollout("r", plan)).state.status is RolloutStatus.DONE


# ---------------------------------------------------------------------- the life: properties
OUTCOMES = [Outcome.SUCCEEDED] * 6 + [Outcome.NOOP, Outcome.ROLLED_BACK, Outcome.ABORTED,
                                      Outcome.FAILED, Outcome.UNKNOWN, None]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 7), st.integers(1, 3),
       st.lists(st.tuples(st.sampled_from(["finish", "pause", "resume", "abort"]),
                          st.integers(0, 6), st.sampled_from(OUTCOMES)), max_size=40))
def test_random_lives_keep_the_invariants(n, par, actions):
    plan = plan_rollout([node(f"n{i}") for i in range(n)], PP2, 0, par,
                        capacity_table({TP2: 1, PP2: 1}))
    step = start(new_rollout("r", plan))
    started = list(step.start)
    for what, i, outcome in actions:
        s = step.state
        try:
            if what == "finish":
                if not s.switching:
                    continue
                step = switch_finished(s, s.switching[i % len(s.switching)], outcome)
            else:
                step = {"pause": pause, "resume": resume, "abort": abort}[what](s)
        except IllegalRolloutTransition:
            assert s.terminal
            continue
        t = step.state
        assert t.version >= s.version and (t == s) == (t.version == s.version)
        started += step.start
        assert all(t.node(x).status is NodeStatus.SWITCHING for x in step.start)
        # only the current wave's nodes ever switch; later waves are untouched
        assert {t.node(x).wave for x in t.switching} <= {t.wave}
        assert all(p.status is NodeStatus.PENDING for p in t.nodes if p.wave > t.wave)
        if t.terminal or t.status is RolloutStatus.PAUSED:
            assert not t.switching
        if t.status is RolloutStatus.FAILED:
            assert t.node(t.failed_node).status is not NodeStatus.SUCCEEDED
        if t.status is RolloutStatus.DONE:
            assert all(p.status is NodeStatus.SUCCEEDED for p in t.nodes)
        if s.terminal:
            assert step.start == () and t.status is s.status
    assert len(started) == len(set(started))  # no node is started twice


def test_wave_keeps_floor_rechecks_with_the_health_of_now():
    s = start(three_one_at_a_time()).state
    s = switch_finished(s, "n1", Outcome.SUCCEEDED).state
    cap = capacity_table({TP2: 1, PP2: 1})
    now = [node("n1", PP2), node("n2"), node("n3")]
    assert wave_keeps_floor(s, 1, now, cap) == ""
    now[2] = node("n3", health=NodeHealth.LOST)
    assert wave_keeps_floor(s, 1, now, cap) == (
        "wave 1 would leave 1 of the required 1.8 (not serving: n3)")
