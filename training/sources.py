"""Sample sources of the retraining job: JSONL and Parquet files and the service's Redis observation stream.

JSONL files may be gzip-compressed: read as they are (known by their first bytes, not their name). Other
compressions are refused in one line, rather than as every row "not JSON".

Every source yields training entries in the one shape the service accepts: an llm-d training row (llm-d's own
rows, the simulator's observation log), optionally with Leadtime's extras (the native observation schema, and
what the service appends to its stream). They are checked and vectorized by the service's own parser
(`RowParser.parse_observations`, which vectorizes with `features/`), so a row means to the job exactly what it
meant to the service that learned it online.

A row that cannot be used is *malformed*: not JSON, not an object, a field the parser refuses, a timestamp that
is not one, neither target observed, or a latency the service's poisoning guard drops (`physics.implausible`).
Each is recorded with its source and where in it (line, row or stream entry id), counted per source, and left
out; a source whose malformed share exceeds the configured bound stops the job (`SampleError`), because that is
more likely the wrong file than a few bad rows.

Keys a row carries that the parser does not read are not malformed (llm-d's rows and the simulator's log carry
fields of their own), but they are counted per source (`unread.py`): a misspelt optional field is one of them.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import numpy as np

from leadtime.data import MEASURED, DataFileError, resolve
from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.errors import FeatureError
from leadtime.features.rows import parse_timestamp
from leadtime.features.vectorize import FeatureBatch
from leadtime.predictor import physics
from leadtime.predictor.service.rows import RowParser
from leadtime.predictor.store.base import cursor_order
from leadtime.predictor.store.redis_store import split_query
from leadtime.predictor.store.stream_identity import StreamIdentity, without_credentials
from leadtime.training.limits import MALFORMED_SHARE
from leadtime.training.unread import KeySets

REDIS_SCHEMES = ("redis", "rediss", "unix")
SCHEMES_TEXT = (
    ", ".join(f"{scheme}://" for scheme in REDIS_SCHEMES[:-1]) + f" or {REDIS_SCHEMES[-1]}://"
)  # as error messages list them
PARQUET_SUFFIXES = (".parquet", ".pq")
DEFAULT_NAMESPACE = "leadtime"  # the service's (RedisStore's default)
_CHUNK = 4096  # entries parsed per call of the service's parser
_ENTRY = "entry "  # where a stream's row is, before its entry id: "entry 1700000000000-0"
IMPLAUSIBLE = (
    f"implausible: a TTFT or TPOT over {physics.IMPLAUSIBLY_FAST:g}x below the hardware's roofline floor, or above "
    f"{physics.IMPLAUSIBLY_SLOW_MS / 3.6e6:g} hours (the service's poisoning guard drops it too)"
)
_LISTED = 10_000  # malformed rows listed one by one in the report (all are counted)
GZIP_MAGIC = b"\x1f\x8b"  # a JSONL file starting so is read through gzip, whatever its name
# Other compressions, known by their first bytes: refused in one line, not each of their rows as "not JSON".
OTHER_COMPRESSIONS = {b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip"}


class SampleError(ValueError):
    """A source cannot be read, holds no usable row, or too large a share of malformed rows (one line)."""


@dataclass(frozen=True)
class Malformed:
    """One row left out: its source, where in it (``line 12``, ``row 3``, ``entry 1700000000000-0``) and why."""

    source: str
    where: str
    problem: str


@dataclass
class SourceSummary:
    """What one source gave: rows read, rows used, rows malformed."""

    name: str
    kind: str  # jsonl | parquet | redis
    read: int = 0
    used: int = 0
    malformed: int = 0
    cursor: str | None = None  # a Redis stream's last entry id read
    stream: StreamIdentity | None = None  # which Redis stream it is
    unread: dict[str, int] = field(default_factory=dict)  # keys no field was read from, with the rows that had each

    @property
    def malformed_share(self) -> float:
        """Malformed rows over rows read (0 for an empty source)."""
        return self.malformed / self.read if self.read else 0.0


@dataclass
class Samples:
    """Every usable row of every source, in read order (sources in the order given).

    `timestamps` is NaN for a row without one; `source` is each row's index into `sources`; `entries` each row's
    Redis stream entry id as (milliseconds, sequence), which orders as the stream does (`cursor_order`), and
    (-1, -1) for a file's row: a model's recorded position in a stream says which of its rows that model learned.
    """

    batch: FeatureBatch
    actual_ttft_ms: np.ndarray
    actual_tpot_ms: np.ndarray
    timestamps: np.ndarray
    source: np.ndarray
    sources: list[SourceSummary]
    malformed: list[Malformed] = field(default_factory=list)  # the first `_LISTED`
    entries: np.ndarray = field(default_factory=lambda: np.empty((0, 2), dtype=np.int64))

    def __len__(self) -> int:
        return len(self.actual_ttft_ms)

    @property
    def malformed_total(self) -> int:
        """Malformed rows over all sources."""
        return sum(s.malformed for s in self.sources)


@dataclass(frozen=True)
class RedisSource:
    """A Redis stream named by a URL: ``redis://host:port/db[?namespace=NAME]`` reads ``NAME:observations``."""

    url: str  # without the namespace parameter (what redis-py takes)
    namespace: str

    @classmethod
    def parse(cls, spec: str) -> RedisSource:
        """Split the job's own `namespace` query parameter off a Redis URL (its query begins after the password:
        one holding '?' is not cut there, and the store's client then asks for it percent-encoded).

        >>> RedisSource.parse("redis://127.0.0.1:6379/0?namespace=fleet-a")
        RedisSource(url='redis://127.0.0.1:6379/0', namespace='fleet-a')
        >>> RedisSource.parse("unix:///run/redis.sock?db=2")
        RedisSource(url='unix:///run/redis.sock?db=2', namespace='leadtime')
        """
        base, query_text = split_query(spec)  # as written: urlunsplit would make unix:///s unix:/s
        query = parse_qsl(query_text, keep_blank_values=True)
        names = [v for k, v in query if k == "namespace"]
        rest = [(k, v) for k, v in query if k != "namespace"]
        namespace = names[-1] if names else DEFAULT_NAMESPACE
        if not namespace:
            raise SampleError(f"{shown(spec)}: namespace must not be empty")
        return cls(f"{base}?{urlencode(rest)}" if rest else base, namespace)

    @property
    def name(self) -> str:
        """The URL as `shown`, with the namespace: how reports, the artifact and the job's output name it."""
        return f"{shown(self.url)} ({self.namespace})"

    @property
    def stream(self) -> StreamIdentity:
        """Which observation stream it is, however the URL is spelt."""
        return StreamIdentity.of(self.url, self.namespace)


