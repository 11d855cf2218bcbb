"""Two predictor replicas sharing one real Redis: what one is told, both learn; models spread; outages heal.

Each replica is a full app (`create_app` with `redis_url`, so it builds its own RedisStore exactly as
`leadtime serve --redis` does) driven through FastAPI's TestClient with its lifespan running, so the ingest,
model-sync and lease loops are the real ones.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from redis_server import RedisServer
from waiting import wait_until

from leadtime.predictor.artifact import ARTIFACT_VERSION, decode, encode, load_file, save_file, seal
from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.learning import STREAM_KEY
from leadtime.predictor.service.runtime import ServiceRuntime
from leadtime.predictor.settings import ServiceSettings
from leadtime.predictor.store.redis_store import RedisStore

PROBE = {  # one llm-d prediction row, asked of both replicas before and after learning
    "kv_cache_percentage": 0.4,
    "input_token_length": 2_000,
    "num_request_waiting": 3,
    "num_request_running": 8,
    "num_tokens_generated": 0,
    "prefix_cache_score": 0.0,
}

RECOVERY_S = 30.0
"""How long a replica may take to be fully ready again once Redis is back: a lease renewal (a third of the TTL) and
a publication, on a host the whole suite loads (5 s was missed there once, and 15 s once, never alone). It checks
that the replica recovers, not how fast: benchmarks measure speed."""


def training_entries(n: int, seed: int, slowdown: float = 8.0) -> list[dict[str, Any]]:
    """llm-d training entries from a fleet `slowdown` times slower than the physics prior expects."""
    rng = random.Random(seed)
    entries = []
    for _ in range(n):
        tokens = rng.randint(100, 4_000)
        waiting = rng.randint(0, 8)
        running = rng.randint(1, 16)
        ttft = slowdown * (20.0 + 0.05 * tokens + 15.0 * waiting) * rng.uniform(0.9, 1.1)
        tpot = slowdown * (8.0 + 0.4 * running) * rng.uniform(0.9, 1.1)
        entries.append(
            {
                "kv_cache_percentage": round(rng.uniform(0.0, 0.9), 3),
                "input_token_length": tokens,
                "num_request_waiting": waiting,
                "num_request_running": running,
                "num_tokens_generated": rng.randint(0, 200),
                "prefix_cache_score": round(rng.uniform(0.0, 1.0), 3),
                "actual_ttft_ms": round(ttft, 3),
                "actual_tpot_ms": round(tpot, 3),
            }
        )
    return entries


class Replica:
    """One running app and the handles a test needs on it."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.runtime: ServiceRuntime = client.app.state.runtime  # type: ignore[attr-defined]
        self.running = False

    def start(self) -> None:
        self.client.__enter__()  # runs the app's lifespan: the runtime and its loops start
        self.running = True

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.client.__exit__(None, None, None)

    @property
    def store(self) -> RedisStore:
        assert isinstance(self.runtime.store, RedisStore)
        return self.runtime.store

    def predict(self, row: dict[str, Any]) -> dict[str, Any]:
        answer = self.client.post("/predict/bulk/strict", json={"requests": [row]})
        assert answer.status_code == 200, answer.text
        prediction: dict[str, Any] = answer.json()["predictions"][0]
        return prediction

    def send(self, entries: list[dict[str, Any]]) -> None:
        answer = self.client.post("/add_training_data_bulk", json={"entries": entries})
        assert answer.status_code == 202, answer.text
        assert answer.json() == {"message": f"Accepted {len(entries)} training samples."}

    def learned(self) -> int:
        return self.runtime.learned()["ttft"]

    def serves_registry_version(self, version: int) -> bool:
        return int(self.status()["registry_version"]) >= version

    def redis_degraded(self) -> bool:
        return "redis" in self.readyz_degraded()

    def fully_ready(self) -> bool:
        return not self.readyz_degraded()

    def readyz_degraded(self) -> dict[str, str]:
        answer = self.client.get("/readyz")
        assert answer.status_code == 200  # still serving predictions: degraded parts are named, not fatal
        degraded: dict[str, str] = answer.json()["degraded"]
        return degraded

    def status(self) -> dict[str, Any]:
        answer = self.client.get("/status")
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body


@pytest.fixture
def start_replicas(redis_url: str) -> Iterator[Callable[..., list[Replica]]]:
    """Start replicas "a", "b", ... on the test's Redis; "a" starts first and so takes the training lease."""
    started: list[Replica] = []

    def start(count: int = 2, **settings: Any) -> list[Replica]:
        replicas = []
        for i in range(count):
            options: dict[str, Any] = {
                "redis_url": redis_url,
                "grpc_port": 0,
                "replica_id": "abcdefgh"[i],
                "lease_ttl_s": 3.0,
            }
            options.update(settings)
            replica = Replica(TestClient(create_app(ServiceSettings(**options))))
            started.append(replica)
            replica.start()
            replicas.append(replica)
        return replicas

    yield start
    for replica in started:
        replica.stop()


