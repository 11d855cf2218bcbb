"""The gateway's parts on their own: discovery, request parsing, stream timing, prefix affinity, scraping's
metric names, time-slice documents, the predictor wrapper's breaker and batches, the lean HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from inprocess_gateway import counted
from raw_endpoint import STREAM_HEAD, next_request

from leadtime.features.prefix import PrefixIndex, text_chunk_hashes
from leadtime.features.rows import EndpointState, FeatureRow, Observation, RequestFeatures
from leadtime.features.vllm_metrics import parse_samples, parse_vllm_metrics
from leadtime.router_plugin.affinity import PrefixAffinity
from leadtime.router_plugin.client import BulkPredictions, PredictorError, PredictorUnavailable
from leadtime.router_plugin.discovery import (
    DiscoveryError,
    FileDiscovery,
    StaticDiscovery,
    parse_endpoints,
    parse_static,
)
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.gateway.assemble import Assembler
from leadtime.router_plugin.gateway.inflight_work import Active, InflightWork
from leadtime.router_plugin.gateway.metrics import FALLBACK_REASONS, GatewayMetrics
from leadtime.router_plugin.gateway.passthrough import PassedThroughLoad
from leadtime.router_plugin.gateway.predictor import GatewayPredictor, failure_reason
from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient
from leadtime.router_plugin.gateway.requests import BadRequest, parse_request
from leadtime.router_plugin.gateway.stream import StreamMeter
from leadtime.router_plugin.heuristics import RoundRobinPolicy
from leadtime.router_plugin.policy import Candidate, RouteRequest
from leadtime.router_plugin.predicted import LeadtimePolicy
from leadtime.router_plugin.scrape import EndpointScrape, wanted_lines
from leadtime.router_plugin.timeslice_sources import FileTimesliceSource, TimesliceError, parse_groups

ENDPOINTS = {
    "endpoints": [
        {"name": "a", "address": "10.0.0.1", "port": "8000", "labels": {"leadtime.io/accelerator": "h100-sxm"}},
        {
            "name": "b",
            "namespace": "serving",
            "address": "10.0.0.2",
            "port": 8001,
            "labels": {"llm-d.ai/role": "decode", "leadtime.io/timeslice-group": "rl"},
        },
    ]
}


# ----- discovery -------------------------------------------------------------------------------------------


def test_discovery_reads_llmd_files() -> None:
    a, b = parse_endpoints(ENDPOINTS)
    assert (a.endpoint_id, a.host_port, a.role, a.base_state().accelerator) == (
        "a",
        "10.0.0.1:8000",
        "both",
        "h100-sxm",
    )
    assert (b.endpoint_id, b.port, b.role, b.timeslice_group) == ("serving/b", 8001, "decode", "rl")
    assert b.base_state("l40s", "llama-3.1-8b").timeslice_state == "resident"


@pytest.mark.parametrize(
    "change,field",
    [
        ({"port": "eighty"}, "endpoints[0].port"),
        ({"port": 70000}, "endpoints[0].port"),
        ({"address": ""}, "endpoints[0].address"),
        ({"labels": {"llm-d.ai/role": "router"}}, "endpoints[0].labels.llm-d.ai/role"),
        ({"labels": {"leadtime.io/accelerator": "abacus"}}, "endpoints[0].labels.leadtime.io/accelerator"),
        ({"labels": {"leadtime.io/tensor-parallel": "0"}}, "endpoints[0].labels.leadtime.io/tensor-parallel"),
        ({"labels": {"leadtime.io/tensor-parallel": 0}}, "endpoints[0].labels.leadtime.io/tensor-parallel"),
        ({"labels": {"leadtime.io/tensor-parallel": True}}, "endpoints[0].labels.leadtime.io/tensor-parallel"),
        ({"name": "serving/b"}, None),
    ],
)
def test_discovery_errors_name_the_field(change: dict[str, object], field: str | None) -> None:
    data = json.loads(json.dumps(ENDPOINTS))
    data["endpoints"][0].update(change)
    if field is None:  # a duplicate id: "serving/b" as a name is not the same as namespace serving, name b
        data["endpoints"][0]["namespace"] = ""
        data["endpoints"][1] = {**data["endpoints"][1], "namespace": "", "name": "serving/b"}
    with pytest.raises(DiscoveryError) as err:
        parse_endpoints(data)
    assert str(err.value).startswith(field or "endpoints[1].name")


def test_one_server_listed_under_two_names_is_refused() -> None:
    """Two names for one address and port loaded silently: the gateway counted that server's load twice."""
    data = json.loads(json.dumps(ENDPOINTS))
    data["endpoints"][1].update(address=data["endpoints"][0]["address"], port=data["endpoints"][0]["port"])
    with pytest.raises(DiscoveryError) as err:
        parse_endpoints(data)
    assert str(err.value) == "endpoints[1].address: 10.0.0.1:8000 is endpoint 'a' already"


@pytest.mark.parametrize(
    "first,second",
    [
        ("Node1", "node1"),  # host names are case-insensitive
        ("node1.example", "NODE1.example."),  # ... and a trailing dot names the same host
        ("::1", "0:0:0:0:0:0:0:1"),
        ("[2001:DB8::1]", "2001:db8:0::1"),
        ("10.0.0.1", "::ffff:10.0.0.1"),  # an IPv4-mapped IPv6 address reaches the IPv4 one
    ],
)
def test_one_server_listed_under_two_spellings_of_its_host_is_refused(first: str, second: str) -> None:
    """Only the same text was caught: `Node1` and `node1`, `::1` and `0:0:0:0:0:0:0:1`, loaded as two servers."""
    data = json.loads(json.dumps(ENDPOINTS))
    data["endpoints"][0].update(address=first)
    data["endpoints"][1].update(address=second, port=data["endpoints"][0]["port"])
    with pytest.raises(DiscoveryError) as err:
        parse_endpoints(data)
    assert str(err.value).startswith("endpoints[1].address: "), err.value
    assert "is endpoint 'a' already" in str(err.value)


def test_a_link_local_address_on_two_interfaces_is_two_servers() -> None:
    """The zone names the interface (case-sensitive, as Linux names them): only the address before it is
    canonical."""
    data = json.loads(json.dumps(ENDPOINTS))
    data["endpoints"][0].update(address="fe80::1%eth0")
    data["endpoints"][1].update(address="FE80::1%Eth0", port=data["endpoints"][0]["port"])
    assert [e.endpoint_id for e in parse_endpoints(data)] == ["a", "serving/b"]


def test_a_number_written_unquoted_as_a_label_is_its_text() -> None:
    data = yaml.safe_load(
        "endpoints:\n- {name: a, address: 127.0.0.1, port: 8000, labels: {leadtime.io/tensor-parallel: 2}}"
    )
    (endpoint,) = parse_endpoints(data)
    assert endpoint.labels["leadtime.io/tensor-parallel"] == "2"
    assert endpoint.base_state("h100-sxm", "llama-3.1-8b").tensor_parallel == 2


@pytest.mark.parametrize(
    "data,expected",
    [
        ({"endpoints": ["vllm-0"]}, "endpoints[0]: expected a mapping {name, namespace, address, port, labels}"),
        (
            {"endpoints": [{"name": "a", "address": "10.0.0.1", "port": 8000, "labels": ["llm-d.ai/role"]}]},
            "endpoints[0].labels: expected a mapping of label names to values",
        ),
    ],
)
def test_a_misshapen_endpoint_says_what_it_expects(data: object, expected: str) -> None:
    """ "Input should be a valid dictionary or instance of _EndpointSpec" named a class no file's author sees."""
    with pytest.raises(DiscoveryError) as err:
        parse_endpoints(data)
    assert str(err.value) == expected


def test_labels_left_null_are_no_labels(tmp_path: Path) -> None:
    """`labels:` with every label commented out is YAML's null (as `"labels": null` is JSON's): the whole file was
    refused, a live reload kept the previous set, while llm-d's own loader reads it as no labels."""
    path = tmp_path / "endpoints.yaml"
    path.write_text(
        "endpoints:\n- name: a\n  address: 10.0.0.1\n  port: 8000\n  labels:\n    # llm-d.ai/role: decode\n"
    )
    (endpoint,) = FileDiscovery(path).endpoints
    assert endpoint.labels == {} and endpoint.role == "both"
    path = tmp_path / "endpoints.json"
    path.write_text(json.dumps({"endpoints": [{"name": "a", "address": "10.0.0.1", "port": "8000", "labels": None}]}))
    (endpoint,) = FileDiscovery(path).endpoints
    assert endpoint.labels == {}


def test_static_endpoints() -> None:
    (e,) = parse_static(["127.0.0.1:9000,name=x,llm-d.ai/role=prefill"])
    assert (e.endpoint_id, e.port, e.role) == ("x", 9000, "prefill")
    with pytest.raises(DiscoveryError, match="ADDRESS:PORT"):
        parse_static(["nowhere"])
    with pytest.raises(DiscoveryError, match="KEY=VALUE"):
        parse_static(["127.0.0.1:9000,oops"])


