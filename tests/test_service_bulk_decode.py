"""The msgspec decoder of plain llm-d bodies must agree with the general path, and leave it all else."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import orjson
import pytest
from test_service_rows import random_row

from predictor.service.bulk_decode import decode_plain_bulk
from predictor.service.rows import RowParser

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
