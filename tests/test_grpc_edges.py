"""The gRPC face at its edges: long-lived observation streams beside predictions, the process's role, messages
that are not protobuf, and writes whose caller has already given up."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import grpc
import pytest
from served import http_and_grpc, http_and_grpc_channel
from waiting import wait_for

from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.grpc.server import MAX_OPEN_STREAMS
from leadtime.predictor.settings import ServiceSettings

BASE: dict[str, Any] = dict(
    kv_cache_percentage=0.4,
    input_token_length=1200,
    num_request_waiting=2,
    num_request_running=8,
    num_tokens_generated=0,
    prefix_cache_score=0.5,
)
OBSERVATION = pb.Observation(row=pb.Row(**BASE), actual_ttft_ms=80.0, actual_tpot_ms=20.0)
PREDICT = pb.PredictBulkRequest(rows=[pb.Row(**BASE)])


def one_batch_then_idle(release: threading.Event) -> Iterator[Any]:
    """A stream's requests: one batch, then nothing until `release` (a client that keeps its stream open)."""
    yield pb.ObserveRequest(observations=[OBSERVATION])
    release.wait(20)


def test_open_observation_streams_leave_threads_for_predictions() -> None:
    """Four open ObserveStream calls took every worker thread: predictions and Status timed out."""
    release = threading.Event()

    with http_and_grpc(ServiceSettings()) as (http, stub):
        runtime = http.app.state.runtime  # type: ignore[attr-defined]
        calls = [stub.ObserveStream.future(one_batch_then_idle(release), timeout=30) for _ in range(MAX_OPEN_STREAMS)]
        try:
            # Every stream open and waiting for its client: a stream takes its slot before its first batch is
            # accepted, and keeps it until its client ends it.
            wait_for(lambda: runtime.ingestion()["accepted"] == MAX_OPEN_STREAMS, 20, "every stream's first batch")
            assert len(stub.PredictBulk(PREDICT, timeout=2).ttft_mean_ms) == 1
            assert stub.Status(pb.StatusRequest(), timeout=2).is_ready
            with pytest.raises(grpc.RpcError) as err:
                stub.ObserveStream(iter([pb.ObserveRequest(observations=[OBSERVATION])]), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"{MAX_OPEN_STREAMS} observation streams are open" in err.value.details()
        finally:
            release.set()
        assert [c.result(timeout=10).accepted for c in calls] == [1] * MAX_OPEN_STREAMS
        # Their threads are free again: another stream is taken.
        assert stub.ObserveStream(iter([pb.ObserveRequest(observations=[OBSERVATION])]), timeout=5).accepted == 1


@pytest.mark.parametrize(
    ("role", "refused", "served_too"),
    [("prediction", ["Observe", "ObserveStream"], "PredictBulk"), ("training", ["PredictBulk"], "Observe")],
)
def test_each_role_answers_only_its_own_calls_as_over_http(
    role: Literal["prediction", "training"], refused: list[str], served_too: str
) -> None:
    """--role prediction learned from gRPC observations (404 over HTTP); --role training answered predictions."""
    requests: dict[str, Any] = {
        "Observe": pb.ObserveRequest(observations=[OBSERVATION]),
        "ObserveStream": iter([pb.ObserveRequest(observations=[OBSERVATION])]),
        "PredictBulk": PREDICT,
    }
    with http_and_grpc(ServiceSettings(role=role)) as (_, stub):
        for name in refused:
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, name)(requests[name], timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert f"--role {role}" in err.value.details()
        getattr(stub, served_too)(requests[served_too], timeout=5)
        assert stub.Status(pb.StatusRequest(), timeout=5).role == role


def test_a_message_that_is_not_protobuf_is_invalid_argument_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """INTERNAL, and an ERROR with a traceback in the log for every such message."""
    row = pb.Row(**BASE).SerializeToString() + b"\x62\x01\xff"  # endpoint_id = b"\xff", not UTF-8
    inner = {"PredictBulk": row, "Observe": b"\x0a" + bytes([len(row)]) + row}  # rows[0] / observations[0].row
    with http_and_grpc_channel(ServiceSettings()) as (_, channel):
        for method in ("PredictBulk", "Observe"):
            raw = channel.unary_unary(
                f"/leadtime.v1.Predictor/{method}",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            bad_utf8 = b"\x0a" + bytes([len(inner[method])]) + inner[method]
            for body in (b"\xff\xff\xff", bad_utf8):
                with caplog.at_level(logging.INFO), pytest.raises(grpc.RpcError) as err:
                    raw(body, timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, body)
                assert err.value.details().startswith(f"request: is not a valid leadtime.v1.{method}Request message")
        stream = channel.stream_unary(
            "/leadtime.v1.Predictor/ObserveStream", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        good = pb.ObserveRequest(observations=[OBSERVATION]).SerializeToString()
        with pytest.raises(grpc.RpcError) as err:
            stream(iter([good, b"\xff\xff\xff"]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("batches[1]: is not a valid leadtime.v1.ObserveRequest")
        assert "(1 observations of the batches before it were accepted)" in err.value.details()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_observations_whose_caller_gave_up_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that timed out at the client (told: unavailable, retry) was kept anyway: a retry learned it twice."""
    with http_and_grpc(ServiceSettings()) as (http, stub):
        runtime = http.app.state.runtime  # type: ignore[attr-defined]
        parse = runtime.parser.parse_observations

        def slow_parse(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.4)  # a large batch on a busy host
            return parse(*args, **kwargs)

        monkeypatch.setattr(runtime.parser, "parse_observations", slow_parse)
        with pytest.raises(grpc.RpcError) as err:
            stub.Observe(pb.ObserveRequest(observations=[OBSERVATION] * 3), timeout=0.1)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.8)
        assert http.get("/status").json()["ingestion"]["accepted"] == 0
        # Counted as what its client was told, not CANCELLED: it did not cancel.
        exceeded = 'leadtime_grpc_requests_total{code="DEADLINE_EXCEEDED",method="Observe"} 1.0'
        assert exceeded in http.get("/metrics").text
        assert stub.Observe(pb.ObserveRequest(observations=[OBSERVATION] * 3), timeout=5).accepted == 3


def test_unary_observe_calls_leave_threads_for_predictions(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every stream open, unary Observe calls (a 50,000-row one takes about a second) took the threads kept
    for predictions, which then queued for seconds: at most MAX_OPEN_OBSERVES of them run at once, one more is
    refused RESOURCE_EXHAUSTED (as a stream beyond the cap is), and a prediction still gets a thread."""
    from leadtime.predictor.grpc.server import MAX_OPEN_OBSERVES

    release = threading.Event()

    with http_and_grpc(ServiceSettings()) as (http, stub):
        runtime = http.app.state.runtime  # type: ignore[attr-defined]
        accept = runtime.accept
        in_accept = threading.Semaphore(0)

        def slow_accept(*args: Any) -> None:  # a large batch being accepted
            if threading.current_thread().name.startswith("leadtime-grpc") and not release.is_set():
                in_accept.release()
                release.wait(20)
            accept(*args)

        streams = [stub.ObserveStream.future(one_batch_then_idle(release), timeout=30) for _ in range(MAX_OPEN_STREAMS)]
        try:
            wait_for(lambda: runtime.ingestion()["accepted"] == MAX_OPEN_STREAMS, 20, "every stream's first batch")
            monkeypatch.setattr(runtime, "accept", slow_accept)
            request = pb.ObserveRequest(observations=[OBSERVATION])
            writes = [stub.Observe.future(request, timeout=30) for _ in range(MAX_OPEN_OBSERVES)]
            for _ in writes:
                assert in_accept.acquire(timeout=10), "an Observe call did not start"
            with pytest.raises(grpc.RpcError) as err:
                stub.Observe(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry" in (err.value.details() or "")
            assert len(stub.PredictBulk(PREDICT, timeout=5).ttft_mean_ms) == 1
            assert stub.Status(pb.StatusRequest(), timeout=5).is_ready
        finally:
            release.set()
        assert [w.result(timeout=10).accepted for w in writes] == [1] * MAX_OPEN_OBSERVES
        assert [c.result(timeout=10).accepted for c in streams] == [1] * MAX_OPEN_STREAMS


def test_a_stream_its_client_cancels_keeps_its_batches_and_is_counted_cancelled() -> None:
    """A stream cancelled by its client after a batch was counted `code="OK"` in leadtime_grpc_requests_total (the
    error gRPC raised in the request iterator was none of the refusals `_call` maps), so a dashboard of failed calls
    never showed it; the batch it had accepted stays accepted."""
    release = threading.Event()
    with http_and_grpc(ServiceSettings()) as (http, stub):
        runtime = http.app.state.runtime  # type: ignore[attr-defined]
        call = stub.ObserveStream.future(one_batch_then_idle(release), timeout=30)
        try:
            wait_for(lambda: runtime.ingestion()["accepted"] == 1, 20, "the stream's first batch")
            call.cancel()
            cancelled = 'leadtime_grpc_requests_total{code="CANCELLED",method="ObserveStream"} 1.0'
            wait_for(lambda: cancelled in http.get("/metrics").text, 10, "the cancelled call counted")
        finally:
            release.set()
        metrics = http.get("/metrics").text
        assert 'leadtime_grpc_requests_total{code="OK",method="ObserveStream"} 0.0' in metrics
        assert 'leadtime_observations_accepted_total{api="grpc"} 1.0' in metrics
        assert runtime.ingestion()["accepted"] == 1


def test_a_stream_whose_deadline_passes_is_counted_deadline_exceeded() -> None:
    """gRPC ends such a stream under its method, which saw its request iterator end as if the client had finished
    the stream: the call was counted `code="OK"`."""
    release = threading.Event()
    with http_and_grpc(ServiceSettings()) as (http, stub):
        try:
            with pytest.raises(grpc.RpcError) as err:
                stub.ObserveStream(one_batch_then_idle(release), timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            exceeded = 'leadtime_grpc_requests_total{code="DEADLINE_EXCEEDED",method="ObserveStream"} 1.0'
            wait_for(lambda: exceeded in http.get("/metrics").text, 10, "the call counted as its deadline passing")
        finally:
            release.set()
        assert 'leadtime_grpc_requests_total{code="OK",method="ObserveStream"} 0.0' in http.get("/metrics").text


def test_a_stream_batch_over_the_size_limit_ends_the_call_after_the_batches_before_it_were_kept() -> None:
    """What the README and the .proto tell a client to do (send that batch, split, and those after it, not the whole
    stream) holds only if the batches before it were kept: gRPC refuses the message itself, naming no count."""
    with http_and_grpc(ServiceSettings(max_body_bytes=20_000)) as (http, stub):
        runtime = http.app.state.runtime  # type: ignore[attr-defined]
        too_large = pb.ObserveRequest(observations=[OBSERVATION] * 1_000)
        assert too_large.ByteSize() > 20_000
        first = pb.ObserveRequest(observations=[OBSERVATION] * 3)
        with pytest.raises(grpc.RpcError) as err:
            stub.ObserveStream(iter([first, too_large, first]), timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in (err.value.details() or "")
        assert runtime.ingestion()["accepted"] == 3
        ended = 'leadtime_grpc_requests_total{code="CANCELLED",method="ObserveStream"} 1.0'
        wait_for(lambda: ended in http.get("/metrics").text, 10, "the call counted as ended by gRPC")
