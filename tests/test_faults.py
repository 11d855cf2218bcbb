"""Faults with real processes: `leadtime serve --redis` as a child process beside a real redis-server.

- Redis killed (SIGKILL) and restarted mid-traffic: every prediction is answered meanwhile, every observation
  answered 202 is learned once Redis is back, and the shared stream holds them all.
- A replica killed and started again: it serves the newest model of the registry (the same predictions).
(The gateway's faults, a predictor killed or slow and a broken endpoints file, are in test_gateway_e2e.py.)
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
from redis_server import RedisServer, free_port
from test_replicas import PROBE, training_entries
from waiting import wait_until

from leadtime.bench.procs import Child
from leadtime.features.rows import feature_row_from_llmd
from leadtime.predictor.learner import OnlinePredictor
from leadtime.predictor.store.redis_store import RedisStore


def start_replica(workdir: Path, redis_url: str, name: str, *extra: str) -> tuple[Child, str]:
    port = free_port()
    args = ["serve", "--port", str(port), "--grpc-port", "0", "--redis", redis_url, *extra]
    child = Child(args, workdir / f"{name}.log", env={"LEADTIME_REPLICA_ID": name, "LEADTIME_RETRAIN_EVERY": "300"})
    url = f"http://127.0.0.1:{port}"
    child.wait_until(f"{url}/readyz")
    return child, url


def status(url: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(f"{url}/status", timeout=5).json()
    return answer


class Traffic:
    """A router's traffic on a thread: a prediction every 10 ms, a 50-entry observation batch every 100 ms."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.predictions = self.failed_predictions = self.accepted = 0
        self.refused: list[str] = []
        self._stop = threading.Event()
        self._entries = training_entries(5_000, seed=7)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=5) as client:
            tick = 0
            while not self._stop.is_set():
                try:
                    answer = client.post("/predict/bulk/strict", json={"requests": [PROBE] * 20})
                    ok = answer.status_code == 200 and answer.json()["predictions"][0]["ttft_ms"] > 0
                except httpx.HTTPError:
                    ok = False
                self.predictions += 1
                self.failed_predictions += not ok
                if tick % 10 == 0 and self.accepted + 50 <= len(self._entries):
                    batch = self._entries[self.accepted : self.accepted + 50]
                    answer = client.post("/add_training_data_bulk", json={"entries": batch})
                    if answer.status_code == 202:
                        self.accepted += len(batch)
                    else:
                        self.refused.append(f"{answer.status_code} {answer.text[:200]}")
                tick += 1
                self._stop.wait(0.01)


def test_redis_killed_and_restarted_mid_traffic_loses_nothing(tmp_path: Path, redis_server: RedisServer) -> None:
    child, url = start_replica(tmp_path, redis_server.url, "a")
    try:
        with Traffic(url) as traffic:
            assert wait_until(lambda: traffic.accepted >= 500, 20)
            redis_server.stop()  # SIGKILL: a crash, and no persistence
            down_at = traffic.accepted
            assert wait_until(lambda: "redis" in httpx.get(f"{url}/readyz", timeout=5).json().get("degraded", {}), 10)
            assert wait_until(lambda: traffic.accepted >= down_at + 500, 20)  # accepted while Redis is down
            redis_server.start()  # same port, empty
            back_at = traffic.accepted
            assert wait_until(lambda: traffic.accepted >= back_at + 300, 20)
        assert traffic.failed_predictions == 0, f"{traffic.failed_predictions} of {traffic.predictions} failed"
        assert traffic.refused == []
        assert traffic.predictions > 200
        # Everything answered 202 is learned, and the ones sent while Redis was down reached the stream.
        assert wait_until(lambda: status(url)["ingestion"]["learned"] == traffic.accepted, 30), (
            status(url)["ingestion"],
            traffic.accepted,
        )
        store = RedisStore(redis_server.url)
        try:
            cursor, stream = "0", 0
            while True:
                cursor, entries = store.read_observations(cursor, 1_000)
                if not entries:
                    break
                stream += len(entries)
            # Redis restarted empty: it holds what came since the outage began, and what it had taken before the
            # crash but the replica had not read yet (sent again: that is what made `learned` whole above).
            assert stream >= traffic.accepted - down_at
        finally:
            store.close()
        assert wait_until(lambda: httpx.get(f"{url}/readyz", timeout=5).json().get("degraded", {}) == {}, 10)
    finally:
        child.stop()


def test_a_restarted_replica_serves_the_newest_model_of_the_registry(tmp_path: Path, redis_url: str) -> None:
    child, url = start_replica(tmp_path, redis_url, "a", "--objective", "mean")
    try:
        entries = training_entries(900, seed=8)
        with httpx.Client(base_url=url, timeout=10) as client:
            for start in range(0, len(entries), 100):
                assert (
                    client.post("/add_training_data_bulk", json={"entries": entries[start : start + 100]}).status_code
                    == 202
                )
        assert wait_until(lambda: status(url)["registry_version"] >= 1, 60), status(url)
        assert wait_until(lambda: status(url)["ingestion"]["learned"] == len(entries), 30)
        before = status(url)
        child.kill()  # SIGKILL: no goodbye, no final save
        # Read once nothing can publish any more (a retrain due at the end of the stream may have published after
        # `before`): the registry's newest model is then final.
        published = RedisStore(redis_url)
        try:
            latest = published.latest_model()
        finally:
            published.close()
        assert latest is not None and latest[0] >= before["registry_version"], (latest, before)
        child, url = start_replica(tmp_path, redis_url, "a2", "--objective", "mean")
        after = status(url)
        assert after["registry_version"] == latest[0], (before, after, latest[0])
        assert after["model_version"] >= 1
        answer = httpx.post(f"{url}/v1/predict", json={"rows": [PROBE]}, timeout=10).json()
        expected = OnlinePredictor.from_bytes(latest[1], background=False)
        try:
            reference = expected.predict_one(feature_row_from_llmd(PROBE))
        finally:
            expected.close()
        for target in ("ttft", "tpot"):  # exactly what the registry's newest model predicts
            assert abs(answer[f"{target}_mean_ms"][0] / reference[f"{target}_mean"] - 1) < 1e-9, (answer, reference)
    finally:
        child.stop()
