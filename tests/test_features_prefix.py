"""Chained prefix-block hashing and the bounded per-endpoint prefix index."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leadtime.data import TRACES
from leadtime.features.prefix import (
    DEFAULT_BLOCK_SIZE,
    PrefixIndex,
    block_hashes,
    chain_block_ids,
    chunk_hashes,
    text_chunk_hashes,
)

MOONCAKE = TRACES["mooncake"]

token_lists = st.lists(st.integers(min_value=0, max_value=200_000), max_size=200)
block_sizes = st.integers(min_value=1, max_value=32)


# ------------------------------------------------------------------------------ block hashes


def test_text_chunk_hashes_stay_as_they_were_when_bytes_are_hashed_too() -> None:
    """Regression: token-id prompts moved to hashing raw bytes; a text prompt must hash as it always did (its
    UTF-8 bytes), or routers of two versions, and the indices they hold, would stop agreeing on a prefix."""
    text = "The same text hashes as it always has: é, ü, 日本語. " * 4
    pinned = [18188593251860164873, 10604170691556810512, 15132525343027277744]
    assert text_chunk_hashes(text, 64, seed="llama-3.1-8b") == pinned
    assert chunk_hashes(text.encode(), 64, seed="llama-3.1-8b") == pinned
    assert text_chunk_hashes("x" * 64, 64) == [12326148225899575614]


def test_default_block_size_is_vllms() -> None:
    assert DEFAULT_BLOCK_SIZE == 16
    assert len(block_hashes(list(range(64)))) == 4


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes(list(range(15))) == []
    assert len(block_hashes(list(range(31)))) == 1
    assert block_hashes(list(range(31)))[0] == block_hashes(list(range(16)))[0]


def test_hashes_are_stable_across_processes() -> None:
    """Routers on different hosts must agree, so the hash may not depend on Python's per-process seed."""
    assert block_hashes([1, 2, 3, 4], block_size=2) == block_hashes((1, 2, 3, 4), block_size=2)
    first = block_hashes([1, 2, 3, 4], block_size=2)
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first)
    assert first == [12576313801678898165, 18073177620372786572]


@pytest.mark.parametrize("size", [0, -16])
def test_block_size_must_be_positive(size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3], block_size=size)


@settings(max_examples=200, deadline=None)
@given(token_lists, block_sizes)
def test_hashing_is_deterministic_and_counts_full_blocks(tokens: list[int], size: int) -> None:
    hashes = block_hashes(tokens, size)
    assert hashes == block_hashes(list(tokens), size)
    assert len(hashes) == len(tokens) // size


@settings(max_examples=200, deadline=None)
@given(token_lists, token_lists, token_lists, block_sizes)
def test_equal_prefixes_give_equal_leading_hashes(
    prefix: list[int], tail_a: list[int], tail_b: list[int], size: int
) -> None:
    shared = len(prefix) // size
    a, b = block_hashes(prefix + tail_a, size), block_hashes(prefix + tail_b, size)
    assert a[:shared] == b[:shared]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 200_000), min_size=1, max_size=200), block_sizes, st.data())
def test_a_changed_token_changes_its_block_and_every_later_one(
    tokens: list[int], size: int, data: st.DataObject
) -> None:
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = data.draw(st.integers(0, 200_000).filter(lambda t: t != tokens[position]))
    before, after = block_hashes(tokens, size), block_hashes(changed, size)
    block = position // size
    assert before[:block] == after[:block]
    for i in range(block, len(before)):
        assert before[i] != after[i]


def test_identical_blocks_after_different_prefixes_differ() -> None:
    a = block_hashes([1] * 16 + [7] * 16)
    b = block_hashes([2] * 16 + [7] * 16)
    assert a[1] != b[1]


def test_token_boundaries_matter() -> None:
    """[1, 23] and [12, 3] must not collide (tokens are separated, not concatenated)."""
    assert block_hashes([1, 23], block_size=2) != block_hashes([12, 3], block_size=2)


