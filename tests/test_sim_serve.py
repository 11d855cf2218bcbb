"""Mock vLLM endpoints over real HTTP: /metrics parses with features/, streams deliver the requested tokens."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest
import yaml

from leadtime.bench.procs import free_port, free_ports
from leadtime.features.vllm_metrics import parse_vllm_metrics
from leadtime.simulator.fleet import parse_fleet
from leadtime.simulator.serve import FleetServer, serve_fleet

FLEET = {
    "pools": [
        {"name": "h100", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
        {"name": "l40s", "count": 1, "accelerator": "l40s", "model": "llama-3.1-8b"},
    ]
}


def serving(document: Mapping[str, object]) -> Iterator[FleetServer]:
    """The fleet `document` describes, served on free ports for as long as the fixture lasts."""
    fleet = parse_fleet(document)
    srv = FleetServer(fleet, [free_port() for _ in fleet.endpoints])
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server() -> Iterator[FleetServer]:
    yield from serving(FLEET)


def _url(server: FleetServer, endpoint: str = "h100-0") -> str:
    return server.urls[endpoint]


def test_metrics_parse_with_features(server: FleetServer) -> None:
    text = httpx.get(_url(server) + "/metrics", timeout=10).text
    metrics = parse_vllm_metrics(text)
    assert metrics.num_requests_running == 0 and metrics.num_requests_waiting == 0
    assert metrics.block_size == 16 and metrics.num_gpu_blocks and metrics.num_gpu_blocks > 1000
    assert 0.0 <= metrics.kv_cache_usage <= 1.0


def test_completion_returns_the_requested_tokens(server: FleetServer) -> None:
    reply = httpx.post(
        _url(server) + "/v1/completions", json={"prompt": "one two three " * 50, "max_tokens": 12}, timeout=30
    )
    assert reply.status_code == 200
    body = reply.json()
    assert body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": 150, "completion_tokens": 12, "total_tokens": 162}
    assert len(body["choices"][0]["text"].split()) == 12


@pytest.mark.parametrize(
    "path,payload",
    [
        ("/v1/completions", {"prompt": "stream me please", "max_tokens": 9, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "stream": True}),
    ],
)
def test_streams_deliver_every_token_then_done(server: FleetServer, path: str, payload: dict[str, object]) -> None:
    with httpx.stream("POST", _url(server, "l40s-0") + path, json=payload, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # As vLLM's: in chat the role comes first; the last event of the choice says why it finished, with no text.
    texts = [c["choices"][0]["delta" if "chat" in path else "text"] for c in chunks]
    if "chat" in path:
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert texts[0] == {"role": "assistant", "content": ""}
        texts = [t["content"] for t in texts[1:]]
    assert texts == [f" tok{i}" for i in range(9)] + [""]
    assert [c["choices"][0]["finish_reason"] for c in chunks[-2:]] == [None, "length"]


@pytest.mark.parametrize("stream", [{}, {"stream": None}])
def test_non_streaming_chat(server: FleetServer, stream: dict[str, None]) -> None:
    reply = httpx.post(
        _url(server) + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "a b c"}], "max_completion_tokens": 4, **stream},
        timeout=30,
    )
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"


def test_requests_the_openai_clients_send_are_taken_as_vllm_takes_them(server: FleetServer) -> None:
    """Content as a list of parts, a message without content, `max_tokens: null`: each was a 422 from the mock."""
    parts = [
        {"type": "text", "text": "a b"},
        {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "c"},
    ]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": None}]
    chat = httpx.post(_url(server) + "/v1/chat/completions", json={"messages": messages, "max_tokens": 3}, timeout=30)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    body = {"prompt": "one two", "max_tokens": None}
    completion = httpx.post(_url(server) + "/v1/completions", json=body, timeout=30)
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 16


def test_a_prompt_of_token_ids_is_served_as_vllm_serves_it(server: FleetServer) -> None:
    """vLLM takes a completion's prompt as token ids too (a list of them, or a list of one such list), and the
    gateway passes such a prompt on unchanged: the mock answered 422 `prompt.str: Input should be a valid string`."""
    for prompt in ([11, 12, 13, 12], [[11, 12, 13, 12]]):
        reply = httpx.post(_url(server) + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    bad_prompts: list[object] = [[], [[]], [-1], [[1], [2]], [1.5]]
    for bad in bad_prompts:
        reply = httpx.post(_url(server) + "/v1/completions", json={"prompt": bad}, timeout=10)
        assert reply.status_code == 422 and reply.json()["field"] == "prompt", reply.text


def test_tokenize_counts_a_chats_messages_as_the_chat_would_be_counted(server: FleetServer) -> None:
    """vLLM's /tokenize takes a chat's `messages` as well as a prompt (the gateway passes both on); the mock refused
    `messages` with a 422 for a missing `prompt`. A chat is counted as /v1/chat/completions counts its prompt."""
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a b"}]},
    ]
    reply = httpx.post(_url(server) + "/tokenize", json={"messages": messages}, timeout=10)
    assert reply.status_code == 200, reply.text
    chat = httpx.post(_url(server) + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=30)
    assert reply.json()["count"] == chat.json()["usage"]["prompt_tokens"] == 4
    assert httpx.post(_url(server) + "/tokenize", json={"prompt": "a b c"}, timeout=10).json()["count"] == 3
    bad_bodies: list[dict[str, object]] = [{}, {"prompt": "a", "messages": messages}, {"messages": []}]
    for bad in bad_bodies:
        reply = httpx.post(_url(server) + "/tokenize", json=bad, timeout=10)
        assert reply.status_code == 422 and reply.json()["field"] in ("prompt", "messages"), reply.text


def test_bad_requests_get_422_naming_the_field_as_the_service_does(server: FleetServer) -> None:
    reply = httpx.post(_url(server) + "/v1/completions", json={"prompt": "x", "max_tokens": 0}, timeout=10)
    assert reply.status_code == 422
    assert reply.json()["field"] == "max_tokens" and reply.json()["error"].startswith("max_tokens: ")
    assert any(err["loc"][-1] == "max_tokens" for err in reply.json()["detail"])
    reply = httpx.post(_url(server) + "/v1/chat/completions", json={"messages": []}, timeout=10)
    assert reply.status_code == 422 and reply.json()["field"] == "messages"


@pytest.mark.parametrize(
    "path,payload,prefix",
    [
        ("/v1/completions", {"prompt": "a b", "max_tokens": 3}, "cmpl-"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}, "chatcmpl-"),
    ],
)
def test_answers_carry_vllms_ids_and_logprobs_and_compact_chunks(
    server: FleetServer, path: str, payload: dict[str, object], prefix: str
) -> None:
    """As vLLM's: a chat completion's id starts `chatcmpl-` (a text completion's `cmpl-`), every choice of a stream
    chunk carries `"logprobs": null`, and the usage chunk is written as compactly as the others."""
    reply = httpx.post(_url(server) + path, json=payload, timeout=30)
    assert reply.status_code == 200 and reply.json()["id"].startswith(prefix), reply.text
    assert reply.json()["choices"][0]["logprobs"] is None
    streamed = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", _url(server) + path, json=streamed, timeout=30) as response:
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")][:-1]
    chunks = [json.loads(e) for e in events]
    assert all(c["id"].startswith(prefix) for c in chunks) and len({c["id"] for c in chunks}) == 1
    assert all(c["choices"][0]["logprobs"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(e == json.dumps(json.loads(e), separators=(",", ":"), ensure_ascii=False) for e in events), events


def test_a_body_that_is_not_json_is_named_as_the_body(server: FleetServer) -> None:
    """It was `{"error": "[0]: JSON decode error", "field": "[0]"}`; the service says `body: is not valid JSON`."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        reply = httpx.post(
            _url(server) + path, content=b"{not json", headers={"content-type": "application/json"}, timeout=10
        )
        assert reply.status_code == 400, reply.text
        assert reply.json()["field"] == "body", reply.text
        assert reply.json()["error"].startswith("body: is not valid JSON ("), reply.text


