"""Workloads: recorded traces (Mooncake JSONL, Azure CSV) and synthetic Poisson or bursty traffic.

Every workload is a list of `WorkloadRequest` sorted by arrival. Prefix sharing is described by chained hashes
of fixed-size prompt segments (`segment_tokens`; the Mooncake trace's `hash_ids` name 512-token blocks), so
equal leading hashes mean a shared prefix.
"""

from __future__ import annotations

import csv
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeGuard

from leadtime.data import TRACES, DataFileError, resolve
from leadtime.features.prefix import chain_block_ids
from leadtime.features.rows import parse_datetime

MOONCAKE_SEGMENT_TOKENS = 512

MAX_TOKENS = 2**24
"""The most tokens a request of a trace, or a synthetic workload's mean prompt or output or shared prefix, may have
(16,777,216: above the longest context any model takes, 10M tokens): beyond it a figure is a slip, and one of 1e18
was a prompt building that never ended."""
MAX_ARRIVAL_MS = 10**11
"""The longest arrival window a workload may span, in ms (100,000,000,000: about three years), as read (from its
first row) and as replayed (after the rate scale): beyond it a figure is a slip, and the simulated clock loses the
precision its steps need (at 1e300 ms a step of a few ms no longer changed it, and every latency came out 0; a
timestamp of 1e308 overflowed)."""
MAX_SYNTHETIC_REQUESTS = 10**7
MAX_SYNTHETIC_SEGMENTS = 10**8
"""The most prompt segments (prefix block ids) a synthetic workload may build, about its memory: the ids of its
requests' prompts and of its shared prefixes each."""
SYNTHETIC_RANGES: dict[str, tuple[int, int, str]] = {
    "requests": (1, MAX_SYNTHETIC_REQUESTS, ""),
    "input_mean": (1, MAX_TOKENS, " (tokens)"),
    "output_mean": (1, MAX_TOKENS, " (tokens)"),
    "prefix_groups": (0, 2**16, ""),
    "prefix_tokens": (0, MAX_TOKENS, " (tokens)"),
    "segment_tokens": (1, MAX_TOKENS, " (tokens)"),
}
"""The integer parameters' (least, most, unit): `prefix_tokens=1e15` built lists of ~2e12 ids until memory ran
out, `input_mean=1e18` looped ~2e15 times."""


class TraceError(ValueError):
    """A trace file is unreadable or has a malformed line (the message names the line)."""


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: when it arrives, its lengths and its prefix blocks."""

    arrival_ms: float
    input_tokens: int
    output_tokens: int
    segments: tuple[int, ...] = ()
    segment_tokens: int = MOONCAKE_SEGMENT_TOKENS


USER_TEXT_ENCODING = "utf-8-sig"
"""How users' text files (traces, training rows, CSV tables) are read: UTF-8, with or without the byte order mark
that editors on Windows write first."""


def loads_line(line: bytes | str) -> Any:
    """One line of a JSONL file (UTF-8, a leading byte order mark allowed) as JSON; ValueError saying in a few words
    why it is not JSON."""
    try:
        text = line.decode(USER_TEXT_ENCODING) if isinstance(line, bytes) else line.removeprefix("\ufeff")
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(err.msg) from None
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _finite_number(value: object) -> TypeGuard[int | float]:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _positive_int(value: object, name: str, where: str, minimum: int = 1, maximum: int = MAX_TOKENS) -> int:
    """A trace row's token count; TraceError naming the row's place (`path:line`) and field. Bounded here, where
    the place is known: `input_length: 1e18` was refused later by the policy, naming neither."""
    if not _finite_number(value) or int(value) != value or value < minimum:
        raise TraceError(f"{where}: '{name}' must be an integer ≥ {minimum}, got {value!r}")
    if value > maximum:
        raise TraceError(f"{where}: '{name}' must be an integer from {minimum} to {maximum:,} (tokens), got {value:g}")
    return int(value)


def _within_clock(offset_ms: float, name: str, shown: str, where: str) -> None:
    """TraceError naming the row (`path:line`) and its field `name` (showing `shown`) when it arrives more than
    `MAX_ARRIVAL_MS` from the trace's first row (`offset_ms` apart)."""
    if abs(offset_ms) > MAX_ARRIVAL_MS:
        raise TraceError(
            f"{where}: {name} {shown} is more than {MAX_ARRIVAL_MS:,} ms (about 3 years) from the first row's"
        )


