"""The predictor service in process: over HTTP (TestClient, or a real uvicorn on a thread) and gRPC on the same
runtime."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from leadtime.bench.procs import free_port
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


@contextlib.contextmanager
def uvicorn_in_a_thread(app: FastAPI) -> Iterator[str]:
    """`app` served by a real uvicorn on a free loopback port, on a thread of its own (its lifespan run): the
    base URL. Unlike TestClient, requests arrive concurrently, over real sockets, on the app's own event loop."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
