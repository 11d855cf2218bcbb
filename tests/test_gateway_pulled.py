"""`leadtime route --pull-model`: the gateway predicts with a copy of the service's model and sends the service
every observation. Every part a real process on loopback: `leadtime sim serve`, `leadtime serve`, `leadtime
route`; the service is killed, or started late, to see what the gateway does without it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from threaded_server import serve_in_a_thread
from waiting import wait_for

from leadtime.bench.procs import Child, Predictor, Route, SimFleet, free_port
from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
from leadtime.predictor.client import PredictorError, PredictorUnavailable, row_dict
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.service.native import etag_matches
from leadtime.router_plugin.gateway.metrics import DISCOVERY_RESULTS, PULL_RESULTS, GatewayMetrics
from leadtime.router_plugin.gateway.predictor import GatewayPredictor
from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient
from leadtime.router_plugin.gateway.pulled import PulledModel

FLEET = {
    "name": "two-classes",
    "pools": [
        {"name": "h100", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
        {"name": "l40s", "count": 1, "accelerator": "l40s", "model": "llama-3.1-8b"},
    ],
}
PULL = ["--pull-model", "--pull-interval-s", "0.2"]


def stream(url: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        response.read()
    return response


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pulled")


@pytest.fixture(scope="module")
def fleet(workdir: Path) -> Iterator[SimFleet]:
    fleet_file = workdir / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEET))
    fleet = SimFleet(fleet_file, workdir)
    try:
        yield fleet
    finally:
        fleet.stop()


def test_the_served_model_predicts_what_the_service_predicts(workdir: Path) -> None:
    """GET /v1/model is the serving model: loaded elsewhere it predicts the service's numbers; its ETag is the
    artifact's SHA-256, and asking with it gets 304."""
    predictor = Predictor(workdir).wait()
    try:
        reply = httpx.get(f"{predictor.url}/v1/model", timeout=10)
        assert reply.status_code == 200
        import hashlib

        assert reply.headers["etag"] == f'"{hashlib.sha256(reply.content).hexdigest()}"'
        again = httpx.get(f"{predictor.url}/v1/model", headers={"If-None-Match": reply.headers["etag"]}, timeout=10)
        assert again.status_code == 304 and not again.content
        model = OnlinePredictor.from_bytes(reply.content, background=False)
        rows = [
            FeatureRow(RequestFeatures(n), EndpointState(endpoint_id="e", accelerator=a, model="llama-3.1-8b"))
            for n, a in [(100, "h100-sxm"), (2000, "l40s"), (800, "a100-sxm-80gb")]
        ]
        here = model.predict_many(rows)
        there = httpx.post(f"{predictor.url}/v1/predict", json={"rows": [row_dict(r) for r in rows]}, timeout=10)
        served = there.json()
        np.testing.assert_allclose(here.ttft_mean, served["ttft_mean_ms"], rtol=1e-9)
        np.testing.assert_allclose(here.tpot_quantile, served["tpot_quantile_ms"], rtol=1e-9)
    finally:
        predictor.child.stop()


