"""What every `leadtime` command shares: the Typer apps, the one-line error, the checks of common options and
the help texts of options several commands take."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from leadtime.data import MEASURED, DataFileError, describe_os_error

if TYPE_CHECKING:
    from leadtime.features.catalog import Catalog

# Plain (click-style) help: typer's rich help prints a type after every option, `<bool>` after flags included.
app = typer.Typer(
    no_args_is_help=True, add_completion=False, rich_markup_mode=None, help="Leadtime: latency-prediction routing."
)
bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)  # its help: the docstring of `_bench`
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
TRACE_HELP = "A shipped trace (mooncake, azure-conv), a Mooncake .jsonl or Azure .csv, or synthetic:rate_rps=20,..."
FLEET_HELP = "A shipped fleet (see `leadtime sim fleets`) or a fleet YAML."
CATALOG_HELP = "YAML of accelerator classes and models to know beside the built-in ones (e.g. b200, l4)."


def reference_model_option(value: str | None) -> str | None:
    if value is not None and value not in ("xgboost", "lightgbm"):
        fail(f"--reference-model must be xgboost or lightgbm, got {value!r}")
    if value == "xgboost":
        import importlib.util

        if importlib.util.find_spec("xgboost") is None:
            fail("--reference-model xgboost needs the xgboost package (pip install 'leadtime[test]')")
    return value


def catalog_option(path: Path | None) -> Catalog:
    """The catalog `--catalog FILE` names (the built-in one without it); a bad file ends the command naming it."""
    from leadtime.features.catalog import BUILT_IN
    from leadtime.features.catalog_file import CatalogError, load_catalog

    try:
        catalog = BUILT_IN if path is None else load_catalog(path)
    except CatalogError as err:
        fail(f"--catalog: {err}")
        raise  # not reached: fail exits
    if path is not None and catalog == BUILT_IN:
        warn(f"--catalog {path} adds no accelerator class or model")
    return catalog


def hardware_options(accelerator: str | None, model: str | None, known: Catalog | None = None, hint: str = "") -> None:
    """End the command naming `--accelerator` or `--model` when `known` (the built-in catalog by default) has no
    such class or model: the catalog's own error names its field (`accelerator: unknown ...`), not the option."""
    from leadtime.features.catalog import BUILT_IN
    from leadtime.features.errors import FeatureError

    catalog = BUILT_IN if known is None else known
    try:
        if accelerator is not None:
            catalog.accelerator(accelerator)
        if model is not None:
            catalog.model(model)
    except FeatureError as err:
        fail(f"--{err.field}: {err.problem}{'; ' + hint if hint else ''}")


def fail(message: str | Exception) -> NoReturn:
    """One line on stderr and exit 2: the shape of every error a user can fix."""
    if isinstance(message, OSError) and message.strerror:
        message = describe_os_error(message)
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def refuse_blank_variables(*names: str) -> None:
    """Fail when one of the environment variables `names` is set but empty or blank. Click reads such a variable
    as not set, so a secret left empty (a Kubernetes Secret with an empty or missing key) started a server open to
    every client, or on plain HTTP, where the operator had meant a token or TLS."""
    for name in names:
        value = os.environ.get(name)
        if value is not None and not value.strip():
            fail(f"{name} is set but empty: give it a value, or unset it")


def warn(message: str) -> None:
    """One line on stderr that the run goes on despite: the shape of every warning, kept off stdout (--json)."""
    typer.secho(f"warning: {message}", fg=typer.colors.YELLOW, err=True)


def bind_host(value: str, option: str = "--host") -> str:
    """The address a server binds, refused when empty: "" binds every interface, and `--host "$HOST"` with HOST
    unset is no request to listen there (the servers stay on loopback unless told otherwise)."""
    if not value.strip():
        fail(f"{option} must not be empty: give an address (0.0.0.0 listens on every interface)")
    return value


