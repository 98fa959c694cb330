"""The dashboard's web security against the real `remp dashboard` process (real controller and
Redis on loopback, no engine), issue 14: reads open, writes only after an operator login
(HttpOnly, SameSite=Strict session cookie; wrong or non-operator credentials refused; failed
logins rate-limited per client address), a Host allowlist on every request (DNS rebinding), CSP
and framing headers on every response, and bounded strings from the client. The pure parts
(sessions, limiter, allowlist, validators) are checked at the end without a server."""

import json
import re

import grpc
import httpx
import pytest

from dashboard import security
from dashboard.app import build_app
from dashboard.config import DashboardSettings
from devstack.agentproc import ControllerProcess
from remp.auth import Credentials, Role
from devstack.dashproc import CSRF, DashboardProcess
from remp.redisproc import RedisServer
from tests.integration.test_controller import reg

CSP = "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"


@pytest.fixture(scope="module")
def dash(artifacts_dir):
    with RedisServer() as r:
        # d1 never heartbeats: a lease longer than the module keeps it READY (no-op switches)
        with ControllerProcess(r.url, log_dir=artifacts_dir, name="ctl-dash-sec",
                               lease_seconds=600) as c:
            with grpc.insecure_channel(c.addr) as ch:
                c.stub(ch).RegisterNode(reg("d1"), timeout=5)
            with DashboardProcess(c.addr, artifacts_dir, name="dash-sec") as d:
                yield d


def tokens() -> dict[Role, str]:
    return dict(Credentials.load().tokens)


def client(dash, source: str = "127.0.0.1", **kw) -> httpx.Client:
    """A client from ``source`` (any 127.0.0.0/8 address: the limiter counts per address)."""
    return httpx.Client(base_url=dash.url, timeout=10, headers=CSRF,
                        transport=httpx.HTTPTransport(local_address=source), **kw)


def noop_body(rid: str) -> dict:
    return {"node": "d1", "target": "TP2PP1", "request_id": rid, "reason": "security test"}


def test_reads_are_open_without_login(dash):
    with httpx.Client(base_url=dash.url, timeout=10) as c:
        for path in ("/", "/static/app.js", "/static/style.css", "/api/config", "/api/nodes",
                     "/api/switches", "/api/switches?node=d1", "/healthz"):
            assert c.get(path).status_code == 200, path
        cfg = c.get("/api/config").json()
        assert cfg["writes_enabled"] is True and cfg["can_write"] is False
        assert [n["node"] for n in c.get("/api/nodes").json()["nodes"]] == ["d1"]


def test_writes_without_a_session_are_401(dash):
    with client(dash) as c:
        r = c.post("/api/reconfigure", json=noop_body("sec-nologin-1"))
        assert r.status_code == 401 and r.json()["code"] == "UNAUTHENTICATED"
        assert "log in" in r.json()["error"]
        # the approve button's request, same answer
        r = c.post("/api/reconfigure", json={"node": "d1", "target": "TP1PP2",
                                             "reason": "approved in the dashboard: x",
                                             "request_id": "pd-abc-1"})
        assert r.status_code == 401
        # a made-up session cookie is no session
        for name in ("remp_session", "__Host-remp_session"):
            c.cookies.set(name, "x" * 43)
        assert c.post("/api/reconfigure", json=noop_body("sec-nologin-2")).status_code == 401
        assert c.get("/api/config").json()["can_write"] is False
    ids = [s["request_id"] for s in httpx.get(dash.url + "/api/switches").json()["switches"]]
    assert not {"sec-nologin-1", "sec-nologin-2", "pd-abc-1"} & set(ids)


