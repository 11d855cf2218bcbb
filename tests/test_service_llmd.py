"""Contract tests of the llm-d-compatible paths, with the payloads and status codes DESIGN.md lists."""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from llmd_rows import llmd_row
from waiting import wait_for

from leadtime.data import MEASURED
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings
from leadtime.predictor.store.memory import MemoryStore

TRACE = MEASURED["sharegpt-h200"]
ANSWER_FIELDS = {"ttft_ms", "tpot_ms", "predicted_at", "model_type", "objective_type", "quantile", "last_model_load"}


def training_entry(i: int, **overrides: Any) -> dict[str, Any]:
    entry = llmd_row(input_token_length=100 + 37 * (i % 50), num_request_running=i % 16)
    entry["actual_ttft_ms"] = 40.0 + 0.2 * entry["input_token_length"] if i % 2 == 0 else 0.0
    entry["actual_tpot_ms"] = 0.0 if i % 2 == 0 else 12.0 + 0.5 * entry["num_request_running"]
    entry.update(overrides)
    return entry


def is_rfc3339(text: str) -> bool:
    return bool(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", text)) and bool(
        datetime.fromisoformat(text.replace("Z", "+00:00")).tzinfo
    )


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(ServiceSettings())) as c:
        yield c


def test_bulk_strict_answers_every_row_in_request_order(client: TestClient) -> None:
    rows = [llmd_row(input_token_length=n, num_request_waiting=w) for n, w in [(50, 0), (4000, 0), (500, 30), (50, 0)]]
    started = time.perf_counter()
    r = client.post("/predict/bulk/strict", json={"requests": rows})
    took_ms = (time.perf_counter() - started) * 1e3
    assert r.status_code == 200
    body = r.json()
    assert body["total_requests"] == 4 and body["successful_predictions"] == 4 and body["failed_predictions"] == 0
    assert 0 < body["processing_time_ms"] <= took_ms  # the server's part of the call this client timed
    predictions = body["predictions"]
    assert len(predictions) == 4
    for p in predictions:
        assert set(p) == ANSWER_FIELDS
        assert p["ttft_ms"] >= 0 and p["tpot_ms"] >= 0
        assert p["model_type"] == "lightgbm" and p["objective_type"] == "quantile" and p["quantile"] == 0.9
        assert is_rfc3339(p["predicted_at"])
    # Order: a long prompt and a deep queue take longer than a short idle one; identical rows answer alike.
    ttft = [p["ttft_ms"] for p in predictions]
    assert ttft[1] > ttft[0] and ttft[2] > ttft[0] and ttft[3] == ttft[0]


def test_bulk_strict_takes_10000_rows_and_refuses_more(client: TestClient) -> None:
    rows = [llmd_row(input_token_length=i) for i in range(10_000)]
    r = client.post("/predict/bulk/strict", json={"requests": rows})
    assert r.status_code == 200 and len(r.json()["predictions"]) == 10_000
    r = client.post("/predict/bulk/strict", json={"requests": rows + [llmd_row()]})
    assert r.status_code == 422 and r.json()["field"] == "requests"


@pytest.mark.parametrize(
    ("row", "field"),
    [
        (llmd_row(kv_cache_percentage=1.5), "requests[1].kv_cache_percentage"),
        ({k: v for k, v in llmd_row().items() if k != "input_token_length"}, "requests[1].input_token_length"),
        (llmd_row(num_request_waiting=-1), "requests[1].num_request_waiting"),
        (llmd_row(prefix_cache_score="high"), "requests[1].prefix_cache_score"),
        (llmd_row(pod_type="gpu"), "requests[1].pod_type"),
        (llmd_row(num_tokens_generated=2.5), "requests[1].num_tokens_generated"),
        ("not a row", "requests[1]"),
    ],
)
def test_bulk_strict_refuses_a_bad_row_with_422_naming_it(client: TestClient, row: Any, field: str) -> None:
    r = client.post("/predict/bulk/strict", json={"requests": [llmd_row(), row]})
    assert r.status_code == 422
    body = r.json()
    assert body["field"] == field
    assert field in body["error"]
    assert body["detail"][0]["loc"][:3] == ["body", "requests", 1]


