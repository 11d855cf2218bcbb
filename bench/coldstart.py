"""`leadtime bench coldstart`: how good is the first prediction on an accelerator class never seen before?

Synthetic fleet data: three accelerator classes serving Llama-3.1-8B, with latencies generated from a
ground-truth model that is deliberately *not* Leadtime's roofline (per-class hidden kernel efficiencies and
scheduler overheads, queueing that grows super-linearly, log-normal noise). Both predictors learn 1,500
observations from each of two classes, then walk the third class prequentially (predict, then learn). Reported:
MAPE over the third class's first 50 observations and over its observations 500–1,000.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.table import Table

from leadtime.console import report_console
from leadtime.features.catalog import get_accelerator, get_model
from leadtime.features.roofline import kv_capacity_tokens
from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures, feature_row_to_llmd
from leadtime.json_text import print_json
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.llmd_reference import LlmdFrame, LlmdReference

MODEL = "llama-3.1-8b"
SEEN = ("h100-sxm", "a100-sxm-80gb")
UNSEEN = "mi300x"


@dataclass(frozen=True)
class _Truth:
    """Hidden per-class efficiencies the predictors must not be told."""

    compute_efficiency: float
    bandwidth_efficiency: float
    overhead_ms: float


def _truth(slug: str, rng: np.random.Generator) -> _Truth:
    return _Truth(
        compute_efficiency=float(rng.uniform(0.35, 0.6)),
        bandwidth_efficiency=float(rng.uniform(0.55, 0.8)),
        overhead_ms=float(rng.uniform(8.0, 20.0)),
    )


def synthetic_class(slug: str, n: int, rng: np.random.Generator) -> tuple[list[FeatureRow], np.ndarray, np.ndarray]:
    """n (row, TTFT, TPOT) samples of one class under a load that varies from idle to saturated."""
    acc, model = get_accelerator(slug), get_model(MODEL)
    truth = _truth(slug, rng)
    flops_per_token = 2.0 * model.params_b * 1e9
    kv_capacity = kv_capacity_tokens(model, acc)
    rows, ttft, tpot = [], np.empty(n), np.empty(n)
    for i in range(n):
        load = rng.uniform(0.0, 1.0)
        running = int(rng.poisson(2 + 60 * load))
        waiting = int(rng.poisson(8 * load**3))
        input_tokens = int(rng.lognormal(6.5, 0.9)) + 1
        prefix = int(input_tokens * rng.uniform(0, 0.6)) if rng.random() < 0.4 else 0
        in_flight = int(rng.poisson(1 + 6000 * load**2))
        kv_tokens = running * rng.uniform(300, 1500)
        kv = min(kv_tokens / kv_capacity, 1.0)
        row = FeatureRow(
            RequestFeatures.with_prefix_hits(input_tokens, prefix),
            EndpointState(
                endpoint_id=f"{slug}-{i % 4}",
                accelerator=slug,
                model=MODEL,
                num_request_waiting=waiting,
                num_request_running=running,
                kv_cache_percentage=kv,
                prefill_tokens_in_flight=in_flight,
            ),
        )
        compute = acc.peak_tflops * 1e12 * truth.compute_efficiency
        bandwidth = acc.hbm_tb_s * 1e12 * truth.bandwidth_efficiency
        step_ms = 1e3 * (model.weight_bytes + kv_tokens * model.kv_bytes_per_token(1)) / bandwidth
        prefill_ms = 1e3 * (in_flight + input_tokens - prefix) * flops_per_token / compute
        queue_ms = waiting * (step_ms + 1e3 * 600 * flops_per_token / compute) * (1 + 0.1 * waiting)
        noise = rng.lognormal(0.0, 0.15, size=2)
        ttft[i] = (truth.overhead_ms + prefill_ms + queue_ms + step_ms) * noise[0]
        tpot[i] = (0.3 * truth.overhead_ms + step_ms * (1 + 0.004 * running)) * noise[1]
        rows.append(row)
    return rows, ttft, tpot


def _mape(pred: np.ndarray, actual: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - actual) / actual))


def _llmd_frame(rows: list[FeatureRow], ttft: np.ndarray, tpot: np.ndarray) -> LlmdFrame:
    entries = [feature_row_to_llmd(r) for r in rows]
    for entry, a, b in zip(entries, ttft.tolist(), tpot.tolist(), strict=True):
        entry["actual_ttft_ms"], entry["actual_tpot_ms"] = a, b
    return LlmdFrame.from_rows(entries)


def run_coldstart(
    seed: int = 0,
    unseen: str = UNSEEN,
    per_seen_class: int = 1500,
    unseen_walk: int = 1000,
    reference_model: str | None = None,
) -> dict[str, Any]:
    """Both predictors learn the seen classes, then walk the held-back one prequentially; MAPE per target."""
    if unseen in SEEN:
        raise ValueError(f"--unseen must be a class other than the seen ones ({', '.join(SEEN)})")
    rng = np.random.default_rng(seed)
    seen = [synthetic_class(slug, per_seen_class, rng) for slug in SEEN]
    new_rows, new_ttft, new_tpot = synthetic_class(unseen, unseen_walk, rng)
    # Interleave the two seen classes as a mixed fleet would report them.
    order = rng.permutation(per_seen_class * len(SEEN))
    rows = [r for cls in seen for r in cls[0]]
    ttft = np.concatenate([cls[1] for cls in seen])
    tpot = np.concatenate([cls[2] for cls in seen])
    rows, ttft, tpot = [rows[i] for i in order], ttft[order], tpot[order]

    leadtime = OnlinePredictor(LearnerConfig(accelerator="h100-sxm", model=MODEL, background=False, seed=seed))
    leadtime.learn_many(leadtime.vectorizer.batch(rows), ttft, tpot)
    reference = LlmdReference(model=reference_model, objectives=("mean",))  # only its mean is scored here
    reference.fit(_llmd_frame(rows, ttft, tpot))

    x_new = leadtime.vectorizer.batch(new_rows)
    x_new_ref = _llmd_frame(new_rows, new_ttft, new_tpot)
    preds: dict[str, dict[str, np.ndarray]] = {
        m: {t: np.empty(unseen_walk) for t in ("ttft", "tpot")} for m in ("leadtime", "llmd_reference")
    }
    for i in range(unseen_walk):
        p = leadtime.predict_many(x_new[i : i + 1])
        preds["leadtime"]["ttft"][i], preds["leadtime"]["tpot"][i] = p.ttft_mean[0], p.tpot_mean[0]
        row = x_new_ref.take(np.arange(i, i + 1))
        ref = reference.predict_many(row)
        for t in ("ttft", "tpot"):
            mean = ref.get(t, "mean")
            assert mean is not None
            preds["llmd_reference"][t][i] = mean[0]
        leadtime.learn_many(x_new[i : i + 1], new_ttft[i : i + 1], new_tpot[i : i + 1])
        reference.learn_many(row)
    leadtime.close()
    actual = {"ttft": new_ttft, "tpot": new_tpot}
    report: dict[str, Any] = {
        "seen_classes": list(SEEN),
        "unseen_class": unseen,
        "model": MODEL,
        "seed": seed,
        "reference_model": reference.model_type,
    }
    for m, by_target in preds.items():
        report[m] = {
            t: {
                "mape_first_50": _mape(by_target[t][:50], actual[t][:50]),
                "mape_after_500": _mape(by_target[t][500:], actual[t][500:]),
            }
            for t in ("ttft", "tpot")
        }
    return report


def print_report(report: dict[str, Any], as_json: bool) -> None:
    """The report as JSON, or as a table."""
    if as_json:
        print_json(report, indent=2)
        return
    seen, reference = ", ".join(report["seen_classes"]), report["reference_model"]
    table = Table(title=f"cold start on {report['unseen_class']} after learning {seen} (llmd_reference: {reference})")
    for column in ("model", "target", "MAPE first 50", "MAPE after 500"):
        table.add_column(column)
    for m in ("leadtime", "llmd_reference"):
        for t in ("ttft", "tpot"):
            r = report[m][t]
            table.add_row(m, t, f"{r['mape_first_50']:.3f}", f"{r['mape_after_500']:.3f}")
    report_console().print(table)
