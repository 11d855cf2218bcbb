"""The gRPC API (leadtime.v1): PredictBulk, Observe (batch and client stream), Status, errors and auth."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from served import http_and_grpc
from waiting import wait_for

from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.grpc import leadtime_pb2_grpc as pb_grpc
from leadtime.predictor.grpc.server import serve_grpc, start_grpc_server
from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings


def row(**overrides: Any) -> Any:
    fields: dict[str, Any] = dict(
        kv_cache_percentage=0.2,
        input_token_length=700,
        num_request_waiting=1,
        num_request_running=4,
        num_tokens_generated=0,
        prefix_cache_score=0.0,
    )
    fields.update(overrides)
    return pb.Row(**fields)


@pytest.fixture
def served() -> Iterator[tuple[TestClient, Any]]:
    """An app (HTTP through TestClient) and a gRPC stub on the same runtime."""
    with http_and_grpc(ServiceSettings(api_token="tok", max_body_bytes=200_000)) as served:
        yield served


def test_predict_bulk_answers_per_row_and_matches_http(served: tuple[TestClient, Any]) -> None:
    http, stub = served
    rows = [row(), row(input_token_length=4000), row(accelerator="l40s", endpoint_id="e1")]
    answer = stub.PredictBulk(pb.PredictBulkRequest(rows=rows), timeout=5)
    assert len(answer.ttft_mean_ms) == 3 and len(answer.tpot_quantile_ms) == 3
    assert answer.ttft_mean_ms[1] > answer.ttft_mean_ms[0]
    assert answer.tpot_mean_ms[2] > answer.tpot_mean_ms[0]
    assert all(q >= m for q, m in zip(answer.ttft_quantile_ms, answer.ttft_mean_ms, strict=True))
    assert answer.quantile == pytest.approx(0.9) and answer.objective_type == "quantile"
    native = http.post(
        "/v1/predict",
        json={
            "rows": [
                {
                    "kv_cache_percentage": 0.2,
                    "input_token_length": 700,
                    "num_request_waiting": 1,
                    "num_request_running": 4,
                    "num_tokens_generated": 0,
                    "prefix_cache_score": 0.0,
                }
            ]
        },
    ).json()
    assert answer.ttft_mean_ms[0] == pytest.approx(native["ttft_mean_ms"][0])


def test_bad_rows_are_invalid_argument_naming_the_field(served: tuple[TestClient, Any]) -> None:
    _, stub = served
    with pytest.raises(grpc.RpcError) as err:
        stub.PredictBulk(pb.PredictBulkRequest(rows=[row(), row(kv_cache_percentage=2.0)]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rows[1].kv_cache_percentage" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.PredictBulk(pb.PredictBulkRequest(rows=[]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.PredictBulk(pb.PredictBulkRequest(rows=[row(accelerator="abacus")]), timeout=5)
    assert "rows[0].accelerator" in err.value.details()


def test_rows_sent_as_columns_answer_as_row_messages_do(served: tuple[TestClient, Any]) -> None:
    from leadtime.predictor.client import row_columns

    _, stub = served
    rows = [row(), row(input_token_length=4000, pod_type="decode"), row(accelerator="l40s", endpoint_id="e1")]
    as_rows = stub.PredictBulk(pb.PredictBulkRequest(rows=rows), timeout=5)
    dicts = [{field.name: value for field, value in r.ListFields()} for r in rows]
    as_columns = stub.PredictBulk(pb.PredictBulkRequest(columns=row_columns(dicts)), timeout=5)
    assert as_columns == as_rows
    with pytest.raises(grpc.RpcError) as err:
        stub.PredictBulk(pb.PredictBulkRequest(rows=rows, columns=row_columns(dicts)), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rows or columns" in err.value.details()
    bad = row_columns(dicts)
    bad.kv_cache_percentage[1] = 3.0
    with pytest.raises(grpc.RpcError) as err:
        stub.PredictBulk(pb.PredictBulkRequest(columns=bad), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "columns[1].kv_cache_percentage" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.PredictBulk(pb.PredictBulkRequest(columns=pb.RowColumns()), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1 to" in err.value.details()


def test_messages_over_the_size_limit_are_refused(served: tuple[TestClient, Any]) -> None:
    _, stub = served
    with pytest.raises(grpc.RpcError) as err:
        stub.PredictBulk(pb.PredictBulkRequest(rows=[row(endpoint_id="x" * 1000)] * 300), timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def observation(i: int) -> Any:
    return pb.Observation(
        row=row(input_token_length=100 + i),
        actual_ttft_ms=80.0 + i,
        actual_tpot_ms=0.0,
        predicted_ttft_ms=70.0,
        predicted_ttft_quantile_ms=95.0,
    )


def test_observe_needs_the_token_and_is_learned(served: tuple[TestClient, Any]) -> None:
    http, stub = served
    request = pb.ObserveRequest(observations=[observation(i) for i in range(20)])
    with pytest.raises(grpc.RpcError) as err:
        stub.Observe(request, timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    auth = (("authorization", "Bearer tok"),)
    assert stub.Observe(request, timeout=5, metadata=auth).accepted == 20
    batches = iter([pb.ObserveRequest(observations=[observation(i)]) for i in range(5)])
    assert stub.ObserveStream(batches, timeout=5, metadata=auth).accepted == 5
    bad = pb.ObserveRequest(observations=[pb.Observation(row=row(), actual_ttft_ms=-1.0)])
    with pytest.raises(grpc.RpcError) as err:
        stub.Observe(bad, timeout=5, metadata=auth)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "observations[0].actual_ttft_ms" in err.value.details()
    absurd = pb.ObserveRequest(observations=[pb.Observation(row=row(), actual_ttft_ms=0.5, predicted_ttft_ms=1.7e308)])
    with pytest.raises(grpc.RpcError) as err:  # as over HTTP: above what the service ever serves
        stub.Observe(absurd, timeout=5, metadata=auth)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "observations[0].predicted_ttft_ms" in err.value.details()
    implausible = pb.Observation(row=row(), actual_ttft_ms=1e-6, predicted_ttft_ms=70.0, predicted_ttft_quantile_ms=1.0)
    assert stub.Observe(pb.ObserveRequest(observations=[implausible]), timeout=5, metadata=auth).accepted == 1
    runtime = http.app.state.runtime  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30  # the learner process starts first: seconds on a loaded machine
    while runtime.learned()["ttft"] < 25 and time.monotonic() < deadline:
        time.sleep(0.02)
    status = stub.Status(pb.StatusRequest(), timeout=5)
    assert status.is_ready and status.observations["ttft"] == 25 and status.role == "all"
    assert status.components["store"] == "ok" and status.holds_training_lease
    metrics = http.get("/metrics").text
    assert 'leadtime_grpc_requests_total{code="OK",method="Observe"} 2.0' in metrics
    assert 'leadtime_grpc_requests_total{code="UNAUTHENTICATED",method="Observe"} 1.0' in metrics
    assert 'leadtime_observations_accepted_total{api="grpc"} 26.0' in metrics
    labels = 'accelerator="h100-sxm",role="both",target="ttft"'
    assert f"leadtime_live_absolute_percentage_error_ratio_count{{{labels}}} 25.0" in metrics  # not the implausible
    assert (
        'leadtime_live_quantile_checks_total{accelerator="h100-sxm",covered="true",role="both",target="ttft"}'
        in metrics
    )


def test_unavailable_before_the_service_has_started() -> None:
    app = create_app(ServiceSettings())
    server, port = start_grpc_server(app.state.runtime, "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PredictorStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.PredictBulk(pb.PredictBulkRequest(rows=[row()]), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=None)


def test_generated_code_matches_the_proto() -> None:
    """The committed modules match the committed .proto (regenerate: python -m leadtime.predictor.grpc.regenerate)."""
    from pathlib import Path

    proto = (Path(pb.__file__).parent / "leadtime.proto").read_text()
    assert "package leadtime.v1;" in proto
    service = pb.DESCRIPTOR.services_by_name["Predictor"]
    assert {m.name for m in service.methods} == {"PredictBulk", "Observe", "ObserveStream", "Status"}
    for name in ("PredictBulk", "Observe", "ObserveStream", "Status"):
        assert f"rpc {name}(" in proto
    block = proto.split("message Row {")[1].split("}")[0]
    declared = set(re.findall(r"^\s*(?:optional\s+)?\w+\s+(\w+)\s*=\s*\d+;", block, flags=re.M))
    assert set(pb.Row.DESCRIPTOR.fields_by_name) == declared


def test_regenerating_the_grpc_modules_gives_the_committed_files(tmp_path: Path) -> None:
    from leadtime.predictor.grpc import regenerate

    regenerate.generate(tmp_path)
    for name in regenerate.GENERATED:
        assert (tmp_path / name).read_bytes() == (regenerate.HERE / name).read_bytes(), name


def test_regenerate_takes_help_for_help_not_for_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m leadtime.predictor.grpc.regenerate --help` made a folder named `--help` and wrote the modules
    there; it prints the usage, and an option it does not know is refused, nothing written."""
    from leadtime.predictor.grpc import regenerate

    monkeypatch.chdir(tmp_path)
    assert regenerate.main(["--help"]) == 0
    assert "regenerate [DIR]" in capsys.readouterr().out
    assert regenerate.main(["--out"]) == 2
    assert "--out" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_grpc_health_checks_answer_readiness_as_kubernetes_probes_ask() -> None:
    """grpc.health.v1 (what kubelet's gRPC probe and grpc_health_probe call): SERVING once predictions can be
    served, NOT_SERVING before and while stopping; a service the process does not have is NOT_FOUND; no token
    needed. The server is started as `serve` starts it (registered with the runtime, stopped by its stop): turned
    NOT_SERVING only after the server had stopped, probes went from SERVING straight to a refused connection."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    app = create_app(ServiceSettings(api_token="tok"))
    runtime = app.state.runtime
    server, port = serve_grpc(runtime, "127.0.0.1", 0)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            assert status("") == status("leadtime.v1.Predictor") == not_serving  # not started yet
            client = TestClient(app)
            client.__enter__()
            assert status("") == status("leadtime.v1.Predictor") == serving
            with pytest.raises(grpc.RpcError) as err:
                status("leadtime.v1.Nope")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            listed = health.List(health_pb2.HealthListRequest(), timeout=5).statuses
            assert {name: listed[name].status for name in listed} == {"": serving, "leadtime.v1.Predictor": serving}
            stopping = threading.Thread(target=client.__exit__, args=(None, None, None))
            stopping.start()  # the app's lifespan stops the runtime, which stops the server
            seen: list[str] = []
            while stopping.is_alive():
                try:
                    answer = health_pb2.HealthCheckResponse.ServingStatus.Name(status(""))
                except grpc.RpcError as refused:
                    answer = refused.code().name
                if not seen or seen[-1] != answer:
                    seen.append(answer)
                time.sleep(0.005)
            stopping.join()
            assert "NOT_SERVING" in seen and "SERVING" not in seen[seen.index("NOT_SERVING") :], seen
            with pytest.raises(grpc.RpcError) as err:
                status("")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # then the port closes
    finally:
        server.stop(grace=None)


def test_health_watch_is_refused_as_unimplemented_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """`Watch` (what gRPC's client-side health checking calls) fell to the base class, whose NotImplementedError
    gRPC logged as an ERROR with a traceback at every call; the client got UNIMPLEMENTED, which it reads as
    "health checking not served"."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    app = create_app(ServiceSettings())
    server, port = start_grpc_server(app.state.runtime, "127.0.0.1", 0)
    try:
        with TestClient(app), grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
            with pytest.raises(grpc.RpcError) as err:
                next(iter(watch))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "Check" in (err.value.details() or "")  # says what to call instead
    finally:
        server.stop(grace=None)
    assert not [r for r in caplog.records if r.levelname == "ERROR" or r.exc_info], caplog.text


def test_an_observation_stream_still_open_when_the_store_closes_is_refused_unavailable(
    served: tuple[TestClient, Any],
) -> None:
    """At a stop, the store was closed while an ObserveStream opened before the signal went on: each later batch
    was appended to a closed store (into a Redis writer's buffer nobody sends) and the client told accepted."""
    http, stub = served
    runtime = http.app.state.runtime  # type: ignore[attr-defined]
    store = runtime.store
    accepted_before = runtime.ingestion()["accepted"]

    def batches() -> Iterator[Any]:
        yield pb.ObserveRequest(observations=[observation(0)])
        # The first batch is accepted before the store closes.
        wait_for(lambda: runtime.ingestion()["accepted"] == accepted_before + 1, 10, "the first batch accepted")
        store.close()
        yield pb.ObserveRequest(observations=[observation(1)])

    auth = (("authorization", "Bearer tok"),)
    with pytest.raises(grpc.RpcError) as err:
        stub.ObserveStream(batches(), timeout=5, metadata=auth)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "batches[1]" in err.value.details() and "1 observations" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Observe(pb.ObserveRequest(observations=[observation(2)]), timeout=5, metadata=auth)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_observation_stream_open_at_a_stop_ends_unavailable_naming_what_was_accepted() -> None:
    """At a stop, gRPC cancelled a stream still open after its grace ("Cancelling all calls", no count) before the
    store closed: every batch was kept, but the client, told nothing, sent the whole stream again. Each open stream
    is told first and ends with its own UNAVAILABLE naming how many observations were accepted."""
    app = create_app(ServiceSettings(api_token="tok"))
    runtime = app.state.runtime
    server, port = serve_grpc(runtime, "127.0.0.1", 0)
    release = threading.Event()

    def batches() -> Iterator[Any]:
        for i in range(3):
            yield pb.ObserveRequest(observations=[observation(i)])
        release.wait(20)  # open, sending nothing, when the service stops

    try:
        client = TestClient(app)
        client.__enter__()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.PredictorStub(channel)
            call = stub.ObserveStream.future(batches(), timeout=20, metadata=(("authorization", "Bearer tok"),))
            wait_for(lambda: runtime.ingestion()["accepted"] == 3, 10, "the stream's three batches accepted")
            started = time.monotonic()
            client.__exit__(None, None, None)  # the app's lifespan stops the runtime, which stops the server
            with pytest.raises(grpc.RpcError) as err:
                call.result(timeout=10)
            release.set()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        details = err.value.details() or ""
        assert "batches[3]" in details and "stopping" in details, details
        assert "(3 observations of the batches before it were accepted)" in details, details
        assert runtime.ingestion()["accepted"] == 3
        assert time.monotonic() - started < 10
    finally:
        release.set()
        server.stop(grace=None)


def test_the_readmes_grpcurl_example_calls_a_real_method_with_a_body_it_answers(served: tuple[TestClient, Any]) -> None:
    """The service has no gRPC reflection, so the README shows grpcurl given the .proto: its file, port, service,
    method and JSON body must be what a fresh service answers (grpcurl reads the body as protobuf's JSON mapping)."""
    from google.protobuf import json_format

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    shown = r"grpcurl -proto (\S+) -plaintext -d '(.*?)'[\s\\]+localhost:(\d+) (\S+)/(\w+)"
    call = re.search(shown, readme, flags=re.S)
    assert call, "the README shows no grpcurl call"
    proto, body, port, service, method = call.groups()
    assert (root / proto).is_file() and int(port) == ServiceSettings().grpc_port
    assert service == f"{pb.DESCRIPTOR.package}.Predictor" and method == "PredictBulk"
    request = json_format.Parse(body, pb.PredictBulkRequest())
    _, stub = served
    answer = stub.PredictBulk(request, timeout=5)
    assert len(answer.ttft_mean_ms) == len(request.rows) == 2


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_grpc_serves_on_an_ipv6_address() -> None:
    """`leadtime serve --host ::1` stopped at start with `cannot serve gRPC on ::1:50051: the port is taken or the
    address is not this machine's`: the address went to gRPC unbracketed, which it cannot parse."""
    with TestClient(create_app(ServiceSettings())) as http:
        server, port = start_grpc_server(http.app.state.runtime, "::1", 0)  # type: ignore[attr-defined]
        try:
            with grpc.insecure_channel(f"[::1]:{port}") as channel:
                assert pb_grpc.PredictorStub(channel).Status(pb.StatusRequest(), timeout=10).is_ready
        finally:
            server.stop(grace=None)
