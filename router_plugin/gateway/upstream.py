"""A small asyncio HTTP/1.1 client for the gateway's upstream calls (proxied requests, /metrics scrapes).

The gateway's budget is a couple of milliseconds per request, and general-purpose async clients spend about
that much of their own per call on this machine; this one does only what a proxy needs: keep-alive connections
per endpoint, one write per request, httptools to parse the response, the body handed over chunk by chunk as it
arrives (de-chunked), with reading paused while the client is slower than the endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httptools

Headers = list[tuple[bytes, bytes]]
_PAUSE_BYTES = 1 << 20
REQUEST_FAILURE_KINDS = ("connect", "timeout", "reset", "malformed", "upgrade")
"""The `kind` of an UpstreamError a request sent on can fail with: the `kind` label of upstream_errors."""
SENT_AGAIN_METHODS = frozenset(("GET", "HEAD", "OPTIONS"))
"""Requests sent again on a new connection when the one they went out on closes before any byte of the answer: an
endpoint may have read such a request before closing (a request that crashes it), and only these are safe to repeat
(RFC 9110 9.2.2). A POST that generates tokens is not: sent again, a request that crashes its endpoint would
crash it twice (the gateway itself decides again, once, on another endpoint)."""
IDLE_REUSE_S = 4.0
"""Idle connections are reused this long at most, then closed: under the 5 s after which uvicorn, vLLM's server,
closes an idle one, so that a request (a POST is not sent again, `SENT_AGAIN_METHODS`) does not go out on a connection
the endpoint is closing at that moment."""


class UpstreamError(Exception):
    """The endpoint could not be reached, or the connection broke, or what it sent was not HTTP/1.1.

    `kind` says which (`REQUEST_FAILURE_KINDS`): `connect`, `timeout`, `reset`, `malformed` (not an HTTP/1.1
    response), `upgrade` (a protocol switch nobody asked for); scrapes add kinds of their own.

    `responded` says whether a response had started: before that, the request can go elsewhere.
    """

    def __init__(self, kind: str, message: str, responded: bool = False, refused: bool = False) -> None:
        self.kind = kind
        self.responded = responded
        self.refused = refused
        """The endpoint's port refused the connection (nothing listens): not a timeout, a name or TLS failure."""
        super().__init__(f"{kind}: {message}")


