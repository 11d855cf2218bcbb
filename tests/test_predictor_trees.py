"""Compiled residual trees return exactly what LightGBM's Booster.predict returns, or leave the booster to it."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable

import lightgbm as lgb
import numpy as np
import pytest

import leadtime.predictor.trees as trees_module
from leadtime.predictor.trees import (
    TREE_FEATURES,
    ResidualTrees,
    TextBooster,
    check_lightgbm_text,
    compile_booster,
    compile_text,
    fit_booster,
)

WIDTH = len(TREE_FEATURES)
K_ZERO = float(np.float32(1e-35))  # LightGBM's kZeroThreshold
ROW_COUNTS = (1, 2, 7, 100, 257, 10_000)  # 257: a last block of one row


def _features(rng: np.random.Generator, n: int) -> np.ndarray:
    """Columns shaped like the service's: token counts, small queue counts (often 0), 0/1 flags, continuous."""
    x = np.empty((n, WIDTH))
    for j in range(WIDTH):
        kind = j % 4
        if kind == 0:
            x[:, j] = rng.integers(1, 8000, n)
        elif kind == 1:
            x[:, j] = rng.poisson(0.7, n)
        elif kind == 2:
            x[:, j] = rng.integers(0, 2, n)
        else:
            x[:, j] = rng.lognormal(0, 1, n)
    return x


def _target(rng: np.random.Generator, x: np.ndarray) -> np.ndarray:
    return np.sin(x[:, 0] / 1000) + 0.3 * x[:, 2] + 0.1 * x[:, 1] + 0.2 * np.log(x[:, 3]) + rng.normal(0, 0.1, len(x))


def _splits(booster: lgb.Booster) -> list[dict]:
    found: list[dict] = []

    def walk(node: dict) -> None:
        if "leaf_value" not in node:
            found.append(node)
            walk(node["left_child"])
            walk(node["right_child"])

    for info in booster.dump_model()["tree_info"]:
        walk(info["tree_structure"])
    return found


def _thresholds(booster: lgb.Booster) -> dict[int, list[float]]:
    found: dict[int, list[float]] = {}
    for node in _splits(booster):
        found.setdefault(node["split_feature"], []).append(node["threshold"])
    return found


def _hard_inputs(booster: lgb.Booster, n: int, seed: int) -> np.ndarray:
    """Realistic rows with cells replaced by values on, just under and just over the model's thresholds, and by
    NaN, ±inf, ±huge, ±0 and tiny values (|x| <= kZeroThreshold reads as 0 in LightGBM)."""
    rng = np.random.default_rng(seed)
    x = _features(rng, n)
    special = np.array([np.nan, np.inf, -np.inf, 1e308, -1e308, 0.0, -0.0, 1e-40, -1e-40, K_ZERO, -K_ZERO, 1e-30])
    for feature, thresholds in _thresholds(booster).items():
        t = np.array(thresholds)
        near = np.concatenate([t, np.nextafter(t, np.inf), np.nextafter(t, -np.inf), special])
        pick = rng.random(n) < 0.4
        x[pick, feature] = rng.choice(near, size=int(pick.sum()))
    x[rng.random(x.shape) < 0.05] = np.nan
    return x


def _assert_parity(booster: lgb.Booster, seed: int = 1) -> None:
    """Compiled from the booster (checked on probe rows) and from its text alone (what a loading process does,
    without LightGBM), the trees give LightGBM's numbers, and both forms are the one LightGBM's JSON dump gives."""
    compiled, from_text = compile_booster(booster), compile_text(booster.model_to_string())
    assert compiled is not None and from_text is not None
    from_dump = trees_module._compile(booster.dump_model())
    for field in dataclasses.fields(from_dump):
        np.testing.assert_array_equal(getattr(from_text, field.name), getattr(from_dump, field.name), field.name)
    for n in ROW_COUNTS:
        x = _hard_inputs(booster, n, seed + n)
        expected = booster.predict(x, num_threads=1)
        np.testing.assert_array_equal(compiled.predict(x), expected)
        np.testing.assert_array_equal(from_text.predict(x), expected)


@pytest.fixture(scope="module")
def training() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = _features(rng, 3000)
    return x, _target(rng, x)


