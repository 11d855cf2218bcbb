"""The clients that ship, against a real `leadtime serve` over TLS (a certificate made at test time): the gateway's
lean HTTP client, the httpx and gRPC clients, the gateway's model pull, and `leadtime route` itself serving HTTPS
and routing with a predictor reached over HTTPS."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import ssl
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvloop
import yaml
from llmd_rows import llmd_row
from threaded_server import serve_in_a_thread

from leadtime.bench.procs import Child, Predictor, Route, SimFleet, free_port
from leadtime.bench.tls import TlsBenchOptions, run_tls_bench, self_signed
from leadtime.features.rows import feature_row_from_llmd
from leadtime.features.vllm_metrics import parse_samples
from leadtime.predictor.client import (
    GrpcPredictorClient,
    HttpPredictorClient,
    PredictorUnavailable,
    tls_client_context,
)
from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient
from leadtime.router_plugin.gateway.pulled import PulledModel
from leadtime.router_plugin.gateway.upstream import UpstreamError, UpstreamPool

TOKEN = "tls-token"
ROW = llmd_row()
FLEET = {"name": "one", "pools": [{"name": "h100", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}]}


@dataclass
class TlsService:
    url: str
    grpc: str
    cert: Path


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsService]:
    workdir = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(workdir)
    predictor = Predictor(workdir, env={"LEADTIME_API_TOKEN": TOKEN}, tls=(cert, key))
    try:
        predictor.wait()
        yield TlsService(predictor.url, predictor.grpc, cert)
    finally:
        predictor.child.stop()


def _observation() -> dict[str, object]:
    return {**ROW, "actual_ttft_ms": 150.0, "actual_tpot_ms": 25.0}


def test_every_client_predicts_and_reports_over_tls(service: TlsService) -> None:
    lean = LeanHttpPredictorClient(service.url, deadline_s=10, api_token=TOKEN, ca_file=service.cert)
    try:
        assert lean.predict([ROW]).ttft_mean_ms[0] > 0
        assert lean.observe([_observation()]) == 1
        assert lean.predict([ROW, ROW]).tpot_mean_ms.shape == (2,)  # the same TLS connection, kept alive
    finally:
        lean.close()
    with HttpPredictorClient(service.url, deadline_s=10, api_token=TOKEN, ca_file=service.cert) as client:
        assert client.predict([ROW]).ttft_quantile_ms[0] > 0
    with GrpcPredictorClient(service.grpc, deadline_s=10, api_token=TOKEN, ca_file=service.cert) as grpc_client:
        assert grpc_client.status()["is_ready"]
        assert grpc_client.predict([ROW]).ttft_mean_ms[0] > 0
        assert grpc_client.observe([_observation()]) == 1


def test_a_certificate_the_client_does_not_trust_is_refused_as_unavailable(service: TlsService) -> None:
    lean = LeanHttpPredictorClient(service.url, deadline_s=10)  # the system's CAs: a self-signed one is not among them
    with pytest.raises(PredictorUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        lean.predict([ROW])
    plain = LeanHttpPredictorClient(service.url.replace("https://", "http://"), deadline_s=2)
    with pytest.raises(PredictorUnavailable, match="transport"):
        plain.predict([ROW])  # plain HTTP to a TLS port: refused, not a hang
    with (
        GrpcPredictorClient(service.grpc, deadline_s=5, tls=True) as grpc_client,
        pytest.raises(PredictorUnavailable, match="UNAVAILABLE"),
    ):
        grpc_client.status()


def test_the_gateway_pulls_the_model_over_tls(service: TlsService) -> None:
    observer = LeanHttpPredictorClient(service.url, deadline_s=10, api_token=TOKEN, ca_file=service.cert)
    pulled = PulledModel(service.url, observer, interval_s=60.0, ca_file=service.cert)
    pulled.start()
    try:
        version = pulled.predict([feature_row_from_llmd(ROW)], deadline_s=30).model_version  # waits for the first pull
        trust = tls_client_context(service.cert)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        status = httpx.get(f"{service.url}/status", verify=trust, headers=auth, timeout=10)
        assert version == status.json()["model_version"]  # the service's own model, pulled
        assert pulled.pulls["new"] == 1 and pulled.model is not None
    finally:
        pulled.stop()
        observer.close()


def test_the_gateways_client_says_when_the_scheme_is_the_wrong_one(service: TlsService) -> None:
    """http:// to the HTTPS service said "the predictor closed the connection", https:// to a plain one "[SSL:
    WRONG_VERSION_NUMBER] wrong version number": neither named the URL's scheme as what to change."""
    plain_dir = service.cert.parent.parent / "plain-for-scheme"
    plain_dir.mkdir(exist_ok=True)
    plain = Predictor(plain_dir)
    try:
        plain.wait()
        cases = (
            (service.url.replace("https://", "http://"), "if it serves HTTPS, give its https:// URL"),
            (plain.url.replace("http://", "https://"), "if it serves plain HTTP, give its http:// URL"),
        )
        for url, hint in cases:
            ca = service.cert if url.startswith("https") else None
            client = LeanHttpPredictorClient(url, deadline_s=5.0, ca_file=ca)
            with pytest.raises(PredictorUnavailable) as err:
                client.predict([ROW])
            client.close()
            assert hint in err.value.message, err.value.message
    finally:
        plain.child.stop()