def shown(spec: str) -> str:
    """A source or registry as the job names it to people (its errors, its report, the artifact it publishes,
    which any client of a service can download): a URL without its credentials, in its user part or its query
    (`without_credentials`), a path as given. Every place that names one goes through here, so that a way of giving
    a password that one of them does not know of cannot leak it there.

    >>> shown("unix:///run/redis.sock?password=secret"), shown("http://:secret@host/0"), shown("rows@2024.jsonl")
    ('unix:///run/redis.sock', 'http://host/0', 'rows@2024.jsonl')
    """
    return without_credentials(spec) if "://" in spec else spec


def is_redis_url(spec: str) -> bool:
    """Whether a source or registry names a Redis server rather than a path (schemes are case-insensitive).

    >>> is_redis_url("REDIS://127.0.0.1:6379/0"), is_redis_url("unix:///run/redis.sock"), is_redis_url("rows.jsonl")
    (True, True, False)
    """
    return spec.split("://", 1)[0].lower() in REDIS_SCHEMES and "://" in spec


# An entry as read: its position in the source (for the report) and the decoded value, or why it is unusable.
_Read = tuple[str, Any, str | None]
# An entry waiting for the parser: its index in the source, position, value and timestamp.
_Pending = tuple[int, str, Mapping[str, Any], float]


