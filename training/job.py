"""`leadtime retrain`: read the history, fit the residual trees on it, judge them against the champion, publish.

What "the model" is. A Leadtime model is the online predictor's state: the physics prior's online correction,
the per-class and per-endpoint offsets and the calibration (learned from every observation as it arrives), and
LightGBM trees that refine what those leave (`predictor/learner.py`). The online parts are only ever right as
of now, and the service keeps them current; the trees are what a longer history can improve. So the job keeps
the champion's online state as it is and replaces its trees with ones fitted on the whole history:

- with a champion in the registry, the challenger is the champion with new trees (mean and upper quantile per
  target) fitted on the residual the champion's online parts leave over the history, and calibrated on the
  history's most recent block. It keeps the champion's record of how far into the service's observation stream
  it has learned, so a replica that adopts it goes on from there: nothing learned twice, nothing skipped.
- with an empty registry, the online parts are first learned from the history in time order, as the service
  would have learned them, then the trees are fitted on top. What is published is what was judged: letting the
  online parts learn the evaluation slice afterwards would move them under trees fitted to what they left
  before (on the shipped H200 rows that doubled the TPOT error on the slice). When a source is the registry's
  own observation stream, the model learns the evaluation slice once judged and records how far into that
  stream it has learned, also when a replica published a model while the job ran. Otherwise it records no position
  in the service's stream: a running replica that adopts it goes on from its own, a replica that starts from it
  learns the stream from its start.

Judging is honest: the new trees never see the evaluation slice (the most recent `eval_share` of the rows), and both
models predict it the way the service serves them (`champion.py`). A champion that has served may have learned rows
of the slice, which flatters it: where its recorded stream position says so the job warns, with their count.
Exit status: 0 published, 3 champion kept. The registry may have moved on while the job ran (the service publishes
its own retrains): the challenger is then judged again, against the newest model, before anything is published.
It is not rebuilt on the newest model's online state: its trees were fitted to what its own online parts leave,
and they would not fit another state. Published, it takes replicas back to its stream position, from which they
learn the stream again.

Interrupted (Ctrl-C; SIGTERM, which the CLI turns into an exit), the job stops where it is. Before it publishes,
nothing is published; once it has, it says so (`InterruptedAfterPublishing`): the model is live whatever the exit
status, and a scheduler must not take the run for one that changed nothing. The publication itself, and the
report's move into place, finish before an interrupt is acted on (`_signals_held`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from leadtime.data import MEASURED, shipped_name
from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.errors import FeatureError
from leadtime.predictor.artifact import ArtifactError, check_writable_dir, missing_dirs, remove_empty_dirs
from leadtime.predictor.learner import TREES_LABEL_KEY, LearnerConfig, OnlinePredictor
from leadtime.predictor.physics import TARGETS, wait_overstated
from leadtime.predictor.service.learning import CURSOR_KEY, STREAM_KEY
from leadtime.predictor.store.base import cursor_order
from leadtime.predictor.store.stream_identity import same_stream
from leadtime.training.champion import Decision, Evaluation, decide, evaluate
from leadtime.training.fit import LocalTrainer, SearchConfig, TargetTrees, Trainer, fit_target, fits_per_target
from leadtime.training.limits import EVAL_SHARE, MALFORMED_SHARE, MARGIN
from leadtime.training.registry import Published, Registry, RegistryError, open_registry
from leadtime.training.sources import (
    SCHEMES_TEXT,
    RedisSource,
    SampleError,
    SampleReader,
    Samples,
    is_redis_url,
    shown,
)
from leadtime.training.split import BY_READ_ORDER, NO_TIMESTAMP, TimeSplit, evaluation_overlap_s, split_recent
from leadtime.training.unread import unread_keys_warning

EXIT_PUBLISHED = 0
EXIT_KEPT = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
MIN_TARGET_ROWS = 500  # history rows a target needs before trees are fitted for it
DEFAULT_ACCELERATOR = "h100-sxm"  # the service's defaults, for rows that name no class
DEFAULT_MODEL = "llama-3.1-8b"
RETRAIN_KEY = TREES_LABEL_KEY  # artifact metadata: what the job fitted the trees on (the learner drops it)


class RetrainError(RuntimeError):
    """The job cannot run as asked (a source, the registry, the cluster, the options); one line."""


class InterruptedAfterPublishing(SystemExit):
    """Ctrl-C or SIGTERM once the model was published: the registry serves it, though the job stopped short.

    A scheduler that saw 130 and no word took the run for one that changed nothing, while every replica had
    swapped the new model in. `message` says what is live where, and whether this run's report was written
    (placed whole, or not at all: the directory then holds what it held before), for the CLI to print. It is the
    exit the interrupt called for (`code`: 130 for Ctrl-C, 143 for SIGTERM as the CLI takes it), so that a caller
    that does not catch it (a benchmark) still leaves as it would have."""

    def __init__(self, version: int, registry: str, report_dir: Path | None, report_placed: bool, status: int) -> None:
        super().__init__(status)
        self.status = status
        report = ""
        if report_dir is not None:
            report = (
                f"; its report is in {report_dir}"
                if report_placed
                else f"; no report of this run was written ({report_dir} is as it was)"
            )
        self.message = f"interrupted after publishing version {version} to {registry}, which is live{report}"

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class RetrainConfig:
    """What `leadtime retrain` is asked to do.

    Parameters
    ----------
    samples
        Sources: JSONL or Parquet paths, shipped names (``sharegpt-h200``), ``redis://`` URLs of a stream.
    registry
        A directory or a ``redis://`` URL (``?namespace=NAME`` for another than the service's default).
    dask
        Address of a Dask scheduler to fit on, or None to fit in this process.
    report_dir
        Where to write report.json, report.md and the plots (None: no files).
    accelerator, model
        The class of rows that name none, for a model started here; must agree with the champion's.
    eval_share
        The most recent share of the rows held out for judging.
    margin
        How much lower (relative) the challenger's MAPE must be on every target judged that it has new trees for
        (`champion.decide`); on one it has none for, it serves the champion's own predictions.
    max_malformed_share
        The share of a source's rows that may be malformed before the job stops.
    search
        The trees' search (`fit.SearchConfig`).
    catalog
        The accelerator classes and models rows may name (`--catalog FILE`); it must state every class the
        registry's model was trained with as that model does.
    """

    samples: tuple[str, ...]
    registry: str
    dask: str | None = None
    report_dir: Path | None = None
    accelerator: str | None = None
    model: str | None = None
    eval_share: float = 0.2
    margin: float = 0.02
    max_malformed_share: float = 0.01
    search: SearchConfig = field(default_factory=SearchConfig)
    catalog: Catalog = BUILT_IN

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for spec in self.samples:  # the same file by two paths is one source: its rows would count twice
            key = _source_key(spec)
            if key in seen:
                raise ValueError(
                    f"--samples {shown(spec)} is given twice (as {shown(seen[key])} too): its rows would count twice"
                )
            seen[key] = spec
        if not self.registry.strip():
            raise ValueError("the registry is empty: give a directory or a redis:// URL")
        if "://" in self.registry and not is_redis_url(self.registry):
            raise ValueError(f"{shown(self.registry)}: not a registry (a directory or a {SCHEMES_TEXT} URL)")
        EVAL_SHARE.check("eval_share", self.eval_share)  # OutOfRange names the field; the CLI, the option
        MARGIN.check("margin", self.margin)
        MALFORMED_SHARE.check("max_malformed_share", self.max_malformed_share)


def _source_key(spec: str) -> str:
    """What a `--samples` source is, to find one given twice: a Redis URL's stream (`StreamIdentity`: one stream is
    often spelt two ways, `redis://h/0` and `redis://h`), else the file it reads (resolved as `SampleReader` resolves
    it: a shipped name, `sharegpt-h200`, means its file unless a file of that name is here), by its real path. A URL
    that names no stream (a port that is not a number) is taken as given: reading it says what is wrong."""
    if is_redis_url(spec):
        try:
            return RedisSource.parse(spec).stream.name
        except ValueError:  # SampleError too
            return spec
    if "://" in spec:
        return spec
    name = shipped_name(spec, MEASURED)
    if name is not None and not Path(spec).is_file():
        return os.path.realpath(MEASURED[name])
    return os.path.realpath(spec)


@dataclass
class RetrainResult:
    """What the job did: published or kept, the registry version, the report, and both models."""

    exit_code: int
    published_version: int | None
    report: dict[str, Any]
    challenger: OnlinePredictor
    champion: OnlinePredictor | None
    files: list[Path] = field(default_factory=list)


@dataclass
class _Progress:
    """A rich progress bar on standard error (or nothing), advanced by the job's steps."""

    enabled: bool
    bar: Any = None
    task: Any = None

    @contextlib.contextmanager
    def running(self, total: int) -> Iterator[_Progress]:
        if not self.enabled:
            yield self
            return
        from leadtime.progress import stderr_bar

        self.bar = stderr_bar()
        with self.bar:
            self.task = self.bar.add_task("retrain", total=total)
            yield self

    def step(self, description: str, advance: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=advance, description=description)


