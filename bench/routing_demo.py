"""`make demo` / `leadtime demo`: Leadtime routing three hard fleets beside the routers a user could pick instead.

A mixed-accelerator fleet, a prefill/decode-disaggregated pool and a fleet half time-sliced with a training job,
each replaying the Mooncake conversation trace at 1.5× the rate that loads it to 85% (`bench.routing`). Every
learning policy starts cold with the predictor embedded and learns from each request it completes. It prints
the comparison and writes a report folder: goodput per fleet, latency CDFs, Leadtime's predicted against actual
TTFT, and its prediction error over time as it learns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from leadtime.bench.routing import (
    LEADTIME,
    LOADS,
    RoutingOptions,
    _policy_order,
    run_routing,
    slo_classes,
    slo_thresholds_ms,
    write_plots,
)
from leadtime.console import report_console
from leadtime.json_text import dumps
from leadtime.plots import axis_cut, policy_colour, policy_style, shared_legend
from leadtime.progress import stderr_bar
from leadtime.simulator.fleet import SloClass

DEMO_FLEETS = ("mixed", "pd", "timesliced")
DEMO_POLICIES = ("llmd_heuristic", "llmd_predicted", "dynamo_kv", "sglang_cache", LEADTIME)


def run_demo(
    out: Path, max_requests: int = 1500, workers: int = 2, policies: tuple[str, ...] = DEMO_POLICIES
) -> list[Path]:
    """Print the comparison and write its files into `out` (a run's temporary folder: the command says where they
    end up); the files written."""
    console = report_console()
    console.print(
        f"[bold]Leadtime demo[/bold]: {max_requests} Mooncake requests on each of {', '.join(DEMO_FLEETS)}, at 1.5× "
        "the rate that loads the fleet to 85% of its capacity; every learning policy starts cold."
    )
    options = RoutingOptions(
        max_requests=max_requests, fleets=DEMO_FLEETS, policies=policies, workers=workers, loads=(LOADS["high"],)
    )
    bar = stderr_bar()
    with bar:
        task = bar.add_task("measuring each fleet's capacity", total=None)

        def tick(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        report, curves = run_routing(options, progress=tick)
    table = Table(
        title="goodput (requests/s meeting both SLOs) and TTFT p50 / p99, high load",
        caption=slo_caption({fleet: slo_classes(fleet) for fleet in DEMO_FLEETS}),
    )
    table.add_column("policy")
    for fleet in DEMO_FLEETS:
        table.add_column(fleet_header(fleet, report["fleets"][fleet]["high"]["rate_rps"]), justify="right")
    for name in policies:
        cells = []
        for fleet in DEMO_FLEETS:
            m = report["fleets"][fleet]["high"]["policies"].get(name)
            cells.append(
                "–"
                if m is None
                else f"{m['goodput_rps']:.2f}  ({m['ttft_ms']['p50'] / 1e3:.1f} / {m['ttft_ms']['p99'] / 1e3:.0f} s)"
            )
        table.add_row(f"[bold]{name}[/bold]" if name == LEADTIME else name, *cells)
    console.print(table)
    console.print(itl_table(report, policies))
    files = [*write_plots(report, curves, out), *write_learning_plots(curves, out), out / "report.json"]
    files[-1].write_text(dumps(report, indent=2) + "\n")
    return files


def fleet_header(fleet: str, rate_rps: float) -> str:
    """A fleet's column header: the rate is what was offered (the arrivals replayed), not what was served.

    >>> fleet_header("mixed", 6.3333)
    'mixed (offered 6.3 rps)'
    """
    return f"{fleet} (offered {rate_rps:.1f} rps)"


def _ms(value: float) -> str:
    return f"{value / 1e3:g} s" if value >= 1000 else f"{value:g} ms"


def slo_caption(classes: dict[str, tuple[SloClass, ...]]) -> str:
    """The line under the goodput table saying what goodput counts: the SLO classes (read from the fleets, once if
    every fleet has the same) and that goodput is the requests per second that met both of their SLOs.

    >>> print(slo_caption({"a": (SloClass(0.3, 1000, 50), SloClass(0.7, 3000, 100))}).split(". ")[0])
    SLOs: 30% of requests TTFT ≤ 1 s and ITL ≤ 50 ms, 70% TTFT ≤ 3 s and ITL ≤ 100 ms
    """

    def described(of: tuple[SloClass, ...]) -> str:
        total = sum(c.share for c in of)
        return ", ".join(
            f"{100 * c.share / total:.0f}% of requests TTFT ≤ {_ms(c.ttft_ms)} and ITL ≤ {_ms(c.itl_ms)}"
            if i == 0
            else f"{100 * c.share / total:.0f}% TTFT ≤ {_ms(c.ttft_ms)} and ITL ≤ {_ms(c.itl_ms)}"
            for i, c in enumerate(of)
        )

    kinds = set(classes.values())
    if len(kinds) == 1:
        slos = described(next(iter(kinds)))
    else:
        slos = "; ".join(f"{fleet}: {described(of)}" for fleet, of in classes.items())
    return f"SLOs: {slos}. Goodput: requests per second that met both of their SLOs."


def itl_table(report: dict[str, Any], policies: tuple[str, ...]) -> Table:
    """The ITL each policy gave at the high load, p50 / p99 in ms: goodput counts the ITL SLO, and the tail that a
    policy packing more requests on a decode endpoint pays is seen here."""
    table = Table(title="ITL p50 / p99 (ms), high load")
    table.add_column("policy")
    for fleet in DEMO_FLEETS:
        table.add_column(fleet, justify="right")
    for name in policies:
        cells = []
        for fleet in DEMO_FLEETS:
            m = report["fleets"][fleet]["high"]["policies"].get(name)
            cells.append("–" if m is None else f"{m['itl_ms']['p50']:.0f} / {m['itl_ms']['p99']:.0f}")
        table.add_row(f"[bold]{name}[/bold]" if name == LEADTIME else name, *cells)
    return table


def rolling_error_percent(pairs: list[tuple[float, float]], window: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean absolute error of the predictions as a percentage of the actual, over `window` completions at a
    time, for (actual, predicted) pairs in completion order: (index of each window's last pair, its error)."""
    actual = np.array([a for a, _ in pairs])
    predicted = np.array([p for _, p in pairs])
    ape = 100.0 * np.abs(predicted - actual) / actual
    if len(ape) < window:
        return np.arange(len(ape)), ape
    kernel = np.ones(window) / window
    return np.arange(window - 1, len(ape)), np.convolve(ape, kernel, mode="valid")