def test_a_ca_file_is_checked_when_the_client_is_made(tmp_path: Path, service: TlsService) -> None:
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    for make in (
        lambda: LeanHttpPredictorClient(service.url, ca_file=not_pem),
        lambda: HttpPredictorClient(service.url, ca_file=not_pem),
        lambda: GrpcPredictorClient(service.grpc, ca_file=not_pem),
        lambda: PulledModel(service.url, LeanHttpPredictorClient(service.url), ca_file=not_pem),
    ):
        with pytest.raises(ValueError, match="holds no PEM certificate"):
            make()
    plain_url = service.url.replace("https://", "http://")
    with pytest.raises(ValueError, match="a CA file is for a service over TLS"):
        LeanHttpPredictorClient(plain_url, ca_file=service.cert)
    with pytest.raises(ValueError, match="a CA file is for a service over TLS"):
        HttpPredictorClient(plain_url, ca_file=service.cert)


def route_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`leadtime route` with a static endpoint, on a free port, and `args`; what it printed."""
    command = [sys.executable, "-m", "leadtime", "route", "--endpoint", "127.0.0.1:9", "--port", str(free_port())]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--predictor-url", "https://127.0.0.1:9", "--predictor-ca", "/nonexistent.pem"], "--predictor-ca: CA file"),
        (["--predictor-url", "http://127.0.0.1:9", "--predictor-tls"], "TLS is an https:// --predictor-url"),
        (["--predictor-url", "http://127.0.0.1:9", "--predictor-ca", "CERT"], "a CA file is for a service over TLS"),
        (["--embedded", "--predictor-tls"], "are for a predictor service"),
    ],
)
def test_route_names_a_tls_option_that_cannot_work(service: TlsService, args: list[str], message: str) -> None:
    done = route_cli(*[str(service.cert) if a == "CERT" else a for a in args])
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_route_serves_https_and_predicts_with_a_service_over_tls(tmp_path: Path, service: TlsService) -> None:
    """A client reaches the gateway over HTTPS, and the gateway its predictor over HTTPS (the same test CA)."""
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEET))
    fleet = SimFleet(fleet_file, tmp_path)
    trust = tls_client_context(service.cert)
    port = free_port()
    args = ["route", "--port", str(port), "--discovery", str(fleet.endpoints_file), "--api-token", TOKEN]
    args += ["--predictor-url", service.url, "--predictor-ca", str(service.cert)]
    args += ["--tls-cert", str(service.cert), "--tls-key", str(service.cert.with_name("key.pem"))]
    route = Child(args, tmp_path / "route.log")
    url = f"https://127.0.0.1:{port}"
    try:
        route.wait_until(f"{url}/readyz", verify=trust)
        learned = httpx.get(f"{service.url}/v1/status", verify=trust).json()["learned"]
        body = {"prompt": "tell me a story " * 20, "max_tokens": 4, "stream": True}
        for _ in range(3):
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60, verify=trust) as response:
                assert response.status_code == 200 and response.read().endswith(b"data: [DONE]\n\n")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status = httpx.get(f"{service.url}/v1/status", verify=trust).json()
            if status["learned"]["ttft"] >= learned["ttft"] + 3:
                break
            time.sleep(0.2)
        assert status["learned"]["ttft"] >= learned["ttft"] + 3  # the observations went over TLS too
        metrics = parse_samples(httpx.get(f"{url}/metrics", verify=trust).text)
        assert (
            sum(v for labels, v in metrics["leadtime_router_fallbacks_total"] if labels["reason"] == "unavailable") == 0
        )
        predicted = metrics["leadtime_router_ttft_seconds_count"]
        assert sum(v for labels, v in predicted if labels.get("kind") == "predicted") >= 1
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)  # plain HTTP to the TLS port
    finally:
        route.stop()
        fleet.stop()


def test_route_refuses_tls_files_that_cannot_serve(tmp_path: Path) -> None:
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("not a certificate\n")
    for args, message in (
        (["--tls-cert", str(not_pem)], "--tls-cert and --tls-key go together"),
        (["--tls-cert", str(not_pem), "--tls-key", str(not_pem)], "are not a PEM certificate and its unencrypted"),
    ):
        done = route_cli("--policy", "round-robin", *args)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_sim_serve_refuses_tls_files_that_cannot_serve(tmp_path: Path) -> None:
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("not a certificate\n")
    base = [sys.executable, "-m", "leadtime", "sim", "serve", "--fleet", "homogeneous", "--base-port", "1"]
    for args, message in (
        (["--tls-key", str(not_pem)], "--tls-cert and --tls-key go together"),
        (["--tls-cert", str(not_pem), "--tls-key", str(not_pem)], "are not a PEM certificate and its unencrypted"),
    ):
        done = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_route_reaches_endpoints_that_serve_https(tmp_path: Path, service: TlsService) -> None:
    """vLLM endpoints started with --ssl-certfile (here `sim serve --tls-cert`, labelled leadtime.io/scheme: https):
    scraped and proxied over TLS, verified with --upstream-ca; without it the endpoints cannot be verified and are
    never routed to."""
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEET))
    key = service.cert.with_name("key.pem")
    fleet = SimFleet(fleet_file, tmp_path, tls=(service.cert, key))
    assert fleet.url("h100-0").startswith("https://")
    common = ["--discovery", str(fleet.endpoints_file), "--policy", "round-robin"]
    trusting = Route(tmp_path, [*common, "--upstream-ca", str(service.cert)])
    untrusting = Route(tmp_path, common)
    try:
        trusting.wait()
        body = {"prompt": "hello " * 10, "max_tokens": 3, "stream": True}
        with httpx.stream("POST", f"{trusting.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200 and response.read().endswith(b"data: [DONE]\n\n")
        untrusting.child.wait_until(f"{untrusting.url}/healthz")
        time.sleep(1.0)
        assert untrusting.metric("leadtime_router_scrape_errors_total") > 0
        refused = httpx.post(f"{untrusting.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503
    finally:
        trusting.child.stop()
        untrusting.child.stop()
        fleet.stop()


def test_bench_tls_reports_both_transports_side_by_side() -> None:
    report = run_tls_bench(TlsBenchOptions(rows=2, calls=100, block=50, first_calls=10))
    assert report["rows"] == 2 and report["calls_per_transport"] == 100
    for part in ("http", "grpc", "first_call"):
        figures = report[part]
        for transport in ("plain", "tls"):
            assert 0 < figures[transport]["p50_ms"] <= figures[transport]["p99_ms"]
        ratio = figures["tls"]["p50_ms"] / figures["plain"]["p50_ms"]
        assert figures["tls_over_plain"]["p50"] == pytest.approx(ratio, abs=0.01)  # a ratio: no "_ms" on it


def test_bench_tls_sends_as_many_rows_a_call_as_it_reports() -> None:
    """`--rows 5000` reported 5,000 rows a prediction while each call carried the shipped trace's 3,400."""
    from leadtime.bench.serving import load_entries, prediction_rows
    from leadtime.bench.tls import bench_rows

    shipped = prediction_rows(load_entries())
    rows = bench_rows(TlsBenchOptions(rows=5000))
    assert len(shipped) < 5000 and len(rows) == 5000 and rows[len(shipped)] == shipped[0]
    assert bench_rows(TlsBenchOptions()) == shipped[:8]


