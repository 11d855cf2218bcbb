"""What the gateway measures of the requests it proxies, in front of a real `sim serve` endpoint: non-streaming
requests sent on as streams, timed, learned from and answered whole (`router_plugin.gateway.assemble`), and the
usage of streams asked for so that output tokens are counted exactly when an event carries several."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable, MutableMapping, Sequence
from typing import Any

import httpx
import orjson
import pytest
from inprocess_gateway import Scenario, counted, through_gateway
from raw_endpoint import STREAM_HEAD, next_request

from leadtime.bench.procs import free_port
from leadtime.features.vllm_metrics import parse_samples
from leadtime.router_plugin.affinity import DEFAULT_BYTES_PER_TOKEN
from leadtime.router_plugin.config import DEFAULT_DEADLINE_MS
from leadtime.router_plugin.discovery import StaticDiscovery, parse_static
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.gateway.assemble import Assembler, streamed_body, whole_answer
from leadtime.router_plugin.gateway.metrics import FAST_BUCKETS_S, ITL_BUCKETS_S, LATENCY_BUCKETS_S
from leadtime.router_plugin.gateway.requests import parse_request
from leadtime.router_plugin.gateway.stream import StreamMeter
from leadtime.router_plugin.heuristics import RoundRobinPolicy
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest
from leadtime.router_plugin.predicted import PolicyCounters
from leadtime.simulator.fleet import parse_fleet
from leadtime.simulator.serve import FleetServer

FLEET = parse_fleet(
    {"name": "one", "pools": [{"name": "h", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}]}
)


@pytest.mark.parametrize(
    "request_body",
    [
        {"prompt": "x", "stream": True},
        {"prompt": "x", "logprobs": 1},
        {"prompt": "x", "logprobs": 0},
        {"messages": [], "logprobs": True, "top_logprobs": 2},
        {"prompt": "x", "echo": True},
        {"prompt": "x", "n": 2},
        {"prompt": "x", "best_of": 3},
        {"messages": [], "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"prompt": "x", "stream_options": {"include_usage": True}},
        {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}},
        {"prompt": "x", "return_token_ids": True},
    ],
)
def test_requests_whose_answer_is_not_rebuilt_go_on_unchanged(request_body: dict[str, Any]) -> None:
    assert streamed_body(request_body) is None


@pytest.mark.parametrize(
    "request_body",
    [
        {"prompt": "x", "max_tokens": 3},
        {"prompt": "x", "stream": False, "n": 1, "logprobs": None, "echo": False, "temperature": 0.7, "seed": 4},
        {"messages": [{"role": "user", "content": "x"}], "logprobs": False, "tools": [], "response_format": {}},
    ],
)
def test_other_requests_go_on_asking_for_a_stream_and_the_usage(request_body: dict[str, Any]) -> None:
    sent = streamed_body(request_body)
    assert sent is not None
    assert orjson.loads(sent) == {**request_body, "stream": True, "stream_options": {"include_usage": True}}


def test_parse_request_streams_non_streaming_requests_only_when_asked() -> None:
    body = b'{"prompt": "hello", "max_tokens": 2}'
    assert parse_request("/v1/completions", body, {}).upstream_body is None
    measured = parse_request("/v1/completions", body, {}, measure_non_streaming=True)
    assert not measured.stream and orjson.loads(measured.upstream_body or b"{}")["stream"] is True
    streaming = b'{"prompt": "hello", "stream": true}'
    assert parse_request("/v1/completions", streaming, {}, measure_non_streaming=True).upstream_body is None


def test_a_null_stream_is_a_non_streaming_request_as_in_vllm() -> None:
    """vLLM's request models read `"stream": null` as false; a client sending it must not be refused."""
    body = b'{"prompt": "hello", "stream": null}'
    plain = parse_request("/v1/completions", body, {})
    assert not plain.stream and plain.upstream_body is None
    measured = parse_request("/v1/completions", body, {}, measure_non_streaming=True)
    assert not measured.stream and orjson.loads(measured.upstream_body or b"{}")["stream"] is True


