"""The llm-d reference on its own: training store, holdout, feature frames, ensemble gate, cadence, trees."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import require_module

from leadtime.predictor.llmd_reference import (
    COLD_START_MS,
    FEATURES,
    LlmdFrame,
    LlmdReference,
    bucket_keys,
    feature_frame,
    fit_booster,
    holdout_mask,
    prefix_quartile,
)


def row(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "kv_cache_percentage": 0.1,
        "input_token_length": 400,
        "num_request_waiting": 0,
        "num_request_running": 2,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.0,
    }
    base.update(overrides)
    return base


def test_bucket_keys_follow_llmds_queue_kv_and_prefix_buckets() -> None:
    waiting = [0, 1, 2, 3, 5, 6, 10, 11, 500]
    frame = LlmdFrame.from_rows([row(num_request_waiting=w) for w in waiting])
    queue = bucket_keys(frame) // 80
    assert queue.tolist() == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    kv = [0.0, 0.049, 0.05, 0.51, 0.999, 1.0]
    frame = LlmdFrame.from_rows([row(kv_cache_percentage=k) for k in kv])
    assert ((bucket_keys(frame) // 4) % 20).tolist() == [0, 0, 1, 10, 19, 19]
    frame = LlmdFrame.from_rows([row(prefix_cache_score=s) for s in (0.0, 0.3, 0.6, 0.99, 1.0)])
    assert (bucket_keys(frame) % 4).tolist() == [0, 1, 2, 3, 3]


def test_a_bucket_keeps_only_its_newest_rows() -> None:
    ref = LlmdReference(model="lightgbm", retrain_every=None, bucket_size=50, test_share=0.0)
    # Every row in one bucket (no queue, KV 10%, no prefix hits); TTFT counts the rows so the newest are known.
    ref.learn_many([row(input_token_length=100 + i, actual_ttft_ms=float(i + 1), actual_tpot_ms=0) for i in range(120)])
    # ... and ten rows in another bucket, which the first bucket's overflow must not touch.
    ref.learn_many([row(num_request_waiting=4, actual_ttft_ms=500.0, actual_tpot_ms=0) for _ in range(10)])
    status = ref.status()
    assert status["training_rows"] == {"ttft": 60, "tpot": 0}
    assert status["buckets"]["ttft"] == 2
    _, y = ref._store("ttft").rows()
    assert sorted(y[y < 500].tolist()) == [float(i) for i in range(71, 121)]


def test_about_a_tenth_of_the_rows_is_held_out_by_a_stable_hash_and_never_trains() -> None:
    rows = [row(input_token_length=10 + i, actual_ttft_ms=5.0 + i, actual_tpot_ms=0) for i in range(5000)]
    frame = LlmdFrame.from_rows(rows)
    held = holdout_mask(frame, 0.1)
    assert 0.08 < held.mean() < 0.12
    assert (holdout_mask(frame, 0.1) == held).all()  # the same row always goes the same way
    assert (holdout_mask(frame.take(np.arange(100, 200)), 0.1) == held[100:200]).all()
    ref = LlmdReference(model="lightgbm", retrain_every=None, bucket_size=10_000)
    ref.learn_many(frame)
    status = ref.status()
    assert status["test_rows"]["ttft"] == int(held.sum())
    assert status["training_rows"]["ttft"] == 5000 - int(held.sum())
    _, y = ref._store("ttft").rows()
    assert not set(y.tolist()) & set(frame.actual_ttft_ms[held].tolist())


def test_feature_frames_per_target() -> None:
    frame = LlmdFrame.from_rows(
        [
            row(
                num_request_waiting=3,
                prefix_cache_score=0.25,
                input_token_length=1000,
                pod_type="prefill",
                prefill_tokens_in_flight=700,
                decode_tokens_in_flight=90,
                num_tokens_generated=12,
            ),
            row(prefix_cache_score=0.8, pod_type="decode"),
        ]
    )
    ttft = dict(zip([n for n, _ in FEATURES["ttft"]], feature_frame("ttft", frame)[0], strict=True))
    assert ttft == {
        "is_queued": 1.0,
        "kv_cache_percentage": 0.1,
        "input_token_length": 1000.0,
        "num_request_waiting": 3.0,
        "num_request_running": 2.0,
        "prefill_tokens_in_flight": 700.0,
        "decode_tokens_in_flight": 90.0,
        "prefix_cache_score": 0.25,
        "effective_input_tokens": 750.0,
        "prefill_score_bucket": 0.0,
        "pod_type": 1.0,
    }
    tpot = dict(zip([n for n, _ in FEATURES["tpot"]], feature_frame("tpot", frame)[1], strict=True))
    assert tpot["is_queued"] == 0.0 and tpot["pod_type"] == 2.0 and "prefix_cache_score" not in tpot
    assert set(tpot) == {
        "is_queued",
        "kv_cache_percentage",
        "input_token_length",
        "num_request_waiting",
        "num_request_running",
        "prefill_tokens_in_flight",
        "decode_tokens_in_flight",
        "num_tokens_generated",
        "pod_type",
    }
    assert prefix_quartile(np.array([0.0, 0.25, 0.26, 0.5, 0.51, 0.75, 0.76, 1.0])).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"rows\[0\]\.prefix_cache_score"):
        LlmdFrame.from_rows([{k: v for k, v in row().items() if k != "prefix_cache_score"}])


def _gated_rows(queued: int, plain: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(queued + plain):
        waiting = int(rng.integers(1, 4)) if i < queued else 0
        # Queued rows wait ~1 s whatever their prompt; the others take ~0.1 ms per prompt token.
        tokens = int(rng.integers(100, 2000))
        ttft = 1000.0 + rng.normal(0, 5) if waiting else 0.1 * tokens
        rows.append(
            row(
                num_request_waiting=waiting,
                input_token_length=tokens,
                kv_cache_percentage=float(rng.uniform(0, 0.3)),
                actual_ttft_ms=ttft,
                actual_tpot_ms=0,
            )
        )
    return rows


def test_the_queue_gated_ensemble_needs_200_rows_on_each_side() -> None:
    ref = LlmdReference(model="lightgbm", objectives=("mean",), test_share=0.0, retrain_every=None)
    ref.fit(_gated_rows(queued=190, plain=400))
    assert ref.status()["gated"]["ttft"] is False
    ref = LlmdReference(model="lightgbm", objectives=("mean",), test_share=0.0, retrain_every=None)
    ref.fit(_gated_rows(queued=400, plain=400))
    assert ref.status()["gated"]["ttft"] is True
    p = ref.predict_many([row(num_request_waiting=2, input_token_length=300), row(input_token_length=1500)])
    assert p.ttft_mean is not None and p.ttft_quantile is None
    assert 900 < p.ttft_mean[0] < 1100  # the queued side's model
    assert 120 < p.ttft_mean[1] < 180  # the other side's
    no_ensemble = LlmdReference(model="lightgbm", objectives=("mean",), test_share=0.0, ensemble=False)
    no_ensemble.fit(_gated_rows(queued=400, plain=400))
    assert no_ensemble.status()["gated"]["ttft"] is False


def test_cold_start_then_a_retrain_every_n_rows() -> None:
    ref = LlmdReference(model="lightgbm", retrain_every=100, test_share=0.0)
    first = ref.predict_many([row()])
    assert first.ttft_mean is not None and first.tpot_quantile is not None
    assert first.ttft_mean.tolist() == [COLD_START_MS] and first.tpot_quantile.tolist() == [COLD_START_MS]
    rows = [row(input_token_length=100 + i, actual_ttft_ms=50.0 + i, actual_tpot_ms=20.0) for i in range(99)]
    ref.learn_many(rows)
    assert ref.retrains == 0 and ref.predict_one(row())["ttft_mean"] == COLD_START_MS
    ref.learn_many(rows[:1])
    assert ref.retrains == 1 and ref.predict_one(row())["ttft_mean"] != COLD_START_MS
    ref.learn_many(rows + rows + rows)  # 297 rows cross two more retrain points
    assert ref.retrains == 3


def test_quantile_objective_sits_above_the_mean() -> None:
    rng = np.random.default_rng(3)
    rows = [
        row(input_token_length=int(t), actual_ttft_ms=float(0.2 * t * rng.lognormal(0, 0.3)), actual_tpot_ms=0)
        for t in rng.integers(100, 3000, 1500)
    ]
    ref = LlmdReference(model="lightgbm", bucket_size=2000, test_share=0.0)
    ref.fit(rows)
    p = ref.predict_many(rows)
    assert p.ttft_mean is not None and p.ttft_quantile is not None
    actual = np.array([r["actual_ttft_ms"] for r in rows])
    assert 0.85 < float(np.mean(actual <= p.ttft_quantile)) < 0.95
    assert float(np.mean(p.ttft_quantile > p.ttft_mean)) > 0.9


@pytest.mark.parametrize("model_type", ["lightgbm", "xgboost"])
def test_compiled_trees_predict_what_the_library_predicts(model_type: str) -> None:
    if model_type == "xgboost":
        require_module("xgboost")
    rng = np.random.default_rng(1)
    n = 600
    rows = [
        row(
            num_request_waiting=int(rng.integers(0, 8)),
            kv_cache_percentage=float(rng.uniform(0, 1)),
            input_token_length=int(rng.integers(1, 4000)),
            prefix_cache_score=float(rng.choice([0.0, 0.2, 0.4, 0.7, 0.9])),
            pod_type=str(rng.choice(["", "prefill", "decode"])),
            prefill_tokens_in_flight=int(rng.integers(0, 5000)),
        )
        for _ in range(n)
    ]
    frame = LlmdFrame.from_rows(rows)
    x = feature_frame("ttft", frame)
    # Latency depends on the categories too, so that the trees split on them.
    y = 0.05 * x[:, 8] + 40 * x[:, 9] ** 2 + 100 * (x[:, 10] == 1) + rng.normal(0, 5, n) + 200
    for objective in ("mean", "quantile"):
        booster, compiled = fit_booster(model_type, "ttft", objective, x, y, 0.9, 42)
        library = booster.inplace_predict(x) if model_type == "xgboost" else booster.predict(x, num_threads=1)
        np.testing.assert_allclose(compiled.predict(x), library, rtol=1e-5, atol=1e-3)
        assert compiled.depth <= 6 and len(compiled.roots) == 200


def test_xgboost_is_the_default_where_installed() -> None:
    require_module("xgboost")
    ref = LlmdReference()
    assert ref.model_type == "xgboost"
    ref.fit([row(input_token_length=100 + i, actual_ttft_ms=50.0 + i, actual_tpot_ms=0) for i in range(100)])
    assert ref.status()["has_model"] == {"ttft": True, "tpot": False}
    with pytest.raises(ValueError, match="model must be one of"):
        _ = LlmdReference(model="bayesian").model_type


def test_the_docstring_example_runs() -> None:
    import doctest

    import leadtime.predictor.llmd_reference as module

    result = doctest.testmod(module)
    assert result.attempted >= 4 and result.failed == 0


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"retrain_every": 0}, "retrain_every"),
        ({"retrain_every": -5}, "retrain_every"),
        ({"retrain_every": 2.5}, "retrain_every"),
        ({"model": "catboost"}, "model"),
        ({"quantile": 1.5}, "quantile"),
        ({"quantile": float("nan")}, "quantile"),
        ({"objectives": ("median",)}, "objectives"),
        ({"objectives": ()}, "objectives"),
        ({"bucket_size": 0}, "bucket_size"),
        ({"test_share": 1.0}, "test_share"),
        ({"ensemble_min_rows": 0}, "ensemble_min_rows"),
        ({"min_rows": 0}, "min_rows"),
        ({"seed": "42"}, "seed"),
    ],
)
def test_a_setting_that_cannot_work_is_refused_at_construction_naming_it(settings: dict[str, Any], named: str) -> None:
    """`retrain_every=0` made `learn_many` loop for ever; a quantile of 1.5 or an unknown model failed at the first
    retrain, after rows had gone into the store (LightGBM printing a Fatal line); `objectives=("median",)` trained
    nothing and predicted None for everything, silently."""
    with pytest.raises(ValueError, match=named):
        LlmdReference(**settings)


def test_the_settings_llm_d_and_the_benchmarks_use_are_taken() -> None:
    assert LlmdReference().retrain_every == 100
    assert LlmdReference(retrain_every=None).retrain_every is None
    assert LlmdReference(objectives=["quantile"]).objectives == ("quantile",)
    assert LlmdReference(model=None, test_share=0.0).test_share == 0.0


def test_a_row_that_is_not_llm_d_s_names_the_row_and_the_field() -> None:
    """A value that is not a number said only "could not convert string to float: 'abc'", a list "float() argument
    must be a string or a real number", and a row that is not a mapping "'int' object has no attribute 'get'"."""
    ref = LlmdReference(model="lightgbm")
    with pytest.raises(ValueError, match=r"rows\[1\].input_token_length must be a number, got 'abc'"):
        ref.predict_many([row(), row(input_token_length="abc")])
    with pytest.raises(ValueError, match=r"rows\[0\].actual_ttft_ms must be a number, got \[1\]"):
        ref.learn_many([row(actual_ttft_ms=[1])])
    with pytest.raises(TypeError, match=r"rows\[0\] must be a mapping of llm-d's fields, got int"):
        ref.predict_many([5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="takes a sequence of rows; got one row"):
        ref.predict_many(row())  # type: ignore[arg-type]
    assert ref.status()["training_rows"] == {"ttft": 0, "tpot": 0}
