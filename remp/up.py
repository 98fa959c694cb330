"""``remp up``: the whole stack on one machine for trying remp out.

Starts, in order: Redis (a private ``redis-server`` unless ``$REMP_REDIS_URL`` is set), the
controller, the dashboard and the policy (advisory), then one node agent on the tiny model
(built with :mod:`remp.modelgen` when missing); prints every address once each is ready and a
last line ``remp up: ready``. Ctrl-C or SIGTERM stops them in reverse order (SIGTERM, then
SIGKILL of the process group after a grace period) and kills any descendant still alive, so no
process outlives it. A child that dies on its own stops the stack with exit code 1.

Each child runs in its own session (Ctrl-C reaches only ``remp up``, which stops them in order)
and gets SIGTERM from the kernel if ``remp up`` itself is killed (Linux ``PR_SET_PDEATHSIG``).
Their logs go to ``--log-dir`` (default ``.remp/up``).
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from remp.redisproc import RedisServer

DEFAULT_PORTS = {"controller": 50051, "controller_metrics": 9151, "agent_grpc": 50061,
                 "agent_http": 8000, "policy": 50071, "policy_metrics": 9171, "dashboard": 8080}


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="run the whole stack locally: Redis, controller, node agent, "
                       "policy, dashboard (Ctrl-C stops all)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--model", type=Path, default=Path(".remp/tiny-llama"),
                   help="model directory (built as the tiny Llama when missing)")
    p.add_argument("--tp", type=int, default=int(os.environ.get("REMP_TP", 2)))
    p.add_argument("--pp", type=int, default=int(os.environ.get("REMP_PP", 1)))
    p.add_argument("--node", default="local")
    p.add_argument("--token", default=None, help="controller bearer token (default: a new random "
                   "one, printed)")
    p.add_argument("--profile", default=None, help="policy profile (default: the measured "
                   "tiny-cpu-2core profile)")
    p.add_argument("--mode", default="advisory", choices=["advisory", "auto", "off"])
    p.add_argument("--free-ports", action="store_true", help="pick free ports instead of the "
                   "defaults (" + ", ".join(f"{k} {v}" for k, v in DEFAULT_PORTS.items()) + ")")
    for k, v in DEFAULT_PORTS.items():
        p.add_argument(f"--{k.replace('_', '-')}-port", dest=f"port_{k}", type=int, default=None,
                       help=f"default {v}")
    p.add_argument("--log-dir", type=Path, default=Path(".remp/up"))
    p.add_argument("--agent-timeout", type=float, default=900.0,
                   help="seconds to wait for the agent to be ready")
    p.add_argument("agent_args", nargs="*", help="after --: extra `remp agent` arguments")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _pdeathsig() -> None:
    """In the child: new session, and SIGTERM when the parent (remp up) dies."""
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    grace_s: float = 20.0
    proc: subprocess.Popen | None = None

    def start(self) -> "Child":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                     preexec_fn=_pdeathsig)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tree(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            me = psutil.Process(self.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> tuple[int | None, list[int]]:
        """SIGTERM, wait, SIGKILL the group; returns (exit code, pids that had to be killed)."""
        if self.proc is None:
            return None, []
        tree = self.tree()
        killed: list[int] = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=self.grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            killed.append(self.proc.pid)
            rc = self.proc.wait()
        _, alive = psutil.wait_procs(tree[1:], timeout=10)
        for p in alive:
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        self._log.close()
        return rc, killed

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Stop(Exception):
    pass


class Stack:
    def __init__(self, a):
        self.a = a
        self.children: list[Child] = []
        self.redis: RedisServer | None = None
        self.stopping = False
        self.addresses: dict[str, str] = {}

    # ------------------------------------------------------------------ helpers
    def say(self, msg: str) -> None:
        print(f"remp up: {msg}", flush=True)

    def ports(self) -> dict[str, int]:
        out = {}
        for k, v in DEFAULT_PORTS.items():
            given = getattr(self.a, f"port_{k}")
            out[k] = given if given is not None else (_free_port() if self.a.free_ports else v)
        busy = [f"{k} {p}" for k, p in out.items() if _port_busy(p)]
        if busy:
            raise OSError("ports in use: " + ", ".join(busy) + " (another `remp up`? use "
                          "--free-ports or --<name>-port)")
        return out

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
              grace_s: float = 20.0) -> Child:
        c = Child(name, [sys.executable, "-m", "remp.cli", *args],
                  self.a.log_dir / f"{name}.log", env or {}, grace_s).start()
        self.children.append(c)
        return c

    def check(self) -> None:
        if self.stopping:
            raise Stop()
        for c in self.children:
            if not c.alive():
                raise RuntimeError(f"{c.name} exited with {c.proc.returncode}; last lines of "
                                   f"{c.log_path}:\n{c.tail()}")

    def wait_health(self, c: Child, addr: str, service: str, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(addr) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                self.check()
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"{c.name} not ready in {timeout:.0f} s; see {c.log_path}:\n{c.tail()}")

    def wait_http(self, c: Child, url: str, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            try:
                if httpx.get(url, timeout=2).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{c.name} not ready in {timeout:.0f} s; see {c.log_path}:\n{c.tail()}")

    # ------------------------------------------------------------------ run
    def start(self) -> None:
        a = self.a
        a.log_dir.mkdir(parents=True, exist_ok=True)
        ports = self.ports()
        token = a.token or secrets.token_urlsafe(16)
        model = a.model
        if not (model / "config.json").is_file():
            from remp.modelgen import make_model

            self.say(f"building the tiny model in {model}")
            make_model(model)
        import policy

        profile = a.profile or str(Path(policy.__file__).parent / "profiles" / "tiny-cpu-2core.json")
        redis_url = os.environ.get("REMP_REDIS_URL")
        if not redis_url:
            self.redis = RedisServer().start()
            redis_url = self.redis.url
            self.say(f"redis      {redis_url} (private, nothing persisted; set REMP_REDIS_URL "
                     "to use yours)")
        else:
            self.say(f"redis      {redis_url}")
        env = {"REMP_LOG_FORMAT": os.environ.get("REMP_LOG_FORMAT", "console")}
        ctl_addr = f"127.0.0.1:{ports['controller']}"
        ctl = self.spawn("controller", [
            "controller", "--host", "127.0.0.1", "--port", str(ports["controller"]),
            "--redis-url", redis_url, "--token", token,
            "--metrics-port", str(ports["controller_metrics"])], env)
        self.wait_health(ctl, ctl_addr, "remp.controller.v1.Controller", 60)
        self.addresses.update(controller=ctl_addr,
                              controller_metrics=f"http://127.0.0.1:{ports['controller_metrics']}/metrics")
        self.say(f"controller {ctl_addr}  (metrics {self.addresses['controller_metrics']})")

        pol_addr = f"127.0.0.1:{ports['policy']}"
        pol = self.spawn("policy", [
            "policy", "serve", "--host", "127.0.0.1", "--port", str(ports["policy"]),
            "--metrics-port", str(ports["policy_metrics"]), "--controller", ctl_addr,
            "--token", token, "--redis-url", redis_url, "--profile", profile, "--mode", a.mode,
            "--tick-seconds", "2", "--window-seconds", "10", "--horizon-seconds", "60",
            "--min-dwell-seconds", "30"], env)
        dash_url = f"http://127.0.0.1:{ports['dashboard']}"
        dash = self.spawn("dashboard", [
            "dashboard", "--controller", ctl_addr, "--policy", pol_addr, "--token", token,
            "--host", "127.0.0.1", "--port", str(ports["dashboard"])], env, grace_s=10)
        self.wait_health(pol, pol_addr, "remp.policy.v1.Policy", 60)
        self.addresses.update(policy=pol_addr,
                              policy_metrics=f"http://127.0.0.1:{ports['policy_metrics']}/metrics")
        self.say(f"policy     {pol_addr}  ({a.mode}, profile {Path(profile).name}; metrics "
                 f"{self.addresses['policy_metrics']})")
        self.wait_http(dash, f"{dash_url}/api/config", 60)
        self.addresses["dashboard"] = dash_url
        self.say(f"dashboard  {dash_url}")

        agent_grpc = f"127.0.0.1:{ports['agent_grpc']}"
        agent_http = f"http://127.0.0.1:{ports['agent_http']}"
        extra = list(a.agent_args)
        agent = self.spawn("agent", [
            "agent", "--model", str(model), "--tp", str(a.tp), "--pp", str(a.pp),
            "--node", a.node, "--host", "127.0.0.1", "--grpc-port", str(ports["agent_grpc"]),
            "--http-port", str(ports["agent_http"]), "--controller", ctl_addr,
            "--controller-token", token, *extra], env, grace_s=60)
        self.say(f"agent      starting {a.node} on TP{a.tp}PP{a.pp} (vLLM; a minute or more on "
                 f"CPU; log {agent.log_path})")
        self.wait_health(agent, agent_grpc, "remp.node_agent.v1.NodeAgent", a.agent_timeout)
        self.addresses.update(agent_grpc=agent_grpc, agent_http=agent_http,
                              agent_metrics=f"{agent_http}/metrics", token=token,
                              redis=redis_url, node=a.node, logs=str(a.log_dir))
        self.say(f"agent      {agent_grpc}  OpenAI API {agent_http}  (metrics {agent_http}/metrics)")
        (a.log_dir / "addresses.json").write_text(json.dumps(self.addresses, indent=1))
        self.say(f"token      {token}")
        self.say(f"try        remp status --controller {ctl_addr}   |   open {dash_url}")
        self.say(f"           remp reconfigure {a.node} TP{a.pp}PP{a.tp} --controller {ctl_addr} "
                 f"--token {token}")
        self.say("ready " + json.dumps(self.addresses))

    def wait(self) -> None:
        while True:
            self.check()
            time.sleep(0.5)

    def stop(self) -> list[int]:
        """Stop every child, newest first; returns pids that had to be killed."""
        self.stopping = True
        killed: list[int] = []
        for c in reversed(self.children):
            if c.proc is None:
                continue
            rc, k = c.stop()
            killed += k
            self.say(f"stopped {c.name} (exit {rc})" + (f", killed {k}" if k else ""))
        if self.redis is not None:
            self.redis.stop()
            self.say("stopped redis")
        return killed


def main(a) -> int:
    stack = Stack(a)

    def on_signal(signum, _frame):
        if not stack.stopping:
            stack.stopping = True
            print(f"\nremp up: {signal.Signals(signum).name}: stopping", flush=True)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 0
    try:
        stack.start()
        stack.wait()
    except Stop:
        rc = 0
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"remp: error: {exc}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C does not interrupt the clean-up
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return rc
