"""Simulated llm-d training traces: what llm-d's latency-predictor sidecar records, from a simulated fleet.

A trace is generated the way the real ones were recorded: inference-perf-like load stages (Poisson arrivals at
each stage's rate), routed by llm-d's default scorer, prefix caching off (prompts share no blocks). Each request
gives llm-d's sidecar two training rows, both carrying the endpoint's state when the request arrived:

- a TTFT row when its first token arrives (`num_tokens_generated` 0, `actual_tpot_ms` 0);
- a TPOT row when it completes (`actual_ttft_ms` 0, the mean inter-token latency), if it produced two tokens.

Rows are written in the order those events happen, which is the order a prequential walk learns them in.
The state is what llm-d's router knows: waiting, running and KV use as last scraped (every `refresh_ms`), and its
own counts of what it has in flight there — `prefill_tokens_in_flight`, the prompt tokens of requests that have
not had their first token (each rounded up to 64 tokens, as in llm-d's sharegpt-h200 rows), and
`decode_tokens_in_flight`, prompt plus generated tokens of those decoding.

What a real server adds to the simulator's physics is in: the fleet's step jitter and per-endpoint speed spread,
preemption (the KV cache fills under load), and the API server's own time per request (HTTP, tokenization),
drawn per request and added to the TTFT the client sees.

Traces are deterministic for their spec and cached under `cache_dir()` by a hash of the spec and of the
simulator's code, so a second `bench accuracy --data sim:NAME` reads the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leadtime.data import shipped_name
from leadtime.features.rows import (
    ACTUAL_FIELDS,
    LLMD_MODEL_INPUTS,
    FeatureRow,
    Observation,
    observation_to_llmd,
)
from leadtime.router_plugin.heuristics import LlmdHeuristicPolicy
from leadtime.router_plugin.policy import Candidate, Outcome, Pick, RouteRequest
from leadtime.simulator.endpoint import Endpoint, SimRequest
from leadtime.simulator.engine import CompletedRequest, FleetSimulator
from leadtime.simulator.fleet import load_fleet, resolve_fleet
from leadtime.simulator.workload import WorkloadRequest

# llm-d's router counts a request's prompt in 64-token units (every prefill_tokens_in_flight of sharegpt-h200 is
# a multiple of 64, and the first rows add up as ceil(prompt / 64) · 64).
_PREFILL_UNIT = 64
# llm-d's training row as its sidecar records it here: no pod type or encoder sizes (one role, text only).
_LLMD_FIELDS = (*LLMD_MODEL_INPUTS, *ACTUAL_FIELDS, "timestamp")
# Leadtime's extras, kept where a router would know them (several accelerator classes, P/D roles).
_EXTRA_FIELDS = ("pod_type", "endpoint_id", "accelerator", "model", "tensor_parallel")


@dataclass(frozen=True)
class TraceSpec:
    """One simulated trace.

    Parameters
    ----------
    fleet
        A shipped fleet name.
    prompts
        The prompt-length mix (`PROMPT_MIXES`).
    stages_qps, stage_s
        inference-perf's stages: each rate for `stage_s` seconds, one after the other.
    extras
        Keep Leadtime's extra fields (accelerator, endpoint, role); off, rows have llm-d's schema alone.
    timeout_s
        The load generator's request timeout: a request still queued that long after it was sent is abandoned
        (vLLM aborts it; llm-d records no row of it).
    api_overhead_ms
        Median of the API server's time per request (log-normal, σ 0.4), added to the TTFT the client sees.
    """

    fleet: str
    prompts: str
    stages_qps: tuple[float, ...] = (1, 2, 4, 8, 16)
    stage_s: float = 120.0
    extras: bool = False
    timeout_s: float = 60.0
    api_overhead_ms: float = 20.0
    seed: int = 0


def _clipped_lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(max(round(median * math.exp(rng.gauss(0.0, sigma))), low), high))


def _bimodal(rng: random.Random) -> int:
    """Short chats and long documents, half and half: median ~3.4k tokens, up to 12k."""
    if rng.random() < 0.45:
        return _clipped_lognormal(rng, 450, 0.8, 16, 2500)
    return _clipped_lognormal(rng, 6000, 0.4, 2500, 12000)


def _long_chat(rng: random.Random) -> int:
    """A chatbot with long conversation histories: median ~6.5k tokens, up to 12.6k."""
    return _clipped_lognormal(rng, 6500, 0.35, 1000, 12600)


PROMPT_MIXES = {"bimodal": _bimodal, "long-chat": _long_chat}


def _output_tokens(rng: random.Random) -> int:
    """Chat answers: median ~250 tokens, up to 1,024."""
    return _clipped_lognormal(rng, 250, 0.9, 1, 1024)


def staged_workload(spec: TraceSpec) -> list[WorkloadRequest]:
    """Poisson arrivals at each stage's rate, one stage after the other; prompts share no prefix."""
    rng = random.Random(spec.seed)
    prompts = PROMPT_MIXES[spec.prompts]
    out: list[WorkloadRequest] = []
    start = 0.0
    for qps in spec.stages_qps:
        clock, end = start, start + spec.stage_s * 1e3
        while True:
            clock += rng.expovariate(qps) * 1e3
            if clock >= end:
                break
            out.append(WorkloadRequest(clock, prompts(rng), _output_tokens(rng)))
        start = end
    return out


