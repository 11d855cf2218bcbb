"""The `leadtime` command: one CLI over every package. Nothing imports this module.

Each command imports what it needs lazily so that `leadtime --help` stays fast. Errors a user can fix
(bad file, bad option value) are printed as one line and exit 2, never as a traceback.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from leadtime.data import MEASURED, SPLITWISE, DataFileError, describe_os_error
from leadtime.features.errors import FeatureError, validation_problem

# Plain (click-style) help: typer's rich help prints a type after every option, `<bool>` after flags included.
app = typer.Typer(
    no_args_is_help=True, add_completion=False, rich_markup_mode=None, help="Leadtime: latency-prediction routing."
)
bench_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None, help="Benchmarks that print the figures the README quotes."
)
sim_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="The fleet simulator's tools.")
dashboards_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None, help="The Grafana dashboards: write their JSON, draw their panels."
)
app.add_typer(bench_app, name="bench")
app.add_typer(sim_app, name="sim")
app.add_typer(dashboards_app, name="dashboards")

DEFAULT_MEASURED = "sharegpt-h200"
MEASURED_HELP = (
    f"JSONL of llm-d training rows, a shipped name ({', '.join(MEASURED)}), or a trace the simulator records "
    "(sim:bimodal, sim:long-chat, sim:long-chat-no-timeout, sim:mixed, sim:pd; generated once, then cached)."
)
REFERENCE_HELP = "Model of the llm-d reference: xgboost (llm-d's default; the default where installed) or lightgbm."


def _reference_model(value: str | None) -> str | None:
    if value is not None and value not in ("xgboost", "lightgbm"):
        _fail(f"--reference-model must be xgboost or lightgbm, got {value!r}")
    if value == "xgboost":
        import importlib.util

        if importlib.util.find_spec("xgboost") is None:
            _fail("--reference-model xgboost needs the xgboost package (pip install 'leadtime[test]')")
    return value


def _fail(message: str | Exception) -> None:
    """One line on stderr and exit 2: the shape of every error a user can fix."""
    if isinstance(message, OSError) and message.strerror:
        message = describe_os_error(message)
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _output_dir(path: Path) -> None:
    """Make the `--out` folder and check that it takes files before a run that may last minutes, so the run does
    not end in a write error with its figures lost."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        _fail(f"--out {path}: a file is in the way (a folder is needed)")
    except OSError as err:
        _fail(f"--out {path}: cannot write there ({(err.strerror or str(err)).lower()})")


def _positive(option: str, value: float, infinite: bool = False) -> None:
    """Fail unless `value` is a number > 0 (NaN is not), finite unless `infinite` allows infinity."""
    if not value > 0 or (math.isinf(value) and not infinite):
        _fail(f"{option} must be > 0{'' if infinite else ' and finite'}, got {value}")


