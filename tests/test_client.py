"""The Python clients the router plugin uses: real HTTP (uvicorn) and gRPC servers, deadlines, errors."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from concurrent import futures
from decimal import Decimal
from typing import Any

import grpc
import numpy as np
import pytest
from served import uvicorn_in_a_thread
from threaded_server import serve_in_a_thread

from leadtime.bench.procs import free_port
from leadtime.features.rows import EndpointState, FeatureRow, Observation, RequestFeatures
from leadtime.predictor.client import (
    GrpcPredictorClient,
    HttpPredictorClient,
    PredictorError,
    PredictorUnavailable,
)
from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.grpc import leadtime_pb2_grpc as pb_grpc
from leadtime.predictor.grpc.server import start_grpc_server
from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings
from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient


@pytest.fixture(scope="module")
def service() -> Iterator[dict[str, Any]]:
    """A real uvicorn server and gRPC server on loopback, sharing one runtime."""
    app = create_app(ServiceSettings(api_token="tok"))
    with uvicorn_in_a_thread(app) as url:
        grpc_server, grpc_port = start_grpc_server(app.state.runtime, "127.0.0.1", 0)
        try:
            yield {"http": url, "grpc": f"127.0.0.1:{grpc_port}", "app": app}
        finally:
            grpc_server.stop(grace=None)


def feature_row(endpoint: str = "e1", accelerator: str = "h100-sxm") -> FeatureRow:
    return FeatureRow(
        RequestFeatures(input_tokens=900, prefix_cache_score=0.1),
        EndpointState(endpoint_id=endpoint, accelerator=accelerator, num_request_running=5, kv_cache_percentage=0.2),
    )


def remote_client(kind: str, service: dict[str, Any]) -> Any:
    if kind == "http":
        return HttpPredictorClient(service["http"], deadline_s=2.0, api_token="tok")
    return GrpcPredictorClient(service["grpc"], deadline_s=2.0, api_token="tok")


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, service: dict[str, Any]) -> Iterator[Any]:
    with remote_client(request.param, service) as c:
        yield c


def test_predict_takes_feature_rows_and_dicts(client: Any, service: dict[str, Any]) -> None:
    rows = [feature_row(), feature_row(accelerator="l40s"), {**_dict_row(), "role": "decode"}]
    serving = service["app"].state.runtime.predictor.version
    p = client.predict(rows)
    assert p.ttft_mean_ms.shape == (3,) and p.quantile == pytest.approx(0.9)
    assert (p.ttft_quantile_ms >= p.ttft_mean_ms).all() and (p.tpot_quantile_ms >= p.tpot_mean_ms).all()
    assert p.tpot_mean_ms[1] > p.tpot_mean_ms[0]
    assert p.model_version == serving  # the version of the model that answered


def _dict_row() -> dict[str, Any]:
    return {
        "kv_cache_percentage": 0.2,
        "input_token_length": 900,
        "num_request_waiting": 0,
        "num_request_running": 5,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.1,
    }


def test_observe_and_status(client: Any) -> None:
    obs = Observation(feature_row(endpoint="slow"), actual_ttft_ms=5000.0, predicted_ttft_ms=120.0)
    assert client.observe([obs, {**_dict_row(), "actual_ttft_ms": 0.0, "actual_tpot_ms": 14.0}]) == 2
    status = client.status()
    assert status["is_ready"] is True and status["objective_type"] == "quantile"


def test_grpc_observe_stream(service: dict[str, Any]) -> None:
    with GrpcPredictorClient(service["grpc"], deadline_s=2.0, api_token="tok") as c:
        batches = [[Observation(feature_row(), actual_tpot_ms=11.0 + i)] for i in range(3)]
        assert c.observe_stream(batches) == 3


def test_refusals_raise_predictor_error_naming_the_field(client: Any) -> None:
    with pytest.raises(PredictorError) as err:
        client.predict([{**_dict_row(), "kv_cache_percentage": 7.0}])
    assert not isinstance(err.value, PredictorUnavailable)
    assert "kv_cache_percentage" in err.value.message


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kv_cache_percentage": float("nan")}, "kv_cache_percentage"),  # HTTP: a bare ValueError from the encoder
        ({"kv_cache_percentage": None}, "kv_cache_percentage"),  # gRPC: predicted as 0 without a word
        ({"num_request_running": -1}, "num_request_running"),  # gRPC: "Value out of range: -1", no field named
        ({"num_request_waiting": "two"}, "num_request_waiting"),
    ],
)
def test_rows_either_client_cannot_send_raise_predictor_error_naming_the_field(
    client: Any, change: dict[str, Any], field: str
) -> None:
    row = {k: v for k, v in {**_dict_row(), **change}.items() if v is not None}
    with pytest.raises(PredictorError) as err:
        client.predict([_dict_row(), row])
    assert not isinstance(err.value, PredictorUnavailable)
    assert field in err.value.message, err.value.message


def test_a_zero_deadline_is_a_zero_deadline_not_the_default(client: Any) -> None:
    with pytest.raises(PredictorUnavailable):
        client.predict([_dict_row()], deadline_s=0.0)


def test_a_missing_token_is_refused(service: dict[str, Any]) -> None:
    with HttpPredictorClient(service["http"], deadline_s=2.0) as c, pytest.raises(PredictorError) as err:
        c.observe([Observation(feature_row(), actual_ttft_ms=100.0)])
    assert err.value.status == 401
    with GrpcPredictorClient(service["grpc"], deadline_s=2.0) as g, pytest.raises(PredictorError) as gerr:
        g.observe([Observation(feature_row(), actual_ttft_ms=100.0)])
    assert gerr.value.status == "UNAUTHENTICATED"


def test_llmd_calls_through_the_http_client(service: dict[str, Any]) -> None:
    with HttpPredictorClient(service["http"], deadline_s=2.0, api_token="tok") as c:
        answers = c.predict_llmd([_dict_row(), feature_row()])
        assert len(answers) == 2 and answers[0]["model_type"] == "lightgbm"
        entry = {**_dict_row(), "actual_ttft_ms": 200.0, "actual_tpot_ms": 0.0}
        assert c.add_training_data([entry]) == "Accepted 1 training samples."


def test_an_absent_service_is_unavailable_within_the_deadline() -> None:
    port = free_port()  # nothing listens here
    for client in (
        HttpPredictorClient(f"http://127.0.0.1:{port}", deadline_s=0.2),
        GrpcPredictorClient(f"127.0.0.1:{port}", deadline_s=0.2),
    ):
        started = time.monotonic()
        with client, pytest.raises(PredictorUnavailable):
            client.predict([_dict_row()])
        assert time.monotonic() - started < 2.0


def test_a_slow_service_hits_the_deadline() -> None:
    """A listener that accepts and never answers: the call must give up at its deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with HttpPredictorClient(f"http://127.0.0.1:{port}", deadline_s=0.3) as c:
            started = time.monotonic()
            with pytest.raises(PredictorUnavailable) as err:
                c.predict([_dict_row()])
            assert err.value.status == "deadline"
            assert 0.25 < time.monotonic() - started < 2.0


