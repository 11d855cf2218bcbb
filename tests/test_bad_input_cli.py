"""Bad input on the command line (simulate, sim, bench, retrain, dashboards): each is one `error: ...` line on
stderr naming the problem and exit 2, never a traceback, a hang or a run that silently does something else."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from leadtime.bench.procs import free_ports
from leadtime.cli import app

ROOT = Path(__file__).resolve().parents[1]
FLEETS = ROOT / "simulator" / "fleets"
runner = CliRunner()

POOL = "pools:\n  - {name: a, count: 2, accelerator: h100-sxm, model: llama-3.1-8b}\n"
SHARED = "pools:\n  - {name: a, count: 2, accelerator: h100-sxm, model: llama-3.1-8b, timeslice_group: rl}\n"
ROW = {
    "kv_cache_percentage": 0.1,
    "input_token_length": 48,
    "num_request_waiting": 0,
    "num_request_running": 0,
    "num_tokens_generated": 0,
    "prefix_cache_score": 0,
    "actual_ttft_ms": 100,
    "actual_tpot_ms": 0,
}
GARBAGE = b"\x00\xed\xa0\x80\xff garbage \xfe\n" * 20
DEEP = "[" * 100_000 + "\n"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def refused(args: list[str], *names: str) -> str:
    """Run the CLI; assert it refused with one `error:` line naming each of `names`, and return that line."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    assert len(result.output.splitlines()) == 1, result.output  # nothing before it (a bar drawn nowhere)
    for name in names:
        assert name in errors[0], errors[0]
    return errors[0]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    """Three Mooncake requests."""
    path = tmp_path / "three.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 300, "output_length": 5, "hash_ids": [i]} for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    """Twelve llm-d training rows."""
    path = tmp_path / "rows.jsonl"
    path.write_text((json.dumps(ROW) + "\n") * 12)
    return path


# ----- fleet files ------------------------------------------------------------------------------------------


SLICED_POOL = "pools:\n  - {name: a, count: 1, accelerator: h100-sxm, model: llama-3.1-8b, timeslice_group: rl}\n"


@pytest.mark.parametrize(
    "content,problem",
    [
        ("", "the file holds no fleet: expected a mapping with pools (and optionally name, refresh_ms,"),
        ("[1, 2]\n", "the file holds no fleet: expected a mapping with pools"),
        (
            SLICED_POOL + "timeslice_groups:\n  rl: {resident_ms: 5000, away_ms: {value: 1000}}\n",
            "timeslice_groups.rl.resident_ms: takes a distribution in milliseconds: {distribution: fixed, value: "
            "5000} (or {value: 5000}), {distribution: uniform, low: 50, high: 100} or {distribution: exponential, "
            "mean: 4000}",
        ),
        (SLICED_POOL + "timeslice_groups:\n  rl: 3\n", "timeslice_groups.rl: takes a mapping of resident_ms, away_ms"),
        ("pools:\n  - 3\n", "pools[0]: takes a mapping of name, count, accelerator, model (and optionally"),
        (POOL + "realism: 0.1\n", "realism: takes a mapping of any of"),
    ],
)
def test_a_fleet_file_says_what_a_misshapen_field_takes(
    tmp_path: Path, trace: Path, content: str, problem: str
) -> None:
    """An empty file, or a number where a distribution goes, said "Input should be a valid dictionary or instance
    of FleetSpec" (or DistributionSpec): names of the code, not of the file."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(content)
    line = refused(["simulate", "--fleet", str(fleet), "--trace", str(trace)], str(fleet), problem)
    assert "instance of" not in line and "Spec" not in line


