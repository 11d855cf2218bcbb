"""Mock vLLM endpoints: the simulated replicas run in real time behind OpenAI-compatible HTTP servers.

Each endpoint of the fleet gets its own server on 127.0.0.1 (port base_port + i) with `/v1/completions`,
`/v1/chat/completions` (streaming or not), `/v1/models`, `/health` and `/metrics` in vLLM's metric names, so the
scraper, the gateway and end-to-end tests talk real HTTP to something that queues, batches and slows down like
vLLM. Steps are paced on the wall clock by the same step-time model and scheduler as the simulator (one step
at a time, no closed-form decode runs). Prompts are tokenised as whitespace-separated words; prefix caching
works on 16-word blocks of them. Time-slice groups swap in real time. Every endpoint serves requests end to
end whatever its role (the role is reported as a label; P/D routing is the gateway's business).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from leadtime.features.errors import FeatureError
from leadtime.features.prefix import block_hashes
from leadtime.features.rows import is_resident
from leadtime.predictor.service.edge import (
    feature_error_handler,
    http_error_handler,
    unexpected_error_handler,
    validation_error_handler,
)
from leadtime.simulator.endpoint import Endpoint, SimRequest
from leadtime.simulator.engine import build_endpoints
from leadtime.simulator.fleet import EndpointConfig, Fleet, TimesliceGroup

PREFIX_BLOCK_WORDS = 16


class CompletionBody(BaseModel):
    """The body of /v1/completions (unknown fields are accepted, as vLLM does)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1, le=32768)
    stream: bool = False


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class ChatBody(BaseModel):
    """The body of /v1/chat/completions (unknown fields are accepted, as vLLM does)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32768)
    stream: bool = False


@dataclass
class Counters:
    """The token and request counters /metrics reports."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0


@dataclass
class LiveEndpoint:
    """One endpoint driven on the wall clock, with a token queue per in-flight request."""

    config: EndpointConfig
    engine: Endpoint
    model_name: str
    streams: dict[int, asyncio.Queue[int | None]] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    timeslice_state: str = "none"
    wake: asyncio.Event | None = None
    origin: float = field(default_factory=time.monotonic)

    def now_ms(self) -> float:
        """Milliseconds since the endpoint started."""
        return (time.monotonic() - self.origin) * 1e3

    async def drive(self) -> None:
        """Run steps back to back in real time; sleep when there is nothing to do."""
        assert self.wake is not None
        while True:
            plan = self.engine.start_step(self.now_ms())
            if plan is None:
                self.wake.clear()
                await self.wake.wait()
                continue
            await asyncio.sleep(max(0.0, (plan.end_ms - self.now_ms()) / 1e3))
            before = {id(r): r.generated for r, _ in plan.entries}
            outcome = self.engine.finish_step()
            for r, _ in plan.entries:
                queue = self.streams.get(r.rid)
                if queue is None:
                    continue
                for _ in range(r.generated - before[id(r)]):
                    queue.put_nowait(1)
                    self.counters.generation_tokens += 1
            for r in outcome.finished:
                self.counters.requests_finished += 1
                queue = self.streams.pop(r.rid, None)
                if queue is not None:
                    queue.put_nowait(None)

    def submit(self, rid: int, words: list[str], max_tokens: int) -> asyncio.Queue[int | None]:
        """Queue a request of these words; its tokens arrive on the returned queue (None ends it)."""
        ids = [zlib.crc32(w.encode()) for w in words]
        request = SimRequest(
            rid,
            self.now_ms(),
            max(1, len(ids)),
            max_tokens,
            tuple(block_hashes(ids, PREFIX_BLOCK_WORDS)),
            PREFIX_BLOCK_WORDS,
        )
        needed = self.engine.cache.blocks_for(request.input_tokens + max_tokens)
        if needed > self.engine.cache.total_blocks:
            raise FeatureError("prompt", "prompt plus max_tokens exceed this endpoint's KV cache")
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.streams[rid] = queue
        self.counters.prompt_tokens += request.input_tokens
        self.engine.enqueue(request)
        assert self.wake is not None
        self.wake.set()
        return queue

    def metrics(self) -> str:
        """/metrics in vLLM's metric names."""
        e = self.engine
        label = f'model_name="{self.model_name}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{label}}} {len(e.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{label}}} {len(e.waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{label}}} {e.cache.usage():.6f}",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig.",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{e.cache.block_size}",num_gpu_blocks="{e.cache.total_blocks}",'
            f"{label}}} 1.0",
            "# HELP vllm:num_preemptions_total Cumulative number of preemptions.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{label}}} {e.preemptions}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{label}}} {self.counters.prompt_tokens}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{label}}} {self.counters.generation_tokens}",
            "# HELP leadtime_sim_timeslice_resident Whether the endpoint's time-slice group is resident.",
            "# TYPE leadtime_sim_timeslice_resident gauge",
            f"leadtime_sim_timeslice_resident{{{label}}} {1 if is_resident(self.timeslice_state) else 0}",
        ]
        return "\n".join(lines) + "\n"


