"""Vectorization to the fixed, versioned column order, and check_matrix's refusals."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leadtime.features import ACCELERATORS, MODELS, ROLES, TIMESLICE_STATES, EndpointState, FeatureRow, RequestFeatures
from leadtime.features.catalog import get_accelerator, get_model
from leadtime.features.errors import FeatureError
from leadtime.features.roofline import decode_step_ms, prefill_ms
from leadtime.features.rows import LLMD_COUNT_FIELDS, feature_row_from_llmd
from leadtime.features.vectorize import (
    COLUMN_INDEX,
    COLUMNS,
    ROLE_CODES,
    SCHEMA_VERSION,
    CheckedColumns,
    FeatureBatch,
    Vectorizer,
    check_matrix,
    class_key,
)

C = COLUMN_INDEX

# The column order each schema version was released with. Changing COLUMNS without bumping SCHEMA_VERSION
# would let a saved model be fed the wrong columns; this pins it.
RELEASED = {1: "be9a0fb0"}


def column_digest() -> str:
    return hashlib.sha256(",".join(COLUMNS).encode()).hexdigest()[:8]


counts = st.integers(0, 2_000_000)
rows = st.builds(
    FeatureRow,
    request=st.builds(
        RequestFeatures,
        input_tokens=counts,
        prefix_cache_score=st.floats(0.0, 1.0),
        num_tokens_generated=counts,
        encoder_matched_size=counts,
        encoder_input_size=counts,
    ),
    endpoint=st.builds(
        EndpointState,
        endpoint_id=st.text(max_size=8),
        accelerator=st.sampled_from(["", *ACCELERATORS]),
        model=st.sampled_from(["", *MODELS]),
        tensor_parallel=st.integers(1, 16),
        role=st.sampled_from(ROLES),
        num_request_waiting=counts,
        num_request_running=counts,
        kv_cache_percentage=st.floats(0.0, 1.0),
        prefill_tokens_in_flight=counts,
        decode_tokens_in_flight=counts,
        timeslice_state=st.sampled_from(TIMESLICE_STATES),
        timeslice_wait_ms=st.floats(0.0, 1e7),
    ),
)


def llmd_row(**overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "kv_cache_percentage": 0.5,
        "input_token_length": 1000,
        "num_request_waiting": 2,
        "num_request_running": 7,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.25,
        "prefill_tokens_in_flight": 300,
    }
    row.update(overrides)
    return row


# ------------------------------------------------------------------------------ schema


def test_columns_are_unique_and_indexed() -> None:
    assert len(set(COLUMNS)) == len(COLUMNS)
    assert [COLUMNS[i] for i in sorted(COLUMN_INDEX.values())] == list(COLUMNS)
    assert all(COLUMNS[i] == name for name, i in COLUMN_INDEX.items())


def test_column_order_is_pinned_to_the_schema_version() -> None:
    assert isinstance(SCHEMA_VERSION, int)
    assert RELEASED.get(SCHEMA_VERSION) == column_digest(), "COLUMNS changed: bump SCHEMA_VERSION"


# ------------------------------------------------------------------------------ transform


def test_empty_batch_has_the_full_width() -> None:
    x = Vectorizer().transform([])
    assert x.shape == (0, len(COLUMNS))
    assert x.dtype == np.float64


def test_values_land_in_their_named_columns() -> None:
    row = FeatureRow(
        RequestFeatures.with_prefix_hits(1000, 256, num_tokens_generated=5, encoder_input_size=7),
        EndpointState(
            accelerator="h200-sxm",
            model="qwen3-32b",
            tensor_parallel=2,
            role="prefill",
            num_request_waiting=4,
            num_request_running=9,
            kv_cache_percentage=0.3,
            prefill_tokens_in_flight=2048,
            decode_tokens_in_flight=11,
            timeslice_state="switching",
            timeslice_wait_ms=75.0,
        ),
    )
    x = Vectorizer().transform([row])[0]
    acc, model = get_accelerator("h200-sxm"), get_model("qwen3-32b")
    expected = {
        "input_tokens": 1000,
        "prefix_hit_tokens": 256,
        "uncached_tokens": 744,
        "num_tokens_generated": 5,
        "num_request_waiting": 4,
        "num_request_running": 9,
        "kv_cache_percentage": 0.3,
        "prefill_tokens_in_flight": 2048,
        "decode_tokens_in_flight": 11,
        "role_prefill": 1,
        "role_decode": 0,
        "accel_tflops": acc.effective_tflops,
        "accel_tb_s": acc.effective_tb_s,
        "tensor_parallel": 2,
        "kv_bytes_per_token": model.kv_bytes_per_token(2),
        "roofline_own_prefill_ms": prefill_ms(model, acc, 744, 256, 2),
        "roofline_queue_prefill_ms": 4 * prefill_ms(model, acc, 512, 0, 2),  # four waiting prompts of 512
        "roofline_weights_ms": decode_step_ms(model, acc, 1, 0, 2),
        "timeslice_resident": 0,
        "timeslice_wait_ms": 75.0,
        "encoder_input_size": 7,
        "encoder_matched_size": 0,
    }
    for name, value in expected.items():
        assert x[C[name]] == pytest.approx(value), name
    assert x[C["roofline_decode_step_ms"]] > x[C["roofline_weights_ms"]]  # KV of the running batch adds reads


@pytest.mark.parametrize(("role", "prefill", "decode"), [("both", 0, 0), ("prefill", 1, 0), ("decode", 0, 1)])
def test_role_is_one_hot(role: str, prefill: int, decode: int) -> None:
    x = Vectorizer().transform([FeatureRow(RequestFeatures(10), EndpointState(role=role))])[0]
    assert (x[C["role_prefill"]], x[C["role_decode"]]) == (prefill, decode)


@pytest.mark.parametrize(("state", "resident"), [("none", 1), ("resident", 1), ("switching", 0), ("parked", 0)])
def test_timeslice_residency(state: str, resident: int) -> None:
    x = Vectorizer().transform([FeatureRow(RequestFeatures(10), EndpointState(timeslice_state=state))])[0]
    assert x[C["timeslice_resident"]] == resident


def test_rows_without_hardware_use_the_defaults() -> None:
    plain = FeatureRow(RequestFeatures(500))
    named = FeatureRow(RequestFeatures(500), EndpointState(accelerator="l40s", model="llama-3.1-8b"))
    v = Vectorizer(default_accelerator="l40s", default_model="llama-3.1-8b")
    assert np.array_equal(v.transform([plain]), v.transform([named]))
    assert v.transform([plain])[0, C["accel_tb_s"]] == get_accelerator("l40s").effective_tb_s
    other = Vectorizer(default_accelerator="h100-sxm").transform([plain])
    assert other[0, C["accel_tb_s"]] != v.transform([plain])[0, C["accel_tb_s"]]


def test_faster_hardware_and_more_parallelism_lower_the_roofline() -> None:
    v = Vectorizer()

    def roofline(accelerator: str, tp: int) -> np.ndarray:
        row = FeatureRow(
            RequestFeatures(4000),
            EndpointState(accelerator=accelerator, model="llama-3.1-70b", tensor_parallel=tp, num_request_running=8),
        )
        x = v.transform([row])[0]
        return x[[C["roofline_own_prefill_ms"], C["roofline_decode_step_ms"]]]

    assert (roofline("h100-sxm", 4) < roofline("a100-sxm-80gb", 4)).all()
    assert (roofline("h100-sxm", 8) < roofline("h100-sxm", 4)).all()
    assert roofline("h200-sxm", 4)[1] < roofline("h100-sxm", 4)[1]  # decode is bandwidth-bound


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"default_accelerator": "b200"}, "accelerator"), ({"default_model": "gpt-5"}, "model")],
)
def test_unknown_defaults_are_refused(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(FeatureError) as err:
        Vectorizer(**kwargs)
    assert err.value.field == field


def test_unknown_hardware_in_a_row_names_the_row() -> None:
    good = FeatureRow(RequestFeatures(10))
    bad = FeatureRow(RequestFeatures(10), EndpointState(accelerator="b200"))
    with pytest.raises(FeatureError) as err:
        Vectorizer().transform([good, bad])
    assert err.value.field == "rows[1].accelerator"
    assert "b200" in str(err.value)


def test_llmd_rows_vectorize_like_parsed_rows() -> None:
    raw = [
        llmd_row(),
        llmd_row(pod_type="decode", accelerator="mi300x", model="llama-3.1-70b", tensor_parallel=8),
    ]
    v = Vectorizer()
    assert np.array_equal(v.transform_llmd(raw), v.transform([feature_row_from_llmd(r) for r in raw]))


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"kv_cache_percentage": 1.5}, "rows[1].kv_cache_percentage"),
        ({"input_token_length": -3}, "rows[1].input_token_length"),
        ({"accelerator": "b200"}, "rows[1].accelerator"),
    ],
)
def test_bad_llmd_row_is_named_with_its_index(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(FeatureError) as err:
        Vectorizer().transform_llmd([llmd_row(), llmd_row(**bad)])
    assert err.value.field == field


@settings(max_examples=200, deadline=None)
@given(st.lists(rows, max_size=8))
def test_any_valid_rows_give_a_finite_matrix_that_passes_the_check(batch: list[FeatureRow]) -> None:
    x = Vectorizer().transform(batch)
    assert x.shape == (len(batch), len(COLUMNS))
    assert np.isfinite(x).all()
    assert check_matrix(x) is not None


@settings(max_examples=200, deadline=None)
@given(rows)
def test_vectorizing_is_row_independent(row: FeatureRow) -> None:
    """A row's vector does not depend on its neighbours or on what the vectorizer saw before."""
    v = Vectorizer()
    alone = v.transform([row])
    beside = v.transform([FeatureRow(RequestFeatures(3)), row])[1]
    assert np.array_equal(alone[0], beside)
    assert np.array_equal(alone, Vectorizer().transform([row]))


