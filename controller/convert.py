"""The controller's one proto <-> dataclass mapping (:mod:`controller.model` both ways), and the
protobuf JSON the store writes. Used by the servicer, the agent clients and the store; the core
never sees a protobuf object.

The mapping is read off the message descriptors: a dataclass mirrors its message under the same
field names (``PAIRS``; ``tests/unit/test_controller_core.py`` checks that every mirrored field
exists and that a fully populated message survives the round trip byte for byte), so the JSON
in Redis stays what earlier controllers wrote and read.
"""

from __future__ import annotations

import dataclasses
from functools import cache

from google.protobuf import json_format
from google.protobuf.message import Message

from controller import model as m
from controller.planner import Plan
from controller.rollout import (NodeProgress, NodeStatus, RolloutPlan, RolloutState,
                                RolloutStatus, Wave)
from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.convert import OUTCOME_FROM_PROTO, OUTCOME_TO_PROTO
from remp.node_agent.v1 import node_agent_pb2

# dataclass ↔ message; the first pair listed for a message is the one its nested fields decode to
PAIRS: tuple[tuple[type, type[Message]], ...] = (
    (m.Error, types_pb2.Error),
    (m.PhaseTiming, types_pb2.PhaseTiming),
    (m.SwitchRecord, types_pb2.SwitchRecord),
    (m.HostFacts, types_pb2.HostFacts),
    (m.WorkerInfo, types_pb2.WorkerInfo),
    (m.ModelFacts, types_pb2.ModelFacts),
    (m.TrafficSample, types_pb2.TrafficSample),
    (m.RecoveryDecision, types_pb2.RecoveryDecision),
    (m.Registration, controller_pb2.RegisterNodeRequest),
    (m.InflightRequest, controller_pb2.InflightRequest),
    (m.Heartbeat, controller_pb2.HeartbeatRequest),
    (m.Recovery, controller_pb2.Recovery),
    (m.NodeState, controller_pb2.NodeState),
    (m.Event, controller_pb2.Event),
    (m.ReconfigureResult, controller_pb2.ReconfigureResponse),
    (m.AbortResult, controller_pb2.AbortResponse),
    (m.EngineInfo, node_agent_pb2.EngineInfo),
    (m.AgentDescription, node_agent_pb2.DescribeResponse),
    (m.SwitchOrder, node_agent_pb2.ExecuteSwitchRequest),
    (m.SwitchProgress, node_agent_pb2.SwitchEvent),
    (m.RequestInfo, node_agent_pb2.RequestInfo),
    (m.MigrateOrder, node_agent_pb2.MigrateRequestRequest),
    (m.ImportOrder, node_agent_pb2.ImportHeader),
    (m.Continuation, node_agent_pb2.MigrateRequestEvent),
)
# mirrors that read only part of their message (agent answers; never converted back)
PARTIAL: frozenset[type] = frozenset({m.AgentDescription, m.Continuation})

PROTO_OF: dict[type, type[Message]] = dict(PAIRS)
_DC_OF: dict[str, type] = {}
for _dc, _pb in PAIRS:
    _DC_OF.setdefault(_pb.DESCRIPTOR.full_name, _dc)

_TIMESTAMP = "google.protobuf.Timestamp"
_TOPOLOGY = "remp.common.v1.Topology"
_OUTCOME = "remp.common.v1.SwitchOutcome"
_ENUMS: dict[str, type] = {
    "remp.common.v1.Phase": m.Phase,
    "remp.controller.v1.NodeHealth": m.NodeHealth,
    "remp.controller.v1.EventType": m.EventType,
    "remp.common.v1.RecoveryAction": m.RecoveryAction,
}


def _enum_in(enum: str, v: int):
    if enum == _OUTCOME:
        return OUTCOME_FROM_PROTO.get(v) if v else None
    cls = _ENUMS.get(enum)
    if cls is None:
        return v
    try:
        return cls(v)
    except ValueError:  # a value this build does not know: kept as the number
        return v


def _enum_out(enum: str, v) -> int:
    if enum == _OUTCOME:
        return OUTCOME_TO_PROTO[m.Outcome(v)] if v is not None else 0
    return int(v)


# a field's kind in a plan
_SCALAR, _ENUM, _TS, _TOPO, _MSG, _MAP = range(6)


@cache
def _plan(desc, dc: type) -> tuple[tuple[str, int, bool, str], ...]:
    """(name, kind, repeated, message or enum name) of each field of ``desc`` that ``dc`` has,
    read off the descriptor once (descriptor attributes are slow to read per message)."""
    names = {f.name for f in dataclasses.fields(dc)}
    out = []
    for f in desc.fields:
        if f.name not in names:
            continue
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            # scalar-valued maps only (labels, capacities): (key, value) pairs sorted by key
            kind, sub = _MAP, ""
        elif f.message_type is not None:
            sub = f.message_type.full_name
            kind = {_TIMESTAMP: _TS, _TOPOLOGY: _TOPO}.get(sub, _MSG)
        elif f.enum_type is not None:
            kind, sub = _ENUM, f.enum_type.full_name
        else:
            kind, sub = _SCALAR, ""
        out.append((f.name, kind, f.is_repeated, sub))
    return tuple(out)


