"""`leadtime serve --role prediction --model-from URL`: llm-d's two sidecars without a shared volume or Redis.

Real processes: a training server and a prediction server on loopback, the second pulling the first's model
over HTTP (`GET /v1/model`), as llm-d's prediction servers fetch theirs from `TRAINING_SERVER_URL`.
"""

from __future__ import annotations

import hashlib
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_replicas import PROBE, training_entries
from test_service_cli import leadtime
from waiting import wait_for

from leadtime.bench.procs import Child, free_port
from leadtime.bench.tls import self_signed
from leadtime.features.rows import feature_row_from_llmd
from leadtime.predictor.learner import OnlinePredictor
from leadtime.predictor.service.native import etag_matches

SMALL_RETRAINS = {"LEADTIME_RETRAIN_EVERY": "300", "LEADTIME_MIN_RETRAIN_INTERVAL_S": "0"}


def start(workdir: Path, name: str, *args: str, port: int | None = None) -> tuple[Child, str]:
    port = port or free_port()
    child = Child(["serve", "--port", str(port), "--grpc-port", "0", *args], workdir / f"{name}.log", SMALL_RETRAINS)
    url = f"http://127.0.0.1:{port}"
    child.wait_until(f"{url}/readyz")
    return child, url


def get(url: str, path: str) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.get(url + path, timeout=5).json()
    return answer


def predicted(url: str) -> tuple[int, list[float]]:
    """(model version, TTFT and TPOT mean and quantile of one probe row) the prediction server answers."""
    answer = httpx.post(f"{url}/v1/predict", json={"rows": [PROBE]}, timeout=5).json()
    keys = ("ttft_mean_ms", "ttft_quantile_ms", "tpot_mean_ms", "tpot_quantile_ms")
    return int(answer["model_version"]), [answer[k][0] for k in keys]


def training_model(url: str) -> tuple[int, list[float]]:
    """The same of the model the training server serves now (it answers no predictions: its /v1/model, loaded)."""
    model = OnlinePredictor.from_bytes(httpx.get(f"{url}/v1/model", timeout=5).content, background=False)
    try:
        p = model.predict_one(feature_row_from_llmd(PROBE))
        return model.version, [p["ttft_mean"], p["ttft_quantile"], p["tpot_mean"], p["tpot_quantile"]]
    finally:
        model.close()


def same(answer: tuple[int, list[float]], expected: tuple[int, list[float]]) -> bool:
    return answer[0] == expected[0] and answer[1] == pytest.approx(expected[1], rel=1e-9)


def train_until_trees(url: str) -> None:
    """Feed the training server until it serves retrained trees, then until it has learned every row sent."""
    entries = training_entries(6_000, seed=3)
    sent = 0

    def trees() -> bool:
        nonlocal sent
        if sent < len(entries):
            batch = entries[sent : sent + 300]
            assert httpx.post(f"{url}/add_training_data_bulk", json={"entries": batch}, timeout=5).status_code == 202
            sent += len(batch)
        return any(get(url, "/status").get("trees_active", {}).values())

    wait_for(trees, 90, "a retrained model on the training server")

    def all_learned() -> bool:
        ingestion = get(url, "/status")["ingestion"]
        return bool(ingestion["accepted"] == sent and ingestion["pending"] == 0)  # learned, or dropped as invalid

    wait_for(all_learned, 60, "the training server to learn every row sent")


def serving_the_same(training_url: str, url: str) -> tuple[int, list[float]] | None:
    """The training server's model (version, probe predictions), if the prediction server serves it now, with the
    same trees active; None while they differ (a retrain still in flight may replace it, and is pulled in turn)."""
    before = get(training_url, "/status")
    expected = training_model(training_url)
    after = get(training_url, "/status")
    if not before["model_version"] == expected[0] == after["model_version"]:
        return None  # replaced meanwhile: ask again
    status = get(url, "/status")
    if not same(predicted(url), expected) or status["model_version"] != expected[0]:
        return None
    assert status["trees_active"] == after["trees_active"], (status["trees_active"], after["trees_active"])
    return expected


