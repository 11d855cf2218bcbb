"""How the demo, the routing benchmark and `leadtime simulate --out` present their results: the rules a reviewer
found broken, checked on hand-made numbers and on the figures' own objects, not on pixels."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.figure import Figure

from leadtime.bench.routing import DEFAULT_SLO_MS, _at_rate, _fleet, _trace, slo_thresholds_ms
from leadtime.bench.routing_demo import (
    DEMO_FLEETS,
    beyond_axes,
    error_label,
    fleet_header,
    slo_caption,
    slo_classes,
    write_learning_plots,
)
from leadtime.plots import axis_cut, draw_cdf, policy_style, shared_legend
from leadtime.simulator.engine import FleetSimulator
from leadtime.simulator.fleet import SloClass
from leadtime.simulator.report import slo_thresholds
from leadtime.simulator.report import write_plots as write_sim_plots
from leadtime.simulator.run import make_policy


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Figure]]:
    """Every figure saved, by file name (the name it is renamed to, when written to a temporary one first), still
    open to be inspected (its file is written all the same)."""
    figures: dict[str, Figure] = {}
    save, close = Figure.savefig, plt.close

    def keep(self: Figure, path: Any, *args: Any, **kwargs: Any) -> None:
        figures[Path(path).name.removeprefix(".").replace(".part.", ".")] = self
        save(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    monkeypatch.setattr(plt, "close", lambda *_: None)
    yield figures
    for fig in figures.values():
        close(fig)


# ----- the cut of a latency axis ------------------------------------------------------------------------


def test_an_axis_whose_tail_runs_far_past_the_slos_ends_at_five_times_the_largest() -> None:
    """mixed's TTFT axis ended at its 95th percentile, 103 s: the 1 s and 3 s SLOs took under 3% of the width."""
    values = np.linspace(0.0, 108.0, 1001)  # 95th percentile 102.6 s
    cut = axis_cut(values, [1.0, 3.0], "s")
    assert cut.limit == pytest.approx(15.0)
    assert cut.why == "cut at 15 s = 5 × the largest SLO (95th percentile of all requests: 103 s)"


def test_an_axis_whose_tail_ends_before_the_slos_still_shows_every_threshold() -> None:
    """pd's ITL axis ended at 45.5 ms, below both ITL SLOs (50, 100 ms): a fifth of Leadtime's requests were off it."""
    values = np.linspace(0.0, 47.9, 1001)  # 95th percentile 45.5 ms
    cut = axis_cut(values, [50.0, 100.0], "ms")
    assert cut.limit == pytest.approx(120.0)
    assert cut.why == "cut at 120 ms = 1.2 × the largest SLO (95th percentile of all requests: 45.5 ms)"


def test_an_axis_whose_tail_is_within_the_span_of_the_slos_ends_at_the_percentile() -> None:
    cut = axis_cut(np.linspace(0.0, 200.0, 1001), [50.0, 100.0], "ms")
    assert cut.limit == pytest.approx(190.0)
    assert cut.why == "cut at 190 ms, the 95th percentile of all requests"


def test_an_axis_with_no_slo_ends_at_the_percentile_and_an_empty_one_still_has_a_width() -> None:
    assert axis_cut(np.linspace(0.0, 100.0, 1001), [], "s").limit == pytest.approx(95.0)
    assert axis_cut([], [], "s").limit == 1.0
    assert axis_cut([], [1.0, 3.0], "s").limit == pytest.approx(3.6)


def test_a_cdf_panel_is_linear_cut_by_the_rule_and_draws_each_slo_labelled() -> None:
    fig, ax = plt.subplots()
    samples = {"llmd_heuristic": np.linspace(0.0, 108.0, 500), "leadtime": np.linspace(0.0, 2.0, 500)}
    cut = draw_cdf(ax, samples, [1.0, 3.0], "TTFT", "s")
    assert ax.get_xscale() == "linear" and ax.get_xlim() == (0.0, cut.limit)
    assert cut.why in ax.get_xlabel() and "share of requests" in ax.get_ylabel()
    assert [t.get_text().strip() for t in ax.texts] == ["SLO 1 s", "SLO 3 s"]
    vertical = [line for line in ax.get_lines() if np.ptp(np.asarray(line.get_xdata(), dtype=float)) == 0]
    assert len(vertical) == 2 and all(line.get_linestyle() == "--" for line in vertical)
    plt.close(fig)


