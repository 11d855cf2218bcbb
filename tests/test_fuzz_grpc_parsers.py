"""Property-based fuzzing (hypothesis) of the gRPC API and of the parsers every request goes through.

- The service's row parser, fed any JSON-shaped values under llm-d's and Leadtime's field names (and others):
  it returns checked rows or raises FeatureError naming `where[i].field`; nothing else escapes it.
- Timestamps: any text or number is a time or a FeatureError.
- The gRPC API on a real server: any message the proto allows (rows as messages or columns, observations) is
  answered OK or INVALID_ARGUMENT naming the problem (RESOURCE_EXHAUSTED for a full backlog), and a refused
  Observe leaves what was accepted as it was; undecodable bytes are refused without harm to the server.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leadtime.features.errors import FeatureError
from leadtime.features.rows import LLMD_FIELDS, parse_timestamp
from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.grpc import leadtime_pb2_grpc as pb_grpc
from leadtime.predictor.grpc.server import start_grpc_server
from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.rows import RowParser
from leadtime.predictor.service.runtime import ServiceRuntime
from leadtime.predictor.settings import ServiceSettings

FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
# Values that mean something to the parser, beside arbitrary ones.
WORDS = ["", "prefill", "decode", "both", "none", "resident", "switching", "parked", "h100-sxm", "l40s", "qwen3-32b"]
NAMES = sorted(
    {*LLMD_FIELDS, "endpoint_id", "accelerator", "model", "tensor_parallel", "prefix_hit_tokens", "role"}
    | {"timeslice_state", "timeslice_wait_ms", "actual_ttft_ms", "actual_tpot_ms", "predicted_ttft_ms", "timestamp"}
)
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(0, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 1),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.sampled_from(WORDS), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner))
rows = st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=5), json_values, max_size=len(NAMES))
good_row = st.fixed_dictionaries(
    {
        "kv_cache_percentage": st.floats(0, 1),
        "input_token_length": st.integers(0, 10_000),
        "num_request_waiting": st.integers(0, 100),
        "num_request_running": st.integers(0, 100),
        "num_tokens_generated": st.integers(0, 1000),
        "prefix_cache_score": st.floats(0, 1),
        "actual_ttft_ms": st.floats(0, 1e5),
        "actual_tpot_ms": st.floats(0, 1e3),
    }
)
# A mostly good row with a few fields replaced by anything: reaches the checks past the first field.
mutated_row = st.builds(
    lambda good, bad: {**good, **bad}, good_row, st.dictionaries(st.sampled_from(NAMES), json_values)
)
PARSER = RowParser("h100-sxm", "llama-3.1-8b")
# A bad field of a row or entry, or the item itself when it is not an object.
NAMED = re.compile(r"^(requests|entries)\[\d+\](\.\w+|$)")


@FUZZ
@given(st.lists(rows | mutated_row | json_values, min_size=1, max_size=6))
def test_the_row_parser_returns_rows_or_names_the_bad_field(items: list[Any]) -> None:
    for parse, where in ((PARSER.parse, "requests"), (PARSER.parse_observations, "entries")):
        try:
            parsed = parse(items, where)
        except FeatureError as err:
            assert NAMED.match(err.field), err.field
            assert err.problem
            continue
        n = len(parsed.rows) if hasattr(parsed, "rows") else len(parsed)
        assert n == len(items)


@FUZZ
@given(st.lists(good_row, min_size=1, max_size=6))
def test_good_rows_always_parse(items: list[dict[str, Any]]) -> None:
    assert len(PARSER.parse(items)) == len(items)
    assert len(PARSER.parse_observations(items).actual_ttft_ms) == len(items)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(NAMES)), st.lists(scalars, max_size=4), min_size=1))
def test_column_lists_are_rows_or_a_named_error(columns: dict[str, list[Any]]) -> None:
    try:
        batch = PARSER.parse_column_lists(columns)
    except FeatureError as err:
        assert err.field.startswith("columns"), err.field
        return
    assert len(batch) == max(map(len, columns.values()))


@FUZZ
@given(st.one_of(st.text(), numbers, st.datetimes().map(str), st.datetimes().map(lambda d: d.isoformat() + "Z")))
def test_timestamps_are_times_or_a_named_error(value: Any) -> None:
    try:
        seconds = parse_timestamp(value)
    except FeatureError as err:
        assert err.field == "timestamp"
        return
    assert seconds == seconds and abs(seconds) != float("inf")


def _field_values(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kinds: dict[int, st.SearchStrategy[Any]] = {
        FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True) | st.floats(0, 1),
        FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=True, allow_infinity=True),
        FieldDescriptor.TYPE_UINT64: st.integers(0, 2**64 - 1) | st.integers(0, 4000),
        FieldDescriptor.TYPE_UINT32: st.integers(0, 2**32 - 1) | st.integers(0, 8),
        FieldDescriptor.TYPE_BOOL: st.booleans(),
        FieldDescriptor.TYPE_STRING: st.sampled_from(WORDS) | st.text(max_size=300),
    }
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages(field.message_type)
    return kinds[field.type]


def messages(descriptor: Any) -> st.SearchStrategy[Any]:
    """Any message of this type the proto allows: each field set or not, repeated ones 0-3 long."""
    cls = getattr(pb, descriptor.name)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        values = _field_values(field)
        repeated = field.is_repeated
        parts[field.name] = st.lists(values, max_size=3) if repeated else values
    return st.fixed_dictionaries({}, optional=parts).map(lambda d: cls(**d))


@pytest.fixture(scope="module")
def grpc_served() -> Iterator[tuple[Any, grpc.Channel, ServiceRuntime]]:
    with TestClient(create_app(ServiceSettings(grpc_port=0))) as http:
        runtime = http.app.state.runtime  # type: ignore[attr-defined]
        server, port = start_grpc_server(runtime, "127.0.0.1", 0)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield pb_grpc.PredictorStub(channel), channel, runtime
        finally:
            channel.close()
            server.stop(grace=None)


GRPC_FUZZ = settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def test_grpc_predict_bulk_answers_or_names_the_problem(grpc_served: tuple[Any, grpc.Channel, ServiceRuntime]) -> None:
    stub, _, _ = grpc_served
    codes: set[grpc.StatusCode] = set()

    @GRPC_FUZZ
    @given(messages(pb.PredictBulkRequest.DESCRIPTOR))
    def run(request: Any) -> None:
        try:
            answer = stub.PredictBulk(request, timeout=10)
            codes.add(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
            assert re.match(r"^(rows|columns)", err.details() or ""), err.details()
            codes.add(err.code())
            return
        n = len(request.rows) or max(len(getattr(request.columns, f.name)) for f in pb.RowColumns.DESCRIPTOR.fields)
        assert len(answer.ttft_mean_ms) == len(answer.tpot_quantile_ms) == n
        assert all(v >= 0 for v in answer.ttft_quantile_ms)

    run()
    assert codes == {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}  # both sides were reached


def test_grpc_observe_accepts_or_refuses_whole_batches(grpc_served: tuple[Any, grpc.Channel, ServiceRuntime]) -> None:
    stub, _, runtime = grpc_served
    codes: set[grpc.StatusCode] = set()

    @GRPC_FUZZ
    @given(messages(pb.ObserveRequest.DESCRIPTOR))
    def run(request: Any) -> None:
        before = runtime.ingestion()["accepted"]
        try:
            answer = stub.Observe(request, timeout=10)
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
                err.code(),
                err.details(),
            )
            assert err.details()
            assert runtime.ingestion()["accepted"] == before
            codes.add(err.code())
            return
        assert answer.accepted == len(request.observations)
        assert runtime.ingestion()["accepted"] == before + answer.accepted
        codes.add(grpc.StatusCode.OK)

    run()
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= codes


def test_undecodable_bytes_are_refused_and_the_server_keeps_serving(
    grpc_served: tuple[Any, grpc.Channel, ServiceRuntime],
) -> None:
    stub, channel, _ = grpc_served
    calls = {
        name: channel.unary_unary(f"/leadtime.v1.Predictor/{name}", request_serializer=None, response_deserializer=None)
        for name in ("PredictBulk", "Observe", "Status")
    }
    codes: set[grpc.StatusCode] = set()

    @GRPC_FUZZ
    @given(st.sampled_from(sorted(calls)), st.binary(max_size=200))
    def run(name: str, data: bytes) -> None:
        try:
            calls[name](data, timeout=10)
            codes.add(grpc.StatusCode.OK)  # some bytes do decode: an empty message, say
        except grpc.RpcError as err:
            # Bytes that are not the request message are refused by name, as bytes that decode to a bad one are
            # (gRPC itself would answer INTERNAL and log a traceback per message).
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
            codes.add(err.code())

    run()
    assert grpc.StatusCode.INVALID_ARGUMENT in codes  # most random bytes are not a message
    assert stub.Status(pb.StatusRequest(), timeout=10).is_ready
