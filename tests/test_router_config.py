"""The plugin configuration (llm-d's EndpointPickerConfig shape): parsing, errors naming the field, policies."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from test_router_plugin import QueueModel, cand, req

from leadtime.router_plugin.config import ConfigError, FallbackSpec, build_policy, load_config, parse_config
from leadtime.router_plugin.heuristics import ScoringPolicy
from leadtime.router_plugin.predicted import LeadtimePolicy

SHIPPED = Path(__file__).resolve().parents[1] / "router_plugin" / "plugins.yaml"


def test_the_shipped_config_builds_both_profiles() -> None:
    config = load_config(SHIPPED)
    policy = build_policy(config, QueueModel())
    assert isinstance(policy, LeadtimePolicy)
    assert policy.config.inflight and policy.config.timeslice and policy.config.joint_pairs
    assert policy.config.exploration == 0.02 and policy.deadline_s == pytest.approx(0.02)
    assert (policy.config.overflow_cap, policy.config.overflow_cap_share) == (5.0, 0.25)
    assert policy.config.comfort == 0.5 and policy.config.local_prefill_itl_share == 0.5
    assert policy.config.comfort_tolerance == 0.0  # taking near-equal candidates in turn is off by default
    assert policy.config.decode_harm
    heuristic = build_policy(config, None, profile="heuristic")
    assert isinstance(heuristic, ScoringPolicy) and [w.weight for w in heuristic.scorers] == [3, 2, 2]


def test_defaults_without_a_file() -> None:
    policy = build_policy(None, QueueModel())
    assert isinstance(policy, LeadtimePolicy) and policy.extra_scorers == []


def test_weights_and_parameters_reach_the_policy() -> None:
    config = {
        "plugins": [
            {
                "type": "predicted-latency-scorer",
                "parameters": {
                    "disaggregation": "decode-first",
                    "exploration": 0,
                    "overflowCap": 3,
                    "comfort": 0.3,
                    "comfortTolerance": 0.1,
                    "localPrefillItlShare": 0.8,
                    "decodeHarm": False,
                    "overflowEndpoints": ["b", "a"],
                    "holdSloMultiple": 0,
                },
            },
            {"type": "kv-cache-utilization-scorer", "name": "kv"},
        ],
        "schedulingProfiles": [
            {"plugins": [{"pluginRef": "predicted-latency-scorer", "weight": 2}, {"pluginRef": "kv", "weight": 0.5}]}
        ],
        "fallback": {"deadlineMs": 5},
    }
    policy = build_policy(config, QueueModel())
    assert isinstance(policy, LeadtimePolicy)
    assert not policy.config.joint_pairs and not policy.config.inflight and not policy.config.timeslice
    assert policy.latency_weight == 2 and [w.weight for w in policy.extra_scorers] == [0.5]
    assert policy.config.overflow_cap == 3.0 and policy.config.comfort == 0.3
    assert policy.config.comfort_tolerance == 0.1
    assert policy.config.local_prefill_itl_share == 0.8 and not policy.config.decode_harm
    assert policy.config.overflow_endpoints == ("b", "a") and policy.config.hold_slo_multiple == 0.0
    assert policy.deadline_s == pytest.approx(0.005)
    # Both predicted alike (the model ignores KV use): the weighted KV scorer tips it towards the emptier cache.
    full, empty = cand("a"), cand("b")
    full = replace(full, state=replace(full.state, kv_cache_percentage=0.9))
    assert policy.pick(req(), [full, empty]).endpoint_id == "b"
    assert policy.pick(req("r2"), [empty, full]).endpoint_id == "b"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (
            {"plugins": [{"type": "magic-scorer"}], "schedulingProfiles": [{"plugins": [{"pluginRef": "x"}]}]},
            "plugins[0].type",
        ),
        (
            {"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": [{"plugins": [{"pluginRef": "nope"}]}]},
            "pluginRef",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}, {"type": "queue-scorer"}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "queue-scorer"}]}],
            },
            "used twice",
        ),
        (
            {
                "plugins": [{"type": "predicted-latency-scorer", "parameters": {"exploration": 2}}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
            },
            "exploration",
        ),
        (
            {
                "plugins": [{"type": "predicted-latency-scorer", "parameters": {"overflowCapShare": 1.5}}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
            },
            "overflowCapShare",
        ),
        (
            {
                "plugins": [{"type": "predicted-latency-scorer", "parameters": {"holdSloMultiple": -1}}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
            },
            "holdSloMultiple",
        ),
        (
            {
                "plugins": [{"type": "predicted-latency-scorer", "parameters": {"comfort": 1.5}}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
            },
            "comfort",
        ),
        (
            {
                "plugins": [{"type": "predicted-latency-scorer", "parameters": {"localPrefillItlShare": 0}}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
            },
            "localPrefillItlShare",
        ),
        (
            {
                "plugins": [{"type": "predicted-latency-scorer", "parameters": {"overflowEndpoints": ["a", "a"]}}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
            },
            "overflowEndpoints",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "queue-scorer", "weight": -1}]}],
            },
            "weight",
        ),
        ({"plugins": [], "schedulingProfiles": []}, "plugins"),
        (  # the value refused is named, and the path is written one way
            {"plugins": [{"type": "queue-scorrer"}], "schedulingProfiles": [{"plugins": [{"pluginRef": "x"}]}]},
            "or 'prefill-filter', got 'queue-scorrer'",
        ),
        (
            {"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": [{"plugins": [{"pluginRef": "nope"}]}]},
            "schedulingProfiles[0].plugins[0].pluginRef: no plugin named 'nope'",
        ),
        (  # a misspelled key is named rather than the key it hides
            {"plugins": [{"type": "queue-scorer"}], "schedulingprofiles": [{"plugins": [{"pluginRef": "x"}]}]},
            "schedulingprofiles: ",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [
                    {
                        "plugins": [
                            {"pluginRef": "queue-scorer", "weight": 1},
                            {"pluginRef": "queue-scorer", "weight": 5},
                        ]
                    }
                ],
            },
            "schedulingProfiles[0].plugins[1].pluginRef: 'queue-scorer' is listed twice",
        ),
        (
            {
                "plugins": [
                    {"type": "predicted-latency-scorer"},
                    {"type": "predicted-latency-scorer", "name": "second", "parameters": {"exploration": 0.5}},
                ],
                "schedulingProfiles": [
                    {"plugins": [{"pluginRef": "predicted-latency-scorer"}, {"pluginRef": "second"}]}
                ],
            },
            "schedulingProfiles[0].plugins[1].pluginRef: a profile takes one predicted-latency-scorer",
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "queue-scorer"}]}],
                "fallback": {
                    "weights": {"queue-scorer": 0, "prefix-cache-scorer": 0, "kv-cache-utilization-scorer": 0}
                },
            },
            "fallback.weights: at least one weight must be above 0",
        ),
        (
            {
                "plugins": [{"type": "predicted-latency-scorer", "parameters": {"overflow": "spill"}}],
                "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
            },
            "plugins[0].parameters.overflow: must be one of auto, least_bad, sink, got 'spill'",
        ),
    ],
)
def test_mistakes_name_the_field(config: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        build_policy(parse_config(config) if field != "exploration" else config, QueueModel())


def test_a_latency_profile_without_a_predictor_and_a_missing_profile_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a predictor"):
        build_policy(None, None)
    with pytest.raises(ConfigError, match=r"no profile named 'fast' \(profiles: default\)"):
        build_policy(None, QueueModel(), profile="fast")
    bad = tmp_path / "bad.yaml"
    bad.write_text("plugins: [\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    bad.write_text("plugins: [{type: queue-scorer}]\nschedulingProfiles: []\nplugins: []\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML .*the key 'plugins' is given twice"):
        load_config(bad)
    with pytest.raises(ConfigError, match="missing.yaml: no such file"):
        load_config(tmp_path / "missing.yaml")


def test_llmds_profile_handlers_and_role_filters_load_and_do_nothing() -> None:
    """A config written for llm-d (its single- and P/D profile handlers, its role filters) did not load: Leadtime
    routes by role itself and picks P/D pairs by prediction, so these are accepted and not used."""
    llmd = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "single-profile-handler"},
            {"type": "pd-profile-handler", "parameters": {"threshold": 100, "hashBlockSize": 5}},
            {"type": "prefill-header-handler"},
            {"type": "decode-filter"},
            {"type": "prefill-filter"},
            {"type": "prefix-cache-scorer", "parameters": {"hashBlockSize": 5, "maxPrefixBlocksToMatch": 256}},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "decode-filter"},
                    {"pluginRef": "max-score-picker"},
                    {"pluginRef": "prefix-cache-scorer", "weight": 50},
                ],
            }
        ],
    }
    policy = build_policy(parse_config(llmd), None)
    assert isinstance(policy, ScoringPolicy)
    assert policy.name == "default" and [s.weight for s in policy.scorers] == [50.0]


def test_a_learner_given_where_a_predictor_client_goes_is_refused_at_build() -> None:
    """`build_policy(config, OnlinePredictor())` was accepted; the first pick then failed with an AttributeError."""
    from leadtime.predictor.learner import LearnerConfig, OnlinePredictor

    with pytest.raises(TypeError, match=r"predictor must be a PredictorClient, got OnlinePredictor \(in process"):
        build_policy(None, OnlinePredictor(LearnerConfig(background=False)))  # type: ignore[arg-type]


def test_build_policy_takes_a_configuration_file_by_path() -> None:
    """`build_policy(SHIPPED_CONFIG, ...)` said "config: Input should be a valid dictionary"."""
    from leadtime.router_plugin.config import SHIPPED_CONFIG

    assert build_policy(SHIPPED_CONFIG, None, profile="heuristic").name == "heuristic"


@pytest.mark.parametrize(
    "entries",
    [
        [{"pluginRef": "queue-scorer", "weight": 0}, {"pluginRef": "max-score-picker"}],
        [{"pluginRef": "timeslice-filter"}, {"pluginRef": "max-score-picker"}],
    ],
)
def test_a_profile_with_no_scorer_above_weight_0_is_refused(entries: list[dict[str, object]]) -> None:
    """A profile whose scorers all weigh 0, or that has none (filters and a picker), routed at random."""
    config = {
        "plugins": [{"type": "queue-scorer"}, {"type": "timeslice-filter"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {"name": "fine", "plugins": [{"pluginRef": "queue-scorer"}]},
            {"name": "mine", "plugins": entries},
        ],
    }
    with pytest.raises(ConfigError, match=r"^schedulingProfiles\[1\]: profile 'mine' has no scorer weighing above 0"):
        parse_config(config)


def test_llmds_own_top_level_keys_load_unused_and_typos_are_still_refused() -> None:
    """A real llm-d EndpointPickerConfig with featureGates (saturationDetector, data) was refused."""
    config = {
        "featureGates": ["prepareDataPlugins"],
        "saturationDetector": {"queueDepthThreshold": 5},
        "data": {"sources": []},
        "plugins": [{"type": "queue-scorer"}],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "queue-scorer"}]}],
    }
    parsed = parse_config(config)
    assert parsed.unused_llmd_keys == ["featureGates", "saturationDetector", "data"]
    plain = {k: v for k, v in config.items() if k in ("plugins", "schedulingProfiles")}
    assert parse_config(plain).unused_llmd_keys == [] and parse_config(plain).warnings == []
    with pytest.raises(ConfigError, match="schedulingProfile: Extra inputs are not permitted"):
        parse_config({**config, "schedulingProfile": []})


def test_a_missing_profile_names_the_configuration_file(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: mine, plugins: [{pluginRef: queue-scorer}]}]\n"
    )
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(mine))}: schedulingProfiles: no profile named 'default'"):
        build_policy(load_config(mine), None)


# ----- what a misshapen file says it expects ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "data,expected",
    [
        (None, "the file holds no configuration: expected a mapping with plugins and schedulingProfiles"),
        ([], "the file holds no configuration: expected a mapping with plugins and schedulingProfiles"),
        ({"plugins": ["queue-scorer"], "schedulingProfiles": []}, "plugins[0]: expected a mapping {type, name, "),
        (
            {"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": ["default"]},
            "schedulingProfiles[0]: expected a mapping {name, plugins}",
        ),
        (
            {"plugins": [{"type": "queue-scorer"}], "schedulingProfiles": [{"plugins": ["queue-scorer"]}]},
            "schedulingProfiles[0].plugins[0]: expected a mapping {pluginRef, weight}",
        ),
        (
            {"plugins": [{"type": "queue-scorer", "parameters": 5}], "schedulingProfiles": []},
            "plugins[0].parameters: expected a mapping of the plugin's parameters",
        ),
    ],
)
def test_a_misshapen_file_says_what_it_expects(data: object, expected: str) -> None:
    """An empty file said "config: Input should be a valid dictionary or instance of PickerConfig", a bare-string
    plugin "...or instance of PluginSpec": class names the author of a YAML file never sees."""
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).startswith(expected), err.value
    assert "instance of" not in str(err.value)


def test_parameters_left_null_are_empty_parameters(tmp_path: Path) -> None:
    """`parameters:` with every child commented out is YAML's null: it was refused as not a dictionary."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "plugins:\n- type: predicted-latency-scorer\n  parameters:\n    # exploration: 0.1\n"
        "- type: timeslice-filter\n  parameters:\n- type: max-score-picker\n  parameters:\n"
        "schedulingProfiles:\n- plugins: [{pluginRef: predicted-latency-scorer}, {pluginRef: timeslice-filter}]\n"
    )
    policy = build_policy(load_config(mine), QueueModel())
    assert isinstance(policy, LeadtimePolicy) and policy.config.exploration == 0.02