def serve_tls_in_a_thread(cert: Path, key: Path) -> tuple[int, asyncio.AbstractEventLoop]:
    """A TLS server that reads what it is sent until the client hangs up, on its own loop and thread (as an
    endpoint in another process answers while the gateway's loop is busy): its port and loop."""
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)

    async def endpoint(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            await reader.read()
        writer.close()

    return serve_in_a_thread(endpoint, server_tls)


def test_connections_given_up_during_a_failing_handshake_leave_no_unretrieved_error(tmp_path: Path) -> None:
    """The gateway's client, on uvloop, to an endpoint whose certificate it cannot verify, connections given up on
    mid-way (the connect timeout, a scrape or request cancelled): uvloop's handshake future was left holding the
    SSLCertVerificationError, logged as `Future exception was never retrieved` with a traceback, about once in fifty
    attempts given up at the handshake."""
    port, server_loop = serve_tls_in_a_thread(*self_signed(tmp_path))

    async def attempts() -> tuple[list[dict[str, Any]], Counter[str]]:
        unhandled: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, context: unhandled.append(context))
        client_tls = ssl.create_default_context()  # the system's CAs: the self-signed certificate is not among them
        outcomes: Counter[str] = Counter()
        rng = random.Random(0)

        async def attempt(i: int, within_s: float) -> None:
            """Even `i`: the pool's connect timeout is `within_s`; odd: the caller gives up after `within_s` (a stop,
            a client that left)."""
            pool = UpstreamPool("127.0.0.1", port, connect_timeout_s=within_s if i % 2 == 0 else 10.0, tls=client_tls)
            request = asyncio.ensure_future(pool.request("GET", "/metrics"))
            if i % 2:
                await asyncio.sleep(within_s)
                request.cancel()
            try:
                await request
            except UpstreamError as err:
                outcomes["verify failed" if "CERTIFICATE_VERIFY_FAILED" in str(err) else err.kind] += 1
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
            finally:
                pool.close()

        started = time.perf_counter()  # how long 20 failing handshakes at once take here: given up within that
        await asyncio.gather(*(attempt(0, 10.0) for _ in range(20)))
        batch_s = time.perf_counter() - started
        assert outcomes["verify failed"] == 20, outcomes
        for start in range(0, 2000, 20):
            await asyncio.gather(*(attempt(i, rng.uniform(0.05, 1.2) * batch_s) for i in range(start, start + 20)))
        await asyncio.sleep(0.2)  # connections given up finish failing
        gc.collect()  # an unretrieved future says so when it is collected
        await asyncio.sleep(0.05)
        return unhandled, outcomes

    try:
        unhandled, outcomes = uvloop.run(attempts())
    finally:
        server_loop.call_soon_threadsafe(server_loop.stop)
    assert not unhandled, [(c.get("message"), c.get("exception")) for c in unhandled[:3]]
    assert outcomes["verify failed"] > 50 and outcomes["cancelled"] + outcomes["connect"] > 50, outcomes


