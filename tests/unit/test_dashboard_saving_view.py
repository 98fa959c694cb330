"""dashboard.views.gpu_hours_by_day: which topology a node held when (its switch records), and
GPU-hours held vs the whole host per UTC day, by hand."""

from datetime import datetime, timezone

import pytest

from dashboard import views
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2

MIDNIGHT = datetime(2026, 12, 2, tzinfo=timezone.utc).timestamp()
T = types_pb2.Topology


def sample(end: float, w: float) -> types_pb2.TrafficSample:
    s = types_pb2.TrafficSample(window_seconds=w, requests=1)
    s.at.FromNanoseconds(int(end * 1e9))
    return s


def switch(at: float, src, dst, outcome=types_pb2.SWITCH_OUTCOME_SUCCEEDED):
    r = types_pb2.SwitchRecord(switch_id=f"s{at}", from_topology=T(tp=src[0], pp=src[1]),
                               to_topology=T(tp=dst[0], pp=dst[1]), outcome=outcome)
    r.finished_at.FromNanoseconds(int(at * 1e9))
    return r


def test_days_follow_the_switches_and_split_at_midnight():
    # 22:00-02:00 around midnight in 1-h heartbeat windows; whole host 8 GPUs
    samples = [sample(MIDNIGHT + h * 3600, 3600) for h in (-1, 0, 1, 2)]
    sw = [switch(MIDNIGHT - 1800, (8, 1), (4, 1)),  # 23:30: 8 -> 4 GPUs
          switch(MIDNIGHT + 1800, (4, 1), (1, 1), types_pb2.SWITCH_OUTCOME_ROLLED_BACK),  # nothing
          switch(MIDNIGHT + 5400, (4, 1), (2, 1))]  # 01:30: 4 -> 2 GPUs
    days = views.gpu_hours_by_day(samples, list(reversed(sw)), T(tp=2, pp=1), host=8)
    assert [d["day"] for d in days] == ["2026-12-01", "2026-12-02"]
    d1, d2 = days
    # the window 22:00-23:00 (middle 22:30, before any switch): the oldest switch's source, 8;
    # 23:00-00:00 (middle 23:30, the first switch's end): 4
    assert d1["observed_hours"] == pytest.approx(2) and d1["gpu_hours"] == pytest.approx(8 + 4)
    assert d1["host_gpu_hours"] == pytest.approx(16) and d1["fraction"] == pytest.approx(0.75)
    # 00:00-01:00 (middle 00:30; the rolled-back switch changes nothing): 4; 01:00-02:00
    # (middle 01:30, the second switch's end): 2
    assert d2["gpu_hours"] == pytest.approx(4 + 2) and d2["saved_gpu_hours"] == pytest.approx(10)


def test_a_window_across_midnight_is_split_and_no_switch_means_observed():
    days = views.gpu_hours_by_day([sample(MIDNIGHT + 900, 1800)], [], T(tp=1, pp=2), host=4)
    assert [(d["day"], round(d["observed_hours"], 3), round(d["gpu_hours"], 3)) for d in days] == \
        [("2026-12-01", 0.25, 0.5), ("2026-12-02", 0.25, 0.5)]
    assert views.gpu_hours_by_day([], [], T(tp=1, pp=1), host=4) == []


def test_saving_view_host_is_the_largest_candidate_and_nan_is_null():
    n = controller_pb2.NodeState(node="n", observed=T(tp=1, pp=1),
                                 candidates=[T(tp=1, pp=1), T(tp=2, pp=2), T(tp=2, pp=1)])
    from remp.policy.v1 import policy_pb2

    rec = policy_pb2.Recommendation(node="n", current=T(tp=1, pp=1), recommended=T(tp=2, pp=1),
                                    switch=True, objective="gpu-hours", gpus=2, host_gpus=4,
                                    released_gpus=[2, 3], expected_saving_gpu_hours=1.5,
                                    error_budget_requests=float("nan"), decision_id="pd-x-1")
    v = views.saving_view(n, [sample(MIDNIGHT, 3600)], [], rec, now=MIDNIGHT)
    assert (v["host_gpus"], v["gpus_now"], v["observed"]) == (4, 1, "TP1PP1")
    assert v["days"][0]["fraction"] == pytest.approx(0.25)
    r = v["recommendation"]
    assert (r["recommended"], r["gpus"], r["released_gpus"], r["expected_saving_gpu_hours"]) == \
        ("TP2PP1", 2, [2, 3], 1.5)
    assert r["error_budget_requests"] is None  # NaN is not JSON
    assert views.saving_view(n, [], [], None, "NOT_FOUND: x")["recommendation"] is None


def test_held_now_is_what_the_agent_measured():
    n = controller_pb2.NodeState(node="n", observed=T(tp=1, pp=1),
                                 candidates=[T(tp=1, pp=1), T(tp=2, pp=1)])
    assert views.saving_view(n, [], [], None)["held_now"] == {
        "reported": False, "released": [], "holding": [], "model_bytes": 0,
        "device_memory_bytes": 0}
    n.workers.extend([
        types_pb2.WorkerInfo(rank=0, state=types_pb2.WORKER_STATE_ACTIVE, device="cuda:0",
                             model_bytes=100, device_memory_bytes=300),
        # STANDBY but still holding memory (e.g. a runner kept by --cache-runners): not released
        types_pb2.WorkerInfo(rank=1, state=types_pb2.WORKER_STATE_STANDBY, device="cuda:1",
                             model_bytes=50, device_memory_bytes=60),
        types_pb2.WorkerInfo(rank=2, state=types_pb2.WORKER_STATE_STANDBY, device="cuda:2",
                             released=True)])
    held = views.saving_view(n, [], [], None)["held_now"]
    assert (held["reported"], held["released"], held["holding"]) == (True, [2], [0, 1])
    assert (held["model_bytes"], held["device_memory_bytes"]) == (150, 360)
    assert [w["state"] for w in views.node_view(n)["workers"]] == ["ACTIVE", "STANDBY", "STANDBY"]
    from ops.commands import node_line

    assert "released (measured): rank 2" in node_line(views.node_view(n))