def test_only_the_operator_token_logs_in(dash):
    tok = tokens()
    with client(dash, "127.0.0.2") as c:  # its failures count against 127.0.0.2 only
        for wrong in ("not-the-token-at-all-0123", tok[Role.OPERATOR] + "x",
                      tok[Role.AGENT], tok[Role.CONTROLLER], tok[Role.POLICY]):
            r = c.post("/api/login", json={"token": wrong})
            assert r.status_code == 401 and r.json()["code"] == "UNAUTHENTICATED"
            assert "set-cookie" not in r.headers
        assert c.post("/api/login", json={"token": 42}).status_code == 400
        assert c.post("/api/login", json={"token": "x" * 5000}).status_code == 401
        assert c.get("/api/config").json()["can_write"] is False
        # login itself needs the CSRF header and JSON (no cross-site login form)
        r = c.post("/api/login", json={"token": tok[Role.OPERATOR]},
                   headers={"x-remp-dashboard": "0"})
        assert r.status_code == 403 and "set-cookie" not in r.headers
        r = c.post("/api/login", data={"token": tok[Role.OPERATOR]})
        assert r.status_code == 403 and "set-cookie" not in r.headers
        r = c.post("/api/login", json={"token": tok[Role.OPERATOR]},
                   headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and "set-cookie" not in r.headers


def test_operator_login_sets_a_strict_httponly_session(dash):
    tok = tokens()[Role.OPERATOR]
    with client(dash) as c:
        r = c.post("/api/login", json={"token": tok})
        assert r.status_code == 200, r.text
        cookie = r.headers["set-cookie"]
        attrs = [a.strip().lower() for a in cookie.split(";")]
        name, _, sid = cookie.split(";")[0].partition("=")
        assert name == "remp_session" and len(sid) >= 43 and tok not in cookie
        assert "httponly" in attrs and "samesite=strict" in attrs and "path=/" in attrs
        assert "secure" not in attrs  # loopback default (cookie_secure), see the in-process test
        assert any(a.startswith("max-age=") for a in attrs)
        cfg = c.get("/api/config").json()
        assert cfg["can_write"] is True and 0 < cfg["session_expires_in_s"] <= 8 * 3600
        r = c.post("/api/reconfigure", json=noop_body("sec-login-1"))
        assert r.status_code == 200 and r.json()["noop"] is True
        # a second browser with its own session; logging one out leaves the other
        with dash.login() as other:
            assert c.post("/api/logout", json={}).status_code == 200
            assert c.get("/api/config").json()["can_write"] is False
            assert other.post("/api/reconfigure", json=noop_body("sec-login-2")).status_code == 200
    # the logged-out session id is dead on the server, not only forgotten by the client
    with client(dash) as c:
        c.cookies.set("remp_session", sid)
        assert c.post("/api/reconfigure", json=noop_body("sec-login-3")).status_code == 401


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example",
                                  "localhost:1", "", "10.0.0.1:{port}"])
def test_foreign_host_header_is_refused(dash, host):
    host = host.format(port=dash.port)
    with client(dash) as c:
        for path in ("/", "/api/config", "/api/nodes", "/api/events", "/static/app.js",
                     "/healthz", "/nope"):
            r = c.get(path, headers={"host": host})
            assert r.status_code == 421, (path, r.status_code)
            assert r.json()["code"] == "MISDIRECTED_REQUEST"
            assert r.headers["content-security-policy"] == CSP
        r = c.post("/api/login", json={"token": tokens()[Role.OPERATOR]}, headers={"host": host})
        assert r.status_code == 421 and "set-cookie" not in r.headers
        with dash.login() as op:  # a session does not help a rebound page either
            r = op.post("/api/reconfigure", json=noop_body("sec-host-1"), headers={"host": host})
            assert r.status_code == 421


def test_allowed_host_names(dash):
    with client(dash) as c:
        for host in (f"127.0.0.1:{dash.port}", f"localhost:{dash.port}", f"LOCALHOST:{dash.port}",
                     f"[::1]:{dash.port}", "localhost", "127.0.0.1"):
            assert c.get("/api/config", headers={"host": host}).status_code == 200, host


def _check_headers(r: httpx.Response, what: str) -> None:
    h = r.headers
    assert h.get("content-security-policy") == CSP, what
    assert h.get("x-frame-options") == "DENY", what
    assert h.get("x-content-type-options") == "nosniff", what
    assert h.get("referrer-policy") == "no-referrer", what


def test_csp_and_frame_headers_on_every_response(dash):
    with client(dash, "127.0.0.5") as c:
        for path in ("/", "/api/config", "/api/nodes", "/api/switches", "/healthz",
                     "/static/app.js", "/static/style.css", "/nope", "/api/policy?node=d1"):
            _check_headers(c.get(path), path)
        _check_headers(c.post("/api/reconfigure", json=noop_body("sec-h")), "401")
        _check_headers(c.post("/api/login", json={"token": "wrong-token-wrong-token"}), "login")
        with c.stream("GET", "/api/events") as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            _check_headers(r, "/api/events")
        with dash.login() as op:
            _check_headers(op.post("/api/reconfigure", json=noop_body("sec-h2")), "200")
            _check_headers(op.post("/api/logout", json={}), "logout")


def test_page_has_no_inline_script_or_style_and_a_login_form(dash):
    html = httpx.get(dash.url + "/").text
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="/static/app.js">']
    assert not re.search(r"<style\b|\sstyle=|\son[a-z]+=|javascript:", html, re.I)
    assert re.search(r'<input[^>]*id="login-token"[^>]*type="password"', html)
    assert 'id="logout"' in html and 'action="/api/login"' in html
    js = httpx.get(dash.url + "/static/app.js").text
    assert "style" not in js and "innerHTML" not in js and "eval(" not in js


