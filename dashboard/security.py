"""The dashboard's web security, pure and testable without a server: the Host allowlist and
security headers (one ASGI middleware), operator sessions, the login rate limit and the checks on
every string a browser sends.

Threat model (docs/security.md): anyone who can reach the port may read (every GET); writing
(start or approve a switch) needs a session, got by posting the operator credential to
``/api/login``. A page on another site cannot use the dashboard through the visitor's browser:
not by DNS rebinding (Host allowlist, every request), not by framing (CSP ``frame-ancestors``,
``X-Frame-Options``), not by a cross-site form or script (the session cookie is
``SameSite=Strict``; writes need ``X-Remp-Dashboard: 1`` and a JSON body, which no cross-site
request can carry without a CORS preflight this app never grants; a foreign ``Origin`` is
refused).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from remp import validate
from remp.errors import InvalidArgument
from remp.topology import Topology

# ---------------------------------------------------------------------------- headers

CSP = "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CSP.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
)

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
WILDCARD_BINDS = ("0.0.0.0", "::", "[::]", "")


def is_loopback(host: str) -> bool:
    h = host.strip().strip("[]").lower()
    return h == "localhost" or h == "::1" or h.startswith("127.")


def host_name(bind_host: str) -> str:
    """How a bind address appears in a Host header (IPv6 in brackets)."""
    h = bind_host.strip()
    return f"[{h}]" if ":" in h and not h.startswith("[") else h


def default_allowed_hosts(bind_host: str, port: int) -> list[str]:
    """The bind host (unless a wildcard), 127.0.0.1, localhost and [::1], each with and without
    the port."""
    names = list(LOOPBACK_NAMES)
    if bind_host.strip() not in WILDCARD_BINDS:
        names.insert(0, host_name(bind_host))
    out: list[str] = []
    for n in names:
        for v in (n, f"{n}:{port}"):
            if v.lower() not in out:
                out.append(v.lower())
    return out


class HostAllowlist:
    """Exact, case-insensitive match of the Host header (``name`` or ``name:port``)."""

    def __init__(self, allowed: Iterable[str]):
        self.allowed = frozenset(a.strip().lower() for a in allowed if a.strip())

    def __contains__(self, host: str | None) -> bool:
        return bool(host) and host.strip().lower().rstrip(".") in self.allowed

    def origin_ok(self, origin: str) -> bool:
        """An ``Origin`` header names an allowed host (``null`` and other schemes do not)."""
        m = re.fullmatch(r"https?://([^/]+)", origin.strip())
        return bool(m) and m.group(1) in self


class SecurityMiddleware:
    """Pure ASGI: refuse a request whose Host is not allowed (421: DNS rebinding), before any
    route runs, SSE included; add :data:`SECURITY_HEADERS` to every response."""

    def __init__(self, app, allowlist: HostAllowlist, on_refused: Callable[[str], None] | None = None):
        self.app, self.allowlist, self.on_refused = app, allowlist, on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            if scope["type"] == "websocket":  # no websocket routes: close before anything runs
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        host = None
        for k, v in scope.get("headers") or ():
            if k == b"host":
                host = v.decode("latin-1")
                break
        if host not in self.allowlist:
            if self.on_refused is not None:
                self.on_refused(scope.get("path", "")[:200])
            body = json.dumps({
                "error": "this dashboard does not answer to that Host name (DNS rebinding "
                         "protection): open it by an allowed name or add this one to "
                         "allowed_hosts (REMP_DASHBOARD_ALLOWED_HOSTS)",
                "code": "MISDIRECTED_REQUEST"}).encode()
            await send({"type": "http.response.start", "status": 421, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"), *SECURITY_HEADERS]})
            await send({"type": "http.response.body", "body": body})
            return

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers") or ()}
                message = {**message, "headers": [*(message.get("headers") or ()),
                                                  *(h for h in SECURITY_HEADERS
                                                    if h[0] not in names)]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


# ---------------------------------------------------------------------------- sessions

def _key(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode()).digest()


class Sessions:
    """Operator sessions in memory: random ids (only their digests kept), an absolute expiry, at
    most ``limit`` alive (the oldest is dropped first). Lost on restart: log in again."""

    MAX_ID_CHARS = 128

    def __init__(self, ttl_s: float, limit: int = 256, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.limit, self.clock = ttl_s, limit, clock
        self._by_key: OrderedDict[bytes, float] = OrderedDict()  # digest -> expires at

    def __len__(self) -> int:
        self._prune()
        return len(self._by_key)

    def _prune(self) -> None:
        now = self.clock()
        for k in [k for k, exp in self._by_key.items() if exp <= now]:
            del self._by_key[k]

    def create(self) -> str:
        self._prune()
        while len(self._by_key) >= self.limit:
            self._by_key.popitem(last=False)
        sid = secrets.token_urlsafe(32)
        self._by_key[_key(sid)] = self.clock() + self.ttl_s
        return sid

    def expires_in(self, session_id: str | None) -> float | None:
        """Seconds left of a live session, None when ``session_id`` is not one."""
        if not session_id or len(session_id) > self.MAX_ID_CHARS:
            return None
        k = _key(session_id)
        exp = self._by_key.get(k)
        if exp is None:
            return None
        left = exp - self.clock()
        if left <= 0:
            del self._by_key[k]
            return None
        return left

    def valid(self, session_id: str | None) -> bool:
        return self.expires_in(session_id) is not None

    def drop(self, session_id: str | None) -> None:
        if session_id and len(session_id) <= self.MAX_ID_CHARS:
            self._by_key.pop(_key(session_id), None)


class LoginLimiter:
    """At most ``per_window`` failed logins per client address per ``window_s`` (sliding);
    beyond it every login from that address is refused (429) until the oldest failure ages out.
    Tracks at most ``max_clients`` addresses (the stalest are forgotten first)."""

    def __init__(self, per_window: int, window_s: float = 60.0, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic):
        self.per_window, self.window_s, self.max_clients = per_window, window_s, max_clients
        self.clock = clock
        self._fails: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, client: str) -> deque[float] | None:
        q = self._fails.get(client)
        if q is None:
            return None
        cutoff = self.clock() - self.window_s
        while q and q[0] <= cutoff:
            q.popleft()
        if not q:
            del self._fails[client]
            return None
        return q

    def retry_after(self, client: str) -> float:
        """0 when ``client`` may try; otherwise seconds until it may."""
        q = self._recent(client)
        if q is None or len(q) < self.per_window:
            return 0.0
        return max(0.0, q[-self.per_window] + self.window_s - self.clock())

    def failed(self, client: str) -> None:
        q = self._recent(client)
        if q is None:
            while len(self._fails) >= self.max_clients:
                self._fails.popitem(last=False)
            q = self._fails[client] = deque()
        self._fails.move_to_end(client)
        q.append(self.clock())
        while len(q) > self.per_window:
            q.popleft()


# ---------------------------------------------------------------------------- input checks

class BadInput(ValueError):
    """A string from the client is out of bounds (HTTP 400, message shown as is)."""


NODE_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")  # controller's rule
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
TARGET_RE = re.compile(r"TP([1-9][0-9]{0,3})PP([1-9][0-9]{0,3})")
MAX_REASON = 500
MAX_BODY = 16 * 1024


def node(value: object, *, required: bool = True) -> str:
    if value is None or value == "":
        if required:
            raise BadInput("node is required")
        return ""
    if not isinstance(value, str) or not NODE_RE.fullmatch(value):
        raise BadInput("node must be 1-253 characters of letters, digits, '.', '_' or '-', "
                       "starting and ending with a letter or digit")
    return value


def target(value: object) -> Topology:
    if not isinstance(value, str) or not TARGET_RE.fullmatch(value):
        raise BadInput("target must look like 'TP1PP2' (tp and pp from 1 to 9999)")
    return Topology.parse(value)


def request_id(value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not REQUEST_ID_RE.fullmatch(value):
        raise BadInput("request_id must be 1-128 characters of letters, digits, '.', '_', ':' "
                       "or '-', starting with a letter or digit")
    return value


def ident(field: str, value: object) -> str:
    """A required id (rollout, switch) by the controller's own rule for ids, shared in
    ``remp.validate.name``: at most 128 characters of [A-Za-z0-9._:-], starting with a letter
    or digit."""
    if value is None or value == "":
        raise BadInput(f"{field} is required")
    if not isinstance(value, str):
        raise BadInput(f"{field} must be a string")
    try:
        return validate.name(field, value, required=True)
    except InvalidArgument as exc:
        raise BadInput(str(exc)) from None


def rollout_id(value: object) -> str:
    return ident("rollout_id", value)


def switch_id(value: object) -> str:
    return ident("switch_id", value)


ROLLOUT_ACTIONS = ("pause", "resume", "abort")


def rollout_action(value: object) -> str:
    if value not in ROLLOUT_ACTIONS:
        raise BadInput(f"action must be one of {', '.join(ROLLOUT_ACTIONS)}")
    return value


def reason(value: object, default: str) -> str:
    if value is None or value == "":
        return default
    if not isinstance(value, str) or len(value) > MAX_REASON:
        raise BadInput(f"reason must be text of at most {MAX_REASON} characters")
    if not value.isprintable():
        raise BadInput("reason must be one line of printable text (no control characters)")
    return value