async def _trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A stalled predictor (a GC pause, swapping, an overloaded proxy) answering a byte every 50 ms."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-l"))
    await reader.readexactly(length)
    body = b'{"status": "ok"}' + b" " * 160  # 176 bytes, 0.05 s apart: ~9 s in all
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    for byte in body:
        writer.write(bytes([byte]))
        await writer.drain()
        await asyncio.sleep(0.05)
    writer.close()


@pytest.mark.parametrize("kind", ["httpx", "lean"])
def test_a_service_trickling_its_answer_is_cut_at_the_deadline(kind: str) -> None:
    """The deadline is the whole call's, not each read's: an answer coming a byte at a time (every 0.05 s, ~9 s in
    all) is given up at 0.2 s."""
    port, loop = serve_in_a_thread(_trickle)
    url = f"http://127.0.0.1:{port}"
    client = HttpPredictorClient(url, deadline_s=0.2) if kind == "httpx" else LeanHttpPredictorClient(url, 0.2)
    try:
        started = time.monotonic()
        with pytest.raises(PredictorUnavailable) as err:
            client.predict([_dict_row()])
        assert err.value.status == "deadline"
        assert time.monotonic() - started < 2.0  # at the deadline, not at the answer's end (a generous bound)
    finally:
        client.close()
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_a_closed_client_is_unavailable_so_routers_fall_back(kind: str, service: dict[str, Any]) -> None:
    """A closed HTTP client raised httpx's RuntimeError, a closed gRPC one a ValueError: a router's pick crashed
    instead of falling back on the heuristics, which it does on PredictorUnavailable."""
    c: Any = (
        HttpPredictorClient(service["http"], deadline_s=2.0)
        if kind == "http"
        else GrpcPredictorClient(service["grpc"], deadline_s=2.0)
    )
    c.close()
    with pytest.raises(PredictorUnavailable, match="closed"):
        c.predict([feature_row()])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"role": "bogus"}, "role"),  # gRPC: the role dropped, predicted as unified
        ({"tensor_parallel": 0}, "tensor_parallel"),  # gRPC: 0 reads as 1 on the wire
    ],
)
def test_what_the_grpc_wire_would_misread_is_refused_as_over_http(
    client: Any, change: dict[str, Any], field: str
) -> None:
    with pytest.raises(PredictorError) as err:
        client.predict([_dict_row(), {**_dict_row(), **change}])
    assert not isinstance(err.value, PredictorUnavailable)
    assert f"rows[1].{field}" in err.value.message, err.value.message


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kv_cache_percentage": None}, "kv_cache_percentage"),  # gRPC: learned as 0
        ({"actual_ttft_ms": "80"}, "actual_ttft_ms"),  # gRPC: "observation cannot be encoded", no index or field
        ({"timestamp": "yesterday"}, "timestamp"),  # gRPC: the timestamp dropped, the row kept
        ({"predicted_ttft": 40.0}, "predicted_ttft"),  # gRPC: dropped unseen, where HTTP refuses the slip
    ],
)
def test_observations_either_client_cannot_send_raise_predictor_error_naming_the_field(
    client: Any, change: dict[str, Any], field: str
) -> None:
    good = {**_dict_row(), "actual_ttft_ms": 80.0, "actual_tpot_ms": 20.0}
    bad = {k: v for k, v in {**good, **change}.items() if v is not None}
    with pytest.raises(PredictorError) as err:
        client.observe([good, bad])
    assert not isinstance(err.value, PredictorUnavailable)
    assert f"observations[1].{field}" in err.value.message, err.value.message


