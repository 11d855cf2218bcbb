"""`leadtime route` in front of a P/D fleet and a time-sliced fleet (`leadtime sim serve` processes on loopback)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from leadtime.bench.procs import Route, SimFleet
from leadtime.features.vllm_metrics import parse_samples

PD_FLEET = {
    "name": "pd-small",
    "kv_link_gb_s": 25,
    "pools": [
        {"name": "prefill", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"},
        {"name": "decode", "count": 1, "accelerator": "h200-sxm", "model": "llama-3.1-8b", "role": "decode"},
    ],
}
TIMESLICED_FLEET = {
    "name": "timesliced-small",
    "pools": [
        {"name": "dedicated", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
        {"name": "shared", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "timeslice_group": "rl"},
    ],
    "timeslice_groups": {
        "rl": {
            "resident_ms": {"distribution": "fixed", "value": 1500},
            "away_ms": {"distribution": "fixed", "value": 2500},
            "restore_ms": {"distribution": "fixed", "value": 50},
        }
    },
}


def stream(url: str, prompt: str, max_tokens: int) -> tuple[httpx.Response, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    tokens = sum(1 for e in events if e != "[DONE]" and (json.loads(e).get("choices") or [{}])[0].get("text"))
    return response, tokens


def counter(url: str, name: str) -> float:
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=5).text)
    return sum(v for _, v in samples.get(name, []))


@pytest.fixture(scope="module")
def fleets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Both mock fleets and three gateways: P/D with llm-d's heuristics (decode, then prefill, always a pair),
    P/D with Leadtime, and the time-sliced fleet with Leadtime reading the orchestrator's group states."""
    root = tmp_path_factory.mktemp("fleets")
    (root / "pd").mkdir()
    (root / "ts").mkdir()
    (root / "pd" / "fleet.yaml").write_text(yaml.safe_dump(PD_FLEET))
    (root / "ts" / "fleet.yaml").write_text(yaml.safe_dump(TIMESLICED_FLEET))
    pd = SimFleet(root / "pd" / "fleet.yaml", root / "pd")
    ts = SimFleet(root / "ts" / "fleet.yaml", root / "ts")
    assert ts.timeslice_url is not None
    routes = {
        "pd_heuristic": Route(root, ["--discovery", str(pd.endpoints_file), "--profile", "heuristic"]),
        "pd_leadtime": Route(root, ["--discovery", str(pd.endpoints_file), "--embedded"]),
        "timesliced": Route(
            root, ["--discovery", str(ts.endpoints_file), "--embedded", "--timeslice-url", ts.timeslice_url]
        ),
    }
    try:
        for r in routes.values():
            r.wait()
        yield {"pd": pd, "ts": ts, **routes}
    finally:
        for r in routes.values():
            r.child.stop()
        pd.stop()
        ts.stop()


def test_pd_the_decode_endpoint_gets_the_prefiller_in_the_header(fleets: dict[str, object]) -> None:
    pd, route = fleets["pd"], fleets["pd_heuristic"]
    assert isinstance(pd, SimFleet) and isinstance(route, Route)
    prefill, decode = pd.url("prefill-0"), pd.url("decode-0")
    response, tokens = stream(route.url, "a long document to prefill elsewhere " * 60, 6)
    assert response.status_code == 200 and tokens == 6
    assert response.headers["x-leadtime-endpoint"] == "decode-0"
    assert response.headers["x-leadtime-prefill-endpoint"] == "prefill-0"
    assert counter(prefill, "leadtime_sim_prefills_for_peers_total") == 1  # the prompt was prefilled there ...
    assert counter(decode, "leadtime_sim_kv_received_total") == 1  # ... and its KV moved to the decode endpoint
    assert counter(decode, "vllm:prompt_tokens_total") == 0
    assert route.metric("leadtime_router_pd_decisions_total", decision="disaggregated") == 1


def test_pd_header_naming_no_prefill_endpoint_is_refused_by_the_mock(fleets: dict[str, object]) -> None:
    pd = fleets["pd"]
    assert isinstance(pd, SimFleet)
    reply = httpx.post(
        pd.url("decode-0") + "/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={"x-prefiller-host-port": "127.0.0.1:1"},
        timeout=10,
    )
    assert reply.status_code == 400 and reply.json()["field"] == "x-prefiller-host-port"


