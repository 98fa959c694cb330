"""The dashboard's one typed configuration (``remp dashboard ...`` or ``REMP_DASHBOARD_*``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from dashboard import security
from remp.controllers import addresses


class DashboardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REMP_DASHBOARD_", extra="forbid")

    controller: str = Field(description="controller host:port, or several comma-separated "
                            "(controller HA: reads go to whichever answers, writes reach the "
                            "leader)")
    policy: str | None = Field(None, description="policy service host:port (unset: no policy "
                               "section)")
    credentials_file: Path | None = Field(
        None, description="remp credentials (0600 JSON, remp.auth; default $REMP_CREDENTIALS_FILE,"
        " then $REMP_TOKEN_<ROLE>). The dashboard acts with the operator token it holds, for "
        "browsers that logged in with that same token; without one it is read-only")
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    allowed_hosts: Annotated[list[str] | None, NoDecode] = Field(
        None, description="Host header values the dashboard answers to (DNS rebinding "
        "protection; anything else gets 421), exact 'name' or 'name:port', comma-separated in "
        "the environment. Default: the bind host (unless 0.0.0.0/::), 127.0.0.1, localhost and "
        "[::1], each with and without the port. Behind a proxy or ingress: the public name(s)")
    session_ttl_s: float = Field(8 * 3600, gt=0, le=7 * 24 * 3600,
                                 description="a login lasts this long (absolute, in memory: a "
                                 "restart logs everyone out)")
    cookie_secure: bool | None = Field(
        None, description="mark the session cookie Secure (sent over HTTPS only). Default: off "
        "when bound to loopback (plain http://127.0.0.1 is then the only way in, and browsers "
        "treat it as trustworthy), on otherwise (serve it behind TLS; set false only on a "
        "network you trust, knowing the login token then crosses it in clear)")
    login_failures_per_minute: int = Field(10, ge=1, le=10_000, description="failed logins "
                                           "allowed per client address per minute; beyond: 429")
    max_event_streams: int = Field(64, ge=1, le=10_000, description="concurrent /api/events "
                                   "streams (all share one Controller.Watch); beyond: 503")
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of every unary gRPC call")
    forecast_poll_s: float = Field(5.0, gt=0, description="how often the dashboard samples the "
                                   "policy's forecast to plot past forecasts against traffic")
    history_page: int = Field(50, ge=1, le=1000, description="switches shown in the history")
    rollouts_page: int = Field(50, ge=1, le=1000, description="rollouts shown in the list "
                               "(newest first)")

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, v):
        if isinstance(v, str):
            v = [x for x in v.split(",")]
        return v

    @model_validator(mode="after")
    def _check(self) -> "DashboardSettings":
        try:
            self.controller = ",".join(addresses(self.controller))
        except ValueError as exc:
            raise ValueError(f"controller: {exc}") from None
        if self.allowed_hosts is not None:
            hosts = [h.strip() for h in self.allowed_hosts if h.strip()]
            for h in hosts:
                if any(c.isspace() or c in "/@,*" for c in h) or len(h) > 261:
                    raise ValueError(f"allowed_hosts: {h[:80]!r} is not a host or host:port")
            if not hosts:
                raise ValueError("allowed_hosts is empty: nothing could reach the dashboard")
            self.allowed_hosts = hosts
        return self

    @property
    def secure_cookie(self) -> bool:
        if self.cookie_secure is not None:
            return self.cookie_secure
        return not security.is_loopback(self.host)

    def hosts_for(self, port: int) -> list[str]:
        """The Host allowlist once the listening port is known (``port`` 0 binds a free one)."""
        if self.allowed_hosts is not None:
            return list(self.allowed_hosts)
        return security.default_allowed_hosts(self.host, port)
