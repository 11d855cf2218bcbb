"""Trace parsers (with line numbers on bad input), shaping, and synthetic workloads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from leadtime.data import TRACES
from leadtime.features.prefix import chain_block_ids
from leadtime.simulator.workload import (
    SyntheticSpec,
    TraceError,
    load_workload,
    parse_synthetic,
    read_azure,
    read_mooncake,
    read_trace,
    shape,
    synthetic,
)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_mooncake_lines_become_requests_with_chained_segments(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "t.jsonl",
        '{"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]}\n'
        "\n"
        '{"timestamp": 250, "input_length": 600, "output_length": 3, "hash_ids": [0, 9]}\n',
    )
    first, second = read_mooncake(path)
    assert (first.arrival_ms, first.input_tokens, first.output_tokens) == (0.0, 1100, 7)
    assert first.segments == tuple(chain_block_ids([0, 1, 2]))
    assert second.segments[0] == first.segments[0] and second.segments[1] != first.segments[1]
    assert len(read_trace(path, limit=1)) == 1


@pytest.mark.parametrize(
    "line,problem",
    [
        ("not json", "not valid JSON"),
        ('{"timestamp": 0, "input_length": 10}', "missing 'output_length'"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1.5}', "output_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}', "hash_ids"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_mooncake_rejects_malformed_lines_with_line_number(tmp_path: Path, line: str, problem: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
    path = _write(tmp_path, "bad.jsonl", good + line + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: .*" + problem.replace("(", r"\(")):
        read_mooncake(path)


def test_azure_csv_parses_times_relative_to_first(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.1805900,396,109\n",
    )
    first, second = read_azure(path)
    assert first.arrival_ms == 0.0 and second.arrival_ms == pytest.approx(500.0)
    assert (second.input_tokens, second.output_tokens, second.segments) == (396, 109, ())


@pytest.mark.parametrize(
    "row,problem",
    [
        ("yesterday,1,1", "TIMESTAMP"),
        ("2023-11-16 18:15:46.6,x,1", "'ContextTokens' must be an integer ≥ 1, got 'x'"),
        ("2023-11-16 18:15:46.6,10,0", "GeneratedTokens"),
        # A cell more than the header has: a comma inside a cell, or columns out of step with the header's.
        ("2023-11-16 18:15:46.6,10,20,7", "1 cell more than the header's 3 columns"),
    ],
)
def test_azure_rejects_malformed_rows_with_line_number(tmp_path: Path, row: str, problem: str) -> None:
    path = _write(tmp_path, "bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,1,1\n" + row)
    with pytest.raises(TraceError, match=rf"bad\.csv:3: .*{problem}"):
        read_azure(path)


def test_azure_errors_name_the_files_line_past_blank_lines(tmp_path: Path) -> None:
    """The reader skips blank lines: counting its rows named line 3 for a bad cell on line 6."""
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\n2023-11-16 18:15:46,10,1\n\n\n2023-11-16 18:15:47,10,x\n"
    with pytest.raises(TraceError, match=r"gaps\.csv:6: 'GeneratedTokens' must be an integer ≥ 1, got 'x'"):
        read_azure(_write(tmp_path, "gaps.csv", text))


def test_azure_missing_columns_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="missing column"):
        read_azure(_write(tmp_path, "x.csv", "a,b\n1,2\n"))
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(_write(tmp_path, "x.txt", ""))
    with pytest.raises(TraceError, match="absent"):
        read_trace(tmp_path / "absent.jsonl")


@pytest.mark.parametrize("suffix", [".CSV", ".Csv"])
def test_a_trace_is_known_by_its_extension_in_any_case(tmp_path: Path, suffix: str) -> None:
    path = _write(tmp_path, "trace" + suffix, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,5,7\n")
    assert [(r.input_tokens, r.output_tokens) for r in read_trace(path)] == [(5, 7)]


def test_shape_scales_rate_and_limits() -> None:
    reqs = synthetic(SyntheticSpec(requests=50, rate_rps=5), seed=1)
    fast = shape(reqs, rate_scale=2.0, max_requests=10)
    assert len(fast) == 10 and fast[0].arrival_ms == 0.0
    origin = reqs[0].arrival_ms
    assert fast[-1].arrival_ms == pytest.approx((reqs[9].arrival_ms - origin) / 2.0)
    with pytest.raises(TraceError):
        shape(reqs, rate_scale=0)
    with pytest.raises(TraceError):
        shape([], rate_scale=1)


def test_synthetic_is_seeded_and_shares_prefixes() -> None:
    spec = SyntheticSpec(requests=300, rate_rps=10, prefix_groups=2, prefix_share=1.0, prefix_tokens=1024)
    a, b = synthetic(spec, seed=7), synthetic(spec, seed=7)
    assert a == b
    assert synthetic(spec, seed=8) != a
    heads = {r.segments[:2] for r in a}
    assert len(heads) == 2  # every request starts with one of two shared prefixes
    assert all(r.input_tokens > 1024 for r in a)


def test_bursty_arrivals_are_more_variable_than_poisson() -> None:
    def cv(burstiness: float) -> float:
        reqs = synthetic(SyntheticSpec(requests=3000, rate_rps=10, burstiness=burstiness), seed=2)
        gaps = [b.arrival_ms - a.arrival_ms for a, b in zip(reqs, reqs[1:], strict=False)]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    assert cv(1.0) == pytest.approx(1.0, abs=0.1)
    assert cv(4.0) > 1.5


def test_real_traces_parse() -> None:
    mooncake = read_trace(TRACES["mooncake"], limit=200)
    assert len(mooncake) == 200 and all(r.segments for r in mooncake)
    azure = read_trace(TRACES["azure-conv"], limit=200)
    assert len(azure) == 200 and azure[-1].arrival_ms > 0


def test_a_limit_keeps_the_earliest_arrivals_of_an_unsorted_trace(tmp_path: Path) -> None:
    rows = [(500, 1), (0, 2), (900, 3), (100, 4)]  # (timestamp ms, output_length), not in time order
    lines = [json.dumps({"timestamp": t, "input_length": 10, "output_length": n}) for t, n in rows]
    mooncake = _write(tmp_path, "t.jsonl", "\n".join(lines) + "\n")
    assert [(r.arrival_ms, r.output_tokens) for r in read_trace(mooncake, limit=2)] == [(0.0, 2), (100.0, 4)]
    azure = _write(
        tmp_path,
        "t.csv",
        AZURE_HEADER + "".join(f"2023-11-16 18:15:{t // 100:02d},10,{n}\n" for t, n in rows),
    )
    assert [r.output_tokens for r in read_trace(azure, limit=2)] == [2, 4]
    assert [r.output_tokens for r in load_workload(str(azure), limit=3)] == [2, 4, 1]


def test_synthetic_spec_from_text() -> None:
    spec = parse_synthetic("synthetic:rate_rps=20,requests=50,burstiness=4,prefix_share=0.25")
    assert (spec.rate_rps, spec.requests, spec.burstiness, spec.prefix_share) == (20.0, 50, 4.0, 0.25)
    assert isinstance(spec.requests, int)
    assert parse_synthetic("synthetic:requests=2e3,output_mean=100.0").requests == 2000  # integral: an integer
    assert len(load_workload("synthetic:requests=50", seed=1, limit=10)) == 10
    for bad, problem in [
        ("synthetic:rate=3", "bad parameter"),
        ("synthetic:requests=x", "number"),
        ("synthetic:prefix_share=2", "prefix_share"),
        ("synthetic:rate_rps=0", "> 0"),
        ("synthetic:requests=2.7", "requests must be an integer, got '2.7'"),
        ("synthetic:prefix_tokens=1e3.5", "prefix_tokens must be a number"),
        ("synthetic:input_mean=99.5", "input_mean must be an integer"),
    ]:
        with pytest.raises(TraceError, match=problem):
            parse_synthetic(bad)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("prefix_tokens=1e15", "prefix_tokens must be at most 16,777,216 (tokens), got 1e+15"),  # memory ran out
        ("input_mean=1e18", "input_mean must be at most 16,777,216 (tokens), got 1e+18"),  # a loop of ~2e15 turns
        ("output_mean=1e18", "output_mean must be at most 16,777,216 (tokens)"),
        ("segment_tokens=1e9", "segment_tokens must be at most 16,777,216 (tokens)"),
        ("requests=1e8", "requests must be at most 10,000,000, got 1e+08"),
        ("prefix_groups=1e9", "prefix_groups must be at most 65,536"),
        ("prefix_tokens=-512", "prefix_tokens must be ≥ 0, got -512"),
        ("requests=5,requests=6", "requests is given twice"),
        ("requests=5, requests=6", "requests is given twice"),
    ],
)
def test_synthetic_parameters_beyond_any_run_are_refused_naming_them(text: str, problem: str) -> None:
    """prefix_tokens=1e15 built 8 lists of ~2e12 ids until memory ran out; input_mean=1e18 looped ~2e15 times."""
    with pytest.raises(TraceError) as caught:
        parse_synthetic(f"synthetic:{text}")
    assert str(caught.value).startswith("synthetic workload: ") and problem in str(caught.value), caught.value


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "requests=1e6,input_mean=2e5,segment_tokens=1",
            "requests × (input_mean or prefix_tokens) / segment_tokens must be at most 100,000,000 prompt segments",
        ),
        (
            "prefix_groups=1e4,prefix_tokens=1e6,segment_tokens=16",
            "prefix_groups × prefix_tokens / segment_tokens must be at most 100,000,000 prompt segments",
        ),
    ],
)
def test_a_synthetic_workload_too_large_to_build_is_refused_naming_its_parameters(text: str, problem: str) -> None:
    """Each parameter bounded, their product was not: a million requests of 200,000 one-token segments."""
    with pytest.raises(TraceError, match=re.escape(f"synthetic workload: {problem}")):
        load_workload(f"synthetic:{text}")


def test_a_large_synthetic_workload_cut_short_by_a_limit_is_built() -> None:
    """The size is of the requests replayed: --max-requests 2 of a workload too large whole builds two."""
    assert len(load_workload("synthetic:requests=1e6,input_mean=2e5,segment_tokens=1", limit=2)) == 2


def test_synthetic_parameters_at_their_bounds_are_taken() -> None:
    spec = parse_synthetic("synthetic:requests=5,input_mean=16777216,prefix_tokens=0,segment_tokens=16777216")
    assert (spec.requests, spec.input_mean, spec.prefix_tokens) == (5, 2**24, 0)


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize(
    "stamps,expected_ms",
    [
        # Python's isoformat drops a zero fraction: rows with and without one, in UTC ('Z').
        (["2024-01-01T00:00:00.500000Z", "2024-01-01T00:00:01.000000Z", "2024-01-01T00:00:02Z"], [0, 500, 1500]),
        # Offsets are honoured: across a daylight-saving change these are one second apart.
        (["2024-03-31 01:59:59.500000+01:00", "2024-03-31 03:00:00.500000+02:00"], [0, 1000]),
        # Any fraction length, with an offset.
        (["2024-03-31 01:59:59.5+01:00", "2024-03-31 03:00:10.5+02:00"], [0, 11000]),
        # A zone-less time is UTC, as everywhere in Leadtime.
        (["2024-01-01 00:00:00.0000000", "2024-01-01T00:00:01Z", "2024-01-01 01:00:03+01:00"], [0, 1000, 3000]),
    ],
)
def test_azure_timestamps_are_compared_in_utc(tmp_path: Path, stamps: list[str], expected_ms: list[int]) -> None:
    path = _write(tmp_path, "iso.csv", AZURE_HEADER + "".join(f"{s},10,1\n" for s in stamps))
    assert [r.arrival_ms for r in read_azure(path)] == pytest.approx(expected_ms)


def test_files_starting_with_a_byte_order_mark_are_read(tmp_path: Path) -> None:
    """Editors on Windows save UTF-8 with a BOM: the Azure header's first column read as '\\ufeffTIMESTAMP'
    ("missing column(s) TIMESTAMP") and a JSONL file's first line was refused as not JSON."""
    from leadtime.bench.data import load_llmd_rows

    bom = "\ufeff"
    azure = _write(tmp_path, "bom.csv", bom + AZURE_HEADER + "2024-01-01 00:00:00,10,1\n2024-01-01 00:00:01,10,1\n")
    assert [r.arrival_ms for r in read_azure(azure)] == [0.0, 1000.0]
    mooncake = _write(tmp_path, "bom.jsonl", bom + '{"timestamp": 0, "input_length": 10, "output_length": 1}\n')
    assert len(read_mooncake(mooncake)) == 1
    row = {"kv_cache_percentage": 0.1, "input_token_length": 10, "num_request_waiting": 0, "num_request_running": 0}
    row |= {"num_tokens_generated": 0, "prefix_cache_score": 0.0, "actual_ttft_ms": 5.0, "actual_tpot_ms": 0.0}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(bom + json.dumps(row) + "\n", encoding="utf-8")
    assert len(load_llmd_rows(rows)) == 1
