"""The gateway's /readyz on what it routes with besides the endpoints: the source of time-slice group states."""

from __future__ import annotations

import asyncio
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
