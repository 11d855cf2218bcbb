"""Learning in a child process, so that learning and retraining never take the serving process's GIL.

A Python process runs one thread at a time: a learner thread beside the handlers slows every request that
overlaps it (measured: 100-row p99 from ~4–6 to 7–15 ms while a backlog was learned and trees retrained). Here
the learning `OnlinePredictor` lives in a child process at a lower CPU priority. The service forwards each
batch it reads from the observation stream together with the stream positions before and after it; the child
learns it and, at most every `snapshot_interval_s` (and after every retrain), sends back its model's state (what
an artifact holds, not yet JSON-encoded) with the stream position it has learned to and the trees' compiled
forms. The service swaps that in as its serving predictor, keeping already-parsed LightGBM boosters whose text
did not change; for a snapshot it never encodes or parses JSON, parses LightGBM text or compiles trees.

A batch whose "before" position is not where the child stands is dropped: it was read before the service
adopted another model (with its own position), and the service reads the stream again from there. If the child
dies, the service starts a new one from the model it serves and reads the stream again from that model's
position, so no accepted observation is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from multiprocessing.connection import Connection
from typing import Any

import orjson

from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.errors import FeatureError, ReasonsSaid
from leadtime.predictor import physics
from leadtime.predictor.artifact import encode
from leadtime.predictor.learner import CHANGED_AT_AHEAD, OnlinePredictor
from leadtime.predictor.service.cpus import pin_process
from leadtime.predictor.service.rows import RowParser
from leadtime.predictor.trees import CompiledTrees

log = logging.getLogger("leadtime.service")

CURSOR_KEY = "stream_cursor"  # artifact metadata: the observation-stream position the model has learned to
STREAM_KEY = "stream"  # artifact metadata: which stream that position is in (`Store.stream_name`)
REACHED_KEY = "stream_reached"  # artifact metadata: where it stopped learning a stream that lost what it held
# Artifact metadata: the rows the model has learned over its life, whichever process or replica learned them (it
# travels with the model through publications, adoptions and --model-dir).
LEARNED_ROWS_KEY = "learned_rows"


def learned_rows(predictor: OnlinePredictor) -> int:
    """The rows `predictor` has learned over its life (`LEARNED_ROWS_KEY`). A model that does not record them (saved
    by an earlier build, or made outside the service: `leadtime retrain`) is taken to have learned as many as the
    target it observed most often: each row observes one target or both."""
    recorded = predictor.metadata.get(LEARNED_ROWS_KEY)
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 0:
        return recorded
    return max((int(n) for n in predictor.status()["observations"].values()), default=0)


@dataclass
class LearnerReport:
    """What the child says about its learner along with each snapshot."""

    epoch: int
    cursor: str
    window: dict[str, int]
    last_retrain: datetime | None
    retrain_error: str | None
    last_model_load: datetime | None  # this learner's last winning retrain (None: none since it was handed the model)
    retrains: list[dict[str, Any]] = field(default_factory=list)
    # Rows this learner has learned (handed to the model and its window) and skipped as invalid since it started,
    # up to `cursor`: what the serving model's lineage holds.
    learned: int = 0
    invalid: int = 0
    implausible: int = 0  # dropped by the poisoning guard
    retrain_failures: int = 0  # retrains that raised since this learner process started, adoptions included


@dataclass(frozen=True)
class ChildSetup:
    """Everything the child needs to start, picklable."""

    artifact: bytes
    cursor: str
    epoch: int
    retrain: bool
    retrain_every: int
    default_accelerator: str
    default_model: str
    nice: int
    snapshot_interval_s: float
    cpus: frozenset[int] | None = None  # where the learner runs (None: wherever the scheduler puts it)
    # Least time between two retrains: under a high rate of observations a retrain every `retrain_every` rows
    # would run back to back and take the CPU that learning the rows needs.
    min_retrain_interval_s: float = 0.0
    catalog: Catalog = BUILT_IN  # the classes and models rows may name


class _Child:
    """The child's side: learn what arrives, send snapshots back."""

    def __init__(self, conn: Connection, setup: ChildSetup) -> None:
        self.conn = conn
        self.setup = setup
        self.parser = RowParser(setup.default_accelerator, setup.default_model, setup.catalog)
        self.skip_reasons = ReasonsSaid()  # why stored observations were skipped
        self.cursor = setup.cursor
        self.epoch = setup.epoch
        self.retrains: list[dict[str, Any]] = []
        self.retrained = threading.Event()
        self.dirty = False
        self.last_snapshot = 0.0
        self.learned = 0
        self.invalid = 0
        self.implausible = 0
        self.retrain_failures_before = 0  # failed retrains of the learners this one replaced by adoptions
        self.predictor = self._load(setup.artifact)
        self.lease_retrain = setup.retrain  # what the lease allows; paused for min_retrain_interval_s after one
        self.last_retrain_at = -float("inf")
        self.resting = False
        self.predictor.config.retrain = setup.retrain
        self.predictor.config.retrain_every = setup.retrain_every

    def _load(self, artifact: bytes) -> OnlinePredictor:
        predictor = OnlinePredictor.from_bytes(artifact, background=True)
        # A copy of what the service serves, not a load: its `last_model_load` is this learner's retrains alone
        # (None until one wins); the service keeps the time of its own loads and pulls.
        predictor.last_model_load = None
        predictor.add_retrain_listener(self._on_retrain)
        return predictor.start(import_now=False)  # the service serves; this process only learns

    def _on_retrain(self, result: dict[str, Any]) -> None:
        """Runs in the learner's retrain thread; the main loop sends the snapshot."""
        self.retrains.append(result)
        self.last_retrain_at = time.monotonic()
        self.retrained.set()

    def _pace_retrains(self) -> None:
        """Allow a retrain only when the lease does and the last one is `min_retrain_interval_s` old (rows that
        arrive meanwhile count towards the next one)."""
        rested = time.monotonic() - self.last_retrain_at >= self.setup.min_retrain_interval_s
        self.predictor.config.retrain = self.lease_retrain and rested
        if rested and self.resting:
            self.predictor.retrain_if_due()  # one that came due during the pause: no later row may come to ask
        self.resting = not rested

    def run(self) -> None:
        while True:
            timeout = 0.02 if self.dirty else 0.2
            self._pace_retrains()
            if self.conn.poll(timeout):
                try:
                    message = self.conn.recv()
                except EOFError:
                    return
                if not self.handle(message):
                    return
            if self.retrained.is_set() or (
                self.dirty and time.monotonic() - self.last_snapshot >= self.setup.snapshot_interval_s
            ):
                self.snapshot()

    def handle(self, message: tuple[Any, ...]) -> bool:
        kind = message[0]
        if kind == "learn":
            _, before, after, payload = message
            if before == self.cursor:
                self.learn(orjson.loads(payload))
                self.cursor = after
                self.dirty = True
        elif kind == "adopt":
            _, artifact, cursor, epoch = message
            old = self.predictor
            self.predictor = self._load(artifact)
            self.predictor.config.retrain = old.config.retrain
            self.predictor.config.retrain_every = old.config.retrain_every
            old.close()
            self.retrain_failures_before += old.retrain_failures  # counted for as long as this process lives
            self.retrains.clear()  # results of the replaced learner's retrains describe a model no longer served
            self.retrained.clear()
            self.cursor, self.epoch = cursor, epoch
            # A new lineage: the service keeps what the old one had counted.
            self.learned = self.invalid = self.implausible = 0
        elif kind == "lease":
            _, retrain, every = message
            self.lease_retrain = retrain
            self.predictor.config.retrain = retrain
            self.predictor.config.retrain_every = every
        elif kind == "flush":
            # After the batches sent before it (learned above): the service read past the rest of the backlog
            # without forwarding it, so the next batch starts where the flush left the stream.
            _, cursor = message
            self.predictor.flush_window()
            self.cursor = cursor
            self.dirty = True
        elif kind == "stop":
            self.predictor.close()
            return False
        return True

    def _skipped(self, err: FeatureError) -> None:
        """Said once per reason, not per row: a replica that lacks the catalog of the others skips each of their
        rows of its classes, and said it 1,577 times in a few seconds."""
        if self.skip_reasons.first(str(err)):
            log.warning("skipping invalid stored observations (%s); such ones are skipped and counted", err)

    def learn(self, entries: list[dict[str, Any]]) -> None:
        """Learn stored entries; one that fails the checks (written by another writer) is skipped alone, and rows
        wildly at odds with the hardware's physics (the poisoning guard, `physics.implausible`) are dropped; both
        are counted."""
        good = entries
        try:
            parsed = self.parser.parse_observations(entries)
        except FeatureError:
            # Entries are validated on acceptance; one that is not (another writer) is skipped alone.
            good = []
            for entry in entries:
                try:
                    self.parser.parse_observations([entry])
                    good.append(entry)
                except FeatureError as err:
                    self._skipped(err)
            self.invalid += len(entries) - len(good)
            if not good:
                return
            parsed = self.parser.parse_observations(good)
        bad = physics.implausible(parsed.rows.X, parsed.actual_ttft_ms, parsed.actual_tpot_ms)
        if bad.any():
            self.implausible += int(bad.sum())
            log.warning("dropping %d observations implausible by the roofline (or above a day)", int(bad.sum()))
            good = [entry for entry, drop in zip(good, bad.tolist(), strict=True) if not drop]
            if not good:
                return
            parsed = self.parser.parse_observations(good)
        try:
            before = learned_rows(self.predictor)
            self.predictor.learn_many(parsed.rows, parsed.actual_ttft_ms, parsed.actual_tpot_ms)
            self.learned += len(parsed.actual_ttft_ms)
            self.predictor.metadata[LEARNED_ROWS_KEY] = before + len(parsed.actual_ttft_ms)
        except (FeatureError, ValueError) as err:
            self.invalid += len(parsed.actual_ttft_ms)
            log.warning("learner refused %d observations: %s", len(parsed.actual_ttft_ms), err)

    def snapshot(self) -> None:
        self.retrained.clear()
        retrains, self.retrains = self.retrains, []
        predictor = self.predictor
        predictor.metadata[CURSOR_KEY] = self.cursor
        state, compiled = predictor.snapshot()
        # The encoded artifact only when a retrain may be published; the service loads the state itself.
        artifact = encode(state) if retrains else None
        status = predictor.status()
        report = LearnerReport(
            epoch=self.epoch,
            cursor=self.cursor,
            window=dict(status["window"]),
            last_retrain=predictor.last_retrain,
            retrain_error=predictor.retrain_error,
            last_model_load=predictor.last_model_load,
            retrains=retrains,
            learned=self.learned,
            invalid=self.invalid,
            implausible=self.implausible,
            retrain_failures=self.retrain_failures_before + predictor.retrain_failures,
        )
        self.conn.send(("snapshot", state, compiled, report, artifact))
        self.dirty = False
        self.last_snapshot = time.monotonic()