def test_a_completion_is_put_back_together() -> None:
    a = Assembler()
    common = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m", "system_fingerprint": "fp"}
    for text, finish in (("Once", None), (" upon", None), (" a", None), ("", "length")):
        a.add({**common, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})
    a.add({**common, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}})
    assert a.error is None
    assert a.body() == {
        **common,
        "choices": [{"index": 0, "text": "Once upon a", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }


def test_a_chat_answer_keeps_its_reasoning_and_the_last_stop_reason() -> None:
    a = Assembler()
    pieces = [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "Think"},
        {"reasoning_content": " first."},
        {"content": "Hi"},
        {"content": "!"},
    ]
    for delta in pieces:
        a.add({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})
    a.add({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": 128001}]})
    choice = a.body()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hi!", "reasoning_content": "Think first."}
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 128001)
    assert a.body()["object"] == "chat.completion" and "usage" not in a.body()


def test_choices_are_kept_apart_by_index() -> None:
    a = Assembler()
    for index, text in ((0, "a"), (1, "x"), (0, "b"), (1, "y")):
        a.add({"choices": [{"index": index, "text": text}]})
    assert [c["text"] for c in a.body()["choices"]] == ["ab", "xy"]
    assert a.body()["object"] == "text_completion"


@pytest.mark.parametrize(
    ("event", "status"),
    [
        ({"error": {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}}, 400),
        ({"object": "error", "message": "engine dead", "type": "InternalServerError", "code": 500}, 500),
        ({"error": {"message": "?", "code": "weird"}}, 500),
    ],
)
def test_an_error_event_becomes_the_answer_with_its_status(event: dict[str, Any], status: int) -> None:
    a = Assembler()
    a.add({"choices": [{"index": 0, "text": "partial"}]})
    a.add(event)
    assert a.error == event and a.error_status() == status


class Recording(RoundRobinPolicy):
    """Round-robin that keeps every decision's candidates and every outcome it is told."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[RouteRequest] = []
        self.offered: list[Sequence[Candidate]] = []
        self.outcomes: list[Outcome] = []
        self.abandoned: list[str] = []
        self.told: list[tuple[str, str, float]] = []  # ("prefilled" | "observe", request id, router's clock)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        self.requests.append(request)
        self.offered.append(list(candidates))
        return super().pick(request, candidates)

    def prefilled(self, request_id: str, now_ms: float) -> None:
        self.told.append(("prefilled", request_id, now_ms))

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self.told.append(("observe", outcome.request_id, outcome.completed_ms))

    def abandon(self, request_id: str) -> None:
        self.abandoned.append(request_id)


def through(
    scenario: Scenario,
    measure: bool = True,
    ask_usage: bool = True,
    tokens_per_event: int = 1,
    attach: Callable[[Gateway], None] | None = None,
) -> tuple[Recording, dict[str, Any], Any]:
    """Run `scenario(client)` against an in-process gateway in front of one `sim serve` endpoint; the policy, the
    gateway's metrics and what the scenario returned. `attach` is given the gateway before it starts."""
    policy = Recording()
    settings = GatewaySettings(scrape_interval_s=0.05, measure_non_streaming=measure, ask_usage=ask_usage)
    samples, result = through_gateway(FLEET, policy, scenario, settings, tokens_per_event, attach=attach)
    return policy, samples, result


async def one_of_each(client: httpx.AsyncClient) -> list[httpx.Response]:
    completion = await client.post("/v1/completions", json={"prompt": "a b c d", "max_tokens": 5})
    chat = await client.post(  # `"stream": null`, which vLLM reads as false
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4, "stream": None},
    )
    refused = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
    whole = await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 3, "logprobs": 1})
    return [completion, chat, refused, whole]


