"""Small online learners, each updated on every observation in microseconds.

- `RecursiveLeastSquares`: exact online least squares with exponential forgetting and a ridge pull towards zero
  (zero correction = trust the physics prior), so it is sensible from the first row and tracks drifting load.
- `OffsetTable`: an exponentially weighted mean residual per key (accelerator class, endpoint), shrunk towards
  zero until a key has a few observations, so one slow endpoint is learned without a retrain.
- `ConformalQuantile`: the upper quantile as the empirical quantile of recent out-of-sample residuals plus an
  adaptive conformal offset (Gibbs & Candès) that steers the realised miss rate to the target online.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np


class RecursiveLeastSquares:
    """Online linear regression y ≈ w·φ with forgetting factor `forgetting` and initial ridge `ridge`.

    Parameters
    ----------
    n_features
        Width of φ.
    forgetting
        Weight kept by the past at each update; 0.999 remembers roughly the last thousand observations.
    ridge
        Strength of the initial pull of w towards 0; larger is more cautious on the first observations.
    prior_rows
        When > 0, the initial pull is set by the first rows instead: it weighs like `prior_rows` observations
        of their scale (a ridge of 1 is nothing beside features of magnitude ~10, so one observation would
        move w almost all the way).
    clip
        Innovations larger than `clip` times the running mean absolute error are clipped (outliers).

    Examples
    --------
    >>> import numpy as np
    >>> rls = RecursiveLeastSquares(2, forgetting=1.0, ridge=1e-3)
    >>> for x in np.linspace(0, 1, 200):
    ...     _ = rls.learn_one(np.array([1.0, x]), 2.0 + 3.0 * x)
    >>> [round(float(w), 2) for w in rls.weights]
    [2.0, 3.0]
    """

    def __init__(
        self,
        n_features: int,
        forgetting: float = 0.999,
        ridge: float = 1.0,
        clip: float = 4.0,
        prior_rows: float = 0.0,
    ) -> None:
        self.n_features = n_features
        self.forgetting = forgetting
        self.ridge = ridge
        self.clip = clip
        self.prior_rows = prior_rows
        self.weights = np.zeros(n_features)
        self._p = np.eye(n_features) / ridge
        self._mean_abs_error = 0.0
        self.n_seen = 0
        self._since_maintenance = 0

    def predict_many(self, phi: np.ndarray) -> np.ndarray:
        """w·φ for every row of φ."""
        return phi @ self.weights

    def learn_one(self, phi: np.ndarray, y: float) -> float:
        """Update on one (φ, y); returns the prior (before-update) error y − w·φ."""
        if self.n_seen == 0 and self.prior_rows:
            self._scale_prior(phi[None, :])
        weights, p = self.weights, self._p
        error = float(y - phi @ weights)
        bound = self.clip * self._mean_abs_error if self.n_seen >= 20 else np.inf
        step = min(max(error, -bound), bound)
        p_phi = p @ phi
        gain = p_phi / (self.forgetting + float(phi @ p_phi))
        weights += gain * step
        p -= np.outer(gain, p_phi)
        p *= 1.0 / self.forgetting
        self._after_update(1)
        self._mean_abs_error += (abs(error) - self._mean_abs_error) / min(self.n_seen, 200)
        return error

    def learn_many(self, phi: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Update on a block of rows at once (matrix-inversion lemma); returns the before-update errors.

        Equivalent to `learn_one` row by row when `forgetting` is 1, except that outlier clipping uses the
        running error scale from before the block, and that with `prior_rows` the first block, not its first row
        alone, sets the prior's scale; with forgetting, the block is discounted as one step of
        `forgetting ** len(y)`. Used for high-rate ingestion, where per-row Python overhead dominates.
        """
        if len(y) == 1:
            return np.array([self.learn_one(phi[0], float(y[0]))])
        if self.n_seen == 0 and self.prior_rows:
            self._scale_prior(phi)
        errors = y - phi @ self.weights
        bound = self.clip * self._mean_abs_error if self.n_seen >= 20 else np.inf
        steps = np.clip(errors, -bound, bound)
        lam = self.forgetting ** len(y)
        p_phi_t = self._p @ phi.T
        gain = np.linalg.solve(lam * np.eye(len(y)) + phi @ p_phi_t, p_phi_t.T).T
        self.weights += gain @ steps
        self._p -= gain @ p_phi_t.T
        self._p *= 1.0 / lam
        seen = self.n_seen
        self._after_update(len(y))
        for error in np.abs(errors).tolist():  # each row with its own count, as `learn_one` takes them
            seen += 1
            self._mean_abs_error += (error - self._mean_abs_error) / min(seen, 200)
        return errors

    def _scale_prior(self, phi: np.ndarray) -> None:
        """Make the pull towards 0 weigh like `prior_rows` observations of the scale of the first rows."""
        scale = np.maximum(np.mean(phi * phi, axis=0), 1.0)
        self._p = np.diag(1.0 / (self.prior_rows * scale))

    def _after_update(self, rows: int) -> None:
        self.n_seen += rows
        self._since_maintenance += rows
        if self._since_maintenance >= 256:
            # Keep P symmetric and bounded so long runs with little excitation do not blow it up.
            self._since_maintenance = 0
            p = self._p
            p[:] = 0.5 * (p + p.T)
            trace = float(np.trace(p))
            if trace > 1e4 * self.n_features:
                p *= 1e4 * self.n_features / trace

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values."""
        return {
            "n_features": self.n_features,
            "forgetting": self.forgetting,
            "ridge": self.ridge,
            "clip": self.clip,
            "prior_rows": self.prior_rows,
            "weights": self.weights.tolist(),
            "p": self._p.tolist(),
            "mean_abs_error": self._mean_abs_error,
            "n_seen": self.n_seen,
            "since_maintenance": self._since_maintenance,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecursiveLeastSquares:
        """A learner from `to_dict`'s output; ValueError if its shapes disagree."""
        rls = cls(
            int(d["n_features"]),
            float(d["forgetting"]),
            float(d["ridge"]),
            float(d["clip"]),
            float(d.get("prior_rows", 0.0)),
        )
        rls.weights = np.asarray(d["weights"], dtype=np.float64)
        rls._p = np.asarray(d["p"], dtype=np.float64)
        if rls.weights.shape != (rls.n_features,) or rls._p.shape != (rls.n_features, rls.n_features):
            raise ValueError("RLS state has the wrong shape")
        if not (np.isfinite(rls.weights).all() and np.isfinite(rls._p).all()):
            raise ValueError("RLS state holds a number that is not finite")  # it would predict NaN for ever
        rls._mean_abs_error = float(d["mean_abs_error"])
        rls.n_seen = int(d["n_seen"])
        # Saved so that a loaded learner tidies P at the rows its original would have; those written before: 0.
        rls._since_maintenance = int(d.get("since_maintenance", 0))
        return rls


