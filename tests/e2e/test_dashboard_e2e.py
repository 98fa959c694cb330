"""The ops dashboard in a real browser (Debian's headless chromium, driven by Selenium through
chromium-driver) against the real stack: Redis + controller + a node agent on vLLM CPU (TP2PP1)
+ `remp dashboard`. A Reconfigure started by the test shows its phases live on the page (fed by
Controller.Watch through server-sent events) and lands in the history table; the policy's
advisory recommendation is approved with the page's button after logging in through the page's
form with the operator token; /metrics of the controller and of the agent count the switches;
`remp reconfigure` prints the phases live. Every process gets its credentials from
$REMP_CREDENTIALS_FILE (tests/conftest.py). Screenshots go to the test artifacts directory."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from devstack.agentproc import (AgentProcess, ControllerProcess, arm_switch, free_port, prompt,
                               stream_completion)
from remp.auth import ENV_FILE, ENV_TOKEN
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from devstack.dashproc import DashboardProcess
from remp.redisproc import RedisServer

pytestmark = pytest.mark.e2e

NODE = "dash-e2e"
PHASES = ["QUIESCING", "PREPARING_WORKERS", "MPU_APPLIED", "MIGRATE_KV", "RELOAD_SHARDS",
          "REBINDING", "SERVING_NEW"]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def stack(tiny_model, artifacts_dir, reaper):
    mport = free_port()
    with RedisServer() as r:
        ctl = ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-dash-e2e",
                                env={"REMP_CONTROLLER_METRICS_PORT": str(mport)})
        ctl.metrics_url = f"http://127.0.0.1:{mport}/metrics"
        ctl.start().wait_ready()
        agent = AgentProcess(tiny_model, tp=2, pp=1, log_dir=artifacts_dir, node=NODE,
                             env={"REMP_AGENT_ENABLE_FAULT_INJECTION": "1"},
                             extra=["--controller", ctl.addr])
        try:
            agent.start()
            with DashboardProcess(ctl.addr, artifacts_dir, name="dash-e2e") as dash:
                agent.wait_ready()
                ctl.wait_node_ready(NODE)
                yield ctl, agent, dash
        finally:
            reaper.stop(agent, check=False)
            ctl.stop()


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM and CHROMEDRIVER, "needs Debian's chromium and chromium-driver (./dev test " \
        "installs them)"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    o = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,1300"):
        o.add_argument(arg)
    o.binary_location = CHROMIUM
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=o)
    try:
        yield d
    finally:
        d.quit()


def until(fn, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(what)


def js(d, script: str):
    return d.execute_script(script)


LIVE_STATE = """
const box = document.querySelector('#live-switch');
if (!box || box.hidden) return null;
return {id: box.dataset.switch, state: box.dataset.state,
        active: [...document.querySelectorAll('#live-phases li.active')].map(li => li.dataset.phase),
        done: [...document.querySelectorAll('#live-phases li.done')].map(li => li.dataset.phase),
        log: [...document.querySelectorAll('#live-log li')].map(li => [li.dataset.type, li.dataset.phase, li.textContent])};
