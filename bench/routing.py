"""`leadtime bench routing`: every router a user could pick instead, and Leadtime, side by side on six fleets.

For each fleet the same requests (the first `max_requests` of the trace, arrivals spread over the trace's
timestamp steps, see `simulator.workload.spread_steps`) are replayed at two rates: a base rate that loads the
fleet to `LOAD_TARGET` of its capacity, and 1.5× that (other multiples of the base rate on request, `load_name`).
A fleet's capacity is measured, not configured: the highest rate at which, under least-queue routing, it
completes requests as fast as they arrive (at least `KEEP_UP` of the arrivals in the middle half of the window
complete within it), found by bisection on the first `CAPACITY_PROBE` requests with the trace's own arrival
pattern. Every policy sees the same requests, seed and SLOs (each request's SLO class is drawn by the fleet
file's `slos` from its id). Goodput is the number of requests that met both of their SLOs per second of the
arrival window.

`decision_ms` is the CPU time of each routing decision (the policy's own cost, whatever else shares the
machine), `decision_wall_ms` its wall-clock time. Runs go to `workers` processes; with `seeds` > 1 every figure
is the mean over seeds `seed`..`seed`+K−1, with its range beside it. With `follow_llmd`, Leadtime's cells also
report `llmd_mape_on_same_requests`: llm-d's predictor following Leadtime's picks (`shadow.FollowedByLlmd`), so
that both predictors are measured on the same requests and load.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from functools import lru_cache
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from leadtime.json_text import print_json
from leadtime.plots import LEADTIME, draw_cdf, policy_colour, shared_legend

if TYPE_CHECKING:
    from leadtime.simulator.fleet import SloClass

FLEETS = ("homogeneous", "mixed", "pd", "pd_hetero", "timesliced", "large")
PEERS = ("round_robin", "least_queue", "llmd_heuristic", "llmd_predicted", "dynamo_kv", "sglang_cache")
REFERENCE = "clairvoyant"
ABLATIONS: dict[str, tuple[str, ...]] = {
    "leadtime_no_inflight": FLEETS,
    "leadtime_no_hardware": ("mixed", "large"),
    "leadtime_decode_first": ("pd", "pd_hetero"),
    "leadtime_no_timeslice": ("timesliced",),
    "leadtime_no_decode_harm": ("homogeneous", "mixed", "timesliced", "large"),
}
VARIANTS: dict[str, tuple[str, ...]] = {
    "leadtime_in_turn": FLEETS,
    "leadtime_overflow_timesliced": ("timesliced",),
    "leadtime_hold": FLEETS,
    "leadtime_x4": FLEETS,
    "leadtime_x4_shared": FLEETS,
    "round_robin_shadow": FLEETS,
    "least_queue_shadow": FLEETS,
}
"""Run only when asked for by `--policy`: Leadtime with an option that is off by default, and plain policies with
Leadtime's predictor learning beside them (`router_plugin.shadow`: their goodput is the plain policy's, their
prediction error is what a predictor learns from traffic it does not route)."""
LEARNING = ("llmd_predicted", LEADTIME, *ABLATIONS, *VARIANTS)
LOADS = {"base": 1.0, "high": 1.5}
LOAD_TARGET = 0.85
CAPACITY_PROBE = 2000
RELIABLE_PROBE = 1000
"""Fewer requests than this in the capacity search, and the capacity found (so every rate run) varies with their
count: a warning says the comparison is less reliable."""
MIN_REQUESTS = 100
"""The fewest requests a run replays (`--max-requests` and the trace alike)."""
CAPACITY_STEPS = 5
KEEP_UP = 0.95
AFTER_JOIN_S = 120.0
"""On a fleet that scales out, `after_join_goodput_rps` counts the requests arriving in this long after the join
that met their SLOs, per second of the window: cut at the last arrival when the arrivals end sooner (as
goodput's own window is the arrival window), and reported beside it as `after_join_window_s`."""
DEFAULT_SLO_MS = (2000.0, 100.0)  # (TTFT, ITL) for a fleet file that states no SLO classes


@dataclass(frozen=True)
class RoutingOptions:
    trace: str = "mooncake"
    max_requests: int = 3000
    seed: int = 0
    seeds: int = 1
    fleets: tuple[str, ...] = FLEETS
    policies: tuple[str, ...] | None = None  # None: every policy that applies to the fleet
    workers: int = 2
    follow_llmd: bool = False  # also measure llm-d's predictor on the requests Leadtime routed (`shadow`)
    loads: tuple[float, ...] = tuple(LOADS.values())  # multiples of the base rate


def load_name(factor: float) -> str:
    """The report's key for a load of `factor` times the base rate: the benchmark's own two by their names.

    >>> load_name(1.0), load_name(1.5), load_name(1.2)
    ('base', 'high', '1.2x')
    """
    for name, known in LOADS.items():
        if math.isclose(factor, known):
            return name
    return f"{factor:g}x"


def check_loads(factors: Sequence[float]) -> dict[str, float]:
    """The loads to run by their report keys; a factor that is no positive finite number, or two that would
    share a key, are refused (ValueError) before anything runs.

    >>> check_loads([1.0, 1.2])
    {'base': 1.0, '1.2x': 1.2}
    """
    loads: dict[str, float] = {}
    for factor in factors:
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"--load must be > 0 and finite, got {factor}")
        name = load_name(factor)
        if name in loads:
            raise ValueError(f"--load: each load once ({name} was given twice)")
        loads[name] = factor
    if not loads:
        raise ValueError("--load: at least one load")
    return loads


