"""Bad input at the predictor service found by an adversarial sweep: each is refused with one clear error naming
the problem (HTTP 422 naming the field, gRPC INVALID_ARGUMENT, `leadtime serve` one line and exit 2), never a
traceback or a 5xx, and nothing accepted before it is lost."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from fastapi.testclient import TestClient
from llmd_rows import llmd_row
from served import http_and_grpc

from leadtime.bench.procs import free_port
from leadtime.predictor.artifact import check_model_dir
from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.service.app import StoreError, make_store
from leadtime.predictor.service.serve import check_tls_files
from leadtime.predictor.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[1]
ROW = llmd_row()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[TestClient, Any]]:
    """An app (HTTP through TestClient) and a gRPC stub on the same runtime."""
    with http_and_grpc(ServiceSettings(grpc_port=0)) as served:
        yield served


def accepted(http: TestClient) -> int:
    return int(http.get("/status").json()["ingestion"]["accepted"])


# ----- HTTP: llm-d's paths and Leadtime's own row fields ------------------------------------------------------


def test_llmd_paths_document_the_leadtime_fields_they_read_and_check(served: tuple[TestClient, Any]) -> None:
    """A fuzzer found `role: []` on an llm-d training entry refused while the schema allowed any extra field."""
    http, _ = served
    paths = http.get("/openapi.json").json()["paths"]
    for path, field in (("/add_training_data_bulk", "entries"), ("/predict/bulk", "requests")):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        item = body["properties"][field]["items"]["properties"]
        assert item["role"]["anyOf"][0]["enum"] == ["both", "prefill", "decode"], path
        assert {"endpoint_id", "accelerator", "timeslice_state", "prefix_hit_tokens"} <= set(item), path
    entry = {**ROW, "actual_ttft_ms": 100.0, "actual_tpot_ms": 10.0, "role": []}
    refused = http.post("/add_training_data_bulk", json={"entries": [entry]})
    assert refused.status_code == 422 and refused.json()["field"] == "entries[0].role", refused.text


def test_the_lenient_bulk_path_names_a_bad_row_and_answers_the_others(served: tuple[TestClient, Any]) -> None:
    http, _ = served
    reply = http.post("/predict/bulk", json={"requests": [ROW, {**ROW, "decode_tokens_in_flight": False}]})
    assert reply.status_code == 200
    body = reply.json()
    assert (body["successful_predictions"], body["failed_predictions"]) == (1, 1)
    assert body["errors"][0]["index"] == 1 and "decode_tokens_in_flight" in body["errors"][0]["error"]


ENTRY = {**ROW, "actual_ttft_ms": 100.0, "actual_tpot_ms": 10.0}


# (path, list field, one good item): every path that takes rows or entries.
BODY_PATHS = [
    ("/predict/bulk/strict", "requests", ROW),
    ("/predict/bulk", "requests", ROW),
    ("/add_training_data_bulk", "entries", ENTRY),
    ("/v1/predict", "rows", ROW),
    ("/v1/observations", "observations", ENTRY),
]


@pytest.mark.parametrize(("path", "field", "item"), BODY_PATHS, ids=[p for p, _, _ in BODY_PATHS])
@pytest.mark.parametrize("literal", ["1e400", "9" * 400])
@pytest.mark.parametrize("n", [1, 300], ids=["hot-path", "route"])
def test_an_unknown_top_level_key_is_ignored_on_llmds_paths_even_holding_a_number_too_large_for_a_double(
    served: tuple[TestClient, Any], path: str, field: str, item: dict[str, Any], literal: str, n: int
) -> None:
    """msgspec (the hot paths' decoder) skips an unknown key's value, orjson refuses a number beyond a double's
    range: /add_training_data_bulk's hot path took the body, then read it again with orjson outside any try (500);
    /predict/bulk/strict answered 200 and /predict/bulk 400 for the same body. llm-d's server ignores a key its
    request model does not know whatever it holds; the native API refuses one by name."""
    http, _ = served
    before = accepted(http)
    items = b",".join([orjson.dumps(item)] * n)
    body = b'{"%s": [%s], "note": %s}' % (field.encode(), items, literal.encode())
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    if path.startswith("/v1/"):
        assert response.status_code == 422 and response.json()["field"] == "note", response.text[:300]
        assert accepted(http) == before
    else:
        assert response.status_code == (202 if "training" in path else 200), response.text[:300]
        assert accepted(http) == before + (n if "training" in path else 0)


@pytest.mark.parametrize("item", [5, "a row", [1, 2], None, True])
def test_an_item_that_is_not_an_object_is_named_by_its_index(served: tuple[TestClient, Any], item: Any) -> None:
    """A row or entry that is not an object is itself the bad value: `rows[0]`, not `rows[0].row` (there is no
    field `row` in a row), on every path that takes a list of them, the edge's hot paths included."""
    from leadtime.predictor.service.hot_path import HotPath

    http, _ = served
    entry = {**ROW, "actual_ttft_ms": 100.0, "actual_tpot_ms": 10.0}
    for path, key, good in (
        ("/v1/predict", "rows", ROW),
        ("/predict/bulk/strict", "requests", ROW),
        ("/v1/observations", "observations", entry),
        ("/add_training_data_bulk", "entries", entry),
    ):
        reply = http.post(path, json={key: [good, item]})
        assert reply.status_code == 422, (path, reply.text)
        body = reply.json()
        assert body["field"] == f"{key}[1]" and body["error"].startswith(f"{key}[1]: "), (path, body)
        assert body["detail"][0]["loc"] == ["body", key, 1], (path, body)
    lenient = http.post("/predict/bulk", json={"requests": [ROW, item]})
    if lenient.status_code == 200:  # llm-d's schema may refuse it first (422 naming requests[1])
        assert lenient.json()["errors"][0]["error"].startswith("requests[1]: "), lenient.text
    else:
        assert lenient.json()["field"] == "requests[1]", lenient.text
    hot = HotPath(http.app.state.runtime)  # type: ignore[attr-defined]
    assert hot.native_predict(orjson.dumps({"rows": [ROW, item]}), "") is None  # left to the route above
    assert hot.predict_bulk_strict(orjson.dumps({"requests": [ROW, item]}), "") is None


# ----- HTTP: /v1/explain ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [("accelerator", "abacus"), ("model", "gpt-99")])
def test_explain_names_an_unknown_class_as_a_field_of_row(served: tuple[TestClient, Any], key: str, value: str) -> None:
    """The body holds one `row`: the error must name `row.accelerator`, not `rows[0].accelerator`."""
    http, _ = served
    response = http.post("/v1/explain", json={"row": {**ROW, key: value}})
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["field"] == f"row.{key}", body
    assert body["error"].startswith(f"row.{key}: "), body


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("kv_cache_percentage", "0.3"),
        ("input_token_length", "800"),
        ("num_request_waiting", True),
        ("tensor_parallel", "2"),
        ("timeslice_wait_ms", "5"),
        ("prefix_hit_tokens", "5"),
    ],
)
def test_explain_refuses_what_the_prediction_paths_refuse(served: tuple[TestClient, Any], key: str, value: Any) -> None:
    """A string or a bool where a number goes is 422 on /v1/predict; /v1/explain explained it as a number."""
    http, _ = served
    assert http.post("/v1/predict", json={"rows": [{**ROW, key: value}]}).status_code == 422
    response = http.post("/v1/explain", json={"row": {**ROW, key: value}})
    assert response.status_code == 422, response.text[:300]
    assert response.json()["field"] == f"row.{key}", response.text


