"""LightGBM refinements of the online model's residual, trained in the background on the sample window.

The trees never replace the physics: they learn what is left of log(actual) after prior × online correction,
so they add structure the linear correction cannot express (interactions, thresholds) without having to
extrapolate load levels they have not seen. A candidate is fitted on four fifths of the window and accepted only
if it beats the current serving model on the rest: every fifth row across the window, not the newest
(`target.heldout_rows` says why). A serving tree that then does worse on the rows after it is retired
(`forward`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import lightgbm as lgb

from leadtime.features.vectorize import COLUMNS

log = logging.getLogger("leadtime.predictor")

TREE_FEATURES: tuple[str, ...] = (*COLUMNS, "log_prior")

# Physics says these never lower the target: more queued work never makes the first token come sooner,
# a bigger running batch never makes a decode step faster.
_MONOTONE_INCREASING = {
    "ttft": ("num_request_waiting", "prefill_tokens_in_flight", "uncached_tokens"),
    "tpot": ("num_request_running", "kv_cache_percentage", "decode_tokens_in_flight"),
}


def monotone_constraints(target: str) -> list[int]:
    """LightGBM's monotone constraints for `target` over TREE_FEATURES (more load never means faster)."""
    up = _MONOTONE_INCREASING[target]
    return [1 if name in up else 0 for name in TREE_FEATURES]


def tree_params(target: str, objective: str, quantile: float, seed: int) -> dict[str, Any]:
    """LightGBM parameters of one residual tree."""
    params: dict[str, Any] = {
        "objective": objective,
        # Small trees, few rounds: they refine a residual, and they sit on the prediction hot path, where
        # LightGBM's cost grows with trees × leaves (120 × 15 cost ~4x the 60 × 7 used here, 100 rows).
        "learning_rate": 0.1,
        "num_leaves": 7,
        "max_depth": 4,
        "min_data_in_leaf": 20,
        "lambda_l2": 1.0,
        "feature_fraction": 0.9,
        "bagging_fraction": 0.9,
        "bagging_freq": 1,
        "num_threads": 1,
        "seed": seed,
        "deterministic": True,
        "force_row_wise": True,
        "verbosity": -1,
    }
    if objective == "quantile":
        # LightGBM refuses monotone constraints with the quantile objective; the upper quantile is
        # monotone through the point prediction it is added to and the floor at the point prediction.
        params["alpha"] = quantile
    else:
        params["monotone_constraints"] = monotone_constraints(target)
        params["monotone_constraints_method"] = "advanced"
    return params


def fit_booster(
    target: str, objective: str, quantile: float, x: np.ndarray, y: np.ndarray, rounds: int, seed: int
) -> lgb.Booster:
    """Fit one residual tree (mean or quantile objective) on the features and log residuals given."""
    import lightgbm as lgb  # lazily: ~0.9 s of imports (sklearn, scipy.stats) a run without trees never needs

    data = lgb.Dataset(x, label=y, feature_name=list(TREE_FEATURES), free_raw_data=True)
    return lgb.train(tree_params(target, objective, quantile, seed), data, num_boost_round=rounds)


def check_lightgbm_text(text: str) -> None:
    """Refuse text that is not a complete LightGBM model *before* LightGBM parses it.

    LightGBM's parser aborts the whole process on some malformed inputs (a truncated model, say), so a corrupt
    artifact must be caught here: the header must declare the tree sizes, and each tree must sit at the place
    and with the length the header says.
    """
    if not text.startswith("tree\n"):
        raise ValueError("tree model is not LightGBM text")
    header_end = text.find("\n\n")
    if header_end < 0:
        raise ValueError("tree model is not LightGBM text: no header")
    sizes_line = [ln for ln in text[:header_end].split("\n") if ln.startswith("tree_sizes=")]
    if len(sizes_line) != 1:
        raise ValueError("tree model is not LightGBM text: no tree_sizes")
    try:
        sizes = [int(v) for v in sizes_line[0][len("tree_sizes=") :].split()]
    except ValueError:
        raise ValueError("tree model is not LightGBM text: bad tree_sizes") from None
    encoded = text.encode()
    position = len(text[: header_end + 2].encode())
    for i, size in enumerate(sizes):
        if size <= 0 or not encoded.startswith(f"Tree={i}\n".encode(), position):
            raise ValueError(f"tree model is not LightGBM text: tree {i} is missing or misplaced (truncated?)")
        position += size
    end_of_trees = encoded.find(b"end of trees", position)
    if end_of_trees < 0 or encoded.find(b"\nend of parameters\n", end_of_trees) < 0:
        raise ValueError("tree model is not LightGBM text: it is truncated")
    if not encoded.rstrip(b"\n").rsplit(b"\n", 1)[-1].startswith(b"pandas_categorical:"):
        raise ValueError("tree model is not LightGBM text: it is truncated")
    _check_indices(*_text_sections(text))