def _put(sub: Message, kind: int, name: str, v) -> None:
    if kind == _TS:
        sub.FromNanoseconds(v)
    elif kind == _TOPO:
        sub.tp, sub.pp = v.tp, v.pp
    else:
        _fill(sub, v)


def _get(sub: Message, kind: int, name: str):
    if kind == _TS:
        return sub.ToNanoseconds()
    if kind == _TOPO:
        return m.Topology(sub.tp, sub.pp)
    return from_proto(sub, _DC_OF[name])


def _fill(msg: Message, obj) -> None:
    for fname, kind, repeated, sub in _plan(msg.DESCRIPTOR, type(obj)):
        v = getattr(obj, fname)
        if kind == _MAP:
            getattr(msg, fname).update(dict(v))
        elif kind == _SCALAR:
            if repeated:
                getattr(msg, fname).extend(v)
            else:
                setattr(msg, fname, v)
        elif kind == _ENUM:
            if repeated:
                getattr(msg, fname).extend(_enum_out(sub, x) for x in v)
            else:
                setattr(msg, fname, _enum_out(sub, v))
        elif repeated:
            box = getattr(msg, fname)
            for x in v:
                _put(box.add(), kind, sub, x)
        elif v is not None:
            child = getattr(msg, fname)
            child.SetInParent()
            _put(child, kind, sub, v)


def to_proto(obj, cls: type[Message] | None = None) -> Message:
    """The message a :mod:`controller.model` dataclass mirrors (``cls``: another message with
    the same fields)."""
    msg = (cls or PROTO_OF[type(obj)])()
    _fill(msg, obj)
    return msg


def from_proto(msg: Message, dc: type):
    """The dataclass ``dc`` (a :mod:`controller.model` type) of ``msg``: every field of ``dc``
    that ``msg`` has (the others keep their defaults)."""
    kw = {}
    for fname, kind, repeated, sub in _plan(msg.DESCRIPTOR, dc):
        v = getattr(msg, fname)
        if kind == _MAP:
            kw[fname] = tuple(sorted(v.items()))
        elif kind == _SCALAR:
            kw[fname] = tuple(v) if repeated else v
        elif kind == _ENUM:
            kw[fname] = tuple(_enum_in(sub, x) for x in v) if repeated else _enum_in(sub, v)
        elif repeated:
            kw[fname] = tuple(_get(x, kind, sub) for x in v)
        else:
            kw[fname] = _get(v, kind, sub) if msg.HasField(fname) else None
    return dc(**kw)


# ---------------------------------------------------------------------- protobuf JSON (Redis)
def to_json(obj) -> str:
    """Protobuf JSON of a message or of a :mod:`controller.model` dataclass (as its message)."""
    msg = obj if isinstance(obj, Message) else to_proto(obj)
    return json_format.MessageToJson(msg, indent=None, preserving_proto_field_name=True)


def proto_from_json(text: str, cls: type[Message]) -> Message:
    return json_format.Parse(text, cls(), ignore_unknown_fields=True)


def from_json(text: str, dc: type):
    """The dataclass ``dc`` from the protobuf JSON of its message (unknown fields ignored)."""
    return from_proto(proto_from_json(text, PROTO_OF[dc]), dc)


# ---------------------------------------------------------------------- servicer helpers
def topology(t: types_pb2.Topology) -> m.Topology:
    """A request's topology field (unset reads as 0 x 0, which the core refuses)."""
    return m.Topology(t.tp, t.pp)


def topology_to_proto(t: m.Topology) -> types_pb2.Topology:
    return types_pb2.Topology(tp=t.tp, pp=t.pp)


def plan_to_proto(node: str, p: Plan) -> controller_pb2.PlanResponse:
    return controller_pb2.PlanResponse(
        node=node,
        from_topology=topology_to_proto(p.source),
        to_topology=topology_to_proto(p.target),
        transfers=[controller_pb2.Transfer(src_rank=t.src_rank, dst_rank=t.dst_rank,
                                           layers=t.layers, kv_head_start=t.kv_head_start,
                                           kv_head_end=t.kv_head_end, kv_bytes=t.kv_bytes)
                   for t in p.transfers],
        shard_loads=[controller_pb2.ShardLoad(rank=s.rank, layers=s.layers, tp_rank=s.tp_rank,
                                              tp_size=s.tp_size, weight_bytes=s.weight_bytes)
                     for s in p.shard_loads],
        kv_bytes_total=p.kv_bytes_total, weight_bytes_total=p.weight_bytes_total,
        predicted=[types_pb2.PhaseTiming(phase=int(ph), seconds=s) for ph, s in
                   sorted(p.predicted.items())],
        predicted_total_seconds=p.predicted_total_s,
        requests_to_preempt=p.requests_to_preempt, noop=p.noop)


