"""How long one engine step takes on a replica: the physics of a transformer step with fitted coefficients.

A step runs every layer once over all tokens scheduled in it (prefill chunks and one token per decoding
sequence). Per layer: four GEMMs (QKV, output, gate-up, down) sharded over tensor parallelism, one prefill
attention and one decode attention kernel, and two all-reduces when TP > 1. Each piece uses the curve fitted to
the kernel tables (see calibration.py). On top sits the host cost of launching kernels: without CUDA graphs every
kernel of every layer pays it; with graphs only a handful per step do.

Classes without tables get the same curves with rates scaled from their published peaks by the mean
achieved/published ratio of the measured classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from features.catalog import ACCELERATORS, Accelerator, ModelProfile, get_accelerator
from simulator.calibration import load_coefficients

# Kernels launched per layer in an eager (no CUDA graph) step: 2 norms, QKV GEMM, rotary, KV-cache write,
# attention, output GEMM, all-reduce, gate-up GEMM, activation, down GEMM, all-reduce.
KERNELS_PER_LAYER = 12


@dataclass(frozen=True)
class Coefficients:
    gemm: tuple[float, float, float, float]
    context_attention: tuple[float, float, float]
    generation_attention: tuple[float, float, float]
    allreduce: dict[int, tuple[float, float]]
    launch_ms: float
    fitted: bool


def _from_json(raw: dict[str, object]) -> Coefficients:
    g = raw["gemm"]
    c = raw["context_attention"]
    d = raw["generation_attention"]
    ar = raw["allreduce"]
    assert isinstance(g, dict) and isinstance(c, dict) and isinstance(d, dict) and isinstance(ar, dict)
    launch = raw["launch_ms"]
    assert isinstance(launch, float | int)
    return Coefficients(
        gemm=(g["c0_ms"], g["tflops"], g["tb_s"], g["m_half"]),
        context_attention=(c["c0_ms"], c["tflops"], c["len_half"]),
        generation_attention=(d["c0_ms"], d["tb_s"], d["per_seq_us"]),
        allreduce={int(k): (v["latency_ms"], v["gb_s"]) for k, v in ar.items()},
        launch_ms=float(launch),
        fitted=True,
    )


@lru_cache(maxsize=1)
def _fitted() -> dict[str, Coefficients]:
    return {slug: _from_json(raw) for slug, raw in load_coefficients().items()}


def coefficients_for(accelerator: Accelerator) -> Coefficients:
    """Fitted coefficients for a measured class; published figures through the same curves otherwise."""
    fitted = _fitted()
    if accelerator.slug in fitted:
        return fitted[accelerator.slug]
    measured = [(ACCELERATORS[s], c) for s, c in fitted.items()]

    def mean(values: list[float]) -> float:
        return float(np.mean(values))

    compute_ratio = mean([c.gemm[1] / a.peak_tflops for a, c in measured])
    bandwidth_ratio = mean([c.gemm[2] / a.hbm_tb_s for a, c in measured])
    attn_compute_ratio = mean([c.context_attention[1] / a.peak_tflops for a, c in measured])
    attn_bandwidth_ratio = mean([c.generation_attention[1] / a.hbm_tb_s for a, c in measured])
    nvlink = [(a, c) for a, c in measured if a.interconnect_gb_s >= 100]
    allreduce: dict[int, tuple[float, float]] = {}
    for gpus in (2, 4, 8):
        latency = mean([c.allreduce[gpus][0] for _, c in nvlink])
        link_ratio = mean([c.allreduce[gpus][1] / a.interconnect_gb_s for a, c in nvlink])
        allreduce[gpus] = (latency, accelerator.interconnect_gb_s * link_ratio)
    return Coefficients(
        gemm=(
            mean([c.gemm[0] for _, c in measured]),
            accelerator.peak_tflops * compute_ratio,
            accelerator.hbm_tb_s * bandwidth_ratio,
            mean([c.gemm[3] for _, c in measured]),
        ),
        context_attention=(
            mean([c.context_attention[0] for _, c in measured]),
            accelerator.peak_tflops * attn_compute_ratio,
            mean([c.context_attention[2] for _, c in measured]),
        ),
        generation_attention=(
            mean([c.generation_attention[0] for _, c in measured]),
            accelerator.hbm_tb_s * attn_bandwidth_ratio,
            mean([c.generation_attention[2] for _, c in measured]),
        ),
        allreduce=allreduce,
        launch_ms=mean([c.launch_ms for _, c in measured]),
        fitted=False,
    )


def ffn_size(model: ModelProfile) -> int:
    """Intermediate size implied by the parameter count (embeddings ignored), rounded to 256."""
    attn = model.hidden_size * (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    attn += model.num_heads * model.head_dim * model.hidden_size
    per_layer = model.params_b * 1e9 / model.layers
    ffn = (per_layer - attn) / (3 * model.hidden_size)
    return max(256, int(round(ffn / 256.0)) * 256)


class StepTimeModel:
    """Step time of one replica (one model on `tensor_parallel` devices of one accelerator class).

    Parameters
    ----------
    accelerator, model
        Catalog entries.
    tensor_parallel
        Devices per replica; weights, heads and the FFN are split across them.
    cuda_graphs
        Whether steps replay CUDA graphs (vLLM's default) or launch every kernel from the host (eager).
    """

    def __init__(self, accelerator: Accelerator | str, model: ModelProfile, tensor_parallel: int = 1,
                 cuda_graphs: bool = True) -> None:
        self.accelerator = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
        self.model = model
        self.tensor_parallel = tensor_parallel
        self.cuda_graphs = cuda_graphs
        self.coefficients = coefficients_for(self.accelerator)
        tp = tensor_parallel
        h = model.hidden_size
        self._heads = max(1.0, model.num_heads / tp)
        self._kv_heads = max(1.0, model.num_kv_heads / tp)
        ffn = ffn_size(model)
        self._gemm_shapes = np.array(
            [
                [h, (model.num_heads + 2 * model.num_kv_heads) * model.head_dim / tp],  # k, n: QKV
                [model.num_heads * model.head_dim / tp, h],  # output projection
                [h, 2 * ffn / tp],  # gate-up
                [ffn / tp, h],  # down
            ]
        )
        self._gemm_pairs = [(float(k), float(n)) for k, n in self._gemm_shapes]
        launches = KERNELS_PER_LAYER * (1 if cuda_graphs else model.layers)
        self.host_ms = launches * self.coefficients.launch_ms
        self._decode_cache: dict[int, tuple[float, float]] = {}

    def _gemms_ms(self, tokens: float) -> float:
        """The four GEMMs of a layer (scalar arithmetic: this runs once per simulated step)."""
        c0, tflops, tb_s, m_half = self.coefficients.gemm
        rate = tflops * 1e9 * tokens / (tokens + m_half)
        total = 0.0
        for k, n in self._gemm_pairs:
            compute = 2.0 * tokens * n * k / rate
            memory = 2.0 * (tokens * k + k * n + tokens * n) / (tb_s * 1e9)
            total += c0 + (compute if compute > memory else memory)
        return total

    def _allreduce_ms(self, tokens: float) -> float:
        tp = self.tensor_parallel
        if tp <= 1:
            return 0.0
        table = self.coefficients.allreduce
        gpus = tp if tp in table else min(table, key=lambda g: abs(g - tp))
        latency_ms, gb_s = table[gpus]
        return 2.0 * (latency_ms + tokens * self.model.hidden_size * 2.0 / (gb_s * 1e6))

    def prefill_attention_ms(self, chunks: list[tuple[int, int]]) -> float:
        """Per-layer prefill attention for chunks of (new tokens, tokens already in context)."""
        if not chunks:
            return 0.0
        c0, tflops, len_half = self.coefficients.context_attention
        hd = self.model.head_dim
        total = c0
        for new, cached in chunks:
            length = cached + new
            flops = 4.0 * self._heads * hd * new * (cached + new / 2.0)
            total += flops / (tflops * 1e9 * length / (length + len_half))
        return total

    def decode_attention_ms(self, sequences: int, kv_tokens: float) -> float:
        """Per-layer decode attention for `sequences` sequences holding `kv_tokens` KV tokens in all."""
        if sequences <= 0:
            return 0.0
        c0, tb_s, per_seq_us = self.coefficients.generation_attention
        kv_bytes = kv_tokens * 2.0 * self._kv_heads * self.model.head_dim * 2.0
        return c0 + kv_bytes / (tb_s * 1e9) + sequences * per_seq_us * 1e-3

    def step_ms(self, chunks: list[tuple[int, int]], decode_sequences: int, decode_kv_tokens: float) -> float:
        """One step: prefill `chunks` (new, cached) plus one token for each of `decode_sequences` sequences."""
        tokens = sum(n for n, _ in chunks) + decode_sequences
        if tokens <= 0:
            return 0.0
        per_layer = (
            self._gemms_ms(tokens)
            + self.prefill_attention_ms(chunks)
            + self.decode_attention_ms(decode_sequences, decode_kv_tokens)
            + self._allreduce_ms(tokens)
        )
        return self.host_ms + self.model.layers * per_layer

    def decode_affine(self, sequences: int) -> tuple[float, float]:
        """A decode-only step with `sequences` sequences costs `a + b · kv_tokens` ms: returns (a, b).

        Lets the simulator advance many decode steps at once in closed form.
        """
        cached = self._decode_cache.get(sequences)
        if cached is None:
            c0, tb_s, per_seq_us = self.coefficients.generation_attention
            per_token = 2.0 * self._kv_heads * self.model.head_dim * 2.0 / (tb_s * 1e9)
            a = self.host_ms + self.model.layers * (
                self._gemms_ms(sequences) + self._allreduce_ms(sequences) + c0 + sequences * per_seq_us * 1e-3
            )
            cached = (a, self.model.layers * per_token)
            self._decode_cache[sequences] = cached
        return cached

    def prefill_ms(self, prompt_tokens: int, batch: int = 1) -> float:
        """Prefill of `batch` prompts of `prompt_tokens` tokens in one step (no cache hits)."""
        return self.step_ms([(prompt_tokens, 0)] * batch, 0, 0.0)
