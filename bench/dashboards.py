"""The dashboards over live metrics: the whole stack on loopback, scraped by a real Prometheus.

`DashboardStack` starts `leadtime sim serve` (a small P/D fleet of three accelerator classes, one prefill pool
time-sliced with an RL job), `leadtime serve` (with Redis when given its URL), `leadtime route` in front of the
fleet reading the time-slice orchestrator, and `prometheus` with the shipped scrape configuration
(`dashboards/provisioning/prometheus.yml`) pointed at the two. `drive` sends streaming completions through the
gateway with SLO headers (short prompts a decode endpoint prefills itself, long ones disaggregated) and a few
gRPC predictions, so every panel has something to show. The dashboard tests run it for seconds;
`leadtime bench dashboards` runs it for minutes and renders the README's picture.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from leadtime.bench.procs import Predictor, Prometheus, Route, SimFleet
from leadtime.dashboards.files import FOLDER

FLEET = {
    "name": "dashboards",
    "refresh_ms": 50,
    "kv_link_gb_s": 25,
    "pools": [
        {"name": "prefill", "count": 1, "accelerator": "h100-sxm", "model": "llama-3.1-8b", "role": "prefill"},
        {
            "name": "shared",
            "count": 1,
            "accelerator": "a100-sxm-80gb",
            "model": "llama-3.1-8b",
            "role": "prefill",
            "timeslice_group": "rl",
        },
        {"name": "decode", "count": 2, "accelerator": "h200-sxm", "model": "llama-3.1-8b", "role": "decode"},
    ],
    "timeslice_groups": {
        "rl": {
            "resident_ms": {"distribution": "fixed", "value": 2000},
            "away_ms": {"distribution": "fixed", "value": 2000},
            "restore_ms": {"distribution": "fixed", "value": 50},
        }
    },
}
SCRAPE_CONFIG = FOLDER / "provisioning" / "prometheus.yml"
ALERTS = FOLDER / "provisioning" / "alerts.yml"
WORDS = ("latency", "prefill", "decode", "token", "cache", "router", "fleet", "queue", "batch", "model", "kv")
# (TTFT, ITL) SLOs in ms a request carries: on this small mock fleet TTFT is ~20 ms and ITL ~8 ms when it is not
# busy, so the tighter ones are missed under load.
SLOS = ((25, 8), (100, 20), (1000, 100))


def prometheus_config(predictor: str, router: str, scrape_interval_s: float) -> dict[str, Any]:
    """The shipped scrape configuration with its targets replaced, a shorter scrape interval, and the shipped
    alerting rules (named by their path: the configuration is written elsewhere)."""
    config: dict[str, Any] = yaml.safe_load(SCRAPE_CONFIG.read_text())
    interval = f"{scrape_interval_s:g}s"
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = interval
    config["rule_files"] = [str(ALERTS)]
    targets = {"leadtime-predictor": predictor, "leadtime-router": router}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    return config


@dataclass
class Traffic:
    """What `DashboardStack.drive` sent and how it went."""

    requests: int = 0
    errors: int = 0
    grpc_predictions: int = 0
    started: float = 0.0
    ended: float = 0.0
    status: dict[int, int] = field(default_factory=dict)


class DashboardStack:
    """The fleet, the predictor service, the gateway and Prometheus, each its own process on loopback."""

    def __init__(
        self,
        workdir: Path,
        prometheus: str,
        redis_url: str | None = None,
        scrape_interval_s: float = 1.0,
        retrain_every: int = 50,
    ) -> None:
        self.workdir = workdir
        self.scrape_interval_s = scrape_interval_s
        fleet_file = workdir / "fleet.yaml"
        fleet_file.write_text(yaml.safe_dump(FLEET))
        env = {"LEADTIME_RETRAIN_EVERY": str(retrain_every), "LEADTIME_MIN_RETRAIN_INTERVAL_S": "1"}
        self.predictor: Predictor | None = Predictor(workdir, redis_url=redis_url, env=env)
        self.fleet: SimFleet | None = None
        self.route: Route | None = None
        self.prometheus: Prometheus | None = None
        self._prometheus_binary = prometheus
        self._fleet_file = fleet_file

    def __enter__(self) -> DashboardStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start every process (the slow ones side by side) and return once Prometheus has scraped both."""
        assert self.predictor is not None
        self.fleet = SimFleet(self._fleet_file, self.workdir)
        assert self.fleet.timeslice_url is not None
        self.predictor.wait()
        args = ["--discovery", str(self.fleet.endpoints_file), "--predictor-url", self.predictor.url]
        self.route = Route(self.workdir, [*args, "--timeslice-url", self.fleet.timeslice_url])
        self.route.wait()
        config = prometheus_config(
            f"127.0.0.1:{self.predictor.port}", f"127.0.0.1:{self.route.port}", self.scrape_interval_s
        )
        self.prometheus = Prometheus(self._prometheus_binary, self.workdir, config)
        self.prometheus.wait_ready()
        self.prometheus.wait_targets_up()

    def stop(self) -> None:
        for child in (self.route, self.predictor):
            if child is not None:
                child.child.stop()
        if self.fleet is not None:
            self.fleet.stop()
        if self.prometheus is not None:
            self.prometheus.stop()

    def drive(
        self,
        seconds: float,
        concurrency: Callable[[float], int] = lambda _: 3,
        seed: int = 0,
    ) -> Traffic:
        """Streaming completions through the gateway for `seconds` (`concurrency(elapsed)` at a time), and a gRPC
        prediction every half second."""
        assert self.route is not None and self.predictor is not None
        traffic = Traffic(started=time.time())
        lock = threading.Lock()
        stop_at = time.monotonic() + seconds
        start = time.monotonic()
        url = self.route.url

        def one(worker: int) -> None:
            rng = random.Random(seed * 1000 + worker)
            while time.monotonic() < stop_at:
                if worker >= concurrency(time.monotonic() - start):
                    time.sleep(0.2)
                    continue
                status = _request(url, rng)
                with lock:
                    traffic.requests += 1
                    traffic.status[status] = traffic.status.get(status, 0) + 1
                    traffic.errors += status != 200

        grpc_thread = threading.Thread(target=self._grpc_predictions, args=(stop_at, traffic), daemon=True)
        grpc_thread.start()
        workers = max(concurrency(t) for t in range(0, max(int(seconds), 1) + 1))
        with ThreadPoolExecutor(max(workers, 1)) as pool:
            list(pool.map(one, range(max(workers, 1))))
        grpc_thread.join()
        traffic.ended = time.time()
        return traffic

    def _grpc_predictions(self, stop_at: float, traffic: Traffic) -> None:
        from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
        from leadtime.predictor.client import GrpcPredictorClient, PredictorError

        assert self.predictor is not None
        client = GrpcPredictorClient(self.predictor.grpc)
        row = FeatureRow(RequestFeatures(800), EndpointState(endpoint_id="decode-0", accelerator="h200-sxm"))
        try:
            while time.monotonic() < stop_at:
                try:
                    client.predict([row], 1.0)
                    traffic.grpc_predictions += 1
                except PredictorError:
                    pass
                time.sleep(0.5)
        finally:
            client.close()


