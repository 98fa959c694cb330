"""The analytic profile's calibration, profile files, and trace readers."""

import json

import numpy as np
import pytest

from policy.profiles import SLO, Profile, analytic_h200x8, load_profile, save_profile
from policy.traces import aggregate, read_trace, write_canonical
from remp.topology import Topology


@pytest.fixture(scope="module")
def h200():
    return analytic_h200x8()


def test_analytic_profile_meets_the_two_calibration_facts(h200):
    cap = {str(t): h200.capacity(t) for t in h200.topologies}
    assert set(cap) == {"TP1PP8", "TP2PP4", "TP4PP2", "TP8PP1"}
    assert cap["TP4PP2"] / cap["TP1PP8"] == pytest.approx(0.60, abs=0.01)
    assert h200.params["trough_ttft_ratio_tp1pp8_tp4pp2"] == pytest.approx(3.1, abs=0.05)
    assert max(cap, key=cap.get) == "TP1PP8"
    assert h200.kind == "analytic"


def test_goodput_curves_trade_latency_for_throughput(h200):
    g = h200.goodput_curves(h200.default_slo)
    best = h200.best_capacity_rps
    low, high = 0.1 * best, 0.9 * best
    assert g[Topology(4, 2)](low) > g[Topology(1, 8)](low)  # trough: high TP wins
    assert g[Topology(1, 8)](high) > g[Topology(4, 2)](high)  # peak: high PP wins
    for c in g.values():  # shedding makes goodput monotone in offered load
        assert np.all(np.diff(c.goodput_rps) >= -1e-12)


def test_profile_json_round_trip(tmp_path, h200):
    path = tmp_path / "p.json"
    save_profile(h200, path)
    back = load_profile(str(path))
    assert back.topologies == h200.topologies
    assert back.capacity(Topology(1, 8)) == pytest.approx(h200.capacity(Topology(1, 8)))
    slo = SLO(1.0, 0.2)
    a, b = h200.goodput_curves(slo), back.goodput_curves(slo)
    for t in h200.topologies:
        assert a[t](5.0) == pytest.approx(b[t](5.0), rel=1e-6)


def test_measured_profile_file_minimal(tmp_path):
    doc = {"name": "cpu-measured", "request": {"input_tokens": 64, "output_tokens": 32},
           "switch_downtime_s": 0.095, "default_slo": {"ttft_ms": 500, "tpot_ms": 100},
           "topologies": {"TP2PP1": {"capacity_rps": 4.0, "points": [
               {"load_rps": 0.5, "ttft_p50_ms": 100, "tpot_p50_ms": 30},
               {"load_rps": 3.5, "ttft_p50_ms": 400, "tpot_p50_ms": 80}]}}}
    (tmp_path / "m.json").write_text(json.dumps(doc))
    p = load_profile(str(tmp_path / "m.json"))
    assert p.kind == "measured" and p.switch_downtime_s == 0.095
    with pytest.raises(ValueError):
        Profile.from_json({"name": "x"})
    with pytest.raises(ValueError):
        load_profile("no-such-profile")


def test_aggregate_and_canonical_round_trip(tmp_path):
    s = aggregate("t", np.array([0.5, 1.0, 61.0, 62.0, 63.0, 200.0]), 60.0,
                  np.array([1, 2, 3, 4, 5, 6.0]), np.array([1, 1, 1, 1, 1, 1.0]), origin_s=0.0)
    assert list(s.requests) == [2, 3, 0]  # the partial last window (180-200 s) is dropped
    path = tmp_path / "c.csv"
    write_canonical(s, path)
    back = read_trace(path)
    assert back.window_s == 60.0 and list(back.requests) == [2, 3, 0]
    assert list(back.input_tokens) == [3, 12, 0]
    assert list(s.rebin(120.0).requests) == [5]


