"""The router's hot path, a plain llm-d `/predict/bulk/strict` body, answered before FastAPI routes it.

Why: FastAPI's routing and dependency injection cost ~0.3-0.4 ms per call (cProfile, on the router's 100-row
call), about as much as validating and predicting the rows. Only plain bodies on a ready service are answered
here; anything else (Leadtime's extras, a bad value, a service still starting) goes on to the FastAPI route,
which answers it as before. Errors, docs and the extras so keep their one home.
"""

from __future__ import annotations

import time

from predictor.service.bulk_decode import decode_plain_bulk
from predictor.service.llmd_prediction import strict_answer
from predictor.service.runtime import ServiceRuntime

STRICT_PATH = "/predict/bulk/strict"


class HotPath:
    """Handlers of the paths the edge answers itself: body in, whole JSON answer out (or None: not here)."""

    def __init__(self, runtime: ServiceRuntime) -> None:
        self.runtime = runtime

    def predict_bulk_strict(self, body: bytes) -> bytes | None:
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
        return strict_answer(runtime, parsed, started)