def read_mooncake(path: Path) -> list[WorkloadRequest]:
    """Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token blocks), in file
    order."""
    out: list[WorkloadRequest] = []
    try:
        handle = path.open("rb")
    except OSError as err:
        raise TraceError(f"{path}: {err.strerror or err}") from None
    with handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = loads_line(line)
            except ValueError as err:
                raise TraceError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: expected a JSON object")
            for name in ("timestamp", "input_length", "output_length"):
                if name not in row:
                    raise TraceError(f"{where}: missing '{name}'")
            stamp = row["timestamp"]
            if not _finite_number(stamp) or stamp < 0:
                raise TraceError(f"{where}: 'timestamp' must be a finite number ≥ 0, got {stamp!r}")
            _within_clock(stamp - (out[0].arrival_ms if out else stamp), "'timestamp'", f"{stamp:g}", where)
            ids = row.get("hash_ids", [])
            if not isinstance(ids, list):
                raise TraceError(f"{where}: 'hash_ids' must be a list")
            out.append(
                WorkloadRequest(
                    arrival_ms=float(stamp),
                    input_tokens=_positive_int(row["input_length"], "input_length", where),
                    output_tokens=_positive_int(row["output_length"], "output_length", where),
                    segments=tuple(chain_block_ids(ids)),
                    segment_tokens=MOONCAKE_SEGMENT_TOKENS,
                )
            )
    return out


def read_azure(path: Path) -> list[WorkloadRequest]:
    """Azure LLM inference CSV: `TIMESTAMP` (date-time), `ContextTokens`, `GeneratedTokens`; no prefixes; in file
    order, times relative to the first row's."""
    try:
        handle = path.open(newline="", encoding=USER_TEXT_ENCODING)
    except OSError as err:
        raise TraceError(f"{path}: {err.strerror or err}") from None
    with handle:
        reader = csv.DictReader(handle)
        try:
            return _azure_rows(path, reader)
        except UnicodeDecodeError:
            raise TraceError(f"{path}: not UTF-8 text (expected an Azure .csv trace)") from None
        except csv.Error as err:
            raise TraceError(f"{path}: not CSV ({err})") from None


def _azure_rows(path: Path, reader: csv.DictReader[str]) -> list[WorkloadRequest]:
    out: list[WorkloadRequest] = []
    if reader.fieldnames is None:  # an empty file: no header, no rows
        return out
    missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames)
    if missing:
        raise TraceError(f"{path}:1: missing column(s) {', '.join(sorted(missing))}")
    start: datetime | None = None
    for row in reader:
        where = f"{path}:{reader.line_num}"  # the file's line (where the row ends): blank lines are skipped
        extra = row.get(None)  # csv.DictReader's key for cells past the header's
        if extra:
            more = f"{len(extra)} cell{'s' if len(extra) > 1 else ''}"
            raise TraceError(f"{where}: the row has {more} more than the header's {len(reader.fieldnames)} columns")
        text = (row.get("TIMESTAMP") or "").strip()
        try:
            # In UTC (a zone-less time is UTC): rows with offsets, Z and none compare as the times they name.
            stamp = parse_datetime(text)
        except ValueError:
            raise TraceError(f"{where}: TIMESTAMP {text!r} is not a date-time") from None
        start = start or stamp
        arrival_ms = (stamp - start).total_seconds() * 1e3
        _within_clock(arrival_ms, "TIMESTAMP", repr(text), where)
        out.append(
            WorkloadRequest(
                arrival_ms=arrival_ms,
                input_tokens=_azure_count(row, "ContextTokens", where),
                output_tokens=_azure_count(row, "GeneratedTokens", where),
            )
        )
    return out


def _azure_count(row: dict[str, str], name: str, where: str) -> int:
    """A token count of an Azure row: the text of an integer ≥ 1 (an error names the column and quotes the cell,
    or says the row is too short to have one)."""
    text = row.get(name)
    if text is None:  # csv.DictReader's filler for the cells a short row lacks
        raise TraceError(f"{where}: the row is short: it has no {name} cell")
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{where}: '{name}' must be an integer ≥ 1, got {text!r}") from None
    return _positive_int(value, name, where)


def is_mooncake(source: str) -> bool:
    """Whether a trace file is read as Mooncake JSONL: by its extension, in any case (`TRACE.JSONL` too)."""
    return Path(source).suffix.lower() == ".jsonl"


