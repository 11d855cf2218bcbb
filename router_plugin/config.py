"""The plugin's configuration, in the shape of llm-d's EndpointPickerConfig: plugins with parameters, and a
scheduling profile that lists which of them run and with what weight.

    kind: EndpointPickerConfig
    plugins:
    - type: timeslice-filter                 # drop endpoints whose accelerator group serves another job
      parameters: {servingJob: inference}
    - type: inflight-accounting              # add what this router sent since each endpoint's last scrape
    - type: predicted-latency-scorer         # SLO headroom from predicted TTFT/ITL (scorers/latency.py)
      parameters: {exploration: 0.02, disaggregation: joint, localPrefill: true, kvLinkGbS: 25}
    - type: prefix-cache-scorer
    - type: queue-scorer
    - type: kv-cache-utilization-scorer
    - type: max-score-picker
    schedulingProfiles:
    - name: default
      plugins:
      - pluginRef: timeslice-filter
      - pluginRef: inflight-accounting
      - pluginRef: predicted-latency-scorer
        weight: 1
      - pluginRef: max-score-picker
    fallback:                                # when the predictor fails or misses its deadline
      deadlineMs: 20
      weights: {prefix-cache-scorer: 3, queue-scorer: 2, kv-cache-utilization-scorer: 2}

A profile with the predicted-latency scorer becomes a `LeadtimePolicy`; heuristic scorers listed beside it with
a weight add their weighted scores to its score on unified fleets (on P/D fleets pairs are ranked by the
latency scorer alone). A profile without it is llm-d's heuristic pipeline. Every mistake is a `ConfigError`
naming the field; what loads but has no effect (llm-d's keys and parameters Leadtime does not act on, a weight on
a filter or picker, a parameter its `disaggregation` mode or another setting overrides, inflight-accounting beside
heuristic scorers alone, a plugin listed in no profile) is in `PickerConfig.warnings`, a line each.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.errors import expected_mapping, field_path, validation_problem
from leadtime.features.rows import MAX_COUNT
from leadtime.router_plugin.client import PredictorClient, require_predictor_client
from leadtime.router_plugin.heuristics import ScoringPolicy, WeightedScorer, resident_filter
from leadtime.router_plugin.policy import RoutingPolicy
from leadtime.router_plugin.predicted import LeadtimeConfig, LeadtimePolicy
from leadtime.router_plugin.scorers.latency import OVERFLOW_CHOICES
from leadtime.router_plugin.scorers.load import kv_utilization_scorer, prefix_cache_scorer, queue_scorer
from leadtime.router_plugin.timeslice import SERVING_JOB
from leadtime.yaml_text import Boolean, Integer, Real, read_yaml_file

HEURISTIC_SCORERS = {
    "prefix-cache-scorer": prefix_cache_scorer,
    "queue-scorer": queue_scorer,
    "kv-cache-utilization-scorer": kv_utilization_scorer,
}
LLMD_STRUCTURAL = (
    "single-profile-handler",
    "pd-profile-handler",
    "prefill-header-handler",
    "decode-filter",
    "prefill-filter",
)
"""llm-d's profile handlers and role filters, accepted so that its configs load, and not used: the router keeps
prefill and decode endpoints apart by their role itself, and decides disaggregation and the (prefill, decode) pair
by prediction (or, in the heuristic profile, as llm-d's default P/D pipeline). Their llm-d parameters are checked
(`LLMD_STRUCTURAL_PARAMETERS`) and each one given is warned about; those without take none."""
PLUGIN_TYPES = (
    "predicted-latency-scorer",
    "inflight-accounting",
    "timeslice-filter",
    "max-score-picker",
    *HEURISTIC_SCORERS,
    *LLMD_STRUCTURAL,
)
SCORER_TYPES = ("predicted-latency-scorer", *HEURISTIC_SCORERS)
"""The plugins that score endpoints: a profile needs one weighing above 0, else its picker picks at random."""
LLMD_TOP_LEVEL = {"featureGates": "feature_gates", "saturationDetector": "saturation_detector", "data": "data"}
"""Top-level keys of llm-d's EndpointPickerConfig (by their field names here), accepted so that its configs load,
and not used: Leadtime has no feature gates, sheds no load on saturation, and scrapes endpoints itself."""
LLMD_WEIGHTS = {"prefix-cache-scorer": 3.0, "queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0}
DEFAULT_DEADLINE_MS = 20.0
"""`fallback.deadlineMs` when the configuration does not say: how long a decision waits for the predictor."""


class ConfigError(ValueError):
    """The plugin configuration is malformed; the message names the field."""


class _Model(BaseModel):
    # Every number finite: `overflowCap: .inf` passed here, then the policy refused it (a traceback in `route`).
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class LatencyParameters(_Model):
    exploration: Real = Field(default=0.02, ge=0.0, le=1.0)
    comfort: Real = Field(default=0.5, ge=0.0, le=1.0)
    comfort_tolerance: Real = Field(default=0.0, ge=0.0, le=1.0, alias="comfortTolerance")
    overflow: str = "auto"  # one of OVERFLOW_CHOICES (checked below: the one list of them)
    overflow_cap: Real = Field(default=5.0, ge=0.0, alias="overflowCap")
    overflow_cap_share: Real = Field(default=0.25, ge=0.0, le=1.0, alias="overflowCapShare")
    overflow_endpoints: list[str] = Field(default=[], alias="overflowEndpoints")
    hold_slo_multiple: Real = Field(default=0.0, ge=0.0, alias="holdSloMultiple")
    disaggregation: Literal["joint", "decode-first"] = "joint"
    local_prefill: Boolean = Field(default=True, alias="localPrefill")
    decode_harm: Boolean = Field(default=True, alias="decodeHarm")
    local_prefill_itl_share: Real = Field(default=0.5, gt=0.0, le=1.0, alias="localPrefillItlShare")
    disaggregate_min_tokens: Integer = Field(default=16, ge=0, le=MAX_COUNT, alias="disaggregateMinTokens")
    kv_link_gb_s: Real = Field(default=25.0, gt=0, alias="kvLinkGbS")
    hardware: Boolean = True
    seed: Integer | None = Field(default=None, ge=0, le=MAX_COUNT)  # unset: the seed the caller gives

    @field_validator("overflow")
    @classmethod
    def _overflow_choice(cls, value: str) -> str:
        if value not in OVERFLOW_CHOICES:
            raise ValueError(f"must be one of {', '.join(OVERFLOW_CHOICES)}, got {value!r}")
        return value

    @field_validator("overflow_endpoints")
    @classmethod
    def _distinct_ids(cls, ids: list[str]) -> list[str]:
        if any(not i for i in ids):
            raise ValueError("endpoint ids must not be empty")
        if len(set(ids)) != len(ids):
            raise ValueError(f"each endpoint may be named once, got {ids}")
        return ids


class TimesliceParameters(_Model):
    serving_job: str = Field(default=SERVING_JOB, min_length=1, alias="servingJob")


class _LlmdParameters(_Model):
    """Parameters of an llm-d plugin Leadtime takes and does not act on: checked as llm-d would (a number where it
    takes one), so that a typo is caught, and each one given is warned about, with its field's description as the
    reason (`PickerConfig.warnings`)."""

    plugin: ClassVar[str]


_OWN_PREFIX_HITS = "the router estimates prefix hits itself, from what it sent each endpoint"
_ONE_PROFILE = "Leadtime runs the one profile --profile names, for prefill and decode endpoints alike"


class PdHandlerParameters(_LlmdParameters):
    plugin = "pd-profile-handler"
    threshold: int = Field(
        default=0,
        ge=0,
        strict=True,
        description="Leadtime decides per request, by predicted latency, whether to disaggregate (a profile without "
        "the predicted-latency-scorer always does; for a fixed threshold, see disaggregateMinTokens with "
        "disaggregation: decode-first)",
    )
    hash_block_size: int = Field(
        default=16,
        gt=0,
        strict=True,
        alias="hashBlockSize",
        description=_OWN_PREFIX_HITS,
    )
    prefix_plugin_name: str = Field(
        default="prefix-cache-scorer",
        strict=True,
        alias="prefixPluginName",
        description=_OWN_PREFIX_HITS,
    )
    decode_profile: str = Field(
        default="decode",
        strict=True,
        alias="decodeProfile",
        description=_ONE_PROFILE,
    )
    prefill_profile: str = Field(
        default="prefill",
        strict=True,
        alias="prefillProfile",
        description=_ONE_PROFILE,
    )
    primary_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        strict=True,
        alias="primaryPort",
        description="requests go to the port the discovery names for the decode endpoint",
    )


class PrefillHeaderParameters(_LlmdParameters):
    plugin = "prefill-header-handler"
    prefill_profile: str = Field(
        default="prefill",
        strict=True,
        alias="prefillProfile",
        description="the gateway names the prefill endpoint it chose in x-prefiller-host-port itself",
    )


LLMD_STRUCTURAL_PARAMETERS: dict[str, type[_LlmdParameters]] = {
    model.plugin: model for model in (PdHandlerParameters, PrefillHeaderParameters)
}
"""The parameters llm-d's structural plugins take (`LLMD_STRUCTURAL`; those not here take none)."""


PARAMETERS: dict[str, type[BaseModel]] = {
    "predicted-latency-scorer": LatencyParameters,
    "timeslice-filter": TimesliceParameters,
}
"""The plugins that take parameters; the others take none but llm-d's own (`LLMD_ONLY_PARAMETERS`)."""

LLMD_ONLY_PARAMETERS: dict[str, frozenset[str]] = {
    "prefix-cache-scorer": frozenset({"hashBlockSize", "maxPrefixBlocksToMatch", "lruCapacityPerServer"}),
    "max-score-picker": frozenset({"maxNumOfEndpoints"}),
}
"""Parameters llm-d's plugins of the same name take, accepted so that llm-d's own configs load, and not used:
this prefix scorer estimates hits from what the router sent (`affinity.py`), and the picker returns one endpoint."""


class PluginSpec(_Model):
    type: Literal[PLUGIN_TYPES]  # type: ignore[valid-type]
    name: str | None = None
    parameters: dict[str, Any] = {}

    @field_validator("parameters", mode="before")
    @classmethod
    def _null_is_empty(cls, value: object) -> object:
        """`parameters:` with every child commented out is YAML's null: no parameters, as an empty mapping is."""
        return {} if value is None else value

    @property
    def ref(self) -> str:
        return self.name or self.type


Weight = Annotated[Real, Field(ge=0.0, allow_inf_nan=False)]
"""A scorer's weight: a number (an integer or not) as written, since `weight: true` or `weight: "2"` is a mistake
that pydantic would otherwise take as 1 or 2; `weight: 1e3`, which PyYAML reads as text, is 1000."""


class ProfilePlugin(_Model):
    plugin_ref: str = Field(alias="pluginRef")
    weight: Weight = 1.0


class ProfileSpec(_Model):
    name: str = Field(default="default", min_length=1)
    plugins: list[ProfilePlugin] = Field(min_length=1)


class FallbackSpec(_Model):
    deadline_ms: Real = Field(default=DEFAULT_DEADLINE_MS, gt=0, le=60_000, allow_inf_nan=False, alias="deadlineMs")
    weights: dict[Literal[tuple(HEURISTIC_SCORERS)], Weight] = dict(LLMD_WEIGHTS)  # type: ignore[valid-type]

    @field_validator("weights", mode="before")
    @classmethod
    def _null_is_default(cls, value: object) -> object:
        """`weights:` with every weight commented out is YAML's null: not given, so llm-d's (an empty mapping, which
        weighs nothing, is refused)."""
        return dict(LLMD_WEIGHTS) if value is None else value


class PickerConfig(_Model):
    kind: Literal["EndpointPickerConfig"] = "EndpointPickerConfig"
    api_version: str | None = Field(default=None, alias="apiVersion")
    plugins: list[PluginSpec] = Field(min_length=1)
    scheduling_profiles: list[ProfileSpec] = Field(min_length=1, alias="schedulingProfiles")
    fallback: FallbackSpec = FallbackSpec()
    feature_gates: Any = Field(default=None, alias="featureGates")
    saturation_detector: Any = Field(default=None, alias="saturationDetector")
    data: Any = None
    _source: str | None = PrivateAttr(default=None)
    """The file it was read from (`load_config`), for errors found after parsing, such as a missing profile."""

    _notes: list[str] = PrivateAttr(default_factory=list)
    """What loads but has no effect, found by `parse_config`: a line each, naming the key."""

    @field_validator("fallback", mode="before")
    @classmethod
    def _null_is_empty(cls, value: object) -> object:
        """`fallback:` with every child commented out is YAML's null: the defaults, as an empty mapping is."""
        return {} if value is None else value

    @property
    def unused_llmd_keys(self) -> list[str]:
        """llm-d's top-level keys the file gives (`LLMD_TOP_LEVEL`), which a user should be told go unused."""
        return [key for key, field in LLMD_TOP_LEVEL.items() if field in self.model_fields_set]

    @property
    def warnings(self) -> list[str]:
        """A line for each thing the file gives that has no effect (llm-d's top-level keys in one line), prefixed
        with the file's name when it was read from one; the CLI prints them as warnings."""
        keys = self.unused_llmd_keys
        lines = [f"llm-d's {', '.join(keys)} are accepted and not used by Leadtime"] if keys else []
        where = f"{self._source}: " if self._source else ""
        return [where + line for line in lines + self._notes]


DEFAULT_CONFIG: dict[str, Any] = {
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "timeslice-filter"},
        {"type": "inflight-accounting"},
        {"type": "predicted-latency-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "timeslice-filter"},
                {"pluginRef": "inflight-accounting"},
                {"pluginRef": "predicted-latency-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


EXPECTED = {
    **{model.__name__: expected_mapping(model) for model in (PluginSpec, ProfileSpec, ProfilePlugin, FallbackSpec)},
    "parameters": "expected a mapping of the plugin's parameters",
    "weights": "expected a mapping of scorer names to weights",
}
"""What a misshapen part of the file should be, by its model's class or by the mapping field's name
(`validation_problem`'s `expected`)."""


def _describe(err: ValidationError) -> str:
    where, problem = validation_problem(err, EXPECTED)
    for error in err.errors():
        if field_path(error["loc"]) == where and error["type"] in ("float_type", "int_type"):
            # strict: `true` or `"2"` given for a number
            got = repr(error.get("input"))
            problem += f", got {got if len(got) <= 40 else got[:40] + '…'}"
    return f"{where or 'config'}: {problem}"


def parse_config(data: object) -> PickerConfig:
    """A parsed YAML/JSON document → PickerConfig; ConfigError names the offending field. What loads but has no
    effect is in the result's `warnings`."""
    if not isinstance(data, Mapping):  # an empty file (None), a list, a bare value
        raise ConfigError("the file holds no configuration: expected a mapping with plugins and schedulingProfiles")
    try:
        config = PickerConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err)) from None
    refs = [p.ref for p in config.plugins]
    duplicates = {r for r in refs if refs.count(r) > 1}
    if duplicates:
        raise ConfigError(f"plugins: the name {sorted(duplicates)[0]!r} is used twice")
    notes = config._notes
    for i, spec in enumerate(config.plugins):
        parameters = PARAMETERS.get(spec.type)
        if spec.type in LLMD_STRUCTURAL:
            notes.extend(_llmd_parameters(spec, f"plugins[{i}]"))
        elif parameters is LatencyParameters:
            notes.extend(_mode_warnings(_parameters(LatencyParameters, spec, f"plugins[{i}]"), f"plugins[{i}]"))
        elif parameters is not None:
            _parameters(parameters, spec, f"plugins[{i}]")
        elif unknown := sorted(set(spec.parameters or ()) - LLMD_ONLY_PARAMETERS.get(spec.type, frozenset())):
            llmd = sorted(LLMD_ONLY_PARAMETERS.get(spec.type, ()))
            besides = f" (llm-d's {', '.join(llmd)} are accepted and not used)" if llmd else ""
            raise ConfigError(f"plugins[{i}].parameters: {spec.type} takes no parameters{besides}, got {unknown}")
    names = [p.name for p in config.scheduling_profiles]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"schedulingProfiles[{i}].name: the profile {name!r} is defined twice")
    types = {p.ref: p.type for p in config.plugins}
    for i, profile in enumerate(config.scheduling_profiles):
        listed: list[str] = []
        for j, entry in enumerate(profile.plugins):
            where = f"schedulingProfiles[{i}].plugins[{j}].pluginRef"
            if entry.plugin_ref not in refs:
                raise ConfigError(f"{where}: no plugin named {entry.plugin_ref!r}")
            if entry.plugin_ref in listed:
                raise ConfigError(f"{where}: {entry.plugin_ref!r} is listed twice (one entry, one weight)")
            if types[entry.plugin_ref] == "predicted-latency-scorer" and any(
                types[r] == "predicted-latency-scorer" for r in listed
            ):
                raise ConfigError(f"{where}: a profile takes one predicted-latency-scorer")
            listed.append(entry.plugin_ref)
            if "weight" in entry.model_fields_set and types[entry.plugin_ref] not in SCORER_TYPES:
                notes.append(
                    f"schedulingProfiles[{i}].plugins[{j}].weight: {types[entry.plugin_ref]} is not a scorer, "
                    "so its weight has no effect"
                )
        if "predicted-latency-scorer" not in {types[r] for r in listed}:
            notes.extend(
                f"schedulingProfiles[{i}].plugins[{j}].pluginRef: inflight-accounting has no effect in profile "
                f"{profile.name!r}, which has no predicted-latency-scorer: the heuristic scorers read each "
                "endpoint's load as last scraped"
                for j, entry in enumerate(profile.plugins)
                if types[entry.plugin_ref] == "inflight-accounting"
            )
        if not any(types[e.plugin_ref] in SCORER_TYPES and e.weight > 0 for e in profile.plugins):
            raise ConfigError(
                f"schedulingProfiles[{i}]: profile {profile.name!r} has no scorer weighing above 0 "
                f"({', '.join(SCORER_TYPES)}): its picker would pick at random"
            )
    listed_anywhere = {e.plugin_ref for profile in config.scheduling_profiles for e in profile.plugins}
    notes.extend(
        f"plugins[{i}]: {spec.ref!r} is listed in no scheduling profile, so it has no effect"
        for i, spec in enumerate(config.plugins)
        if spec.ref not in listed_anywhere and spec.type not in LLMD_STRUCTURAL  # llm-d's handlers are not listed
    )
    if not any(weight > 0 for weight in config.fallback.weights.values()):
        raise ConfigError("fallback.weights: at least one weight must be above 0 (with none, fallbacks pick at random)")
    return config


