"""Property-based tests (hypothesis) of the fleet simulator used as a library: small random fleets (unified, P/D with
KV links, time-sliced groups, several accelerator classes, tiny KV caches, a pool joining mid-run) replaying small
random traces (bursts at one instant, prompts of 1 token to beyond every KV cache, outputs of 1 token, shared
prefixes), each policy the simulator runs by name.

- parsing a fleet or reading a trace raises only FleetError or TraceError, naming the problem;
- a run raises nothing; every request either completes or is counted failed, exactly once;
- no TTFT, ITL or end-to-end latency is negative or NaN;
- an endpoint's KV blocks in use are never negative nor above its capacity, each block is held by a request or a
  cached prefix, and every block is free at the end;
- a time-sliced endpoint starts no step while its group is away;
- the same seed gives identical results twice.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from property_search import SEARCH

from leadtime.features.catalog import BUILT_IN
from leadtime.json_text import dumps
from leadtime.simulator.endpoint import Endpoint
from leadtime.simulator.engine import FleetSimulator, SimResult, SimulationError
from leadtime.simulator.fleet import Fleet, FleetError, parse_fleet
from leadtime.simulator.report import summarize
from leadtime.simulator.run import make_policy
from leadtime.simulator.workload import TraceError, WorkloadRequest, load_workload, shape

# more for a deeper search: SIM_EXAMPLES=1000 PROPERTY_SEARCH=random
PROPERTY = settings(SEARCH, max_examples=int(os.environ.get("SIM_EXAMPLES", "40")))
POLICIES = (
    "round_robin",
    "least_queue",
    "llmd_heuristic",
    "dynamo_kv",
    "sglang_cache",
    "llmd_predicted",
    "leadtime",
    "clairvoyant",
)
ACCELERATORS = ("h100-sxm", "h200-sxm", "l40s", "mi300x")
MODEL = "llama-3.1-8b"
SEGMENT_TOKENS = 128
"""A multiple of every block size drawn, as the simulator requires of prefix segments."""
Draw = Callable[..., Any]


def _utilisation(accelerator: str, block_size: int, kv_tokens: int, tensor_parallel: int) -> float:
    """The `gpu_memory_utilization` that leaves about `kv_tokens` tokens of KV (a block more) after the weights."""
    model = BUILT_IN.model(MODEL)
    need = model.weight_bytes + model.kv_bytes_per_token(tensor_parallel) * (kv_tokens + 2 * block_size)
    return min(1.0, need / (BUILT_IN.accelerator(accelerator).memory_gb * 1e9 * tensor_parallel))


def _duration(draw: Draw, low: float) -> dict[str, object]:
    kind = draw(st.sampled_from(("fixed", "uniform", "exponential")))
    value = draw(st.sampled_from((low, 3.0, 5.0, 40.0, 300.0, 20_000.0)))
    if kind == "fixed":
        return {"distribution": "fixed", "value": max(value, low)}
    if kind == "uniform":
        return {"distribution": "uniform", "low": low, "high": max(value, low)}
    return {"distribution": "exponential", "mean": max(value, low, 1.0)}


@st.composite
def fleet_files(draw: Draw) -> dict[str, object]:
    """A small fleet file: 1-3 pools, unified or P/D, maybe time-sliced, maybe with a pool joining mid-run."""
    roles = ["both"] if draw(st.booleans()) else ["prefill", "decode"]
    pools: list[dict[str, object]] = []
    for i in range(draw(st.integers(len(roles), 3))):
        role = roles[i] if i < len(roles) else draw(st.sampled_from(roles))
        accelerator = draw(st.sampled_from(ACCELERATORS))
        block_size = draw(st.sampled_from((1, 16, 128)))
        tensor_parallel = draw(st.sampled_from((1, 1, 2)))
        kv_tokens = draw(st.sampled_from((300, 2_000, 100_000)))
        pool: dict[str, object] = {
            "name": f"p{i}",
            "count": draw(st.integers(1, 2)),
            "accelerator": accelerator,
            "model": MODEL,
            "role": role,
            "block_size": block_size,
            "tensor_parallel": tensor_parallel,
            "gpu_memory_utilization": _utilisation(accelerator, block_size, kv_tokens, tensor_parallel),
            "max_num_batched_tokens": draw(st.sampled_from((16, 512, 8192))),
            "max_num_seqs": draw(st.sampled_from((1, 3, 256))),
        }
        if i >= len(roles) and draw(st.booleans()):
            if draw(st.booleans()):
                pool["join_at_s"] = draw(st.sampled_from((0.001, 0.003, 0.05, 4.0, 1e4)))
            else:
                pool["join_at_share"] = draw(st.sampled_from((0.3, 0.99)))
        if draw(st.integers(0, 2)) == 0:
            pool["timeslice_group"] = draw(st.sampled_from(("g0", "g1")))
        pools.append(pool)
    groups = {
        name: {"resident_ms": _duration(draw, 1.0), "away_ms": _duration(draw, 0.0), "restore_ms": _duration(draw, 0.0)}
        for name in sorted({str(p["timeslice_group"]) for p in pools if "timeslice_group" in p})
    }
    fleet: dict[str, object] = {
        "name": "fuzzed",
        "refresh_ms": draw(st.sampled_from((1.0, 3.0, 50.0, 700.0))),
        "kv_link_gb_s": draw(st.sampled_from((0.05, 25.0))),
        "pools": pools,
        "timeslice_groups": groups,
    }
    if draw(st.booleans()):
        fleet["slos"] = [{"share": 0.5, "ttft_ms": 50, "itl_ms": 20}, {"share": 0.5, "ttft_ms": 3000, "itl_ms": 200}]
    if draw(st.booleans()):
        fleet["realism"] = {"step_jitter": 0.1, "speed_spread": 0.05}
    return fleet


@st.composite
def trace_rows(draw: Draw) -> list[dict[str, object]]:
    """A small Mooncake trace: arrivals in bursts at a few instants, prompts of 1 token to beyond a KV cache, outputs
    of 1 token and more, prefixes shared between requests. Segments are `SEGMENT_TOKENS` long (`shape` keeps the
    Mooncake reader's 512; the test rewrites them)."""
    instants = draw(st.lists(st.sampled_from((0.0, 3.0, 50.0, 250.0, 4000.0)), min_size=2, max_size=3))
    rows: list[dict[str, object]] = []
    for _ in range(draw(st.integers(1, 16))):
        tokens = draw(st.one_of(st.sampled_from((1, 2, 127, 128, 129, 300, 2_100, 150_000)), st.integers(1, 3000)))
        group = draw(st.sampled_from((None, 0, 1)))
        shared = [1000 * (group + 1) + k for k in range(draw(st.integers(0, 3)))] if group is not None else []
        own = list(range(10_000 + 100 * len(rows), 10_000 + 100 * len(rows) + draw(st.integers(0, 3))))
        rows.append(
            {
                "timestamp": draw(st.sampled_from(instants)),
                "input_length": tokens,
                "output_length": draw(st.sampled_from((1, 1, 2, 40, 700))),
                "hash_ids": (shared + own)[: max(1, -(-tokens // SEGMENT_TOKENS))],
            }
        )
    return rows


def _workload(rows: list[dict[str, object]], tmp: Path) -> list[WorkloadRequest]:
    """The rows read as a trace file is (load_workload, shape), their segments made `SEGMENT_TOKENS` long."""
    path = tmp / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = shape(load_workload(str(path)))
    return [WorkloadRequest(w.arrival_ms, w.input_tokens, w.output_tokens, w.segments, SEGMENT_TOKENS) for w in loaded]


class CheckedSimulator(FleetSimulator):
    """The simulator checking, after every event, each endpoint's KV blocks, and that a time-sliced endpoint starts
    no step while its group is away."""

    def _wake(self, endpoint: Endpoint) -> None:
        before = endpoint.plan
        super()._wake(endpoint)
        group = self._group_of.get(endpoint.endpoint_id)
        if endpoint.plan is not None and endpoint.plan is not before and group is not None:
            assert group.state == "resident", f"{endpoint.endpoint_id} started a step at {self.now} while {group.state}"

    def check(self) -> None:
        for e in self.endpoints:
            cache = e.cache
            held = sum(r.private_blocks for r in (*e.running, *e.waiting))
            assert cache.private_blocks >= 0 and cache.prefix_blocks >= 0 and cache.evictable_blocks >= 0, e.endpoint_id
            assert 0 <= cache.used_blocks <= cache.total_blocks, (e.endpoint_id, cache.used_blocks, cache.total_blocks)
            assert cache.private_blocks == held, (e.endpoint_id, self.now, cache.private_blocks, held)
            assert cache.prefix_blocks == sum(x.blocks for x in cache.entries.values()), e.endpoint_id
            assert cache.evictable_blocks == sum(x.blocks for x in cache.entries.values() if x.refs == 0)
            assert all(x.refs >= 0 for x in cache.entries.values()), e.endpoint_id

    def _route(self, request: Any) -> None:
        super()._route(request)
        self.check()

    def _on_step(self, endpoint: Endpoint) -> None:
        super()._on_step(endpoint)
        self.check()

    def _on_transfer(self, r: Any) -> None:
        super()._on_transfer(r)
        self.check()

    def _on_timeslice(self, group: Any) -> None:
        super()._on_timeslice(group)
        self.check()


def _run(fleet: Fleet, workload: list[WorkloadRequest], policy: str, seed: int) -> tuple[SimResult, CheckedSimulator]:
    sim = CheckedSimulator(fleet, workload, make_policy(policy, seed, fleet), seed=seed, ttft_slo_ms=2000.0)
    return sim.run(), sim


def _figures(result: SimResult) -> str:
    """Everything a run reports but the time its decisions took on this machine."""
    return dumps(
        {
            "summary": summarize(result),
            "completed": [repr(c) for c in result.completed],
            "failed": [repr(f) for f in result.failed],
            "timeslice": result.timeslice,
            "observations": len(result.observations),
        }
    )


@PROPERTY
@given(fleet_files(), trace_rows(), st.sampled_from(POLICIES), st.integers(0, 3))
def test_a_run_accounts_for_every_request_and_every_block(
    tmp_path_factory: pytest.TempPathFactory,
    data: dict[str, object],
    rows: list[dict[str, object]],
    policy: str,
    seed: int,
) -> None:
    try:
        fleet = parse_fleet(data)
    except FleetError as err:
        assert str(err)
        return
    try:
        workload = _workload(rows, tmp_path_factory.mktemp("trace"))
    except TraceError as err:
        assert str(err)
        return
    result, sim = _run(fleet, workload, policy, seed)
    done = [c.rid for c in result.completed] + [f.rid for f in result.failed]
    assert sorted(done) == list(range(len(workload))), "every request completes or fails, exactly once"
    for c in result.completed:
        for value in (c.ttft_ms, c.itl_ms, c.e2e_ms, c.transfer_ms):
            assert not math.isnan(value) and value >= 0, c
    for f in result.failed:
        assert f.reason and f.kind in ("kv_cache", "stuck"), f
    sim.check()
    overdue = {f.rid for f in result.failed if "a day after the last arrival" in f.reason}
    for e in sim.endpoints:  # a request failed a day after the last arrival is left where it waited, holding nothing
        assert {r.rid for r in (*e.running, *e.waiting)} <= overdue, e.endpoint_id
        assert e.cache.private_blocks == 0 and e.cache.usage() == 0.0, e.endpoint_id
    again, _ = _run(fleet, workload, policy, seed)
    assert _figures(again) == _figures(result)


@st.composite
def library_workloads(draw: Draw) -> list[WorkloadRequest]:
    """Requests as a library caller builds them, not read from a trace: maybe out of arrival order, of 0 tokens, or
    with prefix segments not whole blocks on a request past the first."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        segment_tokens = draw(st.sampled_from((SEGMENT_TOKENS, SEGMENT_TOKENS, 100, 0)))
        segments = tuple(draw(st.lists(st.integers(1, 4), max_size=3)))
        out.append(
            WorkloadRequest(
                draw(st.sampled_from((0.0, 2.0, 2.0, 30.0, 30.0, -1.0, math.nan))),
                draw(st.sampled_from((0, 1, 300, 300, 1000, 1000))),
                draw(st.sampled_from((0, 1, 1, 20, 20))),
                segments,
                segment_tokens,
            )
        )
    return out


@settings(PROPERTY, max_examples=min(PROPERTY.max_examples, 60))
@given(fleet_files(), library_workloads(), st.sampled_from(("round_robin", "leadtime", "clairvoyant")))
def test_a_workload_the_simulator_cannot_run_is_refused_at_once(
    data: dict[str, object], workload: list[WorkloadRequest], policy: str
) -> None:
    """FleetSimulator refuses a workload it cannot run (SimulationError naming the request) before running it: a
    prompt of 0 tokens raised ZeroDivisionError in the step-time model, segments not whole blocks on any request but
    the first were taken, and requests out of arrival order gave a goodput of 2e9 requests per second."""
    try:
        fleet = parse_fleet(data)
    except FleetError:
        return
    try:
        sim = CheckedSimulator(fleet, workload, make_policy(policy, 0, fleet), ttft_slo_ms=2000.0)
    except SimulationError as err:
        assert "request" in str(err)
        return
    result = sim.run()
    assert sorted([c.rid for c in result.completed] + [f.rid for f in result.failed]) == list(range(len(workload)))
    assert result.arrival_span_ms >= 0
    for c in result.completed:
        assert c.ttft_ms >= 0 and c.itl_ms >= 0 and c.output_tokens >= 1, c
