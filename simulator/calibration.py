"""Fit the step-time model's per-accelerator coefficients to the measured kernel tables.

The tables in ../shared/data/calibration (measured inside vLLM 0.14) time the pieces a transformer step is made
of: GEMMs, prefill (context) attention, decode (generation) attention and all-reduce. Each piece gets a small
roofline-shaped model with a handful of coefficients, fitted once by least squares on log latency (relative
error is what matters across six orders of magnitude). The result is cached in `coefficients.json` beside this
module so that the simulator never needs the tables or scipy at run time. Regenerate it with:

    .venv/bin/python -m simulator.calibration ../shared/data/calibration

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


def _fit(model: Callable[[np.ndarray, np.ndarray], np.ndarray], x: np.ndarray, y: np.ndarray,
         start: list[float]) -> list[float]:
    """Least squares on log latency over log-parameters (keeps every coefficient positive)."""
    from scipy.optimize import least_squares

    def residual(logp: np.ndarray) -> np.ndarray:
        return np.log(model(np.exp(logp), x)) - np.log(y)

    result = least_squares(residual, np.log(np.array(start)), method="trf", max_nfev=2000)
    return [float(v) for v in np.exp(result.x)]


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
    latency_ms, gb_s = p
    return latency_ms + x[:, 0] / (gb_s * 1e6)


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

    custom = _read(
        directory / f"{base}_vllm_custom_allreduce_bf16.csv",
        ("num_gpus", "message_size", "latency"),
        where=lambda r: int(r["message_size"]) <= 65536,
    )
    with (directory / f"{base}_vllm_custom_allreduce_bf16.csv").open(newline="") as handle:
        kinds = [r["kernel_source"] for r in csv.DictReader(handle) if int(r["message_size"]) <= 65536]
    eager = np.array([k.endswith("eager") for k in kinds])
    # Host cost of launching one kernel without CUDA graphs: the same all-reduce, eager minus graph-replayed.
    launch_ms = float(np.median(custom[eager, 2]) - np.median(custom[~eager, 2]))
    return {
        "gemm": dict(zip(("c0_ms", "tflops", "tb_s", "m_half"), g, strict=True)),
        "context_attention": dict(zip(("c0_ms", "tflops", "len_half"), c, strict=True)),
        "generation_attention": dict(zip(("c0_ms", "tb_s", "per_seq_us"), d, strict=True)),
        "allreduce": {k: dict(zip(("latency_ms", "gb_s"), v, strict=True)) for k, v in allreduce.items()},
        "launch_ms": max(launch_ms, 0.0),
    }


def fit_all(directory: Path) -> dict[str, dict[str, object]]:
    return {slug: fit_class(directory, prefix) for prefix, slug in TABLE_CLASSES.items()}


def load_coefficients(path: Path = COEFFICIENTS_PATH) -> dict[str, dict[str, object]]:
    data: dict[str, dict[str, object]] = json.loads(path.read_text())
    return data


def main(argv: list[str]) -> None:
    directory = Path(argv[0]) if argv else Path("../shared/data/calibration")
    coefficients = fit_all(directory)
    COEFFICIENTS_PATH.write_text(json.dumps(coefficients, indent=2, sort_keys=True) + "\n")
    print(f"wrote {COEFFICIENTS_PATH}")


if __name__ == "__main__":
    main(sys.argv[1:])
