"""The dashboard's web app (Starlette): a static page plus a JSON API and a server-sent-event
stream, all read from the controller (and the policy) over gRPC.

    GET  /                      the page (dashboard/static: no CDN, works offline)
    GET  /api/config            what the page may do (read-only unless a token is configured)
    GET  /api/nodes             ListNodes
    GET  /api/switches?node=    ListSwitches (newest first)
    GET  /api/events?node=      Controller.Watch as server-sent events (live phases)
    GET  /api/policy?node=      the policy's forecast, past forecasts sampled here, decisions
    POST /api/reconfigure       {node, target, reason?, request_id?} → Reconfigure with the token
    GET  /healthz               200 when the controller answers

The POST needs the header ``X-Remp-Dashboard: 1`` and a JSON body: a cross-site form or script
cannot send either without a CORS preflight, which this app never grants.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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

from dashboard.config import DashboardSettings
from remp import logs, views
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2, controller_pb2_grpc
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
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
SSE_PING_S = 15.0
PAST_FORECASTS = 720  # per node


class Backend:
    """gRPC clients of the controller and the policy, and the sampled past forecasts."""

    def __init__(self, s: DashboardSettings):
        self.s = s
        self.ctl_ch = grpc.aio.insecure_channel(s.controller, options=channel_options())
        self.ctl = controller_pb2_grpc.ControllerStub(self.ctl_ch)
        self.pol_ch = (grpc.aio.insecure_channel(s.policy, options=channel_options())
                       if s.policy else None)
        self.pol = policy_pb2_grpc.PolicyStub(self.pol_ch) if self.pol_ch else None
        # node -> {window start: first forecast made for it} (what was predicted, kept to plot
        # against what arrived)
        self.past: dict[str, dict[float, float]] = {}
        self._order: dict[str, deque] = {}
        self._task: asyncio.Task | None = None

    @property
    def md(self):
        return (("authorization", f"Bearer {self.s.token}"),) if self.s.token else None

    async def start(self) -> None:
        if self.pol is not None:
            self._task = asyncio.create_task(self._sample_forecasts())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.ctl_ch.close()
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

    async def forecast(self, node: str) -> dict:
        fc = views.forecast_view(await self.pol.GetForecast(
            policy_pb2.GetForecastRequest(node=node), timeout=self.s.rpc_timeout_s))
        self.remember(node, fc)
        return fc

    async def policy(self, node: str) -> dict:
        fc = await self.forecast(node)
        dec = await self.pol.ListDecisions(policy_pb2.ListDecisionsRequest(node=node, page_size=50),
                                           timeout=self.s.rpc_timeout_s)
        fc["past"] = [{"t": t, "mean": m} for t, m in sorted(self.past.get(node, {}).items())]
        return {"forecast": fc, "decisions": [views.decision_view(d) for d in dec.decisions]}

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

    async def reconfigure(self, node: str, target: Topology, reason: str, request_id: str):
        return await self.ctl.Reconfigure(controller_pb2.ReconfigureRequest(
            node=node, target=types_pb2.Topology(tp=target.tp, pp=target.pp),
            request_id=request_id, reason=reason), metadata=self.md, timeout=self.s.rpc_timeout_s)


def _err(exc: grpc.aio.AioRpcError) -> JSONResponse:
    return JSONResponse({"error": exc.details() or exc.code().name, "code": exc.code().name},
                        status_code=HTTP_STATUS.get(exc.code(), 502))


def build_app(s: DashboardSettings) -> Starlette:
    backend = Backend(s)

    async def index(_: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-store"})

    async def config(_: Request) -> Response:
        return JSONResponse({"controller": s.controller, "policy": s.policy or "",
                             "can_write": bool(s.token)})

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
            return JSONResponse({"switches": await backend.switches(req.query_params.get("node", ""))})
        except grpc.aio.AioRpcError as exc:
            return _err(exc)

    async def policy(req: Request) -> Response:
        if backend.pol is None:
            return JSONResponse({"error": "no policy service configured (--policy)",
                                 "code": "NOT_CONFIGURED"}, status_code=404)
        node = req.query_params.get("node", "")
        if not node:
            return JSONResponse({"error": "node is required", "code": "INVALID_ARGUMENT"},
                                status_code=400)
        try:
            return JSONResponse(await backend.policy(node))
        except grpc.aio.AioRpcError as exc:
            return _err(exc)

    async def reconfigure(req: Request) -> Response:
        if not s.token:
            return JSONResponse({"error": "read-only dashboard: start it with --token to approve "
                                 "or start switches", "code": "READ_ONLY"}, status_code=403)
        if req.headers.get("x-remp-dashboard") != "1" or \
                not req.headers.get("content-type", "").startswith("application/json"):
            return JSONResponse({"error": "send JSON with the header X-Remp-Dashboard: 1",
                                 "code": "FORBIDDEN"}, status_code=403)
        try:
            body = await req.json()
            node, target = str(body["node"]), Topology.parse(str(body["target"]))
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": f"need {{node, target: 'TP1PP2'}}: {exc}",
                                 "code": "INVALID_ARGUMENT"}, status_code=400)
        reason = str(body.get("reason") or "started from the dashboard")[:500]
        request_id = str(body.get("request_id") or f"dash-{uuid.uuid4().hex[:12]}")[:200]
        try:
            r = await backend.reconfigure(node, target, reason, request_id)
        except grpc.aio.AioRpcError as exc:
            return _err(exc)
        log.info("dashboard.reconfigure", node=node, target=str(target), switch_id=r.switch_id,
                 request_id=request_id, noop=r.noop, duplicate=r.duplicate)
        return JSONResponse({"switch_id": r.switch_id, "noop": r.noop, "duplicate": r.duplicate,
                             "request_id": request_id})

    async def events(req: Request) -> Response:
        node = req.query_params.get("node", "")

        async def stream():
            yield "retry: 2000\n\n"
            call = backend.ctl.Watch(controller_pb2.WatchRequest(node=node))
            queue: asyncio.Queue = asyncio.Queue()

            async def pump():
                try:
                    async for ev in call:
                        await queue.put(ev)
                    await queue.put(None)
                except grpc.aio.AioRpcError as exc:
                    await queue.put(exc)

            task = asyncio.create_task(pump())
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout=SSE_PING_S)
                    except asyncio.TimeoutError:
                        yield ": ping\n\n"
                        continue
                    if item is None:
                        return
                    if isinstance(item, grpc.aio.AioRpcError):
                        if item.code() != grpc.StatusCode.CANCELLED:
                            data = json.dumps({"error": item.details(), "code": item.code().name})
                            yield f"event: watch_error\ndata: {data}\n\n"
                        return
                    v = views.event_view(item)
                    yield f"id: {v['id']}\ndata: {json.dumps(v)}\n\n"
            finally:
                call.cancel()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await task

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await backend.start()
        try:
            yield
        finally:
            await backend.close()

    app = Starlette(routes=[
        Route("/", index), Route("/healthz", healthz), Route("/api/config", config),
        Route("/api/nodes", nodes), Route("/api/switches", switches),
        Route("/api/policy", policy), Route("/api/events", events),
        Route("/api/reconfigure", reconfigure, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ], lifespan=lifespan)
    app.state.backend = backend
    return app