@settings(max_examples=200, deadline=None)
@given(rows, st.integers(1, 100_000))
def test_more_uncached_tokens_never_shorten_the_prefill_estimate(row: FeatureRow, extra: int) -> None:
    r = row.request
    longer = FeatureRow(RequestFeatures.with_prefix_hits(r.input_tokens + extra, r.prefix_hit_tokens), row.endpoint)
    v = Vectorizer()
    a, b = v.transform([row])[0], v.transform([longer])[0]
    assert b[C["uncached_tokens"]] == a[C["uncached_tokens"]] + extra
    assert b[C["roofline_own_prefill_ms"]] >= a[C["roofline_own_prefill_ms"]]


# ------------------------------------------------------------------------------ check_matrix


def valid_matrix(n: int = 3) -> np.ndarray:
    return Vectorizer().transform([FeatureRow(RequestFeatures(100 + i)) for i in range(n)])


@pytest.mark.parametrize("shape", [(len(COLUMNS),), (2, len(COLUMNS) - 1), (2, len(COLUMNS) + 1), (1, 1, len(COLUMNS))])
def test_wrong_shape_is_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(FeatureError) as err:
        check_matrix(np.ones(shape))
    assert err.value.field == "matrix"


def test_valid_and_empty_matrices_pass_as_float64() -> None:
    x = valid_matrix()
    assert np.array_equal(check_matrix(x), x)
    assert check_matrix(np.empty((0, len(COLUMNS)))).shape == (0, len(COLUMNS))
    ints = np.ones((2, len(COLUMNS)), dtype=np.int64)
    assert check_matrix(ints).dtype == np.float64


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2),
    st.sampled_from(COLUMNS),
    st.sampled_from([math.nan, math.inf, -math.inf]),
)
def test_non_finite_value_names_its_column(row: int, column: str, value: float) -> None:
    x = valid_matrix()
    x[row, C[column]] = value
    with pytest.raises(FeatureError) as err:
        check_matrix(x)
    assert err.value.field == column
    assert f"row {row}" in str(err.value)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2), st.sampled_from(COLUMNS), st.floats(1e-9, 1e6))
