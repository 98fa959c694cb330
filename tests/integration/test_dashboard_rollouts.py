"""The dashboard's rollout view (issue 17) against a real `remp dashboard` process, a real
Controller (its core, servicer, event hub and gRPC server on loopback, in a thread of this
process) and a real redis-server; the agents are simulated at the controller's AgentPort
boundary (tests/unit/test_rollout_store.Fleet, as the rollout driver's own tests do: each switch
can be held at QUIESCING). A rollout created through the Rollout RPC shows in the list and the
detail, its events reach the browser's event stream, pause / resume / abort go through the
dashboard's login and CSRF guard to ControlRollout (the controller's refusals shown as it gave
them), and ids from the URL or the body are checked before any call."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import grpc
import httpx
import pytest

from controller.config import ControllerSettings
from controller.core import Controller
from controller.server import SERVICE_NAME
from controller.servicer import ControllerServicer
from controller.store import Store
from controller.watch import EventHub
from devstack.dashproc import CSRF, DashboardProcess
from remp.auth import Credentials, Role, intercept
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.grpc_util import make_server, set_serving
from remp.redisproc import RedisServer
from tests.unit.test_rollout_store import CAP, TP2, Fleet, registration

NODES = ("n1", "n2", "n3")


class InProcessController:
    """The real controller on a loopback port, its own event loop in a thread; ``fleet`` the
    simulated agents (``hold()`` / ``release()``: switches wait at QUIESCING or go on)."""

    def __init__(self, redis_url: str):
        self.redis_url = redis_url

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> "InProcessController":
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="controller",
                                       daemon=True)
        self.thread.start()
        self.addr = self.call(self._start())
        return self

    async def _start(self) -> str:
        prefix = f"t-dash-ro-{uuid.uuid4().hex[:8]}:"
        self.fleet = Fleet()
        s = ControllerSettings(lease_seconds=600.0)  # the nodes never heartbeat
        self.store = Store(self.redis_url, prefix)
        self.events = Store(self.redis_url, prefix, max_connections=2, lane="events")
        self.core = Controller(s, self.store, self.fleet,
                               hub=EventHub(self.events, s.watch_queue_events))
        for n in NODES:
            self.fleet.topology[n] = TP2
            await self.core.register(registration(n, TP2, (("zone", "a"),)))
        self.server, health, port = make_server([SERVICE_NAME], "127.0.0.1", 0,
                                                auth=Credentials.load())
        controller_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(self.core),
                                                             self.server)
        await self.server.start()
        await self.core.start()
        await set_serving(health, [SERVICE_NAME], True)
        return f"127.0.0.1:{port}"

    async def _stop(self) -> None:
        self.fleet.hold.set()
        await self.server.stop(0)
        await self.core.stop()
        await self.store.close()
        await self.events.close()

    def __exit__(self, *exc) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    def hold(self) -> None:
        self.loop.call_soon_threadsafe(self.fleet.hold.clear)

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.fleet.hold.set)

    def stub(self, ch: grpc.Channel):
        return controller_pb2_grpc.ControllerStub(intercept(ch, Credentials.load()))

    def rollout(self, request_id: str) -> controller_pb2.RolloutState:
        with grpc.insecure_channel(self.addr) as ch:
            return self.stub(ch).Rollout(controller_pb2.RolloutRequest(
                nodes=list(NODES), target=types_pb2.Topology(tp=1, pp=2), capacity_floor=0.5,
                max_parallel=3, capacity_rps=CAP, request_id=request_id,
                reason="dashboard test"), timeout=10).rollout

    def get(self, rid: str) -> controller_pb2.RolloutState:
        with grpc.insecure_channel(self.addr) as ch:
            return self.stub(ch).GetRollout(controller_pb2.GetRolloutRequest(rollout_id=rid),
                                            timeout=10)


@pytest.fixture(scope="module")
def ctl():
    with RedisServer() as r, InProcessController(r.url) as c:
        yield c


@pytest.fixture(scope="module")
def dash(ctl, artifacts_dir):
    with DashboardProcess(ctl.addr, artifacts_dir, name="dash-rollouts") as d:
        yield d


@pytest.fixture(scope="module")
def op(dash):
    with dash.login() as c:
        yield c


@pytest.fixture(scope="module")
def rid(ctl, dash):
    """A rollout n1 → n2 → n3 (TP2PP1 → TP1PP2, floor 0.5: three waves of one), n1's switch
    held at QUIESCING."""
    ctl.hold()
    return ctl.rollout("dash-ro-1").rollout_id


def until(fn, what: str, timeout: float = 30.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def detail(dash, rid: str) -> dict:
    r = httpx.get(f"{dash.url}/api/rollouts/{rid}", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def status_is(dash, rid: str, status: str):
    return lambda: (v := detail(dash, rid))["status"] == status and v


class Listener:
    """A browser's /api/events stream in a thread: every data event, parsed."""

    def __init__(self, url: str):
        self.got: list[dict] = []
        self.open = threading.Event()
        self.stop = False
        self.t = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.t.start()
        assert self.open.wait(15), "the event stream did not open"

    def _run(self, url: str) -> None:
        try:
            with httpx.stream("GET", url, timeout=60) as r:
                if r.headers["content-type"].startswith("text/event-stream"):
                    self.open.set()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.got.append(json.loads(line[6:]))
                    if self.stop:
                        return
        except httpx.HTTPError:  # the dashboard stopped at the end of the module
            pass

    def rollout_events(self, rid: str) -> list[dict]:
        return [e for e in self.got if e["rollout_id"] == rid]


