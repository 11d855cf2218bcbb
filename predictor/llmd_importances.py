"""Leadtime's tree importances in llm-d's terms: summed onto the llm-d inputs each feature is derived from.

llm-d's tooling reads `/model/{ttft|tpot}/lgb/importances` and the training server's `<target>_importance`
metric lines keyed by its eight input fields. Leadtime's trees split on its own columns (uncached tokens, roofline
times, the log of the physics prior, ...), most of which are computed from those inputs. The mapping below says
which inputs each column comes from; a column derived from k inputs gives each of them 1/k of its importance, so
the total is kept. Columns that no llm-d input determines (the accelerator's figures, time-slice state) keep their
own names. Values are shares of the model's total gain (they sum to 1).
"""

from __future__ import annotations

from collections.abc import Mapping

from leadtime.features.rows import LLMD_FIELDS, LLMD_MODEL_INPUTS

# llm-d's other row fields: listed when Leadtime's trees use a column derived from them (every one of
# `LLMD_MODEL_INPUTS` is present in an answer, 0 when the trees never split on it).
LLMD_OPTIONAL_INPUTS = tuple(f for f in LLMD_FIELDS if f not in LLMD_MODEL_INPUTS)

_PRIOR_INPUTS = {
    # TTFT prior: own uncached prefill + queued prefill + a weight pass per waiting request + one decode step.
    "ttft": (
        "input_token_length",
        "prefix_cache_score",
        "prefill_tokens_in_flight",
        "num_request_waiting",
        "num_request_running",
        "kv_cache_percentage",
    ),
    # TPOT prior: one decode step of the running batch and its KV cache.
    "tpot": ("num_request_running", "kv_cache_percentage"),
}

DERIVED_FROM: dict[str, tuple[str, ...]] = {
    "input_tokens": ("input_token_length",),
    "prefix_hit_tokens": ("input_token_length", "prefix_cache_score"),
    "uncached_tokens": ("input_token_length", "prefix_cache_score"),
    "num_tokens_generated": ("num_tokens_generated",),
    "num_request_waiting": ("num_request_waiting",),
    "num_request_running": ("num_request_running",),
    "kv_cache_percentage": ("kv_cache_percentage",),
    "prefill_tokens_in_flight": ("prefill_tokens_in_flight",),
    "decode_tokens_in_flight": ("decode_tokens_in_flight",),
    "role_prefill": ("pod_type",),
    "role_decode": ("pod_type",),
    "roofline_own_prefill_ms": ("input_token_length", "prefix_cache_score"),
    "roofline_queue_prefill_ms": ("prefill_tokens_in_flight",),
    "roofline_decode_step_ms": ("num_request_running", "kv_cache_percentage"),
    "encoder_input_size": ("encoder_input_size",),
    "encoder_matched_size": ("encoder_matched_size",),
}
# Leadtime's own columns: the accelerator and model figures and the time-slice state, which no llm-d input carries.
OWN_FEATURES = (
    "accel_tflops",
    "accel_tb_s",
    "tensor_parallel",
    "kv_bytes_per_token",
    "roofline_weights_ms",
    "timeslice_resident",
    "timeslice_wait_ms",
)


def sources(target: str, feature: str) -> tuple[str, ...]:
    """The llm-d inputs a Leadtime tree feature is derived from (empty: one of Leadtime's own)."""
    if feature == "log_prior":
        return _PRIOR_INPUTS[target]
    return DERIVED_FROM.get(feature, ())


def llmd_importances(target: str, importances: Mapping[str, float]) -> dict[str, float]:
    """Leadtime feature → importance (any scale) into llm-d input → share of the total, plus Leadtime's own
    features by name. Every one of `LLMD_MODEL_INPUTS` is in the answer."""
    out: dict[str, float] = dict.fromkeys(LLMD_MODEL_INPUTS, 0.0)
    own: dict[str, float] = {}
    total = sum(max(float(v), 0.0) for v in importances.values())
    for feature, value in importances.items():
        share = max(float(value), 0.0) / total if total > 0 else 0.0
        inputs = sources(target, feature)
        if not inputs:
            own[feature] = own.get(feature, 0.0) + share
            continue
        for name in inputs:
            out[name] = out.get(name, 0.0) + share / len(inputs)
    for name in LLMD_OPTIONAL_INPUTS:
        if name in out and out[name] == 0.0:
            del out[name]
    out.update(own)
    return out
