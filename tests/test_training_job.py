"""The retraining job end to end: champion/challenger both ways, the registry round trip through the service's own
loader (directory and Redis), the report files, the CLI's exit codes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightgbm as lgb
import numpy as np
import pytest
from fastapi.testclient import TestClient
from redis_server import free_port
from typer.testing import CliRunner
from waiting import wait_until

from leadtime.bench.retrain import write_simulator_log
from leadtime.cli import app
from leadtime.features.catalog_file import load_catalog
from leadtime.features.rows import ROUTED_BY_FIELD, EndpointState, FeatureRow, RequestFeatures
from leadtime.features.vectorize import Vectorizer
from leadtime.predictor.artifact import FILE_NAME, load_file
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings
from leadtime.predictor.trees import TREE_FEATURES
from leadtime.training import job as job_module
from leadtime.training.champion import Evaluation, Scores, decide, evaluate
from leadtime.training.job import EXIT_KEPT, EXIT_PUBLISHED, RETRAIN_KEY, RetrainConfig, RetrainError, run_retrain
from leadtime.training.registry import DirectoryRegistry, Published
from leadtime.training.report import CHAMPION_IN_SAMPLE
from leadtime.training.sources import SampleReader
from leadtime.training.split import split_recent

ROW_KEYS = ("actual_ttft_ms", "actual_tpot_ms", "timestamp", "policy")

REPORT_FILES = [
    "calibration.png",
    "error_by_class.png",
    "feature_importances.png",
    "predicted_vs_actual.png",
    "report.json",
    "report.md",
]
"""A report directory's files, sorted: report.json, report.md and the four plots."""


@pytest.fixture(scope="module")
def sim_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """1,500 observations of the mixed H100/A100/L40S fleet (the simulator's observation log)."""
    path = tmp_path_factory.mktemp("sim") / "observations.jsonl"
    write_simulator_log(path, requests=1500)
    return path