def test_explain_still_explains_a_good_row(served: tuple[TestClient, Any]) -> None:
    http, _ = served
    response = http.post("/v1/explain", json={"row": {**ROW, "role": "prefill", "input_token_length": 800.0}})
    assert response.status_code == 200, response.text
    assert response.text.startswith("ttft: ")


def test_explain_takes_a_null_pod_type_as_predict_does(served: tuple[TestClient, Any]) -> None:
    """llm-d's clients send `pod_type: null` for a unified endpoint; /v1/predict took it and /v1/explain refused it."""
    http, _ = served
    assert http.post("/v1/predict", json={"rows": [{**ROW, "pod_type": None}]}).status_code == 200
    response = http.post("/v1/explain", json={"row": {**ROW, "pod_type": None}})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"row": {"kv_cache_percentage": NaN}}',
        b'{"row": {"kv_cache_percentage": Infinity}}',
        b'{"row": {"endpoint_id": "\\ud800"}}',  # a lone surrogate
        b"\xff\xfe",
    ],
)
def test_explain_reads_a_body_that_is_not_json_as_predict_does(served: tuple[TestClient, Any], body: bytes) -> None:
    """Explain parsed its body with pydantic's JSON reader: `[0]: JSON decode error` for what /v1/predict calls a
    body that is not JSON (400 naming `body`), and NaN read as a number "less than or equal to 1"."""
    http, _ = served
    headers = {"content-type": "application/json"}
    predicted = http.post("/v1/predict", content=body, headers=headers)
    explained = http.post("/v1/explain", content=body, headers=headers)
    assert predicted.status_code == 400 and predicted.json()["field"] == "body", predicted.text
    assert (explained.status_code, explained.json()) == (predicted.status_code, predicted.json())


