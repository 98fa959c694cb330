"""gRPC plumbing shared by the services: channel options, server with health and reflection,
and the one place where typed errors become gRPC statuses."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from remp.auth import AuthInterceptor, Credentials, server_tls_files_from_env
from remp.errors import RempError, status_for

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_DEADLINE_S = 10.0


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        # accept the clients' keepalive pings (channel_options: every 30 s, also when idle);
        # with gRPC's server defaults they earn a GOAWAY (too_many_pings) and a reconnect
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]


@dataclass(frozen=True)
class ServerTls:
    """Server side of TLS; with ``client_ca`` every client must present a certificate signed by
    it (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes() if self.client_ca else None,
            require_client_auth=self.client_ca is not None)


def make_server(
    full_service_names: Iterable[str], host: str, port: int, interceptors: Iterable = (),
    tls: ServerTls | None = None, *, auth: Credentials,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A grpc.aio server with reflection and grpc.health.v1 already added, every call checked
    against :data:`remp.auth.RPC_ACCESS` with ``auth`` (innermost interceptor, so metrics see
    the refusals).

    Health starts NOT_SERVING for every named service (readiness) and SERVING for "" (liveness).
    Returns (server, health servicer, bound port); add service servicers before ``start()``.
    """
    server = grpc.aio.server(options=server_options(),
                             interceptors=[*interceptors, AuthInterceptor(auth)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(full_service_names)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    if tls is None:  # $REMP_TLS_CERT/KEY (+ $REMP_TLS_CA: clients need certificates)
        env_files = server_tls_files_from_env()
        tls = ServerTls(*env_files) if env_files else None
    if tls is not None:
        bound = server.add_secure_port(f"{host}:{port}", tls.credentials())
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    return server, health_servicer, bound


async def set_serving(health_servicer, names: Iterable[str], serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in names:
        await health_servicer.set(name, status)


def rpc_errors(fn: Callable) -> Callable:
    """Servicer decorator: typed remp errors become their gRPC status, with their message.

    Unknown exceptions propagate (gRPC reports them as UNKNOWN with no internals leaked) — the
    point is that every expected failure has a typed error and a deliberate status.
    """

    @functools.wraps(fn)
    async def unary(self, request, context: grpc.aio.ServicerContext):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except RempError as exc:
            _leader_metadata(context, exc)
            await context.abort(status_for(exc), str(exc))

    return unary


def _leader_metadata(context, exc: Exception) -> None:
    """A NotLeader answer names the leader in trailing metadata ``remp-leader`` as well."""
    leader = getattr(exc, "leader", "")
    if leader:
        context.set_trailing_metadata((("remp-leader", leader),))


def rpc_errors_stream(fn: Callable) -> Callable:
    """Like :func:`rpc_errors` for server-streaming methods (async generators)."""

    @functools.wraps(fn)
    async def stream(self, request, context: grpc.aio.ServicerContext):
        try:
            async for item in fn(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except RempError as exc:
            await context.abort(status_for(exc), str(exc))

    return stream


# ------------------------------------------------------------------------------ shutdown

class Shutdown:
    """A service's stop, bounded and explained: each step gets ``step_s`` seconds (a step that
    hangs is logged by name and skipped), and a watchdog armed when the stop begins dumps every
    thread's stack to stderr (the service's log) and exits the process if it is still alive
    ``watchdog_s`` seconds later — interpreter exit included (a non-daemon thread, the default
    executor; only ``main()`` arms it). A supervisor's SIGKILL is then never needed, and when the watchdog fires the log
    says where the process was stuck."""

    def __init__(self, log, service: str, step_s: float = 5.0, watchdog_s: float | None = None):
        import faulthandler
        import sys

        self.log, self.service, self.step_s = log, service, step_s
        if watchdog_s:  # only where the service owns the process (never in a test's process)
            faulthandler.dump_traceback_later(watchdog_s, exit=True, file=sys.stderr)

    async def step(self, name: str, aw) -> None:
        import asyncio

        try:
            await asyncio.wait_for(aw, self.step_s)
        except asyncio.TimeoutError:
            pending = [t.get_coro().__qualname__ for t in asyncio.all_tasks()
                       if t is not asyncio.current_task()]
            self.log.error(f"{self.service}.stop_step_timed_out", step=name,
                           seconds=self.step_s, pending_tasks=pending[:20])
        except Exception as exc:  # noqa: BLE001 - a failing step must not stop the others
            self.log.warning(f"{self.service}.stop_step_failed", step=name, error=repr(exc))

    def sync(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            self.log.warning(f"{self.service}.stop_step_failed", step=name, error=repr(exc))