def test_negative_value_names_its_column(row: int, column: str, amount: float) -> None:
    x = valid_matrix()
    x[row, C[column]] = -amount
    with pytest.raises(FeatureError) as err:
        check_matrix(x)
    assert err.value.field == column


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("kv_cache_percentage", 1.01),
        ("role_prefill", 2.0),
        ("role_decode", 1.5),
        ("timeslice_resident", 3.0),
        ("tensor_parallel", 0.0),
        ("tensor_parallel", 0.5),
    ],
)
def test_out_of_range_value_names_its_column(column: str, value: float) -> None:
    x = valid_matrix()
    x[1, C[column]] = value
    with pytest.raises(FeatureError) as err:
        check_matrix(x)
    assert err.value.field == column
    assert "row 1" in str(err.value)


def test_first_bad_cell_is_reported() -> None:
    x = valid_matrix()
    x[2, C["input_tokens"]] = math.nan
    x[1, C["timeslice_wait_ms"]] = math.inf
    with pytest.raises(FeatureError) as err:
        check_matrix(x)
    assert err.value.field == "timeslice_wait_ms"


def test_non_numeric_matrix_is_refused_with_a_feature_error() -> None:
    with pytest.raises(FeatureError) as err:
        check_matrix(np.array([["a"] * len(COLUMNS)]))
    assert err.value.field == "matrix"


# ------------------------------------------------------------------------------ the batch form


