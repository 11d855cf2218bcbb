"""The online predictor: physics prior × learned correction, refined by trees, calibrated by conformal.

For each target (TTFT, TPOT) a prediction in milliseconds is

    additive wait + prior(x) · exp( w·φ(x) + class offset + endpoint offset + tree residual(x) )

and the served upper quantile replaces the tree residual by a calibrated quantile of the residual. Every
observation updates w (recursive least squares), the offsets and the calibration at once; LightGBM trees are
retrained on a bounded window in the background and swapped in only when they beat the current model on recent
held-out observations. Where the recent TTFTs show a wall that the predictions overshoot (clients giving up
on a queue deeper than their timeout), TTFT is capped at it (`ceiling.OutcomeCeiling`), and the outcomes at the
wall are learned as the lower bounds they are. The predictor answers from the first row: with nothing learned it
is the physics prior.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import lightgbm as lgb
import numpy as np
from river import drift

from leadtime.features.errors import FeatureError
from leadtime.features.rows import FeatureRow, Observation
from leadtime.features.vectorize import COLUMNS, FeatureBatch, Vectorizer, check_matrix
from leadtime.predictor.artifact import ArtifactError, decode, encode, load_file, save_file
from leadtime.predictor.ceiling import OutcomeCeiling
from leadtime.predictor.forward import ForwardRecord
from leadtime.predictor.online import ConformalQuantile, OffsetTable, RecursiveLeastSquares
from leadtime.predictor.physics import (
    TARGETS,
    additive_ms,
    correction_feature_names,
    correction_features,
    own_prefill_ms,
    prior_ms,
)
from leadtime.predictor.trees import TREE_FEATURES, CompiledTrees, ResidualTrees, compile_booster, fit_booster

log = logging.getLogger("leadtime.predictor")

_MIN_MS = 0.05  # floor for log targets; no real TTFT/ITL is below this
_SETTLE_EVERY = 64  # observations between calibration updates (they need a LightGBM call)
_BLOCK = 32  # rows per block update of the online correction when learning a batch
# The global correction's pull towards the physics prior weighs like this many observations (~2.5 per feature
# it learns), so that its first observations, all from one accelerator class, do not carry over to every other
# class in full: one observation 3x slower than the prior moved another class's prediction by x3 with a ridge
# of 1, and moves it by ~x1.2 with this.
_PRIOR_ROWS = 30.0


@dataclass
class LearnerConfig:
    """Parameters of an OnlinePredictor.

    Parameters
    ----------
    accelerator
        Accelerator class assumed for rows that name none (llm-d rows never do).
    model
        Model assumed for rows that name none.
    quantile
        The upper quantile served (0.9 = p90).
    window
        Observations per target kept for tree retraining.
    retrain_every
        Observations of a target between tree retrains; drift triggers earlier ones.
    background
        Retrain in a background thread (in the service's learner process) or synchronously (reproducible
        benchmarks).
    min_window
        Observations a target needs before its first tree is tried.
    tree_rounds
        Boosting rounds per tree.
    forgetting
        Forgetting factor of the online correction (closer to 1 = longer memory).
    retrain
        Whether this learner retrains its trees at all (on schedule or on drift). A service replica without the
        training lease sets it False: it learns online and adopts the lease holder's published trees.
    seed
        Seed of the trees' bagging.
    """

    accelerator: str = "h100-sxm"
    model: str = "llama-3.1-8b"
    quantile: float = 0.9
    window: int = 20_000
    retrain_every: int = 2_000
    background: bool = True
    min_window: int = 300
    tree_rounds: int = 60
    forgetting: float = 0.998
    retrain: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.5 <= self.quantile < 1.0:
            raise ValueError(f"quantile must be in [0.5, 1), got {self.quantile}")
        if self.window < 100 or self.retrain_every < 1 or self.min_window < 50:
            raise ValueError("window must be ≥ 100, retrain_every ≥ 1 and min_window ≥ 50")
        if not 0.9 <= self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in [0.9, 1], got {self.forgetting}")


@dataclass
class Predictions:
    """Milliseconds; every array has one entry per row, in row order."""

    ttft_mean: np.ndarray
    ttft_quantile: np.ndarray
    tpot_mean: np.ndarray
    tpot_quantile: np.ndarray
    model_version: int


_ACTUAL_TTFT = operator.attrgetter("actual_ttft_ms")
_ACTUAL_TPOT = operator.attrgetter("actual_tpot_ms")


def log_target(target: str, x: np.ndarray, actual_ms: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """What the correction and the trees learn for every row: log(actual without the additive wait / prior)."""
    wait = additive_ms(target, x)
    return np.log(np.maximum(actual_ms - wait, _MIN_MS)) - np.log(np.maximum(prior, _MIN_MS))


def tree_inputs(x: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """The trees' feature matrix: every column plus the log of the physics prior (TREE_FEATURES order)."""
    out = np.empty((len(x), x.shape[1] + 1))
    out[:, :-1] = x
    out[:, -1] = np.log(np.maximum(prior, _MIN_MS))
    return out


def heldout_rows(n: int) -> np.ndarray:
    """The rows of an n-row window (oldest first) that judge a candidate tree: every fifth one.

    Not the newest fifth: the residuals the trees learn are those of the online correction as it is now, which
    has just learned the newest rows (its residual there is in-sample, near zero) and has forgotten the older
    ones. A newest-fifth test set therefore compares an in-sample online model with an out-of-sample tree and
    refuses the tree whenever the load moves (measured: on traces with a load ramp, no tree was ever accepted,
    and predictions for load states met earlier were off by up to 10x). Rows spread over the window judge the
    tree on every load state it will be asked about, as the router will ask.

    >>> heldout_rows(10).nonzero()[0].tolist()
    [4, 9]
    """
    return np.arange(n) % 5 == 4


