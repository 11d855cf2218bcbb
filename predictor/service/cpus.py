"""Where the service's processes run: the learner on CPUs of its own, the serving threads on the others.

Why: measured on a 2-core virtual machine, a CPU-bound process beside the server (any priority, SCHED_IDLE
included) took the bare gRPC stack's p99 for 100 rows from ~1 ms to 3-5 ms, because the server's threads kept
landing on the CPU it held; with the server's threads on one CPU and that process on the other, p99 stayed at
~1.3 ms. The learner is such a process while it retrains. Splitting the CPUs (`auto`) lowered the service's gRPC
p99 while learning from 7.6-8.4 to 4.4-6.7 ms (six runs each way), but the serving threads then share one CPU and
ingestion fell (median ~4%, one run in six below 60,000 samples/s). So the default splits the CPUs only where
the serving threads keep several of their own: `auto` when this process may use `AUTO_FROM_CPUS` or more CPUs,
`off` below.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from leadtime.predictor.settings import ENV_PREFIX

SETTING = f"{ENV_PREFIX}LEARNER_CPUS"
"""The variable the CPU errors name: the setting has no option, so it is what the user gave."""


class CpuPlanError(ValueError):
    """The CPU setting names CPUs this process may not use, or leaves none for serving."""


@dataclass(frozen=True)
class CpuPlan:
    """Where the serving threads and the learner process run."""

    serving: frozenset[int]
    learner: frozenset[int]


def parse_cpu_list(text: str, within: frozenset[int] | None = None) -> frozenset[int]:
    """A CPU list such as "1,3" or "2-3" (the format of taskset -c and /sys/.../cpulist) → the CPU numbers.

    With `within`, a range reaching past its highest CPU is refused before it is expanded: `0-99999999999`, made
    into a set CPU by CPU, hung the start rather than being refused."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise CpuPlanError(f"{SETTING}: {part!r} is an empty range")
        if within is not None and high > max(within, default=-1):
            raise _unavailable(frozenset({high}), within)
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def _unavailable(cpus: frozenset[int], allowed: frozenset[int]) -> CpuPlanError:
    return CpuPlanError(
        f"{SETTING}: CPU {format_cpu_list(cpus)} is not available to this process "
        f"(it may use {format_cpu_list(allowed)})"
    )


def format_cpu_list(cpus: frozenset[int]) -> str:
    """CPU numbers as a comma-separated list, ascending."""
    return ",".join(str(c) for c in sorted(cpus))


AUTO_FROM_CPUS = 4  # the default is `auto` from this many usable CPUs on, `off` below


def default_setting(allowed: frozenset[int]) -> str:
    """What an unset LEADTIME_LEARNER_CPUS means on a process that may use `allowed`."""
    return "auto" if len(allowed) >= AUTO_FROM_CPUS else "off"


def plan_cpus(setting: str | None, allowed: frozenset[int]) -> CpuPlan | None:
    """The placement `setting` asks for within the CPUs this process may use (None: the default for them);
    None: leave scheduling alone."""
    if setting is None:
        setting = default_setting(allowed)
    if setting == "off":
        return None
    if setting == "auto":
        if len(allowed) < 2:
            return None
        learner = frozenset({max(allowed)})
    else:
        learner = parse_cpu_list(setting, allowed)
        if not learner <= allowed:
            raise _unavailable(learner - allowed, allowed)
    serving = allowed - learner
    if not serving:
        raise CpuPlanError(f"{SETTING}: {format_cpu_list(learner)} leaves no CPU for serving")
    return CpuPlan(serving=serving, learner=learner)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (empty where the platform cannot say)."""
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def pin_process(cpus: frozenset[int]) -> None:
    """Every thread of this process, and every thread or process it starts later, on `cpus` only.
    (sched_setaffinity with pid 0 moves only the calling thread, so each running thread is moved by its id.)"""
    tasks = Path("/proc/self/task")
    ids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for task_id in ids:
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(task_id, cpus)
