"""Time-sliced accelerators: which endpoints can serve now, and how long the others will keep a request waiting.

An orchestrator (llm-d's co-operative time-slicing) grants an accelerator group to one job at a time from a FIFO
queue: `Acquire` blocks until granted, `Yield` hands it back. It reports each group as IDLE, IDLE_YIELDED, LOCKED
or SWITCHING with the job that holds it (`active_job`), the job whose weights are resident (`loaded_job`) and the
number of waiters. An endpoint serves only while its own job holds the group and is loaded; after a swap its
prefix cache is gone. SWITCHING comes both ways: straight after serving it is the swap-out, part of the away
period; after the other job's turn it is the restore.

Nobody tells the router when the other job will yield: `ResidencyTracker` learns it from what it sees, the
lengths of past away periods and restores, and estimates the remaining wait of a group that is away now as the
mean residual life of the away periods seen so far (the mean of what is left of those that lasted longer than
this one has already; about one more mean once it has outlasted them all) plus the mean restore.

Nor does anyone say when a serving group will be taken away. A request on such an endpoint risks being swapped
out: it is preempted (its KV is dropped and recomputed once the group is back, as vLLM recomputes a preempted
request) and waits out the other job. Its progress is kept, and so is the queue ahead of it. Treating swap-outs as
arriving at the rate λ = 1 / (mean resident period seen) and each costing the mean downtime D (away + restore),
work that takes T uninterrupted, queueing included, meets λ·T swap-outs on average and takes

    T_eff = T · (1 + λ·D)

`swap_risk_ms` applies it to a predicted TTFT and `swap_risk_factor` (the same 1 + λ·D) to an ITL. (A model in
which the whole of T starts over at each swap-out, (exp(λ·T) − 1)·(1/λ + D), explodes for the minutes-long
TTFTs of an overloaded queue, which does not start over.) The router learns endpoint speeds from latencies with
the away time they overlapped taken out (`away_overlap_ms`), so the risk is counted once, here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

GROUP_STATES = ("IDLE", "IDLE_YIELDED", "LOCKED", "SWITCHING")
SERVING_JOB, OTHER_JOB = "inference", "training"
"""The job names of a time-sliced group by default: the serving job whose residency means the group's endpoints can
serve (`servingJob` in the plugin configuration), and the other job it shares the accelerators with (the simulated
orchestrator's)."""


@dataclass(frozen=True)
class GroupStatus:
    """One accelerator group as the orchestrator reports it; `since_ms` is when it entered `state`."""

    state: str
    active_job: str
    loaded_job: str
    waiters: int = 0
    since_ms: float = 0.0

    def serves(self, job: str) -> bool:
        """True when `job` holds the group and its weights are resident: its endpoints can serve."""
        return self.state == "LOCKED" and self.active_job == job and self.loaded_job == job


class TimesliceSource(Protocol):
    """Where group states come from (the simulator, a file, an orchestrator's HTTP endpoint)."""

    def status(self, group: str) -> GroupStatus | None:
        """The group's current status, or None if the source does not know the group."""
        ...


@dataclass
class _GroupHistory:
    serving: bool = True
    since_ms: float = 0.0
    away_since_ms: float | None = None
    switching_since_ms: float | None = None
    leaving: bool = False  # in the SWITCHING that took it away from serving (not a restore)
    restore_only: bool = False  # first seen restoring: when it went away was never seen, so no away period is learned
    away: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    restore: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    resident: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    outages: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=256))  # (start, end)
    serving_since_ms: float | None = None  # start of the current (or last) resident period