def test_a_non_streaming_request_is_answered_whole_and_learned_from() -> None:
    policy, samples, (completion, chat, refused, whole) = through(one_of_each)
    assert completion.status_code == 200 and completion.headers["content-type"] == "application/json"
    assert completion.headers["content-length"] == str(len(completion.content))
    answer = completion.json()
    assert answer["object"] == "text_completion" and answer["model"] == "llama-3.1-8b"
    # The events' fields put back together (the mock's events carry `"logprobs": null`, as vLLM's do).
    text = " tok0 tok1 tok2 tok3 tok4"
    assert answer["choices"] == [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}]
    assert answer["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    assert completion.headers["x-leadtime-endpoint"] == "h-0"
    reply = chat.json()
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": " tok0 tok1 tok2 tok3"}
    assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 4
    # The endpoint's refusal, before any stream, passes through as it is.
    assert refused.status_code == 422 and refused.json()["field"] == "max_tokens"
    # Asking for log-probabilities, it went on unchanged and came back whole (the mock's own answer).
    assert whole.status_code == 200 and whole.json()["choices"][0]["logprobs"] is None
    # The two measured requests taught the policy their TTFT and ITL; the others were forgotten.
    assert [o.output_tokens for o in policy.outcomes] == [5, 4]
    assert all(o.ttft_ms > 0 and o.itl_ms > 0 for o in policy.outcomes)
    assert len(policy.abandoned) == 2
    # measured="false" counts the requests sent on unchanged, the logprobs one: not the third, which went on as a
    # stream and was refused before any (counted there, it read as measuring switched off for a request that was not)
    assert counted(samples, "leadtime_router_non_streaming_total", measured="true") == 3
    assert counted(samples, "leadtime_router_non_streaming_total", measured="false") == 1


def test_not_measuring_sends_the_request_unchanged_and_learns_nothing() -> None:
    policy, samples, (completion, chat, _, _) = through(one_of_each, measure=False)
    assert completion.json()["choices"][0]["logprobs"] is None  # the mock's whole answer
    assert chat.json()["choices"][0]["message"]["content"] == " tok0 tok1 tok2 tok3"
    assert policy.outcomes == []
    assert counted(samples, "leadtime_router_non_streaming_total", measured="false") == 4


def long_then_short(gateways: list[Gateway], measure: bool) -> Scenario:
    """A long prompt generating many tokens, and, while it decodes, a short request."""

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        (gateway,) = gateways
        long = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "w " * 2000, "max_tokens": 500}))

        def work() -> tuple[int, int]:  # (prefill, decode) tokens the gateway counts on the endpoint, as decided
            (scrape,) = gateway.routable()
            return gateway.work.tokens(scrape.endpoint.endpoint_id, scrape.scraped_ms)

        # Its prefill takes ~0.2 s, its 500 tokens ~3 s. Wait until it is sent before the endpoint's last scrape
        # and, measured, its first token came (it decodes now); answered whole, it stays prefill work.
        deadline = asyncio.get_running_loop().time() + 30
        while (work()[1] if measure else work()[0]) == 0:
            assert asyncio.get_running_loop().time() < deadline, "the long request never showed as in flight"
            assert not long.done()
            await asyncio.sleep(0.02)
        assert not long.done()
        short = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        return [await long, short]

    return scenario


@pytest.mark.parametrize("measure", [True, False])
def test_a_decoding_non_streaming_request_counts_as_decode_work_once_measured(measure: bool) -> None:
    gateways: list[Gateway] = []
    policy, _, (long, short) = through(long_then_short(gateways, measure), measure, attach=gateways.append)
    assert long.status_code == short.status_code == 200
    prompt = policy.requests[0].input_tokens  # as the gateway estimates it from the prompt's bytes
    seen = policy.offered[1][0].state  # what the second decision saw of the endpoint
    if measure:  # its first token came: its prompt and what it generated are decode work
        assert seen.prefill_tokens_in_flight == 0 and seen.decode_tokens_in_flight > prompt > 500
    else:  # answered whole, it stays prefill work until it completes
        assert seen.prefill_tokens_in_flight == prompt > 500 and seen.decode_tokens_in_flight == 0


def test_an_error_in_the_stream_is_answered_with_its_status_and_json() -> None:
    a = Assembler()
    a.add({"choices": [{"index": 0, "text": "partial"}]})
    a.add({"error": {"message": "the KV cache is gone", "code": 503}})
    upstream = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"r7")]
    status, headers, body = whole_answer(a, upstream, 200)
    assert status == 503 and (b"x-request-id", b"r7") in headers
    assert dict(headers)[b"content-type"] == b"application/json"
    assert dict(headers)[b"content-length"] == str(len(body)).encode()
    assert orjson.loads(body) == {"error": {"message": "the KV cache is gone", "code": 503}}


