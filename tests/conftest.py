"""Shared fixtures: a real Redis server per test, and the CI rule that tests of real servers (redis-server,
prometheus) must run there, not skip."""

from __future__ import annotations

import importlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from catalog_yaml import CATALOG_YAML
from redis_server import RedisServer, find_redis_server


def require_redis_server() -> str:
    """The redis-server binary; skip without it locally, but fail under CI=true, where the tests must run."""
    executable = find_redis_server()
    if executable is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; with CI=true the Redis tests must run, not skip", pytrace=False)
        pytest.skip(message)
    return executable


def require_prometheus() -> str:
    """The prometheus binary; skip without it locally, but fail under CI=true, where the tests must run."""
    from leadtime.bench.procs import find_prometheus

    executable = find_prometheus()
    if executable is None:
        message = "prometheus is not installed (apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; with CI=true the Prometheus tests must run, not skip", pytrace=False)
        pytest.skip(message)
    return executable


def require_module(name: str) -> Any:
    """Import `name`, a dependency of the `test` extra; skip without it locally, but fail under CI=true, where
    the extra is installed and the tests must run."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        message = f"{name} is not installed (pip install -e '.[test]'): {err}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; with CI=true the tests needing it must run, not skip", pytrace=False)
        pytest.skip(message)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server on a free loopback port; tests may `stop()` and `restart()` it on that port."""
    server = RedisServer(require_redis_server(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def catalog_file(tmp_path: Path) -> Path:
    """A deployment's catalog file (`catalog_yaml.CATALOG_YAML`): B200 and L4 classes, a Qwen2.5-7B model."""
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG_YAML)
    return path


@pytest.fixture
def ctrl_c_as_a_terminal_gives_it() -> Iterator[None]:
    """Ctrl-C (SIGINT) at Python's default for the test, as a terminal gives it: a suite started in the background
    from a shell without job control inherits it ignored, and so do the processes it spawns, so the tests of what
    Ctrl-C does failed there (the interrupt never came)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
