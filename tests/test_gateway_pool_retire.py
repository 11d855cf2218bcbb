"""An endpoint that leaves discovery takes its connection pool with it: every Kubernetes rollout replaces pods and
their addresses, and the gateway kept one pool per address it had ever sent to, for ever, with its idle keep-alive
connections. Its idle connections are closed at once; a request in flight to it (a pod draining) still completes,
its connection closed after; an address that comes back gets a fresh pool."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from raw_endpoint import STREAM_HEAD, next_request, write_endpoints

from leadtime.features.vllm_metrics import parse_samples
from leadtime.router_plugin.discovery import FileDiscovery
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.gateway.upstream import UpstreamError, Upstreams
from leadtime.router_plugin.heuristics import RoundRobinPolicy
from leadtime.router_plugin.policy import Candidate, Pick, RouteRequest, RoutingPolicy

FIRST = b'data: {"choices":[{"index":0,"text":" a"}]}\n\n'
REST = b'data: {"choices":[{"index":0,"text":" b","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
STREAMING = {"prompt": "hi", "max_tokens": 2, "stream": True}


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
async def gateway_on(
    path: Path, names: dict[str, int], policy: RoutingPolicy | None = None, decide_in_thread: bool = False
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """A gateway reading discovery from `path` (polled every 20 ms), once it can route to every name; round-robin
    unless given a `policy`."""
    write_endpoints(path, names)
    settings = GatewaySettings(discovery_poll_s=0.02, scrape_interval_s=0.01)
    gateway = Gateway(FileDiscovery(path), policy or RoundRobinPolicy(), settings, decide_in_thread=decide_in_thread)
    await gateway.start()
    try:
        await until(lambda: len(gateway.routable()) == len(names))
        transport = httpx.ASGITransport(app=gateway)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
            yield gateway, client
    finally:
        await gateway.stop()


@contextlib.asynccontextmanager
async def endpoint() -> AsyncIterator[tuple[Endpoint, int]]:
    e = Endpoint()
    server = await asyncio.start_server(e.handle, "127.0.0.1", 0)
    try:
        yield e, server.sockets[0].getsockname()[1]
    finally:
        server.close()


def pooled(gateway: Gateway, port: int) -> bool:
    return any(key[:2] == ("127.0.0.1", port) for key in gateway.upstreams._pools)


def test_an_endpoint_leaving_discovery_has_its_idle_connections_closed_and_its_pool_forgotten(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.json"

    async def go() -> tuple[int, bool, int, bool]:
        async with (
            endpoint() as (e1, port1),
            endpoint() as (_, port2),
            gateway_on(path, {"e-1": port1, "e-2": port2}) as (gateway, client),
        ):
            while e1.served == 0:  # round robin: e-1 within two requests
                response = await client.post("/v1/completions", json=STREAMING)
                assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
            idle_before, pooled_before = e1.open, pooled(gateway, port1)
            write_endpoints(path, {"e-2": port2})
            await until(lambda: "e-1" not in gateway.scraper.scrapes)
            with contextlib.suppress(TimeoutError):
                await until(lambda: e1.open == 0, 2.0)
            return idle_before, pooled_before, e1.open, pooled(gateway, port1)

    idle_before, pooled_before, still_open, still_pooled = asyncio.run(go())
    assert idle_before >= 1 and pooled_before  # the request's connection (and the scrapes') kept for reuse
    assert still_open == 0  # the endpoint saw every connection close
    assert not still_pooled


def test_a_stream_in_flight_to_an_endpoint_leaving_discovery_completes_and_its_connection_is_closed(
    tmp_path: Path,
) -> None:
    """A pod draining goes out of discovery while it still streams: its answer must reach the client whole."""
    path = tmp_path / "endpoints.json"

    async def go() -> tuple[httpx.Response, bool, bool, int]:
        async with endpoint() as (e1, port1):
            e1.hold = True
            async with gateway_on(path, {"e-1": port1}) as (gateway, client):
                asked = asyncio.create_task(client.post("/v1/completions", json=STREAMING))
                held = await asyncio.wait_for(e1.held, 5.0)
                write_endpoints(path, {})
                await until(lambda: not gateway.scraper.scrapes and not pooled(gateway, port1))
                cut_early = held in e1.closed
                e1.release.set()
                response = await asyncio.wait_for(asyncio.shield(asked), 5.0)
                with contextlib.suppress(TimeoutError):
                    await until(lambda: held in e1.closed, 2.0)
                return response, cut_early, held in e1.closed, e1.open

    response, cut_early, closed_after, still_open = asyncio.run(go())
    assert not cut_early
    assert response.status_code == 200
    assert response.headers["x-leadtime-endpoint"] == "e-1"
    assert response.text.count('"text":') == 2 and response.text.endswith("data: [DONE]\n\n"), response.text
    assert closed_after  # not kept idle in a pool nobody reaches any more
    assert still_open == 0


def test_an_endpoint_back_in_discovery_is_served_again_on_a_fresh_pool(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.json"

    async def go() -> tuple[httpx.Response, bool, int]:
        async with endpoint() as (e1, port1), gateway_on(path, {"e-1": port1}) as (gateway, client):
            assert (await client.post("/v1/completions", json=STREAMING)).status_code == 200
            retired = gateway.upstreams._pools[("127.0.0.1", port1, False)]
            write_endpoints(path, {})
            await until(lambda: not pooled(gateway, port1) and e1.open == 0)
            write_endpoints(path, {"e-1": port1})
            await until(lambda: len(gateway.routable()) == 1)
            response = await client.post("/v1/completions", json=STREAMING)
            fresh = gateway.upstreams._pools[("127.0.0.1", port1, False)]
            return response, fresh is not retired, e1.open

    response, fresh, still_open = asyncio.run(go())
    assert response.status_code == 200 and response.headers["x-leadtime-endpoint"] == "e-1"
    assert response.text.endswith("data: [DONE]\n\n")
    assert fresh
    assert still_open >= 1  # its connections kept for reuse again


def test_an_endpoint_renamed_at_the_same_address_keeps_its_pool(tmp_path: Path) -> None:
    """A name leaving discovery while another takes its address in the same change (discovery refuses two names at
    one address:port at once): the pool is still in use, its connections kept."""
    path = tmp_path / "endpoints.json"

    async def go() -> tuple[bool, int, int]:
        async with endpoint() as (e1, port1), gateway_on(path, {"e-1": port1}) as (gateway, client):
            assert (await client.post("/v1/completions", json=STREAMING)).status_code == 200
            pool = gateway.upstreams._pools[("127.0.0.1", port1, False)]
            write_endpoints(path, {"e-1b": port1})
            await until(lambda: set(gateway.scraper.scrapes) == {"e-1b"})
            await asyncio.sleep(0.1)  # a few more polls
            response = await client.post("/v1/completions", json=STREAMING)
            assert response.status_code == 200 and response.headers["x-leadtime-endpoint"] == "e-1b"
            return gateway.upstreams._pools.get(("127.0.0.1", port1, False)) is pool, len(pool._idle), e1.open

    kept, idle, still_open = asyncio.run(go())
    assert kept
    assert idle >= 1 and still_open >= 1  # still keeping connections for reuse


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


class SlowFirstDecision(RoundRobinPolicy):
    """Picks the candidate whose id sorts first; its first decision takes until `go` is set (a decision queued
    behind others on the decision thread, or a slow predictor), the others none."""

    def __init__(self) -> None:
        super().__init__()
        self.deciding = threading.Event()
        self.go = threading.Event()
        self.picked: list[str] = []
        self.abandoned: list[str] = []

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        self.deciding.set()
        if not self.picked:
            self.go.wait(10)
        self.picked.append(min(c.endpoint_id for c in candidates))
        return Pick(self.picked[-1])

    def abandon(self, request_id: str) -> None:
        self.abandoned.append(request_id)


def test_an_endpoint_leaving_discovery_while_a_decision_picks_it_has_the_request_decided_again(
    tmp_path: Path,
) -> None:
    """Regression: with decisions on their own thread, a discovery reload that dropped the endpoint being picked
    (a pod rolled) made the request fail with a KeyError out of the gateway (a 500 and a traceback). A pod gone
    gets no new request: the request is decided again on the endpoints left, which is no retry."""
    path = tmp_path / "endpoints.json"
    policy = SlowFirstDecision()

    async def go() -> tuple[httpx.Response, dict[str, Any]]:
        async with (
            endpoint() as (e1, port1),
            endpoint() as (_, port2),
            gateway_on(path, {"e-1": port1, "e-2": port2}, policy, decide_in_thread=True) as (gateway, client),
        ):
            request = asyncio.ensure_future(client.post("/v1/completions", json=STREAMING))
            await until(policy.deciding.is_set)
            write_endpoints(path, {"e-2": port2})  # e-1 leaves while it is being picked
            await until(lambda: "e-1" not in gateway.scraper.scrapes)
            policy.go.set()
            response = await request
            assert e1.served == 0
            return response, parse_samples((await client.get("/metrics")).text)

    response, samples = asyncio.run(go())
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert response.headers["x-leadtime-endpoint"] == "e-2"
    assert policy.picked == ["e-1", "e-2"]
    assert policy.abandoned == ["gw-1"]  # the first decision let go of, as for a request that failed
    assert samples.get("leadtime_router_retries_total") == [({}, 0.0)]
