"""The other gateway replicas' requests as one replica counts them, and the rule that repairs a missed completion:
each replica's heartbeat lists what it still has in flight, and a receiver lets go of what the list no longer holds,
but never of a request started after the list was taken."""

from __future__ import annotations

import time

import orjson
import pytest

from leadtime.router_plugin.gateway.inflight_work import Active
from leadtime.router_plugin.gateway.metrics import GatewayMetrics
from leadtime.router_plugin.gateway.replica_requests import (
    SNAPSHOT_IDS,
    InFlight,
    OwnRequests,
    RemoteRequests,
    part_of,
)
from leadtime.router_plugin.gateway.replicas import Event, ReplicaSync, SenderClocks, WorkEvent, decode, encode
from leadtime.router_plugin.inflight import Sent
from leadtime.router_plugin.ledgers import LedgerEvent

ACTIVE = Active(sent_ms=1.0, uncached_tokens=8, input_tokens=10, prefill_on="e1", decode_on="e1")


def test_a_missed_completion_is_let_go_of_at_the_next_list_and_a_request_started_after_the_list_is_kept() -> None:
    remote = RemoteRequests()
    remote.note("b", "prefill", "r1", seq=1)
    remote.note("b", "work_start", "r1", seq=1)
    remote.note("b", "work_start", "r2", seq=2)
    remote.note("b", "judged", "r2", seq=2)  # not a request in flight
    # b's message 3, r1's completion, is missed. Message 5 starts r4 after b's list (message 4) was taken; it can
    # arrive first: r4 is not in the list, and must not be let go of.
    remote.note("b", "work_start", "r4", seq=5)
    remote.note("c", "work_start", "r1", seq=1)  # another replica's r1: not b's
    assert remote.count == 4
    assert remote.stale("b", InFlight(seq=4, ids=frozenset({"r2"}))) == (["r1"], ["r1"])
    assert remote.count == 3
    assert remote.stale("b", InFlight(seq=6, ids=frozenset({"r2", "r4"}))) == ([], [])  # nothing missed: nothing
    remote.note("b", "work_finish", "r2", seq=7)
    assert remote.count == 2
    assert remote.stale("c", InFlight(seq=2, ids=frozenset({"r1"}))) == ([], [])
    assert remote.forget("b") == (set(), {"r4"}) and remote.count == 1


def test_a_request_said_in_flight_again_after_the_list_is_kept() -> None:
    """A retry records a request again (on another endpoint): what counts is the latest message that said it was in
    flight, not the first."""
    remote = RemoteRequests()
    remote.note("b", "prefill", "r1", seq=1)
    remote.note("b", "prefill", "r1", seq=5)
    assert remote.stale("b", InFlight(seq=4, ids=frozenset())) == ([], [])
    assert remote.count == 1


def test_a_list_of_one_part_lets_go_only_of_the_requests_of_that_part() -> None:
    remote = RemoteRequests()
    ids = [f"gw-{i}" for i in range(40)]
    for rid in ids:
        remote.note("b", "work_start", rid, seq=1)
    in_part_0 = {rid for rid in ids if part_of(rid, 2) == 0}
    assert 0 < len(in_part_0) < len(ids)
    _, work = remote.stale("b", InFlight(seq=2, ids=frozenset(), part=0, parts=2))  # all of part 0 completed
    assert set(work) == in_part_0 and remote.count == len(ids) - len(in_part_0)


def published(own: OwnRequests, kind: str, request_id: str) -> None:
    own.note(kind, request_id, queued=True)
    own.sent(kind, request_id)


def test_a_replica_lists_its_own_requests_in_flight_in_parts_of_bounded_size() -> None:
    own = OwnRequests()
    published(own, "prefill", "r1")
    published(own, "work_start", "r1")
    published(own, "work_start", "r2")
    published(own, "decoding", "r3")
    published(own, "judged", "r4")
    published(own, "complete", "r1")  # still in the tokens-in-flight tracker
    published(own, "complete", "r3")
    assert own.in_flight(seq=9, turn=0) == InFlight(seq=9, ids=frozenset({"r1", "r2"}))
    published(own, "work_finish", "r1")
    published(own, "work_finish", "r2")
    assert own.in_flight(seq=10, turn=1).ids == frozenset()

    many = [f"gw-{i}" for i in range(5 * SNAPSHOT_IDS)]
    for rid in many:
        published(own, "work_start", rid)
    lists = [own.in_flight(seq=11 + turn, turn=turn) for turn in range(5)]
    assert {(x.part, x.parts) for x in lists} == {(p, 5) for p in range(5)}
    assert frozenset().union(*(x.ids for x in lists)) == frozenset(many)  # in five heartbeats, every request
    for x in lists:
        assert len(x.ids) < 1.2 * SNAPSHOT_IDS
        assert all(part_of(rid, 5) == x.part for rid in x.ids)


