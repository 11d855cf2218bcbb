"""The gateway's /readyz on what it routes with besides the endpoints: the source of time-slice group states, the
model pulled from the service (`--pull-model`)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
from raw_endpoint import gateway_in_front, next_request

Writer = asyncio.StreamWriter


def test_readyz_names_a_source_of_group_states_that_cannot_be_read(tmp_path: Any) -> None:
    """A dead or broken source showed as one log line and a counter; /readyz said nothing degraded while the
    gateway routed on states growing old."""
    from leadtime.router_plugin.timeslice_sources import FileTimesliceSource

    path = tmp_path / "groups.yaml"
    path.write_text("groups: {rl: {state: NOPE}}\n")

    async def serve(reader: asyncio.StreamReader, writer: Writer) -> None:
        await next_request(reader, writer)

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        try:
            async with gateway_in_front(server.sockets[0].getsockname()[1]) as gateway:
                source = FileTimesliceSource(path, clock=lambda: 10_000.0)
                gateway.timeslice = source
                source.poll()
                transport = httpx.ASGITransport(app=gateway)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                    failing = (await client.get("/readyz")).json()
                    path.write_text("groups: {rl: {state: LOCKED, active_job: inference, loaded_job: inference}}\n")
                    source.poll()
                    return failing, (await client.get("/readyz")).json()
        finally:
            server.close()

    failing, fixed = asyncio.run(go())
    assert failing["status"] == "ready" and "groups.rl.state" in failing["degraded"]["timeslice"]
    assert "timeslice" not in fixed["degraded"]


def test_readyz_names_a_pull_of_the_model_that_keeps_failing() -> None:
    """With --pull-model, a service killed or answering GET /v1/model with 404 left
    /readyz saying nothing degraded while the model held grew old; it stays ready (the held model predicts)."""
    from leadtime.predictor.learner import OnlinePredictor
    from leadtime.router_plugin.gateway.metrics import GatewayMetrics
    from leadtime.router_plugin.gateway.predictor import GatewayPredictor
    from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient
    from leadtime.router_plugin.gateway.pulled import PulledModel

    artifact = OnlinePredictor().to_bytes()
    digest = f'"{hashlib.sha256(artifact).hexdigest()}"'
    status = [200]

    def service(request: httpx.Request) -> httpx.Response:
        if status[0] == 404:
            return httpx.Response(404, json={"detail": "Not Found"})
        if request.headers.get("if-none-match") == digest:
            return httpx.Response(304)
        return httpx.Response(200, content=artifact, headers={"etag": digest})

    url = "http://service.test:8000"
    pulled = PulledModel(url, LeanHttpPredictorClient(url), interval_s=60.0)
    pulling = httpx.Client(transport=httpx.MockTransport(service))

    async def serve(reader: asyncio.StreamReader, writer: Writer) -> None:
        await next_request(reader, writer)

    async def go() -> list[dict[str, Any]]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        try:
            async with gateway_in_front(server.sockets[0].getsockname()[1]) as gateway:
                gateway.predictor = GatewayPredictor(pulled, pulled.observer, GatewayMetrics())
                transport = httpx.ASGITransport(app=gateway)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                    answers = []
                    for now in (200, 404, 200):
                        status[0] = now
                        pulled.pull_once(pulling)
                        reply = await client.get("/readyz")
                        assert reply.status_code == 200, reply.text
                        answers.append(reply.json())
                    return answers
        finally:
            server.close()

    with pulling:
        pulled_fine, failing, recovered = asyncio.run(go())
    assert "model_pull" not in pulled_fine["degraded"]
    assert failing["status"] == "ready"
    assert failing["degraded"]["model_pull"].startswith("failing (answered 404); model ")
    assert failing["degraded"]["model_pull"].endswith(" s old")
    assert "model_pull" not in recovered["degraded"]


def test_readyz_names_a_pull_that_never_found_the_service() -> None:
    """No model pulled yet: decisions fall back to the heuristics, and /readyz says why."""
    from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient
    from leadtime.router_plugin.gateway.pulled import PulledModel

    url = "http://127.0.0.1:9"
    pulled = PulledModel(url, LeanHttpPredictorClient(url), interval_s=60.0, timeout_s=0.2)
    assert pulled.health() == {}  # nothing tried yet
    with httpx.Client(timeout=0.5) as client:
        assert pulled.pull_once(client) == "error"
    (said,) = pulled.health().values()
    assert said.startswith("failing (") and "no model pulled yet" in said, said


def test_readyz_names_an_endpoint_whose_scrapes_fail_until_they_succeed() -> None:
    """An endpoint whose /metrics failed was said once in the log and never in /readyz, routable or not."""
    from raw_endpoint import METRICS

    answering = [True]

    async def serve(reader: asyncio.StreamReader, writer: Writer) -> None:
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if answering[0]:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(METRICS), METRICS))
            else:
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()

    async def until(client: httpx.AsyncClient, failing: bool) -> dict[str, Any]:
        for _ in range(250):
            answer = (await client.get("/readyz")).json()
            if ("endpoint e-0" in answer.get("degraded", {})) == failing:
                return answer
            await asyncio.sleep(0.02)
        return answer

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        try:
            async with gateway_in_front(server.sockets[0].getsockname()[1]) as gateway:
                transport = httpx.ASGITransport(app=gateway)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                    answering[0] = False
                    failing = await until(client, True)
                    answering[0] = True
                    return failing, await until(client, False)
        finally:
            server.close()

    failing, recovered = asyncio.run(go())
    said = failing["degraded"]["endpoint e-0"]
    assert failing["status"] == "ready" and "its scrapes fail (" in said and "500" in said, failing
    assert "endpoint e-0" not in recovered["degraded"], recovered


def test_readyz_names_a_discovery_file_whose_reload_failed(tmp_path: Any, caplog: Any) -> None:
    """A re-read refused kept the previous endpoints, said once in the log and counted; /readyz stayed clean, and
    a fixed file back to the same endpoints said nothing at all."""
    import logging

    from leadtime.router_plugin.discovery import FileDiscovery
    from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
    from leadtime.router_plugin.heuristics import RoundRobinPolicy

    good = "endpoints: [{name: e-0, address: 127.0.0.1, port: 9}]\n"
    path = tmp_path / "endpoints.yaml"
    path.write_text(good)
    discovery = FileDiscovery(path)
    gateway = Gateway(discovery, RoundRobinPolicy(), GatewaySettings())

    async def readyz() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=gateway)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return (await client.get("/readyz")).json()

    path.write_text("endpoints: [{name: e-0, address: 127.0.0.1, port: abc}]\n")
    discovery.poll()
    refused = asyncio.run(readyz())
    assert "port" in refused["degraded"]["discovery"] and "endpoints read before" in refused["degraded"]["discovery"]
    path.write_text(good + "# fixed\n")
    with caplog.at_level(logging.INFO, logger="leadtime.router"):
        discovery.poll()
    assert "discovery" not in asyncio.run(readyz()).get("degraded", {})
    assert any("reads again" in r.getMessage() for r in caplog.records)


def test_readyz_says_no_group_states_were_read_yet_rather_than_routing_on_the_last(tmp_path: Any) -> None:
    """A source never read (an orchestrator's URL that never answered) was said to be "routing on the last states
    read", while there were none and every time-sliced group was taken as away."""
    from leadtime.router_plugin.timeslice_sources import FileTimesliceSource

    async def serve(reader: asyncio.StreamReader, writer: Writer) -> None:
        await next_request(reader, writer)

    async def go() -> dict[str, Any]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        try:
            async with gateway_in_front(server.sockets[0].getsockname()[1]) as gateway:
                source = FileTimesliceSource(tmp_path / "groups.yaml", clock=lambda: 10_000.0)
                gateway.timeslice = source
                source.poll()
                transport = httpx.ASGITransport(app=gateway)
                async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                    return (await client.get("/readyz")).json()
        finally:
            server.close()

    said = asyncio.run(go())["degraded"]["timeslice"]
    assert "groups.yaml: no such file or directory" in said and "taken as away" in said, said
    assert "last states" not in said, said
