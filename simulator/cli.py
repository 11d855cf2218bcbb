"""What the CLI's simulator commands print (kept out of leadtime/cli.py so its command bodies stay thin)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from leadtime.simulator.run import SimulationOptions, simulate


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
) -> dict[str, object]:
    """`leadtime simulate`: run the policies with a progress bar on stderr (none with --json)."""
    options = SimulationOptions(seed=seed, ttft_slo_ms=ttft_slo_ms, itl_slo_ms=itl_slo_ms)
    if not progress:
        return simulate(fleet, trace, policies, max_requests, rate_scale, options, out)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    tasks: dict[str, TaskID] = {}

    def tick(policy: str, done: int, total: int) -> None:
        if policy not in tasks:
            tasks[policy] = bar.add_task(policy, total=total)
        bar.update(tasks[policy], completed=done)

    callback: Callable[[str, int, int], None] = tick
    with bar:
        return simulate(fleet, trace, policies, max_requests, rate_scale, options, out, progress=callback)


def print_simulation(report: dict[str, object], as_json: bool) -> None:
    """The report as JSON, or as a table and the files written."""
    if as_json:
        print(json.dumps(report))
        return
    console = Console()
    table = Table(title=f"{report['fleet']} — {report['requests']} requests ({report['trace']})")
    for column in (
        "policy",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "e2e p50 ms",
        "SLO met",
        "goodput rps",
        "completed",
    ):
        table.add_column(column)
    policies = report["policies"]
    assert isinstance(policies, dict)
    for name, s in policies.items():
        t, i, e = s["ttft_ms"], s["itl_ms"], s["e2e_ms"]
        table.add_row(
            name,
            f"{t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f}",
            f"{i['p50']:.1f} / {i['p90']:.1f} / {i['p99']:.1f}",
            f"{e['p50']:.0f}",
            f"{s['slo_attainment']:.1%}",
            f"{s['goodput_rps']:.2f}",
            str(s["completed"]),
        )
    console.print(table)
    outputs = report.get("outputs")
    if isinstance(outputs, dict):
        files = outputs["files"]
        console.print(f"wrote {len(files)} files ({outputs['observations']:,} observations in the first):")
        for path in files:
            console.print(f"  {path}", highlight=False, soft_wrap=True)


def print_validation(report: dict[str, dict[str, float]], as_json: bool) -> None:
    """The validation report as JSON, or as one line per phase."""
    if as_json:
        print(json.dumps(report))
        return
    for phase in ("prefill", "decode"):
        r = report[phase]
        print(f"{phase:8s} median APE {r['median_ape']:.1%}   p90 APE {r['p90_ape']:.1%}   ({r['rows']} rows)")