def test_a_prediction_server_serves_the_training_servers_model_pulled_over_http(tmp_path: Path) -> None:
    """llm-d's layout: the prediction server takes every model the training server has, within seconds, and
    answers as it does; before the first pull it serves the prior and says so, and while pulls fail it keeps the
    model it holds, stays ready and names the failure (logged once per cause, not at every pull)."""
    training_port = free_port()
    training_url = f"http://127.0.0.1:{training_port}"
    prediction, url = start(tmp_path, "prediction", "--role", "prediction", "--model-from", training_url)
    training: Child | None = None
    try:
        degraded = get(url, "/readyz")["degraded"]
        assert "no model pulled yet" in degraded["model_pull"] and "prior" in degraded["model_pull"], degraded
        assert httpx.post(f"{url}/predict/bulk/strict", json={"requests": [PROBE]}, timeout=5).status_code == 200

        training, _ = start(tmp_path, "training", "--role", "training", port=training_port)
        train_until_trees(training_url)
        matched: list[tuple[int, list[float]]] = []

        def serves_it() -> bool:
            answer = serving_the_same(training_url, url)
            if answer is not None:
                matched.append(answer)
            return answer is not None

        wait_for(serves_it, 30, "the prediction server to answer as the training server")
        expected = matched[-1]
        assert expected[0] > 0  # retrained: a model the prior is not
        ready = httpx.get(f"{url}/readyz", timeout=5)
        assert ready.status_code == 200 and "model_pull" not in ready.json()["degraded"], ready.json()
        status = get(url, "/status")
        assert status["last_model_load"] is not None
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        swaps = [line for line in metrics.splitlines() if line.startswith("leadtime_model_swaps_total ")]
        assert swaps and float(swaps[0].split()[1]) >= 1, swaps  # swapped in as a shared registry's model is

        last = training_model(training_url)  # the newest the prediction server can have pulled before the kill
        training.kill()
        training = None
        wait_for(lambda: "model_pull" in get(url, "/readyz")["degraded"], 10, "the failing pull named in /readyz")
        ready = httpx.get(f"{url}/readyz", timeout=5)
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        assert "failing" in ready.json()["degraded"]["model_pull"], ready.json()
        held = predicted(url)  # the model held keeps serving: the training server's (a retrain in flight may
        assert same(held, expected) or same(held, last), (held, expected, last)  # have been pulled since the match)
    finally:
        if training is not None:
            training.stop()
        prediction.stop()
    log = prediction.output()
    failed = [line for line in log.splitlines() if "pulling the model from" in line and "failed" in line]
    assert 1 <= len(failed) <= 4, log  # once per cause, not once a second
    assert "Traceback" not in log and "HTTP Request" not in log, log  # nor a line per pull from httpx
    assert "the first model pulled from" in log


def test_model_from_is_refused_at_start_in_one_line_when_it_cannot_work(tmp_path: Path) -> None:
    for args, words in [
        (["--role", "prediction", "--model-from", "127.0.0.1:8000"], "--model-from (LEADTIME_MODEL_FROM): "),
        (["--role", "prediction", "--model-from", "http://127.0.0.1:99999"], "--model-from (LEADTIME_MODEL_FROM): "),
        (["--role", "prediction", "--model-from", "ftp://trainer:8000"], "--model-from (LEADTIME_MODEL_FROM): "),
        (["--role", "prediction", "--model-from", "http://:8000"], "--model-from (LEADTIME_MODEL_FROM): "),
        (["--model-from", "http://127.0.0.1:8000"], "--model-from is for --role prediction"),
        (["--role", "training", "--model-from", "http://127.0.0.1:8000"], "--model-from is for --role prediction"),
        (
            ["--role", "prediction", "--model-from", "http://127.0.0.1:8000", "--redis", "redis://127.0.0.1:1/0"],
            "--model-from or --redis",
        ),
        (
            ["--role", "prediction", "--model-from", "http://127.0.0.1:8000", "--model-dir", str(tmp_path)],
            "--model-from or --model-dir",
        ),
    ]:
        process = leadtime("serve", "--port", "0", "--grpc-port", "0", *args)
        _, err = process.communicate(timeout=60)
        message = err.decode().strip()
        assert process.returncode == 2, message
        assert words in message and "Traceback" not in message, (words, message)
        assert len(message.splitlines()) == 1, message
    for url, ca_file, words in [
        ("https://127.0.0.1:8000", "/nonexistent/ca.pem", "LEADTIME_MODEL_FROM_CA_FILE: CA file '/nonexistent/ca.pem'"),
        ("http://127.0.0.1:8000", __file__, "a CA file is for a service over TLS"),
    ]:
        args = ["--role", "prediction", "--model-from", url]
        env = {"LEADTIME_MODEL_FROM_CA_FILE": ca_file}
        process = leadtime("serve", "--port", "0", "--grpc-port", "0", *args, env=env)
        _, err = process.communicate(timeout=60)
        message = err.decode().strip()
        assert process.returncode == 2, message
        assert words in message and "Traceback" not in message, (words, message)
        assert len(message.splitlines()) == 1, message