@settings(max_examples=200, deadline=None)
@given(st.lists(rows, min_size=1, max_size=12))
def test_the_batch_form_is_bitwise_the_row_form(batch: list[FeatureRow]) -> None:
    v = Vectorizer()
    got = v.batch(batch)
    expected = np.array([v.row_vector(r) for r in batch])
    assert np.array_equal(got.X, expected)
    assert got.X.flags.c_contiguous
    assert got.classes == [
        class_key(r.endpoint.accelerator or "h100-sxm", r.endpoint.model or "llama-3.1-8b", r.endpoint.tensor_parallel)
        for r in batch
    ]
    ids = [r.endpoint.endpoint_id for r in batch]
    assert got.endpoint_ids == (ids if any(ids) else None)


@settings(max_examples=100, deadline=None)
@given(st.lists(rows, min_size=0, max_size=12))
def test_own_prefill_alone_is_the_matrix_column(batch: list[FeatureRow]) -> None:
    v = Vectorizer()
    expected = v.transform(batch)[:, C["roofline_own_prefill_ms"]]
    assert np.allclose(v.own_prefill_ms(batch), expected, rtol=1e-12, atol=0.0)


def test_a_batch_names_each_rows_class_accelerator_and_role() -> None:
    rows_ = [
        FeatureRow(RequestFeatures(10), EndpointState(endpoint_id="a", role="decode")),
        FeatureRow(RequestFeatures(10), EndpointState(accelerator="l40s", model="qwen3-32b", tensor_parallel=2)),
    ]
    batch = Vectorizer().batch(rows_)
    assert batch.classes == ["h100-sxm/llama-3.1-8b/tp1", "l40s/qwen3-32b/tp2"]
    assert batch.accelerators == ["h100-sxm", "l40s"]
    assert batch.roles == ["decode", "both"]
    assert batch.endpoint_ids == ["a", ""]
    assert len(batch) == 2


def test_batches_slice_and_join_like_their_rows() -> None:
    rng = np.random.default_rng(3)
    rows_ = [
        FeatureRow(
            RequestFeatures(int(rng.integers(1, 5000))),
            EndpointState(endpoint_id=f"e{i % 3}", accelerator=["", "l40s", "a100-sxm-80gb"][i % 3]),
        )
        for i in range(30)
    ]
    v = Vectorizer()
    batch = v.batch(rows_)
    for index in (slice(5, 17), [3, 1, 29], np.array([0, 0, 4]), np.arange(30) % 2 == 0, 7):
        part = batch[index]
        picked = [rows_[i] for i in np.arange(30)[index].reshape(-1).tolist()]
        expected = v.batch(picked)
        assert np.array_equal(part.X, expected.X)
        assert part.classes == expected.classes and part.endpoint_ids == expected.endpoint_ids
    joined = FeatureBatch.concat([batch[:10], batch[10:11], batch[11:]])
    assert np.array_equal(joined.X, batch.X) and joined.classes == batch.classes
    assert joined.endpoint_ids == batch.endpoint_ids


def test_two_classes_with_the_same_figures_keep_their_own_keys() -> None:
    # Regression: the learner used to rebuild a class key from the class's rounded figures, so two classes
    # whose figures round alike shared their offsets.
    from dataclasses import replace

    from leadtime.features.catalog import ACCELERATORS, Catalog

    twin = replace(ACCELERATORS["h100-sxm"], slug="h100-twin", name="an H100 by another name")
    batch = Vectorizer(catalog=Catalog((twin,))).batch(
        [FeatureRow(RequestFeatures(10), EndpointState(accelerator=a)) for a in ("", "h100-twin")]
    )
    assert np.array_equal(batch.X[0], batch.X[1])
    assert batch.classes == ["h100-sxm/llama-3.1-8b/tp1", "h100-twin/llama-3.1-8b/tp1"]


def test_checked_columns_give_the_rows_matrix() -> None:
    """What a decoder hands over (exact prefix hits, role codes, time-slice columns, a class per row)."""
    v = Vectorizer()
    rows_ = [
        FeatureRow(
            RequestFeatures.with_prefix_hits(900, 300, num_tokens_generated=4, encoder_input_size=2),
            EndpointState(
                accelerator="l40s",
                role="prefill",
                num_request_waiting=3,
                num_request_running=5,
                kv_cache_percentage=0.25,
                prefill_tokens_in_flight=700,
                timeslice_state="parked",
                timeslice_wait_ms=40.0,
            ),
        ),
        FeatureRow(RequestFeatures(20), EndpointState(decode_tokens_in_flight=9, role="decode")),
    ]
    counts = np.array([[900, 3, 5, 4, 700, 0, 0, 2], [20, 0, 0, 0, 0, 9, 0, 0]], dtype=np.uint64)
    assert counts.shape[1] == len(LLMD_COUNT_FIELDS)
    columns = CheckedColumns(
        counts,
        kv_cache_percentage=np.array([0.25, 0.0]),
        prefix_cache_score=np.array([0.0, 0.0]),  # ignored: the hits are given
        prefix_hit_tokens=np.array([300, 0]),
        roles=np.array([ROLE_CODES["prefill"], ROLE_CODES["decode"]]),
        resident=np.array([0.0, 1.0]),
        timeslice_wait_ms=np.array([40.0, 0.0]),
        hardware=np.array([v.hardware.index("l40s", "", 1), v.hardware.default]),
    )
    got = v.from_columns(columns)
    assert np.array_equal(got.X, v.transform(rows_))
    assert got.classes == v.batch(rows_).classes


