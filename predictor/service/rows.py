"""Validation and vectorization of JSON rows on the hot path, column-wise.

`leadtime.features.vectorize.Vectorizer` builds one frozen dataclass per row, which costs ~40 µs a row: 4 ms for the
router's 100 candidates, more than the whole latency budget of a bulk call. This module checks the same rules a
batch at a time. Plain llm-d rows (dicts without Leadtime's extras, or plain gRPC Row messages) are read with one
C-level getter per row, converted by `struct` (whose formats also refuse floats, negatives and non-numbers in
the counts), type-checked once for bools and range-checked with numpy reductions. If any check fails, the batch
is parsed again row by row, so a bad value is still named `requests[i].field` with exactly the message the
per-row checks give. The hardware and roofline columns are then computed for all rows at once, one hardware
group at a time. `tests/test_service_rows.py` checks that the matrix equals the Vectorizer's on random rows, and
that the column-wise and row-by-row paths agree bit for bit, so none of them can drift apart unnoticed.
"""

from __future__ import annotations

import itertools
import math
import operator
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import chain, repeat
from typing import Any

import numpy as np

from leadtime.features.catalog import get_accelerator, get_model
from leadtime.features.errors import FeatureError
from leadtime.features.roofline import decode_step_ms_array, prefill_ms_array
from leadtime.features.rows import (
    LLMD_REQUIRED_FIELDS,
    MAX_COUNT,
    ROLES,
    TIMESLICE_STATES,
    check_count,
    check_real,
    parse_timestamp,
)
from leadtime.features.vectorize import COLUMNS, KV_MEMORY_SHARE

_POD_TYPES = {"": 0, "both": 0, "prefill": 1, "decode": 2}

# The fields of a plain llm-d row. Its numbers are packed as these counts then these fractions, one struct
# record per row; `_finish` maps them to `COLUMNS`.
_COUNT_FIELDS = (
    "input_token_length",
    "num_tokens_generated",
    "num_request_waiting",
    "num_request_running",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
    "encoder_input_size",
    "encoder_matched_size",
)
_FRACTION_FIELDS = ("kv_cache_percentage", "prefix_cache_score")
NUMBER_FIELDS = _COUNT_FIELDS + _FRACTION_FIELDS
_OPTIONAL_DEFAULTS = {
    "prefill_tokens_in_flight": 0,
    "decode_tokens_in_flight": 0,
    "encoder_input_size": 0,
    "encoder_matched_size": 0,
    "pod_type": "",
}
_PLAIN_WIDTH = len(NUMBER_FIELDS) + 1  # + pod_type
_GET_NUMBERS = operator.itemgetter(*NUMBER_FIELDS)
_GET_POD = operator.itemgetter("pod_type")
_ATTR_NUMBERS = operator.attrgetter(*NUMBER_FIELDS)
_ATTR_POD = operator.attrgetter("pod_type")
_ATTR_MESSAGE_EXTRAS = operator.attrgetter(
    "endpoint_id", "accelerator", "model", "timeslice_wait_ms", "tensor_parallel", "timeslice_state"
)
_HAS_PREFIX_HITS = operator.methodcaller("HasField", "prefix_hit_tokens")
_GET_ACTUALS = operator.itemgetter("actual_ttft_ms", "actual_tpot_ms")
_ACTUALS_RECORD = struct.Struct("<2d")
# One row's numbers as bytes. `struct` converts a whole batch in C at a fraction of np.fromiter's cost, and its
# "Q" refuses what a count must not be (floats, negatives, strings, None, anything ≥ 2**64) while "d" refuses
# non-numbers in the fractions. It lets bools through (bool is an int): the one type check left is for those.
_RECORD = struct.Struct(f"<{len(_COUNT_FIELDS)}Q{len(_FRACTION_FIELDS)}d")
_RECORD_DTYPE = np.dtype([("counts", "<u8", (len(_COUNT_FIELDS),)), ("fractions", "<f8", (len(_FRACTION_FIELDS),))])
_NUMBER_TYPES = frozenset((int, float))
_POD_VALUE_TYPES = frozenset((str, type(None)))
_POD_CODES: dict[str | None, float] = {None: 0.0, "": 0.0, "both": 0.0, "prefill": 1.0, "decode": 2.0}
_POD_VALUES = frozenset(_POD_CODES)
_BOTH_ONLY = frozenset((None, "", "both"))
_PLAIN_TIMESLICE = frozenset(("", "none"))
_ROLE_CODES = np.array([[1.0], [2.0]])  # pod code of role_prefill, role_decode

