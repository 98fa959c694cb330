"""Traffic traces as fixed windows of request counts (readers are the only I/O here).

Canonical form: ``t_start_s,requests[,input_tokens,output_tokens]``, one row per fixed window,
``t_start_s`` in seconds since local midnight of day 0 (so time of day is ``t % 86400``).
Readers for every format in ``../shared/traces`` (see its PROVENANCE.md):

- ``azure2023``: Azure LLM inference 2023 (Splitwise), one row per request,
  ``TIMESTAMP,ContextTokens,GeneratedTokens``; aggregated into windows (default 60 s). The 2024
  week traces (DynamoLLM) have the same columns; ISO-8601 stamps with a ``T``, any number of
  fractional digits and a UTC offset are read too (taken to UTC).
- ``burstgpt``: BurstGPT (one row per request: ``Timestamp`` in s from the trace's start,
  ``Model``, ``Request tokens``, ``Response tokens``, ``Total tokens``, ``Log Type``; failed
  requests, 0 response tokens, are arrivals too). Time of day is unknown (t=0 midnight).
- ``mooncake``: Mooncake FAST'25 JSONL, ``timestamp`` in ms from trace start, ``input_length``,
  ``output_length``; aggregated into windows (default 60 s). Time of day is unknown (t=0 midnight).
- ``hourly`` (alias ``azure2024-hourly``): hourly request counts, ``day,hour[,date],<count
  columns>`` (3600 s windows): the Azure 2024 aggregate ``day,hour,date,conversation``, and
  any file of the same shape with several count columns (e.g. ``conversation,api,all``). The
  column read is ``column`` if given, else ``conversation``, else ``all`` / ``total``, else the
  only one; a series read from a file with several count columns is named ``<file>-<column>``.
  Hours absent from the file are missing windows, not zero load; an empty count is missing too.
- ``servegen``: ServeGen 10-min aggregates ``window_start_s,...,requests_est,...,
  input_tokens_sum_est,output_tokens_sum_est,token_coverage,active_clients``; windows with no
  active client are collection gaps and are marked missing, not zero.
- ``canonical``: the canonical CSV above.

Per-request formats are aggregated into 60-s windows, or 10-min windows when the trace spans
more than two days (the replay decides once per window; ``window_s`` overrides).

Coarser windows: ``WindowSeries.rebin(window_s)`` (a multiple of the native window).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from array import array
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

FORMATS = ("auto", "canonical", "azure2023", "mooncake", "hourly", "azure2024-hourly", "servegen", "burstgpt")
HOURLY_KEYS = ("day", "hour", "date")  # the hourly format's non-count columns
HOURLY_DEFAULT_COLUMNS = ("conversation", "all", "total")  # read in this order unless one is named
LONG_SPAN_S = 2 * 86400.0  # per-request traces longer than this default to LONG_WINDOW_S windows
LONG_WINDOW_S = 600.0
MAX_WINDOWS = 2_000_000  # a trace of more windows (38 years of 10-min ones) is refused before it is built


@dataclass(frozen=True)
class WindowSeries:
    """Request counts in consecutive fixed windows. ``missing`` marks windows with no data."""

    name: str
    window_s: float
    t_start_s: np.ndarray  # float, window starts, strictly increasing by window_s
    requests: np.ndarray  # float, requests that arrived in the window
    missing: np.ndarray  # bool
    input_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None
    day0_weekday: int | None = None  # 0 = Monday, when the trace's calendar date is known

    def __post_init__(self) -> None:
        n = len(self.t_start_s)
        if n == 0:
            raise ValueError(f"trace {self.name!r} has no windows")
        if not (self.window_s > 0 and math.isfinite(self.window_s)):
            raise ValueError("window length must be positive")
        if n > MAX_WINDOWS:
            raise ValueError(f"trace {self.name!r}: {n} windows, more than {MAX_WINDOWS}")
        if len(self.requests) != n or len(self.missing) != n:
            raise ValueError("t_start_s, requests and missing must have the same length")
        if not np.all(np.isfinite(self.t_start_s)) or not np.all(np.isfinite(self.requests[~self.missing])):
            raise ValueError(f"trace {self.name!r}: a window start or request count is not a finite number")
        if n > 1 and not np.allclose(np.diff(self.t_start_s), self.window_s):
            raise ValueError(f"trace {self.name!r}: windows are not consecutive {self.window_s} s windows")
        if np.any(self.requests[~self.missing] < 0):
            raise ValueError(f"trace {self.name!r}: negative request count")

    def __len__(self) -> int:
        return len(self.t_start_s)

    @property
    def rates(self) -> np.ndarray:
        """Requests per second per window (NaN where missing)."""
        r = self.requests / self.window_s
        return np.where(self.missing, np.nan, r)

    @property
    def duration_s(self) -> float:
        return float(len(self) * self.window_s)

    def rebin(self, window_s: float) -> "WindowSeries":
        k = window_s / self.window_s
        if abs(k - round(k)) > 1e-9 or round(k) < 1:
            raise ValueError(f"cannot rebin {self.window_s} s windows into {window_s} s windows")
        k = int(round(k))
        if k == 1:
            return self
        n = len(self) // k
        if n == 0:
            raise ValueError(f"trace shorter than one {window_s} s window")

        def fold(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[: n * k].reshape(n, k).sum(axis=1)

        miss = self.missing[: n * k].reshape(n, k)
        req = np.where(self.missing, 0.0, self.requests)[: n * k].reshape(n, k)
        # a partly missing window is scaled up from its observed part; fully missing stays missing
        seen = (~miss).sum(axis=1)
        counts = np.where(seen > 0, req.sum(axis=1) * k / np.maximum(seen, 1), 0.0)
        return replace(self, window_s=float(window_s), t_start_s=self.t_start_s[: n * k: k].copy(),
                       requests=counts, missing=seen == 0, input_tokens=fold(self.input_tokens),
                       output_tokens=fold(self.output_tokens))


def aggregate(name: str, times_s: np.ndarray, window_s: float, input_tokens: np.ndarray | None = None,
              output_tokens: np.ndarray | None = None, day0_weekday: int | None = None,
              origin_s: float | None = None) -> WindowSeries:
    """Per-request arrival times (s since day-0 midnight) -> counts in fixed windows. Windows are
    aligned to multiples of ``window_s`` since midnight unless ``origin_s`` is given; the last,
    partial window is dropped (a partial count would read as a dip)."""
    times_s = np.asarray(times_s, dtype=float)
    if len(times_s) == 0:
        raise ValueError(f"trace {name!r} has no requests")
    if not (window_s > 0 and math.isfinite(window_s)):
        raise ValueError(f"trace {name!r}: window length must be positive")
    if not np.all(np.isfinite(times_s)):
        raise ValueError(f"trace {name!r}: an arrival time is not a finite number")
    start = np.floor(times_s.min() / window_s) * window_s if origin_s is None else origin_s
    if times_s.min() < start:
        raise ValueError(f"trace {name!r}: an arrival at {times_s.min():g} s, before the trace's start")
    n_span = (times_s.max() - start) / window_s
    if n_span > MAX_WINDOWS:
        raise ValueError(f"trace {name!r} spans {n_span:.3g} windows of {window_s:g} s, more than "
                         f"{MAX_WINDOWS} (a wrong time unit, or pass a longer --window-s)")
    idx = np.floor((times_s - start) / window_s).astype(int)
    n_full = int(np.floor(n_span))  # windows that ended before the last arrival
    n = max(n_full, 1)
    keep = idx < n
    counts = np.bincount(idx[keep], minlength=n).astype(float)

    def sums(a: np.ndarray | None) -> np.ndarray | None:
        if a is None:
            return None
        if not np.all(np.isfinite(a)):
            raise ValueError(f"trace {name!r}: a token count is not a finite number")
        return np.bincount(idx[keep], weights=np.asarray(a, dtype=float)[keep], minlength=n)

    return WindowSeries(name=name, window_s=float(window_s), t_start_s=start + window_s * np.arange(n),
                        requests=counts, missing=np.zeros(n, dtype=bool), input_tokens=sums(input_tokens),
                        output_tokens=sums(output_tokens), day0_weekday=day0_weekday)


# ---- readers ----

def _header(path: Path) -> list[str]:
    with path.open(newline="") as f:
        first = f.readline().strip()
    return [c.strip() for c in first.split(",")]


def detect_format(path: str | Path) -> str:
    path = Path(path)
    if path.suffix in (".jsonl", ".json"):
        return "mooncake"
    cols = _header(path)
    if cols[:1] == ["TIMESTAMP"]:
        return "azure2023"
    if cols[:1] == ["t_start_s"]:
        return "canonical"
    if "day" in cols and "hour" in cols:
        return "hourly"
    if "requests_est" in cols and "window_start_s" in cols:
        return "servegen"
    if "Timestamp" in cols and "Request tokens" in cols:
        return "burstgpt"
    raise ValueError(f"{path}: unknown trace format (header {cols[:6]}); pass --format ({', '.join(FORMATS[1:])})")


def read_canonical(path: str | Path) -> WindowSeries:
    path = Path(path)
    t, req, tin, tout = [], [], [], []
    with path.open(newline="") as f:
        rd = csv.DictReader(f)
        has_tokens = rd.fieldnames is not None and "input_tokens" in rd.fieldnames
        for row in rd:
            t.append(float(row["t_start_s"]))
            v = row["requests"].strip()
            req.append(float(v) if v else np.nan)
            if has_tokens:
                tin.append(float(row["input_tokens"] or 0))
                tout.append(float(row["output_tokens"] or 0))
    if len(t) < 1:
        raise ValueError(f"{path}: no rows")
    t_arr = np.asarray(t)
    window = float(np.median(np.diff(t_arr))) if len(t) > 1 else 60.0
    req_arr = np.asarray(req)
    missing = np.isnan(req_arr)
    return WindowSeries(name=path.stem, window_s=window, t_start_s=t_arr, requests=np.nan_to_num(req_arr),
                        missing=missing, input_tokens=np.asarray(tin) if tin else None,
                        output_tokens=np.asarray(tout) if tout else None)


def write_canonical(series: WindowSeries, path: str | Path) -> None:
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        tokens = series.input_tokens is not None and series.output_tokens is not None
        w.writerow(["t_start_s", "requests"] + (["input_tokens", "output_tokens"] if tokens else []))
        for i in range(len(series)):
            row = [f"{series.t_start_s[i]:g}", "" if series.missing[i] else f"{series.requests[i]:g}"]
            if tokens:
                row += [f"{series.input_tokens[i]:g}", f"{series.output_tokens[i]:g}"]  # type: ignore[index]
            w.writerow(row)


def _count_or_zero(field: str) -> float:
    return float(field or 0)


def _stream_request_csv(path: Path, what: str, time_col: str, seconds, token_cols: tuple[str, str],
                        tokens_required: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A per-request CSV streamed row by row into float arrays (times in s, input and output
    tokens), not every row as objects: a week of Azure 2024 is ~17 M rows, a BurstGPT file
    1.4-3.8 M. ``seconds`` turns a time field into seconds. Token columns are required (a blank
    field is an error) or optional (absent or blank: 0). Any bad row is one ValueError naming the
    file and the line."""
    t, tin, tout = array("d"), array("d"), array("d")
    with path.open(newline="") as f:
        rows = csv.reader(f)
        head = [c.strip() for c in next(rows, [])]
        try:
            i_t = head.index(time_col)
            i_in, i_out = (head.index(c) if tokens_required or c in head else None for c in token_cols)
        except ValueError:
            raise ValueError(f"{path}: not {what} (header {head[:6]})") from None

        count = float if tokens_required else _count_or_zero
        for row in rows:
            if not row:
                continue
            try:
                t.append(seconds(row[i_t]))
                tin.append(0.0 if i_in is None else count(row[i_in]))
                tout.append(0.0 if i_out is None else count(row[i_out]))
            except IndexError:
                raise ValueError(f"{path}: line {rows.line_num} is not a row of {what}: too few "
                                 f"columns ({str(row)[:80]})") from None
            except ValueError as exc:
                raise ValueError(f"{path}: line {rows.line_num} is not a row of {what}: "
                                 f"{str(exc)[:120]} ({str(row)[:80]})") from None
    return (np.frombuffer(t, dtype=float), np.frombuffer(tin, dtype=float),
            np.frombuffer(tout, dtype=float))


