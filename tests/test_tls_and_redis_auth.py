"""Transport security with real processes: `leadtime serve` over TLS (HTTPS and gRPC) from certificate files,
and Redis reached with a password over TLS (`rediss://:password@host`), against a real redis-server started
with `--requirepass` and `--tls-port` (Debian's build has TLS). The certificates are made at test time."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import require_redis_server
from llmd_rows import llmd_row
from redis_server import RedisServer, free_port

from leadtime.bench.procs import Child
from leadtime.bench.tls import self_signed
from leadtime.predictor.grpc import leadtime_pb2 as pb
from leadtime.predictor.grpc import leadtime_pb2_grpc as pb_grpc
from leadtime.predictor.store.redis_store import RedisStore

PASSWORD = "s3cret-p4ss"
TOKEN = "write-token"
ROW = llmd_row()


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    return self_signed(tmp_path)


@pytest.fixture
def secure_redis(tmp_path: Path, certificate: tuple[Path, Path]) -> Iterator[tuple[RedisServer, str]]:
    """redis-server with a password, listening only over TLS; and the rediss:// URL that reaches it."""
    cert, key = certificate
    server = RedisServer(
        require_redis_server(),
        tmp_path,
        extra_args=["--requirepass", PASSWORD, "--tls-port", "PORT", "--port", "0"],
        client_options={"password": PASSWORD, "ssl": True, "ssl_ca_certs": str(cert)},
    )
    server.extra_args[3] = str(server.port)  # the TLS port is the server's port; plain TCP is off (--port 0)
    server.extra_args += ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-auth-clients", "no"]
    server.extra_args += ["--tls-ca-cert-file", str(cert)]
    try:
        server.start()
    except RuntimeError as err:
        pytest.fail(f"redis-server with --tls-port did not start (built without TLS?): {err}")
    try:
        yield server, f"rediss://:{PASSWORD}@127.0.0.1:{server.port}/0?ssl_ca_certs={cert}"
    finally:
        server.stop()


def test_serve_over_tls_with_redis_behind_a_password_and_tls(
    tmp_path: Path, certificate: tuple[Path, Path], secure_redis: tuple[RedisServer, str]
) -> None:
    cert, key = certificate
    _, redis_url = secure_redis
    port, grpc_port = free_port(), free_port()
    args = ["serve", "--port", str(port), "--grpc-port", str(grpc_port), "--api-token", TOKEN]
    args += ["--tls-cert", str(cert), "--tls-key", str(key), "--redis", redis_url]
    child = Child(args, tmp_path / "serve.log")
    context = ssl.create_default_context(cafile=str(cert))
    try:
        child.wait_until(f"https://127.0.0.1:{port}/readyz", verify=context)
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=context, timeout=10) as client:
            answer = client.post("/predict/bulk/strict", json={"requests": [ROW]})
            assert answer.status_code == 200 and answer.json()["predictions"][0]["ttft_ms"] > 0
            entries = {"entries": [{**ROW, "actual_ttft_ms": 150.0, "actual_tpot_ms": 25.0}] * 5}
            assert client.post("/add_training_data_bulk", json=entries).status_code == 401  # no token
            authorized = {"Authorization": f"Bearer {TOKEN}"}
            assert client.post("/add_training_data_bulk", json=entries, headers=authorized).status_code == 202
            assert client.get("/readyz").json()["status"] == "ready"  # Redis reached: nothing degraded
            assert "redis" not in client.get("/readyz").json().get("degraded", {})
        # The observations went through Redis (TLS, password): another client reads them back.
        store = RedisStore(redis_url)
        try:
            deadline = time.monotonic() + 10
            while not store.read_observations("0", 100)[1] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(store.read_observations("0", 100)[1]) == 5
        finally:
            store.close()
        # Plain HTTP to the TLS port is not served.
        try:
            plain = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
            assert plain.status_code != 200, plain.text
        except httpx.TransportError:
            pass  # the TLS handshake fails: what is expected
        # gRPC over TLS with the certificate as the root; a plain channel gets nothing.
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
            status = pb_grpc.PredictorStub(channel).Status(pb.StatusRequest(), timeout=10)
            assert status.is_ready
            answer = pb_grpc.PredictorStub(channel).PredictBulk(pb.PredictBulkRequest(rows=[pb.Row(**ROW)]), timeout=10)
            assert answer.ttft_mean_ms[0] > 0
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.PredictorStub(channel).Status(pb.StatusRequest(), timeout=3)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        # The log names the store without its password.
        assert f"Redis at rediss://127.0.0.1:{secure_redis[0].port}/0" in child.output()
        assert PASSWORD not in child.output()
    finally:
        child.stop()


