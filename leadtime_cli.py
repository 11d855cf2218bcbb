"""The `leadtime` command: one CLI over every package. Nothing imports this module.

Each command imports what it needs lazily so that `leadtime --help` stays fast. Errors a user can fix
(bad file, bad option value) are printed as one line and exit 2, never as a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from features.errors import FeatureError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Leadtime: latency-prediction routing.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print the figures the README quotes.")
sim_app = typer.Typer(no_args_is_help=True, help="The fleet simulator's tools.")
app.add_typer(bench_app, name="bench")
app.add_typer(sim_app, name="sim")

DEFAULT_TRACE = Path("../shared/data/measured/sharegpt-h200.jsonl")


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


# ----- predictor core (issue 2) -------------------------------------------------------------------------


@bench_app.command("accuracy")
def bench_accuracy(
    data: Annotated[Path, typer.Option(help="JSONL of llm-d training rows.")] = DEFAULT_TRACE,
    accelerator: Annotated[str, typer.Option(help="Accelerator class the rows came from.")] = "h200-sxm",
    model: Annotated[str, typer.Option(help="Model the rows came from.")] = "qwen3-32b",
    seeds: Annotated[int, typer.Option(help="Seeds of the random 90/10 split.")] = 10,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Prequential and 90/10-split accuracy of Leadtime, the llm-d reference and a median floor."""
    from bench.accuracy import print_report, run_accuracy

    try:
        report = run_accuracy(data, accelerator=accelerator, model=model, seeds=seeds, progress=not json_out)
    except (FeatureError, OSError, ValueError) as err:
        _fail(str(err))
    print_report(report, as_json=json_out)


@bench_app.command("coldstart")
def bench_coldstart(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    seed: Annotated[int, typer.Option(help="Random seed of the synthetic fleet data.")] = 0,
) -> None:
    """Accuracy on an accelerator class never seen before, after 50 and 500 of its observations."""
    from bench.coldstart import print_report, run_coldstart

    print_report(run_coldstart(seed=seed), as_json=json_out)


@app.command("demo")
def demo(
    data: Annotated[Path, typer.Option(help="JSONL of llm-d training rows.")] = DEFAULT_TRACE,
    out: Annotated[Path, typer.Option(help="Where to write the plot.")] = Path("out/demo"),
) -> None:
    """Run the online predictor over the real H200 trace, compare with llm-d's reference, plot it."""
    from bench.demo import run_demo

    try:
        run_demo(data, out)
    except (FeatureError, OSError, ValueError) as err:
        _fail(str(err))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
