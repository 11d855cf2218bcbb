"""The retraining job's time order: the rows' timestamps are used only where they agree with arrival order."""

from __future__ import annotations

import numpy as np

from leadtime.training.split import (
    AGREEMENT_S,
    BY_ARRIVAL_MERGED,
    BY_READ_ORDER,
    BY_TIMESTAMP,
    evaluation_overlap_s,
    split_recent,
)

NOW = 1_796_459_931.0


def test_a_router_whose_clock_runs_ahead_does_not_supply_the_evaluation_slice() -> None:
    """Regression: 900 rows from a router with a right clock and 100 from one an hour ahead, interleaved as they
    arrived in one stream: sorted by timestamp, the evaluation slice was all of the second router's rows."""
    stamps = np.array([NOW - 1_000 + i + (3_600 if i % 10 == 0 else 0) for i in range(1_000)], dtype=float)
    split = split_recent(stamps, 0.1, now=NOW + 3_600, streams=[True])
    assert split.basis == BY_READ_ORDER and "back" in split.reason, split.reason
    assert split.evaluation.tolist() == list(range(900, 1_000))  # the most recent to arrive
    assert int(np.sum(split.evaluation % 10 == 0)) == 10


def test_a_timestamp_far_in_the_future_does_not_land_in_the_evaluation_slice() -> None:
    stamps = np.array([NOW - 1_000 + i for i in range(1_000)], dtype=float)
    stamps[3] = 253_370_764_800.0  # 9999-12-31
    split = split_recent(stamps, 0.1, now=NOW)
    assert 3 in split.history and split.evaluation.tolist() == list(range(900, 1_000))
    assert split.basis == BY_READ_ORDER and "ahead" in split.reason, split.reason
    # Only an hour ahead, as the last row to arrive: still not a time any row can have been received at yet.
    stamps = np.array([NOW - 1_000 + i for i in range(1_000)], dtype=float)
    stamps[-1] = NOW + 3_600
    assert split_recent(stamps, 0.1, now=NOW).basis == BY_READ_ORDER


def test_timestamps_that_agree_with_arrival_interleave_sources_and_keep_each_sources_order() -> None:
    """Two files, each in the order it received its rows: merged by time. Within a source, rows a few seconds out
    of order (clocks a little apart, requests of different lengths) keep the order they arrived in."""
    a = NOW - 100 + np.array([0.0, 2.0, 1.0, 4.0, 6.0])  # its third row is stamped 1 s before the second
    b = NOW - 100 + np.array([3.0, 5.0, 7.0])
    stamps = np.concatenate([a, b])
    source = np.array([0] * 5 + [1] * 3)
    split = split_recent(stamps, 0.25, source=source, now=NOW)
    assert split.basis == BY_ARRIVAL_MERGED and split.reason == ""
    assert np.concatenate([split.history, split.evaluation]).tolist() == [0, 1, 2, 5, 3, 6, 4, 7]
    assert split.evaluation.tolist() == [4, 7]


def test_a_source_whose_timestamps_go_back_is_named() -> None:
    stamps = np.array([NOW - 10_000.0, NOW - 9_000.0, NOW - 5.0, NOW - 20_000.0])
    source = np.array([0, 0, 1, 1])
    split = split_recent(stamps, 0.25, source=source, names=["a.jsonl", "b.jsonl"], now=NOW)
    assert split.basis == BY_READ_ORDER
    assert "b.jsonl" in split.reason and "19995 s" in split.reason, split.reason


def test_one_file_written_newest_first_is_judged_on_its_newest_rows() -> None:
    """Regression: a file whose timestamps strictly decrease (an export written newest first) went back more than
    the tolerance against its line order, fell back to read order, and was judged on its oldest rows. One source
    is one clock: its rows are put in timestamp order, however the file lists them."""
    stamps = NOW - np.arange(1_000, dtype=float)  # line 0 is the newest
    split = split_recent(stamps, 0.1, now=NOW)
    assert split.basis == BY_TIMESTAMP and split.reason == ""
    assert sorted(split.evaluation.tolist()) == list(range(100))
    assert evaluation_overlap_s(stamps, split) is None


def test_one_shuffled_file_is_put_in_timestamp_order_ties_kept_in_line_order() -> None:
    rng = np.random.default_rng(0)
    stamps = NOW - 2_000 + rng.permutation(1_000).astype(float) * 2
    stamps[[10, 20]] = stamps[30]  # a tie: kept in the order the lines came in
    split = split_recent(stamps, 0.2, now=NOW)
    ordered = np.concatenate([split.history, split.evaluation])
    assert split.basis == BY_TIMESTAMP and np.all(np.diff(stamps[ordered]) >= 0)
    tied = [i for i in ordered.tolist() if i in (10, 20, 30)]
    assert tied == [10, 20, 30]


def test_a_stream_keeps_its_arrival_order_and_an_evaluation_slice_behind_the_history_is_measured() -> None:
    """The Redis stream's order is the one Redis took its rows in: a router stamping an hour ahead does not make
    its rows the most recent. The evaluation slice then starts before the history's latest timestamp, which is
    measured (the job warns of it)."""
    stamps = np.array([NOW - 1_000 + i + (3_600 if i % 10 == 0 else 0) for i in range(1_000)], dtype=float)
    split = split_recent(stamps, 0.1, now=NOW + 3_600, streams=[True])
    assert split.basis == BY_READ_ORDER and split.evaluation.tolist() == list(range(900, 1_000))
    overlap = evaluation_overlap_s(stamps, split)
    assert overlap is not None and overlap > AGREEMENT_S


def test_the_order_says_what_was_done_with_timestamps_a_little_behind_their_line_order() -> None:
    """Regression: one source whose last 600 rows were stamped 200 s back (within the tolerance) was reported as
    ordered by "timestamp" while its evaluation slice started 200 s before the history's latest timestamp. One file
    is now sorted by its timestamps; several sources keep each its arrival order, and the order says so."""
    stamps = NOW - 3_000 + np.arange(3_000, dtype=float) * 0.27
    stamps[-600:] -= 200.0
    one = split_recent(stamps, 0.2, now=NOW)
    assert one.basis == BY_TIMESTAMP
    assert stamps[one.evaluation].min() >= stamps[one.history].max()
    two = split_recent(stamps, 0.2, source=np.repeat([0, 1], [1_500, 1_500]), now=NOW)
    assert two.basis == BY_ARRIVAL_MERGED and two.basis != BY_TIMESTAMP
    assert evaluation_overlap_s(stamps, two) is None  # within the tolerance: no warning
