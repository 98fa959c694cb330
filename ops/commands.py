"""Operator commands of the ``remp`` CLI that talk to a running controller:
``status``, ``nodes``, ``plan``, ``reconfigure`` (phases live, from Watch), ``watch``, ``history``.

The controller is ``--controller`` or ``$REMP_CONTROLLER_ADDRESS`` (default 127.0.0.1:50051), or
several comma-separated (controller HA: a write a follower refuses goes to the leader it names,
an unreachable controller to the next; ``watch`` resumes on another controller after the last
event it printed, :mod:`remp.controllers`); the
operator credential comes from ``--credentials-file``, ``$REMP_CREDENTIALS_FILE``,
``$REMP_TOKEN_OPERATOR`` or, when none is set, ``.remp/up/credentials.json`` (what ``remp up``
writes) — never from argv. ``--json`` prints JSON (one object, or one per
line for streams). Exit codes: 0 ok, 1 the controller said no / is unreachable / the switch did
not succeed, 2 bad arguments.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import sys
import threading
import time
import uuid

import grpc

from dashboard import views
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.auth import Credentials, Role, sync_channel
from remp.cliargs import add_credentials_arg, cli_credentials
from remp.controllers import LEADER_RETRY_S, AioControllers, SyncControllers, addresses
from remp.errors import ConfigError
from remp.topology import Topology

DEFAULT_CONTROLLER = "127.0.0.1:50051"
FINISHED = {controller_pb2.EVENT_TYPE_SWITCH_DONE, controller_pb2.EVENT_TYPE_SWITCH_FAILED,
            controller_pb2.EVENT_TYPE_SWITCH_ROLLED_BACK, controller_pb2.EVENT_TYPE_SWITCH_ABORTED}


def add_common(p) -> None:
    p.add_argument("--controller", default=None,
                   help="controller host:port, or several comma-separated (controller HA: "
                   f"writes reach the leader; default $REMP_CONTROLLER_ADDRESS or "
                   f"{DEFAULT_CONTROLLER})")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_credentials_arg(p)


def add_parsers(sub) -> None:
    p = sub.add_parser("status", help="controller health, nodes, switch in flight, last switches")
    add_common(p)
    p = sub.add_parser("nodes", help="list the registered nodes")
    add_common(p)
    p = sub.add_parser("plan", help="dry run of a switch: transfers, bytes, predicted time")
    add_common(p)
    p.add_argument("node")
    p.add_argument("target", help="e.g. TP1PP2")
    p = sub.add_parser("reconfigure", help="switch a node's topology in place; shows its phases live")
    add_common(p)
    p.add_argument("node")
    p.add_argument("target", help="e.g. TP1PP2")
    p.add_argument("--reason", default="remp reconfigure")
    p.add_argument("--request-id", default=None, help="idempotency key (default: a new one)")
    p.add_argument("--no-wait", action="store_true", help="return once accepted")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the end")
    p = sub.add_parser("watch", help="follow the controller's events (Ctrl-C stops)")
    add_common(p)
    p.add_argument("--node", default="")
    p.add_argument("--switch", default="", help="one switch id")
    p.add_argument("--history", action="store_true", help="replay retained events first")
    p.add_argument("--after", default="", metavar="EVENT_ID",
                   help="resume after this event id (the id --json prints)")
    p = sub.add_parser("health", help="grpc.health.v1 check of any remp service (exit 0 when "
                       "SERVING; container health checks)")
    p.add_argument("address", help="host:port")
    p.add_argument("--service", default="", help="readiness of this service (default: liveness)")
    p.add_argument("--timeout", type=float, default=3.0)
    p = sub.add_parser("history", help="finished and running switches, newest first")
    add_common(p)
    p.add_argument("--node", default="")
    p.add_argument("--limit", type=int, default=20)


def _addr(a) -> str:
    return a.controller or os.environ.get("REMP_CONTROLLER_ADDRESS", DEFAULT_CONTROLLER)


def _addrs(a) -> list[str]:
    try:
        return addresses(_addr(a))
    except ValueError as exc:
        raise ConfigError(f"--controller: {exc}") from None


def _creds(a) -> Credentials:
    """The operator's credentials, loaded once per command."""
    creds = getattr(a, "_operator_creds", None)
    if creds is None:
        creds = cli_credentials(getattr(a, "credentials_file", None)).only(Role.OPERATOR)
        a._operator_creds = creds
    return creds