def run_retrain(config: RetrainConfig, client: Any = None, progress: bool = False) -> RetrainResult:
    """Run the job. `client`: a connected Dask client to fit on (else `config.dask` is connected to, if set).

    Raises RetrainError for anything a user can fix; the exit code is in the result.
    """
    started = time.perf_counter()
    timings: dict[str, float] = {}
    # The registry and report directories are made before a sample is read; a job that then failed left them behind,
    # empty. Those made here are removed again if still empty when it fails.
    made = missing_dirs(*([config.report_dir] if config.report_dir is not None else []), *_registry_dir(config))
    try:
        return _run(config, client, progress, started, timings)
    except BaseException:
        remove_empty_dirs(made)
        raise


def _registry_dir(config: RetrainConfig) -> list[Path]:
    return [Path(config.registry)] if "://" not in config.registry and config.registry.strip() else []


def _run(
    config: RetrainConfig, client: Any, progress: bool, started: float, timings: dict[str, float]
) -> RetrainResult:
    if config.report_dir is not None:  # before anything is fitted or published: a report that cannot be written
        try:  # would turn a published model (or a kept champion) into exit status 2
            check_writable_dir(config.report_dir, "the report directory")
        except OSError as err:
            raise RetrainError(str(err)) from None
    registry = _open_registry(config.registry)
    own_client = None
    trainer: Trainer | None = None
    published_version: int | None = None
    report_placed = False
    try:
        champion_published = _latest(registry)
        champion = _load(champion_published, registry.name) if champion_published is not None else None
        accelerator, model = _default_class(config, champion)
        trainer, own_client, workers = _trainer(config, client)
        bar = _Progress(progress)
        total_fits = fits_per_target(config.search) * len(TARGETS)
        with bar.running(total_fits + 4):
            t = time.perf_counter()
            bar.step("reading samples", 0)
            samples = _read(config, accelerator, model, bar)
            timings["read_s"] = time.perf_counter() - t
            split = _split(samples, config.eval_share)
            bar.step("samples read")

            t = time.perf_counter()
            fresh = LearnerConfig(
                accelerator=accelerator, model=model, quantile=config.search.quantile, catalog=config.catalog
            )
            base = _base(champion, samples, split, fresh)
            timings["online_base_s"] = time.perf_counter() - t
            bar.step("online parts ready")

            t = time.perf_counter()
            trees = _fit_trees(base, samples, split, config.search, trainer, bar)
            timings["fit_s"] = time.perf_counter() - t

            t = time.perf_counter()
            challenger, renewed = _challenger(base, trees, samples, split, config)
            evaluation = _evaluations(champion, challenger, base, samples, split)
            # Where the challenger has no new trees it serves what the champion does (`base` is the champion's).
            unchanged = [t for t in TARGETS if t not in renewed]
            # Where it has a new quantile tree but not a new mean tree, its mean predictions are the champion's.
            kept_mean = [t for t in renewed if trees[t].mean is None]
            decision = decide(evaluation.get("champion"), evaluation["challenger"], config.margin, unchanged, kept_mean)
            timings["evaluate_s"] = time.perf_counter() - t
            bar.step("judged")

            rival = None
            judged_against = champion  # the model the decision compared the challenger with
            if decision.publish:
                rival, rival_model, evaluation, decision = _judge_again_if_moved(
                    registry, champion_published, challenger, base, samples, split, evaluation, decision, config
                )
                judged_against = rival_model or judged_against
            if decision.publish:
                if champion_published is None:  # its online parts were learned here, rival or not
                    _take_stream_position(registry, samples, split, challenger)
                artifact = challenger.to_bytes()
                with _signals_held():  # an interrupt waits for the publication: then it is known to be done
                    published_version = _publish(registry, artifact)
            bar.step("published" if decision.publish else "champion kept")
        timings["total_s"] = time.perf_counter() - started
        serving_cost = {"challenger": _predict_cost(challenger, samples, split)}
        if champion is not None:
            serving_cost["champion"] = _predict_cost(champion, samples, split)
        report = _report(
            config,
            samples,
            split,
            trees,
            evaluation,
            decision,
            registry.name,
            champion_published,
            rival,
            published_version,
            trainer.name,
            workers,
            timings,
            challenger,
            serving_cost,
            judged_against,
        )
        result = RetrainResult(
            EXIT_PUBLISHED if decision.publish else EXIT_KEPT,
            published_version,
            report,
            challenger,
            champion,
        )
        if config.report_dir is not None:
            from leadtime.training.report import draft_report

            try:
                draft = draft_report(config.report_dir, report, evaluation, trees)
                try:
                    with _signals_held():  # moved into place whole, an interrupt acted on after
                        result.files = draft.place()
                        report_placed = True
                finally:
                    draft.discard()
            except OSError as err:
                done = f"published version {published_version}" if decision.publish else "kept the champion"
                raise RetrainError(f"{done}, but the report could not be written: {err}") from None
            report["files"] = [str(p) for p in result.files]
        return result
    except (KeyboardInterrupt, SystemExit) as stop:  # Ctrl-C; SIGTERM, as the CLI takes it
        if trainer is not None:
            trainer.interrupted()
        if published_version is not None:
            raise InterruptedAfterPublishing(
                published_version, registry.name, config.report_dir, report_placed, _status(stop)
            ) from stop
        raise
    finally:
        registry.close()
        if own_client is not None:
            own_client.close()


