"""Feature rows → a float matrix in one fixed, versioned column order, a row at a time or a batch at a time.

Every model Leadtime saves records `SCHEMA_VERSION` and `COLUMNS`; a model trained on another order is refused
on load rather than silently fed the wrong columns. Hardware-derived columns (effective FLOP/s and bandwidth,
roofline prefill and decode times) are computed here, so the predictor sees a never-seen accelerator class
through the same physics as the ones it knows.

Two forms give the same matrix (tests hold them equal):

- the row form, `Vectorizer.row_vector`, is the definition: one FeatureRow in, one list of floats out;
- the batch form builds a whole batch a column at a time with numpy, whose cost per call hardly depends on the
  number of rows: from FeatureRows (`Vectorizer.batch`, what an in-process router calls with its candidates) or
  from columns a decoder has already checked (`Vectorizer.from_columns`, what the service calls with the JSON or
  protobuf rows it decoded). It returns a `FeatureBatch`: the matrix, the hardware class of every row (the
  learner keeps an offset per class, keyed by `HardwareClass.key`) and the endpoint of every row.

Every position in the matrix is looked up in `COLUMN_INDEX`, so reordering `COLUMNS` cannot break either form.
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import chain
from typing import Any

import numpy as np

from leadtime.features.catalog import BUILT_IN, Accelerator, Catalog, ModelProfile
from leadtime.features.errors import FeatureError
from leadtime.features.roofline import (
    decode_step_ms,
    decode_step_ms_array,
    kv_capacity_tokens,
    prefill_ms,
    prefill_ms_array,
    queue_prefill_ms,
)
from leadtime.features.rows import (
    LLMD_COUNT_FIELDS,
    MAX_TENSOR_PARALLEL,
    FeatureRow,
    RequestFeatures,
    check_tensor_parallel,
    feature_row_from_llmd,
    is_resident,
)

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
_BOUNDS["tensor_parallel"] = (1.0, float(MAX_TENSOR_PARALLEL))
_LOW = np.array([_BOUNDS[c][0] for c in COLUMNS])
_HIGH = np.array([_BOUNDS[c][1] for c in COLUMNS])

# Role codes of the batch form: what `CheckedColumns.roles` holds per row.
ROLE_CODES: dict[str, int] = {"both": 0, "prefill": 1, "decode": 2}


def class_key(accelerator: str, model: str, tensor_parallel: int) -> str:
    """The name of a hardware class: accelerator, model and tensor parallelism, which fix every hardware column.

    >>> class_key("h100-sxm", "llama-3.1-8b", 1)
    'h100-sxm/llama-3.1-8b/tp1'
    """
    return f"{accelerator}/{model}/tp{tensor_parallel}"


@dataclass(frozen=True)
class HardwareClass:
    """One accelerator class running one model at one tensor-parallel degree: the figures all its rows share."""

    accelerator: Accelerator
    model: ModelProfile
    tensor_parallel: int
    key: str
    kv_capacity_tokens: float
    weights_ms: float  # one decode step that reads only the weights: the roofline_weights_ms column

    @classmethod
    def of(cls, accelerator: Accelerator, model: ModelProfile, tensor_parallel: int) -> HardwareClass:
        """The class of an accelerator, a model and a tensor-parallel degree, its figures computed."""
        return cls(
            accelerator,
            model,
            tensor_parallel,
            class_key(accelerator.slug, model.slug, tensor_parallel),
            kv_capacity_tokens(model, accelerator, tensor_parallel),
            decode_step_ms(model, accelerator, 1, 0.0, tensor_parallel),
        )

    def figures(self) -> tuple[float, ...]:
        """The class's figures in `_FIGURES` order (what the batch form computes with)."""
        acc, mod = self.accelerator, self.model
        return (
            float(acc.effective_tflops),
            float(acc.effective_tb_s),
            float(mod.kv_bytes_per_token(self.tensor_parallel)),
            float(mod.params_b),
            float(mod.layers),
            float(mod.num_heads * mod.head_dim),
            float(mod.weight_bytes),
            float(self.kv_capacity_tokens),
            float(self.tensor_parallel),
            float(self.weights_ms),
        )


