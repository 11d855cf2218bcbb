"""How long one engine step takes on a replica: the physics of a transformer step, looked up in kernel tables.

A step runs every layer once over all tokens scheduled in it (prefill chunks and one token per decoding
sequence), then the LM head over the sequences that sample a token. Per layer, on each of the
`tensor_parallel` devices:

- four GEMMs of the exact per-device shapes (QKV and gate-up split by columns, output and down projections
  split by rows), each looked up in the measured GEMM table by interpolation in m, n and k;
- one prefill attention and one decode attention kernel (curves fitted to the attention tables);
- the memory-bound elementwise kernels (two fused residual-add + RMSNorm, rotary embedding, KV-cache write,
  SiLU·mul) streaming their bytes at the bandwidth the decode-attention table achieves;
- two all-reduces of tokens × hidden × 2 bytes when TP > 1, looked up by message size in the measured
  collective tables (vLLM's custom all-reduce up to 8 MiB, NCCL above).

On top sits the host that launches the kernels. With CUDA graphs a step pays one graph launch and the few
kernels outside the graph (the head) before the replay. Without them (eager mode) the host enqueues every
kernel of every layer asynchronously while the GPU works through the queue, so a step takes as long as the
slower of the two pipelines, not their sum: a layer costs max(host, GPU) and the pipeline fill costs the
smaller of the two once.

Classes without tables get the same model with rates scaled from their published peaks by the mean
achieved/published ratio of the measured classes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from leadtime.features.catalog import ACCELERATORS, Accelerator, ModelProfile, get_accelerator
from leadtime.simulator.calibration import gemm_ms, load_coefficients

# Kernels launched per layer in an eager (no CUDA graph) step: 2 norms, QKV GEMM, rotary, KV-cache write,
# attention, output GEMM, all-reduce, gate-up GEMM, activation, down GEMM, all-reduce.
KERNELS_PER_LAYER = 12
# Of which memory-bound elementwise kernels: 2 fused add+RMSNorm, rotary, KV-cache write, SiLU·mul.
ELEMENTWISE_KERNELS = 5
# Kernels after the last layer: final norm, LM head GEMM, sampling.
HEAD_KERNELS = 3
# vLLM's custom all-reduce handles messages up to this size; NCCL above.
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 1024 * 1024
# m grid on which table-less classes evaluate their GEMM curve (the measured tables' grid).
DEFAULT_M_GRID = (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192)

# Published architecture figures (config.json of each model): intermediate (FFN) size, vocabulary, gated MLP.
ARCHITECTURES: dict[str, tuple[int, int, bool]] = {
    "llama-3.1-8b": (14336, 128256, True),
    "qwen3-32b": (25600, 151936, True),
    "llama-3.1-70b": (28672, 128256, True),
    "llama-2-70b": (28672, 32000, True),
    "bloom-176b": (57344, 250880, False),
}


@dataclass(frozen=True)
class GemmTable:
    """Measured GEMM latencies on their (m, n, k) grid, as logs for interpolation."""

    m: tuple[float, ...]
    n: np.ndarray
    k: np.ndarray
    log_ms: np.ndarray  # [m, n, k]


@dataclass(frozen=True)
class CollectiveTable:
    """Measured all-reduce latency by message size."""

    bytes: tuple[float, ...]
    ms: tuple[float, ...]


@dataclass(frozen=True)
class Coefficients:
    """The step-time model's coefficients for one accelerator class (fitted or derived)."""

    gemm: tuple[float, float, float, float]
    context_attention: tuple[float, float, float]
    generation_attention: tuple[float, float, float]
    allreduce: dict[int, tuple[float, float]]
    launch_ms: float
    fitted: bool
    gemm_table: GemmTable | None = None
    nccl: dict[int, CollectiveTable] | None = None
    custom_allreduce: dict[int, CollectiveTable] | None = None
    allreduce_launch_ms: dict[int, float] | None = None


def _collectives(raw: object) -> dict[int, CollectiveTable]:
    assert isinstance(raw, dict)
    return {int(g): CollectiveTable(tuple(v["bytes"]), tuple(v["ms"])) for g, v in raw.items()}


