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