class _Window:
    """A ring buffer of recent observations of one target: features, log target, keys."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # Allocated by the first append: a serving copy of a model that never learns (the service's, loaded
        # from its learner process several times a second) must not pay for megabytes it never uses.
        self.x = np.zeros((0, len(COLUMNS)))
        self.z = np.zeros(0)
        self.classes: list[str] = []
        self.endpoints: list[str] = []
        self.count = 0
        self.total = 0

    def extend(self, x: np.ndarray, z: np.ndarray, hw: list[str], endpoints: list[str]) -> None:
        """Append a batch in order: one slice assignment instead of a row at a time."""
        if len(self.z) < self.capacity:
            self.x = np.zeros((self.capacity, len(COLUMNS)))
            self.z = np.zeros(self.capacity)
            self.classes = [""] * self.capacity
            self.endpoints = [""] * self.capacity
        n = len(z)
        if n > self.capacity:  # only the newest rows would survive anyway
            keep = self.capacity
            x, z, hw, endpoints = x[-keep:], z[-keep:], hw[-keep:], endpoints[-keep:]
            self.total += n - keep
            n = self.capacity
        slots = (self.total + np.arange(n)) % self.capacity
        self.x[slots] = x
        self.z[slots] = z
        for slot, key, endpoint in zip(slots.tolist(), hw, endpoints, strict=True):
            self.classes[slot] = key
            self.endpoints[slot] = endpoint
        self.total += n
        self.count = min(self.count + n, self.capacity)

    def chronological(self) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
        """Copies, oldest first (safe to use while new observations arrive)."""
        if self.count < self.capacity:
            idx = np.arange(self.count)
        else:
            idx = (np.arange(self.capacity) + self.total) % self.capacity
        return (
            self.x[idx].copy(),
            self.z[idx].copy(),
            [self.classes[i] for i in idx],
            [self.endpoints[i] for i in idx],
        )

    def clear(self) -> int:
        flushed = self.count
        self.count = 0
        self.total = 0
        return flushed


@dataclass
class _Candidate:
    mean: Any
    upper: Any
    upper_shift: float
    residuals: np.ndarray  # the online model's residuals over the whole window
    serving_upper_shift: float | None = None  # the serving quantile tree's shift, fitted again on this window
    compiled: dict[str, CompiledTrees | None] = field(default_factory=dict)


class _TargetModel:
    """Everything learned about one target."""

    def __init__(self, target: str, config: LearnerConfig) -> None:
        self.target = target
        self.names = correction_feature_names(target)
        self.rls = RecursiveLeastSquares(
            len(self.names), forgetting=config.forgetting, ridge=1.0, prior_rows=_PRIOR_ROWS
        )
        self.classes = OffsetTable(rate=0.02, prior_count=20.0)
        self.endpoints = OffsetTable(rate=0.1, prior_count=5.0)
        self.conformal = ConformalQuantile(config.quantile)
        self.trees = ResidualTrees()
        # Only TTFT has a wall: a client's timeout bounds how long a request may queue, not how fast it decodes.
        self.ceiling = OutcomeCeiling(quantile=config.quantile) if target == "ttft" else None
        self.window = _Window(config.window)
        self.drift = drift.ADWIN()
        self.observations = 0
        self.since_retrain = 0
        self.drifts = 0
        # The serving mean tree against no tree, on the rows that came after it (`forward`).
        self.forward = ForwardRecord()
        self.trees_retired = 0
        # Log-space shift that calibrates an accepted quantile tree on its held-out data.
        self.upper_shift = 0.0
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self._pending_rows = 0
        # The serialized trees this model was loaded from (None once it trains its own): a later load of the
        # same text can reuse the parsed boosters instead of parsing them again.
        self._loaded_trees: dict[str, Any] | None = None

    # --- prediction -------------------------------------------------------------------------------------

    def online_log(
        self, x: np.ndarray, prior: np.ndarray, hw: list[str] | str, endpoint_ids: Sequence[str] | None
    ) -> np.ndarray:
        """log(correction) from the online parts. `hw`: the class key of every row, or one for all of them."""
        phi = correction_features(self.target, x, prior)
        z = self.rls.predict_many(phi) + self.classes.get_many(hw)
        if endpoint_ids is not None and len(self.endpoints):
            z = z + self.endpoints.get_many(list(endpoint_ids))
        return z

    def predict(
        self, x: np.ndarray, hw: list[str] | str, endpoint_ids: Sequence[str] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(mean, upper quantile) in ms of every row; `hw` as in `online_log`."""
        prior = prior_ms(self.target, x)
        z_online = self.online_log(x, prior, hw, endpoint_ids)
        trees = self.trees  # one read: a swap during this call cannot mix two models
        tree_x = tree_inputs(x, prior) if trees.mean is not None or trees.upper is not None else x
        mean_residual = trees.predict_mean(tree_x) if trees.mean is not None else None
        upper_residual = trees.predict_upper(tree_x) if trees.upper is not None else None
        z_point = z_online + (self.conformal.center if mean_residual is None else mean_residual)
        if upper_residual is None:
            z_upper = z_online + self.conformal.offset
        else:
            z_upper = z_online + upper_residual + self.upper_shift + self.conformal.adaptive
        z_upper = np.maximum(z_upper, z_point)
        extra = additive_ms(self.target, x)
        mean, upper = extra + prior * np.exp(z_point), extra + prior * np.exp(z_upper)
        return (mean, upper) if self.ceiling is None else self.ceiling.cap(mean, upper, own_prefill_ms(x))

    # --- learning -----------------------------------------------------------------------------------------

    def learn_batch(self, x: np.ndarray, actual_ms: np.ndarray, hw: list[str], endpoints: list[str]) -> bool:
        """Learn rows in order (all observed this target); returns True when drift was detected.

        Everything that does not depend on the evolving state (prior, φ, log target) is computed for the whole
        batch at once; only the recursive updates loop. The calibration bookkeeping, which needs the trees'
        output, is deferred to `settle` and done in batches (LightGBM has a high per-call cost).
        """
        prior = prior_ms(self.target, x)
        z_all = log_target(self.target, x, actual_ms, prior)
        phi_all = correction_features(self.target, x, prior)
        online_all = np.empty(len(x))
        learned_all = z_all.copy()
        at_wall = self._at_wall(actual_ms)
        drifted = False
        rls, classes, endpoint_table = self.rls, self.classes, self.endpoints
        for start in range(0, len(x), _BLOCK):
            stop = min(start + _BLOCK, len(x))
            phi = phi_all[start:stop]
            keys, eps = hw[start:stop], endpoints[start:stop]
            offsets = np.array(
                [classes.get(k) + (endpoint_table.get(e) if e else 0.0) for k, e in zip(keys, eps, strict=True)]
            )
            z = z_all[start:stop]
            online = phi @ rls.weights + offsets
            online_all[start:stop] = online
            # An outcome at a wall is a lower bound (`_at_wall`): one the model already predicts at least is
            # no evidence against it and is not learned; one predicted lower is, and pulls it up.
            censored = at_wall[start:stop] & (z <= online)
            learned_all[start:stop] = np.where(censored, online, z)  # what the window and calibration see
            kept = ~censored
            # Backfitting: the global correction learns what the offsets do not explain, then each offset
            # learns what is left after the levels above it.
            if kept.any():
                rls.learn_many(phi[kept], (z - offsets)[kept])
            global_after = phi @ rls.weights
            for i in np.flatnonzero(kept).tolist():
                key, endpoint, zi, gi = keys[i], eps[i], float(z[i]), float(global_after[i])
                endpoint_offset = endpoint_table.get(endpoint) if endpoint else 0.0
                classes.learn_one(key, zi - gi - endpoint_offset)
                if endpoint:
                    endpoint_table.learn_one(endpoint, zi - gi - classes.get(key))
                self.drift.update(abs(zi - float(online[i])))
                if self.drift.drift_detected:
                    self.drifts += 1
                    drifted = True
        if self.ceiling is not None:
            # Tested against the online parts' prediction (uncapped, so that the cap goes when the wall does) as
            # the outcomes arrive, not at the calibration's settle (every 64 outcomes, for its tree call): there
            # the wall took hold up to 64 outcomes late.
            online_ms = additive_ms(self.target, x) + prior * np.exp(online_all + self.conformal.center)
            self.ceiling.learn_many(actual_ms, online_ms, own_prefill_ms(x))
        self._pending.append((x, prior, learned_all, online_all, actual_ms))
        self._pending_rows += len(x)
        if self._pending_rows >= _SETTLE_EVERY:
            self.settle()
        self.window.extend(x, learned_all, hw, endpoints)
        self.observations += len(x)
        self.since_retrain += len(x)
        return drifted

    def _at_wall(self, actual_ms: np.ndarray) -> np.ndarray:
        """Outcomes at an active wall (`ceiling`). A request served at a client's timeout would have waited
        longer had no client given up (the queue ahead held the requests that were given up on), so its outcome
        is a lower bound on the uncapped time the model learns, not a measure of it. Learned as measures, the
        wall's outcomes pulled the correction down on every row that shares their features, and the rows below
        the wall were predicted short of it: a third of sim:bimodal's second half, whose outcomes were at it."""
        wall = self.ceiling
        if wall is None or not wall.active:
            return np.zeros(len(actual_ms), dtype=bool)
        return np.asarray(actual_ms) >= wall.level_ms * (1.0 - wall.band)

    def settle(self) -> None:
        """Update the calibration with every pending observation, in order, against what was served then."""
        if not self._pending:
            return
        pending, self._pending, self._pending_rows = self._pending, [], 0
        x = np.concatenate([p[0] for p in pending])
        prior = np.concatenate([p[1] for p in pending])
        z = np.concatenate([p[2] for p in pending])
        online = np.concatenate([p[3] for p in pending])
        actual_ms = np.concatenate([p[4] for p in pending])
        tree_x = tree_inputs(x, prior)
        trees = self.trees
        mean_residual = trees.predict_mean(tree_x)
        upper_residual = trees.predict_upper(tree_x)
        point = online + (self.conformal.center if mean_residual is None else mean_residual)
        conformal = self.conformal
        extra = additive_ms(self.target, x)
        uncapped_ms = extra + prior * np.exp(point)
        if mean_residual is not None:
            plain_ms = extra + prior * np.exp(online + conformal.center)
            self.forward.add(actual_ms, self._served_mean(uncapped_ms, x), self._served_mean(plain_ms, x))
        # Coverage is of the quantile served: under a wall that is the capped one, and the adaptive term must
        # answer for it (the uncapped model's residuals there say it over-predicts, and it shrinks its width).
        wall = self.ceiling if self.ceiling is not None and self.ceiling.active else None
        # Every pending row was served with the calibration as it stood at the last settle: judge each against
        # that, not against the adaptive term as it moves within this batch. Judged against the moving term,
        # a steady climb looked covered (the term rose row by row in the judging) while what was served
        # missed: p90 coverage 0.62 over a tenth of a P/D trace whose TTFTs were climbing.
        served_offset, served_adaptive = conformal.offset, conformal.adaptive
        own = own_prefill_ms(x)
        for i in range(len(z)):
            if upper_residual is None:
                upper = online[i] + served_offset
            else:
                upper = online[i] + upper_residual[i] + self.upper_shift + served_adaptive
            top = max(upper, point[i])
            if wall is None:
                covered = z[i] <= top + 1e-12
            else:
                served = wall.cap(float(uncapped_ms[i]), float(extra[i] + prior[i] * math.exp(top)), float(own[i]))[1]
                covered = actual_ms[i] <= served * (1.0 + 1e-12)
            conformal.observe(float(z[i] - online[i]), covered)
        if self.trees.mean is not None and self.forward.retire():
            self._retire_mean_tree()

    def _served_mean(self, mean_ms: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The mean predictions of rows `x` as served: under an active wall, capped at it."""
        return mean_ms if self.ceiling is None else self.ceiling.cap(mean_ms, mean_ms, own_prefill_ms(x))[0]

    def _retire_mean_tree(self) -> None:
        """The mean tree did worse than no tree on the rows since it was swapped in: serve without it."""
        old = self.trees
        compiled = dict(old.compiled)
        compiled["mean"] = None
        self.trees = ResidualTrees(mean=None, upper=old.upper, compiled=compiled)
        self._loaded_trees = None
        self.trees_retired += 1
        self.forward.reset()

    # --- retraining -----------------------------------------------------------------------------------------

    def fit_candidate(
        self,
        snapshot: tuple[np.ndarray, np.ndarray, list[str], list[str]],
        quantile: float,
        rounds: int,
        seed: int,
        min_window: int,
    ) -> tuple[_Candidate | None, dict[str, Any]]:
        """Fit candidate trees on 80% of the window and keep each only if it beats the serving model on the rest
        (every fifth row, `heldout_rows`)."""
        x, z, hw, endpoints = snapshot
        n = len(z)
        outcome: dict[str, Any] = {"samples": n, "accepted_mean": False, "accepted_upper": False}
        if n < min_window:
            outcome["reason"] = f"window has {n} < {min_window} samples"
            return None, outcome
        prior = prior_ms(self.target, x)
        z_online = self.online_log(x, prior, hw, endpoints)
        tree_x = tree_inputs(x, prior)
        residual = z - z_online
        held = heldout_rows(n)
        fit_x, fit_r, test_x, test_r = tree_x[~held], residual[~held], tree_x[held], residual[held]
        current = self.trees
        mean_tree = fit_booster(self.target, "regression", quantile, fit_x, fit_r, rounds, seed)
        upper_tree = fit_booster(self.target, "quantile", quantile, fit_x, fit_r, rounds, seed)

        def ape(log_error: np.ndarray) -> float:
            return float(np.mean(np.abs(np.expm1(-log_error))))

        def pinball(pred: np.ndarray, actual: np.ndarray) -> float:
            diff = actual - pred
            return float(np.mean(np.maximum(quantile * diff, (quantile - 1.0) * diff)))

        current_mean = current.predict_mean(test_x)
        baseline_ape = ape(test_r - (current_mean if current_mean is not None else 0.0))
        candidate_ape = ape(test_r - mean_tree.predict(test_x, num_threads=1))
        # The quantile tree's split-conformal shift is fitted on the older half of the held-out rows and
        # judged on the newer half, so that the comparison does not reward a shift fitted to its own test.
        half = len(test_r) // 2
        window_shift = float(np.quantile(residual, quantile))
        current_raw = current.predict_upper(test_x)
        serving_shift = None
        if current_raw is None:
            current_upper = np.full(len(test_r), window_shift)
        else:
            # The serving tree learned residuals of the online parts as they were when it was fitted; they have
            # moved since, and its shift with them. It is judged recalibrated as the candidate is, and kept,
            # recalibrated on the whole held-out set (a stale shift left the p90 at the mean on every load the
            # online parts had moved past: split coverage 0.78 on sim:mixed).
            current_upper = current_raw + float(np.quantile(test_r[:half] - current_raw[:half], quantile))
            serving_shift = float(np.quantile(test_r - current_raw, quantile))
        upper_pred = np.asarray(upper_tree.predict(test_x, num_threads=1))
        shift = float(np.quantile(test_r[:half] - upper_pred[:half], quantile))
        baseline_pinball = pinball(current_upper[half:], test_r[half:])
        candidate_pinball = pinball(upper_pred[half:] + shift, test_r[half:])
        candidate = _Candidate(
            mean=None, upper=None, upper_shift=shift, residuals=residual, serving_upper_shift=serving_shift
        )
        # Accepted trees are compiled here, in the background fit, not under the lock that swaps them in.
        if candidate_ape < 0.99 * baseline_ape:
            candidate.mean = mean_tree
            candidate.compiled["mean"] = compile_booster(mean_tree)
            outcome["accepted_mean"] = True
        if candidate_pinball < 0.99 * baseline_pinball:
            candidate.upper = upper_tree
            candidate.compiled["upper"] = compile_booster(upper_tree)
            outcome["accepted_upper"] = True
        outcome.update(
            heldout_ape_before=baseline_ape,
            heldout_ape_after=min(baseline_ape, candidate_ape),
            heldout_pinball_before=baseline_pinball,
            heldout_pinball_after=min(baseline_pinball, candidate_pinball),
        )
        return candidate, outcome

    def residual_set(
        self, x: np.ndarray, actual_ms: np.ndarray, hw: list[str] | str, endpoints: Sequence[str] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(tree inputs, log residual of the online parts in their current state) of rows that observed the
        target: what `fit_candidate` fits on its window, for rows from anywhere."""
        prior = prior_ms(self.target, x)
        residual = log_target(self.target, x, actual_ms, prior) - self.online_log(x, prior, hw, endpoints)
        return tree_inputs(x, prior), residual

    def serving_residuals(self, tree_x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What `predict` adds to the online parts' log prediction for every row: (mean, upper quantile)."""
        trees = self.trees
        n = len(tree_x)
        mean = trees.predict_mean(tree_x)
        upper = trees.predict_upper(tree_x)
        mean_out = np.full(n, self.conformal.center) if mean is None else mean
        if upper is None:
            upper_out = np.full(n, self.conformal.offset)
        else:
            upper_out = upper + self.upper_shift + self.conformal.adaptive
        return mean_out, np.maximum(upper_out, mean_out)

    def swap_in(self, candidate: _Candidate | None) -> None:
        self.since_retrain = 0
        if candidate is None:
            return
        self.conformal.recalibrate(candidate.residuals)
        old = self.trees
        mean, upper = old.mean, old.upper
        compiled = dict(old.compiled)
        if candidate.mean is not None:
            mean = candidate.mean
            compiled["mean"] = candidate.compiled["mean"]
            self.forward.reset()
        if candidate.upper is not None:
            upper = candidate.upper
            compiled["upper"] = candidate.compiled["upper"]
            self.upper_shift = candidate.upper_shift
            self.conformal.adaptive = 0.0
        elif candidate.serving_upper_shift is not None and old.upper is not None:
            self.upper_shift = candidate.serving_upper_shift
        if mean is not old.mean or upper is not old.upper:
            self.trees = ResidualTrees(mean=mean, upper=upper, compiled=compiled)
            self._loaded_trees = None

    # --- persistence ------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "feature_names": self.names,
            "rls": self.rls.to_dict(),
            "classes": self.classes.to_dict(),
            "endpoints": self.endpoints.to_dict(),
            "conformal": self.conformal.to_dict(),
            "trees": self.trees.to_dict(),
            "upper_shift": self.upper_shift,
            "ceiling": None if self.ceiling is None else self.ceiling.to_dict(),
            "observations": self.observations,
            "drifts": self.drifts,
        }

    def load_dict(
        self,
        d: dict[str, Any],
        reuse: _TargetModel | None = None,
        compiled: dict[str, CompiledTrees | None] | None = None,
    ) -> None:
        if d["feature_names"] != self.names:
            raise ArtifactError(f"{self.target}: correction features differ from this version's")
        self.rls = RecursiveLeastSquares.from_dict(d["rls"])
        self.classes = OffsetTable.from_dict(d["classes"])
        self.endpoints = OffsetTable.from_dict(d["endpoints"])
        self.conformal = ConformalQuantile.from_dict(d["conformal"])
        if reuse is not None and reuse._loaded_trees is not None and reuse._loaded_trees == d["trees"]:
            self.trees = reuse.trees
        else:
            self.trees = ResidualTrees.from_dict(d["trees"], compiled)
        self._loaded_trees = d["trees"]
        self.upper_shift = float(d["upper_shift"])
        if self.ceiling is not None and d.get("ceiling"):  # artifacts written before the ceiling have none
            self.ceiling.load_dict(d["ceiling"])
        self.observations = int(d["observations"])
        self.drifts = int(d["drifts"])


class OnlinePredictor:
    """Predicts TTFT and TPOT (mean and an upper quantile) per row and learns from every observation.

    As river's learners: `predict_one(row)` / `learn_one(observation)` and, for batches, `predict_many(rows)` /
    `learn_many(observations)`; the batch forms also take a `FeatureBatch` the caller vectorized itself (the
    service does, column-wise), with the actuals beside it in `learn_many`. Constructing one does no work
    beyond setting it up: with `config.background`, retraining runs in a thread that `start()` starts (and
    `close()` stops); until then a retrain that falls due waits.

    Parameters
    ----------
    config
        A LearnerConfig; defaults serve an H100 fleet running Llama-3.1-8B until told otherwise.

    Examples
    --------
    Prequential use: predict each row, then learn it.

    >>> from leadtime.features.rows import EndpointState, FeatureRow, Observation, RequestFeatures
    >>> p = OnlinePredictor(LearnerConfig(background=False))
    >>> errors = []
    >>> for i in range(300):
    ...     row = FeatureRow(RequestFeatures(input_tokens=200 + i), EndpointState(num_request_running=i % 8))
    ...     predicted = p.predict_one(row)["tpot_mean"]
    ...     actual = 12.0 + 0.5 * (i % 8)
    ...     errors.append(abs(predicted - actual) / actual)
    ...     p.learn_one(Observation(row, actual_tpot_ms=actual))
    >>> bool(sum(errors[-50:]) / 50 < 0.05)
    True

    A router's candidates in one call, and what it learned once they completed:

    >>> candidates = [FeatureRow(RequestFeatures(800), EndpointState(endpoint_id=f"e{i}")) for i in range(3)]
    >>> p.predict_many(candidates).ttft_mean.shape
    (3,)
    >>> p.learn_many([Observation(row, actual_ttft_ms=40.0) for row in candidates])
    """

    def __init__(self, config: LearnerConfig | None = None) -> None:
        self.config = config or LearnerConfig()
        self.vectorizer = Vectorizer(self.config.accelerator, self.config.model)
        self._models = {t: _TargetModel(t, self.config) for t in TARGETS}
        self._lock = threading.RLock()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.version = 0
        # Free-form JSON facts saved with the model (e.g. the service's position in the observation stream).
        self.metadata: dict[str, Any] = {}
        self.last_model_load: datetime | None = None
        self.last_retrain: datetime | None = None
        self.retrain_error: str | None = None
        self._retrain_wanted = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- background work ----------------------------------------------------------------------------------

    def start(self) -> OnlinePredictor:
        """Start retraining in a background thread (with `config.background`; otherwise retrains run inside
        `learn_many`, and this does nothing). Returns the predictor, so `OnlinePredictor(config).start()` reads
        as one step."""
        if self.config.background and self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._retrain_loop, name="leadtime-retrain", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the background thread, if one runs (waits for a retrain in progress)."""
        self._stopping.set()
        self._retrain_wanted.set()  # wakes the thread
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._retrain_wanted.clear()  # the next retrain that falls due asks again

    def __enter__(self) -> OnlinePredictor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- prediction ---------------------------------------------------------------------------------------

    def predict_one(self, row: FeatureRow) -> dict[str, float]:
        """One row's predictions in milliseconds: ttft_mean, ttft_quantile, tpot_mean, tpot_quantile."""
        p = self.predict_many([row])
        return {
            "ttft_mean": float(p.ttft_mean[0]),
            "ttft_quantile": float(p.ttft_quantile[0]),
            "tpot_mean": float(p.tpot_mean[0]),
            "tpot_quantile": float(p.tpot_quantile[0]),
        }

    def predict_many(self, rows: Sequence[FeatureRow] | FeatureBatch | np.ndarray) -> Predictions:
        """Predictions for every row, in row order: FeatureRows, or a FeatureBatch vectorized by the caller.

        A bare `COLUMNS` matrix (from `Vectorizer.transform`) is also taken: each row's class is found again by
        an exact match of its hardware columns (`Vectorizer.batch_of_matrix`, which refuses a row no class or
        several classes match).
        """
        batch = self._batch(rows)
        version = self.version
        x, ids = batch.X, batch.endpoint_ids
        classes: str | list[str] = (
            batch.table.keys[batch.hardware] if isinstance(batch.hardware, int) else batch.classes
        )
        ttft, ttft_q = self._models["ttft"].predict(x, classes, ids)
        tpot, tpot_q = self._models["tpot"].predict(x, classes, ids)
        return Predictions(ttft, ttft_q, tpot, tpot_q, version)

    def _batch(self, rows: Sequence[FeatureRow] | FeatureBatch | np.ndarray) -> FeatureBatch:
        if isinstance(rows, FeatureBatch):
            return rows
        if isinstance(rows, np.ndarray):
            return self.vectorizer.batch_of_matrix(rows)
        return self.vectorizer.batch(rows)

    def debug_one(self, row: FeatureRow) -> str:
        """Explain one prediction term by term: prior, correction, offsets, trees, calibration."""
        batch = self.vectorizer.batch([row])
        x, hw = batch.X, batch.classes
        endpoint = row.endpoint.endpoint_id
        lines = []
        for target, model in self._models.items():
            prior = prior_ms(target, x)
            phi = correction_features(target, x, prior)[0]
            terms = sorted(zip(model.names, phi * model.rls.weights, strict=True), key=lambda t: -abs(t[1]))
            mean, upper = model.predict(x, hw, [endpoint] if endpoint else None)
            wait = float(additive_ms(target, x)[0])
            q = self.config.quantile * 100
            lines.append(f"{target}: {float(mean[0]):.2f} ms (p{q:g} {float(upper[0]):.2f} ms)")
            lines.append(f"  physics prior            {float(prior[0]):10.2f} ms")
            if wait:
                lines.append(f"  time-slice wait          {wait:10.2f} ms (added)")
            lines.append(f"  online correction        ×{math.exp(float(phi @ model.rls.weights)):.3f}")
            for name, value in terms[:5]:
                lines.append(f"    {name:<28} {value:+.3f} (log)")
            lines.append(f"  accelerator-class offset ×{math.exp(model.classes.get(hw[0])):.3f} ({hw[0]})")
            lines.append(f"  endpoint offset          ×{math.exp(model.endpoints.get(endpoint)):.3f}")
            tree = model.trees.predict_mean(tree_inputs(x, prior))
            if tree is not None:
                lines.append(f"  tree residual            ×{math.exp(float(tree[0])):.3f}")
            else:
                lines.append("  tree residual            none serving")
                lines.append(f"  median recentring        ×{math.exp(model.conformal.center):.3f}")
            upper_tree = model.trees.predict_upper(tree_inputs(x, prior))
            if upper_tree is not None:
                shift = float(upper_tree[0]) + model.upper_shift + model.conformal.adaptive
                lines.append(f"  calibration offset       ×{math.exp(shift):.3f} (quantile tree + conformal shift)")
            else:
                offset = math.exp(model.conformal.offset)
                lines.append(f"  calibration offset       ×{offset:.3f} (conformal, upper quantile)")
            wall = model.ceiling
            if wall is not None and wall.active:
                own = float(own_prefill_ms(x)[0])
                level, pile = float(wall.mean_cap_ms(own)), float(wall.upper_cap_ms(own))
                lines.append(f"  client-timeout wall      {level:10.2f} ms (the mean is at most this)")
                lines.append(f"    p{q:g} at the pile         {pile:10.2f} ms (wherever the p{q:g} reaches the wall)")
        return "\n".join(lines)

    # --- learning ---------------------------------------------------------------------------------------

    def learn_one(self, obs: Observation) -> None:
        """Learn one completed request."""
        self.learn_many([obs])

    def learn_many(
        self,
        observations: Sequence[Observation] | FeatureBatch | np.ndarray,
        actual_ttft_ms: np.ndarray | Sequence[float] | None = None,
        actual_tpot_ms: np.ndarray | Sequence[float] | None = None,
    ) -> None:
        """Learn a batch in order: Observations, or a FeatureBatch (or a bare matrix, as `predict_many` takes
        it) with the actuals beside it (0 = that target was not observed).

        Everything is validated before anything is learned: a bad batch changes nothing.
        """
        if isinstance(observations, FeatureBatch | np.ndarray):
            if actual_ttft_ms is None or actual_tpot_ms is None:
                raise TypeError("learn_many(batch, actual_ttft_ms, actual_tpot_ms): a batch needs its actuals")
            batch = self._batch(observations)
        else:
            if actual_ttft_ms is not None or actual_tpot_ms is not None:
                raise TypeError("learn_many(observations): Observations carry their own actuals")
            n = len(observations)
            if n == 0:
                return
            batch = self.vectorizer.batch([o.row for o in observations])
            actual_ttft_ms = np.fromiter(map(_ACTUAL_TTFT, observations), dtype=np.float64, count=n)
            actual_tpot_ms = np.fromiter(map(_ACTUAL_TPOT, observations), dtype=np.float64, count=n)
        self._learn(batch, actual_ttft_ms, actual_tpot_ms)

    def _learn(
        self,
        batch: FeatureBatch,
        actual_ttft_ms: np.ndarray | Sequence[float],
        actual_tpot_ms: np.ndarray | Sequence[float],
    ) -> None:
        x = check_matrix(batch.X)
        actual = {
            "ttft": _check_actuals("actual_ttft_ms", actual_ttft_ms, len(x)),
            "tpot": _check_actuals("actual_tpot_ms", actual_tpot_ms, len(x)),
        }
        if batch.endpoint_ids is not None and len(batch.endpoint_ids) != len(x):
            raise ValueError(f"{len(batch.endpoint_ids)} endpoint ids for {len(x)} rows")
        hw = batch.classes
        ids = batch.endpoint_ids if batch.endpoint_ids is not None else [""] * len(x)
        want_retrain = False
        start = 0
        while start < len(x):
            with self._lock:
                stop = len(x)
                if self.config.retrain and not self.config.background:
                    # Stop where a target reaches its retrain point, so a synchronous walk retrains on time.
                    room = min(self.config.retrain_every - m.since_retrain for m in self._models.values())
                    stop = min(len(x), start + max(room, 1))
                for target, model in self._models.items():
                    observed = np.flatnonzero(actual[target][start:stop] > 0) + start
                    if len(observed) == 0:
                        continue
                    drifted = model.learn_batch(
                        x[observed], actual[target][observed], [hw[i] for i in observed], [ids[i] for i in observed]
                    )
                    if self.config.retrain and (drifted or model.since_retrain >= self.config.retrain_every):
                        want_retrain = True
            if want_retrain and not self.config.background:
                self.retrain_now()
                want_retrain = False
            start = stop
        if want_retrain:
            self._retrain_wanted.set()

    # --- retraining ---------------------------------------------------------------------------------------

    def retrain_now(self) -> dict[str, Any]:
        """Retrain both targets' trees synchronously; swap in only what wins on held-out data."""
        started = time.perf_counter()
        result: dict[str, Any] = {}
        c = self.config
        for target, model in self._models.items():
            with self._lock:
                model.settle()
                snapshot = model.window.chronological()
            candidate, result[target] = model.fit_candidate(snapshot, c.quantile, c.tree_rounds, c.seed, c.min_window)
            with self._lock:
                model.settle()  # what arrived meanwhile was served by the old trees
                model.swap_in(candidate)
        result["duration_s"] = time.perf_counter() - started
        self.last_retrain = datetime.now(UTC)
        if any(result[t]["accepted_mean"] or result[t]["accepted_upper"] for t in TARGETS):
            self.version += 1
            self.last_model_load = self.last_retrain
        result["version"] = self.version
        for listener in list(self._listeners):
            listener(result)
        return result

    def retrain_if_due(self) -> bool:
        """Ask for a retrain that came due while retraining was paused (`config.retrain` False); True if asked."""
        with self._lock:
            due = any(m.since_retrain >= self.config.retrain_every for m in self._models.values())
        if not (due and self.config.retrain):
            return False
        if self.config.background:
            self._retrain_wanted.set()
        else:
            self.retrain_now()
        return True

    # --- trees fitted elsewhere (the offline retraining job) ------------------------------------------------

    def residual_training_set(
        self, target: str, batch: FeatureBatch, actual_ms: np.ndarray | Sequence[float]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The trees' inputs (`TREE_FEATURES` columns) and what they learn for every row of `batch`: the log
        residual that the online parts (prior × correction × offsets), in their current state, leave.

        The same quantities this learner's own retrain fits on its window. The offline retraining job
        (`leadtime.training`) fits on them over a longer history, so that the trees it installs refine this
        predictor's residual exactly as its own would. Every row must have observed `target` (actual > 0).
        """
        actual = _check_actuals(f"actual_{target}_ms", actual_ms, len(batch))
        if len(actual) and actual.min() <= 0:
            raise ValueError(f"every row must have observed {target} (actual > 0)")
        x = check_matrix(batch.X)
        with self._lock:
            return self._model(target).residual_set(x, actual, batch.classes, batch.endpoint_ids)

    def serving_residuals(self, target: str, tree_x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What the predictor now adds to its online parts' log prediction of `target` for rows of tree inputs
        (from `residual_training_set`): (mean, upper quantile). The trees serving, or without them the median
        recentring and the conformal offset: the baseline a tree fitted elsewhere must beat."""
        with self._lock:
            return self._model(target).serving_residuals(tree_x)

    def install_trees(
        self,
        target: str,
        mean: lgb.Booster | None,
        upper: lgb.Booster | None,
        upper_shift: float,
        residuals: np.ndarray,
    ) -> None:
        """Serve trees fitted elsewhere for `target`: a mean-residual and an upper-quantile booster over
        `TREE_FEATURES` (None keeps the one serving), the log shift that calibrates the quantile booster, and the
        online parts' residuals on recent rows (the split-conformal base). Swapped in as this learner swaps in
        its own winners; the version is the caller's to set."""
        for booster in (mean, upper):
            if booster is not None and list(booster.feature_name()) != list(TREE_FEATURES):
                raise ValueError("trees must be fitted on TREE_FEATURES")
        candidate = _Candidate(mean=mean, upper=upper, upper_shift=float(upper_shift), residuals=residuals)
        for name, booster in (("mean", mean), ("upper", upper)):
            if booster is not None:
                candidate.compiled[name] = compile_booster(booster)
        with self._lock:
            model = self._model(target)
            model.settle()
            model.swap_in(candidate)

    def add_retrain_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call `fn(result)` after every retrain (on the thread that ran it)."""
        self._listeners.append(fn)

    def _retrain_loop(self) -> None:
        """A failed retrain is recorded (status()["retrain_error"]) and the thread lives on: the online parts
        keep learning and the next trigger tries again."""
        while not self._stopping.is_set():
            if self._retrain_wanted.wait(timeout=0.5):
                self._retrain_wanted.clear()
                if self._stopping.is_set():
                    continue
                try:
                    self.retrain_now()
                    self.retrain_error = None
                except Exception as err:  # LightGBM raises plain exceptions of several kinds
                    self.retrain_error = f"{type(err).__name__}: {err}"
                    log.exception("background retrain failed")

    # --- introspection ------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Observations learned, window sizes, trees serving, drifts, last retrain and its error, version."""
        return {
            "observations": {t: m.observations for t, m in self._models.items()},
            "window": {t: m.window.count for t, m in self._models.items()},
            "trees_active": {t: m.trees.mean is not None or m.trees.upper is not None for t, m in self._models.items()},
            "drifts": {t: m.drifts for t, m in self._models.items()},
            "trees_retired": {t: m.trees_retired for t, m in self._models.items()},
            "last_retrain": self.last_retrain,
            "retrain_error": self.retrain_error,
            "version": self.version,
        }

    def tree_text(self, target: str) -> str | None:
        """The serving tree of a target as LightGBM text (the mean tree, else the quantile tree), or None."""
        trees = self._model(target).trees
        booster = trees.mean if trees.mean is not None else trees.upper
        return booster.model_to_string() if booster is not None else None

    def tree_importances(self, target: str) -> dict[str, float]:
        """Gain importance of each tree feature for a target's serving tree ({} without one)."""
        trees = self._model(target).trees
        booster = trees.mean if trees.mean is not None else trees.upper
        if booster is None:
            return {}
        gains = booster.feature_importance(importance_type="gain")
        return {name: float(g) for name, g in zip(TREE_FEATURES, gains, strict=True)}

    def flush_window(self) -> dict[str, int]:
        """Empty both retraining windows; returns how many observations each held."""
        with self._lock:
            return {t: m.window.clear() for t, m in self._models.items()}

    def _model(self, target: str) -> _TargetModel:
        if target not in self._models:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        return self._models[target]

    # --- persistence ------------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The artifact: JSON with the trees as LightGBM text (never a pickle)."""
        with self._lock:
            for model in self._models.values():
                model.settle()
            return encode(self._state())

    @classmethod
    def from_bytes(
        cls, data: bytes, background: bool | None = None, reuse: OnlinePredictor | None = None
    ) -> OnlinePredictor:
        """Load an artifact. `reuse`: a predictor loaded earlier whose boosters are kept where the artifact's
        trees are the same text (parsing LightGBM text is most of a load's cost)."""
        return cls.from_state(decode(data), background, reuse)

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        background: bool | None = None,
        reuse: OnlinePredictor | None = None,
        compiled: dict[str, dict[str, CompiledTrees | None]] | None = None,
    ) -> OnlinePredictor:
        """Load a decoded artifact (`snapshot()`'s first part, or `artifact.decode`'s result); `compiled`: the
        trees' compiled forms per target, when the sender has them."""
        try:
            config = LearnerConfig(**state["config"])
            if background is not None:
                config.background = background
            predictor = cls(config)
            for target in TARGETS:
                earlier = reuse._models[target] if reuse is not None else None
                forms = compiled.get(target) if compiled is not None else None
                predictor._models[target].load_dict(state["targets"][target], earlier, forms)
        except ArtifactError:
            raise
        except (KeyError, TypeError, ValueError) as err:
            raise ArtifactError(f"artifact content is invalid: {err}") from None
        predictor.version = int(state.get("version", 0))
        metadata = state.get("metadata", {})
        if not isinstance(metadata, dict):
            raise ArtifactError("artifact metadata must be a JSON object")
        predictor.metadata = dict(metadata)
        predictor.last_model_load = datetime.now(UTC)
        return predictor

    def snapshot(self) -> tuple[dict[str, Any], dict[str, dict[str, CompiledTrees | None]]]:
        """The artifact's content before JSON encoding, and the trees' compiled forms: what `from_state` takes.
        For handing the model to another process of this service, where encoding, parsing and compiling again
        would cost milliseconds each time."""
        with self._lock:
            for model in self._models.values():
                model.settle()
            return self._state(), {t: dict(m.trees.compiled) for t, m in self._models.items()}

    def save(self, directory: Any) -> None:
        """Write the artifact into `directory` (atomically)."""
        save_file(directory, self.to_bytes())

    @classmethod
    def load(cls, directory: Any, background: bool | None = None) -> OnlinePredictor:
        """A predictor from the artifact in `directory` (not started)."""
        return cls.from_bytes(load_file(directory), background=background)

    def _state(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "version": self.version,
            "metadata": self.metadata,
            "targets": {t: m.to_dict() for t, m in self._models.items()},
        }


def _check_actuals(name: str, values: np.ndarray | Sequence[float], n: int) -> np.ndarray:
    values = np.asarray(values, dtype=np.float64)
    if values.shape != (n,):
        raise FeatureError(name, f"expected {n} values, got shape {values.shape}")
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise FeatureError(name, f"row {i} is {values[i]!r}; must be a finite number ≥ 0")
    return values
