"""The controller driving a real node agent (vLLM CPU, 2 workers) over real gRPC, state in a
real Redis: Reconfigure through grpcurl mid-decode, Watch, GetState, history; one switch under
20 concurrent Reconfigures and under request-id retries; SIGKILL of the controller at every
phase boundary, then recovery from the agent's truth; aborts."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from devstack.agentproc import (AgentProcess, ControllerProcess, arm_switch, disarm,
                            execute_switch, grpcurl, prompt, stream_completion)
from remp.auth import Credentials, aio_channel
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc
from remp.redisproc import RedisServer
from tests.helpers import LONG_CONTEXT

pytestmark = pytest.mark.e2e

NODE = "e2e-ctl"
PROMPTS = [prompt(i, 120) for i in range(2)]
MAX_TOKENS = 1000  # the agent's start gate holds the switch until both decode; long enough to
# overlap in the engine on an idle machine (LONG_CONTEXT, tests/helpers.py)
PAUSE_POINTS = ["ACCEPTED", "DISPATCHED", "QUIESCING", "PREPARING_WORKERS", "MPU_APPLIED",
                "MIGRATE_KV", "RELOAD_SHARDS", "REBINDING", "SERVING_NEW"]
T = types_pb2.Topology


@pytest.fixture(scope="module")
def stack(tiny_model, artifacts_dir, reaper):
    with RedisServer() as r:
        ctl = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-e2e")
        ctl.start().wait_ready()
        agent = AgentProcess(tiny_model, tp=2, pp=1, dtype="float32", log_dir=artifacts_dir,
                             node=NODE, env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"},
                             extra=["--controller", ctl.addr, "--max-model-len",
                                    str(LONG_CONTEXT)])  # credentials: the env's file
        try:
            agent.start().wait_ready()
            wait_registered(ctl)
            yield ctl, agent
        finally:
            reaper.stop(agent, check=False)
            ctl.stop()


def wait_registered(ctl, timeout=30):
    """Until the agent has renewed its lease (registered or heartbeated) after this call, i.e.
    with the controller process now running: Redis alone still shows the node READY from
    before a restart."""
    t0 = time.monotonic()
    while True:
        st = ctl.wait_node_ready(NODE)
        if st.lease_age_seconds < time.monotonic() - t0:
            return st
        assert time.monotonic() - t0 < timeout, "the agent never reached the new controller"
        time.sleep(0.2)


def call(ctl, method, req, md=True, timeout=10):
    """As the operator (md) or anonymously (the reads are open)."""
    with grpc.insecure_channel(ctl.addr) as ch:
        return getattr(ctl.stub(ch), method)(req, metadata=ctl.metadata() if md else None,
                                             timeout=timeout)


def agent_topology(agent):
    d = agent.describe()
    return (d.topology.tp, d.topology.pp)


def reference(agent):
    async def go():
        async with httpx.AsyncClient(timeout=600) as c:
            # at once (greedy fp32: the same tokens as one by one; the switched run is concurrent)
            return await asyncio.gather(*(stream_completion(c, agent.http, p, MAX_TOKENS)
                                          for p in PROMPTS))
    return asyncio.run(go())


def test_reconfigure_with_grpcurl_mid_decode(stack):
    ctl, agent = stack
    ref = reference(agent)
    events: list = []
    started = threading.Event()

    def watch():
        with grpc.insecure_channel(ctl.addr) as ch:
            stream = ctl.stub(ch).Watch(controller_pb2.WatchRequest(node=NODE), timeout=120)
            started.set()
            for ev in stream:
                events.append(ev)
                if ev.type in (controller_pb2.EVENT_TYPE_SWITCH_DONE,
                               controller_pb2.EVENT_TYPE_SWITCH_FAILED,
                               controller_pb2.EVENT_TYPE_SWITCH_ROLLED_BACK):
                    return
    w = threading.Thread(target=watch)
    w.start()
    started.wait(10)
    time.sleep(0.3)

    async def go():
        async with httpx.AsyncClient(timeout=600) as c:
            # The agent's test-only start gate (armed through its FaultInjection service for
            # the next switch) holds the switch until the engine has both requests decoding:
            # on 2 busy cores grpcurl → controller → agent takes seconds mid-decode, so the
            # switch is requested first and the streams start once the agent holds it (the
            # controller dispatches after it answers).
            await arm_switch(agent.grpc_addr, start_when_running=len(PROMPTS))
            r = await asyncio.to_thread(
                grpcurl, "-plaintext", "-H",
                f"authorization: {dict(ctl.metadata('operator'))['authorization']}", "-d",
                json.dumps({"node": NODE, "target": {"tp": 1, "pp": 2}, "request_id": "grpcurl-1",
                            "reason": "e2e"}),
                ctl.addr, "remp.controller.v1.Controller/Reconfigure")
            sid = (json.loads(r.stdout or "{}").get("switchId") if r.returncode == 0 else None)
            deadline = time.monotonic() + 60
            while sid and await asyncio.to_thread(agent.switch_record, sid) is None:
                assert time.monotonic() < deadline, "the agent never received the switch"
                await asyncio.sleep(0.05)
            tasks = [asyncio.create_task(stream_completion(c, agent.http, p, MAX_TOKENS))
                     for p in PROMPTS]
            return await asyncio.gather(*tasks), r
    try:
        outs, r = asyncio.run(go())
    finally:
        asyncio.run(disarm(agent.grpc_addr))  # nothing armed survives into the next test
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    sid = out.get("switchId") or out.get("switch_id")
    assert sid and not out.get("noop"), r.stdout
    rec = ctl.wait_switch(sid)
    w.join(30)
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED, rec.error.message
    assert rec.requests_in_flight == len(PROMPTS) and rec.requests_preempted == 0
    assert outs == ref, "the switch changed the tokens"
    # --weight-reshard auto is the host store on CPU: each rank reads the checkpoint it needs
    assert rec.weight_bytes_from_store > 0 and rec.weight_bytes_peer == 0
    mine = [e for e in events if e.switch_id == sid]
    phases = [types_pb2.Phase.Name(e.phase) for e in mine
              if e.type == controller_pb2.EVENT_TYPE_SWITCH_PHASE]
    assert phases == ["PHASE_SERVING_OLD", "PHASE_QUIESCING", "PHASE_PREPARING_WORKERS",
                      "PHASE_MPU_APPLIED", "PHASE_MIGRATE_KV", "PHASE_RELOAD_SHARDS",
                      "PHASE_REBINDING", "PHASE_SERVING_NEW"]
    assert mine[-1].type == controller_pb2.EVENT_TYPE_SWITCH_DONE
    st = call(ctl, "GetState", controller_pb2.GetStateRequest(node=NODE), md=False)
    assert (st.observed.tp, st.observed.pp) == (1, 2) == agent_topology(agent)
    assert not st.HasField("current_switch")
    # the agent's heartbeats carry its workers' facts, read again after the switch (the first
    # heartbeat after it starts the read, a later one carries them)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = call(ctl, "GetState", controller_pb2.GetStateRequest(node=NODE), md=False)
        if [(w.tp_rank, w.pp_rank) for w in st.workers] == [(0, 0), (0, 1)]:
            break
        time.sleep(0.5)
    assert [(w.rank, w.tp_rank, w.pp_rank) for w in st.workers] == [(0, 0, 0), (1, 0, 1)]
    assert all(w.device == "cpu" and w.model_bytes > 0 and not w.released and
               w.state == types_pb2.WORKER_STATE_ACTIVE for w in st.workers)
    hist = call(ctl, "ListSwitches", controller_pb2.ListSwitchesRequest(node=NODE), md=False)
    top = hist.switches[0]
    assert top.switch_id == sid and top.request_id == "grpcurl-1" and top.reason == "e2e"
    timed = {types_pb2.Phase.Name(p.phase) for p in top.phase_timings}
    assert {"PHASE_QUIESCING", "PHASE_MIGRATE_KV", "PHASE_RELOAD_SHARDS",
            "PHASE_REBINDING"} <= timed
    assert all(p.seconds >= 0 for p in top.phase_timings) and top.kv_bytes_moved > 0
    # a retry of the same request id returns the same switch, no new switch
    again = call(ctl, "Reconfigure", controller_pb2.ReconfigureRequest(
        node=NODE, target=T(tp=1, pp=2), request_id="grpcurl-1"))
    assert again.duplicate and again.switch_id == sid
    # the plan for the way back names real transfers
    plan = call(ctl, "Plan", controller_pb2.PlanRequest(node=NODE, target=T(tp=2, pp=1)),
                md=False)
    assert plan.transfers and plan.kv_bytes_total == sum(t.kv_bytes for t in plan.transfers)
    assert len(plan.shard_loads) == 2 and plan.predicted_total_seconds > 0


def test_twenty_concurrent_reconfigures_make_one_switch(stack):
    ctl, agent = stack
    start = agent_topology(agent)
    target = T(tp=2, pp=1) if start == (1, 2) else T(tp=1, pp=2)
    before = len(call(ctl, "ListSwitches", controller_pb2.ListSwitchesRequest(
        node=NODE, page_size=1000), md=False).switches)

    def one(i):
        try:
            r = call(ctl, "Reconfigure", controller_pb2.ReconfigureRequest(
                node=NODE, target=target, reason=f"c{i}"))
            return ("noop" if r.noop else "ok", r.switch_id)
        except grpc.RpcError as exc:
            return (exc.code().name, exc.details())
    with ThreadPoolExecutor(20) as ex:
        res = list(ex.map(one, range(20)))
    started = [sid for kind, sid in res if kind == "ok"]
    assert len(started) == 1, res
    for kind, detail in res:
        assert kind in ("ok", "noop", "FAILED_PRECONDITION"), res
        if kind == "FAILED_PRECONDITION":
            assert started[0] in detail
    rec = ctl.wait_switch(started[0])
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED
    assert agent_topology(agent) == (target.tp, target.pp)
    # retries with one request id → one switch
    back = T(tp=start[0], pp=start[1])
    with ThreadPoolExecutor(10) as ex:
        ids = set(ex.map(lambda _: call(ctl, "Reconfigure", controller_pb2.ReconfigureRequest(
            node=NODE, target=back, request_id="retry-me")).switch_id, range(10)))
    assert len(ids) == 1
    rec = ctl.wait_switch(ids.pop())
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED and agent_topology(agent) == start
    after = call(ctl, "ListSwitches", controller_pb2.ListSwitchesRequest(
        node=NODE, page_size=1000), md=False).switches
    real = [s for s in after[: len(after) - before]
            if s.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED]
    assert len(real) == 2


@pytest.mark.parametrize("point", PAUSE_POINTS)
def test_controller_killed_at_each_phase_recovers_from_the_agent(stack, point):
    ctl, agent = stack
    start = agent_topology(agent)
    target = (2, 1) if start == (1, 2) else (1, 2)
    ctl.stop()
    ctl.start(env={"REMP_CONTROLLER_TEST_PAUSE_AT": point}).wait_ready()
    wait_registered(ctl)
    sid = call(ctl, "Reconfigure", controller_pb2.ReconfigureRequest(
        node=NODE, target=T(tp=target[0], pp=target[1]), request_id=f"crash-{point}")).switch_id
    ctl.wait_log("controller.test_paused")
    ctl.kill()
    time.sleep(0.5)  # the agent finishes (or never got) the switch on its own
    ctl.start().wait_ready()
    rec = ctl.wait_switch(sid)
    truth = agent.switch_record(sid)
    st = call(ctl, "GetState", controller_pb2.GetStateRequest(node=NODE), md=False)
    if point in ("ACCEPTED", "DISPATCHED"):
        # never sent: not re-sent by the new controller either
        assert truth is None
        assert rec.outcome == types_pb2.SWITCH_OUTCOME_ABORTED
        assert agent_topology(agent) == start
    else:
        assert truth is not None and truth.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED
        assert rec.outcome == truth.outcome
        assert [p.phase for p in rec.phase_timings] == [p.phase for p in truth.phase_timings]
        assert agent_topology(agent) == target
    assert (st.observed.tp, st.observed.pp) == agent_topology(agent)
    assert not st.HasField("current_switch")
    # executed at most once on the agent
    quiesced = [r for r in agent.log_records()
                if r.get("event") == "switch.phase" and r.get("switch_id") == sid
                and r.get("phase") == "QUIESCING"]
    assert len(quiesced) == (0 if truth is None else 1)
    # the node takes the next switch normally
    nxt = agent_topology(agent)
    nxt = (2, 1) if nxt == (1, 2) else (1, 2)
    again = call(ctl, "Reconfigure", controller_pb2.ReconfigureRequest(
        node=NODE, target=T(tp=nxt[0], pp=nxt[1]))).switch_id
    assert ctl.wait_switch(again).outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED
    assert agent_topology(agent) == nxt


def test_abort_before_dispatch_and_after_finish(stack):
    ctl, agent = stack
    start = agent_topology(agent)
    target = T(tp=2, pp=1) if start == (1, 2) else T(tp=1, pp=2)
    ctl.stop()
    ctl.start(env={"REMP_CONTROLLER_TEST_PAUSE_AT": "ACCEPTED"}).wait_ready()
    try:
        sid = call(ctl, "Reconfigure", controller_pb2.ReconfigureRequest(
            node=NODE, target=target)).switch_id
        ctl.wait_log("controller.test_paused")
        r = call(ctl, "Abort", controller_pb2.AbortRequest(switch_id=sid, reason="operator"))
        assert r.aborted
        rec = call(ctl, "GetSwitch", controller_pb2.GetSwitchRequest(switch_id=sid), md=False)
        assert rec.outcome == types_pb2.SWITCH_OUTCOME_ABORTED and agent.switch_record(sid) is None
        with pytest.raises(grpc.RpcError) as ei:
            call(ctl, "Abort", controller_pb2.AbortRequest(switch_id=sid))
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        ctl.kill()
        ctl.start().wait_ready()
    assert agent_topology(agent) == start


def test_agent_abort_rolls_back_before_migrate_kv(stack):
    _, agent = stack
    start = agent_topology(agent)
    target = (2, 1) if start == (1, 2) else (1, 2)

    async def go():
        # the test-only start gate holds the switch before QUIESCING (no requests are running)
        sw = asyncio.create_task(execute_switch(agent.grpc_addr, *target, switch_id="abort-me",
                                                start_when_running=3))
        await asyncio.sleep(1.0)
        async with aio_channel(agent.grpc_addr, Credentials.load()) as ch:  # as the controller
            r = await node_agent_pb2_grpc.NodeAgentStub(ch).AbortSwitch(
                node_agent_pb2.AbortSwitchRequest(switch_id="abort-me", reason="op"), timeout=10)
        return r, await sw
    r, (phases, rec) = asyncio.run(go())
    assert r.aborted
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_ABORTED and rec.error.code == "ABORTED"
    assert agent_topology(agent) == start
    with agent.channel() as ch:
        with pytest.raises(grpc.RpcError) as ei:
            node_agent_pb2_grpc.NodeAgentStub(ch).AbortSwitch(
                node_agent_pb2.AbortSwitchRequest(switch_id="abort-me"), timeout=10)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_abort_through_the_controller_while_the_agent_holds_the_switch(stack):
    ctl, agent = stack
    start = agent_topology(agent)
    target = T(tp=2, pp=1) if start == (1, 2) else T(tp=1, pp=2)
    # dispatched, held by the agent's test-only start gate before QUIESCING (nothing is running)
    asyncio.run(arm_switch(agent.grpc_addr, start_when_running=3))
    sid = call(ctl, "Reconfigure", controller_pb2.ReconfigureRequest(
        node=NODE, target=target)).switch_id
    deadline = time.monotonic() + 20
    while agent.switch_record(sid) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = call(ctl, "Abort", controller_pb2.AbortRequest(switch_id=sid, reason="operator"))
    assert r.aborted
    rec = ctl.wait_switch(sid)
    assert rec.outcome == types_pb2.SWITCH_OUTCOME_ABORTED and rec.error.code == "ABORTED"
    st = call(ctl, "GetState", controller_pb2.GetStateRequest(node=NODE), md=False)
    assert (st.observed.tp, st.observed.pp) == start == agent_topology(agent)
