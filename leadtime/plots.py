"""What every Leadtime plot draws the same way: each policy's colour and line, where a latency axis ends, the SLO
thresholds on it and the legend shared by a figure's panels.

One definition, so that a policy looks the same in `leadtime demo`, `leadtime bench routing` and `leadtime simulate
--out`, and every latency axis is cut by the same rule (the simulator may not import the benchmarks, so this lives
beside both). Matplotlib is imported by the functions that draw, not here: the cut rule is plain arithmetic.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

LEADTIME = "leadtime"

_STYLES: dict[str, tuple[str, str]] = {
    # The peers alternate solid and dashed down this list, so that two of like colour (llm-d's two, Dynamo's and
    # SGLang's, the variants) are told apart where their lines cross; Leadtime's is solid (and thick).
    "round_robin": ("#9e9e9e", "-"),
    "least_queue": ("#795548", "--"),
    "llmd_heuristic": ("#ff9800", "-"),
    "llmd_predicted": ("#e65100", "--"),
    "dynamo_kv": ("#4caf50", "-"),
    "sglang_cache": ("#009688", "--"),
    "clairvoyant": ("#000000", "-"),
    LEADTIME: ("#1565c0", "-"),
    "leadtime_no_inflight": ("#90caf9", "-"),
    "leadtime_no_hardware": ("#7e57c2", "--"),
    "leadtime_decode_first": ("#ce93d8", "-"),
    "leadtime_no_timeslice": ("#f48fb1", "--"),
    "leadtime_no_decode_harm": ("#fbc02d", "-"),  # amber: the light blues of no_inflight and it were one
    "leadtime_in_turn": ("#0d47a1", "--"),
    "leadtime_overflow_timesliced": ("#283593", "-"),
    "leadtime_hold": ("#d32f2f", "--"),
    "leadtime_x4": ("#607d8b", "-"),
    "leadtime_x4_shared": ("#607d8b", "--"),
    "round_robin_shadow": ("#9e9e9e", "--"),  # a shadow: its router's colour, the other line style
    "least_queue_shadow": ("#795548", "-"),
}
_OTHER_COLOURS = (
    "#00acc1",
    "#8d6e63",
    "#c0ca33",
    "#5c6bc0",
    "#ec407a",
    "#26a69a",
    "#ffb300",
    "#827717",
)  # olive: a brown was least_queue's
"""For a policy the table above does not name (`random`, `llmd_heuristic_ready`): a colour picked by a fixed hash
of its name, so that two such policies in one plot are still told apart, and look the same in every plot. None is
a colour of the table (each of whose styles is its policy's alone): an unnamed policy is not taken for a named one."""

CUT_PERCENTILE = 95
"""A latency axis ends at this percentile of every policy's requests, within `SLO_SPAN` of the largest SLO: the
tails beyond are in the reports' p99s."""
SLO_SPAN = (1.2, 5.0)
"""The least and the most a latency axis spans, in multiples of the largest SLO of its metric: at least a little
past every SLO threshold (pd's ITL p95 was below both ITL SLOs, and a fifth of Leadtime's requests fell off the
chart), at most five times it (mixed's TTFT p95 was 103 s, and the 1 s and 3 s SLOs took under 3% of the width)."""


def policy_style(name: str) -> dict[str, Any]:
    """The colour, line style and width of `name`'s lines, as keyword arguments of `Axes.plot`."""
    colour, line = _STYLES.get(name, (_OTHER_COLOURS[zlib.crc32(name.encode()) % len(_OTHER_COLOURS)], "-"))
    return {"color": colour, "linestyle": line, "lw": 2.0 if name == LEADTIME else 1.2}


def policy_colour(name: str) -> str:
    """`name`'s colour (bars, points), the same as its lines'."""
    return str(policy_style(name)["color"])


@dataclass(frozen=True)
class AxisCut:
    """Where a latency axis ends, and why there: the axis label says it, so that no reader takes the cut for the
    slowest request."""

    limit: float
    why: str


def _number(value: float) -> str:
    return f"{value:,.3g}"


def finite_slos(slos: Iterable[float]) -> list[float]:
    """The thresholds a plot draws: an infinite SLO (`--ttft-slo-ms inf`, `ttft_ms: .inf`) is no SLO, and an axis
    cut at a multiple of it ended at infinity, which matplotlib refuses (the plots of a finished run were lost)."""
    return [s for s in slos if math.isfinite(s)]


def axis_cut(values: Iterable[float], slos: Sequence[float], unit: str) -> AxisCut:
    """The end of a linear latency axis over `values` (every policy's, in the axis unit) whose SLO thresholds are
    `slos` (the same unit; none for a metric with no SLO, and an infinite one counts as none): the
    `CUT_PERCENTILE`th percentile of the values, clamped to `SLO_SPAN` times the largest SLO. One rule for every
    fleet: the SLO range is readable and every threshold on the axis, whatever the tail.

    >>> axis_cut([1.0, 2.0, 3.0, 100.0], [1.0, 3.0], "s").why
    'cut at 15 s = 5 × the largest SLO (95th percentile of all requests: 85.4 s)'
    """
    sample = np.asarray(list(values), dtype=float)
    tail = float(np.percentile(sample, CUT_PERCENTILE)) if sample.size else 0.0
    of_all = f"{CUT_PERCENTILE}th percentile of all requests"
    slos = finite_slos(slos)
    if not slos:
        limit = tail if tail > 0 else 1.0
        return AxisCut(limit, f"cut at {_number(limit)} {unit}, the {of_all}")
    largest = max(slos)
    low, high = SLO_SPAN[0] * largest, SLO_SPAN[1] * largest
    if low <= tail <= high:
        return AxisCut(tail, f"cut at {_number(tail)} {unit}, the {of_all}")
    limit, times = (low, SLO_SPAN[0]) if tail < low else (high, SLO_SPAN[1])
    return AxisCut(
        limit, f"cut at {_number(limit)} {unit} = {times:g} × the largest SLO ({of_all}: {_number(tail)} {unit})"
    )


def slo_label(threshold: float, unit: str) -> str:
    """The text beside an SLO threshold line.

    >>> slo_label(1.0, "s"), slo_label(50.0, "ms")
    ('SLO 1 s', 'SLO 50 ms')
    """
    return f"SLO {threshold:g} {unit}"


SLO_LABEL_ROOM = 0.15
"""The share of an axis's width a centred SLO label needs: two thresholds closer than this have their labels drawn
away from each other (one ending at its line, the next starting at its own), so that the two do not overlap."""


def slo_label_sides(thresholds: Sequence[float], axis_end: float) -> list[str]:
    """How each label (thresholds in increasing order) is aligned on its line: centred, or, when a neighbour is
    within `SLO_LABEL_ROOM` of the axis, to the side away from it.

    >>> slo_label_sides([1.0, 3.0], 3.6), slo_label_sides([50.0, 100.0], 500.0)
    (['center', 'center'], ['right', 'left'])
    """
    room = SLO_LABEL_ROOM * axis_end
    sides = ["center"] * len(thresholds)
    for i in range(1, len(thresholds)):
        if thresholds[i] - thresholds[i - 1] < room:
            sides[i - 1] = "right" if sides[i - 1] == "center" else sides[i - 1]
            sides[i] = "left"
    return sides


def draw_slo_lines(ax: Any, slos: Iterable[float], unit: str) -> None:
    """Each SLO threshold as a thin dashed grey vertical line, labelled above the panel (where it hides no line).
    Call it once the axis's limits are set: how close two labels are depends on them."""
    thresholds = sorted(set(slos))
    pad = {"center": "{}", "right": "{} ", "left": " {}"}
    for threshold, side in zip(thresholds, slo_label_sides(thresholds, ax.get_xlim()[1]), strict=True):
        ax.axvline(threshold, color="0.35", lw=0.8, linestyle=(0, (4, 3)), zorder=1)
        ax.text(
            threshold,
            1.01,
            pad[side].format(slo_label(threshold, unit)),
            transform=ax.get_xaxis_transform(),
            ha=side,
            va="bottom",
            fontsize=7,
            color="0.25",
        )


def draw_cdf(
    ax: Any, samples: Mapping[str, Sequence[float] | np.ndarray], slos: Sequence[float], what: str, unit: str
) -> AxisCut:
    """One latency CDF panel: a line per policy (in `samples`' order, values in the axis unit), a linear axis cut
    by `axis_cut` and saying where, the (finite) SLO thresholds. Linear, so that a reader reads the SLO range
    directly."""
    slos = finite_slos(slos)
    pooled: list[float] = []
    for name, values in samples.items():
        sample = np.sort(np.asarray(values, dtype=float))
        if not sample.size:
            continue
        pooled.extend(sample.tolist())
        ax.plot(sample, np.arange(1, sample.size + 1) / sample.size, label=name, **policy_style(name))
    cut = axis_cut(pooled, slos, unit)
    ax.set_xlim(0, cut.limit)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"{what} ({unit})\n{cut.why}")
    ax.set_ylabel("share of requests (CDF)")
    ax.grid(alpha=0.3)
    draw_slo_lines(ax, [s for s in slos if s <= cut.limit], unit)
    return cut


def shared_legend(fig: Any, axes: Iterable[Any], columns: int = 6, where: str = "upper center") -> Any:
    """One legend for the whole figure, outside its panels (above them, or `where`): in a panel it hid data, and
    repeated in each it said the same thing three times. The figure should use the constrained layout, which keeps
    room for it (below, when the figure has a suptitle: above, the two overlap)."""
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    if not handles:
        return None
    return fig.legend(
        list(handles.values()),
        list(handles),
        loc=f"outside {where}",
        ncols=min(columns, len(handles)),
        fontsize=8,
        frameon=False,
    )