BAD_BODIES = [
    ({"node": "../../etc/passwd", "target": "TP2PP1"}, "node must be"),
    ({"node": "d" * 300, "target": "TP2PP1"}, "node must be"),
    ({"node": "d1\r\nX-Injected: 1", "target": "TP2PP1"}, "node must be"),
    ({"node": ["d1"], "target": "TP2PP1"}, "node must be"),
    ({"target": "TP2PP1"}, "node is required"),
    ({"node": "d1", "target": "TP2PP1; rm -rf /"}, "target must"),
    ({"node": "d1", "target": "TP99999PP1"}, "target must"),
    ({"node": "d1", "target": 7}, "target must"),
    ({"node": "d1", "target": "TP2PP1", "request_id": "a b"}, "request_id must"),
    ({"node": "d1", "target": "TP2PP1", "request_id": "r" * 129}, "request_id must"),
    ({"node": "d1", "target": "TP2PP1", "request_id": "../x"}, "request_id must"),
    ({"node": "d1", "target": "TP2PP1", "reason": "r" * 501}, "reason must"),
    ({"node": "d1", "target": "TP2PP1", "reason": "two\nlines"}, "reason must"),
    ({"node": "d1", "target": "TP2PP1", "reason": "bell\x07"}, "reason must"),
    ({"node": "d1", "target": "TP2PP1", "reason": {"a": 1}}, "reason must"),
]


def test_client_strings_are_bounded(dash):
    with dash.login() as op:
        for body, msg in BAD_BODIES:
            r = op.post("/api/reconfigure", json=body)
            assert r.status_code == 400 and msg in r.json()["error"], (body, r.text)
            assert r.json()["code"] == "INVALID_ARGUMENT"
        r = op.post("/api/reconfigure", content=b"[1, 2]", headers={"content-type":
                                                                       "application/json"})
        assert r.status_code == 400 and "JSON object" in r.json()["error"]
        r = op.post("/api/reconfigure", content=b"{", headers={"content-type": "application/json"})
        assert r.status_code == 400
        big = {**noop_body("sec-big"), "pad": "x" * 20000}
        r = op.post("/api/reconfigure", json=big)
        assert r.status_code == 400 and "limited" in r.json()["error"]
        # at the bounds: accepted
        r = op.post("/api/reconfigure", json={"node": "d1", "target": "TP2PP1",
                                              "request_id": "r" * 128, "reason": "é" * 500})
        assert r.status_code == 200 and r.json()["noop"] is True
        for path in ("/api/switches?node=../x", "/api/events?node=%0d%0a", "/api/policy?node=a%20b",
                     "/api/switches?node=" + "n" * 300):
            r = op.get(path)
            assert r.status_code in (400, 404), path  # 404: no policy configured here
            if path.startswith(("/api/switches", "/api/events")):
                assert r.status_code == 400 and "node must be" in r.json()["error"], path


def test_failed_logins_are_rate_limited_per_client_address(dash):
    tok = tokens()[Role.OPERATOR]
    with client(dash, "127.0.0.3") as c:
        for i in range(10):
            assert c.post("/api/login", json={"token": f"guess-{i:02d}-xxxxxxxxxxxx"}
                          ).status_code == 401, i
        r = c.post("/api/login", json={"token": "guess-10-xxxxxxxxxxxx"})
        assert r.status_code == 429 and r.json()["code"] == "RATE_LIMITED"
        assert 0 < int(r.headers["retry-after"]) <= 60
        # blocked even with the right token now
        r = c.post("/api/login", json={"token": tok})
        assert r.status_code == 429 and "set-cookie" not in r.headers
    with client(dash, "127.0.0.4") as c:  # another address is not affected
        assert c.post("/api/login", json={"token": tok}).status_code == 200


def test_no_token_or_session_id_in_the_log(dash):
    tok = tokens()
    with dash.login() as op:
        sid = next(iter(op.cookies.values()))
        assert op.post("/api/reconfigure", json=noop_body("sec-log-1")).status_code == 200
        assert op.post("/api/logout", json={}).status_code == 200
    text = dash.log_path.read_text()
    assert '"event": "dashboard.login"' in text and '"event": "dashboard.reconfigure"' in text
    assert '"event": "dashboard.login_refused"' in text
    for t in tok.values():
        assert t not in text
    assert sid not in text


# ---------------------------------------------------------------------------- in process, pure