class _ClientSimulator(FleetSimulator):
    """The fleet behind a load generator that gives up on a request still queued `timeout_ms` after sending it
    (the client disconnects and vLLM aborts it: it leaves the queue and is never recorded)."""

    def __init__(self, *args: Any, timeout_ms: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_ms = timeout_ms
        self.deadlines: deque[tuple[float, SimRequest, str]] = deque()
        self.aborted: set[int] = set()

    def _expire(self) -> None:
        while self.deadlines and self.deadlines[0][0] <= self.now:
            _, r, endpoint_id = self.deadlines.popleft()
            endpoint = self.by_id[endpoint_id]
            if r.first_token_ms is None and r.computed == 0 and r in endpoint.waiting:
                self._freeze(endpoint)  # routers go on seeing it queued until the next publication
                endpoint.waiting.remove(r)
                self.aborted.add(r.rid)
                self._decisions.pop(r.rid)
                # Counted as done so that the run ends; `record` leaves it out.
                self.completed.append(
                    CompletedRequest(
                        r.rid,
                        r.arrival_ms,
                        r.input_tokens,
                        r.output_tokens,
                        math.nan,
                        0.0,
                        0.0,
                        endpoint_id,
                        None,
                        0,
                        r.preemptions,
                        0.0,
                    )
                )

    def _route(self, request: SimRequest) -> None:
        self._expire()
        super()._route(request)
        self.deadlines.append((self.now + self.timeout_ms, request, self._decisions[request.rid].endpoint_id))

    def _on_step(self, endpoint: Endpoint) -> None:
        self._expire()
        super()._on_step(endpoint)


class _RecordingRouter:
    """llm-d's default scorer, with the router's own in-flight counts in every candidate's state; it keeps the
    rows it decided on by request id."""

    name = "llmd_heuristic"

    def __init__(self, seed: int) -> None:
        self.inner = LlmdHeuristicPolicy(seed=seed)
        self.rows: dict[str, tuple[FeatureRow, FeatureRow | None]] = {}
        self.sim: FleetSimulator | None = None

    def attach(self, sim: FleetSimulator) -> None:
        self.sim = sim

    def _counted(self, candidate: Candidate) -> Candidate:
        assert self.sim is not None
        endpoint = self.sim.by_id[candidate.endpoint_id]
        prefill = decode = 0
        for r in (*endpoint.waiting, *endpoint.running):
            if r.first_token_ms is None:
                prefill += -(-r.input_tokens // _PREFILL_UNIT) * _PREFILL_UNIT
            else:
                decode += r.input_tokens + r.generated
        state = dataclasses.replace(candidate.state, prefill_tokens_in_flight=prefill, decode_tokens_in_flight=decode)
        return dataclasses.replace(candidate, state=state)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        counted = {c.endpoint_id: self._counted(c) for c in candidates}
        pick = self.inner.pick(request, list(counted.values()))
        row = counted[pick.endpoint_id].row(request)
        decode_row = counted[pick.decode_endpoint_id].row(request) if pick.decode_endpoint_id else None
        self.rows[request.request_id] = (row, decode_row)
        return dataclasses.replace(pick, row=row, decode_row=decode_row)

    def observe(self, outcome: Outcome) -> None:
        self.inner.observe(outcome)


def _entry(row: FeatureRow, ttft: float, tpot: float, stamp_ms: float, extras: bool) -> dict[str, Any]:
    full = observation_to_llmd(Observation(row, ttft, tpot, timestamp=stamp_ms / 1e3))
    keep = _LLMD_FIELDS + (_EXTRA_FIELDS if extras else ())
    return {k: full[k] for k in keep}


def record(spec: TraceSpec) -> list[dict[str, Any]]:
    """Simulate the spec's load on its fleet and return llm-d's training rows, in recording order."""
    fleet = load_fleet(spec.fleet)
    router = _RecordingRouter(spec.seed)
    sim = _ClientSimulator(fleet, staged_workload(spec), router, seed=spec.seed, timeout_ms=spec.timeout_s * 1e3)
    result = sim.run()
    overhead = random.Random(spec.seed + 1)
    events: list[tuple[float, int, dict[str, Any]]] = []
    for c in result.completed:
        if c.rid in sim.aborted:
            continue
        row, decode_row = router.rows[str(c.rid)]
        ttft = c.ttft_ms + spec.api_overhead_ms * math.exp(overhead.gauss(0.0, 0.4))
        first_token = c.arrival_ms + ttft
        events.append((first_token, 0, _entry(row, ttft, 0.0, first_token, spec.extras)))
        if c.output_tokens > 1 and c.itl_ms > 0:
            done = max(c.arrival_ms + c.e2e_ms, first_token)
            events.append((done, 1, _entry(decode_row or row, 0.0, c.itl_ms, done, spec.extras)))
    events.sort(key=lambda e: (e[0], e[1]))
    return [e[2] for e in events]


# The traces `bench accuracy --data sim:NAME` knows. The Llama-3.1-8B fleets (eight endpoints) get eight times
# the H200 pair's rates for a quarter of the time: as many requests, and as heavy a load at the top stage.
TRACES: dict[str, TraceSpec] = {
    "bimodal": TraceSpec("h200-qwen3", "bimodal"),
    "long-chat": TraceSpec("h200-qwen3", "long-chat"),
    # The same requests from a client that never gives up: the queue, and the TTFT, grow for as long as the load
    # exceeds what the pair serves. What a model predicts when the growth is real rather than cut by a timeout.
    "long-chat-no-timeout": TraceSpec("h200-qwen3", "long-chat", timeout_s=math.inf),
    "mixed": TraceSpec("mixed", "bimodal", stages_qps=(8, 16, 32, 64, 128), stage_s=15.0, extras=True),
    "pd": TraceSpec("pd", "bimodal", stages_qps=(8, 16, 32, 64, 128), stage_s=15.0, extras=True),
}


def cache_dir() -> Path:
    """Where generated traces are kept: `$LEADTIME_CACHE_DIR`, else `$XDG_CACHE_HOME/leadtime`, else
    ~/.cache/leadtime."""
    if os.environ.get("LEADTIME_CACHE_DIR"):
        return Path(os.environ["LEADTIME_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "leadtime"


def code_digest() -> str:
    """A digest of everything a simulated log depends on: the simulator's code and coefficients, and the fleet files
    (what keys a cached one: a trace here, the retraining benchmark's log)."""
    here = Path(__file__).resolve().parent
    parts = sorted([*here.glob("*.py"), here / "coefficients.json", *(here / "fleets").glob("*.yaml")])
    digest = hashlib.sha256()
    for path in parts:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def trace_path(name: str) -> Path:
    """The JSONL file of the simulated trace `name` (one of TRACES), generated on first use and cached."""
    known = shipped_name(name, TRACES)
    if known is None:
        raise ValueError(f"unknown simulated trace {name!r} (known: {', '.join(f'sim:{n}' for n in TRACES)})")
    name, spec = known, TRACES[known]
    resolve_fleet(spec.fleet)
    key = hashlib.sha256(f"{dataclasses.asdict(spec)}|{code_digest()}".encode()).hexdigest()[:16]
    path = cache_dir() / "traces" / f"{name}-{key}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = record(spec)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
    return path