def beyond_axes(actual: np.ndarray, predicted: np.ndarray, top: float) -> int:
    """How many (actual, predicted) points lie beyond a square plot's axes ending at `top`: they are not drawn, and
    the panel says how many, so that none is dropped silently."""
    return int(np.count_nonzero((actual > top) | (predicted > top)))


ERROR_WINDOW = 100
"""The completed requests each point of the prediction error over time averages over."""


def write_learning_plots(curves: dict[tuple[str, str, str], Any], out: Path) -> list[Path]:
    """Leadtime's predicted vs actual TTFT, and the prediction error of every learning policy over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from leadtime.bench.routing import _mape

    written: list[Path] = []
    fig, axes = plt.subplots(1, len(DEMO_FLEETS), figsize=(5 * len(DEMO_FLEETS), 5.0), layout="constrained")
    for ax, fleet in zip(np.atleast_1d(axes), DEMO_FLEETS, strict=True):
        pairs = curves.get((fleet, "high", LEADTIME), {}).get("ttft_pred", [])
        if not pairs:
            continue
        actual = np.array([a for a, _ in pairs]) / 1e3
        predicted = np.array([p for _, p in pairs]) / 1e3
        # The latency CDFs' rule (the 95th percentile, kept within 1.2-5 times the largest TTFT SLO): a bare 98th
        # percentile ended the mixed fleet's axes at 136 s where the median is 0.5 s, every point in a corner.
        slos = [t / 1e3 for t in slo_thresholds_ms(fleet)[0]]
        cut = axis_cut(np.concatenate([actual, predicted]), slos, "s")
        top = cut.limit
        ax.scatter(actual, predicted, s=4, alpha=0.35, color=policy_colour(LEADTIME))
        ax.plot([0, top], [0, top], color="black", lw=0.8, label="predicted = actual")
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel("actual TTFT (s)")
        ax.set_ylabel("predicted mean TTFT (s)")
        mape = _mape(pairs)
        where = cut.why.partition(" (")[0]  # the percentile behind it left out: three panels side by side are narrow
        ax.set_title(
            f"{fleet}: Leadtime's TTFT predictions, MAPE {'n/a' if mape is None else f'{100 * mape:.0f}%'}\n"
            f"{beyond_axes(actual, predicted, top):,} of {len(pairs):,} requests beyond the axes,\n{where}",
            fontsize=9.5,
        )
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
    path = out / "predicted_vs_actual_ttft.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    fig, axes = plt.subplots(
        2, len(DEMO_FLEETS), figsize=(5 * len(DEMO_FLEETS), 7.4), sharex="col", layout="constrained", squeeze=False
    )
    for col, fleet in enumerate(DEMO_FLEETS):
        for row, (key, label) in enumerate((("ttft_pred", "TTFT"), ("tpot_pred", "ITL"))):
            ax = axes[row][col]
            for (f, _, name), curve in sorted(curves.items(), key=lambda item: _policy_order(item[0][2])):
                if f != fleet or key not in curve or not curve[key]:
                    continue
                x, y = rolling_error_percent(curve[key], window=ERROR_WINDOW)
                ax.plot(x, y, label=name, **{**policy_style(name), "linestyle": "-"})
            if col == 0:
                ax.set_ylabel(error_label(label))
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"{fleet}: prediction error while routing")
            else:
                ax.set_xlabel("completed requests")
    shared_legend(fig, axes.flat)
    path = out / "prediction_error_over_time.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def error_label(metric: str) -> str:
    """The y label of the prediction error over time: what each point is, not just "error".

    >>> print(error_label("TTFT"))
    TTFT: mean |predicted − actual| / actual
    over the last 100 completed requests (%)
    """
    return f"{metric}: mean |predicted − actual| / actual\nover the last {ERROR_WINDOW} completed requests (%)"
