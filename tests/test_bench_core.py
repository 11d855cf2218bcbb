"""The predictor-core benchmarks and the demo, on small slices of the real H200 trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from leadtime.bench.accuracy import run_accuracy
from leadtime.bench.coldstart import run_coldstart
from leadtime.bench.demo import run_demo
from leadtime.cli import app
from leadtime.data import MEASURED

TRACE = MEASURED["sharegpt-h200"]


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "slice.jsonl"
    lines = TRACE.read_text().splitlines()[:400]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_accuracy_report_has_every_figure_the_readme_quotes(small_trace: Path) -> None:
    report = run_accuracy(
        small_trace, accelerator="h200-sxm", model="qwen3-32b", seeds=2, progress=False, speed_calls=200
    )
    for model in ("leadtime", "llmd_reference", "median_baseline"):
        for target in ("ttft", "tpot"):
            figures = report[model][target]
            for key in (
                "prequential_mape",
                "prequential_mape_second_half",
                "prequential_p90_coverage",
                "split_mape",
                "split_p90_coverage",
            ):
                assert 0.0 <= figures[key] < 100.0, (model, target, key)
    assert set(report["speed"]) >= {"predict_100_us_p50", "predict_100_us_p99", "learn_one_us_p50"}
    # The reference answers a constant 10 ms before its first retrain, so on the first rows it is far off.
    assert report["leadtime"]["ttft"]["prequential_mape"] < report["llmd_reference"]["ttft"]["prequential_mape"]


def test_accuracy_without_trees_fits_none_in_the_walk_or_the_split(
    small_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from leadtime.predictor.target import TargetModel

    fitted: list[str] = []
    fit = TargetModel.fit_candidate

    def counted(self: TargetModel, *args: Any, **kwargs: Any) -> Any:
        fitted.append(self.target)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "fit_candidate", counted)
    args = ["bench", "accuracy", "--data", str(small_trace), "--seeds", "1", "--json"]
    result = CliRunner().invoke(app, [*args, "--no-trees"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["data"]["trees"] is False
    assert fitted == []
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["data"]["trees"] is True
    assert {"ttft", "tpot"} <= set(fitted)  # the split's retrain, at least
    table = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(small_trace), "--seeds", "1", "--no-trees"])
    assert table.exit_code == 0 and "leadtime without trees" in table.stdout, table.output


def test_accuracy_cli_prints_json_and_refuses_bad_files(small_trace: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "accuracy", "--data", str(small_trace), "--seeds", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert "leadtime" in json.loads(result.stdout)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kv_cache_percentage": 0.1}\n')
    result = runner.invoke(app, ["bench", "accuracy", "--data", str(bad), "--json"])
    assert result.exit_code == 2
    assert "bad.jsonl:1" in result.output and "input_token_length" in result.output
    result = runner.invoke(app, ["bench", "accuracy", "--data", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2
    assert "none.jsonl" in result.output


def test_accuracy_table_names_the_model_the_llmd_reference_ran(small_trace: Path) -> None:
    """Its row said `llmd_reference` whichever model ran (LightGBM where xgboost is not installed, against the
    README's XGBoost figures)."""
    argv = ["bench", "accuracy", "--data", str(small_trace), "--seeds", "1", "--reference-model", "lightgbm"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert "llmd_reference: lightgbm)" in " ".join(result.output.split())


def test_accuracy_refuses_a_file_too_short_or_a_delay_past_its_end(small_trace: Path, tmp_path: Path) -> None:
    """Five rows printed figures of a two-row split; a label delay past the end printed a walk that learned nothing."""
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("\n".join(TRACE.read_text().splitlines()[:5]) + "\n")
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(tiny), "--json"])
    assert result.exit_code == 2 and "5 rows" in result.output and "at least 20" in result.output
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(small_trace), "--label-delay", "400"])
    assert result.exit_code == 2 and "--label-delay 400 is not below the 400 rows" in result.output