def test_a_fallback_left_null_is_the_default_fallback(tmp_path: Path) -> None:
    """`fallback:` (or its `weights:`) with every child commented out is YAML's null: the file was refused as if
    the block were misshapen, where `parameters:` left so loads as no parameters."""
    mine = tmp_path / "mine.yaml"
    profile = "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{plugins: [{pluginRef: queue-scorer}]}]\n"
    mine.write_text(profile + "fallback:\n  # deadlineMs: 50\n")
    assert load_config(mine).fallback == FallbackSpec()
    mine.write_text(profile + "fallback:\n  deadlineMs: 50\n  weights:\n    # queue-scorer: 1\n")
    fallback = load_config(mine).fallback
    assert fallback.deadline_ms == 50 and fallback.weights == FallbackSpec().weights


# ----- llm-d's P/D configuration ---------------------------------------------------------------------------------

LLMD_PD = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "prefill-header-handler"},
        {"type": "prefix-cache-scorer", "parameters": {"hashBlockSize": 5, "maxPrefixBlocksToMatch": 256}},
        {"type": "queue-scorer"},
        {"type": "prefill-filter"},
        {"type": "decode-filter"},
        {"type": "max-score-picker"},
        {"type": "pd-profile-handler", "parameters": {"threshold": 10, "hashBlockSize": 5}},
    ],
    "schedulingProfiles": [
        {
            "name": "prefill",
            "plugins": [
                {"pluginRef": "prefill-filter"},
                {"pluginRef": "max-score-picker"},
                {"pluginRef": "prefix-cache-scorer", "weight": 50},
            ],
        },
        {
            "name": "decode",
            "plugins": [
                {"pluginRef": "decode-filter"},
                {"pluginRef": "max-score-picker"},
                {"pluginRef": "prefix-cache-scorer", "weight": 50},
                {"pluginRef": "queue-scorer", "weight": 1},
            ],
        },
    ],
}


