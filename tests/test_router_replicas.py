"""Router replicas that share their ledgers: the events, the policy's side, the simulator's replicated policy, the
Redis sync against a real redis-server, and two `leadtime route` processes telling each other what they send."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import orjson
import pytest
import redis
import yaml
from redis_server import RedisServer
from test_router_plugin import QueueModel, cand, req
from test_tls_clients import route_cli

from leadtime.bench.procs import Route, SimFleet
from leadtime.features.rows import EndpointState
from leadtime.router_plugin.gateway.inflight_work import Active
from leadtime.router_plugin.gateway.metrics import GatewayMetrics
from leadtime.router_plugin.gateway.replicas import ReplicaSync, SenderClocks, WorkEvent, decode, encode
from leadtime.router_plugin.inflight import Sent
from leadtime.router_plugin.ledgers import LedgerEvent, RouterLedgers
from leadtime.router_plugin.policy import Outcome
from leadtime.router_plugin.predicted import LeadtimeConfig, LeadtimePolicy
from leadtime.simulator.learning_policies import replicated_policy
from leadtime.simulator.replicas import ReplicatedPolicy


def _replicas(shared: bool) -> list[LeadtimePolicy]:
    model = QueueModel()
    policies = [LeadtimePolicy(model, LeadtimeConfig(exploration=0.0)) for _ in range(2)]
    if shared:
        for mine, theirs in ((policies[0], policies[1]), (policies[1], policies[0])):
            mine.ledgers.outbox = theirs.ledgers.apply
    return policies


def test_replicas_that_share_their_ledgers_spread_a_burst_as_one_router_does() -> None:
    """The burst of `test_a_burst_is_spread_by_in_flight_accounting`, dealt to two replicas in turn."""
    candidates = [cand("a", hits=200), cand("b"), cand("c"), cand("d")]

    def route(policies: Sequence[LeadtimePolicy]) -> list[str]:
        return [policies[i % 2].pick(req(f"r{i}", at=1.0 + i * 0.01), candidates).endpoint_id for i in range(8)]

    shared = route(_replicas(shared=True))
    assert sorted(shared) == ["a", "a", "b", "b", "c", "c", "d", "d"] and shared[1] != shared[0]
    alone = route(_replicas(shared=False))
    # each replica alone sends its share of the burst as if it were the whole: their picks come in pairs
    assert alone[0::2] == alone[1::2]


def test_a_completion_reaches_the_other_replica_and_nothing_echoes() -> None:
    first, second = _replicas(shared=True)
    told: list[LedgerEvent] = []

    def tell(event: LedgerEvent) -> None:
        told.append(event)
        second.ledgers.apply(event)

    first.ledgers.outbox = tell
    first.overload = second.overload = 0.5
    candidates = [cand("a"), cand("b")]
    pick = first.pick(req("r1", at=1.0), candidates)
    assert len(second.ledgers.inflight) == 1 and [e.kind for e in told] == ["judged", "prefill", "decoding"]
    first.observe(Outcome("r1", pick.endpoint_id, None, ttft_ms=50.0, itl_ms=10.0, output_tokens=20, completed_ms=9.0))
    assert len(second.ledgers.inflight) == 0 and len(second.ledgers.decoding) == 0
    assert told[-1].kind == "complete" and len(told) == 4  # applying another's event tells no one
    assert second.overload == first.overload < 0.5  # the decision found an endpoint in time: both replicas know


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"kind": "prefill", "request_id": "r", "endpoint_id": "e"}, "sent"),
        ({"kind": "prefill", "request_id": "r", "endpoint_id": "e", "sent": {"request_id": "r"}}, "sent"),
        (
            {
                "kind": "prefill",
                "request_id": "r",
                "endpoint_id": "e",
                "sent": {"request_id": "r", "sent_ms": "soon", "uncached_tokens": 1, "input_tokens": 1},
            },
            "sent",
        ),
        ({"kind": "decoding", "request_id": "r", "endpoint_id": "e", "itl_slo_ms": -5}, "itl_slo_ms"),
        ({"kind": "prefill", "request_id": "", "endpoint_id": "e"}, "request_id"),
        ({"kind": "decode", "request_id": "r"}, "endpoint_id"),
    ],
)
def test_a_ledger_event_that_is_not_one_is_refused_naming_its_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LedgerEvent.from_dict(raw)


def test_messages_carry_times_onto_the_receivers_clock_and_bad_ones_are_refused() -> None:
    active = Active(sent_ms=100.0, uncached_tokens=8, input_tokens=10, prefill_on="e", decode_on="e")
    body = encode("a", [WorkEvent("work_start", "r1", active), WorkEvent("work_first", "r1", generated=3)], 200.0, 0.0)
    message = decode(body, SenderClocks(), now_ms=250.0)  # the receiver's clock is 50 ms ahead
    origin, events = message.origin, message.events
    assert origin == "a" and isinstance(events[0], WorkEvent) and events[0].active is not None
    assert events[0].active.sent_ms == 150.0 and events[1] == WorkEvent("work_first", "r1", generated=3)
    for body, problem in (
        (b'{"origin": 1}', "origin"),
        (b'{"origin": "a", "mono_ms": 0, "wall_ms": 0, "events": {}}', "events"),
        (b'{"origin": "a", "mono_ms": 0, "wall_ms": 0, "events": [{"kind": "work_start", "request_id": "r"}]}', "act"),
        (b'{"origin": "a", "mono_ms": "x", "wall_ms": 0, "events": []}', "mono_ms"),
    ):
        with pytest.raises(ValueError, match=problem):
            decode(body, SenderClocks(), 0.0)


def test_a_replica_not_heard_stops_counting_its_requests() -> None:
    applied: list[object] = []
    metrics = GatewayMetrics()
    sync = ReplicaSync("redis://127.0.0.1:9/0", "g", applied.append, metrics, silent_after_s=0.0)
    sent = LedgerEvent("prefill", "r1", "e1", Sent("r1", 1.0, 8, 10))
    sync._take(encode("other", [sent], time.monotonic() * 1e3, time.time() * 1e3))
    sync._take(encode(sync.origin, [sent], 0.0, 0.0))  # its own message, back from the channel: ignored
    sync._take(b"not json")
    assert len(applied) == 1 and metrics.replica_requests._value.get() == 1
    assert metrics.replica_events.labels("refused")._value.get() == 1
    time.sleep(0.01)
    sync._forget_silent()
    assert applied[1:] == [LedgerEvent("complete", "other/r1")]  # it had no tokens-in-flight entry to finish
    assert metrics.replica_requests._value.get() == 0 and metrics.replicas_heard._value.get() == 0


def test_a_replica_heard_again_after_its_silence_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """Its silence was said ("not heard for 5 s"), its return not: every other fault had its recovery line."""
    sync = ReplicaSync("redis://127.0.0.1:9/0", "g", lambda event: None, GatewayMetrics(), silent_after_s=0.0)
    sent = LedgerEvent("prefill", "r1", "e1", Sent("r1", 1.0, 8, 10))
    with caplog.at_level(logging.INFO, logger="leadtime.router"):
        sync._take(encode("other", [sent], time.monotonic() * 1e3, time.time() * 1e3))
        time.sleep(0.01)
        sync._forget_silent()
        sync._take(encode("other", [sent], time.monotonic() * 1e3, time.time() * 1e3))
        sync._take(encode("other", [sent], time.monotonic() * 1e3, time.time() * 1e3))
    said = [r.getMessage() for r in caplog.records if "heard again" in r.getMessage()]
    assert said == ["replica other heard again: its requests count from now on"], said


def test_requests_numbered_alike_by_two_replicas_stay_apart() -> None:
    """Every gateway numbers its requests gw-1, gw-2, ...: another replica's gw-1 completing must not complete this
    replica's gw-1 (nor the third replica's)."""
    ledgers = RouterLedgers()

    def apply(event: LedgerEvent | WorkEvent) -> None:
        if isinstance(event, LedgerEvent):
            ledgers.apply(event)

    sync = ReplicaSync("redis://127.0.0.1:9/0", "g", apply, GatewayMetrics())
    ledgers.record_prefill("e1", Sent("gw-1", 1.0, 8, 10))  # this replica's own gw-1
    now_mono, now_wall = time.monotonic() * 1e3, time.time() * 1e3
    for origin in ("b", "c"):
        sync._take(encode(origin, [LedgerEvent("prefill", "gw-1", "e1", Sent("gw-1", 2.0, 8, 10))], now_mono, now_wall))
    assert len(ledgers.inflight) == 3
    sync._take(encode("b", [LedgerEvent("complete", "gw-1")], now_mono, now_wall))
    assert len(ledgers.inflight) == 2 and {s.request_id for s in ledgers.inflight.pending("e1")} == {"gw-1", "c/gw-1"}


@pytest.mark.parametrize("skew_ms", [-5_000.0, -100.0, 100.0, 5_000.0])
def test_a_replica_whose_wall_clock_is_off_has_its_request_counted_once(skew_ms: float) -> None:
    """Replica b's wall clock is `skew_ms` off a's, and its monotonic clock started at another time: a request b
    sends counts once on a's ledgers, whichever side of a scrape it falls (not twice when b is ahead: already in a
    scrape taken 20 ms after it; not zero times when b is behind: missing from a scrape taken 20 ms before it)."""
    ledgers = RouterLedgers()

    def apply(event: LedgerEvent | WorkEvent) -> None:
        if isinstance(event, LedgerEvent):
            ledgers.apply(event)

    sync = ReplicaSync("redis://127.0.0.1:9/0", "g", apply, GatewayMetrics())
    a_mono, a_wall = time.monotonic() * 1e3, time.time() * 1e3
    b_mono, b_wall = a_mono - 200_000.0, a_wall + skew_ms  # b's clocks at the same instant
    sync._take(encode("b", [LedgerEvent("prefill", "r1", "e1", Sent("r1", b_mono, 800, 1000))], b_mono, b_wall))
    already_in = EndpointState(endpoint_id="e1", num_request_waiting=1, prefill_tokens_in_flight=800)
    assert ledgers.inflight.adjusted(already_in, published_ms=a_mono + 20.0).num_request_waiting == 1
    not_yet_in = EndpointState(endpoint_id="e1")
    assert ledgers.inflight.adjusted(not_yet_in, published_ms=a_mono - 20.0).num_request_waiting == 1


def test_a_senders_clock_is_mapped_by_its_quickest_recent_message_and_never_past_now() -> None:
    clocks = SenderClocks(window_ms=60_000.0)
    assert clocks.shift("b", sender_ms=1_000.0, received_ms=50_000.0) == 49_000.0  # first heard: as it came
    assert clocks.shift("b", 2_000.0, 50_999.0) == 48_999.0  # a quicker one: the shift is its
    assert clocks.shift("b", 3_000.0, 52_500.0) == 48_999.0  # a slow one (a busy loop) moves nothing
    assert clocks.shift("c", 0.0, 52_500.0) == 52_500.0  # each sender its own
    # a minute on, the quick message has left the window: b's clock may have drifted since
    assert clocks.shift("b", 70_000.0, 119_100.0) == 49_100.0
    clocks.forget("b")
    assert clocks.shift("b", 0.0, 200_000.0) == 200_000.0
    # a time on the sender's clock after its message was sent lands no later than the receiver's now
    body = encode("d", [LedgerEvent("prefill", "r1", "e1", Sent("r1", 5_000.0, 8, 10))], 1_000.0, 0.0)
    events = decode(body, SenderClocks(), now_ms=10_000.0).events
    assert isinstance(events[0], LedgerEvent) and events[0].sent is not None and events[0].sent.sent_ms == 10_000.0


def test_two_syncs_share_through_a_real_redis_and_forget_a_replica_that_stops(redis_server: RedisServer) -> None:
    async def scenario() -> tuple[list[object], list[object]]:
        heard_by_b: list[object] = []
        a = ReplicaSync(redis_server.url, "g", lambda e: None, GatewayMetrics())
        b = ReplicaSync(redis_server.url, "g", heard_by_b.append, GatewayMetrics(), silent_after_s=1.5)
        other_group: list[object] = []
        c = ReplicaSync(redis_server.url, "another", other_group.append, GatewayMetrics())
        for sync in (a, b, c):
            await sync.start()
        await asyncio.sleep(0.3)  # subscribed
        sent_at = time.monotonic() * 1e3
        a.publish(LedgerEvent("prefill", "r1", "e1", Sent("r1", sent_at, 800, 1000)))
        a.publish(LedgerEvent("decoding", "r1", "e1", itl_slo_ms=50.0))
        deadline = time.monotonic() + 5
        while len(heard_by_b) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        received = list(heard_by_b)
        await a.stop()  # gone without completing r1
        deadline = time.monotonic() + 6
        while len(heard_by_b) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for sync in (b, c):
            await sync.stop()
        return received + heard_by_b[2:], other_group

    events, other_group = asyncio.run(scenario())
    assert [getattr(e, "kind", None) for e in events] == ["prefill", "decoding", "complete"]
    first = events[0]
    assert isinstance(first, LedgerEvent) and first.sent is not None
    assert abs(first.sent.sent_ms - time.monotonic() * 1e3) < 30_000  # on this host's clock, not shifted away
    assert other_group == []


def test_without_redis_a_replica_counts_what_it_could_not_tell_and_goes_on() -> None:
    from leadtime.bench.procs import free_port

    async def scenario() -> float:
        metrics = GatewayMetrics()
        sync = ReplicaSync(f"redis://127.0.0.1:{free_port()}/0", "g", lambda e: None, metrics)
        await sync.start()
        for i in range(3):
            sync.publish(LedgerEvent("complete", f"r{i}"))
        deadline = time.monotonic() + 10
        while metrics.replica_events.labels("dropped")._value.get() < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await sync.stop()
        return float(metrics.replica_events.labels("dropped")._value.get())

    assert asyncio.run(scenario()) == 3  # nothing raised into the gateway; nothing sent


def test_a_redis_outage_is_one_warning_and_its_end_is_said(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """ "not hearing the other replicas" came every second of an outage, and hearing them again was never said."""

    async def scenario() -> None:
        sync = ReplicaSync(redis_server.url, "g", lambda e: None, GatewayMetrics())
        await sync.start()
        raw = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 10
        while not raw.pubsub_numsub(sync.channel)[0][1] and time.monotonic() < deadline:  # subscribed
            await asyncio.sleep(0.05)
        assert raw.pubsub_numsub(sync.channel)[0][1] == 1, "never subscribed"
        raw.close()
        redis_server.stop()
        deadline = time.monotonic() + 10
        while sync.health() == {} and time.monotonic() < deadline:  # the outage noticed
            await asyncio.sleep(0.05)
        assert "replicas" in sync.health(), "the outage never noticed"
        # Several retries (one a second): nothing counts them, and a longer wait only means more of them, so this
        # sleep is a lower bound, not a guess at when something has happened.
        await asyncio.sleep(3.5)
        redis_server.start()
        deadline = time.monotonic() + 10
        while "hearing the other replicas again" not in caplog.text and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await sync.stop()

    with caplog.at_level(logging.INFO, logger="leadtime.router.replicas"):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if m.startswith("not hearing the other replicas")]) == 1, said
    assert any(m.startswith("hearing the other replicas again") for m in said), said


def test_a_completion_missed_while_its_replica_lives_stops_counting_within_seconds(redis_server: RedisServer) -> None:
    """Regression: pub/sub delivers nothing again. A replica whose subscriber reconnected (or that Redis dropped for
    less than 5 s) while another kept heartbeating missed that one's completions and counted those requests for good:
    12 requests in flight on an idle fleet, their tokens on endpoints that had none, minutes later."""

    async def scenario() -> tuple[float, float, float, float, list[object], str]:
        a = ReplicaSync(redis_server.url, "g", lambda e: None, GatewayMetrics())
        heard: list[object] = []
        metrics = GatewayMetrics()
        b = ReplicaSync(redis_server.url, "g", heard.append, metrics, silent_after_s=3600.0)  # a is never silent
        raw = redis.Redis.from_url(redis_server.url)

        async def until(condition: Callable[[], bool], timeout_s: float) -> bool:
            deadline = time.monotonic() + timeout_s
            while not condition() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return condition()

        def subscribed() -> bool:
            return int(raw.pubsub_numsub(b.channel)[0][1]) == 2

        def counted() -> float:
            return float(metrics.replica_requests._value.get())

        for sync in (a, b):
            await sync.start()
        try:
            assert await until(subscribed, 10), "never subscribed"
            active = Active(
                sent_ms=time.monotonic() * 1e3, uncached_tokens=8, input_tokens=10, prefill_on="e1", decode_on="e1"
            )
            a.publish(WorkEvent("work_start", "r1", active))
            a.publish(LedgerEvent("prefill", "r1", "e1", Sent("r1", active.sent_ms, 8, 10)))
            assert await until(lambda: counted() == 1, 10)
            assert raw.client_kill_filter(_type="pubsub") == 2  # both subscribers: b subscribes again after a second
            assert await until(lambda: "replicas" in b.health(), 10), "b never noticed"
            a.publish(LedgerEvent("complete", "r1"))  # b is deaf: it misses r1's completion
            a.publish(WorkEvent("work_finish", "r1"))
            # (redis-py subscribes again by itself at once, on a connection nobody reads until it is closed: the
            # count of subscribers says b hears only once b says it does)
            assert await until(lambda: b.health() == {} and subscribed(), 10), "never subscribed again"
            heard_again = time.monotonic()
            a.publish(WorkEvent("work_start", "r2", active))  # started after: it counts on
            finished_r1 = WorkEvent("work_finish", f"{a.origin}/r1")
            assert await until(lambda: finished_r1 in heard, 10), "r1 counts on"
            took = time.monotonic() - heard_again
            await asyncio.sleep(2.5)  # two heartbeats more: r2 still counts
            return (
                took,
                counted(),
                float(metrics.replica_events.labels("received")._value.get()),
                float(metrics.replica_events.labels("missed")._value.get()),
                list(heard),  # before the stops (a stopping replica's requests are let go of)
                a.origin,
            )
        finally:
            raw.close()
            for sync in (a, b):
                await sync.stop()

    took, counting, received, missed, heard, origin = asyncio.run(scenario())
    assert (counting, received, missed) == (1, 3, 1), took  # r1's start (2 events) and r2's: r1's end was missed
    kinds = [(getattr(e, "kind", None), getattr(e, "request_id", None)) for e in heard]
    assert ("complete", f"{origin}/r1") in kinds and ("work_finish", f"{origin}/r1") in kinds
    assert ("work_finish", f"{origin}/r2") not in kinds
    assert took < 5.0, took  # a heartbeat a second: well within the 5 s a silent replica is given


@pytest.mark.parametrize("traffic", [True, False])
def test_a_redis_outage_is_named_in_the_health_the_gateway_reports_and_cleared_after(
    redis_server: RedisServer, traffic: bool
) -> None:
    """The gateway's /readyz said `degraded: {}` through a Redis outage that cut its replicas off from each other
    (each routing on what it alone knew): the log said so, readiness did not. Once Redis is back it clears, with
    traffic or without (only a published event cleared it: an idle gateway said "not sharing" for ever, though its
    heartbeats reached Redis again every second)."""

    async def scenario() -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
        sync = ReplicaSync(redis_server.url, "g", lambda e: None, GatewayMetrics())
        await sync.start()
        await asyncio.sleep(0.3)
        before = sync.health()
        redis_server.stop()
        sync.publish(LedgerEvent("complete", "r0"))
        deadline = time.monotonic() + 10
        while not sync.health() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        during = sync.health()
        redis_server.start()
        deadline = time.monotonic() + 10
        while sync.health() and time.monotonic() < deadline:
            if traffic:
                sync.publish(LedgerEvent("complete", "r1"))
            await asyncio.sleep(0.2)
        after = sync.health()
        await sync.stop()
        return before, during, after

    before, during, after = asyncio.run(scenario())
    assert before == {} and after == {}, (before, after)
    assert set(during) == {"replicas"} and redis_server.url.split("//")[1].split("/")[0] in during["replicas"]
    assert "routing on what this replica knows" in during["replicas"], during


def test_the_simulators_replicas_route_every_request_and_learn_once_each() -> None:
    from leadtime.bench.routing import _fleet

    fleet = _fleet("homogeneous")
    for name in ("leadtime_x4", "leadtime_x4_shared"):
        policy = replicated_policy(name, fleet, seed=0)
        assert isinstance(policy, ReplicatedPolicy) and len(policy.replicas) == 4
        assert policy.shared == name.endswith("shared")
        assert len({id(r.predictor) for r in policy.replicas}) == 1  # one predictor, as one service
    policy = replicated_policy("leadtime_x4_shared", fleet, seed=0)
    candidates = [cand("a"), cand("b")]
    picks = [policy.pick(req(f"r{i}", at=float(i)), candidates) for i in range(8)]
    assert [len(r.ledgers.inflight) for r in policy.replicas] == [8, 8, 8, 8]  # each knows every request
    for i, pick in enumerate(picks):
        policy.observe(Outcome(f"r{i}", pick.endpoint_id, None, 50.0, 10.0, 20, 100.0 + i))
    assert [len(r.ledgers.inflight) for r in policy.replicas] == [0, 0, 0, 0]


def test_the_simulators_replicas_let_go_of_a_failed_request_and_of_an_endpoint_that_left() -> None:
    """Regression: the replicated policy had no `abandon`, so the simulator never told it of a failed request, which
    stayed in flight on every replica for good; nor `forget_endpoint`."""
    from leadtime.bench.routing import _fleet

    policy = replicated_policy("leadtime_x4_shared", _fleet("homogeneous"), seed=0)
    candidates = [cand("a"), cand("b")]
    picks = [policy.pick(req(f"r{i}", at=float(i)), candidates) for i in range(2)]
    policy.abandon("r0")
    assert [len(r.ledgers.inflight) for r in policy.replicas] == [1, 1, 1, 1]  # r1 only, everywhere
    policy.observe(Outcome("r1", picks[1].endpoint_id, None, 50.0, 10.0, 20, 100.0))
    assert [len(r.ledgers.inflight) for r in policy.replicas] == [0, 0, 0, 0]
    policy.abandon("never-routed")  # nothing to let go of: no error
    policy.forget_endpoint("a")
    assert all("a" not in r._last_heard for r in policy.replicas)


FLEET = {"name": "one", "pools": [{"name": "h100", "count": 2, "accelerator": "h100-sxm", "model": "llama-3.1-8b"}]}


def test_two_gateways_tell_each_other_what_they_send(tmp_path: Path, redis_server: RedisServer) -> None:
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(yaml.safe_dump(FLEET))
    fleet = SimFleet(fleet_file, tmp_path)
    common = ["--discovery", str(fleet.endpoints_file), "--embedded"]
    common += ["--replicas-redis", redis_server.url, "--replicas-group", "test"]
    first, second = Route(tmp_path, common), Route(tmp_path, common)
    try:
        first.wait(), second.wait()
        deadline = time.monotonic() + 10
        while second.metric("leadtime_router_replicas_heard") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert second.metric("leadtime_router_replicas_heard") == 1
        body = {"prompt": "tell me a long story " * 30, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{first.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # streaming: in flight now
            deadline = time.monotonic() + 10
            while second.metric("leadtime_router_replica_requests_in_flight") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert second.metric("leadtime_router_replica_requests_in_flight") == 1
            assert second.metric("leadtime_router_replica_events_total", direction="received") >= 1
            for _ in lines:
                pass
        deadline = time.monotonic() + 10
        while second.metric("leadtime_router_replica_requests_in_flight") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert second.metric("leadtime_router_replica_requests_in_flight") == 0  # completed: it counts no more
        assert first.metric("leadtime_router_replica_events_total", direction="dropped") == 0
        assert httpx.get(f"{first.url}/readyz").json()["degraded"] == {}
        redis_server.stop()  # the replicas no longer hear each other: still ready, and saying so
        deadline = time.monotonic() + 10
        while "replicas" not in httpx.get(f"{first.url}/readyz").json()["degraded"] and time.monotonic() < deadline:
            time.sleep(0.2)
        ready = httpx.get(f"{first.url}/readyz")
        assert ready.status_code == 200 and "not sharing through redis" in ready.json()["degraded"]["replicas"]
    finally:
        first.child.stop()
        second.child.stop()
        fleet.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--replicas-redis", "http://127.0.0.1:6379"], "--replicas-redis: expected redis://"),
        (["--replicas-redis", "redis://127.0.0.1:6379/0", "--replicas-group", "two words"], "--replicas-group"),
    ],
)
def test_route_names_a_replica_option_that_cannot_work(args: list[str], message: str) -> None:
    done = route_cli("--policy", "round-robin", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_replica_tells_the_others_how_far_its_requests_have_decoded(redis_server: RedisServer) -> None:
    """Another replica counts a remote request's decode work (prompt + tokens generated so far) to within
    `PROGRESS_SHARED_EVERY` tokens, not as it stood at its first token."""
    from inprocess_gateway import through_gateway

    from leadtime.router_plugin.discovery import StaticDiscovery
    from leadtime.router_plugin.gateway.app import PROGRESS_SHARED_EVERY, Gateway, GatewaySettings
    from leadtime.router_plugin.heuristics import RoundRobinPolicy
    from leadtime.simulator.fleet import parse_fleet

    other = Gateway(StaticDiscovery([]), RoundRobinPolicy(), GatewaySettings())  # the other replica: never started
    heard: list[WorkEvent] = []
    counted_before_finish: list[tuple[int, int]] = []

    def apply(event: LedgerEvent | WorkEvent) -> None:
        if isinstance(event, WorkEvent):
            heard.append(event)
            if event.kind == "work_finish" and heard[0].active is not None:
                counted_before_finish.append(other.work.tokens(heard[0].active.decode_on, float("inf")))
        other.apply_replica_event(event)

    listener = ReplicaSync(redis_server.url, "g", apply, GatewayMetrics())

    def attach(gateway: Gateway) -> None:
        gateway.attach_replicas(ReplicaSync(redis_server.url, "g", gateway.apply_replica_event, gateway.metrics))

    async def scenario(client: httpx.AsyncClient) -> None:
        await listener.start()
        await asyncio.sleep(0.3)  # subscribed
        body = {"prompt": "decode a while " * 20, "max_tokens": 200, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                pass
        deadline = time.monotonic() + 5
        while not counted_before_finish and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await listener.stop()

    through_gateway(parse_fleet(FLEET), RoundRobinPolicy(), scenario, GatewaySettings(), attach=attach)
    assert [e.kind for e in heard][:2] == ["work_start", "work_first"] and heard[-1].kind == "work_finish"
    progress = [e.generated for e in heard if e.kind == "work_progress"]
    assert len(progress) >= 200 // PROGRESS_SHARED_EVERY - 1
    assert progress == sorted(progress) and progress[-1] > 200 - 2 * PROGRESS_SHARED_EVERY
    start = heard[0].active
    assert start is not None
    assert counted_before_finish == [(0, start.input_tokens + progress[-1])]
    assert other.work.tokens(start.decode_on, float("inf")) == (0, 0)


SLASHED = "redis://:Zx9/Secr#t@127.0.0.1:6379/0"  # a password holding '/' and '#', not percent-encoded


def test_a_password_holding_a_url_delimiter_is_refused_without_showing_it() -> None:
    """redis-py was given the URL as it came: it read part of the password as the host or database and showed it
    in its errors (`invalid literal for int() ... 'Secr#t@...'`)."""
    with pytest.raises(ValueError, match="percent-encode") as raised:
        ReplicaSync(SLASHED, "g", lambda e: None, GatewayMetrics())
    assert "Secr" not in str(raised.value) and "Zx9" not in str(raised.value)
    done = route_cli("--policy", "round-robin", "--replicas-redis", SLASHED)
    assert done.returncode == 2 and "--replicas-redis redis://127.0.0.1:6379/0: " in done.stderr
    assert "percent-encode" in done.stderr
    assert "Secr" not in done.stderr and "Zx9" not in done.stderr and "Traceback" not in done.stderr


def test_a_refused_password_is_named_and_never_shown(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from conftest import require_redis_server

    server = RedisServer(
        require_redis_server(), tmp_path, extra_args=["--requirepass", "s3cret"], client_options={"password": "s3cret"}
    )
    server.start()
    url = f"redis://:wr%2Fong@127.0.0.1:{server.port}/0"

    async def scenario() -> None:
        sync = ReplicaSync(url, "g", lambda e: None, GatewayMetrics())
        await sync.start()
        sync.publish(LedgerEvent("complete", "r1"))
        deadline = time.monotonic() + 5
        while caplog.text.count("refused the password") < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await sync.stop()

    try:
        with caplog.at_level(logging.INFO, logger="leadtime.router.replicas"):
            asyncio.run(scenario())
    finally:
        server.stop()
    said = [r.getMessage() for r in caplog.records if r.name == "leadtime.router.replicas"]
    assert sum("refused the password" in m for m in said) == 2, said  # publishing and hearing, once each
    assert all(f"redis://127.0.0.1:{server.port}/0" in m for m in said), said
    assert not any("wr" in m.split("redis://")[-1].split("/")[0] or "%2F" in m for m in said), said


def test_a_message_that_is_refused_teaches_the_clocks_nothing() -> None:
    """The clock sample was taken before the events were checked: one malformed message under a replica's name with
    a bogus clock set that replica's shift for a minute (and every name sent stayed for good)."""
    clocks = SenderClocks()
    good = encode("b", [], 5_000.0, 0.0)
    decode(good, clocks, now_ms=10_000.0)
    bogus = orjson.dumps({"origin": "b", "mono_ms": 1e12, "wall_ms": 0.0, "events": [{"kind": "nonsense"}]})
    with pytest.raises(ValueError):
        decode(bogus, clocks, now_ms=10_001.0)
    with pytest.raises(ValueError):
        decode(orjson.dumps({"origin": "x", "mono_ms": 1.0, "wall_ms": 0.0, "events": "no"}), clocks, 10_001.0)
    assert clocks.shift("b", 6_000.0, 11_000.0) == 5_000.0  # as the good message said
    assert "x" not in clocks._samples