def test_accuracy_on_a_file_of_one_target_prints_dashes_not_nan(tmp_path: Path) -> None:
    """A file of TPOT rows only printed "nan" in every TTFT cell and "learn in batches of 1,000: nan/s"."""
    tpot_only = tmp_path / "tpot.jsonl"
    lines = [line for line in TRACE.read_text().splitlines() if json.loads(line)["actual_tpot_ms"] > 0][:300]
    tpot_only.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(tpot_only), "--seeds", "1"])
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split())  # as one line, wherever the console wrapped it
    assert "nan" not in printed.lower()
    assert "prequential –, split –" in printed and "learn in batches of 1,000: – (under 1,000 rows)" in printed
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(tpot_only), "--seeds", "1", "--json"])
    assert json.loads(result.stdout)["leadtime"]["ttft"]["prequential_mape"] is None


def test_coldstart_beats_the_reference_on_a_class_it_never_saw() -> None:
    # 800 observations per seen class: with 400, the two models' TPOT on the first 50 rows were within 2-5% of
    # each other (0.174-0.187 against 0.178 MAPE, seed 1), too close to tell apart on so little data.
    report = run_coldstart(seed=1, per_seen_class=800, unseen_walk=600)
    assert report["unseen_class"] == "mi300x"
    for target in ("ttft", "tpot"):
        ours = report["leadtime"][target]["mape_first_50"]
        theirs = report["llmd_reference"][target]["mape_first_50"]
        assert ours < theirs
    with pytest.raises(ValueError, match="other than the seen"):
        run_coldstart(unseen="h100-sxm")


def test_demo_writes_a_plot(small_trace: Path, tmp_path: Path) -> None:
    run_demo(small_trace, tmp_path)
    png = tmp_path / "predicted_vs_actual.png"
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_file_without_one_target_reports_null_for_it(tmp_path: Path) -> None:
    """Regression: a TTFT-only file crashed the split floor and would have printed NaN (not JSON)."""
    ttft_only = [line for line in TRACE.read_text().splitlines() if '"actual_tpot_ms": 0,' in line][:200]
    path = tmp_path / "ttft_only.jsonl"
    path.write_text("\n".join(ttft_only) + "\n")
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(path), "--seeds", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["leadtime"]["tpot"]["split_mape"] is None
    assert report["leadtime"]["ttft"]["split_mape"] > 0


def _walk_inputs(path: Path, n: int) -> tuple:
    from leadtime.bench.data import actuals, load_llmd_rows
    from leadtime.features.vectorize import Vectorizer
    from leadtime.predictor.llmd_reference import LlmdFrame

    rows = load_llmd_rows(path)[:n]
    ttft, tpot = actuals(rows)
    x = Vectorizer("h200-sxm", "qwen3-32b").batch_llmd(rows)
    return x, LlmdFrame.from_rows(rows), {"ttft": ttft, "tpot": tpot}


def test_the_walk_tells_leadtime_each_rows_endpoint() -> None:
    """Rows that name their endpoint (Leadtime's extras) are predicted per endpoint, as a router's would be: two
    endpoints alike in every feature, one three times as slow, come apart once it has seen a few of each."""
    import numpy as np

    from leadtime.bench.accuracy import prequential_walk
    from leadtime.features.vectorize import Vectorizer
    from leadtime.predictor.learner import LearnerConfig
    from leadtime.predictor.llmd_reference import LlmdFrame

    rows = []
    for i in range(400):
        slow = i % 2 == 1
        rows.append(
            {
                "kv_cache_percentage": 0.2,
                "input_token_length": 800,
                "num_request_waiting": 0,
                "num_request_running": 4,
                "num_tokens_generated": 0,
                "prefix_cache_score": 0.0,
                "prefill_tokens_in_flight": 0,
                "decode_tokens_in_flight": 0,
                "actual_ttft_ms": 300.0 if slow else 100.0,
                "actual_tpot_ms": 0.0,
                "timestamp": float(i),
                "endpoint_id": "slow" if slow else "fast",
            }
        )
    y = {"ttft": np.array([r["actual_ttft_ms"] for r in rows]), "tpot": np.zeros(len(rows))}
    config = LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False, retrain=False)
    x = Vectorizer("h200-sxm", "qwen3-32b").batch_llmd(rows)
    mean = prequential_walk(x, LlmdFrame.from_rows(rows), y, config, None)["leadtime"]["ttft"][0]
    late = np.arange(len(rows)) >= 300
    assert np.median(mean[late & (y["ttft"] > 200)]) > 2.0 * np.median(mean[late & (y["ttft"] < 200)])


