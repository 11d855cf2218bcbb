"""llm-d's predicted-latency router, re-implemented from its documentation, as a peer for the benchmark.

Source: llm-d's "predicted latency" scheduling (the llm-d-inference-scheduler's SLO-aware profile with the
llm-d-latency-predictor sidecars), as described in its guides:

- One model per target (TTFT, TPOT) over llm-d's features only: no endpoint identity, no accelerator class, no
  P/D pair, no time-slice state. The model is `predictor` (in the benchmark, `leadtime.predictor.llmd_reference`,
  llm-d's training server's store and trees), starting cold.
- The router counts the tokens it has in flight per endpoint, from the responses it streams back (the rule
  `router_plugin.gateway.inflight_work` keeps too): `prefill_tokens_in_flight` is the uncached prompt tokens of
  the requests it sent there to prefill whose first token has not come back; `decode_tokens_in_flight` the
  prompt and generated tokens of those it sent there to decode, from their first token until they complete (on
  P/D the decode endpoint; on a unified fleet the same endpoint, once its prefill is done). The routing contract
  reports the first token (`prefilled`) and the completion, not the tokens between, so a request counts its
  prompt plus one token as decode work. Waiting, running and KV use come from the scraped state.
- Prefix-affinity gates: if some endpoint holds ≥ 99% of the prompt, only those are considered; else if some
  hold ≥ 80%, only those.
- Headroom: h = SLO − predicted for each target; an endpoint with h ≥ 0 on both is "positive". The combined
  headroom is 0.8·h_ttft/SLO_ttft + 0.2·h_tpot/SLO_tpot. 99% of the time the pick is among the positive endpoints
  when there are any (the one with the most combined headroom), else among the others (the least negative);
  1% of the time it picks from the other group, which keeps every endpoint observed.
- P/D: the decode endpoint is picked first (by TPOT headroom), then the prefill endpoint (by TTFT headroom),
  each alone; a prompt with fewer than `disaggregate_min_tokens` uncached tokens is not disaggregated (16 in
  llm-d's sample configuration).
- Learning: each completed request becomes one TTFT row (num_tokens_generated 0) and one TPOT row, with the
  features the router had when it decided, as llm-d's sidecar records them. The training server retrains on a
  timer (llm-d deploys it every 10 s, or every 1,800 s): `retrain_every_ms` of the router's clock (10 s).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest, split_by_role

HEADROOM_WEIGHTS = (0.8, 0.2)
AFFINITY_GATES = (0.99, 0.80)
POSITIVE_SHARE = 0.99


class LlmdModel(Protocol):
    """What llm-d's predictor offers: predictions and learning over llm-d rows, and retraining on demand."""

    def predict_many(self, rows: Sequence[Mapping[str, Any]]) -> Any: ...

    def learn_many(self, rows: Sequence[Mapping[str, Any]]) -> None: ...

    def retrain(self) -> None: ...


@dataclass
class _Decision:
    rows: list[dict[str, Any]]  # the prefill-side row, then (on P/D) the decode-side row
    ttft_ms: float
    tpot_ms: float


@dataclass
class _InFlight:
    """Where one routed request counts: its uncached prompt on `prefill_on` until its first token, then its prompt
    and that token on `decode_on`."""

    prefill_on: str
    uncached: int
    decode_on: str
    decode_tokens: int
    decoding: bool = False


@dataclass
class _Counters:
    prefill: dict[str, int] = field(default_factory=dict)
    decode: dict[str, int] = field(default_factory=dict)
    routed: dict[str, _InFlight] = field(default_factory=dict)

    def start(self, request: RouteRequest, prefill_on: Candidate, decode_on: str) -> None:
        """Count the request where it is sent. One routed again under its id (a retry) moves: what it counted where
        it was sent before, which its outcome would not take back, goes first."""
        self.complete(request.request_id)
        uncached = request.input_tokens - min(prefill_on.prefix_hit_tokens, request.input_tokens)
        eid = prefill_on.endpoint_id
        self.prefill[eid] = self.prefill.get(eid, 0) + uncached
        self.routed[request.request_id] = _InFlight(eid, uncached, decode_on, request.input_tokens + 1)

    def first_token(self, request_id: str) -> None:
        f = self.routed.get(request_id)
        if f is None or f.decoding:
            return
        f.decoding = True
        self.prefill[f.prefill_on] -= f.uncached
        self.decode[f.decode_on] = self.decode.get(f.decode_on, 0) + f.decode_tokens

    def complete(self, request_id: str) -> None:
        f = self.routed.pop(request_id, None)
        if f is None:
            return
        if f.decoding:
            self.decode[f.decode_on] -= f.decode_tokens
        else:
            self.prefill[f.prefill_on] -= f.uncached


