"""A load generator for the gateway benchmark: a trace slice replayed open-loop from several processes.

One Python process saturates long before a fleet of mock endpoints does, so the schedule is dealt out to
`processes` workers (every k-th request to worker k); each runs an event loop that sends its requests at their
arrival times whatever happened to the previous ones, over the gateway's own lean HTTP client, and measures
what a client sees: time to the first token, mean gap between tokens, token count, status.

Prompts are made from the trace: each prefix block id of a request becomes the same 512 words wherever it
appears (the mock endpoints count a word as a token), so requests that share blocks share a prefix in text as
in the trace; a request's prompt is its blocks' words cut to its input length. Words are drawn from a fixed
pseudo-word vocabulary with English-like lengths (~5.7 bytes a word with its space).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any

import orjson

from leadtime.bench.procs import quietly
from leadtime.router_plugin.gateway.stream import StreamMeter
from leadtime.router_plugin.gateway.upstream import UpstreamError, UpstreamPool

BLOCK_WORDS = 512
_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
_WORD_LENGTHS = (1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 6, 6, 7, 7, 8, 9, 10, 11, 12)


@dataclass(frozen=True)
class Shot:
    """One request of the schedule."""

    index: int
    at_s: float
    blocks: tuple[int, ...]
    input_tokens: int
    max_tokens: int
    ttft_slo_ms: float
    itl_slo_ms: float
    target: str = ""
    """`host:port` to send to (the gateway's unless set)."""
    stream: bool = True
    """False: a client that asks for the whole answer at once (it sees no first token, only the answer's time)."""


@dataclass(frozen=True)
class Result:
    index: int
    status: int
    ttfb_ms: float
    ttft_ms: float
    itl_ms: float
    tokens: int
    expected_tokens: int
    endpoint: str
    route_ms: float
    error: str = ""
    stream: bool = True
    """False: a non-streaming request, whose client saw the whole answer after `ttfb_ms` and no TTFT or ITL."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.tokens == self.expected_tokens and not self.error

    def meets(self, ttft_slo_ms: float, itl_slo_ms: float) -> bool:
        """Whether its client saw both SLOs met (never, for a non-streaming request: its client sees neither)."""
        ok = self.ok and self.stream
        return ok and self.ttft_ms <= ttft_slo_ms and (self.tokens < 2 or self.itl_ms <= itl_slo_ms)


def vocabulary(size: int = 4096, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_LETTERS) for _ in range(rng.choice(_WORD_LENGTHS))) for _ in range(size)]


class PromptMaker:
    """The same words for the same block id, everywhere."""

    def __init__(self) -> None:
        self.words = vocabulary()
        self._blocks: dict[int, list[str]] = {}

    def block(self, block_id: int) -> list[str]:
        words = self._blocks.get(block_id)
        if words is None:
            rng = random.Random(block_id)
            words = self._blocks[block_id] = rng.choices(self.words, k=BLOCK_WORDS)
        return words

    def prompt(self, shot: Shot) -> str:
        words: list[str] = []
        for b in shot.blocks:
            words.extend(self.block(b))
            if len(words) >= shot.input_tokens:
                break
        rng = random.Random(shot.index * 7919 + 1)
        while len(words) < shot.input_tokens:  # a prompt longer than its blocks: unique words
            words.extend(rng.choices(self.words, k=BLOCK_WORDS))
        return " ".join(words[: shot.input_tokens])


def request_body(prompt: str, max_tokens: int, stream: bool = True) -> bytes:
    body: dict[str, Any] = {"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


async def send(pool: UpstreamPool, shot: Shot, body: bytes, timeout_s: float = 300.0) -> Result:
    """One request, streaming or not (`shot.stream`); the client's view of it."""
    headers = [
        (b"content-type", b"application/json"),
        (b"x-llm-d-slo-ttft-ms", str(shot.ttft_slo_ms).encode()),
        (b"x-llm-d-slo-tpot-ms", str(shot.itl_slo_ms).encode()),
    ]
    sent_ms = time.monotonic() * 1e3
    meter = StreamMeter()
    first_byte_ms = 0.0
    try:
        response = await pool.request("POST", "/v1/completions", headers, body, timeout_s)
        if not shot.stream:
            meter.feed_json(await response.read(timeout_s))
            first_byte_ms = time.monotonic() * 1e3
        while shot.stream and (chunk := await response.next_chunk(timeout_s)) is not None:
            now = time.monotonic() * 1e3
            if not first_byte_ms:
                first_byte_ms = now
            meter.feed(chunk, now)
    except UpstreamError as err:
        return Result(shot.index, 0, 0.0, 0.0, 0.0, meter.tokens, shot.max_tokens, "", 0.0, str(err), shot.stream)
    endpoint = (response.header(b"x-leadtime-endpoint") or b"").decode()
    route = float(response.header(b"x-leadtime-route-ms") or 0.0)
    ttft = (meter.first_ms - sent_ms) if meter.first_ms is not None else 0.0
    error = "" if response.status == 200 else f"status {response.status}"
    ttfb = (first_byte_ms - sent_ms) if first_byte_ms else 0.0
    return Result(
        shot.index,
        response.status,
        ttfb,
        ttft,
        meter.itl_ms(),
        meter.tokens,
        shot.max_tokens,
        endpoint,
        route,
        error,
        shot.stream,
    )


async def _replay(default_target: str, shots: list[Shot], start_wall: float) -> list[Result]:
    maker = PromptMaker()
    bodies = [request_body(maker.prompt(s), s.max_tokens, s.stream) for s in shots]
    pools: dict[str, UpstreamPool] = {}

    def pool(target: str) -> UpstreamPool:
        if target not in pools:
            host, _, port = target.rpartition(":")
            pools[target] = UpstreamPool(host, int(port), connect_timeout_s=10.0, max_idle=256)
        return pools[target]

    start = time.monotonic() + (start_wall - time.time())
    tasks = []
    for shot, body in zip(shots, bodies, strict=True):
        await asyncio.sleep(max(0.0, start + shot.at_s - time.monotonic()))
        tasks.append(asyncio.ensure_future(send(pool(shot.target or default_target), shot, body)))
    results = list(await asyncio.gather(*tasks))
    for p in pools.values():
        p.close()
    return results


def _worker(target: str, shots: list[Shot], start_wall: float, out: Any) -> None:
    import uvloop

    uvloop.install()
    results = asyncio.run(_replay(target, shots, start_wall))
    out.send([r.__dict__ for r in results])
    out.close()


def replay(target: str, shots: list[Shot], processes: int = 2, lead_s: float = 3.0) -> list[Result]:
    """Send `shots` to `target` (`host:port`) on their schedule from `processes` worker processes."""
    context = multiprocessing.get_context("spawn")
    start_wall = time.time() + lead_s + 0.5 * processes  # time to start the workers and build their prompts
    workers = []
    for k in range(processes):
        receive, out = context.Pipe(duplex=False)
        proc = context.Process(
            target=quietly, args=(_worker, target, shots[k::processes], start_wall, out), daemon=True
        )
        proc.start()
        workers.append((proc, receive))
    results: list[Result] = []
    for proc, receive in workers:
        results.extend(Result(**r) for r in receive.recv())
        proc.join()
    return sorted(results, key=lambda r: r.index)


def paired_probes(
    gateway: str,
    addresses: dict[str, str],
    n: int,
    words: int,
    first_index: int,
    slo: tuple[float, float],
    endpoint_tls: ssl.SSLContext | None = None,
) -> list[tuple[Result, Result | None]]:
    """`n` pairs, one request at a time over kept-alive connections: a request through `gateway`, then one of
    the same size straight to the endpoint it chose (`addresses`: endpoint id → host:port; over TLS with
    `endpoint_tls`, as the gateway reaches endpoints that serve HTTPS). Every prompt is new (no prefix shared), so
    both find the endpoint idle and cold."""

    async def run() -> list[tuple[Result, Result | None]]:
        maker = PromptMaker()
        pools: dict[str, UpstreamPool] = {}

        def pool(target: str) -> UpstreamPool:
            if target not in pools:
                host, _, port = target.rpartition(":")
                tls = endpoint_tls if target != gateway else None
                pools[target] = UpstreamPool(host, int(port), tls=tls)
            return pools[target]

        def shot(index: int, target: str = "") -> Shot:
            return Shot(index, 0.0, (10_000_000 + index,), words, 4, slo[0], slo[1], target)

        out: list[tuple[Result, Result | None]] = []
        for i in range(n):
            first = shot(first_index + 2 * i)
            via = await send(pool(gateway), first, request_body(maker.prompt(first), first.max_tokens))
            direct = None
            if via.ok and via.endpoint in addresses:
                second = shot(first_index + 2 * i + 1, addresses[via.endpoint])
                direct = await send(pool(second.target), second, request_body(maker.prompt(second), second.max_tokens))
            out.append((via, direct))
        for p in pools.values():
            p.close()
        return out

    import uvloop

    return uvloop.run(run())
