import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_SERVING_OLD: _ClassVar[Phase]
    PHASE_QUIESCING: _ClassVar[Phase]
    PHASE_PREPARING_WORKERS: _ClassVar[Phase]
    PHASE_MPU_APPLIED: _ClassVar[Phase]
    PHASE_MIGRATE_KV: _ClassVar[Phase]
    PHASE_RELOAD_SHARDS: _ClassVar[Phase]
    PHASE_REBINDING: _ClassVar[Phase]
    PHASE_SERVING_NEW: _ClassVar[Phase]
    PHASE_ROLLING_BACK: _ClassVar[Phase]
    PHASE_ROLLED_BACK: _ClassVar[Phase]
    PHASE_FAILED: _ClassVar[Phase]

class SwitchOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWITCH_OUTCOME_UNSPECIFIED: _ClassVar[SwitchOutcome]
    SWITCH_OUTCOME_RUNNING: _ClassVar[SwitchOutcome]
    SWITCH_OUTCOME_SUCCEEDED: _ClassVar[SwitchOutcome]
    SWITCH_OUTCOME_ROLLED_BACK: _ClassVar[SwitchOutcome]
    SWITCH_OUTCOME_FAILED: _ClassVar[SwitchOutcome]
    SWITCH_OUTCOME_ABORTED: _ClassVar[SwitchOutcome]
    SWITCH_OUTCOME_NOOP: _ClassVar[SwitchOutcome]
    SWITCH_OUTCOME_UNKNOWN: _ClassVar[SwitchOutcome]

class EngineStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATUS_UNSPECIFIED: _ClassVar[EngineStatus]
    ENGINE_STATUS_STARTING: _ClassVar[EngineStatus]
    ENGINE_STATUS_SERVING: _ClassVar[EngineStatus]
    ENGINE_STATUS_SWITCHING: _ClassVar[EngineStatus]
    ENGINE_STATUS_DEAD: _ClassVar[EngineStatus]
    ENGINE_STATUS_STOPPING: _ClassVar[EngineStatus]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_ACTIVE: _ClassVar[WorkerState]
    WORKER_STATE_STANDBY: _ClassVar[WorkerState]
    WORKER_STATE_WAKING: _ClassVar[WorkerState]

class RecoveryAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECOVERY_ACTION_UNSPECIFIED: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_MIGRATE: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_RECOMPUTE: _ClassVar[RecoveryAction]
    RECOVERY_ACTION_ABORT: _ClassVar[RecoveryAction]
PHASE_UNSPECIFIED: Phase
PHASE_SERVING_OLD: Phase
PHASE_QUIESCING: Phase
PHASE_PREPARING_WORKERS: Phase
PHASE_MPU_APPLIED: Phase
PHASE_MIGRATE_KV: Phase
PHASE_RELOAD_SHARDS: Phase
PHASE_REBINDING: Phase
PHASE_SERVING_NEW: Phase
PHASE_ROLLING_BACK: Phase
PHASE_ROLLED_BACK: Phase
PHASE_FAILED: Phase
SWITCH_OUTCOME_UNSPECIFIED: SwitchOutcome
SWITCH_OUTCOME_RUNNING: SwitchOutcome
SWITCH_OUTCOME_SUCCEEDED: SwitchOutcome
SWITCH_OUTCOME_ROLLED_BACK: SwitchOutcome
SWITCH_OUTCOME_FAILED: SwitchOutcome
SWITCH_OUTCOME_ABORTED: SwitchOutcome
SWITCH_OUTCOME_NOOP: SwitchOutcome
SWITCH_OUTCOME_UNKNOWN: SwitchOutcome
ENGINE_STATUS_UNSPECIFIED: EngineStatus
ENGINE_STATUS_STARTING: EngineStatus
ENGINE_STATUS_SERVING: EngineStatus
ENGINE_STATUS_SWITCHING: EngineStatus
ENGINE_STATUS_DEAD: EngineStatus
ENGINE_STATUS_STOPPING: EngineStatus
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_ACTIVE: WorkerState
WORKER_STATE_STANDBY: WorkerState
WORKER_STATE_WAKING: WorkerState
RECOVERY_ACTION_UNSPECIFIED: RecoveryAction
RECOVERY_ACTION_MIGRATE: RecoveryAction
RECOVERY_ACTION_RECOMPUTE: RecoveryAction
RECOVERY_ACTION_ABORT: RecoveryAction

class Topology(_message.Message):
    __slots__ = ("tp", "pp")
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    tp: int
    pp: int
    def __init__(self, tp: _Optional[int] = ..., pp: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "phase", "retryable")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    phase: Phase
    retryable: bool
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., retryable: _Optional[bool] = ...) -> None: ...

