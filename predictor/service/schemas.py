"""Pydantic models of the HTTP edge: they document the API (OpenAPI at /docs) and validate the small bodies.

The hot paths (bulk predictions, training data) do not build these per row: `leadtime.predictor.service.rows`
checks the same rules column-wise, an order of magnitude faster. Their request schemas are attached to the
OpenAPI document by `body_schema`, so /docs shows exactly what those handlers accept.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, JsonValue

from leadtime.features.catalog import ACCELERATORS, MODELS, Catalog
from leadtime.features.rows import LATEST_TIMESTAMP, MAX_COUNT, MAX_PREDICTED_MS, MAX_TENSOR_PARALLEL
from leadtime.predictor.service.rows import ROW_EXTRAS

TIMESTAMP_HELP = (
    "When the request completed: seconds since the epoch (milliseconds above 2e10, as pydantic reads numbers), or "
    "RFC 3339 (an offset-less time is UTC)."
)
Timestamp = Annotated[float, Field(ge=-LATEST_TIMESTAMP, le=LATEST_TIMESTAMP)]


def text_choices(slugs: Iterable[str]) -> list[JsonValue]:
    """The values a row's accelerator or model may take: a slug, or empty or null for the service default."""
    return ["", *sorted(slugs), None]


class LlmdRow(BaseModel):
    """One candidate as llm-d's router sends it; unknown fields are ignored (Leadtime's extras ride along)."""

    model_config = ConfigDict(extra="allow")

    kv_cache_percentage: float = Field(..., ge=0.0, le=1.0)
    input_token_length: int = Field(..., ge=0, le=MAX_COUNT)
    num_request_waiting: int = Field(..., ge=0, le=MAX_COUNT)
    num_request_running: int = Field(..., ge=0, le=MAX_COUNT)
    num_tokens_generated: int = Field(..., ge=0, le=MAX_COUNT)
    prefix_cache_score: float = Field(..., ge=0.0, le=1.0)
    pod_type: Literal["", "both", "prefill", "decode"] | None = Field(
        default="", description="null, '' or 'both' = unified."
    )
    prefill_tokens_in_flight: int = Field(default=0, ge=0, le=MAX_COUNT)
    decode_tokens_in_flight: int = Field(default=0, ge=0, le=MAX_COUNT)
    encoder_matched_size: int = Field(default=0, ge=0, le=MAX_COUNT)
    encoder_input_size: int = Field(default=0, ge=0, le=MAX_COUNT)


class NativeRow(LlmdRow):
    """Leadtime's richer row: the llm-d fields plus what a mixed, disaggregated, time-sliced fleet needs. Unlike
    llm-d's rows, a field it does not know is refused (`native.refuse_unknown_fields`): it is a slip, not an extra."""

    model_config = ConfigDict(extra="forbid")

    # The three text fields may be null, read as empty (the service default), as the parser reads them (`rows._text`).
    endpoint_id: str | None = Field(default="", description="null = empty.")
    # Documented as the catalog's slugs (the parser refuses any other with 422 naming the known ones); not a Literal,
    # so that /v1/explain's pydantic check leaves that message to the parser. A service with its own catalog
    # documents its slugs instead (`document_catalog`).
    accelerator: str | None = Field(
        default="",
        description="Accelerator class; empty or null = the service default.",
        json_schema_extra={"enum": text_choices(ACCELERATORS)},
    )
    model: str | None = Field(
        default="",
        description="Model profile; empty or null = the service default.",
        json_schema_extra={"enum": text_choices(MODELS)},
    )
    tensor_parallel: int = Field(default=1, ge=1, le=MAX_TENSOR_PARALLEL)
    prefix_hit_tokens: int | None = Field(
        default=None,
        ge=0,
        le=MAX_COUNT,
        description="Overrides prefix_cache_score when given; at most input_token_length (422 otherwise).",
    )
    role: Literal["both", "prefill", "decode"] | None = Field(
        default=None, description="Used when pod_type is unset (absent, null or ''); refused when it disagrees."
    )
    timeslice_state: Literal["", "none", "resident", "switching", "parked"] | None = Field(
        default="none", description="null or '' = none (not time-sliced)."
    )
    timeslice_wait_ms: float = Field(default=0.0, ge=0.0)


