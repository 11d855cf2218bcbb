"""`leadtime demo` and the `leadtime bench ...` commands: each prints the figures the README quotes."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from leadtime.cli.common import (
    CATALOG_HELP,
    DEFAULT_MEASURED,
    FLEET_HELP,
    MEASURED_HELP,
    REFERENCE_HELP,
    TRACE_HELP,
    app,
    bench_app,
    catalog_option,
    check_redis_url,
    fail,
    hardware_options,
    measured_path,
    output_dir,
    positive,
    reference_model_option,
    remove_if_empty,
    seed_option,
    warn,
)
from leadtime.cli.whole_run import RunFolder
from leadtime.features.errors import FeatureError, validation_problem

if TYPE_CHECKING:
    from leadtime.bench.accuracy import LabelDelay


@bench_app.command("accuracy")
def bench_accuracy(
    data: Annotated[str, typer.Option(help=MEASURED_HELP)] = DEFAULT_MEASURED,
    accelerator: Annotated[str, typer.Option(help="Accelerator class the rows came from.")] = "h200-sxm",
    model: Annotated[str, typer.Option(help="Model the rows came from.")] = "qwen3-32b",
    seeds: Annotated[int, typer.Option(help="Seeds of the random 90/10 split.")] = 10,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    reference_model: Annotated[str | None, typer.Option(help=REFERENCE_HELP)] = None,
    label_delay: Annotated[
        str,
        typer.Option(
            help="Rows predicted before a row's outcome is learned in the prequential walk (as in production, "
            "where an outcome arrives when its request completes); 0 = learned at once. `arrival`: each row "
            "predicted at its request's arrival, knowing only the outcomes stamped by then (rows with timestamps).",
            metavar="ROWS|arrival",
        ),
    ] = "0",
    catalog: Annotated[Path | None, typer.Option(help=CATALOG_HELP)] = None,
    no_trees: Annotated[
        bool, typer.Option("--no-trees", help="Leadtime without its residual trees: its online parts alone.")
    ] = False,
) -> None:
    """Prequential and 90/10-split accuracy of Leadtime, the llm-d reference and a median floor."""
    from leadtime.bench.accuracy import ARRIVAL, print_report, run_accuracy
    from leadtime.bench.data import RowUsage

    if seeds < 1:
        fail(f"--seeds must be ≥ 1, got {seeds}")
    delay = label_delay_option(label_delay)
    reference = reference_model_option(reference_model)
    known = catalog_option(catalog)
    hardware_options(accelerator, model, known)
    path = measured_path(data)
    used: list[RowUsage] = []

    def skipped(usage: RowUsage) -> None:
        used.append(usage)
        if usage.neither:
            warn(
                f"{path}: {usage.neither} of its {usage.rows} rows have neither actual_ttft_ms nor actual_tpot_ms "
                "above 0: they count toward no figure"
            )
        if usage.out_of_order_line is not None and delay != ARRIVAL:  # that walk follows the timestamps
            warn(
                f"{path}:{usage.out_of_order_line}: timestamp earlier than the row before it: the walk follows the "
                "file order, not the timestamps (sort the file by time to walk it in time)"
            )
        if usage.implausible:
            warn(
                f"{path}: {usage.implausible} of its {usage.rows} rows (first at line {usage.first_implausible_line}) "
                "are implausible by the roofline (over 100 times faster than the hardware can be, or over a day): "
                "Leadtime's poisoning guard does not learn them, the reference and the median baseline do, and all "
                "are scored on them. Are the latencies in milliseconds?"
            )

    try:
        report = run_accuracy(
            path,
            accelerator=accelerator,
            model=model,
            seeds=seeds,
            progress=not json_out,
            reference_model=reference,
            label_delay=delay,
            on_usage=skipped,
            catalog=known,
            trees=not no_trees,
        )
    except (FeatureError, OSError, ValueError) as err:
        fail(err)
    print_report(report, as_json=json_out, usage=used[0])


def label_delay_option(value: str) -> LabelDelay:
    """--label-delay: a number of rows ≥ 0, or `arrival`."""
    from leadtime.bench.accuracy import ARRIVAL

    if value.strip().lower() == ARRIVAL:
        return ARRIVAL
    try:
        rows = int(value)
    except ValueError:
        fail(f"--label-delay must be a number of rows or {ARRIVAL}, got {value!r}")
    if rows < 0:
        fail(f"--label-delay must be ≥ 0, got {rows}")
    return rows


@bench_app.command("coldstart")
def bench_coldstart(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    seed: Annotated[int, typer.Option(help="Random seed of the synthetic fleet data.")] = 0,
    unseen: Annotated[str, typer.Option(help="The accelerator class held back (never seen in training).")] = "mi300x",
    reference_model: Annotated[str | None, typer.Option(help=REFERENCE_HELP)] = None,
) -> None:
    """Accuracy on an accelerator class never seen before, after 50 and 500 of its observations."""
    from leadtime.bench.coldstart import print_report, run_coldstart
    from leadtime.features.catalog import get_accelerator

    seed_option(seed)
    reference = reference_model_option(reference_model)
    try:
        get_accelerator(unseen)
    except FeatureError as err:  # it named the catalog's field: `accelerator: unknown accelerator class ...`
        fail(f"--unseen: {err.problem}")
    try:
        report = run_coldstart(seed=seed, unseen=unseen, reference_model=reference)
    except (FeatureError, ValueError) as err:
        fail(err)
    print_report(report, as_json=json_out)


@app.command("demo")
def demo(
    ctx: typer.Context,
    out: Annotated[
        Path,
        typer.Option(help="Folder for the report and plots, theirs alone (the same demo's earlier run is replaced)."),
    ] = Path("out/demo"),
    quick: Annotated[bool, typer.Option("--quick", help="A short run, as a smoke test.")] = False,
    accuracy: Annotated[
        bool,
        typer.Option("--accuracy", help="Instead: the predictor alone walking the real H200 trace beside llm-d's."),
    ] = False,
    data: Annotated[str, typer.Option(help=MEASURED_HELP + " (with --accuracy)")] = DEFAULT_MEASURED,
    reference_model: Annotated[str | None, typer.Option(help=REFERENCE_HELP + " (with --accuracy)")] = None,
) -> None:
    """Leadtime routing a mixed, a P/D and a time-sliced fleet beside the routers a user could pick instead."""
    if not accuracy and (data != DEFAULT_MEASURED or reference_model is not None):
        given = "--data" if data != DEFAULT_MEASURED else "--reference-model"
        fail(f"{given} is for the accuracy demo: add --accuracy (the routing demo replays its own trace)")
    folder = RunFolder(ctx, out, "leadtime demo --accuracy" if accuracy else "leadtime demo")
    if accuracy:
        from leadtime.bench.demo import run_demo as run_accuracy_demo

        reference = reference_model_option(reference_model)
        rows = measured_path(data)
        try:
            with folder.writing() as part:
                files = run_accuracy_demo(rows, part, max_rows=600 if quick else None, reference_model=reference)
        except (FeatureError, OSError, ValueError) as err:
            fail(err)
    else:
        from leadtime.bench.routing_demo import run_demo

        try:
            with folder.writing() as part:
                files = run_demo(part, max_requests=300 if quick else 1500)
        except (FeatureError, OSError, ValueError, RuntimeError) as err:
            fail(err)
    typer.echo(f"written to {folder.written}/ ({', '.join(p.name for p in files)})")


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
    from pydantic import ValidationError

    from leadtime.bench.serving import print_report, run_serving
    from leadtime.predictor.settings import ServiceSettings

    if calls < 10:
        fail("--calls must be ≥ 10")
    settings: dict[str, str] = {}
    for item in setting or []:
        name, sep, value = item.partition("=")
        if not sep or name.lower() not in ServiceSettings.model_fields:
            fail(f"--setting {item!r}: expected NAME=VALUE with NAME a service setting, e.g. learner_cpus=auto")
        settings[name.lower()] = value
    try:  # here, so that a value is named as the --setting given, not as the child `leadtime serve`'s option
        ServiceSettings.from_env(env={f"LEADTIME_{name.upper()}": value for name, value in settings.items()})
    except ValidationError as err:
        where, problem = validation_problem(err)
        named = [item for item in setting or [] if item.partition("=")[0].lower() == where] or setting or []
        fail(f"--setting {' '.join(named)}: {problem}")
    try:
        report = run_serving(calls=calls, progress=not json_out, settings=settings, warn=warn)
    except (OSError, RuntimeError) as err:
        fail(err)
    print_report(report, as_json=json_out)


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
        fail("--requests must be ≥ 1")
    try:
        report = run_bench(fleet, trace, requests, policy)
    except (FeatureError, OSError, ValueError, RuntimeError) as err:
        fail(err)
    if report["requests"] != requests:  # the rate computed over fewer requests than asked is still right: say so
        warn(f"--requests {requests}: the trace has {report['requests']} requests, all of them replayed")
    print_report(report, as_json=json_out)


@bench_app.command("routing")
def bench_routing(
    ctx: typer.Context,
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
    out: Annotated[
        Path | None,
        typer.Option(help="Folder for the plots and report.json, theirs alone (an earlier run there is replaced)."),
    ] = None,
) -> None:
    """Goodput of every routing policy on six fleets at two loads, side by side in one run."""
    from leadtime.bench.routing import (
        FLEETS,
        MIN_REQUESTS,
        RoutingOptions,
        check_loads,
        check_trace,
        print_report,
        run_routing,
        selected_policies,
        write_plots,
    )
    from leadtime.data import shipped_name

    if max_requests < MIN_REQUESTS:
        fail(f"--max-requests must be ≥ {MIN_REQUESTS}")
    if seeds < 1 or workers < 1:
        fail("--seeds and --workers must be ≥ 1")
    seed_option(seed)
    named = [(f, shipped_name(f, FLEETS)) for f in fleet or []]
    unknown = [f for f, name in named if name is None]
    if unknown:
        fail(f"--fleet {unknown[0]!r}: not a benchmark fleet (known: {', '.join(FLEETS)})")
    fleets = tuple(name for _, name in named if name is not None) or FLEETS
    try:
        policies = selected_policies(policy, fleets) if policy else None
    except ValueError as err:
        fail(err)
    loads = tuple(load) if load else RoutingOptions().loads
    try:
        check_loads(loads)
    except ValueError as err:
        fail(err)
    folder = RunFolder(ctx, out, "leadtime bench routing") if out is not None else None
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
    try:
        _, warnings = check_trace(options)
    except (OSError, ValueError) as err:
        fail(err)
        return
    for warning in warnings:
        warn(warning)
    from leadtime.progress import stderr_bar

    bar = stderr_bar()
    with bar:
        task = bar.add_task("routing", total=None)

        def tick(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        try:
            report, curves = run_routing(options, progress=tick)
        except (FeatureError, OSError, ValueError, RuntimeError) as err:
            fail(err)
    if folder is not None:
        from leadtime.json_text import dumps

        try:
            with folder.writing() as part:
                files = [*write_plots(report, curves, part), part / "report.json"]
                files[-1].write_text(dumps(report, indent=2) + "\n")
        except OSError as err:  # the folder was checked before the run: a full disk, say; keep the figures
            print_report(report, as_json=json_out)
            fail(err)
        report["outputs"] = [str(folder.written / p.name) for p in files]
    print_report(report, as_json=json_out)


@bench_app.command("gateway")
def bench_gateway(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    trace: Annotated[str, typer.Option(help="The trace replayed (a shipped name or a file).")] = "mooncake",
    requests: Annotated[int, typer.Option(help="Requests of the trace replayed per policy.")] = 400,
    rate_scale: Annotated[float, typer.Option(help="Arrival-rate multiplier of the trace.")] = 2.0,
    probes: Annotated[
        int,
        typer.Option(
            help="Probe pairs (gateway, then direct) for the overhead, per gateway; the first 5 only warm up "
            "(not counted)."
        ),
    ] = 200,
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
    from leadtime.bench.gateway import WARMUP_PAIRS, GatewayBenchOptions, print_report, run_gateway_bench

    if requests < 10:
        fail("--requests must be ≥ 10")
    if probes < WARMUP_PAIRS + 5:
        fail(f"--probes must be ≥ {WARMUP_PAIRS + 5}: the first {WARMUP_PAIRS} pairs only warm up (not counted)")
    positive("--rate-scale", rate_scale)
    if processes < 1:
        fail("--processes must be ≥ 1")
    if not 0 <= non_streaming_share <= 1:
        fail("--non-streaming-share must be between 0 and 1")
    check_redis_url("--replicas-redis", replicas_redis, reachable=True)
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
        report = run_gateway_bench(options, progress=say, warn=warn)
    except (FeatureError, OSError, ValueError, RuntimeError) as err:
        fail(err)
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

    rows_option(rows)
    if calls < 100 or first_calls < 10:
        fail("--calls must be ≥ 100 and --first-calls ≥ 10")

    def say(message: str) -> None:
        if not json_out:
            typer.echo(message, err=True)

    try:
        report = run_tls_bench(TlsBenchOptions(rows=rows, calls=calls, first_calls=first_calls), progress=say)
    except ImportError as err:
        fail(f"bench tls makes a certificate with the `cryptography` package: {err} (pip install 'leadtime[test]')")
    except (OSError, RuntimeError, PredictorError) as err:
        fail(err)
    print_report(report, as_json=json_out)


def rows_option(rows: int) -> None:
    """Fail unless `--rows` is a number of rows the measured service takes in one call (its `max_rows`, default
    settings): above it every call is answered 422."""
    from leadtime.predictor.settings import ServiceSettings

    most = ServiceSettings.model_fields["max_rows"].default
    if not 1 <= rows <= most:
        fail(f"--rows must be in 1..{most}, got {rows}")


@bench_app.command("load")
def bench_load(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    predict_rps: Annotated[float, typer.Option(help="Target bulk predictions per second.")] = 1_000.0,
    rows: Annotated[
        int,
        typer.Option(help="Rows per prediction call (the shipped trace's 3,400 rows, from the first again past them)."),
    ] = 50,
    observe_rps: Annotated[float, typer.Option(help="Target observations per second.")] = 5_000.0,
    duration: Annotated[float, typer.Option(help="Seconds of load.")] = 60.0,
) -> None:
    """The service on loopback under predictions (wrk) and observations together: rates, latency, errors, memory."""
    from leadtime.bench.load import LoadOptions, WrkMissing, print_report, run_load

    positive("--predict-rps", predict_rps)
    positive("--observe-rps", observe_rps)
    positive("--duration", duration)
    if duration < 1:
        fail(f"--duration must be ≥ 1 (seconds), got {duration:g}")
    rows_option(rows)

    def say(message: str) -> None:
        if not json_out:
            typer.echo(message, err=True)

    try:
        report = run_load(LoadOptions(predict_rps, rows, observe_rps, duration), progress=say)
    except (WrkMissing, OSError, RuntimeError) as err:
        fail(err)
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
        fail("--requests must be ≥ 10 and --salts ≥ 1")
    try:
        report = run_prefix_bench(requests=requests, salts=salts)
    except (TokenizerMissing, OSError, ValueError) as err:
        fail(err)
    print_report(report, as_json=json_out)


@bench_app.command("retrain")
def bench_retrain(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    requests: Annotated[int, typer.Option(help="Requests of the simulator run (one observation each).")] = 100_000,
    cache: Annotated[Path | None, typer.Option(help="Where the simulator's observation log is kept.")] = None,
) -> None:
    """Retraining time locally and on a 2-worker Dask cluster, and the retrained model against the online one."""
    from leadtime.bench.retrain import print_report, run_bench_retrain

    if requests < 1000:
        fail("--requests must be ≥ 1000")
    try:
        result = run_bench_retrain(requests=requests, cache=cache, progress=not json_out)
    except (FeatureError, OSError, ValueError, RuntimeError) as err:
        fail(err)
    print_report(result, as_json=json_out)


@bench_app.command("dashboards")
def bench_dashboards(
    out: Annotated[Path, typer.Option(help="Folder for the PNG files.")],
    minutes: Annotated[float, typer.Option(help="Minutes of traffic drawn.")] = 5.0,
    redis: Annotated[str | None, typer.Option(help="Redis for the predictor service (redis://HOST:PORT/DB).")] = None,
) -> None:
    """The whole stack on loopback under changing load, scraped by a real Prometheus; then the dashboards' PNGs."""

    from leadtime.bench.dashboards import run_dashboard_bench
    from leadtime.bench.procs import find_prometheus

    positive("--minutes", minutes)
    check_redis_url("--redis", redis, reachable=True)
    made = output_dir(out)
    try:
        executable = find_prometheus()
        if executable is None:
            fail("prometheus is not installed (apt-get install prometheus)")
        with tempfile.TemporaryDirectory(prefix="leadtime-dashboards-") as workdir:
            try:
                run_dashboard_bench(out, minutes, executable, Path(workdir), redis, progress=typer.echo)
            except (RuntimeError, OSError) as err:
                fail(err)
    finally:  # refused, failed or stopped before drawing: an empty folder would read as a run that drew nothing
        remove_if_empty(made)