def test_list_and_detail_show_a_rollout_created_through_the_controller(dash, ctl, rid):
    v = until(lambda: (d := detail(dash, rid))["progress"]["switching"] == 1 and d,
              "n1's switch to start")
    assert (v["status"], v["target"], v["floor"], v["max_parallel"]) == \
        ("running", "TP1PP2", 0.5, 3)
    assert v["nodes_in_set"] == list(NODES) and v["description"] == "dashboard test"
    assert [w["nodes"] for w in v["waves"]] == [["n1"], ["n2"], ["n3"]]
    assert (v["base_capacity"], v["required_capacity"]) == (27.0, 13.5)
    assert v["capacity_now"] == 18.0  # n2 and n3 at TP2PP1; n1 switching counts 0
    assert v["progress"] == {"waves_done": 0, "waves": 3, "switched": 0, "failed": 0,
                             "switching": 1, "pending": 2}
    n1 = v["nodes"][0]
    assert (n1["node"], n1["status"]) == ("n1", "switching") and n1["switch_id"]
    # the switch id leads to the record the dashboard shows
    sw = httpx.get(f"{dash.url}/api/switch", params={"id": n1["switch_id"]}, timeout=10).json()
    assert (sw["node"], sw["to"], sw["outcome"]) == ("n1", "TP1PP2", "running")
    assert sw["request_id"] == f"rollout:{rid}:n1"

    rows = httpx.get(f"{dash.url}/api/rollouts", timeout=10).json()["rollouts"]
    row = {r["rollout_id"]: r for r in rows}[rid]
    assert (row["status"], row["target"], row["nodes_in_set"], row["progress"]) == \
        ("running", "TP1PP2", list(NODES), v["progress"])
    assert "capacity_now" not in row and "nodes" not in row  # the list: no per-node detail
    active = httpx.get(f"{dash.url}/api/rollouts?active=1", timeout=10).json()["rollouts"]
    assert [r["rollout_id"] for r in active] == [rid]
    # the page has the section and the script that fills it
    assert 'id="rollouts"' in httpx.get(dash.url + "/", timeout=10).text
    js = httpx.get(dash.url + "/static/app.js", timeout=10).text
    assert "/api/control-rollout" in js and "/api/rollouts/" in js


def test_the_event_stream_carries_rollout_events(dash, ctl, rid, op):
    everything = Listener(dash.url + "/api/events")
    only = Listener(f"{dash.url}/api/events?rollout={rid}")
    try:
        time.sleep(1.5)  # the dashboard's one Watch is subscribed (it starts at the newest)
        with grpc.insecure_channel(ctl.addr) as ch:  # an event of no rollout
            ctl.stub(ch).RecordRecommendation(controller_pb2.RecordRecommendationRequest(
                node="n3", recommended=types_pb2.Topology(tp=2, pp=1), reason="stay",
                decision_id="pd-ro-1"), timeout=10)
        r = op.post("/api/control-rollout", json={"rollout_id": rid, "action": "pause",
                                                  "reason": "a look at n1 first"})
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["pause_requested"]) == ("running", True)
        ev = until(lambda: everything.rollout_events(rid), "the rollout event on the stream")[0]
        assert ev["type"] == "rollout_progress" and ev["id"]
        until(lambda: only.rollout_events(rid), "the rollout event on the filtered stream")
        until(lambda: any(e["type"] == "recommendation" for e in everything.got),
              "the recommendation on the unfiltered stream")
        assert all(e["rollout_id"] == rid for e in only.got)  # the filter
    finally:
        everything.stop = only.stop = True


