"""Planning a fleet rollout of 1,000 registered nodes (issue 17: "planned in <= 100 ms; waves
respect the floor").

The nodes register with a real :class:`controller.core.Controller` (state in a private
redis-server); the agents are simulated at the :class:`controller.ports.AgentPort` boundary
(no engine, no gRPC). Measured:

* ``plan_ms``: :func:`controller.rollout.plan_rollout` alone over the 1,000 nodes (median and
  max of ``--repeat`` runs): the planner the issue's 100 ms target is about;
* ``dry_run_ms``: the controller's Rollout with ``dry_run`` (read the 1,000 nodes from Redis,
  select by label, plan);
* the waves checked against an independent simulation: the set's capacity while each wave
  runs >= the required capacity, every node once;
* ``life_ms``: the rollout's whole life through the pure transitions (start, every node's
  switch started and finished, wave after wave), no I/O.

Fleet: ``--nodes`` hosts with the built-in profile ``h200x8-analytic`` (TP8PP1 9.06, TP4PP2
14.6, TP1PP8 24.4 req/s): 60 % on TP8PP1, 40 % on TP1PP8, all to TP4PP2 (gainers and losers),
floor 0.8, at most 100 at once; and the same at floor 0.95, where the floor, not the
maximum, sizes the waves.

* with ``--run``: the rollout itself through Redis, the driver and Controller.reconfigure
  (agents simulated: every switch succeeds at once): wall time, versions written, the size of
  the state each step rewrites.

    python bench/rollout_plan.py [--nodes 1000] [--run] [--out bench/results/...json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

from controller.config import ControllerSettings
from controller.core import Controller
from controller.model import (AbortResult, AgentDescription, EngineInfo, HostFacts, ModelFacts,
                              Registration, SwitchOrder, SwitchProgress, SwitchRecord)
from controller.rollout import (capacity_table, new_rollout, plan_rollout, start,
                                switch_finished, switch_started)
from controller.rollouts import NODE_FIELDS, RolloutSpec, rollout_nodes
from controller.store import Store
from ops.rollout_cli import capacity_table as profile_table
from remp.redisproc import RedisServer
from remp.topology import Topology
from remp.transaction import Outcome, Phase

PROFILE = "h200x8-analytic"
CANDIDATES = (Topology(8, 1), Topology(4, 2), Topology(2, 4), Topology(1, 8))


class SimAgents:
    """The AgentPort of simulated agents: planning asks them nothing (``calls`` counts); a
    switch (``--run``) succeeds at once with a complete record."""

    def __init__(self):
        self.calls = 0
        self.topology: dict[str, Topology] = {}
        self.executed = 0

    def connected(self, address: str) -> bool:
        return False  # every switch asks check_serving first

    async def check_serving(self, address: str, timeout: float = 2.0) -> None:
        self.calls += 1

    async def describe(self, address: str) -> AgentDescription:
        self.calls += 1
        return AgentDescription(engine=EngineInfo())

    async def execute_switch(self, address: str, order: SwitchOrder):
        self.calls += 1
        self.executed += 1
        node = address.split(".", 1)[0]
        src, now = self.topology.get(node), time.time_ns()
        self.topology[node] = order.target
        yield SwitchProgress(switch_id=order.switch_id, record=SwitchRecord(
            switch_id=order.switch_id, node=node, from_topology=src, to_topology=order.target,
            outcome=Outcome.SUCCEEDED, phase=Phase.SERVING_NEW, epoch=order.epoch,
            started_at=now, finished_at=time.time_ns()))

    async def get_switch(self, address: str, switch_id: str) -> SwitchRecord | None:
        return None

    async def abort_switch(self, address: str, switch_id: str, reason: str) -> AbortResult:
        return AbortResult()


def registration(i: int, topo: Topology) -> Registration:
    name = f"host-{i:04d}"
    return Registration(
        node=name, agent_address=f"{name}.fleet:50061", http_address=f"http://{name}:8000",
        topology=topo, candidates=CANDIDATES,
        host=HostFacts(hostname=name, device_type="cuda", device_count=8),
        model=ModelFacts(num_layers=80, num_attention_heads=64, num_kv_heads=8, head_size=128,
                         hidden_size=8192, dtype="bfloat16", weight_bytes=140_000_000_000),
        labels=(("fleet", "bench"), ("zone", f"z{i % 4}")))


def check_waves(nodes, plan, cap) -> tuple[float, int]:
    """Simulated from scratch: (lowest capacity while a wave runs, nodes switched)."""
    now = {n.name: cap(n, n.topology) for n in nodes}
    by = {n.name: n for n in nodes}
    seen, lowest = set(), float("inf")
    for w in plan.waves:
        assert not seen & set(w.nodes), "a node in two waves"
        seen |= set(w.nodes)
        assert len(w.nodes) <= plan.max_parallel
        during = sum(c for name, c in now.items() if name not in w.nodes)
        assert during >= plan.required_capacity - 1e-6, (w.index, during)
        assert abs(during - w.capacity_during) < 1e-6 * max(1.0, during)
        lowest = min(lowest, during)
        for name in w.nodes:
            now[name] = cap(by[name], plan.target)
    assert seen == {n.name for n in nodes if n.topology != plan.target}
    return lowest, len(seen)


async def run(a) -> dict:
    table = profile_table(PROFILE, "")
    cap = capacity_table(table)
    target = Topology.parse(a.target)
    with RedisServer() as r:
        store = Store(r.url, prefix="bench-rollout:", max_connections=8)
        agents = SimAgents()
        ctl = Controller(ControllerSettings(lease_seconds=3600.0), store, agents)
        t0 = time.perf_counter()
        for i in range(a.nodes):
            topo = Topology(8, 1) if i % 5 < 3 else Topology(1, 8)
            await ctl.register(registration(i, topo))
        register_s = time.perf_counter() - t0
        nodes = rollout_nodes(await store.nodes_fields(NODE_FIELDS))
        plan_ms = []
        for _ in range(a.repeat):
            t = time.perf_counter()
            plan = plan_rollout(nodes, target, a.floor, a.max_parallel, cap)
            plan_ms.append((time.perf_counter() - t) * 1e3)
        lowest, switched = check_waves(nodes, plan, cap)
        # a floor that binds: waves cut below max_parallel by the capacity they take out
        t = time.perf_counter()
        tight = plan_rollout(nodes, target, a.tight_floor, a.max_parallel, cap)
        tight_ms = (time.perf_counter() - t) * 1e3
        tight_lowest, _ = check_waves(nodes, tight, cap)
        spec = RolloutSpec(target=target, floor=a.floor, max_parallel=a.max_parallel,
                           capacity=table, labels={"fleet": "bench"}, dry_run=True)
        dry_ms = []
        for _ in range(max(3, a.repeat // 4)):
            t = time.perf_counter()
            v = await ctl.rollouts.create(spec)
            dry_ms.append((time.perf_counter() - t) * 1e3)
        assert v.state.plan == plan and v.dry_run
        # the whole life through the pure transitions (what the driver applies, minus I/O)
        t = time.perf_counter()
        step = start(new_rollout("bench", plan))
        s, transitions = step.state, 1
        while step.start:
            names = step.start
            for n in names:
                s = switch_started(s, n, f"sw-{n}")
            for n in names:
                step = switch_finished(s, n, Outcome.SUCCEEDED)
                s = step.state
            transitions += 2 * len(names)
        life_ms = (time.perf_counter() - t) * 1e3
        assert s.status.value == "done", s.status
        planning_calls, run = agents.calls, None
        if a.run:  # the rollout for real: Redis, the driver, Controller.reconfigure, sim agents
            for n in nodes:
                agents.topology[n.name] = n.topology
            t = time.perf_counter()
            v = await ctl.rollouts.create(RolloutSpec(
                target=target, floor=a.floor, max_parallel=a.max_parallel, capacity=table,
                labels={"fleet": "bench"}))
            rid = v.state.rollout_id
            while True:
                row = await store.rollout(rid)
                if row.status in ("done", "failed", "aborted", "paused"):
                    break
                await asyncio.sleep(0.05)
            wall = time.perf_counter() - t
            observed = {n.name: n.topology for n in rollout_nodes(
                await store.nodes_fields(NODE_FIELDS))}
            run = {"status": row.status, "wall_s": round(wall, 1), "versions": row.version,
                   "ms_per_version": round(wall * 1e3 / max(1, row.version), 1),
                   "switches_executed": agents.executed,
                   "all_on_target": all(t == target for t in observed.values()),
                   "state_json_bytes": len(row.state_json)}
        await ctl.stop()
        await store.close()
    return {
        "bench": "rollout_plan",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.node()} cpus={len(os.sched_getaffinity(0))}"
                   f" load1={os.getloadavg()[0]:.2f}",
        "nodes": a.nodes, "profile": PROFILE, "capacity_rps": table, "target": str(target),
        "floor": a.floor, "max_parallel": a.max_parallel,
        "fleet": {"TP8PP1": sum(n.topology == Topology(8, 1) for n in nodes),
                  "TP1PP8": sum(n.topology == Topology(1, 8) for n in nodes)},
        "register_s": round(register_s, 2),
        "plan_ms": {"median": round(statistics.median(plan_ms), 2),
                    "max": round(max(plan_ms), 2), "runs": len(plan_ms)},
        "plan_target_ms": 100,
        "dry_run_ms": {"median": round(statistics.median(dry_ms), 2),
                       "max": round(max(dry_ms), 2), "runs": len(dry_ms)},
        "waves": len(plan.waves), "nodes_switched": switched,
        "wave_sizes": sorted({len(w.nodes) for w in plan.waves}),
        "base_capacity": round(plan.base_capacity, 2),
        "required_capacity": round(plan.required_capacity, 2),
        "lowest_capacity_during_a_wave": round(lowest, 2),
        "floor_respected": lowest >= plan.required_capacity - 1e-6,
        "tight_floor": {"floor": a.tight_floor, "plan_ms": round(tight_ms, 2),
                        "waves": len(tight.waves),
                        "wave_sizes_min_max": [min(len(w.nodes) for w in tight.waves),
                                               max(len(w.nodes) for w in tight.waves)],
                        "required_capacity": round(tight.required_capacity, 2),
                        "lowest_capacity_during_a_wave": round(tight_lowest, 2)},
        "life_transitions": transitions, "life_ms": round(life_ms, 1),
        "agent_calls_while_planning": planning_calls,
        "run": run,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--target", default="TP4PP2")
    ap.add_argument("--floor", type=float, default=0.8)
    ap.add_argument("--max-parallel", type=int, default=100)
    ap.add_argument("--tight-floor", type=float, default=0.95)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--run", action="store_true", help="also run the rollout through Redis "
                    "and the driver with the simulated agents (slow: minutes at 1,000 nodes)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    result = asyncio.run(run(a))
    out = a.out or Path(__file__).parent / "results" / f"rollout_plan-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
