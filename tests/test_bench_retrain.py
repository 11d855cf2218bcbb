"""`leadtime bench retrain`'s protocol on a short stream (the Dask part runs in tests/test_training_dask.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from leadtime.bench.retrain import _decision_at, _time_ordered_lines, bench_stream, write_simulator_log


def test_the_protocol_on_a_short_simulator_stream(tmp_path: Path) -> None:
    log = tmp_path / "observations.jsonl"
    write_simulator_log(log, requests=1200)
    lines = _time_ordered_lines(log)
    stamps = [json.loads(line)["timestamp"] for line in lines]
    assert len(lines) == 1200 and stamps == sorted(stamps)
    # client=None: the "Dask" run is a second local run here, which must give the very same model.
    s = bench_stream("sim", log, "h100-sxm", "llama-3.1-8b", None, tmp_path, log=lambda message: None)
    assert (s["rows"], s["history_rows"], s["end_of_stream_rows"]) == (1200, 960, 240)
    assert s["end_of_stream_static"]["retrained_local"] == s["end_of_stream_static"]["retrained_dask"]
    for kind in ("end_of_stream_static", "end_of_stream_prequential"):
        for model in ("online", "retrained_local"):
            for target in ("ttft", "tpot"):
                cell = s[kind][model][target]
                assert cell["rows"] == 240 and 0.0 < cell["mape"] < 5.0 and 0.0 <= cell["coverage"] <= 1.0
    job = s["retrain_local"]
    assert job["outcome"] in ("published", "kept") and set(job["job_evaluation"]) == {"champion", "challenger"}


def test_the_decision_at_another_margin_is_the_one_the_job_would_take() -> None:
    def cell(mape: float) -> dict[str, float]:
        return {"rows": 100, "mape": mape, "median_ape": mape, "pinball": 0.05, "coverage": 0.9}

    champion = {"ttft": cell(0.20), "tpot": cell(0.05)}
    report: dict[str, Any] = {
        "outcome": "kept",
        "evaluation": {"champion": champion, "challenger": {"ttft": cell(0.12), "tpot": cell(0.05)}},
    }  # better TTFT, TPOT unchanged
    assert _decision_at(report, 0.02) == "kept" and _decision_at(report, 0.0) == "published"
    # A target with a new quantile tree and the champion's mean tree is held to no worse on MAPE, as in the job.
    new_upper = {"ttft": cell(0.12), "tpot": {**cell(0.05), "pinball": 0.04}}
    report = {**report, "evaluation": {"champion": champion, "challenger": new_upper}}
    assert _decision_at(report, 0.02) == "kept"
    report["decision"] = {"unchanged": [], "kept_mean": ["tpot"]}
    assert _decision_at(report, 0.02) == "published"


def test_the_simulator_log_is_cached_per_simulator_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: the cached log was keyed by request count and seed only: after a change to the simulator, a
    machine that had run the benchmark before judged the retraining job on the old simulator's log."""
    from leadtime.bench import retrain as retrain_bench
    from leadtime.simulator import traces

    written: list[Path] = []

    def write(path: Path, requests: int, seed: int = 0) -> int:
        written.append(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        return 0

    monkeypatch.setattr(retrain_bench, "write_simulator_log", write)
    first = retrain_bench.cached_simulator_log(10, 0, tmp_path)
    assert retrain_bench.cached_simulator_log(10, 0, tmp_path) == first and len(written) == 1  # cached
    monkeypatch.setattr(traces, "code_digest", lambda: "another simulator")
    assert retrain_bench.cached_simulator_log(10, 0, tmp_path) != first and len(written) == 2
