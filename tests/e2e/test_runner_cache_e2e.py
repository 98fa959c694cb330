"""--cache-runners: a switch back to a topology the engine already served reuses that topology's
model runner (weights kept, KV and requests rebound) instead of building one — token-exact with
requests mid-decode, no weight bytes moved on a revisit, and a revisit that fails rolls back with
the cached runner kept for the next one."""

import asyncio
import itertools

import httpx
import pytest

from remp.common.v1 import types_pb2
from tests.helpers import LONG_CONTEXT, AgentProcess, prompt, stream_completion, switch_under_load

pytestmark = pytest.mark.e2e

PROMPTS = [prompt(40 + i, 140) for i in range(2)]
MAX_TOKENS = 600
_ids = itertools.count()


@pytest.fixture(scope="module")
def agent(tiny_model, artifacts_dir, reaper):
    a = AgentProcess(tiny_model, tp=2, pp=1, dtype="float32", log_dir=artifacts_dir,
                     node="e2e-runner-cache", env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"},
                     extra=["--cache-runners", "--no-warm-up-candidates",
                            "--max-model-len", str(LONG_CONTEXT)])
    a.start().wait_ready()
    yield a
    reaper.stop(a)


def run(agent, tp, pp, **kw):
    return asyncio.run(switch_under_load(agent, tp, pp, PROMPTS, MAX_TOKENS,
                                         switch_id=f"rc-{next(_ids)}", **kw))


def test_revisits_reuse_the_runner_token_exact(agent):
    async def ref():
        async with httpx.AsyncClient(timeout=300) as c:
            return list(await asyncio.gather(*(stream_completion(c, agent.http, p, MAX_TOKENS)
                                               for p in PROMPTS)))
    reference = asyncio.run(ref())
    # (target, runner built this time): TP1PP2 and TP1PP1 are new once; TP2PP1 is the start's
    route = [((1, 2), True), ((2, 1), False), ((1, 2), False), ((1, 1), True), ((2, 1), False),
             ((1, 1), False), ((1, 2), False)]
    for (tp, pp), built in route:
        outs, _, _, rec = run(agent, tp, pp)
        frm = f"TP{rec.from_topology.tp}PP{rec.from_topology.pp}"
        assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED, rec.error.message
        assert outs == reference, f"{frm} → TP{tp}PP{pp} changed the tokens"
        assert rec.requests_in_flight == len(PROMPTS) and rec.requests_preempted == 0
        if built:
            assert rec.weight_bytes_loaded > 0, f"{frm} → TP{tp}PP{pp}"
        else:
            assert rec.weight_bytes_loaded == rec.weight_bytes_from_store == 0, \
                f"{frm} → TP{tp}PP{pp} built a runner it had"
        print(f"{frm}→TP{tp}PP{pp}: downtime {rec.downtime_seconds * 1e3:.0f} ms, "
              f"weights {rec.weight_bytes_loaded} B")


def test_a_failed_revisit_keeps_the_cached_runner(agent):
    cur = agent.describe().topology
    target = (2, 1) if (cur.tp, cur.pp) != (2, 1) else (1, 2)
    _, _, _, rec = run(agent, *target, fail_at_phase=types_pb2.PHASE_REBINDING)
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_ROLLED_BACK
    assert rec.weight_bytes_loaded == 0  # it had taken the cached runner, then rolled back
    _, _, _, rec = run(agent, *target)
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED, rec.error.message
    assert rec.weight_bytes_loaded == 0  # the same runner, back from the cache
