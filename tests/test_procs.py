"""Ports for the servers the end-to-end tests start."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from leadtime.bench.procs import LOWEST_PORT, ephemeral_port_start, free_port, free_ports


def _top() -> int:
    start = ephemeral_port_start()
    return start if start > LOWEST_PORT + 1 else 65536  # an ephemeral range that starts low leaves no room below


def test_servers_listen_below_the_range_that_outgoing_connections_take_their_ports_from() -> None:
    # Outgoing connections (the tests' own HTTP clients) get source ports from the ephemeral range: a port found
    # free there can be taken before the server binds it.
    start, top = ephemeral_port_start(), _top()
    ports = {free_port() for _ in range(20)}
    assert all(LOWEST_PORT <= p < top for p in ports) and len(ports) > 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # what the kernel hands out instead
        assert s.getsockname()[1] >= start


def test_consecutive_free_ports_are_all_bindable() -> None:
    base = free_ports(5)
    assert base >= LOWEST_PORT and base + 5 <= _top()
    sockets = [socket.socket() for _ in range(5)]
    try:
        for i, s in enumerate(sockets):
            s.bind(("127.0.0.1", base + i))
    finally:
        for s in sockets:
            s.close()


def test_a_port_handed_out_is_not_handed_out_again_before_its_server_binds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The predictor's HTTP and gRPC ports, the fleet's range and each gateway's port are picked before any of them
    is bound, each found free on its own: a process could be given one port twice (7 of 2,000 gateway-benchmark
    phases were), and the second server failed to start."""
    import leadtime.bench.procs as procs

    first = free_port()
    offset, real = first - LOWEST_PORT, procs.secrets.randbelow
    draws = iter([offset, offset - 1, offset - 2])  # each base's span of 3 holds `first`; then random ones
    monkeypatch.setattr(procs.secrets, "randbelow", lambda below: next(draws, None) or real(below))
    second = free_ports(3)
    assert next(draws, None) is None and first not in range(second, second + 3), (first, second)


def test_a_sigterm_while_a_child_starts_leaves_it_recorded_to_be_stopped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The benchmarks' SIGTERM handler raises SystemExit wherever it lands: landing inside `Popen`, after the fork,
    it left the child started and recorded nowhere, so nothing stopped it (the test of `bench tls` under SIGTERM
    left a `leadtime serve` running with no parent)."""
    import leadtime.bench.procs as procs
    from leadtime.cli.common import _terminated

    sleeper = tmp_path / "sleeper"  # stands in for `python -m leadtime ...`: a child that runs on
    sleeper.write_text("#!/bin/sh\nexec sleep 60\n")
    sleeper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(sleeper))
    created: list[int] = []
    execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def then_sigterm(self: subprocess.Popen[bytes], *args: object) -> None:
        execute(self, *args)
        created.append(self.pid)
        os.kill(os.getpid(), signal.SIGTERM)  # lands before Popen returns

    monkeypatch.setattr(subprocess.Popen, "_execute_child", then_sigterm)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with pytest.raises(SystemExit):
            procs.Child(["serve"], tmp_path / "child.log")
    finally:
        signal.signal(signal.SIGTERM, previous)
        for pid in created:  # whatever the outcome, nothing of this test runs on
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert len(created) == 1 and created[0] in {process.pid for process in procs.started}