def test_control_is_refused_without_login_or_with_another_role(dash, ctl, rid):
    before = ctl.get(rid).version
    body = {"rollout_id": rid, "action": "abort"}
    with httpx.Client(base_url=dash.url, timeout=10, headers=CSRF) as c:
        r = c.post("/api/control-rollout", json=body)
        assert r.status_code == 401 and r.json()["code"] == "UNAUTHENTICATED"
        tokens = Credentials.load().tokens
        # the policy's token may call ControlRollout at the controller, but is no dashboard
        # login (only the operator's is, as for /api/reconfigure)
        for role in (Role.POLICY, Role.AGENT, Role.CONTROLLER):
            r = c.post("/api/login", json={"token": tokens[role]})
            assert r.status_code == 401 and "set-cookie" not in r.headers
            assert c.post("/api/control-rollout", json=body).status_code == 401
    with dash.login() as c:  # logged in, but a request no page of ours sends
        assert c.post("/api/control-rollout", json=body,
                      headers={"x-remp-dashboard": "0"}).status_code == 403
        assert c.post("/api/control-rollout", data=body).status_code == 403
        assert c.post("/api/control-rollout", json=body,
                      headers={"origin": "http://evil.example"}).status_code == 403
    after = ctl.get(rid)
    assert after.version == before and not after.abort_requested


def test_pause_resume_abort_through_the_dashboard(dash, ctl, rid, op):
    def control(action: str) -> httpx.Response:
        return op.post("/api/control-rollout", json={"rollout_id": rid, "action": action})

    # paused (asked in the previous test) once n1's wave finishes
    ctl.release()
    v = until(status_is(dash, rid, "paused"), "PAUSED after wave 0")
    assert v["progress"]["switched"] == 1 and v["progress"]["waves_done"] == 1
    assert v["reason"] == "a look at n1 first"
    assert v["capacity_now"] == 28.0  # n1 at TP1PP2 (10), n2 and n3 at TP2PP1 (9 each)
    assert control("pause").json()["status"] == "paused"  # already: unchanged
    ctl.hold()
    r = control("resume")
    assert r.status_code == 200 and r.json()["status"] == "running"
    v = until(lambda: (d := detail(dash, rid))["nodes"][1]["status"] == "switching" and d,
              "n2's switch to start")
    assert v["wave"] == 1
    r = control("abort")  # n2 is at QUIESCING: its switch is aborted, nothing further starts
    assert r.status_code == 200 and r.json()["abort_requested"] is True
    ctl.release()
    v = until(status_is(dash, rid, "aborted"), "ABORTED")
    assert [n["status"] for n in v["nodes"]] == ["succeeded", "rolled_back", "pending"]
    assert v["progress"] == {"waves_done": 2, "waves": 3, "switched": 1, "failed": 1,
                             "switching": 0, "pending": 1}
    # refused by the controller: its code and text, as it gave them
    r = control("resume")
    assert r.status_code == 409 and r.json()["code"] == "FAILED_PRECONDITION"
    assert "resume" in r.json()["error"] and "aborted" in r.json()["error"].lower()
    r = op.post("/api/control-rollout", json={"rollout_id": "ro-000000000000",
                                              "action": "pause"})
    assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND"
    assert httpx.get(f"{dash.url}/api/rollouts?active=1", timeout=10).json()["rollouts"] == []


BAD_IDS = ["-ro", "a" * 129, "a b", "ro%3B1%22", "%00", "ro:1%0A", "ro%E2%80%A8"]


def test_bad_ids_are_400(dash, op):
    for bad in BAD_IDS:
        r = httpx.get(f"{dash.url}/api/rollouts/{bad}", timeout=10)
        assert r.status_code == 400 and r.json()["code"] == "INVALID_ARGUMENT", (bad, r.text)
        r = httpx.get(f"{dash.url}/api/events?rollout={bad}", timeout=10)
        assert r.status_code == 400, bad
        r = httpx.get(f"{dash.url}/api/switch?id={bad}", timeout=10)
        assert r.status_code == 400, bad
    assert httpx.get(f"{dash.url}/api/rollouts/{'a' * 10_000}", timeout=10).status_code == 400
    assert httpx.get(f"{dash.url}/api/switch", timeout=10).status_code == 400
    assert httpx.get(f"{dash.url}/api/rollouts?active=yes", timeout=10).status_code == 400
    r = httpx.get(f"{dash.url}/api/rollouts/ro-000000000000", timeout=10)
    assert r.status_code == 404 and r.json()["code"] == "NOT_FOUND"
    for body in ({"rollout_id": "-ro", "action": "pause"}, {"rollout_id": 42, "action": "pause"},
                 {"action": "pause"}, {"rollout_id": "a" * 129, "action": "abort"},
                 {"rollout_id": "ro-1", "action": "restart"}, {"rollout_id": "ro-1"},
                 {"rollout_id": "ro-1", "action": "pause", "reason": "two\nlines"},
                 {"rollout_id": "ro-1", "action": "pause", "reason": "x" * 501}):
        r = op.post("/api/control-rollout", json=body)
        assert r.status_code == 400 and r.json()["code"] == "INVALID_ARGUMENT", (body, r.text)