@pytest.fixture(scope="module")
def prefill_log(sim_log: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same observations from a fleet that observes only TTFT (a prefill-only pool: every TPOT is 0)."""
    path = tmp_path_factory.mktemp("prefill") / "observations.jsonl"
    rows = [{**json.loads(line), "actual_tpot_ms": 0.0} for line in sim_log.read_text().splitlines()]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def strict_json(text: str) -> Any:
    """JSON as strict readers (jq, JavaScript) take it: NaN and Infinity are not JSON."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def rows_of(log: Path, n: int) -> list[dict[str, Any]]:
    """The first `n` rows of the log as the native API's prediction rows."""
    with log.open() as f:
        return [{k: v for k, v in json.loads(next(f)).items() if k not in ROW_KEYS} for _ in range(n)]


def served_equals(client: TestClient, predictor: OnlinePredictor, rows: list[dict[str, Any]]) -> None:
    """The service's answers for `rows` are the predictor's, to the last bits JSON keeps."""
    answer = client.post("/v1/predict", json={"rows": rows})
    assert answer.status_code == 200, answer.text
    served = answer.json()
    batch = SampleReader(predictor.config.accelerator, predictor.config.model).parser.parse(rows)
    expected = predictor.predict_many(batch)
    assert served["model_version"] == predictor.version
    for name in ("ttft_mean", "ttft_quantile", "tpot_mean", "tpot_quantile"):
        assert np.allclose(served[f"{name}_ms"], getattr(expected, name), rtol=1e-12), name


def test_an_empty_registry_publishes_what_was_judged_and_the_service_loads_it(sim_log: Path, tmp_path: Path) -> None:
    registry, report_dir = tmp_path / "models", tmp_path / "report"
    result = run_retrain(RetrainConfig(samples=(str(sim_log),), registry=str(registry), report_dir=report_dir))
    assert result.exit_code == EXIT_PUBLISHED and result.published_version == 1
    assert (
        result.report["outcome"] == "published" and result.report["decision"]["reason"] == "the registry holds no model"
    )
    published = OnlinePredictor.from_bytes(load_file(registry), background=False)
    assert published.version == 1 and published.metadata[RETRAIN_KEY]["history_rows"] == 1200
    # What is published is what was judged: its scores on the evaluation slice are the report's.
    samples = SampleReader("h100-sxm", "llama-3.1-8b").read([str(sim_log)])
    split = split_recent(samples.timestamps, 0.2)
    actual = {"ttft": samples.actual_ttft_ms[split.evaluation], "tpot": samples.actual_tpot_ms[split.evaluation]}
    again = evaluate(published, samples.batch[split.evaluation], actual)
    for target in ("ttft", "tpot"):
        assert again.overall[target].mape == result.report["evaluation"]["challenger"][target]["mape"]
    # The service started with --model-dir on that directory serves exactly this model.
    with TestClient(create_app(ServiceSettings(model_dir=registry, grpc_port=0))) as client:
        assert client.get("/status").json()["model_version"] == 1
        served_equals(client, published, rows_of(sim_log, 25))
    # The report: JSON, Markdown and the four plots.
    names = sorted(p.name for p in report_dir.iterdir())
    assert names == REPORT_FILES
    for png in report_dir.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    report = json.loads((report_dir / "report.json").read_text())
    assert report["samples"]["rows"] == 1500 and report["samples"]["ordered_by"] == "timestamp"
    groups = report["evaluation"]["challenger"]["ttft"]["by_group"]
    assert set(groups) == {"h100-sxm/both", "a100-sxm-80gb/both", "l40s/both"}
    assert sum(g["rows"] for g in groups.values()) == report["evaluation"]["challenger"]["ttft"]["rows"]
    assert "**Published** as version 1" in (report_dir / "report.md").read_text()
    assert CHAMPION_IN_SAMPLE not in (report_dir / "report.md").read_text()  # no champion, nothing it learned


def test_a_challenger_no_better_than_the_champion_is_not_published(sim_log: Path, tmp_path: Path) -> None:
    config = RetrainConfig(samples=(str(sim_log),), registry=str(tmp_path))
    assert run_retrain(config).exit_code == EXIT_PUBLISHED
    before = (tmp_path / FILE_NAME).read_bytes()
    result = run_retrain(config)
    assert result.exit_code == EXIT_KEPT and result.published_version is None
    assert result.report["outcome"] == "kept"
    # None of its trees beat the champion's own on the history's recent block: it is the champion, again.
    assert result.report["decision"]["unchanged"] == ["ttft", "tpot"]
    assert result.report["decision"]["reason"].startswith("the champion stays (the challenger is its equal")
    assert result.report["registry"]["champion_version"] == 1
    assert (tmp_path / FILE_NAME).read_bytes() == before


def stale_champion(log: Path, version: int) -> OnlinePredictor:
    """A model left behind by its fleet: it learned these requests when they took three times as long."""
    samples = SampleReader("h100-sxm", "llama-3.1-8b").read([str(log)])
    champion = OnlinePredictor(LearnerConfig(background=False, retrain=False))
    champion.learn_many(samples.batch, 3 * samples.actual_ttft_ms, 3 * samples.actual_tpot_ms)
    champion.version = version
    return champion


def test_a_challenger_that_wins_both_targets_is_published(sim_log: Path, tmp_path: Path) -> None:
    stale_champion(sim_log, version=4).save(tmp_path)
    result = run_retrain(RetrainConfig(samples=(str(sim_log),), registry=str(tmp_path)))
    assert result.exit_code == EXIT_PUBLISHED and result.published_version == 5
    evaluation = result.report["evaluation"]
    for target in ("ttft", "tpot"):
        old, new = evaluation["champion"][target], evaluation["challenger"][target]
        assert new["mape"] <= 0.98 * old["mape"] and new["pinball"] <= old["pinball"]
    assert result.report["decision"]["wins"] == {"ttft": True, "tpot": True}
    published = OnlinePredictor.load(tmp_path, background=False)
    assert published.version == 5 and published.metadata[RETRAIN_KEY]["based_on_version"] == 4


def scores(mape: float, pinball: float, rows: int = 100) -> Scores:
    return Scores(rows, mape, mape, pinball, 0.9)


def evaluation_of(ttft: Scores, tpot: Scores) -> Evaluation:
    return Evaluation({"ttft": ttft, "tpot": tpot}, {"ttft": {}, "tpot": {}}, {})


def test_the_decision_needs_both_targets_better_by_the_margin_and_no_worse_quantile() -> None:
    champion = evaluation_of(scores(0.20, 0.05), scores(0.10, 0.02))
    assert decide(None, champion, 0.02).publish
    assert decide(champion, evaluation_of(scores(0.19, 0.05), scores(0.09, 0.02)), 0.02).publish
    assert decide(champion, evaluation_of(scores(0.19, 0.05), scores(0.09, 0.02)), 0.10).wins == {
        "ttft": False,
        "tpot": True,
    }
    worse_quantile = decide(champion, evaluation_of(scores(0.15, 0.051), scores(0.05, 0.01)), 0.02)
    assert not worse_quantile.publish and worse_quantile.wins == {"ttft": False, "tpot": True}
    assert "ttft: MAPE 0.2000 → 0.1500" in worse_quantile.reason and "(worse)" in worse_quantile.reason
    # A target no row of the slice observed is left out: the challenger is judged on the other...
    unjudged = decide(champion, evaluation_of(scores(0.1, 0.01), scores(0.05, 0.01, rows=0)), 0.02)
    assert unjudged.publish and unjudged.wins == {"ttft": True}
    assert "tpot: not judged (no row of the evaluation slice observed it)" in unjudged.reason
    lost = decide(champion, evaluation_of(scores(0.2, 0.06), scores(0.05, 0.01, rows=0)), 0.02)
    assert not lost.publish and lost.wins == {"ttft": False}
    # ...and with neither judged, it is not published.
    nothing = decide(champion, evaluation_of(scores(0.1, 0.01, rows=0), scores(0.05, 0.01, rows=0)), 0.02)
    assert not nothing.publish and nothing.wins == {}
    assert nothing.reason.startswith("the champion stays: no target can be judged")
    # A margin of 0 publishes a challenger better on one target and the champion's equal on the other...
    assert decide(champion, evaluation_of(scores(0.15, 0.05), scores(0.10, 0.02)), 0.0).publish
    # ...but not the champion's equal on both (nothing would change but the version).
    tie = decide(champion, champion, 0.0)
    assert not tie.publish and tie.wins == {"ttft": True, "tpot": True}
    assert tie.reason.startswith("the champion stays (the challenger is its equal on both targets)")


@pytest.mark.parametrize(
    ("margin", "new_mape", "said"),
    [
        (0.005, 0.0997, "MAPE 0.1000 → 0.0997 (0.3% better, less than the 0.5% margin)"),
        (0.015, 0.0986, "MAPE 0.1000 → 0.0986 (1.4% better, less than the 1.5% margin)"),
        (0.005, 0.09951, "(0.49% better, less than the 0.5% margin)"),  # as many decimals as it takes to be true
        (0.02, 0.0950, "(5.0% better, at least the 2% margin)"),
        (0.02, 0.1000, "(no better, the margin asks 2% better)"),
        (0.02, 0.1100, "(10.0% worse, the margin asks 2% better)"),
    ],
)
def test_the_decision_states_the_margin_as_given(margin: float, new_mape: float, said: str) -> None:
    """The margin was rounded to a whole percent: "0.3% lower ... (< 0% better)" for a margin of 0.5%."""
    champion = evaluation_of(scores(0.1, 0.05), scores(0.1, 0.05))
    decision = decide(champion, evaluation_of(scores(new_mape, 0.05), scores(0.09, 0.05)), margin)
    assert said in decision.reason, decision.reason


class MovingRegistry(DirectoryRegistry):
    """A directory registry to which the service publishes another model while the job runs."""

    def __init__(self, directory: Path, meanwhile: OnlinePredictor) -> None:
        super().__init__(directory)
        self.meanwhile = meanwhile
        self.reads = 0

    def latest(self) -> Published | None:
        self.reads += 1
        if self.reads == 2:  # after the job read its champion, before it publishes
            self.meanwhile.save(self.directory)
        return super().latest()


def test_a_registry_that_moved_on_during_the_job_is_judged_against_again(
    sim_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = MovingRegistry(tmp_path, stale_champion(sim_log, version=7))
    monkeypatch.setattr(job_module, "open_registry", lambda spec: registry)
    result = run_retrain(RetrainConfig(samples=(str(sim_log),), registry=str(tmp_path)))
    assert result.report["registry"]["champion_version"] is None
    assert result.report["registry"]["judged_again_against_version"] == 7
    assert "champion" in result.report["evaluation"]  # judged against the model published meanwhile
    assert result.report["decision"]["wins"] == {"ttft": True, "tpot": True}
    assert result.exit_code == EXIT_PUBLISHED and result.published_version == 8
    assert OnlinePredictor.load(tmp_path, background=False).version == 8


def test_the_redis_registry_round_trips_through_a_running_service(sim_log: Path, redis_url: str) -> None:
    settings = ServiceSettings(redis_url=redis_url, grpc_port=0)
    with TestClient(create_app(settings)) as client:
        runtime = client.app.state.runtime  # type: ignore[attr-defined]
        assert client.get("/status").json()["model_version"] == 0
        result = run_retrain(RetrainConfig(samples=(str(sim_log),), registry=redis_url))
        assert result.exit_code == EXIT_PUBLISHED and result.published_version == 1
        # Every replica swaps a published model in within a second (pub/sub); allow a loaded machine more.
        assert wait_until(lambda: runtime.store_version == 1, timeout_s=30)
        served_equals(client, result.challenger, rows_of(sim_log, 25))
        kept = run_retrain(RetrainConfig(samples=(str(sim_log),), registry=redis_url))
        assert kept.exit_code == EXIT_KEPT and runtime.store.latest_model()[0] == 1


def test_the_cli_exit_status_says_what_happened(sim_log: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["retrain", "--samples", str(sim_log), "--registry", str(tmp_path / "models"), "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["outcome"] == "published"
    second = runner.invoke(app, args)
    assert second.exit_code == 3 and json.loads(second.stdout)["outcome"] == "kept"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(["{}"] * 5) + "\n")
    refused = runner.invoke(app, ["retrain", "--samples", str(bad), "--registry", str(tmp_path / "models")])
    assert refused.exit_code == 2
    assert refused.output.strip().splitlines() == [
        f"error: {bad}: 5 of 5 rows are malformed (100.0% > the 1.0% allowed; first: line 1: actual_ttft_ms: is "
        "required)"
    ]
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    wrong = runner.invoke(app, ["retrain", "--samples", str(sim_log), "--registry", str(not_a_dir)])
    assert wrong.exit_code == 2 and "not a directory" in wrong.output


EARLIER_REPORT = '{"outcome": "kept", "note": "report of an earlier run"}\n'


@pytest.mark.usefixtures("ctrl_c_as_a_terminal_gives_it")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_after_publishing_says_so_and_leaves_the_earlier_report_whole(
    sim_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: int
) -> None:
    """Ctrl-C while the report was drawn, the model already published, exited 130 without a word: cron took it
    for a run that did nothing, while the report directory held the earlier run's report.json beside this run's
    first plots. SIGTERM (a scheduler's timeout) ended it at once, with no word either."""
    from leadtime.training import report as report_module

    def test_handler(number: int, frame: Any) -> None:
        raise RuntimeError("SIGTERM reached the test's own handler: the command installed none")

    before = signal.signal(signal.SIGTERM, test_handler)
    importances = report_module._importances

    def interrupted(*args: Any) -> Path:
        os.kill(os.getpid(), signum)
        return importances(*args)

    monkeypatch.setattr(report_module, "_importances", interrupted)  # the last plot drawn
    registry, report_dir = tmp_path / "models", tmp_path / "report"
    report_dir.mkdir()
    (report_dir / "report.json").write_text(EARLIER_REPORT)
    try:
        args = ["retrain", "--samples", str(sim_log), "--registry", str(registry), "--report", str(report_dir)]
        done = CliRunner().invoke(app, args)
        assert signal.getsignal(signal.SIGTERM) is test_handler  # the command's own handler is taken back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert done.exit_code == 128 + signum, (done.exit_code, done.output, done.exception)
    assert done.stderr.splitlines() == [
        f"error: interrupted after publishing version 1 to {registry}, which is live; no report of this run was "
        f"written ({report_dir} is as it was)"
    ]
    assert OnlinePredictor.load(registry, background=False).version == 1
    assert [p.name for p in report_dir.iterdir()] == ["report.json"]  # no plot of this run, no folder left
    assert (report_dir / "report.json").read_text() == EARLIER_REPORT


@pytest.mark.usefixtures("ctrl_c_as_a_terminal_gives_it")
def test_ctrl_c_while_the_report_is_moved_into_place_waits_until_it_all_is(
    sim_log: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report is drawn in a folder of its own and moved into place at once: an interrupt then is acted on
    once every file is in place, so that the directory never holds part of one report and part of another."""
    replace = os.replace
    report_dir = tmp_path / "report"

    def interrupted(source: Any, destination: Any) -> None:
        if Path(destination).parent == report_dir:
            os.kill(os.getpid(), signal.SIGINT)
        replace(source, destination)

    monkeypatch.setattr(os, "replace", interrupted)
    report_dir.mkdir()
    (report_dir / "report.json").write_text(EARLIER_REPORT)
    registry = tmp_path / "models"
    args = ["retrain", "--samples", str(sim_log), "--registry", str(registry), "--report", str(report_dir)]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 130, (done.output, done.exception)
    assert done.stderr.splitlines() == [
        f"error: interrupted after publishing version 1 to {registry}, which is live; its report is in {report_dir}"
    ]
    assert sorted(p.name for p in report_dir.iterdir()) == REPORT_FILES
    assert json.loads((report_dir / "report.json").read_text())["registry"]["published_version"] == 1


def test_options_that_disagree_with_the_champion_are_refused(sim_log: Path, tmp_path: Path) -> None:
    OnlinePredictor(LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False)).save(tmp_path)
    with pytest.raises(RetrainError, match="--model llama-3.1-8b disagrees with the registry's model"):
        run_retrain(RetrainConfig(samples=(str(sim_log),), registry=str(tmp_path), model="llama-3.1-8b"))


def test_a_report_that_cannot_be_written_stops_the_job_before_anything_is_published(
    sim_log: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    config = RetrainConfig(samples=(str(sim_log),), registry=str(tmp_path / "models"), report_dir=blocker / "report")
    with pytest.raises(RetrainError, match=r"the report directory .* is not a directory \(.* is a file\)"):
        run_retrain(config)
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("champion", [False, True])
def test_an_existing_report_directory_that_takes_no_file_stops_the_job_before_it_reads(
    sim_log: Path, tmp_path: Path, champion: bool
) -> None:
    """Only a missing parent was caught: an existing directory that takes no file (read-only, or /proc, where
    nothing can be made even as root) failed after the model was published (or the champion kept), exit 2."""
    registry = tmp_path / "models"
    if champion:
        stale_champion(sim_log, version=4).save(registry)
    before = sorted(registry.iterdir()) if champion else None
    missing = tmp_path / "no-such-source.jsonl"  # read first, this would be the error
    config = RetrainConfig(samples=(str(missing),), registry=str(registry), report_dir=Path("/proc"))
    with pytest.raises(RetrainError, match=r"^the report directory '/proc' cannot be written \("):
        run_retrain(config)
    assert (sorted(registry.iterdir()) if champion else None) == before
    refused = CliRunner().invoke(
        app, ["retrain", "--samples", str(sim_log), "--registry", str(registry)] + ["--report", "/proc"]
    )
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert (
        OnlinePredictor.load(registry, background=False).version == 4
        if champion
        else not registry.joinpath(FILE_NAME).exists()
    )


def test_a_registry_directory_that_cannot_be_made_stops_the_job_before_it_reads(tmp_path: Path) -> None:
    """It read and fitted everything first, then could not publish."""
    missing = tmp_path / "no-such-source.jsonl"  # read first, this would be the error
    with pytest.raises(RetrainError, match="cannot be written"):
        run_retrain(RetrainConfig(samples=(str(missing),), registry="/proc/leadtime-registry"))


def test_an_unreachable_redis_registry_is_one_line(sim_log: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    refused = CliRunner().invoke(app, ["retrain", "--samples", str(sim_log), "--registry", url])
    assert refused.exit_code == 2
    (line,) = refused.output.strip().splitlines()
    assert line.startswith(f"error: {url} (leadtime): unreachable (") and "buffered" not in line
    # As a process, outside pytest's log capture: the store's own warning came first, on a line of its own.
    process = subprocess.run(
        [sys.executable, "-m", "leadtime", "retrain", "--samples", str(sim_log), "--registry", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 2 and len(process.stderr.strip().splitlines()) == 1, process.stderr


def test_a_redis_on_a_unix_socket_serves_as_source_and_registry(
    sim_log: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`unix:///path` lost a slash on its way (`unix:/path`) and redis-py refused it."""
    from redis_server import RedisServer, find_redis_server

    from leadtime.predictor.store.redis_store import RedisStore

    executable = find_redis_server()
    assert executable is not None
    workdir = tmp_path_factory.mktemp("unix")
    socket_path = workdir / "r.sock"
    server = RedisServer(executable, workdir, extra_args=["--unixsocket", str(socket_path), "--unixsocketperm", "700"])
    server.start()
    try:
        url = f"unix://{socket_path}"
        store = RedisStore(url)
        store.append_observations([json.loads(line) for line in sim_log.read_text().splitlines()])
        store.close(flush_timeout_s=10.0)
        result = run_retrain(RetrainConfig(samples=(url,), registry=url))
        assert result.exit_code == EXIT_PUBLISHED and result.published_version == 1
        assert result.report["samples"]["sources"][0]["used"] == 1500
    finally:
        server.stop()


def test_a_password_given_as_a_query_parameter_is_in_no_artifact_report_or_output(
    sim_log: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`?password=` (a Unix socket's URL has no other place for it) was written into the published model's
    metadata, which any client of a service can download from /v1/model, into report.json and report.md, and
    into the printed result."""
    from redis_server import RedisServer, find_redis_server

    from leadtime.training.registry import RedisRegistry

    executable = find_redis_server()
    assert executable is not None
    workdir = tmp_path_factory.mktemp("password")
    server = RedisServer(
        executable, workdir, extra_args=["--requirepass", "s3cret-pw"], client_options={"password": "s3cret-pw"}
    )
    server.start()
    try:
        url = f"redis://127.0.0.1:{server.port}/0?password=s3cret-pw"
        fill_stream(url, sim_log)
        report_dir = tmp_path_factory.mktemp("report")
        args = ["retrain", "--samples", url, "--registry", url, "--report", str(report_dir)]
        done = CliRunner().invoke(app, args)
        assert done.exit_code == EXIT_PUBLISHED, done.output
        assert f"127.0.0.1:{server.port}/0" in done.stdout and "s3cret" not in done.output
        for path in report_dir.iterdir():
            assert b"s3cret" not in path.read_bytes(), path.name
        with contextlib.closing(RedisRegistry(url)) as registry:
            latest = registry.latest()
        assert latest is not None and b"s3cret" not in latest.artifact
        assert OnlinePredictor.from_bytes(latest.artifact, background=False).metadata[RETRAIN_KEY]["sources"] == [
            f"redis://127.0.0.1:{server.port}/0 (leadtime)"
        ]
    finally:
        server.stop()


@pytest.mark.parametrize("option", ["--samples", "--registry"])
def test_a_redis_url_with_a_parameter_redis_does_not_know_is_one_line_naming_it(
    sim_log: Path, option: str, tmp_path: Path
) -> None:
    """redis-py passes unknown query parameters on to its connection, which raised a TypeError: a traceback."""
    url = f"redis://127.0.0.1:{free_port()}/0?foo=bar"
    # The registry directory is made before the sources are read: in the test's own folder, not the checkout.
    args = {"--samples": str(sim_log), "--registry": str(tmp_path / "registry")} | {option: url}
    refused = CliRunner().invoke(app, ["retrain", "--samples", args["--samples"], "--registry", args["--registry"]])
    assert refused.exit_code == 2, refused.output
    (line,) = refused.output.strip().splitlines()
    assert line.startswith("error: ") and "'foo'" in line, line


def test_a_target_no_evaluation_row_observed_is_null_in_the_report_not_nan(prefill_log: Path, tmp_path: Path) -> None:
    """report.json and --json printed bare NaN for its figures: not JSON, refused by strict readers."""
    report_dir = tmp_path / "report"
    args = ["retrain", "--samples", str(prefill_log), "--registry", str(tmp_path / "models"), "--json"]
    result = CliRunner().invoke(app, [*args, "--report", str(report_dir)])
    assert result.exit_code == 0, result.output
    for text in (result.stdout, (report_dir / "report.json").read_text()):
        tpot = strict_json(text)["evaluation"]["challenger"]["tpot"]
        assert tpot["rows"] == 0 and tpot["mape"] is None and tpot["pinball"] is None
    assert "| challenger | tpot | 0 | – |" in (report_dir / "report.md").read_text()


def test_a_fleet_that_observes_one_target_is_judged_on_it(prefill_log: Path, tmp_path: Path) -> None:
    """A prefill-only pool could never publish after its first model: the TPOT nobody observed counted as lost."""
    stale_champion(prefill_log, version=2).save(tmp_path)
    result = run_retrain(RetrainConfig(samples=(str(prefill_log),), registry=str(tmp_path)))
    assert result.exit_code == EXIT_PUBLISHED and result.published_version == 3
    decision = result.report["decision"]
    assert decision["wins"] == {"ttft": True}
    assert decision["reason"].startswith("the challenger wins the one target judged")
    assert "tpot: not judged (no row of the evaluation slice observed it)" in decision["reason"]


def test_the_jobs_label_is_dropped_once_the_service_retrains_trees_of_its_own(sim_log: Path, tmp_path: Path) -> None:
    """Models the service saved after many retrains of its own still named the job's sources and time."""
    assert run_retrain(RetrainConfig(samples=(str(sim_log),), registry=str(tmp_path))).exit_code == EXIT_PUBLISHED
    served = OnlinePredictor.load(tmp_path, background=False)
    label = served.metadata[RETRAIN_KEY]
    kept = served.retrain_now()  # the job's trees stay: the label still describes them
    assert not any(kept[t]["accepted_mean"] or kept[t]["accepted_upper"] for t in ("ttft", "tpot"))
    assert served.metadata[RETRAIN_KEY] == label
    samples = SampleReader("h100-sxm", "llama-3.1-8b").read([str(sim_log)])
    served.learn_many(samples.batch, 1.3 * samples.actual_ttft_ms, 0.8 * samples.actual_tpot_ms)  # the fleet moved
    replaced = served.retrain_now()
    assert any(replaced[t]["accepted_mean"] or replaced[t]["accepted_upper"] for t in ("ttft", "tpot"))
    assert RETRAIN_KEY not in served.metadata
    assert RETRAIN_KEY not in OnlinePredictor.from_bytes(served.to_bytes(), background=False).metadata


def test_the_cli_keeps_lightgbms_warnings_off_stderr(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """--dask printed "Parameter n_jobs will be ignored." 48 times a run: the CLI sent LightGBM's log to a logger
    without a handler, whose warnings Python's last-resort handler prints on stderr."""
    from lightgbm.basic import _log_warning

    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    assert CliRunner().invoke(app, ["retrain", "--samples", str(bad), "--registry", str(tmp_path / "m")]).exit_code == 2
    capfd.readouterr()
    _log_warning("Parameter n_jobs will be ignored.")  # what LightGBM's Dask estimator says at every fit
    assert not [r for r in caplog.records if r.name == "lightgbm"]
    assert "will be ignored" not in capfd.readouterr().err


def test_a_target_the_evaluation_slice_cannot_judge_keeps_the_champions_trees(sim_log: Path, tmp_path: Path) -> None:
    """History rows observed TPOT, the evaluation slice did not: the challenger's TPOT trees, never compared with
    the champion's, replaced them when it won on TTFT."""
    champion = stale_champion(sim_log, version=2)
    rng = np.random.default_rng(0)
    x = rng.random((200, len(TREE_FEATURES)))
    booster = lgb.train(
        {"objective": "regression", "verbose": -1, "num_leaves": 4},
        lgb.Dataset(x, rng.random(200), feature_name=list(TREE_FEATURES)),
        num_boost_round=3,
    )
    champion.install_trees("tpot", booster, None, 0.0, np.zeros(64))
    champion.save(tmp_path / "models")
    kept = champion.tree_text("tpot")
    assert kept is not None
    rows = [json.loads(line) for line in sim_log.read_text().splitlines()]
    recent = np.quantile([r["timestamp"] for r in rows], 0.7)  # the evaluation slice is the most recent 20%
    log = tmp_path / "observations.jsonl"
    log.write_text(
        "".join(json.dumps({**r, "actual_tpot_ms": 0.0} if r["timestamp"] >= recent else r) + "\n" for r in rows)
    )
    result = run_retrain(RetrainConfig(samples=(str(log),), registry=str(tmp_path / "models")))
    assert result.exit_code == EXIT_PUBLISHED and result.report["decision"]["wins"] == {"ttft": True}
    assert any(result.report["training"]["targets"]["tpot"]["accepted"].values())  # TPOT trees were fitted
    published = OnlinePredictor.load(tmp_path / "models", background=False)
    assert published.tree_text("tpot") == kept
    assert published.tree_text("ttft") != champion.tree_text("ttft")


def test_a_catalog_of_the_fleets_own_classes_trains_a_model_that_carries_it(
    sim_log: Path, tmp_path: Path, catalog_file: Path
) -> None:
    """The L40S rows relabelled as a class only the catalog knows (L4): without the catalog they are malformed
    rows, with it the model is published carrying the catalog, and a later job without it is refused by name."""
    l4_log = tmp_path / "l4.jsonl"
    rows = [json.loads(line) for line in sim_log.read_text().splitlines()]
    for row in rows:
        if row["accelerator"] == "l40s":
            row["accelerator"] = "l4"
    l4_log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    registry = tmp_path / "models"
    runner = CliRunner()
    base = ["retrain", "--samples", str(l4_log), "--registry", str(registry)]

    without = runner.invoke(app, base)
    assert without.exit_code == 2 and "unknown accelerator class 'l4'" in without.output, without.output

    published = runner.invoke(app, [*base, "--catalog", str(catalog_file), "--accelerator", "b200", "--json"])
    assert published.exit_code == 0, published.output
    model = OnlinePredictor.from_bytes(load_file(registry), background=False)
    assert model.config.catalog == load_catalog(catalog_file) and model.config.accelerator == "b200"

    forgot = runner.invoke(app, ["retrain", "--samples", str(sim_log), "--registry", str(registry)])
    assert forgot.exit_code == 2 and len(forgot.output.splitlines()) == 1, forgot.output
    assert "the registry's model was trained with another catalog" in forgot.output
    assert "accelerator class 'b200' is unknown here" in forgot.output and "--catalog" in forgot.output

    bad = tmp_path / "bad.yaml"
    bad.write_text("accelerators: [{slug: l4}]\n")
    refused = runner.invoke(app, [*base, "--catalog", str(bad)])
    assert refused.exit_code == 2 and refused.output.startswith(f"error: --catalog: {bad}: accelerators[0]")


def test_a_source_given_twice_is_refused_before_anything_is_read(sim_log: Path, tmp_path: Path) -> None:
    """Its rows counted twice ("3000 rows used" of a 1,500-row log), without a word."""
    twice = (str(sim_log), str(sim_log.parent / ".." / sim_log.parent.name / sim_log.name))
    with pytest.raises(ValueError, match="is given twice"):
        RetrainConfig(samples=twice, registry=str(tmp_path / "models"))
    result = CliRunner().invoke(app, ["retrain", "--samples", str(sim_log), "--samples", str(sim_log), "--registry",
                                      str(tmp_path / "models")])  # fmt: skip
    assert result.exit_code == 2 and "is given twice" in result.output and len(result.output.splitlines()) == 1


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("redis://cache.example:6379/0", "redis://cache.example"),  # the default port and database
        ("redis://Cache.Example/0/", "redis://cache.example:6379/0"),  # a host name's case, a trailing slash
        ("redis://cache.example/0", "redis://cache.example/0?namespace=leadtime"),  # the default namespace
        ("redis://cache.example/3", "redis://:secret@cache.example/0?db=3&socket_timeout=5"),  # how, not where
        ("unix:///run/redis.sock", "unix:///run/redis.sock?db=0&password=secret"),
    ],
)
def test_one_stream_spelt_two_ways_is_refused_as_given_twice(tmp_path: Path, one: str, other: str) -> None:
    """Only files were compared as what they are: the stream given as `redis://h/0` and `redis://h` was read twice,
    so every row counted twice and every row of the evaluation slice was also a history row the trees fitted."""
    with pytest.raises(ValueError, match="is given twice") as refused:
        RetrainConfig(samples=(one, other), registry=str(tmp_path / "models"))
    assert "secret" not in str(refused.value)
    # Streams that may be others are not refused: another namespace, another host name (nothing is resolved).
    RetrainConfig(samples=(one, f"{one}?namespace=fleet-b"), registry=str(tmp_path / "models"))
    RetrainConfig(samples=("redis://localhost/0", "redis://127.0.0.1/0"), registry=str(tmp_path / "models"))


@pytest.mark.parametrize(
    ("samples", "registry", "said"),
    [
        (["redis://:s3cret-pw@127.0.0.1:42601/0"] * 2, "models", "is given twice"),
        (["unix:///run/r.sock?password=s3cret-pw"] * 2, "models", "is given twice"),
        (["rows.jsonl"], "http://:s3cret-pw@127.0.0.1:42601/0", "not a registry"),
        (["rows.jsonl"], "http://127.0.0.1:42601/0?password=s3cret-pw", "not a registry"),
        (["https://:s3cret-pw@127.0.0.1:42601/rows.jsonl"], "models", "not a source"),
    ],
)
def test_the_errors_of_the_options_do_not_show_a_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, samples: list[str], registry: str, said: str
) -> None:
    """Both errors echoed the URL as given, password and all, into the cron log that keeps stderr."""
    monkeypatch.chdir(tmp_path)
    args = ["retrain", *[a for spec in samples for a in ("--samples", spec)], "--registry", registry]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and len(refused.output.splitlines()) == 1, refused.output
    assert said in refused.output and "s3cret" not in refused.output, refused.output


@pytest.mark.parametrize("name", ["sharegpt-h200", "sharegpt_h200"])
def test_a_shipped_source_given_by_its_name_and_its_path_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """`--samples sharegpt-h200 --samples <that file's path>` read the rows twice: the evaluation slice (the most
    recent 20%) was the second copy, rows the trees had trained on."""
    from leadtime.data import MEASURED

    monkeypatch.chdir(tmp_path)  # no file called like the shipped name here
    with pytest.raises(ValueError, match=f"--samples {MEASURED['sharegpt-h200']} is given twice \\(as {name} too\\)"):
        RetrainConfig(samples=(name, str(MEASURED["sharegpt-h200"])), registry=str(tmp_path / "models"))
    local = tmp_path / name  # a file of that name here is what the name means, as the reader takes it
    local.write_text("")
    RetrainConfig(samples=(name, str(MEASURED["sharegpt-h200"])), registry=str(tmp_path / "models"))


def test_a_first_model_made_from_the_registrys_own_stream_says_how_far_into_it_it_learned(
    sim_log: Path, redis_url: str
) -> None:
    """With an empty Redis registry the job's model recorded no position in the observation stream it was made
    from: a replica adopting it kept reading where it was, losing what it had learned since, and one starting up
    replayed the whole stream over it, learning the history twice."""
    from leadtime.predictor.service.learning import CURSOR_KEY, STREAM_KEY

    settings = ServiceSettings(redis_url=redis_url, grpc_port=0)
    with TestClient(create_app(settings)) as client:
        runtime = client.app.state.runtime  # type: ignore[attr-defined]
        entries = [json.loads(line) for line in sim_log.read_text().splitlines()]
        for start in range(0, len(entries), 500):
            chunk = [{k: v for k, v in e.items() if k != "policy"} for e in entries[start : start + 500]]
            assert client.post("/add_training_data_bulk", json={"entries": chunk}).status_code == 202
        assert wait_until(lambda: runtime.learned()["ttft"] == len(entries), timeout_s=60)
        end = runtime.store.stream_end()
        result = run_retrain(RetrainConfig(samples=(redis_url,), registry=redis_url))
        assert result.exit_code == EXIT_PUBLISHED
        published = OnlinePredictor.from_bytes(runtime.store.latest_model()[1], background=False)
        assert published.metadata[CURSOR_KEY] == end and published.metadata[STREAM_KEY] == runtime.store.stream_name
        # It learned every row read, the evaluation slice too once judged: what the position says it holds.
        assert published.status()["observations"]["ttft"] == len(entries)


def fill_stream(url: str, log: Path) -> tuple[list[dict[str, Any]], str]:
    """The log's rows appended to the service's observation stream (default namespace), as the service appends
    them; returns them and the last entry's id."""
    import redis

    from leadtime.predictor.store.redis_store import ENTRY_FIELD, observation_stream_key

    entries = [json.loads(line) for line in log.read_text().splitlines()]
    end = ""
    with redis.Redis.from_url(url, decode_responses=True) as client:
        for entry in entries:
            end = str(client.xadd(observation_stream_key("leadtime"), {ENTRY_FIELD: json.dumps(entry)}))
    return entries, end


def test_a_first_model_published_past_a_replicas_model_still_takes_its_stream_position(
    sim_log: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: with an empty registry at the start and a replica publishing its model while the job fitted,
    the job's model won and was published without its position in the observation stream and without the
    evaluation slice learned: replicas adopting it skipped those rows, or learned the history twice."""
    from leadtime.predictor.service.learning import CURSOR_KEY, STREAM_KEY
    from leadtime.training.registry import RedisRegistry

    entries, end = fill_stream(redis_url, sim_log)
    fit_trees = job_module._fit_trees

    def replica_publishes_meanwhile(*args: Any, **kwargs: Any) -> Any:
        replica = RedisRegistry(redis_url)
        try:
            replica.publish(OnlinePredictor(LearnerConfig(background=False)).to_bytes())  # its prior alone
        finally:
            replica.close()
        return fit_trees(*args, **kwargs)

    monkeypatch.setattr(job_module, "_fit_trees", replica_publishes_meanwhile)
    result = run_retrain(RetrainConfig(samples=(redis_url,), registry=redis_url))
    assert result.report["registry"]["champion_version"] is None
    assert result.report["registry"]["judged_again_against_version"] == 1
    assert result.exit_code == EXIT_PUBLISHED and result.published_version == 2
    registry = RedisRegistry(redis_url)
    try:
        latest = registry.latest()
        stream = registry.store.stream_name
    finally:
        registry.close()
    assert latest is not None
    published = OnlinePredictor.from_bytes(latest.artifact, background=False)
    assert published.metadata[CURSOR_KEY] == end and published.metadata[STREAM_KEY] == stream
    assert published.status()["observations"]["ttft"] == len(entries)


@pytest.mark.parametrize("learned", ["every row", "the history"])
def test_a_champion_whose_stream_position_covers_evaluation_rows_is_said_to_be_judged_in_sample(
    sim_log: Path, redis_url: str, tmp_path: Path, learned: str
) -> None:
    """The live service's model has learned every row of its stream up to its recorded position, the rows the job
    holds out from that stream too: its "held-out" figures were in-sample, which favours keeping it, and nothing
    said so."""
    import redis

    from leadtime.predictor.service.learning import CURSOR_KEY, STREAM_KEY
    from leadtime.predictor.store.redis_store import observation_stream_key
    from leadtime.predictor.store.stream_identity import StreamIdentity

    fill_stream(redis_url, sim_log)
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        ids = [entry_id for entry_id, _ in client.xrange(observation_stream_key("leadtime"))]
    samples = SampleReader("h100-sxm", "llama-3.1-8b").read([redis_url])
    rows = len(ids) if learned == "every row" else len(ids) - 300  # the last 300 (20%) are the evaluation slice
    champion = OnlinePredictor(LearnerConfig(background=False, retrain=False))
    champion.learn_many(samples.batch[:rows], samples.actual_ttft_ms[:rows], samples.actual_tpot_ms[:rows])
    champion.config.retrain = True
    champion.metadata[CURSOR_KEY] = ids[rows - 1]
    # Spelt otherwise than the source, as the service records it: one stream all the same.
    champion.metadata[STREAM_KEY] = StreamIdentity.of(redis_url, "leadtime").name
    champion.version = 3
    champion.save(tmp_path / "models")
    config = RetrainConfig(
        samples=(redis_url.removesuffix("/0"),), registry=str(tmp_path / "models"), report_dir=tmp_path / "report"
    )
    result = run_retrain(config)
    # Rows from files carry no record of who learned them: the report says in a plain sentence what may be so.
    assert CHAMPION_IN_SAMPLE in (tmp_path / "report" / "report.md").read_text()
    in_sample = [line for line in result.report["warnings"] if "in-sample" in line]
    if learned == "the history":
        assert in_sample == []
        return
    assert in_sample == [
        f"the champion has learned 300 of the 300 rows of the evaluation slice (its position in "
        f"{redis_url.removesuffix('/0')} (leadtime) is entry {ids[-1]}): its figures on them are in-sample, which "
        "favours keeping it"
    ]


@pytest.mark.parametrize(
    ("source", "registry"),
    [
        ("redis://127.0.0.1:{port}", "redis://127.0.0.1:{port}/0"),  # the default database
        ("redis://127.0.0.1:{port}/0/", "REDIS://127.0.0.1:{port}/0"),  # a trailing slash, the scheme's case
        ("redis://127.0.0.1:{port}/0?namespace=leadtime", "redis://127.0.0.1:{port}?db=0"),  # defaults spelt out
    ],
)
def test_the_registrys_own_stream_is_recognised_however_its_url_is_spelt(
    sim_log: Path, redis_server: Any, source: str, registry: str
) -> None:
    """Regression: with an empty registry, `--samples redis://127.0.0.1:6379 --registry redis://127.0.0.1:6379/0`
    published a model without its position in the stream and without the evaluation slice learned: the two URLs,
    one stream, were compared as text. Replicas adopting it skipped rows or learned the history twice."""
    from leadtime.predictor.service.learning import CURSOR_KEY, STREAM_KEY
    from leadtime.training.registry import RedisRegistry

    entries, end = fill_stream(redis_server.url, sim_log)
    source, registry = source.format(port=redis_server.port), registry.format(port=redis_server.port)
    result = run_retrain(RetrainConfig(samples=(source,), registry=registry))
    assert result.exit_code == EXIT_PUBLISHED
    published = result.challenger
    with contextlib.closing(RedisRegistry(registry)) as opened:
        assert published.metadata[STREAM_KEY] == opened.store.stream_name
    assert published.metadata[STREAM_KEY] == f"redis://127.0.0.1:{redis_server.port}/0 leadtime:observations"
    assert published.metadata[CURSOR_KEY] == end
    assert published.status()["observations"]["ttft"] == len(entries)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("redis://cache.example:6379/0", "redis://Cache.Example/0"),  # the default port; a host name's case
        ("redis://:secret@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0?socket_timeout=5"),  # how, not where
        ("redis://127.0.0.1:6379/3", "redis://127.0.0.1:6379/0?db=3"),
        ("redis://[::1]:6379", "redis://[::1]/0"),
        ("unix:///run/redis.sock", "unix:///run/redis.sock?db=0"),
    ],
)
def test_urls_spelt_differently_for_one_stream_name_one(one: str, other: str) -> None:
    """What the URL's text says for certain: the default port and database, a host name in any case."""
    from leadtime.predictor.store.stream_identity import StreamIdentity

    assert StreamIdentity.of(one, "leadtime") == StreamIdentity.of(other, "leadtime")


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("redis://127.0.0.1:6379/0", "rediss://127.0.0.1:6379/0"),  # TLS: another listener, if any
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6380/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/1"),
        ("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6379/1?db=2"),  # redis-py takes ?db= over the path
        ("redis://localhost:6379/0", "redis://127.0.0.1:6379/0"),  # localhost may be ::1: nothing is resolved
        ("unix:///run/redis.sock", "unix:///run/redis.sock?db=1"),
    ],
)
def test_urls_that_may_reach_different_streams_are_not_taken_for_one(one: str, other: str) -> None:
    """Only what is certainly the same stream is: taking another for the registry's own would record a position
    in a stream the model never read."""
    from leadtime.predictor.store.stream_identity import StreamIdentity

    assert StreamIdentity.of(one, "leadtime") != StreamIdentity.of(other, "leadtime")
    assert StreamIdentity.of(one, "leadtime") != StreamIdentity.of(one, "fleet-b")


def test_a_target_that_gets_no_new_trees_need_only_be_no_worse(tmp_path: Path) -> None:
    """Regression: on a mostly-prefill pool (too few TPOT rows in the history for trees) the challenger's TPOT
    predictions were the champion's own, yet had to beat them by the margin: the job kept the champion (exit
    status 3) run after run, though the challenger's new TTFT trees cut the TTFT error by 6%."""
    from leadtime.data import MEASURED

    rows = [json.loads(line) for line in MEASURED["sharegpt-h200"].read_text().splitlines()]
    ttft, tpot = [r for r in rows if r["actual_ttft_ms"] > 0], [r for r in rows if r["actual_tpot_ms"] > 0][:300]
    mixed = []
    for i, row in enumerate(ttft):  # one TPOT row after every fifth TTFT row: 266 in the history, under 500
        mixed.append(row)
        if i % 5 == 0 and i // 5 < len(tpot):
            mixed.append(tpot[i // 5])
    log = tmp_path / "fewtpot.jsonl"
    log.write_text("".join(json.dumps(row) + "\n" for row in mixed))
    samples = SampleReader("h200-sxm", "qwen3-32b").read([str(log)])
    config = LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False, retrain=False)
    champion = OnlinePredictor(config)
    learned = np.arange(int(0.6 * len(samples)))  # a service's model before its first tree retrain
    champion.learn_many(samples.batch[learned], samples.actual_ttft_ms[learned], samples.actual_tpot_ms[learned])
    champion.config.retrain = True
    champion.save(tmp_path / "models")

    result = run_retrain(RetrainConfig(samples=(str(log),), registry=str(tmp_path / "models")))
    assert list(result.report["training"]["targets"]) == ["ttft"]  # no TPOT trees: too few rows
    evaluation = result.report["evaluation"]
    assert evaluation["challenger"]["tpot"]["mape"] == evaluation["champion"]["tpot"]["mape"]
    assert evaluation["challenger"]["ttft"]["mape"] <= 0.98 * evaluation["champion"]["ttft"]["mape"]
    assert result.exit_code == EXIT_PUBLISHED
    decision = result.report["decision"]
    assert decision["wins"] == {"ttft": True, "tpot": True} and decision["unchanged"] == ["tpot"]
    assert decision["reason"].startswith("the challenger wins the one target it has new trees for")
    assert "tpot: no new trees, the champion's own predictions (not held to the margin)" in decision["reason"]
    published = OnlinePredictor.load(tmp_path / "models", background=False)
    assert published.tree_text("tpot") == champion.tree_text("tpot")


def test_a_target_without_new_trees_is_held_to_no_worse_and_cannot_win_alone() -> None:
    champion = evaluation_of(scores(0.20, 0.05), scores(0.10, 0.02))
    better_ttft = evaluation_of(scores(0.15, 0.05), scores(0.10, 0.02))
    assert not decide(champion, better_ttft, 0.02).publish  # held to the margin, TPOT loses
    published = decide(champion, better_ttft, 0.02, unchanged=frozenset({"tpot"}))
    assert published.publish and published.wins == {"ttft": True, "tpot": True}
    # Worse where it should be the champion's own (never so in the job): lost.
    worse = decide(champion, evaluation_of(scores(0.15, 0.05), scores(0.11, 0.02)), 0.02, unchanged={"tpot"})
    assert not worse.publish and worse.wins == {"ttft": True, "tpot": False}
    # The champion's own on every target judged: nothing to publish.
    same = decide(champion, champion, 0.02, unchanged={"ttft", "tpot"})
    assert not same.publish and same.reason.startswith("the champion stays (the challenger is its equal")


def test_a_target_whose_mean_tree_is_kept_is_held_to_no_worse_on_mape() -> None:
    """Its MAPE is the champion's own (same mean predictions): the margin applies only to a new mean tree, while
    the upper-quantile loss is held to no higher either way."""
    champion = evaluation_of(scores(0.20, 0.05), scores(0.10, 0.04))
    new_upper = evaluation_of(scores(0.15, 0.05), scores(0.10, 0.02))  # TPOT: same mean, better quantile
    assert not decide(champion, new_upper, 0.02).publish  # held to the margin, TPOT loses
    published = decide(champion, new_upper, 0.02, kept_mean={"tpot"})
    assert published.publish and published.wins == {"ttft": True, "tpot": True}
    assert published.kept_mean == ["tpot"] and published.unchanged == []
    assert "tpot: MAPE 0.1000 → 0.1000 (the champion's own mean: no worse)" in published.reason
    assert published.as_dict()["kept_mean"] == ["tpot"]
    # Its new quantile tree still answers to the quantile's rule...
    worse_upper = decide(champion, evaluation_of(scores(0.15, 0.05), scores(0.10, 0.041)), 0.02, kept_mean={"tpot"})
    assert not worse_upper.publish and worse_upper.wins == {"ttft": True, "tpot": False}
    # ...and a worse MAPE where the mean should be the champion's own (never so in the job) loses.
    worse_mean = decide(champion, evaluation_of(scores(0.15, 0.05), scores(0.11, 0.02)), 0.02, kept_mean={"tpot"})
    assert not worse_mean.publish and "(the champion's own mean: worse)" in worse_mean.reason
    # A better quantile alone is an improvement: published, every other measure the champion's own.
    upper_only = evaluation_of(scores(0.20, 0.05), scores(0.10, 0.02))
    assert decide(champion, upper_only, 0.02, unchanged={"ttft"}, kept_mean={"tpot"}).publish


def test_a_challenger_with_a_new_quantile_tree_but_the_champions_mean_publishes(tmp_path: Path) -> None:
    """Regression (the README's walk): retrained on the simulator's observations, the challenger got a new TPOT
    upper-quantile tree but kept the champion's TPOT mean tree; its TPOT MAPE was the champion's to the last bit,
    still held to the 2% margin, and the champion stayed (exit status 3) though the challenger was equal or better
    on every measure."""
    registry, sim = tmp_path / "models", tmp_path / "sim"
    first = RetrainConfig(samples=("sharegpt-h200",), registry=str(registry), accelerator="h200-sxm", model="qwen3-32b")
    assert run_retrain(first).exit_code == EXIT_PUBLISHED
    simulated = CliRunner().invoke(
        app, ["simulate", "--fleet", "mixed", "--policy", "leadtime", "--max-requests", "1000", "--out", str(sim)]
    )
    assert simulated.exit_code == 0, simulated.output
    result = run_retrain(RetrainConfig(samples=(str(sim / "observations.jsonl"),), registry=str(registry)))
    targets = result.report["training"]["targets"]
    assert targets["tpot"]["accepted"] == {"mean": False, "upper": True}, targets  # the case this test is about
    evaluation = result.report["evaluation"]
    assert evaluation["challenger"]["tpot"]["mape"] == evaluation["champion"]["tpot"]["mape"]
    assert result.exit_code == EXIT_PUBLISHED, result.report["decision"]["reason"]
    decision = result.report["decision"]
    assert decision["wins"] == {"ttft": True, "tpot": True} and decision["kept_mean"] == ["tpot"]
    assert decision["reason"].startswith("the challenger wins both targets")


def test_a_misspelt_optional_field_is_named_on_stderr_and_in_the_report(sim_log: Path, tmp_path: Path) -> None:
    """Regression: `accelerator` and `prefill_tokens_in_flight` misspelt in every row of a mixed-fleet log, the job
    said "1500 rows used (0 malformed left out)" and published a model that took every row as the default class.
    The rows are still used (extra keys ride along by design), but one warning line says what was not read."""
    typo = tmp_path / "typo.jsonl"
    renamed = {"accelerator": "accelerater", "prefill_tokens_in_flight": "prefill_tokens_inflight"}
    rows = [{renamed.get(k, k): v for k, v in json.loads(line).items()} for line in sim_log.read_text().splitlines()]
    typo.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["retrain", "--samples", str(typo), "--registry", str(tmp_path / "models"), "--json"]
    done = CliRunner().invoke(app, [*args, "--report", str(tmp_path / "report")])
    assert done.exit_code in (EXIT_PUBLISHED, EXIT_KEPT), done.output
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, done.stderr
    n = len(rows)
    assert f"`accelerater` in {n} rows (did you mean `accelerator`?)" in warnings[0], warnings[0]
    assert f"`prefill_tokens_inflight` in {n} rows (did you mean `prefill_tokens_in_flight`?)" in warnings[0]
    assert "policy" not in warnings[0]  # the simulator log's own field: no slip, not named
    report = json.loads(done.stdout)
    assert report["warnings"] == [warnings[0].removeprefix("warning: ")]
    assert report["samples"]["sources"][0]["unread_keys"]["accelerater"] == n
    assert warnings[0].removeprefix("warning: ") in (tmp_path / "report" / "report.md").read_text()


def test_a_log_written_newest_first_is_judged_on_its_newest_rows_and_a_slice_behind_the_history_is_warned_of(
    sim_log: Path, tmp_path: Path
) -> None:
    """Regression: a file whose timestamps strictly decrease was split in read order, judged on its oldest rows,
    and published with exit 0 and nothing on stderr under --json. One file is ordered by its timestamps; where the
    order still cannot follow them (two files whose clocks disagree) the job warns that the slice is not the
    most recent, in every output mode."""
    rows = [json.loads(line) for line in sim_log.read_text().splitlines()]
    for i, row in enumerate(rows):
        row["timestamp"] = 1_000.0 + i  # one second apart: the file spans more than the tolerance
    newest_first = tmp_path / "rev.jsonl"
    newest_first.write_text("".join(json.dumps(row) + "\n" for row in reversed(rows)))
    args = ["retrain", "--registry", str(tmp_path / "one"), "--json"]
    done = CliRunner().invoke(app, [*args, "--samples", str(newest_first)])
    assert done.exit_code in (EXIT_PUBLISHED, EXIT_KEPT), done.output
    samples = json.loads(done.stdout)["samples"]
    assert samples["ordered_by"] == "timestamp"
    assert samples["evaluation_from"] == 1_000.0 + len(rows) - samples["evaluation_rows"]
    assert "evaluation slice" not in done.stderr, done.stderr
    half = len(rows) // 2
    older, newer = tmp_path / "older.jsonl", tmp_path / "newer.jsonl"
    older.write_text("".join(json.dumps(row) + "\n" for row in reversed(rows[:half])))
    newer.write_text("".join(json.dumps(row) + "\n" for row in reversed(rows[half:])))
    args = ["retrain", "--registry", str(tmp_path / "two"), "--json", "--samples", str(newer), "--samples", str(older)]
    done = CliRunner().invoke(app, args)
    assert done.exit_code in (EXIT_PUBLISHED, EXIT_KEPT), done.output
    report = json.loads(done.stdout)
    assert report["samples"]["ordered_by"] == "read order"
    warnings = [line.removeprefix("warning: ") for line in done.stderr.splitlines() if line.startswith("warning: ")]
    assert report["warnings"] == warnings  # the simulator's `policy` key is named too
    late = [line for line in warnings if "evaluation slice starts" in line]
    assert len(late) == 1 and "newer.jsonl" in late[0], done.stderr  # why: the source whose timestamps go back


def test_sources_given_together_one_without_timestamps_are_warned_of_naming_it(sim_log: Path, tmp_path: Path) -> None:
    """The service's stream keeps no timestamp for llm-d's rows: given with a file, the sources followed each other
    in the order given and the evaluation slice was the last source's tail, the newest rows or not, without a word
    (the README's own example held out the archive's tail and trained on the live stream)."""
    rows = [json.loads(line) for line in sim_log.read_text().splitlines()]
    half = len(rows) // 2
    untimed, timed = tmp_path / "untimed.jsonl", tmp_path / "timed.jsonl"
    untimed.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "timestamp"}) + "\n" for r in rows[half:])
    )
    timed.write_text("".join(json.dumps(r) + "\n" for r in rows[:half]))
    report_dir = tmp_path / "report"
    args = ["retrain", "--samples", str(untimed), "--samples", str(timed), "--registry", str(tmp_path / "models")]
    done = CliRunner().invoke(app, [*args, "--report", str(report_dir), "--json"])
    assert done.exit_code == EXIT_PUBLISHED, done.output
    warnings = [line.removeprefix("warning: ") for line in done.stderr.splitlines() if line.startswith("warning: ")]
    (said,) = [line for line in warnings if "without a timestamp" in line]
    assert said == (
        f"{untimed} has rows without a timestamp: the sources follow each other in the order given, so the "
        f"evaluation slice is the last 300 rows read (from {timed}), not the newest by time; give the newest last"
    )
    assert json.loads(done.stdout)["warnings"] == warnings
    assert said in (report_dir / "report.md").read_text()
    # One source alone, without timestamps, is in the order it was logged in: nothing to warn of.
    samples = SampleReader("h100-sxm", "llama-3.1-8b").read([str(untimed)])
    assert job_module._warnings(samples, job_module._split(samples, 0.2)) == []


