"""`leadtime serve`: one process, HTTP + gRPC + metrics on an embedded store; bad options exit 2 in one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from leadtime.predictor.client import GrpcPredictorClient

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def leadtime(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LEADTIME_")}
    return subprocess.Popen(
        [sys.executable, "-m", "leadtime", *args],
        cwd=ROOT,
        env={**base, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_serve_runs_http_grpc_and_metrics_in_one_process() -> None:
    http_port, grpc_port = free_port(), free_port()
    # The gRPC port comes from its environment variable, the HTTP port from the option.
    process = leadtime("serve", "--port", str(http_port), env={"LEADTIME_GRPC_PORT": str(grpc_port)})
    try:
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 30
        ready = False
        while time.monotonic() < deadline and not ready:
            try:
                ready = httpx.get(f"{base}/readyz", timeout=1).status_code == 200
            except httpx.TransportError:
                time.sleep(0.1)
        assert ready, process.stderr.read1().decode() if process.stderr else ""  # type: ignore[attr-defined]
        row = {
            "kv_cache_percentage": 0.1,
            "input_token_length": 64,
            "num_request_waiting": 0,
            "num_request_running": 0,
            "num_tokens_generated": 0,
            "prefix_cache_score": 0.0,
        }
        assert httpx.post(f"{base}/predict/bulk/strict", json={"requests": [row]}).status_code == 200
        assert "leadtime_http_requests_total" in httpx.get(f"{base}/metrics").text
        with GrpcPredictorClient(f"127.0.0.1:{grpc_port}", deadline_s=5) as g:
            assert g.status()["is_ready"] is True
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_bad_options_exit_2_with_one_line() -> None:
    for args, env, words in [
        (["serve", "--role", "both"], {}, "role"),
        (["serve", "--accelerator", "abacus"], {}, "abacus"),
        (["serve"], {"LEADTIME_QUANTILE": "2"}, "quantile"),
        (["serve", "--redis", "http://x"], {}, "redis_url"),
    ]:
        process = leadtime(*args, env=env)
        _, err = process.communicate(timeout=60)
        message = err.decode().strip()
        assert process.returncode == 2, message
        assert words in message and "Traceback" not in message
        assert len(message.splitlines()) == 1
