"""dashboard/views.py: proto → JSON views and the CLI's text (pure)."""

from dashboard import views
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.policy.v1 import policy_pb2


def rec() -> types_pb2.SwitchRecord:
    r = types_pb2.SwitchRecord(
        switch_id="sw-1", node="n1", from_topology=types_pb2.Topology(tp=2, pp=1),
        to_topology=types_pb2.Topology(tp=1, pp=2), outcome=types_pb2.SWITCH_OUTCOME_SUCCEEDED,
        phase=types_pb2.PHASE_SERVING_NEW, kv_bytes_moved=3 * 1024 * 1024, requests_held=1,
        downtime_seconds=0.095, total_seconds=0.2,
        phase_timings=[types_pb2.PhaseTiming(phase=types_pb2.PHASE_QUIESCING, seconds=0.027)])
    r.started_at.FromNanoseconds(1_700_000_000 * 10**9)
    return r


def test_switch_and_node_views():
    s = views.switch_view(rec())
    assert (s["from"], s["to"], s["outcome"], s["phase"]) == ("TP2PP1", "TP1PP2", "succeeded",
                                                              "SERVING_NEW")
    assert s["phases"] == [{"phase": "QUIESCING", "seconds": 0.027, "started_at": None}]
    assert s["started_at"] == 1_700_000_000 and s["finished_at"] is None and s["error"] is None
    n = views.node_view(controller_pb2.NodeState(
        node="n1", observed=types_pb2.Topology(tp=2, pp=1), health=controller_pb2.NODE_HEALTH_SWITCHING,
        recommendation="TP1PP2: load 3 req/s", current_switch=rec()))
    assert n["health"] == "switching" and n["recommended_target"] == "TP1PP2"
    assert n["desired"] == "" and n["current_switch"]["switch_id"] == "sw-1"
    assert views.node_view(controller_pb2.NodeState(node="x"))["current_switch"] is None
    assert views.recommended_target("stay: TP2PP1 …") == ""


def test_event_forecast_and_decision_views():
    e = controller_pb2.Event(id="1-0", type=controller_pb2.EVENT_TYPE_SWITCH_DONE, node="n1",
                             switch_id="sw-1", phase=types_pb2.PHASE_SERVING_NEW, record=rec())
    v = views.event_view(e)
    assert v["type"] == "switch_done" and v["record"]["outcome"] == "succeeded"
    assert views.event_view(controller_pb2.Event(type=controller_pb2.EVENT_TYPE_NODE_LOST))["record"] is None
    f = policy_pb2.Forecast(node="n1", forecaster="ewma", observed=[
        types_pb2.TrafficSample(window_seconds=2.0, requests=5),
        types_pb2.TrafficSample(window_seconds=0.0, requests=5)])
    fv = views.forecast_view(f)
    assert [o["rate"] for o in fv["observed"]] == [2.5, 0.0]
    d = views.decision_view(policy_pb2.Decision(id="pd-1", mode=policy_pb2.MODE_ADVISORY,
                                                recommendation=policy_pb2.Recommendation(
                                                    recommended=types_pb2.Topology(tp=1, pp=2),
                                                    switch=True)))
    assert (d["mode"], d["recommended"], d["switch"]) == ("advisory", "TP1PP2", True)


def test_text():
    s = views.switch_view(rec())
    line = views.switch_line(s)
    assert "sw-1" in line and "TP2PP1→TP1PP2" in line and "downtime 95 ms" in line
    assert "kv 3.0 MiB" in line
    assert views.phases_text(s) == "QUIESCING 27 ms"
    assert views.human_bytes(10) == "10 B" and views.ms(12.5) == "12.5 s"