def _lower_priority(nice: int) -> None:
    """Lower the learner's CPU priority below the handlers'. At 19 the learner also becomes SCHED_IDLE (it
    yields to any normal task at once, but can starve on a saturated machine; on this 2-core machine it did not
    change the serving benchmark, so it is not the default). Threads created afterwards inherit both."""
    if nice <= 0:
        return
    if hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(nice)
    if nice >= 19 and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _child_main(conn: Connection, setup: ChildSetup) -> None:
    # Ctrl-C reaches the whole process group, and a service manager's SIGTERM often does too: the service stops
    # the learner itself (a "stop" message, then SIGKILL if it hangs), so the signals must not end it first,
    # which the service would take for a crash (a warning and a restart while it shuts down).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup = dataclasses.replace(setup, artifact=conn.recv_bytes())  # sent first (`LearnerProcess.start`)
    if setup.cpus:
        pin_process(setup.cpus)
    _lower_priority(setup.nice)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s learner: %(message)s")
    # The service loaded every artifact this process is given and said so if its changed_at was ahead: once.
    logging.getLogger("leadtime.predictor").addFilter(lambda record: not getattr(record, CHANGED_AT_AHEAD, False))
    _Child(conn, setup).run()
    # Nothing is left to keep here (the service holds the model and saves it): end without the interpreter's
    # teardown of numpy, the model and, once it retrained, LightGBM's imports, which took 0.3 s of every stop, up
    # to 0.8 s on a busy machine, with the service waiting (a restart, a rolling update, each test's app).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass(frozen=True)
