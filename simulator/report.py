"""Turn simulation results into what the CLI prints and writes: percentiles, SLO attainment, goodput,
utilisation, the observation JSONL and plots."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from leadtime.features.rows import ROUTED_BY_FIELD, observation_to_llmd
from leadtime.json_text import dumps
from leadtime.plots import draw_cdf, shared_legend
from leadtime.simulator.engine import FailedRequest, SimResult

OBSERVATIONS_FILE, REPORT_FILE = "observations.jsonl", "report.json"
CDF_FILE, UTILISATION_FILE = "latency_cdf.png", "utilisation.png"
RUN_FILES = (OBSERVATIONS_FILE, REPORT_FILE, CDF_FILE, UTILISATION_FILE)
"""The files `leadtime simulate --out` writes, in the order it writes them."""


def run_files_in(directory: Path) -> list[str]:
    """The names of `RUN_FILES` already in `directory`: a run there would replace them (an earlier run's, or a
    user's own `report.json`)."""
    return [name for name in RUN_FILES if (directory / name).exists()]


@contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """A temporary name beside `path` (same suffix: matplotlib picks the format by it) to write to, renamed to
    `path` once the write is done: a write cut short (Ctrl-C, a full disk) leaves no half file under the name, and
    the temporary one is removed."""
    part = path.with_name(f".{path.stem}.part{path.suffix}")
    try:
        yield part
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(values.mean())}


