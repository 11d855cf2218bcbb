"""A service started with its own catalog (`--catalog FILE`): rows of its classes predicted, learned by the
learner process and documented; refused, naming the field, by a service without it; a bad file refused at start."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from catalog_yaml import CATALOG_YAML
from fastapi.testclient import TestClient
from pydantic import ValidationError
from typer.testing import CliRunner

from leadtime.cli import app as cli
from leadtime.features.catalog import Catalog
from leadtime.features.catalog_file import load_catalog
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.service.app import create_app
from leadtime.predictor.settings import ServiceSettings


def row(**overrides: Any) -> dict[str, Any]:
    return {
        "kv_cache_percentage": 0.2,
        "input_token_length": 3000,
        "num_request_waiting": 0,
        "num_request_running": 4,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.0,
        **overrides,
    }


def test_a_service_with_a_catalog_predicts_learns_and_documents_its_classes(catalog_file: Path) -> None:
    settings = ServiceSettings(catalog=catalog_file, accelerator="b200", model="qwen2.5-7b")
    with TestClient(create_app(settings)) as client:
        native = [row(endpoint_id=f"{a}-0", accelerator=a) for a in ("b200", "l4", "h100-sxm")]
        answer = client.post("/v1/predict", json={"rows": native})
        assert answer.status_code == 200, answer.text
        ttft = answer.json()["ttft_mean_ms"]
        assert ttft[0] < ttft[2] < ttft[1]  # B200 before H100 before L4, from their figures alone

        # llm-d's rows name no class: they are the settings' B200 serving Qwen2.5-7B.
        strict = client.post("/predict/bulk/strict", json={"requests": [row(), row(input_token_length=8000)]})
        assert strict.status_code == 200, strict.text
        assert strict.json()["predictions"][0]["ttft_ms"] == pytest.approx(
            client.post("/v1/predict", json={"rows": [row(accelerator="b200", model="qwen2.5-7b")]}).json()[
                "ttft_quantile_ms"
            ][0]
        )

        # Observations of an added class reach the learner process, which parses them with the same catalog.
        l4 = row(endpoint_id="l4-0", accelerator="l4")
        before = client.post("/v1/predict", json={"rows": [l4]}).json()["ttft_mean_ms"][0]
        observations = [dict(l4, actual_ttft_ms=5000.0, actual_tpot_ms=0.0) for _ in range(40)]
        accepted = client.post("/v1/observations", json={"observations": observations})
        assert accepted.status_code == 202, accepted.text
        runtime = client.app.state.runtime  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60  # generous: the learner process shares a busy 2-core machine
        while runtime.learned()["ttft"] < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runtime.learned()["ttft"] == 40
        deadline = time.monotonic() + 60  # the learner's snapshot reaches the serving model a moment later
        while client.post("/v1/predict", json={"rows": [l4]}).json()["ttft_mean_ms"][0] <= before:
            assert time.monotonic() < deadline, "the served model never learned the L4 rows"
            time.sleep(0.05)

        document = client.get("/openapi.json").json()
        text = str(document)
        assert "'b200'" in text and "'qwen2.5-7b'" in text and "'h100-sxm'" in text


def test_a_service_without_the_catalog_names_the_unknown_class(catalog_file: Path) -> None:
    with TestClient(create_app(ServiceSettings())) as client:
        answer = client.post("/v1/predict", json={"rows": [row(), row(accelerator="b200")]})
        assert answer.status_code == 422
        assert "rows[1].accelerator" in answer.text and "unknown accelerator class 'b200'" in answer.text
        assert "'b200'" not in str(client.get("/openapi.json").json())


def test_a_bad_catalog_file_is_refused_by_the_settings(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("accelerators:\n  - {slug: b200, peak_tflops: -1, hbm_tb_s: 8, memory_gb: 180}\n")
    with pytest.raises(ValidationError, match=r"accelerators\[0\].peak_tflops"):
        ServiceSettings(catalog=bad)


@pytest.mark.parametrize(
    ("text", "args", "names"),
    [
        ("accelerators: [{slug: h200-sxm, peak_tflops: 99, hbm_tb_s: 1, memory_gb: 16}]\n", [],
         ["--catalog (LEADTIME_CATALOG)", "accelerators[0].slug: 'h200-sxm' is built in"]),
        ("models: [}\n", [], ["--catalog (LEADTIME_CATALOG)", "not valid YAML"]),
        (CATALOG_YAML, ["--accelerator", "b300"],
         ["--accelerator (LEADTIME_ACCELERATOR): unknown accelerator class 'b300'", "b200", "l4", "--catalog FILE"]),
    ],
)  # fmt: skip
def test_serve_refuses_a_bad_catalog_in_one_line(tmp_path: Path, text: str, args: list[str], names: list[str]) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(text)
    result = CliRunner().invoke(cli, ["serve", "--catalog", str(path), *args])
    assert result.exit_code == 2, result.output
    assert len(result.output.splitlines()) == 1 and result.output.startswith("error: "), result.output
    for name in names:
        assert name in result.output, result.output


def test_a_model_of_another_catalog_is_served_with_a_warning(
    catalog_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model trained with B200 rows naming no class, served by a process that lacks the catalog: the rows naming
    none stay the settings' class (the model's is unknown here), and the log says what to do."""
    model_dir = tmp_path / "model"
    config = LearnerConfig(accelerator="b200", catalog=load_catalog(catalog_file), background=False)
    OnlinePredictor(config).save(model_dir)
    with caplog.at_level(logging.WARNING), TestClient(create_app(ServiceSettings(model_dir=model_dir))) as client:
        assert client.post("/predict/bulk/strict", json={"requests": [row()]}).status_code == 200
        assert client.app.state.runtime.settings.accelerator == "h100-sxm"  # type: ignore[attr-defined]
    warnings = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "accelerator class 'b200' is unknown here" in warnings and "--catalog" in warnings


