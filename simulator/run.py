"""`leadtime simulate`: load a fleet and a workload, run each policy on identical traffic, report."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from leadtime.router_plugin.heuristics import LeastQueuePolicy, LlmdHeuristicPolicy, RandomPolicy, RoundRobinPolicy
from leadtime.router_plugin.policy import RoutingPolicy
from leadtime.simulator.clairvoyant import ClairvoyantPolicy
from leadtime.simulator.engine import FleetSimulator, SimResult
from leadtime.simulator.fleet import Fleet, load_fleet
from leadtime.simulator.learning_policies import LEADTIME_POLICIES, learning_factories
from leadtime.simulator.report import summarize, write_observations, write_plots
from leadtime.simulator.workload import WorkloadRequest, load_workload, shape

POLICY_NAMES = ("random", "round-robin", "least-queue", "llm-d", "clairvoyant", *LEADTIME_POLICIES)


def make_policy(name: str, seed: int = 0, fleet: Fleet | None = None) -> RoutingPolicy:
    """A fresh policy by name (see POLICY_NAMES); learning policies need the fleet they will route."""
    factories: dict[str, Callable[[], RoutingPolicy]] = {
        "random": lambda: RandomPolicy(seed),
        "round-robin": RoundRobinPolicy,
        "least-queue": lambda: LeastQueuePolicy(seed),
        "llm-d": lambda: LlmdHeuristicPolicy(seed=seed),
        "clairvoyant": ClairvoyantPolicy,
    }
    factories.update(
        {
            "round_robin": factories["round-robin"],
            "least_queue": factories["least-queue"],
            "llmd_heuristic": factories["llm-d"],
        }
    )
    if fleet is not None:
        factories.update(learning_factories(fleet, seed))
    if name not in factories:
        if name in LEADTIME_POLICIES:
            raise ValueError(f"policy {name!r} learns: it needs the fleet it routes")
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    return factories[name]()


@dataclass(frozen=True)
class SimulationOptions:
    seed: int = 0
    ttft_slo_ms: float = 2000.0
    itl_slo_ms: float = 100.0


def run_policies(
    fleet: Fleet,
    workload: Sequence[WorkloadRequest],
    policies: Sequence[str],
    options: SimulationOptions = SimulationOptions(),
    progress: Callable[[str, int, int], None] | None = None,
) -> list[SimResult]:
    """Run every policy on the same workload and fleet, each from a fresh state.

    `progress(policy, completed, total)` is called now and then.
    """
    results = []
    total = len(workload)
    for name in policies:
        policy = make_policy(name, options.seed, fleet)
        tick = (lambda n, name=name: progress(name, n, total)) if progress is not None else None
        sim = FleetSimulator(
            fleet,
            workload,
            policy,
            seed=options.seed,
            ttft_slo_ms=options.ttft_slo_ms,
            tpot_slo_ms=options.itl_slo_ms,
            progress=tick,
        )
        results.append(sim.run())
    return results


def simulate(
    fleet_path: str | Path,
    trace_path: str,
    policies: Sequence[str],
    max_requests: int | None = None,
    rate_scale: float = 1.0,
    options: SimulationOptions = SimulationOptions(),
    out: Path | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, object]:
    """The whole command: returns the JSON report and writes observations and plots under `out`."""
    for name in policies:
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    fleet = load_fleet(fleet_path)
    loaded = load_workload(str(trace_path), options.seed, max_requests)
    workload = shape(loaded, rate_scale=rate_scale, max_requests=max_requests)
    results = run_policies(fleet, workload, policies, options, progress)
    report: dict[str, object] = {
        "fleet": fleet.name,
        "trace": str(trace_path),
        "requests": len(workload),
        "rate_scale": rate_scale,
        "seed": options.seed,
        "slo": {
            "ttft_ms": options.ttft_slo_ms,
            "itl_ms": options.itl_slo_ms,
            "classes": [{"share": c.share, "ttft_ms": c.ttft_ms, "itl_ms": c.itl_ms} for c in fleet.slos],
        },
        "policies": {r.policy: summarize(r) for r in results},
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        rows = write_observations(results, out / "observations.jsonl")
        plots = write_plots(results, out)
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        report["outputs"] = {"observations": rows, "files": [str(p) for p in plots]}
    return report