class ModelSource:
    """A server answering GET /v1/model with `artifact` (settable), as a training server would, on a free port."""

    def __init__(self, artifact: bytes | None) -> None:
        self.artifact = artifact
        source = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = source.artifact
                if body is None:  # the source down, as far as a pull can tell
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                etag = f'"{hashlib.sha256(body).hexdigest()}"'
                if etag_matches(self.headers.get("If-None-Match", ""), etag):  # a list, as the service reads it
                    self.send_response(304)
                    self.send_header("ETag", etag)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_pulled_model_is_checked_as_a_model_dir_one_and_a_refused_one_leaves_the_held_model() -> None:
    """An artifact that does not match its checksum, or that takes rows naming no class as another class than
    --accelerator says, is refused: the model held keeps serving, /readyz names why. With no class named, the
    training server's is followed (as a model directory's is at start)."""
    from fastapi.testclient import TestClient

    from leadtime.predictor.learner import LearnerConfig
    from leadtime.predictor.service.app import create_app
    from leadtime.predictor.settings import ServiceSettings

    h200 = OnlinePredictor(LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False))
    h200.version = 7
    source = ModelSource(h200.to_bytes())
    try:
        named = ServiceSettings(role="prediction", model_from=source.url, accelerator="h100-sxm")
        with TestClient(create_app(named)) as c:
            wait_for(lambda: "refused" in c.get("/readyz").json()["degraded"].get("model_pull", ""), 10, "refusal")
            ready = c.get("/readyz")
            assert ready.status_code == 200, ready.json()
            assert "as h200-sxm serving qwen3-32b" in ready.json()["degraded"]["model_pull"], ready.json()
            assert c.get("/status").json()["model_version"] == 0  # the prior, still

        with TestClient(create_app(ServiceSettings(role="prediction", model_from=source.url))) as c:
            wait_for(lambda: c.get("/status").json()["model_version"] == 7, 10, "the pulled model serving")
            assert "model_pull" not in c.get("/readyz").json()["degraded"]
            row = {**PROBE}  # names no class: taken as the pulled model's, H200 serving Qwen3-32B
            answer = c.post("/v1/predict", json={"rows": [row]}).json()
            assert answer["ttft_mean_ms"][0] == pytest.approx(
                h200.predict_one(feature_row_from_llmd({**row, "accelerator": "h200-sxm", "model": "qwen3-32b"}))[
                    "ttft_mean"
                ],
                rel=1e-9,
            )
            altered = bytearray(h200.to_bytes())
            altered[altered.index(b'"version":7') + 10] = ord("8")
            source.artifact = bytes(altered)
            wait_for(lambda: "checksum" in c.get("/readyz").json()["degraded"].get("model_pull", ""), 10, "refusal")
            assert c.get("/status").json()["model_version"] == 7  # the model held
    finally:
        source.close()
        h200.close()


