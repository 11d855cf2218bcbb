"""The benchmark commands stopped by a signal: SIGTERM ends a run as Ctrl-C does, its temporary folders removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from child_processes import children_named
from conftest import require_module


def test_sigterm_removes_the_run_s_temporary_folder_and_exits_143(tmp_path: Path) -> None:
    """`timeout 10 leadtime bench tls` left /tmp/leadtime-bench-tls-* behind (Ctrl-C removed it)."""
    require_module("cryptography")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "leadtime", "bench", "tls", "--calls", "100", "--first-calls", "10"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("leadtime-bench-tls-*")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # the command alone, as `kill PID` does: it stops its own children
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr.decode()[-2000:]
    assert "Traceback" not in stderr.decode()
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_bench_load_stops_wrk_and_the_feeder_quietly(tmp_path: Path) -> None:
    """wrk was left running with init as its parent, driving load at a closed port, and the observation feeder
    printed two ConnectionRefusedError tracebacks as the service went away under it."""
    from test_bench_load import require_wrk

    require_wrk()
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "leadtime", "bench", "load", "--duration", "30"]
    command += ["--predict-rps", "50", "--observe-rps", "200", "--json"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    wrk: list[int] = []
    while len(wrk) < 2:  # the warm-up's wrk, then the measured run's, which the feeder runs beside
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        wrk = sorted({*wrk, *children_named(process.pid, "wrk")})
        time.sleep(0.05)
    time.sleep(2.0)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr.decode()[-2000:]
    assert "Traceback" not in stderr.decode(), stderr.decode()[-3000:]
    time.sleep(0.5)
    assert not [pid for pid in wrk if Path(f"/proc/{pid}").exists()], "wrk outlived the benchmark"
