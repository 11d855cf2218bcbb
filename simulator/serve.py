"""Mock vLLM endpoints: the simulated replicas run in real time behind OpenAI-compatible HTTP servers.

Each endpoint of the fleet gets its own server on 127.0.0.1 (port base_port + i) with `/v1/completions`,
`/v1/chat/completions` (streaming or not), `/v1/models`, `/health` and `/metrics` in vLLM's metric names, so the
scraper, the gateway and end-to-end tests talk real HTTP to something that queues, batches and slows down like
vLLM. Steps are paced on the wall clock by the same step-time model and scheduler as the simulator (one step
at a time, no closed-form decode runs). Prompts are tokenised as whitespace-separated words; prefix caching
works on 16-word segments of them (on an endpoint whose KV blocks are larger, a block's worth: `segment_words`).

P/D: a decode endpoint that receives header `x-prefiller-host-port` (llm-d's convention) has the named prefill
endpoint of the fleet prefill the prompt, waits for the KV transfer on its own link (queued behind the
transfers already on it; uncached and cached prompt KV at the fleet's `kv_link_gb_s`), emits the first token
when the KV lands and decodes the rest itself. Without the header any endpoint serves a request end to end.

A request's `x-request-id` header is echoed in the response, as vLLM does with request-id headers on.
Time-slice groups swap in real time; their states are published as an orchestrator would, on a port of their
own (`GET /v1/timeslice/groups`, the document `router_plugin.timeslice_sources` reads). Errors are answered as
the predictor service answers them: `{"error": "field: problem", "field": ..., "detail": [...]}`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import threading
import time
import zlib
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, TypeVar

import uvicorn
import yaml
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from leadtime.features.errors import FeatureError
from leadtime.features.roofline import kv_transfer_ms
from leadtime.features.rows import is_resident
from leadtime.predictor.service.edge import (
    feature_error_handler,
    http_error_handler,
    unexpected_error_handler,
    validation_error_handler,
)
from leadtime.predictor.service.ports import check_port_free
from leadtime.predictor.service.serve import check_tls_files
from leadtime.router_plugin.discovery import (
    ACCELERATOR_LABEL,
    MODEL_LABEL,
    ROLE_LABEL,
    SCHEME_LABEL,
    TIMESLICE_LABEL,
    TP_LABEL,
)
from leadtime.router_plugin.timeslice import OTHER_JOB, SERVING_JOB
from leadtime.simulator.endpoint import Endpoint, SimRequest
from leadtime.simulator.engine import build_endpoints
from leadtime.simulator.fleet import EndpointConfig, Fleet, TimesliceGroup
from leadtime.simulator.report import written_whole
from leadtime.yaml_text import read_yaml_file

T = TypeVar("T")
PREFIX_BLOCK_WORDS = 16
"""Words in a prompt segment (prefix caching's unit) of an endpoint whose KV blocks hold up to 16 tokens; see
`segment_words` for larger blocks."""
PREFILLER_HEADER = "x-prefiller-host-port"
EVERY_ADDRESS = ("0.0.0.0", "::", "[::]")
"""Bind addresses that listen on every interface: a fleet bound so is reached, and its prefillers named, by any of
the host's addresses."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


ONE_CHOICE = "a simulated endpoint answers one choice per request"


def one_choice(n: int | None) -> int | None:
    """`n` as vLLM reads it, refused above 1: the simulator generates one sequence per request."""
    if n is not None and n != 1:
        raise ValueError(ONE_CHOICE)
    return n


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
"""A prompt as token ids, as vLLM takes it (the gateway passes such a prompt on unchanged)."""


class CompletionBody(BaseModel):
    """The body of /v1/completions (unknown fields are accepted, as vLLM does)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1, le=32768)  # null: vLLM's default for completions, 16
    stream: bool | None = False  # null reads as false, as in vLLM
    stream_options: StreamOptions | None = None
    n: int | None = None

    _one_choice = field_validator("n")(one_choice)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def prompt_kind(cls, prompt: object, handler: ValidatorFunctionWrapHandler) -> object:
        """One problem for a prompt of no kind vLLM takes, where pydantic listed one per kind (`prompt.str: Input
        should be a valid string` for a token id of -1)."""
        try:
            return handler(prompt)
        except ValidationError:
            if not isinstance(prompt, list) or not prompt:
                raise
            raise ValueError(
                "must be a text, a list of token ids (integers ≥ 0), or a list of one text or one such list"
            ) from None

    @field_validator("prompt")
    @classmethod
    def one_prompt(
        cls, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        """Several prompts (texts, or lists of token ids) are several choices in vLLM's answer; a list of token ids
        is one prompt."""
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            raise ValueError(f"{ONE_CHOICE}: send one prompt")
        return prompt

    @property
    def words(self) -> list[str]:
        """The prompt's tokens as the mock counts them: its words, or its token ids (each a word)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return _words(prompt)
        first = prompt[0]
        if isinstance(first, str):
            return _words(first)
        return [str(token) for token in (first if isinstance(first, list) else prompt)]


class ChatMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, object]] | None = None  # text, OpenAI's content parts, or none

    @property
    def text(self) -> str:
        """The message's text: its string, or its text parts joined (other parts, images say, carry none here)."""
        if isinstance(self.content, list):
            return " ".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatBody(BaseModel):
    """The body of /v1/chat/completions (unknown fields are accepted, as vLLM does)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=32768)
    stream: bool | None = False  # null reads as false, as in vLLM
    stream_options: StreamOptions | None = None
    n: int | None = None

    _one_choice = field_validator("n")(one_choice)


class TokenizeBody(BaseModel):
    """The body of /tokenize: a completion's prompt or a chat's messages, as vLLM's takes either."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)

    @property
    def words(self) -> list[str]:
        """The tokens as the completion or chat with this prompt would count them; FeatureError (422) unless
        exactly one of `prompt` and `messages` is given."""
        if (self.prompt is None) == (self.messages is None):
            raise FeatureError("prompt", "give a prompt or a chat's messages (one of them)")
        if self.messages is not None:
            return chat_words(self.messages)
        return _words(self.prompt or "")


