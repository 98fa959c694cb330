"""The suite's backstop (tests/conftest.py): a test stuck where pytest-timeout's SIGALRM cannot
end it is ended, with every thread's stack on stderr — not a hang of the whole run. A main
thread that blocks the signal: the backstop thread kills the run's children and exits with 70.
A main thread that holds the GIL in C (no Python thread can run): faulthandler's watchdog."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

STUCK = """
import signal, subprocess, time

def test_stuck(tmp_path):
    child = subprocess.Popen(["sleep", "120"])
    (tmp_path.parent.parent / "child.pid").write_text(str(child.pid))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # pytest-timeout cannot fire
    time.sleep(120)
"""


FROZEN = """
import ctypes, signal

def test_frozen():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    ctypes.PyDLL(None).sleep(120)  # a C call that keeps the GIL: no Python thread runs
"""


def run_stuck(tmp_path, body: str) -> subprocess.CompletedProcess:
    """pytest on one test file ``body``, with this suite's backstop, a 1-s timeout and 1 s grace."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_configure, pytest_runtest_protocol  # noqa: F401\n")
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REMP_TEST_BACKSTOP_GRACE_S": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "timeout=1", "--basetemp", str(tmp_path / "bt"),
                           str(tmp_path / "test_stuck.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_a_test_the_timeout_cannot_end_is_ended_by_the_backstop(tmp_path):
    r = run_stuck(tmp_path, STUCK)
    assert r.returncode == 70, r.stdout[-2000:] + r.stderr[-2000:]
    assert "backstop: " in r.stderr and "test_stuck.py::test_stuck" in r.stderr
    assert "in test_stuck" in r.stderr  # the stuck thread's stack
    pid = int((tmp_path / "child.pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_frozen_interpreter_is_ended_by_faulthandler(tmp_path):
    r = run_stuck(tmp_path, FROZEN)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Timeout (0:00:03)!" in r.stderr and "in test_frozen" in r.stderr
