"""Pydantic models of the HTTP edge: they document the API (OpenAPI at /docs) and validate the small bodies.

The hot paths (bulk predictions, training data) do not build these per row: `leadtime.predictor.service.rows`
checks the same rules column-wise, an order of magnitude faster. Their request schemas are attached to the
OpenAPI document by `body_schema`, so /docs shows exactly what those handlers accept.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class LlmdRow(BaseModel):
    """One candidate as llm-d's router sends it; unknown fields are ignored (Leadtime's extras ride along)."""

    model_config = ConfigDict(extra="allow")

    kv_cache_percentage: float = Field(..., ge=0.0, le=1.0)
    input_token_length: int = Field(..., ge=0)
    num_request_waiting: int = Field(..., ge=0)
    num_request_running: int = Field(..., ge=0)
    num_tokens_generated: int = Field(..., ge=0)
    prefix_cache_score: float = Field(..., ge=0.0, le=1.0)
    pod_type: Literal["", "prefill", "decode"] = ""
    prefill_tokens_in_flight: int = Field(default=0, ge=0)
    decode_tokens_in_flight: int = Field(default=0, ge=0)
    encoder_matched_size: int = Field(default=0, ge=0)
    encoder_input_size: int = Field(default=0, ge=0)


class NativeRow(LlmdRow):
    """Leadtime's richer row: the llm-d fields plus what a mixed, disaggregated, time-sliced fleet needs."""

    endpoint_id: str = ""
    accelerator: str = Field(default="", description="Accelerator class, e.g. h100-sxm; empty = the service default.")
    model: str = Field(default="", description="Model profile, e.g. llama-3.1-8b; empty = the service default.")
    tensor_parallel: int = Field(default=1, ge=1)
    prefix_hit_tokens: int | None = Field(default=None, ge=0, description="Overrides prefix_cache_score when given.")
    role: Literal["both", "prefill", "decode"] | None = Field(default=None, description="Used when pod_type is absent.")
    timeslice_state: Literal["none", "resident", "switching", "parked"] = "none"
    timeslice_wait_ms: float = Field(default=0.0, ge=0.0)


class TrainingEntry(LlmdRow):
    """One observed sample as llm-d's router posts it: the row and what happened."""

    actual_ttft_ms: float = Field(..., ge=0.0, description="0 = TTFT not observed in this sample.")
    actual_tpot_ms: float = Field(..., ge=0.0, description="0 = TPOT not observed in this sample.")
    timestamp: float | str | None = None


class NativeObservation(NativeRow):
    """A completed request: Leadtime's row, what happened, and what had been predicted."""

    actual_ttft_ms: float = Field(..., ge=0.0, description="0 = TTFT not observed.")
    actual_tpot_ms: float = Field(..., ge=0.0, description="0 = TPOT not observed.")
    predicted_ttft_ms: float | None = Field(default=None, description="Mean TTFT the decision was made with.")
    predicted_tpot_ms: float | None = None
    predicted_ttft_quantile_ms: float | None = Field(default=None, description="Upper-quantile TTFT predicted.")
    predicted_tpot_quantile_ms: float | None = None
    timestamp: float | str | None = None


class BulkPredictRequest(BaseModel):
    """llm-d's bulk prediction body."""

    requests: list[LlmdRow] = Field(..., min_length=1, max_length=10_000)


class TrainingBatch(BaseModel):
    """llm-d's training body."""

    entries: list[TrainingEntry]


class NativePredictRequest(BaseModel):
    """The native API's prediction body."""

    rows: list[NativeRow] = Field(..., min_length=1, max_length=10_000)


class NativeObservationBatch(BaseModel):
    """The native API's observation body."""

    observations: list[NativeObservation] = Field(..., min_length=1)


class PredictionAnswer(BaseModel):
    """One llm-d prediction answer."""

    ttft_ms: float
    tpot_ms: float
    predicted_at: str
    model_type: str = "lightgbm"
    objective_type: Literal["quantile", "mean"]
    quantile: float
    last_model_load: str | None


class BulkPredictionError(BaseModel):
    """Why one row of /predict/bulk got no prediction."""

    index: int
    error: str


class BulkPredictAnswer(BaseModel):
    """llm-d's bulk answer: predictions in request order, and counts."""

    predictions: list[PredictionAnswer | None]
    errors: list[BulkPredictionError] = []
    total_requests: int
    successful_predictions: int
    failed_predictions: int
    processing_time_ms: float


class AcceptedAnswer(BaseModel):
    """llm-d's 202 answer to a training batch."""

    message: str


class NativePredictAnswer(BaseModel):
    """Columnar: element i of every list answers row i."""

    model_version: int
    quantile: float
    predicted_at: str
    ttft_mean_ms: list[float]
    ttft_quantile_ms: list[float]
    tpot_mean_ms: list[float]
    tpot_quantile_ms: list[float]


class NativeAccepted(BaseModel):
    """How many observations the native API accepted."""

    accepted: int


class FlushRequest(BaseModel):
    """What /flush empties (everything by default) and why."""

    model_config = ConfigDict(extra="forbid")

    flush_training_data: bool = True
    flush_test_data: bool = True
    flush_metrics: bool = True
    reason: str | None = None


class ExplainRequest(BaseModel):
    """The row /v1/explain explains."""

    row: NativeRow


def body_schema(model: type[BaseModel], list_field: str, item: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI requestBody for a handler that parses its body itself: {list_field: [item, ...]}."""
    item_schema = item.model_json_schema()
    outer = model.model_json_schema()
    prop = dict(outer["properties"][list_field])
    prop["items"] = item_schema
    schema = {"type": "object", "required": [list_field], "properties": {list_field: prop}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
