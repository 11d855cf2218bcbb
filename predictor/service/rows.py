"""Rows as the service receives them (JSON dicts, msgspec structs, protobuf messages) → checked columns.

The feature matrix is `leadtime.features.vectorize`'s: this module only reads the values a request carries,
checks them and hands them to `Vectorizer.from_columns` as `CheckedColumns`. It checks a whole batch at a time
where it can, because the router's 100 candidates per call leave no room for ~40 µs of Python per row:

- plain llm-d rows (dicts without Leadtime's extras, plain gRPC Row messages, rows msgspec has decoded) are read
  with one C-level getter per row and converted by `struct`, whose formats also refuse floats, negatives and
  non-numbers in the counts; bools are looked for once, ranges are checked with numpy reductions;
- gRPC `RowColumns` (one list per field) are converted a list at a time;
- anything else (Leadtime's extras, or any value the batch checks refuse) is checked row by row, so a bad value
  is named `requests[i].field` with exactly the message the feature rows give.

`tests/test_service_rows.py` holds every path to the Vectorizer's matrix, and the batch paths bit for bit to the
row-by-row one.
"""

from __future__ import annotations

import itertools
import math
import operator
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import chain, repeat
from typing import Any

import numpy as np

from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.errors import FeatureError
from leadtime.features.rows import (
    ACTUAL_FIELDS,
    LEADTIME_ROW_FIELDS,
    LLMD_COUNT_FIELDS,
    LLMD_DEFAULTS,
    LLMD_FRACTION_FIELDS,
    LLMD_REQUIRED_FIELDS,
    MAX_COUNT,
    MAX_PREDICTED_MS,
    MAX_TENSOR_PARALLEL,
    MAX_TEXT_CHARS,
    NOT_RESIDENT_STATES,
    POD_TYPE_ROLES,
    PREDICTED_FIELDS,
    TIMESLICE_STATES,
    check_count,
    check_real,
    check_text,
    is_resident,
    parse_timestamp,
    role_of,
    timeslice_state_of,
)
from leadtime.features.vectorize import ROLE_CODES, CheckedColumns, FeatureBatch, Vectorizer

# The numbers of a plain llm-d row, packed as these counts then these fractions, one struct record per row.
NUMBER_FIELDS = LLMD_COUNT_FIELDS + LLMD_FRACTION_FIELDS
_PLAIN_WIDTH = len(NUMBER_FIELDS) + 1  # + pod_type
_GET_NUMBERS = operator.itemgetter(*NUMBER_FIELDS)
_GET_POD = operator.itemgetter("pod_type")
_ATTR_NUMBERS = operator.attrgetter(*NUMBER_FIELDS)
_ATTR_POD = operator.attrgetter("pod_type")
# Leadtime's fields a Row message always has (prefix_hit_tokens is the one with presence, asked by HasField).
_MESSAGE_EXTRAS = tuple(f for f in LEADTIME_ROW_FIELDS if f != "prefix_hit_tokens")
_ATTR_MESSAGE_EXTRAS = operator.attrgetter(*_MESSAGE_EXTRAS)
_HAS_PREFIX_HITS = operator.methodcaller("HasField", "prefix_hit_tokens")
_GET_ACTUALS = operator.itemgetter(*ACTUAL_FIELDS)
_ACTUALS_RECORD = struct.Struct("<2d")
# One row's numbers as bytes. `struct` converts a whole batch in C at a fraction of np.fromiter's cost, and its
# "Q" refuses what a count must not be (floats, negatives, strings, None, anything ≥ 2**64) while "d" refuses
# non-numbers in the fractions. It lets bools through (bool is an int): the one type check left is for those.
_RECORD = struct.Struct(f"<{len(LLMD_COUNT_FIELDS)}Q{len(LLMD_FRACTION_FIELDS)}d")
_RECORD_DTYPE = np.dtype(
    [("counts", "<u8", (len(LLMD_COUNT_FIELDS),)), ("fractions", "<f8", (len(LLMD_FRACTION_FIELDS),))]
)
_KV, _SCORE = (LLMD_FRACTION_FIELDS.index(f) for f in ("kv_cache_percentage", "prefix_cache_score"))
_INPUT = LLMD_COUNT_FIELDS.index("input_token_length")
_NUMBER_TYPES = frozenset((int, float))
_POD_VALUE_TYPES = frozenset((str, type(None)))
# Role code per pod_type (null means "", as in llm-d).
_POD_CODES: dict[str | None, int] = {None: 0, **{p: ROLE_CODES[r] for p, r in POD_TYPE_ROLES.items()}}
_POD_VALUES = frozenset(_POD_CODES)
_BOTH_ONLY = frozenset(p for p, code in _POD_CODES.items() if code == ROLE_CODES["both"])
_PLAIN_TIMESLICE = frozenset(("", "none"))
_COLUMN_TIMESLICE = frozenset(("", *TIMESLICE_STATES))
_TEXT = frozenset((str,))
ROW_EXTRAS = (*LEADTIME_ROW_FIELDS, "role")
"""Keys that only Leadtime's rows carry, read (and checked) on llm-d's paths too: their presence sends a row down
the careful path."""
_EXTRAS = frozenset(ROW_EXTRAS)
_OBSERVATION_EXTRAS = frozenset((*PREDICTED_FIELDS, "timestamp"))

