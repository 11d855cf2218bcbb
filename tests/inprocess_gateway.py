"""A gateway in this process (`Gateway` over ASGI) in front of a real `sim serve` fleet on loopback, for tests
that need to look at the policy or the gateway's state while requests pass."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from leadtime.bench.procs import free_port
from leadtime.features.vllm_metrics import parse_samples
from leadtime.router_plugin.discovery import StaticDiscovery, parse_static
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.policy import RoutingPolicy
from leadtime.simulator.fleet import EndpointConfig, Fleet
from leadtime.simulator.serve import FleetServer

Scenario = Callable[[httpx.AsyncClient], Awaitable[Any]]


def through_gateway(
    fleet: Fleet,
    policy: RoutingPolicy,
    scenario: Scenario,
    settings: GatewaySettings,
    tokens_per_event: int = 1,
    attach: Callable[[Gateway], None] | None = None,
    discovered: Callable[[EndpointConfig], bool] = lambda cfg: True,
) -> tuple[dict[str, Any], Any]:
    """Run `scenario(client)` against the gateway once every endpoint has been scraped; the gateway's metrics
    (parsed samples) and what the scenario returned. `attach` is given the gateway before it starts; the gateway
    discovers the endpoints `discovered` keeps (all of them by default)."""
    server = FleetServer(fleet, [free_port() for _ in fleet.endpoints], tokens_per_event=tokens_per_event)
    server.start()

    async def go() -> tuple[dict[str, Any], Any]:
        specs = []
        for cfg, port in zip(fleet.endpoints, server.ports, strict=True):
            if not discovered(cfg):
                continue
            spec = f"127.0.0.1:{port},name={cfg.endpoint_id},leadtime.io/accelerator={cfg.accelerator}"
            specs.append(f"{spec},llm-d.ai/role={cfg.role}")
        gateway = Gateway(StaticDiscovery(parse_static(specs)), policy, settings)
        if attach is not None:
            attach(gateway)
        await gateway.start()
        try:
            for _ in range(200):
                scrapes = gateway.routable()
                if len(scrapes) == len(specs) and all(s.state is not None for s in scrapes):
                    break
                await asyncio.sleep(0.02)
            transport = httpx.ASGITransport(app=gateway)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client:
                result = await scenario(client)
                samples = parse_samples((await client.get("/metrics")).text)
        finally:
            await gateway.stop()
        return samples, result

    try:
        return asyncio.run(go())
    finally:
        server.stop()


def counted(samples: dict[str, Any], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    return sum(v for got, v in samples.get(name, []) if all(got.get(k) == want for k, want in labels.items()))
