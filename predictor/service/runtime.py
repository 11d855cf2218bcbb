"""The state of one service instance and its background loops.

Learning happens in a child process (`leadtime.predictor.service.learning`); this process serves. These loops run
beside the HTTP and gRPC handlers (each turn guarded: an unexpected error is named in /readyz, not the loop's end):
- ingest: reads accepted observations back from the store and forwards them to the learner process, so
  accepting is only an append (fast) and learning happens behind it, identically on every replica; the learner
  sends back snapshots that become the serving model;
- model sync: waits for newer models in the store's registry and swaps them in (within a second); with
  --model-dir it also takes up a model another process wrote there, and saves ours every minute while it learns;
- lease: renews the one training lease; only its holder retrains and publishes what it accepted (and, after a
  store outage, the retrained model the store could not take then);
- model pull (`--role prediction --model-from URL` only): pulls a training server's model every second and
  publishes it to this process's store, so that the model sync swaps it in as it would a shared registry's.
Everything lives on this object, which the app factory creates; there is no module-level state.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np

from leadtime.features.catalog import BUILT_IN
from leadtime.features.errors import FeatureError
from leadtime.predictor import physics
from leadtime.predictor.artifact import FILE_NAME, ArtifactError, decode, encode, load_file
from leadtime.predictor.client import served
from leadtime.predictor.learner import LearnerConfig, OnlinePredictor
from leadtime.predictor.metrics import ServiceMetrics
from leadtime.predictor.model_pull import ModelPull
from leadtime.predictor.service.cpus import allowed_cpus, plan_cpus
from leadtime.predictor.service.learning import (
    CURSOR_KEY,
    REACHED_KEY,
    STREAM_KEY,
    ChildSetup,
    LearnerProcess,
    LearnerReport,
    Snapshot,
    learned_rows,
)
from leadtime.predictor.service.model_dir import ModelDirFile
from leadtime.predictor.service.rows import ParsedObservations, RowParser
from leadtime.predictor.settings import ServiceSettings
from leadtime.predictor.store.base import LeaseLost, Store, cursor_order
from leadtime.predictor.store.stream_identity import same_stream

log = logging.getLogger("leadtime.service")

_RESTART_PAUSE_S = 1.0  # after the learner process died, before starting another (no tight crash loop)
_PULL_INTERVAL_S = 1.0  # between two pulls of --model-from's model (llm-d's prediction servers sync as often)
_LOOP_ERROR_PAUSE_S = 0.5  # after an unexpected error in a background loop, before its next turn
BACKLOG_FULL_MESSAGE = (
    "the learner's backlog is full (accepted rows wait to be learned faster than they can be, even thinned): "
    "nothing is accepted now; retry after a moment"
)
BACKLOG_RETRY_AFTER_S = 1
MAX_OBSERVATIONS_PER_CALL = 100_000
"""Most observations (training entries) one write call takes, over HTTP or gRPC."""
# Longest a flush waits for the ingest loop to let go of the learner (and for the Redis store's queue to reach the
# stream) before it reads past the backlog.
_FLUSH_WAIT_S = 5.0


class FlushRefused(ConnectionError):
    """A flush of the training data that could not reach the rows waiting to be learned (the store does not say
    where its stream ends, or the learner process does not take the request): nothing was flushed."""


@dataclass
class SampleCounts:
    """Accepted samples per target, split llm-d-style into training and test data (for /data/status)."""

    train: dict[str, int] = field(default_factory=lambda: {"ttft": 0, "tpot": 0})
    test: dict[str, int] = field(default_factory=lambda: {"ttft": 0, "tpot": 0})
    seen: int = 0


class ServiceRuntime:
    """Settings, store, serving predictor, learner process, metrics and loops of one app."""

    def __init__(
        self,
        settings: ServiceSettings,
        store: Store,
        predictor: OnlinePredictor | None = None,
        own_store: bool = False,
    ) -> None:
        self.settings = settings
        self.store = store
        self.own_store = own_store
        self.catalog = settings.read_catalog()
        if settings.catalog is not None:
            if self.catalog == BUILT_IN:
                log.warning("the catalog %s adds no accelerator class or model", settings.catalog)
            else:
                log.info("the catalog %s adds %s", settings.catalog, self.catalog.describe())
        self.parser = RowParser(settings.accelerator, settings.model, self.catalog)
        self.replica_id = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.predictor: OnlinePredictor | None = None
        self.store_version = 0
        self.holds_lease = False
        self.samples = SampleCounts()
        self.started_at = time.time()
        self._started_monotonic = time.monotonic()  # the age of a model that never changed counts from here
        self._initial_predictor = predictor
        # Stream positions: how far batches were forwarded to the learner, and how far the serving model goes.
        self._cursor = "0"
        self._served_cursor = "0"
        # Where the serving lineage stopped learning a stream that lost what it held (Redis restarted without
        # persistence, or flushed): the rows after it there are gone, though the new stream's positions follow on.
        # None: it never crossed such a loss. `_stream_losses_seen` is the store's count of them at the last read.
        self._reached: str | None = None
        self._stream_losses_seen = 0
        # Adoptions of published models (and learner restarts) start a new epoch; older snapshots are ignored.
        self._epoch = 0
        self._report: LearnerReport | None = None
        # Rows accepted, and learned / skipped as invalid by learner lineages that ended (restart, adoption).
        self._accepted_rows = 0
        self._learned_before = 0
        self._invalid_before = 0
        self._implausible_before = 0
        self._flushed_rows = 0  # read past unlearned by /flush (`flush_samples`)
        # Rows handed to the current lineage's learner: those it has not reported yet are pending in it.
        self._forwarded = 0
        # Rows the stream held when this process started, which an earlier one accepted: read back to be learned,
        # they are counted as replayed (on the accepted side), each once, up to `_replay_counted`; `_replay_until`
        # is the stream's end at start (None: nothing, or no longer anything, to replay).
        self._replayed = 0
        self._replay_until: str | None = None
        self._replay_counted = "0"
        # Rows an earlier stop kept, which the store sends (`Store.kept_after`), are replayed rows from the start
        # on: those that landed by the stream's end then (`_stream_end_at_start`; None: the store could not tell
        # it) as the replay reads them, the rest as the store counts them.
        self._replay_marked = False
        self._stream_end_at_start: str | None = None
        self._counts_lock = threading.Lock()
        self._swap_lock = threading.RLock()
        self._pull_lock = threading.Lock()  # one pull of --model-from's model at a time: the loop's or /reload's
        # One take-up of --model-dir's model at a time, the sync loop's or /reload's: each read the file before the
        # other noted it, and both published the same model.
        self._model_dir_lock = threading.Lock()
        # Held while a batch is forwarded and the read position advanced, and while a model is adopted, so that
        # the learner never receives a batch from before an adoption as if it came after it (lock order:
        # _learn_lock, then _swap_lock; never _learn_lock waited for with _swap_lock held, see `sync_from_store`).
        self._learn_lock = threading.Lock()
        self._published: set[int] = set()
        self._refused_version = 0
        # The store's server restarts when the registry last held our model (`_republish_if_registry_lost`).
        self._restarts_seen = 0
        self._stop = threading.Event()
        self._closing = threading.Event()  # a signal said stop; `stop()` has not run yet
        self._stopping = threading.Event()  # `stop()` has begun: not ready, while the servers in front wind down
        self._threads: list[threading.Thread] = []
        self._server_stops: list[Callable[[], None]] = []  # servers in front of this runtime (`add_server`)
        self._loop_errors: dict[str, str] = {}
        # Per background loop, the causes of unexpected errors whose traceback was logged (`_loop_turn`).
        self._loop_causes: dict[str, set[tuple[str, str, int]]] = {}
        self._retrain_error: str | None = None
        self._retrain_failures_seen = 0  # the learner's count of failed retrains in the last report
        # A retrained model the store could not take (it was down): published once it is back.
        self._unpublished: bytes | None = None
        self._publication_warned = False  # that the store could not take one was logged (once per outage)
        self.learner = LearnerProcess(self._on_snapshot, self._on_learner_exit)
        # Where the learner runs; `serve` pins the serving threads to the other CPUs.
        self.cpu_plan = plan_cpus(settings.learner_cpus, allowed_cpus())
        self.metrics = ServiceMetrics(self.live_values)
        # The serving model's artifact and its SHA-256, encoded once per model installed (`serving_artifact`).
        self._artifact_cache: tuple[OnlinePredictor, int, bytes, str] | None = None
        self._artifact_lock = threading.Lock()
        self._model_file = ModelDirFile(settings.model_dir) if settings.model_dir is not None else None
        self._saved_at = time.monotonic()
        self._saved_learned: dict[str, int] | None = None  # what the model had learned when last saved (periodically)
        # Whether the settings name the class of rows naming none (a pulled model of another class is then refused).
        self._class_named = bool({"accelerator", "model"} & settings.model_fields_set)
        self._catalog_differences: list[str] = []  # how the last model's catalog differed from ours (warned once)
        self._model_pull: ModelPull[bytes] | None = None
        if settings.model_from is not None:
            self._model_pull = ModelPull(
                settings.model_from,
                self._check_pulled,
                log,
                "serving the physics prior until one is pulled",
                ca_file=settings.model_from_ca_file,
            )

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the first model, start the learner process, then the loops (the app's lifespan calls this)."""
        if self.predictor is not None:
            return
        predictor = self._initial_predictor or self._first_predictor()
        self._initial_predictor = None
        self._take_default_class(predictor)
        self._install(predictor)
        self._saved_learned = self.learned()  # as it was loaded: nothing new to save yet
        self._served_cursor = self._cursor
        self._mark_replay()
        self._renew_lease()
        self._start_learner()
        for name, target in (
            ("ingest", self._ingest_loop),
            ("model-sync", self._sync_loop),
            ("lease", self._lease_loop),
            *([("model-pull", self._pull_loop)] if self._model_pull is not None else []),
        ):
            thread = threading.Thread(target=target, name=f"leadtime-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def add_server(self, stop: Callable[[], None]) -> None:
        """A server in front of this runtime that the app's lifespan does not stop (gRPC): `stop` (which waits
        for its grace) runs first in `stop()`, once the runtime answers not ready and while the store still takes
        what its calls in flight accept. Stopped after, a stream open at the signal went on accepting into a
        closed store."""
        self._server_stops.append(stop)

    def stop(self) -> None:
        """Turn not ready, stop the servers in front (`add_server`), then the learner process and the loops, hand
        the training lease over; close the store if the app owns it. Not ready first: a server in front can then
        answer its health checks NOT_SERVING while it winds down, rather than only close its port."""
        self._stopping.set()
        stops, self._server_stops = self._server_stops, []
        for stop_server in stops:
            try:
                stop_server()
            except Exception:  # stopping anyway: the rest must still stop
                log.exception("could not stop a server in front of the runtime")
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads.clear()
        # Released before the learner is stopped (up to 10 s, then a kill): nothing renews the lease meanwhile, and
        # it expired first whenever the learner was slow to exit, with nobody retraining until it had.
        released = self._release_lease()
        self.learner.stop()
        log.info("stopping (replica %s)%s", self.replica_id, released)
        self._save_on_stop()
        if self.predictor is not None:
            self.predictor.close()
        if self.own_store:
            self.store.close()

    def _release_lease(self) -> str:
        """Give the training lease up at a clean stop, so that another replica takes it at its next renewal (within
        a third of the lease's TTL) instead of waiting for it to expire, with nobody retraining or publishing
        meanwhile (every rolling update). Called once the loops have stopped: nothing renews it after this. The
        learner may still be finishing a retrain: with `holds_lease` off, one it finishes later is not published
        (one publishing now holds the swap lock and lands first), and the store refuses a publication by a replica
        that no longer holds the lease. The store deletes the lease only if this replica still holds it. What to
        add to the stop's log line."""
        if not self.holds_lease or self.store.stream_name is None:  # alone in its store: nobody to hand it to
            return ""
        with self._swap_lock:
            self.holds_lease = False
        try:
            released = self.store.release_training_lease(self.replica_id)
        except Exception as err:  # stopping anyway: say so, do not hide the stop behind a traceback
            log.warning("could not release the training lease: %s", err)
            released = False
        if released:
            return ": released the training lease, another replica takes it at its next renewal"
        return (
            ": the training lease was not released (another replica holds it now, or the store did not answer: "
            f"then it expires within {self.settings.lease_ttl_s:g} s)"
        )

    def _save_on_stop(self) -> None:
        """With --model-dir, keep what was learned since the model was last saved (it is saved when published):
        a restart then goes on from it. A model that learned nothing leaves the directory as it is, and so does
        a server that does not train (`_writes_model_dir`)."""
        model_file, predictor = self._model_file, self.predictor
        if model_file is None or predictor is None or not self._writes_model_dir or not any(self.learned().values()):
            return
        try:
            if model_file.save(predictor.to_bytes()):
                log.info("saved the serving model in %s", model_file.directory)
            else:
                log.warning(
                    "not saving the serving model in %s: another process published a model there since, kept",
                    model_file.directory,
                )
        except Exception as err:  # stopping anyway: say so, do not hide the stop behind a traceback
            log.warning("could not save the serving model in %s: %s", model_file.directory, err)

    @property
    def ready(self) -> bool:
        """Whether predictions can be served (a model is installed and the service is not stopping)."""
        return self.predictor is not None and not self._stopping.is_set()

    def _take_default_class(self, predictor: OnlinePredictor) -> None:
        """Rows that name no class (llm-d's never do) are of the class the first model learned them as, unless
        the settings name one: a model retrained on H200 rows and served from --model-dir would otherwise be
        asked about them as the default H100's."""
        s = self.settings
        theirs = predictor.config.accelerator, predictor.config.model
        ours = self.catalog.accelerator(s.accelerator).slug, self.catalog.model(s.model).slug
        if theirs == ours:
            return
        if {"accelerator", "model"} & s.model_fields_set:
            log.warning(
                "rows naming no class are taken as %s serving %s as the settings say; the model loaded learned "
                "them as %s serving %s",
                *ours,
                *theirs,
            )
            return
        try:
            parser = RowParser(*theirs, self.catalog)
        except FeatureError as err:
            log.warning(
                "rows naming no class are taken as %s serving %s: the model loaded learned them as %s serving %s, "
                "which this process does not know (%s); give it the catalog the model was trained with (--catalog)",
                *ours,
                *theirs,
                err,
            )
            return
        self.settings = s.model_copy(update={"accelerator": theirs[0], "model": theirs[1]})
        self.parser = parser
        log.info("rows naming no class are taken as %s serving %s, as the model loaded learned them", *theirs)

    def _learner_config(self) -> LearnerConfig:
        s = self.settings
        return LearnerConfig(
            accelerator=s.accelerator,
            model=s.model,
            quantile=s.quantile,
            window=s.window,
            retrain_every=s.retrain_every,
            seed=s.seed,
            background=False,
            catalog=self.catalog,
        )

    def _first_predictor(self) -> OnlinePredictor:
        """The newest shared model this build reads, else the one saved in --model-dir, else a fresh one (physics
        prior)."""
        if self._model_file is not None:
            # What is there now is known, whichever model serves: not another process's publication to take up
            # (noted only when no registry model served, a replica restarted into a fleet never saved its model
            # again, and published its stale file once it held the lease).
            self._model_file.note_current()
        try:
            latest = self.store.latest_model()
        except Exception as err:  # a store that is down must not stop the service from starting
            log.warning("cannot read the model registry at start: %s", err)
            latest = None
        if latest is not None:
            try:
                predictor = OnlinePredictor.from_bytes(latest[1], background=False)
                self.store_version = latest[0]
                self._adopt_cursor(predictor)
                self._check_model_dir_file()
                return predictor
            except ArtifactError as err:
                log.warning("ignoring published model %d: %s", latest[0], err)
                # The sync loop waits for a version newer than this one, whichever older one serves meanwhile.
                self._refused_version = latest[0]
                self._loop_errors["model_sync"] = f"published model {latest[0]} refused: {err}"
                older = self._older_published_predictor(latest[0], err)
                if older is not None:
                    self._check_model_dir_file()
                    return older
        model_dir = self.settings.model_dir
        if model_dir is not None and (model_dir / FILE_NAME).exists():  # an empty one: a first start
            try:
                predictor = OnlinePredictor.load(model_dir, background=False)
                # Its position goes on in the stream it was saved from (a restart on the same Redis, nothing
                # published: the whole stream was learned again), also when this start spells the URL otherwise
                # (`redis://h:6379` and `redis://h/0`); in another, or in a memory store, it means nothing.
                if same_stream(predictor.metadata.get(STREAM_KEY), self.store.stream):
                    self._adopt_cursor(predictor)
                else:
                    predictor.metadata.pop(CURSOR_KEY, None)
                learned = predictor.status()["observations"]
                log.info(
                    "loaded the model saved in %s (version %d; %d TTFT and %d TPOT observations learned)",
                    model_dir,
                    predictor.version,
                    learned["ttft"],
                    learned["tpot"],
                )
                return predictor
            except (ArtifactError, OSError) as err:
                log.warning(
                    "ignoring the model in %s: %s (it is moved aside, not written over, when this service first "
                    "saves its own there)",
                    model_dir,
                    err,
                )
                self._loop_errors["model_load"] = f"the model in {model_dir} was refused ({err}); serving a new one"
                if self._model_file is not None:
                    self._model_file.note_refused()
        return OnlinePredictor(self._learner_config())

    def _older_published_predictor(self, refused: int, why: ArtifactError) -> OnlinePredictor | None:
        """The newest of the older models the registry still keeps that this build reads, when it refused the newest
        (`refused`; a newer build's, after a rollback): a replica starting then goes on from where the fleet's model
        was, not from the prior learning the whole stream again. None if none loads (or the registry cannot tell)."""
        try:
            versions = sorted((v for v in self.store.model_versions() if v < refused), reverse=True)
        except Exception as err:  # a store that is down must not stop the service from starting
            log.warning("cannot read the model registry's older models at start: %s", err)
            return None
        for version in versions:
            try:
                artifact = self.store.model(version)
            except Exception as err:
                log.warning("cannot read published model %d at start: %s", version, err)
                return None
            if artifact is None:  # trimmed since it was listed
                continue
            try:
                predictor = OnlinePredictor.from_bytes(artifact, background=False)
            except ArtifactError as err:
                log.warning("ignoring published model %d as well: %s", version, err)
                continue
            self.store_version = version
            self._adopt_cursor(predictor)
            log.warning(
                "serving published model %d, the newest this build reads: the newest published, %d, is refused (%s); "
                "a newer one is taken up when published",
                version,
                refused,
                why,
            )
            return predictor
        return None

    def _check_model_dir_file(self) -> None:
        """With the registry's model serving at start, the --model-dir file is not loaded, but one this build
        refuses (a newer build's, after a rollback) is still moved aside rather than written over by our first
        save there (`ModelDirFile.note_refused`)."""
        model_dir = self.settings.model_dir
        if self._model_file is None or model_dir is None or not (model_dir / FILE_NAME).exists():
            return
        try:
            decode(load_file(model_dir))
        except (ArtifactError, OSError) as err:
            log.warning(
                "the model in %s is refused (%s): the registry's serves; it is moved aside, not written over, "
                "when this service first saves its own there",
                model_dir,
                err,
            )
            self._model_file.note_refused()

    def _install(self, predictor: OnlinePredictor) -> None:
        """Make `predictor` the serving one; close the one it replaces."""
        self._check_catalog(predictor)
        with self._swap_lock:
            old = self.predictor
            self.predictor = predictor
        if old is not None and old is not predictor:
            old.close()

    def _check_catalog(self, predictor: OnlinePredictor) -> None:
        """A model of another catalog (from a replica or a training server given another file, or a model directory
        written with one) is warned of once and named in /readyz while it serves: rows of a class this process lacks
        are refused, and a class stated otherwise is predicted from figures the model never learned from. A model
        of a catalog this one extends takes this one, and is saved with it: the classes it learns here go with it."""
        differences = self.catalog.differences(predictor.config.catalog)
        if differences and differences != self._catalog_differences:  # once, not at every model pulled or synced
            log.warning(
                "the model loaded was trained with another catalog (%s): give this process the same --catalog",
                "; ".join(differences),
            )
        self._catalog_differences = differences
        if not differences and predictor.config.catalog != self.catalog:
            predictor.adopt_catalog(self.catalog)

    def serving_artifact(self) -> tuple[bytes, str, int]:
        """(the serving model as an artifact, its SHA-256 in hex, its version), for gateways that predict with a
        copy of it (`GET /v1/model`).

        Encoding costs ~6 ms for a model with trees, and a new model is installed at most every
        `snapshot_interval_s`: it is encoded once per installed model however many gateways ask, and each asks
        only whether the digest it holds is still current.
        """
        predictor = self.predictor
        assert predictor is not None
        with self._artifact_lock:
            cached = self._artifact_cache
            if cached is None or cached[0] is not predictor or cached[1] != predictor.version:
                artifact = predictor.to_bytes()
                cached = (predictor, predictor.version, artifact, hashlib.sha256(artifact).hexdigest())
                self._artifact_cache = cached
        return cached[2], cached[3], cached[1]

    # --- the learner process --------------------------------------------------------------------------------

    def _start_learner(self) -> None:
        """Start a learner process from the serving model and the stream position that model has learned to."""
        predictor = self.predictor
        assert predictor is not None
        with self._learn_lock:
            self._stamp_position(predictor)
            artifact = predictor.to_bytes()
            self._cursor = self._served_cursor
            self._epoch += 1
            s = self.settings
            setup = ChildSetup(
                artifact=artifact,
                cursor=self._served_cursor,
                epoch=self._epoch,
                retrain=self.holds_lease,
                retrain_every=s.retrain_every,
                default_accelerator=s.accelerator,
                default_model=s.model,
                catalog=self.catalog,
                nice=s.background_nice,
                snapshot_interval_s=s.snapshot_interval_s,
                min_retrain_interval_s=s.min_retrain_interval_s,
                cpus=self.cpu_plan.learner if self.cpu_plan else None,
            )
            self.learner.start(setup)

    def begin_shutdown(self) -> None:
        """The process was told to stop (a signal): `stop` follows once the servers have wound down."""
        self._closing.set()

    def _on_learner_exit(self) -> None:
        """The learner process died: start another from what this process serves (no accepted data is lost:
        the stream is read again from the serving model's position).

        A learner that dies while the service shuts down is not a crash: Ctrl-C reaches the whole process group,
        and a learner still starting up has not yet set itself to ignore it.
        """
        if self._stop.is_set() or self._closing.is_set():
            return
        self._loop_errors["learner"] = "the learner process exited; restarting it"
        with self._counts_lock:
            self._close_lineage()
        if self._stop.wait(_RESTART_PAUSE_S) or self._closing.is_set():
            return
        log.warning("the learner process exited unexpectedly; starting another")
        # This runs on the dead learner's receiver thread, which ends here: a start that fails is tried again
        # after a pause (its traceback logged once per cause), not left to end the thread with no learner.
        while True:
            with self._loop_turn("learner_restart"):
                self._start_learner()
                break
            if self._stop.is_set() or self._closing.is_set():
                return
        self._loop_errors.pop("learner", None)

    def _on_snapshot(self, snapshot: Snapshot) -> None:
        """Runs on the learner's receiver thread: the snapshot becomes the serving model."""
        report = snapshot.report
        with self._swap_lock:
            if report.epoch != self._epoch:
                return  # made before an adoption or restart: its lineage is no longer ours
            mirror = OnlinePredictor.from_state(
                snapshot.state, background=False, reuse=self.predictor, compiled=snapshot.compiled
            )
            # A snapshot is no load: the learner's last winning retrain, else the serving model's own load time.
            loaded = self.predictor.last_model_load if self.predictor is not None else None
            mirror.last_model_load = report.last_model_load or loaded
            mirror.last_retrain = report.last_retrain
            mirror.retrain_error = report.retrain_error
            self._install(mirror)
            self._served_cursor = report.cursor
            with self._counts_lock:
                self._report = report
            # The report carries the learner's count of failed retrains since it started (a restarted one counts
            # from 0 again): what is new since the last report goes to the metrics.
            failures = report.retrain_failures
            if failures < self._retrain_failures_seen:
                self._retrain_failures_seen = 0
            if failures > self._retrain_failures_seen:
                self.metrics.observe_retrain_failure(failures - self._retrain_failures_seen)
                self._retrain_failures_seen = failures
        if snapshot.artifact is not None:
            for result in report.retrains:
                self._after_retrain(snapshot.artifact, result)

    # --- retraining and publication -------------------------------------------------------------------------

    def _after_retrain(self, artifact: bytes, result: dict[str, Any]) -> None:
        """Metrics, and publication if this replica holds the lease."""
        try:
            self.metrics.observe_retrain(result)
            accepted = any(
                isinstance(result.get(t), dict)
                and (result[t].get("accepted_mean") or result[t].get("accepted_upper") or result[t].get("accepted"))
                for t in ("ttft", "tpot")
            )
            if accepted and self.holds_lease:
                artifact = self._with_reached(artifact)
                with self._swap_lock:  # never interleaved with a retry of an older model's publication
                    self._unpublished = artifact  # until the store has it
                    self._publish_artifact(artifact)
        except LeaseLost as err:
            self._lease_refused(err)
        except ConnectionError as err:  # the store is down (StoreUnavailable): expected in an outage, retried
            self._retrain_error = f"{type(err).__name__}: {err}"
            # One line per outage, not a traceback per retrain: the lease loop publishes it once the store is back.
            if not self._publication_warned:
                self._publication_warned = True
                log.warning("the retrained model is not published yet (%s): published once the store is back", err)
        except Exception as err:  # never let a publication problem stop the receiver (a bug: keep its traceback)
            self._retrain_error = f"{type(err).__name__}: {err}"
            log.exception("after-retrain publication failed")

    def _with_reached(self, artifact: bytes) -> bytes:
        """A retrained model's artifact (the learner's, which knows nothing of lost streams) with `_reached` stamped
        as `_stamp_reached` says; decoded and encoded again only when that changes it."""
        if self._reached is None and REACHED_KEY.encode() not in artifact:
            return artifact
        state = decode(artifact)
        metadata = state.setdefault("metadata", {})
        before = metadata.get(REACHED_KEY)
        self._stamp_reached(metadata)
        return artifact if metadata.get(REACHED_KEY) == before else encode(state)

    def _retry_publication(self) -> None:
        """Publish the retrained model an outage kept from the store, so that the other replicas get it; and the
        serving model again when the registry lost what was published (`_republish_if_registry_lost`)."""
        self._republish_if_registry_lost()  # on every replica: whichever takes the lease next must know the cause
        if not self.holds_lease:
            return
        with self._swap_lock:
            artifact = self._unpublished
            if artifact is None:
                return
            try:
                self._publish_artifact(artifact)
            except LeaseLost as err:
                self._lease_refused(err)
            except Exception as err:
                self._retrain_error = f"{type(err).__name__}: {err}"

    def _republish_if_registry_lost(self) -> None:
        """The registry no longer holds the newest model published (or adopted) here: Redis restarted without
        persistence, was flushed, or its model keys were deleted or evicted. Replicas starting now would serve the
        untrained prior, and one of them may take the lease and number the prior's models from 1, below what the
        trained replicas hold (they would ignore them): the first replica to notice, holder or not, publishes the
        model it serves again, numbered on from the last version (`Store.restore_model`: only if no other did
        first). A retrained model the holder still waits to publish is published instead, by the caller.

        Every replica notes the store's count of server restarts whenever the registry still holds its model: the
        cause it names is then whether Redis restarted since it last saw the model there, right for whichever
        replica notices, including one that took the lease after an earlier restart was healed."""
        if self.store_version == 0 or self.predictor is None:
            return
        try:
            held = self.store.registry_version()
            if held is None:  # unreachable, or a new server the store has not counted yet: at the next renewal
                return
            restarts = self.store.stats().get("server_restarts", 0)  # after: counts the server that answered
            if held >= self.store_version:
                self._restarts_seen = restarts
                return
            if self.holds_lease and self._unpublished is not None:
                return
            lost = self.store_version
            artifact = self._stamped_artifact(self.predictor)
            with self._swap_lock:
                version = self.store.restore_model(artifact, lost)
                if version is None:  # another replica gave it back first, or the lineage went on
                    return
                self._note_published(version)
            restarted = restarts != self._restarts_seen
            cause = "Redis restarted without persistence" if restarted else "flushed, or its keys deleted or evicted"
            log.warning(
                "the model registry no longer held model %d (%s): published the serving model again as %d",
                lost,
                cause,
                version,
            )
            self._save_published(artifact, version)
        except Exception as err:  # down again: tried at the next renewal
            self._retrain_error = f"{type(err).__name__}: {err}"

    def publish(self, predictor: OnlinePredictor) -> int:
        """Publish to the shared registry (and --model-dir); our own sync loop then skips this version.

        The artifact records how far into the observation stream its state goes, so that a replica adopting it
        continues from there: nothing learned twice, nothing skipped.
        """
        return self._publish_artifact(self._stamped_artifact(predictor))

    def _stamped_artifact(self, predictor: OnlinePredictor) -> bytes:
        """`predictor`'s artifact with its position in the stream, taken while no batch is being forwarded."""
        with self._learn_lock:
            self._stamp_position(predictor)
            return predictor.to_bytes()

    def _stamp_position(self, predictor: OnlinePredictor) -> None:
        """Record in `predictor` how far into which stream it has learned (its learner's snapshots keep both)."""
        predictor.metadata[CURSOR_KEY] = self._served_cursor
        predictor.metadata[STREAM_KEY] = self.store.stream_name
        self._stamp_reached(predictor.metadata)

    def _stamp_reached(self, metadata: dict[str, Any]) -> None:
        """Record where the lineage stopped learning a stream that lost what it held (`_reached`), once its position
        is past it; else none (its position says it): another replica compares it with its own before adopting."""
        reached, cursor = self._reached, metadata.get(CURSOR_KEY)
        if reached is not None and isinstance(cursor, str) and cursor_order(cursor) > cursor_order(reached):
            metadata[REACHED_KEY] = reached
        else:
            metadata.pop(REACHED_KEY, None)

    def _lease_refused(self, err: LeaseLost) -> None:
        """The store refused a publication made as the lease's holder: the lease expired while this process could
        not renew it (paused past its TTL: a VM suspended, a stalled host), and another replica may hold it now.
        The model is not ours to publish; the lease is taken as lost, in one line, and the next renewal tells the
        learner to stop retraining (this runs on its receiver thread, which must not write to its pipe)."""
        with self._swap_lock:
            self._unpublished = None
            self._retrain_error = None
            self._publication_warned = False
        if self.holds_lease:
            self.holds_lease = False
            log.warning("lost the training lease (replica %s): %s", self.replica_id, err)

    def _publish_artifact(self, artifact: bytes) -> int:
        """Publish as the lease's holder (LeaseLost if the store finds the lease is no longer ours)."""
        with self._swap_lock:
            version = self.store.publish_model(artifact, holder=self.replica_id)
            self._note_published(version)
        self._save_published(artifact, version)
        return version

    def _note_published(self, version: int) -> None:
        """This replica published `version` (under _swap_lock)."""
        self._published.add(version)
        self.store_version = max(self.store_version, version)
        if self.store_version > self._refused_version:  # a refused version is behind what serves now
            self._loop_errors.pop("model_sync", None)
        # What is published now is at least as new as any retrain that could not be published before.
        self._unpublished = None
        self._retrain_error = None
        self._publication_warned = False  # the store took it: the next outage is worth a line again

    def _save_published(self, artifact: bytes, version: int) -> None:
        """Also in --model-dir, unless another process published a model there since."""
        if self._model_file is not None:
            if self._model_file.save(artifact):
                self._loop_errors.pop("model_load", None)
            else:
                log.warning(
                    "not saving model %d in %s: another process published a model there since (taken up next)",
                    version,
                    self._model_file.directory,
                )

    def sync_from_store(self) -> tuple[bool, bool]:
        """Swap in the newest published model if it is newer than ours: (synced, loaded). Raises if the registry
        cannot be reached (/reload answers 503; the sync loop names it in health)."""
        latest = self.store.read_latest_model()
        if latest is None:
            return True, False
        version, artifact = latest
        with self._swap_lock:
            if self._known_version(version):
                return True, False
            try:
                # The trees that are the same text as the serving model's are kept, not parsed again: most of a
                # load's cost (~140 ms against ~10 ms), and with --model-from a new model comes every second while
                # the training server learns, its trees changing only at a retrain.
                predictor = OnlinePredictor.from_bytes(artifact, background=False, reuse=self.predictor)
            except ArtifactError as err:
                # Keep serving the current model; do not retry this version, wait for a newer one.
                self._refused_version = max(self._refused_version, version)
                self._loop_errors["model_sync"] = f"published model {version} refused: {err}"
                log.warning("ignoring published model %d: %s (the model held serves on)", version, err)
                raise
        try:
            behind = self._behind_a_lost_stretch(predictor)
        except BaseException:
            predictor.close()
            raise
        if behind is not None:
            predictor.close()
            self._publish_ours_over(version, *behind)
            return True, False
        # _learn_lock first, then _swap_lock, never the other way: ingest holds _learn_lock while its batch waits
        # for the learner to read its pipe, the learner may be blocked sending a snapshot to the receiver thread,
        # and the receiver needs _swap_lock to install it. Waiting for _learn_lock with _swap_lock held closed
        # that cycle (and stopped serving, learning and syncing for good).
        with self._learn_lock:
            with self._swap_lock:
                if self._known_version(version):  # another caller (the loop, /reload) swapped it in meanwhile
                    predictor.close()
                    return True, False
                self._install(predictor)
                if self._model_pull is not None:
                    # A pulled model brings its class of rows naming none (refused if the settings name another):
                    # taken as one loaded at start is, under the same lock as the swap and after it, so that a
                    # request (it reads the parser, then the model) never has the new class read by the old model.
                    # A shared registry's models are all of the class the replicas took at start.
                    self._take_default_class(predictor)
                self._adopt_cursor(predictor)
                self._served_cursor = self._cursor
                self._epoch += 1
                epoch, cursor = self._epoch, self._cursor
                with self._counts_lock:
                    self._close_lineage()
                self.store_version = version
                self._loop_errors.pop("model_sync", None)
                self._unpublished = None  # another replica's newer model replaces ours
                self._retrain_error = None
            # Tell the learner with only _learn_lock held (no batch can overtake this message), not _swap_lock:
            # the receiver needs that one to take the learner's next snapshot, and a learner blocked sending a
            # snapshot does not read what we send.
            self.learner.adopt(artifact, cursor, epoch)
        self.metrics.model_swaps.inc()
        return True, True

    def _behind_a_lost_stretch(self, predictor: OnlinePredictor) -> tuple[str, str] | None:
        """(its position, ours) if adopting `predictor`, a published model, would lose rows for good: it has learned
        our stream only to a position behind ours, and the stream no longer holds any row between (Redis restarted
        without persistence, or was flushed: a replica behind noticed the empty registry first and published its
        model again). This replica learned those rows, and their writers forgot them once they read them back, so
        only its model holds them. Else None: behind, and the stream still holds what lies between (the usual case,
        a holder's retrain that is a little older), the rows are read again after the adoption. ConnectionError if
        the store cannot tell."""
        theirs, ours = predictor.metadata.get(CURSOR_KEY), self._served_cursor
        if not isinstance(theirs, str) or not same_stream(predictor.metadata.get(STREAM_KEY), self.store.stream):
            return None
        # Where each stopped learning a stream that lost what it held comes first: past it, both positions are in
        # the new stream, and one ahead there may lack rows the other learned before the loss.
        pairs = [(theirs, ours)]
        theirs_reached, ours_reached = (
            reached_at(theirs, predictor.metadata.get(REACHED_KEY)),
            reached_at(ours, self._reached),
        )
        if (theirs_reached, ours_reached) != (theirs, ours):
            pairs.insert(0, (theirs_reached, ours_reached))
        for theirs_at, ours_at in pairs:
            if cursor_order(theirs_at) >= cursor_order(ours_at):
                continue
            _after, between = self.store.read_observations(theirs_at, 1, until=ours_at)
            if between:
                continue
            if self.store.stream_end() is None:  # an outage reads as an empty stretch: not taken for a loss
                raise ConnectionError(
                    "cannot tell whether the observation stream still holds what a model has not learned"
                )
            return theirs_at, ours_at
        return None

    def _publish_ours_over(self, version: int, theirs: str, ours: str) -> None:
        """Published model `version` is behind this replica across rows the stream lost (`_behind_a_lost_stretch`):
        publish the serving model above it instead (only if nothing newer came meanwhile, `Store.restore_model`;
        no lease needed, as for a registry's loss), so that every replica adopts the model furthest ahead. Noted as
        known, so that it is not looked at again; a newer one is."""
        assert self.predictor is not None
        artifact = self._stamped_artifact(self.predictor)
        with self._swap_lock:
            self.store_version = max(self.store_version, version)
            published = self.store.restore_model(artifact, version + 1)
            if published is None:  # another came first: the sync loop looks at it next
                return
            self._note_published(published)
        log.warning(
            "not adopting published model %d: it has learned the observation stream up to %s, this replica up to %s, "
            "and the stream no longer holds the rows between (Redis lost them): published this replica's model as %d "
            "instead",
            version,
            theirs,
            ours,
            published,
        )
        self._save_published(artifact, published)

    def _known_version(self, version: int) -> bool:
        """Whether a published `version` is not news (under _swap_lock): not newer than the one held, or this
        replica's own publication (then noted as held)."""
        if version <= self.store_version:
            return True
        if version in self._published:
            self.store_version = version
            return True
        return False

    @property
    def _writes_model_dir(self) -> bool:
        """Whether this server saves its model in --model-dir: not a prediction server. It learns nothing, and the
        observations its model counts are its training server's: a copy written back was taken up there as another
        process's model, the training server going back to what it had saved last and dropping what it had learned
        since."""
        return self.settings.serves_training

    def _save_now_and_then(self) -> None:
        """With --model-dir, the model is saved every `model_save_interval_s` while it learns, not only when it is
        published (every `retrain_every` rows, if a retrain wins) or at a clean stop: a crash loses at most that."""
        model_file, predictor = self._model_file, self.predictor
        now = time.monotonic()
        if model_file is None or predictor is None or not self._writes_model_dir:
            return
        if now - self._saved_at < self.settings.model_save_interval_s:
            return
        self._saved_at = now
        learned = self.learned()
        if learned == self._saved_learned:
            return
        try:
            if model_file.save(self.serving_artifact()[0]):
                self._saved_learned = learned
                self._loop_errors.pop("model_load", None)  # a good model is there now (one refused moved aside)
        except Exception as err:  # the directory was checked at start; say it, keep serving
            log.warning("could not save the serving model in %s: %s", model_file.directory, err)

    def sync_model_dir(self) -> bool:
        """Take up a model another process published to --model-dir (`leadtime retrain --registry DIR`): it is
        published to the store as any replica's would be, and every replica swaps it in (the sync loop, or
        `/reload` at once). It continues from this service's stream position: the position in its file belongs
        to the stream of whichever process wrote it. Only the lease holder does it (the one process that publishes,
        so that replicas sharing a directory publish it once), or a process alone in its store (no Redis) that
        does not train: a prediction server beside a training server that saves to the same directory, as llm-d
        runs its two. True if one was taken up."""
        model_file = self._model_file
        alone = self.settings.redis_url is None and not self.settings.serves_training
        if model_file is None or not (self.holds_lease or alone):
            return False
        with self._model_dir_lock:
            return self._take_up_model_dir(model_file)

    def _take_up_model_dir(self, model_file: ModelDirFile) -> bool:
        """`sync_model_dir`'s take-up, under its lock."""
        try:
            read = model_file.changed()
        except OSError as err:
            self._loop_errors["model_load"] = f"cannot read the model in {model_file.directory}: {err}"
            return False
        if read is None:
            return False
        # Noted as known (not looked at again until it changes) once refused or published: a publication that
        # fails (the store down, the lease lapsed) leaves it to be taken up at a later turn, and it is not written
        # over meanwhile (a save finds it changed).
        try:
            predictor = OnlinePredictor.from_bytes(read.data, background=False)
        except ArtifactError as err:
            log.warning("ignoring the model another process wrote to %s: %s", model_file.directory, err)
            self._loop_errors["model_load"] = f"the model in {model_file.directory} was refused ({err})"
            model_file.note(read)
            model_file.note_refused()  # moved aside, not written over, by this service's next save
            return False
        predictor.metadata.pop(CURSOR_KEY, None)
        try:
            # As the lease's holder when it took it up as one; a process alone in its store holds no lease.
            version = self.store.publish_model(
                predictor.to_bytes(), holder=self.replica_id if self.holds_lease else None
            )
        except LeaseLost as err:
            self._lease_refused(err)
            return False
        except Exception as err:
            self._loop_errors["model_load"] = f"cannot publish the model in {model_file.directory}: {err}"
            return False
        model_file.note(read)
        self._loop_errors.pop("model_load", None)
        log.info(
            "taking up the model another process wrote to %s (its version %d, published as %d)",
            model_file.directory,
            predictor.version,
            version,
        )
        return True

    def _close_lineage(self) -> None:
        """The learner's lineage ends (restart or adoption): keep what its serving snapshot had counted (under
        _counts_lock). Rows it learned after that snapshot are read and learned again by the next one."""
        if self._report is not None:
            self._learned_before += self._report.learned
            self._invalid_before += self._report.invalid
            self._implausible_before += self._report.implausible
        self._report = None
        self._forwarded = 0  # what it held unreported is read from the store again

    def _mark_replay(self) -> None:
        """Before anything is accepted: note where the stream ends, so that the rows before it (an earlier
        process accepted them; this one reads them from its model's position) are counted as replayed, not as
        accepted here. A store that cannot tell now (Redis down) leaves them uncounted."""
        try:
            end = self.store.stream_end()
        except Exception as err:
            log.warning("cannot tell where the observation stream ends: %s", err)
            end = None
        if end is not None and cursor_order(end) > cursor_order(self._cursor):
            self._replay_until, self._replay_counted = end, self._cursor
        self._replay_marked, self._stream_end_at_start = True, end

    def _replay_bound(self, cursor: str) -> tuple[str | None, bool]:
        """(where a read from `cursor` must stop, whether its rows are replayed ones not counted yet): read
        again after a learner restart, rows are counted once; past the stream's end at start, nothing is."""
        until = self._replay_until
        if until is None:
            return None, False
        at = cursor_order(cursor)
        if at < cursor_order(self._replay_counted):
            return self._replay_counted, False
        if at < cursor_order(until):
            return until, True
        self._replay_until = None
        return None, False

    def _adopt_cursor(self, predictor: OnlinePredictor) -> None:
        cursor = predictor.metadata.get(CURSOR_KEY)
        if isinstance(cursor, str):
            self._cursor = cursor
        reached = predictor.metadata.get(REACHED_KEY)  # the adopted lineage's, with its position
        self._reached = reached if isinstance(reached, str) else None

    # --- loops ----------------------------------------------------------------------------------------------

    @contextmanager
    def _loop_turn(self, loop: str) -> Iterator[None]:
        """One turn of a background loop. An unexpected exception (a bug, or content no check foresaw) must not end
        the thread: one that did took every later registry sync and --model-dir save with it, for the life of the
        process. It is named in /readyz until a turn goes through, its traceback logged once per cause (type and
        where it was raised: not at every turn of a loop that meets it each time), and the loop goes on after a
        pause."""
        key = f"{loop}_loop"
        try:
            yield
        except Exception as err:
            self._loop_errors[key] = f"unexpected error, the loop goes on: {type(err).__name__}: {err}"
            where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ is not None else None
            cause = (type(err).__name__, where.filename if where else "", (where.lineno or 0) if where else 0)
            logged = self._loop_causes.setdefault(loop, set())
            if cause not in logged:
                logged.add(cause)
                log.exception("unexpected error in the %s loop (it goes on; this cause is not logged again)", loop)
            self._stop.wait(_LOOP_ERROR_PAUSE_S)
        else:
            self._loop_errors.pop(key, None)

    def _ingest_loop(self) -> None:
        while not self._stop.is_set():
            with self._loop_turn("ingest"):
                self._ingest_turn()

    def _ingest_turn(self) -> None:
        """Forward the next batch of accepted observations to the learner (one turn of the ingest loop)."""
        try:
            cursor_before = self._cursor
            until, replayed = self._replay_bound(cursor_before)
            cursor, entries = self.store.read_observations(cursor_before, self.settings.ingest_batch, until)
            self._loop_errors.pop("ingest", None)
        except Exception as err:
            self._loop_errors["ingest"] = f"cannot read observations: {err}"
            self._stop.wait(0.5)
            return
        losses = self.store.stream_losses()
        if losses != self._stream_losses_seen:
            # The first read of the new stream (this one, or another that came first): nothing read here before it
            # came from there, so this lineage learned the lost stream up to where this read began.
            with self._learn_lock:
                self._stream_losses_seen = losses
                if cursor_before == self._cursor:  # else a model adopted meanwhile brought its own
                    self._reached = cursor_before
        if not entries:
            if until is not None and all(v == "ok" for v in self.store.health().values()):
                if replayed:
                    self._replay_until = None  # nothing left before the stream's end at start: trimmed
                else:
                    # Read again after a learner restart, up to the rows counted already, and those were
                    # trimmed from the stream meanwhile: none is left to count twice, and the rest of the
                    # replay, up to `_replay_until`, is still to be counted.
                    self._replay_counted = cursor_before
            self._stop.wait(0.02)
            return
        with self._learn_lock:
            if cursor_before != self._cursor:
                return  # a model adopted meanwhile moved the cursor: these entries are read again or known
            if self.learner.learn(cursor_before, cursor, entries):
                self._cursor = cursor
                with self._counts_lock:
                    self._forwarded += len(entries)
                    if replayed:
                        self._replayed += len(entries)
                        self._replay_counted = cursor
                return
        self._stop.wait(0.1)  # the learner process is gone; it is being restarted

    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            with self._loop_turn("model_sync"):
                self._sync_turn()

    def _sync_turn(self) -> None:
        """Take up --model-dir's model, save ours now and then, swap in a newer published one (one turn)."""
        self.sync_model_dir()
        self._save_now_and_then()
        try:
            newer = self.store.wait_for_model(max(self.store_version, self._refused_version), 0.5)
            self._loop_errors.pop("model_registry", None)
            if newer is not None:
                self.sync_from_store()
        except ArtifactError:
            pass  # recorded by sync_from_store; the loop waits for a newer version
        except OSError as err:  # the store's outages (StoreUnavailable is a ConnectionError); the rest is a bug
            self._loop_errors["model_registry"] = f"cannot reach the model registry: {err}"
            self._stop.wait(0.5)

    def _pull_loop(self) -> None:
        """Pull --model-from's model every `_PULL_INTERVAL_S`; a new one is published to this process's store, and
        the model sync swaps it in (version, `last_model_load`, metrics, the learner told) as it swaps in any
        published model. While pulls fail the model held keeps serving (`health` names the failure)."""
        pull = self._model_pull
        assert pull is not None
        with pull.client() as client:
            while not self._stop.is_set():
                with self._loop_turn("model_pull"):
                    self._pull_model(client)
                self._stop.wait(_PULL_INTERVAL_S)

    def _pull_model(self, client: httpx.Client) -> tuple[str, str]:
        """One pull of --model-from's model, the loop's or /reload's (one at a time: both update the pull's state):
        (what it did, one of `PULL_RESULTS`; why pulls fail now, "" if they do not). A new model is published to
        this process's store, which the model sync swaps in."""
        pull = self._model_pull
        assert pull is not None
        with self._pull_lock:
            first = not pull.digest
            result, artifact = pull.pull_once(client)
            if artifact is not None:
                self.store.publish_model(artifact)  # this process's own memory store: it takes it
                if first:  # the ones after it come every second while the training server learns: no line
                    log.info("the first model pulled from %s serves from now on", pull.url)
            self.metrics.model_pulls.labels(result).inc()
            return result, pull.failure

    def pull_model_now(self) -> tuple[str, str] | None:
        """/reload with --model-from: pull now rather than at the loop's next pull, so that the model the source
        serves now is the one installed when /reload answers (the caller swaps it in). (what the pull did, why it
        failed), or None without --model-from."""
        pull = self._model_pull
        if pull is None:
            return None
        with pull.client() as client:
            return self._pull_model(client)

    def _check_pulled(self, data: bytes) -> bytes:
        """A pulled artifact as this process publishes it, or ArtifactError refusing it: not an artifact of this
        build or not matching its checksum, or of another class of rows naming none than the settings name (as
        a model directory's is refused at start). With no class named, the training server's is followed, but
        only once its model is installed (`sync_from_store`): switched here, in the pull thread, requests would be
        parsed as the new class and predicted by the old model until then. Its stream position is dropped: it
        belongs to the training server's stream, not to this process's."""
        document = decode(data)
        config = document["config"]
        try:
            known = self.catalog
            theirs = known.accelerator(str(config.get("accelerator"))).slug, known.model(str(config.get("model"))).slug
        except FeatureError as err:
            raise ArtifactError(f"its class is not one this process knows ({err})") from None
        s = self.settings
        ours = known.accelerator(s.accelerator).slug, known.model(s.model).slug
        if theirs != ours and self._class_named:
            raise ArtifactError(
                f"it takes rows naming no class as {theirs[0]} serving {theirs[1]}; --accelerator and --model "
                f"say {ours[0]} serving {ours[1]}"
            )
        metadata = document.get("metadata")
        if isinstance(metadata, dict):
            metadata.pop(CURSOR_KEY, None)
            metadata.pop(STREAM_KEY, None)
        return encode(document)

    def _pull_health(self) -> str | None:
        """What /readyz says of --model-from: nothing while pulls succeed; the prior serving before the first
        model arrives; a failure, and what serves meanwhile."""
        pull = self._model_pull
        if pull is None:
            return None
        age = pull.age_s()
        if pull.failure:
            if pull.digest and age is not None:
                return f"failing ({pull.failure}); keeping the model held, last pulled {age:.0f} s ago"
            return f"failing ({pull.failure}); no model pulled yet, serving the physics prior"
        if not pull.digest:
            return f"no model pulled yet from {pull.url}: serving the physics prior"
        return None

    def _lease_loop(self) -> None:
        period = self.settings.lease_ttl_s / 3
        while not self._stop.wait(period):
            with self._loop_turn("lease"):
                self._renew_lease()
                self._retry_publication()

    def _renew_lease(self) -> None:
        if not self.settings.serves_training:
            held = False
        else:
            try:
                held = self.store.acquire_training_lease(self.replica_id, self.settings.lease_ttl_s)
                self._loop_errors.pop("lease", None)
            except ConnectionError as err:  # the store's own words: "cannot take or renew ...: redis unreachable"
                self._loop_errors["lease"] = str(err)
                held = False
            except Exception as err:
                self._loop_errors["lease"] = f"cannot take or renew the training lease: {err}"
                held = False
        if held != self.holds_lease:
            self.holds_lease = held
            # Which replica retrains and publishes is worth one line each time it changes hands; losing it says
            # why, as far as this replica can tell: the store away (it raised), else another replica holds it (a
            # pause past its TTL).
            if held:
                log.info("took the training lease (replica %s)", self.replica_id)
            else:
                why = self._loop_errors.get("lease") or (
                    f"another replica holds it: this one did not renew it within {self.settings.lease_ttl_s:g} s "
                    "(paused, or starved of CPU)"
                )
                log.warning("lost the training lease (replica %s): %s", self.replica_id, why)
        if held != self.learner.retrain:  # also after a refused publication dropped the lease (`_lease_refused`)
            # Only the lease holder retrains (on schedule or drift); the others learn online and adopt its models.
            self.learner.set_lease(held, self.settings.retrain_every)

    # --- accepting ------------------------------------------------------------------------------------------

    def accept(self, entries: list[dict[str, Any]], actual_ttft: np.ndarray, actual_tpot: np.ndarray) -> None:
        """Append validated entries to the store and count them into the llm-d train/test split."""
        self.store.append_observations(entries)
        every = self.settings.test_every
        with self._counts_lock:
            self._accepted_rows += len(entries)
            s = self.samples
            # Every `every`-th accepted sample, by arrival, counts as test data (as llm-d holds some out).
            arrival = np.arange(s.seen, s.seen + len(entries))
            is_test = arrival % every == every - 1
            s.seen += len(entries)
            for target, actual in (("ttft", actual_ttft), ("tpot", actual_tpot)):
                observed = actual > 0
                n_test = int((observed & is_test).sum())
                s.test[target] += n_test
                s.train[target] += int(observed.sum()) - n_test

    def record_live_errors(self, parsed: ParsedObservations) -> None:
        """Live error and quantile coverage of what was predicted for these observations, per target.

        Only of the rows the learner will learn: one the poisoning guard drops (`physics.implausible`) is no
        measurement, and its error (a nanosecond TTFT against a 50 ms prediction is 5e7) would swamp the metric."""
        rows = parsed.rows
        kept = ~physics.implausible(rows.X, parsed.actual_ttft_ms, parsed.actual_tpot_ms)
        accelerators, roles = rows.accelerators, rows.roles
        if not kept.all():
            accelerators = [a for a, k in zip(accelerators, kept.tolist(), strict=True) if k]
            roles = [r for r, k in zip(roles, kept.tolist(), strict=True) if k]
        for target, actual, predicted, quantile in (
            ("ttft", parsed.actual_ttft_ms, parsed.predicted_ttft_ms, parsed.predicted_ttft_quantile_ms),
            ("tpot", parsed.actual_tpot_ms, parsed.predicted_tpot_ms, parsed.predicted_tpot_quantile_ms),
        ):
            self.metrics.observe_live_error(target, actual[kept], predicted[kept], quantile[kept], accelerators, roles)

    def flush_samples(self, training: bool, test: bool) -> dict[str, int]:
        """Take the sample counts asked for off (how many each held); with the training data, also empty the
        learner's window and read past the rows accepted before the flush that still wait to be learned, so that
        the answer, the counts and the window agree. Emptying the window alone, rows waiting in the store (a
        burst is learned behind the answers) were learned into it afterwards, after the answer had counted them
        as flushed and /data/status said 0.

        The learner first learns the batches already forwarded to it, then empties its window and goes on from
        the stream's end as it was at the flush; the rows before that end it never learns are counted as
        `dropped.flushed` in `ingestion`. A request accepted while the flush runs may be learned or not. It
        flushes this replica's learner: replicas sharing a Redis stream learn those rows all the same, and a
        model published by the lease holder brings its window with it when adopted (the holder's flush reaches
        the others that way). FlushRefused when the store cannot say where its stream ends or the learner does
        not take the request: then nothing was flushed."""
        if not training:
            taken = self._sample_counts(False, test)
            self._take_off(taken, 0)
            return taken
        # No batch forwarded, and no model adopted, while the cursor moves. The ingest loop holds the lock while the
        # learner's pipe is full (a backlog being learned): bounded, as the wait for the pipe is.
        if not self._learn_lock.acquire(timeout=_FLUSH_WAIT_S):
            raise FlushRefused("the learner is busy taking a backlog; retry")
        try:
            self.store.flush(_FLUSH_WAIT_S)  # what was accepted before is in the stream (Redis: sent)
            try:
                end = self.store.stream_end()
            except Exception as err:
                raise FlushRefused(f"the store cannot say where its observation stream ends: {err}") from None
            if end is None:
                raise FlushRefused("the store cannot say where its observation stream ends (it does not answer)")
            if cursor_order(end) < cursor_order(self._cursor):  # a Redis that restarted empty: nothing to skip
                end = self._cursor
            taken = self._sample_counts(True, test)
            if not self.learner.flush_window(end):
                raise FlushRefused("the learner process did not take the request (busy or restarting); retry")
            self._take_off(taken, self._skip_backlog(end))
        finally:
            self._learn_lock.release()
        return taken

    def _sample_counts(self, training: bool, test: bool) -> dict[str, int]:
        """The sample counts /flush answers, as they are now (0 for those not asked for)."""
        with self._counts_lock:
            train, held_out = self.samples.train, self.samples.test
            return {
                "ttft_training": train["ttft"] if training else 0,
                "tpot_training": train["tpot"] if training else 0,
                "ttft_test": held_out["ttft"] if test else 0,
                "tpot_test": held_out["tpot"] if test else 0,
            }

    def _take_off(self, taken: dict[str, int], skipped: int) -> None:
        """Take flushed counts off rather than zero them: rows accepted since they were read stay counted."""
        with self._counts_lock:
            for target in ("ttft", "tpot"):
                self.samples.train[target] -= taken[f"{target}_training"]
                self.samples.test[target] -= taken[f"{target}_test"]
            self._flushed_rows += skipped

    def _skip_backlog(self, end: str) -> int:
        """Read the stream from where batches were last forwarded up to `end` without forwarding it, and go on from
        `end` (the learner was told so); how many rows were read past (under _learn_lock). Read rather than jumped
        over: the memory store counts a row pending until it is read, and rows an earlier process accepted are
        counted as replayed as they are read (`_replay_bound`)."""
        cursor, skipped = self._cursor, 0
        try:
            while cursor_order(cursor) < cursor_order(end):
                until, replayed = self._replay_bound(cursor)
                if until is None or cursor_order(until) > cursor_order(end):
                    until = end
                after, entries = self.store.read_observations(cursor, self.settings.ingest_batch, until)
                if after == cursor:  # nothing readable (trimmed meanwhile, or the store went away): gone past
                    break
                skipped += len(entries)
                if replayed:
                    with self._counts_lock:
                        self._replayed += len(entries)
                        self._replay_counted = after
                cursor = after
        finally:
            self._cursor = end  # where the learner takes the next batch from, whatever was read
        return skipped

    def backlog_full(self) -> bool:
        """Whether rows offered now would be dropped (the native API then answers 429 instead of accepting)."""
        try:
            return bool(self.store.stats().get("full", 0))
        except Exception:
            return False

    def ingestion(self) -> dict[str, Any]:
        """What became of the accepted rows: learned, thinned (evenly, to keep up), dropped per reason, pending.

        Learned is the rows the serving model has learned over its life (`learned_rows`), whoever learned them: an
        earlier process, or the replica that published a model adopted here; with a shared store it follows the
        stream. Learned here counts the rows this process's learner has learned, a row learned again (after an
        adoption moved the position back, or a learner restart) again: a counter that never goes down.
        Pending counts the rows waiting in the store and those handed to the learner that it has not reported
        yet. Replayed counts the rows an earlier process accepted into the shared stream that this one read back
        at start (from its model's position) to learn: they were not accepted here. With one replica,
        accepted + replayed = learned_here + thinned + dropped + pending (to within the batch moving between the
        two as this reads them). With a shared store each replica learns every replica's rows.
        """
        try:
            stats = self.store.stats()
        except Exception:
            stats = {}
        with self._counts_lock:
            report = self._report
            in_lineage = (report.learned + report.invalid + report.implausible) if report is not None else 0
            in_learner = max(0, self._forwarded - in_lineage)
            learned_here = self._learned_before + (report.learned if report is not None else 0)
            invalid = self._invalid_before + (report.invalid if report is not None else 0)
            implausible = self._implausible_before + (report.implausible if report is not None else 0)
            accepted = self._accepted_rows
            replayed = self._replayed
            flushed = self._flushed_rows
            marked, end_at_start = self._replay_marked, self._stream_end_at_start
        if marked:  # rows an earlier stop kept, yet to be sent or landed past where the replay's reads stop
            replayed += self.store.kept_after(end_at_start)
        predictor = self.predictor
        learned = learned_rows(predictor) if predictor is not None else 0
        dropped = {k[len("dropped_") :]: int(v) for k, v in stats.items() if k.startswith("dropped_")}
        if not dropped:  # a store that counts its drops without reasons (the Redis store's outage buffer)
            dropped["store_buffer"] = int(stats.get("dropped", 0))
        dropped["invalid"] = invalid
        dropped["implausible"] = implausible  # the poisoning guard (physics.implausible)
        dropped["flushed"] = flushed  # read past by /flush before they were learned
        stride = int(stats.get("thinning_stride", 1))
        return {
            "accepted": accepted,
            "replayed": replayed,
            "learned": learned,
            "learned_here": learned_here,
            "thinned": {"overload": int(stats.get("thinned", 0))},
            "dropped": dropped,
            "pending": int(stats.get("pending", stats.get("buffered", 0))) + in_learner,
            "thinning": stride > 1,
            "learning_one_in": stride,
            "full": bool(stats.get("full", 0)),
        }

    # --- introspection --------------------------------------------------------------------------------------

    def health(self) -> dict[str, str]:
        """Component → "ok" or why it is degraded."""
        out: dict[str, str] = {}
        try:
            out.update(self.store.health())
        except Exception as err:
            out["store"] = f"health check failed: {err}"
        predictor = self.predictor
        out["predictor"] = "ok" if predictor is not None else "not started"
        if predictor is not None and predictor.retrain_error is not None:
            out["retrain"] = f"last retrain failed: {predictor.retrain_error}"
        if predictor is not None and not self.learner.alive and not self._stop.is_set():
            out.setdefault("learner", "the learner process is not running")
        out.update(self._loop_errors)
        pulling = self._pull_health()
        if pulling is not None:
            out["model_pull"] = pulling
        for thread in self._threads:
            if not thread.is_alive() and not self._stop.is_set():
                out[thread.name] = "background loop stopped"
        if self._retrain_error is not None:
            out["publication"] = self._retrain_error
        if self._catalog_differences:
            out["catalog"] = (
                f"the model serving was trained with another catalog ({'; '.join(self._catalog_differences)}): "
                "give this process the same --catalog"
            )
        ingestion = self.ingestion()
        if ingestion["full"]:
            out["ingestion"] = f"backlog full: {ingestion['pending']} rows wait to be learned; new rows are dropped"
        elif ingestion["thinning"]:
            out["ingestion"] = (
                f"thinning: learning 1 in {ingestion['learning_one_in']} accepted rows, evenly over time, to keep up "
                f"({ingestion['pending']} rows wait)"
            )
        return out

    def live_values(self) -> dict[str, Any]:
        """Values metrics read at scrape time."""
        predictor = self.predictor
        values: dict[str, Any] = {"learned": self.learned(), "quantile": self.settings.quantile}
        if predictor is not None:
            values["model_version"] = predictor.version
            values["window"] = dict(self.model_status().get("window", {}))
            changed = predictor.changed_at
            # Never negative: a changed_at a little ahead (kept at load, up to `CHANGED_AT_AHEAD_KEPT`), or the wall
            # clock stepped back since, reads as just changed.
            if changed is not None:
                values["model_age_seconds"] = max(0.0, time.time() - changed.timestamp())
            else:
                values["model_age_seconds"] = time.monotonic() - self._started_monotonic
        try:  # the stores answer health() from state they keep, without a round trip
            values["store_up"] = {name: int(reason == "ok") for name, reason in self.store.health().items()}
        except Exception:
            values["store_up"] = {"store": 0}
        try:
            stats = self.store.stats()
            values["buffered"] = stats.get("buffered", 0)
        except Exception:
            pass
        values["ingestion"] = self.ingestion()
        return values

    def learned(self) -> dict[str, int]:
        """Observations the serving model has learned from, per target: this replica's learning and, once it
        adopted a published model, what the publisher had learned (the same stream, read by every replica)."""
        predictor = self.predictor
        if predictor is None:
            return {"ttft": 0, "tpot": 0}
        return {t: int(n) for t, n in predictor.status()["observations"].items()}

    def model_status(self) -> dict[str, Any]:
        """The serving model's status, with what only the learner process knows (its window) filled in."""
        predictor = self.predictor
        if predictor is None:
            return {}
        status = predictor.status()
        with self._counts_lock:
            report = self._report
        if report is not None:
            status["window"] = dict(report.window)
        return status


def reached_at(cursor: str, reached: object) -> str:
    """How far a lineage at `cursor` learned the stream before it lost what it held: `reached` (the metadata's or a
    runtime's record of where it stopped) once the lineage is past it, else its position.

    >>> reached_at("1700000009000-0", "1700000005000-3"), reached_at("1700000004000-0", "1700000005000-3")
    ('1700000005000-3', '1700000004000-0')
    >>> reached_at("12", None)
    '12'
    """
    if isinstance(reached, str) and cursor_order(cursor) > cursor_order(reached):
        return reached
    return cursor


def served_ms(values: np.ndarray) -> list[float]:
    """Predicted milliseconds as answers carry them (`predictor.client.served`)."""
    out: list[float] = served(values).tolist()
    return out


def rfc3339(moment: datetime | None) -> str | None:
    """A moment as RFC 3339 with its offset, or None."""
    return moment.isoformat() if moment is not None else None
