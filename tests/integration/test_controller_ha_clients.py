"""The clients of a controller group (issue 17; remp/controllers.py): Watch resumes from the last
event id (``WatchRequest.after_id``) with nothing lost or repeated, across a kill -9 of the
controller it was on; the CLI's and the dashboard's writes reach the leader when pointed at a
follower first. Two real controller processes (leader lease on) on one real Redis; real gRPC
over loopback; no agent (nodes registered with an unreachable agent address)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import httpx
import pytest
import redis

from devstack.agentproc import ControllerProcess
from devstack.dashproc import CSRF, DashboardProcess
from remp.auth import Credentials, Role
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.controllers import AioControllers
from remp.redisproc import RedisServer
from tests.integration.test_controller import reg

LEASE_S = 1.5


def _leader(ctls) -> ControllerProcess | None:
    """The controller that answers a write as a leader (NOT_FOUND for an unknown node)."""
    for c in ctls:
        with grpc.insecure_channel(c.addr) as ch:
            try:
                c.stub(ch).Reconfigure(controller_pb2.ReconfigureRequest(
                    node="no-such-node", target=types_pb2.Topology(tp=2, pp=1)), timeout=5)
                return c
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return c
    return None


@pytest.fixture(scope="module")
def group(artifacts_dir):
    """(redis url, leader, follower)."""
    env = {"REMP_CONTROLLER_LEADER_LEASE_SECONDS": str(LEASE_S)}
    with RedisServer() as r:
        a = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-hc-a", lease_seconds=600,
                              env=env)
        b = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-hc-b", lease_seconds=600,
                              env=env)
        with a, b:
            deadline = time.monotonic() + 15
            while (lead := _leader([a, b])) is None:
                assert time.monotonic() < deadline, "no leader"
                time.sleep(0.1)
            yield r.url, lead, (b if lead is a else a)


def _register(ctl: ControllerProcess, node: str, n: int = 1) -> None:
    """``n`` NODE_REGISTERED events for ``node`` (any controller takes registrations)."""
    with grpc.insecure_channel(ctl.addr) as ch:
        stub = ctl.stub(ch)
        for _ in range(n):
            stub.RegisterNode(reg(node), timeout=5)


def _truth(url: str, node: str) -> list[str]:
    """The ids of ``node``'s events in the Redis stream itself."""
    r = redis.Redis.from_url(url, decode_responses=True)
    try:
        return [eid for eid, f in r.xrange("remp:events", "-", "+")
                if json.loads(f["e"]).get("node") == node]
    finally:
        r.close()


def _read(ctl, req, want: int, timeout: float = 10) -> list[controller_pb2.Event]:
    out = []
    with grpc.insecure_channel(ctl.addr) as ch:
        call = ctl.stub(ch).Watch(req, timeout=timeout)
        for ev in call:
            out.append(ev)
            if len(out) == want:
                call.cancel()
                break
    return out


def test_after_id_replays_exactly_the_events_after_it_then_streams_live(group):
    url, lead, follow = group
    _register(lead, "res-1", 6)
    truth = _truth(url, "res-1")
    assert len(truth) == 6
    # the follower serves it too: resume after the 2nd event → the 4 after it, in order
    got = _read(follow, controller_pb2.WatchRequest(node="res-1", after_id=truth[1]), 4)
    assert [e.id for e in got] == truth[2:]
    # after the last one: nothing replayed; the next event arrives live, once
    with grpc.insecure_channel(follow.addr) as ch:
        call = follow.stub(ch).Watch(controller_pb2.WatchRequest(
            node="res-1", after_id=truth[-1]), timeout=10)
        call.initial_metadata()  # the stream is open (sent before the first event)
        time.sleep(0.3)
        _register(lead, "res-1")
        first = next(iter(call))
        call.cancel()
    assert first.id == _truth(url, "res-1")[-1] and first.id not in truth
    # include_history is ignored with after_id; "0-0" (nothing trimmed yet) replays all
    got = _read(lead, controller_pb2.WatchRequest(node="res-1", after_id="0-0",
                                                  include_history=True), 7)
    assert [e.id for e in got] == _truth(url, "res-1")


