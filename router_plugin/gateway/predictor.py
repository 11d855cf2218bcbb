"""The predictor as the gateway's policy sees it: predictions on the routing path, observations in batches.

`GatewayPredictor` is the `PredictorClient` handed to the policy. Its `predict` goes straight to the predictor
(HTTP, gRPC or in process) with the policy's deadline less the decision's wait for its turn (`queued_s`), timed,
or fails at once when what that wait left of the deadline is shorter than the predictor's answers take; after
`open_after` failures in a row it stops calling for `open_for_s` and fails at once, so that a predictor that hangs
costs the deadline a few times, not on every request (each such decision still falls back to the heuristics and is
counted). Its `observe` only queues: a thread of its own sends the queue in batches through a second client,
retries a batch that failed, and drops the oldest observations (counted) when the queue is full because the
predictor has been away long.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from leadtime.features.errors import ReasonsSaid, without_index
from leadtime.features.rows import FeatureRow, Observation
from leadtime.router_plugin.client import (
    INVALID_ANSWER,
    BulkPredictions,
    PredictorClient,
    PredictorError,
    PredictorUnavailable,
)
from leadtime.router_plugin.gateway.metrics import GatewayMetrics

log = logging.getLogger("leadtime.router.predictor")
QUEUED = "queued"
"""The status (and fallback reason) of a decision that waited for the decision thread until what was left of its
deadline was shorter than the predictor's answers take: decided by the heuristics without asking the predictor,
which answers slower than the decisions come."""
ANSWER_WEIGHT = 0.2
"""Weight of the newest answer in the moving mean of how long the predictor's answers take (`queued_s`)."""
REFUSED_ROWS_SAID_S = 60.0
"""How long /readyz names candidates the predictor refused, after the last refusal."""


def failure_reason(err: PredictorError) -> str:
    """A short label for a failed call: deadline, unavailable, circuit_open, refused, invalid_answer (an answer
    the policy cannot route on: a row missing, a value not finite), or queued (not made: the decision waited for
    its turn until too little of its deadline was left, `GatewayPredictor.queued_s`)."""
    status = str(err.status)
    if status in ("deadline", "DEADLINE_EXCEEDED"):
        return "deadline"
    if status == QUEUED:
        return QUEUED
    if status == INVALID_ANSWER:
        return "invalid_answer"
    if status == "circuit":
        return "circuit_open"
    if isinstance(err, PredictorUnavailable):
        return "unavailable"
    return "refused"


def refusal_hint(err: Exception) -> str:
    """What to change when the predictor refuses observations for good (retrying as it is will not help), or ""
    for an outage (it is away; retrying will).

    >>> refusal_hint(PredictorError(404, "Not Found"))
    'a --role prediction service takes none: point the gateway at a training or all one'
    """
    if not isinstance(err, PredictorError) or isinstance(err, PredictorUnavailable):
        return ""
    status = str(err.status)
    if status in ("401", "403", "UNAUTHENTICATED", "PERMISSION_DENIED"):
        return "give route --api-token the service's token"
    if status in ("404", "UNIMPLEMENTED"):
        return "a --role prediction service takes none: point the gateway at a training or all one"
    return ""


def refused_observation(err: Exception, count: int) -> int | None:
    """The index of the one observation of a batch of `count` that the predictor refuses for good (it names it:
    `observations[3].accelerator: unknown accelerator class 'b200'`), or None when the refusal is not of one row
    (an outage, a token, a full backlog).

    >>> refused_observation(PredictorError(422, "observations[3].accelerator: unknown accelerator class 'b200'"), 5)
    3
    >>> refused_observation(PredictorUnavailable("transport", "connection refused"), 5) is None
    True
    """
    if not isinstance(err, PredictorError) or isinstance(err, PredictorUnavailable):
        return None
    if str(err.status) not in ("422", "invalid", "INVALID_ARGUMENT"):
        return None
    found = re.match(r"observations\[(\d+)\]", err.message)
    return int(found.group(1)) if found is not None and int(found.group(1)) < count else None


@runtime_checkable
class BackgroundModel(Protocol):
    """A predict client that holds a model of its own and keeps it current in the background (`pulled.PulledModel`
    pulls the service's): the gateway starts and stops it with itself, reports the model's age, and names under
    /readyz's `degraded` what fails in keeping it current (`health`)."""

    def start(self) -> None: ...

    def stop(self, timeout_s: float = 5.0) -> None: ...

    def age_s(self) -> float | None: ...

    def health(self) -> dict[str, str]: ...


