"""vLLM's other request paths through the gateway (`PASSED_THROUGH`): to the least-loaded endpoint that serves,
answered as the endpoint answers, in front of real `sim serve` endpoints."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import httpx
from inprocess_gateway import Scenario, counted, through_gateway
from raw_endpoint import Handler, fleet_of, gateway_in_front, next_request

from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.heuristics import RoundRobinPolicy
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest
from leadtime.simulator.fleet import parse_fleet

TWO = parse_fleet(
    {"name": "two", "pools": [{"name": "h", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}]}
)
PD = parse_fleet(
    {
        "name": "pd",
        "pools": [
            {"name": "p", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"},
            {"name": "d", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "decode"},
        ],
    }
)
SETTINGS = GatewaySettings(scrape_interval_s=0.05)


class Learning(RoundRobinPolicy):
    """Round-robin that keeps what it is asked and told: a passed-through request must reach neither."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0
        self.outcomes: list[Outcome] = []

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        self.asked += 1
        return super().pick(request, candidates)

    def observe(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


async def tokenize_four(client: httpx.AsyncClient) -> list[httpx.Response]:
    return [await client.post("/tokenize", json={"prompt": f"count these {i} words"}) for i in range(4)]


def test_a_tokenize_request_is_answered_by_an_endpoint_in_turn_and_teaches_nothing() -> None:
    policy = Learning()
    samples, replies = through_gateway(TWO, policy, tokenize_four, SETTINGS)
    assert [r.status_code for r in replies] == [200] * 4
    assert [r.json()["count"] for r in replies] == [4] * 4 and len(replies[0].json()["tokens"]) == 4
    # Both idle: they take turns.
    assert sorted(r.headers["x-leadtime-endpoint"] for r in replies) == ["h-0", "h-0", "h-1", "h-1"]
    assert policy.asked == 0 and policy.outcomes == []
    assert counted(samples, "leadtime_router_requests_total", path="/tokenize", code="200") == 4


def tokenize_beside_a_long_request(gateways: list[Gateway]) -> Scenario:
    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        (gateway,) = gateways
        long = asyncio.ensure_future(
            client.post("/v1/completions", json={"prompt": "w " * 500, "max_tokens": 400, "stream": False})
        )

        def scraped_busy() -> bool:  # what passed-through requests are routed by: the scraped running and waiting
            return any(
                s.state is not None and s.state.num_request_running + s.state.num_request_waiting > 0
                for s in gateway.routable()
            )

        deadline = asyncio.get_running_loop().time() + 30
        while not scraped_busy():  # it runs, and the endpoints were scraped since
            assert asyncio.get_running_loop().time() < deadline, "no scrape showed the long request running"
            assert not long.done()
            await asyncio.sleep(0.02)
        replies = [await client.post("/tokenize", json={"prompt": "x y"}) for _ in range(3)]
        return [await long, *replies]

    return scenario


def test_a_passed_through_request_goes_to_the_least_loaded_endpoint() -> None:
    gateways: list[Gateway] = []
    scenario = tokenize_beside_a_long_request(gateways)
    _, (long, *replies) = through_gateway(TWO, Learning(), scenario, SETTINGS, attach=gateways.append)
    busy = long.headers["x-leadtime-endpoint"]
    assert long.status_code == 200
    assert {r.headers["x-leadtime-endpoint"] for r in replies} == {"h-1" if busy == "h-0" else "h-0"}


async def refused_and_unknown(client: httpx.AsyncClient) -> list[httpx.Response]:
    return [
        await client.post("/tokenize", json={"text": "no prompt"}),
        await client.post("/v1/responses", json={"input": "stateful"}),
        await client.post("/tokenize", json={"prompt": "on a decode endpoint"}),
    ]


def test_the_endpoints_refusal_comes_back_as_it_is_and_stateful_paths_are_not_passed() -> None:
    _, (refused, stateful, ok) = through_gateway(PD, Learning(), refused_and_unknown, SETTINGS)
    assert refused.status_code == 422 and refused.headers["x-leadtime-endpoint"] == "d-0"
    assert stateful.status_code == 404 and "/v1/responses" in stateful.json()["error"]["message"]
    # On a P/D fleet the prefill endpoints serve no client: the decode endpoint answers.
    assert ok.status_code == 200 and ok.headers["x-leadtime-endpoint"] == "d-0"


async def one_completion(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": "just the decode pool", "max_tokens": 3})


def test_a_pd_fleet_without_its_prefill_pool_is_served_by_its_decode_endpoints() -> None:
    _, reply = through_gateway(PD, Learning(), one_completion, SETTINGS, discovered=lambda cfg: cfg.role == "decode")
    assert reply.status_code == 200 and reply.headers["x-leadtime-endpoint"] == "d-0"
    assert "x-leadtime-prefill-endpoint" not in reply.headers


async def completion_and_readiness(client: httpx.AsyncClient) -> tuple[httpx.Response, httpx.Response]:
    return await one_completion(client), await client.get("/readyz")


def test_a_pd_fleet_without_its_decode_pool_is_a_503_saying_so_and_not_ready() -> None:
    """/readyz said ready (1 routable endpoint) while every request got a 503."""
    _, (reply, ready) = through_gateway(
        PD, Learning(), completion_and_readiness, SETTINGS, discovered=lambda cfg: cfg.role == "prefill"
    )
    assert reply.status_code == 503 and reply.json()["error"]["param"] == "endpoints"
    assert "no decode endpoint" in reply.json()["error"]["message"]
    assert ready.status_code == 503 and "prefill" in ready.json()["reason"]


MODELS = b'{"object":"list","data":[{"id":"m"}]}'


async def checks_the_key(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An endpoint guarding its `/v1` paths with the bearer token `k1`, as `vllm serve --api-key k1` does."""
    # cancelled as the test's loop ends, with a connection open: quietly (asyncio logs a cancelled handler)
    with contextlib.suppress(ConnectionError, asyncio.CancelledError):
        while (head := await next_request(reader, writer)) is not None:
            shown = b"\r\nauthorization: bearer k1\r\n" in head.lower()
            status, body = (b"200 OK", MODELS) if shown else (b"401 Unauthorized", b'{"error":"Unauthorized"}')
            head_out = (
                b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nx-request-id: r1\r\ncontent-length: %d\r\n\r\n"
            )
            writer.write(head_out % (status, len(body)) + body)
            await writer.drain()


def test_the_models_list_goes_to_the_endpoint_with_the_clients_key() -> None:
    """Regression: GET /v1/models went on with none of the client's headers: behind endpoints started with
    --api-key (vLLM guards every /v1 path with it), a client showing the right key was answered 401, while its
    completions, sent on with its headers, were served."""

    async def go() -> tuple[httpx.Response, httpx.Response]:
        server = await asyncio.start_server(checks_the_key, "127.0.0.1", 0)
        settings = GatewaySettings(api_keys=("k1",))
        try:
            async with gateway_in_front(server.sockets[0].getsockname()[1], settings) as gateway:
                transport = httpx.ASGITransport(app=gateway)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as client:
                    models = await client.get("/v1/models", headers={"authorization": "Bearer k1"})
                    completion = await client.post(
                        "/v1/completions", json={"prompt": "hi"}, headers={"authorization": "Bearer k1"}
                    )
                    return models, completion
        finally:
            server.close()

    models, completion = asyncio.run(go())
    assert completion.status_code == 200  # the endpoint takes the key on the other paths
    assert models.status_code == 200, models.text
    assert models.content == MODELS
    assert models.headers["x-request-id"] == "r1"  # its headers come back, as on every path sent on


def models_answering(status: bytes) -> Handler:
    """An endpoint answering every request but its scrapes with `status` (a models list when 200 OK)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while await next_request(reader, writer) is not None:
                body = MODELS if status.startswith(b"200") else b'{"error":"engine dead"}'
                head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                writer.write(head % (status, len(body)) + body)
                await writer.drain()

    return serve


def models_through(statuses: Sequence[bytes]) -> httpx.Response:
    """GET /v1/models through an in-process gateway in front of one hand-written endpoint per status, in order."""

    async def go() -> httpx.Response:
        handlers = {f"e-{i}": models_answering(status) for i, status in enumerate(statuses)}
        async with fleet_of(handlers, RoundRobinPolicy()) as (_, client, _):
            return await client.get("/v1/models")

    return asyncio.run(go())


def test_the_models_list_comes_from_an_endpoint_that_can_answer_it() -> None:
    """Regression: an endpoint whose engine had failed (a 500 or 503 to every path) answered the models list for
    the whole fleet when it was listed first, although the next endpoint served it."""
    assert models_through([b"503 Service Unavailable", b"200 OK"]).content == MODELS
    assert models_through([b"500 Internal Server Error", b"200 OK"]).status_code == 200
    failed = models_through([b"500 Internal Server Error", b"503 Service Unavailable"])
    assert failed.status_code == 503 and failed.json() == {"error": "engine dead"}  # none could: the last answer
    refused = models_through([b"401 Unauthorized", b"200 OK"])  # the client's own problem: passed on as it is
    assert refused.status_code == 401
