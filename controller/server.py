"""``remp controller``: the Controller gRPC service (reflection, grpc.health.v1) over Redis.

With no Redis URL configured it starts a private redis-server (nothing persisted) and says so.
SIGTERM/SIGINT stop it cleanly; unfinished switches are completed by the next start.

Redis is pinged every ``redis_ping_seconds``: while it does not answer, the service's health is
NOT_SERVING (RPCs answer UNAVAILABLE), and SERVING again once it does. Redis connections come
from one pool per lane (agents, switches, reads) plus one for the event reader behind every
Watch stream and one for the ping, so no client load can starve heartbeats or switches.
"""

from __future__ import annotations

import asyncio
import signal

from controller.agents import AgentClients, TlsFiles
from controller.config import ControllerSettings
from controller.core import Controller
from controller.servicer import ControllerServicer
from controller.store import Fence, Store
from controller.watch import EventHub
from remp import logs, metrics
from remp.auth import Credentials, Role
from remp.controller.v1 import controller_pb2_grpc
from remp.grpc_util import Shutdown, make_server, set_serving

SERVICE_NAME = "remp.controller.v1.Controller"
log = logs.get_logger("remp.controller")


async def serve(s: ControllerSettings, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, watchdog_s: float | None = None) -> int:
    from remp.redisproc import RedisServer, die_with_parent, redact_url

    private = None
    url = s.redis_url
    if not url:
        # dies with this process even when it is SIGKILLed (seen: private redis-servers left
        # running by controllers that did not stop cleanly)
        private = RedisServer(generate_password=True).start(preexec_fn=die_with_parent)
        url = private.url
        log.warning("controller.private_redis", url=redact_url(url),
                    note="state lives only as long as this process (set REMP_CONTROLLER_REDIS_URL)")
    creds = Credentials.load(s.credentials_file)
    creds.require_for_server("remp controller")
    m = metrics.controller()
    fence = Fence()  # the leader term the leader-only writes carry (controller HA)

    def lane(name: str, size: int, **kw) -> Store:
        return metrics.CountingStore(Store(url, s.redis_prefix, max_connections=size, lane=name,
                                           wait_replicas=s.redis_wait_replicas,
                                           wait_ms=s.redis_wait_ms, fence=fence, **kw), m)
    store = lane("switches", s.redis_switch_connections)
    leases = lane("agents", s.redis_agent_connections)
    reads = lane("reads", s.redis_read_connections, pool_timeout=2.0)
    events = lane("events", 2)
    pinger = Store(url, s.redis_prefix, max_connections=1, lane="ping",
                   socket_timeout=max(0.2, min(2.0, s.redis_ping_seconds)))
    hub = EventHub(events, s.watch_queue_events)
    tls = (TlsFiles(s.agent_tls_ca, s.agent_tls_cert, s.agent_tls_key)
           if s.agent_tls_ca else None)
    agents = AgentClients(tls=tls, timeout=s.agent_timeout_s, creds=creds.only(Role.CONTROLLER))
    core = Controller(s, store, agents, leases=leases, reads=reads, hub=hub)
    server, health, port = make_server([SERVICE_NAME], s.host, s.port,
                                       interceptors=[metrics.RpcMetricsInterceptor(m)], auth=creds)
    msrv = metrics.serve(s.host, s.metrics_port, "controller")
    controller_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(core), server)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await server.start()
    monitor = lease_task = None
    try:
        # health stays NOT_SERVING until Redis answers (unfinished switches are recovered
        # from it before anything else)
        waited = 0
        while not await pinger.ping():
            if waited % 30 == 0:
                log.warning("controller.redis_unreachable", url=store.url,
                            detail="waiting for it; health NOT_SERVING")
            waited += 1
            try:
                await asyncio.wait_for(stop.wait(), max(1.0, s.redis_ping_seconds))
                return 0
            except asyncio.TimeoutError:
                pass
        if s.leader_lease_seconds:
            lease_task = asyncio.create_task(_lead_when_elected(s, url, core, port, fence))
            await core.start(lead=False)
        else:
            await core.start()
        redis_ok = await pinger.ping()
        await set_serving(health, [SERVICE_NAME], redis_ok)
        m.redis_up.set(1 if redis_ok else 0)
        monitor = asyncio.create_task(_watch_redis(pinger, health, s.redis_ping_seconds,
                                                   redis_ok, m))
        log.info("controller.ready", grpc=f"{s.host}:{port}", redis=store.url,
                 auth=creds.source if creds.enforcing else "NONE (REMP_ALLOW_UNAUTHENTICATED)",
                 agent_tls=bool(tls))
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        log.info("controller.stopping")
        down = Shutdown(log, "controller", watchdog_s=watchdog_s)
        if monitor is not None:
            monitor.cancel()
            await down.step("redis_monitor", asyncio.gather(monitor, return_exceptions=True))
        if lease_task is not None:  # drivers stopped, then the lease resigned: a follower
            await down.step("step_down", core.step_down())  # takes over at once
            lease_task.cancel()
            await down.step("leader_lease", asyncio.gather(lease_task, return_exceptions=True))
        await down.step("health", set_serving(health, [SERVICE_NAME], False))
        await down.step("grpc_server", server.stop(grace=2))
        await down.step("core", core.stop())
        await down.step("agent_channels", agents.close())
        for st in (store, leases, reads, events, pinger):
            await down.step(f"redis_{st.lane}", st.close())
        if private is not None:
            down.sync("private_redis", private.stop)
        if msrv is not None:
            down.sync("metrics", msrv.stop)
        log.info("controller.stopped")
    return 0


