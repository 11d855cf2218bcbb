"""The fleet simulator: one event loop over arrivals, engine steps, KV transfers and time-slice swaps.

The router sees each endpoint's state as last published (every `refresh_ms`): the snapshot is taken at the
first event at or after each publication instant, which is the state at that instant because nothing changes
between events. Cached prefixes count as visible to the router only if cached before the last publication.
Completed requests are reported to the policy when they complete, never earlier; a request's first token when the
client gets it (`prefilled`, to a policy that has it), as a router sees its stream start.

P/D: the prefill endpoint runs the prompt and samples the first token; the KV then queues on the decode
endpoint's ingress link (FIFO, `kv_link_gb_s`), and the first token reaches the client when the transfer
lands. Time-slicing: each group alternates resident → away (another job holds the accelerators; running
requests are preempted and the prefix cache is lost) → switching (restore cost) → resident.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from leadtime.features.roofline import kv_transfer_ms
from leadtime.features.rows import EndpointState, FeatureRow, Observation
from leadtime.router_plugin.policy import (
    Candidate,
    NoCandidateError,
    Outcome,
    Pick,
    RouteRequest,
    RoutingPolicy,
    candidates_that_fit,
)
from leadtime.router_plugin.timeslice import OTHER_JOB, SERVING_JOB, GroupStatus
from leadtime.simulator.endpoint import Endpoint, SimRequest, StepNoise, StepOutcome
from leadtime.simulator.fleet import DAY_MS, EndpointConfig, Fleet, TimesliceGroup
from leadtime.simulator.kvcache import KVCache
from leadtime.simulator.steptime import StepTimeModel
from leadtime.simulator.workload import WorkloadRequest

ARRIVAL, STEP, TRANSFER, TIMESLICE, JOIN = 0, 1, 2, 3, 4
MAX_HOLD_MS = 600_000.0
"""A policy that holds a request longer than this (`Pick.hold`) is taken for one that never places it."""
# The job names a time-slice group reports: the serving engine's, and the job it shares the accelerators with.


class SimulationError(RuntimeError):
    """The simulation cannot go on (e.g. a policy picked an endpoint that does not exist)."""


@dataclass
class Decision:
    """What the router decided on for one request (the rows it scored, or the candidates' rows as published)."""

    row: FeatureRow
    decode_row: FeatureRow | None
    endpoint_id: str
    decode_endpoint_id: str | None
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    placed_ms: float = 0.0
    """When it was sent to the endpoint: its arrival, or later for a request the router held."""


@dataclass
class CompletedRequest:
    """One request as it completed: its latencies and where it ran."""

    rid: int
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    ttft_ms: float
    itl_ms: float
    e2e_ms: float
    endpoint_id: str
    decode_endpoint_id: str | None
    prefix_hit_tokens: int
    preemptions: int
    transfer_ms: float
    ttft_slo_ms: float = math.inf
    itl_slo_ms: float = math.inf

    @property
    def meets_slo(self) -> bool:
        return self.ttft_ms <= self.ttft_slo_ms and self.itl_ms <= self.itl_slo_ms


@dataclass(frozen=True)
class FailedRequest:
    """A request the fleet could not serve: counted as a missed SLO, and the run goes on without it (one request
    the fleet cannot serve says nothing of how the policy routed the others, whose figures stand)."""

    rid: int
    arrival_ms: float
    input_tokens: int
    reason: str
    """Why, naming the request and the endpoint: a prompt too large for its KV cache, or restarted again and again."""
    kind: str
    """What sort of failure, for counting them (`reason` names the request and its tokens): "kv_cache" (no
    endpoint's KV cache can hold it) or "stuck" (preempted again and again without getting further, or unfinished
    a day after the last arrival)."""


@dataclass
class GroupState:
    """A time-slice group's state over the run."""

    spec: TimesliceGroup
    members: list[Endpoint]
    state: str = "resident"
    until_ms: float = math.inf
    history: list[tuple[float, str]] = field(default_factory=list)


@dataclass
class SimResult:
    """Everything one policy's run produced."""

    policy: str
    completed: list[CompletedRequest]
    observations: list[Observation]
    busy: dict[str, list[tuple[float, float]]]
    endpoints: dict[str, dict[str, object]]
    timeslice: dict[str, list[tuple[float, str]]]
    duration_ms: float
    preemptions: int
    join_ms: float = 0.0
    decision_ms: list[float] = field(default_factory=list)
    decision_wall_ms: list[float] = field(default_factory=list)
    arrival_span_ms: float = 0.0
    decision_at_ms: list[float] = field(default_factory=list)
    """The simulated time of each decision, beside `decision_ms`: a held request is decided again later, so the
    decisions made on the fleet as it stood at some time (before or after a scale-out) cannot be told by count."""
    failed: list[FailedRequest] = field(default_factory=list)
    """Requests dropped as unservable (`FailedRequest`): none met its SLO."""

    @property
    def goodput_rps(self) -> float:
        """Requests that met both of their SLOs per second of the arrival window (the same for every policy)."""
        return sum(c.meets_slo for c in self.completed) / max(self.arrival_span_ms / 1e3, 1e-9)


def trusted_state(**fields: object) -> EndpointState:
    """An EndpointState from values the simulator produced itself, without field validation.

    Validation is for values from outside; here it would dominate the cost of every routing decision. Every
    field must be given: one that EndpointState gains later makes this fail at once, never left unset.
    """
    if fields.keys() != _STATE_FIELDS:
        missing, unknown = sorted(_STATE_FIELDS - fields.keys()), sorted(fields.keys() - _STATE_FIELDS)
        raise TypeError(f"trusted_state needs every EndpointState field: missing {missing}, unknown {unknown}")
    state = object.__new__(EndpointState)
    state.__dict__.update(fields)  # a frozen dataclass refuses setattr, not its __dict__
    return state


_STATE_FIELDS = frozenset(f.name for f in dataclasses.fields(EndpointState))


def build_endpoints(fleet: Fleet, decode_runs: bool = True, seed: int = 0, record_busy: bool = True) -> list[Endpoint]:
    """The fleet's replicas; each draws its speed factor (the fleet's `speed_spread`) from `seed` and its index.
    `record_busy`: see `Endpoint` (off where no report will read the steps' intervals)."""
    endpoints = []
    for index, cfg in enumerate(fleet.endpoints):
        known = fleet.catalog
        stepper = StepTimeModel(
            known.accelerator(cfg.accelerator), known.model(cfg.model), cfg.tensor_parallel, cfg.cuda_graphs
        )
        cache = KVCache(cfg.kv_blocks, cfg.block_size)
        spread = fleet.speed_spread
        z = random.Random(seed * 1_000_003 + index).gauss(0.0, 1.0)
        noise = StepNoise(math.exp(spread * z - 0.5 * spread * spread), fleet.step_jitter, seed * 1_000_003 + index)
        endpoints.append(
            Endpoint(
                cfg.endpoint_id,
                cfg.role,
                stepper,
                cache,
                cfg.max_batched_tokens,
                cfg.max_running,
                decode_runs,
                noise,
                record_busy,
            )
        )
    return endpoints


def join_ms(config: EndpointConfig, workload: Sequence[WorkloadRequest]) -> float:
    """When an endpoint joins: its fixed time, or its share of the workload's arrival window."""
    if config.join_share <= 0 or not workload:
        return config.join_ms
    arrivals = [w.arrival_ms for w in workload]
    first, last = min(arrivals), max(arrivals)
    return max(first + config.join_share * (last - first), 1e-3)


def pools_never_joining(fleet: Fleet, workload: Sequence[WorkloadRequest]) -> list[str]:
    """The pools that join after the workload's last arrival (`join_ms`): they are offered no request, and a run
    with them reads like one of the fleet without them, so a caller says so."""
    if not workload:
        return []
    last = max(w.arrival_ms for w in workload)
    late = [c.pool for c in fleet.endpoints if join_ms(c, workload) > last]
    return list(dict.fromkeys(late))


def check_workload(workload: Sequence[WorkloadRequest], endpoints: Sequence[Endpoint]) -> None:
    """SimulationError naming the first request the simulator cannot run, before it runs any: the trace readers
    refuse these, a library caller's own requests were taken as they came (a prompt of 0 tokens raised
    ZeroDivisionError in the step-time model, requests out of arrival order made the arrival window negative and
    the goodput 2e9 requests per second, segments not whole blocks were checked on the first request alone)."""
    block_sizes = {e.cache.block_size: e.endpoint_id for e in endpoints}
    previous = -math.inf
    for rid, w in enumerate(workload):
        if not (math.isfinite(w.arrival_ms) and w.arrival_ms >= previous):
            raise SimulationError(
                f"request {rid} arrives at {w.arrival_ms} ms, before request {rid - 1} or not at a finite time: "
                "the workload must be in arrival order (workload.shape sorts it)"
            )
        previous = w.arrival_ms
        if w.input_tokens < 1 or w.output_tokens < 1:
            raise SimulationError(
                f"request {rid} has {w.input_tokens} prompt and {w.output_tokens} output tokens: both must be ≥ 1"
            )
        if w.segment_tokens < 1:  # a prefill step divides by it, with or without segments
            raise SimulationError(f"request {rid}: segment_tokens={w.segment_tokens}: must be ≥ 1")
        if not w.segments:
            continue
        for size, endpoint_id in block_sizes.items():
            if w.segment_tokens % size:
                raise SimulationError(
                    f"request {rid}: prefix segments of segment_tokens={w.segment_tokens} tokens are not whole blocks "
                    f"of {size} on {endpoint_id}: segment_tokens must be a multiple of every pool's block_size"
                )


class FleetSimulator:
    """Run one policy over one workload on one fleet.

    Parameters
    ----------
    fleet
        Parsed fleet.
    workload
        Requests sorted by arrival.
    policy
        Any `leadtime.router_plugin.policy.RoutingPolicy`; one with an `attach(simulator)` method gets the simulator.
    seed
        Seeds the time-slice windows.
    ttft_slo_ms, tpot_slo_ms
        Each request's SLOs when the fleet states none (its `slos` classes take precedence); passed to the
        policy with the request.
    progress
        Called with the number of completed requests now and then.
    """

    def __init__(
        self,
        fleet: Fleet,
        workload: Sequence[WorkloadRequest],
        policy: RoutingPolicy,
        seed: int = 0,
        ttft_slo_ms: float | None = None,
        tpot_slo_ms: float | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.workload = list(workload)
        self.policy = policy
        self.rng = random.Random(seed)
        self.ttft_slo_ms = ttft_slo_ms
        self.tpot_slo_ms = tpot_slo_ms
        self.progress = progress
        self.endpoints = build_endpoints(fleet, seed=seed)
        self.by_id = {e.endpoint_id: e for e in self.endpoints}
        self.configs = {c.endpoint_id: c for c in fleet.endpoints}
        check_workload(self.workload, self.endpoints)
        self.now = 0.0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._versions: dict[str, int] = {e.endpoint_id: 0 for e in self.endpoints}
        self._link_free: dict[str, float] = {e.endpoint_id: 0.0 for e in self.endpoints}
        self._decisions: dict[int, Decision] = {}
        self._transfer_ms: dict[int, float] = {}
        self._published_at = 0.0
        self._next_publish = 0.0
        self._published: dict[str, tuple[int, int, float, int, int]] = {}
        self._frozen_at: dict[str, float] = {}
        self._states: dict[str, tuple[tuple[float, str], EndpointState]] = {}
        self.groups: dict[str, GroupState] = {}
        self._group_of: dict[str, GroupState] = {}
        for name, spec in fleet.timeslice_groups.items():
            members = [self.by_id[c.endpoint_id] for c in fleet.endpoints if c.timeslice_group == name]
            if members:
                group = GroupState(spec, members)
                self.groups[name] = group
                for m in members:
                    self._group_of[m.endpoint_id] = group
        self._join_ms = {e.endpoint_id: join_ms(self.configs[e.endpoint_id], self.workload) for e in self.endpoints}
        self._joined: list[Endpoint] = [e for e in self.endpoints if self._join_ms[e.endpoint_id] <= 0]
        self.routing: SimRequest | None = None
        self.completed: list[CompletedRequest] = []
        self.failed: list[FailedRequest] = []
        self.observations: list[Observation] = []
        # Each policy.pick's own time: the CPU it used (what it costs, whatever else shares the machine) and
        # the wall-clock time it took.
        self.decision_ms: list[float] = []
        self.decision_wall_ms: list[float] = []
        self.decision_at_ms: list[float] = []
        attach = getattr(policy, "attach", None)
        if callable(attach):
            attach(self)

    # ----- events -------------------------------------------------------------------------------------------

    def _push(self, time_ms: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (time_ms, self._seq, kind, payload))

    def _wake(self, endpoint: Endpoint) -> None:
        """Start a step if the endpoint is idle, or cut a decode run short so the newcomer joins soon."""
        self._freeze(endpoint)
        if endpoint.plan is not None:
            if endpoint.interrupt(self.now):
                self._schedule_step(endpoint)
            return
        if endpoint.start_step(self.now) is not None:
            self._schedule_step(endpoint)

    def _schedule_step(self, endpoint: Endpoint) -> None:
        assert endpoint.plan is not None
        version = self._versions[endpoint.endpoint_id] + 1
        self._versions[endpoint.endpoint_id] = version
        self._push(endpoint.plan.end_ms, STEP, (endpoint, version))

    # ----- router view ----------------------------------------------------------------------------------------

    def _freeze(self, endpoint: Endpoint) -> None:
        """Record the endpoint's published state before it changes, if not yet done since the last publication.

        An endpoint changes only in its own events, so a snapshot taken just before its first change after a
        publication instant is its state at that instant; one never changed since is its current state.
        """
        eid = endpoint.endpoint_id
        if self._frozen_at.get(eid, -1.0) < self._published_at:
            self._published[eid] = (
                len(endpoint.waiting),
                len(endpoint.running),
                endpoint.kv_usage(self._published_at),
                endpoint.prefill_tokens_in_flight(),
                endpoint.decode_tokens_in_flight(self._published_at),
            )
            self._frozen_at[eid] = self._published_at

    def timeslice_view(self, endpoint_id: str) -> str:
        """The residency an endpoint shows a router: `none` (not time-sliced), `resident`, `parked`, `switching`.

        Routers are not told when a group will come back (the simulator knows; an orchestrator does not): a
        policy that needs that estimates it from the group's history (`status`).
        """
        group = self._group_of.get(endpoint_id)
        return "none" if group is None else group.state

    def status(self, group_name: str) -> GroupStatus | None:
        """A time-slice group as its orchestrator reports it (router_plugin.timeslice's source protocol)."""
        group = self.groups.get(group_name)
        if group is None:
            return None
        since = group.history[-1][0] if group.history else 0.0
        if group.state == "resident":
            return GroupStatus("LOCKED", SERVING_JOB, SERVING_JOB, 0, since)
        if group.state == "parked":
            return GroupStatus("LOCKED", OTHER_JOB, OTHER_JOB, 1, since)
        return GroupStatus("SWITCHING", "", SERVING_JOB, 0, since)

    def resume_time(self, endpoint_id: str) -> float | None:
        """When a non-resident endpoint will serve again (known to the simulator, not to routers)."""
        group = self._group_of.get(endpoint_id)
        if group is None or group.state == "resident":
            return None
        if group.state == "parked":
            return group.until_ms + group.spec.restore_ms.mean
        return group.until_ms

    def park_time(self, endpoint_id: str) -> tuple[float, float] | None:
        """For a resident time-sliced endpoint: when its group is handed to the other job next, and the mean
        time it then stays away (away + restore). Known to the simulator, not to routers."""
        group = self._group_of.get(endpoint_id)
        if group is None or group.state != "resident":
            return None
        return group.until_ms, group.spec.away_ms.mean + group.spec.restore_ms.mean

    def link_free_ms(self, endpoint_id: str) -> float:
        """When the KV ingress link of a decode endpoint is next free."""
        return max(self.now, self._link_free[endpoint_id])

    def candidates(self, request: SimRequest) -> list[Candidate]:
        """Every endpoint that has joined, as published at the last publication instant."""
        out = []
        for e in self._joined:
            cfg = self.configs[e.endpoint_id]
            self._freeze(e)
            ts_state = self.timeslice_view(e.endpoint_id)
            key = (self._frozen_at[e.endpoint_id], ts_state)
            cached = self._states.get(e.endpoint_id)
            if cached is not None and cached[0] == key:
                state = cached[1]
            else:
                waiting, running, kv, prefill_tokens, decode_tokens = self._published[e.endpoint_id]
                state = trusted_state(
                    endpoint_id=e.endpoint_id,
                    accelerator=cfg.accelerator,
                    model=cfg.model,
                    tensor_parallel=cfg.tensor_parallel,
                    role=cfg.role,
                    num_request_waiting=waiting,
                    num_request_running=running,
                    kv_cache_percentage=kv,
                    prefill_tokens_in_flight=prefill_tokens,
                    decode_tokens_in_flight=decode_tokens,
                    timeslice_state=ts_state,
                    timeslice_wait_ms=0.0,  # routers are not told when an away group comes back
                )
                self._states[e.endpoint_id] = (key, state)
            hits = 0
            if request.segments and e.role != "decode":
                usable = min(len(request.segments), request.input_tokens // request.segment_tokens)
                matched = e.cache.matched_prefix(request.segments[:usable], self._published_at)
                hits = min(matched * request.segment_tokens, request.input_tokens)
            out.append(Candidate(state, hits, self._published_at, cfg.timeslice_group or "", e.cache.capacity_tokens))
        return out

    # ----- handlers -------------------------------------------------------------------------------------------

    def slo_of(self, rid: int) -> tuple[float, float]:
        """(TTFT, ITL) SLO of request `rid`, the same whichever policy routes it."""
        return self.fleet.slo_of(
            rid,
            self.ttft_slo_ms if self.ttft_slo_ms is not None else math.inf,
            self.tpot_slo_ms if self.tpot_slo_ms is not None else math.inf,
        )

    def _route(self, request: SimRequest) -> None:
        ttft_slo, itl_slo = self.slo_of(request.rid)
        route = RouteRequest(
            request_id=str(request.rid),
            input_tokens=request.input_tokens,
            block_hashes=request.segments,
            ttft_slo_ms=ttft_slo if math.isfinite(ttft_slo) else None,
            tpot_slo_ms=itl_slo if math.isfinite(itl_slo) else None,
            arrival_ms=self.now,
            held_ms=self.now - request.arrival_ms,
            # The simulated client asks for as many tokens as it will get (`leadtime sim serve` generates max_tokens).
            max_output_tokens=request.output_tokens,
        )
        try:
            candidates = candidates_that_fit(route, self.candidates(request))
        except NoCandidateError as err:  # no endpoint can hold it: it fails, and no policy placed it
            self.failed.append(
                FailedRequest(request.rid, request.arrival_ms, request.input_tokens, str(err), "kv_cache")
            )
            self._report_progress()
            return
        self.routing = request
        started, started_cpu = time.perf_counter(), time.thread_time()
        pick = self.policy.pick(route, candidates)
        self.decision_ms.append((time.thread_time() - started_cpu) * 1e3)
        self.decision_wall_ms.append((time.perf_counter() - started) * 1e3)
        self.decision_at_ms.append(self.now)
        self.routing = None
        if pick.hold:
            self._hold(request)
            return
        self._check_pick(pick)
        self._check_fits(route, self.by_id[pick.endpoint_id], prompt_only=pick.decode_endpoint_id is not None)
        if pick.decode_endpoint_id is not None:
            self._check_fits(route, self.by_id[pick.decode_endpoint_id], prompt_only=False)
        by_id = {c.endpoint_id: c for c in candidates}
        decode_row = None
        if pick.decode_endpoint_id is not None:
            decode_row = pick.decode_row or by_id[pick.decode_endpoint_id].row(route)
        self._decisions[request.rid] = Decision(
            pick.row or by_id[pick.endpoint_id].row(route),
            decode_row,
            pick.endpoint_id,
            pick.decode_endpoint_id,
            pick.predicted_ttft_ms,
            pick.predicted_tpot_ms,
            self.now,
        )
        if pick.decode_endpoint_id is not None:
            request.prefill_only = True
        target = self.by_id[pick.endpoint_id]
        self._freeze(target)
        target.enqueue(request)
        self._wake(target)

    def _hold(self, request: SimRequest) -> None:
        """The policy holds `request`: offer it again at the next state publication."""
        if self.now - request.arrival_ms > MAX_HOLD_MS:
            name = getattr(self.policy, "name", type(self.policy).__name__)
            raise SimulationError(f"policy {name!r} held request {request.rid} for over {MAX_HOLD_MS / 1e3:.0f} s")
        again = self._next_publish if self._next_publish > self.now else self.now + self.fleet.refresh_ms
        self._push(again, ARRIVAL, request)

    def _check_fits(self, route: RouteRequest, endpoint: Endpoint, prompt_only: bool) -> None:
        """A policy that picked past its candidates an endpoint too small for the request (never offered it: see
        `candidates_that_fit`, whose measure this is: the prompt alone on the prefill endpoint of a pair) is a bug
        of that policy, named as `_check_pick` names it."""
        tokens = route.input_tokens if prompt_only else route.kv_tokens
        if tokens > endpoint.cache.capacity_tokens:
            name = getattr(self.policy, "name", type(self.policy).__name__)
            raise SimulationError(
                f"policy {name!r} picked {endpoint.endpoint_id} for request {route.request_id} ({tokens} tokens), "
                f"which can never fit its KV cache ({endpoint.cache.capacity_tokens} tokens)"
            )

    def _check_pick(self, pick: Pick) -> None:
        name = getattr(self.policy, "name", type(self.policy).__name__)
        joined = {e.endpoint_id for e in self._joined}
        if pick.endpoint_id not in joined:
            raise SimulationError(f"policy {name!r} picked unknown endpoint {pick.endpoint_id!r}")
        if self.fleet.disaggregated:
            if pick.decode_endpoint_id is None:
                # Not disaggregated: a decode endpoint prefills the request itself (llm-d below its threshold).
                if self.by_id[pick.endpoint_id].role != "decode":
                    raise SimulationError(f"policy {name!r} must pick a decode endpoint (or a pair) on a P/D fleet")
                return
            if pick.decode_endpoint_id not in joined:
                raise SimulationError(f"policy {name!r} must pick a decode endpoint on a P/D fleet")
            if self.by_id[pick.endpoint_id].role != "prefill" or self.by_id[pick.decode_endpoint_id].role != "decode":
                raise SimulationError(f"policy {name!r} picked a pair with the wrong roles")
        elif pick.decode_endpoint_id is not None:
            raise SimulationError(f"policy {name!r} picked a P/D pair on a unified fleet")

    def _on_step(self, endpoint: Endpoint) -> None:
        self._freeze(endpoint)
        outcome: StepOutcome = endpoint.finish_step()
        self._drop_stuck(endpoint)
        for r in outcome.first_token:
            self._first_token(r)
        for r in outcome.prefill_done:
            self._start_transfer(r)
        for r in outcome.finished:
            self._complete(r)
        self._wake(endpoint)

    def _start_transfer(self, r: SimRequest) -> None:
        decision = self._decisions[r.rid]
        assert decision.decode_endpoint_id is not None
        target = decision.decode_endpoint_id
        config = self.configs[target]
        model = self.fleet.catalog.model(config.model)
        start = max(self.now, self._link_free[target])
        end = start + kv_transfer_ms(model, r.input_tokens, self.fleet.kv_link_gb_s, config.tensor_parallel)
        self._link_free[target] = end
        self._transfer_ms[r.rid] = end - self.now
        self._push(end, TRANSFER, r)

    def _on_transfer(self, r: SimRequest) -> None:
        decision = self._decisions[r.rid]
        assert decision.decode_endpoint_id is not None
        r.first_token_ms = self.now
        r.decode_start_ms = self.now
        r.decode_start_generated = 1
        r.prefill_only = False
        r.kv_ready = True
        r.computed = 0
        r.generated = 1
        self._first_token(r)
        if r.output_tokens <= 1:
            r.finish_ms = self.now
            self._complete(r)
            return
        target = self.by_id[decision.decode_endpoint_id]
        self._freeze(target)
        target.enqueue(r)
        self._wake(target)

    def _first_token(self, r: SimRequest) -> None:
        """Tell a policy that has the hook (`prefilled`) that the request's first token reached the client: a real
        router sees its stream start then, and Dynamo's and llm-d's release the request's prefill side there."""
        prefilled = getattr(self.policy, "prefilled", None)
        if prefilled is not None:
            prefilled(str(r.rid), self.now)

    def _complete(self, r: SimRequest) -> None:
        decision = self._decisions.pop(r.rid)
        assert r.first_token_ms is not None and r.finish_ms is not None
        ttft = r.first_token_ms - r.arrival_ms
        served_ttft = r.first_token_ms - decision.placed_ms  # what the endpoint took: what the router learns from
        decode_tokens = r.generated - r.decode_start_generated
        start = r.decode_start_ms if r.decode_start_ms is not None else r.first_token_ms
        itl = (r.finish_ms - start) / decode_tokens if decode_tokens > 0 else 0.0
        done = CompletedRequest(
            rid=r.rid,
            arrival_ms=r.arrival_ms,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            ttft_ms=ttft,
            itl_ms=itl,
            e2e_ms=r.finish_ms - r.arrival_ms,
            endpoint_id=decision.endpoint_id,
            decode_endpoint_id=decision.decode_endpoint_id,
            prefix_hit_tokens=max(r.prefix_hit_tokens, 0),
            preemptions=r.preemptions,
            transfer_ms=self._transfer_ms.pop(r.rid, 0.0),
            ttft_slo_ms=self.slo_of(r.rid)[0],
            itl_slo_ms=self.slo_of(r.rid)[1],
        )
        self.completed.append(done)
        stamp = self.now / 1e3
        predicted_ttft, predicted_tpot = decision.predicted_ttft_ms, decision.predicted_tpot_ms
        if decision.decode_row is None:
            self.observations.append(
                Observation.of_request(decision.row, served_ttft, itl, stamp, predicted_ttft, None, predicted_tpot)
            )
        else:
            self.observations.append(Observation(decision.row, served_ttft, 0.0, predicted_ttft, None, stamp))
            self.observations.append(
                Observation.of_request(decision.decode_row, 0.0, itl, stamp, predicted_tpot_ms=predicted_tpot)
            )
        self.policy.observe(
            Outcome(
                str(r.rid),
                decision.endpoint_id,
                decision.decode_endpoint_id,
                served_ttft,
                itl,
                r.output_tokens,
                self.now,
            )
        )
        self._report_progress()

    def _report_progress(self) -> None:
        """Tell `progress` how many requests are done with (failed ones too: the bar reaches the total)."""
        done = len(self.completed) + len(self.failed)
        if self.progress is not None and (done % 200 == 0 or done == len(self.workload)):
            self.progress(done)

    def _fail(self, r: SimRequest, reason: str, kind: str) -> None:
        """Count `r` as failed and forget it (it holds nothing on any endpoint any more), and so does the policy
        that placed it, if it keeps count of what it sent (`abandon`, as the gateway tells it of a failed request)."""
        abandon = getattr(self.policy, "abandon", None)
        if abandon is not None:
            abandon(str(r.rid))
        self._decisions.pop(r.rid, None)
        self._transfer_ms.pop(r.rid, None)
        self.failed.append(FailedRequest(r.rid, r.arrival_ms, r.input_tokens, reason, kind))
        self._report_progress()

    def _fail_overdue(self) -> None:
        """Fail every request still unfinished a day after the last arrival (`DAY_MS`, the longest a fleet file
        may make a group stay away): one waiting on a group away that long, or needing many of its short resident
        windows, would otherwise keep the run going over weeks of simulated time, for a client long gone."""
        for rid, decision in list(self._decisions.items()):
            w = self.workload[rid]
            placed = [decision.endpoint_id, *([decision.decode_endpoint_id] if decision.decode_endpoint_id else [])]
            groups = [g for g in (self.configs[e].timeslice_group for e in placed) if g]
            reason = (
                f"request {rid} ({w.input_tokens} prompt tokens) had not finished a day after the last arrival, on "
                f"{' → '.join(placed)}"
                + (f" (time-slice group {', '.join(map(repr, dict.fromkeys(groups)))})" if groups else "")
                + "; the run stops there"
            )
            r = SimRequest(rid, w.arrival_ms, w.input_tokens, w.output_tokens, w.segments, w.segment_tokens)
            self._fail(r, reason, "stuck")

    def _drop_stuck(self, endpoint: Endpoint) -> None:
        """A request the endpoint found restarting without end (`Endpoint.stuck`) fails; the endpoint serves on."""
        r = endpoint.stuck
        if r is None:
            return
        reason = endpoint.stuck_reason()
        endpoint.stuck = None
        endpoint.remove(r.rid)
        self._fail(r, reason, "stuck")

    def _on_timeslice(self, group: GroupState) -> None:
        if group.state == "resident":
            group.state = "parked"
            group.until_ms = self.now + group.spec.away_ms.draw(self.rng)
            for e in group.members:
                self._freeze(e)
                had_plan = e.plan is not None
                e.request_park(self.now)
                self._drop_stuck(e)
                if had_plan and e.plan is not None:
                    self._schedule_step(e)
        elif group.state == "parked":
            group.state = "switching"
            group.until_ms = self.now + group.spec.restore_ms.draw(self.rng)
        else:
            group.state = "resident"
            group.until_ms = self.now + group.spec.resident_ms.draw(self.rng)
            for e in group.members:
                self._freeze(e)
                e.resume()
                self._wake(e)
        group.history.append((self.now, group.state))
        self._push(group.until_ms, TIMESLICE, group)

    # ----- the loop -----------------------------------------------------------------------------------------

    def _on_join(self, endpoint: Endpoint) -> None:
        """A scaled-out endpoint starts taking traffic (empty, cold cache)."""
        self._joined.append(endpoint)

    def run(self) -> SimResult:
        """Run the workload to the end. A request the fleet cannot serve is counted in `SimResult.failed`;
        SimulationError if the run cannot end otherwise (a policy's bad pick, a fleet that never serves)."""
        for e in self.endpoints:  # pushed first: an endpoint joining at a request's arrival instant is offered to it
            joins_at = self._join_ms[e.endpoint_id]
            if joins_at > 0:
                self._push(joins_at, JOIN, e)
        for rid, w in enumerate(self.workload):
            request = SimRequest(rid, w.arrival_ms, w.input_tokens, w.output_tokens, w.segments, w.segment_tokens)
            self._push(w.arrival_ms, ARRIVAL, request)
        for group in self.groups.values():
            group.history.append((0.0, "resident"))
            group.until_ms = group.spec.resident_ms.draw(self.rng)
            self._push(group.until_ms, TIMESLICE, group)
        pending = len(self.workload)
        refresh = self.fleet.refresh_ms
        self._next_publish = refresh
        horizon = (self.workload[-1].arrival_ms if self.workload else 0.0) + DAY_MS
        while self._events and len(self.completed) + len(self.failed) < pending:
            time_ms, _, kind, payload = heapq.heappop(self._events)
            if time_ms > horizon:
                self.now = horizon
                self._fail_overdue()
                break
            if kind == STEP:
                endpoint, version = cast(tuple[Endpoint, int], payload)
                if version != self._versions[endpoint.endpoint_id] or endpoint.plan is None:
                    continue
            if time_ms >= self._next_publish:
                self._published_at = math.floor(time_ms / refresh) * refresh
                self._next_publish = self._published_at + refresh
            self.now = time_ms
            if kind == ARRIVAL:
                assert isinstance(payload, SimRequest)
                self._route(payload)
            elif kind == STEP:
                self._on_step(endpoint)
            elif kind == TRANSFER:
                assert isinstance(payload, SimRequest)
                self._on_transfer(payload)
            elif kind == JOIN:
                assert isinstance(payload, Endpoint)
                self._on_join(payload)
            else:
                assert isinstance(payload, GroupState)
                self._on_timeslice(payload)
        if len(self.completed) + len(self.failed) < pending:
            raise SimulationError(
                f"{pending - len(self.completed) - len(self.failed)} requests never completed (a fleet that never "
                "serves them)"
            )
        return SimResult(
            policy=getattr(self.policy, "name", type(self.policy).__name__),
            completed=sorted(self.completed, key=lambda c: c.rid),
            observations=self.observations,
            busy={e.endpoint_id: e.busy_intervals for e in self.endpoints},
            endpoints={
                e.endpoint_id: {
                    "accelerator": self.configs[e.endpoint_id].accelerator,
                    "model": self.configs[e.endpoint_id].model,
                    "role": e.role,
                    "timeslice_group": self.configs[e.endpoint_id].timeslice_group,
                    "kv_blocks": e.cache.total_blocks,
                    "preemptions": e.preemptions,
                }
                for e in self.endpoints
            },
            timeslice={name: g.history for name, g in self.groups.items()},
            duration_ms=self.now,
            preemptions=sum(e.preemptions for e in self.endpoints),
            join_ms=max(self._join_ms.values(), default=0.0),
            decision_ms=self.decision_ms,
            decision_wall_ms=self.decision_wall_ms,
            arrival_span_ms=self.workload[-1].arrival_ms - self.workload[0].arrival_ms if self.workload else 0.0,
            decision_at_ms=self.decision_at_ms,
            failed=sorted(self.failed, key=lambda f: f.rid),
        )
