"""An asyncio server on a loop and thread of its own, for tests: an endpoint in another process answers while the
loop under test is busy, and this one does too."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def serve_in_a_thread(handler: Handler, tls: ssl.SSLContext | None = None) -> tuple[int, asyncio.AbstractEventLoop]:
    """Serve `handler` on a free loopback port (over TLS with `tls`); its port, and its loop (to stop it)."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    port: list[int] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(handler, "127.0.0.1", 0, ssl=tls))
        port.append(server.sockets[0].getsockname()[1])
        started.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    started.wait(10)
    return port[0], loop