def test_routes_with_the_pulled_model_and_the_service_learns_every_observation(workdir: Path, fleet: SimFleet) -> None:
    """Then the service is killed: the gateway keeps predicting with the model it holds (no fallback), and its
    pulls are counted as failing while the model's age grows."""
    predictor = Predictor(workdir).wait()
    route = Route(workdir, ["--discovery", str(fleet.endpoints_file), "--predictor-url", predictor.url, *PULL])
    try:
        route.wait()
        assert route.metric("leadtime_router_model_pulls_total", result="new") >= 1
        before = httpx.get(f"{predictor.url}/v1/status", timeout=5).json()["learned"]
        for i in range(8):
            response = stream(route.url, f"pulled question {i} " * 20)
            assert response.status_code == 200 and response.headers["x-leadtime-endpoint"] in {"h100-0", "l40s-0"}
        assert route.metric("leadtime_router_fallbacks_total") == 0
        assert route.metric("leadtime_router_ttft_seconds_count", kind="predicted") >= 8

        def learned() -> bool:
            now = httpx.get(f"{predictor.url}/v1/status", timeout=5).json()["learned"]
            return bool(now["ttft"] >= before["ttft"] + 8 and now["tpot"] >= before["tpot"] + 8)

        wait_for(learned, timeout_s=60)  # the learner runs at nice 10: on a busy machine it waits its turn
        wait_for(lambda: route.metric("leadtime_router_model_pulls_total", result="unchanged") >= 1, timeout_s=20)
        log = route.child.output()
        assert f"routing on {route.url}: 2 endpoints from {fleet.endpoints_file}" in log  # where it listens
        assert "/v1/model" not in log  # not a line per pull

        predictor.child.kill()
        wait_for(lambda: route.metric("leadtime_router_model_pulls_total", result="error") >= 2, timeout_s=20)
        for i in range(6):
            assert stream(route.url, f"service gone {i} " * 20).status_code == 200
        assert route.metric("leadtime_router_fallbacks_total") == 0  # the last model still predicts
        assert route.metric("leadtime_router_pulled_model_age_seconds") > 0.2
        assert route.metric("leadtime_router_requests_total", code="200") == 14
        ready = httpx.get(f"{route.url}/readyz", timeout=5)  # still routing on the model held, and saying so
        assert ready.status_code == 200 and "s old" in ready.json()["degraded"]["model_pull"], ready.text
    finally:
        route.child.stop()
        predictor.child.stop()


def test_without_a_service_it_falls_back_then_pulls_once_the_service_is_up(workdir: Path, fleet: SimFleet) -> None:
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    route = Route(workdir, ["--discovery", str(fleet.endpoints_file), "--predictor-url", url, *PULL])
    service: Child | None = None
    try:
        route.wait()  # ready: the warm-up found no model and said so
        for i in range(4):
            assert stream(route.url, f"no service yet {i} " * 10).status_code == 200
        assert route.metric("leadtime_router_fallbacks_total") == 4
        assert route.metric("leadtime_router_pulled_model_age_seconds") == -1
        service = Child(["serve", "--port", str(port), "--grpc-port", str(grpc_port)], workdir / "late-serve.log")
        service.wait_until(f"{url}/readyz")
        wait_for(lambda: route.metric("leadtime_router_model_pulls_total", result="new") >= 1, timeout_s=20)
        time.sleep(1.2)  # the breaker (open for a second after three failures) has closed
        before = route.metric("leadtime_router_fallbacks_total")
        for i in range(4):
            assert stream(route.url, f"service up {i} " * 10).status_code == 200
        assert route.metric("leadtime_router_fallbacks_total") == before
    finally:
        route.child.stop()
        if service is not None:
            service.stop()


def test_pull_model_needs_the_services_http_url() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "leadtime", "route", "--endpoint", "127.0.0.1:9", "--pull-model"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--predictor-url" in done.stderr + done.stdout


Answer = Callable[[httpx.Request], httpx.Response]


def served(artifact: bytes, etag: str | None = None) -> Answer:
    """The service answering GET /v1/model with `artifact`, announced by `etag` (default: its SHA-256)."""
    digest = hashlib.sha256(artifact).hexdigest()

    def answer(request: httpx.Request) -> httpx.Response:
        headers = {"etag": f'"{etag or digest}"'}
        if etag_matches(request.headers.get("if-none-match", ""), headers["etag"]):  # a list, as the service reads it
            return httpx.Response(304, headers=headers)
        return httpx.Response(200, content=artifact, headers=headers)

    return answer


