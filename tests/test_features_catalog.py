"""Accelerator catalog and model profiles against their published sources, and the roofline estimates."""

from __future__ import annotations

import csv
import re
from collections import defaultdict

import pytest

from leadtime.data import HERE as SHIPPED_DATA
from leadtime.features.catalog import ACCELERATORS, MODELS, Accelerator, get_accelerator, get_model
from leadtime.features.errors import FeatureError
from leadtime.features.roofline import (
    decode_step_ms,
    kv_capacity_tokens,
    kv_transfer_ms,
    prefill_flops,
    prefill_ms,
)

DATA = SHIPPED_DATA  # the shipped copy of the published table and the splitwise measurements

README_CLASS_TO_SLUG = {
    "H100 SXM": "h100-sxm",
    "H200 SXM": "h200-sxm",
    "A100 SXM 80GB": "a100-sxm-80gb",
    "L40S": "l40s",
    "MI300X": "mi300x",
    "TPU v5e": "tpu-v5e",
    "TPU v6e": "tpu-v6e",
    "Gaudi 3": "gaudi3",
}

# From each model's published config.json (num_hidden_layers, hidden_size, num_attention_heads,
# num_key_value_heads, head_dim) and its model card's parameter count in billions.
PUBLISHED_MODELS = {
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 8.03),
    "qwen3-32b": (64, 5120, 64, 8, 128, 32.8),
    "llama-3.1-70b": (80, 8192, 64, 8, 128, 70.6),
    "llama-2-70b": (80, 8192, 64, 8, 128, 69.0),
    "bloom-176b": (70, 14336, 112, 112, 128, 176.2),
}


def published_accelerators() -> dict[str, tuple[float, float, float, str]]:
    """The data README's table: slug → (TFLOP/s, TB/s, GB, note)."""
    table: dict[str, tuple[float, float, float, str]] = {}
    text = (DATA / "README.md").read_text()
    section = text.split("## Published accelerator figures", 1)[1]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in README_CLASS_TO_SLUG:
            table[README_CLASS_TO_SLUG[cells[0]]] = (
                float(cells[1]),
                float(cells[2]),
                float(cells[3]),
                cells[4],
            )
    return table


# ------------------------------------------------------------------------------ accelerators


def test_catalog_has_exactly_the_issues_classes() -> None:
    assert set(ACCELERATORS) == set(README_CLASS_TO_SLUG.values())
    assert all(slug == a.slug for slug, a in ACCELERATORS.items())


@pytest.mark.parametrize("slug", sorted(README_CLASS_TO_SLUG.values()))
def test_accelerator_figures_match_the_published_table(slug: str) -> None:
    tflops, tb_s, gb, note = published_accelerators()[slug]
    a = get_accelerator(slug)
    assert (a.peak_tflops, a.hbm_tb_s, a.memory_gb) == (tflops, tb_s, gb)
    gemm = re.search(r"GEMM ~(\d+(?:\.\d+)?) TF/s", note)
    kv = re.search(r"KV read ~(\d+(?:\.\d+)?) TB/s", note)
    assert a.measured_gemm_tflops == (float(gemm.group(1)) if gemm else None)
    assert a.measured_kv_tb_s == (float(kv.group(1)) if kv else None)


def test_measured_classes_use_their_measurements() -> None:
    h100 = get_accelerator("h100-sxm")
    assert (h100.effective_tflops, h100.effective_tb_s) == (881, 3.0)


def test_unmeasured_classes_get_the_mean_achieved_share_of_peak() -> None:
    measured = [a for a in ACCELERATORS.values() if a.measured_gemm_tflops is not None]
    assert len(measured) == 4
    compute = sum(a.effective_tflops / a.peak_tflops for a in measured) / len(measured)
    bandwidth = sum(a.effective_tb_s / a.hbm_tb_s for a in measured) / len(measured)
    for slug in ("mi300x", "tpu-v5e", "tpu-v6e", "gaudi3"):
        a = get_accelerator(slug)
        assert a.effective_tflops == pytest.approx(a.peak_tflops * compute)
        assert a.effective_tb_s == pytest.approx(a.hbm_tb_s * bandwidth)
        assert 0.5 * a.peak_tflops < a.effective_tflops < a.peak_tflops


def test_effective_figures_never_exceed_peak() -> None:
    for a in ACCELERATORS.values():
        assert 0 < a.effective_tflops <= a.peak_tflops
        assert 0 < a.effective_tb_s <= a.hbm_tb_s
        assert a.interconnect_gb_s > 0


def test_l40s_has_no_nvlink() -> None:
    """Without NVLink the L40S talks over PCIe 4.0 x16 (~32 GB/s), an order of magnitude below NVLink."""
    assert get_accelerator("l40s").interconnect_gb_s <= 64
    assert get_accelerator("h100-sxm").interconnect_gb_s >= 10 * get_accelerator("l40s").interconnect_gb_s


