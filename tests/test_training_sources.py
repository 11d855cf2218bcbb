"""The retraining job's sources: llm-d rows, Leadtime observations, the simulator's log, Parquet, the Redis stream,
each with malformed rows counted by source and line, never dropped silently, and a bound on their share."""

from __future__ import annotations

import gzip
import json
import lzma
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from leadtime.bench.retrain import write_simulator_log
from leadtime.data import MEASURED
from leadtime.features.rows import FeatureRow, Observation, RequestFeatures, observation_to_llmd
from leadtime.predictor.service.rows import RowParser
from leadtime.predictor.store.redis_store import RedisStore, observation_stream_key
from leadtime.training import sources
from leadtime.training.job import _split
from leadtime.training.sources import RedisSource, SampleError, SampleReader, shown
from leadtime.training.split import BY_READ_ORDER, BY_TIMESTAMP, split_recent
from leadtime.training.unread import unread_keys_warning


def llmd_lines(n: int) -> list[str]:
    """The first `n` rows of the shipped sharegpt-h200 measurements (llm-d's own training rows)."""
    with MEASURED["sharegpt-h200"].open() as f:
        return [next(f).strip() for _ in range(n)]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_llmd_rows_with_malformed_lines_counted_by_line(tmp_path: Path) -> None:
    good = llmd_lines(40)
    bad = [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({**json.loads(good[0]), "input_token_length": -3}),
        json.dumps({k: v for k, v in json.loads(good[1]).items() if k != "num_request_waiting"}),
        json.dumps({**json.loads(good[2]), "actual_ttft_ms": 0, "actual_tpot_ms": 0}),
        json.dumps({**json.loads(good[3]), "timestamp": "yesterday"}),
    ]
    path = write_lines(tmp_path / "rows.jsonl", good[:20] + bad + [""] + good[20:])
    samples = SampleReader("h200-sxm", "qwen3-32b", max_malformed_share=0.2).read([str(path)])
    assert len(samples) == 40
    (source,) = samples.sources
    assert (source.read, source.used, source.malformed) == (46, 40, 6)
    assert [(m.where, m.problem.split(" ")[0]) for m in samples.malformed] == [
        ("line 21", "not"),
        ("line 22", "must"),
        ("line 23", "input_token_length:"),
        ("line 24", "num_request_waiting:"),
        ("line 25", "observes"),
        ("line 26", "timestamp:"),
    ]
    assert all(m.source == str(path) for m in samples.malformed)
    # The rows kept are the good ones, in file order, vectorized as the service's parser does.
    expected = RowParser("h200-sxm", "qwen3-32b").parse_observations([json.loads(line) for line in good])
    assert np.array_equal(samples.batch.X, expected.rows.X)
    assert np.array_equal(samples.actual_ttft_ms, expected.actual_ttft_ms)


def test_rows_the_services_poisoning_guard_drops_are_left_out_by_name(tmp_path: Path) -> None:
    """The service drops observations impossible by the roofline or above a day; the job trained on them."""
    good = llmd_lines(60)
    poisoned = [
        json.dumps({**json.loads(good[0]), "actual_ttft_ms": 1e12}),
        json.dumps({**json.loads(good[1]), "actual_ttft_ms": 1e308}),
        json.dumps({**json.loads(good[2]), "actual_ttft_ms": 1e-6}),
    ]
    refused = json.dumps({**json.loads(good[3]), "input_token_length": -3})
    for extra in ([], [refused]):  # a chunk parsed whole, and one parsed entry by entry after the parser refused
        path = write_lines(tmp_path / "rows.jsonl", good[:30] + poisoned + extra + good[30:])
        samples = SampleReader("h200-sxm", "qwen3-32b", max_malformed_share=0.1).read([str(path)])
        assert len(samples) == 60
        implausible = [m for m in samples.malformed if "implausible" in m.problem]
        assert [m.where for m in implausible] == ["line 31", "line 32", "line 33"]
        expected = RowParser("h200-sxm", "qwen3-32b").parse_observations([json.loads(line) for line in good])
        assert np.array_equal(samples.actual_ttft_ms, expected.actual_ttft_ms)
        assert np.array_equal(samples.batch.X, expected.rows.X)