def _stub(a):
    """(the controllers, a stub-like object whose calls follow the leader); the first is a
    context manager that closes the channels."""
    c = SyncControllers(_addrs(a), _creds(a), retry_s=LEADER_RETRY_S)
    return c, c.stub


def _fail(msg: str, code: int = 1) -> int:
    print(f"remp: error: {msg}", file=sys.stderr)
    return code


def _rpc_fail(a, exc: grpc.RpcError) -> int:
    return _fail(f"controller {_addr(a)}: {exc.code().name}: {exc.details()}")


def _print(a, obj, text: str) -> None:
    print(json.dumps(obj) if a.json else text, flush=True)


def node_line(n: dict) -> str:
    cur = n["current_switch"]
    s = (f"{n['node']:<16} {n['health']:<10} observed {n['observed'] or '?':<8} desired "
         f"{n['desired'] or '?':<8} lease {n['lease_age_s']:5.1f} s  epoch {n['epoch']:<4} "
         f"agent {n['agent_address']}")
    if cur:
        s += f"\n{'':16} switching {cur['switch_id']} {cur['from']}→{cur['to']} at {cur['phase']}"
    if n["recommendation"]:
        s += f"\n{'':16} policy recommends {n['recommendation']}"
    if n.get("labels"):
        s += f"\n{'':16} labels " + ",".join(f"{k}={v}" for k, v in n["labels"].items())
    if n.get("rollout_id"):
        s += f"\n{'':16} held by rollout {n['rollout_id']}"
    released = [w["rank"] for w in n.get("workers", []) if w["released"]]
    if released:
        s += f"\n{'':16} released (measured): rank{'s' if len(released) > 1 else ''} " + \
            ", ".join(map(str, released))
    return s


def cmd_nodes(a) -> int:
    ch, stub = _stub(a)
    with ch:
        try:
            nodes = [dict(views.node_view(n), labels=dict(sorted(n.labels.items())),
                          rollout_id=n.rollout_id) for n in
                     stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10).nodes]
        except grpc.RpcError as exc:
            return _rpc_fail(a, exc)
    if a.json:
        print(json.dumps({"nodes": nodes}))
    else:
        print("\n".join(node_line(n) for n in nodes) or "no node registered")
    return 0


def cmd_status(a) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ch, stub = _stub(a)
    with ch:
        try:
            nodes = [views.node_view(n) for n in
                     stub.ListNodes(controller_pb2.ListNodesRequest(), timeout=10).nodes]
            hist = [views.switch_view(s) for s in stub.ListSwitches(
                controller_pb2.ListSwitchesRequest(page_size=5), timeout=10).switches]
            h = health_pb2_grpc.HealthStub(ch.channel()).Check(  # the one that answered
                health_pb2.HealthCheckRequest(service="remp.controller.v1.Controller"), timeout=5)
        except grpc.RpcError as exc:
            return _rpc_fail(a, exc)
    health = health_pb2.HealthCheckResponse.ServingStatus.Name(h.status)
    if a.json:
        print(json.dumps({"controller": ch.address, "health": health, "nodes": nodes,
                          "recent_switches": hist}))
        return 0
    print(f"controller {ch.address}: {health}")
    print(f"nodes ({len(nodes)}):")
    for n in nodes:
        print("  " + node_line(n).replace("\n", "\n  "))
    print("recent switches:" if hist else "recent switches: none")
    for s in hist:
        print("  " + views.switch_line(s))
    return 0


