"""`leadtime bench gateway`'s pieces that need no process: what its report says of the replicas' overhead."""

from __future__ import annotations

from leadtime.bench.gateway import replica_overhead

SILENT = {"sent": 0.0, "received": 0.0, "dropped": 0.0, "replicas_heard": 0.0}


def test_no_figure_for_replicas_that_never_heard_each_other() -> None:
    """The figure was filled though sent, received and replicas_heard were all 0: it measured a lone gateway."""
    warnings: list[str] = []
    assert replica_overhead([1.0, 2.0, 3.0], SILENT, warnings.append) is None
    assert len(warnings) == 1 and "no replica was heard" in warnings[0], warnings


def test_the_figure_of_replicas_that_heard_each_other() -> None:
    warnings: list[str] = []
    heard = {**SILENT, "sent": 10.0, "received": 10.0, "replicas_heard": 1.0}
    assert replica_overhead([1.0, 2.0, 3.0], heard, warnings.append) == {"p50": 2.0, "p99": 2.98}
    assert warnings == []
