"""The dashboard (real `remp dashboard` process) over a real controller and Redis, no engine:
the JSON API, the event stream (SSE from Controller.Watch), the approve/reconfigure guard (after
an operator login), and the controller's /metrics (RPCs by code, Redis errors). The web security
(login, sessions, Host allowlist, CSP, input bounds) is in test_dashboard_security.py; switches
through a real agent, in a browser, are in tests/e2e/test_dashboard_e2e.py."""

import json
import threading
import time

import grpc
import httpx
import pytest

from devstack.agentproc import ControllerProcess, free_port
from remp.auth import Credentials, Role, digest
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from devstack.dashproc import DashboardProcess
from remp.redisproc import RedisServer
from tests.integration.test_controller import reg

H = {"x-remp-dashboard": "1"}


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as r:
        yield r


@pytest.fixture(scope="module")
def ctl(redis_server, artifacts_dir):
    # d1 never heartbeats: a lease longer than the module keeps it from being marked lost on a
    # slow machine (seen: the no-op Reconfigure answered UNAVAILABLE "node is lost")
    c = ControllerProcess(redis_server.url, log_dir=artifacts_dir, name="ctl-dashboard",
                          lease_seconds=600,
                          env={"REMP_CONTROLLER_METRICS_PORT": str(free_port())})
    c.metrics_url = f"http://127.0.0.1:{c.env['REMP_CONTROLLER_METRICS_PORT']}/metrics"
    with c:
        with grpc.insecure_channel(c.addr) as ch:
            c.stub(ch).RegisterNode(reg("d1"), timeout=5)
        yield c


@pytest.fixture(scope="module")
def dash(ctl, artifacts_dir):
    with DashboardProcess(ctl.addr, artifacts_dir, name="dash-int") as d:
        yield d


@pytest.fixture(scope="module")
def op(dash):
    """A client logged in with the operator token (sends the CSRF header)."""
    with dash.login() as c:
        yield c


def recommend(ctl, node, tp, pp, reason):
    with grpc.insecure_channel(ctl.addr) as ch:
        ctl.stub(ch).RecordRecommendation(controller_pb2.RecordRecommendationRequest(
            node=node, recommended=types_pb2.Topology(tp=tp, pp=pp), reason=reason,
            decision_id="pd-1"), timeout=5)


def test_page_and_config(dash):
    r = httpx.get(dash.url + "/", timeout=5)
    assert r.status_code == 200 and "/static/app.js" in r.text
    assert "cdn" not in r.text.lower() and "https://" not in r.text
    assert httpx.get(dash.url + "/static/app.js", timeout=5).status_code == 200
    cfg = httpx.get(dash.url + "/api/config", timeout=5).json()
    assert cfg["writes_enabled"] is True and cfg["can_write"] is False and cfg["policy"] == ""
    assert httpx.get(dash.url + "/healthz", timeout=5).json() == {"ok": True}
    assert httpx.get(dash.url + "/api/policy?node=d1", timeout=5).status_code == 404


def test_nodes_show_topology_health_lease_and_recommendation(dash, ctl):
    recommend(ctl, "d1", 1, 2, "load 3.1 req/s above TP2PP1's capacity")
    n = {x["node"]: x for x in httpx.get(dash.url + "/api/nodes", timeout=5).json()["nodes"]}["d1"]
    assert (n["observed"], n["desired"], n["health"]) == ("TP2PP1", "TP2PP1", "ready")
    assert 0 <= n["lease_age_s"] < 30 and n["candidates"] == ["TP1PP1", "TP2PP1", "TP1PP2"]
    assert n["recommended_target"] == "TP1PP2" and "capacity" in n["recommendation"]


def test_event_stream_follows_watch(dash, ctl):
    got: list[dict] = []
    ready = threading.Event()

    def listen():
        with httpx.stream("GET", dash.url + "/api/events", timeout=30) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            ready.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))
                    return
    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert ready.wait(10)
    time.sleep(1.5)  # the dashboard's Watch is subscribed (Watch starts at the newest event)
    recommend(ctl, "d1", 1, 2, "sse check")
    t.join(20)
    assert got and got[0]["type"] == "recommendation" and got[0]["node"] == "d1"
    assert "sse check" in got[0]["detail"]