# --- the steps ---------------------------------------------------------------------------------------------


def _open_registry(spec: str) -> Registry:
    try:
        return open_registry(spec)
    except (RegistryError, SampleError) as err:
        raise RetrainError(str(err)) from None


def _latest(registry: Registry) -> Published | None:
    try:
        return registry.latest()
    except RegistryError as err:
        raise RetrainError(str(err)) from None


def _load(published: Published, where: str) -> OnlinePredictor:
    try:
        return OnlinePredictor.from_bytes(published.artifact, background=False)
    except ArtifactError as err:
        raise RetrainError(f"{where}: the registry's model {published.version} cannot be loaded ({err})") from None


def _default_class(config: RetrainConfig, champion: OnlinePredictor | None) -> tuple[str, str]:
    """The class of rows that name none: the champion's (the options may only repeat it), else the options'."""
    known = config.catalog
    try:
        accelerator = known.accelerator(config.accelerator).slug if config.accelerator else None
        model = known.model(config.model).slug if config.model else None
    except FeatureError as err:
        raise RetrainError(str(err)) from None
    differences = known.differences(champion.config.catalog) if champion is not None else []
    if differences:
        raise RetrainError(
            f"the registry's model was trained with another catalog ({'; '.join(differences)}): give --catalog the "
            "file it was trained with"
        )
    if champion is None:
        return accelerator or DEFAULT_ACCELERATOR, model or DEFAULT_MODEL
    served = champion.config.accelerator, champion.config.model
    for given, theirs, option in ((accelerator, served[0], "--accelerator"), (model, served[1], "--model")):
        if given is not None and given != theirs:
            raise RetrainError(
                f"{option} {given} disagrees with the registry's model, which serves rows naming no class as {theirs}"
            )
    return served


