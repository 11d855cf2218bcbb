"""One serving replica: vLLM-style continuous batching over a block KV cache.

Each step takes a token budget (chunked prefill): running requests first (one token each when decoding, a chunk
when prefilling), then waiting requests in arrival order while the budget, the running cap and the KV cache
allow. When the cache cannot hold the running requests' next tokens, the most recently admitted request is
preempted: its blocks are freed and it goes back to the head of the queue to be recomputed (no token is lost;
its generated tokens are recomputed with its prompt). No new request is admitted in a step that preempted.

When nothing but decoding happens, many identical decode steps are planned at once in closed form (a decode
step costs a + b·kv_tokens ms), so a long generation costs one event, not one per token. An arrival or a
time-slice swap cuts such a run short at the end of the step in flight.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from leadtime.simulator.kvcache import KVCache
from leadtime.simulator.steptime import StepTimeModel

MAX_DECODE_RUN = 4096
MAX_STALLS = 100
"""A request preempted without getting further than before more than this many times in a row (at the 101st) is
taken for one that never will (`Endpoint.stuck`): the simulator counts it as failed rather than restart it without
end. A request preempted often under KV pressure or at swaps still gets further each time it runs."""

# Standard normal draws that step noise indexes by a hash of (endpoint, step start): the same step of the same
# endpoint gets the same factor in every run and in every what-if fork, whatever else happened meanwhile.
_NORMALS: list[float] = [float(z) for z in np.random.default_rng(20261201).standard_normal(1 << 16)]
_LOWEST_NORMAL = min(_NORMALS)
# A request's prefill computed in one step takes at least this share of the steps it really takes (chunks, and
# other requests' tokens in the same steps, only add time): 0.97 measured over every catalog class, 0.85 kept.
PREFILL_BOUND_SHARE = 0.85
# No step (prefill, decode or mixed) is shorter than this share of a one-sequence decode step (0.994 measured).
MIN_STEP_SHARE = 0.9


@dataclass(frozen=True)
class StepNoise:
    """A real server's departures from the step-time model: a fixed speed factor of this endpoint (silicon,
    clocks, thermals) and a log-normal factor on each planned step or run of decode steps (host scheduling,
    kernel variance). Both have mean 1."""

    speed: float = 1.0
    jitter: float = 0.0
    seed: int = 0

    @property
    def lowest_factor(self) -> float:
        """No step's factor is below this (the table's lowest draw)."""
        return self.speed * math.exp(self.jitter * _LOWEST_NORMAL - 0.5 * self.jitter * self.jitter)

    def factor(self, start_ms: float) -> float:
        if self.jitter == 0.0:
            return self.speed
        z = _NORMALS[hash((self.seed, round(start_ms * 1000.0))) & 0xFFFF]
        return self.speed * math.exp(self.jitter * z - 0.5 * self.jitter * self.jitter)


@dataclass(eq=False)
class SimRequest:
    """A request's life in the simulator; progress fields describe its state on its current endpoint."""

    rid: int
    arrival_ms: float
    input_tokens: int
    output_tokens: int
    segments: tuple[int, ...] = ()
    segment_tokens: int = 512
    prefill_only: bool = False
    kv_ready: bool = False
    computed: int = 0
    generated: int = 0
    private_blocks: int = 0
    held: list[int] = field(default_factory=list)
    published: int = 0
    prefix_hit_tokens: int = -1
    first_token_ms: float | None = None
    prefill_done_ms: float | None = None
    finish_ms: float | None = None
    decode_start_ms: float | None = None
    decode_start_generated: int = 0
    preemptions: int = 0
    best_progress: tuple[int, int] = (0, 0)
    """The most (generated, computed) it had at a preemption: a request preempted again and again without passing
    it makes no progress (`MAX_STALLS`)."""
    stalls: int = 0

    def need(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return self.input_tokens + self.generated - self.computed

    @property
    def decoding(self) -> bool:
        """Whether the request is past its prefill, generating a token per step."""
        return self.generated > 0 and self.need() == 1

    def copy(self) -> SimRequest:
        """An independent copy (for forking an endpoint's state)."""
        clone = object.__new__(SimRequest)  # every field as it is (no __init__ to rerun), the held list copied
        clone.__dict__.update(self.__dict__)
        clone.held = list(self.held)
        return clone


@dataclass
class StepPlan:
    """One engine step (or a run of decode-only steps): when it starts and ends, and what each request does."""

    start_ms: float
    end_ms: float
    entries: list[tuple[SimRequest, int]]
    decode_run: int = 0  # > 0: a run of this many decode-only steps (one token per entry per step)
    a_ms: float = 0.0
    b_ms: float = 0.0
    kv0: float = 0.0

    def run_end(self, steps: int) -> float:
        """When the first `steps` steps of a decode run end."""
        n = len(self.entries)
        return self.start_ms + steps * self.a_ms + self.b_ms * (steps * self.kv0 + n * steps * (steps - 1) / 2.0)


@dataclass
class StepOutcome:
    """What a finished step did: first tokens, prefills done (for P/D) and requests finished."""

    first_token: list[SimRequest] = field(default_factory=list)
    prefill_done: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)


