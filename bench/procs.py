"""Leadtime's commands as child processes on loopback: mock endpoints, the predictor service, the gateway; and a
real Prometheus scraping them.

The gateway benchmark and the end-to-end tests run the real programs, as a user would, each in its own process:
`leadtime sim serve` (writing its fleet as an llm-d discovery file), `leadtime serve`, `leadtime route`,
`prometheus` (Debian's package) for the dashboards.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

LOWEST_PORT = 10000
"""Servers started here listen between this and the start of the kernel's ephemeral range (Linux: 32768 by
default), from which it hands out the source ports of outgoing connections: a port found free in that range can be
taken by a test's own HTTP client before the server binds it, and the server fails to start."""


def ephemeral_port_start() -> int:
    """The first port of the range the kernel picks source ports of outgoing connections from."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


HANDED_OUT_KEPT = 1024
"""How many of the ports it handed out last a process does not hand out again: those whose servers may not have
bound them yet (a benchmark picks a dozen before its first server has started)."""
_handed_out: dict[int, None] = {}  # in the order handed out: the oldest are forgotten first
_handing_out = threading.Lock()


def free_ports(n: int = 1) -> int:
    """A base port with `n` free ports after it, below the ephemeral range (`leadtime sim serve` takes consecutive
    ports). Chosen at random, so that test workers starting servers at the same moment rarely try the same one, and
    none this process handed out lately (`HANDED_OUT_KEPT`): found free only because their servers had not bound
    them yet, one was handed out twice and its second server failed to start."""
    top = ephemeral_port_start() - n
    if top <= LOWEST_PORT:  # an ephemeral range that starts low: any port above LOWEST_PORT
        top = 65536 - n
    with _handing_out:
        for _ in range(200):
            base = LOWEST_PORT + secrets.randbelow(top - LOWEST_PORT)
            span = range(base, base + n)
            if not any(port in _handed_out for port in span) and all(_bindable(port) for port in span):
                _handed_out.update(dict.fromkeys(span))
                while len(_handed_out) > HANDED_OUT_KEPT:
                    del _handed_out[next(iter(_handed_out))]
                return base
    raise OSError(f"no {n} consecutive free ports")


def free_port() -> int:
    """A free loopback port below the ephemeral range (see `LOWEST_PORT`)."""
    return free_ports(1)


started: list[subprocess.Popen[Any]] = []
"""The children `start` started that may still run: each is killed at exit if it does (`stop_started`), so that a
caller that dies half-way leaves no server, no load generator and no CPU-bound neighbour behind."""


def stop_started() -> None:
    """At exit: SIGKILL each child `start` started that still runs."""
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


atexit.register(stop_started)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT noted while the block runs and acted on after it. A benchmark's SIGTERM handler raises
    SystemExit wherever it lands: inside `Popen`, after the fork, it left the child started and recorded nowhere, a
    server running on with no parent. (Only the main thread receives signals and may set their handlers.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    held = (signal.SIGTERM, signal.SIGINT)
    previous = {number: signal.signal(number, lambda number, _frame: noted.append(number)) for number in held}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
        if noted:
            signal.raise_signal(noted[0])  # to the handler in place again: SystemExit, KeyboardInterrupt, ...


def start(args: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(args, **popen)`, recorded in `started` before any SIGTERM or SIGINT that came meanwhile
    is acted on (`_signals_held`): however the caller ends, the child is stopped at the latest at exit."""
    with _signals_held():
        started[:] = [process for process in started if process.returncode is None]  # forget those reaped
        process = subprocess.Popen(args, **popen)
        started.append(process)
    return process


def quietly(target: Callable[..., object], *args: object) -> None:
    """The entry of a benchmark's worker process (`multiprocessing`): `target(*args)`, ending quietly on Ctrl-C.
    Ctrl-C reaches the whole process group: the parent stops the run, cleans up and exits 130, and a traceback
    from each worker would only bury that. (SIGINT is not ignored instead: the parent would then wait at exit for
    a worker with a fixed schedule to finish it.)"""
    with contextlib.suppress(KeyboardInterrupt):
        target(*args)