def read_azure2023(path: str | Path, window_s: float | None = None) -> WindowSeries:
    path = Path(path)
    t, tin, tout = _stream_request_csv(
        path, "an Azure per-request trace", "TIMESTAMP",
        lambda s: (_parse_stamp(s) - _EPOCH).total_seconds(), ("ContextTokens", "GeneratedTokens"),
        tokens_required=True)
    if not t.size:
        raise ValueError(f"{path}: no requests")
    midnight = dt.datetime.combine((_EPOCH + dt.timedelta(seconds=float(t.min()))).date(), dt.time())
    rel = t - (midnight - _EPOCH).total_seconds()
    return aggregate(path.stem, rel, window_s or _default_window(rel), tin, tout,
                     day0_weekday=midnight.weekday())


_EPOCH = dt.datetime(1970, 1, 1)


def _parse_stamp(s: str) -> dt.datetime:
    """A wall-clock stamp as naive UTC (naive stays as written): ``2023-11-16 18:17:03.9799600``,
    ``2024-05-10T00:00:01+00:00``, ``...Z``; any number of fractional digits."""
    text = s.strip()
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"timestamp {s[:40]!r} is not ISO 8601") from None
    return t.astimezone(dt.timezone.utc).replace(tzinfo=None) if t.tzinfo else t


