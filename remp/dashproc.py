"""Start a real ``remp dashboard`` process on a free loopback port (tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from remp.agentproc import free_port


class DashboardProcess:
    def __init__(self, controller: str, log_dir: Path, policy: str | None = None,
                 token: str | None = None, name: str = "dashboard"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.controller, self.policy, self.token = controller, policy, token
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "DashboardProcess":
        cmd = [sys.executable, "-m", "remp.cli", "dashboard", "--controller", self.controller,
               "--port", str(self.port), "--host", "127.0.0.1"]
        if self.policy:
            cmd += ["--policy", self.policy]
        if self.token:
            cmd += ["--token", self.token]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "REMP_LOG_FORMAT": "json"},
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 60) -> "DashboardProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dashboard exited rc={self.proc.returncode}:\n"
                                   + self.log_path.read_text()[-3000:])
            try:
                if httpx.get(f"{self.url}/api/config", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"dashboard not ready:\n{self.log_path.read_text()[-3000:]}")

    def stop(self, timeout: float = 20) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        self._log.close()
        self.proc = None
        return rc

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc):
        self.stop()
