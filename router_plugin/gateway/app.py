"""The gateway: an OpenAI-compatible HTTP front that routes every request with the plugin's policy.

Per request (`/v1/completions`, `/v1/chat/completions`, streaming or not):

1. read the body and what routing needs of it (`requests.parse_request`): prompt, model, SLO headers;
2. hash the prompt's chunks and estimate, per endpoint, the tokens it holds cached (`affinity.PrefixAffinity`);
3. offer the policy one `Candidate` per routable endpoint: its last scraped state and when it was scraped,
   its time-slice group (and that group's state), its prefix hits; the policy decides on a thread of its own
   (one decision at a time, so the policy needs no locks), calling the predictor within its deadline (counted from
   when the decision was queued for the thread) or falling back to the heuristics;
4. forward the body to the chosen endpoint (on P/D the decode endpoint, with the prefill endpoint in
   `x-prefiller-host-port`), unchanged but for the stream it asks for (below), headers passed through but
   hop-by-hop ones; an endpoint that fails before answering is left out and the request decided again, once;
5. pass the answer back as it arrives, status, headers and errors included, measuring TTFT and ITL from the
   stream (whose usage event the gateway asks for when the client did not, to count tokens, and keeps from that
   client), tell the policy when the first token passes (`prefilled`, when it has one: peers release the
   request's prefill side then), and report the outcome to the policy, which learns from it (observations reach
   the predictor in batches, `predictor.GatewayPredictor`).

A non-streaming request goes on asking for a stream, which is timed and put back together into one JSON body
for its client (`assemble`; requests whose answer that would not rebuild go on unchanged). Failed requests, and
non-streaming ones answered whole, teach nothing (a whole answer has no first-token time); the policy is told to
forget them (`abandon`, when it has one), and so of endpoints discovery no longer lists (`forget_endpoint`).
Its own paths: `/metrics` (`metrics.GatewayMetrics`), `/healthz`, `/readyz` (ready once an endpoint that serves
clients, not a prefill-only one, can be routed to).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

from leadtime.features.catalog import BUILT_IN, Catalog
from leadtime.features.rows import EndpointState, FeatureRow, RequestFeatures
from leadtime.predictor.client import tls_client_context
from leadtime.predictor.metrics import UNMATCHED_PATH
from leadtime.predictor.service.hosts import UNCHECKED_PATHS, host_allowed, host_header, host_refusal
from leadtime.router_plugin.affinity import PrefixAffinity, PromptKey
from leadtime.router_plugin.client import PredictorError
from leadtime.router_plugin.discovery import DiscoveredEndpoint, FileDiscovery, StaticDiscovery
from leadtime.router_plugin.gateway.assemble import Assembler, whole_answer
from leadtime.router_plugin.gateway.client_watch import ClientLeft, ClientWatch
from leadtime.router_plugin.gateway.inflight_work import Active, InflightWork, with_tokens
from leadtime.router_plugin.gateway.metrics import STATUS_CLASSES, GatewayMetrics
from leadtime.router_plugin.gateway.outliers import Outliers
from leadtime.router_plugin.gateway.passthrough import PASSED_THROUGH, PassedThroughLoad
from leadtime.router_plugin.gateway.predictor import BackgroundModel, GatewayPredictor, failure_reason
from leadtime.router_plugin.gateway.replicas import ReplicaSync, WorkEvent
from leadtime.router_plugin.gateway.requests import BadRequest, ParsedRequest, bearer_ok, parse_request
from leadtime.router_plugin.gateway.stream import StreamMeter
from leadtime.router_plugin.gateway.upstream import REQUEST_FAILURE_KINDS, Response, UpstreamError, Upstreams
from leadtime.router_plugin.heuristics import LlmdHeuristicPolicy
from leadtime.router_plugin.ledgers import LedgerEvent, RouterLedgers
from leadtime.router_plugin.policy import (
    Candidate,
    NoCandidateError,
    Outcome,
    Pick,
    RouteRequest,
    RoutingPolicy,
    candidates_that_fit,
)
from leadtime.router_plugin.scrape import EndpointScrape, Scraper, monotonic_ms
from leadtime.router_plugin.timeslice import SERVING_JOB, TimesliceSource

log = logging.getLogger("leadtime.router.gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROXIED_PATHS = ("/v1/completions", "/v1/chat/completions")
COUNTED_PATHS = (*PROXIED_PATHS, "/v1/models", *sorted(PASSED_THROUGH))
"""The paths requests_total counts by (the probes and /metrics are not counted): each exported at 0 from the start
under the code it answers when it serves, 200, so that rate() sees a path's first burst. Other codes are not known
in advance, and appear with the first."""
PROBED_PATHS = ("/healthz", "/readyz", "/metrics")
"""Paths load balancers and `curl -I` probe with HEAD: answered as GET, without the body."""
PREFILLER_HEADER = b"x-prefiller-host-port"
HOP_BY_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",  # the gateway has the whole body; a client's 100-continue was answered by its own server
        PREFILLER_HEADER,
    )
)


def end_to_end(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers a proxy passes on: neither the hop-by-hop ones nor those its `Connection` header names (RFC 9110
    7.6.1: they are for that hop alone).

    >>> end_to_end([(b"Connection", b"close, X-Mine"), (b"x-mine", b"1"), (b"x-other", b"2"), (b"host", b"h")])
    [(b'x-other', b'2')]
    """
    headers = list(headers)
    named = {
        token.strip().lower().encode()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.decode("latin-1").split(",")
    }
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() not in named]


MAX_HOLD_MS = 60_000.0
"""A policy still holding a request after this long (`Pick.hold`) is overruled: the heuristics place it."""
PANIC_SHARE = 0.5
"""With fewer than this share of the scraped endpoints left in by `outliers`, all of them are routed to (Envoy's
default panic threshold): a failure that is everyone's is no endpoint's to be taken out for."""
NOT_HTTP_KINDS = frozenset(("malformed", "upgrade"))
"""Upstream failures (`UpstreamError.kind`) that say the endpoint does not speak HTTP/1.1: warned of (`_failed`)."""
RETRIED_STATUSES = frozenset((502, 503, 504))
"""Answers sent on to a second endpoint (once) rather than to the client: the endpoint, or a proxy before it, says
it cannot serve now (gateway errors, as Envoy's `gateway-error` retry policy names them), and nothing was generated.
A 500 is not retried: it may be what this request does anywhere."""
PROGRESS_SHARED_EVERY = 32
"""Tokens a request generates between two reports of its decode progress to the other replicas: each then counts
its decode work to within that many tokens, at one event per request every 32 tokens on the channel."""


@dataclass(frozen=True)
class GatewaySettings:
    """How the gateway runs (the `leadtime route` options)."""

    host: str = "127.0.0.1"
    port: int = 8080
    scrape_interval_s: float = 0.05
    scrape_timeout_s: float = 1.0
    unroutable_after_s: float = 3.0
    discovery_poll_s: float = 1.0
    timeslice_poll_s: float = 0.1
    default_accelerator: str = ""
    default_model: str = ""
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    serving_job: str = SERVING_JOB
    """The inference job's name in the time-slice group states, by which the gateway takes each group as serving or
    away: the chosen profile's `timeslice-filter` `servingJob` (`serve.build_gateway` sets it)."""
    chunk_bytes: int = 64
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0
    """Longest wait for an endpoint's answer to start, and between two pieces of it."""
    max_body_bytes: int = 32 << 20
    upstream_ca_file: str | None = None
    """PEM bundle that endpoints serving HTTPS are verified with (default: the system's trusted CAs)."""
    measure_non_streaming: bool = True
    """Send non-streaming requests on as streams, to time them (`assemble`), and answer their clients whole."""
    ask_usage: bool = True
    """Ask for the usage of streams whose client did not, to count their tokens (kept from the client)."""
    api_keys: tuple[str, ...] = ()
    """Bearer tokens a client must show on the API's paths (`/v1/...` and the passed-through ones); none: open."""
    allowed_hosts: tuple[str, ...] = ()
    """The Host headers requests may name, as `predictor.service.hosts.check_allowed_host` leaves them (the
    DNS-rebinding defence); none: any. `/healthz`, `/readyz` and `/metrics` answer any Host."""
    drain_s: int = 30
    """On a stop, how long requests in flight may take to finish (a frozen endpoint would hold them for
    `upstream_timeout_s`)."""
    catalog: Catalog = BUILT_IN
    """The accelerator classes and models endpoints may be of (`--catalog FILE` adds to the built-in ones)."""


@dataclass
class _Decision:
    pick: Pick
    fell_back: str | None
    seconds: float
    explored: bool = False
    """The policy took an endpoint its model is unsure of (its exploration share), not the best predicted one."""