def test_too_large_a_share_of_malformed_rows_stops_the_job(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "rows.jsonl", llmd_lines(10) + ["oops"] * 2)
    with pytest.raises(SampleError, match=r"2 of 12 rows are malformed \(16\.7% > the 10\.0% allowed; first: line 11"):
        SampleReader("h200-sxm", "qwen3-32b", max_malformed_share=0.1).read([str(path)])
    assert len(SampleReader("h200-sxm", "qwen3-32b", max_malformed_share=0.2).read([str(path)])) == 10


def native_observation(i: int, **extra: Any) -> dict[str, Any]:
    """Leadtime's native observation schema: llm-d's fields plus the endpoint, its class, role and time."""
    return {
        "kv_cache_percentage": 0.2,
        "input_token_length": 500 + i,
        "num_request_waiting": i % 3,
        "num_request_running": 4,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.0,
        "prefix_hit_tokens": 100,
        "endpoint_id": f"l40s-{i % 2}",
        "accelerator": "l40s",
        "model": "llama-3.1-8b",
        "role": "prefill",
        "actual_ttft_ms": 80.0 + i,
        "actual_tpot_ms": 0.0,
        "predicted_ttft_ms": 75.0,
        "timestamp": f"2026-11-30T10:00:{i:02d}Z",
        **extra,
    }


def test_leadtime_observations_keep_their_class_role_endpoint_and_time(tmp_path: Path) -> None:
    lines = [json.dumps(native_observation(i)) for i in range(30)]
    lines[7] = json.dumps(native_observation(7, accelerator="a-gpu-nobody-makes"))
    lines[9] = json.dumps(native_observation(9, role="sideways"))
    samples = SampleReader("h100-sxm", "llama-3.1-8b", max_malformed_share=0.1).read(
        [str(write_lines(tmp_path / "o.jsonl", lines))]
    )
    assert len(samples) == 28
    assert [m.where for m in samples.malformed] == ["line 8", "line 10"]
    assert "accelerator" in samples.malformed[0].problem and "role" in samples.malformed[1].problem
    assert set(samples.batch.accelerators) == {"l40s"} and set(samples.batch.roles) == {"prefill"}
    assert samples.batch.endpoint_ids is not None and samples.batch.endpoint_ids[:2] == ["l40s-0", "l40s-1"]
    assert samples.timestamps[0] == pytest.approx(1796032800.0)  # 2026-11-30T10:00:00Z
    assert np.all(np.diff(samples.timestamps) > 0)


def test_the_simulators_observation_log(tmp_path: Path) -> None:
    path = tmp_path / "observations.jsonl"
    rows = write_simulator_log(path, requests=300)
    with path.open("a") as f:
        f.write('{"policy": "llmd_heuristic"}\n')  # a row without any of the fields
    samples = SampleReader("h100-sxm", "llama-3.1-8b", max_malformed_share=0.01).read([str(path)])
    assert len(samples) == rows == 300
    assert [(m.where, m.problem) for m in samples.malformed] == [("line 301", "actual_ttft_ms: is required")]
    assert set(samples.batch.accelerators) == {"h100-sxm", "a100-sxm-80gb", "l40s"}  # the mixed fleet
    assert np.isfinite(samples.timestamps).all()
    split = split_recent(samples.timestamps, 0.2)
    assert split.basis == BY_TIMESTAMP and len(split.evaluation) == 60
    assert samples.timestamps[split.history].max() <= samples.timestamps[split.evaluation].min()


def test_parquet_rows_with_nulls_and_a_malformed_row(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in llmd_lines(12)]
    rows[3]["num_request_running"] = -1  # malformed
    for row in rows[:6]:  # a column only some rows fill: null elsewhere
        row["endpoint_id"] = "h200-a"
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    samples = SampleReader("h200-sxm", "qwen3-32b", max_malformed_share=0.1).read([str(path)])
    assert len(samples) == 11 and samples.sources[0].kind == "parquet"
    assert [(m.where, m.problem.split(":")[0]) for m in samples.malformed] == [("row 4", "num_request_running")]
    assert samples.batch.endpoint_ids is not None
    assert samples.batch.endpoint_ids[:6] == ["h200-a"] * 5 + [""]


