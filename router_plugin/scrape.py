"""Each endpoint's load, scraped from its vLLM `/metrics` on an interval, with how stale it is.

One task per endpoint GETs `/metrics` every `interval_s` and parses it with `features.vllm_metrics` (requests
running and waiting, KV-cache usage under its old or new name, the cache's size, prefix-cache hit counters). The
state a router sees is the last good scrape, stamped with when it was asked for (`scraped_ms`, on the router's
clock): whatever the router sent after that is not in it. A failing scrape marks the endpoint; once it has failed
for `unroutable_after_s` the endpoint is no longer routed to, until a scrape succeeds again. An endpoint never
scraped successfully is not routed to either: nothing is known of it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from leadtime.features import vllm_metrics as vm
from leadtime.features.errors import FeatureError
from leadtime.features.rows import EndpointState
from leadtime.features.vllm_metrics import VllmMetrics, parse_vllm_metrics
from leadtime.router_plugin.discovery import SCHEME_LABEL, DiscoveredEndpoint
from leadtime.router_plugin.gateway.upstream import Response, UpstreamError, Upstreams

log = logging.getLogger("leadtime.router.scrape")

MAX_METRICS_BYTES = 8 << 20
"""A /metrics answer larger than this fails its scrape unread. vLLM's is tens to hundreds of kB (more with many
LoRA adapters); one of 50 MB, read every 50 ms, took 40 % of the gateway's core."""


def monotonic_ms() -> float:
    return time.monotonic() * 1e3


WANTED = tuple(name.encode() for name in vm.READ)


def wanted_lines(body: bytes) -> str:
    """Only the samples the router reads: a real vLLM's /metrics is hundreds of lines of histograms, and
    parsing all of them on every scrape would cost the gateway more than everything else it does."""
    keep = [line for line in body.split(b"\n") if line.startswith(WANTED)]
    return b"\n".join(keep).decode(errors="replace")


@dataclass
class EndpointScrape:
    """What is known of one endpoint's load."""

    endpoint: DiscoveredEndpoint
    state: EndpointState | None = None
    metrics: VllmMetrics | None = None
    scraped_ms: float = 0.0
    """When the last good scrape was asked for (router clock)."""
    failing_since_ms: float | None = None
    last_error: str = ""
    failing_for: str = ""
    """What kind of failure the scrapes have now (logged when it changes, not at every scrape)."""
    errors: int = 0
    scrapes: int = 0
    duration_s: float = 0.0