def report_loads(fleet_report: dict[str, Any]) -> list[str]:
    """The loads a fleet's report holds, in the order they were run."""
    return [key for key in fleet_report if key != "capacity_rps"]


def policies_for(fleet: str, only: Sequence[str] | None = None) -> list[str]:
    """The policies run on `fleet`: the peers, the clairvoyant reference, Leadtime and the ablations that act there;
    of those and the variants, the ones in `only` when it is given."""
    names = [*PEERS, REFERENCE, LEADTIME, *(a for a, where in ABLATIONS.items() if fleet in where)]
    if only is None:
        return names
    names += [v for v, where in VARIANTS.items() if fleet in where]
    return [n for n in names if n in only]


def selected_policies(names: Sequence[str], fleets: Sequence[str]) -> tuple[str, ...]:
    """The policies a user asked for, by their canonical names (spelled as `leadtime simulate` takes them); a name
    that is no benchmark policy, or an ablation that acts on none of `fleets`, is refused (ValueError) rather
    than silently running nothing."""
    from leadtime.simulator.run import policy_name

    known = [*PEERS, REFERENCE, LEADTIME, *ABLATIONS, *VARIANTS]
    chosen = []
    for name in names:
        try:
            canonical = policy_name(name)  # the simulator's spellings: hyphens, and its older short names
        except ValueError:
            canonical = name
        if canonical not in known:
            raise ValueError(f"--policy {name!r}: not a benchmark policy (known: {', '.join(known)})")
        where = ABLATIONS.get(canonical, VARIANTS.get(canonical, FLEETS))
        if not any(f in where for f in fleets):
            raise ValueError(f"--policy {name!r} runs only on {', '.join(where)} (its feature acts only there)")
        chosen.append(canonical)
    return tuple(chosen)


# ----- one simulation -----------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _fleet(name: str) -> Any:
    from leadtime.simulator.fleet import load_fleet

    return load_fleet(name)


@lru_cache(maxsize=16)
def _trace(trace: str, max_requests: int, seed: int) -> tuple[Any, ...]:
    from leadtime.simulator.workload import load_workload, shape, spread_steps

    return tuple(shape(spread_steps(load_workload(trace, seed, max_requests), seed), max_requests=max_requests))


