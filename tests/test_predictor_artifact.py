"""Saving and loading: JSON + LightGBM text, never pickle; corrupt or foreign artifacts are refused."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
from leadtime.features.vectorize import COLUMN_INDEX
from leadtime.predictor.artifact import FILE_NAME, ArtifactError, save_file, seal
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.target import _Adwin, new_drift_detector


@pytest.fixture(scope="module")
def trained() -> OnlinePredictor:
    rng = np.random.default_rng(0)
    p = OnlinePredictor(LearnerConfig(background=False, retrain_every=10**6, min_window=100))
    rows = [
        FeatureRow(
            RequestFeatures(int(rng.integers(10, 3000))),
            EndpointState(
                endpoint_id=f"ep-{i % 3}",
                num_request_waiting=int(rng.integers(0, 8)),
                num_request_running=int(rng.integers(0, 30)),
            ),
        )
        for i in range(1500)
    ]
    batch = p.vectorizer.batch(rows)
    x = batch.X
    waiting = x[:, COLUMN_INDEX["num_request_waiting"]]
    ttft = (
        (20 + 0.03 * x[:, COLUMN_INDEX["input_tokens"]])
        * np.where(waiting > 3, 2.5, 1.0)
        * rng.lognormal(0, 0.05, 1500)
    )
    tpot = (10 + 0.2 * x[:, COLUMN_INDEX["num_request_running"]]) * rng.lognormal(0, 0.05, 1500)
    p.learn_many(batch, ttft, tpot)
    p.retrain_now()
    assert p.status()["trees_active"]["ttft"]
    return p


def _probe(p: OnlinePredictor) -> np.ndarray:
    rows = [
        FeatureRow(RequestFeatures(n), EndpointState(endpoint_id="ep-1", num_request_waiting=w))
        for n, w in [(100, 0), (1000, 5), (2500, 2)]
    ]
    pred = p.predict_many(rows)
    return np.concatenate([pred.ttft_mean, pred.ttft_quantile, pred.tpot_mean, pred.tpot_quantile])


def test_round_trip_through_bytes_predicts_identically(trained: OnlinePredictor) -> None:
    loaded = OnlinePredictor.from_bytes(trained.to_bytes(), background=False)
    np.testing.assert_allclose(_probe(loaded), _probe(trained), rtol=1e-12)
    assert loaded.version == trained.version
    assert loaded.tree_text("ttft") == trained.tree_text("ttft")
    loaded.close()


def test_round_trip_through_a_directory(trained: OnlinePredictor, tmp_path: Path) -> None:
    trained.save(tmp_path)
    loaded = OnlinePredictor.load(tmp_path, background=False)
    np.testing.assert_allclose(_probe(loaded), _probe(trained), rtol=1e-12)
    loaded.close()


def test_round_trip_through_a_file_named_as_load_takes_it(trained: OnlinePredictor, tmp_path: Path) -> None:
    """`save("m.json")` made a directory m.json/ holding the artifact, while `load("m.json")` takes a file."""
    trained.save(tmp_path / "m.json")
    assert (tmp_path / "m.json").is_file()
    loaded = OnlinePredictor.load(tmp_path / "m.json", background=False)
    np.testing.assert_allclose(_probe(loaded), _probe(trained), rtol=1e-12)
    loaded.close()
    (tmp_path / "models.json").mkdir()  # a directory that happens to end in .json stays a directory
    trained.save(tmp_path / "models.json")
    assert (tmp_path / "models.json" / "leadtime-predictor.json").is_file()


def test_artifact_is_json_with_lightgbm_text_not_pickle(trained: OnlinePredictor) -> None:
    data = trained.to_bytes()
    document = json.loads(data)
    assert document["format"] == "leadtime-predictor"
    assert document["targets"]["ttft"]["trees"]["mean"].startswith("tree")
    assert b"\x80\x04" not in data[:2]  # no pickle protocol header


def test_a_model_that_never_changed_writes_no_changed_at_as_before_it_was_recorded() -> None:
    """A replica of this release and one of the last, serving the same never-changed model, must give it the same
    bytes (the same ETag): `"changed_at": null` made every pull between the two a whole download."""
    document = json.loads(OnlinePredictor(LearnerConfig(background=False)).to_bytes())
    assert "changed_at" not in document


@pytest.mark.parametrize("ahead", [timedelta(hours=2), datetime(9999, 1, 1, tzinfo=UTC) - datetime.now(UTC)])
def test_a_changed_at_in_the_future_is_taken_as_now_with_one_warning(
    ahead: timedelta, caplog: pytest.LogCaptureFixture
) -> None:
    """A publisher whose clock ran 2 h ahead made the model's age -7200 s (year 9999: -2.5e11 s), which hid a stale
    model from every dashboard. Its model is still good: loaded, its change taken as now, in one warning."""
    made = OnlinePredictor(LearnerConfig(background=False))
    made.changed_at = datetime.now(UTC) + ahead
    written = made.changed_at.isoformat()
    with caplog.at_level(logging.WARNING, logger="leadtime.predictor"):
        loaded = OnlinePredictor.from_bytes(made.to_bytes())
    assert loaded.changed_at is not None
    assert abs((loaded.changed_at - datetime.now(UTC)).total_seconds()) < 5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and written in lines[0], lines
    again = OnlinePredictor.from_bytes(loaded.to_bytes())  # published on: now in the past, nothing to say
    assert again.changed_at == loaded.changed_at and len(caplog.records) == 1


def test_a_changed_at_a_little_ahead_is_kept() -> None:
    """Clocks a few seconds apart are normal: within 5 minutes the recorded time is kept (the age reads 0)."""
    made = OnlinePredictor(LearnerConfig(background=False))
    made.changed_at = datetime.now(UTC) + timedelta(minutes=1)
    assert OnlinePredictor.from_bytes(made.to_bytes()).changed_at == made.changed_at


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(schema_version=999), "schema version"),
        (lambda d: d.update(artifact_version=1), "artifact version"),
        (lambda d: d.update(format="joblib"), "not a Leadtime artifact"),
        (lambda d: d["columns"].reverse(), "column order"),
        (lambda d: d["targets"]["ttft"]["trees"].update(mean="import os; os.system('x')"), "LightGBM text"),
        (lambda d: d["targets"]["tpot"]["rls"].update(weights=[1.0, 2.0]), "wrong shape"),
        (lambda d: d["targets"].pop("tpot"), "invalid"),
    ],
)
def test_wrong_or_corrupt_artifacts_are_refused_with_a_clear_error(
    trained: OnlinePredictor, mutate, message: str
) -> None:
    document = json.loads(trained.to_bytes())
    mutate(document)
    # Sealed again (a matching checksum, as whoever can write the registry can make): the content checks refuse it.
    with pytest.raises(ArtifactError, match=message):
        OnlinePredictor.from_bytes(seal(document), background=False)


def test_any_change_without_a_matching_checksum_is_refused(trained: OnlinePredictor) -> None:
    """The checksum covers the whole document, not only the trees: a learned weight or an offset changed by hand
    (still of the right shape and type, so no other check could tell) is refused."""
    original = json.loads(trained.to_bytes())
    assert original["checksum"].startswith("sha256:")
    changes = [
        lambda d: d["targets"]["ttft"]["rls"]["weights"].__setitem__(0, d["targets"]["ttft"]["rls"]["weights"][0] + 1),
        lambda d: d.update(version=d["version"] + 1),
        lambda d: d["config"].update(quantile=0.5),
        lambda d: d.pop("checksum"),
    ]
    for change in changes:
        document = json.loads(trained.to_bytes())
        change(document)
        with pytest.raises(ArtifactError, match="checksum"):
            OnlinePredictor.from_bytes(json.dumps(document, separators=(",", ":")).encode(), background=False)
    # Whitespace is not content: the same document written another way still loads.
    OnlinePredictor.from_bytes(json.dumps(original, indent=2).encode(), background=False).close()


def test_garbage_bytes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not JSON"):
        OnlinePredictor.from_bytes(b"\x80\x04\x95 pickle bytes", background=False)
    with pytest.raises(ArtifactError, match="no artifact"):
        OnlinePredictor.load(tmp_path / "missing", background=False)


@pytest.mark.parametrize("fraction", [0.002, 0.1, 0.33, 0.5, 0.9, 0.99, 0.999, 0.9999])
def test_truncated_lightgbm_text_is_refused_without_crashing(trained: OnlinePredictor, fraction: float) -> None:
    """LightGBM's own parser aborts the process on some truncations; they must be caught before it."""
    document = json.loads(trained.to_bytes())
    text = document["targets"]["ttft"]["trees"]["mean"]
    document["targets"]["ttft"]["trees"]["mean"] = text[: int(len(text) * fraction)]
    with pytest.raises(ArtifactError):
        OnlinePredictor.from_bytes(seal(document), background=False)  # past the checksum: LightGBM's parser