def test_bad_bodies_are_json_errors(client: TestClient) -> None:
    r = client.post("/predict/bulk/strict", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    for path in ("/predict/bulk/strict", "/predict", "/v1/predict", "/v1/explain", "/add_training_data_bulk"):
        r = client.post(path, json=[llmd_row()])  # JSON, of the wrong shape: a bad value (422), not a bad body
        assert r.status_code == 422 and r.json()["field"] == "body", (path, r.text)
    r = client.post("/predict/bulk/strict", json={"requests": []})
    assert r.status_code == 422 and r.json()["field"] == "requests"
    r = client.post("/predict/bulk/strict", json={"rows": [llmd_row()]})
    assert r.status_code == 422 and r.json()["field"] == "requests"
    r = client.get("/no/such/path")
    assert r.status_code == 404 and "error" in r.json()


def test_unknown_fields_ride_along_and_extras_are_used(client: TestClient) -> None:
    plain = client.post("/predict/bulk/strict", json={"requests": [llmd_row(some_future_field=3)]})
    assert plain.status_code == 200
    slow = client.post("/predict/bulk/strict", json={"requests": [llmd_row(accelerator="l40s")]})
    assert slow.json()["predictions"][0]["tpot_ms"] > plain.json()["predictions"][0]["tpot_ms"]


def test_a_row_role_reads_alike_on_the_prediction_and_training_paths(client: TestClient) -> None:
    """`role` (Leadtime's name for pod_type, among the extras llm-d's paths take) was read by
    /add_training_data_bulk and ignored by the prediction paths: a row learned as decode was predicted as unified."""
    by_pod_type = client.post("/predict/bulk/strict", json={"requests": [llmd_row(pod_type="decode")]})
    by_role = client.post("/predict/bulk/strict", json={"requests": [llmd_row(role="decode")]})
    role, pod_type = (r.json()["predictions"][0] for r in (by_role, by_pod_type))
    assert (role["ttft_ms"], role["tpot_ms"]) == (pod_type["ttft_ms"], pod_type["tpot_ms"])
    refused = client.post("/predict/bulk/strict", json={"requests": [llmd_row(role="worker")]})
    assert refused.status_code == 422 and refused.json()["field"] == "requests[0].role", refused.text
    per_row = client.post("/predict/bulk", json={"requests": [llmd_row(role="worker")]}).json()  # an extra: per row
    assert per_row["predictions"] == [None] and "requests[0].role" in per_row["errors"][0]["error"]
    entry = dict(llmd_row(role="worker"), actual_ttft_ms=10.0, actual_tpot_ms=0.0)
    refused = client.post("/add_training_data_bulk", json={"entries": [entry]})
    assert refused.status_code == 422 and refused.json()["field"] == "entries[0].role"


def test_bulk_reports_per_row_errors_and_null_predictions(client: TestClient) -> None:
    # Row 1 passes llm-d's schema but names an accelerator class Leadtime does not know: it cannot be predicted.
    rows = [llmd_row(), llmd_row(accelerator="no-such-gpu"), llmd_row(input_token_length=20)]
    r = client.post("/predict/bulk", json={"requests": rows})
    assert r.status_code == 200
    body = r.json()
    assert body["total_requests"] == 3 and body["successful_predictions"] == 2 and body["failed_predictions"] == 1
    assert body["predictions"][1] is None
    assert set(body["predictions"][0]) == ANSWER_FIELDS and set(body["predictions"][2]) == ANSWER_FIELDS
    assert body["errors"] == [{"index": 1, "error": body["errors"][0]["error"]}]
    assert "requests[1].accelerator" in body["errors"][0]["error"]


def test_pod_type_both_reads_as_unified_and_the_messages_say_so(client: TestClient) -> None:
    """The row parsers take "both" as unified (Leadtime's role name) but their message did not list it.
    `/predict/bulk` refuses it with the whole call, as llm-d's own schema does (test_service_llmd_compat)."""
    unified, both = llmd_row(), llmd_row(pod_type="both")
    strict = client.post("/predict/bulk/strict", json={"requests": [unified, both]}).json()["predictions"]
    assert strict[0]["ttft_ms"] == strict[1]["ttft_ms"]
    assert client.post("/predict", json=both).status_code == 200
    refused = client.post("/predict/bulk/strict", json={"requests": [llmd_row(pod_type="PREFILL")]})
    assert "'both'" in refused.json()["error"]


def test_predict_answers_one_row(client: TestClient) -> None:
    r = client.post("/predict", json=llmd_row())
    assert r.status_code == 200 and set(r.json()) == ANSWER_FIELDS
    strict = client.post("/predict/bulk/strict", json={"requests": [llmd_row()]}).json()["predictions"][0]
    assert r.json()["ttft_ms"] == strict["ttft_ms"]
    bad = client.post("/predict", json=llmd_row(kv_cache_percentage=None))
    assert bad.status_code == 422 and bad.json()["field"] == "kv_cache_percentage"


def test_mean_objective_serves_means_below_the_quantile() -> None:
    rows = [llmd_row(input_token_length=n) for n in (100, 1000, 3000)]
    with TestClient(create_app(ServiceSettings(objective="mean"))) as mean_client:
        means = mean_client.post("/predict/bulk/strict", json={"requests": rows}).json()["predictions"]
        assert all(p["objective_type"] == "mean" for p in means)
        assert mean_client.get("/status").json()["objective_type"] == "mean"
    with TestClient(create_app(ServiceSettings(objective="quantile", quantile=0.95))) as q_client:
        uppers = q_client.post("/predict/bulk/strict", json={"requests": rows}).json()["predictions"]
        assert all(p["quantile"] == 0.95 for p in uppers)
    assert all(u["ttft_ms"] >= m["ttft_ms"] for u, m in zip(uppers, means, strict=True))


def test_add_training_data_bulk_answers_exactly_202_and_learns_behind(client: TestClient) -> None:
    before = client.post("/predict/bulk/strict", json={"requests": [llmd_row()]}).json()["predictions"][0]
    entries = [training_entry(i) for i in range(400)]
    r = client.post("/add_training_data_bulk", json={"entries": entries})
    assert r.status_code == 202
    assert r.json() == {"message": "Accepted 400 training samples."}
    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    deadline = 1200  # a wait, not a speed check: up to 60 s on a busy machine
    while sum(runtime.learned().values()) < 400 and deadline:
        import time

        time.sleep(0.05)
        deadline -= 1
    assert runtime.learned() == {"ttft": 200, "tpot": 200}
    after = client.post("/predict/bulk/strict", json={"requests": [llmd_row()]}).json()["predictions"][0]
    assert after["ttft_ms"] != before["ttft_ms"]


def test_a_bad_entry_deep_in_a_large_batch_is_named_by_its_index_and_nothing_is_accepted(client: TestClient) -> None:
    # Large batches are checked a slice at a time between turns of the event loop; the index is the batch's.
    entries = [training_entry(i) for i in range(1_000)]
    entries[700]["input_token_length"] = -1
    r = client.post("/add_training_data_bulk", json={"entries": entries})
    assert r.status_code == 422 and r.json()["field"] == "entries[700].input_token_length"
    assert client.app.state.runtime.store.stats()["appended"] == 0  # type: ignore[attr-defined]
    del entries[700]
    assert client.post("/add_training_data_bulk", json={"entries": entries}).status_code == 202
    assert client.app.state.runtime.store.stats()["appended"] == 999  # type: ignore[attr-defined]


def test_add_training_data_bulk_rejects_the_whole_batch_on_a_bad_entry(client: TestClient) -> None:
    entries = [training_entry(i) for i in range(5)]
    entries[3]["actual_ttft_ms"] = -4
    r = client.post("/add_training_data_bulk", json={"entries": entries})
    assert r.status_code == 422 and r.json()["field"] == "entries[3].actual_ttft_ms"
    missing = [training_entry(0)]
    del missing[0]["actual_tpot_ms"]
    r = client.post("/add_training_data_bulk", json={"entries": missing})
    assert r.status_code == 422 and r.json()["field"] == "entries[0].actual_tpot_ms"
    r = client.post("/add_training_data_bulk", json={"entries": [training_entry(0, timestamp="yesterday")]})
    assert r.status_code == 422 and r.json()["field"] == "entries[0].timestamp"
    assert client.app.state.runtime.store.stats()["appended"] == 0  # type: ignore[attr-defined]
    ok = client.post("/add_training_data_bulk", json={"entries": [training_entry(0, timestamp="2026-01-01T00:00:00Z")]})
    assert ok.status_code == 202
    # The same timestamp forms features/ accepts: epoch seconds as a number or a string, offset-less RFC 3339.
    for stamp in (1767225600, "1767225600.5", "2026-01-01T00:00:00", 1767225600000):  # the last in ms, as pydantic
        ok = client.post("/add_training_data_bulk", json={"entries": [training_entry(0, timestamp=stamp)]})
        assert ok.status_code == 202, (stamp, ok.json())
    r = client.post("/add_training_data_bulk", json={"entries": [training_entry(0, timestamp=1e20)]})
    assert r.status_code == 422 and r.json()["field"] == "entries[0].timestamp"  # after the year 9999 in ms too


def test_status_health_and_readiness(client: TestClient) -> None:
    status = client.get("/status").json()
    assert status["is_ready"] is True
    assert status["model_type"] == "lightgbm" and status["objective_type"] == "quantile" and status["quantile"] == 0.9
    assert status["models_exist"] == {"ttft_model": True, "tpot_model": True}
    assert status["ensemble_active"] is False
    assert status["last_model_load"] is None or is_rfc3339(status["last_model_load"])
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_probes_answer_head(client: TestClient) -> None:
    """Load balancers and `curl -I` probe with HEAD: the same status as GET, no body."""
    for path in ("/healthz", "/readyz", "/status", "/metrics"):
        r = client.head(path)
        assert r.status_code == 200, (path, r.status_code)
        assert r.content == b""


def test_503_before_the_service_has_started() -> None:
    app = create_app(ServiceSettings())
    c = TestClient(app)  # no context manager: the lifespan (which loads the model) has not run
    r = c.post("/predict/bulk/strict", json={"requests": [llmd_row()]})
    assert r.status_code == 503 and "not ready" in r.json()["error"]
    ready = c.get("/readyz")
    assert ready.status_code == 503 and ready.json()["degraded"]["predictor"] == "not started"
    assert c.get("/status").json()["is_ready"] is False
    assert c.get("/healthz").status_code == 200


def test_model_download_info_and_models_list(client: TestClient) -> None:
    info = client.get("/model/download/info").json()
    assert info["model_type"] == "lightgbm" and info["quantile"] == 0.9
    assert "ttft" in info["available_endpoints"] and isinstance(info["model_status"], dict)
    # Readiness flags alone, as llm-d's: a client decoding the map as name -> bool failed on a version number.
    assert info["model_status"] and all(isinstance(v, bool) for v in info["model_status"].values())
    assert isinstance(info["model_version"], int) and "last_model_load" in info
    listing = client.get("/models/list").json()
    assert set(listing["models"]) == {"ttft", "tpot", "ttft_gated", "tpot_gated"}
    for name, model in listing["models"].items():
        assert set(model) == {"exists", "size_bytes", "last_modified"}
        assert model["exists"] is (name in ("ttft", "tpot"))
    assert listing["model_type"] == "lightgbm" and is_rfc3339(listing["server_time"])


def test_model_info_and_download(client: TestClient) -> None:
    info = client.get("/model/ttft/info")
    assert info.status_code == 200
    assert set(info.json()) == {"model_name", "path", "size_bytes", "last_modified", "exists", "model_type", "quantile"}
    assert info.json()["exists"] is True
    download = client.get("/model/ttft/download")
    assert download.status_code == 200
    document = json.loads(download.content)  # JSON, never a pickle
    assert document["target"] == "ttft" and document["model_type"] == "lightgbm"
    assert len(download.content) == info.json()["size_bytes"]
    assert client.get("/model/ttft_gated/info").json()["exists"] is False
    assert client.get("/model/ttft_gated/download").status_code == 404
    unknown = client.get("/model/nope/info")
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]