# The row-by-row path's values per row: the counts, the fractions, then these.
_RAW = (*NUMBER_FIELDS, "hits", "role", "resident", "wait", "hardware")
_RAW_HITS, _RAW_ROLE, _RAW_RESIDENT, _RAW_WAIT, _RAW_HARDWARE = (
    _RAW.index(n) for n in ("hits", "role", "resident", "wait", "hardware")
)
_RAW_COUNTS = slice(0, len(LLMD_COUNT_FIELDS))
_RAW_KV, _RAW_SCORE = (NUMBER_FIELDS.index(f) for f in ("kv_cache_percentage", "prefix_cache_score"))


@dataclass
class ParsedObservations:
    """Training entries checked: their rows vectorized, what happened, and what the client had predicted."""

    rows: FeatureBatch
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
        rows = FeatureBatch.concat([p.rows for p in parts])
        columns = [np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls) if f.name != "rows"]
        return cls(rows, *columns)


@dataclass
class _Plain:
    """A plain batch read with one getter per row, before its types and ranges are checked."""

    numbers: list[tuple[Any, ...]]  # per row, in `NUMBER_FIELDS` order
    pods: Sequence[Any]
    typed: bool  # protobuf already guarantees the types (unsigned ints, doubles, strings)


def _count(row: Mapping[str, Any], name: str, default: int | None = None, least: int = 0, most: int = MAX_COUNT) -> int:
    value = row.get(name, default)
    if type(value) is int and least <= value <= most:
        return value
    if value is None:  # a field with a default sent as null is a bad value, not a missing one
        raise FeatureError(name, "is required" if default is None else f"must be an integer ≥ {least}, got null")
    return check_count(name, value, least, most)


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
    return check_text(name, value)


def _all_dicts(rows: Sequence[Any]) -> bool:
    return len(rows) > 0 and set(map(type, rows)) == {dict}


def _dict_columns(rows: Sequence[Any], keys_checked: bool = False) -> _Plain | None:
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
        columns = _Plain(list(map(_GET_NUMBERS, rows)), list(map(_GET_POD, rows)), typed=False)
    except KeyError:  # some row leaves out an optional field
        columns, exact = None, False
    if not (keys_checked or exact) and not _EXTRAS.isdisjoint(set().union(*rows)):
        return None
    if columns is not None:
        return columns

    def column(name: str) -> list[Any]:
        return list(map(dict.get, rows, repeat(name), repeat(LLMD_DEFAULTS.get(name))))

    return _Plain(list(zip(*map(column, NUMBER_FIELDS), strict=True)), column("pod_type"), typed=False)