def test_a_flipped_digit_in_a_tree_fails_the_checksum(trained: OnlinePredictor) -> None:
    document = json.loads(trained.to_bytes())
    text = document["targets"]["ttft"]["trees"]["mean"]
    i = text.index("leaf_value=") + len("leaf_value=")
    flipped = "1" if text[i] != "1" else "2"
    document["targets"]["ttft"]["trees"]["mean"] = text[:i] + flipped + text[i + 1 :]
    with pytest.raises(ArtifactError, match="checksum"):
        OnlinePredictor.from_bytes(json.dumps(document).encode(), background=False)


def test_a_loaded_predictor_serves_the_same_quantile_mid_refresh() -> None:
    """Regression: the calibration's cached quantile was recomputed on load, so p90 differed after a swap."""
    rng = np.random.default_rng(11)
    p = OnlinePredictor(LearnerConfig(background=False))
    rows = [FeatureRow(RequestFeatures(int(rng.integers(10, 900))), EndpointState()) for _ in range(213)]
    x = p.vectorizer.batch(rows)
    p.learn_many(x, 50 * rng.lognormal(0, 0.4, 213), 12 * rng.lognormal(0, 0.2, 213))
    loaded = OnlinePredictor.from_bytes(p.to_bytes(), background=False)
    np.testing.assert_array_equal(_probe(loaded), _probe(p))