@pytest.mark.parametrize("zone", [None, "UTC", "Europe/Berlin"])
def test_a_parquet_timestamp_column_is_read_as_its_moment(tmp_path: Path, zone: str | None) -> None:
    """Parquet writers store times as timestamps, not as the numbers or RFC 3339 text of JSON: every row was
    refused ("timestamp: must be a number, got datetime.datetime(...)"). A time without a zone is UTC."""
    rows = [json.loads(line) for line in llmd_lines(6)]
    epoch = 1796032800  # 2026-11-30T10:00:00Z
    table = pa.Table.from_pylist(rows).append_column(
        "timestamp", pa.array([(epoch + 60 * i) * 1_000_000 for i in range(6)], pa.timestamp("us", tz="UTC"))
    )
    if zone != "UTC":
        kind = pa.timestamp("us", tz=zone) if zone else pa.timestamp("us")
        table = table.set_column(table.num_columns - 1, "timestamp", table.column("timestamp").cast(kind))
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)
    samples = SampleReader("h200-sxm", "qwen3-32b").read([str(path)])
    assert len(samples) == 6 and not samples.malformed
    assert samples.timestamps.tolist() == [float(epoch + 60 * i) for i in range(6)]


def test_a_parquet_timestamp_beyond_pythons_years_is_one_malformed_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: one Parquet row timestamped in the year 10000 stopped `leadtime retrain` with a 72-line
    OverflowError traceback (exit status 1), where a bad timestamp is to be left out and reported like any other
    malformed row. The other rows of its batch, and of the batches after it, are read as usual."""
    monkeypatch.setattr(sources, "_CHUNK", 50)  # the bad row in the second of several batches
    rows = [json.loads(line) for line in llmd_lines(200)]
    epoch = 1796032800  # 2026-11-30T10:00:00Z
    stamps = [epoch + 60 * i for i in range(200)]
    stamps[55] = 253402300800  # 10000-01-01T00:00:00Z: within Arrow's range, beyond Python's datetime
    table = pa.Table.from_pylist(rows).append_column("timestamp", pa.array(stamps, pa.timestamp("s")))
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)
    samples = SampleReader("h200-sxm", "qwen3-32b").read([str(path)])
    (source,) = samples.sources
    assert (source.read, source.used, source.malformed) == (200, 199, 1)
    assert [(m.where, m.problem) for m in samples.malformed] == [
        ("row 56", "timestamp: cannot be read (date value out of range)")
    ]
    assert samples.timestamps.tolist() == [float(s) for i, s in enumerate(stamps) if i != 55]


def test_a_csv_source_is_refused_as_csv(tmp_path: Path) -> None:
    """It was read as JSONL: "line 1: not JSON (Expecting value)"."""
    path = tmp_path / "rows.csv"
    path.write_text("actual_ttft_ms,actual_tpot_ms\n10,2\n")
    with pytest.raises(SampleError, match=r"rows\.csv: a CSV file; sources are JSONL or Parquet"):
        SampleReader("h200-sxm", "qwen3-32b").read([str(path)])


def test_a_file_that_is_not_parquet_is_one_clear_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "rows.parquet", llmd_lines(3))
    with pytest.raises(SampleError, match=r"rows\.parquet: not a Parquet file"):
        SampleReader("h200-sxm", "qwen3-32b").read([str(path)])


def test_the_services_redis_stream_with_foreign_and_broken_messages(redis_url: str) -> None:
    entries = [
        observation_to_llmd(Observation(FeatureRow(RequestFeatures(100 + i)), actual_ttft_ms=20.0 + i))
        for i in range(50)
    ]
    store = RedisStore(redis_url, namespace="fleet-a")
    try:
        store.append_observations(entries[:25])
        assert store.flush()
        client = redis.Redis.from_url(redis_url)
        key = observation_stream_key("fleet-a")
        client.xadd(key, {"other": "field"})  # some other writer's message
        client.xadd(key, {"e": b"{broken"})
        store.append_observations(entries[25:])
        assert store.flush()
        newest: Any = client.xrevrange(key, count=1)
        last_id = newest[0][0].decode()
        client.close()
    finally:
        store.close()
    spec = f"{redis_url}?namespace=fleet-a"
    samples = SampleReader("h100-sxm", "llama-3.1-8b", max_malformed_share=0.05).read([spec])
    assert len(samples) == 50
    assert np.array_equal(samples.actual_ttft_ms, [20.0 + i for i in range(50)])
    (source,) = samples.sources
    assert (source.kind, source.read, source.malformed, source.cursor) == ("redis", 52, 2, last_id)
    assert [m.problem.split(" (")[0] for m in samples.malformed] == ["no 'e' field", "not JSON"]
    assert all(m.where.startswith("entry ") for m in samples.malformed)
    # The service's own namespace holds nothing here.
    with pytest.raises(SampleError, match="holds no rows"):
        SampleReader("h100-sxm", "llama-3.1-8b").read([redis_url])


def test_redis_source_names_hide_credentials() -> None:
    source = RedisSource.parse("redis://user:secret@10.0.0.5:6379/2?namespace=a&socket_timeout=3")
    assert source.url == "redis://user:secret@10.0.0.5:6379/2?socket_timeout=3"
    assert "secret" not in source.name and source.namespace == "a"


@pytest.mark.parametrize(
    "url",
    [
        "unix:///run/r.sock?password=s3cret-pw",  # a socket's URL has no user part: its password is a parameter
        "redis://127.0.0.1:6379/0?password=s3cret-pw&namespace=a",
        "redis://127.0.0.1:6379/0?username=s3cret-pw&password=s3cret-pw",
        "rediss://127.0.0.1:6380/0?ssl_password=s3cret-pw",  # the TLS key file's password
        "redis://127.0.0.1:6379/0?pass%77ord=s3cret-pw",  # redis-py decodes the parameter's name
        "redis://127.0.0.1:6379/0?PASSWORD=s3cret-pw",
    ],
)
def test_a_password_given_as_a_query_parameter_is_not_shown(url: str) -> None:
    """Only a password in the URL's user part was left out: one given as `?password=` (the only way for a Unix
    socket) was written into the artifact's metadata, the report and the printed result."""
    source = RedisSource.parse(url)
    assert "s3cret" not in source.name, source.name
    assert "s3cret" not in shown(url) and "s3cret" not in shown(source.url)
    kept = RedisSource.parse("unix:///run/r.sock?password=pw&db=2&socket_timeout=3")
    assert kept.name == "unix:///run/r.sock?db=2&socket_timeout=3 (leadtime)"  # where and how, not who


