"""Leadtime's routing policy: every candidate predicted in one call, picked by SLO headroom, learned as it routes.

For each request:

1. **Filter** — time-sliced endpoints whose group is not serving the inference job are left out while a serving
   candidate is predicted to meet the request's SLOs. When none serves, or none of those that serve is predicted
   in time (overload), the others compete too, each predicted with its expected wait until it is back, learned
   from the group's history (`timeslice.ResidencyTracker`). An endpoint swapped in since its state was published
   has lost its prefix cache, so its prefix hits are dropped.
2. **Rows** — one feature row per remaining candidate: the request's prompt and that endpoint's prefix hits, the
   endpoint's published state plus what this router sent it since (`inflight.InflightLedger`), its accelerator
   class, role and time-slice state.
3. **Predict** — one bulk call for all rows (prefill and decode endpoints of a P/D fleet together).
4. **Score and pick** — `scorers.latency`: headroom of the upper-quantile predictions against the request's SLOs
   (lowest predicted latency without SLOs; the shortest mean TTFT when every candidate is far inside them), on
   unified endpoints weighed by the ITL headroom the request's prefill would take from the requests this router
   has in flight there (`decoding.DecodingLedger`, `scorers.latency.shared_step_scores`); on P/D the
   (prefill, decode) pair or local prefill is chosen jointly (`pairs.choose_pair`), local prefill only on a decode
   endpoint far inside the ITL SLO. A request whose upper quantiles miss everywhere but whose mean predictions meet the
   SLOs somewhere goes where its means are best. A request predicted beyond saving everywhere (not even its mean
   predictions meet the SLOs anywhere) goes to the first candidate beyond saving, one overflow endpoint, rather than
   slowing the whole fleet down; while the fleet has capacity to spare, only up to a bounded predicted wait there
   (`LeadtimeConfig.overflow_cap`). A small share of decisions explores: among the candidates predicted to meet the SLOs
   it takes the one this router has heard from least recently, so that every endpoint keeps being observed.
5. **Learn** — when the request completes, the rows it was decided on (in-flight additions included) are
   reported with the actual TTFT and ITL and what was predicted. On P/D the prefill row learns the TTFT less the
   transfer it was predicted to wait for, and the decode row the ITL.

A predictor that fails or misses its deadline makes that decision fall back to llm-d's heuristic scorers; the
fallbacks are counted, and their requests are accounted in flight and learned from like the others. The
`LeadtimeConfig` switches turn single features off for ablations.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.errors import FeatureError, ReasonsSaid
from leadtime.features.roofline import kv_transfer_ms
from leadtime.features.rows import (
    MAX_PREDICTED_MS,
    EndpointState,
    FeatureRow,
    Observation,
    RequestFeatures,
    check_count,
    check_real,
)
from leadtime.features.vectorize import Vectorizer
from leadtime.router_plugin.client import (
    INVALID_ANSWER,
    PredictorClient,
    PredictorError,
    PredictorUnavailable,
    require_predictor_client,
)
from leadtime.router_plugin.decoding import decode_harm
from leadtime.router_plugin.heuristics import LlmdHeuristicPolicy, WeightedScorer
from leadtime.router_plugin.inflight import Sent
from leadtime.router_plugin.ledgers import RouterLedgers
from leadtime.router_plugin.pairs import PairPredictions, choose_pair
from leadtime.router_plugin.policy import (
    Candidate,
    NoCandidateError,
    Outcome,
    Pick,
    RouteRequest,
    RoutingPolicy,
    serves_clients,
    split_by_role,
)
from leadtime.router_plugin.scorers.latency import (
    FEASIBLE,
    FIT_CHOICES,
    OVERFLOW_CHOICES,
    comfortable_scores,
    latency_scores,
    overflow_choice,
    preference,
    shared_step_scores,
    slo_scores,
)
from leadtime.router_plugin.timeslice import SERVING_JOB, ResidencyTracker, TimesliceSource

BLIND_ACCELERATOR = "h100-sxm"
"""What every endpoint is called when the predictor is kept blind to accelerator classes (an ablation)."""


log = logging.getLogger("leadtime.router.policy")


@dataclass(frozen=True)
class LeadtimeConfig:
    """Parameters of the Leadtime policy.

    Parameters
    ----------
    name
        Reported in results.
    inflight
        Add what this router sent since each endpoint's state was published.
    hardware
        Tell the predictor each endpoint's accelerator class (off: every endpoint is called an H100).
    joint_pairs
        Choose P/D pairs jointly (off: llm-d's order, the decode endpoint first, then the prefill endpoint,
        always disaggregated above `disaggregate_min_tokens`).
    timeslice
        Read time-slice groups' state (off: every endpoint is treated as resident).
    decode_harm
        On unified endpoints, weigh among the candidates predicted to meet the SLOs the ITL headroom the request's
        prefill would take from the requests this router has in flight there (`decoding`,
        `scorers.latency.shared_step_scores`).
    local_prefill, local_prefill_itl_share
        On P/D, let a decode endpoint prefill a request itself when that is predicted faster, but only while its
        predicted ITL p90 is within `local_prefill_itl_share` of the request's ITL SLO: a prefill there slows the
        decode steps of every request on it (1: whenever the SLO is predicted met).
    disaggregate_min_tokens
        With `joint_pairs` off, prompts of fewer tokens (the whole prompt, cached or not) are prefilled on the
        decode endpoint and longer ones never are: `local_prefill` and `local_prefill_itl_share` are not read.
    exploration
        Share of decisions that explore (see the module docstring).
    comfort
        When every candidate's upper-quantile TTFT and ITL are within this share of the SLOs, the shortest mean
        predicted TTFT wins (`scorers.latency.comfortable_scores`); 0: never, slack always decides.
    comfort_tolerance
        Then, mean TTFTs within this share of the shortest count as equal, and of those the endpoint this policy
        sent a request longest ago wins, without the decode-harm weighing (spacing the requests out is what
        weighs them there); 0 (the default): the shortest wins.
    fit, fit_margin
        Which candidate predicted to meet the SLOs wins (`scorers.latency.preference`): the most slack, or the
        tightest fit leaving `fit_margin` of the binding SLO.
    overflow, overload_share, overload_window
        Where a request that no candidate is predicted to serve in time goes: "least_bad" (the smallest miss),
        "sink" (an endpoint already beyond saving, see `preference`), or "auto": sink while the fleet is
        overloaded, i.e. while more than `overload_share` of the recent decisions (a moving average over about
        `overload_window` of them) found no candidate predicted to serve in time, and the smallest miss otherwise.
        Under a passing burst, spreading the misses lets the fleet catch up; under sustained overload, piling
        them onto the endpoints already beyond saving keeps the others serving in time.
    overflow_endpoints
        Endpoints, by id, that take requests predicted beyond saving everywhere before any other candidate does, in
        this order (an endpoint kept spare, or one shared with another job); empty: the candidates' order. On P/D,
        pairs are ordered by the endpoint that prefills.
    overflow_cap, overflow_cap_share
        The overflow endpoint (the first candidate beyond saving, which takes requests predicted beyond saving
        everywhere) takes them only while its predicted TTFT stays within `overflow_cap` times the request's TTFT
        SLO; then the next candidate within it does, and when none is, the one with the shortest predicted TTFT
        (`scorers.latency.overflow_choice`). The cap holds only while at most `overflow_cap_share` of the recent
        decisions found no candidate predicted in time: with capacity to spare it bounds the overflow's wait (the
        TTFT tail: p99 70 s against 6 s at 85% load on the homogeneous fleet, for 2% of goodput); short of
        capacity, more overflow endpoints would serve fewer requests in time. 0: no cap.
    hold_slo_multiple
        While the overflow cap is let go (sustained overload, above), a request predicted to miss everywhere even
        by its mean prediction is held at the router (`Pick.held`) rather than queued on the overflow endpoint:
        offered again at each fresh state, with the time it waited spent from its TTFT SLO, it goes wherever it
        is first predicted in time, or, once it has waited `hold_slo_multiple` times its TTFT SLO, with the
        requests beyond saving to the overflow endpoint. Once held, a request is held on until then whatever the
        overload. 0: never hold. (Placed instead where it would have missed least, as when it came in, its TTFT
        tail shortens but the goodput gained under overload is lost: it slows the requests still served in time.)
    kv_link_gb_s
        KV link bandwidth to each decode endpoint, for transfer times.
    serving_job
        The inference job's name in time-slice group states.
    seed
        Seeds exploration and tie-breaking.
    catalog
        The accelerator classes and models endpoints may be of (for roofline prefill and KV transfer times).
    """

    name: str = "leadtime"
    inflight: bool = True
    hardware: bool = True
    joint_pairs: bool = True
    timeslice: bool = True
    decode_harm: bool = True
    local_prefill: bool = True
    local_prefill_itl_share: float = 0.5
    disaggregate_min_tokens: int = 16
    exploration: float = 0.02
    comfort: float = 0.5
    comfort_tolerance: float = 0.0
    fit: str = "most_slack"
    fit_margin: float = 0.0
    overflow: str = "auto"
    overload_share: float = 0.5
    overload_window: int = 200
    overflow_cap: float = 5.0
    overflow_cap_share: float = 0.25
    overflow_endpoints: tuple[str, ...] = ()
    hold_slo_multiple: float = 0.0
    kv_link_gb_s: float = 25.0
    serving_job: str = SERVING_JOB
    seed: int = 0
    catalog: Catalog = BUILT_IN

    def __post_init__(self) -> None:
        """Checked when made, naming the field, as the YAML's are: an unknown `fit` or `overflow` behaved as the
        default in silence, and `exploration=5` explored at every decision."""
        for name, allowed in (("fit", FIT_CHOICES), ("overflow", OVERFLOW_CHOICES)):
            if getattr(self, name) not in allowed:
                raise FeatureError(name, f"must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        shares = ("local_prefill_itl_share", "exploration", "comfort", "comfort_tolerance")
        for name in (*shares, "overload_share", "overflow_cap_share"):
            check_real(name, getattr(self, name), 0.0, 1.0)
        if self.local_prefill_itl_share == 0:  # no ITL headroom at all: every decode endpoint would look busy
            raise FeatureError("local_prefill_itl_share", "must be above 0, got 0")
        for name in ("fit_margin", "overflow_cap", "hold_slo_multiple"):
            check_real(name, getattr(self, name))
        if check_real("kv_link_gb_s", self.kv_link_gb_s) == 0:
            raise FeatureError("kv_link_gb_s", "must be above 0, got 0")
        for name in ("disaggregate_min_tokens", "seed"):
            check_count(name, getattr(self, name))
        if check_count("overload_window", self.overload_window) < 1:
            raise FeatureError("overload_window", "must be at least 1, got 0")
        ids = self.overflow_endpoints
        if not isinstance(ids, tuple) or not all(isinstance(e, str) and e for e in ids):
            raise FeatureError("overflow_endpoints", f"must be a tuple of endpoint ids, got {ids!r}")


@dataclass
class _Decision:
    row: FeatureRow
    decode_row: FeatureRow | None
    predicted_ttft_ms: float | None
    predicted_tpot_ms: float | None
    transfer_ms: float = 0.0
    decided_ms: float = 0.0
    prefill_group: str = ""
    decode_group: str = ""
    predicted_ttft_quantile_ms: float | None = None
    predicted_tpot_quantile_ms: float | None = None
    prefill_ttft_ms: float | None = None  # P/D: the prefill endpoint's own predicted TTFT, mean and quantile
    prefill_ttft_quantile_ms: float | None = None


@dataclass
class PolicyCounters:
    decisions: int = 0
    fallbacks: int = 0
    explored: int = 0
    held: int = 0
    disaggregated: int = 0
    local_prefill: int = 0
    timeslice_filtered: int = 0
    all_non_resident: int = 0
    learned: int = 0
    unreported: int = 0


_PREDICTED = ("ttft", "ttft_mean", "tpot", "tpot_mean")


@dataclass
class _Scored:
    """Candidates that survived filtering, their rows, and their predictions (index-aligned)."""

    candidates: list[Candidate]
    rows: list[FeatureRow]
    ttft: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ttft_mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tpot: np.ndarray = field(default_factory=lambda: np.zeros(0))
    tpot_mean: np.ndarray = field(default_factory=lambda: np.zeros(0))


MAX_OPEN_DECISIONS = 100_000
"""Decisions kept for outcomes still to come (far more requests than any fleet has in flight)."""


class LeadtimePolicy:
    """Routes on predicted TTFT/ITL and learns from every completed request (see the module docstring).

    Its state (what is in flight, the decisions awaiting their outcomes, its counters) is one caller's at a time:
    `pick`, `observe` and `abandon` take a lock, so a router may call them from several threads (the gateway and
    the simulator call from one).

    Parameters
    ----------
    predictor
        Any `PredictorClient`: in-process, HTTP or gRPC. An in-process `OnlinePredictor` made with
        `background=True` (its default) retrains only once its thread is started (`start()`); with
        `background=False` it retrains inside `observe`, holding this policy's lock (other threads' picks wait
        for it: ~0.1 s every `retrain_every` observations).
    config
        Feature switches and parameters.
    timeslice_source
        Where time-slice group states come from; the simulator attaches itself when none is given.
    deadline_s
        Budget of each predictor call; beyond it the decision falls back to heuristics.
    latency_weight, extra_scorers
        On unified fleets a candidate's score is `latency_weight` × its latency score plus each extra
        (heuristic) scorer's weighted score, as llm-d sums its scorers; on P/D pairs are ranked by latency alone.
    fallback
        The policy that decides when the predictor cannot (llm-d's 3/2/2 heuristic by default).
    """

    def __init__(
        self,
        predictor: PredictorClient,
        config: LeadtimeConfig = LeadtimeConfig(),
        timeslice_source: TimesliceSource | None = None,
        deadline_s: float | None = None,
        latency_weight: float = 1.0,
        extra_scorers: Sequence[WeightedScorer] = (),
        fallback: RoutingPolicy | None = None,
    ) -> None:
        require_predictor_client(predictor)
        self.predictor = predictor
        self.config = config
        self.name = config.name
        self._lock = threading.RLock()
        self._refusal: str | None = None  # why the predictor last refused observations, said once
        self._candidate_refusals = ReasonsSaid()  # why it refused a decision's candidates
        self.timeslice_source = timeslice_source
        self.deadline_s = deadline_s
        self.counters = PolicyCounters()
        self._rng = random.Random(config.seed)
        self.ledgers = RouterLedgers(config.overload_window)
        """What this router has in flight; a gateway replica sets its `outbox` to tell the other replicas."""
        self._vectorizer = Vectorizer(
            catalog=config.catalog
        )  # for the roofline prefill time the decode harm is weighed by
        self._residency = ResidencyTracker(config.serving_job)
        self._decisions: dict[str, _Decision] = {}
        self.latency_weight = latency_weight
        self.extra_scorers = list(extra_scorers)
        self._fallback = fallback if fallback is not None else LlmdHeuristicPolicy(seed=config.seed)
        self._last_heard: dict[str, float] = {}
        self._last_sent: dict[str, float] = {}  # when each endpoint was last sent a request, for `comfort_tolerance`
        self._output_tokens = 256.0  # running mean of output lengths, for the no-SLO latency score
        self.fallback_error: PredictorError | None = None
        """What the last decision that fell back to the heuristics fell back on (the gateway counts it by it)."""

    def attach(self, simulator: Any) -> None:
        """Inside the simulator: read its time-slice groups unless another source was given. The simulated
        orchestrator calls the serving job its own way (`timeslice.SERVING_JOB`), whatever `serving_job` calls a
        real one's: a configuration written for a deployment runs in the simulator as it is."""
        if self.timeslice_source is None and hasattr(simulator, "status"):
            self.timeslice_source = simulator
            self._residency.job = SERVING_JOB

    # ----- rows -------------------------------------------------------------------------------------------

    def _servable(
        self, request: RouteRequest, candidates: Sequence[Candidate]
    ) -> tuple[list[Candidate], list[Candidate]]:
        """(candidates whose time-slice group serves the inference job now, the others)."""
        if not self.config.timeslice:
            return list(candidates), []
        source = self.timeslice_source
        serving: list[Candidate] = []
        away: list[Candidate] = []
        for c in candidates:
            if not c.timeslice_group:
                serving.append(c)
                continue
            if source is not None:
                status = source.status(c.timeslice_group)
                if status is not None:
                    self._residency.update(c.timeslice_group, status, request.arrival_ms)
                    (serving if self._residency.serving(c.timeslice_group) else away).append(c)
                    continue
            (serving if c.state.timeslice_state in ("none", "resident") else away).append(c)
        return serving, away

    def _state(self, c: Candidate, away: bool, now_ms: float) -> EndpointState:
        """The row's endpoint state. `away` is how the candidate's list was taken; a group the router has seen is
        taken as it is now (on P/D with every decode endpoint away, the prefill endpoints may still serve)."""
        state = c.state
        if c.timeslice_group and self._residency.knows(c.timeslice_group):
            away = not self._residency.serving(c.timeslice_group)
        if self.config.inflight:
            state = self.ledgers.inflight.adjusted(state, c.published_ms)
        changes: dict[str, Any] = {}
        if not self.config.hardware and state.accelerator != BLIND_ACCELERATOR:
            changes["accelerator"] = BLIND_ACCELERATOR
        if not self.config.timeslice:
            if state.timeslice_state != "none" or state.timeslice_wait_ms:
                changes.update(timeslice_state="none", timeslice_wait_ms=0.0)
        elif away and c.timeslice_group:
            # What the router has learned of the group's residency, once it has seen the group; until then the
            # wait the candidate's own state gives (a caller or a source that knows it).
            known = self._residency.knows(c.timeslice_group)
            wait = self._residency.expected_wait_ms(c.timeslice_group, now_ms) if known else state.timeslice_wait_ms
            changes.update(timeslice_state="parked", timeslice_wait_ms=wait)
        elif c.timeslice_group and state.timeslice_state != "resident":
            changes["timeslice_state"] = "resident"
        return replace(state, **changes) if changes else state

    def _prefix_hits(self, request: RouteRequest, c: Candidate) -> int:
        hits = min(c.prefix_hit_tokens, request.input_tokens)
        swapped = bool(c.timeslice_group) and self._residency.swapped_in_at(c.timeslice_group) > c.published_ms
        if hits and self.config.timeslice and swapped:
            return 0  # swapped out and back since the state was published: the cache is gone
        return hits

    def _rows(
        self, request: RouteRequest, candidates: Sequence[Candidate], away: bool, decode_side: bool = False
    ) -> list[FeatureRow]:
        features: dict[int, RequestFeatures] = {}
        rows = []
        for c in candidates:
            hits = 0 if decode_side else self._prefix_hits(request, c)
            req = features.get(hits)
            if req is None:
                req = features[hits] = RequestFeatures.with_prefix_hits(request.input_tokens, hits)
            rows.append(FeatureRow(req, self._state(c, away, request.arrival_ms)))
        return rows

    def _predict(self, scored: Sequence[_Scored]) -> None:
        rows = [r for s in scored for r in s.rows]
        # A missing row or a value not finite would turn into a wrong pick or an exception, where the heuristics
        # can still decide. (The remote clients check the rows too; the in-process one need not.)
        p = self.predictor.predict(rows, self.deadline_s).check_rows(len(rows), "the answer").check_finite("the answer")
        start = 0
        for s in scored:
            stop = start + len(s.rows)
            s.ttft, s.ttft_mean = p.ttft_quantile_ms[start:stop].copy(), p.ttft_mean_ms[start:stop].copy()
            s.tpot, s.tpot_mean = p.tpot_quantile_ms[start:stop].copy(), p.tpot_mean_ms[start:stop].copy()
            start = stop
            if self.config.timeslice:
                self._add_swap_risk(s)

    def _add_swap_risk(self, s: _Scored) -> None:
        """Time-sliced endpoints that serve now may be swapped out mid-request (timeslice.swap_risk_ms). Kept within
        `MAX_PREDICTED_MS`, the most a prediction says: the service serves an overflow as that bound, and stretched
        past it, the prediction would be refused with the request's outcome (`Observation`)."""
        for i, c in enumerate(s.candidates):
            group = c.timeslice_group
            if not group or not self._residency.serving(group):
                continue
            ttft = self._residency.swap_risk_ms(group, np.array([s.ttft[i], s.ttft_mean[i]]))
            s.ttft[i], s.ttft_mean[i] = np.minimum(ttft, MAX_PREDICTED_MS)
            factor = self._residency.swap_risk_factor(group)
            s.tpot[i] = min(s.tpot[i] * factor, MAX_PREDICTED_MS)
            s.tpot_mean[i] = min(s.tpot_mean[i] * factor, MAX_PREDICTED_MS)

    # ----- picking -----------------------------------------------------------------------------------------

    def _latency_scores(self, request: RouteRequest, s: _Scored) -> np.ndarray:
        if request.ttft_slo_ms is None and request.tpot_slo_ms is None:
            return latency_scores(s.ttft_mean, s.tpot_mean, self._output_tokens, s.ttft)
        tolerance = self.config.comfort_tolerance
        last_sent = None
        if tolerance > 0:
            last_sent = np.array([self._last_sent.get(c.endpoint_id, -math.inf) for c in s.candidates])
        scores = comfortable_scores(
            s.ttft,
            s.tpot,
            s.ttft_mean,
            request.ttft_slo_ms,
            request.tpot_slo_ms,
            self.config.comfort,
            tolerance,
            last_sent,
        )
        if scores is None:
            scores = slo_scores(s.ttft, s.tpot, request.ttft_slo_ms, request.tpot_slo_ms)
        elif last_sent is not None:
            return scores
        return self._shared_steps(s, scores)

    def _shared_steps(self, s: _Scored, scores: np.ndarray) -> np.ndarray:
        """`scores` weighed by what the request's prefill takes from the requests decoding on each candidate."""
        if not self.config.decode_harm or float(scores.max()) < FEASIBLE:
            return scores
        in_flight = self.ledgers.decoding.inverse_slo_sums([c.endpoint_id for c in s.candidates])
        if not in_flight.any():
            return scores
        harm = decode_harm(self._vectorizer.own_prefill_ms(s.rows), self._output_tokens, in_flight)
        return shared_step_scores(scores, harm)

    def _mean_scores(self, request: RouteRequest, s: _Scored) -> np.ndarray | None:
        """SLO scores of the mean predictions: whether the request may still be saved (`preference`)."""
        if request.ttft_slo_ms is None and request.tpot_slo_ms is None:
            return None
        return slo_scores(s.ttft_mean, s.tpot_mean, request.ttft_slo_ms, request.tpot_slo_ms)

    def _overflow(self) -> str:
        if self.config.overflow != "auto":
            return self.config.overflow
        return "sink" if self.overload > self.config.overload_share else "least_bad"

    @property
    def overload(self) -> float:
        """Moving share of the recent decisions that found no candidate predicted to serve in time (kept with the
        ledgers, so that replicas sharing them judge the fleet on every replica's decisions)."""
        return self.ledgers.overload

    @overload.setter
    def overload(self, share: float) -> None:
        self.ledgers.overload = share

    def _overflow_cap_ms(self, request: RouteRequest, overflow: str) -> float | None:
        cap = self.config.overflow_cap
        if overflow == "sink" or cap <= 0 or request.ttft_slo_ms is None:
            return None
        if self.overload > self.config.overflow_cap_share:
            return None
        return cap * request.ttft_slo_ms

    def _overflow_rank(self, candidates: Sequence[Candidate]) -> np.ndarray:
        """Each candidate's place in `overflow_endpoints`, the others after them (`scorers.latency.overflow_choice`)."""
        named = self.config.overflow_endpoints
        return np.array([named.index(c.endpoint_id) if c.endpoint_id in named else len(named) for c in candidates])

    def _argmax(self, request: RouteRequest, latency: np.ndarray, s: _Scored, may_hold: bool) -> int:
        """The chosen candidate's index; -1 to hold the request (`may_hold`)."""
        c, candidates, ttft = self.config, s.candidates, s.ttft
        overflow = self._overflow()
        in_time = float(latency.max()) >= FEASIBLE
        if not request.held_ms:  # the overload share counts each request once, when it comes in
            self.ledgers.record_judgement(request.request_id, in_time)
        mean = None if in_time else self._mean_scores(request, s)  # whether it is savable (`preference`)
        if may_hold and mean is not None and float(mean.max()) < FEASIBLE:
            return -1
        scores = self.latency_weight * preference(latency, c.fit, c.fit_margin, overflow, mean)
        for extra in self.extra_scorers:
            scores = scores + extra.weight * np.asarray(extra.scorer(request, candidates))
        best = float(scores.max())
        tied = np.flatnonzero(scores >= best - 1e-12)
        if self.config.exploration > 0 and self._rng.random() < self.config.exploration:
            feasible = np.flatnonzero(latency >= FEASIBLE)
            if len(feasible) > 1:
                self.counters.explored += 1
                heard = [self._last_heard.get(candidates[int(i)].endpoint_id, -math.inf) for i in feasible]
                return int(feasible[int(np.argmin(heard))])
        if float(latency.max()) < FEASIBLE:
            # Ties among candidates predicted to miss are ties among those beyond saving (their scores clip at 0):
            # an overflow endpoint takes them, as on P/D (`pairs.choose_pair`). Spread at random they slowed every
            # endpoint down: goodput 1.8 against 8.3 requests/s on the homogeneous fleet at 1.5x.
            rank = self._overflow_rank(candidates) if self.config.overflow_endpoints else None
            return overflow_choice(scores, ttft, self._overflow_cap_ms(request, overflow), rank)
        if len(tied) == 1:
            return int(tied[0])
        return int(self._rng.choice(list(tied)))

    def _may_hold(self, request: RouteRequest) -> bool:
        """Whether `request` may be held (`LeadtimeConfig.hold_slo_multiple`)."""
        slo, multiple = request.ttft_slo_ms, self.config.hold_slo_multiple
        if slo is None or multiple <= 0 or request.held_ms >= multiple * slo:
            return False
        return request.held_ms > 0 or self.overload > self.config.overflow_cap_share

    def _budget(self, request: RouteRequest) -> RouteRequest:
        """`request` with the TTFT SLO it has left after waiting at the router."""
        slo = request.ttft_slo_ms
        if not request.held_ms or slo is None:
            return request
        return replace(request, ttft_slo_ms=max(slo - request.held_ms, 1.0))

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        """The endpoint (or P/D pair) for `request`. `candidates` are taken as able to hold it: give the ones
        `policy.candidates_that_fit` keeps (the simulator and the gateway do), since `Candidate.kv_cache_tokens` is
        not weighed here."""
        for i, c in enumerate(candidates):
            if not isinstance(c, Candidate):
                raise TypeError(f"candidates[{i}] must be a Candidate, got {type(c).__name__}")
        with self._lock:
            return self._pick(request, candidates)

    def _pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        self.counters.decisions += 1
        may_hold = self._may_hold(request)
        request = self._budget(request)
        serving, away = self._servable(request, candidates)
        if not serves_clients(serving):  # none resident, or prefill endpoints alone: all compete, with their waits
            self.counters.all_non_resident += 1
            serving, away = [], [*serving, *away]
        roles = split_by_role(serving or away)
        try:
            if roles.disaggregated:
                if serving:
                    self.counters.timeslice_filtered += len(away)
                chosen = self._pick_pair(request, list(roles.prefill), list(roles.decode), not serving, may_hold)
            elif not serving:
                chosen = self._pick_one(request, [], list(roles.unified), may_hold)
            else:
                # An away prefill endpoint serves no client alone: only whole-request endpoints may compete.
                whole = [c for c in away if c.state.role != "prefill"]
                chosen = self._pick_one(request, list(roles.unified), whole, may_hold)
        except PredictorError as err:
            if not isinstance(err, PredictorUnavailable):  # a deadline missed or an outage is counted, not said
                self._candidates_refused(err)
            self.fallback_error = err
            chosen = self._fall_back(request, serving or away, not serving)
        if chosen.hold:
            self.counters.held += 1
            return chosen
        for endpoint_id in (chosen.endpoint_id, chosen.decode_endpoint_id):
            if endpoint_id is not None:  # heard from when its outcome comes, unless it leaves first
                self._last_heard.setdefault(endpoint_id, -math.inf)
        if self.config.decode_harm and request.tpot_slo_ms is not None:  # only the weighing reads them
            decodes_on = chosen.decode_endpoint_id or chosen.endpoint_id
            self.ledgers.record_decoding(decodes_on, request.request_id, request.tpot_slo_ms)
        return chosen

    def _record_prefill(self, endpoint_id: str, request: RouteRequest, row: FeatureRow) -> None:
        """`request`, scored on `row`, was sent to `endpoint_id` to be prefilled there."""
        self.ledgers.record_prefill(
            endpoint_id, Sent(request.request_id, request.arrival_ms, row.request.uncached_tokens, request.input_tokens)
        )

    def _fall_back(self, request: RouteRequest, candidates: list[Candidate], away: bool) -> Pick:
        """The heuristics decide. The request still counts in flight where it went and is learned from (with
        nothing predicted): the predictor misses its deadline when the machine is busiest, and the outcomes of
        those moments are the last to leave out."""
        self.counters.fallbacks += 1
        pick = self._fallback.pick(request, candidates)
        by_id = {c.endpoint_id: c for c in candidates}
        prefill, now = by_id[pick.endpoint_id], request.arrival_ms
        (row,) = self._rows(request, [prefill], away)
        self._record_prefill(prefill.endpoint_id, request, row)
        decode_row, transfer, decode_group = None, 0.0, prefill.timeslice_group
        if pick.decode_endpoint_id is not None and pick.decode_endpoint_id != pick.endpoint_id:
            decode = by_id[pick.decode_endpoint_id]
            (decode_row,) = self._rows(request, [decode], away, decode_side=True)
            transfer, decode_group = float(self._transfer_ms(request, [decode])[0]), decode.timeslice_group
            # Nothing predicted: the prefill is taken to end when the roofline says, its queue left out.
            ready = now + self._roofline_prefill_ms(row)
            link_free = self.ledgers.inflight.link_free_ms(decode.endpoint_id, now) if self.config.inflight else now
            self.ledgers.record_decode(
                decode.endpoint_id,
                Sent(
                    request.request_id,
                    now,
                    0,
                    request.input_tokens,
                    kv_arrival_ms=max(ready, link_free) + transfer,
                    ready_ms=ready,
                    transfer_ms=transfer,
                ),
            )
        self._remember(
            request.request_id,
            _Decision(row, decode_row, None, None, transfer, now, prefill.timeslice_group, decode_group),
        )
        return pick

    def _roofline_prefill_ms(self, row: FeatureRow) -> float:
        """The row's prefill alone, as the roofline has it; 0 on hardware the catalog does not know (a fallback
        must still route when the predictor refused the row for that)."""
        try:
            return float(self._vectorizer.own_prefill_ms([row])[0])
        except FeatureError:
            return 0.0

    def _pick_one(
        self, request: RouteRequest, serving: list[Candidate], away: list[Candidate], may_hold: bool = False
    ) -> Pick:
        """The best candidate. Endpoints swapped out for the other job are left out while a serving one is predicted
        to meet the request's SLOs; otherwise (none serves, or the serving ones are all predicted to miss, as under
        overload) they compete too, each predicted with its expected wait until it is back: a queue that waits
        out a swap is served when the group returns, and leaving those endpoints idle would waste them then."""
        if not serving and not away:
            raise NoCandidateError("no candidate endpoints")
        parts = []
        if serving:
            parts.append(_Scored(serving, self._rows(request, serving, False)))
        if away:
            parts.append(_Scored(away, self._rows(request, away, True)))
        self._predict(parts)
        s = parts[0]
        latency = self._latency_scores(request, s)
        if len(parts) == 2:
            if float(latency.max()) >= FEASIBLE:
                self.counters.timeslice_filtered += len(away)
            else:
                s = _Scored(
                    serving + away,
                    parts[0].rows + parts[1].rows,
                    *(np.concatenate([getattr(parts[0], k), getattr(parts[1], k)]) for k in _PREDICTED),
                )
                latency = self._latency_scores(request, s)
        i = self._argmax(request, latency, s, may_hold)
        if i < 0:
            return Pick.held()
        chosen, row = s.candidates[i], s.rows[i]
        self._last_sent[chosen.endpoint_id] = request.arrival_ms
        self._record_prefill(chosen.endpoint_id, request, row)
        ttft, tpot = float(s.ttft_mean[i]), float(s.tpot_mean[i])
        group = chosen.timeslice_group
        ttft_q, tpot_q = float(s.ttft[i]), float(s.tpot[i])
        self._remember(
            request.request_id, _Decision(row, None, ttft, tpot, 0.0, request.arrival_ms, group, group, ttft_q, tpot_q)
        )
        return Pick(chosen.endpoint_id, row=row, predicted_ttft_ms=ttft, predicted_tpot_ms=tpot)

    def _transfer_ms(self, request: RouteRequest, decode: Sequence[Candidate]) -> np.ndarray:
        return np.array(
            [
                kv_transfer_ms(
                    self.config.catalog.model(c.state.model),
                    request.input_tokens,
                    self.config.kv_link_gb_s,
                    c.state.tensor_parallel,
                )
                if c.state.model
                else 0.0
                for c in decode
            ]
        )

    def _pick_pair(
        self,
        request: RouteRequest,
        prefill: list[Candidate],
        decode: list[Candidate],
        away: bool,
        may_hold: bool = False,
    ) -> Pick:
        if not decode:
            raise NoCandidateError("P/D fleet has no servable decode endpoint")
        now, config = request.arrival_ms, self.config
        if config.joint_pairs:
            local_allowed = config.local_prefill or not prefill
        else:  # llm-d: disaggregate above a fixed number of uncached prompt tokens
            local_allowed = request.input_tokens < config.disaggregate_min_tokens or not prefill
        p = _Scored(prefill, self._rows(request, prefill, away))
        d = _Scored(decode, self._rows(request, decode, away, decode_side=True))
        local = _Scored(decode, self._rows(request, decode, away)) if local_allowed else None
        self._predict([p, d] if local is None else [p, d, local])
        local_ttft, local_mean = (None, None) if local is None else (local.ttft, local.ttft_mean)
        if local is not None and config.joint_pairs and prefill and request.tpot_slo_ms is not None:
            # Prefill chunks share the decode steps of every request on that endpoint: only where it decodes far
            # inside the ITL SLO can it take them (prefilled anywhere, goodput on pd_hetero at 1.5x fell by 13%).
            busy = d.tpot > config.local_prefill_itl_share * request.tpot_slo_ms
            local_ttft, local_mean = np.where(busy, np.inf, local.ttft), np.where(busy, np.inf, local.ttft_mean)
        link_free = np.array(
            [self.ledgers.inflight.link_free_ms(c.endpoint_id, now) if config.inflight else now for c in decode]
        )
        transfer = self._transfer_ms(request, decode)
        overflow = self._overflow()
        if not config.joint_pairs and local is not None:
            # llm-d's rule is a threshold, not a comparison: below it, prefill where the request decodes.
            prefill_ttft = prefill_mean = np.zeros(0)
            scored_prefill: list[Candidate] = []
        else:
            prefill_ttft, prefill_mean = p.ttft, p.ttft_mean
            scored_prefill = prefill
        choice = choose_pair(
            PairPredictions(
                prefill_ttft,
                prefill_mean,
                d.tpot,
                d.tpot_mean,
                local_ttft,
                local_mean,
                link_free,
                transfer,
            ),
            now,
            request.ttft_slo_ms,
            request.tpot_slo_ms,
            self._output_tokens,
            decode_first=not config.joint_pairs and local is None,
            fit=(config.fit, config.fit_margin, overflow),
            overflow_cap_ms=self._overflow_cap_ms(request, overflow),
            overflow_rank=(self._overflow_rank(scored_prefill), self._overflow_rank(decode))
            if config.overflow_endpoints
            else None,
        )
        if not request.held_ms:
            self.ledgers.record_judgement(request.request_id, choice.score >= FEASIBLE)
        if may_hold and not choice.saveable:
            return Pick.held()
        dec = decode[choice.decode]
        if choice.prefill is None:
            assert local is not None
            self.counters.local_prefill += 1
            row = local.rows[choice.decode]
            self._record_prefill(dec.endpoint_id, request, row)
            group, ttft_q, tpot_q = dec.timeslice_group, choice.ttft_ms, choice.itl_ms
            self._remember(
                request.request_id,
                _Decision(row, None, choice.ttft_mean_ms, choice.itl_mean_ms, 0.0, now, group, group, ttft_q, tpot_q),
            )
            return Pick(
                dec.endpoint_id, row=row, predicted_ttft_ms=choice.ttft_mean_ms, predicted_tpot_ms=choice.itl_mean_ms
            )
        self.counters.disaggregated += 1
        pre = prefill[choice.prefill]
        row, decode_row = p.rows[choice.prefill], d.rows[choice.decode]
        prefill_done = now + float(p.ttft_mean[choice.prefill])
        kv_arrival = max(prefill_done, float(link_free[choice.decode])) + choice.transfer_ms
        self._record_prefill(pre.endpoint_id, request, row)
        self.ledgers.record_decode(
            dec.endpoint_id,
            Sent(
                request.request_id,
                now,
                0,
                request.input_tokens,
                kv_arrival_ms=kv_arrival,
                ready_ms=prefill_done,
                transfer_ms=choice.transfer_ms,
            ),
        )
        self._remember(
            request.request_id,
            _Decision(
                row,
                decode_row,
                choice.ttft_mean_ms,
                choice.itl_mean_ms,
                choice.wait_ms + choice.transfer_ms,
                now,
                pre.timeslice_group,
                dec.timeslice_group,
                predicted_tpot_quantile_ms=choice.itl_ms,
                prefill_ttft_ms=float(p.ttft_mean[choice.prefill]),
                prefill_ttft_quantile_ms=float(p.ttft[choice.prefill]),
            ),
        )
        return Pick(
            pre.endpoint_id,
            dec.endpoint_id,
            row=row,
            decode_row=decode_row,
            predicted_ttft_ms=choice.ttft_mean_ms,
            predicted_tpot_ms=choice.itl_mean_ms,
        )

    # ----- learning ----------------------------------------------------------------------------------------

    def _remember(self, request_id: str, decision: _Decision) -> None:
        """Keep what was decided until the outcome comes (`observe`) or the request is given up (`abandon`); a
        caller that does neither for a pick would otherwise grow this without bound: past `MAX_OPEN_DECISIONS`
        the oldest is forgotten (it could only be learned from late), and abandoned in the ledgers too, where it
        would otherwise count in flight, and weigh on its endpoint's score, for good."""
        self._decisions.pop(request_id, None)  # decided again (a retry): it is the newest, not forgotten first
        self._decisions[request_id] = decision
        if len(self._decisions) > MAX_OPEN_DECISIONS:
            oldest = next(iter(self._decisions))
            del self._decisions[oldest]
            self.ledgers.complete(oldest)

    def abandon(self, request_id: str) -> None:
        """The request will not complete where it was sent (it failed, or was retried elsewhere): forget it."""
        with self._lock:
            self.ledgers.complete(request_id)
            self._decisions.pop(request_id, None)

    def observe(self, outcome: Outcome) -> None:
        with self._lock:
            self._observe(outcome)

    def forget_endpoint(self, endpoint_id: str) -> None:
        """The endpoint left the fleet, or came back under its name at another server (a new pod, heard from and
        sent nothing yet): drop what is kept of it by name. In Kubernetes endpoint names are pod names, and every
        rollout would otherwise add entries for ever; its requests still in flight complete as usual (the ledgers
        let go of them then)."""
        with self._lock:
            self._last_sent.pop(endpoint_id, None)
            self._last_heard.pop(endpoint_id, None)

    def _observe(self, outcome: Outcome) -> None:
        self.ledgers.complete(outcome.request_id)
        decision = self._decisions.pop(outcome.request_id, None)
        if decision is None:
            return  # never decided here, or abandoned: it says nothing of what this policy sent
        for endpoint_id in (outcome.endpoint_id, outcome.decode_endpoint_id):
            if endpoint_id in self._last_heard:  # not one that left the fleet since (`forget_endpoint`)
                self._last_heard[endpoint_id] = outcome.completed_ms
        self._output_tokens += 0.01 * (outcome.output_tokens - self._output_tokens)
        itl = outcome.learned_itl_ms
        ttft = outcome.ttft_ms
        if self.config.timeslice:  # learn the endpoint's own speed: the swap-out risk is added when deciding
            first_token = decision.decided_ms + ttft
            if decision.prefill_group:
                away = self._residency.away_overlap_ms(decision.prefill_group, decision.decided_ms, first_token)
                ttft = max(ttft - away, 0.05 * ttft)
            if itl and decision.decode_group:
                away = self._residency.away_overlap_ms(decision.decode_group, first_token, outcome.completed_ms)
                itl = max(itl - away / (outcome.output_tokens - 1), 0.05 * itl)
        stamp = outcome.completed_ms / 1e3
        if decision.decode_row is None:
            observations = [
                Observation.of_request(
                    decision.row,
                    ttft,
                    itl,
                    stamp,
                    decision.predicted_ttft_ms,
                    decision.predicted_ttft_quantile_ms,
                    decision.predicted_tpot_ms,
                    decision.predicted_tpot_quantile_ms,
                )
            ]
        else:
            prefill_ttft = max(ttft - decision.transfer_ms, 0.05 * ttft)
            observations = [
                Observation(
                    decision.row,
                    prefill_ttft,
                    0.0,
                    decision.prefill_ttft_ms,
                    None,
                    stamp,
                    decision.prefill_ttft_quantile_ms,
                )
            ]
            if itl:
                tpot, tpot_quantile = decision.predicted_tpot_ms, decision.predicted_tpot_quantile_ms
                observations.append(Observation(decision.decode_row, 0.0, itl, None, tpot, stamp, None, tpot_quantile))
        try:
            learned = self.predictor.observe(observations, self.deadline_s)
        except PredictorError as err:
            self.counters.unreported += len(observations)  # the predictor could not take them; routing goes on
            self._refused(err)
            return
        self.counters.learned += learned
        if self._refusal is not None:
            log.info("the predictor takes this router's observations again")
            self._refusal = None

    def _candidates_refused(self, err: PredictorError) -> None:
        """Said once per reason: a candidate the predictor refuses (of a class it does not know), or an answer that
        cannot be routed on, sends every decision it is in to the heuristics, and nothing else would say why."""
        if self._candidate_refusals.first(err.message):
            what = (
                "answers what cannot be routed on"
                if err.status == INVALID_ANSWER
                else "refuses a decision's candidates"
            )
            log.warning("the predictor %s (%s): the heuristics decide while it does", what, err)

    def _refused(self, err: PredictorError) -> None:
        """Said once per cause: a router whose predictor refuses what it is told (a token it lacks) routes on what
        the predictor knew, for ever, and nothing else would say so."""
        cause = f"{type(err).__name__} {err.status}"
        if cause != self._refusal:
            what = "cannot be reached" if isinstance(err, PredictorUnavailable) else "refuses observations"
            log.warning("the predictor %s (%s): this router learns nothing meanwhile", what, err)
            self._refusal = cause
