"""The learner process: it learns what the service forwards, hands back snapshots, and survives being killed."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_service_store import entry, wait_until

from leadtime.predictor.service.app import create_app
from leadtime.predictor.service.learning import ChildSetup, LearnerReport, Snapshot
from leadtime.predictor.settings import ServiceSettings
from leadtime.predictor.store.memory import MemoryStore

ROW = {k: v for k, v in entry(0).items() if not k.startswith("actual_")}


def child_setup(artifact: bytes, **overrides: Any) -> ChildSetup:
    """A learner child's start-up data, with the defaults the service gives it."""
    fields: dict[str, Any] = {
        "cursor": "0",
        "epoch": 1,
        "retrain": False,
        "retrain_every": 100,
        "default_accelerator": "h100-sxm",
        "default_model": "llama-3.1-8b",
        "nice": 0,
        "snapshot_interval_s": 0.25,
    }
    return ChildSetup(artifact=artifact, **{**fields, **overrides})


def _predict(client: TestClient) -> float:
    answer = client.post("/predict/bulk/strict", json={"requests": [ROW]})
    assert answer.status_code == 200
    ttft: float = answer.json()["predictions"][0]["ttft_ms"]
    return ttft


def test_learning_happens_in_another_process_and_reaches_the_served_model() -> None:
    with TestClient(create_app(ServiceSettings(retrain_every=100_000))) as c:
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        before = _predict(c)
        c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(800)]})
        assert wait_until(lambda: sum(runtime.learned().values()) == 800, timeout_s=60)
        assert runtime.learner.pid not in (None, os.getpid())
        assert runtime.model_status()["window"] == {"ttft": 400, "tpot": 400}
        assert _predict(c) != before


def test_a_killed_learner_is_restarted_and_no_accepted_observation_is_lost() -> None:
    with TestClient(create_app(ServiceSettings(retrain_every=100_000))) as c:
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(600)]})
        assert wait_until(lambda: sum(runtime.learned().values()) == 600, timeout_s=60)
        first = runtime.learner.pid
        os.kill(first, signal.SIGKILL)
        c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(600, 1000)]})
        assert wait_until(lambda: runtime.learner.alive and runtime.learner.pid != first, timeout_s=30)
        # Every accepted observation is learned exactly once in the served model's lineage.
        assert wait_until(lambda: sum(runtime.learned().values()) == 1000, timeout_s=60)
        assert runtime.model_status()["observations"] == {"ttft": 500, "tpot": 500}
        assert "learner" not in c.get("/readyz").json()["degraded"]


def test_a_snapshot_from_before_an_adoption_is_ignored() -> None:
    store = MemoryStore()
    with TestClient(create_app(ServiceSettings(retrain_every=100_000), store=store)) as c:
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(400)]})
        assert wait_until(lambda: sum(runtime.learned().values()) == 400, timeout_s=60)
        state, compiled = runtime.predictor.snapshot()
        report = runtime._report
        assert report is not None
        other = runtime.predictor
        other.version = 41
        store.publish_model(other.to_bytes())  # another replica's model: adopting it starts a new epoch
        assert wait_until(lambda: runtime.store_version == 1, timeout_s=10)
        served = runtime.predictor
        runtime._on_snapshot(Snapshot(state, compiled, replace(report, epoch=report.epoch - 1), None))
        assert runtime.predictor is served


def test_failed_retrains_are_counted_from_the_learners_reports() -> None:
    """`leadtime_retrains_total{outcome="failed"}` was exported and drawn on the dashboard, but nothing counted a
    failure: it read 0 whatever the learner's retrains did."""
    with TestClient(create_app(ServiceSettings(retrain_every=100_000))) as c:
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(50)]})
        assert wait_until(lambda: runtime._report is not None, timeout_s=60)
        report = runtime._report
        state, compiled = runtime.predictor.snapshot()

        def failed() -> float:
            return runtime.metrics.registry.get_sample_value(
                "leadtime_retrains_total", {"target": "ttft", "outcome": "failed"}
            )

        for failures in (0, 2, 2, 3):  # reports carry the learner's count so far
            runtime._on_snapshot(Snapshot(state, compiled, replace(report, retrain_failures=failures), None))
        assert failed() == 3
        restarted = replace(report, epoch=report.epoch, retrain_failures=1)  # a new learner counts from 0 again
        runtime._on_snapshot(Snapshot(state, compiled, restarted, None))
        assert failed() == 4