MAX_OFFSET_KEYS = 4096
"""Keys an `OffsetTable` keeps, the least recently learned forgotten first: more endpoints than one fleet routes
among, and a bound on what observations naming ever new endpoint ids can make the model hold (50,000 such ids made
a 91 MB model, re-encoded at every snapshot)."""


class OffsetTable:
    """Per-key exponentially weighted mean residual, shrunk towards zero unless it stands out of the noise.

    A real shift (an endpoint throttled to half speed) is served in full after a few tens of observations,
    while a key whose residuals are only noise gets an offset near zero instead of chasing the last few values.

    Parameters
    ----------
    rate
        Weight of the newest residual once warmed up; 0.1 follows a change within a few tens of observations.
    prior_count
        Pseudo-observations of residual 0 a new key starts with.
    max_keys
        Keys kept; learning a new one beyond them forgets the one learned least recently (it starts again at 0,
        as a new endpoint does).

    Examples
    --------
    One endpoint 2x slow (log residual 0.69) among others that are only noisy:

    >>> import random
    >>> table, rng = OffsetTable(), random.Random(0)
    >>> for _ in range(60):
    ...     table.learn_one("slow", 0.69 + rng.gauss(0, 0.1))
    ...     table.learn_one("noisy", rng.gauss(0, 0.1))
    >>> round(table.get("slow"), 1), abs(table.get("noisy")) < 0.05, table.get("never seen")
    (0.7, True, 0.0)
    """

    def __init__(self, rate: float = 0.1, prior_count: float = 5.0, max_keys: int = MAX_OFFSET_KEYS) -> None:
        self.rate = rate
        self.prior_count = prior_count
        self.max_keys = max_keys
        self._offsets: dict[str, float] = {}
        self._means: dict[str, float] = {}
        self._squares: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def get(self, key: str) -> float:
        """The offset of `key` (0 for a key never seen)."""
        return self._offsets.get(key, 0.0)

    def get_many(self, keys: list[str] | str) -> np.ndarray | float:
        """Offsets of `keys`; a single float when every key is the same (the usual case: one class), which a
        caller that knows it says by passing that one key."""
        offsets = self._offsets
        if not offsets:
            return 0.0
        if isinstance(keys, str):
            return offsets.get(keys, 0.0)
        if keys and keys.count(keys[0]) == len(keys):
            return offsets.get(keys[0], 0.0)
        return np.array([offsets.get(k, 0.0) for k in keys])

    def learn_one(self, key: str, residual: float) -> None:
        """Update `key`'s offset with one residual (an empty key is ignored)."""
        if not key:
            return
        counts = self._counts
        n = counts.pop(key, 0) + 1
        counts[key] = n  # last in order: the least recently learned key is first
        if len(counts) > self.max_keys:
            self._forget(next(iter(counts)))
        weight = max(1.0 / (n + self.prior_count), self.rate)
        mean = self._means.get(key, 0.0)
        mean += weight * (residual - mean)
        square = self._squares.get(key, residual * residual)
        square += weight * (residual * residual - square)
        self._means[key], self._squares[key] = mean, square
        # Shrink by the mean's signal-to-noise ratio: mean² / (mean² + its squared standard error).
        effective_count = min(n + self.prior_count, 2.0 / self.rate - 1.0)
        standard_error_sq = max(square - mean * mean, 1e-8) / effective_count
        self._offsets[key] = mean * mean * mean / (mean * mean + standard_error_sq)

    def _forget(self, key: str) -> None:
        for values in (self._offsets, self._means, self._squares, self._counts):
            values.pop(key, None)

    def __len__(self) -> int:
        return len(self._offsets)

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values."""
        return {
            "rate": self.rate,
            "prior_count": self.prior_count,
            "max_keys": self.max_keys,
            "offsets": self._offsets,
            "means": self._means,
            "squares": self._squares,
            "counts": self._counts,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OffsetTable:
        """A table from `to_dict`'s output."""
        table = cls(float(d["rate"]), float(d["prior_count"]), int(d.get("max_keys", MAX_OFFSET_KEYS)))
        table._offsets = {str(k): float(v) for k, v in d["offsets"].items()}
        table._means = {str(k): float(v) for k, v in d["means"].items()}
        table._squares = {str(k): float(v) for k, v in d["squares"].items()}
        table._counts = {str(k): int(v) for k, v in d["counts"].items()}
        return table


