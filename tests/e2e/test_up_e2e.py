"""`remp up` (what `./dev up` runs) as a user runs it: start the whole stack (private Redis,
controller, node agent on vLLM CPU, policy, dashboard), query it over gRPC (grpcurl) and HTTP,
Ctrl-C it, and check that every process it started is gone."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from remp.agentproc import grpcurl

pytestmark = pytest.mark.e2e

TOKEN = "up-e2e"


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


def test_remp_up_starts_answers_and_stops_without_orphans(tiny_model, artifacts_dir):
    log_dir = artifacts_dir / "up"
    env = {k: v for k, v in os.environ.items() if k != "REMP_REDIS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "remp.cli", "up", "--free-ports", "--model", str(tiny_model),
         "--log-dir", str(log_dir), "--token", TOKEN, "--node", "up-e2e"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        ready = None
        while time.monotonic() < deadline and ready is None:
            assert proc.poll() is None, "".join(lines)
            ready = next((ln for ln in lines if ln.startswith("remp up: ready ")), None)
            time.sleep(0.5)
        assert ready, "".join(lines)
        addr = json.loads(ready[len("remp up: ready "):])
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        for what in ("redis-server", " controller ", " agent ", " policy serve", " dashboard "):
            assert what in names, (what, names)

        # gRPC: the controller knows the node, healthy; the agent is healthy
        r = grpcurl("-plaintext", addr["controller"], "remp.controller.v1.Controller/ListNodes")
        assert r.returncode == 0, r.stderr
        nodes = json.loads(r.stdout)["nodes"]
        assert [n["node"] for n in nodes] == ["up-e2e"]
        assert nodes[0]["observed"] == {"tp": 2, "pp": 1}
        r = grpcurl("-plaintext", "-d", '{"service":"remp.node_agent.v1.NodeAgent"}',
                    addr["agent_grpc"], "grpc.health.v1.Health/Check")
        assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr
        r = grpcurl("-plaintext", "-d", '{"service":"remp.policy.v1.Policy"}', addr["policy"],
                    "grpc.health.v1.Health/Check")
        assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr
        # HTTP: dashboard API, the OpenAI API, /metrics of each service
        d = httpx.get(f"{addr['dashboard']}/api/nodes", timeout=10).json()
        assert d["nodes"][0]["node"] == "up-e2e" and d["nodes"][0]["health"] == "ready"
        assert httpx.get(f"{addr['dashboard']}/api/config", timeout=10).json()["can_write"]
        pol = httpx.get(f"{addr['dashboard']}/api/policy?node=up-e2e", timeout=30)
        assert pol.status_code == 200, pol.text
        assert {"forecast", "decisions"} <= set(pol.json())
        screenshot(addr["dashboard"], artifacts_dir / "remp-up-dashboard.png")
        models = httpx.get(f"{addr['agent_http']}/v1/models", timeout=10).json()
        assert models["data"]
        assert "remp_controller_rpcs_total" in httpx.get(addr["controller_metrics"], timeout=10).text
        assert "remp_agent_switch" in httpx.get(addr["agent_metrics"], timeout=10).text
        assert "remp_policy_decisions" in httpx.get(addr["policy_metrics"], timeout=10).text
        # the CLI against it
        r = subprocess.run([sys.executable, "-m", "remp.cli", "status", "--controller",
                            addr["controller"], "--json"], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["nodes"][0]["node"] == "up-e2e"

        # Ctrl-C
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=180)
        reader.join(10)
        out = "".join(lines)
        assert rc == 0, out
        assert "killed" not in out, out  # everything stopped on SIGTERM, nothing needed SIGKILL
        gone, alive = psutil.wait_procs(tree, timeout=10)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        for stopped in ("dashboard", "policy", "agent", "controller", "redis"):
            assert f"stopped {stopped}" in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(10)
        proc.stdout.close()
