"""The native /v1 API: richer rows in, mean and quantile of both targets and the model version out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from leadtime.features.errors import FeatureError
from leadtime.features.rows import feature_row_from_llmd
from leadtime.features.vectorize import COLUMN_INDEX
from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.rows import RowParser
from leadtime.predictor.settings import ServiceSettings


def native_row(**overrides: Any) -> dict[str, Any]:
    row = {
        "kv_cache_percentage": 0.2,
        "input_token_length": 1200,
        "num_request_waiting": 1,
        "num_request_running": 6,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.0,
        "endpoint_id": "pod-a",
        "accelerator": "h100-sxm",
        "model": "llama-3.1-8b",
        "role": "both",
    }
    row.update(overrides)
    return row


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(ServiceSettings())) as c:
        yield c


def test_predict_returns_mean_and_quantile_of_both_targets_per_row(client: TestClient) -> None:
    rows = [native_row(), native_row(accelerator="l40s"), native_row(prefix_hit_tokens=1100)]
    r = client.post("/v1/predict", json={"rows": rows})
    assert r.status_code == 200
    body = r.json()
    assert body["model_version"] == 0 and body["quantile"] == 0.9 and body["predicted_at"].endswith("+00:00")
    for key in ("ttft_mean_ms", "ttft_quantile_ms", "tpot_mean_ms", "tpot_quantile_ms"):
        assert len(body[key]) == 3 and all(v > 0 for v in body[key])
    for i in range(3):
        assert body["ttft_quantile_ms"][i] >= body["ttft_mean_ms"][i]
        assert body["tpot_quantile_ms"][i] >= body["tpot_mean_ms"][i]
    assert body["tpot_mean_ms"][1] > body["tpot_mean_ms"][0]  # L40S decodes slower than H100
    assert body["ttft_mean_ms"][2] < body["ttft_mean_ms"][0]  # prefix hits shorten the prefill


def test_predict_names_bad_native_fields(client: TestClient) -> None:
    cases = [
        (native_row(accelerator="abacus"), "rows[0].accelerator"),
        (native_row(role="leader"), "rows[0].role"),
        (native_row(prefix_hit_tokens=5000), "rows[0].prefix_hit_tokens"),
        (native_row(timeslice_state="asleep"), "rows[0].timeslice_state"),
        (native_row(tensor_parallel=0), "rows[0].tensor_parallel"),
        (native_row(endpoint_id=7), "rows[0].endpoint_id"),
    ]
    for row, field in cases:
        r = client.post("/v1/predict", json={"rows": [row]})
        assert r.status_code == 422, field
        assert r.json()["field"] == field


def test_a_misspelled_field_of_a_native_row_is_refused_naming_it(client: TestClient) -> None:
    """`acelerator` was ignored as an unknown field: the row was predicted, and its observation learned, as the
    default class's (llm-d's paths still ignore what they do not know, as llm-d's server does)."""
    typo = native_row()
    typo["acelerator"] = typo.pop("accelerator")
    r = client.post("/v1/predict", json={"rows": [native_row(), typo]})
    assert r.status_code == 422
    assert r.json()["field"] == "rows[1].acelerator"
    assert "did you mean 'accelerator'" in r.json()["error"], r.json()
    observation = dict(typo, actual_ttft_ms=900.0, actual_tpot_ms=40.0)
    r = client.post("/v1/observations", json={"observations": [observation]})
    assert r.status_code == 422 and r.json()["field"] == "observations[0].acelerator"
    r = client.post(
        "/v1/observations",
        json={"observations": [dict(native_row(), actual_ttft_ms=900.0, actual_tpot_ms=40.0, predicted_ttft=1.0)]},
    )
    assert r.status_code == 422 and "did you mean 'predicted_ttft_ms'" in r.json()["error"], r.json()
    r = client.post("/v1/explain", json={"row": dict(native_row(), kv_cache_percent=0.5)})
    assert r.status_code == 422 and r.json()["field"] == "row.kv_cache_percent"
    r = client.post("/predict/bulk/strict", json={"requests": [typo]})  # llm-d's path: ignored, as llm-d does
    assert r.status_code == 200
    assert client.get("/v1/status").json()["learned"] == {"ttft": 0, "tpot": 0}


def test_a_parked_time_slice_adds_its_wait_to_ttft(client: TestClient) -> None:
    rows = [native_row(), native_row(timeslice_state="parked", timeslice_wait_ms=800.0)]
    body = client.post("/v1/predict", json={"rows": rows}).json()
    assert body["ttft_mean_ms"][1] > body["ttft_mean_ms"][0] + 500