class Snapshot:
    """The learner's model as `OnlinePredictor.from_state` takes it, what the learner says about it, and, when
    it retrained since the last snapshot, the encoded artifact to publish."""

    state: dict[str, Any]
    compiled: dict[str, dict[str, CompiledTrees | None]]
    report: LearnerReport
    artifact: bytes | None


SnapshotHandler = Callable[[Snapshot], None]


class LearnerProcess:
    """The service's side of the child: forward batches, receive snapshots (on a receiver thread).

    `on_snapshot(snapshot)` runs on the receiver thread for every snapshot; `on_exit()` when the child
    ended without being asked to (the service restarts it with `start`, and says so).
    """

    def __init__(self, on_snapshot: SnapshotHandler, on_exit: Callable[[], None]) -> None:
        self._on_snapshot = on_snapshot
        self._on_exit = on_exit
        self._send_lock = threading.Lock()
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._receiver: threading.Thread | None = None
        self._stopping = False
        # What the child was last told about retraining (the lease decides).
        self.retrain = False
        self.retrain_every = 0

    def start(self, setup: ChildSetup) -> None:
        # A fresh interpreter, never a fork: this process runs gRPC and uvicorn threads, and a fork server
        # started after gRPC's threads was seen to hang the service at start-up.
        """Start a learner process from `setup`, and the thread that receives its snapshots."""
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        # The model goes over our own pipe, not with the spawn's start-up data: the parent writes that while it
        # still holds the child's end of its pipe, so a child killed before reading it all (Ctrl-C, or a service
        # manager's SIGTERM to the process group, while it imports) left that write blocked for good.
        lean = dataclasses.replace(setup, artifact=b"")
        process = context.Process(target=_child_main, args=(child_conn, lean), name="leadtime-learner", daemon=True)
        process.start()
        child_conn.close()
        with contextlib.suppress(OSError):  # the child is gone already: the receiver sees it exit (and restarts it)
            parent_conn.send_bytes(setup.artifact)
        with self._send_lock:
            self._conn, self._process = parent_conn, process
            self.retrain, self.retrain_every = setup.retrain, setup.retrain_every
        self._stopping = False
        self._receiver = threading.Thread(
            target=self._receive, args=(parent_conn,), name="leadtime-learner-receiver", daemon=True
        )
        self._receiver.start()

    @property
    def alive(self) -> bool:
        """Whether the learner process runs."""
        return self._process is not None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        """The learner process's id, once started."""
        return self._process.pid if self._process is not None else None

    def _send(self, message: tuple[Any, ...], wait_s: float = -1) -> bool:
        """False when the child is gone (the receiver notices and reports it), or when another send has held the
        pipe for `wait_s` seconds (a child that stopped reading must not hang whoever sends next)."""
        if not self._send_lock.acquire(timeout=wait_s):
            return False
        try:
            if self._conn is None:
                return False
            self._conn.send(message)
            return True
        except (OSError, ValueError):
            return False
        finally:
            self._send_lock.release()

    def learn(self, before: str, after: str, entries: list[dict[str, Any]]) -> bool:
        """Forward one batch read from the stream between positions `before` and `after` (blocks when the
        child is far behind: the pipe's buffer is the backlog's bound, the stream holds the rest)."""
        return self._send(("learn", before, after, orjson.dumps(entries)))

    def adopt(self, artifact: bytes, cursor: str, epoch: int) -> bool:
        """Replace the child's learner; snapshots it sends from now on carry `epoch`."""
        return self._send(("adopt", artifact, cursor, epoch))

    def set_lease(self, retrain: bool, retrain_every: int) -> bool:
        """Tell the learner whether it retrains (only the lease holder does), and how often."""
        self.retrain, self.retrain_every = retrain, retrain_every
        return self._send(("lease", retrain, retrain_every))

    def flush_window(self, cursor: str) -> bool:
        """Ask the learner to empty its retraining window once it has learned the batches sent so far, and to take
        the next batch from stream position `cursor` (the service skips the rows before it); called from a request
        handler, so it waits for the pipe at most 2 s (False: not delivered)."""
        return self._send(("flush", cursor), wait_s=2.0)

    def _receive(self, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "snapshot":
                _, state, compiled, report, artifact = message
                try:
                    self._on_snapshot(Snapshot(state, compiled, report, artifact))
                except Exception:  # a bad snapshot must not stop the receiver
                    log.exception("cannot install the learner's snapshot")
        if not self._stopping:
            self._on_exit()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the learner to stop; SIGKILL if it has not within `timeout_s`."""
        self._stopping = True
        process = self._process
        if process is not None:
            if self._send(("stop",), wait_s=2.0):
                process.join(timeout_s)
            if process.is_alive():  # wedged (it ignores SIGTERM): SIGKILL
                process.kill()
                process.join(2.0)
        with self._send_lock:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(timeout_s)
