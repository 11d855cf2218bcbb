"""Simulator speed: replay the Mooncake trace on a 16-endpoint fleet and time it.

`leadtime bench sim --json` → {"requests_per_wall_s": N, "wall_s": ..., ...}. The issue's target is a
10,000-request replay in under a minute on the development machine.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

from leadtime.json_text import print_json
from leadtime.simulator.fleet import load_fleet
from leadtime.simulator.run import SimulationOptions, run_policies
from leadtime.simulator.workload import load_workload, shape


def run_bench(fleet_path: str | Path, trace_path: str, requests: int, policy: str = "llm-d") -> dict[str, object]:
    """Replay `requests` requests of the trace on the fleet under one policy and time it."""
    start = time.perf_counter()
    fleet = load_fleet(fleet_path)
    workload = shape(load_workload(trace_path, 0, requests), max_requests=requests)
    loaded = time.perf_counter()
    (result,) = run_policies(fleet, workload, [policy], SimulationOptions())
    end = time.perf_counter()
    return {
        "requests": len(workload),
        "endpoints": len(fleet.endpoints),
        "policy": policy,
        "wall_s": end - start,
        "load_s": loaded - start,
        "simulate_s": end - loaded,
        "requests_per_wall_s": len(workload) / (end - start),
        "simulated_s": result.duration_ms / 1e3,
        "completed": len(result.completed),
        "python": platform.python_version(),
    }


def print_report(report: dict[str, object], as_json: bool) -> None:
    """The report as JSON, or as one line."""
    if as_json:
        print_json(report)
        return
    print(
        f"{report['requests']} requests on {report['endpoints']} endpoints: {report['wall_s']:.1f} s wall "
        f"({report['requests_per_wall_s']:.0f} requests/s; {report['simulated_s']:.0f} s simulated)"
    )
