"""``remp rollout``: fleet rollouts on a running controller (docs/rollout.md).

    remp rollout plan  TARGET (--nodes a,b | --label k=v ...) --floor F --profile NAME
    remp rollout start TARGET (--nodes a,b | --label k=v ...) --floor F --profile NAME [--wait]
    remp rollout get ID | list [--active] | pause ID | resume ID | abort ID

``plan`` is ``start --dry-run``: the waves, each with the set's capacity while it runs, and
nothing written. The capacity table comes from a policy profile (``--profile``: a built-in
name, a JSON file, or a profile shipped in policy/profiles/) or ``--capacity TP2PP1=9,...``.
Controller address, credentials, ``--json`` and exit codes as the other operator commands
(:mod:`ops.commands`); ``start --wait`` exits 1 unless the rollout ends DONE.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import grpc

from ops.commands import _fail, _one_line_config_errors, _rpc_fail, _stub, add_common
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.errors import InvalidArgument
from remp.topology import Topology
from remp.validate import labels as parse_labels

TERMINAL = {controller_pb2.ROLLOUT_STATUS_DONE, controller_pb2.ROLLOUT_STATUS_FAILED,
            controller_pb2.ROLLOUT_STATUS_ABORTED}
ACTIONS = {"pause": controller_pb2.ROLLOUT_ACTION_PAUSE,
           "resume": controller_pb2.ROLLOUT_ACTION_RESUME,
           "abort": controller_pb2.ROLLOUT_ACTION_ABORT}


def add_parser(sub) -> None:
    p = sub.add_parser("rollout", help="switch a set of nodes to one topology in waves, "
                       "keeping a capacity floor (plan | start | get | list | pause | resume "
                       "| abort)")
    rsub = p.add_subparsers(dest="rollout_cmd", required=True, parser_class=type(p))
    for name, text in (("plan", "the waves only (a dry run: nothing written or started)"),
                       ("start", "plan and start a rollout")):
        q = rsub.add_parser(name, help=text)
        add_common(q)
        q.add_argument("target", help="e.g. TP1PP2")
        q.add_argument("--nodes", default="", help="comma-separated node names")
        q.add_argument("--label", dest="labels", action="append", default=[],
                       metavar="KEY=VALUE", help="select the nodes with this label "
                       "(repeatable: all must match); instead of --nodes")
        q.add_argument("--floor", type=float, required=True,
                       help="fraction of the set's serving capacity that must stay up, 0-1")
        q.add_argument("--max-parallel", type=int, default=1,
                       help="most nodes switching at once (default 1)")
        q.add_argument("--profile", help="policy profile whose capacities fill the table "
                       "(built-in name, JSON file, or a name in policy/profiles/)")
        q.add_argument("--capacity", default="",
                       help="the table by hand: TP2PP1=9,TP1PP2=10 (overrides --profile's)")
        q.add_argument("--reason", default=f"remp rollout {name}")
        if name == "start":
            q.add_argument("--request-id", default=None,
                           help="idempotency key (default: a new one)")
            q.add_argument("--dry-run", action="store_true", help="as `remp rollout plan`")
            q.add_argument("--wait", action="store_true", help="follow it to its end")
            q.add_argument("--timeout", type=float, default=3600.0)
    q = rsub.add_parser("get", help="one rollout: status, waves, each node's switch")
    add_common(q)
    q.add_argument("rollout_id")
    q = rsub.add_parser("list", help="rollouts, newest first")
    add_common(q)
    q.add_argument("--active", action="store_true", help="only those not finished")
    q.add_argument("--limit", type=int, default=20)
    for name, text in (("pause", "no new wave starts (the running one finishes)"),
                       ("resume", "start the next wave"),
                       ("abort", "abort what can be, start nothing more")):
        q = rsub.add_parser(name, help=text)
        add_common(q)
        q.add_argument("rollout_id")
        q.add_argument("--reason", default=f"remp rollout {name}")


def capacity_table(profile: str | None, text: str) -> dict[str, float]:
    """"TPxPPy" → capacity: the profile's, then ``text`` (TP2PP1=9,...) on top."""
    table: dict[str, float] = {}
    if profile:
        from policy import profiles

        spec = profile
        shipped = Path(profiles.__file__).parent / "profiles" / f"{profile}.json"
        if profile not in profiles.BUILTIN_PROFILES and not Path(profile).is_file() \
                and shipped.is_file():
            spec = str(shipped)
        prof = profiles.load_profile(spec)
        table = {str(t): float(prof.capacity(t)) for t in prof.topologies}
    for item in filter(None, (x.strip() for x in text.split(","))):
        k, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"--capacity: {item!r} is not TOPOLOGY=NUMBER")
        table[str(Topology.parse(k))] = float(v)
    if not table:
        raise ValueError("give --profile NAME or --capacity TP2PP1=9,... (the SLO capacity of "
                         "each topology the rollout touches)")
    return table


