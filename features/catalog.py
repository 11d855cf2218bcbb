"""Accelerator classes and model profiles: the hardware facts that let one model serve a mixed fleet.

Figures are the published dense BF16 peaks and memory bandwidths; where kernel timings were measured (vLLM 0.14
kernel tables, summarised here; the tables ship in `leadtime.data`) the measured GEMM throughput and KV-read
bandwidth are kept beside them, because a roofline built on achieved rather than peak figures is what predicts
real step times. Classes without measurements get the mean achieved/peak ratio of the measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from leadtime.features.errors import FeatureError


@dataclass(frozen=True)
class Accelerator:
    """One accelerator class: published peaks, memory, and the achieved figures where kernel timings were measured."""

    slug: str
    name: str
    peak_tflops: float
    hbm_tb_s: float
    memory_gb: float
    measured_gemm_tflops: float | None = None
    measured_kv_tb_s: float | None = None
    interconnect_gb_s: float = 450.0

    @property
    def effective_tflops(self) -> float:
        """Achieved dense BF16 TFLOP/s: measured, else the peak at the measured classes' mean efficiency."""
        if self.measured_gemm_tflops is not None:
            return self.measured_gemm_tflops
        return self.peak_tflops * _MEAN_COMPUTE_EFFICIENCY

    @property
    def effective_tb_s(self) -> float:
        """Achieved KV-read bandwidth in TB/s: measured, else the peak at the measured classes' mean efficiency."""
        if self.measured_kv_tb_s is not None:
            return self.measured_kv_tb_s
        return self.hbm_tb_s * _MEAN_BANDWIDTH_EFFICIENCY


_MEASURED: list[tuple[float, float, float, float]] = [
    # (peak TFLOP/s, measured GEMM TFLOP/s, peak TB/s, measured KV read TB/s)
    (989, 881, 3.35, 3.0),
    (989, 815, 4.8, 4.2),
    (312, 255, 2.04, 1.6),
    (362, 252, 0.864, 0.72),
]
_MEAN_COMPUTE_EFFICIENCY = sum(m / p for p, m, _, _ in _MEASURED) / len(_MEASURED)
_MEAN_BANDWIDTH_EFFICIENCY = sum(m / p for _, _, p, m in _MEASURED) / len(_MEASURED)

ACCELERATORS: dict[str, Accelerator] = {
    a.slug: a
    for a in (
        Accelerator("h100-sxm", "NVIDIA H100 SXM", 989, 3.35, 80, 881, 3.0, 450),
        Accelerator("h200-sxm", "NVIDIA H200 SXM", 989, 4.8, 141, 815, 4.2, 450),
        Accelerator("a100-sxm-80gb", "NVIDIA A100 SXM 80GB", 312, 2.04, 80, 255, 1.6, 300),
        Accelerator("l40s", "NVIDIA L40S", 362, 0.864, 48, 252, 0.72, 32),
        Accelerator("mi300x", "AMD Instinct MI300X", 1307, 5.3, 192, interconnect_gb_s=448),
        Accelerator("tpu-v5e", "Google TPU v5e", 197, 0.819, 16, interconnect_gb_s=200),
        Accelerator("tpu-v6e", "Google TPU v6e", 918, 1.638, 32, interconnect_gb_s=400),
        Accelerator("gaudi3", "Intel Gaudi 3", 1835, 3.7, 128, interconnect_gb_s=300),
    )
}


@dataclass(frozen=True)
class ModelProfile:
    """One model's shape: what its weights and KV cache weigh and how much work a token is."""

    slug: str
    params_b: float
    layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int = 2

    @property
    def weight_bytes(self) -> float:
        """Bytes of the weights."""
        return self.params_b * 1e9 * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, BF16."""
        return 2 * self.layers * self.num_kv_heads * self.head_dim * self.bytes_per_param


MODELS: dict[str, ModelProfile] = {
    m.slug: m
    for m in (
        ModelProfile("llama-3.1-8b", 8.03, 32, 4096, 32, 8, 128),
        ModelProfile("qwen3-32b", 32.8, 64, 5120, 64, 8, 128),
        ModelProfile("llama-3.1-70b", 70.6, 80, 8192, 64, 8, 128),
        ModelProfile("llama-2-70b", 69.0, 80, 8192, 64, 8, 128),
        ModelProfile("bloom-176b", 176.2, 70, 14336, 112, 112, 128),
    )
}


def get_accelerator(slug: str) -> Accelerator:
    """The catalog's class named `slug`; FeatureError naming the known ones if there is none."""
    try:
        return ACCELERATORS[slug]
    except KeyError:
        known = ", ".join(sorted(ACCELERATORS))
        raise FeatureError("accelerator", f"unknown accelerator class {slug!r} (known: {known})") from None


def get_model(slug: str) -> ModelProfile:
    """The catalog's model named `slug`; FeatureError naming the known ones if there is none."""
    try:
        return MODELS[slug]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise FeatureError("model", f"unknown model {slug!r} (known: {known})") from None