@dataclass
class _Routed:
    """One request on its way: what was decided, and where it went."""

    request_id: str
    route: RouteRequest
    parsed: ParsedRequest
    key: PromptKey
    decision: _Decision
    candidates: dict[str, Candidate]
    held_s: float = 0.0
    """How long the policy held the request before placing it (`Pick.hold`)."""
    settled: bool = False
    """Completed or abandoned: the policy and the work tracker were told."""
    shared_generated: int = 0
    """Tokens generated as last told to the other replicas (`PROGRESS_SHARED_EVERY`)."""
    sent_ms: float = 0.0
    """When it was sent on (router clock): a late failure of a request sent before its endpoint came back in is not
    held against it (`outliers`)."""
    received_ms: float = 0.0
    """When its body was in (router clock): its client's wait, which its SLOs are judged on, counts from there
    through any hold and a first endpoint's failure; the TTFT learned counts from `sent_ms`."""


def _moved(before: DiscoveredEndpoint, after: DiscoveredEndpoint) -> bool:
    """Whether discovery now lists the endpoint at another server: another host (not another spelling of it), port
    or scheme."""
    return (before.server, before.tls) != (after.server, after.tls)


def _event_stream(response: Response) -> bool:
    """Whether an endpoint answers with an event stream (one to measure and pass on event by event)."""
    return (response.header(b"content-type") or b"").startswith(b"text/event-stream")


def _counted_once_read(response: Response) -> bool:
    """A 200 event stream is counted by how it ends, not by its status: vLLM fails a request it has answered 200
    with an error event in the stream (`stream.error_in`), which is then the endpoint's answer (`Gateway._relay`)."""
    return 200 <= response.status < 300 and _event_stream(response)


def _without_body(send: Send) -> Send:
    """`send` for a HEAD request: GET's status and headers (its Content-Length included), an empty body."""

    async def head(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return head


def _json(obj: object) -> bytes:
    return orjson.dumps(obj)


def openai_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """An error as OpenAI's API and vLLM answer it, which OpenAI clients read the message of (from a body of another
    shape they show "Error code: 503" alone); `param` names the field at fault.

    >>> openai_error(503, "no endpoint can serve this request now", "endpoints")["error"]["type"]
    'ServiceUnavailableError'
    """
    kind = HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def stream_failed(endpoint_id: str, err: UpstreamError) -> bytes:
    """What ends a stream its endpoint broke off: the error event vLLM sends when a stream fails (which OpenAI
    clients raise on), then `[DONE]`; without it the client would take the cut answer for a whole one.

    >>> stream_failed("e-0", UpstreamError("reset", "connection closed")).decode()[:60]
    'data: {"error":{"message":"endpoint e-0 failed mid-stream: r'
    """
    return stream_error(502, f"endpoint {endpoint_id} failed mid-stream: {err}")


class AnswerBroken(Exception):
    """A passed-through answer that cannot be finished (its endpoint broke it off, or the drain ended) once its
    status and part of its body went out: the application returns without the body's end, and the ASGI server then
    closes the client's connection, which is how HTTP says an answer is not whole. Ending it (the last chunk of a
    chunked body) would hand the client the part as a complete answer; the format of a passed-through body, unlike
    a stream's, has no error event to say so in."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        """What the request is counted as (`leadtime_router_requests_total`)."""


def _framing_length(status: int, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """An endpoint's Content-Length, to pass on with its body when that is how the body is framed (one decimal
    value, no Transfer-Encoding): a client reading a body cut short then knows it for one by its length too. Else
    nothing, and the body goes on chunked.

    >>> _framing_length(200, [(b"Content-Length", b"15")])
    [(b'content-length', b'15')]
    >>> _framing_length(200, [(b"content-length", b"15"), (b"transfer-encoding", b"chunked")])
    []
    """
    lengths = [v.strip() for k, v in headers if k.lower() == b"content-length"]
    if len(lengths) != 1 or not lengths[0].isdigit() or any(k.lower() == b"transfer-encoding" for k, _ in headers):
        return []
    if status < 200 or status in (204, 304):
        return []
    return [(b"content-length", lengths[0])]


def stream_error(status: int, message: str) -> bytes:
    """An error event in OpenAI's shape and `[DONE]`: the end of a stream that could not be finished."""
    return b"data: " + orjson.dumps(openai_error(status, message)) + b"\n\ndata: [DONE]\n\n"