def test_file_discovery_keeps_the_previous_set_on_a_bad_reload(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text(json.dumps(ENDPOINTS))
    discovery = FileDiscovery(path)
    assert len(discovery.endpoints) == 2 and not discovery.poll()  # unchanged file: nothing re-read
    for bad in (b"endpoints: [", b"x" * (FileDiscovery(path).max_bytes + 1), b'{"endpoints": [{"name": "a"}]}'):
        tmp = tmp_path / "new"
        tmp.write_bytes(bad)
        tmp.replace(path)
        assert discovery.poll() is False
        assert len(discovery.endpoints) == 2 and discovery.last_error
    path.unlink()
    assert discovery.poll() is False and "no such file" in (discovery.last_error or "")
    one = {"endpoints": ENDPOINTS["endpoints"][:1]}
    path.write_text(json.dumps(one))
    assert discovery.poll() is True and [e.endpoint_id for e in discovery.endpoints] == ["a"]
    assert discovery.failed_reloads == 4 and discovery.reloads == 1 and discovery.last_error is None


def test_file_discovery_says_what_changed_and_warns_of_an_empty_list(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A port change was logged as "8 endpoints (same names)"; `endpoints: []` emptied the fleet at INFO."""
    path = tmp_path / "endpoints.yaml"
    path.write_text(json.dumps(ENDPOINTS))
    discovery = FileDiscovery(path)
    moved = json.loads(json.dumps(ENDPOINTS))
    moved["endpoints"][1]["port"] = 9999
    moved["endpoints"].append({**moved["endpoints"][0], "name": "c"})
    with caplog.at_level(logging.INFO, logger="leadtime.router.discovery"):
        path.write_text(json.dumps({"endpoints": moved["endpoints"][1:]}))
        assert discovery.poll()
        path.write_text("endpoints: []\n")
        assert discovery.poll() and discovery.endpoints == ()
    changed, emptied = [r for r in caplog.records if r.getMessage().startswith("discovery: ")]
    assert changed.getMessage() == "discovery: 2 endpoints (added c; removed a; changed serving/b)"
    assert emptied.levelno == logging.WARNING and "lists no endpoint" in emptied.getMessage()


def test_discovery_warns_of_unified_endpoints_beside_pd_ones(caplog: pytest.LogCaptureFixture) -> None:
    """The policies score P/D pairs when there are any: a unified endpoint beside them was left out, silently."""
    specs = [
        "127.0.0.1:1,name=u",
        "127.0.0.1:2,name=p,llm-d.ai/role=prefill",
        "127.0.0.1:3,name=d,llm-d.ai/role=decode",
    ]
    with caplog.at_level(logging.WARNING, logger="leadtime.router.discovery"):
        parse_static(specs[1:])
        assert not caplog.records
        parse_static(specs)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "mixes unified endpoints (u)" in said


def test_file_discovery_refuses_a_broken_file_at_start(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text("endpoints: 3")
    with pytest.raises(DiscoveryError, match="endpoints"):
        FileDiscovery(path)


# ----- requests ----------------------------------------------------------------------------------------------


def test_requests_give_their_prompt_and_slos() -> None:
    headers = {b"x-llm-d-slo-ttft-ms": b"500", b"x-llm-d-slo-tpot-ms": b"40.5"}
    parsed = parse_request("/v1/completions", b'{"prompt": "hi there", "model": "m", "stream": true}', headers)
    assert (parsed.text, parsed.model, parsed.stream, parsed.ttft_slo_ms, parsed.tpot_slo_ms) == (
        "hi there",
        "m",
        True,
        500.0,
        40.5,
    )
    ids = parse_request("/v1/completions", b'{"prompt": [1, 2, 3]}', {}, 900.0, None)
    assert ids.token_ids == [1, 2, 3] and ids.ttft_slo_ms == 900.0 and ids.tpot_slo_ms is None
    chat = parse_request(
        "/v1/chat/completions",
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hello"}]},
                ]
            }
        ).encode(),
        {},
    )
    assert chat.text == "system: be brief\nuser: hello"


@pytest.mark.parametrize(
    "path,body,headers,status,field",
    [
        ("/v1/completions", b"{", {}, 400, "body"),
        ("/v1/completions", b"[1]", {}, 422, "body"),
        ("/v1/completions", b"{}", {}, 422, "prompt"),
        ("/v1/completions", b'{"prompt": [true]}', {}, 422, "prompt"),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', {}, 422, "stream"),
        ("/v1/chat/completions", b'{"messages": []}', {}, 422, "messages"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', {}, 422, "messages[0].content"),
        ("/v1/completions", b'{"prompt": "x"}', {b"x-llm-d-slo-tpot-ms": b"nan"}, 422, "x-llm-d-slo-tpot-ms"),
    ],
)
def test_bad_requests_name_the_field(
    path: str, body: bytes, headers: dict[bytes, bytes], status: int, field: str
) -> None:
    with pytest.raises(BadRequest) as err:
        parse_request(path, body, headers)
    assert (err.value.status, err.value.field) == (status, field)


# ----- stream timing ------------------------------------------------------------------------------------------


def test_stream_meter_times_tokens_across_chunk_boundaries() -> None:
    meter = StreamMeter()
    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]}] + [
        {"choices": [{"delta": {"content": f"t{i}"}}]} for i in range(5)
    ]
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + b"data: [DONE]\r\n\r\n"
    for k, start in enumerate(range(0, len(data), 7)):  # 7-byte pieces, 1 ms apart
        meter.feed(data[start : start + 7], float(k))
    assert meter.tokens == 5 and meter.first_ms is not None and meter.last_ms is not None
    assert meter.itl_ms() == pytest.approx((meter.last_ms - meter.first_ms) / 4)
    meter.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 9}}\n\n', 99.0)
    assert meter.tokens == 9 and meter.prompt_tokens == 30


def test_stream_meter_takes_the_itl_of_one_choice_when_there_are_several() -> None:
    meter = StreamMeter()
    for step in range(3):  # two choices decoded side by side, a token each every 10 ms
        for index in (0, 1):
            meter.feed(f'data: {{"choices": [{{"index": {index}, "text": "t{step}"}}]}}\n\n'.encode(), 10.0 * step)
    assert meter.tokens == 6 and meter.itl_ms() == pytest.approx(10.0)
    meter.feed(b'data: {"choices": [], "usage": {"completion_tokens": 6}}\n\n', 30.0)
    assert meter.itl_ms() == pytest.approx(10.0)
    meter.feed(b'data: {"choices": [{"index": [1], "text": "odd"}]}\n\n', 30.0)  # a malformed index counts as 0
    assert meter.events == 7


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_stream_meter_counts_a_reasoning_models_thinking_as_tokens(field: str) -> None:
    """Regression: a reasoning model's thinking in `delta.reasoning` (newer vLLM's field, which the assembler
    already joined) was not counted: TTFT was learned at the first content token, a second after the first token
    reached the client, and the ITL as the gap between the two content tokens, 1.7 ms for 170 ms a token."""
    meter = StreamMeter()
    events = [{"role": "assistant", "content": ""}] + [{field: f"think{i} "} for i in range(5)]
    events += [{"content": "Hi"}, {"content": "!"}]
    times = [0.0, 0.0, 200.0, 400.0, 600.0, 800.0, 1000.0, 1010.0]
    for delta, at in zip(events, times, strict=True):
        meter.feed(b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n", at)
    assert (meter.events, meter.first_ms, meter.last_ms) == (7, 0.0, 1010.0)
    assert meter.itl_ms() == pytest.approx(1010.0 / 6)


@pytest.mark.parametrize("field", ["text", "content", "reasoning_content", "reasoning"])
def test_every_text_field_the_assembler_joins_is_one_the_meter_counts(field: str) -> None:
    """What makes a token and what makes an answer's text are one list: `reasoning` was joined into the answer but
    not counted, and a reasoning model's TTFT was learned a second late."""
    assembler = Assembler()
    meter = StreamMeter(assembler.add)
    meter.feed(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {field: "x"}}]}).encode() + b"\n\n", 1.0)
    meter.feed(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {field: "y"}}]}).encode() + b"\n\n", 2.0)
    assert (meter.events, meter.first_ms) == (2, 1.0)
    assert assembler.body()["choices"][0]["message"][field] == "xy"


@pytest.mark.parametrize(
    "delta",
    [
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"function_call": {"arguments": "{}"}},
    ],
    ids=["tool-call-named", "tool-call-arguments", "legacy-function-call"],
)
def test_stream_meter_counts_a_streamed_tool_call_as_tokens(delta: dict[str, Any]) -> None:
    """Regression: an answer streamed as tool calls (`delta.tool_calls`, content empty, as vLLM streams them) had
    no token: no TTFT, no ITL, and its prompt counted as prefill work waiting on its endpoint until it completed."""
    meter = StreamMeter()
    meter.feed(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n', 1.0)
    for at in (5.0, 9.0):
        meter.feed(b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode() + b"\n\n", at)
    meter.feed(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[]},"finish_reason":"tool_calls"}]}\n\n', 12.0)
    assert (meter.events, meter.first_ms, meter.last_ms) == (2, 5.0, 9.0)  # an empty list is no piece of one


def test_stream_meter_reads_usage_of_a_whole_answer() -> None:
    meter = StreamMeter()
    meter.feed_json(b'{"choices": [{"text": "x"}], "usage": {"prompt_tokens": 4, "completion_tokens": 1}}')
    assert (meter.prompt_tokens, meter.tokens, meter.first_ms) == (4, 1, None)


# ----- prefix affinity ----------------------------------------------------------------------------------------


def test_the_work_tracker_keeps_nothing_of_endpoints_whose_requests_all_finished() -> None:
    """In Kubernetes an endpoint's name is its pod's: every rollout brings new names, and a set kept for each name
    once its requests finished grew the tracker for ever. Meanwhile each endpoint's tokens are those of the
    requests still open there."""
    rng = np.random.default_rng(11)
    work = InflightWork()
    open_now: dict[str, Active] = {}
    for i in range(2_000):
        if open_now and rng.random() < 0.45:
            done = list(open_now)[int(rng.integers(len(open_now)))]
            del open_now[done]
            work.finish(done)
        else:
            prefill_on, decode_on = f"p{rng.integers(300)}", f"d{rng.integers(300)}"
            if rng.random() < 0.3:
                decode_on = prefill_on  # unified
            active = Active(float(rng.uniform(0, 1_000)), 100, 150, prefill_on, decode_on)
            work.start(f"r{i}", active)
            open_now[f"r{i}"] = active
            if rng.random() < 0.5:
                work.first_token(f"r{i}", generated=3)
        if i % 100 == 0:
            for endpoint in {e for a in open_now.values() for e in (a.prefill_on, a.decode_on)} | {"p1", "d1"}:
                for at in (0.0, 500.0, 1_000.0):
                    here = [a for a in open_now.values() if a.sent_ms < at]
                    prefill = sum(a.uncached_tokens for a in here if not a.first_token and a.prefill_on == endpoint)
                    decode = sum(
                        a.input_tokens + a.generated for a in here if a.first_token and a.decode_on == endpoint
                    )
                    assert work.tokens(endpoint, at) == (prefill, decode)
    for rid in open_now:
        work.finish(rid)
    assert len(work) == 0 and work._by_endpoint == {}


def test_the_passed_through_load_keeps_nothing_of_endpoints_with_nothing_open() -> None:
    """Regression: every endpoint name a passed-through request ever went to kept an entry (its count at 0), so the
    gateway grew by one per pod for its life, every rollout naming new pods. Meanwhile each endpoint's count is
    its requests still open there."""
    rng = np.random.default_rng(5)
    load = PassedThroughLoad()
    open_now: list[str] = []
    for _ in range(2_000):
        if open_now and rng.random() < 0.45:
            load.closed(open_now.pop(int(rng.integers(len(open_now)))))
        else:
            endpoint = f"pod-{rng.integers(300)}"
            load.opened(endpoint)
            open_now.append(endpoint)
        assert load.open == {e: open_now.count(e) for e in set(open_now)}
    for endpoint in open_now:
        load.closed(endpoint)
    assert load.open == {}