def test_numpy_token_arrays_hash_like_lists() -> None:
    tokens = list(range(100, 164))
    assert block_hashes(np.array(tokens, dtype=np.int32)) == block_hashes(tokens)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ precomputed ids


def test_chained_ids_depend_on_the_whole_prefix() -> None:
    assert chain_block_ids([0, 5])[1] != chain_block_ids([1, 5])[1]
    assert chain_block_ids([0, 5])[0] == chain_block_ids([0, 6])[0]
    assert chain_block_ids([]) == []


def test_numpy_ids_chain_like_python_ints() -> None:
    """hash_ids read through numpy or pandas must match the same ids read as plain ints."""
    ids = [0, 14, 15, 16]
    assert chain_block_ids(np.array(ids, dtype=np.int64)) == chain_block_ids(ids)  # type: ignore[arg-type]
    assert chain_block_ids([np.int32(i) for i in ids]) == chain_block_ids(ids)


def test_string_and_int_ids_stay_distinct() -> None:
    assert chain_block_ids(["1"]) != chain_block_ids([1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**9), max_size=60), st.lists(st.integers(0, 10**9), max_size=60))
def test_chained_ids_prefix_property(prefix: list[int], tail: list[int]) -> None:
    whole = chain_block_ids(prefix + tail)
    assert len(whole) == len(prefix) + len(tail)
    assert whole[: len(prefix)] == chain_block_ids(prefix)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=60), st.data())
def test_a_changed_id_changes_every_later_hash(ids: list[int], data: st.DataObject) -> None:
    position = data.draw(st.integers(0, len(ids) - 1))
    changed = list(ids)
    changed[position] = ids[position] + 1
    before, after = chain_block_ids(ids), chain_block_ids(changed)
    assert before[:position] == after[:position]
    assert all(b != a for b, a in zip(before[position:], after[position:], strict=True))


def test_mooncake_trace_prefix_hit_share_matches_the_published_figure() -> None:
    """The data README says ~37% of the conversation trace's input tokens are prefix hits with an unlimited
    cache; replaying the trace through chain_block_ids and one unbounded index must reproduce that."""
    index = PrefixIndex(block_size=512, capacity_blocks=10**9)
    hits = total = 0
    for line in MOONCAKE.read_text().splitlines():
        request = json.loads(line)
        hashes = chain_block_ids(request["hash_ids"])
        hits += index.matched_tokens("pod", hashes, request["input_length"])
        total += request["input_length"]
        index.record("pod", hashes)
    assert 0.35 < hits / total < 0.40


# ------------------------------------------------------------------------------ PrefixIndex


def test_matched_blocks_stop_at_the_first_miss() -> None:
    index = PrefixIndex(block_size=4)
    index.record("a", [1, 2, 3, 5])
    assert index.matched_blocks("a", [1, 2, 3, 4, 5]) == 3
    assert index.matched_blocks("a", [9, 1, 2]) == 0
    assert index.matched_blocks("a", []) == 0


def test_matched_tokens_are_blocks_times_size_capped_by_the_request() -> None:
    index = PrefixIndex(block_size=16)
    index.record("a", [1, 2, 3])
    assert index.matched_tokens("a", [1, 2, 3, 4], input_tokens=100) == 48
    assert index.matched_tokens("a", [1, 2, 3], input_tokens=40) == 40


def test_endpoints_are_separate_and_unknown_ones_hold_nothing() -> None:
    index = PrefixIndex()
    index.record("a", [1, 2])
    assert index.matched_blocks("b", [1, 2]) == 0
    assert index.size("b") == 0
    assert index.matched_blocks("nobody", [1]) == 0
    assert index.size("nobody") == 0  # asking does not create an entry