class PhaseTiming(_message.Message):
    __slots__ = ("phase", "seconds", "started_at")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    seconds: float
    started_at: _timestamp_pb2.Timestamp
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., seconds: _Optional[float] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SwitchRecord(_message.Message):
    __slots__ = ("switch_id", "node", "from_topology", "to_topology", "outcome", "phase", "phase_timings", "kv_bytes_moved", "weight_bytes_loaded", "peak_extra_mem_bytes", "layer_kv_bytes", "requests_held", "requests_preempted", "requests_in_flight", "downtime_seconds", "total_seconds", "error", "started_at", "finished_at", "request_id", "reason", "epoch", "overlapped", "pool_blocks_before", "pool_blocks_after", "preempted_request_ids", "ranks_woken", "ranks_parked", "weight_bytes_from_store", "weight_bytes_peer", "weight_bytes_verified")
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FROM_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    TO_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    PEAK_EXTRA_MEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_HELD_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DOWNTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_AFTER_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_WOKEN_FIELD_NUMBER: _ClassVar[int]
    RANKS_PARKED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_PEER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    node: str
    from_topology: Topology
    to_topology: Topology
    outcome: SwitchOutcome
    phase: Phase
    phase_timings: _containers.RepeatedCompositeFieldContainer[PhaseTiming]
    kv_bytes_moved: int
    weight_bytes_loaded: int
    peak_extra_mem_bytes: int
    layer_kv_bytes: int
    requests_held: int
    requests_preempted: int
    requests_in_flight: int
    downtime_seconds: float
    total_seconds: float
    error: Error
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    request_id: str
    reason: str
    epoch: int
    overlapped: bool
    pool_blocks_before: int
    pool_blocks_after: int
    preempted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    ranks_woken: _containers.RepeatedScalarFieldContainer[int]
    ranks_parked: _containers.RepeatedScalarFieldContainer[int]
    weight_bytes_from_store: int
    weight_bytes_peer: int
    weight_bytes_verified: int
    def __init__(self, switch_id: _Optional[str] = ..., node: _Optional[str] = ..., from_topology: _Optional[_Union[Topology, _Mapping]] = ..., to_topology: _Optional[_Union[Topology, _Mapping]] = ..., outcome: _Optional[_Union[SwitchOutcome, str]] = ..., phase: _Optional[_Union[Phase, str]] = ..., phase_timings: _Optional[_Iterable[_Union[PhaseTiming, _Mapping]]] = ..., kv_bytes_moved: _Optional[int] = ..., weight_bytes_loaded: _Optional[int] = ..., peak_extra_mem_bytes: _Optional[int] = ..., layer_kv_bytes: _Optional[int] = ..., requests_held: _Optional[int] = ..., requests_preempted: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., downtime_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., request_id: _Optional[str] = ..., reason: _Optional[str] = ..., epoch: _Optional[int] = ..., overlapped: _Optional[bool] = ..., pool_blocks_before: _Optional[int] = ..., pool_blocks_after: _Optional[int] = ..., preempted_request_ids: _Optional[_Iterable[str]] = ..., ranks_woken: _Optional[_Iterable[int]] = ..., ranks_parked: _Optional[_Iterable[int]] = ..., weight_bytes_from_store: _Optional[int] = ..., weight_bytes_peer: _Optional[int] = ..., weight_bytes_verified: _Optional[int] = ...) -> None: ...

class HostFacts(_message.Message):
    __slots__ = ("hostname", "device_type", "device_count", "device_names", "cpu_cores", "memory_bytes", "device_memory_bytes")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAMES_FIELD_NUMBER: _ClassVar[int]
    CPU_CORES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    device_type: str
    device_count: int
    device_names: _containers.RepeatedScalarFieldContainer[str]
    cpu_cores: int
    memory_bytes: int
    device_memory_bytes: int
    def __init__(self, hostname: _Optional[str] = ..., device_type: _Optional[str] = ..., device_count: _Optional[int] = ..., device_names: _Optional[_Iterable[str]] = ..., cpu_cores: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ...) -> None: ...

class ModelFacts(_message.Message):
    __slots__ = ("path", "architecture", "num_layers", "num_attention_heads", "num_kv_heads", "head_size", "hidden_size", "vocab_size", "dtype", "weight_bytes", "max_model_len")
    PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    dtype: str
    weight_bytes: int
    max_model_len: int
    def __init__(self, path: _Optional[str] = ..., architecture: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "tp_rank", "pp_rank", "state", "pid", "rss_bytes", "kv_resident_bytes", "device", "model_bytes", "device_memory_bytes", "released")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    tp_rank: int
    pp_rank: int
    state: WorkerState
    pid: int
    rss_bytes: int
    kv_resident_bytes: int
    device: str
    model_bytes: int
    device_memory_bytes: int
    released: bool
    def __init__(self, rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., pid: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., kv_resident_bytes: _Optional[int] = ..., device: _Optional[str] = ..., model_bytes: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., released: _Optional[bool] = ...) -> None: ...

class TrafficSample(_message.Message):
    __slots__ = ("at", "window_seconds", "requests", "input_tokens", "output_tokens", "running", "waiting", "tpot_seconds_sum", "tpot_requests", "ttft_seconds_sum", "ttft_requests")
    AT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TPOT_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    TPOT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    TTFT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    at: _timestamp_pb2.Timestamp
    window_seconds: float
    requests: int
    input_tokens: int
    output_tokens: int
    running: int
    waiting: int
    tpot_seconds_sum: float
    tpot_requests: int
    ttft_seconds_sum: float
    ttft_requests: int
    def __init__(self, at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., window_seconds: _Optional[float] = ..., requests: _Optional[int] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., tpot_seconds_sum: _Optional[float] = ..., tpot_requests: _Optional[int] = ..., ttft_seconds_sum: _Optional[float] = ..., ttft_requests: _Optional[int] = ...) -> None: ...

class RecoveryDecision(_message.Message):
    __slots__ = ("request_id", "action", "reason", "migrate_seconds", "recompute_seconds", "bandwidth_bps", "kv_bytes", "tokens", "retry_after_seconds", "source_node", "target_node", "detail")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_NODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    action: RecoveryAction
    reason: str
    migrate_seconds: float
    recompute_seconds: float
    bandwidth_bps: float
    kv_bytes: int
    tokens: int
    retry_after_seconds: int
    source_node: str
    target_node: str
    detail: str
    def __init__(self, request_id: _Optional[str] = ..., action: _Optional[_Union[RecoveryAction, str]] = ..., reason: _Optional[str] = ..., migrate_seconds: _Optional[float] = ..., recompute_seconds: _Optional[float] = ..., bandwidth_bps: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., tokens: _Optional[int] = ..., retry_after_seconds: _Optional[int] = ..., source_node: _Optional[str] = ..., target_node: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...