async def read_at_most(response: Response, limit: int, timeout_s: float, what: str = "/metrics") -> bytes:
    """The whole body within `timeout_s`, or UpstreamError: "too_large" (naming `what`) once it passes `limit` bytes,
    "timeout" once the time is up (the connection is closed, the rest unread). The bound is on the whole body, not
    on each piece: a server sending a byte at a time meets the latter and never the former. (It is kept here rather
    than by cancelling the read from outside, which a piece arriving as it fires swallows on Python 3.11.)"""
    length = (response.header(b"content-length") or b"").strip()
    if length.isdigit() and int(length) > limit:
        response.close()
        raise UpstreamError("too_large", f"{what} is larger than {limit >> 20} MiB ({int(length):,} bytes)", True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks, size = [], 0
    while True:
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise UpstreamError("timeout", "the body's time is up", True)
            chunk = await response.next_chunk(left)
        except UpstreamError as err:
            if err.kind != "timeout":
                raise
            response.close()
            raise UpstreamError("timeout", f"{what} not read whole within {timeout_s:g} s", True) from None
        if chunk is None:
            break
        size += len(chunk)
        if size > limit:
            response.close()
            raise UpstreamError("too_large", f"{what} is larger than {limit >> 20} MiB", True)
        chunks.append(chunk)
    return b"".join(chunks)


class Scraper:
    """Scrapes every discovered endpoint's `/metrics` on an interval.

    Parameters
    ----------
    upstreams
        Connection pools (shared with the proxy).
    interval_s
        Time between two scrapes of one endpoint (llm-d's default refresh is 50 ms).
    timeout_s
        Budget of one scrape.
    unroutable_after_s
        How long an endpoint may fail its scrapes before it is no longer routed to.
    default_accelerator, default_model
        For endpoints whose labels name none.
    clock
        Milliseconds on the router's clock.
    on_scrape
        Called after every good scrape (the gateway sizes its prefix index from the cache's size).
    """

    def __init__(
        self,
        upstreams: Upstreams,
        interval_s: float = 0.05,
        timeout_s: float = 1.0,
        unroutable_after_s: float = 3.0,
        default_accelerator: str = "",
        default_model: str = "",
        clock: Callable[[], float] = monotonic_ms,
        on_scrape: Callable[[EndpointScrape], None] | None = None,
    ) -> None:
        self.upstreams = upstreams
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unroutable_after_s = unroutable_after_s
        self.default_accelerator = default_accelerator
        self.default_model = default_model
        self.clock = clock
        self.on_scrape = on_scrape
        self.scrapes: dict[str, EndpointScrape] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def sync(self, endpoints: Iterable[DiscoveredEndpoint]) -> None:
        """Scrape exactly these endpoints: start tasks for new ones, stop those that left or changed."""
        wanted = {e.endpoint_id: e for e in endpoints}
        for endpoint_id in list(self._tasks):
            if endpoint_id not in wanted or self.scrapes[endpoint_id].endpoint != wanted[endpoint_id]:
                self._tasks.pop(endpoint_id).cancel()
                self.scrapes.pop(endpoint_id, None)
        for endpoint_id, endpoint in wanted.items():
            if endpoint_id not in self._tasks:
                self.scrapes[endpoint_id] = EndpointScrape(endpoint)
                self._tasks[endpoint_id] = asyncio.get_running_loop().create_task(self._loop(endpoint_id))

    async def _loop(self, endpoint_id: str) -> None:
        while True:
            started = time.monotonic()
            scrape = self.scrapes.get(endpoint_id)
            if scrape is None:
                return
            await self.scrape_once(scrape)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def scrape_once(self, scrape: EndpointScrape) -> None:
        endpoint = scrape.endpoint
        asked_ms = self.clock()
        started = time.perf_counter()
        try:
            pool = self.upstreams.pool(endpoint.address, endpoint.port, endpoint.tls)
            response = await pool.request("GET", "/metrics", timeout_s=self.timeout_s)
            body = await read_at_most(response, MAX_METRICS_BYTES, self.timeout_s)
            if response.status != 200:
                raise UpstreamError("status", f"/metrics answered {response.status}", responded=True)
            metrics = parse_vllm_metrics(wanted_lines(body))
            state = metrics.endpoint_state(
                scrape.state or endpoint.base_state(self.default_accelerator, self.default_model)
            )
        except (UpstreamError, FeatureError) as err:
            scrape.errors += 1
            scrape.last_error = f"{err}{_scheme_hint(endpoint, err)}"
            kind = err.kind if isinstance(err, UpstreamError) else f"metrics:{err.field}"
            if scrape.failing_since_ms is None:
                scrape.failing_since_ms = asked_ms
                log.warning("scrape of %s failed: %s", endpoint.endpoint_id, scrape.last_error)
            elif kind != scrape.failing_for:
                log.warning("scrape of %s failed, now for another reason: %s", endpoint.endpoint_id, scrape.last_error)
            scrape.failing_for = kind
            return
        finally:
            scrape.duration_s = time.perf_counter() - started
            scrape.scrapes += 1
        if scrape.failing_since_ms is not None:
            log.info("scrape of %s succeeds again", endpoint.endpoint_id)
        scrape.metrics, scrape.state, scrape.scraped_ms = metrics, state, asked_ms
        scrape.failing_since_ms = None
        scrape.last_error = scrape.failing_for = ""
        if self.on_scrape is not None:
            self.on_scrape(scrape)

    def routable(self, scrape: EndpointScrape, now_ms: float) -> bool:
        """Scraped successfully at least once, and not failing for longer than `unroutable_after_s`."""
        if scrape.state is None:
            return False
        return scrape.failing_since_ms is None or now_ms - scrape.failing_since_ms < self.unroutable_after_s * 1e3

    def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()


def _scheme_hint(endpoint: DiscoveredEndpoint, err: Exception) -> str:
    """What to change when a plain-HTTP scrape is closed unanswered: an endpoint serving HTTPS (vLLM with
    `--ssl-certfile`) ends a plain request's connection at its TLS handshake, and the scrape said only "connection
    closed"."""
    if not endpoint.tls and isinstance(err, UpstreamError) and err.kind == "reset" and not err.responded:
        return f" (if it serves HTTPS, label it {SCHEME_LABEL}: https)"
    return ""
