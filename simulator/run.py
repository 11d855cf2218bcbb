"""`leadtime simulate`: load a fleet and a workload, run each policy on identical traffic, report."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from leadtime.data import describe_os_error
from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.router_plugin.config import SHIPPED_CONFIG, PickerConfig, load_config, profile_of
from leadtime.router_plugin.heuristics import LeastQueuePolicy, LlmdHeuristicPolicy, RandomPolicy, RoundRobinPolicy
from leadtime.router_plugin.peers.dynamo_kv import DynamoKvPolicy
from leadtime.router_plugin.peers.sglang_cache import SglangCachePolicy
from leadtime.router_plugin.policy import RoutingPolicy
from leadtime.simulator.clairvoyant import ClairvoyantPolicy
from leadtime.simulator.engine import FleetSimulator, SimResult
from leadtime.simulator.fleet import Fleet, load_fleet
from leadtime.simulator.learning_policies import (
    LEADTIME_POLICIES,
    PROFILE_PREFIX,
    REPLICATED_POLICIES,
    SHADOW_POLICIES,
    learning_factories,
    profile_policy,
)
from leadtime.simulator.report import (
    OBSERVATIONS_FILE,
    REPORT_FILE,
    summarize,
    write_observations,
    write_plots,
    write_report,
)
from leadtime.simulator.workload import (
    WorkloadRequest,
    arrival_rate_rps,
    arrival_window_s,
    load_workload,
    require_arrival_window,
    shape,
    spread_steps,
)

# Every policy the simulator can run, by its name in results (the benchmark's JSON keys).
POLICIES: dict[str, Callable[[int], RoutingPolicy]] = {
    "round_robin": lambda seed: RoundRobinPolicy(),
    "least_queue": lambda seed: LeastQueuePolicy(seed),
    "llmd_heuristic": lambda seed: LlmdHeuristicPolicy(seed=seed),
    "llmd_heuristic_ready": lambda seed: LlmdHeuristicPolicy(seed=seed, ready_only=True),
    "dynamo_kv": lambda seed: DynamoKvPolicy(seed=seed),
    "sglang_cache": lambda seed: SglangCachePolicy(seed=seed),
    "clairvoyant": lambda seed: ClairvoyantPolicy(),
    "random": lambda seed: RandomPolicy(seed),
}
POLICY_NAMES = (*POLICIES, "llmd_predicted", *LEADTIME_POLICIES, *REPLICATED_POLICIES, *SHADOW_POLICIES)
# Other spellings the CLI accepts (hyphens for underscores, and the older short names).
ALIASES = {"llm-d": "llmd_heuristic", "llmd": "llmd_heuristic"}


def policy_name(name: str) -> str:
    """The canonical name of a policy as a user may spell it (`round-robin` → `round_robin`, `llm-d` → ...);
    `profile:NAME` names a profile of the plugin configuration as it is written."""
    if name.startswith(PROFILE_PREFIX):
        return name
    canonical = ALIASES.get(name, name.replace("-", "_"))
    if canonical not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
    return canonical


def policy_names(names: Sequence[str]) -> list[str]:
    """The canonical names of the policies as a user lists them, each once: a policy given twice (`round_robin`
    and `round-robin`, `llm-d` and `llmd`) ran twice, and its observations were written twice under one name."""
    given: dict[str, str] = {}
    for name in names:
        canonical = policy_name(name)
        if canonical in given:
            raise ValueError(
                f"policy {name!r} is {canonical}, given already as {given[canonical]!r}: give each policy once"
            )
        given[canonical] = name
    return list(given)


def make_policy(
    name: str, seed: int = 0, fleet: Fleet | None = None, config: PickerConfig | None = None
) -> RoutingPolicy:
    """A fresh policy by name (see POLICY_NAMES; hyphen spellings accepted, and `profile:NAME` for a profile of
    `config`, the shipped plugins.yaml by default); a learning policy is built for the fleet it will route (its KV
    links, its default classes) and starts cold."""
    canonical = policy_name(name)
    if canonical in POLICIES:
        return POLICIES[canonical](seed)
    if fleet is None:
        raise ValueError(f"policy {name!r} learns: it needs the fleet it routes")
    if canonical.startswith(PROFILE_PREFIX):
        return profile_policy(canonical[len(PROFILE_PREFIX) :], config or load_config(SHIPPED_CONFIG), fleet, seed)
    return learning_factories(fleet, seed)[canonical]()


class OutputsError(Exception):
    """A file of `--out` could not be written (or a plot drawn) once the runs were done. It carries the report,
    which the caller still prints: a run of minutes is not lost to a plot, and the files written before stay."""

    def __init__(self, report: dict[str, object], problem: str) -> None:
        super().__init__(problem)
        self.report = report


@dataclass(frozen=True)
class SimulationOptions:
    """Seed and SLOs of a simulation."""

    seed: int = 0
    ttft_slo_ms: float = 2000.0
    itl_slo_ms: float = 100.0
    config: PickerConfig | None = None
    """The plugin configuration `profile:NAME` policies come from (None: the shipped plugins.yaml)."""
    catalog: Catalog = BUILT_IN
    """The accelerator classes and models the fleet's pools may name (`--catalog FILE`)."""
    spread_steps: bool = False
    """Spread the requests that share a timestamp over the trace's timestamp step (`workload.spread_steps`), as
    the demo and the benchmarks replay a trace (`--spread-steps`); else they arrive at one instant, as recorded."""


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
        policy = make_policy(name, options.seed, fleet, options.config)
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
    on_workload: Callable[[list[WorkloadRequest]], None] | None = None,
) -> dict[str, object]:
    """The whole command: returns the JSON report and writes observations, the report and plots under `out`, in
    that order: the plots last, as the likeliest to fail (`OutputsError`, which carries the report).

    `on_workload(requests)` is given the requests as replayed before the runs, for what a caller says of them.
    """
    policies = policy_names(policies)
    profiles = [name[len(PROFILE_PREFIX) :] for name in policies if name.startswith(PROFILE_PREFIX)]
    if profiles:  # a profile the configuration lacks is named before the fleet and the trace are read
        config = options.config or load_config(SHIPPED_CONFIG)
        for profile in profiles:
            profile_of(config, profile)
    fleet = load_fleet(fleet_path, options.catalog)
    loaded = load_workload(str(trace_path), options.seed, max_requests)
    if options.spread_steps:
        loaded = spread_steps(loaded, options.seed)
    workload = shape(loaded, rate_scale=rate_scale, max_requests=max_requests)
    require_arrival_window(workload, str(trace_path), max_requests)
    if on_workload is not None:
        on_workload(workload)
    results = run_policies(fleet, workload, policies, options, progress)
    report: dict[str, object] = {
        "fleet": fleet.name,
        "trace": str(trace_path),
        "requests": len(workload),
        "arrival_window_s": arrival_window_s(workload),
        "arrival_rate_rps": arrival_rate_rps(workload),
        "rate_scale": rate_scale,
        "seed": options.seed,
        "policies": {r.policy: summarize(r) for r in results},
    }
    if out is not None:
        report["outputs"] = _write_outputs(report, results, out)
    return report


def _write_outputs(report: dict[str, object], results: list[SimResult], out: Path) -> dict[str, object]:
    """Write the observations, the report and the plots under `out`; what `report["outputs"]` says of them."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        rows = write_observations(results, out / OBSERVATIONS_FILE)
        write_report(report, out / REPORT_FILE)
        plots = write_plots(results, out)
    except OSError as err:
        raise OutputsError(report, describe_os_error(err)) from err
    except Exception as err:  # matplotlib's own (a figure it cannot draw): the report is kept all the same
        raise OutputsError(report, f"the plots could not be drawn ({err})") from err
    files = [out / OBSERVATIONS_FILE, out / REPORT_FILE, *plots]
    return {"observations": rows, "files": [str(p) for p in files]}
