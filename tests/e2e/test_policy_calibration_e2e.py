"""The policy calibrates its profile from a real engine's TPOT and TTFT, end to end: Redis +
controller + a node agent on vLLM CPU (TP2PP1) + ``remp policy serve --objective gpu-hours``
(subprocess).

The profile is the one ``remp policy profile`` measured on this kind of machine
(``policy/profiles/tiny-cpu-2core.json``) with its TPOT divided by 3 — a profile that claims the
engine decodes 3x faster than it does — and its TTFT a flat 5 ms at every load (p50 = p90, so
its mean is 5 ms too), far below what the engine shows. Under Poisson load the agent's heartbeats
carry vLLM's per-request TPOT and TTFT; the policy must find the host slower than that profile
on both and decide on it taken as slower (``<profile>-calibrated<s>-ttft<t>``), with ``s`` and
``t`` what the heartbeats themselves say."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest

import policy
from remp.auth import Credentials, aio_channel
from remp.controller.v1 import controller_pb2
from remp.policy.v1 import policy_pb2, policy_pb2_grpc
from tests.e2e.test_policy_e2e import policy_stack, ramp, until

pytestmark = pytest.mark.e2e

NODE = "cal-e2e"
SPEEDUP = 3.0
CLAIMED_TTFT_MS = 5.0
NAME = re.compile(r"tiny-cpu-2core-fast-calibrated([0-9.]+)(?:-ttft([0-9.]+))?")


def fast_profile_doc() -> dict:
    doc = json.loads((Path(policy.__file__).parent / "profiles" / "tiny-cpu-2core.json").read_text())
    doc["name"] = "tiny-cpu-2core-fast"
    for t in doc["topologies"].values():
        for p in t["points"]:
            p["tpot_p50_ms"] /= SPEEDUP
            p["tpot_p90_ms"] /= SPEEDUP
            p["ttft_p50_ms"] = p["ttft_p90_ms"] = CLAIMED_TTFT_MS
    return doc


@pytest.fixture(scope="module")
def stack(tiny_model, artifacts_dir, tmp_path_factory):
    prof = tmp_path_factory.mktemp("profile") / "fast.json"
    prof.write_text(json.dumps(fast_profile_doc()))
    with policy_stack(tiny_model, artifacts_dir, prof, NODE, "policy-calibration-e2e",
                      ["--mode", "advisory", "--objective", "gpu-hours", "--tick-seconds", "1",
                       "--window-seconds", "10"]) as (ctl, agent, pol):
        yield ctl, agent, pol, prof


async def test_the_policy_finds_a_real_engine_slower_than_its_profile(stack, artifacts_dir):
    ctl, agent, pol, prof_path = stack
    creds = Credentials.load()
    async with aio_channel(ctl.addr, creds) as cch, aio_channel(pol.addr, creds) as pch:
        cstub, pstub = ctl.stub(cch), policy_pb2_grpc.PolicyStub(pch)

        async def registered():
            try:
                st = await cstub.GetState(controller_pb2.GetStateRequest(node=NODE), timeout=5)
            except Exception:  # noqa: BLE001 - not registered yet
                return None
            return st if (st.observed.tp, st.observed.pp) == (2, 1) else None

        await until(registered, 60, "the agent never registered")
        stop = asyncio.Event()
        # 3 req/s: 30 finished requests a 10-s window, so the policy may calibrate after ~4
        load = asyncio.create_task(ramp(agent.http, stop, steps=((3.0, 1e9),)))

        async def calibrated():  # both sides (the TTFT alone may be calibrated first)
            r = await pstub.GetRecommendation(
                policy_pb2.GetRecommendationRequest(node=NODE), timeout=5)
            m = NAME.fullmatch(r.profile)
            return r if m and float(m.group(1)) > 1.0 else None
        try:
            rec = await until(calibrated, 150, "the policy never calibrated its profile")
        finally:
            stop.set()
            await load
        tr = await cstub.GetTraffic(controller_pb2.GetTrafficRequest(node=NODE), timeout=5)

    m = NAME.fullmatch(rec.profile)
    s = float(m.group(1))
    t = float(m.group(2)) if m.group(2) else s  # no suffix: the TTFT's slowdown is the TPOT's
    # what the heartbeats say, independently of the policy's windows: the mean TPOT of every
    # finished request against the profile's (flat in load) TPOT
    n = sum(t.tpot_requests for t in tr.samples)
    observed_ms = sum(t.tpot_seconds_sum for t in tr.samples) / n * 1e3
    doc = json.loads(prof_path.read_text())
    claimed_ms = float(np.mean([p["tpot_p50_ms"] for p in doc["topologies"]["TP2PP1"]["points"]]))
    ratio = observed_ms / claimed_ms
    # the TTFT: the profile's is flat (its mean 5 ms at any load), so the ratio is the slowdown
    nf = sum(t.ttft_requests for t in tr.samples)
    ttft_ms = sum(t.ttft_seconds_sum for t in tr.samples) / nf * 1e3
    ttft_ratio = ttft_ms / CLAIMED_TTFT_MS
    (artifacts_dir / "policy-calibration-e2e.json").write_text(json.dumps(dict(
        calibrated=s, observed_tpot_ms=observed_ms, profile_tpot_ms=claimed_ms, requests=n,
        measured_profile_tpot_ms=claimed_ms * SPEEDUP, calibrated_ttft=t,
        observed_ttft_ms=ttft_ms, profile_ttft_ms=CLAIMED_TTFT_MS, ttft_requests=nf,
        profile=rec.profile)))
    assert ratio > 1.5, (observed_ms, claimed_ms)  # the profile really is optimistic here
    assert s == pytest.approx(min(ratio, 4.0), rel=0.25), (s, ratio, observed_ms)
    assert rec.objective == "gpu-hours" and s >= 1.5
    assert ttft_ratio > 1.5, (ttft_ms, CLAIMED_TTFT_MS)
    # the TPOT's slowdown is the TTFT's floor (policy/calibrate.py): where this host's decode is
    # slower against its profile than its TTFT is (CI's 2 cores at times: s 3.675, TTFT 2.81x),
    # the TTFT is taken s x slower, not 2.81x
    assert t == pytest.approx(max(s, min(ttft_ratio, 4.0)), rel=0.3), (t, s, ttft_ratio, ttft_ms)
