"""`leadtime route`: the gateway."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from leadtime.cli.common import (
    CATALOG_HELP,
    app,
    bind_host,
    catalog_option,
    check_redis_url,
    fail,
    hardware_options,
    positive,
    refuse_blank_variables,
    slo_option,
    warn,
)

HOSTS_VARIABLE = "LEADTIME_ROUTE_ALLOWED_HOSTS"
KEYS_VARIABLE = "LEADTIME_ROUTE_API_KEY"


def _checked_entries(
    given: list[str] | None,
    option: str,
    variable: str,
    parse: Callable[[str], tuple[str, ...]],
    check: Callable[[str], str],
    said: str,
) -> tuple[str, ...]:
    """The `option`s given, else `variable`'s entries (`parse`), else none, each as `check` gives it back; one that
    fails it fails the command in one line naming where it came from (`said` between that and the reason)."""
    value = os.environ.get(variable)
    if given:
        entries, source = given, option
    elif value is not None:
        entries, source = list(parse(value)), variable
    else:
        return ()
    checked = []
    for entry in entries:
        try:
            checked.append(check(entry))
        except ValueError as err:
            fail(f"{source}{said}{err}")
    return tuple(checked)


def checked_hosts(given: list[str] | None) -> tuple[str, ...]:
    """The gateway's allowed hosts as compared: the `--allowed-host` options, else `LEADTIME_ROUTE_ALLOWED_HOSTS`
    (comma-separated, as a Kubernetes env value lists them; click would split a repeatable option's variable at
    spaces), else none."""
    from leadtime.predictor.service.hosts import check_allowed_host, parse_allowed_hosts

    return _checked_entries(given, "--allowed-host", HOSTS_VARIABLE, parse_allowed_hosts, check_allowed_host, ": ")


def checked_keys(given: list[str] | None) -> tuple[str, ...]:
    """The keys clients must show: the `--api-key` options, else `LEADTIME_ROUTE_API_KEY` (apart by commas, as
    the allowed hosts' variable, or by spaces; read here, since click splits a repeatable option's variable at
    spaces alone and took `key1,key2` for one key), else none."""
    from leadtime.predictor.service.keys import check_key, parse_keys

    return _checked_entries(given, "--api-key", KEYS_VARIABLE, parse_keys, check_key, " ")


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
        float | None,
        typer.Option(
            help="TTFT SLO of requests without an x-llm-d-slo-ttft-ms header (unset: none, and a request with no "
            "SLO goes where its predicted latency is lowest)."
        ),
    ] = None,
    tpot_slo_ms: Annotated[
        float | None,
        typer.Option(
            "--tpot-slo-ms",
            "--itl-slo-ms",
            help="ITL SLO of requests without an x-llm-d-slo-tpot-ms header (unset: none).",
        ),
    ] = None,
    accelerator: Annotated[
        str, typer.Option(help="Accelerator class of endpoints whose labels name none.")
    ] = "h100-sxm",
    model: Annotated[str, typer.Option(help="Model of endpoints whose labels name none.")] = "llama-3.1-8b",
    catalog: Annotated[Path | None, typer.Option(help=CATALOG_HELP)] = None,
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
            help="A key clients must show (Authorization: Bearer KEY) on /v1/... and the passed-through paths; "
            "repeat it to accept several (rotation); or LEADTIME_ROUTE_API_KEY, the keys apart by commas or "
            "spaces. Health and metrics stay open.",
        ),
    ] = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            help="Answer only requests whose Host header names this host (port not compared; *.example.com: its "
            "subdomains), refusing others with 400: the defence against DNS rebinding. Repeatable; or "
            "LEADTIME_ROUTE_ALLOWED_HOSTS, comma-separated. Unset: any Host. /healthz, /readyz and /metrics "
            "answer any Host (kubelet and Prometheus name the pod by its IP).",
        ),
    ] = None,
    drain_s: Annotated[
        int,
        typer.Option(help="On SIGTERM or Ctrl-C, seconds requests in flight may take to finish before they are cut."),
    ] = 30,
    upstream_timeout_s: Annotated[
        float,
        typer.Option(
            help="Longest wait for an endpoint's answer to start, and between two pieces of it; an endpoint that "
            "keeps anyone waiting longer fails the request (retried elsewhere if nothing was answered yet)."
        ),
    ] = 600.0,
) -> None:
    """Run an OpenAI-compatible gateway that routes live traffic with the plugin (no Kubernetes needed)."""
    from leadtime.features.catalog_file import CATALOG_HINT
    from leadtime.predictor.service.keys import check_key
    from leadtime.router_plugin.config import ConfigError, load_config
    from leadtime.router_plugin.discovery import DiscoveryError
    from leadtime.router_plugin.gateway.app import GatewaySettings
    from leadtime.router_plugin.gateway.serve import PLAIN_POLICIES, RouteOptions, build_gateway, needs_predictor
    from leadtime.router_plugin.timeslice_sources import TimesliceError

    bind_host(host)
    if (discovery is None) == (not endpoint):
        fail("give either --discovery FILE or one or more --endpoint ADDRESS:PORT")
    if sum([predictor_url is not None, predictor_grpc is not None, embedded]) > 1:
        fail("--predictor-url, --predictor-grpc and --embedded are alternatives: give one")
    if timeslice_file is not None and timeslice_url is not None:
        fail("--timeslice-file and --timeslice-url are alternatives: give one")
    if pull_model and predictor_url is None:
        fail("--pull-model pulls the model from the service's HTTP API: give --predictor-url too")
    if (predictor_tls or predictor_ca is not None) and predictor_url is None and predictor_grpc is None:
        fail("--predictor-tls and --predictor-ca are for a predictor service: give --predictor-url or --predictor-grpc")
    if predictor_url is not None and predictor_tls and not predictor_url.lower().startswith("https://"):
        fail("--predictor-tls: over HTTP, TLS is an https:// --predictor-url")
    for option, ca_file in (("--predictor-ca", predictor_ca), ("--upstream-ca", upstream_ca)):
        if ca_file is not None:
            from leadtime.predictor.client import tls_client_context

            try:
                tls_client_context(ca_file)
            except ValueError as err:
                fail(f"{option}: {err}")
    check_redis_url("--replicas-redis", replicas_redis)
    if not replicas_group or not replicas_group.isprintable() or " " in replicas_group:
        fail("--replicas-group: expected a name without spaces")
    if (tls_cert is None) != (tls_key is None):
        fail("--tls-cert and --tls-key go together: give both, or neither")
    policy = policy.replace("_", "-") if policy else policy  # as simulate and bench routing take names
    if policy and policy not in PLAIN_POLICIES:
        fail(f"--policy must be one of {', '.join(PLAIN_POLICIES)}, got {policy!r}")
    if not 1 <= port <= 65535:
        fail("--port must be between 1 and 65535")
    for name, value in (
        ("--pull-interval-s", pull_interval_s),
        ("--scrape-interval-ms", scrape_interval_ms),
        ("--unroutable-after-s", unroutable_after_s),
        ("--drain-s", drain_s),
        ("--upstream-timeout-s", upstream_timeout_s),
    ):
        if value is not None:
            positive(name, value)
    for name, slo in (("--ttft-slo-ms", ttft_slo_ms), ("--tpot-slo-ms", tpot_slo_ms)):
        if slo is not None:
            slo_option(name, slo)
    refuse_blank_variables(  # a flag given wins over its variable, which then does not matter
        *(["LEADTIME_API_TOKEN"] if api_token is None else []),
        *([KEYS_VARIABLE] if not api_key else []),
        *([HOSTS_VARIABLE] if not allowed_host else []),
    )
    if api_token is not None:
        try:
            check_key(api_token)
        except ValueError as err:
            fail(f"--api-token {err}")
    api_keys = checked_keys(api_key)
    allowed_hosts = checked_hosts(allowed_host)
    known = catalog_option(catalog)
    hardware_options(accelerator, model, known, CATALOG_HINT)
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
        api_keys=api_keys,
        allowed_hosts=allowed_hosts,
        drain_s=drain_s,
        upstream_timeout_s=upstream_timeout_s,
        catalog=known,
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
        unused = load_config(config).warnings if config is not None else []
    except ConfigError as err:
        fail(err)
    for line in unused:
        warn(line)
    given = "--predictor-url" if predictor_url else "--predictor-grpc" if predictor_grpc else "--embedded"
    if wanted and not (predictor_url or predictor_grpc or embedded):
        needs = "--shadow" if shadow else "the predicted-latency scorer"
        fail(f"{needs} needs a predictor: give --predictor-url, --predictor-grpc or --embedded")
    if not wanted and (predictor_url or predictor_grpc or embedded):
        plain = f"--policy {policy}" if policy else f"profile {profile!r}"
        fail(f"{given}: {plain} does not predict, so the predictor would go unused (add --shadow to learn beside it)")
    if predictor_grpc is not None:
        host, _, grpc_port = predictor_grpc.rpartition(":")
        if not host or not grpc_port.isdigit() or not 1 <= int(grpc_port) <= 65535:
            fail(f"--predictor-grpc: expected HOST:PORT (a port from 1 to 65535), got {predictor_grpc!r}")
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
            fail(f"--predictor-url: {err}")
    elif wanted and predictor_grpc:
        from leadtime.predictor.client import GrpcPredictorClient

        try:
            predict_client = GrpcPredictorClient(
                predictor_grpc, api_token=api_token, tls=predictor_tls, ca_file=predictor_ca
            )
            observe_client = GrpcPredictorClient(
                predictor_grpc, api_token=api_token, tls=predictor_tls, ca_file=predictor_ca
            )
        except ValueError as err:
            fail(f"--predictor-grpc: {err}")
    elif wanted:
        from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
        from leadtime.router_plugin.client import InProcessPredictor

        learner = OnlinePredictor(LearnerConfig(accelerator=accelerator, model=model, catalog=known)).start()
        predict_client = InProcessPredictor(learner, learner.config.quantile)
    try:
        gateway = build_gateway(options, predict_client, observe_client, remote=not embedded)
    except TimesliceError as err:
        fail(f"--timeslice-{'url' if timeslice_url else 'file'}: {err}")
    except (ConfigError, DiscoveryError) as err:
        fail(err)
    from leadtime.router_plugin.gateway.serve import serve_gateway

    try:
        serve_gateway(gateway, (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None)
    except OSError as err:
        fail(err)