def test_a_learners_count_of_failed_retrains_survives_an_adoption() -> None:
    """The count lived on the learner's predictor, which an adoption replaces: the failures before it were lost to
    the service's metrics whenever the first report after it already counted as many."""
    import multiprocessing

    from leadtime.predictor.learner import OnlinePredictor as Predictor
    from leadtime.predictor.service.learning import _Child

    parent, child_end = multiprocessing.Pipe()
    artifact = Predictor().to_bytes()
    child = _Child(child_end, child_setup(artifact))
    try:
        child.predictor.retrain_failures = 2
        child.handle(("adopt", artifact, "0", 2))
        child.predictor.retrain_failures = 1  # the adopted learner's own
        child.snapshot()
        report = parent.recv()[3]
        assert report.retrain_failures == 3
    finally:
        child.predictor.close()
        parent.close()
        child_end.close()


def test_learner_report_round_trips_through_the_pipe() -> None:
    """The report crosses the process boundary by pickling: it must stay a plain picklable dataclass."""
    import pickle

    report = LearnerReport(epoch=1, cursor="5", window={"ttft": 1, "tpot": 2},
                           last_retrain=None, retrain_error=None, last_model_load=None)  # fmt: skip
    assert pickle.loads(pickle.dumps(report)) == report


def test_the_learner_priority_is_lowered_and_at_19_becomes_idle_class() -> None:
    import subprocess
    import sys

    code = (
        "import os\n"
        "from leadtime.predictor.service.learning import _lower_priority\n"
        "_lower_priority(int(os.environ['NICE']))\n"
        "print(os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0) == os.SCHED_IDLE)\n"
    )
    for nice, idle in ((10, "False"), (19, "True")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "NICE": str(nice)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert out == [str(nice), idle]


def test_shutdown_does_not_hang_on_a_learner_that_stopped_reading() -> None:
    import time

    client = TestClient(create_app(ServiceSettings(retrain_every=100_000)))
    client.__enter__()
    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    assert wait_until(lambda: runtime.learner.alive, timeout_s=10)
    os.kill(runtime.learner.pid, signal.SIGSTOP)  # alive but reading nothing: the pipe fills up
    for start in range(0, 20_000, 2_000):
        client.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(start, start + 2_000)]})
    time.sleep(1.0)  # the ingest loop is now blocked writing to the full pipe
    started = time.monotonic()
    client.__exit__(None, None, None)
    assert time.monotonic() - started < 20
    assert not runtime.learner.alive


def test_flushing_training_data_empties_the_learners_window() -> None:
    with TestClient(create_app(ServiceSettings(retrain_every=100_000))) as c:
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(400)]})
        assert wait_until(lambda: runtime.model_status().get("window") == {"ttft": 200, "tpot": 200}, timeout_s=60)
        assert c.post("/flush", json={"flush_test_data": False}).status_code == 200
        assert wait_until(lambda: runtime.model_status().get("window") == {"ttft": 0, "tpot": 0}, timeout_s=10)
        assert runtime.learned() == {"ttft": 200, "tpot": 200}  # flushing the window forgets no learning


def test_a_flush_also_flushes_the_rows_still_waiting_to_be_learned(monkeypatch: pytest.MonkeyPatch) -> None:
    """/flush zeroed the counts and emptied the learner's window, but rows accepted before it that still waited in
    the store were learned into the window after it: the answer said 3,600 training samples flushed, /data/status
    then 0, and the window held 4,000 rows a few seconds later."""
    with TestClient(create_app(ServiceSettings(retrain_every=100_000))) as c:
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(400)]})
        assert wait_until(lambda: runtime.model_status().get("window") == {"ttft": 200, "tpot": 200}, timeout_s=60)
        ingest_turn = runtime._ingest_turn
        monkeypatch.setattr(runtime, "_ingest_turn", lambda: time.sleep(0.01))  # nothing is forwarded meanwhile
        assert c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(1000)]}).status_code == 202
        assert runtime.ingestion()["pending"] == 1000
        flushed = c.post("/flush", json={"flush_test_data": False})
        assert flushed.status_code == 200
        said = flushed.json()["ttft_training_samples_flushed"] + flushed.json()["tpot_training_samples_flushed"]
        assert said == 1260  # 1,400 accepted, one in ten counted as test data
        monkeypatch.setattr(runtime, "_ingest_turn", ingest_turn)
        assert wait_until(lambda: runtime.ingestion()["pending"] == 0, timeout_s=30)
        assert wait_until(lambda: runtime.model_status().get("window") == {"ttft": 0, "tpot": 0}, timeout_s=10)
        ingestion = runtime.ingestion()
        assert ingestion["pending"] == 0 and ingestion["dropped"]["flushed"] == 1000
        assert ingestion["accepted"] == ingestion["learned"] + ingestion["dropped"]["flushed"]
        assert c.get("/data/status").json()["training_data"]["total_samples"] == 0
        # The learner goes on from past the flushed rows: what comes next is learned, and only that.
        c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(40)]})
        assert wait_until(lambda: runtime.model_status().get("window") == {"ttft": 20, "tpot": 20}, timeout_s=30)
        time.sleep(0.5)  # a flushed row learned late would show by now
        assert runtime.model_status()["window"] == {"ttft": 20, "tpot": 20}
        assert runtime.learned() == {"ttft": 220, "tpot": 220}


