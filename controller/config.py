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
    redis_url: str | None = Field(None, description="redis://[:password@]host:port/db, "
                                  "rediss:// for TLS, or redis+sentinel://[:password@]host:port"
                                  "[,host:port…]/service[/db] through Redis Sentinel; unset: "
                                  "start a private redis-server")
    redis_wait_replicas: int = Field(0, ge=0, le=8, description="acknowledge a switch's and a "
                                     "rollout's writes only once this many replicas have them "
                                     "(WAIT; 1 with Sentinel: a failover loses none of them)")
    redis_wait_ms: int = Field(1000, ge=1, le=60_000, description="how long WAIT waits")
    # controller high availability (controller.leader)
    leader_lease_seconds: float | None = Field(
        None, gt=0.2, le=60, description="run several controllers on one Redis: one leads "
        "through a lease of this many seconds (3 is a good value; handover after a leader's "
        "death ≤ the lease + 0.25 s); the others serve reads and Watch and refuse writes with "
        "the leader's address. Unset: this controller always leads (run exactly one)")
    advertise_address: str | None = Field(
        None, max_length=256, description="host:port clients reach this controller at (what "
        "followers name as the leader's address); default host:port")
    redis_prefix: str = "remp:"
    credentials_file: Path | None = Field(None, description="who may call what (remp.auth); "
                                          "default $REMP_CREDENTIALS_FILE / $REMP_TOKEN_<ROLE>")
    lease_seconds: float = Field(10.0, gt=0)
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus "
                                     "/metrics on this port (0: a free one, logged); unset: off")
    agent_timeout_s: float = Field(5.0, gt=0)
    # Watch streams (one Redis reader per process, fanned out in process)
    watch_max_per_caller: int = Field(32, ge=1, description="concurrent Watch streams per "
                                      "caller (its role, or its IP when anonymous)")
    watch_max_total: int = Field(256, ge=1, description="concurrent Watch streams in total")
    watch_queue_events: int = Field(1000, ge=1, description="events buffered per Watch stream;"
                                    " a reader that falls further behind is closed "
                                    "(RESOURCE_EXHAUSTED)")
    # Redis connection pools, one per lane: load on one cannot starve another
    redis_agent_connections: int = Field(16, ge=1, description="registration, heartbeats, "
                                         "lease expiry")
    redis_switch_connections: int = Field(16, ge=1, description="Reconfigure, Abort, "
                                          "DrainNode, recommendations, the switch driver")
    redis_read_connections: int = Field(32, ge=1, description="the read RPCs (GetState, "
                                        "ListNodes, ListSwitches, Watch history, ...)")
    redis_ping_seconds: float = Field(1.0, gt=0, description="how often Redis is pinged; "
                                      "health is NOT_SERVING while it does not answer")
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
