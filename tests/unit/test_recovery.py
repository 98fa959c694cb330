"""The per-request recovery core (remp/recovery.py): bandwidth EWMA, prefill table, the
migrate / recompute / abort decision and the block-pool resize arithmetic. Pure: no mocks."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from remp.recovery import (Action, BandwidthEstimator, DisplacedRequest, PrefillTable, Reason,
                           RecoveryConfig, RunningRequest, blocks_for, crossover_bandwidth,
                           crossover_kv_bytes, decide, effective_bandwidth, isotonic,
                           plan_pool_resize, pool_blocks, prefers_migration, slo_budget, summarize)

TABLE = PrefillTable(((16, 0.010), (64, 0.020), (256, 0.060), (1024, 0.300)))

# ----------------------------------------------------------------------------- strategies

kv_sizes = st.integers(min_value=1, max_value=10**12)
seconds = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False, allow_infinity=False)
bandwidths = st.floats(min_value=1e3, max_value=1e12, allow_nan=False, allow_infinity=False)


@st.composite
def tables(draw):
    lens = sorted(draw(st.sets(st.integers(0, 100_000), min_size=2, max_size=8)))
    secs = sorted(draw(st.lists(st.floats(0, 100, allow_nan=False), min_size=len(lens),
                                max_size=len(lens))))
    return PrefillTable(tuple(zip(lens, secs)))


def one(kv: int, prefill_s: float) -> tuple[DisplacedRequest, PrefillTable]:
    """A request of 100 tokens whose recompute costs exactly ``prefill_s``."""
    return DisplacedRequest("r", kv, 100), PrefillTable(((0, prefill_s), (100, prefill_s)))


@st.composite
def batches(draw):
    n = draw(st.integers(0, 12))
    reqs = []
    for i in range(n):
        reqs.append(DisplacedRequest(
            f"r{i}", draw(st.integers(0, 4 * 10**8)), draw(st.integers(1, 2048)),
            draw(st.one_of(st.none(), st.floats(-0.1, 1.5, allow_nan=False))),
            draw(st.integers(0, 500))))
    return reqs


# ----------------------------------------------------------------------------- bandwidth


def test_ewma_first_sample_replaces_default_then_blends():
    est = BandwidthEstimator(alpha=0.25, default_bps=5e8)
    assert est.estimate("a", "b") == 5e8 and est.samples("a", "b") == 0
    assert est.observe("a", "b", 2_000_000, 0.002) == pytest.approx(1e9)
    assert est.observe("a", "b", 1_000_000, 0.002) == pytest.approx(0.25 * 5e8 + 0.75 * 1e9)
    assert est.samples("a", "b") == 2
    assert est.estimate("b", "a") == 5e8  # directions are separate pairs
    assert est.estimate("a", "c") == 5e8


def test_ewma_ignores_transfers_below_min_bytes_and_rejects_nonsense():
    est = BandwidthEstimator(alpha=0.5, default_bps=1e9, min_bytes=4096)
    assert est.observe("a", "b", 100, 1.0) == 1e9 and est.samples("a", "b") == 0
    with pytest.raises(ValueError):
        est.observe("a", "b", 10_000, 0.0)
    with pytest.raises(ValueError):
        BandwidthEstimator(alpha=0)
    with pytest.raises(ValueError):
        BandwidthEstimator(default_bps=-1)


@given(st.lists(st.tuples(st.integers(1, 10**10), st.floats(1e-4, 10)), min_size=1, max_size=20),
       st.floats(0.01, 1.0))
def test_ewma_stays_within_the_observed_range(samples, alpha):
    est = BandwidthEstimator(alpha=alpha)
    rates = []
    for b, s in samples:
        rates.append(b / s)
        got = est.observe("h1", "h2", b, s)
        assert min(rates) * (1 - 1e-9) <= got <= max(rates) * (1 + 1e-9)
    again = BandwidthEstimator.from_json(json.loads(json.dumps(est.to_json())))
    assert again.estimate("h1", "h2") == est.estimate("h1", "h2")
    assert again.samples("h1", "h2") == len(samples) and again.alpha == alpha


def test_throttle_caps_the_bandwidth():
    assert effective_bandwidth(1e9, None) == 1e9
    assert effective_bandwidth(1e9, 1e6) == 1e6
    assert effective_bandwidth(1e5, 1e6) == 1e5
    with pytest.raises(ValueError):
        RecoveryConfig(bandwidth_cap_bps=0)


# ----------------------------------------------------------------------------- prefill table


def test_table_interpolates_and_extrapolates_linearly():
    assert [TABLE.seconds(n) for n in (16, 64, 256, 1024)] == [0.010, 0.020, 0.060, 0.300]
    assert TABLE.seconds(40) == pytest.approx(0.015)
    assert TABLE.seconds(160) == pytest.approx(0.040)
    assert TABLE.seconds(2048) == pytest.approx(0.300 + 1024 * 0.240 / 768)
    assert TABLE.seconds(8) == pytest.approx(0.010 - 8 * 0.010 / 48)
    assert TABLE.seconds(0) >= 0.0
    steep = PrefillTable(((100, 0.01), (200, 1.0)))
    assert steep.seconds(0) == 0.0  # never negative below the first point


@given(tables(), st.integers(0, 300_000), st.integers(0, 300_000))
def test_table_is_monotone_everywhere(t, a, b):
    lo, hi = min(a, b), max(a, b)
    assert 0.0 <= t.seconds(lo) <= t.seconds(hi)


@given(tables())
def test_table_hits_its_points_and_round_trips_json(t):
    for n, s in t.points:
        assert t.seconds(n) == s
    assert PrefillTable.loads(t.dumps()) == t


def test_table_json_keeps_metadata_and_rejects_bad_input():
    t = PrefillTable(((8, 0.01), (32, 0.02)), {"model": "tiny", "topology": "TP2PP1"})
    doc = json.loads(t.dumps())
    assert doc["kind"] == "remp.prefill_table" and doc["version"] == 1
    assert doc["points"] == [{"tokens": 8, "seconds": 0.01}, {"tokens": 32, "seconds": 0.02}]
    assert PrefillTable.from_json(doc).meta == {"model": "tiny", "topology": "TP2PP1"}
    with pytest.raises(ValueError, match="not a prefill table"):
        PrefillTable.from_json({**doc, "kind": "profile"})
    with pytest.raises(ValueError, match="at least two"):
        PrefillTable(((8, 0.01),))
    with pytest.raises(ValueError, match="increase strictly"):
        PrefillTable(((8, 0.01), (8, 0.02)))
    with pytest.raises(ValueError, match="must not decrease"):
        PrefillTable(((8, 0.02), (16, 0.01)))
    with pytest.raises(ValueError, match="tokens and seconds"):
        PrefillTable.from_json({"points": [{"tokens": 8}]})


def test_fit_takes_medians_and_pools_violators():
    t = PrefillTable.fit([(16, 0.010), (16, 0.030), (16, 0.011), (64, 0.009), (256, 0.050)])
    # medians 0.011, 0.009, 0.05; weights 3, 1, 1 -> 16 and 64 pooled at (3*0.011+0.009)/4
    assert t.points == ((16, pytest.approx(0.0105)), (64, pytest.approx(0.0105)), (256, 0.05))


@given(st.lists(st.tuples(st.floats(-50, 50, allow_nan=False), st.integers(1, 5)), min_size=1,
                max_size=30))
def test_isotonic_is_monotone_and_keeps_the_weighted_mean(pairs):
    ys, ws = [p[0] for p in pairs], [p[1] for p in pairs]
    fit = isotonic(ys, ws)
    assert len(fit) == len(ys)
    assert all(a <= b for a, b in zip(fit, fit[1:]))
    assert sum(w * f for w, f in zip(ws, fit)) == pytest.approx(
        sum(w * y for w, y in zip(ws, ys)), abs=1e-6)
    if all(a <= b for a, b in zip(ys, ys[1:])):
        assert fit == pytest.approx(ys)


# ----------------------------------------------------------------------------- decision


def test_tie_migrates():
    req, table = one(1_000_000, 0.5)
    [d] = decide([req], table, 2_000_000.0)
    assert d.migrate_s == d.recompute_s == 0.5
    assert d.action is Action.MIGRATE and d.reason is Reason.TIE_MIGRATE


@given(kv_sizes, seconds)
def test_decision_flips_exactly_at_the_crossover_bandwidth(kv, p):
    req, table = one(kv, p)
    c = crossover_bandwidth(kv, p)
    assume(math.isfinite(c) and c > 0)
    [at] = decide([req], table, c)
    [below] = decide([req], table, math.nextafter(c, 0))
    assert at.action is Action.MIGRATE
    assert below.action is Action.RECOMPUTE
    # and the costs agree with the choice up to rounding
    assert at.migrate_s == pytest.approx(at.recompute_s, rel=1e-12)
    assert below.migrate_s >= below.recompute_s * (1 - 1e-12)


@given(kv_sizes, seconds, bandwidths)
def test_throttle_flips_the_decision_at_the_crossover(kv, p, measured):
    """Bandwidth throttled by the setting: migrate down to the crossover, recompute below it."""
    req, table = one(kv, p)
    c = crossover_bandwidth(kv, p)
    assume(c < measured)  # unthrottled, migration is cheaper
    est = BandwidthEstimator(default_bps=measured)
    [free] = decide([req], table, est)
    assert free.action is Action.MIGRATE
    [at] = decide([req], table, est, RecoveryConfig(bandwidth_cap_bps=c))
    [below] = decide([req], table, est, RecoveryConfig(bandwidth_cap_bps=math.nextafter(c, 0)))
    assert (at.action, below.action) == (Action.MIGRATE, Action.RECOMPUTE)
    assert below.bandwidth_bps < c


@given(bandwidths, seconds)
def test_crossover_kv_bytes_is_the_largest_size_that_migrates(bw, p):
    k = crossover_kv_bytes(bw, p)
    assert k == pytest.approx(bw * p, rel=1e-9, abs=1)
    assert k == 0 or prefers_migration(k, bw, p)
    assert not prefers_migration(k + 1, bw, p)
    req, table = one(k + 1, p)
    assert decide([req], table, bw)[0].action is Action.RECOMPUTE
    if k > 0:
        req, table = one(k, p)
        assert decide([req], table, bw)[0].action is Action.MIGRATE


def test_crossover_edges():
    assert crossover_bandwidth(0, 0.1) == 0.0  # nothing to move: migrate at any bandwidth
    assert crossover_bandwidth(10, 0.0) == math.inf  # free recompute wins
    req, table = one(0, 0.0)
    assert decide([req], table, 1.0)[0].action is Action.MIGRATE  # 0 vs 0: a tie


def _active_at(intervals, t):
    return sum(1 for a, b in intervals if a <= t < b)


@settings(max_examples=300)
@given(batches(), st.integers(0, 6), st.lists(st.floats(0, 2, allow_nan=False), max_size=8),
       st.floats(1e7, 1e10))
def test_decision_invariants(reqs, n, busy, bw):
    cfg = RecoveryConfig(max_concurrent_migrations=n)
    ds = decide(reqs, TABLE, bw, cfg, busy_slots=busy)
    assert [d.request_id for d in ds] == [r.request_id for r in reqs]
    # never more than N migrations at once, counting the ones already running
    running = [(0.0, b) for b in busy if b > 0]
    new = [(d.wait_s, d.wait_s + d.migrate_s) for d in ds if d.action is Action.MIGRATE]
    if n == 0:
        assert not new
    for a, b in new:
        if b > a:
            assert _active_at(running + new, a) <= n
    if not busy:
        assert sum(1 for d in ds if d.action is Action.MIGRATE
                   and d.reason is not Reason.SLOTS_FULL_QUEUED) <= n
    retry = {d.retry_after_s for d in ds if d.action is Action.ABORT}
    assert len(retry) <= 1
    for r, d in zip(reqs, ds):
        assert d.recompute_s == TABLE.seconds(r.tokens) and d.migrate_s == r.kv_bytes / bw
        if d.action is Action.ABORT:
            # ABORT only when recompute misses the budget and so does migrating (now or after a
            # slot frees)
            assert r.budget_s is not None and d.recompute_s > r.budget_s
            assert d.migrate_s > r.budget_s or d.reason is Reason.SLOTS_FULL_SLO_INFEASIBLE
            assert d.retryable and d.retry_after_s >= 1
            assert d.retry_after_s >= max([x.finish_s for x in ds] + busy)
        else:
            assert d.retry_after_s is None and not d.retryable
            if r.budget_s is not None:
                assert d.finish_s <= r.budget_s  # an accepted path meets the budget
        if d.action is Action.RECOMPUTE and d.reason is Reason.RECOMPUTE_CHEAPER:
            assert not prefers_migration(r.kv_bytes, bw, d.recompute_s)
        json.dumps(d.to_event())
    assert sum(summarize(ds).values()) == len(ds)


@settings(max_examples=300)
@given(batches(), st.floats(1e7, 1e10))
def test_without_slot_pressure_abort_iff_both_paths_miss_the_budget(reqs, bw):
    ds = decide(reqs, TABLE, bw, RecoveryConfig(max_concurrent_migrations=len(reqs)))
    for r, d in zip(reqs, ds):
        both_miss = r.budget_s is not None and d.migrate_s > r.budget_s \
            and d.recompute_s > r.budget_s
        assert (d.action is Action.ABORT) == both_miss
        if not both_miss:
            cheaper = Action.MIGRATE if prefers_migration(r.kv_bytes, bw, d.recompute_s) \
                else Action.RECOMPUTE
            feasible = {Action.MIGRATE: r.budget_s is None or d.migrate_s <= r.budget_s,
                        Action.RECOMPUTE: r.budget_s is None or d.recompute_s <= r.budget_s}
            assert d.action is (cheaper if feasible[cheaper] else
                                {Action.MIGRATE: Action.RECOMPUTE,
                                 Action.RECOMPUTE: Action.MIGRATE}[cheaper])
            assert d.wait_s == 0


def test_beyond_n_slots_recompute_when_it_meets_the_budget():
    # every request prefers migration (1 MB at 1 GB/s = 1 ms < 20 ms recompute); savings differ
    reqs = [DisplacedRequest(f"r{i}", (4 - i) * 1_000_000, 64) for i in range(4)]
    ds = decide(reqs, TABLE, 1e9, RecoveryConfig(max_concurrent_migrations=2))
    assert [d.action for d in ds] == [Action.RECOMPUTE, Action.RECOMPUTE, Action.MIGRATE,
                                      Action.MIGRATE]  # the two largest savings migrate
    assert {d.reason for d in ds[:2]} == {Reason.SLOTS_FULL_RECOMPUTE}


def test_beyond_n_slots_wait_when_only_migration_meets_the_budget_else_abort():
    # 10 MB at 1 GB/s = 10 ms; recompute of 1024 tokens = 300 ms; budgets 25 ms / 15 ms
    reqs = [DisplacedRequest("a", 10_000_000, 1024, 0.025),
            DisplacedRequest("b", 10_000_000, 1024, 0.025),
            DisplacedRequest("c", 10_000_000, 1024, 0.015),
            DisplacedRequest("d", 10_000_000, 64, None)]  # recompute 20 ms, fits any budget
    ds = decide(reqs, TABLE, 1e9, RecoveryConfig(max_concurrent_migrations=1))
    a, b, c, d = ds
    assert a.action is Action.MIGRATE and a.wait_s == 0
    assert b.action is Action.MIGRATE and b.reason is Reason.SLOTS_FULL_QUEUED
    assert b.wait_s == pytest.approx(0.010) and b.finish_s == pytest.approx(0.020)
    assert c.action is Action.ABORT and c.reason is Reason.SLOTS_FULL_SLO_INFEASIBLE
    assert d.action is Action.RECOMPUTE and d.reason is Reason.SLOTS_FULL_RECOMPUTE
    assert c.retry_after_s == 1  # the batch is done in 20 ms: at least the minimum


def test_requests_that_need_a_slot_get_it_first():
    # "needy" cannot recompute within its budget; "eager" saves more but can recompute
    needy = DisplacedRequest("needy", 5_000_000, 64, 0.010)     # mig 5 ms, recomp 20 ms
    eager = DisplacedRequest("eager", 1_000_000, 1024, None)    # mig 1 ms, recomp 300 ms
    ds = decide([eager, needy], TABLE, 1e9, RecoveryConfig(max_concurrent_migrations=1))
    assert [d.action for d in ds] == [Action.RECOMPUTE, Action.MIGRATE]


def test_slo_infeasible_aborts_with_retry_after_of_the_batch():
    reqs = [DisplacedRequest("slow", 4 * 10**9, 1024, 2.0),   # mig 4 s at 1 GB/s, recomp 0.3 s
            DisplacedRequest("late", 10**9, 1024, 0.1)]       # mig 1 s, recomp 0.3 s: both miss
    ds = decide(reqs, TABLE, 1e9, busy_slots=[2.4])
    assert ds[0].action is Action.RECOMPUTE and ds[1].action is Action.ABORT
    assert ds[1].reason is Reason.SLO_INFEASIBLE and ds[1].retryable
    assert ds[1].retry_after_s == 3  # the running migration ends at 2.4 s
    ev = ds[1].to_event()
    assert ev["action"] == "ABORT" and ev["retry_after_s"] == 3 and ev["retryable"] is True
    assert summarize(ds) == {"MIGRATE": 0, "RECOMPUTE": 1, "ABORT": 1}


def test_no_slots_at_all_means_recompute_or_abort():
    # migrate 30 ms < recompute 300 ms, but N = 0: recompute if it meets the budget, else abort
    r = DisplacedRequest("x", 30_000_000, 1024, 0.5)
    [d] = decide([r], TABLE, 1e9, RecoveryConfig(max_concurrent_migrations=0))
    assert d.action is Action.RECOMPUTE and d.reason is Reason.SLOTS_FULL_RECOMPUTE
    [d] = decide([DisplacedRequest("y", 30_000_000, 1024, 0.2)], TABLE, 1e9,
                 RecoveryConfig(max_concurrent_migrations=0))
    assert d.action is Action.ABORT and d.reason is Reason.SLOTS_FULL_SLO_INFEASIBLE
    [d] = decide([DisplacedRequest("z", 10**9, 64, 0.5)], TABLE, 1e9)
    assert d.action is Action.RECOMPUTE and d.reason is Reason.RECOMPUTE_CHEAPER


def test_per_pair_bandwidth_is_used():
    est = BandwidthEstimator(default_bps=1e9)
    est.observe("a", "b", 10**6, 1.0)  # 1 MB/s between a and b
    reqs = [DisplacedRequest("ab", 10**6, 64, src="a", dst="b"),
            DisplacedRequest("ac", 10**6, 64, src="a", dst="c")]
    ab, ac = decide(reqs, TABLE, est)
    assert ab.bandwidth_bps == 1e6 and ab.action is Action.RECOMPUTE
    assert ac.bandwidth_bps == 1e9 and ac.action is Action.MIGRATE


def test_slo_budget():
    assert slo_budget(deadline_s=10.0, now_s=4.0, remaining_tokens=100, tpot_s=0.02) == \
        pytest.approx(4.0)
    assert slo_budget(5.0, 4.0, 100, 0.02) < 0


# ----------------------------------------------------------------------------- pool arithmetic


def brute_min_displaced(reqs: list[RunningRequest], usable: int) -> int:
    for k in range(len(reqs) + 1):
        for gone in itertools.combinations(range(len(reqs)), k):
            if sum(r.demand for i, r in enumerate(reqs) if i not in gone) <= usable:
                return k
    raise AssertionError("unreachable: displacing all always fits")


running_lists = st.lists(
    st.tuples(st.integers(0, 12), st.integers(0, 14), st.integers(0, 50)), max_size=8).map(
    lambda xs: [RunningRequest(f"q{i}", h, n, w) for i, (h, n, w) in enumerate(xs)])


@settings(max_examples=400)
@given(running_lists, st.integers(0, 60), st.integers(1, 4), st.integers(0, 2))
def test_pool_displaces_the_minimal_count(reqs, blocks, bpb, reserved):
    budget = blocks * bpb + (bpb - 1)  # a remainder smaller than a block is unusable
    plan = plan_pool_resize(budget, bpb, reqs, reserved_blocks=reserved)
    assert plan.num_blocks == blocks and plan.usable_blocks == max(0, blocks - reserved)
    assert len(plan.displaced) == brute_min_displaced(reqs, plan.usable_blocks)
    assert sorted(plan.kept + plan.displaced) == sorted(r.request_id for r in reqs)
    kept = [r for r in reqs if r.request_id in plan.kept]
    assert plan.kept_blocks == sum(r.demand for r in kept) <= plan.usable_blocks
    assert plan.free_blocks >= 0
    if sum(r.demand for r in reqs) <= plan.usable_blocks:
        assert plan.displaced == ()
    # displacement order: most blocks first, then least remaining work
    by_id = {r.request_id: r for r in reqs}
    keys = [(-by_id[i].demand, by_id[i].remaining_tokens) for i in plan.displaced]
    assert keys == sorted(keys)
    # no kept request could have been displaced instead of a chosen one under the rule
    if plan.displaced:
        last = by_id[plan.displaced[-1]]
        assert all((r.demand, -r.remaining_tokens) <= (last.demand, -last.remaining_tokens)
                   for r in kept)


def test_pool_ties_displace_least_remaining_work_first():
    reqs = [RunningRequest("long", 4, 4, 400), RunningRequest("short", 4, 4, 10),
            RunningRequest("mid", 4, 4, 100), RunningRequest("small", 1, 2, 0)]
    # 9 blocks, 1 reserved -> 8 usable; demand 4+4+4+2 = 14 -> two of the 4-block ones go
    plan = plan_pool_resize(9 * 1000, 1000, reqs)
    assert plan.num_blocks == 9 and plan.usable_blocks == 8
    assert plan.displaced == ("short", "mid")
    assert plan.kept == ("long", "small") and plan.kept_blocks == 6 and plan.free_blocks == 2


def test_pool_counts_what_requests_need_not_only_what_they_hold():
    reqs = [RunningRequest("a", 3, 5, 1), RunningRequest("b", 3, 3, 1)]
    assert plan_pool_resize(8, 1, reqs, reserved_blocks=0).displaced == ()  # 5 + 3
    assert plan_pool_resize(7, 1, reqs, reserved_blocks=0).displaced == ("a",)


def test_pool_grows_without_displacing_and_validates():
    reqs = [RunningRequest(f"r{i}", 10, 11, 5) for i in range(5)]
    plan = plan_pool_resize(kv_budget_bytes=4 * 2**30, bytes_per_block=2 * 2**20, running=reqs)
    assert plan.num_blocks == 2048 and plan.displaced == ()
    assert pool_blocks(10**6, 10**3, num_blocks_override=77) == 77
    with pytest.raises(ValueError):
        plan_pool_resize(1000, 0, reqs)
    with pytest.raises(ValueError):
        plan_pool_resize(1000, 10, [RunningRequest("x", 1, 1), RunningRequest("x", 1, 1)])
    with pytest.raises(ValueError):
        RunningRequest("x", -1, 0)


def test_blocks_for():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


# ----------------------------------------------------------------------------- remp profile (pure)


def test_profile_lengths_fit_the_engine():
    from ops.prefill import lengths_for

    assert lengths_for((), 512) == [16, 32, 64, 128, 256, 511]
    assert lengths_for((), 257) == [16, 32, 64, 128, 256]
    assert lengths_for((64, 16, 64), 512) == [16, 64]
    assert lengths_for((16, 5000), 0) == [16, 5000]  # unknown limit
    with pytest.raises(ValueError, match=r"\[512\] do not fit max_model_len 512 \(at most 511\)"):
        lengths_for((16, 512), 512)
    with pytest.raises(ValueError, match="two distinct"):
        lengths_for((16, 16), 512)


def test_profile_prompts_histograms_and_kv_bytes():
    import random

    from ops.prefill import histogram_sum_count, kv_bytes_per_token, prompt_ids

    ids = prompt_ids(300, 2048, random.Random(1))
    assert len(ids) == 300 and all(3 <= i < 2048 for i in ids)
    assert ids != prompt_ids(300, 2048, random.Random(2))
    text = "\n".join([
        "# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase",
        'vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3"} 2.0',
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="tiny"} 0.25',
        'vllm:request_prefill_time_seconds_count{engine="0",model_name="tiny"} 3.0',
        'vllm:request_prefill_time_seconds_sum{engine="1",model_name="tiny"} 0.5',
        'vllm:request_prefill_time_seconds_count{engine="1",model_name="tiny"} 1.0',
        'vllm:request_decode_time_seconds_sum{engine="0"} 9.0'])
    assert histogram_sum_count(text, "vllm:request_prefill_time_seconds") == (0.75, 4.0)
    assert histogram_sum_count("nothing here", "vllm:request_prefill_time_seconds") is None
    assert kv_bytes_per_token(4, 4, 32, "float32") == 4096
    assert kv_bytes_per_token(4, 4, 32, "bfloat16") == 2048
    assert kv_bytes_per_token(4, 4, 32, "mystery") == 0


def test_profile_builds_the_table_from_samples():
    from ops.prefill import Sample, build_table, summary_lines

    samples = [Sample(16, 0.050, 0.010), Sample(16, 0.048, 0.012), Sample(16, 0.300, 0.011),
               Sample(64, 0.052, 0.020), Sample(64, 0.051, 0.009), Sample(64, 0.049, 0.021),
               Sample(256, 0.060, 0.040), Sample(256, 0.061, 0.041), Sample(256, 0.059, 0.039)]
    t = build_table(samples, "engine", {"topology": "TP2PP1", "kv_bytes_per_token": 4096})
    assert t.points == ((16, 0.011), (64, 0.020), (256, 0.040))
    assert t.meta["seconds_source"] == "engine" and t.meta["topology"] == "TP2PP1"
    m = t.meta["measurements"][0]
    assert (m["tokens"], m["n"], m["ttft_median_s"], m["ttft_max_s"]) == (16, 3, 0.050, 0.300)
    assert (m["engine_min_s"], m["engine_median_s"], m["engine_max_s"]) == (0.010, 0.011, 0.012)
    ttft = build_table(samples, "ttft", {})
    # client medians 0.050, 0.051, 0.060: already monotone
    assert ttft.points == ((16, 0.050), (64, 0.051), (256, 0.060))
    lines = summary_lines(t)
    assert len(lines) == 3 and "cheaper above 6.0 MB/s" in lines[0]  # 65536 B / 11 ms
    assert PrefillTable.loads(t.dumps()) == t
    with pytest.raises(RuntimeError, match="use --source ttft"):
        build_table([Sample(16, 0.05), Sample(64, 0.06)], "engine", {})


def test_the_committed_measured_tables_load():
    from pathlib import Path

    files = sorted((Path(__file__).parents[2] / "docs" / "prefill").glob("*.json"))
    assert {f.stem for f in files} >= {"tiny-cpu-2core-TP1PP1", "tiny-cpu-2core-TP2PP1",
                                       "tiny-cpu-2core-TP1PP2"}
    for f in files:
        t = PrefillTable.loads(f.read_text())
        assert t.meta["source"] == "remp profile" and t.meta["seconds_source"] == "engine"
        assert f.stem.endswith(t.meta["topology"])
        assert t.points[-1][0] == t.meta["model"]["max_model_len"] - 1
