"""``remp policy serve``: the Policy gRPC service (reflection, grpc.health.v1) and its tick loop.

SIGTERM/SIGINT → NOT_SERVING → the loop stops → ``server.stop(grace)`` → channels closed.
"""

from __future__ import annotations

import asyncio
import signal

from policy.calibrate import CalibrationConfig
from policy.config import PolicySettings
from policy.controller_client import GrpcController
from policy.profiles import SLO, load_profile
from policy.service import PolicyService
from policy.servicer import PolicyServicer
from policy.store import RedisDecisionStore
from remp import logs, metrics
from remp.auth import Credentials, Role
from remp.redisproc import redact_url
from remp.errors import ConfigError
from remp.grpc_util import Shutdown, make_server, set_serving
from remp.policy.v1 import policy_pb2_grpc

SERVICE_NAME = "remp.policy.v1.Policy"
log = logs.get_logger("remp.policy")


def build_service(s: PolicySettings, creds: Credentials
                  ) -> tuple[PolicyService, GrpcController, RedisDecisionStore | None]:
    try:
        profile = load_profile(s.profile).slowed(s.profile_slowdown)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    d = profile.default_slo
    slo = SLO(s.slo_ttft_ms / 1e3 if s.slo_ttft_ms else d.ttft_s,
              s.slo_tpot_ms / 1e3 if s.slo_tpot_ms else d.tpot_s)
    ctl = GrpcController(s.controller, creds.only(Role.POLICY), s.controller_timeout_s)
    store = RedisDecisionStore(s.redis_url, s.redis_prefix) if s.redis_url else None
    svc = PolicyService(profile, ctl, slo=slo, config=s.policy_config(),
                        window_s=s.window_seconds, default_mode=s.mode, store=store,
                        retry_backoff_s=s.retry_backoff_seconds, max_decisions=s.max_decisions,
                        rollout_min_nodes=s.rollout_min_nodes,
                        rollout_headroom=s.rollout_headroom,
                        follow_s=s.follow_switch_seconds,
                        objective=s.objective, scale=s.scale_config(),
                        calibration=CalibrationConfig(enabled=s.calibrate))
    return svc, ctl, store


async def serve(s: PolicySettings, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, bound: list[int] | None = None,
                watchdog_s: float | None = None) -> int:
    creds = Credentials.load(s.credentials_file)
    creds.require_for_server("remp policy serve")
    svc, ctl, store = build_service(s, creds)
    server, health, port = make_server([SERVICE_NAME], s.host, s.port, auth=creds)
    if bound is not None:
        bound.append(port)
    policy_pb2_grpc.add_PolicyServicer_to_server(PolicyServicer(svc), server)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    msrv = metrics.serve(s.host, s.metrics_port, "policy")
    metrics.policy()
    await server.start()
    ticker = None
    try:
        await svc.start()
        ticker = asyncio.create_task(svc.run(s.tick_seconds, stop))
        await set_serving(health, [SERVICE_NAME], True)
        log.info("policy.ready", grpc=f"{s.host}:{port}", controller=s.controller,
                 profile=svc.profile.name, profile_kind=svc.profile.kind, mode=s.mode,
                 objective=s.objective,
                 tick_s=s.tick_seconds, window_s=s.window_seconds,
                 slo_ttft_ms=svc.slo.ttft_s * 1e3, slo_tpot_ms=svc.slo.tpot_s * 1e3,
                 redis=redact_url(s.redis_url) if s.redis_url else "none (decisions in memory)")
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        stop.set()
        log.info("policy.stopping")
        down = Shutdown(log, "policy", watchdog_s=watchdog_s)
        await down.step("health", set_serving(health, [SERVICE_NAME], False))
        if ticker is not None:
            await down.step("ticker", ticker)
        await down.step("grpc_server", server.stop(grace=2))
        await down.step("controller_channel", ctl.close())
        if store is not None:
            await down.step("redis", store.close())
        if msrv is not None:
            down.sync("metrics", msrv.stop)
        log.info("policy.stopped")
    return 0