def read_trace(path: Path, limit: int | None = None) -> list[WorkloadRequest]:
    """Pick the parser by extension (in any case): .jsonl → Mooncake, .csv → Azure; a file without a request is
    refused here, where its name is known, rather than later as a workload without one.

    The requests come in arrival order, the `limit` earliest of them with a limit. The whole file is read either
    way: a file's rows need not be in time order, and its first lines are then not its first arrivals (reading
    the shipped traces whole takes a fraction of a second).
    """
    suffix = path.suffix.lower()  # TRACE.CSV is a CSV file too
    if is_mooncake(str(path)):
        requests = read_mooncake(path)
    elif suffix == ".csv":
        requests = read_azure(path)
    else:
        raise TraceError(f"{path}: unknown trace format (expected .jsonl Mooncake or .csv Azure)")
    if not requests:
        raise TraceError(f"{path}: no requests (the file is empty{', or a header alone' if suffix == '.csv' else ''})")
    return sorted(requests, key=lambda r: r.arrival_ms)[:limit]  # stable: rows of one instant keep file order


def arrival_window_s(requests: Sequence[WorkloadRequest]) -> float:
    """Seconds from the first arrival to the last of requests in arrival order: what goodput and arrival rates are
    per second of."""
    return (requests[-1].arrival_ms - requests[0].arrival_ms) / 1e3 if requests else 0.0


def arrival_rate_rps(requests: Sequence[WorkloadRequest]) -> float:
    """Requests per second of their arrival window (requests in arrival order, over a window > 0).

    >>> arrival_rate_rps([WorkloadRequest(1000.0 * i, 10, 1) for i in range(20)])  # 20 over 19 s
    1.0526315789473684
    """
    return len(requests) / arrival_window_s(requests)


def describe_arrivals(requests: Sequence[WorkloadRequest]) -> str:
    """How many requests arrive over what window at what rate, as a user checks a replay against the trace meant.

    >>> describe_arrivals([WorkloadRequest(1000.0 * i, 10, 1) for i in range(20)])
    '20 requests over 19.0 s, 1.05 req/s'
    >>> describe_arrivals([WorkloadRequest(1.0 * i, 10, 1) for i in range(20)])  # under a second: in ms
    '20 requests over 19 ms, 1,052.63 req/s'
    """
    window_s = arrival_window_s(requests)
    window = f"{window_s:,.1f} s" if window_s >= 1 else f"{window_s * 1e3:.3g} ms"
    return f"{len(requests)} requests over {window}, {arrival_rate_rps(requests):,.2f} req/s"


IMPLAUSIBLE_RATE_RPS = 1000.0
"""A recorded Mooncake trace at this rate or above is more likely stamped in seconds than in the format's
milliseconds (read as milliseconds, seconds replay a thousand times too fast; the shipped trace runs at ~3 req/s)."""


def rate_unit_warning(source: str, requests: Sequence[WorkloadRequest], rate_scale: float = 1.0) -> str | None:
    """A warning when a Mooncake file's recorded rate (`requests` as replayed at `rate_scale`) is implausible for
    its unit, else None; other sources state their times unambiguously (Azure's are date-times)."""
    if not is_mooncake(source) or len(requests) < 2 or arrival_window_s(requests) <= 0:
        return None
    recorded = arrival_rate_rps(requests) / rate_scale
    if recorded < IMPLAUSIBLE_RATE_RPS:
        return None
    return (
        f"{source}: {len(requests)} requests arrive at {recorded:,.0f} req/s as recorded; Mooncake timestamps are "
        "milliseconds: if this file's are seconds, multiply them by 1000"
    )


def require_arrival_window(requests: Sequence[WorkloadRequest], source: str, max_requests: int | None = None) -> None:
    """Refuse requests (in arrival order) of `source` that all arrive at one instant: every rate per second of their
    window would be a division by zero. Replaying more is advised only when `max_requests` (--max-requests) cut the
    trace short: a whole trace has no more to give."""
    if arrival_window_s(requests) <= 0:
        cut = max_requests is not None and len(requests) >= max_requests
        raise TraceError(
            f"{source}: the {len(requests)} request(s) replayed arrive at one instant: goodput per second of their "
            f"arrival window is undefined{'; replay more of the trace (--max-requests)' if cut else ''}"
        )


def shape(
    requests: list[WorkloadRequest],
    rate_scale: float = 1.0,
    max_requests: int | None = None,
) -> list[WorkloadRequest]:
    """Sort by arrival, keep the first `max_requests`, and compress time by `rate_scale` (2 = twice the rate)."""
    if rate_scale <= 0:
        raise TraceError(f"rate_scale must be > 0, got {rate_scale}")
    if max_requests is not None and max_requests < 1:
        raise TraceError(f"max_requests must be ≥ 1, got {max_requests}")
    ordered = sorted(requests, key=lambda r: r.arrival_ms)[:max_requests]
    if not ordered:
        raise TraceError("the workload has no requests")
    origin = ordered[0].arrival_ms
    window_ms = (ordered[-1].arrival_ms - origin) / rate_scale
    if not window_ms <= MAX_ARRIVAL_MS:  # inf too
        raise TraceError(
            f"the {len(ordered)} requests' arrivals span {window_ms:.3g} ms at rate_scale {rate_scale:g}, more than "
            f"the {MAX_ARRIVAL_MS:,} ms (about 3 years) a simulated clock keeps precise: a larger rate scale"
        )
    return [
        WorkloadRequest(
            (r.arrival_ms - origin) / rate_scale, r.input_tokens, r.output_tokens, r.segments, r.segment_tokens
        )
        for r in ordered
    ]


