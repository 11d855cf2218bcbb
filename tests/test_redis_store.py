"""RedisStore against a real redis-server: stream order, replicas, registry, notification, lease, outage."""

from __future__ import annotations

import json
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import require_redis_server
from redis_server import RedisServer
from waiting import wait_until

from leadtime.predictor.artifact import encode
from leadtime.predictor.store.base import LeaseLost, Store, StoreClosed
from leadtime.predictor.store.redis_store import (
    ArtifactRefused,
    LatestOutcome,
    RedisStore,
    StoreUnavailable,
    check_artifact,
)
from leadtime.predictor.store.stream_identity import StreamIdentity, same_stream

StoreFactory = Callable[..., RedisStore]


@pytest.fixture
def make_store(redis_url: str) -> Iterator[StoreFactory]:
    """Stores on the test's server, all in one namespace (like replicas), closed at the end."""
    stores: list[RedisStore] = []

    def make(**kwargs: Any) -> RedisStore:
        kwargs.setdefault("namespace", "test")
        store = RedisStore(redis_url, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close(flush_timeout_s=0.0)


def entry(i: int) -> dict[str, Any]:
    """An llm-d training entry (observation_to_llmd shape) numbered by its input length."""
    return {
        "kv_cache_percentage": 0.25,
        "input_token_length": i,
        "num_request_waiting": 1,
        "num_request_running": 2,
        "num_tokens_generated": 10,
        "prefix_cache_score": 0.5,
        "pod_type": "",
        "actual_ttft_ms": 100.0 + i,
        "actual_tpot_ms": 12.5,
    }


def read_all(store: RedisStore, cursor: str = "0", batch: int = 1_000) -> tuple[str, list[dict[str, Any]]]:
    out: list[dict[str, Any]] = []
    while True:
        cursor, entries = store.read_observations(cursor, batch)
        if not entries:
            return cursor, out
        out.extend(entries)


def artifact(tag: str) -> bytes:
    """A minimal artifact in the predictor's JSON format, told apart by its tag."""
    return encode({"config": {}, "targets": {}, "tag": tag})


# ---- observations -----------------------------------------------------------------------------------------


def test_appended_entries_come_back_in_order_and_cursor_pages(make_store: StoreFactory) -> None:
    store = make_store()
    as_protocol: Store = store  # mypy checks that RedisStore implements the service's Store protocol
    assert as_protocol is store
    store.append_observations([entry(i) for i in range(250)])
    store.append_observations([entry(i) for i in range(250, 300)])
    assert store.flush(5.0)

    cursor, first = store.read_observations("0", 100)
    assert [e["input_token_length"] for e in first] == list(range(100))
    assert first[0] == entry(0)  # the whole entry survives the round trip
    cursor, rest = read_all(store, cursor, batch=64)
    assert [e["input_token_length"] for e in rest] == list(range(100, 300))
    assert store.read_observations(cursor, 10) == (cursor, [])
    assert store.stats() == {"buffered": 0, "dropped": 0, "appended": 300, "resent": 0, "server_restarts": 0}


def test_a_read_stops_at_the_end_the_stream_had_at_a_moment(make_store: StoreFactory) -> None:
    """What a restarted service replays (rows an earlier process accepted) is told from what arrives after its
    start by the stream's end at start: `stream_end`, then reads bounded by it."""
    store = make_store()
    assert store.stream_end() == "0"
    store.append_observations([entry(i) for i in range(30)])
    assert store.flush(5.0)
    end = store.stream_end()
    assert end is not None
    store.append_observations([entry(i) for i in range(30, 50)])
    assert store.flush(5.0)
    cursor, first = store.read_observations("0", 20, until=end)
    cursor, rest = store.read_observations(cursor, 20, until=end)
    assert [e["input_token_length"] for e in first + rest] == list(range(30)) and cursor == end
    assert store.read_observations(cursor, 20, until=end) == (cursor, [])
    assert [e["input_token_length"] for e in read_all(store, cursor)[1]] == list(range(30, 50))


def test_every_replica_reads_every_observation(make_store: StoreFactory) -> None:
    a, b, c = make_store(), make_store(), make_store()
    a.append_observations([entry(i) for i in range(20)])
    b.append_observations([entry(i) for i in range(20, 30)])
    assert a.flush() and b.flush()
    for reader in (a, b, c):
        _cursor, seen = read_all(reader)
        assert sorted(e["input_token_length"] for e in seen) == list(range(30))


def test_namespaces_do_not_see_each_other(make_store: StoreFactory) -> None:
    blue, green = make_store(namespace="blue"), make_store(namespace="green")
    blue.append_observations([entry(1)])
    assert blue.flush()
    assert read_all(green)[1] == []
    assert len(read_all(blue)[1]) == 1


def test_read_refuses_a_bad_cursor_and_count(make_store: StoreFactory) -> None:
    store = make_store()
    store.append_observations([entry(1)])
    assert store.flush()
    with pytest.raises(ValueError, match="cursor"):
        store.read_observations("not-an-id", 10)
    with pytest.raises(ValueError, match="max_count"):
        store.read_observations("0", 0)


def test_messages_from_other_writers_are_skipped_not_fatal(make_store: StoreFactory, redis_url: str) -> None:
    store = make_store()
    raw = redis.Redis.from_url(redis_url)
    store.append_observations([entry(1)])
    assert store.flush()
    raw.xadd("test:observations", {"other": "field"})
    raw.xadd("test:observations", {"e": "not json"})
    raw.xadd("test:observations", {"e": "[1, 2]"})
    store.append_observations([entry(2)])
    assert store.flush()
    _cursor, seen = read_all(store)
    assert [e["input_token_length"] for e in seen] == [1, 2]


def test_stream_is_bounded(make_store: StoreFactory, redis_url: str) -> None:
    store = make_store(stream_maxlen=100)
    store.append_observations([entry(i) for i in range(3_000)])
    assert store.flush()
    length = redis.Redis.from_url(redis_url).xlen("test:observations")
    assert 100 <= length < 3_000  # MAXLEN ~ trims whole macro nodes, so "about" the bound
    _cursor, kept = read_all(store)
    assert kept[-1]["input_token_length"] == 2_999  # the newest are the ones kept


def test_constructor_refuses_bad_bounds(redis_url: str) -> None:
    with pytest.raises(ValueError, match="buffer_limit"):
        RedisStore(redis_url, buffer_limit=-1)
    with pytest.raises(ValueError, match="keep_versions"):
        RedisStore(redis_url, keep_versions=0)
    with pytest.raises(ValueError, match="redis URL 'http://nowhere:6379' is not usable"):
        RedisStore("http://user:secret@nowhere:6379")  # and the password is not repeated in the message


@pytest.mark.parametrize("password", ["Zx9/Secr3tPart", "Zx9#Secr3tPart", "Zx9?Secr3tPart"])
def test_a_password_holding_a_url_delimiter_is_never_shown_and_the_message_says_how_to_write_it(
    password: str,
) -> None:
    """Regression: a `/` or `#` in the password ended the URL's user part early, and the error repeated the rest
    (`got '/Secr3tPart@127.0.0.1:6393/0'`, `integer value as 'Zx9'`)."""
    with pytest.raises(ValueError) as refused:
        RedisStore(f"redis://:{password}@127.0.0.1:6393/0")
    message = str(refused.value)
    assert "Zx9" not in message and "Secr3t" not in message, message
    assert "redis://127.0.0.1:6393/0" in message and "percent-encode" in message and "%2F" in message, message


def add_user(redis_server: RedisServer) -> None:
    """The user "user" with the password "secret", that the URLs of the tests below give (a wrong one is refused)."""
    raw = redis.Redis(port=redis_server.port)
    raw.acl_setuser("user", enabled=True, passwords=["+secret"], keys=["*"], channels=["*"], commands=["+@all"])
    raw.close()


def test_address_never_shows_the_password(redis_server: RedisServer) -> None:
    add_user(redis_server)
    store = RedisStore(f"redis://user:secret@127.0.0.1:{redis_server.port}/0")
    try:
        assert store.address == f"redis://127.0.0.1:{redis_server.port}/0"
        assert "secret" not in store.health()["redis"]
    finally:
        store.close()


@pytest.mark.parametrize(
    "spelling",
    [
        "redis://127.0.0.1:{port}",
        "REDIS://user:secret@127.0.0.1:{port}/0/",
        "redis://127.0.0.1:{port}?db=0&socket_timeout=5",
    ],
)
def test_every_spelling_of_one_stream_records_one_name_and_shows_its_own_address(
    redis_server: RedisServer, spelling: str
) -> None:
    """What a model records as its stream (`stream_name`) is canonical, so that a replica started under another
    spelling of the URL recognises it; logs and /v1/status still show the URL as given, without the password."""
    url = spelling.format(port=redis_server.port)
    add_user(redis_server)
    store = RedisStore(url, namespace="test")
    try:
        assert store.stream_name == f"redis://127.0.0.1:{redis_server.port}/0 test:observations"
        assert store.address == url.replace("user:secret@", "")
    finally:
        store.close(flush_timeout_s=0.0)


@pytest.mark.parametrize(
    ("recorded", "same"),
    [
        ("redis://127.0.0.1:6379/0 leadtime:observations", True),  # the canonical name
        ("redis://127.0.0.1 leadtime:observations", True),  # an old-form name: the URL as it was given
        ("redis://127.0.0.1:6379/0/?socket_timeout=5 leadtime:observations", True),
        ("redis://127.0.0.1:6379?db=0 leadtime:observations", True),
        ("redis://localhost:6379/0 leadtime:observations", False),  # nothing is resolved
        ("rediss://127.0.0.1:6379/0 leadtime:observations", False),
        ("redis://127.0.0.1:6379/1 leadtime:observations", False),
        ("redis://127.0.0.1:6379/0 fleet-b:observations", False),
        ("redis://127.0.0.1:6379/0", False),
        ("redis://127.0.0.1:port/0 leadtime:observations", False),  # not an address
        ("", False),
        (None, False),  # a model saved without Redis
    ],
)
def test_a_recorded_stream_name_is_compared_as_the_stream_it_names(recorded: str | None, same: bool) -> None:
    """Regression: names were compared as text, so a model recorded under `redis://h:6379` lost its position in a
    replica started under `redis://h:6379/0`. Names recorded before they were canonical are read too."""
    ours = StreamIdentity.of("redis://127.0.0.1:6379/0", "leadtime")
    assert same_stream(recorded, ours) is same
    assert not same_stream(recorded, None)  # a memory store: no other process's stream


def test_the_canonical_name_names_the_stream_it_was_made_of() -> None:
    """A socket path holding a space, an IPv6 host, a namespace holding a space: the name still reads back as the
    same stream, and never as another."""
    for url, namespace in [("unix:///tmp/my redis.sock?db=2", "a b"), ("redis://[::1]", "leadtime")]:
        ours = StreamIdentity.of(url, namespace)
        assert same_stream(ours.name, ours)
        assert not same_stream(ours.name, StreamIdentity.of(url, "other"))


# ---- the stream key holding something else ------------------------------------------------------------------


def test_a_chunk_refused_by_a_script_error_stays_buffered_until_the_stream_key_is_fixed(
    make_store: StoreFactory, redis_url: str
) -> None:
    """Regression: with the stream key holding a string (WRONGTYPE), the append script set the chunk's mark before
    its XADD failed; the retry found the mark, took the chunk for landed and dropped it: rows answered 202 lost."""
    raw = redis.Redis.from_url(redis_url)
    raw.set("test:observations", "v1-format")
    store = make_store()
    store.append_observations([entry(i) for i in range(10)])
    assert wait_until(lambda: "observations" in store.health()["redis"], timeout_s=5), store.health()
    time.sleep(0.3)  # several retries meet the wrong key
    assert store.stats()["buffered"] == 10
    assert "not a stream" in store.health()["redis"]  # names the problem
    raw.delete("test:observations")
    assert store.flush(10.0)
    assert [e["input_token_length"] for e in read_all(store)[1]] == list(range(10))
    assert store.stats() == {"buffered": 0, "dropped": 0, "appended": 10, "resent": 0, "server_restarts": 0}


def test_a_stream_key_holding_something_else_is_logged_once_not_on_every_other_call(
    make_store: StoreFactory, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """While the stream key held a string, every failed append or read logged a warning and every registry or lease
    call that succeeded meanwhile logged "answers again": 130 lines in 37 s instead of one per outage."""
    raw = redis.Redis.from_url(redis_url)
    raw.set("test:observations", "v1-format")
    with caplog.at_level(logging.INFO, logger="leadtime.store"):
        store = make_store()
        store.append_observations([entry(0)])
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # what the ingest, model-sync and lease loops do meanwhile
            store.read_observations("0", 10)
            store.wait_for_model(0, 0.05)
            store.acquire_training_lease("replica-a", 5.0)
        assert "not a stream" in store.health()["redis"]
        raw.delete("test:observations")
        assert store.flush(10.0)
        assert wait_until(lambda: store.health() == {"redis": "ok"}, timeout_s=5)
    lines = [r.getMessage() for r in caplog.records if r.name == "leadtime.store"]
    assert sum("buffering observations in memory" in line for line in lines) == 1, lines
    assert sum("again" in line for line in lines) == 1, lines


def test_a_full_redis_is_one_warning_and_health_says_what_waits_until_writes_are_taken_again(
    make_store: StoreFactory, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis at its maxmemory (noeviction) refuses writes while reads answer: every read on the stream ended the
    append's "error" (about 2 log lines a second, alternating) and health() said "ok" between them, while the
    accepted rows stayed in the buffer. Raising maxmemory sends them, without a restart."""
    raw = redis.Redis.from_url(redis_url)
    store = make_store()
    with caplog.at_level(logging.INFO, logger="leadtime.store"):
        raw.config_set("maxmemory", "1")  # below what an empty server uses: every write is refused
        store.append_observations([entry(i) for i in range(50)])
        answers = set()
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # what the ingest, model-sync and lease loops do meanwhile
            store.read_observations("0", 10)
            store.wait_for_model(0, 0.05)
            answers.add(store.health()["redis"])
        assert store.stats()["buffered"] == 50
        answers.discard("ok")  # before the writer's first refused try
        assert answers == {store.health()["redis"]}, answers
        assert "out of memory" in store.health()["redis"] and "50 observations buffered" in store.health()["redis"]
        raw.config_set("maxmemory", "0")
        assert store.flush(10.0)
        assert wait_until(lambda: store.health() == {"redis": "ok"}, timeout_s=5)
    assert [e["input_token_length"] for e in read_all(store)[1]] == list(range(50))
    lines = [r.getMessage() for r in caplog.records if r.name == "leadtime.store"]
    assert sum("buffering observations in memory" in line for line in lines) == 1, lines
    assert sum("again" in line for line in lines) == 1, lines


def test_a_full_redis_answers_the_reads_of_a_replica_that_never_read_its_stream(
    make_store: StoreFactory, redis_url: str
) -> None:
    """A read also marks the stream it reads (the token that tells a flushed one), a write: a full Redis refuses that,
    and must still answer the read."""
    writer = make_store()
    writer.append_observations([entry(i) for i in range(5)])
    assert writer.flush()
    redis.Redis.from_url(redis_url).config_set("maxmemory", "1")  # every write refused from now on
    try:
        _cursor, rows = read_all(make_store())  # a replica started now: its first read finds no token
        assert [e["input_token_length"] for e in rows] == list(range(5))
    finally:
        redis.Redis.from_url(redis_url).config_set("maxmemory", "0")


def test_a_redis_that_evicts_keys_when_full_is_named_once_at_start(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With an allkeys-* policy a full Redis silently evicts the observation stream and the models (XLEN 0)."""
    raw = redis.Redis.from_url(redis_url)
    with caplog.at_level(logging.INFO, logger="leadtime.store"):
        quiet = RedisStore(redis_url, namespace="quiet")
        quiet.flush(1.0)
        time.sleep(0.3)  # the writer's first contact
        quiet.close()
        raw.config_set("maxmemory-policy", "allkeys-lru")
        store = RedisStore(redis_url, namespace="evicted")
        try:
            assert wait_until(lambda: "allkeys-lru" in caplog.text, timeout_s=5)
            store.append_observations([entry(0)])
            assert store.flush(5.0)
            time.sleep(0.6)  # further health checks by the writer say nothing more
        finally:
            store.close()
    lines = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "allkeys-lru" in lines[0] and "noeviction" in lines[0] and "observation stream" in lines[0]


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server that needs the password "right"."""
    server = RedisServer(
        require_redis_server(), tmp_path, extra_args=["--requirepass", "right"], client_options={"password": "right"}
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_a_wrong_or_missing_password_or_a_database_redis_lacks_is_refused_at_start(
    password_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: these are configuration errors no retry heals, yet the store started, reported itself degraded and
    buffered rows it could never send (a service answered 202 for them, then dropped them). Redis says so at the first
    PING: the store refuses to start, in one line naming the problem (never the password)."""
    port = password_redis.port
    with caplog.at_level(logging.INFO, logger="leadtime.store"):
        for url, named in (
            (f"redis://:wrong@127.0.0.1:{port}/0", "Redis refused the password"),
            (f"redis://127.0.0.1:{port}/0", "Redis needs a password"),
            (f"redis://:right@127.0.0.1:{port}/16", "Redis has no database 16"),
        ):
            with pytest.raises(ValueError) as refused:
                RedisStore(url, socket_timeout_s=0.5)
            problem = str(refused.value)
            assert problem.startswith(f"redis URL 'redis://127.0.0.1:{port}/") and named in problem, problem
            assert "wrong" not in problem and "right" not in problem and "HELLO" not in problem, problem
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # the refusal is the one line


def test_a_password_required_after_start_is_named_as_such(password_redis: RedisServer) -> None:
    """Once running, the store rides out whatever Redis answers (a password changed by an operator is fixed there,
    not by restarting every replica), and names it: authentication failures read as "unreachable (...)" or
    redis-py internals ("HELLO must be called with the client already authenticated")."""
    store = RedisStore(f"redis://:right@127.0.0.1:{password_redis.port}/0", socket_timeout_s=0.5)
    try:
        raw = redis.Redis(port=password_redis.port, password="right")
        raw.config_set("requirepass", "changed")
        raw.client_kill_filter(_type="normal", skipme=True)  # the store's connections authenticate again
        store.append_observations([entry(0)])
        assert wait_until(lambda: store.health()["redis"].startswith("Redis refused the password"), timeout_s=5)
        problem = store.health()["redis"]
        assert "unreachable" not in problem and "HELLO" not in problem and "right" not in problem, problem
        # and so do the calls that raise it (the lease, a publication), once: "...: redis Redis refused ..." was said
        for call in (lambda: store.acquire_training_lease("a", 1.0), lambda: store.publish_model(artifact("x"))):
            with pytest.raises(StoreUnavailable) as refused:
                call()
            assert ": Redis refused the password" in str(refused.value), str(refused.value)
        raw.close()
    finally:
        store.close(flush_timeout_s=0.0)


def test_a_database_redis_lacks_found_after_start_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a database index Redis lacks (/16) was logged twice, "from the start" and again 40 ms later: the
    stream's own calls took the refusal (a ResponseError) for a problem of the stream key. Found once Redis is up
    (it was unreachable at the start, which is ridden out), it is said once, as the server's problem."""
    server = RedisServer(require_redis_server(), tmp_path)
    with caplog.at_level(logging.INFO, logger="leadtime.store"):
        store = RedisStore(f"redis://127.0.0.1:{server.port}/16", socket_timeout_s=0.3)
        try:
            server.start()
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:  # what the ingest, model-sync and lease loops do meanwhile
                store.append_observations([entry(0)])
                store.read_observations("0", 10)
                store.latest_model()
                time.sleep(0.05)
            assert "Redis has no database 16" in store.health()["redis"]
        finally:
            store.close(flush_timeout_s=0.0)
            server.stop()
    lines = [r.getMessage() for r in caplog.records if "database" in r.getMessage()]
    assert len(lines) == 1, lines


# ---- model registry ---------------------------------------------------------------------------------------


def test_registry_versions_latest_and_trimming(make_store: StoreFactory) -> None:
    publisher, other = make_store(keep_versions=3), make_store(keep_versions=3)
    assert publisher.latest_model() is None
    assert publisher.model_versions() == []
    versions = [publisher.publish_model(artifact(f"m{i}")) for i in range(5)]
    assert versions == [1, 2, 3, 4, 5]
    assert other.latest_model() == (5, artifact("m4"))
    assert other.model_versions() == [3, 4, 5]
    assert other.model(4) == artifact("m3")
    assert other.model(1) is None  # trimmed: only the last three are kept


def test_registry_version_tells_what_the_registry_still_holds(
    make_store: StoreFactory, redis_url: str, redis_server: RedisServer
) -> None:
    """What the lease holder asks on every renewal to notice a registry that lost its models (no artifact sent)."""
    store = make_store()
    raw = redis.Redis.from_url(redis_url)
    assert store.registry_version() == 0
    assert [store.publish_model(artifact(str(i))) for i in range(2)] == [1, 2]
    assert store.registry_version() == 2
    raw.delete("test:model:2")  # evicted or deleted: the counter alone is not a model
    assert store.registry_version() == 0
    raw.flushall()
    assert store.registry_version() == 0
    redis_server.stop()
    assert store.registry_version() is None  # cannot tell


def test_registry_refuses_anything_but_json(make_store: StoreFactory) -> None:
    store = make_store()
    refused: list[Any] = [
        pickle.dumps({"model": "tree"}),
        b"tree\nversion=v4\n",  # raw LightGBM text without the JSON wrapper
        b"\xff\xfe not utf-8",
        b"[1, 2, 3]",
        b'{"format": "something-else", "config": {}, "targets": {}}',
        "a str, not bytes",
    ]
    for bad in refused:
        with pytest.raises(ArtifactRefused):
            store.publish_model(bad)
    assert store.latest_model() is None
    check_artifact(artifact("ok"))  # the predictor's own format passes


def test_a_real_predictor_round_trips_through_the_registry(make_store: StoreFactory) -> None:
    from leadtime.predictor.learner import LearnerConfig, OnlinePredictor

    source = OnlinePredictor(LearnerConfig(background=False, seed=3))
    publisher, replica = make_store(), make_store()
    version = publisher.publish_model(source.to_bytes())
    latest = replica.latest_model()
    assert latest is not None and latest[0] == version
    loaded = OnlinePredictor.from_bytes(latest[1], background=False)
    assert loaded.config.seed == 3
    assert loaded.to_bytes() == source.to_bytes()


WAIT_S = 30.0
"""How long the wait_for_model tests wait: far longer than the 0.25 s poll, so a wake-up by a notification or a
poll is told from the end of the wait however loaded the host is."""


def test_wait_for_model_wakes_soon_after_publication(make_store: StoreFactory) -> None:
    publisher, replica = make_store(), make_store()
    publisher.publish_model(artifact("first"))
    assert replica.wait_for_model(0, 2.0) == 1  # already there: answers at once
    assert replica.wait_for_model(1, 0.2) is None  # nothing newer: times out

    seen: dict[str, float] = {}

    def waiter() -> None:
        version = replica.wait_for_model(1, WAIT_S)
        seen["at"] = time.monotonic()
        seen["version"] = float(version or 0)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)  # the waiter is blocked by now (if not, it finds the version when it asks: same outcome)
    published_at = time.monotonic()
    publisher.publish_model(artifact("second"))
    thread.join(WAIT_S)
    assert seen["version"] == 2
    # Woken by the publication: the notification, or at worst the 0.25 s poll that backs it up (the two cannot be
    # told apart by time). The bound only tells a wake-up from the end of the 30 s wait, with room for a stalled
    # host; how fast a swap is, the benchmarks measure.
    assert seen["at"] - published_at < WAIT_S / 3


def test_wait_for_model_polls_when_a_notification_is_missed(make_store: StoreFactory, redis_url: str) -> None:
    replica = make_store()
    raw = redis.Redis.from_url(redis_url)
    raw.set("test:model:1", artifact("silent"))
    started = time.monotonic()
    threading.Timer(0.2, lambda: raw.set("test:model:version", 1)).start()  # no PUBLISH at all
    assert replica.wait_for_model(0, WAIT_S) == 1
    # Found by a poll (every 0.25 s), not by the last look at the end of the 30 s wait: a generous bound tells
    # the two apart.
    assert time.monotonic() - started < WAIT_S / 3
    assert replica.latest_model() == (1, artifact("silent"))


def test_versions_never_go_backwards_after_redis_loses_its_data(
    make_store: StoreFactory, redis_server: RedisServer
) -> None:
    store = make_store()
    assert [store.publish_model(artifact(str(i))) for i in range(3)] == [1, 2, 3]
    redis_server.restart()  # no persistence: the counter is gone
    assert wait_until(lambda: store.health() == {"redis": "ok"}, timeout_s=5)
    assert store.publish_model(artifact("after")) == 4
    assert store.latest_model() == (4, artifact("after"))


def test_a_model_is_restored_only_where_the_registry_lost_it_and_once(make_store: StoreFactory, redis_url: str) -> None:
    """Any replica may give a registry that lost its models the model it serves, without the lease: the restoration
    writes nothing while the registry holds the version lost or a newer one, so of two replicas noticing, one does."""
    first, second = make_store(), make_store()
    raw = redis.Redis.from_url(redis_url)
    assert [first.publish_model(artifact(str(i))) for i in range(2)] == [1, 2]
    assert first.restore_model(artifact("again"), lost=2) is None  # held
    raw.delete("test:model:2")  # evicted: the counter alone is not a model
    assert first.restore_model(artifact("again"), lost=2) == 3
    assert second.restore_model(artifact("other"), lost=2) is None  # the first gave it back
    raw.flushall()
    assert make_store().publish_model(artifact("new lineage")) == 1  # a store that never saw the old numbers
    assert first.restore_model(artifact("again"), lost=3) == 4  # numbered above what the fleet held
    assert second.latest_model() == (4, artifact("again"))
    assert second.restore_model(artifact("other"), lost=3) is None


# ---- training lease ---------------------------------------------------------------------------------------


def test_lease_is_exclusive_renewable_by_its_holder_and_expires(make_store: StoreFactory, redis_url: str) -> None:
    a, b = make_store(), make_store()
    raw = redis.Redis.from_url(redis_url)
    assert a.acquire_training_lease("replica-a", ttl_s=3.0)
    assert not b.acquire_training_lease("replica-b", ttl_s=5.0)
    assert b.lease_holder() == "replica-a"
    time.sleep(1.0)
    left = raw.pttl("test:lease:training")
    assert 0 < left <= 2_000  # a second of the 3 s has gone
    assert a.acquire_training_lease("replica-a", ttl_s=3.0)  # renewal pushes expiry out: the full TTL again
    assert raw.pttl("test:lease:training") > left  # ~3 000 > 2 000: a second of margin for a stalled host
    assert not b.acquire_training_lease("replica-b", ttl_s=5.0)
    assert b.lease_holder() == "replica-a"
    assert wait_until(lambda: b.acquire_training_lease("replica-b", ttl_s=5.0), timeout_s=10.0)  # it expires
    assert not a.acquire_training_lease("replica-a", ttl_s=5.0)
    assert not a.release_training_lease("replica-a")  # only the holder may release
    assert b.release_training_lease("replica-b")
    assert a.acquire_training_lease("replica-a", ttl_s=5.0)


def test_a_former_lease_holder_cannot_publish(make_store: StoreFactory) -> None:
    """Regression: a replica paused past the lease's TTL (a VM suspended) resumed believing it held the lease and
    published over the new holder's model. The check and the publication are one atomic step."""
    a, b = make_store(), make_store()
    assert a.acquire_training_lease("replica-a", ttl_s=0.2)
    assert a.publish_model(artifact("a1"), holder="replica-a") == 1
    time.sleep(0.3)  # A paused past the TTL
    with pytest.raises(LeaseLost, match="replica-a") as refused:  # nobody holds it: still not A's
        a.publish_model(artifact("a-stale"), holder="replica-a")
    assert refused.value.holder is None
    assert b.acquire_training_lease("replica-b", ttl_s=5.0)
    assert b.publish_model(artifact("b1"), holder="replica-b") == 2
    with pytest.raises(LeaseLost, match="replica-b") as refused:
        a.publish_model(artifact("a2"), holder="replica-a")
    assert refused.value.holder == "replica-b"
    assert b.latest_model() == (2, artifact("b1"))  # nothing of A's was stored, no version used
    assert b.publish_model(artifact("job")) == 3  # a publisher without a lease (`leadtime retrain`) is not checked


def test_lease_refuses_bad_arguments(make_store: StoreFactory) -> None:
    store = make_store()
    with pytest.raises(ValueError, match="holder"):
        store.acquire_training_lease("", 1.0)
    with pytest.raises(ValueError, match="ttl_s"):
        store.acquire_training_lease("x", 0)


def test_only_one_of_many_contenders_gets_the_lease(make_store: StoreFactory) -> None:
    stores = [make_store() for _ in range(4)]
    winners: list[str] = []
    barrier = threading.Barrier(len(stores))

    def contend(i: int) -> None:
        barrier.wait()
        if stores[i].acquire_training_lease(f"replica-{i}", ttl_s=5.0):
            winners.append(f"replica-{i}")

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1
    assert stores[0].lease_holder() == winners[0]


# ---- outage -----------------------------------------------------------------------------------------------


def test_outage_loses_no_accepted_observation(make_store: StoreFactory, redis_server: RedisServer) -> None:
    writer, reader = make_store(), make_store()
    writer.append_observations([entry(i) for i in range(50)])
    assert writer.flush()
    cursor, before = read_all(reader)
    assert len(before) == 50
    assert len(read_all(writer)[1]) == 50  # a replica reads what it wrote too: these need no resending

    redis_server.stop()
    for start in range(50, 150, 10):
        writer.append_observations([entry(i) for i in range(start, start + 10)])  # must not raise
    assert wait_until(lambda: writer.health()["redis"] != "ok", timeout_s=5)
    assert "100 observations buffered" in writer.health()["redis"]
    assert writer.stats()["buffered"] == 100
    assert reader.read_observations(cursor, 10) == (cursor, [])  # no exception while down

    redis_server.start()  # same port, empty
    assert writer.flush(10.0)
    assert wait_until(lambda: writer.health() == {"redis": "ok"}, timeout_s=5)
    _cursor, after = read_all(reader, cursor)
    assert [e["input_token_length"] for e in after] == list(range(50, 150))
    assert writer.stats() == {"buffered": 0, "dropped": 0, "appended": 150, "resent": 0, "server_restarts": 1}


def sent_again_after(store: RedisStore, lose: Callable[[str], None]) -> None:
    """20 rows sent and read back, 30 more sent and not yet read, then `lose(cursor after the 20)`: the 30, and only
    they, are sent again, each once and in order."""
    store.append_observations([entry(i) for i in range(20)])
    assert store.flush()
    cursor, first = read_all(store)
    assert len(first) == 20  # read back: confirmed
    store.append_observations([entry(i) for i in range(20, 50)])
    assert store.flush()  # in Redis, not yet read back
    lose(cursor)
    assert wait_until(lambda: store.stats()["resent"] == 30, 10), store.stats()
    assert store.flush(10.0)
    _cursor, after = read_all(store, cursor)
    assert [e["input_token_length"] for e in after] == list(range(20, 50))  # each once, in order


def test_what_redis_took_but_lost_in_a_crash_before_it_was_read_is_sent_again(
    make_store: StoreFactory, redis_server: RedisServer
) -> None:
    """Regression: Redis (without persistence) acknowledged a batch, then crashed before the ingest loop had read
    it: the batch was gone. The store keeps what it sent until it has read it back, and sends it again when it
    finds Redis restarted (another run id)."""
    store = make_store()
    sent_again_after(store, lambda _cursor: redis_server.restart())  # SIGKILL and up again, empty
    assert store.stats()["appended"] == 50  # resending is not appending again


def test_what_a_flush_of_redis_took_before_it_was_read_is_sent_again(make_store: StoreFactory, redis_url: str) -> None:
    """Regression: FLUSHALL while the replicas ran emptied the stream of rows Redis had taken and no replica had read
    yet; the run id was the same, so nothing was sent again: answered 202, learned by no replica. The first read of
    the emptied stream tells (its token is gone) and the rows it no longer holds are sent again; it is no restart."""

    def flush_all(cursor: str) -> None:
        redis.Redis.from_url(redis_url).flushall()
        assert store.read_observations(cursor, 100) == (cursor, [])  # the emptied stream: its token is gone

    store = make_store()
    sent_again_after(store, flush_all)
    assert store.stats()["appended"] == 50 and store.stats()["server_restarts"] == 0


@pytest.fixture
def persistent_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server with `appendonly yes` (fsync on every write): a restart keeps what it had taken."""
    persistence = ["--appendonly", "yes", "--appendfsync", "always"]
    server = RedisServer(require_redis_server(), tmp_path, extra_args=persistence)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_a_restart_of_a_redis_with_persistence_resends_nothing(persistent_redis: RedisServer) -> None:
    """Regression: any new run_id made the store send again what it had not read back, though a Redis with
    `appendonly yes` still held it: every replica learned those rows twice (XLEN 6500 -> 8500)."""
    store = RedisStore(persistent_redis.url, namespace="test")
    try:
        store.append_observations([entry(i) for i in range(20)])
        assert store.flush()
        cursor, _first = read_all(store)
        store.append_observations([entry(i) for i in range(20, 50)])
        assert store.flush()  # in Redis, not yet read back
        persistent_redis.restart()  # SIGKILL, then up again from its append-only file
        assert wait_until(lambda: store.stats()["server_restarts"] == 1, 10), store.stats()
        store.append_observations([entry(50)])
        assert store.flush(10.0)
        _cursor, after = read_all(store, cursor)
        assert [e["input_token_length"] for e in after] == list(range(20, 51))  # each once
        assert store.stats()["resent"] == 0
    finally:
        store.close()


def test_rows_a_replica_was_moved_past_are_not_resent_after_a_restart(
    make_store: StoreFactory, redis_server: RedisServer
) -> None:
    """Regression: a replica that adopted a published model continues from that model's stream position, past rows
    it wrote and had not read itself; it kept them as unread and sent them again at the next restart, so every
    replica learned them twice (14000 -> 14750)."""
    writer, publisher = make_store(), make_store()
    writer.append_observations([entry(i) for i in range(30)])
    assert writer.flush()
    adopted, _learned = read_all(publisher)  # the position recorded in the model the writer adopts
    assert writer.read_observations(adopted, 100) == (adopted, [])  # the writer reads on from there
    redis_server.restart()  # no persistence: the stream is gone, but every replica had these rows
    assert wait_until(lambda: writer.stats()["server_restarts"] == 1, 10), writer.stats()
    assert writer.flush(10.0)
    assert writer.stats()["resent"] == 0
    assert read_all(writer)[1] == []


def test_redis_going_away_and_coming_back_is_logged_once_each(
    make_store: StoreFactory, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store()
    with caplog.at_level(logging.INFO, logger="leadtime.store"):
        redis_server.stop()
        for i in range(3):
            store.append_observations([entry(i)])
            store.read_observations("0", 10)
        assert wait_until(lambda: "buffering observations in memory" in caplog.text, timeout_s=5)
        redis_server.start()
        assert wait_until(lambda: "answers again" in caplog.text, timeout_s=15.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "leadtime.store"]
    assert sum("buffering observations in memory" in line for line in lines) == 1, lines
    assert sum("answers again" in line for line in lines) == 1, lines
    assert all(redis_server.url.split("@")[-1] in line for line in lines)


def test_redis_unreachable_from_the_start_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Only a change was logged, and "not contacted yet" to "unreachable" was none: a service whose Redis was
    never up said nothing of it in its log."""
    from leadtime.bench.procs import free_port

    with caplog.at_level(logging.INFO, logger="leadtime.store"):
        store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.3)
        try:
            store.append_observations([entry(0)])
            assert wait_until(lambda: "buffering observations in memory" in caplog.text, timeout_s=5)
        finally:
            store.close(flush_timeout_s=0.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "leadtime.store"]
    assert any("unreachable" in line and "buffering" in line for line in lines), lines


def test_an_answer_that_arrives_late_does_not_override_a_call_started_after_it() -> None:
    """Calls run on several threads (the writer, request handlers), so their answers arrive out of order: the
    writer's health check that started before an outage may return after a handler's call saw the outage. Health
    follows the call that started last, so that stale answer neither hides the outage nor logs a recovery."""
    health = LatestOutcome("not contacted yet")
    assert health.record(None, started=1.0) == ("not contacted yet", None)
    assert health.record("connection refused", started=3.0) == (None, "connection refused")
    assert health.record(None, started=2.0) is None  # began before the failure was seen: stale
    assert health.problem == "connection refused"
    assert health.record("connection refused", started=4.0) is None  # no change, nothing to log
    assert health.record(None, started=5.0) == ("connection refused", None)
    assert health.record("timeout", started=4.5) is None  # a stale failure does not hide the recovery
    assert health.problem is None


def test_a_hung_server_neither_blocks_appends_nor_duplicates_a_resent_chunk(
    make_store: StoreFactory, redis_server: RedisServer
) -> None:
    store = make_store(socket_timeout_s=0.3)
    store.append_observations([entry(0)])
    assert store.flush()
    redis_server.pause()
    try:
        store.append_observations([entry(i) for i in range(1, 101)])  # returns at once: no network I/O
        assert wait_until(lambda: "timeout" in store.health()["redis"].lower(), timeout_s=5)
        # The writer has sent the chunk at least once; the frozen server will run every copy on resume.
    finally:
        redis_server.resume()
    assert store.flush(10.0)
    _cursor, seen = read_all(store)
    assert [e["input_token_length"] for e in seen] == list(range(101))  # each exactly once, in order
    assert store.stats() == {"buffered": 0, "dropped": 0, "appended": 101, "resent": 0, "server_restarts": 0}


def test_outage_buffer_is_bounded_and_counts_drops(make_store: StoreFactory, redis_server: RedisServer) -> None:
    store = make_store(buffer_limit=10)
    redis_server.stop()
    store.append_observations([entry(i) for i in range(25)])
    assert store.stats() == {"buffered": 10, "dropped": 15, "appended": 0, "resent": 0, "server_restarts": 0}
    assert wait_until(lambda: "15 dropped" in store.health()["redis"], timeout_s=5)

    redis_server.start()
    assert store.flush(10.0)
    _cursor, kept = read_all(store)
    assert [e["input_token_length"] for e in kept] == list(range(10))  # the oldest accepted ones survive
    stats = store.stats()
    del stats["server_restarts"]  # 0 or 1: whether the writer met the first server before it stopped is a race
    assert stats == {"buffered": 0, "dropped": 15, "appended": 10, "resent": 0}


def test_other_operations_degrade_without_raising_while_redis_is_down(
    make_store: StoreFactory, redis_server: RedisServer
) -> None:
    store = make_store()
    store.publish_model(artifact("kept"))
    redis_server.stop()
    assert store.latest_model() is None
    assert store.model_versions() == []
    with pytest.raises(StoreUnavailable, match="cannot take or renew the training lease: redis unreachable"):
        store.acquire_training_lease("replica-a", 5.0)  # not False: that would read as another holder
    assert store.wait_for_model(1, 0.3) is None
    with pytest.raises(StoreUnavailable, match="cannot publish"):
        store.publish_model(artifact("lost"))
    assert store.health()["redis"].startswith("unreachable")


def test_read_latest_model_tells_an_unreachable_registry_from_an_empty_one(
    make_store: StoreFactory, redis_server: RedisServer
) -> None:
    """latest_model() answers None for both (its callers rely on that); /reload must tell them apart."""
    store = make_store()
    assert store.read_latest_model() is None  # nothing published: no error
    store.publish_model(artifact("kept"))
    assert store.read_latest_model() == (1, artifact("kept"))
    redis_server.stop()
    with pytest.raises(StoreUnavailable, match="unreachable") as raised:
        store.read_latest_model()
    assert str(raised.value).startswith(f"redis at {redis_server.url}: ")
    assert store.latest_model() is None


def test_close_is_idempotent_and_sends_what_is_queued(make_store: StoreFactory) -> None:
    store, reader = make_store(), make_store()
    store.append_observations([entry(i) for i in range(5)])
    store.close()
    store.close()
    assert len(read_all(reader)[1]) == 5


def test_a_store_started_before_redis_connects_once_it_is_up(redis_server: RedisServer) -> None:
    redis_server.stop()
    store = RedisStore(redis_server.url, namespace="late")
    try:
        assert store.health()["redis"].startswith("unreachable")  # known at once, not after a first round
        store.append_observations([entry(i) for i in range(3)])
        redis_server.start()
        assert store.flush(10.0)
        assert wait_until(lambda: store.health() == {"redis": "ok"}, timeout_s=5)
        assert [e["input_token_length"] for e in read_all(store)[1]] == [0, 1, 2]
    finally:
        store.close()


def test_closing_while_redis_is_down_counts_what_is_lost(make_store: StoreFactory, redis_server: RedisServer) -> None:
    store = make_store()
    redis_server.stop()
    store.append_observations([entry(i) for i in range(7)])
    store.close(flush_timeout_s=0.1)
    assert store.stats() == {"buffered": 0, "dropped": 7, "appended": 0, "resent": 0, "server_restarts": 0}


def test_missing_redis_server_skips_locally_but_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    import conftest

    monkeypatch.setattr(conftest, "find_redis_server", lambda: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="redis-server is not installed"):
        conftest.require_redis_server()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="must run, not skip"):
        conftest.require_redis_server()