def _check_indices(header: dict[str, str], blocks: list[dict[str, str]]) -> None:
    """Refuse trees that index outside the model: LightGBM trusts a model's indices, and one split naming feature
    #100,000,000 (with a checksum and tree sizes made right) killed the process that parsed it with a segmentation
    fault, a service at every start. A model this project fits has TREE_FEATURES' features, no categorical split,
    and in each tree a split's children are its other splits or its leaves."""
    try:
        if int(header.get("max_feature_idx", "-1")) != len(TREE_FEATURES) - 1:
            raise ValueError(f"max_feature_idx is not {len(TREE_FEATURES) - 1}")
        if header.get("feature_names", "").split() != list(TREE_FEATURES):
            raise ValueError("the features are not the ones the trees are fitted on")
        for i, fields in enumerate(blocks):
            leaves = int(fields["num_leaves"])
            splits = {key: [int(v) for v in fields.get(key, "").split()] for key in _INDEXED}
            if leaves < 1 or any(len(values) != leaves - 1 for values in splits.values()):
                raise ValueError(f"tree {i}: its split lists do not match its {leaves} leaves")
            if int(fields.get("num_cat", "0")) or any(d & 1 for d in splits["decision_type"]):
                raise ValueError(f"tree {i}: a categorical split")
            if any(not 0 <= f < len(TREE_FEATURES) for f in splits["split_feature"]):
                raise ValueError(f"tree {i}: a split on a feature the model does not have")
            children = splits["left_child"] + splits["right_child"]
            if any(not (0 <= c < leaves - 1 if c >= 0 else ~c < leaves) for c in children):
                raise ValueError(f"tree {i}: a child that is neither one of its splits nor one of its leaves")
    except (KeyError, ValueError) as err:
        raise ValueError(f"tree model is not LightGBM text Leadtime could have written: {err}") from None


_INDEXED = ("split_feature", "decision_type", "left_child", "right_child")


# LightGBM's kZeroThreshold (a float literal widened to double): when LightGBM reads a dense row it drops every
# value with |x| <= this, so such a value reaches the trees as exactly 0.0.
_ZERO_THRESHOLD = float(np.float32(1e-35))
# Each tree's split outcomes are packed into one uint8 code (bit k: split k sent the row left), which indexes a
# table of 2**splits leaf values per tree: 8 splits (num_leaves 9) keep that table at 256 entries a tree.
_MAX_SPLITS = 8
# Rows evaluated per pass: a pass's temporaries grow as splits × rows, and passes over ~1000 rows (megabytes of
# fresh memory per call) measured 2-3x slower per row than passes of 256.
_BLOCK_ROWS = 256
# dump_model() writes an infinite threshold as ±1e300; such a model is left to LightGBM rather than guessed at.
_MAX_THRESHOLD = 1e300


class _Unsupported(ValueError):
    """The booster uses something CompiledTrees does not reproduce exactly; LightGBM keeps predicting it."""