def _busy_ms(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    if not intervals or end <= start:
        return 0.0
    spans = np.array(intervals)
    return float(np.clip(np.minimum(spans[:, 1], end) - np.maximum(spans[:, 0], start), 0, None).sum())


def summarize(result: SimResult) -> dict[str, object]:
    """One policy's figures: latency percentiles (ms), SLO attainment, goodput, per-endpoint utilisation.

    Each request is judged against its own SLOs (the fleet's SLO classes, or the command's); goodput counts the
    requests that met both per second of the arrival window. A failed request (`SimResult.failed`) missed both:
    it counts in the attainments, not in the latency percentiles (it has no latency).
    """
    done = result.completed
    ttft = np.array([c.ttft_ms for c in done])
    itl = np.array([c.itl_ms for c in done if c.output_tokens > 1])
    e2e = np.array([c.e2e_ms for c in done])
    meets_ttft = np.array([c.ttft_ms <= c.ttft_slo_ms for c in done], dtype=bool)
    meets_itl = np.array([c.itl_ms <= c.itl_slo_ms for c in done], dtype=bool)
    classes: dict[tuple[float, float], int] = {}
    for c in done:
        classes[(c.ttft_slo_ms, c.itl_slo_ms)] = classes.get((c.ttft_slo_ms, c.itl_slo_ms), 0) + 1
    both = meets_ttft & meets_itl
    judged = len(done) + len(result.failed)
    span_ms = max(result.duration_ms, 1e-9)
    endpoints: dict[str, object] = {}
    for endpoint_id, info in result.endpoints.items():
        served = sum(1 for c in done if c.endpoint_id == endpoint_id or c.decode_endpoint_id == endpoint_id)
        endpoints[endpoint_id] = {
            **info,
            "utilisation": _busy_ms(result.busy[endpoint_id], 0.0, span_ms) / span_ms,
            "requests": served,
        }
    return {
        "ttft_ms": _percentiles(ttft),
        "itl_ms": _percentiles(itl),
        "e2e_ms": _percentiles(e2e),
        "slo": [{"ttft_ms": t, "itl_ms": i, "share": n / len(done)} for (t, i), n in sorted(classes.items())],
        "slo_attainment": float(both.sum() / judged) if judged else 0.0,
        "ttft_slo_attainment": float(meets_ttft.sum() / judged) if judged else 0.0,
        "itl_slo_attainment": float(meets_itl.sum() / judged) if judged else 0.0,
        "goodput_rps": result.goodput_rps,
        "completed": len(done),
        "failed": len(result.failed),
        "failures": _failures(result.failed),
        "preemptions": result.preemptions,
        "prefix_hit_rate": float(sum(c.prefix_hit_tokens for c in done) / max(1, sum(c.input_tokens for c in done))),
        "simulated_s": span_ms / 1e3,
        "endpoints": endpoints,
    }


def _failures(failed: list[FailedRequest]) -> dict[str, dict[str, object]]:
    """The failed requests by kind (`FailedRequest.kind`), each with how many and one reason as an example (a
    reason names its request, so counting by reason would make one entry per failed request)."""
    kinds = Counter(f.kind for f in failed)
    examples: dict[str, str] = {}
    for f in failed:
        examples.setdefault(f.kind, f.reason)
    return {kind: {"count": n, "example": examples[kind]} for kind, n in sorted(kinds.items())}


def write_observations(results: list[SimResult], path: Path) -> int:
    """Every observation as an llm-d training row plus Leadtime's fields and the policy that routed it."""
    n = 0
    with written_whole(path) as part, part.open("w") as handle:
        for result in results:
            for obs in result.observations:
                row = observation_to_llmd(obs)
                row["prefix_hit_tokens"] = obs.row.request.prefix_hit_tokens
                row[ROUTED_BY_FIELD] = result.policy
                handle.write(json.dumps(row) + "\n")
                n += 1
    return n


def write_report(report: dict[str, object], path: Path) -> None:
    """The JSON report, indented for a reader; strict JSON (`json_text.dumps`): an infinite SLO is null."""
    with written_whole(path) as part:
        part.write_text(dumps(report, indent=2) + "\n")


def utilisation_matrix(result: SimResult, buckets: int = 100) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Time-bucket edges (ms), endpoint ids in fleet order, and each endpoint's busy share of each bucket."""
    edges = np.linspace(0.0, max(result.duration_ms, 1.0), buckets + 1)
    width = edges[1] - edges[0]
    ids = list(result.busy)
    matrix = np.array(
        [[_busy_ms(result.busy[e], lo, hi) / width for lo, hi in zip(edges[:-1], edges[1:], strict=True)] for e in ids]
    )
    return edges, ids, np.clip(matrix.reshape(len(ids), buckets), 0.0, 1.0)


def slo_thresholds(results: list[SimResult]) -> tuple[list[float], list[float]]:
    """The TTFT and ITL SLO thresholds (ms) the requests were judged by, each once: every request carries its own
    (its class's, or the command's), so they are read from the requests rather than assumed."""
    done = [c for r in results for c in r.completed]
    return sorted({c.ttft_slo_ms for c in done}), sorted({c.itl_slo_ms for c in done})


CDF_PANELS = (("ttft_ms", "TTFT", "s", 1e-3), ("itl_ms", "ITL", "ms", 1.0), ("e2e_ms", "end-to-end", "s", 1e-3))
"""The latency CDFs drawn: (field of a completed request, name, axis unit, scale from ms)."""


def write_plots(results: list[SimResult], directory: Path, buckets: int = 100) -> list[Path]:
    """Latency CDFs per policy, and per-endpoint utilisation over time as one heat map per policy (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), layout="constrained")
    ttft_slos, itl_slos = slo_thresholds(results)
    slos = {"ttft_ms": ttft_slos, "itl_ms": itl_slos, "e2e_ms": []}
    for ax, (field, what, unit, scale) in zip(axes, CDF_PANELS, strict=True):
        samples = {
            r.policy: [getattr(c, field) * scale for c in r.completed if field != "itl_ms" or c.output_tokens > 1]
            for r in results
        }
        draw_cdf(ax, samples, [s * scale for s in slos[field]], what, unit)
        ax.set_title(f"{what}: share of requests within a latency", pad=14)
    fig.suptitle("latency CDFs of the completed requests, per policy (SLO thresholds dashed)")
    shared_legend(fig, axes, where="lower center")
    cdf = directory / CDF_FILE
    with written_whole(cdf) as part:
        fig.savefig(part, dpi=100)
    plt.close(fig)
    paths.append(cdf)

    # One heat map per policy: a row per endpoint (grouped by pool), colour = share of each time bucket the endpoint
    # had a step in flight. One time axis for all, so that the policies' panels are compared at the same instants.
    rows_per_policy = max(len(r.busy) for r in results)
    height = max(2.2, 0.22 * rows_per_policy + 1.2)
    fig, axes = plt.subplots(
        len(results), 1, figsize=(12, height * len(results)), squeeze=False, sharex=True, layout="constrained"
    )
    image = None
    for ax, result in zip(axes[:, 0], results, strict=True):
        edges, ids, matrix = utilisation_matrix(result, buckets)
        image = ax.imshow(
            matrix,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            vmin=0.0,
            vmax=1.0,
            extent=(edges[0] / 1e3, edges[-1] / 1e3, len(ids) - 0.5, -0.5),
        )
        ax.set_yticks(range(len(ids)), ids, fontsize=8 if len(ids) <= 16 else 6)
        pools = [endpoint.rsplit("-", 1)[0] for endpoint in ids]
        for i in range(1, len(ids)):
            if pools[i] != pools[i - 1]:
                ax.axhline(i - 0.5, color="white", linewidth=1.5)
        ax.set_title(f"utilisation over time — {result.policy}")
        ax.set_ylabel("endpoint")
    axes[-1, 0].set_xlim(0.0, max(max(r.duration_ms, 1.0) for r in results) / 1e3)
    axes[-1, 0].set_xlabel("simulated time (s)")
    if image is not None:
        bar = fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.025, pad=0.01, aspect=40)
        bar.set_label("share of the time bucket the endpoint had ≥ 1 request running")
    util = directory / UTILISATION_FILE
    with written_whole(util) as part:
        fig.savefig(part, dpi=100, bbox_inches="tight")
    plt.close(fig)
    paths.append(util)
    return paths