def test_llmds_pd_handler_threshold_is_warned_about_by_key() -> None:
    """`threshold` was dropped in silence: Leadtime decides disaggregation by prediction."""
    warnings = parse_config(LLMD_PD).warnings
    threshold = [w for w in warnings if w.startswith("plugins[6].parameters.threshold: ")]
    assert len(threshold) == 1, warnings
    assert "llm-d's pd-profile-handler threshold is not used" in threshold[0]
    assert "disaggregateMinTokens" in threshold[0] and "without the predicted-latency-scorer always" in threshold[0]
    assert any(w.startswith("plugins[6].parameters.hashBlockSize: ") for w in warnings), warnings
    assert all("\n" not in w for w in warnings)


@pytest.mark.parametrize(
    "plugin,field",
    [
        ({"type": "pd-profile-handler", "parameters": {"threshold": "abc"}}, "plugins[0].parameters.threshold"),
        ({"type": "pd-profile-handler", "parameters": {"threshold": -1}}, "plugins[0].parameters.threshold"),
        ({"type": "pd-profile-handler", "parameters": {"threshold": True}}, "plugins[0].parameters.threshold"),
    ],
)
def test_llmds_structural_plugins_parameters_are_checked(plugin: dict[str, object], field: str) -> None:
    """`pd-profile-handler` took `{threshold: "abc", bogus: 1}` without a word."""
    config = {
        "plugins": [plugin, {"type": "queue-scorer"}],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "queue-scorer"}]}],
    }
    with pytest.raises(ConfigError, match="^" + re.escape(field)):
        parse_config(config)