@dataclass
class Counters:
    """The token and request counters /metrics reports."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefills_for_peers: int = 0
    kv_received: int = 0


@dataclass
class GroupClock:
    """A time-slice group's state as its orchestrator would publish it (wall-clock `since`)."""

    state: str = "resident"
    since: float = field(default_factory=time.time)

    def document(self) -> dict[str, object]:
        if self.state == "resident":
            active = loaded = SERVING_JOB
            waiters, status = 0, "LOCKED"
        elif self.state == "parked":
            active = loaded = OTHER_JOB
            waiters, status = 1, "LOCKED"
        else:
            active, loaded, waiters, status = "", SERVING_JOB, 0, "SWITCHING"
        return {"state": status, "active_job": active, "loaded_job": loaded, "waiters": waiters, "since": self.since}


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
    kv_link_gb_s: float = 25.0
    link_free_ms: float = 0.0
    prefills: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    aborted: set[int] = field(default_factory=set)
    """Requests whose clients left during the step in flight: removed when it ends."""
    peer_prefills: dict[int, LiveEndpoint] = field(default_factory=dict)
    """The prefill endpoint of each request of this decode endpoint still being prefilled there."""

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
            for rid in self.aborted:
                self.engine.remove(rid)
            self.aborted.clear()
            for r in (*outcome.first_token, *outcome.prefill_done):
                if not r.kv_ready and r.prefix_hit_tokens >= 0 and before[id(r)] == 0:
                    self.counters.prefix_queries += r.input_tokens
                    self.counters.prefix_hits += r.prefix_hit_tokens
            for r in outcome.prefill_done:
                done = self.prefills.pop(r.rid, None)
                if done is not None and not done.done():
                    done.set_result(None)
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

    def abort(self, rid: int) -> None:
        """The client of request `rid` left: stop serving it, as vLLM aborts a request whose connection closes (the
        mock generated on for no one, and a router in front of it saw load no one was waiting for); a prefill a peer
        runs for it is stopped too."""
        self.streams.pop(rid, None)
        prefiller = self.peer_prefills.pop(rid, None)
        if prefiller is not None:
            prefiller.cancel_prefill(rid)
            return
        plan = self.engine.plan
        if plan is not None and any(r.rid == rid for r, _ in plan.entries):
            self.aborted.add(rid)  # removed once the step in flight ends, a decode run cut short to it
            self.engine.interrupt(self.now_ms())
        else:
            self.engine.remove(rid)

    def _request(self, rid: int, words: list[str], max_tokens: int, whose: str = "this endpoint's") -> SimRequest:
        """The request as this endpoint's engine runs it; FeatureError (422) when its KV cache cannot hold it, the
        cache named as `whose`."""
        segment = segment_words(self.engine.cache.block_size)
        request = SimRequest(
            rid, self.now_ms(), max(1, len(words)), max_tokens, word_block_hashes(words, segment), segment
        )
        cache = self.engine.cache
        if cache.blocks_for(request.input_tokens + max_tokens) > cache.total_blocks:
            raise FeatureError(
                "prompt",
                f"prompt plus max_tokens ({request.input_tokens} + {max_tokens} tokens) exceed the "
                f"{cache.capacity_tokens} tokens {whose} KV cache holds",
            )
        return request

    def _enqueue(self, request: SimRequest) -> None:
        self.engine.enqueue(request)
        assert self.wake is not None
        self.wake.set()

    def submit(self, rid: int, words: list[str], max_tokens: int) -> asyncio.Queue[int | None]:
        """Serve a request end to end here; its tokens arrive on the queue, then None."""
        request = self._request(rid, words, max_tokens)
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.streams[rid] = queue
        self.counters.prompt_tokens += request.input_tokens
        self._enqueue(request)
        return queue

    async def prefill_for_peer(self, request: SimRequest) -> int:
        """Prefill `request` (`_request` of this endpoint) for a decode endpoint elsewhere; returns its prompt length
        once done (CancelledError if `cancel_prefill` is called first)."""
        request.prefill_only = True
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.prefills[request.rid] = done
        self.counters.prompt_tokens += request.input_tokens
        self.counters.prefills_for_peers += 1
        self._enqueue(request)
        await done
        return request.input_tokens

    def cancel_prefill(self, rid: int) -> None:
        """The client of the request this endpoint prefills for a peer left: stop prefilling it, as its own
        request is aborted (`abort`), and end the wait for it."""
        done = self.prefills.pop(rid, None)
        if done is not None and not done.done():
            done.cancel()
        self.abort(rid)

    def submit_disaggregated(
        self, prefiller: LiveEndpoint, rid: int, words: list[str], max_tokens: int
    ) -> asyncio.Queue[int | None]:
        """Prefill on `prefiller`, move the KV over this endpoint's link, decode here. A prompt that either KV
        cache cannot hold is refused here, at once: refused by the prefiller in the task below, it left the client
        waiting for ever."""
        self._request(rid, words, max_tokens)
        prefill = prefiller._request(rid, words, max_tokens, f"the prefill endpoint {prefiller.config.endpoint_id}'s")
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        self.streams[rid] = queue
        self.peer_prefills[rid] = prefiller
        asyncio.get_running_loop().create_task(self._disaggregated(prefiller, prefill, max_tokens, queue))
        return queue

    async def _disaggregated(
        self, prefiller: LiveEndpoint, prefill: SimRequest, max_tokens: int, queue: asyncio.Queue[int | None]
    ) -> None:
        rid = prefill.rid
        try:
            input_tokens = await prefiller.prefill_for_peer(prefill)
        finally:
            self.peer_prefills.pop(rid, None)
        if rid not in self.streams:
            return  # its client left while it was prefilled elsewhere
        start = max(self.now_ms(), self.link_free_ms)
        stepper = self.engine.stepper
        end = start + kv_transfer_ms(stepper.model, input_tokens, self.kv_link_gb_s, stepper.tensor_parallel)
        self.link_free_ms = end
        await asyncio.sleep(max(0.0, (end - self.now_ms()) / 1e3))
        if rid not in self.streams:
            return  # its client left while its KV crossed the link: nothing to decode for
        self.counters.kv_received += 1
        queue.put_nowait(1)  # the first token comes with the KV
        self.counters.generation_tokens += 1
        if max_tokens <= 1:
            self.counters.requests_finished += 1
            self.streams.pop(rid, None)
            queue.put_nowait(None)
            return
        request = SimRequest(rid, self.now_ms(), input_tokens, max_tokens, kv_ready=True)
        request.generated = 1
        request.first_token_ms = request.decode_start_ms = self.now_ms()
        request.decode_start_generated = 1
        self._enqueue(request)

    def metrics(self) -> str:
        """/metrics in vLLM's metric names."""
        e = self.engine
        label = f'model_name="{label_value(self.model_name)}"'
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
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f"vllm:request_success_total{{{label}}} {self.counters.requests_finished}",
            "# HELP vllm:num_preemptions_total Cumulative number of preemptions.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{label}}} {e.preemptions}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{label}}} {self.counters.prompt_tokens}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{label}}} {self.counters.generation_tokens}",
            "# HELP vllm:prefix_cache_queries_total Prefix-cache queries, in tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{label}}} {self.counters.prefix_queries}",
            "# HELP vllm:prefix_cache_hits_total Prefix-cache hits, in tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{label}}} {self.counters.prefix_hits}",
            "# HELP leadtime_sim_prefills_for_peers_total Prompts prefilled here for a decode endpoint (P/D).",
            "# TYPE leadtime_sim_prefills_for_peers_total counter",
            f"leadtime_sim_prefills_for_peers_total{{{label}}} {self.counters.prefills_for_peers}",
            "# HELP leadtime_sim_kv_received_total Requests whose KV arrived here from a prefill endpoint (P/D).",
            "# TYPE leadtime_sim_kv_received_total counter",
            f"leadtime_sim_kv_received_total{{{label}}} {self.counters.kv_received}",
            "# HELP leadtime_sim_timeslice_resident Whether the endpoint's time-slice group is resident.",
            "# TYPE leadtime_sim_timeslice_resident gauge",
            f"leadtime_sim_timeslice_resident{{{label}}} {1 if is_resident(self.timeslice_state) else 0}",
        ]
        return "\n".join(lines) + "\n"


