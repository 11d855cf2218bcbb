"""/openapi.json says what the service does: which statuses each path answers, which paths need the API token, and
the shape of every error body. Each claim is checked by real requests, so that a client generated from the document
(Node, Go) meets no status, token or body it was not told of."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
from fastapi.testclient import TestClient

from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings

ROW = {
    "kv_cache_percentage": 0.1,
    "input_token_length": 300,
    "num_request_waiting": 0,
    "num_request_running": 2,
    "num_tokens_generated": 0,
    "prefix_cache_score": 0.0,
}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, dict[str, Any]]]:
    with TestClient(create_app(ServiceSettings(grpc_port=0))) as client:
        yield client, client.get("/openapi.json").json()


def test_a_text_field_sent_as_null_is_accepted_and_documented_so(served: tuple[TestClient, dict[str, Any]]) -> None:
    """A row's endpoint_id, accelerator and model may be null (read as empty: the defaults), on every path that takes
    rows; a schema that said "string" made a generated client refuse what the service takes (a fuzzer found it)."""
    client, document = served
    row = {**ROW, "endpoint_id": None, "accelerator": None, "model": None}
    for path, key in (("/v1/predict", "rows"), ("/predict/bulk/strict", "requests"), ("/predict/bulk", "requests")):
        assert client.post(path, json={key: [row]}).status_code == 200, path
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        validator = jsonschema_rs.Draft202012Validator({**schema, "components": document["components"]})
        assert validator.is_valid({key: [row]}), path
        assert not validator.is_valid({key: [{**row, "endpoint_id": 5}]}), path