@pytest.mark.parametrize(
    "plugin,field",
    [
        ({"type": "pd-profile-handler", "parameters": {"deciderPluginName": "x"}}, "deciderPluginName"),
        ({"type": "decode-filter", "parameters": {"bogus": 1}}, "bogus"),
        ({"type": "single-profile-handler", "parameters": {"x": 1}}, "x"),
    ],
)
def test_a_parameter_of_an_llmd_plugin_not_known_here_is_a_warning_not_a_refusal(
    plugin: dict[str, object], field: str
) -> None:
    """A newer llm-d may take parameters this project does not know of: its configs must still load."""
    config = {
        "plugins": [plugin, {"type": "queue-scorer"}],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "queue-scorer"}]}],
    }
    warnings = parse_config(config).warnings
    assert f"plugins[0].parameters.{field}: not a parameter llm-d's {plugin['type']} is known to take; not used" in (
        warnings
    ), warnings


def test_an_llmd_pd_config_without_profile_says_to_choose_one(tmp_path: Path) -> None:
    mine = tmp_path / "pd.yaml"
    mine.write_text(yaml.safe_dump(LLMD_PD))
    with pytest.raises(ConfigError, match=r"no profile named 'default' \(profiles: prefill, decode\).*--profile NAME"):
        build_policy(load_config(mine), None)
    assert isinstance(build_policy(load_config(mine), None, profile="decode"), ScoringPolicy)


