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
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
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
from leadtime.features.vectorize import Vectorizer  # noqa: E402
from leadtime.predictor.learner import LearnerConfig  # noqa: E402
from leadtime.predictor.llmd_reference import LlmdFrame  # noqa: E402


def plot_walk(preds: Walk, y: dict[str, np.ndarray], path: Path) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(13, 8), sharex=True)
    index = np.arange(len(y["ttft"]))
    for ax, target, unit in zip(axes, TARGETS, ("TTFT (ms)", "TPOT (ms)"), strict=True):
        mask = y[target] > 0
        ax.scatter(index[mask], y[target][mask], s=3, color="black", alpha=0.5, label="actual")
        for model, color in (("leadtime", "tab:blue"), ("llmd_reference", "tab:orange")):
            mean, upper = preds[model][target]
            ax.plot(index[mask], mean[mask], lw=0.8, color=color, label=f"{model} mean")
            if model == "leadtime":
                ax.plot(index[mask], upper[mask], lw=0.6, color=color, ls=":", label="leadtime p90")
        ax.set_yscale("log")
        ax.set_ylabel(unit)
        ax.legend(loc="upper left", fontsize=8, ncols=4)
    axes[0].set_title("Prequential walk over real vLLM/H200 measurements (predict, then learn)")
    axes[1].set_xlabel("row (recording order; load ramps 1 → 16 QPS)")
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
) -> None:
    console = Console()
    rows = load_llmd_rows(data)[:max_rows]
    console.print(f"[bold]Leadtime demo[/bold]: {len(rows)} real rows from {data} ({accelerator}, {model})")
    x_lt = Vectorizer(accelerator, model).transform_llmd(rows)
    ttft, tpot = actuals(rows)
    y = {"ttft": ttft, "tpot": tpot}
    config = LearnerConfig(accelerator=accelerator, model=model, background=False)
    with Progress(console=console, transient=True) as bar:
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
    console.print(f"plot written to {path}")