def test_an_infinite_slo_is_no_threshold_on_the_axis() -> None:
    """`--ttft-slo-ms inf` (no SLO) made the axis end at infinity, and matplotlib refused the whole plot."""
    values = np.linspace(0.0, 100.0, 1001)
    assert axis_cut(values, [math.inf], "s") == axis_cut(values, [], "s")
    assert axis_cut(values, [1.0, math.inf], "s") == axis_cut(values, [1.0], "s")
    fig, ax = plt.subplots()
    cut = draw_cdf(ax, {"leadtime": values}, [3.0, math.inf], "TTFT", "s")
    assert ax.get_xlim() == (0.0, cut.limit)
    assert [t.get_text().strip() for t in ax.texts] == ["SLO 3 s"]
    plt.close(fig)


def test_the_benchmark_cdfs_draw_the_slos_the_fleet_judges_by() -> None:
    assert slo_thresholds_ms("mixed") == ([1000.0, 3000.0], [50.0, 100.0])
    assert slo_thresholds_ms("bench-16") == ([DEFAULT_SLO_MS[0]], [DEFAULT_SLO_MS[1]])  # its file states none


# ----- one style and one legend for every plot ----------------------------------------------------------


def test_a_policy_looks_the_same_in_every_plot_and_two_unnamed_ones_apart() -> None:
    assert policy_style("leadtime") == {"color": "#1565c0", "linestyle": "-", "lw": 2.0}
    assert policy_style("llmd_predicted")["linestyle"] == "--"  # told from llmd_heuristic where they cross
    # An unnamed policy's colour comes from its name's CRC, not from `hash()` (salted per process): this value
    # is the same in every run, so the same policy looks the same in plots drawn by different processes.
    assert policy_style("random") == {"color": "#26a69a", "linestyle": "-", "lw": 1.2}
    assert policy_style("random")["color"] != policy_style("llmd_heuristic_ready")["color"]


def test_every_named_policy_has_a_style_of_its_own_and_no_unnamed_one_takes_its_colour() -> None:
    """leadtime_x4 and round_robin_shadow were one solid grey-blue line, and the first unnamed colour was it too."""
    from leadtime.plots import _OTHER_COLOURS, _STYLES

    assert len(set(_STYLES.values())) == len(_STYLES)
    assert not set(_OTHER_COLOURS) & {colour for colour, _ in _STYLES.values()}
    assert len(set(_OTHER_COLOURS)) == len(_OTHER_COLOURS)


def test_the_shared_legend_is_one_for_the_figure_above_its_panels() -> None:
    """In a panel the legend hid data (llm-d's peak on mixed's ITL error); repeated in each it said it thrice."""
    fig, axes = plt.subplots(1, 3, layout="constrained")
    for ax in axes:
        for name in ("leadtime", "llmd_predicted"):
            ax.plot([0, 1], [0, 1], label=name)
    legend = shared_legend(fig, axes)
    fig.canvas.draw()
    assert fig.legends == [legend] and all(ax.get_legend() is None for ax in axes)
    assert [t.get_text() for t in legend.get_texts()] == ["leadtime", "llmd_predicted"]
    top_of_panels = max(ax.get_window_extent().y1 for ax in axes)
    assert legend.get_window_extent().y0 >= top_of_panels
    plt.close(fig)


# ----- the demo -----------------------------------------------------------------------------------------


def test_the_demo_table_says_the_rate_is_offered_and_what_goodput_counts() -> None:
    assert fleet_header("mixed", 6.34) == "mixed (offered 6.3 rps)"
    classes = (SloClass(0.3, 1000.0, 50.0), SloClass(0.7, 3000.0, 100.0))
    assert slo_caption({"mixed": classes, "pd": classes}) == (
        "SLOs: 30% of requests TTFT ≤ 1 s and ITL ≤ 50 ms, 70% TTFT ≤ 3 s and ITL ≤ 100 ms. "
        "Goodput: requests per second that met both of their SLOs."
    )
    other = (SloClass(1.0, 2000.0, 100.0),)
    assert slo_caption({"mixed": classes, "large": other}) == (
        "SLOs: mixed: 30% of requests TTFT ≤ 1 s and ITL ≤ 50 ms, 70% TTFT ≤ 3 s and ITL ≤ 100 ms; "
        "large: 100% of requests TTFT ≤ 2 s and ITL ≤ 100 ms. Goodput: requests per second that met both of their SLOs."
    )


