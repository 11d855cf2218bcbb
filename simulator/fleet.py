"""Fleet description files: pools of endpoints, P/D links and time-slice groups, validated at the edge.

A fleet YAML looks like:

    refresh_ms: 50            # how often endpoint state is published to the router
    pools:
      - name: h100
        count: 4
        accelerator: h100-sxm
        model: llama-3.1-8b
        tensor_parallel: 1
        role: both            # both | prefill | decode
        timeslice_group: rl   # optional
    kv_link_gb_s: 25          # P/D: per decode endpoint, KV transfers queue on it
    timeslice_groups:
      rl:
        resident_ms: {distribution: exponential, mean: 4000}
        away_ms: {distribution: uniform, low: 500, high: 1500}
        restore_ms: {distribution: uniform, low: 50, high: 100}

A fleet is either unified (every pool `both`) or disaggregated (`prefill` and `decode` pools).
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from leadtime.data import DataFileError, resolve
from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.catalog_file import CATALOG_HINT
from leadtime.features.errors import FeatureError, field_path, validation_problem
from leadtime.features.roofline import decode_step_ms
from leadtime.router_plugin.policy import MIN_SLO_MS
from leadtime.yaml_text import Boolean, Integer, Real, read_yaml_file


class FleetError(ValueError):
    """A fleet file is missing, unreadable or describes an impossible fleet."""


BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
"""vLLM's --block-size choices."""
DAY_MS = 86_400_000.0
"""The longest duration a fleet file may give: a group away longer is never resident in any run."""


class DistributionSpec(BaseModel):
    """A duration as a fleet file gives it: fixed, uniform or exponential."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    TAKES: ClassVar[str] = (
        "takes a distribution in milliseconds: {distribution: fixed, value: 5000} (or {value: 5000}), "
        "{distribution: uniform, low: 50, high: 100} or {distribution: exponential, mean: 4000}"
    )
    """What a fleet file's duration field takes, as an error says it (a bare number is not one)."""
    distribution: Literal["fixed", "uniform", "exponential"] = "fixed"
    value: Real | None = Field(default=None, ge=0, le=DAY_MS)
    low: Real | None = Field(default=None, ge=0, le=DAY_MS)
    high: Real | None = Field(default=None, ge=0, le=DAY_MS)
    mean: Real | None = Field(default=None, gt=0, le=DAY_MS)

    @model_validator(mode="after")
    def _complete(self) -> DistributionSpec:
        needed = {"fixed": ("value",), "uniform": ("low", "high"), "exponential": ("mean",)}[self.distribution]
        for name in needed:
            if getattr(self, name) is None:
                raise ValueError(f"{self.distribution} distribution needs '{name}'")
        if self.distribution == "uniform" and (self.high or 0) < (self.low or 0):
            raise ValueError("uniform distribution needs low ≤ high")
        return self

    @property
    def mean_ms(self) -> float:
        """The mean duration the spec gives."""
        if self.distribution == "uniform":
            return ((self.low or 0.0) + (self.high or 0.0)) / 2.0
        return (self.value if self.distribution == "fixed" else self.mean) or 0.0


class TimesliceSpec(BaseModel):
    """How long a time-slice group stays resident, away, and takes to restore."""

    model_config = ConfigDict(extra="forbid")
    resident_ms: DistributionSpec
    away_ms: DistributionSpec
    restore_ms: DistributionSpec = DistributionSpec(distribution="uniform", low=50, high=100)

    @model_validator(mode="after")
    def _takes_time(self) -> TimesliceSpec:
        if self.resident_ms.mean_ms < 1.0:  # 0 or 1e-300: the group would switch forever at one instant
            raise ValueError(
                f"resident_ms: the group must be resident for 1 ms or more on average, got {self.resident_ms.mean_ms:g}"
            )
        return self