def test_a_bare_matrix_finds_its_rows_classes_again_exactly() -> None:
    v = Vectorizer()
    rows_ = [
        FeatureRow(RequestFeatures(100)),
        FeatureRow(RequestFeatures(100), EndpointState(accelerator="l40s")),
        FeatureRow(RequestFeatures(100), EndpointState(accelerator="mi300x", model="llama-3.1-70b", tensor_parallel=4)),
    ]
    x = Vectorizer("h200-sxm", "qwen3-32b").transform(rows_)  # another vectorizer, with other defaults
    assert v.batch_of_matrix(x).classes == [
        "h200-sxm/qwen3-32b/tp1",
        "l40s/qwen3-32b/tp1",
        "mi300x/llama-3.1-70b/tp4",
    ]
    assert v.batch_of_matrix(v.transform(rows_[:1])).hardware == v.hardware.default
    bad = x.copy()
    bad[0, C["accel_tflops"]] += 1.0
    with pytest.raises(ValueError, match="no accelerator class"):
        v.batch_of_matrix(bad)
    with pytest.raises(ValueError, match="shape"):
        v.batch_of_matrix(np.zeros((2, 3)))


def test_a_bare_matrix_of_two_classes_with_the_same_figures_is_refused() -> None:
    from dataclasses import replace

    from leadtime.features.catalog import ACCELERATORS, Catalog

    twin = Catalog((replace(ACCELERATORS["l40s"], slug="l40s-twin"),))
    x = Vectorizer(catalog=twin).transform([FeatureRow(RequestFeatures(100), EndpointState(accelerator="l40s"))])
    with pytest.raises(ValueError, match="2 classes"):
        Vectorizer(catalog=twin).batch_of_matrix(x)
    assert Vectorizer().batch_of_matrix(x).classes == ["l40s/llama-3.1-8b/tp1"]  # the built-in catalog: one match


def test_an_unknown_class_in_a_batch_names_its_first_row() -> None:
    rows_ = [FeatureRow(RequestFeatures(10))] * 3 + [FeatureRow(RequestFeatures(10), EndpointState(model="gpt-9"))]
    with pytest.raises(FeatureError) as err:
        Vectorizer().batch(rows_ + rows_)
    assert err.value.field == "rows[3].model"


def test_a_table_of_thousands_of_classes_keeps_every_class_where_it_was_put() -> None:
    """Regression: each new hardware class rebuilt the table's whole figures matrix and looked its key up in a
    list, so a client naming ever-new tensor-parallel sizes made every prediction slower (about 50 ms each with
    7,000 classes). A class is now appended (a dict lookup, the matrix grown by doubling): 2,000 classes, each
    found again at its index, with its figures, its key, and the row form's matrix; a view of the figures taken
    early (a reader without the lock) still reads what it read."""
    v = Vectorizer()
    table = v.hardware
    early = table.figures
    early_values = early.copy()
    names = [(a, m, tp) for a in ACCELERATORS for m in MODELS for tp in range(1, 51)]
    assert len(names) == 2000
    indices = [table.index(*name) for name in names]
    assert len(set(indices)) == len(table.classes) == len(table.keys) == len(table.figures)
    assert [table.index(*name) for name in names] == indices
    for (a, m, tp), i in zip(names, indices, strict=True):
        hardware = table.classes[i]
        assert hardware.key == table.keys[i] == class_key(a, m, tp)
        assert table.figures[i].tolist() == list(hardware.figures())
    np.testing.assert_array_equal(early, early_values)
    rows = [
        FeatureRow(
            RequestFeatures(500), EndpointState(accelerator=a, model=m, tensor_parallel=tp, num_request_running=3)
        )
        for a, m, tp in names[-7:] + names[:3]
    ]
    np.testing.assert_array_equal(v.batch(rows).X, np.array([v.row_vector(r) for r in rows]))
