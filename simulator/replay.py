"""State-conditioned replay: put a simulated endpoint in the state a recorded row describes and let it run.

A row of llm-d's training schema records, for one request routed to a real vLLM endpoint, what the router knew
of that endpoint when the request arrived (waiting, running, KV-cache use, prefill tokens in flight, the
request's input length) and the measured TTFT or TPOT. The replay builds one simulated endpoint per row in that
state, delivers the request, and reads the TTFT or TPOT off the simulator's own scheduler (`Endpoint`) and step
model (`StepTimeModel`). Nothing here is estimated from the rows: the endpoint is configured as every simulated
pool is by default (`PoolSpec`: `max_num_batched_tokens` 8192, `max_num_seqs` 256, 16-token blocks, KV cache
sized from `gpu_memory_utilization` 0.9, CUDA graphs), and the assumptions below fill in what a row leaves out.

What a row leaves out, and what the replay assumes:

- Running requests (`num_request_running`) are all decoding, and share the KV the cache holds
  (`kv_cache_percentage` of the cache's blocks) evenly, in whole blocks: each one's context is its blocks ×
  16 tokens (at least one block each, so a running request with a 0 % reading holds 16 tokens). Their split
  between prompt and output does not matter to a step, only their context does. A row does not say when they
  finish: the replay takes them as a steady state of replies of `output_tokens` tokens (the length it assumes
  for TPOT rows), at evenly spread points of their generation, so the i-th of R running requests has
  ⌈(i + 1) · output_tokens / R⌉ tokens still to go. One that finishes while nothing waits is replaced by a
  request of the context it had reached, with a whole reply to go (an arrival replacing it: the batch stays
  steady, step for step as if the request had gone on: its context goes on growing a token a step, as when the
  replay took the running requests never to finish, and the shipped rows' figures are the same as then); one
  that finishes while requests wait is not, and leaves its KV and its place to them, first come first served,
  as vLLM's scheduler gives them. (A running batch that never finished, as the replay once assumed, never let a
  long queued prefill into a nearly full cache: rows of a heavily loaded endpoint could not be replayed.)
- Waiting requests and prefill tokens in flight. llm-d's `prefill_tokens_in_flight` counts the prompt tokens
  (in the shipped rows, each rounded up to a multiple of 64) of the requests it routed to this endpoint that
  have not yet sent their first token:
  prefill that must run before or with this request's. The replay queues them ahead of the request, in
  `max(num_request_waiting, 1)` requests of equal size (one request when none is waiting: the scrape that
  says "0 waiting" is older than the router's own count). A row that reports waiting requests but no prefill
  tokens in flight gets waiting requests of the request's own input length. A queued request ahead, once
  running, generates a whole reply of `output_tokens` tokens and then leaves, and is replaced as a running
  request is (below).
- When the request arrives at a busy endpoint (one that has running requests) a step is in flight; the request
  arrives halfway through it (the mean of an arrival at a uniformly random point of the step). An idle
  endpoint schedules it at once.
- Scheduling. vLLM's asynchronous scheduling (on by default in vLLM 0.14 unless pipeline parallelism, the Ray
  executor or non-EAGLE speculative decoding rules it out; the engine then keeps two steps in its batch queue)
  plans step N+1 while step N runs and takes in new requests when step N ends, so a request that arrives during
  step N is first scheduled in step N+2: it waits for the rest of the step in flight, then one more step of the
  batch as it was, then runs its prefill (with the queued prefill ahead of it, under the token budget, alongside
  the running batch's decode tokens) and samples its first token at the end of that step. `async_scheduling=False`
  gives the synchronous scheduler (the request joins the step right after the one in flight).
- TTFT is the simulated time from arrival to the first token. Time outside the engine (the router, HTTP,
  tokenisation, streaming the token back) is not modelled, so the replay is expected to be short by that much.
- TPOT rows: llm-d captured them when the request arrived (`num_tokens_generated` = 0), and the TPOT it
  records is the mean time between output tokens over the whole generation. The replay runs the request to
  the end of an assumed `output_tokens` (128 by default; a row does not say how long the reply was) and
  reports (last token − first token) / (output_tokens − 1), with the running batch and the queued requests
  decoding beside it. A TPOT row with `num_tokens_generated` = g > 0 is taken as captured mid-generation: the
  request is one of the running requests, with its prompt and its first g − 1 output tokens computed, and its
  TPOT is the mean of its next `output_tokens` decode steps.
- Arrivals after the row are unknown, so prefill chunks of later requests, which share decode steps in the
  real engine, are absent: the simulated TPOT is that of the batch alone.
- Prefix-cache hits are not modelled (the prompt is computed in full): the shipped run had prefix caching off.
  `num_tokens_generated` is ignored on TTFT rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leadtime.features.catalog import get_accelerator, get_model
from leadtime.features.errors import FeatureError
from leadtime.features.rows import FeatureRow, Observation, observation_from_llmd
from leadtime.simulator.endpoint import Endpoint, SimRequest
from leadtime.simulator.fleet import PoolSpec, kv_blocks
from leadtime.simulator.kvcache import KVCache
from leadtime.simulator.steptime import StepTimeModel
from leadtime.simulator.workload import loads_line

# Output length assumed for a TPOT row and for the replies of the requests beside it (a row records neither).
DEFAULT_OUTPUT_TOKENS = 128
# The row's request on a TTFT replay, which is over at its first token, is given this many output tokens.
_FOREVER = 1 << 40
# A replay that has not produced its answer after this many engine steps is stuck (a request that never fits).
_MAX_STEPS = 100_000


# Request ids: the running batch's are -1, -2, ..., the queued requests ahead this one and below; the row's is 0.
_FIRST_QUEUED_ID = -1_000_000


def _running_request(rid: int, context: int, to_go: int) -> SimRequest:
    """A request of the running batch: `context` tokens computed, its first token out, `to_go` more to generate."""
    return SimRequest(rid, 0.0, input_tokens=context, output_tokens=1 + to_go, computed=context, generated=1)


class ReplayError(ValueError):
    """A row cannot be replayed (e.g. its request cannot fit the simulated endpoint's KV cache)."""


@dataclass(frozen=True)
class ReplayedRow:
    """One measured figure and what the simulated endpoint produced in the same state."""

    line: int
    target: str  # "ttft" or "tpot"
    load: int  # requests on the endpoint when the row's request arrived: running + waiting
    measured_ms: float
    simulated_ms: float

    @property
    def ape(self) -> float:
        return abs(self.simulated_ms - self.measured_ms) / self.measured_ms


class StateReplay:
    """Builds endpoints in a row's state and runs the row's request on them.

    Parameters
    ----------
    accelerator, model
        Catalog slugs of the replicas the rows were measured on.
    tensor_parallel
        Devices per replica.
    async_scheduling
        vLLM's asynchronous scheduler (plans one step ahead) or the synchronous one.
    output_tokens
        Output length assumed for TPOT rows.

    Examples
    --------
    An idle endpoint: the TTFT is the request's own prefill step.

    >>> replay = StateReplay("h200-sxm", "qwen3-32b")
    >>> row = {"input_token_length": 100, "num_request_waiting": 0, "num_request_running": 0,
    ...        "kv_cache_percentage": 0.0, "num_tokens_generated": 0, "prefix_cache_score": 0.0}
    >>> ttft = replay.ttft_ms(observation_from_llmd({**row, "actual_ttft_ms": 1, "actual_tpot_ms": 0}).row)
    >>> ttft == replay.stepper.step_ms([(100, 0)], 0, 0.0)
    True
    """

    def __init__(
        self,
        accelerator: str,
        model: str,
        tensor_parallel: int = 1,
        async_scheduling: bool = True,
        output_tokens: int = DEFAULT_OUTPUT_TOKENS,
    ) -> None:
        if output_tokens < 2:
            raise ValueError("output_tokens must be ≥ 2 (a TPOT needs two tokens)")
        self.pool = PoolSpec(
            name="replay", count=1, accelerator=accelerator, model=model, tensor_parallel=tensor_parallel
        )
        self.stepper = StepTimeModel(
            get_accelerator(accelerator), get_model(model), tensor_parallel, cuda_graphs=self.pool.cuda_graphs
        )
        self.kv_blocks = kv_blocks(self.pool)
        capacity = self.kv_blocks * self.pool.block_size
        if output_tokens >= capacity:  # no row could be replayed: each was blamed in turn, the first for all
            raise ValueError(
                f"--output-tokens must be below the {capacity:,} tokens the simulated endpoint's KV cache holds "
                f"({accelerator} × {model}), got {output_tokens:,}"
            )
        self.async_scheduling = async_scheduling
        self.output_tokens = output_tokens

    # ----- the endpoint in the row's state ----------------------------------------------------------------

    def endpoint(self, row: FeatureRow, also_running: SimRequest | None = None) -> Endpoint:
        """A fresh endpoint whose running batch holds the row's running requests and their KV.

        `also_running` (a request already decoding) takes one of the running places and its share of the KV.
        """
        pool = self.pool
        ep = Endpoint(
            "replay",
            "both",
            self.stepper,
            KVCache(self.kv_blocks, pool.block_size),
            pool.max_num_batched_tokens,
            pool.max_num_seqs,
            decode_runs=False,  # step by step until the request is in; TPOT turns runs on for its generation
        )
        state = row.endpoint
        running = state.num_request_running
        held = round(state.kv_cache_percentage * self.kv_blocks)
        if also_running is not None:
            if not ep.place_running(also_running):
                raise ReplayError("the request's context does not fit the simulated KV cache")
            running = max(0, running - 1)
            held -= also_running.private_blocks
        if running:
            free = ep.cache.free_blocks
            if running > free:
                raise ReplayError(f"{running} running requests do not fit {free} free KV blocks")
            used = min(free, max(running, held))
            per, extra = divmod(used, running)
            for i in range(running):
                context = (per + (1 if i < extra else 0)) * pool.block_size
                to_go = math.ceil((i + 1) * self.output_tokens / running)
                if not ep.place_running(_running_request(-1 - i, context, to_go)):
                    raise AssertionError("running requests were sized to fit the cache")
        return ep

    def _replace_finished(self, ep: Endpoint, finished: list[SimRequest]) -> None:
        """Replace the requests beside the row's that finished, while nothing waits, each by one of the context it
        had reached (`computed`) with a whole reply to go: step for step as if it had gone on (its context still
        grows), not one of a fixed context (see the module docstring)."""
        for r in finished:
            if r.rid == 0 or ep.waiting:
                continue
            if not ep.place_running(_running_request(r.rid, r.computed, self.output_tokens)):
                return  # the cache filled meanwhile (queued requests grew into it): the batch shrinks

    def _queued_ahead(self, row: FeatureRow) -> list[SimRequest]:
        """The prefill waiting ahead of the row's request (see the module docstring for the layout)."""
        state = row.endpoint
        tokens = state.prefill_tokens_in_flight
        count = max(state.num_request_waiting, 1) if tokens else state.num_request_waiting
        if count == 0:
            return []
        if tokens == 0:
            sizes = [max(1, row.request.input_tokens)] * count
        else:
            per, extra = divmod(tokens, count)
            sizes = [per + (1 if i < extra else 0) for i in range(count)]
        return [
            SimRequest(_FIRST_QUEUED_ID - i, 0.0, input_tokens=size, output_tokens=self.output_tokens)
            for i, size in enumerate(sizes)
            if size > 0
        ]

    # ----- running the request ----------------------------------------------------------------------------

    def _arrive(self, ep: Endpoint, arrivals: list[SimRequest]) -> tuple[float, float]:
        """Deliver `arrivals` (queued requests ahead, then the row's request) as the module docstring says.

        Returns (arrival time, clock at which the next step may be planned).
        """
        if not ep.running:
            for r in arrivals:
                ep.enqueue(r)
            return 0.0, 0.0
        plan = ep.start_step(0.0)
        if plan is None:
            raise AssertionError("a running batch always has a step to run")
        first_step_end = plan.run_end(1) if plan.decode_run else plan.end_ms
        arrival = first_step_end / 2.0
        ep.interrupt(arrival)
        if not self.async_scheduling:
            for r in arrivals:
                ep.enqueue(r)
        clock = self._finish(ep)
        if self.async_scheduling:
            # Step N+1 was planned before the arrival was seen: it runs the batch as it was.
            plan = ep.start_step(clock)
            if plan is None:
                raise AssertionError("a running batch always has a step to run")
            ep.interrupt(clock)
            for r in arrivals:
                ep.enqueue(r)
            clock = self._finish(ep)
        return arrival, clock

    def _finish(self, ep: Endpoint) -> float:
        plan = ep.plan
        assert plan is not None
        end = plan.end_ms
        self._replace_finished(ep, ep.finish_step().finished)
        return end

    def _run_until(self, ep: Endpoint, clock: float, probe: SimRequest, done: str) -> None:
        for _ in range(_MAX_STEPS):
            if getattr(probe, done) is not None:
                return
            plan = ep.start_step(clock)
            if plan is None:
                raise ReplayError("the request cannot be scheduled on the simulated endpoint (KV cache too small)")
            clock = self._finish(ep)
        raise ReplayError(f"no answer after {_MAX_STEPS} simulated steps")

    def ttft_ms(self, row: FeatureRow) -> float:
        """Simulated time from the request's arrival to its first token."""
        ep = self.endpoint(row)
        probe = SimRequest(0, 0.0, input_tokens=max(1, row.request.input_tokens), output_tokens=_FOREVER)
        arrival, clock = self._arrive(ep, [*self._queued_ahead(row), probe])
        self._run_until(ep, clock, probe, "first_token_ms")
        assert probe.first_token_ms is not None
        return probe.first_token_ms - arrival

    def tpot_ms(self, row: FeatureRow) -> float:
        """Simulated mean time between the request's output tokens."""
        n = self.output_tokens
        generated = row.request.num_tokens_generated
        prompt = max(1, row.request.input_tokens)
        if generated > 0:
            context = prompt + generated - 1
            probe = SimRequest(
                0, 0.0, input_tokens=prompt, output_tokens=generated + n, computed=context, generated=generated
            )
            ep = self.endpoint(row, also_running=probe)
            ep.decode_runs = True
            for r in self._queued_ahead(row):
                ep.enqueue(r)
            self._run_until(ep, 0.0, probe, "finish_ms")
            assert probe.finish_ms is not None
            return probe.finish_ms / n
        ep = self.endpoint(row)
        probe = SimRequest(0, 0.0, input_tokens=prompt, output_tokens=n)
        _, clock = self._arrive(ep, [*self._queued_ahead(row), probe])
        ep.decode_runs = True  # many decode steps planned at once, as in every simulation
        self._run_until(ep, clock, probe, "finish_ms")
        assert probe.finish_ms is not None and probe.first_token_ms is not None
        return (probe.finish_ms - probe.first_token_ms) / (n - 1)


def load_rows(path: Path) -> list[tuple[int, Observation]]:
    """Every row of an llm-d training-row JSONL file with its line number; a bad line raises FeatureError."""
    out: list[tuple[int, Observation]] = []
    with path.open("rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                entry = loads_line(line)
            except ValueError as err:
                raise FeatureError(f"{path}:{lineno}", f"not JSON ({err})") from None
            try:
                out.append((lineno, observation_from_llmd(entry)))
            except FeatureError as err:
                raise FeatureError(f"{path}:{lineno}: {err.field}", err.problem) from None
    if not out:
        raise FeatureError(str(path), "holds no rows")
    return out


def replay_file(path: Path, replay: StateReplay) -> list[ReplayedRow]:
    """Replay every observed TTFT and TPOT of the file (a row with both gives two figures)."""
    out: list[ReplayedRow] = []
    for lineno, obs in load_rows(path):
        state = obs.row.endpoint
        load = state.num_request_running + state.num_request_waiting
        try:
            if obs.has_ttft:
                out.append(ReplayedRow(lineno, "ttft", load, obs.actual_ttft_ms, replay.ttft_ms(obs.row)))
            if obs.has_tpot:
                out.append(ReplayedRow(lineno, "tpot", load, obs.actual_tpot_ms, replay.tpot_ms(obs.row)))
        except ReplayError as err:
            raise ReplayError(f"{path}:{lineno}: {err}") from None
    if not out:
        raise ReplayError(f"{path}: no row observes a TTFT or a TPOT (both are 0 everywhere)")
    return out


def errors(rows: list[ReplayedRow]) -> dict[str, float]:
    """Median and p90 absolute percentage error (fractions) and the row count."""
    if not rows:
        return {"median_ape": math.nan, "p90_ape": math.nan, "rows": 0}
    ape = np.array([r.ape for r in rows])
    return {"median_ape": float(np.median(ape)), "p90_ape": float(np.quantile(ape, 0.9)), "rows": len(rows)}


def by_load_quintile(rows: list[ReplayedRow]) -> list[dict[str, float]]:
    """The same figures for each fifth of the rows ordered by load (ties in file order), with its load range."""
    ordered = sorted(rows, key=lambda r: (r.load, r.line))
    out: list[dict[str, float]] = []
    for part in np.array_split(np.arange(len(ordered)), 5):
        chunk = [ordered[i] for i in part]
        if not chunk:
            continue
        out.append({"load_min": chunk[0].load, "load_max": chunk[-1].load, **errors(chunk)})
    return out


def measured_fidelity(path: Path, replay: StateReplay) -> dict[str, dict[str, object]]:
    """TTFT and TPOT error of the state-conditioned replay over a file, overall and by load quintile."""
    rows = replay_file(path, replay)
    out: dict[str, dict[str, object]] = {}
    for target in ("ttft", "tpot"):
        subset = [r for r in rows if r.target == target]
        out[target] = {**errors(subset), "by_load_quintile": by_load_quintile(subset)}
    return out