class PoolSpec(BaseModel):
    """A pool of identical endpoints as a fleet file gives it."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    count: Integer = Field(ge=1, le=1024)
    accelerator: str
    model: str
    tensor_parallel: Integer = Field(default=1, ge=1, le=64)
    role: Literal["both", "prefill", "decode"] = "both"
    timeslice_group: str | None = None
    max_num_batched_tokens: Integer = Field(default=8192, ge=16)
    max_num_seqs: Integer = Field(default=256, ge=1)
    block_size: Integer = 16
    gpu_memory_utilization: Real = Field(default=0.9, gt=0, le=1)
    cuda_graphs: Boolean = True
    join_at_s: Real = Field(default=0.0, ge=0)
    """A scale-out: the pool's endpoints start empty at this time and are offered to routers from then on."""
    join_at_share: Real = Field(default=0.0, ge=0, lt=1)
    """A scale-out at this share of the workload's arrival window (0.33: a third of the way through the run),
    whatever rate the trace is replayed at; the alternative to `join_at_s`."""

    @field_validator("block_size")
    @classmethod
    def _vllm_block_size(cls, value: int) -> int:
        """vLLM's --block-size choices (a Literal took `block_size: true` for 1)."""
        if value not in BLOCK_SIZES:
            raise ValueError(
                f"Input should be {', '.join(map(str, BLOCK_SIZES[:-1]))} or {BLOCK_SIZES[-1]}, got {value}"
            )
        return value


class SloClassSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    share: Real = Field(default=1.0, gt=0, allow_inf_nan=False)
    ttft_ms: Real = Field(ge=MIN_SLO_MS)
    itl_ms: Real = Field(ge=MIN_SLO_MS)


class RealismSpec(BaseModel):
    """What a real server adds to the step-time model's physics, so that a predictor built on the same physics
    does not find the simulator easier than a real fleet."""

    model_config = ConfigDict(extra="forbid")
    step_jitter: Real = Field(default=0.0, ge=0, le=1)
    """σ of a log-normal factor drawn for each planned step (or run of decode steps) of each endpoint."""
    speed_spread: Real = Field(default=0.0, ge=0, le=1)
    """σ of a log-normal factor drawn once per endpoint: two endpoints of one class are not equally fast."""


class FleetSpec(BaseModel):
    """A fleet file: pools, time-slice groups, publication period and KV link."""

    model_config = ConfigDict(extra="forbid")
    name: str = "fleet"
    refresh_ms: Real = Field(default=50.0, gt=0, allow_inf_nan=False)
    kv_link_gb_s: Real = Field(default=25.0, gt=0)
    pools: list[PoolSpec] = Field(min_length=1)
    timeslice_groups: dict[str, TimesliceSpec] = {}
    slos: list[SloClassSpec] = Field(default_factory=list)
    """Request classes by share of the traffic, each with its TTFT and ITL SLOs; empty: the command's SLOs."""
    realism: RealismSpec = RealismSpec()


