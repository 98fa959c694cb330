"""remp/metrics.py: the switch families, the policy's helpers, the Redis-error adapter (pure or
in-process: private registries, no sockets)."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from remp import metrics
from remp.errors import Unavailable


def value(reg, name, **labels):
    return reg.get_sample_value(name, labels or None)


def test_switch_metrics_from_the_facts_of_a_record():
    reg = CollectorRegistry()
    m = metrics.ControllerMetrics(reg)
    m.observe(metrics.SwitchFacts("succeeded", {"QUIESCING": 0.03, "MIGRATE_KV": 0.01}, 0.12,
                                  0.09, 1000, 5000, 2, 1, 3))
    m.observe(metrics.SwitchFacts("rolled_back", {}, 0.0, 0.0, 0, 0, 0, 0, 0))
    assert value(reg, "remp_controller_switches_total", outcome="succeeded") == 1
    assert value(reg, "remp_controller_switches_total", outcome="rolled_back") == 1
    assert value(reg, "remp_controller_switch_phase_seconds_count", phase="QUIESCING") == 1
    assert value(reg, "remp_controller_switch_phase_seconds_sum",
                 phase="MIGRATE_KV") == pytest.approx(0.01)
    assert value(reg, "remp_controller_switch_downtime_seconds_count") == 1
    assert value(reg, "remp_controller_switch_kv_bytes_moved_total") == 1000
    assert value(reg, "remp_controller_switch_weight_bytes_loaded_total") == 5000
    assert value(reg, "remp_controller_switch_requests_held_total") == 2
    assert value(reg, "remp_controller_switch_requests_preempted_total") == 1
    text = generate_latest(reg).decode()
    assert 'remp_controller_switch_seconds_bucket{le="0.25",outcome="succeeded"} 1.0' in text


def test_agent_metrics_skip_warm_up_visits():
    from node_agent.switch import SwitchRecord
    from remp.topology import Topology
    from remp.transaction import Phase

    reg = CollectorRegistry()
    m = metrics.AgentMetrics(reg)
    rec = SwitchRecord("w", "n", Topology(2, 1), Topology(1, 2), outcome="succeeded",
                       reason="warm-up", timings=[(Phase.QUIESCING, 0.0, 0.02)])
    m.switch_finished(rec)
    assert value(reg, "remp_agent_switches_total", outcome="succeeded") is None
    rec.reason = "operator"
    m.switch_finished(rec)
    assert value(reg, "remp_agent_switches_total", outcome="succeeded") == 1
    assert value(reg, "remp_agent_switch_phase_seconds_count", phase="QUIESCING") == 1


def test_observed_rate_and_action_result():
    from policy.service import Sample

    s = [Sample(at_s=t, window_s=1.0, requests=r) for t, r in ((97, 50), (99, 2), (100, 4))]
    assert metrics.observed_rate(s, window_s=2.0, now_s=100.0) == pytest.approx(3.0)
    assert metrics.observed_rate([], 2.0, 100.0) is None
    assert metrics.action_result("recommended TP1PP2") == "recommended"
    assert metrics.action_result("recommended earlier") == ""
    assert metrics.action_result("recommendation not recorded (UNAVAILABLE): x") == "not_recorded"
    assert metrics.action_result("accepted") == "accepted"
    assert metrics.action_result("refused (FAILED_PRECONDITION): busy") == "refused"
    assert metrics.action_result("waiting: Reconfigure r1 got no answer") == ""
    assert metrics.action_result("") == ""


def test_counting_store_counts_unavailable_and_passes_the_rest():
    reg = CollectorRegistry()
    m = metrics.ControllerMetrics(reg)

    class FakeStore:
        url = "redis://x"

        async def nodes(self):
            raise Unavailable("redis down")

        async def ping(self):
            return True

    s = metrics.CountingStore(FakeStore(), m)
    assert s.url == "redis://x"
    assert asyncio.run(s.ping()) is True
    with pytest.raises(Unavailable):
        asyncio.run(s.nodes())
    assert value(reg, "remp_controller_redis_errors_total", op="nodes") == 1
    assert value(reg, "remp_controller_redis_errors_total", op="ping") is None


def test_metrics_server_serves_the_default_registry():
    import httpx

    metrics.controller()  # families exist in this process's default registry
    srv = metrics.serve("127.0.0.1", 0, "test")
    try:
        r = httpx.get(srv.url, timeout=5)
        assert r.status_code == 200 and "remp_controller_switches_total" in r.text
    finally:
        srv.stop()
    assert metrics.serve("127.0.0.1", None, "test") is None
