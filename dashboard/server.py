"""``remp dashboard``: serve the dashboard app with uvicorn until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys

from dashboard import security
from dashboard.app import build_app
from dashboard.config import DashboardSettings
from remp import logs
from remp.auth import Credentials
from remp.errors import ConfigError

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


async def serve(s: DashboardSettings, creds: Credentials) -> int:
    import uvicorn

    sock = bind(s.host, s.port)
    port = sock.getsockname()[1]
    app = build_app(s, creds, port)
    # proxy_headers off: the login rate limit counts the real peer, not an X-Forwarded-For a
    # local client could forge (uvicorn trusts it from 127.0.0.1 by default)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            proxy_headers=False, server_header=False,
                            timeout_graceful_shutdown=3, timeout_keep_alive=5)
    server = _server_class()(config)
    log.info("dashboard.ready", url=f"http://{security.host_name(s.host)}:{port}",
             controller=s.controller, policy=s.policy or "none",
             mode="login to approve" if app.state.writes_enabled else
             "read-only (no operator token in the credentials)",
             credentials=creds.source, allowed_hosts=app.state.allowed_hosts,
             secure_cookie=s.secure_cookie)
    if s.host.strip() in security.WILDCARD_BINDS and s.allowed_hosts is None:
        log.warning("dashboard.loopback_names_only", hint="bound to every address but answering "
                    "only to 127.0.0.1/localhost/[::1] Host names: set allowed_hosts "
                    "(REMP_DASHBOARD_ALLOWED_HOSTS) to the names browsers use")
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        log.info("dashboard.stopped")
    return 0


def main(s: DashboardSettings) -> int:
    try:
        creds = Credentials.load(s.credentials_file)
    except ConfigError as exc:
        print(f"remp: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(s, creds))