def label_value(text: str) -> str:
    """`text` as a Prometheus label value is written: a quote, a backslash or a line break unescaped broke the
    whole exposition, and a scraper refused every scrape.

    >>> print(label_value('say "hi"'))
    say \\"hi\\"
    """
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def segment_words(block_size: int) -> int:
    """Words in a prompt segment on an endpoint whose KV blocks hold `block_size` tokens: the least whole number of
    its blocks that is also a whole number of `PREFIX_BLOCK_WORDS` (16 for blocks of 1, 8 and 16; a block for 32,
    64 and 128). A segment smaller than a block held no block of the cache: its prefix was never evicted and gave
    free hits for ever (the simulator refuses such segments).

    >>> [segment_words(b) for b in (1, 8, 16, 32, 64, 128)]
    [16, 16, 16, 32, 64, 128]
    """
    return math.lcm(PREFIX_BLOCK_WORDS, block_size)


def word_block_hashes(words: list[str], segment: int = PREFIX_BLOCK_WORDS) -> tuple[int, ...]:
    """Chained hashes of the prompt's full `segment`-word blocks (the mock's tokens are words).

    Python's own hashes, stable within this process (which holds every endpoint of the fleet): ~1 µs a block,
    where hashing each word's bytes first cost ~12 ms for a 12,000-word prompt, on the serving event loop.
    """
    hashes = []
    parent = 0
    for start in range(0, len(words) - segment + 1, segment):
        parent = hash((parent, *words[start : start + segment]))
        hashes.append(parent)
    return tuple(hashes)