@pytest.mark.parametrize("rel,fmt,window", [
    ("azure2023/AzureLLMInferenceTrace_conv.csv", "azure2023", 60.0),
    ("mooncake/conversation_trace.jsonl", "mooncake", 60.0),
    ("azure2024/azure2024_conv_hourly.csv", "hourly", 3600.0),
    ("servegen/servegen_m-mid_10min.csv", "servegen", 600.0),
])
def test_shared_trace_readers(rel, fmt, window):
    from pathlib import Path

    import os

    # the shared traces sit beside the checkout (../shared); a clone elsewhere finds them through
    # REMP_SHARED_DIR or at the workplace's fixed path
    roots = [os.environ.get("REMP_SHARED_DIR", ""), Path(__file__).resolve().parents[3] / "shared",
             "/work/shared"]
    path = next((Path(r) / "traces" / rel for r in roots
                 if r and (Path(r) / "traces" / rel).is_file()), None)
    if path is None:
        pytest.skip(f"shared trace {rel} not found (set REMP_SHARED_DIR)")
    s = read_trace(path)
    assert s.window_s == window and len(s) > 10
    assert np.nanmax(s.rates) > 0
    if fmt == "servegen":
        assert s.missing.sum() == 84  # collection gaps are missing, not zero load
    if fmt == "hourly":
        assert s.requests.sum() == 24_732_434
        assert s.name == "azure2024_conv_hourly" and s.day0_weekday == 6  # 2024-05-12, a Sunday
        assert read_trace(path, "azure2024-hourly").requests.sum() == 24_732_434  # the old name


def test_hourly_count_traces_with_several_columns_gaps_and_bad_rows(tmp_path):
    """Hourly counts of any service (``day,hour[,date],<count columns>``), e.g. an aggregate with
    ``conversation,api,all``: the column read is named or, by default, ``conversation`` (then
    ``all``/``total``, then the only one); hours the file lacks are missing windows, not zero
    load; a bad row, a duplicate hour or an unknown column is a clear error."""
    from policy.traces import detect_format

    h = tmp_path / "svc_hourly.csv"
    rows = ["day,hour,conversation,api,all"]
    rows += [f"{d},{hr},{10 + hr},{100 if hr == 9 else 0},{10 + hr + (100 if hr == 9 else 0)}"
             for d in range(2) for hr in range(24) if (d, hr) != (1, 3)]  # day 1, 03:00 absent
    h.write_text("\n".join(rows) + "\n")
    assert detect_format(h) == "hourly"
    s = read_trace(h)
    assert s.name == "svc_hourly-conversation" and s.window_s == 3600.0 and len(s) == 48
    assert s.missing.sum() == 1 and s.missing[27] and s.requests[9] == 19
    assert s.day0_weekday is None and s.t_start_s[-1] == 47 * 3600
    api = read_trace(h, column="all")
    assert api.name == "svc_hourly-all" and api.requests[9] == 119
    assert read_trace(h, window_s=7200.0).requests[0] == 10 + 11  # re-binned
    with pytest.raises(ValueError, match="no count column 'tokens'; it has conversation, api, all"):
        read_trace(h, column="tokens")
    with pytest.raises(ValueError, match="only in an hourly trace"):
        read_trace(h, "servegen", column="api")
    two = tmp_path / "two.csv"
    two.write_text("hour,day,a,b\n0,0,1,2\n1,0,1,2\n")
    with pytest.raises(ValueError, match="several count columns \\(a, b\\); pass --column"):
        read_trace(two)
    assert list(read_trace(two, column="b").requests) == [2, 2]
    _refused(tmp_path, "day,hour,date,code\n0,0,2024-05-10,5\n0,0,2024-05-10,6\n", "hour 0 appears twice")
    dated = tmp_path / "dated.csv"
    dated.write_text("day,hour,date,code\n1,5,2024-05-11,5\n1,6,2024-05-11,\n2,0,2024-05-12,7\n")
    s = read_trace(dated)
    assert s.name == "dated" and s.t_start_s[0] == 86400 + 5 * 3600 and len(s) == 20
    assert s.day0_weekday == 4 and s.missing.sum() == 18  # day 0 = 2024-05-10, a Friday; 06:00 empty
    for text, match in (("day,hour,code\n0,25,1\n", "out of range"), ("day,hour,code\n0,1,-1\n", "out of range"),
                        ("day,hour,code\n0,x,1\n", "not an hourly count"),
                        ("day,hour,date,code\n0,1,May 10,1\n", "not an ISO date"),
                        ("day,hour,code\n", "no rows")):
        _refused(tmp_path, text, match)