def _timeslice_rows(rng: np.random.Generator, n: int) -> list[FeatureRow]:
    """Rows of endpoints in every time-slice state, some with a stated wait."""
    return [
        FeatureRow(
            RequestFeatures(int(rng.integers(10, 3000))),
            EndpointState(
                endpoint_id=f"ep-{i % 3}",
                num_request_waiting=int(rng.integers(0, 8)),
                timeslice_state=["resident", "parked", "switching"][i % 3],
                timeslice_wait_ms=[0.0, 0.0, 40.0, 300.0][i % 4] if i % 3 else 0.0,
            ),
        )
        for i in range(n)
    ]


def _learn_timeslice_rows(p: OnlinePredictor, rows: list[FeatureRow], rng: np.random.Generator) -> None:
    """Outcomes of switched-out endpoints slower than the resident ones', beyond their stated wait."""
    x = p.vectorizer.batch(rows).X
    away = 1.0 - x[:, COLUMN_INDEX["timeslice_resident"]]
    ttft = x[:, COLUMN_INDEX["timeslice_wait_ms"]] + (30 + 0.03 * x[:, COLUMN_INDEX["input_tokens"]]) * (1 + away)
    p.learn_many(p.vectorizer.batch(rows), ttft * rng.lognormal(0, 0.05, len(rows)), 12 * (1 + 0.3 * away))


def _as_saved_with_a_resident_column(document: dict[str, Any]) -> None:
    """Rewrite a document's online corrections as builds before `timeslice_away` wrote them: a column
    `timeslice_resident` (1 − away) in its place, with the weights and the RLS state that give the same φ·w."""
    for target in document["targets"].values():
        names, rls = target["feature_names"], target["rls"]
        away = names.index("timeslice_away")
        names[away] = "timeslice_resident"
        a = np.eye(len(names))  # φ_old = A φ_new: resident = bias − away (and back: A is its own inverse)
        a[away, 0], a[away, away] = 1.0, -1.0
        rls["weights"] = (a.T @ np.array(rls["weights"])).tolist()
        rls["p"] = (a.T @ np.array(rls["p"]) @ a).tolist()


