from remp.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
    __slots__ = ("target", "switch_id", "epoch", "reason", "sequential_data_path", "fail_at_phase", "test_skip_kv_migration", "test_start_when_running")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SEQUENTIAL_DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    FAIL_AT_PHASE_FIELD_NUMBER: _ClassVar[int]
    TEST_SKIP_KV_MIGRATION_FIELD_NUMBER: _ClassVar[int]
    TEST_START_WHEN_RUNNING_FIELD_NUMBER: _ClassVar[int]
    target: _types_pb2.Topology
    switch_id: str
    epoch: int
    reason: str
    sequential_data_path: bool
    fail_at_phase: _types_pb2.Phase
    test_skip_kv_migration: bool
    test_start_when_running: int
    def __init__(self, target: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., switch_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ..., sequential_data_path: _Optional[bool] = ..., fail_at_phase: _Optional[_Union[_types_pb2.Phase, str]] = ..., test_skip_kv_migration: _Optional[bool] = ..., test_start_when_running: _Optional[int] = ...) -> None: ...

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
