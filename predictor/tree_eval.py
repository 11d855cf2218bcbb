"""Gradient-boosted tree ensembles (XGBoost or LightGBM) evaluated with numpy, for small batches.

A router that predicts for every candidate endpoint of every request calls a model once per request on 10–100
rows; both libraries spend much of such a call on fixed costs (input conversion, thread set-up). Here every tree
of a model steps down one level at a time for all rows at once: four array gathers per level, whatever the
number of trees. The compiled form is exact: tests compare it with the library's own predictions.

Supported is what the llm-d reference trains: numerical splits, categorical splits on small integer categories
(< 64; each distinct category set becomes a 0/1 column computed per call), no missing values (NaN is refused:
llm-d's rows have none), a regression output (identity link) plus the model's base score.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAX_CATEGORY = 63


@dataclass(frozen=True)
class CompiledEnsemble:
    """Every tree's nodes in flat arrays. A leaf's two children are itself, so extra steps keep a row there.

    A row goes right at a node when its value is above the node's threshold (XGBoost: at or above, compared in
    float32, as XGBoost does); categorical splits read a 0/1 column (1 = not in the set sent left).
    """

    feature: np.ndarray  # int64 per node (columns past the input's are the categorical 0/1 columns)
    threshold: np.ndarray  # per node
    children: np.ndarray  # int64, 2 per node: [left, right]
    value: np.ndarray  # float64 per node (leaf values; 0 for inner nodes)
    roots: np.ndarray  # int64 per tree
    depth: int
    base: float
    strict: bool  # XGBoost's `x < threshold goes left`, in float32
    categorical: tuple[tuple[int, np.ndarray], ...]  # per extra column: (input column, lookup code → 0/1)
    width: int  # input columns

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The ensemble's raw output per row of `x` (as the library's own predict)."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.width:
            raise ValueError(f"x must have shape (n, {self.width}), got {x.shape}")
        if np.isnan(x).any():
            raise ValueError("the compiled trees take no missing values (NaN)")
        n = len(x)
        if n == 0 or len(self.roots) == 0:
            return np.full(n, self.base)
        if self.categorical:
            extra = [lut[np.clip(x[:, col], 0, _MAX_CATEGORY).astype(np.int64)] for col, lut in self.categorical]
            x = np.column_stack([x, *extra])
        values = (x.astype(np.float32) if self.strict else x).ravel()
        offsets = np.arange(n, dtype=np.int64) * x.shape[1]
        node = np.repeat(self.roots, n)
        offsets = np.tile(offsets, len(self.roots))
        feature, threshold, children = self.feature, self.threshold, self.children
        for _ in range(self.depth):
            v = values.take(offsets + feature.take(node))
            t = threshold.take(node)
            right = v >= t if self.strict else v > t
            node = children.take(2 * node + right)
        leaves = self.value.take(node).reshape(len(self.roots), n)
        total: np.ndarray = leaves.sum(axis=0) + self.base
        return total


def _mask(categories: list[int]) -> int:
    mask = 0
    for c in categories:
        if not 0 <= int(c) <= _MAX_CATEGORY:
            raise ValueError(f"category {c} is outside 0..{_MAX_CATEGORY}")
        mask |= 1 << int(c)
    return mask


class _Builder:
    def __init__(self, width: int) -> None:
        self.width = width
        self.feature: list[int] = []
        self.threshold: list[float] = []
        self.left: list[int] = []
        self.right: list[int] = []
        self.value: list[float] = []
        self.roots: list[int] = []
        self.depth = 0
        self.categorical: dict[tuple[int, int], int] = {}  # (input column, left mask) → extra column

    def node(self) -> int:
        g = len(self.feature)
        self.feature.append(0)
        self.threshold.append(np.inf)
        self.left.append(g)
        self.right.append(g)
        self.value.append(0.0)
        return g

    def categorical_split(self, g: int, column: int, left_mask: int) -> None:
        key = (column, left_mask)
        if key not in self.categorical:
            self.categorical[key] = self.width + len(self.categorical)
        self.feature[g] = self.categorical[key]
        self.threshold[g] = 0.5

    def build(self, base: float, strict: bool) -> CompiledEnsemble:
        dtype = np.float32 if strict else np.float64
        luts = []
        for (column, left_mask), _ in sorted(self.categorical.items(), key=lambda item: item[1]):
            lut = np.array([0.0 if left_mask >> c & 1 else 1.0 for c in range(_MAX_CATEGORY + 1)])
            luts.append((column, lut))
        children = np.empty(2 * len(self.left), dtype=np.int64)
        children[0::2], children[1::2] = self.left, self.right
        return CompiledEnsemble(
            feature=np.array(self.feature, dtype=np.int64),
            threshold=np.array(self.threshold, dtype=dtype),
            children=children,
            value=np.array(self.value, dtype=np.float64),
            roots=np.array(self.roots, dtype=np.int64),
            depth=self.depth,
            base=base,
            strict=strict,
            categorical=tuple(luts),
            width=self.width,
        )


def compile_xgboost(booster: Any) -> CompiledEnsemble:
    """An `xgboost.Booster` (one regression output) → CompiledEnsemble."""
    model = json.loads(booster.save_raw("json"))
    learner = model["learner"]
    base = float(np.float32(float(str(learner["learner_model_param"]["base_score"]).strip("[]"))))
    b = _Builder(int(learner["learner_model_param"]["num_feature"]))
    for tree in learner["gradient_booster"]["model"]["trees"]:
        offset = len(b.feature)
        lefts, rights = tree["left_children"], tree["right_children"]
        cats_of = {
            node: tree["categories"][start : start + size]
            for node, start, size in zip(
                tree["categories_nodes"], tree["categories_segments"], tree["categories_sizes"], strict=True
            )
        }
        depth = {0: 0}
        for _ in lefts:
            b.node()
        for i in range(len(lefts)):  # XGBoost numbers children after their parents
            g = offset + i
            if lefts[i] == -1:
                b.value[g] = float(np.float32(tree["split_conditions"][i]))
                continue
            column = int(tree["split_indices"][i])
            b.left[g], b.right[g] = offset + lefts[i], offset + rights[i]
            depth[lefts[i]] = depth[rights[i]] = depth[i] + 1
            if int(tree["split_type"][i]) == 1:
                # XGBoost sends the categories listed at a node to the right.
                everything = (1 << (_MAX_CATEGORY + 1)) - 1
                b.categorical_split(g, column, everything & ~_mask(cats_of.get(i, [])))
            else:
                b.feature[g] = column
                b.threshold[g] = float(tree["split_conditions"][i])
        b.roots.append(offset)
        b.depth = max(b.depth, max(depth.values()))
    return b.build(base, strict=True)


def compile_lightgbm(booster: Any) -> CompiledEnsemble:
    """A `lightgbm.Booster` (regression or quantile objective) → CompiledEnsemble."""
    model = booster.dump_model()
    b = _Builder(int(model["max_feature_idx"]) + 1)

    def add(node: dict[str, Any], level: int) -> int:
        g = b.node()
        if "split_feature" not in node:
            b.value[g] = float(node.get("leaf_value", 0.0))
            b.depth = max(b.depth, level)
            return g
        column = int(node["split_feature"])
        if node["decision_type"] == "==":  # LightGBM sends the categories listed at a node to the left
            b.categorical_split(g, column, _mask([int(c) for c in str(node["threshold"]).split("||")]))
        else:
            b.feature[g] = column
            b.threshold[g] = float(node["threshold"])
        b.left[g] = add(node["left_child"], level + 1)
        b.right[g] = add(node["right_child"], level + 1)
        return g

    for tree in model["tree_info"]:
        b.roots.append(add(tree["tree_structure"], 0))
    return b.build(0.0, strict=False)
