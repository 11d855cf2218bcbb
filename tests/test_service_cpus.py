"""CPU placement (LEADTIME_LEARNER_CPUS): the plan, its refusals, and real pinning of threads and the learner."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from leadtime.predictor.service.cpus import CpuPlan, CpuPlanError, parse_cpu_list, plan_cpus
from leadtime.predictor.settings import ServiceSettings

ROOT = Path(__file__).resolve().parent.parent
TWO_CPUS = len(os.sched_getaffinity(0)) >= 2 if hasattr(os, "sched_getaffinity") else False


def test_cpu_lists_read_like_taskset() -> None:
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("2-4") == {2, 3, 4}
    assert parse_cpu_list("0,2-3") == {0, 2, 3}
    with pytest.raises(CpuPlanError, match="empty range"):
        parse_cpu_list("3-2")


def test_auto_gives_the_learner_the_highest_cpu_and_needs_two() -> None:
    assert plan_cpus("auto", frozenset({0, 1})) == CpuPlan(serving=frozenset({0}), learner=frozenset({1}))
    assert plan_cpus("auto", frozenset({2, 5, 7})) == CpuPlan(serving=frozenset({2, 5}), learner=frozenset({7}))
    assert plan_cpus("auto", frozenset({0})) is None
    assert plan_cpus("off", frozenset({0, 1})) is None


def test_explicit_cpus_must_be_available_and_leave_one_for_serving() -> None:
    assert plan_cpus("0", frozenset({0, 1})) == CpuPlan(serving=frozenset({1}), learner=frozenset({0}))
    with pytest.raises(CpuPlanError, match="CPU 7 is not available"):
        plan_cpus("1,7", frozenset({0, 1}))
    with pytest.raises(CpuPlanError, match="leaves no CPU for serving"):
        plan_cpus("0-1", frozenset({0, 1}))


def test_the_default_is_auto_from_four_cpus_and_off_below() -> None:
    assert ServiceSettings().learner_cpus is None
    assert plan_cpus(None, frozenset({0, 1})) is None
    assert plan_cpus(None, frozenset({0, 1, 2})) is None
    assert plan_cpus(None, frozenset({0, 1, 2, 3})) == CpuPlan(serving=frozenset({0, 1, 2}), learner=frozenset({3}))
    assert plan_cpus("auto", frozenset({0, 1})) is not None  # asked for, it splits two CPUs too


def test_the_setting_is_checked() -> None:
    assert ServiceSettings.from_env(env={"LEADTIME_LEARNER_CPUS": "1,3"}).learner_cpus == "1,3"
    for bad in ("all", "1;2", "-1", "1-"):
        with pytest.raises(ValidationError, match="learner_cpus"):
            ServiceSettings(learner_cpus=bad)


def test_an_unavailable_cpu_stops_serve_with_one_line() -> None:
    cpu = max(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEADTIME_")}
    env["LEADTIME_LEARNER_CPUS"] = str(cpu)
    process = subprocess.run(
        [sys.executable, "-m", "leadtime", "serve", "--port", "0", "--grpc-port", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
    )
    message = process.stderr.decode().strip()
    assert process.returncode == 2, message
    assert f"CPU {cpu} is not available" in message and "Traceback" not in message


_PIN_ALL_THREADS = """
import os, threading, time
from leadtime.predictor.service.cpus import pin_process
started = threading.Event()
def idle():
    started.set()
    time.sleep(5)
threading.Thread(target=idle, daemon=True).start()
started.wait()
pin_process(frozenset({0}))
tasks = os.listdir("/proc/self/task")
late = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0))))
late.start(); late.join()
print(len(tasks), sorted({c for t in tasks for c in os.sched_getaffinity(int(t))}))
"""


@pytest.mark.skipif(not TWO_CPUS, reason="pinning needs a machine with two CPUs to show anything")
def test_pin_process_moves_every_running_thread_and_those_started_later() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PIN_ALL_THREADS], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    assert out[0] == "[0]"  # a thread started after pinning inherits it
    threads, cpus = out[1].split(" ", 1)
    assert int(threads) >= 2 and cpus == "[0]"


@pytest.mark.skipif(not TWO_CPUS, reason="pinning needs a machine with two CPUs to show anything")
def test_the_learner_process_runs_on_the_cpus_it_was_given() -> None:
    from fastapi.testclient import TestClient

    from leadtime.predictor.service.app import create_app

    learner_cpu = max(os.sched_getaffinity(0))
    with TestClient(create_app(ServiceSettings(learner_cpus=str(learner_cpu)))) as client:
        runtime = client.app.state.runtime  # type: ignore[attr-defined]
        assert runtime.cpu_plan.learner == {learner_cpu}
        process = runtime.learner._process
        assert process is not None
        deadline = time.monotonic() + 30
        while os.sched_getaffinity(process.pid) != {learner_cpu} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.sched_getaffinity(process.pid) == {learner_cpu}
        assert len(os.sched_getaffinity(0)) >= 2  # the test process itself (in-process app) is not pinned


def test_a_range_past_the_usable_cpus_is_refused_before_it_is_expanded() -> None:
    """`0-99999999999` was expanded CPU by CPU before it was compared with the usable ones: `leadtime serve` hung,
    taking memory, rather than refusing it."""
    with pytest.raises(CpuPlanError, match="LEADTIME_LEARNER_CPUS: CPU 99999999999 is not available"):
        plan_cpus("0-99999999999", frozenset({0, 1}))