def test_a_row_that_is_not_a_row_is_a_predictor_error(client: Any) -> None:
    with pytest.raises(PredictorError) as err:
        client.predict([_dict_row(), "abc"])
    assert "rows[1]" in err.value.message, err.value.message
    with pytest.raises(PredictorError) as err:
        client.observe(["abc"])
    assert err.value.message == "observations[0]: must be an Observation or a mapping of its fields, got str"


def test_the_grpc_client_sends_a_timestamp_given_as_text_or_a_datetime() -> None:
    """Text was dropped, and a datetime refused ("must be real number, not datetime.datetime", where HTTP takes
    it): the wire carries seconds since the epoch."""
    from datetime import UTC, datetime

    from leadtime.predictor.client import observation_message

    for stamp in ("2026-11-30T10:00:00Z", datetime(2026, 11, 30, 10, tzinfo=UTC)):
        entry = {**_dict_row(), "actual_ttft_ms": 80.0, "timestamp": stamp}
        assert observation_message(entry).timestamp == 1796032800.0


def test_a_bad_batch_in_a_grpc_stream_is_named_and_what_went_before_counted(service: dict[str, Any]) -> None:
    """The client's own refusal inside the stream reached the caller as gRPC's "UNKNOWN: Exception iterating
    requests!", the field and the count of what was kept lost."""
    good = {**_dict_row(), "actual_ttft_ms": 80.0, "actual_tpot_ms": 20.0}
    bad = {k: v for k, v in good.items() if k != "kv_cache_percentage"}
    with GrpcPredictorClient(service["grpc"], deadline_s=5.0, api_token="tok") as c:
        with pytest.raises(PredictorError) as err:
            c.observe_stream([[good, good], [bad]])
        assert not isinstance(err.value, PredictorUnavailable)
        assert err.value.message == (
            "batches[1].observations[0].kv_cache_percentage: is required "
            "(2 observations of the batches before it were accepted)"
        )

        def failing() -> Iterator[list[dict[str, Any]]]:
            yield [good]
            raise RuntimeError("the caller's own source broke")

        with pytest.raises(RuntimeError, match="source broke") as broke:
            c.observe_stream(failing())
        assert "1 observations of the batches before it were accepted" in "".join(broke.value.__notes__)


