"""A ServeGen category's per-client arrival rates summed to 10-min request counts (issue 16)

    .venv/bin/python bench/servegen_aggregate.py GIT_DIR CATEGORY OUT.csv
    # e.g. GIT_DIR from the fetch tool's snapshot of alibaba/ServeGen, CATEGORY language/m-small

The method of ``../shared/traces/PROVENANCE.md`` (section 5), so the output reads with
``policy.traces.read_servegen`` like the shared ServeGen traces: per 600-s window,
``requests_est`` = sum over the category's clients of ``rate x 600`` (each client's
``data/<CATEGORY>/chunk-<client>-trace.csv``: ``start_s, rate (req/s), cv, distribution, p1,
p2``), ``active_clients`` = clients with a rate above 0 (a window with none is a collection gap,
read as missing). Token sums are left out: the replay does not read them. Checked against the
shared ``servegen_m-mid_10min.csv``: the same ``requests_est`` and ``active_clients`` in all 2,016
windows.

Reads the snapshot with ``git show`` (no work tree needed); nothing here touches the network.
"""

from __future__ import annotations

import csv
import io
import subprocess
import sys

import numpy as np


def client_traces(git_dir: str, category: str) -> list[str]:
    out = subprocess.run(["git", "-C", git_dir, "ls-tree", "-r", "--name-only", "HEAD", f"data/{category}"],
                         capture_output=True, text=True, check=True).stdout.split()
    return sorted(n for n in out if n.endswith("-trace.csv"))


def aggregate(git_dir: str, category: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(window starts, requests per window, active clients per window, clients)."""
    names = client_traces(git_dir, category)
    if not names:
        raise SystemExit(f"no chunk-*-trace.csv under data/{category} in {git_dir}")
    t0 = total = active = None
    for n in names:
        text = subprocess.run(["git", "-C", git_dir, "show", f"HEAD:{n}"], capture_output=True, text=True,
                              check=True).stdout
        rows = [r for r in csv.reader(io.StringIO(text)) if r]
        t = np.array([float(r[0]) for r in rows])
        rate = np.array([float(r[1]) for r in rows])
        if t0 is None:
            t0, total, active = t, np.zeros(len(t)), np.zeros(len(t), dtype=int)
        if not np.array_equal(t, t0):  # the same windows, in number and start
            raise SystemExit(f"{n}: its windows differ from the category's first client's")
        total += rate * 600.0
        active += rate > 0
    return t0, total, active, len(names)


def main() -> None:
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    git_dir, category, out = sys.argv[1:]
    t, req, act, clients = aggregate(git_dir, category)
    with open(out, "w", newline="") as f:
        f.write("window_start_s,day,hour_of_day,requests_est,req_per_s,active_clients\n")
        for ts, r, a in zip(t, req, act):
            f.write(f"{int(ts)},{int(ts // 86400)},{int(ts % 86400 // 3600)},{r:.1f},{r / 600:.4f},{int(a)}\n")
    print(f"{category}: {clients} clients, {len(t)} windows, {int((act == 0).sum())} without an active "
          f"client -> {out}")


if __name__ == "__main__":
    main()