def _request(url: str, rng: random.Random) -> int:
    """One streaming completion: a prompt of 5 to 1,500 words sharing a prefix with others, SLO headers."""
    words = 5 if rng.random() < 0.4 else rng.randint(200, 1500)
    prefix = f"system prompt {rng.randint(0, 3)} " * 20
    prompt = prefix + " ".join(rng.choice(WORDS) for _ in range(words))
    ttft, itl = rng.choice(SLOS)
    headers = {"x-llm-d-slo-ttft-ms": str(ttft), "x-llm-d-slo-tpot-ms": str(itl)}
    body = {"prompt": prompt, "max_tokens": rng.randint(4, 24), "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as response:
            for _ in response.iter_lines():
                pass
        return response.status_code
    except httpx.HTTPError:
        return 0


def waves(period_s: float, low: int, high: int) -> Callable[[float], int]:
    """A concurrency that rises from `low` to `high` and back every `period_s` (load that changes over time)."""

    def at(elapsed: float) -> int:
        return low + round((high - low) * (1 - math.cos(2 * math.pi * elapsed / period_s)) / 2)

    return at


def run_dashboard_bench(
    out: Path,
    minutes: float,
    prometheus: str,
    workdir: Path,
    redis_url: str | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Path]:
    """The stack under `minutes` of changing load, then a PNG of each dashboard's main panels in `out`."""
    from leadtime.dashboards.definitions import DASHBOARDS
    from leadtime.dashboards.render import PrometheusApi, render_dashboard

    with DashboardStack(workdir, prometheus, redis_url, scrape_interval_s=2.0, retrain_every=200) as stack:
        assert stack.prometheus is not None
        progress(f"stack up; Prometheus at {stack.prometheus.url}; {minutes:g} min of traffic")
        traffic = stack.drive(minutes * 60, waves(120.0, 1, 6))
        progress(f"{traffic.requests} requests ({traffic.errors} failed), {traffic.grpc_predictions} gRPC predictions")
        time.sleep(3 * stack.scrape_interval_s)  # the last scrapes
        api = PrometheusApi(stack.prometheus.url)
        paths = []
        for board in DASHBOARDS:
            path, panels = render_dashboard(board, api, out, minutes=minutes, end=time.time())
            empty = [p.panel.title for p in panels if not p.has_data]
            progress(f"wrote {path}" + (f" (no data: {', '.join(empty)})" if empty else ""))
            paths.append(path)
        return paths
