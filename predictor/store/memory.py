"""The embedded store of a single process: observations, models and the training lease, in memory.

It keeps the same semantics as the shared store (cursors, versions, a lease) so that the service runs one
code path with or without Redis. Observations are retained up to a bound; entries trimmed before the ingest
loop has read them are counted as dropped, never lost silently.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

_KEEP_MODELS = 4


class MemoryStore:
    """In-process implementation of `leadtime.predictor.store.base.Store`.

    Parameters
    ----------
    retain
        Most observations kept for readers; older ones are trimmed.
    """

    def __init__(self, retain: int = 200_000) -> None:
        if retain < 1:
            raise ValueError("retain must be ≥ 1")
        self._retain = retain
        self._lock = threading.Lock()
        self._model_published = threading.Condition(self._lock)
        self._entries: deque[dict[str, Any]] = deque()
        self._first_index = 0  # absolute index of self._entries[0]
        self._highest_read = 0  # absolute index one past the newest entry any reader has seen
        self._appended = 0
        self._dropped = 0
        self._models: deque[tuple[int, bytes]] = deque(maxlen=_KEEP_MODELS)
        self._version = 0
        self._lease_holder: str | None = None
        self._lease_expires = 0.0

    def append_observations(self, entries: Sequence[dict[str, Any]]) -> None:
        """Append entries in order (never blocks on learning); past `retain`, the oldest go."""
        with self._lock:
            self._entries.extend(entries)
            self._appended += len(entries)
            excess = len(self._entries) - self._retain
            if excess > 0:
                for _ in range(excess):
                    self._entries.popleft()
                unread = self._first_index + excess - max(self._highest_read, self._first_index)
                self._dropped += max(0, min(excess, unread))
                self._first_index += excess

    def read_observations(self, cursor: str, max_count: int) -> tuple[str, list[dict[str, Any]]]:
        """Entries after `cursor`, oldest first, at most `max_count`, and the new cursor."""
        try:
            start = int(cursor)
        except ValueError:
            raise ValueError(f"cursor must be an integer string, got {cursor!r}") from None
        with self._lock:
            start = max(start, self._first_index)
            end = min(self._first_index + len(self._entries), start + max(0, max_count))
            offset = start - self._first_index
            out = [self._entries[offset + i] for i in range(end - start)]
            self._highest_read = max(self._highest_read, end)
            return str(end), out

    def publish_model(self, artifact: bytes) -> int:
        """Keep an artifact as the next version; returns it."""
        with self._model_published:
            self._version += 1
            self._models.append((self._version, bytes(artifact)))
            self._model_published.notify_all()
            return self._version

    def latest_model(self) -> tuple[int, bytes] | None:
        """The newest (version, artifact), or None."""
        with self._lock:
            return self._models[-1] if self._models else None

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

    def health(self) -> dict[str, str]:
        """Always ok: the store is this process's memory."""
        return {"store": "ok"}

    def stats(self) -> dict[str, int]:
        """Observations appended, and dropped unread past `retain`; nothing waits in a buffer here."""
        with self._lock:
            return {"buffered": 0, "dropped": self._dropped, "appended": self._appended}

    def close(self) -> None:
        """Nothing to release."""
        with self._model_published:
            self._model_published.notify_all()
