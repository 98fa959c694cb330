"""``bench/servegen_aggregate.py`` sums a ServeGen category's per-client rates into 10-min request
counts, read from a git snapshot (a real git repository made here, two clients)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from bench.servegen_aggregate import aggregate, main
from policy.traces import read_trace


def _repo(tmp_path):
    d = tmp_path / "repo" / "data" / "language" / "m-x"
    d.mkdir(parents=True)
    (d / "chunk-0-trace.csv").write_text("0,0,0,,0,0\n600,1.5,1.0,Gamma,1,1\n1200,2.0,1.0,Gamma,1,1\n")
    (d / "chunk-1-trace.csv").write_text("0,0,0,,0,0\n600,0.5,1.0,Gamma,1,1\n1200,0,0,,0,0\n")
    (d / "chunk-1-dataset.json").write_text("{}")
    git = ["git", "-C", str(tmp_path / "repo"), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    return str(tmp_path / "repo")


def test_rates_summed_per_window_and_gaps_read_as_missing(tmp_path, monkeypatch, capsys):
    repo = _repo(tmp_path)
    t, req, act, clients = aggregate(repo, "language/m-x")
    assert clients == 2 and list(t) == [0, 600, 1200]
    assert np.allclose(req, [0, 1200, 1200]) and list(act) == [0, 2, 1]
    out = tmp_path / "servegen_m-x_10min.csv"
    monkeypatch.setattr("sys.argv", ["servegen_aggregate.py", repo, "language/m-x", str(out)])
    main()
    assert "2 clients, 3 windows, 1 without an active client" in capsys.readouterr().out
    s = read_trace(out)  # the shared ServeGen traces' reader: the window with no client is a gap
    assert s.window_s == 600.0 and list(s.missing) == [True, False, False]
    assert s.requests[1:].tolist() == [1200.0, 1200.0]
    with pytest.raises(SystemExit):
        aggregate(repo, "language/none")