# ---------------------------------------------------------------------- rollouts
# controller/rollout.py's frozen dataclasses use StrEnums and (node, why) pairs: mapped here by
# hand, field for field (tests/unit/test_rollout_store.py round-trips a fully set message).
def _status_to_proto(st: RolloutStatus) -> int:
    return controller_pb2.RolloutStatus.Value("ROLLOUT_STATUS_" + st.name)


def _node_status_to_proto(st: NodeStatus) -> int:
    return controller_pb2.RolloutNodeStatus.Value("ROLLOUT_NODE_STATUS_" + st.name)


def rollout_to_proto(s: RolloutState, meta: m.RolloutMeta | None = None
                     ) -> controller_pb2.RolloutState:
    p = s.plan
    msg = controller_pb2.RolloutState(
        rollout_id=s.rollout_id, status=_status_to_proto(s.status), wave=s.wave,
        failed_node=s.failed_node, pause_requested=s.pause_requested,
        abort_requested=s.abort_requested, reason=s.reason, version=s.version,
        plan=controller_pb2.RolloutPlan(
            target=topology_to_proto(p.target), floor=p.floor, max_parallel=p.max_parallel,
            base_capacity=p.base_capacity, required_capacity=p.required_capacity,
            waves=[controller_pb2.RolloutWave(index=w.index, nodes=w.nodes,
                                              capacity_during=w.capacity_during,
                                              capacity_after=w.capacity_after)
                   for w in p.waves],
            skipped=p.skipped,
            excluded=[controller_pb2.RolloutExcluded(node=n, why=why) for n, why in p.excluded]),
        nodes=[controller_pb2.RolloutNodeProgress(
            node=n.node, wave=n.wave, status=_node_status_to_proto(n.status),
            switch_id=n.switch_id, error=n.error,
            outcome=OUTCOME_TO_PROTO[n.outcome] if n.outcome is not None else 0)
            for n in s.nodes])
    if meta is not None:
        msg.request_id, msg.description = meta.request_id, meta.description
        if meta.created_at is not None:
            msg.created_at.FromNanoseconds(meta.created_at)
        msg.capacity_rps.update(dict(meta.capacity_rps))
    return msg


def rollout_from_proto(msg: controller_pb2.RolloutState
                       ) -> tuple[RolloutState, m.RolloutMeta]:
    p = msg.plan
    plan = RolloutPlan(
        target=topology(p.target), floor=p.floor, max_parallel=p.max_parallel,
        base_capacity=p.base_capacity, required_capacity=p.required_capacity,
        waves=tuple(Wave(w.index, tuple(w.nodes), w.capacity_during, w.capacity_after)
                    for w in p.waves),
        skipped=tuple(p.skipped), excluded=tuple((e.node, e.why) for e in p.excluded))
    status_name = controller_pb2.RolloutStatus.Name(msg.status).removeprefix("ROLLOUT_STATUS_")
    state = RolloutState(
        rollout_id=msg.rollout_id, plan=plan,
        status=RolloutStatus[status_name] if msg.status else RolloutStatus.PLANNED,
        wave=msg.wave, failed_node=msg.failed_node, pause_requested=msg.pause_requested,
        abort_requested=msg.abort_requested, reason=msg.reason, version=msg.version,
        nodes=tuple(NodeProgress(
            node=n.node, wave=n.wave,
            status=NodeStatus[controller_pb2.RolloutNodeStatus.Name(n.status).removeprefix(
                "ROLLOUT_NODE_STATUS_")] if n.status else NodeStatus.PENDING,
            switch_id=n.switch_id, error=n.error,
            outcome=OUTCOME_FROM_PROTO.get(n.outcome) if n.outcome else None)
            for n in msg.nodes))
    meta = m.RolloutMeta(
        request_id=msg.request_id, description=msg.description,
        created_at=msg.created_at.ToNanoseconds() if msg.HasField("created_at") else None,
        capacity_rps=tuple(sorted(msg.capacity_rps.items())))
    return state, meta


def rollout_to_json(s: RolloutState, meta: m.RolloutMeta | None = None) -> str:
    return to_json(rollout_to_proto(s, meta))


def rollout_from_json(text: str) -> tuple[RolloutState, m.RolloutMeta]:
    return rollout_from_proto(proto_from_json(text, controller_pb2.RolloutState))