def test_a_model_saved_with_a_resident_column_loads_and_predicts_and_learns_as_before(
    trained: OnlinePredictor,
) -> None:
    """Artifacts written before the correction's time-slice column was `timeslice_away` (0 on ordinary rows) had
    `timeslice_resident` (1 on them): they load converted, and predict and go on learning as they would have."""
    rng = np.random.default_rng(12)
    model = OnlinePredictor.from_bytes(trained.to_bytes(), background=False)
    _learn_timeslice_rows(model, _timeslice_rows(rng, 600), rng)
    document = json.loads(model.to_bytes())
    _as_saved_with_a_resident_column(document)
    old = document["targets"]["ttft"]
    assert old["feature_names"][-1] == "timeslice_resident" and old["rls"]["weights"][-1] != 0.0
    loaded = OnlinePredictor.from_bytes(seal(document), background=False)
    probes = _timeslice_rows(rng, 12)
    for name in ("ttft_mean", "ttft_quantile", "tpot_mean", "tpot_quantile"):
        np.testing.assert_allclose(
            getattr(loaded.predict_many(probes), name), getattr(model.predict_many(probes), name), rtol=1e-9
        )
    # Against the model loaded as saved now: saving keeps no window nor drift state, for either.
    reloaded = OnlinePredictor.from_bytes(model.to_bytes(), background=False)
    more, seed = _timeslice_rows(rng, 300), int(rng.integers(1000))
    for p in (reloaded, loaded):
        _learn_timeslice_rows(p, more, np.random.default_rng(seed))
    np.testing.assert_allclose(
        loaded.predict_many(probes).ttft_mean, reloaded.predict_many(probes).ttft_mean, rtol=1e-9
    )
    assert json.loads(loaded.to_bytes())["targets"]["ttft"]["feature_names"][-1] == "timeslice_away"


def test_a_loaded_predictor_keeps_the_trees_records_and_the_count_to_its_next_retrain(
    trained: OnlinePredictor,
) -> None:
    """Regression: the serving trees' forward records and the rows since the last retrain were not saved, so a
    restarted learner started each tree's 256-row trial over (a tree about to be retired served on) and retrained
    on another schedule."""
    learning = OnlinePredictor.from_bytes(trained.to_bytes(), background=False)
    rng = np.random.default_rng(5)
    rows = [
        FeatureRow(RequestFeatures(int(rng.integers(10, 3000))), EndpointState(endpoint_id="ep-0")) for _ in range(200)
    ]
    x = learning.vectorizer.batch(rows)
    learning.learn_many(x, 30 * rng.lognormal(0, 0.1, 200), 12 * rng.lognormal(0, 0.1, 200))
    loaded = OnlinePredictor.from_bytes(learning.to_bytes(), background=False)
    for target in ("ttft", "tpot"):
        before, after = learning._models[target], loaded._models[target]
        assert after.forward == before.forward
        assert after.upper_forward == before.upper_forward
        assert after.since_retrain == before.since_retrain == 200
    assert learning._models["ttft"].forward.rows == 200  # a record there was to keep
    learning.close()
    loaded.close()


def test_an_artifact_written_before_the_records_were_saved_loads_with_fresh_ones(trained: OnlinePredictor) -> None:
    document = json.loads(trained.to_bytes())
    for state in document["targets"].values():
        for key in ("forward", "upper_forward", "since_retrain"):
            state.pop(key, None)
    loaded = OnlinePredictor.from_bytes(seal(document), background=False)
    assert loaded._models["ttft"].forward.rows == loaded._models["ttft"].since_retrain == 0
    np.testing.assert_array_equal(_probe(loaded), _probe(trained))
    loaded.close()