def _jsonl_entries(path: Path, name: str, gzipped: bool) -> Iterator[_Read]:
    """Every non-blank line; a gzip file's lines as decompressed (archived logs usually are)."""
    try:
        with gzip.open(path, "rb") if gzipped else path.open("rb") as handle:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"line {lineno}"
                try:
                    yield where, json.loads(line), None
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
                    yield where, None, f"not JSON ({getattr(err, 'msg', type(err).__name__)})"
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # cut short or damaged
        raise SampleError(f"{name}: a gzip file that cannot be read ({err})") from None


def _compression(path: Path) -> str | None:
    """The file's compression ("gzip", another's name, or None), from its first bytes: a name can mislead."""
    with path.open("rb") as handle:
        head = handle.read(6)
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    return next((name for magic, name in OTHER_COMPRESSIONS.items() if head.startswith(magic)), None)


def _parquet_entries(path: Path) -> Iterator[_Read]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SampleError(f"{path}: reading Parquet needs pyarrow (pip install 'leadtime[retrain]')") from None
    try:
        handle = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise SampleError(f"{path}: not a Parquet file ({' '.join(str(err).split())[:200]})") from None
    row = 0
    with handle:
        for record_batch in handle.iter_batches(batch_size=_CHUNK):
            for values, problem in _batch_rows(record_batch):
                row += 1
                if problem is not None:
                    yield f"row {row}", None, problem
                    continue
                # A null in a column is a field the row does not have (a column that only some rows fill).
                yield f"row {row}", {k: v for k, v in values.items() if v is not None}, None


# What pyarrow raises for a value Python cannot hold (a timestamp past the year 9999 is an OverflowError).
_UNCONVERTIBLE = (OverflowError, ValueError)


def _batch_rows(record_batch: Any) -> list[tuple[dict[str, Any], str | None]]:
    """A Parquet batch's rows as Python values, each with why it cannot be used (or None).

    The batch is converted at once. Arrow holds values Python cannot (a timestamp in the year 10000): one such
    value made the whole batch fail, and the job stop with a traceback. Only a batch that fails is converted
    again, column by column and the failing column value by value, so that just the rows holding such a value are
    left out, each naming its column; a large file of good rows costs what it did.
    """
    try:
        return [(values, None) for values in record_batch.to_pylist()]
    except _UNCONVERTIBLE:
        pass
    columns: dict[str, list[Any]] = {}
    problems: dict[int, str] = {}
    for name, column in zip(record_batch.schema.names, record_batch.columns, strict=True):
        try:
            columns[name] = column.to_pylist()
            continue
        except _UNCONVERTIBLE:
            pass
        values: list[Any] = []
        for index in range(len(column)):
            try:
                values.append(column[index].as_py())
            except _UNCONVERTIBLE as err:
                values.append(None)
                problems.setdefault(index, f"{name}: cannot be read ({err})")
        columns[name] = values
    return [
        ({name: values[index] for name, values in columns.items()}, problems.get(index))
        for index in range(record_batch.num_rows)
    ]


def _redis_entries(source: RedisSource, summary: SourceSummary) -> Iterator[_Read]:
    import redis

    from leadtime.predictor.store.redis_store import ENTRY_FIELD, observation_stream_key, redis_client, redis_problem

    try:
        client = redis_client(source.url, socket_timeout=10.0, socket_connect_timeout=5.0)
    except ValueError as err:
        raise SampleError(f"{source.name}: not a usable Redis URL ({err})") from None
    key = observation_stream_key(source.namespace)
    summary.stream = source.stream
    field_name = ENTRY_FIELD.encode()
    last = "-"
    try:
        while True:
            low = last if last == "-" else f"({last}"
            messages: Any = client.xrange(key, min=low, max="+", count=_CHUNK)
            if not messages:
                break
            for message_id, fields in messages:
                last = message_id.decode()
                summary.cursor = last
                where = f"{_ENTRY}{last}"
                raw = fields.get(field_name)
                if raw is None:
                    yield where, None, f"no {ENTRY_FIELD!r} field (not a Leadtime observation message)"
                    continue
                try:
                    yield where, json.loads(raw), None
                except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
                    yield where, None, f"not JSON ({getattr(err, 'msg', type(err).__name__)})"
    except redis.RedisError as err:
        raise SampleError(f"{source.name}: cannot read the observation stream ({redis_problem(err)})") from None
    finally:
        client.close()


