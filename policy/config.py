"""The policy service's one typed configuration (``remp policy serve ...`` or ``REMP_POLICY_*``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from policy.decide import PolicyConfig
from policy.scale import ScaleConfig

MODES = ("auto", "advisory", "off")


class PolicySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REMP_POLICY_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(50071, ge=0, le=65535)
    metrics_port: int | None = Field(None, ge=0, le=65535, description="serve Prometheus "
                                     "/metrics on this port (0: a free one, logged); unset: off")
    controller: str = Field(description="controller host:port (GetTraffic, Reconfigure, ...)")
    credentials_file: Path | None = Field(
        None, description="who may call the policy, and the token it sends the controller "
        "(remp.auth); default $REMP_CREDENTIALS_FILE / $REMP_TOKEN_<ROLE>")
    controller_timeout_s: float = Field(10.0, gt=0, description="deadline of every controller call")
    redis_url: str | None = Field(None, description="keep decisions and modes in Redis; unset: "
                                  "in memory only")
    redis_prefix: str = "remp:policy:"
    profile: str = Field("h200x8-analytic", description="built-in profile name or a measured "
                         "profile JSON file")
    profile_slowdown: float = Field(1.0, ge=0.25, le=4.0, description="take the profile as this "
                                    "many times slower (capacities / S, latencies x S): a margin "
                                    "for a profile measured to be optimistic (docs/policy.md, "
                                    "'Model error')")
    calibrate: bool = Field(True, description="gpu-hours / latency: take the profile as slower "
                            "when the host's observed TPOT says it is (never faster than "
                            "--profile-slowdown; docs/policy.md, 'Calibration')")
    slo_ttft_ms: float | None = Field(None, gt=0, description="TTFT target (default: the profile's)")
    slo_tpot_ms: float | None = Field(None, gt=0, description="TPOT target (default: the profile's)")
    mode: Literal["auto", "advisory", "off"] = Field("advisory", description="initial mode of "
                                                     "every node")
    tick_seconds: float = Field(5.0, gt=0, description="how often the loop reads traffic and decides")
    window_seconds: float = Field(60.0, gt=0, description="traffic is aggregated into windows of "
                                  "this length; the forecasters see one rate per window")
    objective: Literal["gpu-hours", "latency", "goodput"] = Field(
        "gpu-hours", description="gpu-hours: the fewest GPUs keeping the SLO (the rest "
        "released); latency: the whole host, lowest TPOT; goodput: the older SLO-goodput core "
        "(same world size only)")
    horizon_seconds: float = Field(PolicyConfig.horizon_s, gt=0)
    min_dwell_seconds: float | None = Field(None, ge=0, description="no scale-down / switch "
                                            "sooner than this after the last switch (default: "
                                            "goodput 1800; gpu-hours and latency 0, plus two "
                                            "windows)")
    max_switches_per_day: int | None = Field(None, ge=0, description="rolling 24 h (default: "
                                             "goodput 6; gpu-hours and latency 12, scale-ups "
                                             "held only with none left)")
    loss_budget: float = Field(ScaleConfig.loss_budget, gt=0, lt=1, description="gpu-hours: "
                               "the expected share of the whole host's in-SLO requests a "
                               "choice may lose")
    burst_rps: float = Field(0.0, ge=0, allow_inf_nan=False, description="gpu-hours / latency: "
                             "a burst of this many req/s may come at any time (batch jobs the "
                             "traffic so far need not show); sized for from the first window, "
                             "as a burst the policy has seen is for 2 days (0: none)")
    min_gpus: int = Field(0, ge=0, le=4096, description="gpu-hours: never fewer GPUs than this "
                          "(0: no floor)")
    hard_switch_budget: bool = Field(False, description="gpu-hours: max_switches_per_day is a "
                                     "hard limit in every 24 h; by default, with no switch left, "
                                     "a scale-up still goes (one over, to the largest) when one "
                                     "window at the bet would spend the day's whole SLO error "
                                     "budget left")
    hysteresis: float = Field(PolicyConfig.hysteresis, ge=0, description="goodput only")
    dwell_override: float = Field(PolicyConfig.dwell_override, gt=0, description="goodput only")
    retry_backoff_seconds: float = Field(30.0, ge=0, description="after a Reconfigure that did not "
                                         "get an answer, wait this long before asking again (same "
                                         "request id)")
    follow_switch_seconds: float = Field(10.0, ge=0, description="auto mode: how long a tick "
                                         "waits for a switch it asked for to end (the policy "
                                         "commits its state only when the switch succeeds; one "
                                         "still running is checked again each tick)")
    max_decisions: int = Field(50_000, ge=10, description="decisions kept (memory and Redis)")
    rollout_min_nodes: int = Field(2, ge=0, description="auto mode: this many nodes or more "
                                   "making the same move (not a scale-up) go as one rollout with "
                                   "a capacity floor; 0 or 1: node by node")
    rollout_headroom: float = Field(1.2, ge=1, description="a rollout's capacity floor covers "
                                    "the nodes' forecast load times this")

    @model_validator(mode="after")
    def _check(self) -> "PolicySettings":
        if not self.controller.strip():
            raise ValueError("controller must be host:port")
        if self.horizon_seconds < self.window_seconds:
            raise ValueError("horizon_seconds must be at least one window_seconds")
        if self.objective != "goodput" and self.max_switches_per_day == 0:
            raise ValueError("max_switches_per_day must be at least 1 for objective "
                             f"{self.objective} (a scale-up needs a switch)")
        return self

    def policy_config(self) -> PolicyConfig:
        """The goodput core's configuration."""
        d = PolicyConfig()
        return PolicyConfig(horizon_s=self.horizon_seconds,
                            min_dwell_s=d.min_dwell_s if self.min_dwell_seconds is None
                            else self.min_dwell_seconds,
                            max_switches_per_day=d.max_switches_per_day
                            if self.max_switches_per_day is None else self.max_switches_per_day,
                            hysteresis=self.hysteresis, dwell_override=self.dwell_override)

    def scale_config(self) -> ScaleConfig:
        """The gpu-hours / latency core's configuration (goodput: the impact's)."""
        d = ScaleConfig()
        return ScaleConfig(objective="latency" if self.objective == "latency" else "gpu-hours",
                           horizon_s=self.horizon_seconds,
                           min_dwell_s=d.min_dwell_s if self.min_dwell_seconds is None
                           else self.min_dwell_seconds,
                           max_switches_per_day=d.max_switches_per_day
                           if not self.max_switches_per_day else self.max_switches_per_day,
                           loss_budget=self.loss_budget, burst_rps=self.burst_rps,
                           min_gpus=self.min_gpus, over_budget_up=not self.hard_switch_budget)
