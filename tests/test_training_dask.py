"""The retraining job on a real Dask cluster (a LocalCluster of two worker processes): LightGBM's Dask estimators
fit the same search, and the result is as accurate as a local run's, within the noise of distributed bins."""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pytest
from dask.distributed import Client, LocalCluster

from leadtime.bench.retrain import write_simulator_log
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.training.distributed import DaskTrainer, DaskUnavailable, connect
from leadtime.training.fit import LocalTrainer, SearchConfig, booster_params
from leadtime.training.job import EXIT_PUBLISHED, RetrainConfig, run_retrain
from leadtime.training.sources import SampleReader


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    # The dashboard on any free port: None still asks for 8787, and warns when another test's cluster holds it.
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", silence_logs=logging.ERROR
        ) as cluster,
        Client(cluster) as connected,
    ):
        yield connected


def test_a_dask_run_matches_a_local_run(client: Any, tmp_path: Path) -> None:
    log = tmp_path / "observations.jsonl"
    write_simulator_log(log, requests=1500)
    # Two settings instead of four and at most 100 rounds keep the test short: a Dask fit runs every round
    # (its workers cannot stop early together), each synchronised over the network.
    search = SearchConfig(grid={"num_leaves": [5, 9], "min_data_in_leaf": [20]}, max_rounds=100)
    local = run_retrain(RetrainConfig(samples=(str(log),), registry=str(tmp_path / "local"), search=search))
    distributed = run_retrain(
        RetrainConfig(samples=(str(log),), registry=str(tmp_path / "dask"), search=search), client=client
    )
    assert local.exit_code == distributed.exit_code == EXIT_PUBLISHED
    assert distributed.report["training"]["backend"] == "dask" and distributed.report["training"]["workers"] == 2
    # The same search ran: every setting of both roles, on both folds, for both targets.
    for target in ("ttft", "tpot"):
        tried = distributed.report["training"]["targets"][target]["search"]
        assert len(tried) == 6 and all(len(s["fold_scores"]) == 2 for s in tried)
    # Within noise: the candidate trees' validation scores, and the published models' errors on the evaluation
    # slice, differ by less than 5% of the local run's; the upper quantile's pinball loss by less than 10%. Dask's
    # data-parallel LightGBM bins each worker's part of the rows on its own, and which worker takes which part
    # varies from run to run; the quantile tree, fitted on the tail, moves most (TPOT's: 4.2% or 7.0% from the
    # local run's, run to run on the same rows; every other figure within 2.5%).
    for target in ("ttft", "tpot"):
        for role, within in (("mean", 0.05), ("upper", 0.10)):
            a = local.report["training"]["targets"][target]["validation"][role]["candidate"]
            b = distributed.report["training"]["targets"][target]["validation"][role]["candidate"]
            assert abs(a - b) <= within * a, (target, role, a, b)
        a = local.report["evaluation"]["challenger"][target]
        b = distributed.report["evaluation"]["challenger"][target]
        assert abs(a["mape"] - b["mape"]) <= 0.05 * a["mape"], (target, a["mape"], b["mape"])
        assert abs(a["coverage"] - b["coverage"]) <= 0.05, (target, a["coverage"], b["coverage"])
    # What the cluster fitted is a model the service loads like any other.
    loaded = OnlinePredictor.load(tmp_path / "dask", background=False)
    assert loaded.status()["trees_active"] == {"ttft": True, "tpot": True}