def test_label_delay_learns_a_row_only_after_that_many_later_rows_were_predicted(small_trace: Path) -> None:
    from leadtime.bench.accuracy import prequential_walk
    from leadtime.predictor.learner import LearnerConfig

    n, delay = 160, 40
    x, frame, y = _walk_inputs(small_trace, n)
    config = LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False)
    delayed = prequential_walk(x, frame, y, config, None, label_delay=delay)
    # Change the outcome of row k: no prediction up to row k + delay may move, and later ones must.
    k = 60
    changed = {t: v.copy() for t, v in y.items()}
    target = "ttft" if y["ttft"][k] > 0 else "tpot"
    changed[target][k] *= 50.0
    moved = prequential_walk(x, frame, changed, config, None, label_delay=delay)
    for model in ("leadtime", "median_baseline"):
        before, after = delayed[model][target][0], moved[model][target][0]
        assert (before[: k + delay + 1] == after[: k + delay + 1]).all(), model
        assert (before[k + delay + 1 :] != after[k + delay + 1 :]).any(), model
    # Nothing is learned before row `delay`: the median floor has seen nothing there.
    assert (delayed["median_baseline"]["ttft"][0][:delay] == 0).all()
    immediate = prequential_walk(x, frame, y, config, None)
    assert (immediate["median_baseline"]["ttft"][0][1:delay] != 0).any()


def _request_rows() -> list[dict]:
    """Four requests' rows in outcome order, with the arrivals and completions below (seconds); the TTFT and TPOT
    rows of a request carry its endpoint's state at arrival, but B's TPOT row another endpoint's (P/D's decode
    endpoint). A and D share a prompt length, and D completes first: only their states tell their rows apart.

    request  arrives  first token  completes  prompt
    A        0.0      1.0          5.0        900
    B        0.5      0.8          1.2        300
    C        2.0      2.5          3.0        500
    D        4.0      4.2          4.6        900
    """
    waiting = {"A": 0, "B": 1, "C": 2, "D": 3}
    prompt = {"A": 900, "B": 300, "C": 500, "D": 900}

    def row(request: str, stamp: float, ttft: float, tpot: float, decode: bool = False) -> dict:
        return {
            "kv_cache_percentage": 0.1,
            "input_token_length": prompt[request],
            "num_request_waiting": waiting[request] + (10 if decode else 0),
            "num_request_running": 2,
            "num_tokens_generated": 0,
            "prefix_cache_score": 0.0,
            "actual_ttft_ms": ttft,
            "actual_tpot_ms": tpot,
            "timestamp": stamp,
        }

    return [
        row("B", 0.8, 300.0, 0.0),
        row("A", 1.0, 1000.0, 0.0),
        row("B", 1.2, 0.0, 10.0, decode=True),
        row("C", 2.5, 500.0, 0.0),
        row("C", 3.0, 0.0, 20.0),
        row("D", 4.2, 200.0, 0.0),
        row("D", 4.6, 0.0, 30.0),
        row("A", 5.0, 0.0, 40.0),
    ]


