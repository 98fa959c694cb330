import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from remp.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_HEALTH_UNSPECIFIED: _ClassVar[NodeHealth]
    NODE_HEALTH_READY: _ClassVar[NodeHealth]
    NODE_HEALTH_SWITCHING: _ClassVar[NodeHealth]
    NODE_HEALTH_LOST: _ClassVar[NodeHealth]
    NODE_HEALTH_DRAINING: _ClassVar[NodeHealth]

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_TYPE_NODE_REGISTERED: _ClassVar[EventType]
    EVENT_TYPE_NODE_LOST: _ClassVar[EventType]
    EVENT_TYPE_SWITCH_PHASE: _ClassVar[EventType]
    EVENT_TYPE_SWITCH_DONE: _ClassVar[EventType]
    EVENT_TYPE_SWITCH_FAILED: _ClassVar[EventType]
    EVENT_TYPE_SWITCH_ROLLED_BACK: _ClassVar[EventType]
    EVENT_TYPE_SWITCH_ABORTED: _ClassVar[EventType]
    EVENT_TYPE_RECOMMENDATION: _ClassVar[EventType]
    EVENT_TYPE_NODE_DRAINING: _ClassVar[EventType]
    EVENT_TYPE_REQUEST_RECOVERY: _ClassVar[EventType]
    EVENT_TYPE_REQUEST_RECOVERED: _ClassVar[EventType]
    EVENT_TYPE_ROLLOUT_PLANNED: _ClassVar[EventType]
    EVENT_TYPE_ROLLOUT_WAVE: _ClassVar[EventType]
    EVENT_TYPE_ROLLOUT_PAUSED: _ClassVar[EventType]
    EVENT_TYPE_ROLLOUT_DONE: _ClassVar[EventType]
    EVENT_TYPE_ROLLOUT_FAILED: _ClassVar[EventType]
    EVENT_TYPE_ROLLOUT_ABORTED: _ClassVar[EventType]
    EVENT_TYPE_ROLLOUT_PROGRESS: _ClassVar[EventType]

class RolloutAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_ACTION_UNSPECIFIED: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_PAUSE: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_RESUME: _ClassVar[RolloutAction]
    ROLLOUT_ACTION_ABORT: _ClassVar[RolloutAction]

class RolloutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_STATUS_UNSPECIFIED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_PLANNED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_RUNNING: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_PAUSED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_ABORTED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_FAILED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_DONE: _ClassVar[RolloutStatus]

class RolloutNodeStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_NODE_STATUS_UNSPECIFIED: _ClassVar[RolloutNodeStatus]
    ROLLOUT_NODE_STATUS_PENDING: _ClassVar[RolloutNodeStatus]
    ROLLOUT_NODE_STATUS_SWITCHING: _ClassVar[RolloutNodeStatus]
    ROLLOUT_NODE_STATUS_SUCCEEDED: _ClassVar[RolloutNodeStatus]
    ROLLOUT_NODE_STATUS_ROLLED_BACK: _ClassVar[RolloutNodeStatus]
    ROLLOUT_NODE_STATUS_FAILED: _ClassVar[RolloutNodeStatus]
