"""``remp policy evaluate --png FILE --day N``: a day of a real replay drawn to a PNG (matplotlib,
Agg), the numbers it draws, and the one-line errors (no such day, goodput objective, matplotlib
missing)."""

import json
import struct
import sys

import numpy as np
import pytest

from ops.policy_cli import main
from policy.profiles import load_profile
from policy.savings import run_savings
from policy.savings_plot import day_view, render_png
from policy.traces import WindowSeries, write_canonical

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def two_day_trace(tmp_path):
    """Two days of 30-min windows: a daily sine (trough 10 % of the peak) with a missing window."""
    t = np.arange(0, 2 * 86400, 1800.0)
    r = 1000 * (0.55 + 0.45 * np.sin(2 * np.pi * t / 86400))
    miss = np.zeros(len(t), bool)
    miss[60] = True
    path = tmp_path / "sine.csv"
    write_canonical(WindowSeries("sine", 1800.0, t, r, miss), path)
    return path


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    w, h = struct.unpack(">II", data[16:24])  # IHDR
    return len(data), w, h


def test_evaluate_png_draws_the_chosen_day(tmp_path, capsys):
    trace = two_day_trace(tmp_path)
    out = tmp_path / "day1.png"
    rc = main(["evaluate", "--trace", str(trace), "--profile", "h100x8-llama2-7b", "--load-scale", "0.9",
               "--png", str(out), "--day", "1", "--json"])
    assert rc == 0
    cap = capsys.readouterr()
    res = json.loads(cap.out.strip().splitlines()[-1])  # the last stdout line is still the JSON
    assert "gpu_hours_fraction" in res and f"wrote {out}: day 1 of 2" in cap.err
    size, w, h = png_size(out)
    assert (w, h) == (1100, 850) and 20_000 < size < 1_000_000


def test_day_view_numbers_match_the_replay(tmp_path):
    from policy.traces import read_trace

    series = read_trace(two_day_trace(tmp_path))
    ev = run_savings(series, load_profile("h100x8-llama2-7b"), "gpu-hours", 0.9)
    v = day_view(ev, 1)
    assert v.days == 2 and len(v.hours) == 48 and v.hours[0] == 0 and v.hours[-1] == 23.5
    assert v.host_gpus == 8 and np.isnan(v.load_rps[60 - 48])
    auto = ev.runs["auto"]
    assert [t.world_size for t in v.topologies["auto"]] == [t.world_size for t in auto.topologies[48:]]
    assert list(v.gpus["auto"]) == [t.world_size for t in auto.topologies[48:]]
    # the day's GPU-hour fraction over the observed windows, and its attainment vs fixed-best
    held = sum(t.world_size for i, t in enumerate(auto.topologies[48:]) if i != 12)
    assert v.gpu_hours_fraction["auto"] == pytest.approx(held / (8 * 47))
    assert v.relative_attainment["auto"] == pytest.approx(
        auto.good_by_day[1] / ev.runs["fixed-best"].good_by_day[1])
    assert v.gpu_hours_fraction["oracle"] < 1.0  # the sine's trough is worth releasing GPUs
    for n in ("auto", "oracle"):  # the capacity line is the SLO capacity of what was held
        assert list(v.capacity_rps[n]) == [ev.slo_capacity[t] for t in v.topologies[n]]
    png = tmp_path / "direct.png"
    assert render_png(ev, 0, str(png)).day == 0 and png_size(png)[0] > 20_000


@pytest.mark.parametrize("args, text", [
    (["--day", "2"], "day 2 is not in the trace: it has 2 day(s), 0..1"),
    (["--day", "-1"], "days are numbered from 0"),
    (["--objective", "goodput", "--profile", "h200x8-analytic"], "not --objective goodput"),
])
def test_png_errors_are_one_line(tmp_path, capsys, args, text):
    trace = two_day_trace(tmp_path)
    argv = ["evaluate", "--trace", str(trace), "--profile", "h100x8-llama2-7b", "--png",
            str(tmp_path / "x.png"), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("remp: error:") and text in err[0], err
    assert not (tmp_path / "x.png").exists()


def test_png_without_matplotlib_fails_at_once_with_one_line(tmp_path, capsys, monkeypatch):
    # matplotlib made unimportable (None in sys.modules: ``import`` raises ImportError)
    for m in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    trace = two_day_trace(tmp_path)
    assert main(["evaluate", "--trace", str(trace), "--png", str(tmp_path / "x.png")]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and "needs matplotlib" in err[0] and "pip install" in err[0]
    assert cap.out == ""  # failed before the replay
