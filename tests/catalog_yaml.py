"""A deployment's catalog file as the tests write it: two accelerator classes and a model the build lacks."""

from __future__ import annotations

CATALOG_YAML = """\
accelerators:
  - slug: b200
    name: NVIDIA B200
    peak_tflops: 2250
    hbm_tb_s: 8.0
    memory_gb: 180
    interconnect_gb_s: 900
  - slug: l4
    peak_tflops: 121
    hbm_tb_s: 0.3
    memory_gb: 24
    interconnect_gb_s: 32
models:
  - slug: qwen2.5-7b
    params_b: 7.6
    layers: 28
    hidden_size: 3584
    num_heads: 28
    num_kv_heads: 4
    head_dim: 128
"""