def check_trace(options: RoutingOptions) -> tuple[int, list[str]]:
    """(how many requests each fleet replays, warnings about them), checked before any simulation: a trace of fewer
    than `MIN_REQUESTS` requests, or whose requests all arrive at one instant, is refused (ValueError; there is no
    capacity to search for), one too short for a reliable capacity search is warned of."""
    from leadtime.simulator.workload import require_arrival_window

    requests = _trace(options.trace, options.max_requests, options.seed)
    if len(requests) < MIN_REQUESTS:
        raise ValueError(
            f"{options.trace}: {len(requests)} request{'s' if len(requests) != 1 else ''}; the routing benchmark "
            f"replays at least {MIN_REQUESTS}"
        )
    require_arrival_window(requests, options.trace, options.max_requests)
    probe = min(len(requests), CAPACITY_PROBE)
    if probe >= RELIABLE_PROBE:
        return len(requests), []
    more = "; replay more (--max-requests)" if len(requests) == options.max_requests else " (the whole trace)"
    return len(requests), [
        f"the capacity search runs on {probe} requests (fewer than {RELIABLE_PROBE:,}): the capacity it finds varies "
        f"with their count, so the rates run, and the comparison, are less reliable{more}"
    ]


def _at_rate(requests: Sequence[Any], rate_rps: float) -> list[Any]:
    """The same requests with their arrival times scaled to `rate_rps` on average."""
    span = requests[-1].arrival_ms - requests[0].arrival_ms
    scale = (len(requests) - 1) / (span / 1e3) / rate_rps if span > 0 else 1.0
    return [replace(r, arrival_ms=(r.arrival_ms - requests[0].arrival_ms) * scale) for r in requests]


