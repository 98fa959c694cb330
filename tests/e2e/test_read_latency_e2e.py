"""Reads of a node's state answer at once under load (issue 17): ``NodeAgent.ListRequests``
polled while requests stream on a real agent (tiny model, vLLM CPU, TP2PP1).

The default reply is the agent's front end's own view (no call into the engine core, whose
answer waits for a step boundary and then queues behind the steps' outputs); ``exact`` still
asks the engine core. The poller runs in another process, as an operator's CLI, the dashboard
or the controller does: in this process it would share the interpreter with the SSE parsing of
the streams and measure the client's GIL, not the agent (bench/read_latency.py, "same process").
"""

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from remp.auth import Credentials, sync_channel
from remp.node_agent.v1 import node_agent_pb2 as pb
from remp.node_agent.v1 import node_agent_pb2_grpc
from tests.helpers import prompt

pytestmark = pytest.mark.e2e

STREAMS = 4
TOKENS = 1500  # ~8-15 s at 4 streams here: hundreds of polls, a p99 no single stall sets
# The target is 50 ms p99 — a performance figure, measured by bench/read_latency.py, not
# asserted here: on this shared 2-core box a call doing no work at all (GetSwitch of an unknown
# id, polled in the same window) had p99 40-430 ms at load averages of 8-30, and the clean-clone
# CI run of ca65961 saw ListRequests p99 355 ms against 85 ms for the no-op call at load 11.
# Asserted: the median, which the box's stalls do not set — p50 <= max(50 ms, the no-op call's
# p50 + 20 ms). The engine-core path this replaced failed that: its answer waits for a step
# boundary, then queues behind the steps' outputs (measured: p50 +7-10 ms over the no-op call
# with few streams, p50 11-12 ms against 4-5 ms at 8).
P50_TARGET_S = 0.050
MARGIN_S = 0.020
ROUNDS = 4  # at most; a round is one set of streams, ~8-15 s
MIN_POLLS = 10  # a median over at least this many (the clean-clone CI run of 567af21: 58 in 12 s,
# with the box stalling polls for up to 0.7 s; 191 in the run before; 17 in a local run)

# Polls ListRequests every 20 ms until stdin closes; one JSON line per reply: its latency, what
# it described, and the latency of a call that does no work (GetSwitch of an unknown id:
# NOT_FOUND from the agent's event loop) made 10 ms later — the floor any reply has on this box
# at that moment, reported when the bound is missed.
# The poller runs in a session of its own at autogroup nice -20 where permitted, ahead of the
# agent's session, as a client on another host would be: with Linux's autogroup scheduling the
# agent's busy-waiting workers otherwise starve a client's session for seconds whatever its nice
# (bench.common.PauseMonitor; the clean-clone CI run of 227da20 saw a no-op call take 13.0 s).
POLLER = r"""
import json, select, sys, time
from devstack.agentproc import favour_this_session
favour_this_session()
import grpc
from remp.auth import Credentials, sync_channel
from remp.node_agent.v1 import node_agent_pb2 as pb, node_agent_pb2_grpc
with sync_channel(sys.argv[1], Credentials.load()) as ch:
    stub = node_agent_pb2_grpc.NodeAgentStub(ch)
    stub.ListRequests(pb.ListRequestsRequest(), timeout=30)  # connected before the streams
    print(json.dumps({"ready": True}), flush=True)
    while not select.select([sys.stdin], [], [], 0.01)[0]:
        t0 = time.monotonic()
        r = stub.ListRequests(pb.ListRequestsRequest(), timeout=30)
        lat = time.monotonic() - t0
        time.sleep(0.01)
        t1 = time.monotonic()
        try:
            stub.GetSwitch(pb.GetSwitchRequest(switch_id="no-such-switch"), timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
        print(json.dumps({"lat": lat, "base": time.monotonic() - t1, "reqs": [
            [x.request_id, x.status, x.prompt_tokens, x.output_tokens, x.max_tokens, x.blocks]
            for x in r.requests]}), flush=True)
"""


