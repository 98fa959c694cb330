"""``remp up``: the whole stack on one machine for trying remp out.

Starts, in order: Redis (a private ``redis-server`` unless ``$REMP_REDIS_URL`` is set), the
controller, the policy (advisory) and the dashboard, then one node agent on the tiny model (built
with :mod:`devstack.modelgen` when missing); prints every address once each is ready and a last line
``remp up: ready``. Then it supervises them: a child that dies is restarted (its log says why),
with a growing delay and at most --max-restarts times per 10 minutes, while the others keep
running; Redis comes back on the same port with the same password and its data. Ctrl-C or SIGTERM
stops them in reverse order (SIGTERM, then SIGKILL of the process group after a grace period).

Credentials: ``<log-dir>/credentials.json`` (0600; made on first run and reused after, so the
operator's CLI keeps working; --new-credentials replaces it), or --credentials-file. Every child
gets the path of a 0600 file holding its own token (and digests of the others') in
``$REMP_CREDENTIALS_FILE``; no secret is ever on a command line. The private Redis listens on
127.0.0.1 with a random password; its URL reaches the controller and the policy through their
environment (``REMP_CONTROLLER_REDIS_URL`` / ``REMP_POLICY_REDIS_URL``). ``$REMP_REDIS_URL``
(``redis://[:password@]host:port/db``, ``rediss://`` for TLS) uses your Redis instead; printed
URLs never show a password. Logs: --log-dir (default ``.remp/up``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from remp.auth import ENV_ALLOW_UNAUTHENTICATED, ENV_FILE, ENV_TOKEN, Credentials, Role, digest
from remp.errors import ConfigError
from remp.backoff import RestartBudget
from remp.cliargs import remove_secret_flags
from remp.redisproc import RedisHA, RedisSentinel, RedisServer, die_with_parent, redact_url
from node_agent.config import detect_device_type

DEFAULT_PORTS = {"controller": 50051, "controller_metrics": 9151, "agent_grpc": 50061,
                 "agent_http": 8000, "policy": 50071, "policy_metrics": 9171, "dashboard": 8080}
DEFAULT_LOG_DIR = Path(".remp/up")
# Which identity each child holds (its token; the other roles' sha256 digests, to verify them).
CHILD_ROLE = {"controller": Role.CONTROLLER, "agent": Role.AGENT, "policy": Role.POLICY,
              "dashboard": Role.OPERATOR}
# Never inherited by a child: secrets it must not see, and settings remp up sets itself.
_NOT_INHERITED = ("REMP_REDIS_URL", "REMP_CONTROLLER_REDIS_URL", "REMP_POLICY_REDIS_URL",
                  ENV_ALLOW_UNAUTHENTICATED, ENV_FILE)


def add_parser(sub) -> None:
    p = sub.add_parser("up", help="run the whole stack locally: Redis, controller, node agent, "
                       "policy, dashboard (Ctrl-C stops all)",
                       description=" ".join(__doc__.split("\n\n")[1:4]).replace("\n", " "))
    p.add_argument("--model", type=Path, default=Path(".remp/tiny-llama"),
                   help="model directory (built as the tiny Llama when missing)")
    p.add_argument("--tp", type=int, default=int(os.environ.get("REMP_TP", 2)))
    p.add_argument("--pp", type=int, default=int(os.environ.get("REMP_PP", 1)))
    p.add_argument("--node", default="local")
    p.add_argument("--credentials-file", type=Path, default=None,
                   help="use these credentials (0600, a token for every role) instead of "
                   "<log-dir>/credentials.json")
    p.add_argument("--new-credentials", action="store_true",
                   help="replace <log-dir>/credentials.json with new tokens (rotation)")
    remove_secret_flags(p, ("--token", "--controller-token"), hint=(
        "remp up generates its credentials into <log-dir>/credentials.json (0600; the CLI finds "
        ".remp/up/credentials.json by itself, `remp credentials token operator` prints the token "
        "for grpcurl); --credentials-file FILE uses yours (`remp credentials create FILE`)"))
    p.add_argument("--profile", default=None, help="policy profile (default: the measured "
                   "tiny-cpu-2core profile)")
    p.add_argument("--mode", default="advisory", choices=["advisory", "auto", "off"])
    p.add_argument("--no-agent", dest="agent", action="store_false",
                   help="only the control plane: Redis, controller, policy, dashboard")
    p.add_argument("--ha", action="store_true",
                   help="Redis with a replica and three sentinels (Redis Sentinel, shipped with "
                   "Redis): kill -9 of the primary fails over to the replica; the controller "
                   "acknowledges a switch's writes only once the replica has them (WAIT)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one child per 10 minutes before the whole stack stops "
                   "(0: stop at the first death)")
    p.add_argument("--free-ports", action="store_true", help="pick free ports instead of the "
                   "defaults (" + ", ".join(f"{k} {v}" for k, v in DEFAULT_PORTS.items()) + ")")
    for k, v in DEFAULT_PORTS.items():
        p.add_argument(f"--{k.replace('_', '-')}-port", dest=f"port_{k}", type=int, default=None,
                       help=f"default {v}")
    p.add_argument("--log-dir", type=Path, default=DEFAULT_LOG_DIR)
    p.add_argument("--agent-timeout", type=float, default=900.0,
                   help="seconds to wait for the agent to be ready")
    p.add_argument("agent_args", nargs="*", help="after --: extra `remp agent` arguments")


# ---------------------------------------------------------------------------- files

def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` with mode 0600 from the first byte (atomic replace)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)
    os.replace(tmp, path)
    return path


def prepare_credentials(log_dir: Path, given: Path | None = None, rotate: bool = False
                        ) -> tuple[Path, Credentials, str]:
    """The stack's credentials: ``given``, else ``<log_dir>/credentials.json`` — reused when it
    is a private (0600) file with a token for every role, else (or with ``rotate``) replaced by
    a new set. Returns (path, credentials, what happened)."""
    if given is not None:
        if rotate:
            raise ConfigError("--new-credentials replaces <log-dir>/credentials.json; to rotate "
                              f"{given} use `remp credentials create --force {given}`")
        creds = Credentials.load(given, env={})
        missing = [r.value for r in Role if r not in creds.tokens]
        if missing:
            raise ConfigError(f"{given}: remp up runs every role and needs each one's token "
                              f"(missing: {', '.join(missing)})")
        return given, creds, "given"
    path = log_dir / "credentials.json"
    status = "new"
    if path.exists():
        status = "rotated (--new-credentials)"
        if not rotate:
            try:
                creds = Credentials.load(path, env={})
                if all(r in creds.tokens for r in Role):
                    return path, creds, "reused"
                status = "replaced: it lacked a role's token"
            except ConfigError as exc:
                status = f"replaced: {exc}"
    Credentials.generate().write(path)
    return path, Credentials.load(path, env={}), status


SECRET_AGENT_FLAGS = ("--api-key",)


def check_agent_args(args: list[str]) -> None:
    """Extra agent arguments must not carry a secret (``ps`` shows argv)."""
    for arg in args:
        if arg.split("=", 1)[0] in SECRET_AGENT_FLAGS:
            raise ConfigError(f"{arg.split('=', 1)[0]} would put a secret on the agent's command "
                              "line (ps shows it): set VLLM_API_KEY in the environment instead "
                              "(the agent's OpenAI API then requires it)")


CPU_WORKER_SPIN_S = "0.02"


def with_agent_defaults(args: list[str], cpu: bool) -> list[str]:
    """The agent arguments ``remp up`` adds unless told otherwise: on CPU, vLLM's workers
    busy-wait 0.02 s between messages instead of 1 s (the agent, controller, policy and Redis
    share those cores; measured: a switch's done event lands ~1 s sooner, decode speed equal)."""
    if cpu and not any(a.split("=", 1)[0] == "--worker-spin-seconds" for a in args):
        return [*args, "--worker-spin-seconds", CPU_WORKER_SPIN_S]
    return list(args)


def child_credentials(creds: Credentials, role: Role) -> str:
    """A credentials file for a process acting as ``role``: its own token, the digests of the
    others' (it verifies them but cannot act as them)."""
    tokens = {r.value: (tok if r == role else f"sha256:{digest(tok).hex()}")
              for r, tok in creds.tokens.items()}
    return json.dumps({"version": 1, "tokens": tokens}, indent=1)


def weight_store_cleanup(node: str, agent_args: list[str]):
    """After a SIGKILL the agent cannot remove its host weight store (a copy of the model's
    weights in shared memory, ``<root>/remp-<node>-<pid>``, node_agent/server.py): this does."""
    root = os.environ.get("REMP_AGENT_WEIGHT_STORE_ROOT") or "/dev/shm"
    for i, arg in enumerate(agent_args):
        if arg == "--weight-store-root" and i + 1 < len(agent_args):
            root = agent_args[i + 1]
        elif arg.startswith("--weight-store-root="):
            root = arg.split("=", 1)[1]

    def clean(pid: int) -> str | None:
        path = Path(root) / f"remp-{node}-{pid}"
        if not path.is_dir():
            return None
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        shutil.rmtree(path, ignore_errors=True)
        return f"removed its weight store {path} ({size / 2**20:.1f} MiB)"
    return clean


def open_log(path: Path, append: bool):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "w")


