"""Leadtime's native, versioned API: richer rows in, mean and quantile of both targets out.

Rows carry what llm-d's lack (endpoint id, accelerator class, model, prefix-hit tokens, role, time-slice
state). Observations carry what was predicted beside what happened, so the live error of each decision is
measured.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import orjson
from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from leadtime.features.errors import FeatureError
from leadtime.features.rows import (
    NATIVE_OBSERVATION_FIELDS,
    NATIVE_ROW_FIELDS,
    refuse_unknown_fields,
    refuse_unknown_keys,
    role_of,
)
from leadtime.predictor.model_pull import ROLE_HEADER
from leadtime.predictor.service.edge import ReadyRuntime, json_body, list_field, require_token
from leadtime.predictor.service.health import status as llmd_status
from leadtime.predictor.service.llmd_training import accept_entries, parse_entries
from leadtime.predictor.service.runtime import (
    BACKLOG_FULL_MESSAGE,
    BACKLOG_RETRY_AFTER_S,
    MAX_OBSERVATIONS_PER_CALL,
    ServiceRuntime,
    served_ms,
)
from leadtime.predictor.service.schemas import (
    BACKLOG_FULL,
    NativeAccepted,
    NativeObservation,
    NativeObservationBatch,
    NativePredictAnswer,
    NativePredictRequest,
    NativeRow,
    body_schema,
    content_of,
)

prediction_router = APIRouter(prefix="/v1", tags=["native v1"])
training_router = APIRouter(prefix="/v1", tags=["native v1"])
common_router = APIRouter(prefix="/v1", tags=["native v1"])

# The keys of each native body: another is a slip (`row` for `rows`), refused by name as a row's unknown field is.
_PREDICT_BODY = frozenset({"rows"})
_OBSERVATIONS_BODY = frozenset({"observations"})
_EXPLAIN_BODY = frozenset({"row"})


@prediction_router.post(
    "/predict",
    response_model=NativePredictAnswer,
    openapi_extra=body_schema(NativePredictRequest, "rows", NativeRow),
    summary="Mean and upper quantile of TTFT and TPOT per row (columnar), and the model version.",
)
async def predict(request: Request, runtime: ReadyRuntime) -> Response:
    """Mean and upper quantile of TTFT and TPOT per row (columnar), and the model version."""
    return Response(predict_answer(runtime, await json_body(request)), media_type="application/json")


def predict_answer(runtime: ServiceRuntime, body: Any) -> bytes:
    """The whole /v1/predict answer for a parsed body, encoded; FeatureError naming the first bad field.

    One function for the route and the edge's hot path (`hot_path.HotPath.native_predict`), so that both answer
    alike."""
    rows = list_field(body, "rows", 1, runtime.settings.max_rows)
    refuse_unknown_keys(body, "", _PREDICT_BODY)
    refuse_unknown_fields(rows, "rows", NATIVE_ROW_FIELDS)
    parsed = runtime.parser.parse(rows, "rows")
    predictor = runtime.predictor
    assert predictor is not None
    p = predictor.predict_many(parsed)
    runtime.metrics.predictions.labels("native").inc(len(rows))
    answer = {
        "model_version": p.model_version,
        "quantile": runtime.settings.quantile,
        "predicted_at": datetime.now(UTC).isoformat(),
        "ttft_mean_ms": served_ms(p.ttft_mean),
        "ttft_quantile_ms": served_ms(p.ttft_quantile),
        "tpot_mean_ms": served_ms(p.tpot_mean),
        "tpot_quantile_ms": served_ms(p.tpot_quantile),
    }
    return orjson.dumps(answer)


@common_router.get(
    "/model",
    responses={
        200: {"content": {"application/json": {}}, "description": "The serving model's artifact."},
        304: {"description": "The model is the one whose digest If-None-Match names."},
    },
    summary="The serving model as an artifact (JSON with LightGBM text, SHA-256 sealed), for gateways that predict "
    "with a copy of it; 304 when If-None-Match names the current one.",
)
async def model(request: Request, runtime: ReadyRuntime) -> Response:
    """The model this process predicts with now, as `leadtime.predictor.artifact` writes it, with its SHA-256 as
    the ETag.

    Why: `leadtime route --pull-model` predicts in its own process with a copy of this model (a prediction over
    loopback costs the gateway about a millisecond, in process a few tenths) and keeps sending every observation
    here, so this service stays the one learner. It asks every second or so with the ETag it holds and gets
    304 until the model changes. So does a prediction server taking its models from a training server
    (`leadtime serve --role prediction --model-from URL`): it is answered in every role, the training one first.
    The artifact is data (never a pickle), and its checksum is checked on load. It needs no token: it is what
    the predictions served here already give away, and writes nothing."""
    artifact, digest, version = await asyncio.to_thread(runtime.serving_artifact)
    etag = f'"{digest}"'
    # Its role too: a prediction server pulling from a prediction server (or itself) would serve a prior for ever.
    headers = {"ETag": etag, "X-Leadtime-Model-Version": str(version), ROLE_HEADER: runtime.settings.role}
    if etag_matches(request.headers.get("if-none-match", ""), etag):
        return Response(status_code=304, headers=headers)
    return Response(artifact, media_type="application/json", headers=headers)


def etag_matches(if_none_match: str, etag: str) -> bool:
    """Whether an If-None-Match header names `etag`, by HTTP's weak comparison (RFC 9110: `W/` is ignored), or is
    `*` (any current representation).

    >>> etag_matches('"a", W/"b"', '"b"'), etag_matches("*", '"b"'), etag_matches('"a"', '"b"')
    (True, True, False)
    """
    tags = [v.strip().removeprefix("W/") for v in if_none_match.split(",")]
    return "*" in tags or etag in tags


def _llmd_entry(entry: Any) -> Any:
    """Store entries (checked already) in llm-d's shape: a native `role` becomes `pod_type`."""
    if isinstance(entry, dict) and "role" in entry:
        entry = dict(entry)
        role = role_of(entry.get("pod_type"), entry.pop("role"))
        entry["pod_type"] = "" if role == "both" else role
    return entry


