"""The dashboard's web app (Starlette): a static page plus a JSON API and a server-sent-event
stream, all read from the controller (and the policy) over gRPC.

    GET  /                      the page (dashboard/static: no CDN, no inline script or style)
    GET  /api/config            what this browser may do (``can_write``: logged in)
    GET  /api/nodes             ListNodes
    GET  /api/switches?node=    ListSwitches (newest first)
    GET  /api/events?node=&rollout=   Controller.Watch as server-sent events (live phases and
                                rollout progress; one Watch for all streams, fanned out here; it
                                resumes on another controller after the last event when its
                                controller dies)
    GET  /api/rollouts?active=1 ListRollouts (newest first): target, set, floor, state, progress
    GET  /api/rollouts/{id}     GetRollout: waves, each node's state and switch id, the floor
                                and the set's capacity now (ListNodes by the rollout's table)
    GET  /api/switch?id=        GetSwitch (a rollout node's switch record)
    GET  /api/policy?node=      the policy's forecast, past forecasts sampled here, decisions
    GET  /api/saving?node=      GPU-hours the node held vs the whole host, per UTC day (its
                                heartbeat windows and switch records at the controller), and the
                                policy's latest recommendation with its expected saving
    POST /api/login             {token} (the operator credential) → a session cookie
    POST /api/logout            ends the session
    POST /api/reconfigure       {node, target, reason?, request_id?} → Reconfigure (logged in)
    POST /api/control-rollout   {rollout_id, action: pause|resume|abort, reason?} →
                                ControlRollout (logged in, as reconfigure)
    GET  /healthz               200 when the controller answers

Reading is open to whoever reaches the port. Writing needs a session: ``/api/login`` with the
operator token (checked against the credentials' digest, constant time) sets an HttpOnly,
SameSite=Strict cookie naming a random server-side session; failed logins are rate-limited per
client address. Every POST needs the header ``X-Remp-Dashboard: 1`` and a JSON body (a
cross-site form or script cannot send either without a CORS preflight, which this app never
grants) and, when the browser sends one, an allowed ``Origin``. Every request needs an allowed
``Host`` (DNS rebinding) and every response carries a CSP (dashboard/security.py).

The dashboard calls the controller with its own operator token (``creds.only(OPERATOR)``); a
dashboard holding no operator token is read-only (login refused). ``controller`` may name
several controllers (comma-separated, controller HA): reads go to whichever answers, writes
reach the leader (:mod:`remp.controllers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections import deque
from pathlib import Path

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from dashboard import security
from dashboard.config import DashboardSettings
from remp import logs
from dashboard import views
from remp.auth import Credentials, Role, aio_channel
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.controllers import LEADER_RETRY_S, AioControllers
from remp.grpc_util import channel_options
from remp.policy.v1 import policy_pb2, policy_pb2_grpc
from remp.topology import Topology

log = logs.get_logger("remp.dashboard")
STATIC = Path(__file__).parent / "static"
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.UNAUTHENTICATED: 502,  # our token is wrong: a configuration problem here
    grpc.StatusCode.PERMISSION_DENIED: 502, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
SSE_PING_S = 15.0
SSE_QUEUE = 1000  # events buffered per stream; a stream that falls further behind is closed
PAST_FORECASTS = 720  # per node
SAVING_DAYS = 8  # days of heartbeat windows /api/saving reads (the controller keeps 20,000 samples)
SAVING_SWITCHES = 1000  # switch records it reads to know which topology was held when
CSRF_HEADER = "x-remp-dashboard"
ROLLOUT_ACTIONS = {"pause": controller_pb2.ROLLOUT_ACTION_PAUSE,
                   "resume": controller_pb2.ROLLOUT_ACTION_RESUME,
                   "abort": controller_pb2.ROLLOUT_ACTION_ABORT}


class WatchHub:
    """One ``Controller.Watch`` (all nodes) shared by every /api/events stream: the number of
    browsers never becomes a number of controller streams. Started by the first subscriber,
    cancelled after the last one leaves. Its controller dying does not end it: it resumes on
    another after the last event (:meth:`AioControllers.watch`; a gap, when events were trimmed
    meanwhile, is sent to the browsers as a ``watch_gap`` event). When it ends (no controller
    for a while, an error) every stream ends with it and the browsers reconnect (EventSource
    retry), which starts a new one."""

    def __init__(self, ctl: AioControllers, limit: int):
        self.ctl, self.limit = ctl, limit
        self.subs: dict[asyncio.Queue, tuple[str, str]] = {}  # queue -> (node, rollout) filter
        self._task: asyncio.Task | None = None

    def full(self) -> bool:
        return len(self.subs) >= self.limit

    def subscribe(self, node: str, rollout: str = "") -> asyncio.Queue | None:
        """A queue of (id, json) / str (a gap notice) / AioRpcError / None (end), or None
        when at the limit. ``node``, ``rollout``: only that node's / rollout's events ("" all)."""
        if self.full():
            return None
        q: asyncio.Queue = asyncio.Queue(maxsize=SSE_QUEUE)
        self.subs[q] = (node, rollout)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subs.pop(q, None)
        if not self.subs and self._task is not None:
            self._task.cancel()
            self._task = None

    def _end_all(self, item) -> None:
        for q in list(self.subs):
            self.subs.pop(q, None)
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(item)

    def _notify(self, item: str) -> None:
        for q in list(self.subs):
            with contextlib.suppress(asyncio.QueueFull):
                q.put_nowait(item)

    def _gap(self, after: str, why: str) -> None:
        log.warning("dashboard.watch_gap", after_id=after, detail=why)
        self._notify(f"events after {after} were trimmed before the stream resumed: some "
                     "were missed")

    async def _run(self) -> None:
        events = self.ctl.watch(
            controller_pb2.WatchRequest(), on_gap=self._gap,
            on_resume=lambda addr, after: log.info("dashboard.watch_resumed", controller=addr,
                                                   after_id=after))
        try:
            async for ev in events:
                v = views.event_view(ev)
                item = (v["id"], json.dumps(v))
                for q, (node, rollout) in list(self.subs.items()):
                    if (node and node != ev.node) or (rollout and rollout != ev.rollout_id):
                        continue
                    try:
                        q.put_nowait(item)
                    except asyncio.QueueFull:  # too slow a reader: it reconnects and catches up
                        self.subs.pop(q, None)
                        q.get_nowait()
                        q.put_nowait(None)
            self._end_all(None)
        except grpc.aio.AioRpcError as exc:
            self._end_all(exc)
        finally:
            await events.aclose()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._end_all(None)


class Backend:
    """gRPC clients of the controller and the policy (sending the operator token this dashboard
    holds, if any), the shared Watch and the sampled past forecasts."""

    def __init__(self, s: DashboardSettings, creds: Credentials):
        self.s = s
        own = creds.only(Role.OPERATOR)
        # reads to whichever controller answers, writes to the leader
        self.controllers = AioControllers(s.controller, own, timeout=s.rpc_timeout_s,
                                          retry_s=LEADER_RETRY_S)
        self.ctl = self.controllers.stub
        self.pol_ch = aio_channel(s.policy, own, options=channel_options()) if s.policy else None
        self.pol = policy_pb2_grpc.PolicyStub(self.pol_ch) if self.pol_ch else None
        self.watch = WatchHub(self.controllers, s.max_event_streams)
        # node -> {window start: first forecast made for it} (what was predicted, kept to plot
        # against what arrived)
        self.past: dict[str, dict[float, float]] = {}
        self._order: dict[str, deque] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.pol is not None:
            self._task = asyncio.create_task(self._sample_forecasts())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.watch.close()
        await self.controllers.close()
        if self.pol_ch is not None:
            await self.pol_ch.close()

    async def nodes(self) -> list[dict]:
        r = await self.ctl.ListNodes(controller_pb2.ListNodesRequest(), timeout=self.s.rpc_timeout_s)
        return [views.node_view(n) for n in sorted(r.nodes, key=lambda n: n.node)]

    async def switches(self, node: str) -> list[dict]:
        r = await self.ctl.ListSwitches(controller_pb2.ListSwitchesRequest(
            node=node, page_size=self.s.history_page), timeout=self.s.rpc_timeout_s)
        return [views.switch_view(x) for x in r.switches]

    def remember(self, node: str, fc: dict) -> None:
        if not fc["points"]:
            return
        p = fc["points"][0]
        past = self.past.setdefault(node, {})
        order = self._order.setdefault(node, deque())
        if p["t"] not in past:
            past[p["t"]] = p["mean"]
            order.append(p["t"])
            while len(order) > PAST_FORECASTS:
                past.pop(order.popleft(), None)

    async def forecast(self, node: str, remember: bool = True) -> dict:
        fc = views.forecast_view(await self.pol.GetForecast(
            policy_pb2.GetForecastRequest(node=node), timeout=self.s.rpc_timeout_s))
        if remember:
            self.remember(node, fc)
        return fc

    async def policy(self, node: str) -> dict:
        # only nodes the controller knows are remembered (a browser cannot grow self.past)
        fc = await self.forecast(node, remember=False)
        dec = await self.pol.ListDecisions(policy_pb2.ListDecisionsRequest(node=node, page_size=50),
                                           timeout=self.s.rpc_timeout_s)
        fc["past"] = [{"t": t, "mean": m} for t, m in sorted(self.past.get(node, {}).items())]
        return {"forecast": fc, "decisions": [views.decision_view(d) for d in dec.decisions]}

    async def saving(self, node: str) -> dict:
        t = self.s.rpc_timeout_s
        st = await self.ctl.GetState(controller_pb2.GetStateRequest(node=node), timeout=t)
        req = controller_pb2.GetTrafficRequest(node=node)
        req.since.FromNanoseconds(int((time.time() - SAVING_DAYS * 86400.0) * 1e9))
        traffic = await self.ctl.GetTraffic(req, timeout=t)
        sw = await self.ctl.ListSwitches(controller_pb2.ListSwitchesRequest(
            node=node, page_size=SAVING_SWITCHES), timeout=t)
        rec, err = None, ""
        if self.pol is None:
            err = "no policy service configured (--policy)"
        else:
            try:
                rec = await self.pol.GetRecommendation(
                    policy_pb2.GetRecommendationRequest(node=node), timeout=t)
            except grpc.aio.AioRpcError as exc:  # not decided for yet, policy down: still the days
                err = f"{exc.code().name}: {exc.details()}"
        return views.saving_view(st, traffic.samples, sw.switches, rec, err)

    async def _sample_forecasts(self) -> None:
        while True:
            try:
                for n in await self.nodes():
                    try:
                        await self.forecast(n["node"])
                    except grpc.aio.AioRpcError:
                        pass  # not known to the policy yet, or policy down: next round
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(self.s.forecast_poll_s)

    async def switch(self, switch_id: str) -> dict:
        return views.switch_view(await self.ctl.GetSwitch(
            controller_pb2.GetSwitchRequest(switch_id=switch_id), timeout=self.s.rpc_timeout_s))

    async def rollouts(self, active_only: bool) -> list[dict]:
        r = await self.ctl.ListRollouts(controller_pb2.ListRolloutsRequest(
            active_only=active_only, limit=self.s.rollouts_page), timeout=self.s.rpc_timeout_s)
        return [views.rollout_row(x) for x in r.rollouts]

    async def rollout(self, rollout_id: str) -> dict:
        t = self.s.rpc_timeout_s
        r = await self.ctl.GetRollout(controller_pb2.GetRolloutRequest(rollout_id=rollout_id),
                                      timeout=t)
        nodes = await self.ctl.ListNodes(controller_pb2.ListNodesRequest(), timeout=t)
        return views.rollout_view(r, nodes.nodes)

    async def control_rollout(self, rollout_id: str, action: str, reason: str) -> dict:
        r = await self.ctl.ControlRollout(controller_pb2.ControlRolloutRequest(
            rollout_id=rollout_id, action=ROLLOUT_ACTIONS[action], reason=reason),
            timeout=self.s.rpc_timeout_s)
        return views.rollout_view(r)

    async def reconfigure(self, node: str, target: Topology, reason: str, request_id: str):
        return await self.ctl.Reconfigure(controller_pb2.ReconfigureRequest(
            node=node, target=types_pb2.Topology(tp=target.tp, pp=target.pp),
            request_id=request_id, reason=reason), timeout=self.s.rpc_timeout_s)


def _json_error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "code": code}, status_code=status, headers=headers)


def _err(exc: grpc.aio.AioRpcError) -> JSONResponse:
    return _json_error(HTTP_STATUS.get(exc.code(), 502), exc.code().name,
                       exc.details() or exc.code().name)


def _client(req: Request) -> str:
    return req.client.host if req.client else "unknown"


class _Refusals:
    """Log refused Host headers without letting a flood of them flood the log."""

    def __init__(self, every_s: float = 60.0):
        self.every_s, self.last, self.count = every_s, -math.inf, 0

    def __call__(self, path: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            log.warning("dashboard.host_refused", path=path, refused_total=self.count,
                        hint="set allowed_hosts (REMP_DASHBOARD_ALLOWED_HOSTS) if this is you")


class _App(Starlette):
    """Starlette with :class:`security.SecurityMiddleware` outermost, outside even Starlette's
    error handler: a 500 carries the security headers too."""

    security: dict

    def build_middleware_stack(self):
        return security.SecurityMiddleware(super().build_middleware_stack(), **self.security)


def build_app(s: DashboardSettings, creds: Credentials | None = None,
              port: int | None = None) -> Starlette:
    """``creds``: default ``Credentials.load(s.credentials_file)``; ``port``: the port actually
    listened on (for the default Host allowlist; default ``s.port``)."""
    creds = Credentials.load(s.credentials_file) if creds is None else creds
    backend = Backend(s, creds)
    writes_enabled = Role.OPERATOR in creds.tokens and Role.OPERATOR in creds.digests
    allow = security.HostAllowlist(s.hosts_for(s.port if port is None else port))
    sessions = security.Sessions(s.session_ttl_s)
    limiter = security.LoginLimiter(s.login_failures_per_minute, 60.0)
    secure = s.secure_cookie
    cookie = "__Host-remp_session" if secure else "remp_session"

    def session_left(req: Request) -> float | None:
        return sessions.expires_in(req.cookies.get(cookie))

    def post_guard(req: Request) -> Response | None:
        """CSRF: the custom header, a JSON content type, and an allowed Origin if one is sent."""
        if req.headers.get(CSRF_HEADER) != "1" or \
                not req.headers.get("content-type", "").startswith("application/json"):
            return _json_error(403, "FORBIDDEN", "send JSON with the header X-Remp-Dashboard: 1")
        origin = req.headers.get("origin")
        if origin is not None and not allow.origin_ok(origin):
            return _json_error(403, "FORBIDDEN", "cross-origin request refused")
        return None

    async def read_json(req: Request) -> dict:
        cl = req.headers.get("content-length", "")
        if cl and (not cl.isdigit() or int(cl) > security.MAX_BODY):
            raise security.BadInput(f"the body is limited to {security.MAX_BODY} bytes")
        buf = bytearray()
        async for chunk in req.stream():
            buf += chunk
            if len(buf) > security.MAX_BODY:
                raise security.BadInput(f"the body is limited to {security.MAX_BODY} bytes")
        try:
            body = json.loads(buf or b"{}")
        except ValueError:
            raise security.BadInput("the body is not JSON") from None
        if not isinstance(body, dict):
            raise security.BadInput("the body must be a JSON object")
        return body

    def bad(exc: security.BadInput) -> JSONResponse:
        return _json_error(400, "INVALID_ARGUMENT", str(exc))

    async def index(_: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-store"})

    async def config(req: Request) -> Response:
        left = session_left(req) if writes_enabled else None
        return JSONResponse({"controller": s.controller, "policy": s.policy or "",
                             "writes_enabled": writes_enabled, "can_write": left is not None,
                             "session_expires_in_s": round(left) if left is not None else None},
                            headers={"cache-control": "no-store"})

    async def healthz(_: Request) -> Response:
        try:
            await backend.nodes()
        except grpc.aio.AioRpcError as exc:
            return _err(exc)
        return JSONResponse({"ok": True})

    async def nodes(_: Request) -> Response:
        try:
            return JSONResponse({"nodes": await backend.nodes(), "at": time.time()})
        except grpc.aio.AioRpcError as exc:
            return _err(exc)

    async def switches(req: Request) -> Response:
        try:
            node = security.node(req.query_params.get("node"), required=False)
            return JSONResponse({"switches": await backend.switches(node)})
        except security.BadInput as exc:
            return bad(exc)
        except grpc.aio.AioRpcError as exc:
            return _err(exc)

    async def policy(req: Request) -> Response:
        if backend.pol is None:
            return _json_error(404, "NOT_CONFIGURED", "no policy service configured (--policy)")
        try:
            return JSONResponse(await backend.policy(security.node(req.query_params.get("node"))))
        except security.BadInput as exc:
            return bad(exc)
        except grpc.aio.AioRpcError as exc:
            return _err(exc)

    async def saving(req: Request) -> Response:
        try:
            return JSONResponse(await backend.saving(security.node(req.query_params.get("node"))))
        except security.BadInput as exc:
            return bad(exc)
        except grpc.aio.AioRpcError as exc:
            return _err(exc)

    async def login(req: Request) -> Response:
        if (refused := post_guard(req)) is not None:
            return refused
        if not writes_enabled:
            return _json_error(403, "READ_ONLY", "read-only dashboard: it holds no operator "
                               "token to act with (give it credentials with one: "
                               "--credentials-file or REMP_CREDENTIALS_FILE)")
        ip = _client(req)
        wait = limiter.retry_after(ip)
        if wait > 0:
            return _json_error(429, "RATE_LIMITED", f"too many failed logins: try again in "
                               f"{math.ceil(wait)} s", {"retry-after": str(math.ceil(wait))})
        try:
            body = await read_json(req)
        except security.BadInput as exc:
            return bad(exc)
        token = body.get("token")
        if not isinstance(token, str) or not token:
            return _json_error(400, "INVALID_ARGUMENT", "need {\"token\": \"<operator token>\"}")
        if creds.role_of(token) != Role.OPERATOR:
            limiter.failed(ip)
            log.warning("dashboard.login_refused", client=ip)
            return _json_error(401, "UNAUTHENTICATED", "that is not the operator credential")
        sessions.drop(req.cookies.get(cookie))  # a login always starts a fresh session
        sid = sessions.create()
        log.info("dashboard.login", client=ip, sessions=len(sessions))
        resp = JSONResponse({"ok": True, "expires_in_s": round(s.session_ttl_s),
                             "secure_cookie": secure}, headers={"cache-control": "no-store"})
        resp.set_cookie(cookie, sid, max_age=int(s.session_ttl_s), path="/", secure=secure,
                        httponly=True, samesite="strict")
        return resp

    async def logout(req: Request) -> Response:
        if (refused := post_guard(req)) is not None:
            return refused
        sid = req.cookies.get(cookie)
        if sessions.valid(sid):
            log.info("dashboard.logout", client=_client(req))
        sessions.drop(sid)
        resp = JSONResponse({"ok": True})
        resp.delete_cookie(cookie, path="/", secure=secure, httponly=True, samesite="strict")
        return resp

    def write_guard(req: Request, what: str) -> Response | None:
        """Every action: a dashboard that can act, a live operator session, then CSRF."""
        if not writes_enabled:
            return _json_error(403, "READ_ONLY", "read-only dashboard: it holds no operator token")
        if session_left(req) is None:
            return _json_error(401, "UNAUTHENTICATED", "log in with the operator credential "
                               f"to {what}")
        return post_guard(req)

    async def reconfigure(req: Request) -> Response:
        if (refused := write_guard(req, "approve or start switches")) is not None:
            return refused
        try:
            body = await read_json(req)
            node = security.node(body.get("node"))
            target = security.target(body.get("target"))
            reason = security.reason(body.get("reason"), "started from the dashboard")
            request_id = security.request_id(body.get("request_id")) or \
                f"dash-{uuid.uuid4().hex[:12]}"
        except security.BadInput as exc:
            return bad(exc)
        try:
            r = await backend.reconfigure(node, target, reason, request_id)
        except grpc.aio.AioRpcError as exc:
            return _err(exc)
        log.info("dashboard.reconfigure", node=node, target=str(target), switch_id=r.switch_id,
                 request_id=request_id, noop=r.noop, duplicate=r.duplicate, client=_client(req))
        return JSONResponse({"switch_id": r.switch_id, "noop": r.noop, "duplicate": r.duplicate,
                             "request_id": request_id})

    async def switch(req: Request) -> Response:
        try:
            sid = security.switch_id(req.query_params.get("id"))
            return JSONResponse(await backend.switch(sid))
        except security.BadInput as exc:
            return bad(exc)
        except grpc.aio.AioRpcError as exc:
            return _err(exc)

    async def rollouts(req: Request) -> Response:
        active = req.query_params.get("active", "")
        if active not in ("", "0", "1"):
            return _json_error(400, "INVALID_ARGUMENT", "active must be 0 or 1")
        try:
            return JSONResponse({"rollouts": await backend.rollouts(active == "1"),
                                 "at": time.time()})
        except grpc.aio.AioRpcError as exc:
            return _err(exc)

    async def rollout(req: Request) -> Response:
        try:
            return JSONResponse(await backend.rollout(
                security.rollout_id(req.path_params["rollout_id"])))
        except security.BadInput as exc:
            return bad(exc)
        except grpc.aio.AioRpcError as exc:
            return _err(exc)

    async def control_rollout(req: Request) -> Response:
        if (refused := write_guard(req, "pause, resume or abort rollouts")) is not None:
            return refused
        try:
            body = await read_json(req)
            rid = security.rollout_id(body.get("rollout_id"))
            action = security.rollout_action(body.get("action"))
            reason = security.reason(body.get("reason"), f"{action} from the dashboard")
        except security.BadInput as exc:
            return bad(exc)
        try:
            v = await backend.control_rollout(rid, action, reason)
        except grpc.aio.AioRpcError as exc:
            log.info("dashboard.control_rollout_refused", rollout_id=rid, action=action,
                     code=exc.code().name, client=_client(req))
            return _err(exc)
        log.info("dashboard.control_rollout", rollout_id=rid, action=action, status=v["status"],
                 version=v["version"], client=_client(req))
        return JSONResponse(v)

    async def events(req: Request) -> Response:
        try:
            node = security.node(req.query_params.get("node"), required=False)
            rollout = req.query_params.get("rollout")
            rollout = security.rollout_id(rollout) if rollout else ""
        except security.BadInput as exc:
            return bad(exc)
        if backend.watch.full():
            return _json_error(503, "RESOURCE_EXHAUSTED", "too many event streams open on this "
                               "dashboard", {"retry-after": "10"})

        async def stream():
            # subscribed here, not before: a generator that never starts never unsubscribes
            queue = backend.watch.subscribe(node, rollout)
            if queue is None:
                return
            try:
                yield "retry: 2000\n\n"
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout=SSE_PING_S)
                    except asyncio.TimeoutError:
                        yield ": ping\n\n"
                        continue
                    if item is None:
                        return
                    if isinstance(item, str):
                        yield f"event: watch_gap\ndata: {json.dumps({'detail': item})}\n\n"
                        continue
                    if isinstance(item, grpc.aio.AioRpcError):
                        if item.code() != grpc.StatusCode.CANCELLED:
                            data = json.dumps({"error": item.details(), "code": item.code().name})
                            yield f"event: watch_error\ndata: {data}\n\n"
                        return
                    eid, data = item
                    yield f"id: {eid}\ndata: {data}\n\n"
            finally:
                backend.watch.unsubscribe(queue)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await backend.start()
        try:
            yield
        finally:
            await backend.close()

    app = _App(routes=[
        Route("/", index), Route("/healthz", healthz), Route("/api/config", config),
        Route("/api/nodes", nodes), Route("/api/switches", switches),
        Route("/api/policy", policy), Route("/api/saving", saving), Route("/api/events", events),
        Route("/api/switch", switch), Route("/api/rollouts", rollouts),
        Route("/api/rollouts/{rollout_id}", rollout),
        Route("/api/login", login, methods=["POST"]),
        Route("/api/logout", logout, methods=["POST"]),
        Route("/api/reconfigure", reconfigure, methods=["POST"]),
        Route("/api/control-rollout", control_rollout, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ], lifespan=lifespan)
    app.security = dict(allowlist=allow, on_refused=_Refusals())
    app.state.backend = backend
    app.state.sessions = sessions
    app.state.allowed_hosts = sorted(allow.allowed)
    app.state.writes_enabled = writes_enabled
    return app
