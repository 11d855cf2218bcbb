"""What the CLI's simulator commands print (kept out of leadtime/cli/ so that its command bodies stay thin)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.progress import TaskID
from rich.table import Table

from leadtime.console import report_console
from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.json_text import print_json
from leadtime.progress import stderr_bar
from leadtime.router_plugin.config import PickerConfig, profile_parameters
from leadtime.simulator.fleet import Fleet, fastest_pass_ms
from leadtime.simulator.learning_policies import PROFILE_PREFIX
from leadtime.simulator.run import OutputsError, SimulationOptions, simulate
from leadtime.simulator.workload import WorkloadRequest


def run_simulate_command(
    fleet: str | Path,
    trace: str,
    policies: list[str],
    max_requests: int | None,
    rate_scale: float,
    seed: int,
    ttft_slo_ms: float,
    itl_slo_ms: float,
    out: Path | None,
    progress: bool,
    config: PickerConfig | None = None,
    catalog: Catalog = BUILT_IN,
    spread: bool = False,
) -> tuple[dict[str, object], list[WorkloadRequest], str | None]:
    """`leadtime simulate`: run the policies with a progress bar on stderr (none with --json); returns the report,
    the requests replayed (what the report's figures are per second of) and why the `out` files could not all be
    written (None when they were): the caller prints the report first, then that error."""
    options = SimulationOptions(
        seed=seed,
        ttft_slo_ms=ttft_slo_ms,
        itl_slo_ms=itl_slo_ms,
        config=config,
        catalog=catalog,
        spread_steps=spread,
    )
    replayed: list[WorkloadRequest] = []
    bar = stderr_bar()
    tasks: dict[str, TaskID] = {}

    def tick(policy: str, done: int, total: int) -> None:
        if policy not in tasks:
            tasks[policy] = bar.add_task(policy, total=total)
        bar.update(tasks[policy], completed=done)

    callback: Callable[[str, int, int], None] | None = tick if progress else None
    try:
        with bar if progress else contextlib.nullcontext():
            report = simulate(
                fleet, trace, policies, max_requests, rate_scale, options, out, callback, on_workload=replayed.extend
            )
    except OutputsError as err:
        return err.report, replayed, str(err)
    return report, replayed, None


def slo_warnings(fleet: Fleet, ttft_slo_ms: float, itl_slo_ms: float) -> list[str]:
    """One line per SLO no request can meet on `fleet` (the fleet's classes, else `--ttft-slo-ms`/`--itl-slo-ms`):
    below one pass over the weights, the least a first token (on a prefilling endpoint) or a next token (on a
    decoding one) takes. Such an SLO is most likely seconds given for milliseconds, and the run's attainment of 0%
    would otherwise read as a verdict on the policies."""
    if fleet.slos:
        named = [
            (f"slos[{i}].{field}", getattr(c, field))
            for i, c in enumerate(fleet.slos)
            for field in ("ttft_ms", "itl_ms")
        ]
    else:
        named = [("--ttft-slo-ms", ttft_slo_ms), ("--itl-slo-ms", itl_slo_ms)]
    floors = {
        "ttft": fastest_pass_ms(fleet, ("both", "prefill")),
        "itl": fastest_pass_ms(fleet, ("both", "decode")),
    }
    lines = []
    for name, slo in named:
        floor = floors["ttft" if "ttft" in name else "itl"]
        if slo < floor:
            lines.append(
                f"{name} {slo:g} is below one pass over the model's weights ({floor:.1f} ms on this fleet's fastest "
                "endpoint): no request can meet it; SLOs are in milliseconds (seconds given?)"
            )
    return lines


def overflow_warnings(config: PickerConfig, policies: Sequence[str], fleet: Fleet) -> list[str]:
    """One line per `overflowEndpoints` entry of a `profile:NAME` policy that no endpoint of `fleet` is, as the
    gateway warns of one no discovered endpoint is: a misspelling would leave the overflow to the candidates'
    order, silently."""
    ids = [e.endpoint_id for e in fleet.endpoints]
    known = ", ".join(ids[:8]) + (", ..." if len(ids) > 8 else "")
    lines: list[str] = []
    for name in policies:
        if not name.startswith(PROFILE_PREFIX):
            continue
        profile = name[len(PROFILE_PREFIX) :]
        latency = profile_parameters(config, profile, "predicted-latency-scorer")
        lines.extend(
            f"profile {profile!r}: overflowEndpoints names {endpoint!r}, which no endpoint of the fleet is "
            f"(its endpoints: {known})"
            for endpoint in (latency.overflow_endpoints if latency is not None else ())
            if endpoint not in ids
        )
    return lines


def failure_warnings(report: dict[str, object]) -> list[str]:
    """One line per policy that had requests fail, naming how many of each kind with one example reason: the run
    went on, and its figures count them as missed SLOs, which a reader should know before comparing policies."""
    policies = report["policies"]
    assert isinstance(policies, dict)
    lines = []
    for name, summary in policies.items():
        failures = summary["failures"]  # kind → {"count": how many, "example": one reason}
        if failures:
            kinds = "; ".join(f"{f['count']} {kind} (e.g. {f['example']})" for kind, f in failures.items())
            lines.append(
                f"policy {name}: {summary['failed']} request(s) could not be served and count as failed (SLO "
                f"missed): {kinds}"
            )
    return lines


def print_simulation(report: dict[str, object], as_json: bool, arrivals: str = "") -> None:
    """The report as JSON, or as a table titled with the fleet, the arrivals (`describe_arrivals`, else the count of
    requests) and the trace, and the files written."""
    if as_json:
        print_json(report)  # strict JSON: an infinite SLO is null, not `Infinity`
        return
    console = report_console()
    arrivals = arrivals or f"{report['requests']} requests"
    table = Table(title=f"{report['fleet']} — {arrivals} ({report['trace']})")
    for column in (
        "policy",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "e2e p50 ms",
        "SLO met",
        "goodput rps",
        "completed",
        "failed",
    ):
        table.add_column(column)
    policies = report["policies"]
    assert isinstance(policies, dict)
    for name, s in policies.items():
        t, i, e = s["ttft_ms"], s["itl_ms"], s["e2e_ms"]
        latencies = [
            f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f}",
            f"{i['p50']:.1f} / {i['p90']:.1f} / {i['p99']:.1f}",
            f"{e['p50']:.0f}",
        ]
        table.add_row(
            name,
            *(latencies if s["completed"] else ["–"] * 3),  # none measured: 0 ms would read as the best of the table
            f"{s['slo_attainment']:.1%}",
            f"{s['goodput_rps']:.2f}",
            str(s["completed"]),
            str(s["failed"]),
        )
    console.print(table)
    outputs = report.get("outputs")
    if isinstance(outputs, dict):
        files = outputs["files"]
        console.print(f"wrote {len(files)} files ({outputs['observations']:,} observations in the first):")
        for path in files:
            console.print(f"  {path}", highlight=False, soft_wrap=True)


def _pct(value: object) -> str:
    """A share as a percentage; `–` for one of no rows (NaN: `nan%` read as a figure)."""
    assert isinstance(value, float | int)
    return f"{value:.1%}" if math.isfinite(value) else "–"


def print_validation(report: dict[str, object], as_json: bool) -> None:
    """`sim validate`: the replay's TTFT/TPOT error (overall and by load quintile) and the splitwise check."""
    if as_json:
        print_json(report)
        return
    console = report_console()
    measured = report["measured"]
    assert isinstance(measured, dict)
    table = Table(title="Replay of measured rows in their recorded state (simulated vs measured)")
    for column in ("target", "rows", "load (running + waiting)", "median APE", "p90 APE"):
        table.add_column(column)
    for target in ("ttft", "tpot"):
        r = measured[target]
        table.add_row(target.upper(), str(r["rows"]), "all", _pct(r["median_ape"]), _pct(r["p90_ape"]))
        for q in r["by_load_quintile"]:
            load = f"{q['load_min']}–{q['load_max']}"
            table.add_row("", str(q["rows"]), load, _pct(q["median_ape"]), _pct(q["p90_ape"]))
    console.print(table)
    table = Table(title="Splitwise llama2-70b, A100 and H100 (step model vs measured)")
    for column in ("", "prefill median APE", "prefill p90", "decode median APE", "decode p90", "rows"):
        table.add_column(column)
    for key, label in (
        ("splitwise_unfitted", "unfitted"),
        ("splitwise_heldout", "held out (fitted factors)"),
    ):
        r = report[key]
        assert isinstance(r, dict)
        p, d = r["prefill"], r["decode"]
        table.add_row(
            label, _pct(p["median_ape"]), _pct(p["p90_ape"]), _pct(d["median_ape"]), _pct(d["p90_ape"]), str(p["rows"])
        )
    console.print(table)
    heldout = report["splitwise_heldout"]
    assert isinstance(heldout, dict)
    for fold in heldout["folds"]:
        factors = ", ".join(
            f"{hw} prefill {f['prefill']:.2f} decode {f['decode']:.2f}" for hw, f in fold["efficiency"].items()
        )
        console.print(f"fitted on {fold['fit_on']}, evaluated on {fold['evaluated_on']}: efficiency {factors}")
