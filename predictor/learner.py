"""The online predictor: physics prior × learned correction, refined by trees, calibrated by conformal.

For each target (TTFT, TPOT) a prediction in milliseconds is

    additive wait + prior(x) · exp( w·φ(x) + class offset + endpoint offset + tree residual(x) )

and the served upper quantile replaces the tree residual by a calibrated quantile of the residual. Every
observation updates w (recursive least squares), the offsets and the calibration at once; LightGBM trees are
retrained on a bounded window in the background and swapped in only when they beat the current model on every fifth
row of the window, held out of their fit. Where the recent TTFTs show a wall that the predictions overshoot (clients
giving up on a queue deeper than their timeout), TTFT is capped at it (`ceiling.OutcomeCeiling`), and the outcomes
at the wall are learned as the lower bounds they are; nor is a mean TTFT predicted beyond the longest wait learned so
far (`wait_bound.WaitBound`). The predictor answers from the first row: with nothing learned it is the physics prior.

This module holds the predictor's interface, its locking and its retraining thread; what it learns about each
target, and how, is `target.TargetModel`.
"""

from __future__ import annotations

import logging
import math
import numbers
import operator
import threading
import time
from collections.abc import Callable, Sequence, Sized
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import lightgbm as lgb

from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.errors import FeatureError
from leadtime.features.rows import FeatureRow, Observation
from leadtime.features.vectorize import FeatureBatch, Vectorizer, check_matrix
from leadtime.predictor.artifact import ArtifactError, decode, encode, load_file, save_file
from leadtime.predictor.physics import (
    TARGETS,
    additive_ms,
    correction_features,
    implausible,
    own_prefill_ms,
    prior_ms,
    queue_ahead_ms,
    wait_overstated,
)
from leadtime.predictor.target import TargetModel, TreeCandidate, not_queueing_ms, tree_inputs
from leadtime.predictor.trees import TREE_FEATURES, CompiledTrees, compile_booster

log = logging.getLogger("leadtime.predictor")

