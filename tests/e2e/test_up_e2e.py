"""`remp up` (what `./dev up` runs) as a user runs it: start the whole stack (private Redis,
controller, node agent on vLLM CPU, policy, dashboard), query it over gRPC (grpcurl) and HTTP,
check that no secret is in any process's argv (vLLM's engine and workers included), kill -9
Redis and then the agent and watch `remp up` bring each back while the others keep running,
switch with the operator's CLI, Ctrl-C it, and check that every process it started is gone."""

from __future__ import annotations

import json
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from devstack.agentproc import grpcurl
from remp.auth import Credentials, Role
from tests.upstack import UpProcess, environ

pytestmark = pytest.mark.e2e


def screenshot(url: str, path) -> None:
    """The stack's dashboard (with its policy section) in headless chromium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    o = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1400"):
        o.add_argument(arg)
    o.binary_location = shutil.which("chromium") or "chromium"
    d = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"),
                         options=o)
    try:
        d.get(url)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not d.execute_script(
                "return document.querySelector('[data-policy-node] svg')"):
            time.sleep(0.2)
        assert d.execute_script("return document.querySelector('[data-policy-node] svg')")
        d.save_screenshot(str(path))
    finally:
        d.quit()


def list_nodes(addr: dict) -> list[dict]:
    r = grpcurl("-plaintext", addr["controller"], "remp.controller.v1.Controller/ListNodes")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout).get("nodes", [])


def serving(address: str, service: str) -> bool:
    r = grpcurl("-plaintext", "-d", json.dumps({"service": service}), address,
                "grpc.health.v1.Health/Check")
    return r.returncode == 0 and '"SERVING"' in r.stdout


def wait_until(what, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, message
        time.sleep(0.5)


def test_remp_up_starts_answers_recovers_and_stops_without_orphans(tiny_model, artifacts_dir):
    log_dir = artifacts_dir / "up"
    # the OpenAI API key the way vLLM reads it (remp up refuses it on the command line)
    api_key = "sk-up-e2e-" + "k" * 24
    up = UpProcess(["--model", str(tiny_model), "--node", "up-e2e"], log_dir,
                   env={"VLLM_API_KEY": api_key})
    try:
        addr = up.wait_ready(600)
        tree = up.descendants()
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        for what in ("redis-server", " controller ", " agent ", " policy serve", " dashboard "):
            assert what in names, (what, names)

        # credentials: private files; no secret in any argv (vLLM's processes included)
        creds = Credentials.load(log_dir / "credentials.json", env={})
        assert stat.S_IMODE((log_dir / "credentials.json").stat().st_mode) == 0o600
        assert stat.S_IMODE((log_dir / "addresses.json").stat().st_mode) == 0o600
        children = up.children()
        password = environ(children["controller"].pid)["REMP_CONTROLLER_REDIS_URL"] \
            .split("@")[0].rsplit(":", 1)[1]
        secrets = [*creds.tokens.values(), password, api_key]
        assert len(tree) > 5  # the engine core and workers are in it
        assert up.argv_offenders(secrets) == []
        for secret in secrets:
            assert secret not in (log_dir / "addresses.json").read_text()
            assert secret not in up.output
        agent_env = environ(children["agent"].pid)
        agent_creds = Credentials.load(agent_env["REMP_CREDENTIALS_FILE"], env={})
        assert dict(agent_creds.tokens) == {Role.AGENT: creds.tokens[Role.AGENT]}
        assert not {"REMP_REDIS_URL", "REMP_CONTROLLER_REDIS_URL"} & set(agent_env)

        # gRPC: the controller knows the node, healthy; the agent is healthy
        nodes = list_nodes(addr)
        assert [n["node"] for n in nodes] == ["up-e2e"]
        assert nodes[0]["observed"] == {"tp": 2, "pp": 1}
        assert serving(addr["agent_grpc"], "remp.node_agent.v1.NodeAgent")
        assert serving(addr["policy"], "remp.policy.v1.Policy")
        # HTTP: dashboard API, the OpenAI API, /metrics of each service
        d = httpx.get(f"{addr['dashboard']}/api/nodes", timeout=10).json()
        assert d["nodes"][0]["node"] == "up-e2e" and d["nodes"][0]["health"] == "ready"
        assert httpx.get(f"{addr['dashboard']}/api/config", timeout=10).json()["writes_enabled"]
        pol = httpx.get(f"{addr['dashboard']}/api/policy?node=up-e2e", timeout=30)
        assert pol.status_code == 200, pol.text
        assert {"forecast", "decisions"} <= set(pol.json())
        screenshot(addr["dashboard"], artifacts_dir / "remp-up-dashboard.png")
        # vLLM's API key holds through remp up: 401 without it, 200 with it
        assert httpx.get(f"{addr['agent_http']}/v1/models", timeout=10).status_code == 401
        models = httpx.get(f"{addr['agent_http']}/v1/models", timeout=10,
                           headers={"Authorization": f"Bearer {api_key}"}).json()
        assert models["data"]
        assert "remp_controller_rpcs_total" in httpx.get(addr["controller_metrics"], timeout=10).text
        assert "remp_agent_switch" in httpx.get(addr["agent_metrics"], timeout=10).text
        assert "remp_policy_decisions" in httpx.get(addr["policy_metrics"], timeout=10).text
        cf = ["--credentials-file", addr["credentials_file"]]  # the tests' own set is in the env
        r = subprocess.run([sys.executable, "-m", "ops.cli", "status", "--controller",
                            addr["controller"], "--json", *cf], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["nodes"][0]["node"] == "up-e2e"

        # kill -9 Redis: restarted on its port with its password and data; controller serves
        before = {k: p.pid for k, p in up.children().items()}
        n = len(up.lines)
        psutil.Process(before["redis"]).kill()
        assert "same port" in up.wait_line("restarted redis", 60, after=n)
        wait_until(lambda: serving(addr["controller"], "remp.controller.v1.Controller"), 60,
                   "controller not SERVING after Redis came back")
        wait_until(lambda: [x["node"] for x in list_nodes(addr)] == ["up-e2e"], 60,
                   "the node is gone after Redis came back")
        after = {k: p.pid for k, p in up.children().items()}
        assert after["redis"] != before["redis"]
        assert {k: v for k, v in after.items() if k != "redis"} == \
            {k: v for k, v in before.items() if k != "redis"}

        # kill -9 the agent: its engine is cleaned up, it comes back; nothing else restarts
        before = after
        engine = [p for p in up.children()["agent"].children(recursive=True)]
        n = len(up.lines)
        psutil.Process(before["agent"]).kill()
        line = up.wait_line("agent was killed by SIGKILL", 60, after=n)
        assert "killed what was left of it: [" in line and "restarting it in 1 s" in line
        store = Path(f"/dev/shm/remp-up-e2e-{before['agent']}")  # its weight store
        assert f"removed its weight store {store}" in line and not store.exists()
        _, alive = psutil.wait_procs(engine, timeout=30)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        up.wait_line("restarted agent", 60, after=n)
        up.wait_line("agent ready again", 600, after=n)
        after = {k: p.pid for k, p in up.children().items()}
        assert after["agent"] != before["agent"]
        assert {k: v for k, v in after.items() if k != "agent"} == \
            {k: v for k, v in before.items() if k != "agent"}
        assert up.proc.poll() is None
        wait_until(lambda: [(x["node"], x["health"]) for x in list_nodes(addr)]
                   == [("up-e2e", "NODE_HEALTH_READY")], 120, "node not READY again")
        assert up.argv_offenders(secrets) == []

        # the operator's CLI switches it, finding the credentials by the path remp up printed
        r = subprocess.run([sys.executable, "-m", "ops.cli", "reconfigure", "up-e2e", "TP1PP2",
                            "--controller", addr["controller"], *cf, "--json"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert list_nodes(addr)[0]["observed"] == {"tp": 1, "pp": 2}

        # Ctrl-C
        tree = up.descendants()
        rc = up.stop(signal.SIGINT, timeout=180)
        out = up.output
        assert rc == 0, out
        assert "), killed [" not in out, out  # every child stopped on SIGTERM
        _, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        for stopped in ("dashboard", "policy", "agent", "controller", "redis"):
            assert f"stopped {stopped}" in out, out
        assert not list(Path("/dev/shm").glob("remp-up-e2e-*"))  # no weight store left
    finally:
        up.kill()
        for leftover in Path("/dev/shm").glob("remp-up-e2e-*"):  # after a failure's SIGKILL
            shutil.rmtree(leftover, ignore_errors=True)
