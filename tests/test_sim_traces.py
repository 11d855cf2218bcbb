"""Simulated llm-d traces: rows as llm-d's sidecar records them, deterministic and cached."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from leadtime.bench.data import dataset_path, load_llmd_rows
from leadtime.simulator import traces
from leadtime.simulator.traces import TraceSpec, record, staged_workload

SMALL = TraceSpec("h200-qwen3", "long-chat", stages_qps=(1, 4), stage_s=20.0, timeout_s=15.0)
_STATE = (
    "kv_cache_percentage",
    "input_token_length",
    "num_request_waiting",
    "num_request_running",
    "prefill_tokens_in_flight",
    "decode_tokens_in_flight",
)


def test_workload_follows_the_stages_and_the_prompt_mix() -> None:
    workload = staged_workload(TraceSpec("h200-qwen3", "long-chat", stages_qps=(2, 8), stage_s=60.0))
    first = [w for w in workload if w.arrival_ms < 60_000]
    assert 80 < len(first) < 160 and 360 < len(workload) - len(first) < 600  # Poisson at 2 then 8 QPS
    prompts = sorted(w.input_tokens for w in workload)
    assert 5500 < prompts[len(prompts) // 2] < 7500 and prompts[-1] <= 12600
    assert max(w.output_tokens for w in workload) <= 1024
    assert all(not w.segments for w in workload)  # prefix caching off: no shared blocks


def test_rows_are_what_llmd_records_one_ttft_and_one_tpot_row_per_request() -> None:
    rows = record(SMALL)
    assert rows == record(SMALL)  # deterministic
    ttft = [r for r in rows if r["actual_ttft_ms"] > 0]
    tpot = [r for r in rows if r["actual_tpot_ms"] > 0]
    assert len(ttft) + len(tpot) == len(rows) and len(tpot) <= len(ttft)
    assert all(r["actual_tpot_ms"] == 0 and r["num_tokens_generated"] == 0 for r in ttft)
    assert all(r["actual_ttft_ms"] == 0 and r["num_tokens_generated"] == 0 for r in tpot)
    assert set(rows[0]) == set(traces._LLMD_FIELDS)  # llm-d's schema alone
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps)  # in recording order: first tokens and completions as they happen
    # A TPOT row carries the state its request arrived to, as its TTFT row does.
    states = {tuple(r[k] for k in _STATE) for r in ttft}
    assert all(tuple(r[k] for k in _STATE) in states for r in tpot)
    assert all(r["prefill_tokens_in_flight"] % 64 == 0 for r in rows)
    # Heavy queueing happens, and the client's timeout bounds it.
    assert max(r["num_request_waiting"] for r in rows) > 10
    assert max(r["actual_ttft_ms"] for r in ttft) < 15_000 + 10_000


def test_named_traces_are_generated_once_and_then_read_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LEADTIME_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(traces.TRACES, "tiny", SMALL)
    path = dataset_path("sim:tiny")
    assert path.parent == tmp_path / "traces"
    stamp = path.stat().st_mtime_ns
    assert dataset_path("sim:tiny") == path and path.stat().st_mtime_ns == stamp
    assert len(load_llmd_rows(path)) == len(record(SMALL))
    with pytest.raises(ValueError, match="sim:bimodal"):
        dataset_path("sim:nope")


def test_fleet_traces_keep_the_class_and_role_of_each_row() -> None:
    spec = TraceSpec("pd", "bimodal", stages_qps=(8,), stage_s=5.0, extras=True)
    rows = record(spec)
    assert {r["pod_type"] for r in rows if r["actual_ttft_ms"] > 0} == {"prefill"}
    assert {r["pod_type"] for r in rows if r["actual_tpot_ms"] > 0} == {"decode"}
    assert {r["accelerator"] for r in rows} == {"h100-sxm", "h200-sxm"}


def test_a_client_that_never_gives_up_has_every_request_recorded_however_long_it_waited() -> None:
    patient = TraceSpec("h200-qwen3", "long-chat", stages_qps=(1, 4), stage_s=20.0, timeout_s=math.inf)
    rows = record(patient)
    sent = len(staged_workload(patient))
    assert sum(r["actual_ttft_ms"] > 0 for r in rows) == sent
    # the same requests, once those queued past SMALL's 15 s timeout were given up on: they waited longer
    assert max(r["actual_ttft_ms"] for r in rows) > max(r["actual_ttft_ms"] for r in record(SMALL))
    assert "long-chat-no-timeout" in traces.TRACES and traces.TRACES["long-chat-no-timeout"].timeout_s == math.inf


def test_a_request_its_client_gave_up_on_is_shown_queued_until_the_next_publication() -> None:
    """Regression: a client's timeout took its request out of the endpoint's queue without the state published to
    routers being kept first, so rows recorded after that publication instant counted one waiting request fewer than
    the endpoint had at it (131 of 361 routing decisions at 4 and 8 QPS with a 5 s timeout)."""
    spec = TraceSpec("h200-qwen3", "long-chat", stages_qps=(4, 8), stage_s=30.0, timeout_s=5.0)
    fleet = traces.load_fleet(spec.fleet)
    sim = traces._ClientSimulator(
        fleet, staged_workload(spec), traces._RecordingRouter(0), seed=0, timeout_ms=spec.timeout_s * 1e3
    )
    expire = sim._expire
    unkept: list[float] = []

    def expiring() -> None:
        before = {e.endpoint_id: len(e.waiting) for e in sim.endpoints}
        expire()
        for e in sim.endpoints:
            if len(e.waiting) < before[e.endpoint_id] and sim._frozen_at.get(e.endpoint_id, -1.0) < sim._published_at:
                unkept.append(sim.now)

    sim._expire = expiring  # type: ignore[method-assign]
    sim.run()
    assert len(sim.aborted) > 50  # the timeout did act
    assert unkept == []
