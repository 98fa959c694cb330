from remp.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecoveryMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECOVERY_MODE_UNSPECIFIED: _ClassVar[RecoveryMode]
    RECOVERY_MODE_MIGRATE: _ClassVar[RecoveryMode]
    RECOVERY_MODE_RECOMPUTE: _ClassVar[RecoveryMode]

class KvInt8Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_INT8_MODE_UNSPECIFIED: _ClassVar[KvInt8Mode]
    KV_INT8_MODE_OFF: _ClassVar[KvInt8Mode]
    KV_INT8_MODE_ON: _ClassVar[KvInt8Mode]
    KV_INT8_MODE_AUTO: _ClassVar[KvInt8Mode]

class KvFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_FORMAT_UNSPECIFIED: _ClassVar[KvFormat]
    KV_FORMAT_FULL: _ClassVar[KvFormat]
    KV_FORMAT_INT8: _ClassVar[KvFormat]
RECOVERY_MODE_UNSPECIFIED: RecoveryMode
RECOVERY_MODE_MIGRATE: RecoveryMode
RECOVERY_MODE_RECOMPUTE: RecoveryMode
KV_INT8_MODE_UNSPECIFIED: KvInt8Mode
KV_INT8_MODE_OFF: KvInt8Mode
KV_INT8_MODE_ON: KvInt8Mode
KV_INT8_MODE_AUTO: KvInt8Mode
KV_FORMAT_UNSPECIFIED: KvFormat
KV_FORMAT_FULL: KvFormat
KV_FORMAT_INT8: KvFormat

class SetDrainingRequest(_message.Message):
    __slots__ = ("draining", "retry_after_seconds")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    retry_after_seconds: int
    def __init__(self, draining: _Optional[bool] = ..., retry_after_seconds: _Optional[int] = ...) -> None: ...

class SetDrainingResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("exact",)
    EXACT_FIELD_NUMBER: _ClassVar[int]
    exact: bool
    def __init__(self, exact: _Optional[bool] = ...) -> None: ...

class RequestInfo(_message.Message):
    __slots__ = ("request_id", "status", "prompt_tokens", "output_tokens", "max_tokens", "blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    blocks: int
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInfo]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestInfo, _Mapping]]] = ...) -> None: ...

class MigrateRequestRequest(_message.Message):
    __slots__ = ("request_id", "target_address", "mode", "bandwidth_limit_bps", "slo_budget_seconds", "target_node", "kv_int8")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_LIMIT_BPS_FIELD_NUMBER: _ClassVar[int]
    SLO_BUDGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_NODE_FIELD_NUMBER: _ClassVar[int]
    KV_INT8_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target_address: str
    mode: RecoveryMode
    bandwidth_limit_bps: float
    slo_budget_seconds: float
    target_node: str
    kv_int8: KvInt8Mode
    def __init__(self, request_id: _Optional[str] = ..., target_address: _Optional[str] = ..., mode: _Optional[_Union[RecoveryMode, str]] = ..., bandwidth_limit_bps: _Optional[float] = ..., slo_budget_seconds: _Optional[float] = ..., target_node: _Optional[str] = ..., kv_int8: _Optional[_Union[KvInt8Mode, str]] = ...) -> None: ...