def test_a_training_server_over_tls_is_pulled_from_with_its_certificate_verified(tmp_path: Path) -> None:
    """https://: the training server's certificate is verified (a private CA named by LEADTIME_MODEL_FROM_CA_FILE);
    one it cannot verify is a failing pull named in /readyz, and the prior serves."""
    cert, key = self_signed(tmp_path)
    port = free_port()
    training = Child(
        ["serve", "--port", str(port), "--grpc-port", "0", "--role", "training", "--tls-cert", str(cert)]
        + ["--tls-key", str(key)],
        tmp_path / "training.log",
    )
    servers = [training]
    try:
        training.wait_until(f"https://127.0.0.1:{port}/readyz", verify=ssl.create_default_context(cafile=str(cert)))
        source = f"https://127.0.0.1:{port}"

        def prediction_server(name: str, env: dict[str, str]) -> str:
            http = free_port()
            args = ["serve", "--port", str(http), "--grpc-port", "0", "--role", "prediction", "--model-from", source]
            servers.append(Child(args, tmp_path / f"{name}.log", env))
            servers[-1].wait_until(f"http://127.0.0.1:{http}/readyz")
            return f"http://127.0.0.1:{http}"

        trusting = prediction_server("trusting", {"LEADTIME_MODEL_FROM_CA_FILE": str(cert)})
        wait_for(lambda: "model_pull" not in get(trusting, "/readyz")["degraded"], 10, "a pull over TLS")
        untrusting = prediction_server("system-cas", {})
        wait_for(lambda: "failing" in get(untrusting, "/readyz")["degraded"].get("model_pull", ""), 10, "refusal")
        assert "CERTIFICATE_VERIFY_FAILED" in get(untrusting, "/readyz")["degraded"]["model_pull"]
    finally:
        for server in servers:
            server.stop()


def test_a_pulled_models_class_of_rows_naming_none_is_taken_with_the_model_not_before_it() -> None:
    """The pull thread switched the class taken for rows naming none as it checked a pulled model, before the
    model sync installed it: meanwhile requests were parsed as the new class and predicted by the old model. The
    switch is now made where the model is installed, by the one function a model loaded at start uses, after the
    model is in place (requests read the parser, then the model: none sees the new class with the old model)."""
    from leadtime.predictor.learner import LearnerConfig
    from leadtime.predictor.service.runtime import ServiceRuntime
    from leadtime.predictor.settings import ServiceSettings
    from leadtime.predictor.store.memory import MemoryStore

    class Learner:  # no process: what the runtime tells its learner is not looked at here
        def adopt(self, artifact: bytes, cursor: str, epoch: int) -> bool:
            return True

    h200 = OnlinePredictor(LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False))
    h200.version = 7
    runtime = ServiceRuntime(ServiceSettings(role="prediction", model_from="http://127.0.0.1:9"), MemoryStore())
    runtime.learner = Learner()  # type: ignore[assignment]
    prior = OnlinePredictor(runtime._learner_config())
    runtime._install(prior)
    switches: list[tuple[str, bool]] = []
    take = runtime._take_default_class

    def spied(predictor: OnlinePredictor) -> None:
        switches.append((predictor.config.accelerator, runtime.predictor is predictor))
        take(predictor)

    runtime._take_default_class = spied  # type: ignore[method-assign]
    try:
        checked = runtime._check_pulled(h200.to_bytes())  # the pull thread's part
        assert (runtime.settings.accelerator, runtime.predictor) == ("h100-sxm", prior)  # nothing switched yet
        runtime.store.publish_model(checked)
        assert runtime.sync_from_store() == (True, True)  # the model sync's part: the install
        served = runtime.predictor
        assert served is not None and served.version == 7
        assert (runtime.settings.accelerator, runtime.settings.model) == ("h200-sxm", "qwen3-32b")
        assert switches == [("h200-sxm", True)]  # by the one function, once the model serves
        row = {**PROBE}  # names no class: now H200 serving Qwen3-32B
        expected = h200.predict_one(feature_row_from_llmd({**row, "accelerator": "h200-sxm", "model": "qwen3-32b"}))
        assert served.predict_many(runtime.parser.parse([row], "rows")).ttft_mean[0] == pytest.approx(
            expected["ttft_mean"], rel=1e-9
        )
    finally:
        if runtime.predictor is not None:
            runtime.predictor.close()
        h200.close()


