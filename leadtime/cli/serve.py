"""`leadtime serve`: the predictor service."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from leadtime.cli.common import CATALOG_HELP, app, bind_host, fail
from leadtime.features.errors import FeatureError, validation_problem

OPTION_OF = {
    "host": "--host",
    "port": "--port",
    "grpc_port": "--grpc-port",
    "redis_url": "--redis",
    "role": "--role",
    "objective": "--objective",
    "quantile": "--quantile",
    "model_dir": "--model-dir",
    "model_from": "--model-from",
    "api_token": "--api-token",
    "allowed_hosts": "--allowed-host",
    "accelerator": "--accelerator",
    "model": "--model",
    "catalog": "--catalog",
    "tls_certfile": "--tls-cert",
    "tls_keyfile": "--tls-key",
}
"""The service settings `leadtime serve` takes as options; the others are read from `LEADTIME_<FIELD>` only."""


def setting_name(field: str) -> str:
    """A setting as the user gave it: its option and variable, or the variable alone.

    >>> setting_name("redis_url"), setting_name("max_body_bytes")
    ('--redis (LEADTIME_REDIS_URL)', 'LEADTIME_MAX_BODY_BYTES')
    """
    variable = f"LEADTIME_{field.upper()}"
    return f"{OPTION_OF[field]} ({variable})" if field in OPTION_OF else variable


@app.command("serve")
def serve(
    host: Annotated[str | None, typer.Option(envvar="LEADTIME_HOST", help="HTTP address (default 127.0.0.1).")] = None,
    port: Annotated[
        int | None,
        typer.Option(envvar="LEADTIME_PORT", help="HTTP port (default 8000; 0 = any free one, which the log names)."),
    ] = None,
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
    model_from: Annotated[
        str | None,
        typer.Option(
            envvar="LEADTIME_MODEL_FROM",
            help="With --role prediction: pull the model from this training server (http(s)://HOST:PORT).",
        ),
    ] = None,
    api_token: Annotated[
        str | None, typer.Option(envvar="LEADTIME_API_TOKEN", help="Bearer token the write paths require.")
    ] = None,
    allowed_host: Annotated[
        list[str] | None,
        typer.Option(
            help="Answer HTTP requests only when their Host header names this host (port not compared; "
            "*.example.com: its subdomains), refusing others with 400: the defence against DNS rebinding. "
            "Repeatable; or LEADTIME_ALLOWED_HOSTS, comma-separated. Unset: any Host. /healthz, /readyz and "
            "/metrics answer any Host (kubelet and Prometheus name the pod by its IP). gRPC is not checked.",
        ),
    ] = None,
    accelerator: Annotated[
        str | None,
        typer.Option(
            envvar="LEADTIME_ACCELERATOR", help="Class for rows naming none (the saved model's, else h100-sxm)."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            envvar="LEADTIME_MODEL", help="Model for rows naming none (the saved model's, else llama-3.1-8b)."
        ),
    ] = None,
    catalog: Annotated[
        Path | None,
        typer.Option(
            envvar="LEADTIME_CATALOG",
            help=CATALOG_HELP,
        ),
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

    if host is not None:
        bind_host(host)
    overrides = dict(
        host=host,
        port=port,
        grpc_port=grpc_port,
        redis_url=redis,
        role=role,
        objective=objective,
        quantile=quantile,
        model_dir=model_dir,
        model_from=model_from,
        api_token=api_token,
        allowed_hosts=tuple(allowed_host) if allowed_host else None,  # else LEADTIME_ALLOWED_HOSTS, apart by commas
        accelerator=accelerator,
        model=model,
        catalog=catalog,
        tls_certfile=tls_cert,
        tls_keyfile=tls_key,
    )
    try:
        settings = ServiceSettings.from_env(overrides)
        known = settings.read_catalog()
        try:
            known.accelerator(settings.accelerator)
            known.model(settings.model)
        except FeatureError as err:
            from leadtime.features.catalog_file import CATALOG_HINT

            fail(f"{setting_name(err.field)}: {err.problem}; {CATALOG_HINT}")
        plan_cpus(settings.learner_cpus, allowed_cpus())
    except ValidationError as err:
        where, problem = validation_problem(err)
        for field, option in OPTION_OF.items():
            if "_" in field:  # a name no sentence has: a check of several settings together names them
                problem = problem.replace(field, option)
        fail(f"{setting_name(where)}: {problem}" if where else problem)
    except (FeatureError, CpuPlanError, ValueError) as err:  # ValueError: a secret variable set but empty
        fail(err)
    from leadtime.predictor.service.app import StoreError
    from leadtime.predictor.service.serve import serve as run_service

    try:
        run_service(settings)
    except (OSError, StoreError) as err:
        fail(err)