async def test_cookie_secure_setting_in_process():
    creds = Credentials.generate()
    s = DashboardSettings(controller="127.0.0.1:1", host="0.0.0.0", port=8443,
                          allowed_hosts="dash.example.org,dash.example.org:8443")
    assert s.secure_cookie is True  # not loopback: Secure by default
    app = build_app(s, creds, 8443)
    try:
        t = httpx.ASGITransport(app=app, client=("192.0.2.7", 5555))
        async with httpx.AsyncClient(transport=t, base_url="https://dash.example.org",
                                     headers=CSRF) as c:
            r = await c.post("/api/login", json={"token": creds.tokens[Role.OPERATOR]})
            assert r.status_code == 200
            attrs = [a.strip().lower() for a in r.headers["set-cookie"].split(";")]
            assert attrs[0].startswith("__host-remp_session=") and "secure" in attrs
            assert "httponly" in attrs and "samesite=strict" in attrs and "path=/" in attrs
            assert (await c.get("/api/config")).json()["can_write"] is True
            r = await c.get("/api/config", headers={"host": "localhost:8443"})
            assert r.status_code == 421  # an explicit list replaces the defaults
    finally:
        await app.state.backend.close()
    loop = DashboardSettings(controller="x:1")
    assert loop.secure_cookie is False and loop.hosts_for(8080) == [
        "127.0.0.1", "127.0.0.1:8080", "localhost", "localhost:8080", "[::1]", "[::1]:8080"]
    assert DashboardSettings(controller="x:1", host="127.0.0.1", cookie_secure=True).secure_cookie
    with pytest.raises(ValueError):
        DashboardSettings(controller="x:1", allowed_hosts="evil/path")
    with pytest.raises(ValueError):
        DashboardSettings(controller="x:1", allowed_hosts=" , ")


def test_sessions_expire_and_are_bounded():
    now = [1000.0]
    ss = security.Sessions(ttl_s=10, limit=3, clock=lambda: now[0])
    a = ss.create()
    assert ss.valid(a) and not ss.valid(a + "x") and not ss.valid("") and not ss.valid(None)
    now[0] += 9.9
    assert ss.expires_in(a) == pytest.approx(0.1)
    now[0] += 0.2
    assert not ss.valid(a)
    ids = [ss.create() for _ in range(4)]  # at most 3 alive: the oldest goes
    assert not ss.valid(ids[0]) and all(ss.valid(i) for i in ids[1:]) and len(ss) == 3
    ss.drop(ids[1])
    assert not ss.valid(ids[1])
    assert len({ss.create() for _ in range(50)}) == 50


def test_login_limiter_slides():
    now = [0.0]
    lim = security.LoginLimiter(3, window_s=60, clock=lambda: now[0])
    for i in range(3):
        assert lim.retry_after("a") == 0
        lim.failed("a")
        now[0] += 10
    assert lim.retry_after("a") == pytest.approx(30) and lim.retry_after("b") == 0
    now[0] = 60.5  # the first failure aged out
    assert lim.retry_after("a") == 0
    lim.failed("a")
    assert lim.retry_after("a") == pytest.approx(9.5)
    small = security.LoginLimiter(1, max_clients=2, clock=lambda: now[0])
    for ip in ("x", "y", "z"):
        small.failed(ip)
    assert small.retry_after("x") == 0 and small.retry_after("z") > 0


def test_allowlist_and_validators():
    allow = security.HostAllowlist(security.default_allowed_hosts("10.1.2.3", 8080))
    assert "10.1.2.3:8080" in allow and "localhost:8080" in allow and "[::1]" in allow
    assert "10.1.2.3:8081" not in allow and "evil.example" not in allow and None not in allow
    assert allow.origin_ok("http://localhost:8080") and not allow.origin_ok("null")
    assert not allow.origin_ok("http://evil.example") and not allow.origin_ok("file://x")
    assert security.default_allowed_hosts("::", 80) == [
        "127.0.0.1", "127.0.0.1:80", "localhost", "localhost:80", "[::1]", "[::1]:80"]
    assert security.default_allowed_hosts("fd00::5", 1)[:2] == ["[fd00::5]", "[fd00::5]:1"]
    assert security.node("a.b-c_9") == "a.b-c_9" and security.node(None, required=False) == ""
    assert str(security.target("TP1PP2")) in ("TP1PP2", "TP1×PP2")
    assert security.request_id("pd-1a2b3c4d-7") == "pd-1a2b3c4d-7"
    assert security.request_id("") is None
    assert security.reason(None, "dflt") == "dflt"
    assert json.loads(json.dumps(security.reason("ünïcode → ok", "")))
