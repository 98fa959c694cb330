"""A trace file's (or profile file's) bytes never crash a replay: whatever a file of any supported format holds, the
reader gives a window series that keeps its invariants (consecutive windows, finite non-negative
counts, at most MAX_WINDOWS of them) or one ValueError that names the file, which the CLI prints
as one line. Fuzzed with hypothesis: cells replaced by hostile values, rows dropped, doubled or
cut, junk lines inserted, into a valid file of each format."""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.profiles import load_profile
from policy.savings import run_savings
from policy.traces import MAX_WINDOWS, WindowSeries, read_trace

VALID = {
    "azure.csv": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,12,30\n"
                 "2023-11-16 18:19:03.97,10,20\n2023-11-16 18:25:00,5,5\n",
    "burst.csv": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "0,ChatGPT,10,20,30,Conversation log\n65,ChatGPT,10,20,30,Conversation log\n"
                 "200,GPT-4,1,0,1,API log\n",
    "moon.jsonl": '{"timestamp": 0, "input_length": 5, "output_length": 6}\n'
                  '{"timestamp": 61000, "input_length": 5, "output_length": 6}\n'
                  '{"timestamp": 200000, "input_length": 1, "output_length": 1}\n',
    "hourly.csv": "day,hour,date,conversation,api,all\n0,0,2024-05-12,10,1,11\n0,1,2024-05-12,12,0,12\n"
                  "0,3,2024-05-12,,5,5\n",
    "servegen.csv": "window_start_s,requests_est,input_tokens_sum_est,output_tokens_sum_est,token_coverage,"
                    "active_clients\n0,10,100,100,1,3\n600,12,100,100,1,3\n1200,0,0,0,1,0\n",
    "canonical.csv": "t_start_s,requests,input_tokens,output_tokens\n0,5,10,10\n60,6,10,10\n120,,0,0\n",
}
HOSTILE = ["", "nan", "inf", "-inf", "-1", "1e308", "1e18", "99999999999", "x", '"', "\x00", "0",
           "1.5", "2023-13-45 99:99:99", "9999-12-31 23:59:59", "0001-01-01T00:00:00+14:00", "null",
           "[]", "{}", "é", "y" * 140_000]
CELL = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=12))


def _mutate(text: str, ops: list) -> str:
    lines = text.splitlines()
    for op, i, j, v in ops:
        if not lines:
            lines = [v]
            continue
        i %= len(lines)
        if op == "cell":
            sep = "," if "," in lines[i] else ": "
            cells = lines[i].split(sep)
            cells[j % len(cells)] = v
            lines[i] = sep.join(cells)
        elif op == "drop":
            del lines[i]
        elif op == "double":
            lines.insert(i, lines[i])
        elif op == "junk":
            lines.insert(i, v)
        elif op == "cut":
            lines[i] = lines[i][: j % (len(lines[i]) + 1)]
    return "\n".join(lines) + "\n"


OPS = st.lists(st.tuples(st.sampled_from(["cell", "cell", "cell", "drop", "double", "junk", "cut"]),
                         st.integers(0, 10), st.integers(0, 10), CELL), min_size=1, max_size=4)


@pytest.mark.parametrize("name", sorted(VALID))
@settings(max_examples=120, deadline=None, derandomize=True)
@given(ops=OPS)
def test_any_trace_file_reads_or_fails_with_one_clear_error(name, ops):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_text(_mutate(VALID[name], ops), encoding="utf-8")
        try:
            s = read_trace(path)
        except ValueError as exc:
            assert name in str(exc) and "\n" not in str(exc).strip()
            return
    assert 1 <= len(s) <= MAX_WINDOWS
    assert s.window_s > 0 and np.isfinite(s.window_s)
    assert np.all(np.isfinite(s.t_start_s)) and np.allclose(np.diff(s.t_start_s), s.window_s)
    observed = s.requests[~s.missing]
    assert np.all(np.isfinite(observed)) and np.all(observed >= 0)


@pytest.mark.parametrize("name", sorted(VALID))
def test_the_unmutated_files_read(name):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_text(VALID[name])
        assert len(read_trace(path)) >= 1


# ---- a profile file (an operator's measured profile) is the replay's other input ----

_PROFILE = json.loads(Path(__file__).resolve().parents[2].joinpath(
    "policy/profiles/tiny-cpu-2core.json").read_text())


def _leaves(d, path=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _leaves(v, (*path, i))
    elif path[0] not in ("notes", "params"):
        yield path


LEAVES = list(_leaves(_PROFILE))
VALUE = st.sampled_from([float("nan"), float("inf"), -1.0, 0.0, 1e308, 1e-300, "x", None, [], {}, 7])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(edits=st.lists(st.tuples(st.sampled_from(LEAVES), VALUE), min_size=1, max_size=2))
def test_any_profile_file_loads_and_replays_or_fails_with_one_clear_error(edits):
    doc = copy.deepcopy(_PROFILE)
    for path, v in edits:
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = v
    t = np.arange(24) * 600.0
    series = WindowSeries("syn", 600.0, t, 600.0 * (2 + np.sin(t / 3600)), np.zeros(24, dtype=bool))
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "measured.json"
        f.write_text(json.dumps(doc))
        try:
            prof = load_profile(str(f))
        except ValueError as exc:
            assert "measured.json" in str(exc)
            return
    r = run_savings(series, prof, "gpu-hours", 0.9).result()
    assert all(np.isfinite(v) for m in ("gpu_hours_fraction", "relative_attainment_min_day") for v in r[m].values())