@pytest.fixture(params=["http", "grpc", "in-process"])
def any_client(request: pytest.FixtureRequest, service: dict[str, Any]) -> Iterator[Any]:
    """Each implementation of the router plugin's PredictorClient."""
    if request.param == "in-process":
        from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
        from leadtime.router_plugin.client import InProcessPredictor

        yield InProcessPredictor(OnlinePredictor(LearnerConfig(background=False)))
        return
    with remote_client(request.param, service) as remote:
        yield remote


def test_every_client_answers_nothing_alike(any_client: Any) -> None:
    """Swapping one PredictorClient for another changes nothing at the edges: an empty predict call is refused by
    each, naming rows (the service refuses it, as llm-d does; in process it returned empty arrays), and an empty
    observe call accepts none (over HTTP it was a 422, over gRPC and in process 0)."""
    with pytest.raises(PredictorError, match=r"rows: .*got 0"):
        any_client.predict([])
    assert any_client.observe([]) == 0


@pytest.mark.parametrize(
    "change",
    [
        {"num_request_running": -1},  # gRPC said protobuf's "Value out of range: -1"
        {"input_token_length": 1.5},  # gRPC: "'float' object cannot be interpreted as an integer"
        {"num_request_waiting": "two"},
        {"accelerator": "nope"},  # gRPC named "columns[1].accelerator": the caller gave rows
        {"acelerator": "l40s"},  # gRPC dropped the key: the row was predicted as the default class's
        {"prefix_cache_score": "0.5"},  # gRPC said protobuf's "must be real number, not str"
        {"tensor_parallel": 0.5},  # both said "must be an integer ≥ 0": the least is 1
    ],
)
def test_both_remote_clients_refuse_a_bad_row_in_the_same_words(service: dict[str, Any], change: dict) -> None:
    """Swapping the HTTP client for the gRPC one (the gateway's `--predictor-grpc`) changes no error message."""
    messages = []
    for kind in ("http", "grpc"):
        with remote_client(kind, service) as c, pytest.raises(PredictorError) as err:
            c.predict([_dict_row(), {**_dict_row(), **change}])
        messages.append(err.value.message)
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"rows[1].{next(iter(change))}: "), messages[0]
    if "tensor_parallel" in change:
        assert messages[0] == "rows[1].tensor_parallel: must be an integer ≥ 1, got 0.5"


def test_both_remote_clients_take_counts_given_as_integral_floats(service: dict[str, Any]) -> None:
    """JSON encoders differ: 900.0 is a count over HTTP (the service takes it), and the gRPC client refused it.
    Each call holds the plain row beside it: the module's service learns meanwhile, so calls apart may differ."""
    row = {**_dict_row(), "input_token_length": 900.0, "num_request_running": np.int64(5)}
    with remote_client("http", service) as http, remote_client("grpc", service) as grpc_client:
        for c in (http, grpc_client):
            ttft = c.predict([_dict_row(), row]).ttft_mean_ms
            assert ttft[0] == ttft[1], ttft


def test_a_row_json_cannot_carry_is_a_predictor_error_over_http(service: dict[str, Any]) -> None:
    """It was the JSON encoder's bare TypeError, raised through the caller."""
    with remote_client("http", service) as c, pytest.raises(PredictorError) as err:
        c.predict([{**_dict_row(), "num_request_waiting": Decimal(2)}])
    assert "cannot be sent as JSON" in err.value.message and "Decimal" in err.value.message, err.value.message


