"""The control plane survives losing any one process (issue 17), with REAL CPU node agents.

    python bench/control_plane_faults.py [--scenario leader-kill|redis-kill|
                                         redis-and-leader-kill|both|all] [--out FILE]
                                         [--log-dir DIR] [--json]

Everything runs on loopback as real processes: three ``remp agent`` (vLLM CPU, the tiny model,
TP2PP1 <-> TP1PP2 inside world 2, 64 MiB KV, fault injection on — the setup of
tests/e2e/test_rollout_e2e.py), registered with two ``remp controller`` processes
(``--controller A,B``, ``REMP_CONTROLLER_LEADER_LEASE_SECONDS=3``), and Redis. A thread sends
short OpenAI completions (max_tokens 8) round robin to the agents throughout; every one must
complete. A nice -20 sleeper (bench.common.PauseMonitor) records the gaps of the bench's own
session (autogroup scheduling starves it for 0.2-6 s behind the agents' busy-waiting workers
on 2 cores; see PauseMonitor); every figure is reported with the gaps inside its window.

leader-kill: rollouts with floor 0.5 of the profile ``tiny-cpu-2core`` (one node per wave, nodes
in name order a, b, c). kill -9 of the leading controller at these points:
  K0 a first rollout accepted, wave 1's switch accepted (in Redis) but not yet dispatched (the
     leader runs with REMP_CONTROLLER_TEST_PAUSE_AT=ACCEPTED). The next leader aborts that
     switch (NOT_DISPATCHED, nothing ran) and the rollout switches the node again (97775da;
     before it, the rollout ended FAILED at node a) and finishes; the rollout after it goes
     back to the starting topology;
  idle: no rollout running (to hand leadership to a controller frozen at DISPATCHED);
  then one rollout that must finish:
  K1 before wave 1 runs: its switch dispatched (in Redis) but not sent (PAUSE_AT=DISPATCHED);
     the next leader finds the agent never got it (NOT_RECEIVED) and the rollout re-issues it;
  K2 node a finished: the moment GetRollout shows node a SUCCEEDED (polled every 20 ms; the
     leader has usually already started node b's switch by then — see state_at_kill);
  K3 mid node b's switch: node b's agent holds the switch it received before QUIESCING
     (FaultInjection start gate, released by one longer request once the other controller leads).
A controller is restarted after each kill so that two are always up. handover = kill -> the
other controller answers writes as leader; resumed = kill -> its log shows
controller.rollout_resumed; progress = kill -> the rollout's state changes after the kill.
Checked: the rollout ends DONE, each node's switch EXECUTED exactly once by its agent (the
agent's switch.phase QUIESCING log lines per switch id; a switch that never reached an agent,
aborted NOT_RECEIVED, is re-issued by the rollout and is not a run), every switch id ever seen
is in the final leader's ListSwitches, final, and agrees with the agent's own record.

redis-kill: Redis primary + replica + three sentinels (remp.redisproc.RedisHA, as ``remp up
--ha``), two controllers reaching it with REMP_CONTROLLER_REDIS_URL=redis+sentinel://... and
REMP_CONTROLLER_REDIS_WAIT_REPLICAS=1 (environment only: the password is in no argv, checked),
on the same ports (the agents re-register by themselves). A rollout back; when node a finished
and node b's switch is held on its agent, kill -9 of the Redis primary, then node b released.
The killed server is restarted as a replica of the new primary once Sentinel has promoted (as
``remp up`` does). failover = kill -> the sentinels name a new primary; recovered = kill -> the
rollout's next step (node b's result) is written and read back through the controller; target
<= 15 s. Checked: rollout DONE, no switch run twice, every record seen before the kill there.

redis-and-leader-kill: as redis-kill on a fresh Redis HA group, and the leading controller is
killed -9 at the same moment as the primary (two faults at once); it is restarted at once on its
port. handover = kill -> a controller answers writes as leader (after Sentinel promoted and the
dead leader's lease ran out). The same three agents serve through every scenario: against each
new Redis they register with the last switch epoch they saw (RegisterNodeRequest.last_epoch),
which the new node epoch starts from.

Not measured: network partitions (everything is loopback), the agents themselves dying (tests/e2e), GPUs, or load
beyond one request at a time. Handover figures include this VM's pauses (reported beside).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import PauseMonitor, emit, machine  # noqa: E402
from devstack.agentproc import (AgentProcess, ControllerProcess, arm_switch,  # noqa: E402
                                disarm, ensure_credentials, favour_this_session, prompt)
from devstack.modelgen import make_model  # noqa: E402
from ops.rollout_cli import capacity_table  # noqa: E402
from remp.common.v1 import types_pb2  # noqa: E402
from remp.controller.v1 import controller_pb2 as S  # noqa: E402
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc  # noqa: E402
from remp.redisproc import RedisHA, RedisServer  # noqa: E402

NODES = ("cpf-a", "cpf-b", "cpf-c")
LABEL = ("fleet", "cp-faults")
CAP = capacity_table("tiny-cpu-2core", "")  # {"TP2PP1": 9.0, "TP1PP2": 10.0}
FLOOR = 0.5  # of 27 req/s: one node at a time
LEASE_S = 3.0
HA = {"REMP_CONTROLLER_LEADER_LEASE_SECONDS": str(LEASE_S)}
T = types_pb2.Topology
TERMINAL = {S.ROLLOUT_STATUS_DONE, S.ROLLOUT_STATUS_FAILED, S.ROLLOUT_STATUS_ABORTED}
MAX_TOKENS = 8
RELEASE_TOKENS = 128  # the one longer request that opens node b's start gate


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- controller calls

def call(ctl, method, req, timeout=10):
    with grpc.insecure_channel(ctl.addr) as ch:
        return getattr(ctl.stub(ch), method)(req, metadata=ctl.metadata(), timeout=timeout)


def leads(ctl) -> bool:
    """A write to an unknown node: NOT_FOUND from the leader, UNAVAILABLE elsewhere."""
    if ctl.proc is None or ctl.proc.poll() is not None:
        return False
    try:
        call(ctl, "Reconfigure", S.ReconfigureRequest(node="no-such-node", target=T(tp=1, pp=1)),
             timeout=3)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.NOT_FOUND
    return False


def wait_leader(ctls, timeout: float = 30):
    """The first of ``ctls`` that leads, and the seconds waited."""
    t0 = time.monotonic()
    while True:
        for c in ctls:
            if leads(c):
                return c, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("no controller took over")
        time.sleep(0.05)


def get_rollout(ctl, rid, timeout=5) -> S.RolloutState:
    return call(ctl, "GetRollout", S.GetRolloutRequest(rollout_id=rid), timeout=timeout)


def node_row(r: S.RolloutState, node: str):
    return next(n for n in r.nodes if n.node == node)


def snapshot(r: S.RolloutState) -> tuple:
    return (r.status, r.wave, tuple((n.node, n.status, n.switch_id) for n in r.nodes))


def wait_rollout(ctls, rid, pred, timeout=180, seen: set | None = None):
    """Polls GetRollout on whichever controller answers until ``pred(state)``; collects every
    switch id seen into ``seen``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        for c in ctls:
            if c.proc is None:
                continue
            try:
                last = get_rollout(c, rid)
            except grpc.RpcError:
                continue
            if seen is not None:
                seen.update(n.switch_id for n in last.nodes if n.switch_id)
            if pred(last):
                return last
            break
        time.sleep(0.02)
    raise TimeoutError(f"rollout {rid}: condition not reached; last state {last}")


