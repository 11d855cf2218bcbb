"""Assemble a gateway from its parts and serve it (the body of `leadtime route`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import sys
import threading
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn

from leadtime.predictor.metrics import expose_without_created_series
from leadtime.predictor.service.ports import check_port_free
from leadtime.predictor.service.serve import check_tls_files
from leadtime.predictor.store.redis_store import check_configuration, without_credentials
from leadtime.router_plugin.client import PredictorClient
from leadtime.router_plugin.config import (
    SHIPPED_CONFIG,
    ConfigError,
    build_policy,
    load_config,
    profile_parameters,
    profile_types,
)
from leadtime.router_plugin.discovery import FileDiscovery, StaticDiscovery, parse_static
from leadtime.router_plugin.gateway.app import Gateway, GatewaySettings
from leadtime.router_plugin.gateway.metrics import GatewayMetrics
from leadtime.router_plugin.gateway.predictor import GatewayPredictor
from leadtime.router_plugin.gateway.pulled import PulledModel
from leadtime.router_plugin.gateway.replicas import ReplicaSync
from leadtime.router_plugin.heuristics import LeastQueuePolicy, RandomPolicy, RoundRobinPolicy
from leadtime.router_plugin.policy import RoutingPolicy
from leadtime.router_plugin.scrape import monotonic_ms
from leadtime.router_plugin.shadow import ShadowLearning
from leadtime.router_plugin.timeslice_sources import FileTimesliceSource, HttpTimesliceSource

log = logging.getLogger("leadtime.router")

CUT_GRACE_S = 2
"""How long after the drain, and the gateway's cut of the requests still in flight, uvicorn waits before cancelling
what is left (a request still sending its body, which the cut does not reach): the cut requests' answers end in
that time, so uvicorn's cancellation, logged as an error with a traceback per task, is kept for what is stuck."""

PLAIN_POLICIES = {"round-robin": RoundRobinPolicy, "random": RandomPolicy, "least-queue": LeastQueuePolicy}
"""Policies chosen by name instead of from the plugin configuration (baselines for comparisons)."""


@dataclass(frozen=True)
class RouteOptions:
    """Everything `leadtime route` was told."""

    discovery: Path | None = None
    endpoints: tuple[str, ...] = ()
    config: Path | None = None
    profile: str = "default"
    policy: str = ""
    timeslice_file: Path | None = None
    timeslice_url: str | None = None
    settings: GatewaySettings = GatewaySettings()
    replicas_redis: str | None = None
    replicas_group: str = "default"
    shadow: bool = False
    """With a plain `policy` or a profile that does not predict: the predictor predicts its picks and learns from
    them (`router_plugin.shadow`)."""


def _chosen_types(options: RouteOptions) -> frozenset[str]:
    """The plugin types the chosen profile runs (none for a plain `--policy`)."""
    if options.policy:
        return frozenset()
    config = load_config(options.config or SHIPPED_CONFIG)
    return profile_types(config, options.profile)


def needs_predictor(options: RouteOptions) -> bool:
    """Whether the chosen profile scores with predicted latency, or a policy that does not is shadowed;
    ConfigError for a shadowed profile that predicts already, and for a plugin configuration or time-slice states
    nothing would read."""
    unread = [
        flag for flag, given in (("--config", options.config), ("--profile", options.profile != "default")) if given
    ]
    if options.policy and unread:
        raise ConfigError(
            f"{' and '.join(unread)}: --policy {options.policy} does not read the plugin configuration, so "
            f"{'they' if len(unread) > 1 else 'it'} would go unused"
        )
    types = _chosen_types(options)
    if options.timeslice_file is not None or options.timeslice_url is not None:
        given = "--timeslice-file" if options.timeslice_file is not None else "--timeslice-url"
        if options.policy:
            raise ConfigError(f"{given}: --policy {options.policy} does not read time-slice states")
        if "timeslice-filter" not in types:
            raise ConfigError(
                f"{given}: profile {options.profile!r} has no timeslice-filter, so the group states would go unused"
            )
    if options.policy:
        return options.shadow
    predicts = "predicted-latency-scorer" in types
    if predicts and options.shadow:
        raise ConfigError(
            f"--shadow: profile {options.profile!r} routes on predictions and learns from every request already; "
            "shadow a plain --policy or a profile without the predicted-latency scorer"
        )
    return predicts or options.shadow


