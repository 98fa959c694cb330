"""The node agent process (``remp agent`` runs :func:`run`): gRPC NodeAgent service + the
embedded vLLM engine + its HTTP API. The agent's state and switch logic are
:class:`node_agent.agent.NodeAgent`; the RPCs are :mod:`node_agent.servicer`.

Lifecycle (STYLE.md §10): gRPC comes up first with readiness NOT_SERVING while the engine starts;
once the engine is ready readiness turns SERVING and the OpenAI API is served. SIGTERM/SIGINT →
NOT_SERVING → HTTP and gRPC stop (with grace) → engine shutdown. An engine that dies (or a switch
that could not roll back) turns readiness NOT_SERVING and is restarted in process — new engine,
switching set-up on the same weight store, warm-up, back into the topology it served — then
SERVING again; too many deaths in a window make the agent exit 1 (its supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

from remp import logs, metrics
from remp.auth import Role
from remp.backoff import RestartBudget
from remp.grpc_util import ServerTls, make_server, set_serving
from remp.topology import Topology

from node_agent import engine_plugin
from node_agent.agent import SERVICE_NAME, NodeAgent
from node_agent.config import ResolvedAgentConfig
from node_agent.registration import keep_registered
from node_agent.servicer import NodeAgentServicer, add_to_server, service_names
from node_agent.weight_store import WeightStore

log = logs.get_logger("remp.node_agent")


def prepare_environment(cfg: ResolvedAgentConfig, state_dir: str) -> None:
    """Process environment for vLLM; must run before vLLM is imported."""
    env = (
        engine_plugin.cpu_backend_env(cfg.cpu_binds, state_dir, cfg.settings.enforce_eager)
        if cfg.host.device_type == "cpu"
        else engine_plugin.common_env(state_dir)
    )
    for k, v in env.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("VLLM_LOGGING_PREFIX", f"[node={cfg.settings.node}] ")
    if cfg.settings.worker_spin_seconds is not None:  # read by the plugin in every vLLM process
        os.environ[engine_plugin.WORKER_SPIN_ENV] = str(cfg.settings.worker_spin_seconds)
    reshard = cfg.settings.weight_reshard
    if reshard == "auto":
        reshard = "store" if cfg.host.device_type == "cpu" else "p2p"
    os.environ[engine_plugin.WEIGHT_RESHARD_ENV] = reshard  # read by the plugin in every process
    os.environ[engine_plugin.VERIFY_WEIGHTS_ENV] = "1" if cfg.settings.verify_weights else "0"
    os.environ[engine_plugin.CACHE_RUNNERS_ENV] = "1" if cfg.settings.cache_runners else "0"
    Path(os.environ["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True)
    # ImportRequest payloads: a private directory, and a key only this agent and its engine
    # know (the import connector honours nothing else: kv_transfer_params also come from HTTP)
    imports = os.path.join(state_dir, "imports")
    os.makedirs(imports, mode=0o700, exist_ok=True)
    os.chmod(imports, 0o700)
    os.environ[engine_plugin.IMPORT_DIR_ENV] = imports
    os.environ[engine_plugin.IMPORT_KEY_ENV] = secrets.token_hex(32)


def bind_http(host: str, port: int) -> socket.socket:
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets
    # whose proto says TCP; with proto 0 every small write (an SSE chunk, a response's headers)
    # waited for the client's delayed ACK — ~40 ms on the first token of each request
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot bind the HTTP API to {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def engine_spec(cfg: ResolvedAgentConfig, http_port: int):
    s = cfg.settings
    return engine_plugin.EngineSpec(
        model=cfg.model.path, tp=cfg.start_topology.tp, pp=cfg.start_topology.pp,
        dtype=cfg.dtype,
        max_model_len=s.max_model_len, max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens, enforce_eager=s.enforce_eager,
        seed=s.seed, served_model_name=s.served_model_name or Path(cfg.model.path).name,
        host=s.host, http_port=http_port, gpu_memory_utilization=s.gpu_memory_utilization,
        extra_args=s.extra_vllm_args, request_migration=s.request_migration,
        kv_cache_bytes=(int(s.kv_cache_gib * 2**30)
                        if cfg.host.device_type == "cpu" else None),
    )


async def start_engine(agent: NodeAgent, handle, store: WeightStore | None,
                       home: Topology, visit_all: bool) -> None:
    """Engine start, switching set-up (the weight store outlives engines), engine facts,
    warm-up, and the switch into ``home``; raises on any failure."""
    cfg, s = agent.cfg, agent.cfg.settings
    await handle.start()
    if store is not None:
        setup = await handle.setup_switching([(t.tp, t.pp) for t in cfg.candidates],
                                             str(store.path))
        log.info("agent.switching_ready", store=str(store.path), store_bytes=store.nbytes,
                 topologies=setup[0]["topologies"],
                 seconds=round(max(w["seconds"] for w in setup), 3))
    agent.block_size = (await handle.engine_info())["block_size"]
    agent.kv_layout = next((w["kv_layout"] for w in await handle.worker_info()
                            if w.get("kv_layout")), None)
    if s.warm_up:
        log.info("agent.warmed_up", seconds=round(await handle.warm_up(), 2))
    if s.switching and (visit_all or agent.topology != home):
        await agent.warm_up_candidates(visit_all=visit_all, home=home)
        if agent.topology != home:
            raise RuntimeError(f"could not switch the engine into {home}")


async def _until(stop: asyncio.Event, work) -> bool:
    """Await ``work`` unless ``stop`` is set first (then ``work`` is cancelled): whether it ran."""
    task = asyncio.ensure_future(work)
    stop_wait = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return False
    task.result()
    return True


async def run(cfg: ResolvedAgentConfig) -> int:
    """Run the agent until SIGTERM/SIGINT (returns 0). An engine that dies is restarted in
    process (readiness NOT_SERVING meanwhile) up to ``max_engine_restarts`` times within
    ``engine_restart_window_seconds``; one more death returns 1."""

    s = cfg.settings
    own_state_dir = s.state_dir is None
    state_dir = tempfile.mkdtemp(prefix="remp-agent-") if own_state_dir else str(s.state_dir)
    prepare_environment(cfg, state_dir)

    http_sock = bind_http(s.host, s.http_port)
    http_port = http_sock.getsockname()[1]
    agent = NodeAgent(cfg, f"http://{s.host}:{http_port}")
    agent.state_dir = state_dir
    agent.import_dir = os.environ[engine_plugin.IMPORT_DIR_ENV]
    if s.prefill_table:
        from remp.recovery import PrefillTable

        agent.migration.prefill = PrefillTable.loads(Path(s.prefill_table).read_text())
    metrics.agent()  # remp_agent_* families on vLLM's /metrics (default registry) from the start
    tls = ServerTls(s.tls_cert, s.tls_key, s.tls_client_ca) if s.tls_cert else None
    server, health, grpc_port = make_server(service_names(agent), s.host, s.grpc_port, tls=tls,
                                            auth=cfg.credentials)
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
    handle = engine_plugin.EngineHandle(engine_spec(cfg, http_port))
    agent.engine = handle
    http_task: asyncio.Task | None = None
    reg_task: asyncio.Task | None = None
    store = None
    budget = RestartBudget(limit=s.max_engine_restarts, window_s=s.engine_restart_window_seconds)

    async def stop_http() -> None:
        """The HTTP app of the engine; continuations relayed into it end."""
        nonlocal http_task
        for t in list(agent.migration.tasks):
            t.cancel()
        handle.stop_http()
        if http_task is not None:
            try:
                await asyncio.wait_for(http_task, timeout=5)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001
                http_task.cancel()
            http_task = None

    async def serve() -> None:
        nonlocal http_task
        # a duplicate of the listening socket: the HTTP server closes its copy when it stops
        # (engine restart), the port stays bound by ours
        http_task = asyncio.create_task(handle.serve_http(http_sock.dup()))
        agent.status = "serving"
        await set_serving(health, [SERVICE_NAME], True)

    try:
        try:
            if s.switching:
                store = WeightStore.create(Path(cfg.model.path), Path(s.weight_store_root),
                                           f"remp-{s.node}-{os.getpid()}")
            if not await _until(stop, start_engine(agent, handle, store, cfg.topology,
                                                   visit_all=s.warm_up and s.warm_up_candidates)):
                log.info("agent.stopped_during_start")
                return 0
        except Exception as exc:  # noqa: BLE001 - engine start failure: one line, exit non-zero
            log.error("agent.engine_start_failed", error=f"{type(exc).__name__}: {exc}")
            rc = 1
            return rc
        await serve()
        log.info("agent.ready", grpc=f"{s.host}:{grpc_port}", http=agent.http_address,
                 topology=str(agent.topology))
        if s.controller:
            host = "127.0.0.1" if s.host in ("0.0.0.0", "::", "") else s.host
            reg_task = asyncio.create_task(keep_registered(
                agent, s.controller, s.advertise_address or f"{host}:{grpc_port}",
                cfg.credentials.only(Role.AGENT)))
        dead = ""
        while not stop.is_set():
            if not dead:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass
                if handle.errored:
                    dead = "the engine died"
                elif agent.status == "dead" and agent.current is None:
                    dead = "a switch failed and could not roll back"
                elif http_task is not None and http_task.done():
                    log.error("agent.http_stopped", error=repr(http_task.exception()))
                    rc = 1
                    break
                if not dead or stop.is_set():
                    continue
            # the engine is gone: NOT_SERVING, then a new one (or give up)
            agent.status = "restarting"
            await set_serving(health, [SERVICE_NAME], False)
            delay = budget.on_death(time.monotonic())
            if delay is None:
                log.error("agent.engine_restarts_exhausted", cause=dead,
                          restarts=agent.engine_restarts, max_restarts=s.max_engine_restarts,
                          window_s=s.engine_restart_window_seconds,
                          detail="exiting; the supervisor (remp up, Kubernetes) restarts the "
                          "agent")
                agent.status, rc = "dead", 1
                break
            log.error("agent.engine_dead", cause=dead, restart_in_s=delay,
                      restarts=agent.engine_restarts)
            await stop_http()
            await loop.run_in_executor(None, handle.shutdown)
            if not await _until(stop, asyncio.sleep(delay)):
                break
            home, t0 = agent.topology, time.monotonic()
            agent.topology = cfg.start_topology
            handle = engine_plugin.EngineHandle(engine_spec(cfg, http_port))
            agent.engine = handle
            agent.engine_restarts += 1
            try:
                if not await _until(stop, start_engine(agent, handle, store, home,
                                                       visit_all=False)):
                    break
            except Exception as exc:  # noqa: BLE001 - counted as another death
                log.error("agent.engine_restart_failed", error=f"{type(exc).__name__}: {exc}")
                agent.status = "restarting"
                continue
            await serve()
            dead = ""
            log.info("agent.engine_restarted", restarts=agent.engine_restarts,
                     topology=str(agent.topology), seconds=round(time.monotonic() - t0, 2))
    finally:
        if agent.status != "dead":
            agent.status = "stopping"
        await set_serving(health, [SERVICE_NAME], False)
        if reg_task is not None:
            reg_task.cancel()
        await stop_http()
        http_sock.close()
        await server.stop(grace=2)
        await loop.run_in_executor(None, handle.shutdown)
        if store is not None:
            store.close()
        if own_state_dir:
            shutil.rmtree(state_dir, ignore_errors=True)
        log.info("agent.exit", rc=rc)
    return rc
