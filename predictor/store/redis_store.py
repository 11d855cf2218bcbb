"""The store that lets several predictor replicas share what they learn, backed by a real Redis server.

- Observations go to one Redis stream. Every replica reads the whole stream from its own cursor (a range read
  after the last id it saw, no consumer groups): each replica must learn every observation, not share them out.
- Accepting an observation never touches the network: `append_observations` queues it in memory and one writer
  thread sends the queue to Redis in order. While Redis is down, or full (at its maxmemory it refuses writes and
  still answers reads), the queue is the outage buffer (bounded, drops counted); the writer keeps retrying and
  empties it, oldest first, once Redis takes writes again.
- What Redis took is kept in memory until this store has read it back from the stream (a replica reads what it
  writes) or reads on from past it: a Redis without persistence that crashes loses what no one had read yet.
  When the writer finds Redis restarted (another `run_id`), it sends again those entries that the new server's
  stream no longer holds (counted in `stats()["resent"]`); with `appendonly yes` that is nothing, or the last
  writes the file had not synced. Another replica that had read them before the crash learns them twice: a
  duplicate rather than a loss.
- Models go to a versioned registry: the artifact under `<ns>:model:<version>`, an INCR'd counter, the last
  few versions kept, a pub/sub message on every publication. Only JSON artifacts (LightGBM text inside JSON)
  are accepted, so nothing fetched from Redis can run code when loaded.
- One replica retrains at a time: a lease key set with NX and a TTL that only its holder may renew. A holder's
  publication is refused in the same atomic step once the key no longer names it (a replica paused past the TTL
  does not publish over the new holder's model).

Read paths (`read_observations`, `latest_model`, `wait_for_model`) answer "nothing new" while Redis is down, so
a replica keeps serving with the model it has; `health()` says why. `acquire_training_lease` raises
StoreUnavailable then: "not granted" would say that another replica holds the lease.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from leadtime.predictor.artifact import decode
from leadtime.predictor.store.base import LeaseLost, StoreClosed, cursor_order
from leadtime.predictor.store.spill import SPILL_MARK_TTL_S, Spill, read_spills, remove_spill, write_spill
from leadtime.predictor.store.stream_identity import (  # the gateway, the CLI and the job import these from here
    StreamIdentity,
    observation_stream_key,
    split_credentials,
    without_credentials,
)

# Refuse, before anything is written, a stream key that holds something else (a string left by another program):
# a Lua error is not rolled back, so the scripts must fail before their first write, and with a reply that names
# the key rather than Redis's bare WRONGTYPE.
_STREAM_TYPE_CHECK = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'stream' and kind ~= 'none' then
  return redis.error_reply('WRONGTYPE the key ' .. KEYS[1] .. ' holds a ' .. kind .. ', not a stream of observations')
end
"""

# A whole chunk of observations in one atomic step, exactly once: it lands whole or not at all, and a chunk
# resent after its reply was lost (a timeout while the server still ran it) finds its id already marked and is
# skipped. The mark is set last: a script that fails half-way leaves no mark, so its retry is sent, not skipped
# (the rows would be lost). The mark expires after `_CHUNK_MARK_TTL_S`; a resend comes seconds after the server
# answers again. One script call is also ~3x faster than pipelined XADDs.
_APPEND_SCRIPT = (
    """
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
"""
    + _STREAM_TYPE_CHECK
    + """
local maxlen = ARGV[1]
local id = 0
for i = 3, #ARGV do
  id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', 'e', ARGV[i])
end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])
return id
"""
)

# Entries after a cursor as one flat array (token, id, entry, id, entry, ...): far cheaper to decode client-side
# than XREAD's nested reply. The token (KEYS[2], set to ARGV[4] by the first read that finds none) names what the
# stream holds: a Redis that restarted without persistence, or was flushed, has lost it with the stream, and the
# first read of the new stream sees another token, in the same step as its first rows.
_READ_SCRIPT = (
    _STREAM_TYPE_CHECK
    + """
local token = redis.call('GET', KEYS[2])
if not token then
  token = ARGV[4]
  if redis.pcall('SET', KEYS[2], token)['err'] then token = '' end  -- a full Redis refuses it: no token yet
end
local messages = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], ARGV[3], 'COUNT', ARGV[2])
local out = {token}
for i, message in ipairs(messages) do
  out[2 * i] = message[1]
  local fields = message[2]
  out[2 * i + 1] = false  -- a message some other writer added without our field reads as nil
  for j = 1, #fields, 2 do
    if fields[j] == 'e' then out[2 * i + 1] = fields[j + 1] end
  end
end
return out
"""
)

# For each stream id in ARGV, whether the stream still holds it (1) or not (0): what a restarted server kept.
_HELD_SCRIPT = """
local held = {}
for i = 1, #ARGV do
  held[i] = #redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i], 'COUNT', 1)
end
return held
"""

# Every publish is one atomic step: a version number that never goes backwards (even after Redis lost its data
# in a restart, the publisher passes the highest version it has seen), the artifact, trimming, notification.
# A publisher that names itself as the training lease's holder (ARGV[6], '' for none) is refused, before anything
# is written, unless the lease key (KEYS[2]) holds it: {0, who holds it now or ''}. A restoration (ARGV[7], a
# version; '' for none) writes nothing if the registry holds that version or a newer one: {1, the newest held}.
_PUBLISH_SCRIPT = """
if ARGV[6] ~= '' then
  local current = redis.call('GET', KEYS[2])
  if current ~= ARGV[6] then return {0, current or ''} end
end
if ARGV[7] ~= '' then
  local newest = redis.call('GET', KEYS[1])
  if newest and tonumber(newest) >= tonumber(ARGV[7]) and redis.call('EXISTS', ARGV[3] .. newest) == 1 then
    return {1, newest}
  end
end
local version = redis.call('INCR', KEYS[1])
local floor = tonumber(ARGV[2])
if version <= floor then
  version = floor + 1
  redis.call('SET', KEYS[1], version)
end
redis.call('SET', ARGV[3] .. version, ARGV[1])
local keep = tonumber(ARGV[4])
if version > keep then
  redis.call('DEL', ARGV[3] .. (version - keep))
end
redis.call('PUBLISH', ARGV[5], version)
return version
"""

