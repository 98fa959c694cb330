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

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_OFF: _ClassVar[Mode]
    MODE_ADVISORY: _ClassVar[Mode]
    MODE_AUTO: _ClassVar[Mode]
MODE_UNSPECIFIED: Mode
MODE_OFF: Mode
MODE_ADVISORY: Mode
MODE_AUTO: Mode

class GetForecastRequest(_message.Message):
    __slots__ = ("node", "horizon_seconds")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HORIZON_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node: str
    horizon_seconds: float
    def __init__(self, node: _Optional[str] = ..., horizon_seconds: _Optional[float] = ...) -> None: ...

class ForecastPoint(_message.Message):
    __slots__ = ("at", "requests_per_second", "lower", "upper")
    AT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    at: _timestamp_pb2.Timestamp
    requests_per_second: float
    lower: float
    upper: float
    def __init__(self, at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., requests_per_second: _Optional[float] = ..., lower: _Optional[float] = ..., upper: _Optional[float] = ...) -> None: ...

class Forecast(_message.Message):
    __slots__ = ("node", "forecaster", "points", "observed", "backtest_mae")
    NODE_FIELD_NUMBER: _ClassVar[int]
    FORECASTER_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    BACKTEST_MAE_FIELD_NUMBER: _ClassVar[int]
    node: str
    forecaster: str
    points: _containers.RepeatedCompositeFieldContainer[ForecastPoint]
    observed: _containers.RepeatedCompositeFieldContainer[_types_pb2.TrafficSample]
    backtest_mae: float
    def __init__(self, node: _Optional[str] = ..., forecaster: _Optional[str] = ..., points: _Optional[_Iterable[_Union[ForecastPoint, _Mapping]]] = ..., observed: _Optional[_Iterable[_Union[_types_pb2.TrafficSample, _Mapping]]] = ..., backtest_mae: _Optional[float] = ...) -> None: ...

class GetRecommendationRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class CandidateScore(_message.Message):
    __slots__ = ("topology", "expected_goodput", "switch_cost", "score", "expected_slo_loss", "slo_capacity_rps", "gpus")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GOODPUT_FIELD_NUMBER: _ClassVar[int]
    SWITCH_COST_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SLO_LOSS_FIELD_NUMBER: _ClassVar[int]
    SLO_CAPACITY_RPS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    topology: _types_pb2.Topology
    expected_goodput: float
    switch_cost: float
    score: float
    expected_slo_loss: float
    slo_capacity_rps: float
    gpus: int
    def __init__(self, topology: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., expected_goodput: _Optional[float] = ..., switch_cost: _Optional[float] = ..., score: _Optional[float] = ..., expected_slo_loss: _Optional[float] = ..., slo_capacity_rps: _Optional[float] = ..., gpus: _Optional[int] = ...) -> None: ...

class Recommendation(_message.Message):
    __slots__ = ("node", "current", "recommended", "switch", "reason", "scores", "at", "objective", "profile", "expected_saving_gpu_hours", "saving_horizon_seconds", "expected_slo_loss", "overload_risk", "gpus", "host_gpus", "released_gpus", "error_budget_requests", "expected_tpot_saving_ms", "forecaster", "forecast_rps", "decision_id", "unreleased_gpus")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_FIELD_NUMBER: _ClassVar[int]
    SWITCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SAVING_GPU_HOURS_FIELD_NUMBER: _ClassVar[int]
    SAVING_HORIZON_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SLO_LOSS_FIELD_NUMBER: _ClassVar[int]
    OVERLOAD_RISK_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    HOST_GPUS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_GPUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_BUDGET_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_TPOT_SAVING_MS_FIELD_NUMBER: _ClassVar[int]
    FORECASTER_FIELD_NUMBER: _ClassVar[int]
    FORECAST_RPS_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    UNRELEASED_GPUS_FIELD_NUMBER: _ClassVar[int]
    node: str
    current: _types_pb2.Topology
    recommended: _types_pb2.Topology
    switch: bool
    reason: str
    scores: _containers.RepeatedCompositeFieldContainer[CandidateScore]
    at: _timestamp_pb2.Timestamp
    objective: str
    profile: str
    expected_saving_gpu_hours: float
    saving_horizon_seconds: float
    expected_slo_loss: float
    overload_risk: float
    gpus: int
    host_gpus: int
    released_gpus: _containers.RepeatedScalarFieldContainer[int]
    error_budget_requests: float
    expected_tpot_saving_ms: float
    forecaster: str
    forecast_rps: float
    decision_id: str
    unreleased_gpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node: _Optional[str] = ..., current: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., recommended: _Optional[_Union[_types_pb2.Topology, _Mapping]] = ..., switch: _Optional[bool] = ..., reason: _Optional[str] = ..., scores: _Optional[_Iterable[_Union[CandidateScore, _Mapping]]] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., objective: _Optional[str] = ..., profile: _Optional[str] = ..., expected_saving_gpu_hours: _Optional[float] = ..., saving_horizon_seconds: _Optional[float] = ..., expected_slo_loss: _Optional[float] = ..., overload_risk: _Optional[float] = ..., gpus: _Optional[int] = ..., host_gpus: _Optional[int] = ..., released_gpus: _Optional[_Iterable[int]] = ..., error_budget_requests: _Optional[float] = ..., expected_tpot_saving_ms: _Optional[float] = ..., forecaster: _Optional[str] = ..., forecast_rps: _Optional[float] = ..., decision_id: _Optional[str] = ..., unreleased_gpus: _Optional[_Iterable[int]] = ...) -> None: ...

class SetModeRequest(_message.Message):
    __slots__ = ("mode", "node")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    node: str
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., node: _Optional[str] = ...) -> None: ...

class SetModeResponse(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ...) -> None: ...

class ListDecisionsRequest(_message.Message):
    __slots__ = ("node", "page_size", "page_token")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    node: str
    page_size: int
    page_token: str
    def __init__(self, node: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("id", "recommendation", "mode", "switch_id", "outcome")
    ID_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDATION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SWITCH_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    id: str
    recommendation: Recommendation
    mode: Mode
    switch_id: str
    outcome: str
    def __init__(self, id: _Optional[str] = ..., recommendation: _Optional[_Union[Recommendation, _Mapping]] = ..., mode: _Optional[_Union[Mode, str]] = ..., switch_id: _Optional[str] = ..., outcome: _Optional[str] = ...) -> None: ...

class ListDecisionsResponse(_message.Message):
    __slots__ = ("decisions", "next_page_token")
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    next_page_token: str
    def __init__(self, decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