# Where things go in the COLUMNS matrix.
_COUNT_COLUMNS = np.array([0, 3, 4, 5, 7, 8, 21, 22])  # `_COUNT_FIELDS`, in order
_FIGURE_COLUMNS = np.array([11, 12, 13, 14, 18])  # tflops, tb_s, tensor parallel, kv bytes/token, weights ms
_TABLE_FIGURE_COLUMNS = np.array([0, 1, 8, 2, 9])  # the same figures in `_group_figures` order

# Raw layout of the row-by-row path: the counts, the fractions, then these.
_POD, _RESIDENT, _WAIT, _GROUP = 10, 11, 12, 13


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

    @classmethod
    def concat(cls, parts: Sequence[ParsedObservations]) -> ParsedObservations:
        """Slices of one batch, checked one after the other, as one."""
        if len(parts) == 1:
            return parts[0]
        ids = [p.rows.endpoint_ids or [""] * len(p.rows.X) for p in parts]
        rows = ParsedRows(
            np.concatenate([p.rows.X for p in parts]),
            list(chain.from_iterable(ids)) if any(p.rows.endpoint_ids for p in parts) else None,
            list(chain.from_iterable(p.rows.accelerators for p in parts)),
        )
        columns = [np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls) if f.name != "rows"]
        return cls(rows, *columns)


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
    tensor_parallel: float
    weights_ms: float  # roofline_weights_ms: the same for every row of the group, so computed once


@dataclass
class _Columns:
    """A plain batch read with one getter per row, before its types and ranges are checked."""

    numbers: list[tuple[Any, ...]]  # per row, in `NUMBER_FIELDS` order
    pods: Sequence[Any]
    typed: bool  # protobuf already guarantees the types (unsigned ints, doubles, strings)