# The newest version and its artifact read together, so a concurrent publish cannot split them. With ARGV[2]
# 'version', the version alone (if its artifact is still there), without sending the artifact.
_LATEST_SCRIPT = """
local version = redis.call('GET', KEYS[1])
if not version then return nil end
if ARGV[2] == 'version' then
  if redis.call('EXISTS', ARGV[1] .. version) == 0 then return nil end
  return {version}
end
local artifact = redis.call('GET', ARGV[1] .. version)
if not artifact then return nil end
return {version, artifact}
"""

# Take the lease if it is free, or extend it if `holder` already has it; anyone else is refused.
_LEASE_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if current then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

_RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

log = logging.getLogger("leadtime.store")

_SEND_CHUNK = 1_000  # entries per round trip from the writer thread
_CHUNK_MARK_TTL_S = 600
_PING_EVERY_S = 0.5  # how stale the health answer may get while there is nothing to send
_RETRY_MIN_S = 0.05
_RETRY_MAX_S = 1.0
_POLL_EVERY_S = 0.25  # polling fallback for model notifications lost while the subscriber reconnects


# The field of each stream message that holds its entry's JSON (what _APPEND_SCRIPT writes and _READ_SCRIPT reads).
ENTRY_FIELD = "e"


class StoreUnavailable(ConnectionError):
    """Redis could not be reached for an operation that cannot be buffered (publishing a model)."""


class ArtifactRefused(ValueError):
    """The bytes offered to the registry are not a Leadtime JSON model artifact."""


def check_artifact(artifact: bytes) -> None:
    """Refuse anything but a Leadtime JSON artifact: a pickle (or any other format) never enters Redis."""
    if not isinstance(artifact, bytes | bytearray):
        raise ArtifactRefused(f"artifact must be bytes, got {type(artifact).__name__}")
    if artifact[:1] == b"\x80":
        raise ArtifactRefused("artifact looks like a Python pickle; only JSON artifacts are stored")
    try:
        decode(bytes(artifact))
    except ValueError as exc:
        raise ArtifactRefused(f"artifact refused: {exc}") from None


def _decode_entries(raw: list[bytes | None]) -> list[dict[str, Any]]:
    """All entries in one json.loads; if some message is not ours (not a JSON object), skip just that one."""
    if all(raw):
        try:
            decoded = json.loads(b"[" + b",".join(item for item in raw if item) + b"]")
            if all(isinstance(entry, dict) for entry in decoded):
                return list(decoded)
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass
    entries: list[dict[str, Any]] = []
    for item in raw:
        try:
            entry = json.loads(item) if item else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            entry = None
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def split_query(url: str) -> tuple[str, str]:
    """(the URL without its query, the query), the '?' looked for after the user part: a password holding '?' is
    not cut there (`redis_client` then asks for it percent-encoded, without showing it).

    >>> split_query("redis://:pa?ss@10.0.0.5:6379/0?namespace=a"), split_query("unix:///run/redis.sock?db=2")
    (('redis://:pa?ss@10.0.0.5:6379/0', 'namespace=a'), ('unix:///run/redis.sock', 'db=2'))
    """
    head, userinfo, tail = split_credentials(url)
    if not userinfo:
        base, _, query = url.partition("?")
        return base, query
    base, _, query = tail.partition("?")
    return f"{head}{userinfo}@{base}", query


# What Redis answers a client that gave no password where one is needed (RESP2's AUTH check, RESP3's HELLO).
_NO_PASSWORD_GIVEN = re.compile(r"NOAUTH|authentication required|HELLO must be called", re.IGNORECASE)
# What Redis answers the SELECT of a database it does not have (`databases`, 16 by default: /0 to /15).
_NO_SUCH_DATABASE = re.compile(r"DB index is out of range|invalid DB index", re.IGNORECASE)


class RedisRefused(ValueError):
    """Redis answered, and refuses what the URL asks of it for good: a wrong or missing password (or user), a
    database it does not have. No retry heals these, so a process refuses to start on them (one line naming the
    problem) rather than ride them out as an outage, buffering rows it can never send."""


def refuses_configuration(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing the URL's password, user or database (`RedisRefused`), not an outage."""
    if isinstance(exc, redis.AuthenticationError):
        return True
    return isinstance(exc, redis.ResponseError) and _NO_SUCH_DATABASE.search(str(exc)) is not None


def redis_problem(exc: BaseException, database: int | None = None) -> str:
    """One short line for health(), logs and messages (the store's, the gateway replicas', the retraining
    job's): a refused or missing password by name (redis-py reports both as a connection error, with RESP3's HELLO
    internals), a database the server lacks by its number (`database`, the URL's, when the caller knows it), a full
    server as "out of memory", "unreachable (...)" when the server cannot be reached, else "error (...)"."""
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0][:200]
    if isinstance(exc, redis.AuthenticationError):
        if _NO_PASSWORD_GIVEN.search(text):
            return "Redis needs a password (give it in the URL: redis://:PASSWORD@host:port/db)"
        return "Redis refused the password (or the user) given in the URL"
    if refuses_configuration(exc):
        which = "such database" if database is None else f"database {database}"
        return (
            f"Redis has no {which} (DB index is out of range: its `databases` setting, 16 by default, numbers "
            "them from /0)"
        )
    if isinstance(exc, redis.OutOfMemoryError):  # redis-py drops the "OOM" that names it
        return "out of memory (OOM: Redis refuses writes above its maxmemory; raise maxmemory or free memory)"
    kind = "unreachable" if isinstance(exc, redis.ConnectionError | redis.TimeoutError) else "error"
    return f"{kind} ({text})"


def _from_redis(exc: BaseException) -> str:
    """`redis_problem` after a colon in a longer message: "redis unreachable (...)", but "Redis refused the password"
    as it is (not "redis Redis refused ...")."""
    problem = redis_problem(exc)
    return problem if problem.startswith("Redis ") else f"redis {problem}"


# What each family of maxmemory-policy evicts when Redis is full; noeviction (refusing writes, which the store
# buffers and retries) is the only one that loses nothing.
_EVICTED_BY_POLICY = {
    "allkeys": "any key, the observation stream and the models too",
    "volatile": "keys with a TTL: the training lease, and the marks that keep a resent chunk of observations from "
    "landing twice",
}