def _trainer(config: RetrainConfig, client: Any) -> tuple[Trainer, Any, int]:
    """(trainer, a client this job opened and must close, workers)."""
    if client is None and config.dask is None:
        return LocalTrainer(), None, 1
    from leadtime.training.distributed import DaskTrainer, DaskUnavailable, connect

    own = None
    if client is None:
        try:
            client = own = connect(str(config.dask))
        except DaskUnavailable as err:
            raise RetrainError(str(err)) from None
    trainer = DaskTrainer(client)
    return trainer, own, trainer.workers


def _read(config: RetrainConfig, accelerator: str, model: str, bar: _Progress) -> Samples:
    reader = SampleReader(accelerator, model, config.max_malformed_share, config.catalog)
    try:
        return reader.read(config.samples, progress=lambda name, n: bar.step(f"reading {name}: {n:,} rows", 0))
    except SampleError as err:
        raise RetrainError(str(err)) from None


def _split(samples: Samples, eval_share: float) -> TimeSplit:
    try:
        names = [s.name for s in samples.sources]
        streams = [s.kind == "redis" for s in samples.sources]  # in the order Redis took them
        return split_recent(samples.timestamps, eval_share, samples.source, names, streams=streams)
    except ValueError as err:
        raise RetrainError(str(err)) from None