def spread_steps(requests: list[WorkloadRequest], seed: int = 0) -> list[WorkloadRequest]:
    """Spread requests that share a timestamp over the trace's timestamp step, in their order.

    Some traces record arrivals in coarse steps (Mooncake's come every 3 s, about ten at a time); replayed as
    they are, every step is a same-instant burst. The step is the median gap between distinct timestamps; the
    k-th of n requests stamped t arrives at t + step · (k + u) / n with u uniform in [0, 1) (seeded): as many
    arrivals per step as recorded, evenly but not regularly spaced. A trace without repeated timestamps is
    returned as it is.

    >>> reqs = [WorkloadRequest(t, 10, 1) for t in (0.0, 0.0, 0.0, 0.0, 3000.0, 6000.0)]
    >>> [round(r.arrival_ms) for r in spread_steps(reqs)]
    [633, 1318, 1815, 2444, 3000, 6000]
    """
    ordered = sorted(requests, key=lambda r: r.arrival_ms)
    stamps = sorted({r.arrival_ms for r in ordered})
    if len(stamps) == len(ordered) or len(stamps) < 2:
        return ordered
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    step = gaps[len(gaps) // 2]
    rng = random.Random(seed)
    out: list[WorkloadRequest] = []
    i = 0
    while i < len(ordered):
        j = i
        while j < len(ordered) and ordered[j].arrival_ms == ordered[i].arrival_ms:
            j += 1
        n = j - i
        for k, r in enumerate(ordered[i:j]):
            at = r.arrival_ms + step * (k + rng.random()) / n if n > 1 else r.arrival_ms
            out.append(WorkloadRequest(at, r.input_tokens, r.output_tokens, r.segments, r.segment_tokens))
        i = j
    return sorted(out, key=lambda r: r.arrival_ms)


@dataclass(frozen=True)
class SyntheticSpec:
    """Synthetic traffic.

    Parameters
    ----------
    rate_rps
        Mean arrival rate.
    burstiness
        1 = Poisson; > 1 = gamma inter-arrivals with that squared coefficient of variation (bursty).
    input_mean, output_mean
        Means of log-normal input and output lengths.
    prefix_groups, prefix_tokens, prefix_share
        `prefix_share` of the requests start with one of `prefix_groups` shared prefixes of `prefix_tokens`.
    """

    requests: int = 1000
    rate_rps: float = 10.0
    burstiness: float = 1.0
    input_mean: int = 2000
    output_mean: int = 200
    prefix_groups: int = 8
    prefix_tokens: int = 1024
    prefix_share: float = 0.5
    segment_tokens: int = MOONCAKE_SEGMENT_TOKENS


def _check_size(spec: SyntheticSpec) -> None:
    """TraceError naming the parameters when the workload would build more than `MAX_SYNTHETIC_SEGMENTS` prompt
    segments (each bounded, their product was not: input_mean=1e6 with segment_tokens=1 for a million requests);
    checked on the requests replayed, after --max-requests."""
    prompt = max(spec.input_mean, spec.prefix_tokens + 1) // spec.segment_tokens + 1
    if spec.requests * prompt > MAX_SYNTHETIC_SEGMENTS:
        raise TraceError(
            f"synthetic workload: requests × (input_mean or prefix_tokens) / segment_tokens must be at most "
            f"{MAX_SYNTHETIC_SEGMENTS:,} prompt segments, got about {spec.requests * prompt:.3g}: fewer requests, "
            "shorter prompts or longer segments"
        )
    shared = spec.prefix_groups * (spec.prefix_tokens // spec.segment_tokens)
    if shared > MAX_SYNTHETIC_SEGMENTS:
        raise TraceError(
            f"synthetic workload: prefix_groups × prefix_tokens / segment_tokens must be at most "
            f"{MAX_SYNTHETIC_SEGMENTS:,} prompt segments, got {shared:.3g}: fewer groups, shorter prefixes or longer "
            "segments"
        )


def _check_rate(spec: SyntheticSpec) -> None:
    """TraceError naming `rate_rps` when the requests' mean arrival window would pass `MAX_ARRIVAL_MS` (checked on
    the requests replayed, after --max-requests; a draw past it all the same is refused by `shape`)."""
    least = spec.requests * 1e3 / MAX_ARRIVAL_MS
    if spec.rate_rps < least:
        raise TraceError(
            f"synthetic workload: rate_rps must be at least {least:.3g} for {spec.requests} requests, got "
            f"{spec.rate_rps:g}: their arrivals would span more than {MAX_ARRIVAL_MS:,} ms (about 3 years)"
        )


def synthetic(spec: SyntheticSpec, seed: int = 0) -> list[WorkloadRequest]:
    """A synthetic workload: bursty (gamma) arrivals and prompts sharing prefixes as `spec` says."""
    _check_size(spec)
    _check_rate(spec)
    rng = random.Random(seed)
    out: list[WorkloadRequest] = []
    clock = 0.0
    shape_k = 1.0 / spec.burstiness
    next_id = 0
    group_ids = [
        [f"g{g}-{i}" for i in range(spec.prefix_tokens // spec.segment_tokens)] for g in range(spec.prefix_groups)
    ]
    for _ in range(spec.requests):
        clock += rng.gammavariate(shape_k, 1.0 / (spec.rate_rps * shape_k)) * 1e3
        inp = max(1, int(rng.lognormvariate(0, 0.6) * spec.input_mean / 1.197))
        out_len = max(1, int(rng.lognormvariate(0, 0.6) * spec.output_mean / 1.197))
        ids: list[object] = []
        if spec.prefix_groups and rng.random() < spec.prefix_share:
            ids.extend(rng.choice(group_ids))
            inp = max(inp, spec.prefix_tokens + 1)
        while len(ids) * spec.segment_tokens < inp:
            ids.append(next_id)
            next_id += 1
        out.append(WorkloadRequest(clock, inp, out_len, tuple(chain_block_ids(ids)), spec.segment_tokens))
    return out


def parse_synthetic(text: str) -> SyntheticSpec:
    """`synthetic:rate_rps=20,requests=2000,burstiness=4,...` → SyntheticSpec (fields as in SyntheticSpec); a
    TraceError names the parameter out of its range (`SYNTHETIC_RANGES`) or given twice."""
    _, _, params = text.partition(":")
    fields = SyntheticSpec.__dataclass_fields__
    values: dict[str, float | int] = {}
    for item in filter(None, params.split(",")):
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            known = ", ".join(fields)
            raise TraceError(f"synthetic workload: bad parameter {item!r} (known: {known})")
        if name in values:  # the last one silently won
            raise TraceError(f"synthetic workload: {name} is given twice")
        try:
            value = float(raw)
        except ValueError:
            raise TraceError(f"synthetic workload: {name} must be a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise TraceError(f"synthetic workload: {name} must be a finite number, got {raw!r}")
        if fields[name].type == "int":
            if value != int(value):  # 2.7 requests would silently become 2
                raise TraceError(f"synthetic workload: {name} must be an integer, got {raw!r}")
            least, most, unit = SYNTHETIC_RANGES[name]
            if value < least:
                raise TraceError(f"synthetic workload: {name} must be ≥ {least}, got {value:g}")
            if value > most:
                raise TraceError(f"synthetic workload: {name} must be at most {most:,}{unit}, got {value:g}")
            values[name] = int(value)
        else:
            values[name] = value
    spec = SyntheticSpec(**values)  # type: ignore[arg-type]
    if spec.rate_rps <= 0 or spec.burstiness <= 0:
        raise TraceError("synthetic workload: rate_rps and burstiness must be > 0")
    if not 0 <= spec.prefix_share <= 1:
        raise TraceError("synthetic workload: prefix_share must be in [0, 1]")
    return spec


def load_workload(source: str, seed: int = 0, limit: int | None = None) -> list[WorkloadRequest]:
    """A shipped trace's name (`mooncake`, `azure-conv`), a trace path, or `synthetic:key=value,...`; with `limit`,
    its `limit` earliest arrivals."""
    if source == "synthetic" or source.startswith("synthetic:"):
        spec = parse_synthetic(source)
        if limit is not None:
            spec = SyntheticSpec(**{**spec.__dict__, "requests": min(spec.requests, limit)})
        return synthetic(spec, seed)
    try:
        path = resolve(source, TRACES, "a Mooncake .jsonl or Azure .csv trace, or synthetic:key=value,...")
    except DataFileError as err:
        raise TraceError(str(err)) from None
    return read_trace(path, limit)
