"""The shipped fleets parse and say what the routing benchmark needs; every policy runs on tiny fleets."""

from __future__ import annotations

import pytest

from leadtime.features.catalog import get_accelerator, get_model
from leadtime.simulator.engine import FleetSimulator
from leadtime.simulator.fleet import PoolSpec, kv_blocks, load_fleet, parse_fleet, shipped_fleets
from leadtime.simulator.learning_policies import LEADTIME_POLICIES
from leadtime.simulator.run import POLICY_NAMES, make_policy
from leadtime.simulator.workload import SyntheticSpec, synthetic

BENCHMARK_FLEETS = ("homogeneous", "mixed", "pd", "pd_hetero", "timesliced", "large")


def test_every_shipped_fleet_parses() -> None:
    names = set(shipped_fleets())
    assert set(BENCHMARK_FLEETS) <= names and "homogeneous-h100" not in names
    for name in names:
        assert load_fleet(name).endpoints


@pytest.mark.parametrize("name", BENCHMARK_FLEETS)
def test_benchmark_fleets_state_slo_classes_and_the_same_realism(name: str) -> None:
    fleet = load_fleet(name)
    assert fleet.name == name
    assert len(fleet.slos) >= 2 and len({(c.ttft_ms, c.itl_ms) for c in fleet.slos}) == len(fleet.slos)
    assert (fleet.step_jitter, fleet.speed_spread) == (0.08, 0.05)


def test_a_pool_wider_than_its_kv_heads_sizes_its_cache_with_them_replicated() -> None:
    """Regression: a pool of Llama-3.1-70B (8 KV heads) at TP 16 was simulated with twice the KV blocks vLLM
    allocates, since each of the 16 GPUs holds a KV head of its own; so it admitted twice the batch a real one
    does. A pool whose TP does not exceed the KV heads is sized as before."""
    model, h100 = get_model("llama-3.1-70b"), get_accelerator("h100-sxm")
    pool = PoolSpec(name="p", count=1, accelerator="h100-sxm", model="llama-3.1-70b", tensor_parallel=16)
    per_gpu_block = 2 * model.layers * 1 * model.head_dim * model.bytes_per_param * pool.block_size  # one head
    free_per_gpu = h100.memory_gb * 1e9 * pool.gpu_memory_utilization - model.weight_bytes / 16
    assert kv_blocks(pool) == pytest.approx(free_per_gpu / per_gpu_block, abs=1)
    eight = pool.model_copy(update={"tensor_parallel": 8})
    free_per_gpu = h100.memory_gb * 1e9 * pool.gpu_memory_utilization - model.weight_bytes / 8
    assert kv_blocks(eight) == pytest.approx(free_per_gpu / per_gpu_block, abs=1)  # one head a GPU, none copied


def test_pd_hetero_has_two_classes_a_side_and_a_slow_link() -> None:
    fleet = load_fleet("pd_hetero")
    for role in ("prefill", "decode"):
        assert len({e.accelerator for e in fleet.endpoints if e.role == role}) == 2
    assert fleet.kv_link_gb_s <= 12.5


def test_large_fleet_scales_out_with_a_new_class() -> None:
    fleet = load_fleet("large")
    start = [e for e in fleet.endpoints if e.join_ms == 0 and e.join_share == 0]
    later = [e for e in fleet.endpoints if e.join_share > 0]
    assert len(start) >= 32 and len({e.accelerator for e in start}) == 3
    assert fleet.refresh_ms == 200
    assert len(later) >= 8 and {e.accelerator for e in later}.isdisjoint({e.accelerator for e in start})
    assert {e.join_share for e in later} == {0.33}  # a third of the way through the run


TINY: dict[str, dict[str, object]] = {
    "unified": {
        "pools": [
            {"name": "h100", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
            {"name": "l40s", "count": 1, "accelerator": "l40s", "model": "llama-3.1-8b"},
        ],
        "slos": [{"share": 1, "ttft_ms": 1000, "itl_ms": 50}],
    },
    "pd": {
        "kv_link_gb_s": 10,
        "pools": [
            {"name": "p", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"},
            {"name": "d", "count": 2, "accelerator": "a100-sxm-80gb", "model": "llama-3.1-8b", "role": "decode"},
        ],
    },
    "timesliced": {
        "pools": [
            {"name": "own", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b"},
            {"name": "shared", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "timeslice_group": "g"},
        ],
        "timeslice_groups": {
            "g": {
                "resident_ms": {"distribution": "fixed", "value": 800},
                "away_ms": {"distribution": "fixed", "value": 600},
            }
        },
    },
    "scale_out": {
        "pools": [
            {"name": "old", "count": 2, "accelerator": "a100-sxm-80gb", "model": "llama-3.1-8b"},
            {"name": "new", "count": 2, "accelerator": "h200-sxm", "model": "llama-3.1-8b", "join_at_s": 2},
        ],
        "realism": {"step_jitter": 0.08, "speed_spread": 0.05},
    },
}


@pytest.mark.parametrize("fleet_kind", sorted(TINY))
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_runs_on_tiny_fleets(fleet_kind: str, name: str) -> None:
    fleet = parse_fleet(TINY[fleet_kind])
    workload = synthetic(SyntheticSpec(requests=60, rate_rps=12, burstiness=3.0, input_mean=1500), seed=2)
    result = FleetSimulator(
        fleet, workload, make_policy(name, seed=1, fleet=fleet), ttft_slo_ms=2000, tpot_slo_ms=100
    ).run()
    assert result.policy == name and len(result.completed) == 60
    if fleet_kind == "pd":
        assert all(c.decode_endpoint_id is not None or c.endpoint_id.startswith("d-") for c in result.completed)
    if (
        fleet_kind == "timesliced"
        and name in ("llmd_heuristic_ready", *LEADTIME_POLICIES)
        and name != "leadtime_no_timeslice"
    ):
        # Policies that read the time-slice state never send to a parked or switching endpoint while the
        # dedicated one serves.
        history = result.timeslice["g"]

        def state_at(t: float) -> str:
            return [s for at, s in history if at <= t][-1]

        shared = [c for c in result.completed if c.endpoint_id.startswith("shared")]
        assert shared and all(state_at(c.arrival_ms) == "resident" for c in shared if c.arrival_ms not in dict(history))


def test_summary_judges_each_request_against_its_own_slo_class() -> None:
    from leadtime.simulator.report import summarize

    doc = {
        **TINY["unified"],
        "slos": [{"share": 1, "ttft_ms": 1, "itl_ms": 1000}, {"share": 1, "ttft_ms": 1e6, "itl_ms": 1000}],
    }
    fleet = parse_fleet(doc)
    workload = synthetic(SyntheticSpec(requests=40, rate_rps=5), seed=1)
    result = FleetSimulator(fleet, workload, make_policy("least_queue")).run()
    summary = summarize(result)
    met = [c for c in result.completed if c.ttft_ms <= c.ttft_slo_ms and c.itl_ms <= c.itl_slo_ms]
    assert 0 < len(met) < 40  # the 1 ms class misses, the other meets
    assert summary["slo_attainment"] == pytest.approx(len(met) / 40)
    classes = summary["slo"]
    assert isinstance(classes, list) and [c["ttft_ms"] for c in classes] == [1, 1e6]
    assert sum(c["share"] for c in classes) == pytest.approx(1.0)