def test_reload_on_a_prediction_server_pulls_at_once_and_says_what_the_pull_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`POST /reload` with --model-from swapped in only what the pull thread had already published to the
    process's own store, answering `"loaded": false` while the training server had a newer model: it did not ask
    the training server. It pulls now, and answers as for a registry: 200 with the model taken (or none newer),
    409 naming why the model pulled was refused, 503 naming why the source could not be pulled from."""
    from fastapi.testclient import TestClient

    from leadtime.predictor.learner import LearnerConfig
    from leadtime.predictor.service import runtime as runtime_module
    from leadtime.predictor.service.app import create_app
    from leadtime.predictor.settings import ServiceSettings

    monkeypatch.setattr(runtime_module, "_PULL_INTERVAL_S", 3600.0)  # the first pull only: the rest is /reload's
    models = []
    for version in (7, 8):
        model = OnlinePredictor(LearnerConfig(background=False))
        model.version = version
        models.append(model.to_bytes())
        model.close()
    source = ModelSource(models[0])
    try:
        with TestClient(create_app(ServiceSettings(role="prediction", model_from=source.url))) as c:
            wait_for(lambda: c.get("/status").json()["model_version"] == 7, 10, "the first pull")
            source.artifact = models[1]
            answer = c.post("/reload")
            assert answer.status_code == 200, answer.text
            assert answer.json()["pulled"] == "new" and answer.json()["loaded"] is True, answer.json()
            assert answer.json()["model_version"] == 8 and c.get("/status").json()["model_version"] == 8
            answer = c.post("/reload")
            assert answer.json()["pulled"] == "unchanged" and answer.json()["loaded"] is False, answer.json()

            source.artifact = b'{"format": "leadtime-predictor", "artifact_version": 999}'
            answer = c.post("/reload")
            assert answer.status_code == 409 and "artifact version 999" in answer.json()["detail"], answer.text
            source.artifact = None
            answer = c.post("/reload")
            assert answer.status_code == 503 and "answered 503" in answer.json()["detail"], answer.text
            assert c.get("/status").json()["model_version"] == 8  # the model held
    finally:
        source.close()


def test_every_pull_and_what_it_did_is_counted_in_the_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prediction server's pulls were in no metric (the gateway counts its own): an alert on failing or refused
    pulls had only /readyz to go by. Each result is exported from the start, at 0."""
    from fastapi.testclient import TestClient

    from leadtime.predictor.model_pull import PULL_RESULTS
    from leadtime.predictor.service import runtime as runtime_module
    from leadtime.predictor.service.app import create_app
    from leadtime.predictor.settings import ServiceSettings

    def pulls(text: str) -> dict[str, float]:
        prefix = "leadtime_model_pulls_total{result="
        lines = [line.removeprefix(prefix).split("} ") for line in text.splitlines() if line.startswith(prefix)]
        return {result.strip('"'): float(value) for result, value in lines}

    with TestClient(create_app(ServiceSettings())) as c:
        assert pulls(c.get("/metrics").text) == dict.fromkeys(PULL_RESULTS, 0.0)
    monkeypatch.setattr(runtime_module, "_PULL_INTERVAL_S", 3600.0)  # the first pull only: the rest is /reload's
    source = ModelSource(OnlinePredictor().to_bytes())
    try:
        with TestClient(create_app(ServiceSettings(role="prediction", model_from=source.url))) as c:
            wait_for(lambda: pulls(c.get("/metrics").text)["new"] == 1, 10, "the first pull counted")
            c.post("/reload")
            source.artifact = b"not an artifact"
            c.post("/reload")
            c.post("/reload")  # the same artifact: refused again, not downloaded again
            source.artifact = None
            c.post("/reload")
            assert pulls(c.get("/metrics").text) == {"new": 1, "unchanged": 1, "refused": 2, "error": 1}
    finally:
        source.close()


def test_the_pull_loop_survives_an_unexpected_error(caplog: pytest.LogCaptureFixture) -> None:
    """An exception out of a pull ended the pull thread: the prediction server kept its model for good."""
    from fastapi.testclient import TestClient

    from leadtime.predictor.service.app import create_app
    from leadtime.predictor.settings import ServiceSettings

    with TestClient(create_app(ServiceSettings(role="prediction", model_from="http://127.0.0.1:9"))) as c:
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        pulls = {"n": 0}
        real = runtime._pull_model

        def failing(client: Any) -> Any:
            pulls["n"] += 1
            if pulls["n"] <= 2:
                raise RuntimeError("a bug in a pull")
            return real(client)

        runtime._pull_model = failing
        wait_for(lambda: pulls["n"] > 3, timeout_s=15)
        assert all(thread.is_alive() for thread in runtime._threads)
        assert "model_pull_loop" not in runtime.health()
    assert len([r for r in caplog.records if r.exc_info and "a bug in a pull" in str(r.exc_info[1])]) == 1