@pytest.mark.parametrize("bad", [
    "abc", "1-2-3", "1-", "-1", "12", "1 -2", "1-2\n", "٣-1",  # not <ms>-<seq> (ASCII digits)
    "1" * 21 + "-0",  # longer than a 64-bit number
    "18446744073709551616-0", "0-18446744073709551616",  # 2^64: past Redis's range
    "9" * 100_000,
])
def test_a_bad_after_id_is_invalid_argument(group, bad):
    _, lead, _ = group
    with grpc.insecure_channel(lead.addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(lead.stub(ch).Watch(controller_pb2.WatchRequest(after_id=bad), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "after_id" in e.value.details() and len(e.value.details()) < 300


def test_the_largest_after_id_is_valid(group):
    _, lead, _ = group
    with grpc.insecure_channel(lead.addr) as ch:
        with pytest.raises(grpc.RpcError) as e:  # accepted: open, nothing newer, the deadline
            list(lead.stub(ch).Watch(controller_pb2.WatchRequest(
                after_id="18446744073709551615-18446744073709551615"), timeout=1))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_cli_writes_sent_to_the_follower_first_reach_the_leader(group, capsys):
    from ops.cli import main

    url, lead, follow = group
    _register(follow, "cli-n1")
    # the follower alone: it names the leader (remp-leader), the write goes there
    rc = main(["rollout", "start", "TP1PP2", "--nodes", "cli-n1", "--floor", "0",
               "--capacity", "TP2PP1=1,TP1PP2=1", "--json", "--controller", follow.addr])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rid = json.loads(out.out)["rollout_id"]
    assert rid
    # a list, follower first: a no-op switch (a write only the leader takes)
    _register(follow, "cli-n2")
    rc = main(["reconfigure", "cli-n2", "TP2PP1", "--no-wait", "--json",
               "--controller", f"{follow.addr},{lead.addr}"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out.splitlines()[-1])["noop"] is True
    # pause the rollout: the leader's answer (done, or refused by its state: it may have
    # failed already, its agent being unreachable), never the follower's
    rc = main(["rollout", "pause", rid, "--json", "--controller", f"{follow.addr},{lead.addr}"])
    out = capsys.readouterr()
    assert rc == 0 or ("FAILED_PRECONDITION" in out.err and "not the leader" not in out.err), \
        out.err
    rc = main(["rollout", "get", rid, "--json", "--controller", f"{follow.addr},{lead.addr}"])
    out = capsys.readouterr()
    assert rc == 0 and json.loads(out.out)["rollout_id"] == rid, out.err
    # reconfigure of an unknown node: the leader's own answer (NOT_FOUND), not the follower's
    rc = main(["reconfigure", "no-such-node", "TP1PP2", "--no-wait",
               "--controller", f"{follow.addr},{lead.addr}"])
    err = capsys.readouterr().err
    assert rc == 1 and "NOT_FOUND" in err and "not the leader" not in err, err
    # an unreachable controller first: the next one answers
    rc = main(["nodes", "--json", "--controller", f"127.0.0.1:1,{follow.addr}"])
    out = capsys.readouterr()
    assert rc == 0 and "cli-n1" in [n["node"] for n in json.loads(out.out)["nodes"]]
    # a bad list is one line and exit 2
    rc = main(["nodes", "--controller", "a:1,no-port"])
    assert rc == 2 and "is not host:port" in capsys.readouterr().err


def test_dashboard_pointed_at_follower_then_leader_reads_and_writes(group, artifacts_dir):
    url, lead, follow = group
    _register(lead, "dash-n1")
    with DashboardProcess(f"{follow.addr},{lead.addr}", artifacts_dir, name="dash-hc") as d:
        tok = Credentials.load().tokens[Role.OPERATOR]
        with httpx.Client(base_url=d.url, timeout=15, headers=CSRF) as c:
            assert "dash-n1" in [n["node"] for n in c.get("/api/nodes").json()["nodes"]]
            assert c.post("/api/login", json={"token": tok}).status_code == 200
            r = c.post("/api/reconfigure", json={"node": "dash-n1", "target": "TP2PP1",
                                                 "request_id": "dash-hc-1"})
            assert r.status_code == 200, r.text  # the leader accepted it (a no-op switch)
            assert r.json()["noop"] is True and r.json()["switch_id"]
            r = c.post("/api/reconfigure", json={"node": "nope", "target": "TP2PP1"})
            assert r.status_code == 404, r.text  # the leader's NOT_FOUND
            # the live events (one Watch behind every browser stream)
            got: list[dict] = []

            def sse():
                with c.stream("GET", "/api/events?node=dash-n1") as s:
                    for line in s.iter_lines():
                        if line.startswith("data: "):
                            got.append(json.loads(line[6:]))
                            return
            t = threading.Thread(target=sse, daemon=True)
            t.start()
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                _register(follow, "dash-n1")
                time.sleep(0.3)
            t.join(5)
            assert got and got[0]["node"] == "dash-n1" and got[0]["id"]


def test_an_after_id_older_than_the_retained_events_is_failed_precondition(group):
    """The stream keeps the newest ~100,000 events (XADD MAXLEN ~): trimmed here with XTRIM,
    which removes the oldest the same way."""
    url, lead, follow = group
    _register(lead, "gap-n1", 4)
    ids = _truth(url, "gap-n1")
    r = redis.Redis.from_url(url, decode_responses=True)
    try:
        assert r.xtrim("remp:events", minid=ids[2], approximate=False) > 0  # everything before the 3rd is gone
    finally:
        r.close()
    with grpc.insecure_channel(follow.addr) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(follow.stub(ch).Watch(controller_pb2.WatchRequest(
                node="gap-n1", after_id=ids[0]), timeout=5))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"after_id {ids[0]}: events after it are no longer retained (the oldest is " \
           f"{ids[2]};" in e.value.details()
    # a retained id resumes as before
    assert [e.id for e in _read(follow, controller_pb2.WatchRequest(
        node="gap-n1", after_id=ids[2]), 1)] == ids[3:]
    # the client says so and replays every retained event instead
    gaps: list[tuple[str, str]] = []

    async def go():
        ctl = AioControllers([follow.addr], Credentials.load().only(Role.OPERATOR))
        got = []
        try:
            async for ev in ctl.watch(controller_pb2.WatchRequest(node="gap-n1",
                                                                  after_id=ids[1]),
                                      on_gap=lambda a, why: gaps.append((a, why))):
                got.append(ev.id)
                if len(got) == 2:
                    return got
        finally:
            await ctl.close()
    assert asyncio.run(asyncio.wait_for(go(), 20)) == ids[2:]
    assert gaps and gaps[0][0] == ids[1] and "no longer retained" in gaps[0][1]


def test_a_watch_resumes_on_the_other_controller_after_a_kill_nothing_lost_or_repeated(group):
    """Last in the module: it kills one controller (the leader, so the other also takes over)."""
    url, lead, follow = group
    node = "kill-n1"
    _register(follow, node, 3)
    before = _truth(url, node)
    resumed: list[tuple[str, str]] = []

    async def go():
        # the dying controller first; start after the 1st event: the 2 after it are replayed
        ctl = AioControllers([lead.addr, follow.addr], Credentials.load().only(Role.OPERATOR))
        got: list[str] = []

        async def consume():
            async for ev in ctl.watch(controller_pb2.WatchRequest(node=node, after_id=before[0]),
                                      give_up_s=20,
                                      on_resume=lambda a, i: resumed.append((a, i))):
                got.append(ev.id)
        consumer = asyncio.create_task(consume())
        loop = asyncio.get_running_loop()
        try:
            for i in range(12):
                if i == 4:
                    await loop.run_in_executor(None, lead.kill)  # kill -9, mid-stream
                await loop.run_in_executor(None, _register, follow, node)
                await asyncio.sleep(0.05)
            want = len(_truth(url, node)) - 1
            deadline = loop.time() + 20
            while len(got) < want and loop.time() < deadline and not consumer.done():
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)  # a repeat would arrive meanwhile
            return list(got)
        finally:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            await ctl.close()
    got = asyncio.run(asyncio.wait_for(go(), 60))
    truth = _truth(url, node)
    assert len(truth) == 3 + 12
    assert got == truth[1:], (got, truth)  # every event after the first, once, in order
    assert resumed and resumed[0][0] == follow.addr, resumed