def build_gateway(
    options: RouteOptions,
    predict_client: PredictorClient | None = None,
    observe_client: PredictorClient | None = None,
    remote: bool = True,
) -> Gateway:
    """The gateway `options` describe; raises ConfigError, DiscoveryError or TimesliceError on bad input.

    `remote`: the predictor is in another process (decisions then wait for it on a thread of their own); a
    pulled model (`pulled.PulledModel`) predicts in this one, so decisions are made on the event loop.
    """
    discovery: FileDiscovery | StaticDiscovery
    if options.discovery is not None:
        discovery = FileDiscovery(options.discovery, catalog=options.settings.catalog)
    else:
        discovery = StaticDiscovery(parse_static(options.endpoints, options.settings.catalog))
    metrics = GatewayMetrics()
    predictor = None
    if predict_client is not None:
        predictor = GatewayPredictor(predict_client, observe_client or predict_client, metrics)
        if isinstance(predict_client, PulledModel):
            predict_client.metrics = metrics
    policy: RoutingPolicy
    settings = options.settings
    if options.policy:
        policy = PLAIN_POLICIES[options.policy]()
    else:
        config = load_config(options.config or SHIPPED_CONFIG)
        policy = build_policy(config, predictor, options.profile, catalog=settings.catalog)
        timeslice = profile_parameters(config, options.profile, "timeslice-filter")
        if timeslice is not None:  # the gateway's own view of the groups (metrics, warnings, heuristic profiles)
            settings = dataclasses.replace(settings, serving_job=timeslice.serving_job)
    if options.shadow:
        if predictor is None:
            raise ConfigError("--shadow: the policy's picks are predicted and learned: give a predictor")
        policy = ShadowLearning(policy, predictor)
    gateway = Gateway(
        discovery,
        policy,
        settings,
        predictor,
        metrics=metrics,
        decide_in_thread=remote and predictor is not None and not isinstance(predict_client, PulledModel),
    )
    if options.replicas_redis is not None:
        try:
            sync = ReplicaSync(options.replicas_redis, options.replicas_group, gateway.apply_replica_event, metrics)
            # A refused password or database is refused here, in one line; an unreachable Redis is ridden out (the
            # replicas route on what each knows meanwhile).
            check_configuration(options.replicas_redis)
        except ValueError as err:  # RedisRefused too
            raise ConfigError(f"--replicas-redis {without_credentials(options.replicas_redis)}: {err}") from None
        gateway.attach_replicas(sync)
    if options.timeslice_file is not None:
        source = FileTimesliceSource(options.timeslice_file, monotonic_ms)
        source.first_read()
        gateway.attach_timeslice(source)
    elif options.timeslice_url is not None:
        gateway.attach_timeslice(HttpTimesliceSource(options.timeslice_url, gateway.upstreams, gateway.clock))
    return gateway


def serve_gateway(gateway: Gateway, tls: tuple[Path, Path] | None = None) -> None:
    """Serve until interrupted, over TLS from `tls` (a PEM certificate chain and its key) when given; an OSError in
    one line when the address cannot be listened on or the TLS files are not a certificate and its key.

    The interpreter's thread switch interval is shortened from 5 ms to 0.5 ms: when the decision thread's
    predictor answer arrives while the event loop is busy, it waits at most that long for the interpreter.
    """
    settings = gateway.settings
    if tls is not None:
        check_tls_files(*tls)
    check_port_free(settings.host, settings.port, "the gateway")  # before uvicorn, which would log a failure, exit 3
    sys.setswitchinterval(0.0005)
    expose_without_created_series()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per model pull or time-slice poll
    endpoints = gateway.discovery.endpoints
    source = getattr(gateway.discovery, "path", None)
    log.info(
        "routing on %s://%s:%d: %d endpoint%s %s; %s%s",
        "https" if tls else "http",
        settings.host,
        settings.port,
        len(endpoints),
        "" if len(endpoints) == 1 else "s",
        f"from {source}, re-read when it changes" if source is not None else "given on the command line",
        "clients need an API key" if settings.api_keys else "open to any client that reaches it (no --api-key)",
        f"; sharing with replicas through {gateway.replicas.address}" if gateway.replicas else "",
    )
    if settings.allowed_hosts:
        log.info(
            "answering only the Host %s (--allowed-host; /healthz, /readyz and /metrics any)",
            ", ".join(settings.allowed_hosts),
        )
    config = uvicorn.Config(
        gateway,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        loop="uvloop",
        http="httptools",
        server_header=False,  # the endpoint's own date and server headers are passed through
        date_header=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
        timeout_graceful_shutdown=settings.drain_s + CUT_GRACE_S,  # the gateway cuts its requests first
    )
    _Draining(config, gateway).run()


SIGHUP_IGNORED = (
    "SIGHUP ignored: --config is read once at start (restart the gateway to change it: SIGTERM drains it); "
    "the discovery and time-slice files are re-read when they change"
)
"""What the gateway logs at a SIGHUP, which it ignores: a service manager's reload (or a closed terminal) ended it
at once, requests in flight cut, while it has nothing to reload."""


class _Draining(uvicorn.Server):
    """uvicorn's server, saying at the first stop signal what it waits for, and for how long at most, and ignoring
    SIGHUP with a line saying why."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's stop signals (SIGINT, SIGTERM), and SIGHUP ignored with a log line, its handler restored after."""
        if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
            with super().capture_signals():
                yield
            return
        previous = signal.signal(signal.SIGHUP, lambda sig, frame: log.warning(SIGHUP_IGNORED))
        try:
            with super().capture_signals():
                yield
        finally:
            signal.signal(signal.SIGHUP, previous)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            n, drain = self.gateway.in_flight, self.gateway.settings.drain_s
            if n:
                requests, them = ("request", "it") if n == 1 else ("requests", "them")
                log.info("stopping: %d %s in flight, finishing %s for at most %g s", n, requests, them, drain)
            else:
                log.info("stopping")
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, with the requests still in flight when the drain ends cut by the gateway: a cut is
        expected (`--drain-s`), so it is one line and an answer each that says it was cut, not uvicorn's
        cancellation (see `CUT_GRACE_S`)."""
        timer = asyncio.get_running_loop().call_later(self.gateway.settings.drain_s, self._cut)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _cut(self) -> None:
        n = self.gateway.cut()
        if n:
            requests = "request" if n == 1 else "requests"
            log.warning(
                "stopping: cut %d %s still in flight after the drain of %g s",
                n,
                requests,
                self.gateway.settings.drain_s,
            )
