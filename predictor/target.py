"""One target's model (TTFT or TPOT): everything `OnlinePredictor` keeps per target.

The online parts (recursive least squares on the correction features, per-class and per-endpoint offsets), the
residual trees and how a candidate is fitted and judged against the serving ones, the calibration of the upper
quantile (settled in batches against what was served) and, for TTFT, the wall of a client timeout. The predictor
owns two of these, the locking and the retraining thread; each of these owns the arithmetic of one target.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from leadtime.features.vectorize import COLUMNS
from leadtime.predictor.artifact import ArtifactError
from leadtime.predictor.ceiling import OutcomeCeiling
from leadtime.predictor.forward import ForwardRecord, percentage_errors, pinball_losses
from leadtime.predictor.online import RECENTRE_AFTER, ConformalQuantile, OffsetTable, RecursiveLeastSquares
from leadtime.predictor.physics import (
    IMPLAUSIBLY_FAST,
    MIN_MS,
    additive_ms,
    convert_resident_column,
    correction_feature_names,
    correction_features,
    floor_ms,
    own_prefill_ms,
    prior_ms,
    queue_ahead_ms,
)
from leadtime.predictor.trees import CompiledTrees, ResidualTrees, compile_booster, fit_booster
from leadtime.predictor.wait_bound import WaitBound

_SETTLE_EVERY = 64  # observations between calibration updates (they need a LightGBM call)
_BLOCK = 32  # rows per block update of the online correction when learning a batch
# The global correction's pull towards the physics prior weighs like this many observations (~2.5 per feature
# it learns), so that its first observations, all from one accelerator class, do not carry over to every other
# class in full: one observation 3x slower than the prior moved another class's prediction by x3 with a ridge
# of 1, and moves it by ~x1.2 with this.
_PRIOR_ROWS = 30.0


def log_target(target: str, x: np.ndarray, actual_ms: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """What the correction and the trees learn for every row: log(actual without the additive wait / prior)."""
    wait = additive_ms(target, x)
    return np.log(np.maximum(actual_ms - wait, MIN_MS)) - np.log(np.maximum(prior, MIN_MS))


def not_queueing_ms(target: str, x: np.ndarray) -> np.ndarray:
    """The part of each row's latency that is no queue wait (`wait_bound`): its own prefill and a stated wait."""
    return own_prefill_ms(x) + additive_ms(target, x)