def read_burstgpt(path: str | Path, window_s: float | None = None) -> WindowSeries:
    path = Path(path)
    times, tin, tout = _stream_request_csv(path, "a BurstGPT trace", "Timestamp", float,
                                           ("Request tokens", "Response tokens"), tokens_required=False)
    return aggregate(path.stem, times, window_s or _default_window(times), tin, tout, origin_s=0.0)


def _default_window(times_s: np.ndarray) -> float:
    return LONG_WINDOW_S if len(times_s) and float(np.ptp(times_s)) > LONG_SPAN_S else 60.0


def read_mooncake(path: str | Path, window_s: float | None = None) -> WindowSeries:
    path = Path(path)
    t, tin, tout = array("d"), array("d"), array("d")
    with path.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                t.append(float(d["timestamp"]) / 1e3)
                tin.append(float(d.get("input_length", 0)))
                tout.append(float(d.get("output_length", 0)))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ValueError(f"{path}: line {i} is not a Mooncake request (a JSON object with a "
                                 f"numeric timestamp): {line[:80]!r}") from None
    times = np.frombuffer(t, dtype=float)
    return aggregate(path.stem, times, window_s or _default_window(times), np.frombuffer(tin, dtype=float),
                     np.frombuffer(tout, dtype=float), origin_s=0.0)


