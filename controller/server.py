"""``remp controller``: the Controller gRPC service (reflection, grpc.health.v1) over Redis.

With no Redis URL configured it starts a private redis-server (nothing persisted) and says so.
SIGTERM/SIGINT stop it cleanly; unfinished switches are completed by the next start.
"""

from __future__ import annotations

import asyncio
import signal

from controller.agents import AgentClients, TlsFiles
from controller.config import ControllerSettings
from controller.core import Controller
from controller.servicer import ControllerServicer
from controller.store import Store
from remp import logs, metrics
from remp.controller.v1 import controller_pb2_grpc
from remp.grpc_util import make_server, set_serving

SERVICE_NAME = "remp.controller.v1.Controller"
log = logs.get_logger("remp.controller")


async def serve(s: ControllerSettings, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> int:
    from remp.redisproc import RedisServer

    private = None
    url = s.redis_url
    if not url:
        private = RedisServer().start()
        url = private.url
        log.warning("controller.private_redis", url=url,
                    note="state lives only as long as this process (set REMP_CONTROLLER_REDIS_URL)")
    m = metrics.controller()
    store = metrics.CountingStore(Store(url, s.redis_prefix), m)
    tls = (TlsFiles(s.agent_tls_ca, s.agent_tls_cert, s.agent_tls_key)
           if s.agent_tls_ca else None)
    agents = AgentClients(tls=tls, timeout=s.agent_timeout_s)
    core = Controller(s, store, agents)
    server, health, port = make_server([SERVICE_NAME], s.host, s.port,
                                       interceptors=[metrics.RpcMetricsInterceptor(m)])
    msrv = metrics.serve(s.host, s.metrics_port, "controller")
    controller_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(core, s.token), server)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    await server.start()
    try:
        if not await store.ping():
            log.warning("controller.redis_unreachable", url=store.url)
        await core.start()
        await set_serving(health, [SERVICE_NAME], True)
        log.info("controller.ready", grpc=f"{s.host}:{port}", redis=store.url,
                 auth="bearer" if s.token else "none", agent_tls=bool(tls))
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        await set_serving(health, [SERVICE_NAME], False)
        await server.stop(grace=2)
        await core.stop()
        await agents.close()
        await store.close()
        if private is not None:
            private.stop()
        if msrv is not None:
            msrv.stop()
        log.info("controller.stopped")
    return 0


def main(s: ControllerSettings) -> int:
    return asyncio.run(serve(s))
