"""The open ObserveStream calls: at most `limit` at once, and each one's batches read where a stop can reach it.

A stream's worker thread waiting in gRPC's request iterator cannot be woken until its client sends or hangs up. At
a stop, gRPC then cancelled it after its grace ("Cancelling all calls", no count), though every batch it had
acknowledged was kept, and a client that retried sent the whole stream again. So each open stream's batches are
read by a small thread of its own (not one of the server's workers), one batch when the worker asks for it, and the
worker waits for either that batch or the stop: told first, each stream ends with its own answer, naming the count.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

_DONE = object()  # the client ended its stream
_STOP = object()  # the service is stopping


STOPPING_MESSAGE = "the service is stopping: nothing was accepted (send it to another replica)"
"""A write refused at a stop, before any of it was taken."""


class ServiceStopping(Exception):
    """The service is stopping: nothing more is accepted here (UNAVAILABLE; send it to another replica)."""


class StreamBatches:
    """The batches of one stream, read on a thread of their own; iterating raises `ServiceStopping` once `stop()`
    was called (the batch in the worker's hand is finished first), and re-raises gRPC's error when the caller
    cancels."""

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wanted = threading.Semaphore(0)  # a batch asked for: read ahead no further than gRPC's flow control
        self._stopped = False
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="leadtime-grpc-stream", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            self._wanted.acquire()
            if self._closed:
                return
            try:
                item = next(self._source, _DONE)
            except Exception as err:  # the caller cancelled or its deadline passed: the worker raises it
                item = err
            self._items.put(item)
            if item is _DONE or isinstance(item, Exception):
                return

    def __iter__(self) -> StreamBatches:
        return self

    def __next__(self) -> Any:
        if not self._stopped:
            self._wanted.release()
        item = self._items.get()
        if item is _DONE:
            raise StopIteration
        if item is _STOP:
            raise ServiceStopping("the service is stopping: this batch and those after it were not accepted")
        if isinstance(item, Exception):
            raise item
        return item

    def stop(self) -> None:
        """End the stream at its next batch (called from another thread)."""
        self._stopped = True
        self._items.put(_STOP)

    def close(self) -> None:
        """The call has ended: the reader reads no more (one waiting in gRPC ends with the call)."""
        self._closed = True
        self._wanted.release()


class OpenStreams:
    """The streams open at once, up to `limit`; `stop_all` tells each to end and waits for them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: set[StreamBatches] = set()
        self._stopping = False
        self._changed = threading.Condition()

    def open(self, source: Iterator[Any]) -> StreamBatches | None:
        """The stream's batches, or None when `limit` streams are open already (`ServiceStopping` once stopping)."""
        with self._changed:
            if self._stopping:
                raise ServiceStopping(STOPPING_MESSAGE)
            if len(self._open) >= self.limit:
                return None
            batches = StreamBatches(source)
            self._open.add(batches)
            return batches

    def close(self, batches: StreamBatches) -> None:
        """The stream's call has ended."""
        batches.close()
        with self._changed:
            self._open.discard(batches)
            self._changed.notify_all()

    def stop_all(self, timeout_s: float) -> bool:
        """Tell every open stream to end (and refuse new ones); whether all ended within `timeout_s`."""
        with self._changed:
            self._stopping = True
            for batches in self._open:
                batches.stop()
            return self._changed.wait_for(lambda: not self._open, timeout_s)