def _keeps_up(fleet: Any, probe: Sequence[Any], rate_rps: float, seed: int) -> bool:
    """Whether the fleet, under least-queue routing, completes requests as fast as they arrive at `rate_rps`:
    over the middle half of the arrival window it must complete at least `KEEP_UP` of what arrived."""
    from leadtime.simulator.engine import FleetSimulator
    from leadtime.simulator.run import make_policy

    workload = _at_rate(probe, rate_rps)
    result = FleetSimulator(fleet, workload, make_policy("least-queue", seed, fleet), seed=seed).run()
    start, end = workload[len(workload) // 4].arrival_ms, workload[3 * len(workload) // 4].arrival_ms
    arrived = sum(start <= r.arrival_ms < end for r in workload)
    completed = sum(start <= c.arrival_ms + c.e2e_ms < end for c in result.completed)
    return completed >= KEEP_UP * arrived


def capacity_rps(fleet_name: str, trace: str, max_requests: int, seed: int) -> float:
    """The highest arrival rate the fleet keeps up with (least-queue routing, the trace's own arrival pattern):
    found by doubling or halving from the trace's recorded rate, then `CAPACITY_STEPS` bisections."""
    fleet = _fleet(fleet_name)
    from leadtime.simulator.workload import arrival_window_s

    probe = list(_trace(trace, max_requests, seed))[: min(CAPACITY_PROBE, max_requests)]
    span_s = arrival_window_s(probe)
    rate = (len(probe) - 1) / span_s if span_s > 0 else 1.0
    low, high = None, None
    for _ in range(12):
        if _keeps_up(fleet, probe, rate, seed):
            low, rate = rate, rate * 2.0
        else:
            high, rate = rate, rate / 2.0
        if low is not None and high is not None:
            break
    if low is None or high is None:
        raise RuntimeError(f"{fleet_name}: could not bracket the fleet's capacity")
    for _ in range(CAPACITY_STEPS):
        middle = math.sqrt(low * high)
        if _keeps_up(fleet, probe, middle, seed):
            low = middle
        else:
            high = middle
    return low


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def _mape(pairs: list[tuple[float, float]]) -> float | None:
    if not pairs:
        return None
    actual = np.array([a for a, _ in pairs])
    predicted = np.array([p for _, p in pairs])
    return float(np.mean(np.abs(predicted - actual) / actual))


def cell_metrics(result: Any, learning: bool) -> dict[str, Any]:
    """One policy's figures on one fleet and load, as the JSON reports them.

    A request the fleet could not serve (`SimResult.failed`, counted in `failed`) missed its SLOs: it counts in
    `slo_attainment`'s denominator, as in `leadtime simulate`, or a policy that drops requests would read as
    attaining more than one that serves them late. It has no latency, so the latency percentiles (`ttft_ms`,
    `itl_ms`) are over the completed requests only.
    """
    done = result.completed
    met = [c for c in done if c.meets_slo]
    itl = [c.itl_ms for c in done if c.output_tokens > 1]
    ttft = [c.ttft_ms for c in done]
    metrics: dict[str, Any] = {
        "goodput_rps": result.goodput_rps,
        "slo_attainment": len(met) / max(len(done) + len(result.failed), 1),
        "failed": len(result.failed),
        "ttft_ms": {
            "p50": _percentile([c.ttft_ms for c in done], 50),
            "p99": _percentile([c.ttft_ms for c in done], 99),
        },
        "itl_ms": {"p50": _percentile(itl, 50), "p99": _percentile(itl, 99)},
        "decision_ms": {"p50": _percentile(result.decision_ms, 50), "p99": _percentile(result.decision_ms, 99)},
        "decision_wall_ms": {
            "p50": _percentile(result.decision_wall_ms, 50),
            "p99": _percentile(result.decision_wall_ms, 99),
        },
    }
    if learning:
        ttft = [
            (o.actual_ttft_ms, o.predicted_ttft_ms)
            for o in result.observations
            if o.actual_ttft_ms > 0 and o.predicted_ttft_ms is not None
        ]
        tpot = [
            (o.actual_tpot_ms, o.predicted_tpot_ms)
            for o in result.observations
            if o.actual_tpot_ms > 0 and o.predicted_tpot_ms is not None
        ]
        metrics["prediction_mape"] = {"ttft": _mape(ttft), "tpot": _mape(tpot)}
    if result.join_ms > 0:
        end_ms = result.join_ms + AFTER_JOIN_S * 1e3
        # Every request ends completed or failed (the simulator raises otherwise): the last of them arrived last.
        last_ms = max((r.arrival_ms for r in (*done, *result.failed)), default=result.join_ms)
        window_s = max(min(end_ms, last_ms) - result.join_ms, 0.0) / 1e3
        after = [c for c in done if result.join_ms <= c.arrival_ms < end_ms]
        # No arrival after the join (a pool joining after the last): no rate, rather than a 0 read as a collapse.
        metrics["after_join_goodput_rps"] = sum(c.meets_slo for c in after) / window_s if window_s > 0 else None
        metrics["after_join_window_s"] = window_s
        # The decision-time target is stated for the grown fleet: its decisions apart from the smaller fleet's.
        grown = [ms for ms, at in zip(result.decision_ms, result.decision_at_ms, strict=True) if at >= result.join_ms]
        metrics["decision_ms_after_join"] = {"p50": _percentile(grown, 50), "p99": _percentile(grown, 99)}
    return metrics


@dataclass(frozen=True)
class Cell:
    fleet: str
    load: str
    rate_rps: float
    policy: str
    seed: int
    trace: str
    max_requests: int
    follow_llmd: bool = False


def run_cell(cell: Cell) -> tuple[Cell, dict[str, Any], Any]:
    """Simulate one (fleet, load, policy, seed); returns its metrics and what the plots need."""
    from leadtime.bench.shadow import FollowedByLlmd
    from leadtime.simulator.engine import FleetSimulator
    from leadtime.simulator.learning_policies import llmd_predicted_policy
    from leadtime.simulator.run import make_policy

    fleet = _fleet(cell.fleet)
    workload = _at_rate(_trace(cell.trace, cell.max_requests, cell.seed), cell.rate_rps)
    policy = make_policy(cell.policy, cell.seed, fleet)
    followed = None
    if cell.follow_llmd and cell.policy == LEADTIME:
        policy = followed = FollowedByLlmd(policy, llmd_predicted_policy(fleet, cell.seed))
    result = FleetSimulator(
        fleet, workload, policy, seed=cell.seed, ttft_slo_ms=DEFAULT_SLO_MS[0], tpot_slo_ms=DEFAULT_SLO_MS[1]
    ).run()
    metrics = cell_metrics(result, cell.policy in LEARNING)
    if followed is not None:
        metrics["llmd_mape_on_same_requests"] = {
            "ttft": _mape(followed.ttft_pairs),
            "tpot": _mape(followed.tpot_pairs),
        }
    curves: dict[str, Any] = {
        "ttft_ms": sorted(c.ttft_ms for c in result.completed),
        "itl_ms": sorted(c.itl_ms for c in result.completed if c.output_tokens > 1),
    }
    if cell.policy in LEARNING:  # what was predicted beside what happened, in completion order
        curves["ttft_pred"] = [
            (o.actual_ttft_ms, o.predicted_ttft_ms)
            for o in result.observations
            if o.actual_ttft_ms > 0 and o.predicted_ttft_ms is not None
        ]
        curves["tpot_pred"] = [
            (o.actual_tpot_ms, o.predicted_tpot_ms)
            for o in result.observations
            if o.actual_tpot_ms > 0 and o.predicted_tpot_ms is not None
        ]
    return cell, metrics, curves


def ceiling_rps(fleet_name: str, options: RoutingOptions, rate_rps: float, seed: int) -> float:
    """The goodput no policy can pass on this fleet and load (simulator.feasible): the requests that would meet
    their SLOs with the fleet to themselves, per second of the arrival window."""
    from leadtime.simulator.feasible import ceiling_goodput_rps

    workload = _at_rate(_trace(options.trace, options.max_requests, seed), rate_rps)
    return ceiling_goodput_rps(_fleet(fleet_name), workload, seed, DEFAULT_SLO_MS[0], DEFAULT_SLO_MS[1])


# ----- the whole benchmark ------------------------------------------------------------------------------


_RANGED = ("goodput_rps", "slo_attainment", "failed", "after_join_goodput_rps")
"""The figures given with their range over seeds: a mean alone hides one seed's collapse (or, for `failed`, which
seeds dropped requests)."""


def _mean_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each figure over seeds, with `<name>_range` [min, max] beside those in `_RANGED`."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = _mean_metrics([r[key] for r in runs])
        elif value is None or any(r[key] is None for r in runs):
            out[key] = None
        else:
            values = [float(r[key]) for r in runs]
            out[key] = float(np.mean(values))
            if key in _RANGED and len(runs) > 1:
                out[f"{key}_range"] = [min(values), max(values)]
    return out


@contextlib.contextmanager
def _workers(count: int) -> Iterator[ProcessPoolExecutor | None]:
    """A pool of `count` processes, or None to run everything here (one worker)."""
    if count <= 1:
        yield None
        return
    with ProcessPoolExecutor(count, mp_context=get_context("spawn")) as pool:
        yield pool


def _search_capacities(
    pool: Any, searches: list[tuple[str, str, int, int]], progress: Callable[[int, int, str], None] | None
) -> list[float]:
    """`capacity_rps` of each search, in their order, on the workers if any; each found is told to `progress` (the
    searches are a good share of a short run: a bar with no total for that long reads as a hang)."""
    found: dict[int, float] = {}

    def tell(i: int) -> None:
        if progress is not None:
            fleet, _, _, seed = searches[i]
            progress(len(found), len(searches), f"capacity of {fleet} (seed {seed})")

    if pool is None:
        for i, search in enumerate(searches):
            found[i] = capacity_rps(*search)
            tell(i)
    else:
        futures = {pool.submit(capacity_rps, *search): i for i, search in enumerate(searches)}
        for future in as_completed(futures):
            found[futures[future]] = future.result()
            tell(futures[future])
    return [found[i] for i in range(len(searches))]


def run_routing(
    options: RoutingOptions = RoutingOptions(),
    progress: Callable[[int, int, str], None] | None = None,
) -> tuple[dict[str, Any], dict[tuple[str, str, str], Any]]:
    """(the JSON report, the latency curves of seed `options.seed` per (fleet, load, policy))."""
    loads = check_loads(options.loads)
    requests, warnings = check_trace(options)
    seeds = list(range(options.seed, options.seed + options.seeds))
    started = time.perf_counter()
    rates: dict[tuple[str, int], float] = {}
    capacity: dict[str, list[float]] = {}
    cells: list[Cell] = []
    results: dict[Cell, dict[str, Any]] = {}
    curves: dict[tuple[str, str, str], Any] = {}

    def done(cell: Cell, metrics: dict[str, Any], curve: Any) -> None:
        results[cell] = metrics
        if cell.seed == options.seed:
            curves[cell.fleet, cell.load, cell.policy] = curve
        if progress is not None:
            progress(len(results), len(cells), f"{cell.fleet} {cell.load} {cell.policy}")

    with _workers(options.workers) as pool:
        # The capacity searches (a dozen short simulations each) run on the workers too.
        keys = [(fleet, seed) for fleet in options.fleets for seed in seeds]
        searches = [(fleet, options.trace, options.max_requests, seed) for fleet, seed in keys]
        found = _search_capacities(pool, searches, progress)
        for (fleet, seed), cap in zip(keys, found, strict=True):
            capacity.setdefault(fleet, []).append(cap)
            rates[fleet, seed] = LOAD_TARGET * cap
            for load, factor in loads.items():
                for policy in policies_for(fleet, options.policies):
                    cells.append(
                        Cell(
                            fleet,
                            load,
                            rates[fleet, seed] * factor,
                            policy,
                            seed,
                            options.trace,
                            options.max_requests,
                            options.follow_llmd,
                        )
                    )
        # The slowest first, so that the last minutes are not one worker finishing alone.
        cost = {REFERENCE: 4.0, "llmd_predicted": 3.0, "large": 3.0, "pd_hetero": 1.5}
        cells.sort(key=lambda c: -(cost.get(c.policy, 1.0) * cost.get(c.fleet, 1.0)))
        if pool is None:
            for cell in cells:
                done(*run_cell(cell))
        else:
            for future in as_completed([pool.submit(run_cell, c) for c in cells]):
                done(*future.result())
    report: dict[str, Any] = {"fleets": {}}
    for fleet in options.fleets:
        fleet_report: dict[str, Any] = {}
        for load in loads:
            per_policy: dict[str, Any] = {}
            for policy in policies_for(fleet, options.policies):
                runs = [results[c] for c in cells if (c.fleet, c.load, c.policy) == (fleet, load, policy)]
                per_policy[policy] = _mean_metrics(runs)
            rate = float(np.mean([rates[fleet, s] * loads[load] for s in seeds]))
            ceiling = float(np.mean([ceiling_rps(fleet, options, rates[fleet, s] * loads[load], s) for s in seeds]))
            fleet_report[load] = {"rate_rps": rate, "ceiling_rps": ceiling, "policies": per_policy}
        fleet_report["capacity_rps"] = float(np.mean(capacity[fleet]))
        report["fleets"][fleet] = fleet_report
    report["targets"] = check_targets(report)
    report["run"] = {
        "trace": options.trace,
        "max_requests": options.max_requests,
        "requests": requests,
        "warnings": warnings,
        "seeds": seeds,
        "load_target": LOAD_TARGET,
        "loads": loads,
        "workers": options.workers,
        "wall_s": time.perf_counter() - started,
        "cpus": os.cpu_count(),
    }
    return report, curves


# ----- targets ------------------------------------------------------------------------------------------


def check_targets(
    report: dict[str, Any],
    strong: tuple[str, ...] = ("mixed", "pd_hetero", "timesliced", "large"),
) -> dict[str, Any]:
    """Each target of the routing benchmark, per fleet and load: the figures it compares and whether it holds."""
    checks: dict[str, Any] = {}
    for fleet, loads in report["fleets"].items():
        for load in report_loads(loads):
            policies = loads[load]["policies"]
            peers = {p: policies[p]["goodput_rps"] for p in PEERS if p in policies}
            if not peers or LEADTIME not in policies:
                continue
            best_peer = max(peers, key=lambda p: peers[p])
            b, lt = peers[best_peer], policies[LEADTIME]["goodput_rps"]
            entry: dict[str, Any] = {"best_peer": best_peer, "B": b, "L": lt, "L_over_B": lt / b if b else math.inf}
            entry["L_ge_B"] = lt >= b
            if "ceiling_rps" in loads[load]:  # no router passes it: a target above it is out of every router's reach
                entry["ceiling_over_B"] = loads[load]["ceiling_rps"] / b if b else math.inf
                entry["L_over_ceiling"] = lt / loads[load]["ceiling_rps"] if loads[load]["ceiling_rps"] else 0.0
            if fleet in strong:
                entry["L_ge_1.10B"] = lt >= 1.10 * b
            if REFERENCE in policies:
                c = policies[REFERENCE]["goodput_rps"]
                entry["C"] = c
                if c >= 1.05 * b:
                    entry["gap_closed"] = (lt - b) / (c - b)
                    entry["gap_closed_ge_0.8"] = entry["gap_closed"] >= 0.8
                else:
                    entry["L_ge_0.97C"] = lt >= 0.97 * c
            mine, theirs = policies[LEADTIME]["ttft_ms"], policies[best_peer]["ttft_ms"]
            entry["ttft_no_worse"] = mine["p50"] <= theirs["p50"] and mine["p99"] <= theirs["p99"]
            if "llmd_predicted" in policies and "prediction_mape" in policies["llmd_predicted"]:
                ours, ref = policies[LEADTIME]["prediction_mape"], policies["llmd_predicted"]["prediction_mape"]
                entry["mape_le_llmd"] = all(
                    ours[t] is not None and ref[t] is not None and ours[t] <= ref[t] for t in ("ttft", "tpot")
                )
            if fleet == "large":
                entry["decision_p99_ms"] = policies[LEADTIME]["decision_ms"]["p99"]
                entry["decision_p99_le_2ms"] = entry["decision_p99_ms"] <= 2.0
            checks[f"{fleet}/{load}"] = entry
    ablations: dict[str, Any] = {}
    for name, where in ABLATIONS.items():
        losses = {}
        for fleet in where:
            policies = report["fleets"].get(fleet, {}).get("high", {}).get("policies", {})
            if name not in policies or LEADTIME not in policies:
                continue
            key = "after_join_goodput_rps" if name == "leadtime_no_hardware" and fleet == "large" else "goodput_rps"
            full, without = policies[LEADTIME].get(key), policies[name].get(key)
            if full:
                losses[fleet] = 1.0 - without / full
        if losses:
            ablations[name] = {"loss_at_high_load": losses, "loses_ge_3pct": max(losses.values()) >= 0.03}
    checks["ablations"] = ablations
    return checks


# ----- output -------------------------------------------------------------------------------------------


def slo_classes(fleet_name: str) -> tuple[SloClass, ...]:
    """The SLO classes the fleet's requests are judged by: its file's, or `DEFAULT_SLO_MS` for all of them when it
    states none (as `run_cell` judges them)."""
    from leadtime.simulator.fleet import SloClass

    return _fleet(fleet_name).slos or (SloClass(1.0, *DEFAULT_SLO_MS),)


def slo_thresholds_ms(fleet_name: str) -> tuple[list[float], list[float]]:
    """The TTFT and ITL SLO thresholds (ms) the fleet's requests are judged by, each once. The CDFs draw them."""
    classes = slo_classes(fleet_name)
    return sorted({c.ttft_ms for c in classes}), sorted({c.itl_ms for c in classes})


def write_plots(report: dict[str, Any], curves: dict[tuple[str, str, str], Any], out: Path) -> list[Path]:
    """Latency CDFs per fleet (at the highest load run, with the fleet's SLO thresholds) and goodput per fleet and
    load; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    fleets = list(report["fleets"])
    loads = list(report["run"]["loads"])
    top = max(loads, key=lambda load: report["run"]["loads"][load])
    fig, axes = plt.subplots(1, len(loads), figsize=(6.5 * len(loads), 4.8), sharey=False)
    for ax, load in zip(np.atleast_1d(axes), loads, strict=True):
        names = sorted({p for f in fleets for p in report["fleets"][f][load]["policies"]}, key=_policy_order)
        width = 0.8 / max(len(names), 1)
        for k, name in enumerate(names):
            values = [report["fleets"][f][load]["policies"].get(name, {}).get("goodput_rps", 0.0) for f in fleets]
            ax.bar(np.arange(len(fleets)) + k * width, values, width, label=name, color=policy_colour(name))
        ax.set_xticks(np.arange(len(fleets)) + 0.4 - width / 2, fleets, rotation=20)
        ax.set_ylabel("goodput (requests/s meeting both SLOs)")
        ax.set_title(f"{load} load")
        ax.grid(axis="y", alpha=0.3)
    np.atleast_1d(axes)[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = out / "goodput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    for fleet in fleets:
        fig, axes = plt.subplots(1, 2, figsize=(12, 5.0), layout="constrained")
        ttft_slos, itl_slos = slo_thresholds_ms(fleet)
        names = sorted({p for (f, ld, p) in curves if f == fleet and ld == top}, key=_policy_order)
        for ax, metric, unit, scale, slos in (
            (axes[0], "ttft_ms", "s", 1e-3, ttft_slos),
            (axes[1], "itl_ms", "ms", 1.0, itl_slos),
        ):
            what = "TTFT" if metric == "ttft_ms" else "ITL"
            samples = {n: np.asarray(curves[fleet, top, n][metric], dtype=float) * scale for n in names}
            draw_cdf(ax, samples, [s * scale for s in slos], what, unit)
            ax.set_title(f"{fleet}, {top} load: {what}", pad=14)
        shared_legend(fig, axes)
        path = out / f"latency_cdf_{fleet}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


_ORDER = (*PEERS, REFERENCE, LEADTIME, *ABLATIONS, *VARIANTS)
"""The order policies are listed and plotted in (their colours and lines: `leadtime.plots`)."""


def _policy_order(name: str) -> int:
    return _ORDER.index(name) if name in _ORDER else len(_ORDER)


def print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(report, indent=2)
        return
    from rich.table import Table

    from leadtime.console import report_console

    console = report_console()
    for fleet, loads in report["fleets"].items():
        ran = report_loads(loads)
        table = Table(title=f"{fleet} (capacity {loads['capacity_rps']:.2f} req/s)")
        table.add_column("policy")
        for load in ran:
            ceiling = loads[load].get("ceiling_rps")
            limit = f" (ceiling {ceiling:.2f})" if ceiling is not None else ""
            table.add_column(f"{load} {loads[load]['rate_rps']:.2f} rps: goodput{limit}")
            table.add_column("TTFT p50 / p99 ms")
        names = sorted(loads[ran[0]]["policies"], key=_policy_order)
        for name in names:
            cells = []
            for load in ran:
                m = loads[load]["policies"][name]
                cells += [f"{m['goodput_rps']:.2f}", f"{m['ttft_ms']['p50']:.0f} / {m['ttft_ms']['p99']:.0f}"]
            table.add_row(f"[bold]{name}[/bold]" if name == LEADTIME else name, *cells)
        console.print(table)
    checked = {where: entry for where, entry in report["targets"].items() if where != "ablations"}
    if checked:
        console.print(targets_table(checked))
    else:  # a table of headers alone said nothing of why
        console.print(
            f"targets: none checked: they compare {LEADTIME} with the best peer (run one of {', '.join(PEERS)} "
            f"beside {LEADTIME})"
        )
    ablations = report["targets"].get("ablations", {})
    if ablations:
        table = Table(title="ablations: goodput lost against leadtime at the high load")
        for column in ("ablation", "loss by fleet", "loses ≥ 3% on one"):
            table.add_column(column)
        for name, result in ablations.items():
            losses = ", ".join(f"{fleet} {loss:.1%}" for fleet, loss in result["loss_at_high_load"].items())
            table.add_row(name, losses, "yes" if result["loses_ge_3pct"] else "no")
        console.print(table)


def targets_table(targets: dict[str, Any]) -> Any:
    """The targets of `check_targets`, a row per fleet and load: the goodputs compared, and the targets missed
    by name (as the JSON names them), where they printed as a page of raw JSON."""
    from rich.table import Table

    table = Table(title="targets (B: best peer, L: leadtime, C: clairvoyant; goodput in req/s)")
    for column in ("fleet/load", "best peer", "B", "L", "L/B", "C", "gap closed", "missed"):
        table.add_column(column)
    for where, entry in targets.items():
        if where == "ablations":
            continue
        missed = [name for name, value in entry.items() if value is False]
        gap = entry.get("gap_closed")
        table.add_row(
            where,
            entry["best_peer"],
            f"{entry['B']:.2f}",
            f"{entry['L']:.2f}",
            f"{entry['L_over_B']:.3f}",
            f"{entry['C']:.2f}" if "C" in entry else "",
            f"{gap:.2f}" if gap is not None else "",
            ", ".join(missed) or "none",
        )
    return table