class GatewayPredictor:
    """Predict on the caller's thread; observe into a queue flushed in batches by a background thread.

    Parameters
    ----------
    predict_client
        Serves `predict` (the routing path).
    observe_client
        Serves the batched `observe` calls from the flusher thread (a client of its own: HTTP and gRPC clients
        are not shared between threads here).
    metrics
        Where call latencies and observation counts go.
    batch_size, flush_interval_s
        A batch goes when it is this large or this old.
    capacity
        Most observations queued; beyond it the oldest are dropped.
    observe_deadline_s
        Budget of one batch call.
    open_after, open_for_s
        The breaker: after this many failed predictions in a row, none is tried for this long.
    """

    def __init__(
        self,
        predict_client: PredictorClient,
        observe_client: PredictorClient,
        metrics: GatewayMetrics,
        batch_size: int = 64,
        flush_interval_s: float = 0.2,
        capacity: int = 20_000,
        observe_deadline_s: float = 2.0,
        open_after: int = 3,
        open_for_s: float = 1.0,
    ) -> None:
        self.predict_client = predict_client
        self.observe_client = observe_client
        self.metrics = metrics
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.capacity = capacity
        self.observe_deadline_s = observe_deadline_s
        self.open_after = open_after
        self.open_for_s = open_for_s
        self.last_failure = ""
        self._last_error = ""  # what the last failed call said (the breaker's resting says nothing of the cause)
        self._observe_failing = False  # the last batch sent failed (an outage, said once)
        self._observe_refusal = ""  # what to change, when the predictor refuses them for good (`refusal_hint`)
        self._row_refusals = ReasonsSaid()  # why it refused single observations
        self._outage = False  # the breaker opened, or the warm-up failed, since the last prediction that succeeded
        self._warm_up_failed = False  # the outage is the warm-up's: no prediction asked since
        self._refused_rows: tuple[float, str] | None = None  # when the predictor last refused rows, and why
        self._consecutive = 0
        self._open_until = 0.0
        self._queue: deque[Observation] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.dropped = 0
        self.queued_s = 0.0
        """How long the decision being made waited for the decision thread (the gateway sets it for each): its
        predictions get the deadline less that wait, so that decisions queued behind a predictor slower than they
        come each add about the deadline at most, not every call before them. None is asked for when what is left
        is shorter than the predictor's answers take (`_answer_s`): it would come too late, and a call cut short
        counts towards the breaker, which would then leave the predictor unasked for a second, decisions it had
        time for included. Unasked for the breaker's rest (`open_for_s`), it is asked with what is left: that mean
        moves only with answers, and a few slow ones would otherwise leave it unasked for good."""
        self._answer_s = 0.0  # moving mean of how long the predictor's answers take (`ANSWER_WEIGHT`)
        self._asked_at = -math.inf  # time.monotonic() of the last call made to the predictor
        self._ok = metrics.predictor_seconds.labels("predict", "ok")
        self._queued = metrics.observations.labels("queued")
        metrics.observations_waiting.set_function(self.pending)  # read at each scrape

    # ----- predictions (the decision thread) -------------------------------------------------------------

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        now = time.monotonic()
        if deadline_s is not None and self.queued_s > 0:
            left = deadline_s - self.queued_s
            asked_lately = now - self._asked_at < self.open_for_s
            if left <= 0 or left <= self._answer_s and asked_lately:  # not the predictor's failure: no breaker
                self.last_failure = QUEUED
                raise PredictorUnavailable(
                    QUEUED,
                    f"the decision waited {self.queued_s * 1e3:.0f} ms for its turn, leaving {max(left, 0) * 1e3:.0f} "
                    f"ms of its {deadline_s * 1e3:g} ms deadline, and the predictor answers in "
                    f"{self._answer_s * 1e3:.0f} ms",
                )
            deadline_s = left
        if now < self._open_until:
            self.last_failure = "circuit_open"
            raise PredictorUnavailable("circuit", f"predictor failed {self.open_after} times in a row; resting")
        self._asked_at = now
        started = time.perf_counter()
        try:
            answer = self.predict_client.predict(rows, deadline_s)
        except PredictorError as err:
            self._prediction_failed(err, started)
            raise
        except Exception as err:
            # A client bug, or an answer the client choked on, must not drop the request, nor pass unseen: it is
            # the predictor failing, counted, rested from and said in /readyz as any other failure. Its label is
            # invalid_answer: the call came back and could not be used ("refused" would blame the rows).
            failure = PredictorError(INVALID_ANSWER, f"the predictor client failed: {type(err).__name__}: {err}")
            self._prediction_failed(failure, started)
            raise failure from err
        took = time.perf_counter() - started
        self._ok.observe(took)
        self._answer_s = self._answer_s + ANSWER_WEIGHT * (took - self._answer_s) if self._answer_s else took
        self._consecutive = 0
        self._warm_up_failed = False
        if self._outage:
            self._outage = False
            log.info("predictor answers again")
        return answer

    def _prediction_failed(self, err: PredictorError, started: float) -> None:
        """Account for a prediction that failed with `err`: its label, latency and message; a refusal named in
        /readyz; any other failure counted towards the breaker, which opens after `open_after` in a row."""
        self.last_failure = failure_reason(err)
        self._last_error = str(err)
        self._warm_up_failed = False
        self.metrics.predictor_seconds.labels("predict", self.last_failure).observe(time.perf_counter() - started)
        if self.last_failure == "refused":
            # The rows, not the predictor: it answers at once, and answers decisions without them. Not an
            # outage to rest from, but named in /readyz while it lasts (`health`).
            self._refused_rows = (time.monotonic(), without_index(err.message))
            return
        self._consecutive += 1
        if self._consecutive >= self.open_after:
            self._open_until = time.monotonic() + self.open_for_s
            self._consecutive = 0
            if not self._outage:  # once an outage, not at every re-opening of the breaker
                self._outage = True
                log.warning(
                    "predictor failing (%s); heuristics meanwhile, trying it again every %.1f s",
                    err,
                    self.open_for_s,
                )

    def warm_up(self, row: FeatureRow, deadline_s: float = 2.0) -> bool:
        """One prediction before traffic, so that the first request does not pay for connecting. Its answer is
        ignored, and a failure does not count towards the breaker, but it is an outage as far as /readyz goes
        (`health`) until a prediction succeeds, or a pulled model is held: a probe right after start must not see a
        healthy gateway whose every decision falls back."""
        try:
            self.predict_client.predict([row], deadline_s)
        except Exception as err:  # noqa: BLE001 - a warm-up must never stop the gateway
            log.warning("predictor warm-up failed (%s); requests will fall back until it answers", err)
            self.last_failure = failure_reason(err) if isinstance(err, PredictorError) else "refused"
            self._last_error = str(err)
            self._outage = self._warm_up_failed = True
            return False
        return True

    def health(self) -> dict[str, str]:
        """What is degraded (for the gateway's /readyz, which stays ready: the heuristics, or a pulled model held,
        route meanwhile): the predictor, the observations, and the predict client's own background work."""
        out = self.predict_client.health() if isinstance(self.predict_client, BackgroundModel) else {}
        warm_up_outdated = self._warm_up_failed and self._holds_model()  # a model pulled since it found none
        if self._outage and not warm_up_outdated:
            cause = f"{self.last_failure}: {self._last_error}" if self._last_error else self.last_failure
            out["predictor"] = f"failing ({cause}); deciding with the heuristics until it answers"
        refused = self._refused_rows
        if refused is not None and time.monotonic() - refused[0] < REFUSED_ROWS_SAID_S:
            out["candidates"] = (
                f"the predictor refuses some ({refused[1]}); decisions with them among their candidates fall back "
                "to the heuristics"
            )
        if self._observe_failing and self._observe_refusal:
            out["observations"] = f"refused by the predictor ({self._observe_refusal}); kept and retried"
        elif self._observe_failing:
            out["observations"] = "not reaching the predictor; kept and retried"
        return out

    def _holds_model(self) -> bool:
        """Whether the predict client holds a model of its own now (`BackgroundModel`: one a pull has found)."""
        client = self.predict_client
        return isinstance(client, BackgroundModel) and client.age_s() is not None

    # ----- observations ----------------------------------------------------------------------------------

    def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
        """Queue for the flusher; returns how many were queued."""
        with self._cond:
            self._queue.extend(observations)
            over = len(self._queue) - self.capacity
            for _ in range(max(0, over)):
                self._queue.popleft()
            if over > 0:
                self.dropped += over
                self.metrics.observations.labels("dropped").inc(over)
            if len(self._queue) >= self.batch_size:
                self._cond.notify()
        self._queued.inc(len(observations))
        return len(observations)

    def start(self) -> None:
        """Start the flusher, and the predict client's own background work if it has any (`pulled.PulledModel`
        pulls the service's model)."""
        self._thread = threading.Thread(target=self._flush_loop, name="leadtime-router-observe", daemon=True)
        self._thread.start()
        if isinstance(self.predict_client, BackgroundModel):
            self.predict_client.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        if isinstance(self.predict_client, BackgroundModel):
            self.predict_client.stop(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._cond:
            left = len(self._queue)
            self._queue.clear()
        if left:  # the predictor did not take them before the stop: said and counted, not lost in silence
            self.dropped += left
            self.metrics.observations.labels("dropped").inc(left)
            log.warning("stopping: %d observations not sent to the predictor are dropped", left)

    def pending(self) -> int:
        """Observations queued, not yet sent."""
        return len(self._queue)

    def _flush_loop(self) -> None:
        while True:
            with self._cond:
                if not self._stopping and len(self._queue) < self.batch_size:
                    self._cond.wait(self.flush_interval_s)
                stopping = self._stopping
                batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
            if batch and not self._send(batch):
                with self._cond:  # keep them for the next try, in order
                    room = self.capacity - len(self._queue)
                    keep = batch[-room:] if room > 0 else []
                    self._queue.extendleft(reversed(keep))
                    lost = len(batch) - len(keep)
                    if lost:
                        self.dropped += lost
                        self.metrics.observations.labels("dropped").inc(lost)
                if stopping:
                    return
                time.sleep(min(1.0, self.flush_interval_s * 5))  # the predictor is away: do not spin
            elif stopping and not self._queue:
                return

    def _send(self, batch: list[Observation]) -> bool:
        """Send `batch`; False when it could not be, for the caller to keep what is left of it. An observation the
        predictor refuses for good (a class it does not know) is dropped from `batch`, counted and said once per
        reason, and the rest sent again: the service takes a batch whole or not at all, and keeping that row would
        have kept every other one from it for ever."""
        while batch:
            started = time.perf_counter()
            try:
                self.observe_client.observe(batch, self.observe_deadline_s)
            except Exception as err:  # any failure: the batch is kept and retried
                index = refused_observation(err, len(batch))
                if index is None:
                    return self._failed(batch, err, started)
                del batch[index]
                self._drop_refused(err)
                continue
            return self._sent(batch, started)
        return True

    def _drop_refused(self, err: Exception) -> None:
        """Count an observation dropped, refused by the predictor as `err` says; the reason is said once."""
        self.dropped += 1
        self.metrics.observations.labels("dropped").inc()
        if self._row_refusals.first(str(getattr(err, "message", err))):
            log.warning("the predictor refuses an observation (%s): such ones are dropped, the others sent", err)

    def _failed(self, batch: list[Observation], err: Exception, started: float) -> bool:
        """`batch` was not sent (an outage, a refusal of the whole batch): counted and, once, said; False."""
        self.metrics.predictor_seconds.labels("observe", "error").observe(time.perf_counter() - started)
        self.metrics.observations.labels("failed").inc(len(batch))
        hint = refusal_hint(err)
        if not self._observe_failing:  # once an outage: a refusal (a token the service wants) stops learning
            said = f"{err}: {hint}" if hint else str(err)
            log.warning("observations not sent to the predictor (%s); kept and retried", said)
        self._observe_failing, self._observe_refusal = True, hint
        return False

    def _sent(self, batch: list[Observation], started: float) -> bool:
        """`batch` was taken: counted; an outage of observations said to be over; True."""
        self.metrics.predictor_seconds.labels("observe", "ok").observe(time.perf_counter() - started)
        self.metrics.observations.labels("sent").inc(len(batch))
        self.sent += len(batch)
        if self._observe_failing:
            log.info("observations reach the predictor again")
            self._observe_failing, self._observe_refusal = False, ""
        return True