def terminate(process: subprocess.Popen[bytes]) -> None:
    """Stop `process` as a user would (SIGTERM), with SIGKILL after 15 s; nothing if it has already exited."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


EXITING_S = 2.0
"""How long a service that broke a connection is given to show its exit: its sockets close as it dies, a moment
before the kernel reports it gone."""


def stopped(process: subprocess.Popen[bytes], wait_s: float = 0.0, name: str = "the service") -> str | None:
    """What became of a benchmark's service (or the process `name` says) that has exited (its exit code, or the
    signal that killed it), given `wait_s` to finish exiting; None while it runs."""
    try:
        code = process.wait(timeout=wait_s) if wait_s > 0 else process.poll()
    except subprocess.TimeoutExpired:
        code = None
    if code is None:
        return None
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return f"{name} stopped during the run ({how})"


@contextlib.contextmanager
def said_as_stopped(process: subprocess.Popen[bytes]) -> Iterator[None]:
    """Whatever fails in the block while `process`, the measured service, has stopped is said as its stopping: one
    line naming its exit code or signal, not the error of the call, the feeder or the load generator it broke (a
    traceback, or a line blaming the feeder). A service that runs on but does not answer is said as that."""
    try:
        yield
    except Exception as err:
        if (gone := stopped(process, EXITING_S)) is not None:
            raise RuntimeError(gone) from err
        if isinstance(err, httpx.HTTPError):
            raise RuntimeError(f"the service did not answer: {err}") from err
        import grpc  # here: most benchmarks never load it

        if isinstance(err, grpc.RpcError) and isinstance(err, grpc.Call):
            raise RuntimeError(f"the service did not answer a gRPC call: {err.code().name} {err.details()}") from err
        raise


class Child:
    """A `leadtime ...` command in a child process, its output in a log file."""

    def __init__(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.log = log
        environment = {k: v for k, v in os.environ.items() if not k.startswith("LEADTIME_")}
        environment.update(env or {})
        self._out = log.open("wb")
        self.process: subprocess.Popen[bytes] = start(  # stopped at exit if the caller dies half-way
            [sys.executable, "-m", "leadtime", *args], stdout=self._out, stderr=subprocess.STDOUT, env=environment
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_until(
        self, url: str, timeout_s: float = 60.0, status: int = 200, verify: ssl.SSLContext | bool = True
    ) -> None:
        """Until GET `url` answers `status` (or the process dies: RuntimeError with its output); an https `url` is
        verified with `verify` (an SSL context trusting the service's certificate)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"leadtime {' '.join(self.args)} exited {self.process.returncode}:\n{self.output()[-3000:]}"
                )
            try:
                if httpx.get(url, timeout=1.0, verify=verify).status_code == status:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{url} did not answer {status} within {timeout_s:.0f} s:\n{self.output()[-3000:]}")

    def kill(self) -> None:
        """Stop at once (SIGKILL), as a crash would."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._out.close()

    def stop(self) -> None:
        terminate(self.process)
        self._out.close()


class SimFleet:
    """`leadtime sim serve` on consecutive free ports; its discovery file and time-slice URL. With `tls`
    (certificate, key), the endpoints serve HTTPS; with `catalog`, a catalog file, its pools may be of classes
    only that file knows."""

    def __init__(
        self,
        fleet: str | Path,
        workdir: Path,
        seed: int = 0,
        tls: tuple[Path, Path] | None = None,
        catalog: Path | None = None,
    ) -> None:
        from leadtime.features.catalog import BUILT_IN
        from leadtime.features.catalog_file import load_catalog
        from leadtime.simulator.fleet import load_fleet

        parsed = load_fleet(fleet, BUILT_IN if catalog is None else load_catalog(catalog))
        self.size = len(parsed.endpoints)
        self.base_port = free_ports(self.size + 1)
        self.endpoints_file = workdir / "endpoints.yaml"
        self.endpoints_file.unlink(missing_ok=True)
        args = ["sim", "serve", "--fleet", str(fleet), "--base-port", str(self.base_port)]
        args += ["--endpoints-file", str(self.endpoints_file), "--seed", str(seed)]
        if tls is not None:
            args += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        if catalog is not None:
            args += ["--catalog", str(catalog)]
        self.timeslice_url = (
            f"http://127.0.0.1:{self.base_port + self.size}/v1/timeslice/groups" if parsed.timeslice_groups else None
        )
        self.child = Child(args, workdir / "sim.log")
        deadline = time.monotonic() + 60
        while not self.endpoints_file.exists():
            if self.child.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"leadtime sim serve did not start:\n{self.child.output()[-3000:]}")
            time.sleep(0.1)
        self.endpoints = yaml.safe_load(self.endpoints_file.read_text())["endpoints"]

    def url(self, name: str) -> str:
        entry = next(e for e in self.endpoints if e["name"] == name)
        scheme = entry.get("labels", {}).get("leadtime.io/scheme", "http")
        return f"{scheme}://{entry['address']}:{entry['port']}"

    def stop(self) -> None:
        self.child.stop()


class Predictor:
    """`leadtime serve` on free HTTP and gRPC ports: in-memory store, or Redis at `redis_url`; `env` sets other
    `LEADTIME_*` settings (e.g. {"LEADTIME_RETRAIN_EVERY": "50"}); with `tls` (certificate, key), HTTPS and gRPC
    over TLS."""

    def __init__(
        self,
        workdir: Path,
        accelerator: str = "h100-sxm",
        model: str = "llama-3.1-8b",
        redis_url: str | None = None,
        env: dict[str, str] | None = None,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.grpc = f"127.0.0.1:{self.grpc_port}"
        args = ["serve", "--host", "127.0.0.1", "--port", str(self.port), "--grpc-port", str(self.grpc_port)]
        args += ["--accelerator", accelerator, "--model", model]
        if redis_url is not None:
            args += ["--redis", redis_url]
        if tls is not None:
            args += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        self.child = Child(args, workdir / f"predictor-{self.port}.log", env)

    def wait(self) -> Predictor:
        from leadtime.predictor.client import tls_client_context

        verify = tls_client_context(self.tls[0]) if self.tls is not None else True
        self.child.wait_until(f"{self.url}/readyz", verify=verify)
        return self


class Route:
    """`leadtime route` on a free port."""

    def __init__(self, workdir: Path, args: Sequence[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.child = Child(["route", "--port", str(self.port), *args], workdir / f"route-{self.port}.log")

    def wait(self) -> Route:
        self.child.wait_until(f"{self.url}/readyz")
        return self

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 if none). A gateway that has stopped, or does
        not answer, is a RuntimeError saying so in one line: httpx's errors are no OSError, and the benchmark
        that reads its figures here would end in their traceback."""
        from leadtime.features.vllm_metrics import parse_samples

        try:
            text = httpx.get(f"{self.url}/metrics", timeout=5).text
        except httpx.HTTPError as err:
            gone = stopped(self.child.process, EXITING_S, "the gateway (leadtime route)")
            raise RuntimeError(gone or f"the gateway (leadtime route) did not answer /metrics: {err}") from err
        samples = parse_samples(text)
        return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def find_prometheus() -> str | None:
    """Path of the `prometheus` binary (Debian's package installs /usr/bin/prometheus), or None."""
    return shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None)