def test_a_password_holding_a_question_mark_is_not_cut_there_nor_shown() -> None:
    """The query was split off at the first '?': one in the password cut it there, and what followed was taken as
    query parameters and shown in the source's name."""
    source = RedisSource.parse("redis://:pa?ss#wd@10.0.0.5:6379/2?namespace=a")
    assert (source.url, source.namespace) == ("redis://:pa?ss#wd@10.0.0.5:6379/2", "a")
    assert source.name == "redis://10.0.0.5:6379/2 (a)"
    with pytest.raises(SampleError) as raised:
        SampleReader("h100-sxm", "llama-3.1-8b").read(["redis://:pa?ss#wd@127.0.0.1:6379/0"])
    assert "percent-encode" in str(raised.value) and "ss" not in str(raised.value).split("(")[0]
    assert not any(part in str(raised.value) for part in ("pa?", "ss#", "wd@")), raised.value


def test_sources_join_in_time_order_only_when_every_row_has_a_timestamp(tmp_path: Path) -> None:
    early = [json.dumps(native_observation(i)) for i in range(0, 20, 2)]
    late = [json.dumps(native_observation(i)) for i in range(1, 20, 2)]
    a, b = write_lines(tmp_path / "a.jsonl", early), write_lines(tmp_path / "b.jsonl", late)
    samples = SampleReader("h100-sxm", "llama-3.1-8b").read([str(a), str(b)])
    assert samples.source.tolist() == [0] * 10 + [1] * 10
    split = _split(samples, 0.25)  # as the job splits them: each row's source known
    ordered = np.concatenate([split.history, split.evaluation])
    assert samples.actual_ttft_ms[ordered].tolist() == [80.0 + i for i in range(20)]  # interleaved by time
    no_time = write_lines(tmp_path / "c.jsonl", llmd_lines(4))
    mixed = SampleReader("h100-sxm", "llama-3.1-8b").read([str(a), str(no_time)])
    assert split_recent(mixed.timestamps, 0.25).basis == BY_READ_ORDER