def test_a_full_outage_buffer_is_one_warning_until_it_has_been_emptied(
    make_store: StoreFactory, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: rows dropped beyond the outage buffer were counted but never logged; one line per row or batch
    would flood the log during an outage, so it is one per time the buffer fills."""
    store = make_store(buffer_limit=10)
    with caplog.at_level(logging.WARNING, logger="leadtime.store"):
        for _outage in range(2):
            redis_server.stop()
            for start in range(0, 40, 4):  # batches, most of them past the cap
                store.append_observations([entry(i) for i in range(start, start + 4)])
            redis_server.start()
            assert store.flush(10.0)  # emptied: the next time it fills is worth a line again
    lines = [r.getMessage() for r in caplog.records if "buffer" in r.getMessage() and "full" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "10 observations" in lines[0] and "dropped" in lines[0] and "store_buffer" in lines[0], lines[0]
    assert store.stats()["dropped"] == 60


def test_a_closed_store_refuses_appends_rather_than_buffer_what_nobody_sends(make_store: StoreFactory) -> None:
    """Rows appended after close went into the writer's buffer, which no thread sends any more: lost, while the
    caller (an ObserveStream open at a stop) was told they were accepted."""
    store = make_store()
    store.close()
    with pytest.raises(StoreClosed):
        store.append_observations([entry(0)])
    assert store.stats()["buffered"] == 0


# ---- rows buffered at a stop, kept in a directory the replica owns -----------------------------------------


def stream_lengths(redis_url: str, namespace: str = "test") -> list[int]:
    """The input lengths of the stream's entries, in order (`entry(i)` numbers them)."""
    raw = redis.Redis.from_url(redis_url)
    try:
        messages: Any = raw.xrange(f"{namespace}:observations")
        return [json.loads(fields[b"e"])["input_token_length"] for _, fields in messages]
    finally:
        raw.close()


def test_rows_buffered_at_a_stop_during_an_outage_are_sent_once_at_the_next_start(
    redis_server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a clean stop (SIGTERM) during a Redis outage flushed for a second, then dropped every buffered
    accepted row ("closed before redis took them: 500 buffered observations dropped"). With a directory it owns
    (--model-dir) the store keeps them there, and the next store started with it sends them first, in order, once."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    store = RedisStore(redis_server.url, namespace="test", spill_dir=model_dir)
    store.append_observations([entry(i) for i in range(10)])
    assert store.flush(5.0)
    redis_server.stop()
    store.append_observations([entry(i) for i in range(10, 2_500)])
    with caplog.at_level(logging.INFO, logger="leadtime.store"):
        store.close(flush_timeout_s=0.1)
    assert store.stats()["dropped"] == 0
    said = [r.getMessage() for r in caplog.records if "closed before redis took them" in r.getMessage()]
    assert len(said) == 1 and "2490 buffered observations kept in" in said[0] and "dropped" not in said[0], said
    redis_server.start()  # empty: only what the first store sent before the outage is gone with it
    again = RedisStore(redis_server.url, namespace="test", spill_dir=model_dir)
    try:
        again.append_observations([entry(2_500)])  # accepted after the start: behind the kept rows
        assert again.flush(10.0)
        assert wait_until(lambda: not list(model_dir.glob("unsent-*")), timeout_s=5)  # gone once Redis took them
        assert stream_lengths(redis_server.url) == list(range(10, 2_501))
    finally:
        again.close()
    third = RedisStore(redis_server.url, namespace="test", spill_dir=model_dir)  # nothing left to send again
    third.close()
    assert stream_lengths(redis_server.url) == list(range(10, 2_501))


def test_kept_rows_read_again_after_a_crash_mid_send_land_once(redis_server: RedisServer, tmp_path: Path) -> None:
    """A replica that crashed while it sent the rows kept at the last stop (the file still there) sends them again
    at its next start: each chunk is sent under an id of its place in the file, and one that had landed is skipped
    (the mark Redis keeps of it), so each row lands once, whether the crash came after every chunk or after one."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    redis_server.stop()
    store = RedisStore(redis_server.url, namespace="test", spill_dir=model_dir)
    store.append_observations([entry(i) for i in range(2_500)])
    store.close(flush_timeout_s=0.0)
    (kept,) = model_dir.glob("unsent-*")
    saved = kept.read_bytes()
    redis_server.start()
    raw = redis.Redis.from_url(redis_server.url)
    for landed in (3, 1):  # chunks of 1,000 rows that had landed at the crash: all three, then only the first
        sender = RedisStore(redis_server.url, namespace="test", spill_dir=model_dir)
        assert sender.flush(10.0)
        sender.close()
        assert not kept.exists() and stream_lengths(redis_server.url) == list(range(2_500))
        kept.write_bytes(saved)  # the crash came before the file was removed
        if landed < 3:  # ... and before the last chunks had landed: neither they nor their marks are there
            keys: Any = raw.keys("test:observations:chunk:*")
            marks = sorted(key for key in keys if not key.endswith(b":0"))
            assert len(marks) == 2
            raw.delete(*marks)
            messages: Any = raw.xrange("test:observations")
            raw.xdel("test:observations", *[entry_id for entry_id, _ in messages[1_000:]])
        again = RedisStore(redis_server.url, namespace="test", spill_dir=model_dir)
        try:
            assert again.flush(10.0)
            assert wait_until(lambda: not kept.exists(), timeout_s=5)
        finally:
            again.close()
        assert stream_lengths(redis_server.url) == list(range(2_500))  # none twice, none lost
        kept.write_bytes(saved)
        raw.delete("test:observations")
        raw.delete(*raw.keys("test:observations:chunk:*"))
    raw.close()


def test_rows_a_hung_server_took_as_the_store_stopped_land_once_when_the_kept_file_is_sent(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Regression: Redis hung (a network blip, a stalled host) while the writer sent a chunk, and the store stopped:
    the send timed out, so the chunk was kept in the file, and the server ran it once it went on. The next start
    sent the file under the file's own chunk ids, and every row of that chunk landed twice. The file keeps the id
    the chunk was sent under, and its rows are sent again under it: Redis skips them if it took them."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    store = RedisStore(redis_server.url, namespace="test", spill_dir=model_dir, socket_timeout_s=0.3)
    store.append_observations([entry(0)])
    assert store.flush(5.0)
    redis_server.pause()
    try:
        store.append_observations([entry(i) for i in range(1, 1_501)])  # a whole chunk of 1,000 in flight, and more
        assert wait_until(lambda: "timeout" in store.health()["redis"].lower(), timeout_s=5)
        store.close(flush_timeout_s=0.0)
        assert len(list(model_dir.glob("unsent-*"))) == 1
    finally:
        redis_server.resume()  # it runs what it was sent before the store gave up
    assert wait_until(lambda: stream_lengths(redis_server.url) == list(range(1_001)), timeout_s=5)
    again = RedisStore(redis_server.url, namespace="test", spill_dir=model_dir)
    try:
        assert again.flush(10.0)
        assert wait_until(lambda: not list(model_dir.glob("unsent-*")), timeout_s=5)
    finally:
        again.close()
    assert stream_lengths(redis_server.url) == list(range(1_501))  # each once, in order


def test_without_a_directory_rows_buffered_at_a_stop_are_dropped_and_counted(
    make_store: StoreFactory, redis_server: RedisServer, tmp_path: Path
) -> None:
    store = make_store()
    redis_server.stop()
    store.append_observations([entry(i) for i in range(7)])
    store.close(flush_timeout_s=0.1)
    assert store.stats()["dropped"] == 7