class ResidencyTracker:
    """Learns each group's away and restore times from status changes and predicts the wait until it serves.

    Parameters
    ----------
    job
        The serving job's name as the orchestrator reports it.
    prior_away_ms, prior_restore_ms, prior_resident_ms
        Used until a group has been seen away (restoring, resident) once: a first guess, replaced by what is seen.

    >>> tracker = ResidencyTracker("inference")
    >>> tracker.update("g", GroupStatus("LOCKED", "training", "training", 1, 1000.0), now_ms=1000.0)
    >>> tracker.update("g", GroupStatus("SWITCHING", "", "inference", 0, 4000.0), now_ms=4000.0)
    >>> tracker.update("g", GroupStatus("LOCKED", "inference", "inference", 0, 4080.0), now_ms=4080.0)
    >>> tracker.update("g", GroupStatus("LOCKED", "training", "training", 1, 9000.0), now_ms=9000.0)
    >>> round(tracker.expected_wait_ms("g", now_ms=10000.0))  # 3 s away seen once, 1 s of it gone, 80 ms restore
    2080
    """

    def __init__(
        self,
        job: str,
        prior_away_ms: float = 5000.0,
        prior_restore_ms: float = 100.0,
        prior_resident_ms: float = 60_000.0,
    ) -> None:
        self.job = job
        self.prior_away_ms = prior_away_ms
        self.prior_restore_ms = prior_restore_ms
        self.prior_resident_ms = prior_resident_ms
        self._groups: dict[str, _GroupHistory] = {}

    def update(self, group: str, status: GroupStatus, now_ms: float) -> None:
        """Record the group's status as seen now (call it whenever the router looks)."""
        serving = status.serves(self.job)
        h = self._groups.get(group)
        seen_serving = h is not None and h.serving
        first_seen = h is None
        if h is None:
            h = self._groups[group] = _GroupHistory(serving=True, since_ms=status.since_ms)
        if serving and not h.serving:  # back
            if h.switching_since_ms is not None:
                h.restore.append(max(0.0, status.since_ms - h.switching_since_ms))
            if h.away_since_ms is not None:
                ended = h.switching_since_ms if h.switching_since_ms is not None else status.since_ms
                if not h.restore_only:
                    h.away.append(max(0.0, ended - h.away_since_ms))
                h.outages.append((h.away_since_ms, status.since_ms))
            h.away_since_ms = h.switching_since_ms = None
            h.restore_only = False
        elif not serving and h.serving:  # taken away
            h.away_since_ms = status.since_ms
            if h.serving_since_ms is not None:
                h.resident.append(max(0.0, status.since_ms - h.serving_since_ms))
        if serving:
            h.serving_since_ms = status.since_ms
            h.leaving = False
        elif status.state != "SWITCHING":
            h.switching_since_ms = None
            h.leaving = h.restore_only = False
        elif seen_serving:
            # Switching away from serving: the swap-out is part of the away period, not a restore.
            h.leaving = True
        elif not h.leaving and h.switching_since_ms is None:
            h.switching_since_ms = status.since_ms
            h.restore_only = first_seen
        h.serving = serving
        h.since_ms = status.since_ms

    def serving(self, group: str) -> bool:
        h = self._groups.get(group)
        return True if h is None else h.serving

    def swapped_in_at(self, group: str) -> float:
        """When the group last became servable (its prefix cache is empty from then on)."""
        h = self._groups.get(group)
        return 0.0 if h is None or not h.serving else h.since_ms

    def knows(self, group: str) -> bool:
        """Whether the group's states were ever seen (`update`): its residency is learned, not assumed."""
        return group in self._groups

    def expected_wait_ms(self, group: str, now_ms: float) -> float:
        """Expected ms until the group serves again (0 if it serves now)."""
        h = self._groups.get(group)
        if h is None or h.serving:
            return 0.0
        restore = sum(h.restore) / len(h.restore) if h.restore else self.prior_restore_ms
        if h.switching_since_ms is not None:
            return max(0.0, restore - (now_ms - h.switching_since_ms))
        elapsed = now_ms - (h.away_since_ms if h.away_since_ms is not None else h.since_ms)
        away = list(h.away) or [self.prior_away_ms]  # the prior counts as one period until one is seen
        longer = [a - elapsed for a in away if a > elapsed]
        # Longer than every period seen so far: expect about one more mean.
        residual = sum(longer) / len(longer) if longer else sum(away) / len(away)
        return residual + restore

    def _mean(self, values: deque[float], prior: float) -> float:
        return sum(values) / len(values) if values else prior

    def swap_risk_ms(self, group: str, work_ms: np.ndarray) -> np.ndarray:
        """Expected time to get through `work_ms` of uninterrupted work on a serving endpoint of `group`."""
        return np.asarray(work_ms, dtype=np.float64) * self.swap_risk_factor(group)

    def swap_risk_factor(self, group: str) -> float:
        """How much work on a serving endpoint of `group` is stretched on average by its swap-outs: 1 + λ·D."""
        h = self._groups.get(group)
        if h is None:
            return 1.0
        rate = 1.0 / max(self._mean(h.resident, self.prior_resident_ms), 1.0)
        down = self._mean(h.away, self.prior_away_ms) + self._mean(h.restore, self.prior_restore_ms)
        return 1.0 + rate * down

    def away_overlap_ms(self, group: str, start_ms: float, end_ms: float) -> float:
        """How much of [start_ms, end_ms] the group spent away (or restoring), as far as it was seen."""
        h = self._groups.get(group)
        if h is None or end_ms <= start_ms:
            return 0.0
        spans = list(h.outages)
        if not h.serving and h.away_since_ms is not None:
            spans.append((h.away_since_ms, end_ms))
        return sum(max(0.0, min(b, end_ms) - max(a, start_ms)) for a, b in spans)