def test_reconfigure_needs_the_header_and_maps_errors(dash, op):
    url = "/api/reconfigure"
    body = {"node": "d1", "target": "TP2PP1"}
    assert op.get("/api/config").json()["can_write"] is True
    # logged in, but no CSRF header / not JSON
    assert op.post(url, json=body, headers={"x-remp-dashboard": "0"}).status_code == 403
    assert op.post(url, data={"node": "d1"}).status_code == 403
    r = op.post(url, json={"node": "d1", "target": "bogus"})
    assert r.status_code == 400
    r = op.post(url, json={"node": "nope", "target": "TP1PP2"})
    assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND"
    # the agent is fake: accepted at once, rolled back by the controller's background check
    r = op.post(url, json={"node": "d1", "target": "TP1PP2"})
    assert r.status_code == 200 and r.json()["switch_id"], r.text
    sid, deadline = r.json()["switch_id"], time.monotonic() + 30
    while not any(s["switch_id"] == sid and s["outcome"] == "rolled_back" for s in
                  httpx.get(dash.url + "/api/switches", timeout=5).json()["switches"]):
        assert time.monotonic() < deadline, "the fake agent's switch did not end rolled back"
        time.sleep(0.05)
    r = op.post(url, json={**body, "request_id": "dash-noop-1"})
    assert r.status_code == 200 and r.json()["noop"] is True
    sw = httpx.get(dash.url + "/api/switches", timeout=5).json()["switches"]
    assert any(s["request_id"] == "dash-noop-1" and s["outcome"] == "noop" for s in sw)


def test_read_only_without_an_operator_token(ctl, artifacts_dir, tmp_path):
    """Credentials that can verify the operator but hold no operator token to act with: the
    dashboard serves reads and refuses logins (it could not act on them)."""
    full = Credentials.load()
    verify_only = full.only(Role.AGENT)  # the agent token only ...
    path = verify_only.write(tmp_path / "verify-only.json")
    env = {"REMP_CREDENTIALS_FILE": str(path),  # ... plus the operator's digest
           "REMP_TOKEN_OPERATOR": "sha256:" + digest(full.tokens[Role.OPERATOR]).hex()}
    with DashboardProcess(ctl.addr, artifacts_dir, name="dash-ro", env=env) as d:
        cfg = httpx.get(d.url + "/api/config", timeout=5).json()
        assert cfg["writes_enabled"] is False and cfg["can_write"] is False
        r = httpx.post(d.url + "/api/login", json={"token": d.operator_token()}, headers=H,
                       timeout=10)
        assert r.status_code == 403 and r.json()["code"] == "READ_ONLY"
        assert "set-cookie" not in r.headers
        r = httpx.post(d.url + "/api/reconfigure", json={"node": "d1", "target": "TP2PP1"},
                       headers=H, timeout=10)
        assert r.status_code == 403 and r.json()["code"] == "READ_ONLY"
        assert httpx.get(d.url + "/api/nodes", timeout=5).status_code == 200
        assert d.stop() == 0


def test_controller_metrics_count_rpcs_and_redis_errors(dash, ctl, redis_server):
    text = httpx.get(ctl.metrics_url, timeout=5).text
    assert 'remp_controller_rpcs_total{code="OK",method="RegisterNode"}' in text
    assert 'remp_controller_rpc_errors_total{code="NOT_FOUND",method="Reconfigure"}' in text
    assert "# TYPE remp_controller_switch_phase_seconds histogram" in text
    redis_server.stop()  # last test of the module: Redis goes away
    with grpc.insecure_channel(ctl.addr) as ch:
        with pytest.raises(grpc.RpcError):
            ctl.stub(ch).Heartbeat(controller_pb2.HeartbeatRequest(node="d1"), timeout=10)
    text = httpx.get(ctl.metrics_url, timeout=5).text
    assert 'remp_controller_redis_errors_total{op="heartbeat"}' in text
    r = httpx.get(dash.url + "/api/nodes", timeout=10)  # served stale from the controller's cache
    assert r.status_code == 200 and r.json()["nodes"][0]["stale"] is True
