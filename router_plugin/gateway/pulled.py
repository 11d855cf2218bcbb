"""`leadtime route --pull-model`: predict in the gateway's process with a copy of the service's model.

Why: a prediction from `leadtime serve` over loopback costs the gateway about a millisecond per decision (the
round trip, the service's handling, and handing the decision to a thread of its own and back so that the event
loop keeps relaying streams meanwhile); on a 2-core host that kept the gateway's added time to first byte above
2 ms at p50. The same prediction in process takes a few tenths of a millisecond, and the decision can then be
made on the event loop itself.

What stays the same: the service is still the one learner. Every observation goes to it in batches, as in the
remote mode (`predictor.GatewayPredictor`); the gateway never learns. A thread here asks the service for its
serving model (`GET /v1/model`) every `interval_s` with the SHA-256 of the copy it holds (`If-None-Match`) and
gets 304 until the model changes (online corrections every ~0.25 s while it learns, new trees after a retrain).
A new model is checked (the artifact's own SHA-256 checksum, and the digest the service announced) and loaded
beside the one serving, reusing its LightGBM trees where they are the same text, then swapped in by one
assignment: predictions never wait for a pull.

A service that is down: the last model keeps serving (its age is exported), pulls are retried every
`interval_s`; with no model yet, predictions fail at once as `unavailable` and the policy falls back to the
heuristics (counted), as when a remote predictor is down. A pull that fails, for want of the service or by
refusing what it sent, is logged when it starts failing and when the reason changes, not at every pull: a service
that keeps failing would otherwise write a line every `interval_s`, forever. The pull itself is
`leadtime.predictor.model_pull.ModelPull`, shared with a prediction server that takes its models from a training
server (`leadtime serve --model-from`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import httpx

from leadtime.features.rows import FeatureRow, Observation
from leadtime.predictor.client import DEFAULT_DEADLINE_S
from leadtime.predictor.learner import OnlinePredictor
from leadtime.predictor.model_pull import DEFAULT_PULL_TIMEOUT_S, PULL_RESULTS, ModelPull
from leadtime.router_plugin.client import (
    BulkPredictions,
    PredictorClient,
    PredictorUnavailable,
    predict_in_process,
)
from leadtime.router_plugin.gateway.metrics import GatewayMetrics

log = logging.getLogger("leadtime.router.pulled")


class PulledModel:
    """A `PredictorClient` whose predictions come from the service's model pulled into this process, and whose
    observations go to the service through `observer`.

    Parameters
    ----------
    base_url
        The service over HTTP, e.g. "http://127.0.0.1:8000".
    observer
        Sends observations to the service (the same client a remote-mode gateway uses); `observe` delegates to it.
    interval_s
        Time between two pulls.
    timeout_s, api_token, ca_file
        As `ModelPull` takes them (the pulls are its): `timeout_s` is a pull's whole deadline.
    """

    def __init__(
        self,
        base_url: str,
        observer: PredictorClient,
        interval_s: float = 1.0,
        timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
        api_token: str | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("the pull interval must be > 0")
        self._pull = ModelPull(
            base_url, self._load, log, "heuristics until one is pulled", timeout_s, api_token, ca_file
        )
        self.url = self._pull.url
        self.observer = observer
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.model: OnlinePredictor | None = None
        self.pulls = dict.fromkeys(PULL_RESULTS, 0)
        self.metrics: GatewayMetrics | None = None
        self._first = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def digest(self) -> str:
        """SHA-256 of the model held ("" before one was pulled)."""
        return self._pull.digest

    @property
    def pulled_at(self) -> float | None:
        """time.monotonic() of the last pull that found the service (a new model or the same one)."""
        return self._pull.pulled_at

    def _load(self, artifact: bytes) -> OnlinePredictor:
        """A pulled artifact loaded beside the model serving, reusing its LightGBM trees where they are the same
        text (ArtifactError refuses it)."""
        return OnlinePredictor.from_bytes(artifact, background=False, reuse=self.model)

    # ----- predictions (the decision's thread) ---------------------------------------------------------------

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        """Predict with the model held now. Before the first pull has finished, wait for it within the deadline;
        with no model at all, raise `PredictorUnavailable` (the policy falls back to the heuristics). A row the model
        cannot read is refused as the service refuses it (`predict_in_process`)."""
        model = self.model
        if model is None and not self._first.is_set():
            self._first.wait(deadline_s if deadline_s is not None else DEFAULT_DEADLINE_S)
            model = self.model
        if model is None:
            raise PredictorUnavailable("no_model", f"no model pulled from {self.url} yet")
        return predict_in_process(model, rows, model.config.quantile)

    def observe(self, observations: Sequence[Observation], deadline_s: float | None = None) -> int:
        """To the service, which learns from them (this process never does)."""
        return self.observer.observe(observations, deadline_s)

    # ----- pulling (a thread of its own) --------------------------------------------------------------------

    def start(self) -> None:
        """Pull now and then every `interval_s`, on a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="leadtime-router-pull", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop pulling: waits up to `timeout_s` for a pull in progress to finish (the thread is a daemon: one
        that takes longer does not hold the process)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def age_s(self) -> float | None:
        """Seconds since a pull last found the service (None before any did)."""
        return self._pull.age_s()

    def health(self) -> dict[str, str]:
        """A pull that fails now, named for the gateway's /readyz (which stays ready: the model held, growing old,
        or the heuristics decide meanwhile); empty while pulls succeed. Without it a service gone for good, or one
        answering 404, left /readyz saying nothing while the gateway routed on an ever older model."""
        failure = self._pull.failure
        if not failure:
            return {}
        age = self.age_s()
        if self.model is None or age is None:
            return {"model_pull": f"failing ({failure}); no model pulled yet, deciding with the heuristics"}
        return {"model_pull": f"failing ({failure}); model {age:.0f} s old"}

    def _loop(self) -> None:
        with self._pull.client() as client:
            while not self._stop.is_set():
                self.pull_once(client)
                self._first.set()
                self._stop.wait(self.interval_s)

    def pull_once(self, client: httpx.Client) -> str:
        """One pull: ask for the model unless it is the one held; load and swap in a new one. Returns what it
        did (one of `PULL_RESULTS`); never raises."""
        result, model = self._pull.pull_once(client)
        if model is not None:
            self.model = model
        self.pulls[result] += 1
        if self.metrics is not None:
            self.metrics.model_pulls.labels(result).inc()
        return result
