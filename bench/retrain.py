"""`leadtime bench retrain`: the offline retraining job, locally and on Dask, against the online model.

Two streams: the observation log of a long simulator run (the mixed H100/A100/L40S fleet under llm-d's policy,
synthetic bursty traffic, one observation per request; generated once and cached, the same for a given
request count and seed) and the shipped sharegpt-h200 measurements. Each stream is put in time order and cut:

- the first 80% is the history. The online model learns it as the service would (in order, retraining its
  trees on its window every 2,000 observations) and becomes the champion in a fresh directory registry; the
  retraining job then runs on the history with that registry, once in this process and once on a local Dask
  cluster of two single-threaded worker processes (timed separately, cluster start-up excluded);
- the last 20%, the end of the stream, is seen by neither. The online model and each retrained model (the job's
  challenger, whether the job published it or kept the champion) predict it twice: statically, as they stand
  (`training.champion.evaluate`), and prequentially, as a service would serve it, predicting each block of 100
  observations before learning it (their online parts learn, their trees retrain on schedule as the service's do).

Every figure is measured by the run; nothing is fixed in the code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from leadtime.data import MEASURED
from leadtime.features.rows import parse_timestamp
from leadtime.json_text import print_json
from leadtime.predictor.artifact import save_file
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.physics import TARGETS
from leadtime.training.champion import Evaluation, Scores, decide, evaluate
from leadtime.training.job import RetrainConfig, RetrainResult, run_retrain
from leadtime.training.sources import SampleReader, Samples

HOLDOUT_SHARE = 0.2
PREQUENTIAL_BLOCK = 100
SIM_FLEET = "mixed"
SIM_POLICY = "llm-d"
SIM_TRAFFIC = "synthetic:requests={requests},rate_rps=20,burstiness=4"
LOG_VERSION = 1  # bump when the log's format changes here; the simulator's own changes key it by `code_digest`


def write_simulator_log(path: Path, requests: int, seed: int = 0, fleet: str = SIM_FLEET) -> int:
    """Simulate `requests` requests of bursty synthetic traffic on `fleet` under llm-d's policy and write every
    observation (an llm-d training row with Leadtime's fields, as `leadtime simulate --out` does); returns rows."""
    from leadtime.simulator.fleet import load_fleet
    from leadtime.simulator.report import write_observations
    from leadtime.simulator.run import SimulationOptions, run_policies
    from leadtime.simulator.workload import load_workload, shape

    workload = shape(load_workload(SIM_TRAFFIC.format(requests=requests), seed))
    results = run_policies(load_fleet(fleet), workload, [SIM_POLICY], SimulationOptions(seed=seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    rows = write_observations(results, partial)
    os.replace(partial, path)
    return rows


def cached_simulator_log(requests: int, seed: int, cache: Path | None) -> Path:
    """The simulator's observation log for this request count and seed, generated on first use."""
    directory = cache or Path(tempfile.gettempdir()) / "leadtime-bench-cache"
    from leadtime.simulator.traces import code_digest

    # Keyed by the simulator's code too: a log it generated before a change to what it simulates is not reused.
    key = f"retrain-{SIM_FLEET}-{requests}-seed{seed}-v{LOG_VERSION}-{code_digest()[:12]}"
    path = directory / key / "observations.jsonl"
    if not path.exists():
        write_simulator_log(path, requests, seed)
    return path


def _time_ordered_lines(path: Path) -> list[bytes]:
    """The file's non-empty lines in time order (by timestamp when every row has one, else as they are)."""
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    stamps = []
    for line in lines:
        value = json.loads(line).get("timestamp")
        if value is None:
            return lines
        stamps.append(parse_timestamp(value))
    order = np.argsort(np.array(stamps), kind="stable")
    return [lines[i] for i in order]


def _scores(evaluation_scores: dict[str, Scores]) -> dict[str, dict[str, float]]:
    return {t: {"mape": s.mape, "coverage": s.coverage, "rows": s.rows} for t, s in evaluation_scores.items()}


def prequential(predictor: OnlinePredictor, samples: Samples, block: int = PREQUENTIAL_BLOCK) -> dict[str, Any]:
    """Predict each block of rows, then learn it; scores of every prediction made before its row was learned."""
    quantile = predictor.config.quantile
    means: dict[str, list[np.ndarray]] = {t: [] for t in TARGETS}
    uppers: dict[str, list[np.ndarray]] = {t: [] for t in TARGETS}
    for start in range(0, len(samples), block):
        rows = np.arange(start, min(start + block, len(samples)))
        batch = samples.batch[rows]
        p = predictor.predict_many(batch)
        means["ttft"].append(p.ttft_mean)
        uppers["ttft"].append(p.ttft_quantile)
        means["tpot"].append(p.tpot_mean)
        uppers["tpot"].append(p.tpot_quantile)
        predictor.learn_many(batch, samples.actual_ttft_ms[rows], samples.actual_tpot_ms[rows])
    out = {}
    for target, actual in (("ttft", samples.actual_ttft_ms), ("tpot", samples.actual_tpot_ms)):
        seen = actual > 0
        mean, upper = np.concatenate(means[target])[seen], np.concatenate(uppers[target])[seen]
        s = Scores.of(actual[seen], mean, upper, quantile)
        out[target] = {"mape": s.mape, "coverage": s.coverage, "rows": s.rows}
    return out


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Standard output (the file descriptor, so child processes started meanwhile inherit it) to standard
    error: LightGBM's Dask workers print their network set-up there, and `--json` must stay alone on stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _retrain(history: Path, champion: bytes, workdir: Path, name: str, client: Any) -> tuple[RetrainResult, float]:
    """The job on the history with the online model as champion (a registry of its own), and its wall time."""
    registry = workdir / f"registry-{name}"
    save_file(registry, champion)
    started = time.perf_counter()
    result = run_retrain(RetrainConfig(samples=(str(history),), registry=str(registry)), client=client)
    return result, time.perf_counter() - started


def _decision_at(report: dict[str, Any], margin: float) -> str:
    """What the job would have decided on the same judging with another `--margin`."""
    judged = {
        name: Evaluation({t: Scores(*(e[t][k] for k in _SCORE_FIELDS)) for t in TARGETS}, {}, {})
        for name, e in report["evaluation"].items()
    }
    if "champion" not in judged:
        return report["outcome"]
    decision = report.get("decision", {})
    unchanged = decision.get("unchanged", [])  # held to no worse, not to the margin
    kept_mean = decision.get("kept_mean", [])  # MAPE held to no worse (a new quantile tree alone)
    at_margin = decide(judged["champion"], judged["challenger"], margin, unchanged, kept_mean)
    return "published" if at_margin.publish else "kept"


_SCORE_FIELDS = ("rows", "mape", "median_ape", "pinball", "coverage")


def _job_summary(result: RetrainResult, seconds: float) -> dict[str, Any]:
    report = result.report
    return {
        "seconds": seconds,
        "fit_s": report["timings_s"]["fit_s"],
        "outcome": report["outcome"],
        "outcome_with_margin_0": _decision_at(report, 0.0),
        "reason": report["decision"]["reason"],
        "job_evaluation": {
            name: {t: {"mape": e[t]["mape"], "coverage": e[t]["coverage"]} for t in TARGETS}
            for name, e in report["evaluation"].items()
        },
        "trees": {
            t: {"accepted": f["accepted"], "rounds": f["trees"], "chosen": f["chosen"]}
            for t, f in report["training"]["targets"].items()
        },
    }


def bench_stream(
    name: str, path: Path, accelerator: str, model: str, client: Any, workdir: Path, log: Any
) -> dict[str, Any]:
    """One stream: the online model, the job locally and on Dask, and all three on the end of the stream."""
    lines = _time_ordered_lines(path)
    cut = int(round(len(lines) * (1 - HOLDOUT_SHARE)))
    history, holdout = workdir / f"{name}-history.jsonl", workdir / f"{name}-holdout.jsonl"
    history.write_bytes(b"\n".join(lines[:cut]) + b"\n")
    holdout.write_bytes(b"\n".join(lines[cut:]) + b"\n")
    reader = SampleReader(accelerator, model)
    seen, unseen = reader.read([str(history)]), reader.read([str(holdout)])

    log(f"{name}: the online model learns {len(seen):,} observations")
    online = OnlinePredictor(LearnerConfig(accelerator=accelerator, model=model, background=False))
    started = time.perf_counter()
    online.learn_many(seen.batch, seen.actual_ttft_ms, seen.actual_tpot_ms)
    online_s = time.perf_counter() - started
    champion = online.to_bytes()

    log(f"{name}: retraining in this process")
    local, local_s = _retrain(history, champion, workdir, f"{name}-local", None)
    log(f"{name}: retraining on the Dask cluster")
    with _stdout_to_stderr():
        dask, dask_s = _retrain(history, champion, workdir, f"{name}-dask", client)

    log(f"{name}: the end of the stream")
    actual = {"ttft": unseen.actual_ttft_ms, "tpot": unseen.actual_tpot_ms}
    models = {
        "online": OnlinePredictor.from_bytes(champion, background=False),
        "retrained_local": local.challenger,
        "retrained_dask": dask.challenger,
    }
    static = {k: _scores(evaluate(m, unseen.batch, actual).overall) for k, m in models.items()}
    walked = {
        k: prequential(OnlinePredictor.from_bytes(m.to_bytes(), background=False), unseen) for k, m in models.items()
    }
    return {
        "rows": len(seen) + len(unseen),
        "history_rows": len(seen),
        "end_of_stream_rows": len(unseen),
        "online_learning_s": online_s,
        "retrain_local": _job_summary(local, local_s),
        "retrain_dask": _job_summary(dask, dask_s),
        "end_of_stream_static": static,
        "end_of_stream_prequential": walked,
    }


def run_bench_retrain(
    requests: int = 100_000, seed: int = 0, cache: Path | None = None, progress: bool = False
) -> dict[str, Any]:
    """Both streams; the Dask cluster is started once (its start-up time reported apart)."""
    from dask.distributed import Client, LocalCluster

    def log(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    log(f"simulator log of {requests:,} requests (cached after the first run)")
    sim_log = cached_simulator_log(requests, seed, cache)
    log_s = time.perf_counter() - started
    report: dict[str, Any] = {"simulator_log": str(sim_log), "simulator_log_s": log_s, "streams": {}}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="leadtime-bench-retrain-") as tmp:
        t = time.perf_counter()
        with _stdout_to_stderr():
            cluster = stack.enter_context(
                LocalCluster(
                    n_workers=2,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=":0",  # any free port: None still asks for 8787, and warns when it is taken
                    silence_logs=logging.ERROR,
                )
            )
            client = stack.enter_context(Client(cluster))
        report["dask_cluster"] = {"workers": 2, "threads_per_worker": 1, "start_s": time.perf_counter() - t}
        workdir = Path(tmp)
        streams = (
            (f"simulator-{SIM_FLEET}", sim_log, "h100-sxm", "llama-3.1-8b"),
            ("sharegpt-h200", MEASURED["sharegpt-h200"], "h200-sxm", "qwen3-32b"),
        )
        for name, path, accelerator, model in streams:
            report["streams"][name] = bench_stream(name, path, accelerator, model, client, workdir, log)
    report["total_s"] = time.perf_counter() - started
    report["cpu_count"] = os.cpu_count()
    return report


def print_report(report: dict[str, Any], as_json: bool) -> None:
    """The report as JSON, or a few lines per stream."""
    if as_json:
        print_json(report)
        return
    for name, s in report["streams"].items():
        print(f"{name}: {s['rows']:,} observations ({s['history_rows']:,} history, {s['end_of_stream_rows']:,} end)")
        print(
            f"  retrain time: local {s['retrain_local']['seconds']:.1f} s, Dask (2 workers) "
            f"{s['retrain_dask']['seconds']:.1f} s; outcome {s['retrain_local']['outcome']} / "
            f"{s['retrain_dask']['outcome']}"
        )
        for kind in ("end_of_stream_static", "end_of_stream_prequential"):
            cells = ", ".join(
                f"{model} TTFT {v['ttft']['mape']:.3f} TPOT {v['tpot']['mape']:.3f}" for model, v in s[kind].items()
            )
            print(f"  {kind.removeprefix('end_of_stream_')} MAPE: {cells}")
