"""State-conditioned replay: hand-made rows whose answer is known from the step model, and the figures on the
shipped measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leadtime.data import MEASURED
from leadtime.features.errors import FeatureError
from leadtime.features.rows import FeatureRow, feature_row_from_llmd
from leadtime.simulator.endpoint import Endpoint, SimRequest
from leadtime.simulator.kvcache import KVCache
from leadtime.simulator.replay import (
    ReplayedRow,
    ReplayError,
    StateReplay,
    by_load_quintile,
    load_rows,
    measured_fidelity,
    replay_file,
)

BASE = {
    "input_token_length": 100,
    "num_request_waiting": 0,
    "num_request_running": 0,
    "kv_cache_percentage": 0.0,
    "num_tokens_generated": 0,
    "prefix_cache_score": 0.0,
}


@pytest.fixture(scope="module")
def replay() -> StateReplay:
    return StateReplay("h200-sxm", "qwen3-32b")


def _row(**fields: object) -> FeatureRow:
    return feature_row_from_llmd({**BASE, **fields})


def _kv_share(replay: StateReplay, blocks: int) -> float:
    """The KV reading at which the running requests hold `blocks` blocks in all."""
    return blocks / replay.kv_blocks


def test_idle_endpoint_ttft_is_the_own_prefill_step(replay: StateReplay) -> None:
    # Nothing in flight: the request is scheduled at once and samples its first token at the end of its prefill.
    assert replay.ttft_ms(_row()) == pytest.approx(replay.stepper.step_ms([(100, 0)], 0, 0.0), rel=1e-12)


def test_busy_endpoint_ttft_waits_for_the_step_in_flight_and_the_one_planned_ahead(replay: StateReplay) -> None:
    # Four running requests of 10 blocks (160 tokens) each; decode KV of a step = Σ (context + 1).
    row = _row(num_request_running=4, kv_cache_percentage=_kv_share(replay, 40))
    s = replay.stepper
    in_flight = s.step_ms([], 4, 4 * 161.0)
    planned_ahead = s.step_ms([], 4, 4 * 162.0)
    own = s.step_ms([(100, 0)], 4, 4 * 163.0)
    assert replay.ttft_ms(row) == pytest.approx(in_flight / 2 + planned_ahead + own, rel=1e-9)
    sync = StateReplay("h200-sxm", "qwen3-32b", async_scheduling=False)
    assert sync.ttft_ms(row) == pytest.approx(in_flight / 2 + s.step_ms([(100, 0)], 4, 4 * 162.0), rel=1e-9)


def test_queued_prefill_is_laid_out_among_the_waiting_requests_under_the_token_budget(replay: StateReplay) -> None:
    s = replay.stepper
    two_waiting = _row(num_request_waiting=2, prefill_tokens_in_flight=600)
    assert replay.ttft_ms(two_waiting) == pytest.approx(s.step_ms([(300, 0), (300, 0), (100, 0)], 0, 0.0), rel=1e-12)
    # 9,000 tokens ahead exceed the 8,192-token budget: the rest of the queued prompt shares the next step.
    over_budget = _row(prefill_tokens_in_flight=9000)
    expected = s.step_ms([(8192, 0)], 0, 0.0) + s.step_ms([(808, 8192), (100, 0)], 0, 0.0)
    assert replay.ttft_ms(over_budget) == pytest.approx(expected, rel=1e-12)


def test_waiting_requests_without_prefill_in_flight_have_the_requests_own_length(replay: StateReplay) -> None:
    row = _row(num_request_waiting=1)
    assert replay.ttft_ms(row) == pytest.approx(replay.stepper.step_ms([(100, 0), (100, 0)], 0, 0.0), rel=1e-12)


def test_tpot_of_a_request_alone_is_its_decode_step(replay: StateReplay) -> None:
    replay3 = StateReplay("h200-sxm", "qwen3-32b", output_tokens=3)
    s = replay3.stepper
    # After its prefill (100 tokens computed) it decodes two tokens, one sequence with KV 101 then 102.
    expected = (s.step_ms([], 1, 101.0) + s.step_ms([], 1, 102.0)) / 2
    assert replay3.tpot_ms(_row()) == pytest.approx(expected, rel=1e-9)


def test_tpot_mid_generation_is_the_step_time_of_that_batch() -> None:
    replay = StateReplay("h200-sxm", "qwen3-32b", output_tokens=2)
    s = replay.stepper
    # Three running (the request itself, with 100 prompt + 10 generated tokens, and two others sharing 20 blocks),
    # the KV reading covering all three: the request's 7 blocks (109 tokens computed) and the others' 20.
    row = _row(num_request_running=3, num_tokens_generated=10, kv_cache_percentage=_kv_share(replay, 27))
    kv = 110.0 + 2 * 161.0
    expected = (s.step_ms([], 3, kv) + s.step_ms([], 3, kv + 3)) / 2
    assert replay.tpot_ms(row) == pytest.approx(expected, rel=1e-9)


def test_running_requests_share_the_kv_reading_in_whole_blocks(replay: StateReplay) -> None:
    ep = replay.endpoint(_row(num_request_running=3, kv_cache_percentage=_kv_share(replay, 31)))
    assert sorted(r.computed for r in ep.running) == [160, 160, 176]
    assert ep.cache.private_blocks == 31 and all(r.decoding for r in ep.running)
    # A running request whose endpoint reads 0 % still holds its one block.
    assert [r.computed for r in replay.endpoint(_row(num_request_running=1)).running] == [16]


def test_place_running_takes_only_decoding_requests_that_fit() -> None:
    ep = Endpoint("e", "both", StateReplay("h200-sxm", "qwen3-32b").stepper, KVCache(4, 16))
    with pytest.raises(ValueError, match="decoding"):
        ep.place_running(SimRequest(1, 0.0, input_tokens=10, output_tokens=5))
    assert ep.place_running(SimRequest(1, 0.0, input_tokens=48, output_tokens=5, computed=48, generated=1))
    assert not ep.place_running(SimRequest(2, 0.0, input_tokens=32, output_tokens=5, computed=32, generated=1))
    assert len(ep.running) == 1 and ep.cache.private_blocks == 3


def test_a_request_that_cannot_fit_is_a_clear_error(replay: StateReplay) -> None:
    with pytest.raises(ReplayError, match="cannot be scheduled"):
        replay.ttft_ms(_row(input_token_length=replay.kv_blocks * 16 + 1))


def test_a_long_prefill_queued_at_a_nearly_full_cache_gets_in_as_the_running_batch_finishes(
    replay: StateReplay,
) -> None:
    """A heavily loaded endpoint (every simulator trace under queueing has such rows): 50 running requests hold all
    but 100 blocks and 20k prompt tokens wait ahead. The running batch used never to finish, and the replay gave
    up ("no answer after 100000 simulated steps"). Replies with more to go hold the cache longer."""
    row = _row(
        input_token_length=2000,
        num_request_running=50,
        kv_cache_percentage=_kv_share(replay, replay.kv_blocks - 100),
        num_request_waiting=1,
        prefill_tokens_in_flight=20_000,
    )
    short_replies = replay.ttft_ms(row)
    long_replies = StateReplay("h200-sxm", "qwen3-32b", output_tokens=512).ttft_ms(row)
    assert 0 < short_replies < long_replies


def test_load_quintiles_are_fifths_by_load() -> None:
    rows = [ReplayedRow(i, "ttft", load=i % 7, measured_ms=10.0, simulated_ms=10.0 + i % 3) for i in range(23)]
    parts = by_load_quintile(rows)
    assert [p["rows"] for p in parts] == [5, 5, 5, 4, 4]
    assert all(a["load_max"] <= b["load_min"] for a, b in zip(parts, parts[1:], strict=False))


def test_rows_are_read_with_errors_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "rows.jsonl"
    bad.write_text(json.dumps({**BASE, "actual_ttft_ms": 50, "actual_tpot_ms": 0}) + "\n{oops\n")
    with pytest.raises(FeatureError, match=r"rows.jsonl:2"):
        load_rows(bad)
    bad.write_text(json.dumps({**BASE, "num_request_running": -1, "actual_ttft_ms": 50, "actual_tpot_ms": 0}) + "\n")
    with pytest.raises(FeatureError, match=r"rows.jsonl:1: num_request_running"):
        load_rows(bad)
    bad.write_text(json.dumps({**BASE, "actual_ttft_ms": 0, "actual_tpot_ms": 0}) + "\n")
    with pytest.raises(ReplayError, match="no row observes"):
        replay_file(bad, StateReplay("h200-sxm", "qwen3-32b"))


def test_a_row_with_both_targets_gives_two_figures(tmp_path: Path, replay: StateReplay) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({**BASE, "actual_ttft_ms": 30, "actual_tpot_ms": 19}) + "\n")
    rows = replay_file(path, replay)
    assert [(r.line, r.target) for r in rows] == [(1, "ttft"), (1, "tpot")]


def test_replay_of_the_shipped_h200_rows_meets_its_targets(replay: StateReplay) -> None:
    report = measured_fidelity(MEASURED["sharegpt-h200"], replay)
    assert report["ttft"]["rows"] == 1692 and report["tpot"]["rows"] == 1708
    assert report["ttft"]["median_ape"] <= 0.25  # type: ignore[operator]
    assert report["tpot"]["median_ape"] <= 0.10  # type: ignore[operator]
    assert len(report["ttft"]["by_load_quintile"]) == 5  # type: ignore[arg-type]


def test_docstring_example_runs() -> None:
    import doctest

    import leadtime.simulator.replay as module

    assert doctest.testmod(module).failed == 0