@pytest.mark.parametrize("target", ["ttft", "tpot"])
@pytest.mark.parametrize("objective", ["regression", "quantile"])
def test_real_boosters_match_lightgbm_exactly(target: str, objective: str, training: tuple) -> None:
    x, y = training
    booster = fit_booster(target, objective, 0.9, x, y, rounds=60, seed=3)
    assert len(_splits(booster)) > 200
    _assert_parity(booster)


def test_nan_aware_splits_send_missing_values_their_default_way(training: tuple) -> None:
    x, y = training
    x = x.copy()
    holes = np.random.default_rng(5).random(x.shape) < 0.2
    holes[:, 1::2] = False  # NaN in half the columns: splits of both missing types
    x[holes] = np.nan
    booster = fit_booster("ttft", "regression", 0.9, x, y, rounds=60, seed=3)
    assert {node["missing_type"] for node in _splits(booster)} == {"None", "NaN"}
    assert {node["default_left"] for node in _splits(booster) if node["missing_type"] == "NaN"} == {True, False}
    _assert_parity(booster)


def test_a_constant_booster_of_single_leaves(training: tuple) -> None:
    x, _ = training
    booster = fit_booster("tpot", "regression", 0.9, x, np.full(len(x), 0.25), rounds=60, seed=3)
    assert all(info["num_leaves"] == 1 for info in booster.dump_model()["tree_info"])
    _assert_parity(booster)


def test_thresholds_inside_the_zero_band_read_tiny_values_as_zero(training: tuple) -> None:
    """LightGBM itself never puts a threshold in [-kZero, kZero); edit the text model to make sure that if one is
    there, tiny inputs still land where LightGBM puts them (the edits keep each tree's byte length)."""
    x, y = training
    text = fit_booster("ttft", "regression", 0.9, x, y, rounds=60, seed=3).model_to_string()
    assert text.count("1.0000000180025095e-35") >= 2
    for replacement in ("-1.000000018002509e-35", "0.0000000000000000e+00"):
        edited = lgb.Booster(model_str=text.replace("1.0000000180025095e-35", replacement, 2))
        compiled = compile_booster(edited)
        assert compiled is not None and compiled.zero_small
        _assert_parity(edited)


@pytest.mark.parametrize(
    ("params", "categorical", "reason"),
    [
        ({"num_leaves": 31}, [], "splits"),
        ({"zero_as_missing": True}, [], "missing type Zero"),
        ({"min_data_per_group": 5, "cat_smooth": 1}, [1], "categorical split"),
        ({"linear_tree": True}, [], "linear tree"),
        ({"objective": "poisson"}, [], "objective 'poisson'"),
    ],
)
def test_what_it_cannot_reproduce_stays_with_lightgbm(
    params: dict, categorical: list[int], reason: str, training: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    x, y = training
    base = {"objective": "regression", "num_leaves": 4, "verbosity": -1, "num_threads": 1, "seed": 1}
    label = np.abs(y) + 2.0 * np.isin(x[:, 1], [1, 3])  # column 1 matters as a category, not as an order
    dataset = lgb.Dataset(x, label, feature_name=list(TREE_FEATURES), categorical_feature=categorical or "auto")
    booster = lgb.train({**base, **params}, dataset, num_boost_round=5)
    with caplog.at_level(logging.DEBUG, logger="leadtime.predictor"):
        assert compile_booster(booster) is None
    assert reason in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="leadtime.predictor"):
        assert compile_text(booster.model_to_string()) is None
    assert reason in caplog.text
    probe = _features(np.random.default_rng(7), 200)
    probe[::7, 1] = np.nan
    trees = ResidualTrees(mean=booster, upper=booster)
    np.testing.assert_array_equal(trees.predict_mean(probe), booster.predict(probe, num_threads=1))
    np.testing.assert_array_equal(trees.predict_upper(probe), booster.predict(probe, num_threads=1))


def _fitted_pair(training: tuple, target: str) -> tuple[lgb.Booster, lgb.Booster, ResidualTrees]:
    """A mean and an upper-quantile booster for `target`, and the ResidualTrees serving them."""
    x, y = training
    mean = fit_booster(target, "regression", 0.9, x, y, rounds=60, seed=3)
    upper = fit_booster(target, "quantile", 0.9, x, y, rounds=60, seed=3)
    return mean, upper, ResidualTrees(mean=mean, upper=upper)


