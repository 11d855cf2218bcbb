"""Regression: a tensor-parallel size up to 2**53 was taken, and each new one added a hardware class to the
process's table for good, rebuilding the whole table each time: a client sending ever-new sizes made every
prediction slower (8,000 sizes sent: about 50 ms per prediction, where it takes well under one) and the process
larger. Every path that takes a size now refuses one above `MAX_TENSOR_PARALLEL`, naming the field and the bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from leadtime.cli import app as cli_app
from leadtime.features.errors import FeatureError
from leadtime.features.rows import (
    MAX_TENSOR_PARALLEL,
    EndpointState,
    FeatureRow,
    RequestFeatures,
    feature_row_from_llmd,
)
from leadtime.features.vectorize import COLUMN_INDEX, Vectorizer, check_matrix
from leadtime.predictor.client import PredictorError, row_columns, row_message
from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.grpc import leadtime_pb2_grpc as pb_grpc
from leadtime.predictor.grpc.server import start_grpc_server
from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.rows import RowParser
from leadtime.predictor.settings import ServiceSettings
from leadtime.router_plugin.discovery import DiscoveryError, parse_endpoints, parse_static

TOO_MANY = MAX_TENSOR_PARALLEL + 1
PROBLEM = f"must be ≤ {MAX_TENSOR_PARALLEL}"

ROW: dict[str, Any] = {
    "kv_cache_percentage": 0.2,
    "input_token_length": 700,
    "num_request_waiting": 1,
    "num_request_running": 4,
    "num_tokens_generated": 0,
    "prefix_cache_score": 0.0,
}


def test_the_bound_is_realistic() -> None:
    """Tensor-parallel groups in practice are 8 to 64 GPUs: the bound leaves room above them, and the sizes any
    fleet uses are taken."""
    assert 64 <= MAX_TENSOR_PARALLEL <= 4096
    for size in (1, 2, 8, 64, MAX_TENSOR_PARALLEL):
        assert EndpointState(tensor_parallel=size).tensor_parallel == size


@pytest.mark.parametrize("size", [TOO_MANY, 2**31, 2**53, 2**60])
def test_a_row_refuses_a_size_above_the_bound_naming_it(size: int) -> None:
    """Regression: a row naming tensor_parallel up to 2**53 was taken, and each new size became a hardware class
    kept for good: 8,000 sizes sent, about 50 ms per prediction and 7 MB more. In process and in llm-d's rows."""
    with pytest.raises(FeatureError) as err:
        EndpointState(tensor_parallel=size)
    assert err.value.field == "tensor_parallel" and err.value.problem.startswith(PROBLEM), err.value.problem
    with pytest.raises(FeatureError) as err:
        feature_row_from_llmd({**ROW, "tensor_parallel": size})
    assert err.value.field == "tensor_parallel" and err.value.problem.startswith(PROBLEM)


def test_the_hardware_table_and_a_bare_matrix_refuse_it_too() -> None:
    """The table is the last line: whatever path reaches it with a size above the bound adds no class."""
    v = Vectorizer()
    before = len(v.hardware.classes)
    with pytest.raises(FeatureError, match=PROBLEM):
        v.hardware.index("", "", TOO_MANY)
    assert len(v.hardware.classes) == before
    x = v.batch([FeatureRow(RequestFeatures(10), EndpointState())]).X.copy()
    x[0, COLUMN_INDEX["tensor_parallel"]] = TOO_MANY
    with pytest.raises(FeatureError) as err:
        check_matrix(x)
    assert err.value.field == "tensor_parallel"


def test_the_services_parser_refuses_it_in_rows_columns_and_messages() -> None:
    from leadtime.predictor.grpc.server import row_to_dict

    parser = RowParser("h100-sxm", "llama-3.1-8b")
    with pytest.raises(FeatureError) as err:
        parser.parse([ROW, {**ROW, "tensor_parallel": TOO_MANY}], where="requests")
    assert err.value.field == "requests[1].tensor_parallel" and err.value.problem.startswith(PROBLEM)
    columns: dict[str, list[Any]] = {name: [value, value] for name, value in ROW.items()}
    columns["tensor_parallel"] = [1, TOO_MANY]
    with pytest.raises(FeatureError) as err:
        parser.parse_column_lists(columns)
    assert err.value.field == "columns[1].tensor_parallel" and err.value.problem.startswith(PROBLEM)
    messages = [pb.Row(**ROW), pb.Row(**ROW, tensor_parallel=TOO_MANY)]
    with pytest.raises(FeatureError) as err:
        parser.parse_messages(messages, row_to_dict)
    assert err.value.field == "rows[1].tensor_parallel" and err.value.problem.startswith(PROBLEM)


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with TestClient(create_app(ServiceSettings(api_token="tok"))) as client:
        yield client


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/predict", {"rows": [ROW, {**ROW, "tensor_parallel": TOO_MANY}]}, "rows[1].tensor_parallel"),
        ("/v1/explain", {"row": {**ROW, "tensor_parallel": TOO_MANY}}, "row.tensor_parallel"),
        (
            "/v1/observations",
            {"observations": [{**ROW, "tensor_parallel": TOO_MANY, "actual_ttft_ms": 90.0, "actual_tpot_ms": 9.0}]},
            "observations[0].tensor_parallel",
        ),
        ("/predict/bulk/strict", {"requests": [{**ROW, "tensor_parallel": TOO_MANY}]}, "requests[0].tensor_parallel"),
    ],
)
def test_http_answers_422_naming_the_field_and_the_bound(
    http: TestClient, path: str, body: dict[str, Any], field: str
) -> None:
    """Regression: every HTTP path answered 200 for a size up to 2**53 (the schema said `le=2**53`), adding a class
    to the serving process's table with each new one."""
    response = http.post(path, json=body, headers={"Authorization": "Bearer tok"})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field, response.text
    assert str(MAX_TENSOR_PARALLEL) in response.json()["error"], response.text