@dataclass(frozen=True)
class Distribution:
    """A duration distribution, ready to draw from."""

    kind: str
    a: float
    b: float = 0.0

    def draw(self, rng: random.Random) -> float:
        """One duration in milliseconds."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        return rng.expovariate(1.0 / self.a)

    @property
    def mean(self) -> float:
        """The mean duration in milliseconds."""
        return (self.a + self.b) / 2.0 if self.kind == "uniform" else self.a


def _distribution(spec: DistributionSpec) -> Distribution:
    if spec.distribution == "fixed":
        return Distribution("fixed", float(spec.value or 0.0))
    if spec.distribution == "uniform":
        return Distribution("uniform", float(spec.low or 0.0), float(spec.high or 0.0))
    return Distribution("exponential", float(spec.mean or 1.0))


@dataclass(frozen=True)
class EndpointConfig:
    """One endpoint of the fleet and how it is configured."""

    endpoint_id: str
    pool: str
    accelerator: str
    model: str
    tensor_parallel: int
    role: str
    timeslice_group: str | None
    max_batched_tokens: int
    max_running: int
    block_size: int
    kv_blocks: int
    cuda_graphs: bool
    join_ms: float = 0.0
    join_share: float = 0.0
    """Joins at this share of the arrival window (the simulator resolves it against its workload)."""


@dataclass(frozen=True)
class TimesliceGroup:
    """A group of endpoints that share accelerators with another job."""

    name: str
    resident_ms: Distribution
    away_ms: Distribution
    restore_ms: Distribution


@dataclass(frozen=True)
class SloClass:
    share: float
    ttft_ms: float
    itl_ms: float


@dataclass(frozen=True)
class Fleet:
    """A parsed fleet: its endpoints and time-slice groups."""

    name: str
    refresh_ms: float
    kv_link_gb_s: float
    endpoints: tuple[EndpointConfig, ...]
    timeslice_groups: dict[str, TimesliceGroup]
    slos: tuple[SloClass, ...] = ()
    step_jitter: float = 0.0
    speed_spread: float = 0.0
    catalog: Catalog = BUILT_IN
    """The accelerator classes and models its pools may name (a deployment's own besides the built-in ones)."""

    @property
    def disaggregated(self) -> bool:
        """Whether the fleet has separate prefill and decode pools."""
        return any(e.role != "both" for e in self.endpoints)

    @property
    def join_ms(self) -> float:
        """When the last pool with a fixed `join_at_s` joins (0 without one; see `EndpointConfig.join_share`)."""
        return max((e.join_ms for e in self.endpoints), default=0.0)

    def slo_of(self, rid: int, default_ttft_ms: float, default_itl_ms: float) -> tuple[float, float]:
        """The (TTFT, ITL) SLO of request `rid`: its class by a fixed hash of the id, the same for every policy."""
        if not self.slos:
            return default_ttft_ms, default_itl_ms
        total = sum(c.share for c in self.slos)
        u = ((rid * 2654435761) % 2**32) / 2**32 * total
        for c in self.slos:
            if u < c.share:
                return c.ttft_ms, c.itl_ms
            u -= c.share
        return self.slos[-1].ttft_ms, self.slos[-1].itl_ms


def fastest_pass_ms(fleet: Fleet, roles: tuple[str, ...]) -> float:
    """The least time any endpoint of `roles` takes for one forward pass: one read of its share of the weights at
    its class's achieved memory bandwidth (the roofline of a one-token step). Every token a request gets, its
    first included, costs a pass at least: no SLO below this can be met, whatever the load or the router."""
    return min(
        decode_step_ms(
            fleet.catalog.model(e.model), fleet.catalog.accelerator(e.accelerator), 1, 0.0, e.tensor_parallel
        )
        for e in fleet.endpoints
        if e.role in roles
    )


def kv_blocks(pool: PoolSpec, catalog: Catalog = BUILT_IN) -> int:
    """Blocks left for KV after the weights, as vLLM sizes its cache from `gpu_memory_utilization`."""
    accelerator = catalog.accelerator(pool.accelerator)
    model = catalog.model(pool.model)
    budget = accelerator.memory_gb * 1e9 * pool.tensor_parallel * pool.gpu_memory_utilization
    if model.num_heads % pool.tensor_parallel:
        raise FleetError(
            f"pool {pool.name!r}: tensor_parallel {pool.tensor_parallel} does not divide {pool.model}'s "
            f"{model.num_heads} attention heads (vLLM refuses it)"
        )
    free = budget - model.weight_bytes
    blocks = math.floor(free / (model.kv_bytes_per_token(pool.tensor_parallel) * pool.block_size))
    if blocks < 1:
        raise FleetError(
            f"pool {pool.name!r}: {pool.model} ({model.weight_bytes / 1e9:.0f} GB of weights) does not fit in "
            f"{pool.gpu_memory_utilization:g} of {pool.tensor_parallel}× {pool.accelerator} "
            f"({budget / 1e9:.0f} GB); raise gpu_memory_utilization ({pool.gpu_memory_utilization:g}) or "
            "tensor_parallel"
        )
    return blocks


def build_fleet(spec: FleetSpec, catalog: Catalog = BUILT_IN) -> Fleet:
    """Check a fleet spec (roles, names, groups) and expand its pools, of `catalog`'s classes and models, into
    endpoints."""
    roles = {p.role for p in spec.pools}
    if "both" in roles and len(roles) > 1:
        raise FleetError("pools: a fleet is either unified (all 'both') or P/D ('prefill' and 'decode'), not mixed")
    if roles and "both" not in roles and roles != {"prefill", "decode"}:
        raise FleetError("pools: a P/D fleet needs at least one 'prefill' and one 'decode' pool")
    names = [p.name for p in spec.pools]
    if len(set(names)) != len(names):
        raise FleetError("pools: pool names must be unique")
    models = sorted({p.model for p in spec.pools})
    if len(models) > 1:
        # A replayed request names no model: any endpoint may get it, and a P/D pair's KV must fit both sides.
        raise FleetError(f"pools: every pool must serve the same model, got {', '.join(models)}")
    used = {p.timeslice_group for p in spec.pools}
    for name in spec.timeslice_groups:
        if name not in used:
            raise FleetError(f"timeslice_groups.{name}: no pool names it (a pool's timeslice_group)")
    endpoints: list[EndpointConfig] = []
    for pool in spec.pools:
        if pool.timeslice_group is not None and pool.timeslice_group not in spec.timeslice_groups:
            raise FleetError(f"pool {pool.name!r}: unknown timeslice_group {pool.timeslice_group!r}")
        try:
            blocks = kv_blocks(pool, catalog)
        except FeatureError as err:
            raise FleetError(f"pool {pool.name!r}: {err}; {CATALOG_HINT}") from None
        for i in range(pool.count):
            endpoints.append(
                EndpointConfig(
                    endpoint_id=f"{pool.name}-{i}",
                    pool=pool.name,
                    accelerator=pool.accelerator,
                    model=pool.model,
                    tensor_parallel=pool.tensor_parallel,
                    role=pool.role,
                    timeslice_group=pool.timeslice_group,
                    max_batched_tokens=pool.max_num_batched_tokens,
                    max_running=pool.max_num_seqs,
                    block_size=pool.block_size,
                    kv_blocks=blocks,
                    cuda_graphs=pool.cuda_graphs,
                    join_ms=pool.join_at_s * 1e3,
                    join_share=pool.join_at_share,
                )
            )
    groups = {
        name: TimesliceGroup(name, _distribution(g.resident_ms), _distribution(g.away_ms), _distribution(g.restore_ms))
        for name, g in spec.timeslice_groups.items()
    }
    for pool in spec.pools:
        if pool.join_at_s > 0 and pool.join_at_share > 0:
            raise FleetError(f"pool {pool.name!r}: give join_at_s or join_at_share, not both")
    if spec.pools and all(p.join_at_s > 0 or p.join_at_share > 0 for p in spec.pools):
        raise FleetError("pools: at least one pool must be there from the start (join_at_s 0)")
    decode = [p for p in spec.pools if p.role == "decode"]
    if decode and all(p.join_at_s > 0 or p.join_at_share > 0 for p in decode):
        # Refused here, naming the pools: the run otherwise aborted at its first request with a message naming
        # neither the file nor a pool.
        raise FleetError(
            f"pools {', '.join(repr(p.name) for p in decode)}: a P/D fleet needs a decode pool from the start "
            "(join_at_s and join_at_share 0): prefill endpoints serve no client alone"
        )
    slos = tuple(SloClass(c.share, c.ttft_ms, c.itl_ms) for c in spec.slos)
    return Fleet(
        spec.name,
        spec.refresh_ms,
        spec.kv_link_gb_s,
        tuple(endpoints),
        groups,
        slos,
        spec.realism.step_jitter,
        spec.realism.speed_spread,
        catalog,
    )


_SPECS: dict[str, type[BaseModel]] = {
    spec.__name__: spec for spec in (FleetSpec, PoolSpec, TimesliceSpec, DistributionSpec, SloClassSpec, RealismSpec)
}


def _fields(spec: type[BaseModel]) -> str:
    """The fields of a mapping of the fleet file, from its model: `pools (and optionally name, ...)`."""
    required = [name for name, field in spec.model_fields.items() if field.is_required()]
    optional = [name for name, field in spec.model_fields.items() if not field.is_required()]
    if not required:
        return f"any of {', '.join(optional)}"
    return f"{', '.join(required)} (and optionally {', '.join(optional)})" if optional else ", ".join(required)


def _takes(spec: type[BaseModel]) -> str:
    """What a mapping of the fleet file takes: pydantic's own words name the model's class ("a valid dictionary or
    instance of PoolSpec"), which a fleet file's author never sees."""
    takes = getattr(spec, "TAKES", None)
    return takes if isinstance(takes, str) else f"takes a mapping of {_fields(spec)}"


def parse_fleet(data: object, catalog: Catalog = BUILT_IN) -> Fleet:
    """A parsed YAML/JSON document → Fleet of `catalog`'s classes and models; FleetError names the offending
    field, and what it takes where it is not a mapping."""
    if not isinstance(data, dict):  # an empty file (None), a list, a bare value
        raise FleetError(f"the file holds no fleet: expected a mapping with {_fields(FleetSpec)}")
    try:
        spec = FleetSpec.model_validate(data)
    except ValidationError as err:
        where, problem = validation_problem(err)
        for error in err.errors():
            if error["type"] == "model_type" and field_path(error["loc"]) == where:
                problem = _takes(_SPECS[error.get("ctx", {})["class_name"]])
        raise FleetError(f"{where or 'fleet'}: {problem}") from None
    return build_fleet(spec, catalog)


FLEETS_DIR = Path(__file__).resolve().parent / "fleets"


def late_pools(fleet: Fleet) -> list[str]:
    """The pools that scale out during a run (`join_at_s` or `join_at_share` above 0), in the fleet's order: what a
    caller that cannot model a scale-out (`sim serve`) must say it serves from the start."""
    late = [e.pool for e in fleet.endpoints if e.join_ms > 0 or e.join_share > 0]
    return list(dict.fromkeys(late))


def shipped_fleets() -> dict[str, Path]:
    """The example fleets that ship in `fleets/`, by name (the file's stem)."""
    return {p.stem: p for p in sorted(FLEETS_DIR.glob("*.yaml"))}


def resolve_fleet(value: str | Path) -> Path:
    """A shipped fleet's name (`mixed`, `pd`, ...) or a path to a fleet YAML."""
    try:
        return resolve(value, shipped_fleets(), "a fleet YAML")
    except DataFileError as err:
        raise FleetError(str(err)) from None


def load_fleet(source: str | Path, catalog: Catalog = BUILT_IN) -> Fleet:
    """A fleet by shipped name or path, its pools of `catalog`'s classes and models; FleetError names the file and
    the problem."""
    path = resolve_fleet(source)
    try:
        data = read_yaml_file(path, "a fleet YAML")
    except ValueError as err:
        raise FleetError(str(err)) from None
    try:
        fleet = parse_fleet(data, catalog)
    except FleetError as err:
        raise FleetError(f"{path}: {err}") from None
    return fleet if _is_shipped(path) else dataclasses.replace(fleet, name=str(path))


def _is_shipped(path: Path) -> bool:
    """Whether `path` is one of the shipped fleet files. A user's file is named by its path in titles and reports:
    one copied from a shipped fleet keeps that fleet's `name:`, and its runs would read as the shipped fleet's."""
    return any(path.resolve() == shipped.resolve() for shipped in shipped_fleets().values())
