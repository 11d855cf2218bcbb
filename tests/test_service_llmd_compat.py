"""What llm-d's router and its tools rely on beyond the prediction and training calls: GET /, importances keyed by
llm-d's inputs, the training server's intercept and importance metric lines, and /predict/bulk's schema check."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from llmd_rows import llmd_row

from leadtime.features.rows import LLMD_MODEL_INPUTS
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.llmd_importances import (
    DERIVED_FROM,
    LLMD_OPTIONAL_INPUTS,
    OWN_FEATURES,
    llmd_importances,
    sources,
)
from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings
from leadtime.predictor.trees import TREE_FEATURES


def training_entry(i: int) -> dict[str, Any]:
    entry = llmd_row(input_token_length=100 + 37 * (i % 50), num_request_running=i % 16, num_request_waiting=i % 5)
    entry["actual_ttft_ms"] = 40.0 + 0.2 * entry["input_token_length"] + 30 * entry["num_request_waiting"]
    entry["actual_tpot_ms"] = 12.0 + 0.5 * entry["num_request_running"]
    return entry


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(ServiceSettings())) as c:
        yield c


@pytest.mark.parametrize("role", ["prediction", "training"])
def test_root_says_what_is_running(role: str) -> None:
    settings = ServiceSettings.model_validate({"role": role, "objective": "mean"})
    with TestClient(create_app(settings)) as c:
        r = c.get("/")
        assert r.status_code == 200
        body = r.json()
        assert set(body) >= {"message", "model_type", "objective_type", "quantile", "description"}
        assert "running" in body["message"] and body["model_type"] == "lightgbm"
        assert body["objective_type"] == "mean" and body["quantile"] == 0.9


def test_every_tree_feature_maps_to_llmd_inputs_or_is_leadtimes_own() -> None:
    for feature in TREE_FEATURES:
        assert sources("ttft", feature) or feature in OWN_FEATURES, feature
        assert set(sources("tpot", feature)) <= set(LLMD_MODEL_INPUTS) | set(LLMD_OPTIONAL_INPUTS)
    assert set(DERIVED_FROM) | set(OWN_FEATURES) | {"log_prior"} == set(TREE_FEATURES)


def test_importances_are_summed_onto_the_inputs_they_come_from() -> None:
    shares = llmd_importances(
        "ttft", {"uncached_tokens": 4.0, "num_request_waiting": 2.0, "accel_tflops": 2.0, "log_prior": 0.0}
    )
    assert set(LLMD_MODEL_INPUTS) <= set(shares)
    assert shares["input_token_length"] == pytest.approx(0.25) and shares["prefix_cache_score"] == pytest.approx(0.25)
    assert shares["num_request_waiting"] == pytest.approx(0.25) and shares["accel_tflops"] == pytest.approx(0.25)
    assert shares["decode_tokens_in_flight"] == 0.0 and "pod_type" not in shares
    assert sum(shares.values()) == pytest.approx(1.0)
    assert llmd_importances("tpot", {"role_decode": 1.0})["pod_type"] == pytest.approx(1.0)


def _metric_lines(text: str, name: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        match = re.fullmatch(rf'{name}\{{(?:feature="([a-z_]+)")?\}} (\S+)', line)
        if match:
            out[match.group(1) or ""] = match.group(2)
    return out


def test_importances_404_until_a_tree_serves_then_every_llmd_input_and_the_metric_lines_agree() -> None:
    config = LearnerConfig(background=False, min_window=50, retrain_every=300, tree_rounds=20)
    predictor = OnlinePredictor(config)
    with TestClient(create_app(ServiceSettings(role="training"), predictor=predictor)) as c:
        for target in ("ttft", "tpot"):
            r = c.get(f"/model/{target}/lgb/importances")
            assert r.status_code == 404 and target in r.json()["detail"]
        text = c.get("/metrics").text
        for target in ("ttft", "tpot"):
            assert f"{target}_intercept{{}} 0.0" in text.splitlines()
            lines = _metric_lines(text, f"{target}_importance")
            assert lines == dict.fromkeys(LLMD_MODEL_INPUTS, "0.0")
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        parsed = runtime.parser.parse_observations([training_entry(i) for i in range(1500)])
        predictor.learn_many(parsed.rows.X, parsed.actual_ttft_ms, parsed.actual_tpot_ms)
        predictor.retrain_now()
        # The rows are fixed and the learner seeded (LearnerConfig.seed): trees win on this data every run.
        assert predictor.tree_text("ttft") is not None, "the learner kept its online model (no tree won held out)"
        importances = c.get("/model/ttft/lgb/importances").json()
        assert set(LLMD_MODEL_INPUTS) <= set(importances) and "input_tokens" not in importances
        assert sum(importances.values()) == pytest.approx(1.0)
        assert max(importances[name] for name in LLMD_MODEL_INPUTS) > 0
        lines = _metric_lines(c.get("/metrics").text, "ttft_importance")
        assert set(lines) == set(LLMD_MODEL_INPUTS)
        for name in LLMD_MODEL_INPUTS:
            assert float(lines[name]) == pytest.approx(importances[name])


def test_prediction_role_metrics_carry_no_training_server_lines() -> None:
    with TestClient(create_app(ServiceSettings(role="prediction"))) as c:
        text = c.get("/metrics").text
        assert "ttft_intercept" not in text and "ttft_importance" not in text


BAD_ROWS: list[tuple[dict[str, Any], str]] = [
    ({"input_token_length": None}, "input_token_length"),  # missing (removed below)
    ({"num_request_running": "many"}, "num_request_running"),
    ({"kv_cache_percentage": [0.1]}, "kv_cache_percentage"),
    ({"kv_cache_percentage": 1.5}, "kv_cache_percentage"),
    ({"pod_type": "mixed"}, "pod_type"),
]


def test_bulk_refuses_the_whole_call_when_a_row_fails_llmds_schema(client: TestClient) -> None:
    for bad, field in BAD_ROWS:
        rows = [llmd_row(), llmd_row(**bad), llmd_row()]
        if bad.get("input_token_length", 0) is None:
            del rows[1]["input_token_length"]
        r = client.post("/predict/bulk", json={"requests": rows})
        assert r.status_code == 422, bad
        assert r.json()["field"] == f"requests[1].{field}"


def test_bulk_names_a_row_its_schema_refuses_in_the_words_of_the_other_paths(client: TestClient) -> None:
    """/predict/bulk said pydantic's words ("Field required", "a valid dictionary or instance of LlmdRow", naming a
    class no client sees) where /predict/bulk/strict said the service's for the same row."""
    missing = llmd_row()
    del missing["input_token_length"]
    for row in [missing, "row", [1], *(llmd_row(**bad) for bad, _ in BAD_ROWS[1:]), llmd_row(num_request_waiting=1.5)]:
        body = {"requests": [llmd_row(), row]}
        strict = client.post("/predict/bulk/strict", json=body)
        bulk = client.post("/predict/bulk", json=body)
        assert (strict.status_code, bulk.status_code) == (422, 422), row
        assert bulk.json()["error"] == strict.json()["error"], row
        assert bulk.json()["detail"] == strict.json()["detail"], row
        assert "LlmdRow" not in bulk.text