_WARMUP = 50  # residuals before the empirical quantile stands on its own
RECENTRE_AFTER = 50  # recent residuals before a point prediction is recentred on their median
_COLD_WIDTH = float(np.log(2.0))  # upper quantile ≈ 2 × the point prediction before anything is known


_SHIFT_LOG = float(np.log(2.0))  # a change of level the current model leaves unexplained: a factor of 2
_SHIFT_MIN_ROWS = 200  # rows on each side of it, at least


def _since_level_shift(residuals: np.ndarray) -> int:
    """How many of the newest residuals (oldest first) to base a quantile on: those after the window's most
    likely single change of level (CUSUM split), when the current model's mean residual differs across it by
    more than a factor of 2 (older rows from a regime that has gone); otherwise all of them."""
    n = len(residuals)
    if n < 2 * _SHIFT_MIN_ROWS:
        return n
    c = np.cumsum(residuals)
    k = np.arange(_SHIFT_MIN_ROWS, n - _SHIFT_MIN_ROWS + 1)  # rows before the split
    gap = c[k - 1] / k - (c[-1] - c[k - 1]) / (n - k)
    best = int(np.argmax(np.abs(gap) * np.sqrt(k * (n - k))))
    return n - int(k[best]) if abs(gap[best]) > _SHIFT_LOG else n


