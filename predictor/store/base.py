"""The contract between the service and its shared state.

One process with no Redis uses the in-memory store; several replicas share a Redis store. Either way the service
accepts observations by appending them here (fast, never blocking on learning), and every replica's ingest loop
reads them back and feeds its learner, so what one replica is told, all of them learn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from leadtime.predictor.store.stream_identity import StreamIdentity


class StoreClosed(ConnectionError):
    """Observations offered to a store that was closed (the service is stopping): none of them is kept. The HTTP
    API answers 503 and gRPC UNAVAILABLE, so that the caller sends them to another replica or again later."""


class LeaseLost(RuntimeError):
    """A publication made for a training lease's holder that no longer holds it (it expired while the holder was
    paused, and another may hold it now): nothing was published. `holder` is who holds the lease now (None:
    nobody)."""

    def __init__(self, publisher: str, holder: str | None) -> None:
        now = f"{holder} holds it now" if holder else "nobody holds it now"
        super().__init__(f"{publisher} no longer holds the training lease ({now}): the model was not published")
        self.publisher = publisher
        self.holder = holder


def cursor_order(cursor: str) -> tuple[int, int]:
    """A cursor of either store as a pair that orders as their positions do: a Redis stream id "<ms>-<seq>",
    a memory store's index "<n>" (as (n, 0)); "0" is (0, 0).

    >>> cursor_order("1700000000000-3") > cursor_order("1700000000000-2") > cursor_order("0")
    True
    >>> cursor_order("12") < cursor_order("100")
    True
    """
    ms, _, seq = cursor.partition("-")
    return int(ms), int(seq or 0)


class Store(Protocol):
    """What the service needs of its shared state: observations, the model registry and the training lease."""

    stream_name: str | None
    """Which observation stream this is, the same for every process that reads it (a model saved with a position
    in it goes on from there), whichever spelling of its URL each was given (`StreamIdentity.name`); None for a
    stream no other process can read."""

    stream: StreamIdentity | None
    """The identity `stream_name` is the name of: what a recorded name is compared with (`same_stream`)."""

    def append_observations(self, entries: Sequence[dict[str, Any]]) -> None:
        """Accept validated observation entries (llm-d training-entry dicts, `observation_to_llmd` shape).

        Must be fast and must not raise when a backend is down: it buffers up to a bound and counts drops. Raises
        StoreClosed once `close` has begun: nothing would send or read them any more.
        """
        ...

    def read_observations(
        self, cursor: str, max_count: int, until: str | None = None
    ) -> tuple[str, list[dict[str, Any]]]:
        """Entries appended after `cursor` ("0" = from the start), oldest first, and the new cursor; with `until`
        (a cursor), none after it: a reader can tell the rows the stream held at a moment (`stream_end`) from
        those that came later."""
        ...

    def stream_losses(self) -> int:
        """How many times a read of this store found that the stream had lost what it held since the read before
        (Redis restarted without persistence, or was flushed); 0 for a store that never loses it. A reader that sees
        it change knows where it stopped learning what was lost: its position before that read."""
        ...

    def stream_end(self) -> str | None:
        """The cursor of a reader that has read everything the stream holds now ("0" when it is empty); None
        when the backend cannot tell."""
        ...

    def kept_after(self, cursor: str | None) -> int:
        """Rows an earlier process kept at its stop (accepted there, never sent) that this store still has to send,
        or has sent and that landed in the stream after `cursor` (None: anywhere): a reader counts the rows it reads
        up to the stream's end at its start as replayed, and these, whenever they are sent, are replayed rows too.
        0 for a store that keeps none."""
        ...

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every observation accepted so far is in the stream, readable up to `stream_end` (a store
        that sends them on from a queue, the Redis store, has sent them); False if that took longer than
        `timeout_s`."""
        ...

    def publish_model(self, artifact: bytes, holder: str | None = None) -> int:
        """Store a model artifact (JSON + LightGBM text, never pickle) and return its new version. With `holder`,
        only while `holder` holds the training lease, checked in the same atomic step: LeaseLost otherwise (a
        replica paused past the lease's TTL must not publish over the new holder's model). Publishers that hold
        no lease (a model pulled or taken up alone, `leadtime retrain`) pass none."""
        ...

    def restore_model(self, artifact: bytes, lost: int) -> int | None:
        """Publish `artifact` again, numbered above `lost`, only if the registry no longer holds version `lost`
        or a newer one (it lost its data), in one atomic step; None if it does. No lease needed: after a loss the
        replica that holds it may be new, and it would number the prior's models from 1, below what the trained
        replicas hold (they would ignore them)."""
        ...

    def latest_model(self) -> tuple[int, bytes] | None:
        """The newest published (version, artifact), or None (none published, or the backend is down)."""
        ...

    def read_latest_model(self) -> tuple[int, bytes] | None:
        """The newest published (version, artifact), or None if none is; raises (ConnectionError) if the backend
        cannot be reached, so that an outage is not taken for an empty registry."""
        ...

    def model_versions(self) -> list[int]:
        """The versions the registry still holds, oldest first (it keeps the last few); [] if none is or the
        backend cannot be reached. A replica that refuses the newest (a newer build's) starts from an older one."""
        ...

    def model(self, version: int) -> bytes | None:
        """The artifact of one published `version`; None if it is no longer kept, was never published, or the
        backend cannot be reached."""
        ...

    def registry_version(self) -> int | None:
        """The newest version the registry holds with its artifact (0: none), or None if the backend cannot be
        reached or cannot yet tell whether it restarted (`stats()["server_restarts"]`); cheap (the artifact is not
        fetched), so every replica can ask it on every renewal."""
        ...

    def wait_for_model(self, after_version: int, timeout_s: float) -> int | None:
        """Block up to `timeout_s` until a version newer than `after_version` is published; return it."""
        ...

    def acquire_training_lease(self, holder: str, ttl_s: float) -> bool:
        """True if `holder` now holds (or renewed) the one training lease; only the holder retrains. False only
        when another holds it; raises (ConnectionError) if the backend cannot be reached, so that an outage is not
        told as another holder."""
        ...

    def release_training_lease(self, holder: str) -> bool:
        """Give the lease up if `holder` still holds it (compared and deleted in one step, so a lease that passed to
        another is left alone); True if it was released. A replica that stops cleanly calls it, so that another
        takes the lease at its next attempt rather than when it expires."""
        ...

    def health(self) -> dict[str, str]:
        """Component → "ok" or a short reason it is degraded (e.g. {"redis": "connection refused"})."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters: "appended" (rows offered), "buffered" (waiting for the backend), "dropped" (lost, in all).
        A store that thins under overload (the memory store) adds "pending" (accepted, not yet read), "thinned"
        (removed to keep up, evenly over time), "thinning_stride" (1 = keeping every row), "dropped_<reason>"
        per reason and "full" (1: rows offered now are dropped)."""
        ...

    def close(self) -> None:
        """Release connections and threads."""
        ...
