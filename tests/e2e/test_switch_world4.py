"""World size 4 (4 workers on the CPU): all 6 ordered pairs of TP4PP1, TP2PP2, TP1PP4, in place,
requests mid-decode, token-exact against an uninterrupted run; the weights resharded peer to peer
(--weight-reshard p2p: nothing read from the host store) and every new shard checked bit for bit
against the store before commit (--verify-weights)."""

import asyncio

import httpx
import pytest

from remp.common.v1 import types_pb2
from tests.helpers import AgentProcess, prompt, stream_completion, switch_under_load

pytestmark = pytest.mark.e2e

PROMPTS = [prompt(i, 140) for i in range(2)]
MAX_TOKENS = 64  # the agent's start gate switches with both mid-decode; 64 outlast the switch
# A→B→C→A→C→B→A visits every ordered pair of {A, B, C} exactly once
ROUTE = [(2, 2), (4, 1), (1, 4), (2, 2), (1, 4), (4, 1), (2, 2)]


def test_all_six_pairs_token_exact(tiny_model, artifacts_dir, reaper):
    a = AgentProcess(tiny_model, tp=2, pp=2, dtype="float32", log_dir=artifacts_dir,
                     node="e2e-world4",
                     extra=["--devices", "4", "--weight-reshard", "p2p", "--verify-weights"],
                     env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"})
    a.start().wait_ready()
    try:
        async def ref():
            async with httpx.AsyncClient(timeout=600) as c:
                return list(await asyncio.gather(*(stream_completion(c, a.http, p, MAX_TOKENS)
                                                   for p in PROMPTS)))
        reference = asyncio.run(ref())
        pairs = []
        for i, (tp, pp) in enumerate(ROUTE[1:]):
            outs, _, _, rec = asyncio.run(
                switch_under_load(a, tp, pp, PROMPTS, MAX_TOKENS, switch_id=f"w4-{i}"))
            frm = (rec.from_topology.tp, rec.from_topology.pp)
            pairs.append((frm, (tp, pp)))
            assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED, rec.error.message
            assert rec.requests_in_flight == len(PROMPTS) and rec.requests_preempted == 0
            assert outs == reference, f"TP{frm[0]}PP{frm[1]} → TP{tp}PP{pp} changed the tokens"
            assert rec.weight_bytes_from_store == 0 and rec.weight_bytes_peer > 0
            assert rec.weight_bytes_verified == rec.weight_bytes_loaded > 0
            print(f"TP{frm[0]}PP{frm[1]}→TP{tp}PP{pp}: total {rec.total_seconds:.2f}s "
                  f"downtime {rec.downtime_seconds:.2f}s kv {rec.kv_bytes_moved} B "
                  f"weights from peers {rec.weight_bytes_peer} B")
        assert len(set(pairs)) == 6
        d = a.describe()
        assert (d.topology.tp, d.topology.pp) == ROUTE[-1] and len(d.workers) == 4
    finally:
        reaper.stop(a, check=False)