def tree_inputs(x: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """The trees' feature matrix: every column plus the log of the physics prior (TREE_FEATURES order)."""
    out = np.empty((len(x), x.shape[1] + 1))
    out[:, :-1] = x
    out[:, -1] = np.log(np.maximum(prior, MIN_MS))
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


class SampleWindow:
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
        """Forget every row (the service's flush); returns how many there were."""
        flushed = self.count
        self.count = 0
        self.total = 0
        return flushed


@dataclass
class TreeCandidate:
    """Trees fitted on a window (None where the serving one won), with what swapping them in needs."""

    mean: Any
    upper: Any
    upper_shift: float
    residuals: np.ndarray  # the online model's residuals over the whole window
    serving_upper_shift: float | None = None  # the serving quantile tree's shift, fitted again on this window
    compiled: dict[str, CompiledTrees | None] = field(default_factory=dict)


class _Adwin:
    """river's `drift.ADWIN()`: its Rust core with ADWIN's defaults, reset on the update after a drift as ADWIN
    is. `from river import drift` pulls in scikit-learn, scipy.stats and pandas for the package's example datasets:
    ~0.7 s and ~70 MiB at every start of every process (the service, each CLI run, each test worker) for this one
    detector. `new_drift_detector` falls back to river's ADWIN should a release move the core or change it."""

    __slots__ = ("_core", "_helper", "drift_detected")

    def __init__(self, core: Callable[..., Any]) -> None:
        self._core = core
        self._helper = core(**_ADWIN_DEFAULTS)
        self.drift_detected = False

    def update(self, x: float) -> None:
        if self.drift_detected:
            self._helper = self._core(**_ADWIN_DEFAULTS)
        self.drift_detected = bool(self._helper.update(x))


_ADWIN_DEFAULTS = {"delta": 0.002, "clock": 32, "max_buckets": 5, "min_window_length": 5, "grace_period": 10}


def new_drift_detector() -> Any:
    """A drift detector on a target's errors: ADWIN with river's defaults (`update(x)`, then `drift_detected`)."""
    try:
        from river._river_rust.drift import AdaptiveWindowing

        return _Adwin(AdaptiveWindowing)
    except (ImportError, TypeError):  # pragma: no cover - a river whose core moved or whose arguments changed
        from river import drift

        return drift.ADWIN()


class TargetModel:
    """Everything learned about one target."""

    def __init__(self, target: str, quantile: float, window: int, forgetting: float) -> None:
        self.target = target
        self.names = correction_feature_names(target)
        self.rls = RecursiveLeastSquares(len(self.names), forgetting=forgetting, ridge=1.0, prior_rows=_PRIOR_ROWS)
        self.classes = OffsetTable(rate=0.02, prior_count=20.0)
        self.endpoints = OffsetTable(rate=0.1, prior_count=5.0)
        self.conformal = ConformalQuantile(quantile)
        self.trees = ResidualTrees()
        # Only TTFT has a wall: a client's timeout bounds how long a request may queue, not how fast it decodes.
        self.ceiling = OutcomeCeiling(quantile=quantile) if target == "ttft" else None
        # Nor is a TTFT predicted beyond the longest wait learned: the queue model's extrapolation is unproven.
        self.wait_bound = WaitBound() if target == "ttft" else None
        self.window = SampleWindow(window)
        self.drift = new_drift_detector()
        self.observations = 0
        self.since_retrain = 0
        self.drifts = 0
        # The serving mean and quantile trees against none, on the rows that came after them (`forward`).
        self.forward = ForwardRecord()
        self.upper_forward = ForwardRecord()
        self.trees_retired = 0
        # Log-space shift that calibrates an accepted quantile tree on its held-out data.
        self.upper_shift = 0.0
        # A serving mean tree's point is recentred on the median of its own recent log residuals, as the online
        # parts' point is on theirs (`ConformalQuantile.center`): a tree fitted on log residuals predicts their
        # mean, and under skewed noise exp(mean log) is not the median. Without it, only the rows served without a
        # tree were recentred (measured on sim:mixed under delayed labels: prequential TPOT MAPE 0.252 → 0.236).
        self.tree_center = 0.0
        self._tree_residuals: deque[float] = deque(maxlen=self.conformal.window)
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]] = []
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
        z_point = z_online + (self.conformal.center if mean_residual is None else mean_residual + self.tree_center)
        if upper_residual is None:
            z_upper = z_online + self.conformal.offset
        else:
            z_upper = z_online + upper_residual + self.upper_shift + self.conformal.adaptive
        z_upper = np.maximum(z_upper, z_point)
        extra = additive_ms(self.target, x)
        mean, upper = extra + prior * np.exp(z_point), extra + prior * np.exp(z_upper)
        mean, upper = self._bounded(mean, upper, x, hw)
        # Never below what the poisoning guard would refuse to learn (`physics.implausible`): however far down
        # the outcomes it was fed have pushed the correction, the physics bounds how fast a request can go.
        floor = floor_ms(self.target, x) * (1.000001 / IMPLAUSIBLY_FAST)  # a hair above, whatever the rounding
        return np.maximum(mean, floor), np.maximum(upper, floor)

    def _bounded(
        self, mean_ms: np.ndarray, upper_ms: np.ndarray, x: np.ndarray, hw: list[str] | str
    ) -> tuple[np.ndarray, np.ndarray]:
        """The predictions as served: the mean within the longest wait learned on its class (`hw` as in
        `online_log`), both capped at an active wall."""
        if self.ceiling is None or self.wait_bound is None:
            return mean_ms, upper_ms
        own = own_prefill_ms(x)
        bounded = self.wait_bound.cap(mean_ms, not_queueing_ms(self.target, x), queue_ahead_ms(x), hw)
        return self.ceiling.cap(bounded, upper_ms, own)

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
        if self.wait_bound is not None:
            self.wait_bound.learn_many(actual_ms, not_queueing_ms(self.target, x), queue_ahead_ms(x), hw)
        self._pending.append((x, prior, learned_all, online_all, actual_ms, hw))
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
        """Update the calibration with every pending observation, in order, against what was served then.

        The rows are settled `_SETTLE_EVERY` at a time, each chunk against the calibration as the chunks before it
        left it: as they would have been had they arrived that many at a time. All judged against the calibration
        that stood before a large batch, with the adaptive term stepped once per row and nothing fed back, 5,000
        rows learned in one call drove that term to -4.7 and the p90 onto the mean (coverage 0.48; learned 64 at
        a time, 0.98). The trees are asked once for all the rows (LightGBM's cost is per call), and their output
        sliced.
        """
        if not self._pending:
            return
        pending, self._pending, self._pending_rows = self._pending, [], 0
        x = np.concatenate([p[0] for p in pending])
        prior = np.concatenate([p[1] for p in pending])
        z = np.concatenate([p[2] for p in pending])
        online = np.concatenate([p[3] for p in pending])
        actual_ms = np.concatenate([p[4] for p in pending])
        hw = [key for p in pending for key in p[5]]
        tree_x = tree_inputs(x, prior)
        trees = self.trees
        mean_all = trees.predict_mean(tree_x)
        upper_all = trees.predict_upper(tree_x)
        for start in range(0, len(z), _SETTLE_EVERY):
            rows = slice(start, start + _SETTLE_EVERY)
            # A tree that an earlier chunk retired served none of the rows after it.
            mean_residual = None if mean_all is None or self.trees.mean is None else mean_all[rows]
            upper_residual = None if upper_all is None or self.trees.upper is None else upper_all[rows]
            self._settle_chunk(
                x[rows], prior[rows], z[rows], online[rows], actual_ms[rows], hw[rows], mean_residual, upper_residual
            )

    def _settle_chunk(
        self,
        x: np.ndarray,
        prior: np.ndarray,
        z: np.ndarray,
        online: np.ndarray,
        actual_ms: np.ndarray,
        hw: list[str],
        mean_residual: np.ndarray | None,
        upper_residual: np.ndarray | None,
    ) -> None:
        """Settle consecutive rows served with one calibration: the trees' records, the coverage of each row's
        upper quantile and the residuals the calibration learns. `hw`: each row's class; `mean_residual` and
        `upper_residual`: the serving trees' output for these rows (None where no such tree serves)."""
        point = online + (self.conformal.center if mean_residual is None else mean_residual + self.tree_center)
        conformal = self.conformal
        extra = additive_ms(self.target, x)
        uncapped_ms = extra + prior * np.exp(point)
        if mean_residual is not None:
            plain_ms = extra + prior * np.exp(online + conformal.center)
            self.forward.add(
                percentage_errors(actual_ms, self._served_mean(uncapped_ms, x, hw)),
                percentage_errors(actual_ms, self._served_mean(plain_ms, x, hw)),
            )
        # Coverage is of the quantile served: under a wall that is the capped one, and the adaptive term must
        # answer for it (the uncapped model's residuals there say it over-predicts, and it shrinks its width).
        wall = self.ceiling if self.ceiling is not None and self.ceiling.active else None
        # Every row of the chunk was served with the calibration as it stood at the chunk's start: judge each
        # against that, not against the adaptive term as it moves within the chunk. Judged against the moving term,
        # a steady climb looked covered (the term rose row by row in the judging) while what was served
        # missed: p90 coverage 0.62 over a tenth of a P/D trace whose TTFTs were climbing.
        served_offset, served_adaptive, shadow_offset = conformal.offset, conformal.adaptive, conformal.shadow_offset
        # What each row was served as its upper quantile (log), and, while a quantile tree serves, what it would
        # have been served without the tree: the conformal offset over the online parts.
        plain = np.maximum(online + (served_offset if upper_residual is None else shadow_offset), point)
        top = (
            plain
            if upper_residual is None
            else np.maximum(online + upper_residual + self.upper_shift + served_adaptive, point)
        )
        if wall is None and upper_residual is None:  # the usual case: coverage in log space, nothing else needed
            for i, covered in enumerate((z <= top + 1e-12).tolist()):
                conformal.observe(float(z[i] - online[i]), covered)
            self._settle_mean_tree(z - online, mean_residual)
            return
        served_ms = self._served_upper_ms(top, extra, prior, uncapped_ms, x, wall)
        plain_upper_ms = self._served_upper_ms(plain, extra, prior, uncapped_ms, x, wall)
        if wall is None:
            covered_all, plain_covered_all = z <= top + 1e-12, z <= plain + 1e-12
        else:
            covered_all = actual_ms <= served_ms * (1.0 + 1e-12)
            plain_covered_all = actual_ms <= plain_upper_ms * (1.0 + 1e-12)
        for i in range(len(z)):
            shadow_covered = None if upper_residual is None else bool(plain_covered_all[i])
            conformal.observe(float(z[i] - online[i]), bool(covered_all[i]), shadow_covered)
        if upper_residual is not None:
            self.upper_forward.add(
                pinball_losses(actual_ms, served_ms, conformal.quantile),
                pinball_losses(actual_ms, plain_upper_ms, conformal.quantile),
            )
            if self.upper_forward.retire():
                self._retire_tree("upper")
        self._settle_mean_tree(z - online, mean_residual)

    def _settle_mean_tree(self, residual: np.ndarray, mean_residual: np.ndarray | None) -> None:
        """Recentre the serving mean tree on the residuals it served (`tree_center`), or retire it if its
        record says it does worse than none."""
        if self.trees.mean is None or mean_residual is None:
            return
        if self.forward.retire():
            self._retire_tree("mean")
            return
        self._tree_residuals.extend((residual - mean_residual).tolist())
        if len(self._tree_residuals) >= RECENTRE_AFTER:
            self.tree_center = float(np.median(np.fromiter(self._tree_residuals, float)))

    def _served_upper_ms(
        self,
        z_upper: np.ndarray,
        extra: np.ndarray,
        prior: np.ndarray,
        uncapped_ms: np.ndarray,
        x: np.ndarray,
        wall: OutcomeCeiling | None,
    ) -> np.ndarray:
        """Upper quantiles in ms from their log values, as served: under an active wall, capped as `predict` caps
        them (row by row, as the wall's cap is)."""
        upper_ms = extra + prior * np.exp(z_upper)
        if wall is None:
            return upper_ms
        own = own_prefill_ms(x)
        return np.array(
            [wall.cap(float(m), float(u), float(o))[1] for m, u, o in zip(uncapped_ms, upper_ms, own, strict=True)]
        )

    def _served_mean(self, mean_ms: np.ndarray, x: np.ndarray, hw: list[str]) -> np.ndarray:
        """The mean predictions of rows `x`, of classes `hw`, as served (`_bounded`)."""
        return self._bounded(mean_ms, mean_ms, x, hw)[0]

    def _retire_tree(self, kind: str) -> None:
        """The `kind` ("mean" or "upper") tree did worse than no tree on the rows since it was swapped in: serve
        without it. A retired quantile tree leaves the conformal offset as its record judged it (`shadow`)."""
        old = self.trees
        compiled = dict(old.compiled)
        compiled[kind] = None
        if kind == "mean":
            self.trees = ResidualTrees(mean=None, upper=old.upper, compiled=compiled)
            self.forward.reset()
            self._restart_tree_center()
        else:
            self.trees = ResidualTrees(mean=old.mean, upper=None, compiled=compiled)
            self.upper_forward.reset()
            self.conformal.serve_offset()
        self._loaded_trees = None
        self.trees_retired += 1

    def _restart_tree_center(self) -> None:
        """A new mean tree (or none) serves: its centre is learned afresh from its own residuals."""
        self.tree_center = 0.0
        self._tree_residuals.clear()

    # --- retraining -----------------------------------------------------------------------------------------

    def fit_candidate(
        self,
        snapshot: tuple[np.ndarray, np.ndarray, list[str], list[str]],
        quantile: float,
        rounds: int,
        seed: int,
        min_window: int,
    ) -> tuple[TreeCandidate | None, dict[str, Any]]:
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

        # Against what serves now: the online parts recentred on their median residual, or the serving tree with its
        # own centre. Judged against no correction at all, a tree that learned only that constant offset (pulled off
        # the median by a tail of slow rows) passed, and served worse than the model it replaced.
        serving_mean, _ = self.serving_residuals(test_x)
        baseline_ape = ape(test_r - serving_mean)
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
        candidate = TreeCandidate(
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
        mean_out = np.full(n, self.conformal.center) if mean is None else mean + self.tree_center
        if upper is None:
            upper_out = np.full(n, self.conformal.offset)
        else:
            upper_out = upper + self.upper_shift + self.conformal.adaptive
        return mean_out, np.maximum(upper_out, mean_out)

    def swap_in(self, candidate: TreeCandidate | None) -> None:
        """Serve the trees the candidate won and restart the calibration on its window's residuals (a kept
        quantile tree's shift is the one fitted again there); None only resets the retrain count."""
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
            self._restart_tree_center()
        if candidate.upper is not None:
            upper = candidate.upper
            compiled["upper"] = candidate.compiled["upper"]
            self.upper_shift = candidate.upper_shift
            self.conformal.adaptive = 0.0
            self.upper_forward.reset()
        elif candidate.serving_upper_shift is not None and old.upper is not None:
            self.upper_shift = candidate.serving_upper_shift
        if mean is not old.mean or upper is not old.upper:
            self.trees = ResidualTrees(mean=mean, upper=upper, compiled=compiled)
            self._loaded_trees = None

    # --- persistence ------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values (the trees as LightGBM text), with the serving trees' forward records
        and the rows since the last retrain, so that a learner loaded from it judges and retrains on as it would
        have without the restart.

        The sample window is not saved: 20,000 rows of every column by default, megabytes of JSON in an artifact
        that the service loads from its learner process several times a second and saves, publishes and serves
        as its model. A loaded learner collects a new window, and a retrain before that holds `min_window` rows
        fits no tree. Nor is the drift detector's state saved: it starts again on the errors to come.
        """
        return {
            "feature_names": self.names,
            "rls": self.rls.to_dict(),
            "classes": self.classes.to_dict(),
            "endpoints": self.endpoints.to_dict(),
            "conformal": self.conformal.to_dict(),
            "trees": self.trees.to_dict(),
            "upper_shift": self.upper_shift,
            "tree_center": self.tree_center,
            "tree_residuals": list(self._tree_residuals),
            "ceiling": None if self.ceiling is None else self.ceiling.to_dict(),
            "wait_bound": None if self.wait_bound is None else self.wait_bound.to_dict(),
            "observations": self.observations,
            "drifts": self.drifts,
            "since_retrain": self.since_retrain,
            "forward": self.forward.to_dict(),
            "upper_forward": self.upper_forward.to_dict(),
        }

    def load_dict(
        self,
        d: dict[str, Any],
        reuse: TargetModel | None = None,
        compiled: dict[str, CompiledTrees | None] | None = None,
    ) -> None:
        """Take the state `to_dict` wrote; trees whose text `reuse` was loaded from are taken from it, not parsed
        again."""
        names, rls = convert_resident_column(d["feature_names"], d["rls"])  # as saved before `timeslice_away`
        if names != self.names:
            raise ArtifactError(f"{self.target}: correction features differ from this version's")
        learner = RecursiveLeastSquares.from_dict(rls)
        if learner.n_features != len(names):  # else every prediction fails, not the load
            raise ValueError(
                f"{self.target}: the correction has {learner.n_features} weights for {len(names)} features"
            )
        self.rls = learner
        self.classes = OffsetTable.from_dict(d["classes"])
        self.endpoints = OffsetTable.from_dict(d["endpoints"])
        self.conformal = ConformalQuantile.from_dict(d["conformal"])
        if reuse is not None and reuse._loaded_trees is not None and reuse._loaded_trees == d["trees"]:
            self.trees = reuse.trees
        else:
            self.trees = ResidualTrees.from_dict(d["trees"], compiled)
        self._loaded_trees = d["trees"]
        self.upper_shift = float(d["upper_shift"])
        # Artifacts written before the mean tree was recentred have no centre: their trees served without one.
        self.tree_center = float(d.get("tree_center", 0.0))
        self._tree_residuals = deque((float(r) for r in d.get("tree_residuals", [])), maxlen=self.conformal.window)
        if self.ceiling is not None and d.get("ceiling"):  # artifacts written before the ceiling have none
            self.ceiling.load_dict(d["ceiling"])
        if self.wait_bound is not None and d.get("wait_bound"):  # nor those written before the wait bound
            # One written before the bound was per class bounds the classes learned (`WaitBound.load_dict`).
            self.wait_bound.load_dict(d["wait_bound"], classes=d["classes"]["counts"])
        self.observations = int(d["observations"])
        self.drifts = int(d["drifts"])
        # Artifacts written before these were saved have none: their trees' records start empty, as they did.
        self.since_retrain = int(d.get("since_retrain", 0))
        self.forward = ForwardRecord.from_dict(d["forward"]) if "forward" in d else ForwardRecord()
        self.upper_forward = ForwardRecord.from_dict(d["upper_forward"]) if "upper_forward" in d else ForwardRecord()
