"""Request features, endpoint state, observations and their lossless mapping to llm-d rows."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leadtime.data import MEASURED as MEASURED_FILES
from leadtime.features import (
    ACCELERATORS,
    MODELS,
    ROLES,
    TIMESLICE_STATES,
    EndpointState,
    FeatureError,
    FeatureRow,
    Observation,
    RequestFeatures,
    feature_row_from_llmd,
    feature_row_to_llmd,
    observation_from_llmd,
    observation_to_llmd,
)

MEASURED = MEASURED_FILES["sharegpt-h200"]

LLMD_FIELDS = (
    "kv_cache_percentage",
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "num_tokens_generated",
    "prefix_cache_score",
    "pod_type",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
    "encoder_matched_size",
    "encoder_input_size",
)
REQUIRED = (
    "kv_cache_percentage",
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "num_tokens_generated",
    "prefix_cache_score",
)
COUNT_FIELDS = (
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "num_tokens_generated",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
    "encoder_matched_size",
    "encoder_input_size",
)
FRACTION_FIELDS = ("kv_cache_percentage", "prefix_cache_score")


def llmd_row(**overrides: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "kv_cache_percentage": 0.25,
        "input_token_length": 200,
        "num_request_waiting": 3,
        "num_request_running": 5,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.5,
    }
    row.update(overrides)
    return row


# ------------------------------------------------------------------------------ strategies

counts = st.integers(min_value=0, max_value=10**7)
fractions = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
milliseconds = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)

requests = st.builds(
    RequestFeatures,
    input_tokens=counts,
    prefix_cache_score=fractions,
    num_tokens_generated=counts,
    encoder_matched_size=counts,
    encoder_input_size=counts,
)
endpoints = st.builds(
    EndpointState,
    endpoint_id=st.text(max_size=30),
    accelerator=st.sampled_from(["", *ACCELERATORS]),
    model=st.sampled_from(["", *MODELS]),
    tensor_parallel=st.integers(min_value=1, max_value=64),
    role=st.sampled_from(ROLES),
    num_request_waiting=counts,
    num_request_running=counts,
    kv_cache_percentage=fractions,
    prefill_tokens_in_flight=counts,
    decode_tokens_in_flight=counts,
    timeslice_state=st.sampled_from(TIMESLICE_STATES),
    timeslice_wait_ms=milliseconds,
)
feature_rows = st.builds(FeatureRow, request=requests, endpoint=endpoints)
observations = st.builds(
    Observation,
    row=feature_rows,
    actual_ttft_ms=milliseconds,
    actual_tpot_ms=milliseconds,
    predicted_ttft_ms=st.none() | milliseconds,
    predicted_tpot_ms=st.none() | milliseconds,
    timestamp=st.none() | st.floats(min_value=0, max_value=4e9, allow_nan=False),
    predicted_ttft_quantile_ms=st.none() | milliseconds,
    predicted_tpot_quantile_ms=st.none() | milliseconds,
)

# llm-d sends JSON: counts as ints, fractions as floats (or 0/1 written as integers).
llmd_fractions = fractions | st.sampled_from([0, 1])
llmd_rows = st.fixed_dictionaries(
    {
        "kv_cache_percentage": llmd_fractions,
        "input_token_length": counts,
        "num_request_waiting": counts,
        "num_request_running": counts,
        "num_tokens_generated": counts,
        "prefix_cache_score": llmd_fractions,
    },
    optional={
        "pod_type": st.sampled_from(["", "prefill", "decode"]),
        "prefill_tokens_in_flight": counts,
        "decode_tokens_in_flight": counts,
        "encoder_matched_size": counts,
        "encoder_input_size": counts,
    },
)


# ------------------------------------------------------------------------------ round trips


@settings(max_examples=200, deadline=None)
@given(feature_rows)
def test_ours_to_llmd_to_ours_is_lossless(row: FeatureRow) -> None:
    assert feature_row_from_llmd(feature_row_to_llmd(row)) == row


@settings(max_examples=200, deadline=None)
@given(feature_rows)
def test_ours_to_llmd_survives_json(row: FeatureRow) -> None:
    wire = json.loads(json.dumps(feature_row_to_llmd(row)))
    assert feature_row_from_llmd(wire) == row


@settings(max_examples=200, deadline=None)
@given(llmd_rows)
def test_llmd_to_ours_to_llmd_is_lossless(row: dict[str, Any]) -> None:
    back = feature_row_to_llmd(feature_row_from_llmd(row))
    assert {k: back[k] for k in row} == row
    for name in LLMD_FIELDS:  # llm-d's optional fields come back with llm-d's defaults
        assert name in back
    assert back["pod_type"] == row.get("pod_type", "")


@settings(max_examples=200, deadline=None)
@given(observations)
def test_observation_round_trip(obs: Observation) -> None:
    assert observation_from_llmd(observation_to_llmd(obs)) == obs
    assert observation_from_llmd(json.loads(json.dumps(observation_to_llmd(obs)))) == obs


def test_llmd_row_carries_leadtime_extras() -> None:
    row = FeatureRow(
        RequestFeatures.with_prefix_hits(1000, 640),
        EndpointState(
            endpoint_id="pod-3",
            accelerator="h200-sxm",
            model="qwen3-32b",
            tensor_parallel=2,
            role="decode",
            timeslice_state="switching",
            timeslice_wait_ms=80.0,
        ),
    )
    out = feature_row_to_llmd(row)
    assert out["endpoint_id"] == "pod-3"
    assert out["accelerator"] == "h200-sxm"
    assert out["model"] == "qwen3-32b"
    assert out["tensor_parallel"] == 2
    assert out["pod_type"] == "decode"
    assert out["prefix_hit_tokens"] == 640
    assert out["prefix_cache_score"] == pytest.approx(0.64)
    assert out["timeslice_state"] == "switching"
    assert out["timeslice_wait_ms"] == 80.0


def test_real_llmd_training_rows_round_trip() -> None:
    """Every row the llm-d router recorded on the H200 run converts to ours and back unchanged."""
    lines = MEASURED.read_text().splitlines()
    assert len(lines) == 3400
    for line in lines:
        entry = json.loads(line)
        back = observation_to_llmd(observation_from_llmd(entry))
        assert {k: back[k] for k in entry} == entry


# ------------------------------------------------------------------------------ request features


def test_prefix_hits_and_uncached_tokens_follow_the_score() -> None:
    r = RequestFeatures(input_tokens=1000, prefix_cache_score=0.25)
    assert r.prefix_hit_tokens == 250
    assert r.uncached_tokens == 750
    assert RequestFeatures(0, 0.7).prefix_hit_tokens == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**7).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_with_prefix_hits_recovers_the_exact_hit_count(pair: tuple[int, int]) -> None:
    n, hits = pair
    r = RequestFeatures.with_prefix_hits(n, hits)
    assert r.prefix_hit_tokens == hits
    assert r.uncached_tokens == n - hits
    assert 0.0 <= r.prefix_cache_score <= 1.0


def test_with_prefix_hits_refuses_more_hits_than_tokens() -> None:
    with pytest.raises(FeatureError) as err:
        RequestFeatures.with_prefix_hits(10, 11)
    assert err.value.field == "prefix_hit_tokens"


def test_integral_floats_and_numpy_integers_are_counts() -> None:
    assert RequestFeatures(input_tokens=12.0).input_tokens == 12  # type: ignore[arg-type]
    r = RequestFeatures(input_tokens=np.int64(12), num_tokens_generated=np.uint32(3))  # type: ignore[arg-type]
    assert r.input_tokens == 12 and type(r.input_tokens) is int
    assert r.num_tokens_generated == 3 and type(r.num_tokens_generated) is int
    e = EndpointState(num_request_waiting=np.int32(4), kv_cache_percentage=np.float32(0.5))  # type: ignore[arg-type]
    assert e.num_request_waiting == 4 and e.kv_cache_percentage == 0.5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_tokens": -1}, "input_token_length"),
        ({"input_tokens": 1.5}, "input_token_length"),
        ({"input_tokens": True}, "input_token_length"),
        ({"input_tokens": "12"}, "input_token_length"),
        ({"input_tokens": math.nan}, "input_token_length"),
        ({"input_tokens": math.inf}, "input_token_length"),
        ({"input_tokens": None}, "input_token_length"),
        ({"input_tokens": 10**400}, "input_token_length"),
        ({"input_tokens": 10, "prefix_cache_score": 1.01}, "prefix_cache_score"),
        ({"input_tokens": 10, "prefix_cache_score": -0.1}, "prefix_cache_score"),
        ({"input_tokens": 10, "prefix_cache_score": math.nan}, "prefix_cache_score"),
        ({"input_tokens": 10, "num_tokens_generated": -3}, "num_tokens_generated"),
        ({"input_tokens": 10, "encoder_matched_size": 0.5}, "encoder_matched_size"),
        ({"input_tokens": 10, "encoder_input_size": -1}, "encoder_input_size"),
    ],
)
def test_request_features_name_the_bad_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(FeatureError) as err:
        RequestFeatures(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


# ------------------------------------------------------------------------------ endpoint state


def test_endpoint_state_defaults_describe_an_idle_unshared_endpoint() -> None:
    e = EndpointState()
    assert (e.role, e.timeslice_state, e.tensor_parallel) == ("both", "none", 1)
    assert e.num_request_waiting == e.num_request_running == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"endpoint_id": 7}, "endpoint_id"),
        ({"accelerator": None}, "accelerator"),
        ({"model": b"x"}, "model"),
        ({"tensor_parallel": 0}, "tensor_parallel"),
        ({"tensor_parallel": 2.5}, "tensor_parallel"),
        ({"role": "router"}, "role"),
        ({"role": ""}, "role"),
        ({"num_request_waiting": -1}, "num_request_waiting"),
        ({"num_request_running": 1.5}, "num_request_running"),
        ({"kv_cache_percentage": 1.5}, "kv_cache_percentage"),
        ({"kv_cache_percentage": math.inf}, "kv_cache_percentage"),
        ({"prefill_tokens_in_flight": -2}, "prefill_tokens_in_flight"),
        ({"decode_tokens_in_flight": "3"}, "decode_tokens_in_flight"),
        ({"timeslice_state": "LOCKED"}, "timeslice_state"),
        ({"timeslice_wait_ms": -5.0}, "timeslice_wait_ms"),
        ({"timeslice_wait_ms": math.nan}, "timeslice_wait_ms"),
    ],
)
def test_endpoint_state_names_the_bad_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(FeatureError) as err:
        EndpointState(**kwargs)
    assert err.value.field == field


# ------------------------------------------------------------------------------ observations


def test_observation_flags_which_targets_were_observed() -> None:
    row = FeatureRow(RequestFeatures(100))
    assert Observation(row, actual_ttft_ms=120.0).has_ttft
    assert not Observation(row, actual_ttft_ms=120.0).has_tpot
    both = Observation(row, actual_ttft_ms=120.0, actual_tpot_ms=9.0)
    assert both.has_ttft and both.has_tpot


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"actual_ttft_ms": -1.0}, "actual_ttft_ms"),
        ({"actual_tpot_ms": math.nan}, "actual_tpot_ms"),
        ({"actual_ttft_ms": "fast"}, "actual_ttft_ms"),
        ({"predicted_ttft_ms": math.inf}, "predicted_ttft_ms"),
        ({"predicted_tpot_ms": math.nan}, "predicted_tpot_ms"),
        ({"predicted_ttft_quantile_ms": math.inf}, "predicted_ttft_quantile_ms"),
        ({"timestamp": math.nan}, "timestamp"),
    ],
)
def test_observation_names_the_bad_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(FeatureError) as err:
        Observation(FeatureRow(RequestFeatures(10)), **kwargs)
    assert err.value.field == field


# ------------------------------------------------------------------------------ llm-d rows in


def test_llmd_row_without_extras_gets_defaults() -> None:
    row = feature_row_from_llmd(llmd_row())
    assert row.request.input_tokens == 200
    assert row.request.prefix_hit_tokens == 100
    assert row.endpoint == EndpointState(num_request_waiting=3, num_request_running=5, kv_cache_percentage=0.25)


@pytest.mark.parametrize(
    ("pod_type", "role"), [("", "both"), (None, "both"), ("prefill", "prefill"), ("decode", "decode")]
)
def test_pod_type_maps_to_role(pod_type: str | None, role: str) -> None:
    assert feature_row_from_llmd(llmd_row(pod_type=pod_type)).endpoint.role == role


def test_unknown_keys_are_ignored() -> None:
    assert feature_row_from_llmd(llmd_row(some_future_field=[1, 2])) == feature_row_from_llmd(llmd_row())


@pytest.mark.parametrize("name", REQUIRED)
def test_missing_required_field_is_named(name: str) -> None:
    row = llmd_row()
    del row[name]
    with pytest.raises(FeatureError) as err:
        feature_row_from_llmd(row)
    assert err.value.field == name
    with pytest.raises(FeatureError) as err:
        feature_row_from_llmd(llmd_row(**{name: None}))
    assert err.value.field == name


@pytest.mark.parametrize("name", COUNT_FIELDS)
@pytest.mark.parametrize("bad", [-1, 2.5, "3", True, math.nan])
def test_bad_count_in_llmd_row_is_named(name: str, bad: Any) -> None:
    with pytest.raises(FeatureError) as err:
        feature_row_from_llmd(llmd_row(**{name: bad}))
    assert err.value.field == name


@pytest.mark.parametrize("name", FRACTION_FIELDS)
@pytest.mark.parametrize("bad", [-0.01, 1.01, math.inf, math.nan, "0.5", None])
def test_bad_fraction_in_llmd_row_is_named(name: str, bad: Any) -> None:
    with pytest.raises(FeatureError) as err:
        feature_row_from_llmd(llmd_row(**{name: bad}))
    assert err.value.field == name


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"pod_type": "mixed"}, "pod_type"),
        ({"endpoint_id": 5}, "endpoint_id"),
        ({"accelerator": ["h100-sxm"]}, "accelerator"),
        # Regression: a text field that is empty but not "" or null (0, false, [], {}) was read as unset, so the
        # row was taken as the default class's, where the service refuses it naming the field.
        ({"accelerator": 0}, "accelerator"),
        ({"accelerator": False}, "accelerator"),
        ({"accelerator": []}, "accelerator"),
        ({"model": {}}, "model"),
        ({"endpoint_id": 0}, "endpoint_id"),
        ({"tensor_parallel": 0}, "tensor_parallel"),
        ({"timeslice_state": "busy"}, "timeslice_state"),
        ({"timeslice_wait_ms": -1}, "timeslice_wait_ms"),
        ({"prefix_hit_tokens": 201}, "prefix_hit_tokens"),
        ({"prefix_hit_tokens": -1}, "prefix_hit_tokens"),
    ],
)
def test_bad_extra_in_llmd_row_is_named(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(FeatureError) as err:
        feature_row_from_llmd(llmd_row(**extra))
    assert err.value.field == field


def test_null_or_empty_text_fields_are_unset() -> None:
    row = feature_row_from_llmd(llmd_row(accelerator=None, model="", endpoint_id=None))
    assert (row.endpoint.accelerator, row.endpoint.model, row.endpoint.endpoint_id) == ("", "", "")


def test_not_a_mapping_is_refused() -> None:
    with pytest.raises(FeatureError) as err:
        feature_row_from_llmd([1, 2, 3])  # type: ignore[arg-type]
    assert err.value.field == "row"


def test_prefix_hit_tokens_override_an_inconsistent_score() -> None:
    row = feature_row_from_llmd(llmd_row(input_token_length=1000, prefix_cache_score=0.0, prefix_hit_tokens=512))
    assert row.request.prefix_hit_tokens == 512
    assert row.request.prefix_cache_score == pytest.approx(0.512)


def test_consistent_prefix_hit_tokens_keep_the_exact_score() -> None:
    """llm-d → ours → llm-d must not perturb a score that already agrees with the hit count."""
    row = feature_row_from_llmd(llmd_row(input_token_length=7, prefix_cache_score=0.3, prefix_hit_tokens=2))
    assert row.request.prefix_cache_score == 0.3


def test_out_of_range_score_is_refused_even_with_hit_tokens() -> None:
    with pytest.raises(FeatureError) as err:
        feature_row_from_llmd(llmd_row(prefix_cache_score=5.0, prefix_hit_tokens=10))
    assert err.value.field == "prefix_cache_score"


# ------------------------------------------------------------------------------ training entries


def test_training_entry_needs_both_actuals() -> None:
    for name in ("actual_ttft_ms", "actual_tpot_ms"):
        entry = llmd_row(actual_ttft_ms=100.0, actual_tpot_ms=0.0)
        del entry[name]
        with pytest.raises(FeatureError) as err:
            observation_from_llmd(entry)
        assert err.value.field == name


def test_training_entry_refuses_negative_actual() -> None:
    with pytest.raises(FeatureError) as err:
        observation_from_llmd(llmd_row(actual_ttft_ms=-1.0, actual_tpot_ms=0.0))
    assert err.value.field == "actual_ttft_ms"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2026-11-29T20:00:00Z", 1795982400.0),
        ("2026-11-29T20:00:00+00:00", 1795982400.0),
        ("2026-11-29T21:00:00+01:00", 1795982400.0),
        ("2026-11-29T20:00:00.250Z", 1795982400.25),
        ("2026-11-29T20:00:00", 1795982400.0),  # no offset: taken as UTC, not the host's zone
        ("1795982400.5", 1795982400.5),  # seconds since the epoch, sent as a string
    ],
)
def test_timestamps_parse_to_epoch_seconds(text: str, seconds: float) -> None:
    obs = observation_from_llmd(llmd_row(actual_ttft_ms=1.0, actual_tpot_ms=0.0, timestamp=text))
    assert obs.timestamp == pytest.approx(seconds)


def test_numeric_timestamp_is_kept() -> None:
    obs = observation_from_llmd(llmd_row(actual_ttft_ms=1.0, actual_tpot_ms=0.0, timestamp=1795982400))
    assert obs.timestamp == 1795982400.0


@pytest.mark.parametrize("bad", ["yesterday", "", "2026-13-01T00:00:00Z", "nan", "inf", [1]])
def test_bad_timestamp_is_named(bad: Any) -> None:
    with pytest.raises(FeatureError) as err:
        observation_from_llmd(llmd_row(actual_ttft_ms=1.0, actual_tpot_ms=0.0, timestamp=bad))
    assert err.value.field == "timestamp"


def test_with_counts_checks_the_counts_it_changes_and_keeps_every_other_field() -> None:
    state = EndpointState(endpoint_id="a", accelerator="h100-sxm", num_request_waiting=1, kv_cache_percentage=0.5)
    more = state.with_counts(num_request_waiting=3, decode_tokens_in_flight=7.0)  # type: ignore[arg-type]
    assert more == dataclasses.replace(state, num_request_waiting=3, decode_tokens_in_flight=7)
    assert type(more.decode_tokens_in_flight) is int and state.num_request_waiting == 1
    with pytest.raises(FeatureError, match="num_request_running"):
        state.with_counts(num_request_running=-1)


def test_an_unknown_key_of_any_length_is_named_briefly() -> None:
    """Values are shortened in messages, key names were not: a row with a 10 MB key got a 10 MB answer, after 1.8 s
    spent looking for the field it might be a slip for. No field is that long: its start is named, and no match."""
    from leadtime.features.rows import NATIVE_ROW_FIELDS, refuse_unknown_fields

    with pytest.raises(FeatureError) as err:
        refuse_unknown_fields([{"x" * 1_000_000: 1}], "rows", NATIVE_ROW_FIELDS)
    assert len(str(err.value)) < 200 and err.value.field.startswith("rows[0].xxx") and "..." in err.value.field
