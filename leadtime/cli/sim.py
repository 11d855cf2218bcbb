"""`leadtime simulate` and the `leadtime sim ...` tools."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from leadtime.cli.common import (
    CATALOG_HELP,
    DEFAULT_MEASURED,
    FLEET_HELP,
    MEASURED_HELP,
    TRACE_HELP,
    app,
    bind_host,
    catalog_option,
    fail,
    hardware_options,
    measured_path,
    option_given,
    output_dir,
    positive,
    refuse_held,
    remove_if_empty,
    seed_option,
    sim_app,
    slo_option,
    warn,
)
from leadtime.data import SPLITWISE
from leadtime.features.errors import FeatureError


@app.command("simulate")
def simulate(
    ctx: typer.Context,
    fleet: Annotated[str, typer.Option(help=FLEET_HELP)],
    trace: Annotated[str, typer.Option(help=TRACE_HELP)] = "mooncake",
    policy: Annotated[
        list[str] | None,
        typer.Option(
            help="Routing policy, or profile:NAME of the plugin configuration; repeat to compare several "
            "(default: llm-d, or profile:default with --config)."
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="Plugin configuration (EndpointPickerConfig) of profile:NAME policies.")
    ] = None,
    max_requests: Annotated[int | None, typer.Option(help="Replay only the N earliest arrivals of the trace.")] = None,
    rate_scale: Annotated[float, typer.Option(help="Arrival-rate multiplier (2 = twice as fast).")] = 1.0,
    seed: Annotated[
        int,
        typer.Option(
            help="Random seed of every draw: policies, time-slice windows, the fleet's realism (step jitter, speed "
            "spread) and synthetic: traces."
        ),
    ] = 0,
    ttft_slo_ms: Annotated[
        float, typer.Option(help="TTFT SLO of every request when the fleet states no SLO classes.")
    ] = 2000.0,
    itl_slo_ms: Annotated[
        float,
        typer.Option(
            "--itl-slo-ms", "--tpot-slo-ms", help="ITL SLO of every request when the fleet states no SLO classes."
        ),
    ] = 100.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    out: Annotated[Path | None, typer.Option(help="Directory for observations JSONL, plots, report.")] = None,
    catalog: Annotated[Path | None, typer.Option(help=CATALOG_HELP)] = None,
    spread_steps: Annotated[
        bool,
        typer.Option(
            "--spread-steps",
            help="Spread requests that share a timestamp over the trace's timestamp step, as the demo and the "
            "benchmarks replay a trace (default: they arrive at one instant, as recorded).",
        ),
    ] = False,
) -> None:
    """Replay a trace on a simulated fleet under one or more routing policies."""
    from leadtime.router_plugin.config import load_config
    from leadtime.simulator.cli import (
        failure_warnings,
        overflow_warnings,
        print_simulation,
        run_simulate_command,
        slo_warnings,
    )
    from leadtime.simulator.engine import pools_never_joining
    from leadtime.simulator.fleet import load_fleet
    from leadtime.simulator.learning_policies import PROFILE_PREFIX
    from leadtime.simulator.workload import describe_arrivals, rate_unit_warning

    if max_requests is not None and max_requests < 1:
        fail("--max-requests must be ≥ 1")
    positive("--rate-scale", rate_scale)
    seed_option(seed)
    slo_option("--ttft-slo-ms", ttft_slo_ms, infinite=True)  # infinite: no SLO
    slo_option("--itl-slo-ms", itl_slo_ms, infinite=True)
    if out is not None:
        _no_earlier_run(out)
        made = output_dir(out)  # removed on the way out (Ctrl-C, an error) if nothing was written
        ctx.call_on_close(lambda: remove_if_empty(made))
    known = catalog_option(catalog)
    policies = policy or ([f"{PROFILE_PREFIX}default"] if config is not None else ["llm-d"])
    if config is not None and not any(name.startswith(PROFILE_PREFIX) for name in policies):
        given = " ".join(f"--policy {name}" for name in policies)
        fail(
            f"--config: {given} {'does' if len(policies) == 1 else 'do'} not read the plugin configuration "
            f"(--policy {PROFILE_PREFIX}NAME runs its profile NAME), so it would go unused"
        )
    try:
        picker = load_config(config) if config is not None else None
        for line in picker.warnings if picker is not None else []:
            warn(line)
        simulated = load_fleet(fleet, known)
        for option in ("ttft_slo_ms", "itl_slo_ms"):
            if simulated.slos and option_given(ctx, option):
                flag = "--" + option.replace("_", "-")
                warn(f"{flag} is ignored: the fleet states its SLO classes (slos), which apply instead")
        for line in slo_warnings(simulated, ttft_slo_ms, itl_slo_ms):
            warn(line)
        for line in overflow_warnings(picker, policies, simulated) if picker is not None else []:
            warn(f"{config}: {line}")
        report, replayed, unwritten = run_simulate_command(
            fleet,
            trace,
            policies,
            max_requests,
            rate_scale,
            seed,
            ttft_slo_ms,
            itl_slo_ms,
            out,
            not json_out,
            picker,
            known,
            spread_steps,
        )
    except (FeatureError, OSError, ValueError, RuntimeError) as err:
        fail(err)
        return
    for line in failure_warnings(report):
        warn(line)
    for pool in pools_never_joining(simulated, replayed):
        warn(f"pool {pool!r} never joins: its join time is after the last request's arrival, so it serves 0 requests")
    suspicious = rate_unit_warning(trace, replayed, rate_scale)
    if suspicious is not None:
        warn(suspicious)
    print_simulation(report, as_json=json_out, arrivals=describe_arrivals(replayed))
    if unwritten is not None:
        fail(f"--out {out}: {unwritten} (the report is printed above; the files written before are kept)")


def _no_earlier_run(out: Path) -> None:
    """Refuse an `--out` folder holding files a run writes: they were silently replaced (an earlier run's
    observations, a user's own report.json), or, with a run cut short, left mixed with the new run's."""
    from leadtime.simulator.report import run_files_in

    held = run_files_in(out) if out.is_dir() else []
    if held:
        refuse_held(out, "a run's files", held)


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
        fail(f"--scheduling must be async or sync, got {scheduling!r}")
    if output_tokens < 2:
        fail(f"--output-tokens must be ≥ 2, got {output_tokens}")
    hardware_options(accelerator, model)
    path = measured_path(data)
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
        fail(err)
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
    catalog: Annotated[Path | None, typer.Option(help=CATALOG_HELP)] = None,
) -> None:
    """Serve the simulated endpoints in real time as OpenAI-compatible HTTP servers with vLLM /metrics.

    A decode endpoint of a P/D fleet honours `x-prefiller-host-port` (prefill there, simulated KV transfer);
    a time-sliced fleet publishes its groups' states at /v1/timeslice/groups on --timeslice-port.
    """
    from leadtime.simulator.fleet import late_pools, load_fleet, resolve_fleet
    from leadtime.simulator.serve import serve_fleet

    if not 1 <= base_port <= 65535:
        fail("--base-port must be between 1 and 65535")
    if timeslice_port is not None and not 1 <= timeslice_port <= 65535:
        fail("--timeslice-port must be between 1 and 65535")
    if (tls_cert is None) != (tls_key is None):
        fail("--tls-cert and --tls-key go together: give both, or neither")
    bind_host(host)
    if tokens_per_event < 1:
        fail("--tokens-per-event must be ≥ 1")
    seed_option(seed)
    known = catalog_option(catalog)
    try:
        served = load_fleet(fleet, known)
    except ValueError as err:
        fail(err)
        return
    late = late_pools(served)
    if late:
        warn(
            f"pools {', '.join(map(repr, late))} scale out (join_at_s/join_at_share), not modelled by `sim serve`: "
            "they listen from the start and are in --endpoints-file"
        )
    try:
        serve_fleet(
            served,
            host=host,
            base_port=base_port,
            model_name=model_name or None,
            timeslice_port=timeslice_port,
            endpoints_file=endpoints_file,
            seed=seed,
            tls=(tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None,
            tokens_per_event=tokens_per_event,
            inputs={
                "--fleet": resolve_fleet(fleet),
                "--catalog": catalog,
                "--tls-cert": tls_cert,
                "--tls-key": tls_key,
            },
        )
    except (OSError, ValueError) as err:
        fail(err)


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
