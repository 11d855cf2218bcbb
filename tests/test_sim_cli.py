"""The simulator's commands: simulate (JSON, --out files), sim validate, bench sim, and clean errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from leadtime.cli import app
from leadtime.features.rows import observation_from_llmd

ROOT = Path(__file__).resolve().parents[1]
FLEETS = ROOT / "simulator" / "fleets"
runner = CliRunner()


def _azure(tmp_path: Path, n: int = 40) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{10 + i // 4:02d}.{(i % 4) * 25:02d}00000,{300 + 50 * i},{10 + i}" for i in range(n)]
    path = tmp_path / "mini.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_simulate_json_report_and_outputs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "simulate",
            "--fleet",
            str(FLEETS / "mixed.yaml"),
            "--trace",
            str(_azure(tmp_path)),
            "--policy",
            "llm-d",
            "--policy",
            "round-robin",
            "--json",
            "--out",
            str(out),
            "--seed",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["policies"]) == {"llmd_heuristic", "round_robin"}  # canonical names, whatever the spelling
    for summary in report["policies"].values():
        assert summary["completed"] == 40
        for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert summary[metric]["p50"] <= summary[metric]["p90"] <= summary[metric]["p99"]
        assert 0.0 <= summary["slo_attainment"] <= 1.0 and summary["goodput_rps"] >= 0
        assert len(summary["endpoints"]) == 8
        assert all(0.0 <= e["utilisation"] <= 1.0 for e in summary["endpoints"].values())
    rows = [json.loads(line) for line in (out / "observations.jsonl").read_text().splitlines()]
    assert len(rows) == 80
    obs = observation_from_llmd(rows[0])  # the predictor's training-row schema
    assert obs.row.endpoint.accelerator in {"h100-sxm", "a100-sxm-80gb", "l40s"}
    assert {"policy", "prefix_hit_tokens", "endpoint_id", "timeslice_state"} <= set(rows[0])
    assert (out / "latency_cdf.png").stat().st_size > 1000
    assert (out / "utilisation.png").stat().st_size > 1000
    assert sorted(report["outputs"]["files"]) == sorted(str(p) for p in out.iterdir())


def test_simulate_out_ends_by_listing_what_it_wrote(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["simulate", "--fleet", str(FLEETS / "mixed.yaml"), "--trace", str(_azure(tmp_path)), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    written = sorted(out.iterdir())
    assert len(written) == 4
    tail = result.stdout.strip().splitlines()[-len(written) - 1 :]
    assert tail[0] == "wrote 4 files (40 observations in the first):"
    assert sorted(line.strip() for line in tail[1:]) == [str(p) for p in written]


@pytest.mark.parametrize("fleet", ["homogeneous", "pd", "timesliced", "mixed", "pd_hetero", "large"])
def test_example_fleets_run(tmp_path: Path, fleet: str) -> None:
    result = runner.invoke(
        app,
        [
            "simulate",
            "--fleet",
            str(FLEETS / f"{fleet}.yaml"),
            "--trace",
            str(_azure(tmp_path, 20)),
            "--json",
            "--policy",
            "clairvoyant",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["policies"]["clairvoyant"]["completed"] == 20


@pytest.mark.parametrize(
    "args,message",
    [
        (["--fleet", "nope.yaml"], "nope.yaml"),
        (["--policy", "oracle"], "unknown policy"),
        (["--rate-scale", "0"], "rate-scale"),
        (["--max-requests", "0"], "max-requests"),
    ],
)
def test_simulate_errors_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    base = {"--fleet": str(FLEETS / "homogeneous.yaml"), "--trace": str(_azure(tmp_path, 5))}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = ["simulate"] + [x for kv in base.items() for x in kv]
    if "--policy" in args:
        argv += ["--policy", "oracle"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_simulate_reports_malformed_trace_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2}\n{"timestamp": 1}\n')
    result = runner.invoke(app, ["simulate", "--fleet", str(FLEETS / "pd.yaml"), "--trace", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:2" in result.output


def test_bad_fleet_file_names_the_field(tmp_path: Path) -> None:
    fleet = tmp_path / "f.yaml"
    fleet.write_text("pools:\n  - {name: a, count: 1, accelerator: h100-sxm, model: llama-3.1-8b, role: boss}\n")
    result = runner.invoke(app, ["simulate", "--fleet", str(fleet), "--trace", str(_azure(tmp_path, 3))])
    assert result.exit_code == 2 and "role" in result.output


def test_sim_validate_json() -> None:
    result = runner.invoke(app, ["sim", "validate", "--json"])  # shipped sharegpt-h200 rows and splitwise rows
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report) == {"measured", "splitwise_heldout", "splitwise_unfitted"}
    assert set(report["measured"]) == {"ttft", "tpot"}
    for target in ("ttft", "tpot"):
        assert {"median_ape", "p90_ape"} <= set(report["measured"][target])
    for part in ("splitwise_heldout", "splitwise_unfitted"):
        assert {"prefill", "decode"} <= set(report[part])
        assert {"median_ape", "p90_ape"} <= set(report[part]["prefill"])


def _rows_file(tmp_path: Path) -> Path:
    row = {
        "input_token_length": 200,
        "num_request_waiting": 0,
        "num_request_running": 3,
        "kv_cache_percentage": 0.01,
        "num_tokens_generated": 0,
        "prefix_cache_score": 0.0,
    }
    path = tmp_path / "rows.jsonl"
    lines = [{**row, "actual_ttft_ms": 60, "actual_tpot_ms": 0}, {**row, "actual_ttft_ms": 0, "actual_tpot_ms": 19.5}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_sim_validate_takes_any_file_of_the_schema(tmp_path: Path) -> None:
    path = _rows_file(tmp_path)
    argv = ["sim", "validate", "--data", str(path), "--accelerator", "h100-sxm", "--model", "qwen3-32b", "--json"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    measured = json.loads(result.stdout)["measured"]
    assert measured["ttft"]["rows"] == 1 and measured["tpot"]["rows"] == 1
    human = runner.invoke(app, ["sim", "validate", "--data", str(path), "--scheduling", "sync"])
    assert human.exit_code == 0 and "TTFT" in human.stdout and "efficiency" in human.stdout


def test_sim_validate_json_is_json_when_a_target_has_no_rows(tmp_path: Path) -> None:
    """A file of TPOT rows only printed `"median_ape": NaN`, which no strict JSON parser reads."""
    path = _rows_file(tmp_path)
    lines = path.read_text().splitlines()[1:]  # the TPOT row only
    path.write_text("\n".join(lines) + "\n")
    argv = ["sim", "validate", "--data", str(path), "--accelerator", "h100-sxm", "--model", "qwen3-32b", "--json"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert "NaN" not in result.stdout
    measured = json.loads(result.stdout)["measured"]
    assert measured["ttft"]["rows"] == 0 and measured["ttft"]["median_ape"] is None
    table = runner.invoke(app, argv[:-1])  # the table said `nan%` for them
    assert table.exit_code == 0, table.output
    (ttft,) = [line for line in table.stdout.splitlines() if "TTFT" in line and "│" in line]
    assert "nan" not in table.stdout and [cell.strip() for cell in ttft.split("│")[1:-1]] == [
        "TTFT",
        "0",
        "all",
        "–",
        "–",
    ]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--scheduling", "later"], "--scheduling"),
        (["--output-tokens", "1"], "--output-tokens"),
        # Beyond the KV cache: the first row replayed was blamed (`ROWS:1: ... (KV cache too small)`).
        (["--output-tokens", "100000000"], "--output-tokens must be below the 233,840 tokens"),
        (["--accelerator", "abacus"], "unknown accelerator"),
        (["--splitwise", "/no/such.csv"], "no such file"),
    ],
)
def test_sim_validate_rejects_bad_options(tmp_path: Path, extra: list[str], message: str) -> None:
    result = runner.invoke(app, ["sim", "validate", "--data", str(_rows_file(tmp_path)), *extra])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_sim_validate_names_a_bad_line(tmp_path: Path) -> None:
    path = _rows_file(tmp_path)
    path.write_text(path.read_text() + "{not json\n")
    result = runner.invoke(app, ["sim", "validate", "--data", str(path)])
    assert result.exit_code == 2 and "rows.jsonl:3" in result.output


def test_bench_sim_json_small() -> None:
    result = runner.invoke(
        app, ["bench", "sim", "--json", "--requests", "200", "--fleet", "bench-16", "--trace", "mooncake"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["requests"] == 200 and report["endpoints"] == 16 and report["requests_per_wall_s"] > 0


def test_sim_serve_rejects_bad_options() -> None:
    result = runner.invoke(app, ["sim", "serve", "--fleet", str(FLEETS / "pd.yaml"), "--base-port", "70000"])
    assert result.exit_code == 2 and "base-port" in result.output
    result = runner.invoke(app, ["sim", "serve", "--fleet", "missing.yaml"])
    assert result.exit_code == 2 and "missing.yaml" in result.output


def test_utilisation_heat_map_has_a_row_per_endpoint_and_busy_shares() -> None:
    from leadtime.simulator.engine import SimResult
    from leadtime.simulator.report import utilisation_matrix

    busy = {"h100-0": [(0.0, 1000.0)], "h100-1": [(500.0, 750.0)], "a100-0": []}
    result = SimResult("p", [], [], busy, {}, {}, duration_ms=1000.0, preemptions=0)
    edges, ids, matrix = utilisation_matrix(result, buckets=4)
    assert ids == ["h100-0", "h100-1", "a100-0"] and list(edges) == [0.0, 250.0, 500.0, 750.0, 1000.0]
    assert matrix.tolist() == [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_simulate_runs_the_profiles_of_a_plugin_configuration(tmp_path: Path) -> None:
    """A configuration could be tried only by deploying it: `--policy profile:NAME` runs its profile (over a
    cold in-process predictor where it predicts), from `--config FILE` or the shipped plugins.yaml."""
    trace = str(_azure(tmp_path, 30))
    shipped = ["--policy", "profile:default", "--policy", "profile:heuristic", "--policy", "round-robin"]
    result = runner.invoke(app, ["simulate", "--fleet", "mixed", "--trace", trace, *shipped, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["policies"]) == {"profile:default", "profile:heuristic", "round_robin"}
    assert all(p["completed"] == 30 for p in report["policies"].values())
    config = tmp_path / "mine.yaml"
    config.write_text(
        "plugins: [{type: queue-scorer}, {type: max-score-picker}]\n"
        "schedulingProfiles: [{name: queue, plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]}]\n"
    )
    mine = ["--config", str(config), "--policy", "profile:queue", "--json"]
    result = runner.invoke(app, ["simulate", "--fleet", "mixed", "--trace", trace, *mine])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["policies"]) == {"profile:queue"}
    missing = runner.invoke(app, ["simulate", "--fleet", "mixed", "--trace", trace, "--config", str(config)])
    assert missing.exit_code == 2 and "no profile named 'default' (profiles: queue)" in missing.output


def _mooncake(tmp_path: Path, stamps: list[float]) -> Path:
    path = tmp_path / "mc.jsonl"
    rows = [{"timestamp": t, "input_length": 300, "output_length": 5} for t in stamps]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_simulate_says_the_arrival_window_and_rate(tmp_path: Path) -> None:
    """Neither was shown, so a trace replayed at a rate far from the one meant went unnoticed."""
    trace = _mooncake(tmp_path, [1000.0 * i for i in range(20)])
    result = runner.invoke(
        app, ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--policy", "round_robin"]
    )
    assert result.exit_code == 0, result.output
    assert "20 requests over 19.0 s, 1.05 req/s" in " ".join(result.output.split())
    assert "warning" not in result.output


@pytest.mark.parametrize("suffix", [".jsonl", ".JSONL"])  # read as Mooncake in any case, so warned of alike
def test_simulate_warns_of_a_mooncake_trace_whose_timestamps_look_like_seconds(tmp_path: Path, suffix: str) -> None:
    trace = _mooncake(tmp_path, [float(i) for i in range(20)])  # seconds, read as the format's milliseconds
    trace = trace.rename(trace.with_suffix(suffix))
    argv = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--policy", "round_robin", "--json"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # the warning is on stderr, the JSON alone on stdout
    assert report["requests"] == 20 and report["arrival_window_s"] == 0.019
    assert report["arrival_rate_rps"] == pytest.approx(20 / 0.019)
    warning = " ".join(result.stderr.split())
    assert "warning:" in warning and "1,053 req/s" in warning and "milliseconds" in warning


def test_a_fleet_file_is_reported_under_its_path_not_the_name_inside(tmp_path: Path) -> None:
    """A copy of a shipped fleet file keeps its `name:`: the run was reported as the shipped fleet's."""
    mine = tmp_path / "my.yaml"
    mine.write_text((FLEETS / "homogeneous.yaml").read_text())
    argv = ["simulate", "--fleet", str(mine), "--trace", str(_azure(tmp_path, 5)), "--policy", "round_robin"]
    result = runner.invoke(app, [*argv, "--json", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["fleet"] == str(mine)
    assert json.loads((tmp_path / "out" / "report.json").read_text())["fleet"] == str(mine)
    shipped = runner.invoke(app, [*argv[:2], "homogeneous", *argv[3:], "--json"])
    assert json.loads(shipped.stdout)["fleet"] == "homogeneous"


def test_a_piped_report_keeps_its_headers_and_names_whole(tmp_path: Path) -> None:
    """Piped (a file, a CI log), the table took rich's 80 columns and cut "TTFT p50/p90/p99 ms" and "llmd_heuristic"
    to "TTFT p50/p90…" and "llmd_heu…"."""
    argv = ["simulate", "--fleet", "homogeneous", "--trace", str(_azure(tmp_path, 5)), "--policy", "llm-d"]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert "TTFT p50/p90/p99 ms" in result.output and "llmd_heuristic" in result.output


def test_simulate_counts_a_request_no_kv_cache_can_hold_as_failed_and_says_why(tmp_path: Path) -> None:
    """On a fleet with a small KV cache, a long prompt goes to the endpoint that holds it; one that no endpoint
    holds fails for each policy, named in the report, and the run goes on."""
    fleet = tmp_path / "smallkv.yaml"
    fleet.write_text(
        "pools:\n"
        "  - {name: big, count: 1, accelerator: h100-sxm, model: llama-3.1-8b}\n"
        "  - {name: small, count: 1, accelerator: h100-sxm, model: llama-3.1-8b, gpu_memory_utilization: 0.25}\n"
    )
    trace = tmp_path / "long.csv"
    rows = [(300, 10), (36_000, 10), (500_000, 10), (400, 10), (36_000, 10), (300, 10)]
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{10 + i:02d}.0000000,{tokens},{out}" for i, (tokens, out) in enumerate(rows)]
    trace.write_text("\n".join(lines) + "\n")
    args = ["simulate", "--fleet", str(fleet), "--trace", str(trace), "--policy", "leadtime", "--policy", "round-robin"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    for summary in json.loads(result.stdout)["policies"].values():
        assert summary["completed"] == 5 and summary["failed"] == 1
        assert list(summary["failures"]) == ["kv_cache"] and summary["failures"]["kv_cache"]["count"] == 1
        assert summary["failures"]["kv_cache"]["example"] == (
            "no endpoint's KV cache can hold the request's 500,010 tokens (prompt plus max_tokens); "
            "the largest holds 426,784"
        )
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    for name in ("leadtime", "round_robin"):
        said = f"policy {name}: 1 request(s) could not be served and count as failed (SLO missed): 1 kv_cache (e.g. no"
        assert said in result.output and "500,010 tokens" in result.output


def test_sim_fleets_lists_every_shipped_fleet_and_trace() -> None:
    """Every fleet file under simulator/fleets/ with its endpoint count, and every trace `--trace` takes by name."""
    from leadtime.data import TRACES
    from leadtime.simulator.fleet import load_fleet

    result = runner.invoke(app, ["sim", "fleets"])
    assert result.exit_code == 0, result.output
    listed = [line.split() for line in result.output.splitlines()]
    fleets = {p.stem: p for p in FLEETS.glob("*.yaml")}
    assert fleets and TRACES
    assert {(kind, name) for kind, name, *_ in listed} == {("fleet", name) for name in fleets} | {
        ("trace", name) for name in TRACES
    }
    for kind, name, *rest in listed:
        if kind == "fleet":
            assert rest[:2] == [str(len(load_fleet(fleets[name]).endpoints)), "endpoints"], rest
            assert Path(rest[2]).samefile(fleets[name])
        else:
            assert Path(rest[0]).samefile(TRACES[name])


def test_simulate_seed_help_says_everything_it_seeds() -> None:
    """The help said policies and time-slice windows; the seed also draws the realism factors and synthetic traces."""
    result = runner.invoke(app, ["simulate", "--help"], terminal_width=400)
    seed = next(line for line in result.stdout.splitlines() if line.strip().startswith("--seed"))
    for drawn in ("policies", "time-slice windows", "step jitter", "speed spread", "synthetic:"):
        assert drawn in seed, seed


def _stderr_lines(result: Result) -> list[str]:
    return [" ".join(line.split()) for line in result.stderr.splitlines() if line.strip()]


def test_simulate_warns_of_slos_no_request_can_meet_as_seconds_given_for_milliseconds(tmp_path: Path) -> None:
    """`slos: [{ttft_ms: 1.0, itl_ms: 0.05}]` (seconds) or `--ttft-slo-ms 2 --itl-slo-ms 0.1` gave 0-5% attainment
    without a word: both are below one pass over the weights (5.4 ms for Llama-3.1-8B on an H100, its roofline)."""
    trace = str(_azure(tmp_path, 5))
    fleet = tmp_path / "seconds.yaml"
    fleet.write_text(
        "pools:\n  - {name: a, count: 2, accelerator: h100-sxm, model: llama-3.1-8b}\n"
        "slos:\n  - {share: 1, ttft_ms: 1.0, itl_ms: 0.05}\n  - {share: 1, ttft_ms: 3000, itl_ms: 100}\n"
    )
    base = ["simulate", "--trace", trace, "--policy", "round_robin", "--json"]
    result = runner.invoke(app, [*base, "--fleet", str(fleet)])
    assert result.exit_code == 0, result.output
    lines = _stderr_lines(result)
    assert len(lines) == 2, lines
    assert lines[0].startswith("warning: slos[0].ttft_ms 1 is below one pass over the model's weights (5.4 ms")
    assert lines[1].startswith("warning: slos[0].itl_ms 0.05 is below one pass over the model's weights (5.4 ms")
    assert all("no request can meet it" in line and "milliseconds" in line for line in lines)
    plain = tmp_path / "plain.yaml"
    plain.write_text("pools:\n  - {name: a, count: 2, accelerator: h100-sxm, model: llama-3.1-8b}\n")
    flags = runner.invoke(app, [*base, "--fleet", str(plain), "--ttft-slo-ms", "2", "--itl-slo-ms", "0.1"])
    assert [line.split(" is below")[0] for line in _stderr_lines(flags)] == [
        "warning: --ttft-slo-ms 2",
        "warning: --itl-slo-ms 0.1",
    ]
    assert _stderr_lines(runner.invoke(app, [*base, "--fleet", str(plain), "--itl-slo-ms", "6"])) == []


@pytest.mark.parametrize("flags", [["--ttft-slo-ms", "500"], ["--itl-slo-ms", "20"], ["--ttft-slo-ms", "9"]])
def test_simulate_says_the_fleets_slos_win_over_the_slo_options(tmp_path: Path, flags: list[str]) -> None:
    """The options were ignored without a word on a fleet that states SLO classes (every shipped benchmark fleet)."""
    argv = ["simulate", "--fleet", "homogeneous", "--trace", str(_azure(tmp_path, 5)), "--policy", "round_robin"]
    result = runner.invoke(app, [*argv, *flags, "--json"])
    assert result.exit_code == 0, result.output
    assert _stderr_lines(result) == [
        f"warning: {flags[0]} is ignored: the fleet states its SLO classes (slos), which apply instead"
    ]
    assert _stderr_lines(runner.invoke(app, [*argv, "--json"])) == []


def test_simulate_spreads_same_instant_arrivals_over_their_step_when_asked(tmp_path: Path) -> None:
    """`simulate` replays Mooncake's same-instant bursts as recorded; the demo and the benchmarks spread them
    (`spread_steps`), and `--spread-steps` replays a trace as they do."""
    trace = _mooncake(tmp_path, [0, 0, 0, 3000, 3000, 3000])
    args = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--json", "--policy", "round-robin"]
    recorded = runner.invoke(app, args)
    spread = runner.invoke(app, [*args, "--spread-steps"])
    assert recorded.exit_code == spread.exit_code == 0, recorded.output + spread.output
    assert json.loads(recorded.stdout)["arrival_window_s"] == 3.0
    assert 4.0 < json.loads(spread.stdout)["arrival_window_s"] < 6.0  # the last step spread over 3 s after it


def _strict_json(text: str) -> object:
    """`text` parsed as JSON proper: Python's parser takes the `Infinity` and `NaN` that strict ones (jq, Go,
    JSON.parse) refuse."""

    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_an_infinite_slo_leaves_the_report_valid_json(tmp_path: Path) -> None:
    """An infinite SLO (no SLO) is taken, and went out as a bare `Infinity` in the printed report and report.json."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("pools: [{name: a, count: 2, accelerator: h100-sxm, model: llama-3.1-8b}]\n")
    out = tmp_path / "out"
    args = ["simulate", "--fleet", str(fleet), "--trace", str(_azure(tmp_path, 8)), "--ttft-slo-ms", "inf"]
    result = runner.invoke(app, [*args, "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for text in (result.stdout, (out / "report.json").read_text()):
        report = _strict_json(text)
        assert isinstance(report, dict)
        assert report["policies"]["llmd_heuristic"]["slo"][0]["ttft_ms"] is None


def test_a_policy_that_completed_nothing_shows_no_latencies(tmp_path: Path) -> None:
    """Percentiles over no request printed as `0 / 0 / 0`: the best latencies of the table, for a policy that
    served nothing."""
    trace = tmp_path / "huge.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:10,500000,10\n2023-11-16 18:15:11,500000,10\n"
    )
    result = runner.invoke(app, ["simulate", "--fleet", "homogeneous", "--trace", str(trace)])
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.output.splitlines() if "llmd_heuristic" in line and "│" in line]
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    assert cells[1:5] == ["–", "–", "–", "0.0%"] and cells[-2:] == ["0", "2"], cells