def _words(text: str) -> list[str]:
    return text.split() or [""]


def build_app(live: LiveEndpoint) -> FastAPI:
    """The HTTP face of one simulated endpoint. Errors answer in the predictor service's JSON shape
    (`{"error", "field", "detail"}`); a request naming a model the endpoint does not serve is a 404, as in vLLM."""
    app = FastAPI(title=f"leadtime mock vLLM {live.config.endpoint_id}")
    app.add_exception_handler(FeatureError, feature_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
    ids = itertools.count(1)

    def check_model(model: str | None) -> None:
        if model is not None and model != live.model_name:
            raise HTTPException(404, f"The model `{model}` does not exist.")  # vLLM's words

    async def tokens(queue: asyncio.Queue[int | None]) -> AsyncIterator[int]:
        index = 0
        while await queue.get() is not None:
            yield index
            index += 1

    def completion_json(kind: str, rid: int, text_pieces: list[str], prompt_tokens: int) -> dict[str, object]:
        text = "".join(text_pieces)
        if kind == "chat":
            choice: dict[str, object] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        return {
            "id": f"cmpl-{live.config.endpoint_id}-{rid}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": live.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(text_pieces),
                "total_tokens": prompt_tokens + len(text_pieces),
            },
        }

    async def respond(kind: str, words: list[str], max_tokens: int, stream: bool) -> object:
        rid = next(ids)
        queue = live.submit(rid, words, max_tokens)
        prompt_tokens = len(words)
        if not stream:
            pieces = [f" tok{i}" async for i in tokens(queue)]
            return completion_json(kind, rid, pieces, prompt_tokens)

        async def events() -> AsyncIterator[str]:
            created = int(time.time())
            async for i in tokens(queue):
                if kind == "chat":
                    choice: dict[str, object] = {"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}
                    obj = "chat.completion.chunk"
                else:
                    choice = {"index": 0, "text": f" tok{i}", "finish_reason": None}
                    obj = "text_completion"
                chunk = {
                    "id": f"cmpl-{live.config.endpoint_id}-{rid}",
                    "object": obj,
                    "created": created,
                    "model": live.model_name,
                    "choices": [choice],
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody) -> object:
        check_model(body.model)
        prompt = body.prompt if isinstance(body.prompt, str) else " ".join(body.prompt)
        return await respond("text", _words(prompt), body.max_tokens, body.stream)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatBody) -> object:
        check_model(body.model)
        words = _words(" ".join(m.content for m in body.messages))
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        return await respond("chat", words, max_tokens, body.stream)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": live.model_name, "object": "model", "owned_by": "leadtime-sim"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        return live.metrics()

    return app


