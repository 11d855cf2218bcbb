"""The hot-path row parser must build exactly the Vectorizer's matrix and refuse exactly what it refuses."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from features.catalog import ACCELERATORS, MODELS
from features.errors import FeatureError
from features.vectorize import Vectorizer
from predictor.service.rows import RowParser


def random_row(rng: random.Random, extras: bool) -> dict[str, Any]:
    n = rng.randint(0, 8000)
    row: dict[str, Any] = {
        "kv_cache_percentage": rng.random(),
        "input_token_length": n,
        "num_request_waiting": rng.randint(0, 40),
        "num_request_running": rng.randint(0, 200),
        "num_tokens_generated": rng.randint(0, 900),
        "prefix_cache_score": rng.choice([0, 0.0, 1, rng.random()]),
        "pod_type": rng.choice(["", "prefill", "decode"]),
        "prefill_tokens_in_flight": rng.randint(0, 20000),
        "decode_tokens_in_flight": rng.randint(0, 20000),
        "encoder_matched_size": rng.randint(0, 10),
        "encoder_input_size": rng.randint(0, 10),
    }
    if extras:
        row.update(
            endpoint_id=rng.choice(["", "a", "b"]),
            accelerator=rng.choice(["", *ACCELERATORS]),
            model=rng.choice(["", *MODELS]),
            tensor_parallel=rng.choice([1, 2, 4, 8]),
            timeslice_state=rng.choice(["none", "resident", "switching", "parked"]),
            timeslice_wait_ms=rng.choice([0.0, rng.uniform(0, 3000)]),
        )
        if rng.random() < 0.3:
            row["prefix_hit_tokens"] = rng.randint(0, n)
    return row


@pytest.mark.parametrize("extras", [False, True])
def test_matrix_equals_the_vectorizers(extras: bool) -> None:
    rng = random.Random(7)
    rows = [random_row(rng, extras) for _ in range(500)]
    for default in (("h100-sxm", "llama-3.1-8b"), ("h200-sxm", "qwen3-32b")):
        expected = Vectorizer(*default).transform_llmd(rows)
        got = RowParser(*default).parse(rows).X
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)


def test_endpoint_ids_roles_and_accelerators_are_reported() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    base = dict(random_row(random.Random(1), False), pod_type="")
    parsed = parser.parse([dict(base, pod_type="decode"), dict(base, endpoint_id="x", accelerator="l40s")])
    assert parsed.endpoint_ids == ["", "x"]
    assert parsed.roles == ["decode", "both"]
    assert parsed.accelerators == ["h100-sxm", "l40s"]
    assert parser.parse([base]).endpoint_ids is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kv_cache_percentage": float("nan")}, "kv_cache_percentage"),
        ({"kv_cache_percentage": True}, "kv_cache_percentage"),
        ({"input_token_length": None}, "input_token_length"),
        ({"num_request_running": 1.5}, "num_request_running"),
        ({"prefix_cache_score": 1.01}, "prefix_cache_score"),
        ({"pod_type": None}, None),  # null pod_type means "", as in llm-d
        ({"decode_tokens_in_flight": -3}, "decode_tokens_in_flight"),
        ({"tensor_parallel": 0}, "tensor_parallel"),
        ({"model": "gpt-9"}, "model"),
        ({"timeslice_wait_ms": float("inf")}, "timeslice_wait_ms"),
    ],
)
def test_refuses_what_the_feature_rows_refuse(change: dict[str, Any], field: str | None) -> None:
    row = dict(random_row(random.Random(3), False), **change)
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    if field is None:
        parser.parse([row])
        Vectorizer().transform_llmd([row])
        return
    with pytest.raises(FeatureError) as ours:
        parser.parse([row, row], where="requests")
    assert ours.value.field == f"requests[0].{field}"
    with pytest.raises(FeatureError):
        Vectorizer().transform_llmd([row])


def test_integral_floats_are_counts() -> None:
    row = dict(random_row(random.Random(4), False), input_token_length=512.0)
    assert RowParser("h100-sxm", "llama-3.1-8b").parse([row]).X[0, 0] == 512.0


def test_observations_carry_actuals_and_what_was_predicted() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    base = random_row(random.Random(5), True)
    entries = [
        dict(base, actual_ttft_ms=120, actual_tpot_ms=0),
        dict(
            base,
            actual_ttft_ms=0.0,
            actual_tpot_ms=9.5,
            predicted_tpot_ms=10.0,
            predicted_tpot_quantile_ms=12.0,
            timestamp="2026-05-01T10:00:00+02:00",
        ),
    ]
    parsed = parser.parse_observations(entries)
    assert parsed.actual_ttft_ms.tolist() == [120.0, 0.0]
    assert parsed.actual_tpot_ms.tolist() == [0.0, 9.5]
    assert np.isnan(parsed.predicted_tpot_ms[0]) and parsed.predicted_tpot_ms[1] == 10.0
    assert parsed.predicted_tpot_quantile_ms[1] == 12.0
    with pytest.raises(FeatureError) as err:
        parser.parse_observations([entries[0], dict(base, actual_ttft_ms=float("inf"), actual_tpot_ms=0)])
    assert err.value.field == "entries[1].actual_ttft_ms"
    with pytest.raises(FeatureError) as err:
        parser.parse_observations([dict(base, actual_tpot_ms=1.0)])
    assert err.value.field == "entries[0].actual_ttft_ms"


def test_grpc_messages_give_the_same_matrix_as_json_rows() -> None:
    from predictor.client import row_message
    from predictor.grpc.server import row_to_dict

    rng = random.Random(11)
    rows = [random_row(rng, extras=i % 2 == 0) for i in range(300)]
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    from_json = parser.parse(rows, native=True)
    from_messages = parser.parse_messages([row_message(r) for r in rows], row_to_dict)
    np.testing.assert_allclose(from_messages.X, from_json.X, rtol=1e-12, atol=0)
    assert from_messages.endpoint_ids == from_json.endpoint_ids
    assert from_messages.accelerators == from_json.accelerators
    bad = [row_message(rows[1]), row_message(dict(rows[1], kv_cache_percentage=0.5))]
    bad[1].kv_cache_percentage = 1.5
    with pytest.raises(FeatureError) as err:
        parser.parse_messages(bad, row_to_dict)
    assert err.value.field == "rows[1].kv_cache_percentage"