class TrainingEntry(LlmdRow):
    """One observed sample as llm-d's router posts it: the row and what happened."""

    actual_ttft_ms: float = Field(..., ge=0.0, description="0 = TTFT not observed in this sample.")
    actual_tpot_ms: float = Field(..., ge=0.0, description="0 = TPOT not observed in this sample.")
    timestamp: Timestamp | AwareDatetime | None = Field(default=None, description=TIMESTAMP_HELP)


class NativeObservation(NativeRow):
    """A completed request: Leadtime's row, what happened, and what had been predicted."""

    actual_ttft_ms: float = Field(..., ge=0.0, description="0 = TTFT not observed.")
    actual_tpot_ms: float = Field(..., ge=0.0, description="0 = TPOT not observed.")
    predicted_ttft_ms: float | None = Field(
        default=None, ge=0.0, le=MAX_PREDICTED_MS, description="Mean TTFT the decision was made with."
    )
    predicted_tpot_ms: float | None = Field(default=None, ge=0.0, le=MAX_PREDICTED_MS)
    predicted_ttft_quantile_ms: float | None = Field(
        default=None, ge=0.0, le=MAX_PREDICTED_MS, description="Upper-quantile TTFT predicted."
    )
    predicted_tpot_quantile_ms: float | None = Field(default=None, ge=0.0, le=MAX_PREDICTED_MS)
    timestamp: Timestamp | AwareDatetime | None = Field(default=None, description=TIMESTAMP_HELP)


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

    observations: list[NativeObservation]


class PredictionAnswer(BaseModel):
    """One llm-d prediction answer."""

    ttft_ms: float
    tpot_ms: float
    predicted_at: str
    model_type: str = "lightgbm"
    objective_type: Literal["quantile", "mean"]
    quantile: float
    last_model_load: str | None


class ErrorDetail(BaseModel):
    """One problem of a refused body, in FastAPI's validation-error shape."""

    loc: list[str | int] = Field(..., description='Where it is: ["body", "rows", 0, "kv_cache_percentage"].')
    msg: str
    type: str


class ErrorAnswer(BaseModel):
    """Every refusal (4xx) and the rare 5xx: what went wrong, and for a bad value the field it is in."""

    error: str = Field(..., description="The problem in one line, naming the field when a value is at fault.")
    field: str | None = Field(default=None, description="Where the bad value is, e.g. requests[3].pod_type.")
    # A string for the refusals that are no bad value (401, 404, 405, 413, 415, 429, 503), as llm-d's own server
    # answers its HTTPExceptions ({"detail": "..."}): a client written against llm-d reads them unchanged.
    detail: list[ErrorDetail] | str | None = Field(
        default=None,
        description="The same in FastAPI's shape: a list of {loc, msg, type} for a refused body (400, 422), "
        "else a string. Absent from a few 5xx answers.",
    )


class Readiness(BaseModel):
    """/readyz's answer, 200 and 503 alike: whether predictions can be served, and what is degraded meanwhile."""

    status: Literal["ready", "not ready"]
    degraded: dict[str, str] = Field(..., description="Each degraded component and why; empty when all is well.")
    components: dict[str, str] = Field(..., description='Every component: "ok" or why it is degraded.')
    ingestion: dict[str, Any] = Field(..., description="Observations accepted, learned, thinned, dropped, pending.")


# What each path can be refused with, so that the OpenAPI document says what clients may get. Every path that needs
# the model answers 503 while the service starts or stops (all but the health router's); the rest depend on what a
# path takes, and `document_refusals` adds them from the operation itself (its method, its body, its security).
_ERROR = {"model": ErrorAnswer}
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorAnswer"}}}
COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    503: {**_ERROR, "description": "The service has not finished starting, or is stopping."},
}
# The edge refuses these before routing, on any method but GET, HEAD and OPTIONS (`edge.EdgeMiddleware`).
SENT_BODY_ERRORS: dict[str, str] = {
    "413": "The body exceeds the size limit.",
    "415": "The Content-Type is not JSON (or is missing on a path that changes what the service learns), or the "
    "body is compressed (Content-Encoding): send uncompressed JSON.",
}
READ_BODY_ERRORS: dict[str, str] = {
    "400": "The body is not JSON.",
    "422": "A value is missing, of the wrong type or out of range: `field` names it.",
}
TOKEN_ERRORS: dict[str, str] = {
    "401": "An API token is configured and the request does not carry it as `Authorization: Bearer <token>`.",
}
BACKLOG_FULL: dict[int | str, dict[str, Any]] = {
    429: {
        **_ERROR,
        "description": "The learner's backlog is full: nothing was accepted; send the batch again after Retry-After.",
        "headers": {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}},
    }
}
_NO_BODY_METHODS = frozenset({"get", "head", "options"})


