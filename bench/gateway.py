"""`leadtime bench gateway`: the gateway's added latency and the goodput it routes to, real processes on loopback.

Every part runs as a user runs it: `leadtime sim serve --fleet mixed` (eight mock endpoints of three accelerator
classes, in real time), `leadtime serve` (the predictor), `leadtime route`, and the load generator's processes.

1. **Overhead.** With the fleet idle, probe pairs one after the other: a streaming request through the gateway,
   then the same-sized request (another prompt, so no prefix is shared) straight to the endpoint the gateway
   chose. The gateway's added time to first byte is the difference of the two times to the first token, pair
   by pair; p50 and p99 over the pairs. Measured through three gateways routing with Leadtime, in turn: with
   `leadtime serve`'s model pulled into the gateway (`--predictor-url ... --pull-model`: predictions in process,
   observations to the service), with every prediction asked of `leadtime serve` over HTTP (`--predictor-url`),
   and with the predictor embedded (`--embedded`, which also learns in the gateway's process).
2. **Goodput.** A slice of the Mooncake trace (its arrival steps spread out, time compressed by `rate_scale`),
   prompts built from its prefix blocks, each request with TTFT and ITL SLOs in llm-d's headers, replayed
   open-loop through the gateway: once routing round-robin, once with Leadtime (a cold predictor that learns
   from the traffic). Each run gets a fresh fleet (empty caches and queues). Goodput is the requests that met
   both SLOs per second of the arrival window, as in the simulator. With `non_streaming_share`, that share of the
   requests (drawn with the seed) asks for the whole answer at once, and Leadtime runs twice: measuring them (the
   gateway's default: sent on as streams, timed, learned from) and sending them on unchanged
   (`--no-measure-non-streaming`). Goodput, SLO attainment, TTFT and ITL are then the streaming requests' (only
   their clients see a first token); `whole_ms` is how long the others waited for their answer, `observed` the
   outcomes the gateway handed to the predictor.

JSON: `requests` and `errors` over every phase (an error: a status other than 200, a broken or short stream),
`overhead_ms` {p50, p99} with the service's model pulled into the gateway; `overhead_ms_predict_over_http` with
each prediction asked of the service over HTTP (what `overhead_ms` measured before `--pull-model` existed);
`overhead_ms_embedded`; with `replicas_redis`, `overhead_ms_pulled_replicas`: the model pulled, the gateway one of
two replicas telling each other what they send through that Redis (`--replicas-redis`; the other idle but listening),
with `replica_events` (the figure null if neither replica heard the other); with `tls_upstream`,
`overhead_ms_pulled_tls_upstream`: the model pulled, a fleet of its own serving HTTPS (a certificate made for the
run, `--upstream-ca`), the direct probe over TLS as well; `fallbacks` (the Leadtime gateways' decisions made by the
heuristics), `goodput_rps` {leadtime, round_robin} (the Leadtime run asks the service over HTTP, as before), and the
details beside them.
"""

from __future__ import annotations

import math
import os
import shutil
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leadtime.bench.loadgen import Result, Shot, paired_probes, replay
from leadtime.bench.procs import Predictor, Route, SimFleet
from leadtime.bench.tls import self_signed
from leadtime.json_text import print_json
from leadtime.predictor.client import tls_client_context
from leadtime.router_plugin.gateway.metrics import REPLICA_EVENT_DIRECTIONS
from leadtime.simulator.workload import arrival_window_s, load_workload, require_arrival_window, shape, spread_steps

FLEET = "mixed"
TTFT_SLO_MS = 2000.0
ITL_SLO_MS = 100.0
WARMUP_PAIRS = 5
"""The first probe pairs through each gateway, not counted: they open the connections and warm the caches."""


@dataclass(frozen=True)
class GatewayBenchOptions:
    trace: str = "mooncake"
    requests: int = 400
    rate_scale: float = 2.0
    probes: int = 200
    probe_words: int = 256
    processes: int = 2
    seed: int = 0
    replicas_redis: str | None = None
    tls_upstream: bool = False
    non_streaming_share: float = 0.0
    """Share of the replayed requests whose client asks for the whole answer at once (drawn with the seed)."""


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    a = np.asarray(values)
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3)}


MAX_REPLAY_S = 86_400.0
"""The longest arrival window replayed: the replay is in real time, and a trace stretched over more than a day
(timestamps of 1e300 ms, or seconds read as milliseconds at a low --rate-scale) would never finish."""


