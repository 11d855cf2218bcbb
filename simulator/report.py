"""Turn simulation results into what the CLI prints and writes: percentiles, SLO attainment, goodput,
utilisation, the observation JSONL and plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from leadtime.features.rows import observation_to_llmd
from leadtime.simulator.engine import SimResult


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

    Each request is judged against its own SLOs (its class in the fleet file, or the command's SLOs).
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
    both = meets_ttft & meets_itl if done else np.array([], dtype=bool)
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
        "slo_attainment": float(both.mean()) if done else 0.0,
        "ttft_slo_attainment": float(meets_ttft.mean()) if done else 0.0,
        "itl_slo_attainment": float(meets_itl.mean()) if done else 0.0,
        "goodput_rps": float(both.sum() / (span_ms / 1e3)),
        "completed": len(done),
        "preemptions": result.preemptions,
        "prefix_hit_rate": float(sum(c.prefix_hit_tokens for c in done) / max(1, sum(c.input_tokens for c in done))),
        "simulated_s": span_ms / 1e3,
        "endpoints": endpoints,
    }


def write_observations(results: list[SimResult], path: Path) -> int:
    """Every observation as an llm-d training row plus Leadtime's fields and the policy that routed it."""
    n = 0
    with path.open("w") as handle:
        for result in results:
            for obs in result.observations:
                row = observation_to_llmd(obs)
                row["prefix_hit_tokens"] = obs.row.request.prefix_hit_tokens
                row["policy"] = result.policy
                handle.write(json.dumps(row) + "\n")
                n += 1
    return n


def write_plots(results: list[SimResult], directory: Path, buckets: int = 100) -> list[Path]:
    """Latency CDFs per policy and per-endpoint utilisation over time (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for result in results:
        for ax, name in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), strict=True):
            values = np.sort(np.array([getattr(c, name) for c in result.completed]))
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=result.policy)
    for ax, title in zip(axes, ("TTFT (ms)", "ITL (ms)", "end-to-end (ms)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    cdf = directory / "latency_cdf.png"
    fig.savefig(cdf, dpi=100)
    plt.close(fig)
    paths.append(cdf)

    fig, axes = plt.subplots(len(results), 1, figsize=(12, 3 * len(results)), squeeze=False)
    for ax, result in zip(axes[:, 0], results, strict=True):
        edges = np.linspace(0.0, max(result.duration_ms, 1.0), buckets + 1)
        width = edges[1] - edges[0]
        for endpoint_id, intervals in result.busy.items():
            use = [_busy_ms(intervals, lo, hi) / width for lo, hi in zip(edges[:-1], edges[1:], strict=True)]
            ax.plot(edges[:-1] / 1e3, use, label=endpoint_id, linewidth=0.8)
        ax.set_title(f"utilisation over time — {result.policy}")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=6, ncol=4)
    fig.tight_layout()
    util = directory / "utilisation.png"
    fig.savefig(util, dpi=100)
    plt.close(fig)
    paths.append(util)
    return paths