def test_the_load_generator_sends_a_share_of_non_streaming_requests_and_times_their_whole_answer() -> None:
    from leadtime.bench.gateway import GatewayBenchOptions, workload_shots
    from leadtime.bench.loadgen import PromptMaker, Shot, request_body, send
    from leadtime.router_plugin.gateway.upstream import UpstreamPool

    shots = workload_shots(GatewayBenchOptions(requests=200, non_streaming_share=0.5))
    assert 70 < sum(not s.stream for s in shots) < 130
    assert all(s.stream for s in workload_shots(GatewayBenchOptions(requests=200)))
    server = FleetServer(FLEET, [free_port()])
    server.start()

    async def both() -> list[Any]:
        pool = UpstreamPool("127.0.0.1", server.ports[0])
        out = []
        for stream in (True, False):
            shot = Shot(0, 0.0, (1,), 40, 6, 2000.0, 100.0, stream=stream)
            out.append(await send(pool, shot, request_body(PromptMaker().prompt(shot), 6, stream)))
        pool.close()
        return out

    try:
        streamed, whole = asyncio.run(both())
    finally:
        server.stop()
    assert streamed.ok and streamed.stream and streamed.ttft_ms > 0 and streamed.meets(2000.0, 100.0)
    assert whole.ok and not whole.stream and whole.tokens == 6 and whole.ttfb_ms > 0
    assert not whole.meets(2000.0, 100.0)  # its client saw no first token: not counted in goodput


def test_a_chat_answer_with_no_text_keeps_its_content_null() -> None:
    a = Assembler()
    a.add({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
    a.add({"choices": [{"index": 0, "delta": {"content": None}, "finish_reason": "stop"}]})
    assert a.body()["choices"][0]["message"] == {"role": "assistant", "content": None}


def test_a_stream_without_stream_options_goes_on_asking_for_the_usage() -> None:
    body = b'{"prompt": "hello", "stream": true}'
    asked = parse_request("/v1/completions", body, {}, ask_usage=True)
    assert asked.hide_usage and orjson.loads(asked.upstream_body or b"{}") == {
        "prompt": "hello",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert parse_request("/v1/completions", body, {}).upstream_body is None
    own = b'{"prompt": "hello", "stream": true, "stream_options": {"include_usage": false}}'
    mine = parse_request("/v1/completions", own, {}, ask_usage=True)  # the client's own options go unchanged
    assert mine.upstream_body is None and not mine.hide_usage


def test_a_hidden_usage_event_is_cut_out_wherever_the_pieces_break() -> None:
    stream = (
        b'data: {"choices":[{"index":0,"text":" a b"}]}\n\n'
        b'data: {"choices":[{"index":0,"text":" c","finish_reason":"length"}],"usage":{"completion_tokens":3}}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5}}\n\n'
        b"data: [DONE]\n\n"
    )
    usage_event = stream.split(b"\n\n")[2] + b"\n\n"
    for size in (1, 7, 64, len(stream)):
        meter = StreamMeter(hide_usage=True)
        passed = b"".join(meter.feed(stream[i : i + size], float(i)) for i in range(0, len(stream), size))
        passed += meter.rest()
        assert passed == stream.replace(usage_event, b""), size  # an event with choices keeps its usage
        assert (meter.tokens, meter.prompt_tokens, meter.events) == (3, 2, 2)
    meter = StreamMeter(hide_usage=True)
    assert meter.feed(b"data: [DO") == b"" and meter.rest() == b"data: [DO"  # an unfinished end goes on as it is
    meter = StreamMeter()
    assert meter.feed(stream) == stream  # not hiding: every byte goes on as it came


async def stream_of_twelve(client: httpx.AsyncClient) -> list[str]:
    async with client.stream("POST", "/v1/completions", json={"prompt": "x y", "max_tokens": 12, "stream": True}) as r:
        return [line async for line in r.aiter_lines() if line.startswith("data: ")]


def test_with_several_tokens_an_event_the_itl_is_per_token_once_the_usage_is_asked() -> None:
    outcomes, bytes_per_token = {}, {}
    for ask_usage in (True, False):
        policy, samples, lines = through(stream_of_twelve, ask_usage=ask_usage, tokens_per_event=3)
        events = [orjson.loads(line[6:]) for line in lines if line != "data: [DONE]"]
        assert lines[-1] == "data: [DONE]"
        assert all("usage" not in e for e in events)  # the client did not ask for it, and does not get it
        assert "".join(e["choices"][0]["text"] for e in events) == "".join(f" tok{i}" for i in range(12))
        (outcomes[ask_usage],) = policy.outcomes
        bytes_per_token[ask_usage] = counted(samples, "leadtime_router_prompt_bytes_per_token")
    # Asked, the usage counts 12 tokens in the 4 events; counted by events, 4, and each gap is taken for one
    # token's: 3 gaps over the span where there were 11.
    assert (outcomes[True].output_tokens, outcomes[False].output_tokens) == (12, 4)
    assert outcomes[False].itl_ms > 2 * outcomes[True].itl_ms
    # The usage's prompt length also teaches the prefix estimate its bytes per token ("x y": 3 bytes, 2 tokens).
    assert bytes_per_token[True] < bytes_per_token[False] == DEFAULT_BYTES_PER_TOKEN


def test_the_policy_is_told_of_the_first_token_as_it_streams_through() -> None:
    """Peers release a request's prefill side when its stream starts (`RoutingPolicy`'s `prefilled`): the gateway
    tells the policy when the first token passes, once, before the outcome."""
    policy, _, _ = through(stream_of_twelve)
    (request,), (outcome,) = policy.requests, policy.outcomes
    (kind, request_id, at), last = policy.told
    assert (kind, request_id) == ("prefilled", request.request_id) and last[:2] == ("observe", request.request_id)
    assert request.arrival_ms + outcome.ttft_ms <= at + 1e-6 and at <= outcome.completed_ms


def test_the_gateway_counts_the_decisions_its_policy_explored() -> None:
    """The exploration share (a decision taking an endpoint the model is unsure of) was counted by the policy and
    shown nowhere: an SRE could not tell exploration from a bad model."""

    class ExploresEveryOther(RoundRobinPolicy):
        def __init__(self) -> None:
            super().__init__()
            self.counters = PolicyCounters()

        def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
            self.counters.decisions += 1
            self.counters.explored += self.counters.decisions % 2
            return super().pick(request, candidates)

    async def four(client: httpx.AsyncClient) -> None:
        for i in range(4):
            assert (await client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2})).status_code == 200

    settings = GatewaySettings(scrape_interval_s=0.05)
    samples, _ = through_gateway(FLEET, ExploresEveryOther(), four, settings)
    assert [v for _, v in samples["leadtime_router_explorations_total"]] == [2.0]


ONE_TOKEN = (
    b'data: {"choices":[{"index":0,"text":" a","finish_reason":"length"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}\n\ndata: [DONE]\n\n'
)
SLOW_S = 0.5
"""How long the slow parts of the tests below take: an endpoint's 503, a client's upload."""


async def answers_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while await next_request(reader, writer) is not None:
            writer.write(STREAM_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(ONE_TOKEN), ONE_TOKEN))
            await writer.drain()