def test_unknown_accelerator_names_the_field_and_the_choices() -> None:
    with pytest.raises(FeatureError) as err:
        get_accelerator("b200")
    assert err.value.field == "accelerator"
    assert "'b200'" in str(err.value) and "h100-sxm" in str(err.value)


# ------------------------------------------------------------------------------ models


def test_catalog_has_the_issues_models() -> None:
    assert {"llama-3.1-8b", "qwen3-32b", "llama-3.1-70b", "llama-2-70b"} <= set(MODELS)


@pytest.mark.parametrize("slug", sorted(PUBLISHED_MODELS))
def test_model_profiles_match_published_configs(slug: str) -> None:
    layers, hidden, heads, kv_heads, head_dim, params_b = PUBLISHED_MODELS[slug]
    m = get_model(slug)
    assert (m.layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim,
    )
    assert m.params_b == pytest.approx(params_b, rel=0.01)
    assert m.bytes_per_param == 2


@pytest.mark.parametrize(
    ("slug", "kib"), [("llama-3.1-8b", 128), ("qwen3-32b", 256), ("llama-3.1-70b", 320), ("llama-2-70b", 320)]
)
def test_kv_bytes_per_token(slug: str, kib: int) -> None:
    """2 (K and V) × layers × KV heads × head dim × 2 bytes: the figures vLLM logs at start-up."""
    assert get_model(slug).kv_bytes_per_token(1) == kib * 1024


def test_weight_bytes_are_bf16() -> None:
    assert get_model("llama-3.1-70b").weight_bytes == pytest.approx(141.2e9)


def test_unknown_model_names_the_field() -> None:
    with pytest.raises(FeatureError) as err:
        get_model("gpt-5")
    assert err.value.field == "model"
    assert "qwen3-32b" in str(err.value)


# ------------------------------------------------------------------------------ roofline

H100, A100, H200 = get_accelerator("h100-sxm"), get_accelerator("a100-sxm-80gb"), get_accelerator("h200-sxm")
LLAMA8, LLAMA70 = get_model("llama-3.1-8b"), get_model("llama-3.1-70b")


def test_prefill_of_nothing_takes_no_time() -> None:
    assert prefill_ms(LLAMA8, H100, 0) == 0.0
    assert prefill_ms(LLAMA8, H100, -5) == 0.0


def test_short_prefill_is_bound_by_reading_the_weights() -> None:
    weights_ms = 1e3 * LLAMA8.weight_bytes / (H100.effective_tb_s * 1e12)
    assert prefill_ms(LLAMA8, H100, 1) == pytest.approx(weights_ms)


def test_long_prefill_is_compute_bound_and_counts_attention() -> None:
    dense = 2 * LLAMA8.params_b * 1e9 * 8192
    assert prefill_flops(LLAMA8, 8192) > dense
    assert prefill_flops(LLAMA8, 8192, cached_tokens=8192) > prefill_flops(LLAMA8, 8192)
    assert prefill_ms(LLAMA8, H100, 8192) == pytest.approx(
        1e3 * prefill_flops(LLAMA8, 8192) / (H100.effective_tflops * 1e12)
    )


def test_prefill_grows_with_tokens_and_shrinks_with_hardware() -> None:
    times = [prefill_ms(LLAMA70, H100, n, tensor_parallel=4) for n in (512, 1024, 4096, 16384)]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert prefill_ms(LLAMA70, A100, 4096, tensor_parallel=4) > prefill_ms(LLAMA70, H100, 4096, tensor_parallel=4)
    assert prefill_ms(LLAMA70, H100, 4096, tensor_parallel=8) == pytest.approx(
        prefill_ms(LLAMA70, H100, 4096, tensor_parallel=4) / 2
    )


def test_decode_step_reads_weights_and_kv() -> None:
    empty = decode_step_ms(LLAMA8, H100, 1, 0)
    assert empty == pytest.approx(1e3 * LLAMA8.weight_bytes / (H100.effective_tb_s * 1e12))
    loaded = decode_step_ms(LLAMA8, H100, 32, 32 * 4096)
    kv_ms = 1e3 * 32 * 4096 * LLAMA8.kv_bytes_per_token(1) / (H100.effective_tb_s * 1e12)
    assert loaded == pytest.approx(empty + kv_ms)
    assert decode_step_ms(LLAMA8, H200, 32, 32 * 4096) < loaded
    assert decode_step_ms(LLAMA8, H100, 0, 0) == empty  # an empty batch still steps once


def test_huge_batch_decode_becomes_compute_bound() -> None:
    batch = 4096
    compute_ms = 1e3 * 2 * LLAMA8.params_b * 1e9 * batch / (H100.effective_tflops * 1e12)
    assert decode_step_ms(LLAMA8, H100, batch, 0) == pytest.approx(compute_ms)