def _message_columns(messages: Sequence[Any]) -> _Plain | None:
    """The fields of plain gRPC Row messages as columns; None when some message sets a Leadtime extra."""
    if not messages:
        return None
    extras = dict(zip(_MESSAGE_EXTRAS, zip(*map(_ATTR_MESSAGE_EXTRAS, messages), strict=True), strict=True))
    if (
        any(extras["endpoint_id"])
        or any(extras["accelerator"])
        or any(extras["model"])
        or any(extras["timeslice_wait_ms"])  # 0.0 and -0.0 are the plain "no wait"; NaN is truthy: row by row
        or max(extras["tensor_parallel"]) > 1
        or not _PLAIN_TIMESLICE.issuperset(extras["timeslice_state"])
        or any(map(_HAS_PREFIX_HITS, messages))
    ):
        return None
    return _Plain(list(map(_ATTR_NUMBERS, messages)), list(map(_ATTR_POD, messages)), typed=True)


def _pod_codes(pods: Sequence[Any], typed: bool) -> tuple[bool, np.ndarray | None]:
    """(plain, role code per row): plain is False when some pod_type needs the row checks; the codes are None
    when every row is "both"."""
    if not (typed or _POD_VALUE_TYPES.issuperset(map(type, pods))):
        return False, None
    kinds = set(pods)
    if kinds <= _BOTH_ONLY:
        return True, None
    if not kinds <= _POD_VALUES:
        return False, None
    return True, np.fromiter(map(_POD_CODES.__getitem__, pods), dtype=np.float64, count=len(pods))


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
    for j, name in enumerate(PREDICTED_FIELDS):
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
            if not (checked.min(initial=0.0) >= 0.0 and checked.max(initial=0.0) <= MAX_PREDICTED_MS):
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
    """Checks llm-d rows (and Leadtime's native rows) and vectorizes them with its `Vectorizer`.

    Parameters
    ----------
    default_accelerator, default_model
        Assumed for rows that name none (llm-d rows never do).
    catalog
        The classes and models rows may name.
    """

    def __init__(self, default_accelerator: str, default_model: str, catalog: Catalog = BUILT_IN) -> None:
        self.vectorizer = Vectorizer(default_accelerator, default_model, catalog)
        self.hardware = self.vectorizer.hardware

    def _raw_row(self, row: Any) -> tuple[tuple[float, ...], str]:
        """One row → (values in `_RAW` order, endpoint id); raises FeatureError naming the field, or naming none
        when the row itself is not an object (the caller names where it was: `FeatureError.under`)."""
        if not isinstance(row, Mapping):
            raise FeatureError("", f"must be a JSON object, got {type(row).__name__}")  # the row itself
        for name in LLMD_REQUIRED_FIELDS:
            if row.get(name) is None:
                raise FeatureError(name, "is required")
        # Checked in llm-d's order (the first bad value is the one named), kept in `NUMBER_FIELDS` order below.
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
        else:
            hits = round(score * input_tokens)
        role = _pod_type_index(row)
        endpoint_id = _text(row, "endpoint_id")
        accelerator = _text(row, "accelerator")
        model = _text(row, "model")
        tp = _count(row, "tensor_parallel", 1, least=1, most=MAX_TENSOR_PARALLEL)
        timeslice = timeslice_state_of(row.get("timeslice_state"))
        wait = row.get("timeslice_wait_ms", 0.0)
        if not ((type(wait) is float or type(wait) is int) and 0.0 <= wait < math.inf):
            wait = check_real("timeslice_wait_ms", wait)
        hardware = self.hardware.index(accelerator, model, tp)
        values = (
            input_tokens,
            waiting,
            running,
            generated,
            prefill_in_flight,
            decode_in_flight,
            encoder_matched,
            encoder_input,
            kv,
            score,
            hits,
            role,
            1.0 if is_resident(timeslice) else 0.0,
            wait,
            hardware,
        )
        return values, endpoint_id

    def parse(self, rows: Sequence[Any], where: str = "requests") -> FeatureBatch:
        """Check and vectorize; a bad row raises FeatureError with field `where[i].name`."""
        plain = _dict_columns(rows)
        if plain is not None:
            parsed = self._parse_plain(plain)
            if parsed is not None:
                return parsed
        return self._parse_rows(rows, where)

    def parse_one(self, row: Any) -> FeatureBatch:
        """One row (`/predict`); a bad value raises FeatureError naming the field (none for a row that is not an
        object: the caller knows where the row was, `FeatureError.under`)."""
        values, endpoint_id = self._raw_row(row)
        return self._finish_raw([values], [endpoint_id])

    def _parse_rows(self, rows: Sequence[Any], where: str, first: int = 0) -> FeatureBatch:
        """Row by row: for batches with Leadtime's extras, and to name the first bad value of any batch."""
        raw: list[tuple[float, ...]] = []
        endpoint_ids: list[str] = []
        for i, row in enumerate(rows):
            try:
                values, endpoint_id = self._raw_row(row)
            except FeatureError as err:
                raise err.under(f"{where}[{first + i}]") from None
            raw.append(values)
            endpoint_ids.append(endpoint_id)
        return self._finish_raw(raw, endpoint_ids)

    def _parse_plain(self, plain: _Plain) -> FeatureBatch | None:
        """A plain batch checked and converted a column at a time; None when any value needs the row checks."""
        numbers = plain.numbers
        if not (plain.typed or _NUMBER_TYPES.issuperset(map(type, chain.from_iterable(numbers)))):
            return None  # a bool, or something struct would convert (numpy scalars, Decimal): row by row
        plain_pods, roles = _pod_codes(plain.pods, plain.typed)
        if not plain_pods:
            return None
        try:
            records = np.frombuffer(b"".join(itertools.starmap(_RECORD.pack, numbers)), dtype=_RECORD_DTYPE)
        except (struct.error, OverflowError):
            return None
        counts, fractions = records["counts"], records["fractions"]
        # Exact on the integers; NaN fails both fraction comparisons.
        if not (counts.max() <= MAX_COUNT and fractions.min() >= 0.0 and fractions.max() <= 1.0):
            return None
        columns = CheckedColumns(counts, fractions[:, _KV], fractions[:, _SCORE], roles=roles)
        return self.vectorizer.from_columns(columns)

    def parse_plain(self, numbers: list[tuple[Any, ...]], pods: Sequence[str | None]) -> FeatureBatch | None:
        """Rows whose types are already known (`bulk_decode`): numbers in `NUMBER_FIELDS` order, pod_type each.

        None when a value is out of range, for the general path to name it.
        """
        return self._parse_plain(_Plain(numbers, pods, typed=True))

    def parse_messages(self, messages: Sequence[Any], to_dict: Any, where: str = "rows") -> FeatureBatch:
        """gRPC `leadtime.v1.Row` messages: plain ones straight to values, the rest through `to_dict(message)`.

        Protobuf already guarantees the integer fields are non-negative integers, so a plain row only needs its
        two fractions checked (and its counts held to 2**53, as JSON rows are).
        """
        plain = _message_columns(messages)
        if plain is not None:
            parsed = self._parse_plain(plain)
            if parsed is not None:
                return parsed
        raw: list[tuple[float, ...]] = []
        endpoint_ids: list[str] = []
        default = self.hardware.default
        for i, m in enumerate(messages):
            kv, score, role = m.kv_cache_percentage, m.prefix_cache_score, _POD_CODES.get(m.pod_type)
            counts = _ATTR_NUMBERS(m)[: len(LLMD_COUNT_FIELDS)]
            if (
                0.0 <= kv <= 1.0
                and 0.0 <= score <= 1.0
                and role is not None
                and max(counts) <= MAX_COUNT
                and not (m.endpoint_id or m.accelerator or m.model or m.timeslice_wait_ms)
                and m.tensor_parallel <= 1
                and m.timeslice_state in _PLAIN_TIMESLICE
                and not m.HasField("prefix_hit_tokens")
            ):
                hits = round(score * counts[_INPUT])
                raw.append((*counts, kv, score, hits, role, 1.0, 0.0, default))
                endpoint_ids.append("")
                continue
            try:
                values, endpoint_id = self._raw_row(to_dict(m))
            except FeatureError as err:
                raise err.under(f"{where}[{i}]") from None
            raw.append(values)
            endpoint_ids.append(endpoint_id)
        return self._finish_raw(raw, endpoint_ids)

    def parse_column_lists(self, columns: Mapping[str, Sequence[Any]], where: str = "columns") -> FeatureBatch:
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
        return self._parse_rows(_column_rows(columns, n), where)

    def _parse_column_arrays(self, columns: Mapping[str, Sequence[Any]], n: int) -> FeatureBatch | None:
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
        counts = np.zeros((n, len(LLMD_COUNT_FIELDS)), dtype=np.uint64)
        fractions = np.zeros((n, len(LLMD_FRACTION_FIELDS)))
        for names, kinds, block in ((LLMD_COUNT_FIELDS, "ui", counts), (LLMD_FRACTION_FIELDS, "uif", fractions)):
            for j, name in enumerate(names):
                if given(name):
                    column = typed(name, kinds)
                    if column is None:
                        return None
                    block[:, j] = column
        if n == 0 or not (counts.max() <= MAX_COUNT and fractions.min() >= 0.0 and fractions.max() <= 1.0):
            return None
        hits = None
        if given("prefix_hit_tokens"):
            hits = typed("prefix_hit_tokens", "ui")
            if hits is None or not (hits.astype(np.uint64) <= counts[:, _INPUT]).all():
                return None
        plain_pods, roles = _pod_codes(given("pod_type"), typed=True) if given("pod_type") else (True, None)
        if not plain_pods:
            return None
        resident = wait = None
        states, waits = given("timeslice_state"), given("timeslice_wait_ms")
        if states:
            if not _COLUMN_TIMESLICE.issuperset(states):
                return None
            resident = np.array([0.0 if state in NOT_RESIDENT_STATES else 1.0 for state in states])
        if waits:
            wait = typed("timeslice_wait_ms", "uif")
            if wait is None or not (wait.min() >= 0.0 and wait.max() < math.inf):
                return None
        hardware: int | np.ndarray = self.hardware.default
        named, models, parallel = given("accelerator"), given("model"), given("tensor_parallel")
        if parallel:
            sizes = typed("tensor_parallel", "ui")
            if sizes is None or sizes.min() < 0 or sizes.max() > MAX_TENSOR_PARALLEL:
                return None  # the row-by-row checks name it
        if any(named) or any(models) or any(tp > 1 for tp in parallel):
            keys = list(zip(named or repeat(""), models or repeat(""), parallel or repeat(1), strict=False))
            try:
                classes = {key: self.hardware.index(key[0], key[1], max(int(key[2]), 1)) for key in set(keys)}
            except FeatureError:
                return None
            per_row = np.array([classes[key] for key in keys], dtype=np.intp)
            hardware = int(per_row[0]) if per_row.min() == per_row.max() else per_row
        ids = given("endpoint_id")
        if not _TEXT.issuperset(map(type, ids)) or max(map(len, ids), default=0) > MAX_TEXT_CHARS:
            return None  # the row-by-row checks name it
        checked = CheckedColumns(
            counts,
            fractions[:, _KV],
            fractions[:, _SCORE],
            prefix_hit_tokens=hits,
            roles=roles,
            resident=resident,
            timeslice_wait_ms=wait,
            hardware=hardware,
            endpoint_ids=list(ids) if any(ids) else None,
        )
        return self.vectorizer.from_columns(checked)

    def parse_observations(self, entries: Sequence[Any], where: str = "entries", first: int = 0) -> ParsedObservations:
        """Training entries: a row plus `actual_ttft_ms`, `actual_tpot_ms` (0 = not observed). `first`: the index
        of `entries[0]` in the whole batch, for naming a bad one when a batch is checked a slice at a time.

        Batches are 512–1000 entries, so the keys of all entries are looked at once (one union) to pick the
        column-wise paths for the actuals and for the rows; either falls back to the per-entry checks.
        """
        n = len(entries)
        predicted = np.full((n, len(PREDICTED_FIELDS)), np.nan)
        keys = set().union(*entries) if _all_dicts(entries) else None
        actuals = None if keys is None else _column_actuals(entries, keys, predicted)
        checked = None if actuals is not None else self._entry_actuals(entries, predicted, where, first)
        rows = None
        if keys is not None and _EXTRAS.isdisjoint(keys):
            plain = _dict_columns(entries, keys_checked=True)
            rows = None if plain is None else self._parse_plain(plain)
        if rows is None:
            rows = self._parse_rows(entries, where, first=first)
        if actuals is None:  # converted after the rows are checked, so a bad row is named first, as it was
            both = np.array(checked, dtype=np.float64).reshape(n, 2)
            actuals = both[:, 0], both[:, 1]
        return ParsedObservations(rows, *actuals, *(predicted[:, j] for j in range(len(PREDICTED_FIELDS))))

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
                raise err.under(f"{where}[{first + i}]") from None
        return actuals

    @staticmethod
    def _checked_actuals(entry: Any, predicted: np.ndarray) -> tuple[float, float]:
        """Actuals of one entry checked field by field; fills `predicted` with what the client had predicted."""
        if not isinstance(entry, Mapping):
            raise FeatureError("", f"must be a JSON object, got {type(entry).__name__}")  # the entry itself
        values = []
        for name in ACTUAL_FIELDS:
            value = entry.get(name)
            if value is None:
                raise FeatureError(name, "is required")
            values.append(check_real(name, value))
        for j, name in enumerate(PREDICTED_FIELDS):
            value = entry.get(name)
            if value is not None:
                predicted[j] = check_real(name, value, high=MAX_PREDICTED_MS)
        timestamp = entry.get("timestamp")
        if timestamp is not None:
            parse_timestamp(timestamp)
        return values[0], values[1]

    def _finish_raw(self, raw: list[tuple[float, ...]], endpoint_ids: list[str]) -> FeatureBatch:
        """Values of the row-by-row path (`_RAW` order) → checked columns → the batch."""
        n = len(raw)
        if n == 0:
            return self.vectorizer.batch([])
        # fromiter over the flattened values is ~25% faster than np.array on a list of mixed int/float tuples.
        r = np.fromiter(itertools.chain.from_iterable(raw), dtype=np.float64, count=n * len(_RAW)).reshape(n, -1)
        groups = r[:, _RAW_HARDWARE]
        hardware: int | np.ndarray = int(groups[0]) if groups.min() == groups.max() else groups.astype(np.intp)
        columns = CheckedColumns(
            r[:, _RAW_COUNTS],
            r[:, _RAW_KV],
            r[:, _RAW_SCORE],
            prefix_hit_tokens=r[:, _RAW_HITS],
            roles=r[:, _RAW_ROLE],
            resident=r[:, _RAW_RESIDENT],
            timeslice_wait_ms=r[:, _RAW_WAIT],
            hardware=hardware,
            endpoint_ids=endpoint_ids if any(endpoint_ids) else None,
        )
        return self.vectorizer.from_columns(columns)


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


# What an unset field of a Row message reads as.
_ROW_DEFAULTS: dict[str, Any] = {"kv_cache_percentage": 0.0, "prefix_cache_score": 0.0, "pod_type": ""}


def _pod_type_index(row: Mapping[str, Any]) -> int:
    """The row's role code: llm-d's `pod_type`, else Leadtime's `role` (one of the extras every path takes, so that
    a row is predicted as what it is learned as)."""
    return ROLE_CODES[role_of(row.get("pod_type"), row.get("role"))]
