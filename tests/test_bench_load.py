"""A few seconds of `leadtime bench load` at low rates: the real service, wrk and the observation feeder run, and
the report has its fields, no errors and the rates it was asked for. (The full benchmark is not part of the tests.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from child_processes import kill_service_expecting_one_line

FIELDS = {
    "achieved_predict_rps",
    "achieved_observe_rps",
    "p50_ms",
    "p99_ms",
    "predict_errors",
    "observe_errors",
    "errors",
    "rss_mb_start",
    "rss_mb_end",
}


def require_wrk() -> None:
    if shutil.which("wrk") is None:
        message = "wrk is not installed (apt-get install wrk)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; with CI=true the load benchmark's smoke test must run", pytrace=False)
        pytest.skip(message)


def test_bench_load_smoke() -> None:
    require_wrk()
    done = subprocess.run(
        [sys.executable, "-m", "leadtime", "bench", "load", "--json", "--duration", "3"]
        + ["--predict-rps", "40", "--observe-rps", "400"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert set(report) >= FIELDS
    assert report["predict_errors"] == report["observe_errors"] == report["errors"] == 0
    assert 0.7 * 40 <= report["achieved_predict_rps"] <= 1.2 * 40, report
    assert 0.8 * 400 <= report["achieved_observe_rps"] <= 1.05 * 400, report
    assert 0 < report["p50_ms"] <= report["p99_ms"]
    assert report["rss_mb_start"] > 50 and report["rss_mb_end"] > 50
    assert report["ingestion"]["accepted"] >= 2_000  # the warm-up's 2,000 and the feeder's


def test_bench_load_says_when_wrk_is_missing(tmp_path: object) -> None:
    env = {**os.environ, "PATH": "/nonexistent"}
    done = subprocess.run(
        [sys.executable, "-m", "leadtime", "bench", "load", "--duration", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and "wrk is not installed" in done.stderr and "Traceback" not in done.stderr


def _nap(ready: Any) -> None:
    """A worker that says it runs, then waits to be interrupted."""
    ready.set()
    time.sleep(60)


@pytest.mark.usefixtures("ctrl_c_as_a_terminal_gives_it")
def test_a_worker_process_ends_quietly_on_ctrl_c(capfd: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C reaches the process group: each observation feeder printed a KeyboardInterrupt traceback under the
    parent's own exit."""
    import multiprocessing

    from leadtime.bench.procs import quietly

    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    worker = context.Process(target=quietly, args=(_nap, ready))
    worker.start()
    assert ready.wait(60)
    os.kill(worker.pid or 0, signal.SIGINT)
    worker.join(30)
    assert worker.exitcode == 0
    assert "Traceback" not in capfd.readouterr().err


def test_a_call_holds_the_rows_asked_for_repeating_the_shipped_ones() -> None:
    """`--rows 10000` said "of 10000 rows" but sent the 3,400 rows the shipped trace has."""
    from leadtime.bench.load import call_rows
    from leadtime.bench.serving import load_entries, prediction_rows

    entries = load_entries()
    shipped = prediction_rows(entries)
    assert len(shipped) < 10_000
    rows = call_rows(entries, 10_000)
    assert len(rows) == 10_000
    assert rows[: len(shipped)] == shipped
    assert rows[len(shipped)] == shipped[0]  # from the first again
    assert call_rows(entries, 50) == shipped[:50]


def test_the_report_names_prediction_and_observation_errors_apart(capsys: pytest.CaptureFixture[str]) -> None:
    """The report gave one sum of wrk's errors and the observation posts not answered 202; the README's table has
    an errors column for each."""
    from leadtime.bench.load import print_report

    report = {
        "achieved_predict_rps": 990.0,
        "target_predict_rps": 1000.0,
        "rows_per_call": 50,
        "p50_ms": 1.0,
        "p99_ms": 5.0,
        "achieved_observe_rps": 4990.0,
        "target_observe_rps": 5000.0,
        "predict_errors": 3,
        "observe_errors": 2,
        "errors": 5,
        "rss_mb_start": 290.0,
        "rss_mb_end": 400.0,
    }
    print_report(report, as_json=False)
    out = capsys.readouterr().out
    assert "errors: 3 prediction calls (failed, timed out or answered ≥ 400), 2 observation posts" in out