class Gateway:
    """An ASGI application that routes OpenAI-style requests with a `RoutingPolicy`.

    Parameters
    ----------
    discovery
        Where the endpoint list comes from (a file re-read on change, or a static list).
    policy
        Any routing policy; `LeadtimePolicy` gets the time-slice source and is told of abandoned requests.
    settings
        Intervals, timeouts, default SLOs and model.
    predictor
        The policy's predictor wrapper, when it has one (started and stopped with the gateway).
    timeslice
        Group states, from a file or an orchestrator's endpoint (`timeslice_sources`).
    decide_in_thread
        Decide on a thread of its own (one decision at a time), so that waiting for a remote predictor does not
        hold up the streams in flight; otherwise (the default without a predictor) decide in the event loop,
        which costs no thread hand-over.
    """

    def __init__(
        self,
        discovery: FileDiscovery | StaticDiscovery,
        policy: RoutingPolicy,
        settings: GatewaySettings = GatewaySettings(),
        predictor: GatewayPredictor | None = None,
        timeslice: Any = None,
        metrics: GatewayMetrics | None = None,
        decide_in_thread: bool | None = None,
    ) -> None:
        self.discovery = discovery
        self.policy = policy
        self.settings = settings
        self.predictor = predictor
        self.metrics = metrics or (predictor.metrics if predictor is not None else GatewayMetrics())
        for path in COUNTED_PATHS:
            self.metrics.requests.labels(path, "200")
        self.clock = monotonic_ms
        tls = tls_client_context(settings.upstream_ca_file) if settings.upstream_ca_file else None
        self.upstreams = Upstreams(settings.connect_timeout_s, tls)
        self.scraper = Scraper(
            self.upstreams,
            settings.scrape_interval_s,
            settings.scrape_timeout_s,
            settings.unroutable_after_s,
            settings.default_accelerator,
            settings.default_model,
            self.clock,
            on_scrape=self._on_scrape,
        )
        self.affinity = PrefixAffinity(settings.chunk_bytes)
        self.outliers = Outliers(lambda: self.clock(), on_ejection=lambda eid: self.metrics.ejections.labels(eid).inc())
        self.work = InflightWork()
        self.last_resort = LlmdHeuristicPolicy()
        self._decider = ThreadPoolExecutor(1, thread_name_prefix="leadtime-router-decide")
        self.decide_in_thread = predictor is not None if decide_in_thread is None else decide_in_thread
        self._ids = itertools.count(1)
        self._group_view: dict[str, str] = {}
        self._passed = PassedThroughLoad()
        self._scrape_errors_seen: dict[str, tuple[EndpointScrape, int]] = {}
        """Per endpoint, the scrape whose errors scrape_errors has counted, and how many: a name discovery lists
        again (or at a new address) gets a new scrape counting from 0, whose errors are all new."""
        self._timeslice_errors_seen = 0
        self._gauged: set[str] = set()  # endpoints the per-endpoint gauges were last rendered for
        self.in_flight = 0
        """Requests being proxied or passed through now."""
        self._watches: set[ClientWatch] = set()  # of the requests in flight whose body is read: what `cut` reaches
        self._unnamed_groups: set[str] = set()
        self._unused_groups: set[str] = set()  # named by the states, by no endpoint: warned of once
        self._jobs_seen: dict[str, set[str]] = {}  # per group, the jobs its states have named
        self._serving_job_unseen: set[str] = set()  # groups warned of as never naming the serving job
        self._loaded_job_unsaid: set[str] = set()  # groups warned of as held by it with no loaded job named
        self._unknown_overflow: set[str] = set()
        self._unread_groups_said = False
        self._panic = False
        self._answered_by: set[str] = set()  # endpoints labelled in upstream_errors or _responses by a request
        self._not_http: set[str] = set()  # endpoints warned of for answering other than in HTTP/1.1, until they serve
        self._pick_series: set[tuple[str, str, str]] = set()  # (endpoint, accelerator, role) series of picks, ditto
        self._unservable_message = "no endpoint can serve this request now"
        self._warm_up: Future[bool] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.timeslice: Any = None
        if timeslice is not None:
            self.attach_timeslice(timeslice)
        self._prefilled = getattr(policy, "prefilled", None)
        self._abandon = getattr(policy, "abandon", None)
        self._forget_endpoint = getattr(policy, "forget_endpoint", None)
        self.replicas: ReplicaSync | None = None

    def attach_replicas(self, sync: ReplicaSync) -> None:
        """Share what this gateway sends with the other replicas of its group (`replicas.ReplicaSync`): its policy's
        ledgers and its tokens-in-flight tracker, both ways."""
        self.replicas = sync
        ledgers = getattr(self.policy, "ledgers", None)
        if isinstance(ledgers, RouterLedgers):
            ledgers.outbox = sync.publish

    def apply_replica_event(self, event: LedgerEvent | WorkEvent) -> None:
        """On the event loop: another replica's change, applied where this gateway's own would be."""
        if isinstance(event, WorkEvent):
            self._apply_work(event)
            return
        ledgers = getattr(self.policy, "ledgers", None)
        if isinstance(ledgers, RouterLedgers):
            self._policy_call(ledgers.apply, event)

    def _apply_work(self, event: WorkEvent) -> None:
        if event.kind == "work_start" and event.active is not None:
            self.work.start(event.request_id, event.active)
        elif event.kind == "work_first":
            self.work.first_token(event.request_id, event.generated)
        elif event.kind == "work_progress":
            self.work.progress(event.request_id, event.generated)
        elif event.kind == "work_finish":
            self.work.finish(event.request_id)

    def _work(self, event: WorkEvent) -> None:
        """A change of this gateway's own tokens-in-flight tracker, shared with the other replicas."""
        self._apply_work(event)
        if self.replicas is not None:
            self.replicas.publish(event)

    def attach_timeslice(self, source: Any) -> None:
        """Read time-slice group states from `source` (its `poll` is called on an interval); a policy that
        reads group states itself (`LeadtimePolicy.timeslice_source`) gets it too."""
        self.timeslice = source
        if hasattr(self.policy, "timeslice_source") and self.policy.timeslice_source is None:
            ts: TimesliceSource = source
            self.policy.timeslice_source = ts

    # ----- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.scraper.sync(self.discovery.endpoints)
        self._warn_unknown_overflow()
        self._warn_unread_groups()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._watch_discovery()))
        if self.timeslice is not None:
            self._tasks.append(loop.create_task(self._watch_timeslice()))
        if self.replicas is not None:
            await self.replicas.start()
        if self.predictor is not None:
            self.predictor.start()
            row = FeatureRow(
                RequestFeatures(input_tokens=16),
                EndpointState(accelerator=self.settings.default_accelerator, model=self.settings.default_model),
            )
            if self.decide_in_thread:  # on the decision thread, which owns the client; /readyz waits for it
                self._warm_up = self._decider.submit(self.predictor.warm_up, row)
            else:
                await asyncio.get_running_loop().run_in_executor(None, self.predictor.warm_up, row)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.scraper.stop()
        self.upstreams.close()
        if self.replicas is not None:
            await self.replicas.stop()
        if self.predictor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.predictor.stop)
        self._decider.shutdown(wait=False)

    async def _watch_discovery(self) -> None:
        while True:
            await asyncio.sleep(self.settings.discovery_poll_s)
            before = (self.discovery.reloads, self.discovery.failed_reloads)
            try:
                changed = await asyncio.get_running_loop().run_in_executor(None, self.discovery.poll)
            except Exception:  # noqa: BLE001 - a watcher must keep watching
                log.exception("discovery poll failed")
                continue
            if self.discovery.reloads > before[0]:
                self.metrics.discovery_reloads.labels("ok").inc()
            if self.discovery.failed_reloads > before[1]:
                self.metrics.discovery_reloads.labels("error").inc()
            if changed:
                known = [s.endpoint for s in self.scraper.scrapes.values()]  # as discovery listed them until now
                listed = {e.endpoint_id: e for e in self.discovery.endpoints}
                # gone, or back under the name at another server (a pod recreated under its StatefulSet name, at a
                # new IP): what was learned of the old server (its prefix cache, its failures) is not the new one's
                fresh = {
                    e.endpoint_id for e in known if e.endpoint_id not in listed or _moved(e, listed[e.endpoint_id])
                }
                for endpoint_id in fresh:
                    self.affinity.forget(endpoint_id)
                    if self._forget_endpoint is not None:
                        self._policy_call(self._forget_endpoint, endpoint_id)
                self.outliers.keep_only(set(listed) - fresh)
                self.scraper.sync(self.discovery.endpoints)
                # an address no endpoint has any more: its pool retired (one that another name took is still used)
                left = {(e.address, e.port) for e in known} - {(e.address, e.port) for e in self.discovery.endpoints}
                for address, port in left:
                    self.upstreams.retire(address, port)
                self._warn_unknown_overflow()
                self._warn_unread_groups()

    def _warn_unknown_overflow(self) -> None:
        """Once per name: an `overflowEndpoints` entry that no discovered endpoint has (a misspelling would leave
        the overflow to the candidates' order, silently)."""
        named = getattr(getattr(self.policy, "config", None), "overflow_endpoints", ())
        known = {e.endpoint_id for e in self.discovery.endpoints}
        for name in named:
            if name not in known and name not in self._unknown_overflow:
                self._unknown_overflow.add(name)
                log.warning("overflowEndpoints names %r, which no discovered endpoint is (not yet, at least)", name)

    def _warn_unread_groups(self) -> None:
        """Once: endpoints name time-slice groups, and no source of group states was given (`--timeslice-url` or
        `--timeslice-file`): they are routed as always resident, swapped out or not (the easiest mistake there)."""
        if self.timeslice is not None or self._unread_groups_said:
            return
        groups = sorted({e.timeslice_group for e in self.discovery.endpoints if e.timeslice_group})
        if groups:
            self._unread_groups_said = True
            log.warning(
                "endpoints name time-slice group(s) %s, but no --timeslice-url or --timeslice-file gives their "
                "states: they are routed as always resident",
                ", ".join(groups),
            )

    async def _watch_timeslice(self) -> None:
        source: Any = self.timeslice
        watching_since_ms = self.clock()  # states never read are as old as the watch: the stale-states alert fires
        while True:
            try:
                result = source.poll()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # noqa: BLE001 - a watcher must keep watching; the source keeps its last states
                log.exception("time-slice poll failed")
            self._warn_unnamed_groups(source)
            self._warn_unused_groups(source)
            self._warn_serving_job_unnamed(source)
            self._warn_loaded_job_unsaid(source)
            if source.errors > self._timeslice_errors_seen:
                self.metrics.timeslice_source_errors.inc(source.errors - self._timeslice_errors_seen)
                self._timeslice_errors_seen = source.errors
            self._refresh_group_views()
            confirmed_ms = getattr(source, "confirmed_ms", None)
            read_ms = watching_since_ms if confirmed_ms is None else confirmed_ms
            self.metrics.timeslice_states_age.set(max(0.0, self.clock() - read_ms) / 1e3)
            await asyncio.sleep(self.settings.timeslice_poll_s)

    def _warn_unnamed_groups(self, source: Any) -> None:
        """Once per group: an endpoint's time-slice group that the states read do not name is taken as serving
        (a name spelled otherwise on either side would leave its endpoints routed while they train)."""
        if getattr(source, "updated_ms", None) is None:
            return  # nothing read yet
        for scrape in self.scraper.scrapes.values():
            group = scrape.endpoint.timeslice_group
            if group and group not in self._unnamed_groups and source.status(group) is None:
                self._unnamed_groups.add(group)
                named = ", ".join(sorted(getattr(source, "groups", {}))) or "none"
                log.warning(
                    "time-slice group %r of endpoint %s is not in the group states (they name: %s); its endpoints "
                    "are taken as serving",
                    group,
                    scrape.endpoint.endpoint_id,
                    named,
                )

    def _warn_unused_groups(self, source: Any) -> None:
        """Once per group: the states name a group no discovered endpoint belongs to (a label spelled otherwise, or
        a group whose endpoints are gone): its state changes nothing here."""
        labelled = {e.timeslice_group for e in self.discovery.endpoints if e.timeslice_group}
        for group in getattr(source, "groups", {}):
            if group not in labelled and group not in self._unused_groups:
                self._unused_groups.add(group)
                log.warning(
                    "time-slice group %r is in the group states but no endpoint belongs to it (endpoints name: %s)",
                    group,
                    ", ".join(sorted(labelled)) or "none",
                )

    def _warn_serving_job_unnamed(self, source: Any) -> None:
        """Once per group: its states have named two jobs or more and never the serving job (`servingJob`): an
        orchestrator calling it otherwise (`vllm-inference`) keeps the group's endpoints out of routing for good."""
        job = self.settings.serving_job
        for group, status in getattr(source, "groups", {}).items():
            seen = self._jobs_seen.setdefault(group, set())
            seen.update(j for j in (status.active_job, status.loaded_job) if j)
            if len(seen) >= 2 and job not in seen and group not in self._serving_job_unseen:
                self._serving_job_unseen.add(group)
                log.warning(
                    "time-slice group %r has named the jobs %s but never the serving job %r: its endpoints are "
                    "taken as swapped out for good (is the inference job called otherwise? set servingJob)",
                    group,
                    ", ".join(sorted(seen)),
                    job,
                )

    def _warn_loaded_job_unsaid(self, source: Any) -> None:
        """Once per group: LOCKED by the serving job with no `loaded_job` in its states. A group serves only while
        its job's weights are said to be resident, so states that leave the field out keep its endpoints out of
        routing during the inference job's own turn."""
        job = self.settings.serving_job
        for group, status in getattr(source, "groups", {}).items():
            unsaid = status.state == "LOCKED" and status.active_job == job and not status.loaded_job
            if unsaid and group not in self._loaded_job_unsaid:
                self._loaded_job_unsaid.add(group)
                log.warning(
                    "time-slice group %r is LOCKED by the serving job %r but its states name no loaded_job: its "
                    "endpoints are taken as away until the states say %r is loaded (loaded_job)",
                    group,
                    job,
                    job,
                )

    def _group_state(self, group: str) -> str:
        """How routing takes `group`: "resident" (serving the inference job), "switching" or "parked". Until the
        states are first read, away: a source not readable yet must not send traffic into a training job's turn."""
        if self.timeslice is not None and getattr(self.timeslice, "updated_ms", 0.0) is None:
            return "parked"
        status = self.timeslice.status(group) if self.timeslice is not None else None
        if status is None or status.serves(self.settings.serving_job):
            return "resident"
        return "switching" if status.state == "SWITCHING" else "parked"

    def _refresh_group_views(self) -> None:
        groups = {s.endpoint.timeslice_group for s in self.scraper.scrapes.values() if s.endpoint.timeslice_group}
        for gone in set(self._group_view) - groups:  # no endpoint of it any more: neither its view nor its series
            del self._group_view[gone]
            with contextlib.suppress(KeyError):
                self.metrics.timeslice_group_serving.remove(gone)
        for scrape in self.scraper.scrapes.values():
            group = scrape.endpoint.timeslice_group
            if not group:
                continue
            view = self._group_state(group)
            old = self._group_view.get(group)
            if old is not None and old != "resident" and view == "resident":
                for other in self.scraper.scrapes.values():  # back from a swap: its prefix cache is gone
                    if other.endpoint.timeslice_group == group:
                        self.affinity.forget(other.endpoint.endpoint_id)
            self._group_view[group] = view
            self.metrics.timeslice_group_serving.labels(group).set(1.0 if view == "resident" else 0.0)
            if scrape.state is not None and scrape.state.timeslice_state != view:
                scrape.state = dataclasses.replace(scrape.state, timeslice_state=view)

    def _on_scrape(self, scrape: EndpointScrape) -> None:
        self.outliers.scraped(scrape.endpoint.endpoint_id, scrape.scraped_ms)
        group = scrape.endpoint.timeslice_group
        if group and scrape.state is not None:
            # a group the watcher has not looked at yet (its first poll still waiting for an answer, an endpoint
            # just discovered in a new group) is taken as its states say, away when none were read
            view = self._group_view.get(group) or self._group_state(group)
            if scrape.state.timeslice_state != view:
                scrape.state = dataclasses.replace(scrape.state, timeslice_state=view)
        cache_tokens = scrape.metrics.kv_cache_tokens if scrape.metrics is not None else None
        if cache_tokens is not None:
            self.affinity.set_cache_tokens(scrape.endpoint.endpoint_id, cache_tokens)
        self.metrics.scrape_seconds.observe(scrape.duration_s)

    def routable(self, now_ms: float | None = None) -> list[EndpointScrape]:
        """The endpoints requests may go to: those whose scrapes succeed, less those out for failing their requests
        (`outliers`), unless that leaves fewer than `PANIC_SHARE` of them: then all of them (said once)."""
        now = self.clock() if now_ms is None else now_ms
        scraped = [s for s in self.scraper.scrapes.values() if self.scraper.routable(s, now)]
        kept = [s for s in scraped if not self.outliers.out(s.endpoint.endpoint_id)]
        panic = len(kept) < PANIC_SHARE * len(scraped)
        if panic != self._panic:
            self._panic = panic
            if panic:
                log.warning(
                    "%d of %d endpoints are out of routing for failing their requests: routing to all of them "
                    "(a failure most endpoints share is not one endpoint's)",
                    len(scraped) - len(kept),
                    len(scraped),
                )
            else:
                log.info("most endpoints serve again: those failing their requests are left out again")
        return scraped if panic else kept

    def _answered(self, endpoint_id: str, status: int, sent_ms: float, why: str = "") -> None:
        """An endpoint answered a request sent on with `status`: counted, and a 5xx is a failure (`outliers`), for
        `why` when said. A success is counted when the answer has been read to its end (`_served`): a stream may
        still break, or carry an error event (`_counted_once_read`)."""
        self.metrics.upstream_responses.labels(endpoint_id, STATUS_CLASSES[min(max(status // 100, 1), 5) - 1]).inc()
        self._answered_by.add(endpoint_id)
        if status >= 500:
            self.outliers.failed(endpoint_id, why or f"answered {status}", sent_ms=sent_ms)

    def _served(self, endpoint_id: str, status: int) -> None:
        """An answer read to its end: below 500, a success (`outliers`)."""
        if status < 500:
            self.outliers.answered(endpoint_id)
        self._not_http.discard(endpoint_id)

    def _failed(self, endpoint_id: str, err: UpstreamError, sent_ms: float) -> None:
        """An endpoint could not be reached, or broke its answer: counted, and a failure (`outliers`). One that
        answers other than in HTTP/1.1 (a port serving something else, or another protocol) is said in the log once,
        until it serves a request: retried elsewhere, its failures were said nowhere but in a counter, and with no
        other endpoint to retry on its clients got a 503 with no reason."""
        self.metrics.upstream_errors.labels(endpoint_id, err.kind).inc()
        self._answered_by.add(endpoint_id)
        if err.kind in NOT_HTTP_KINDS and endpoint_id not in self._not_http:
            self._not_http.add(endpoint_id)
            log.warning(
                "endpoint %s sent %s (%s): is an HTTP/1.1 server at its address? (said again once it serves a request)",
                endpoint_id,
                "a malformed response" if err.kind == "malformed" else "an unexpected upgrade",
                err,
            )
        self.outliers.failed(endpoint_id, str(err), refused=err.refused, sent_ms=sent_ms)

    # ----- ASGI --------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "HEAD" and path in PROBED_PATHS:
            send, method = _without_body(send), "GET"
        if self.settings.allowed_hosts and path not in UNCHECKED_PATHS:  # before the key: a rebound page learns nothing
            host = host_header(scope["headers"])
            if not host_allowed(host, self.settings.allowed_hosts):
                await self._refuse(send, 400, host_refusal(host), "host")
                if path in PROXIED_PATHS or path in PASSED_THROUGH:
                    self.metrics.requests.labels(path, "400").inc()
                return
        guarded = path.startswith("/v1/") or path in PASSED_THROUGH
        if self.settings.api_keys and guarded and not bearer_ok(scope["headers"], self.settings.api_keys):
            await self._refuse(
                send,
                401,
                "authorization: a valid bearer token is required",
                "authorization",
                [(b"www-authenticate", b"Bearer")],
            )
            if path in PROXIED_PATHS or path in PASSED_THROUGH:
                self.metrics.requests.labels(path, "401").inc()
            return
        if path in PROXIED_PATHS and method == "POST":
            await self._proxy(scope, receive, send)
        elif path == "/metrics" and method == "GET":
            await self._plain(send, 200, self._render_metrics(), b"text/plain; version=0.0.4; charset=utf-8")
        elif path == "/healthz":
            await self._reply(send, 200, {"status": "ok"})
        elif path == "/readyz":
            await self._readyz(send)
        elif path == "/v1/models" and method == "GET":
            await self._models(scope, send)
        elif path in PASSED_THROUGH:
            await self._pass_through(scope, receive, send)
        else:
            await self._refuse(send, 404, f"no route for {method} {path}")
            self.metrics.requests.labels(UNMATCHED_PATH, "404").inc()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _discovery_failing(self) -> dict[str, str]:
        """A file discovery whose last re-read was refused, for /readyz (the endpoints read before are kept)."""
        reload_failed = getattr(self.discovery, "last_error", None)
        return {} if reload_failed is None else {"discovery": f"{reload_failed} (routing on the endpoints read before)"}

    def _scrapes_failing(self) -> dict[str, str]:
        """The endpoints whose scrapes fail now, for /readyz: routed to on their last state until
        `unroutable_after_s`, left out after it. Only the first failure was said, in the log."""
        now, after = self.clock(), self.settings.unroutable_after_s
        out = {}
        for eid, scrape in self.scraper.scrapes.items():
            if scrape.failing_since_ms is not None:
                seconds = (now - scrape.failing_since_ms) / 1e3
                routed = "out of routing" if seconds > after else f"out of routing after {after:g} s"
                out[f"endpoint {eid}"] = f"its scrapes fail ({scrape.last_error}) for {seconds:.0f} s: {routed}"
        return out

    async def _reply(
        self, send: Send, status: int, body: object, extra: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        await self._plain(send, status, _json(body), b"application/json", extra)

    async def _refuse(
        self,
        send: Send,
        status: int,
        message: str,
        param: str | None = None,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """An error of the gateway's own, in OpenAI's shape (`openai_error`); a 503 says when to try again."""
        if status == 503:
            extra = [*(extra or []), (b"retry-after", b"1")]
        await self._reply(send, status, openai_error(status, message, param), extra)

    def cut(self) -> int:
        """The drain is over (`serve._Draining`): the requests still in flight are let go, as when their clients
        leave (the endpoint's connection closed, the policy told they were abandoned), but their clients are told
        (`_cut_message`); how many. Done before uvicorn's own deadline, which cancels what is left with a traceback
        each, and ends a stream without the error event that tells its client the answer is not whole."""
        watches = list(self._watches)
        for watch in watches:
            watch.cut()
        return len(watches)

    def _cut_message(self) -> str:
        return f"the gateway is stopping: its drain ({self.settings.drain_s} s) ended before this answer was complete"

    async def _was_cut(self, send: Send) -> int:
        """A request `cut` before its answer started: a 503, which says to try again (elsewhere)."""
        await self._refuse(send, 503, self._cut_message())
        return 503

    async def _none_left(self, send: Send, endpoint_id: str, err: UpstreamError) -> int:
        """The only endpoint a request could go to failed before answering: a 503 (nothing was generated, and an
        endpoint may be back for the next try) that names the endpoint and how it failed, which tell a reset from a
        timeout or a refused connection."""
        message = f"endpoint {endpoint_id} failed before answering ({err}), and no other endpoint is left to retry on"
        extra = [(b"x-leadtime-endpoint", endpoint_id.encode())]
        await self._refuse(send, 503, f"no endpoint can serve this request now: {message}", "endpoints", extra)
        return 503

    async def _endpoint_failed(self, send: Send, endpoint_id: str, err: UpstreamError | str) -> int:
        extra = [(b"x-leadtime-endpoint", endpoint_id.encode())]
        await self._refuse(send, 502, f"endpoint {endpoint_id} failed: {err}", "endpoint", extra)
        return 502

    async def _plain(
        self, send: Send, status: int, body: bytes, content_type: bytes, extra: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _readyz(self, send: Send) -> None:
        scrapes = self.routable()
        routable = len(scrapes)
        known = len(self.scraper.scrapes)
        if self._warm_up is not None and not self._warm_up.done():
            reason = "connecting to the predictor (at most 2 s)"
            await self._reply(send, 503, {"status": "not ready", "reason": reason, "endpoints": known})
        elif routable and all(s.endpoint.role == "prefill" for s in scrapes):
            reason = "only prefill endpoints can be routed to, and they serve no client alone (no decode endpoint)"
            await self._reply(send, 503, {"status": "not ready", "reason": reason, "endpoints": known})
        elif routable:
            degraded = self.predictor.health() if self.predictor is not None else {}
            degraded.update({f"endpoint {eid}": why for eid, why in self.outliers.health().items()})
            if self.replicas is not None:
                degraded.update(self.replicas.health())
            if self._panic:
                degraded["endpoints"] = (
                    "most endpoints are out of routing for failing their requests: routing to all of them"
                )
            for where, why in self._scrapes_failing().items():
                degraded.setdefault(where, why)  # an endpoint taken out for failing requests says that first
            degraded.update(self._discovery_failing())
            failing = getattr(self.timeslice, "last_error", None)
            if failing is not None:  # routing goes on with the last states read, which age meanwhile, or none
                degraded = {**degraded, "timeslice": f"{failing} ({self.timeslice.routing_on()})"}
            answer = {"status": "ready", "routable_endpoints": routable, "endpoints": known, "degraded": degraded}
            await self._reply(send, 200, answer)
        else:
            after = self.settings.unroutable_after_s
            out = self.outliers.health()
            reason = (  # endpoints out for failing are routed to when most are (`routable`): never the reason here
                f"no endpoint can be routed to (none answered a scrape within the last {after:g} s)"
                if known
                else "discovery lists no endpoint"
            )
            refusal: dict[str, Any] = {"status": "not ready", "reason": reason, "endpoints": known}
            named = {f"endpoint {eid}": why for eid, why in out.items()} | self._discovery_failing()
            if named:
                refusal["degraded"] = named
            await self._reply(send, 503, refusal)

    async def _models(self, scope: Scope, send: Send) -> None:
        """Every endpoint serves the same models (as in an llm-d pool): the first that answers says which, asked
        with the client's headers as every path sent on is (an endpoint checking the client's key guards this one
        too). An endpoint answering a 5xx (its engine failed) leaves the question to the next; a 4xx is the
        client's own (a key refused) and comes back as it is."""
        status = await self._first_models(scope, send)
        self.metrics.requests.labels("/v1/models", str(status)).inc()

    async def _first_models(self, scope: Scope, send: Send) -> int:
        forward = end_to_end(scope["headers"])
        failed: tuple[int, bytes, bytes, list[tuple[bytes, bytes]]] | None = None
        for scrape in self.routable():
            e = scrape.endpoint
            try:
                pool = self.upstreams.pool(e.address, e.port, e.tls)
                response = await pool.request("GET", "/v1/models", forward, timeout_s=5.0)
                body = await response.read(5.0)
            except UpstreamError:
                continue
            # its headers too: asked with the client's (an Accept-Encoding among them), the body may be encoded
            kept = [(k, v) for k, v in end_to_end(response.headers) if k.lower() != b"content-type"]
            content_type = response.header(b"content-type") or b"application/json"
            if response.status >= 500:
                failed = (response.status, body, content_type, kept)
                continue
            await self._plain(send, response.status, body, content_type, kept)
            return response.status
        if failed is not None:  # every endpoint that answered failed: the last failure, as it was
            await self._plain(send, *failed)
            return failed[0]
        await self._refuse(send, 503, "no endpoint can be routed to", "endpoints")
        return 503

    def _render_metrics(self) -> bytes:
        m = self.metrics
        now = self.clock()
        routable = 0
        up_now = {s.endpoint.endpoint_id for s in self.routable(now)}
        for scrape in self.scraper.scrapes.values():
            eid = scrape.endpoint.endpoint_id
            up = eid in up_now
            routable += up
            # At 0 from the start: rate() and increase() count steps, so a series born at 1 never shows its first
            # failure, the one an alert on the endpoint's errors or ejections exists for.
            m.ejections.labels(eid)
            for kind in REQUEST_FAILURE_KINDS:
                m.upstream_errors.labels(eid, kind)
            for status in STATUS_CLASSES:
                m.upstream_responses.labels(eid, status)
            m.endpoint_up.labels(eid).set(1 if up else 0)
            if scrape.state is not None:
                m.scrape_age.labels(eid).set((now - scrape.scraped_ms) / 1e3)
            if scrape.metrics is not None and scrape.metrics.prefix_cache_hits is not None:
                m.prefix_reported.labels(eid).set(scrape.metrics.prefix_cache_hits)
            counted, seen = self._scrape_errors_seen.get(eid, (scrape, 0))
            if counted is not scrape:
                seen = 0
            if scrape.errors > seen:
                m.scrape_errors.labels(eid).inc(scrape.errors - seen)
                self._scrape_errors_seen[eid] = (scrape, scrape.errors)
        current = set(self.scraper.scrapes)
        # an endpoint discovery dropped is not shown as still there, nor are its counters kept: in Kubernetes its
        # name is its pod's, and every rollout would add series for ever. A request decided or answered after the
        # endpoint left labels it again: its series are in _pick_series or _answered_by, removed at the next render.
        series_of = {s[0] for s in self._pick_series} | self._answered_by
        for gone in (self._gauged | series_of) - current:
            self._scrape_errors_seen.pop(gone, None)
            self._not_http.discard(gone)
            by_endpoint = (m.endpoint_up, m.scrape_age, m.prefix_reported, m.ejections, m.scrape_errors)
            for family in (*by_endpoint, m.prefix_estimated):
                with contextlib.suppress(KeyError):
                    family.remove(gone)
            for picked in [s for s in self._pick_series if s[0] == gone]:
                m.picks.remove(*picked)
                self._pick_series.discard(picked)
            for status in STATUS_CLASSES:
                with contextlib.suppress(KeyError):
                    m.upstream_responses.remove(gone, status)
            for kind in REQUEST_FAILURE_KINDS:
                with contextlib.suppress(KeyError):
                    m.upstream_errors.remove(gone, kind)
            self._answered_by.discard(gone)
        self._gauged = current
        m.endpoints.labels("true").set(routable)
        m.endpoints.labels("false").set(len(self.scraper.scrapes) - routable)
        m.bytes_per_token.set(self.affinity.bytes_per_token)
        client = self.predictor.predict_client if self.predictor is not None else None
        if isinstance(client, BackgroundModel):
            seconds = client.age_s()
            m.pulled_model_age.set(-1.0 if seconds is None else seconds)
        return m.render()

    # ----- the hot path ------------------------------------------------------------------------------------

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > self.settings.max_body_bytes:
                raise BadRequest(413, "body", f"larger than {self.settings.max_body_bytes} bytes")
            chunks.append(body)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        self.metrics.inflight.inc()
        self.in_flight += 1
        code = 500
        try:
            code = await self._route(scope, receive, send)
        finally:
            self.metrics.inflight.dec()
            self.in_flight -= 1
            self.metrics.requests.labels(path, str(code)).inc()

    async def _pass_through(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.metrics.inflight.inc()
        self.in_flight += 1
        code = 500
        try:
            code = await self._pass(scope, receive, send)
        except AnswerBroken as err:
            # Returned from without the body's end: the server closes the connection, which tells the client the
            # answer is not whole (one line of its own, not the traceback an exception raised out of the app logs).
            code = err.status
            log.warning("%s: the client's connection is closed before the answer's end", err)
        finally:
            self.metrics.inflight.dec()
            self.in_flight -= 1
            self.metrics.requests.labels(scope["path"], str(code)).inc()

    async def _pass(self, scope: Scope, receive: Receive, send: Send) -> int:
        """A request of `PASSED_THROUGH`: to the least-loaded endpoint (`PassedThroughLoad`), its answer relayed as
        it comes; an endpoint that fails before answering is left out and another tried, once."""
        try:
            body = await self._read_body(receive)
        except BadRequest as err:
            await self._refuse(send, err.status, str(err), err.field)
            return err.status
        if body is None:
            return 499
        watch = ClientWatch(receive)
        self._watches.add(watch)
        try:
            return await self._pass_on(scope, send, watch, body)
        except ClientLeft:
            return await self._was_cut(send) if watch.was_cut else 499
        finally:
            self._watches.discard(watch)
            watch.close()

    async def _pass_on(self, scope: Scope, send: Send, watch: ClientWatch, body: bytes) -> int:
        forward = end_to_end(scope["headers"])
        target_path = scope["path"] + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else "")
        excluded: set[str] = set()
        failed: tuple[str, UpstreamError] | None = None  # the first endpoint's failure
        for attempt in (0, 1):
            target = self._passed.choose(self.routable(), excluded)
            if target is None and failed is not None:
                return await self._none_left(send, *failed)
            if target is None:
                await self._refuse(send, 503, "no endpoint can serve this request now", "endpoints")
                return 503
            if attempt:  # counted once another endpoint takes it: a retry is one sent
                self.metrics.retries.inc()
            eid = target.endpoint_id
            self._passed.opened(eid)
            sent_ms = self.clock()
            try:
                pool = self.upstreams.pool(target.address, target.port, target.tls)
                try:
                    response = await watch.race(
                        pool.request(scope["method"], target_path, forward, body, self.settings.upstream_timeout_s)
                    )
                except UpstreamError as err:
                    self._failed(eid, err, sent_ms)
                    excluded.add(eid)
                    if attempt == 0:
                        failed = (eid, err)
                        continue
                    return await self._endpoint_failed(send, eid, err)
                self._answered(eid, response.status, sent_ms)
                return await self._relay_as_is(target, response, send, watch, sent_ms)
            finally:
                self._passed.closed(eid)
        raise AssertionError("unreachable")

    async def _relay_as_is(
        self, target: DiscoveredEndpoint, response: Response, send: Send, watch: ClientWatch, sent_ms: float
    ) -> int:
        headers = end_to_end(response.headers) + _framing_length(response.status, response.headers)
        headers.append((b"x-leadtime-endpoint", target.endpoint_id.encode()))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        response.stop_when(watch.gone)
        while True:
            try:
                chunk = await response.next_chunk(self.settings.upstream_timeout_s)
            except UpstreamError as err:
                self._failed(target.endpoint_id, err, sent_ms)
                raise AnswerBroken(502, f"endpoint {target.endpoint_id} broke off its answer: {err}") from None
            if chunk is None and not response.stopped:
                break
            if response.stopped:
                response.close()
                if watch.was_cut:  # ended as a broken answer is (above)
                    raise AnswerBroken(503, self._cut_message())
                return 499
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        self._served(target.endpoint_id, response.status)
        return response.status

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> int:
        headers: dict[bytes, bytes] = dict(scope["headers"])
        if len(headers) < len(scope["headers"]):  # a header given twice reads as its values joined, as in HTTP
            headers = {}
            for name, value in scope["headers"]:
                headers[name] = headers[name] + b", " + value if name in headers else value
        try:
            body = await self._read_body(receive)
            if body is None:
                return 499
            # The request is here once its body is: the client's upload is neither the gateway's time nor the
            # endpoint's (`x-leadtime-route-ms`, the TTFT learned).
            arrival_ms, started = self.clock(), time.perf_counter()
            parsed = parse_request(
                scope["path"],
                body,
                headers,
                self.settings.ttft_slo_ms,
                self.settings.tpot_slo_ms,
                self.settings.measure_non_streaming,
                self.settings.ask_usage,
            )
        except BadRequest as err:
            await self._refuse(send, err.status, str(err), err.field)
            return err.status
        if parsed.token_ids is not None:
            key = self.affinity.key_for_ids(parsed.token_ids, parsed.model)
        else:
            key = self.affinity.key(parsed.text, parsed.model)
        request_id = f"gw-{next(self._ids)}"
        route = RouteRequest(
            request_id, key.input_tokens, (), parsed.ttft_slo_ms, parsed.tpot_slo_ms, arrival_ms=arrival_ms
        )
        routes: list[_Routed] = []
        watch = ClientWatch(receive)
        self._watches.add(watch)
        try:
            return await self._attempts(scope, send, watch, started, request_id, route, parsed, key, body, routes)
        except ClientLeft:  # raised before the answer started
            return await self._was_cut(send) if watch.was_cut else 499
        finally:
            self._watches.discard(watch)
            watch.close()
            for routed in routes:  # a request cut short (the client left, the task was cancelled)
                self._forget(routed)

    async def _attempts(
        self,
        scope: Scope,
        send: Send,
        watch: ClientWatch,
        started: float,
        request_id: str,
        route: RouteRequest,
        parsed: ParsedRequest,
        key: PromptKey,
        body: bytes,
        routes: list[_Routed],
    ) -> int:
        forward = end_to_end(scope["headers"])
        target_path = scope["path"] + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else "")
        excluded: set[str] = set()
        overhead_s = 0.0  # the gateway's own time before each attempt was sent: not its hold, nor a failed endpoint's
        received_ms = route.arrival_ms  # before a retry's decision moves it
        for attempt in (0, 1):
            if attempt:  # a retry is decided now, on the states of now, as a request held is (`_decide`)
                route = dataclasses.replace(route, arrival_ms=self.clock())
                started = time.perf_counter()
            routed = await self._decide(
                request_id if not attempt else f"{request_id}-retry", route, parsed, key, excluded, watch
            )
            if routed is None:
                await self._refuse(send, 503, self._unservable_message, "endpoints")
                return 503
            routes.append(routed)
            if attempt:  # counted once it is decided: a retry is one sent
                self.metrics.retries.inc()
            target = self._target(routed)
            extra = list(forward)
            if routed.decision.pick.is_pair:
                prefill = self._endpoint(routed.decision.pick.endpoint_id)
                extra.append((PREFILLER_HEADER, prefill.host_port.encode()))
            pool = self.upstreams.pool(target.address, target.port, target.tls)
            overhead_s += time.perf_counter() - started - routed.held_s
            routed.sent_ms, routed.received_ms = self.clock(), received_ms
            try:
                response = await watch.race(
                    pool.request(
                        "POST", target_path, extra, parsed.upstream_body or body, self.settings.upstream_timeout_s
                    )
                )
            except UpstreamError as err:
                self._failed(target.endpoint_id, err, routed.sent_ms)
                self._forget(routed)
                excluded.add(target.endpoint_id)
                if attempt == 0 and self._candidates(key, excluded):  # `outliers` logs one that keeps failing, once
                    log.debug("%s failed before answering (%s); trying elsewhere", target.endpoint_id, err)
                    continue
                if attempt == 0:
                    return await self._none_left(send, target.endpoint_id, err)
                return await self._endpoint_failed(send, target.endpoint_id, err)
            if not _counted_once_read(response):
                self._answered(target.endpoint_id, response.status, routed.sent_ms)
            elsewhere = attempt == 0 and response.status in RETRIED_STATUSES
            if elsewhere and self._candidates(key, excluded | {target.endpoint_id}):  # else its answer is the best
                response.close()
                self._forget(routed)
                excluded.add(target.endpoint_id)
                continue
            self.metrics.overhead_seconds.observe(overhead_s)
            return await self._relay(routed, target, response, send, watch, overhead_s)
        raise AssertionError("unreachable")

    def _endpoint(self, endpoint_id: str) -> DiscoveredEndpoint:
        return self.scraper.scrapes[endpoint_id].endpoint

    def _target(self, routed: _Routed) -> DiscoveredEndpoint:
        pick = routed.decision.pick
        return self._endpoint(pick.decode_endpoint_id or pick.endpoint_id)

    def _candidates(self, key: PromptKey, excluded: set[str]) -> list[Candidate]:
        out = []
        for scrape in self.routable():
            eid = scrape.endpoint.endpoint_id
            if eid in excluded or scrape.state is None:
                continue
            hits = self.affinity.hit_tokens(eid, key)
            state = with_tokens(scrape.state, *self.work.tokens(eid, scrape.scraped_ms))
            cache = scrape.metrics.kv_cache_tokens if scrape.metrics is not None else None
            out.append(Candidate(state, hits, scrape.scraped_ms, scrape.endpoint.timeslice_group, cache))
        # An endpoint whose KV cache cannot hold the prompt would refuse it: it is not offered. When none can, all
        # are: the prompt's length here is an estimate (bytes per token), so an endpoint, which counts its tokens,
        # judges, and refuses it in words of its own (a 4xx naming its limit) if it is too long indeed.
        try:
            return candidates_that_fit(RouteRequest("", key.input_tokens), out)
        except NoCandidateError:
            return out

    async def _decide(
        self,
        request_id: str,
        route: RouteRequest,
        parsed: ParsedRequest,
        key: PromptKey,
        excluded: set[str],
        watch: ClientWatch,
    ) -> _Routed | None:
        """Where the request goes; None when no endpoint can take it. While the policy holds it (`Pick.hold`),
        it is offered again a scrape interval later, on fresh states, until the policy places it, or the client
        leaves (`ClientLeft`: nothing is sent on for a client that is gone)."""
        if request_id != route.request_id:
            route = dataclasses.replace(route, request_id=request_id)
        first_ms, held_s = route.arrival_ms, 0.0
        while True:
            candidates = self._candidates(key, excluded)
            if not candidates:
                reason = (
                    "no other endpoint to retry on"
                    if excluded
                    else "no endpoint answered a scrape recently"
                    if self.scraper.scrapes
                    else "discovery lists no endpoint"
                )
                self._unservable(reason, warn=False)  # the scrapes' own warnings say why
                return None
            try:
                if self.decide_in_thread:  # stamped as it is queued: the predictor's deadline covers its wait
                    decision = await asyncio.get_running_loop().run_in_executor(
                        self._decider, self._pick, route, candidates, time.perf_counter()
                    )
                else:
                    decision = self._pick(route, candidates)
            except NoCandidateError as err:
                self._unservable(str(err))
                return None
            if not decision.pick.hold:
                if self._listed(decision.pick):
                    break
                # Discovery dropped an endpoint picked while the decision was made (on its thread): a pod gone gets
                # no new request. Decided again, now, on the endpoints left (no retry: nothing was sent), the policy
                # letting go of the first decision.
                log.debug("%s left discovery while %s was decided; deciding again", decision.pick, route.request_id)
                self.metrics.decision_seconds.observe(decision.seconds)
                if self._abandon is not None:
                    self._policy_call(self._abandon, route.request_id)
                route = dataclasses.replace(route, arrival_ms=self.clock())
                continue
            self.metrics.decision_seconds.observe(decision.seconds)
            started = time.perf_counter()
            left = await watch.wait(self.settings.scrape_interval_s)
            held_s += time.perf_counter() - started
            if left:
                self.metrics.held_seconds.observe(held_s)
                raise ClientLeft
            now = self.clock()
            route = dataclasses.replace(route, arrival_ms=now, held_ms=now - first_ms)
        if held_s:
            self.metrics.held_seconds.observe(held_s)
        routed = _Routed(request_id, route, parsed, key, decision, {c.endpoint_id: c for c in candidates}, held_s)
        self._record_decision(routed, candidates)
        return routed

    def _listed(self, pick: Pick) -> bool:
        """Whether discovery still lists the endpoints `pick` names."""
        return all(eid in self.scraper.scrapes for eid in (pick.endpoint_id, pick.decode_endpoint_id) if eid)

    def _unservable(self, reason: str, warn: bool = True) -> None:
        """Why no endpoint could take a request: in the 503's message, and logged when it changes."""
        message = f"no endpoint can serve this request now: {reason}"
        if warn and message != self._unservable_message:
            log.warning("%s", message)
        self._unservable_message = message

    def _pick(self, route: RouteRequest, candidates: list[Candidate], queued_at: float | None = None) -> _Decision:
        """On the decision thread; `queued_at` (`time.perf_counter()`) is when the decision was handed to it: its
        wait counts against the predictor's deadline (`GatewayPredictor.queued_s`)."""
        if self.predictor is None or queued_at is None:
            return self._pick_now(route, candidates)
        self.predictor.queued_s = time.perf_counter() - queued_at
        try:
            return self._pick_now(route, candidates)
        finally:
            self.predictor.queued_s = 0.0

    def _pick_now(self, route: RouteRequest, candidates: list[Candidate]) -> _Decision:
        started = time.perf_counter()
        before, explored_before = self._fallbacks(), self._explored()
        known = {c.endpoint_id for c in candidates}
        try:
            pick = self.policy.pick(route, candidates)
            if pick.hold:
                if route.held_ms < MAX_HOLD_MS:
                    return _Decision(pick, None, time.perf_counter() - started)
                log.warning(
                    "policy %s held %s for over %.0f s: the heuristics place it",
                    self._name,
                    route.request_id,
                    MAX_HOLD_MS / 1e3,
                )
                return _Decision(
                    self.last_resort.pick(route, candidates), "policy_error", time.perf_counter() - started
                )
            if pick.endpoint_id not in known or (pick.decode_endpoint_id or pick.endpoint_id) not in known:
                raise ValueError(f"picked {pick.endpoint_id}/{pick.decode_endpoint_id}, not among the candidates")
        except NoCandidateError:
            raise
        except Exception:  # a policy bug must not drop the request
            log.exception("policy %s failed; deciding with the heuristics", self._name)
            return _Decision(self.last_resort.pick(route, candidates), "policy_error", time.perf_counter() - started)
        fell_back = None
        after = self._fallbacks()
        if before is not None and after is not None and after > before:
            fell_back = self._fallback_reason()
        explored = explored_before is not None and (self._explored() or 0) > explored_before
        return _Decision(pick, fell_back, time.perf_counter() - started, explored)

    @property
    def _name(self) -> str:
        return str(getattr(self.policy, "name", "?"))

    def _fallback_reason(self) -> str:
        """Why the policy's last decision fell back: the error it caught when it says (an answer it could not
        route on never reaches the predictor's wrapper), else what the predictor last failed with."""
        err = getattr(self.policy, "fallback_error", None)
        if isinstance(err, PredictorError):
            return failure_reason(err)
        return self.predictor.last_failure if self.predictor is not None else "unavailable"

    def _fallbacks(self) -> int | None:
        counters = getattr(self.policy, "counters", None)
        return None if counters is None else int(counters.fallbacks)

    def _explored(self) -> int | None:
        counters = getattr(self.policy, "counters", None)
        return None if counters is None else int(getattr(counters, "explored", 0))

    def _record_decision(self, routed: _Routed, candidates: list[Candidate]) -> None:
        m = self.metrics
        decision = routed.decision
        pick = decision.pick
        m.decision_seconds.observe(decision.seconds)
        if decision.fell_back:
            m.fallbacks.labels(decision.fell_back).inc()
        if decision.explored:
            m.explorations.inc()
        chosen = [pick.endpoint_id] + ([pick.decode_endpoint_id] if pick.decode_endpoint_id else [])
        for eid in chosen:
            state = routed.candidates[eid].state
            m.picks.labels(eid, state.accelerator, state.role).inc()
            self._pick_series.add((eid, state.accelerator, state.role))
            self.affinity.record(eid, routed.key)
        prefill = routed.candidates[pick.endpoint_id]
        uncached = max(routed.route.input_tokens - prefill.prefix_hit_tokens, 0)
        decode_on = pick.decode_endpoint_id or pick.endpoint_id
        active = Active(routed.route.arrival_ms, uncached, routed.route.input_tokens, pick.endpoint_id, decode_on)
        self._work(WorkEvent("work_start", routed.request_id, active))
        if prefill.prefix_hit_tokens:
            m.prefix_estimated.labels(pick.endpoint_id).inc(prefill.prefix_hit_tokens)
        if any(c.state.role != "both" for c in candidates):
            m.pd_decisions.labels("disaggregated" if pick.is_pair else "local_prefill").inc()
        resident = sum(c.state.timeslice_state in ("none", "resident") for c in candidates)
        if resident and resident < len(candidates):
            m.timeslice_filtered.inc(len(candidates) - resident)

    def _forget(self, routed: _Routed) -> None:
        """The request will not complete where it was sent: the policy must not wait for it or learn from it."""
        if routed.settled:
            return
        routed.settled = True
        self._work(WorkEvent("work_finish", routed.request_id))
        if self._abandon is not None:
            self._policy_call(self._abandon, routed.request_id)

    def _policy_call(self, fn: Callable[..., None], *args: Any) -> None:
        """Where decisions are made (their thread, or here), so that the policy sees one caller at a time."""
        if self.decide_in_thread:
            self._decider.submit(self._safely, fn, *args)
        else:
            self._safely(fn, *args)

    @staticmethod
    def _safely(fn: Callable[..., None], *args: Any) -> None:
        """On the decision thread: a policy's failure to learn is logged, never raised into the proxy."""
        try:
            fn(*args)
        except Exception:
            log.exception("policy hook %s failed", getattr(fn, "__name__", fn))

    def _headers_out(self, response: Response, routed: _Routed, overhead_s: float) -> list[tuple[bytes, bytes]]:
        pick = routed.decision.pick
        out = end_to_end(response.headers)
        out.append((b"x-leadtime-endpoint", (pick.decode_endpoint_id or pick.endpoint_id).encode()))
        if pick.is_pair:
            out.append((b"x-leadtime-prefill-endpoint", pick.endpoint_id.encode()))
        out.append((b"x-leadtime-route-ms", f"{overhead_s * 1e3:.3f}".encode()))
        return out

    async def _relay(
        self,
        routed: _Routed,
        target: DiscoveredEndpoint,
        response: Response,
        send: Send,
        watch: ClientWatch,
        overhead_s: float,
    ) -> int:
        headers = self._headers_out(response, routed, overhead_s)
        streaming = _event_stream(response)
        parsed = routed.parsed
        assembler = Assembler() if streaming and not parsed.stream and parsed.upstream_body is not None else None
        meter = StreamMeter(None if assembler is None else assembler.add, hide_usage=parsed.hide_usage)
        timeout = self.settings.upstream_timeout_s
        if not parsed.stream:
            # by what was sent: a request sent on as a stream and answered with an error whole was meant measured
            self.metrics.non_streaming.labels("true" if parsed.upstream_body is not None else "false").inc()
        response.stop_when(watch.gone)
        if not streaming:
            try:
                body = await response.read(timeout)
            except UpstreamError as err:
                self._failed(target.endpoint_id, err, routed.sent_ms)
                self._forget(routed)
                return await self._endpoint_failed(send, target.endpoint_id, err)
            if response.stopped:
                response.close()
                raise ClientLeft
            headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            self._served(target.endpoint_id, response.status)
            if 200 <= response.status < 300:
                meter.feed_json(body)
                self._learn_length(routed, meter)
            self._forget(routed)  # no first-token time to learn from
            return response.status
        status = response.status
        deferred = _counted_once_read(response)
        first = True
        if assembler is None:
            await send({"type": "http.response.start", "status": status, "headers": headers})
        try:
            while True:
                try:
                    chunk = await response.next_chunk(timeout)
                except UpstreamError as err:
                    self._failed(target.endpoint_id, err, routed.sent_ms)
                    self._forget(routed)
                    if assembler is None:
                        await send({"type": "http.response.body", "body": stream_failed(target.endpoint_id, err)})
                    else:
                        await self._endpoint_failed(send, target.endpoint_id, err)
                    return 502
                if response.stopped:
                    response.close()
                    if not meter.done and watch.was_cut and assembler is None:
                        self._forget(routed)
                        await send({"type": "http.response.body", "body": stream_error(503, self._cut_message())})
                        return 503
                    if not meter.done:
                        raise ClientLeft
                    break  # the client hung up after `[DONE]`, its whole answer read: served, not lost
                if chunk is None:
                    break
                passed_on = meter.feed(chunk, self.clock())
                if meter.events:
                    if first:
                        first = False
                        routed.shared_generated = meter.events
                        self._work(WorkEvent("work_first", routed.request_id, generated=meter.events))
                        if self._prefilled is not None:
                            self._policy_call(self._prefilled, routed.request_id, meter.first_ms)
                    elif meter.events < routed.shared_generated + PROGRESS_SHARED_EVERY or self.replicas is None:
                        self.work.progress(routed.request_id, meter.events)
                    else:
                        routed.shared_generated = meter.events
                        self._work(WorkEvent("work_progress", routed.request_id, generated=meter.events))
                if assembler is None and passed_on:
                    await send({"type": "http.response.body", "body": passed_on, "more_body": True})
        finally:  # counted as the stream turned out: by the error event it carried, if it carried one
            if deferred:
                failed = meter.error_status
                why = f"answered {failed} in its stream ({meter.error})" if failed is not None else ""
                self._answered(target.endpoint_id, status if failed is None else failed, routed.sent_ms, why)
        if meter.error_status is not None:  # it failed the request in its stream: so it answered, not served
            status = meter.error_status
        empty = 200 <= status < 300 and assembler is not None and assembler.error is None and not assembler.answered
        if empty:  # no choice to make an answer of (one whose text is "" is one): "choices": [] would be no answer
            why = "answered a stream with no event holding a choice"
            self.outliers.failed(target.endpoint_id, why, sent_ms=routed.sent_ms)
            self._forget(routed)
            return await self._endpoint_failed(send, target.endpoint_id, why)
        self._served(target.endpoint_id, status)
        if assembler is None:
            await send({"type": "http.response.body", "body": meter.rest()})
        else:
            status, whole_headers, body = whole_answer(assembler, headers, status)
            await send({"type": "http.response.start", "status": status, "headers": whole_headers})
            await send({"type": "http.response.body", "body": body})
        if not 200 <= status < 300 or meter.first_ms is None:
            self._forget(routed)
            return status
        self._complete(routed, meter)
        return status

    def _learn_length(self, routed: _Routed, meter: StreamMeter) -> None:
        if meter.prompt_tokens and routed.key.prompt_bytes:
            self.affinity.learn_length(routed.key.prompt_bytes, meter.prompt_tokens)

    def _complete(self, routed: _Routed, meter: StreamMeter) -> None:
        assert meter.first_ms is not None
        routed.settled = True
        self._work(WorkEvent("work_finish", routed.request_id))
        pick = routed.decision.pick
        ttft = meter.first_ms - routed.sent_ms  # from when it was sent to its endpoint (`Outcome.ttft_ms`)
        itl = meter.itl_ms()
        tokens = max(meter.tokens, 1)
        self._learn_length(routed, meter)
        outcome = Outcome(routed.request_id, pick.endpoint_id, pick.decode_endpoint_id, ttft, itl, tokens, self.clock())
        self._policy_call(self.policy.observe, outcome)
        m = self.metrics
        prefill_class = routed.candidates[pick.endpoint_id].state.accelerator
        decode_class = routed.candidates[pick.decode_endpoint_id or pick.endpoint_id].state.accelerator
        m.ttft_seconds.labels("actual", prefill_class).observe(ttft / 1e3)
        if pick.predicted_ttft_ms:
            m.ttft_seconds.labels("predicted", prefill_class).observe(pick.predicted_ttft_ms / 1e3)
            m.ttft_ratio.labels(prefill_class).observe(ttft / pick.predicted_ttft_ms)
        if tokens > 1:
            m.itl_seconds.labels("actual", decode_class).observe(itl / 1e3)
            if pick.predicted_tpot_ms:
                m.itl_seconds.labels("predicted", decode_class).observe(pick.predicted_tpot_ms / 1e3)
                m.itl_ratio.labels(decode_class).observe(itl / pick.predicted_tpot_ms)
        route = routed.route
        waited = meter.first_ms - routed.received_ms  # the client's wait for its first token
        ttft_ok = route.ttft_slo_ms is None or waited <= route.ttft_slo_ms
        itl_ok = route.tpot_slo_ms is None or tokens < 2 or itl <= route.tpot_slo_ms
        if route.ttft_slo_ms is not None:
            m.slo.labels("ttft", "met" if ttft_ok else "missed").inc()
        if route.tpot_slo_ms is not None:
            m.slo.labels("itl", "met" if itl_ok else "missed").inc()
        if route.ttft_slo_ms is not None or route.tpot_slo_ms is not None:
            m.slo.labels("both", "met" if ttft_ok and itl_ok else "missed").inc()