# ----- weights ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight", [True, "2", None])
def test_a_weight_that_is_not_a_number_is_refused_naming_it(weight: object) -> None:
    """`weight: true` was taken as 1 and `weight: "2"` as 2."""
    config = {
        "plugins": [{"type": "queue-scorer"}],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "queue-scorer", "weight": weight}]}],
    }
    with pytest.raises(ConfigError, match=r"^schedulingProfiles\[0\]\.plugins\[0\]\.weight: "):
        parse_config(config)
    fallback = {
        "plugins": [{"type": "queue-scorer"}],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "queue-scorer"}]}],
    }
    with pytest.raises(ConfigError, match=r"^fallback\.weights\.queue-scorer: "):
        parse_config({**fallback, "fallback": {"weights": {"queue-scorer": weight}}})


@pytest.mark.parametrize("weight", ["1e3", "1.0e3", "1e+3"])
def test_a_weight_in_exponent_notation_is_the_number_it_reads_as(tmp_path: Path, weight: str) -> None:
    """PyYAML reads `1e3` as text (its YAML 1.1 wants `1.0e+3`): the strict weight refused it as "not a valid
    number, got '1e3'"."""
    path = tmp_path / "plugins.yaml"
    path.write_text(
        "plugins: [{type: queue-scorer}]\n"
        f"schedulingProfiles: [{{plugins: [{{pluginRef: queue-scorer, weight: {weight}}}]}}]\n"
        f"fallback: {{weights: {{queue-scorer: {weight}}}}}\n"
    )
    config = load_config(path)
    assert config.scheduling_profiles[0].plugins[0].weight == 1000.0 == config.fallback.weights["queue-scorer"]


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("overflowCap", INF, "finite"),
        ("holdSloMultiple", INF, "finite"),
        ("kvLinkGbS", INF, "finite"),
        ("exploration", NAN, "finite"),
        ("comfort", NAN, "finite"),
        ("comfortTolerance", NAN, "finite"),
        ("overflowCapShare", NAN, "finite"),
        ("localPrefillItlShare", NAN, "finite"),
        ("seed", 10**30, "less than or equal to 9007199254740992"),
        ("disaggregateMinTokens", 10**30, "less than or equal to 9007199254740992"),
        ("exploration", True, "must be a number, got True"),  # explored at every decision
        ("overflowCap", "5", "must be a number, got '5'"),
        ("disaggregateMinTokens", True, "valid integer"),
        ("seed", "3", "valid integer"),
    ],
)
def test_a_latency_parameter_the_policy_would_refuse_is_refused_naming_the_file_and_field(
    tmp_path: Path, key: str, value: object, problem: str
) -> None:
    """`overflowCap: .inf` passed the configuration's checks, then the policy refused it (FeatureError), which
    `leadtime route` did not catch: a traceback. Every parameter is checked where the file is read."""
    document = yaml.safe_load(SHIPPED.read_text())
    document["plugins"][2]["parameters"][key] = value
    path = tmp_path / "plugins.yaml"
    path.write_text(yaml.safe_dump(document))  # .inf, .nan as YAML writes them
    with pytest.raises(ConfigError) as caught:
        build_policy(load_config(path), QueueModel())
    assert str(caught.value).startswith(f"{path}: plugins[2].parameters.{key}: "), caught.value
    assert problem in str(caught.value)