def _from_json(raw: dict[str, object]) -> Coefficients:
    g = raw["gemm"]
    c = raw["context_attention"]
    d = raw["generation_attention"]
    ar = raw["allreduce"]
    assert isinstance(g, dict) and isinstance(c, dict) and isinstance(d, dict) and isinstance(ar, dict)
    launch = raw["launch_ms"]
    assert isinstance(launch, float | int)
    table = raw.get("gemm_table")
    gemm_table = None
    if isinstance(table, dict):
        gemm_table = GemmTable(
            m=tuple(float(v) for v in table["m"]),
            n=np.log(np.array(table["n"], dtype=float)),
            k=np.log(np.array(table["k"], dtype=float)),
            log_ms=np.log(np.array(table["ms"], dtype=float)),
        )
    tables = raw.get("allreduce_table")
    launches = raw.get("allreduce_launch_ms")
    return Coefficients(
        gemm=(g["c0_ms"], g["tflops"], g["tb_s"], g["m_half"]),
        context_attention=(c["c0_ms"], c["tflops"], c["len_half"]),
        generation_attention=(d["c0_ms"], d["tb_s"], d["per_seq_us"]),
        allreduce={int(k): (v["latency_ms"], v["gb_s"]) for k, v in ar.items()},
        launch_ms=float(launch),
        fitted=True,
        gemm_table=gemm_table,
        nccl=_collectives(tables["nccl"]) if isinstance(tables, dict) else None,
        custom_allreduce=_collectives(tables["custom_graph"]) if isinstance(tables, dict) else None,
        allreduce_launch_ms={int(k): float(v) for k, v in launches.items()} if isinstance(launches, dict) else None,
    )


@lru_cache(maxsize=1)
def _fitted() -> dict[str, Coefficients]:
    return {slug: _from_json(raw) for slug, raw in load_coefficients().items()}


def coefficients_for(accelerator: Accelerator) -> Coefficients:
    """Measured tables and fitted curves for a measured class; published figures through the curves otherwise."""
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