def test_one_dask_worker_fits_the_very_trees_a_local_fit_does() -> None:
    """Regression: the Dask trainer left `feature_pre_filter` out of the parameters, so LightGBM's default (on)
    dropped features the local fit keeps: the same rows and seed gave other trees on Dask (residual predictions up
    to 0.13 apart on the shipped H200 rows), and a Dask run's model was not the one a local run made."""
    samples = SampleReader("h200-sxm", "qwen3-32b").read(["sharegpt-h200"])
    rows = np.flatnonzero(samples.actual_ttft_ms > 0)
    base = OnlinePredictor(LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False, retrain=False))
    x, residual = base.residual_training_set("ttft", samples.batch[rows], samples.actual_ttft_ms[rows])
    fit, valid = slice(0, 1000), slice(1000, 1400)
    params = booster_params("ttft", "regression", {"num_leaves": 5, "min_data_in_leaf": 20}, SearchConfig())
    # Every round kept (patience beyond them), so that both hold the same number of rounds.
    local = LocalTrainer().train(params, (x[fit], residual[fit]), x[valid], residual[valid], rounds=10, patience=100)
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0", silence_logs=logging.ERROR
        ) as cluster,
        Client(cluster) as one_worker,
    ):
        trainer = DaskTrainer(one_worker)
        placed = trainer.prepare(x[fit], residual[fit])
        dask = trainer.train(params, placed, x[valid], residual[valid], rounds=10, patience=100)
        trainer.release(placed)
    assert local.current_iteration() == dask.current_iteration() == 10
    np.testing.assert_allclose(dask.predict(x[valid]), local.predict(x[valid]), rtol=1e-12, atol=1e-12)


def test_an_unreachable_scheduler_is_one_clear_error() -> None:
    with pytest.raises(DaskUnavailable, match=r"^cannot reach the Dask scheduler at tcp://127\.0\.0\.1:9: "):
        connect("tcp://127.0.0.1:9", timeout_s=1.0)


@pytest.mark.usefixtures("ctrl_c_as_a_terminal_gives_it")
def test_an_interrupted_dask_fit_leaves_no_traceback_behind(
    client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl-C during a fit exited 130, then printed "Task exception was never retrieved ... AllExit" twice: the
    client's gather, abandoned by the interrupt, ended that way when the client closed."""
    log = tmp_path / "observations.jsonl"
    write_simulator_log(log, requests=1500)
    own = Client(client.scheduler.address)

    def slow_fit(self: Any, *args: Any, **kwargs: Any) -> None:  # a fit waiting on the workers, as LightGBM's does
        threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()
        own.gather([own.submit(time.sleep, 30 + i, pure=False) for i in range(2)])

    monkeypatch.setattr(lgb.DaskLGBMRegressor, "fit", slow_fit)
    with pytest.raises(KeyboardInterrupt):
        run_retrain(RetrainConfig(samples=(str(log),), registry=str(tmp_path / "models")), client=own)
    own.close()
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not (tmp_path / "models" / "leadtime-predictor.json").exists()


def test_quieting_an_interrupted_job_never_replaces_the_interrupt() -> None:
    """On the way out of a Ctrl-C, a client without an event loop (closed, or not distributed's) made
    `interrupted` raise, and that error replaced the KeyboardInterrupt."""
    logger = logging.getLogger("distributed")
    level = logger.level
    try:
        DaskTrainer(object()).interrupted()  # no `loop` at all: must not raise
        # What it can still do without the client's loop is done: distributed's log of the cut is quieted.
        assert logger.level == logging.CRITICAL
    finally:
        logger.setLevel(level)


def test_an_address_that_is_no_dask_scheduler_is_one_clear_error_in_time() -> None:
    """`--dask` pointed at Redis or the scheduler's dashboard connected and then waited for ever for a Dask
    handshake: a nightly job hung, printing nothing."""
    import socket
    import threading
    import time

    from leadtime.training.distributed import DaskUnavailable, connect

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    started = time.monotonic()
    try:
        with pytest.raises(DaskUnavailable, match=r"did not answer as a Dask scheduler within 7 s"):
            connect(address, timeout_s=2.0)
        assert time.monotonic() - started < 15
    finally:
        for connection in held:
            connection.close()
        listener.close()


def test_an_address_answering_another_protocol_is_one_clear_error() -> None:
    """`--dask` pointed at an HTTP server (the scheduler's dashboard on :8787, a Leadtime service): its answer to
    distributed's handshake, read as a frame length, asked for exabytes, and the job ended in a MemoryError
    traceback."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def answer_as_http() -> None:
        connection = listener.accept()[0]
        held.append(connection)
        connection.recv(65536)
        connection.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 11\r\n\r\nBad Request")

    threading.Thread(target=answer_as_http, daemon=True).start()
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(DaskUnavailable, match=r"^tcp://127\.0\.0\.1:\d+ did not answer as a Dask scheduler \("):
            connect(address, timeout_s=2.0)
    finally:
        for connection in held:
            connection.close()
        listener.close()