def start_rollout(ctl, target: tuple[int, int], request_id: str) -> S.RolloutState:
    req = S.RolloutRequest(target=T(tp=target[0], pp=target[1]), capacity_floor=FLOOR,
                           max_parallel=3, capacity_rps=CAP, reason="control_plane_faults",
                           request_id=request_id)
    req.labels[LABEL[0]] = LABEL[1]
    return call(ctl, "Rollout", req, timeout=30).rollout


def list_switches(ctl, node) -> list[types_pb2.SwitchRecord]:
    return list(call(ctl, "ListSwitches", S.ListSwitchesRequest(node=node, page_size=1000),
                     timeout=30).switches)


# ---------------------------------------------------------------- agents

def topology(agent) -> tuple[int, int]:
    d = agent.describe()
    return (d.topology.tp, d.topology.pp)


def executions(agent, sids) -> dict[str, int]:
    """How many times the agent ran each switch (its switch.phase QUIESCING log lines)."""
    n = {s: 0 for s in sids}
    for r in agent.log_records():
        if (r.get("event") == "switch.phase" and r.get("phase") == "QUIESCING"
                and r.get("switch_id") in n):
            n[r["switch_id"]] += 1
    return n


class Traffic:
    """Short completions round robin to the agents, one at a time, until stopped; nodes in
    ``hold`` are skipped (a held switch's start gate must not open by chance)."""

    def __init__(self, agents: dict[str, AgentProcess]):
        self.agents = agents
        self.sent = self.completed = 0
        self.per_node = {n: [0, 0] for n in agents}
        self.errors: list[str] = []
        self.hold: set[str] = set()
        self.phase = "start"  # each request is counted under the phase it was sent in
        self.per_phase: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Traffic":
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(180)

    def begin(self, phase: str) -> None:
        with self.lock:
            self.phase = phase

    def counts(self, phase: str) -> tuple[int, int]:
        with self.lock:
            return tuple(self.per_phase.get(phase, [0, 0]))

    def one(self, client, node: str, i: int, max_tokens: int = MAX_TOKENS) -> None:
        a = self.agents[node]
        with self.lock:
            self.sent += 1
            self.per_node[node][0] += 1
            phase = self.per_phase.setdefault(self.phase, [0, 0])
            phase[0] += 1
        try:
            r = client.post(f"{a.http}/v1/completions", json={
                "model": "tiny", "prompt": prompt(i % 40, 20), "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True})
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == max_tokens:
                with self.lock:
                    self.completed += 1
                    self.per_node[node][1] += 1
                    phase[1] += 1
            else:
                self.errors.append(f"{node}: {r.status_code} {r.text[:200]}")
        except httpx.HTTPError as exc:
            self.errors.append(f"{node}: {exc!r}")

    def _run(self) -> None:
        i = 0
        names = list(self.agents)
        with httpx.Client(timeout=180) as c:
            while not self._stop.is_set():
                node = names[i % len(names)]
                i += 1
                if node in self.hold:
                    continue
                self.one(c, node, i)
                self._stop.wait(0.05)  # a trickle: the restarting controllers need the cores


def release(traffic: Traffic, node: str) -> threading.Thread:
    """One longer request to ``node`` (it opens the start gate), then its traffic again."""
    def go():
        with httpx.Client(timeout=180) as c:
            traffic.one(c, node, 7, max_tokens=RELEASE_TOKENS)
        traffic.hold.discard(node)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def wait_held(agent, sid, timeout=60) -> None:
    """Until the agent has switch ``sid`` (received, waiting at its start gate)."""
    deadline = time.monotonic() + timeout
    while agent.switch_record(sid) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{agent.node} never received {sid}")
        time.sleep(0.05)


def wait_log_mono(ctl, event, timeout=60) -> float:
    """time.monotonic() when ``event`` is first seen in the controller's log (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ctl.log_has(event):
            return time.monotonic()
        time.sleep(0.05)
    return float("nan")


# ---------------------------------------------------------------- verification

def verify(ctl, agents, r: S.RolloutState, seen: set[str]) -> dict:
    """Every switch id seen is in the leader's history, final; per node: the rollout's switches
    and how many the agent executed; the agent's record agrees with the controller's."""
    listed = {}
    for n in NODES:
        for s in list_switches(ctl, n):
            listed[s.switch_id] = s
    lost = sorted(seen - set(listed))
    not_final = sorted(s for s in seen & set(listed) if listed[s].outcome in (
        types_pb2.SWITCH_OUTCOME_RUNNING, types_pb2.SWITCH_OUTCOME_UNSPECIFIED))
    per_node, twice, disagree = {}, 0, []
    prefix = f"rollout:{r.rollout_id}:"
    for n in NODES:
        mine = [s for s in listed.values() if s.node == n and s.request_id.startswith(prefix)]
        runs = executions(agents[n], [s.switch_id for s in mine])
        executed = [s for s, k in runs.items() if k > 0]
        twice += sum(max(0, k - 1) for k in runs.values()) + max(0, len(executed) - 1)
        for s in mine:
            truth = agents[n].switch_record(s.switch_id)
            if truth is not None and truth.outcome != s.outcome:
                disagree.append(s.switch_id)
            if truth is None and runs[s.switch_id]:
                disagree.append(s.switch_id)
        per_node[n] = {
            "switch_records": [{"switch_id": s.switch_id, "request_id": s.request_id,
                                "outcome": types_pb2.SwitchOutcome.Name(s.outcome),
                                "error": s.error.code if s.HasField("error") else "",
                                "executed_by_agent": runs[s.switch_id]} for s in mine],
            "switches_executed": len(executed),
            "topology": "TP{}PP{}".format(*topology(agents[n]))}
    return {"rollout_status": S.RolloutStatus.Name(r.status),
            "node_status": {n.node: S.RolloutNodeStatus.Name(n.status) for n in r.nodes},
            "switch_ids_seen": len(seen), "records_lost": len(lost), "lost": lost,
            "records_not_final": not_final, "switches_run_twice": twice,
            "agent_controller_disagree": disagree, "per_node": per_node}


def other(cur: tuple[int, int]) -> tuple[int, int]:
    return (1, 2) if cur == (2, 1) else (2, 1)


# ---------------------------------------------------------------- scenarios

def leader_kill(ctls, agents, traffic: Traffic, log_dir: Path) -> dict:
    a, b = ctls
    # A leads, frozen at ACCEPTED for every switch it drives; B is the spare
    for c in (a, b):
        c.kill()
    a.start(env={**HA, "REMP_CONTROLLER_TEST_PAUSE_AT": "ACCEPTED"}).wait_ready(120)
    wait_leader([a])
    b.start(env=HA).wait_ready(120)
    for n in NODES:
        a.wait_node_ready(n, timeout=120)
    start = topology(agents[NODES[0]])
    target = other(start)
    traffic.begin("leader_kill")
    kills = []

    def kill_leader(point: str, lead, spare, before: S.RolloutState | None, restart_env=None):
        lead.kill()
        t_kill = time.monotonic()
        who, handover = wait_leader([spare], timeout=60)
        t_lead = time.monotonic()
        k = {"point": point, "killed": lead.name, "took_over": spare.name,
             "t_kill": t_kill, "handover_s": round(handover, 3)}
        if before is not None:
            resumed_at = wait_log_mono(spare, "controller.rollout_resumed", timeout=20)
            k["resumed_s"] = round(resumed_at - t_kill, 3)
            k["state_at_kill"] = {n.node: [S.RolloutNodeStatus.Name(n.status), n.switch_id]
                                  for n in before.nodes}
        log(f"{point}: killed {lead.name}; {spare.name} leads after {handover:.2f} s"
            + (f", resumed the rollout after {k['resumed_s']:.2f} s" if before else ""))
        lead.start(env=restart_env or HA)  # the spare again (ready checked before next kill)
        kills.append(k)
        return k, t_lead

    # K0: a first rollout, its first switch accepted (in Redis) and not yet dispatched. The
    # next leader aborts a switch that was never dispatched (NOT_DISPATCHED, nothing ran) and
    # the rollout switches that node again.
    seen0: set[str] = set()
    r0 = start_rollout(a, target, f"cpf-leader0-{int(time.time())}")
    a.wait_log("controller.test_paused", timeout=60)
    before = wait_rollout([a], r0.rollout_id, lambda s: bool(node_row(s, "cpf-a").switch_id),
                          seen=seen0)
    k0, _ = kill_leader("K0 rollout accepted, wave 1's switch accepted, not dispatched", a, b,
                        before, restart_env={**HA, "REMP_CONTROLLER_TEST_PAUSE_AT": "DISPATCHED"})
    final0 = wait_rollout([b], r0.rollout_id, lambda s: s.status in TERMINAL, seen=seen0)
    k0["progress_s"] = round(time.monotonic() - k0["t_kill"], 3)
    k0["rollout_outcome"] = S.RolloutStatus.Name(final0.status)
    k0["rollout_reason"] = final0.reason
    v0 = verify(b, agents, final0, seen0)
    log(f"K0: rollout {k0['rollout_outcome']} ({final0.reason})")
    if final0.status == S.ROLLOUT_STATUS_DONE:  # every node on ``target``: the next goes back
        start, target = target, start
    # A (frozen at DISPATCHED) must lead for K1: the idle leader B is killed (handover measured)
    a.wait_ready(120)
    kill_leader("idle (no rollout running)", b, a, None)
    b.wait_ready(120)

    asyncio.run(disarm(agents["cpf-b"].grpc_addr))
    asyncio.run(arm_switch(agents["cpf-b"].grpc_addr, start_when_running=1))
    traffic.hold.add("cpf-b")
    seen: set[str] = set()
    t_start = time.monotonic()
    r = start_rollout(a, target, f"cpf-leader-{int(time.time())}")
    rid = r.rollout_id
    log(f"leader-kill: rollout {rid} {start} -> {target}, waves "
        f"{[list(w.nodes) for w in r.plan.waves]}")

    # K1: wave 1's switch dispatched (in Redis), not yet sent (A frozen at DISPATCHED): the
    # next leader finds the agent never got it (NOT_RECEIVED) and the rollout re-issues it
    a.wait_log("controller.test_paused", timeout=60)
    before = wait_rollout([a], rid, lambda s: bool(node_row(s, "cpf-a").switch_id), seen=seen)
    k1, _ = kill_leader("K1 before wave 1 runs: its switch dispatched, not sent", a, b, before)
    snap = snapshot(before)
    after = wait_rollout([b], rid, lambda s: snapshot(s) != snap, seen=seen)
    k1["progress_s"] = round(time.monotonic() - k1["t_kill"], 3)

    # K2: node a finished (B leads; node b's switch, if sent, waits at its start gate)
    after = wait_rollout([b], rid, lambda s: node_row(s, "cpf-a").status
                         == S.ROLLOUT_NODE_STATUS_SUCCEEDED, timeout=120, seen=seen)
    a.wait_ready(120)
    if not node_row(after, "cpf-a").status == S.ROLLOUT_NODE_STATUS_SUCCEEDED:
        raise RuntimeError(after)
    sid = node_row(after, "cpf-b").switch_id  # (read just before the kill)
    on_agent = bool(sid) and agents["cpf-b"].switch_record(sid) is not None
    k2, _ = kill_leader("K2 node a finished", b, a, after)
    k2["node_b_switch_on_agent_at_kill"] = on_agent
    snap = snapshot(after)
    after = wait_rollout([a], rid, lambda s: snapshot(s) != snap
                         or bool(node_row(s, "cpf-b").switch_id), seen=seen)
    k2["progress_s"] = round(time.monotonic() - k2["t_kill"], 3)

    # K3: mid node b's switch (A leads; node b's agent holds it before QUIESCING)
    st = wait_rollout([a], rid, lambda s: bool(node_row(s, "cpf-b").switch_id), seen=seen)
    sid_b = node_row(st, "cpf-b").switch_id
    wait_held(agents["cpf-b"], sid_b)
    b.wait_ready(120)
    held = agents["cpf-b"].switch_record(sid_b)
    k3, _ = kill_leader("K3 mid node b's switch", a, b, st)
    k3["node_b_agent_phase_at_kill"] = types_pb2.Phase.Name(held.phase)  # held at its gate
    rel = release(traffic, "cpf-b")
    snap = snapshot(st)
    wait_rollout([b], rid, lambda s: snapshot(s) != snap, seen=seen)
    k3["progress_s"] = round(time.monotonic() - k3["t_kill"], 3)
    k3["progress_includes"] = "node b's switch itself (released once the spare leads)"

    final = wait_rollout([b, a], rid, lambda s: s.status in TERMINAL, timeout=180, seen=seen)
    done_s = time.monotonic() - t_start
    rel.join(180)
    a.wait_ready(120)
    lead, _ = wait_leader([a, b])
    v = verify(lead, agents, final, seen)
    s1 = traffic.counts("leader_kill")
    traffic.begin("between")
    log(f"leader-kill: rollout {v['rollout_status']} in {done_s:.1f} s; lost "
        f"{v['records_lost']}, run twice {v['switches_run_twice']}")
    return {"rollout_id": rid, "from": "TP{}PP{}".format(*start),
            "to": "TP{}PP{}".format(*target), "lease_s": LEASE_S, "kills": kills,
            "rollout_s": round(done_s, 2), **v,
            "records_lost": v["records_lost"] + v0["records_lost"],
            "switches_run_twice": v["switches_run_twice"] + v0["switches_run_twice"],
            "k0_rollout": {"rollout_id": r0.rollout_id, **v0},
            "controller_handover_s": max(k["handover_s"] for k in kills),
            "openai_requests_sent": s1[0], "openai_requests_completed": s1[1]}


def redis_kill(ctls, agents, traffic: Traffic, log_dir: Path, kill_leader: bool = False,
               phase: str = "redis_kill") -> dict:
    """``kill_leader``: the leading controller is killed -9 at the same moment as the Redis
    primary (two faults at once); it is restarted at once, so two controllers are up again."""
    for c in ctls:
        c.kill()
    with RedisHA(down_after_ms=1000, failover_timeout_ms=5000) as ha:
        env = {**HA, "REMP_CONTROLLER_REDIS_WAIT_REPLICAS": "1"}
        sctls = []
        for c in ctls:  # same ports: the agents find them and re-register
            # the URL (password included) goes in the environment (ControllerProcess.start)
            s = ControllerProcess(ha.url, log_dir=log_dir, name=f"{c.name}-{phase}", env=env)
            s.port, s.addr = c.port, c.addr
            sctls.append(s)
        try:
            for s in sctls:
                s.start().wait_ready(120)
            lead, _ = wait_leader(sctls, timeout=60)
            for n in NODES:
                lead.wait_node_ready(n, timeout=120)
            offenders = [p.pid for p in psutil.process_iter(["cmdline"])
                         if ha.password in " ".join(p.info["cmdline"] or [])]
            start = topology(agents[NODES[0]])
            target = other(start)
            asyncio.run(disarm(agents["cpf-b"].grpc_addr))
            asyncio.run(arm_switch(agents["cpf-b"].grpc_addr, start_when_running=1))
            traffic.hold.add("cpf-b")
            traffic.begin(phase)
            seen: set[str] = set()
            t_start = time.monotonic()
            r = start_rollout(lead, target, f"cpf-{phase}-{int(time.time())}")
            rid = r.rollout_id
            log(f"{phase}: rollout {rid} {start} -> {target} through {ha.redacted_url}")
            st = wait_rollout(sctls, rid, lambda s: bool(node_row(s, "cpf-b").switch_id)
                              or s.status in TERMINAL, timeout=120, seen=seen)
            if st.status in TERMINAL:
                raise RuntimeError(f"the rollout ended before node b's switch: {st}")
            sid_b = node_row(st, "cpf-b").switch_id
            wait_held(agents["cpf-b"], sid_b)
            acked = {s: call(lead, "GetSwitch", S.GetSwitchRequest(switch_id=s))
                     for s in seen}
            old = ha.primary_port()
            ha.server_on(old).proc.kill()
            if kill_leader:
                lead.kill()
            t_kill = time.monotonic()
            log(f"{phase}: primary :{old} killed (-9)"
                f"{' and the leading controller ' + lead.name if kill_leader else ''} with node "
                f"b's switch {sid_b} held")
            rejoin = {}
            handover: dict = {}
            if kill_leader:
                killed = lead

                def restart_and_handover():
                    killed.start()  # the process manager restarts it (same port)
                    try:
                        new, _ = wait_leader([c for c in sctls if c is not killed] + [killed],
                                             timeout=120)
                        handover.update(s=time.monotonic() - t_kill, leader=new.name)
                    except TimeoutError as exc:
                        handover["error"] = repr(exc)
                ht = threading.Thread(target=restart_and_handover, daemon=True)
                ht.start()

            def restart_old():
                try:
                    ha.restart_server(ha.server_on(old), timeout=60)
                    rejoin["s"] = time.monotonic() - t_kill
                except Exception as exc:  # noqa: BLE001 - reported
                    rejoin["error"] = repr(exc)
            rt = threading.Thread(target=restart_old, daemon=True)
            rt.start()
            rel = release(traffic, "cpf-b")
            first_read = None
            promoted = None
            progressed = None
            snap = snapshot(st)
            deadline = t_kill + 120
            while time.monotonic() < deadline and progressed is None:
                if promoted is None:
                    p = ha.primary_port()
                    if p not in (None, old):
                        promoted = time.monotonic() - t_kill
                for c in sctls:
                    try:
                        cur = get_rollout(c, rid, timeout=3)
                    except grpc.RpcError:
                        continue
                    if first_read is None:
                        first_read = time.monotonic() - t_kill
                    seen.update(n.switch_id for n in cur.nodes if n.switch_id)
                    if node_row(cur, "cpf-b").status != S.ROLLOUT_NODE_STATUS_SWITCHING \
                            and snapshot(cur) != snap:
                        progressed = time.monotonic() - t_kill
                    break
                time.sleep(0.05)
            while promoted is None and time.monotonic() < deadline:
                if ha.primary_port() not in (None, old):
                    promoted = time.monotonic() - t_kill
                time.sleep(0.05)
            log(f"{phase}: promoted after {promoted} s, first read {first_read} s, "
                f"rollout progressed after {progressed} s")
            if kill_leader:
                ht.join(150)
                log(f"{phase}: a controller led again after {handover.get('s')} s "
                    f"({handover.get('leader') or handover.get('error')})")
            final = wait_rollout(sctls, rid, lambda s: s.status in TERMINAL, timeout=180,
                                 seen=seen)
            done_s = time.monotonic() - t_start
            rel.join(180)
            rt.join(90)
            lead, _ = wait_leader(sctls, timeout=60)
            v = verify(lead, agents, final, seen)
            missing_acked = [s for s in acked if s not in {
                x.switch_id for n in NODES for x in list_switches(lead, n)}]
            s1 = traffic.counts(phase)
            traffic.begin("after")
            log(f"{phase}: rollout {v['rollout_status']} in {done_s:.1f} s; lost "
                f"{v['records_lost']}, run twice {v['switches_run_twice']}")
            return {"rollout_id": rid, "from": "TP{}PP{}".format(*start),
                    "to": "TP{}PP{}".format(*target), "t_kill": t_kill,
                    "sentinel": {"down_after_ms": 1000, "failover_timeout_ms": 5000,
                                 "replicas": 1, "sentinels": 3, "wait_replicas": 1},
                    "sentinel_promoted_s": None if promoted is None else round(promoted, 3),
                    "first_controller_read_s": None if first_read is None
                    else round(first_read, 3),
                    "recovered_s": None if progressed is None else round(progressed, 3),
                    "recovered_means": "kill -> node b's switch result written and read back "
                                       "through the controller (includes the switch itself)",
                    "old_primary_rejoined_s": round(rejoin["s"], 3) if "s" in rejoin else None,
                    "old_primary_rejoin_error": rejoin.get("error"),
                    "redis_failover_s": None if progressed is None else round(progressed, 3),
                    **({"leader_killed": True,
                        "controller_handover_s": round(handover["s"], 3) if "s" in handover
                        else None, "new_leader": handover.get("leader"),
                        "handover_error": handover.get("error")} if kill_leader else {}),
                    "acknowledged_records_before_kill": len(acked),
                    "acknowledged_records_missing": missing_acked,
                    "password_in_argv_pids": offenders,
                    "rollout_s": round(done_s, 2), **v,
                    "openai_requests_sent": s1[0], "openai_requests_completed": s1[1]}
        finally:
            for s in sctls:
                s.kill()


# ---------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", choices=["leader-kill", "redis-kill", "redis-and-leader-kill",
                                           "both", "all"], default="all",
                    help="both: leader-kill and redis-kill; all: the three")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / (
        f"control_plane_faults_agents-{time.strftime('%Y-%m-%d', time.gmtime())}.json"))
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    client_session = favour_this_session()  # the bench's clients as if on another host
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="cp-faults-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    ensure_credentials(log_dir)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(log_dir / "vllm-cache"))
    model = make_model(log_dir / "tiny-llama")
    t0 = time.monotonic()
    result: dict = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine(),
                    "command": " ".join([".venv/bin/python", "bench/control_plane_faults.py",
                                         *sys.argv[1:]]),
                    "scenarios_run": args.scenario, "log_dir": str(log_dir),
                    "client_session": client_session}
    scen: dict = {}
    redis = RedisServer().start()
    ctls = [ControllerProcess(redis.url, log_dir=log_dir, name=f"ctl-{x}", env=HA)
            for x in ("a", "b")]
    agents = {n: AgentProcess(model, tp=2, pp=1, log_dir=log_dir, node=n,
                              env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"},
                              extra=["--controller", f"{ctls[0].addr},{ctls[1].addr}",
                                     "--label", "=".join(LABEL), "--no-world-changes",
                                     "--no-warm-up-candidates", "--candidates", "TP2PP1,TP1PP2",
                                     "--max-model-len", "512"]) for n in NODES}
    traffic = Traffic(agents)
    error = None
    with PauseMonitor() as pm:
        try:
            for a in agents.values():  # the controllers: each scenario starts its own
                a.start()
            for a in agents.values():
                a.wait_ready(timeout=400)
            log(f"agents ready after {time.monotonic() - t0:.0f} s")
            traffic.start()
            if args.scenario in ("leader-kill", "both", "all"):
                scen["leader_kill"] = leader_kill(ctls, agents, traffic, log_dir)
            # The same agents go on against each new Redis: a node's switch epoch lives in
            # Redis and the agents refuse epochs below the last they saw; they report it when
            # they register and the new Redis's node epoch is raised to it (last_epoch).
            if args.scenario in ("redis-kill", "both", "all"):
                for c in ctls:
                    c.kill()
                redis.stop()
                scen["redis_kill"] = redis_kill(ctls, agents, traffic, log_dir)
            if args.scenario in ("redis-and-leader-kill", "all"):
                for c in ctls:
                    c.kill()
                redis.stop()
                scen["redis_and_leader_kill"] = redis_kill(
                    ctls, agents, traffic, log_dir, kill_leader=True,
                    phase="redis_and_leader_kill")
        except Exception as exc:  # noqa: BLE001 - what was measured is still written
            import traceback
            error = traceback.format_exc()
            log(f"FAILED: {exc!r}")
        finally:
            time.sleep(0.3)
            traffic.stop()
            for c in ctls:
                c.kill()
            redis.stop()
            for a in agents.values():
                a.stop_in_background()
    for a in agents.values():
        a.stop()
    for name, sc in scen.items():  # counted once every request has returned
        sc["openai_requests_sent"], sc["openai_requests_completed"] = \
            traffic.per_phase.get(name, [0, 0])
    # machine pauses inside each measured window
    lk = scen.get("leader_kill")
    if lk:
        for k in lk["kills"]:
            t = k.pop("t_kill")
            k["paused_s_in_handover"] = round(pm.paused_s(t, t + k["handover_s"]), 3)
            k["paused_s_in_progress"] = round(pm.paused_s(t, t + k.get("progress_s", 0)), 3)
    for rk in (scen.get("redis_kill"), scen.get("redis_and_leader_kill")):
        if rk:
            t = rk.pop("t_kill")
            rk["paused_s_in_recovery"] = round(pm.paused_s(t, t + (rk["recovered_s"] or 0)), 3)
    rk, dk = scen.get("redis_kill"), scen.get("redis_and_leader_kill")
    result.update({
        "controller_handover_s": lk["controller_handover_s"] if lk else None,
        "redis_failover_s": rk["redis_failover_s"] if rk else None,
        "redis_and_leader_kill": None if not dk else {
            "redis_failover_s": dk["redis_failover_s"],
            "controller_handover_s": dk["controller_handover_s"]},
        "records_lost": sum(s["records_lost"] + len(s.get("acknowledged_records_missing", []))
                            for s in scen.values()),
        "switches_run_twice": sum(s["switches_run_twice"] for s in scen.values()),
        "openai_requests_sent": traffic.sent,
        "openai_requests_completed": traffic.completed,
        "openai_per_node_sent_completed": traffic.per_node,
        "openai_per_phase_sent_completed": traffic.per_phase,
        "openai_errors": traffic.errors[:20],
        "machine_pauses": pm.summary(),
        "wall_s": round(time.monotonic() - t0, 1),
        "scenarios": scen})
    if error:
        result["partial"] = True
        result["error"] = error[-3000:]
    emit(result, args.out, args.json)
    log(f"wrote {args.out}")
    ok = (not error and result["records_lost"] == 0 and result["switches_run_twice"] == 0
          and traffic.sent == traffic.completed
          and all(s["rollout_status"] == "ROLLOUT_STATUS_DONE" for s in scen.values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