class Response:
    """An upstream response: status and headers at once, the body as it arrives."""

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.status = 0
        self.headers: Headers = []
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self.stopped = False
        self.error: UpstreamError | None = None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    # called by the connection
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _PAUSE_BYTES:
            self._connection.pause()
        self._wake()

    def _finish(self, error: UpstreamError | None = None) -> None:
        if error is not None and not self.complete:
            self.error = error
        self.complete = True
        self._wake()

    def stop_when(self, future: asyncio.Future[Any]) -> None:
        """Stop waiting for the body once `future` is done (the client left): `next_chunk` then returns None as at
        the body's end, and `stopped` tells the two apart."""
        future.add_done_callback(self._stop)

    def _stop(self, _: object) -> None:
        self.stopped = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_chunk(self, timeout_s: float | None = None) -> bytes | None:
        """The next piece of the body; None at its end (or once stopped); UpstreamError if the connection broke."""
        while not self._chunks:
            if self.complete:
                if self.error is not None:
                    raise self.error
                return None
            if self.stopped:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout_s is None:
                    await self._waiter
                else:
                    await asyncio.wait_for(self._waiter, timeout_s)
            except TimeoutError:
                self.close()
                raise UpstreamError("timeout", f"no data for {timeout_s} s", responded=True) from None
            finally:
                self._waiter = None
        data = self._chunks.popleft()
        self._buffered -= len(data)
        if self._buffered <= _PAUSE_BYTES // 2:
            self._connection.resume()
        return data

    async def chunks(self, timeout_s: float | None = None) -> AsyncIterator[bytes]:
        while (data := await self.next_chunk(timeout_s)) is not None:
            yield data

    async def read(self, timeout_s: float | None = None) -> bytes:
        return b"".join([c async for c in self.chunks(timeout_s)])

    def close(self) -> None:
        """Stop reading: a connection with an unfinished response is closed, not reused."""
        if not self.complete:
            self._connection.abort()
            self.complete = True


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.headers_ready: asyncio.Future[Response] | None = None
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        """When it was last released to the pool (`time.monotonic()`)."""

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's transports are not asyncio.Transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("upgrade", "unexpected upgrade", self._responded()))
        except httptools.HttpParserError as err:
            self._fail(UpstreamError("malformed", f"malformed response: {err}", self._responded()))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._discard(self)
        response = self.response
        if response is not None and not response.complete and self._responded() and self._until_close(response):
            response._finish()  # a response without a length ends with the connection
            return
        if response is None or not response.complete:
            self._fail(UpstreamError("reset", f"connection closed ({exc or 'by the endpoint'})", self._responded()))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.response = Response(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is None:
            return
        response.status = self.parser.get_status_code()
        if 100 <= response.status < 200:  # interim (100 Continue, 103 Early Hints): the answer follows it
            return
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None and 100 <= response.status < 200:
            self.response = None  # an interim response ends here; the parser reads the final one next
            return
        keep = self.parser.should_keep_alive()
        if response is not None:
            response._finish()
        self.response = None
        self.headers_ready = None
        if keep and not self.closed:
            self.resume()
            self.pool._release(self)
        else:
            self.abort()

    # helpers
    @staticmethod
    def _until_close(response: Response) -> bool:
        return response.header(b"content-length") is None and response.header(b"transfer-encoding") is None

    def _responded(self) -> bool:
        return self.headers_ready is not None and self.headers_ready.done()

    def _fail(self, error: UpstreamError) -> None:
        if self.headers_ready is not None and not self.headers_ready.done():
            self.headers_ready.set_exception(error)
        if self.response is not None:
            self.response._finish(error)
        self.abort()

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.abort()
        self.pool._discard(self)

    def send(self, data: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.headers_ready = asyncio.get_running_loop().create_future()
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(data)
        return self.headers_ready


class UpstreamPool:
    """Keep-alive connections to one endpoint.

    Parameters
    ----------
    host, port
        The endpoint.
    connect_timeout_s
        Budget to open a connection.
    max_idle
        Idle connections kept open for reuse.
    tls
        Speak TLS to the endpoint, verifying its certificate and host name with this context.
    """

    def __init__(
        self,
        host: str,
        port: int,
        connect_timeout_s: float = 2.0,
        max_idle: int = 64,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()
        self.retired = False
        """No longer kept for reuse (`retire`): a connection released is closed."""
        self._host_header = f"{host}:{port}".encode()

    async def _connect(self) -> _Connection:
        """A new connection, TLS negotiated after the TCP connection (`start_tls`) rather than by create_connection's
        `ssl`: uvloop's create_connection, given up on (the timeout, a caller cancelled) as its handshake fails, left
        its handshake future holding the error, logged as "Future exception was never retrieved" with a traceback;
        start_tls awaits that future alone, so that giving up cancels it."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, protocol = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
                if self.tls is not None:
                    tls_transport = await loop.start_tls(transport, protocol, self.tls, server_hostname=self.host)
                    if tls_transport is None:  # typed as optional: None only for a closed transport
                        raise ConnectionResetError("connection closed during the TLS handshake")
                    protocol.connection_made(tls_transport)  # start_tls does not call it
        except TimeoutError:
            message = f"{self.host}:{self.port} did not accept within {self.connect_timeout_s} s"
            raise UpstreamError("connect", message) from None
        except OSError as err:
            refused = isinstance(err, ConnectionRefusedError)
            said = "connection refused" if refused else err.strerror or err
            raise UpstreamError("connect", f"{self.host}:{self.port}: {said}", refused=refused) from None
        self._all.add(protocol)
        return protocol

    def _release(self, connection: _Connection) -> None:
        if connection.closed or self.retired or len(self._idle) >= self.max_idle:
            connection.abort()
        elif connection not in self._idle:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)

    def _reusable(self) -> _Connection | None:
        """The idle connection released last, closing those idle longer than `IDLE_REUSE_S` on the way; None when
        none is left."""
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since <= IDLE_REUSE_S:
                return connection
            connection.abort()
        return None

    def _discard(self, connection: _Connection) -> None:
        self._all.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)

    def encode(self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        lines = [f"{method} {path} HTTP/1.1".encode(), b"host: " + self._host_header]
        lines.extend(name + b": " + value for name, value in headers)
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(b"content-length: " + str(len(body)).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    async def request(
        self,
        method: str,
        path: str,
        headers: Sequence[tuple[bytes, bytes]] = (),
        body: bytes = b"",
        timeout_s: float | None = None,
    ) -> Response:
        """Send a request; returns once the response's status and headers are in.

        A request of `SENT_AGAIN_METHODS` on a reused connection that turns out closed before any byte of the
        response is sent again once on a new one (the endpoint closed it while idle); any other failure raises
        UpstreamError.
        """
        data = self.encode(method, path, headers, body)
        for attempt in (0, 1):
            connection = self._reusable()
            reused = connection is not None
            if connection is None:
                connection = await self._connect()
            if connection.closed:
                continue
            waiter = connection.send(data)
            try:
                return await (waiter if timeout_s is None else asyncio.wait_for(waiter, timeout_s))
            except TimeoutError:
                connection.abort()
                raise UpstreamError("timeout", f"no response within {timeout_s} s") from None
            except asyncio.CancelledError:  # the caller gave up (its client left): the endpoint is told so
                connection.abort()
                raise
            except UpstreamError as err:
                again = method in SENT_AGAIN_METHODS
                if again and reused and attempt == 0 and not err.responded and err.kind == "reset":
                    continue
                raise
        raise UpstreamError("reset", f"{self.host}:{self.port} closed the connection")

    def retire(self) -> None:
        """Keep no connection any more: the idle ones are closed now, those carrying a request once it is answered
        (a request streaming from an endpoint that left discovery, a pod draining, completes)."""
        self.retired = True
        for connection in list(self._idle):
            connection.abort()
        self._idle.clear()

    def close(self) -> None:
        for connection in list(self._all):
            connection.abort()
        self._idle.clear()


class Upstreams:
    """One pool per `host:port` (and whether it speaks TLS), created on first use, retired once no endpoint has it.

    `tls`: the context endpoints serving HTTPS are verified with (default: the system's trusted CAs)."""

    def __init__(self, connect_timeout_s: float = 2.0, tls: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._tls = tls
        self._pools: dict[tuple[str, int, bool], UpstreamPool] = {}
        self._retired: list[UpstreamPool] = []  # retired with requests in flight: closed too by `close`

    def pool(self, host: str, port: int, tls: bool = False) -> UpstreamPool:
        key = (host, port, tls)
        pool = self._pools.get(key)
        if pool is None:
            if tls and self._tls is None:
                self._tls = ssl.create_default_context()
            pool = self._pools[key] = UpstreamPool(host, port, self.connect_timeout_s, tls=self._tls if tls else None)
        return pool

    def retire(self, host: str, port: int) -> None:
        """Forget the pools of `host:port` (both schemes), which no endpoint has any more (it left discovery, as
        every rollout's pods do): kept, each would hold its idle connections for ever, and a gateway running for
        months would gather one per address it ever sent to. Retired, not closed: its idle connections are closed
        now, but those carrying a request are left to finish (`UpstreamPool.retire`), since closing would cut the
        streams of a pod draining. The address coming back gets a new pool."""
        self._retired = [pool for pool in self._retired if pool._all]
        for tls in (False, True):
            pool = self._pools.pop((host, port, tls), None)
            if pool is not None:
                pool.retire()
                if pool._all:
                    self._retired.append(pool)

    def close(self) -> None:
        for pool in [*self._pools.values(), *self._retired]:
            pool.close()
        self._pools.clear()
        self._retired.clear()