def _refused(tmp_path, text: str, match: str, fmt: str = "auto") -> None:
    """A trace file holding ``text`` is refused with a ValueError matching ``match``."""
    bad = tmp_path / "refused.csv"
    bad.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_trace(bad, fmt)


def test_burstgpt_and_iso_stamped_azure_traces_are_read(tmp_path):
    """Formats a held-out trace may come in: BurstGPT's per-request CSV (seconds from its start;
    a failed request, 0 response tokens, is an arrival too) and Azure's per-request CSV with ISO
    stamps (T, any fraction, a UTC offset: taken to UTC). A trace longer than two days defaults
    to 10-min windows; a row that is not the format's is a clear error."""
    from policy.traces import detect_format

    b = tmp_path / "BurstGPT_1.csv"
    rows = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    rows += [f"{t},ChatGPT,{100 + t},{0 if t == 5 else 20},{120 + t},Conversation log"
             for t in (1, 5, 30, 61, 62, 130)]
    b.write_text("\n".join(rows) + "\n")
    assert detect_format(b) == "burstgpt"
    s = read_trace(b)
    assert s.window_s == 60.0 and list(s.requests) == [3, 2]  # 120-130 s: the partial window
    assert list(s.output_tokens) == [40, 40] and s.t_start_s[0] == 0.0
    long = tmp_path / "long.csv"
    long.write_text(rows[0] + "\n" + "\n".join(f"{t},GPT-4,10,10,20,API log"
                                               for t in range(0, 3 * 86400, 97)) + "\n")
    assert read_trace(long).window_s == 600.0 and read_trace(long, window_s=60.0).window_s == 60.0
    bad = tmp_path / "bad.csv"
    bad.write_text(rows[0] + "\nsoon,ChatGPT,1,1,2,x\n")
    with pytest.raises(ValueError, match="bad.csv: line 2 is not a row of a BurstGPT trace: could not"):
        read_trace(bad)
    empty = tmp_path / "empty.csv"
    empty.write_text(rows[0] + "\n")
    with pytest.raises(ValueError, match="no requests"):
        read_trace(empty)

    a = tmp_path / "AzureLLMInferenceTrace_code_1week.csv"
    a.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2024-05-10T00:00:01.5+02:00,10,2\n2024-05-09 22:00:30Z,11,3\n"
                 "2024-05-09 22:01:10.1234567,12,4\n2024-05-09 22:02:30,1,1\n")
    s = read_trace(a)
    assert s.window_s == 60.0 and list(s.requests) == [2, 1]
    assert s.t_start_s[0] == 22 * 3600 and s.day0_weekday == 3  # UTC: 2024-05-09, a Thursday
    _refused(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n", "not ISO 8601")
    _refused(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:01,1\n", "too few columns")
    # the columns found by name, in any order
    swapped = tmp_path / "swapped.csv"
    swapped.write_text("ContextTokens,GeneratedTokens,TIMESTAMP\n"
                       + "".join(f"5,1,2024-05-10 00:0{m}:0{m}\n" for m in range(4)))
    with pytest.raises(ValueError, match="unknown trace format"):
        read_trace(swapped)  # detection looks at the first column, as before
    s = read_trace(swapped, "azure2023")
    assert list(s.requests) == [1, 1, 1] and list(s.input_tokens) == [5, 5, 5]


def test_the_outside_trace_in_bench_data_is_what_its_readme_says():
    """``bench/data/servegen/servegen_m-small_10min.csv`` (ServeGen M-small, derived by
    ``bench/servegen_aggregate.py``; replayed as a trace outside ../shared/traces): the bytes its
    README names, read as a ServeGen trace of 14 days with its 37 collection gaps missing."""
    import hashlib
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "data" / "servegen" / "servegen_m-small_10min.csv"
    assert hashlib.sha256(path.read_bytes()).hexdigest()[:16] == "8fced5f7a7b6c3ac"
    s = read_trace(path)
    assert (s.name, s.window_s, len(s), int(s.missing.sum())) == ("servegen_m-small_10min", 600.0, 2016, 37)
    assert 3879 < np.nanmax(s.rates) < 3880  # day 11, about twice the first week's peaks