def workload_shots(options: GatewayBenchOptions) -> list[Shot]:
    """The requests replayed, refused (ValueError naming the trace) where their goodput is undefined, all arriving
    at one instant as `simulate` refuses them (it was printed as 1e9 req/s), or where the replay would not end."""
    requests = shape(spread_steps(load_workload(options.trace), options.seed), options.rate_scale, options.requests)
    # Without a cut to advise on: a trace with two timestamps has its steps spread, so only a whole trace at one
    # instant arrives at one, and replaying more of it would not help.
    require_arrival_window(requests, options.trace)
    window_s = arrival_window_s(requests)
    if window_s > MAX_REPLAY_S:
        raise ValueError(
            f"{options.trace}: the {len(requests)} requests replayed arrive over {window_s:.3g} s at --rate-scale "
            f"{options.rate_scale:g}, more than a day, which the real-time replay would take; raise --rate-scale or "
            "replay fewer requests (--requests)"
        )
    whole = np.random.default_rng(options.seed).random(len(requests)) < options.non_streaming_share
    return [
        Shot(
            i,
            r.arrival_ms / 1e3,
            tuple(r.segments),
            r.input_tokens,
            r.output_tokens,
            TTFT_SLO_MS,
            ITL_SLO_MS,
            stream=not whole[i],
        )
        for i, r in enumerate(requests)
    ]


def probe_pairs(
    route: Route, fleet: SimFleet, n: int, words: int, first_index: int, endpoint_tls: ssl.SSLContext | None = None
) -> tuple[list[float], list[Result]]:
    """(added time to first token per pair, every result)."""
    addresses = {e["name"]: f"{e['address']}:{e['port']}" for e in fleet.endpoints}
    pairs = paired_probes(
        route.url.removeprefix("http://"), addresses, n, words, first_index, (TTFT_SLO_MS, ITL_SLO_MS), endpoint_tls
    )
    added = [via.ttft_ms - direct.ttft_ms for via, direct in pairs[WARMUP_PAIRS:] if direct is not None and direct.ok]
    return added, [r for pair in pairs for r in pair if r is not None]


def _goodput(results: list[Result], shots: list[Shot]) -> float:
    window = max(s.at_s for s in shots) - min(s.at_s for s in shots)
    met = sum(r.meets(s.ttft_slo_ms, s.itl_slo_ms) for r, s in zip(results, shots, strict=True))
    return met / max(window, 1e-9)


def _summary(results: list[Result], shots: list[Shot]) -> dict[str, Any]:
    """Goodput, SLO attainment, TTFT and ITL are of the streaming requests (only their clients see a first token;
    without one, NaN: nothing was measured, not every SLO missed); `whole_ms`: the time non-streaming clients waited
    for their answer."""
    ok = [r for r in results if r.ok]
    streamed = [r for r in results if r.stream]
    met = sum(r.meets(TTFT_SLO_MS, ITL_SLO_MS) for r in streamed)
    out = {
        "goodput_rps": round(_goodput(results, shots), 3) if streamed else math.nan,
        "slo_attainment": round(met / len(streamed), 4) if streamed else math.nan,
        "ttft_ms": _pct([r.ttft_ms for r in ok if r.stream]),
        "itl_ms": _pct([r.itl_ms for r in ok if r.stream and r.tokens > 1]),
        "route_ms": _pct([r.route_ms for r in ok]),
        "errors": len(results) - len(ok),
        "picks": {
            e: sum(r.endpoint == e for r in results) for e in sorted({r.endpoint for r in results if r.endpoint})
        },
    }
    if len(streamed) < len(results):
        out["whole_ms"] = _pct([r.ttfb_ms for r in ok if not r.stream])
        out["non_streaming"] = len(results) - len(streamed)
    return out


def replica_events(metric: Callable[..., float]) -> dict[str, float]:
    """What a replica gateway counted of its messages, every direction the gateway counts (`metric` reads one
    series of its /metrics), and how many replicas it heard: the context of its overhead figure."""
    events = {d: metric("leadtime_router_replica_events_total", direction=d) for d in REPLICA_EVENT_DIRECTIONS}
    return events | {"replicas_heard": metric("leadtime_router_replicas_heard")}


def replica_overhead(
    added: list[float], events: dict[str, float], warn: Callable[[str], None]
) -> dict[str, float] | None:
    """The overhead of the gateway that is one of two replicas; None (and a warning) if it never heard the other:
    then it measured a lone gateway, not one sharing through Redis, and its figure would say otherwise."""
    if not events.get("replicas_heard"):
        warn(
            f"no replica was heard through --replicas-redis (replica events {events}): "
            "overhead_ms_pulled_replicas is left out"
        )
        return None
    return _pct(added)


