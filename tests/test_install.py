"""Leadtime outside its checkout: the wheel installs one top-level package, and its commands work from anywhere.

The wheel is built from this checkout and installed with `--target` into a temporary folder; an interpreter
started there sees that folder and the test environment's dependencies, but neither the checkout nor its
editable install, and runs in a temporary working directory with nothing beside it.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from leadtime.bench.procs import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the wheel, a folder holding only what the wheel installed)."""
    dist = tmp_path_factory.mktemp("dist")
    # pip builds in the source tree, and setuptools would leave build/ there (and ship whatever a stale build/
    # held): build from a copy of the checkout's tracked folders instead.
    source = tmp_path_factory.mktemp("source") / "leadtime-src"
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "dist", "out", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
        ),
    )
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("leadtime-*.whl")
    target = tmp_path_factory.mktemp("target")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    return wheel, target


def _env(target: Path) -> dict[str, str]:
    """The installed copy first, then the dependencies; site-packages' .pth files (the editable install) unread."""
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEADTIME_") and k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(target), *deps])
    return env


def _leadtime(target: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-S", "-m", "leadtime", *args],
        cwd=cwd,
        env=_env(target),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_wheel_installs_only_the_leadtime_package(installed: tuple[Path, Path]) -> None:
    wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/", 1)[0] for name in archive.namelist()}
        names = set(archive.namelist())
    name, version = wheel.name.split("-")[:2]
    assert top == {"leadtime", f"{name}-{version}.dist-info"}
    for shipped in (
        "data/measured/sharegpt-h200.jsonl",
        "data/traces/mooncake_conversation_trace.jsonl",
        "data/traces/AzureLLMInferenceTrace_conv_2023.csv",
        "data/README.md",
        "data/calibration/h100_sxm_vllm0.14_gemm_bf16.csv",
        "simulator/fleets/mixed.yaml",
        "simulator/coefficients.json",
        "predictor/grpc/leadtime.proto",
        "dashboards/leadtime-predictor.json",
        "dashboards/leadtime-router.json",
        "dashboards/README.md",
        "dashboards/provisioning/prometheus.yml",
        "dashboards/provisioning/dashboards/leadtime.yaml",
        "dashboards/provisioning/datasources/leadtime-prometheus.yaml",
        "py.typed",  # a user's mypy reads the package's types (it skipped them as untyped)
    ):
        shipped = f"leadtime/{shipped}"
        assert shipped in names, shipped
    # The licence the metadata names ships with it.
    assert f"{name}-{version}.dist-info/licenses/LICENSE" in names
    metadata = zipfile.ZipFile(wheel).read(f"{name}-{version}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata


def test_the_dependency_floors_admit_no_grpc_or_protobuf_the_generated_code_refuses() -> None:
    """`grpcio>=1.62` and `protobuf>=4.25` installed, and the service crashed at import: the committed modules
    check the versions they were generated with."""
    import tomllib

    from leadtime.predictor.grpc import leadtime_pb2_grpc

    generated = (ROOT / "predictor" / "grpc" / "leadtime_pb2.py").read_text()
    gencode = generated.split("# Protobuf Python Version: ", 1)[1].split()[0]
    needed = {"grpcio": leadtime_pb2_grpc.GRPC_GENERATED_VERSION, "protobuf": gencode}
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {d.split(">=")[0]: d.split(">=")[1] for d in dependencies if ">=" in d}
    for package, version in needed.items():
        assert _version(floors[package]) >= _version(version), (package, floors[package], version)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_the_installed_package_is_the_one_imported(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, target = installed
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import leadtime.features, leadtime.data; print(leadtime.features.__file__)"],
        cwd=tmp_path,
        env=_env(target),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).is_relative_to(target)


def test_version_demo_and_simulate_run_from_an_empty_directory(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, target = installed
    version = _leadtime(target, tmp_path, "--version")
    assert version.returncode == 0 and version.stdout.startswith("leadtime "), version.stderr
    demo = _leadtime(target, tmp_path, "demo", "--quick", timeout=300)
    assert demo.returncode == 0, demo.stderr
    assert any((tmp_path / "out" / "demo").glob("*.png"))
    sim = _leadtime(target, tmp_path, "simulate", "--fleet", "mixed", "--max-requests", "50", "--json")
    assert sim.returncode == 0, sim.stderr
    assert '"requests": 50' in sim.stdout
    missing = _leadtime(target, tmp_path, "simulate", "--fleet", "mixed", "--trace", "nowhere.jsonl")
    assert missing.returncode == 2
    assert "nowhere.jsonl: no such file" in missing.stderr and "Errno" not in missing.stderr


def test_the_dashboards_written_by_the_installed_package_are_the_shipped_ones(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    _, target = installed
    build = _leadtime(target, tmp_path, "dashboards", "build", "--out", "grafana")
    assert build.returncode == 0, build.stderr
    for name in ("leadtime-predictor.json", "leadtime-router.json"):
        assert (tmp_path / "grafana" / name).read_bytes() == (target / "leadtime" / "dashboards" / name).read_bytes()


def test_serve_answers_healthz_from_an_empty_directory(installed: tuple[Path, Path], tmp_path: Path) -> None:
    _, target = installed
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-S", "-m", "leadtime", "serve", "--port", str(port), "--grpc-port", "0"],
        cwd=tmp_path,
        env=_env(target),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        answer = None
        while time.monotonic() < deadline and answer is None:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            except httpx.TransportError:
                assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
                time.sleep(0.2)
        assert answer is not None and answer.status_code == 200 and answer.json() == {"status": "ok"}
    finally:
        process.terminate()
        process.wait(timeout=30)
