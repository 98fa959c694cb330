"""Controller high availability (issue 17): the leader lease (controller/leader.py) against a
real Redis, and two real controller processes on one Redis — one leads, the other serves reads
and refuses writes with the leader's address (UNAVAILABLE + ``remp-leader``); kill -9 of the
leader hands over within the lease. (Switches in flight across a handover, with a real agent:
tests/e2e/test_controller_ha_e2e.py.)"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis.asyncio as aioredis

from controller.leader import LeaderLease
from devstack.agentproc import ControllerProcess
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.errors import NotLeader
from remp.redisproc import RedisServer
from tests.integration.test_controller import reg

LEASE_S = 1.5


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as r:
        yield r


def test_lease_elects_one_hands_over_after_expiry_and_a_deposed_leader_steps_down(
        redis_server):
    async def go():
        r = aioredis.from_url(redis_server.url, decode_responses=True)
        prefix = "t-lease:"
        a = LeaderLease(r, prefix, "a", "10.0.0.1:50051", lease_s=LEASE_S, poll_s=0.05)
        b = LeaderLease(r, prefix, "b", "10.0.0.2:50051", lease_s=LEASE_S, poll_s=0.05)
        events = []

        def cb(who, what):
            async def f():
                events.append((who, what, time.monotonic()))
            return f
        assert await a.try_acquire() and a.term >= 1  # a leads (and then "dies": no renews)
        tb = asyncio.create_task(b.run(cb("b", "up"), cb("b", "down")))
        await asyncio.sleep(0.3)
        assert not b.is_leader and b.leader_address == "10.0.0.1:50051"
        with pytest.raises(NotLeader) as e:
            b.require()
        assert e.value.leader == "10.0.0.1:50051" and "leader at 10.0.0.1:50051" in str(e.value)
        t0 = time.monotonic()
        while not b.is_leader:
            assert time.monotonic() - t0 < LEASE_S + 1.0
            await asyncio.sleep(0.02)
        assert b.term == a.term + 1 and events[0][:2] == ("b", "up")
        # a comes back (a long pause) and finds itself deposed: its renew fails
        assert not await a.renew()
        # b loses the key (say an operator deleted it): b steps down at its next renew
        await r.delete(f"{prefix}leader")
        await a.try_acquire()
        t1 = time.monotonic()
        while b.is_leader:
            assert time.monotonic() - t1 < LEASE_S
            await asyncio.sleep(0.02)
        assert events[-1][:2] == ("b", "down")
        await asyncio.sleep(0.2)  # b follows again, and names the new leader
        assert not b.is_leader and b.leader_address == "10.0.0.1:50051"
        tb.cancel()
        await asyncio.gather(tb, return_exceptions=True)
        await r.aclose()
    asyncio.run(go())


def _leader(ctls) -> ControllerProcess | None:
    for c in ctls:
        with grpc.insecure_channel(c.addr) as ch:
            try:
                c.stub(ch).Reconfigure(controller_pb2.ReconfigureRequest(
                    node="ha-n1", target=types_pb2.Topology(tp=2, pp=1)), timeout=5)
                return c
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return c  # answered by a leader (NOT_FOUND, FAILED_PRECONDITION, ...)
    return None


def test_two_controllers_one_leads_the_other_refuses_writes_and_takes_over(
        redis_server, artifacts_dir):
    env = {"REMP_CONTROLLER_LEADER_LEASE_SECONDS": str(LEASE_S)}
    a = ControllerProcess(redis_server.url, log_dir=artifacts_dir, name="ctl-ha-a",
                          lease_seconds=30, env=env)
    b = ControllerProcess(redis_server.url, log_dir=artifacts_dir, name="ctl-ha-b",
                          lease_seconds=30, env=env)
    with a, b:
        deadline = time.monotonic() + 10
        while (lead := _leader([a, b])) is None:
            assert time.monotonic() < deadline, "no leader"
            time.sleep(0.1)
        follow = b if lead is a else a
        with grpc.insecure_channel(follow.addr) as ch:
            stub = follow.stub(ch)
            # registration and reads work on any controller
            stub.RegisterNode(reg("ha-n1"), timeout=5)
            assert [n.node for n in stub.ListNodes(
                controller_pb2.ListNodesRequest(), timeout=5).nodes] == ["ha-n1"]
            with pytest.raises(grpc.RpcError) as e:
                stub.Reconfigure(controller_pb2.ReconfigureRequest(
                    node="ha-n1", target=types_pb2.Topology(tp=1, pp=2)), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"leader at {lead.addr}" in e.value.details()
            assert dict(e.value.trailing_metadata())["remp-leader"] == lead.addr
        # the policy's client: a follower's NotLeader sends the write on to the leader
        async def policy_write(address: str):
            from policy.controller_client import GrpcController
            from remp.auth import Credentials, Role
            from remp.errors import NotFound
            from remp.topology import Topology

            c = GrpcController(address, Credentials.load().only(Role.POLICY), timeout=5)
            try:
                with pytest.raises(NotFound):  # answered by the leader: no such node
                    await c.reconfigure("no-such-node", Topology(1, 2), "rid-1", "test")
                assert [n.name for n in await c.list_nodes()] == ["ha-n1"]
                return c.address
            finally:
                await c.close()
        assert asyncio.run(policy_write(follow.addr)) == lead.addr
        assert asyncio.run(policy_write(f"{follow.addr},{lead.addr}")) == lead.addr
        lead.kill()  # kill -9
        t0 = time.monotonic()
        while _leader([follow]) is None:
            assert time.monotonic() - t0 < LEASE_S + 3.5, "no handover"
            time.sleep(0.05)
        handover = time.monotonic() - t0
        print(f"controller handover after kill -9: {handover:.2f} s (lease {LEASE_S} s)")
        assert handover <= 5.0


@pytest.mark.parametrize("wait_replicas", [0, 1])  # 1: the script runs in a WAIT pipeline
def test_a_deposed_leaders_writes_are_fenced_by_the_term(redis_server, wait_replicas):
    """Fenced writes (docs/rollout.md §5): the leader-only scripts carry the term the writer
    was elected in; once another controller leads (a new term), the old leader's begin /
    advance / finish / recommend / rollout step / drain flag / recovery record are refused by Redis and change nothing, while
    registration (every controller's) still works and the new leader's writes go through."""
    from controller.store import Fence, Store

    async def go():
        prefix = f"t-fence-{wait_replicas}:"
        r = aioredis.from_url(redis_server.url, decode_responses=True)
        a = LeaderLease(r, prefix, "a", "10.0.0.1:1", lease_s=LEASE_S, poll_s=0.05)
        b = LeaderLease(r, prefix, "b", "10.0.0.2:1", lease_s=LEASE_S, poll_s=0.05)
        fa, fb = Fence(), Fence()
        sa = Store(redis_server.url, prefix, fence=fa, wait_replicas=wait_replicas)
        sb = Store(redis_server.url, prefix, fence=fb, wait_replicas=wait_replicas)
        ev = controller_pb2.Event(type=controller_pb2.EVENT_TYPE_SWITCH_PHASE, node="f1")
        try:
            assert await a.try_acquire()
            fa.term = a.term
            await sa.register("f1", reg("f1"), time.time() + 60, "TP2PP1", ev)
            assert (await sa.begin("f1", "sw-f1", "", "{}", time.time(), "TP1PP2", ev,
                                   observed="TP2PP1"))[0] == "ok"
            assert await sa.advance("sw-f1", 1, 2, '{"a": 1}', ev)
            # a pauses; its lease is taken over (here: the key removed, b elected)
            await r.delete(f"{prefix}leader")
            assert await b.try_acquire() and b.term == a.term + 1
            fb.term = b.term
            await sb.set_inflight("f1", '{"inflight": []}')  # heartbeats: every controller
            for write in (sa.advance("sw-f1", 2, 3, '{"a": 2}', ev),
                          sa.finish("sw-f1", "f1", "succeeded", 9, "{}", "TP1PP2", ev),
                          sa.dispatch("sw-f1"),
                          sa.recommend("f1", "TP1PP2", ev),
                          sa.rollout_step("ro-1", 0, 1, "{}", "running", False, [], ev),
                          sa.begin("f1", "sw-f2", "", "{}", time.time(), "TP1PP2", ev,
                                   observed="TP2PP1"),
                          sa.set_draining("f1", True, ev),
                          sa.put_recovery("rq-1", "{}", time.time(), ev),
                          sa.clear_inflight("f1")):
                with pytest.raises(NotLeader):
                    await write
            assert await sa.inflight("f1") == '{"inflight": []}'  # the journal kept
            row = await sa.switch("sw-f1")
            assert (row.phase, row.outcome, row.dispatched) == (2, "running", False)
            assert (await sa.node("f1")).get("recommendation") is None
            assert (await sa.node("f1")).get("draining") is None and not await sa.recoveries()
            # the new leader's drain flag and recovery record go through
            await sb.set_draining("f1", True, ev)
            await sb.put_recovery("rq-1", '{"request_id": "rq-1"}', time.time(), ev)
            assert (await sb.node("f1"))["draining"] == "1"
            assert await sb.recoveries() == ['{"request_id": "rq-1"}']
            await sa.register("f1", reg("f1"), time.time() + 60, "TP2PP1", ev)  # unfenced
            # the new leader's writes go through
            assert await sb.finish("sw-f1", "f1", "rolled_back", 2, "{}", "", ev)
            assert (await sb.switch("sw-f1")).outcome == "rolled_back"
            # one controller (no lease: term 0) is not fenced at all
            solo = Store(redis_server.url, prefix)
            try:
                assert await solo.recommend("f1", "TP1PP2", ev)
            finally:
                await solo.close()
        finally:
            await sa.close()
            await sb.close()
            await r.aclose()
    asyncio.run(go())


def test_a_swallowed_cancellation_still_ends_the_lease_loop(redis_server):
    """Cancelling ``LeaderLease.run`` ends it even when the cancellation is swallowed below it —
    here a Redis call that turns it into a RedisError (as a client may; Python 3.11's wait_for
    can drop one too). Before, the loop went on polling and an awaiting shutdown hung."""
    import redis as sync_redis

    class Swallowing(LeaderLease):
        async def try_acquire(self) -> bool:
            try:
                await asyncio.sleep(10)  # a Redis call that does not answer yet
                return await super().try_acquire()
            except asyncio.CancelledError:
                raise sync_redis.RedisError("connection reset") from None

    async def go():
        r = aioredis.from_url(redis_server.url, decode_responses=True)
        prefix = "t-swallow:"
        b = Swallowing(r, prefix, "b", "10.0.0.2:1", lease_s=LEASE_S, poll_s=0.001)

        async def noop():
            return None
        tb = asyncio.create_task(b.run(noop, noop))
        await asyncio.sleep(0.2)
        tb.cancel()  # once, as a shutdown does: it lands in the Redis call, which swallows it
        await asyncio.wait_for(asyncio.gather(tb, return_exceptions=True), timeout=15)
        assert tb.cancelled() and not b.is_leader
        await r.aclose()
    asyncio.run(go())