def run_gateway_bench(
    options: GatewayBenchOptions = GatewayBenchOptions(),
    progress: Callable[[str], None] | None = None,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The report described above; `progress` gets a line per phase, `warn` what makes a figure left out. The
    trace is read first, so that a trace that is not one is named before any process starts."""
    say = progress or (lambda message: None)
    shots = workload_shots(options)
    work = Path(tempfile.mkdtemp(prefix="leadtime-bench-gateway-"))
    report: dict[str, Any] = {"fleet": FLEET, "trace": options.trace, "rate_scale": options.rate_scale}
    report["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
    all_results: list[Result] = []
    fallbacks = 0.0
    try:
        # 1. overhead, on an idle fleet
        say("overhead: starting the fleet, the predictor and three gateways")
        (work / "a").mkdir()
        predictor = Predictor(work / "a")
        fleet = SimFleet(FLEET, work / "a", options.seed)
        predictor.wait()
        discovery = ["--discovery", str(fleet.endpoints_file)]
        pulled = [*discovery, "--predictor-url", predictor.url, "--pull-model"]
        gateways = {"pulled": Route(work / "a", pulled)}
        if options.replicas_redis is not None:  # the same, one of two replicas telling each other what they send
            replica = [*pulled, "--replicas-redis", options.replicas_redis, "--replicas-group", "bench-gateway"]
            gateways["pulled_replicas"] = Route(work / "a", replica)
            gateways["idle_replica"] = Route(work / "a", replica)  # subscribed, heard, not measured
        gateways["http"] = Route(work / "a", [*discovery, "--predictor-url", predictor.url])
        gateways["embedded"] = Route(work / "a", [*discovery, "--embedded"])
        added: dict[str, list[float]] = {}
        try:
            for gateway in gateways.values():  # all started before any is measured
                gateway.wait()
            for i, (name, gateway) in enumerate(gateways.items()):
                if name == "idle_replica":
                    continue
                say(f"overhead: {options.probes} probe pairs through the gateway ({name} predictor)")
                added[name], results = probe_pairs(
                    gateway, fleet, options.probes, options.probe_words, 10 * i * options.probes
                )
                all_results += results
                fallbacks += gateway.metric("leadtime_router_fallbacks_total")
                if name == "pulled_replicas":
                    report["replica_events"] = replica_events(gateway.metric)
        finally:
            for gateway in gateways.values():
                gateway.child.stop()
            predictor.child.stop()
            fleet.stop()
        report["overhead_ms"] = _pct(added["pulled"])
        report["overhead_ms_predict_over_http"] = _pct(added["http"])
        report["overhead_ms_embedded"] = _pct(added["embedded"])
        if "pulled_replicas" in added:
            report["overhead_ms_pulled_replicas"] = replica_overhead(
                added["pulled_replicas"], report["replica_events"], warn or say
            )
        if options.tls_upstream:  # the gateway with the model pulled, before a fleet that serves HTTPS
            say(f"overhead: {options.probes} probe pairs through a gateway to endpoints serving HTTPS")
            (work / "tls").mkdir()
            cert, key = self_signed(work / "tls")
            predictor = Predictor(work / "tls")
            fleet = SimFleet(FLEET, work / "tls", options.seed, tls=(cert, key))
            predictor.wait()
            args = ["--discovery", str(fleet.endpoints_file), "--predictor-url", predictor.url, "--pull-model"]
            gateway = Route(work / "tls", [*args, "--upstream-ca", str(cert)])
            try:
                gateway.wait()
                added["pulled_tls_upstream"], results = probe_pairs(
                    gateway,
                    fleet,
                    options.probes,
                    options.probe_words,
                    10 * len(added) * options.probes,
                    tls_client_context(cert),
                )
                all_results += results
                fallbacks += gateway.metric("leadtime_router_fallbacks_total")
            finally:
                gateway.child.stop()
                predictor.child.stop()
                fleet.stop()
            report["overhead_ms_pulled_tls_upstream"] = _pct(added["pulled_tls_upstream"])
        report["overhead_pairs"] = {name: len(values) for name, values in added.items()}

        # 2. goodput, the same trace slice through the gateway with each policy, each on a fresh fleet
        window = max(s.at_s for s in shots)
        runs: dict[str, dict[str, Any]] = {}
        policies = [("round_robin", ["--policy", "round-robin"], False), ("leadtime", [], True)]
        if options.non_streaming_share > 0:  # Leadtime again, the non-streaming requests sent on unchanged
            policies.append(("leadtime_unmeasured", ["--no-measure-non-streaming"], True))
        for name, args, with_predictor in policies:
            say(f"goodput: {len(shots)} requests over {window:.0f} s through the gateway routing {name}")
            run_dir = work / name
            run_dir.mkdir()
            fleet = SimFleet(FLEET, run_dir, options.seed)
            service = Predictor(run_dir).wait() if with_predictor else None
            extra = ["--predictor-url", service.url] if service is not None else []
            route = Route(run_dir, ["--discovery", str(fleet.endpoints_file), *args, *extra])
            try:
                route.wait()
                started = time.monotonic()
                results = replay(route.url.removeprefix("http://"), shots, options.processes)
                runs[name] = _summary(results, shots)
                runs[name]["wall_s"] = round(time.monotonic() - started, 1)
                all_results += results
                if service is not None:
                    runs[name]["fallbacks"] = route.metric("leadtime_router_fallbacks_total")
                    fallbacks += runs[name]["fallbacks"]
                    calls = route.metric("leadtime_router_predictor_call_seconds_count", call="predict", result="ok")
                    took = route.metric("leadtime_router_predictor_call_seconds_sum", call="predict", result="ok")
                    runs[name]["predict_call_ms_mean"] = round(1e3 * took / max(calls, 1), 3)
                    runs[name]["observed"] = route.metric("leadtime_router_observations_total", result="queued")
                decisions = route.metric("leadtime_router_decision_seconds_count")
                took = route.metric("leadtime_router_decision_seconds_sum")
                runs[name]["decision_ms_mean"] = round(1e3 * took / max(decisions, 1), 3)
            finally:
                route.child.stop()
                if service is not None:
                    service.child.stop()
                fleet.stop()
        report["goodput_rps"] = {name: runs[name]["goodput_rps"] for name in ("leadtime", "round_robin")}
        report["runs"] = runs
        report["window_s"] = round(window, 1)
        report["requests"] = len(all_results)
        report["errors"] = sum(not r.ok for r in all_results)
        report["fallbacks"] = int(fallbacks)
        report["slo_ms"] = {"ttft": TTFT_SLO_MS, "itl": ITL_SLO_MS}
        report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    order = ["requests", "errors", "overhead_ms", "fallbacks", "goodput_rps"]
    return {**{k: report[k] for k in order}, **{k: v for k, v in report.items() if k not in order}}


def _shown(value: float, spec: str) -> str:
    """A figure of the table; "–" where nothing was measured (a run without a streaming request).

    >>> _shown(0.5, ".1%"), _shown(math.nan, ".2f")
    ('50.0%', '–')
    """
    return "–" if math.isnan(value) else format(value, spec)


def print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(report)
        return
    from rich.table import Table

    from leadtime.console import report_console

    console = report_console()
    o, h, e = report["overhead_ms"], report["overhead_ms_predict_over_http"], report["overhead_ms_embedded"]
    console.print(
        f"gateway overhead (added time to first token, {report['overhead_pairs']['pulled']} pairs): "
        f"p50 {o['p50']:.2f} ms, p99 {o['p99']:.2f} ms with the service's model pulled; "
        f"p50 {h['p50']:.2f} ms, p99 {h['p99']:.2f} ms with each prediction over HTTP; "
        f"p50 {e['p50']:.2f} ms, p99 {e['p99']:.2f} ms embedded"
    )
    if "overhead_ms_pulled_tls_upstream" in report:
        t = report["overhead_ms_pulled_tls_upstream"]
        console.print(
            "with the model pulled, to endpoints serving HTTPS (the direct probe over TLS too): "
            f"p50 {t['p50']:.2f} ms, p99 {t['p99']:.2f} ms"
        )
    if report.get("overhead_ms_pulled_replicas") is not None:
        r = report["overhead_ms_pulled_replicas"]
        console.print(
            f"with the model pulled, as one of two replicas sharing through Redis: p50 {r['p50']:.2f} ms, "
            f"p99 {r['p99']:.2f} ms ({report['replica_events']})"
        )
    table = Table(
        title=f"{report['trace']} ×{report['rate_scale']} on {report['fleet']}, {report['window_s']} s of arrivals"
    )
    for column in (
        "policy",
        "goodput rps",
        "SLO met",
        "TTFT p50/p99 ms",
        "ITL p50/p99 ms",
        "route p50/p99 ms",
        "errors",
    ):
        table.add_column(column)
    whole = any("whole_ms" in r for r in report["runs"].values())
    if whole:
        table.add_column("whole answer p50/p99 ms")
        table.add_column("outcomes learned")
    for name, r in report["runs"].items():
        t, i, g = r["ttft_ms"], r["itl_ms"], r["route_ms"]
        w = r.get("whole_ms", {"p50": float("nan"), "p99": float("nan")})
        extra = [f"{w['p50']:.0f} / {w['p99']:.0f}", f"{r.get('observed', 0):.0f}"] if whole else []
        table.add_row(
            name,
            _shown(r["goodput_rps"], ".2f"),
            _shown(r["slo_attainment"], ".1%"),
            f"{t['p50']:.0f} / {t['p99']:.0f}",
            f"{i['p50']:.1f} / {i['p99']:.1f}",
            f"{g['p50']:.2f} / {g['p99']:.2f}",
            str(r["errors"]),
            *extra,
        )
    console.print(table)
    console.print(f"requests {report['requests']}, errors {report['errors']}, fallbacks {report['fallbacks']}")
