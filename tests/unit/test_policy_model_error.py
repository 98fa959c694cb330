"""Model error: a profile taken as s x slower (``Profile.slowed``, ``--profile-slowdown``) and
the bench that replays auto deciding on one profile and counted on a slower one
(bench/policy_model_error.py)."""

import json

import numpy as np
import pytest
from pydantic import ValidationError

from bench.policy_model_error import replay
from ops.policy_cli import main
from policy.config import PolicySettings
from policy.perfmodel import build_profile
import policy.perfmodel as perfmodel
from policy.profiles import load_profile
from policy.savings import capacity_table, run_savings
from policy.scale import ScaleConfig
from policy.traces import WindowSeries, write_canonical


def _diurnal(days=2, W=600.0):
    t = np.arange(0, days * 86400, W)
    r = 100 * (1 + 0.7 * np.sin(2 * np.pi * t / 86400))
    return WindowSeries("diurnal", W, t, r * W, np.zeros(len(t), bool))


def test_a_slowed_profile_divides_loads_and_multiplies_latencies():
    p = load_profile("h200x8-llama2-7b")
    q = p.slowed(1.25)
    assert p.slowed(1.0) is p and q.name == "h200x8-llama2-7b-slowed1.25"
    assert q.params["slowdown"] == 1.25 and "1.25x slower" in q.notes
    for a, b in zip(p.curves, q.curves):
        assert b.capacity_rps == pytest.approx(a.capacity_rps / 1.25)
        assert b.load_rps[-1] == pytest.approx(a.load_rps[-1] / 1.25)
        assert b.tpot_p50_s[3] == pytest.approx(a.tpot_p50_s[3] * 1.25)
        assert b.ttft_p90_s[-1] == pytest.approx(a.ttft_p90_s[-1] * 1.25)
    assert q.pair_downtime_s == p.pair_downtime_s
    for bad in (0.1, 5.0, float("nan")):
        with pytest.raises(ValueError, match="slowdown"):
            p.slowed(bad)


def test_slowing_the_profile_matches_rebuilding_it_with_slower_layers(monkeypatch):
    """The transform stands for an engine whose every layer is s x slower: within 1.5 % of
    rebuilding the profile from the model with each layer's time x 1.12."""
    layer = perfmodel.PerfModel.layer_ms
    monkeypatch.setattr(perfmodel.PerfModel, "layer_ms",
                        lambda self, *a, **k: 1.12 * layer(self, *a, **k))
    rebuilt = build_profile("llama2-70b", "h200")
    monkeypatch.undo()
    slowed = load_profile("h200x8-llama2-70b").slowed(1.12)
    for c in rebuilt.curves:
        assert slowed.capacity(c.topology) == pytest.approx(c.capacity_rps, rel=0.015)


def test_settings_and_cli_take_the_slowdown(tmp_path, capsys):
    s = PolicySettings(controller="127.0.0.1:1", profile_slowdown=1.12)
    assert s.profile_slowdown == 1.12 and PolicySettings(controller="x:1").profile_slowdown == 1.0
    with pytest.raises(ValidationError):
        PolicySettings(controller="127.0.0.1:1", profile_slowdown=5)
    write_canonical(_diurnal(W=3600.0), tmp_path / "t.csv")
    args = ["evaluate", "--trace", str(tmp_path / "t.csv"), "--profile", "h200x8-llama2-7b",
            "--load-scale", "0.6"]
    assert main(args + ["--profile-slowdown", "1.12"]) == 0
    out = capsys.readouterr().out
    assert "profile h200x8-llama2-7b-slowed1.12" in out
    assert main(args + ["--profile-slowdown", "9", "--json"]) == 2
    assert "slowdown" in capsys.readouterr().err


def test_model_error_replay_counts_on_the_slower_host():
    prof, cfg = load_profile("h200x8-llama2-7b"), ScaleConfig()
    same = replay(_diurnal(), prof, 0.9, 1.0, 1.0, cfg)
    worse = replay(_diurnal(), prof, 0.9, 1.0, 1.25, cfg)
    margin = replay(_diurnal(), prof, 0.9, 1.25, 1.25, cfg)
    assert same["auto_worst_day"] >= 0.99 and margin["auto_worst_day"] >= 0.99
    # deciding on a 25 % optimistic model loses more than deciding on the host as it is
    assert worse["auto_worst_day"] < margin["auto_worst_day"]
    json.dumps([same, worse, margin])