async def _timeslice(group: TimesliceGroup, members: list[LiveEndpoint], seed: int) -> None:
    """Cycle a group on the wall clock: resident → parked → switching → resident."""
    import random

    rng = random.Random(seed)
    for m in members:
        m.timeslice_state = "resident"
    while True:
        await asyncio.sleep(group.resident_ms.draw(rng) / 1e3)
        for m in members:
            m.timeslice_state = "parked"
            m.engine.request_park(m.now_ms())
        await asyncio.sleep(group.away_ms.draw(rng) / 1e3)
        for m in members:
            m.timeslice_state = "switching"
        await asyncio.sleep(group.restore_ms.draw(rng) / 1e3)
        for m in members:
            m.timeslice_state = "resident"
            m.engine.resume()
            assert m.wake is not None
            m.wake.set()


class FleetServer:
    """All endpoints of a fleet served from one background thread and event loop.

    Parameters
    ----------
    fleet
        Parsed fleet.
    ports
        One port per endpoint, in fleet order.
    host
        Bind address.
    model_name
        Name reported by the OpenAI API (default: the pool's model slug).
    seed
        Seeds the time-slice windows.
    """

    def __init__(
        self, fleet: Fleet, ports: list[int], host: str = "127.0.0.1", model_name: str | None = None, seed: int = 0
    ) -> None:
        if len(ports) != len(fleet.endpoints):
            raise ValueError(f"need {len(fleet.endpoints)} ports, got {len(ports)}")
        self.fleet = fleet
        self.ports = ports
        self.host = host
        self.seed = seed
        engines = build_endpoints(fleet, decode_runs=False)
        pairs = zip(fleet.endpoints, engines, strict=True)
        self.live = [LiveEndpoint(cfg, engine, model_name or cfg.model) for cfg, engine in pairs]
        self._servers: list[uvicorn.Server] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def urls(self) -> dict[str, str]:
        """The base URL of every endpoint."""
        return {
            cfg.endpoint_id: f"http://{self.host}:{port}"
            for cfg, port in zip(self.fleet.endpoints, self.ports, strict=True)
        }

    async def _main(self) -> None:
        tasks = []
        for live, port in zip(self.live, self.ports, strict=True):
            live.wake = asyncio.Event()
            live.origin = time.monotonic()
            tasks.append(asyncio.create_task(live.drive()))
            config = uvicorn.Config(build_app(live), host=self.host, port=port, log_level="warning", lifespan="off")
            server = uvicorn.Server(config)
            self._servers.append(server)
        for i, (name, group) in enumerate(self.fleet.timeslice_groups.items()):
            members = [m for m in self.live if m.config.timeslice_group == name]
            if members:
                tasks.append(asyncio.create_task(_timeslice(group, members, self.seed + i)))
        serving = [asyncio.create_task(s.serve()) for s in self._servers]
        while not all(s.started for s in self._servers):
            if any(t.done() for t in serving):
                break
            await asyncio.sleep(0.01)
        self._ready.set()
        await asyncio.gather(*serving, return_exceptions=True)
        for t in tasks:
            t.cancel()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # reported to the starting thread
            self._error = err
            self._ready.set()

    def start(self, timeout_s: float = 15.0) -> None:
        """Start serving; OSError if some port cannot be bound or the servers do not start in time."""
        self._thread = threading.Thread(target=self._run, name="leadtime-sim-serve", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise OSError("mock endpoints did not start in time")
        if self._error is not None:
            raise OSError(f"mock endpoints failed to start: {self._error}")
        if not all(s.started for s in self._servers):
            self.stop()
            raise OSError(f"could not bind every port of {self.ports} on {self.host}")

    def stop(self) -> None:
        """Stop every server and wait for the thread."""
        for server in self._servers:
            server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def wait(self) -> None:
        """Block until the servers stop."""
        if self._thread is not None:
            self._thread.join()


def serve_fleet(fleet: Fleet, host: str = "127.0.0.1", base_port: int = 8100, model_name: str | None = None) -> None:
    """Serve until interrupted (the `leadtime sim serve` command)."""
    ports = [base_port + i for i in range(len(fleet.endpoints))]
    if ports[-1] > 65535:
        raise ValueError(f"--base-port {base_port} leaves no room for {len(ports)} endpoints")
    server = FleetServer(fleet, ports, host, model_name)
    server.start()
    for endpoint_id, url in server.urls.items():
        print(f"{endpoint_id}: {url}")
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()
