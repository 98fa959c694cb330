"""``remp dashboard``: serve the dashboard app with uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket

from dashboard.app import build_app
from dashboard.config import DashboardSettings
from remp import logs

log = logs.get_logger("remp.dashboard")


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the dashboard to {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    return sock


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """SIGTERM/SIGINT → graceful shutdown → exit 0 (uvicorn's own handlers re-raise the
        signal after shutting down, which makes the exit code -15)."""

        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, lambda: setattr(self, "should_exit", True))
            yield

    return Server


async def serve(s: DashboardSettings) -> int:
    import uvicorn

    sock = bind(s.host, s.port)
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(s), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3, timeout_keep_alive=5)
    server = _server_class()(config)
    log.info("dashboard.ready", url=f"http://{s.host}:{port}", controller=s.controller,
             policy=s.policy or "none", mode="approve enabled" if s.token else "read-only")
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        log.info("dashboard.stopped")
    return 0


def main(s: DashboardSettings) -> int:
    return asyncio.run(serve(s))
