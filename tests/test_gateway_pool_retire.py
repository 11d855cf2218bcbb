"""An endpoint that leaves discovery takes its connection pool with it: every Kubernetes rollout replaces pods and
their addresses, and the gateway kept one pool per address it had ever sent to, for ever, with its idle keep-alive
connections. Its idle connections are closed at once; a request in flight to it (a pod draining) still completes,
its connection closed after; an address that comes back gets a fresh pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from raw_endpoint import STREAM_HEAD, next_request

from leadtime.router_plugin.gateway.upstream import UpstreamError, Upstreams

FIRST = b'data: {"choices":[{"index":0,"text":" a"}]}\n\n'
REST = b'data: {"choices":[{"index":0,"text":" b","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Endpoint:
    """A hand-written endpoint that streams two tokens to every request (its scrapes answered idle) and keeps
    track of the gateway's connections to it. With `hold` set, it waits for `release` after the first token."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed: set[int] = set()
        self.hold = False
        self.release = asyncio.Event()
        self.held: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        """The connection of the request held mid-stream, once it is."""
        self.served = 0

    @property
    def open(self) -> int:
        return self.opened - len(self.closed)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        connection = self.opened
        # cancelled as the test's loop ends, with a connection open: quietly
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            try:
                while await next_request(reader, writer) is not None:
                    writer.write(STREAM_HEAD + chunked(FIRST))
                    await writer.drain()
                    if self.hold and not self.held.done():
                        self.held.set_result(connection)
                        await self.release.wait()
                    writer.write(chunked(REST) + b"0\r\n\r\n")
                    await writer.drain()
                    self.served += 1
            finally:
                self.closed.add(connection)
                writer.close()


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def endpoint() -> AsyncIterator[tuple[Endpoint, int]]:
    e = Endpoint()
    server = await asyncio.start_server(e.handle, "127.0.0.1", 0)
    try:
        yield e, server.sockets[0].getsockname()[1]
    finally:
        server.close()


def test_closing_the_upstreams_closes_a_retired_pools_connections_still_in_flight() -> None:
    """A retired pool is no longer one of `Upstreams`' pools, but the gateway stopping still closes what it
    carries."""

    async def go() -> tuple[bool, bool, str]:
        async with endpoint() as (e1, port1):
            e1.hold = True
            upstreams = Upstreams(2.0)
            pool = upstreams.pool("127.0.0.1", port1)
            response = await pool.request("POST", "/v1/completions", body=b"{}", timeout_s=5.0)
            held = await asyncio.wait_for(e1.held, 5.0)
            upstreams.retire("127.0.0.1", port1)
            open_after_retire = held not in e1.closed
            upstreams.close()
            try:
                await response.read(5.0)
            except UpstreamError as err:
                kind = err.kind
            else:
                kind = "read whole"
            e1.release.set()  # the endpoint writes on, and finds its connection closed
            await until(lambda: held in e1.closed, 2.0)
            return open_after_retire, upstreams.pool("127.0.0.1", port1) is not pool, kind

    open_after_retire, fresh, kind = asyncio.run(go())
    assert open_after_retire
    assert fresh
    assert kind == "reset"
