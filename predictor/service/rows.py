"""Validation and vectorization of JSON rows on the hot path, column-wise.

`features.vectorize.Vectorizer` builds one frozen dataclass per row, which costs ~40 µs a row: 4 ms for the
router's 100 candidates, more than the whole latency budget of a bulk call. This module checks the same rules
with tight per-field code (still naming `requests[i].field` on a bad value), then computes the hardware and
roofline columns for all rows at once with numpy, one hardware group at a time. `tests/test_service_rows.py`
checks that the matrix equals the Vectorizer's on random rows, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from features.catalog import get_accelerator, get_model
from features.errors import FeatureError
from features.roofline import decode_step_ms_array, prefill_ms_array
from features.rows import LLMD_REQUIRED_FIELDS, ROLES, TIMESLICE_STATES, check_count, check_real, parse_timestamp
from features.vectorize import COLUMNS, KV_MEMORY_SHARE

_POD_TYPES = {"": 0, "both": 0, "prefill": 1, "decode": 2}


@dataclass
class ParsedRows:
    """Rows ready for the predictor, plus the labels metrics need."""

    X: np.ndarray
    endpoint_ids: list[str] | None  # None when no row names an endpoint
    accelerators: list[str]  # resolved accelerator class per row

    @property
    def roles(self) -> list[str]:
        """both | prefill | decode per row (computed on demand: only live-error metrics need it)."""
        return ["prefill" if p else "decode" if d else "both" for p, d in self.X[:, 9:11].tolist()]


@dataclass
class ParsedObservations:
    rows: ParsedRows
    actual_ttft_ms: np.ndarray
    actual_tpot_ms: np.ndarray
    predicted_ttft_ms: np.ndarray  # NaN where the client sent none
    predicted_tpot_ms: np.ndarray
    predicted_ttft_quantile_ms: np.ndarray
    predicted_tpot_quantile_ms: np.ndarray


@dataclass(frozen=True)
class _Group:
    """Constants of one (accelerator, model, tensor parallel) combination."""

    tflops: float
    tb_s: float
    kv_bytes_per_token: float
    params_b: float
    layers: float
    attn_width: float
    weight_bytes: float
    kv_capacity_tokens: float


def _count(row: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = row.get(name, default)
    if type(value) is int and value >= 0:
        return value
    if value is None:
        raise FeatureError(name, "is required")
    return check_count(name, value)


def _real01(row: Mapping[str, Any], name: str) -> float:
    value = row.get(name)
    if (type(value) is float or type(value) is int) and 0.0 <= value <= 1.0:
        return float(value)
    if value is None:
        raise FeatureError(name, "is required")
    return check_real(name, value, 0.0, 1.0)


def _text(row: Mapping[str, Any], name: str) -> str:
    value = row.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FeatureError(name, f"must be a string, got {value!r}")
    return value


class RowParser:
    """Parses llm-d rows (and Leadtime's native rows) into the `COLUMNS` matrix.

    Parameters
    ----------
    default_accelerator, default_model
        Assumed for rows that name none (llm-d rows never do).
    """

    def __init__(self, default_accelerator: str, default_model: str) -> None:
        self.default_accelerator = get_accelerator(default_accelerator).slug
        self.default_model = get_model(default_model).slug
        self._groups: dict[tuple[str, str, int], tuple[int, _Group]] = {}
        self._group_list: list[_Group] = []
        self._table = np.empty((0, 8))
        self._default_group = self._group("", "", 1)

    def _group(self, accelerator: str, model: str, tensor_parallel: int) -> int:
        key = (accelerator or self.default_accelerator, model or self.default_model, tensor_parallel)
        found = self._groups.get(key)
        if found is not None:
            return found[0]
        acc, mod = get_accelerator(key[0]), get_model(key[1])
        free_bytes = max(acc.memory_gb * 1e9 * tensor_parallel - mod.weight_bytes, 1e9)
        group = _Group(
            tflops=acc.effective_tflops,
            tb_s=acc.effective_tb_s,
            kv_bytes_per_token=float(mod.kv_bytes_per_token),
            params_b=mod.params_b,
            layers=float(mod.layers),
            attn_width=float(mod.num_heads * mod.head_dim),
            weight_bytes=mod.weight_bytes,
            kv_capacity_tokens=free_bytes * KV_MEMORY_SHARE / mod.kv_bytes_per_token,
        )
        index = len(self._group_list)
        self._group_list.append(group)
        self._groups[key] = (index, group)
        self._table = np.array(
            [
                (
                    g.tflops,
                    g.tb_s,
                    g.kv_bytes_per_token,
                    g.params_b,
                    g.layers,
                    g.attn_width,
                    g.weight_bytes,
                    g.kv_capacity_tokens,
                )
                for g in self._group_list
            ]
        )
        return index

    def _fast_row(self, row: Any) -> tuple[float, ...] | None:
        """The common llm-d row (no Leadtime extras, plain valid values) in one pass; None: check slowly."""
        if type(row) is not dict or not _EXTRAS.isdisjoint(row):
            return None
        g = row.get
        kv = g("kv_cache_percentage")
        score = g("prefix_cache_score")
        n_in = g("input_token_length")
        waiting = g("num_request_waiting")
        running = g("num_request_running")
        generated = g("num_tokens_generated")
        prefill = g("prefill_tokens_in_flight", 0)
        decode = g("decode_tokens_in_flight", 0)
        matched = g("encoder_matched_size", 0)
        enc_in = g("encoder_input_size", 0)
        pod_type = g("pod_type", "")
        pod = _POD_TYPES.get(pod_type) if type(pod_type) is str else None
        if (
            (type(kv) is float or type(kv) is int)
            and 0 <= kv <= 1
            and (type(score) is float or type(score) is int)
            and 0 <= score <= 1
            and type(n_in) is int
            and n_in >= 0
            and type(waiting) is int
            and waiting >= 0
            and type(running) is int
            and running >= 0
            and type(generated) is int
            and generated >= 0
            and type(prefill) is int
            and prefill >= 0
            and type(decode) is int
            and decode >= 0
            and type(matched) is int
            and matched >= 0
            and type(enc_in) is int
            and enc_in >= 0
            and pod is not None
        ):
            return (
                n_in,
                score,
                generated,
                waiting,
                running,
                kv,
                prefill,
                decode,
                pod,
                1,
                1.0,
                0.0,
                enc_in,
                matched,
                self._default_group,
            )
        return None

    def _raw_row(self, row: Any, native: bool) -> tuple[tuple[float, ...], str, str]:
        """One row → (raw values, endpoint id, accelerator slug); raises FeatureError naming the field."""
        if not isinstance(row, Mapping):
            raise FeatureError("row", f"must be a JSON object, got {type(row).__name__}")
        for name in LLMD_REQUIRED_FIELDS:
            if row.get(name) is None:
                raise FeatureError(name, "is required")
        kv = _real01(row, "kv_cache_percentage")
        input_tokens = _count(row, "input_token_length")
        waiting = _count(row, "num_request_waiting")
        running = _count(row, "num_request_running")
        generated = _count(row, "num_tokens_generated")
        score = _real01(row, "prefix_cache_score")
        prefill_in_flight = _count(row, "prefill_tokens_in_flight", 0)
        decode_in_flight = _count(row, "decode_tokens_in_flight", 0)
        encoder_matched = _count(row, "encoder_matched_size", 0)
        encoder_input = _count(row, "encoder_input_size", 0)
        hits_raw = row.get("prefix_hit_tokens")
        if hits_raw is not None:
            hits = check_count("prefix_hit_tokens", hits_raw)
            if hits > input_tokens:
                raise FeatureError("prefix_hit_tokens", f"{hits} exceeds input_token_length {input_tokens}")
            score = hits / input_tokens if input_tokens else 0.0
        role = _pod_type_index(row, native)
        endpoint_id = _text(row, "endpoint_id")
        accelerator = _text(row, "accelerator")
        model = _text(row, "model")
        tp = _count(row, "tensor_parallel", 1)
        if tp < 1:
            raise FeatureError("tensor_parallel", "must be ≥ 1")
        timeslice = row.get("timeslice_state", "none")
        if timeslice not in TIMESLICE_STATES:
            choices = ", ".join(repr(c) for c in TIMESLICE_STATES)
            raise FeatureError("timeslice_state", f"must be one of {choices}, got {timeslice!r}")
        wait = row.get("timeslice_wait_ms", 0.0)
        if not ((type(wait) is float or type(wait) is int) and 0.0 <= wait < math.inf):
            wait = check_real("timeslice_wait_ms", wait)
        group = self._group(accelerator, model, tp)
        values = (
            float(input_tokens),
            score,
            float(generated),
            float(waiting),
            float(running),
            kv,
            float(prefill_in_flight),
            float(decode_in_flight),
            float(role),
            float(tp),
            0.0 if timeslice in ("switching", "parked") else 1.0,
            float(wait),
            float(encoder_input),
            float(encoder_matched),
            float(group),
        )
        return values, endpoint_id, accelerator or self.default_accelerator

    def parse(self, rows: Sequence[Any], where: str = "requests", native: bool = False) -> ParsedRows:
        """Validate and vectorize; a bad row raises FeatureError with field `where[i].name`."""
        raw: list[tuple[float, ...]] = []
        endpoint_ids: list[str] = []
        accelerators: list[str] = []
        fast = self._fast_row
        default_accelerator = self.default_accelerator
        for i, row in enumerate(rows):
            values_or_none = fast(row)
            if values_or_none is not None:
                raw.append(values_or_none)
                endpoint_ids.append("")
                accelerators.append(default_accelerator)
                continue
            try:
                values, endpoint_id, accelerator = self._raw_row(row, native)
            except FeatureError as err:
                raise FeatureError(f"{where}[{i}].{err.field}", err.problem) from None
            raw.append(values)
            endpoint_ids.append(endpoint_id)
            accelerators.append(accelerator)
        return self._finish(raw, endpoint_ids, accelerators)

    def parse_messages(self, messages: Sequence[Any], to_dict: Any, where: str = "rows") -> ParsedRows:
        """gRPC `leadtime.v1.Row` messages: plain ones straight to values, the rest through `to_dict(message)`.

        Protobuf already guarantees the integer fields are non-negative integers, so a plain row only needs its
        two fractions checked.
        """
        raw: list[tuple[float, ...]] = []
        endpoint_ids: list[str] = []
        accelerators: list[str] = []
        group = self._default_group
        for i, m in enumerate(messages):
            kv, score, pod = m.kv_cache_percentage, m.prefix_cache_score, _POD_TYPES.get(m.pod_type)
            if (
                0.0 <= kv <= 1.0
                and 0.0 <= score <= 1.0
                and pod is not None
                and not (m.endpoint_id or m.accelerator or m.model or m.timeslice_wait_ms)
                and m.tensor_parallel <= 1
                and m.timeslice_state in ("", "none")
                and not m.HasField("prefix_hit_tokens")
            ):
                raw.append(
                    (m.input_token_length, score, m.num_tokens_generated, m.num_request_waiting,
                     m.num_request_running, kv, m.prefill_tokens_in_flight, m.decode_tokens_in_flight, pod, 1,
                     1.0, 0.0, m.encoder_input_size, m.encoder_matched_size, group)
                )  # fmt: skip
                endpoint_ids.append("")
                accelerators.append(self.default_accelerator)
                continue
            try:
                values, endpoint_id, accelerator = self._raw_row(to_dict(m), native=True)
            except FeatureError as err:
                raise FeatureError(f"{where}[{i}].{err.field}", err.problem) from None
            raw.append(values)
            endpoint_ids.append(endpoint_id)
            accelerators.append(accelerator)
        return self._finish(raw, endpoint_ids, accelerators)

    def parse_one(self, row: Any, native: bool = False) -> ParsedRows:
        values, endpoint_id, accelerator = self._raw_row(row, native)
        return self._finish([values], [endpoint_id], [accelerator])

    def parse_observations(self, entries: Sequence[Any], where: str = "entries") -> ParsedObservations:
        """Training entries: a row plus `actual_ttft_ms`, `actual_tpot_ms` (0 = not observed)."""
        n = len(entries)
        actuals: list[tuple[float, float]] = []
        predicted = np.full((n, 4), np.nan)
        for i, entry in enumerate(entries):
            if type(entry) is dict:
                ttft, tpot = entry.get("actual_ttft_ms"), entry.get("actual_tpot_ms")
                if (
                    (type(ttft) is float or type(ttft) is int)
                    and 0 <= ttft < math.inf
                    and (type(tpot) is float or type(tpot) is int)
                    and 0 <= tpot < math.inf
                    and _OBSERVATION_EXTRAS.isdisjoint(entry)
                ):
                    actuals.append((ttft, tpot))
                    continue
            try:
                actuals.append(self._checked_actuals(entry, predicted[i]))
            except FeatureError as err:
                raise FeatureError(f"{where}[{i}].{err.field}", err.problem) from None
        rows = self.parse(entries, where=where, native=True)
        actual = np.array(actuals, dtype=np.float64).reshape(n, 2)
        return ParsedObservations(rows, actual[:, 0], actual[:, 1], *(predicted[:, j] for j in range(4)))

    @staticmethod
    def _checked_actuals(entry: Any, predicted: np.ndarray) -> tuple[float, float]:
        """Actuals of one entry checked field by field; fills `predicted` with what the client had predicted."""
        if not isinstance(entry, Mapping):
            raise FeatureError("entry", f"must be a JSON object, got {type(entry).__name__}")
        values = []
        for name in ("actual_ttft_ms", "actual_tpot_ms"):
            value = entry.get(name)
            if value is None:
                raise FeatureError(name, "is required")
            values.append(check_real(name, value))
        for j, name in enumerate(_PREDICTED):
            value = entry.get(name)
            if value is not None:
                predicted[j] = check_real(name, value)
        timestamp = entry.get("timestamp")
        if timestamp is not None:
            parse_timestamp(timestamp)
        return values[0], values[1]

    def _finish(self, raw: list[tuple[float, ...]], endpoint_ids: list[str], accelerators: list[str]) -> ParsedRows:
        """Raw values → the COLUMNS matrix, with as few numpy calls as possible (each costs microseconds)."""
        n = len(raw)
        x = np.empty((n, len(COLUMNS)))
        if n == 0:
            return ParsedRows(x, None, [])
        width = len(raw[0])
        # fromiter over the flattened values is ~25% faster than np.array on a list of mixed int/float tuples.
        r = np.fromiter(itertools.chain.from_iterable(raw), dtype=np.float64, count=n * width).reshape(n, width)
        x[:, _DIRECT_COLUMNS] = r[:, _DIRECT_RAW]
        input_tokens = r[:, 0]
        hits = np.round(r[:, 1] * input_tokens)
        uncached = input_tokens - hits
        x[:, 1] = hits
        x[:, 2] = uncached
        x[:, 9] = r[:, 8] == 1.0
        x[:, 10] = r[:, 8] == 2.0
        tp = r[:, 9]
        groups = r[:, 14]
        if groups.min() == groups.max():  # one hardware group (always, for llm-d rows): scalar constants
            constants: Any = self._table[int(groups[0])]
        else:
            constants = self._table[groups.astype(np.intp)].T
        tflops, tb_s, kvb, params_b, layers, attn_width, weight_bytes, capacity = constants
        x[:, 11] = tflops
        x[:, 12] = tb_s
        x[:, 14] = kvb
        # The request's own prefill and the prefill queued ahead of it, in one pass over a (2, n) stack.
        new_tokens = np.stack((uncached, r[:, 6]))
        cached_tokens = np.zeros_like(new_tokens)
        cached_tokens[0] = hits
        model_figures = (params_b, layers, attn_width, weight_bytes, tflops, tb_s)
        prefill = prefill_ms_array(*model_figures, new_tokens, cached_tokens, tp)
        x[:, 15:17] = prefill.T
        x[:, 17] = decode_step_ms_array(params_b, weight_bytes, kvb, tflops, tb_s, r[:, 4] + 1, r[:, 5] * capacity, tp)
        x[:, 18] = decode_step_ms_array(params_b, weight_bytes, kvb, tflops, tb_s, 1.0, 0.0, tp)
        ids = endpoint_ids if any(endpoint_ids) else None
        return ParsedRows(x, ids, accelerators)


# Raw values copied unchanged into the matrix: raw index → column index.
_DIRECT_RAW = [0, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13]
_DIRECT_COLUMNS = [0, 3, 4, 5, 6, 7, 8, 13, 19, 20, 21, 22]

# Keys that only Leadtime's rows carry: their presence sends a row down the careful path.
_EXTRAS = frozenset(
    (
        "prefix_hit_tokens",
        "endpoint_id",
        "accelerator",
        "model",
        "tensor_parallel",
        "timeslice_state",
        "timeslice_wait_ms",
        "role",
    )
)
_OBSERVATION_EXTRAS = frozenset(
    (
        "predicted_ttft_ms",
        "predicted_tpot_ms",
        "predicted_ttft_quantile_ms",
        "predicted_tpot_quantile_ms",
        "timestamp",
    )
)
_PREDICTED = (
    "predicted_ttft_ms",
    "predicted_tpot_ms",
    "predicted_ttft_quantile_ms",
    "predicted_tpot_quantile_ms",
)


def _pod_type_index(row: Mapping[str, Any], native: bool) -> int:
    pod_type = row.get("pod_type")
    if native and pod_type is None and row.get("role") is not None:
        role = row["role"]
        if role not in ROLES:
            raise FeatureError("role", f"must be one of {', '.join(repr(r) for r in ROLES)}, got {role!r}")
        return _POD_TYPES[role]
    if pod_type is None:
        return 0
    index = _POD_TYPES.get(pod_type) if isinstance(pod_type, str) else None
    if index is None:
        raise FeatureError("pod_type", f"must be '', 'prefill' or 'decode', got {pod_type!r}")
    return index