def _count(row: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = row.get(name, default)
    if type(value) is int and 0 <= value <= MAX_COUNT:
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


def _all_dicts(rows: Sequence[Any]) -> bool:
    return len(rows) > 0 and set(map(type, rows)) == {dict}


def _dict_columns(rows: Sequence[Any], keys_checked: bool = False) -> _Columns | None:
    """The plain llm-d fields of every row as columns; None when some row is not a dict or carries extras.

    `keys_checked`: the caller has already seen that every row is a dict without `_EXTRAS` keys. Otherwise
    rows holding exactly the eleven llm-d keys (what llm-d sends) need no look at their keys at all: all eleven
    found and nothing else. Missing optional fields, or unknown keys, cost one union of all keys.
    """
    exact = False
    if not keys_checked:
        if not _all_dicts(rows) or not _EXTRAS.isdisjoint(rows[0]):  # a Leadtime batch usually shows at once
            return None
        exact = set(map(len, rows)) == {_PLAIN_WIDTH}
    try:
        columns = _Columns(list(map(_GET_NUMBERS, rows)), list(map(_GET_POD, rows)), typed=False)
    except KeyError:  # some row leaves out an optional field
        columns, exact = None, False
    if not (keys_checked or exact) and not _EXTRAS.isdisjoint(set().union(*rows)):
        return None
    if columns is not None:
        return columns

    def column(name: str) -> list[Any]:
        return list(map(dict.get, rows, repeat(name), repeat(_OPTIONAL_DEFAULTS.get(name))))

    return _Columns(list(zip(*map(column, NUMBER_FIELDS), strict=True)), column("pod_type"), typed=False)


def _message_columns(messages: Sequence[Any]) -> _Columns | None:
    """The fields of plain gRPC Row messages as columns; None when some message sets a Leadtime extra."""
    if not messages:
        return None
    endpoint, accelerator, model, wait, tp, timeslice = zip(*map(_ATTR_MESSAGE_EXTRAS, messages), strict=True)
    if (
        any(endpoint)
        or any(accelerator)
        or any(model)
        or any(wait)  # 0.0 and -0.0 are the plain "no wait"; NaN is truthy and goes row by row
        or max(tp) > 1
        or not _PLAIN_TIMESLICE.issuperset(timeslice)
        or any(map(_HAS_PREFIX_HITS, messages))
    ):
        return None
    return _Columns(list(map(_ATTR_NUMBERS, messages)), list(map(_ATTR_POD, messages)), typed=True)


def _pod_codes(pods: Sequence[Any], typed: bool) -> np.ndarray | float | None:
    """Role code per row (0.0 for every row when all are "both"); None when some pod_type is not plain."""
    if not (typed or _POD_VALUE_TYPES.issuperset(map(type, pods))):
        return None
    kinds = set(pods)
    if kinds <= _BOTH_ONLY:
        return 0.0
    if not kinds <= _POD_VALUES:
        return None
    return np.fromiter(map(_POD_CODES.__getitem__, pods), dtype=np.float64, count=len(pods))


def _column_actuals(
    entries: Sequence[Any], keys: set[str], predicted: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """actual_ttft_ms and actual_tpot_ms as columns, with what was predicted and the timestamps checked too.

    Fills `predicted` (n, 4) from the predicted_* columns. None when any value needs the per-entry checks,
    which then name the first bad one.
    """
    n = len(entries)
    try:
        pairs = list(map(_GET_ACTUALS, entries))
    except KeyError:
        return None
    if not _NUMBER_TYPES.issuperset(map(type, chain.from_iterable(pairs))):
        return None
    try:
        records = b"".join(itertools.starmap(_ACTUALS_RECORD.pack, pairs))
        actual = np.frombuffer(records, dtype="<f8").reshape(n, 2)
    except struct.error:  # an integer beyond float64
        return None
    if not (actual.min() >= 0.0 and actual.max() < math.inf):  # NaN fails both comparisons
        return None
    given: dict[int, np.ndarray] = {}
    for j, name in enumerate(_PREDICTED):
        if name in keys:
            column = list(map(dict.get, entries, repeat(name)))
            values = [v for v in column if v is not None]
            if not _NUMBER_TYPES.issuperset(map(type, values)):
                return None
            try:
                checked = np.array(values, dtype=np.float64)
                given[j] = np.array(column, dtype=np.float64)  # None → NaN, "not sent"
            except OverflowError:
                return None
            if not (checked.min(initial=0.0) >= 0.0 and checked.max(initial=0.0) < math.inf):
                return None
    if "timestamp" in keys:
        try:
            for stamp in map(dict.get, entries, repeat("timestamp")):
                if stamp is not None:
                    parse_timestamp(stamp)
        except (FeatureError, ArithmeticError, ValueError, TypeError):
            return None
    for j, values_or_nan in given.items():
        predicted[:, j] = values_or_nan
    return actual[:, 0], actual[:, 1]


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
        self._groups: dict[tuple[str, str, int], int] = {}
        self._group_list: list[_Group] = []
        self._table = np.empty((0, 10))
        self._templates: list[np.ndarray] = []  # per group: a (COLUMNS, 1) column of its constant columns
        self._lock = threading.Lock()
        self._default_group = self._group("", "", 1)

    def _group(self, accelerator: str, model: str, tensor_parallel: int) -> int:
        key = (accelerator or self.default_accelerator, model or self.default_model, tensor_parallel)
        found = self._groups.get(key)
        if found is not None:
            return found
        with self._lock:  # request threads share the parser: a group is published only once complete
            found = self._groups.get(key)
            return found if found is not None else self._add_group(key)

    def _add_group(self, key: tuple[str, str, int]) -> int:
        acc, mod = get_accelerator(key[0]), get_model(key[1])
        tensor_parallel = key[2]
        free_bytes = max(acc.memory_gb * 1e9 * tensor_parallel - mod.weight_bytes, 1e9)
        tflops, tb_s, tp = float(acc.effective_tflops), float(acc.effective_tb_s), float(tensor_parallel)
        params_b, weight_bytes, kvb = float(mod.params_b), float(mod.weight_bytes), float(mod.kv_bytes_per_token)
        group = _Group(
            tflops=tflops,
            tb_s=tb_s,
            kv_bytes_per_token=kvb,
            params_b=params_b,
            layers=float(mod.layers),
            attn_width=float(mod.num_heads * mod.head_dim),
            weight_bytes=weight_bytes,
            kv_capacity_tokens=float(free_bytes * KV_MEMORY_SHARE / mod.kv_bytes_per_token),
            tensor_parallel=tp,
            weights_ms=float(decode_step_ms_array(params_b, weight_bytes, kvb, tflops, tb_s, 1.0, 0.0, tp)),
        )
        index = len(self._group_list)
        template = np.zeros((len(COLUMNS), 1))
        template[_FIGURE_COLUMNS, 0] = np.array(_group_figures(group))[_TABLE_FIGURE_COLUMNS]
        template[19] = 1.0  # timeslice_resident; role_prefill, role_decode and timeslice_wait_ms stay 0
        self._group_list.append(group)
        self._templates.append(template)
        self._table = np.array([_group_figures(g) for g in self._group_list])
        self._groups[key] = index
        return index

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
            input_tokens,
            generated,
            waiting,
            running,
            prefill_in_flight,
            decode_in_flight,
            encoder_input,
            encoder_matched,
            kv,
            score,
            role,
            0.0 if timeslice in ("switching", "parked") else 1.0,
            wait,
            group,
        )
        return values, endpoint_id, accelerator or self.default_accelerator

    def parse(self, rows: Sequence[Any], where: str = "requests", native: bool = False) -> ParsedRows:
        """Validate and vectorize; a bad row raises FeatureError with field `where[i].name`."""
        columns = _dict_columns(rows)
        if columns is not None:
            parsed = self._parse_columns(columns)
            if parsed is not None:
                return parsed
        return self._parse_rows(rows, where, native)

    def _parse_rows(self, rows: Sequence[Any], where: str, native: bool, first: int = 0) -> ParsedRows:
        """Row by row: for batches with Leadtime's extras, and to name the first bad value of any batch."""
        raw: list[tuple[float, ...]] = []
        endpoint_ids: list[str] = []
        accelerators: list[str] = []
        for i, row in enumerate(rows):
            try:
                values, endpoint_id, accelerator = self._raw_row(row, native)
            except FeatureError as err:
                raise FeatureError(f"{where}[{first + i}].{err.field}", err.problem) from None
            raw.append(values)
            endpoint_ids.append(endpoint_id)
            accelerators.append(accelerator)
        return self._finish_raw(raw, endpoint_ids, accelerators)

    def _parse_columns(self, columns: _Columns) -> ParsedRows | None:
        """A plain batch checked and converted a column at a time; None when any value needs the row checks."""
        numbers = columns.numbers
        if not (columns.typed or _NUMBER_TYPES.issuperset(map(type, chain.from_iterable(numbers)))):
            return None  # a bool, or something struct would convert (numpy scalars, Decimal): row by row
        pods = _pod_codes(columns.pods, columns.typed)
        if pods is None:
            return None
        try:
            records = np.frombuffer(b"".join(itertools.starmap(_RECORD.pack, numbers)), dtype=_RECORD_DTYPE)
        except (struct.error, OverflowError):
            return None
        counts, fractions = records["counts"], records["fractions"]
        # Exact on the integers; NaN fails both fraction comparisons.
        if not (counts.max() <= MAX_COUNT and fractions.min() >= 0.0 and fractions.max() <= 1.0):
            return None
        accelerators = [self.default_accelerator] * len(numbers)
        return self._finish(counts, fractions, pods, None, self._default_group, None, accelerators)

    def parse_plain(self, numbers: list[tuple[Any, ...]], pods: Sequence[str | None]) -> ParsedRows | None:
        """Rows whose types are already known (`bulk_decode`): numbers in `NUMBER_FIELDS` order, pod_type each.

        None when a value is out of range, for the general path to name it.
        """
        return self._parse_columns(_Columns(numbers, pods, typed=True))

    def parse_messages(self, messages: Sequence[Any], to_dict: Any, where: str = "rows") -> ParsedRows:
        """gRPC `leadtime.v1.Row` messages: plain ones straight to values, the rest through `to_dict(message)`.

        Protobuf already guarantees the integer fields are non-negative integers, so a plain row only needs its
        two fractions checked (and its counts held to 2**53, as JSON rows are).
        """
        columns = _message_columns(messages)
        if columns is not None:
            parsed = self._parse_columns(columns)
            if parsed is not None:
                return parsed
        raw: list[tuple[float, ...]] = []
        endpoint_ids: list[str] = []
        accelerators: list[str] = []
        group = self._default_group
        for i, m in enumerate(messages):
            kv, score, pod = m.kv_cache_percentage, m.prefix_cache_score, _POD_TYPES.get(m.pod_type)
            counts = _ATTR_NUMBERS(m)[: len(_COUNT_FIELDS)]
            if (
                0.0 <= kv <= 1.0
                and 0.0 <= score <= 1.0
                and pod is not None
                and max(counts) <= MAX_COUNT
                and not (m.endpoint_id or m.accelerator or m.model or m.timeslice_wait_ms)
                and m.tensor_parallel <= 1
                and m.timeslice_state in ("", "none")
                and not m.HasField("prefix_hit_tokens")
            ):
                raw.append((*counts, kv, score, pod, 1.0, 0.0, group))
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
        return self._finish_raw(raw, endpoint_ids, accelerators)

    def parse_column_lists(self, columns: Mapping[str, Sequence[Any]], where: str = "columns") -> ParsedRows:
        """Rows given as one list per field (gRPC `RowColumns`), with the row fields' names; an empty or missing
        list means the field's default for every row. A bad value raises FeatureError naming `where[i].field`.
        """
        lengths = {name: len(values) for name, values in columns.items() if len(values)}
        n = max(lengths.values(), default=0)
        for name, length in lengths.items():
            if length != n:
                raise FeatureError(f"{where}.{name}", f"has {length:,} values for {n:,} rows")
        try:
            parsed = self._parse_column_arrays(columns, n)
        except (OverflowError, TypeError, ValueError):  # a value numpy cannot take as its column's type
            parsed = None
        if parsed is not None:
            return parsed
        return self._parse_rows(_column_rows(columns, n), where, native=True)

    def _parse_column_arrays(self, columns: Mapping[str, Sequence[Any]], n: int) -> ParsedRows | None:
        """The lists checked and converted a whole column at a time; None when a value needs the row checks."""

        def given(name: str) -> Sequence[Any]:
            return columns.get(name) or ()

        def typed(name: str, kinds: str) -> np.ndarray | None:
            """The list as an array if numpy reads it as one of `kinds` ("ui": integers, "uif": numbers). A plain
            list may hide bools among the integers, which numpy takes as 0 and 1 (a protobuf list cannot)."""
            values = given(name)
            if type(values) is list and bool in set(map(type, values)):
                return None
            array = np.asarray(values)
            return array if array.dtype.kind in kinds else None

        # Negative integers wrap around in these unsigned columns and so fail the range checks below.
        counts = np.zeros((n, len(_COUNT_FIELDS)), dtype=np.uint64)
        fractions = np.zeros((n, 2))
        for names, kinds, block in ((_COUNT_FIELDS, "ui", counts), (_FRACTION_FIELDS, "uif", fractions)):
            for j, name in enumerate(names):
                if given(name):
                    column = typed(name, kinds)
                    if column is None:
                        return None
                    block[:, j] = column
        if n == 0 or not (counts.max() <= MAX_COUNT and fractions.min() >= 0.0 and fractions.max() <= 1.0):
            return None
        if given("prefix_hit_tokens"):
            hits = typed("prefix_hit_tokens", "ui")
            tokens = counts[:, 0]
            if hits is None or not (hits.astype(np.uint64) <= tokens).all():
                return None
            fractions[:, 1] = np.divide(hits, tokens, out=np.zeros(n), where=tokens > 0)
        pods = _pod_codes(given("pod_type"), typed=True) if given("pod_type") else 0.0
        if pods is None:
            return None
        timeslice = None
        states, waits = given("timeslice_state"), given("timeslice_wait_ms")
        if states or waits:
            timeslice = np.zeros((n, 2))
            timeslice[:, 0] = 1.0
            if states:
                if not _COLUMN_TIMESLICE.issuperset(states):
                    return None
                timeslice[:, 0] = [0.0 if state in _NOT_RESIDENT else 1.0 for state in states]
            if waits:
                wait = typed("timeslice_wait_ms", "uif")
                if wait is None:
                    return None
                timeslice[:, 1] = wait
                if not (timeslice[:, 1].min() >= 0.0 and timeslice[:, 1].max() < math.inf):
                    return None
        group: int | np.ndarray = self._default_group
        accelerators = [self.default_accelerator] * n
        named, models, parallel = given("accelerator"), given("model"), given("tensor_parallel")
        if parallel:
            sizes = typed("tensor_parallel", "ui")
            if sizes is None or sizes.min() < 0 or sizes.max() > MAX_COUNT:
                return None
        if any(named) or any(models) or any(tp > 1 for tp in parallel):
            keys = list(zip(named or repeat(""), models or repeat(""), parallel or repeat(1), strict=False))
            try:
                groups = {key: self._group(key[0], key[1], max(key[2], 1)) for key in set(keys)}
            except FeatureError:
                return None
            per_row = np.array([groups[key] for key in keys], dtype=np.intp)
            group = int(per_row[0]) if per_row.min() == per_row.max() else per_row
            accelerators = [a or self.default_accelerator for a, _, _ in keys]
        ids = given("endpoint_id")
        if not _TEXT.issuperset(map(type, ids)):
            return None
        endpoint_ids = list(ids) if any(ids) else None
        return self._finish(counts, fractions, pods, timeslice, group, endpoint_ids, accelerators)

    def parse_one(self, row: Any, native: bool = False) -> ParsedRows:
        values, endpoint_id, accelerator = self._raw_row(row, native)
        return self._finish_raw([values], [endpoint_id], [accelerator])

    def parse_observations(self, entries: Sequence[Any], where: str = "entries", first: int = 0) -> ParsedObservations:
        """Training entries: a row plus `actual_ttft_ms`, `actual_tpot_ms` (0 = not observed). `first`: the index
        of `entries[0]` in the whole batch, for naming a bad one when a batch is checked a slice at a time.

        Batches are 512–1000 entries, so the keys of all entries are looked at once (one union) to pick the
        column-wise paths for the actuals and for the rows; either falls back to the per-entry checks.
        """
        n = len(entries)
        predicted = np.full((n, 4), np.nan)
        keys = set().union(*entries) if _all_dicts(entries) else None
        actuals = None if keys is None else _column_actuals(entries, keys, predicted)
        checked = None if actuals is not None else self._entry_actuals(entries, predicted, where, first)
        rows = None
        if keys is not None and _EXTRAS.isdisjoint(keys):
            columns = _dict_columns(entries, keys_checked=True)
            rows = None if columns is None else self._parse_columns(columns)
        if rows is None:
            rows = self._parse_rows(entries, where, native=True, first=first)
        if actuals is None:  # converted after the rows are checked, so a bad row is named first, as it was
            both = np.array(checked, dtype=np.float64).reshape(n, 2)
            actuals = both[:, 0], both[:, 1]
        return ParsedObservations(rows, *actuals, *(predicted[:, j] for j in range(4)))

    def _entry_actuals(
        self, entries: Sequence[Any], predicted: np.ndarray, where: str, first: int = 0
    ) -> list[tuple[float, float]]:
        """Actuals entry by entry (what the client predicted goes into `predicted`); names the first bad one."""
        actuals: list[tuple[float, float]] = []
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
                raise FeatureError(f"{where}[{first + i}].{err.field}", err.problem) from None
        return actuals

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

    def _finish_raw(self, raw: list[tuple[float, ...]], endpoint_ids: list[str], accelerators: list[str]) -> ParsedRows:
        """Raw tuples of the row-by-row path → the COLUMNS matrix."""
        n = len(raw)
        if n == 0:
            return ParsedRows(np.empty((0, len(COLUMNS))), None, [])
        width = len(raw[0])
        # fromiter over the flattened values is ~25% faster than np.array on a list of mixed int/float tuples.
        r = np.fromiter(itertools.chain.from_iterable(raw), dtype=np.float64, count=n * width).reshape(n, width)
        groups = r[:, _GROUP]
        group: int | np.ndarray = int(groups[0]) if groups.min() == groups.max() else groups.astype(np.intp)
        ids = endpoint_ids if any(endpoint_ids) else None
        return self._finish(r[:, :8], r[:, 8:10], r[:, _POD], r[:, _RESIDENT : _WAIT + 1], group, ids, accelerators)

    def _finish(
        self,
        counts: np.ndarray,
        fractions: np.ndarray,
        pods: np.ndarray | float,
        timeslice: np.ndarray | None,
        group: int | np.ndarray,
        endpoint_ids: list[str] | None,
        accelerators: list[str],
    ) -> ParsedRows:
        """Checked raw columns → the COLUMNS matrix, in as few numpy calls as possible (each costs ~1 µs).

        counts: (n, 8) in `_COUNT_FIELDS` order; fractions: (n, 2) kv, score; pods: role code per row, or one
        for all; timeslice: (n, 2) resident, wait, or None for resident without wait; group: the one hardware
        group of every row (its figures are then scalars and one template row fills every constant column), or
        the group per row.
        """
        n = len(counts)
        # Built transposed, one contiguous row per column, since numpy's per-call cost is lower on contiguous
        # vectors; copied into the usual row-major (n, COLUMNS) layout at the end.
        xt = np.empty((len(COLUMNS), n))
        figures: Any
        if isinstance(group, int):
            figures = _group_figures(self._group_list[group])
            xt[:] = self._templates[group]
        else:  # per-row figures as (n,) vectors, which broadcast like scalars against (k, n) blocks
            xt[:] = self._templates[self._default_group]  # its constant columns; the figures are set per row below
            per_row = self._table[group]
            figures = per_row.T
            xt[_FIGURE_COLUMNS] = per_row[:, _TABLE_FIGURE_COLUMNS].T
        tflops, tb_s, kvb, params_b, layers, attn_width, weight_bytes, capacity, tp, _ = figures
        xt[_COUNT_COLUMNS] = counts.T
        xt[6] = fractions[:, 0]
        if not isinstance(pods, float):  # else 0.0: every row is "both", as the template says
            xt[9:11] = pods == _ROLE_CODES
        if timeslice is not None:
            xt[19:21] = timeslice.T
        # The request's own prefill (its uncached tokens after its cached hits) and the prefill queued ahead of
        # it (nothing cached) in one pass: new tokens in tokens[:2], cached ones in tokens[2:].
        tokens = np.zeros((4, n))
        # np.rint is np.round's own kernel for 0 decimals (half to even), without its Python wrapper.
        hits = np.rint(np.multiply(fractions[:, 1], xt[0], out=tokens[2]), out=tokens[2])
        np.subtract(xt[0], hits, out=tokens[0])
        tokens[1] = xt[7]  # prefill_tokens_in_flight
        xt[1:3] = tokens[2::-2]  # prefix_hit_tokens, uncached_tokens
        model_figures = (params_b, layers, attn_width, weight_bytes, tflops, tb_s)
        xt[15:17] = prefill_ms_array(*model_figures, tokens[:2], tokens[2:], tp)
        batch = xt[5] + 1.0  # running + this one
        xt[17] = decode_step_ms_array(params_b, weight_bytes, kvb, tflops, tb_s, batch, xt[6] * capacity, tp)
        return ParsedRows(xt.T.copy(), endpoint_ids, accelerators)


def _group_figures(g: _Group) -> tuple[float, ...]:
    """A group's figures in the order `_finish` unpacks them (and `RowParser._table` holds them)."""
    return (g.tflops, g.tb_s, g.kv_bytes_per_token, g.params_b, g.layers, g.attn_width, g.weight_bytes,
            g.kv_capacity_tokens, g.tensor_parallel, g.weights_ms)  # fmt: skip


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


_COLUMN_TIMESLICE = frozenset(("", *TIMESLICE_STATES))
_TEXT = frozenset((str,))
_NOT_RESIDENT = frozenset(("switching", "parked"))


def _column_rows(columns: Mapping[str, Sequence[Any]], n: int) -> list[dict[str, Any]]:
    """Column lists as the row dicts Row messages would give, for the row-by-row checks: llm-d's fields always
    (an empty list gives their default, as a Row's unset field does), Leadtime's extras only where set."""
    if n == 0:
        return []
    rows: list[dict[str, Any]] = [{} for _ in range(n)]
    for name in (*NUMBER_FIELDS, "pod_type"):
        values = columns.get(name) or [_ROW_DEFAULTS.get(name, 0)] * n
        for row, value in zip(rows, values, strict=True):
            row[name] = value
    for name, values in columns.items():
        if name in rows[0] or not len(values):
            continue
        for row, value in zip(rows, values, strict=True):
            if value or name == "prefix_hit_tokens":  # a zero hit count is a count; other zeros mean "not set"
                row[name] = value
    return rows


_ROW_DEFAULTS: dict[str, Any] = {"kv_cache_percentage": 0.0, "prefix_cache_score": 0.0, "pod_type": ""}


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
