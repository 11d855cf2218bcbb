"""`make demo` / `leadtime demo`: the online predictor walking real vLLM measurements, beside llm-d's.

It predicts each row of the H200 trace before learning it (as a predictor inside a router would), prints the
accuracy of Leadtime, the llm-d reference (llm-d's own predictor as its training server runs it,
`leadtime.predictor.llmd_reference`) and a median floor, and plots predicted against actual over time.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from rich.table import Table  # noqa: E402

from leadtime.bench.accuracy import (  # noqa: E402
    MODELS,
    TARGETS,
    Walk,
    prequential_walk,
    reference_settings,
    summarize_walk,
)
from leadtime.bench.data import actuals, load_llmd_rows  # noqa: E402
from leadtime.console import report_console  # noqa: E402
from leadtime.features.vectorize import Vectorizer  # noqa: E402
from leadtime.predictor.learner import LearnerConfig  # noqa: E402
from leadtime.predictor.llmd_reference import LlmdFrame  # noqa: E402
from leadtime.progress import stderr_bar  # noqa: E402


def axis_top(actual: np.ndarray) -> float:
    """Top of a linear latency axis: room above nearly every actual, so a rare spike or a prediction swinging
    far off does not squash the rest against the bottom (what lies above is cut, and counted in the title)."""
    return float(np.percentile(actual, 99)) * 1.5


def plot_walk(preds: Walk, y: dict[str, np.ndarray], path: Path) -> None:
    """Predicted against actual over the walk: one panel per target and model, so no line hides another.

    Linear axes cut at `axis_top` (the data sit in a narrow band, 15-30 ms for TPOT, which a log axis labels
    only at 10 and 100); the actuals are drawn over each model's mean, and Leadtime's p90 beside it.
    """
    fig, axes = plt.subplots(2, 2, figsize=(15, 8.5), sharex=True, sharey="row")
    index = np.arange(len(y["ttft"]))
    colors = {"leadtime": "tab:blue", "llmd_reference": "tab:orange"}
    for row, (target, unit) in enumerate(zip(TARGETS, ("TTFT (ms)", "TPOT (ms)"), strict=True)):
        mask = y[target] > 0
        actual = y[target][mask]
        top = axis_top(actual) if mask.any() else 1.0
        for column, model in enumerate(("leadtime", "llmd_reference")):
            ax = axes[row, column]
            mean, upper = preds[model][target]
            ax.scatter(index[mask], actual, s=4, color="black", alpha=0.5, lw=0, label="actual", zorder=4)
            ax.plot(index[mask], mean[mask], lw=0.7, color=colors[model], label="predicted mean", zorder=3)
            if model == "leadtime":
                ax.plot(index[mask], upper[mask], lw=0.6, color="tab:green", alpha=0.8, label="predicted p90", zorder=2)
            ax.set_ylim(0, top)
            ape = np.abs(mean[mask] - actual) / actual
            over = [(int((mean[mask] > top).sum()), "predictions"), (int((actual > top).sum()), "actuals")]
            cut = "".join(f"; {n} {what} above the axis" for n, what in over if n)
            name = "Leadtime" if model == "leadtime" else "llm-d reference"
            ax.set_title(f"{name}: {target.upper()} MAPE {ape.mean():.3f}{cut}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(loc="upper right", fontsize=8, ncols=3, markerscale=3)
        axes[row, 0].set_ylabel(unit)
    for ax in axes[1]:
        ax.set_xlabel("row (recording order; load ramps 1 → 16 QPS)")
    fig.suptitle("Prequential walk over real vLLM/H200 measurements: each row predicted, then learned")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(
    data: Path,
    out: Path,
    accelerator: str = "h200-sxm",
    model: str = "qwen3-32b",
    max_rows: int | None = None,
    reference_model: str | None = None,
) -> list[Path]:
    """Walk the trace, print each model's prequential accuracy and write the plot under `out` (a run's temporary
    folder: the command says where it ends up); the files written."""
    console = report_console()
    rows = load_llmd_rows(data)[:max_rows]
    console.print(f"[bold]Leadtime demo[/bold]: {len(rows)} real rows from {data} ({accelerator}, {model})")
    x_lt = Vectorizer(accelerator, model).batch_llmd(rows)
    ttft, tpot = actuals(rows)
    y = {"ttft": ttft, "tpot": tpot}
    config = LearnerConfig(accelerator=accelerator, model=model, background=False)
    with stderr_bar() as bar:
        preds = prequential_walk(x_lt, LlmdFrame.from_rows(rows), y, config, bar, reference_model)
    summary = summarize_walk(preds, y)
    table = Table(title="prequential accuracy (each row predicted before it is learned)")
    for column in ("model", "target", "MAPE", "MAPE 2nd half", "median APE", "p90 coverage"):
        table.add_column(column)
    for m in MODELS:
        for t in TARGETS:
            r = summary[m][t]
            table.add_row(
                m,
                t,
                f"{r['prequential_mape']:.3f}",
                f"{r['prequential_mape_second_half']:.3f}",
                f"{r['prequential_median_ape']:.3f}",
                f"{r['prequential_p90_coverage']:.3f}",
            )
    console.print(table)
    ref = reference_settings(reference_model)
    console.print(
        f"llm-d reference: llm-d's own predictor ({ref['model_type']}, a store of the newest {ref['bucket_size']} "
        f"rows per load bucket, {ref['test_share']:.0%} held out, queue-gated ensemble), retrained every "
        f"{ref['retrain_every_rows']} rows, 10 ms until its first model"
    )
    path = out / "predicted_vs_actual.png"
    plot_walk(preds, y, path)
    return [path]
