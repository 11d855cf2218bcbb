"""The msgspec decoder of plain llm-d bodies must agree with the general path, and leave it all else."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import orjson
import pytest
from test_service_rows import random_row

from leadtime.predictor.service.bulk_decode import decode_plain_bulk
from leadtime.predictor.service.edge import list_field
from leadtime.predictor.service.rows import RowParser

PARSER = RowParser("h200-sxm", "qwen3-32b")


def plain_or_none(body: bytes, max_rows: int = 10_000) -> Any:
    plain = decode_plain_bulk(body, max_rows)
    return None if plain is None else PARSER.parse_plain(*plain)


def test_plain_bodies_give_the_general_paths_matrix_bit_for_bit() -> None:
    rng = random.Random(3)
    for _ in range(30):
        rows = [random_row(rng, extras=False) for _ in range(rng.randint(1, 120))]
        for row in rows:  # llm-d may leave the optional fields out, or send pod_type null
            for name in ("pod_type", "prefill_tokens_in_flight", "encoder_input_size"):
                if rng.random() < 0.2:
                    del row[name]
            if rng.random() < 0.1:
                row["pod_type"] = None
        fast = plain_or_none(orjson.dumps({"requests": rows}))
        assert fast is not None
        general = PARSER.parse(rows)
        np.testing.assert_array_equal(fast.X, general.X)
        assert fast.endpoint_ids is None and fast.accelerators == general.accelerators


@pytest.mark.parametrize(
    "change",
    [
        {"input_token_length": 48.0},  # an integral float: the general path accepts it as a count
        {"input_token_length": -1},
        {"input_token_length": True},
        {"input_token_length": 2**53 + 1},
        {"kv_cache_percentage": 1.5},
        {"prefix_cache_score": "0.5"},
        {"pod_type": "mixed"},
        {"endpoint_id": "pod-a"},  # a Leadtime extra
        {"something_new": 1},  # an unknown key, which the general path ignores
    ],
)
def test_anything_but_a_plain_body_is_left_to_the_general_path(change: dict[str, Any]) -> None:
    row = dict(random_row(random.Random(5), extras=False), **change)
    assert decode_plain_bulk(orjson.dumps({"requests": [row]}), 10) is None


@pytest.mark.parametrize("body", [b"", b"not json", b"[]", b'{"requests": []}', b'{"requests": {}}', b"{}"])
def test_bodies_that_are_not_plain_batches_are_left_to_the_general_path(body: bytes) -> None:
    assert decode_plain_bulk(body, 10) is None


def test_more_rows_than_allowed_are_left_to_the_general_path() -> None:
    rows = [random_row(random.Random(i), extras=False) for i in range(3)]
    assert decode_plain_bulk(orjson.dumps({"requests": rows}), 3) is not None
    assert decode_plain_bulk(orjson.dumps({"requests": rows}), 2) is None


def training_entries(n: int, seed: int = 4) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    entries = []
    for i in range(n):
        entry = random_row(rng, extras=False)
        entry.update(actual_ttft_ms=rng.uniform(1, 900) if i % 2 else 0, actual_tpot_ms=0.0 if i % 2 else 12)
        entries.append(entry)
    return entries


def test_plain_training_bodies_give_the_general_paths_actuals() -> None:
    from leadtime.predictor.service.bulk_decode import decode_plain_training

    entries = training_entries(120)
    actuals = decode_plain_training(orjson.dumps({"entries": entries}), 256)
    assert actuals is not None
    general = PARSER.parse_observations(entries)
    np.testing.assert_array_equal(actuals[:, 0], general.actual_ttft_ms)
    np.testing.assert_array_equal(actuals[:, 1], general.actual_tpot_ms)


@pytest.mark.parametrize(
    "change",
    [
        {"actual_ttft_ms": -1.0},
        {"actual_tpot_ms": "3"},
        {"timestamp": "yesterday"},  # a bad timestamp: the general path names it
        {"timestamp": True},
        {"timestamp": {"seconds": 1767225600}},
        {"predicted_ttft_ms": 12.0},
        {"endpoint_id": "pod-a"},
        {"kv_cache_percentage": 7},
    ],
)
def test_training_entries_that_are_not_plain_are_left_to_the_general_path(change: dict[str, Any]) -> None:
    from leadtime.predictor.service.bulk_decode import decode_plain_training

    entries = training_entries(3)
    entries[1].update(change)
    assert decode_plain_training(orjson.dumps({"entries": entries}), 256) is None


def test_infinite_actuals_and_oversized_training_batches_are_left_to_the_general_path() -> None:
    from leadtime.predictor.service.bulk_decode import decode_plain_training

    body = orjson.dumps({"entries": training_entries(2)}).replace(b'"actual_tpot_ms":12', b'"actual_tpot_ms":1e400', 1)
    assert b"1e400" in body and decode_plain_training(body, 256) is None
    assert decode_plain_training(orjson.dumps({"entries": training_entries(3)}), 2) is None
    assert decode_plain_training(b'{"entries": []}', 256) is None


# Timestamps as JSON text: those `parse_timestamp` (so the general path) takes, and those it refuses.
GOOD_TIMESTAMPS = [
    b'"2026-12-05T05:47:01.123456789Z"',  # Go's RFC3339Nano, what llm-d's client sends
    b'"2026-12-05T05:47:01.1Z"',  # RFC3339Nano drops trailing zeros
    b'"2026-12-05T05:47:01Z"',
    b'"0001-01-01T00:00:00Z"',  # Go's zero time
    b'"0001-01-01T00:00:00+01:00"',  # before year 1 in UTC
    b'"9999-12-31T23:59:59-01:00"',  # after year 9999 in UTC
    b'"2026-12-05T11:17:01.123456789+05:30"',
    b'"2026-12-05T05:47:01-08:00"',
    b'"2026-12-05 05:47:01.5"',  # no zone: UTC
    b'"1767225600"',
    b'"1767225600.25"',
    b"1767225600",
    b"1767225600.125",
    b"1767225600000",  # beyond 2e10: milliseconds
    b"253402300799000",  # the last millisecond of year 9999
    b"253402300800",  # past the last second of year 9999, but beyond 2e10: milliseconds (1978)
    b"0",
    b"-0",
    b"-5",
    b"-1767225600000",
    b"null",
]
BAD_TIMESTAMPS = [
    b'"garbage"',
    b'""',
    b'"NaN"',
    b'"nan"',
    b'"inf"',
    b'"-Infinity"',
    b'"1e20"',
    b'"2026-13-01T00:00:00Z"',
    b'"2026-12-05T25:00:00Z"',
    b'"2026-12-05T05:47:01.123456789+25:00"',
    b"1e20",
    b"-1e20",
    b"253402300799001",
    b"100000000000000000000000000000",  # beyond 64 bits: an int to msgspec, a float to orjson
    b"1e400",  # infinite: no JSON to orjson
    b"true",
    b"false",
    b'{"seconds": 1767225600}',
    b"[1767225600]",
]


def general_actuals(body: bytes) -> tuple[np.ndarray, np.ndarray] | None:
    """What the route makes of a training body (JSON, the list, the entries' checks), or None if it refuses it."""
    try:
        entries = list_field(orjson.loads(body), "entries", 0, 10_000)
        parsed = PARSER.parse_observations(entries)
    except Exception:  # the route answers an error, whichever
        return None
    return parsed.actual_ttft_ms, parsed.actual_tpot_ms


def with_timestamps(entries: list[dict[str, Any]], stamps: list[bytes | None]) -> bytes:
    """The training body of `entries`, each with the JSON text of its timestamp (None: no timestamp key)."""
    parts = []
    for entry, stamp in zip(entries, stamps, strict=True):
        text = orjson.dumps(entry)
        parts.append(text if stamp is None else text[:-1] + b',"timestamp":' + stamp + b"}")
    return b'{"entries":[' + b",".join(parts) + b"]}"


@pytest.mark.parametrize("stamp", GOOD_TIMESTAMPS + BAD_TIMESTAMPS)
def test_a_timestamp_is_taken_exactly_when_the_general_path_takes_it(stamp: bytes) -> None:
    from leadtime.predictor.service.bulk_decode import decode_plain_training

    entries = training_entries(3)
    body = with_timestamps(entries, [None, stamp, b'"2026-12-05T05:47:01.123456789Z"'])
    fast, general = decode_plain_training(body, 256), general_actuals(body)
    assert (fast is not None) == (general is not None) == (stamp in GOOD_TIMESTAMPS)
    if fast is not None and general is not None:
        np.testing.assert_array_equal(fast[:, 0], general[0])
        np.testing.assert_array_equal(fast[:, 1], general[1])


def random_timestamp(rng: random.Random) -> bytes:
    """An RFC 3339 text as Go writes one (any zone, 0-9 fraction digits), or an epoch number, or null."""
    when = rng.uniform(-62_135_596_800 + 86_400, 253_402_300_799 - 86_400)  # a day inside years 1..9999
    kind = rng.randrange(4)
    if kind == 3:
        return b"null"
    if kind == 2:
        return orjson.dumps(rng.choice([when, int(when), int(when * 1000), str(int(when))]))
    offset = rng.randint(-14 * 60, 14 * 60)
    moment = datetime.fromtimestamp(when, UTC) + timedelta(minutes=offset)
    zone = "Z" if kind == 0 else f"{'+-'[offset < 0]}{abs(offset) // 60:02d}:{abs(offset) % 60:02d}"
    digits = rng.randint(0, 9)
    fraction = f".{rng.randrange(10**digits):0{digits}d}" if digits else ""
    return f'"{moment:%Y-%m-%dT%H:%M:%S}{fraction}{zone}"'.encode()


def test_random_timestamped_bodies_are_taken_exactly_when_the_general_path_takes_them() -> None:
    from leadtime.predictor.service.bulk_decode import decode_plain_training

    rng = random.Random(11)
    taken = refused = 0
    for seed in range(150):
        entries = training_entries(rng.randint(1, 60), seed)
        stamps: list[bytes | None] = [
            rng.choice([None, random_timestamp(rng), rng.choice(GOOD_TIMESTAMPS)]) for _ in entries
        ]
        if rng.random() < 0.4:  # one bad timestamp anywhere spoils the body for both paths
            stamps[rng.randrange(len(stamps))] = rng.choice(BAD_TIMESTAMPS)
        body = with_timestamps(entries, stamps)
        fast, general = decode_plain_training(body, 256), general_actuals(body)
        assert (fast is None) == (general is None), body
        if fast is not None and general is not None:
            taken += 1
            np.testing.assert_array_equal(fast[:, 0], general[0])
            np.testing.assert_array_equal(fast[:, 1], general[1])
        else:
            refused += 1
    assert taken > 40 and refused > 40


def test_a_timestamped_llmd_batch_takes_the_fast_path() -> None:
    """llm-d's Go client stamps every entry (RFC3339Nano); such a batch must not fall to the general path."""
    from leadtime.predictor.service.bulk_decode import decode_plain_training

    entries = training_entries(200)
    start = datetime(2026, 12, 5, 5, 47, 1, tzinfo=UTC)
    for i, entry in enumerate(entries):
        entry["timestamp"] = f"{start + timedelta(milliseconds=97 * i):%Y-%m-%dT%H:%M:%S.%f}123Z"
    actuals = decode_plain_training(orjson.dumps({"entries": entries}), 256)
    assert actuals is not None
    np.testing.assert_array_equal(actuals[:, 0], PARSER.parse_observations(entries).actual_ttft_ms)
