"""/openapi.json says what the service does: which statuses each path answers, which paths need the API token, and
the shape of every error body. Each claim is checked by real requests, so that a client generated from the document
(Node, Go) meets no status, token or body it was not told of."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
from fastapi.testclient import TestClient
from llmd_rows import LLMD_ROW

from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings
from leadtime.predictor.store.memory import MemoryStore

TOKEN = "s3cret"
MAX_BODY = 20_000
ROW = LLMD_ROW
ENTRY = {**ROW, "actual_ttft_ms": 120.0, "actual_tpot_ms": 0.0}
TOKEN_PATHS = {"/add_training_data_bulk", "/flush", "/v1/observations", "/reload"}


class _FullStore(MemoryStore):
    """A store whose learner backlog is full (as when the learner is stalled)."""

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "full": 1}


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, dict[str, Any]]]:
    settings = ServiceSettings(api_token=TOKEN, grpc_port=0, max_body_bytes=MAX_BODY)
    with TestClient(create_app(settings)) as client:
        yield client, client.get("/openapi.json").json()


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(method, URL, operation) of every documented operation, path parameters filled with a known name."""
    for path, item in document["paths"].items():
        url = path.replace("{name}", "ttft").replace("{target}", "ttft")
        for method, operation in item.items():
            yield method.upper(), url, operation


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_401_and_the_bearer_scheme_are_documented_on_exactly_the_paths_that_need_the_token(
    served: tuple[TestClient, dict[str, Any]],
) -> None:
    client, document = served
    [(name, scheme)] = document["components"]["securitySchemes"].items()
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    needing = set()
    for method, url, operation in operations(document):
        body = b"{}" if method == "POST" else None
        wrong = {**auth("wrong"), "content-type": "application/json"}
        answer = client.request(method, url, content=body, headers=wrong)
        needs = answer.status_code == 401
        if needs:
            needing.add(url)
        assert ("401" in operation["responses"]) == needs, (method, url, answer.status_code)
        assert operation.get("security") == ([{name: []}] if needs else None), (method, url)
    assert needing == TOKEN_PATHS
    # Predictions need no token: a wrong one is ignored.
    assert client.post("/v1/predict", json={"rows": [ROW]}, headers=auth("wrong")).status_code == 200
    assert client.post("/predict/bulk/strict", json={"requests": [ROW]}, headers=auth("wrong")).status_code == 200


def test_a_service_without_a_token_documents_neither_the_scheme_nor_401() -> None:
    with TestClient(create_app(ServiceSettings(grpc_port=0))) as client:
        document = client.get("/openapi.json").json()
        assert client.post("/v1/observations", json={"observations": [ENTRY]}).status_code == 202
    assert "securitySchemes" not in document["components"]
    for method, url, operation in operations(document):
        assert "401" not in operation["responses"] and "security" not in operation, (method, url)


def test_415_413_400_and_422_are_documented_on_exactly_the_paths_that_read_a_body(
    served: tuple[TestClient, dict[str, Any]],
) -> None:
    """The edge refuses a body that is not JSON by its Content-Type, or compressed, with 415, and one above the size
    limit with 413, on every path a body is sent to (POST); GET paths never read one. 400 and 422 are for the paths
    that read the body (those that document one: /reload takes none)."""
    client, document = served
    for method, url, operation in operations(document):
        responses = operation["responses"]
        headers = auth(TOKEN)
        as_text = client.request(method, url, content=b"{}", headers={**headers, "content-type": "text/plain"})
        compressed = {**headers, "content-type": "application/json", "content-encoding": "gzip"}
        gzipped = client.request(method, url, content=b"{}", headers=compressed)
        large = client.request(
            method, url, content=b" " * (MAX_BODY + 1), headers={**headers, "content-type": "application/json"}
        )
        answers_415 = as_text.status_code == 415 and gzipped.status_code == 415
        assert answers_415 == (method == "POST") == (large.status_code == 413), (method, url)
        assert ("415" in responses) == answers_415, (method, url)
        assert ("413" in responses) == answers_415, (method, url)
        reads_body = "requestBody" in operation
        assert reads_body == (method == "POST" and url != "/reload"), (method, url)
        assert ("400" in responses) == ("422" in responses) == reads_body, (method, url)
        if reads_body:
            not_json = client.request(
                method, url, content=b"{not json", headers={**headers, "content-type": "application/json"}
            )
            assert not_json.status_code == 400, (method, url, not_json.text)


