"""A real `redis-server` process for tests: free loopback port, temp dir, no persistence, stoppable mid-test.

Outage tests kill it (SIGKILL, as a crash would) and start it again on the same port, so clients that hold the
URL see the same server come back, empty, as a restarted Redis without persistence would be.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import redis

from leadtime.bench.procs import free_port


def find_redis_server() -> str | None:
    """Path of the redis-server binary, or None if it is not installed."""
    return shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)


class RedisServer:
    """One redis-server child process bound to 127.0.0.1:`port`, with its files in `workdir`."""

    def __init__(
        self,
        executable: str,
        workdir: Path,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        client_options: Mapping[str, Any] | None = None,
    ) -> None:
        """`extra_args` go to redis-server after the defaults (a password, TLS); `client_options` to the redis-py
        client that waits for its PONG (the password, TLS options)."""
        self.executable = executable
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.extra_args = list(extra_args)
        self.client_options = dict(client_options or {})
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and return once it answers PING."""
        if self.running:
            return
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self._process = subprocess.Popen(
            [
                self.executable,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--daemonize",
                "no",
                "--protected-mode",
                "yes",
                *self.extra_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        log.close()
        client = redis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5, **self.client_options
        )
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._process.poll() is not None:
                    tail = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server exited with {self._process.returncode}:\n{tail}")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server gave no PONG on port {self.port} in {timeout_s} s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        """Kill the server at once (SIGKILL, like a crash) and wait until it is gone."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.kill()  # SIGKILL ends a paused (SIGSTOPped) server too
        self._process.wait(timeout=10)
        self._process = None

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections still open, nothing answers, as a hung host would."""
        assert self._process is not None, "the server is not running"
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server run on; it then executes whatever clients sent while it was frozen."""
        assert self._process is not None, "the server is not running"
        self._process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Come back on the same port, empty (no persistence), as after a crash."""
        self.stop()
        self.start()