_FIGURES = (
    "tflops",
    "tb_s",
    "kv_bytes_per_token",
    "params_b",
    "layers",
    "attn_width",
    "weight_bytes",
    "kv_capacity_tokens",
    "tensor_parallel",
    "weights_ms",
)
# The figures that are columns of their own, and their columns.
_FIGURE_COLUMN = {
    "tflops": "accel_tflops",
    "tb_s": "accel_tb_s",
    "tensor_parallel": "tensor_parallel",
    "kv_bytes_per_token": "kv_bytes_per_token",
    "weights_ms": "roofline_weights_ms",
}
_FIGURE_POSITIONS = np.array([_FIGURES.index(f) for f in _FIGURE_COLUMN])
_FIGURE_COLUMNS = np.array([COLUMN_INDEX[c] for c in _FIGURE_COLUMN.values()])


class HardwareTable:
    """Every hardware class a Vectorizer has met, by index, with the default class for rows that name none.

    Request threads share one table and read it without a lock: a new class is published in the index only once
    all of it is in place. Adding one costs the same however many the table holds: its key is found in a dict,
    and its figures are written into a matrix with room to spare (doubled when full), of which `figures` is a
    view of the rows in use. (Rebuilt whole for each class, a client naming ever-new classes made every
    prediction slower.) A reader holding an older `figures` keeps a valid view of the classes it knew.

    Parameters
    ----------
    default_accelerator, default_model
        The class of rows that name no accelerator or model (llm-d rows never do).
    catalog
        The classes and models rows may name.
    """

    def __init__(self, default_accelerator: str, default_model: str, catalog: Catalog = BUILT_IN) -> None:
        self.catalog = catalog
        self.default_accelerator = catalog.accelerator(default_accelerator).slug
        self.default_model = catalog.model(default_model).slug
        self.classes: list[HardwareClass] = []
        self.keys: list[str] = []
        self._storage = np.empty((8, len(_FIGURES)))  # room for classes to come, `_FIGURES` order
        self.figures = self._storage[:0]  # one row per class
        self.templates: list[np.ndarray] = []  # per class: its constant columns, a (COLUMNS, 1) column
        self._index: dict[tuple[str, str, int], int] = {}  # as rows name them ("" for the default)
        self._by_key: dict[str, int] = {}  # by class key
        self._lock = threading.Lock()
        self.default = self.index("", "", 1)

    def index(self, accelerator: str, model: str, tensor_parallel: int) -> int:
        """The index of a class ("" names the default); raises FeatureError for an unknown one, or a
        tensor-parallel size outside 1 to `MAX_TENSOR_PARALLEL`."""
        found = self._index.get((accelerator, model, tensor_parallel))
        if found is not None:
            return found
        if not 1 <= tensor_parallel <= MAX_TENSOR_PARALLEL:
            check_tensor_parallel(tensor_parallel)  # raises, in the rows' words
        with self._lock:
            acc = self.catalog.accelerator(accelerator or self.default_accelerator)
            mod = self.catalog.model(model or self.default_model)
            hardware = HardwareClass.of(acc, mod, tensor_parallel)
            found = self._by_key.get(hardware.key)
            if found is None:
                found = self._add(hardware)
            self._index[(accelerator, model, tensor_parallel)] = found
            return found

    def _add(self, hardware: HardwareClass) -> int:
        """Append a class (under the lock); its index. Readers see it once `index` publishes it."""
        n = len(self.classes)
        template = np.zeros((len(COLUMNS), 1))
        figures = np.array(hardware.figures())
        template[_FIGURE_COLUMNS, 0] = figures[_FIGURE_POSITIONS]
        template[COLUMN_INDEX["timeslice_resident"]] = 1.0  # roles and the time-slice wait stay 0
        if n == len(self._storage):  # full: a new matrix twice the size; views of the old one stay valid
            grown = np.empty((2 * n, len(_FIGURES)))
            grown[:n] = self._storage
            self._storage = grown
        self._storage[n] = figures
        self.classes.append(hardware)
        self.templates.append(template)
        self.keys.append(hardware.key)
        self.figures = self._storage[: n + 1]
        self._by_key[hardware.key] = n
        return n


