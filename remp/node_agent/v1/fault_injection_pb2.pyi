from remp.common.v1 import types_pb2 as _types_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArmSwitchRequest(_message.Message):
    __slots__ = ("switch_id", "fail_at_phase", "skip_kv_migration", "start_when_running")
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    FAIL_AT_PHASE_FIELD_NUMBER: _ClassVar[int]
    SKIP_KV_MIGRATION_FIELD_NUMBER: _ClassVar[int]
    START_WHEN_RUNNING_FIELD_NUMBER: _ClassVar[int]
    switch_id: str
    fail_at_phase: _types_pb2.Phase
    skip_kv_migration: bool
    start_when_running: int
    def __init__(self, switch_id: _Optional[str] = ..., fail_at_phase: _Optional[_Union[_types_pb2.Phase, str]] = ..., skip_kv_migration: _Optional[bool] = ..., start_when_running: _Optional[int] = ...) -> None: ...

class ArmSwitchResponse(_message.Message):
    __slots__ = ("armed",)
    ARMED_FIELD_NUMBER: _ClassVar[int]
    armed: int
    def __init__(self, armed: _Optional[int] = ...) -> None: ...

class ArmMigrationRequest(_message.Message):
    __slots__ = ("request_id", "poison_kv", "wait_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POISON_KV_FIELD_NUMBER: _ClassVar[int]
    WAIT_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    poison_kv: bool
    wait_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., poison_kv: _Optional[bool] = ..., wait_output_tokens: _Optional[int] = ...) -> None: ...

class ArmMigrationResponse(_message.Message):
    __slots__ = ("armed",)
    ARMED_FIELD_NUMBER: _ClassVar[int]
    armed: int
    def __init__(self, armed: _Optional[int] = ...) -> None: ...

class DisarmRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DisarmResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...
