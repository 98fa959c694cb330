"""`remp up` without an engine (`--no-agent`: Redis, controller, policy, dashboard as real
processes): it fails fast on a busy port; it generates private credentials and hands each child
only a file path; no secret is in any process's argv, in addresses.json, in its output or in
the logs; the private Redis has a password and listens on loopback; a child killed with SIGKILL
is restarted (Redis on the same port with the same password) while the others keep running;
Ctrl-C leaves nothing behind. The agent's restart (it needs vLLM) is in tests/e2e/test_up_e2e.py."""

from __future__ import annotations

import json
import signal
import socket
import stat
import subprocess
import sys
import time
from urllib.parse import urlsplit

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from remp.auth import Credentials, Role, sync_channel
from remp.policy.v1 import policy_pb2, policy_pb2_grpc
from tests.upstack import UpProcess, environ

STRAY = "stray-operator-token-from-the-shell"


def mode(p) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_busy_port_fails_at_once_and_starts_nothing(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        p = subprocess.Popen([sys.executable, "-m", "ops.cli", "up", "--free-ports",
                              "--controller-port", str(port), "--log-dir", str(tmp_path),
                              "--model", str(tmp_path / "model")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out
    assert f"controller {port}" in out and "ports in use" in out
    assert not (tmp_path / "model").exists()
    assert not [c for c in psutil.Process().children(recursive=True) if "redis" in c.name()]


def test_token_flag_is_refused_with_an_explanation(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ops.cli", "up", "--token", "abcdefghijklmnop0123",
                        "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--token was removed: secrets never go on the command line" in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up") / "up"
    up = UpProcess(["--no-agent"], log_dir, env={"REMP_TOKEN_OPERATOR": STRAY})
    try:
        up.wait_ready(120)
        creds = Credentials.load(log_dir / "credentials.json", env={})
        pids = {k: p.pid for k, p in up.children().items()}
        ctl_env = environ(pids["controller"])
        password = urlsplit(ctl_env["REMP_CONTROLLER_REDIS_URL"]).password
        assert password
        up.creds, up.password, up.first_pids = creds, password, pids
        up.secrets = [*creds.tokens.values(), password]
        yield up
    finally:
        up.kill()


def health(addr: str, service: str) -> str:
    with grpc.insecure_channel(addr) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as exc:
            return exc.code().name


def wait_serving(addr: str, service: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (h := health(addr, service)) != "SERVING":
        assert time.monotonic() < deadline, h
        time.sleep(0.3)


def test_credentials_and_addresses_are_private_and_hold_no_secret_in_sight(stack):
    d = stack.log_dir
    assert mode(d) == 0o700
    assert mode(d / "credentials.json") == 0o600 and set(stack.creds.tokens) == set(Role)
    assert mode(d / "credentials.d") == 0o700
    for name in ("controller", "policy", "dashboard", "agent"):
        assert mode(d / "credentials.d" / f"{name}.json") == 0o600
    addresses = (d / "addresses.json").read_text()
    assert mode(d / "addresses.json") == 0o600
    assert json.loads(addresses)["credentials_file"] == str((d / "credentials.json").resolve())
    assert "token" not in json.loads(addresses)
    for secret in stack.secrets:
        assert secret not in addresses
        assert secret not in stack.output
    out = stack.output
    assert "redis://:***@127.0.0.1:" in out
    assert "remp reconfigure local TP1PP2 --controller" in out
    assert 'grpcurl -plaintext -H "authorization: Bearer $(remp credentials token operator' in out
    assert "$REMP_TOKEN_OPERATOR set in this shell: the stack ignores it" in out


def test_no_secret_in_any_argv_and_each_child_gets_only_a_path(stack):
    assert stack.argv_offenders(stack.secrets + [STRAY]) == []
    d = stack.log_dir
    children = stack.children()
    assert set(children) == {"redis", "controller", "policy", "dashboard"}
    for name, p in children.items():
        env = environ(p.pid)
        assert not [k for k in env if k.startswith("REMP_TOKEN_")], name
        if name == "redis":
            assert stack.password not in " ".join(p.cmdline())
            continue
        assert env["REMP_CREDENTIALS_FILE"] == str((d / "credentials.d" / f"{name}.json").resolve())
        own = Credentials.load(env["REMP_CREDENTIALS_FILE"], env={})
        role = {"controller": Role.CONTROLLER, "policy": Role.POLICY,
                "dashboard": Role.OPERATOR}[name]
        assert dict(own.tokens) == {role: stack.creds.tokens[role]}  # its own token only
        redis_env = {"controller": "REMP_CONTROLLER_REDIS_URL", "policy": "REMP_POLICY_REDIS_URL"}
        for k in ("REMP_REDIS_URL", "REMP_CONTROLLER_REDIS_URL", "REMP_POLICY_REDIS_URL"):
            assert (k in env) == (redis_env.get(name) == k), (name, k)


def test_private_redis_wants_the_password_and_listens_on_loopback_only(stack):
    r = stack.children()["redis"]
    ports = {c.laddr.port for c in r.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    ips = {c.laddr.ip for c in r.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert ips == {"127.0.0.1"} and len(ports) == 1
    with socket.create_connection(("127.0.0.1", ports.pop()), timeout=5) as s:
        s.sendall(b"PING\r\n")
        assert s.recv(64).startswith(b"-NOAUTH")


def test_the_services_accept_the_generated_credentials(stack):
    creds = stack.creds
    pol = stack.addr["policy"]
    with sync_channel(pol, creds.only(Role.OPERATOR)) as ch:
        r = policy_pb2_grpc.PolicyStub(ch).SetMode(
            policy_pb2.SetModeRequest(mode=policy_pb2.MODE_ADVISORY, node=""), timeout=10)
        assert r.mode == policy_pb2.MODE_ADVISORY
    for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED),
                        ("x" * 43, grpc.StatusCode.UNAUTHENTICATED),
                        (creds.tokens[Role.AGENT], grpc.StatusCode.PERMISSION_DENIED)):
        md = [("authorization", f"Bearer {token}")] if token else []
        with grpc.insecure_channel(pol) as ch, pytest.raises(grpc.RpcError) as exc:
            policy_pb2_grpc.PolicyStub(ch).SetMode(
                policy_pb2.SetModeRequest(mode=policy_pb2.MODE_OFF, node=""), metadata=md,
                timeout=10)
        assert exc.value.code() == code
    # the dashboard holds the operator token (writes after a login), no browser is logged in
    cfg = httpx.get(f"{stack.addr['dashboard']}/api/config", timeout=10).json()
    assert cfg["writes_enabled"] and not cfg["can_write"]
    # the CLI, as the printed lines say
    cf = ["--credentials-file", stack.addr["credentials_file"]]
    r = subprocess.run([sys.executable, "-m", "ops.cli", "credentials", "token", "operator", *cf],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == creds.tokens[Role.OPERATOR]
    r = subprocess.run([sys.executable, "-m", "ops.cli", "status", "--controller",
                        stack.addr["controller"], "--json", *cf], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr


def logs_with_secrets(stack, names) -> dict[str, list[str]]:
    out = {}
    for name in names:
        text = (stack.log_dir / f"{name}.log").read_text(errors="replace")
        hits = [s[:6] + "…" for s in stack.secrets + [STRAY] if s in text]
        if hits:
            out[name] = hits
    return out


def test_no_log_carries_a_secret(stack):
    for name in ("controller", "policy", "dashboard"):
        assert mode(stack.log_dir / f"{name}.log") == 0o600
    assert logs_with_secrets(stack, ["controller", "dashboard"]) == {}


def test_the_policy_log_does_not_carry_the_redis_password(stack):
    assert logs_with_secrets(stack, ["policy"]) == {}


def test_redis_killed_is_restarted_on_its_port_and_the_controller_serves_again(stack):
    before = stack.children()
    port = next(c.laddr.port for c in before["redis"].net_connections("inet")
                if c.status == psutil.CONN_LISTEN)
    n = len(stack.lines)
    before["redis"].kill()
    stack.wait_line("redis was killed by SIGKILL; restarting it in", 30, after=n)
    line = stack.wait_line("restarted redis", 60, after=n)
    assert f"same port {port} and password" in line
    wait_serving(stack.addr["controller"], "remp.controller.v1.Controller")
    after = stack.children()
    assert after["redis"].pid != before["redis"].pid
    assert {k: p.pid for k, p in after.items() if k != "redis"} == \
        {k: p.pid for k, p in before.items() if k != "redis"}
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        pw = stack.password.encode()
        s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
        assert s.recv(64).startswith(b"+OK")  # same port, same password
    assert stack.argv_offenders(stack.secrets) == []


def test_controller_and_dashboard_killed_are_restarted_the_others_untouched(stack):
    before = {k: p.pid for k, p in stack.children().items()}
    n = len(stack.lines)
    for name in ("controller", "dashboard"):
        psutil.Process(before[name]).kill()
    for name in ("controller", "dashboard"):
        stack.wait_line(f"{name} was killed by SIGKILL", 30, after=n)
        stack.wait_line(f"{name} ready again", 90, after=n)
    wait_serving(stack.addr["controller"], "remp.controller.v1.Controller")
    wait_serving(stack.addr["policy"], "remp.policy.v1.Policy")
    after = {k: p.pid for k, p in stack.children().items()}
    assert after["controller"] != before["controller"]
    assert after["dashboard"] != before["dashboard"]
    assert (after["redis"], after["policy"]) == (before["redis"], before["policy"])
    assert stack.proc.poll() is None


def test_ctrl_c_stops_everything(stack):
    tree = stack.descendants()
    assert tree
    rc = stack.stop(signal.SIGINT, timeout=120)
    out = stack.output
    assert rc == 0, out
    assert "killed [" not in out, out
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    for name in ("dashboard", "policy", "controller", "redis"):
        assert f"stopped {name}" in out, out
