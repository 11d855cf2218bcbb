"""`leadtime bench serving`'s pieces that need no server: inputs, percentiles and the printed report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from leadtime.bench.serving import (
    FEED_BATCH,
    FEED_PERIOD_S,
    load_entries,
    percentiles,
    prediction_rows,
    print_report,
    run_serving,
)


def test_inputs_are_llmd_rows_without_actuals() -> None:
    entries = load_entries()
    assert len(entries) >= 1000
    rows = prediction_rows(entries[:5])
    assert all("actual_ttft_ms" in e for e in entries[:5])
    assert all(not any(k.startswith("actual_") for k in r) for r in rows)


def test_inputs_are_the_shipped_h200_trace() -> None:
    # The rows that ship in the project, not a file beside the checkout (a clone with nothing beside it measured
    # synthetic rows instead).
    from leadtime.bench.data import dataset_path, load_llmd_rows

    assert load_entries() == load_llmd_rows(dataset_path("sharegpt-h200"))


def test_percentiles_are_in_milliseconds() -> None:
    samples = [0.001] * 98 + [0.010, 0.020]
    p = percentiles(samples)
    assert p["p50_ms"] == pytest.approx(1.0)
    assert 1.0 < p["p99_ms"] <= 20.0


def test_report_prints_as_json_or_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    cell = {"p50_ms": 1.0, "p99_ms": 2.0}
    report = {
        "calls": 10,
        "cpus": 2,
        "load_average_1m_before": 0.5,
        "load_average_1m_after": 0.7,
        "http": {f"rows_{n}": cell for n in (1, 10, 100)},
        "grpc": {f"rows_{n}": cell for n in (1, 10, 100)},
        "ingest_samples_per_s": 61000,
        "burst": {
            "rows": 60000,
            "accepted_per_s": 61000,
            "learned_per_s": 9000,
            "accepted_total": 70000,
            "learned_total": 52000,
            "thinned_total": 18000,
            "dropped_total": 0,
        },
        "ingestion": {
            "sustained_per_s": 20000,
            "seconds_per_step": 10.0,
            "steps": [
                {
                    "target_per_s": 20000,
                    "accepted_per_s": 20000,
                    "learned_per_s_during": 19900,
                    "pending_at_end": 900,
                    "thinned_or_dropped": 0,
                    "settled": True,
                    "sustained": True,
                },
                {
                    "target_per_s": 30000,
                    "accepted_per_s": 29000,
                    "learned_per_s_during": 22000,
                    "pending_at_end": 70000,
                    "thinned_or_dropped": 5000,
                    "settled": True,
                    "sustained": False,
                },
            ],
        },
        "while_learning": {
            "http_rows_100": cell,
            "grpc_rows_100": cell,
            "retrains_completed": 2,
            "observations_fed_per_s": 2000,
            "handler_rows_100_ms": cell,
        },
        "handler_rows_100_ms": cell,
        "stack_floor": {"http_rows_100": cell, "grpc_rows_100": cell},
        "stack_floor_with_equal_work": {"http_rows_100": cell, "grpc_rows_100": cell, "work_us": 1000},
        "stack_floor_beside_busy_cpu": {"http_rows_100": cell, "grpc_rows_100": cell},
        "stack_floor_with_equal_work_beside_busy_cpu": {"http_rows_100": cell, "grpc_rows_100": cell, "work_us": 1000},
    }
    print_report(report, as_json=True)
    assert json.loads(capsys.readouterr().out) == report
    print_report(report, as_json=False)
    text = capsys.readouterr().out
    assert "100 rows" in text and "2 retrains" in text and "2,000 observations/s" in text
    assert "accepted at 61,000/s, learned at 9,000/s" in text and "18,000 thinned" in text
    assert "paced 30,000/s" in text and "-> not" in text and "nothing thinned or dropped: 20,000 rows/s" in text
    assert "the bare stack" in text and "busy 1000 µs" in text and "processing_time_ms" in text
    assert "busy 1000 µs beside a CPU-bound process" in text


def test_the_benchmark_runs_end_to_end_against_a_real_service_process() -> None:
    report = run_serving(calls=30, progress=False, sustain_rates=(2_000, 1_000_000), sustain_seconds=2.0)
    for protocol in ("http", "grpc"):
        for n in (1, 10, 100):
            cell = report[protocol][f"rows_{n}"]
            assert 0 < cell["p50_ms"] <= cell["p99_ms"]
    assert report["ingest_samples_per_s"] > 0
    burst = report["burst"]
    assert burst["learned_total"] + burst["thinned_total"] + burst["dropped_total"] == burst["accepted_total"]
    steps = report["ingestion"]["steps"]
    assert steps[0]["sustained"] and steps[0]["thinned_or_dropped"] == 0  # 2,000 rows/s is kept whole
    assert not steps[-1]["sustained"]  # a million rows/s is not reached by one client
    assert report["ingestion"]["sustained_per_s"] == steps[0]["accepted_per_s"]
    w = report["while_learning"]  # only what the feeder posted while the calls were timed: 60 calls may see none
    assert 0 <= w["observations_fed"] <= (w["seconds"] / FEED_PERIOD_S + 1) * FEED_BATCH, w
    assert w["retrained_while_timed"] == (w["retrains_completed"] > 0)
    for cell in (*report["stack_floor"].values(), *report["stack_floor_beside_busy_cpu"].values()):
        assert 0 < cell["p50_ms"] <= cell["p99_ms"]
    assert 0 < report["handler_rows_100_ms"]["p50_ms"] <= report["handler_rows_100_ms"]["p99_ms"]
    for key in ("stack_floor_with_equal_work", "stack_floor_with_equal_work_beside_busy_cpu"):
        work = report[key]
        assert work["work_us"] == round(report["while_learning"]["handler_rows_100_ms"]["p50_ms"] * 1e3)
        # The busy floor really works that long per call.
        assert work["http_rows_100"]["p50_ms"] >= work["work_us"] / 1e3


def test_settings_reach_the_measured_service_and_nothing_else_of_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from leadtime.bench.serving import ServiceProcess

    monkeypatch.setenv("LEADTIME_ROLE", "training")  # the caller's own setting: not for the measured service
    service = ServiceProcess(settings={"learner_cpus": "off", "snapshot_interval_s": "1"})
    try:
        # Read once the service answers: right after the fork the child may not have exec'd yet, and its
        # environ would still be empty.
        service.wait_ready()
        environ = Path(f"/proc/{service.process.pid}/environ").read_bytes().split(b"\0")
        assert b"LEADTIME_LEARNER_CPUS=off" in environ and b"LEADTIME_SNAPSHOT_INTERVAL_S=1" in environ
        assert not any(item.startswith(b"LEADTIME_ROLE=") for item in environ)
    finally:
        service.stop()


def test_a_setting_that_is_not_one_is_refused_by_the_cli() -> None:
    process = subprocess.run(
        [sys.executable, "-m", "leadtime", "bench", "serving", "--setting", "nonsense=1"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        timeout=60,
    )
    message = process.stderr.decode().strip()
    assert process.returncode == 2 and "nonsense=1" in message and "Traceback" not in message


def test_the_timed_window_starts_only_once_the_feeder_feeds() -> None:
    """A feeder that has posted lets the timing start; one that ended without posting is named, not waited on."""
    import multiprocessing

    from leadtime.bench.serving import wait_until_feeding

    context = multiprocessing.get_context("spawn")
    posted = context.Value("q", 0)
    quitter = context.Process(target=int)  # ends at once, having posted nothing
    quitter.start()
    quitter.join(30)
    with pytest.raises(RuntimeError, match="stopped before feeding"):
        wait_until_feeding(quitter, posted)
    posted.value = 500
    wait_until_feeding(quitter, posted)  # something was posted: no wait


def test_the_while_learning_cell_counts_only_what_happened_while_it_was_timed() -> None:
    """The feeder's rate counted the batch posted before the clock started (and one after it stopped) over the
    timed seconds only, and the retrains were counted from before the 60,000-row burst."""
    import time
    from types import SimpleNamespace

    from leadtime.bench.serving import timed_while_feeding

    posted = SimpleNamespace(value=FEED_BATCH)  # the first batch, posted before the clock starts
    retrains = iter([7, 7])  # 7 retrains since the burst, none while timed

    def calls() -> str:
        time.sleep(0.2)
        posted.value += 2 * FEED_BATCH
        return "timed"

    result, cell = timed_while_feeding(calls, posted, lambda: next(retrains))
    assert result == "timed"
    assert cell["observations_fed"] == 2 * FEED_BATCH
    assert 0.2 <= cell["seconds"] < 0.5
    assert cell["observations_fed_per_s"] == pytest.approx(2 * FEED_BATCH / cell["seconds"], rel=0.01)
    assert cell["retrains_completed"] == 0 and cell["retrained_while_timed"] is False

    retrains = iter([7, 9])
    _, cell = timed_while_feeding(calls, posted, lambda: next(retrains))
    assert cell["retrains_completed"] == 2 and cell["retrained_while_timed"] is True


def test_a_while_learning_cell_without_a_retrain_is_said_to_be_one() -> None:
    from leadtime.bench.serving import no_retrain_warning

    assert no_retrain_warning({"retrained_while_timed": True, "retrains_completed": 1}, 2000) is None
    message = no_retrain_warning({"retrained_while_timed": False, "retrains_completed": 0}, 100)
    assert message is not None and message.startswith("no retrain completed during the 100 + 100 calls timed while")


def test_bench_serving_says_in_one_line_that_the_service_stopped_mid_run() -> None:
    """`kill -9` of the service while the observation feeder started ended `bench serving` in the feeder's own
    traceback (ConnectionRefusedError) and "the observation feeder stopped before feeding (exit code 1)", which
    blamed the feeder; `bench load` says it as the service stopping, and so does this now."""
    import time

    from child_processes import children, kill_service_expecting_one_line

    command = [sys.executable, "-m", "leadtime", "bench", "serving", "--calls", "10"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    lines: list[str] = []
    while not lines or not lines[-1].startswith("accepted "):  # the burst is in: the feeder starts next
        lines.append(process.stderr.readline())
        assert lines[-1], (lines, process.communicate())
    deadline = time.monotonic() + 30
    while not children(process.pid, lambda entry: b"spawn_main" in (entry / "cmdline").read_bytes()):
        assert time.monotonic() < deadline, "no feeder process started"
        time.sleep(0.05)
    kill_service_expecting_one_line(process)