def rollout_view(r: controller_pb2.RolloutState) -> dict:
    p = r.plan
    return {
        "rollout_id": r.rollout_id,
        "status": controller_pb2.RolloutStatus.Name(r.status).removeprefix(
            "ROLLOUT_STATUS_").lower(),
        "target": f"TP{p.target.tp}PP{p.target.pp}", "wave": r.wave, "version": r.version,
        "failed_node": r.failed_node, "reason": r.reason, "description": r.description,
        "pause_requested": r.pause_requested, "abort_requested": r.abort_requested,
        "floor": p.floor, "max_parallel": p.max_parallel, "base_capacity": p.base_capacity,
        "required_capacity": p.required_capacity,
        "waves": [{"index": w.index, "nodes": list(w.nodes),
                   "capacity_during": w.capacity_during, "capacity_after": w.capacity_after}
                  for w in p.waves],
        "skipped": list(p.skipped), "excluded": {e.node: e.why for e in p.excluded},
        "nodes": [{"node": n.node, "wave": n.wave,
                   "status": controller_pb2.RolloutNodeStatus.Name(n.status).removeprefix(
                       "ROLLOUT_NODE_STATUS_").lower(),
                   "switch_id": n.switch_id, "error": n.error} for n in r.nodes],
        "created_at": r.created_at.ToNanoseconds() / 1e9 if r.HasField("created_at") else None,
        "capacity_rps": dict(sorted(r.capacity_rps.items())),
    }


def rollout_text(v: dict) -> str:
    head = (f"rollout {v['rollout_id'] or '(dry run)'}: {v['status']} → {v['target']}, floor "
            f"{v['floor']:g} (required {v['required_capacity']:g} of {v['base_capacity']:g}), "
            f"max {v['max_parallel']} at once")
    lines = [head]
    if v["failed_node"]:
        lines.append(f"  failed on {v['failed_node']}")
    if v["reason"]:
        lines.append(f"  reason: {v['reason']}")
    status = {n["node"]: n for n in v["nodes"]}
    for w in v["waves"]:
        mark = ">" if w["index"] == v["wave"] and v["status"] == "running" else " "
        lines.append(f" {mark}wave {w['index']}: capacity {w['capacity_during']:g} while it "
                     f"runs, {w['capacity_after']:g} after")
        for n in w["nodes"]:
            s = status.get(n, {})
            lines.append(f"     {n:<20} {s.get('status', ''):<12} {s.get('switch_id', '')}"
                         + (f"  {s['error']}" if s.get("error") else ""))
    if v["skipped"]:
        lines.append(f"  already on the target: {', '.join(v['skipped'])}")
    for n, why in v["excluded"].items():
        lines.append(f"  excluded {n}: {why}")
    return "\n".join(lines)


def _show(a, r: controller_pb2.RolloutState, note: str = "") -> None:
    v = rollout_view(r)
    print(json.dumps(v) if a.json else rollout_text(v) + note, flush=True)