def test_the_arrival_walk_predicts_each_row_knowing_only_outcomes_stamped_before_its_request_arrived() -> None:
    """The file-order walk predicted a row after learning outcomes of requests that completed after it arrived
    (a median of 764 per TTFT row on sim:pd), which a router never has."""
    import numpy as np

    from leadtime.bench.accuracy import arrival_schedule, prequential_walk, request_times
    from leadtime.features.vectorize import Vectorizer
    from leadtime.predictor.learner import LearnerConfig
    from leadtime.predictor.llmd_reference import LlmdFrame

    rows = _request_rows()
    times = request_times(rows, Path("hand.jsonl"), list(range(1, len(rows) + 1)))
    # A TPOT row arrives with its request: D's with D, not with A (the earlier TTFT row of its prompt length).
    assert times.arrival.tolist() == [0.5, 0.0, 0.5, 2.0, 2.0, 4.0, 4.0, 0.0]
    assert (times.tpot_by_state, times.tpot_by_length) == (3, 1)
    schedule = arrival_schedule(times.arrival, times.outcome)
    assert schedule == [
        *[("predict", i) for i in (1, 7, 0, 2)],  # A's and B's rows, at 0.0 and 0.5: nothing stamped yet
        *[("learn", i) for i in (0, 1, 2)],  # stamped 0.8, 1.0 and 1.2: before C arrives at 2.0
        *[("predict", i) for i in (3, 4)],
        *[("learn", i) for i in (3, 4)],  # 2.5 and 3.0: before D arrives at 4.0
        *[("predict", i) for i in (5, 6)],
    ]  # rows 5, 6 and 7 (4.2, 4.6, 5.0) are stamped after the last arrival: never learned
    y = {"ttft": np.array([r["actual_ttft_ms"] for r in rows]), "tpot": np.array([r["actual_tpot_ms"] for r in rows])}
    config = LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False)
    x = Vectorizer("h200-sxm", "qwen3-32b").batch_llmd(rows)
    walk = prequential_walk(x, LlmdFrame.from_rows(rows), y, config, None, schedule=schedule)
    floor = walk["median_baseline"]
    # The median floor shows what each model had learned: nothing before A and B; B's and A's first tokens and B's
    # completion before C; C's too before D (not D's own, nor A's completion at 5.0).
    assert floor["ttft"][0][[0, 1, 2, 7]].tolist() == [0.0] * 4
    assert floor["ttft"][0][[3, 4]].tolist() == [650.0, 650.0] and floor["tpot"][0][3] == 10.0
    assert floor["ttft"][0][[5, 6]].tolist() == [500.0, 500.0] and floor["tpot"][0][6] == 15.0
    assert np.isfinite(walk["leadtime"]["ttft"][0]).all() and np.isfinite(walk["llmd_reference"]["tpot"][0]).all()


def test_request_times_name_the_line_of_a_tpot_row_without_its_ttft_row() -> None:
    from leadtime.bench.accuracy import request_times

    rows = _request_rows()
    del rows[1]  # A's TTFT row: A's TPOT row (now line 7) has none left, D's having taken D's
    with pytest.raises(ValueError, match=r"hand.jsonl:7: a TPOT row with no TTFT row of its request"):
        request_times(rows, Path("hand.jsonl"), list(range(1, len(rows) + 1)))
    rows = _request_rows()
    del rows[3]["timestamp"]
    with pytest.raises(ValueError, match=r"hand.jsonl:4: no timestamp"):
        request_times(rows, Path("hand.jsonl"), list(range(1, len(rows) + 1)))


def test_the_second_half_is_of_the_rows_in_the_order_they_were_predicted() -> None:
    import numpy as np

    from leadtime.bench.accuracy import MODELS, TARGETS, summarize_walk

    y = {"ttft": np.full(4, 100.0), "tpot": np.full(4, 10.0)}
    off = np.array([200.0, 200.0, 100.0, 100.0])  # rows 0 and 1 predicted twice too high, rows 2 and 3 exactly
    walk = {m: {t: (off * (y[t][0] / 100.0), off) for t in TARGETS} for m in MODELS}
    in_file_order = summarize_walk(walk, y)["leadtime"]["ttft"]
    in_arrival_order = summarize_walk(walk, y, order=np.array([2, 3, 0, 1]))["leadtime"]["ttft"]
    assert in_file_order["prequential_mape_second_half"] == 0.0
    assert in_arrival_order["prequential_mape_second_half"] == 1.0
    assert in_file_order["prequential_mape"] == in_arrival_order["prequential_mape"] == 0.5