def down(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


def not_found(request: httpx.Request) -> httpx.Response:  # a service started with --role training
    return httpx.Response(404, json={"detail": "Not Found"})


def pulls(answers: list[tuple[Answer, int]], caplog: pytest.LogCaptureFixture) -> tuple[PulledModel, list[str]]:
    """Pull from a service that answers each `(answer, times)` in turn; the model and what was logged."""
    url = "http://service.test:8000"
    pulled = PulledModel(url, LeanHttpPredictorClient(url), interval_s=60.0)
    now: list[Answer] = []
    with (
        caplog.at_level(logging.INFO, logger="leadtime.router.pulled"),
        httpx.Client(transport=httpx.MockTransport(lambda request: now[0](request))) as client,
    ):
        for answer, times in answers:
            now[:] = [answer]
            for _ in range(times):
                pulled.pull_once(client)
    return pulled, [r.getMessage() for r in caplog.records if r.name == "leadtime.router.pulled"]


GOOD = OnlinePredictor().to_bytes()
UNSUPPORTED = json.dumps({"format": "leadtime-predictor", "artifact_version": 999}).encode()


def test_a_refused_model_is_said_once_not_at_every_pull(caplog: pytest.LogCaptureFixture) -> None:
    """A service serving a model this build refuses had the gateway log the refusal at every pull (every second,
    forever); said once as a failing connection is, again when the reason changes, and after a recovery."""
    pulled, said = pulls(
        [
            (served(GOOD), 2),
            (served(UNSUPPORTED), 5),
            (served(UNSUPPORTED, etag="0" * 64), 5),  # not what the service announced
            (served(GOOD), 3),
            (served(UNSUPPORTED), 4),
        ],
        caplog,
    )
    assert pulled.pulls == {"new": 1, "unchanged": 4, "error": 0, "refused": 14}
    assert pulled.model is not None  # the model held kept predicting throughout
    assert len(said) == 4, said
    assert "artifact version 999 is not supported" in said[0] and "keeping the model held" in said[0]
    assert "SHA-256" in said[1]
    assert "succeeds again" in said[2]
    assert "artifact version 999 is not supported" in said[3]


def test_a_refused_model_is_downloaded_once_while_its_etag_stays_and_a_new_one_is_taken_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused artifact was downloaded (and decoded) again at every pull, every second, for ever: ~1.4% of a CPU
    for nothing. Its digest is sent as If-None-Match beside the held model's, so the source answers 304 until it
    serves another artifact, which is taken at the next pull."""
    other = OnlinePredictor(LearnerConfig(quantile=0.8)).to_bytes()
    downloads: list[bytes] = []

    def counted(artifact: bytes) -> Answer:
        answer = served(artifact)

        def counting(request: httpx.Request) -> httpx.Response:
            response = answer(request)
            if response.status_code == 200:
                downloads.append(artifact)
            return response

        return counting

    pulled, said = pulls([(counted(GOOD), 2), (counted(UNSUPPORTED), 5), (counted(other), 2)], caplog)
    assert downloads == [GOOD, UNSUPPORTED, other]
    assert pulled.pulls == {"new": 2, "unchanged": 2, "error": 0, "refused": 5}
    assert pulled.digest == hashlib.sha256(other).hexdigest()
    assert len(said) == 2 and "not supported" in said[0] and "succeeds again" in said[1], said


def test_a_refused_model_is_not_read_again_from_a_source_that_ignores_if_none_match(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A source (or a proxy) that answers 200 whatever If-None-Match says: a body announced by the ETag of the
    artifact refused is not read again, and stays refused."""
    digest = hashlib.sha256(UNSUPPORTED).hexdigest()
    reads: list[int] = []

    def body() -> Iterator[bytes]:
        reads.append(1)
        yield UNSUPPORTED

    def deaf(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body(), headers={"etag": f'"{digest}"'})

    pulled, said = pulls([(deaf, 4)], caplog)
    assert len(reads) == 1
    assert pulled.pulls["refused"] == 4 and pulled.model is None
    assert len(said) == 1 and "not supported" in said[0], said


def test_a_pull_that_fails_for_another_reason_says_the_new_one(caplog: pytest.LogCaptureFixture) -> None:
    """Only the switch between failing and succeeding was logged: a service that went down and came back with
    --role training (404) went on failing under the first reason (connection refused) in the log."""
    pulled, said = pulls([(down, 3), (not_found, 3), (down, 2)], caplog)
    assert pulled.pulls["error"] == 8
    assert len(said) == 3, said
    assert "Connection refused" in said[0] and "heuristics until one is pulled" in said[0]
    assert "answered 404" in said[1]
    assert "Connection refused" in said[2]


def test_every_pull_result_is_exported_from_the_start() -> None:
    """An alert on the rate of failing pulls found no series before the first failure (as with fallbacks, each
    result starts at 0)."""
    text = GatewayMetrics().render().decode()
    for result in PULL_RESULTS:
        assert f'leadtime_router_model_pulls_total{{result="{result}"}} 0.0' in text, text


def test_every_discovery_reload_result_is_exported_from_the_start() -> None:
    """`discovery_reloads_total` had no series before the first reload, unlike the gateway's other counters."""
    text = GatewayMetrics().render().decode()
    for result in DISCOVERY_RESULTS:
        assert f'leadtime_router_discovery_reloads_total{{result="{result}"}} 0.0' in text, text


def test_a_predictor_url_in_capitals_is_taken_and_one_without_a_scheme_refused_as_every_client_does() -> None:
    """`--pull-model` refused `HTTPS://...`, which the other clients take (a scheme is case-blind); its own check was
    one of three copies of the rule."""
    pulled = PulledModel("HTTPS://predictor:8443", LeanHttpPredictorClient("HTTPS://predictor:8443"), interval_s=60.0)
    assert pulled.url == "HTTPS://predictor:8443/v1/model"
    with pytest.raises(ValueError, match=r"'predictor:8443': expected http://HOST:PORT or https://HOST:PORT"):
        PulledModel("predictor:8443", LeanHttpPredictorClient("http://predictor:8443"), interval_s=60.0)


def test_a_pull_survives_any_body_and_says_why_it_was_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A body nested 200,000 deep raised RecursionError out of the artifact's decoding: the pull thread died for
    good (the gateway's model aged in silence; the service said "background loop stopped")."""

    def deep(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"[" * 200_000)

    pulled, said = pulls([(served(GOOD), 1), (deep, 3), (served(GOOD), 1)], caplog)
    assert pulled.pulls["refused"] == 3 and pulled.model is not None
    assert any("refused" in m for m in said), said


def test_a_weak_etag_from_a_proxy_is_taken_as_the_digest_it_names(caplog: pytest.LogCaptureFixture) -> None:
    """`W/"<sha>"` (a proxy that compresses weakens ETags) was refused at every pull as not the announced SHA-256."""
    digest = hashlib.sha256(GOOD).hexdigest()

    def weak(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=GOOD, headers={"etag": f'W/"{digest}"'})

    pulled, said = pulls([(weak, 1)], caplog)
    assert pulled.pulls["new"] == 1 and pulled.model is not None, said


def test_a_source_that_is_itself_a_prediction_server_is_refused_naming_why(caplog: pytest.LogCaptureFixture) -> None:
    """`--model-from` pointed at a prediction server (or at itself) took its prior, for ever, with nothing degraded:
    such a server takes its models from elsewhere and has none of its own to give."""

    def prediction_role(request: httpx.Request) -> httpx.Response:
        digest = hashlib.sha256(GOOD).hexdigest()
        headers = {"etag": f'"{digest}"', "x-leadtime-role": "prediction"}
        return httpx.Response(200, content=GOOD, headers=headers)

    pulled, said = pulls([(prediction_role, 2)], caplog)
    assert pulled.pulls["refused"] == 2 and pulled.model is None
    assert len(said) == 1 and "is a prediction server" in said[0], said


def test_a_body_beyond_the_cap_is_not_read_whole(caplog: pytest.LogCaptureFixture) -> None:
    """A wrong URL streaming a huge body was read whole into memory."""
    from leadtime.predictor.model_pull import MAX_MODEL_BYTES

    def huge(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter([b"x" * (1 << 20)] * (MAX_MODEL_BYTES // (1 << 20) + 2)))

    pulled, said = pulls([(huge, 1)], caplog)
    assert pulled.pulls["refused"] == 1 and "larger than" in said[0], said


def test_a_source_whose_model_version_went_back_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """A training server restarted without --model-dir or --redis serves its prior again as version 0: the pulling
    servers took it in silence, back from a trained model to the prior ("succeeds again" was all the log said)."""
    trained, fresh = GOOD, OnlinePredictor(LearnerConfig(quantile=0.8)).to_bytes()

    def at(artifact: bytes, version: int) -> Answer:
        def answer(request: httpx.Request) -> httpx.Response:
            headers = {"etag": f'"{hashlib.sha256(artifact).hexdigest()}"', "x-leadtime-model-version": str(version)}
            return httpx.Response(200, content=artifact, headers=headers)

        return answer

    pulled, said = pulls([(at(trained, 30), 1), (down, 2), (at(fresh, 0), 1)], caplog)
    assert pulled.pulls["new"] == 2
    assert any("went back from version 30 to 0" in m and "restarted" in m for m in said), said


def test_a_version_header_that_is_no_number_leaves_the_model_taken(caplog: pytest.LogCaptureFixture) -> None:
    """A model version of "²" (the byte 0xB2, which Python's isdigit takes for a digit) raised ValueError out of
    the pull, which never raises: the gateway's pulling thread ended for good, the model it had just checked never
    served though its digest was kept (the source then answered 304 to every pull, had the thread lived)."""

    def answer(request: httpx.Request) -> httpx.Response:
        headers = [(b"etag", f'"{hashlib.sha256(GOOD).hexdigest()}"'.encode()), (b"x-leadtime-model-version", b"\xb2")]
        return httpx.Response(200, content=GOOD, headers=headers)

    pulled, said = pulls([(answer, 1)], caplog)
    assert pulled.pulls["new"] == 1 and pulled.model is not None, said


async def _trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A source answering GET /v1/model at once, then its body 1 KiB every 50 ms: 5 s in all, each read well
    within any step's timeout (a pull given up closes the connection: the next one comes on a new one)."""
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (100 << 10))
        for _ in range(100):
            writer.write(b"x" * 1024)
            await writer.drain()
            await asyncio.sleep(0.05)
    except OSError:
        pass
    writer.close()


def test_a_source_trickling_its_answer_is_given_up_at_the_pulls_deadline(caplog: pytest.LogCaptureFixture) -> None:
    """httpx's timeout bounds each step (connecting, each read), not the pull: a source trickling its answer held
    a pull (and /reload, or a gateway's stop, waiting on it) for as long as it kept sending, up to 64 MiB. The
    pull's timeout is now its whole deadline: given up as an "error" naming it, said once."""
    port, loop = serve_in_a_thread(_trickle)
    pulled = PulledModel(f"http://127.0.0.1:{port}", LeanHttpPredictorClient("http://127.0.0.1:1"), timeout_s=0.5)
    try:
        with caplog.at_level(logging.INFO, logger="leadtime.router.pulled"), pulled._pull.client() as client:
            for _ in range(2):
                started = time.monotonic()
                assert pulled.pull_once(client) == "error"
                assert time.monotonic() - started < 1.5
    finally:
        loop.call_soon_threadsafe(loop.stop)
    said = [r.getMessage() for r in caplog.records if r.name == "leadtime.router.pulled"]
    assert len(said) == 1 and "the answer took longer than 0.5 s" in said[0], said
    assert "took longer than 0.5 s" in pulled.health()["model_pull"]


def test_a_compressed_answer_is_read_within_the_size_cap_not_inflated_whole(caplog: pytest.LogCaptureFixture) -> None:
    """`Content-Encoding: gzip, gzip` over 5 KB inflated to 3 GB before the 64 MiB cap was checked (httpx decodes a
    piece whole before handing it over): the prediction server grew to 6 GB. The pull asks for the model
    uncompressed, and what a proxy compresses anyway is inflated piece by piece against the cap."""
    import gzip
    import tracemalloc
    import zlib

    class Streamed(httpx.SyncByteStream):  # as off the network: bytes given whole would be read (decoded) at once
        def __init__(self, body: bytes) -> None:
            self.body = body

        def __iter__(self) -> Iterator[bytes]:
            yield from (self.body[i : i + 65536] for i in range(0, len(self.body), 65536))

    deflater = zlib.compressobj(9, zlib.DEFLATED, 31)  # a gzip stream of 512 MiB of zeros, made without holding it
    zero = bytes(1 << 20)
    inner = b"".join(deflater.compress(zero) for _ in range(512)) + deflater.flush()
    bomb = gzip.compress(inner)
    asked: list[str] = []

    def bombing(request: httpx.Request) -> httpx.Response:
        asked.append(request.headers.get("accept-encoding", ""))
        return httpx.Response(200, stream=Streamed(bomb), headers={"content-encoding": "gzip, gzip"})

    def compressed(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Streamed(gzip.compress(GOOD)), headers={"content-encoding": "gzip"})

    def brotli(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Streamed(b"\x00" * 10), headers={"content-encoding": "br"})

    tracemalloc.start()
    pulled, said = pulls([(bombing, 1), (compressed, 1), (brotli, 1)], caplog)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 160 << 20, f"{peak >> 20} MiB held at once"  # the 64 MiB cap and a piece, not 512 MiB
    assert asked == ["identity"]
    assert pulled.pulls["refused"] == 2 and pulled.pulls["new"] == 1, pulled.pulls
    assert "larger than 64 MiB" in said[0], said
    assert pulled.model is not None  # a proxy's gzip of a model is taken
    assert "Content-Encoding br" in said[-1], said


def test_a_row_the_pulled_model_refuses_is_refused_as_the_service_refuses_it(caplog: pytest.LogCaptureFixture) -> None:
    """Regression: a candidate the pulled model cannot predict (an accelerator class it does not know, which the
    gateway's own catalog may name) raised the model's FeatureError, which the gateway took for a predictor that
    failed (`invalid_answer`): three in a row opened the breaker, and decisions without that candidate fell back
    too, the gateway saying the predictor failed. Asking the service, such rows are refused (422) and the others
    predicted: so here too."""
    pulled, _ = pulls([(served(GOOD), 1)], caplog)
    gateway = GatewayPredictor(pulled, pulled, GatewayMetrics())
    unknown = FeatureRow(RequestFeatures(input_tokens=900), EndpointState(endpoint_id="e", accelerator="b999-custom"))
    for _ in range(gateway.open_after + 1):
        with pytest.raises(PredictorError) as err:
            gateway.predict([unknown], 1.0)
        assert not isinstance(err.value, PredictorUnavailable) and gateway.last_failure == "refused", err.value
        assert "accelerator: unknown accelerator class 'b999-custom'" in err.value.message
    assert len(gateway.predict([FeatureRow(RequestFeatures(input_tokens=900))], 1.0).ttft_mean_ms) == 1
    assert "predictor" not in gateway.health() and "b999-custom" in gateway.health()["candidates"]


def test_readyz_stops_saying_no_model_was_pulled_once_one_is(caplog: pytest.LogCaptureFixture) -> None:
    """A gateway started before its service: the warm-up found no model, and /readyz went on saying "no model pulled
    from ... yet; deciding with the heuristics" after the first pull had brought one, until a request came."""
    url = "http://service.test:8000"
    pulled = PulledModel(url, LeanHttpPredictorClient(url), interval_s=60.0)
    gateway = GatewayPredictor(pulled, pulled, GatewayMetrics())
    row = FeatureRow(RequestFeatures(input_tokens=16))
    now: list[Answer] = [down]
    with (
        caplog.at_level(logging.INFO),
        httpx.Client(transport=httpx.MockTransport(lambda request: now[0](request))) as client,
    ):
        pulled.pull_once(client)
        assert not gateway.warm_up(row, deadline_s=0.01)
        assert "no model pulled" in gateway.health()["predictor"]
        now[:] = [served(GOOD)]
        pulled.pull_once(client)
    assert gateway.health() == {}
