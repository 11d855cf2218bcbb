"""`leadtime retrain`: the offline retraining job."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from leadtime.cli.common import CATALOG_HELP, app, catalog_option, fail, hardware_options, leave_on_sigterm, warn
from leadtime.training.limits import EVAL_SHARE, MALFORMED_SHARE, MARGIN, OutOfRange

OPTION_OF = {"eval_share": "--eval-share", "margin": "--margin", "max_malformed_share": "--max-malformed-share"}
"""The job's checked fields, as the options `leadtime retrain` takes them."""


@app.command("retrain")
def retrain(
    ctx: typer.Context,
    samples: Annotated[
        list[str],
        typer.Option(help="JSONL or Parquet observations, a shipped name, or redis://HOST:PORT/DB (the stream)."),
    ],
    registry: Annotated[str, typer.Option(help="Model registry: a directory (as --model-dir) or redis://...")],
    dask: Annotated[str | None, typer.Option(help="Fit on this Dask scheduler (tcp://HOST:8786).")] = None,
    report: Annotated[Path | None, typer.Option(help="Write report.json, report.md and plots here.")] = None,
    accelerator: Annotated[str | None, typer.Option(help="Class for rows naming none (a new model).")] = None,
    model: Annotated[str | None, typer.Option(help="Model for rows naming none (a new model).")] = None,
    catalog: Annotated[Path | None, typer.Option(help=CATALOG_HELP)] = None,
    eval_share: Annotated[
        float, typer.Option(help=f"Most recent share of rows held out for judging, in {EVAL_SHARE}.")
    ] = 0.2,
    margin: Annotated[
        float,
        typer.Option(help=f"Relative MAPE gain needed on each target judged that has new trees, in {MARGIN}."),
    ] = 0.02,
    max_malformed_share: Annotated[
        float,
        typer.Option(
            help=f"Share of a source's rows that may be malformed before the job stops, in {MALFORMED_SHARE}."
        ),
    ] = 0.01,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Fit the trees on a long history; publish only if they beat the registry's model.

    Exit 0 published, 3 champion kept, 2 an error."""
    import logging

    from leadtime.training.job import InterruptedAfterPublishing, RetrainConfig, RetrainError, run_retrain
    from leadtime.training.report import print_result

    leave_on_sigterm(ctx)  # a scheduler's stop is told what the job had done, as Ctrl-C is

    # The job says itself what went wrong, in one line: not the Redis store's own account of its connection, nor
    # LightGBM's chatter (its Dask set-up, and "Parameter n_jobs will be ignored." at every Dask fit). LightGBM's
    # log goes to a logger kept below ERROR: without a handler, Python's last-resort one printed every warning.
    logging.getLogger("leadtime.store").setLevel(logging.ERROR)
    import lightgbm

    lightgbm_log = logging.getLogger("lightgbm")
    lightgbm_log.setLevel(logging.ERROR)
    lightgbm.register_logger(lightgbm_log)

    from leadtime.features.catalog_file import CATALOG_HINT

    known = catalog_option(catalog)
    hardware_options(accelerator, model, known, CATALOG_HINT)
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
            catalog=known,
        )
        result = run_retrain(config, progress=not json_out)
    except InterruptedAfterPublishing as stop:  # the model is live: said, whatever else the exit status says
        typer.secho(f"error: {stop.message}", fg=typer.colors.RED, err=True)
        raise typer.Exit(stop.status) from None
    except OutOfRange as err:
        fail(err.named(OPTION_OF.get(err.field, err.field)))
    except (RetrainError, ValueError, OSError) as err:
        fail(err)
    for line in result.report["warnings"]:  # on stderr, so also beside --json's one object on stdout
        warn(line)
    print_result(result.report, as_json=json_out)
    raise typer.Exit(result.exit_code)
