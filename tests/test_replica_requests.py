"""The other gateway replicas' requests as one replica counts them, and the rule that repairs a missed completion:
each replica's heartbeat lists what it still has in flight, and a receiver lets go of what the list no longer holds,
but never of a request started after the list was taken."""

from __future__ import annotations

from leadtime.router_plugin.gateway.replica_requests import (
    SNAPSHOT_IDS,
    InFlight,
    OwnRequests,
    RemoteRequests,
    part_of,
)


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


def test_a_replica_lists_its_own_requests_in_flight_in_parts_of_bounded_size() -> None:
    own = OwnRequests()
    own.note("prefill", "r1")
    own.note("work_start", "r1")
    own.note("work_start", "r2")
    own.note("decoding", "r3")
    own.note("judged", "r4")
    own.note("complete", "r1")  # still in the tokens-in-flight tracker
    own.note("complete", "r3")
    assert own.in_flight(seq=9, turn=0) == InFlight(seq=9, ids=frozenset({"r1", "r2"}))
    own.note("work_finish", "r1")
    own.note("work_finish", "r2")
    assert own.in_flight(seq=10, turn=1).ids == frozenset()

    many = [f"gw-{i}" for i in range(5 * SNAPSHOT_IDS)]
    for rid in many:
        own.note("work_start", rid)
    lists = [own.in_flight(seq=11 + turn, turn=turn) for turn in range(5)]
    assert {(x.part, x.parts) for x in lists} == {(p, 5) for p in range(5)}
    assert frozenset().union(*(x.ids for x in lists)) == frozenset(many)  # in five heartbeats, every request
    for x in lists:
        assert len(x.ids) < 1.2 * SNAPSHOT_IDS
        assert all(part_of(rid, 5) == x.part for rid in x.ids)