def option_given(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option `name` (its parameter's name), on the command line or in its environment
    variable, rather than leaving its default: what an option's default cannot tell apart from the same value
    given. (By the source's name: typer ships its own copy of click, whose ParameterSource is another class.)"""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def output_dir(path: Path) -> list[Path]:
    """Make the `--out` folder and check that it takes files before a run that may last minutes, so the run does
    not end in a write error with its figures lost; the folders this call made, the deepest first (see
    `remove_if_empty`)."""
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        fail(f"--out {path}: a file is in the way (a folder is needed)")
    except OSError as err:
        fail(f"--out {path}: cannot write there ({(err.strerror or str(err)).lower()})")
    return made


def remove_if_empty(made: list[Path]) -> None:
    """Remove the folders `output_dir` made for `--out` (the deepest first) that are still empty (a run interrupted
    or refused before it wrote anything): an empty folder would read as a run that wrote nothing."""
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only an empty folder is removed


def unused_sibling(path: Path) -> Path:
    """`path` with the first of -2, -3, ... appended that names nothing yet: a folder to suggest instead."""
    n = 2
    while path.with_name(f"{path.name}-{n}").exists():
        n += 1
    return path.with_name(f"{path.name}-{n}")


LISTED_NAMES = 6
"""Names a refusal of an `--out` folder lists before it counts the rest: one line, however full the folder."""


def listed(names: Sequence[str]) -> str:
    """`names` for a one-line message: the first `LISTED_NAMES`, then how many more."""
    more = len(names) - LISTED_NAMES
    return ", ".join(names[:LISTED_NAMES]) + (f" and {more} more" if more > 0 else "")


def refuse_held(out: Path, what: str, names: Sequence[str]) -> NoReturn:
    """Refuse an `--out` folder whose files a run would replace or mix its own with, naming them and a folder to
    give instead: the one wording of every command that writes runs (`simulate`, `demo`, `bench routing`)."""
    sibling = unused_sibling(out)
    fail(f"--out {out} already holds {what} ({listed(names)}): give another folder (e.g. {sibling}), or move them away")


def positive(option: str, value: float, infinite: bool = False) -> None:
    """Fail unless `value` is a number > 0 (NaN is not), finite unless `infinite` allows infinity."""
    if not value > 0 or (math.isinf(value) and not infinite):
        fail(f"{option} must be > 0{'' if infinite else ' and finite'}, got {value}")


def slo_option(option: str, value: float, infinite: bool = False) -> None:
    """Fail unless `value` is an SLO a request may have: `positive`, and at least `policy.MIN_SLO_MS`."""
    from leadtime.router_plugin.policy import MIN_SLO_MS

    positive(option, value, infinite)
    if value < MIN_SLO_MS:
        fail(f"{option} must be at least {MIN_SLO_MS} (ms), got {value}")


def seed_option(seed: int) -> None:
    """Fail unless `seed` is one the policies and generators take (0 to 2**53, `check_count`'s bound): above it,
    a policy refused it naming its own field, `seed`, not the option."""
    from leadtime.features.rows import MAX_COUNT

    if seed < 0:
        fail(f"--seed must be ≥ 0, got {seed}")
    if seed > MAX_COUNT:
        fail(f"--seed must be ≤ 2**53, got a {len(str(seed))}-digit number")


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


def _terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM's handler in a benchmark or the retraining job: leave as Ctrl-C does, through every `finally` and
    `with` on the way out (children stopped, temporary folders removed, what was done said), then exit 128 + 15 as
    a process that SIGTERM ended. Further SIGTERMs are ignored so that they do not cut that cleanup short; SIGKILL
    still ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def leave_on_sigterm(ctx: typer.Context) -> None:
    """Take SIGTERM (a scheduler's stop or timeout) as `_terminated` does for the command `ctx` runs, and give the
    previous handler back when it ends: by default SIGTERM ended it at once, with no cleanup and no word."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous))


@bench_app.callback()
def _bench(ctx: typer.Context) -> None:
    """Benchmarks that print the figures the README quotes."""
    leave_on_sigterm(ctx)


def measured_path(data: str) -> Path:
    from leadtime.bench.data import dataset_path

    try:
        return dataset_path(data)
    except (DataFileError, ValueError, OSError) as err:  # OSError: a sim: trace's cache cannot be written
        fail(err)
        raise


def check_redis_url(option: str, url: str | None, reachable: bool = False) -> None:
    """Fail unless `url` (if given) is a Redis URL; with `reachable`, also unless a Redis answers there (a PING,
    2 s at most). A service waits out an outage, so only its URL's form is checked; a benchmark that runs against
    no Redis measures something else than it says, so it is refused before anything starts."""
    if url is None:
        return
    if not url.startswith(("redis://", "rediss://", "unix://")):
        from leadtime.predictor.store.stream_identity import without_credentials

        # Without a scheme, a user part ("user:pw@host") is all before the last "@": shown without it too.
        given = without_credentials(url) if "://" in url else url.rpartition("@")[2]
        fail(f"{option}: expected redis://HOST:PORT/DB (or rediss://, unix://), got {given!r}")
    if not reachable:
        return
    import redis

    from leadtime.predictor.store.redis_store import redis_client, redis_problem, without_credentials

    shown = without_credentials(url)
    try:
        client = redis_client(url, socket_connect_timeout=2.0, socket_timeout=2.0)
    except ValueError as err:
        fail(f"{option} {shown}: {err}")
        return
    try:
        client.ping()
    except redis.RedisError as err:
        fail(f"{option} {shown}: {redis_problem(err)}")
    finally:
        client.close()