def test_explain_names_a_number_too_large_for_a_double_as_predict_does(served: tuple[TestClient, Any]) -> None:
    """Valid JSON that orjson refuses (`1e309`) was a body "that is not JSON" on both; now the field is named."""
    http, _ = served
    headers = {"content-type": "application/json"}
    row = orjson.dumps({**ROW, "kv_cache_percentage": "@"}).replace(b'"@"', b"1e309")
    predicted = http.post("/v1/predict", content=b'{"rows": [%s]}' % row, headers=headers)
    explained = http.post("/v1/explain", content=b'{"row": %s}' % row, headers=headers)
    assert predicted.status_code == 422 and predicted.json()["field"] == "rows[0].kv_cache_percentage", predicted.text
    assert explained.status_code == 422 and explained.json()["field"] == "row.kv_cache_percentage", explained.text
    assert explained.json()["error"].split(": ", 1)[1] == predicted.json()["error"].split(": ", 1)[1]


@pytest.mark.parametrize(
    ("body", "field"),
    [([ROW], "body"), ("row", "body"), ({}, "row"), ({"row": None}, "row"), ({"row": 5}, "row"), ({"row": []}, "row")],
)
def test_explain_names_a_body_without_a_row_object(served: tuple[TestClient, Any], body: Any, field: str) -> None:
    """A body that is not an object is answered as /v1/predict answers one; a missing or non-object row is 422."""
    http, _ = served
    response = http.post("/v1/explain", json=body)
    expected = http.post("/v1/predict", json=body).status_code if field == "body" else 422
    assert response.status_code == expected, response.text
    assert response.json()["field"] == field and response.json()["error"].startswith(f"{field}: "), response.text


@pytest.mark.parametrize(
    "row",
    [
        ROW,
        {**ROW, "accelerator": "l40s", "endpoint_id": "pod-b", "role": "decode"},
        {**ROW, "timeslice_state": "parked", "timeslice_wait_ms": 1e300},  # /v1/predict caps it at 1e12 ms
    ],
)
def test_explain_headlines_the_numbers_predict_serves(served: tuple[TestClient, Any], row: dict[str, Any]) -> None:
    """The explanation's first lines are the prediction /v1/predict answers for the same row, cap included."""
    import re

    http, _ = served
    answer = http.post("/v1/predict", json={"rows": [row]}).json()
    text = http.post("/v1/explain", json={"row": row}).text
    for target in ("ttft", "tpot"):
        found = re.search(rf"^{target}: ([0-9.]+) ms \(p90 ([0-9.]+) ms\)", text, re.MULTILINE)
        assert found is not None, text[:300]
        mean, upper = float(found[1]), float(found[2])
        assert mean == pytest.approx(answer[f"{target}_mean_ms"][0], abs=0.006), (target, text[:300])
        assert upper == pytest.approx(answer[f"{target}_quantile_ms"][0], abs=0.006), (target, text[:300])