def cmd_plan(a) -> int:
    try:
        t = Topology.parse(a.target)
    except ValueError as exc:
        return _fail(str(exc), 2)
    ch, stub = _stub(a)
    with ch:
        try:
            p = views.plan_view(stub.Plan(controller_pb2.PlanRequest(
                node=a.node, target=types_pb2.Topology(tp=t.tp, pp=t.pp)), timeout=30))
        except grpc.RpcError as exc:
            return _rpc_fail(a, exc)
    if a.json:
        print(json.dumps(p))
        return 0
    if p["noop"]:
        print(f"{a.node}: already {p['to']} (nothing to do)")
        return 0
    print(f"{a.node}: {p['from']} → {p['to']}: KV {views.human_bytes(p['kv_bytes_total'])} in "
          f"{len(p['transfers'])} transfers, weights {views.human_bytes(p['weight_bytes_total'])} "
          f"in {len(p['shard_loads'])} shard loads; predicted {views.ms(p['predicted_total_s'])}"
          f", requests to preempt {p['requests_to_preempt']}")
    print("predicted: " + " · ".join(f"{k} {views.ms(v)}" for k, v in p["predicted"].items()))
    for t_ in p["transfers"]:
        print(f"  rank {t_['src_rank']} → {t_['dst_rank']}: layers {t_['layers']} kv heads "
              f"{t_['kv_heads'][0]}..{t_['kv_heads'][1] - 1} ({views.human_bytes(t_['kv_bytes'])})")
    return 0


class _Watcher:
    """Controller.Watch in a thread (its own event loop: :meth:`AioControllers.watch`, which
    resumes on another controller after the last event when its stream breaks); events go to
    a queue (so the main thread can time out), with the stream's end (None), its error
    (grpc.RpcError) and notices about resumes and gaps (str) among them."""

    def __init__(self, a, node: str = "", switch: str = "", history: bool = False,
                 after: str = ""):
        self.q: queue.Queue = queue.Queue()
        self.req = controller_pb2.WatchRequest(node=node, switch_id=switch,
                                               include_history=history, after_id=after)
        self.ctl = AioControllers(_addrs(a), _creds(a))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._closed = threading.Event()
        self.t = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)
        self.t.start()

    async def _run(self) -> None:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        try:
            if self._closed.is_set():
                return
            async for ev in self.ctl.watch(
                    self.req, on_gap=lambda after, why: self.q.put(
                        f"events after {after} are no longer retained: some were missed; "
                        f"replaying every retained event ({why})"),
                    on_resume=lambda addr, after: self.q.put(
                        f"stream resumed at {addr} after event {after or '(none yet)'}")):
                self.q.put(ev)
            self.q.put(None)
        except grpc.RpcError as exc:
            self.q.put(exc)
        except asyncio.CancelledError:
            pass
        finally:
            await self.ctl.close()

    def close(self) -> None:
        self._closed.set()
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop has finished already
                pass
        self.t.join(5)


def event_text(e: dict) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(e["at"] or time.time()))
    what = e["type"].replace("_", " ")
    s = f"{at} {e['node']:<14} {what:<18} {e['switch_id'] or ''} {e['phase']} {e['detail']}"
    return s.rstrip()


def cmd_watch(a) -> int:
    w = _Watcher(a, a.node, a.switch, a.history, a.after)
    try:
        while True:
            item = w.q.get()
            if item is None:
                return 0
            if isinstance(item, str):
                print(f"remp: {item}", file=sys.stderr, flush=True)
                continue
            if isinstance(item, grpc.RpcError):
                if item.code() == grpc.StatusCode.CANCELLED:
                    return 0
                return _rpc_fail(a, item)
            e = views.event_view(item)
            _print(a, e, event_text(e))
    except KeyboardInterrupt:
        return 0
    finally:
        w.close()


def cmd_history(a) -> int:
    ch, stub = _stub(a)
    with ch:
        try:
            recs = [views.switch_view(s) for s in stub.ListSwitches(controller_pb2.ListSwitchesRequest(
                node=a.node, page_size=max(1, min(a.limit, 1000))), timeout=10).switches]
        except grpc.RpcError as exc:
            return _rpc_fail(a, exc)
    if a.json:
        print(json.dumps({"switches": recs}))
        return 0
    if not recs:
        print("no switch yet")
    for s in recs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["started_at"] or 0))
        print(f"{started}  {views.switch_line(s)}")
        if s["phases"]:
            print(f"{'':21}{views.phases_text(s)}")
    return 0


