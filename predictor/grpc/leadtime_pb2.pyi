# ruff: noqa
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Row(_message.Message):
    __slots__ = ("kv_cache_percentage", "input_token_length", "num_request_waiting", "num_request_running", "num_tokens_generated", "prefix_cache_score", "pod_type", "prefill_tokens_in_flight", "decode_tokens_in_flight", "encoder_matched_size", "encoder_input_size", "endpoint_id", "accelerator", "model", "tensor_parallel", "prefix_hit_tokens", "timeslice_state", "timeslice_wait_ms")
    KV_CACHE_PERCENTAGE_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUEST_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUEST_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_SCORE_FIELD_NUMBER: _ClassVar[int]
    POD_TYPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENCODER_MATCHED_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENCODER_INPUT_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMESLICE_STATE_FIELD_NUMBER: _ClassVar[int]
    TIMESLICE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    kv_cache_percentage: float
    input_token_length: int
    num_request_waiting: int
    num_request_running: int
    num_tokens_generated: int
    prefix_cache_score: float
    pod_type: str
    prefill_tokens_in_flight: int
    decode_tokens_in_flight: int
    encoder_matched_size: int
    encoder_input_size: int
    endpoint_id: str
    accelerator: str
    model: str
    tensor_parallel: int
    prefix_hit_tokens: int
    timeslice_state: str
    timeslice_wait_ms: float
    def __init__(self, kv_cache_percentage: _Optional[float] = ..., input_token_length: _Optional[int] = ..., num_request_waiting: _Optional[int] = ..., num_request_running: _Optional[int] = ..., num_tokens_generated: _Optional[int] = ..., prefix_cache_score: _Optional[float] = ..., pod_type: _Optional[str] = ..., prefill_tokens_in_flight: _Optional[int] = ..., decode_tokens_in_flight: _Optional[int] = ..., encoder_matched_size: _Optional[int] = ..., encoder_input_size: _Optional[int] = ..., endpoint_id: _Optional[str] = ..., accelerator: _Optional[str] = ..., model: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., timeslice_state: _Optional[str] = ..., timeslice_wait_ms: _Optional[float] = ...) -> None: ...

class RowColumns(_message.Message):
    __slots__ = ("kv_cache_percentage", "input_token_length", "num_request_waiting", "num_request_running", "num_tokens_generated", "prefix_cache_score", "pod_type", "prefill_tokens_in_flight", "decode_tokens_in_flight", "encoder_matched_size", "encoder_input_size", "endpoint_id", "accelerator", "model", "tensor_parallel", "prefix_hit_tokens", "timeslice_state", "timeslice_wait_ms")
    KV_CACHE_PERCENTAGE_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUEST_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUEST_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_SCORE_FIELD_NUMBER: _ClassVar[int]
    POD_TYPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENCODER_MATCHED_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENCODER_INPUT_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    ACCELERATOR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMESLICE_STATE_FIELD_NUMBER: _ClassVar[int]
    TIMESLICE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    kv_cache_percentage: _containers.RepeatedScalarFieldContainer[float]
    input_token_length: _containers.RepeatedScalarFieldContainer[int]
    num_request_waiting: _containers.RepeatedScalarFieldContainer[int]
    num_request_running: _containers.RepeatedScalarFieldContainer[int]
    num_tokens_generated: _containers.RepeatedScalarFieldContainer[int]
    prefix_cache_score: _containers.RepeatedScalarFieldContainer[float]
    pod_type: _containers.RepeatedScalarFieldContainer[str]
    prefill_tokens_in_flight: _containers.RepeatedScalarFieldContainer[int]
    decode_tokens_in_flight: _containers.RepeatedScalarFieldContainer[int]
    encoder_matched_size: _containers.RepeatedScalarFieldContainer[int]
    encoder_input_size: _containers.RepeatedScalarFieldContainer[int]
    endpoint_id: _containers.RepeatedScalarFieldContainer[str]
    accelerator: _containers.RepeatedScalarFieldContainer[str]
    model: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel: _containers.RepeatedScalarFieldContainer[int]
    prefix_hit_tokens: _containers.RepeatedScalarFieldContainer[int]
    timeslice_state: _containers.RepeatedScalarFieldContainer[str]
    timeslice_wait_ms: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, kv_cache_percentage: _Optional[_Iterable[float]] = ..., input_token_length: _Optional[_Iterable[int]] = ..., num_request_waiting: _Optional[_Iterable[int]] = ..., num_request_running: _Optional[_Iterable[int]] = ..., num_tokens_generated: _Optional[_Iterable[int]] = ..., prefix_cache_score: _Optional[_Iterable[float]] = ..., pod_type: _Optional[_Iterable[str]] = ..., prefill_tokens_in_flight: _Optional[_Iterable[int]] = ..., decode_tokens_in_flight: _Optional[_Iterable[int]] = ..., encoder_matched_size: _Optional[_Iterable[int]] = ..., encoder_input_size: _Optional[_Iterable[int]] = ..., endpoint_id: _Optional[_Iterable[str]] = ..., accelerator: _Optional[_Iterable[str]] = ..., model: _Optional[_Iterable[str]] = ..., tensor_parallel: _Optional[_Iterable[int]] = ..., prefix_hit_tokens: _Optional[_Iterable[int]] = ..., timeslice_state: _Optional[_Iterable[str]] = ..., timeslice_wait_ms: _Optional[_Iterable[float]] = ...) -> None: ...

