"""What a 202 promises: under overload the backlog is thinned evenly over time, every accepted row is counted as
learned, thinned or dropped (per reason), and the state shows in /readyz, /status and /metrics."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient
from redis_server import RedisServer

from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.runtime import ServiceRuntime
from leadtime.predictor.settings import ServiceSettings
from leadtime.predictor.store.memory import MemoryStore


def rows(start: int, n: int) -> list[dict[str, Any]]:
    return [{"t": start + i} for i in range(n)]


def accounted(store: MemoryStore, read: int) -> int:
    s = store.stats()
    return read + s["pending"] + s["thinned"] + s["dropped"]


def test_a_burst_above_what_the_reader_keeps_up_with_is_thinned_evenly_across_its_duration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore(thin_above=2_000, max_stride=64)
    cursor = "0"
    learned: list[int] = []

    def read(n: int) -> None:
        nonlocal cursor
        cursor, got = store.read_observations(cursor, n)
        learned.extend(e["t"] for e in got)

    t = 0
    with caplog.at_level(logging.WARNING, logger="leadtime.service"):
        for _ in range(50):  # sustained: 100 rows a step, the reader takes them all
            store.append_observations(rows(t, 100))
            t += 100
            read(200)
        assert store.stats()["thinned"] == 0 and len(learned) == t
        burst_start = t
        for _ in range(400):  # a burst: 1,000 rows a step, the reader takes 100
            store.append_observations(rows(t, 1_000))
            t += 1_000
            read(100)
        burst_end = t
        assert store.stats()["thinning_stride"] > 1
        while store.stats()["pending"]:  # the burst is over: the reader drains the backlog
            read(100)
        for _ in range(20):
            store.append_observations(rows(t, 100))
            t += 100
            read(200)
    s = store.stats()
    assert s["thinning_stride"] == 1 and s["dropped"] == 0
    assert s["appended"] == t == len(learned) + s["thinned"]  # every accepted row counted once
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "thinning started" in messages and "thinning stopped" in messages
    # Evenly across the burst: every tenth of it is represented alike in what was learned (the first ~2,000 rows
    # arrived before the backlog reached its bound and were kept whole).
    kept = np.array([x for x in learned if burst_start + 10_000 <= x < burst_end])
    deciles = np.histogram(kept, bins=10, range=(burst_start + 10_000, burst_end))[0]
    assert deciles.min() > 0.6 * deciles.mean() and deciles.max() < 1.4 * deciles.mean(), deciles
    # ... and after the burst every row is learned again.
    assert [x for x in learned if x >= burst_end] == list(range(burst_end, t))


def test_thinning_keeps_a_share_of_every_kind_of_row_whatever_pattern_they_arrive_in() -> None:
    """Keeping every k-th row by position locks onto any pattern that repeats: llm-d sends a request's TTFT row and
    then its TPOT row, and one call of 60,000 such entries kept every TTFT row and learned no TPOT at all."""
    for period in (2, 3, 4, 8):
        store = MemoryStore(thin_above=1_000, max_stride=64)
        entries = [{"kind": i % period} for i in range(60_000)]
        for start in range(0, len(entries), 5_000):
            store.append_observations(entries[start : start + 5_000])
        assert store.stats()["thinning_stride"] > 1
        _, kept = store.read_observations("0", 100_000)
        shares = np.bincount([e["kind"] for e in kept], minlength=period) / len(kept)
        assert shares.min() > 0.6 / period and shares.max() < 1.4 / period, (period, shares)


def test_rows_thinned_out_of_the_backlog_do_not_count_towards_the_retained_bound() -> None:
    """A thinned backlog row leaves an empty slot (so that cursors hold); those slots counted towards `retain`, and
    unread rows were trimmed as `store_bound` with far fewer than `retain` rows kept."""
    store = MemoryStore(retain=1_000, thin_above=400, max_stride=64)
    for i in range(8):
        store.append_observations(rows(600 * i, 600))
    s = store.stats()
    assert s["thinned"] > 0 and s["pending"] <= 1_000
    assert s["dropped_store_bound"] == 0 and s["appended"] == s["pending"] + s["thinned"] + s["dropped"]


def test_a_full_backlog_drops_new_rows_and_counts_them() -> None:
    store = MemoryStore(thin_above=100, max_stride=4)
    for i in range(20):
        store.append_observations(rows(100 * i, 100))
    s = store.stats()
    assert s["full"] == 1 and s["dropped_backlog_full"] > 0 and s["dropped"] == s["dropped_backlog_full"]
    assert accounted(store, 0) == s["appended"] == 2_000
    cursor, got = store.read_observations("0", 10_000)
    assert len(got) == s["pending"] and store.stats()["full"] == 0
    assert accounted(store, len(got)) == 2_000


def test_unread_rows_trimmed_by_the_store_bound_are_counted() -> None:
    store = MemoryStore(retain=10, thin_above=1_000)
    store.append_observations(rows(0, 25))
    s = store.stats()
    assert s["dropped_store_bound"] == 15 and s["pending"] == 10 and s["thinned"] == 0


def _wait(condition: Any, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def entry(i: int) -> dict[str, Any]:
    return {
        "kv_cache_percentage": 0.2,
        "input_token_length": 100 + i % 500,
        "num_request_waiting": i % 4,
        "num_request_running": i % 16,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.0,
        "actual_ttft_ms": 50.0 + (i % 500) * 0.1,
        "actual_tpot_ms": 0.0 if i % 2 else 12.0,
    }


def test_the_service_counts_every_accepted_row_and_shows_thinning() -> None:
    store = MemoryStore(thin_above=1_000, max_stride=64)
    with TestClient(create_app(ServiceSettings(), store=store)) as c:
        batch = {"entries": [entry(i) for i in range(1_000)]}
        for _ in range(30):  # far faster than the learner learns: the backlog passes its bound
            assert c.post("/add_training_data_bulk", json=batch).status_code == 202
        status = c.get("/status").json()["ingestion"]
        assert status["accepted"] == 30_000
        assert status["thinned"]["overload"] > 0  # thinned as soon as the backlog passed 1,000

        def settled() -> bool:
            s = c.get("/status").json()["ingestion"]
            return s["pending"] == 0 and s["learned"] + s["thinned"]["overload"] + sum(s["dropped"].values()) == 30_000

        assert _wait(settled), c.get("/status").json()["ingestion"]
        ready = c.get("/readyz")
        assert ready.status_code == 200 and set(ready.json()["ingestion"]) >= {"learned", "thinned", "dropped"}
        metrics = c.get("/metrics").text
        learned = c.get("/status").json()["ingestion"]["learned"]
        assert f"leadtime_observations_learned_total {float(learned)}" in metrics
        assert 'leadtime_observations_thinned_total{reason="overload"}' in metrics


def test_rows_the_learner_holds_but_has_not_learned_count_as_pending() -> None:
    """Rows read from the store and handed to the learner were in no count until its next report: the backlog
    gauge showed 2,328 of 5,800 waiting rows. accepted = learned + thinned + dropped + pending at any moment (to
    within the batches in motion between the store and the learner while the counts are read)."""
    settings = ServiceSettings()
    with TestClient(create_app(settings)) as c:
        batch = {"entries": [entry(i) for i in range(1_000)]}
        gaps = []
        for _ in range(15):
            assert c.post("/add_training_data_bulk", json=batch).status_code == 202
            s = c.get("/status").json()["ingestion"]
            counted = s["learned"] + s["thinned"]["overload"] + sum(s["dropped"].values()) + s["pending"]
            gaps.append(s["accepted"] - counted)
        assert max(abs(g) for g in gaps) <= 2 * settings.ingest_batch, gaps


class _FullStore(MemoryStore):
    """A store whose learner backlog is full (as when the learner is stalled)."""

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "full": 1}


def test_a_full_backlog_gets_429_on_the_native_api_and_202_on_llmds() -> None:
    with TestClient(create_app(ServiceSettings(), store=_FullStore())) as c:
        native = c.post("/v1/observations", json={"observations": [entry(1)]})
        assert native.status_code == 429 and native.headers["retry-after"] == "1"
        assert "backlog is full" in native.json()["error"]
        assert c.post("/add_training_data_bulk", json={"entries": [entry(1)]}).status_code == 202
        ready = c.get("/readyz")
        assert ready.status_code == 200 and "backlog full" in ready.json()["degraded"]["ingestion"]


def test_lost_rows_are_counted_once_in_the_metrics_by_reason() -> None:
    """`leadtime_observations_dropped_total` counted again what `leadtime_observations_lost_total` counts by
    reason (backlog_full and store_bound here, store_buffer with Redis): summing the two overstated the loss."""
    store = MemoryStore(thin_above=100, max_stride=4)
    for i in range(20):  # before the service starts: the backlog is full and drops rows
        store.append_observations(rows(100 * i, 100))
    dropped = store.stats()["dropped_backlog_full"]
    assert dropped > 0
    with TestClient(create_app(ServiceSettings(), store=store)) as c:
        text = c.get("/metrics").text
    assert f'leadtime_observations_lost_total{{reason="backlog_full"}} {float(dropped)}' in text
    assert "leadtime_observations_dropped" not in text


def test_rows_replayed_from_the_stream_after_a_restart_are_counted_apart_from_what_this_process_accepted(
    redis_url: str,
) -> None:
    """A restarted service read the shared stream again from its model's position and counted those rows, which an
    earlier process had accepted, as learned: learned jumped (467 in the first scrape) and ended above accepted,
    breaking accepted = learned + thinned + dropped + pending. Now they are `replayed`, on the accepted side:
    accepted + replayed = learned + thinned + dropped + pending."""
    # Nothing published, so the restarted service replays all: the training lease is another's, so neither
    # retrains (a retrain drift set off, finishing as the first stopped, was published with its position).
    redis.Redis.from_url(redis_url).set("leadtime:lease:training", "someone-else", px=600_000)
    settings = ServiceSettings(redis_url=redis_url, retrain_every=1_000_000)
    with TestClient(create_app(settings)) as first:
        assert (
            first.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(300)]}).status_code == 202
        )
        assert _wait(lambda: first.get("/status").json()["ingestion"]["learned"] == 300)
        assert first.get("/status").json()["ingestion"]["replayed"] == 0
    with TestClient(create_app(settings)) as restarted:
        batch = {"entries": [entry(i) for i in range(200)]}
        assert restarted.post("/add_training_data_bulk", json=batch).status_code == 202

        def settled() -> bool:
            s = restarted.get("/status").json()["ingestion"]
            return s["pending"] == 0 and s["learned"] == 500

        assert _wait(settled), restarted.get("/status").json()["ingestion"]
        s = restarted.get("/status").json()["ingestion"]
        assert s["accepted"] == 200 and s["replayed"] == 300
        counted = s["learned_here"] + s["thinned"]["overload"] + sum(s["dropped"].values())
        assert s["accepted"] + s["replayed"] == counted and s["learned"] == s["learned_here"]
        metrics = restarted.get("/metrics").text
        assert "leadtime_observations_replayed_total 300.0" in metrics
        assert "leadtime_observations_learned_total 500.0" in metrics


def test_rows_an_earlier_stop_kept_in_the_model_dir_are_counted_as_replayed_whenever_they_are_sent(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Rows a replica kept in --model-dir at a stop during an outage, sent by the next start once Redis was back:
    learned, and counted neither as accepted (an earlier process accepted them) nor as replayed, since they landed
    after the stream's end at start (here Redis was still down then): accepted 0, replayed 0, learned 300. They are
    replayed rows, from the start on: pending until sent, then learned."""
    settings = ServiceSettings(redis_url=redis_server.url, model_dir=tmp_path, retrain_every=1_000_000)
    with TestClient(create_app(settings)) as first:
        redis_server.stop()
        batch = {"entries": [entry(i) for i in range(300)]}
        assert first.post("/add_training_data_bulk", json=batch).status_code == 202
    assert len(list(tmp_path.glob("unsent-*"))) == 1
    with TestClient(create_app(settings)) as restarted:
        s = restarted.get("/status").json()["ingestion"]
        assert s["accepted"] == 0 and s["replayed"] == s["pending"] == 300  # waiting to be sent, accounted for
        redis_server.start()

        def settled() -> bool:
            s = restarted.get("/status").json()["ingestion"]
            return s["pending"] == 0 and s["learned_here"] == 300

        assert _wait(settled), restarted.get("/status").json()["ingestion"]
        s = restarted.get("/status").json()["ingestion"]
        assert s["accepted"] == 0 and s["replayed"] == 300
        assert "leadtime_observations_replayed_total 300.0" in restarted.get("/metrics").text


def test_a_rewound_read_finding_its_counted_rows_trimmed_still_counts_the_rest_of_the_replay() -> None:
    """After a learner restart the cursor goes back before `_replay_counted`; when the rows up to it were trimmed
    from the stream meanwhile, that empty read cleared the replay's end, and the rest of the rows an earlier
    process accepted went uncounted as replayed."""

    class Learner:
        def learn(self, cursor_before: str, cursor: str, entries: list[dict[str, Any]]) -> bool:
            return True

    store = MemoryStore(retain=40)
    store.append_observations([entry(i) for i in range(100)])  # rows 60..99 remain
    runtime = ServiceRuntime(ServiceSettings(), store)
    runtime.learner = Learner()  # type: ignore[assignment]
    runtime._cursor, runtime._replay_counted, runtime._replay_until = "10", "60", "100"
    thread = threading.Thread(target=runtime._ingest_loop, daemon=True)
    thread.start()
    try:
        assert _wait(lambda: runtime._cursor == "100", 10.0)
    finally:
        runtime._stop.set()
        thread.join(timeout=5)
    assert runtime._replayed == 40
