"""The routers' hot paths, plain llm-d bodies of `/predict/bulk/strict` and `/add_training_data_bulk` and
Leadtime's native `/v1/predict` (what `leadtime route` calls on every decision), answered before FastAPI routes
them.

Why: FastAPI's routing and dependency injection cost ~0.3-0.4 ms per call (cProfile, on the router's 100-row
call), about as much as validating and predicting the rows; and a training batch checked entry by entry holds
the event loop, so predictions arriving meanwhile wait (the router posts a batch every ~100 ms). Only plain
bodies on a ready service are answered here, and training batches only up to `MAX_HOT_ENTRIES` (larger ones
are checked a slice at a time by the route); anything else (Leadtime's extras, a bad value, a missing token, a
service still starting) goes on to the FastAPI route, which answers it as before. Errors, docs and the extras
so keep their one home.

`/v1/predict` measured from `leadtime route`'s client (8 rows, one call every 20 ms, the way a gateway calls it):
the FastAPI route's routing, middleware and dependency stack was about half of the service's time per call.
"""

from __future__ import annotations

import time

import orjson

from leadtime.features.errors import FeatureError
from leadtime.predictor.service.bulk_decode import decode_plain_bulk, decode_plain_training
from leadtime.predictor.service.edge import bearer_matches, loads_json
from leadtime.predictor.service.llmd_prediction import strict_answer
from leadtime.predictor.service.llmd_training import accept_entries
from leadtime.predictor.service.native import predict_answer
from leadtime.predictor.service.runtime import ServiceRuntime
from leadtime.predictor.store.base import StoreClosed

STRICT_PATH = "/predict/bulk/strict"
TRAINING_PATH = "/add_training_data_bulk"
NATIVE_PREDICT_PATH = "/v1/predict"
# Checked in one go here: ~0.3 ms of work. Larger batches go to the route, which yields between slices.
MAX_HOT_ENTRIES = 256


class HotPath:
    """Handlers of the paths the edge answers itself: body and Authorization header in, (status, whole JSON
    answer) out, or None: not here."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime

    def predict_bulk_strict(self, body: bytes, authorization: str) -> tuple[int, bytes] | None:
        """Answer a plain llm-d body of /predict/bulk/strict, or None to leave it to the route."""
        started = time.perf_counter()
        runtime = self.runtime
        if not runtime.ready:
            return None
        plain = decode_plain_bulk(body, runtime.settings.max_rows)
        if plain is None:
            return None
        parsed = runtime.parser.parse_plain(*plain)
        if parsed is None:
            return None
        return 200, strict_answer(runtime, parsed, started)

    def native_predict(self, body: bytes, authorization: str) -> tuple[int, bytes] | None:
        """Answer a good body of /v1/predict, or None to leave it to the route (which names what is wrong with a
        bad one: errors keep their one home)."""
        if not self.runtime.ready:
            return None
        try:
            return 200, predict_answer(self.runtime, orjson.loads(body))
        except (FeatureError, orjson.JSONDecodeError):
            return None

    def add_training_data_bulk(self, body: bytes, authorization: str) -> tuple[int, bytes] | None:
        """Accept a plain llm-d body of /add_training_data_bulk (202), or None to leave it to the route."""
        runtime = self.runtime
        token = runtime.settings.api_token
        if not runtime.ready or (token and not bearer_matches(authorization, token)):
            return None
        actuals = decode_plain_training(body, MAX_HOT_ENTRIES)
        if actuals is None:
            return None
        # What the store keeps: the entries as they came, read by the route's own reader. msgspec skips an unknown
        # key's value unread, so it takes bodies orjson refuses (`"note": 1e400`): read by orjson alone, outside any
        # try, those were answered 500. What the reader refuses (or reads otherwise) is the route's to answer.
        try:
            entries = loads_json(body)["entries"]
        except ValueError:
            return None
        if not isinstance(entries, list) or len(entries) != len(actuals):
            return None
        try:
            n = accept_entries(runtime, entries, actuals[:, 0], actuals[:, 1], "llmd")
        except StoreClosed:
            return None  # nothing was kept: the route answers it (503, with Retry-After)
        return 202, orjson.dumps({"message": f"Accepted {n} training samples."})