async def answers_503_late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An endpoint that cannot serve now, and takes `SLOW_S` to say so."""
    with contextlib.suppress(ConnectionError):
        while await next_request(reader, writer) is not None:
            await asyncio.sleep(SLOW_S)
            body = b'{"error":"overloaded"}'
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()


class FirstByName(Recording):
    """Picks the candidate whose id sorts first ("a" whenever it is offered), and keeps what it is told."""

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        super().pick(request, candidates)
        return Pick(min(c.endpoint_id for c in candidates))


@contextlib.asynccontextmanager
async def hand_written(policy: Recording, **handlers: Any) -> AsyncIterator[Gateway]:
    """A gateway deciding with `policy` in front of hand-written endpoints named as the keyword arguments."""
    servers = {name: await asyncio.start_server(h, "127.0.0.1", 0) for name, h in handlers.items()}
    specs = [
        f"127.0.0.1:{s.sockets[0].getsockname()[1]},name={name},leadtime.io/accelerator=h100-sxm"
        for name, s in servers.items()
    ]
    gateway = Gateway(StaticDiscovery(parse_static(specs)), policy, GatewaySettings(scrape_interval_s=0.05))
    await gateway.start()
    try:
        for _ in range(200):
            if len(gateway.routable()) == len(specs) and all(s.state is not None for s in gateway.routable()):
                break
            await asyncio.sleep(0.02)
        yield gateway
    finally:
        await gateway.stop()
        for server in servers.values():
            server.close()


def test_the_ttft_learned_after_a_retry_is_the_second_endpoints_own() -> None:
    """Regression: endpoint a took 1.5 s to answer 503, and the request was retried on b, which answered at once: b
    was taught a TTFT of 1.5 s (counted from the request's arrival, a's wait in it), and `x-leadtime-route-ms` said
    the gateway took 1,500 ms before sending the request on. The retry is decided as it is made, and its TTFT
    counted from when it was sent to b."""
    policy = FirstByName()

    async def go() -> tuple[httpx.Response, dict[str, Any]]:
        async with hand_written(policy, a=answers_503_late, b=answers_at_once) as gateway:
            transport = httpx.ASGITransport(app=gateway)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stream": True})
                return response, parse_samples((await client.get("/metrics")).text)

    response, samples = asyncio.run(go())
    assert response.status_code == 200 and response.headers["x-leadtime-endpoint"] == "b"
    (outcome,) = policy.outcomes
    assert outcome.endpoint_id == "b" and outcome.ttft_ms < SLOW_S * 1e3 / 2
    assert float(response.headers["x-leadtime-route-ms"]) < SLOW_S * 1e3 / 2
    assert counted(samples, "leadtime_router_overhead_seconds_sum") < SLOW_S / 2
    first, retry = policy.requests
    assert retry.arrival_ms - first.arrival_ms >= SLOW_S * 1e3  # the retry is decided when it is made
    assert counted(samples, "leadtime_router_ttft_seconds_sum", kind="actual") < SLOW_S / 2


def test_the_ttft_learned_does_not_hold_the_clients_upload() -> None:
    """Regression: a client whose body came in two parts 1 s apart (a long prompt on a slow link), to an endpoint
    that answered at once: the endpoint was taught a TTFT of 1 s, counted from the first part of the body, and
    `x-leadtime-route-ms` said the gateway took 1,000 ms before sending the request on."""
    policy = FirstByName()
    body = json.dumps({"prompt": "x" * 1000, "max_tokens": 1, "stream": True}).encode()
    parts = [body[:500], body[500:]]
    sent: list[MutableMapping[str, Any]] = []

    async def go() -> None:
        async with hand_written(policy, a=answers_at_once) as gateway:
            done = asyncio.Event()

            async def receive() -> dict[str, Any]:
                if len(parts) == 2:
                    return {"type": "http.request", "body": parts.pop(0), "more_body": True}
                if parts:
                    await asyncio.sleep(SLOW_S)  # the rest of the upload
                    return {"type": "http.request", "body": parts.pop(0), "more_body": False}
                await done.wait()
                return {"type": "http.disconnect"}

            async def send(message: MutableMapping[str, Any]) -> None:
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"", "headers": []}
            await gateway(scope, receive, send)
            done.set()

    asyncio.run(go())
    assert sent[0]["status"] == 200
    (outcome,) = policy.outcomes
    assert outcome.ttft_ms < SLOW_S * 1e3 / 2
    assert float(dict(sent[0]["headers"])[b"x-leadtime-route-ms"]) < SLOW_S * 1e3 / 2


def test_slo_attainment_is_the_clients_wait_a_retry_included() -> None:
    """Regression: once the TTFT learned was counted from when a request was sent to the endpoint that answered, the
    SLO attainment was judged on it too: a request whose first endpoint took half a second to fail it, retried and
    answered at once, was counted as meeting a 300 ms TTFT SLO its client waited longer than."""
    policy = FirstByName()

    async def go() -> dict[str, Any]:
        async with hand_written(policy, a=answers_503_late, b=answers_at_once) as gateway:
            transport = httpx.ASGITransport(app=gateway)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                response = await client.post(
                    "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 1, "stream": True},
                    headers={"x-llm-d-slo-ttft-ms": "300"},
                )
                assert response.status_code == 200 and response.headers["x-leadtime-endpoint"] == "b"
                return parse_samples((await client.get("/metrics")).text)

    samples = asyncio.run(go())
    (outcome,) = policy.outcomes
    assert outcome.ttft_ms < SLOW_S * 1e3 / 2  # b is taught its own TTFT
    assert counted(samples, "leadtime_router_slo_total", target="ttft", result="missed") == 1
    assert counted(samples, "leadtime_router_slo_total", target="ttft", result="met") == 0


def sse(*events: dict[str, Any]) -> bytes:
    """`events` as one chunk of an event stream."""
    data = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return b"%x\r\n%s\r\n" % (len(data), data)


def streams_a_tool_call(go_on: asyncio.Event) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]:
    """An endpoint answering a chat with a tool call, as vLLM streams one (`delta.tool_calls`, no content): the
    call's name, then, once `go_on` is set, its arguments, the finish and the usage."""

    def delta(piece: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": piece, "finish_reason": finish}]}

    named = {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}
    argued = {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 2, "total_tokens": 902}}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while await next_request(reader, writer) is not None:
                writer.write(STREAM_HEAD + sse(delta({"role": "assistant", "content": ""}), delta(named)))
                await writer.drain()
                await go_on.wait()
                writer.write(sse(delta(argued), delta({}, "tool_calls"), usage) + sse() + b"0\r\n\r\n")
                await writer.drain()

    return handle