@dataclass
class FeatureBatch:
    """Rows vectorized: the `COLUMNS` matrix, the hardware class of every row, and every row's endpoint.

    `hardware` is one index into `table` for every row (a fleet of one class, the usual case), or one per row.
    Batches slice like arrays (`batch[10:20]`, `batch[[0, 5]]`).

    `checked` says the values were checked before they were vectorized (FeatureRows when they were built, a
    decoder's `CheckedColumns`): a batch the Vectorizer made from them, and its slices and concatenations. Others
    (a bare matrix, a batch built by hand) are checked by whoever takes them (`check_matrix`), which a router's
    batch does not pay for again.
    """

    X: np.ndarray
    hardware: int | np.ndarray
    table: HardwareTable
    endpoint_ids: list[str] | None = None  # None when no row names its endpoint
    checked: bool = field(default=False, compare=False)

    def __len__(self) -> int:
        return len(self.X)

    @property
    def classes(self) -> list[str]:
        """The hardware class key of every row (what the learner keeps its per-class offsets by)."""
        keys = self.table.keys
        if isinstance(self.hardware, int):
            return [keys[self.hardware]] * len(self.X)
        return [keys[i] for i in self.hardware.tolist()]

    @property
    def accelerators(self) -> list[str]:
        """The accelerator class of every row, the default filled in."""
        classes = self.table.classes
        if isinstance(self.hardware, int):
            return [classes[self.hardware].accelerator.slug] * len(self.X)
        return [classes[i].accelerator.slug for i in self.hardware.tolist()]

    @property
    def roles(self) -> list[str]:
        """both | prefill | decode per row."""
        roles = self.X[:, [COLUMN_INDEX["role_prefill"], COLUMN_INDEX["role_decode"]]].tolist()
        return ["prefill" if p else "decode" if d else "both" for p, d in roles]

    def __getitem__(self, index: int | slice | Sequence[int] | np.ndarray) -> FeatureBatch:
        if isinstance(index, int | np.integer):
            index = [int(index)]
        hardware = self.hardware if isinstance(self.hardware, int) else self.hardware[index]
        ids = self.endpoint_ids
        if ids is not None:
            if isinstance(index, slice):
                ids = ids[index]
            else:
                positions = np.asarray(index)
                if positions.dtype == bool:
                    positions = np.flatnonzero(positions)
                ids = [ids[i] for i in positions.tolist()]
        return FeatureBatch(self.X[index], hardware, self.table, ids, self.checked)

    @classmethod
    def concat(cls, parts: Sequence[FeatureBatch]) -> FeatureBatch:
        """Batches of one table (slices of one request, checked one after the other) as one."""
        if len(parts) == 1:
            return parts[0]
        table = parts[0].table
        if any(p.table is not table for p in parts):
            raise ValueError("batches of different hardware tables cannot be joined")
        hardware: int | np.ndarray
        shared = {p.hardware for p in parts if isinstance(p.hardware, int)}
        if len(shared) == 1 and all(isinstance(p.hardware, int) for p in parts):
            hardware = shared.pop()
        else:
            hardware = np.concatenate([np.full(len(p), p.hardware, dtype=np.intp) for p in parts])
        ids = None
        if any(p.endpoint_ids is not None for p in parts):
            ids = list(chain.from_iterable(p.endpoint_ids or [""] * len(p) for p in parts))
        return cls(np.concatenate([p.X for p in parts]), hardware, table, ids, all(p.checked for p in parts))


@dataclass
class CheckedColumns:
    """A batch of rows as columns whose values a decoder has already checked: what `from_columns` takes.

    counts
        (n, len(LLMD_COUNT_FIELDS)) integers 0..2**53 in `LLMD_COUNT_FIELDS` order (any numeric dtype).
    kv_cache_percentage
        (n,) in [0, 1].
    prefix_cache_score
        (n,) in [0, 1]; the prefix hits are round(score × input tokens) where `prefix_hit_tokens` is None.
    prefix_hit_tokens
        (n,) exact hit counts ≤ the input tokens, or None.
    roles
        (n,) `ROLE_CODES` per row, or None when every row is "both".
    resident, timeslice_wait_ms
        (n,) 1/0 and milliseconds ≥ 0, or None: every row resident, no wait.
    hardware
        `HardwareTable` index per row, or one for every row (None: the default class).
    endpoint_ids
        Per row, or None when no row names one.
    """

    counts: np.ndarray
    kv_cache_percentage: np.ndarray
    prefix_cache_score: np.ndarray
    prefix_hit_tokens: np.ndarray | None = None
    roles: np.ndarray | None = None
    resident: np.ndarray | None = None
    timeslice_wait_ms: np.ndarray | None = None
    hardware: int | np.ndarray | None = None
    endpoint_ids: list[str] | None = None