NODE_HEALTH_UNSPECIFIED: NodeHealth
NODE_HEALTH_READY: NodeHealth
NODE_HEALTH_SWITCHING: NodeHealth
NODE_HEALTH_LOST: NodeHealth
NODE_HEALTH_DRAINING: NodeHealth
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_TYPE_NODE_REGISTERED: EventType
EVENT_TYPE_NODE_LOST: EventType
EVENT_TYPE_SWITCH_PHASE: EventType
EVENT_TYPE_SWITCH_DONE: EventType
EVENT_TYPE_SWITCH_FAILED: EventType
EVENT_TYPE_SWITCH_ROLLED_BACK: EventType
EVENT_TYPE_SWITCH_ABORTED: EventType
EVENT_TYPE_RECOMMENDATION: EventType
EVENT_TYPE_NODE_DRAINING: EventType
EVENT_TYPE_REQUEST_RECOVERY: EventType
EVENT_TYPE_REQUEST_RECOVERED: EventType
EVENT_TYPE_ROLLOUT_PLANNED: EventType
EVENT_TYPE_ROLLOUT_WAVE: EventType
EVENT_TYPE_ROLLOUT_PAUSED: EventType
EVENT_TYPE_ROLLOUT_DONE: EventType
EVENT_TYPE_ROLLOUT_FAILED: EventType
EVENT_TYPE_ROLLOUT_ABORTED: EventType
EVENT_TYPE_ROLLOUT_PROGRESS: EventType
ROLLOUT_ACTION_UNSPECIFIED: RolloutAction
ROLLOUT_ACTION_PAUSE: RolloutAction
ROLLOUT_ACTION_RESUME: RolloutAction
ROLLOUT_ACTION_ABORT: RolloutAction
ROLLOUT_STATUS_UNSPECIFIED: RolloutStatus
ROLLOUT_STATUS_PLANNED: RolloutStatus
ROLLOUT_STATUS_RUNNING: RolloutStatus
ROLLOUT_STATUS_PAUSED: RolloutStatus
ROLLOUT_STATUS_ABORTED: RolloutStatus
ROLLOUT_STATUS_FAILED: RolloutStatus
ROLLOUT_STATUS_DONE: RolloutStatus
ROLLOUT_NODE_STATUS_UNSPECIFIED: RolloutNodeStatus
ROLLOUT_NODE_STATUS_PENDING: RolloutNodeStatus
ROLLOUT_NODE_STATUS_SWITCHING: RolloutNodeStatus
ROLLOUT_NODE_STATUS_SUCCEEDED: RolloutNodeStatus
ROLLOUT_NODE_STATUS_ROLLED_BACK: RolloutNodeStatus
ROLLOUT_NODE_STATUS_FAILED: RolloutNodeStatus

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node", "agent_address", "http_address", "topology", "candidates", "host", "model", "kv_bandwidth_bps", "weight_bandwidth_bps", "labels", "last_epoch")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LAST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent_address: str
    http_address: str
    topology: _types_pb2.Topology
    candidates: _containers.RepeatedCompositeFieldContainer[_types_pb2.Topology]
    host: _types_pb2.HostFacts
    model: _types_pb2.ModelFacts
    kv_bandwidth_bps: float
    weight_bandwidth_bps: float
    labels: _containers.ScalarMap[str, str]
    last_epoch: int
    def __init__(self, node: _Optional[str] = ..., agent_address: _Optional[str] = ..., http_address: _Optional[str] = ..., topology: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[_types_pb2.Topology, _Mapping]]] = ..., host: _Optional[_Union[_types_pb2.HostFacts, _Mapping]] = ..., model: _Optional[_Union[_types_pb2.ModelFacts, _Mapping]] = ..., kv_bandwidth_bps: _Optional[float] = ..., weight_bandwidth_bps: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., last_epoch: _Optional[int] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("lease_seconds", "epoch")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    epoch: int
    def __init__(self, lease_seconds: _Optional[float] = ..., epoch: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node", "topology", "engine_status", "traffic", "inflight", "topology_epoch", "workers")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATUS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_EPOCH_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    node: str
    topology: _types_pb2.Topology
    engine_status: _types_pb2.EngineStatus
    traffic: _types_pb2.TrafficSample
    inflight: _containers.RepeatedCompositeFieldContainer[InflightRequest]
    topology_epoch: int
    workers: _containers.RepeatedCompositeFieldContainer[_types_pb2.WorkerInfo]
    def __init__(self, node: _Optional[str] = ..., topology: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., engine_status: _Optional[_Union[_types_pb2.EngineStatus, str]] = ..., traffic: _Optional[_Union[_types_pb2.TrafficSample, _Mapping]] = ..., inflight: _Optional[_Iterable[_Union[InflightRequest, _Mapping]]] = ..., topology_epoch: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[_types_pb2.WorkerInfo, _Mapping]]] = ...) -> None: ...

class InflightRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "max_tokens", "temperature", "ignore_eos")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class DrainNodeRequest(_message.Message):
    __slots__ = ("node", "target_node", "slo_budget_seconds", "reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_NODE_FIELD_NUMBER: _ClassVar[int]
    SLO_BUDGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    target_node: str
    slo_budget_seconds: float
    reason: str
    def __init__(self, node: _Optional[str] = ..., target_node: _Optional[str] = ..., slo_budget_seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainNodeResponse(_message.Message):
    __slots__ = ("decisions",)
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[_types_pb2.RecoveryDecision]
    def __init__(self, decisions: _Optional[_Iterable[_Union[_types_pb2.RecoveryDecision, _Mapping]]] = ...) -> None: ...

class Recovery(_message.Message):
    __slots__ = ("request_id", "source_node", "target_node", "cause", "decision", "status", "tokens_before", "token_ids", "text", "finish_reason", "error", "at")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_NODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_NODE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_node: str
    target_node: str
    cause: str
    decision: _types_pb2.RecoveryDecision
    status: str
    tokens_before: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    error: str
    at: _timestamp_pb2.Timestamp
    def __init__(self, request_id: _Optional[str] = ..., source_node: _Optional[str] = ..., target_node: _Optional[str] = ..., cause: _Optional[str] = ..., decision: _Optional[_Union[_types_pb2.RecoveryDecision, _Mapping]] = ..., status: _Optional[str] = ..., tokens_before: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListRecoveriesRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class ListRecoveriesResponse(_message.Message):
    __slots__ = ("recoveries",)
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    recoveries: _containers.RepeatedCompositeFieldContainer[Recovery]
    def __init__(self, recoveries: _Optional[_Iterable[_Union[Recovery, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds",)
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    def __init__(self, lease_seconds: _Optional[float] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNodesResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeState]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeState, _Mapping]]] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("node", "agent_address", "http_address", "desired", "observed", "candidates", "health", "lease_age_seconds", "current_switch", "epoch", "stale", "host", "model", "recommendation", "labels", "rollout_id", "workers")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    LEASE_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_SWITCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDATION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent_address: str
    http_address: str
    desired: _types_pb2.Topology
    observed: _types_pb2.Topology
    candidates: _containers.RepeatedCompositeFieldContainer[_types_pb2.Topology]
    health: NodeHealth
    lease_age_seconds: float
    current_switch: _types_pb2.SwitchRecord
    epoch: int
    stale: bool
    host: _types_pb2.HostFacts
    model: _types_pb2.ModelFacts
    recommendation: str
    labels: _containers.ScalarMap[str, str]
    rollout_id: str
    workers: _containers.RepeatedCompositeFieldContainer[_types_pb2.WorkerInfo]
    def __init__(self, node: _Optional[str] = ..., agent_address: _Optional[str] = ..., http_address: _Optional[str] = ..., desired: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., observed: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[_types_pb2.Topology, _Mapping]]] = ..., health: _Optional[_Union[NodeHealth, str]] = ..., lease_age_seconds: _Optional[float] = ..., current_switch: _Optional[_Union[_types_pb2.SwitchRecord, _Mapping]] = ..., epoch: _Optional[int] = ..., stale: _Optional[bool] = ..., host: _Optional[_Union[_types_pb2.HostFacts, _Mapping]] = ..., model: _Optional[_Union[_types_pb2.ModelFacts, _Mapping]] = ..., recommendation: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., rollout_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[_types_pb2.WorkerInfo, _Mapping]]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("node", "target")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    node: str
    target: _types_pb2.Topology
    def __init__(self, node: _Optional[str] = ..., target: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("src_rank", "dst_rank", "layers", "kv_head_start", "kv_head_end", "kv_bytes")
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    src_rank: int
    dst_rank: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    kv_head_start: int
    kv_head_end: int
    kv_bytes: int
    def __init__(self, src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class ShardLoad(_message.Message):
    __slots__ = ("rank", "layers", "tp_rank", "tp_size", "weight_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    tp_rank: int
    tp_size: int
    weight_bytes: int
    def __init__(self, rank: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., weight_bytes: _Optional[int] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("node", "from_topology", "to_topology", "transfers", "shard_loads", "kv_bytes_total", "weight_bytes_total", "predicted", "predicted_total_seconds", "requests_to_preempt", "noop")
    NODE_FIELD_NUMBER: _ClassVar[int]
    FROM_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    TO_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TO_PREEMPT_FIELD_NUMBER: _ClassVar[int]
    NOOP_FIELD_NUMBER: _ClassVar[int]
    node: str
    from_topology: _types_pb2.Topology
    to_topology: _types_pb2.Topology
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    shard_loads: _containers.RepeatedCompositeFieldContainer[ShardLoad]
    kv_bytes_total: int
    weight_bytes_total: int
    predicted: _containers.RepeatedCompositeFieldContainer[_types_pb2.PhaseTiming]
    predicted_total_seconds: float
    requests_to_preempt: int
    noop: bool
    def __init__(self, node: _Optional[str] = ..., from_topology: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., to_topology: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ..., shard_loads: _Optional[_Iterable[_Union[ShardLoad, _Mapping]]] = ..., kv_bytes_total: _Optional[int] = ..., weight_bytes_total: _Optional[int] = ..., predicted: _Optional[_Iterable[_Union[_types_pb2.PhaseTiming, _Mapping]]] = ..., predicted_total_seconds: _Optional[float] = ..., requests_to_preempt: _Optional[int] = ..., noop: _Optional[bool] = ...) -> None: ...

class ReconfigureRequest(_message.Message):
    __slots__ = ("node", "target", "request_id", "reason")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node: str
    target: _types_pb2.Topology
    request_id: str
    reason: str
    def __init__(self, node: _Optional[str] = ..., target: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReconfigureResponse(_message.Message):
    __slots__ = ("switch_id", "noop", "duplicate")
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    NOOP_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    noop: bool
    duplicate: bool
    def __init__(self, switch_id: _Optional[str] = ..., noop: _Optional[bool] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("node", "switch_id", "include_history", "rollout_id", "after_id")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    node: str
    switch_id: str
    include_history: bool
    rollout_id: str
    after_id: str
    def __init__(self, node: _Optional[str] = ..., switch_id: _Optional[str] = ..., include_history: _Optional[bool] = ..., rollout_id: _Optional[str] = ..., after_id: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("id", "type", "node", "switch_id", "phase", "at", "record", "detail", "decision", "rollout_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    type: EventType
    node: str
    switch_id: str
    phase: _types_pb2.Phase
    at: _timestamp_pb2.Timestamp
    record: _types_pb2.SwitchRecord
    detail: str
    decision: _types_pb2.RecoveryDecision
    rollout_id: str
    def __init__(self, id: _Optional[str] = ..., type: _Optional[_Union[EventType, str]] = ..., node: _Optional[str] = ..., switch_id: _Optional[str] = ..., phase: _Optional[_Union[_types_pb2.Phase, str]] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., record: _Optional[_Union[_types_pb2.SwitchRecord, _Mapping]] = ..., detail: _Optional[str] = ..., decision: _Optional[_Union[_types_pb2.RecoveryDecision, _Mapping]] = ..., rollout_id: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("switch_id", "reason")
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    reason: str
    def __init__(self, switch_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted", "phase")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    phase: _types_pb2.Phase
    def __init__(self, aborted: _Optional[bool] = ..., phase: _Optional[_Union[_types_pb2.Phase, str]] = ...) -> None: ...

class GetSwitchRequest(_message.Message):
    __slots__ = ("switch_id",)
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    def __init__(self, switch_id: _Optional[str] = ...) -> None: ...

class ListSwitchesRequest(_message.Message):
    __slots__ = ("node", "page_size", "page_token")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    node: str
    page_size: int
    page_token: str
    def __init__(self, node: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListSwitchesResponse(_message.Message):
    __slots__ = ("switches", "next_page_token")
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    switches: _containers.RepeatedCompositeFieldContainer[_types_pb2.SwitchRecord]
    next_page_token: str
    def __init__(self, switches: _Optional[_Iterable[_Union[_types_pb2.SwitchRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetTrafficRequest(_message.Message):
    __slots__ = ("node", "since", "limit")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    node: str
    since: _timestamp_pb2.Timestamp
    limit: int
    def __init__(self, node: _Optional[str] = ..., since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., limit: _Optional[int] = ...) -> None: ...

class GetTrafficResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[_types_pb2.TrafficSample]
    def __init__(self, samples: _Optional[_Iterable[_Union[_types_pb2.TrafficSample, _Mapping]]] = ...) -> None: ...

class RecordRecommendationRequest(_message.Message):
    __slots__ = ("node", "recommended", "reason", "decision_id")
    NODE_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    node: str
    recommended: _types_pb2.Topology
    reason: str
    decision_id: str
    def __init__(self, node: _Optional[str] = ..., recommended: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., reason: _Optional[str] = ..., decision_id: _Optional[str] = ...) -> None: ...

class RecordRecommendationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutRequest(_message.Message):
    __slots__ = ("nodes", "labels", "target", "capacity_floor", "max_parallel", "capacity_rps", "request_id", "reason", "dry_run")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CapacityRpsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FLOOR_FIELD_NUMBER: _ClassVar[int]
    MAX_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_RPS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    target: _types_pb2.Topology
    capacity_floor: float
    max_parallel: int
    capacity_rps: _containers.ScalarMap[str, float]
    request_id: str
    reason: str
    dry_run: bool
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., target: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., capacity_floor: _Optional[float] = ..., max_parallel: _Optional[int] = ..., capacity_rps: _Optional[_Mapping[str, float]] = ..., request_id: _Optional[str] = ..., reason: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class RolloutResponse(_message.Message):
    __slots__ = ("rollout", "duplicate", "dry_run")
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    rollout: RolloutState
    duplicate: bool
    dry_run: bool
    def __init__(self, rollout: _Optional[_Union[RolloutState, _Mapping]] = ..., duplicate: _Optional[bool] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class GetRolloutRequest(_message.Message):
    __slots__ = ("rollout_id",)
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    def __init__(self, rollout_id: _Optional[str] = ...) -> None: ...

class ListRolloutsRequest(_message.Message):
    __slots__ = ("active_only", "limit")
    ACTIVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    active_only: bool
    limit: int
    def __init__(self, active_only: _Optional[bool] = ..., limit: _Optional[int] = ...) -> None: ...

class ListRolloutsResponse(_message.Message):
    __slots__ = ("rollouts",)
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[RolloutState]
    def __init__(self, rollouts: _Optional[_Iterable[_Union[RolloutState, _Mapping]]] = ...) -> None: ...

class ControlRolloutRequest(_message.Message):
    __slots__ = ("rollout_id", "action", "reason")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    action: RolloutAction
    reason: str
    def __init__(self, rollout_id: _Optional[str] = ..., action: _Optional[_Union[RolloutAction, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class RolloutWave(_message.Message):
    __slots__ = ("index", "nodes", "capacity_during", "capacity_after")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_DURING_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_AFTER_FIELD_NUMBER: _ClassVar[int]
    index: int
    nodes: _containers.RepeatedScalarFieldContainer[str]
    capacity_during: float
    capacity_after: float
    def __init__(self, index: _Optional[int] = ..., nodes: _Optional[_Iterable[str]] = ..., capacity_during: _Optional[float] = ..., capacity_after: _Optional[float] = ...) -> None: ...

class RolloutExcluded(_message.Message):
    __slots__ = ("node", "why")
    NODE_FIELD_NUMBER: _ClassVar[int]
    WHY_FIELD_NUMBER: _ClassVar[int]
    node: str
    why: str
    def __init__(self, node: _Optional[str] = ..., why: _Optional[str] = ...) -> None: ...

class RolloutPlan(_message.Message):
    __slots__ = ("target", "floor", "max_parallel", "base_capacity", "required_capacity", "waves", "skipped", "excluded")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    FLOOR_FIELD_NUMBER: _ClassVar[int]
    MAX_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    BASE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    REQUIRED_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    WAVES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    target: _types_pb2.Topology
    floor: float
    max_parallel: int
    base_capacity: float
    required_capacity: float
    waves: _containers.RepeatedCompositeFieldContainer[RolloutWave]
    skipped: _containers.RepeatedScalarFieldContainer[str]
    excluded: _containers.RepeatedCompositeFieldContainer[RolloutExcluded]
    def __init__(self, target: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., floor: _Optional[float] = ..., max_parallel: _Optional[int] = ..., base_capacity: _Optional[float] = ..., required_capacity: _Optional[float] = ..., waves: _Optional[_Iterable[_Union[RolloutWave, _Mapping]]] = ..., skipped: _Optional[_Iterable[str]] = ..., excluded: _Optional[_Iterable[_Union[RolloutExcluded, _Mapping]]] = ...) -> None: ...

class RolloutNodeProgress(_message.Message):
    __slots__ = ("node", "wave", "status", "switch_id", "outcome", "error")
    NODE_FIELD_NUMBER: _ClassVar[int]
    WAVE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    node: str
    wave: int
    status: RolloutNodeStatus
    switch_id: str
    outcome: _types_pb2.SwitchOutcome
    error: str
    def __init__(self, node: _Optional[str] = ..., wave: _Optional[int] = ..., status: _Optional[_Union[RolloutNodeStatus, str]] = ..., switch_id: _Optional[str] = ..., outcome: _Optional[_Union[_types_pb2.SwitchOutcome, str]] = ..., error: _Optional[str] = ...) -> None: ...

class RolloutState(_message.Message):
    __slots__ = ("rollout_id", "plan", "status", "wave", "nodes", "failed_node", "pause_requested", "abort_requested", "reason", "version", "request_id", "created_at", "capacity_rps", "description")
    class CapacityRpsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    WAVE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    FAILED_NODE_FIELD_NUMBER: _ClassVar[int]
    PAUSE_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    ABORT_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_RPS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    plan: RolloutPlan
    status: RolloutStatus
    wave: int
    nodes: _containers.RepeatedCompositeFieldContainer[RolloutNodeProgress]
    failed_node: str
    pause_requested: bool
    abort_requested: bool
    reason: str
    version: int
    request_id: str
    created_at: _timestamp_pb2.Timestamp
    capacity_rps: _containers.ScalarMap[str, float]
    description: str
    def __init__(self, rollout_id: _Optional[str] = ..., plan: _Optional[_Union[RolloutPlan, _Mapping]] = ..., status: _Optional[_Union[RolloutStatus, str]] = ..., wave: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[RolloutNodeProgress, _Mapping]]] = ..., failed_node: _Optional[str] = ..., pause_requested: _Optional[bool] = ..., abort_requested: _Optional[bool] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ..., request_id: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., capacity_rps: _Optional[_Mapping[str, float]] = ..., description: _Optional[str] = ...) -> None: ...