def _estimated_ffn(model: ModelProfile) -> int:
    attn = model.hidden_size * (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    attn += model.num_heads * model.head_dim * model.hidden_size
    per_layer = model.params_b * 1e9 / model.layers
    ffn = (per_layer - attn) / (3 * model.hidden_size)
    return max(256, int(round(ffn / 256.0)) * 256)


def ffn_size(model: ModelProfile) -> int:
    """Intermediate size: the published one for known models; else implied by the parameter count, rounded."""
    known = ARCHITECTURES.get(model.slug)
    return known[0] if known is not None else _estimated_ffn(model)


def vocab_size(model: ModelProfile) -> int:
    """Vocabulary: the published one for known models; else what the parameters left over by the layers imply."""
    known = ARCHITECTURES.get(model.slug)
    if known is not None:
        return known[1]
    ffn = _estimated_ffn(model)
    attn = model.hidden_size * (2 * model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    rest = model.params_b * 1e9 - model.layers * (attn + 3 * model.hidden_size * ffn)
    return max(32000, int(rest / (2 * model.hidden_size)))


def _table_gemm_curve(table: GemmTable, n: float, k: float) -> list[float]:
    """Latency (ms) at each table m of an (m × k) · (k × n) GEMM: bilinear in log n, log k on log latency.

    Beyond the table's n or k range the nearest edge is scaled in proportion (work grows linearly there).
    """
    out = []
    scale = 1.0
    ln, lk = math.log(n), math.log(k)
    if ln > table.n[-1]:
        scale *= math.exp(ln - table.n[-1])
        ln = float(table.n[-1])
    if ln < table.n[0]:
        ln = float(table.n[0])
    if lk > table.k[-1]:
        scale *= math.exp(lk - table.k[-1])
        lk = float(table.k[-1])
    if lk < table.k[0]:
        lk = float(table.k[0])
    i = min(max(int(np.searchsorted(table.n, ln)) - 1, 0), len(table.n) - 2)
    j = min(max(int(np.searchsorted(table.k, lk)) - 1, 0), len(table.k) - 2)
    tn = (ln - table.n[i]) / (table.n[i + 1] - table.n[i])
    tk = (lk - table.k[j]) / (table.k[j + 1] - table.k[j])
    for plane in table.log_ms:
        value = (
            (1 - tn) * (1 - tk) * plane[i, j]
            + tn * (1 - tk) * plane[i + 1, j]
            + (1 - tn) * tk * plane[i, j + 1]
            + tn * tk * plane[i + 1, j + 1]
        )
        out.append(scale * math.exp(value))
    return out


class _PiecewiseLinear:
    """y(x) linear between knots; flat below the first; proportional to x beyond the last (work ∝ size)."""

    def __init__(self, xs: tuple[float, ...] | list[float], ys: list[float]) -> None:
        self.xs = list(xs)
        self.ys = list(ys)

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1] * x / xs[-1]
        i = bisect.bisect_right(xs, x)
        x0, x1 = xs[i - 1], xs[i]
        return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


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
    custom_allreduce
        Whether all-reduces up to 8 MiB use vLLM's custom kernel (its default on NVLink since early 2024) or NCCL.
    """

    def __init__(
        self,
        accelerator: Accelerator | str,
        model: ModelProfile,
        tensor_parallel: int = 1,
        cuda_graphs: bool = True,
        custom_allreduce: bool = True,
    ) -> None:
        self.accelerator = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
        self.model = model
        self.tensor_parallel = tensor_parallel
        self.cuda_graphs = cuda_graphs
        self.custom_allreduce = custom_allreduce
        self.coefficients = coefficients_for(self.accelerator)
        coef = self.coefficients
        tp = tensor_parallel
        h = model.hidden_size
        self._heads = max(1.0, model.num_heads / tp)
        self._kv_heads = max(1.0, model.num_kv_heads / tp)
        ffn = ffn_size(model)
        gated = ARCHITECTURES.get(model.slug, (0, 0, True))[2]
        up = (2 if gated else 1) * ffn
        self._gemm_shapes = np.array(
            [
                [h, (model.num_heads + 2 * model.num_kv_heads) * model.head_dim / tp],  # k, n: QKV
                [model.num_heads * model.head_dim / tp, h],  # output projection
                [h, up / tp],  # gate-up
                [ffn / tp, h],  # down
            ]
        )
        self._gemm_pairs = [(float(k), float(n)) for k, n in self._gemm_shapes]
        # GEMM latency of a layer as a function of m (tokens), summed over the four shapes on one m grid.
        layer_curve = None
        for k, n in self._gemm_pairs:
            curve = self._gemm_curve(n, k)
            layer_curve = curve if layer_curve is None else [a + b for a, b in zip(layer_curve, curve, strict=True)]
        assert layer_curve is not None
        self._layer_gemms = _PiecewiseLinear(self._m_grid, layer_curve)
        self._vocab = vocab_size(model)
        self._lm_head = _PiecewiseLinear(self._m_grid, self._gemm_curve(self._vocab / tp, float(h)))
        # Elementwise bytes per token per layer (BF16): 2 × fused add+RMSNorm (read x and residual, write both),
        # rotary (read and write q and k), KV-cache write (read k and v, write the cache), SiLU·mul (read gate
        # and up, write the product).
        qk = (self._heads + self._kv_heads) * model.head_dim
        kv = 2.0 * self._kv_heads * model.head_dim
        act = (3.0 if gated else 2.0) * ffn / tp
        self._elementwise_bytes = 2.0 * (2 * 4.0 * h + 2.0 * qk + 2.0 * kv + act)
        self._bandwidth = coef.generation_attention[1] * 1e9  # bytes per ms
        self._kernel_floor = coef.gemm[0]
        self._allreduce = self._allreduce_curves()
        # Host cost per layer of launching its kernels eagerly; all-reduces use their own measured cost.
        launch = coef.launch_ms
        if tp > 1:
            ar_launch = launch
            if coef.allreduce_launch_ms:
                table = coef.allreduce_launch_ms
                ar_launch = table[min(table, key=lambda g: abs(g - tp))]
            self._host_layer = (KERNELS_PER_LAYER - 2) * launch + 2 * ar_launch
        else:
            self._host_layer = (KERNELS_PER_LAYER - 2) * launch
        self._host_head = HEAD_KERNELS * launch
        # With graphs: one graph launch before the replay plus the head kernels run outside it.
        self.host_ms = (1 + HEAD_KERNELS) * launch if cuda_graphs else model.layers * self._host_layer
        self._dense_cache: dict[int, float] = {}
        self._decode_cache: dict[int, tuple[float, float]] = {}

    # -- pieces ------------------------------------------------------------------------------------------
    @property
    def _m_grid(self) -> tuple[float, ...]:
        table = self.coefficients.gemm_table
        return table.m if table is not None else tuple(float(m) for m in DEFAULT_M_GRID)

    def _gemm_curve(self, n: float, k: float) -> list[float]:
        table = self.coefficients.gemm_table
        if table is not None:
            return _table_gemm_curve(table, n, k)
        x = np.array([[m, n, k] for m in self._m_grid])
        return [float(v) for v in gemm_ms(list(self.coefficients.gemm), x)]

    def _allreduce_curves(self) -> tuple[_PiecewiseLinear | None, _PiecewiseLinear | None]:
        """(custom all-reduce, NCCL) latency by bytes for this TP, or the fitted line when no table exists."""
        tp = self.tensor_parallel
        coef = self.coefficients
        if tp <= 1:
            return None, None
        custom = nccl = None
        if coef.nccl:
            t = coef.nccl[min(coef.nccl, key=lambda g: abs(g - tp))]
            nccl = _PiecewiseLinear(t.bytes, list(t.ms))
        if self.custom_allreduce and coef.custom_allreduce and self.accelerator.interconnect_gb_s >= 100:
            t = coef.custom_allreduce[min(coef.custom_allreduce, key=lambda g: abs(g - tp))]
            custom = _PiecewiseLinear(t.bytes, list(t.ms))
        return custom, nccl

    def _gemms_ms(self, tokens: float) -> float:
        """The four GEMMs of a layer at m = `tokens` (looked up per shape in the GEMM table)."""
        return self._layer_gemms(tokens)

    def _elementwise_ms(self, tokens: float) -> float:
        return ELEMENTWISE_KERNELS * self._kernel_floor + tokens * self._elementwise_bytes / self._bandwidth

    def _allreduce_ms(self, tokens: float) -> float:
        """Two all-reduces of `tokens` × hidden BF16 values per layer."""
        tp = self.tensor_parallel
        if tp <= 1:
            return 0.0
        size = tokens * self.model.hidden_size * 2.0
        custom, nccl = self._allreduce
        if custom is not None and size <= CUSTOM_ALLREDUCE_MAX_BYTES:
            return 2.0 * custom(size)
        if nccl is not None:
            return 2.0 * nccl(size)
        table = self.coefficients.allreduce
        gpus = tp if tp in table else min(table, key=lambda g: abs(g - tp))
        latency_ms, gb_s = table[gpus]
        return 2.0 * (latency_ms + size / (gb_s * 1e6))

    def _dense_layer_ms(self, tokens: int) -> float:
        """Per-layer work that depends only on the token count: GEMMs, elementwise kernels, all-reduces."""
        cached = self._dense_cache.get(tokens)
        if cached is None:
            cached = self._gemms_ms(tokens) + self._elementwise_ms(tokens) + self._allreduce_ms(tokens)
            if len(self._dense_cache) < 65536:
                self._dense_cache[tokens] = cached
        return cached

    def _head_ms(self, sequences: int) -> float:
        """Final norm, LM head over the sequences that sample, and sampling (reads the logits once)."""
        if sequences <= 0:
            return 0.0
        logits_bytes = sequences * self._vocab / self.tensor_parallel * 4.0
        return self._lm_head(sequences) + 2 * self._kernel_floor + logits_bytes / self._bandwidth

    def _combine(self, gpu_layer: float, gpu_head: float) -> float:
        """Step time from the GPU time of one layer and of the head, given how the host launches them."""
        layers = self.model.layers
        if self.cuda_graphs:
            return self.host_ms + layers * gpu_layer + gpu_head
        host = self._host_layer
        # Eager: host and GPU pipelines overlap; the slower one sets the pace, the faster one fills once.
        body = layers * max(host, gpu_layer) + min(host, gpu_layer)
        return body + max(self._host_head, gpu_head)

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

    # -- public API --------------------------------------------------------------------------------------
    def step_ms(self, chunks: list[tuple[int, int]], decode_sequences: int, decode_kv_tokens: float) -> float:
        """One step: prefill `chunks` (new, cached) plus one token for each of `decode_sequences` sequences."""
        tokens = sum(n for n, _ in chunks) + decode_sequences
        if tokens <= 0:
            return 0.0
        per_layer = (
            self._dense_layer_ms(tokens)
            + self.prefill_attention_ms(chunks)
            + self.decode_attention_ms(decode_sequences, decode_kv_tokens)
        )
        return self._combine(per_layer, self._head_ms(len(chunks) + decode_sequences))

    def decode_affine(self, sequences: int) -> tuple[float, float]:
        """A decode-only step with `sequences` sequences costs `a + b · kv_tokens` ms: returns (a, b).

        Lets the simulator advance many decode steps at once in closed form. Exact with CUDA graphs; in eager
        mode an upper bound that is exact whenever the GPU, not the host, sets the pace.
        """
        cached = self._decode_cache.get(sequences)
        if cached is None:
            c0, tb_s, per_seq_us = self.coefficients.generation_attention
            per_token = 2.0 * self._kv_heads * self.model.head_dim * 2.0 / (tb_s * 1e9)
            layer0 = self._dense_layer_ms(sequences) + c0 + sequences * per_seq_us * 1e-3
            a = self._combine(layer0, self._head_ms(sequences))
            slope = self.model.layers * per_token
            if not self.cuda_graphs and layer0 < self._host_layer:
                slope += per_token  # the pipeline fill term follows the GPU once it is the faster side
            cached = (a, slope)
            self._decode_cache[sequences] = cached
        return cached

    def prefill_ms(self, prompt_tokens: int, batch: int = 1) -> float:
        """Prefill of `batch` prompts of `prompt_tokens` tokens in one step (no cache hits)."""
        return self.step_ms([(prompt_tokens, 0)] * batch, 0, 0.0)