def test_a_catalog_difference_is_warned_once_and_named_in_readyz_while_it_serves(
    catalog_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A prediction server pulls a new model every few seconds while its source learns (a replica installs its
    peers' from Redis alike): a difference of catalogs is said once, again only when it changes, and /readyz names
    it while such a model serves (a replica without the catalog of the others said nothing at all)."""
    theirs = load_catalog(catalog_file)
    with TestClient(create_app(ServiceSettings())) as client:
        runtime = client.app.state.runtime  # type: ignore[attr-defined]
        with caplog.at_level(logging.WARNING):
            for _ in range(3):  # as each pulled or synced model is installed
                runtime._install(OnlinePredictor(LearnerConfig(catalog=theirs, background=False)))
            assert "'b200' is unknown here" in client.get("/readyz").json()["degraded"]["catalog"]
            fewer = Catalog(accelerators=theirs.accelerators[:1])
            runtime._install(OnlinePredictor(LearnerConfig(catalog=fewer, background=False)))
            runtime._install(OnlinePredictor(LearnerConfig(background=False)))
            assert "catalog" not in client.get("/readyz").json()["degraded"]
    said = [r.getMessage() for r in caplog.records if "another catalog" in r.getMessage()]
    assert len(said) == 2 and "'l4'" in said[0] and "'l4'" not in said[1], said


def test_a_model_learning_where_the_catalog_extends_its_own_is_saved_with_it(
    catalog_file: Path, tmp_path: Path
) -> None:
    """A model saved before the deployment had a catalog, served with one: it learned B200 offsets and was saved
    without the catalog, and a process without the file then loaded it without a word."""
    model_dir = tmp_path / "model"
    OnlinePredictor(LearnerConfig(background=False)).save(model_dir)
    settings = ServiceSettings(catalog=catalog_file, model_dir=model_dir)
    with TestClient(create_app(settings)) as client:
        runtime = client.app.state.runtime  # type: ignore[attr-defined]
        assert runtime.predictor.config.catalog == load_catalog(catalog_file)
        b200 = [dict(row(endpoint_id="b-0", accelerator="b200"), actual_ttft_ms=90.0, actual_tpot_ms=9.0)] * 30
        assert client.post("/v1/observations", json={"observations": b200}).status_code == 202
        deadline = time.monotonic() + 60
        while runtime.learned()["ttft"] < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
    saved = OnlinePredictor.load(model_dir, background=False)
    assert saved.config.catalog == load_catalog(catalog_file) and saved.status()["observations"]["ttft"] >= 30


def test_serve_refuses_a_model_dir_whose_default_class_it_does_not_know(catalog_file: Path, tmp_path: Path) -> None:
    """Started without the catalog its model was trained with, the service answered every llm-d row as an H100's
    and learned them so, saving them back into the model, /readyz all clear."""
    model_dir = tmp_path / "model"
    config = LearnerConfig(accelerator="b200", catalog=load_catalog(catalog_file), background=False)
    OnlinePredictor(config).save(model_dir)
    result = CliRunner().invoke(cli, ["serve", "--model-dir", str(model_dir), "--port", "0", "--grpc-port", "0"])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert "takes rows naming no class as b200 serving llama-3.1-8b, which this process does not know" in result.output
    assert "--catalog" in result.output


def test_the_learner_says_why_it_skips_stored_observations_once_per_reason(
    catalog_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica without its peers' catalog skips each of their rows of the classes it lacks: it said so for
    every row (1,577 lines in a few seconds)."""
    from multiprocessing import Pipe

    from leadtime.predictor.service.learning import ChildSetup, _Child

    artifact = OnlinePredictor(LearnerConfig(background=False)).to_bytes()
    setup = ChildSetup(artifact, "0", 0, False, 2000, "h100-sxm", "llama-3.1-8b", 0, 0.25)
    ours, _ = Pipe()
    child = _Child(ours, setup)
    try:
        entries = [dict(row(accelerator=a), actual_ttft_ms=90.0, actual_tpot_ms=9.0) for a in ["b200"] * 40 + ["l4"]]
        with caplog.at_level(logging.WARNING, logger="leadtime.service"):
            child.learn([*entries, dict(row(), actual_ttft_ms=90.0, actual_tpot_ms=9.0)])
    finally:
        child.predictor.close()
    assert child.invalid == 41 and child.learned == 1
    said = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(said) == 2 and "'b200'" in said[0] and "'l4'" in said[1], said


def test_what_a_catalog_adds_is_logged_at_start_and_an_empty_one_warned_of(
    catalog_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing said a catalog had been read, or what it added: an empty or wrong file went unnoticed."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with caplog.at_level(logging.INFO, logger="leadtime.service"):
        create_app(ServiceSettings(catalog=catalog_file))
        create_app(ServiceSettings(catalog=empty))
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "the catalog" in r.getMessage()]
    assert said[0] == (logging.INFO, f"the catalog {catalog_file} adds accelerator classes b200, l4; models qwen2.5-7b")
    assert said[1] == (logging.WARNING, f"the catalog {empty} adds no accelerator class or model")
    result = CliRunner().invoke(cli, ["sim", "serve", "--fleet", "nope", "--catalog", str(empty)])
    assert f"warning: --catalog {empty} adds no accelerator class or model" in result.output, result.output