def test_a_simulator_log_as_written_is_retrained_on_without_a_warning_of_its_keys(
    sim_log: Path, tmp_path: Path
) -> None:
    """The simulator's `--out` log names the policy that routed each row (`ROUTED_BY_FIELD`): a field of Leadtime's
    own, no slip, so the README's simulate-then-retrain path says nothing of keys left unread."""
    assert all(ROUTED_BY_FIELD in json.loads(line) for line in sim_log.read_text().splitlines()[:5])
    args = ["retrain", "--samples", str(sim_log), "--registry", str(tmp_path / "models"), "--json"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code in (EXIT_PUBLISHED, EXIT_KEPT), done.output
    assert "keys the job does not read" not in done.stderr, done.stderr
    assert json.loads(done.stdout)["samples"]["sources"][0]["unread_keys"] == {}


def test_trees_do_not_fit_first_tokens_sooner_than_their_stated_wait() -> None:
    """The online learner skips such a TTFT (its wait was overstated); the offline trees fitted it, floored, as
    a request thousands of times faster than its prior."""
    parked = EndpointState(timeslice_state="parked", timeslice_wait_ms=5000.0)
    x = Vectorizer().batch([FeatureRow(RequestFeatures(1000), parked)] * 3 + [FeatureRow(RequestFeatures(1000))]).X
    ttft = np.array([4000.0, 5200.0, 0.0, 90.0])
    history = np.arange(4)
    assert job_module.tree_rows("ttft", x, ttft, history).tolist() == [1, 3]
    assert job_module.tree_rows("tpot", x, np.array([9.0, 9.0, 9.0, 0.0]), history).tolist() == [0, 1, 2]


def test_too_few_rows_for_trees_counts_the_rows_the_trees_could_fit(tmp_path: Path) -> None:
    """It counted every history row that observed the target ("ttft: 1354" against the 500 needed), not those
    left once first tokens sooner than their stated time-slice wait are left out, which the check counts."""
    from leadtime.data import MEASURED
    from leadtime.training.fit import LocalTrainer, SearchConfig

    rows = [json.loads(line) for line in MEASURED["sharegpt-h200"].read_text().splitlines()]
    parked = {"timeslice_state": "parked", "timeslice_wait_ms": 10_000.0}  # far longer than any of these TTFTs
    ttft = [r | (parked if i % 5 else {}) for i, r in enumerate(r for r in rows if r["actual_ttft_ms"] > 0)]
    log = tmp_path / "parked.jsonl"
    log.write_text("".join(json.dumps(row) + "\n" for row in ttft))
    samples = SampleReader("h200-sxm", "qwen3-32b").read([str(log)])
    split = split_recent(samples.timestamps, 0.2)
    base = OnlinePredictor(LearnerConfig(accelerator="h200-sxm", model="qwen3-32b", background=False))
    fits = job_module.tree_rows("ttft", samples.batch.X, samples.actual_ttft_ms, split.history)
    observed = int((samples.actual_ttft_ms[split.history] > 0).sum())
    assert len(fits) < job_module.MIN_TARGET_ROWS <= observed  # the case this test is about
    with pytest.raises(RetrainError) as refused:
        job_module._fit_trees(base, samples, split, SearchConfig(), LocalTrainer(), job_module._Progress(False))
    assert str(refused.value) == (
        f"no target has the {job_module.MIN_TARGET_ROWS} history rows trees need (ttft: {len(fits)}, "
        f"{observed - len(fits)} more left out for a first token sooner than the time-slice wait they state; "
        "tpot: 0)"
    )