# ----- gRPC -------------------------------------------------------------------------------------------------------


def observation(**fields: Any) -> Any:
    return pb.Observation(row=pb.Row(**ROW), **{"actual_ttft_ms": 60.0, "actual_tpot_ms": 12.0, **fields})


def test_grpc_observation_without_a_row_is_invalid_argument_and_nothing_is_kept(
    served: tuple[TestClient, Any],
) -> None:
    """An Observation whose `row` is unset was learned as a row of zeros (no tokens, no load)."""
    http, stub = served
    before = accepted(http)
    request = pb.ObserveRequest(observations=[observation(), pb.Observation(actual_ttft_ms=60.0)])
    with pytest.raises(grpc.RpcError) as err:
        stub.Observe(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "observations[1].row" in err.value.details()
    assert accepted(http) == before


def test_grpc_takes_at_most_as_many_observations_a_call_as_http(served: tuple[TestClient, Any]) -> None:
    """Observe took 100,001 observations in one call where both HTTP paths refuse more than 100,000."""
    from leadtime.predictor.service.runtime import MAX_OBSERVATIONS_PER_CALL

    http, stub = served
    before = accepted(http)
    one = observation()
    request = pb.ObserveRequest(observations=[one] * (MAX_OBSERVATIONS_PER_CALL + 1))
    with pytest.raises(grpc.RpcError) as err:
        stub.Observe(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "observations" in err.value.details() and "100,000" in err.value.details()
    assert accepted(http) == before


def test_grpc_observe_stream_names_the_bad_batch_and_keeps_the_batches_before_it(
    served: tuple[TestClient, Any],
) -> None:
    """Batches are accepted on arrival: a bad one fails the call, and the error says which batch it was and that
    the ones before it were kept (the client must not send them again)."""
    http, stub = served
    before = accepted(http)
    batches = [
        pb.ObserveRequest(observations=[observation(), observation()]),
        pb.ObserveRequest(observations=[observation(), observation(actual_ttft_ms=-1.0)]),
    ]
    with pytest.raises(grpc.RpcError) as err:
        stub.ObserveStream(iter(batches), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details()
    assert "batches[1].observations[1].actual_ttft_ms" in details, details
    assert "2 observations" in details, details
    assert accepted(http) == before + 2


def test_grpc_observe_stream_says_what_was_kept_when_the_backlog_fills(
    served: tuple[TestClient, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full backlog in the middle of a stream failed it without saying that the batches before were kept."""
    http, stub = served
    runtime = http.app.state.runtime  # type: ignore[attr-defined]
    before = accepted(http)
    calls = iter([False, True])
    monkeypatch.setattr(runtime, "backlog_full", lambda: next(calls))  # full from the second batch on
    batches = [pb.ObserveRequest(observations=[observation()]) for _ in range(2)]
    with pytest.raises(grpc.RpcError) as err:
        stub.ObserveStream(iter(batches), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "batches[1]" in err.value.details() and "1 observations" in err.value.details(), err.value.details()
    assert accepted(http) == before + 1


# ----- leadtime serve ---------------------------------------------------------------------------------------------


def leadtime_serve(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `leadtime serve` to its end (a bad option ends it at once); (exit code, stderr). `env`: LEADTIME_
    variables to set."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LEADTIME_")}, **(env or {})}
    process = subprocess.run(
        [sys.executable, "-m", "leadtime", "serve", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
    )
    return process.returncode, process.stderr.decode().strip()


def assert_one_line(code: int, message: str, *words: str) -> None:
    assert code == 2, message
    assert len(message.splitlines()) == 1 and message.startswith("error: "), message
    assert "Traceback" not in message
    for word in words:
        assert word in message, message


def test_serve_refuses_the_same_port_for_http_and_grpc() -> None:
    """It started gRPC on the port, then uvicorn failed to bind it: log lines and exit code 3."""
    port = str(free_port())
    code, message = leadtime_serve("--port", port, "--grpc-port", port)
    assert_one_line(code, message, port, "gRPC", "HTTP")


def test_serve_refuses_tls_files_that_are_not_a_certificate_and_key(tmp_path: Path) -> None:
    """Garbage PEM files: gRPC's C core logged three lines and blamed the port; with gRPC off, uvicorn failed after
    the start-up log with "[ssl] pem lib". Now they are checked before either starts."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    with pytest.raises(OSError, match="are not a PEM certificate"):
        check_tls_files(cert, key)
    args = ("--port", str(free_port()), "--grpc-port", str(free_port()), "--tls-cert", str(cert), "--tls-key", str(key))
    code, message = leadtime_serve(*args)
    assert_one_line(code, message, str(cert), str(key))


def test_an_expired_certificate_is_refused_at_start(tmp_path: Path) -> None:
    """It was served: every client then refused it ("certificate has expired"), while the start-up said the
    files were checked."""
    import datetime

    from leadtime.bench.tls import self_signed

    cert, key = self_signed(tmp_path, expires_in=datetime.timedelta(days=-3))
    with pytest.raises(OSError, match=r"expired on .* every client would refuse it"):
        check_tls_files(cert, key)
    (tmp_path / "fresh").mkdir()
    check_tls_files(*self_signed(tmp_path / "fresh"))  # one valid for a day passes


def test_a_missing_tls_file_is_named_alone(tmp_path: Path) -> None:
    """`route --tls-cert /nonexistent.pem --tls-key key.pem` named both files, not which one is missing."""
    key = tmp_path / "key.pem"
    key.write_text("not a key\n")
    with pytest.raises(OSError) as caught:
        check_tls_files(tmp_path / "missing.pem", key)
    assert str(caught.value) == f"cannot read the TLS file '{tmp_path / 'missing.pem'}': no such file or directory"


@pytest.mark.parametrize(
    "url",
    [
        "redis://:secret@host:notaport/0",
        "redis://:secret@host:99999/0",
        "redis://:secret@[::1/0",
        "redis://:secret@host:6379/0?foo=bar",
        "redis://:secret@host:6379/0?socket_timeout=abc",
        "redis://:secret@host:6379/zero",
    ],
)
def test_an_unusable_redis_url_is_one_error_without_the_password(url: str) -> None:
    """A traceback before (a TypeError for an unknown query parameter); the password must never be shown."""
    with pytest.raises(StoreError) as caught:
        make_store(ServiceSettings(redis_url=url))
    assert "redis" in str(caught.value) and "secret" not in str(caught.value)


def test_serve_refuses_an_unusable_redis_url_in_one_line() -> None:
    url = "redis://:secret@host:6379/0?foo=bar"
    code, message = leadtime_serve("--port", str(free_port()), "--grpc-port", "0", "--redis", url)
    assert_one_line(code, message, "redis")
    assert "secret" not in message


def test_a_settings_error_that_names_no_field_reads_cleanly(tmp_path: Path) -> None:
    """It printed "error: : Value error, tls_certfile and ..."."""
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    code, message = leadtime_serve("--tls-cert", str(cert))
    assert_one_line(code, message, "--tls-cert and --tls-key go together")
    assert not message.startswith("error: :") and "Value error" not in message, message


def test_serve_refuses_a_model_dir_it_cannot_save_in(tmp_path: Path) -> None:
    """A file, or a path under a file: the service started, then logged a traceback at every retrain (saving the
    model failed) and never saved it."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(OSError, match="not a directory"):
        check_model_dir(afile / "models")
    check_model_dir(tmp_path / "new" / "models")  # missing directories are made
    assert (tmp_path / "new" / "models").is_dir() and not any((tmp_path / "new" / "models").iterdir())
    code, message = leadtime_serve("--port", str(free_port()), "--grpc-port", "0", "--model-dir", str(afile))
    assert_one_line(code, message, str(afile), "not a directory")


def test_serve_refuses_a_model_dir_that_cannot_be_made_even_as_root() -> None:
    """Under /proc nothing can be made, whatever the permissions say (root passes every access check): the
    service started, then logged a traceback at the first retrain."""
    with pytest.raises(OSError, match="cannot be written"):
        check_model_dir(Path("/proc/leadtime-models"))
    code, message = leadtime_serve("--port", str(free_port()), "--grpc-port", "0", "--model-dir", "/proc/leadtime")
    assert_one_line(code, message, "/proc/leadtime", "cannot be written")


def test_a_prediction_server_takes_a_model_dir_it_cannot_write_in() -> None:
    """It never saves there (the training server does), yet a read-only mount of the training server's directory,
    as a prediction pod would have it, was refused at start. /proc/self: a directory no file can be made in, even
    as root."""
    from leadtime.predictor.service.serve import check_model_dir_of

    check_model_dir_of(ServiceSettings(role="prediction", model_dir=Path("/proc/self")))
    for role in ("training", "all"):
        with pytest.raises(OSError, match="cannot be written"):
            check_model_dir_of(ServiceSettings(role=role, model_dir=Path("/proc/self")))


def test_a_second_server_learning_in_a_model_dir_without_redis_is_refused(tmp_path: Path) -> None:
    """Two servers learning without Redis on one directory each took up the other's saves as another process's
    model, by turns, dropping what each had learned since: nothing said so. Prediction servers, and replicas that
    share Redis (the lease holder alone saves), may share it."""
    from leadtime.predictor.service.serve import claim_model_dir

    first = claim_model_dir(ServiceSettings(model_dir=tmp_path, role="training"))
    assert first is not None
    try:
        with pytest.raises(OSError, match=f"another leadtime serve learns in {tmp_path} without Redis"):
            claim_model_dir(ServiceSettings(model_dir=tmp_path))
        assert claim_model_dir(ServiceSettings(model_dir=tmp_path, role="prediction")) is None
        assert claim_model_dir(ServiceSettings(model_dir=tmp_path, redis_url="redis://127.0.0.1:9")) is None
    finally:
        first.close()
    second = claim_model_dir(ServiceSettings(model_dir=tmp_path))  # the first one stopped
    assert second is not None
    second.close()


@pytest.mark.parametrize("token", ["", "   ", " padded ", "line\nbreak"])
def test_serve_refuses_an_api_token_no_client_could_send(token: str) -> None:
    """An empty `--api-token ""` left the write paths open without the warning that no token gives."""
    code, message = leadtime_serve("--port", str(free_port()), "--grpc-port", "0", "--api-token", token)
    assert_one_line(code, message, "--api-token (LEADTIME_API_TOKEN)")


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--allowed-host", ""], {}, "empty"),
        (["--allowed-host", "localhost:8000"], {}, "give the host without it ('localhost')"),
        (["--allowed-host", "http://leadtime.svc"], {}, "without scheme or path"),
        (["--allowed-host", "a.svc", "--allowed-host", "bad host"], {}, "spaces"),
        ([], {"LEADTIME_ALLOWED_HOSTS": "a.svc,,b.svc"}, "empty"),
        ([], {"LEADTIME_ALLOWED_HOSTS": ""}, "LEADTIME_ALLOWED_HOSTS is set but empty"),
    ],
)
def test_serve_refuses_an_allowed_host_no_host_header_could_match(
    args: list[str], env: dict[str, str], said: str
) -> None:
    """Found only when requests arrive, a mistyped entry would refuse every one (or leave a meant host out)."""
    code, message = leadtime_serve("--port", "47601", "--grpc-port", "0", *args, env=env)
    assert_one_line(code, message, said)
    if args:
        assert "--allowed-host (LEADTIME_ALLOWED_HOSTS)" in message, message


@pytest.mark.parametrize("variable", ["LEADTIME_API_TOKEN", "LEADTIME_TLS_CERTFILE", "LEADTIME_TLS_KEYFILE"])
def test_serve_refuses_a_secret_variable_set_but_empty(variable: str) -> None:
    """A Kubernetes Secret with an empty or missing key gives `LEADTIME_API_TOKEN=`: it was read as no token, and
    the write paths were open (the TLS files alike: plain HTTP), while `--api-token ""` is refused."""
    code, message = leadtime_serve("--port", str(free_port()), "--grpc-port", "0", env={variable: ""})
    assert_one_line(code, message, variable, "set but empty")
