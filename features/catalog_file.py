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

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from leadtime.features.catalog import ACCELERATORS, MODELS, Accelerator, Catalog, ModelProfile
from leadtime.features.errors import validation_problem
from leadtime.yaml_text import read_yaml_file

SLUG_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
"""What a slug may be: it is part of a class key (`h100-sxm/llama-3.1-8b/tp1`), a metric label and a file name."""


class CatalogError(ValueError):
    """A catalog file that cannot be read or says something invalid; the message names the file and the entry."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AcceleratorSpec(_Spec):
    """One accelerator class as a user states it: published figures, and achieved ones where measured."""

    slug: str = Field(pattern=SLUG_PATTERN)
    name: str = ""
    peak_tflops: float = Field(gt=0, allow_inf_nan=False, description="Dense BF16 peak, TFLOP/s.")
    hbm_tb_s: float = Field(gt=0, allow_inf_nan=False, description="Memory bandwidth, TB/s.")
    memory_gb: float = Field(gt=0, allow_inf_nan=False)
    measured_gemm_tflops: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    measured_kv_tb_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    interconnect_gb_s: float = Field(default=450.0, gt=0, allow_inf_nan=False)

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

    slug: str = Field(pattern=SLUG_PATTERN)
    params_b: float = Field(gt=0, allow_inf_nan=False, description="Parameters, billions.")
    layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    bytes_per_param: int = Field(default=2, gt=0, le=8)

    def entry(self) -> ModelProfile:
        """The catalog's entry."""
        return ModelProfile(**self.model_dump())


class CatalogSpec(_Spec):
    """The file: additions to the built-in catalog, none of them redefining a built-in slug or named twice."""

    accelerators: list[AcceleratorSpec] = []
    models: list[ModelSpec] = []

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
        where, problem = validation_problem(err)
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