def _actuals(samples: Samples) -> dict[str, np.ndarray]:
    return {"ttft": samples.actual_ttft_ms, "tpot": samples.actual_tpot_ms}


_OVERSTATED = "first token sooner than the time-slice wait they state"  # the rows `tree_rows` leaves out for TTFT


def tree_rows(target: str, x: np.ndarray, actual: np.ndarray, history: np.ndarray) -> np.ndarray:
    """The history rows the trees of `target` fit on: those that observed it, less, for TTFT, those whose first
    token came sooner than the time-slice wait they state (`physics.wait_overstated`): the online learner does
    not learn them, and their residual (TTFT less the wait, floored) would teach the trees a speed no request has.
    """
    rows = history[actual[history] > 0]
    if target == "ttft":
        rows = rows[~wait_overstated(x[rows], actual[rows])]
    return rows


def _base(
    champion: OnlinePredictor | None, samples: Samples, split: TimeSplit, fresh: LearnerConfig
) -> OnlinePredictor:
    """The online parts the trees refine: the champion's, or learned here (with `fresh`'s class, quantile and
    catalog) from the history in time order."""
    if champion is not None:
        return OnlinePredictor.from_bytes(champion.to_bytes(), background=False)
    base = OnlinePredictor(replace(fresh, background=False, retrain=False))
    rows = split.history
    base.learn_many(samples.batch[rows], samples.actual_ttft_ms[rows], samples.actual_tpot_ms[rows])
    base.config.retrain = True  # the service decides when it retrains; a model at rest retrains on schedule
    return base


def _fit_trees(
    base: OnlinePredictor,
    samples: Samples,
    split: TimeSplit,
    search: SearchConfig,
    trainer: Trainer,
    bar: _Progress,
) -> dict[str, TargetTrees]:
    """Trees per target on the history rows that observed it (fewer than `MIN_TARGET_ROWS`: none fitted)."""
    fitted: dict[str, TargetTrees] = {}
    counted: list[str] = []  # per target, the rows counted against MIN_TARGET_ROWS, and those left out for a wait
    search = _with_quantile(search, base.config.quantile)
    for target, actual in _actuals(samples).items():
        rows = tree_rows(target, samples.batch.X, actual, split.history)
        overstated = int((actual[split.history] > 0).sum()) - len(rows)
        counted.append(
            f"{target}: {len(rows)}" + (f", {overstated} more left out for a {_OVERSTATED}" if overstated else "")
        )
        if len(rows) < MIN_TARGET_ROWS:
            bar.step(f"{target}: {len(rows)} rows, too few for trees", fits_per_target(search))
            continue
        x, residual = base.residual_training_set(target, samples.batch[rows], actual[rows])
        try:
            fitted[target] = fit_target(
                target,
                x,
                residual,
                partial(base.serving_residuals, target),
                search,
                trainer,
                tick=lambda what: bar.step(what),
            )
        except (ValueError, RuntimeError) as err:  # too few rows for the folds; a Dask fit that failed
            raise RetrainError(f"{target}: {err}") from None
    if not fitted:
        raise RetrainError(f"no target has the {MIN_TARGET_ROWS} history rows trees need ({'; '.join(counted)})")
    return fitted


