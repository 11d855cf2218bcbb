"""The msgspec decoder of plain llm-d bodies must agree with the general path, and leave it all else."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import orjson
import pytest
from test_service_rows import random_row

from leadtime.predictor.service.bulk_decode import decode_plain_bulk
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
        {"timestamp": 1767225600},  # a field only the general path checks
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