def read_hourly(path: str | Path, column: str | None = None) -> WindowSeries:
    """Hourly request counts (``day,hour[,date],<count columns>``): one 3600-s window per
    (day, hour); hours the file lacks and empty counts are missing windows."""
    path = Path(path)
    with path.open(newline="") as f:
        rd = csv.DictReader(f)
        head = [c.strip() for c in (rd.fieldnames or [])]
        counts = [c for c in head if c not in HOURLY_KEYS]
        if "day" not in head or "hour" not in head or not counts:
            raise ValueError(f"{path}: not an hourly count trace (header {head[:6]}; needs day, hour "
                             "and a count column)")
        col = _hourly_column(path, counts, column)
        rd.fieldnames = head
        slots: dict[int, float] = {}
        dates: dict[int, str] = {}
        for row in rd:
            try:
                day, hour = int(row["day"]), int(row["hour"])
                v = (row.get(col) or "").strip()
                n = float(v) if v else float("nan")
            except (TypeError, ValueError):
                raise ValueError(f"{path}: a row that is not an hourly count ({str(row)[:80]})") from None
            if day < 0 or not 0 <= hour < 24 or n < 0 or math.isinf(n):
                raise ValueError(f"{path}: day {day}, hour {hour}, count {n:g}: out of range")
            slot = day * 24 + hour
            if slot in slots:
                raise ValueError(f"{path}: day {day} hour {hour} appears twice")
            slots[slot] = n
            if (row.get("date") or "").strip():
                dates[slot] = row["date"].strip()
    if not slots:
        raise ValueError(f"{path}: no rows")
    first, last = min(slots), max(slots)
    if last - first + 1 > MAX_WINDOWS:
        raise ValueError(f"{path}: days {first // 24} to {last // 24}, more than {MAX_WINDOWS} hours")
    req = np.array([slots.get(k, np.nan) for k in range(first, last + 1)])
    missing = np.isnan(req)
    weekday = None
    if first in dates:  # the calendar date of the first row's day gives day 0's weekday
        try:
            weekday = (dt.date.fromisoformat(dates[first]) - dt.timedelta(days=first // 24)).weekday()
        except ValueError:
            raise ValueError(f"{path}: date {dates[first][:40]!r} is not an ISO date") from None
    name = path.stem if len(counts) == 1 else f"{path.stem}-{col}"
    return WindowSeries(name=name, window_s=3600.0, t_start_s=3600.0 * np.arange(first, last + 1),
                        requests=np.nan_to_num(req), missing=missing, day0_weekday=weekday)


def _hourly_column(path: Path, counts: list[str], column: str | None) -> str:
    if column is not None:
        if column not in counts:
            raise ValueError(f"{path}: no count column {column[:40]!r}; it has {', '.join(counts)}")
        return column
    for c in HOURLY_DEFAULT_COLUMNS:
        if c in counts:
            return c
    if len(counts) == 1:
        return counts[0]
    raise ValueError(f"{path}: several count columns ({', '.join(counts[:8])}); pass --column")


def read_servegen(path: str | Path) -> WindowSeries:
    path = Path(path)
    t, req, tin, tout, miss = [], [], [], [], []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            t.append(float(row["window_start_s"]))
            req.append(float(row["requests_est"]))
            tin.append(float(row.get("input_tokens_sum_est") or 0))
            tout.append(float(row.get("output_tokens_sum_est") or 0))
            miss.append(int(float(row.get("active_clients") or 1)) == 0)
    t_arr = np.asarray(t)
    window = float(np.median(np.diff(t_arr))) if len(t) > 1 else 600.0
    return WindowSeries(name=path.stem, window_s=window, t_start_s=t_arr, requests=np.asarray(req),
                        missing=np.asarray(miss), input_tokens=np.asarray(tin), output_tokens=np.asarray(tout))


def read_trace(path: str | Path, fmt: str = "auto", window_s: float | None = None,
               column: str | None = None) -> WindowSeries:
    """Read any supported trace; ``window_s`` sets the window for per-request formats and
    re-bins windowed ones (must be a multiple of their native window); ``column`` picks the
    count column of an hourly trace."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no trace file {path}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "azure2024-hourly":
        fmt = "hourly"
    if column is not None and fmt != "hourly":
        raise ValueError(f"a count column is chosen only in an hourly trace, not in {fmt!r}")
    if window_s is not None and not (window_s > 0 and math.isfinite(window_s)):
        raise ValueError(f"window length {window_s!r} must be a positive number of seconds")
    per_request = {"azure2023": read_azure2023, "mooncake": read_mooncake, "burstgpt": read_burstgpt}
    windowed = {"canonical": read_canonical, "servegen": read_servegen,
                "hourly": lambda p: read_hourly(p, column)}
    if fmt not in per_request and fmt not in windowed:
        raise ValueError(f"unknown trace format {fmt!r}; one of {', '.join(FORMATS)}")
    try:
        if fmt in per_request:
            return per_request[fmt](path, window_s)
        series = windowed[fmt](path)
        return series.rebin(window_s) if window_s else series
    except ValueError as exc:  # the readers' own messages, named by the file where they are not
        msg = str(exc)
        raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg[:300]}") from None
    except (KeyError, TypeError, IndexError, AttributeError, OverflowError, csv.Error) as exc:
        # a file that is not what its header or --format says: a missing field, a short row,
        # a non-number, a malformed CSV line (NUL, a field past csv's limit)
        raise ValueError(f"{path}: not a readable {fmt} trace ({type(exc).__name__}: "
                         f"{str(exc)[:120]})") from None