def test_observations_are_accepted_learned_and_measured(client: TestClient) -> None:
    before = client.post("/v1/predict", json={"rows": [native_row()]}).json()
    observations = [
        dict(
            native_row(),
            actual_ttft_ms=900.0,
            actual_tpot_ms=40.0,
            predicted_ttft_ms=before["ttft_mean_ms"][0],
            predicted_ttft_quantile_ms=before["ttft_quantile_ms"][0],
            predicted_tpot_ms=before["tpot_mean_ms"][0],
            predicted_tpot_quantile_ms=before["tpot_quantile_ms"][0],
        )
        for _ in range(60)
    ]
    r = client.post("/v1/observations", json={"observations": observations})
    assert r.status_code == 202 and r.json() == {"accepted": 60}
    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    deadline = time.monotonic() + 60  # generous: the learner process shares a busy 2-core machine
    while runtime.learned()["ttft"] < 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runtime.learned()["ttft"] == 60
    after = client.post("/v1/predict", json={"rows": [native_row()]}).json()
    assert after["ttft_mean_ms"][0] > before["ttft_mean_ms"][0]  # it learned that pod-a is slow
    metrics = client.get("/metrics").text
    assert (
        'leadtime_live_absolute_percentage_error_ratio_count{accelerator="h100-sxm",role="both",target="ttft"} 60.0'
        in metrics
    )
    assert (
        'leadtime_live_quantile_checks_total{accelerator="h100-sxm",covered="false",role="both",target="ttft"} 60.0'
        in metrics
    )
    # none covered: coverage is 0, not "no data" (a ratio over a missing series is empty, and alerts on nothing)
    assert (
        'leadtime_live_quantile_checks_total{accelerator="h100-sxm",covered="true",role="both",target="ttft"} 0.0'
        in metrics
    )
    status = client.get("/v1/status").json()
    assert status["learned"]["ttft"] == 60 and status["model_version"] == 0


def test_observations_are_all_or_nothing(client: TestClient) -> None:
    good = dict(native_row(), actual_ttft_ms=100.0, actual_tpot_ms=0.0)
    bad = dict(native_row(), actual_ttft_ms=100.0, actual_tpot_ms=0.0, predicted_ttft_ms="soon")
    r = client.post("/v1/observations", json={"observations": [good, bad]})
    assert r.status_code == 422 and r.json()["field"] == "observations[1].predicted_ttft_ms"
    empty = client.post("/v1/observations", json={"observations": []})  # as llm-d's path and gRPC Observe take it
    assert empty.status_code == 202 and empty.json() == {"accepted": 0}
    assert client.app.state.runtime.store.stats()["appended"] == 0  # type: ignore[attr-defined]


def test_role_is_stored_as_llmd_pod_type(client: TestClient) -> None:
    observation = dict(native_row(role="decode"), actual_ttft_ms=0.0, actual_tpot_ms=20.0)
    assert client.post("/v1/observations", json={"observations": [observation]}).status_code == 202
    _, stored = client.app.state.runtime.store.read_observations("0", 10)  # type: ignore[attr-defined]
    assert stored[0]["pod_type"] == "decode" and "role" not in stored[0]


def test_role_is_used_when_pod_type_is_unset_and_refused_when_they_disagree(client: TestClient) -> None:
    """A client that sends every field with its default (a Go struct without omitempty, a generated client) sends
    `pod_type: ""` beside the `role` it means: the role was ignored and a prefill pod predicted as unified."""
    for pod_type in ("", None, "prefill"):
        observation = dict(native_row(role="prefill", pod_type=pod_type), actual_ttft_ms=300.0, actual_tpot_ms=0.0)
        assert client.post("/v1/observations", json={"observations": [observation]}).status_code == 202
    _, stored = client.app.state.runtime.store.read_observations("0", 10)  # type: ignore[attr-defined]
    assert [entry["pod_type"] for entry in stored] == ["prefill"] * 3
    rows = [native_row(role="prefill", pod_type=""), native_row(role="prefill", pod_type=None), native_row(pod_type="")]
    x = RowParser("h100-sxm", "llama-3.1-8b").parse(rows).X
    assert x[:, COLUMN_INDEX["role_prefill"]].tolist() == [1.0, 1.0, 0.0]
    assert feature_row_from_llmd(native_row(role="decode", pod_type="")).endpoint.role == "decode"
    with pytest.raises(FeatureError, match="role"):
        feature_row_from_llmd(native_row(role="decode", pod_type="prefill"))
    for path, body in (
        ("/v1/predict", {"rows": [native_row(role="decode", pod_type="prefill")]}),
        (
            "/v1/observations",
            {
                "observations": [
                    dict(native_row(role="both", pod_type="decode"), actual_ttft_ms=9.0, actual_tpot_ms=0.0)
                ]
            },
        ),
        ("/predict/bulk/strict", {"requests": [native_row(role="decode", pod_type="prefill")]}),
    ):
        r = client.post(path, json=body)
        assert r.status_code == 422, (path, r.json())
        assert r.json()["field"].endswith("[0].role") and "pod_type" in r.json()["error"], r.json()


