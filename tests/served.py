"""The predictor service in process, over HTTP (TestClient) and gRPC on the same runtime."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
from fastapi.testclient import TestClient

from leadtime.predictor.grpc import leadtime_pb2_grpc as pb_grpc
from leadtime.predictor.grpc.server import start_grpc_server
from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings


@contextlib.contextmanager
def http_and_grpc(settings: ServiceSettings) -> Iterator[tuple[TestClient, Any]]:
    """(HTTP client, gRPC stub) of one app built from `settings`; both stopped on exit."""
    with http_and_grpc_channel(settings) as (http, channel):
        yield http, pb_grpc.PredictorStub(channel)


@contextlib.contextmanager
def http_and_grpc_channel(settings: ServiceSettings) -> Iterator[tuple[TestClient, grpc.Channel]]:
    """(HTTP client, gRPC channel) of one app built from `settings`, for calls the stub cannot make."""
    with TestClient(create_app(settings)) as http:
        server, port = start_grpc_server(http.app.state.runtime, "127.0.0.1", 0)  # type: ignore[attr-defined]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield http, channel
        finally:
            channel.close()
            server.stop(grace=None)