def cmd_reconfigure(a) -> int:
    try:
        t = Topology.parse(a.target)
    except ValueError as exc:
        return _fail(str(exc), 2)
    w = None if a.no_wait else _Watcher(a, a.node)  # subscribe first: no phase is missed
    try:
        ch, stub = _stub(a)
        with ch:
            try:
                r = stub.Reconfigure(controller_pb2.ReconfigureRequest(
                    node=a.node, target=types_pb2.Topology(tp=t.tp, pp=t.pp),
                    request_id=a.request_id or f"cli-{uuid.uuid4().hex[:12]}", reason=a.reason),
                    timeout=30)
            except grpc.RpcError as exc:
                return _rpc_fail(a, exc)
        if not a.json:
            note = " (noop: already there)" if r.noop else \
                " (duplicate request id: the earlier switch)" if r.duplicate else ""
            print(f"switch {r.switch_id}: {a.node} → {t}{note}", flush=True)
        if r.noop or a.no_wait:
            if a.json:
                print(json.dumps({"switch_id": r.switch_id, "noop": r.noop,
                                  "duplicate": r.duplicate}))
            return 0
        return _follow(a, w, r.switch_id)
    finally:
        if w is not None:
            w.close()


def _follow(a, w: _Watcher, sid: str) -> int:
    deadline = time.monotonic() + a.timeout
    t0 = None
    while time.monotonic() < deadline:
        try:
            item = w.q.get(timeout=1.0)
        except queue.Empty:
            rec = _get_switch(a, sid)  # finished before we subscribed, or events were trimmed
            if rec is not None and rec["outcome"] != "running":
                return _done(a, rec)
            continue
        if isinstance(item, str):  # a resume or gap notice: GetSwitch covers a gap
            continue
        if item is None or isinstance(item, grpc.RpcError):
            rec = _get_switch(a, sid)
            if rec is not None and rec["outcome"] != "running":
                return _done(a, rec)
            return _fail(f"lost the event stream of {sid}: {item}")
        if item.switch_id != sid:
            continue
        e = views.event_view(item)
        t0 = t0 if t0 is not None else e["at"]
        if a.json:
            print(json.dumps(e), flush=True)
        elif item.type == controller_pb2.EVENT_TYPE_SWITCH_PHASE:
            label = "ACCEPTED" if e["phase"] == "SERVING_OLD" else e["phase"]
            print(f"  +{(e['at'] - t0) * 1e3:7.0f} ms  {label:<18} {e['detail']}", flush=True)
        if item.type in FINISHED:
            rec = e["record"] or _get_switch(a, sid)
            return _done(a, rec)
    return _fail(f"switch {sid} did not finish in {a.timeout:g} s (still running; "
                 f"`remp watch --switch {sid}`)")


def _get_switch(a, sid: str) -> dict | None:
    ch, stub = _stub(a)
    with ch:
        try:
            return views.switch_view(stub.GetSwitch(controller_pb2.GetSwitchRequest(switch_id=sid),
                                                    timeout=10))
        except grpc.RpcError:
            return None


def _done(a, rec: dict) -> int:
    if a.json:
        print(json.dumps({"record": rec}))
    else:
        print(views.switch_line(rec))
        if rec["phases"]:
            print("  " + views.phases_text(rec))
    return 0 if rec["outcome"] in ("succeeded", "noop") else 1


def cmd_health(a) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with sync_channel(a.address, None) as ch:  # TLS when $REMP_TLS_CA is set
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout)
        except grpc.RpcError as exc:
            return _fail(f"{a.address}: {exc.code().name}: {exc.details()}")
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    print(name)
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1


def _one_line_config_errors(cmd):
    """A bad credentials file (say, readable by others) is one line and exit 2, never a
    traceback."""
    def run(a) -> int:
        try:
            return cmd(a)
        except ConfigError as exc:
            return _fail(str(exc), 2)
    return run


COMMANDS = {name: _one_line_config_errors(cmd) for name, cmd in {
    "health": cmd_health, "status": cmd_status, "nodes": cmd_nodes, "plan": cmd_plan,
    "reconfigure": cmd_reconfigure, "watch": cmd_watch, "history": cmd_history}.items()}