async def _hung_up(request: Request) -> None:
    """Return once the client of `request` (its body read) has closed the connection: the next ASGI message is then
    `http.disconnect` (vLLM listens for it the same way)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_hung_up(request: Request, work: Coroutine[object, object, T]) -> T | None:
    """`work`'s result, or None (`work` cancelled) when the client of `request` leaves first: a non-streaming
    client that timed out left the mock generating for no one, where vLLM aborts the request."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


def _words(text: str) -> list[str]:
    return text.split() or [""]


def chat_words(messages: list[ChatMessage]) -> list[str]:
    """A chat's prompt as the mock counts it: the words of its messages' texts."""
    return _words(" ".join(m.text for m in messages))


class HeaderError(FeatureError):
    """A request header the mock cannot honour (400, naming the header: the request itself is malformed)."""


async def _header_error_handler(request: Request, exc: Exception) -> JSONResponse:
    response = await feature_error_handler(request, exc)
    response.status_code = 400
    return response


def _add_error_handlers(app: FastAPI) -> None:
    """Errors in the predictor service's JSON shape (one definition of it: predictor.service.edge)."""
    app.add_exception_handler(HeaderError, _header_error_handler)
    app.add_exception_handler(FeatureError, feature_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)


def build_app(
    live: LiveEndpoint,
    peers: dict[str, LiveEndpoint] | None = None,
    ids: Iterator[int] | None = None,
    tokens_per_event: int = 1,
) -> FastAPI:
    """The HTTP face of one simulated endpoint.

    Errors answer in the predictor service's JSON shape (`{"error", "field", "detail"}`); a request naming a model
    the endpoint does not serve is a 404, as in vLLM. `peers` maps `host:port` to the fleet's endpoints (a decode
    endpoint finds its prefiller there); `ids` numbers requests across the fleet (a prefill endpoint serves
    requests of several decode endpoints). A stream carries `tokens_per_event` tokens in each event (the last
    event of a choice fewer), as a server does whose steps yield several tokens (speculative decoding) or that
    sends its stream every few tokens: its clients cannot count tokens by events.
    """
    app = FastAPI(title=f"leadtime mock vLLM {live.config.endpoint_id}")
    _add_error_handlers(app)
    numbers = ids if ids is not None else itertools.count(1)
    fleet = peers or {}
    # A fleet listening on every address is named by whichever address its client reaches it at: by port, then.
    by_port = {key.rpartition(":")[2]: peer for key, peer in fleet.items() if key.rpartition(":")[0] in EVERY_ADDRESS}

    def check_model(model: str | None) -> None:
        if model is not None and model != live.model_name:
            raise HTTPException(404, f"The model `{model}` does not exist.")  # vLLM's words

    async def tokens(queue: asyncio.Queue[int | None]) -> AsyncIterator[int]:
        index = 0
        while await queue.get() is not None:
            yield index
            index += 1

    async def whole_answer(queue: asyncio.Queue[int | None]) -> list[str]:
        return [f" tok{i}" async for i in tokens(queue)]

    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def completion_json(kind: str, cid: str, text_pieces: list[str], prompt_tokens: int) -> dict[str, object]:
        text = "".join(text_pieces)
        if kind == "chat":
            choice: dict[str, object] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
        return {
            "id": cid,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": live.model_name,
            "choices": [choice],
            "usage": usage(prompt_tokens, len(text_pieces)),
        }

    def prefiller_of(request: Request) -> LiveEndpoint | None:
        target = request.headers.get(PREFILLER_HEADER)
        if target is None:
            return None
        if live.config.role != "decode":
            raise HeaderError(PREFILLER_HEADER, f"{live.config.endpoint_id} is not a decode endpoint")
        peer = fleet.get(target.strip()) or by_port.get(target.strip().rpartition(":")[2])
        if peer is None:
            raise HeaderError(PREFILLER_HEADER, f"{target!r} is no endpoint of this fleet")
        if peer.config.role != "prefill":
            raise HeaderError(PREFILLER_HEADER, f"{peer.config.endpoint_id} is not a prefill endpoint")
        return peer

    async def respond(
        request: Request, kind: str, words: list[str], max_tokens: int, stream: bool, include_usage: bool
    ) -> object:
        rid = next(numbers)
        cid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{live.config.endpoint_id}-{rid}"  # vLLM's prefixes
        prefiller = prefiller_of(request)
        if prefiller is None:
            queue = live.submit(rid, words, max_tokens)
        else:
            queue = live.submit_disaggregated(prefiller, rid, words, max_tokens)
        prompt_tokens = len(words)
        echo = {"x-request-id": request.headers["x-request-id"]} if "x-request-id" in request.headers else None
        if not stream:
            pieces = await unless_hung_up(request, whole_answer(queue))
            if pieces is None:  # the client left before the end: abort it, as a stream is
                if rid in live.streams:
                    live.abort(rid)
                return Response(status_code=499)  # nginx's "client closed request": no one reads it
            return JSONResponse(completion_json(kind, cid, pieces, prompt_tokens), headers=echo)
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = f'data: {{"id":{json.dumps(cid)},"object":"{obj}","created":{created},'
        head += f'"model":{json.dumps(live.model_name)},"choices":[{{"index":0,'

        def event(text: str, finish: str = "null", role: str = "") -> str:
            if kind == "chat":
                return f'{head}"delta":{{{role}"content":"{text}"}},"logprobs":null,"finish_reason":{finish}}}]}}\n\n'
            return f'{head}"text":"{text}","logprobs":null,"finish_reason":{finish}}}]}}\n\n'

        async def events() -> AsyncIterator[str]:
            try:
                async for event in answer():
                    yield event
            finally:
                if rid in live.streams:  # the client left before the end (a finished request has left them)
                    live.abort(rid)

        async def answer() -> AsyncIterator[str]:
            n = 0
            pending = ""
            async for i in tokens(queue):
                if not n and kind == "chat":  # as vLLM: the role, with the first token
                    yield event("", role='"role":"assistant",')
                n += 1
                pending += f" tok{i}"
                if n % tokens_per_event == 0:
                    yield event(pending)
                    pending = ""
            if pending:
                yield event(pending)
            yield event("", finish='"length"')  # as vLLM: the last event of a choice says why it finished
            if include_usage:
                last = {
                    "id": cid,
                    "object": obj,
                    "created": created,
                    "model": live.model_name,
                    "choices": [],
                    "usage": usage(prompt_tokens, n),
                }
                yield f"data: {json.dumps(last, separators=(',', ':'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=echo)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> object:
        check_model(body.model)
        usage_wanted = bool(body.stream_options and body.stream_options.include_usage)
        max_tokens = body.max_tokens or 16
        return await respond(request, "text", body.words, max_tokens, bool(body.stream), usage_wanted)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatBody, request: Request) -> object:
        check_model(body.model)
        words = chat_words(body.messages)
        max_tokens = body.max_completion_tokens or body.max_tokens or 16
        usage_wanted = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(request, "chat", words, max_tokens, bool(body.stream), usage_wanted)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict[str, object]:
        """As vLLM's: the prompt's tokens (a word each here, numbered by a stable hash), and the model's length."""
        check_model(body.model)
        tokens = [zlib.crc32(w.encode()) % 128_000 for w in body.words if w]
        return {"count": len(tokens), "max_model_len": 131_072, "tokens": tokens}

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


