"""The policy service end to end: Redis + controller + a node agent on vLLM CPU (TP2PP1) + the
policy service (``remp policy serve`` subprocess), with a profile in which TP2PP1 is best at
low load and TP1PP2 at high load. A ramp of real requests:

- advisory mode → a recommendation for TP1PP2 at the controller (GetState.recommendation), no
  switch;
- auto mode, same ramp → the policy calls Reconfigure (request id = its decision id) and the
  controller performs the switch (GetState shows TP1PP2).

The profile is synthetic (its capacities are scaled so the flip happens at ≈1.7 req/s, a load a
2-core CPU can offer); measured profiles come from ``remp policy profile``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remp.auth import Credentials, aio_channel
from devstack.agentproc import AgentProcess, ControllerProcess, free_port
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.policy.v1 import policy_pb2, policy_pb2_grpc
from remp.redisproc import RedisServer

pytestmark = pytest.mark.e2e

NODE = "pol-e2e"
POLICY_SERVICE = "remp.policy.v1.Policy"


def flip_profile_doc() -> dict:
    def pts(loads, t50, t90):
        return [{"load_rps": x, "ttft_p50_ms": t50, "ttft_p90_ms": t90, "tpot_p50_ms": 20,
                 "tpot_p90_ms": 25} for x in loads]
    return {
        "name": "tiny-flip-synthetic", "kind": "synthetic",
        "notes": "synthetic: TP2PP1 best below ~1.7 req/s, TP1PP2 above",
        "request": {"input_tokens": 24, "output_tokens": 4}, "switch_downtime_s": 0.2,
        "default_slo": {"ttft_ms": 100, "tpot_ms": 100},
        "topologies": {
            "TP2PP1": {"capacity_rps": 1.0, "points": pts([0, 0.5, 0.9], 40, 60)},
            "TP1PP2": {"capacity_rps": 20.0, "points": pts([0, 10, 19], 90, 180)},
        }}


class PolicyProcess:
    def __init__(self, args: list[str], log_path):
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.args, self.log_path = args, log_path

    def __enter__(self):
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "policy", "serve", "--port", str(self.port),
             *self.args], stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "REMP_LOG_FORMAT": "json"}, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            try:
                with grpc.insecure_channel(self.addr) as ch:
                    r = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=POLICY_SERVICE), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.log_path.read_text()[-3000:])

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            rc = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        assert rc == 0, self.log_path.read_text()[-3000:]


async def ramp(http: str, stop: asyncio.Event, steps=((0.5, 3.0), (1.5, 3.0), (4.0, 1e9))):
    """Poisson arrivals of short greedy completions, rate rising step by step until ``stop``."""
    rng = random.Random(7)
    tasks, i = [], 0
    async with httpx.AsyncClient(timeout=180) as c:
        t0 = time.monotonic()
        t_next = t0
        for rate, dur in steps:
            end = time.monotonic() + dur
            while not stop.is_set() and t_next < end:
                t_next += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, t_next - time.monotonic()))
                i += 1
                tasks.append(asyncio.create_task(c.post(f"{http}/v1/completions", json={
                    "model": "tiny", "prompt": f"r{i} " + " ".join(
                        f"w{rng.randrange(3, 1900)}" for _ in range(23)),
                    "max_tokens": 4, "temperature": 0.0, "ignore_eos": True})))
            if stop.is_set():
                break
        res = await asyncio.gather(*tasks, return_exceptions=True)
    bad = [r for r in res if isinstance(r, BaseException) or r.status_code != 200]
    assert not bad, bad[:3]
    return len(res)


async def until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(0.5)
    raise TimeoutError(what)


@contextlib.contextmanager
def policy_stack(tiny_model, artifacts_dir, profile: Path, node: str, name: str,
                 policy_args: list[str], decisions_in_redis: bool = False):
    """Redis, a controller, a TP2PP1 agent on vLLM CPU and ``remp policy serve`` on ``profile``
    (its log: ``<name>.log``); yields (controller, agent, policy)."""
    with RedisServer() as redis, \
            ControllerProcess(redis.url, log_dir=artifacts_dir, lease_seconds=1.5,
                              name=f"ctl-{name}") as ctl, \
            AgentProcess(tiny_model, tp=2, pp=1, log_dir=artifacts_dir, node=node,
                         extra=["--controller", ctl.addr]) as agent, \
            PolicyProcess(["--controller", ctl.addr, "--profile", str(profile),
                           *(["--redis-url", redis.url] if decisions_in_redis else []),
                           *policy_args], artifacts_dir / f"{name}.log") as pol:
        yield ctl, agent, pol


@pytest.fixture(scope="module")
def stack(tiny_model, artifacts_dir, tmp_path_factory):
    prof = tmp_path_factory.mktemp("profile") / "flip.json"
    prof.write_text(json.dumps(flip_profile_doc()))
    with policy_stack(tiny_model, artifacts_dir, prof, NODE, "policy-e2e",
                      ["--mode", "advisory", "--objective", "goodput", "--tick-seconds", "1",
                       "--window-seconds", "2", "--horizon-seconds", "10",
                       "--min-dwell-seconds", "0", "--retry-backoff-seconds", "2"],
                      decisions_in_redis=True) as s:
        yield s


async def test_advisory_then_auto_on_a_ramp(stack):
    ctl, agent, pol = stack
    creds = Credentials.load()
    async with aio_channel(ctl.addr, creds) as cch, aio_channel(pol.addr, creds) as pch:
        cstub, pstub = ctl.stub(cch), policy_pb2_grpc.PolicyStub(pch)

        async def node_state():
            return await cstub.GetState(controller_pb2.GetStateRequest(node=NODE), timeout=5)

        async def registered():
            try:
                st = await node_state()
            except grpc.aio.AioRpcError:
                return None
            return st if (st.observed.tp, st.observed.pp) == (2, 1) else None

        await until(registered, 60, "the agent never registered")

        # --- advisory: the ramp yields a recommendation and no switch
        stop = asyncio.Event()
        load = asyncio.create_task(ramp(agent.http, stop))

        async def recommended():
            st = await node_state()
            return st if st.recommendation.startswith("TP1PP2") else None
        st = await until(recommended, 60, "no TP1PP2 recommendation in advisory mode")
        await asyncio.sleep(3)  # a few more ticks at high load
        stop.set()
        assert await load > 0
        st = await node_state()
        assert (st.observed.tp, st.observed.pp) == (2, 1) and not st.HasField("current_switch")
        sw = await cstub.ListSwitches(controller_pb2.ListSwitchesRequest(node=NODE), timeout=5)
        assert not [s for s in sw.switches if s.request_id.startswith("pd-")]
        page = await pstub.ListDecisions(policy_pb2.ListDecisionsRequest(node=NODE), timeout=5)
        adv = [d for d in page.decisions if d.outcome == "recommended TP1PP2"]
        assert adv and adv[0].mode == policy_pb2.MODE_ADVISORY and not adv[0].switch_id
        r = adv[0].recommendation
        assert r.switch and (r.recommended.tp, r.recommended.pp) == (1, 2) and len(r.scores) == 2
        # the agent's heartbeats carry vLLM's per-request TPOT and TTFT (the policy's
        # calibration reads them): every finished request counted, means of a plausible size
        tr = await cstub.GetTraffic(controller_pb2.GetTrafficRequest(node=NODE), timeout=5)
        done = sum(t.requests for t in tr.samples)
        tpot_n = sum(t.tpot_requests for t in tr.samples)
        assert done > 0 and tpot_n == done, (done, tpot_n)
        assert sum(t.ttft_requests for t in tr.samples) >= done  # TTFT: at the first token
        assert 0 < sum(t.tpot_seconds_sum for t in tr.samples) / tpot_n < 10
        assert 0 < sum(t.ttft_seconds_sum for t in tr.samples) / done < 60

        # the load is over: wait until the policy no longer wants a switch, so that what auto
        # mode does below comes from the second ramp, not from the tail of the first
        async def settled():
            r = await pstub.GetRecommendation(policy_pb2.GetRecommendationRequest(node=NODE),
                                              timeout=5)
            return not r.switch
        await until(settled, 30, "the policy still wants a switch with no load")
        await until(settled, 30, "the policy still wants a switch with no load")

        # --- auto: the same ramp makes the policy call Reconfigure; the controller switches
        t_auto = time.time()
        m = await pstub.SetMode(policy_pb2.SetModeRequest(mode=policy_pb2.MODE_AUTO, node=NODE),
                                timeout=5)
        assert m.mode == policy_pb2.MODE_AUTO
        stop = asyncio.Event()
        load = asyncio.create_task(ramp(agent.http, stop))

        async def switched():
            s = await node_state()
            return s if (s.observed.tp, s.observed.pp) == (1, 2) \
                and not s.HasField("current_switch") else None
        try:
            st = await until(switched, 90, "the controller never switched to TP1PP2")
        finally:
            await pstub.SetMode(policy_pb2.SetModeRequest(mode=policy_pb2.MODE_OFF), timeout=5)
            stop.set()
            await load
        page = await pstub.ListDecisions(policy_pb2.ListDecisionsRequest(node=NODE), timeout=5)
        acted = [d for d in page.decisions if d.mode == policy_pb2.MODE_AUTO and d.switch_id]
        assert len(acted) == 1, page
        # the policy followed the switch to its outcome (it commits only a SUCCEEDED one)
        assert acted[0].outcome in (f"accepted: switch {acted[0].switch_id} succeeded",
                                    f"accepted: switch {acted[0].switch_id} still running after "
                                    f"10 s (committed when it succeeds)"), page
        assert acted[0].recommendation.at.ToNanoseconds() / 1e9 > t_auto
        rec = await cstub.GetSwitch(controller_pb2.GetSwitchRequest(
            switch_id=acted[0].switch_id), timeout=5)
        assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED
        assert rec.request_id == acted[0].id and (rec.to_topology.tp, rec.to_topology.pp) == (1, 2)
        assert acted[0].id in rec.reason
        d = agent.describe()
        assert (d.topology.tp, d.topology.pp) == (1, 2)