class LlmdPredictedPolicy:
    """llm-d's predicted-latency routing (see the module docstring).

    Parameters
    ----------
    model
        llm-d's predictor (an `LlmdModel`).
    objective
        Which of its predictions to route on ("quantile" or "mean"); predictions of the mean are reported.
    disaggregate_min_tokens
        On P/D, prompts with fewer uncached tokens are prefilled on the decode endpoint.
    retrain_every_ms
        The training server's timer, on the router's clock; None leaves retraining to the model.
    seed
        Seeds the 1% picks from the other group and ties.
    """

    name = "llmd_predicted"

    def __init__(
        self,
        model: LlmdModel,
        objective: str = "quantile",
        disaggregate_min_tokens: int = 16,
        retrain_every_ms: float | None = 10_000.0,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.objective = objective
        self.disaggregate_min_tokens = disaggregate_min_tokens
        self.retrain_every_ms = retrain_every_ms
        self._last_retrain_ms = 0.0
        self._rng = random.Random(seed)
        self._counters = _Counters()
        self._decisions: dict[str, _Decision] = {}

    def _row(self, request: RouteRequest, c: Candidate, pod_type: str, cached: bool = True) -> dict[str, Any]:
        s = c.state
        hits = min(c.prefix_hit_tokens, request.input_tokens) if cached else 0
        return {
            "kv_cache_percentage": s.kv_cache_percentage,
            "input_token_length": request.input_tokens,
            "num_request_waiting": s.num_request_waiting,
            "num_request_running": s.num_request_running,
            "num_tokens_generated": 0,
            "prefix_cache_score": hits / request.input_tokens if request.input_tokens else 0.0,
            "pod_type": pod_type,
            "prefill_tokens_in_flight": self._counters.prefill.get(c.endpoint_id, 0),
            "decode_tokens_in_flight": self._counters.decode.get(c.endpoint_id, 0),
        }

    def _predict(self, rows: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(TTFT routed on, TPOT routed on, TTFT mean, TPOT mean) per row."""
        p = self.model.predict_many(rows)

        def pick(target: str, objective: str) -> np.ndarray:
            value = getattr(p, f"{target}_{objective}", None)
            if value is None:
                value = getattr(p, f"{target}_{'mean' if objective == 'quantile' else 'quantile'}")
            return np.asarray(value, dtype=np.float64)

        return pick("ttft", self.objective), pick("tpot", self.objective), pick("ttft", "mean"), pick("tpot", "mean")

    def _headroom(
        self, request: RouteRequest, ttft: np.ndarray, tpot: np.ndarray, weights: tuple[float, float] = HEADROOM_WEIGHTS
    ) -> tuple[np.ndarray, np.ndarray]:
        """(combined headroom, positive) per candidate; an absent SLO is met by any prediction."""
        combined = np.zeros(len(ttft))
        positive = np.ones(len(ttft), dtype=bool)
        for slo, predicted, weight in (
            (request.ttft_slo_ms, ttft, weights[0]),
            (request.tpot_slo_ms, tpot, weights[1]),
        ):
            if slo is None or weight == 0:
                continue
            h = slo - predicted
            combined += weight * h / slo
            positive &= h >= 0
        if request.ttft_slo_ms is None and request.tpot_slo_ms is None:
            combined = -(weights[0] * ttft + weights[1] * tpot)  # no SLO: the lowest predicted latency
        return combined, positive

    def _choose(self, combined: np.ndarray, positive: np.ndarray) -> int:
        groups = [np.flatnonzero(positive), np.flatnonzero(~positive)]
        preferred, other = (groups[0], groups[1]) if len(groups[0]) else (groups[1], groups[0])
        if len(other) and self._rng.random() >= POSITIVE_SHARE:
            preferred = other
        best = preferred[np.flatnonzero(combined[preferred] >= combined[preferred].max() - 1e-12)]
        return int(best[0]) if len(best) == 1 else int(self._rng.choice(list(best)))

    def _gate(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        if request.input_tokens <= 0:
            return list(candidates)
        for gate in AFFINITY_GATES:
            kept = [c for c in candidates if c.prefix_hit_tokens / request.input_tokens >= gate]
            if kept:
                return kept
        return list(candidates)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        roles = split_by_role(candidates)
        if not roles.disaggregated:
            pool = self._gate(request, roles.unified)
            rows = [self._row(request, c, "") for c in pool]
            ttft, tpot, ttft_mean, tpot_mean = self._predict(rows)
            i = self._choose(*self._headroom(request, ttft, tpot))
            chosen = pool[i]
            self._counters.start(request, chosen, chosen.endpoint_id)
            self._decisions[request.request_id] = _Decision([rows[i]], float(ttft_mean[i]), float(tpot_mean[i]))
            return Pick(
                chosen.endpoint_id, predicted_ttft_ms=float(ttft_mean[i]), predicted_tpot_ms=float(tpot_mean[i])
            )
        decode = list(roles.decode)
        decode_rows = [self._row(request, c, "decode", cached=False) for c in decode]
        _, d_tpot, _, d_tpot_mean = self._predict(decode_rows)
        d = self._choose(*self._headroom(request, np.zeros(len(decode)), d_tpot, (0.0, 1.0)))
        best_decode = decode[d]
        uncached = request.input_tokens - max((c.prefix_hit_tokens for c in roles.prefill), default=0)
        if uncached < self.disaggregate_min_tokens or not roles.prefill:
            row = self._row(request, best_decode, "decode")
            ttft, _, ttft_mean, _ = self._predict([row])
            self._counters.start(request, best_decode, best_decode.endpoint_id)
            self._decisions[request.request_id] = _Decision([row], float(ttft_mean[0]), float(d_tpot_mean[d]))
            return Pick(
                best_decode.endpoint_id, predicted_ttft_ms=float(ttft_mean[0]), predicted_tpot_ms=float(d_tpot_mean[d])
            )
        prefill = self._gate(request, roles.prefill)
        prefill_rows = [self._row(request, c, "prefill") for c in prefill]
        p_ttft, _, p_ttft_mean, _ = self._predict(prefill_rows)
        p = self._choose(*self._headroom(request, p_ttft, np.zeros(len(prefill)), (1.0, 0.0)))
        chosen = prefill[p]
        self._counters.start(request, chosen, best_decode.endpoint_id)
        self._decisions[request.request_id] = _Decision(
            [prefill_rows[p], decode_rows[d]], float(p_ttft_mean[p]), float(d_tpot_mean[d])
        )
        return Pick(
            chosen.endpoint_id,
            best_decode.endpoint_id,
            predicted_ttft_ms=float(p_ttft_mean[p]),
            predicted_tpot_ms=float(d_tpot_mean[d]),
        )

    def follow(self, request: RouteRequest, candidates: Sequence[Candidate], pick: Pick) -> tuple[float, float]:
        """Predict and count another router's pick as if this router had made it; its (TTFT, TPOT) mean predictions.

        For measuring llm-d's predictor on the very requests another policy routed: what this router would have
        predicted for the endpoints that policy chose, with its own features and tokens-in-flight counters, and
        learning from their outcomes through `observe` as it would from its own.
        """
        by_id = {c.endpoint_id: c for c in candidates}
        first = by_id[pick.endpoint_id]
        if first.state.role == "both":
            row = self._row(request, first, "")
            _, _, ttft, tpot = self._predict([row])
            rows, decode_id = [row], first.endpoint_id
        elif pick.decode_endpoint_id is None or pick.decode_endpoint_id == pick.endpoint_id:
            row = self._row(request, first, "decode")  # prefilled on the decode endpoint, as below the threshold
            _, _, means_ttft, means_tpot = self._predict([row, self._row(request, first, "decode", cached=False)])
            ttft, tpot = means_ttft[:1], means_tpot[1:]
            rows, decode_id = [row], first.endpoint_id
        else:
            decode = by_id[pick.decode_endpoint_id]
            rows = [self._row(request, first, "prefill"), self._row(request, decode, "decode", cached=False)]
            _, _, means_ttft, means_tpot = self._predict(rows)
            ttft, tpot = means_ttft[:1], means_tpot[1:]
            decode_id = decode.endpoint_id
        self._counters.start(request, first, decode_id)
        self._decisions[request.request_id] = _Decision(rows, float(ttft[0]), float(tpot[0]))
        return float(ttft[0]), float(tpot[0])

    def prefilled(self, request_id: str, now_ms: float) -> None:
        """The first token came back: the request's uncached prompt leaves the prefill count, and its prompt and
        that token count as decode work where it decodes (llm-d's accounting; see the module docstring)."""
        self._counters.first_token(request_id)

    def abandon(self, request_id: str) -> None:
        """The request failed: it leaves the counters, as llm-d's response-complete hook does for any request, and
        teaches nothing (it has no latency to learn)."""
        self._counters.complete(request_id)
        self._decisions.pop(request_id, None)

    def observe(self, outcome: Outcome) -> None:
        self._counters.complete(outcome.request_id)
        decision = self._decisions.pop(outcome.request_id, None)
        if decision is None:
            return
        prefill_row, decode_row = decision.rows[0], decision.rows[-1]
        rows = [dict(prefill_row, actual_ttft_ms=outcome.ttft_ms, actual_tpot_ms=0.0)]
        if outcome.output_tokens > 1 and outcome.itl_ms > 0:
            rows.append(
                dict(
                    decode_row,
                    num_tokens_generated=outcome.output_tokens - 1,
                    actual_ttft_ms=0.0,
                    actual_tpot_ms=outcome.itl_ms,
                )
            )
        self.model.learn_many(rows)
        if self.retrain_every_ms is not None and outcome.completed_ms - self._last_retrain_ms >= self.retrain_every_ms:
            self._last_retrain_ms = outcome.completed_ms
            self.model.retrain()