def test_chunk_hashes_identify_prefixes() -> None:
    a = text_chunk_hashes("x" * 640, 64, seed="m")
    b = text_chunk_hashes("x" * 320 + "y" * 320, 64, seed="m")
    assert len(a) == 10 and a[:5] == b[:5] and set(a[5:]).isdisjoint(b[5:])
    assert text_chunk_hashes("x" * 640, 64, seed="other")[0] != a[0]  # another model shares no cache
    assert text_chunk_hashes("x" * 63, 64) == [] and len(text_chunk_hashes("x" * 6400, 64, max_chunks=7)) == 7
    # Bytes, not characters: 64 "é" are 128 bytes, 2 chunks; 32 of them are one full chunk, not none.
    assert len(text_chunk_hashes("é" * 64, 64)) == 2 and len(text_chunk_hashes("é" * 32, 64)) == 1
    with pytest.raises(ValueError):
        text_chunk_hashes("x", 60)


def test_longest_prefix_matches_the_linear_scan() -> None:
    rng = np.random.default_rng(0)
    index = PrefixIndex(block_size=1, capacity_blocks=300)
    prompts = [list(range(p * 1000, p * 1000 + int(rng.integers(1, 60)))) for p in range(40)]
    for p in prompts:  # shared heads: prompt k starts with prompt k-1's first half
        index.record("e", p)
    for p in prompts:
        query = p[: len(p) // 2] + [-1, -2]
        assert index.longest_prefix("e", query) == index.matched_blocks("e", query)
    index.set_capacity("e", 10)
    assert index.size("e") == 10


def test_affinity_estimates_hit_tokens_and_learns_bytes_per_token() -> None:
    affinity = PrefixAffinity(chunk_bytes=64)
    system = "You are a careful assistant. " * 40  # 1,160 bytes
    first = affinity.key(system + "What is 2 + 2?", model="m")
    affinity.record("e1", first)
    second = affinity.key(system + "Name a colour.", model="m")
    assert affinity.hit_tokens("e1", second) == 18 * 64 // 4 and affinity.hit_tokens("e2", second) == 0
    for _ in range(50):
        affinity.learn_length(6000, 1000)  # responses say ~6 bytes a token
    assert affinity.bytes_per_token == pytest.approx(6.0, rel=0.05)
    assert affinity.key(system, "m").input_tokens == pytest.approx(len(system) / 6.0, rel=0.05)
    ids = affinity.key_for_ids(list(range(100)), "m")
    affinity.record("e3", ids)
    assert affinity.hit_tokens("e3", affinity.key_for_ids(list(range(50)) + [7] * 50, "m")) == 48  # 3 chunks of 16
    affinity.set_cache_tokens("e1", 500)
    assert affinity.index.size("e1") <= 500 * 6 // 64 + 1
    affinity.forget("e1")
    assert affinity.hit_tokens("e1", second) == 0


def test_token_ids_of_a_large_vocabulary_are_hashed_16_to_a_chunk() -> None:
    """Regression: ids were packed 4 bytes each, then re-encoded as UTF-8 text, so every byte from 0x80 took two:
    with ids from ~99k (Llama 3, Qwen) a chunk held under 16 ids, hits were over-counted by up to 1.5x, and a
    shared prefix shorter than one block counted as a hit."""
    high = [0x018080 + i % 128 + (i // 128 % 128) * 256 for i in range(800)]  # both low bytes >= 0x80
    affinity = PrefixAffinity(chunk_bytes=64)
    assert len(affinity.key_for_ids(high[:32], "m").hashes) == 2
    affinity.record("e1", affinity.key_for_ids(high[:11] + list(range(1000, 1400)), "m"))
    assert affinity.hit_tokens("e1", affinity.key_for_ids(high[:11] + list(range(5000, 5400)), "m")) == 0
    affinity.record("e2", affinity.key_for_ids(high + list(range(1, 801)), "m"))
    assert affinity.hit_tokens("e2", affinity.key_for_ids(high + list(range(20_000, 20_800)), "m")) == 800


# ----- scraping -----------------------------------------------------------------------------------------------


def test_scrapes_keep_only_what_the_router_reads_old_and_new_names() -> None:
    body = b"\n".join(
        [
            b"# HELP vllm:num_requests_running x",
            b'vllm:num_requests_running{model_name="m"} 3',
            b'vllm:num_requests_waiting{model_name="m"} 1',
            b'vllm:gpu_cache_usage_perc{model_name="m"} 0.25',
            b'vllm:time_to_first_token_seconds_bucket{le="0.1"} 9',
            b'vllm:prefix_cache_queries_total{model_name="m"} 1000',
            b'vllm:prefix_cache_hits_total{model_name="m"} 250',
        ]
    )
    text = wanted_lines(body)
    assert "bucket" not in text and "HELP" not in text
    m = parse_vllm_metrics(text)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (3, 1, 0.25)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.prefix_cache_hit_rate) == (1000.0, 250.0, None)
    old = parse_vllm_metrics(
        wanted_lines(body.replace(b"prefix_cache_hits_total", b"x") + b"\nvllm:gpu_prefix_cache_hit_rate 0.5")
    )
    assert old.prefix_cache_hit_rate == 0.5 and old.prefix_cache_hits is None
    renamed = parse_vllm_metrics(wanted_lines(body.replace(b"vllm:prefix_cache", b"vllm:gpu_prefix_cache")))
    assert (renamed.prefix_cache_queries, renamed.prefix_cache_hits) == (1000.0, 250.0)  # earlier V1 releases' names


# ----- time-slice documents -------------------------------------------------------------------------------------


WALL = 1_796_459_931.0  # a router's wall clock, seconds since the epoch (2026-12)


def _locked_since(since: object, **doc: object) -> dict[str, object]:
    return {"groups": {"g": {"state": "LOCKED", "active_job": "training", "since": since}}, **doc}


@pytest.mark.parametrize("since", [WALL - 3.0, (WALL - 3.0) * 1000.0])
def test_since_is_read_in_seconds_or_milliseconds(since: float) -> None:
    """`since` in milliseconds was taken as seconds far in the future, and clamped to now without a word."""
    status = parse_groups(_locked_since(since), router_now_ms=50_000.0, wall_now_s=WALL)["g"]
    assert status.since_ms == pytest.approx(47_000.0)


@pytest.mark.parametrize("since", [1, -5.0, 946_684_799.0])
def test_a_since_before_2000_is_refused_naming_the_field(since: float) -> None:
    with pytest.raises(TimesliceError, match=r"groups\.g\.since: .*2000-01-01"):
        parse_groups(_locked_since(since), router_now_ms=50_000.0, wall_now_s=WALL)


def test_a_since_of_0_means_not_known_as_it_always_did() -> None:
    """An orchestrator that sends 0 for a time it does not know (a common zero value) keeps being read, as now."""
    status = parse_groups(_locked_since(0), router_now_ms=50_000.0, wall_now_s=WALL)["g"]
    assert status.since_ms == 50_000.0


@pytest.mark.parametrize("orchestrator_ahead_s", [-60.0, -2.0, 0.0, 30.0])
def test_a_documents_now_measures_since_on_the_orchestrators_clock(orchestrator_ahead_s: float) -> None:
    """With `now`, how long a group has been in its state is the orchestrator's own reckoning, whatever the skew
    between its clock and the router's: without it, an orchestrator 2 s behind made a 3 s-old state 5 s old."""
    orchestrator_now = WALL + orchestrator_ahead_s
    for now in (orchestrator_now, orchestrator_now * 1000.0):  # seconds or milliseconds, as `since`
        doc = _locked_since(orchestrator_now - 3.0, now=now)
        assert parse_groups(doc, 50_000.0, WALL)["g"].since_ms == pytest.approx(47_000.0)
    with pytest.raises(TimesliceError, match=r"^now: .*2000-01-01"):
        parse_groups(_locked_since(WALL, now=12.0), 50_000.0, WALL)


def test_group_states_come_on_the_routers_clock(tmp_path: Path) -> None:
    doc = {
        "groups": {
            "rl": {"state": "LOCKED", "active_job": "training", "loaded_job": "training", "waiters": 1, "since": WALL}
        }
    }
    status = parse_groups(doc, router_now_ms=50_000.0, wall_now_s=WALL + 2.5)["rl"]
    assert status.since_ms == pytest.approx(47_500.0) and not status.serves("inference")
    with pytest.raises(TimesliceError, match="groups.rl.state"):
        parse_groups({"groups": {"rl": {"state": "ASLEEP"}}}, 0.0, 0.0)
    path = tmp_path / "groups.json"
    path.write_text(json.dumps(doc))
    source = FileTimesliceSource(path, clock=lambda: 10_000.0)
    source.poll()
    assert source.status("rl") is not None and source.status("other") is None
    path.write_text("groups: {rl: {state: NOPE}}")
    source.poll()
    assert source.errors == 1 and source.status("rl") is not None  # the previous states are kept


@pytest.mark.parametrize(
    "data,expected",
    [
        ({"groups": {"rl": None}}, "groups.rl: expected a mapping {state, active_job, loaded_job, waiters, since}"),
        ({"groups": {"rl": ["LOCKED"]}}, "groups.rl: expected a mapping {state, active_job, loaded_job, waiters, "),
        ({"groups": ["rl"]}, "groups: expected a mapping of group names to their states"),
    ],
)
def test_misshapen_group_states_say_what_they_expect(data: object, expected: str) -> None:
    """ "Input should be a valid dictionary or instance of _GroupSpec" named a class no orchestrator's author sees."""
    with pytest.raises(TimesliceError) as err:
        parse_groups(data, 0.0, WALL)
    assert str(err.value).startswith(expected), err.value


def test_a_misspelled_key_in_the_group_states_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Unknown keys are left for what an orchestrator may add; a misspelled `active_job` went unnoticed, its group
    taken as serving whatever it holds."""
    path = tmp_path / "groups.yaml"
    path.write_text("groups: {rl: {state: LOCKED, activ_job: inference, loaded_job: inference}}\nupdated: 3\n")
    source = FileTimesliceSource(path, clock=lambda: 10_000.0)
    with caplog.at_level(logging.WARNING, logger="leadtime.router.timeslice"):
        source.poll()
        path.write_text("groups: {rl: {state: LOCKED, activ_job: training}}\n")
        source.poll()
    assert source.status("rl") is not None and source.errors == 0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned  # once per unknown key, not at every read
    (group_key,) = [w for w in warned if "groups.rl.activ_job" in w]
    assert "active_job" in group_key and any("updated: unknown key" in w for w in warned)


def watch_timeslice(gateway: Gateway, seconds: float = 0.05) -> None:
    """Run the gateway's time-slice watcher for `seconds` (it polls every `timeslice_poll_s`)."""

    async def watch() -> None:
        task = asyncio.get_running_loop().create_task(gateway._watch_timeslice())
        await asyncio.sleep(seconds)
        task.cancel()

    asyncio.run(watch())


def test_an_endpoint_group_the_states_do_not_name_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "groups.yaml"
    path.write_text("groups: {RL: {state: LOCKED, active_job: training}}\n")
    (endpoint,) = parse_static(["127.0.0.1:9,name=a,leadtime.io/timeslice-group=rl"])
    gateway = Gateway(StaticDiscovery((endpoint,)), RoundRobinPolicy(), GatewaySettings(timeslice_poll_s=0.001))
    gateway.scraper.scrapes["a"] = EndpointScrape(endpoint)
    gateway.timeslice = FileTimesliceSource(path, clock=lambda: 10_000.0)

    with caplog.at_level(logging.WARNING, logger="leadtime.router.gateway"):
        watch_timeslice(gateway)
    warned = [r.getMessage() for r in caplog.records if "'rl'" in r.getMessage()]
    assert len(warned) == 1 and "RL" in warned[0], warned


def test_a_group_whose_states_never_name_the_serving_job_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An orchestrator calling the inference job `vllm-inference` (servingJob is `inference`): the group's endpoints
    were never routed to, without a word."""
    path = tmp_path / "groups.yaml"
    (endpoint,) = parse_static(["127.0.0.1:9,name=a,leadtime.io/timeslice-group=rl"])
    gateway = Gateway(StaticDiscovery((endpoint,)), RoundRobinPolicy(), GatewaySettings(timeslice_poll_s=0.001))
    gateway.timeslice = source = FileTimesliceSource(path, clock=lambda: 10_000.0)

    async def watch(document: str) -> None:
        path.write_text(document)
        task = asyncio.get_running_loop().create_task(gateway._watch_timeslice())
        await asyncio.sleep(0.03)
        task.cancel()

    def ours() -> list[str]:  # not asyncio's word on a task an earlier test left behind, collected meanwhile
        return [r.getMessage() for r in caplog.records if r.name.startswith("leadtime")]

    with caplog.at_level(logging.WARNING, logger="leadtime.router.gateway"):
        asyncio.run(watch("groups: {rl: {state: LOCKED, active_job: training, loaded_job: training}}\n"))
        assert source.status("rl") is not None and not ours()  # training alone: its turn, no mistake
        asyncio.run(watch("groups: {rl: {state: LOCKED, active_job: vllm-inference, loaded_job: vllm-inference}}\n"))
        asyncio.run(watch("groups: {rl: {state: IDLE, active_job: '', loaded_job: vllm-inference}}\n"))
    warned = ours()
    assert len(warned) == 1, warned
    assert "training, vllm-inference" in warned[0] and "'inference'" in warned[0]


def test_the_profiles_serving_job_is_the_job_the_gateway_takes_its_groups_by(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`servingJob: vllm` reached the policy alone: the gateway took a group LOCKED by vllm as parked (a heuristic
    profile never routed to it, and its serving metric read 0) and warned to set the servingJob that was set."""
    from leadtime.router_plugin.gateway.serve import RouteOptions, build_gateway

    config = tmp_path / "plugins.yaml"
    config.write_text(
        "plugins: [{type: timeslice-filter, parameters: {servingJob: vllm}}, {type: queue-scorer}]\n"
        "schedulingProfiles: [{name: q, plugins: [{pluginRef: timeslice-filter}, {pluginRef: queue-scorer}]}]\n"
    )
    states = tmp_path / "groups.yaml"
    states.write_text("groups: {rl: {state: IDLE, active_job: '', loaded_job: training}}\n")
    options = RouteOptions(
        endpoints=("127.0.0.1:9,name=a,leadtime.io/timeslice-group=rl",),
        config=config,
        profile="q",
        timeslice_file=states,
        settings=GatewaySettings(timeslice_poll_s=0.001),
    )
    gateway = build_gateway(options)
    gateway.scraper.scrapes["a"] = EndpointScrape(gateway.discovery.endpoints[0])

    with caplog.at_level(logging.WARNING, logger="leadtime.router.gateway"):
        watch_timeslice(gateway)
        states.write_text("groups: {rl: {state: LOCKED, active_job: vllm, loaded_job: vllm}}\n")
        watch_timeslice(gateway)
    assert gateway.settings.serving_job == "vllm"
    assert gateway._group_state("rl") == "resident"
    assert 'leadtime_router_timeslice_group_serving{group="rl"} 1.0' in gateway.metrics.render().decode()
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("leadtime")]


def test_a_group_locked_by_the_serving_job_with_no_loaded_job_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """States that leave `loaded_job` out kept a group's endpoints out of routing while the inference job held it
    (its weights are not said to be resident), without a word."""
    path = tmp_path / "groups.yaml"
    (endpoint,) = parse_static(["127.0.0.1:9,name=a,leadtime.io/timeslice-group=rl"])
    gateway = Gateway(StaticDiscovery((endpoint,)), RoundRobinPolicy(), GatewaySettings(timeslice_poll_s=0.001))
    gateway.scraper.scrapes["a"] = EndpointScrape(endpoint)
    gateway.timeslice = FileTimesliceSource(path, clock=lambda: 10_000.0)

    with caplog.at_level(logging.WARNING, logger="leadtime.router.gateway"):
        path.write_text("groups: {rl: {state: LOCKED, active_job: inference, loaded_job: inference}}\n")
        watch_timeslice(gateway)
        assert not caplog.records and gateway._group_state("rl") == "resident"
        path.write_text("groups: {rl: {state: LOCKED, active_job: inference}}\n")
        watch_timeslice(gateway)
        watch_timeslice(gateway)
    warned = [r.getMessage() for r in caplog.records]
    assert gateway._group_state("rl") == "parked"
    assert len(warned) == 1 and "'rl'" in warned[0] and "loaded_job" in warned[0], warned


def test_what_the_router_believes_of_each_group_is_in_its_metrics_and_a_group_no_endpoint_names_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """/metrics said nothing of the groups (only a filtered count), so an SRE could not see which groups the router
    took as away, nor how old the states it routes on are; a group the states name and no endpoint does (a
    misspelled label, say) was ignored in silence."""
    path = tmp_path / "groups.yaml"
    path.write_text("groups: {rl: {state: LOCKED, active_job: training}, ghost: {state: IDLE}}\n")
    endpoints = parse_static(
        ["127.0.0.1:9,name=a,leadtime.io/timeslice-group=rl", "127.0.0.1:10,name=b,leadtime.io/timeslice-group=spare"]
    )
    gateway = Gateway(StaticDiscovery(endpoints), RoundRobinPolicy(), GatewaySettings(timeslice_poll_s=0.001))
    for endpoint in endpoints:
        gateway.scraper.scrapes[endpoint.endpoint_id] = EndpointScrape(endpoint)
    now = [10_000.0]
    gateway.timeslice = FileTimesliceSource(path, clock=lambda: now[0])
    gateway.clock = lambda: now[0]

    with caplog.at_level(logging.WARNING, logger="leadtime.router.gateway"):
        watch_timeslice(gateway)
        watch_timeslice(gateway)  # read again, unchanged: the states are current
        assert "leadtime_router_timeslice_states_age_seconds 0.0" in gateway.metrics.render().decode()
        path.unlink()  # the states cannot be read for 7 s: the router routes on states 7 s old
        now[0] += 7_000.0
        watch_timeslice(gateway)
    text = gateway.metrics.render().decode()
    assert 'leadtime_router_timeslice_group_serving{group="rl"} 0.0' in text  # training's turn
    assert 'leadtime_router_timeslice_group_serving{group="spare"} 1.0' in text  # not in the states: serving
    assert 'group="ghost"' not in text  # no endpoint of it: no series
    assert "leadtime_router_timeslice_states_age_seconds 7.0" in text
    ghost = [r.getMessage() for r in caplog.records if "'ghost'" in r.getMessage()]
    assert len(ghost) == 1 and "no endpoint" in ghost[0], ghost


def test_endpoints_naming_groups_with_no_source_of_their_states_are_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Time-slice labels and no --timeslice-url/--timeslice-file: the endpoints were routed as always resident (into
    a training job's turn) without a word."""
    endpoints = parse_static(
        [f"127.0.0.1:{9 + i},name=s{i},leadtime.io/timeslice-group=rl" for i in range(3)] + ["127.0.0.1:20,name=d"]
    )
    gateway = Gateway(StaticDiscovery(endpoints), RoundRobinPolicy(), GatewaySettings())

    async def start_and_stop() -> None:
        await gateway.start()
        gateway._warn_unread_groups()  # as after every change of the discovered set: said once
        await gateway.stop()

    with caplog.at_level(logging.WARNING, logger="leadtime.router.gateway"):
        asyncio.run(start_and_stop())
    warned = [r.getMessage() for r in caplog.records if "time-slice group" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "rl" in warned[0] and "--timeslice-url" in warned[0]


# ----- the predictor wrapper --------------------------------------------------------------------------------


class _Client:
    """A predictor client that fails while `down` is set, and records what it was sent."""

    def __init__(self) -> None:
        self.down = False
        self.predictions = 0
        self.batches: list[int] = []

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        self.predictions += 1
        if self.down:
            raise PredictorUnavailable("transport", "connection refused")
        n = len(rows)
        return BulkPredictions(np.ones(n), np.ones(n), np.ones(n), np.ones(n), 1, 0.9)

    def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
        if self.down:
            raise PredictorUnavailable("transport", "connection refused")
        self.batches.append(len(observations))
        return len(observations)


ROW = FeatureRow(RequestFeatures(input_tokens=10), EndpointState(endpoint_id="e"))


def test_a_predictor_outage_is_one_warning_and_its_end_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """The breaker's warning came again at every re-opening, every 1.2 s for a whole outage, and its end was silent."""
    client = _Client()
    wrapper = GatewayPredictor(client, client, GatewayMetrics(), open_after=2, open_for_s=0.02)
    client.down = True
    with caplog.at_level(logging.INFO, logger="leadtime.router.predictor"):
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            with contextlib.suppress(PredictorUnavailable):
                wrapper.predict([ROW])
            time.sleep(0.005)
        assert wrapper.health()["predictor"].startswith("failing (")  # /readyz names it while it lasts
        client.down = False
        time.sleep(0.03)
        wrapper.predict([ROW])
        wrapper.predict([ROW])
        assert wrapper.health() == {}
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, m in said if "predictor failing" in m] == [logging.WARNING], said
    assert [m for _, m in said if "predictor answers again" in m], said


def test_a_failed_warm_up_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """An untrusted predictor certificate at start was said at INFO only; every decision then falls back."""
    client = _Client()
    client.down = True
    wrapper = GatewayPredictor(client, client, GatewayMetrics())
    with caplog.at_level(logging.INFO, logger="leadtime.router.predictor"):
        assert not wrapper.warm_up(ROW)
    (record,) = [r for r in caplog.records if "warm-up failed" in r.getMessage()]
    assert record.levelno == logging.WARNING


def test_a_failed_warm_up_is_named_in_readyz_until_the_predictor_answers() -> None:
    """/readyz said nothing degraded after a warm-up against a predictor that was down, and kept saying so until
    three requests in a row had fallen back and opened the breaker: a probe right after start saw a healthy
    gateway."""
    client = _Client()
    client.down = True
    wrapper = GatewayPredictor(client, client, GatewayMetrics(), open_after=3)
    wrapper.warm_up(ROW)
    assert wrapper.health()["predictor"].startswith("failing (unavailable: transport: connection refused)"), (
        wrapper.health()
    )
    with pytest.raises(PredictorUnavailable):
        wrapper.predict([ROW])  # one failure does not open the breaker: the warm-up did not count towards it
    assert client.predictions == 2 and wrapper.health()["predictor"].startswith("failing (")
    client.down = False
    wrapper.predict([ROW])
    assert wrapper.health() == {}


def test_the_breaker_rests_after_failures_in_a_row() -> None:
    client = _Client()
    wrapper = GatewayPredictor(client, client, GatewayMetrics(), open_after=3, open_for_s=0.2)
    client.down = True
    for _ in range(6):
        with pytest.raises(PredictorUnavailable):
            wrapper.predict([ROW], 0.02)
    assert client.predictions == 3 and wrapper.last_failure == "circuit_open"
    client.down = False
    time.sleep(0.25)
    assert len(wrapper.predict([ROW], 0.02).ttft_mean_ms) == 1 and client.predictions == 4


def test_a_predict_client_raising_what_is_not_a_predictor_error_is_a_failure_like_any_other() -> None:
    """Regression: a predict client raising anything but a PredictorError (a client bug, an answer it choked on)
    was only counted towards the breaker: the breaker never opened on it, /readyz stayed {} through the whole
    outage, no latency was recorded, and each fallback was labelled "refused", as if the rows were at fault."""

    class Choking(_Client):
        def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
            self.predictions += 1
            raise TypeError("'NoneType' object is not subscriptable")

    client = Choking()
    metrics = GatewayMetrics()
    wrapper = GatewayPredictor(client, client, metrics, open_after=2, open_for_s=5.0)
    for _ in range(2):
        with pytest.raises(PredictorError) as failed:
            wrapper.predict([ROW])
        assert failed.value.status == "invalid_answer" and "TypeError" in failed.value.message, failed.value
        assert isinstance(failed.value.__cause__, TypeError)
        assert wrapper.last_failure == "invalid_answer" and wrapper.last_failure in FALLBACK_REASONS
    with pytest.raises(PredictorUnavailable):  # the breaker opened: the client is left alone
        wrapper.predict([ROW])
    assert client.predictions == 2 and wrapper.last_failure == "circuit_open"
    said = wrapper.health()["predictor"]
    assert said.startswith("failing (circuit_open: invalid_answer: ") and "TypeError" in said, said
    calls = metrics.registry.get_sample_value(
        "leadtime_router_predictor_call_seconds_count", {"call": "predict", "result": "invalid_answer"}
    )
    assert calls == 2


class _Slow(_Client):
    """A predictor answering in `seconds`, within its deadline but slower than the requests come; it keeps to the
    deadline it is given, as the real clients do."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        self.predictions += 1
        if deadline_s is not None and deadline_s < self.seconds:
            time.sleep(deadline_s)
            raise PredictorUnavailable("deadline", f"no answer within {deadline_s} s")
        time.sleep(self.seconds)
        n = len(rows)
        return BulkPredictions(np.ones(n), np.ones(n), np.ones(n), np.ones(n), 1, 0.9)


def test_a_decision_that_waited_its_deadline_out_does_not_ask_the_predictor() -> None:
    """The deadline covers the decision's wait for the decision thread (`queued_s`, set by the gateway): the
    predictor is given what is left of it, and not asked at all once that is shorter than its answers take; that is
    no failure of the predictor's (the breaker is not moved)."""
    given: list[float | None] = []

    class Keeps(_Slow):
        def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
            given.append(deadline_s)
            return super().predict(rows, deadline_s)

    client = Keeps(0.01)  # answers in 10 ms
    wrapper = GatewayPredictor(client, client, GatewayMetrics(), open_after=1)
    wrapper.queued_s = 0.015
    wrapper.predict([ROW], 0.2)
    assert given == [pytest.approx(0.185)]  # the deadline less the wait
    for waited_s in (0.195, 0.2, 0.3):  # 5 ms left, less than an answer takes; none; less than none
        wrapper.queued_s = waited_s
        with pytest.raises(PredictorUnavailable) as failed:
            wrapper.predict([ROW], 0.2)
        assert failure_reason(failed.value) == "queued" == wrapper.last_failure
        assert f"waited {waited_s * 1e3:.0f} ms for its turn" in failed.value.message, failed.value.message
    assert client.predictions == 1
    wrapper.queued_s = 0.0
    wrapper.predict([ROW], 0.2)  # asked: the breaker, open after one failure, did not open
    assert given[-1] == 0.2 and client.predictions == 2 and wrapper.health() == {}


def test_a_predictor_that_answered_near_its_deadline_once_is_asked_again() -> None:
    """Regression: the answer time a decision is measured against moved only with answers. Slow answers (a
    predictor restarted, busy learning the backlog the gateway sent it) lifted it to within 2 ms of the deadline;
    from then on every decision that waited 2 ms for its turn was `queued`, none asked the predictor, the mean never
    came down: live, every decision for minutes went to the heuristics, /readyz saying nothing. Not asked for the
    breaker's rest, the predictor is asked again with what is left, and its answer time is learned anew."""
    client = _Slow(0.019)  # busy: 19 ms of the 20 ms deadline
    wrapper = GatewayPredictor(client, client, GatewayMetrics(), open_for_s=0.05)
    for _ in range(3):
        wrapper.predict([ROW], 0.02)
    client.seconds = 0.001  # fast again
    stop = time.monotonic() + 5  # bounds a failure only: it is asked again after 0.05 s
    while client.predictions == 3 and time.monotonic() < stop:
        wrapper.queued_s = 0.002
        with contextlib.suppress(PredictorUnavailable):
            wrapper.predict([ROW], 0.02)
            continue
        assert wrapper.last_failure == "queued"  # skipped while it had just answered slowly
        time.sleep(0.005)
    assert client.predictions == 4  # then asked
    for _ in range(5):  # its answers take 1 ms again: every decision asks it
        wrapper.queued_s = 0.002
        wrapper.predict([ROW], 0.02)
    assert client.predictions == 9 and wrapper.health() == {}


async def answers_one_token(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    event = b'data: {"choices":[{"index":0,"text":" a","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    with contextlib.suppress(ConnectionError, asyncio.CancelledError):
        while await next_request(reader, writer) is not None:
            writer.write(STREAM_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
            await writer.drain()


def test_decisions_queued_behind_a_slow_predictor_wait_about_its_deadline_at_most() -> None:
    """Regression: a predictor answering within its deadline but slower than the requests came (15 ms, 100 requests
    a second) queued the decisions on their one thread without bound: the gateway's added time grew by 0.7 s every
    second, and nothing fell back (each call met its deadline). The deadline now counts from when a decision was
    queued: one left less of it than the predictor's answers take is made by the heuristics at once (`queued`)."""
    deadline_s, requests = 0.2, 50
    slow = _Slow(0.06)  # all at once: 3 s for the last one to be decided, one call after the other
    metrics = GatewayMetrics()
    wrapper = GatewayPredictor(slow, _Client(), metrics)
    policy = LeadtimePolicy(wrapper, deadline_s=deadline_s)

    async def go() -> tuple[list[Any], dict[str, Any]]:
        server = await asyncio.start_server(answers_one_token, "127.0.0.1", 0)
        spec = f"127.0.0.1:{server.sockets[0].getsockname()[1]},name=e-0,leadtime.io/accelerator=h100-sxm"
        settings = GatewaySettings(scrape_interval_s=0.05)
        gateway = Gateway(StaticDiscovery(parse_static([spec])), policy, settings, predictor=wrapper)
        await gateway.start()
        try:
            for _ in range(200):
                if gateway.routable() and gateway._warm_up is not None and gateway._warm_up.done():
                    break
                await asyncio.sleep(0.02)
            transport = httpx.ASGITransport(app=gateway)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client:
                body = {"prompt": "hi", "max_tokens": 1, "stream": True}
                responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(requests)))
                return list(responses), parse_samples((await client.get("/metrics")).text)
        finally:
            await gateway.stop()
            server.close()

    responses, samples = asyncio.run(go())
    assert [r.status_code for r in responses] == [200] * requests
    route_ms = [float(r.headers["x-leadtime-route-ms"]) for r in responses]
    assert max(route_ms) < deadline_s * 1e3 + 600, sorted(route_ms)  # 0.6 s for a loaded machine; was 3 s
    # Every decision the predictor did not answer was made by the heuristics and counted: not asked (queued), cut to
    # what was left of its deadline, or spared by a breaker such cuts opened. Which of them, timing decides.
    answered = slow.predictions - 1 - counted(samples, "leadtime_router_fallbacks_total", reason="deadline")  # warm-up
    assert slow.predictions <= requests // 4, slow.predictions
    assert counted(samples, "leadtime_router_fallbacks_total") == requests - answered


def test_zero_valued_counters_are_exported_from_the_start() -> None:
    text = GatewayMetrics().render().decode()
    for reason in ("deadline", "unavailable", "circuit_open", "refused", "policy_error", "queued"):
        assert f'leadtime_router_fallbacks_total{{reason="{reason}"}} 0.0' in text
    assert 'leadtime_router_slo_total{result="missed",target="both"} 0.0' in text
    assert 'leadtime_router_observations_total{result="dropped"} 0.0' in text
    # every label failure_reason gives is one of them
    reasons = {
        failure_reason(PredictorError("deadline", "slow")),
        failure_reason(PredictorError("circuit", "resting")),
        failure_reason(PredictorUnavailable("transport", "refused")),
        failure_reason(PredictorError(422, "bad row")),
    }
    assert reasons == {"deadline", "circuit_open", "unavailable", "refused"} <= set(FALLBACK_REASONS)


def test_requests_by_path_are_exported_at_0_before_the_first_on_each_of_the_gateways_paths() -> None:
    """A path's first burst of completions (or of embeddings passed through) was never seen by rate() or increase():
    its series appeared with it. Exported under the status a path answers when it serves (the others' statuses are
    not known in advance: they appear with the first); not for the probes and /metrics, which it does not count."""
    import httpx

    from leadtime.router_plugin.gateway.passthrough import PASSED_THROUGH

    async def scrape() -> str:
        gateway = Gateway(StaticDiscovery(()), RoundRobinPolicy(), GatewaySettings())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://gateway") as client:
            return (await client.get("/metrics")).text

    text = asyncio.run(scrape())
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", *PASSED_THROUGH):
        assert f'leadtime_router_requests_total{{code="200",path="{path}"}} 0.0' in text, path
    assert 'path="/healthz"' not in text and 'path="/metrics"' not in text


def test_a_decision_fallen_back_on_an_unusable_answer_is_counted_as_invalid_answer() -> None:
    """Regression: a predictor answering NaN sent the decision to the heuristics (or raised), and the fallback was
    counted under whatever the predictor had last failed with, or not at all."""

    class NaNs(_Client):
        def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
            nan = np.full(len(rows), np.nan)
            return BulkPredictions(nan, nan, nan, nan, 1, 0.9)

    predictor = GatewayPredictor(NaNs(), _Client(), GatewayMetrics())
    gateway = Gateway(StaticDiscovery(()), LeadtimePolicy(predictor), GatewaySettings(), predictor=predictor)
    candidates = [Candidate(EndpointState("a")), Candidate(EndpointState("b"))]
    decision = gateway._pick(RouteRequest("r", 100, ttft_slo_ms=1000.0, tpot_slo_ms=50.0), candidates)
    assert decision.fell_back == "invalid_answer" and decision.pick.endpoint_id in ("a", "b")
    assert failure_reason(PredictorError("invalid_answer", "ttft_mean_ms: not finite")) in FALLBACK_REASONS


def test_observations_go_in_batches_and_survive_an_outage() -> None:
    client = _Client()
    metrics = GatewayMetrics()
    wrapper = GatewayPredictor(client, client, metrics, batch_size=10, flush_interval_s=0.05, capacity=25)

    def waiting() -> float:  # what an alert reads: failed attempts count each retry, this says how many wait
        value = metrics.registry.get_sample_value("leadtime_router_observations_waiting")
        return -1.0 if value is None else value

    wrapper.start()
    try:
        obs = Observation(ROW, 100.0, 10.0)
        client.down = True
        for _ in range(30):
            wrapper.observe([obs])
        time.sleep(0.2)
        assert wrapper.dropped == 5 and not client.batches  # the queue holds 25; the 5 oldest went
        assert waiting() == 25
        client.down = False
        deadline = time.monotonic() + 5
        while sum(client.batches) < 25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(client.batches) == 25 and max(client.batches) <= 10 and wrapper.pending() == 0
        assert waiting() == 0
    finally:
        wrapper.stop()


def test_observations_the_predictor_refuses_are_warned_about_and_those_left_at_stop_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A predictor restarted with a token the gateway lacked answered 401 to every batch: learning stopped with a
    DEBUG line; at the gateway's stop the 45 queued were thrown away without a word or a count."""
    client = _Client()
    wrapper = GatewayPredictor(client, client, GatewayMetrics(), batch_size=10, flush_interval_s=0.02)
    client.down = True
    with caplog.at_level(logging.INFO, logger="leadtime.router.predictor"):
        wrapper.start()
        for _ in range(12):
            wrapper.observe([Observation(ROW, 100.0, 10.0)])
        time.sleep(0.3)  # several failed tries
        client.down = False
        deadline = time.monotonic() + 5
        while wrapper.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        client.down = True
        for _ in range(3):
            wrapper.observe([Observation(ROW, 100.0, 10.0)])
        wrapper.stop(timeout_s=0.5)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    failing = [m for level, m in said if level == logging.WARNING and "kept and retried" in m]
    assert len(failing) == 2, said  # once per outage, not per try
    assert any("observations reach the predictor again" in m for _, m in said), said
    assert any("3 observations not sent to the predictor are dropped" in m for _, m in said), said
    assert wrapper.dropped == 3


@pytest.mark.parametrize(
    ("refusal", "hint"),
    [
        (PredictorError(401, "Unauthorized"), "route --api-token"),
        (PredictorError("UNAUTHENTICATED", "missing or wrong token"), "route --api-token"),
        (PredictorError(404, "Not Found"), "--role prediction"),
    ],
)
def test_observations_the_predictor_refuses_say_why_and_what_to_change(
    refusal: PredictorError, hint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong token (401) or a `--role prediction` service (404) refuses every batch for ever: /readyz said "not
    reaching the predictor" (it answers) and the log gave the status alone."""

    class Refusing(_Client):
        def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
            raise refusal

    client = Refusing()
    wrapper = GatewayPredictor(client, client, GatewayMetrics(), batch_size=1, flush_interval_s=0.02)
    with caplog.at_level(logging.INFO, logger="leadtime.router.predictor"):
        wrapper.start()
        wrapper.observe([Observation(ROW, 100.0, 10.0)])
        deadline = time.monotonic() + 5
        while "observations" not in wrapper.health() and time.monotonic() < deadline:
            time.sleep(0.02)
        health = wrapper.health()
        wrapper.stop(timeout_s=0.5)
    assert "refused by the predictor" in health["observations"] and hint in health["observations"], health
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(hint in m and str(refusal.status) in m for m in warned), warned


# ----- the lean HTTP client -----------------------------------------------------------------------------------


class _Service(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    delay_s = 0.0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        time.sleep(type(self).delay_s)
        if self.path == "/v1/predict":
            n = len(body["rows"])
            payload = {k: [5.0] * n for k in ("ttft_mean_ms", "ttft_quantile_ms", "tpot_mean_ms", "tpot_quantile_ms")}
            answer, status = {**payload, "model_version": 3, "quantile": 0.9}, 200
        else:
            answer, status = {"error": "observations[0].actual_ttft_ms: must be ≥ 0"}, 422
        data = json.dumps(answer).encode()
        try:
            self.send_response(status)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


def test_lean_client_predicts_keeps_its_deadline_and_reports_refusals() -> None:
    from leadtime.router_plugin.client import PredictorError

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = LeanHttpPredictorClient(f"http://127.0.0.1:{server.server_address[1]}", deadline_s=0.5)
    try:
        for _ in range(3):  # one connection, kept alive
            answer = client.predict([ROW, ROW])
            assert answer.model_version == 3 and list(answer.ttft_quantile_ms) == [5.0, 5.0]
        with pytest.raises(PredictorError) as refused:
            client.observe([Observation(ROW, 1.0, 1.0)])
        assert refused.value.status == 422 and "actual_ttft_ms" in refused.value.message
        _Service.delay_s = 5.0
        started = time.monotonic()
        with pytest.raises(PredictorUnavailable) as late:
            client.predict([ROW], deadline_s=0.05)
        # Cut at its deadline, not at the answer 5 s later (a generous bound: the host may be loaded).
        assert late.value.status == "deadline" and time.monotonic() - started < 2.0
        _Service.delay_s = 0.0
        assert client.predict([ROW]).model_version == 3  # a new connection: the late answer is never read
    finally:
        _Service.delay_s = 0.0
        client.close()
        server.shutdown()
        server.server_close()
    with pytest.raises(PredictorUnavailable, match="transport"):
        LeanHttpPredictorClient(f"http://127.0.0.1:{server.server_address[1]}").predict([ROW], 0.2)


# ----- the command line ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        ([], "give either --discovery FILE or one or more --endpoint"),
        (["--endpoint", "127.0.0.1:1", "--embedded", "--predictor-url", "http://x:1"], "alternatives"),
        (["--endpoint", "127.0.0.1:1"], "needs a predictor"),
        (["--endpoint", "127.0.0.1:1", "--policy", "fastest"], "--policy must be one of"),
        (["--endpoint", "nowhere", "--policy", "random"], "ADDRESS:PORT"),
        (["--endpoint", "127.0.0.1:1", "--embedded", "--accelerator", "abacus"], "unknown accelerator class"),
        (["--endpoint", "127.0.0.1:1", "--embedded", "--profile", "fast"], "no profile named 'fast'"),
        (["--endpoint", "127.0.0.1:1", "--predictor-url", "grpc://x:1"], "--predictor-url"),
        (["--endpoint", "127.0.0.1:1", "--policy", "random", "--ttft-slo-ms", "0"], "--ttft-slo-ms must be > 0"),
        (["--endpoint", "127.0.0.1:1", "--policy", "random", "--api-key", "two words"], "--api-key must be"),
        (["--endpoint", "127.0.0.1:1", "--policy", "random", "--api-key", ""], "--api-key must be"),
        (["--endpoint", "127.0.0.1:1", "--embedded", "--shadow"], "routes on predictions and learns"),
        (["--endpoint", "127.0.0.1:1", "--profile", "heuristic", "--shadow"], "--shadow needs a predictor"),
        (["--endpoint", "127.0.0.1:1", "--policy", "random", "--shadow"], "--shadow needs a predictor"),
        (["--endpoint", "127.0.0.1:1", "--policy", "random", "--embedded"], "--embedded: --policy random does not"),
        (["--endpoint", "127.0.0.1:1", "--profile", "heuristic", "--predictor-url", "http://x:1"], "would go unused"),
        (["--endpoint", "127.0.0.1:1", "--predictor-grpc", "nohostport"], "--predictor-grpc: expected HOST:PORT"),
        (["--endpoint", "127.0.0.1:1", "--predictor-grpc", "h:99999"], "--predictor-grpc: expected HOST:PORT"),
        (
            ["--endpoint", "127.0.0.1:1", "--policy", "random", "--timeslice-url", "http://x:1/g"],
            "--timeslice-url: --policy random does not read time-slice states",
        ),
        (  # a profile that does not exist was not even looked up: the plain policy routed
            ["--endpoint", "127.0.0.1:1", "--policy", "round-robin", "--profile", "nope"],
            "--profile: --policy round-robin does not read the plugin configuration, so it would go unused",
        ),
        (  # nor was the file read: a missing one is not what is named
            ["--endpoint", "127.0.0.1:1", "--policy", "random", "--config", "nowhere.yaml", "--profile", "q"],
            "--config and --profile: --policy random does not read the plugin configuration, so they would go unused",
        ),
    ],
)
def test_route_refuses_bad_options_with_one_line(args: list[str], message: str) -> None:
    from typer.testing import CliRunner

    from leadtime.cli import app

    result = CliRunner().invoke(app, ["route", "--port", "42451", *args])  # a refusal missed serves there, not on 8080
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_overflow_endpoints_discovery_does_not_know_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """`overflowEndpoints: [nosuch-0]` did nothing, silently: the names are checked against discovery's."""
    from leadtime.predictor.learner import OnlinePredictor
    from leadtime.router_plugin.client import InProcessPredictor
    from leadtime.router_plugin.config import build_policy

    config = {
        "plugins": [{"type": "predicted-latency-scorer", "parameters": {"overflowEndpoints": ["a", "nosuch-0"]}}],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
    }
    policy = build_policy(config, InProcessPredictor(OnlinePredictor()))
    endpoints = parse_static(["127.0.0.1:9,name=a", "127.0.0.1:10,name=b"])
    gateway = Gateway(StaticDiscovery(endpoints), policy, GatewaySettings())
    with caplog.at_level(logging.WARNING, logger="leadtime.router.gateway"):
        gateway._warn_unknown_overflow()
        gateway._warn_unknown_overflow()  # once
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "'nosuch-0'" in warned[0] and "'a'" not in warned[0], warned


def test_route_refuses_time_slice_states_its_profile_would_not_read(tmp_path: Path) -> None:
    """Training held the endpoints, and 9 of 12 requests went to them: the profile had no timeslice-filter."""
    from typer.testing import CliRunner

    from leadtime.cli import app

    config = tmp_path / "plugins.yaml"
    config.write_text(
        "plugins: [{type: queue-scorer}, {type: max-score-picker}]\n"
        "schedulingProfiles: [{name: q, plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]}]\n"
    )
    states = tmp_path / "groups.yaml"
    states.write_text("groups: {}\n")
    args = ["route", "--endpoint", "127.0.0.1:1", "--config", str(config), "--profile", "q"]
    result = CliRunner().invoke(app, [*args, "--timeslice-file", str(states)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--timeslice-file: profile 'q' has no timeslice-filter, so the group states would go unused" in result.output


def test_route_hands_its_options_to_the_gateway_api_keys_from_the_environment_apart_by_spaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from typer.testing import CliRunner

    from leadtime.cli import app
    from leadtime.router_plugin.gateway import serve

    built: list[Any] = []

    def build(options: Any, *args: Any, **kwargs: Any) -> None:  # the gateway as configured, not started
        built.append(options.settings)
        raise SystemExit(0)

    monkeypatch.setattr(serve, "build_gateway", build)
    args = ["route", "--endpoint", "127.0.0.1:1", "--policy", "random"]
    env = {"LEADTIME_ROUTE_API_KEY": "k-old k-new"}
    assert CliRunner().invoke(app, args, env=env).exit_code == 0
    assert CliRunner().invoke(app, [*args, "--no-ask-usage", "--no-measure-non-streaming"]).exit_code == 0
    (keyed, plain) = built
    assert keyed.api_keys == ("k-old", "k-new") and keyed.ask_usage and keyed.measure_non_streaming
    assert plain.api_keys == () and not plain.ask_usage and not plain.measure_non_streaming


@pytest.mark.parametrize("value", ["k-old,k-new", "k-old, k-new", " k-old ,k-new ", "k-old\tk-new\n"])
def test_route_takes_api_keys_from_the_environment_apart_by_commas_as_well(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`LEADTIME_ROUTE_API_KEY="key1,key2"` (comma-separated, as LEADTIME_ROUTE_ALLOWED_HOSTS is) was one key
    "key1,key2": clients showing key1 or key2 got 401, and nothing said so at start."""
    from typer.testing import CliRunner

    from leadtime.cli import app
    from leadtime.router_plugin.gateway import serve

    built: list[Any] = []

    def build(options: Any, *args: Any, **kwargs: Any) -> None:
        built.append(options.settings)
        raise SystemExit(0)

    monkeypatch.setattr(serve, "build_gateway", build)
    result = CliRunner().invoke(
        app, ["route", "--endpoint", "127.0.0.1:1", "--policy", "random"], env={"LEADTIME_ROUTE_API_KEY": value}
    )
    assert result.exit_code == 0, result.output
    assert built[0].api_keys == ("k-old", "k-new")


def test_route_reads_its_allowed_hosts_from_the_option_else_the_environment_apart_by_commas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from typer.testing import CliRunner

    from leadtime.cli import app
    from leadtime.router_plugin.gateway import serve

    built: list[Any] = []

    def build(options: Any, *args: Any, **kwargs: Any) -> None:
        built.append(options.settings)
        raise SystemExit(0)

    monkeypatch.setattr(serve, "build_gateway", build)
    monkeypatch.delenv("LEADTIME_ROUTE_ALLOWED_HOSTS", raising=False)
    args = ["route", "--endpoint", "127.0.0.1:1", "--policy", "random"]
    env = {"LEADTIME_ROUTE_ALLOWED_HOSTS": "Gateway.svc, 10.0.0.7,[::1] ,*.example.com"}
    for extra, environment in (([], env), (["--allowed-host", "a.svc"], env), ([], {})):
        result = CliRunner().invoke(app, [*args, *extra], env=environment)
        assert result.exit_code == 0, result.output
    (from_env, from_option, unset) = built
    assert from_env.allowed_hosts == ("gateway.svc", "10.0.0.7", "::1", "*.example.com")
    assert from_option.allowed_hosts == ("a.svc",) and unset.allowed_hosts == ()


@pytest.mark.parametrize(
    ("env", "extra", "named"),
    [
        ({"LEADTIME_ROUTE_ALLOWED_HOSTS": ""}, [], "LEADTIME_ROUTE_ALLOWED_HOSTS is set but empty"),
        ({"LEADTIME_ROUTE_ALLOWED_HOSTS": "a.svc,,b.svc"}, [], "LEADTIME_ROUTE_ALLOWED_HOSTS: an entry is empty"),
        ({"LEADTIME_ROUTE_ALLOWED_HOSTS": "a.svc:8080"}, [], "LEADTIME_ROUTE_ALLOWED_HOSTS: 'a.svc:8080' has a port"),
        ({"LEADTIME_ROUTE_API_KEY": ""}, [], "LEADTIME_ROUTE_API_KEY"),
        ({"LEADTIME_ROUTE_API_KEY": "   "}, [], "LEADTIME_ROUTE_API_KEY"),
        ({"LEADTIME_API_TOKEN": ""}, [], "LEADTIME_API_TOKEN"),
        ({}, ["--api-token", "has space"], "--api-token"),
        ({}, ["--api-token", ""], "--api-token"),
        ({"LEADTIME_ROUTE_API_KEY": "k1,,k2"}, [], "LEADTIME_ROUTE_API_KEY must be printable ASCII"),
        ({"LEADTIME_ROUTE_API_KEY": "k1,"}, [], "LEADTIME_ROUTE_API_KEY must be printable ASCII"),
        ({}, ["--api-key", "k1,k2"], "--api-key must be printable ASCII, without spaces, commas"),
        ({}, ["--api-token", "t1,t2"], "--api-token must be printable ASCII, without spaces, commas"),
    ],
)
def test_route_refuses_keys_and_tokens_it_could_not_use(
    env: dict[str, str], extra: list[str], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty LEADTIME_ROUTE_API_KEY (a Secret with an empty key) was read as none: the gateway came up open to
    every client, saying so at INFO. A token with a space had every observation refused (401) for ever."""
    from typer.testing import CliRunner

    from leadtime.cli import app
    from leadtime.router_plugin.gateway import serve

    monkeypatch.setattr(serve, "build_gateway", lambda *a, **k: pytest.fail("the gateway was built"))
    for variable in ("LEADTIME_ROUTE_API_KEY", "LEADTIME_API_TOKEN", "LEADTIME_ROUTE_ALLOWED_HOSTS"):
        monkeypatch.delenv(variable, raising=False)
    args = ["route", "--endpoint", "127.0.0.1:1", "--predictor-url", "http://127.0.0.1:1", *extra]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert named in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_a_blank_variable_a_flag_overrides_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LEADTIME_API_TOKEN=""` beside `--api-token X` was refused, though the flag wins."""
    from typer.testing import CliRunner

    from leadtime.cli import app
    from leadtime.router_plugin.gateway import serve

    built: list[Any] = []

    def build(options: Any, *args: Any, **kwargs: Any) -> None:
        built.append(options.settings)
        raise SystemExit(0)

    monkeypatch.setattr(serve, "build_gateway", build)
    args = ["route", "--endpoint", "127.0.0.1:1", "--policy", "random", "--api-key", "k1", "--api-token", "t1"]
    args += ["--allowed-host", "gw"]
    env = {"LEADTIME_API_TOKEN": "", "LEADTIME_ROUTE_API_KEY": " ", "LEADTIME_ROUTE_ALLOWED_HOSTS": ""}
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0 and built and built[0].api_keys == ("k1",), result.output
    assert built[0].allowed_hosts == ("gw",)


def test_route_refuses_a_broken_discovery_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from leadtime.cli import app

    path = tmp_path / "endpoints.yaml"
    path.write_text("endpoints:\n  - {name: a, address: 10.0.0.1, port: 'x'}\n")
    result = CliRunner().invoke(app, ["route", "--discovery", str(path), "--policy", "random"])
    assert result.exit_code == 2 and "endpoints[0].port" in result.output


def test_the_gateway_starts_and_stops_a_pulled_model_with_itself_and_nothing_else() -> None:
    from leadtime.router_plugin.gateway.predictor import BackgroundModel
    from leadtime.router_plugin.gateway.pulled import PulledModel

    observer = LeanHttpPredictorClient("http://127.0.0.1:9")
    pulled = PulledModel("http://127.0.0.1:9", observer, interval_s=60.0, timeout_s=0.2)
    assert isinstance(pulled, BackgroundModel) and not isinstance(observer, BackgroundModel)
    predictor = GatewayPredictor(pulled, observer, GatewayMetrics())
    predictor.start()
    try:
        assert pulled._thread is not None and pulled._thread.is_alive()  # pulling (nothing answers on port 9)
        assert pulled.age_s() is None
    finally:
        predictor.stop(timeout_s=2.0)
    assert not pulled._thread.is_alive()


def test_a_failing_pull_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """It said "failed (error)": not whether the service was down, refused or answered something else."""
    import httpx as _httpx

    from leadtime.router_plugin.gateway.pulled import PulledModel

    pulled = PulledModel("http://127.0.0.1:9", LeanHttpPredictorClient("http://127.0.0.1:9"), timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="leadtime.router.pulled"), _httpx.Client(timeout=0.5) as client:
        assert pulled.pull_once(client) == "error"
    (said,) = [r.getMessage() for r in caplog.records]
    assert "failed (error)" not in said and "refused" in said.lower(), said  # the connection was refused


def test_an_endpoints_interim_responses_are_passed_over_for_its_answer() -> None:
    """An endpoint (or a proxy before it) may send 100 Continue or 103 Early Hints before its answer."""
    import asyncio

    from leadtime.router_plugin.gateway.upstream import UpstreamPool

    async def scenario() -> tuple[int, bytes, list[tuple[bytes, bytes]], int, bytes]:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(2):
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
                await writer.drain()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-final: 1\r\n\r\nok")
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = UpstreamPool("127.0.0.1", port, 2.0)
        try:
            first = await pool.request("GET", "/", timeout_s=5)
            first_body = await first.read(5)
            again = await pool.request("GET", "/", timeout_s=5)  # and the connection is still usable
            return first.status, first_body, first.headers, again.status, await again.read(5)
        finally:
            pool.close()
            server.close()

    status, body, headers, status_again, body_again = asyncio.run(scenario())
    assert (status, body, status_again, body_again) == (200, b"ok", 200, b"ok")
    assert headers == [(b"content-length", b"2"), (b"x-final", b"1")]  # the interim ones' headers are not its


def test_an_observation_the_predictor_refuses_is_dropped_and_the_others_delivered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A gateway that knows a class the service does not (its --catalog): the service refused every batch holding
    one of its rows, and the gateway kept and retried them all for ever, the H100 rows with them, saying the
    predictor could not be reached."""
    from served import uvicorn_in_a_thread

    from leadtime.predictor.service.app import create_app
    from leadtime.predictor.settings import ServiceSettings
    from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient

    app = create_app(ServiceSettings())
    unknown = FeatureRow(RequestFeatures(input_tokens=10), EndpointState(endpoint_id="b", accelerator="b200"))
    batch = [Observation(ROW, actual_ttft_ms=50.0) for _ in range(5)]
    batch[1] = batch[3] = Observation(unknown, actual_ttft_ms=50.0)
    with uvicorn_in_a_thread(app) as url, caplog.at_level(logging.WARNING, logger="leadtime.router.predictor"):
        client = LeanHttpPredictorClient(url, deadline_s=5.0)
        wrapper = GatewayPredictor(client, client, GatewayMetrics(), flush_interval_s=0.01)
        wrapper.start()
        try:
            wrapper.observe(batch)
            deadline = time.monotonic() + 30
            while (wrapper.sent < 3 or wrapper.pending()) and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            wrapper.stop()
        assert app.state.runtime.samples.seen == 3
    assert wrapper.sent == 3 and wrapper.dropped == 2 and wrapper.pending() == 0
    said = [r.getMessage() for r in caplog.records if "refuses" in r.getMessage()]
    assert len(said) == 1 and "unknown accelerator class 'b200'" in said[0] and "dropped" in said[0], said
    assert "observations" not in wrapper.health()


def test_candidates_the_predictor_refuses_do_not_open_the_breaker_and_are_named_in_readyz() -> None:
    """A refusal of rows (a class the predictor does not know) counted towards the breaker: three decisions with
    that endpoint among their candidates sent every decision, the others too, to the heuristics for a second, and
    /readyz said only "failing (refused)"."""
    from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
    from leadtime.router_plugin.client import InProcessPredictor

    client = InProcessPredictor(OnlinePredictor(LearnerConfig(background=False)))
    wrapper = GatewayPredictor(client, client, GatewayMetrics(), open_after=3)
    unknown = FeatureRow(RequestFeatures(input_tokens=10), EndpointState(endpoint_id="b", accelerator="b200"))
    for _ in range(5):
        with pytest.raises(PredictorError):
            wrapper.predict([ROW, unknown])
    assert len(wrapper.predict([ROW]).ttft_mean_ms) == 1  # not resting: the predictor answers what it can read
    said = wrapper.health()["candidates"]
    assert "unknown accelerator class 'b200'" in said and "rows[1]" not in said, said
    assert "predictor" not in wrapper.health()


@pytest.mark.parametrize("path", ["native", "llmd"])
def test_observations_whose_sender_gave_up_are_not_kept_so_its_retry_lands_once(tmp_path: Path, path: str) -> None:
    """A paused service (SIGSTOP) took in, once resumed, every batch the gateway had given up on at its deadline,
    and then the same batches again from the gateway's retries: each observation learned twice or three times.
    As over gRPC, a batch whose sender is gone by the time it would be accepted is not kept."""
    import os
    import signal

    import httpx

    from leadtime.bench.procs import Predictor
    from leadtime.features.rows import observation_to_llmd
    from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient

    service = Predictor(tmp_path).wait()
    try:
        client = LeanHttpPredictorClient(service.url, deadline_s=0.5)
        batch = [Observation(ROW, actual_ttft_ms=50.0 + i) for i in range(4)]
        entries = [observation_to_llmd(o) for o in batch]

        def send(deadline_s: float) -> None:
            if path == "native":
                client.observe(batch, deadline_s)
            else:  # llm-d's router posts its training batches so, and gives up at its own deadline
                body = {"entries": entries}
                httpx.post(f"{service.url}/add_training_data_bulk", json=body, timeout=deadline_s).raise_for_status()

        os.kill(service.child.process.pid, signal.SIGSTOP)
        try:
            with pytest.raises((PredictorUnavailable, httpx.TimeoutException)):
                send(0.5)
        finally:
            os.kill(service.child.process.pid, signal.SIGCONT)
        send(5.0)  # the sender's retry
        deadline = time.monotonic() + 30
        status: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status = httpx.get(f"{service.url}/v1/status", timeout=5).json()
            if status["learned"]["ttft"] >= 4:
                break
            time.sleep(0.1)
        time.sleep(1.0)  # anything accepted twice would be learned by now too
        status = httpx.get(f"{service.url}/v1/status", timeout=5).json()
        assert status["learned"]["ttft"] == 4, status["learned"]
    finally:
        service.child.stop()


def test_states_never_read_are_as_old_as_the_watch_and_said_as_none_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A source whose states were never read (a --timeslice-url that never answered, a file never written) left
    leadtime_router_timeslice_states_age_seconds at 0, so the alert on stale states never fired while every group was
    taken as away; and its failures were logged as "keeping the previous ones" when there were none."""
    path = tmp_path / "groups.yaml"
    (endpoint,) = parse_static(["127.0.0.1:9,name=a,leadtime.io/timeslice-group=rl"])
    gateway = Gateway(StaticDiscovery((endpoint,)), RoundRobinPolicy(), GatewaySettings(timeslice_poll_s=0.001))
    gateway.scraper.scrapes[endpoint.endpoint_id] = EndpointScrape(endpoint)
    now = [10_000.0]
    gateway.clock = lambda: now[0]
    with caplog.at_level(logging.WARNING, logger="leadtime.router.timeslice"):
        gateway.timeslice = FileTimesliceSource(path, clock=lambda: now[0])
        gateway.timeslice.first_read()

        async def watch() -> None:  # one watch, as the gateway runs it, through 40 s of its clock
            task = asyncio.get_running_loop().create_task(gateway._watch_timeslice())
            await asyncio.sleep(0.02)
            now[0] += 40_000.0
            await asyncio.sleep(0.02)
            task.cancel()

        asyncio.run(watch())
    text = gateway.metrics.render().decode()
    assert "leadtime_router_timeslice_states_age_seconds 40.0" in text
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "taken as away" in said[0] and "previous" not in said[0], said


def test_an_endpoint_scraped_before_its_groups_states_are_first_read_is_taken_as_away() -> None:
    """Groups are taken as away until their states are first read, but an endpoint scraped before the first poll of
    the states had ended (an orchestrator slow to answer at the gateway's start) was stamped resident: the gateway
    was ready and its first requests went to endpoints whose accelerators the training job held."""
    from leadtime.router_plugin.timeslice_sources import HttpTimesliceSource

    async def metrics(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await next_request(reader, writer)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)  # the orchestrator has not answered yet

    async def go() -> str:
        endpoint = await asyncio.start_server(metrics, "127.0.0.1", 0)
        orchestrator = await asyncio.start_server(silent, "127.0.0.1", 0)
        port, states_port = (s.sockets[0].getsockname()[1] for s in (endpoint, orchestrator))
        spec = f"127.0.0.1:{port},name=a,leadtime.io/timeslice-group=rl"
        gateway = Gateway(StaticDiscovery(parse_static([spec])), RoundRobinPolicy(), GatewaySettings())
        url = f"http://127.0.0.1:{states_port}/groups"
        gateway.attach_timeslice(HttpTimesliceSource(url, gateway.upstreams, gateway.clock, timeout_s=30))
        await gateway.start()
        try:
            for _ in range(200):
                if (scraped := gateway.scraper.scrapes["a"].state) is not None:
                    return scraped.timeslice_state
                await asyncio.sleep(0.01)
            return "never scraped"
        finally:
            await gateway.stop()
            endpoint.close()
            orchestrator.close()

    assert asyncio.run(go()) == "parked"
