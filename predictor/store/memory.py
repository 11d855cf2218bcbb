"""The embedded store of a single process: observations, models and the training lease, in memory.

It keeps the same semantics as the shared store (cursors, versions, a lease) so that the service runs one
code path with or without Redis.

Overload is handled here, by design and visibly. The backlog is what was accepted and not yet read by the ingest
loop (which hands it to the learner). While it stays under `thin_above` rows nothing is lost: a burst waits and
is learned behind the answers. Beyond that the store thins the backlog uniformly over time instead of losing its
oldest part: it removes half the pending rows and from then on keeps one accepted row in 2 (then 4, 8, ... up
to `max_stride`), so that every period of a burst stays represented in what is learned; once the backlog is down
to a quarter of the bound it keeps twice as many again. Which rows go is drawn at random, each alike: a rule by
position (every other row) locks onto any pattern the rows arrive in, and llm-d's router sends each request's
TTFT row beside its TPOT row. Thinned rows are counted, thinning logs when it starts
and stops. Only when even `max_stride` cannot hold the backlog is the store full: rows offered then are dropped
and counted (`dropped_backlog_full`); the native API refuses them beforehand with 429 (see `stats()["full"]`),
llm-d's path keeps answering 202 as its router expects. Read rows are retained up to `retain` (a restarted
learner reads again from the serving model's position); unread rows trimmed by that bound are counted as
`dropped_store_bound`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from leadtime.predictor.store.base import LeaseLost, StoreClosed
from leadtime.predictor.store.stream_identity import StreamIdentity

log = logging.getLogger("leadtime.service")

_KEEP_MODELS = 4


class MemoryStore:
    """In-process implementation of `leadtime.predictor.store.base.Store`.

    Parameters
    ----------
    retain
        Most observations kept for readers; older ones are trimmed.
    thin_above
        Backlog (accepted, unread rows) above which the backlog is thinned uniformly over time.
    max_stride
        Most thinning: one row kept in `max_stride`. Beyond it the backlog is full and new rows are dropped.
    seed
        Of the draws of which rows thinning keeps.
    """

    def __init__(self, retain: int = 200_000, thin_above: int = 50_000, max_stride: int = 64, seed: int = 0) -> None:
        if retain < 1 or thin_above < 1 or max_stride < 1:
            raise ValueError("retain, thin_above and max_stride must be ≥ 1")
        self._retain = retain
        self._thin_above = thin_above
        self._max_stride = max_stride
        self.stream_name: str | None = None  # this process's memory: no other process reads it
        self.stream: StreamIdentity | None = None
        self._lock = threading.Lock()
        self._model_published = threading.Condition(self._lock)
        self._closed = False
        # Slots of the stream; a thinned pending row leaves None behind, so cursors (absolute slot indices) hold.
        self._entries: deque[dict[str, Any] | None] = deque()
        self._first_index = 0  # absolute index of self._entries[0]
        self._highest_read = 0  # absolute index one past the newest slot any reader has seen
        self._pending = 0  # rows (not None) at or after _highest_read
        self._appended = 0  # rows offered to the store (accepted by the service)
        self._rows = 0  # rows (not None) in _entries: what `retain` bounds (empty slots cost a pointer)
        self._stride = 1  # keep one accepted row in this many
        self._rng = np.random.default_rng(seed)
        self._thinned = 0
        self._dropped_bound = 0
        self._dropped_full = 0
        self._thinning_since = 0.0
        self._models: deque[tuple[int, bytes]] = deque(maxlen=_KEEP_MODELS)
        self._version = 0
        self._lease_holder: str | None = None
        self._lease_expires = 0.0

    def append_observations(self, entries: Sequence[dict[str, Any]]) -> None:
        """Append entries in order (never blocks on learning); past `retain`, the oldest go. StoreClosed once
        closed."""
        with self._lock:
            if self._closed:
                raise StoreClosed("the store is closed (the service is stopping): no observation was accepted")
            n = len(entries)
            self._appended += n
            kept: Sequence[dict[str, Any]] = entries
            if self._stride > 1:
                chosen = np.flatnonzero(self._rng.random(n) * self._stride < 1.0).tolist()
                kept = [entries[i] for i in chosen]
                self._thinned += n - len(kept)
            if self._stride >= self._max_stride and self._pending >= self._thin_above:
                self._dropped_full += len(kept)
                return
            self._entries.extend(kept)
            self._pending += len(kept)
            self._rows += len(kept)
            while self._pending > self._thin_above and self._stride < self._max_stride:
                self._thin_pending()
            self._trim()

    def _thin_pending(self) -> None:
        """Remove half the pending rows, each alike likely, and keep half as many from now on (under the lock)."""
        start = max(self._highest_read, self._first_index) - self._first_index
        entries = self._entries
        pending = [i for i in range(start, len(entries)) if entries[i] is not None]
        removed = 0
        for i in np.flatnonzero(self._rng.random(len(pending)) < 0.5).tolist():
            entries[pending[i]] = None
            removed += 1
        self._pending -= removed
        self._rows -= removed
        self._thinned += removed
        if self._stride == 1:
            self._thinning_since = time.monotonic()
            log.warning(
                "ingestion: thinning started: %d accepted rows wait to be learned (bound %d); learning 1 in 2 of "
                "the backlog and of what arrives, evenly over time",
                self._pending + removed,
                self._thin_above,
            )
        else:
            log.warning("ingestion: thinning further: learning 1 in %d of what arrives", self._stride * 2)
        self._stride *= 2

    def _relax(self) -> None:
        """Keep twice as many once the backlog is down to a quarter of the bound (under the lock)."""
        while self._stride > 1 and self._pending <= self._thin_above // 4:
            self._stride //= 2
            if self._stride == 1:
                log.warning(
                    "ingestion: thinning stopped after %.1f s; %d rows thinned so far in all",
                    time.monotonic() - self._thinning_since,
                    self._thinned,
                )

    def _trim(self) -> None:
        """Drop the oldest slots until `retain` rows are left; unread rows among them are counted as lost."""
        lost = 0
        while self._rows > self._retain:
            entry = self._entries.popleft()
            if entry is not None:
                self._rows -= 1
                lost += self._first_index >= self._highest_read
            self._first_index += 1
        self._dropped_bound += lost
        self._pending -= lost
        self._highest_read = max(self._highest_read, self._first_index)

    def read_observations(
        self, cursor: str, max_count: int, until: str | None = None
    ) -> tuple[str, list[dict[str, Any]]]:
        """Entries after `cursor`, oldest first, at most `max_count` and none after `until`, and the new cursor."""
        try:
            start = int(cursor)
        except ValueError:
            raise ValueError(f"cursor must be an integer string, got {cursor!r}") from None
        with self._lock:
            start = max(start, self._first_index)
            stop = self._first_index + len(self._entries)
            if until is not None:
                stop = min(stop, int(until))
            out: list[dict[str, Any]] = []
            index = start
            fresh = 0
            while index < stop and len(out) < max_count:
                entry = self._entries[index - self._first_index]
                if entry is not None:
                    out.append(entry)
                    if index >= self._highest_read:
                        fresh += 1
                index += 1
            if index > self._highest_read:
                self._pending -= fresh
                self._highest_read = index
            self._relax()
            return str(index), out

    def stream_losses(self) -> int:
        """Never: this process's memory loses nothing while it reads it."""
        return 0

    def stream_end(self) -> str:
        """The index after the last entry: where a reader that has read everything stands."""
        with self._lock:
            return str(self._first_index + len(self._entries))

    def kept_after(self, cursor: str | None) -> int:
        """0: nothing outlives this store to be kept."""
        return 0

    def flush(self, timeout_s: float = 5.0) -> bool:
        """True: what is appended here is in the stream at once."""
        return True

    def publish_model(self, artifact: bytes, holder: str | None = None) -> int:
        """Keep an artifact as the next version; returns it. With `holder`, only while it holds the lease
        (LeaseLost otherwise)."""
        with self._model_published:
            if holder is not None and (self._lease_holder != holder or time.monotonic() >= self._lease_expires):
                current = self._lease_holder if time.monotonic() < self._lease_expires else None
                raise LeaseLost(holder, current)
            return self._keep(artifact)

    def restore_model(self, artifact: bytes, lost: int) -> int | None:
        """Keep an artifact as the next version unless version `lost` or a newer one is kept (here it always is,
        once published: nothing here loses its models)."""
        with self._model_published:
            if self._version >= lost:
                return None
            return self._keep(artifact)

    def _keep(self, artifact: bytes) -> int:
        """The next version (under _model_published)."""
        self._version += 1
        self._models.append((self._version, bytes(artifact)))
        self._model_published.notify_all()
        return self._version

    def latest_model(self) -> tuple[int, bytes] | None:
        """The newest (version, artifact), or None."""
        with self._lock:
            return self._models[-1] if self._models else None

    def read_latest_model(self) -> tuple[int, bytes] | None:
        """The newest (version, artifact), or None: nothing here is ever unreachable."""
        return self.latest_model()

    def model_versions(self) -> list[int]:
        """The versions kept (the last few), oldest first."""
        with self._lock:
            return [version for version, _ in self._models]

    def model(self, version: int) -> bytes | None:
        """The artifact of a kept `version`, or None."""
        with self._lock:
            return next((artifact for kept, artifact in self._models if kept == version), None)

    def registry_version(self) -> int | None:
        """The newest version kept (0: none): nothing here loses its models."""
        with self._lock:
            return self._models[-1][0] if self._models else 0

    def wait_for_model(self, after_version: int, timeout_s: float) -> int | None:
        """Block up to `timeout_s` until a version newer than `after_version` exists; return it."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._model_published:
            while self._version <= after_version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._model_published.wait(remaining)
            return self._version

    def acquire_training_lease(self, holder: str, ttl_s: float) -> bool:
        """Take or renew the one training lease for `holder` (it expires after `ttl_s`)."""
        now = time.monotonic()
        with self._lock:
            if self._lease_holder in (None, holder) or now >= self._lease_expires:
                self._lease_holder = holder
                self._lease_expires = now + ttl_s
                return True
            return False

    def release_training_lease(self, holder: str) -> bool:
        """Give the lease up if `holder` holds it (for the Store contract: no other process shares this store)."""
        with self._lock:
            if self._lease_holder != holder or time.monotonic() >= self._lease_expires:
                return False
            self._lease_holder = None
            return True

    def health(self) -> dict[str, str]:
        """Always ok: the store is this process's memory."""
        return {"store": "ok"}

    def stats(self) -> dict[str, int]:
        """Observations appended, and dropped unread past `retain`; nothing waits in a buffer here."""
        with self._lock:
            return {
                "buffered": 0,
                "dropped": self._dropped_bound + self._dropped_full,
                "dropped_store_bound": self._dropped_bound,
                "dropped_backlog_full": self._dropped_full,
                "appended": self._appended,
                "pending": self._pending,
                "thinned": self._thinned,
                "thinning_stride": self._stride,
                "full": int(self._stride >= self._max_stride and self._pending >= self._thin_above),
            }

    def close(self) -> None:
        """Refuse appends from now on (nothing else to release)."""
        with self._model_published:
            self._closed = True
            self._model_published.notify_all()