def test_a_replica_lists_a_request_until_its_queued_completion_has_gone_out() -> None:
    """A list must not say a request completed before the messages numbered below it have: a receiver would take the
    completion still queued for a missed one."""
    own = OwnRequests()
    published(own, "work_start", "r1")
    own.note("work_finish", "r1", queued=True)  # queued behind a message being published
    assert own.in_flight(seq=2, turn=0).ids == frozenset({"r1"})
    own.sent("work_finish", "r1")
    assert own.in_flight(seq=3, turn=1).ids == frozenset()
    # A completion dropped (the queue full) is lost to the others: no list holds its request from then on, though
    # its start, queued before, goes out after.
    own.note("work_start", "r2", queued=True)
    own.note("work_finish", "r2", queued=False)
    assert own.in_flight(seq=4, turn=2).ids == frozenset()
    own.sent("work_start", "r2")
    assert own.in_flight(seq=5, turn=3).ids == frozenset()


def test_a_heartbeat_of_thousands_in_flight_stays_small_and_quick() -> None:
    own = OwnRequests()
    for i in range(10_000):
        published(own, "work_start", f"gw-{1_000_000 + i}")
    x = own.in_flight(seq=1, turn=0)
    started = time.perf_counter()
    body = encode("a", [], 0.0, 0.0, seq=x.seq, in_flight=x)
    message = decode(body, SenderClocks(), 0.0)
    took = time.perf_counter() - started
    assert message.in_flight == x
    assert len(body) < 40_000, len(body)  # about 2,000 ids of 10 characters, and quotes and commas
    assert took < 0.05, took  # a few ms at most, even on a loaded host


def test_a_heartbeat_that_no_longer_lists_a_request_finishes_it_on_the_receiver() -> None:
    applied: list[object] = []
    metrics = GatewayMetrics()
    sync = ReplicaSync("redis://127.0.0.1:9/0", "g", applied.append, metrics)
    mono, wall = time.monotonic() * 1e3, time.time() * 1e3
    start: list[Event] = [
        WorkEvent("work_start", "r1", ACTIVE),
        LedgerEvent("prefill", "r1", "e1", Sent("r1", 1.0, 8, 10)),
    ]
    sync._take(encode("b", start, mono, wall, seq=1))
    # message 2, r1's completion, is missed; message 4 (r2's start) comes before the heartbeat, message 3
    sync._take(encode("b", [WorkEvent("work_start", "r2", ACTIVE)], mono, wall, seq=4))
    assert metrics.replica_requests._value.get() == 2
    sync._take(encode("b", [], mono, wall, seq=3, in_flight=InFlight(seq=3, ids=frozenset())))
    assert applied[-2:] == [LedgerEvent("complete", "b/r1"), WorkEvent("work_finish", "b/r1")]
    assert metrics.replica_requests._value.get() == 1  # r2 still counts
    assert metrics.replica_events.labels("missed")._value.get() == 1
    assert metrics.replica_events.labels("received")._value.get() == 3
    sync._take(encode("b", [], mono, wall, seq=5, in_flight=InFlight(seq=5, ids=frozenset({"r2"}))))
    assert metrics.replica_requests._value.get() == 1 and len(applied) == 5


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"seq": "x"}, "seq"),
        ({"seq": -1}, "seq"),
        ({"seq": True}, "seq"),
        ({"in_flight": {"part": 0, "parts": 1, "ids": []}}, "seq"),  # a list not numbered cannot be placed
        ({"seq": 3, "in_flight": []}, "in_flight"),
        ({"seq": 3, "in_flight": {"part": 2, "parts": 2, "ids": []}}, "in_flight.part"),
        ({"seq": 3, "in_flight": {"part": 0, "parts": 0, "ids": []}}, "in_flight.parts"),
        ({"seq": 3, "in_flight": {"part": 0, "parts": 1, "ids": [1]}}, "in_flight.ids"),
        ({"seq": 3, "in_flight": {"part": 0, "parts": 1}}, "in_flight.ids"),
    ],
)
def test_a_message_whose_number_or_list_is_not_one_is_refused_naming_it(
    fields: dict[str, object], problem: str
) -> None:
    body = orjson.dumps({"origin": "b", "mono_ms": 0.0, "wall_ms": 0.0, "events": [], **fields})
    with pytest.raises(ValueError, match=problem):
        decode(body, SenderClocks(), 0.0)


def test_a_message_of_an_earlier_version_has_no_number_and_no_list() -> None:
    body = orjson.dumps({"origin": "b", "mono_ms": 0.0, "wall_ms": 0.0, "events": []})
    message = decode(body, SenderClocks(), 0.0)
    assert message.origin == "b" and message.seq is None and message.in_flight is None
