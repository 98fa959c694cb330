"""Start a real ``remp dashboard`` process on a free loopback port (tests). It inherits the
environment, so ``REMP_CREDENTIALS_FILE`` (tests/conftest.py) gives it the operator token it acts
with; :meth:`DashboardProcess.login` logs a client in with that token."""

from __future__ import annotations

from pathlib import Path

import httpx

from devstack.agentproc import ServiceProcess, free_port
from remp.auth import Credentials, Role

CSRF = {"x-remp-dashboard": "1"}


class DashboardProcess(ServiceProcess):
    kind = "dashboard"

    def __init__(self, controller: str, log_dir: Path, policy: str | None = None,
                 name: str = "dashboard", env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.controller, self.policy, self.env = controller, policy, env or {}
        self._log_path = Path(log_dir) / f"{name}.log"
        self.proc = None

    @property
    def log_path(self) -> Path:
        return self._log_path

    def command(self) -> list[str]:
        return ["dashboard", "--controller", self.controller, "--port", str(self.port),
                "--host", "127.0.0.1", *(["--policy", self.policy] if self.policy else [])]

    def start(self) -> "DashboardProcess":
        self.launch(self.env)
        return self

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/api/config", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @staticmethod
    def operator_token() -> str:
        """The operator token of $REMP_CREDENTIALS_FILE / $REMP_TOKEN_OPERATOR."""
        tok = Credentials.load().tokens.get(Role.OPERATOR)
        if not tok:
            raise RuntimeError("no operator token in the credentials (REMP_CREDENTIALS_FILE)")
        return tok

    def login(self, token: str | None = None, timeout: float = 10) -> httpx.Client:
        """An httpx client (not yet opened: use it in ``with``) holding the session cookie of a
        login with ``token`` (default the operator's), sending the dashboard's CSRF header."""
        r = httpx.post(f"{self.url}/api/login", json={"token": token or self.operator_token()},
                       headers=CSRF, timeout=timeout)
        r.raise_for_status()
        return httpx.Client(base_url=self.url, timeout=timeout, headers=CSRF, cookies=r.cookies)

    def stop(self, timeout: float = 20) -> int:
        return super().stop(timeout)
