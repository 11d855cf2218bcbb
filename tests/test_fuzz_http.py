"""Every HTTP path fuzzed from the service's own OpenAPI schema with schemathesis, on a running app.

For each operation, schema-valid cases (positive) and schema-breaking ones (negative, where the operation has
inputs to break) are sent through the app with its runtime started. Every answer must be:
- never a 5xx;
- a status and content type the schema documents, with a body that matches the documented schema;
- for a refusal (4xx), JSON whose `error` names the problem; a rejected write changes nothing that was accepted;
- for a schema-breaking case, a refusal (schemathesis' negative_data_rejection), or on llm-d's lenient bulk path,
  where a bad row fails alone, a 200 that names it among the errors;
- for a schema-valid case, an acceptance, except for the two rules JSON Schema cannot state (prefix hits may not
  exceed the prompt: a 422 naming `prefix_hit_tokens`; a role may not disagree with pod_type: one naming `role`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.runtime import ServiceRuntime
from leadtime.predictor.settings import ServiceSettings

LENIENT_BULK = "POST /predict/bulk"
EXAMPLES = 20  # per operation and mode: ~23 operations x 2 modes in ~25 s on this machine
CHECKS = [
    schemathesis.checks.not_a_server_error,
    schemathesis.checks.status_code_conformance,
    schemathesis.checks.content_type_conformance,
    schemathesis.checks.response_schema_conformance,
]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, ServiceRuntime]]:
    app = create_app(ServiceSettings(grpc_port=0))
    with TestClient(app):  # runs the lifespan: the runtime, its learner and loops are the real ones
        yield schemathesis.openapi.from_asgi("/openapi.json", app), app.state.runtime


def _accepted(runtime: ServiceRuntime) -> int:
    return int(runtime.ingestion()["accepted"])


def _check_case(case: Any, runtime: ServiceRuntime, mode: GenerationMode) -> int:
    before = _accepted(runtime)
    response = case.call()
    status = response.status_code
    assert status < 500, f"{case.operation.label}: {status} {response.text[:300]}"
    if status >= 400:
        body = response.json()
        assert isinstance(body, dict) and isinstance(body.get("error"), str) and body["error"], response.text[:300]
        assert _accepted(runtime) == before, f"{case.operation.label}: a refused write changed what was accepted"
        if mode is GenerationMode.POSITIVE and status not in (401, 404, 429):
            field = body.get("field", "")
            assert status == 422 and ("prefix_hit_tokens" in field or field.endswith(".role")), (
                f"{case.operation.label}: a schema-valid case was refused: {response.text[:300]}"
            )
    extra = [schemathesis.checks.negative_data_rejection] if mode is GenerationMode.NEGATIVE else []
    if mode is GenerationMode.NEGATIVE and case.operation.label == LENIENT_BULK and status == 200:
        # llm-d's lenient bulk path answers a batch with bad rows 200, naming each bad row in `errors`.
        body = response.json()
        assert body["failed_predictions"] >= 1 and body["errors"], response.text[:300]
        extra = []
    case.validate_response(response, checks=CHECKS + extra)
    return status


def _fuzz(operation: Any, mode: GenerationMode, runtime: ServiceRuntime, seen: set[int]) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: a failure here is reproducible
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        seen.add(_check_case(case, runtime, mode))

    run()


def test_every_documented_path_survives_fuzzing_from_its_own_schema(served: tuple[Any, ServiceRuntime]) -> None:
    schema, runtime = served
    started = time.monotonic()
    statuses: dict[str, set[int]] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20, [op.label for op in operations]
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            seen = statuses.setdefault(f"{operation.label} {mode.value}", set())
            try:
                _fuzz(operation, mode, runtime, seen)
            except Unsatisfiable:
                # Nothing to break: the operation takes no input (GET /healthz, say). Positive cases cover it.
                assert mode is GenerationMode.NEGATIVE
    # The fuzzing reached both sides of the write paths: accepted (2xx) and refused (4xx).
    for label in ("POST /predict/bulk/strict", "POST /add_training_data_bulk", "POST /v1/observations"):
        assert any(s < 300 for s in statuses[f"{label} positive"]), statuses[f"{label} positive"]
        assert any(400 <= s < 500 for s in statuses[f"{label} negative"]), statuses[f"{label} negative"]
    assert time.monotonic() - started < 60