@training_router.post(
    "/observations",
    status_code=202,
    response_model=NativeAccepted,
    responses=BACKLOG_FULL,
    openapi_extra=body_schema(NativeObservationBatch, "observations", NativeObservation),
    dependencies=[Depends(require_token)],
    summary="Accept completed requests: the row, what happened and what had been predicted (202; 429 with "
    "Retry-After while the learner's backlog is full).",
)
async def observations(request: Request, runtime: ReadyRuntime) -> JSONResponse:
    """Accept completed requests: the row, what happened and what had been predicted (202).

    Unlike llm-d's path (its router drops a batch on any answer but 202, so it gets 202 and the rows are
    counted as dropped), the native API tells a full backlog with 429: its clients can retry."""
    if runtime.backlog_full():
        raise HTTPException(429, BACKLOG_FULL_MESSAGE, {"Retry-After": str(BACKLOG_RETRY_AFTER_S)})
    body = await json_body(request)
    entries = list_field(body, "observations", 0, MAX_OBSERVATIONS_PER_CALL)
    try:
        refuse_unknown_keys(body, "", _OBSERVATIONS_BODY)
        refuse_unknown_fields(entries, "observations", NATIVE_OBSERVATION_FIELDS)
    except FeatureError:
        runtime.metrics.observations_rejected.labels("native").inc(len(entries))  # as `parse_entries` counts
        raise
    parsed = await parse_entries(runtime, entries, "native", "observations")
    llmd_entries = [_llmd_entry(e) for e in entries]
    accepted = accept_entries(runtime, llmd_entries, parsed.actual_ttft_ms, parsed.actual_tpot_ms, "native")
    runtime.record_live_errors(parsed)
    return JSONResponse({"accepted": accepted}, status_code=202)


@common_router.get("/status", summary="Model version, learning state, lease and component health.")
async def status(runtime: ReadyRuntime) -> dict[str, Any]:
    """Model version, learning state, lease and component health."""
    answer = await llmd_status(runtime)
    answer["learned"] = runtime.learned()
    return answer


@prediction_router.post(
    "/explain",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "required": ["row"],
                        "properties": {"row": NativeRow.model_json_schema()},
                        "additionalProperties": False,
                    }
                }
            },
        }
    },
    responses=content_of("text/plain", "The explanation, one term a line."),
    summary="One prediction explained term by term (plain text).",
)
async def explain(request: Request, runtime: ReadyRuntime) -> Response:
    """One prediction explained term by term (plain text).

    The body is read as `/v1/predict` reads it (the same JSON reader, so the same 400 for a body that is not JSON,
    NaN or an overflowing number included) and the row is checked and vectorized by the same parser, so that what
    is explained is what `/v1/predict` serves for that row, its cap included (`served_ms`); a bad value is named as
    a field of `row`."""
    body = await json_body(request)
    if not isinstance(body, dict):
        raise FeatureError("body", "must be a JSON object with a 'row' object")
    if body.get("row") is None:
        raise FeatureError("row", "is required")
    refuse_unknown_keys(body, "", _EXPLAIN_BODY)
    if isinstance(body["row"], dict):
        refuse_unknown_keys(body["row"], "row", NATIVE_ROW_FIELDS)
    try:
        batch = runtime.parser.parse_one(body["row"])
    except FeatureError as err:
        raise err.under("row") from None
    predictor = runtime.predictor
    assert predictor is not None
    return Response(predictor.debug_one(batch, served=served_ms), media_type="text/plain; charset=utf-8")