def test_a_wrong_redis_password_is_refused_at_start_and_no_tls_is_named_not_fatal(
    secure_redis: tuple[RedisServer, str],
) -> None:
    """A wrong password is a configuration error no retry heals: refused at start. A TLS port spoken to in plain
    text answers nothing a client can read as a refusal: ridden out as an outage, and named."""
    _, good = secure_redis
    with pytest.raises(ValueError, match="Redis refused the password") as refused:
        RedisStore(good.replace(PASSWORD, "wrong"), socket_timeout_s=0.5)
    assert ":wrong@" not in str(refused.value) and PASSWORD not in str(refused.value)
    store = RedisStore(good.replace("rediss://", "redis://").split("?")[0], socket_timeout_s=0.5)
    try:
        store.append_observations([{"x": 1}])  # accepted into the outage buffer, never lost silently
        problem = store.health()["redis"].lower()
        assert any(word in problem for word in ("connection", "closed", "reset", "timeout")), problem
        assert store.stats()["buffered"] == 1
    finally:
        store.close()


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A plain-TCP redis-server that needs PASSWORD."""
    server = RedisServer(
        require_redis_server(), tmp_path, extra_args=["--requirepass", PASSWORD], client_options={"password": PASSWORD}
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("userinfo", "database", "named"),
    [
        (":wrong@", 0, "Redis refused the password"),
        ("", 0, "Redis needs a password"),
        (f":{PASSWORD}@", 16, "Redis has no database 16"),
    ],
    ids=["wrong password", "no password", "no such database"],
)
@pytest.mark.parametrize("command", ["serve", "route"])
def test_a_redis_that_refuses_the_url_stops_serve_and_route_at_start_in_one_line(
    password_redis: RedisServer, command: str, userinfo: str, database: int, named: str
) -> None:
    """Regression: `serve --redis` with a wrong or missing password, or a database index Redis lacks, ran and
    answered 202 for rows it could never store (they waited in memory, then were dropped); `route --replicas-redis`
    shared nothing. These are permanent configuration errors, not outages: one line, exit 2, no traceback."""
    url = f"redis://{userinfo}127.0.0.1:{password_redis.port}/{database}"
    if command == "serve":
        args = ["serve", "--port", str(free_port()), "--grpc-port", "0", "--redis", url]
    else:
        args = ["route", "--endpoint", "127.0.0.1:9", "--port", str(free_port()), "--policy", "round-robin"]
        args += ["--replicas-redis", url]
    done = subprocess.run([sys.executable, "-m", "leadtime", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and named in errors[0], done.stderr
    assert f"redis://127.0.0.1:{password_redis.port}/{database}" in errors[0], errors[0]
    assert "Traceback" not in done.stderr and "wrong" not in done.stderr and PASSWORD not in done.stderr
    assert "buffering" not in done.stderr, done.stderr  # not also logged as an outage first


def test_tls_needs_both_files_and_they_must_exist(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    for args, message in (
        (["--tls-cert", str(cert)], "give both"),
        (["--tls-cert", str(cert), "--tls-key", str(tmp_path / "missing.pem")], "does not exist"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "leadtime", "serve", "--port", "0", "--grpc-port", "0", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