class MigrateRequestEvent(_message.Message):
    __slots__ = ("decision", "token_ids", "text", "finished", "finish_reason", "transfer_seconds", "export_seconds", "receive_seconds", "kv_format", "payload_bytes")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPORT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    decision: _types_pb2.RecoveryDecision
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    transfer_seconds: float
    export_seconds: float
    receive_seconds: float
    kv_format: KvFormat
    payload_bytes: int
    def __init__(self, decision: _Optional[_Union[_types_pb2.RecoveryDecision, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., transfer_seconds: _Optional[float] = ..., export_seconds: _Optional[float] = ..., receive_seconds: _Optional[float] = ..., kv_format: _Optional[_Union[KvFormat, str]] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class ImportHeader(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "max_tokens", "temperature", "ignore_eos", "kv_bytes", "block_size", "kv_format")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    kv_bytes: int
    block_size: int
    kv_format: KvFormat
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., ignore_eos: _Optional[bool] = ..., kv_bytes: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_format: _Optional[_Union[KvFormat, str]] = ...) -> None: ...

class ImportChunk(_message.Message):
    __slots__ = ("header", "kv")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    header: ImportHeader
    kv: bytes
    def __init__(self, header: _Optional[_Union[ImportHeader, _Mapping]] = ..., kv: _Optional[bytes] = ...) -> None: ...

class ImportEvent(_message.Message):
    __slots__ = ("token_ids", "text", "finished", "finish_reason", "loaded_tokens", "receive_seconds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    loaded_tokens: int
    receive_seconds: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., loaded_tokens: _Optional[int] = ..., receive_seconds: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("node", "host", "model", "topology", "candidates", "engine_status", "vllm_version", "agent_version", "http_address", "workers", "current_switch_id", "world_size", "engine")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATUS_FIELD_NUMBER: _ClassVar[int]
    VLLM_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    node: str
    host: _types_pb2.HostFacts
    model: _types_pb2.ModelFacts
    topology: _types_pb2.Topology
    candidates: _containers.RepeatedCompositeFieldContainer[_types_pb2.Topology]
    engine_status: _types_pb2.EngineStatus
    vllm_version: str
    agent_version: str
    http_address: str
    workers: _containers.RepeatedCompositeFieldContainer[_types_pb2.WorkerInfo]
    current_switch_id: str
    world_size: int
    engine: EngineInfo
    def __init__(self, node: _Optional[str] = ..., host: _Optional[_Union[_types_pb2.HostFacts, _Mapping]] = ..., model: _Optional[_Union[_types_pb2.ModelFacts, _Mapping]] = ..., topology: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[_types_pb2.Topology, _Mapping]]] = ..., engine_status: _Optional[_Union[_types_pb2.EngineStatus, str]] = ..., vllm_version: _Optional[str] = ..., agent_version: _Optional[str] = ..., http_address: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[_types_pb2.WorkerInfo, _Mapping]]] = ..., current_switch_id: _Optional[str] = ..., world_size: _Optional[int] = ..., engine: _Optional[_Union[EngineInfo, _Mapping]] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("num_blocks", "free_blocks", "block_size", "running", "waiting", "engine_core_pid")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CORE_PID_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    free_blocks: int
    block_size: int
    running: int
    waiting: int
    engine_core_pid: int
    def __init__(self, num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., engine_core_pid: _Optional[int] = ...) -> None: ...

class ExecuteSwitchRequest(_message.Message):
    __slots__ = ("target", "switch_id", "epoch", "reason", "sequential_data_path")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SEQUENTIAL_DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    target: _types_pb2.Topology
    switch_id: str
    epoch: int
    reason: str
    sequential_data_path: bool
    def __init__(self, target: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., switch_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ..., sequential_data_path: _Optional[bool] = ...) -> None: ...

class SwitchEvent(_message.Message):
    __slots__ = ("switch_id", "phase", "elapsed_seconds", "record", "error", "detail")
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    phase: _types_pb2.Phase
    elapsed_seconds: float
    record: _types_pb2.SwitchRecord
    error: _types_pb2.Error
    detail: str
    def __init__(self, switch_id: _Optional[str] = ..., phase: _Optional[_Union[_types_pb2.Phase, str]] = ..., elapsed_seconds: _Optional[float] = ..., record: _Optional[_Union[_types_pb2.SwitchRecord, _Mapping]] = ..., error: _Optional[_Union[_types_pb2.Error, _Mapping]] = ..., detail: _Optional[str] = ...) -> None: ...

class GetSwitchRequest(_message.Message):
    __slots__ = ("switch_id",)
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    def __init__(self, switch_id: _Optional[str] = ...) -> None: ...

class GetSwitchResponse(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: _types_pb2.SwitchRecord
    def __init__(self, record: _Optional[_Union[_types_pb2.SwitchRecord, _Mapping]] = ...) -> None: ...

class AbortSwitchRequest(_message.Message):
    __slots__ = ("switch_id", "reason")
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    reason: str
    def __init__(self, switch_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortSwitchResponse(_message.Message):
    __slots__ = ("aborted", "phase")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    phase: _types_pb2.Phase
    def __init__(self, aborted: _Optional[bool] = ..., phase: _Optional[_Union[_types_pb2.Phase, str]] = ...) -> None: ...