def test_requests_for_several_choices_are_refused_naming_the_field(server: FleetServer) -> None:
    """A simulated endpoint answers one choice: `n` > 1 or several prompts were answered as one, silently."""
    for path, body, field in (
        ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
        ("/v1/completions", {"prompt": ["one", "two"]}, "prompt"),
    ):
        reply = httpx.post(_url(server) + path, json=body, timeout=10)
        assert reply.status_code == 422 and reply.json()["field"] == field, reply.text
        assert "one choice" in reply.json()["error"]
    one_choice: list[dict[str, object]] = [
        {"prompt": "x", "n": 1, "max_tokens": 2},
        {"prompt": ["x"], "n": None, "max_tokens": 2},
    ]
    for ok in one_choice:
        assert httpx.post(_url(server) + "/v1/completions", json=ok, timeout=30).status_code == 200


def test_a_request_larger_than_the_kv_cache_is_a_422_naming_the_prompt() -> None:
    # 16.3 GB of the L40S's 48 for a 16 GB model: a KV cache of a few thousand tokens.
    pool = {"name": "tiny", "count": 1, "accelerator": "l40s", "model": "llama-3.1-8b", "gpu_memory_utilization": 0.34}
    srv = FleetServer(parse_fleet({"pools": [pool]}), [free_port()])
    srv.start()
    try:
        body = {"prompt": "w " * 10, "max_tokens": 32768}
        reply = httpx.post(srv.urls["tiny-0"] + "/v1/completions", json=body, timeout=10)
    finally:
        srv.stop()
    assert reply.status_code == 422
    assert reply.json()["field"] == "prompt" and "KV cache" in reply.json()["error"]
    capacity = srv.live[0].engine.cache.capacity_tokens
    assert f"(10 + 32768 tokens) exceed the {capacity} tokens this endpoint's KV cache holds" in reply.json()["error"]