def test_a_replica_says_its_own_name_when_it_starts_sharing(caplog: pytest.LogCaptureFixture) -> None:
    """Others logged "replica 4e7ebea5c707 not heard for 5 s", a name no replica said was its own."""

    async def started() -> None:
        sync = ReplicaSync("redis://127.0.0.1:9/0", "g", lambda event: None, GatewayMetrics())
        await sync.start()
        await sync.stop()
        said = [r.getMessage() for r in caplog.records if sync.origin in r.getMessage()]
        assert said and "this replica" in said[0] and "127.0.0.1:9" in said[0], said

    with caplog.at_level(logging.INFO, logger="leadtime.router"):
        asyncio.run(started())


def test_replicas_given_different_databases_of_one_redis_do_not_share(redis_server: RedisServer) -> None:
    """Redis pub/sub ignores the database: a gateway given redis://HOST/1 heard, and counted, every request of the
    gateways given redis://HOST/0 (another fleet, its ledgers and its overload share mixed into this one's)."""
    base = redis_server.url.rsplit("/", 1)[0]

    async def scenario() -> tuple[list[object], list[object]]:
        in_db0: list[object] = []
        in_db1: list[object] = []
        a = ReplicaSync(f"{base}/0", "default", lambda e: None, GatewayMetrics())
        b = ReplicaSync(f"{base}/0", "default", in_db0.append, GatewayMetrics())
        c = ReplicaSync(f"{base}/1", "default", in_db1.append, GatewayMetrics())
        for sync in (a, b, c):
            await sync.start()
        await asyncio.sleep(0.3)  # subscribed
        a.publish(LedgerEvent("prefill", "r1", "e1", Sent("r1", time.monotonic() * 1e3, 8, 10)))
        deadline = time.monotonic() + 5
        while not in_db0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # c, were it to hear it, would by now
        heard = list(in_db0), list(in_db1)  # before the stops (a stopping replica's requests are let go of)
        for sync in (a, b, c):
            await sync.stop()
        return heard

    in_db0, in_db1 = asyncio.run(scenario())
    assert [getattr(e, "kind", None) for e in in_db0] == ["prefill"]
    assert in_db1 == []


