"""The policies that learn while they route, built for one fleet: Leadtime (and its ablations), llm-d's
predicted-latency router, and plain policies with Leadtime's predictor learning beside them.

Each starts cold: a fresh in-process predictor that knows only the accelerator catalog's physics, learning from
every request the simulation completes. The P/D link bandwidth is the fleet's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.llmd_reference import LlmdReference
from leadtime.router_plugin.client import InProcessPredictor
from leadtime.router_plugin.config import PickerConfig, build_policy
from leadtime.router_plugin.heuristics import LeastQueuePolicy, RoundRobinPolicy
from leadtime.router_plugin.peers.llmd_predicted import LlmdPredictedPolicy
from leadtime.router_plugin.policy import RoutingPolicy
from leadtime.router_plugin.predicted import LeadtimeConfig, LeadtimePolicy
from leadtime.router_plugin.shadow import ShadowLearning
from leadtime.simulator.fleet import Fleet
from leadtime.simulator.replicas import ReplicatedPolicy

LEADTIME_POLICIES: dict[str, dict[str, Any]] = {
    "leadtime": {},
    "leadtime_no_inflight": {"inflight": False},
    "leadtime_no_hardware": {"hardware": False},
    "leadtime_decode_first": {"joint_pairs": False},
    "leadtime_no_timeslice": {"timeslice": False},
    "leadtime_no_decode_harm": {"decode_harm": False},
    "leadtime_in_turn": {"comfort_tolerance": 0.1},
    "leadtime_hold": {"hold_slo_multiple": 1.0},
    "leadtime_overflow_timesliced": {},  # and the switches its fleet gives it (FLEET_SWITCHES)
}


PROFILE_PREFIX = "profile:"
"""`--policy profile:NAME`: the profile NAME of the plugin configuration (`--config`, else the shipped one)."""

REPLICATED_POLICIES: dict[str, tuple[int, bool]] = {"leadtime_x4": (4, False), "leadtime_x4_shared": (4, True)}
"""Leadtime as four gateway replicas beside one predictor: (replicas, whether they share their ledgers)."""

SHADOW_POLICIES: dict[str, Callable[[int], RoutingPolicy]] = {
    "round_robin_shadow": lambda seed: RoundRobinPolicy(),
    "least_queue_shadow": lambda seed: LeastQueuePolicy(seed),
}
"""A plain policy routing while Leadtime's predictor predicts its picks and learns (`router_plugin.shadow`)."""


def timesliced_endpoints(fleet: Fleet) -> tuple[str, ...]:
    """The endpoints of `fleet` that share their accelerators with another job, in the fleet's order."""
    return tuple(e.endpoint_id for e in fleet.endpoints if e.timeslice_group)


FLEET_SWITCHES: dict[str, Callable[[Fleet], dict[str, Any]]] = {
    "leadtime_overflow_timesliced": lambda fleet: {"overflow_endpoints": timesliced_endpoints(fleet)},
}
"""Switches of a Leadtime policy that name something of the fleet it routes."""


def cold_predictor(fleet: Fleet, seed: int = 0) -> InProcessPredictor:
    """A fresh in-process predictor for `fleet`: the physics of its first endpoint's class and model, nothing
    learned."""
    first = fleet.endpoints[0]
    learner = OnlinePredictor(
        LearnerConfig(
            accelerator=first.accelerator, model=first.model, background=False, seed=seed, catalog=fleet.catalog
        )
    )
    return InProcessPredictor(learner, learner.config.quantile)


def leadtime_policy(name: str, fleet: Fleet, seed: int = 0) -> RoutingPolicy:
    """A cold-started Leadtime policy (or one of its ablations) for `fleet`."""
    switches = LEADTIME_POLICIES[name] | FLEET_SWITCHES.get(name, lambda _: {})(fleet)
    config = LeadtimeConfig(name=name, kv_link_gb_s=fleet.kv_link_gb_s, seed=seed, catalog=fleet.catalog, **switches)
    return LeadtimePolicy(cold_predictor(fleet, seed), config)


def replicated_policy(name: str, fleet: Fleet, seed: int = 0) -> ReplicatedPolicy:
    """Leadtime routed by several replicas over one cold-started predictor (see `simulator.replicas`)."""
    count, shared = REPLICATED_POLICIES[name]
    client = cold_predictor(fleet, seed)
    replicas = [
        LeadtimePolicy(client, LeadtimeConfig(name=name, kv_link_gb_s=fleet.kv_link_gb_s, seed=seed + i))
        for i in range(count)
    ]
    return ReplicatedPolicy(replicas, shared, name)


def shadow_policy(name: str, fleet: Fleet, seed: int = 0) -> ShadowLearning:
    """A plain policy with a cold-started predictor learning beside it (no deadline: the predictor is in process)."""
    return ShadowLearning(SHADOW_POLICIES[name](seed), cold_predictor(fleet, seed), None)


def profile_policy(profile: str, config: PickerConfig, fleet: Fleet, seed: int = 0) -> RoutingPolicy:
    """A scheduling profile of a plugin configuration, as `leadtime route` would build it, over a cold in-process
    predictor (used only if the profile predicts); named `profile:NAME` in results."""
    policy = build_policy(config, cold_predictor(fleet, seed), profile, seed, fleet.catalog)
    policy.name = f"{PROFILE_PREFIX}{profile}"
    return policy


def llmd_predicted_policy(fleet: Fleet, seed: int = 0) -> LlmdPredictedPolicy:
    """llm-d's predicted-latency router over llm-d's predictor as published, cold, retrained every 10 s."""
    return LlmdPredictedPolicy(LlmdReference(retrain_every=None, seed=seed), seed=seed)


def learning_factories(fleet: Fleet, seed: int) -> dict[str, Callable[[], RoutingPolicy]]:
    factories: dict[str, Callable[[], RoutingPolicy]] = {
        name: partial(leadtime_policy, name, fleet, seed) for name in LEADTIME_POLICIES
    }
    factories.update({name: partial(replicated_policy, name, fleet, seed) for name in REPLICATED_POLICIES})
    factories.update({name: partial(shadow_policy, name, fleet, seed) for name in SHADOW_POLICIES})
    factories["llmd_predicted"] = partial(llmd_predicted_policy, fleet, seed)
    return factories