def test_an_empty_or_null_timeslice_state_means_none_as_over_grpc(client: TestClient) -> None:
    """gRPC reads an unset `timeslice_state` ("") as "none", as the text fields' "" means their default here
    (pod_type, accelerator, model); HTTP refused it."""
    plain = client.post("/v1/predict", json={"rows": [native_row()]}).json()["ttft_mean_ms"]
    for state in ("", None):
        r = client.post("/v1/predict", json={"rows": [native_row(timeslice_state=state)]})
        assert r.status_code == 200 and r.json()["ttft_mean_ms"] == plain, r.json()
    observation = dict(native_row(timeslice_state=""), actual_ttft_ms=300.0, actual_tpot_ms=0.0)
    assert client.post("/v1/observations", json={"observations": [observation]}).status_code == 202
    r = client.post("/v1/predict", json={"rows": [native_row(timeslice_state="idle")]})
    assert r.status_code == 422 and r.json()["field"] == "rows[0].timeslice_state"


def test_a_key_the_native_bodies_do_not_have_is_refused_naming_it(client: TestClient) -> None:
    """Inside a row an unknown key was refused, beside the rows it was ignored."""
    r = client.post("/v1/predict", json={"rows": [native_row()], "row": [native_row()]})
    assert r.status_code == 422 and r.json()["field"] == "row", r.json()
    observation = dict(native_row(), actual_ttft_ms=300.0, actual_tpot_ms=0.0)
    r = client.post("/v1/observations", json={"observations": [observation], "batch": 1})
    assert r.status_code == 422 and r.json()["field"] == "batch", r.json()
    r = client.post("/v1/explain", json={"row": native_row(), "verbose": True})
    assert r.status_code == 422 and r.json()["field"] == "verbose", r.json()
    r = client.post("/v1/predict", json={"rows": [native_row()], "²": None})  # a digit to Python, not an index
    assert r.status_code == 422 and r.json()["field"] == "²", r.json()
    r = client.post("/v1/observations", json={"observations": [observation, dict(observation, acelerator="")]})
    assert r.status_code == 422
    # every refused observation is counted, as those refused for a bad value are (1 + 2 above)
    assert 'leadtime_observations_rejected_total{api="native"} 3.0' in client.get("/metrics").text
    assert client.get("/v1/status").json()["learned"] == {"ttft": 0, "tpot": 0}


def test_a_field_nobody_reads_is_not_stored(client: TestClient) -> None:
    """llm-d's path ignores a field it does not know, and the store kept it whole: 30 entries of a 10 MB field held
    340 MB for as long as the store kept the rows (their count bounds the store, not their bytes)."""
    entry = {**native_row(), "actual_ttft_ms": 300.0, "actual_tpot_ms": 0.0, "junk": "x" * 1000}
    del entry["role"]
    assert client.post("/add_training_data_bulk", json={"entries": [entry, dict(entry, junk2=[1])]}).status_code == 202
    _, stored = client.app.state.runtime.store.read_observations("0", 10)  # type: ignore[attr-defined]
    assert [sorted(e) for e in stored] == [sorted(k for k in entry if k != "junk")] * 2


def test_explain_breaks_a_prediction_down(client: TestClient) -> None:
    r = client.post("/v1/explain", json={"row": native_row()})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "physics prior" in r.text and "ttft" in r.text and "tpot" in r.text
    bad = client.post("/v1/explain", json={"row": native_row(kv_cache_percentage=3)})
    assert bad.status_code == 422 and "kv_cache_percentage" in bad.json()["field"]