def test_a_streamed_tool_call_is_measured_and_its_prompt_is_no_longer_prefill_work_once_it_starts() -> None:
    """Regression: a chat answered with a tool call, streamed, was never measured (no TTFT, ITL, SLO judgement or
    outcome: its deltas carry `tool_calls`, no text), and the work tracker held its prompt as prefill work waiting
    on the endpoint for its whole decode, steering the policy away from an endpoint busy with tool calls."""
    policy = Recording()
    go_on = asyncio.Event()
    prompt = "what is the weather like " * 100

    async def go() -> tuple[tuple[int, int], httpx.Response, dict[str, Any]]:
        async with hand_written(policy, a=streams_a_tool_call(go_on)) as gateway:
            transport = httpx.ASGITransport(app=gateway)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "tools": [{"type": "x"}]}
                request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
                work = gateway.work.tokens("a", published_ms=float("inf"))
                deadline = asyncio.get_running_loop().time() + 5
                while work[1] == 0 and asyncio.get_running_loop().time() < deadline:  # until it counts as decoding
                    await asyncio.sleep(0.01)
                    work = gateway.work.tokens("a", published_ms=float("inf"))
                go_on.set()
                response = await request
                return work, response, parse_samples((await client.get("/metrics")).text)

    (prefill, decode), response, samples = asyncio.run(go())
    assert response.status_code == 200 and '"arguments":"{\\"city\\": \\"Oslo\\"}"' in response.text
    assert prefill == 0 and decode > 500, (prefill, decode)  # after the tool call's first delta: its prompt decodes
    (outcome,) = policy.outcomes
    assert outcome.output_tokens == 2 and outcome.ttft_ms > 0
    assert counted(samples, "leadtime_router_ttft_seconds_count", kind="actual") == 1


