"""Plain llm-d bulk bodies decoded straight into typed, range-checked rows by msgspec, in one C pass.

Why: on the router's 100-row bodies, JSON decoding into dicts and then checking every value in Python costs
~0.3 ms, a quarter of a call; a 200-entry training batch, ~0.5 ms. msgspec decodes into structs whose fields
are already the right type and within range, so the rows only need to be read out. It takes exactly what llm-d
sends (the eleven row fields, integer counts, the two actuals of a training entry, no Leadtime extras);
everything else (a float count, an unknown or extra key, a bad value) is refused here and goes to the general
path (`RowParser`), which accepts what it accepts and names what it refuses. So this module never decides an
error, and whatever it accepts, the general path accepts with the same values
(`tests/test_service_bulk_decode.py` checks both on random bodies).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from leadtime.features.rows import MAX_COUNT
from leadtime.predictor.service.rows import NUMBER_FIELDS

_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
_Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class LlmdBulkRow(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One candidate as llm-d's router sends it (`gc=False`: the rows hold no containers, so the collector
    never needs to see them)."""

    kv_cache_percentage: _Fraction
    input_token_length: _Count
    num_request_waiting: _Count
    num_request_running: _Count
    num_tokens_generated: _Count
    prefix_cache_score: _Fraction
    pod_type: Literal["", "both", "prefill", "decode"] | None = None
    prefill_tokens_in_flight: _Count = 0
    decode_tokens_in_flight: _Count = 0
    encoder_matched_size: _Count = 0
    encoder_input_size: _Count = 0


class _BulkBody(msgspec.Struct):
    requests: list[LlmdBulkRow]


class LlmdTrainingEntry(LlmdBulkRow, kw_only=True, forbid_unknown_fields=True, gc=False):
    """One observed sample as llm-d's router posts it: the row and what happened (0 = not observed)."""

    actual_ttft_ms: Annotated[float, msgspec.Meta(ge=0.0)]
    actual_tpot_ms: Annotated[float, msgspec.Meta(ge=0.0)]


class _TrainingBody(msgspec.Struct):
    entries: list[LlmdTrainingEntry]


_NUMBERS = operator.attrgetter(*NUMBER_FIELDS)
_POD = operator.attrgetter("pod_type")
_DECODER = msgspec.json.Decoder(_BulkBody)
_TRAINING_DECODER = msgspec.json.Decoder(_TrainingBody)
_ACTUALS = operator.attrgetter("actual_ttft_ms", "actual_tpot_ms")


def decode_plain_bulk(body: bytes, max_rows: int) -> tuple[list[tuple[Any, ...]], Sequence[str | None]] | None:
    """(numbers per row in `NUMBER_FIELDS` order, pod_type per row) of a plain body of 1..max_rows rows, or
    None when the general path must look at it."""
    rows = _decoded_list(_DECODER, body, "requests", max_rows)
    if rows is None:
        return None
    return list(map(_NUMBERS, rows)), list(map(_POD, rows))


def decode_plain_training(body: bytes, max_entries: int) -> np.ndarray | None:
    """The (n, 2) actual TTFT and TPOT of a plain body of 1..max_entries entries, all of whose values are then
    known good; or None when the general path must look at it (infinite actuals included)."""
    entries = _decoded_list(_TRAINING_DECODER, body, "entries", max_entries)
    if entries is None:
        return None
    actuals = np.array(list(map(_ACTUALS, entries)), dtype=np.float64)
    if not actuals.max() < math.inf:
        return None
    return actuals


def _decoded_list(decoder: msgspec.json.Decoder[Any], body: bytes, name: str, max_items: int) -> list[Any] | None:
    """The body's `name` list if the body decodes as the decoder's type and holds 1..max_items items."""
    try:
        items: list[Any] = getattr(decoder.decode(body), name)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return items if 1 <= len(items) <= max_items else None
