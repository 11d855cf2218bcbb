"""Whether the client of a proxied request is still there.

Once a request's body is read, ASGI has one message left for it, `http.disconnect`: a receive() left pending
completes only when the client hangs up. The gateway waits on that beside whatever it awaits from an endpoint, so
a client that leaves is let go at once, its endpoint's connection closed (vLLM aborts a request whose connection
closes), rather than when the endpoint answers or its read timeout (600 s) ends the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ClientLeft(Exception):
    """The client hung up before its answer was complete."""


class ClientWatch:
    """The pending receive() of one request whose body has been read."""

    def __init__(self, receive: Callable[[], Awaitable[Any]]) -> None:
        self._receive = receive
        self._gone: asyncio.Future[Any] | None = None
        self.was_cut = False
        """The gateway let the request go (`cut`), its client still there: it is told why, not dropped."""

    @property
    def gone(self) -> asyncio.Future[Any]:
        """Done once the client has left."""
        if self._gone is None:
            self._gone = asyncio.ensure_future(self._receive())
        return self._gone

    def left(self) -> bool:
        return self._gone is not None and self._gone.done()

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s`; whether the client left meanwhile."""
        await asyncio.wait({self.gone}, timeout=timeout_s)
        return self.gone.done()

    async def race(self, work: Awaitable[T]) -> T:
        """`work`'s result; ClientLeft, `work` cancelled, if the client leaves first."""
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait({task, self.gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled from outside (a stop): the work with it
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientLeft

    def cut(self) -> None:
        """The gateway stops and its drain is over: the request is let go as if its client had left, by the paths
        that let a leaving client go (in whatever wait it is), and `was_cut` tells them to answer it."""
        if self.left():
            return  # gone already: nobody to tell
        self.was_cut = True
        if self._gone is None:
            self._gone = asyncio.get_running_loop().create_future()
            self._gone.set_result(None)
        else:
            self._gone.cancel()  # the pending receive(): `gone` ends (cancelled) for its waiters and callbacks

    def close(self) -> None:
        if self._gone is not None:
            self._gone.cancel()
