"""Plain-JSON views of the controller's and the policy's messages, shared by the ``remp`` CLI and
the dashboard (pure: protos in, dicts and strings out)."""

from __future__ import annotations

import math
import re
import time
from datetime import datetime, timezone

from remp.common.v1 import types_pb2
from remp.controller.v1 import controller_pb2
from remp.policy.v1 import policy_pb2

# The phases of a switch as an operator follows them (remp/transaction.py's forward path).
FORWARD_PHASES = ("QUIESCING", "PREPARING_WORKERS", "MPU_APPLIED", "MIGRATE_KV", "RELOAD_SHARDS",
                  "REBINDING", "SERVING_NEW")
_REC_TARGET = re.compile(r"^\s*(TP\d+PP\d+)\b")


def _enum(enum, value: int, prefix: str) -> str:
    try:
        return enum.Name(value).removeprefix(prefix)
    except ValueError:
        return str(value)


def phase_name(p: int) -> str:
    return _enum(types_pb2.Phase, p, "PHASE_")


def outcome_name(o: int) -> str:
    return _enum(types_pb2.SwitchOutcome, o, "SWITCH_OUTCOME_").lower()


def health_name(h: int) -> str:
    return _enum(controller_pb2.NodeHealth, h, "NODE_HEALTH_").lower()


def event_type_name(t: int) -> str:
    return _enum(controller_pb2.EventType, t, "EVENT_TYPE_").lower()


def rollout_status_name(s: int) -> str:
    return _enum(controller_pb2.RolloutStatus, s, "ROLLOUT_STATUS_").lower()


def rollout_node_status_name(s: int) -> str:
    return _enum(controller_pb2.RolloutNodeStatus, s, "ROLLOUT_NODE_STATUS_").lower()


def mode_name(m: int) -> str:
    return _enum(policy_pb2.Mode, m, "MODE_").lower()


def topo(t) -> str:
    return f"TP{t.tp}PP{t.pp}" if t.tp and t.pp else ""


def _ts(ts) -> float | None:
    n = ts.ToNanoseconds()
    return n / 1e9 if n else None


def recommended_target(recommendation: str) -> str:
    """The topology a controller-recorded recommendation names ("TP1PP2: reason" → TP1PP2)."""
    m = _REC_TARGET.match(recommendation or "")
    return m.group(1) if m else ""


def switch_view(r: types_pb2.SwitchRecord) -> dict:
    return {
        "switch_id": r.switch_id, "node": r.node, "from": topo(r.from_topology),
        "to": topo(r.to_topology), "outcome": outcome_name(r.outcome), "phase": phase_name(r.phase),
        "phases": [{"phase": phase_name(p.phase), "seconds": p.seconds,
                    "started_at": _ts(p.started_at)} for p in r.phase_timings],
        "kv_bytes_moved": r.kv_bytes_moved, "weight_bytes_loaded": r.weight_bytes_loaded,
        "peak_extra_mem_bytes": r.peak_extra_mem_bytes, "layer_kv_bytes": r.layer_kv_bytes,
        "requests_held": r.requests_held, "requests_preempted": r.requests_preempted,
        "requests_in_flight": r.requests_in_flight, "downtime_s": r.downtime_seconds,
        "total_s": r.total_seconds,
        "error": ({"code": r.error.code, "message": r.error.message,
                   "phase": phase_name(r.error.phase)} if r.error.code or r.error.message
                  else None),
        "started_at": _ts(r.started_at), "finished_at": _ts(r.finished_at),
        "request_id": r.request_id, "reason": r.reason, "epoch": r.epoch,
        "overlapped": r.overlapped,
    }


def node_view(n: controller_pb2.NodeState) -> dict:
    cur = n.current_switch if n.current_switch.switch_id else None
    return {
        "node": n.node, "agent_address": n.agent_address, "http_address": n.http_address,
        "desired": topo(n.desired), "observed": topo(n.observed),
        "candidates": [topo(c) for c in n.candidates], "health": health_name(n.health),
        "lease_age_s": n.lease_age_seconds, "epoch": n.epoch, "stale": n.stale,
        "recommendation": n.recommendation,
        "recommended_target": recommended_target(n.recommendation),
        "current_switch": switch_view(cur) if cur is not None else None,
        "host": {"hostname": n.host.hostname, "device_type": n.host.device_type,
                 "device_count": n.host.device_count},
        "model": {"path": n.model.path, "architecture": n.model.architecture,
                  "dtype": n.model.dtype, "num_layers": n.model.num_layers},
        "workers": [worker_view(w) for w in n.workers],
    }


