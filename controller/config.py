"""The controller's one typed configuration (``remp controller ...`` or ``REMP_CONTROLLER_*``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Points where the test hook can freeze the driver (after writing that state to Redis):
# ACCEPTED (switch created, intent to dispatch not yet written), DISPATCHED (intent written,
# ExecuteSwitch not yet sent), then every agent phase name as it is recorded.
PAUSE_POINTS = ("ACCEPTED", "DISPATCHED", "QUIESCING", "PREPARING_WORKERS", "MPU_APPLIED",
                "MIGRATE_KV", "RELOAD_SHARDS", "REBINDING", "SERVING_NEW")


class ControllerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REMP_CONTROLLER_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535)
    redis_url: str | None = Field(None, description="redis://[:password@]host:port/db or "
                                  "rediss:// for TLS; unset: start a private redis-server")
    redis_prefix: str = "remp:"
    token: str | None = Field(None, description="bearer token required on mutating RPCs")
    lease_seconds: float = Field(10.0, gt=0)
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus "
                                     "/metrics on this port (0: a free one, logged); unset: off")
    agent_timeout_s: float = Field(5.0, gt=0)
    # mTLS towards the agents (all three or none)
    agent_tls_ca: Path | None = None
    agent_tls_cert: Path | None = None
    agent_tls_key: Path | None = None
    test_pause_at: str | None = Field(None, description="tests only: freeze the driver of every "
                                      "switch at this point (crash tests)")

    @model_validator(mode="after")
    def _check(self) -> "ControllerSettings":
        tls = [self.agent_tls_ca, self.agent_tls_cert, self.agent_tls_key]
        if any(tls) and not all(tls):
            raise ValueError("agent mTLS needs agent_tls_ca, agent_tls_cert and agent_tls_key")
        for p in filter(None, tls):
            if not p.is_file():
                raise ValueError(f"TLS file {p} does not exist")
        if self.test_pause_at and self.test_pause_at not in PAUSE_POINTS:
            raise ValueError(f"test_pause_at must be one of {', '.join(PAUSE_POINTS)}")
        return self
