"""Drive a real ``remp up`` process in tests (tests/integration/test_up_cli.py, the e2e)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from remp.auth import ENV_FILE

CHILD_MARKS = {"redis": "redis-server", "controller": " controller ", "policy": " policy serve",
               "dashboard": " dashboard ", "agent": " agent "}


class UpProcess:
    """``remp up ARGS`` in its own session; stdout collected line by line."""

    def __init__(self, args: list[str], log_dir: Path, env: dict[str, str] | None = None):
        self.log_dir = log_dir
        base = {k: v for k, v in os.environ.items()
                if k not in ("REMP_REDIS_URL", ENV_FILE) and not k.startswith("REMP_TOKEN_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "up", "--free-ports", "--log-dir", str(log_dir),
             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**base, **(env or {})}, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(
            iter(self.proc.stdout.readline, "")), daemon=True)
        self.reader.start()
        self.addr: dict = {}

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_line(self, prefix: str, timeout: float, after: int = 0) -> str:
        """The first line from index ``after`` on that starts with ``remp up: `` + prefix."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((ln for ln in self.lines[after:]
                          if ln.startswith("remp up: " + prefix)), None)
            if found:
                return found
            assert self.proc.poll() is None, self.output
            time.sleep(0.2)
        raise AssertionError(f"no 'remp up: {prefix}' in {timeout:.0f} s:\n{self.output}")

    def wait_ready(self, timeout: float) -> dict:
        line = self.wait_line("ready ", timeout)
        self.addr = json.loads(line[len("remp up: ready "):])
        return self.addr

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def children(self) -> dict[str, psutil.Process]:
        """Its direct children by role (redis, controller, policy, dashboard, agent)."""
        out = {}
        for p in psutil.Process(self.proc.pid).children():
            try:
                cmd = " " + " ".join(p.cmdline()) + " "
            except psutil.NoSuchProcess:
                continue
            for name, mark in CHILD_MARKS.items():
                if mark in cmd and name not in out:
                    out[name] = p
                    break
        return out

    def argv_offenders(self, secrets: list[str]) -> list[tuple[int, str]]:
        """Every descendant whose /proc/<pid>/cmdline (what ps shows) holds one of ``secrets``."""
        bad = []
        for p in self.descendants():
            try:
                cmd = Path(f"/proc/{p.pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if any(s in cmd for s in secrets):
                bad.append((p.pid, cmd.replace("\0", " ")[:200]))
        return bad

    def stop(self, sig=signal.SIGINT, timeout: float = 180) -> int:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.reader.join(10)
        self.proc.stdout.close()


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