def test_accuracy_walks_a_timestamped_file_in_arrival_order(tmp_path: Path) -> None:
    """The whole command on a file of 40 requests (80 rows) with timestamps: the report says which walk it was."""
    rows = []
    for k in range(10):  # the hand-made requests again, 6 s later each time
        rows += [r | {"timestamp": r["timestamp"] + 6.0 * k} for r in _request_rows()]
    path = tmp_path / "stamped.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run_accuracy(path, "h200-sxm", "qwen3-32b", seeds=1, progress=False, speed_calls=50, label_delay="arrival")
    assert report["data"]["label_delay"] == "arrival"
    assert report["data"]["tpot_arrival_from_ttft_row"] == {"same_state": 30, "same_prompt_length": 10}
    assert report["median_baseline"]["ttft"]["prequential_mape"] > 0


def test_coverage_by_load_splits_each_feature_at_its_median() -> None:
    import numpy as np

    from leadtime.bench.accuracy import coverage_by_load
    from leadtime.predictor.llmd_reference import LlmdFrame

    n = 200
    rows = [
        {
            "kv_cache_percentage": i / n,
            "input_token_length": 100,
            "num_request_waiting": i,
            "num_request_running": 3,
            "num_tokens_generated": 0,
            "prefix_cache_score": 0.0,
            "actual_ttft_ms": 10.0,
            "actual_tpot_ms": 0.0,
        }
        for i in range(n)
    ]
    upper = np.where(np.arange(n) < n // 2, 20.0, 5.0)  # covers the low-load half only
    halves = coverage_by_load(LlmdFrame.from_rows(rows), upper, np.full(n, 10.0))
    assert halves["num_request_waiting"] == {"low": 1.0, "high": 0.0}
    assert "num_request_running" not in halves  # constant: no high half


def _rows_file(path: Path, count: int, **fields: object) -> list[dict]:
    rows = [json.loads(line) | fields for line in TRACE.read_text().splitlines()[:count]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_accuracy_says_how_many_rows_each_target_used_and_skipped(tmp_path: Path) -> None:
    """Rows with neither actual > 0 were left out of every figure without a word."""
    path = tmp_path / "some_unmeasured.jsonl"
    rows = _rows_file(path, 60)
    for row in rows[:5]:
        row["actual_ttft_ms"] = row["actual_tpot_ms"] = 0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ttft = sum(r["actual_ttft_ms"] > 0 for r in rows)
    tpot = sum(r["actual_tpot_ms"] > 0 for r in rows)
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(path), "--seeds", "1"])
    assert result.exit_code == 0, result.output
    printed = " ".join(result.output.split())
    assert f"60 rows: TTFT from {ttft}, TPOT from {tpot}, 5 with neither skipped" in printed
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(path), "--seeds", "1", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["data"]["rows"] == 60
    assert "warning:" in result.stderr and "5 of its 60 rows" in " ".join(result.stderr.split())


def test_accuracy_warns_of_rows_the_poisoning_guard_leaves_unlearned(tmp_path: Path) -> None:
    """Latencies in seconds: Leadtime's guard dropped 286 of 300 rows as implausible while the reference and the
    median baseline learned them, and the report, scored as usual, said nothing."""
    path = tmp_path / "seconds.jsonl"
    rows = _rows_file(path, 60)
    for row in rows[10:]:
        row["actual_ttft_ms"] /= 1000.0
        row["actual_tpot_ms"] /= 1000.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(path), "--seeds", "1", "--json"])
    assert result.exit_code == 0, result.output
    implausible = json.loads(result.stdout)["data"]["implausible"]
    assert 40 <= implausible <= 50, implausible
    said = " ".join(result.stderr.split())
    assert f"warning: {path}: {implausible} of its 60 rows" in said and "first at line 11" in said, said
    assert "milliseconds" in said


def test_accuracy_says_when_timestamps_run_against_the_file_order(tmp_path: Path) -> None:
    """The walk follows file order; a file whose timestamps run backwards was walked forwards without a word."""
    path = tmp_path / "reversed.jsonl"
    rows = _rows_file(path, 60)
    for i, row in enumerate(rows):
        row["timestamp"] = 1_800_000_000.0 - i
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(path), "--seeds", "1", "--json"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert f"warning: {path}:2: timestamp earlier than the row before it" in said and "file order" in said, said
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(path), "--seeds", "1", "--json"])
    assert "timestamp" not in result.stderr, result.stderr