def test_a_source_whose_router_clock_runs_ahead_is_split_in_read_order_and_named(tmp_path: Path) -> None:
    """One file of a router an hour ahead, beside one of a router with a right clock: its rows are not judged on for
    being stamped later, and the split names the file whose timestamps disagree with the order they arrived in."""
    rows = [native_observation(i) for i in range(20)]
    rows[5]["timestamp"] = "2026-11-30T11:00:05Z"  # an hour ahead, as its router stamped it
    a = write_lines(tmp_path / "a.jsonl", [json.dumps(native_observation(i)) for i in range(20)])
    b = write_lines(tmp_path / "b.jsonl", [json.dumps(row) for row in rows])
    samples = SampleReader("h100-sxm", "llama-3.1-8b").read([str(a), str(b)])
    split = _split(samples, 0.25)
    assert split.basis == BY_READ_ORDER and "b.jsonl" in split.reason, split.reason
    assert split.evaluation.tolist() == list(range(30, 40))


def test_a_gzip_compressed_jsonl_source_is_read_as_its_rows(tmp_path: Path) -> None:
    """It was read as JSONL: "656 of 656 rows are malformed ... not JSON (UnicodeDecodeError)"."""
    lines = llmd_lines(40)
    plain = write_lines(tmp_path / "rows.jsonl", lines)
    packed = tmp_path / "rows.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    reader = SampleReader("h200-sxm", "qwen3-32b")
    samples, expected = reader.read([str(packed)]), reader.read([str(plain)])
    assert len(samples) == 40 and samples.sources[0].kind == "jsonl" and not samples.malformed
    assert np.array_equal(samples.batch.X, expected.batch.X)
    assert np.array_equal(samples.actual_ttft_ms, expected.actual_ttft_ms)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    with pytest.raises(SampleError, match=r"^.*cut\.jsonl\.gz: a gzip file that cannot be read \("):
        reader.read([str(cut)])


def test_a_source_compressed_otherwise_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl.xz"
    path.write_bytes(lzma.compress("\n".join(llmd_lines(5)).encode()))
    with pytest.raises(SampleError, match=r"rows\.jsonl\.xz: compressed with xz, which is not read \(decompress it"):
        SampleReader("h200-sxm", "qwen3-32b").read([str(path)])


def test_keys_the_job_does_not_read_are_counted_per_source_with_the_field_they_may_be_a_slip_for(
    tmp_path: Path,
) -> None:
    """Regression: a log whose class field was misspelt (`accelerater`) in every row was read as "20 rows used (0
    malformed)", every row taken as the default class. Extra keys ride along (the simulator's `policy`), but the
    job says which it did not read, in how many rows, and what a near-miss may have meant (not the `policy` that
    Leadtime's own simulator log carries)."""
    rows = []
    for i in range(20):
        row = native_observation(i, policy="llmd_heuristic")
        if i < 15:
            row["accelerater"] = row.pop("accelerator")
        if i % 2:
            row["actual_e2e_ms"] = 900.0  # an extra of the simulator's: no near-miss of a field the job reads
        rows.append(row)
    path = write_lines(tmp_path / "typo.jsonl", [json.dumps(row) for row in rows])
    samples = SampleReader("h100-sxm", "llama-3.1-8b").read([str(path)])
    assert len(samples) == 20 and samples.malformed_total == 0
    assert samples.sources[0].unread == {"accelerater": 15, "actual_e2e_ms": 10}  # `policy`: the simulator's own
    line = unread_keys_warning(samples.sources)
    assert line is not None
    assert "`accelerater` in 15 rows (did you mean `accelerator`?)" in line, line
    assert "`actual_e2e_ms` in 10 rows" in line and "policy" not in line, line
    assert "did you mean `actual" not in line, line
    assert line.index("accelerater") < line.index("actual_e2e_ms")  # the likely slip first
    clean = write_lines(tmp_path / "clean.jsonl", [json.dumps(native_observation(i)) for i in range(5)])
    read = SampleReader("h100-sxm", "llama-3.1-8b").read([str(clean)])
    assert read.sources[0].unread == {} and unread_keys_warning(read.sources) is None