def _with_quantile(search: SearchConfig, quantile: float) -> SearchConfig:
    return search if search.quantile == quantile else replace(search, quantile=quantile)


def _challenger(
    base: OnlinePredictor,
    trees: dict[str, TargetTrees],
    samples: Samples,
    split: TimeSplit,
    config: RetrainConfig,
) -> tuple[OnlinePredictor, set[str]]:
    """`base` (copied) serving the new trees, one version on, with a record of what they were fitted on; and the
    targets it has new trees for (on the others it predicts as `base` does).

    A target no row of the evaluation slice observed cannot be judged (`champion.decide`): trees fitted for it
    replace none the champion (`base`) serves, which stay; they are installed only where it serves none."""
    challenger = OnlinePredictor.from_bytes(base.to_bytes(), background=False)
    judged = {t for t, actual in _actuals(samples).items() if (actual[split.evaluation] > 0).any()}
    trees = {t: f for t, f in trees.items() if t in judged or base.tree_text(t) is None}
    renewed: set[str] = set()
    for target, fitted in trees.items():
        if fitted.installs:
            challenger.install_trees(
                target, fitted.mean, fitted.upper, fitted.upper_shift, fitted.calibration_residuals
            )
            renewed.add(target)
    challenger.version = base.version + 1
    stamps = samples.timestamps[split.history]
    challenger.metadata[RETRAIN_KEY] = {
        "at": datetime.now(UTC).isoformat(),
        "sources": [s.name for s in samples.sources],
        "history_rows": len(split.history),
        "history_until": float(np.nanmax(stamps)) if np.isfinite(stamps).any() else None,
        "targets": {t: {"mean": f.mean is not None, "upper": f.upper is not None} for t, f in trees.items()},
        "based_on_version": base.version,
    }
    return challenger, renewed


def _evaluations(
    champion: OnlinePredictor | None,
    challenger: OnlinePredictor,
    base: OnlinePredictor,
    samples: Samples,
    split: TimeSplit,
) -> dict[str, Evaluation]:
    """Both models on the evaluation slice; with no champion, the online parts alone for reference."""
    rows = split.evaluation
    batch = samples.batch[rows]
    actual = {t: a[rows] for t, a in _actuals(samples).items()}
    out = {"challenger": evaluate(challenger, batch, actual)}
    if champion is not None:
        out["champion"] = evaluate(champion, batch, actual)
    else:
        out["online_only"] = evaluate(base, batch, actual)
    return out


def _judge_again_if_moved(
    registry: Registry,
    champion: Published | None,
    challenger: OnlinePredictor,
    base: OnlinePredictor,
    samples: Samples,
    split: TimeSplit,
    evaluation: dict[str, Evaluation],
    decision: Decision,
    config: RetrainConfig,
) -> tuple[Published | None, OnlinePredictor | None, dict[str, Evaluation], Decision]:
    """If the registry moved on while the job ran, judge the challenger again against its newest model (and
    number it after that model); returns that model, as published and as loaded (None, None if it did not move).
    Every target is held to the margin there: where the challenger has no new trees it serves what the old
    champion did, not what the newest model does."""
    newest = _latest(registry)
    if newest is None or (champion is not None and newest.digest == champion.digest):
        return None, None, evaluation, decision
    rival = _load(newest, registry.name)
    challenger.version = max(challenger.version, rival.version + 1)
    evaluation = _evaluations(rival, challenger, base, samples, split)
    return newest, rival, evaluation, decide(evaluation["champion"], evaluation["challenger"], config.margin)


