"""End-to-end check of the step-time model against measured whole-prefill and decode-iteration times.

splitwise_sim_perf_model.csv times llama2-70b on A100-80GB and H100-80GB at TP 2/4/8: `prompt_time` is the
prefill of `batch_size` prompts of `prompt_size` tokens, `token_time` one decode iteration of that batch,
averaged over the generation. The model was fitted to kernel tables only, so this is a held-out check: nothing
here is estimated from the splitwise rows.

Comparison protocol (like with like):
- prefill: one step over `batch_size` chunks of `prompt_size` new tokens, each sampling its first token;
- decode: one decode step of `batch_size` sequences whose KV length is the average over the generation,
  `prompt_size + generated / 2`. The harness stops a sequence at its end-of-sequence token, so `generated` is
  the number of tokens the row actually produced, `(e2e_time - prompt_time) / token_time`, capped at
  `token_size` (the requested maximum; 137 of the 630 rows stopped well short of it);
- that harness (2023 vLLM) ran without CUDA graphs, so the model is evaluated in eager mode: the host launches
  every kernel and the step runs at the pace of the slower of the host and the GPU; it also predates vLLM's
  custom all-reduce, so every all-reduce is NCCL's.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leadtime.data import SPLITWISE
from leadtime.features.catalog import get_model
from leadtime.simulator.steptime import StepTimeModel

DEFAULT_PATH = SPLITWISE
HARDWARE = {"a100-80gb": "a100-sxm-80gb", "h100-80gb": "h100-sxm"}


@dataclass(frozen=True)
class ValidationRow:
    hardware: str
    tensor_parallel: int
    prompt_size: int
    batch_size: int
    token_size: int
    measured_prefill_ms: float
    measured_decode_ms: float
    predicted_prefill_ms: float
    predicted_decode_ms: float


def _errors(measured: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    ape = np.abs(predicted - measured) / measured
    return {"median_ape": float(np.median(ape)), "p90_ape": float(np.quantile(ape, 0.9)), "rows": int(len(ape))}


def validation_rows(path: Path = DEFAULT_PATH, cuda_graphs: bool = False) -> list[ValidationRow]:
    """Predict every llama2-70b row measured on A100-80GB or H100-80GB."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    model = get_model("llama-2-70b")
    steppers: dict[tuple[str, int], StepTimeModel] = {}
    out: list[ValidationRow] = []
    with path.open(newline="") as handle:
        for lineno, row in enumerate(csv.DictReader(handle), start=2):
            if row.get("model") != "llama2-70b" or row.get("hardware") not in HARDWARE:
                continue
            try:
                tp, prompt, batch, tokens = (
                    int(row[k]) for k in ("tensor_parallel", "prompt_size", "batch_size", "token_size")
                )
                prompt_ms, token_ms = float(row["prompt_time"]), float(row["token_time"])
                e2e_ms = float(row["e2e_time"]) if row.get("e2e_time") else float("nan")
            except (KeyError, ValueError) as err:
                raise ValueError(f"{path}:{lineno}: malformed row ({err})") from None
            key = (row["hardware"], tp)
            if key not in steppers:
                steppers[key] = StepTimeModel(
                    HARDWARE[row["hardware"]], model, tp, cuda_graphs=cuda_graphs, custom_allreduce=False
                )
            stepper = steppers[key]
            # The average decode iteration: each sequence holds its prompt and half of what it generated.
            generated = float(tokens)
            if np.isfinite(e2e_ms) and token_ms > 0:
                generated = min(float(tokens), max(1.0, (e2e_ms - prompt_ms) / token_ms))
            kv = batch * (prompt + generated / 2.0)
            out.append(
                ValidationRow(
                    hardware=row["hardware"],
                    tensor_parallel=tp,
                    prompt_size=prompt,
                    batch_size=batch,
                    token_size=tokens,
                    measured_prefill_ms=prompt_ms,
                    measured_decode_ms=token_ms,
                    predicted_prefill_ms=stepper.prefill_ms(prompt, batch),
                    predicted_decode_ms=stepper.step_ms([], batch, kv),
                )
            )
    if not out:
        raise ValueError(f"{path}: no llama2-70b rows on a100-80gb or h100-80gb")
    return out


def validate(path: Path = DEFAULT_PATH, cuda_graphs: bool = False) -> dict[str, dict[str, float]]:
    """Median and p90 absolute percentage error (fractions) of prefill and decode times."""
    rows = validation_rows(path, cuda_graphs)
    return {
        "prefill": _errors(
            np.array([r.measured_prefill_ms for r in rows]), np.array([r.predicted_prefill_ms for r in rows])
        ),
        "decode": _errors(
            np.array([r.measured_decode_ms for r in rows]), np.array([r.predicted_decode_ms for r in rows])
        ),
    }
