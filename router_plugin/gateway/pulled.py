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
that keeps failing would otherwise write a line every `interval_s`, forever.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np

from leadtime.features.rows import FeatureRow, Observation
from leadtime.predictor.artifact import ArtifactError
from leadtime.predictor.client import DEFAULT_DEADLINE_S, https_context
from leadtime.predictor.learner import OnlinePredictor
from leadtime.router_plugin.client import BulkPredictions, PredictorClient, PredictorUnavailable
from leadtime.router_plugin.gateway.metrics import PULL_RESULTS, GatewayMetrics

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
    timeout_s
        Budget of one pull (the download and nothing else; loading is not bounded by it).
    api_token
        Sent as a Bearer token (the service does not need one to serve its model, but a proxy in front may).
    ca_file
        With an `https://` URL: the PEM bundle to verify the service's certificate with (default: the system's).
    """

    def __init__(
        self,
        base_url: str,
        observer: PredictorClient,
        interval_s: float = 1.0,
        timeout_s: float = 5.0,
        api_token: str | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        # True: httpx's default CAs. https_context refuses a URL without its scheme, as every client does.
        self._verify: ssl.SSLContext | bool = https_context(base_url, ca_file) or True
        if interval_s <= 0:
            raise ValueError("the pull interval must be > 0")
        self.url = base_url.rstrip("/") + "/v1/model"
        self.observer = observer
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self.model: OnlinePredictor | None = None
        self.digest = ""
        self.pulled_at: float | None = None
        """time.monotonic() of the last pull that found the service (a new model or the same one)."""
        self.pulls = dict.fromkeys(PULL_RESULTS, 0)
        self.metrics: GatewayMetrics | None = None
        self._first = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure = ""
        """Why pulls fail now, "" since one succeeded: logged when it changes, not at every pull."""

    # ----- predictions (the decision's thread) ---------------------------------------------------------------

    def predict(self, rows: Sequence[FeatureRow], deadline_s: float | None = None) -> BulkPredictions:
        """Predict with the model held now. Before the first pull has finished, wait for it within the deadline;
        with no model at all, raise `PredictorUnavailable` (the policy falls back to the heuristics)."""
        model = self.model
        if model is None and not self._first.is_set():
            self._first.wait(deadline_s if deadline_s is not None else DEFAULT_DEADLINE_S)
            model = self.model
        if model is None:
            raise PredictorUnavailable("no_model", f"no model pulled from {self.url} yet")
        p = model.predict_many(rows)
        return BulkPredictions(
            np.asarray(p.ttft_mean),
            np.asarray(p.ttft_quantile),
            np.asarray(p.tpot_mean),
            np.asarray(p.tpot_quantile),
            int(p.model_version),
            model.config.quantile,
        )

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
        """Stop pulling (a pull in progress finishes first, within `timeout_s`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def age_s(self) -> float | None:
        """Seconds since a pull last found the service (None before any did)."""
        return None if self.pulled_at is None else time.monotonic() - self.pulled_at

    def health(self) -> dict[str, str]:
        """A pull that fails now, named for the gateway's /readyz (which stays ready: the model held, growing old,
        or the heuristics decide meanwhile); empty while pulls succeed. Without it a service gone for good, or one
        restarted to train only (404), left /readyz saying nothing while the gateway routed on an ever older
        model."""
        failure = self._failure
        if not failure:
            return {}
        age = self.age_s()
        if self.model is None or age is None:
            return {"model_pull": f"failing ({failure}); no model pulled yet, deciding with the heuristics"}
        return {"model_pull": f"failing ({failure}); model {age:.0f} s old"}

    def _loop(self) -> None:
        with httpx.Client(timeout=self.timeout_s, headers=self._headers, verify=self._verify) as client:
            while not self._stop.is_set():
                self.pull_once(client)
                self._first.set()
                self._stop.wait(self.interval_s)

    def pull_once(self, client: httpx.Client) -> str:
        """One pull: ask for the model unless it is the one held; load and swap in a new one. Returns what it
        did (one of `PULL_RESULTS`); never raises."""
        result, failure = self._pull(client)
        self.pulls[result] += 1
        if self.metrics is not None:
            self.metrics.model_pulls.labels(result).inc()
        if failure != self._failure:
            if failure:
                kept = "keeping the model held" if self.model is not None else "heuristics until one is pulled"
                log.warning("pulling the model from %s failed (%s); %s", self.url, failure, kept)
            else:
                log.info("pulling the model from %s succeeds again", self.url)
            self._failure = failure
        return result

    def _pull(self, client: httpx.Client) -> tuple[str, str]:
        """What one pull did (one of `PULL_RESULTS`) and why it failed ("" when it did not). Says nothing:
        `pull_once` logs a failure once, not at every pull."""
        headers = {"If-None-Match": f'"{self.digest}"'} if self.digest else {}
        try:
            response = client.get(self.url, headers=headers)
        except httpx.HTTPError as err:
            return "error", str(err) or type(err).__name__
        if response.status_code == 304:
            self.pulled_at = time.monotonic()
            return "unchanged", ""
        if response.status_code != 200:
            return "error", f"answered {response.status_code}"
        artifact = response.content
        digest = hashlib.sha256(artifact).hexdigest()
        announced = response.headers.get("etag", "").strip('"')
        if announced and announced != digest:
            return "refused", "refused: the model does not match the SHA-256 the service announced"
        try:
            model = OnlinePredictor.from_bytes(artifact, background=False, reuse=self.model)
        except ArtifactError as err:
            return "refused", f"refused: {err}"
        self.model, self.digest, self.pulled_at = model, digest, time.monotonic()
        return "new", ""