def test_residual_trees_predict_like_their_boosters(training: tuple) -> None:
    mean, upper, trees = _fitted_pair(training, "ttft")
    probe = _hard_inputs(mean, 100, 11)
    np.testing.assert_array_equal(trees.predict_mean(probe), mean.predict(probe, num_threads=1))
    np.testing.assert_array_equal(trees.predict_upper(probe), upper.predict(probe, num_threads=1))
    assert ResidualTrees().predict_mean(probe) is None and ResidualTrees(mean=mean).predict_upper(probe) is None

    loaded = ResidualTrees.from_dict(trees.to_dict())
    np.testing.assert_array_equal(loaded.predict_mean(probe), trees.predict_mean(probe))
    np.testing.assert_array_equal(loaded.predict_upper(probe), trees.predict_upper(probe))

    trees.mean = upper  # a swapped-in booster serves, not the compiled form of the old one
    np.testing.assert_array_equal(trees.predict_mean(probe), upper.predict(probe, num_threads=1))


def test_inputs_it_does_not_take_go_to_lightgbm(training: tuple) -> None:
    x, y = training
    booster = fit_booster("ttft", "regression", 0.9, x, y, rounds=60, seed=3)
    trees = ResidualTrees(mean=booster)
    probe = _features(np.random.default_rng(2), 50)
    as_float32 = probe.astype(np.float32)
    np.testing.assert_array_equal(trees.predict_mean(as_float32), booster.predict(as_float32, num_threads=1))
    fortran = np.asfortranarray(probe)
    np.testing.assert_array_equal(trees.predict_mean(fortran), booster.predict(probe, num_threads=1))
    empty = trees.predict_mean(np.empty((0, WIDTH)))
    assert empty is not None and empty.shape == (0,)
    with pytest.raises(lgb.basic.LightGBMError):
        trees.predict_mean(probe[:, :-1])


def test_a_compiled_form_that_disagrees_or_fails_is_not_used(training: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe-row check at compile time: a LightGBM whose semantics moved must not get wrong numbers served."""
    x, y = training
    real_compile = trees_module._compile

    def off_by_a_bit(model: dict) -> trees_module.CompiledTrees:
        compiled = real_compile(model)
        return dataclasses.replace(compiled, leaf_table=compiled.leaf_table + 1e-9)

    def broken(model: dict) -> trees_module.CompiledTrees:
        raise KeyError("tree_structure")

    for bad in (off_by_a_bit, broken):
        monkeypatch.setattr(trees_module, "_compile", bad)
        booster = fit_booster("ttft", "regression", 0.9, x, y, rounds=20, seed=3)
        assert compile_booster(booster) is None
        probe = _features(np.random.default_rng(4), 30)
        np.testing.assert_array_equal(
            ResidualTrees(mean=booster).predict_mean(probe), booster.predict(probe, num_threads=1)
        )


def test_trees_loaded_with_their_compiled_forms_stay_text_until_lightgbm_is_needed(training: tuple) -> None:
    mean, upper, trees = _fitted_pair(training, "tpot")
    probe = _hard_inputs(mean, 100, 12)
    loaded = ResidualTrees.from_dict(trees.to_dict(), compiled=trees.compiled)
    assert isinstance(loaded.mean, TextBooster) and isinstance(loaded.upper, TextBooster)
    np.testing.assert_array_equal(loaded.predict_mean(probe), mean.predict(probe, num_threads=1))
    np.testing.assert_array_equal(loaded.predict_upper(probe), upper.predict(probe, num_threads=1))
    assert loaded.to_dict() == trees.to_dict()
    assert loaded.mean._booster is None  # predicting and serializing never parsed it
    # What the compiled form does not take goes to LightGBM, parsed on first use (importances are read from the text).
    as_float32 = np.clip(probe, -1e30, 1e30).astype(np.float32)
    np.testing.assert_array_equal(loaded.predict_mean(as_float32), mean.predict(as_float32, num_threads=1))
    np.testing.assert_array_equal(
        loaded.mean.feature_importance(importance_type="gain"), mean.feature_importance(importance_type="gain")
    )
    # Text is still checked before it is kept: a truncated model is refused at load, not at first use.
    broken = dict(trees.to_dict())
    broken["mean"] = str(broken["mean"])[: len(str(broken["mean"])) // 2]
    with pytest.raises(ValueError, match="LightGBM text"):
        ResidualTrees.from_dict(broken, compiled=trees.compiled)


@pytest.mark.parametrize("objective", ["regression", "quantile"])
def test_a_text_boosters_importances_are_read_from_its_text_as_lightgbm_gives_them(
    objective: str, training: tuple
) -> None:
    """Importances parsed LightGBM's booster from the text, importing LightGBM (and scikit-learn, scipy, pandas
    through it: ~1 s and ~150 MB) into a service that otherwise predicts with compiled trees, at the first /metrics
    scrape after trees existed."""
    x, y = training
    for booster in (
        fit_booster("ttft", objective, 0.9, x, y, rounds=60, seed=3),
        fit_booster("tpot", objective, 0.9, x, np.full(len(x), 0.25), rounds=10, seed=3),  # single leaves
    ):
        text = TextBooster(booster.model_to_string())
        parsed = lgb.Booster(model_str=booster.model_to_string())  # what the service's text gave before
        for kind in ("gain", "split"):
            np.testing.assert_allclose(
                text.feature_importance(importance_type=kind),
                parsed.feature_importance(importance_type=kind),
                rtol=1e-12,
            )
        assert text._booster is None  # not parsed by LightGBM


def test_text_that_does_not_read_as_trees_is_left_to_lightgbm(training: tuple) -> None:
    """A loading process compiles the trees from their text; text it cannot follow (a split reached twice, lists
    of different lengths, an unknown missing type, other features) gives no compiled form, never an exception or
    a loop."""
    x, y = training
    text = fit_booster("ttft", "regression", 0.9, x, y, rounds=5, seed=3).model_to_string()
    assert compile_text(text) is not None
    tree = text.index("Tree=0\n")

    def edit_first(key: str, change: Callable[[list[str]], list[str]]) -> str:
        start = text.index(f"\n{key}=", tree) + len(key) + 2
        end = text.index("\n", start)
        return text[:start] + " ".join(change(text[start:end].split())) + text[end:]

    broken = [
        edit_first("left_child", lambda v: ["0", *v[1:]]),  # the root is its own left child
        edit_first("right_child", lambda v: v[:-1]),
        edit_first("decision_type", lambda v: ["14", *v[1:]]),  # missing type 3 does not exist
        edit_first("leaf_value", lambda v: ["x", *v[1:]]),
        text.replace("feature_names=", "feature_names=other_", 1),
        text.replace("\nend of trees", "", 1),
    ]
    for edited in broken:
        assert compile_text(edited) is None


def _sized(text: str) -> str:
    """`text` with its header's tree_sizes made right again after an edit (as a crafted model would have them)."""
    encoded = text.encode()
    starts = [m.start() for m in re.finditer(rb"Tree=\d+\n", encoded)] + [encoded.find(b"end of trees")]
    sizes = " ".join(str(b - a) for a, b in zip(starts, starts[1:], strict=False))
    return re.sub(r"tree_sizes=.*", "tree_sizes=" + sizes, text, count=1)