class Prometheus:
    """A real `prometheus` on a free loopback port with `config` (a parsed prometheus.yml), its data in `workdir`."""

    def __init__(self, executable: str, workdir: Path, config: dict[str, object]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workdir = workdir
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        (workdir / "tsdb").mkdir(exist_ok=True)
        self.log = workdir / "prometheus.log"
        self._out = self.log.open("wb")
        self.process: subprocess.Popen[bytes] = start(
            [
                executable,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1d",
                "--log.level=warn",
            ],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
        atexit.register(self.stop)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until /-/ready answers 200 (RuntimeError with its log if it exits or takes longer)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.process.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus was not ready within {timeout_s:.0f} s:\n{self.output()[-3000:]}")

    def wait_targets_up(self, timeout_s: float = 30.0) -> None:
        """Until every configured target has been scraped successfully at least once."""
        deadline = time.monotonic() + timeout_s
        targets: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            targets = httpx.get(f"{self.url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            if targets and all(t["health"] == "up" for t in targets):
                return
            time.sleep(0.2)
        states = {str(t["scrapeUrl"]): (t["health"], t.get("lastError")) for t in targets}
        raise RuntimeError(f"prometheus targets not all up within {timeout_s:.0f} s: {states}")

    def stop(self) -> None:
        terminate(self.process)
        self._out.close()