def eviction_warning(policy: str) -> str | None:
    """What a server's `maxmemory-policy` would silently evict, or None for one that evicts nothing of ours.

    >>> eviction_warning("noeviction") is None
    True
    >>> print(eviction_warning("allkeys-lru"))  # doctest: +NORMALIZE_WHITESPACE
    maxmemory-policy allkeys-lru evicts any key, the observation stream and the models too, when Redis is full;
    Leadtime needs maxmemory-policy noeviction
    """
    evicted = _EVICTED_BY_POLICY.get(policy.partition("-")[0])
    if evicted is None:
        return None
    return f"maxmemory-policy {policy} evicts {evicted}, when Redis is full; Leadtime needs maxmemory-policy noeviction"


NOT_CONTACTED = "not contacted yet"


class LatestOutcome:
    """Whether Redis works, as told by the call that *started* last.

    Calls run on several threads (the writer, request handlers, the trainer) and their answers can come back out
    of order: a health check begun just before an outage may return after a handler's call has seen the outage.
    Ordering by start time keeps such a stale answer from hiding the outage (or a recovery) and from logging a
    transition twice. Not thread-safe by itself: the store records under its lock.

    >>> health = LatestOutcome("not contacted yet")
    >>> health.record(None, started=1.0)
    ('not contacted yet', None)
    >>> health.record("timeout", started=0.5) is None  # began before the success: stale
    True
    """

    def __init__(self, problem: str | None, contacted: bool = False) -> None:
        self.problem = problem  # None = Redis answered
        self.contacted = contacted  # False: the first outcome is reported even if it changes nothing
        self._started = float("-inf")

    def record(
        self, problem: str | None, started: float, notable: bool = False
    ) -> tuple[str | None, str | None] | None:
        """Take one call's outcome; (was, now) when the state changed or on the first outcome, else None (stale or
        the same). A `notable` problem (one no retry heals) is a change from any other problem too: after an
        outage, a refused password is news."""
        if started < self._started:
            return None
        self._started = started
        first, self.contacted = not self.contacted, True
        was, self.problem = self.problem, problem
        if (was is None) == (problem is None) and not first and not (notable and was != problem):
            return None
        return was, problem