SHIPPED_CONFIG = Path(__file__).resolve().parent / "plugins.yaml"
"""The configuration `leadtime route` and `leadtime simulate` use without `--config`: profiles default and
heuristic."""


def load_config(path: Path) -> PickerConfig:
    """The configuration in the file at `path`, read as fleet and catalog files are (`read_yaml_file`: a regular
    file of at most 1 MiB; `--config /dev/zero` was read until memory ran out); ConfigError naming the file."""
    try:
        data = read_yaml_file(Path(path), "a plugin configuration YAML")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        config = parse_config(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    config._source = str(path)
    return config


def _parameters(model: type[BaseModel], spec: PluginSpec, where: str) -> Any:
    try:
        return model.model_validate(spec.parameters)
    except ValidationError as err:
        raise ConfigError(f"{where}.parameters.{_describe(err)}") from None


def _llmd_parameters(spec: PluginSpec, where: str) -> list[str]:
    """Check the parameters of one of llm-d's structural plugins as llm-d takes them: a line for each one given,
    saying why it is not used; ConfigError for a known one of the wrong type. One this project does not know llm-d
    to take is a warning too, not a refusal: a newer llm-d may take it, and a config of its must still load."""
    model = LLMD_STRUCTURAL_PARAMETERS.get(spec.type)
    names = {} if model is None else {field.alias or name: name for name, field in model.model_fields.items()}
    unknown = [key for key in spec.parameters if key not in names]
    lines = [
        f"{where}.parameters.{key}: not a parameter llm-d's {spec.type} is known to take; not used" for key in unknown
    ]
    if model is None:
        return lines
    known = {key: value for key, value in spec.parameters.items() if key in names}
    given = _parameters(model, spec.model_copy(update={"parameters": known}), where).model_fields_set
    return [
        f"{where}.parameters.{field.alias or name}: llm-d's {spec.type} {field.alias or name} is not used: "
        f"{field.description}"
        for name, field in model.model_fields.items()
        if name in given
    ] + lines


def _mode_warnings(latency: LatencyParameters, where: str) -> list[str]:
    """A line for each parameter of the predicted-latency scorer given where it has no effect: in a `disaggregation`
    mode that does not read it, or beside a setting that overrides it (see `predicted.LeadtimePolicy._pick_pair`)."""
    given = latency.model_fields_set
    joint = latency.disaggregation == "joint"
    said: list[tuple[str, str]] = []
    if joint and "disaggregate_min_tokens" in given:
        said.append(("disaggregateMinTokens", "ignored with disaggregation: joint, which decides by prediction"))
    if not joint and "local_prefill" in given:
        said.append(
            (
                "localPrefill",
                "ignored with disaggregation: decode-first: a prompt below disaggregateMinTokens is prefilled on "
                "the decode endpoint, one at or above it never is",
            )
        )
    if not joint and "local_prefill_itl_share" in given:
        said.append(("localPrefillItlShare", "ignored with disaggregation: decode-first (it acts in joint)"))
    elif joint and not latency.local_prefill and "local_prefill_itl_share" in given:
        said.append(("localPrefillItlShare", "no effect with localPrefill: false (no decode endpoint prefills)"))
    if latency.overflow == "sink" and "overflow_cap" in given:
        said.append(("overflowCap", "no effect with overflow: sink, which never caps the overflow endpoint"))
    if latency.comfort == 0 and "comfort_tolerance" in given:
        said.append(("comfortTolerance", "no effect with comfort: 0, which never ranks candidates by mean TTFT"))
    return [f"{where}.parameters.{key}: {text}" for key, text in said]


def profile_of(config: PickerConfig, name: str) -> ProfileSpec:
    """The scheduling profile called `name`; ConfigError listing the profiles there are."""
    chosen = next((p for p in config.scheduling_profiles if p.name == name), None)
    if chosen is None:
        known = ", ".join(p.name for p in config.scheduling_profiles)
        where = f"{config._source}: " if config._source else ""
        raise ConfigError(
            f"{where}schedulingProfiles: no profile named {name!r} (profiles: {known}): Leadtime runs one profile, "
            "for prefill and decode endpoints alike, chosen with --profile NAME (simulate: --policy profile:NAME)"
        )
    return chosen


def profile_types(config: PickerConfig, name: str) -> frozenset[str]:
    """The plugin types the profile `name` runs."""
    plugins = {p.ref: p.type for p in config.plugins}
    return frozenset(plugins[e.plugin_ref] for e in profile_of(config, name).plugins)


def profile_parameters(config: PickerConfig, profile: str, plugin_type: str) -> Any:
    """The parameters (`PARAMETERS`) of the `plugin_type` plugin the profile `profile` runs, None when it runs none:
    what the gateway and the simulator read beside the policy (`servingJob`, `overflowEndpoints`) must be what the
    policy was built with."""
    plugins = {p.ref: p for p in config.plugins}
    for entry in profile_of(config, profile).plugins:
        spec = plugins[entry.plugin_ref]
        if spec.type == plugin_type:
            return _parameters(PARAMETERS[plugin_type], spec, f"plugins.{spec.ref}")
    return None


def build_policy(
    config: PickerConfig | Mapping[str, Any] | str | Path | None,
    predictor: PredictorClient | None,
    profile: str = "default",
    seed: int = 0,
    catalog: Catalog = BUILT_IN,
) -> RoutingPolicy:
    """The policy a scheduling profile describes, over `predictor` (needed when it uses predicted latency).
    `config`: a parsed configuration, its document (a mapping), a YAML file's path (`SHIPPED_CONFIG`, say, as a
    `Path` or a `str`), or None for the default profile alone. `catalog`: the accelerator classes and models the
    endpoints may be of."""
    if isinstance(config, str | Path):
        config = load_config(Path(config))
    if not isinstance(config, PickerConfig):
        config = parse_config(DEFAULT_CONFIG if config is None else config)
    chosen = profile_of(config, profile)
    plugins = {p.ref: p for p in config.plugins}
    used = [(plugins[e.plugin_ref], e.weight) for e in chosen.plugins]
    types = {spec.type for spec, _ in used}
    heuristics = [
        WeightedScorer(HEURISTIC_SCORERS[spec.type], weight)
        for spec, weight in used
        if spec.type in HEURISTIC_SCORERS and weight > 0
    ]
    if "predicted-latency-scorer" not in types:
        filters = [resident_filter] if "timeslice-filter" in types else []
        return ScoringPolicy(chosen.name, heuristics, filters, seed=seed)
    if predictor is None:
        raise ConfigError(
            "the predicted-latency-scorer needs a predictor (--predictor-url, --predictor-grpc or --embedded; "
            "in Python, a PredictorClient)"
        )
    require_predictor_client(predictor)
    latency_weight = next(weight for spec, weight in used if spec.type == "predicted-latency-scorer")
    latency: LatencyParameters = profile_parameters(config, profile, "predicted-latency-scorer")
    timeslice: TimesliceParameters | None = profile_parameters(config, profile, "timeslice-filter")
    leadtime = LeadtimeConfig(
        name=chosen.name if chosen.name != "default" else "leadtime",
        inflight="inflight-accounting" in types,
        hardware=latency.hardware,
        joint_pairs=latency.disaggregation == "joint",
        timeslice=timeslice is not None,
        local_prefill=latency.local_prefill,
        decode_harm=latency.decode_harm,
        local_prefill_itl_share=latency.local_prefill_itl_share,
        disaggregate_min_tokens=latency.disaggregate_min_tokens,
        exploration=latency.exploration,
        comfort=latency.comfort,
        comfort_tolerance=latency.comfort_tolerance,
        overflow=latency.overflow,
        overflow_cap=latency.overflow_cap,
        overflow_cap_share=latency.overflow_cap_share,
        overflow_endpoints=tuple(latency.overflow_endpoints),
        hold_slo_multiple=latency.hold_slo_multiple,
        kv_link_gb_s=latency.kv_link_gb_s,
        serving_job=timeslice.serving_job if timeslice else SERVING_JOB,
        seed=seed if latency.seed is None else latency.seed,
        catalog=catalog,
    )
    fallback = ScoringPolicy(
        "fallback",
        [WeightedScorer(HEURISTIC_SCORERS[n], w) for n, w in config.fallback.weights.items() if w > 0],
        [resident_filter],
        seed=seed,
    )
    return LeadtimePolicy(
        predictor,
        leadtime,
        deadline_s=config.fallback.deadline_ms / 1e3,
        latency_weight=latency_weight,
        extra_scorers=heuristics,
        fallback=fallback,
    )