def _take_stream_position(registry: Registry, samples: Samples, split: TimeSplit, challenger: OnlinePredictor) -> None:
    """A first model (the registry held none when the job started) learned its online parts from the history
    alone, whatever a replica published while the job ran. When a source is the registry's own observation stream,
    it also learns the evaluation slice once judged, and records how far into that stream it has learned, as the
    service stamps the models it publishes: the replicas that adopt it go on from there. Without a position a
    replica adopting it kept reading where it was, losing what its own model had learned since, and one starting
    up replayed the whole stream over it, learning the history twice."""
    # The registry's stream and a source's are compared as what their URLs name, not as text: `redis://h:6379`
    # and `redis://h/0` are one stream.
    stream = registry.stream
    source = next((s for s in samples.sources if s.cursor is not None and s.stream == stream), None)
    if stream is None or source is None:
        return
    rows = split.evaluation
    challenger.config.retrain = False  # the trees just fitted and judged are the ones published
    try:
        challenger.learn_many(samples.batch[rows], samples.actual_ttft_ms[rows], samples.actual_tpot_ms[rows])
    finally:
        challenger.config.retrain = True
    challenger.metadata[CURSOR_KEY] = source.cursor
    challenger.metadata[STREAM_KEY] = stream.name  # as the service stamps its own models (`Store.stream_name`)


def _publish(registry: Registry, artifact: bytes) -> int:
    try:
        return registry.publish(artifact)
    except RegistryError as err:
        raise RetrainError(str(err)) from None


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block is done, then act on them as they would have been: a publication
    and a report's move into place are done whole or not at all, and the job knows which when it says why it
    stopped (cut short, a publication to Redis might have been made or not, unknown). Each block is short: one
    registry write, a few renames. Signals reach only the main thread's handlers: elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    previous = {signum: signal.signal(signum, hold) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if held:
            signal.raise_signal(held[0])


def _status(stop: BaseException) -> int:
    """The exit status an interrupt leaves with: 130 for Ctrl-C, a SystemExit's own (143 for the CLI's SIGTERM)."""
    if isinstance(stop, SystemExit):
        return stop.code if isinstance(stop.code, int) else 1
    return EXIT_INTERRUPTED


def _report(
    config: RetrainConfig,
    samples: Samples,
    split: TimeSplit,
    trees: dict[str, TargetTrees],
    evaluation: dict[str, Evaluation],
    decision: Decision,
    registry_name: str,
    champion: Published | None,
    rival: Published | None,
    published_version: int | None,
    backend: str,
    workers: int,
    timings: dict[str, float],
    challenger: OnlinePredictor,
    serving_cost: dict[str, float],
    judged_against: OnlinePredictor | None,
) -> dict[str, Any]:
    """The job's report as JSON-ready values (report.py writes it out with the plots)."""
    stamps = samples.timestamps
    eval_stamps = stamps[split.evaluation]
    return {
        "outcome": "published" if decision.publish else "kept",
        "warnings": _warnings(samples, split, judged_against),
        "exit_code": EXIT_PUBLISHED if decision.publish else EXIT_KEPT,
        "registry": {
            "name": registry_name,
            "champion_version": champion.version if champion is not None else None,
            "judged_again_against_version": rival.version if rival is not None else None,
            "published_version": published_version,
        },
        "decision": {**decision.as_dict(), "margin": config.margin},
        "samples": {
            "rows": len(samples),
            "sources": [
                {
                    "name": s.name,
                    "kind": s.kind,
                    "read": s.read,
                    "used": s.used,
                    "malformed": s.malformed,
                    "unread_keys": s.unread,
                }
                for s in samples.sources
            ],
            "malformed_total": samples.malformed_total,
            "malformed": [{"source": m.source, "where": m.where, "problem": m.problem} for m in samples.malformed],
            "ordered_by": split.basis,
            "order_reason": split.reason,  # for read order: why the timestamps were not used
            "history_rows": len(split.history),
            "evaluation_rows": len(split.evaluation),
            "evaluation_from": float(np.min(eval_stamps)) if np.isfinite(eval_stamps).all() else None,
            "per_target": {
                t: {"history": int((a[split.history] > 0).sum()), "evaluation": int((a[split.evaluation] > 0).sum())}
                for t, a in _actuals(samples).items()
            },
        },
        "training": {
            "backend": backend,
            "workers": workers,
            "quantile": challenger.config.quantile,
            "search": {
                "grid": config.search.grid,
                "folds": config.search.folds,
                "learning_rate": config.search.learning_rate,
                "max_rounds": config.search.max_rounds,
                "patience": config.search.patience,
            },
            "targets": {t: fitted.summary() for t, fitted in trees.items()},
        },
        "evaluation": {name: e.as_dict() for name, e in evaluation.items()},
        "serving_cost_ms_per_100_rows": serving_cost,
        "model": {
            "version": challenger.version,
            "accelerator": challenger.config.accelerator,
            "model": challenger.config.model,
        },
        "timings_s": timings,
    }