CHANGED_AT_AHEAD_KEPT = timedelta(minutes=5)
"""How far ahead of this host's clock an artifact's `changed_at` is kept as written (clocks a little apart); one
further ahead is taken as the moment of loading, with a warning."""
CHANGED_AT_AHEAD = "leadtime_changed_at_ahead"
"""The attribute that marks that warning's log record (the learner process, which loads what the service loaded
and warned about already, leaves it out)."""


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
    catalog
        The accelerator classes and models rows may name: the built-in ones and a deployment's additions. Saved
        with the model (when it adds any), so that wherever the model goes its classes keep their figures.
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
    catalog: Catalog = BUILT_IN

    def __post_init__(self) -> None:
        """Every value checked here, by name: one that fails later does so inside a `learn_one`, after part of the
        row was learned (`tree_rounds=0` at the first retrain, `window=1000.5` at the first window).

        >>> LearnerConfig(tree_rounds=0)
        Traceback (most recent call last):
        ...
        ValueError: tree_rounds must be ≥ 1, got 0
        """
        for name in ("window", "retrain_every", "min_window", "tree_rounds", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in ("quantile", "forgetting"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.catalog, Catalog):
            raise ValueError(f"catalog must be a Catalog, got {type(self.catalog).__name__}")
        if not 0.5 <= self.quantile < 1.0:
            raise ValueError(f"quantile must be in [0.5, 1), got {self.quantile}")
        if self.window < 100 or self.retrain_every < 1 or self.min_window < 50:
            raise ValueError("window must be ≥ 100, retrain_every ≥ 1 and min_window ≥ 50")
        if self.min_window > self.window:
            raise ValueError(
                f"min_window ({self.min_window}) must be ≤ window ({self.window}): a smaller window never holds the "
                "rows a first tree needs, and no tree would ever be fitted"
            )
        if self.tree_rounds < 1:
            raise ValueError(f"tree_rounds must be ≥ 1, got {self.tree_rounds}")
        if not 0.9 <= self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in [0.9, 1], got {self.forgetting}")


def _ms_text(ms: float) -> str:
    """Milliseconds for an explanation's column: two decimals, or four digits and an exponent past a billion (a
    stated wait may be any finite number, and 300 digits would bury the other terms).

    >>> _ms_text(36.849), _ms_text(1e300)
    ('     36.85', '    1e+300')
    """
    return f"{ms:10.2f}" if abs(ms) < 1e9 else f"{ms:10.4g}"


def _not_one(items: object, kind: type, method: str, single: str) -> None:
    """A TypeError for one item, or an iterator, given to a method that takes a sequence of them (it said
    "object is not iterable", or "has no len()")."""
    name = kind.__name__
    if isinstance(items, kind):
        raise TypeError(f"{method} takes a sequence of {name}s; got one {name} ({single} takes one)")
    if not isinstance(items, Sized):
        raise TypeError(f"{method} takes a sequence of {name}s (a list); got a {type(items).__name__}")


def _only(items: Sequence[Any], kind: type, usage: str) -> None:
    """A TypeError saying what the method takes, rather than an AttributeError from deep inside it."""
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise TypeError(f"{usage}; item {i} is {type(item).__name__}")


@dataclass
class Predictions:
    """Milliseconds; every array has one entry per row, in row order."""

    ttft_mean: np.ndarray
    ttft_quantile: np.ndarray
    tpot_mean: np.ndarray
    tpot_quantile: np.ndarray
    model_version: int


# Artifact metadata describing the serving trees (the offline retraining job's record of what it fitted them on).
# It is dropped when this learner swaps in trees of its own: a label must describe the trees it travels with.
TREES_LABEL_KEY = "offline_retrain"
_ACTUAL_TTFT = operator.attrgetter("actual_ttft_ms")
_ACTUAL_TPOT = operator.attrgetter("actual_tpot_ms")


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
        self.vectorizer = Vectorizer(self.config.accelerator, self.config.model, self.config.catalog)
        c = self.config
        self._models = {t: TargetModel(t, c.quantile, c.window, c.forgetting) for t in TARGETS}
        self._lock = threading.RLock()
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        self.version = 0
        self.implausible = 0  # rows dropped by the poisoning guard (`physics.implausible`)
        # Free-form JSON facts saved with the model (e.g. the service's position in the observation stream).
        self.metadata: dict[str, Any] = {}
        # When this process loaded or made the model (llm-d's `last_model_load`); not saved with it.
        self.last_model_load: datetime | None = None
        # When the model last changed: a retrain that won, or trees installed (None: never, the physics prior
        # learning online; not its making, so that the same learning gives the same artifact). Saved with it
        # (`changed_at` in the artifact), so that its age survives a restart or a publication: a stale model must
        # not look fresh because the process serving it restarted.
        self.changed_at: datetime | None = None
        self.last_retrain: datetime | None = None
        self.retrain_error: str | None = None
        self.retrain_failures = 0  # background retrains that raised (the service counts them in its metrics)
        self._retrain_wanted = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- background work ----------------------------------------------------------------------------------

    def start(self, import_now: bool = True) -> OnlinePredictor:
        """Start retraining in a background thread (with `config.background`; otherwise retrains run inside
        `learn_many`, and this does nothing). Returns the predictor, so `OnlinePredictor(config).start()` reads
        as one step.

        LightGBM is imported when trees are first fitted (a process that only predicts never needs its 1.4 s of CPU
        importing it, scikit-learn and pandas); a thread retraining beside live traffic takes it here, not at its
        first retrain, where the imports would hold the interpreter for that second. `import_now=False` leaves it
        to the first retrain: for a process that serves nothing itself (the service's learner process), most of
        whose starts never retrain (a restart, a replica that does not hold the lease, a short-lived test)."""
        if self.config.background and self._thread is None:
            if import_now:
                import lightgbm  # noqa: F401

            # Each thread has a stop of its own: one that `close()` could not wait for (closed by a retrain
            # listener, on that thread, or a retrain longer than the wait) ends after its retrain, not with the next.
            self._stopping = threading.Event()
            self._thread = threading.Thread(
                target=self._retrain_loop, args=(self._stopping,), name="leadtime-retrain", daemon=True
            )
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the background thread, if one runs (waits for a retrain in progress, unless called from that
        thread: by a retrain listener, which it returns to)."""
        self._stopping.set()
        self._retrain_wanted.set()  # wakes the thread
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)
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
        several classes match). A matrix, and a FeatureBatch the Vectorizer did not make, is checked as
        `learn_many` checks it (`check_matrix`: a FeatureError naming the column), not predicted as NaN.
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
        """The rows as a checked batch: a batch the Vectorizer made is one already (`FeatureBatch.checked`)."""
        if isinstance(rows, FeatureBatch):
            return rows if rows.checked else replace(rows, X=check_matrix(rows.X), checked=True)
        if isinstance(rows, np.ndarray):
            return replace(self.vectorizer.batch_of_matrix(check_matrix(rows)), checked=True)
        _not_one(rows, FeatureRow, "predict_many", "predict_one")
        _only(rows, FeatureRow, "predict_one and predict_many take FeatureRows (an Observation's is its .row)")
        return self.vectorizer.batch(rows)

    def debug_one(
        self, row: FeatureRow | FeatureBatch, served: Callable[[np.ndarray], Sequence[float]] | None = None
    ) -> str:
        """Explain one prediction term by term: prior, correction, offsets, trees, calibration.

        `row`: a FeatureRow, or a one-row FeatureBatch vectorized by the caller (a service explains the row exactly
        as it read it for a prediction). `served`: how the caller turns predicted milliseconds into what it answers
        (the service caps them, `service.runtime.served_ms`), so that the headline is the number the caller serves
        for this row; where that differs from the model's, both are given."""
        if not isinstance(row, FeatureRow | FeatureBatch):
            raise TypeError(f"debug_one takes a FeatureRow or a one-row FeatureBatch; got {type(row).__name__}")
        batch = self.vectorizer.batch([row]) if isinstance(row, FeatureRow) else row
        if len(batch) != 1:
            raise ValueError(f"debug_one explains one row, got {len(batch)}")
        x, hw = batch.X, batch.classes
        endpoint = batch.endpoint_ids[0] if batch.endpoint_ids else ""
        lines = []
        for target, model in self._models.items():
            prior = prior_ms(target, x)
            phi = correction_features(target, x, prior)[0]
            terms = sorted(zip(model.names, phi * model.rls.weights, strict=True), key=lambda t: -abs(t[1]))
            mean, upper = model.predict(x, hw, [endpoint] if endpoint else None)
            wait = float(additive_ms(target, x)[0])
            q = self.config.quantile * 100
            shown_mean, shown_upper = (float(mean[0]), float(upper[0]))
            if served is not None:
                shown_mean, shown_upper = served(mean[:1])[0], served(upper[:1])[0]
            lines.append(f"{target}: {shown_mean:.2f} ms (p{q:g} {shown_upper:.2f} ms)")
            if (shown_mean, shown_upper) != (float(mean[0]), float(upper[0])):
                model_says = f"{_ms_text(float(mean[0]))} ms (p{q:g} {float(upper[0]):.4g} ms)"
                lines.append(f"  as the model gives it    {model_says}")
            lines.append(f"  physics prior            {float(prior[0]):10.2f} ms")
            if wait:
                lines.append(f"  time-slice wait          {_ms_text(wait)} ms (added)")  # as sent: any size
            lines.append(f"  online correction        ×{math.exp(float(phi @ model.rls.weights)):.3f}")
            for name, value in terms[:5]:
                lines.append(f"    {name:<28} {value:+.3f} (log)")
            lines.append(f"  accelerator-class offset ×{math.exp(model.classes.get(hw[0])):.3f} ({hw[0]})")
            lines.append(f"  endpoint offset          ×{math.exp(model.endpoints.get(endpoint)):.3f}")
            tree = model.trees.predict_mean(tree_inputs(x, prior))
            if tree is not None:
                lines.append(f"  tree residual            ×{math.exp(float(tree[0])):.3f}")
                lines.append(f"  median recentring        ×{math.exp(model.tree_center):.3f} (the tree's)")
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
            own = float(own_prefill_ms(x)[0])
            bound = model.wait_bound
            if bound is not None and bound.bounds(hw[0]) and float(queue_ahead_ms(x)[0]) > bound.deepest_ms:
                limit = float(not_queueing_ms(target, x)[0]) + bound.longest_ms
                if float(mean[0]) >= limit - 1e-9:
                    lines.append(
                        f"  longest wait learned     {limit:10.2f} ms (own prefill and stated waits + the longest "
                        "wait; the mean of a queue deeper than any learned is at most this)"
                    )
            wall = model.ceiling
            if wall is not None and wall.active:
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

        The same observations learned in batches of another size end near the same model, not at it. The online
        correction learns 32 rows at a time (`target._BLOCK`), each row's residual taken against the state at its
        block's start, and the first block, not the first row, sets the scale of its pull to the prior; one row at a
        time, each learns against the state the row before left. The calibration is settled 64 rows at a time
        whatever the batch size, each 64 against the calibration those before left: beyond those residuals, a
        batch's size changes only where the 64-row boundaries fall. Retrains on drift, and a background learner's
        scheduled ones, come between batches, not between rows, so trees may be fitted at other moments (a
        synchronous learner stops a batch where a retrain falls due). Measured without trees: 2,000 rows in one call
        and one at a time predicted within 2% of each other (within 7% after the first 40 rows); 5,000 rows in one
        call and 64 at a time served the same p90 coverage within a point.
        """
        if isinstance(observations, FeatureBatch | np.ndarray):
            if actual_ttft_ms is None or actual_tpot_ms is None:
                raise TypeError("learn_many(batch, actual_ttft_ms, actual_tpot_ms): a batch needs its actuals")
            batch = self._batch(observations)
        else:
            if actual_ttft_ms is not None or actual_tpot_ms is not None:
                raise TypeError("learn_many(observations): Observations carry their own actuals")
            _not_one(observations, Observation, "learn_many", "learn_one")
            n = len(observations)
            if n == 0:
                return
            _only(
                observations,
                Observation,
                "learn_one and learn_many take Observations: a FeatureRow with its actual TTFT/TPOT",
            )
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
        bad = implausible(x, actual["ttft"], actual["tpot"])  # the service's poisoning guard, for every caller
        if bad.any():
            self.implausible += int(bad.sum())
            actual = {t: np.where(bad, 0.0, a) for t, a in actual.items()}  # 0: not observed, not learned
        # A first token sooner than the wait its row states tells nothing of the multiplicative part: TTFT less
        # the wait is below any real one. Its TTFT is not learned at all, rather than learned as log(actual /
        # (wait + prior)): that would still pull the correction that every other row shares towards a wait the
        # router misjudged, where skipping leaves the model as the other rows make it. Its TPOT is learned.
        overstated = wait_overstated(x, actual["ttft"])
        if overstated.any():
            actual["ttft"] = np.where(overstated, 0.0, actual["ttft"])
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
            with self._lock:
                self.metadata.pop(TREES_LABEL_KEY, None)  # trees fitted elsewhere no longer all serve
            self.version += 1
            self.last_model_load = self.changed_at = self.last_retrain
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
        (from `residual_training_set`): (mean, upper quantile). The trees serving (the mean tree with its median
        recentring), or without them the median recentring and the conformal offset: the baseline a tree fitted
        elsewhere must beat."""
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
        candidate = TreeCandidate(mean=mean, upper=upper, upper_shift=float(upper_shift), residuals=residuals)
        for name, booster in (("mean", mean), ("upper", upper)):
            if booster is not None:
                candidate.compiled[name] = compile_booster(booster)
        with self._lock:
            model = self._model(target)
            model.settle()
            model.swap_in(candidate)
            self.changed_at = datetime.now(UTC)

    def add_retrain_listener(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call `fn(result)` after every retrain (on the thread that ran it)."""
        self._listeners.append(fn)

    def _retrain_loop(self, stopping: threading.Event) -> None:
        """A failed retrain is recorded (status()["retrain_error"]) and the thread lives on: the online parts
        keep learning and the next trigger tries again."""
        while not stopping.is_set():
            if self._retrain_wanted.wait(timeout=0.5):
                self._retrain_wanted.clear()
                if stopping.is_set():
                    continue
                try:
                    self.retrain_now()
                    self.retrain_error = None
                except Exception as err:  # LightGBM raises plain exceptions of several kinds
                    self.retrain_error = f"{type(err).__name__}: {err}"
                    self.retrain_failures += 1
                    log.exception("background retrain failed")

    # --- introspection ------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Observations learned, window sizes, trees serving, drifts, last retrain and its error, version."""
        return {
            "observations": {t: m.observations for t, m in self._models.items()},
            "implausible": self.implausible,
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

    def _model(self, target: str) -> TargetModel:
        if target not in self._models:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        return self._models[target]

    def adopt_catalog(self, catalog: Catalog) -> None:
        """Know `catalog`'s classes from now on, and save them with the model: a process whose catalog extends the
        one the model was trained with (it grew, or the model predates it) teaches the model classes it must carry.
        ValueError if `catalog` lacks a class of the model's own or states it otherwise (`Catalog.differences`)."""
        differences = catalog.differences(self.config.catalog)
        if differences:
            raise ValueError(f"the catalog does not extend the model's: {'; '.join(differences)}")
        with self._lock:
            self.config = replace(self.config, catalog=catalog)
            self.vectorizer = Vectorizer(self.config.accelerator, self.config.model, catalog)

    # --- persistence ------------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The artifact: JSON with the trees as LightGBM text (never a pickle).

        Learned rows whose calibration update still waits (it is applied every 64 rows, in a batch, for speed) are
        applied first, so the artifact holds everything learned: predictions afterwards include them, as they would
        have a few rows later."""
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
        trees' compiled forms per target, when the sender has them.

        Any failure to make a predictor of the content is an ArtifactError naming it: a checksum says only who
        wrote the document, not that its content is of the shapes this build reads (an endpoint table that is a
        string raised AttributeError, which no caller expects from a refused model)."""
        try:
            fields = dict(state["config"])
            if "catalog" in fields:  # checked as a catalog file is: a checksum says who wrote it, not what it says
                from leadtime.features.catalog_file import parse_catalog

                fields["catalog"] = parse_catalog(fields["catalog"])
            config = LearnerConfig(**fields)
            if background is not None:
                config.background = background
            predictor = cls(config)
        except ArtifactError:
            raise
        except Exception as err:
            raise ArtifactError(f"artifact content is invalid: {type(err).__name__}: {err}") from None
        try:
            predictor._load_state(state, reuse, compiled)
        except BaseException as err:
            predictor.close()
            if isinstance(err, ArtifactError) or not isinstance(err, Exception):
                raise
            raise ArtifactError(f"artifact content is invalid: {type(err).__name__}: {err}") from None
        return predictor

    def _load_state(
        self,
        state: dict[str, Any],
        reuse: OnlinePredictor | None,
        compiled: dict[str, dict[str, CompiledTrees | None]] | None,
    ) -> None:
        """`from_state`'s filling of a new predictor; raises whatever the content makes it raise."""
        for target in TARGETS:
            earlier = reuse._models[target] if reuse is not None else None
            forms = compiled.get(target) if compiled is not None else None
            self._models[target].load_dict(state["targets"][target], earlier, forms)
        self.version = int(state.get("version", 0))
        metadata = state.get("metadata", {})
        if not isinstance(metadata, dict):
            raise ArtifactError("artifact metadata must be a JSON object")
        self.metadata = dict(metadata)
        self.last_model_load = datetime.now(UTC)
        changed_at = state.get("changed_at")
        if changed_at is not None:  # None: never changed, or written before it was recorded
            try:
                self.changed_at = datetime.fromisoformat(changed_at)
            except (TypeError, ValueError):
                raise ArtifactError(f"artifact changed_at {changed_at!r} is not an ISO 8601 time") from None
            if self.changed_at.tzinfo is None:
                raise ArtifactError(f"artifact changed_at {changed_at!r} has no UTC offset")
            now = datetime.now(UTC)
            ahead = self.changed_at - now
            if ahead > CHANGED_AT_AHEAD_KEPT:
                # Written by a publisher whose clock runs ahead (or made up): its age would read negative, hiding
                # the model going stale. The model itself is good: kept, its change taken as now.
                log.warning(
                    "the model's changed_at %s is %.0f s ahead of this host's clock (the publisher's clock runs "
                    "ahead?): taken as now, its age counted from this load",
                    changed_at,
                    ahead.total_seconds(),
                    extra={CHANGED_AT_AHEAD: True},
                )
                self.changed_at = now

    def snapshot(self) -> tuple[dict[str, Any], dict[str, dict[str, CompiledTrees | None]]]:
        """The artifact's content before JSON encoding, and the trees' compiled forms: what `from_state` takes.
        For handing the model to another process of this service, where encoding, parsing and compiling again
        would cost milliseconds each time."""
        with self._lock:
            for model in self._models.values():
                model.settle()
            return self._state(), {t: dict(m.trees.compiled) for t, m in self._models.items()}

    def __reduce__(self) -> Any:
        """Refused with the way that works: a predictor holds locks and threads, and its artifact is the portable
        form (JSON and LightGBM text, checked on load).

        >>> import pickle
        >>> try:
        ...     pickle.dumps(OnlinePredictor())
        ... except TypeError as err:
        ...     print(err)
        an OnlinePredictor is not pickled: save it with to_bytes() or save(DIR), load it with from_bytes() or load(DIR)
        """
        raise TypeError(
            "an OnlinePredictor is not pickled: save it with to_bytes() or save(DIR), load it with from_bytes() or "
            "load(DIR)"
        )

    def save(self, directory: Any) -> None:
        """Write the artifact into `directory` (atomically; what `serve --model-dir` reads), or as the file named,
        given a path ending in `.json`."""
        save_file(directory, self.to_bytes())

    @classmethod
    def load(cls, directory: Any, background: bool | None = None) -> OnlinePredictor:
        """A predictor from the artifact in `directory`, or in the file named (not started)."""
        return cls.from_bytes(load_file(directory), background=background)

    def _state(self) -> dict[str, Any]:
        config = asdict(self.config)
        if self.config.catalog == BUILT_IN:  # left out when it adds nothing: the same bytes as releases before it
            del config["catalog"]
        state: dict[str, Any] = {"config": config, "version": self.version}
        if self.changed_at is not None:  # left out when never changed: the same bytes as releases before it
            state["changed_at"] = self.changed_at.isoformat()
        state["metadata"] = self.metadata
        state["targets"] = {t: m.to_dict() for t, m in self._models.items()}
        return state


def _check_actuals(name: str, values: np.ndarray | Sequence[float], n: int) -> np.ndarray:
    try:
        values = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise FeatureError(name, "must hold numbers only") from None
    if values.shape != (n,):
        raise FeatureError(name, f"expected {n} values, got shape {values.shape}")
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise FeatureError(name, f"row {i} is {float(values[i])!r}; must be a finite number ≥ 0")
    return values
