"""Fit the step-time model's per-accelerator coefficients to the measured kernel tables.

The tables in `leadtime.data`'s calibration/ (measured inside vLLM 0.14) time the pieces a transformer step is made
of: GEMMs, prefill (context) attention, decode (generation) attention and all-reduce. Each piece gets a small
roofline-shaped model with a handful of coefficients, fitted once by least squares on log latency (relative
error is what matters across six orders of magnitude). Beside the curves, the measured grids themselves are kept
where the step-time model looks shapes up directly: the GEMM table on its (m, n, k) grid, the all-reduce tables
(NCCL and vLLM's custom kernel) by message size and GPU count, and the host cost of an eager op read off the
eager vs graph-replayed all-reduce timings. The result is cached in `coefficients.json` beside this module so
that the simulator never needs the tables or scipy at run time. Regenerate it with:

    .venv/bin/python -m leadtime.simulator.calibration

which writes the same bytes on any machine (`_fit` says how).

Classes without tables (mi300x, tpu-*, gaudi3) are not fitted: `steptime.coefficients_for` derives them from the
published figures in features.catalog through the same model.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from leadtime.data import KERNEL_TABLES

COEFFICIENTS_PATH = Path(__file__).with_name("coefficients.json")

# Calibration file prefix → accelerator slug of features.catalog.
TABLE_CLASSES = {
    "a100_sxm": "a100-sxm-80gb",
    "h100_sxm": "h100-sxm",
    "h200_sxm": "h200-sxm",
    "l40s": "l40s",
}


def _read(path: Path, columns: tuple[str, ...], where: Callable[[dict[str, str]], bool] | None = None) -> np.ndarray:
    with path.open(newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if where is None or where(r)]
    if not rows:
        raise ValueError(f"{path}: no usable rows")
    return np.array([[float(r[c]) for c in columns] for r in rows], dtype=float)


def _fit(
    model: Callable[[np.ndarray, np.ndarray], np.ndarray], x: np.ndarray, y: np.ndarray, start: list[float]
) -> list[float]:
    """Least squares on log latency over log-parameters (keeps every coefficient positive).

    Reproducible to the byte on any machine: the solver runs to the optimum (default tolerances stop it
    ~1e-7 short, wherever the machine's BLAS rounding led it) and the coefficients keep `_FIT_DIGITS`
    significant digits, far above what is left of that rounding.
    """
    from scipy.optimize import least_squares

    def residual(logp: np.ndarray) -> np.ndarray:
        return np.log(model(np.exp(logp), x)) - np.log(y)

    result = least_squares(
        residual, np.log(np.array(start)), method="trf", max_nfev=10_000, ftol=1e-15, xtol=1e-15, gtol=1e-15
    )
    return [float(f"{v:.{_FIT_DIGITS}g}") for v in np.exp(result.x)]


_FIT_DIGITS = 6


def gemm_ms(p: np.ndarray | list[float], x: np.ndarray) -> np.ndarray:
    """Launch floor + max(compute at an efficiency that saturates with m, bytes moved at achieved bandwidth)."""
    c0, tflops, tb_s, m_half = p
    m, n, k = x[:, 0], x[:, 1], x[:, 2]
    flops = 2.0 * m * n * k
    bytes_moved = 2.0 * (m * k + k * n + m * n)
    efficiency = m / (m + m_half)
    return c0 + np.maximum(flops / (tflops * 1e9 * efficiency), bytes_moved / (tb_s * 1e9))


def context_attention_ms(p: np.ndarray | list[float], x: np.ndarray) -> np.ndarray:
    """Causal attention FLOPs at an achieved rate that saturates with sequence length."""
    c0, tflops, l_half = p
    b, isl, heads, head_dim = x[:, 0], x[:, 1], x[:, 2], x[:, 3]
    flops = 4.0 * b * heads * head_dim * isl * isl / 2.0
    return c0 + flops / (tflops * 1e9 * isl / (isl + l_half))


def generation_attention_ms(p: np.ndarray | list[float], x: np.ndarray) -> np.ndarray:
    """KV bytes read at achieved bandwidth, plus a per-sequence cost."""
    c0, tb_s, per_seq_us = p
    b, kv_len, kv_heads, head_dim = x[:, 0], x[:, 1], x[:, 2], x[:, 3]
    kv_bytes = b * kv_len * 2.0 * kv_heads * head_dim * 2.0
    return c0 + kv_bytes / (tb_s * 1e9) + b * per_seq_us * 1e-3


def allreduce_ms(p: np.ndarray | list[float], x: np.ndarray) -> np.ndarray:
    """Latency plus message bytes at achieved bandwidth."""
    latency_ms, gb_s = p
    return latency_ms + x[:, 0] / (gb_s * 1e6)


def _round(value: float) -> float:
    return float(f"{value:.5g}")


def _suffix_min(values: np.ndarray, axis: int) -> np.ndarray:
    """Latency can only grow with problem size: a smaller problem can always run padded to a larger one."""
    flipped = np.flip(values, axis=axis)
    return np.flip(np.minimum.accumulate(flipped, axis=axis), axis=axis)


def gemm_table(gemm: np.ndarray, curve: list[float]) -> dict[str, object]:
    """The measured GEMM latencies on their (m, n, k) grid, for per-shape lookup by interpolation.

    Cells the table lacks are filled from the fitted curve; outliers above a larger-m measurement of the same
    (n, k) are clipped to it (padding m to the larger size would have been faster).
    """
    ms, ns, ks = (np.unique(gemm[:, i]) for i in range(3))
    grid = np.full((len(ms), len(ns), len(ks)), np.nan)
    mi, ni, ki = (np.searchsorted(axis, gemm[:, i]) for i, axis in enumerate((ms, ns, ks)))
    grid[mi, ni, ki] = gemm[:, 3]
    missing = np.isnan(grid)
    if missing.any():
        m, n, k = np.meshgrid(ms, ns, ks, indexing="ij")
        x = np.stack([m[missing], n[missing], k[missing]], axis=1)
        grid[missing] = gemm_ms(curve, x)
    grid = _suffix_min(grid, axis=0)
    return {
        "m": [float(v) for v in ms],
        "n": [float(v) for v in ns],
        "k": [float(v) for v in ks],
        "ms": [[[_round(v) for v in row] for row in plane] for plane in grid],
    }


def allreduce_tables(directory: Path, base: str) -> dict[str, dict[str, dict[str, list[float]]]]:
    """Measured all-reduce latency by message bytes and GPU count: NCCL, and vLLM's custom kernel (graph-replayed).

    h200 has no NCCL table: its custom all-reduce stands in for NCCL (as in the curve fit).
    """
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    nccl_path = directory / f"{base}_nccl_half.csv"
    custom_path = directory / f"{base}_vllm_custom_allreduce_bf16.csv"
    sources: dict[str, tuple[Path, tuple[str, ...], Callable[[dict[str, str]], bool]]] = {
        "custom_graph": (
            custom_path,
            ("num_gpus", "message_size", "latency"),
            lambda r: r["kernel_source"].endswith("graph"),
        ),
    }
    if nccl_path.exists():
        sources["nccl"] = (nccl_path, ("num_gpus", "message_size", "latency"), lambda r: r["op_name"] == "all_reduce")
    else:
        sources["nccl"] = sources["custom_graph"]
    for name, (path, columns, where) in sources.items():
        rows = _read(path, columns, where)
        per_gpus: dict[str, dict[str, list[float]]] = {}
        for gpus in sorted(set(rows[:, 0].astype(int))):
            sel = rows[rows[:, 0] == gpus]
            sizes = np.unique(sel[:, 1])
            latency = np.array([np.median(sel[sel[:, 1] == s, 2]) for s in sizes])
            latency = _suffix_min(latency, axis=0)
            # message_size counts 16-bit elements.
            per_gpus[str(gpus)] = {"bytes": [float(2.0 * s) for s in sizes], "ms": [_round(v) for v in latency]}
        out[name] = per_gpus
    return out


def eager_host_ms(path: Path) -> dict[str, float]:
    """Host cost of one eager (no CUDA graph) all-reduce op, per GPU count.

    The table times a loop of the same all-reduce, eager and graph-replayed. Eagerly the host enqueues each op
    while the GPU runs the previous one, so the time per op is max(host cost, GPU time): flat at the host's cost
    (~20 µs on H100, ~44 µs on A100) while the graph-replayed GPU time below it still grows with the message.
    The host cost is therefore the eager time where the GPU is clearly not the bottleneck (graph time under half
    the eager time), not eager minus graph.
    """
    rows = _read(path, ("num_gpus", "message_size", "latency"))
    with path.open(newline="") as handle:
        eager = np.array([r["kernel_source"].endswith("eager") for r in csv.DictReader(handle)])
    out: dict[str, float] = {}
    for gpus in sorted(set(rows[:, 0].astype(int))):
        sel = rows[:, 0] == gpus
        graph = {size: lat for size, lat in rows[sel & ~eager, 1:3]}
        host_bound = [lat for size, lat in rows[sel & eager, 1:3] if graph.get(size, lat) < 0.5 * lat]
        if not host_bound:  # GPU-bound at every size: the smallest message's eager time bounds the host cost
            host_bound = [float(rows[sel & eager][np.argmin(rows[sel & eager, 1]), 2])]
        out[str(gpus)] = float(np.median(host_bound))
    return out


def fit_class(directory: Path, prefix: str) -> dict[str, object]:
    """All coefficients of one accelerator class from its five tables."""
    base = f"{prefix}_vllm0.14"
    gemm = _read(directory / f"{base}_gemm_bf16.csv", ("m", "n", "k", "latency"))
    g = _fit(gemm_ms, gemm[:, :3], gemm[:, 3], [0.005, 500.0, 2.0, 64.0])

    ctx = _read(
        directory / f"{base}_context_attention_bf16.csv",
        ("batch_size", "isl", "num_heads", "head_dim", "latency"),
    )
    c = _fit(context_attention_ms, ctx[:, :4], ctx[:, 4], [0.01, 300.0, 512.0])

    gen = _read(
        directory / f"{base}_generation_attention_bf16.csv",
        ("batch_size", "step", "num_key_value_heads", "head_dim", "latency"),
    )
    d = _fit(generation_attention_ms, gen[:, :4], gen[:, 4], [0.01, 2.0, 0.1])

    allreduce: dict[str, list[float]] = {}
    nccl_path = directory / f"{base}_nccl_half.csv"
    if nccl_path.exists():
        collective = _read(
            nccl_path, ("num_gpus", "message_size", "latency"), where=lambda r: r["op_name"] == "all_reduce"
        )
    else:  # h200 has no NCCL table: vLLM's own all-reduce (graph-replayed) times the same operation.
        collective = _read(
            directory / f"{base}_vllm_custom_allreduce_bf16.csv",
            ("num_gpus", "message_size", "latency"),
            where=lambda r: r["kernel_source"].endswith("graph"),
        )
    for gpus in sorted(set(collective[:, 0].astype(int))):
        rows = collective[collective[:, 0] == gpus]
        # message_size counts 16-bit elements.
        allreduce[str(gpus)] = _fit(allreduce_ms, rows[:, 1:2] * 2.0, rows[:, 2], [0.01, 100.0])

    host = eager_host_ms(directory / f"{base}_vllm_custom_allreduce_bf16.csv")
    # Host cost of one eager op of any kind: the cheapest all-reduce host path (fewest peers).
    launch_ms = min(host.values())
    return {
        "gemm_table": gemm_table(gemm, g),
        "allreduce_table": allreduce_tables(directory, base),
        "allreduce_launch_ms": host,
        "gemm": dict(zip(("c0_ms", "tflops", "tb_s", "m_half"), g, strict=True)),
        "context_attention": dict(zip(("c0_ms", "tflops", "len_half"), c, strict=True)),
        "generation_attention": dict(zip(("c0_ms", "tb_s", "per_seq_us"), d, strict=True)),
        "allreduce": {k: dict(zip(("latency_ms", "gb_s"), v, strict=True)) for k, v in allreduce.items()},
        "launch_ms": max(launch_ms, 0.0),
    }


def fit_all(directory: Path) -> dict[str, dict[str, object]]:
    """The coefficients of every class with tables, by catalog slug."""
    return {slug: fit_class(directory, prefix) for prefix, slug in TABLE_CLASSES.items()}


def load_coefficients(path: Path = COEFFICIENTS_PATH) -> dict[str, dict[str, object]]:
    """The cached coefficients."""
    data: dict[str, dict[str, object]] = json.loads(path.read_text())
    return data


def coefficients_text(coefficients: dict[str, dict[str, object]]) -> str:
    """The file's exact text: compact, keys sorted, one line."""
    return json.dumps(coefficients, separators=(",", ":"), sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    """`python -m leadtime.simulator.calibration [TABLES_DIR [OUT]]`: fit the tables (TABLES_DIR defaults to the
    shipped ones), write the coefficients (OUT defaults to the `coefficients.json` the simulator reads). 0 once
    written (or for `--help`), 2 with one line on stderr for an option or a third argument."""
    if argv[:1] in (["-h"], ["--help"]):
        print(
            "usage: python -m leadtime.simulator.calibration [TABLES_DIR [OUT]]  (TABLES_DIR: the kernel tables, "
            "default the shipped ones; OUT: default the coefficients.json the simulator reads)"
        )
        return 0
    if len(argv) > 2 or any(arg.startswith("-") for arg in argv):
        print(f"error: takes TABLES_DIR and OUT, and no options: got {' '.join(argv)}", file=sys.stderr)
        return 2
    directory = Path(argv[0]) if argv else KERNEL_TABLES
    out = Path(argv[1]) if len(argv) > 1 else COEFFICIENTS_PATH
    out.write_text(coefficients_text(fit_all(directory)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
