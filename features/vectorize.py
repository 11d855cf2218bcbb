"""Feature rows → a float matrix in one fixed, versioned column order.

Every model Leadtime saves records `SCHEMA_VERSION` and `COLUMNS`; a model trained on another order is refused
on load rather than silently fed the wrong columns. Hardware-derived columns (effective FLOP/s and bandwidth,
roofline prefill and decode times) are computed here, so the predictor sees a never-seen accelerator class
through the same physics as the ones it knows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from leadtime.features.catalog import Accelerator, ModelProfile, get_accelerator, get_model
from leadtime.features.errors import FeatureError
from leadtime.features.roofline import decode_step_ms, prefill_ms
from leadtime.features.rows import FeatureRow, feature_row_from_llmd

SCHEMA_VERSION = 1

COLUMNS: tuple[str, ...] = (
    "input_tokens",
    "prefix_hit_tokens",
    "uncached_tokens",
    "num_tokens_generated",
    "num_request_waiting",
    "num_request_running",
    "kv_cache_percentage",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
    "role_prefill",
    "role_decode",
    "accel_tflops",
    "accel_tb_s",
    "tensor_parallel",
    "kv_bytes_per_token",
    "roofline_own_prefill_ms",
    "roofline_queue_prefill_ms",
    "roofline_decode_step_ms",
    "roofline_weights_ms",
    "timeslice_resident",
    "timeslice_wait_ms",
    "encoder_input_size",
    "encoder_matched_size",
)
COLUMN_INDEX: dict[str, int] = {name: i for i, name in enumerate(COLUMNS)}

# Upper bounds on raw columns: values beyond them are input errors, not load (1 = 100% for fractions).
_BOUNDS: dict[str, tuple[float, float]] = {name: (0.0, math.inf) for name in COLUMNS}
_BOUNDS["kv_cache_percentage"] = (0.0, 1.0)
_BOUNDS["role_prefill"] = (0.0, 1.0)
_BOUNDS["role_decode"] = (0.0, 1.0)
_BOUNDS["timeslice_resident"] = (0.0, 1.0)
_BOUNDS["tensor_parallel"] = (1.0, math.inf)
_LOW = np.array([_BOUNDS[c][0] for c in COLUMNS])
_HIGH = np.array([_BOUNDS[c][1] for c in COLUMNS])

# Share of the memory left after weights that vLLM gives to the KV cache (gpu_memory_utilization 0.9).
KV_MEMORY_SHARE = 0.9


@dataclass(frozen=True)
class _Hardware:
    accelerator: Accelerator
    model: ModelProfile
    tensor_parallel: int
    kv_capacity_tokens: float


class Vectorizer:
    """Turns FeatureRows (or llm-d dict rows) into the `COLUMNS` matrix.

    Parameters
    ----------
    default_accelerator
        Class assumed for rows that do not name one (llm-d rows never do).
    default_model
        Model assumed for rows that do not name one.
    """

    def __init__(self, default_accelerator: str = "h100-sxm", default_model: str = "llama-3.1-8b") -> None:
        self.default_accelerator = get_accelerator(default_accelerator).slug
        self.default_model = get_model(default_model).slug
        self._hardware: dict[tuple[str, str, int], _Hardware] = {}

    def _hw(self, accelerator: str, model: str, tensor_parallel: int) -> _Hardware:
        key = (accelerator or self.default_accelerator, model or self.default_model, tensor_parallel)
        hw = self._hardware.get(key)
        if hw is None:
            acc, mod = get_accelerator(key[0]), get_model(key[1])
            free_bytes = max(acc.memory_gb * 1e9 * tensor_parallel - mod.weight_bytes, 1e9)
            capacity = free_bytes * KV_MEMORY_SHARE / mod.kv_bytes_per_token
            hw = _Hardware(acc, mod, tensor_parallel, capacity)
            self._hardware[key] = hw
        return hw

    def row_vector(self, row: FeatureRow) -> list[float]:
        r, e = row.request, row.endpoint
        hw = self._hw(e.accelerator, e.model, e.tensor_parallel)
        hits = r.prefix_hit_tokens
        uncached = r.input_tokens - hits
        tp = hw.tensor_parallel
        kv_tokens = e.kv_cache_percentage * hw.kv_capacity_tokens
        return [
            float(r.input_tokens),
            float(hits),
            float(uncached),
            float(r.num_tokens_generated),
            float(e.num_request_waiting),
            float(e.num_request_running),
            e.kv_cache_percentage,
            float(e.prefill_tokens_in_flight),
            float(e.decode_tokens_in_flight),
            1.0 if e.role == "prefill" else 0.0,
            1.0 if e.role == "decode" else 0.0,
            hw.accelerator.effective_tflops,
            hw.accelerator.effective_tb_s,
            float(tp),
            float(hw.model.kv_bytes_per_token),
            prefill_ms(hw.model, hw.accelerator, uncached, hits, tp),
            prefill_ms(hw.model, hw.accelerator, e.prefill_tokens_in_flight, 0.0, tp),
            decode_step_ms(hw.model, hw.accelerator, e.num_request_running + 1, kv_tokens, tp),
            decode_step_ms(hw.model, hw.accelerator, 1, 0.0, tp),
            0.0 if e.timeslice_state in ("switching", "parked") else 1.0,
            e.timeslice_wait_ms,
            float(r.encoder_input_size),
            float(r.encoder_matched_size),
        ]

    def transform(self, rows: Sequence[FeatureRow]) -> np.ndarray:
        """Rows → matrix; an unknown accelerator or model raises a FeatureError naming the row index."""
        out = np.empty((len(rows), len(COLUMNS)), dtype=np.float64)
        for i, row in enumerate(rows):
            try:
                out[i] = self.row_vector(row)
            except FeatureError as err:
                raise FeatureError(f"rows[{i}].{err.field}", err.problem) from None
        return out

    def transform_llmd(self, rows: Iterable[Mapping[str, Any]]) -> np.ndarray:
        """llm-d dict rows → matrix; a bad row raises FeatureError naming the row index and field."""
        parsed = []
        for i, raw in enumerate(rows):
            try:
                parsed.append(feature_row_from_llmd(raw))
            except FeatureError as err:
                raise FeatureError(f"rows[{i}].{err.field}", err.problem) from None
        return self.transform(parsed)


def check_matrix(x: np.ndarray) -> np.ndarray:
    """Refuse a matrix with the wrong width, NaN, infinities or out-of-range values, naming the column."""
    try:
        x = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise FeatureError("matrix", "must hold numbers only") from None
    if x.ndim != 2 or x.shape[1] != len(COLUMNS):
        raise FeatureError("matrix", f"must have shape (n, {len(COLUMNS)}), got {x.shape}")
    if x.size == 0:
        return x
    bad_finite = ~np.isfinite(x)
    if bad_finite.any():
        row, col = np.argwhere(bad_finite)[0]
        raise FeatureError(COLUMNS[col], f"row {row} is {x[row, col]!r}; NaN and infinities are refused")
    bad_range = (x < _LOW) | (x > _HIGH)
    if bad_range.any():
        row, col = np.argwhere(bad_range)[0]
        low, high = _BOUNDS[COLUMNS[col]]
        raise FeatureError(COLUMNS[col], f"row {row} is {x[row, col]:g}, outside [{low:g}, {high:g}]")
    return x