def _warnings(samples: Samples, split: TimeSplit, champion: OnlinePredictor | None = None) -> list[str]:
    """What the job went on despite, one line each (the CLI prints them on stderr, in every output mode);
    `champion` is the model the challenger was judged against, if any."""
    lines = []
    unread = unread_keys_warning(samples.sources)
    if unread is not None:
        lines.append(unread)
    untimed = _untimed_sources_warning(samples, split)
    if untimed is not None:
        lines.append(untimed)
    learned = _champion_learned_warning(champion, samples, split)
    if learned is not None:
        lines.append(learned)
    overlap = evaluation_overlap_s(samples.timestamps, split)
    if overlap is not None:
        why = f"ordered by {split.basis}" + (f": {split.reason}" if split.reason else "")
        lines.append(
            f"the evaluation slice starts {overlap:.0f} s before the history's latest timestamp ({why}): it is not "
            "the most recent rows by their timestamps"
        )
    return lines


def _champion_learned_warning(champion: OnlinePredictor | None, samples: Samples, split: TimeSplit) -> str | None:
    """A model records how far into which observation stream it has learned (`CURSOR_KEY`, `STREAM_KEY`): a live
    service's model has learned every row of its stream up to there. Rows of the evaluation slice read from that
    stream at or before that position are rows the champion learned, its figures on them in-sample, which favours
    keeping it. Said with their count. Rows from files carry no such record (README: a live champion's figures can
    be in-sample), and a position that does not read as one says nothing."""
    if champion is None:
        return None
    cursor, recorded = champion.metadata.get(CURSOR_KEY), champion.metadata.get(STREAM_KEY)
    if not isinstance(cursor, str):
        return None
    try:
        ms, seq = cursor_order(cursor)
    except ValueError:
        return None
    for index, source in enumerate(samples.sources):
        if source.stream is None or not same_stream(recorded, source.stream):
            continue
        rows = split.evaluation[samples.source[split.evaluation] == index]
        ids = samples.entries[rows]
        learned = int(((ids[:, 0] < ms) | ((ids[:, 0] == ms) & (ids[:, 1] <= seq))).sum())
        if learned:
            return (
                f"the champion has learned {learned} of the {len(split.evaluation)} rows of the evaluation slice (its "
                f"position in {source.name} is entry {cursor}): its figures on them are in-sample, which favours "
                "keeping it"
            )
    return None


def _untimed_sources_warning(samples: Samples, split: TimeSplit) -> str | None:
    """With several sources and a row without a timestamp (the service's stream keeps none for llm-d's rows), the
    sources follow each other in the order given, and the evaluation slice is the last one's tail: the newest rows
    only if the newest source came last, which nothing here can check. Said, naming the sources without them; one
    source alone is in the order it was logged in, and needs no timestamp."""
    if split.basis != BY_READ_ORDER or split.reason != NO_TIMESTAMP or len(np.unique(samples.source)) < 2:
        return None
    untimed = [s.name for i, s in enumerate(samples.sources) if np.isnan(samples.timestamps[samples.source == i]).any()]
    judged = [samples.sources[i].name for i in np.unique(samples.source[split.evaluation])]
    return (
        f"{', '.join(untimed)} {'has' if len(untimed) == 1 else 'have'} rows without a timestamp: the sources follow "
        f"each other in the order given, so the evaluation slice is the last {len(split.evaluation)} rows read (from "
        f"{', '.join(judged)}), not the newest by time; give the newest last"
    )


def _predict_cost(predictor: OnlinePredictor, samples: Samples, split: TimeSplit, calls: int = 30) -> float:
    """Median time of one `predict_many` call on 100 evaluation rows (what a router's bulk call costs)."""
    rows = split.evaluation[:100]
    batch = samples.batch[rows]
    predictor.predict_many(batch)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        predictor.predict_many(batch)
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)
