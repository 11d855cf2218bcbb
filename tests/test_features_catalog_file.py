"""A deployment's own accelerator classes and models (`--catalog FILE`): read, checked, vectorized, learned and
carried with the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from leadtime.features.catalog import ACCELERATORS, BUILT_IN, Accelerator, Catalog
from leadtime.features.catalog_file import CatalogError, load_catalog
from leadtime.features.errors import FeatureError
from leadtime.features.rows import EndpointState, FeatureRow, Observation, RequestFeatures
from leadtime.features.vectorize import COLUMN_INDEX, Vectorizer
from leadtime.predictor.artifact import ArtifactError, decode, encode
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor


def test_a_catalog_file_adds_its_classes_and_models(catalog_file: Path) -> None:
    catalog = load_catalog(catalog_file)
    assert [a.slug for a in catalog.accelerators] == ["b200", "l4"]
    assert catalog.accelerator("b200").interconnect_gb_s == 900
    assert catalog.accelerator("l4").name == "l4"  # no name given: the slug
    assert catalog.accelerator("l4").interconnect_gb_s == 32
    assert catalog.model("qwen2.5-7b").kv_bytes_per_token(1) == 2 * 28 * 4 * 128 * 2
    assert catalog.accelerator("h100-sxm") is ACCELERATORS["h100-sxm"]  # the built-in ones stay
    assert load_catalog(_write(catalog_file.parent, "")) == BUILT_IN  # an empty file adds nothing


def _write(directory: Path, text: str) -> Path:
    path = directory / "bad.yaml"
    path.write_text(text)
    return path


B200 = "  - {slug: b200, peak_tflops: 2250, hbm_tb_s: 8.0, memory_gb: 180}\n"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("accelerators:\n" + B200 + B200, "accelerators[1].slug: 'b200' is given twice"),
        ("accelerators:\n  - {slug: h100-sxm, peak_tflops: 99, hbm_tb_s: 1, memory_gb: 16}\n", "is built in"),
        ("models:\n  - {slug: llama-3.1-8b, params_b: 8, layers: 32, hidden_size: 4096, num_heads: 32, "
         "num_kv_heads: 8, head_dim: 128}\n", "models[0].slug: 'llama-3.1-8b' is built in"),
        ("accelerators:\n  - {slug: b200, peak_tflops: 0, hbm_tb_s: 8.0, memory_gb: 180}\n",
         "accelerators[0].peak_tflops: Input should be greater than 0"),
        ("accelerators:\n  - {slug: b200, peak_tflops: 2250, memory_gb: 180}\n",
         "accelerators[0].hbm_tb_s: Field required"),
        ("accelerators:\n  - {slug: b200, peak_tflops: 2250, hbm_tb_s: 8, memory_gb: 180, hbm_gb_s: 8000}\n",
         "accelerators[0].hbm_gb_s: Extra inputs are not permitted"),
        ("accelerators:\n  - {slug: B200/x, peak_tflops: 2250, hbm_tb_s: 8.0, memory_gb: 180}\n",
         "accelerators[0].slug: must be lower-case letters, digits, '.', '_' or '-' (at most 63, starting with a "
         "letter or digit), got 'B200/x'"),
        ("accelerators:\n  - {slug: b200, peak_tflops: 2250, hbm_tb_s: 8.0, memory_gb: 180, measured_kv_tb_s: 9}\n",
         "measured_kv_tb_s exceeds hbm_tb_s"),
        ("accelerators:\n  - {slug: b200, peak_tflops: .nan, hbm_tb_s: 8.0, memory_gb: 180}\n",
         "accelerators[0].peak_tflops: Input should be a finite number"),
        ("accelerators:\n  - {slug: b200, peak_tflops: 2250, hbm_tb_s: 8.0, memory_gb: 183359}\n",
         "accelerators[0].memory_gb: must be at most 10,000 GB, got 183,359 (nvidia-smi prints MiB"),
        ("accelerators:\n  - {slug: b200, peak_tflops: 1e308, hbm_tb_s: 8.0, memory_gb: 180}\n",
         "accelerators[0].peak_tflops: Input should be less than or equal to 100000"),
        ("accelerators:\n  - {slug: b200, peak_tflops: true, hbm_tb_s: 8.0, memory_gb: 180}\n",
         "accelerators[0].peak_tflops: must be a number, got True"),
        ("models:\n  - {slug: m, params_b: 7.6, layers: true, hidden_size: 3584, num_heads: 28, num_kv_heads: 4, "
         "head_dim: 128}\n", "models[0].layers: Input should be a valid integer"),
        ("models:\n  - {slug: m, params_b: 7.6, layers: '28', hidden_size: 3584, num_heads: 28, num_kv_heads: 4, "
         "head_dim: 128}\n", "models[0].layers: Input should be a valid integer"),
        ("models:\n  - {slug: m, params_b: 7.6, layers: 10000000000000000000000, hidden_size: 3584, num_heads: 28, "
         "num_kv_heads: 4, head_dim: 128}\n", "models[0].layers: Input should be less than or equal to 10000"),
        ("models:\n  - {slug: m, params_b: 1e300, layers: 28, hidden_size: 3584, num_heads: 28, num_kv_heads: 4, "
         "head_dim: 128}\n", "models[0].params_b: Input should be less than or equal to 100000"),
        ("models:\n  - {slug: m, params_b: 7.6, layers: 28, hidden_size: 3584, num_heads: 4, num_kv_heads: 28, "
         "head_dim: 128}\n", "models[0]: num_kv_heads (28) must divide num_heads (4)"),
        ("gpus: []\n", "gpus: Extra inputs are not permitted"),
        ("- b200\n", "must be a mapping with accelerators and models, got list"),
        ("accelerators: [\n", "not valid YAML (line 2, column 1:"),
        ("accelerators: []\naccelerators: []\n", "the key 'accelerators' is given twice"),
    ],
)  # fmt: skip
def test_a_bad_catalog_is_refused_naming_the_file_and_the_entry(tmp_path: Path, text: str, problem: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(CatalogError) as err:
        load_catalog(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and problem in message and "\n" not in message


def test_an_unreadable_catalog_is_refused_naming_the_file(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="missing.yaml: no such file or directory"):
        load_catalog(tmp_path / "missing.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(CatalogError, match="not UTF-8 text"):
        load_catalog(binary)


def test_rows_of_an_added_class_take_its_figures_and_an_unknown_one_is_named(catalog_file: Path) -> None:
    catalog = load_catalog(catalog_file)
    rows = [
        FeatureRow(RequestFeatures(4000), EndpointState(accelerator=a, model="qwen2.5-7b"))
        for a in ("h100-sxm", "b200", "l4")
    ]
    batch = Vectorizer(catalog=catalog).batch(rows)
    assert batch.classes == ["h100-sxm/qwen2.5-7b/tp1", "b200/qwen2.5-7b/tp1", "l4/qwen2.5-7b/tp1"]
    tb_s = batch.X[:, COLUMN_INDEX["accel_tb_s"]]
    assert tb_s[1] > tb_s[0] > tb_s[2]  # B200's 8 TB/s, H100's 3.35, L4's 0.3, each at achieved efficiency
    with pytest.raises(FeatureError) as err:
        Vectorizer().batch(rows)
    assert err.value.field == "rows[0].model" and "unknown model 'qwen2.5-7b'" in err.value.problem


def test_the_prior_ranks_an_added_class_by_its_figures(catalog_file: Path) -> None:
    """A class never observed gets first predictions from its figures: a long prefill is fastest on the B200
    and slowest on the L4, and so is a decode step."""
    predictor = OnlinePredictor(LearnerConfig(catalog=load_catalog(catalog_file), background=False))
    rows = [
        FeatureRow(RequestFeatures(4000), EndpointState(accelerator=a, num_request_running=8))
        for a in ("b200", "h100-sxm", "l4")
    ]
    predicted = predictor.predict_many(rows)
    assert list(np.argsort(predicted.ttft_mean)) == [0, 1, 2]
    assert list(np.argsort(predicted.tpot_mean)) == [0, 1, 2]


def test_a_model_carries_its_catalog_and_a_built_in_one_saves_as_before(catalog_file: Path) -> None:
    catalog = load_catalog(catalog_file)
    trained = OnlinePredictor(LearnerConfig(accelerator="b200", model="qwen2.5-7b", catalog=catalog, background=False))
    row = FeatureRow(RequestFeatures(2000), EndpointState(endpoint_id="b-1", accelerator="l4"))
    for _ in range(40):
        trained.learn_one(Observation(row, actual_ttft_ms=3000.0, actual_tpot_ms=60.0))
    loaded = OnlinePredictor.from_bytes(trained.to_bytes(), background=False)
    assert loaded.config.catalog == catalog and loaded.config.accelerator == "b200"
    assert loaded.predict_one(row) == trained.predict_one(row)
    assert "catalog" not in decode(OnlinePredictor(LearnerConfig(background=False)).to_bytes())["config"]


def test_catalog_differences_name_what_a_model_adds_that_a_process_lacks(catalog_file: Path) -> None:
    catalog = load_catalog(catalog_file)
    assert catalog.differences(catalog) == [] and catalog.differences(BUILT_IN) == []
    assert BUILT_IN.differences(catalog) == [
        "accelerator class 'b200' is unknown here",
        "accelerator class 'l4' is unknown here",
        "model 'qwen2.5-7b' is unknown here",
    ]
    faster = Catalog((Accelerator("b200", "NVIDIA B200", 2500, 8.0, 180),))
    assert catalog.differences(faster) == ["accelerator class 'b200' has other figures here"]


def test_an_artifact_whose_catalog_does_not_check_is_refused_naming_the_entry(catalog_file: Path) -> None:
    """A checksum says who wrote an artifact, not that its catalog holds: a class with no bandwidth would divide
    by zero in the prior."""
    trained = OnlinePredictor(LearnerConfig(catalog=load_catalog(catalog_file), background=False))
    document = decode(trained.to_bytes())
    document["config"]["catalog"]["accelerators"][1]["hbm_tb_s"] = 0
    with pytest.raises(ArtifactError, match=r"accelerators\[1\].hbm_tb_s: Input should be greater than 0"):
        OnlinePredictor.from_bytes(encode(document), background=False)


def test_a_figure_in_exponent_notation_is_read_as_the_number_it_is(tmp_path: Path) -> None:
    """PyYAML reads `2.25e3` as text (YAML 1.1 wants `2.25e+3`): it is still the number a reader sees."""
    path = _write(tmp_path, "accelerators:\n  - {slug: b200, peak_tflops: 2.25e3, hbm_tb_s: 8e0, memory_gb: 180}\n")
    assert load_catalog(path).accelerator("b200").peak_tflops == 2250.0


@pytest.mark.parametrize(
    ("entry", "field", "gb_s"),
    [
        ("{slug: l4, peak_tflops: 121, hbm_tb_s: 300, memory_gb: 24}", "hbm_tb_s", 300),
        ("{slug: a10g, peak_tflops: 125, hbm_tb_s: 600, memory_gb: 24}", "hbm_tb_s", 600),
        ("{slug: t4, peak_tflops: 65, hbm_tb_s: 320, memory_gb: 16}", "hbm_tb_s", 320),
        ("{slug: b200, peak_tflops: 2250, hbm_tb_s: 8000, memory_gb: 180}", "hbm_tb_s", 8000),
        ("{slug: l4, peak_tflops: 121, hbm_tb_s: 300, memory_gb: 24, measured_kv_tb_s: 250}", "hbm_tb_s", 300),
        ("{slug: l4, peak_tflops: 121, hbm_tb_s: 0.3, memory_gb: 24, measured_kv_tb_s: 250}", "measured_kv_tb_s", 250),
    ],
)
def test_bandwidth_in_gb_s_is_refused_as_a_slip_of_units(tmp_path: Path, entry: str, field: str, gb_s: int) -> None:
    """Regression: an L4 (300 GB/s), A10G (600 GB/s) or T4 (320 GB/s) written in GB/s in the TB/s field was
    accepted as a chip with 300–600 TB/s: its decode steps were predicted at 0.16 ms instead of 63 ms. No
    accelerator comes near 50 TB/s, so a figure above it is refused naming the slip."""
    with pytest.raises(CatalogError) as err:
        load_catalog(_write(tmp_path, f"accelerators:\n  - {entry}\n"))
    assert f"accelerators[0].{field}: must be at most 50 TB/s" in str(err.value)
    assert f"{gb_s:,} GB/s is {gb_s / 1000:g} TB/s" in str(err.value)


@pytest.mark.parametrize(
    ("figures", "problem"),
    [
        ("peak_tflops: 2.25, hbm_tb_s: 8, memory_gb: 180",
         "peak_tflops: must be at least 10 TFLOP/s, got 2.25 (PFLOP/s written as TFLOP/s? 2.25 PFLOP/s is 2,250 "
         "TFLOP/s)"),
        ("peak_tflops: 2250, measured_gemm_tflops: 1.6, hbm_tb_s: 8, memory_gb: 180",
         "measured_gemm_tflops: must be at least 10 TFLOP/s, got 1.6 (PFLOP/s written as TFLOP/s?"),
        ("peak_tflops: 2250, hbm_tb_s: 8, memory_gb: 0.18",
         "memory_gb: must be at least 4 GB, got 0.18 (TB written as GB? 0.18 TB is 180 GB)"),
        ("peak_tflops: 2250, hbm_tb_s: 1e-300, memory_gb: 180", "hbm_tb_s: must be at least 0.05 TB/s, got 1e-300"),
        ("peak_tflops: 2250, hbm_tb_s: 8, measured_kv_tb_s: 0.001, memory_gb: 180",
         "measured_kv_tb_s: must be at least 0.05 TB/s, got 0.001"),
        ("peak_tflops: 2250, hbm_tb_s: 8, memory_gb: 180, interconnect_gb_s: 0.9",
         "interconnect_gb_s: must be at least 1 GB/s, got 0.9 (TB/s written as GB/s? 0.9 TB/s is 900 GB/s)"),
    ],
)  # fmt: skip
def test_a_figure_below_any_accelerator_made_is_refused_as_a_slip_of_units(
    tmp_path: Path, figures: str, problem: str
) -> None:
    """A B200 written as its spec sheet prints it (2.25 PFLOP/s, 0.18 TB) was taken as a chip a thousand times
    slower or smaller: its prefills predicted a thousand times too long, or its KV cache a thousand times too small;
    and a figure near 0 made its rows' features overflow to inf before they reached the model. The slowest
    accelerator one serves an LLM on (a T4: 65 TFLOP/s, 0.32 TB/s, 16 GB) is far above each bound."""
    with pytest.raises(CatalogError) as err:
        load_catalog(_write(tmp_path, f"accelerators:\n  - {{slug: b200, {figures}}}\n"))
    assert f"accelerators[0].{problem}" in str(err.value)
    t4 = "{slug: t4, peak_tflops: 65, hbm_tb_s: 0.32, memory_gb: 16, interconnect_gb_s: 32}"
    assert load_catalog(_write(tmp_path, f"accelerators:\n  - {t4}\n")).accelerator("t4").memory_gb == 16


def test_the_fastest_memory_made_is_accepted(tmp_path: Path) -> None:
    """The bound is well above any chip made: a B200's 8 TB/s (and twice, or five times, that) passes."""
    path = _write(tmp_path, "accelerators:\n  - {slug: next, peak_tflops: 9000, hbm_tb_s: 40, memory_gb: 1000}\n")
    assert load_catalog(path).accelerator("next").hbm_tb_s == 40


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("accelerators:\n  - b200\n", "accelerators[0]: expected a mapping {slug, name, peak_tflops, hbm_tb_s, "
         "memory_gb, measured_gemm_tflops, measured_kv_tb_s, interconnect_gb_s}"),
        ("accelerators:\n  -\n", "accelerators[0]: expected a mapping {slug, name, peak_tflops,"),
        ("models:\n  - qwen2.5-7b\n", "models[0]: expected a mapping {slug, params_b, layers, hidden_size, num_heads, "
         "num_kv_heads, head_dim, bytes_per_param}"),
    ],
)  # fmt: skip
def test_an_entry_that_is_not_a_mapping_is_named_in_the_files_terms(tmp_path: Path, text: str, problem: str) -> None:
    """Regression: an entry written as a bare name (`- b200`) was refused as "Input should be a valid dictionary or
    instance of AcceleratorSpec", a class the file's author never sees."""
    with pytest.raises(CatalogError) as err:
        load_catalog(_write(tmp_path, text))
    assert problem in str(err.value) and "Spec" not in str(err.value)


