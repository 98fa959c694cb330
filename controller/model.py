"""The controller's domain types: plain dataclasses the core takes and returns (no protobuf).

Each mirrors one message of the contract field for field, under the same field names, so that
:mod:`controller.convert` maps them both ways without loss (the store keeps writing the same
protobuf JSON). Conventions:

* a message-typed field is ``X | None`` (None: not set), a repeated one a tuple, a map a tuple
  of (key, value) pairs sorted by key;
* timestamps are ``int`` nanoseconds since the epoch (None: not set), exact both ways;
* ``remp.common.v1.Topology`` is :class:`remp.topology.Topology`, ``Phase`` is
  :class:`remp.transaction.Phase`, ``SwitchOutcome`` is :class:`remp.transaction.Outcome`
  (None: UNSPECIFIED); the other enums are the IntEnums below (values = the proto numbers,
  pinned by ``tests/unit/test_controller_core.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from remp.topology import Topology
from remp.transaction import Outcome, Phase

__all__ = ["Topology", "Outcome", "Phase"]  # re-exported: part of this model


class NodeHealth(IntEnum):
    UNSPECIFIED = 0
    READY = 1
    SWITCHING = 2
    LOST = 3
    DRAINING = 4


class EventType(IntEnum):
    UNSPECIFIED = 0
    NODE_REGISTERED = 1
    NODE_LOST = 2
    SWITCH_PHASE = 3
    SWITCH_DONE = 4
    SWITCH_FAILED = 5
    SWITCH_ROLLED_BACK = 6
    SWITCH_ABORTED = 7
    RECOMMENDATION = 8
    NODE_DRAINING = 9
    REQUEST_RECOVERY = 10
    REQUEST_RECOVERED = 11
    ROLLOUT_PLANNED = 12
    ROLLOUT_WAVE = 13
    ROLLOUT_PAUSED = 14
    ROLLOUT_DONE = 15
    ROLLOUT_FAILED = 16
    ROLLOUT_ABORTED = 17
    ROLLOUT_PROGRESS = 18


class RecoveryAction(IntEnum):
    UNSPECIFIED = 0
    MIGRATE = 1
    RECOMPUTE = 2
    ABORT = 3


# ---------------------------------------------------------------------- remp.common.v1
@dataclass(frozen=True)
class Error:
    code: str = ""
    message: str = ""
    phase: Phase = Phase.UNSPECIFIED
    retryable: bool = False


@dataclass(frozen=True)
class PhaseTiming:
    phase: Phase = Phase.UNSPECIFIED
    seconds: float = 0.0
    started_at: int | None = None


@dataclass(frozen=True)
class SwitchRecord:
    switch_id: str = ""
    node: str = ""
    from_topology: Topology | None = None
    to_topology: Topology | None = None
    outcome: Outcome | None = None
    phase: Phase = Phase.UNSPECIFIED
    phase_timings: tuple[PhaseTiming, ...] = ()
    kv_bytes_moved: int = 0
    weight_bytes_loaded: int = 0
    peak_extra_mem_bytes: int = 0
    layer_kv_bytes: int = 0
    requests_held: int = 0
    requests_preempted: int = 0
    requests_in_flight: int = 0
    downtime_seconds: float = 0.0
    total_seconds: float = 0.0
    error: Error | None = None
    started_at: int | None = None
    finished_at: int | None = None
    request_id: str = ""
    reason: str = ""
    epoch: int = 0
    overlapped: bool = False
    pool_blocks_before: int = 0
    pool_blocks_after: int = 0
    preempted_request_ids: tuple[str, ...] = ()
    ranks_woken: tuple[int, ...] = ()
    ranks_parked: tuple[int, ...] = ()
    weight_bytes_from_store: int = 0
    weight_bytes_peer: int = 0
    weight_bytes_verified: int = 0


@dataclass(frozen=True)
class HostFacts:
    hostname: str = ""
    device_type: str = ""
    device_count: int = 0
    device_names: tuple[str, ...] = ()
    cpu_cores: int = 0
    memory_bytes: int = 0
    device_memory_bytes: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    """One worker as its agent reports it (``WorkerInfo``; ``state`` is the proto's number)."""

    rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    state: int = 0
    pid: int = 0
    rss_bytes: int = 0
    kv_resident_bytes: int = 0
    device: str = ""
    model_bytes: int = 0
    device_memory_bytes: int = 0
    released: bool = False


@dataclass(frozen=True)
class ModelFacts:
    path: str = ""
    architecture: str = ""
    num_layers: int = 0
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    hidden_size: int = 0
    vocab_size: int = 0
    dtype: str = ""
    weight_bytes: int = 0
    max_model_len: int = 0


@dataclass(frozen=True)
class TrafficSample:
    at: int | None = None
    window_seconds: float = 0.0
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    running: int = 0
    waiting: int = 0
    tpot_seconds_sum: float = 0.0
    tpot_requests: int = 0
    ttft_seconds_sum: float = 0.0
    ttft_requests: int = 0


@dataclass(frozen=True)
class RecoveryDecision:
    request_id: str = ""
    action: RecoveryAction = RecoveryAction.UNSPECIFIED
    reason: str = ""
    migrate_seconds: float = 0.0
    recompute_seconds: float = 0.0
    bandwidth_bps: float = 0.0
    kv_bytes: int = 0
    tokens: int = 0
    retry_after_seconds: int = 0
    source_node: str = ""
    target_node: str = ""
    detail: str = ""


# ---------------------------------------------------------------------- remp.controller.v1
@dataclass(frozen=True)
class Registration:
    """A node's registration (``RegisterNodeRequest``; stored as the node's ``reg``)."""

    node: str = ""
    agent_address: str = ""
    http_address: str = ""
    topology: Topology | None = None
    candidates: tuple[Topology, ...] = ()
    host: HostFacts | None = None
    model: ModelFacts | None = None
    kv_bandwidth_bps: float = 0.0
    weight_bandwidth_bps: float = 0.0
    labels: tuple[tuple[str, str], ...] = ()  # map<string, string>: (key, value), sorted
    last_epoch: int = 0  # the agent's; raises the node's epoch (not kept in the stored reg)


@dataclass(frozen=True)
class InflightRequest:
    request_id: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    max_tokens: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False


@dataclass(frozen=True)
class Heartbeat:
    """``HeartbeatRequest`` (also the stored in-flight journal: only ``inflight`` set)."""

    node: str = ""
    topology: Topology | None = None
    engine_status: int = 0
    traffic: TrafficSample | None = None
    inflight: tuple[InflightRequest, ...] = ()
    topology_epoch: int = 0
    workers: tuple[WorkerInfo, ...] = ()


@dataclass
class Recovery:
    """One request's recovery record (mutable: the continuation accumulates in it)."""

    request_id: str = ""
    source_node: str = ""
    target_node: str = ""
    cause: str = ""
    decision: RecoveryDecision | None = None
    status: str = ""
    tokens_before: int = 0
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str = ""
    error: str = ""
    at: int | None = None


@dataclass(frozen=True)
class NodeState:
    node: str = ""
    agent_address: str = ""
    http_address: str = ""
    desired: Topology | None = None
    observed: Topology | None = None
    candidates: tuple[Topology, ...] = ()
    health: NodeHealth = NodeHealth.UNSPECIFIED
    lease_age_seconds: float = 0.0
    current_switch: SwitchRecord | None = None
    epoch: int = 0
    stale: bool = False
    host: HostFacts | None = None
    model: ModelFacts | None = None
    recommendation: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    rollout_id: str = ""
    workers: tuple[WorkerInfo, ...] = ()  # as the last heartbeat reported them


@dataclass(frozen=True)
class Event:
    id: str = ""
    type: EventType = EventType.UNSPECIFIED
    node: str = ""
    switch_id: str = ""
    phase: Phase = Phase.UNSPECIFIED
    at: int | None = None
    record: SwitchRecord | None = None
    detail: str = ""
    decision: RecoveryDecision | None = None
    rollout_id: str = ""


@dataclass(frozen=True)
class RolloutMeta:
    """What a stored rollout keeps beside its :class:`controller.rollout.RolloutState` (the
    ``RolloutState`` message's fields 11-14)."""

    request_id: str = ""
    created_at: int | None = None
    capacity_rps: tuple[tuple[str, float], ...] = ()  # "TPxPPy" → capacity, sorted
    description: str = ""


@dataclass(frozen=True)
class ReconfigureResult:
    switch_id: str = ""
    noop: bool = False
    duplicate: bool = False


@dataclass(frozen=True)
class AbortResult:
    aborted: bool = False
    phase: Phase = Phase.UNSPECIFIED


# ---------------------------------------------------------------------- the agent port's types
@dataclass(frozen=True)
class EngineInfo:
    num_blocks: int = 0
    free_blocks: int = 0
    block_size: int = 0
    running: int = 0
    waiting: int = 0
    engine_core_pid: int = 0


@dataclass(frozen=True)
class AgentDescription:
    """What the controller reads of an agent's ``Describe`` (not every field)."""

    node: str = ""
    topology: Topology | None = None
    http_address: str = ""
    current_switch_id: str = ""
    world_size: int = 0
    engine: EngineInfo | None = None  # None while the engine starts


@dataclass(frozen=True)
class SwitchOrder:
    """``ExecuteSwitchRequest``: what the controller asks an agent to run."""

    target: Topology | None = None
    switch_id: str = ""
    epoch: int = 0
    reason: str = ""
    sequential_data_path: bool = False


@dataclass(frozen=True)
class SwitchProgress:
    """``SwitchEvent``: one phase of a running switch; ``record`` on the final one."""

    switch_id: str = ""
    phase: Phase = Phase.UNSPECIFIED
    elapsed_seconds: float = 0.0
    record: SwitchRecord | None = None
    error: Error | None = None
    detail: str = ""


@dataclass(frozen=True)
class RequestInfo:
    request_id: str = ""
    status: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int = 0
    blocks: int = 0


@dataclass(frozen=True)
class MigrateOrder:
    """``MigrateRequestRequest``: move one running request to another agent."""

    request_id: str = ""
    target_address: str = ""
    mode: int = 0
    bandwidth_limit_bps: float = 0.0
    slo_budget_seconds: float = 0.0
    target_node: str = ""
    kv_int8: int = 0  # KvInt8Mode (0: the agent's --kv-int8)


@dataclass(frozen=True)
class ImportOrder:
    """``ImportHeader``: recompute a request on an agent (no KV payload follows)."""

    request_id: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    max_tokens: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    kv_bytes: int = 0
    block_size: int = 0
    kv_format: int = 0  # KvFormat of the payload (0: full width)


@dataclass(frozen=True)
class Continuation:
    """An event of a moved request's stream (``MigrateRequestEvent`` / ``ImportEvent``): the
    decision (first event of a migration only), then the tokens the target generates."""

    decision: RecoveryDecision | None = None
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    finish_reason: str = ""
