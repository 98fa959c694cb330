import json

import numpy as np

from ops.policy_cli import main
from policy.evaluate import RESULT_KEYS
from policy.traces import WindowSeries, write_canonical


def test_cli_json_last_line(tmp_path, capsys):
    t = np.arange(0, 2 * 86400, 3600.0)
    r = 100 * (1 + 0.6 * np.sin(2 * np.pi * t / 86400))
    write_canonical(WindowSeries("x", 3600.0, t, r, np.zeros(len(t), bool)), tmp_path / "t.csv")
    rc = main(["evaluate", "--trace", str(tmp_path / "t.csv"), "--profile", "h200x8-analytic", "--objective", "goodput",
               "--peak-utilization", "0.8", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "200", "--json"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert tuple(json.loads(last)) == RESULT_KEYS


def test_cli_error_is_one_line(capsys, tmp_path):
    assert main(["evaluate", "--trace", str(tmp_path / "none.csv"), "--profile", "h200x8-analytic"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("remp: error:")


def test_cli_replays_the_chosen_column_of_an_hourly_trace(tmp_path, capsys):
    """``--column`` picks the series of an hourly count file with several (the report names it);
    an unknown column, or a column for a format that has none, is a one-line error."""
    t = np.arange(48)
    conv = (100 * (1.5 + np.sin(2 * np.pi * t / 24))).astype(int)
    rows = ["day,hour,conversation,api,all"] + [f"{h // 24},{h % 24},{c},{3 * c},{4 * c}" for h, c in zip(t, conv)]
    (tmp_path / "svc.csv").write_text("\n".join(rows) + "\n")
    assert main(["evaluate", "--trace", str(tmp_path / "svc.csv"), "--column", "api", "--load-scale", "0.6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trace svc-api: 48 windows of 3600 s")
    assert main(["evaluate", "--trace", str(tmp_path / "svc.csv"), "--column", "tokens"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no count column 'tokens'" in err[0]
    write_canonical(WindowSeries("x", 3600.0, t * 3600.0, conv.astype(float), np.zeros(48, bool)), tmp_path / "c.csv")
    assert main(["evaluate", "--trace", str(tmp_path / "c.csv"), "--column", "api"]) == 2
    assert "only in an hourly trace" in capsys.readouterr().err


def test_cli_replays_with_the_operators_floor_and_declared_burst(tmp_path, capsys):
    """``--min-gpus`` and ``--burst-rps`` reach auto in the replay (``remp policy serve`` takes
    the same two); a bad value is a one-line error."""
    t = np.arange(48)
    conv = (100 * (1.5 + np.sin(2 * np.pi * t / 24))).astype(float)
    write_canonical(WindowSeries("x", 3600.0, t * 3600.0, conv, np.zeros(48, bool)), tmp_path / "c.csv")
    frac = {}
    for extra in ([], ["--min-gpus", "8"], ["--burst-rps", "1000"]):
        assert main(["evaluate", "--trace", str(tmp_path / "c.csv"), "--load-scale", "0.6", "--json", *extra]) == 0
        frac[" ".join(extra)] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["gpu_hours_fraction"]["auto"]
    assert frac[""] < 1.0 and frac["--min-gpus 8"] == 1.0 and frac["--burst-rps 1000"] == 1.0
    # the text report says what auto was told, and the factor that turns the trace's rates into
    # the replay's (--burst-rps is in the replay's req/s)
    assert main(["evaluate", "--trace", str(tmp_path / "c.csv"), "--burst-rps", "2.5", "--min-gpus", "2"]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert "the trace's rates x " in head and "auto told: a declared burst of 2.5 req/s, at least 2 GPUs" in head
    assert main(["evaluate", "--trace", str(tmp_path / "c.csv"), "--hard-switch-budget"]) == 0
    assert "a hard limit of 12 switches in any 24 h" in capsys.readouterr().out.splitlines()[0]
    assert main(["evaluate", "--trace", str(tmp_path / "c.csv"), "--burst-rps", "-1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