@pytest.mark.parametrize("deadline", [None, 0, -1, float("inf"), float("nan"), "1"])
@pytest.mark.parametrize("kind", ["http", "grpc", "lean-http"])
def test_a_client_without_a_usable_default_deadline_is_refused_when_made(kind: str, deadline: Any) -> None:
    """None made the gRPC client wait for ever on a stopped service (its docstring: every call has a deadline), and
    the HTTP client raise a TypeError at its first call; -1 a raw ValueError from the socket."""
    make = {"http": HttpPredictorClient, "lean-http": LeanHttpPredictorClient}.get(kind)
    with pytest.raises(ValueError, match=r"deadline_s: must be a number of seconds > 0"):
        if make is not None:
            make("http://127.0.0.1:9", deadline_s=deadline)
        else:
            GrpcPredictorClient("127.0.0.1:9", deadline_s=deadline)


@pytest.mark.parametrize("token", ["s3cret\n", "sécret", "s3 cret"])
@pytest.mark.parametrize("kind", ["http", "grpc", "lean-http"])
def test_a_token_no_header_can_carry_is_refused_when_made(kind: str, token: str) -> None:
    """Regression: taken, it failed every call, each client its own way (gRPC INTERNAL "Invalid metadata", httpx a
    UnicodeEncodeError or an outage, the lean client a 400 from the service, or sent as bytes no service compares
    equal), where `leadtime serve` and `route` refuse such a token at start."""
    make = {"http": HttpPredictorClient, "lean-http": LeanHttpPredictorClient}.get(kind)
    with pytest.raises(ValueError, match=r"api_token: must be printable ASCII"):
        if make is not None:
            make("http://127.0.0.1:9", api_token=token)
        else:
            GrpcPredictorClient("127.0.0.1:9", api_token=token)


def test_a_grpc_target_given_as_a_url_is_refused_when_made() -> None:
    """It was taken, and every call then failed as UNAVAILABLE ("Misformatted domain name"), which reads as an
    outage to wait out."""
    with pytest.raises(ValueError, match=r"expected HOST:PORT"):
        GrpcPredictorClient("http://127.0.0.1:50051")


def test_too_many_rows_are_named_as_rows_by_both_remote_clients(service: dict[str, Any]) -> None:
    """The gRPC client passed on the service's "columns: must hold 1 to 10,000 rows": the caller gave rows."""
    messages = []
    for kind in ("http", "grpc"):
        with remote_client(kind, service) as c, pytest.raises(PredictorError) as err:
            c.predict([_dict_row()] * 10_001)
        messages.append(err.value.message)
    assert messages[1].startswith("rows: ") and "10,001" in messages[1], messages
    assert messages[0].startswith("rows: "), messages


@pytest.mark.parametrize("kind", ["http", "lean-http"])
def test_a_predictor_answering_a_redirect_is_a_predictor_error_naming_where(kind: str) -> None:
    """A front redirecting http to https: the clients read the empty answer as the predictions, and raised
    "'NoneType' object is not subscriptable" (a TypeError, not a PredictorError, so a client bug to the gateway).
    Redirects are not followed: a token would go where the caller did not send it."""
    import http.server
    import threading

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the standard library's name
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(308)
            self.send_header("Location", "https://127.0.0.1:8443/v1/predict")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    client = HttpPredictorClient(url, deadline_s=5.0) if kind == "http" else LeanHttpPredictorClient(url, 5.0)
    try:
        with pytest.raises(PredictorError) as err:
            client.predict([_dict_row()])
        assert not isinstance(err.value, PredictorUnavailable)
        assert err.value.status == 308 and "https://127.0.0.1:8443/v1/predict" in err.value.message, err.value
    finally:
        client.close()
        server.shutdown()


