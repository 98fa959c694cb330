"""to_proto / from_proto converters for the node agent (the only place that builds messages)."""

from __future__ import annotations

from remp.common.v1 import types_pb2
from remp.node_agent.v1 import node_agent_pb2
from remp.topology import Topology

from google.protobuf.timestamp_pb2 import Timestamp

from remp.convert import outcome_to_proto
from remp.transaction import Outcome, Phase

from node_agent.agent import AgentSnapshot
from node_agent.config import HostFacts, ModelFacts
from node_agent.switch import SwitchEvent, SwitchRecord

ENGINE_STATUS = {
    "starting": types_pb2.ENGINE_STATUS_STARTING,
    "serving": types_pb2.ENGINE_STATUS_SERVING,
    "switching": types_pb2.ENGINE_STATUS_SWITCHING,
    "dead": types_pb2.ENGINE_STATUS_DEAD,
    "stopping": types_pb2.ENGINE_STATUS_STOPPING,
    "restarting": types_pb2.ENGINE_STATUS_STARTING,  # a new engine after the last one died
}


def topology_to_proto(t: Topology) -> types_pb2.Topology:
    return types_pb2.Topology(tp=t.tp, pp=t.pp)


def topology_from_proto(p: types_pb2.Topology) -> Topology:
    return Topology(p.tp, p.pp)


def host_to_proto(h: HostFacts) -> types_pb2.HostFacts:
    return types_pb2.HostFacts(
        hostname=h.hostname,
        device_type=h.device_type,
        device_count=h.device_count,
        device_names=h.device_names,
        cpu_cores=h.cpu_cores,
        memory_bytes=h.memory_bytes,
        device_memory_bytes=h.device_memory_bytes,
    )


def model_to_proto(m: ModelFacts, dtype: str, max_model_len: int) -> types_pb2.ModelFacts:
    return types_pb2.ModelFacts(
        path=m.path,
        architecture=m.architecture,
        num_layers=m.shape.num_layers,
        num_attention_heads=m.shape.num_attention_heads,
        num_kv_heads=m.shape.num_kv_heads,
        head_size=m.shape.head_size,
        hidden_size=m.shape.hidden_size,
        vocab_size=m.vocab_size,
        dtype=dtype,
        weight_bytes=m.weight_bytes,
        max_model_len=max_model_len,
    )


def worker_to_proto(w: dict) -> types_pb2.WorkerInfo:
    """One worker's facts (``remp_worker_info``) as the Describe reply and heartbeats carry them."""
    return types_pb2.WorkerInfo(
        rank=w["rank"], tp_rank=w["tp_rank"], pp_rank=w["pp_rank"],
        state=(types_pb2.WORKER_STATE_STANDBY if w.get("standby")
               else types_pb2.WORKER_STATE_ACTIVE), pid=w["pid"], rss_bytes=w["rss_bytes"],
        kv_resident_bytes=w.get("kv_resident_bytes", 0), device=w.get("device", ""),
        model_bytes=w.get("model_bytes", 0), device_memory_bytes=w.get("device_memory_bytes", 0),
        released=w.get("released", False))


def describe_to_proto(d: AgentSnapshot) -> node_agent_pb2.DescribeResponse:
    cfg = d.config
    return node_agent_pb2.DescribeResponse(
        node=cfg.settings.node,
        host=host_to_proto(cfg.host),
        model=model_to_proto(cfg.model, cfg.dtype, cfg.settings.max_model_len),
        topology=topology_to_proto(d.topology),
        candidates=[topology_to_proto(t) for t in cfg.candidates],
        engine_status=ENGINE_STATUS[d.status],
        vllm_version=d.vllm_version,
        agent_version=d.agent_version,
        http_address=d.http_address,
        workers=[worker_to_proto(w) for w in d.workers],
        current_switch_id=d.current_switch_id,
        world_size=d.topology.world_size,
        engine=engine_info_to_proto(d.engine) if d.engine else None,
    )


def engine_info_to_proto(e: dict) -> node_agent_pb2.EngineInfo:
    return node_agent_pb2.EngineInfo(
        num_blocks=e["num_blocks"], free_blocks=e["free_blocks"], block_size=e["block_size"],
        running=e["running"], waiting=e["waiting"], engine_core_pid=e["pid"],
    )


def _ts(wall: float) -> Timestamp | None:
    if not wall:
        return None
    t = Timestamp()
    t.FromNanoseconds(int(wall * 1e9))
    return t


def record_to_proto(r: SwitchRecord) -> types_pb2.SwitchRecord:
    return types_pb2.SwitchRecord(
        switch_id=r.switch_id,
        node=r.node,
        from_topology=topology_to_proto(r.from_topology),
        to_topology=topology_to_proto(r.to_topology),
        outcome=outcome_to_proto(r.outcome),
        phase=int(r.phase),
        phase_timings=[types_pb2.PhaseTiming(phase=int(p), seconds=s, started_at=_ts(t))
                       for p, t, s in r.timings],
        kv_bytes_moved=r.kv_bytes_moved,
        weight_bytes_loaded=r.weight_bytes_loaded,
        weight_bytes_from_store=r.weight_bytes_from_store,
        weight_bytes_peer=r.weight_bytes_peer,
        weight_bytes_verified=r.weight_bytes_verified,
        peak_extra_mem_bytes=r.peak_extra_mem_bytes,
        layer_kv_bytes=r.layer_kv_bytes,
        requests_held=r.requests_held,
        requests_preempted=r.requests_preempted,
        pool_blocks_before=r.pool_blocks_before,
        pool_blocks_after=r.pool_blocks_after,
        preempted_request_ids=r.preempted_request_ids,
        ranks_woken=r.ranks_woken,
        ranks_parked=r.ranks_parked,
        requests_in_flight=r.requests_in_flight,
        downtime_seconds=r.downtime_s,
        total_seconds=r.total_s,
        error=(types_pb2.Error(code=r.error[0], message=r.error[1], phase=int(r.error[2]),
                               retryable=r.outcome == Outcome.ROLLED_BACK) if r.error else None),
        started_at=_ts(r.started_wall),
        finished_at=_ts(r.finished_wall),
        reason=r.reason,
        epoch=r.epoch,
        overlapped=r.overlapped,
    )


def event_to_proto(e: SwitchEvent) -> node_agent_pb2.SwitchEvent:
    return node_agent_pb2.SwitchEvent(
        switch_id=e.switch_id,
        phase=int(e.phase),
        elapsed_seconds=e.elapsed_s,
        detail=e.detail,
        record=record_to_proto(e.record) if e.record else None,
    )


def phase_from_proto(p: int) -> Phase:
    return Phase(p)
