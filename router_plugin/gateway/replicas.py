"""`leadtime route --replicas-redis URL`: gateway replicas that tell each other what they send.

Several gateways behind one load balancer each route a share of the requests. What an endpoint's scraped state
cannot show yet (the requests sent since its last scrape, the prompt tokens still to prefill, who decodes where)
each gateway knows only of its own requests; a burst split between replicas lands again on the endpoint that looked
idle. Here every replica publishes, on one Redis channel per group, each change of its policy's ledgers
(`router_plugin.ledgers`) and of its tokens-in-flight tracker (`inflight_work`), and applies everyone else's:
where a request was sent, when its first token came, when it completed, whether it found an endpoint in time.

- **Clocks.** No two replicas' clocks need agree, wall or monotonic. Times travel as the sender's monotonic
  milliseconds, and each message says what the sender's monotonic clock read when it went out. The receiver maps
  each sender's clock onto its own by the least (its own monotonic time at receipt − the message's) over that
  sender's messages of the last minute, heartbeats included (`SenderClocks`): the quickest delivery, so off by
  that delivery's latency (well under a millisecond on one network, against a 50 ms scrape interval), and taken
  afresh every minute, so that clocks running at slightly different rates do not drift apart. A request's send
  time never lands after the receiver's now. (Messages also carry the sender's wall clock, for replicas of
  earlier versions, which convert through the wall clocks.)
- **A replica that goes away.** Each replica says it is alive every second (a heartbeat); the requests of one
  not heard for `silent_after_s` (5 s) stop counting, as if they had completed. One that stops cleanly says so
  (`leaving`), and the others let go of its requests at once.
- **A message missed.** Pub/sub delivers nothing again: a subscriber that reconnects, or a Redis blip shorter than
  those 5 s, loses what was sent meanwhile. Each heartbeat lists the requests its replica still has in flight, and
  a receiver lets go of those it counts that the list no longer holds (`replica_requests`): a missed completion
  counts until the next heartbeat, not for as long as its replica lives. Messages are numbered, so that a request
  started after the list was taken is not let go of, and published one at a time, so that they arrive in order.
- **Redis that goes away.** Routing never waits for it: publishing is a queue drained by a task of its own (events
  beyond 10,000 queued are dropped and counted), and the subscriber reconnects every second. Meanwhile each replica
  routes on what it knows, as a single gateway does.
- **Decode progress** goes out every 32 tokens a request generates (`app.PROGRESS_SHARED_EVERY`), so another
  replica counts a remote request's decode work to within that many tokens.
- **Not shared:** what each replica has learned of time-slice groups (each reads the same source). Each decision's
  judgement of whether any endpoint could serve its request in time is shared (`judged` events), so that every
  replica sees the fleet overloaded when one router would.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from leadtime.predictor.store.redis_store import async_redis_client, redis_problem, without_credentials
from leadtime.router_plugin.gateway.inflight_work import Active
from leadtime.router_plugin.gateway.metrics import GatewayMetrics
from leadtime.router_plugin.gateway.replica_requests import InFlight, OwnRequests, RemoteRequests
from leadtime.router_plugin.ledgers import LedgerEvent, dataclass_of_numbers, required_text

log = logging.getLogger("leadtime.router.replicas")

CHANNEL_PREFIX = "leadtime:route:"


def channel_of(group: str, database: int) -> str:
    """The pub/sub channel of `group`'s replicas on Redis database `database`. Redis delivers a publication to every
    subscriber of its channel whatever database either selected, so the database is part of the name: fleets told
    apart by their URL's /DB must not hear each other. Database 0 keeps the name replicas of earlier versions use.

    >>> channel_of("default", 0), channel_of("default", 1)
    ('leadtime:route:default', 'leadtime:route:db1:default')
    """
    return CHANNEL_PREFIX + (f"db{database}:" if database else "") + group


HEARTBEAT_S = 1.0
SILENCE_CHECK_S = 0.25
"""How often the other replicas' silence is checked: on a task of its own, not after this replica's heartbeat, which
a hung Redis holds for its 2 s timeout, behind the events being published (a silent replica's requests then counted
for twice the time they are given)."""
STOP_WAIT_S = 2.0
"""The longest `ReplicaSync.stop` waits for its tasks to end."""
QUEUE_LIMIT = 10_000
WORK_KINDS = ("work_start", "work_first", "work_progress", "work_finish")


@dataclasses.dataclass(frozen=True)
class WorkEvent:
    """A change of the tokens-in-flight tracker: a request started (with what it is), had its first token,
    generated more (every `app.PROGRESS_SHARED_EVERY` tokens), or finished."""

    kind: str
    request_id: str
    active: Active | None = None
    generated: int = 0


Event = LedgerEvent | WorkEvent


@dataclasses.dataclass(frozen=True)
class Message:
    """A message of another replica's, as `decode` reads it: its number (None from replicas of earlier versions,
    which number none) and, in a heartbeat, its requests in flight."""

    origin: str
    events: list[Event]
    seq: int | None = None
    in_flight: InFlight | None = None
    leaving: bool = False


def encode(
    origin: str,
    events: list[Event],
    mono_ms: float,
    wall_ms: float,
    seq: int | None = None,
    in_flight: InFlight | None = None,
    leaving: bool = False,
) -> bytes:
    """One message: who sends it, its number `seq` (the sender's count of its messages), its two clocks (the
    monotonic one is what receivers read; the wall clock is for replicas of earlier versions), its events, and in a
    heartbeat the sender's requests in flight (`in_flight`, taken when message `seq` went out).

    >>> from leadtime.router_plugin.inflight import Sent
    >>> body = encode("a", [LedgerEvent("prefill", "r1", "e1", Sent("r1", 100.0, 8, 10))], 1000.0, 5000.0, seq=7)
    >>> message = decode(body, SenderClocks(), now_ms=1000.0)
    >>> message.origin, message.seq, message.events[0].sent.sent_ms
    ('a', 7, 100.0)
    >>> decode(body, SenderClocks(), now_ms=1010.0).events[0].sent.sent_ms  # a receiver whose clock is 10 ms ahead
    110.0
    """
    assert in_flight is None or in_flight.seq == seq, "a list is taken when its message goes out"
    items: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, LedgerEvent):
            items.append(event.to_dict())
        else:
            d: dict[str, Any] = {"kind": event.kind, "request_id": event.request_id}
            if event.active is not None:
                d["active"] = dataclasses.asdict(event.active)
            if event.generated:
                d["generated"] = event.generated
            items.append(d)
    message: dict[str, Any] = {"origin": origin, "mono_ms": mono_ms, "wall_ms": wall_ms, "events": items}
    if seq is not None:
        message["seq"] = seq
    if in_flight is not None:
        message["in_flight"] = {"part": in_flight.part, "parts": in_flight.parts, "ids": list(in_flight.ids)}
    if leaving:
        message["leaving"] = True
    return orjson.dumps(message)


class SenderClocks:
    """Each sender's monotonic clock mapped onto the receiver's, without wall clocks.

    A message sent when the sender's clock read `s` and received when the receiver's read `r` says the shift from
    one clock to the other is at most `r - s` (it is `r - s` less the delivery time). The shift taken is the least
    `r - s` of the sender's messages received in the last `window_ms`: the quickest delivery, and only recent ones,
    so that a drift between the two clocks' rates does not build up.
    """

    def __init__(self, window_ms: float = 60_000.0) -> None:
        self.window_ms = window_ms
        # sender → (received at, r - s) of its messages in the window, each r - s below every later one's
        self._samples: dict[str, collections.deque[tuple[float, float]]] = {}

    def shift(self, origin: str, sender_ms: float, received_ms: float) -> float:
        """What to add to a time on `origin`'s clock to have it on the receiver's, given a message of `origin`
        sent at `sender_ms` (its clock) and received at `received_ms` (the receiver's); the message is learned."""
        self.learn(origin, sender_ms, received_ms)
        return self._samples[origin][0][1]

    def peek(self, origin: str, sender_ms: float, received_ms: float) -> float:
        """`shift` as it would be with this message, which is not learned (not yet checked)."""
        sample = received_ms - sender_ms
        samples = self._samples.get(origin)
        recent = [s for at, s in samples or () if at >= received_ms - self.window_ms]
        return min([sample, *recent])

    def learn(self, origin: str, sender_ms: float, received_ms: float) -> None:
        """Learn from a message of `origin` sent at `sender_ms`, received at `received_ms`."""
        samples = self._samples.setdefault(origin, collections.deque())
        sample = received_ms - sender_ms
        while samples and samples[-1][1] >= sample:
            samples.pop()  # never the least again: this one is as low and will stay longer
        samples.append((received_ms, sample))
        while samples[0][0] < received_ms - self.window_ms:
            samples.popleft()

    def forget(self, origin: str) -> None:
        """Drop what is known of `origin`'s clock (a replica gone)."""
        self._samples.pop(origin, None)


def decode(body: bytes, clocks: SenderClocks, now_ms: float) -> Message:
    """The message, its events' times on the receiver's monotonic clock, for a message received at `now_ms` on that
    clock; `clocks` learns the sender's clock from it. A request's send time lands no later than `now_ms`.
    ValueError naming what is wrong with a message that is not one of ours."""
    message = orjson.loads(body)
    if not isinstance(message, dict) or not isinstance(message.get("origin"), str):
        raise ValueError("origin: expected a string")
    mono = message.get("mono_ms")
    if not isinstance(mono, int | float) or isinstance(mono, bool) or not math.isfinite(mono):
        raise ValueError("mono_ms: expected a number")
    raw_events = message.get("events")
    if not isinstance(raw_events, list):
        raise ValueError("events: expected a list")
    seq = message.get("seq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 0):
        raise ValueError("seq: expected a count")
    in_flight = None if message.get("in_flight") is None else _in_flight(message["in_flight"], seq)
    # sender's monotonic → receiver's monotonic; the message is learned from once it is known to be one of ours
    shift = clocks.peek(message["origin"], mono, now_ms)
    events: list[Event] = []
    for raw in raw_events:
        if not isinstance(raw, Mapping):
            raise ValueError("events: expected objects")
        if raw.get("kind") in WORK_KINDS:
            events.append(_work_event(raw, shift, now_ms))
        else:
            event = LedgerEvent.from_dict(raw)
            if event.sent is not None:
                sent = event.sent.shifted(shift)
                event = dataclasses.replace(event, sent=dataclasses.replace(sent, sent_ms=min(sent.sent_ms, now_ms)))
            events.append(event)
    clocks.learn(message["origin"], mono, now_ms)
    leaving = message.get("leaving", False)
    if not isinstance(leaving, bool):
        raise ValueError("leaving: expected true or false")
    return Message(message["origin"], events, seq, in_flight, leaving)


def _in_flight(raw: object, seq: int | None) -> InFlight:
    if seq is None:
        raise ValueError("seq: a list of requests in flight needs its message's number")
    if not isinstance(raw, Mapping):
        raise ValueError("in_flight: expected an object")
    parts, part, ids = raw.get("parts"), raw.get("part"), raw.get("ids")
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError("in_flight.parts: expected a count of at least 1")
    if not isinstance(part, int) or isinstance(part, bool) or not 0 <= part < parts:
        raise ValueError("in_flight.part: expected a part below in_flight.parts")
    if not isinstance(ids, list) or not all(isinstance(rid, str) for rid in ids):
        raise ValueError("in_flight.ids: expected a list of request ids")
    return InFlight(seq, frozenset(ids), part, parts)


def _work_event(raw: Mapping[str, Any], shift: float, now_ms: float) -> WorkEvent:
    request_id = required_text(raw, "request_id")
    active = None
    if raw["kind"] == "work_start":
        active = dataclass_of_numbers(Active, raw.get("active"), "active")
        active = dataclasses.replace(active, sent_ms=min(active.sent_ms + shift, now_ms))
    generated = raw.get("generated", 0)
    if not isinstance(generated, int) or generated < 0:
        raise ValueError("generated: expected a count")
    return WorkEvent(raw["kind"], request_id, active, generated)


def _remote_id(origin: str, request_id: str) -> str:
    """`request_id` prefixed by the replica it came from: every replica numbers its requests alike (the gateway's
    `gw-1`, `gw-2`, ...), and one replica's request must not complete another's."""
    return f"{origin}/{request_id}"


def _as_remote(event: Event, origin: str) -> Event:
    """`event` with its request id prefixed by the replica it came from (`_remote_id`)."""
    request_id = _remote_id(origin, event.request_id)
    if isinstance(event, LedgerEvent) and event.sent is not None:
        return dataclasses.replace(
            event, request_id=request_id, sent=dataclasses.replace(event.sent, request_id=request_id)
        )
    return dataclasses.replace(event, request_id=request_id)


MAX_SILENCED_KEPT = 1024
"""Replicas whose silence is remembered, for their return to be said (a replica's id changes at each restart)."""


class ReplicaSync:
    """Publishes this replica's events and applies the other replicas' (see the module docstring).

    Parameters
    ----------
    url
        Redis, e.g. "redis://127.0.0.1:6379/0" (or rediss:// with a password).
    group
        Replicas of one group (and one database of `url`) share; one Redis can serve several fleets.
    apply
        Called (on the event loop) with each event of another replica, to be applied where decisions are made.
    metrics
        The gateway's metrics (events sent, received and dropped; replicas heard; their requests in flight).
    silent_after_s
        A replica not heard for this long is taken to be gone, and its requests stop counting.

    Raises ValueError naming what is wrong with `url` (never a part of its password), as the predictor's store does.
    """

    def __init__(
        self,
        url: str,
        group: str,
        apply: Callable[[Event], None],
        metrics: GatewayMetrics,
        silent_after_s: float = 5.0,
    ) -> None:
        self.address = without_credentials(url)  # for logs: the password left out
        # Checked and built here (not connected): a bad URL is refused at start, in the store's words.
        self._client = async_redis_client(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.channel = channel_of(group, int(self._client.connection_pool.connection_kwargs.get("db") or 0))
        self.origin = secrets.token_hex(6)
        self.apply = apply
        self.metrics = metrics
        self.silent_after_s = silent_after_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Event] = asyncio.Queue(QUEUE_LIMIT)
        self._heard: dict[str, float] = {}  # origin → time.monotonic() of its last message
        self._silenced: set[str] = set()  # origins whose silence was said (their return is said once)
        self._clocks = SenderClocks()  # each other replica's monotonic clock on this one's
        self._remote = RemoteRequests()  # the other replicas' requests this one counts
        self._own = OwnRequests()  # this replica's, as its heartbeats list them
        self._seq = 0  # messages sent, this one's number
        self._heartbeats = 0  # whose turn it is to be listed, when this replica lists its requests in parts
        self._left = False  # this replica told the others it stops
        self._publishing = asyncio.Lock()  # one message at a time: they arrive in the order they are numbered
        self._tasks: list[asyncio.Task[None]] = []
        self._cannot_publish: str | None = None  # why the last publication failed, until one succeeds
        self._deaf: str | None = None  # why the subscription failed, until it is made again

    # ----- this replica's events (any thread) ---------------------------------------------------------------

    def publish(self, event: Event) -> None:
        """Queue an event for the other replicas; safe from the decision thread; never blocks."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the gateway is stopping
                self._loop.call_soon_threadsafe(self._enqueue, event)

    def _enqueue(self, event: Event) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            self._own.note(event.kind, event.request_id, queued=False)  # lost: the next heartbeat says where it stands
            self.metrics.replica_events.labels("dropped").inc()
            return
        self._own.note(event.kind, event.request_id, queued=True)

    def health(self) -> dict[str, str]:
        """What is degraded, for the gateway's /readyz (which stays ready: each replica routes on what it knows):
        {"replicas": why} while the replicas cannot tell each other what they send, else {}."""
        problem = self._cannot_publish or self._deaf
        if problem is None:
            return {}
        return {
            "replicas": f"not sharing through redis at {self.address} ({problem}); routing on what this replica knows"
        }

    # ----- lifecycle ----------------------------------------------------------------------------------------

    async def start(self) -> None:
        log.info("sharing with the other replicas through redis at %s: this replica is %s", self.address, self.origin)
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            self._loop.create_task(self._send()),
            self._loop.create_task(self._receive()),
            self._loop.create_task(self._heartbeat()),
            self._loop.create_task(self._watch_silence()),
        ]

    async def stop(self) -> None:
        """Cancel the tasks, again until each has ended (`STOP_WAIT_S` at most), and close the client.

        Once is not enough: redis-py's publish can return as if uncancelled when its answer arrives with the
        cancellation, and the task that made it then waited for events that never came, holding the gateway's
        shutdown for ever. A cancellation of `stop` itself is not swallowed either."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):  # the others let go of this one's requests at once, not after 5 s
            await asyncio.wait_for(self._say_goodbye(), STOP_WAIT_S / 2)
        deadline = loop.time() + STOP_WAIT_S
        while pending := [task for task in self._tasks if not task.done()]:
            left = deadline - loop.time()
            if left <= 0:
                log.warning("%d tasks sharing with the other replicas did not stop; leaving them", len(pending))
                break
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=min(0.1, left))
        for task in self._tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a task that ended on an error has nothing more to say at a stop
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._client.aclose(), STOP_WAIT_S)

    async def _say_goodbye(self) -> None:
        """Tell the others this replica stops (a stop signal, Ctrl-C): they let go of its requests at once, with a
        line saying so, rather than count them for `silent_after_s` and then warn that it went silent."""
        async with self._publishing:
            self._left = True  # nothing after it: the others would count this one's requests again
            self._seq += 1
            body = encode(self.origin, [], time.monotonic() * 1e3, time.time() * 1e3, self._seq, leaving=True)
            await self._client.publish(self.channel, body)

    # ----- tasks --------------------------------------------------------------------------------------------

    async def _publish(self, events: list[Event]) -> None:
        """Publish `events` (none: a heartbeat, which lists this replica's requests in flight). Whether it worked is
        what `health` says: heartbeats count too, so that a replica with no traffic clears its degraded health once
        Redis is back. Events that fail to go out are lost to the others all the same: the next heartbeat says
        where their requests stand."""
        async with self._publishing:
            if self._left:
                return
            self._seq += 1
            for event in events:
                self._own.sent(event.kind, event.request_id)
            in_flight = None
            if not events:
                in_flight = self._own.in_flight(self._seq, self._heartbeats)
                self._heartbeats += 1
            body = encode(self.origin, events, time.monotonic() * 1e3, time.time() * 1e3, self._seq, in_flight)
            try:
                await self._client.publish(self.channel, body)
            except Exception as err:
                self._cannot_publish = redis_problem(err)
                raise
            self._cannot_publish = None

    async def _send(self) -> None:
        failing = False
        while True:
            events = [await self._queue.get()]
            while not self._queue.empty() and len(events) < 512:
                events.append(self._queue.get_nowait())
            try:
                await self._publish(events)
                self.metrics.replica_events.labels("sent").inc(len(events))
                if failing:
                    log.info("publishing to the other replicas through redis at %s works again", self.address)
                failing = False
            except Exception as err:  # Redis away: these events are lost to the others, routing goes on
                self.metrics.replica_events.labels("dropped").inc(len(events))
                if not failing:
                    log.warning(
                        "cannot publish to the other replicas through redis at %s (%s); routing on what this one knows",
                        self.address,
                        redis_problem(err),
                    )
                failing = True

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._publish([])
            await asyncio.sleep(HEARTBEAT_S)

    async def _watch_silence(self) -> None:
        while True:
            self._forget_silent()
            await asyncio.sleep(SILENCE_CHECK_S)

    async def _receive(self) -> None:
        deaf = False  # said once an outage, and its end
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                self._deaf = None
                if deaf:
                    deaf = False
                    log.info("hearing the other replicas again through redis at %s", self.address)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._take(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self._deaf = redis_problem(err)
                if not deaf:
                    deaf = True
                    log.warning(
                        "not hearing the other replicas through redis at %s (%s); retrying every second",
                        self.address,
                        redis_problem(err),
                    )
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _take(self, body: bytes) -> None:
        try:
            message = decode(body, self._clocks, time.monotonic() * 1e3)
        except (ValueError, TypeError, KeyError, orjson.JSONDecodeError) as err:
            self.metrics.replica_events.labels("refused").inc()
            log.debug("a message on %s that is not a replica's: %s", self.channel, err)
            return
        origin = message.origin
        if origin == self.origin:
            self._clocks.forget(origin)  # our own, echoed by the channel: no clock to map
            return
        if origin in self._silenced:  # its silence was said: so is its return
            self._silenced.discard(origin)
            log.info("replica %s heard again: its requests count from now on", origin)
        if message.leaving:
            self._let_go_of(origin, "stopped")
            self._export()
            return
        self._heard[origin] = time.monotonic()
        seq = message.seq if message.seq is not None else 0  # an earlier version's: never listed, never let go of
        for event in message.events:
            self._remote.note(origin, event.kind, event.request_id, seq)
            self.apply(_as_remote(event, origin))
        self.metrics.replica_events.labels("received").inc(len(message.events))
        if message.in_flight is not None:
            self._let_go_of_missed(origin, message.in_flight)
        self._export()

    def _let_go_of_missed(self, origin: str, listed: InFlight) -> None:
        """`origin`'s requests this replica counts that its heartbeat no longer lists: their completions were missed
        (see the module docstring). They complete here."""
        in_ledgers, in_work = self._remote.stale(origin, listed)
        if not in_ledgers and not in_work:
            return
        missed = len({*in_ledgers, *in_work})
        self.metrics.replica_events.labels("missed").inc(missed)
        log.info(
            "replica %s no longer has %d requests whose completion this one missed: they stop counting", origin, missed
        )
        for request_id in in_ledgers:
            self.apply(LedgerEvent("complete", _remote_id(origin, request_id)))
        for request_id in in_work:
            self.apply(WorkEvent("work_finish", _remote_id(origin, request_id)))

    def _forget_silent(self) -> None:
        now = time.monotonic()
        for origin in [o for o, heard in self._heard.items() if now - heard > self.silent_after_s]:
            if len(self._silenced) < MAX_SILENCED_KEPT:
                self._silenced.add(origin)
            self._let_go_of(origin, f"not heard for {self.silent_after_s:.0f} s")
        self._export()

    def _let_go_of(self, origin: str, why: str) -> None:
        """Every request of `origin` stops counting: it went silent, or said it stops. Logged in one line, a warning
        for a silence."""
        in_ledgers, in_work = self._remote.forget(origin)
        self._heard.pop(origin, None)
        self._clocks.forget(origin)
        level = logging.INFO if why == "stopped" else logging.WARNING
        log.log(level, "replica %s %s: its %d requests stop counting", origin, why, len(in_ledgers | in_work))
        for request_id in in_ledgers:
            self.apply(LedgerEvent("complete", _remote_id(origin, request_id)))
        for request_id in in_work:
            self.apply(WorkEvent("work_finish", _remote_id(origin, request_id)))

    def _export(self) -> None:
        self.metrics.replicas_heard.set(len(self._heard))
        self.metrics.replica_requests.set(self._remote.count)