def _canned(answer: bytes) -> tuple[str, socket.socket]:
    """A loopback service answering every HTTP request with `answer`, byte for byte; its URL and listening socket."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def handle(conn: socket.socket) -> None:
        with conn:
            try:
                while True:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(1 << 16)
                        if not chunk:
                            return
                        data += chunk
                    head, _, rest = data.partition(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    while len(rest) < length:
                        rest += conn.recv(1 << 16)
                    conn.sendall(answer)
            except OSError:
                return

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


def _answer(body: bytes, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 200 OK\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


@pytest.mark.parametrize("kind", ["http", "lean-http"])
@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (_answer(b"<html>hi</html>", "Content-Type: text/html"), "invalid_answer"),
        (_answer(b"{}"), "invalid_answer"),
        (_answer(b'{"ttft_mean_ms": [1.0]}'), "invalid_answer"),
        (_answer(b"[1, 2]"), "invalid_answer"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "transport"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "transport"),
    ],
    ids=["html", "empty-object", "fields-missing", "not-an-object", "not-http", "bad-content-length"],
)
def test_a_predictor_answering_what_is_not_an_answer_is_a_predictor_error(
    kind: str, answer: bytes, expected: str
) -> None:
    """Regression: a 200 whose body was not JSON (an HTML page from a proxy) or lacked the predictions escaped the
    clients as a raw orjson.JSONDecodeError or KeyError, and the lean client's status line or Content-Length it
    could not parse as an IndexError or ValueError, its socket left open: the module promises PredictorError or
    PredictorUnavailable for any failed call, which is what a router falls back on."""
    url, listener = _canned(answer)
    client = HttpPredictorClient(url, deadline_s=2.0) if kind == "http" else LeanHttpPredictorClient(url, 2.0)
    try:
        with pytest.raises(PredictorError) as err:
            client.predict([_dict_row()])
        assert err.value.status == expected, err.value
        assert isinstance(err.value, PredictorUnavailable) == (expected == "transport"), err.value
        if isinstance(client, LeanHttpPredictorClient) and expected == "transport":
            assert client._sock is None  # closed: what is left of that answer must not be read as the next one's
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize("kind", ["http", "lean-http"])
def test_an_observation_answer_without_its_count_is_a_predictor_error(kind: str) -> None:
    """Regression: a 200 to POST /v1/observations without `accepted` escaped as a raw KeyError."""
    url, listener = _canned(_answer(b'{"ok": true}'))
    client = HttpPredictorClient(url, deadline_s=2.0) if kind == "http" else LeanHttpPredictorClient(url, 2.0)
    try:
        with pytest.raises(PredictorError) as err:
            client.observe([])
        assert err.value.status == "invalid_answer" and "accepted" in err.value.message, err.value
    finally:
        client.close()
        listener.close()


def test_a_corrupt_gzip_answer_is_the_predictor_unavailable() -> None:
    """Regression: a 200 saying Content-Encoding: gzip over a body that is not gzip escaped the httpx client as
    httpx.DecodingError (only httpx.TransportError was caught). The transport delivered it corrupt: an outage."""
    url, listener = _canned(_answer(b"abcde", "Content-Encoding: gzip"))
    client = HttpPredictorClient(url, deadline_s=2.0)
    try:
        with pytest.raises(PredictorUnavailable) as err:
            client.predict([_dict_row()])
        assert err.value.status == "transport", err.value
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize("deadline", [0, 0.0, -1.0])
def test_the_lean_client_reads_a_zero_deadline_as_no_time_left_not_the_default(deadline: float) -> None:
    """Regression: the lean HTTP client read a per-call deadline of 0 as "none given" and waited its whole default
    (5 s here, on a predictor that never answers) where the other clients fail at once (`call_deadline`)."""
    listener = socket.create_server(("127.0.0.1", 0))  # connects (the backlog), never answers
    client = LeanHttpPredictorClient(f"http://127.0.0.1:{listener.getsockname()[1]}", deadline_s=5.0)
    try:
        started = time.monotonic()
        with pytest.raises(PredictorUnavailable) as err:
            client.predict([_dict_row()], deadline_s=deadline)
        assert err.value.status == "deadline" and time.monotonic() - started < 1.0, err.value
    finally:
        client.close()
        listener.close()


def test_a_grpc_answer_without_one_prediction_per_row_is_an_invalid_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the gRPC client handed on an answer holding fewer predictions than the rows sent (here
    `tpot_quantile_ms` one short) as it came: a caller indexing by row read past it, or a neighbour's."""
    short = pb.PredictBulkResponse(
        ttft_mean_ms=[1.0, 2.0],
        ttft_quantile_ms=[1.0, 2.0],
        tpot_mean_ms=[1.0, 2.0],
        tpot_quantile_ms=[1.0],
        model_version=1,
        quantile=0.9,
    )
    client = GrpcPredictorClient("127.0.0.1:9", deadline_s=1.0)
    monkeypatch.setattr(client, "_call", lambda *args: short)
    try:
        with pytest.raises(PredictorError) as err:
            client.predict([_dict_row(), _dict_row()])
        assert err.value.status == "invalid_answer" and not isinstance(err.value, PredictorUnavailable)
        assert "tpot_quantile_ms" in err.value.message and "1 predictions for 2 rows" in err.value.message
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["http", "lean-http"])
def test_a_native_answer_without_one_prediction_per_row_is_an_invalid_answer(kind: str) -> None:
    """Regression: BulkPredictions.from_native took an answer whose arrays were shorter (or longer) than the rows
    sent as it came, for each HTTP client."""
    fields = {"ttft_mean_ms": [1.0, 2.0], "ttft_quantile_ms": [1.0, 2.0], "tpot_mean_ms": [1.0, 2.0, 3.0]}
    body = {**fields, "tpot_quantile_ms": [1.0, 2.0], "model_version": 1, "quantile": 0.9}
    url, listener = _canned(_answer(json.dumps(body).encode()))
    client = HttpPredictorClient(url, deadline_s=2.0) if kind == "http" else LeanHttpPredictorClient(url, 2.0)
    try:
        with pytest.raises(PredictorError) as err:
            client.predict([_dict_row(), _dict_row()])
        assert err.value.status == "invalid_answer" and "tpot_mean_ms: 3 predictions for 2 rows" in err.value.message
    finally:
        client.close()
        listener.close()