def test_a_tree_that_indexes_outside_the_model_is_refused_before_lightgbm_reads_it(training: tuple) -> None:
    """A model with a correct checksum and tree sizes, one split naming feature #100,000,000, made LightGBM (and so
    the service at every start, and a gateway pulling it) die of a segmentation fault; with few leaves the
    compiled evaluator served 500s instead. A tree must index only the model's features, splits and leaves."""
    x, y = training
    text = fit_booster("ttft", "regression", 0.9, x, y, rounds=5, seed=3).model_to_string()
    check_lightgbm_text(text)
    tree = text.index("Tree=0\n")

    def edit_first(key: str, change: Callable[[list[str]], list[str]]) -> str:
        start = text.index(f"\n{key}=", tree) + len(key) + 2
        end = text.index("\n", start)
        return _sized(text[:start] + " ".join(change(text[start:end].split())) + text[end:])

    crafted = {
        "split_feature": edit_first("split_feature", lambda v: ["100000000", *v[1:]]),
        "negative feature": edit_first("split_feature", lambda v: ["-1", *v[1:]]),
        "left_child": edit_first("left_child", lambda v: ["5000", *v[1:]]),
        "right_child": edit_first("right_child", lambda v: ["-5000", *v[1:]]),
        "max_feature_idx": _sized(text.replace("max_feature_idx=", "max_feature_idx=9", 1)),
        "categorical": edit_first("decision_type", lambda v: [str(int(v[0]) | 1), *v[1:]]),
    }
    for what, edited in crafted.items():
        with pytest.raises(ValueError, match="LightGBM text"):
            check_lightgbm_text(edited)
        assert compile_text(edited) is None, what