def _run_grid_bench(tmp_path, monkeypatch, main, series, gpu: str) -> tuple[str, dict]:
    """Run a grid bench's ``main`` on ``series`` as the only trace; its table and its JSON."""
    (tmp_path / "traces" / "synthetic").mkdir(parents=True)
    write_canonical(series, tmp_path / "traces" / "synthetic" / "diurnal.csv")
    out = tmp_path / "bench.md"
    monkeypatch.setattr("sys.argv", ["bench.py", "--gpu", gpu, "--traces", str(tmp_path / "traces"),
                                     "--out", str(out)])
    main()
    return out.read_text(), json.loads((tmp_path / "bench.md.json").read_text())


def test_load_sweep_bench_writes_its_table_and_json(tmp_path, monkeypatch, capsys):
    import bench.policy_load_sweep as sweep

    monkeypatch.setattr(sweep, "SWEEP", (0.6, 0.65))
    md, doc = _run_grid_bench(tmp_path, monkeypatch, sweep.main, _diurnal(), "h200")
    assert "4/4** runs keep every day" in md and "| diurnal | llama2-70b | 2/2 |" in md
    assert {(r["model"], r["K"]) for r in doc["runs"]} == {
        (m, k) for m in ("llama2-7b", "llama2-70b") for k in (0.6, 0.65)}
    assert doc["meta"]["seconds"] >= 0 and md in capsys.readouterr().out


def test_stress_bench_replays_every_variant_and_writes_its_table(tmp_path, monkeypatch, capsys):
    """bench/policy_stress.py: each trace reversed, twice as fast, noisy and with batch bursts
    (2 a day, 3 x the trace's peak on top, never in a missing window; the trace itself is left
    as it was), same windows, replayed like the grid; the burst runs also count the days after
    the first burst's."""
    import bench.policy_stress as stress

    s = _diurnal(days=1)
    before = s.requests.copy()
    rev, fast, noisy, burst = (stress.variant(s, k) for k in stress.VARIANTS)
    assert np.array_equal(s.requests, before)
    added = burst.requests - s.requests
    assert np.all(added >= 0) and np.count_nonzero(added) == 2 * 1  # 2 bursts of one 10-min window
    assert added.max() == pytest.approx(3 * s.requests.max())
    assert stress.first_burst_day(s, burst) == 0
    assert np.array_equal(rev.requests, s.requests[::-1]) and rev.name == "diurnal-rev"
    assert len(fast.requests) == len(s.requests) and fast.requests.sum() == pytest.approx(s.requests.sum())
    assert np.array_equal(fast.requests[:72], fast.requests[72:])  # the day twice, as fast
    assert not np.array_equal(noisy.requests, s.requests) and np.all(noisy.requests > 0)
    with pytest.raises(ValueError):
        stress.variant(s, "sideways")
    monkeypatch.setattr("bench.policy_savings_table.LOAD_SCALES", (0.6,))
    md, doc = _run_grid_bench(tmp_path, monkeypatch, stress.main, s, "h100")
    assert "/8** runs keep every day" in md
    assert "| rev | 2/2 |" in md and "burst: every day after the day of the first burst" in md
    assert {(r["variant"], r["model"]) for r in doc["runs"]} == {
        (v, m) for v in stress.VARIANTS for m in ("llama2-7b", "llama2-70b")}
    # the burst once more, declared by the operator: the bursts' size in the replay's req/s
    assert "burst, declared (`--burst-rps` the bursts' size)" in md
    assert {(r["model"], r["K"]) for r in doc["declared"]} == {(m, 0.6) for m in ("llama2-7b", "llama2-70b")}
    prof = load_profile("h100x8-llama2-7b")
    tb = capacity_table(prof, prof.default_slo, 0.99)
    rps = stress.declared_burst_rps(s, burst, run_savings(burst, prof, "gpu-hours", 0.6, policies=("fixed-best",)).scale)
    assert rps == pytest.approx(3 * s.requests.max() / s.window_s * 0.6 * tb.best_capacity / burst.rates.max())
    assert md in capsys.readouterr().out


def test_burst_synthetic_bench_builds_its_two_series():
    """bench/policy_burst_synthetic.py's trace: 61 hourly days, the ``all`` series the
    conversation series plus bursts at about 10 % of the hours (seed 1), nothing missing."""
    from bench.policy_burst_synthetic import synthetic

    s = synthetic()
    conv, both = s["conversation"], s["all"]
    assert len(conv) == len(both) == 61 * 24 and conv.window_s == 3600.0
    extra = both.requests - conv.requests
    assert np.all(extra >= 0) and 0.07 < np.mean(extra > 0) < 0.13 and extra.max() > 1800
    assert conv.requests.max() < 300 and not both.missing.any()