def test_a_grpc_predictor_back_after_an_outage_is_answering_again_within_seconds(service: dict[str, Any]) -> None:
    """Regression: the gRPC client kept gRPC's own reconnect backoff, which grows 1.6-fold per failed attempt up to
    two minutes while the predictor is away: back after 30 s away, it was first reached 17 s later (62 s later
    after two minutes away), every decision falling back to the heuristics meanwhile, where the HTTP clients
    reached it at once. Here 10 s away (gRPC's own gaps between attempts are 4–6 s by then), then reached
    within 2.5 s."""
    runtime = service["app"].state.runtime
    port = free_port()
    server, _ = start_grpc_server(runtime, "127.0.0.1", port)
    client = GrpcPredictorClient(f"127.0.0.1:{port}", deadline_s=2.0)
    try:
        client.predict([feature_row()])
        server.stop(grace=None).wait()
        back_at = time.monotonic() + 10.0
        while time.monotonic() < back_at:  # a gateway's breaker tries it about once a second meanwhile
            with pytest.raises(PredictorUnavailable):
                client.predict([feature_row()], deadline_s=0.05)
            time.sleep(0.5)
        server, _ = start_grpc_server(runtime, "127.0.0.1", port)
        back = time.monotonic()
        while True:
            try:
                client.predict([feature_row()], deadline_s=0.5)
                break
            except PredictorUnavailable:
                assert time.monotonic() - back < 2.5, "the predictor, back, is still not reached"
                time.sleep(0.1)
    finally:
        client.close()
        server.stop(grace=None)


def test_a_grpc_answer_larger_than_grpcs_default_limit_is_read() -> None:
    """Regression: the gRPC client kept gRPC's default 4 MiB limit on what it receives, so the answer to about
    130,000 rows or more (a service given a larger LEADTIME_MAX_ROWS takes them) was thrown away once the service
    had computed it (RESOURCE_EXHAUSTED, which a gateway counts as the rows refused). Here a predictor answering
    140,000 predictions to one row: the answer is read whole, and refused for what it holds."""
    many = [1.0] * 140_000  # 4 arrays of 8-byte doubles: about 4.5 MB

    class Oversized(pb_grpc.PredictorServicer):
        def PredictBulk(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
            return pb.PredictBulkResponse(
                ttft_mean_ms=many, ttft_quantile_ms=many, tpot_mean_ms=many, tpot_quantile_ms=many, quantile=0.9
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_PredictorServicer_to_server(Oversized(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = GrpcPredictorClient(f"127.0.0.1:{port}", deadline_s=10.0)
    try:
        with pytest.raises(PredictorError) as err:
            client.predict([_dict_row()])
        assert err.value.status == "invalid_answer", err.value
        assert "140000 predictions for 1 rows" in err.value.message
    finally:
        client.close()
        server.stop(grace=None)