@pytest.mark.parametrize(
    ("text", "field", "problem"),
    [
        (POOL.replace("count: 2", "count: true"), "pools[0].count", "valid integer"),
        (POOL.replace("count: 2", "count: '2'"), "pools[0].count", "valid integer"),
        (POOL.replace("count: 2", "count: 2.0"), "pools[0].count", "valid integer"),
        (POOL.replace("}", ", max_num_seqs: '8'}"), "pools[0].max_num_seqs", "valid integer"),
        (POOL.replace("}", ", tensor_parallel: true}"), "pools[0].tensor_parallel", "valid integer"),
        (POOL.replace("}", ", block_size: true}"), "pools[0].block_size", "valid integer"),
        (POOL.replace("}", ", block_size: 12}"), "pools[0].block_size", "or 128, got 12"),
        (POOL.replace("}", ", gpu_memory_utilization: true}"), "pools[0].gpu_memory_utilization", "got True"),
        (POOL.replace("}", ", join_at_s: '5'}"), "pools[0].join_at_s", "got '5' (text: unquote it)"),
        (POOL.replace("}", ", cuda_graphs: 1}"), "pools[0].cuda_graphs", "valid boolean"),
        (POOL + "slos:\n  - {share: true, ttft_ms: 1000, itl_ms: 50}\n", "slos[0].share", "got True"),
        (POOL + "slos:\n  - {ttft_ms: '1000', itl_ms: 50}\n", "slos[0].ttft_ms", "got '1000'"),
        ("refresh_ms: true\n" + POOL, "refresh_ms", "got True"),
        (POOL + "realism: {step_jitter: true}\n", "realism.step_jitter", "got True"),
        (SLICED_POOL + "timeslice_groups:\n  rl: {resident_ms: {value: true}, away_ms: {value: 5}}\n",
         "timeslice_groups.rl.resident_ms.value", "got True"),
    ],
)  # fmt: skip
def test_a_fleet_number_given_as_a_boolean_or_text_is_refused_naming_the_field(
    tmp_path: Path, trace: Path, text: str, field: str, problem: str
) -> None:
    """`count: true` ran a one-endpoint pool, `share: true` a share of 1, `max_num_seqs: "8"` 8: pydantic's lax mode,
    which the catalog file already refused for its figures."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(text)
    refused(["simulate", "--fleet", str(fleet), "--trace", str(trace)], f"{fleet}: {field}: ", problem)


def test_a_fleet_number_in_exponent_notation_is_the_number_it_reads_as() -> None:
    """PyYAML leaves `4e3` as text (its YAML 1.1 wants `4.0e+3`): a reader sees 4000, and so does the fleet."""
    from leadtime.simulator.fleet import parse_fleet
    from leadtime.yaml_text import load_yaml

    fleet = parse_fleet(
        load_yaml(SLICED_POOL + "timeslice_groups:\n  rl: {resident_ms: {value: 4e3}, away_ms: {value: 1.5e3}}\n")
    )
    assert (fleet.timeslice_groups["rl"].resident_ms.mean, fleet.timeslice_groups["rl"].away_ms.mean) == (4e3, 1.5e3)


@pytest.mark.parametrize(
    "content,problem",
    [
        (GARBAGE, "not UTF-8 text"),
        (b"pools: [ {name: a, count: \n", "not valid YAML"),
        (b"pools:\n\t- name: a\n", "not valid YAML"),
        (DEEP.encode(), "nested too deeply"),
        (  # PyYAML keeps the last of the two, silently
            b"pools:\n  - {name: a, accelerator: h100-sxm, model: llama-3.1-8b, count: 2, count: 3}\n",
            "line 2, column 69: the key 'count' is given twice",
        ),
    ],
)
@pytest.mark.parametrize("command", [["simulate", "--max-requests", "3"], ["bench", "sim", "--requests", "3"]])
def test_a_fleet_file_that_is_not_a_fleet_yaml_is_one_line_naming_it(
    tmp_path: Path, trace: Path, content: bytes, problem: str, command: list[str]
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_bytes(content)
    refused([*command, "--fleet", str(fleet), "--trace", str(trace)], str(fleet), problem)


def test_requests_that_all_arrive_at_one_instant_are_refused(tmp_path: Path) -> None:
    """Their arrival window is empty: goodput per second of it read 1e9 requests/s. Replaying more of the trace is
    advised only where --max-requests cut it short (the whole trace has no more to give)."""
    burst = tmp_path / "burst.jsonl"
    rows = [{"timestamp": t, "input_length": 300, "output_length": 5} for t in (0, 0, 0, 0)]
    burst.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = ["simulate", "--fleet", "homogeneous", "--trace", str(burst), "--json"]
    assert "--max-requests" not in refused(command, "one instant")
    assert "--max-requests" not in refused([*command, "--max-requests", "10"], "one instant")
    burst.write_text("".join(json.dumps(row) + "\n" for row in [*rows, {**rows[0], "timestamp": 100}]))
    refused([*command, "--max-requests", "4"], "4 request(s)", "one instant", "replay more of the trace")


def test_a_request_that_can_never_finish_is_counted_as_failed_with_a_warning(tmp_path: Path) -> None:
    """A prompt longer than a time-sliced endpoint's resident window can prefill restarts from zero at every swap:
    it fails alone (a warning naming it and the policy, a count in the JSON), and every policy's figures stand."""
    fleet = tmp_path / "ts.yaml"
    fleet.write_text(
        "pools:\n  - {name: a, count: 2, accelerator: h100-sxm, model: llama-3.1-8b, timeslice_group: rl}\n"
        "timeslice_groups:\n  rl: {resident_ms: {value: 1000}, away_ms: {value: 1000}, restore_ms: {value: 10}}\n"
    )
    trace = tmp_path / "long.jsonl"
    rows = [{"timestamp": t, "input_length": n, "output_length": 10} for t, n in ((0, 100_000), (1, 100))]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["simulate", "--fleet", str(fleet), "--trace", str(trace), "--json"]
    result = runner.invoke(app, [*args, "--policy", "round-robin", "--policy", "llm-d"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: policy")]
    assert len(warnings) == 2, result.stderr
    assert all("request 0" in w and "preempted" in w and "failed" in w for w in warnings), warnings
    assert "round_robin" in warnings[0] and "llmd_heuristic" in warnings[1]
    report = json.loads(result.stdout)
    assert {name: p["failed"] for name, p in report["policies"].items()} == {"round_robin": 1, "llmd_heuristic": 1}
    assert all(p["completed"] == 1 for p in report["policies"].values())


def test_sim_serve_names_a_fleet_file_that_is_not_text(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_bytes(GARBAGE)
    refused(["sim", "serve", "--fleet", str(fleet)], str(fleet), "not UTF-8 text")


GROUP = "timeslice_groups:\n  rl:\n    resident_ms: {res}\n    away_ms: {away}\n    restore_ms: {restore}\n"
FIXED_100 = "{distribution: fixed, value: 100}"


@pytest.mark.parametrize(
    "text,field",
    [
        (SHARED + GROUP.format(res=FIXED_100, away="{distribution: fixed, value: .inf}", restore=FIXED_100), "away_ms"),
        (
            SHARED + GROUP.format(res="{distribution: exponential, mean: .inf}", away=FIXED_100, restore=FIXED_100),
            "resident_ms",
        ),
        (
            SHARED + GROUP.format(res=FIXED_100, away=FIXED_100, restore="{distribution: uniform, low: 0, high: .inf}"),
            "restore_ms",
        ),
        (POOL + "slos:\n  - {share: .inf, ttft_ms: 1000, itl_ms: 50}\n", "slos[0].share"),
        ("refresh_ms: .inf\n" + POOL, "refresh_ms"),
    ],
)
def test_infinite_fleet_values_are_refused_naming_the_field(tmp_path: Path, trace: Path, text: str, field: str) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(text)
    refused(["simulate", "--fleet", str(fleet), "--trace", str(trace)], str(fleet), field, "finite")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("res", "away", "restore", "problem"),
    [
        ("{value: 0}", "{value: 0}", "{value: 1e-300}", "resident_ms"),  # switched forever, a hang
        ("{value: 0}", "{value: 1e300}", "{value: 0}", "away_ms"),  # never resident, a hang
        (
            "{distribution: exponential, mean: 1e-300}",
            "{distribution: exponential, mean: 1e-300}",
            FIXED_100,
            "resident",
        ),
    ],
)
def test_time_slice_durations_no_run_could_end_with_are_refused(
    tmp_path: Path, trace: Path, res: str, away: str, restore: str, problem: str
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(SHARED + GROUP.format(res=res, away=away, restore=restore))
    refused(["simulate", "--fleet", str(fleet), "--trace", str(trace)], str(fleet), problem)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra_pool", ["", "  - {name: b, count: 1, accelerator: h100-sxm, model: llama-3.1-8b}\n"])
def test_a_timeslice_group_whose_cycle_takes_no_time_is_refused_not_simulated_forever(
    tmp_path: Path, trace: Path, extra_pool: str
) -> None:
    fleet = tmp_path / "fleet.yaml"
    zero = "{distribution: fixed, value: 0}"
    fleet.write_text(
        SHARED + extra_pool + GROUP.format(res=zero, away=zero, restore="{distribution: uniform, low: 0, high: 0}")
    )
    refused(["simulate", "--fleet", str(fleet), "--trace", str(trace)], str(fleet), "timeslice_groups.rl")


# ----- traces -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,content,problem",
    [
        ("t.jsonl", GARBAGE, "not UTF-8 text"),
        ("t.csv", GARBAGE, "not UTF-8 text"),
        ("t.jsonl", DEEP.encode(), "nested too deeply"),
        ("t.jsonl", b'{"timestamp": NaN, "input_length": 10, "output_length": 5}\n', "timestamp"),
        ("t.jsonl", b'{"timestamp": Infinity, "input_length": 10, "output_length": 5}\n', "timestamp"),
        ("t.jsonl", b'{"timestamp": 0, "input_length": NaN, "output_length": 5}\n', "input_length"),
        ("t.jsonl", b'{"timestamp": 0, "input_length": 10, "output_length": Infinity}\n', "output_length"),
        ("t.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n" + b'"' + b"x" * 200_000 + b'",5,5\n', "not CSV"),
    ],
)
def test_a_trace_that_is_not_a_trace_is_one_line_naming_the_file(
    tmp_path: Path, name: str, content: bytes, problem: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    refused(["simulate", "--fleet", "homogeneous", "--trace", str(path)], str(path), problem)


def test_a_trace_file_whose_name_starts_with_synthetic_is_replayed_not_replaced(
    tmp_path: Path, trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "synthetic_three.jsonl").write_text(trace.read_text())
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["simulate", "--fleet", "homogeneous", "--trace", "synthetic_three.jsonl", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"] == 3


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
@pytest.mark.parametrize("name", ["rate_rps", "burstiness", "input_mean", "prefix_share"])
def test_non_finite_synthetic_parameters_are_refused_naming_them(name: str, value: str) -> None:
    refused(["simulate", "--fleet", "homogeneous", "--trace", f"synthetic:{name}={value}"], name, "finite")


# ----- numeric options --------------------------------------------------------------------------------------


HUGE = "9" * 23
"""A seed above 2**53."""


@pytest.mark.parametrize(
    "option,value",
    [("--rate-scale", "nan"), ("--rate-scale", "inf"), ("--ttft-slo-ms", "nan"), ("--itl-slo-ms", "nan")],
)
def test_simulate_refuses_non_finite_options(trace: Path, option: str, value: str) -> None:
    refused(["simulate", "--fleet", "homogeneous", "--trace", str(trace), option, value], option)


@pytest.mark.parametrize("option", ["--ttft-slo-ms", "--itl-slo-ms"])
def test_simulate_refuses_an_slo_below_a_microsecond(trace: Path, tmp_path: Path, option: str) -> None:
    """`--itl-slo-ms 1e-320` (on a fleet stating no SLO classes) ended in a traceback: its 1 / SLO, infinite, left
    NaN in the in-flight ledger, and a later decision raised IndexError."""
    fleet = tmp_path / "plain.yaml"
    fleet.write_text(POOL)
    refused(["simulate", "--fleet", str(fleet), "--trace", str(trace), option, "1e-320"], option, "0.001")


@pytest.mark.parametrize("field", ["ttft_ms", "itl_ms"])
def test_a_fleet_slo_class_below_a_microsecond_is_refused_naming_it(trace: Path, tmp_path: Path, field: str) -> None:
    fleet = tmp_path / "tiny.yaml"
    slo = {"ttft_ms": 1000, "itl_ms": 50, field: "1.0e-320"}
    fleet.write_text(POOL + f"slos:\n  - {{ttft_ms: {slo['ttft_ms']}, itl_ms: {slo['itl_ms']}}}\n")
    refused(["simulate", "--fleet", str(fleet), "--trace", str(trace)], f"slos[0].{field}", "0.001")


def test_simulate_takes_an_infinite_slo_as_no_slo(trace: Path) -> None:
    args = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--ttft-slo-ms", "inf", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["policies"]["llmd_heuristic"]["slo_attainment"] == 1.0


@pytest.mark.parametrize("fleet", ["plain", "slo_inf"])
def test_an_infinite_slo_with_out_writes_the_whole_run(trace: Path, tmp_path: Path, fleet: str) -> None:
    """The run finished, then its plots failed on an axis ending at infinity: no table, no report, no plots."""
    path = tmp_path / f"{fleet}.yaml"
    path.write_text(POOL + ("slos: [{ttft_ms: .inf, itl_ms: .inf}]\n" if fleet == "slo_inf" else ""))
    out = tmp_path / "out"
    args = ["simulate", "--fleet", str(path), "--trace", str(trace), "--ttft-slo-ms", "inf", "--out", str(out)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["policies"]["llmd_heuristic"]["slo_attainment"] == 1.0
    assert sorted(p.name for p in out.iterdir()) == [
        "latency_cdf.png",
        "observations.jsonl",
        "report.json",
        "utilisation.png",
    ]


def test_simulate_prints_and_keeps_its_report_when_the_plots_cannot_be_written(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report was written after the plots: a plot that failed lost the table and report.json of a whole run."""
    import errno

    import leadtime.simulator.run as run

    def full_disk(*_: object) -> list[Path]:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "latency_cdf.png"))

    monkeypatch.setattr(run, "write_plots", full_disk)
    out = tmp_path / "out"
    args = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--out", str(out), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    report = json.loads(result.stdout)
    assert report["policies"]["llmd_heuristic"]["completed"] == 3
    assert json.loads((out / "report.json").read_text())["policies"] == report["policies"]
    assert len((out / "observations.jsonl").read_text().splitlines()) == 3
    assert result.stderr.splitlines()[-1].startswith("error: ") and "no space left on device" in result.stderr


@pytest.mark.parametrize(
    "first,second,canonical",
    [
        ("round_robin", "round-robin", "round_robin"),
        ("llm-d", "llmd_heuristic", "llmd_heuristic"),
        ("llmd", "llmd", "llmd_heuristic"),
    ],
)
def test_a_policy_given_twice_is_refused_naming_both_spellings(
    trace: Path, first: str, second: str, canonical: str
) -> None:
    """It ran twice, and its observations were written twice under one name (training rows doubled)."""
    args = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--policy", first, "--policy", second]
    refused(args, f"policy {second!r} is {canonical}, given already as {first!r}: give each policy once")


def test_a_plugin_configuration_no_policy_reads_is_refused(trace: Path, tmp_path: Path) -> None:
    """`--policy round_robin --config FILE` ran round-robin alone, without a word of the configuration (a user
    thinking it in effect compared a baseline); the file is not even read, so a broken one is not what is named."""
    config = tmp_path / "plugins.yaml"
    config.write_text("plugins: [{type: queue-scorer, weight: true}]\n")
    args = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--config", str(config)]
    line = refused([*args, "--policy", "round_robin", "--policy", "llm-d"], "--config: ", "--policy round_robin")
    assert "profile:NAME" in line and "unused" in line


def test_simulate_refuses_an_out_folder_that_holds_a_run_naming_its_files(trace: Path, tmp_path: Path) -> None:
    """A second run into the same folder silently replaced the first one's observations (50 rows became 20)."""
    out = tmp_path / "out"
    args = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    held = "(observations.jsonl, report.json, latency_cdf.png, utilisation.png)"
    refused(args, f"--out {out} already holds a run's files {held}", f"{out}-2")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.json").write_text("my own notes\n")
    refused([*args[:-1], str(mine)], "(report.json)")
    assert (mine / "report.json").read_text() == "my own notes\n"


def test_an_interrupted_simulate_leaves_no_half_file_and_no_folder_it_made(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C left the empty folder made before the run, and a write cut short left half a file under its name."""
    import leadtime.simulator.report as report

    rows = 0

    def interrupted(obs: object) -> dict[str, object]:
        nonlocal rows
        rows += 1
        if rows == 2:
            raise KeyboardInterrupt
        return {"row": rows}

    monkeypatch.setattr(report, "observation_to_llmd", interrupted)
    made = tmp_path / "made"
    result = runner.invoke(app, ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--out", str(made)])
    assert result.exit_code != 0 and rows == 2
    assert not made.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine\n")
    rows = 0
    result = runner.invoke(app, ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--out", str(kept)])
    assert result.exit_code != 0 and rows == 2
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]  # no observations.jsonl, whole or half


def test_a_refused_simulate_leaves_none_of_the_folders_it_made(trace: Path, tmp_path: Path) -> None:
    """`--out new/a/b` on a run refused before it wrote anything removed `b` and left `new/a`, empty."""
    out = tmp_path / "new" / "a" / "b"
    refused(["simulate", "--fleet", "nope", "--trace", str(trace), "--out", str(out)], "nope")
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    refused(["simulate", "--fleet", "nope", "--trace", str(trace), "--out", str(kept / "a")], "nope")
    assert kept.is_dir() and not (kept / "a").exists()


ROUTING_SMALL = ["bench", "routing", "--fleet", "homogeneous", "--policy", "round_robin", "--max-requests", "100"]
WHOLE_RUN_COMMANDS = [["demo"], ["demo", "--accuracy"], ROUTING_SMALL]
"""The commands whose --out takes a whole run: refused when it holds anything else, replaced when it holds theirs."""


@pytest.fixture
def quick_demos(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Both demos as stand-ins that write at once (the real ones take a minute): each run writes the files of the
    list's next entry, `"INTERRUPT"` among them standing for a Ctrl-C once the files before it are written."""
    import leadtime.bench.demo as accuracy_demo
    import leadtime.bench.routing_demo as routing_demo

    runs: list[list[str]] = []

    def write(out: Path) -> list[Path]:
        written = []
        for name in runs.pop(0):
            if name == "INTERRUPT":
                raise KeyboardInterrupt
            (out / name).write_text(f"{name}, {len(runs)} runs to go\n")
            written.append(out / name)
        return written

    monkeypatch.setattr(routing_demo, "run_demo", lambda out, **_: write(out))
    monkeypatch.setattr(accuracy_demo, "run_demo", lambda data, out, **_: write(out))
    return runs


def held(folder: Path) -> dict[str, str]:
    """The files of `folder` (its run marker aside) and their text."""
    return {p.name: p.read_text(errors="replace") for p in folder.iterdir() if p.name != ".leadtime-run.json"}


@pytest.mark.parametrize("args", WHOLE_RUN_COMMANDS)
def test_a_whole_run_command_refuses_an_out_folder_holding_anything_else_naming_it(
    tmp_path: Path, args: list[str], quick_demos: list[list[str]]
) -> None:
    """`bench routing --out` and `demo` wrote into whatever the folder held: a user's own report.json replaced, or
    another run's plots left mixed with theirs."""
    quick_demos.append(["report.json"])
    mine = tmp_path / "mine"
    (mine / "plots").mkdir(parents=True)
    (mine / "report.json").write_text("my own notes\n")
    refused([*args, "--out", str(mine)], f"--out {mine} already holds", "(plots/, report.json)", f"{mine}-2")
    assert (mine / "report.json").read_text() == "my own notes\n"
    assert sorted(p.name for p in mine.iterdir()) == ["plots", "report.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # nothing written beside it either


def test_make_demo_twice_replaces_the_first_run_as_a_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quick_demos: list[list[str]]
) -> None:
    """`make demo` runs `leadtime demo` into out/demo: a second run there is the same run again, so it replaces the
    first one whole (a plot the second run no longer draws does not stay behind to pass for its own)."""
    monkeypatch.chdir(tmp_path)
    quick_demos += [["goodput.png", "old.png", "report.json"], ["goodput.png", "report.json"]]
    assert runner.invoke(app, ["demo"]).exit_code == 0
    result = runner.invoke(app, ["demo", "--quick"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out" / "demo"
    assert held(out) == {"goodput.png": "goodput.png, 0 runs to go\n", "report.json": "report.json, 0 runs to go\n"}
    assert f"written to {Path('out/demo')}/ (goodput.png, report.json)" in result.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["demo"]  # no temporary folder left


def test_a_whole_run_interrupted_keeps_the_earlier_run_and_leaves_nothing_of_its_own(
    tmp_path: Path, quick_demos: list[list[str]]
) -> None:
    """A run cut short (Ctrl-C, a full disk) must not leave half a run where a whole one was, nor in a new folder."""
    out = tmp_path / "sub" / "demo"
    quick_demos += [["report.json", "INTERRUPT"], ["goodput.png", "report.json"], ["goodput.png", "INTERRUPT"]]
    assert runner.invoke(app, ["demo", "--out", str(out)]).exit_code != 0
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its parent, made for the run, stay
    assert runner.invoke(app, ["demo", "--out", str(out)]).exit_code == 0
    before = held(out)
    assert runner.invoke(app, ["demo", "--out", str(out)]).exit_code != 0
    assert held(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["demo"]


def test_another_commands_run_in_the_out_folder_is_refused_not_replaced(
    tmp_path: Path, quick_demos: list[list[str]]
) -> None:
    """`demo --accuracy` writes one plot where `demo` writes a report: one silently replacing the other's run is
    the clobbering the check is there to stop. A file added to a run's folder since is not the run's either."""
    out = tmp_path / "demo"
    quick_demos += [["goodput.png", "report.json"], ["predicted_vs_actual.png"]]
    assert runner.invoke(app, ["demo", "--out", str(out)]).exit_code == 0
    refused(["demo", "--accuracy", "--out", str(out)], "a `leadtime demo` run", "(goodput.png, report.json)")
    (out / "notes.txt").write_text("mine\n")
    refused(["demo", "--out", str(out)], "(notes.txt)", f"{out}-2")
    assert sorted(held(out)) == ["goodput.png", "notes.txt", "report.json"]


def test_a_file_put_into_the_out_folder_during_the_run_is_kept_and_the_run_put_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder was checked when the run started; replacing it at the end would have removed what came since."""
    import leadtime.bench.routing_demo as routing_demo

    out = tmp_path / "demo"

    def meanwhile(part: Path, **_: object) -> list[Path]:
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")
        (part / "report.json").write_text("{}\n")
        return [part / "report.json"]

    monkeypatch.setattr(routing_demo, "run_demo", meanwhile)
    result = runner.invoke(app, ["demo", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"--out {out} came to hold files not from an earlier `leadtime demo` run" in result.stderr
    assert held(out) == {"notes.txt": "mine\n"} and held(tmp_path / "demo-2") == {"report.json": "{}\n"}
    assert f"written to {out}-2/ (report.json)" in result.stdout


def test_a_run_replacing_one_in_a_linked_folder_replaces_it_where_the_link_points(
    tmp_path: Path, quick_demos: list[list[str]]
) -> None:
    """Swapping the new run in for the link itself would leave the link's target with the old run (and the link
    gone), with the folder's permissions (a group's shared folder) reset."""
    target = tmp_path / "disk" / "demo"
    target.mkdir(parents=True)
    target.chmod(0o770)
    link = tmp_path / "demo"
    link.symlink_to(target)
    quick_demos += [["report.json"], ["goodput.png"]]
    for _ in range(2):
        assert runner.invoke(app, ["demo", "--out", str(link)]).exit_code == 0
    assert link.is_symlink() and held(target) == {"goodput.png": "goodput.png, 0 runs to go\n"}
    assert target.stat().st_mode & 0o777 == 0o770
    assert sorted(p.name for p in target.parent.iterdir()) == ["demo"]


@pytest.mark.timeout(120)
def test_bench_routing_run_twice_into_one_folder_replaces_its_earlier_run(tmp_path: Path) -> None:
    out = tmp_path / "routing"
    assert runner.invoke(app, [*ROUTING_SMALL, "--json", "--out", str(out)]).exit_code == 0
    (out / "goodput.png").write_bytes(b"the first run's plot")
    result = runner.invoke(app, [*ROUTING_SMALL, "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "goodput.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(held(out)) == ["goodput.png", "latency_cdf_homogeneous.png", "report.json"]
    assert json.loads(result.stdout)["outputs"] == [str(out / name) for name in sorted(held(out))]
    assert [p.name for p in tmp_path.iterdir()] == ["routing"]


@pytest.mark.parametrize(
    "args,option",
    [
        (["bench", "gateway", "--requests", "10", "--probes", "10", "--rate-scale", "nan"], "--rate-scale"),
        (["bench", "gateway", "--non-streaming-share", "1.5"], "--non-streaming-share"),
        (["bench", "gateway", "--non-streaming-share", "nan"], "--non-streaming-share"),
        (["bench", "load", "--predict-rps", "nan", "--duration", "1"], "--predict-rps"),
        (["bench", "load", "--observe-rps", "inf", "--duration", "1"], "--observe-rps"),
        (["bench", "load", "--duration", "nan"], "--duration"),
        (["bench", "load", "--duration", "inf"], "--duration"),
        (["bench", "dashboards", "--out", "/tmp/unused", "--minutes", "nan"], "--minutes"),
        (
            ["dashboards", "render", "--prometheus", "http://127.0.0.1:1", "--out", "/tmp/x", "--minutes", "nan"],
            "--minutes",
        ),
        (["bench", "accuracy", "--seeds", "0"], "--seeds"),
        (["bench", "accuracy", "--seeds", "-1"], "--seeds"),
        (["bench", "accuracy", "--label-delay", "-1"], "--label-delay"),
        (["bench", "accuracy", "--label-delay", "soon"], "--label-delay"),
        (["bench", "coldstart", "--seed", "-1"], "--seed"),
        # A process pool's "terminated abruptly" once the capacity search had run, or a run with Leadtime's
        # policies refused deep inside (their seed must be ≥ 0) and one without them accepted.
        (["bench", "routing", "--seed", "-3", "--max-requests", "300", "--fleet", "mixed"], "--seed"),
        (["simulate", "--fleet", "mixed", "--policy", "leadtime", "--seed", "-1"], "--seed"),
        (["sim", "serve", "--fleet", "mixed", "--seed", "-1"], "--seed"),
        # Above 2**53 the policies refused it naming their field, "seed", not the option.
        (["simulate", "--fleet", "mixed", "--policy", "leadtime", "--seed", HUGE], "--seed must be ≤ 2**53"),
        (["sim", "serve", "--fleet", "mixed", "--seed", HUGE], "--seed must be ≤ 2**53"),
        (["bench", "coldstart", "--seed", HUGE], "--seed must be ≤ 2**53"),
        (["bench", "routing", "--seed", HUGE, "--max-requests", "300", "--fleet", "mixed"], "--seed must be ≤ 2**53"),
    ],
)
def test_bench_options_out_of_range_are_refused_naming_the_option(args: list[str], option: str) -> None:
    refused(args, option)


def test_bench_accuracy_refuses_to_walk_in_arrival_order_a_file_without_timestamps() -> None:
    """sharegpt-h200's rows carry no timestamp: no arrival to predict a row at."""
    refused(["bench", "accuracy", "--label-delay", "arrival"], "sharegpt-h200.jsonl", "no timestamp", "--label-delay")


def test_bench_coldstart_refuses_to_hold_back_a_class_it_learns() -> None:
    from leadtime.bench.coldstart import SEEN

    refused(["bench", "coldstart", "--unseen", SEEN[0]], "--unseen must be a class other than the seen ones", *SEEN)


def test_bench_coldstart_names_an_unknown_unseen_class_and_the_known_ones() -> None:
    """It said `accelerator: unknown accelerator class 'nope'`, the catalog's field, not the option."""
    from leadtime.features.catalog import ACCELERATORS

    line = refused(["bench", "coldstart", "--unseen", "nope"], "--unseen: unknown accelerator class 'nope'")
    assert line.endswith(f"(known: {', '.join(sorted(ACCELERATORS))})"), line


@pytest.mark.parametrize("command", ["accuracy", "coldstart"])
def test_bench_refuses_a_reference_model_it_does_not_know(command: str) -> None:
    refused(["bench", command, "--reference-model", "foo"], "--reference-model must be xgboost or lightgbm, got 'foo'")


# ----- llm-d training rows (bench accuracy, demo --accuracy, sim validate) ---------------------------------


@pytest.mark.parametrize("content,problem", [(GARBAGE, "not UTF-8 text"), (DEEP.encode(), "nested too deeply")])
@pytest.mark.parametrize(
    "command", [["bench", "accuracy", "--seeds", "1"], ["sim", "validate"], ["demo", "--accuracy", "--quick"]]
)
def test_a_rows_file_that_is_not_jsonl_is_one_line_naming_the_line(
    tmp_path: Path, rows: Path, content: bytes, problem: str, command: list[str]
) -> None:
    rows.write_bytes(rows.read_bytes() + content)
    args = [*command, "--data", str(rows)]
    if command[0] == "demo":
        args += ["--out", str(tmp_path / "demo")]
    refused(args, f"{rows}:13", problem)


@pytest.mark.parametrize(
    "content,problem",
    [(GARBAGE, "not UTF-8 text"), (b"model,hardware\n" + b'"' + b"x" * 200_000 + b'",h100\n', "splitwise.csv")],
)
def test_sim_validate_names_a_splitwise_file_that_is_not_csv(
    tmp_path: Path, rows: Path, content: bytes, problem: str
) -> None:
    splitwise = tmp_path / "splitwise.csv"
    splitwise.write_bytes(content)
    refused(["sim", "validate", "--data", str(rows), "--splitwise", str(splitwise)], str(splitwise), problem)


def test_sim_validate_names_a_cache_directory_it_cannot_create(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("LEADTIME_CACHE_DIR", str(blocker))
    refused(["sim", "validate", "--data", "sim:mixed"], str(blocker), "not a directory")


# ----- retrain ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "registry,problem", [("", "registry is empty"), ("http://models.example/x", "http://models.example/x")]
)
def test_retrain_refuses_a_registry_that_is_neither_a_directory_nor_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: str, problem: str
) -> None:
    monkeypatch.chdir(tmp_path)
    refused(["retrain", "--samples", "sharegpt-h200", "--registry", registry], problem)
    assert list(tmp_path.iterdir()) == []  # nothing published anywhere


@pytest.mark.parametrize(
    "option,value", [("--eval-share", "0"), ("--eval-share", "0.5"), ("--margin", "-1"), ("--max-malformed-share", "2")]
)
def test_retrain_names_the_option_that_is_out_of_range(tmp_path: Path, option: str, value: str) -> None:
    """It named the job's field (`eval_share must be in (0, 0.5)`), not the option the user typed."""
    args = ["retrain", "--samples", "sharegpt-h200", "--registry", str(tmp_path / "models"), option, value]
    line = refused(args, f"{option} must be in ", f"got {float(value)}")
    assert "_" not in line, line
    assert not (tmp_path / "models").exists()


def test_retrain_help_states_the_ranges_the_job_checks() -> None:
    from leadtime.training.limits import EVAL_SHARE, MALFORMED_SHARE, MARGIN

    text = " ".join(runner.invoke(app, ["retrain", "--help"]).output.split())
    for option, bounds in (
        ("--eval-share", EVAL_SHARE),
        ("--margin", MARGIN),
        ("--max-malformed-share", MALFORMED_SHARE),
    ):
        assert f"in {bounds}" in text.split(option, 1)[1].split(" --", 1)[0], (option, text)


def test_retrain_counts_a_deeply_nested_line_as_malformed(rows: Path, tmp_path: Path) -> None:
    rows.write_text(rows.read_text() + DEEP)
    refused(["retrain", "--samples", str(rows), "--registry", str(tmp_path / "models")], "line 13: not JSON")


def test_a_failed_retrain_leaves_no_directory_it_made(rows: Path, tmp_path: Path) -> None:
    """The registry directory (and the report's) were made before the samples were read, and left behind, empty,
    when the job then failed; one that was there before stays."""
    rows.write_text(rows.read_text() + DEEP)
    made, report = tmp_path / "new" / "models", tmp_path / "out" / "report"
    args = ["retrain", "--samples", str(rows), "--registry", str(made), "--report", str(report)]
    refused(args, "line 13: not JSON")
    assert not (tmp_path / "new").exists() and not (tmp_path / "out").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    refused(["retrain", "--samples", str(rows), "--registry", str(kept)], "line 13: not JSON")
    assert kept.is_dir()


# ----- sim serve --------------------------------------------------------------------------------------------


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.timeout(60)
def test_sim_serve_names_a_port_it_cannot_listen_on(taken_port: int) -> None:
    line = refused(
        ["sim", "serve", "--fleet", "homogeneous", "--base-port", str(taken_port)], f"127.0.0.1:{taken_port}"
    )
    assert "in use" in line


@pytest.mark.timeout(60)
def test_sim_serve_names_a_host_it_cannot_listen_on() -> None:
    line = refused(["sim", "serve", "--fleet", "homogeneous", "--host", "999.1.1.1", "--base-port", "47802"])
    assert line.startswith("error: cannot serve simulated endpoints on 999.1.1.1:47802: the address cannot be resolved")


@pytest.mark.parametrize("port", ["0", "65536"])
def test_sim_serve_refuses_a_timeslice_port_that_is_no_port(port: str) -> None:
    refused(["sim", "serve", "--fleet", "timesliced", "--timeslice-port", port], "--timeslice-port", "1 and 65535")


def test_sim_serve_names_an_unknown_fleet_and_the_shipped_ones() -> None:
    shipped = sorted(p.stem for p in FLEETS.glob("*.yaml"))
    refused(["sim", "serve", "--fleet", "nope"], "nope: no such file", f"shipped names: {', '.join(shipped)})")


def test_sim_serve_refuses_fewer_than_one_token_an_event() -> None:
    refused(["sim", "serve", "--fleet", "homogeneous", "--tokens-per-event", "0"], "--tokens-per-event")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("where", "problem"), [("missing/endpoints.yaml", "no directory"), (".", "is a directory")])
def test_sim_serve_refuses_an_endpoints_file_it_cannot_write_before_starting(
    tmp_path: Path, where: str, problem: str
) -> None:
    """It started the endpoints and printed their URLs, then failed to write the file."""
    args = ["sim", "serve", "--fleet", "homogeneous", "--base-port", str(free_ports(9))]
    refused([*args, "--endpoints-file", str(tmp_path / where)], "--endpoints-file", problem)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("option", ["--fleet", "--catalog"])
def test_sim_serve_refuses_to_write_its_endpoints_over_a_file_it_reads(tmp_path: Path, option: str) -> None:
    """`--endpoints-file` named the command's own --fleet file: the fleet was overwritten with the discovery file."""
    fleet, catalog = tmp_path / "fleet.yaml", tmp_path / "catalog.yaml"
    fleet.write_text(POOL)
    catalog.write_text("accelerators: [{slug: b200, peak_tflops: 2250, hbm_tb_s: 8, memory_gb: 180}]\n")
    target = (fleet if option == "--fleet" else catalog).read_text()
    args = ["sim", "serve", "--fleet", str(fleet), "--catalog", str(catalog), "--base-port", str(free_ports(2))]
    named = tmp_path / ".." / tmp_path.name / (fleet.name if option == "--fleet" else catalog.name)  # another path
    refused([*args, "--endpoints-file", str(named)], "--endpoints-file", f"the {option} file")
    assert (fleet if option == "--fleet" else catalog).read_text() == target


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "content",
    ["notes I keep\n", "endpoints: [{name: a, address: 10.0.0.1, port: '8000'}]\n", GARBAGE.decode("latin-1")],
)
def test_sim_serve_refuses_to_overwrite_a_file_it_did_not_write(tmp_path: Path, content: str) -> None:
    """Any file there was overwritten: notes, a hand-written discovery file, whatever the path named."""
    other = tmp_path / "endpoints.yaml"
    other.write_text(content)
    args = ["sim", "serve", "--fleet", "homogeneous", "--base-port", str(free_ports(9))]
    refused([*args, "--endpoints-file", str(other)], f"--endpoints-file {str(other)!r}", "not a discovery file")
    assert other.read_text() == content


@pytest.mark.timeout(60)
def test_sim_serve_rewrites_the_endpoints_file_a_run_of_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file a previous run wrote (or an empty one, as mktemp makes) is what the option is for: rewritten."""
    from leadtime.simulator.serve import FleetServer

    monkeypatch.setattr(FleetServer, "wait", FleetServer.stop)  # serve, write the file, stop
    fleet, endpoints = tmp_path / "fleet.yaml", tmp_path / "endpoints.yaml"
    fleet.write_text(POOL)
    endpoints.write_text("")
    written = []
    for _ in range(2):
        base = free_ports(2)
        result = runner.invoke(
            app, ["sim", "serve", "--fleet", str(fleet), "--base-port", str(base), "--endpoints-file", str(endpoints)]
        )
        assert result.exit_code == 0, result.output
        written.append(endpoints.read_text())
        assert f"port: '{base}'" in written[-1]
    assert written[0] != written[1]


def test_sim_serve_refuses_a_timeslice_port_among_the_endpoints_ports() -> None:
    args = ["sim", "serve", "--fleet", "timesliced", "--base-port", "18400", "--timeslice-port", "18401"]
    refused(args, "--timeslice-port 18401")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args",
    [
        ["demo"],
        ["demo", "--accuracy"],
        ["simulate", "--fleet", "homogeneous", "--max-requests", "50"],
        ["bench", "routing", "--fleet", "homogeneous", "--policy", "round_robin", "--max-requests", "100"],
        ["bench", "dashboards"],
        ["dashboards", "render", "--prometheus", "http://127.0.0.1:9"],
        ["dashboards", "build"],
        ["dashboards", "provisioning"],
    ],
)
@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_an_output_folder_that_cannot_be_made_is_refused_before_the_run(
    tmp_path: Path, args: list[str], where: str
) -> None:
    """`bench routing` ran for minutes and then died in a traceback writing its plots, the run's figures lost."""
    (tmp_path / "file").write_text("a file, not a folder\n")
    refused([*args, "--out", str(tmp_path / where)], "--out", str(tmp_path / "file"))


@pytest.mark.timeout(120)
def test_bench_routing_prints_its_figures_when_the_plots_cannot_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails after the run (a full disk) still shows what the run measured, then names the error."""
    import errno

    import leadtime.bench.routing as routing

    def full_disk(*_: object) -> list[Path]:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "goodput.png"))

    monkeypatch.setattr(routing, "write_plots", full_disk)
    args = ["bench", "routing", "--fleet", "homogeneous", "--policy", "round_robin", "--max-requests", "100"]
    result = runner.invoke(app, [*args, "--json", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    report = json.loads(result.stdout)
    assert report["fleets"]["homogeneous"]["base"]["policies"]["round_robin"]["goodput_rps"] > 0
    assert "no space left on device" in result.stderr.splitlines()[-1]


def test_shipped_names_take_hyphens_and_underscores_alike(tmp_path: Path) -> None:
    """Policies took `round-robin` for `round_robin`; fleets, traces and simulated datasets now do the same."""
    from leadtime.bench.data import dataset_path
    from leadtime.data import TRACES, resolve
    from leadtime.simulator.fleet import resolve_fleet

    assert resolve_fleet("pd-hetero") == resolve_fleet("pd_hetero")
    assert resolve("azure_conv", TRACES, "a trace") == TRACES["azure-conv"]
    assert dataset_path("sharegpt_h200") == dataset_path("sharegpt-h200")
    with pytest.raises(ValueError, match="unknown simulated trace 'long-chats'"):
        dataset_path("sim:long-chats")
    result = runner.invoke(app, ["bench", "routing", "--fleet", "pd-hetero", "--fleet", "nope"])
    assert result.exit_code != 0 and "--fleet 'nope': not a benchmark fleet" in result.output


def test_bench_load_names_the_option_that_is_out_of_range() -> None:
    """`--rows 0` said "--duration must be ≥ 1 and --rows in 1..10000"."""
    refused(["bench", "load", "--rows", "0"], "--rows must be in 1..10000, got 0")
    refused(["bench", "load", "--duration", "0.5"], "--duration must be ≥ 1 (seconds), got 0.5")


# ----- trace files --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,text",
    [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.csv", ""), ("header.csv", AZURE_HEADER)],
)
def test_a_trace_without_requests_is_refused_naming_the_file(tmp_path: Path, name: str, text: str) -> None:
    """It said "the workload has no requests", without the file."""
    path = tmp_path / name
    path.write_text(text)
    refused(["simulate", "--fleet", "homogeneous", "--trace", str(path)], f"{path}: no requests")


@pytest.mark.parametrize("field", ["input_length", "output_length"])
@pytest.mark.parametrize("value", [10**18, 1e18])
def test_a_mooncake_token_count_beyond_any_context_is_refused_naming_the_line(
    tmp_path: Path, field: str, value: float
) -> None:
    """`input_length: 1e18` was read, then refused by the policy ("input_tokens: must be ≤ 2**53"), without the file
    or the line."""
    path = tmp_path / "huge.jsonl"
    first: dict[str, float] = {"timestamp": 0, "input_length": 100, "output_length": 10}
    rows = [first, {**first, "timestamp": 5, field: value}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused(
        ["simulate", "--fleet", "homogeneous", "--trace", str(path), "--policy", "round-robin"],
        f"{path}:2: '{field}' must be an integer from 1 to 16,777,216",
    )


def test_a_mooncake_timestamp_beyond_any_clock_is_refused_naming_the_line(tmp_path: Path) -> None:
    """`timestamp: 1e308` ended in an OverflowError traceback deep in the simulation."""
    path = tmp_path / "huge.jsonl"
    first = {"timestamp": 0, "input_length": 100, "output_length": 10}
    path.write_text(json.dumps(first) + "\n" + json.dumps({**first, "timestamp": 1e308}) + "\n")
    refused(
        ["simulate", "--fleet", "homogeneous", "--trace", str(path)],
        f"{path}:2: 'timestamp' 1e+308 is more than 100,000,000,000 ms",
    )


def test_an_azure_row_beyond_any_clock_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "far.csv"
    path.write_text(AZURE_HEADER + "2024-01-01 00:00:00,10,5\n9024-01-01 00:00:01,10,5\n")
    refused(
        ["simulate", "--fleet", "homogeneous", "--trace", str(path)],
        f"{path}:3: TIMESTAMP '9024-01-01 00:00:01' is more than 100,000,000,000 ms",
    )


@pytest.mark.parametrize(
    "args,names",
    [
        (["--trace", "synthetic:rate_rps=1e-300,requests=5"], ["rate_rps must be at least", "for 5 requests"]),
        (["--max-requests", "3", "--rate-scale", "1e-300"], ["rate_scale 1e-300", "100,000,000,000 ms"]),
    ],
)
def test_arrivals_spread_beyond_any_clock_are_refused_not_simulated_as_0_ms(
    trace: Path, args: list[str], names: list[str]
) -> None:
    """At clock values of 1e300 ms a step of a few ms no longer changes the float: every latency came out 0."""
    refused(["simulate", "--fleet", "homogeneous", "--trace", str(trace), *args], *names)


def test_an_azure_token_count_beyond_any_context_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "huge.csv"
    path.write_text(AZURE_HEADER + "2024-01-01 00:00:00,10,5\n2024-01-01 00:00:01,100000000000,5\n")
    refused(["simulate", "--fleet", "homogeneous", "--trace", str(path)], f"{path}:3: 'ContextTokens'", "16,777,216")


@pytest.mark.parametrize(
    "row,names",
    [
        ("2024-01-01 00:00:01,,50", ["bad.csv:3", "ContextTokens", "''"]),
        ("2024-01-01 00:00:01,12,5.5", ["bad.csv:3", "GeneratedTokens", "'5.5'"]),
    ],
)
def test_an_azure_token_count_that_is_no_integer_is_named_with_its_value(
    tmp_path: Path, row: str, names: list[str]
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(AZURE_HEADER + "2024-01-01 00:00:00,10,5\n" + row + "\n")
    refused(["simulate", "--fleet", "homogeneous", "--trace", str(path)], *names)


def test_a_short_azure_row_is_named_as_short(tmp_path: Path) -> None:
    """A row of 2 cells under a 3-column header said "'GeneratedTokens' must be an integer ≥ 1, got None"."""
    path = tmp_path / "short.csv"
    path.write_text(AZURE_HEADER + "2024-01-01 00:00:00,10,5\n2024-01-01 00:00:01,12\n")
    refused(
        ["simulate", "--fleet", "homogeneous", "--trace", str(path)], f"{path}:3: the row is short", "GeneratedTokens"
    )


def test_segments_that_are_not_whole_blocks_are_refused_naming_segment_tokens() -> None:
    refused(
        ["simulate", "--fleet", "mixed", "--trace", "synthetic:segment_tokens=24,requests=50"],
        "segment_tokens=24",
        "multiple of every pool's block_size",
    )


def test_bench_routing_on_requests_that_all_arrive_at_one_instant_says_so(tmp_path: Path) -> None:
    """simulate said so; bench routing said "could not bracket the fleet's capacity"."""
    burst = tmp_path / "burst.jsonl"
    row = json.dumps({"timestamp": 0, "input_length": 300, "output_length": 5})
    burst.write_text((row + "\n") * 120)
    args = ["bench", "routing", "--trace", str(burst), "--max-requests", "120", "--fleet", "homogeneous"]
    refused([*args, "--policy", "round_robin", "--workers", "1"], "120 request(s)", "one instant")


@pytest.fixture
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway benchmark's child processes, made to fail the test if one is started."""
    import leadtime.bench.gateway as gateway

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a child process was started before the options were checked")

    for name in ("Predictor", "SimFleet", "Route"):
        monkeypatch.setattr(gateway, name, started)


@pytest.mark.parametrize(
    "url,problem", [("redis://127.0.0.1:{port}/0", "unreachable"), ("redis://127.0.0.1:abc/0", "Port could not")]
)
def test_bench_gateway_refuses_a_replicas_redis_nothing_answers_at(no_processes: None, url: str, problem: str) -> None:
    """It ran and filled overhead_ms_pulled_replicas with the figure of a replica that never heard the other."""
    url = url.format(port=free_ports(1))
    args = ["bench", "gateway", "--requests", "10", "--probes", "10", "--replicas-redis", url, "--json"]
    refused(args, f"--replicas-redis {url}", problem)


def test_bench_gateway_names_a_trace_that_is_not_one_before_starting_anything(no_processes: None) -> None:
    """It started the fleet, the predictor and three gateways, and said so ~30 s later."""
    refused(["bench", "gateway", "--trace", "nosuch", "--requests", "10", "--probes", "10"], "nosuch")


@pytest.mark.parametrize("stamps", [[0], [0, 0, 0]])
def test_bench_gateway_refuses_requests_that_all_arrive_at_one_instant(
    no_processes: None, tmp_path: Path, stamps: list[int]
) -> None:
    """A one-request trace was replayed and its goodput printed as 1,000,000,000 req/s (met / max(window, 1e-9));
    simulate refused the same trace."""
    burst = tmp_path / "burst.jsonl"
    burst.write_text(
        "".join(json.dumps({"timestamp": t, "input_length": 100, "output_length": 10}) + "\n" for t in stamps)
    )
    line = refused(["bench", "gateway", "--trace", str(burst), "--requests", "10", "--probes", "30"], str(burst))
    assert "one instant" in line and "--max-requests" not in line  # replayed with its steps spread: more is alike


@pytest.mark.parametrize(("last_ms", "rate_scale"), [("1e10", "2"), ("200000000", "1")])  # 1e300: refused on reading
def test_bench_gateway_refuses_an_arrival_window_no_real_time_replay_would_end(
    no_processes: None, tmp_path: Path, last_ms: str, rate_scale: str
) -> None:
    """A trace whose arrivals span 1e300 ms was replayed in real time: the benchmark would never finish."""
    trace = tmp_path / "long.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 10}\n'
        f'{{"timestamp": {last_ms}, "input_length": 100, "output_length": 10}}\n'
    )
    args = ["bench", "gateway", "--trace", str(trace), "--requests", "10", "--probes", "30", "--rate-scale", rate_scale]
    refused(args, str(trace), "more than a day", "--rate-scale")


def test_bench_gateway_help_says_the_first_probe_pairs_only_warm_up() -> None:
    """`--probes 10` measured 5 pairs, without a word."""
    from leadtime.bench.gateway import WARMUP_PAIRS

    result = runner.invoke(app, ["bench", "gateway", "--help"])
    assert f"the first {WARMUP_PAIRS} only warm up" in " ".join(result.output.split())
    refused(["bench", "gateway", "--probes", str(WARMUP_PAIRS)], "--probes", f"the first {WARMUP_PAIRS}")


@pytest.mark.parametrize("item", ["QUANTILE=abc", "quantile=2", "quantile=5"])
def test_bench_serving_names_a_setting_whose_value_is_not_one(item: str) -> None:
    """QUANTILE=abc printed `leadtime serve`'s usage error for --quantile, in five lines, naming no --setting."""
    refused(["bench", "serving", "--setting", item], f"--setting {item}")


@pytest.mark.parametrize(
    "url,problem",
    [
        ("foo", "expected redis://"),
        ("redis://127.0.0.1:{port}/0", "unreachable"),
        ("redis://127.0.0.1:abc/0", "redis://127.0.0.1:abc/0: Port could not be cast to integer value as 'abc'"),
    ],
)
def test_bench_dashboards_refuses_a_redis_url_before_starting_anything(tmp_path: Path, url: str, problem: str) -> None:
    """`--redis foo` was refused by the predictor service once the stack had started, in two lines."""
    refused(
        ["bench", "dashboards", "--out", str(tmp_path), "--redis", url.format(port=free_ports(1))], "--redis", problem
    )


@pytest.mark.parametrize("url", ["http://:s3cret@127.0.0.1:6379/0", "user:s3cret@127.0.0.1:6379"])
def test_a_redis_url_of_another_form_is_refused_without_showing_its_password(tmp_path: Path, url: str) -> None:
    line = refused(["bench", "dashboards", "--out", str(tmp_path), "--redis", url], "--redis", "expected redis://")
    assert "s3cret" not in line and "127.0.0.1" in line


def test_bench_sim_says_when_the_trace_has_fewer_requests_than_asked(trace: Path) -> None:
    """`--requests 20000` replayed the trace's 12,031 without a word."""
    args = ["bench", "sim", "--fleet", "homogeneous", "--trace", str(trace), "--requests", "5", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"] == 3
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "--requests 5" in warnings[0] and "3 requests" in warnings[0], result.stderr


# ----- plugin configurations --------------------------------------------------------------------------------

MINE = "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: mine, plugins: [{pluginRef: queue-scorer}]}]\n"
ROUTE = ["route", "--endpoint", "127.0.0.1:9"]


@pytest.mark.parametrize("command", [["simulate", "--fleet", "homogeneous"], ROUTE])
def test_a_config_that_is_not_valid_yaml_is_one_line_naming_where(tmp_path: Path, command: list[str]) -> None:
    """A tab in a configuration printed PyYAML's five-line dump; fleet files were one line already."""
    tabs = tmp_path / "tabs.yaml"
    tabs.write_text("plugins:\n\t- type: queue-scorer\n")
    refused([*command, "--config", str(tabs)], str(tabs), "not valid YAML (line 2, column 1: found character")


@pytest.mark.parametrize("command", [["simulate", "--fleet", "homogeneous"], ROUTE])
def test_a_missing_profile_names_the_configuration_file(tmp_path: Path, command: list[str]) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text(MINE)
    refused([*command, "--config", str(mine)], f"{mine}: schedulingProfiles: no profile named 'default'", "mine")


@pytest.mark.parametrize("config", [False, True])
def test_an_unknown_profile_is_named_before_the_trace_is_judged(tmp_path: Path, config: bool) -> None:
    """`--policy profile:nope --max-requests 5` said the 5 requests arrive at one instant, not that there is no
    profile 'nope' (with the shipped configuration, or the one given)."""
    from leadtime.router_plugin.config import SHIPPED_CONFIG

    mine = tmp_path / "mine.yaml"
    mine.write_text(MINE)
    extra = ["--config", str(mine)] if config else []
    args = ["simulate", "--fleet", "homogeneous", "--max-requests", "5", "--policy", "profile:nope", *extra]
    refused(args, f"{mine if config else SHIPPED_CONFIG}: schedulingProfiles: no profile named 'nope'")


@pytest.mark.parametrize("command", [["simulate", "--fleet", "homogeneous"], ROUTE])
@pytest.mark.parametrize("key", ["overflowCap", "holdSloMultiple", "kvLinkGbS"])
def test_an_infinite_latency_parameter_is_one_line_naming_the_file_and_field(
    tmp_path: Path, command: list[str], key: str
) -> None:
    """`overflowCap: .inf` passed the configuration's checks; the policy then refused it, and `route` printed a
    traceback (exit 1)."""
    from leadtime.router_plugin.config import SHIPPED_CONFIG

    mine = tmp_path / "inf.yaml"
    mine.write_text(re.sub(rf"(\n +{key}:) [0-9.]+", r"\1 .inf", SHIPPED_CONFIG.read_text(), count=1))
    assert ".inf" in mine.read_text()
    refused([*command, "--config", str(mine)], f"{mine}: plugins[2].parameters.{key}: ", "finite")


@pytest.mark.parametrize("command", [["simulate", "--fleet", "homogeneous"], ROUTE])
@pytest.mark.parametrize("special", ["/dev/zero", "fifo", "directory", "big"])
def test_a_config_that_is_no_regular_file_or_too_large_is_refused_unread(
    tmp_path: Path, command: list[str], special: str
) -> None:
    """`--config /dev/zero` was read until memory ran out: fleet and catalog files were checked, --config not."""
    import os

    path = Path(special) if special.startswith("/") else tmp_path / special
    if special == "fifo":
        os.mkfifo(path)
    elif special == "directory":
        path.mkdir()
    elif special == "big":
        path.write_text("# " + "x" * (1 << 20) + "\n" + MINE)
    problem = {"directory": "is a directory", "big": "larger than 1 MiB"}.get(special, "not a regular file")
    refused([*command, "--config", str(path)], str(path), problem)


def test_llmds_top_level_keys_load_with_one_warning(tmp_path: Path, trace: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text(MINE + "featureGates: [prepareDataPlugins]\nsaturationDetector: {queueDepthThreshold: 5}\n")
    args = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--config", str(mine), "--json"]
    result = runner.invoke(app, [*args, "--policy", "profile:mine"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "not used" in line]
    unused = "llm-d's featureGates, saturationDetector are accepted and not used by Leadtime"
    assert warnings == [f"warning: {mine}: {unused}"]


def test_an_llmd_pd_handler_threshold_is_one_warning_line_naming_the_key(tmp_path: Path, trace: Path) -> None:
    """llm-d's `pd-profile-handler` `threshold` was dropped without a word."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        MINE.replace(
            "[{type: queue-scorer}]", "[{type: queue-scorer}, {type: pd-profile-handler, parameters: {threshold: 10}}]"
        )
    )
    args = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--config", str(mine), "--json"]
    result = runner.invoke(app, [*args, "--policy", "profile:mine"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "threshold" in line]
    assert len(warnings) == 1, result.stderr
    assert warnings[0].startswith(f"warning: {mine}: plugins[1].parameters.threshold: llm-d's pd-profile-handler")


def test_overflow_endpoints_the_fleet_does_not_have_are_warned_about(tmp_path: Path, trace: Path) -> None:
    """The gateway warns of an `overflowEndpoints` entry no endpoint has; `simulate` ran with one silently (a
    misspelling leaves the overflow to the candidates' order)."""
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "plugins: [{type: predicted-latency-scorer, parameters: {overflowEndpoints: [h100-0, nosuch-0]}}]\n"
        "schedulingProfiles: [{name: mine, plugins: [{pluginRef: predicted-latency-scorer}]}]\n"
    )
    args = ["simulate", "--fleet", "homogeneous", "--trace", str(trace), "--config", str(mine), "--json"]
    result = runner.invoke(app, [*args, "--policy", "profile:mine"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "overflowEndpoints" in line]
    assert len(warnings) == 1, result.stderr
    assert warnings[0].startswith(f"warning: {mine}: ") and "'nosuch-0'" in warnings[0], warnings
    assert "'h100-0'" not in warnings[0]


# ----- scale-out pools --------------------------------------------------------------------------------------

LATE = POOL + "  - {name: late, count: 1, accelerator: h100-sxm, model: llama-3.1-8b, join_at_s: %s}\n"


@pytest.mark.parametrize("join_at_s", ["1e308", ".inf", "100"])
def test_a_pool_that_never_joins_is_warned_about(tmp_path: Path, trace: Path, join_at_s: str) -> None:
    fleet = tmp_path / "late.yaml"
    fleet.write_text(LATE % join_at_s)
    result = runner.invoke(app, ["simulate", "--fleet", str(fleet), "--trace", str(trace), "--json"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "late" in line]
    assert len(warnings) == 1 and "never joins" in warnings[0] and "0 requests" in warnings[0], result.stderr


PD_POOLS = (
    "pools:\n  - {name: p, count: 1, accelerator: h100-sxm, model: llama-3.1-8b, role: prefill}\n"
    "  - {name: d, count: 1, accelerator: h100-sxm, model: llama-3.1-8b, role: decode%s}\n"
    "  - {name: d2, count: 1, accelerator: h100-sxm, model: llama-3.1-8b, role: decode%s}\n"
)


@pytest.mark.parametrize("late", [", join_at_s: 5", ", join_at_share: 0.5"])
@pytest.mark.parametrize("command", [["simulate", "--policy", "round-robin"], ["sim", "serve"]])
def test_a_pd_fleet_whose_decode_pools_all_join_later_is_refused_naming_them(
    tmp_path: Path, trace: Path, late: str, command: list[str]
) -> None:
    """It passed the fleet's checks, then the run aborted at the first request saying "P/D fleet has no decode
    endpoint", naming neither the file nor the pool: prefill endpoints serve no client alone."""
    fleet = tmp_path / "pd.yaml"
    fleet.write_text(PD_POOLS % (late, late))
    args = [*command, "--fleet", str(fleet)] + (["--trace", str(trace)] if command[0] == "simulate" else [])
    refused(args, str(fleet), "'d', 'd2'", "decode", "from the start")


def test_a_pd_fleet_with_a_decode_pool_from_the_start_may_scale_out_the_others(trace: Path, tmp_path: Path) -> None:
    fleet = tmp_path / "pd.yaml"
    fleet.write_text(PD_POOLS % ("", ", join_at_share: 0.5"))
    result = runner.invoke(app, ["simulate", "--fleet", str(fleet), "--trace", str(trace), "--policy", "round-robin"])
    assert result.exit_code == 0, result.output


def test_sim_serve_says_it_does_not_model_a_scale_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sim serve` had the late pool listen from the start, in --endpoints-file, and said nothing."""
    monkeypatch.setattr("leadtime.simulator.serve.serve_fleet", lambda *args, **kwargs: None)
    fleet = tmp_path / "late.yaml"
    fleet.write_text(LATE % "30")
    result = runner.invoke(app, ["sim", "serve", "--fleet", str(fleet)])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "'late'" in warnings[0] and "not modelled" in warnings[0], result.stderr


def test_a_fleet_holding_a_number_of_thousands_of_digits_is_one_line(tmp_path: Path) -> None:
    """PyYAML reads such a number as Python's int(), which refuses it with a ValueError that no fleet check caught."""
    fleet = tmp_path / "huge.yaml"
    fleet.write_text(f"pools:\n  - {{name: a, count: {'9' * 5000}, accelerator: h100-sxm, model: llama-3.1-8b}}\n")
    refused(["sim", "serve", "--fleet", str(fleet)], str(fleet), "not valid YAML")


@pytest.mark.parametrize("special", ["/dev/zero", "fifo", "directory"])
def test_a_fleet_or_catalog_that_is_no_regular_file_is_refused_not_read_for_ever(tmp_path: Path, special: str) -> None:
    """`--catalog /dev/zero` (or a named pipe nobody writes) read for ever: the command hung."""
    import os

    path = Path(special) if special.startswith("/") else tmp_path / special
    if special == "fifo":
        os.mkfifo(path)
    elif special == "directory":
        path.mkdir()
    problem = "is a directory" if special == "directory" else "not a regular file"
    refused(["sim", "serve", "--fleet", str(path)], str(path), problem)
    refused(["retrain", "--samples", "x.jsonl", "--registry", str(tmp_path / "r"), "--catalog", str(path)], str(path))


def test_a_fleet_larger_than_a_mebibyte_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n" + POOL)
    refused(["sim", "serve", "--fleet", str(big)], str(big), "larger than 1 MiB")


@pytest.mark.parametrize("option", [["--data", "nosuch"], ["--reference-model", "lightgbm"]])
def test_demo_refuses_an_option_of_the_accuracy_demo_without_it(option: list[str]) -> None:
    """`demo --quick --data nosuch` ran the routing demo and said nothing of --data."""
    refused(["demo", "--quick", *option], option[0], "--accuracy")


@pytest.mark.parametrize("target", ["https://127.0.0.1:18501", "grpcs://127.0.0.1:18501"])
def test_route_refuses_a_url_given_as_the_grpc_predictor(target: str) -> None:
    """It was a traceback ending in the client's ValueError, exit 1."""
    refused(["route", "--endpoint", "127.0.0.1:8100", "--predictor-grpc", target], "--predictor-grpc", "HOST:PORT")


@pytest.mark.parametrize(
    "command",
    [
        ["serve", "--grpc-port", "0"],
        ["route", "--endpoint", "127.0.0.1:8100", "--policy", "round-robin"],
        ["sim", "serve", "--fleet", "homogeneous"],
    ],
)
@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_rather_than_listening_on_every_interface(command: list[str], host: str) -> None:
    """`--host "$HOST"` with HOST unset listened on 0.0.0.0 and [::]: the servers are said to stay on loopback unless
    told otherwise, and an empty value is no such telling."""
    refused([*command, "--host", host], "--host", "0.0.0.0")


def test_route_takes_a_plain_policy_spelled_with_underscores() -> None:
    """`simulate` and `bench routing` take `round_robin` for `round-robin`; `route` refused it."""
    result = CliRunner().invoke(
        app, ["route", "--endpoint", "127.0.0.1:8100", "--policy", "least_queue", "--port", "0"]
    )
    assert "--policy must be one of" not in result.output, result.output


def test_the_itl_slo_option_is_spelled_alike_on_route_and_simulate() -> None:
    """`route` took `--tpot-slo-ms` (llm-d's header's word) and `simulate` `--itl-slo-ms`: each takes both now."""
    refused(["route", "--endpoint", "127.0.0.1:8100", "--itl-slo-ms", "-1"], "--tpot-slo-ms")
    refused(["simulate", "--fleet", "homogeneous", "--tpot-slo-ms", "-1"], "--itl-slo-ms")


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "accuracy"],
        ["sim", "validate"],
        ["retrain", "--samples", "sharegpt-h200", "--registry", "unused-registry"],
        ["route", "--endpoint", "127.0.0.1:8100"],
    ],
)
@pytest.mark.parametrize("option", ["--accelerator", "--model"])
def test_an_unknown_class_or_model_names_the_option(command: list[str], option: str, tmp_path: Path) -> None:
    """`bench accuracy --accelerator b200` said `accelerator: unknown ...`: a row's field or the option?"""
    refused([*command, option, "b200"], f"{option}: unknown")


@pytest.mark.parametrize("prometheus", [None, "/usr/bin/prometheus"])
def test_bench_dashboards_stopped_before_drawing_leaves_no_out_folder_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prometheus: str | None
) -> None:
    """A run refused for want of Prometheus, or whose stack failed to start, left behind the empty `--out` folders it
    had made, which read as a run that drew nothing; a folder that was there before stays."""
    import leadtime.bench.dashboards
    import leadtime.bench.procs

    def failing(*args: object, **kwargs: object) -> list[Path]:
        raise RuntimeError("prometheus was not ready within 30 s")

    monkeypatch.setattr(leadtime.bench.procs, "find_prometheus", lambda: prometheus)
    monkeypatch.setattr(leadtime.bench.dashboards, "run_dashboard_bench", failing)
    out = tmp_path / "a" / "pngs"
    refused(["bench", "dashboards", "--out", str(out)], "prometheus")
    assert not (tmp_path / "a").exists()
    refused(["bench", "dashboards", "--out", str(tmp_path)], "prometheus")
    assert tmp_path.is_dir()


@pytest.mark.parametrize("command", ["tls", "load"])
def test_bench_rows_above_what_the_service_takes_in_one_call_are_refused(command: str) -> None:
    """`bench tls --rows 20000` started two services for calls they answer 422 (more than `max_rows`)."""
    refused(["bench", command, "--rows", "10001"], "--rows", "1..10000")