def test_integer_and_fractional_weights_are_taken() -> None:
    config = {
        "plugins": [{"type": "queue-scorer"}, {"type": "prefix-cache-scorer"}],
        "schedulingProfiles": [
            {
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 0.5},
                ]
            }
        ],
    }
    policy = build_policy(parse_config(config), None)
    assert isinstance(policy, ScoringPolicy) and [s.weight for s in policy.scorers] == [2.0, 0.5]


def test_a_weight_on_a_filter_or_picker_is_warned_about() -> None:
    config = {
        "plugins": [{"type": "timeslice-filter"}, {"type": "queue-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {
                "plugins": [
                    {"pluginRef": "timeslice-filter", "weight": 2},
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "max-score-picker"},
                ]
            }
        ],
    }
    assert parse_config(config).warnings == [
        "schedulingProfiles[0].plugins[0].weight: timeslice-filter is not a scorer, so its weight has no effect"
    ]


# ----- parameters that act only in one disaggregation mode -------------------------------------------------------


def latency(parameters: dict[str, object]) -> dict[str, object]:
    return {
        "plugins": [{"type": "predicted-latency-scorer", "parameters": parameters}],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
    }


@pytest.mark.parametrize(
    "parameters,key,says",
    [
        ({"disaggregateMinTokens": 100}, "disaggregateMinTokens", "ignored with disaggregation: joint"),
        ({"disaggregation": "decode-first", "localPrefill": False}, "localPrefill", "below disaggregateMinTokens"),
        ({"disaggregation": "decode-first", "localPrefillItlShare": 0.3}, "localPrefillItlShare", "decode-first"),
        ({"localPrefill": False, "localPrefillItlShare": 0.3}, "localPrefillItlShare", "localPrefill: false"),
        ({"overflow": "sink", "overflowCap": 3}, "overflowCap", "overflow: sink"),
        ({"comfort": 0, "comfortTolerance": 0.5}, "comfortTolerance", "comfort: 0"),
    ],
)
def test_parameters_without_effect_in_their_mode_are_warned_about(
    parameters: dict[str, object], key: str, says: str
) -> None:
    warnings = parse_config(latency(parameters)).warnings
    assert len(warnings) == 1 and warnings[0].startswith(f"plugins[0].parameters.{key}: "), warnings
    assert says in warnings[0]