@dataclass(frozen=True)
class CompiledTrees:
    """A small LightGBM regression booster as flat arrays, evaluated for all rows and all trees at once.

    Why: ``Booster.predict`` costs ~70 µs of Python wrapper per call plus ~1-2 µs per row, and serving calls it up
    to four times per request. Here every distinct (feature, threshold, side NaN takes) split is compared for all
    rows in one numpy operation, each tree's outcomes become a small integer code, a table maps code to leaf
    value, and the trees are summed in LightGBM's order, so the result is the same double LightGBM returns,
    including its handling of NaN (missing type None or NaN, default direction) and of values it reads as zero.
    """

    num_features: int
    pair_feature: np.ndarray  # (pairs,) the feature each distinct split compares
    pair_threshold: np.ndarray  # (pairs, 1) go left when x <= threshold
    pair_missing: np.ndarray  # (pairs, 1) what NaN becomes there: -inf goes left, +inf right (thresholds are finite)
    split_pair: np.ndarray  # (splits * trees,) split k of tree t (row k * trees + t) -> its pair
    bit: np.ndarray  # (splits,) uint8 weight of split k in a tree's code: 1 << k
    leaf_table: np.ndarray  # (trees * 2**splits,) leaf value for tree t, code c at t * 2**splits + c
    table_offset: np.ndarray  # (trees, 1) t * 2**splits
    zero_small: bool  # a threshold lies in [-kZeroThreshold, kZeroThreshold): tiny inputs must become 0.0

    def accepts(self, x: Any) -> bool:
        """Only a non-empty float64 matrix of the right width; anything else goes to LightGBM, errors included."""
        return (
            isinstance(x, np.ndarray)
            and x.dtype == np.float64
            and x.ndim == 2
            and x.shape[1] == self.num_features
            and x.shape[0] > 0
        )

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The trees' sum for every row, a block of rows at a time."""
        if len(x) <= _BLOCK_ROWS:
            return self._predict_block(x)
        return np.concatenate([self._predict_block(x[i : i + _BLOCK_ROWS]) for i in range(0, len(x), _BLOCK_ROWS)])

    def _predict_block(self, x: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        xt = np.ascontiguousarray(x.T)  # one row per feature: the gathers below copy whole rows
        if self.zero_small:
            xt = np.where(np.abs(xt) <= _ZERO_THRESHOLD, 0.0, xt)
        values = xt.take(self.pair_feature, axis=0)  # (pairs, rows)
        if np.isnan(xt.min()):  # min is NaN exactly when some value is (cheaper than isnan(xt).any())
            np.copyto(values, self.pair_missing, where=np.isnan(values))
        went_left = (values <= self.pair_threshold).take(self.split_pair, axis=0)  # (splits * trees, rows)
        splits = len(self.bit)
        codes = np.einsum("k,kn->n", self.bit, went_left.view(np.uint8).reshape(splits, -1))
        leaves = self.leaf_table.take(codes.reshape(-1, n) + self.table_offset)  # (trees, rows)
        # LightGBM adds tree after tree; a reduction along the slow axis does the same, while one along the fast
        # axis (a single row) would sum pairwise and differ in the last bits.
        return np.add.reduce(leaves, axis=0) if n > 1 else np.cumsum(leaves[:, 0])[-1:]


_Leaf = tuple[int, int, float]  # (mask, bits, value): a code c reaches the leaf when c & mask == bits


def _tree_paths(root: dict[str, Any]) -> tuple[list[dict[str, Any]], list[_Leaf]]:
    """A tree's splits in preorder and its leaves, each with the code bits its path fixes (bit k: split k went
    left)."""
    splits: list[dict[str, Any]] = []
    leaves: list[_Leaf] = []

    def walk(node: dict[str, Any], mask: int, bits: int) -> None:
        if "leaf_value" in node:
            if "leaf_coeff" in node:
                raise _Unsupported("linear tree")
            leaves.append((mask, bits, float(node["leaf_value"])))
            return
        if node["decision_type"] != "<=":
            raise _Unsupported("categorical split")
        if node["missing_type"] not in ("None", "NaN"):
            raise _Unsupported(f"missing type {node['missing_type']}")
        if not abs(float(node["threshold"])) < _MAX_THRESHOLD:
            raise _Unsupported("infinite threshold")
        bit = 1 << len(splits)
        splits.append(node)
        walk(node["left_child"], mask | bit, bits | bit)
        walk(node["right_child"], mask | bit, bits)

    walk(root, 0, 0)
    return splits, leaves


def _compile(model: dict[str, Any]) -> CompiledTrees:
    objective = str(model.get("objective", "")).split()
    if not objective or objective[0] not in ("regression", "quantile") or "sqrt" in objective:
        # Booster.predict applies the objective's output transform; these two have none (unless sqrt).
        raise _Unsupported(f"objective {' '.join(objective)!r}")
    if model.get("num_tree_per_iteration") != 1 or model.get("average_output"):
        raise _Unsupported("not a single-output boosted model")
    trees = [_tree_paths(info["tree_structure"]) for info in model["tree_info"]]
    if not trees:
        raise _Unsupported("no trees")
    num_splits = max(1, *(len(splits) for splits, _ in trees))  # at least one (ignored) split keeps shapes simple
    if num_splits > _MAX_SPLITS:
        raise _Unsupported(f"a tree has {num_splits} splits")
    num_trees, width = len(trees), 1 << num_splits
    pairs: dict[tuple[int, float, bool], int] = {}  # (feature, threshold, NaN goes left) -> pair
    split_pair = np.zeros((num_splits, num_trees), dtype=np.intp)
    table = np.zeros((num_trees, width))
    codes = np.arange(width)
    for t, (splits, leaves) in enumerate(trees):
        for k, node in enumerate(splits):
            feature, threshold = int(node["split_feature"]), float(node["threshold"])
            # LightGBM reads NaN as 0.0 unless the split's missing type is NaN, which takes the default side.
            nan_left = bool(node["default_left"]) if node["missing_type"] == "NaN" else threshold >= 0.0
            split_pair[k, t] = pairs.setdefault((feature, threshold, nan_left), len(pairs))
        masks, bits, values = (np.array(column) for column in zip(*leaves, strict=True))
        reached = (codes[:, None] & masks) == bits  # (codes, leaves): each code reaches exactly one leaf
        table[t] = values[reached.argmax(axis=1)]
    thresholds = np.array([thr for _, thr, _ in pairs])
    zero_small = bool(np.any((thresholds >= -_ZERO_THRESHOLD) & (thresholds < _ZERO_THRESHOLD)))
    # Padding splits compare pair 0 (any pair would do: no leaf looks at their bit); single leaves need a dummy.
    pairs.setdefault((0, 0.0, True), len(pairs))
    pair_feature = np.array([f for f, _, _ in pairs], dtype=np.intp)
    pair_threshold = np.array([thr for _, thr, _ in pairs])
    pair_missing = np.array([-np.inf if left else np.inf for _, _, left in pairs])
    return CompiledTrees(
        num_features=int(model["max_feature_idx"]) + 1,
        pair_feature=pair_feature,
        pair_threshold=pair_threshold[:, None],
        pair_missing=pair_missing[:, None],
        split_pair=split_pair.ravel(),
        bit=(1 << np.arange(num_splits)).astype(np.uint8),
        leaf_table=table.ravel(),
        table_offset=(np.arange(num_trees) * width)[:, None],
        zero_small=zero_small,
    )


def _probe_rows(compiled: CompiledTrees, rows: int = 128) -> np.ndarray:
    """Rows sitting on, just under and just over every threshold, mixed with NaN, ±0, ±inf and tiny values."""
    rng = np.random.default_rng(0)
    special = [np.nan, 0.0, -0.0, _ZERO_THRESHOLD, -_ZERO_THRESHOLD, 1e-40, np.inf, -np.inf, 1e308, -1e308]
    x = np.empty((rows, compiled.num_features))
    thresholds = compiled.pair_threshold[:, 0]
    for f in range(compiled.num_features):
        mine = thresholds[compiled.pair_feature == f]
        near = np.concatenate([mine, np.nextafter(mine, np.inf), np.nextafter(mine, -np.inf), special])
        x[:, f] = rng.choice(near, size=rows)
    return x


_MISSING_TYPES = ("None", "Zero", "NaN")  # LightGBM's decision_type bits 2-3


def _text_sections(text: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """A LightGBM text model's header and each tree's block, as `key=value` fields (a bare line is a key with an
    empty value); ValueError without the line that ends the trees."""
    header: dict[str, str] = {}
    blocks: list[dict[str, str]] = []
    fields = header
    for line in text.splitlines():
        if line == "end of trees":
            return header, blocks
        key, has_value, value = line.partition("=")
        if key == "Tree":
            fields = {}
            blocks.append(fields)
        elif has_value:
            fields[key] = value
        elif line:
            fields[line] = ""
    raise ValueError("LightGBM text: no end of trees")


def _text_model(text: str) -> dict[str, Any]:
    """The parts of ``Booster.dump_model()`` that `_compile` reads, from a model's LightGBM text: compiling needs
    no LightGBM then (a process that only predicts never imports it). ValueError for text that does not hold.

    In the text each tree lists its splits by index: ``decision_type`` packs categorical (bit 0), default left
    (bit 1) and the missing type (bits 2-3); a child >= 0 is a split, a child < 0 is leaf ``~child``.
    """
    header, blocks = _text_sections(text)
    _check_indices(header, blocks)
    return {
        "objective": header.get("objective", ""),
        "num_tree_per_iteration": int(header.get("num_tree_per_iteration", "1")),
        "average_output": "average_output" in header,
        "max_feature_idx": int(header["max_feature_idx"]),
        "feature_names": header.get("feature_names", "").split(),
        "tree_info": [{"tree_structure": _text_tree(block)} for block in blocks],
    }


def _text_tree(fields: dict[str, str]) -> dict[str, Any]:
    """One tree of LightGBM text as dump_model's nested nodes."""

    def numbers(key: str, kind: type) -> list[Any]:
        return [kind(v) for v in fields.get(key, "").split()]

    leaf_value = numbers("leaf_value", float)
    if int(fields["num_leaves"]) != len(leaf_value) or not leaf_value:
        raise ValueError("LightGBM text: leaf count and leaf values differ")
    linear = fields.get("is_linear", "0") != "0"
    feature, threshold = numbers("split_feature", int), numbers("threshold", float)
    decision, left, right = numbers("decision_type", int), numbers("left_child", int), numbers("right_child", int)
    if not len(feature) == len(threshold) == len(decision) == len(left) == len(right) == len(leaf_value) - 1:
        raise ValueError("LightGBM text: a tree's split lists differ in length")
    seen: set[int] = set()

    def node(i: int) -> dict[str, Any]:
        if i < 0:
            leaf: dict[str, Any] = {"leaf_value": leaf_value[~i]}
            if linear:
                leaf["leaf_coeff"] = []
            return leaf
        if i in seen:
            raise ValueError("LightGBM text: a split is reached twice")
        seen.add(i)
        return {
            "split_feature": feature[i],
            "threshold": threshold[i],
            "decision_type": "==" if decision[i] & 1 else "<=",
            "default_left": bool(decision[i] & 2),
            "missing_type": _MISSING_TYPES[decision[i] >> 2 & 3],
            "left_child": node(left[i]),
            "right_child": node(right[i]),
        }

    return node(0 if feature else -1)


def compile_text(text: str) -> CompiledTrees | None:
    """A model's LightGBM text as CompiledTrees without LightGBM, or None when it must stay with LightGBM
    (anything `compile_booster` leaves to it, or text this parser does not read).

    Used where a model is loaded (from disk, the registry, a pull): there LightGBM would cost ~0.8 s of imports
    and ~140 MB. The probe-row check against LightGBM runs where LightGBM is loaded anyway, at every fit
    (`compile_booster` compiles from the same text), so a LightGBM that wrote a model this reads otherwise than
    itself never has one compiled there, and the tests compare this with LightGBM on every kind of tree.
    """
    try:
        model = _text_model(text)
        if model["feature_names"] != list(TREE_FEATURES):
            raise _Unsupported("trained on other features")
        return _compile(model)
    except _Unsupported as why:
        log.debug("residual trees need LightGBM: %s", why)
    except (ValueError, KeyError, IndexError) as err:
        log.debug("residual trees need LightGBM: their text does not read (%s)", err)
    return None


def compile_booster(booster: Booster) -> CompiledTrees | None:
    """The booster as CompiledTrees, or None when it must stay with LightGBM.

    None for anything not reproduced exactly (categorical or zero-as-missing splits, linear trees, more than 8
    splits in a tree, output transforms) and, as a guard against a LightGBM whose semantics moved, whenever the
    compiled form disagrees with ``Booster.predict`` on probe rows built around the model's own thresholds. It
    compiles the booster's text, as `compile_text` does where a model is loaded.
    """
    try:
        compiled = _compile(_text_model(booster.model_to_string()))
        probe = _probe_rows(compiled)
        agrees = np.allclose(compiled.predict(probe), booster.predict(probe, num_threads=1), rtol=1e-12, atol=1e-12)
    except _Unsupported as why:
        log.debug("residual trees predict through LightGBM: %s", why)
        return None
    except Exception:  # a speed-up must never keep a booster from serving
        log.warning("could not compile residual trees; predicting through LightGBM", exc_info=True)
        return None
    if not agrees:
        log.warning("compiled residual trees disagree with LightGBM on probe rows; predicting through LightGBM")
        return None
    return compiled


def _predict(booster: Booster, compiled: CompiledTrees | None, features: np.ndarray) -> np.ndarray:
    if compiled is not None and compiled.accepts(features):
        return compiled.predict(features)
    return np.asarray(booster.predict(features, num_threads=1))


def parse_booster(text: str, checked: bool = False) -> lgb.Booster:
    """LightGBM text → Booster, refusing malformed text before LightGBM sees it (`checked`: the caller did) and
    models of other features."""
    if not checked:
        check_lightgbm_text(text)
    import lightgbm as lgb

    booster = lgb.Booster(model_str=text)
    if booster.feature_name() != list(TREE_FEATURES):
        raise ValueError("tree model was trained on other features")
    return booster


class TextBooster:
    """A booster known by its LightGBM text and its compiled form, parsed by LightGBM only when something needs
    LightGBM itself (a booster without a compiled form, its JSON dump; importances are read from the text).

    The service receives each retrained model from its learner process with the trees already compiled, so it
    never needs the parsed boosters to predict; parsing four of them (~8 ms, much of it holding the GIL) at every
    retrain would stall the requests in flight.
    """

    def __init__(self, text: str) -> None:
        self._text = text
        self._booster: lgb.Booster | None = None
        self._importances: dict[str, np.ndarray] = {}  # read from the text once: it never changes
        self._lock = threading.Lock()

    def booster(self) -> lgb.Booster:
        """The LightGBM booster, parsed from its text on first use."""
        with self._lock:
            if self._booster is None:
                self._booster = parse_booster(self._text)
            return self._booster

    def model_to_string(self) -> str:
        """The LightGBM text the booster came from."""
        return self._text

    def predict(self, x: Any, num_threads: int = 1) -> Any:
        """LightGBM's predict on the parsed booster."""
        return self.booster().predict(x, num_threads=num_threads)

    def feature_importance(self, importance_type: str = "split") -> Any:
        """LightGBM's feature importances ("split": splits per feature; "gain": their gains summed), read from the
        text as LightGBM reads it: /metrics asks for them at every scrape, and parsing the booster would import
        LightGBM (with scikit-learn, scipy and pandas: ~1 s and ~150 MB) into a service that predicts without it."""
        if importance_type not in ("split", "gain"):
            return self.booster().feature_importance(importance_type=importance_type)
        with self._lock:
            if importance_type not in self._importances:
                self._importances[importance_type] = text_importances(self._text, importance_type)
            return self._importances[importance_type].copy()

    def feature_name(self) -> list[str]:
        """LightGBM's feature names."""
        return list(self.booster().feature_name())

    def dump_model(self) -> dict[str, Any]:
        """LightGBM's JSON dump of the trees."""
        return dict(self.booster().dump_model())


def text_importances(text: str, importance_type: str) -> np.ndarray:
    r"""Per feature of a LightGBM text model: its splits ("split") or their gains summed ("gain"), as
    `Booster.feature_importance` gives them for every tree (LightGBM keeps each gain as a float32, and sums them
    in double precision, tree by tree).

    >>> lines = ["max_feature_idx=2", "Tree=0", "split_feature=0 2 0", "split_gain=1.5 2 0.25", "Tree=1"]
    >>> text = "\n".join([*lines, "end of trees"])
    >>> text_importances(text, "split").tolist(), text_importances(text, "gain").tolist()
    ([2.0, 0.0, 1.0], [1.75, 0.0, 2.0])
    """
    header, blocks = _text_sections(text)
    if "max_feature_idx" not in header:
        raise ValueError("LightGBM text: no max_feature_idx")
    importances = np.zeros(int(header["max_feature_idx"]) + 1, dtype=np.float64)
    for block in blocks:
        features = np.array(block.get("split_feature", "").split(), dtype=np.int64)
        if importance_type == "split":
            np.add.at(importances, features, 1.0)
        else:
            gains = np.array(block.get("split_gain", "").split(), dtype=np.float32)
            for feature, gain in zip(features, gains, strict=True):
                importances[feature] += float(gain)
    return importances


Booster: TypeAlias = "lgb.Booster | TextBooster"


@dataclass
class ResidualTrees:
    """The trees serving one target: a mean-residual booster and/or an upper-quantile booster.

    Predictions go through CompiledTrees (same numbers, a fraction of LightGBM's per-call cost) when the booster
    allows it. Boosters are compiled when they are set here (~10 ms each), unless `compiled` already holds their
    compiled form: the learner compiles candidates in its background fit, and the service receives the forms
    its learner process compiled, so neither a lock nor a request waits for a compilation.
    """

    mean: Booster | None = None
    upper: Booster | None = None
    compiled: dict[str, CompiledTrees | None] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("mean", "upper"):
            if name not in self.compiled:
                self._compile(name)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("mean", "upper") and "compiled" in self.__dict__:
            self._compile(name)

    def _compile(self, name: str) -> None:
        booster = getattr(self, name)
        self.compiled[name] = compile_booster(booster) if booster is not None else None

    def predict_mean(self, features: np.ndarray) -> np.ndarray | None:
        """The mean tree's residual for every row, or None when no mean tree serves."""
        return None if self.mean is None else _predict(self.mean, self.compiled.get("mean"), features)

    def predict_upper(self, features: np.ndarray) -> np.ndarray | None:
        """The quantile tree's residual for every row, or None when no quantile tree serves."""
        return None if self.upper is None else _predict(self.upper, self.compiled.get("upper"), features)

    def to_dict(self) -> dict[str, str | None]:
        """Both trees as LightGBM text with their SHA-256 (None where a tree is missing)."""
        out: dict[str, str | None] = {}
        for name, booster in (("mean", self.mean), ("upper", self.upper)):
            text = booster.model_to_string() if booster is not None else None
            out[name] = text
            out[f"{name}_sha256"] = hashlib.sha256(text.encode()).hexdigest() if text is not None else None
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], compiled: dict[str, CompiledTrees | None] | None = None) -> ResidualTrees:
        """`compiled`: the boosters' compiled forms when the caller has them (else they are compiled here, from
        their text). A booster with a compiled form is kept as text until LightGBM itself is needed."""
        forms = dict(compiled) if compiled is not None else {}

        def load(name: str) -> Booster | None:
            text, digest = d.get(name), d.get(f"{name}_sha256")
            if text is None:
                return None
            if not isinstance(text, str):
                raise ValueError("tree model is not LightGBM text")
            check_lightgbm_text(text)
            if digest != hashlib.sha256(text.encode()).hexdigest():
                raise ValueError("tree model does not match its checksum (corrupted?)")
            if name not in forms:
                forms[name] = compile_text(text)
            if forms[name] is not None:
                return TextBooster(text)
            return parse_booster(text, checked=True)

        return cls(mean=load("mean"), upper=load("upper"), compiled=forms)
