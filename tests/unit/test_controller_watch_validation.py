"""The controller's pure pieces for issue 14: request string bounds (controller/validation.py)
and the Watch fan-out and caps (controller/watch.py). No sockets, no Redis."""

import asyncio

import pytest

from controller import validation
from controller.watch import Fanout, WatchLimits, id_key
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.errors import InvalidArgument, ResourceExhausted


def invalid(msg) -> str:
    with pytest.raises(InvalidArgument) as ei:
        validation.check(msg)
    return str(ei.value)


def test_bounds_name_the_field_and_the_rule():
    msg = invalid(controller_pb2.ReconfigureRequest(node="n1", request_id="r" * 100_000))
    assert msg == ("request_id: at most 128 characters of [A-Za-z0-9._:-], starting with a "
                   "letter or digit (got 100000 characters: 'rrrrrrrrrrrrrrrr'…)")
    assert invalid(controller_pb2.GetSwitchRequest(switch_id="-sw")).startswith("switch_id:")
    assert invalid(controller_pb2.GetStateRequest(node="-x")).startswith(
        "node: at most 253 characters of [A-Za-z0-9._-], starting and ending with a letter")
    assert invalid(controller_pb2.AbortRequest(switch_id="sw-1", reason="a\nb")).startswith(
        "reason: at most 1024 printable characters")
    assert invalid(controller_pb2.RegisterNodeRequest(
        node="n", host=types_pb2.HostFacts(device_names=["ok", "bad\x00"]))).startswith(
        "host.device_names[1]:")
    assert invalid(controller_pb2.RegisterNodeRequest(
        node="n", host=types_pb2.HostFacts(device_names=["d"] * 5000))).startswith(
        "host.device_names: at most 4096 entries")
    assert invalid(controller_pb2.RegisterNodeRequest(
        node="n", agent_address="h:1", http_address="ftp://x")).startswith("http_address:")
    assert invalid(controller_pb2.ListSwitchesRequest(page_token="-1")).startswith("page_token:")


def test_in_bounds_and_empty_pass():
    for m in [controller_pb2.ReconfigureRequest(),  # required-ness is the domain's
              controller_pb2.ReconfigureRequest(node="a.b-c_1", request_id="x" * 128,
                                                reason="TP1PP2 → TP2PP1: +12% goodput"),
              controller_pb2.RegisterNodeRequest(
                  node="n", agent_address="[::1]:50052", http_address="http://127.0.0.1:8000",
                  host=types_pb2.HostFacts(hostname="gpu-01.example", device_type="cuda",
                                           device_names=["NVIDIA H200"]),
                  model=types_pb2.ModelFacts(path="/models/My Model (v2)", dtype="bfloat16",
                                             architecture="LlamaForCausalLM")),
              controller_pb2.ListSwitchesRequest(page_token="50")]:
        validation.check(m)


def test_journal_keeps_usable_entries_within_budget():
    ok = controller_pb2.InflightRequest(request_id="cmpl-1", prompt_token_ids=[1, 2])
    entries = [ok, controller_pb2.InflightRequest(request_id="x" * 300),
               controller_pb2.InflightRequest(request_id="has space"),
               controller_pb2.InflightRequest(request_id="")]
    kept, dropped = validation.journal_entries(entries)
    assert kept == [ok] and dropped == 3
    many = [controller_pb2.InflightRequest(request_id=f"r{i}") for i in range(5000)]
    kept, dropped = validation.journal_entries(many)
    assert len(kept) == validation.JOURNAL_MAX_ENTRIES and dropped == 5000 - len(kept)
    # a journal is still a valid request for check() (its ids are not refused there)
    validation.check(controller_pb2.HeartbeatRequest(node="n", inflight=entries))


def test_watch_limits_per_caller_and_total():
    lim = WatchLimits(per_caller=2, total=3)
    lim.acquire("operator")
    lim.acquire("operator")
    with pytest.raises(ResourceExhausted, match="from operator: 2 open, at most 2 per caller"):
        lim.acquire("operator")
    lim.acquire("anon@10.0.0.1")
    with pytest.raises(ResourceExhausted, match="3 open, at most 3 in total"):
        lim.acquire("policy")
    lim.release("operator")
    lim.acquire("policy")
    assert lim.count == 3 and lim.open == {"operator": 1, "anon@10.0.0.1": 1, "policy": 1}


def ev(i, node="n1", sid=""):
    return controller_pb2.Event(id=f"{1000 + i}-0", node=node, switch_id=sid)


def test_fanout_filters_and_drops_only_the_slow_one():
    async def go():
        f = Fanout(maxsize=3)
        fast, slow = f.subscribe("", "", "0-0"), f.subscribe("n1", "", "0-0")
        by_switch = f.subscribe("", "sw-1", "0-0")
        got = []
        for i in range(5):
            f.publish([ev(i, sid="sw-1" if i == 2 else "")])
            got.append(await fast.get())
        assert [e.id for e in got] == [f"{1000 + i}-0" for i in range(5)]
        assert slow not in f.subs and f.dropped == 1
        with pytest.raises(ResourceExhausted, match="fell 3 events behind"):
            await slow.get()
        assert (await by_switch.get()).switch_id == "sw-1" and by_switch in f.subs
        f.fail_all(ResourceExhausted("bye"))
        with pytest.raises(ResourceExhausted, match="bye"):
            await fast.get()
        assert len(f) == 0
    asyncio.run(go())


def test_stream_ids_compare_numerically():
    assert id_key("999-5") < id_key("1000-0") < id_key("1000-1")
    assert id_key("0-0") == (0, 0)


def test_after_id_is_a_bounded_redis_stream_id():
    from controller.watch import U64_MAX, stream_id

    validation.check(controller_pb2.WatchRequest(after_id="1700000000000-3"))
    validation.check(controller_pb2.WatchRequest(after_id=f"{U64_MAX}-{U64_MAX}"))
    for bad in ("x", "1", "1-", "-1", "1-2-3", " 1-2", "1-2\n", "1" * 21 + "-0", "9" * 10**5):
        assert invalid(controller_pb2.WatchRequest(after_id=bad)).startswith("after_id:"), bad
    assert stream_id("1700000000000-3") == (1700000000000, 3)
    for bad in (f"{U64_MAX + 1}-0", f"0-{U64_MAX + 1}", "١-2", "a-b", "12"):
        with pytest.raises(InvalidArgument):
            stream_id(bad)


def test_maybe_trimmed_only_when_something_was_removed_past_the_cursor():
    from controller.watch import maybe_trimmed

    assert not maybe_trimmed("0-0", "5-0", 0)        # nothing ever removed: all retained
    assert maybe_trimmed("0-0", "5-0", 3)            # the oldest were trimmed: unknown gap
    assert maybe_trimmed("4-9", "5-0", 1)
    assert not maybe_trimmed("5-0", "5-0", 1)        # the cursor is still retained
    assert not maybe_trimmed("7-0", "5-0", 1)
    assert not maybe_trimmed("1-0", "", 1)           # an empty stream: nothing to replay