def test_inflight_accounting_in_a_profile_without_the_latency_scorer_is_warned_about() -> None:
    """The heuristic scorers read each endpoint's load as last scraped (a heuristic profile keeps no ledger of what
    it sent since): listed beside them, inflight-accounting loaded and changed nothing, without a word."""
    config = {
        "plugins": [{"type": "inflight-accounting"}, {"type": "queue-scorer"}, {"type": "predicted-latency-scorer"}],
        "schedulingProfiles": [
            {"name": "heuristic", "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "inflight-accounting"}]},
            {
                "name": "predicted",
                "plugins": [{"pluginRef": "inflight-accounting"}, {"pluginRef": "predicted-latency-scorer"}],
            },
        ],
    }
    warnings = parse_config(config).warnings
    assert len(warnings) == 1 and warnings[0].startswith("schedulingProfiles[0].plugins[1].pluginRef: "), warnings
    assert "inflight-accounting" in warnings[0] and "'heuristic'" in warnings[0]


def test_the_shipped_config_warns_of_nothing() -> None:
    assert load_config(SHIPPED).warnings == []
    assert parse_config(latency({"disaggregation": "decode-first", "disaggregateMinTokens": 64})).warnings == []


def test_a_plugin_in_no_profile_is_warned_about() -> None:
    """A scorer defined under `plugins` and listed in no profile (its `pluginRef` forgotten) loaded and did nothing,
    without a word; llm-d's profile handlers, which its profiles never list, are not warned about for that."""
    config = {
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer", "name": "kv"},
            {"type": "single-profile-handler"},
            {"type": "timeslice-filter", "parameters": {"servingJob": "serve"}},
        ],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "queue-scorer"}]}],
    }
    assert parse_config(config).warnings == [
        "plugins[1]: 'kv' is listed in no scheduling profile, so it has no effect",
        "plugins[3]: 'timeslice-filter' is listed in no scheduling profile, so it has no effect",
    ]


def test_a_profile_named_with_nothing_is_refused_naming_it() -> None:
    """`name: ''` loaded, and the gateway then stopped with "no profile named 'default' (profiles: )"."""
    config = {
        "plugins": [{"type": "queue-scorer"}],
        "schedulingProfiles": [{"name": "", "plugins": [{"pluginRef": "queue-scorer"}]}],
    }
    with pytest.raises(ConfigError, match=r"^schedulingProfiles\[0\]\.name: String should have at least 1 character"):
        parse_config(config)


@pytest.mark.parametrize("key", ["hardware", "localPrefill", "decodeHarm"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1, "yes"])
def test_a_switch_that_is_not_true_or_false_is_refused_naming_it(key: str, value: object) -> None:
    """A switch written `'no'` or `1` was read as pydantic reads it (a quoted 'no' is False, 1 is True), where a fleet
    file's switch must be true or false: one file's `hardware: 'no'` ran with the feature off, another's refused."""
    config = {
        "plugins": [{"type": "predicted-latency-scorer", "parameters": {key: value}}],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
    }
    with pytest.raises(ConfigError, match=re.escape(f"plugins[0].parameters.{key}: ")):
        parse_config(config)
    config["plugins"][0]["parameters"][key] = False  # type: ignore[index]
    parse_config(config)


def test_a_key_that_is_not_a_name_is_named_as_a_key() -> None:
    """`parameters: {1: 2}` was blamed on `plugins[0].parameters[1].[key]`, as if the parameters were a list."""
    config = {
        "plugins": [{"type": "predicted-latency-scorer", "parameters": {1: 2}}],
        "schedulingProfiles": [{"plugins": [{"pluginRef": "predicted-latency-scorer"}]}],
    }
    with pytest.raises(ConfigError, match=re.escape("plugins[0].parameters (its key 1): ")):
        parse_config(config)
