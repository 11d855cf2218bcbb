"""Which requests each gateway replica has in flight, as the other replicas count them, and the rule that repairs a
completion one of them missed.

Replicas tell each other when their requests start and complete over Redis pub/sub (`replicas`), which delivers
nothing again: a replica whose subscriber reconnects, or that Redis drops for less than the 5 s after which a silent
replica's requests stop counting, misses what was sent meanwhile. A missed start only leaves a request uncounted
until it completes; a missed completion would leave it counted for as long as its replica lives, with its tokens on
an endpoint that has long finished it, in every row the predictor is shown and learns from.

So each replica also lists, with its heartbeat (every second), the requests it still has in flight (`OwnRequests`),
and a receiver lets go of those of its requests it counts that the list no longer holds (`RemoteRequests.stale`).
The race: a request started after the list was taken is not in it, and its start may reach a receiver first. Every
message is numbered (the sender counts its messages), each request counts from the latest message that said it was
in flight, and the list lets go only of requests said to be in flight by messages numbered below its own. A
replica's own requests are those its events say are in flight, in the order it queues them for publishing (or drops
them, the queue full); a request whose completion is still queued is listed until that completion has gone out, so
that a list never says a request completed before the messages numbered below it have.

A list of 2,048 request ids is about 30 KB. A replica with more in flight splits its requests by a hash of their ids
(CRC-32, the same in every process) into as many parts as needed to keep each near that size, and lists one part per
heartbeat, in turn: with 10,000 in flight, five parts, and a missed completion counts for at most about 5 s.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import zlib

LEDGER_STARTS = ("prefill", "decode", "decoding")
"""Ledger events that put a request in flight (`router_plugin.ledgers.EVENT_KINDS`); `complete` takes it out."""
WORK_START, WORK_FINISH = "work_start", "work_finish"
"""The tokens-in-flight tracker's (`replicas.WORK_KINDS`)."""
ENDS = ("complete", WORK_FINISH)

SNAPSHOT_IDS = 2048
"""Request ids a heartbeat lists, about: beyond, a replica's requests are listed in parts, one per heartbeat."""


def part_of(request_id: str, parts: int) -> int:
    """Which of `parts` parts `request_id` is listed in: the same in every process (not Python's salted `hash`).

    >>> part_of("gw-1", 1), part_of("gw-1", 3) == part_of("gw-1", 3)
    (0, True)
    """
    return zlib.crc32(request_id.encode()) % parts if parts > 1 else 0


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A replica's requests in flight when it sent its message numbered `seq`: all those in part `part` of `parts`
    (`part_of`)."""

    seq: int
    ids: frozenset[str]
    part: int = 0
    parts: int = 1


class OwnRequests:
    """This replica's requests in flight, as its events say (in its policy's ledgers, in its tokens-in-flight
    tracker), and those whose completion is queued, not yet sent."""

    def __init__(self) -> None:
        self._ledgers: set[str] = set()
        self._work: set[str] = set()
        self._completing: collections.Counter[str] = collections.Counter()  # completions queued, not yet sent

    def note(self, kind: str, request_id: str, queued: bool) -> None:
        """An event of this replica's, queued for publishing or dropped (the queue full: lost to the others)."""
        if queued and kind in ENDS:
            self._completing[request_id] += 1
        if kind in LEDGER_STARTS:
            self._ledgers.add(request_id)
        elif kind == "complete":
            self._ledgers.discard(request_id)
        elif kind == WORK_START:
            self._work.add(request_id)
        elif kind == WORK_FINISH:
            self._work.discard(request_id)

    def sent(self, kind: str, request_id: str) -> None:
        """A queued event has gone out, in a message numbered below any list taken from now on (published, or lost
        to the others: Redis away)."""
        if kind in ENDS:
            self._completing[request_id] -= 1
            if self._completing[request_id] <= 0:
                del self._completing[request_id]

    def in_flight(self, seq: int, turn: int) -> InFlight:
        """What the heartbeat numbered `seq`, this replica's `turn`-th, lists: every request in flight, or the part
        whose turn it is when there are more than `SNAPSHOT_IDS`."""
        ids = self._ledgers | self._work | self._completing.keys()
        parts = max(1, math.ceil(len(ids) / SNAPSHOT_IDS))
        part = turn % parts
        if parts > 1:
            ids = {rid for rid in ids if part_of(rid, parts) == part}
        return InFlight(seq, frozenset(ids), part, parts)


class RemoteRequests:
    """The other replicas' requests this one counts, per replica (its origin), each with the number of the latest
    message that said it was in flight; `count` of them over every replica."""

    def __init__(self) -> None:
        self._ledgers: dict[str, dict[str, int]] = {}
        self._work: dict[str, dict[str, int]] = {}
        self.count = 0  # kept as events come, not recounted

    def note(self, origin: str, kind: str, request_id: str, seq: int) -> None:
        """An event of `origin`'s, in its message numbered `seq`."""
        in_ledgers = self._ledgers.setdefault(origin, {})
        in_work = self._work.setdefault(origin, {})
        counted = request_id in in_ledgers or request_id in in_work
        if kind in LEDGER_STARTS:
            in_ledgers[request_id] = seq
        elif kind == "complete":
            in_ledgers.pop(request_id, None)
        elif kind == WORK_START:
            in_work[request_id] = seq
        elif kind == WORK_FINISH:
            in_work.pop(request_id, None)
        self.count += int(request_id in in_ledgers or request_id in in_work) - int(counted)

    def stale(self, origin: str, listed: InFlight) -> tuple[list[str], list[str]]:
        """Let go of `origin`'s requests that its list no longer holds though a message numbered before the list said
        they were in flight: their completions were missed. Those (in the ledgers, in the tokens-in-flight tracker),
        for the caller to complete."""
        gone: list[list[str]] = []
        for held in (self._ledgers.get(origin, {}), self._work.get(origin, {})):
            missed = [
                rid
                for rid, seq in held.items()
                if seq < listed.seq and rid not in listed.ids and part_of(rid, listed.parts) == listed.part
            ]
            gone.append(missed)
        in_ledgers, in_work = gone
        before = self._counted(origin, {*in_ledgers, *in_work})
        for rid in in_ledgers:
            del self._ledgers[origin][rid]
        for rid in in_work:
            del self._work[origin][rid]
        self.count -= before - self._counted(origin, {*in_ledgers, *in_work})
        return in_ledgers, in_work

    def _counted(self, origin: str, ids: set[str]) -> int:
        in_ledgers, in_work = self._ledgers.get(origin, {}), self._work.get(origin, {})
        return sum(rid in in_ledgers or rid in in_work for rid in ids)

    def forget(self, origin: str) -> tuple[set[str], set[str]]:
        """Let go of every request of `origin` (a replica gone): those (in the ledgers, in the tracker)."""
        in_ledgers, in_work = set(self._ledgers.pop(origin, {})), set(self._work.pop(origin, {}))
        self.count -= len(in_ledgers | in_work)
        return in_ledgers, in_work