def test_forget_drops_one_endpoint() -> None:
    index = PrefixIndex()
    index.record("a", [1, 2])
    index.record("b", [1, 2])
    index.forget("a")
    index.forget("never-seen")
    assert index.matched_blocks("a", [1, 2]) == 0
    assert index.matched_blocks("b", [1, 2]) == 2


def test_forget_drops_the_endpoints_capacity_too() -> None:
    """Regression: forgetting an endpoint dropped its blocks but kept its capacity entry: with pod names changing at
    every rollout, the index grew for ever."""
    index = PrefixIndex(capacity_blocks=100)
    index.set_capacity("a", 2)
    index.record("a", [1, 2])
    index.forget("a")
    assert index._capacity == {} and index.endpoints() == []
    index.record("a", [1, 2, 3])  # back under the same name: the default bound until its own is set again
    assert index.size("a") == 3


def test_least_recently_recorded_blocks_are_forgotten_first() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks=4)
    index.record("a", [1, 2])
    index.record("a", [3, 4])
    index.record("a", [1, 2])  # refresh the first request
    index.record("a", [5])
    assert index.size("a") == 4
    assert index.matched_blocks("a", [1, 2]) == 2
    assert index.matched_blocks("a", [5]) == 1
    assert index.matched_blocks("a", [3, 4]) == 1  # the oldest request lost its tail, not its head


def test_a_request_longer_than_the_capacity_keeps_its_head() -> None:
    """A prefix cache is only useful from the first block on; the bound must drop tails, not heads."""
    index = PrefixIndex(block_size=1, capacity_blocks=4)
    index.record("a", range(10))
    assert index.size("a") == 4
    assert index.matched_blocks("a", list(range(10))) == 4


def test_eviction_prefers_the_tail_of_an_old_request_over_a_shared_head() -> None:
    index = PrefixIndex(block_size=1, capacity_blocks=5)
    index.record("a", [1, 2, 3])
    index.record("a", [1, 4, 5])  # shares block 1 with the first request
    index.record("a", [1, 4, 6])
    assert index.matched_blocks("a", [1, 4, 6]) == 3
    assert index.matched_blocks("a", [1, 4, 5]) == 3
    assert index.matched_blocks("a", [1, 2, 3]) == 2  # the oldest request lost its tail block only


@pytest.mark.parametrize(("block_size", "capacity"), [(0, 10), (16, 0), (-1, 5)])
def test_index_parameters_must_be_positive(block_size: int, capacity: int) -> None:
    with pytest.raises(ValueError):
        PrefixIndex(block_size=block_size, capacity_blocks=capacity)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 20),
    st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.lists(st.integers(0, 40), max_size=30)), max_size=30),
)
def test_index_never_exceeds_its_capacity(capacity: int, records: list[tuple[str, list[int]]]) -> None:
    index = PrefixIndex(block_size=1, capacity_blocks=capacity)
    seen: dict[str, set[int]] = {}
    for endpoint, hashes in records:
        index.record(endpoint, hashes)
        seen.setdefault(endpoint, set()).update(hashes)
        assert index.size(endpoint) == min(capacity, len(seen[endpoint]))
        # the most recent request is always found, as far as the capacity allows
        distinct = list(dict.fromkeys(hashes))
        if distinct == hashes:
            assert index.matched_blocks(endpoint, hashes) == min(len(hashes), capacity)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 15), max_size=8), max_size=10),
    st.lists(st.integers(0, 15), max_size=8),
)
def test_unbounded_index_matches_the_longest_recorded_prefix(recorded: list[list[int]], query: list[int]) -> None:
    """Fed chained hashes, the index answers exactly the longest common prefix with any recorded request."""
    index = PrefixIndex(block_size=1, capacity_blocks=10**6)
    for ids in recorded:
        index.record("e", chain_block_ids(ids))
    best = 0
    for ids in recorded:
        n = 0
        while n < min(len(ids), len(query)) and ids[n] == query[n]:
            n += 1
        best = max(best, n)
    assert index.matched_blocks("e", chain_block_ids(query)) == best