async def counted_by(metrics: GatewayMetrics, sender: ReplicaSync) -> None:
    """`sender` sends a request, and the replica exporting to `metrics` comes to count it (within 5 s)."""
    sender.publish(WorkEvent("work_start", "r1", Active(time.monotonic() * 1e3, 8, 10, "e1", "e1")))
    deadline = time.monotonic() + 5
    while metrics.replica_requests._value.get() != 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert metrics.replica_requests._value.get() == 1


def test_a_hung_redis_lets_go_of_a_silent_replicas_requests_on_time(redis_server: RedisServer) -> None:
    """With Redis hung (SIGSTOP: every publication waits out its 2 s timeout), the check for silent replicas ran
    only after this replica's own heartbeat had waited its turn behind the events being published and then failed:
    the other replica's requests counted up to twice the time the README gives them."""

    async def scenario() -> float:
        a = ReplicaSync(redis_server.url, "g", lambda e: None, GatewayMetrics())
        metrics = GatewayMetrics()
        b = ReplicaSync(redis_server.url, "g", lambda e: None, metrics, silent_after_s=1.5)
        for sync in (a, b):
            await sync.start()
        await asyncio.sleep(0.3)  # subscribed
        await counted_by(metrics, a)
        redis_server.pause()
        paused = time.monotonic()
        try:
            deadline = paused + 15
            while metrics.replica_requests._value.get() and time.monotonic() < deadline:
                b.publish(LedgerEvent("judged", "rb", in_time=True))  # b routes on meanwhile
                await asyncio.sleep(0.1)
            return time.monotonic() - paused
        finally:
            redis_server.resume()
            for sync in (a, b):
                await sync.stop()

    took = asyncio.run(scenario())
    assert took < 1.5 + 1.0 + 1.0, took  # its last heartbeat at most a second before the pause, 1.5 s of silence


