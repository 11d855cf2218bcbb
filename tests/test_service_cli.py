"""`leadtime serve`: one process, HTTP + gRPC + metrics on an embedded store; bad options exit 2 in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from leadtime.bench.procs import free_port
from leadtime.predictor.client import GrpcPredictorClient

ROOT = Path(__file__).resolve().parents[1]


ROW = {
    "kv_cache_percentage": 0.1,
    "input_token_length": 64,
    "num_request_waiting": 0,
    "num_request_running": 0,
    "num_tokens_generated": 0,
    "prefix_cache_score": 0.0,
}


def leadtime(*args: str, env: dict[str, str] | None = None, new_session: bool = False) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LEADTIME_")}
    return subprocess.Popen(
        [sys.executable, "-m", "leadtime", *args],
        cwd=ROOT,
        env={**base, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=new_session,  # its own process group, as a terminal gives it
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
        assert httpx.post(f"{base}/predict/bulk/strict", json={"requests": [ROW]}).status_code == 200
        assert "leadtime_http_requests_total" in httpx.get(f"{base}/metrics").text
        with GrpcPredictorClient(f"127.0.0.1:{grpc_port}", deadline_s=5) as g:
            assert g.status()["is_ready"] is True
    finally:
        process.terminate()
        process.wait(timeout=20)
    log = process.stderr.read().decode() if process.stderr else ""
    assert f"gRPC on 127.0.0.1:{grpc_port}" in log
    assert f"HTTP on http://127.0.0.1:{http_port}" in log
    assert "store: in memory" in log


def test_a_prediction_server_on_a_model_dir_logs_what_it_keeps_and_what_is_open(tmp_path: Path) -> None:
    """A `--role prediction` server warned that anyone could send it training data (it answers those paths 404),
    and said its models go when it stops while `--model-dir` keeps them."""
    log = start_up_log(free_port(), "--role", "prediction", "--model-dir", str(tmp_path))
    assert "no API token" not in log, log
    assert f"store: in memory (this process only: observations go when it stops; models are kept in {tmp_path})" in log


def test_serve_with_allowed_hosts_says_which_and_refuses_another_host_over_a_real_socket() -> None:
    """The readiness probe (Host 127.0.0.1:PORT, not listed) passes; a request naming another host is 400."""
    port = free_port()
    process = leadtime("serve", "--port", str(port), "--grpc-port", "0", "--allowed-host", "leadtime.svc")
    try:
        wait_ready(port, process)
        base = f"http://127.0.0.1:{port}"
        refused = httpx.get(f"{base}/status", headers={"Host": "evil.example"})
        assert refused.status_code == 400 and refused.json()["field"] == "host", refused.text
        assert httpx.get(f"{base}/status").status_code == 400  # 127.0.0.1 is not listed either
        assert httpx.get(f"{base}/status", headers={"Host": f"leadtime.svc:{port}"}).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=20)
    log = process.stderr.read().decode() if process.stderr else ""
    assert "HTTP answers only the Host leadtime.svc (--allowed-host; /healthz, /readyz and /metrics any)" in log, log


def start_up_log(http_port: int, *args: str) -> str:
    """What `leadtime serve --port http_port --grpc-port 0 ARGS` logs until it is ready and stopped."""
    process = leadtime("serve", "--port", str(http_port), "--grpc-port", "0", *args)
    try:
        wait_ready(http_port, process)
    finally:
        process.terminate()
        process.wait(timeout=20)
    return process.stderr.read().decode() if process.stderr else ""


def wait_ready(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
    raise AssertionError("the service did not become ready")


def learner_pid(server: int) -> int:
    """The learner process among the server's children (the other one is multiprocessing's resource tracker)."""
    for task in Path(f"/proc/{server}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError("no learner process")


@pytest.mark.usefixtures("ctrl_c_as_a_terminal_gives_it")
def test_ctrl_c_stops_the_service_quietly() -> None:
    # Regression: Ctrl-C reaches the whole process group; when the learner process got it first it died, and
    # the service logged "learner process exited unexpectedly" (and began restarting it) on its way out.
    http_port = free_port()
    process = leadtime("serve", "--port", str(http_port), "--grpc-port", "0", new_session=True)
    try:
        wait_ready(http_port, process)
        base = f"http://127.0.0.1:{http_port}"
        entry = {**ROW, "actual_ttft_ms": 50.0, "actual_tpot_ms": 5.0}
        assert httpx.post(f"{base}/add_training_data_bulk", json={"entries": [entry]}).status_code == 202
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/status").json().get("observations", {}).get("ttft", 0) < 1:  # the learner runs
            assert time.monotonic() < deadline
            time.sleep(0.1)
        learner = learner_pid(process.pid)
        os.kill(learner, signal.SIGINT)  # the learner's share of a Ctrl-C, delivered first
        time.sleep(1.0)
        assert learner_pid(process.pid) == learner  # it ignored it
        os.killpg(process.pid, signal.SIGINT)  # the Ctrl-C itself, to everyone
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    log = err.decode()
    assert "exited unexpectedly" not in log and "Traceback" not in log, log
    assert log.rstrip().endswith("stopped"), log


def test_a_taken_port_stops_serve_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args in (["--port", str(free_port()), "--grpc-port", port], ["--port", port, "--grpc-port", "0"]):
            process = leadtime("serve", *args)
            _, err = process.communicate(timeout=60)
            message = err.decode().strip()
            assert process.returncode == 2, message
            assert f"127.0.0.1:{port}" in message and "Traceback" not in message, message
            assert len(message.splitlines()) == 1, message


def test_bad_options_exit_2_with_one_line() -> None:
    for args, env, words in [
        (["serve", "--role", "both"], {}, "role"),
        (["serve", "--accelerator", "abacus"], {}, "abacus"),
        (["serve"], {"LEADTIME_QUANTILE": "2"}, "quantile"),
        (["serve", "--redis", "http://x"], {}, "--redis (LEADTIME_REDIS_URL): "),
        (["serve", "--port", "99999"], {}, "--port (LEADTIME_PORT): "),
        (["serve", "--tls-cert", __file__], {}, "--tls-cert and --tls-key go together"),
        (["serve"], {"LEADTIME_MAX_BODY_BYTES": "-1"}, "LEADTIME_MAX_BODY_BYTES: "),
        (["serve"], {"LEADTIME_WINDOW": "200"}, "LEADTIME_WINDOW: "),
        # gRPC takes the body limit as a C int: one beyond it was a 90-line traceback.
        (["serve"], {"LEADTIME_MAX_BODY_BYTES": str(2**31)}, "LEADTIME_MAX_BODY_BYTES: "),
        # Expanded CPU by CPU before it was compared with the usable ones: the start hung.
        (["serve"], {"LEADTIME_LEARNER_CPUS": "0-99999999999"}, "LEADTIME_LEARNER_CPUS: "),
        (["serve"], {"LEADTIME_LEARNER_CPUS": "1-0"}, "LEADTIME_LEARNER_CPUS: '1-0' is an empty range"),
        # Alone, a prediction server never sees a trained model: it served the prior forever without a word.
        (["serve", "--role", "prediction"], {}, "--role prediction needs --model-from"),
    ]:
        process = leadtime(*args, env=env)
        _, err = process.communicate(timeout=60)
        message = err.decode().strip()
        assert process.returncode == 2, message
        assert words in message and "Traceback" not in message
        assert len(message.splitlines()) == 1


def test_serve_refuses_a_class_that_disagrees_with_the_saved_model(tmp_path: Path) -> None:
    """As `leadtime retrain` refuses it for its registry: the model learned rows naming no class as H200s."""
    from leadtime.predictor.artifact import save_file
    from leadtime.predictor.learner import LearnerConfig, OnlinePredictor

    saved = OnlinePredictor(LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False))
    save_file(tmp_path, saved.to_bytes())
    process = leadtime("serve", "--model-dir", str(tmp_path), "--accelerator", "l40s", "--port", "0")
    _, err = process.communicate(timeout=60)
    message = err.decode().strip()
    assert process.returncode == 2 and len(message.splitlines()) == 1, message
    assert "--accelerator l40s disagrees with the model in" in message and "as h200-sxm" in message


def test_a_training_server_that_keeps_no_model_says_so_at_start(tmp_path: Path) -> None:
    """Without --redis or --model-dir a training server's model dies with it, and every prediction server pulling
    it (--model-from) goes back to the prior when it restarts: said once, at start."""
    log = start_up_log(free_port(), "--role", "training")
    assert "--role training without --redis or --model-dir: its model is lost when it stops" in log, log