def _version(value: bool) -> None:
    if value:
        from leadtime import __version__

        typer.echo(f"leadtime {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Leadtime: latency-prediction routing."""


def _measured(data: str) -> Path:
    from leadtime.bench.data import dataset_path

    try:
        return dataset_path(data)
    except (DataFileError, ValueError, OSError) as err:  # OSError: a sim: trace's cache cannot be written
        _fail(err)
        raise


# ----- predictor core -------------------------------------------------------------------------


@bench_app.command("accuracy")
def bench_accuracy(
    data: Annotated[str, typer.Option(help=MEASURED_HELP)] = DEFAULT_MEASURED,
    accelerator: Annotated[str, typer.Option(help="Accelerator class the rows came from.")] = "h200-sxm",
    model: Annotated[str, typer.Option(help="Model the rows came from.")] = "qwen3-32b",
    seeds: Annotated[int, typer.Option(help="Seeds of the random 90/10 split.")] = 10,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    reference_model: Annotated[str | None, typer.Option(help=REFERENCE_HELP)] = None,
    label_delay: Annotated[
        int,
        typer.Option(
            help="Rows predicted before a row's outcome is learned in the prequential walk (as in production, "
            "where an outcome arrives when its request completes); 0 = learned at once."
        ),
    ] = 0,
) -> None:
    """Prequential and 90/10-split accuracy of Leadtime, the llm-d reference and a median floor."""
    from leadtime.bench.accuracy import print_report, run_accuracy

    if seeds < 1:
        _fail(f"--seeds must be ≥ 1, got {seeds}")
    if label_delay < 0:
        _fail(f"--label-delay must be ≥ 0, got {label_delay}")
    reference = _reference_model(reference_model)
    try:
        report = run_accuracy(
            _measured(data),
            accelerator=accelerator,
            model=model,
            seeds=seeds,
            progress=not json_out,
            reference_model=reference,
            label_delay=label_delay,
        )
    except (FeatureError, OSError, ValueError) as err:
        _fail(err)
    print_report(report, as_json=json_out)


@bench_app.command("coldstart")
def bench_coldstart(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    seed: Annotated[int, typer.Option(help="Random seed of the synthetic fleet data.")] = 0,
    unseen: Annotated[str, typer.Option(help="The accelerator class held back (never seen in training).")] = "mi300x",
    reference_model: Annotated[str | None, typer.Option(help=REFERENCE_HELP)] = None,
) -> None:
    """Accuracy on an accelerator class never seen before, after 50 and 500 of its observations."""
    from leadtime.bench.coldstart import print_report, run_coldstart

    if seed < 0:
        _fail(f"--seed must be ≥ 0, got {seed}")
    reference = _reference_model(reference_model)
    try:
        report = run_coldstart(seed=seed, unseen=unseen, reference_model=reference)
    except (FeatureError, ValueError) as err:
        _fail(err)
    print_report(report, as_json=json_out)


@app.command("demo")
def demo(
    out: Annotated[Path, typer.Option(help="Where to write the report and plots.")] = Path("out/demo"),
    quick: Annotated[bool, typer.Option("--quick", help="A short run, as a smoke test.")] = False,
    accuracy: Annotated[
        bool,
        typer.Option("--accuracy", help="Instead: the predictor alone walking the real H200 trace beside llm-d's."),
    ] = False,
    data: Annotated[str, typer.Option(help=MEASURED_HELP + " (with --accuracy)")] = DEFAULT_MEASURED,
    reference_model: Annotated[str | None, typer.Option(help=REFERENCE_HELP + " (with --accuracy)")] = None,
) -> None:
    """Leadtime routing a mixed, a P/D and a time-sliced fleet beside the routers a user could pick instead."""
    _output_dir(out)
    if accuracy:
        from leadtime.bench.demo import run_demo as run_accuracy_demo

        reference = _reference_model(reference_model)
        try:
            run_accuracy_demo(_measured(data), out, max_rows=600 if quick else None, reference_model=reference)
        except (FeatureError, OSError, ValueError) as err:
            _fail(err)
        return
    from leadtime.bench.routing_demo import run_demo

    try:
        run_demo(out, max_requests=300 if quick else 1500)
    except (FeatureError, OSError, ValueError, RuntimeError) as err:
        _fail(err)


# ----- predictor service ----------------------------------------------------------------------


@app.command("serve")
def serve(
    host: Annotated[str | None, typer.Option(envvar="LEADTIME_HOST", help="HTTP address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(envvar="LEADTIME_PORT", help="HTTP port (default 8000).")] = None,
    grpc_port: Annotated[
        int | None, typer.Option(envvar="LEADTIME_GRPC_PORT", help="gRPC port, 0 = off (default 50051).")
    ] = None,
    redis: Annotated[
        str | None, typer.Option(envvar="LEADTIME_REDIS_URL", help="Share state through Redis (redis://...).")
    ] = None,
    role: Annotated[
        str | None, typer.Option(envvar="LEADTIME_ROLE", help="all | prediction | training (default all).")
    ] = None,
    objective: Annotated[
        str | None, typer.Option(envvar="LEADTIME_OBJECTIVE", help="quantile | mean (default quantile).")
    ] = None,
    quantile: Annotated[
        float | None, typer.Option(envvar="LEADTIME_QUANTILE", help="Upper quantile (default 0.9).")
    ] = None,
    model_dir: Annotated[
        Path | None, typer.Option(envvar="LEADTIME_MODEL_DIR", help="Load and save the model here.")
    ] = None,
    api_token: Annotated[
        str | None, typer.Option(envvar="LEADTIME_API_TOKEN", help="Bearer token the write paths require.")
    ] = None,
    accelerator: Annotated[
        str | None, typer.Option(envvar="LEADTIME_ACCELERATOR", help="Class for rows naming none (h100-sxm).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(envvar="LEADTIME_MODEL", help="Model for rows naming none (llama-3.1-8b).")
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(envvar="LEADTIME_TLS_CERTFILE", help="PEM certificate: HTTPS and gRPC over TLS.")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(envvar="LEADTIME_TLS_KEYFILE", help="PEM key of --tls-cert.")] = None,
) -> None:
    """Run the predictor service: llm-d-compatible and native HTTP, gRPC, Prometheus /metrics."""
    from pydantic import ValidationError

    from leadtime.predictor.service.cpus import CpuPlanError, allowed_cpus, plan_cpus
    from leadtime.predictor.settings import ServiceSettings

    overrides = dict(
        host=host,
        port=port,
        grpc_port=grpc_port,
        redis_url=redis,
        role=role,
        objective=objective,
        quantile=quantile,
        model_dir=model_dir,
        api_token=api_token,
        accelerator=accelerator,
        model=model,
        tls_certfile=tls_cert,
        tls_keyfile=tls_key,
    )
    try:
        settings = ServiceSettings.from_env(overrides)
        from leadtime.features.catalog import get_accelerator, get_model

        get_accelerator(settings.accelerator)
        get_model(settings.model)
        plan_cpus(settings.learner_cpus, allowed_cpus())
    except ValidationError as err:
        where, problem = validation_problem(err)
        _fail(f"{where}: {problem}" if where else problem)
    except (FeatureError, CpuPlanError) as err:
        _fail(err)
    from leadtime.predictor.service.app import StoreError
    from leadtime.predictor.service.serve import serve as run_service

    try:
        run_service(settings)
    except (OSError, StoreError) as err:
        _fail(err)


@bench_app.command("serving")
def bench_serving(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    calls: Annotated[int, typer.Option(help="Timed calls per row count and protocol.")] = 2000,
    setting: Annotated[
        list[str] | None,
        typer.Option(help="NAME=VALUE: a service setting for the measured service (LEADTIME_NAME), repeatable."),
    ] = None,
) -> None:
    """Service latency over HTTP and gRPC (1, 10, 100 rows), also while retraining, and ingestion rate."""
    from leadtime.bench.serving import print_report, run_serving
    from leadtime.predictor.settings import ServiceSettings

    if calls < 10:
        _fail("--calls must be ≥ 10")
    settings: dict[str, str] = {}
    for item in setting or []:
        name, sep, value = item.partition("=")
        if not sep or name.lower() not in ServiceSettings.model_fields:
            _fail(f"--setting {item!r}: expected NAME=VALUE with NAME a service setting, e.g. learner_cpus=auto")
        settings[name.lower()] = value
    try:
        report = run_serving(calls=calls, progress=not json_out, settings=settings)
    except (OSError, RuntimeError) as err:
        _fail(err)
    print_report(report, as_json=json_out)


# ----- fleet simulator ------------------------------------------------------------------------

TRACE_HELP = "A shipped trace (mooncake, azure-conv), a Mooncake .jsonl or Azure .csv, or synthetic:rate_rps=20,..."
FLEET_HELP = "A shipped fleet (see `leadtime sim fleets`) or a fleet YAML."


@app.command("simulate")
def simulate(
    fleet: Annotated[str, typer.Option(help=FLEET_HELP)],
    trace: Annotated[str, typer.Option(help=TRACE_HELP)] = "mooncake",
    policy: Annotated[list[str], typer.Option(help="Routing policy; repeat to compare several.")] = ["llm-d"],  # noqa: B006
    max_requests: Annotated[int | None, typer.Option(help="Replay only the first N requests.")] = None,
    rate_scale: Annotated[float, typer.Option(help="Arrival-rate multiplier (2 = twice as fast).")] = 1.0,
    seed: Annotated[int, typer.Option(help="Random seed (policies, time-slice windows).")] = 0,
    ttft_slo_ms: Annotated[
        float, typer.Option(help="TTFT SLO of every request when the fleet states no SLO classes.")
    ] = 2000.0,
    itl_slo_ms: Annotated[
        float, typer.Option(help="ITL SLO of every request when the fleet states no SLO classes.")
    ] = 100.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    out: Annotated[Path | None, typer.Option(help="Directory for observations JSONL, plots, report.")] = None,
) -> None:
    """Replay a trace on a simulated fleet under one or more routing policies."""
    from leadtime.simulator.cli import print_simulation, run_simulate_command

    if max_requests is not None and max_requests < 1:
        _fail("--max-requests must be ≥ 1")
    _positive("--rate-scale", rate_scale)
    _positive("--ttft-slo-ms", ttft_slo_ms, infinite=True)  # infinite: no SLO
    _positive("--itl-slo-ms", itl_slo_ms, infinite=True)
    if out is not None:
        _output_dir(out)
    try:
        report = run_simulate_command(
            fleet, trace, policy, max_requests, rate_scale, seed, ttft_slo_ms, itl_slo_ms, out, progress=not json_out
        )
    except (FeatureError, OSError, ValueError, RuntimeError) as err:
        _fail(err)
    print_simulation(report, as_json=json_out)


@sim_app.command("validate")
def sim_validate(
    data: Annotated[str, typer.Option(help=MEASURED_HELP)] = DEFAULT_MEASURED,
    accelerator: Annotated[str, typer.Option(help="Accelerator class the rows were measured on.")] = "h200-sxm",
    model: Annotated[str, typer.Option(help="Model the rows were measured with.")] = "qwen3-32b",
    splitwise: Annotated[
        Path, typer.Option(help="splitwise_sim_perf_model.csv (the shipped copy by default).")
    ] = SPLITWISE,
    scheduling: Annotated[
        str, typer.Option(help="The replayed vLLM's scheduler: async (vLLM's default) or sync.")
    ] = "async",
    output_tokens: Annotated[int, typer.Option(help="Output length assumed for TPOT rows (≥ 2).")] = 128,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Simulator fidelity: replay of measured vLLM rows in their recorded state, and the splitwise check."""
    from leadtime.data import readable_file
    from leadtime.simulator.cli import print_validation
    from leadtime.simulator.validate import validate

    if scheduling not in ("async", "sync"):
        _fail(f"--scheduling must be async or sync, got {scheduling!r}")
    if output_tokens < 2:
        _fail(f"--output-tokens must be ≥ 2, got {output_tokens}")
    path = _measured(data)
    try:
        report = validate(
            path,
            accelerator,
            model,
            readable_file(splitwise, "splitwise_sim_perf_model.csv"),
            async_scheduling=scheduling == "async",
            output_tokens=output_tokens,
        )
    except (FeatureError, OSError, ValueError) as err:
        _fail(err)
    print_validation(report, as_json=json_out)


@sim_app.command("serve")
def sim_serve(
    fleet: Annotated[str, typer.Option(help=FLEET_HELP)],
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    base_port: Annotated[int, typer.Option(help="First port; endpoint i listens on base_port + i.")] = 8100,
    model_name: Annotated[str, typer.Option(help="Model name served in the OpenAI API.")] = "",
    timeslice_port: Annotated[
        int | None, typer.Option(help="Port of the time-slice groups' states (default: after the endpoints').")
    ] = None,
    endpoints_file: Annotated[
        Path | None, typer.Option(help="Write the fleet here as an llm-d discovery file (for leadtime route).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seeds the time-slice windows.")] = 0,
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate: the endpoints serve HTTPS (as vLLM's --ssl-certfile).")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM key of --tls-cert.")] = None,
    tokens_per_event: Annotated[
        int,
        typer.Option(
            help="Tokens in each event of a stream, as from a server whose steps yield several (speculative "
            "decoding) or that streams every few tokens."
        ),
    ] = 1,
) -> None:
    """Serve the simulated endpoints in real time as OpenAI-compatible HTTP servers with vLLM /metrics.

    A decode endpoint of a P/D fleet honours `x-prefiller-host-port` (prefill there, simulated KV transfer);
    a time-sliced fleet publishes its groups' states at /v1/timeslice/groups on --timeslice-port.
    """
    from leadtime.simulator.fleet import load_fleet
    from leadtime.simulator.serve import serve_fleet

    if not 1 <= base_port <= 65535:
        _fail("--base-port must be between 1 and 65535")
    if timeslice_port is not None and not 1 <= timeslice_port <= 65535:
        _fail("--timeslice-port must be between 1 and 65535")
    if (tls_cert is None) != (tls_key is None):
        _fail("--tls-cert and --tls-key go together: give both, or neither")
    if tokens_per_event < 1:
        _fail("--tokens-per-event must be ≥ 1")
    try:
        serve_fleet(
            load_fleet(fleet),
            host=host,
            base_port=base_port,
            model_name=model_name or None,
            timeslice_port=timeslice_port,
            endpoints_file=endpoints_file,
            seed=seed,
            tls=(tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None,
            tokens_per_event=tokens_per_event,
        )
    except (OSError, ValueError) as err:
        _fail(err)


@bench_app.command("sim")
def bench_sim(
    requests: Annotated[int, typer.Option(help="Requests of the Mooncake trace to replay.")] = 10_000,
    fleet: Annotated[str, typer.Option(help=FLEET_HELP)] = "bench-16",
    trace: Annotated[str, typer.Option(help=TRACE_HELP)] = "mooncake",
    policy: Annotated[str, typer.Option(help="Routing policy.")] = "llm-d",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Simulator speed: a trace replay on a 16-endpoint fleet, in simulated requests per wall-clock second."""
    from leadtime.bench.sim import print_report, run_bench

    if requests < 1:
        _fail("--requests must be ≥ 1")
    try:
        report = run_bench(fleet, trace, requests, policy)
    except (FeatureError, OSError, ValueError, RuntimeError) as err:
        _fail(err)
    print_report(report, as_json=json_out)


@bench_app.command("routing")
def bench_routing(
    trace: Annotated[str, typer.Option(help=TRACE_HELP)] = "mooncake",
    max_requests: Annotated[int, typer.Option(help="Requests of the trace replayed on each fleet.")] = 3000,
    seed: Annotated[int, typer.Option(help="First seed (time-slice windows, step noise, policies' tie-breaks).")] = 0,
    seeds: Annotated[int, typer.Option(help="Seeds to average over (seed, seed+1, ...).")] = 1,
    fleet: Annotated[list[str] | None, typer.Option(help="Only these fleets (repeatable); default: all six.")] = None,
    policy: Annotated[list[str] | None, typer.Option(help="Only these policies (repeatable).")] = None,
    workers: Annotated[int, typer.Option(help="Simulations run in parallel processes.")] = 2,
    load: Annotated[
        list[float] | None,
        typer.Option(
            help="Loads to run, as multiples of the base rate (85% of capacity; repeatable); "
            "default: 1.0 and 1.5, reported as base and high."
        ),
    ] = None,
    follow_llmd: Annotated[
        bool,
        typer.Option(
            "--follow-llmd",
            help="Also measure llm-d's predictor on the requests Leadtime routed (its picks unchanged; slower).",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    out: Annotated[Path | None, typer.Option(help="Directory for the plots and report.json.")] = None,
) -> None:
    """Goodput of every routing policy on six fleets at two loads, side by side in one run."""
    from leadtime.bench.routing import (
        FLEETS,
        RoutingOptions,
        check_loads,
        print_report,
        run_routing,
        selected_policies,
        write_plots,
    )

    if max_requests < 100:
        _fail("--max-requests must be ≥ 100")
    if seeds < 1 or workers < 1:
        _fail("--seeds and --workers must be ≥ 1")
    unknown = [f for f in fleet or [] if f not in FLEETS]
    if unknown:
        _fail(f"--fleet {unknown[0]!r}: not a benchmark fleet (known: {', '.join(FLEETS)})")
    fleets = tuple(fleet) if fleet else FLEETS
    try:
        policies = selected_policies(policy, fleets) if policy else None
    except ValueError as err:
        _fail(err)
    loads = tuple(load) if load else RoutingOptions().loads
    try:
        check_loads(loads)
    except ValueError as err:
        _fail(err)
    if out is not None:
        _output_dir(out)
    options = RoutingOptions(
        trace=trace,
        max_requests=max_requests,
        seed=seed,
        seeds=seeds,
        fleets=fleets,
        policies=policies,
        workers=workers,
        follow_llmd=follow_llmd,
        loads=loads,
    )
    from leadtime.progress import stderr_bar

    bar = stderr_bar()
    with bar:
        task = bar.add_task("routing", total=None)

        def tick(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        try:
            report, curves = run_routing(options, progress=tick)
        except (FeatureError, OSError, ValueError, RuntimeError) as err:
            _fail(err)
    if out is not None:
        import json

        try:
            files = write_plots(report, curves, out)
            (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        except OSError as err:  # the folder was checked before the run: a full disk, say; keep the figures
            print_report(report, as_json=json_out)
            _fail(err)
        report["outputs"] = [str(p) for p in [*files, out / "report.json"]]
    print_report(report, as_json=json_out)


# ----- gateway -------------------------------------------------------------------------------


def _check_redis_url(option: str, url: str | None) -> None:
    if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
        _fail(f"{option}: expected redis://HOST:PORT/DB (or rediss://, unix://), got {url!r}")


@app.command("route")
def route(
    discovery: Annotated[
        Path | None, typer.Option(help="llm-d endpoints file (YAML/JSON), re-read when it changes.")
    ] = None,
    endpoint: Annotated[
        list[str] | None,
        typer.Option(help="A static endpoint instead: ADDRESS:PORT[,name=N,LABEL=VALUE...] (repeatable)."),
    ] = None,
    predictor_url: Annotated[
        str | None, typer.Option(help="The predictor service over HTTP (http://HOST:PORT, or https:// for TLS).")
    ] = None,
    predictor_grpc: Annotated[str | None, typer.Option(help="The predictor service over gRPC (HOST:PORT).")] = None,
    predictor_tls: Annotated[
        bool,
        typer.Option(
            "--predictor-tls", help="With --predictor-grpc: speak TLS to it (an https:// --predictor-url does)."
        ),
    ] = False,
    predictor_ca: Annotated[
        Path | None,
        typer.Option(
            help="PEM bundle that signed the predictor service's TLS certificate, when the system does not trust it "
            "(implies --predictor-tls)."
        ),
    ] = None,
    embedded: Annotated[bool, typer.Option("--embedded", help="Run the online predictor in this process.")] = False,
    pull_model: Annotated[
        bool,
        typer.Option(
            "--pull-model",
            help="With --predictor-url: predict in this process with a copy of the service's model, pulled every "
            "--pull-interval-s (observations still go to the service, which stays the one learner).",
        ),
    ] = False,
    pull_interval_s: Annotated[
        float, typer.Option(help="With --pull-model: seconds between two pulls of the service's model.")
    ] = 1.0,
    config: Annotated[Path | None, typer.Option(help="Plugin configuration (EndpointPickerConfig YAML).")] = None,
    profile: Annotated[str, typer.Option(help="Scheduling profile of the configuration.")] = "default",
    policy: Annotated[
        str, typer.Option(help="Route with a plain baseline instead: round-robin, random or least-queue.")
    ] = "",
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to serve the OpenAI-compatible API on.")] = 8080,
    timeslice_file: Annotated[
        Path | None, typer.Option(help="Time-slice group states, a file re-read on change.")
    ] = None,
    timeslice_url: Annotated[str | None, typer.Option(help="Time-slice group states, polled from this URL.")] = None,
    ttft_slo_ms: Annotated[
        float | None, typer.Option(help="TTFT SLO of requests without an x-llm-d-slo-ttft-ms header.")
    ] = None,
    tpot_slo_ms: Annotated[
        float | None, typer.Option(help="ITL SLO of requests without an x-llm-d-slo-tpot-ms header.")
    ] = None,
    accelerator: Annotated[
        str, typer.Option(help="Accelerator class of endpoints whose labels name none.")
    ] = "h100-sxm",
    model: Annotated[str, typer.Option(help="Model of endpoints whose labels name none.")] = "llama-3.1-8b",
    scrape_interval_ms: Annotated[float, typer.Option(help="Time between two /metrics scrapes of an endpoint.")] = 50.0,
    unroutable_after_s: Annotated[
        float, typer.Option(help="An endpoint whose scrapes fail this long is no longer routed to.")
    ] = 3.0,
    api_token: Annotated[
        str | None, typer.Option(envvar="LEADTIME_API_TOKEN", help="Bearer token for the predictor's write paths.")
    ] = None,
    replicas_redis: Annotated[
        str | None,
        typer.Option(
            help="Redis through which several gateway replicas tell each other what they send "
            "(redis://HOST:PORT/DB, rediss:// for TLS)."
        ),
    ] = None,
    replicas_group: Annotated[
        str, typer.Option(help="With --replicas-redis: the replicas of one fleet share one group name.")
    ] = "default",
    upstream_ca: Annotated[
        Path | None,
        typer.Option(
            help="PEM bundle that endpoints serving HTTPS (label leadtime.io/scheme: https) are verified with, when "
            "the system's CAs do not."
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate (chain): serve the gateway's API over HTTPS.")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM key of --tls-cert.")] = None,
    measure_non_streaming: Annotated[
        bool,
        typer.Option(
            help="Send non-streaming requests on as streams, to time them and learn from them, and answer their "
            "clients with the whole body (--no-measure-non-streaming: send them unchanged; they teach nothing)."
        ),
    ] = True,
    ask_usage: Annotated[
        bool,
        typer.Option(
            help="Ask endpoints for the usage at the end of streams whose client did not, to count output tokens "
            "exactly when an event carries several (the usage event is kept from such a client)."
        ),
    ] = True,
    shadow: Annotated[
        bool,
        typer.Option(
            "--shadow",
            help="With --policy, or a --profile that does not predict (heuristic): the predictor predicts that "
            "policy's picks and learns what happened, to be judged (and warm) before routing on it. Needs a "
            "predictor.",
        ),
    ] = False,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            envvar="LEADTIME_ROUTE_API_KEY",
            help="A key clients must show (Authorization: Bearer KEY) on /v1/... and the passed-through paths; "
            "repeat it to accept several (rotation). Health and metrics stay open.",
        ),
    ] = None,
) -> None:
    """Run an OpenAI-compatible gateway that routes live traffic with the plugin (no Kubernetes needed)."""
    from leadtime.features.catalog import get_accelerator, get_model
    from leadtime.router_plugin.config import ConfigError
    from leadtime.router_plugin.discovery import DiscoveryError
    from leadtime.router_plugin.gateway.app import GatewaySettings
    from leadtime.router_plugin.gateway.serve import PLAIN_POLICIES, RouteOptions, build_gateway, needs_predictor
    from leadtime.router_plugin.timeslice_sources import TimesliceError

    if (discovery is None) == (not endpoint):
        _fail("give either --discovery FILE or one or more --endpoint ADDRESS:PORT")
    if sum([predictor_url is not None, predictor_grpc is not None, embedded]) > 1:
        _fail("--predictor-url, --predictor-grpc and --embedded are alternatives: give one")
    if timeslice_file is not None and timeslice_url is not None:
        _fail("--timeslice-file and --timeslice-url are alternatives: give one")
    if pull_model and predictor_url is None:
        _fail("--pull-model pulls the model from the service's HTTP API: give --predictor-url too")
    if (predictor_tls or predictor_ca is not None) and predictor_url is None and predictor_grpc is None:
        _fail(
            "--predictor-tls and --predictor-ca are for a predictor service: give --predictor-url or --predictor-grpc"
        )
    if predictor_url is not None and predictor_tls and not predictor_url.startswith("https://"):
        _fail("--predictor-tls: over HTTP, TLS is an https:// --predictor-url")
    for option, ca_file in (("--predictor-ca", predictor_ca), ("--upstream-ca", upstream_ca)):
        if ca_file is not None:
            from leadtime.predictor.client import tls_client_context

            try:
                tls_client_context(ca_file)
            except ValueError as err:
                _fail(f"{option}: {err}")
    _check_redis_url("--replicas-redis", replicas_redis)
    if not replicas_group or not replicas_group.isprintable() or " " in replicas_group:
        _fail("--replicas-group: expected a name without spaces")
    if (tls_cert is None) != (tls_key is None):
        _fail("--tls-cert and --tls-key go together: give both, or neither")
    if policy and policy not in PLAIN_POLICIES:
        _fail(f"--policy must be one of {', '.join(PLAIN_POLICIES)}, got {policy!r}")
    if not 1 <= port <= 65535:
        _fail("--port must be between 1 and 65535")
    for name, value in (
        ("--pull-interval-s", pull_interval_s),
        ("--scrape-interval-ms", scrape_interval_ms),
        ("--unroutable-after-s", unroutable_after_s),
        ("--ttft-slo-ms", ttft_slo_ms),
        ("--tpot-slo-ms", tpot_slo_ms),
    ):
        if value is not None:
            _positive(name, value)
    if api_token is not None and not (api_token.isascii() and api_token.isprintable()):
        _fail("--api-token must be printable ASCII, without line breaks or control characters")
    for key in api_key or ():
        if not key or not (key.isascii() and key.isprintable()) or " " in key:
            _fail("--api-key must be printable ASCII, without spaces, line breaks or control characters")
    try:
        get_accelerator(accelerator)
        get_model(model)
    except FeatureError as err:
        _fail(err)
    settings = GatewaySettings(
        host=host,
        port=port,
        scrape_interval_s=scrape_interval_ms / 1e3,
        unroutable_after_s=unroutable_after_s,
        default_accelerator=accelerator,
        default_model=model,
        ttft_slo_ms=ttft_slo_ms,
        tpot_slo_ms=tpot_slo_ms,
        upstream_ca_file=None if upstream_ca is None else str(upstream_ca),
        measure_non_streaming=measure_non_streaming,
        ask_usage=ask_usage,
        api_keys=tuple(api_key or ()),
    )
    options = RouteOptions(
        discovery=discovery,
        endpoints=tuple(endpoint or ()),
        config=config,
        profile=profile,
        policy=policy,
        timeslice_file=timeslice_file,
        timeslice_url=timeslice_url,
        settings=settings,
        replicas_redis=replicas_redis,
        replicas_group=replicas_group,
        shadow=shadow,
    )
    try:
        wanted = needs_predictor(options)
    except ConfigError as err:
        _fail(err)
    given = "--predictor-url" if predictor_url else "--predictor-grpc" if predictor_grpc else "--embedded"
    if wanted and not (predictor_url or predictor_grpc or embedded):
        needs = "--shadow" if shadow else "the predicted-latency scorer"
        _fail(f"{needs} needs a predictor: give --predictor-url, --predictor-grpc or --embedded")
    if not wanted and (predictor_url or predictor_grpc or embedded):
        plain = f"--policy {policy}" if policy else f"profile {profile!r}"
        _fail(f"{given}: {plain} does not predict, so the predictor would go unused (add --shadow to learn beside it)")
    if predictor_grpc is not None:
        host, _, grpc_port = predictor_grpc.rpartition(":")
        if not host or not grpc_port.isdigit() or not 1 <= int(grpc_port) <= 65535:
            _fail(f"--predictor-grpc: expected HOST:PORT (a port from 1 to 65535), got {predictor_grpc!r}")
    from leadtime.router_plugin.client import PredictorClient

    predict_client: PredictorClient | None = None
    observe_client: PredictorClient | None = None
    if wanted and predictor_url:
        from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient

        try:
            observe_client = LeanHttpPredictorClient(predictor_url, api_token=api_token, ca_file=predictor_ca)
            if pull_model:
                from leadtime.router_plugin.gateway.pulled import PulledModel

                predict_client = PulledModel(
                    predictor_url, observe_client, pull_interval_s, api_token=api_token, ca_file=predictor_ca
                )
            else:
                predict_client = LeanHttpPredictorClient(predictor_url, api_token=api_token, ca_file=predictor_ca)
        except ValueError as err:
            _fail(f"--predictor-url: {err}")
    elif wanted and predictor_grpc:
        from leadtime.predictor.client import GrpcPredictorClient

        predict_client = GrpcPredictorClient(
            predictor_grpc, api_token=api_token, tls=predictor_tls, ca_file=predictor_ca
        )
        observe_client = GrpcPredictorClient(
            predictor_grpc, api_token=api_token, tls=predictor_tls, ca_file=predictor_ca
        )
    elif wanted:
        from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
        from leadtime.router_plugin.client import InProcessPredictor

        learner = OnlinePredictor(LearnerConfig(accelerator=accelerator, model=model)).start()
        predict_client = InProcessPredictor(learner, learner.config.quantile)
    try:
        gateway = build_gateway(options, predict_client, observe_client, remote=not embedded)
    except (ConfigError, DiscoveryError, TimesliceError) as err:
        _fail(err)
    from leadtime.router_plugin.gateway.serve import serve_gateway

    try:
        serve_gateway(gateway, (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None)
    except OSError as err:
        _fail(err)


@bench_app.command("gateway")
def bench_gateway(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    trace: Annotated[str, typer.Option(help="The trace replayed (a shipped name or a file).")] = "mooncake",
    requests: Annotated[int, typer.Option(help="Requests of the trace replayed per policy.")] = 400,
    rate_scale: Annotated[float, typer.Option(help="Arrival-rate multiplier of the trace.")] = 2.0,
    probes: Annotated[int, typer.Option(help="Probe pairs (gateway, then direct) for the overhead.")] = 200,
    processes: Annotated[int, typer.Option(help="Load-generator processes.")] = 2,
    replicas_redis: Annotated[
        str | None,
        typer.Option(help="Also measure the overhead of a gateway sharing with a replica through this Redis."),
    ] = None,
    tls_upstream: Annotated[
        bool, typer.Option("--tls-upstream", help="Also measure the overhead before endpoints serving HTTPS.")
    ] = False,
    non_streaming_share: Annotated[
        float,
        typer.Option(
            help="Share of the replayed requests that ask for the whole answer at once; above 0, Leadtime also runs "
            "with them sent on unchanged (--no-measure-non-streaming)."
        ),
    ] = 0.0,
) -> None:
    """The gateway on loopback: added time to first token, and goodput with Leadtime and with round-robin."""
    from leadtime.bench.gateway import GatewayBenchOptions, print_report, run_gateway_bench

    if requests < 10 or probes < 10:
        _fail("--requests and --probes must be ≥ 10")
    _positive("--rate-scale", rate_scale)
    if processes < 1:
        _fail("--processes must be ≥ 1")
    _check_redis_url("--replicas-redis", replicas_redis)
    if not 0 <= non_streaming_share <= 1:
        _fail("--non-streaming-share must be between 0 and 1")
    options = GatewayBenchOptions(
        trace,
        requests,
        rate_scale,
        probes,
        processes=processes,
        replicas_redis=replicas_redis,
        tls_upstream=tls_upstream,
        non_streaming_share=non_streaming_share,
    )

    def say(message: str) -> None:
        if not json_out:
            typer.echo(message, err=True)

    try:
        report = run_gateway_bench(options, progress=say)
    except (FeatureError, OSError, ValueError, RuntimeError) as err:
        _fail(err)
    print_report(report, as_json=json_out)


@bench_app.command("tls")
def bench_tls(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    rows: Annotated[int, typer.Option(help="Rows per prediction (the candidates of one decision).")] = 8,
    calls: Annotated[int, typer.Option(help="Timed calls per client and transport.")] = 3000,
    first_calls: Annotated[int, typer.Option(help="New connections timed per transport.")] = 50,
) -> None:
    """What TLS costs a router's call to the predictor: plain and TLS services side by side, one run."""
    from leadtime.bench.tls import TlsBenchOptions, print_report, run_tls_bench
    from leadtime.predictor.client import PredictorError

    if rows < 1 or calls < 100 or first_calls < 10:
        _fail("--rows must be ≥ 1, --calls ≥ 100 and --first-calls ≥ 10")

    def say(message: str) -> None:
        if not json_out:
            typer.echo(message, err=True)

    try:
        report = run_tls_bench(TlsBenchOptions(rows=rows, calls=calls, first_calls=first_calls), progress=say)
    except ImportError as err:
        _fail(f"bench tls makes a certificate with the `cryptography` package: {err} (pip install '.[test]')")
    except (OSError, RuntimeError, PredictorError) as err:
        _fail(err)
    print_report(report, as_json=json_out)


@bench_app.command("load")
def bench_load(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    predict_rps: Annotated[float, typer.Option(help="Target bulk predictions per second.")] = 1_000.0,
    rows: Annotated[int, typer.Option(help="Rows per prediction call.")] = 50,
    observe_rps: Annotated[float, typer.Option(help="Target observations per second.")] = 5_000.0,
    duration: Annotated[float, typer.Option(help="Seconds of load.")] = 60.0,
) -> None:
    """The service on loopback under predictions (wrk) and observations together: rates, latency, errors, memory."""
    from leadtime.bench.load import LoadOptions, WrkMissing, print_report, run_load

    _positive("--predict-rps", predict_rps)
    _positive("--observe-rps", observe_rps)
    _positive("--duration", duration)
    if duration < 1 or not 1 <= rows <= 10_000:
        _fail("--duration must be ≥ 1 and --rows in 1..10000")

    def say(message: str) -> None:
        if not json_out:
            typer.echo(message, err=True)

    try:
        report = run_load(LoadOptions(predict_rps, rows, observe_rps, duration), progress=say)
    except (WrkMissing, OSError, RuntimeError) as err:
        _fail(err)
    print_report(report, as_json=json_out)


@bench_app.command("prefix")
def bench_prefix(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    requests: Annotated[int, typer.Option(help="Requests of each trace per run.")] = 1000,
    salts: Annotated[int, typer.Option(help="Runs with other text for the same prefix blocks, pooled.")] = 3,
) -> None:
    """How good the gateway's tokenizer-free prefix-hit (and prompt-length) estimate is on the shipped traces."""
    from leadtime.bench.prefix_estimate import TokenizerMissing, print_report, run_prefix_bench

    if requests < 10 or salts < 1:
        _fail("--requests must be ≥ 10 and --salts ≥ 1")
    try:
        report = run_prefix_bench(requests=requests, salts=salts)
    except (TokenizerMissing, OSError, ValueError) as err:
        _fail(err)
    print_report(report, as_json=json_out)


# ----- offline retraining -------------------------------------------------------------------------------


@app.command("retrain")
def retrain(
    samples: Annotated[
        list[str],
        typer.Option(help="JSONL or Parquet observations, a shipped name, or redis://HOST:PORT/DB (the stream)."),
    ],
    registry: Annotated[str, typer.Option(help="Model registry: a directory (as --model-dir) or redis://...")],
    dask: Annotated[str | None, typer.Option(help="Fit on this Dask scheduler (tcp://HOST:8786).")] = None,
    report: Annotated[Path | None, typer.Option(help="Write report.json, report.md and plots here.")] = None,
    accelerator: Annotated[str | None, typer.Option(help="Class for rows naming none (a new model).")] = None,
    model: Annotated[str | None, typer.Option(help="Model for rows naming none (a new model).")] = None,
    eval_share: Annotated[float, typer.Option(help="Most recent share of rows held out for judging.")] = 0.2,
    margin: Annotated[float, typer.Option(help="Relative MAPE gain needed on both targets to publish.")] = 0.02,
    max_malformed_share: Annotated[
        float, typer.Option(help="Share of a source's rows that may be malformed before the job stops.")
    ] = 0.01,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Fit the trees on a long history; publish only if they beat the registry's model (exit 0; kept: 3)."""
    from leadtime.training.job import RetrainConfig, RetrainError, run_retrain
    from leadtime.training.report import print_result

    try:
        config = RetrainConfig(
            samples=tuple(samples),
            registry=registry,
            dask=dask,
            report_dir=report,
            accelerator=accelerator,
            model=model,
            eval_share=eval_share,
            margin=margin,
            max_malformed_share=max_malformed_share,
        )
        result = run_retrain(config, progress=not json_out)
    except (RetrainError, ValueError, OSError) as err:
        _fail(err)
    print_result(result.report, as_json=json_out)
    raise typer.Exit(result.exit_code)


@bench_app.command("retrain")
def bench_retrain(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    requests: Annotated[int, typer.Option(help="Requests of the simulator run (one observation each).")] = 100_000,
    cache: Annotated[Path | None, typer.Option(help="Where the simulator's observation log is kept.")] = None,
) -> None:
    """Retraining time locally and on a 2-worker Dask cluster, and the retrained model against the online one."""
    from leadtime.bench.retrain import print_report, run_bench_retrain

    if requests < 1000:
        _fail("--requests must be ≥ 1000")
    try:
        result = run_bench_retrain(requests=requests, cache=cache, progress=not json_out)
    except (FeatureError, OSError, ValueError, RuntimeError) as err:
        _fail(err)
    print_report(result, as_json=json_out)


@sim_app.command("fleets")
def sim_fleets() -> None:
    """List the fleets and traces that ship with Leadtime (usable by name in --fleet and --trace)."""
    from leadtime.data import TRACES
    from leadtime.simulator.fleet import load_fleet, shipped_fleets

    for name, path in shipped_fleets().items():
        fleet = load_fleet(path)
        typer.echo(f"fleet  {name:18s} {len(fleet.endpoints):3d} endpoints  {path}")
    for name, path in TRACES.items():
        typer.echo(f"trace  {name:18s} {path}")


@dashboards_app.command("build")
def dashboards_build(
    out: Annotated[
        Path | None, typer.Option(help="Folder to write the JSON into (default: the package's dashboards folder).")
    ] = None,
) -> None:
    """Write leadtime-predictor.json and leadtime-router.json from their definitions (for Grafana to import)."""
    from leadtime.dashboards.files import FOLDER, write_dashboards

    try:
        for path in write_dashboards(out or FOLDER):
            typer.echo(f"wrote {path}")
    except OSError as err:
        _fail(err)


@dashboards_app.command("render")
def dashboards_render(
    prometheus: Annotated[str, typer.Option(help="Prometheus that scrapes Leadtime (http://HOST:PORT).")],
    out: Annotated[Path, typer.Option(help="Folder for the PNG files (one per dashboard).")],
    minutes: Annotated[float, typer.Option(help="Time range drawn, ending now.")] = 60.0,
) -> None:
    """Draw each dashboard's main panels as a PNG from Prometheus's answers (matplotlib; no Grafana needed)."""
    from leadtime.dashboards.definitions import DASHBOARDS
    from leadtime.dashboards.render import PrometheusApi, PrometheusError, render_dashboard

    _positive("--minutes", minutes)
    _output_dir(out)
    api = PrometheusApi(prometheus)
    try:
        for board in DASHBOARDS:
            path, panels = render_dashboard(board, api, out, minutes=minutes)
            empty = [p.panel.title for p in panels if not p.has_data]
            typer.echo(f"wrote {path}" + (f" (no data: {'; '.join(empty)})" if empty else ""))
    except (PrometheusError, OSError, ValueError) as err:
        _fail(err)


@bench_app.command("dashboards")
def bench_dashboards(
    out: Annotated[Path, typer.Option(help="Folder for the PNG files.")],
    minutes: Annotated[float, typer.Option(help="Minutes of traffic drawn.")] = 5.0,
    redis: Annotated[str | None, typer.Option(help="Redis for the predictor service (redis://HOST:PORT/DB).")] = None,
) -> None:
    """The whole stack on loopback under changing load, scraped by a real Prometheus; then the dashboards' PNGs."""
    import tempfile

    from leadtime.bench.dashboards import run_dashboard_bench
    from leadtime.bench.procs import find_prometheus

    _positive("--minutes", minutes)
    _output_dir(out)
    executable = find_prometheus()
    if executable is None:
        _fail("prometheus is not installed (apt-get install prometheus)")
        return
    with tempfile.TemporaryDirectory(prefix="leadtime-dashboards-") as workdir:
        try:
            run_dashboard_bench(out, minutes, executable, Path(workdir), redis, progress=typer.echo)
        except (RuntimeError, OSError) as err:
            _fail(err)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