TOKEN_SCHEME = "apiToken"
"""The name of the API token's security scheme in the OpenAPI document."""


def document_refusals(document: dict[str, Any], token_paths: Iterable[str] = ()) -> dict[str, Any]:
    """An OpenAPI document whose operations list the refusals they can answer: 413 and 415 where a body is sent,
    400 and 422 where one is read (the operation documents it), and on `token_paths` (those that need the API token,
    none when no token is configured) the bearer scheme and 401; all in the shape of `ErrorAnswer`. Changed in place
    (and returned); doing it again changes nothing."""
    token_paths = frozenset(token_paths)
    for path, item in document.get("paths", {}).items():
        for method, operation in item.items():
            answers: dict[str, str] = {}
            if method not in _NO_BODY_METHODS:
                answers.update(SENT_BODY_ERRORS)
            if "requestBody" in operation:
                answers.update(READ_BODY_ERRORS)
            else:  # FastAPI's own 422 for path parameters: they are plain strings (an unknown one is a 404)
                operation.get("responses", {}).pop("422", None)
            if path in token_paths:
                answers.update(TOKEN_ERRORS)
                operation["security"] = [{TOKEN_SCHEME: []}]
            responses = operation.setdefault("responses", {})
            for status, description in answers.items():
                responses[status] = {"description": description, "content": _ERROR_CONTENT}
            operation["responses"] = dict(sorted(responses.items()))
    if token_paths:
        document.setdefault("components", {})["securitySchemes"] = {
            TOKEN_SCHEME: {
                "type": "http",
                "scheme": "bearer",
                "description": "The service's API token (`--api-token`), needed on the paths that change what it "
                "learns; a service started without one documents none.",
            }
        }
    return document


NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {**_ERROR, "description": "No such model (or none yet)."}}
MODEL_REFUSED: dict[int | str, dict[str, Any]] = {
    409: {**_ERROR, "description": "The model to load (published, or pulled from --model-from) was refused: why."},
    503: {**_ERROR, "description": "The service is not ready, or the model registry or source cannot be reached."},
}


FLUSH_REFUSED: dict[int | str, dict[str, Any]] = {
    503: {
        **_ERROR,
        "description": "The service is not ready, or the store or the learner cannot take the flush now: nothing "
        "was flushed.",
    },
}


def content_of(media_type: str, description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 answer that is not JSON, documented with its media type."""
    return {200: {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}}


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


def body_schema(model: type[BaseModel], list_field: str, item: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI requestBody for a handler that parses its body itself: {list_field: [item, ...]}.

    An llm-d row documents Leadtime's own fields as well (`rows.ROW_EXTRAS`): llm-d's paths take them when a row
    carries them, and refuse a bad one, so the schema says what they must be.
    """
    item_schema = item.model_json_schema()
    if issubclass(item, LlmdRow) and not issubclass(item, NativeRow):
        native = NativeRow.model_json_schema()["properties"]
        item_schema["properties"].update({name: native[name] for name in ROW_EXTRAS})
    outer = model.model_json_schema()
    prop = dict(outer["properties"][list_field])
    prop["items"] = item_schema
    schema: dict[str, Any] = {"type": "object", "required": [list_field], "properties": {list_field: prop}}
    if issubclass(item, NativeRow):  # the native API refuses a key its bodies do not have; llm-d's ignore them
        schema["additionalProperties"] = False
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def document_catalog(document: dict[str, Any], catalog: Catalog) -> dict[str, Any]:
    """An OpenAPI document whose row fields `accelerator` and `model` list `catalog`'s slugs, not only the built-in
    ones: a service started with its own catalog accepts more than the models above say. Changed in place (and
    returned); doing it again changes nothing."""
    slugs = {
        "accelerator": text_choices(catalog.all_accelerators),
        "model": text_choices(catalog.all_models),
    }

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            properties = node.get("properties")
            if isinstance(properties, dict):
                for name, enum in slugs.items():
                    field = properties.get(name)
                    if isinstance(field, dict) and "enum" in field:
                        field["enum"] = enum
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(document)
    return document