def worker_view(w) -> dict:
    return {"rank": w.rank, "state": _enum(types_pb2.WorkerState, w.state, "WORKER_STATE_"),
            "device": w.device, "model_bytes": w.model_bytes,
            "device_memory_bytes": w.device_memory_bytes, "released": w.released}


def held_now(n: controller_pb2.NodeState) -> dict:
    """The GPUs a node holds now as its agent measured them (its last heartbeat's workers):
    released ranks hold no weights, KV or device memory. ``reported`` False: no report yet."""
    return {"reported": bool(n.workers),
            "released": [w.rank for w in n.workers if w.released],
            "holding": [w.rank for w in n.workers if not w.released],
            "model_bytes": sum(w.model_bytes for w in n.workers),
            "device_memory_bytes": sum(w.device_memory_bytes for w in n.workers)}


def event_view(e: controller_pb2.Event) -> dict:
    return {
        "id": e.id, "type": event_type_name(e.type), "node": e.node, "switch_id": e.switch_id,
        "phase": phase_name(e.phase) if e.phase else "", "at": _ts(e.at), "detail": e.detail,
        "record": switch_view(e.record) if e.HasField("record") and e.record.switch_id else None,
        "rollout_id": e.rollout_id,
    }


ROLLOUT_TERMINAL = ("done", "failed", "aborted")


def rollout_view(r: controller_pb2.RolloutState, nodes=None) -> dict:
    """One rollout: its plan (waves with the capacity planned during and after each), each
    node's progress, and counts for a list row. ``nodes``: the controller's NodeStates, when
    given, add ``capacity_now`` — the set's serving capacity at this moment by the rollout's
    own table (READY nodes not switching, each at its observed topology's capacity), to set
    against the floor; the controller itself reports only the planned capacities."""
    p = r.plan
    status = rollout_status_name(r.status)
    progress = [{"node": n.node, "wave": n.wave, "status": rollout_node_status_name(n.status),
                 "switch_id": n.switch_id,
                 "outcome": outcome_name(n.outcome) if n.outcome else "", "error": n.error}
                for n in r.nodes]
    count = {k: 0 for k in ("pending", "switching", "succeeded", "rolled_back", "failed")}
    for n in progress:
        count[n["status"]] = count.get(n["status"], 0) + 1
    waves = len(p.waves)
    # a wave is done once none of its nodes is pending or switching
    by_wave: dict[int, list[str]] = {}
    for n in progress:
        by_wave.setdefault(n["wave"], []).append(n["status"])
    waves_done = sum(1 for w in p.waves
                     if by_wave.get(w.index) and
                     not {"pending", "switching"} & set(by_wave[w.index]))
    members = [n for w in p.waves for n in w.nodes]
    v = {
        "rollout_id": r.rollout_id, "status": status, "terminal": status in ROLLOUT_TERMINAL,
        "target": topo(p.target), "floor": p.floor, "max_parallel": p.max_parallel,
        "base_capacity": p.base_capacity, "required_capacity": p.required_capacity,
        "nodes_in_set": members + list(p.skipped) + [e.node for e in p.excluded],
        "wave": r.wave, "version": r.version,
        "failed_node": r.failed_node, "reason": r.reason, "description": r.description,
        "pause_requested": r.pause_requested, "abort_requested": r.abort_requested,
        "request_id": r.request_id, "created_at": _ts(r.created_at),
        "capacity_rps": dict(sorted(r.capacity_rps.items())),
        "waves": [{"index": w.index, "nodes": list(w.nodes),
                   "capacity_during": w.capacity_during, "capacity_after": w.capacity_after}
                  for w in p.waves],
        "skipped": list(p.skipped),
        "excluded": [{"node": e.node, "why": e.why} for e in p.excluded],
        "nodes": progress,
        "progress": {"waves_done": waves_done, "waves": waves,
                     "switched": count["succeeded"],
                     "failed": count["failed"] + count["rolled_back"],
                     "switching": count["switching"], "pending": count["pending"]},
    }
    if nodes is not None:
        v["capacity_now"] = capacity_now(r, nodes)
    return v