def test_bulk_keeps_per_row_errors_for_rows_llmds_schema_accepts(client: TestClient) -> None:
    rows = [llmd_row(), llmd_row(accelerator="no-such-gpu"), llmd_row(timeslice_state="asleep")]
    r = client.post("/predict/bulk", json={"requests": rows})
    assert r.status_code == 200
    body = r.json()
    assert [e["index"] for e in body["errors"]] == [1, 2]
    assert body["predictions"][0] is not None and body["predictions"][1] is None
    assert body["successful_predictions"] == 1 and body["failed_predictions"] == 2


def test_every_prediction_path_takes_the_same_pod_types(client: TestClient) -> None:
    """Pod type "both" was taken by /predict/bulk/strict and /predict but refused by /predict/bulk (422)."""
    for pod_type in ("", "both", "prefill", "decode"):
        row = llmd_row(pod_type=pod_type)
        strict = client.post("/predict/bulk/strict", json={"requests": [row]})
        bulk = client.post("/predict/bulk", json={"requests": [row]})
        single = client.post("/predict", json=row)
        assert (strict.status_code, bulk.status_code, single.status_code) == (200, 200, 200), pod_type
        assert bulk.json()["predictions"][0]["ttft_ms"] == strict.json()["predictions"][0]["ttft_ms"]


@pytest.mark.parametrize("field", ["prefill_tokens_in_flight", "decode_tokens_in_flight", "encoder_input_size"])
def test_an_optional_field_sent_as_null_is_named_as_a_bad_value_not_as_missing(client: TestClient, field: str) -> None:
    """Said "is required" of a field llm-d's schema defaults to 0."""
    row = {**llmd_row(), field: None}
    entry = {**row, "actual_ttft_ms": 80.0, "actual_tpot_ms": 20.0}
    for path, body, where in [
        ("/predict/bulk/strict", {"requests": [row]}, f"requests[0].{field}"),
        ("/predict/bulk", {"requests": [row]}, f"requests[0].{field}"),
        ("/predict", row, field),
        ("/add_training_data_bulk", {"entries": [entry]}, f"entries[0].{field}"),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 422, path
        assert r.json()["field"] == where, path
        assert "required" not in r.json()["error"], (path, r.json()["error"])


def test_a_large_bulk_call_with_a_bad_row_lets_other_calls_run_while_its_rows_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/predict/bulk checked its rows one at a time without a turn of the event loop: 10,000 rows took ~0.6 s, and
    every router call (/predict/bulk/strict) arriving meanwhile waited for all of it (measured: 520 ms). A batch
    whose rows are all good is checked a column at a time, as the strict path checks it; one with a bad row is
    checked row by row a slice at a time, other calls answered between slices. The answer is the same."""
    app = create_app(ServiceSettings(grpc_port=0))
    runtime = app.state.runtime
    ticks = 0
    seen: list[int] = []
    parse_one = runtime.parser.parse_one

    def counting(row: Any) -> Any:
        seen.append(ticks)
        return parse_one(row)

    monkeypatch.setattr(runtime.parser, "parse_one", counting)
    rows = [llmd_row(input_token_length=100 + i) for i in range(1_000)]
    rows[500]["kv_cache_percentage"] = "0.4"  # llm-d's schema takes it, Leadtime's checks do not: a per-row error

    async def call() -> tuple[httpx.Response, httpx.Response]:
        nonlocal ticks
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with app.router.lifespan_context(app), client:
            task = asyncio.create_task(client.post("/predict/bulk", json={"requests": rows}))
            while not task.done():
                ticks += 1
                await asyncio.sleep(0)
            good = await client.post("/predict/bulk", json={"requests": rows[:500] + rows[501:]})
            return task.result(), good

    bulk, good = asyncio.run(call())
    assert bulk.status_code == 200, bulk.text
    body = bulk.json()
    assert body["errors"] == [{"index": 500, "error": "requests[500].kv_cache_percentage: must be a number, got '0.4'"}]
    assert body["predictions"][500] is None and body["successful_predictions"] == 999
    assert len(seen) >= 1_000 and len(set(seen)) > 10, "the event loop had no turn while the rows were checked"
    answered = [p for p in body["predictions"] if p is not None]
    assert [p["ttft_ms"] for p in answered] == [p["ttft_ms"] for p in good.json()["predictions"]]
