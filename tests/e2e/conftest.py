"""Engines shared by several e2e modules: each start of a real vLLM engine costs 40-90 s on a
2-core CI machine (mostly three processes each importing torch and vLLM, one core each), so an
agent that no test changes is started once per session, and a module that needs several
engines starts them at once rather than one after another."""

import pytest

from devstack.agentproc import AgentProcess
from tests.helpers import LONG_CONTEXT


class Reaper:
    """Agents a module is done with, stopped in the background: the next module's engines start
    while they shut down (≈ 6 s each, mostly vLLM's engine core waiting for its workers). Where
    a module checked its agents' exit — code 0, nothing left running — the check runs when the
    session ends, with the agent's log tail; every stop is waited for then."""

    def __init__(self):
        self.stops = []

    def stop(self, *agents: AgentProcess, check: bool = True) -> None:
        for a in agents:
            self.stops.append((a, check, a.stop_in_background()))

    def finish(self) -> None:
        bad = []
        for a, check, fut in self.stops:
            rc, orphans = fut.result(timeout=180)
            if check and (rc != 0 or orphans):
                bad.append(f"agent {a.node}: exit {rc}, left running {orphans}\n{a.log_tail()}")
        assert not bad, "\n\n".join(bad)


@pytest.fixture(scope="session")
def reaper():
    r = Reaper()
    yield r
    r.finish()


def _started(a: AgentProcess):
    """A session agent's life: started (not waited for), then stopped with exit code 0 and
    nothing left running (a second stop, after a module stopped it, is a no-op)."""
    a.start()
    yield a
    rc, orphans = a.stop()
    assert rc == 0 and not orphans, a.log_tail()


@pytest.fixture(scope="session")
def plain_tp1_started(tiny_model, artifacts_dir):
    """TP1PP1 fp32 on plain vLLM (``--no-switching``: started natively on one worker, no world
    changes, no warm-up visits), started but not yet waited for: test_agent_e2e asks for it when
    it starts its own engines, so that the starts overlap. Tests use ``plain_tp1_agent``."""
    yield from _started(AgentProcess(tiny_model, tp=1, pp=1, dtype="float32",
                                     log_dir=artifacts_dir, node="e2e-plain-tp1",
                                     extra=["--no-switching"]))


@pytest.fixture(scope="session")
def plain_tp1_agent(plain_tp1_started):
    """The plain TP1PP1 agent, ready. Read-only for its users (completions, ``remp profile``):
    test_agent_e2e (the native TP1PP1 outputs) and test_prefill_profile_e2e."""
    return plain_tp1_started.wait_ready()


@pytest.fixture(scope="session")
def tp2_started(tiny_model, artifacts_dir):
    """TP2PP1 fp32 with the fault-injection service (its start gate and faults), started but not
    yet waited for: test_agent_e2e observes its start (health before ready) and reads its facts
    while it still serves its native topology; test_switch_e2e then switches it, over and over.
    One engine for both (a start is 40-90 s on 2 cores); test_switch_e2e stops it when it ends
    (files run in name order: test_agent_e2e first). Tests use ``tp2_agent``."""
    yield from _started(AgentProcess(tiny_model, tp=2, pp=1, dtype="float32",
                                     log_dir=artifacts_dir, node="e2e-tp2",
                                     env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"},
                                     # switches reshard weights peer to peer and check
                                     # every new shard against the store before commit
                                     extra=["--max-model-len", str(LONG_CONTEXT),
                                            "--weight-reshard", "p2p", "--verify-weights"],
                                     # test_switch_e2e holds the peak extra KV memory of a
                                     # switch to one layer + 10 %: the executor's fixed
                                     # staging (~7 MB) needs layers of ≥ 70 MB for that
                                     kv_cache_gib=0.25))


@pytest.fixture(scope="session")
def tp2_agent(tp2_started):
    return tp2_started.wait_ready()
