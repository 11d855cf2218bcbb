"""Request features, endpoint state and observations, and their lossless mapping to llm-d's rows.

llm-d's router describes a candidate as one flat JSON row (`LLMD_FIELDS`); Leadtime keeps the same facts split
into what belongs to the request and what belongs to the endpoint, plus the fields llm-d lacks (endpoint id,
accelerator class, model, role, time-slice state, prefix-hit tokens). Those extras ride along in the flat row
as extra keys, which llm-d's own predictor ignores, so one row format serves both.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from leadtime.features.errors import FeatureError

ROLES = ("both", "prefill", "decode")
TIMESLICE_STATES = ("none", "resident", "switching", "parked")
# An endpoint is servable only while its time-slice group is resident: in these states its job is away.
NOT_RESIDENT_STATES = frozenset(("switching", "parked"))
# The role each pod_type value means ("both" is accepted beside llm-d's "").
POD_TYPE_ROLES = {"": "both", "both": "both", "prefill": "prefill", "decode": "decode"}

# llm-d's prediction row, field by field, in the order llm-d documents it. Every decoder (JSON dicts, msgspec
# structs, protobuf messages) reads these names from here.
LLMD_FIELDS = (
    "kv_cache_percentage",
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "num_tokens_generated",
    "prefix_cache_score",
    "pod_type",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
    "encoder_matched_size",
    "encoder_input_size",
)
# The numbers llm-d's latency model is trained on and predicts from, in its order: every field but the pod type (a
# category) and the encoder sizes of multimodal requests.
LLMD_MODEL_INPUTS = tuple(f for f in LLMD_FIELDS if f not in ("pod_type", "encoder_matched_size", "encoder_input_size"))
LLMD_REQUIRED_FIELDS = (
    "kv_cache_percentage",
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "num_tokens_generated",
    "prefix_cache_score",
)
# Integers ≥ 0, and fractions in [0, 1]; pod_type is the one text field.
LLMD_COUNT_FIELDS = tuple(f for f in LLMD_FIELDS if f not in ("kv_cache_percentage", "prefix_cache_score", "pod_type"))
LLMD_FRACTION_FIELDS = ("kv_cache_percentage", "prefix_cache_score")
# What an optional llm-d field means when a row leaves it out.
LLMD_DEFAULTS: dict[str, Any] = {
    "pod_type": "",
    "prefill_tokens_in_flight": 0,
    "decode_tokens_in_flight": 0,
    "encoder_matched_size": 0,
    "encoder_input_size": 0,
}
# Leadtime's fields that ride along in a flat row (llm-d's predictor ignores them). The native API also takes
# `role` for a row without pod_type.
LEADTIME_ROW_FIELDS = (
    "endpoint_id",
    "accelerator",
    "model",
    "tensor_parallel",
    "prefix_hit_tokens",
    "timeslice_state",
    "timeslice_wait_ms",
)
# A training entry: the row, what happened (0 = not observed), and optionally what had been predicted and when.
ACTUAL_FIELDS = ("actual_ttft_ms", "actual_tpot_ms")
PREDICTED_FIELDS = (
    "predicted_ttft_ms",
    "predicted_tpot_ms",
    "predicted_ttft_quantile_ms",
    "predicted_tpot_quantile_ms",
)
# Every field of a native row, and of a native observation (`/v1`, gRPC): anything else is a slip, refused by name
# (`refuse_unknown_fields`), where llm-d's paths ignore what they do not know.
NATIVE_ROW_FIELDS = frozenset((*LLMD_FIELDS, *LEADTIME_ROW_FIELDS, "role"))
NATIVE_OBSERVATION_FIELDS = NATIVE_ROW_FIELDS | {*ACTUAL_FIELDS, *PREDICTED_FIELDS, "timestamp"}
ROUTED_BY_FIELD = "policy"
"""The routing policy an observation log's row names (the simulator's `--out` log): what routed the request, no
feature; readers of such logs pass it by without a word."""
MAX_PREDICTED_MS = 1e12
"""The most milliseconds a served prediction says (about 32 years: an infinity or overflow is served as this), and
so the most a predicted_* field may carry: a value above it was never a prediction of this service, and one near
float64's limit would make the live error's sum infinite for good."""


def is_resident(timeslice_state: str) -> bool:
    """Whether an endpoint in this time-slice state serves now (no time-slicing counts as resident).

    >>> is_resident("none"), is_resident("resident"), is_resident("parked")
    (True, True, False)
    """
    return timeslice_state not in NOT_RESIDENT_STATES


# Largest count accepted: every integer up to it is exact as a float64, so vectorizing a row cannot overflow.
MAX_COUNT = 2**53

MAX_TENSOR_PARALLEL = 1024
"""The largest tensor-parallel size a row may name, on every path (rows, the service's HTTP and gRPC bodies, the
clients, discovery labels). The largest tensor-parallel groups in practice are 8 to 64 GPUs (one node, or an
NVLink domain such as a GB200 NVL72 rack); 1024 leaves ample room above them. Each size is part of a hardware
class that the vectorizer keeps for the process's life, so an unbounded size (it was 2**53) let a client grow
that table, and slow every prediction, by sending ever-new sizes: bounded, the table holds at most this many
classes per accelerator class and model."""


def check_count(name: str, value: Any, least: int = 0, most: int = MAX_COUNT) -> int:
    """An integer from `least` (0: a count; 1: a tensor-parallel size) to `most`; floats with an integral value are
    accepted (JSON encoders differ), bools are not.

    numpy integers count as integers: rows are often built from arrays.

    >>> check_count("tensor_parallel", 0.5, least=1)
    Traceback (most recent call last):
    ...
    leadtime.features.errors.FeatureError: tensor_parallel: must be an integer ≥ 1, got 0.5
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | float):
        raise FeatureError(name, f"must be an integer ≥ {least}, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise FeatureError(name, f"must be an integer ≥ {least}, got {_shown(value)}")
    value = int(value)
    if value < least:
        raise FeatureError(name, f"must be ≥ {least}, got {value}")
    if value > MAX_COUNT:
        bound = "2**53" if most == MAX_COUNT else str(most)
        raise FeatureError(name, f"must be ≤ {bound}, got a {len(str(value))}-digit number")
    if value > most:
        raise FeatureError(name, f"must be ≤ {most}, got {value}")
    return value


def _shown(value: float) -> str:
    """A float as a message quotes it; an infinite one says what it mostly is: a JSON number beyond a double's
    range (`1e400`), which the service reads as infinite, as llm-d's server does (`edge.loads_json`), and would
    otherwise be quoted back as "inf", a value the sender never wrote.

    >>> _shown(float("-inf")), _shown(0.5)
    ('-inf (a number too large for a double)', '0.5')
    """
    return f"{value!r} (a number too large for a double)" if math.isinf(value) else repr(value)


def check_tensor_parallel(value: Any, name: str = "tensor_parallel") -> int:
    """A tensor-parallel size: an integer from 1 to `MAX_TENSOR_PARALLEL`.

    >>> check_tensor_parallel(2048)
    Traceback (most recent call last):
    ...
    leadtime.features.errors.FeatureError: tensor_parallel: must be ≤ 1024, got 2048
    """
    return check_count(name, value, least=1, most=MAX_TENSOR_PARALLEL)


def check_real(name: str, value: Any, low: float = 0.0, high: float = math.inf) -> float:
    """A finite real within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FeatureError(name, f"must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise FeatureError(name, f"must be finite, got {_shown(value)}")
    if value < low or value > high:
        bounds = f"between {low:g} and {high:g}" if math.isfinite(high) else f"≥ {low:g}"
        raise FeatureError(name, f"must be {bounds}, got {value:g}")
    return value


def known_fields_only(entries: list[Any], known: frozenset[str] = NATIVE_OBSERVATION_FIELDS) -> list[Any]:
    """Entries (checked mappings) as they are when every key is `known` (one union of all keys), else each without
    the keys that are not. What is stored is what is learned: llm-d's path ignores a field it does not know, and
    kept whole it held memory in the store and in Redis by the row (30 rows of a 10 MB field: 340 MB), where the
    store's bounds count rows.

    >>> known_fields_only([{"timestamp": 1, "junk": "x"}])
    [{'timestamp': 1}]
    """
    if known.issuperset(set().union(*entries)):
        return entries
    return [{key: value for key, value in entry.items() if key in known} for entry in entries]


def refuse_unknown_fields(items: Sequence[Any], where: str, known: frozenset[str]) -> None:
    """FeatureError naming the first key of `items` (rows or observations, named `where[i]`; items that are not
    mappings are left to the checks of their own) that is not one of `known`, with the field it may be a slip for.

    llm-d's paths ignore fields they do not know, as llm-d's own server does (Leadtime's extras ride along that
    way); the native API is Leadtime's own, and a row that misspells its class (`acelerator`) would otherwise be
    predicted, and its observation learned, as the default class's. One union of all keys when every one is known.

    >>> refuse_unknown_fields([{"accelerator": "l40s"}, {"acelerator": "l40s"}], "rows", NATIVE_ROW_FIELDS)
    Traceback (most recent call last):
    ...
    leadtime.features.errors.FeatureError: rows[1].acelerator: is not a field of the native API (did you mean \
'accelerator'?)
    """
    mappings = [item for item in items if type(item) is dict or isinstance(item, Mapping)]  # dicts: no ABC check
    if known.issuperset(set().union(*mappings)):
        return
    for i, item in enumerate(items):
        if isinstance(item, Mapping):
            refuse_unknown_keys(item, f"{where}[{i}]", known)


MAX_KEY_SHOWN = 64
"""The longest unknown key named whole in an error; a longer one is named by its start."""


def refuse_unknown_keys(
    item: Mapping[str, Any], where: str, known: frozenset[str], api: str = "the native API"
) -> None:
    """`refuse_unknown_fields` of one row or observation, named `where`, or of a whole body (`where` empty) that
    `api` (what the message says the key is not a field of) takes."""
    for key in item:
        if key not in known:
            name = str(key) or "''"
            # No field is long: a long key is named by its start (a 10 MB key was answered in a 10 MB message, after
            # 1.8 s spent looking for the field it might be a slip for).
            long = len(name) > MAX_KEY_SHOWN
            close = [] if long else difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else " (see /docs for the fields it takes)"
            name = f"{name[: MAX_KEY_SHOWN - 3]}..." if long else name
            raise FeatureError(f"{where}.{name}" if where else name, f"is not a field of {api}{hint}")


def role_of(pod_type: Any, role: Any = None) -> str:
    """A row's role from llm-d's `pod_type` and Leadtime's `role`. An unset pod_type (absent, null or "") leaves it
    to `role`: a client that sends every field with its default sends pod_type "" beside the role it means. Both
    set and saying different things is refused rather than settled by a rule the sender may not know.

    >>> role_of("", "prefill"), role_of("decode"), role_of(None)
    ('prefill', 'decode', 'both')
    >>> role_of("prefill", "decode")
    Traceback (most recent call last):
    ...
    leadtime.features.errors.FeatureError: role: 'decode' disagrees with pod_type 'prefill': give one of them
    """
    if pod_type is None or (isinstance(pod_type, str) and not pod_type):
        return "both" if role is None else _check_choice("role", role, ROLES)
    if not isinstance(pod_type, str) or pod_type not in POD_TYPE_ROLES:
        raise FeatureError("pod_type", f"must be '', 'both', 'prefill' or 'decode', got {pod_type!r}")
    said = POD_TYPE_ROLES[pod_type]
    if role is not None and role != said:
        _check_choice("role", role, ROLES)
        raise FeatureError("role", f"{role!r} disagrees with pod_type {pod_type!r}: give one of them")
    return said


def timeslice_state_of(value: Any) -> str:
    """A row's time-slice state: unset (absent, null or "") is "none", as "" is every text field's default (gRPC's
    unset field reads as "").

    >>> timeslice_state_of(""), timeslice_state_of(None), timeslice_state_of("parked")
    ('none', 'none', 'parked')
    """
    if value is None or (isinstance(value, str) and not value):
        return "none"
    return _check_choice("timeslice_state", value, TIMESLICE_STATES)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise FeatureError(name, f"must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return str(value)


# Longest endpoint id, accelerator or model name: Kubernetes names stop at 253 characters. The learner keeps state
# per endpoint id, so an unbounded id would be a way to make it hold megabytes per observation.
MAX_TEXT_CHARS = 256


def check_text(name: str, value: Any) -> str:
    """A string of at most `MAX_TEXT_CHARS` characters."""
    if not isinstance(value, str):
        raise FeatureError(name, f"must be a string, got {value!r}")
    if len(value) > MAX_TEXT_CHARS:
        raise FeatureError(name, f"must be at most {MAX_TEXT_CHARS} characters, got {len(value):,}")
    return value


@dataclass(frozen=True)
class RequestFeatures:
    """What the request brings, as seen on one candidate endpoint.

    `prefix_cache_score` is the share of the input already cached on that endpoint (llm-d's field); the hit
    count in tokens is derived from it so that both llm-d rows and Leadtime rows convert without loss.
    """

    input_tokens: int
    prefix_cache_score: float = 0.0
    num_tokens_generated: int = 0
    encoder_matched_size: int = 0
    encoder_input_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_tokens", check_count("input_token_length", self.input_tokens))
        object.__setattr__(
            self, "prefix_cache_score", check_real("prefix_cache_score", self.prefix_cache_score, 0.0, 1.0)
        )
        for name in ("num_tokens_generated", "encoder_matched_size", "encoder_input_size"):
            object.__setattr__(self, name, check_count(name, getattr(self, name)))

    @classmethod
    def with_prefix_hits(cls, input_tokens: int, prefix_hit_tokens: int, **kwargs: Any) -> RequestFeatures:
        """Request features from a prefix-hit count in tokens (which must not exceed the input)."""
        input_tokens = check_count("input_token_length", input_tokens)
        hits = check_count("prefix_hit_tokens", prefix_hit_tokens)
        if hits > input_tokens:
            raise FeatureError("prefix_hit_tokens", f"{hits} exceeds input_token_length {input_tokens}")
        score = hits / input_tokens if input_tokens else 0.0
        return cls(input_tokens=input_tokens, prefix_cache_score=score, **kwargs)

    @property
    def prefix_hit_tokens(self) -> int:
        """Input tokens already cached on the endpoint."""
        return round(self.prefix_cache_score * self.input_tokens)

    @property
    def uncached_tokens(self) -> int:
        """Input tokens the endpoint must prefill."""
        return self.input_tokens - self.prefix_hit_tokens


_COUNT_FIELDS = ("num_request_waiting", "num_request_running", "prefill_tokens_in_flight", "decode_tokens_in_flight")
"""EndpointState's counts of work on the endpoint, integers ≥ 0."""


@dataclass(frozen=True)
class EndpointState:
    """What a router knows of one endpoint when it decides (possibly a little stale)."""

    endpoint_id: str = ""
    accelerator: str = ""
    model: str = ""
    tensor_parallel: int = 1
    role: str = "both"
    num_request_waiting: int = 0
    num_request_running: int = 0
    kv_cache_percentage: float = 0.0
    prefill_tokens_in_flight: int = 0
    decode_tokens_in_flight: int = 0
    timeslice_state: str = "none"
    timeslice_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        check_text("endpoint_id", self.endpoint_id)
        check_text("accelerator", self.accelerator)
        check_text("model", self.model)
        object.__setattr__(self, "tensor_parallel", check_tensor_parallel(self.tensor_parallel))
        _check_choice("role", self.role, ROLES)
        for name in _COUNT_FIELDS:
            object.__setattr__(self, name, check_count(name, getattr(self, name)))
        object.__setattr__(
            self, "kv_cache_percentage", check_real("kv_cache_percentage", self.kv_cache_percentage, 0.0, 1.0)
        )
        _check_choice("timeslice_state", self.timeslice_state, TIMESLICE_STATES)
        object.__setattr__(self, "timeslice_wait_ms", check_real("timeslice_wait_ms", self.timeslice_wait_ms))

    def with_counts(self, **counts: int) -> EndpointState:
        """A copy with the count fields given replaced, only those checked: a router adds what it has in flight
        to every candidate at every decision, and `dataclasses.replace` would check the twelve fields again.

        >>> EndpointState(num_request_waiting=2).with_counts(num_request_waiting=5).num_request_waiting
        5
        >>> EndpointState().with_counts(role=1)
        Traceback (most recent call last):
        ...
        TypeError: with_counts takes count fields only, not ['role']
        """
        if not counts.keys() <= set(_COUNT_FIELDS):
            raise TypeError(f"with_counts takes count fields only, not {sorted(counts.keys() - set(_COUNT_FIELDS))}")
        state = object.__new__(EndpointState)
        state.__dict__.update(self.__dict__)  # a frozen dataclass refuses setattr, not its __dict__
        state.__dict__.update({name: check_count(name, value) for name, value in counts.items()})
        return state


@dataclass(frozen=True)
class FeatureRow:
    """One (request, candidate endpoint) pair: the unit the predictor scores."""

    request: RequestFeatures
    endpoint: EndpointState = field(default_factory=EndpointState)

    def __post_init__(self) -> None:
        """Its parts' kinds checked when made: a string in their place failed later, as an AttributeError from
        inside the vectorizer."""
        for name, kind, article in (("request", RequestFeatures, "a"), ("endpoint", EndpointState, "an")):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(f"FeatureRow.{name} must be {article} {kind.__name__}, got {type(value).__name__}")


@dataclass(frozen=True)
class Observation:
    """A completed request: the row it was predicted from, what happened, and what had been predicted.

    An actual of 0 means "this target was not observed" (llm-d's convention: TTFT and TPOT samples often
    arrive separately). The predicted mean is what live error is measured on, the predicted upper quantile what
    live coverage is measured on (the service's `leadtime_live_*` metrics).
    """

    row: FeatureRow
    actual_ttft_ms: float = 0.0
    actual_tpot_ms: float = 0.0
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    timestamp: float | None = None
    predicted_ttft_quantile_ms: float | None = None
    predicted_tpot_quantile_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.row, FeatureRow):
            raise TypeError(f"Observation.row must be a FeatureRow, got {type(self.row).__name__}")
        object.__setattr__(self, "actual_ttft_ms", check_real("actual_ttft_ms", self.actual_ttft_ms))
        object.__setattr__(self, "actual_tpot_ms", check_real("actual_tpot_ms", self.actual_tpot_ms))
        for name in (*PREDICTED_FIELDS, "timestamp"):
            value = getattr(self, name)
            if value is not None:
                high = MAX_PREDICTED_MS if name in PREDICTED_FIELDS else math.inf
                object.__setattr__(self, name, check_real(name, value, -math.inf, high))

    @classmethod
    def of_request(
        cls,
        row: FeatureRow,
        ttft_ms: float,
        tpot_ms: float,
        timestamp: float,
        predicted_ttft_ms: float | None = None,
        predicted_ttft_quantile_ms: float | None = None,
        predicted_tpot_ms: float | None = None,
        predicted_tpot_quantile_ms: float | None = None,
    ) -> Observation:
        """A routed request's observation: a TPOT prediction goes with it only when a TPOT was observed (live
        error and coverage are measured on pairs).

        >>> o = Observation.of_request(FeatureRow(RequestFeatures(10), EndpointState("e", "h100-sxm")), 80.0, 0.0,
        ...                            1.0, 70.0, 90.0, predicted_tpot_ms=9.0)
        >>> o.predicted_ttft_ms, o.predicted_tpot_ms
        (70.0, None)
        """
        observed = tpot_ms > 0
        return cls(
            row,
            ttft_ms,
            tpot_ms,
            predicted_ttft_ms,
            predicted_tpot_ms if observed else None,
            timestamp,
            predicted_ttft_quantile_ms,
            predicted_tpot_quantile_ms if observed else None,
        )

    @property
    def has_ttft(self) -> bool:
        """Whether the observation carries a TTFT."""
        return self.actual_ttft_ms > 0

    @property
    def has_tpot(self) -> bool:
        """Whether the observation carries a TPOT."""
        return self.actual_tpot_ms > 0


def feature_row_from_llmd(row: Mapping[str, Any]) -> FeatureRow:
    """An llm-d prediction row (plus Leadtime's optional extras) → FeatureRow. Unknown keys are ignored."""
    if not isinstance(row, Mapping):
        raise FeatureError("row", f"must be a JSON object, got {type(row).__name__}")
    for name in LLMD_REQUIRED_FIELDS:
        if name not in row or row[name] is None:
            raise FeatureError(name, "is required")
    input_tokens = check_count("input_token_length", row["input_token_length"])
    common = dict(
        num_tokens_generated=row["num_tokens_generated"],
        encoder_matched_size=row.get("encoder_matched_size", 0),
        encoder_input_size=row.get("encoder_input_size", 0),
    )
    request = RequestFeatures(input_tokens, row["prefix_cache_score"], **common)
    if row.get("prefix_hit_tokens") is not None:
        # Leadtime's exact hit count wins over a score that disagrees with it; a score that agrees is kept as
        # sent, so that llm-d → ours → llm-d returns the very same float.
        from_hits = RequestFeatures.with_prefix_hits(input_tokens, row["prefix_hit_tokens"], **common)
        if from_hits.prefix_hit_tokens != request.prefix_hit_tokens:
            request = from_hits
    role = role_of(row.get("pod_type"), row.get("role"))
    endpoint = EndpointState(
        endpoint_id=_unset_is_empty(row.get("endpoint_id")),
        accelerator=_unset_is_empty(row.get("accelerator")),
        model=_unset_is_empty(row.get("model")),
        tensor_parallel=row.get("tensor_parallel", 1),
        role=role,
        num_request_waiting=row["num_request_waiting"],
        num_request_running=row["num_request_running"],
        kv_cache_percentage=row["kv_cache_percentage"],
        prefill_tokens_in_flight=row.get("prefill_tokens_in_flight", 0),
        decode_tokens_in_flight=row.get("decode_tokens_in_flight", 0),
        timeslice_state=timeslice_state_of(row.get("timeslice_state")),
        timeslice_wait_ms=row.get("timeslice_wait_ms", 0.0),
    )
    return FeatureRow(request, endpoint)


def _unset_is_empty(value: Any) -> Any:
    """A text field's value, null read as "" (unset), as the service's decoders read it; anything else as it is, for
    `check_text` to refuse what is no text. (`value or ""` read 0, false and [] as unset too: such a row was taken
    as the default class's.)"""
    return "" if value is None else value


def feature_row_to_llmd(row: FeatureRow) -> dict[str, Any]:
    """FeatureRow → llm-d prediction row with Leadtime's extras as additional keys."""
    r, e = row.request, row.endpoint
    return {
        "kv_cache_percentage": e.kv_cache_percentage,
        "input_token_length": r.input_tokens,
        "num_request_waiting": e.num_request_waiting,
        "num_request_running": e.num_request_running,
        "num_tokens_generated": r.num_tokens_generated,
        "prefix_cache_score": r.prefix_cache_score,
        "prefix_hit_tokens": r.prefix_hit_tokens,
        "pod_type": "" if e.role == "both" else e.role,
        "prefill_tokens_in_flight": e.prefill_tokens_in_flight,
        "decode_tokens_in_flight": e.decode_tokens_in_flight,
        "encoder_matched_size": r.encoder_matched_size,
        "encoder_input_size": r.encoder_input_size,
        "endpoint_id": e.endpoint_id,
        "accelerator": e.accelerator,
        "model": e.model,
        "tensor_parallel": e.tensor_parallel,
        "timeslice_state": e.timeslice_state,
        "timeslice_wait_ms": e.timeslice_wait_ms,
    }


def observation_from_llmd(entry: Mapping[str, Any]) -> Observation:
    """An llm-d training entry (row + actual_ttft_ms/actual_tpot_ms [+ timestamp]) → Observation."""
    row = feature_row_from_llmd(entry)
    for name in ("actual_ttft_ms", "actual_tpot_ms"):
        if entry.get(name) is None:
            raise FeatureError(name, "is required")
    timestamp = entry.get("timestamp")
    if timestamp is not None:
        timestamp = parse_timestamp(timestamp)
    return Observation(
        row=row,
        actual_ttft_ms=entry["actual_ttft_ms"],
        actual_tpot_ms=entry["actual_tpot_ms"],
        predicted_ttft_ms=entry.get("predicted_ttft_ms"),
        predicted_tpot_ms=entry.get("predicted_tpot_ms"),
        timestamp=timestamp,
        predicted_ttft_quantile_ms=entry.get("predicted_ttft_quantile_ms"),
        predicted_tpot_quantile_ms=entry.get("predicted_tpot_quantile_ms"),
    )


def observation_to_llmd(obs: Observation) -> dict[str, Any]:
    """Observation → llm-d training entry with Leadtime's extras as additional keys."""
    out = feature_row_to_llmd(obs.row)
    out["actual_ttft_ms"] = obs.actual_ttft_ms
    out["actual_tpot_ms"] = obs.actual_tpot_ms
    for name in PREDICTED_FIELDS:
        value = getattr(obs, name)
        if value is not None:
            out[name] = value
    if obs.timestamp is not None:
        out["timestamp"] = obs.timestamp
    return out


_MILLISECONDS_ABOVE = 2e10
_LAST_SECOND = 253_402_300_799.0  # 9999-12-31T23:59:59Z
LATEST_TIMESTAMP = _LAST_SECOND * 1000.0
"""The largest number a timestamp may be (in milliseconds, the last second of the year 9999); schemas bound it."""


def _epoch_seconds(value: float) -> float:
    """pydantic's reading of a number as a time: seconds up to 2e10 (the year 2603), milliseconds beyond."""
    if abs(value) > _MILLISECONDS_ABOVE:
        value /= 1000.0
    if abs(value) > _LAST_SECOND:
        raise FeatureError("timestamp", "must be seconds or milliseconds since the epoch before the year 10000")
    return value


def in_utc(moment: datetime) -> datetime:
    """`moment` with a zone: a zone-less time is UTC, never the host's zone (a trace recorded on one machine must
    replay the same on any other).

    >>> in_utc(datetime(2026, 11, 30, 10)).isoformat()
    '2026-11-30T10:00:00+00:00'
    """
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def parse_datetime(text: str) -> datetime:
    """An ISO 8601 / RFC 3339 date-time with a zone (`in_utc`): any fraction of a second (cut to microseconds),
    `Z` or an offset; ValueError if the text is no date-time.

    >>> parse_datetime("2024-03-31 03:00:00.5+02:00") - parse_datetime("2024-03-31T01:59:59.5+01:00")
    datetime.timedelta(seconds=1)
    """
    return in_utc(datetime.fromisoformat(text.replace("Z", "+00:00")))


def parse_timestamp(value: Any) -> float:
    """Seconds since the epoch: a number, RFC 3339 (an offset-less time is taken as UTC, never the host's zone),
    epoch seconds as a string, or a `datetime` (what a Parquet timestamp column reads as; without a zone, UTC).

    >>> from datetime import datetime
    >>> parse_timestamp("2026-11-30T10:00:00Z"), parse_timestamp(datetime(2026, 11, 30, 10)), parse_timestamp(1.5)
    (1796032800.0, 1796032800.0, 1.5)

    A number beyond 2e10 is milliseconds, as pydantic (and so llm-d's own schema) reads it:

    >>> parse_timestamp(1_700_000_000_000), parse_timestamp("1700000000")
    (1700000000.0, 1700000000.0)
    """
    if isinstance(value, datetime):
        return in_utc(value).timestamp()
    if not isinstance(value, str):
        return _epoch_seconds(check_real("timestamp", value, -math.inf))
    text = value
    try:
        return _epoch_seconds(check_real("timestamp", float(text), -math.inf))
    except ValueError:
        pass
    try:
        return parse_datetime(text).timestamp()
    except ValueError:
        problem = f"must be RFC 3339 or seconds since the epoch, got {text!r}"
        raise FeatureError("timestamp", problem) from None
