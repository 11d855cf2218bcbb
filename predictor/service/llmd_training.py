"""llm-d's training-server paths: /add_training_data_bulk (answers exactly 202), /data/status, /flush.

Accepting is validate-then-append: every entry is checked (a bad one rejects the batch with 422 naming
`entries[i].field`, nothing accepted), the batch goes to the store, and the learner process learns it behind. A key
the body or an entry does not have is ignored whatever it holds (a number beyond a double's range included), on the
hot path as on the route: llm-d's request models ignore unknown fields.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from leadtime.features.errors import FeatureError, validation_problem
from leadtime.features.rows import known_fields_only, refuse_unknown_keys
from leadtime.predictor.service.edge import ReadyRuntime, json_body, list_field, require_token
from leadtime.predictor.service.rows import ParsedObservations
from leadtime.predictor.service.runtime import MAX_OBSERVATIONS_PER_CALL, FlushRefused, ServiceRuntime, rfc3339
from leadtime.predictor.service.schemas import (
    FLUSH_REFUSED,
    AcceptedAnswer,
    FlushRequest,
    TrainingBatch,
    TrainingEntry,
    body_schema,
)

router = APIRouter(tags=["llm-d training"])


# Entries checked between two turns of the event loop: ~0.3 ms of work, so that a prediction arriving while a
# large batch is checked waits for one slice, not for the batch (a 1,000-entry batch takes ~5 ms).
_SLICE = 64


async def parse_entries(runtime: ServiceRuntime, entries: list[Any], api: str, where: str) -> ParsedObservations:
    """Validate every entry (all or nothing), counting a rejected batch in metrics."""
    parts = []
    try:
        for first in range(0, max(len(entries), 1), _SLICE):
            if first:
                await asyncio.sleep(0)
            parts.append(runtime.parser.parse_observations(entries[first : first + _SLICE], where, first))
    except FeatureError:
        runtime.metrics.observations_rejected.labels(api).inc(len(entries))
        raise
    return ParsedObservations.concat(parts)


def accept_entries(
    runtime: ServiceRuntime, entries: list[Any], actual_ttft: np.ndarray, actual_tpot: np.ndarray, api: str
) -> int:
    """Append validated entries, without the fields nobody reads; returns how many were accepted."""
    runtime.accept(known_fields_only(entries), actual_ttft, actual_tpot)
    runtime.metrics.observations_accepted.labels(api).inc(len(entries))
    return len(entries)


@router.post(
    "/add_training_data_bulk",
    status_code=202,
    response_model=AcceptedAnswer,
    openapi_extra=body_schema(TrainingBatch, "entries", TrainingEntry),
    dependencies=[Depends(require_token)],
    summary="Accept observed samples (202); learning happens behind the answer.",
)
async def add_training_data_bulk(request: Request, runtime: ReadyRuntime) -> JSONResponse:
    """Accept observed samples (exactly 202); learning happens behind the answer."""
    entries = list_field(await json_body(request), "entries", 0, MAX_OBSERVATIONS_PER_CALL)
    parsed = await parse_entries(runtime, entries, "llmd", "entries")
    n = accept_entries(runtime, entries, parsed.actual_ttft_ms, parsed.actual_tpot_ms, "llmd")
    return JSONResponse({"message": f"Accepted {n} training samples."}, status_code=202)


@router.get("/data/status", summary="Samples held for training and testing, and the model state.")
async def data_status(runtime: ReadyRuntime) -> dict[str, Any]:
    """Samples held for training and testing, and the model state."""
    s = runtime.samples
    predictor = runtime.predictor
    assert predictor is not None
    status = runtime.model_status()

    def block(counts: dict[str, int]) -> dict[str, int]:
        return {
            "ttft_samples": counts["ttft"],
            "tpot_samples": counts["tpot"],
            "total_samples": counts["ttft"] + counts["tpot"],
        }

    return {
        "training_data": block(s.train),
        "test_data": block(s.test),
        "window": status.get("window", {}),
        "ensemble": {"ensemble_mode": False, "ensemble_active": False, "members": []},
        "model_ready": True,
        "last_retrain": rfc3339(status.get("last_retrain")),
    }


@router.post(
    "/flush",
    dependencies=[Depends(require_token)],
    responses=FLUSH_REFUSED,
    # Its JSON Content-Type is required even with no body (a web page could send an empty POST otherwise): the
    # schema says so, with the options an empty object leaves at their defaults (flush everything).
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": FlushRequest.model_json_schema()}}}
    },
    summary="Empty the training and test data (and the metrics' live-error state) on request.",
)
async def flush(request: Request, runtime: ReadyRuntime) -> dict[str, Any]:
    """Empty the training and test data (and the metrics' live-error state) on request.

    Flushing the training data flushes the rows accepted before it that still wait to be learned as well (a burst
    is learned behind the answers): the counts answered are those /data/status held, it says 0 after, and the
    window stays empty of them (`ServiceRuntime.flush_samples`; /status counts them as `dropped.flushed`). It
    flushes this replica: replicas sharing a Redis stream keep theirs, and a model the lease holder publishes
    brings its window with it. 503, nothing flushed, when the store or the learner cannot take it now."""
    raw = await request.body()
    body: Any = {} if not raw.strip() else await json_body(request)
    if isinstance(body, dict):  # a misspelt option would flush what it was meant to keep: named, with its likely fix
        refuse_unknown_keys(body, "", frozenset(FlushRequest.model_fields), api="/flush")
    try:
        options = FlushRequest.model_validate(body)
    except ValidationError as err:
        where, problem = validation_problem(err)
        raise FeatureError(where or "body", problem) from None
    # In a worker thread: telling the learner process to empty its window waits for its pipe (up to 2 s), and the
    # event loop must keep answering predictions meanwhile.
    try:
        flushed = await asyncio.to_thread(runtime.flush_samples, options.flush_training_data, options.flush_test_data)
    except FlushRefused as err:
        raise HTTPException(503, f"nothing was flushed: {err}") from None
    if options.flush_metrics:
        runtime.metrics.live_error.clear()
        runtime.metrics.quantile_checks.clear()
    what = [
        name
        for name, on in (
            ("training data", options.flush_training_data),
            ("test data", options.flush_test_data),
            ("metrics", options.flush_metrics),
        )
        if on
    ]
    return {
        "success": True,
        "flushed_at": datetime.now(UTC).isoformat(),
        "reason": options.reason,
        "ttft_training_samples_flushed": flushed["ttft_training"],
        "tpot_training_samples_flushed": flushed["tpot_training"],
        "ttft_test_samples_flushed": flushed["ttft_test"],
        "tpot_test_samples_flushed": flushed["tpot_test"],
        "metrics_cleared": options.flush_metrics,
        "message": "Successfully flushed: " + (", ".join(what) if what else "nothing"),
    }