def test_what_replica_a_is_told_changes_what_replica_b_predicts(
    start_replicas: Callable[..., list[Replica]],
) -> None:
    a, b = start_replicas(retrain_every=300)
    assert a.status()["holds_training_lease"] and not b.status()["holds_training_lease"]
    before = b.predict(PROBE)

    entries = training_entries(900, seed=1)
    for start in range(0, len(entries), 100):
        a.send(entries[start : start + 100])  # every sample goes to replica A only

    assert wait_until(lambda: b.learned() >= len(entries), timeout_s=30), b.learned()
    assert wait_until(lambda: b.status()["registry_version"] >= 1, timeout_s=30), "A published no retrain"
    after = b.predict(PROBE)
    # The fleet is 8x slower than the prior; B has seen none of it directly yet now predicts far slower.
    assert after["ttft_ms"] > 2.0 * before["ttft_ms"], (before, after)
    assert after["tpot_ms"] > 2.0 * before["tpot_ms"], (before, after)
    # B serves A's retrained model (A may publish again meanwhile, so allow B a moment to catch up).
    assert a.status()["model_version"] >= 1
    assert wait_until(lambda: b.status()["model_version"] == a.status()["model_version"], timeout_s=5)


def test_a_flush_on_a_also_flushes_its_backlog_and_b_learns_those_rows_all_the_same(
    start_replicas: Callable[..., list[Replica]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """/flush reads past the rows waiting in the shared stream (Redis stream ids as cursors) on the replica asked:
    before, they were learned into its window after the flush. Each replica learns every row, so B, not asked,
    learns them."""
    a, b = start_replicas(retrain_every=100_000)  # no retrain: no model published that would carry a window over
    ingest_turn = a.runtime._ingest_turn
    monkeypatch.setattr(a.runtime, "_ingest_turn", lambda: time.sleep(0.01))  # the rows wait in A's backlog
    a.send(training_entries(300, seed=11))
    assert wait_until(lambda: b.learned() == 300, timeout_s=30)
    assert a.learned() == 0
    flushed = a.client.post("/flush", json={})
    assert flushed.status_code == 200, flushed.text
    monkeypatch.setattr(a.runtime, "_ingest_turn", ingest_turn)
    a.send(training_entries(20, seed=12))
    assert wait_until(lambda: b.learned() == 320, timeout_s=30)
    assert wait_until(lambda: a.runtime.model_status()["window"] == {"ttft": 20, "tpot": 20}, timeout_s=10)
    time.sleep(0.5)  # a flushed row learned late would show by now
    assert a.runtime.model_status()["window"] == {"ttft": 20, "tpot": 20} and a.learned() == 20
    assert b.runtime.model_status()["window"] == {"ttft": 320, "tpot": 320}
    assert a.client.get("/data/status").json()["training_data"]["total_samples"] == 36  # 20 rows: 2 held out
    assert a.status()["ingestion"]["dropped"]["flushed"] == 300


def test_the_learned_count_is_the_rows_the_serving_model_has_learned_also_after_an_adoption(
    start_replicas: Callable[..., list[Replica]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: `ingestion.learned` added up what each lineage of this replica's learner had learned, so a replica
    that adopted a model behind its own position (rows read and learned again) counted those rows twice: 6,312
    against a stream of 6,000; and a replica that replayed rows, then adopted a model, said 0 while serving a model
    that had learned 14,500. It is the rows the serving model has learned, whoever learned them; the rows this
    process's learner has learned, again or not, are `learned_here` (the counter behind
    leadtime_observations_learned_total, which never goes down)."""
    a, b = start_replicas(retrain_every=100_000)  # no retrain: the one publication is the test's
    a.send(training_entries(200, seed=21))
    assert wait_until(lambda: a.learned() == 200 and b.learned() == 200, timeout_s=30)
    monkeypatch.setattr(a.runtime, "_ingest_turn", lambda: time.sleep(0.01))  # A stops at 200 rows
    a.send(training_entries(100, seed=22))
    assert wait_until(lambda: b.status()["ingestion"]["learned"] == 300, timeout_s=30)
    assert a.runtime.predictor is not None
    version = a.runtime.publish(a.runtime.predictor)  # at 200 rows: B adopts it and learns the last 100 again
    assert wait_until(lambda: b.serves_registry_version(version), timeout_s=10)
    assert wait_until(lambda: b.status()["ingestion"]["pending"] == 0 and b.learned() == 300, timeout_s=30)
    ingestion = b.status()["ingestion"]
    assert ingestion["learned"] == 300, ingestion  # the stream's 300 rows, each once in the model
    assert ingestion["learned_here"] == 400, ingestion  # B's learner learned 100 of them twice
    assert "leadtime_observations_learned_total 400.0" in b.client.get("/metrics").text
    assert a.status()["ingestion"]["learned"] == 200


def test_a_model_published_by_a_is_served_by_b(
    start_replicas: Callable[..., list[Replica]],
) -> None:
    # Mean objective: the served mean is fully determined by the artifact. (The quantile after a round trip
    # through bytes is not: the learner does not serialize all of its calibration state, see the report.)
    a, b = start_replicas(objective="mean")
    a.send(training_entries(200, seed=2))
    assert wait_until(lambda: a.learned() == 200 and b.learned() == 200, timeout_s=20)
    for _ in range(3):
        assert a.runtime.predictor is not None
        version = a.runtime.publish(a.runtime.predictor)  # the path a successful retrain takes
        # No time bound: B's model-sync loop looks for a newer version every 0.5 s (and the store polls every
        # 0.25 s) even without the notification, so no bound tells the notification from that fallback; how
        # fast a swap is, benchmarks measure. The deadline only keeps a loaded host from failing the test.
        assert wait_until(partial(b.serves_registry_version, version), timeout_s=30.0, every_s=0.005)
        assert b.predict(PROBE)["ttft_ms"] == pytest.approx(a.predict(PROBE)["ttft_ms"], rel=1e-9)
        assert b.status()["model_version"] == a.status()["model_version"]


def test_killing_redis_mid_run_loses_no_accepted_observation(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer
) -> None:
    a, b = start_replicas()
    first = training_entries(300, seed=3)
    a.send(first)
    assert wait_until(lambda: b.learned() == len(first), timeout_s=20)
    assert a.client.get("/readyz").json()["status"] == "ready"

    redis_server.stop()
    during = training_entries(500, seed=4)
    for start in range(0, len(during), 100):
        a.send(during[start : start + 100])  # still 202 while Redis is down
    assert a.predict(PROBE)["ttft_ms"] > 0  # still serving with the model it has
    assert a.store.stats()["buffered"] == len(during)
    for replica in (a, b):
        assert wait_until(replica.redis_degraded, timeout_s=5)
        assert replica.client.get("/readyz").json()["status"] == "ready"
    assert "500 observations buffered" in a.readyz_degraded()["redis"]

    redis_server.start()  # same port, empty: the replicas reconnect by themselves
    assert wait_until(lambda: b.learned() == len(first) + len(during), timeout_s=20), b.learned()
    assert wait_until(lambda: a.learned() == len(first) + len(during), timeout_s=20), a.learned()
    assert a.store.stats() == {
        "buffered": 0,
        "dropped": 0,
        "appended": len(first) + len(during),
        "resent": 0,
        "server_restarts": 1,
    }
    for replica in (a, b):
        assert wait_until(replica.fully_ready, timeout_s=RECOVERY_S)


def test_a_retrained_model_that_could_not_be_published_is_published_once_redis_is_back(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer
) -> None:
    # Regression: a publication that failed during an outage left /readyz degraded for good, and the other
    # replicas never got that model.
    a, b = start_replicas()
    assert a.runtime.predictor is not None and a.status()["holds_training_lease"]
    artifact = a.runtime.predictor.to_bytes()
    redis_server.stop()
    a.runtime._after_retrain(artifact, {"ttft": {"accepted": True}})  # what the learner's retrain report triggers
    assert "publication" in a.readyz_degraded()
    redis_server.start()  # same port, empty
    assert wait_until(a.fully_ready, timeout_s=RECOVERY_S), a.readyz_degraded()
    assert a.store.latest_model() is not None
    assert wait_until(lambda: b.serves_registry_version(1), timeout_s=RECOVERY_S)


def test_a_registry_lost_with_a_redis_restart_is_given_the_serving_model_again(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer
) -> None:
    """A Redis without persistence that restarts loses the models too: the lease holder kept serving its model
    without publishing it again, and a replica started meanwhile served the prior."""
    a, b = start_replicas()
    assert a.runtime.predictor is not None and a.status()["holds_training_lease"]
    version = a.runtime.publish(a.runtime.predictor)
    assert wait_until(lambda: b.serves_registry_version(version), timeout_s=5)
    redis_server.stop()
    redis_server.start()  # same port, empty
    a.send(training_entries(20, seed=6))  # the writer finds the new server (another run id) when it sends
    assert wait_until(lambda: a.store.latest_model() is not None, timeout_s=15), "not published again"
    again = a.store.latest_model()
    assert again is not None and again[0] > version  # numbered on from what every replica has
    assert wait_until(lambda: b.serves_registry_version(again[0]), timeout_s=5)
    (late,) = [r for r in start_replicas(count=1, replica_id="z")]
    assert late.status()["model_version"] == a.status()["model_version"]  # not the prior


def test_a_registry_flushed_while_redis_runs_is_given_the_serving_model_again(
    start_replicas: Callable[..., list[Replica]], redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: after FLUSHALL (or the model keys deleted or evicted) the registry stayed empty: the lease holder
    published again only when Redis had restarted (another run_id), and replicas starting then served the prior."""
    a, b = start_replicas()
    assert a.runtime.predictor is not None and a.status()["holds_training_lease"]
    version = a.runtime.publish(a.runtime.predictor)
    assert wait_until(lambda: b.serves_registry_version(version), timeout_s=5)
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        redis.Redis.from_url(redis_url).flushall()
        assert wait_until(lambda: a.store.latest_model() is not None, timeout_s=10), "not published again"
        again = a.store.latest_model()
        assert again is not None and again[0] > version  # numbered on from what every replica has
        (late,) = start_replicas(count=1, replica_id="z")
        assert late.status()["model_version"] == a.status()["model_version"]  # not the prior
    lines = [r.getMessage() for r in caplog.records if "registry" in r.getMessage()]
    assert len(lines) == 1 and "flushed" in lines[0] and "restart" not in lines[0], lines


def test_a_replica_started_while_the_newest_model_is_refused_serves_the_newest_older_one_kept(
    start_replicas: Callable[..., list[Replica]], redis_url: str
) -> None:
    """After a rollback the registry's newest model is a newer build's (one artifact version ahead): a replica
    starting then served a fresh model and learned the whole stream again, though Redis still held the older models
    it reads. It serves the newest of those, from the stream position that model learned to."""
    (a,) = start_replicas(count=1, retrain_every=100_000)
    entries = training_entries(300, seed=11)
    a.send(entries)
    assert wait_until(lambda: a.learned() == len(entries), timeout_s=20)
    assert a.runtime.predictor is not None
    a.runtime.predictor.version = 7  # told apart from a fresh model's (0)
    a.runtime.publish(a.runtime.predictor)
    a.stop()  # the lease holder publishes no more models after the one written below (a retrain could)
    raw = redis.Redis.from_url(redis_url)
    version = int(raw.get("leadtime:model:version") or 0)
    document = json.loads(raw.get(f"leadtime:model:{version}") or b"")
    served = document["version"]
    assert served != 0  # A's model, not the fresh one's version
    document["artifact_version"] = ARTIFACT_VERSION + 1  # written by a newer build (Redis takes only ours: by hand)
    raw.set(f"leadtime:model:{version + 1}", seal(document))
    raw.set("leadtime:model:version", version + 1)
    (b,) = start_replicas(count=1, replica_id="b", role="prediction")
    assert b.status()["registry_version"] == version and b.status()["model_version"] == served
    assert b.learned() == len(entries)  # from v1's position: nothing learned again
    time.sleep(0.5)  # a few turns of the loops: the refused one is not tried again, no row is learned twice
    assert b.learned() == len(entries) and b.status()["registry_version"] == version
    assert f"published model {version + 1} refused" in b.readyz_degraded()["model_sync"]


def test_taking_and_losing_the_training_lease_is_logged_once_each(
    start_replicas: Callable[..., list[Replica]], redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Which replica retrains and publishes changed without a word in any log."""
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        (a,) = start_replicas(count=1, lease_ttl_s=1.5)
        assert a.status()["holds_training_lease"]
        raw = redis.Redis.from_url(redis_url)
        raw.set("leadtime:lease:training", "someone-else", px=60_000)  # another holder, as after an expiry
        assert wait_until(lambda: not a.status()["holds_training_lease"], timeout_s=5)
        time.sleep(1.0)  # more renewals refused: still one line
    lines = [r.getMessage() for r in caplog.records if "training lease" in r.getMessage()]
    assert len(lines) == 2 and "took" in lines[0] and "lost" in lines[1], lines


def test_a_lease_not_renewed_because_redis_is_unreachable_is_not_blamed_on_another_replica(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the store answered False for an unreachable Redis as for a lease another replica holds, and the
    holder logged "another replica holds it: this one did not renew it within 3 s (paused, or starved of CPU)"
    though nobody held it."""
    (a,) = start_replicas(count=1, lease_ttl_s=30.0)  # no renewal by the loop during the test: renewed by hand
    assert a.runtime.holds_lease
    redis_server.stop()
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        a.runtime._renew_lease()
    assert not a.runtime.holds_lease
    lines = [r.getMessage() for r in caplog.records if "training lease" in r.getMessage()]
    assert len(lines) == 1, lines
    said = "lost the training lease (replica a): cannot take or renew the training lease: redis unreachable ("
    assert said in lines[0], lines[0]
    assert "another replica" not in lines[0] and "paused" not in lines[0], lines[0]


def test_the_training_lease_passes_to_b_when_a_stops(start_replicas: Callable[..., list[Replica]]) -> None:
    a, b = start_replicas(lease_ttl_s=1.0)
    assert a.status()["holds_training_lease"] and not b.status()["holds_training_lease"]
    time.sleep(1.5)  # A renews in time: B still may not train
    assert not b.status()["holds_training_lease"]
    a.stop()  # A neither renews nor retrains any more; its lease runs out
    assert wait_until(lambda: b.status()["holds_training_lease"], timeout_s=5)
    assert b.store.lease_holder() == "b"


def test_a_full_redis_is_named_in_readyz_and_status_while_accepted_rows_wait(
    start_replicas: Callable[..., list[Replica]], redis_url: str
) -> None:
    """A Redis at its maxmemory refuses writes and answers reads: /readyz said `"degraded": {}` half the time while
    the rows answered 202 stayed in the replica's buffer. Raising maxmemory sends them without a restart."""
    (a,) = start_replicas(count=1)
    raw = redis.Redis.from_url(redis_url)
    raw.config_set("maxmemory", "1")  # below what the server uses: every write is refused
    entries = training_entries(300, seed=9)
    a.send(entries)
    assert wait_until(a.redis_degraded, timeout_s=5)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # the ingest loop reads the stream meanwhile, and that works
        reason = a.readyz_degraded().get("redis", "")
        assert "out of memory" in reason and "300 observations buffered" in reason, reason
        time.sleep(0.05)
    assert "300 observations buffered" in a.status()["components"]["redis"]
    raw.config_set("maxmemory", "0")
    assert wait_until(lambda: a.learned() == len(entries), timeout_s=20), a.learned()
    assert wait_until(a.fully_ready, timeout_s=RECOVERY_S), a.readyz_degraded()


def test_reload_answers_503_while_the_registry_cannot_be_reached(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer
) -> None:
    """The store's latest_model() answers None for an unreachable Redis as for an empty registry: /reload said
    200 `{"synced": true, "loaded": false}` during an outage."""
    (a,) = start_replicas(count=1)
    assert a.client.post("/reload").status_code == 200
    redis_server.stop()
    answer = a.client.post("/reload")
    assert answer.status_code == 503, answer.text
    assert "registry" in answer.text and "unreachable" in answer.text, answer.text
    redis_server.start()
    assert wait_until(lambda: a.client.post("/reload").status_code == 200, timeout_s=10)


def test_a_restart_from_the_model_dir_on_the_same_stream_goes_on_from_where_it_stopped(
    start_replicas: Callable[..., list[Replica]], tmp_path: Any
) -> None:
    """Nothing published yet (no retrain): the saved model's stream position was thrown away at the restart and
    the whole stream learned again, every row twice."""
    (a,) = start_replicas(1, model_dir=tmp_path, retrain_every=100_000)
    a.send(training_entries(300, seed=5))
    assert wait_until(lambda: a.learned() == 300, timeout_s=60)
    a.stop()
    (again,) = start_replicas(1, model_dir=tmp_path, retrain_every=100_000, replica_id="z")
    assert again.learned() == 300
    again.send(training_entries(20, seed=6))
    assert wait_until(lambda: again.learned() >= 320, timeout_s=60)
    time.sleep(0.5)  # anything it would read again has had time to arrive
    assert again.learned() == 320


@pytest.mark.parametrize("recorded", ["as saved", "in the old text form"])
def test_a_restart_from_the_model_dir_under_another_spelling_of_the_url_goes_on_from_where_it_stopped(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer, tmp_path: Any, recorded: str
) -> None:
    """Regression: a model saved under `redis://127.0.0.1:PORT` was not recognised at a restart under
    `redis://127.0.0.1:PORT/0`, the same server and database: the stream names it records were compared as text,
    its position was dropped and the whole stream learned again, every row twice. A model saved before stream
    names were canonical (``<the URL as given> <stream key>``) is recognised too."""
    port = redis_server.port
    (a,) = start_replicas(1, redis_url=f"redis://127.0.0.1:{port}", model_dir=tmp_path, retrain_every=100_000)
    a.send(training_entries(300, seed=5))
    assert wait_until(lambda: a.learned() == 300, timeout_s=60)
    a.stop()
    if recorded == "in the old text form":
        document = decode(load_file(tmp_path))
        document["metadata"][STREAM_KEY] = f"redis://127.0.0.1:{port} leadtime:observations"
        save_file(tmp_path, encode(document))
    (again,) = start_replicas(
        1, redis_url=f"redis://127.0.0.1:{port}/0", model_dir=tmp_path, retrain_every=100_000, replica_id="z"
    )
    assert again.learned() == 300
    again.send(training_entries(20, seed=6))
    assert wait_until(lambda: again.learned() >= 320, timeout_s=60)
    time.sleep(0.5)  # anything it would read again has had time to arrive
    assert again.learned() == 320


def test_rows_accepted_during_an_outage_and_buffered_at_a_stop_are_learned_after_the_next_start(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer, redis_url: str, tmp_path: Any
) -> None:
    """Regression: a clean stop during a Redis outage dropped every row answered 202 and still buffered ("closed
    before redis took them: 500 buffered observations dropped"). With --model-dir they are kept there, and the
    replica started next with that directory sends them to the stream first: each lands once, and is learned."""
    (a,) = start_replicas(1, model_dir=tmp_path, retrain_every=100_000)
    a.send(training_entries(100, seed=5))
    assert wait_until(lambda: a.learned() == 100, timeout_s=60)
    redis_server.stop()
    for start in range(0, 500, 100):
        a.send(training_entries(100, seed=100 + start))  # 202: buffered while Redis is down
    a.stop()  # what the lifespan does after SIGTERM
    assert a.store.stats()["dropped"] == 0
    redis_server.start()  # empty: the first 100 rows are gone with it (the model learned them)
    (again,) = start_replicas(1, model_dir=tmp_path, retrain_every=100_000, replica_id="z")
    assert wait_until(lambda: again.learned() == 600, timeout_s=60), again.learned()
    assert again.store.flush(5.0)
    assert redis.Redis.from_url(redis_url).xlen("leadtime:observations") == 500  # once each
    time.sleep(0.5)  # anything read or sent twice would show by now
    assert again.learned() == 600


def test_a_publication_refused_by_a_redis_outage_is_one_warning_per_outage_without_a_traceback(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a retrain the lease holder could not publish while Redis was down logged an ERROR with a 7-line
    traceback, though replicas are meant to keep serving through an outage."""
    (a,) = start_replicas(count=1)
    assert a.runtime.predictor is not None and a.status()["holds_training_lease"]
    artifact = a.runtime.predictor.to_bytes()
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        for _ in range(2):  # an outage
            redis_server.stop()
            for _ in range(3):  # retrains the store cannot take
                a.runtime._after_retrain(artifact, {"ttft": {"accepted": True}})
            redis_server.start()
            assert wait_until(lambda: a.store.latest_model() is not None, timeout_s=10), "not published once back"
    records = [r for r in caplog.records if "publi" in r.getMessage()]
    assert [r.levelno for r in records] == [logging.WARNING] * 2, [r.getMessage() for r in records]
    for record in records:
        assert record.exc_info is None
        assert "unreachable" in record.getMessage(), record.getMessage()


def test_a_replica_stopped_cleanly_hands_the_training_lease_over_at_once(
    start_replicas: Callable[..., list[Replica]], caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a replica stopped by SIGTERM kept the lease until it expired (10 s by default), and meanwhile no
    replica retrained or published, at every rolling update; nor did the stop leave a line in the log."""
    # Each renews or tries to take it every ttl/3 s. A long TTL: A's lease must outlast its stop (4-9 s seen on a
    # loaded host, the learner process's exit), or it expires before A can release it.
    ttl_s = 30.0
    a, b = start_replicas(lease_ttl_s=ttl_s)
    assert a.status()["holds_training_lease"] and not b.status()["holds_training_lease"]
    # A's stop waits for its learner process before releasing the lease; a learner still starting (a spawned
    # interpreter importing, seconds on a loaded host) delays that up to its 10 s stop timeout, so the lease could
    # expire first. Learned rows show both learners are up.
    a.send(training_entries(20, seed=9))
    assert wait_until(lambda: a.learned() == 20 and b.learned() == 20, timeout_s=120)
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        a.stop()  # what the lifespan does after SIGTERM
        stopped_at = time.monotonic()
        # Released: nobody holds it, or B has already taken it (its attempt may fall right after the release).
        assert b.store.lease_holder() in (None, "b")
        assert wait_until(lambda: b.status()["holds_training_lease"], timeout_s=30)
    # B took it at its next attempt (within ttl/3 = 10 s). Had A kept it, renewed within the last ttl/3, B could
    # have taken it only at its expiry, at least 2/3 of the TTL (20 s) after the stop: the bound tells them apart.
    assert time.monotonic() - stopped_at < 2 * ttl_s / 3
    assert b.store.lease_holder() == "b"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping")]
    # ("not released" would also contain "released".)
    assert len(lines) == 1 and "released the training lease" in lines[0], lines


def test_a_replica_whose_learner_is_slow_to_stop_still_hands_the_lease_over(
    start_replicas: Callable[..., list[Replica]], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the stop released the lease only after its learner process had stopped (up to 10 s, then a
    kill), renewing it no more meanwhile: a learner slow to exit (a loaded host, a retrain finishing) let the lease
    expire first, and nobody retrained until it did. It is released as soon as the loops have stopped."""
    a, b = start_replicas(lease_ttl_s=3.0)
    assert a.status()["holds_training_lease"]
    real_stop = a.runtime.learner.stop

    def slow_stop(*args: Any, **kwargs: Any) -> None:
        time.sleep(4.0)  # longer than the lease's TTL
        real_stop(*args, **kwargs)

    monkeypatch.setattr(a.runtime.learner, "stop", slow_stop)
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        a.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping")]
    assert len(lines) == 1 and ": released the training lease" in lines[0], lines
    assert not [r for r in caplog.records if "lost the training lease" in r.getMessage()]
    assert wait_until(lambda: b.status()["holds_training_lease"], timeout_s=30)


def test_a_stopping_replica_releases_only_a_lease_it_still_holds(
    start_replicas: Callable[..., list[Replica]], redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The release compares the holder and deletes atomically: a replica that lost the lease (it expired, another
    took it) and does not know yet must not take it from its new holder when it stops."""
    (a,) = start_replicas(count=1, lease_ttl_s=30.0)
    assert a.status()["holds_training_lease"]
    raw = redis.Redis.from_url(redis_url)
    raw.set("leadtime:lease:training", "someone-else", px=60_000)  # as after an expiry and another's take
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        a.stop()
    assert raw.get("leadtime:lease:training") == b"someone-else"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping")]
    assert len(lines) == 1 and "not released" in lines[0], lines


def test_a_replica_that_lost_the_lease_unknowingly_does_not_publish(
    start_replicas: Callable[..., list[Replica]], redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: the lease was checked only by the flag each renewal sets (every third of the TTL), so a replica
    paused past the TTL (a VM suspended) resumed believing it held the lease and published its retrained model over
    the new holder's. The store refuses it now; the replica takes that as the lease lost, in one line."""
    (a,) = start_replicas(count=1, lease_ttl_s=30.0)  # no renewal during the test
    assert a.runtime.predictor is not None and a.runtime.holds_lease
    raw = redis.Redis.from_url(redis_url)
    raw.set("leadtime:lease:training", "someone-else", px=60_000)  # as after an expiry and another's take
    artifact = a.runtime.predictor.to_bytes()
    with caplog.at_level(logging.INFO):
        a.runtime._after_retrain(artifact, {"ttft": {"accepted": True}})
        a.runtime._after_retrain(artifact, {"ttft": {"accepted": True}})  # a second retrain: no second line
    assert raw.get("leadtime:model:version") is None  # nothing published
    assert not a.runtime.holds_lease and not a.status()["holds_training_lease"]
    lost = [r for r in caplog.records if "lease" in r.getMessage()]
    assert len(lost) == 1 and "someone-else" in lost[0].getMessage(), [r.getMessage() for r in lost]
    assert not any(r.exc_info or r.levelno >= logging.ERROR for r in caplog.records)
    assert "publication" not in a.readyz_degraded()  # not an outage to retry
    a.runtime._renew_lease()  # the next renewal tells the learner to stop retraining
    assert not a.runtime.learner.retrain and not a.runtime.holds_lease


def ahead_and_lagging(
    start_replicas: Callable[..., list[Replica]], monkeypatch: pytest.MonkeyPatch
) -> tuple[Replica, Replica, Callable[[], None]]:
    """Two replicas serving A's published model, A holding the lease and ahead by 300 rows it wrote and read back, B
    learning nothing (its ingest turn replaced); and B's ingest turn, to give back."""
    a, b = start_replicas(lease_ttl_s=30.0, retrain_every=100_000)  # the lease loops wait 10 s: renewed by hand
    assert a.runtime.predictor is not None and a.status()["holds_training_lease"]
    version = a.runtime.publish(a.runtime.predictor)
    assert wait_until(lambda: b.serves_registry_version(version), timeout_s=5)
    ingest_turn = b.runtime._ingest_turn
    monkeypatch.setattr(b.runtime, "_ingest_turn", lambda: time.sleep(0.01))  # B lags: it learns nothing
    a.send(training_entries(300, seed=13))
    assert wait_until(lambda: a.learned() == 300, timeout_s=30)  # A wrote them and read them back: not kept
    return a, b, ingest_turn


def test_after_redis_lost_the_stream_a_replica_ahead_does_not_adopt_a_lagging_replicas_model(
    start_replicas: Callable[..., list[Replica]],
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: after a Redis restart without persistence, the lagging replica noticed the empty registry first
    and published its model again; the replica ahead adopted it and dropped what it had learned beyond (14,000 ->
    13,000 rows), rows the stream no longer held: answered 202, learned by no replica. The replica ahead keeps its
    model and publishes it instead, and the lagging one adopts that."""
    a, b, ingest_turn = ahead_and_lagging(start_replicas, monkeypatch)
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        redis_server.restart()  # same port, empty: the stream, the registry and the lease are gone

        def b_republished() -> bool:  # B, the lagging one, notices first and publishes its model again
            b.runtime._retry_publication()
            return b.store.registry_version() not in (None, 0)

        assert wait_until(b_republished, timeout_s=10)
        monkeypatch.setattr(b.runtime, "_ingest_turn", ingest_turn)
        assert wait_until(lambda: b.learned() == 300, timeout_s=30), (a.learned(), b.learned())
    assert a.learned() == 300
    refused = [r.getMessage() for r in caplog.records if "not adopting published model" in r.getMessage()]
    assert len(refused) == 1 and "the stream no longer holds the rows between" in refused[0], refused
    a.send(training_entries(20, seed=14))
    assert wait_until(lambda: a.learned() == 320 and b.learned() == 320, timeout_s=30), (a.learned(), b.learned())


def take_lease_and_check_registry(replica: Replica, caplog: pytest.LogCaptureFixture) -> list[str]:
    """One lease renewal of `replica` as its lease loop does it (that loop waits a third of the TTL), repeated
    until it has given the registry its model back and said why the registry lost it; those lines."""

    def said() -> list[str]:
        replica.runtime._renew_lease()
        replica.runtime._retry_publication()
        return [r.getMessage() for r in caplog.records if "registry no longer held" in r.getMessage()]

    assert wait_until(lambda: bool(said()), timeout_s=10)
    return said()


def test_a_registry_lost_with_a_redis_restart_is_named_so_by_the_replica_that_takes_the_lease(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: after Redis restarted without persistence, the replica that took the lease on the new server
    blamed a flush (or deleted or evicted keys): its store had not yet looked at the new server's run_id."""
    a, b = start_replicas(lease_ttl_s=30.0)  # the lease loops wait 10 s: this test renews B's lease itself
    assert a.runtime.predictor is not None and a.status()["holds_training_lease"]
    version = a.runtime.publish(a.runtime.predictor)
    assert wait_until(lambda: b.serves_registry_version(version), timeout_s=5)
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        redis_server.restart()  # same port, empty: the lease is free, the models are gone
        lines = take_lease_and_check_registry(b, caplog)
    assert len(lines) == 1 and "Redis restarted without persistence" in lines[0], lines


def test_a_registry_flushed_is_named_so_by_a_replica_that_took_the_lease_after_an_earlier_restart(
    start_replicas: Callable[..., list[Replica]],
    redis_server: RedisServer,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: the restarts a replica had looked at were counted only while it held the lease, so one that
    took it after a restart (which the holder had healed) blamed that restart for a later FLUSHALL."""
    a, b = start_replicas(lease_ttl_s=30.0)  # the lease loops wait 10 s: this test renews the leases itself
    assert a.runtime.predictor is not None and a.status()["holds_training_lease"]
    version = a.runtime.publish(a.runtime.predictor)
    assert wait_until(lambda: b.serves_registry_version(version), timeout_s=5)
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        redis_server.restart()
        assert take_lease_and_check_registry(a, caplog)  # A, the holder, publishes its model again
        again = a.store.latest_model()
        assert again is not None and again[0] > version
        assert wait_until(lambda: b.serves_registry_version(again[0]), timeout_s=5)
        assert wait_until(lambda: b.store.stats()["server_restarts"] == 1, timeout_s=5)
        b.runtime._retry_publication()  # a renewal of B, still not the holder: the registry holds its model
        caplog.clear()
        redis.Redis.from_url(redis_url).flushall()  # the lease goes too: B takes it
        lines = take_lease_and_check_registry(b, caplog)
    assert len(lines) == 1 and "flushed" in lines[0] and "restart" not in lines[0], lines


def test_a_registry_lost_while_a_new_replica_takes_the_lease_gets_the_trained_model_back(
    start_replicas: Callable[..., list[Replica]], redis_server: RedisServer
) -> None:
    """Regression: after Redis lost its data, a replica started then took the lease and published the prior's lineage
    from version 1; the trained replicas ignored every version up to their own, published nothing (not holders),
    and the fleet served two lineages: the new replica and those started after it, the prior."""
    a, b = start_replicas(lease_ttl_s=30.0)  # the lease loops wait 10 s: this test renews the leases itself
    assert a.runtime.predictor is not None and a.status()["holds_training_lease"]
    a.send(training_entries(300, seed=7))
    assert wait_until(lambda: a.learned() >= 300, timeout_s=30), a.learned()
    a.runtime.publish(a.runtime.predictor)
    version = a.runtime.publish(a.runtime.predictor)  # two: the new holder's first version is below it
    assert wait_until(lambda: b.serves_registry_version(version), timeout_s=5)
    redis_server.restart()  # same port, empty: the lease is free, the models and the stream are gone
    (z,) = start_replicas(count=1, replica_id="z", lease_ttl_s=30.0)
    prior = z.predict(PROBE)["ttft_ms"]
    assert a.predict(PROBE)["ttft_ms"] > 2.0 * prior  # the fleet is 8x slower than the prior says

    def z_renewed() -> bool:
        z.runtime._renew_lease()
        return z.runtime.holds_lease

    assert wait_until(z_renewed, timeout_s=10)
    assert z.runtime.predictor is not None
    assert z.runtime.publish(z.runtime.predictor) == 1  # the prior's lineage, numbered from 1

    def renewed() -> bool:  # a renewal of A and of B, neither the holder: one of them gives the registry its model
        for replica in (a, b):
            replica.runtime._renew_lease()
            replica.runtime._retry_publication()
        latest = z.store.latest_model()
        return latest is not None and latest[0] > version

    assert wait_until(renewed, timeout_s=10), z.store.latest_model()
    assert not a.runtime.holds_lease and not b.runtime.holds_lease
    restored = z.store.latest_model()
    assert restored is not None
    assert wait_until(partial(z.serves_registry_version, restored[0]), timeout_s=10)
    assert z.predict(PROBE)["ttft_ms"] > 2.0 * prior  # the trained lineage, not the prior's
    newer = z.runtime.publish(z.runtime.predictor)  # the holder's next model reaches the trained replicas
    assert wait_until(lambda: b.serves_registry_version(newer), timeout_s=5)
    assert wait_until(lambda: a.serves_registry_version(newer), timeout_s=5)


def test_after_redis_lost_the_stream_a_lagging_replica_that_read_new_rows_does_not_take_the_rows_ahead_with_it(
    start_replicas: Callable[..., list[Replica]],
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Traffic goes on across a Redis restart without persistence: the lagging replica reads the new server's rows
    before it notices the empty registry, so its model's position is past the replica ahead's, though it never
    learned the rows the crash lost. Adopting it dropped those rows from the replica ahead too: answered 202, learned
    by no replica (21,000 accepted, 20,488 learned by each of three replicas)."""
    a, b, ingest_turn = ahead_and_lagging(start_replicas, monkeypatch)
    redis_server.restart()  # same port, empty: the stream, the registry and the lease are gone
    a.send(training_entries(20, seed=14))  # traffic goes on: the new server's stream holds these
    assert wait_until(lambda: a.learned() == 320, timeout_s=30), a.learned()
    monkeypatch.setattr(b.runtime, "_ingest_turn", ingest_turn)
    assert wait_until(lambda: b.learned() == 20, timeout_s=30), b.learned()  # B reads on into the new stream

    def b_republished() -> bool:  # B, the lagging one, notices the empty registry first
        b.runtime._retry_publication()
        return b.store.registry_version() not in (None, 0)

    assert wait_until(b_republished, timeout_s=10)
    assert wait_until(lambda: a.learned() == 320 and b.learned() == 320, timeout_s=30), (a.learned(), b.learned())