def test_accuracy_takes_a_catalog_for_rows_of_a_class_not_built_in(tmp_path: Path, catalog_file: Path) -> None:
    """A B200 fleet's rows could not be judged: `--catalog` was refused here while serve, route, retrain and
    simulate take it."""
    path = tmp_path / "b200.jsonl"
    _rows_file(path, 60, accelerator="b200")
    args = ["bench", "accuracy", "--data", str(path), "--seeds", "1", "--json"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "unknown accelerator class 'b200'" in " ".join(refused.output.split())
    result = CliRunner().invoke(app, [*args, "--catalog", str(catalog_file), "--accelerator", "l4"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["data"]["accelerator"] == "b200"


def test_accuracy_refuses_a_file_without_a_measured_row(tmp_path: Path) -> None:
    """It printed a table of dashes and exited 0."""
    path = tmp_path / "unmeasured.jsonl"
    _rows_file(path, 40, actual_ttft_ms=0, actual_tpot_ms=0)
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(path), "--json"])
    assert result.exit_code == 2, result.output
    assert str(path) in result.output and "none of its 40 rows" in result.output


def test_accuracy_reports_the_hardware_the_rows_name_not_the_flags(tmp_path: Path) -> None:
    """Rows naming their accelerator and model are vectorized as theirs; the report gave the flags' values."""
    path = tmp_path / "h100.jsonl"
    _rows_file(path, 60, accelerator="h100-sxm", model="llama-3.1-8b")
    report = run_accuracy(path, accelerator="h200-sxm", model="qwen3-32b", seeds=1, progress=False, speed_calls=50)
    assert (report["data"]["accelerator"], report["data"]["model"]) == ("h100-sxm", "llama-3.1-8b")


def test_accuracy_names_the_line_of_a_row_with_an_unknown_accelerator(tmp_path: Path) -> None:
    """It said `rows[49].accelerator` (an index from 0, no file)."""
    path = tmp_path / "bad_accelerator.jsonl"
    rows = _rows_file(path, 60)
    rows[49]["accelerator"] = "h100"
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))  # a blank first line: line 51
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(path), "--json"])
    assert result.exit_code == 2, result.output
    assert f"{path}:51: accelerator: unknown accelerator class 'h100'" in " ".join(result.output.split())


def test_accuracy_names_the_line_of_an_actual_too_large_for_the_references_trees(tmp_path: Path) -> None:
    """An actual of 1e308 (finite, warned of as implausible) ended the run in XGBoost's native stack trace, `Label
    contains NaN, infinity or a value too large`, naming neither the line nor the field."""
    path = tmp_path / "huge.jsonl"
    rows = _rows_file(path, 40)
    rows[3]["actual_ttft_ms"] = 1e308
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["bench", "accuracy", "--data", str(path), "--seeds", "1", "--json"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert f"error: {path}:4: actual_ttft_ms:" in said and "1e+308" in said, said
    assert "[bt]" not in said and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_coldstart_table_names_the_model_the_llmd_reference_ran(capsys: pytest.CaptureFixture[str]) -> None:
    """Its rows said `llmd_reference` whichever model ran (`--reference-model lightgbm`, or LightGBM where xgboost
    is not installed, beside the README's XGBoost figures), as the accuracy table once did."""
    from leadtime.bench.coldstart import print_report

    figures = {"mape_first_50": 0.5, "mape_after_500": 0.25}
    report = {
        "unseen_class": "mi300x",
        "seen_classes": ["h100-sxm", "a100-sxm-80gb"],
        "reference_model": "lightgbm",
        "leadtime": {"ttft": figures, "tpot": figures},
        "llmd_reference": {"ttft": figures, "tpot": figures},
    }
    print_report(report, as_json=False)
    assert "llmd_reference: lightgbm" in " ".join(capsys.readouterr().out.split())