def _timestamp(entry: Mapping[str, Any]) -> float:
    value = entry.get("timestamp")
    return math.nan if value is None else parse_timestamp(value)


class SampleReader:
    """Reads sources into `Samples` with the service's parser, counting malformed rows per source.

    Parameters
    ----------
    accelerator, model
        The class of rows that name none (llm-d rows never do): the serving model's defaults.
    max_malformed_share
        Largest share of a source's rows that may be malformed; beyond it the job stops.
    catalog
        The classes and models rows may name.
    """

    def __init__(
        self, accelerator: str, model: str, max_malformed_share: float = 0.01, catalog: Catalog = BUILT_IN
    ) -> None:
        MALFORMED_SHARE.check("max_malformed_share", max_malformed_share)
        self.parser = RowParser(accelerator, model, catalog)
        self.max_malformed_share = max_malformed_share

    def read(self, specs: Sequence[str], progress: Callable[[str, int], None] | None = None) -> Samples:
        """Every source in order; `progress(source name, rows read so far)` is called as rows come in."""
        if not specs:
            raise SampleError("no sample source given")
        batches: list[FeatureBatch] = []
        ttft: list[np.ndarray] = []
        tpot: list[np.ndarray] = []
        stamps: list[np.ndarray] = []
        entry_ids: list[np.ndarray] = []
        origin: list[np.ndarray] = []
        summaries: list[SourceSummary] = []
        malformed: list[Malformed] = []
        for index, spec in enumerate(specs):
            summary, entries = self._open(spec)
            summaries.append(summary)
            pending: list[_Pending] = []
            bad: list[tuple[int, Malformed]] = []  # (position in the source, row), put in source order below
            key_sets = KeySets()
            for where, entry, problem in entries:
                summary.read += 1
                if problem is None:
                    problem, stamp = self._precheck(entry)
                    if problem is None:
                        key_sets.add(entry)
                        pending.append((summary.read, where, entry, stamp))
                if problem is not None:
                    bad.append((summary.read, Malformed(summary.name, where, problem)))
                if len(pending) >= _CHUNK:
                    self._parse(pending, summary, bad, batches, ttft, tpot, stamps, entry_ids)
                    pending = []
                    if progress is not None:
                        progress(summary.name, summary.read)
            self._parse(pending, summary, bad, batches, ttft, tpot, stamps, entry_ids)
            if progress is not None:
                progress(summary.name, summary.read)
            summary.malformed = len(bad)
            summary.unread = key_sets.unread()
            bad.sort(key=lambda item: item[0])
            malformed.extend(row for _, row in bad[: max(0, _LISTED - len(malformed))])
            origin.append(np.full(summary.used, index, dtype=np.intp))
            if summary.read == 0:
                raise SampleError(f"{summary.name}: holds no rows")
            if summary.malformed_share > self.max_malformed_share:
                raise SampleError(
                    f"{summary.name}: {summary.malformed} of {summary.read} rows are malformed "
                    f"({summary.malformed_share:.1%} > the {self.max_malformed_share:.1%} allowed; first: "
                    f"{_first_problem(malformed, summary.name)})"
                )
        if not batches:
            raise SampleError("the sources hold no usable row")
        return Samples(
            FeatureBatch.concat(batches),
            np.concatenate(ttft),
            np.concatenate(tpot),
            np.concatenate(stamps),
            np.concatenate(origin),
            summaries,
            malformed,
            np.concatenate(entry_ids),
        )

    def _open(self, spec: str) -> tuple[SourceSummary, Iterator[_Read]]:
        if is_redis_url(spec):
            source = RedisSource.parse(spec)
            summary = SourceSummary(source.name, "redis")
            return summary, _redis_entries(source, summary)
        if "://" in spec:  # read as a path it was "no such file", the URL shown as given, password and all
            raise SampleError(f"{shown(spec)}: not a source (a JSONL or Parquet file, or a {SCHEMES_TEXT} URL)")
        try:
            path = resolve(spec, MEASURED, "a JSONL or Parquet file of observations, or a redis:// URL")
        except DataFileError as err:
            raise SampleError(str(err)) from None
        if path.suffix.lower() in PARQUET_SUFFIXES:
            return SourceSummary(spec, "parquet"), _parquet_entries(path)
        if path.suffix.lower() in (".csv", ".tsv"):  # read as JSONL it was "line 1: not JSON"
            raise SampleError(f"{spec}: a {path.suffix[1:].upper()} file; sources are JSONL or Parquet (or redis://)")
        compression = _compression(path)
        if compression not in (None, "gzip"):
            raise SampleError(f"{spec}: compressed with {compression}, which is not read (decompress it, or gzip it)")
        return SourceSummary(spec, "jsonl"), _jsonl_entries(path, spec, gzipped=compression == "gzip")

    @staticmethod
    def _precheck(entry: Any) -> tuple[str | None, float]:
        """What the parser does not look at: the entry is an object, its timestamp reads, a target observed."""
        if not isinstance(entry, dict):
            return f"must be a JSON object, got {type(entry).__name__}", math.nan
        try:
            stamp = _timestamp(entry)
        except FeatureError as err:
            return str(err), math.nan
        ttft, tpot = entry.get("actual_ttft_ms"), entry.get("actual_tpot_ms")
        if ttft == 0 and tpot == 0 and not isinstance(ttft, bool) and not isinstance(tpot, bool):
            return "observes neither target (actual_ttft_ms and actual_tpot_ms are both 0)", stamp
        return None, stamp

    def _parse(
        self,
        pending: list[_Pending],
        summary: SourceSummary,
        bad: list[tuple[int, Malformed]],
        batches: list[FeatureBatch],
        ttft: list[np.ndarray],
        tpot: list[np.ndarray],
        stamps: list[np.ndarray],
        entry_ids: list[np.ndarray],
    ) -> None:
        """A chunk at once; a chunk the parser refuses is parsed entry by entry, so each bad one is named."""
        if not pending:
            return
        entries = [entry for _, _, entry, _ in pending]
        try:
            parsed = [self.parser.parse_observations(entries)]
            kept = pending
        except FeatureError:
            parsed, kept = [], []
            for item in pending:
                position, where, entry, _ = item
                try:
                    parsed.append(self.parser.parse_observations([entry], where="entry"))
                    kept.append(item)
                except FeatureError as err:
                    bad.append((position, Malformed(summary.name, where, str(err).removeprefix("entry[0]."))))
        if not parsed:
            return
        rows = FeatureBatch.concat([part.rows for part in parsed]) if len(parsed) > 1 else parsed[0].rows
        actual_ttft = np.concatenate([part.actual_ttft_ms for part in parsed])
        actual_tpot = np.concatenate([part.actual_tpot_ms for part in parsed])
        # The service's poisoning guard: what it would drop, the job does not train on either.
        implausible = physics.implausible(rows.X, actual_ttft, actual_tpot)
        if implausible.any():
            for (position, where, _, _), dropped in zip(kept, implausible, strict=True):
                if dropped:
                    bad.append((position, Malformed(summary.name, where, IMPLAUSIBLE)))
            keep = ~implausible
            rows, actual_ttft, actual_tpot = rows[keep], actual_ttft[keep], actual_tpot[keep]
            kept = [item for item, dropped in zip(kept, implausible, strict=True) if not dropped]
        batches.append(rows)
        ttft.append(actual_ttft)
        tpot.append(actual_tpot)
        stamps.append(np.array([stamp for _, _, _, stamp in kept], dtype=np.float64))
        ids = [
            cursor_order(where.removeprefix(_ENTRY)) if summary.kind == "redis" else (-1, -1) for _, where, _, _ in kept
        ]
        entry_ids.append(np.array(ids, dtype=np.int64).reshape(-1, 2))
        summary.used += len(kept)


def _first_problem(malformed: list[Malformed], source: str) -> str:
    for item in malformed:
        if item.source == source:
            return f"{item.where}: {item.problem}"
    return "not listed"