def test_kv_transfer_time() -> None:
    # 10,000 tokens × 320 KiB over 50 GB/s
    assert kv_transfer_ms(LLAMA70, 10_000, 50, 8) == pytest.approx(1e3 * 10_000 * 327_680 / 50e9)
    assert kv_transfer_ms(LLAMA70, 0, 50, 8) == 0
    with pytest.raises(ValueError, match="bandwidth"):
        kv_transfer_ms(LLAMA70, 100, 0, 8)


def test_kv_heads_are_replicated_when_tensor_parallel_exceeds_them() -> None:
    """Regression: Llama-3.1-70B (8 KV heads) at TP 16 was given twice the KV capacity vLLM has (3.13M tokens on
    16 H100s instead of 1.56M), and decode steps that read half the KV they do: vLLM gives each GPU at least one
    KV head, so 16 GPUs hold 16 copies' worth, not 8."""
    per_head = 2 * LLAMA70.layers * LLAMA70.head_dim * LLAMA70.bytes_per_param  # one KV head, every layer
    assert [LLAMA70.kv_bytes_per_token(tp) for tp in (1, 2, 8, 16, 32)] == [per_head * n for n in (8, 8, 8, 16, 32)]
    kv_per_gpu = per_head  # one head on each of the 16 GPUs
    free_per_gpu = H100.memory_gb * 1e9 - LLAMA70.weight_bytes / 16
    assert kv_capacity_tokens(LLAMA70, H100, 16) == pytest.approx(free_per_gpu * 0.9 / kv_per_gpu)
    step_ms = 1e3 * (LLAMA70.weight_bytes / 16 + 1e6 * kv_per_gpu) / (H100.effective_tb_s * 1e12)
    assert decode_step_ms(LLAMA70, H100, 64, 1e6, 16) == pytest.approx(step_ms)
    # Each GPU of the group sends its own heads, the replicated ones included.
    assert kv_transfer_ms(LLAMA70, 10_000, 50, 16) == pytest.approx(2 * kv_transfer_ms(LLAMA70, 10_000, 50, 8))
    bloom = get_model("bloom-176b")  # 112 KV heads: no TP degree a node offers replicates them
    assert bloom.kv_bytes_per_token(8) == bloom.kv_bytes_per_token(1)


def test_roofline_is_a_lower_bound_within_an_order_of_magnitude_of_measured_decode() -> None:
    """splitwise-sim measured per-iteration decode time for Llama-2-70B on A100/H100 at TP 2/4/8; the roofline
    (no communication, no kernel overheads) must stay below it, and within 10× of it."""
    hardware: dict[str, Accelerator] = {"a100-80gb": A100, "h100-80gb": H100}
    llama2 = get_model("llama-2-70b")
    measured: dict[tuple[str, int, int, int], list[float]] = defaultdict(list)
    with (DATA / "calibration" / "splitwise_sim_perf_model.csv").open() as f:
        for r in csv.DictReader(f):
            if r["model"] == "llama2-70b" and r["hardware"] in hardware:
                key = (r["hardware"], int(r["tensor_parallel"]), int(r["batch_size"]), int(r["prompt_size"]))
                measured[key].append(float(r["token_time"]))
    assert len(measured) > 50
    for (hw, tp, batch, prompt), times in measured.items():
        estimate = decode_step_ms(llama2, hardware[hw], batch, batch * prompt, tp)
        actual = sum(times) / len(times)
        assert estimate <= actual < 10 * estimate, (hw, tp, batch, prompt)


def test_the_array_roofline_matches_the_scalar_one() -> None:
    """The service vectorizes whole requests with the array forms; they must be the same physics."""
    import numpy as np

    from leadtime.features.catalog import ACCELERATORS, MODELS
    from leadtime.features.roofline import decode_step_ms_array, prefill_ms_array

    for acc in ACCELERATORS.values():
        for model in MODELS.values():
            figures = (model.params_b, float(model.layers), float(model.num_heads * model.head_dim))
            new = np.array([0.0, 1.0, 700.0, 9000.0])
            cached = np.array([0.0, 0.0, 512.0, 0.0])
            speed = (acc.effective_tflops, acc.effective_tb_s)
            got = prefill_ms_array(*figures, model.weight_bytes, *speed, new, cached, 2)
            want = [prefill_ms(model, acc, n, c, 2) for n, c in zip(new, cached, strict=True)]
            np.testing.assert_allclose(got, want, rtol=1e-12)
            batch, kv = np.array([1.0, 8.0, 64.0]), np.array([0.0, 4e4, 3e5])
            got = decode_step_ms_array(
                model.params_b,
                model.weight_bytes,
                float(model.kv_bytes_per_token(4)),
                acc.effective_tflops,
                acc.effective_tb_s,
                batch,
                kv,
                4,
            )
            want = [decode_step_ms(model, acc, b, k, 4) for b, k in zip(batch, kv, strict=True)]
            np.testing.assert_allclose(got, want, rtol=1e-12)
