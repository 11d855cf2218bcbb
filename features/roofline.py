"""Roofline estimates of prefill and decode time from hardware and model figures alone.

They are deliberately simple (max of compute time and memory time, no kernel-level detail): their job is to
put a never-seen accelerator class on the right scale and to give the learner features that grow the way
latency does, not to be exact. Times are in milliseconds for one replica of `tensor_parallel` devices.
"""

from __future__ import annotations

import numpy as np

from leadtime.features.catalog import Accelerator, ModelProfile


def prefill_flops(model: ModelProfile, new_tokens: float, cached_tokens: float = 0.0) -> float:
    """Dense matmuls (2·params per token) plus causal attention over cached and new tokens."""
    dense = 2.0 * model.params_b * 1e9 * new_tokens
    attn_width = model.num_heads * model.head_dim
    attention = 4.0 * model.layers * attn_width * new_tokens * (cached_tokens + new_tokens / 2.0)
    return dense + attention


def prefill_ms(
    model: ModelProfile,
    accelerator: Accelerator,
    new_tokens: float,
    cached_tokens: float = 0.0,
    tensor_parallel: int = 1,
) -> float:
    """Time to prefill `new_tokens` uncached tokens after `cached_tokens` cached ones."""
    if new_tokens <= 0:
        return 0.0
    compute_s = prefill_flops(model, new_tokens, cached_tokens) / (accelerator.effective_tflops * 1e12)
    memory_s = model.weight_bytes / (accelerator.effective_tb_s * 1e12)
    return 1e3 * max(compute_s, memory_s) / tensor_parallel


def queue_prefill_ms(
    model: ModelProfile, accelerator: Accelerator, tokens: float, requests: float, tensor_parallel: int = 1
) -> float:
    """Prefilling `tokens` queued prompt tokens that belong to `requests` requests (at least one).

    Each prompt is its own sequence: its attention grows with its own length, not with the whole queue's. Taken
    as one sequence, 3.7M queued tokens (~500 long prompts) cost 60x their real attention work.

    >>> from leadtime.features.catalog import get_accelerator, get_model
    >>> qwen, h200 = get_model("qwen3-32b"), get_accelerator("h200-sxm")
    >>> one = prefill_ms(qwen, h200, 6000)
    >>> round(queue_prefill_ms(qwen, h200, 600_000, 100) / one, 6)
    100.0
    """
    if tokens <= 0:
        return 0.0
    count = min(max(requests, 1.0), tokens)
    return count * prefill_ms(model, accelerator, tokens / count, 0.0, tensor_parallel)


def decode_step_ms(
    model: ModelProfile,
    accelerator: Accelerator,
    batch_size: float,
    kv_tokens: float,
    tensor_parallel: int = 1,
) -> float:
    """One decode iteration for `batch_size` sequences holding `kv_tokens` KV tokens between them."""
    batch = max(batch_size, 1.0)
    read_bytes = model.weight_bytes + kv_tokens * model.kv_bytes_per_token(tensor_parallel)
    memory_s = read_bytes / (accelerator.effective_tb_s * 1e12)
    compute_s = 2.0 * model.params_b * 1e9 * batch / (accelerator.effective_tflops * 1e12)
    return 1e3 * max(memory_s, compute_s) / tensor_parallel


# Share of the memory left after the weights that vLLM gives to the KV cache (gpu_memory_utilization 0.9).
KV_MEMORY_SHARE = 0.9


def kv_capacity_tokens(model: ModelProfile, accelerator: Accelerator, tensor_parallel: int = 1) -> float:
    """Tokens of KV cache one replica holds: the memory of its devices less the weights (at least 1 GB is
    assumed left, so a model that barely fits still has a capacity), times `KV_MEMORY_SHARE`.

    >>> from leadtime.features.catalog import get_accelerator, get_model
    >>> round(kv_capacity_tokens(get_model("llama-3.1-8b"), get_accelerator("h100-sxm")))
    439041
    """
    free_bytes = max(accelerator.memory_gb * 1e9 * tensor_parallel - model.weight_bytes, 1e9)
    return free_bytes * KV_MEMORY_SHARE / model.kv_bytes_per_token(tensor_parallel)


def kv_transfer_ms(model: ModelProfile, tokens: float, link_gb_s: float, tensor_parallel: int) -> float:
    """Moving `tokens` tokens of KV cache over a link of `link_gb_s` GB/s (P/D disaggregation) into a decode
    endpoint of `tensor_parallel` devices: each of them receives its own KV heads, replicated ones included."""
    if link_gb_s <= 0:
        raise ValueError("link bandwidth must be positive")
    return 1e3 * tokens * model.kv_bytes_per_token(tensor_parallel) / (link_gb_s * 1e9)


Figures = np.ndarray | float  # per-row arrays, or one value shared by every row


def prefill_ms_array(
    params_b: Figures,
    layers: Figures,
    attn_width: Figures,
    weight_bytes: Figures,
    tflops: Figures,
    tb_s: Figures,
    new_tokens: Figures,
    cached_tokens: Figures,
    tp: Figures,
) -> np.ndarray:
    """`prefill_ms` over arrays of per-row figures (the service vectorizes a whole request this way)."""
    dense = 2.0 * params_b * 1e9 * new_tokens
    attention = 4.0 * layers * attn_width * new_tokens * (cached_tokens + new_tokens / 2.0)
    compute_s = (dense + attention) / (tflops * 1e12)
    memory_s = weight_bytes / (tb_s * 1e12)
    out = 1e3 * np.maximum(compute_s, memory_s) / tp
    return np.where(new_tokens <= 0, 0.0, out)


def decode_step_ms_array(
    params_b: Figures,
    weight_bytes: Figures,
    kv_bytes_per_token: Figures,
    tflops: Figures,
    tb_s: Figures,
    batch_size: Figures,
    kv_tokens: Figures,
    tp: Figures,
) -> np.ndarray:
    """`decode_step_ms` over arrays of per-row figures."""
    batch = np.maximum(batch_size, 1.0)
    read_bytes = weight_bytes + kv_tokens * kv_bytes_per_token
    memory_s = read_bytes / (tb_s * 1e12)
    compute_s = 2.0 * params_b * 1e9 * batch / (tflops * 1e12)
    return 1e3 * np.maximum(memory_s, compute_s) / tp
