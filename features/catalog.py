"""Accelerator classes and model profiles: the hardware facts that let one model serve a mixed fleet.

Figures are the published dense BF16 peaks and memory bandwidths; where kernel timings were measured (vLLM 0.14
kernel tables, summarised here; the tables ship in `leadtime.data`) the measured GEMM throughput and KV-read
bandwidth are kept beside them, because a roofline built on achieved rather than peak figures is what predicts
real step times. Classes without measurements get the mean achieved/peak ratio of the measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

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

    def kv_bytes_per_token(self, tensor_parallel: int) -> int:
        """K and V of one token, every layer, over a whole group of `tensor_parallel` devices. vLLM splits the KV
        heads among the devices but gives each at least one, so a group wider than the model's KV heads holds
        copies: Llama-3.1-70B's 8 heads take 16 heads' room at TP 16."""
        heads = max(self.num_kv_heads, tensor_parallel)
        return 2 * self.layers * heads * self.head_dim * self.bytes_per_param


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


@dataclass(frozen=True)
class Catalog:
    """The accelerator classes and model profiles one deployment knows: the built-in ones above and its own
    additions (`--catalog FILE`, read by `catalog_file.load_catalog`).

    Only the additions are held, so that a model's artifact, which carries its learner's catalog, records what
    its deployment added and not what every build knows. An addition never redefines a built-in slug: one slug is
    one set of figures everywhere a model goes.

    >>> b200 = Accelerator("b200", "NVIDIA B200", 2250, 8.0, 180, interconnect_gb_s=900)
    >>> catalog = Catalog(accelerators=(b200,))
    >>> catalog.accelerator("b200").hbm_tb_s, catalog.accelerator("h100-sxm").hbm_tb_s
    (8.0, 3.35)
    >>> Catalog().accelerator("b200")
    Traceback (most recent call last):
    ...
    leadtime.features.errors.FeatureError: accelerator: unknown accelerator class 'b200' (known: a100-sxm-80gb, \
gaudi3, h100-sxm, h200-sxm, l40s, mi300x, tpu-v5e, tpu-v6e)
    """

    accelerators: tuple[Accelerator, ...] = ()
    models: tuple[ModelProfile, ...] = ()

    @cached_property
    def all_accelerators(self) -> dict[str, Accelerator]:
        """Every class this catalog knows, by slug: the built-in ones, then the additions."""
        return {**ACCELERATORS, **{a.slug: a for a in self.accelerators}}

    @cached_property
    def all_models(self) -> dict[str, ModelProfile]:
        """Every model this catalog knows, by slug: the built-in ones, then the additions."""
        return {**MODELS, **{m.slug: m for m in self.models}}

    def accelerator(self, slug: str) -> Accelerator:
        """The class named `slug`; FeatureError naming the known ones if there is none."""
        try:
            return self.all_accelerators[slug]
        except KeyError:
            known = ", ".join(sorted(self.all_accelerators))
            raise FeatureError("accelerator", f"unknown accelerator class {slug!r} (known: {known})") from None

    def model(self, slug: str) -> ModelProfile:
        """The model named `slug`; FeatureError naming the known ones if there is none."""
        try:
            return self.all_models[slug]
        except KeyError:
            known = ", ".join(sorted(self.all_models))
            raise FeatureError("model", f"unknown model {slug!r} (known: {known})") from None

    def describe(self) -> str:
        """What this catalog adds, for a log line.

        >>> Catalog((Accelerator("l4", "NVIDIA L4", 121, 0.3, 24),)).describe()
        'accelerator classes l4; models none'
        """
        classes = ", ".join(a.slug for a in self.accelerators) or "none"
        return f"accelerator classes {classes}; models {', '.join(m.slug for m in self.models) or 'none'}"

    def differences(self, other: Catalog) -> list[str]:
        """What `other` adds that this catalog lacks or states otherwise, one phrase each (empty: nothing).

        A model carries its learner's catalog: served by a process that lacks a class of it, the rows of that class
        are refused; one that states it otherwise would predict them from figures the model never learned from.

        >>> l4 = Accelerator("l4", "NVIDIA L4", 121, 0.3, 24, interconnect_gb_s=32)
        >>> Catalog().differences(Catalog((l4,)))
        ["accelerator class 'l4' is unknown here"]
        >>> from dataclasses import replace
        >>> Catalog((l4,)).differences(Catalog((replace(l4, hbm_tb_s=0.6),)))
        ["accelerator class 'l4' has other figures here"]
        """
        found = []
        for kind, ours, theirs in (
            ("accelerator class", self.all_accelerators, other.accelerators),
            ("model", self.all_models, other.models),
        ):
            for entry in theirs:
                mine = ours.get(entry.slug)
                if mine != entry:
                    how = "is unknown here" if mine is None else "has other figures here"
                    found.append(f"{kind} {entry.slug!r} {how}")
        return found


BUILT_IN = Catalog()
"""The catalog of a deployment that adds nothing."""


def get_accelerator(slug: str) -> Accelerator:
    """The built-in class named `slug`; FeatureError naming the known ones if there is none."""
    return BUILT_IN.accelerator(slug)


def get_model(slug: str) -> ModelProfile:
    """The built-in model named `slug`; FeatureError naming the known ones if there is none."""
    return BUILT_IN.model(slug)
