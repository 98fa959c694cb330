"""A world that does not divide the engine's, with pipeline stages that do not divide the layers: a
10-layer tiny Llama on 4 CPU workers, switched in place with requests mid-decode TP2PP2 (stages of
5 and 5 layers) → TP1PP3 (world 3, rank 3 STANDBY; stages 3, 4, 3 — vLLM's layout) → TP1PP4
(stages 2, 3, 3, 2; rank 3 wakes) → TP2PP2, token-exact in fp32 against an uninterrupted run,
the weights resharded peer to peer (nothing read from the host store) and every new shard
checked bit for bit. (On 8 GPUs the same paths give an 80-layer model TP1PP5, and a 32- or
80-layer one TP1PP3, TP2PP3 and TP1PP7.)"""

import asyncio

import httpx
import pytest

from devstack.modelgen import TinyLlamaSpec, make_model
from remp.common.v1 import types_pb2
from tests.helpers import AgentProcess, prompt, stream_completion, switch_under_load

pytestmark = pytest.mark.e2e

PROMPTS = [prompt(i, 140) for i in range(2)]
MAX_TOKENS = 64
ROUTE = [(2, 2), (1, 3), (1, 4), (2, 2)]


def test_world_three_on_four_workers_token_exact(tmp_path_factory, artifacts_dir, reaper):
    model = make_model(tmp_path_factory.mktemp("model10") / "tiny-llama-10l",
                       TinyLlamaSpec(num_layers=10))
    a = AgentProcess(model, tp=2, pp=2, dtype="float32", log_dir=artifacts_dir, node="e2e-world3",
                     extra=["--devices", "4", "--weight-reshard", "p2p", "--verify-weights"],
                     env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"})
    a.start().wait_ready()
    try:
        d = a.describe()
        assert (1, 3) in {(c.tp, c.pp) for c in d.candidates}

        async def ref():
            async with httpx.AsyncClient(timeout=600) as c:
                return list(await asyncio.gather(*(stream_completion(c, a.http, p, MAX_TOKENS)
                                                   for p in PROMPTS)))
        reference = asyncio.run(ref())
        for i, (tp, pp) in enumerate(ROUTE[1:]):
            outs, _, _, rec = asyncio.run(
                switch_under_load(a, tp, pp, PROMPTS, MAX_TOKENS, switch_id=f"w3-{i}"))
            assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED, rec.error.message
            assert rec.requests_in_flight == len(PROMPTS) and rec.requests_preempted == 0
            assert outs == reference, f"→ TP{tp}PP{pp} changed the tokens"
            assert rec.weight_bytes_from_store == 0 and rec.weight_bytes_peer > 0
            assert rec.weight_bytes_verified == rec.weight_bytes_loaded > 0
            d = a.describe()
            assert (d.topology.tp, d.topology.pp) == (tp, pp) and len(d.workers) == 4
            standby = sorted(w.rank for w in d.workers if w.state == types_pb2.WORKER_STATE_STANDBY)
            assert standby == ([3] if tp * pp == 3 else []), standby
            print(f"→TP{tp}PP{pp}: total {rec.total_seconds:.2f}s downtime {rec.downtime_seconds:.2f}s "
                  f"kv {rec.kv_bytes_moved} B parked {list(rec.ranks_parked)}")
    finally:
        reaper.stop(a, check=False)