def test_pd_with_leadtime_every_request_is_a_pair_or_a_local_prefill(fleets: dict[str, object]) -> None:
    route = fleets["pd_leadtime"]
    assert isinstance(route, Route)
    for i in range(6):
        response, tokens = stream(route.url, f"prompt {i} " * (20 + 200 * i), 4)
        assert response.status_code == 200 and tokens == 4
        assert response.headers["x-leadtime-endpoint"] == "decode-0"
    decisions = route.metric("leadtime_router_pd_decisions_total")
    assert decisions == 6


def test_pd_a_non_streaming_request_is_measured_through_the_pair(fleets: dict[str, object]) -> None:
    route = fleets["pd_leadtime"]
    assert isinstance(route, Route)
    measured = route.metric("leadtime_router_non_streaming_total", measured="true")
    reply = httpx.post(f"{route.url}/v1/completions", json={"prompt": "a long document " * 300, "max_tokens": 3})
    assert reply.status_code == 200 and reply.headers["x-leadtime-endpoint"] == "decode-0"
    assert reply.json()["choices"] == [
        {"index": 0, "text": " tok0 tok1 tok2", "logprobs": None, "finish_reason": "length"}
    ]
    assert route.metric("leadtime_router_non_streaming_total", measured="true") == measured + 1


def test_a_time_sliced_endpoint_is_not_routed_to_while_swapped_out(fleets: dict[str, object]) -> None:
    ts, route = fleets["ts"], fleets["timesliced"]
    assert isinstance(ts, SimFleet) and isinstance(route, Route) and ts.timeslice_url is not None
    checked = 0
    deadline = time.monotonic() + 12
    while checked < 4 and time.monotonic() < deadline:
        group = httpx.get(ts.timeslice_url, timeout=5).json()["groups"]["rl"]
        away_for = time.time() - group["since"]
        # Well inside an away period (2.5 s long): the gateway polls the orchestrator every 100 ms.
        if group["active_job"] == "training" and 0.4 < away_for < 1.8:
            response, tokens = stream(route.url, "who serves me now", 2)
            assert response.status_code == 200 and tokens == 2
            assert response.headers["x-leadtime-endpoint"] == "dedicated-0"
            checked += 1
        else:
            time.sleep(0.05)
    assert checked >= 4
    assert route.metric("leadtime_router_timeslice_filtered_total") >= checked


SMALL_KV_FLEET = {
    "name": "smallkv",
    "pools": [  # big-0 holds 91,088 tokens, small-0 30,048
        {"name": name, "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "gpu_memory_utilization": share}
        for name, share in (("big", 0.35), ("small", 0.25))
    ],
}


@pytest.fixture(scope="module")
def smallkv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Route]:
    """Leadtime in front of two endpoints whose KV caches differ threefold (their `vllm:cache_config_info`)."""
    root = tmp_path_factory.mktemp("smallkv")
    (root / "fleet.yaml").write_text(yaml.safe_dump(SMALL_KV_FLEET))
    fleet = SimFleet(root / "fleet.yaml", root)
    route = Route(root, ["--discovery", str(fleet.endpoints_file), "--embedded"])
    try:
        yield route.wait()
    finally:
        route.child.stop()
        fleet.stop()


def test_a_prompt_a_small_kv_cache_cannot_hold_goes_where_it_fits(smallkv: Route) -> None:
    for _ in range(4):
        response, tokens = stream(smallkv.url, "word " * 40_000, 2)
        assert response.status_code == 200 and tokens == 2
        assert response.headers["x-leadtime-endpoint"] == "big-0"
    seen = {stream(smallkv.url, f"short {i} " * 50, 2)[0].headers["x-leadtime-endpoint"] for i in range(8)}
    assert "small-0" in seen  # short prompts still go to either


def test_a_prompt_no_kv_cache_can_hold_is_refused_naming_the_cache(smallkv: Route) -> None:
    body = {"prompt": "word " * 120_000, "max_tokens": 2, "stream": True}
    response = httpx.post(f"{smallkv.url}/v1/completions", json=body, timeout=60)
    assert 400 <= response.status_code < 600 and "KV cache" in response.text