def test_the_demo_reads_the_slos_from_the_fleet_files() -> None:
    for fleet in DEMO_FLEETS:
        assert slo_classes(fleet) == _fleet(fleet).slos
        assert slo_thresholds_ms(fleet) == (
            sorted({c.ttft_ms for c in _fleet(fleet).slos}),
            sorted({c.itl_ms for c in _fleet(fleet).slos}),
        )


def test_points_beyond_the_axes_are_counted_whichever_axis_they_pass() -> None:
    actual = np.array([1.0, 5.0, 1.0, 12.0])
    predicted = np.array([1.0, 1.0, 11.0, 13.0])
    assert beyond_axes(actual, predicted, top=10.0) == 2


def test_the_learning_plots_say_what_they_drop_their_mape_and_what_their_error_is(
    tmp_path: Path, saved: dict[str, Figure]
) -> None:
    pairs = [(1000.0 * (1 + i % 50), 1100.0 * (1 + i % 50)) for i in range(300)]  # every prediction 10% high
    curves = {
        (fleet, "high", name): {"ttft_pred": pairs, "tpot_pred": pairs}
        for fleet in DEMO_FLEETS
        for name in ("leadtime", "llmd_predicted")
    }
    write_learning_plots(curves, tmp_path)
    scatter = saved["predicted_vs_actual_ttft.png"].axes
    for ax, fleet in zip(scatter, DEMO_FLEETS, strict=True):
        assert "MAPE 10%" in ax.get_title()
        assert "of 300 requests beyond the axes" in ax.get_title()
        assert ax.get_ylabel() == "predicted mean TTFT (s)"
        # The CDFs' rule: within 5 times the largest TTFT SLO, where a 98th percentile put the points in a corner.
        largest_s = max(slo_thresholds_ms(fleet)[0]) / 1e3
        assert ax.get_xlim()[1] == pytest.approx(5 * largest_s) and "× the largest SLO" in ax.get_title()
    error = saved["prediction_error_over_time.png"]
    assert len(error.legends) == 1 and all(ax.get_legend() is None for ax in error.axes)
    assert error.axes[0].get_ylabel() == error_label("TTFT")
    assert "mean |predicted − actual| / actual" in error_label("ITL") and "last 100 completed" in error_label("ITL")


# ----- leadtime simulate --out --------------------------------------------------------------------------


def test_simulate_plots_are_linear_with_one_legend_slo_lines_and_one_time_axis(
    tmp_path: Path, saved: dict[str, Figure]
) -> None:
    fleet = _fleet("mixed")
    workload = _at_rate(_trace("mooncake", 120, 0), 4.0)
    results = [
        FleetSimulator(fleet, workload, make_policy(name, 0, fleet), seed=0).run()
        for name in ("round_robin", "llmd_heuristic")
    ]
    assert slo_thresholds(results) == ([1000.0, 3000.0], [50.0, 100.0])
    write_sim_plots(results, tmp_path)
    cdf = saved["latency_cdf.png"]
    assert len(cdf.legends) == 1 and all(ax.get_legend() is None for ax in cdf.axes)
    assert all(ax.get_xscale() == "linear" and ax.get_title() for ax in cdf.axes)
    assert [t.get_text().strip() for t in cdf.axes[0].texts] == ["SLO 1 s", "SLO 3 s"]
    assert [t.get_text().strip() for t in cdf.axes[1].texts] == ["SLO 50 ms", "SLO 100 ms"]
    assert cdf.axes[0].get_lines()[1].get_color() == policy_style("llmd_heuristic")["color"]
    panels = [ax for ax in saved["utilisation.png"].axes if ax.get_label() != "<colorbar>"]
    assert len(panels) == 2 and panels[0].get_xlim() == panels[1].get_xlim()
    bar = [ax for ax in saved["utilisation.png"].axes if ax.get_label() == "<colorbar>"][0]
    assert "had ≥ 1 request running" in bar.get_ylabel()