def _positions(*names: str) -> slice | np.ndarray:
    """Where columns are in the matrix: a slice when they are adjacent and in order (numpy is faster on those)."""
    where = [COLUMN_INDEX[n] for n in names]
    if where == list(range(where[0], where[0] + len(where))):
        return slice(where[0], where[0] + len(where))
    return np.array(where)


# The column of each llm-d count field: its own name but for the input length.
_COLUMN_OF = {"input_token_length": "input_tokens"}
_COUNT_COLUMNS = np.array([COLUMN_INDEX[_COLUMN_OF.get(f, f)] for f in LLMD_COUNT_FIELDS])
_INPUT = COLUMN_INDEX["input_tokens"]
_HITS = COLUMN_INDEX["prefix_hit_tokens"]
_UNCACHED = COLUMN_INDEX["uncached_tokens"]
_RUNNING = COLUMN_INDEX["num_request_running"]
_KV = COLUMN_INDEX["kv_cache_percentage"]
_PREFILL_IN_FLIGHT = COLUMN_INDEX["prefill_tokens_in_flight"]
_ROLES = _positions("role_prefill", "role_decode")
_ROLE_CODE_COLUMN = np.array([[ROLE_CODES["prefill"]], [ROLE_CODES["decode"]]])
_PREFILLS = _positions("roofline_own_prefill_ms", "roofline_queue_prefill_ms")
_QUEUE_PREFILL = COLUMN_INDEX["roofline_queue_prefill_ms"]
_WAITING = COLUMN_INDEX["num_request_waiting"]
_DECODE_STEP = COLUMN_INDEX["roofline_decode_step_ms"]
_RESIDENT = COLUMN_INDEX["timeslice_resident"]
_WAIT = COLUMN_INDEX["timeslice_wait_ms"]

# What the batch form reads off a FeatureRow with one C-level getter each: the numbers (llm-d's counts in
# LLMD_COUNT_FIELDS order, then kv, prefix score and time-slice wait), and the labels.
_REQUEST_FIELDS = frozenset(f.name for f in fields(RequestFeatures))
_ROW_ATTRIBUTE = {"input_token_length": "input_tokens"}


def _row_path(name: str) -> str:
    attribute = _ROW_ATTRIBUTE.get(name, name)
    return f"request.{attribute}" if attribute in _REQUEST_FIELDS else f"endpoint.{attribute}"


_ROW_NUMBERS = operator.attrgetter(
    *map(_row_path, LLMD_COUNT_FIELDS), "endpoint.kv_cache_percentage", "request.prefix_cache_score",
    "endpoint.timeslice_wait_ms"
)  # fmt: skip
_ROW_WIDTH = len(LLMD_COUNT_FIELDS) + 3
_ROW_LABELS = operator.attrgetter(
    "endpoint.accelerator", "endpoint.model", "endpoint.tensor_parallel", "endpoint.role", "endpoint.timeslice_state",
    "endpoint.endpoint_id"
)  # fmt: skip
_PLAIN_TIMESLICE = frozenset(("none", "resident"))


