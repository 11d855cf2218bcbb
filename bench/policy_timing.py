"""Each routing policy's own decision time: `time.perf_counter` around every `pick` of a trace replay.

`python -m leadtime.bench.policy_timing --fleet large --requests 6000 --rate-scale 2.8 --policy dynamo_kv ...`
prints one JSON object per policy: the replay's arrival rate, goodput (each request against its own SLOs),
decision time p50/p99/max in ms, and the wall time of the whole run. Policies run one after the other on the
same requests, so their timings are side by side under the same machine load.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import numpy as np

from leadtime.router_plugin.policy import Candidate, Pick, RouteRequest, RoutingPolicy, pass_on
from leadtime.simulator.engine import FleetSimulator
from leadtime.simulator.fleet import load_fleet
from leadtime.simulator.report import summarize
from leadtime.simulator.run import POLICY_NAMES, make_policy
from leadtime.simulator.workload import load_workload, shape


class Timed:
    """Wraps a policy and records how long each of its decisions took."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy
        self.name = policy.name
        self.seconds: list[float] = []

    def attach(self, simulator: FleetSimulator) -> None:
        attach = getattr(self.policy, "attach", None)
        if callable(attach):
            attach(simulator)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Pick:
        start = time.perf_counter()
        pick = self.policy.pick(request, candidates)
        self.seconds.append(time.perf_counter() - start)
        return pick

    def observe(self, outcome: object) -> None:
        self.policy.observe(outcome)  # type: ignore[arg-type]

    def prefilled(self, request_id: str, now_ms: float) -> None:
        """Passed on (the optional hooks of `RoutingPolicy`): a peer timed here must route as in the benchmark."""
        pass_on(self.policy, "prefilled", request_id, now_ms)

    def abandon(self, request_id: str) -> None:
        pass_on(self.policy, "abandon", request_id)


def time_policy(fleet_name: str, requests: int, rate_scale: float, policy: str, seed: int = 0) -> dict[str, object]:
    fleet = load_fleet(fleet_name)
    workload = shape(load_workload("mooncake", seed, requests), rate_scale=rate_scale, max_requests=requests)
    timed = Timed(make_policy(policy, seed, fleet))
    start = time.perf_counter()
    result = FleetSimulator(fleet, workload, timed, seed=seed).run()
    wall = time.perf_counter() - start
    ms = np.array(timed.seconds) * 1e3
    summary = summarize(result)
    return {
        "fleet": fleet.name,
        "policy": result.policy,
        "requests": len(workload),
        "rate_rps": len(workload) / max(workload[-1].arrival_ms / 1e3, 1e-9),
        "goodput_rps": summary["goodput_rps"],
        "decision_ms": {
            "p50": float(np.percentile(ms, 50)),
            "p99": float(np.percentile(ms, 99)),
            "max": float(ms.max()),
        },
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", default="large")
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--rate-scale", type=float, default=2.8)
    parser.add_argument("--policy", action="append", choices=POLICY_NAMES)
    args = parser.parse_args()
    for policy in args.policy or POLICY_NAMES:
        print(json.dumps(time_policy(args.fleet, args.requests, args.rate_scale, policy)), flush=True)


if __name__ == "__main__":
    main()