class ConformalQuantile:
    """Upper-quantile offset on log residuals: recent empirical quantile + adaptive conformal correction.

    Parameters
    ----------
    quantile
        Target probability of actual ≤ prediction (0.9 for p90).
    window
        Recent residuals kept.
    step
        Adaptive-conformal learning rate (log units per observation).

    Examples
    --------
    Residuals of standard normal noise: the p90 offset settles near its 1.28.

    >>> import random
    >>> rng, cq = random.Random(1), ConformalQuantile(0.9)
    >>> for _ in range(2000):
    ...     r = rng.gauss(0, 1)
    ...     cq.observe(r, covered=r <= cq.offset)
    >>> 1.0 < cq.offset < 1.6
    True
    """

    def __init__(self, quantile: float = 0.9, window: int = 1000, step: float = 0.01) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        if window < 1:
            raise ValueError(f"window must be ≥ 1, got {window}")  # an empty window has no quantile to learn
        self.quantile = quantile
        self.window = window
        self.step = step
        self.residuals: deque[float] = deque(maxlen=window)
        self.adaptive = 0.0
        # While a quantile tree serves instead of the offset, the adaptive term the offset would have had: steered
        # by the offset's own coverage, so that a tree's forward record compares it with the offset as it would
        # have served (on the served term the offset overshoots once that term answers for the tree's misses).
        self.shadow = 0.0
        self.base: float | None = None
        self._cached = 0.0
        self.center = 0.0
        self._since_refresh = 0

    @property
    def offset(self) -> float:
        """Log-space distance from the point prediction to the served quantile (without a quantile tree).

        Before it has seen `_WARMUP` residuals, an empirical quantile means little: the offset is then at least
        a cold-start width (×2) fading out as residuals arrive, so a first p90 is not simply the mean.
        """
        return self._base() + self.adaptive

    @property
    def shadow_offset(self) -> float:
        """The offset as it would serve while a quantile tree serves instead (see `shadow`)."""
        return self._base() + self.shadow

    def _base(self) -> float:
        base = self._cached if self.base is None else self.base
        seen = len(self.residuals)
        if self.base is None and seen < _WARMUP:
            base = max(base, _COLD_WIDTH * (1.0 - seen / _WARMUP))
        return base

    def recalibrate(self, residuals: np.ndarray) -> None:
        """Split-conformal restart: base the quantile on the current model's residuals over a sample window.

        The recent out-of-sample residuals describe the *recent* error of *past* states of the model; after a
        retrain the current model's residuals over the whole window are the better base for rows like those
        in the window, and the adaptive term restarts from zero on top of it. Rows from before a change of level
        the model has since followed (latency ×0.1 for the same rows) are left out: they would say the model
        errs by that factor, and hold the quantile there until they leave the window (`_since_level_shift`).
        """
        if len(residuals):
            self.base = float(np.quantile(residuals[-_since_level_shift(residuals) :], self.quantile))
            self.adaptive = self.shadow = 0.0

    def serve_offset(self) -> None:
        """The quantile tree stops serving: the offset serves again, with the adaptive term it would have had."""
        self.adaptive, self.shadow = self.shadow, 0.0

    def observe(self, residual: float, covered: bool, shadow_covered: bool | None = None) -> None:
        """Record a before-learning residual and whether the served quantile covered the actual (and, while a
        quantile tree serves, whether the offset would have: `shadow_offset`)."""
        self.residuals.append(residual)
        self.adaptive += self.step * ((0.0 if covered else 1.0) - (1.0 - self.quantile))
        if shadow_covered is not None:
            self.shadow += self.step * ((0.0 if shadow_covered else 1.0) - (1.0 - self.quantile))
        self._since_refresh += 1
        if self._since_refresh >= 25 or len(self.residuals) < 50:
            recent = np.fromiter(self.residuals, float)
            self._cached = float(np.quantile(recent, self.quantile))
            # The median recent residual recentres the point prediction: for skewed noise, exp(E[log y]) is not
            # the median. (The point relative error rewards, the median weighted by e^-residual, lost under delayed
            # labels: residuals 200 rows old, while the load climbs, are wider than the error to come; README.)
            self.center = float(np.median(recent)) if len(recent) >= RECENTRE_AFTER else 0.0
            self._since_refresh = 0

    def to_dict(self) -> dict[str, Any]:
        """The state as JSON-ready values."""
        return {
            "quantile": self.quantile,
            "window": self.window,
            "step": self.step,
            "residuals": list(self.residuals),
            "adaptive": self.adaptive,
            "shadow": self.shadow,
            "base": self.base,
            "cached": self._cached,
            "center": self.center,
            "since_refresh": self._since_refresh,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConformalQuantile:
        """A calibration from `to_dict`'s output."""
        cq = cls(float(d["quantile"]), int(d["window"]), float(d["step"]))
        cq.residuals.extend(float(r) for r in d["residuals"])
        cq.adaptive = float(d["adaptive"])
        cq.shadow = float(d.get("shadow", 0.0))  # artifacts written before it was kept: none
        cq.base = None if d.get("base") is None else float(d["base"])
        cq._cached = float(d["cached"])
        cq.center = float(d["center"])
        cq._since_refresh = int(d["since_refresh"])
        return cq