def test_openapi_docs_describe_both_apis(client: TestClient) -> None:
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for path in ("/predict/bulk/strict", "/add_training_data_bulk", "/v1/predict", "/v1/observations", "/status"):
        assert path in paths
    body = paths["/predict/bulk/strict"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "kv_cache_percentage" in body["properties"]["requests"]["items"]["properties"]


def test_the_edge_answers_good_predictions_as_the_route_would_and_leaves_bad_ones_to_it(client: TestClient) -> None:
    """`/v1/predict` is answered by the edge's hot path (the gateway calls it on every decision); the route and
    the hot path share `predict_answer`, and anything the hot path cannot answer still gets the route's error."""
    import orjson

    from leadtime.predictor.service.hot_path import HotPath

    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    hot = HotPath(runtime)
    rows = [native_row(), native_row(accelerator="l40s", prefix_hit_tokens=300)]
    status, answer = hot.native_predict(orjson.dumps({"rows": rows}), "") or (0, b"")
    via_client = client.post("/v1/predict", json={"rows": rows}).json()
    direct = orjson.loads(answer)
    assert status == 200
    for key in ("model_version", "quantile", "ttft_mean_ms", "ttft_quantile_ms", "tpot_mean_ms", "tpot_quantile_ms"):
        assert direct[key] == via_client[key]
    assert hot.native_predict(orjson.dumps({"rows": [native_row(role="leader")]}), "") is None
    assert hot.native_predict(b"{not json", "") is None
    assert hot.native_predict(orjson.dumps({"rows": []}), "") is None
    assert client.post("/v1/predict", json={"rows": []}).status_code == 422
    assert (
        client.post("/v1/predict", content=b"{not json", headers={"content-type": "application/json"}).status_code
        == 400
    )


def test_a_predicted_value_above_the_served_cap_is_refused_naming_it(client: TestClient) -> None:
    """The service never serves more than `MAX_PREDICTED_MS`, so a predicted value above it is no prediction of
    its: refused (422 naming the field) before it could make the live error's sum infinite for good."""
    from leadtime.features.rows import MAX_PREDICTED_MS

    capped = client.post("/v1/predict", json={"rows": [native_row(timeslice_state="parked", timeslice_wait_ms=1e300)]})
    assert capped.json()["ttft_mean_ms"] == [MAX_PREDICTED_MS]  # the cap is the one answers carry
    for name in ("predicted_ttft_ms", "predicted_tpot_ms", "predicted_ttft_quantile_ms", "predicted_tpot_quantile_ms"):
        for value in (1.7e308, 1e308, MAX_PREDICTED_MS * 1.01):
            entry = dict(native_row(), actual_ttft_ms=0.5, actual_tpot_ms=0.0, **{name: value})
            r = client.post("/v1/observations", json={"observations": [dict(entry)]})
            assert r.status_code == 422 and r.json()["field"] == f"observations[0].{name}", (name, value, r.text)
            r = client.post("/v1/observations", json={"observations": [dict(entry, timestamp=1.7e9)]})  # entry-wise
            assert r.status_code == 422 and r.json()["field"] == f"observations[0].{name}", (name, value, r.text)
    at_cap = dict(native_row(), actual_ttft_ms=500.0, actual_tpot_ms=0.0, predicted_ttft_ms=MAX_PREDICTED_MS)
    assert client.post("/v1/observations", json={"observations": [at_cap]}).status_code == 202
    metrics = client.get("/metrics").text
    assert "+Inf" not in "".join(line for line in metrics.splitlines() if "error_ratio_sum" in line)


def test_observations_the_poisoning_guard_drops_stay_out_of_the_accuracy_metrics(client: TestClient) -> None:
    """A row the learner drops as implausible (`physics.implausible`) is no measurement: neither its live error
    nor its quantile coverage is recorded, or one row claiming a nanosecond TTFT would move the error's sum by
    millions."""
    implausible = dict(
        native_row(),
        actual_ttft_ms=0.000001,
        actual_tpot_ms=0.0,
        predicted_ttft_ms=50.0,
        predicted_ttft_quantile_ms=120,
    )
    plausible = dict(implausible, actual_ttft_ms=100.0)
    r = client.post("/v1/observations", json={"observations": [implausible, plausible, implausible]})
    assert r.status_code == 202
    metrics = client.get("/metrics").text
    labels = 'accelerator="h100-sxm",role="both",target="ttft"'
    assert f"leadtime_live_absolute_percentage_error_ratio_count{{{labels}}} 1.0" in metrics
    assert f"leadtime_live_absolute_percentage_error_ratio_sum{{{labels}}} 0.5" in metrics
    assert (
        'leadtime_live_quantile_checks_total{accelerator="h100-sxm",covered="true",role="both",target="ttft"} 1.0'
        in (metrics)
    )
    assert 'covered="false",role="both",target="ttft"} 0.0' in metrics  # the implausible ones are not checked


def test_the_native_field_lists_are_the_documented_schemas() -> None:
    """`features.rows` holds the one list of a native row's fields (the service and the gRPC client refuse any
    other); the OpenAPI models document the same ones."""
    from leadtime.features.rows import NATIVE_OBSERVATION_FIELDS, NATIVE_ROW_FIELDS
    from leadtime.predictor.service.schemas import NativeObservation, NativeRow

    assert set(NativeRow.model_fields) == NATIVE_ROW_FIELDS
    assert set(NativeObservation.model_fields) == NATIVE_OBSERVATION_FIELDS