def test_a_model_the_endpoint_does_not_serve_is_404_as_in_vllm(server: FleetServer) -> None:
    served = httpx.get(_url(server) + "/v1/models", timeout=10).json()["data"][0]["id"]
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ):
        reply = httpx.post(_url(server) + path, json={**body, "model": "gpt-9"}, timeout=10)
        assert reply.status_code == 404 and reply.json()["error"] == "The model `gpt-9` does not exist."
        assert httpx.post(_url(server) + path, json={**body, "model": served}, timeout=30).status_code == 200
        assert httpx.post(_url(server) + path, json=body, timeout=30).status_code == 200  # no model: the one served


def test_load_shows_in_metrics_while_requests_run(server: FleetServer) -> None:
    import threading

    url = _url(server, "l40s-0")
    done: list[int] = []

    def call() -> None:
        r = httpx.post(url + "/v1/completions", json={"prompt": "w " * 3000, "max_tokens": 60}, timeout=60)
        done.append(r.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    seen = 0
    for _ in range(50):
        m = parse_vllm_metrics(httpx.get(url + "/metrics", timeout=10).text)
        seen = max(seen, m.num_requests_running + m.num_requests_waiting)
        if seen:
            break
    for t in threads:
        t.join()
    assert seen > 0
    assert done == [60, 60, 60, 60]
    # Counted as vLLM counts them (it was kept and never reported).
    text = httpx.get(url + "/metrics", timeout=10).text
    (line,) = [x for x in text.splitlines() if x.startswith("vllm:request_success_total")]
    assert float(line.split()[-1]) >= 4


def test_timesliced_endpoint_goes_away_and_comes_back() -> None:
    import time

    doc = {
        "pools": [
            {"name": "ts", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "timeslice_group": "rl"}
        ],
        "timeslice_groups": {
            "rl": {
                "resident_ms": {"distribution": "fixed", "value": 100},
                "away_ms": {"distribution": "fixed", "value": 300},
                "restore_ms": {"distribution": "fixed", "value": 50},
            }
        },
    }
    fleet = parse_fleet(doc)
    srv = FleetServer(fleet, [free_port()])
    srv.start()
    try:
        url = srv.urls["ts-0"]
        states: set[str] = set()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and len(states) < 2:
            text = httpx.get(url + "/metrics", timeout=5).text
            line = next(x for x in text.splitlines() if x.startswith("leadtime_sim_timeslice_resident"))
            states.add(line.split()[-1])
            time.sleep(0.02)
        assert states == {"0", "1"}
        reply = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=10)
        assert reply.json()["usage"]["completion_tokens"] == 3  # served across swaps
    finally:
        srv.stop()


