"""A vLLM endpoint written by hand on asyncio streams, for tests that need one to misbehave in a precise way: it
answers the gateway's /metrics scrapes itself and hands every other request to the test's own handler."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from leadtime.router_plugin.discovery import StaticDiscovery, parse_static
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.heuristics import RoundRobinPolicy

METRICS = (
    b'vllm:num_requests_running{model_name="m"} 0\n'
    b'vllm:num_requests_waiting{model_name="m"} 0\n'
    b'vllm:gpu_cache_usage_perc{model_name="m"} 0.1\n'
)
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def next_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes | None:
    """The head of the next request that is not a /metrics scrape (those are answered here, idle), or None once
    the gateway closed the connection."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = next(
            (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
            0,
        )
        await reader.readexactly(length)
        if not head.startswith(b"GET /metrics"):
            return head
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(METRICS), METRICS))
        await writer.drain()


@contextlib.asynccontextmanager
async def gateway_in_front(port: int, settings: GatewaySettings | None = None) -> AsyncIterator[Gateway]:
    """An in-process gateway routing round-robin to the one endpoint on `port`, once it has scraped it."""
    spec = f"127.0.0.1:{port},name=e-0,leadtime.io/accelerator=h100-sxm"
    gateway = Gateway(StaticDiscovery(parse_static([spec])), RoundRobinPolicy(), settings or GatewaySettings())
    await gateway.start()
    try:
        for _ in range(200):
            if any(s.state is not None for s in gateway.routable()):
                break
            await asyncio.sleep(0.02)
        yield gateway
    finally:
        await gateway.stop()


@contextlib.asynccontextmanager
async def fleet_of(
    handlers: dict[str, Handler], policy: Any, settings: GatewaySettings | None = None
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, dict[str, asyncio.Server]]]:
    """An in-process gateway routing by `policy` in front of one hand-written endpoint per name in `handlers` (in
    that order), once it has scraped them all; a client of it."""
    servers = {name: await asyncio.start_server(h, "127.0.0.1", 0) for name, h in handlers.items()}
    specs = [
        f"127.0.0.1:{s.sockets[0].getsockname()[1]},name={name},leadtime.io/accelerator=h100-sxm"
        for name, s in servers.items()
    ]
    gateway = Gateway(StaticDiscovery(parse_static(specs)), policy, settings or GatewaySettings())
    await gateway.start()
    try:
        for _ in range(200):
            if len(gateway.routable()) == len(specs):
                break
            await asyncio.sleep(0.02)
        transport = httpx.ASGITransport(app=gateway)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
            yield gateway, client, servers
    finally:
        await gateway.stop()
        for s in servers.values():
            s.close()


def post_through(
    endpoint: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST `body` to /v1/completions through an in-process gateway in front of the hand-written `endpoint`; the
    whole answer."""

    async def go() -> httpx.Response:
        server = await asyncio.start_server(endpoint, "127.0.0.1", 0)
        try:
            async with gateway_in_front(server.sockets[0].getsockname()[1]) as gateway:
                transport = httpx.ASGITransport(app=gateway)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                    response = await client.post("/v1/completions", json=body, headers=headers)
                    await response.aread()
                    return response
        finally:
            server.close()

    return asyncio.run(go())


def write_endpoints(path: Path, names: dict[str, int]) -> None:
    """A discovery file listing one endpoint per name, at 127.0.0.1 and its port (replaced whole, as Kubernetes
    does)."""
    endpoints = [
        {"name": name, "address": "127.0.0.1", "port": port, "labels": {"leadtime.io/accelerator": "h100-sxm"}}
        for name, port in names.items()
    ]
    tmp = path.with_suffix(".new")
    tmp.write_text(json.dumps({"endpoints": endpoints}))
    tmp.replace(path)