"""


def node_row(d):
    return js(d, f"""const tr = document.querySelector('#nodes tr[data-node="{NODE}"]');
        return tr ? tr.textContent : null;""")


def history_row(d, sid):
    return js(d, f"""const tr = document.querySelector('#history tr[data-switch="{sid}"]');
        return tr ? {{outcome: tr.dataset.outcome, text: tr.textContent}} : null;""")


def reconfigure(ctl, tp, pp, **kw) -> str:
    with grpc.insecure_channel(ctl.addr) as ch:
        r = ctl.stub(ch).Reconfigure(controller_pb2.ReconfigureRequest(
            node=NODE, target=types_pb2.Topology(tp=tp, pp=pp), reason="dashboard e2e", **kw),
            timeout=30)
    assert r.switch_id and not r.noop
    return r.switch_id


def one_request(agent, out: list[str]) -> None:
    """One 200-token completion streamed from the agent (a request decoding through a switch)."""
    async def go():
        async with httpx.AsyncClient(timeout=300) as c:
            out.append(await stream_completion(c, agent.http, prompt(1, 60), 200))
    asyncio.run(go())


def test_page_shows_a_switch_live_and_in_history(stack, browser, artifacts_dir):
    ctl, agent, dash = stack
    d = browser
    d.get(dash.url)
    until(lambda: node_row(d), 30, "the page lists the node")
    assert "TP2PP1" in node_row(d) and "ready" in node_row(d)
    until(lambda: "live" in js(d, "return document.querySelector('#stream').textContent"), 20,
          "the event stream is connected")
    time.sleep(1.5)  # the dashboard's Watch is subscribed before the switch starts
    d.save_screenshot(str(artifacts_dir / "dashboard-before.png"))

    # The agent's test-only start gate (armed for its next switch) holds the switch (accepted,
    # not yet quiescing) until one request is decoding: the page must show it in flight before
    # any phase has run.
    asyncio.run(arm_switch(agent.grpc_addr, start_when_running=1))
    sid = reconfigure(ctl, 1, 2)
    held = until(lambda: (s := js(d, LIVE_STATE)) and s["id"] == sid and s, 20,
                 "the page shows the accepted switch")
    assert held["state"] == "running" and held["done"] == []
    assert held["log"] and "accepted" in held["log"][0][2]
    until(lambda: "switching" in (node_row(d) or ""), 10, "the node row says switching")
    d.save_screenshot(str(artifacts_dir / "dashboard-switch-accepted.png"))

    seen: list[dict] = []
    out: list[str] = []
    t = threading.Thread(target=one_request, args=(agent, out))
    t.start()

    def finished():
        s = js(d, LIVE_STATE)
        if s and (not seen or s != seen[-1]):
            seen.append(s)
        return s and s["state"] != "running" and s
    final = until(finished, 120, "the switch finishes on the page", every=0.02)
    d.save_screenshot(str(artifacts_dir / "dashboard-switch-done.png"))
    t.join(300)
    assert out and out[0], "the request in flight did not complete"

    assert final["id"] == sid and final["state"] == "succeeded", final
    logged = [ph for typ, ph, _ in final["log"] if typ == "switch_phase" and ph in PHASES]
    assert logged == PHASES, final["log"]  # every phase arrived live, in order
    assert final["log"][-1][0] == "switch_done" and "succeeded" in final["log"][-1][2]
    assert set(final["done"]) >= set(PHASES)
    # the page was seen mid-switch with some phase active (it was not only drawn at the end)
    assert any(s["state"] == "running" for s in seen), seen

    row = until(lambda: history_row(d, sid), 20, "the switch lands in the history table")
    assert row["outcome"] == "succeeded"
    for ph in ("QUIESCING", "MIGRATE_KV", "RELOAD_SHARDS", "REBINDING"):
        assert ph in row["text"], row
    assert "TP2PP1 → TP1PP2" in row["text"]
    until(lambda: "TP1PP2" in js(d, f"""return document.querySelector(
        '#nodes tr[data-node="{NODE}"] td.observed').textContent"""), 20, "observed TP1PP2")
    d.save_screenshot(str(artifacts_dir / "dashboard.png"))
    print(f"screenshots in {artifacts_dir}")


def test_approve_button_runs_the_recommendation(stack, browser, artifacts_dir):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    ctl, agent, dash = stack
    d = browser
    with grpc.insecure_channel(ctl.addr) as ch:  # what the advisory policy records
        ctl.stub(ch).RecordRecommendation(controller_pb2.RecordRecommendationRequest(
            node=NODE, recommended=types_pb2.Topology(tp=2, pp=1), reason="load fell to 0.2 "
            "req/s: TP2PP1 has the lower TTFT", decision_id="pd-e2e-1"), timeout=10)
    d.get(dash.url)
    # read-only until logged in: the recommendation shows, no button, the login form does
    until(lambda: "lower TTFT" in (node_row(d) or ""), 30, "the page shows the recommendation")
    assert not d.find_elements(By.CSS_SELECTOR, "button.approve, button.reconfigure")
    form = d.find_element(By.ID, "login")
    assert form.is_displayed() and not d.find_element(By.ID, "logout").is_displayed()
    # a wrong token: refused on the page, still read-only
    d.find_element(By.ID, "login-token").send_keys("not-the-operator-token-123")
    d.find_element(By.ID, "login-submit").click()
    until(lambda: d.find_element(By.ID, "login-error").is_displayed(), 10, "a login error")
    assert "operator credential" in d.find_element(By.ID, "login-error").text
    assert not d.find_elements(By.CSS_SELECTOR, "button.approve")
    # the operator token: logged in (the cookie is HttpOnly: the page's script cannot read it)
    d.find_element(By.ID, "login-token").send_keys(dash.operator_token())
    d.find_element(By.ID, "login-submit").click()
    until(lambda: d.find_element(By.ID, "logout").is_displayed(), 10, "logged in")
    assert not form.is_displayed() and not d.find_element(By.ID, "login-error").is_displayed()
    assert "approve enabled" in d.find_element(By.ID, "access").text
    assert js(d, "return document.cookie") == ""
    assert d.find_element(By.ID, "login-token").get_attribute("value") == ""
    d.save_screenshot(str(artifacts_dir / "dashboard-logged-in.png"))
    css = f'#nodes tr[data-node="{NODE}"] button.approve'
    btn = until(lambda: d.find_elements(By.CSS_SELECTOR, css), 30, "an approve button")[0]
    assert btn.text == "Approve TP2PP1"
    until(lambda: "live" in js(d, "return document.querySelector('#stream').textContent"), 20,
          "the event stream is connected")

    def click():  # the table is redrawn every 2 s: a button found a moment ago may be gone
        try:
            d.find_element(By.CSS_SELECTOR, css).click()
            return True
        except (StaleElementReferenceException, NoSuchElementException):
            return False
    until(click, 10, "the approve button clicked")
    final = until(lambda: (s := js(d, LIVE_STATE)) and s["state"] != "running" and s, 120,
                  "the approved switch finishes")
    assert final["state"] == "succeeded"
    row = until(lambda: history_row(d, final["id"]), 20, "in history")
    assert "TP1PP2 → TP2PP1" in row["text"] and "approved in the dashboard" in row["text"]
    d.save_screenshot(str(artifacts_dir / "dashboard-approved.png"))


def sample(text: str, name: str, **labels) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def succeeded_switches(ctl) -> int:
    """The node's switches that succeeded, by the controller's own history."""
    with grpc.insecure_channel(ctl.addr) as ch:
        recs = ctl.stub(ch).ListSwitches(controller_pb2.ListSwitchesRequest(node=NODE),
                                         timeout=10).switches
    return sum(r.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED for r in recs)


def other_topology(ctl) -> str:
    """TP1PP2 when the node is on TP2PP1, else TP2PP1 (the two the tests move between)."""
    with grpc.insecure_channel(ctl.addr) as ch:
        obs = ctl.stub(ch).GetState(controller_pb2.GetStateRequest(node=NODE), timeout=10).observed
    return "TP1PP2" if (obs.tp, obs.pp) == (2, 1) else "TP2PP1"


def test_metrics_after_switches(stack):
    """Every switch counted once on both /metrics (no warm-ups). The browser tests above make
    two, the first with a request decoding through it; without them (run alone, or no
    chromium) this test makes such a switch first, so its checks do not hang on theirs."""
    ctl, agent, dash = stack
    if succeeded_switches(ctl) == 0:  # held until a request decodes, as the browser test's
        tp, pp = (1, 2) if other_topology(ctl) == "TP1PP2" else (2, 1)
        asyncio.run(arm_switch(agent.grpc_addr, start_when_running=1))
        sid = reconfigure(ctl, tp, pp)
        out: list[str] = []
        t = threading.Thread(target=one_request, args=(agent, out))
        t.start()

        assert ctl.wait_switch(sid, 180).outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED
        t.join(300)
        assert out and out[0], "the request in flight did not complete"
    n = succeeded_switches(ctl)
    c = httpx.get(ctl.metrics_url, timeout=10).text
    assert sample(c, "remp_controller_switches_total", outcome="succeeded") == n
    for ph in PHASES[:-1]:
        assert sample(c, "remp_controller_switch_phase_seconds_count", phase=ph) == n, ph
    assert sample(c, "remp_controller_switch_downtime_seconds_count") == n
    assert sample(c, "remp_controller_switch_kv_bytes_moved_total") > 0
    assert sample(c, "remp_controller_switch_weight_bytes_loaded_total") > 0
    assert sample(c, "remp_controller_rpcs_total", method="Reconfigure", code="OK") >= n
    # the agent: remp's families on vLLM's own /metrics, next to vLLM's
    a = httpx.get(f"{agent.http}/metrics", timeout=10).text
    assert sample(a, "vllm:request_success_total") is not None
    assert sample(a, "remp_agent_switches_total", outcome="succeeded") == n  # no warm-ups
    assert sample(a, "remp_agent_switch_phase_seconds_bucket", phase="MIGRATE_KV", le="+Inf") == n
    assert sample(a, "remp_agent_switch_weight_bytes_loaded_total") > 0
    assert sample(a, "remp_agent_switch_requests_in_flight_total") >= 1


def test_cli_reconfigure_shows_phases_and_history(stack):
    ctl, agent, dash = stack
    base = [sys.executable, "-m", "ops.cli"]
    before, target = succeeded_switches(ctl), other_topology(ctl)
    r = subprocess.run([*base, "reconfigure", NODE, target, "--controller", ctl.addr,
                        "--reason", "cli e2e"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    order = [next(i for i, ln in enumerate(lines) if f" {ph} " in ln + " ") for ph in PHASES]
    assert order == sorted(order), r.stdout
    assert "succeeded" in lines[-2] and "MIGRATE_KV" in lines[-1], r.stdout
    r = subprocess.run([*base, "history", "--controller", ctl.addr, "--limit", "3"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.count("succeeded") == min(3, before + 1), r.stdout
    r = subprocess.run([*base, "status", "--controller", ctl.addr], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "SERVING" in r.stdout and f"observed {target}" in r.stdout, r.stdout
    wrong = {**os.environ, ENV_TOKEN + "OPERATOR": "wrong-operator-token-0123456789"}
    assert wrong[ENV_FILE]  # the right credentials file, overridden by the wrong token
    r = subprocess.run([*base, "reconfigure", NODE, "TP1PP2", "--controller", ctl.addr],
                       capture_output=True, text=True, timeout=60, env=wrong)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr, r.stdout + r.stderr