def test_downloads_are_cut_from_the_model_encoded_once_per_model_installed(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llm-d's prediction servers ask for /model/{name}/download every second: the model is encoded once per model
    installed (the artifact /v1/model serves), not once per download, listing, info or export."""
    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    encodings = []
    original = OnlinePredictor.to_bytes

    def counted(self: OnlinePredictor) -> bytes:
        encodings.append(1)
        return original(self)

    monkeypatch.setattr(OnlinePredictor, "to_bytes", counted)
    for _ in range(3):
        for name in ("ttft", "tpot"):
            assert client.get(f"/model/{name}/download").status_code == 200
            assert client.get(f"/model/{name}/info").json()["exists"] is True
        assert client.get("/models/list").status_code == 200
    assert client.get("/model/export").status_code == 200
    assert len(encodings) <= 1
    artifact = json.loads(runtime.serving_artifact()[0])
    for name in ("ttft", "tpot"):
        document = json.loads(client.get(f"/model/{name}/download").content)
        assert document["state"] == artifact["targets"][name] and document["version"] == artifact["version"]


def test_lgb_text_is_404_until_a_tree_serves_then_plain_text() -> None:
    config = LearnerConfig(background=False, min_window=50, retrain_every=300, tree_rounds=20)
    predictor = OnlinePredictor(config)
    with TestClient(create_app(ServiceSettings(), predictor=predictor)) as c:
        r = c.get("/model/ttft/lgb/txt")
        assert r.status_code == 404 and "ttft" in r.json()["error"]
        none_yet = c.get("/model/ttft/lgb/importances")
        assert none_yet.status_code == 404 and "ttft" in none_yet.json()["detail"]
        assert c.get("/model/itl/lgb/txt").status_code == 404
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        parsed = runtime.parser.parse_observations([training_entry(i) for i in range(1200)])
        predictor.learn_many(parsed.rows, parsed.actual_ttft_ms, parsed.actual_tpot_ms)
        predictor.retrain_now()
        # The rows are fixed and the learner seeded (LearnerConfig.seed): trees win on this data every run.
        assert predictor.tree_text("ttft") is not None, "the learner kept its online model (no tree won held out)"
        text = c.get("/model/ttft/lgb/txt")
        assert text.status_code == 200 and text.headers["content-type"] == "text/plain; charset=utf-8"
        assert text.text.startswith("tree")
        importances = c.get("/model/ttft/lgb/importances").json()
        assert "input_token_length" in importances and "input_tokens" not in importances


def test_data_status_and_flush(client: TestClient) -> None:
    client.post("/add_training_data_bulk", json={"entries": [training_entry(i) for i in range(100)]})
    status = client.get("/data/status").json()
    train, test = status["training_data"], status["test_data"]
    assert train["total_samples"] + test["total_samples"] == 100
    assert test["total_samples"] == 10
    assert train["total_samples"] == train["ttft_samples"] + train["tpot_samples"]
    assert status["ensemble"]["ensemble_active"] is False and status["model_ready"] is True
    flushed = client.post("/flush", json={"flush_test_data": False, "reason": "test"})
    assert flushed.status_code == 200
    body = flushed.json()
    assert body["success"] is True and body["reason"] == "test" and is_rfc3339(body["flushed_at"])
    assert body["ttft_training_samples_flushed"] + body["tpot_training_samples_flushed"] == 90
    assert body["ttft_test_samples_flushed"] == 0 and body["tpot_test_samples_flushed"] == 0
    assert body["metrics_cleared"] is True and body["message"].startswith("Successfully flushed: ")
    after = client.get("/data/status").json()
    assert after["training_data"]["total_samples"] == 0 and after["test_data"]["total_samples"] == 10
    # No body, its JSON Content-Type given: flush everything; without the Content-Type, refused (a page could send it).
    assert client.post("/flush", headers={"content-type": "application/json"}).status_code == 200
    assert client.post("/flush").status_code == 415
    bad = client.post("/flush", json={"flush_training_data": "maybe"})
    assert bad.status_code == 422 and bad.json()["field"] == "flush_training_data"
    assert client.post("/flush", json={"surprise": True}).status_code == 422
    assert client.post("/flush", content=b"{", headers={"content-type": "application/json"}).status_code == 400


def test_flush_names_the_option_a_misspelt_key_may_be_a_slip_for(client: TestClient) -> None:
    """Said pydantic's "Extra inputs are not permitted", leaving the user to guess what the key should be."""
    r = client.post("/flush", json={"flush_training": False})
    assert r.status_code == 422 and r.json()["field"] == "flush_training"
    assert r.json()["error"] == "flush_training: is not a field of /flush (did you mean 'flush_training_data'?)"


def test_reload_answers_in_llmd_shape(client: TestClient) -> None:
    r = client.post("/reload")
    assert r.status_code == 200
    body = r.json()
    assert {"synced", "loaded", "is_ready", "model_type", "objective_type", "quantile", "last_load_time"} <= set(body)
    assert body["synced"] is True and body["loaded"] is False and body["is_ready"] is True


def test_last_model_load_stays_null_until_a_real_load_and_learning_does_not_move_it() -> None:
    """Regression: one observation learned (no load, retrain or pull; model version 0) turned `last_model_load`
    from null into the learner process's start-up time, earlier than answers that had said null: the learner's
    copy of the serving model, and each snapshot the service installs from it, stamped a load of their own."""
    store = MemoryStore()
    with TestClient(create_app(ServiceSettings(), store=store)) as c:
        runtime = c.app.state.runtime  # type: ignore[attr-defined]

        def load_times() -> set[Any]:
            answer = c.post("/predict/bulk/strict", json={"requests": [llmd_row()]}).json()["predictions"][0]
            status = c.get("/status").json()
            return {answer["last_model_load"], status["last_model_load"], c.post("/reload").json()["last_load_time"]}

        def learn(i: int, total: int) -> None:
            assert c.post("/add_training_data_bulk", json={"entries": [training_entry(i)]}).status_code == 202
            wait_for(lambda: sum(runtime.learned().values()) >= total, 20, "the observation learned")

        assert load_times() == {None}
        learn(0, 1)
        assert c.get("/status").json()["model_version"] == 0
        assert load_times() == {None}
        # A real load (a model published by another replica, taken up by /reload or the sync loop, whichever comes
        # first): its time, then kept as the service learns on.
        published = OnlinePredictor(LearnerConfig(background=False))
        published.version = 1
        store.publish_model(published.to_bytes())
        loaded = c.post("/reload").json()["last_load_time"]
        assert c.get("/status").json()["model_version"] == 1 and is_rfc3339(loaded)
        assert load_times() == {loaded}
        learn(1, 1)  # learned on from the published model's 0 observations
        assert load_times() == {loaded}


def test_model_export_is_a_tar_of_json_models_and_metadata(client: TestClient) -> None:
    r = client.get("/model/export")
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        names = tar.getnames()
        metadata_file = tar.extractfile("metadata.json")
        assert metadata_file is not None
        metadata = json.load(metadata_file)
        artifact_file = tar.extractfile("leadtime-predictor.json")
        assert artifact_file is not None
        OnlinePredictor.from_bytes(artifact_file.read()).close()  # loads back: a seed for a new deployment
    assert "metadata.json" in names and "leadtime-predictor.json" in names
    assert metadata["model_type"] == "lightgbm" and metadata["quantile_alpha"] == 0.9
    assert is_rfc3339(metadata["exported_at"])


def test_split_roles_serve_their_own_paths() -> None:
    with TestClient(create_app(ServiceSettings(role="prediction"))) as prediction:
        assert prediction.post("/predict/bulk/strict", json={"requests": [llmd_row()]}).status_code == 200
        assert prediction.post("/reload").status_code == 200
        assert prediction.post("/add_training_data_bulk", json={"entries": []}).status_code == 404
        assert prediction.get("/status").json()["role"] == "prediction"
        assert "training_samples_count" not in prediction.get("/metrics").text
        assert prediction.get("/v1/model").headers["x-leadtime-role"] == "prediction"  # no source to pull from
    with TestClient(create_app(ServiceSettings(role="training"))) as training:
        assert training.post("/predict/bulk/strict", json={"requests": [llmd_row()]}).status_code == 404
        assert training.post("/add_training_data_bulk", json={"entries": [training_entry(1)]}).status_code == 202
        assert training.get("/models/list").status_code == 200
        assert training.get("/status").json()["holds_training_lease"] is True
        # Its model, for the prediction servers that pull it (`serve --role prediction --model-from URL`).
        etag = training.get("/v1/model").headers["etag"]
        assert training.get("/v1/model").headers["x-leadtime-role"] == "training"
        assert training.get("/v1/model", headers={"If-None-Match": etag}).status_code == 304


def test_real_llmd_rows_from_the_h200_trace_are_accepted(client: TestClient) -> None:
    with TRACE.open() as f:
        entries = [json.loads(line) for _, line in zip(range(500), f, strict=False)]
    assert client.post("/add_training_data_bulk", json={"entries": entries}).status_code == 202
    rows = [{k: v for k, v in e.items() if not k.startswith("actual_")} for e in entries[:100]]
    r = client.post("/predict/bulk/strict", json={"requests": rows})
    assert r.status_code == 200 and r.json()["successful_predictions"] == 100


def test_strict_answers_are_what_orjson_writes_for_the_answer_objects(client: TestClient) -> None:
    from leadtime.predictor.service.llmd_prediction import _served, strict_answer

    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    rows = [llmd_row(input_token_length=n) for n in (1, 50, 4000, 123_457)]
    parsed = runtime.parser.parse(rows)
    raw = strict_answer(runtime, parsed, started=0.0)
    answer = orjson.loads(raw)
    assert raw == orjson.dumps(answer)  # the splice is byte for byte orjson's own encoding of what it holds
    ttft, tpot = _served(runtime, parsed)
    assert [p["ttft_ms"] for p in answer["predictions"]] == ttft
    assert [p["tpot_ms"] for p in answer["predictions"]] == tpot
    order = ["ttft_ms", "tpot_ms", "predicted_at", "model_type", "objective_type", "quantile", "last_model_load"]
    assert all(list(p) == order for p in answer["predictions"])  # llm-d's field order


def test_bodies_with_extras_or_errors_still_get_the_general_answers(client: TestClient) -> None:
    r = client.post("/predict/bulk/strict", json={"requests": [llmd_row(endpoint_id="pod-a", input_token_length=9.0)]})
    assert r.status_code == 200 and r.json()["total_requests"] == 1
    r = client.post("/predict/bulk/strict", json={"requests": [llmd_row(), llmd_row(input_token_length=-3)]})
    assert r.status_code == 422 and r.json()["field"] == "requests[1].input_token_length"


def test_small_and_large_training_batches_are_accepted_and_counted_alike(client: TestClient) -> None:
    # Up to 256 plain entries are answered by the edge's hot path, larger batches by the route; same contract.
    from leadtime.predictor.service.hot_path import MAX_HOT_ENTRIES

    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    for n in (10, MAX_HOT_ENTRIES, MAX_HOT_ENTRIES + 1):
        before = runtime.store.stats()["appended"]
        r = client.post("/add_training_data_bulk", json={"entries": [training_entry(i) for i in range(n)]})
        assert r.status_code == 202 and r.json() == {"message": f"Accepted {n} training samples."}
        assert runtime.store.stats()["appended"] == before + n
    total = 10 + 2 * MAX_HOT_ENTRIES + 1
    status = client.get("/data/status").json()
    assert status["training_data"]["total_samples"] + status["test_data"]["total_samples"] == total
    assert f'leadtime_observations_accepted_total{{api="llmd"}} {float(total)}' in client.get("/metrics").text