class PredictBulkRequest(_message.Message):
    __slots__ = ("rows", "columns")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[Row]
    columns: RowColumns
    def __init__(self, rows: _Optional[_Iterable[_Union[Row, _Mapping]]] = ..., columns: _Optional[_Union[RowColumns, _Mapping]] = ...) -> None: ...

class PredictBulkResponse(_message.Message):
    __slots__ = ("ttft_mean_ms", "ttft_quantile_ms", "tpot_mean_ms", "tpot_quantile_ms", "model_version", "quantile", "objective_type")
    TTFT_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_QUANTILE_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_QUANTILE_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUANTILE_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_TYPE_FIELD_NUMBER: _ClassVar[int]
    ttft_mean_ms: _containers.RepeatedScalarFieldContainer[float]
    ttft_quantile_ms: _containers.RepeatedScalarFieldContainer[float]
    tpot_mean_ms: _containers.RepeatedScalarFieldContainer[float]
    tpot_quantile_ms: _containers.RepeatedScalarFieldContainer[float]
    model_version: int
    quantile: float
    objective_type: str
    def __init__(self, ttft_mean_ms: _Optional[_Iterable[float]] = ..., ttft_quantile_ms: _Optional[_Iterable[float]] = ..., tpot_mean_ms: _Optional[_Iterable[float]] = ..., tpot_quantile_ms: _Optional[_Iterable[float]] = ..., model_version: _Optional[int] = ..., quantile: _Optional[float] = ..., objective_type: _Optional[str] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("row", "actual_ttft_ms", "actual_tpot_ms", "predicted_ttft_ms", "predicted_tpot_ms", "predicted_ttft_quantile_ms", "predicted_tpot_quantile_ms", "timestamp")
    ROW_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_QUANTILE_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_QUANTILE_MS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    row: Row
    actual_ttft_ms: float
    actual_tpot_ms: float
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    predicted_ttft_quantile_ms: float
    predicted_tpot_quantile_ms: float
    timestamp: float
    def __init__(self, row: _Optional[_Union[Row, _Mapping]] = ..., actual_ttft_ms: _Optional[float] = ..., actual_tpot_ms: _Optional[float] = ..., predicted_ttft_ms: _Optional[float] = ..., predicted_tpot_ms: _Optional[float] = ..., predicted_ttft_quantile_ms: _Optional[float] = ..., predicted_tpot_quantile_ms: _Optional[float] = ..., timestamp: _Optional[float] = ...) -> None: ...

class ObserveRequest(_message.Message):
    __slots__ = ("observations",)
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    observations: _containers.RepeatedCompositeFieldContainer[Observation]
    def __init__(self, observations: _Optional[_Iterable[_Union[Observation, _Mapping]]] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("is_ready", "model_version", "objective_type", "quantile", "last_model_load", "role", "holds_training_lease", "components", "observations")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ObservationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    IS_READY_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_TYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTILE_FIELD_NUMBER: _ClassVar[int]
    LAST_MODEL_LOAD_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOLDS_TRAINING_LEASE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    is_ready: bool
    model_version: int
    objective_type: str
    quantile: float
    last_model_load: str
    role: str
    holds_training_lease: bool
    components: _containers.ScalarMap[str, str]
    observations: _containers.ScalarMap[str, int]
    def __init__(self, is_ready: _Optional[bool] = ..., model_version: _Optional[int] = ..., objective_type: _Optional[str] = ..., quantile: _Optional[float] = ..., last_model_load: _Optional[str] = ..., role: _Optional[str] = ..., holds_training_lease: _Optional[bool] = ..., components: _Optional[_Mapping[str, str]] = ..., observations: _Optional[_Mapping[str, int]] = ...) -> None: ...
