"""The event loop is never held by a slow request: encoding a model, exporting it, reading its trees or waiting for the
learner's pipe runs in a worker thread, and a prediction or a probe arriving meanwhile is answered at once.

Each test serves the app with a real uvicorn on a thread of its own, makes the heavy call slow (seconds) and
asks /healthz and a prediction while it is in flight: answered while the slow call still runs, or it held the loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from llmd_rows import llmd_row
from served import uvicorn_in_a_thread

from leadtime.predictor.learner import OnlinePredictor
from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.runtime import ServiceRuntime
from leadtime.predictor.settings import ServiceSettings

SLOW_S = 3.0
"""How long the slowed call takes: the cheap requests must be answered within it (ordering, not a time bound), so
it is long enough for two of them on a loaded host."""


@dataclass
class Served:
    """A real uvicorn serving one app on loopback, and its runtime."""

    app: FastAPI
    url: str

    @property
    def runtime(self) -> ServiceRuntime:
        runtime: ServiceRuntime = self.app.state.runtime
        return runtime


@pytest.fixture
def served() -> Iterator[Served]:
    app = create_app(ServiceSettings())
    with uvicorn_in_a_thread(app) as url:
        yield Served(app, url)


class SlowCall(threading.Event):
    """Set when a slowed call begins; `running` counts the slowed calls in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.running += n


def slowed(original: Callable[..., Any], entered: SlowCall) -> Callable[..., Any]:
    """`original`, taking SLOW_S longer, setting `entered` when called."""

    def slow(*args: Any, **kwargs: Any) -> Any:
        entered.add(1)
        entered.set()
        try:
            time.sleep(SLOW_S)
        finally:
            entered.add(-1)
        return original(*args, **kwargs)

    return slow


def assert_loop_free_during(served: Served, entered: SlowCall, method: str, path: str, **kw: Any) -> int:
    """Send the slow request; once its slow call has begun, time /healthz and a prediction. The slow request's
    status."""
    answer: list[httpx.Response] = []

    def heavy() -> None:
        with httpx.Client(base_url=served.url, timeout=30) as c:
            answer.append(c.request(method, path, **kw))

    thread = threading.Thread(target=heavy)
    thread.start()
    try:
        assert entered.wait(10), f"{method} {path} never reached the slowed call"
        with httpx.Client(base_url=served.url, timeout=30) as c:
            assert c.get("/healthz").status_code == 200
            probe_during = entered.running > 0
            assert c.post("/predict", json=llmd_row()).status_code == 200
            predict_during = entered.running > 0
    finally:
        thread.join(30)
    # Answered while the slow call still ran: held by it, the loop would have answered only once it returned.
    assert probe_during, f"/healthz was answered only after the slow call of {method} {path}: the loop was held"
    assert predict_during, f"/predict was answered only after the slow call of {method} {path}: the loop was held"
    assert answer, f"{method} {path} got no answer"
    return answer[0].status_code


@pytest.mark.parametrize(
    "path", ["/model/ttft/download", "/model/tpot/info", "/models/list", "/model/export"], ids=lambda p: p
)
def test_encoding_the_model_does_not_hold_the_loop(served: Served, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    entered = SlowCall()
    monkeypatch.setattr(OnlinePredictor, "to_bytes", slowed(OnlinePredictor.to_bytes, entered))
    assert assert_loop_free_during(served, entered, "GET", path) == 200


@pytest.mark.parametrize("path", ["/model/ttft/lgb/txt", "/model/export"], ids=lambda p: p)
def test_writing_the_trees_as_text_does_not_hold_the_loop(
    served: Served, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = SlowCall()
    monkeypatch.setattr(OnlinePredictor, "to_bytes", lambda self: b"{}")  # only the text is slow here
    monkeypatch.setattr(OnlinePredictor, "tree_text", slowed(lambda self, target: "tree\n", entered))
    assert assert_loop_free_during(served, entered, "GET", path) == 200


@pytest.mark.parametrize("path", ["/model/tpot/lgb/importances", "/metrics"], ids=lambda p: p)
def test_reading_the_trees_importances_does_not_hold_the_loop(
    served: Served, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = SlowCall()
    monkeypatch.setattr(
        OnlinePredictor, "tree_importances", slowed(lambda self, target: {"input_tokens": 1.0}, entered)
    )
    assert assert_loop_free_during(served, entered, "GET", path) == 200


def test_flush_waiting_for_the_learner_does_not_hold_the_loop(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """POST /flush asks the learner process to empty its window: that waits for its pipe up to 2 s."""
    entered = SlowCall()
    learner = served.runtime.learner
    monkeypatch.setattr(learner, "flush_window", slowed(learner.flush_window, entered))
    assert assert_loop_free_during(served, entered, "POST", "/flush", json={"reason": "test"}) == 200