def test_the_itl_and_ttft_buckets_resolve_the_range_they_usually_fall_in() -> None:
    """Mean ITLs of 8B models on H100/H200 fall between 5 and 10 ms: buckets jumping from 5 to 10 ms put 99% of them
    in one, and the median panel drew its midpoint, 7.5 ms, whatever the ITL. From 2 to 20 ms the ITL buckets are
    at most a third apart; the TTFT buckets at most half apart from 10 ms to 2 s. Few enough for the series they
    multiply (kind × accelerator)."""
    itl = [b for b in ITL_BUCKETS_S if 0.002 <= b <= 0.02]
    assert itl[0] == 0.002 and itl[-1] == 0.02
    assert all(b / a <= 4 / 3 + 1e-9 for a, b in itertools.pairwise(itl)), itl
    ttft = [b for b in LATENCY_BUCKETS_S if 0.01 <= b <= 2.0]
    assert ttft[0] == 0.01 and ttft[-1] == 2.0
    assert all(b / a <= 1.5 + 1e-9 for a, b in itertools.pairwise(ttft)), ttft
    assert len(ITL_BUCKETS_S) <= 30 and len(LATENCY_BUCKETS_S) <= 30


def test_a_predictor_call_cut_at_the_default_deadline_is_drawn_just_above_it() -> None:
    """With the 20 ms default deadline on a bucket boundary, calls that ran into it (20.5 ms) landed in (20, 50] ms
    and the p99 panel read about 50 ms: calls overrunning their deadline 2.5 times, it seemed."""
    deadline_s = DEFAULT_DEADLINE_MS / 1e3
    above = min(b for b in FAST_BUCKETS_S if b > deadline_s)
    assert above <= 1.25 * deadline_s + 1e-9