def rollout_row(r: controller_pb2.RolloutState) -> dict:
    """A rollout as a list shows it: :func:`rollout_view` without the per-wave and per-node
    detail (a 1,000-node rollout's is most of its size)."""
    v = rollout_view(r)
    for k in ("waves", "nodes", "excluded"):
        del v[k]
    return v


def capacity_now(r: controller_pb2.RolloutState, nodes) -> float | None:
    """The rollout's set serving now, by its capacity table: READY nodes (none switching) count
    their observed topology's capacity, others 0. None when the table lacks a
    topology a serving node is on (nothing to say then)."""
    members = {n for w in r.plan.waves for n in w.nodes} | set(r.plan.skipped) | \
        {e.node for e in r.plan.excluded}
    total = 0.0
    for n in nodes:
        if n.node not in members or n.health != controller_pb2.NODE_HEALTH_READY:
            continue  # switching (health SWITCHING), lost or draining: 0
        cap = r.capacity_rps.get(topo(n.observed))
        if cap is None:
            return None
        total += cap
    return total


def plan_view(p: controller_pb2.PlanResponse) -> dict:
    return {
        "node": p.node, "from": topo(p.from_topology), "to": topo(p.to_topology), "noop": p.noop,
        "kv_bytes_total": p.kv_bytes_total, "weight_bytes_total": p.weight_bytes_total,
        "predicted": {phase_name(x.phase): x.seconds for x in p.predicted},
        "predicted_total_s": p.predicted_total_seconds,
        "requests_to_preempt": p.requests_to_preempt,
        "transfers": [{"src_rank": t.src_rank, "dst_rank": t.dst_rank, "layers": list(t.layers),
                       "kv_heads": [t.kv_head_start, t.kv_head_end], "kv_bytes": t.kv_bytes}
                      for t in p.transfers],
        "shard_loads": [{"rank": s.rank, "layers": list(s.layers), "tp_rank": s.tp_rank,
                         "tp_size": s.tp_size, "weight_bytes": s.weight_bytes}
                        for s in p.shard_loads],
    }


def forecast_view(f: policy_pb2.Forecast) -> dict:
    return {
        "node": f.node, "forecaster": f.forecaster, "backtest_error": f.backtest_mae,
        "points": [{"t": _ts(p.at), "mean": p.requests_per_second, "lower": p.lower,
                    "upper": p.upper} for p in f.points],
        "observed": [{"t": _ts(s.at), "window_s": s.window_seconds,
                      "rate": s.requests / s.window_seconds if s.window_seconds > 0 else 0.0,
                      "requests": s.requests, "running": s.running, "waiting": s.waiting}
                     for s in f.observed],
    }


def _num(x: float) -> float | None:
    """JSON has no NaN: a quantity not counted is null."""
    return None if math.isnan(x) or math.isinf(x) else x


def impact_view(r: policy_pb2.Recommendation) -> dict:
    """What a recommendation is expected to do (policy.proto Recommendation fields 8-22)."""
    return {
        "objective": r.objective, "profile": r.profile,
        "expected_saving_gpu_hours": _num(r.expected_saving_gpu_hours),
        "saving_horizon_s": _num(r.saving_horizon_seconds),
        "expected_slo_loss": _num(r.expected_slo_loss), "overload_risk": _num(r.overload_risk),
        "gpus": r.gpus, "host_gpus": r.host_gpus, "released_gpus": list(r.released_gpus),
        "unreleased_gpus": list(r.unreleased_gpus),
        "error_budget_requests": _num(r.error_budget_requests),
        "expected_tpot_saving_ms": _num(r.expected_tpot_saving_ms),
        "forecaster": r.forecaster, "forecast_rps": _num(r.forecast_rps),
        "decision_id": r.decision_id,
    }


def recommendation_view(r: policy_pb2.Recommendation) -> dict:
    return {"node": r.node, "current": topo(r.current), "recommended": topo(r.recommended),
            "switch": r.switch, "reason": r.reason, "at": _ts(r.at), **impact_view(r)}


def decision_view(d: policy_pb2.Decision) -> dict:
    r = d.recommendation
    return {
        "id": d.id, "node": r.node, "mode": mode_name(d.mode), "switch_id": d.switch_id,
        "outcome": d.outcome, "current": topo(r.current), "recommended": topo(r.recommended),
        "switch": r.switch, "reason": r.reason, "at": _ts(r.at),
        "scores": [{"topology": topo(c.topology), "expected_goodput": c.expected_goodput,
                    "switch_cost": c.switch_cost, "score": c.score} for c in r.scores],
        "impact": impact_view(r),
    }


