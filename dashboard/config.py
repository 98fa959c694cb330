"""The dashboard's one typed configuration (``remp dashboard ...`` or ``REMP_DASHBOARD_*``)."""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class DashboardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REMP_DASHBOARD_", extra="forbid")

    controller: str = Field(description="controller host:port")
    policy: str | None = Field(None, description="policy service host:port (unset: no policy "
                               "section)")
    token: str | None = Field(None, description="the controller's bearer token; with it the "
                              "dashboard can approve recommendations and start switches, without "
                              "it the dashboard is read-only")
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    rpc_timeout_s: float = Field(5.0, gt=0, description="deadline of every unary gRPC call")
    forecast_poll_s: float = Field(5.0, gt=0, description="how often the dashboard samples the "
                                   "policy's forecast to plot past forecasts against traffic")
    history_page: int = Field(50, ge=1, le=1000, description="switches shown in the history")

    @model_validator(mode="after")
    def _check(self) -> "DashboardSettings":
        if not self.controller.strip():
            raise ValueError("controller must be host:port")
        return self
