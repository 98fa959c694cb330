"""The dashboard's saving (real processes: Redis, controller, ``remp policy serve --objective
gpu-hours`` and ``remp dashboard --policy``; no engine, traffic pushed as real Heartbeats):
GPU-hours each node held vs its whole host per UTC day (/api/saving and the page), and the
policy's latest recommendation with its expected saving, as the policy itself states it."""

import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from devstack.agentproc import ControllerProcess, free_port, terminate
from devstack.dashproc import DashboardProcess
from remp.auth import Credentials, Role, sync_channel
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.policy.v1 import policy_pb2, policy_pb2_grpc
from remp.redisproc import RedisServer
from tests.integration.test_controller import reg
from tests.policy_profiles import two_gpu_profile

WINDOW_S = 10.0
HISTORY_S = 750.0  # > the policy's 10-min warm-up before it releases a GPU
RATE = 0.3  # req/s: far below TP1PP1's SLO capacity (~1.5) in the synthetic profile


def serving(addr: str) -> bool:
    try:
        with grpc.insecure_channel(addr) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="remp.policy.v1.Policy"), timeout=1)
    except grpc.RpcError:
        return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


class Traffic:
    """Heartbeats of a node carrying synthetic traffic on a timeline that ends now."""

    def __init__(self, ctl, node: str, tp: int, pp: int):
        self.ctl, self.node, self.topo = ctl, node, types_pb2.Topology(tp=tp, pp=pp)
        self.at = time.time() - HISTORY_S
        self.sent, self.acc = 0, 0.0

    def push_until(self, end: float, step: float) -> None:
        with grpc.insecure_channel(self.ctl.addr) as ch:
            stub = self.ctl.stub(ch)
            while self.at + step <= end + 1e-6:
                self.at += step
                self.acc += RATE * step
                n = int(self.acc)
                self.acc -= n
                s = types_pb2.TrafficSample(window_seconds=step, requests=n)
                s.at.FromNanoseconds(int(self.at * 1e9))
                stub.Heartbeat(controller_pb2.HeartbeatRequest(node=self.node, topology=self.topo,
                                                               traffic=s), timeout=5)
                self.sent += 1


@pytest.fixture(scope="module")
def stack(artifacts_dir, tmp_path_factory):
    prof = tmp_path_factory.mktemp("saving") / "saving-test.json"
    prof.write_text(json.dumps(two_gpu_profile("saving-test").to_json()))
    with RedisServer() as redis, ControllerProcess(redis.url, log_dir=artifacts_dir,
                                                   name="ctl-saving", lease_seconds=600) as ctl:
        with grpc.insecure_channel(ctl.addr) as ch:
            ctl.stub(ch).RegisterNode(reg("big"), timeout=5)  # TP2PP1: the whole host (2 GPUs)
            ctl.stub(ch).RegisterNode(reg("small", tp=1, pp=1), timeout=5)  # 1 of its 2 GPUs
        traffic = {"big": Traffic(ctl, "big", 2, 1), "small": Traffic(ctl, "small", 1, 1)}
        now = time.time()
        for t in traffic.values():  # the history the policy reads back when it starts
            t.push_until(now, WINDOW_S)
        port = free_port()
        log_path = artifacts_dir / "policy-saving.log"
        log = open(log_path, "w")
        pol = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "policy", "serve", "--port", str(port),
             "--controller", ctl.addr, "--profile", str(prof), "--objective", "gpu-hours",
             "--mode", "advisory", "--tick-seconds", "1", "--window-seconds", str(WINDOW_S),
             "--horizon-seconds", "120", "--controller-timeout-s", "5"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "REMP_LOG_FORMAT": "json"},
            start_new_session=True)
        addr = f"127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while not serving(addr):
                assert pol.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
                time.sleep(0.2)
            with DashboardProcess(ctl.addr, artifacts_dir, policy=addr, name="dash-saving") as dash:
                yield ctl, addr, dash, traffic
        finally:
            assert terminate(pol, 30) == 0, log_path.read_text()[-2000:]
            log.close()