def build_timeslice_app(groups: dict[str, GroupClock]) -> FastAPI:
    """The orchestrator's face: every time-slice group's state (`GET /v1/timeslice/groups`), with `now`, what the
    orchestrator's clock reads, for a router to reckon each `since` against."""
    app = FastAPI(title="leadtime mock time-slice orchestrator")
    _add_error_handlers(app)

    @app.get("/v1/timeslice/groups")
    async def states() -> dict[str, object]:
        return {"groups": {name: clock.document() for name, clock in groups.items()}, "now": time.time()}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


async def _timeslice(group: TimesliceGroup, members: list[LiveEndpoint], clock: GroupClock, seed: int) -> None:
    """Cycle a group on the wall clock: resident → parked → switching → resident."""
    import random

    rng = random.Random(seed)

    def enter(state: str) -> None:
        clock.state, clock.since = state, time.time()
        for m in members:
            m.timeslice_state = state

    enter("resident")
    while True:
        await asyncio.sleep(group.resident_ms.draw(rng) / 1e3)
        enter("parked")
        for m in members:
            m.engine.request_park(m.now_ms())
        await asyncio.sleep(group.away_ms.draw(rng) / 1e3)
        enter("switching")
        await asyncio.sleep(group.restore_ms.draw(rng) / 1e3)
        enter("resident")
        for m in members:
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
    timeslice_port
        Where the time-slice groups' states are served (only for a fleet that has groups; None: not served).
    tls
        (certificate, key) PEM files: the endpoints serve HTTPS, as vLLM does with --ssl-certfile/--ssl-keyfile
        (the time-slice states stay plain HTTP).
    tokens_per_event
        Tokens in each event of a stream (`build_app`).
    """

    def __init__(
        self,
        fleet: Fleet,
        ports: list[int],
        host: str = "127.0.0.1",
        model_name: str | None = None,
        seed: int = 0,
        timeslice_port: int | None = None,
        tls: tuple[Path, Path] | None = None,
        tokens_per_event: int = 1,
    ) -> None:
        if len(ports) != len(fleet.endpoints):
            raise ValueError(f"need {len(fleet.endpoints)} ports, got {len(ports)}")
        self.fleet = fleet
        self.ports = ports
        self.host = host
        self.seed = seed
        self.tls = tls
        self.tokens_per_event = tokens_per_event
        self.timeslice_port = timeslice_port if fleet.timeslice_groups else None
        engines = build_endpoints(fleet, decode_runs=False, record_busy=False)  # served for as long as it runs
        pairs = zip(fleet.endpoints, engines, strict=True)
        self.live = [
            LiveEndpoint(cfg, engine, model_name or cfg.model, kv_link_gb_s=fleet.kv_link_gb_s) for cfg, engine in pairs
        ]
        self.groups = {name: GroupClock() for name in fleet.timeslice_groups}
        self._servers: list[uvicorn.Server] = []
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def urls(self) -> dict[str, str]:
        """The base URL of every endpoint."""
        return {
            cfg.endpoint_id: f"{'https' if self.tls else 'http'}://{self.host}:{port}"
            for cfg, port in zip(self.fleet.endpoints, self.ports, strict=True)
        }

    @property
    def timeslice_url(self) -> str | None:
        """Where the groups' states are published, if they are."""
        if self.timeslice_port is None:
            return None
        return f"http://{self.host}:{self.timeslice_port}/v1/timeslice/groups"

    def endpoints_document(self) -> dict[str, object]:
        """The fleet as an llm-d discovery file (roles, accelerator classes, models, time-slice groups)."""
        entries = []
        for cfg, port in zip(self.fleet.endpoints, self.ports, strict=True):
            labels = {
                ROLE_LABEL: cfg.role,
                ACCELERATOR_LABEL: cfg.accelerator,
                MODEL_LABEL: cfg.model,
                TP_LABEL: str(cfg.tensor_parallel),
            }
            if cfg.timeslice_group:
                labels[TIMESLICE_LABEL] = cfg.timeslice_group
            if self.tls:
                labels[SCHEME_LABEL] = "https"
            entries.append({"name": cfg.endpoint_id, "address": self.host, "port": str(port), "labels": labels})
        return {"endpoints": entries}

    async def _main(self) -> None:
        tasks = []
        peers = {f"{self.host}:{port}": live for live, port in zip(self.live, self.ports, strict=True)}
        ids = itertools.count(1)
        for live, port in zip(self.live, self.ports, strict=True):
            live.wake = asyncio.Event()
            live.origin = time.monotonic()
            tasks.append(asyncio.create_task(live.drive()))
            app = build_app(live, peers, ids, self.tokens_per_event)
            cert, key = self.tls or (None, None)
            config = uvicorn.Config(
                app,
                host=self.host,
                port=port,
                log_level="warning",
                lifespan="off",
                ssl_certfile=cert,
                ssl_keyfile=key,
            )
            self._servers.append(uvicorn.Server(config))
        if self.timeslice_port is not None:
            app = build_timeslice_app(self.groups)
            config = uvicorn.Config(app, host=self.host, port=self.timeslice_port, log_level="warning", lifespan="off")
            self._servers.append(uvicorn.Server(config))
        for i, (name, group) in enumerate(self.fleet.timeslice_groups.items()):
            members = [m for m in self.live if m.config.timeslice_group == name]
            if members:
                tasks.append(asyncio.create_task(_timeslice(group, members, self.groups[name], self.seed + i)))
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

    def _check_ports(self) -> None:
        """OSError naming the first port (the endpoints', then the time-slice groups') that cannot be bound, before
        any server starts (`predictor.service.ports`: probed, not held)."""
        for port in [*self.ports, *([self.timeslice_port] if self.timeslice_port is not None else [])]:
            check_port_free(self.host, port, "simulated endpoints" if port in self.ports else "time-slice states")

    def start(self, timeout_s: float = 15.0) -> None:
        """Start serving; OSError if some port cannot be bound or the servers do not start in time."""
        self._check_ports()
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