# ---------------------------------------------------------------------------- processes

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


def _exit_text(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            pass
    return f"exited with {rc}"


@dataclass
class Supervised:
    """What ``remp up`` keeps alive: a name, a way to (re)start, a readiness probe."""

    name: str
    budget: RestartBudget = field(default_factory=RestartBudget)
    restart_at: float | None = None  # dead, restart scheduled
    recovering: bool = False  # restarted, not yet ready again
    restarts: int = 0
    last_cleanup: str | None = None  # what reap() removed besides processes

    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        raise NotImplementedError

    @property
    def returncode(self) -> int | None:
        raise NotImplementedError

    def restart(self) -> None:
        raise NotImplementedError

    def reap(self) -> list[int]:
        """After a death: kill what is left of it."""
        return []

    def ready(self) -> bool:
        return True

    def tail(self, n: int = 20) -> str:
        return ""

    @property
    def log_name(self) -> str:
        return ""


@dataclass
class Child(Supervised):
    cmd: list[str] = field(default_factory=list)
    log_path: Path = Path("/dev/null")
    env: dict[str, str] = field(default_factory=dict)  # the whole environment
    grace_s: float = 20.0
    probe: object = None  # () -> bool: ready (after a restart)
    cleanup: object = None  # (dead pid) -> str | None: what it removed after a SIGKILL
    proc: subprocess.Popen | None = None
    known: list[psutil.Process] = field(default_factory=list)  # descendants last seen

    def start(self, append: bool = False) -> "Child":
        self._log = open_log(self.log_path, append)
        if append:
            self._log.write(f"\n----- remp up: restart {self.restarts} at "
                            f"{time.strftime('%Y-%m-%d %H:%M:%S')} -----\n")
            self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     preexec_fn=die_with_parent)
        self.known = []
        return self

    def restart(self) -> None:
        self._log.close()
        self.restarts += 1
        self.start(append=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    @property
    def log_name(self) -> str:
        return str(self.log_path)

    def ready(self) -> bool:
        return bool(self.probe()) if self.probe else True

    def tree(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            me = psutil.Process(self.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def remember_tree(self) -> None:
        if self.alive():
            self.known = self.tree()[1:]

    def reap(self) -> list[int]:
        """Its process group and the descendants last seen (vLLM's engine and workers) get
        SIGKILL, so that a restart starts clean."""
        killed: list[int] = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: group id == its pid
        except (ProcessLookupError, PermissionError):
            pass
        for p in self.known:
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(self.known, timeout=10)
        self.known = []
        self.last_cleanup = self.cleanup(self.proc.pid) if self.cleanup else None
        return killed

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
        if self.cleanup and (killed or rc is None or rc < 0):
            self.cleanup(self.proc.pid)
        self._log.close()
        return rc, killed

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class RedisChild(Supervised):
    server: RedisServer | RedisSentinel | None = None
    group: RedisHA | None = None  # --ha: a server comes back as a replica of the new primary

    def alive(self) -> bool:
        return self.server.alive()

    @property
    def pid(self) -> int | None:
        return self.server.proc.pid if self.server.proc else None

    @property
    def returncode(self) -> int | None:
        return self.server.proc.poll() if self.server.proc else None

    def restart(self) -> None:
        self.restarts += 1
        if self.group is not None and isinstance(self.server, RedisServer):
            self.group.restart_server(self.server, preexec_fn=die_with_parent)
        else:
            self.server.restart(preexec_fn=die_with_parent)

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.server.log_tail().splitlines()[-min(n, 4):])

    @property
    def log_name(self) -> str:
        return f"{self.name}'s log"


class Stop(Exception):
    pass


class Stack:
    def __init__(self, a):
        self.a = a
        self.children: list[Child] = []
        self.redis: RedisServer | None = None
        self.redis_ha: RedisHA | None = None
        self.redis_children: list[RedisChild] = []
        self.stopping = False
        self.ready = False
        self.addresses: dict[str, str] = {}
        self.credentials_path: Path | None = None
        self._last_snapshot = 0.0

    # ------------------------------------------------------------------ helpers
    def say(self, msg: str) -> None:
        print(f"remp up: {msg}", flush=True)

    def ports(self) -> dict[str, int]:
        out = {}
        for k, v in DEFAULT_PORTS.items():
            given = getattr(self.a, f"port_{k}")
            out[k] = given if given is not None else (_free_port() if self.a.free_ports else v)
        if not self.a.agent:
            out = {k: v for k, v in out.items() if not k.startswith("agent")}
        busy = [f"{k} {p}" for k, p in out.items() if _port_busy(p)]
        if busy:
            raise OSError("ports in use: " + ", ".join(busy) + " (another `remp up`? use "
                          "--free-ports or --<name>-port)")
        return out

    def budget(self) -> RestartBudget:
        return RestartBudget(limit=max(0, self.a.max_restarts))

    def child_env(self, name: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in _NOT_INHERITED and not k.startswith(ENV_TOKEN)}
        env["REMP_LOG_FORMAT"] = os.environ.get("REMP_LOG_FORMAT", "console")
        env[ENV_FILE] = str(self.child_creds[name])
        env.update(extra or {})
        return env

    def spawn(self, name: str, args: list[str], extra_env: dict[str, str] | None = None,
              grace_s: float = 20.0, probe=None, cleanup=None) -> Child:
        c = Child(name, budget=self.budget(), cmd=[sys.executable, "-m", "ops.cli", *args],
                  log_path=self.a.log_dir / f"{name}.log", env=self.child_env(name, extra_env),
                  grace_s=grace_s, probe=probe, cleanup=cleanup).start()
        self.children.append(c)
        return c

    def check(self) -> None:
        """While starting: any death stops the stack (it is a set-up problem, not a crash)."""
        if self.stopping:
            raise Stop()
        for c in self.children:
            if not c.alive():
                raise RuntimeError(f"{c.name} {_exit_text(c.returncode)}; last lines of "
                                   f"{c.log_path}:\n{c.tail()}")
        for rc in self.redis_children:
            if not rc.alive():
                raise RuntimeError(f"{rc.name} {_exit_text(rc.returncode)}:\n{rc.tail()}")

    @staticmethod
    def grpc_ready(addr: str, service: str, timeout: float = 1.0) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(addr) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout)
                return r.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

    @staticmethod
    def http_ready(url: str, timeout: float = 1.0) -> bool:
        import httpx

        try:
            return httpx.get(url, timeout=timeout).status_code < 500
        except httpx.HTTPError:
            return False

    def wait_ready(self, c: Child, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            if c.ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"{c.name} not ready in {timeout:.0f} s; see {c.log_path}:\n{c.tail()}")

    # ------------------------------------------------------------------ run
    def start(self) -> None:
        a = self.a
        check_agent_args(a.agent_args)
        a.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        ports = self.ports()
        path, creds, status = prepare_credentials(a.log_dir, a.credentials_file,
                                                  a.new_credentials)
        self.credentials_path = path.resolve()
        cdir = a.log_dir / "credentials.d"
        cdir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(cdir, 0o700)
        self.child_creds = {name: write_private(cdir / f"{name}.json",
                                                child_credentials(creds, role)).resolve()
                            for name, role in CHILD_ROLE.items()}
        self.say(f"credentials {path} ({status}; 0600; each process gets its own token through "
                 f"${ENV_FILE}, never argv)")
        for note in self.credential_notes():
            self.say(note)
        model = a.model
        if a.agent and not (model / "config.json").is_file():
            from devstack.modelgen import make_model

            self.say(f"building the tiny model in {model}")
            make_model(model)
        import policy

        profile = a.profile or str(Path(policy.__file__).parent / "profiles" / "tiny-cpu-2core.json")
        redis_url = os.environ.get("REMP_REDIS_URL")
        ctl_env: dict[str, str] = {}
        if not redis_url and a.ha:
            self.redis_ha = RedisHA(persist=True)
            self.redis_ha.start(preexec_fn=die_with_parent)
            self.redis_children = [
                RedisChild(f"redis {role}", budget=self.budget(), server=srv,
                           group=self.redis_ha) for role, srv in (
                    ("primary", self.redis_ha.primary), ("replica", self.redis_ha.replicas[0]),
                    *((f"sentinel {i + 1}", s) for i, s in enumerate(self.redis_ha.sentinels)))]
            redis_url = self.redis_ha.url
            ctl_env["REMP_CONTROLLER_REDIS_WAIT_REPLICAS"] = "1"
            self.say(f"redis      {self.redis_ha.redacted_url} (Sentinel: primary "
                     f"127.0.0.1:{self.redis_ha.primary.port}, replica "
                     f"127.0.0.1:{self.redis_ha.replicas[0].port}, three sentinels; random "
                     "password; a crashed one is restarted and rejoins as a replica)")
        elif not redis_url:
            port = _free_port()
            while port in ports.values():  # --free-ports chose those without binding them
                port = _free_port()
            self.redis = RedisServer(port, generate_password=True, persist=True)
            self.redis.start(preexec_fn=die_with_parent)
            self.redis_children = [RedisChild("redis", budget=self.budget(), server=self.redis)]
            redis_url = self.redis.url
            self.say(f"redis      {self.redis.redacted_url} (private: 127.0.0.1 only, random "
                     "password; nothing kept after stop; set REMP_REDIS_URL to use yours)")
        else:
            self.say(f"redis      {redact_url(redis_url)} (REMP_REDIS_URL)")
        ctl_addr = f"127.0.0.1:{ports['controller']}"
        ctl = self.spawn("controller", [
            "controller", "--host", "127.0.0.1", "--port", str(ports["controller"]),
            "--metrics-port", str(ports["controller_metrics"])],
            {"REMP_CONTROLLER_REDIS_URL": redis_url, **ctl_env},
            probe=lambda: self.grpc_ready(ctl_addr, "remp.controller.v1.Controller"))
        self.wait_ready(ctl, 60)
        self.addresses.update(controller=ctl_addr,
                              controller_metrics=f"http://127.0.0.1:{ports['controller_metrics']}/metrics")
        self.say(f"controller {ctl_addr}  (metrics {self.addresses['controller_metrics']})")

        pol_addr = f"127.0.0.1:{ports['policy']}"
        pol = self.spawn("policy", [
            "policy", "serve", "--host", "127.0.0.1", "--port", str(ports["policy"]),
            "--metrics-port", str(ports["policy_metrics"]), "--controller", ctl_addr,
            "--profile", profile, "--mode", a.mode,
            "--tick-seconds", "2", "--window-seconds", "10", "--horizon-seconds", "60",
            "--min-dwell-seconds", "30"], {"REMP_POLICY_REDIS_URL": redis_url},
            probe=lambda: self.grpc_ready(pol_addr, "remp.policy.v1.Policy"))
        dash_url = f"http://127.0.0.1:{ports['dashboard']}"
        dash = self.spawn("dashboard", [
            "dashboard", "--controller", ctl_addr, "--policy", pol_addr,
            "--host", "127.0.0.1", "--port", str(ports["dashboard"])], grace_s=10,
            probe=lambda: self.http_ready(f"{dash_url}/api/config"))
        self.wait_ready(pol, 60)
        self.addresses.update(policy=pol_addr,
                              policy_metrics=f"http://127.0.0.1:{ports['policy_metrics']}/metrics")
        self.say(f"policy     {pol_addr}  ({a.mode}, profile {Path(profile).name}; metrics "
                 f"{self.addresses['policy_metrics']})")
        self.wait_ready(dash, 60)
        self.addresses["dashboard"] = dash_url
        self.say(f"dashboard  {dash_url}  (log in with the operator token to approve / switch)")

        if a.agent:
            agent_grpc = f"127.0.0.1:{ports['agent_grpc']}"
            agent_http = f"http://127.0.0.1:{ports['agent_http']}"
            cpu = detect_device_type("auto") == "cpu"
            agent = self.spawn("agent", [
                "agent", "--model", str(model), "--tp", str(a.tp), "--pp", str(a.pp),
                "--node", a.node, "--host", "127.0.0.1", "--grpc-port", str(ports["agent_grpc"]),
                "--http-port", str(ports["agent_http"]), "--controller", ctl_addr,
                *with_agent_defaults(a.agent_args, cpu)], grace_s=60,
                # vLLM's cache outlives an agent restart (a private one costs every start 7 s:
                # vLLM inspects the model class in a subprocess that imports vLLM again)
                extra_env={"VLLM_CACHE_ROOT": os.environ.get(
                    "VLLM_CACHE_ROOT", str(a.log_dir / "vllm-cache"))},
                probe=lambda: self.grpc_ready(agent_grpc, "remp.node_agent.v1.NodeAgent"),
                cleanup=weight_store_cleanup(a.node, a.agent_args))
            self.say(f"agent      starting {a.node} on TP{a.tp}PP{a.pp} (vLLM; a minute or more "
                     f"on CPU; log {agent.log_path})")
            self.wait_ready(agent, a.agent_timeout)
            self.addresses.update(agent_grpc=agent_grpc, agent_http=agent_http,
                                  agent_metrics=f"{agent_http}/metrics")
            key = " (API key from $VLLM_API_KEY)" if os.environ.get("VLLM_API_KEY") else ""
            self.say(f"agent      {agent_grpc}  OpenAI API {agent_http}{key}  (metrics "
                     f"{agent_http}/metrics)")
        self.addresses.update(credentials_file=str(self.credentials_path),
                              redis=redact_url(redis_url), node=a.node, logs=str(a.log_dir))
        write_private(a.log_dir / "addresses.json", json.dumps(self.addresses, indent=1))
        for line in self.usage(ctl_addr, dash_url):
            self.say(line)
        self.ready = True
        self.say("ready " + json.dumps(self.addresses))

    def credential_notes(self) -> list[str]:
        notes = []
        env_file = os.environ.get(ENV_FILE)
        if env_file and Path(env_file).resolve() != self.credentials_path:
            notes.append(f"note: ${ENV_FILE} is set ({env_file}); the stack does not use it, "
                         "but the remp CLI reads it first: pass --credentials-file "
                         f"{self.credentials_path} to the CLI, or unset it")
        toks = sorted(k for k in os.environ if k.startswith(ENV_TOKEN) and os.environ[k])
        if toks:
            notes.append(f"note: {', '.join('$' + t for t in toks)} set in this shell: the stack "
                         "ignores it; the remp CLI would send it instead of the file's token")
        return notes

    def usage(self, ctl_addr: str, dash_url: str) -> list[str]:
        a = self.a
        default = (Path.cwd() / DEFAULT_LOG_DIR / "credentials.json").resolve()
        cf = ("" if self.credentials_path == default and not os.environ.get(ENV_FILE)
              else f" --credentials-file {self.credentials_path}")
        where = (f"(the CLI finds {DEFAULT_LOG_DIR / 'credentials.json'} by itself)" if not cf
                 else "")
        target = f"TP{a.pp}PP{a.tp}"
        body = json.dumps({"node": a.node, "target": {"tp": a.pp, "pp": a.tp}},
                          separators=(",", ":"))
        return [
            f"try        remp status --controller {ctl_addr}{cf}   |   open {dash_url}",
            f"           remp reconfigure {a.node} {target} --controller {ctl_addr}{cf}   "
            f"{where}".rstrip(),
            f"           grpcurl -plaintext -H \"authorization: Bearer $(remp credentials token "
            f"operator{cf})\" -d '{body}' {ctl_addr} remp.controller.v1.Controller/Reconfigure",
        ]

    # ------------------------------------------------------------------ supervision
    def supervised(self) -> list[Supervised]:
        return list(self.redis_children) + list(self.children)

    def supervise_once(self, now: float | None = None) -> None:
        """One look at every child: notice deaths, restart when due, report recoveries."""
        if self.stopping:
            raise Stop()
        now = time.monotonic() if now is None else now
        if now - self._last_snapshot > 5:
            self._last_snapshot = now
            for c in self.children:
                c.remember_tree()
        for s in self.supervised():
            if self.stopping:
                raise Stop()
            if s.restart_at is None and not s.recovering and not s.alive():
                self.on_death(s, now)
            elif s.restart_at is not None and now >= s.restart_at:
                s.restart_at = None
                try:
                    s.restart()
                except (OSError, RuntimeError, TimeoutError) as exc:
                    raise RuntimeError(f"{s.name} could not be restarted ({exc}); stopping the "
                                       "stack") from None
                s.recovering = True
                self.say(f"restarted {s.name} (pid {s.pid}"
                         + (f", same port {s.server.port} and password"
                            if isinstance(s, RedisChild) else "") + ")")
            elif s.recovering:
                if not s.alive():
                    s.recovering = False
                    self.on_death(s, now)
                elif s.ready():
                    s.recovering = False
                    self.say(f"{s.name} ready again")

    def on_death(self, s: Supervised, now: float) -> None:
        rc = s.returncode
        killed = s.reap()
        delay = s.budget.on_death(now)
        tail = s.tail(12)
        if delay is None:
            raise RuntimeError(
                f"{s.name} {_exit_text(rc)}: it died {s.budget.count} times in "
                f"{s.budget.window_s / 60:.0f} min (--max-restarts {s.budget.limit}); stopping "
                f"the stack. Last lines of {s.log_name}:\n{tail}")
        self.say(f"{s.name} {_exit_text(rc)}"
                 + (f" (killed what was left of it: {killed})" if killed else "")
                 + (f" ({s.last_cleanup})" if s.last_cleanup else "")
                 + f"; restarting it in {delay:g} s (restart {s.budget.count} of at most "
                 f"{s.budget.limit} per {s.budget.window_s / 60:.0f} min); the others keep "
                 f"running. Last lines of {s.log_name}:\n{tail}")
        s.restart_at = now + delay

    def wait(self) -> None:
        while True:
            self.supervise_once()
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
            if k or rc not in (0, None):  # say why, from its own log (it holds no secret)
                self.say(f"{c.name} did not stop cleanly; the end of {c.log_path}:\n"
                         + "\n".join("    " + ln for ln in c.tail(25).splitlines()))
        if self.redis is not None:
            self.redis.stop()
            self.say("stopped redis")
        if self.redis_ha is not None:
            self.redis_ha.stop()
            self.say("stopped redis (primary, replica, sentinels)")
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
    except ConfigError as exc:
        print(f"remp: error: {exc}", file=sys.stderr, flush=True)
        rc = 2
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