def test_a_replica_stops_even_when_a_publication_swallows_its_cancellation(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py's publish can return as if uncancelled when its answer arrives with the cancellation (seen with Redis
    resumed after a pause: the publication then returned normally, twice); the loop that made it went on to wait
    for events that never came, and the gateway's shutdown waited for it for ever."""

    async def scenario() -> float:
        sync = ReplicaSync(redis_server.url, "g", lambda e: None, GatewayMetrics())
        real = sync._client.publish

        async def swallowing(channel: str, body: bytes) -> int:
            with contextlib.suppress(asyncio.CancelledError):  # as redis-py does when the answer comes with it
                await asyncio.sleep(0.5)  # the answer on its way
            return int(await real(channel, body))

        monkeypatch.setattr(sync._client, "publish", swallowing)
        await sync.start()
        await asyncio.sleep(0.1)  # the first heartbeat is being published
        sync.publish(LedgerEvent("complete", "r0"))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await asyncio.wait_for(sync.stop(), 10)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 3.0


def test_a_replica_that_stops_cleanly_has_its_requests_let_go_of_at_once_without_a_warning(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway stopped by SIGTERM went on counting at every other replica for 5 s, which then each warned that
    it was "not heard for 5 s", at every rolling restart; it says it stops, and they let go of it at once."""

    async def scenario() -> float:
        a = ReplicaSync(redis_server.url, "g", lambda e: None, GatewayMetrics())
        metrics = GatewayMetrics()
        b = ReplicaSync(redis_server.url, "g", lambda e: None, metrics)
        for sync in (a, b):
            await sync.start()
        await asyncio.sleep(0.3)  # subscribed
        await counted_by(metrics, a)
        await a.stop()
        stopped = time.monotonic()
        while metrics.replica_requests._value.get() and time.monotonic() < stopped + 8:
            await asyncio.sleep(0.02)
        took = time.monotonic() - stopped
        await b.stop()
        return took

    with caplog.at_level(logging.INFO, logger="leadtime.router.replicas"):
        took = asyncio.run(scenario())
    assert took < 1.0, took
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert any(level == logging.INFO and "stopped: its 1 requests stop counting" in m for level, m in said), said
    assert not [m for level, m in said if level >= logging.WARNING], said