class Vectorizer:
    """Turns FeatureRows (or llm-d dict rows) into the `COLUMNS` matrix, a row or a batch at a time.

    Parameters
    ----------
    default_accelerator
        Class assumed for rows that do not name one (llm-d rows never do).
    default_model
        Model assumed for rows that do not name one.
    catalog
        The classes and models rows may name (the built-in ones unless a deployment adds its own).

    Examples
    --------
    >>> from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
    >>> v = Vectorizer("h100-sxm", "llama-3.1-8b")
    >>> rows = [FeatureRow(RequestFeatures(1000)), FeatureRow(RequestFeatures(50), EndpointState(accelerator="l40s"))]
    >>> batch = v.batch(rows)
    >>> batch.X.shape, batch.classes
    ((2, 23), ['h100-sxm/llama-3.1-8b/tp1', 'l40s/llama-3.1-8b/tp1'])
    >>> bool(np.array_equal(batch.X[1], v.row_vector(rows[1])))
    True
    """

    def __init__(
        self, default_accelerator: str = "h100-sxm", default_model: str = "llama-3.1-8b", catalog: Catalog = BUILT_IN
    ) -> None:
        self.hardware = HardwareTable(default_accelerator, default_model, catalog)
        self.default_accelerator = self.hardware.default_accelerator
        self.default_model = self.hardware.default_model

    # --- the row form ---------------------------------------------------------------------------------------

    def row_vector(self, row: FeatureRow) -> list[float]:
        """One row's values in `COLUMNS` order: the definition the batch form is held to."""
        r, e = row.request, row.endpoint
        hw = self.hardware.classes[self.hardware.index(e.accelerator, e.model, e.tensor_parallel)]
        acc, mod, tp = hw.accelerator, hw.model, hw.tensor_parallel
        hits = r.prefix_hit_tokens
        uncached = r.input_tokens - hits
        kv_tokens = e.kv_cache_percentage * hw.kv_capacity_tokens
        values = {
            "input_tokens": float(r.input_tokens),
            "prefix_hit_tokens": float(hits),
            "uncached_tokens": float(uncached),
            "num_tokens_generated": float(r.num_tokens_generated),
            "num_request_waiting": float(e.num_request_waiting),
            "num_request_running": float(e.num_request_running),
            "kv_cache_percentage": e.kv_cache_percentage,
            "prefill_tokens_in_flight": float(e.prefill_tokens_in_flight),
            "decode_tokens_in_flight": float(e.decode_tokens_in_flight),
            "role_prefill": 1.0 if e.role == "prefill" else 0.0,
            "role_decode": 1.0 if e.role == "decode" else 0.0,
            "accel_tflops": acc.effective_tflops,
            "accel_tb_s": acc.effective_tb_s,
            "tensor_parallel": float(tp),
            "kv_bytes_per_token": float(mod.kv_bytes_per_token(tp)),
            "roofline_own_prefill_ms": prefill_ms(mod, acc, uncached, hits, tp),
            "roofline_queue_prefill_ms": queue_prefill_ms(
                mod, acc, e.prefill_tokens_in_flight, e.num_request_waiting, tp
            ),
            "roofline_decode_step_ms": decode_step_ms(mod, acc, e.num_request_running + 1, kv_tokens, tp),
            "roofline_weights_ms": hw.weights_ms,
            "timeslice_resident": 1.0 if is_resident(e.timeslice_state) else 0.0,
            "timeslice_wait_ms": e.timeslice_wait_ms,
            "encoder_input_size": float(r.encoder_input_size),
            "encoder_matched_size": float(r.encoder_matched_size),
        }
        return [values[c] for c in COLUMNS]

    def transform(self, rows: Sequence[FeatureRow]) -> np.ndarray:
        """Rows → matrix; an unknown accelerator or model raises a FeatureError naming the row index."""
        return self.batch(rows).X

    def transform_llmd(self, rows: Iterable[Mapping[str, Any]]) -> np.ndarray:
        """llm-d dict rows → matrix; a bad row raises FeatureError naming the row index and field."""
        return self.batch_llmd(rows).X

    # --- the batch form -------------------------------------------------------------------------------------

    def batch(self, rows: Sequence[FeatureRow]) -> FeatureBatch:
        """FeatureRows (already checked when they were built) → a FeatureBatch, a column at a time."""
        n = len(rows)
        if n == 0:
            return FeatureBatch(np.empty((0, len(COLUMNS))), self.hardware.default, self.hardware, checked=True)
        numbers = np.fromiter(chain.from_iterable(map(_ROW_NUMBERS, rows)), np.float64, n * _ROW_WIDTH)
        numbers = numbers.reshape(n, _ROW_WIDTH)
        k = len(LLMD_COUNT_FIELDS)
        counts, kv, score, wait = numbers[:, :k], numbers[:, k], numbers[:, k + 1], numbers[:, k + 2]
        accelerators, models, parallel, roles, states, ids = zip(*map(_ROW_LABELS, rows), strict=True)
        hardware = self._classes_of(accelerators, models, parallel)
        role_set = set(roles)
        codes = None if role_set == {"both"} else np.array([ROLE_CODES[r] for r in roles], dtype=np.float64)
        resident = None
        if not _PLAIN_TIMESLICE.issuperset(states):
            resident = np.array([1.0 if is_resident(s) else 0.0 for s in states])
        columns = CheckedColumns(
            counts,
            kv,
            score,
            roles=codes,
            resident=resident,
            timeslice_wait_ms=wait if wait.any() else None,
            hardware=hardware,
            endpoint_ids=list(ids) if any(ids) else None,
        )
        return self.from_columns(columns)

    def own_prefill_ms(self, rows: Sequence[FeatureRow]) -> np.ndarray:
        """Each row's `roofline_own_prefill_ms` column alone, at half the cost of the whole matrix: what a router
        weighs a prefill by where it lands (`router_plugin.decoding`).

        >>> from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
        >>> v = Vectorizer("h100-sxm", "llama-3.1-8b")
        >>> rows = [FeatureRow(RequestFeatures(8000), EndpointState(accelerator=a)) for a in ("h100-sxm", "l40s")]
        >>> slow, fast = v.own_prefill_ms(rows)[::-1]
        >>> bool(slow > 2 * fast)
        True
        """
        if not rows:
            return np.zeros(0)
        hardware = self._classes_of(
            [r.endpoint.accelerator for r in rows],
            [r.endpoint.model for r in rows],
            [r.endpoint.tensor_parallel for r in rows],
        )
        tflops, tb_s, _, params_b, layers, attn_width, weight_bytes, _, tp, _ = self.hardware.figures[hardware].T
        hits = np.array([r.request.prefix_hit_tokens for r in rows], dtype=np.float64)
        new = np.array([r.request.input_tokens for r in rows], dtype=np.float64) - hits
        return prefill_ms_array(params_b, layers, attn_width, weight_bytes, tflops, tb_s, new, hits, tp)

    def _classes_of(
        self, accelerators: Sequence[str], models: Sequence[str], parallel: Sequence[int]
    ) -> int | np.ndarray:
        """The hardware class of every row (one index when all share one); names the first row of an unknown one."""
        keys = list(zip(accelerators, models, parallel, strict=True))
        index: dict[tuple[str, str, int], int] = {}
        for key in dict.fromkeys(keys):  # in order of first appearance, so the first bad row is named
            try:
                index[key] = self.hardware.index(*key)
            except FeatureError as err:
                raise FeatureError(f"rows[{keys.index(key)}].{err.field}", err.problem) from None
        if len(index) == 1:
            return next(iter(index.values()))
        per_row = np.array([index[key] for key in keys], dtype=np.intp)
        return int(per_row[0]) if per_row.min() == per_row.max() else per_row

    def batch_llmd(self, rows: Iterable[Mapping[str, Any]]) -> FeatureBatch:
        """llm-d dict rows (Leadtime's extras allowed) → a FeatureBatch; a bad row raises FeatureError naming the
        row index and field."""
        parsed = []
        for i, raw in enumerate(rows):
            try:
                parsed.append(feature_row_from_llmd(raw))
            except FeatureError as err:
                raise FeatureError(f"rows[{i}].{err.field}", err.problem) from None
        return self.batch(parsed)

    def batch_of_matrix(self, x: np.ndarray) -> FeatureBatch:
        """A bare `COLUMNS` matrix (from `transform`) as a batch, each row's hardware class found again.

        A matrix does not name its rows' classes, and figures rounded into a name could make two classes one.
        So each row's hardware columns are matched exactly against the catalog's classes (at the row's tensor
        parallelism); a row that no class, or more than one, matches exactly is refused (ValueError): pass a
        FeatureBatch from `batch`, which names every row's class.
        """
        x = np.asarray(x, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != len(COLUMNS):
            raise ValueError(f"x must have shape (n, {len(COLUMNS)}), got {x.shape}")
        table = self.hardware
        figures = x[:, _FIGURE_COLUMNS]
        if not len(x) or (figures == table.templates[table.default][_FIGURE_COLUMNS, 0]).all():
            return FeatureBatch(x, table.default, table)
        distinct, inverse = np.unique(figures, axis=0, return_inverse=True)
        indices = np.array([self._class_of_figures(tuple(row)) for row in distinct.tolist()], dtype=np.intp)
        per_row = indices[inverse.reshape(-1)]
        hardware: int | np.ndarray = int(per_row[0]) if per_row.min() == per_row.max() else per_row
        return FeatureBatch(x, hardware, table)

    def _class_of_figures(self, figures: tuple[float, ...]) -> int:
        """The table index of the one catalog class whose hardware columns are exactly `figures`."""
        tp = figures[list(_FIGURE_COLUMN).index("tensor_parallel")]
        matches = []
        if tp >= 1 and float(tp).is_integer():
            for acc in self.hardware.catalog.all_accelerators.values():
                for mod in self.hardware.catalog.all_models.values():
                    candidate = np.array(HardwareClass.of(acc, mod, int(tp)).figures())[_FIGURE_POSITIONS]
                    if tuple(candidate.tolist()) == figures:
                        matches.append((acc.slug, mod.slug, int(tp)))
        if len(matches) != 1:
            found = "no accelerator class and model" if not matches else f"{len(matches)} classes ({matches})"
            raise ValueError(
                f"a matrix row's hardware columns {figures} match {found} exactly: vectorize the rows with "
                "Vectorizer.batch, which names every row's class"
            )
        return self.hardware.index(*matches[0])

    def from_columns(self, c: CheckedColumns) -> FeatureBatch:
        """Checked columns → a FeatureBatch, in as few numpy calls as possible (each costs ~1 µs).

        With one hardware class for every row its figures are scalars and one template fills every constant
        column; otherwise the figures are (n,) vectors, which broadcast like scalars.
        """
        table = self.hardware
        counts = c.counts
        n = len(counts)
        group = table.default if c.hardware is None else c.hardware
        # Built transposed, one contiguous row per column (numpy's per-call cost is lower on contiguous
        # vectors), and copied into the usual row-major (n, COLUMNS) layout at the end.
        xt = np.empty((len(COLUMNS), n))
        figures: Any
        if isinstance(group, int):
            figures = table.classes[group].figures()
            xt[:] = table.templates[group]
        else:
            xt[:] = table.templates[table.default]  # its constant columns; the figures are set per row below
            per_row = table.figures[group]
            figures = per_row.T
            xt[_FIGURE_COLUMNS] = per_row[:, _FIGURE_POSITIONS].T
        tflops, tb_s, kvb, params_b, layers, attn_width, weight_bytes, capacity, tp, _ = figures
        xt[_COUNT_COLUMNS] = counts.T
        xt[_KV] = c.kv_cache_percentage
        if c.roles is not None:  # else every row is "both", as the template says
            xt[_ROLES] = c.roles == _ROLE_CODE_COLUMN
        if c.resident is not None:
            xt[_RESIDENT] = c.resident
        if c.timeslice_wait_ms is not None:
            xt[_WAIT] = c.timeslice_wait_ms
        # The request's own prefill (its uncached tokens after its cached hits) and the prefill queued ahead of
        # it (nothing cached) in one pass: new tokens in tokens[:2], cached ones in tokens[2:].
        tokens = np.zeros((4, n))
        if c.prefix_hit_tokens is None:
            # np.rint is np.round's own kernel for 0 decimals (half to even, as Python's round), without its wrapper.
            hits = np.rint(np.multiply(c.prefix_cache_score, xt[_INPUT], out=tokens[2]), out=tokens[2])
        else:
            hits = tokens[2]
            hits[:] = c.prefix_hit_tokens
        np.subtract(xt[_INPUT], hits, out=tokens[0])
        # The queued tokens are the waiting requests' prompts, each its own sequence (`queue_prefill_ms`).
        queued = np.minimum(np.maximum(xt[_WAITING], 1.0), np.maximum(xt[_PREFILL_IN_FLIGHT], 1.0))
        np.divide(xt[_PREFILL_IN_FLIGHT], queued, out=tokens[1])
        xt[_HITS] = hits
        xt[_UNCACHED] = tokens[0]
        xt[_PREFILLS] = prefill_ms_array(
            params_b, layers, attn_width, weight_bytes, tflops, tb_s, tokens[:2], tokens[2:], tp
        )
        xt[_QUEUE_PREFILL] *= queued
        batch = xt[_RUNNING] + 1.0  # running + this one
        xt[_DECODE_STEP] = decode_step_ms_array(
            params_b, weight_bytes, kvb, tflops, tb_s, batch, xt[_KV] * capacity, tp
        )
        return FeatureBatch(xt.T.copy(), group, table, c.endpoint_ids, checked=True)


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
        raise FeatureError(COLUMNS[col], f"row {row} is {float(x[row, col])!r}; NaN and infinities are refused")
    bad_range = (x < _LOW) | (x > _HIGH)
    if bad_range.any():
        row, col = np.argwhere(bad_range)[0]
        low, high = _BOUNDS[COLUMNS[col]]
        raise FeatureError(COLUMNS[col], f"row {row} is {x[row, col]:g}, outside [{low:g}, {high:g}]")
    return x