def test_a_flush_the_learner_does_not_take_flushes_nothing_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """It answered success, counts zeroed, while the learner kept its window (a warning in the log only)."""
    with TestClient(create_app(ServiceSettings(retrain_every=100_000))) as c:
        runtime = c.app.state.runtime  # type: ignore[attr-defined]
        c.post("/add_training_data_bulk", json={"entries": [entry(i) for i in range(100)]})
        assert wait_until(lambda: runtime.ingestion()["pending"] == 0, timeout_s=30)
        before = c.get("/data/status").json()["training_data"]
        monkeypatch.setattr(runtime.learner, "flush_window", lambda cursor: False)  # busy, or restarting
        refused = c.post("/flush", json={})
        assert refused.status_code == 503 and "nothing was flushed" in refused.json()["error"], refused.text
        assert c.get("/data/status").json()["training_data"] == before
        assert runtime.ingestion()["dropped"]["flushed"] == 0


def test_retrains_rest_min_retrain_interval_s_after_one_and_follow_the_lease() -> None:
    import multiprocessing
    import time as clock

    from leadtime.predictor.learner import OnlinePredictor as Predictor
    from leadtime.predictor.service.learning import _Child

    parent, child_end = multiprocessing.Pipe()
    child = _Child(child_end, child_setup(Predictor().to_bytes(), retrain=True, min_retrain_interval_s=30.0))
    try:
        child._pace_retrains()
        assert child.predictor.config.retrain is True  # none yet: free to retrain
        child._on_retrain({"duration_s": 0.1})
        child._pace_retrains()
        assert child.predictor.config.retrain is False  # resting
        child.retrains.clear()
        for model in child.predictor._models.values():
            model.since_retrain = 100  # a retrain came due while resting
        child.last_retrain_at = clock.monotonic() - 31.0
        child._pace_retrains()
        assert child.predictor.config.retrain is True
        # ... and the retrain that came due meanwhile runs at once, without waiting for another row to ask for it.
        assert wait_until(lambda: len(child.retrains) > 0, timeout_s=10)
        child.handle(("lease", False, 100))  # the lease went elsewhere: no retrain, rested or not
        child._pace_retrains()
        assert child.predictor.config.retrain is False
    finally:
        child.predictor.close()
        parent.close()
        child_end.close()


def _spawned_children() -> list[int]:
    """Pids of this process's children that multiprocessing spawned."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"multiprocessing" in cmdline:
            pids.append(int(status.parent.name))
    return pids


def test_a_learner_killed_before_it_read_its_model_does_not_hang_the_start() -> None:
    """The model went to the learner with the spawn's own start-up data, which the parent writes while it still
    holds the child's end of that pipe: a child killed while importing (Ctrl-C or a service manager's SIGTERM
    reach the whole process group, and a start takes seconds on a busy host) left the parent blocked in that
    write for good once the model passed the pipe's 64 KiB, no signal able to stop it. The model now goes over
    the learner's own pipe, whose other end the parent closed."""
    from leadtime.predictor.learner import OnlinePredictor as Predictor
    from leadtime.predictor.service.learning import LearnerProcess

    before = set(_spawned_children())
    artifact = Predictor().to_bytes()
    setup = child_setup(artifact + b" " * (4 << 20))  # a large model (trailing spaces decode as JSON whitespace)
    learner = LearnerProcess(lambda snapshot: None, lambda: None)
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            learner.start(setup)
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - reported below
            outcome.append(err)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    assert wait_until(lambda: set(_spawned_children()) - before, timeout_s=30)
    for pid in set(_spawned_children()) - before:
        os.kill(pid, signal.SIGKILL)
    starter.join(30)
    try:
        assert not starter.is_alive(), "the start hung on a learner that died before reading its model"
    finally:
        learner.stop(timeout_s=2.0)
