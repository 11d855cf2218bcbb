"""`leadtime sim validate`: how close the simulator comes to measured serving, two ways.

1. State-conditioned replay on real vLLM measurements (the primary yardstick, `replay.py`): for each recorded
   row, a simulated endpoint in the row's state produces the row's TTFT or TPOT. The rows are of the stack the
   step model's kernel tables describe (vLLM, CUDA graphs); nothing is fitted on them.

2. Splitwise (`splitwise_sim_perf_model.csv`): llama2-70b on A100-80GB and H100-80GB at TP 2/4/8; `prompt_time`
   is the prefill of `batch_size` prompts of `prompt_size` tokens, `token_time` one decode iteration of that
   batch, averaged over the generation. That harness is another stack (2023 vLLM, eager mode, no custom
   all-reduce), so besides the unfitted error the check allows, as trained-physics simulators do, one
   efficiency factor per (hardware, stack) for prefill and one for decode, fitted on one part of the rows and
   evaluated on the other. The factors are reported and used nowhere else.

Splitwise comparison protocol (like with like):
- prefill: one step over `batch_size` chunks of `prompt_size` new tokens, each sampling its first token;
- decode: one decode step of `batch_size` sequences whose KV length is the average over the generation,
  `prompt_size + generated / 2`. The harness stops a sequence at its end-of-sequence token, so `generated` is
  the number of tokens the row actually produced, `(e2e_time - prompt_time) / token_time`, capped at
  `token_size` (the requested maximum; 137 of the 630 rows stopped well short of it);
- that harness ran without CUDA graphs, so the model is evaluated in eager mode: the host launches every
  kernel and the step runs at the pace of the slower of the host and the GPU; it also predates vLLM's custom
  all-reduce, so every all-reduce is NCCL's.

Splitwise folds: the rows come at three tensor-parallel degrees (210 rows each), so the two folds split by TP
degree: fit on TP 4 and evaluate on TP 2 and 8, then fit on TP 2 and 8 and evaluate on TP 4. Every row is held
out exactly once, and the held-out error is over all of them. A factor is the efficiency of the stack relative
to the model, the median over the fitting rows of predicted / measured time (< 1: the stack is slower than the
kernel tables); a held-out prediction is the model's time divided by it.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from leadtime.data import SPLITWISE
from leadtime.features.catalog import get_model
from leadtime.simulator.replay import DEFAULT_OUTPUT_TOKENS, StateReplay, measured_fidelity
from leadtime.simulator.steptime import StepTimeModel
from leadtime.simulator.workload import USER_TEXT_ENCODING

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


def _csv_records(path: Path, handle: TextIO) -> list[dict[str, str]]:
    """Every record of a CSV file; ValueError naming the file when it is not UTF-8 text or not CSV."""
    try:
        return list(csv.DictReader(handle))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text (expected splitwise_sim_perf_model.csv)") from None
    except csv.Error as err:
        raise ValueError(f"{path}: not CSV ({err})") from None


def validation_rows(path: Path = DEFAULT_PATH, cuda_graphs: bool = False) -> list[ValidationRow]:
    """Predict every llama2-70b row measured on A100-80GB or H100-80GB."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    model = get_model("llama-2-70b")
    steppers: dict[tuple[str, int], StepTimeModel] = {}
    out: list[ValidationRow] = []
    with path.open(newline="", encoding=USER_TEXT_ENCODING) as handle:
        for lineno, row in enumerate(_csv_records(path, handle), start=2):
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


def _errors(measured: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    ape = np.abs(predicted - measured) / measured
    return {"median_ape": float(np.median(ape)), "p90_ape": float(np.quantile(ape, 0.9)), "rows": int(len(ape))}


def _phase(rows: list[ValidationRow], phase: str) -> tuple[np.ndarray, np.ndarray]:
    measured = np.array([getattr(r, f"measured_{phase}_ms") for r in rows])
    predicted = np.array([getattr(r, f"predicted_{phase}_ms") for r in rows])
    return measured, predicted


def splitwise_unfitted(rows: list[ValidationRow]) -> dict[str, dict[str, float]]:
    """Median and p90 absolute percentage error (fractions) of prefill and decode times, nothing fitted."""
    return {phase: _errors(*_phase(rows, phase)) for phase in ("prefill", "decode")}


# (name of the fitting part, TP degrees it holds): each fold fits on one part and is evaluated on the rest.
FOLDS: tuple[tuple[str, frozenset[int]], ...] = (("tp 4", frozenset({4})), ("tp 2 and 8", frozenset({2, 8})))


def efficiency_factors(rows: list[ValidationRow]) -> dict[str, dict[str, float]]:
    """Per hardware, the prefill and decode efficiency: median predicted / measured time over `rows`."""
    out: dict[str, dict[str, float]] = {}
    for hardware in sorted({r.hardware for r in rows}):
        mine = [r for r in rows if r.hardware == hardware]
        out[hardware] = {}
        for phase in ("prefill", "decode"):
            measured, predicted = _phase(mine, phase)
            out[hardware][phase] = float(np.median(predicted / measured))
    return out


def splitwise_heldout(rows: list[ValidationRow]) -> dict[str, object]:
    """Error on held-out rows with one efficiency factor per (hardware, stack) and phase, over the two folds."""
    measured: dict[str, list[float]] = {"prefill": [], "decode": []}
    predicted: dict[str, list[float]] = {"prefill": [], "decode": []}
    folds: list[dict[str, object]] = []
    for name, degrees in FOLDS:
        fit = [r for r in rows if r.tensor_parallel in degrees]
        held = [r for r in rows if r.tensor_parallel not in degrees]
        if not fit or not held:
            raise ValueError(f"splitwise fold {name!r}: needs rows at TP {sorted(degrees)} and at other degrees")
        factors = efficiency_factors(fit)
        for r in held:
            if r.hardware not in factors:
                raise ValueError(f"splitwise fold {name!r}: no fitting rows on {r.hardware}")
            for phase in ("prefill", "decode"):
                measured[phase].append(getattr(r, f"measured_{phase}_ms"))
                predicted[phase].append(getattr(r, f"predicted_{phase}_ms") / factors[r.hardware][phase])
        held_degrees = " and ".join(str(d) for d in sorted({r.tensor_parallel for r in held}))
        folds.append({"fit_on": name, "evaluated_on": f"tp {held_degrees}", "efficiency": factors})
    out: dict[str, object] = {
        phase: _errors(np.array(measured[phase]), np.array(predicted[phase])) for phase in ("prefill", "decode")
    }
    out["folds"] = folds
    return out


def validate(
    data: Path,
    accelerator: str,
    model: str,
    splitwise: Path = DEFAULT_PATH,
    async_scheduling: bool = True,
    output_tokens: int = DEFAULT_OUTPUT_TOKENS,
) -> dict[str, object]:
    """Both checks: the replay of `data` on `accelerator` × `model`, and splitwise held out and unfitted."""
    replay = StateReplay(accelerator, model, async_scheduling=async_scheduling, output_tokens=output_tokens)
    rows = validation_rows(splitwise)
    return {
        "measured": measured_fidelity(data, replay),
        "splitwise_heldout": splitwise_heldout(rows),
        "splitwise_unfitted": splitwise_unfitted(rows),
    }