def saving(dash, node: str) -> dict:
    r = httpx.get(f"{dash.url}/api/saving", params={"node": node}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_gpu_hours_held_vs_the_whole_host_per_day(stack):
    ctl, _, dash, traffic = stack
    small, big = saving(dash, "small"), saving(dash, "big")
    assert (small["host_gpus"], small["gpus_now"], small["observed"]) == (2, 1, "TP1PP1")
    assert (big["host_gpus"], big["gpus_now"]) == (2, 2)
    for s, held_per_host in ((small, 0.5), (big, 1.0)):
        days = s["days"]
        assert 1 <= len(days) <= 2 and [d["day"] for d in days] == sorted(d["day"] for d in days)
        hours = sum(d["observed_hours"] for d in days)
        assert hours == pytest.approx(traffic[s["node"]].sent * WINDOW_S / 3600, rel=0.05)
        assert hours >= HISTORY_S / 3600 * 0.99
        for d in days:
            assert d["host_gpu_hours"] == pytest.approx(2 * d["observed_hours"])
            assert d["gpu_hours"] == pytest.approx(2 * held_per_host * d["observed_hours"])
            assert d["fraction"] == pytest.approx(held_per_host)
            assert d["saved_gpu_hours"] == pytest.approx(d["host_gpu_hours"] - d["gpu_hours"])
    # the page has the section the browser fills from /api/saving
    page = httpx.get(dash.url + "/", timeout=5).text
    assert 'id="saving-table"' in page and 'id="saving-recs"' in page
    assert "refreshSaving" in httpx.get(dash.url + "/static/app.js", timeout=5).text
    r = httpx.get(f"{dash.url}/api/saving", params={"node": "nope"}, timeout=10)
    assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND"
    assert httpx.get(f"{dash.url}/api/saving", params={"node": "a b"}, timeout=10).status_code == 400


def test_latest_recommendation_states_its_expected_saving(stack):
    """The whole-host node at 0.3 req/s: once the policy has seen 10 min of traffic it advises
    one GPU; the dashboard shows that recommendation's expected saving, risk and profile exactly
    as GetRecommendation states them."""
    ctl, pol_addr, dash, traffic = stack
    deadline = time.monotonic() + 90
    rec = None
    while time.monotonic() < deadline:
        for t in traffic.values():  # keep the windows coming (a gap would restart the warm-up)
            t.push_until(time.time(), 1.0)
        rec = saving(dash, "big")["recommendation"]
        if rec and rec["switch"] and rec["recommended"] == "TP1PP1":
            break
        time.sleep(1.0)
    assert rec and rec["switch"] and rec["recommended"] == "TP1PP1", rec
    assert (rec["current"], rec["gpus"], rec["host_gpus"], rec["released_gpus"]) == ("TP2PP1", 1, 2, [1])
    assert rec["objective"] == "gpu-hours" and rec["profile"] == "saving-test"
    assert rec["expected_saving_gpu_hours"] > 0 and rec["saving_horizon_s"] > 0
    assert 0 <= rec["expected_slo_loss"] <= 0.0095 and rec["decision_id"].startswith("pd-")
    with sync_channel(pol_addr, Credentials.load().only(Role.OPERATOR)) as ch:
        direct = policy_pb2_grpc.PolicyStub(ch).GetRecommendation(
            policy_pb2.GetRecommendationRequest(node="big"), timeout=5)
    if direct.decision_id == rec["decision_id"]:  # not decided again in between
        assert direct.expected_saving_gpu_hours == pytest.approx(rec["expected_saving_gpu_hours"])
        assert direct.expected_slo_loss == pytest.approx(rec["expected_slo_loss"])
    # the decision log carries the same impact (the policy section's table)
    pol = httpx.get(f"{dash.url}/api/policy", params={"node": "big"}, timeout=10).json()
    logged = {d["id"]: d for d in pol["decisions"]}
    assert any(d["impact"]["gpus"] == 1 and d["impact"]["expected_saving_gpu_hours"] > 0
               for d in logged.values()), pol["decisions"][:3]
    # the days are still there next to it
    assert saving(dash, "big")["days"]
