"""Fleet rollouts (issue 17, docs/rollout.md §8) on three real node agents (vLLM CPU, TP2PP1,
the tiny model) registered with a real controller (Redis), labelled ``fleet=rollout-e2e``.

Capacities from the measured profile ``tiny-cpu-2core`` (TP2PP1 9.0, TP1PP2 10.0 req/s): floor
0.5 of 27 = 13.5 allows one node at a time. Throughout, a thread sends short completions round
robin to the three agents and a sampler reads ListNodes every 50 ms, summing the profile
capacity of the nodes READY and not switching: its minimum must not fall below the floor, and
every request sent must complete.

* TP2PP1 → TP1PP2 by label: three waves of one in name order, each node's switch record
  succeeded with the rollout's request id, the waves one after another.
* TP1PP2 → TP2PP1 with a fault armed on the second node (MIGRATE_KV): FAILED on it, the first
  switched, the second rolled back, the third untouched (no switch at all).
* Pause / resume / abort over the two nodes still on TP1PP2, and a manual Reconfigure of a node
  the paused rollout holds refused.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from devstack.agentproc import (AgentProcess, ControllerProcess, arm_switch, complete, disarm,
                                prompt)
from ops.rollout_cli import capacity_table
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.redisproc import RedisServer

pytestmark = pytest.mark.e2e

NODES = ("ro-a", "ro-b", "ro-c")
LABEL = ("fleet", "rollout-e2e")
CAP = capacity_table("tiny-cpu-2core", "")  # {"TP2PP1": 9.0, "TP1PP2": 10.0}
FLOOR = 0.5
T = types_pb2.Topology
TERMINAL = {controller_pb2.ROLLOUT_STATUS_DONE, controller_pb2.ROLLOUT_STATUS_FAILED,
            controller_pb2.ROLLOUT_STATUS_ABORTED}
S = controller_pb2


@pytest.fixture(scope="module")
def stack(tiny_model, artifacts_dir, reaper):
    """Redis, a controller and three TP2PP1 agents started at once (each start is mostly one
    core importing torch and vLLM). Switches only within world 2 (TP2PP1 <-> TP1PP2), no
    warm-up visits: the agents are ready sooner."""
    with RedisServer() as r:
        ctl = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-rollout")
        ctl.start()
        agents = [AgentProcess(tiny_model, tp=2, pp=1, log_dir=artifacts_dir, node=n,
                               env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"},
                               extra=["--controller", ctl.addr, "--label", "=".join(LABEL),
                                      "--no-world-changes", "--no-warm-up-candidates",
                                      "--candidates", "TP2PP1,TP1PP2", "--max-model-len", "512"])
                  for n in NODES]
        try:
            for a in agents:
                a.start()
            ctl.wait_ready()
            for a in agents:
                a.wait_ready(timeout=300)
            for n in NODES:
                ctl.wait_node_ready(n, timeout=120)
            yield ctl, dict(zip(NODES, agents))
        finally:
            reaper.stop(*agents, check=False)
            ctl.stop()


def call(ctl, method, req, timeout=30):
    with grpc.insecure_channel(ctl.addr) as ch:
        return getattr(ctl.stub(ch), method)(req, timeout=timeout)


def rollout(ctl, target: tuple[int, int], **kw) -> S.RolloutState:
    req = S.RolloutRequest(target=T(tp=target[0], pp=target[1]), capacity_floor=FLOOR,
                           max_parallel=3, capacity_rps=CAP, reason="e2e", **kw)
    if not kw.get("nodes"):
        req.labels[LABEL[0]] = LABEL[1]
    return call(ctl, "Rollout", req).rollout


def wait_rollout(ctl, rid, until=TERMINAL, timeout=120) -> S.RolloutState:
    deadline = time.monotonic() + timeout
    while True:
        r = call(ctl, "GetRollout", S.GetRolloutRequest(rollout_id=rid))
        if r.status in until:
            return r
        assert time.monotonic() < deadline, r
        time.sleep(0.1)


def control(ctl, rid, action) -> S.RolloutState:
    return call(ctl, "ControlRollout", S.ControlRolloutRequest(rollout_id=rid, action=action,
                                                               reason="e2e"))


def switches(ctl, node) -> list[types_pb2.SwitchRecord]:
    return list(call(ctl, "ListSwitches", S.ListSwitchesRequest(node=node)).switches)


class Load:
    """Completions round robin to the agents (sent / completed counted) and a ListNodes
    sampler (the minimum serving capacity seen), both until stopped."""

    def __init__(self, ctl, agents):
        self.ctl, self.agents = ctl, list(agents.values())
        self.sent = self.completed = 0
        self.errors: list[str] = []
        self.samples: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._traffic, daemon=True),
                        threading.Thread(target=self._sample, daemon=True)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 60
        while self.completed < 3 and not self.errors and time.monotonic() < deadline:
            time.sleep(0.05)  # traffic flowing before the rollout starts
        return self

    def __exit__(self, *exc):
        time.sleep(0.3)  # … and after it ended
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _traffic(self) -> None:
        i = 0
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                a = self.agents[i % len(self.agents)]
                self.sent += 1
                try:
                    r = c.post(f"{a.http}/v1/completions", json={
                        "model": "tiny", "prompt": prompt(i % 40, 20), "max_tokens": 4,
                        "temperature": 0.0, "ignore_eos": True})
                    if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4:
                        self.completed += 1
                    else:
                        self.errors.append(f"{a.node}: {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.errors.append(f"{a.node}: {exc!r}")
                i += 1
                # a steady trickle: back to back, they took the cores a restarting
                # controller needs (its start went from 3 s to 24 s)
                self.stop.wait(0.05)

    def _sample(self) -> None:
        while not self.stop.is_set():
            try:
                with grpc.insecure_channel(self.ctl.addr) as ch:
                    self._sample_on(self.ctl.stub(ch))
            except grpc.RpcError:  # the controller restarting (the kill test)
                time.sleep(0.1)

    def _sample_on(self, stub) -> None:
        while not self.stop.is_set():
            nodes = stub.ListNodes(S.ListNodesRequest(), timeout=10).nodes
            self.samples.append(sum(
                CAP[f"TP{n.observed.tp}PP{n.observed.pp}"] for n in nodes
                if n.node in NODES and n.health == S.NODE_HEALTH_READY
                and not n.current_switch.switch_id))
            time.sleep(0.05)


def cli(ctl, *args) -> dict:
    """``remp rollout ... --json`` against the stack's controller (credentials: the env's)."""
    r = subprocess.run([sys.executable, "-m", "ops.cli", "rollout", *args, "--controller",
                        ctl.addr, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_rollout_one_at_a_time_keeps_the_floor_and_serves(stack):
    ctl, agents = stack
    # the CLI's dry run: the waves from the profile's capacities, nothing started
    plan = cli(ctl, "plan", "TP1PP2", "--label", "=".join(LABEL), "--floor", str(FLOOR),
               "--max-parallel", "3", "--profile", "tiny-cpu-2core")
    assert plan["rollout_id"] == "" and [w["nodes"] for w in plan["waves"]] == [
        ["ro-a"], ["ro-b"], ["ro-c"]]
    assert plan["capacity_rps"] == CAP and plan["required_capacity"] == 13.5
    assert not call(ctl, "ListRollouts", S.ListRolloutsRequest()).rollouts
    with Load(ctl, agents) as load:
        r = rollout(ctl, (1, 2))
        assert [list(w.nodes) for w in r.plan.waves] == [["ro-a"], ["ro-b"], ["ro-c"]]
        assert (r.plan.base_capacity, r.plan.required_capacity) == (27.0, 13.5)
        assert [w.capacity_during for w in r.plan.waves] == [18.0, 19.0, 20.0]
        r = wait_rollout(ctl, r.rollout_id)
    assert r.status == S.ROLLOUT_STATUS_DONE, r
    recs = [call(ctl, "GetSwitch", S.GetSwitchRequest(switch_id=n.switch_id)) for n in r.nodes]
    assert [x.node for x in recs] == list(NODES)
    for x in recs:  # each node's switch record
        assert x.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED, x.error
        assert x.request_id == f"rollout:{r.rollout_id}:{x.node}"
        assert (x.to_topology.tp, x.to_topology.pp) == (1, 2)
    # the order, and one at a time: each switch started after the previous one finished
    for a, b in zip(recs, recs[1:]):
        assert a.finished_at.ToNanoseconds() <= b.started_at.ToNanoseconds()
    assert all((agents[n].describe().topology.tp, agents[n].describe().topology.pp) == (1, 2)
               for n in NODES)
    assert load.samples and min(load.samples) >= r.plan.required_capacity, load.samples
    assert load.sent >= 3 and load.completed == load.sent, load.errors[:5]
    print(f"rollout 1: {load.sent} requests sent, {load.completed} completed; capacity "
          f"min {min(load.samples)} over {len(load.samples)} samples (required 13.5)")
    nodes = call(ctl, "ListNodes", S.ListNodesRequest()).nodes
    assert all(dict(n.labels) == {LABEL[0]: LABEL[1]} and not n.rollout_id for n in nodes)


def test_a_failure_on_the_second_node_stops_the_rollout(stack):
    ctl, agents = stack
    before = {n: len(switches(ctl, n)) for n in NODES}
    asyncio.run(arm_switch(agents["ro-b"].grpc_addr, fail_at_phase=types_pb2.PHASE_MIGRATE_KV))
    try:
        with Load(ctl, agents) as load:
            r = wait_rollout(ctl, rollout(ctl, (2, 1)).rollout_id)
    finally:
        asyncio.run(disarm(agents["ro-b"].grpc_addr))
    assert r.status == S.ROLLOUT_STATUS_FAILED and r.failed_node == "ro-b", r
    status = {n.node: n.status for n in r.nodes}
    assert status == {"ro-a": S.ROLLOUT_NODE_STATUS_SUCCEEDED,
                      "ro-b": S.ROLLOUT_NODE_STATUS_ROLLED_BACK,
                      "ro-c": S.ROLLOUT_NODE_STATUS_PENDING}
    after = {n: switches(ctl, n) for n in NODES}
    assert after["ro-a"][0].outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED
    assert after["ro-b"][0].outcome == types_pb2.SWITCH_OUTCOME_ROLLED_BACK
    assert len(after["ro-c"]) == before["ro-c"]  # untouched: no switch at all
    topo = {n: (agents[n].describe().topology.tp, agents[n].describe().topology.pp)
            for n in NODES}
    assert topo == {"ro-a": (2, 1), "ro-b": (1, 2), "ro-c": (1, 2)}
    assert min(load.samples) >= r.plan.required_capacity, load.samples
    assert load.completed == load.sent, load.errors[:5]
    print(f"rollout 2: {load.sent} requests sent, {load.completed} completed")


def test_pause_resume_abort_and_a_held_node_refuses_other_switches(stack):
    ctl, agents = stack
    b = agents["ro-b"]
    # ro-b's switch waits (FaultInjection start gate) until a request decodes there: the pause
    # is asked for while wave 0 runs (a switch takes ~0.1 s here)
    asyncio.run(arm_switch(b.grpc_addr, start_when_running=1))
    held: dict = {}
    try:
        r = rollout(ctl, (2, 1))  # ro-a is there already: skipped; ro-b, then ro-c
        assert list(r.plan.skipped) == ["ro-a"]
        assert [list(w.nodes) for w in r.plan.waves] == [["ro-b"], ["ro-c"]]
        p = control(ctl, r.rollout_id, S.ROLLOUT_ACTION_PAUSE)
        assert p.status == S.ROLLOUT_STATUS_RUNNING and p.pause_requested and p.wave == 0, p
        long = threading.Thread(target=lambda: held.update(complete(b.http, prompt(5, 20),
                                                                    max_tokens=200)))
        with Load(ctl, agents) as load:
            long.start()  # releases ro-b's switch
            p = wait_rollout(ctl, r.rollout_id, {S.ROLLOUT_STATUS_PAUSED, *TERMINAL})
            assert p.status == S.ROLLOUT_STATUS_PAUSED and p.wave == 0, p
            assert {n.node: n.status for n in p.nodes}["ro-b"] == \
                S.ROLLOUT_NODE_STATUS_SUCCEEDED
            time.sleep(0.5)
            assert len(switches(ctl, "ro-c")) == 1  # nothing started while paused
            with pytest.raises(grpc.RpcError) as ei:
                call(ctl, "Reconfigure", S.ReconfigureRequest(
                    node="ro-c", target=T(tp=2, pp=1), request_id="manual-1"))
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"held by rollout {r.rollout_id}" in ei.value.details()
            q = control(ctl, r.rollout_id, S.ROLLOUT_ACTION_RESUME)
            assert q.status == S.ROLLOUT_STATUS_RUNNING and q.wave == 1
            q = control(ctl, r.rollout_id, S.ROLLOUT_ACTION_ABORT)
            assert q.abort_requested or q.status == S.ROLLOUT_STATUS_ABORTED
            q = wait_rollout(ctl, r.rollout_id)
            long.join(120)
    finally:
        asyncio.run(disarm(b.grpc_addr))
    assert held["usage"]["completion_tokens"] == 200
    assert q.status == S.ROLLOUT_STATUS_ABORTED and not q.failed_node, q
    status = {n.node: n.status for n in q.nodes}
    assert status["ro-b"] == S.ROLLOUT_NODE_STATUS_SUCCEEDED
    # ro-c's switch was aborted (rolled back) or had passed MIGRATE_KV and finished
    assert status["ro-c"] in (S.ROLLOUT_NODE_STATUS_ROLLED_BACK, S.ROLLOUT_NODE_STATUS_SUCCEEDED)
    with pytest.raises(grpc.RpcError) as ei:
        control(ctl, r.rollout_id, S.ROLLOUT_ACTION_RESUME)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert min(load.samples) >= r.plan.required_capacity, load.samples
    assert load.completed == load.sent, load.errors[:5]
    print(f"rollout 3: {load.sent + 1} requests sent, {load.completed + 1} completed")
    listed = cli(ctl, "list")["rollouts"]
    assert [x["status"] for x in listed] == ["aborted", "failed", "done"]
    assert cli(ctl, "get", r.rollout_id)["status"] == "aborted"
    assert not call(ctl, "ListRollouts", S.ListRolloutsRequest(active_only=True)).rollouts


def test_a_controller_killed_mid_rollout_resumes_it_without_a_second_switch(stack):
    """SIGKILL of the controller while the first node's switch is in MIGRATE_KV (the driver
    frozen there by the test hook): the restarted controller completes that switch from the
    agent's truth and resumes the rollout from Redis (rollouts:active); the node's switch is
    followed again by its request id, never run twice."""
    ctl, agents = stack
    ctl.kill()  # (quicker than a graceful stop; nothing is running)
    ctl.start(env={"REMP_CONTROLLER_TEST_PAUSE_AT": "MIGRATE_KV"}).wait_ready()
    for n in NODES:
        ctl.wait_node_ready(n, timeout=60)
    with Load(ctl, agents) as load:
        r = rollout(ctl, (1, 2))
        first = r.plan.waves[0].nodes[0]
        ctl.wait_log("controller.test_paused")
        ctl.kill()
        t_kill = time.monotonic()
        ctl.start().wait_ready()
        r = wait_rollout(ctl, r.rollout_id)
        resumed_s = time.monotonic() - t_kill
    assert r.status == S.ROLLOUT_STATUS_DONE, r
    assert ctl.log_has("controller.rollout_resumed")
    sids = [n.switch_id for n in r.nodes]
    assert len(set(sids)) == len(sids) == sum(len(w.nodes) for w in r.plan.waves)
    recs = [call(ctl, "GetSwitch", S.GetSwitchRequest(switch_id=s)) for s in sids]
    assert all(x.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED for x in recs), recs
    assert all((agents[n].describe().topology.tp, agents[n].describe().topology.pp) == (1, 2)
               for n in NODES)
    sid = next(n.switch_id for n in r.nodes if n.node == first)
    quiesced = [x for x in agents[first].log_records() if x.get("event") == "switch.phase"
                and x.get("switch_id") == sid and x.get("phase") == "QUIESCING"]
    assert len(quiesced) == 1  # executed once
    assert load.completed == load.sent, load.errors[:5]
    print(f"rollout 4 (controller killed in MIGRATE_KV): done {resumed_s:.1f} s after the kill;"
          f" {load.sent} requests sent, {load.completed} completed")
