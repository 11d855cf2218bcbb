"""A deployment's own accelerator classes and models, from a YAML file (`--catalog FILE`).

A fleet of B200s, L4s or A10Gs, or a model the built-in profiles lack, needs the same few published figures the
built-in entries carry; the physics prior turns them into first predictions, and the learner corrects them from
there. The file adds entries: it never redefines a built-in slug (one slug is one set of figures wherever a model
trained on it goes).

```yaml
accelerators:
  - slug: b200
    name: NVIDIA B200
    peak_tflops: 2250        # dense BF16
    hbm_tb_s: 8.0
    memory_gb: 180
    interconnect_gb_s: 900   # per direction; default 450
models:
  - slug: qwen2.5-7b
    params_b: 7.6
    layers: 28
    hidden_size: 3584
    num_heads: 28
    num_kv_heads: 4
    head_dim: 128
```
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from leadtime.features.catalog import ACCELERATORS, MODELS, Accelerator, Catalog, ModelProfile
from leadtime.features.errors import expected_mapping, validation_problem
from leadtime.yaml_text import Integer, Real, read_yaml_file

CATALOG_HINT = "others can be described in a catalog file (--catalog FILE)"
"""Said after an unknown class or model where the command takes a catalog."""
SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
"""What a slug may be: it is part of a class key (`h100-sxm/llama-3.1-8b/tp1`), a metric label and a file name."""
_SLUG = re.compile(SLUG_PATTERN)


def _slug(value: object) -> object:
    """A slug as its author wrote it: an unquoted number (`slug: 4090`, an RTX 4090) is its text, as an endpoint's
    label naming it is read (`leadtime.io/accelerator: 4090`); one that is no slug is refused in words, where
    pydantic quoted the pattern.

    >>> _slug(4090)
    '4090'
    """
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not _SLUG.fullmatch(value):
        shown = repr(value) if not isinstance(value, str) or len(value) <= 70 else repr(value[:67] + "...")
        raise ValueError(
            f"must be lower-case letters, digits, '.', '_' or '-' (at most 63, starting with a letter or digit), "
            f"got {shown}"
        )
    return value


Slug = Annotated[str, BeforeValidator(_slug)]


def _none_is_empty(value: object) -> object:
    """A section with every entry commented out (`models:` and nothing under it: YAML's null) adds nothing, as a
    section left out does."""
    return [] if value is None else value


class CatalogError(ValueError):
    """A catalog file that cannot be read or says something invalid; the message names the file and the entry."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Upper bounds far above any accelerator or model made (B200: 2,250 TFLOP/s, 8 TB/s, 192 GB; the largest models a
# few trillion parameters): a figure beyond them is a slip of units, which turned predictions to 0 or to seconds.
MAX_TFLOPS = 100_000
MAX_TB_S = 50
"""Memory bandwidth, TB/s, above which a figure is GB/s written as TB/s. The fastest HBM made is about 8 TB/s
(B200), so 50 leaves room for generations to come; while the slowest accelerators a deployment adds, written in GB/s
(a T4's 320, an L4's 300, an A10G's 600), all land above it. A bound of 1,000 let those through as 300–600 TB/s."""
MAX_MEMORY_GB = 10_000
MAX_INTERCONNECT_GB_S = 100_000
MAX_PARAMS_B = 100_000
MAX_SHAPE = 10_000
MAX_HIDDEN = 1_000_000
# Lower bounds far below any accelerator one serves an LLM on (a T4: 65 TFLOP/s, 0.32 TB/s, 16 GB, PCIe's 32 GB/s):
# a figure below them is a spec sheet's larger unit (a B200's 2.25 PFLOP/s, 0.18 TB), which predicted prefills a
# thousand times too long or a KV cache a thousand times too small; and a figure near 0 made features overflow to inf.
MIN_TFLOPS = 10
MIN_TB_S = 0.05
MIN_MEMORY_GB = 4
MIN_INTERCONNECT_GB_S = 1


def _at_least(value: float | None, least: float, unit: str, larger: str = "") -> None:
    """Refuse `value` below `least` (in `unit`), naming `larger`, the unit a thousand times as large, when the
    figure read in it would pass."""
    if value is None or value >= least:
        return
    hint = ""
    if larger and value * 1000 >= least:
        hint = f" ({larger} written as {unit}? {value:,g} {larger} is {value * 1000:,g} {unit})"
    raise ValueError(f"must be at least {least:g} {unit}, got {value:,g}{hint}")


class AcceleratorSpec(_Spec):
    """One accelerator class as a user states it: published figures, and achieved ones where measured."""

    slug: Slug
    name: str = ""
    peak_tflops: Real = Field(gt=0, le=MAX_TFLOPS, allow_inf_nan=False, description="Dense BF16 peak, TFLOP/s.")
    hbm_tb_s: Real = Field(gt=0, allow_inf_nan=False, description="Memory bandwidth, TB/s (`_bandwidth_in_tb_s`).")
    memory_gb: Real = Field(gt=0, allow_inf_nan=False, description="Memory, GB (bounded in `_memory_in_gb`).")
    measured_gemm_tflops: Real | None = Field(default=None, gt=0, le=MAX_TFLOPS, allow_inf_nan=False)
    measured_kv_tb_s: Real | None = Field(default=None, gt=0, allow_inf_nan=False)
    interconnect_gb_s: Real = Field(default=450.0, gt=0, le=MAX_INTERCONNECT_GB_S, allow_inf_nan=False)

    @field_validator("memory_gb")
    @classmethod
    def _memory_in_gb(cls, value: float) -> float:
        """nvidia-smi prints memory in MiB: 183359 for a B200 made its KV cache a thousand times too large."""
        if value > MAX_MEMORY_GB:
            raise ValueError(
                f"must be at most {MAX_MEMORY_GB:,} GB, got {value:,.0f} (nvidia-smi prints MiB: "
                f"{value:,.0f} MiB is {value * 2**20 / 1e9:,.0f} GB)"
            )
        _at_least(value, MIN_MEMORY_GB, "GB", "TB")
        return value

    @field_validator("peak_tflops", "measured_gemm_tflops")
    @classmethod
    def _compute_in_tflops(cls, value: float | None) -> float | None:
        """Spec sheets of the newest classes state PFLOP/s (a B200's 2.25)."""
        _at_least(value, MIN_TFLOPS, "TFLOP/s", "PFLOP/s")
        return value

    @field_validator("interconnect_gb_s")
    @classmethod
    def _interconnect_in_gb_s(cls, value: float) -> float:
        """NVLink is often quoted in TB/s (a B200's 1.8)."""
        _at_least(value, MIN_INTERCONNECT_GB_S, "GB/s", "TB/s")
        return value

    @field_validator("hbm_tb_s", "measured_kv_tb_s")
    @classmethod
    def _bandwidth_in_tb_s(cls, value: float | None) -> float | None:
        """Spec sheets of the slower classes state GB/s: an L4's 300 taken as TB/s predicted 0.16 ms decode steps."""
        if value is not None and value > MAX_TB_S:
            raise ValueError(
                f"must be at most {MAX_TB_S} TB/s, got {value:,g} (GB/s written as TB/s? "
                f"{value:,g} GB/s is {value / 1000:g} TB/s)"
            )
        _at_least(value, MIN_TB_S, "TB/s")
        return value

    @model_validator(mode="after")
    def _measured_below_peak(self) -> AcceleratorSpec:
        """Achieved figures above the peaks are a unit slip (GB/s for TB/s), not a faster chip."""
        for measured, peak, what in (
            (self.measured_gemm_tflops, self.peak_tflops, "measured_gemm_tflops exceeds peak_tflops"),
            (self.measured_kv_tb_s, self.hbm_tb_s, "measured_kv_tb_s exceeds hbm_tb_s"),
        ):
            if measured is not None and measured > peak:
                raise ValueError(what)
        return self

    def entry(self) -> Accelerator:
        """The catalog's entry; a class with no name is called by its slug."""
        return Accelerator(**{**self.model_dump(), "name": self.name or self.slug})


class ModelSpec(_Spec):
    """One model's shape, as its Hugging Face config states it."""

    slug: Slug
    params_b: Real = Field(gt=0, le=MAX_PARAMS_B, allow_inf_nan=False, description="Parameters, billions.")
    layers: Integer = Field(gt=0, le=MAX_SHAPE)
    hidden_size: Integer = Field(gt=0, le=MAX_HIDDEN)
    num_heads: Integer = Field(gt=0, le=MAX_SHAPE)
    num_kv_heads: Integer = Field(gt=0, le=MAX_SHAPE)
    head_dim: Integer = Field(gt=0, le=MAX_SHAPE)
    bytes_per_param: Integer = Field(default=2, gt=0, le=8)

    @model_validator(mode="after")
    def _grouped_heads(self) -> ModelSpec:
        """Grouped-query attention shares each KV head among a whole number of query heads."""
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        return self

    def entry(self) -> ModelProfile:
        """The catalog's entry."""
        return ModelProfile(**self.model_dump())


class CatalogSpec(_Spec):
    """The file: additions to the built-in catalog, none of them redefining a built-in slug or named twice."""

    accelerators: Annotated[list[AcceleratorSpec], BeforeValidator(_none_is_empty)] = []
    models: Annotated[list[ModelSpec], BeforeValidator(_none_is_empty)] = []

    @model_validator(mode="after")
    def _new_slugs(self) -> CatalogSpec:
        for kind, entries, built_in in (
            ("accelerators", [a.slug for a in self.accelerators], ACCELERATORS),
            ("models", [m.slug for m in self.models], MODELS),
        ):
            seen: set[str] = set()
            for i, slug in enumerate(entries):
                if slug in built_in:
                    raise ValueError(f"{kind}[{i}].slug: {slug!r} is built in; give yours another name")
                if slug in seen:
                    raise ValueError(f"{kind}[{i}].slug: {slug!r} is given twice")
                seen.add(slug)
        return self

    def catalog(self) -> Catalog:
        """The file's additions as the catalog the rest of Leadtime reads."""
        return Catalog(tuple(a.entry() for a in self.accelerators), tuple(m.entry() for m in self.models))


EXPECTED = {spec.__name__: expected_mapping(spec) for spec in (AcceleratorSpec, ModelSpec)}
"""What an entry that is not a mapping should be, by its keys: pydantic named the classes (`instance of
AcceleratorSpec`), which the file's author never sees (`validation_problem`'s `expected`)."""


def parse_catalog(data: object) -> Catalog:
    """A catalog from YAML's parsed content; CatalogError naming the entry and field.

    >>> parse_catalog({"accelerators": [{"slug": "l4", "peak_tflops": 121, "hbm_tb_s": 0.3, "memory_gb": 24}]})
    Catalog(accelerators=(Accelerator(slug='l4', name='l4', peak_tflops=121.0, ...),), models=())
    >>> parse_catalog({"models": [{"slug": "qwen3-32b", "params_b": 32.8, "layers": 64, "hidden_size": 5120,
    ...                            "num_heads": 64, "num_kv_heads": 8, "head_dim": 128}]})
    Traceback (most recent call last):
    ...
    leadtime.features.catalog_file.CatalogError: models[0].slug: 'qwen3-32b' is built in; give yours another name
    """
    if data is None:
        return Catalog()
    if not isinstance(data, dict):
        raise CatalogError(f"must be a mapping with accelerators and models, got {type(data).__name__}")
    try:
        return CatalogSpec.model_validate(data).catalog()
    except ValidationError as err:
        where, problem = validation_problem(err, EXPECTED)
        raise CatalogError(f"{where}: {problem}" if where else problem) from None


def load_catalog(path: str | Path) -> Catalog:
    """The catalog a file adds; CatalogError naming the file and the problem, on one line."""
    path = Path(path)
    try:
        data = read_yaml_file(path, "a catalog YAML")
    except ValueError as err:
        raise CatalogError(str(err)) from None
    try:
        return parse_catalog(data)
    except CatalogError as err:
        raise CatalogError(f"{path}: {err}") from None