DISCOVERY_LABELS = (ROLE_LABEL, ACCELERATOR_LABEL, MODEL_LABEL, TP_LABEL)
"""The labels `FleetServer.endpoints_document` gives every endpoint: a file whose entries all carry them is one a
run of `sim serve` wrote."""


def _written_by_sim_serve(path: Path) -> bool:
    """Whether `path` holds nothing to lose: empty (as mktemp leaves it), or the discovery file a run of `sim serve`
    wrote (`FleetServer.endpoints_document`'s shape). Anything else is someone's file, which `--endpoints-file` once
    overwrote: notes, a hand-written discovery file, the command's own --fleet file."""
    try:
        if path.stat().st_size == 0:
            return True
        document = read_yaml_file(path, "a discovery file")
    except (OSError, ValueError):
        return False
    entries = document.get("endpoints") if isinstance(document, dict) and set(document) == {"endpoints"} else None
    return (
        isinstance(entries, list)
        and bool(entries)
        and all(
            isinstance(entry, dict)
            and set(entry) == {"name", "address", "port", "labels"}
            and isinstance(entry["labels"], dict)
            and all(label in entry["labels"] for label in DISCOVERY_LABELS)
            for entry in entries
        )
    )


def _check_writable(path: Path, inputs: Mapping[str, Path | None] | None = None) -> None:
    """OSError before anything starts when `path` cannot be written (it is a directory, or its directory is missing
    or not writable), or must not be: one of the command's own `inputs` (files it reads, by option), or a file
    that a run of `sim serve` did not write. Not created here: a waiting client takes the file's appearance for
    "the fleet is up"."""
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OSError(f"--endpoints-file {str(path)!r} is a directory")
    if not directory.is_dir():
        raise OSError(f"--endpoints-file {str(path)!r}: no directory {str(directory)!r}")
    if path.exists():
        for option, given in (inputs or {}).items():
            if given is not None and given.exists() and os.path.samefile(path, given):
                raise OSError(f"--endpoints-file {str(path)!r} is the {option} file: it would be overwritten")
        if not _written_by_sim_serve(path):
            raise OSError(
                f"--endpoints-file {str(path)!r} exists and is not a discovery file `sim serve` wrote: it would be "
                "overwritten (remove it, or give another path)"
            )
    if not os.access(directory, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OSError(f"--endpoints-file {str(path)!r} cannot be written")


def serve_fleet(
    fleet: Fleet,
    host: str = "127.0.0.1",
    base_port: int = 8100,
    model_name: str | None = None,
    timeslice_port: int | None = None,
    endpoints_file: Path | None = None,
    seed: int = 0,
    tls: tuple[Path, Path] | None = None,
    tokens_per_event: int = 1,
    inputs: Mapping[str, Path | None] | None = None,
) -> None:
    """Serve until interrupted (the `leadtime sim serve` command).

    A fleet with time-slice groups publishes their states on `timeslice_port` (default: the port after the
    endpoints'); `endpoints_file` is written with the fleet as an llm-d discovery file, never over one of `inputs`
    (the files the command reads, by option) nor over a file a run of this command did not write. With `tls`
    (certificate and key files) the endpoints serve HTTPS, and the discovery file says so
    (`leadtime.io/scheme: https`).
    """
    ports = [base_port + i for i in range(len(fleet.endpoints))]
    if fleet.timeslice_groups and timeslice_port is None:
        timeslice_port = base_port + len(ports)
    if fleet.timeslice_groups and timeslice_port in ports:
        raise ValueError(f"--timeslice-port {timeslice_port} is one of the endpoints' ports ({ports[0]}-{ports[-1]})")
    if max(ports + [timeslice_port or 0]) > 65535:
        raise ValueError(f"--base-port {base_port} leaves no room for {len(ports)} endpoints")
    if endpoints_file is not None:
        _check_writable(endpoints_file, inputs)
    if tls is not None:
        check_tls_files(*tls)
    server = FleetServer(
        fleet,
        ports,
        host,
        model_name,
        seed=seed,
        timeslice_port=timeslice_port,
        tls=tls,
        tokens_per_event=tokens_per_event,
    )
    server.start()
    for endpoint_id, url in server.urls.items():
        print(f"{endpoint_id}: {url}", flush=True)
    if server.timeslice_url is not None:
        print(f"timeslice: {server.timeslice_url}", flush=True)
    if endpoints_file is not None:
        # Renamed into place whole: a client waiting for the file to appear read it empty, written in place.
        with written_whole(endpoints_file) as part:
            part.write_text(yaml.safe_dump(server.endpoints_document(), sort_keys=False))
        print(f"endpoints: {endpoints_file}", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()