def test_grpc_cores_info_lines_stay_off_a_tls_services_log(tmp_path: Path) -> None:
    """gRPC's C core wrote an INFO line ("Handshake failed ...") for every plain-text connection to the TLS port: a
    port scanner could fill the service's log. A user's own GRPC_VERBOSITY still wins."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from leadtime.bench.procs import free_port
    from leadtime.bench.tls import self_signed

    cert, key = self_signed(tmp_path)
    http_port, grpc_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    command = [sys.executable, "-m", "leadtime", "serve", "--port", str(http_port), "--grpc-port", str(grpc_port)]
    command += ["--tls-cert", str(cert), "--tls-key", str(key)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                connection = socket.create_connection(("127.0.0.1", grpc_port), timeout=1)
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, process.communicate()
                time.sleep(0.1)
        for _ in range(3):
            connection.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.2)
            connection.close()
            connection = socket.create_connection(("127.0.0.1", grpc_port), timeout=1)
        connection.close()
        time.sleep(0.5)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert "Handshake failed" not in stderr.decode(), stderr.decode()[-2000:]


def test_a_scrape_of_an_https_endpoint_labelled_plain_says_to_label_it(tmp_path: Path) -> None:
    """vLLM with --ssl-certfile discovered without `leadtime.io/scheme: https`: its scrapes failed with "connection
    closed (by the endpoint)", naming nothing to change."""
    from leadtime.router_plugin.discovery import StaticDiscovery, parse_static
    from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
    from leadtime.router_plugin.heuristics import RoundRobinPolicy

    port, server_loop = serve_tls_in_a_thread(*self_signed(tmp_path))

    async def first_error() -> str:
        gateway = Gateway(StaticDiscovery(parse_static([f"127.0.0.1:{port},name=e-0"])), RoundRobinPolicy(),
                          GatewaySettings())  # fmt: skip
        await gateway.start()
        try:
            for _ in range(250):
                scrape = gateway.scraper.scrapes.get("e-0")
                if scrape is not None and scrape.last_error:
                    return scrape.last_error
                await asyncio.sleep(0.02)
            return ""
        finally:
            await gateway.stop()

    try:
        said = asyncio.run(first_error())
    finally:
        server_loop.call_soon_threadsafe(server_loop.stop)
    assert "if it serves HTTPS, label it leadtime.io/scheme: https" in said, said


def test_a_model_pull_over_the_wrong_scheme_says_which_to_give(service: TlsService) -> None:
    """`serve --model-from http://` to a training server over TLS failed every pull with "Server disconnected
    without sending a response", naming nothing to change."""
    import logging

    from leadtime.predictor.model_pull import ModelPull

    pull = ModelPull(service.url.replace("https://", "http://"), bytes, logging.getLogger("test"), "the prior")
    with pull.client() as client:
        assert pull.pull_once(client)[0] == "error"
    assert "if it serves HTTPS, give its https:// URL" in pull.failure, pull.failure
