"""The poisoning guard: observations wildly at odds with the hardware's physics are accepted (llm-d's router
needs its 202) but never learned; they are counted in /status, /readyz and /metrics, and the model learns the
rest exactly as if they had never come."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from waiting import wait_until

from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
from leadtime.features.vectorize import Vectorizer
from leadtime.predictor import physics
from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings

PROBE = {
    "kv_cache_percentage": 0.3,
    "input_token_length": 1500,
    "num_request_waiting": 2,
    "num_request_running": 8,
    "num_tokens_generated": 0,
    "prefix_cache_score": 0.0,
}


def entries(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tokens = rng.randint(100, 4000)
        running = rng.randint(1, 16)
        out.append(
            {
                **PROBE,
                "input_token_length": tokens,
                "num_request_running": running,
                "actual_ttft_ms": round(3 * (20 + 0.05 * tokens) * rng.uniform(0.9, 1.1), 3),
                "actual_tpot_ms": round(3 * (8 + 0.4 * running) * rng.uniform(0.9, 1.1), 3),
            }
        )
    return out


def test_the_floor_is_the_roofline_of_the_rows_hardware() -> None:
    """One definition of the physics: the floors are the roofline columns features/ computes for the row."""
    x = Vectorizer().batch([FeatureRow(RequestFeatures(1000), EndpointState(num_request_running=30))]).X
    weights, step = physics.floor_ms("ttft", x)[0], physics.floor_ms("tpot", x)[0]
    assert 1.0 < weights <= step < 100.0  # an 8B model on an H100: a few ms to read the weights
    just_below, far_below = weights / 50, weights / 150
    assert physics.implausible(x, np.array([just_below]), np.array([step])).tolist() == [False]
    assert physics.implausible(x, np.array([far_below]), np.array([step])).tolist() == [True]
    assert physics.implausible(x, np.array([0.0]), np.array([step / 150])).tolist() == [True]
    assert physics.implausible(x, np.array([0.0]), np.array([0.0])).tolist() == [False]  # nothing observed
    assert physics.implausible(x, np.array([9e7]), np.array([0.0])).tolist() == [True]  # over a day


def test_implausible_observations_are_counted_and_not_learned() -> None:
    good = entries(400, seed=1)
    poison = [dict(e, actual_ttft_ms=0.001, actual_tpot_ms=0.0005) for e in entries(60, seed=2)]
    poison += [dict(e, actual_ttft_ms=1e10) for e in entries(15, seed=3)]
    apps = [create_app(ServiceSettings(grpc_port=0)) for _ in range(2)]
    with TestClient(apps[0]) as clean, TestClient(apps[1]) as attacked:
        for i, start in enumerate(range(0, len(good), 100)):
            batch = good[start : start + 100]
            assert clean.post("/add_training_data_bulk", json={"entries": batch}).status_code == 202
            mixed = batch + poison[i * 19 : i * 19 + 19]  # 75 over the 4 batches
            random.Random(start).shuffle(mixed)
            assert attacked.post("/add_training_data_bulk", json={"entries": mixed}).status_code == 202

        def ingestion(client: TestClient) -> dict[str, Any]:
            block: dict[str, Any] = client.get("/status").json()["ingestion"]
            return block

        assert wait_until(lambda: ingestion(clean)["learned"] == 400, timeout_s=30), ingestion(clean)
        assert wait_until(
            lambda: ingestion(attacked)["learned"] + ingestion(attacked)["dropped"]["implausible"] == 475, timeout_s=30
        )
        counts = ingestion(attacked)
        assert counts["accepted"] == 475 and counts["learned"] == 400 and counts["dropped"]["implausible"] == 75
        assert ingestion(clean)["dropped"]["implausible"] == 0
        assert 'leadtime_observations_lost_total{reason="implausible"} 75.0' in attacked.get("/metrics").text
        assert attacked.get("/readyz").status_code == 200

        def predict(client: TestClient) -> dict[str, list[float]]:
            answer: dict[str, list[float]] = client.post("/v1/predict", json={"rows": [PROBE]}).json()
            return answer

        # The attacked service predicts as the clean one does (the same good rows; only their grouping into the
        # learner's batches differs, which moves a prediction by a few percent). Learned, the 60 rows claiming
        # 1 µs would have pulled the log-space correction towards -12.
        a, b = predict(clean), predict(attacked)
        for key in ("ttft_mean_ms", "tpot_mean_ms"):
            assert abs(b[key][0] / a[key][0] - 1) < 0.05, (key, a[key], b[key])
