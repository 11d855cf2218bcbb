"""The retraining job's report: report.json, a short report.md, and four PNG plots.

- predicted_vs_actual.png: each model's mean prediction against the actual, per target (log-log);
- error_by_class.png: MAPE per accelerator class and role, per target and model;
- calibration.png: how often the actual stays at or below the upper quantile, by decile of the predicted
  quantile (a calibrated p90 sits on the 0.9 line in every decile);
- feature_importances.png: the new trees' gain per feature (features/ columns plus the log physics prior).

Plots are drawn on `matplotlib.figure.Figure` objects (no pyplot, no global backend state).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from leadtime.json_text import dumps, print_json
from leadtime.predictor.physics import TARGETS
from leadtime.predictor.trees import TREE_FEATURES
from leadtime.training.champion import Evaluation
from leadtime.training.fit import TargetTrees

CHAMPION_IN_SAMPLE = (
    "A champion that has served has learned the rows it was sent: on those of the evaluation slice, its figures are "
    "in-sample, which favours keeping it. The job counts them (a warning) only for the rows of a stream whose "
    "position the champion records; a file, such as an export of the service's log, carries no such record."
)
"""Said under the figures whenever a champion was judged: who learned which rows the job can tell only in part."""
_COLOURS = {"champion": "tab:gray", "online_only": "tab:gray", "challenger": "tab:blue"}
_POINTS = 4000  # points per model in a scatter plot (evenly thinned beyond)
_TOP_FEATURES = 12


@dataclass
class Draft:
    """A report drawn in a hidden folder inside its directory, waiting to be moved into place.

    Drawing takes a second or two, and a job interrupted then (the model perhaps already published) left the
    directory holding this run's first plots beside an earlier run's report.json. Drawn aside and moved in at
    once, the directory holds one run's report or the other's, whole."""

    directory: Path
    folder: Path
    names: list[str]  # in the order they are moved into place: report.json, which lists them, last

    def place(self) -> list[Path]:
        """Move every file into `directory` (each replacing an earlier run's); returns their paths there."""
        for name in self.names:
            os.replace(self.folder / name, self.directory / name)
        self.discard()
        return [self.directory / name for name in self.names]

    def discard(self) -> None:
        """Remove the folder and what is left in it (all of the draft, unless it was placed)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def draft_report(
    directory: Path, report: dict[str, Any], evaluation: dict[str, Evaluation], trees: dict[str, TargetTrees]
) -> Draft:
    """Draw every file in a new hidden folder inside `directory` (created if needed), for `Draft.place`; the folder
    is removed again if drawing fails or is interrupted."""
    directory.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=".report-", dir=directory))
    try:
        drawn = [
            _predicted_vs_actual(folder / "predicted_vs_actual.png", evaluation),
            _error_by_class(folder / "error_by_class.png", evaluation),
            _calibration(folder / "calibration.png", evaluation, float(report["training"]["quantile"])),
            _importances(folder / "feature_importances.png", trees),
        ]
        (folder / "report.md").write_text(summary_markdown(report))
        names = [p.name for p in drawn] + ["report.md", "report.json"]
        listed = {**report, "files": [str(directory / name) for name in names]}  # where they will be
        (folder / "report.json").write_text(dumps(listed, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return Draft(directory, folder, names)


def _figure(value: Any, digits: int) -> str:
    """A figure of report.md: a dash where none could be computed (no row observed the target).

    >>> _figure(0.12345, 4), _figure(float("nan"), 4), _figure(None, 3)
    ('0.1235', '–', '–')
    """
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return f"{value:.{digits}f}"


def kept_version(registry: dict[str, Any]) -> Any:
    """The version a kept outcome kept: the one published while the job ran, when it was judged against again.

    >>> kept_version({"champion_version": 26, "judged_again_against_version": 28})
    28
    """
    again = registry.get("judged_again_against_version")
    return again if again is not None else registry["champion_version"]


def summary_markdown(report: dict[str, Any]) -> str:
    """A short human summary: the decision, the figures it rests on, the data and the time taken."""
    registry = report["registry"]
    lines = ["# Offline retraining", ""]
    if report["outcome"] == "published":
        lines.append(f"**Published** as version {registry['published_version']} to {registry['name']}.")
    else:
        lines.append(f"**Champion kept** (version {kept_version(registry)} in {registry['name']}).")
    lines += ["", report["decision"]["reason"], ""]
    for warning in report.get("warnings", []):
        lines += [f"**Warning:** {warning}", ""]
    lines += [
        "| model | target | rows | MAPE | median APE | upper-quantile loss | coverage |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, scores in report["evaluation"].items():
        for target in TARGETS:
            s = scores[target]
            figures = [_figure(s[k], 4) for k in ("mape", "median_ape", "pinball")] + [_figure(s["coverage"], 3)]
            lines.append(f"| {name} | {target} | {s['rows']} | " + " | ".join(figures) + " |")
    if "champion" in report["evaluation"]:
        lines += ["", CHAMPION_IN_SAMPLE]
    samples = report["samples"]
    lines += ["", "## Data", ""]
    for source in samples["sources"]:
        lines.append(
            f"- {source['name']} ({source['kind']}): {source['read']} rows read, {source['used']} used, "
            f"{source['malformed']} malformed"
        )
    listed = samples["malformed"][:5]
    for item in listed:
        lines.append(f"  - {item['source']} {item['where']}: {item['problem']}")
    if samples["malformed_total"] > len(listed):
        lines.append(f"  - ... {samples['malformed_total'] - len(listed)} more in report.json")
    order = samples["ordered_by"] + (f" ({samples['order_reason']})" if samples.get("order_reason") else "")
    lines.append(
        f"- ordered by {order}; history {samples['history_rows']} rows, evaluation slice (most "
        f"recent) {samples['evaluation_rows']} rows"
    )
    training = report["training"]
    lines += ["", "## Training", ""]
    lines.append(f"- backend: {training['backend']} ({training['workers']} worker(s))")
    for target, fitted in training["targets"].items():
        state = {True: "installed", False: "not better than what served, not installed"}
        lines.append(
            f"- {target}: {_trees(fitted['trees']['mean'], 'point-prediction')} ({_setting(fitted['chosen']['mean'])}; "
            f"{state[fitted['accepted']['mean']]}), {_trees(fitted['trees']['upper'], 'upper-quantile')} "
            f"({_setting(fitted['chosen']['upper'])}; {state[fitted['accepted']['upper']]}), fitted on "
            f"{fitted['rows']['fit']} rows"
        )
    timings = report["timings_s"]
    lines.append("- time: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in timings.items()))
    return "\n".join(lines) + "\n"


def _trees(count: int, kind: str) -> str:
    """`count` trees of `kind`, in words: "1 upper-quantile tree", "60 upper-quantile trees".

    >>> _trees(1, "upper-quantile"), _trees(60, "point-prediction")
    ('1 upper-quantile tree', '60 point-prediction trees')
    """
    return f"{count} {kind} tree{'' if count == 1 else 's'}"


def _setting(chosen: dict[str, Any]) -> str:
    """A chosen setting in words.

    >>> _setting({"objective": "median", "num_leaves": 5, "min_data_in_leaf": 200})
    'median, 5 leaves, ≥ 200 rows a leaf'
    """
    rest = {k: v for k, v in chosen.items() if k not in ("objective", "num_leaves", "min_data_in_leaf")}
    words = [str(chosen.get("objective", "")), f"{chosen.get('num_leaves')} leaves"]
    words.append(f"≥ {chosen.get('min_data_in_leaf')} rows a leaf")
    words += [f"{k} {v}" for k, v in sorted(rest.items())]
    return ", ".join(words)


def _thin(n: int) -> np.ndarray:
    return np.linspace(0, n - 1, min(n, _POINTS)).astype(int) if n else np.zeros(0, dtype=int)


def _predicted_vs_actual(path: Path, evaluation: dict[str, Evaluation]) -> Path:
    fig = Figure(figsize=(11, 5))
    for i, target in enumerate(TARGETS):
        ax = fig.add_subplot(1, len(TARGETS), i + 1)
        low, high = np.inf, 0.0
        for name, ev in evaluation.items():
            p = ev.predictions[target]
            keep = _thin(len(p["actual"]))
            if not len(keep):
                continue
            actual, mean = p["actual"][keep], p["mean"][keep]
            ax.scatter(actual, mean, s=4, alpha=0.35, color=_COLOURS.get(name), label=name)
            low = min(low, float(actual.min()), float(np.maximum(mean, 1e-3).min()))
            high = max(high, float(actual.max()), float(mean.max()))
        if high > 0:
            ax.plot([low, high], [low, high], color="black", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(loc="upper left")
        ax.set_xlabel(f"actual {target} (ms)")
        ax.set_ylabel(f"predicted mean {target} (ms)")
        ax.set_title(f"{target}: predicted vs actual (evaluation slice)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _error_by_class(path: Path, evaluation: dict[str, Evaluation]) -> Path:
    fig = Figure(figsize=(11, 5))
    names = list(evaluation)
    for i, target in enumerate(TARGETS):
        ax = fig.add_subplot(1, len(TARGETS), i + 1)
        groups = sorted(set().union(*(ev.groups[target] for ev in evaluation.values())))
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            values = [evaluation[name].groups[target].get(g) for g in groups]
            heights = [v.mape if v is not None else 0.0 for v in values]
            positions = np.arange(len(groups)) + j * width
            ax.bar(positions, heights, width, color=_COLOURS.get(name), label=name)
        ax.set_xticks(np.arange(len(groups)) + width * (len(names) - 1) / 2)
        ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("MAPE of the mean prediction")
        ax.set_title(f"{target}: error by accelerator class and role")
        if groups:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def calibration_curve(actual: np.ndarray, upper: np.ndarray, bins: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """(median predicted quantile, coverage) per bin of equal row count, bins ordered by the predicted quantile.

    >>> centre, coverage = calibration_curve(np.arange(1.0, 11.0), np.arange(1.0, 11.0) + 0.5, bins=2)
    >>> centre.tolist(), coverage.tolist()
    ([3.5, 8.5], [1.0, 1.0])
    """
    if not len(actual):
        return np.zeros(0), np.zeros(0)
    order = np.argsort(upper, kind="stable")
    parts = [p for p in np.array_split(order, min(bins, len(order))) if len(p)]
    centre = np.array([float(np.median(upper[p])) for p in parts])
    coverage = np.array([float(np.mean(actual[p] <= upper[p])) for p in parts])
    return centre, coverage


def _calibration(path: Path, evaluation: dict[str, Evaluation], quantile: float) -> Path:
    fig = Figure(figsize=(11, 5))
    for i, target in enumerate(TARGETS):
        ax = fig.add_subplot(1, len(TARGETS), i + 1)
        for name, ev in evaluation.items():
            p = ev.predictions[target]
            centre, coverage = calibration_curve(p["actual"], p["upper"])
            if len(centre):
                ax.plot(centre, coverage, marker="o", color=_COLOURS.get(name), label=name)
        ax.axhline(quantile, color="black", linewidth=0.8, linestyle="--", label=f"target {quantile:g}")
        ax.set_xscale("log")
        ax.set_ylim(0.0, 1.02)
        ax.set_xlabel(f"predicted upper quantile of {target} (ms), deciles")
        ax.set_ylabel("share of actuals at or below it")
        ax.set_title(f"{target}: quantile calibration")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def _importances(path: Path, trees: dict[str, TargetTrees]) -> Path:
    fig = Figure(figsize=(11, 5))
    for i, target in enumerate(TARGETS):
        ax = fig.add_subplot(1, len(TARGETS), i + 1)
        fitted = trees.get(target)
        if fitted is None:
            ax.set_title(f"{target}: no trees fitted")
            continue
        mean_gain = np.asarray(fitted.candidate_mean.feature_importance(importance_type="gain"), dtype=float)
        upper_gain = np.asarray(fitted.candidate_upper.feature_importance(importance_type="gain"), dtype=float)
        mean_share = mean_gain / max(mean_gain.sum(), 1e-12)
        upper_share = upper_gain / max(upper_gain.sum(), 1e-12)
        top = np.argsort(-(mean_share + upper_share))[:_TOP_FEATURES][::-1]
        positions = np.arange(len(top))
        used = {True: "installed", False: "not installed"}
        ax.barh(positions - 0.2, mean_share[top], 0.4, label=f"point trees ({used[fitted.accepted['mean']]})")
        ax.barh(positions + 0.2, upper_share[top], 0.4, label=f"upper trees ({used[fitted.accepted['upper']]})")
        ax.set_yticks(positions)
        ax.set_yticklabels([TREE_FEATURES[j] for j in top], fontsize=8)
        ax.set_xlabel("share of the trees' gain")
        ax.set_title(f"{target}: feature importances")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def print_result(report: dict[str, Any], as_json: bool) -> None:
    """The report as one JSON object, or a few lines: the outcome, the figures it rests on, where the files are."""
    if as_json:
        print_json(report)
        return
    registry = report["registry"]
    if report["outcome"] == "published":
        print(f"published version {registry['published_version']} to {registry['name']}")
    else:
        print(f"kept the champion (version {kept_version(registry)} in {registry['name']})")
    print(report["decision"]["reason"])
    samples = report["samples"]
    order = samples["ordered_by"] + (f" ({samples['order_reason']})" if samples.get("order_reason") else "")
    print(
        f"{samples['rows']} rows used ({samples['malformed_total']} malformed left out), ordered by "
        f"{order}; judged on the most recent {samples['evaluation_rows']}; "
        f"{report['timings_s']['total_s']:.1f} s on {report['training']['backend']}"
    )
    for path in report.get("files", []):
        if path.endswith("report.md"):
            print(f"report: {path}")
