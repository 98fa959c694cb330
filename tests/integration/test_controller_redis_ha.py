"""The controller's state through Redis Sentinel (issue 17): the real Controller core and its
Store on a primary + replica + three sentinels (real processes), agents simulated at the
AgentPort boundary (tests/unit/test_rollout_store.Fleet). Critical writes wait for the replica
(``wait_replicas=1``). kill -9 of the primary in the middle of a rollout: the rollout finishes
after Sentinel promotes the replica, no switch runs twice, and every switch record a caller was
told about is there."""

import asyncio
import time
import uuid
from dataclasses import replace

import pytest

from controller.config import ControllerSettings
from controller.core import Controller
from controller.model import Outcome, Phase, SwitchRecord
from controller.rollout import NodeStatus, RolloutStatus
from controller.store import Store
from remp.redisproc import RedisHA
from tests.unit.test_rollout_store import PP2, TP2, Fleet, registration, spec


class AgentsOfTheirOwn(Fleet):
    """The fleet of test_rollout_store, but each switch runs on the agent's side whether or
    not the controller still listens (as a real agent's does), and GetSwitch reports it while
    it runs: a controller that lost Redis mid-switch then finds it by reconciling."""

    def __init__(self):
        super().__init__()
        self.tasks: list[asyncio.Task] = []
        self.running: dict[str, SwitchRecord] = {}

    async def execute_switch(self, address, order):
        q: asyncio.Queue = asyncio.Queue()
        self.running[order.switch_id] = SwitchRecord(
            switch_id=order.switch_id, node=self.node(address), outcome=Outcome.RUNNING,
            phase=Phase.QUIESCING, epoch=order.epoch, to_topology=order.target)

        async def run():
            async for ev in Fleet.execute_switch(self, address, order):
                if ev.record is None:
                    self.running[order.switch_id] = replace(
                        self.running[order.switch_id], phase=ev.phase)
                q.put_nowait(ev)
            q.put_nowait(None)
        self.tasks.append(asyncio.create_task(run()))
        while (ev := await q.get()) is not None:
            yield ev

    async def get_switch(self, address, switch_id):
        return self.records.get(switch_id) or self.running.get(switch_id)


@pytest.fixture(scope="module")
def ha():
    with RedisHA(down_after_ms=1000, failover_timeout_ms=5000) as g:
        yield g


async def _core(url: str, fleet: Fleet) -> tuple[Controller, Store]:
    store = Store(url, prefix=f"t-ha-{uuid.uuid4().hex[:8]}:", wait_replicas=1, wait_ms=2000,
                  socket_timeout=3.0, pool_timeout=3.0)
    c = Controller(ControllerSettings(lease_seconds=60.0), store, fleet)
    for n in ("n1", "n2", "n3"):
        fleet.topology.setdefault(n, TP2)
        await c.register(registration(n, fleet.topology[n]))
    return c, store


def test_a_rollout_survives_kill_9_of_the_redis_primary(ha):
    async def go():
        fleet = AgentsOfTheirOwn()
        core, store = await _core(ha.url, fleet)
        try:
            fleet.hold.clear()  # each switch waits at QUIESCING until released
            v = await core.rollouts.create(spec(request_id="ha-1"))
            rid = v.state.rollout_id
            # n1 switches; the primary is killed as n2's switch starts
            fleet.hold.set()
            while len(fleet.executed) < 2:
                await asyncio.sleep(0.01)
            old = ha.primary_port()
            ha.server_on(old).proc.kill()
            t0 = time.monotonic()
            deadline = t0 + 20
            while True:
                try:
                    st = (await core.rollouts.get(rid)).state
                    if st.terminal:
                        break
                except Exception:  # noqa: BLE001 - Redis unavailable during the failover
                    st = None
                assert time.monotonic() < deadline, (
                    f"the rollout did not finish: {st}; executed {fleet.executed}")
                await asyncio.sleep(0.05)
            finished = time.monotonic() - t0
            assert st.status is RolloutStatus.DONE, st
            recs = [await core.get_switch(p.switch_id) for p in st.nodes]
            return st, recs, fleet, finished, old
        finally:
            await core.stop()
            await store.close()
    st, recs, fleet, finished, old = asyncio.run(go())
    assert ha.primary_port() != old
    assert st.status is RolloutStatus.DONE, st
    assert all(p.status is NodeStatus.SUCCEEDED for p in st.nodes)
    assert [n for n, _ in fleet.executed] == ["n1", "n2", "n3"]  # none twice
    assert all(r is not None and r.outcome is Outcome.SUCCEEDED for r in recs)
    assert fleet.topology == {"n1": PP2, "n2": PP2, "n3": PP2}
    print(f"rollout finished {finished:.2f} s after kill -9 of the Redis primary")