def test_429_is_documented_where_a_full_backlog_answers_it_and_not_on_llmds_training_path() -> None:
    """llm-d's router drops a batch on any answer but 202, so its path answers 202 when the backlog is full; the
    native API answers 429 with Retry-After, and says so."""
    with TestClient(create_app(ServiceSettings(grpc_port=0), store=_FullStore())) as client:
        document = client.get("/openapi.json").json()
        native = client.post("/v1/observations", json={"observations": [ENTRY]})
        assert native.status_code == 429 and native.headers["retry-after"] == "1"
        assert client.post("/add_training_data_bulk", json={"entries": [ENTRY]}).status_code == 202
    documented = {url for _, url, operation in operations(document) if "429" in operation["responses"]}
    assert documented == {"/v1/observations"}
    answer = document["paths"]["/v1/observations"]["post"]["responses"]["429"]
    assert answer["headers"]["Retry-After"]["schema"] == {"type": "integer"}
    assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorAnswer"}


def _error_validator(document: dict[str, Any]) -> jsonschema_rs.Draft202012Validator:
    schema = {"$ref": "#/components/schemas/ErrorAnswer", "components": document["components"]}
    return jsonschema_rs.Draft202012Validator(schema)


def test_every_error_body_matches_the_documented_error_schema(served: tuple[TestClient, dict[str, Any]]) -> None:
    """`detail` is a list of {loc, msg, type} for a refused body (400, 422) and a string for the other refusals,
    as llm-d's own server answers its HTTPExceptions; the document says exactly that."""
    client, document = served
    validator = _error_validator(document)
    json_type = {"content-type": "application/json"}
    answers = {
        400: client.post("/v1/predict", content=b"{not json", headers=json_type),
        401: client.post("/v1/observations", json={"observations": [ENTRY]}),
        404: client.get("/model/nope/info"),
        405: client.get("/v1/predict"),
        413: client.post("/v1/predict", content=b" " * (MAX_BODY + 1), headers=json_type),
        415: client.post("/v1/predict", content=b"{}", headers={"content-type": "text/plain"}),
        422: client.post("/v1/predict", json={"rows": [{**ROW, "kv_cache_percentage": 3}]}),
    }
    with TestClient(create_app(ServiceSettings(grpc_port=0), store=_FullStore())) as full:
        answers[429] = full.post("/v1/observations", json={"observations": [ENTRY]})
    answers[503] = TestClient(create_app(ServiceSettings(grpc_port=0))).post("/v1/predict", json={"rows": [ROW]})
    for status, answer in answers.items():
        assert answer.status_code == status, (status, answer.text)
        body = answer.json()
        validator.validate(body)
        if status in (400, 422):
            assert isinstance(body["detail"], list) and body["detail"][0]["loc"][0] == "body", body
        else:
            assert isinstance(body["detail"], str), body
    # The documented `detail` is that list or a string, nothing else.
    for wrong in ({"error": "x", "detail": 5}, {"error": "x", "detail": {"msg": "x"}}, {"error": "x", "detail": [1]}):
        assert not validator.is_valid(wrong), wrong


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


def test_reload_documents_the_409_it_answers_for_a_refused_model() -> None:
    store = MemoryStore()
    with TestClient(create_app(ServiceSettings(grpc_port=0), store=store)) as client:
        document = client.get("/openapi.json").json()
        store.publish_model(b'{"not": "an artifact"}')
        refused = client.post("/reload", headers={"content-type": "application/json"})
    assert refused.status_code == 409 and "refused" in refused.json()["error"], refused.text
    documented = document["paths"]["/reload"]["post"]["responses"]
    assert documented["409"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorAnswer"}


def test_503_is_documented_on_exactly_the_paths_that_answer_it_before_start_up_has_finished() -> None:
    """Paths that need the model answer 503 (an ErrorAnswer) until start-up has finished; /readyz answers its own
    503 (its readiness body); /, /healthz, /status and /metrics answer 200 all along."""
    app = create_app(ServiceSettings(grpc_port=0))
    client = TestClient(app)  # not entered: the runtime has not started
    document = client.get("/openapi.json").json()
    error = {"$ref": "#/components/schemas/ErrorAnswer"}
    for method, url, operation in operations(document):
        body = b"{}" if method == "POST" else None
        answer = client.request(method, url, content=body, headers={"content-type": "application/json"})
        assert ("503" in operation["responses"]) == (answer.status_code == 503), (method, url, answer.status_code)
        if answer.status_code == 503:
            schema = operation["responses"]["503"]["content"]["application/json"]["schema"]
            assert (schema == error) == ("error" in answer.json()), (method, url, schema)
    readyz = document["paths"]["/readyz"]["get"]["responses"]["503"]["content"]["application/json"]["schema"]
    validator = jsonschema_rs.Draft202012Validator({**readyz, "components": document["components"]})
    validator.validate(client.get("/readyz").json())
    assert not validator.is_valid({"error": "not ready"})