def test_a_section_left_empty_adds_nothing(tmp_path: Path) -> None:
    """Regression: `models:` with every model under it commented out (YAML's null) was refused as "Input should be a
    valid list", where leaving out the key, or the whole file's content, is accepted."""
    path = _write(tmp_path, "accelerators:\n" + B200 + "models:\n  # - {slug: m, ...}\n")
    assert [a.slug for a in load_catalog(path).accelerators] == ["b200"]
    assert load_catalog(_write(tmp_path, "accelerators:\nmodels:\n")) == BUILT_IN


def test_a_slug_written_as_a_bare_number_is_that_name(tmp_path: Path) -> None:
    """Regression: `slug: 4090` (an RTX 4090), which YAML reads as a number, was refused as "Input should be a valid
    string"; an endpoint's label `leadtime.io/accelerator: 4090` is read as the text "4090", and names it."""
    path = _write(tmp_path, "accelerators:\n  - {slug: 4090, peak_tflops: 165, hbm_tb_s: 1.0, memory_gb: 24}\n")
    assert load_catalog(path).accelerator("4090").name == "4090"
    with pytest.raises(CatalogError, match="slug: must be lower-case letters"):
        load_catalog(_write(tmp_path, "accelerators:\n  - {slug: true, peak_tflops: 99, hbm_tb_s: 1, memory_gb: 16}\n"))