@_one_line_config_errors
def cmd_rollout(a) -> int:
    try:
        return {"plan": _start, "start": _start, "get": _get, "list": _list,
                "pause": _control, "resume": _control, "abort": _control}[a.rollout_cmd](a)
    except grpc.RpcError as exc:
        return _rpc_fail(a, exc)


def _start(a) -> int:
    try:
        target = Topology.parse(a.target)
        table = capacity_table(a.profile, a.capacity)
        labels = parse_labels("--label", a.labels)
    except (ValueError, InvalidArgument) as exc:
        return _fail(str(exc), 2)
    nodes = [n.strip() for n in a.nodes.split(",") if n.strip()]
    if bool(nodes) == bool(labels):
        return _fail("give the nodes (--nodes a,b) or a label selector (--label k=v), one of "
                     "them", 2)
    dry = a.rollout_cmd == "plan" or getattr(a, "dry_run", False)
    req = controller_pb2.RolloutRequest(
        nodes=nodes, labels=labels, target=types_pb2.Topology(tp=target.tp, pp=target.pp),
        capacity_floor=a.floor, max_parallel=a.max_parallel, capacity_rps=table,
        request_id="" if dry else (getattr(a, "request_id", None)
                                   or f"cli-{uuid.uuid4().hex[:12]}"),
        reason=a.reason, dry_run=dry)
    ch, stub = _stub(a)
    with ch:
        r = stub.Rollout(req, timeout=30)
    note = " (duplicate request id: the earlier rollout)" if r.duplicate else ""
    _show(a, r.rollout, note)
    if dry or not getattr(a, "wait", False):
        return 0
    return _wait(a, r.rollout.rollout_id)


def _wait(a, rid: str) -> int:
    deadline, last = time.monotonic() + a.timeout, None
    while time.monotonic() < deadline:
        ch, stub = _stub(a)
        with ch:
            r = stub.GetRollout(controller_pb2.GetRolloutRequest(rollout_id=rid), timeout=10)
        if r.version != last and not a.json:
            last = r.version
            v = rollout_view(r)
            done = sum(n["status"] == "succeeded" for n in v["nodes"])
            print(f"  {v['status']}: wave {v['wave']}, {done}/{len(v['nodes'])} switched",
                  flush=True)
        if r.status in TERMINAL or r.status == controller_pb2.ROLLOUT_STATUS_PAUSED:
            _show(a, r)
            return 0 if r.status == controller_pb2.ROLLOUT_STATUS_DONE else 1
        time.sleep(0.5)
    return _fail(f"rollout {rid} did not finish in {a.timeout:g} s (`remp rollout get {rid}`)")


def _get(a) -> int:
    ch, stub = _stub(a)
    with ch:
        r = stub.GetRollout(controller_pb2.GetRolloutRequest(rollout_id=a.rollout_id),
                            timeout=10)
    _show(a, r)
    return 0


def _list(a) -> int:
    ch, stub = _stub(a)
    with ch:
        rs = stub.ListRollouts(controller_pb2.ListRolloutsRequest(
            active_only=a.active, limit=max(1, min(a.limit, 1000))), timeout=10).rollouts
    if a.json:
        print(json.dumps({"rollouts": [rollout_view(r) for r in rs]}))
        return 0
    if not rs:
        print("no rollout" + (" active" if a.active else " yet"))
    for r in rs:
        v = rollout_view(r)
        done = sum(n["status"] == "succeeded" for n in v["nodes"])
        print(f"{v['rollout_id']}  {v['status']:<8} → {v['target']}  wave {v['wave']}/"
              f"{len(v['waves'])}  {done}/{len(v['nodes'])} switched"
              + (f"  failed on {v['failed_node']}" if v["failed_node"] else ""))
    return 0


def _control(a) -> int:
    ch, stub = _stub(a)
    with ch:
        r = stub.ControlRollout(controller_pb2.ControlRolloutRequest(
            rollout_id=a.rollout_id, action=ACTIONS[a.rollout_cmd], reason=a.reason),
            timeout=30)
    _show(a, r)
    return 0