class Endpoint:
    """A replica's scheduler, cache and clock-free state; the fleet simulator owns time and events.

    Parameters
    ----------
    endpoint_id, role
        Name and P/D role (`both`, `prefill`, `decode`).
    stepper
        Step-time model of this replica.
    cache
        Its KV cache.
    max_batched_tokens, max_running
        vLLM's `max_num_batched_tokens` and `max_num_seqs`.
    decode_runs
        Plan runs of decode steps in closed form (off for real-time serving, where each step is paced).
    noise
        Departures from the step-time model (none by default).
    record_busy
        Keep each step's (start, end) in `busy_intervals`, for the offline report's utilisation. Off for real-time
        serving, which never reads them: a list growing by every step for as long as the server runs.
    """

    def __init__(
        self,
        endpoint_id: str,
        role: str,
        stepper: StepTimeModel,
        cache: KVCache,
        max_batched_tokens: int = 8192,
        max_running: int = 256,
        decode_runs: bool = True,
        noise: StepNoise = StepNoise(),
        record_busy: bool = True,
    ) -> None:
        self.endpoint_id = endpoint_id
        self.role = role
        self.stepper = stepper
        self.cache = cache
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        self.decode_runs = decode_runs
        self.noise = noise
        self.record_busy = record_busy
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.plan: StepPlan | None = None
        self.available = True
        self.parking = False
        self.busy_intervals: list[tuple[float, float]] = []
        self.preemptions = 0
        self.stuck: SimRequest | None = None
        """A request preempted more than `MAX_STALLS` times in a row without progress: it will never complete here."""

    def clone(self, share_cache: bool = False) -> Endpoint:
        """An independent copy for what-if simulation (the clairvoyant policy).

        With `share_cache` the copy's KV cache is a copy-on-write fork of this one's (cheap, but only valid
        while this endpoint does not change).
        """
        other = Endpoint(
            self.endpoint_id,
            self.role,
            self.stepper,
            self.cache.fork() if share_cache else self.cache.clone(),
            self.max_batched_tokens,
            self.max_running,
            self.decode_runs,
            self.noise,
            self.record_busy,
        )
        copies = {id(r): r.copy() for r in (*self.waiting, *self.running)}
        other.waiting = deque(copies[id(r)] for r in self.waiting)
        other.running = [copies[id(r)] for r in self.running]
        if self.plan is not None:
            p = self.plan
            entries = [(copies[id(r)], n) for r, n in p.entries]
            other.plan = StepPlan(p.start_ms, p.end_ms, entries, p.decode_run, p.a_ms, p.b_ms, p.kv0)
        other.available = self.available
        other.parking = self.parking
        return other

    # ----- what a router can scrape -------------------------------------------------------------------------

    def prefill_tokens_in_flight(self) -> int:
        """Prompt tokens still to prefill, waiting and running requests together."""
        return sum(r.need() for r in (*self.waiting, *self.running) if not r.decoding)

    def decode_tokens_in_flight(self, at_ms: float | None = None) -> int:
        """KV tokens of the requests decoding (at `at_ms`, within a decode run in flight: as its steps have gone by
        then, as step-by-step decoding would show them)."""
        done = 0 if at_ms is None else self.run_steps_done(at_ms)
        return sum(r.computed + done + 1 for r in self.running if r.decoding)

    def kv_usage(self, at_ms: float | None = None) -> float:
        """Share of the KV cache in use (at `at_ms`, within a decode run in flight: without the blocks the run took at
        its start for steps it has not reached by then, as step-by-step decoding would hold them)."""
        usage = self.cache.usage()
        plan = self.plan
        if at_ms is None or plan is None or plan.decode_run <= 1:
            return usage
        reached = min(self.run_steps_done(at_ms) + 1, plan.decode_run)  # the step in flight holds its block
        blocks_for = self.cache.blocks_for
        ahead = sum(
            blocks_for(r.computed + plan.decode_run) - blocks_for(r.computed + reached) for r, _ in plan.entries
        )
        return max(0.0, usage - ahead / self.cache.total_blocks)

    def run_steps_done(self, at_ms: float) -> int:
        """Steps of the decode run in flight that end by `at_ms` (0 without one)."""
        plan = self.plan
        if plan is None or plan.decode_run <= 1:
            return 0
        # run_end grows with k: bisect over k without listing every end.
        return bisect.bisect_right(range(1, plan.decode_run + 1), at_ms, key=plan.run_end)

    # ----- queue --------------------------------------------------------------------------------------------

    def enqueue(self, request: SimRequest) -> None:
        """Queue a request (the next step schedules it)."""
        self.waiting.append(request)

    def place_running(self, request: SimRequest) -> bool:
        """Put a request that is already decoding into the running batch, holding the KV blocks of what it has
        computed (to start an endpoint in a given state). False, and nothing changed, if the blocks do not fit.
        """
        if not request.decoding:
            raise ValueError("place_running takes a decoding request (generated ≥ 1, one token to compute)")
        blocks = self.cache.blocks_for(request.computed) - request.private_blocks
        if not self.cache.allocate(blocks):
            return False
        request.private_blocks += blocks
        self.running.append(request)
        return True

    # ----- cache bookkeeping per request --------------------------------------------------------------------

    def _blocks_needed(self, r: SimRequest, tokens: int) -> int:
        """New private blocks for `r` to hold `tokens` more KV tokens."""
        shared = r.published * (r.segment_tokens // self.cache.block_size)
        return self.cache.blocks_for(r.computed + tokens) - shared - r.private_blocks

    def _cacheable_segments(self, r: SimRequest) -> int:
        if r.kv_ready or not r.segments:
            return 0
        return min(len(r.segments), r.input_tokens // r.segment_tokens)

    def _admit_prefix(self, r: SimRequest) -> None:
        """Match the cached prefix when `r` first gets blocks here (again after a preemption)."""
        if r.kv_ready:
            r.computed = r.input_tokens
            return
        usable = self._cacheable_segments(r)
        matched = self.cache.matched_prefix(r.segments[:usable])
        if matched * r.segment_tokens >= r.input_tokens:
            matched -= 1  # at least one prompt token must be computed to sample from
        hits = r.segments[:matched]
        self.cache.acquire_prefix(hits)
        r.held = list(hits)
        r.published = matched
        r.computed = matched * r.segment_tokens

    def _release(self, r: SimRequest) -> None:
        self.cache.free(r.private_blocks)
        self.cache.release_prefix(r.held)
        r.private_blocks = 0
        r.held = []
        r.published = 0

    def _preempt(self, r: SimRequest) -> None:
        """Free everything `r` holds; it will recompute its prompt and output here (transferred KV included)."""
        progress = (r.generated, r.computed)
        if progress > r.best_progress:
            r.best_progress, r.stalls = progress, 0
        else:
            r.stalls += 1
        self._release(r)
        r.kv_ready = False
        r.computed = 0
        r.preemptions += 1
        self.preemptions += 1
        self.running.remove(r)
        self.waiting.appendleft(r)
        if r.stalls > MAX_STALLS and self.stuck is None:
            self.stuck = r  # for the engine to drop and count as failed (`stuck_reason`)

    def stuck_reason(self) -> str:
        """Why the request found stuck here (`stuck` is set) does not finish: what was seen, not a guessed cause
        (a prompt that cannot be prefilled in one resident window, or one starved behind another that recomputes
        a long prompt after every swap, look the same from here)."""
        r = self.stuck
        assert r is not None
        return (
            f"request {r.rid} ({r.input_tokens} prompt tokens) was preempted {r.stalls} times in a row on "
            f"{self.endpoint_id} without getting further than before (its KV is lost at each time-slice swap or "
            "preemption, and it is restarted from its prompt)"
        )

    def _publish(self, r: SimRequest, now_ms: float) -> None:
        """Share the prompt segments `r` has fully computed."""
        done = min(self._cacheable_segments(r), r.computed // r.segment_tokens)
        if done > r.published:
            per_segment = r.segment_tokens // self.cache.block_size
            fresh = list(r.segments[r.published : done])
            self.cache.publish_prefix(fresh, per_segment, now_ms)
            r.private_blocks -= per_segment * len(fresh)
            r.held.extend(fresh)
            r.published = done

    # ----- scheduling ---------------------------------------------------------------------------------------

    def start_step(self, now_ms: float) -> StepPlan | None:
        """Plan the next step starting now (None when idle or not resident)."""
        if self.plan is not None or not self.available:
            return None
        if self.decode_runs and not self.waiting and self.running:
            plan = self._plan_decode_run(now_ms)
            if plan is not None:
                self.plan = plan
                return plan
        plan = self._plan_step(now_ms)
        self.plan = plan
        return plan

    def _plan_step(self, now_ms: float) -> StepPlan | None:
        # The simulator's innermost loop (the clairvoyant policy forks and plans thousands of steps per request):
        # `SimRequest.need`, `decoding` and `_blocks_needed` are written out here.
        budget = self.max_batched_tokens
        cache = self.cache
        block = cache.block_size
        entries: list[tuple[SimRequest, int]] = []
        preempted = False
        for r in list(self.running):
            if budget <= 0:
                break
            if preempted and r not in self.running:
                continue  # preempted below to make room for an earlier request
            need = r.input_tokens + r.generated - r.computed
            n = need if need < budget else budget
            blocks = -(-(r.computed + n) // block) - r.published * (r.segment_tokens // block) - r.private_blocks
            fits = blocks <= 0 or cache.allocate(blocks)
            while not fits:  # make room from the back of the batch, this request itself the last resort
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
                fits = cache.allocate(blocks)
            if not fits:
                continue
            r.private_blocks += blocks
            entries.append((r, n))
            budget -= n
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_running:
            r = self.waiting[0]
            self._admit_prefix(r)
            n = min(r.need(), budget)
            blocks = self._blocks_needed(r, n)
            if not cache.allocate(blocks):
                self._release(r)
                r.computed = 0
                break
            r.private_blocks += blocks
            if r.prefix_hit_tokens < 0:
                r.prefix_hit_tokens = r.published * r.segment_tokens
            self.waiting.popleft()
            self.running.append(r)
            entries.append((r, n))
            budget -= n
        if not entries:
            return None
        chunks: list[tuple[int, int]] = []  # (tokens computed this step, tokens computed before) per prefill chunk
        decodes = 0
        kv = 0  # KV tokens the decodes read
        for r, n in entries:
            if r.generated > 0 and r.input_tokens + r.generated - r.computed == 1:  # `SimRequest.decoding`
                decodes += 1
                kv += r.computed + 1
            else:
                chunks.append((n, r.computed))
        duration = self.stepper.step_ms(chunks, decodes, float(kv)) * self.noise.factor(now_ms)
        return StepPlan(now_ms, now_ms + duration, entries)

    def _plan_decode_run(self, now_ms: float) -> StepPlan | None:
        if any(not r.decoding for r in self.running) or len(self.running) > self.max_batched_tokens:
            return None
        steps = min(MAX_DECODE_RUN, min(r.output_tokens - r.generated for r in self.running))
        if steps < 2:
            return None
        room = self.cache.free_blocks + self.cache.evictable_blocks

        def blocks(k: int) -> int:
            return sum(self._blocks_needed(r, k) for r in self.running)

        if blocks(steps) > room:
            low, high = 1, steps  # blocks(low) may fit, blocks(high) does not
            if blocks(low) > room:
                return None
            while high - low > 1:
                mid = (low + high) // 2
                if blocks(mid) <= room:
                    low = mid
                else:
                    high = mid
            steps = low
            if steps < 2:
                return None
        for r in self.running:
            extra = self._blocks_needed(r, steps)
            if not self.cache.allocate(extra):
                raise AssertionError("decode run allocation failed after a successful check")
            r.private_blocks += extra
        a, b = self.stepper.decode_affine(len(self.running))
        scale = self.noise.factor(now_ms)
        a, b = a * scale, b * scale
        kv0 = float(sum(r.computed + 1 for r in self.running))
        plan = StepPlan(now_ms, now_ms, [(r, 1) for r in self.running], steps, a, b, kv0)
        plan.end_ms = plan.run_end(steps)
        return plan

    def interrupt(self, now_ms: float) -> bool:
        """Cut a decode run short at the end of the step in flight; True if its end time changed."""
        plan = self.plan
        if plan is None or plan.decode_run <= 1:
            return False
        steps = min(plan.decode_run, self.run_steps_done(now_ms) + 1)
        if steps >= plan.decode_run:
            return False
        for r, _ in plan.entries:
            keep = self.cache.blocks_for(r.computed + steps) - self.cache.blocks_for(r.computed)
            over = self.cache.blocks_for(r.computed + plan.decode_run) - self.cache.blocks_for(r.computed) - keep
            self.cache.free(over)
            r.private_blocks -= over
        plan.decode_run = steps
        plan.end_ms = plan.run_end(steps)
        return True

    def finish_step(self) -> StepOutcome:
        """Apply the planned step at its end time."""
        plan = self.plan
        if plan is None:
            raise AssertionError("no step in flight")
        self.plan = None
        now = plan.end_ms
        if self.record_busy:
            self.busy_intervals.append((plan.start_ms, now))
        outcome = StepOutcome()
        steps = max(plan.decode_run, 1)
        for r, n in plan.entries:
            if plan.decode_run:
                r.computed += steps
                r.generated += steps
            else:
                r.computed += n
                seg = r.segment_tokens
                # Only a request that has just computed a whole new segment it may share (`_cacheable_segments`,
                # written out) has anything to publish.
                if (
                    r.computed >= (r.published + 1) * seg
                    and r.published < r.input_tokens // seg
                    and r.published < len(r.segments)
                    and not r.kv_ready
                ):
                    self._publish(r, now)
                if r.computed == r.input_tokens + r.generated:
                    r.generated += 1
                    if r.prefill_done_ms is None:
                        r.prefill_done_ms = now
                    if r.first_token_ms is None and not r.prefill_only:
                        r.first_token_ms = now
                        r.decode_start_ms = now
                        r.decode_start_generated = r.generated
                        outcome.first_token.append(r)
            if r.prefill_only and r.generated >= 1:
                self._leave(r)
                outcome.prefill_done.append(r)
            elif r.generated >= r.output_tokens:
                r.finish_ms = now
                self._leave(r)
                outcome.finished.append(r)
        if self.parking:
            self._park()
        return outcome

    def _leave(self, r: SimRequest) -> None:
        self._release(r)
        self.running.remove(r)

    def remove(self, rid: int) -> bool:
        """Drop request `rid`, waiting or running, and free what it holds: its client left, and vLLM aborts such a
        request at its next step. Between steps only (one in the step in flight is removed after it). Whether it
        was here."""
        assert self.plan is None or all(r.rid != rid for r, _ in self.plan.entries), "in the step in flight"
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                self._release(r)
                return True
        for r in self.running:
            if r.rid == rid:
                self._leave(r)
                return True
        return False

    # ----- time-slicing --------------------------------------------------------------------------------------

    def request_park(self, now_ms: float) -> None:
        """The accelerator is handed to another job: stop after the step in flight."""
        self.interrupt(now_ms)
        self.parking = True
        if self.plan is None:
            self._park()

    def _park(self) -> None:
        self.parking = False
        self.available = False
        for r in list(reversed(self.running)):
            self._preempt(r)
        self.cache.clear_unreferenced()

    def resume(self) -> None:
        """The time-slice group is resident again: serve. A step still in flight from before the swap-out goes on,
        and the endpoint is no longer to be parked when it ends (it sat out its next resident window)."""
        self.available = True
        self.parking = False

    # ----- what-if ------------------------------------------------------------------------------------------

    def fork_until_prefilled(
        self,
        request: SimRequest,
        now_ms: float,
        resume_at_ms: float | None = None,
        give_up_after_ms: float = math.inf,
        park_at_ms: float | None = None,
        away_ms: float = 0.0,
    ) -> tuple[float, Endpoint | None]:
        """Exact time from `now_ms` until `request` would finish its prefill here, with no further arrivals, and
        the forked replica as it is the moment the prefill completes (None if cut).

        `resume_at_ms` is when a parked endpoint will be resident again. Once the answer is known to exceed
        `give_up_after_ms`, the forward simulation stops and returns infinity (a caller looking for the
        minimum over endpoints needs no more).

        The fork's `running` and `waiting` are then exactly the batch the request would join to decode (the
        request itself has left it: it ran as prefill-only). `park_at_ms`: a resident time-sliced endpoint
        is handed to the other job then (after the step in flight, as the engine does) and serves again
        `away_ms` later.
        """
        sim = self.clone(share_cache=True)
        probe = request.copy()
        probe.prefill_only = True
        sim.waiting.append(probe)
        clock = now_ms
        if sim.plan is not None:
            sim.interrupt(now_ms)
            clock = sim.plan.end_ms
            sim.finish_step()
        if not sim.available:
            if resume_at_ms is None:
                return math.inf, None
            clock = max(clock, resume_at_ms)
            sim.resume()
        while probe.prefill_done_ms is None:
            if clock - now_ms > give_up_after_ms:
                return math.inf, None
            if park_at_ms is not None and clock >= park_at_ms:
                sim.request_park(clock)
                clock = max(clock, park_at_ms + away_ms)
                sim.resume()
                park_at_ms = None
            plan = sim.start_step(clock)
            if plan is None:
                return math.inf, None
            if park_at_ms is not None and plan.end_ms > park_at_ms:
                sim.interrupt(max(park_at_ms, plan.start_ms))
            clock = plan.end_ms
            sim.finish_step()
        return probe.prefill_done_ms - now_ms, sim

    def ttft_lower_bound_ms(self, request: SimRequest, now_ms: float, resume_at_ms: float | None = None) -> float:
        """A cheap lower bound on the time `fork_until_prefilled` finds (no fork).

        The step in flight ends first (a decode run can be cut at once), a parked endpoint resumes first, and
        the request's uncached prompt and the prefill queued ahead of it then take at least
        `PREFILL_BOUND_SHARE` of one step over all of it at the lowest step noise. Cached counts every segment
        cached here or carried by a request already here (those may be cached by the time it is admitted).
        """
        wait = 0.0
        if self.plan is not None and self.plan.decode_run <= 1:
            wait = max(0.0, self.plan.end_ms - now_ms)
        if not self.available:
            if resume_at_ms is None:
                return math.inf
            wait = max(wait, resume_at_ms - now_ms)
        usable = self._cacheable_segments(request)
        matched = self.cache.matched_prefix(request.segments[:usable])
        if matched < usable and (self.running or self.waiting):
            ahead = {h for r in (*self.running, *self.waiting) for h in r.segments}
            while matched < usable:
                h = request.segments[matched]
                if h not in ahead and not self.cache.matched_prefix((h,)):
                    break
                matched += 1
        if matched * request.segment_tokens >= request.input_tokens:
            matched -= 1
        hits = max(0, matched) * request.segment_tokens
        chunks = [(request.input_tokens - hits, hits)]
        queued = self._prefill_ahead_tokens()
        if queued:
            chunks.append((queued, 0))
        compute = self.stepper.step_ms(chunks, 0, 0.0)
        return wait + PREFILL_BOUND_SHARE * compute * self.noise.lowest_factor

    def _prefill_ahead_tokens(self) -> int:
        """Prompt tokens that must be computed before a newcomer's prefill completes, at the least.

        Running requests get the token budget before anyone admitted after them and waiting ones are admitted
        first in, so all of their prefill is done by the time a newcomer's is. Counted: what running requests
        still need after the step in flight, and what waiting ones need beyond every segment that might be
        cached for them.
        """
        plan = self.plan
        in_flight = {id(r): n for r, n in plan.entries} if plan is not None and not plan.decode_run else {}
        # (the step in flight is counted as a wait of its own)
        tokens = sum(max(0, r.need() - in_flight.get(id(r), 0)) for r in self.running if not r.decoding)
        for r in self.waiting:
            if not r.kv_ready:
                tokens += max(0, r.input_tokens + r.generated - self._cacheable_segments(r) * r.segment_tokens)
        return tokens

    def itl_lower_bound_ms(self, context_tokens: int) -> float:
        """No `joining_step_ms` here is below the step of the request decoding alone."""
        a, b = self.stepper.decode_affine(1)
        return (a + b * float(context_tokens + 1)) * self.noise.speed

    def sure_joining_step_ms(self, context_tokens: int, now_ms: float, within_ms: float) -> float:
        """A lower bound on `joining_step_ms` of the fork, if the request's prefill completes within `within_ms`.

        A request here with more tokens left to generate than steps fit in that time is still in the batch
        then; the batch holds at least that many sequences (up to the running cap) and at least the KV of that
        many of the shortest contexts here now (contexts only grow).
        """
        if not math.isfinite(within_ms):
            return self.itl_lower_bound_ms(context_tokens)
        origin = self.plan.start_ms if self.plan is not None else now_ms
        a1, _ = self.stepper.decode_affine(1)
        steps = (now_ms + within_ms - origin) / (MIN_STEP_SHARE * a1 * self.noise.lowest_factor)
        present = [
            (r.input_tokens + r.generated, r.output_tokens - r.generated) for r in (*self.running, *self.waiting)
        ]
        sure = min(sum(1 for _, left in present if left > steps), max(0, self.max_running - 1))
        smallest = sorted(context for context, _ in present)[:sure]  # no batch of `sure` of them holds less
        a, b = self.stepper.decode_affine(sure + 1)
        return (a + b * float(sum(smallest) + context_tokens + 1)) * self.noise.speed

    def joining_step_ms(self, context_tokens: int, also: Sequence[int] = ()) -> float:
        """True decode step time of the batch a request of `context_tokens` joins here, with no later arrivals.

        The batch is what runs and waits here now (waiting requests are ahead of it), the requests of `also`
        (context tokens of requests already bound here but not arrived yet, e.g. KV in transit) and the
        request itself, up to the running cap; a decode step of n sequences over kv tokens costs a + b·kv on
        this replica's step-time model, times its speed factor (the per-step jitter has mean 1).
        """
        contexts = [r.input_tokens + r.generated for r in (*self.running, *self.waiting)]
        contexts.extend(also)
        contexts = contexts[: max(0, self.max_running - 1)]
        a, b = self.stepper.decode_affine(len(contexts) + 1)
        return (a + b * float(sum(contexts) + context_tokens + 1)) * self.noise.speed