def test_a_save_that_fails_leaves_no_temporary_file_and_the_old_artifact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk each failed save left its partial temporary file, which kept the disk full for every save
    after it."""
    save_file(tmp_path, b"old")

    def disk_full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("leadtime.predictor.artifact.os.fsync", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_file(tmp_path, b"new" * 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME]
    assert (tmp_path / FILE_NAME).read_bytes() == b"old"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_saved_artifact_is_readable_as_the_umask_says(tmp_path: Path, umask: int, mode: int) -> None:
    """Always 0600 before (the temporary file's mode): a prediction server or a retraining job running as another
    user could not read a shared model directory."""
    old = os.umask(umask)
    try:
        path = save_file(tmp_path, b"{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["targets"]["tpot"]["endpoints"].update(squares="x"),  # AttributeError: str has no .items()
        lambda d: d["targets"]["ttft"]["endpoints"].update(offsets=[1, 2]),
        lambda d: d["targets"]["ttft"].update(endpoints="x"),
        lambda d: d["targets"]["tpot"]["rls"].update(weights={"a": 1}),
        lambda d: d.update(metadata=None),
        lambda d: d["targets"]["ttft"]["ceiling"].update(active="false"),  # a string: true as a bool
        # Loaded, and then every prediction and every learn raised numpy's "matmul: … mismatch":
        lambda d: d["targets"]["ttft"]["rls"].update(n_features=2, weights=[0.0, 0.0], p=[[1.0, 0.0], [0.0, 1.0]]),
        # Loaded, and served NaN (JSON's non-standard NaN, which json.loads reads):
        lambda d: d["targets"]["tpot"]["rls"]["weights"].__setitem__(0, float("nan")),
        lambda d: d["targets"]["ttft"]["rls"]["p"][0].__setitem__(0, float("inf")),
        # Loaded, and the first learn raised IndexError:
        lambda d: d["targets"]["ttft"]["conformal"].update(window=0),
    ],
)
def test_a_sealed_artifact_of_any_malformed_content_is_refused_as_an_artifact_error(
    trained: OnlinePredictor, mutate
) -> None:
    """A checksummed artifact whose endpoint table was a string raised AttributeError out of `from_bytes`: the
    model-sync thread that took it up from --model-dir died with it (no sync, no saves, for the process's life)."""
    document = json.loads(trained.to_bytes())
    mutate(document)
    with pytest.raises(ArtifactError, match="invalid|metadata"):
        OnlinePredictor.from_bytes(seal(document), background=False)


def test_a_process_that_loads_a_model_with_trees_predicts_without_importing_lightgbm(
    trained: OnlinePredictor, tmp_path: Path
) -> None:
    """A service or gateway loading a trained model (from --model-dir, the registry, a pull) compiled its trees
    through LightGBM's own parse: ~0.8 s of CPU and ~140 MB imported (with scikit-learn, scipy and pandas) into a
    process that predicts with the compiled form anyway. It compiles them from their text now, and predicts the
    same numbers."""
    path = tmp_path / "model.json"
    path.write_bytes(trained.to_bytes())
    code = (
        "import sys, json\n"
        "from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures\n"
        "from leadtime.predictor.learner import OnlinePredictor\n"
        f"p = OnlinePredictor.from_bytes(open({str(path)!r}, 'rb').read())\n"
        "assert p.status()['trees_active']['ttft']\n"
        "rows = [FeatureRow(RequestFeatures(n), EndpointState(endpoint_id='ep-1', num_request_waiting=w))\n"
        "        for n, w in [(100, 0), (1000, 5), (2500, 2)]]\n"
        "pred = p.predict_many(rows)\n"
        "print(json.dumps([list(map(float, a)) for a in (pred.ttft_mean, pred.ttft_quantile, pred.tpot_mean,\n"
        "                                                pred.tpot_quantile)]))\n"
        "print(sorted(m for m in ('lightgbm', 'sklearn', 'scipy.stats', 'pandas') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    predicted, imported = out.stdout.strip().splitlines()
    assert "lightgbm" not in imported, out.stdout + out.stderr
    if isinstance(new_drift_detector(), _Adwin):  # river's own ADWIN core (river.drift imports the other three)
        assert imported == "[]", out.stdout + out.stderr
    np.testing.assert_array_equal(np.array(json.loads(predicted)).ravel(), _probe(trained))
