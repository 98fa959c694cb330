"""What the CPU serving benchmarks share: the machine line and how a result leaves the run."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> str:
    return f"{platform.machine()} {platform.node()} cpus={len(os.sched_getaffinity(0))}"


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (None entries dropped), linearly interpolated; NaN when empty."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def emit(result: dict, out: Path | None, as_json: bool) -> None:
    """Write ``result`` to ``out`` (indented JSON) and, with ``as_json``, print it as the last
    line (one object)."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    if as_json:
        print(json.dumps(result))


# The machine monitor's child: sleeps 5 ms at a time and prints every gap over the threshold as
# "start end" (CLOCK_MONOTONIC, shared by every process here) until stdin closes.
_PAUSE_CHILD = r"""
import os, select, sys, time
thr = float(sys.argv[1])
last = time.monotonic()
while not select.select([sys.stdin], [], [], 0.005)[0]:
    now = time.monotonic()
    if now - last > thr:
        print(f"{last:.6f} {now:.6f}", flush=True)
    last = now
"""


class PauseMonitor:
    """Times when this benchmark's own session got no CPU: a process at the highest priority
    allowed (nice -20 where permitted) that wakes every 5 ms records each gap over
    ``threshold_s``.

    What the gaps were (2026-12-05; stop 25 took them for the VM being stopped by its host):
    Linux's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled, on by default) gives
    each session one share of the CPU, whatever its tasks' nice values. vLLM's workers, in the
    target's session, busy-wait pinned one to a core; the benchmark's session — its client and
    this monitor — was runnable but not run for 0.2-2.7 s at a time: the monitor's own
    ``schedstat`` run delay equalled each gap, while /proc/stat showed both cores busy with the
    workers (nice ticks) and no steal. Two plain spinners, pinned or not, yielding or not, made
    no gap. With the benchmark's session at autogroup nice -20
    (``devstack.agentproc.favour_this_session``) there were none either, and plain vLLM at 4
    clients went from 117 to 580 tok/s as the client saw it: the figures before measured the
    client's starvation. Benchmarks favour their session and keep this monitor to show that no
    gap remains.
    """

    def __init__(self, threshold_s: float = 0.1):
        self.threshold_s = threshold_s
        self.pauses: list[tuple[float, float]] = []
        self.priority = "nice 0"
        self._proc = None

    def __enter__(self) -> "PauseMonitor":
        import subprocess
        import sys

        def raise_priority():
            try:
                os.nice(-20)
            except OSError:
                pass
        self._proc = subprocess.Popen([sys.executable, "-c", _PAUSE_CHILD, str(self.threshold_s)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      preexec_fn=raise_priority)
        try:
            self.priority = f"nice {os.getpriority(os.PRIO_PROCESS, self._proc.pid)}"
        except OSError:
            pass
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self._proc.communicate(input="", timeout=30)
        self.pauses = [tuple(map(float, line.split())) for line in out.splitlines() if line]

    def overlaps(self, t0: float, t1: float) -> bool:
        """Whether [t0, t1] (time.monotonic) overlaps a recorded pause."""
        return any(a < t1 and b > t0 for a, b in self.pauses)

    def paused_s(self, t0: float, t1: float) -> float:
        """Seconds of recorded pauses inside [t0, t1]."""
        return sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in self.pauses)

    def summary(self) -> dict:
        gaps = sorted(b - a for a, b in self.pauses)
        return {"threshold_s": self.threshold_s, "monitor_priority": self.priority,
                "count": len(gaps), "total_s": round(sum(gaps), 3),
                "max_s": round(gaps[-1], 3) if gaps else 0.0}
