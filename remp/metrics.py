"""Prometheus metrics of every remp process, defined in this one module.

Each process creates only its own families, on first use, in prometheus-client's default
registry (``controller()``, ``agent()``, ``policy()``):

- the **node agent** serves them through vLLM's own ``/metrics`` (vLLM's app exposes the default
  registry of the agent process), next to vLLM's ``vllm:*`` metrics;
- the **controller** and the **policy** serve them with :func:`serve` on their ``metrics_port``.

The controller and the agent have the same switch families (``remp_controller_switch_*`` and
``remp_agent_switch_*``): the agent counts what it executed (warm-up visits before ready are not
counted), the controller what it recorded (its history, including refusals and recoveries).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from remp import logs
from remp.errors import Unavailable
from remp.transaction import Outcome

log = logs.get_logger("remp.metrics")

# Phases take milliseconds (CPU, tiny model) to seconds (GPU, big model); downtime likewise.
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 30.0, 60.0, 120.0, 300.0)
SWITCH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                  300.0, 600.0)


@dataclass(frozen=True)
class SwitchFacts:
    """What the switch metrics need, from either record type (agent dataclass or proto)."""

    outcome: Outcome
    phase_seconds: Mapping[str, float]
    total_s: float
    downtime_s: float
    kv_bytes: int
    weight_bytes: int
    held: int
    preempted: int
    in_flight: int


def facts_from_agent(rec) -> SwitchFacts:
    """``node_agent.switch.SwitchRecord`` → facts."""
    return SwitchFacts(rec.outcome, rec.phase_seconds(), rec.total_s, rec.downtime_s,
                       rec.kv_bytes_moved, rec.weight_bytes_loaded, rec.requests_held,
                       rec.requests_preempted, rec.requests_in_flight)


class SwitchMetrics:
    """The switch families under one prefix (``remp_controller`` or ``remp_agent``)."""

    def __init__(self, prefix: str, registry=REGISTRY):
        p = prefix
        self.switches = Counter(f"{p}_switches", "Switches finished, by outcome", ["outcome"],
                                registry=registry)
        self.phase_seconds = Histogram(f"{p}_switch_phase_seconds",
                                       "Seconds spent in each switch phase (succeeded and "
                                       "rolled-back switches)", ["phase"], buckets=PHASE_BUCKETS,
                                       registry=registry)
        self.total_seconds = Histogram(f"{p}_switch_seconds", "Switch duration, first phase to "
                                       "last", ["outcome"], buckets=SWITCH_BUCKETS,
                                       registry=registry)
        self.downtime = Histogram(f"{p}_switch_downtime_seconds", "Request-visible downtime of "
                                  "succeeded switches", buckets=SWITCH_BUCKETS, registry=registry)
        self.kv_bytes = Counter(f"{p}_switch_kv_bytes_moved", "KV cache bytes migrated",
                                registry=registry)
        self.weight_bytes = Counter(f"{p}_switch_weight_bytes_loaded", "Weight shard bytes "
                                    "loaded", registry=registry)
        self.held = Counter(f"{p}_switch_requests_held", "Requests that arrived during a switch "
                            "and were held", registry=registry)
        self.preempted = Counter(f"{p}_switch_requests_preempted", "Requests preempted by a "
                                 "switch (recomputed)", registry=registry)
        self.in_flight = Counter(f"{p}_switch_requests_in_flight", "Requests in flight when a "
                                 "switch froze the engine (kept with their KV)", registry=registry)

    def observe(self, f: SwitchFacts) -> None:
        self.switches.labels(f.outcome).inc()
        for phase, s in f.phase_seconds.items():
            if s >= 0 and math.isfinite(s):
                self.phase_seconds.labels(phase).observe(s)
        if f.total_s > 0:
            self.total_seconds.labels(f.outcome).observe(f.total_s)
        if f.outcome == Outcome.SUCCEEDED and f.downtime_s > 0:
            self.downtime.observe(f.downtime_s)
        self.kv_bytes.inc(max(0, f.kv_bytes))
        self.weight_bytes.inc(max(0, f.weight_bytes))
        self.held.inc(max(0, f.held))
        self.preempted.inc(max(0, f.preempted))
        self.in_flight.inc(max(0, f.in_flight))


# ------------------------------------------------------------------------------ controller

class ControllerMetrics(SwitchMetrics):
    def __init__(self, registry=REGISTRY):
        super().__init__("remp_controller", registry)
        self.redis_errors = Counter("remp_controller_redis_errors", "Redis calls that failed "
                                    "(Redis unreachable or timed out), by store operation",
                                    ["op"], registry=registry)
        self.rpcs = Counter("remp_controller_rpcs", "gRPC calls served, by method and status code",
                            ["method", "code"], registry=registry)
        self.rpc_errors = Counter("remp_controller_rpc_errors", "gRPC calls that ended with a "
                                  "status other than OK, by method and code", ["method", "code"],
                                  registry=registry)
        self.redis_up = Gauge("remp_controller_redis_up", "1 while Redis answers the "
                              "controller's periodic ping (health SERVING), else 0",
                              registry=registry)
        self.watch_streams = Gauge("remp_controller_watch_streams", "Watch streams open now",
                                   registry=registry)
        self.watch_refused = Counter("remp_controller_watch_refused", "Watch streams refused "
                                     "by the per-caller or total cap (RESOURCE_EXHAUSTED)",
                                     registry=registry)
        self.watch_dropped = Counter("remp_controller_watch_dropped", "Watch streams closed "
                                     "because their reader fell too far behind",
                                     registry=registry)


class AgentMetrics(SwitchMetrics):
    def __init__(self, registry=REGISTRY):
        super().__init__("remp_agent", registry)

    def switch_finished(self, rec) -> None:
        """Hook: the agent finished executing a switch; warm-up visits are not counted."""
        if rec.reason == "warm-up":
            return
        self.observe(facts_from_agent(rec))


class PolicyMetrics:
    def __init__(self, registry=REGISTRY):
        self.forecast = Gauge("remp_policy_forecast_requests_per_second", "The chosen "
                              "forecaster's rate for the decision horizon (req/s)", ["node"],
                              registry=registry)
        self.actual = Gauge("remp_policy_observed_requests_per_second", "Observed request rate "
                            "over the last aggregation window (req/s)", ["node"],
                            registry=registry)
        self.forecast_error = Gauge("remp_policy_forecast_error_ratio", "Chosen forecaster's "
                                    "rolling backtest error (mean |error| / mean rate)", ["node"],
                                    registry=registry)
        self.slowdown = Gauge("remp_policy_profile_slowdown", "How many times slower than the "
                              "configured profile the node's last decision took its host, "
                              "calibrated from its observed TPOT (1: as configured)", ["node"],
                              registry=registry)
        self.ttft_slowdown = Gauge("remp_policy_profile_ttft_slowdown", "How many times slower "
                                   "than the configured profile's TTFT the node's last decision "
                                   "took its host's, calibrated from its observed TTFT (1: as "
                                   "configured)", ["node"], registry=registry)
        self.decisions = Counter("remp_policy_decisions", "Decisions made, by mode and whether "
                                 "they called for a switch", ["mode", "switch"],
                                 registry=registry)
        self.actions = Counter("remp_policy_actions", "Decisions acted on (Reconfigure in auto, "
                               "RecordRecommendation in advisory), by mode and outcome",
                               ["mode", "result"], registry=registry)

    def decided(self, n, rec, window_s: float, now_s: float) -> None:
        """Hook: the policy made a decision ``rec`` for node ``n`` (``PolicyService._tick_node``;
        ``n`` has ``name``, ``observed`` samples, the forecaster ``chooser`` and the calibrated
        profile's ``slowdown`` and ``ttft_slowdown``)."""
        d = rec.decision
        self.decisions.labels(rec.mode, "yes" if d.switch else "no").inc()
        if math.isfinite(d.forecast_rps):
            self.forecast.labels(n.name).set(d.forecast_rps)
        self.slowdown.labels(n.name).set(n.slowdown)
        self.ttft_slowdown.labels(n.name).set(n.ttft_slowdown)
        rate = observed_rate(n.observed, window_s, now_s)
        if rate is not None:
            self.actual.labels(n.name).set(rate)
        try:
            err = float(n.chooser.scores()[n.chooser.chosen])
        except (AttributeError, IndexError, TypeError, ValueError):
            err = math.nan
        if math.isfinite(err):
            self.forecast_error.labels(n.name).set(err)
        result = action_result(rec.outcome)
        if result:
            self.actions.labels(rec.mode, result).inc()


def action_result(outcome: str) -> str:
    """The short result of a decision that called the controller ('' if it called nothing)."""
    first = outcome.split(":")[0].split(" ")[0] if outcome else ""
    if outcome.startswith("recommendation not recorded"):
        return "not_recorded"
    if first == "recommended" and not outcome.startswith("recommended earlier"):
        return "recommended"
    if outcome.startswith("rolled back"):
        return "rolled_back"
    return first if first in ("accepted", "noop", "duplicate", "refused", "unavailable", "failed",
                              "aborted", "unknown", "missing") else ""


def observed_rate(samples: Iterable, window_s: float, now_s: float) -> float | None:
    """Requests per second over the samples that end within the last ``window_s`` (pure)."""
    req = secs = 0.0
    for s in samples:
        if s.at_s > now_s - window_s and s.window_s > 0:
            req += s.requests
            secs += s.window_s
    return req / secs if secs > 0 else None


# ------------------------------------------------------------------------------ singletons

_lock = threading.Lock()
_made: dict[str, object] = {}


def _one(name: str, factory):
    with _lock:
        if name not in _made:
            _made[name] = factory()
        return _made[name]


def controller() -> ControllerMetrics:
    return _one("controller", ControllerMetrics)


def agent() -> AgentMetrics:
    return _one("agent", AgentMetrics)


def policy() -> PolicyMetrics:
    return _one("policy", PolicyMetrics)


# ------------------------------------------------------------------------------ serving

class MetricsServer:
    """``/metrics`` of the default registry on ``host:port`` (0: a free port), in a thread."""

    def __init__(self, host: str, port: int):
        self.httpd, self.thread = start_http_server(port, addr=host)
        self.host, self.port = host, self.httpd.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def serve(host: str, port: int | None, service: str) -> MetricsServer | None:
    """Start the metrics endpoint when ``port`` is set (None: off); logs its URL."""
    if port is None:
        return None
    try:
        srv = MetricsServer(host, port)
    except OSError as exc:
        raise OSError(f"cannot bind /metrics to {host}:{port}: {exc.strerror or exc}") from None
    log.info(f"{service}.metrics_listening", metrics=srv.url)
    return srv


# ------------------------------------------------------------------------------ adapters

class CountingStore:
    """Wraps the controller's Store: every coroutine method that raises ``Unavailable``
    (Redis unreachable) increments ``remp_controller_redis_errors{op}``; everything else passes
    through unchanged."""

    def __init__(self, store, m: ControllerMetrics):
        self._store, self._m = store, m

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr
        import inspect

        if not inspect.iscoroutinefunction(attr):
            return attr
        m = self._m

        async def call(*a, **kw):
            try:
                return await attr(*a, **kw)
            except Unavailable:
                m.redis_errors.labels(name).inc()
                raise
        return call


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every served RPC by method and final status code (``remp_controller_rpcs``) and
    the non-OK ones (``remp_controller_rpc_errors``)."""

    def __init__(self, m: ControllerMetrics):
        self.m = m

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        name = method.rsplit("/", 1)[-1]
        self.m.rpcs.labels(name, code.name).inc()
        if code != grpc.StatusCode.OK:
            self.m.rpc_errors.labels(name, code.name).inc()

    @staticmethod
    def _code(context, exc: BaseException | None) -> grpc.StatusCode:
        try:
            code = context.code()
        except Exception:  # noqa: BLE001 - older grpc: no code() on the aio context
            code = None
        if isinstance(code, grpc.StatusCode):
            return code
        if isinstance(exc, BaseException) and exc is not None:
            return grpc.StatusCode.CANCELLED if isinstance(exc, _cancelled()) else \
                grpc.StatusCode.UNKNOWN
        return grpc.StatusCode.OK

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        me = self
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                try:
                    out = await inner(request, context)
                except BaseException as exc:
                    me._count(method, me._code(context, exc))
                    raise
                me._count(method, me._code(context, None))
                return out
            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            inner_s = handler.unary_stream

            async def stream(request, context):
                try:
                    async for item in inner_s(request, context):
                        yield item
                except BaseException as exc:
                    me._count(method, me._code(context, exc))
                    raise
                me._count(method, me._code(context, None))
            return grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return handler


def _cancelled():
    import asyncio

    return asyncio.CancelledError