async def _lead_when_elected(s: ControllerSettings, url: str, core: Controller,
                             port: int, fence: Fence) -> None:
    """Controller HA: the lease loop (its own Redis connections); the core's drivers run while
    this controller leads, their writes fenced by the term it was elected in (``fence``: a
    deposed leader's writes are refused by Redis itself)."""
    import os
    import socket
    import uuid

    from controller.leader import LeaderLease
    from remp import redisconn

    address = s.advertise_address or f"{s.host}:{port}"
    ident = f"{socket.gethostname()[:64]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    r = redisconn.client(url, max_connections=2, timeout=2.0, decode_responses=True,
                         socket_timeout=max(0.2, s.leader_lease_seconds / 3),
                         socket_connect_timeout=max(0.2, s.leader_lease_seconds / 3))
    lease = LeaderLease(r, s.redis_prefix, ident, address, lease_s=s.leader_lease_seconds)
    core.leadership = lease

    async def elected() -> None:
        fence.term = lease.term  # before anything awaits: every write from here carries it
        try:
            await core.lead()
        except Exception as exc:  # noqa: BLE001 - keep leading; the drivers retry on their own
            log.error("controller.lead_failed", error=f"{type(exc).__name__}: {exc}")

    try:
        await lease.run(elected, core.step_down)
    finally:
        await r.aclose()


async def _watch_redis(pinger: Store, health, period: float, ok: bool, m) -> None:
    """Health follows Redis: NOT_SERVING while it does not answer a ping, SERVING again once
    it does (checked every ``period`` seconds)."""
    while True:
        await asyncio.sleep(period)
        now = await pinger.ping()
        if now == ok:
            continue
        ok = now
        m.redis_up.set(1 if ok else 0)
        await set_serving(health, [SERVICE_NAME], ok)
        if ok:
            log.info("controller.redis_back", redis=pinger.url, health="SERVING")
        else:
            log.error("controller.redis_down", redis=pinger.url, health="NOT_SERVING",
                      detail="RPCs answer UNAVAILABLE until Redis answers again")


def main(s: ControllerSettings) -> int:
    # the process's own: its stop is bounded (15 s, inside remp up's 20 s grace)
    return asyncio.run(serve(s, watchdog_s=15.0))