def test_the_mock_orchestrator_says_what_its_clock_reads() -> None:
    """Its documents carry `now` beside each group's `since`, so that a gateway measures how long a group has been
    in its state on the orchestrator's clock alone."""
    import asyncio

    from leadtime.router_plugin.timeslice_sources import parse_groups
    from leadtime.simulator.serve import GroupClock, build_timeslice_app

    async def get() -> dict[str, object]:
        transport = httpx.ASGITransport(app=build_timeslice_app({"rl": GroupClock("parked", time.time() - 4.0)}))
        async with httpx.AsyncClient(transport=transport, base_url="http://orchestrator") as client:
            answer: dict[str, object] = (await client.get("/v1/timeslice/groups")).json()
            return answer

    doc = asyncio.run(get())
    assert isinstance(doc["now"], float)
    assert abs(doc["now"] - time.time()) < 5.0
    status = parse_groups(doc, router_now_ms=100_000.0, wall_now_s=time.time() + 3600.0)[
        "rl"
    ]  # the router's clock is off by an hour
    assert 95_000.0 < status.since_ms <= 96_000.0


def test_a_stream_whose_client_hangs_up_is_aborted_as_vllm_aborts_it(server: FleetServer) -> None:
    """The mock generated on for nobody (running 32 after 40 clients left), so a gateway in front of it routed
    on load no one was waiting for."""
    url = _url(server, "h100-0")
    body = {"prompt": "w " * 200, "max_tokens": 5000, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert [next(lines) for _ in range(3)]  # a few events in, then gone
    assert _idle(url) == (0, 0)


def _idle(url: str) -> tuple[int, int]:
    """Running and waiting requests once both are 0, or as they stand after ~2 s."""
    running = waiting = -1
    for _ in range(100):
        m = parse_vllm_metrics(httpx.get(url + "/metrics", timeout=10).text)
        running, waiting = m.num_requests_running, m.num_requests_waiting
        if running == waiting == 0:
            break
        time.sleep(0.02)
    return running, waiting


def _generated(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    (line,) = [x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total")]
    return float(line.split()[-1])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_non_streaming_request_whose_client_hangs_up_is_aborted_as_vllm_aborts_it(
    server: FleetServer, path: str
) -> None:
    """Only streams were aborted: a client that timed out on a whole answer left the mock generating for minutes
    (a gateway with timeouts in front of it saw load no one was waiting for)."""
    url = _url(server, "h100-0")
    body: dict[str, object] = {"max_tokens": 5000}
    body.update(
        {"prompt": "w " * 200} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + path, json=body, timeout=httpx.Timeout(10.0, read=0.3))
    assert _idle(url) == (0, 0)
    generated = _generated(url)
    time.sleep(0.2)
    assert _generated(url) == generated


def test_a_live_endpoint_keeps_nothing_of_the_steps_it_ran(server: FleetServer) -> None:
    """Each step's (start, end) was kept for the offline report's utilisation, which a live server never makes: `sim
    serve` grew by ~2.4 MB a minute under load."""
    live = next(e for e in server.live if e.config.endpoint_id == "h100-0")
    reply = httpx.post(_url(server) + "/v1/completions", json={"prompt": "step by step", "max_tokens": 64}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 64  # one step per token
    assert live.engine.busy_intervals == []


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 64, 128])
def test_a_prompts_prefix_segments_are_whole_blocks_of_the_endpoints_cache(block_size: int) -> None:
    """With 16-word segments and blocks of 64 a published prefix held 0 blocks: never evicted, it gave free hits for
    ever (a prompt evicted long ago took 11 ms where 607 ms was due). `simulate` refuses such segments."""
    from leadtime.simulator.serve import PREFIX_BLOCK_WORDS, word_block_hashes

    pool = {"name": "a", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "block_size": block_size}
    live = FleetServer(parse_fleet({"pools": [pool]}), [0]).live[0]
    words = [f"w{i}" for i in range(300)]
    request = live._request(1, words, 4)
    assert request.segment_tokens % block_size == 0 and request.segment_tokens >= PREFIX_BLOCK_WORDS
    assert len(request.segments) == 300 // request.segment_tokens
    if block_size <= PREFIX_BLOCK_WORDS:  # as before: 16-word segments
        assert request.segment_tokens == PREFIX_BLOCK_WORDS
        assert request.segments == word_block_hashes(words)


PD_FLEET = {
    # 0.05 GB/s: a 300-word prompt's KV (~39 MB) takes ~0.8 s to cross the decode endpoint's link.
    "kv_link_gb_s": 0.05,
    "pools": [
        # 0.21 of an H100 for a 16 GB model: a KV cache of 5,632 tokens; 64-token steps: a 5,000-word prompt
        # takes ~80 steps (~0.5 s) to prefill.
        {"name": "p", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"}
        | {"gpu_memory_utilization": 0.21, "max_num_batched_tokens": 64},
        {"name": "d", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "decode"},
    ],
}


@pytest.fixture(scope="module")
def pd_server() -> Iterator[FleetServer]:
    yield from serving(PD_FLEET)


def _prefiller(server: FleetServer) -> dict[str, str]:
    return {"x-prefiller-host-port": server.urls["p-0"].removeprefix("http://")}


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_the_named_prefiller_cannot_hold_is_a_422_naming_it(pd_server: FleetServer, stream: bool) -> None:
    """The decode endpoint checked its own KV cache only: the prefiller refused the prompt in a task nobody awaited,
    and the client waited for ever, streaming or not (a traceback in the log, the stream's queue kept)."""
    body = {"prompt": "w " * 8000, "max_tokens": 4, "stream": stream}
    reply = httpx.post(pd_server.urls["d-0"] + "/v1/completions", json=body, headers=_prefiller(pd_server), timeout=10)
    assert reply.status_code == 422 and reply.json()["field"] == "prompt"
    assert "5632 tokens" in reply.json()["error"] and "p-0" in reply.json()["error"]
    assert not pd_server.live[1].streams


def test_a_pd_request_whose_client_hangs_up_during_the_kv_transfer_is_not_decoded(pd_server: FleetServer) -> None:
    """The client's departure was checked once the prefill ended, not once the KV landed: a client gone during the
    transfer left the decode endpoint generating its whole answer for no one."""
    decode = pd_server.live[1]
    url = pd_server.urls["d-0"]
    body = {"prompt": " ".join(f"w{i}" for i in range(300)), "max_tokens": 5000, "stream": True}
    with pytest.raises(httpx.ReadTimeout):  # the first token comes with the KV, ~0.8 s after the prefill
        httpx.post(
            url + "/v1/completions", json=body, headers=_prefiller(pd_server), timeout=httpx.Timeout(10, read=0.3)
        )
    for _ in range(200):  # until the transfer has landed
        if decode.link_free_ms and decode.now_ms() > decode.link_free_ms + 100:
            break
        time.sleep(0.02)
    assert _idle(url) == (0, 0)
    assert not decode.streams


def test_a_pd_request_whose_client_hangs_up_during_the_prefill_is_not_prefilled_on(pd_server: FleetServer) -> None:
    """The prefill endpoint went on prefilling for a client gone (a long prompt holds it for seconds)."""
    prefiller = pd_server.live[0]
    queried = prefiller.counters.prefix_queries  # counted as each prefill ends
    body = {"prompt": " ".join(f"v{i}" for i in range(5000)), "max_tokens": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            pd_server.urls["d-0"] + "/v1/completions",
            json=body,
            headers=_prefiller(pd_server),
            timeout=httpx.Timeout(10, read=0.1),
        )
    assert _idle(pd_server.urls["p-0"]) == (0, 0)
    assert prefiller.counters.prefix_queries == queried and not prefiller.prefills


def test_a_fleet_on_every_address_takes_its_prefiller_by_any_of_them() -> None:
    """Bound to 0.0.0.0 (for clients in other containers), the decode endpoints knew their prefillers as
    `0.0.0.0:PORT` alone: llm-d or a gateway naming one by an address it reaches got 400 on every P/D request."""
    fleet = parse_fleet(PD_FLEET)
    srv = FleetServer(fleet, [free_port() for _ in fleet.endpoints], host="0.0.0.0")
    srv.start()
    try:
        prefill_port = srv.ports[0]
        body = {"prompt": "a b c", "max_tokens": 2}
        for host in ("127.0.0.1", "localhost", "0.0.0.0"):
            reply = httpx.post(
                f"http://127.0.0.1:{srv.ports[1]}/v1/completions",
                json=body,
                headers={"x-prefiller-host-port": f"{host}:{prefill_port}"},
                timeout=30,
            )
            assert reply.status_code == 200, (host, reply.text)
        assert srv.live[0].counters.prefills_for_peers == 3
        reply = httpx.post(
            f"http://127.0.0.1:{srv.ports[1]}/v1/completions",
            json=body,
            headers={"x-prefiller-host-port": f"127.0.0.1:{srv.ports[1]}"},  # a port of the fleet, not a prefiller's
            timeout=30,
        )
        assert reply.status_code == 400 and "not a prefill endpoint" in reply.json()["error"]
    finally:
        srv.stop()


def test_names_with_quotes_leave_streams_and_metrics_parseable() -> None:
    """A pool or model name with a quote went into stream events and /metrics unescaped: every event was invalid
    JSON, and every scrape failed."""
    pool = {"name": 'h100"x', "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}
    srv = FleetServer(parse_fleet({"pools": [pool]}), [free_port()], model_name='my"model\\v1')
    srv.start()
    try:
        url = srv.urls['h100"x-0']
        body = {"prompt": "a b", "max_tokens": 2, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")][:-1]
        assert {json.loads(e)["id"] for e in events} == {'cmpl-h100"x-0-1'}
        assert {json.loads(e)["model"] for e in events} == {'my"model\\v1'}
        metrics = parse_vllm_metrics(httpx.get(url + "/metrics", timeout=10).text)
        assert metrics.num_requests_running == 0 and metrics.num_gpu_blocks
    finally:
        srv.stop()


def test_the_discovery_file_appears_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It was written in place: a client waiting for it to appear (as `bench.procs.SimFleet` and a shell's
    `until [ -f ]` do) read it empty 4 times in 10, the instant between its creation and its write."""
    path = tmp_path / "endpoints.yaml"
    appeared: list[tuple[bool, str]] = []  # (the name was there already, what appeared under it)
    real_replace = os.replace

    def replace(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        if Path(target) == path:
            appeared.append((path.exists(), Path(source).read_text()))
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(FleetServer, "wait", FleetServer.stop)  # serve_fleet returns once the file is written
    serve_fleet(parse_fleet(FLEET), base_port=free_ports(2), endpoints_file=path)
    assert len(appeared) == 1 and not appeared[0][0]
    written = yaml.safe_load(appeared[0][1])
    assert [e["name"] for e in written["endpoints"]] == ["h100-0", "l40s-0"]
    assert written == yaml.safe_load(path.read_text()) and [p.name for p in tmp_path.iterdir()] == [path.name]
