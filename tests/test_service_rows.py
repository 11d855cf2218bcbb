"""The hot-path row parser must build exactly the Vectorizer's matrix and refuse exactly what it refuses."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from leadtime.features.catalog import ACCELERATORS, MODELS
from leadtime.features.errors import FeatureError
from leadtime.features.vectorize import COLUMNS, Vectorizer
from leadtime.predictor.service.rows import RowParser, _dict_columns


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
    from leadtime.predictor.client import row_message
    from leadtime.predictor.grpc.server import row_to_dict

    rng = random.Random(11)
    rows = [random_row(rng, extras=i % 2 == 0) for i in range(300)]
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    from_json = parser.parse(rows)
    from_messages = parser.parse_messages([row_message(r) for r in rows], row_to_dict)
    np.testing.assert_allclose(from_messages.X, from_json.X, rtol=1e-12, atol=0)
    assert from_messages.endpoint_ids == from_json.endpoint_ids
    assert from_messages.accelerators == from_json.accelerators
    bad = [row_message(rows[1]), row_message(dict(rows[1], kv_cache_percentage=0.5))]
    bad[1].kv_cache_percentage = 1.5
    with pytest.raises(FeatureError) as err:
        parser.parse_messages(bad, row_to_dict)
    assert err.value.field == "rows[1].kv_cache_percentage"


# --- The column-wise path (whole batches of plain llm-d rows) against the row-by-row one --------------------


def plain_rows(n: int, seed: int = 21) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_row(rng, extras=False) for _ in range(n)]


def row_by_row(parser: RowParser, rows: list[Any], native: bool = False) -> np.ndarray:
    return parser._parse_rows(rows, "requests", native).X


def takes_column_path(parser: RowParser, rows: list[Any]) -> bool:
    columns = _dict_columns(rows)
    return columns is not None and parser._parse_plain(columns) is not None


def error_of(call: Any) -> tuple[str, str]:
    with pytest.raises(FeatureError) as err:
        call()
    return err.value.field, err.value.problem


def test_column_path_is_bitwise_the_row_path() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = plain_rows(300)
    # Some rows leave optional fields out, and one carries a key nobody knows: still column-wise.
    for row in rows[::7]:
        del row["encoder_input_size"], row["pod_type"]
    rows[5]["something_new"] = [1, 2]
    rows[6]["pod_type"] = None
    assert takes_column_path(parser, rows)
    got = parser.parse(rows).X
    assert got.flags.c_contiguous
    assert np.array_equal(got.view(np.int64), row_by_row(parser, rows).view(np.int64))
    np.testing.assert_allclose(got, Vectorizer("h100-sxm", "llama-3.1-8b").transform_llmd(rows), rtol=1e-12, atol=0)


def test_mixed_batches_go_row_by_row_and_agree() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rng = random.Random(22)
    rows = [random_row(rng, extras=i % 10 == 3) for i in range(200)]
    assert not takes_column_path(parser, rows)
    parsed = parser.parse(rows)
    np.testing.assert_allclose(parsed.X, Vectorizer("h100-sxm", "llama-3.1-8b").transform_llmd(rows), rtol=1e-12)
    # The plain rows of a mixed batch get the same values as in a plain batch.
    plain = [i for i in range(200) if i % 10 != 3]
    alone = parser.parse([rows[i] for i in plain]).X
    assert np.array_equal(parsed.X[plain], alone)


def test_a_huge_batch_parses_column_wise() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = plain_rows(10_000, seed=23)
    assert takes_column_path(parser, rows)
    got = parser.parse(rows)
    assert got.X.shape == (10_000, len(COLUMNS)) and got.endpoint_ids is None
    assert got.accelerators == ["h100-sxm"] * 10_000
    assert np.array_equal(got.X, row_by_row(parser, rows))
    rows[9_999]["kv_cache_percentage"] = 2.0
    assert error_of(lambda: parser.parse(rows))[0] == "requests[9999].kv_cache_percentage"


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("num_request_waiting", True, "must be an integer ≥ 0, got True"),
        ("input_token_length", False, "must be an integer ≥ 0, got False"),
        ("kv_cache_percentage", True, "must be a number, got True"),
        ("prefix_cache_score", False, "must be a number, got False"),
        ("num_request_running", 1.5, "must be an integer ≥ 0, got 1.5"),
        ("encoder_matched_size", -1, "must be ≥ 0, got -1"),
        ("decode_tokens_in_flight", "12", "must be an integer ≥ 0, got '12'"),
        ("input_token_length", None, "is required"),
        ("prefill_tokens_in_flight", None, "must be an integer ≥ 0, got null"),  # optional: null is a bad value
        ("kv_cache_percentage", 1.5, "must be between 0 and 1, got 1.5"),
        ("kv_cache_percentage", float("nan"), "must be finite, got nan"),
        ("prefix_cache_score", -0.25, "must be between 0 and 1, got -0.25"),
        ("pod_type", "gpu", "must be '', 'both', 'prefill' or 'decode', got 'gpu'"),
        ("pod_type", 1, "must be '', 'both', 'prefill' or 'decode', got 1"),
        ("num_tokens_generated", 2**53 + 1, "must be ≤ 2**53, got a 16-digit number"),
        ("num_tokens_generated", 10**400, "must be ≤ 2**53, got a 401-digit number"),
    ],
)
def test_a_bad_value_in_a_plain_batch_is_named_with_its_index(field: str, value: Any, problem: str) -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = plain_rows(100)
    rows[57][field] = value
    assert error_of(lambda: parser.parse(rows)) == (f"requests[57].{field}", problem)
    entries = [dict(r, actual_ttft_ms=1, actual_tpot_ms=0) for r in rows]
    assert error_of(lambda: parser.parse_observations(entries))[0] == f"entries[57].{field}"


def test_a_missing_required_field_is_named_with_its_index() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = plain_rows(100)
    del rows[41]["num_request_running"]
    assert error_of(lambda: parser.parse(rows)) == ("requests[41].num_request_running", "is required")
    mixed: list[Any] = plain_rows(100)
    mixed[3] = [1, 2, 3]
    assert error_of(lambda: parser.parse(mixed)) == ("requests[3]", "must be a JSON object, got list")


def test_values_the_row_checks_accept_give_the_same_matrix() -> None:
    """Integral floats in counts, numpy scalars, 2**53: not column-wise, but accepted exactly as before."""
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    for field, value in [
        ("input_token_length", 512.0),
        ("num_request_waiting", np.int64(3)),
        ("kv_cache_percentage", np.float64(0.5)),
        ("input_token_length", 2**53),
        ("kv_cache_percentage", -0.0),
    ]:
        rows = plain_rows(20)
        rows[9][field] = value
        got = parser.parse(rows).X
        assert np.array_equal(got, row_by_row(parser, rows)), field
        expected = Vectorizer("h100-sxm", "llama-3.1-8b").transform_llmd(rows)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)


def test_plain_grpc_messages_parse_column_wise() -> None:
    from leadtime.predictor.client import row_message
    from leadtime.predictor.grpc.server import row_to_dict
    from leadtime.predictor.service.rows import _message_columns

    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = plain_rows(100, seed=24)
    messages = [row_message(r) for r in rows]
    assert _message_columns(messages) is not None
    got = parser.parse_messages(messages, row_to_dict)
    assert np.array_equal(got.X, parser.parse(rows).X)
    messages[30].tensor_parallel = 2  # an extra: the batch goes row by row
    assert _message_columns(messages) is None
    assert parser.parse_messages(messages, row_to_dict).X[30, COLUMNS.index("tensor_parallel")] == 2.0
    messages[30].tensor_parallel = 0
    messages[77].input_token_length = 2**53 + 1  # uint64 allows it; the JSON rows' limit holds here too
    expected = ("rows[77].input_token_length", "must be ≤ 2**53, got a 16-digit number")
    assert error_of(lambda: parser.parse_messages(messages, row_to_dict)) == expected


def test_observation_columns_equal_the_entry_checks() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rng = random.Random(25)
    entries = [
        dict(r, actual_ttft_ms=rng.choice([0, 12.5, 300]), actual_tpot_ms=rng.choice([0, 7]), timestamp=1.7e9 + i)
        for i, r in enumerate(plain_rows(600, seed=25))
    ]
    entries[10]["predicted_ttft_ms"] = 11.0
    entries[11]["timestamp"] = "2026-05-01T10:00:00Z"
    parsed = parser.parse_observations(entries)
    predicted = np.full((600, 4), np.nan)
    checked = np.array(parser._entry_actuals(entries, predicted, "entries"))
    assert np.array_equal(parsed.actual_ttft_ms, checked[:, 0])
    assert np.array_equal(parsed.actual_tpot_ms, checked[:, 1])
    assert np.array_equal(parsed.predicted_ttft_ms, predicted[:, 0], equal_nan=True)
    assert parsed.predicted_ttft_ms[10] == 11.0 and np.isnan(parsed.predicted_tpot_ms).all()
    assert np.array_equal(parsed.rows.X, parser.parse(entries).X)
    for field, value, problem in [
        ("actual_tpot_ms", True, "must be a number, got True"),
        ("actual_ttft_ms", float("nan"), "must be finite, got nan"),
        ("predicted_tpot_ms", -1.0, "must be between 0 and 1e+12, got -1"),
        ("predicted_ttft_ms", 1.7e308, "must be between 0 and 1e+12, got 1.7e+308"),  # above what is ever served
        ("timestamp", "yesterday", "must be RFC 3339 or seconds since the epoch, got 'yesterday'"),
    ]:
        bad = [dict(e) for e in entries]
        bad[444][field] = value
        assert error_of(lambda b=bad: parser.parse_observations(b)) == (f"entries[444].{field}", problem)


def test_hardware_groups_added_from_many_threads_agree() -> None:
    from concurrent.futures import ThreadPoolExecutor

    rows = [dict(r, accelerator=a) for r in plain_rows(50, seed=26) for a in sorted(ACCELERATORS)[:4]]
    expected = RowParser("h100-sxm", "llama-3.1-8b").parse(rows).X
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: parser.parse(rows).X, range(16)))
    assert all(np.array_equal(x, expected) for x in results)


def test_observations_checked_in_slices_concatenate_to_the_whole_batch() -> None:
    from leadtime.predictor.service.rows import ParsedObservations

    rng = random.Random(11)
    entries = []
    for i in range(150):
        entry = random_row(rng, extras=i % 3 == 0)
        entry.update(actual_ttft_ms=rng.uniform(1, 900), actual_tpot_ms=0.0)
        if i % 5 == 0:
            entry["predicted_ttft_ms"] = 12.5
        entries.append(entry)
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    whole = parser.parse_observations(entries)
    sliced = ParsedObservations.concat(
        [parser.parse_observations(entries[i : i + 64], "entries", i) for i in range(0, 150, 64)]
    )
    np.testing.assert_array_equal(sliced.rows.X, whole.rows.X)
    assert sliced.rows.endpoint_ids == whole.rows.endpoint_ids
    assert sliced.rows.accelerators == whole.rows.accelerators
    for name in ("actual_ttft_ms", "actual_tpot_ms", "predicted_ttft_ms", "predicted_tpot_quantile_ms"):
        np.testing.assert_array_equal(getattr(sliced, name), getattr(whole, name))
    entries[130]["kv_cache_percentage"] = 2.0
    with pytest.raises(FeatureError, match=r"entries\[130\]\.kv_cache_percentage"):
        parser.parse_observations(entries[128:], "entries", 128)


# --- gRPC RowColumns: rows as one list per field ----------------------------------------------------------


def columns_of(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    from leadtime.predictor.client import row_columns

    message = row_columns(rows)
    assert message is not None
    return {field.name: list(getattr(message, field.name)) for field in message.DESCRIPTOR.fields}


@pytest.mark.parametrize("extras", [False, True])
def test_column_lists_are_bitwise_the_row_messages(extras: bool) -> None:
    from leadtime.predictor.client import row_message
    from leadtime.predictor.grpc.server import row_to_dict

    rng = random.Random(13)
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    for _ in range(20):
        rows = [random_row(rng, extras) for _ in range(rng.randint(1, 80))]
        hits = rng.random() < 0.5
        for r in rows:
            r.pop("prefix_hit_tokens", None)
            if extras and hits:
                r["prefix_hit_tokens"] = rng.randint(0, r["input_token_length"])
        columns = columns_of(rows)
        assert parser._parse_column_arrays(columns, len(rows)) is not None  # the column-wise path took them
        got = parser.parse_column_lists(columns)
        expected = parser.parse_messages([row_message(r) for r in rows], row_to_dict)
        np.testing.assert_array_equal(got.X, expected.X)
        assert got.endpoint_ids == expected.endpoint_ids
        assert got.accelerators == expected.accelerators


def test_empty_column_lists_are_the_fields_defaults() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = [dict(random_row(random.Random(2), extras=False), num_request_waiting=0, prefix_cache_score=0.0)]
    columns = columns_of(rows)
    columns["num_request_waiting"] = []
    columns["prefix_cache_score"] = []
    np.testing.assert_array_equal(parser.parse_column_lists(columns).X, parser.parse(rows).X)


@pytest.mark.parametrize(
    ("name", "value", "field"),
    [
        ("kv_cache_percentage", 1.5, "columns[2].kv_cache_percentage"),
        ("timeslice_wait_ms", float("nan"), "columns[2].timeslice_wait_ms"),
        ("timeslice_state", "asleep", "columns[2].timeslice_state"),
        ("accelerator", "abacus", "columns[2].accelerator"),
        ("input_token_length", 2**53 + 1, "columns[2].input_token_length"),
        ("pod_type", "mixed", "columns[2].pod_type"),
    ],
)
def test_a_bad_value_in_the_column_lists_is_named_by_its_row(name: str, value: Any, field: str) -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = [random_row(random.Random(i), extras=True) for i in range(4)]
    for r in rows:
        r.pop("prefix_hit_tokens", None)
    columns = columns_of(rows)
    columns[name][2] = value
    assert error_of(lambda: parser.parse_column_lists(columns))[0] == field


def test_column_lists_from_python_name_values_numpy_cannot_convert() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    changes: list[tuple[str, Any]] = [
        ("num_request_waiting", -1),
        ("num_request_waiting", True),
        ("input_token_length", 1.5),  # numpy would truncate it to 1
        ("kv_cache_percentage", False),
        ("timeslice_wait_ms", "soon"),
        ("tensor_parallel", 2.5),
        ("endpoint_id", 7),
    ]
    for name, value in changes:
        columns = columns_of(plain_rows(3))
        columns[name] = [columns[name][0] if columns.get(name) else "" if name == "endpoint_id" else 1] * 3
        columns[name][1] = value
        assert error_of(lambda columns=columns: parser.parse_column_lists(columns))[0] == f"columns[1].{name}", name


@pytest.mark.parametrize("size", [2**60, -1])
def test_a_tensor_parallel_out_of_range_is_refused_in_columns_as_in_rows(size: int) -> None:
    # Regression: the column-wise path checked only that tensor_parallel held integers, and took sizes that the
    # row checks refuse (a Row's uint32 carries neither: only Python callers can send them).
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = plain_rows(3)
    columns = columns_of(rows)
    columns["tensor_parallel"] = [1, size, 1]
    assert error_of(lambda: parser.parse([dict(rows[1], tensor_parallel=size)]))[0] == "requests[0].tensor_parallel"
    assert error_of(lambda: parser.parse_column_lists(columns))[0] == "columns[1].tensor_parallel"


_ODD_VALUES: list[Any] = [
    -1, 0, 1, 2, 2**32, 2**53, 2**53 + 1, 2**60, 2**64, 0.5, 1.5, -0.0, 1.0, float("nan"), float("inf"),
    float("-inf"), True, False, "", "x", "decode", "parked", "h100-sxm", "l40s", "abacus",
]  # fmt: skip


def test_the_column_wise_path_never_takes_what_the_row_checks_refuse() -> None:
    """Random odd values in random columns: whatever the column-wise path accepts, the row checks (which name the
    bad value) accept too, with bit-identical rows."""
    from leadtime.predictor.service.rows import _column_rows

    rng = random.Random(5)
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    taken = 0
    for _ in range(1500):
        rows = [random_row(rng, extras=True) for _ in range(rng.randint(1, 6))]
        for r in rows:
            r.pop("prefix_hit_tokens", None)
        columns = columns_of(rows)
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(sorted(columns))
            values = columns[name] or [0] * len(rows)
            values[rng.randrange(len(rows))] = rng.choice(_ODD_VALUES)
            columns[name] = values
        fast = parser._parse_column_arrays(columns, len(rows))
        if fast is None:
            continue
        taken += 1
        slow = parser._parse_rows(_column_rows(columns, len(rows)), "columns")
        np.testing.assert_array_equal(fast.X, slow.X)
        assert fast.endpoint_ids == slow.endpoint_ids and fast.accelerators == slow.accelerators
    assert taken > 100  # the column-wise path was really exercised


def test_column_lists_of_different_lengths_are_refused() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    columns = columns_of(plain_rows(3))
    columns["num_request_running"] = columns["num_request_running"][:2]
    assert error_of(lambda: parser.parse_column_lists(columns)) == (
        "columns.num_request_running",
        "has 2 values for 3 rows",
    )


def test_prefix_hits_beyond_the_prompt_are_named() -> None:
    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = [dict(r, prefix_hit_tokens=0) for r in plain_rows(3)]
    rows[1]["prefix_hit_tokens"] = rows[1]["input_token_length"] + 1
    assert error_of(lambda: parser.parse_column_lists(columns_of(rows)))[0] == "columns[1].prefix_hit_tokens"


def test_rows_that_give_prefix_hits_only_sometimes_travel_as_messages() -> None:
    from leadtime.predictor.client import row_columns

    rows = plain_rows(2)
    rows[0]["prefix_hit_tokens"] = 0
    assert row_columns(rows) is None


def test_column_lists_with_mixed_hardware_and_no_roles_or_time_slices() -> None:
    # Regression: per-row hardware groups left the role and time-slice columns unset when no list gave them.
    from leadtime.predictor.client import row_message
    from leadtime.predictor.grpc.server import row_to_dict

    parser = RowParser("h100-sxm", "llama-3.1-8b")
    rows = [dict(r, pod_type="") for r in plain_rows(3)]
    rows[2]["accelerator"] = "l40s"
    columns = columns_of(rows)
    expected = parser.parse_messages([row_message(r) for r in rows], row_to_dict)
    for _ in range(5):
        junk = np.full((len(COLUMNS), len(rows)), np.nan)  # numpy hands freed small blocks out again, unwiped
        del junk
        np.testing.assert_array_equal(parser.parse_column_lists(columns).X, expected.X)


# --- llm-d's row fields are defined once (features.rows); every decoder agrees with them --------------------


def test_every_row_decoder_knows_exactly_the_feature_rows_fields() -> None:
    from leadtime.features.rows import LEADTIME_ROW_FIELDS, LLMD_DEFAULTS, LLMD_FIELDS, LLMD_REQUIRED_FIELDS
    from leadtime.predictor.grpc import leadtime_pb2 as pb
    from leadtime.predictor.service.bulk_decode import LlmdBulkRow, LlmdTrainingEntry
    from leadtime.predictor.service.schemas import LlmdRow, NativeRow, TrainingEntry

    assert set(LLMD_REQUIRED_FIELDS) | set(LLMD_DEFAULTS) == set(LLMD_FIELDS)
    assert tuple(f.name for f in pb.Row.DESCRIPTOR.fields) == LLMD_FIELDS + LEADTIME_ROW_FIELDS
    assert tuple(f.name for f in pb.RowColumns.DESCRIPTOR.fields) == LLMD_FIELDS + LEADTIME_ROW_FIELDS
    assert LlmdBulkRow.__struct_fields__ == LLMD_FIELDS
    training_fields = (*LLMD_FIELDS, "actual_ttft_ms", "actual_tpot_ms", "timestamp")
    assert LlmdTrainingEntry.__struct_fields__ == training_fields == tuple(TrainingEntry.model_fields)
    # The OpenAPI schemas document the same fields (plus the native API's `role`).
    assert tuple(LlmdRow.model_fields) == LLMD_FIELDS
    assert set(NativeRow.model_fields) == {*LLMD_FIELDS, *LEADTIME_ROW_FIELDS, "role"}
    assert {n for n, f in LlmdRow.model_fields.items() if f.is_required()} == set(LLMD_REQUIRED_FIELDS)