def check_configuration(url: str, timeout_s: float = 2.0) -> None:
    """One PING to `url` (its form checked as `redis_client` does: ValueError): RedisRefused, naming the problem
    (never the password), if Redis answers and refuses the URL's password, user or database. Nothing if it answers,
    nor if it cannot be reached: an outage at start is ridden out as any other. For the processes that reach Redis
    through a client of their own (`leadtime route --replicas-redis`); the store checks as it starts."""
    client = redis_client(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except redis.RedisError as exc:
        if refuses_configuration(exc):
            raise RedisRefused(redis_problem(exc, StreamIdentity.of(url, "").db)) from None
    finally:
        client.close()


def redis_client(url: str, **options: Any) -> redis.Redis:
    """A client for `url`; ValueError naming what is wrong with it. The connection it describes is built here
    (not connected): redis-py passes a query parameter it does not know on to that constructor, whose TypeError
    would otherwise come at the first command.

    >>> redis_client("redis://127.0.0.1:6379/0?foo=bar")
    Traceback (most recent call last):
    ValueError: unknown parameter 'foo'
    >>> redis_client("redis://127.0.0.1:6379/zero")  # redis-py would take database 0 without a word
    Traceback (most recent call last):
    ValueError: the database must be a number (/0, /1, ...), got '/zero'
    >>> redis_client("redis://:Zx9/Secr#t@127.0.0.1:6379/0")  # and never repeats a part of the password
    Traceback (most recent call last):
    ValueError: the user or password holds '/', '?' or '#', which end it in a URL: percent-encode them (%2F, %3F, %23)
    """
    return _checked_client(redis.Redis.from_url, url, options)


def async_redis_client(url: str, **options: Any) -> aioredis.Redis:
    """`redis_client` for asyncio (the gateway's replicas): the same checks, the same messages."""
    return _checked_client(aioredis.Redis.from_url, url, options)


_Client = TypeVar("_Client", redis.Redis, aioredis.Redis)


def _checked_client(from_url: Callable[..., _Client], url: str, options: dict[str, Any]) -> _Client:
    """The client `from_url` makes of `url`, after the checks `redis_client` describes."""
    if any(delimiter in split_credentials(url)[1] for delimiter in "/?#"):
        raise ValueError(
            "the user or password holds '/', '?' or '#', which end it in a URL: percent-encode them (%2F, %3F, %23)"
        )
    parts = urlsplit(url)
    if parts.scheme in ("redis", "rediss") and parts.path.strip("/") and not parts.path.strip("/").isdigit():
        raise ValueError(f"the database must be a number (/0, /1, ...), got {parts.path[:40]!r}")
    try:
        client = from_url(url, **options)
    except ValueError as exc:
        raise ValueError(" ".join(str(exc).split())) from None
    pool = client.connection_pool
    try:
        pool.connection_class(**pool.connection_kwargs)
    except TypeError as exc:
        unknown = re.search(r"unexpected keyword argument '([^']*)'", str(exc))
        raise ValueError(f"unknown parameter {unknown[1]!r}" if unknown else str(exc)) from None
    return client


class RedisStore:
    """Shared observations, model registry and training lease in one Redis server.

    Parameters
    ----------
    url
        Redis URL, e.g. ``redis://127.0.0.1:6379/0``.
    namespace
        Prefix of every key and channel, so several fleets (or tests) can share one server.
    buffer_limit
        Observations held in memory while Redis is unreachable; beyond it new ones are dropped and counted.
    stream_maxlen
        Approximate bound on the observation stream (XADD MAXLEN ~); a replica lagging further loses the rest.
    keep_versions
        Published model versions kept in the registry.
    socket_timeout_s
        Bound on every Redis call, so an unreachable server costs at most this long before buffering starts.
    spill_dir
        A directory this replica owns (--model-dir): rows still buffered when the store closes are kept there rather
        than dropped, and rows kept there by an earlier stop are sent first (`leadtime.predictor.store.spill`).
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "leadtime",
        buffer_limit: int = 100_000,
        stream_maxlen: int = 1_000_000,
        keep_versions: int = 5,
        socket_timeout_s: float = 1.0,
        spill_dir: Path | None = None,
    ) -> None:
        if buffer_limit < 0:
            raise ValueError(f"buffer_limit must be >= 0, got {buffer_limit}")
        if stream_maxlen < 1:
            raise ValueError(f"stream_maxlen must be >= 1, got {stream_maxlen}")
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.address = without_credentials(url)  # for logs and status pages
        self.namespace = namespace
        self.buffer_limit = buffer_limit
        self.stream_maxlen = stream_maxlen
        self.keep_versions = keep_versions
        self._socket_timeout_s = socket_timeout_s
        self._stream_key = observation_stream_key(namespace)
        self._chunk_prefix = f"{namespace}:observations:chunk:"
        self._token_key = f"{namespace}:observations:token"
        self._version_key = f"{namespace}:model:version"
        self._model_prefix = f"{namespace}:model:"
        self._channel = f"{namespace}:model:published"
        self._lease_key = f"{namespace}:lease:training"
        try:
            self._redis = redis_client(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
            stream = StreamIdentity.of(url, namespace)
        except ValueError as exc:
            raise ValueError(f"redis URL {self.address!r} is not usable: {exc}") from None
        # Its ids are times: a position in it stays one across restarts (and a stream that restarted empty takes
        # ids after it), so a model saved with one goes on from there, whichever spelling of the URL names it.
        self.stream: StreamIdentity | None = stream
        self.stream_name: str | None = stream.name  # what models record: one name for every spelling
        self._append = self._redis.register_script(_APPEND_SCRIPT)
        self._read = self._redis.register_script(_READ_SCRIPT)
        self._held = self._redis.register_script(_HELD_SCRIPT)
        self._publish = self._redis.register_script(_PUBLISH_SCRIPT)
        self._latest = self._redis.register_script(_LATEST_SCRIPT)
        self._lease = self._redis.register_script(_LEASE_SCRIPT)
        self._release = self._redis.register_script(_RELEASE_SCRIPT)

        self._lock = threading.Lock()
        self._closed = False  # close() has begun: appends are refused (the writer sends what it holds, then stops)
        self._buffer: deque[bytes] = deque()
        # The writer's chunk from the head of the buffer not taken yet, (its id, its rows): a send that timed out
        # may have landed, so rows kept at close are sent again under that id (`write_spill`'s `head`).
        self._in_flight: tuple[str, int] | None = None
        self._dropped = 0
        self._full_warned = False  # that the buffer is full and rows are dropped was logged (once until emptied)
        self._appended = 0
        self._resent = 0
        self._resent_pending = 0
        # Chunks Redis took that this store has not read back yet: (last stream id, entries), oldest first; at
        # most buffer_limit entries are remembered (beyond, the oldest are forgotten: a reader that far behind).
        self._unread: deque[tuple[tuple[int, int], list[bytes]]] = deque()
        self._unread_count = 0
        self._run_id: str | None = None
        self._restarts = 0  # times the server came back as another one (its models gone too, without persistence)
        self._read_upto = (0, 0)  # the newest stream id this store has read
        # The stream's token at the last read (`_READ_SCRIPT`), and how often a read found another one: the stream
        # lost what it held (`stream_losses`).
        self._stream_token: bytes | None = None
        self._stream_losses = 0
        # A read found the stream lost (flushed, or a restart the writer may not have seen yet): until the writer has
        # looked at what of `_unread` the stream still holds, no read confirms any of it (the new stream's rows come
        # after the lost ones).
        self._stream_lost = False
        self._check_run_id = True
        self._health = LatestOutcome(NOT_CONTACTED)
        # Whether the observation stream itself works: a server that answers may still refuse it (its key holds
        # something else, or it is full and refuses writes while reads work), and only the calls on the stream can
        # tell that or its end. Reads and writes are told apart: a read that works does not end refused writes.
        self._stream_reads = LatestOutcome(None, contacted=True)
        self._stream_writes = LatestOutcome(None, contacted=True)
        self._highest_version = 0
        self._wake_writer = threading.Event()
        self._version_seen = threading.Condition()
        self._stop = threading.Event()
        started = time.monotonic()
        try:  # know the truth from the start: health() answers before the writer's first round
            self._redis.ping()
            self._health.record(None, started)
        except redis.RedisError as exc:
            if refuses_configuration(exc):  # no retry heals it: refused here, in one line, before any thread runs
                self._redis.close()
                problem = redis_problem(exc, stream.db)
                raise RedisRefused(f"redis URL {self.address!r} is not usable: {problem}") from None
            self._set_problem(exc, started)
        # Rows an earlier stop kept in `spill_dir`, oldest file first: sent before anything accepted here.
        self._spill_dir = spill_dir
        self._spills: deque[Spill] = deque(read_spills(spill_dir) if spill_dir is not None else ())
        # Where each chunk of them landed: (the stream id of its last row, its rows), for `kept_after`.
        self._kept_landed: list[tuple[tuple[int, int], int]] = []
        if self._spills:
            log.info(
                "%d observations accepted before the last stop and kept in %s: sending them to redis first",
                sum(len(spill.rows) for spill in self._spills),
                spill_dir,
            )
        self._writer = threading.Thread(target=self._write_loop, name="redis-store-writer", daemon=True)
        self._subscriber = threading.Thread(target=self._listen_loop, name="redis-store-models", daemon=True)
        self._writer.start()
        self._subscriber.start()

    # ---- observations -------------------------------------------------------------------------------------

    def append_observations(self, entries: Sequence[dict[str, Any]]) -> None:
        """Queue entries for the writer thread: no network I/O here, so it is fast and survives an outage.
        StoreClosed once `close` has begun: they would wait in a buffer that nobody sends."""
        if not entries:
            return
        encoded = [json.dumps(entry, separators=(",", ":")).encode() for entry in entries]
        with self._lock:
            if self._closed:
                raise StoreClosed("the store is closed (the service is stopping): no observation was accepted")
            room = max(self.buffer_limit - len(self._buffer), 0)
            self._buffer.extend(encoded[:room])
            self._dropped += len(encoded) - min(room, len(encoded))
            # Dropped rows are counted for every row, but said once each time the buffer fills: a line per batch
            # would flood the log for as long as the outage lasts. The writer re-arms it once it has emptied.
            warn = room < len(encoded) and not self._full_warned
            self._full_warned = self._full_warned or warn
        if warn:
            log.warning(
                "redis at %s: the outage buffer is full (%d observations wait in memory): newer observations are "
                "dropped, the oldest kept, until redis takes them again (counted in "
                'leadtime_observations_lost_total{reason="store_buffer"} and as dropped in /status)',
                self.address,
                self.buffer_limit,
            )
        self._wake_writer.set()

    def read_observations(
        self, cursor: str, max_count: int, until: str | None = None
    ) -> tuple[str, list[dict[str, Any]]]:
        """Entries after `cursor` (a stream id; "0" = from the start) and none after `until` (one too), oldest
        first, and the new cursor.

        While Redis is down this answers no entries and the same cursor, so the caller just tries again later.
        """
        if max_count < 1:
            raise ValueError(f"max_count must be >= 1, got {max_count}")
        started = time.monotonic()
        try:
            answer: Any = self._read(
                keys=[self._stream_key, self._token_key], args=[cursor, max_count, until or "+", uuid.uuid4().hex]
            )
        except redis.ResponseError as exc:
            if "stream id" in str(exc).lower():
                raise ValueError(f"cursor {cursor!r} is not a stream id") from None
            self._set_problem(exc, started, stream="read")
            return cursor, []
        except redis.RedisError as exc:
            self._set_problem(exc, started, stream="read")
            return cursor, []
        self._set_problem(None, started, stream="read")
        token, flat = bytes(answer[0]), answer[1:]
        with self._lock:
            # No token (a full Redis refused to set one): a loss is told at a later read.
            if token and self._stream_token is not None and token != self._stream_token:
                self._stream_losses += 1
                self._stream_lost = True
                self._check_run_id = True
                self._wake_writer.set()
            if token:
                self._stream_token = token
        # The caller is done with everything up to `cursor` as well: a replica that adopted a published model
        # reads on from that model's position, past rows it wrote and never read itself (the publisher learned
        # them); kept as unread, they were sent again at the next restart and learned twice.
        new_cursor = flat[-2].decode() if flat else cursor
        self._confirm_read(cursor_order(new_cursor))
        if not flat:
            return cursor, []
        return new_cursor, _decode_entries(flat[1::2])

    def stream_losses(self) -> int:
        """How many times a read found that the stream had lost what it held since the read before (Redis restarted
        without persistence, or was flushed): the rows after a reader's position then were gone, and the new
        stream's ids follow on from the old ones as if nothing was missing."""
        with self._lock:
            return self._stream_losses

    def stream_end(self) -> str | None:
        """The id of the stream's last entry ("0" when it is empty or absent); None when Redis does not answer."""
        try:
            last: Any = self._redis.xrevrange(self._stream_key, count=1)
        except redis.RedisError:
            return None
        if not last:
            return "0"
        newest = last[0][0]
        return newest.decode() if isinstance(newest, bytes) else str(newest)

    def _confirm_read(self, upto: tuple[int, int]) -> None:
        """Forget the sent chunks this store has now read back (up to stream id `upto`)."""
        with self._lock:
            if self._stream_lost:  # the writer sends again what the lost stream held first (`_resend_if_restarted`)
                return
            self._read_upto = max(self._read_upto, upto)  # a chunk recorded after it was read needs no keeping
            while self._unread and self._unread[0][0] <= upto:
                self._unread_count -= len(self._unread.popleft()[1])

    def _resend_if_restarted(self) -> bool:
        """If Redis restarted since the last look (another run id), or a read found the stream lost (a flush, or
        the stream deleted), queue what it had taken, this store had not read back and the server no longer holds,
        ahead of what waits: lost with the crash (no persistence, or the last writes an append-only file had not
        synced) or the flush. What it still holds is not sent again: every replica would learn it twice. Whether it
        restarted or rows were queued again (the chunk in flight is then taken again from the head); raises
        RedisError. Called by the writer only, with no chunk sent meanwhile."""
        run_id = str(self._redis.info("server").get("run_id", ""))
        restarted = self._run_id is not None and run_id != self._run_id
        if run_id != self._run_id:
            self._warn_if_evicting()
        with self._lock:
            stream_lost = self._stream_lost
        lost = 0
        if restarted or stream_lost:
            lost = self._take_back_lost()
            if lost:
                how = "restarted and lost" if restarted else "no longer holds (flushed, or the stream deleted)"
                log.warning("redis at %s %s %d unread observations: sending them again", self.address, how, lost)
        if restarted:  # counted before the run id is taken: `registry_version` relies on that order
            with self._lock:
                self._restarts += 1
        self._check_run_id = False
        self._run_id = run_id
        return restarted or lost > 0

    def _warn_if_evicting(self) -> None:
        """Once per server met: a maxmemory-policy that evicts would lose observations or models without an
        error, where noeviction refuses the write (buffered, retried, shown in health()). Raises RedisError."""
        policy = str(self._redis.info("memory").get("maxmemory_policy", "noeviction"))
        warning = eviction_warning(policy)
        if warning is not None:
            log.warning("redis at %s: %s", self.address, warning)

    def _take_back_lost(self) -> int:
        """Move the unread chunks that the (restarted or flushed) server no longer holds to the head of the buffer;
        how many entries. A chunk lands whole or not at all, so its last id tells whether the server kept it."""
        with self._lock:
            sent = [last_id for last_id, _ in self._unread]
            losses = self._stream_losses  # a loss a read finds after this is looked at again
        answer: Any = self._held(keys=[self._stream_key], args=[f"{ms}-{seq}" for ms, seq in sent]) if sent else []
        gone = {last_id for last_id, held in zip(sent, answer, strict=True) if not held}
        with self._lock:
            self._read_upto = (0, 0)  # without persistence the new server's ids start again from its clock
            lost = [entry for last_id, chunk in self._unread if last_id in gone for entry in chunk]
            self._unread = deque(item for item in self._unread if item[0] not in gone)
            self._unread_count = sum(len(chunk) for _, chunk in self._unread)
            if self._stream_losses == losses:
                self._stream_lost = False  # looked at: reads confirm again
            self._buffer.extendleft(reversed(lost))
            if lost:
                self._in_flight = None  # no longer the head: the writer takes a new chunk (the server has no mark)
            self._resent += len(lost)
            self._resent_pending += len(lost)  # at the head of the buffer: not counted as appended again
        return len(lost)

    def kept_after(self, cursor: str | None) -> int:
        """Rows of the files an earlier stop kept that wait to be sent, or that this store sent and that landed
        after `cursor` (None: anywhere). A chunk lands whole in one step, so its last row's id tells on which side
        of a cursor read at any moment all of its rows are; one found landed already (a file read again) is not
        counted."""
        after = cursor_order(cursor) if cursor is not None else (-1, -1)
        with self._lock:
            landed = sum(rows for last_id, rows in self._kept_landed if last_id > after)
            return landed + sum(len(spill.rows) for spill in self._spills)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every accepted observation is in Redis; False if that took longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not self._buffer and not self._spills:
                    return True
            if time.monotonic() >= deadline:
                return False
            self._wake_writer.set()
            time.sleep(0.01)

    def _write_loop(self) -> None:
        """Send the queue oldest first; on failure keep it, back off and retry: order and entries survive."""
        retry_s = _RETRY_MIN_S
        last_contact = 0.0
        chunk: list[bytes] = []  # the chunk in flight: resent unchanged, under the same id, until it lands
        chunk_id = ""
        spill: Spill | None = None  # the kept file the chunk comes from (None: the buffer)
        while not self._stop.is_set():
            if self._check_run_id or self._stream_lost:  # before anything is sent to what may be a new server
                started = time.monotonic()
                try:
                    if self._resend_if_restarted():
                        chunk = []  # taken again from the head, behind what the crash lost
                except redis.RedisError as exc:
                    self._set_problem(exc, started)
                    self._stop.wait(retry_s)
                    retry_s = min(retry_s * 2, _RETRY_MAX_S)
                    continue
            if not chunk:
                with self._lock:
                    spill = self._spills[0] if self._spills else None
                    size = spill.chunk_size(_SEND_CHUNK) if spill is not None else _SEND_CHUNK
                    chunk = list(islice(spill.rows if spill else self._buffer, 0, size))
                    # A kept file's chunk goes under an id of its place in the file: read again after a crash, the
                    # chunks that had landed are skipped.
                    chunk_id = spill.chunk_id() if spill is not None else uuid.uuid4().hex
                    self._in_flight = (chunk_id, len(chunk)) if spill is None and chunk else None
            if not chunk:
                if time.monotonic() - last_contact >= _PING_EVERY_S:
                    started = time.monotonic()
                    try:
                        self._resend_if_restarted()  # also the health check (one INFO instead of a PING)
                        self._set_problem(None, started)
                    except redis.RedisError as exc:
                        self._set_problem(exc, started)
                    last_contact = time.monotonic()
                self._wake_writer.wait(_PING_EVERY_S)
                self._wake_writer.clear()
                continue
            started = time.monotonic()
            try:
                last_id = self._send(chunk_id, chunk, SPILL_MARK_TTL_S if spill is not None else _CHUNK_MARK_TTL_S)
            except redis.RedisError as exc:
                self._set_problem(exc, started, stream="write")
                self._stop.wait(retry_s)
                retry_s = min(retry_s * 2, _RETRY_MAX_S)
                continue
            retry_s = _RETRY_MIN_S
            last_contact = time.monotonic()
            self._set_problem(None, started, stream="write")
            sent_spill = self._taken(chunk, spill, last_id)
            chunk, spill = [], None
            if sent_spill is not None:
                remove_spill(sent_spill)
                log.info("redis took the %d observations kept in %s", sent_spill.total, sent_spill.path.name)

    def _taken(self, chunk: list[bytes], spill: Spill | None, last_id: tuple[int, int] | None) -> Spill | None:
        """Redis took `chunk`, from the head of `spill` (a kept file) or else of the buffer: off the queue, kept
        until read back. The kept file it emptied, if it did (its file is removed then)."""
        emptied = None
        with self._lock:  # appenders only add on the right, so the chunk is still the buffer's head
            if spill is not None:  # an earlier process's rows: not counted as appended here
                for _ in chunk:
                    spill.rows.popleft()
                spill.chunks_sent += 1
                if last_id is not None:
                    self._kept_landed.append((last_id, len(chunk)))
                if not spill.rows:
                    emptied = self._spills.popleft()
            else:
                for _ in chunk:
                    self._buffer.popleft()
                self._in_flight = None
                if self._resent_pending > 0:  # entries sent again after a restart are not new
                    again = min(self._resent_pending, len(chunk))
                    self._resent_pending -= again
                    self._appended += len(chunk) - again
                else:
                    self._appended += len(chunk)
            if not self._buffer:
                self._full_warned = False  # emptied: filling it again is worth a line again
            if last_id is not None and last_id > self._read_upto:
                self._unread.append((last_id, chunk))
                self._unread_count += len(chunk)
                while self._unread_count > self.buffer_limit:
                    self._unread_count -= len(self._unread.popleft()[1])
        return emptied

    def _send(self, chunk_id: str, chunk: list[bytes], mark_ttl_s: int) -> tuple[int, int] | None:
        """Append one chunk, its id remembered `mark_ttl_s`; the stream id of its last entry (None: an earlier try of
        this chunk had landed)."""
        last = self._append(
            keys=[self._stream_key, f"{self._chunk_prefix}{chunk_id}"],
            args=[self.stream_maxlen, mark_ttl_s, *chunk],
        )
        return cursor_order(last.decode() if isinstance(last, bytes) else str(last)) if last else None

    # ---- model registry -----------------------------------------------------------------------------------

    def publish_model(self, artifact: bytes, holder: str | None = None) -> int:
        """Store a JSON artifact as the next version and notify every replica; raises if Redis is down. With
        `holder`, only if the training lease is `holder`'s, checked in the same step (LeaseLost otherwise)."""
        if holder == "":
            raise ValueError("holder must be a non-empty string or None")
        version = self._publish_if(artifact, holder or "", "")
        assert version is not None  # nothing is restored: every publication writes
        return version

    def restore_model(self, artifact: bytes, lost: int) -> int | None:
        """Publish `artifact` again, numbered above `lost`, only if the registry no longer holds version `lost` or
        a newer one (Redis lost its data), checked in the same step; None if it does: another replica restored it
        first, or the lineage went on. Needs no lease: whichever replica notices gives the fleet back its model."""
        return self._publish_if(artifact, "", str(lost))

    def _publish_if(self, artifact: bytes, holder: str, lost: str) -> int | None:
        check_artifact(artifact)
        with self._lock:
            floor = self._highest_version
        started = time.monotonic()
        try:
            answer = self._publish(
                keys=[self._version_key, self._lease_key],
                args=[bytes(artifact), floor, self._model_prefix, self.keep_versions, self._channel, holder, lost],
            )
        except redis.RedisError as exc:
            self._set_problem(exc, started)
            raise StoreUnavailable(f"cannot publish the model: {_from_redis(exc)}") from None
        self._set_problem(None, started)
        if isinstance(answer, list):
            if int(answer[0]) == 1:  # the registry holds the lost version or a newer one
                self._saw_version(int(answer[1]))
                return None
            raise LeaseLost(holder, bytes(answer[1]).decode(errors="replace") or None)
        version = int(answer)
        self._saw_version(version)
        return version

    def latest_model(self) -> tuple[int, bytes] | None:
        """The newest (version, artifact), or None if there is none or Redis cannot be reached: the sync loop,
        startup and the retraining job go on with what they have either way."""
        try:
            return self.read_latest_model()
        except StoreUnavailable:
            return None

    def read_latest_model(self) -> tuple[int, bytes] | None:
        """The newest (version, artifact), or None if none is published; StoreUnavailable if Redis cannot be
        reached, for a caller that must not report an outage as "nothing published" (/reload)."""
        started = time.monotonic()
        try:
            answer = self._latest(keys=[self._version_key], args=[self._model_prefix])
        except redis.RedisError as exc:
            self._set_problem(exc, started)
            raise StoreUnavailable(f"redis at {self.address}: {redis_problem(exc)}") from None
        self._set_problem(None, started)
        if not answer:
            return None
        version = int(answer[0])
        self._saw_version(version)
        return version, bytes(answer[1])

    def registry_version(self) -> int | None:
        """The newest version the registry holds with its artifact (0: none), without fetching the artifact; None
        if Redis cannot be reached, or answers as another server than the writer last looked at. The replicas
        compare it with what they published or adopted to notice a registry that lost its models (flushed, keys
        deleted or evicted, a restart without persistence), and tell those causes apart by `server_restarts`:
        until the writer has counted a restart (it looks at once when woken), the answer could not be told from a
        flush, so there is none yet."""
        started = time.monotonic()
        try:
            run_id = str(self._redis.info("server").get("run_id", ""))
            answer = self._latest(keys=[self._version_key], args=[self._model_prefix, "version"])
        except redis.RedisError as exc:
            self._set_problem(exc, started)
            return None
        self._set_problem(None, started)
        if self._run_id is not None and run_id != self._run_id:  # restarted, not counted yet
            self._check_run_id = True
            self._wake_writer.set()
            return None
        return int(answer[0]) if answer else 0

    def model_versions(self) -> list[int]:
        """Versions still held in the registry, oldest first ([] if Redis cannot be reached)."""
        started = time.monotonic()
        try:
            current = self._redis.get(self._version_key)
            if current is None:
                return []
            newest = int(current)
            candidates = list(range(max(newest - self.keep_versions + 1, 1), newest + 1))
            pipe = self._redis.pipeline(transaction=False)
            for version in candidates:
                pipe.exists(f"{self._model_prefix}{version}")
            present = pipe.execute()
        except redis.RedisError as exc:
            self._set_problem(exc, started)
            return []
        return [version for version, found in zip(candidates, present, strict=True) if found]

    def model(self, version: int) -> bytes | None:
        """The artifact of one published version; None if trimmed, never published or Redis is down."""
        started = time.monotonic()
        try:
            data: Any = self._redis.get(f"{self._model_prefix}{version}")
        except redis.RedisError as exc:
            self._set_problem(exc, started)
            return None
        return None if data is None else bytes(data)

    def wait_for_model(self, after_version: int, timeout_s: float) -> int | None:
        """The first version newer than `after_version` seen within `timeout_s`, else None.

        Woken by the pub/sub subscriber as soon as a publication arrives; polls the counter every 0.25 s as
        well, so a notification lost while the subscriber was reconnecting delays a swap by at most that.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._version_seen:
                if self._highest_version > after_version:
                    return self._highest_version
            current = self._read_version_counter()
            if current is not None and current > after_version:
                return current
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            with self._version_seen:
                if self._highest_version <= after_version:
                    self._version_seen.wait(min(remaining, _POLL_EVERY_S))

    def _read_version_counter(self) -> int | None:
        started = time.monotonic()
        try:
            value = self._redis.get(self._version_key)
        except redis.RedisError as exc:
            self._set_problem(exc, started)
            return None
        if value is None:
            return None
        version = int(value)
        self._saw_version(version)
        return version

    def _saw_version(self, version: int) -> None:
        with self._version_seen:
            if version > self._highest_version:
                self._highest_version = version
                self._version_seen.notify_all()

    def _listen_loop(self) -> None:
        """Keep one subscription to the publication channel alive, resubscribing after any outage."""
        while not self._stop.is_set():
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self._channel)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=_POLL_EVERY_S)
                    if message and message.get("type") == "message":
                        self._saw_version(int(message["data"]))
            except (redis.RedisError, OSError, ValueError):
                self._stop.wait(_RETRY_MAX_S / 2)
            finally:
                with contextlib.suppress(redis.RedisError, OSError):
                    pubsub.close()

    # ---- training lease -----------------------------------------------------------------------------------

    def acquire_training_lease(self, holder: str, ttl_s: float) -> bool:
        """Take or renew the one training lease for `ttl_s`; False only if another holds it. StoreUnavailable if
        Redis cannot be reached: a False then made the holder log that another replica held the lease (it had
        not renewed it, "paused, or starved of CPU") while nobody did."""
        if not holder:
            raise ValueError("holder must be a non-empty string")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        started = time.monotonic()
        try:
            granted = self._lease(keys=[self._lease_key], args=[holder, max(int(ttl_s * 1000), 1)])
        except redis.RedisError as exc:
            self._set_problem(exc, started)
            raise StoreUnavailable(f"cannot take or renew the training lease: {_from_redis(exc)}") from None
        self._set_problem(None, started)
        return bool(granted)

    def release_training_lease(self, holder: str) -> bool:
        """Give the lease up early (only its holder can); True if it was held by `holder`."""
        started = time.monotonic()
        try:
            return bool(self._release(keys=[self._lease_key], args=[holder]))
        except redis.RedisError as exc:
            self._set_problem(exc, started)
            return False

    def lease_holder(self) -> str | None:
        """Who holds the training lease now (None if nobody or Redis is down)."""
        started = time.monotonic()
        try:
            value: Any = self._redis.get(self._lease_key)
        except redis.RedisError as exc:
            self._set_problem(exc, started)
            return None
        return None if value is None else value.decode()

    # ---- state --------------------------------------------------------------------------------------------

    def _set_problem(
        self, exc: BaseException | None, started: float, stream: Literal["read", "write"] | None = None
    ) -> None:
        """Record the outcome of a Redis call begun at `started` (time.monotonic()); log a change once.

        An error the server answered for a call on the observation `stream` (its key holds something else, or a
        full server refuses the append) is the stream's problem, not the server's: the registry and lease calls
        that succeed meanwhile must not read as its end (that logged a warning and an "answers again" several
        times a second). Nor may a read of the stream end refused writes: a full Redis still answers reads. A write
        that lands ends both."""
        problem = None if exc is None else redis_problem(exc, self.stream.db if self.stream is not None else None)
        if problem is not None:
            self._check_run_id = True  # the server may come back as another one, empty
        # A refused password or database comes on connecting, whichever call connects: the server's problem, said
        # once (taken for the stream's, every stream call said it again), and worth a line after an outage too.
        refused = exc is not None and refuses_configuration(exc)
        stream_only = stream is not None and isinstance(exc, redis.ResponseError) and not refused
        with self._lock:
            change = None if stream_only else self._health.record(problem, started, notable=refused)
            stream_change = None
            if stream is not None and (exc is None or stream_only):  # an unreachable server tells nothing of it
                was = self._stream_problem()
                sides = [self._stream_reads] if stream == "read" else [self._stream_writes]
                if stream == "write" and exc is None:  # a chunk landed: the key is a stream, readable too
                    sides.append(self._stream_reads)
                for side in sides:
                    side.record(problem, started)
                now = self._stream_problem()
                stream_change = (was, now) if (was is None) != (now is None) else None
            buffered = len(self._buffer)
        for outcome in (change, stream_change):
            if outcome is not None:
                self._log_change(*outcome, buffered)

    def _stream_problem(self) -> str | None:
        """What keeps the observation stream from working (its writes first: they keep rows waiting), or None.
        Called under the lock."""
        return self._stream_writes.problem or self._stream_reads.problem

    def _log_change(self, was: str | None, problem: str | None, buffered: int) -> None:
        """One line when Redis (or its observation stream) stops or starts working again."""
        first = was == NOT_CONTACTED
        if problem is not None:
            when = " from the start" if first else ""
            log.warning("redis at %s: %s%s; buffering observations in memory", self.address, problem, when)
        elif not first:
            log.info("redis at %s answers again; %d buffered observations to send", self.address, buffered)

    def health(self) -> dict[str, str]:
        """{"redis": "ok"} or what is wrong, with how many observations wait in memory meanwhile."""
        with self._lock:
            problem = self._health.problem or self._stream_problem()
            buffered, dropped = self._buffered(), self._dropped
        if problem is None:
            return {"redis": "ok"}
        detail = f"{problem}; {buffered} observations buffered"
        if dropped:
            detail += f", {dropped} dropped"
        return {"redis": detail}

    def _buffered(self) -> int:
        """Rows waiting for Redis: accepted here, and kept by an earlier stop (under the lock)."""
        return len(self._buffer) + sum(len(spill.rows) for spill in self._spills)

    def stats(self) -> dict[str, int]:
        """Observations waiting in memory, dropped while Redis was down, appended and sent again; times the
        server was found restarted."""
        with self._lock:
            return {
                "buffered": self._buffered(),
                "dropped": self._dropped,
                "appended": self._appended,
                "resent": self._resent,
                "server_restarts": self._restarts,
            }

    def close(self, flush_timeout_s: float = 1.0) -> None:
        """Give the writer a moment to send what is queued, then stop both threads and the connections. What Redis
        has not taken by then is kept in `spill_dir` if there is one (sent first by the next store started with it),
        else dropped and counted."""
        if self._stop.is_set():
            return
        with self._lock:
            self._closed = True  # from now on nothing joins what the flush sends
        self.flush(flush_timeout_s)
        self._stop.set()
        self._wake_writer.set()
        self._writer.join(timeout=2.0 + 2 * self._socket_timeout_s)
        self._subscriber.join(timeout=2.0)
        with self._lock:
            rest = list(self._buffer)
            self._buffer.clear()
            in_flight, self._in_flight = self._in_flight, None
            earlier = sum(len(spill.rows) for spill in self._spills)  # their files stay until Redis takes them
            self._spills.clear()
        kept = self._keep(rest, in_flight)
        if kept is not None:
            log.warning(
                "closed before redis took them: %d buffered observations kept in %s, sent first by the next start "
                "with that directory%s",
                len(rest),
                kept,
                f" (behind {earlier} kept by an earlier stop, still there)" if earlier else "",
            )
        elif rest:
            with self._lock:
                self._dropped += len(rest)
            log.warning("closed before redis took them: %d buffered observations dropped", len(rest))
        self._redis.close()

    def _keep(self, rows: list[bytes], in_flight: tuple[str, int] | None) -> Path | None:
        """Write the rows left at close to `spill_dir`, the first as the chunk `in_flight` if the writer was sending
        one (it may have landed); the file, or None if there is no directory, nothing to keep, or it could not be
        written (said, and the rows then count as dropped)."""
        if not rows or self._spill_dir is None:
            return None
        try:
            return write_spill(self._spill_dir, rows, head=in_flight)
        except OSError as err:
            log.warning("could not keep the buffered observations in %s: %s", self._spill_dir, err)
            return None