@contextlib.contextmanager
def grpc_stub(http: TestClient) -> Iterator[Any]:
    """A gRPC server on the app's runtime, on a loopback port of 47850–47899."""
    for port in range(47850, 47900):
        try:
            server, bound = start_grpc_server(http.app.state.runtime, "127.0.0.1", port)  # type: ignore[attr-defined]
        except (OSError, RuntimeError):
            continue
        break
    else:
        pytest.skip("no free loopback port in 47850–47899")
    channel = grpc.insecure_channel(f"127.0.0.1:{bound}")
    try:
        yield pb_grpc.PredictorStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)


def test_grpc_answers_invalid_argument_naming_the_field_and_the_bound(http: TestClient) -> None:
    """Regression: a Row's uint32 tensor_parallel took any size up to 2**32 - 1, as rows and as columns."""
    with grpc_stub(http) as stub:
        rows = [pb.Row(**ROW), pb.Row(**ROW, tensor_parallel=TOO_MANY)]
        with pytest.raises(grpc.RpcError) as err:
            stub.PredictBulk(pb.PredictBulkRequest(rows=rows), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"rows[1].tensor_parallel: {PROBLEM}" in err.value.details(), err.value.details()
        columns = row_columns([ROW, ROW])
        columns.tensor_parallel.extend([TOO_MANY, 1])
        with pytest.raises(grpc.RpcError) as err:
            stub.PredictBulk(pb.PredictBulkRequest(columns=columns), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"columns[0].tensor_parallel: {PROBLEM}" in err.value.details(), err.value.details()


def test_the_remote_clients_refuse_it_before_sending() -> None:
    with pytest.raises(PredictorError) as err:
        row_message({**ROW, "tensor_parallel": TOO_MANY}, "rows[1]")
    assert err.value.message.startswith(f"rows[1].tensor_parallel: {PROBLEM}"), err.value.message


def test_discovery_and_the_routes_endpoint_option_refuse_it(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def never_serve(*_: object) -> None:
        raise OSError("the gateway would have started")  # were the endpoint taken: no server in a test

    monkeypatch.setattr("leadtime.router_plugin.gateway.serve.serve_gateway", never_serve)
    label = "leadtime.io/tensor-parallel"
    data = {"endpoints": [{"name": "a", "address": "10.0.0.1", "port": 8000, "labels": {label: str(TOO_MANY)}}]}
    with pytest.raises(DiscoveryError) as err:
        parse_endpoints(data)
    assert str(err.value).startswith(f"endpoints[0].labels.{label}: must be an integer from 1 to {MAX_TENSOR_PARALLEL}")
    assert parse_endpoints({"endpoints": [{**data["endpoints"][0], "labels": {label: "1024"}}]})
    with pytest.raises(DiscoveryError, match=f"from 1 to {MAX_TENSOR_PARALLEL}"):
        parse_static([f"127.0.0.1:8000,{label}={TOO_MANY}"])
    route = ["route", "--policy", "random", "--port", "47860"]
    result = CliRunner().invoke(cli_app, [*route, "--endpoint", f"127.0.0.1:1,{label}={TOO_MANY}"])
    assert result.exit_code == 2 and f"from 1 to {MAX_TENSOR_PARALLEL}" in result.output, result.output
    discovery = tmp_path / "endpoints.yaml"
    discovery.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(cli_app, [*route, "--discovery", str(discovery)])
    assert result.exit_code == 2 and f"from 1 to {MAX_TENSOR_PARALLEL}" in result.output, result.output


def test_sizes_within_the_bound_are_predicted_as_before() -> None:
    """The bound changes no prediction of a size it takes: the matrix of a size-8 row is the row form's."""
    v = Vectorizer()
    row = FeatureRow(
        RequestFeatures(1000), EndpointState(accelerator="mi300x", model="llama-3.1-70b", tensor_parallel=8)
    )
    np.testing.assert_array_equal(v.batch([row]).X[0], np.array(v.row_vector(row)))
