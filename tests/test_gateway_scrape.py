"""Scraping endpoints that misbehave: an endpoint's /metrics is read on every interval, so what it sends must not
cost the gateway more than a scrape, and why a scrape fails must be said when it changes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import pytest
import uvloop
from raw_endpoint import METRICS

from leadtime.router_plugin.discovery import parse_static
from leadtime.router_plugin.gateway.upstream import Upstreams
from leadtime.router_plugin.scrape import MAX_METRICS_BYTES, EndpointScrape, Scraper

GOOD = METRICS


def scraping(answers: list[Callable[[], bytes]]) -> list[tuple[bool, str]]:
    """Scrape an endpoint whose /metrics answers are `answers`, one per scrape; after each, whether a state is
    known and the scrape's last error."""

    async def go() -> list[tuple[bool, str]]:
        served = iter(answers)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                body = next(served)()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        (endpoint,) = parse_static([f"127.0.0.1:{port},name=e"])
        scraper = Scraper(Upstreams(2.0))
        scrape = EndpointScrape(endpoint)
        seen = []
        for _ in answers:
            await scraper.scrape_once(scrape)
            seen.append((scrape.state is not None, scrape.last_error))
        server.close()
        return seen

    return asyncio.run(go())


def test_a_metrics_body_larger_than_the_cap_fails_the_scrape_unread() -> None:
    """50 MB of /metrics every 50 ms took 40 % of a core to read and parse: beyond the cap it is not read."""
    huge = b"# padding\n" * (MAX_METRICS_BYTES // 10 + 1) + GOOD
    seen = scraping([lambda: GOOD, lambda: huge])
    assert seen[0] == (True, "")
    assert f"larger than {MAX_METRICS_BYTES // (1 << 20)} MiB" in seen[1][1]


def test_a_scrape_failing_for_a_new_reason_says_the_new_one(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="leadtime.router.scrape"):
        negative = METRICS.replace(b'running{model_name="m"} 0', b'running{model_name="m"} -1')
        scraping([lambda: b"garbage{", lambda: b"garbage{", lambda: negative])
    said = [r.getMessage() for r in caplog.records if r.name == "leadtime.router.scrape"]
    assert len(said) == 2 and all(m.startswith("scrape of e failed") for m in said), said


def test_a_timeslice_document_larger_than_a_discovery_file_is_not_read_from_an_orchestrator() -> None:
    """The HTTP source read the whole body, however large (a file source stops at discovery's 1 MiB)."""
    from leadtime.router_plugin.discovery import MAX_FILE_BYTES
    from leadtime.router_plugin.timeslice_sources import HttpTimesliceSource

    async def go() -> tuple[str | None, bool]:
        body = b'{"groups": {"rl": {"state": "LOCKED"}}, "pad": "' + b"x" * MAX_FILE_BYTES + b'"}'

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")  # no length to refuse it by
            for start in range(0, len(body), 65536):
                chunk = body[start : start + 65536]
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        source = HttpTimesliceSource(f"http://127.0.0.1:{port}/groups", Upstreams(2.0), lambda: 0.0)
        await source.poll()
        server.close()
        return source.last_error, source.status("rl") is None

    error, nothing = asyncio.run(go())
    assert nothing and "the time-slice document is larger than 1 MiB" in (error or ""), error


def dribbling(body: bytes) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A server answering any request with `body`, a byte every millisecond."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
        with contextlib.suppress(OSError, asyncio.CancelledError):
            for i in range(len(body)):
                writer.write(body[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.001)

    return handle


def test_an_orchestrator_dribbling_its_answer_fails_the_poll_within_its_timeout() -> None:
    """The time-slice poll's timeout bounded the wait for the answer's head and for each piece of its body, not the
    whole: an orchestrator sending its answer a byte at a time held the watcher for minutes, while /readyz and the
    states' age said nothing was wrong and the gateway routed on states the orchestrator had moved on from. (A
    bound cancelling the read from outside is not enough: on Python 3.11 a piece arriving as it fires swallows the
    cancellation, and the read went on for 24 s.)"""
    from leadtime.router_plugin.timeslice_sources import HttpTimesliceSource

    async def go() -> tuple[str | None, float]:
        body = b'{"groups": {"rl": {"state": "LOCKED"}}, "pad": "' + b"x" * 20_000 + b'"}'

        server = await asyncio.start_server(dribbling(body), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        longest, url = 0.0, f"http://127.0.0.1:{port}/groups"
        for _ in range(40):  # a piece arriving as the bound fires: one poll in 20 or so
            source = HttpTimesliceSource(url, Upstreams(2.0), lambda: 0.0, timeout_s=0.1)
            started = time.monotonic()
            await source.poll()
            longest = max(longest, time.monotonic() - started)
        server.close()
        return source.last_error, longest

    error, longest = uvloop.run(go())  # the gateway's loop
    assert longest < 0.5 and "timeout" in (error or "") and "0.1 s" in (error or ""), (error, longest)


def test_an_endpoint_dribbling_its_metrics_fails_the_scrape_within_its_timeout() -> None:
    """A scrape's timeout bounded the wait for each piece of /metrics, not the whole: an endpoint sending its
    metrics a byte at a time kept one scrape going for as long as it liked, never failing, so the gateway routed to
    it on its last state, however old, and /readyz named nothing."""

    async def go() -> tuple[str, float]:
        body = METRICS + b"# " + b"x" * 20_000 + b"\n"

        server = await asyncio.start_server(dribbling(body), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        (endpoint,) = parse_static([f"127.0.0.1:{port},name=e"])
        scraper = Scraper(Upstreams(2.0), timeout_s=0.1)
        scrape = EndpointScrape(endpoint)
        started = time.monotonic()
        await scraper.scrape_once(scrape)
        took = time.monotonic() - started
        server.close()
        return scrape.last_error, took

    error, took = uvloop.run(go())  # the gateway's loop
    assert took < 0.5 and "timeout" in error and "0.1 s" in error, (error, took)
