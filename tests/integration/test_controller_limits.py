"""The controller under client load (issue 14): Watch streams hold no Redis connection (one
reader per process fanned out in process), are capped per caller and in total
(RESOURCE_EXHAUSTED), and a slow reader is dropped without holding others up; heartbeats and
Reconfigure keep answering promptly meanwhile. Real controller, real Redis."""

import asyncio
import time

import grpc
import pytest

from controller.store import Store
from controller.watch import EventHub
from devstack.agentproc import ControllerProcess, free_port
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
from remp.errors import ResourceExhausted
from remp.redisproc import RedisServer

PER_CALLER, TOTAL = 32, 148  # 148 streams: more than redis-py's default pool of 100
CALLERS = ("operator", "controller", "agent", "policy", None)  # None: anonymous


def reg(node):
    return controller_pb2.RegisterNodeRequest(
        node=node, agent_address=f"127.0.0.1:{free_port()}", http_address="http://x",
        topology=types_pb2.Topology(tp=2, pp=1),
        candidates=[types_pb2.Topology(tp=2, pp=1), types_pb2.Topology(tp=1, pp=2)],
        host=types_pb2.HostFacts(device_count=2),
        model=types_pb2.ModelFacts(num_layers=4, num_attention_heads=8, num_kv_heads=4,
                                   head_size=32, hidden_size=256, weight_bytes=1000))


@pytest.fixture(scope="module")
def ctl(artifacts_dir):
    with RedisServer() as r:
        c = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-limits", lease_seconds=1.0,
                              env={"REMP_CONTROLLER_WATCH_MAX_PER_CALLER": str(PER_CALLER),
                                   "REMP_CONTROLLER_WATCH_MAX_TOTAL": str(TOTAL)})
        with c:
            yield c


async def _open(stub, md, n):
    return [stub.Watch(controller_pb2.WatchRequest(node="lim"), metadata=md) for _ in range(n)]


async def _first_event(calls, timeout=20):
    """Each call's next event (all must be live streams)."""
    evs = await asyncio.wait_for(asyncio.gather(*(c.read() for c in calls)), timeout)
    assert all(e is not grpc.aio.EOF and e.node == "lim" for e in evs)
    return evs


async def _refused(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await asyncio.wait_for(call.read(), 10)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    return ei.value.details()


def test_many_watch_streams_starve_nothing_and_are_capped(ctl):
    async def go():
        chans = [grpc.aio.insecure_channel(ctl.addr) for _ in CALLERS]
        try:
            stubs = [controller_pb2_grpc.ControllerStub(ch) for ch in chans]
            mds = [ctl.metadata(who) if who else None for who in CALLERS]
            agent, op = mds[CALLERS.index("agent")], mds[CALLERS.index("operator")]
            control = stubs[0]
            await control.RegisterNode(reg("lim"), metadata=agent, timeout=5)
            # the first caller fills its share; one more from it is refused
            calls = await _open(stubs[0], mds[0], PER_CALLER)
            await control.Heartbeat(controller_pb2.HeartbeatRequest(node="lim"),
                                    metadata=agent, timeout=5)
            await control.RegisterNode(reg("lim"), metadata=agent, timeout=5)  # an event
            await _first_event(calls)
            msg = await _refused(stubs[0].Watch(controller_pb2.WatchRequest(), metadata=mds[0]))
            assert f"at most {PER_CALLER} per caller" in msg and "operator" in msg, msg
            # the others fill the controller up to its total
            rest = TOTAL - PER_CALLER
            for i, (stub, md) in enumerate(zip(stubs[1:], mds[1:])):
                calls += await _open(stub, md, rest // 4 + (i < rest % 4))
            assert len(calls) == TOTAL
            await control.RegisterNode(reg("lim"), metadata=agent, timeout=5)
            await _first_event(calls)
            msg = await _refused(stubs[2].Watch(controller_pb2.WatchRequest(), metadata=mds[2]))
            assert f"at most {TOTAL} in total" in msg, msg
            # with every stream open: heartbeats and Reconfigure answer promptly for 3 leases
            worst = 0.0
            t_end = time.monotonic() + 3.0
            n = 0
            while time.monotonic() < t_end:
                t0 = time.monotonic()
                await control.Heartbeat(controller_pb2.HeartbeatRequest(node="lim"),
                                        metadata=agent, timeout=2)
                r = await control.Reconfigure(controller_pb2.ReconfigureRequest(
                    node="lim", target=types_pb2.Topology(tp=2, pp=1), request_id=f"l-{n}"),
                    metadata=op, timeout=2)
                assert r.noop
                worst = max(worst, time.monotonic() - t0)
                n += 1
                await asyncio.sleep(0.2)
            assert worst < 1.0, f"a heartbeat + Reconfigure took {worst:.2f} s"
            st = await control.GetState(controller_pb2.GetStateRequest(node="lim"), timeout=5)
            assert st.health == controller_pb2.NODE_HEALTH_READY
            # every stream is still live and got the events (the noop switches of "lim")
            async def switch_done(call):
                for _ in range(3):  # the first callers have one registration still unread
                    ev = await call.read()
                    if ev.type == controller_pb2.EVENT_TYPE_SWITCH_DONE:
                        return ev
            evs = await asyncio.wait_for(asyncio.gather(*map(switch_done, calls)), 20)
            assert all(e is not None and "noop" in e.detail for e in evs)
            # closing streams frees their places
            for c in calls:
                c.cancel()
            deadline = time.monotonic() + 10
            while True:
                again = stubs[0].Watch(controller_pb2.WatchRequest(node="lim"), metadata=mds[0])
                await control.RegisterNode(reg("lim"), metadata=agent, timeout=5)
                try:
                    await _first_event([again], timeout=5)
                    again.cancel()
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert time.monotonic() < deadline, "closed streams were never released"
                    await asyncio.sleep(0.2)
        finally:
            for ch in chans:
                await ch.close()
    asyncio.run(go())
    assert ctl.log_path.read_text().count("Too many connections") == 0


async def test_a_slow_reader_is_dropped_and_holds_no_one_up(tmp_path):
    """The hub hands events to bounded per-stream queues: a reader that stops reading is
    closed (RESOURCE_EXHAUSTED, clear message) and the others get every event."""
    with RedisServer() as r:
        writer = Store(r.url, prefix="t-hub:")
        reader = Store(r.url, prefix="t-hub:", max_connections=1)
        hub = EventHub(reader, queue_size=5, block_ms=200)
        dropped = []
        hub.on_drop = dropped.append
        task = asyncio.create_task(hub.run())
        try:
            for _ in range(50):
                if hub.ready:
                    break
                await asyncio.sleep(0.05)
            fast, slow = hub.subscribe("", ""), hub.subscribe("n1", "")
            other = hub.subscribe("n2", "")  # filtered out: never fills up
            got = []

            async def consume():
                while len(got) < 20:
                    got.append(await fast.get())
            consumer = asyncio.create_task(consume())
            for i in range(20):
                await writer.r.xadd(writer.k_events, {"e": f'{{"node": "n1", "detail": "{i}"}}'})
                await asyncio.sleep(0.01)
            await asyncio.wait_for(consumer, 10)
            assert [e.detail for e in got] == [str(i) for i in range(20)]
            with pytest.raises(ResourceExhausted) as ei:
                await asyncio.wait_for(slow.get(), 1)
            assert "fell 5 events behind" in str(ei.value) and "reconnect" in str(ei.value)
            assert dropped == [1] and slow not in hub.fanout.subs and other in hub.fanout.subs
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await writer.close()
            await reader.close()