def _world(t) -> int:
    return t.tp * t.pp


def host_gpus(n: controller_pb2.NodeState) -> int:
    """The whole host, as the policy counts it: the largest candidate world size."""
    return max([_world(c) for c in n.candidates] + [_world(n.observed)], default=0)


def topology_timeline(switches, observed) -> list[tuple[float, int]]:
    """[(from time, GPUs held)] of a node, from its switch records (any order) and its observed
    topology: before the oldest successful switch, that switch's source; from each one's end, its
    target. Switches that did not succeed changed nothing."""
    done = sorted((r for r in switches
                   if r.outcome == types_pb2.SWITCH_OUTCOME_SUCCEEDED and _ts(r.finished_at)),
                  key=lambda r: r.finished_at.ToNanoseconds())
    if not done:
        return [(-math.inf, _world(observed))]
    line = [(-math.inf, _world(done[0].from_topology))]
    line += [(_ts(r.finished_at), _world(r.to_topology)) for r in done]
    return line


def _held_at(line: list[tuple[float, int]], t: float) -> int:
    g = line[0][1]
    for since, gpus in line:
        if since <= t:
            g = gpus
        else:
            break
    return g


def _utc_day(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d")


def gpu_hours_by_day(samples, switches, observed, host: int) -> list[dict]:
    """GPU-hours a node held vs holding the whole host (``host`` GPUs), per UTC day, over the
    heartbeat windows the controller retains (a window [at − window_seconds, at] counts with the
    topology held at its middle; a window across midnight is split). Newest day last."""
    line = topology_timeline(switches, observed)
    days: dict[str, dict] = {}
    for s in samples:
        end, w = _ts(s.at), s.window_seconds
        if end is None or not w > 0:
            continue
        gpus = _held_at(line, end - w / 2)
        start = end - w
        while start < end:
            day = _utc_day(start)
            midnight = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=timezone.utc).timestamp()
            piece = min(end, midnight + 86400.0) - start
            d = days.setdefault(day, {"day": day, "observed_s": 0.0, "gpu_s": 0.0, "host_gpu_s": 0.0})
            d["observed_s"] += piece
            d["gpu_s"] += gpus * piece
            d["host_gpu_s"] += host * piece
            start += piece
    out = []
    for day in sorted(days):
        d = days[day]
        held, whole = d["gpu_s"] / 3600.0, d["host_gpu_s"] / 3600.0
        out.append({"day": day, "observed_hours": d["observed_s"] / 3600.0, "gpu_hours": held,
                    "host_gpu_hours": whole, "saved_gpu_hours": whole - held,
                    "fraction": held / whole if whole > 0 else None})
    return out


def saving_view(n: controller_pb2.NodeState, samples, switches, recommendation=None,
                recommendation_error: str = "", now: float | None = None) -> dict:
    """The saving of one node: GPU-hours held vs the whole host per day, and the latest
    recommendation's expected saving (``recommendation``: a policy Recommendation, or None)."""
    host = host_gpus(n)
    return {
        "node": n.node, "host_gpus": host, "gpus_now": _world(n.observed),
        "observed": topo(n.observed), "held_now": held_now(n),
        "days": gpu_hours_by_day(samples, switches, n.observed, host),
        "recommendation": recommendation_view(recommendation) if recommendation is not None else None,
        "recommendation_error": recommendation_error,
        "at": time.time() if now is None else now,
    }


# ------------------------------------------------------------------------------ text

def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 10 else f"{s:.1f} s"


def phases_text(sw: dict) -> str:
    return " · ".join(f"{p['phase']} {ms(p['seconds'])}" for p in sw["phases"])


def switch_line(sw: dict) -> str:
    line = (f"{sw['switch_id']}  {sw['node']}  {sw['from']}→{sw['to']}  {sw['outcome']}"
            f"  total {ms(sw['total_s'])}  downtime {ms(sw['downtime_s'])}"
            f"  kv {human_bytes(sw['kv_bytes_moved'])}  weights "
            f"{human_bytes(sw['weight_bytes_loaded'])}  in-flight {sw['requests_in_flight']}"
            f" held {sw['requests_held']} preempted {sw['requests_preempted']}")
    if sw["error"]:
        line += f"  error {sw['error']['code']}: {sw['error']['message']}"
    return line