def test_the_feeder_counts_posts_to_a_service_that_is_gone_as_errors() -> None:
    """A refused reconnect inside the feeder's `except OSError` ended the feeder with a traceback of its own."""
    import socket

    from leadtime.bench.load import observe
    from leadtime.bench.serving import load_entries

    with socket.socket() as closed:  # bound and not listening: a connection to it is refused
        closed.bind(("127.0.0.1", 0))
        out = [0, 0, 0.0]
        observe(closed.getsockname()[1], load_entries()[:200], 400.0, 1.0, out)
    accepted, errors, seconds = out
    assert accepted == 0 and 3 <= errors <= 5 and seconds >= 1.0, out


def test_a_feeder_that_did_not_finish_is_an_error_not_zero_observations() -> None:
    """Its figures stayed [0, 0, 0.0]: a run reported `achieved_observe_rps: 0.0` with `errors: 0`."""
    from types import SimpleNamespace

    from leadtime.bench.load import feeder_figures

    with pytest.raises(RuntimeError, match=r"the observation feeder failed \(exit code 1\)"):
        feeder_figures(SimpleNamespace(exitcode=1), [0, 0, 0.0])
    with pytest.raises(RuntimeError, match="the observation feeder did not finish"):
        feeder_figures(SimpleNamespace(exitcode=None), [0, 0, 0.0])
    assert feeder_figures(SimpleNamespace(exitcode=0), [400, 1, 1.0]) == (400, 1, 1.0)


def test_bench_load_says_in_one_line_that_the_service_stopped_mid_run() -> None:
    """`kill -9` of the service mid-run ended `bench load` in a 280-line traceback (httpx.ConnectError is not an
    OSError), with no report, and the feeder's own traceback above it."""
    require_wrk()
    command = [sys.executable, "-m", "leadtime", "bench", "load", "--duration", "6"]
    command += ["--predict-rps", "40", "--observe-rps", "400"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    lines: list[str] = []
    while not lines or not lines[-1].startswith("driving "):  # the measured run has begun
        lines.append(process.stderr.readline())
        assert lines[-1], (lines, process.communicate())
    time.sleep(1.5)
    kill_service_expecting_one_line(process)


def test_the_achieved_rate_counts_only_the_calls_answered_in_time_below_400() -> None:
    """wrk's `requests` counts every answered call, those answered ≥ 400 and those past its timeout with them: a
    service answering every call 503 was reported as achieving the target rate."""
    from leadtime.bench.load import served_calls

    summary = {"requests": 228, "connect": 0, "read": 0, "write": 0, "status": 200, "timeout": 8}
    assert served_calls(summary) == 20
    assert served_calls({**summary, "status": 228, "timeout": 0}) == 0
    assert served_calls({**summary, "status": 0, "timeout": 0, "read": 5}) == 228  # read errors are not in requests


def test_the_feeder_ends_with_the_run_at_a_rate_below_one_batch_per_run() -> None:
    """At `--observe-rps 1` a 100-row batch is due every 100 s: the feeder slept until the next one, past the run's
    end and the minute it is waited for, and `bench load --duration 3` failed after 63 s with "the observation
    feeder did not finish"."""
    import socket

    from leadtime.bench.load import observe
    from leadtime.bench.serving import load_entries

    with socket.socket() as closed:  # bound and not listening: each post is refused at once
        closed.bind(("127.0.0.1", 0))
        out = [0, 0, 0.0]
        observe(closed.getsockname()[1], load_entries()[:200], 0.01, 1.0, out)  # a batch due every 10,000 s
    accepted, errors, seconds = out
    assert accepted == 0 and errors == 1 and 1.0 <= seconds < 60, out


def test_a_run_too_short_for_one_batch_posts_smaller_ones_at_the_rate_asked() -> None:
    """With the bound of the feeder's sleep alone, `--observe-rps 1 --duration 3` sent one 100-row batch: 33
    rows/s achieved for a target of 1."""
    from leadtime.bench.load import OBSERVE_BATCH, batch_rows

    assert batch_rows(5_000, 60) == OBSERVE_BATCH
    assert batch_rows(1, 3) == 3 and batch_rows(10, 60) == OBSERVE_BATCH and batch_rows(0.01, 1) == 1