async def stream(client: httpx.AsyncClient, http: str, text: str) -> int:
    """One greedy SSE stream, read as raw bytes (the test's process stays light: parsing every
    event would take a share of the 2 cores the agent and its poller need); bytes received."""
    n = 0
    async with client.stream("POST", f"{http}/v1/completions", json={
            "model": "tiny", "prompt": text, "max_tokens": TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        async for chunk in r.aiter_raw():
            n += len(chunk)
    return n


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def _measure(agent):
    with subprocess.Popen([sys.executable, "-c", POLLER, agent.grpc_addr],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env=os.environ.copy(), start_new_session=True) as poller:
        try:
            assert json.loads(poller.stdout.readline()).get("ready"), "poller did not start"
            exact_replies = []

            async def streams():
                async with httpx.AsyncClient(timeout=120) as c:
                    tasks = [asyncio.create_task(stream(c, agent.http, prompt(i, 40)))
                             for i in range(STREAMS)]
                    # the engine core's exact view, mid-stream (answered between steps): every
                    # reply that shows a request running, until one shows all of them. Not all
                    # at once is normal: the clean-clone CI run of 9639d10 never saw the 4
                    # together in the engine core's view (a request waiting for KV blocks or
                    # preempted is WAITING there, RUNNING in the front end's)
                    with sync_channel(agent.grpc_addr, Credentials.load()) as ch:
                        stub = node_agent_pb2_grpc.NodeAgentStub(ch)
                        while not all(t.done() for t in tasks):
                            r = await asyncio.to_thread(stub.ListRequests,
                                                        pb.ListRequestsRequest(exact=True),
                                                        timeout=30)
                            running = sum(x.status == "RUNNING" for x in r.requests)
                            if running:
                                exact_replies.append(r)
                            if running >= STREAMS:
                                break
                            await asyncio.sleep(0.05)
                    return await asyncio.gather(*tasks)

            t_start = time.monotonic()
            texts = asyncio.run(streams())
            wall = time.monotonic() - t_start
            poller.stdin.close()  # the poller's signal to stop
            out = poller.stdout.read()
            poller.wait(timeout=60)
        finally:
            if poller.poll() is None:
                poller.kill()
    return poller.returncode, texts, wall, out, exact_replies


def _running(p):
    return [r for r in p["reqs"] if r[1] == "RUNNING"]


def test_list_requests_answers_at_once_while_requests_stream(tp2_agent):
    # another round when one saw too short a window of all streams decoding (a cold agent's
    # first requests, or the shared box stalling the poller for seconds: the clean-clone CI run
    # of 227da20 saw 11 polls in 13.3 s, one no-op call taking 13.0 s, in both of two rounds)
    for _ in range(ROUNDS):
        rc, texts, wall, out, exact_replies = _measure(tp2_agent)
        assert rc == 0
        assert len(texts) == STREAMS and all(n > TOKENS * 50 for n in texts)  # an event a token
        polls = [json.loads(line) for line in out.splitlines() if line.strip()]
        full = [i for i, p in enumerate(polls) if len(_running(p)) >= STREAMS]
        if full and full[-1] - full[0] + 1 >= MIN_POLLS:
            break
    assert full, (f"no reply showed {STREAMS} requests running ({len(polls)} polls in "
                  f"{wall:.1f} s)", polls[:3])
    window = polls[full[0]:full[-1] + 1]
    lats, base = [p["lat"] for p in window], [p["base"] for p in window]
    print(f"ListRequests while {STREAMS} streams decoded: {len(lats)} polls, p50 "
          f"{sorted(lats)[len(lats) // 2] * 1e3:.1f} ms, p99 {p99(lats) * 1e3:.1f} ms, max "
          f"{max(lats) * 1e3:.1f} ms; no-op call p99 {p99(base) * 1e3:.1f} ms; load "
          f"{os.getloadavg()[0]:.1f}")
    assert len(window) >= MIN_POLLS, (len(window), wall)
    p50 = sorted(lats)[len(lats) // 2]
    bound = max(P50_TARGET_S, sorted(base)[len(base) // 2] + MARGIN_S)
    assert p50 <= bound, (
        f"ListRequests p50 {p50 * 1e3:.1f} ms over {len(lats)} polls while {STREAMS} streams "
        f"decoded (p99 {p99(lats) * 1e3:.1f} ms); bound {bound * 1e3:.1f} ms (a call doing no "
        f"work meanwhile: p99 {p99(base) * 1e3:.1f} ms); load {os.getloadavg()[0]:.1f}")

    # the replies describe the requests mid-decode: each one's output count grows, poll after
    # poll, below its max_tokens; prompt and max_tokens are the request's own
    counts: dict[str, list[int]] = {}
    for p in window:
        for rid, status, prompt_tokens, out_tokens, max_tokens, blocks in p["reqs"]:
            assert max_tokens == TOKENS and prompt_tokens > 40 and blocks == 0
            counts.setdefault(rid, []).append(out_tokens)
    growing = {rid: c for rid, c in counts.items()
               if c == sorted(c) and len({x for x in c if 0 < x < TOKENS}) >= 5}
    assert len(growing) >= STREAMS, {rid: c[::10] for rid, c in counts.items()}

    # exact=true still asks the engine core: the same requests, with the KV blocks they hold
    assert exact_replies, "the exact view never showed a stream running"
    best = max(exact_replies, key=lambda r: sum(x.status == "RUNNING" for x in r.requests))
    exact = {x.request_id: x for x in best.requests}
    assert exact and set(exact) <= set(counts), (sorted(exact), sorted(counts))
    assert all(x.blocks > 0 and x.max_tokens == TOKENS for x in exact.values()
               if x.status == "RUNNING")
    front_prompt = {r[0]: r[2] for p in window for r in p["reqs"]}
    assert all(front_prompt[rid] == x.prompt_tokens for rid, x in exact.items())
