"""A replica's KV cache: fixed-size blocks, prefix caching with reference counts, LRU eviction.

Blocks come in two kinds. Private blocks belong to one request (its uncached prompt tail and its output) and are
only counted. Prefix entries hold the KV of one prefix segment (a run of whole blocks named by a chained hash,
the granularity at which the workload says which prompts share a prefix); they are shared by reference count
and, once no request references them, kept in LRU order until space is needed. This mirrors vLLM's block
manager at the granularity the traces provide, at a fraction of the bookkeeping.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class PrefixEntry:
    """A cached prefix block group: its size, its users and when it was cached."""

    blocks: int
    refs: int
    cached_at_ms: float


class KVCache:
    """Block accounting for one replica.

    Parameters
    ----------
    total_blocks
        Blocks that fit in the memory left after the weights.
    block_size
        Tokens per block.
    """

    def __init__(self, total_blocks: int, block_size: int) -> None:
        if total_blocks < 1 or block_size < 1:
            raise ValueError("total_blocks and block_size must be ≥ 1")
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.private_blocks = 0
        self.prefix_blocks = 0
        self.evictable_blocks = 0
        self.entries: dict[int, PrefixEntry] = {}
        self._unreferenced: OrderedDict[int, None] = OrderedDict()

    def clone(self) -> KVCache:
        """An independent copy (for forking an endpoint's state)."""
        other = KVCache(self.total_blocks, self.block_size)
        other.private_blocks = self.private_blocks
        other.prefix_blocks = self.prefix_blocks
        other.evictable_blocks = self.evictable_blocks
        other.entries = {h: PrefixEntry(e.blocks, e.refs, e.cached_at_ms) for h, e in self.entries.items()}
        other._unreferenced = OrderedDict(self._unreferenced)
        return other

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests and by cached prefixes."""
        return self.private_blocks + self.prefix_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks nobody holds."""
        return self.total_blocks - self.used_blocks

    def usage(self) -> float:
        """Share of blocks held by running requests (unreferenced cached prefixes count as free, as in vLLM)."""
        held = self.used_blocks - self.evictable_blocks
        return min(1.0, max(0.0, held / self.total_blocks))

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache holds: what the endpoint publishes (`vllm:cache_config_info`) for a router to
        know which requests it can ever take."""
        return self.total_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks `tokens` tokens take."""
        return -(-tokens // self.block_size)

    def matched_prefix(self, hashes: tuple[int, ...] | list[int], visible_before_ms: float | None = None) -> int:
        """Leading segments of `hashes` present (and, if given, cached no later than `visible_before_ms`)."""
        n = 0
        for h in hashes:
            entry = self.entries.get(h)
            if entry is None or (visible_before_ms is not None and entry.cached_at_ms > visible_before_ms):
                break
            n += 1
        return n

    def acquire_prefix(self, hashes: tuple[int, ...] | list[int]) -> None:
        """Reference cached segments (a request starts using them)."""
        for h in hashes:
            entry = self.entries[h]
            if entry.refs == 0:
                del self._unreferenced[h]
                self.evictable_blocks -= entry.blocks
            entry.refs += 1

    def release_prefix(self, hashes: tuple[int, ...] | list[int]) -> None:
        """Drop references; unreferenced segments stay cached, most recently used last."""
        for h in hashes:
            entry = self.entries[h]
            entry.refs -= 1
            if entry.refs == 0:
                self._unreferenced[h] = None
                self.evictable_blocks += entry.blocks

    def make_room(self, blocks: int) -> bool:
        """Evict least recently used unreferenced segments until `blocks` are free; False if impossible."""
        while self.free_blocks < blocks and self._unreferenced:
            h, _ = self._unreferenced.popitem(last=False)
            evicted = self.entries.pop(h).blocks
            self.prefix_blocks -= evicted
            self.evictable_blocks -= evicted
        return self.free_blocks >= blocks

    def can_allocate(self, blocks: int) -> bool:
        """Whether `blocks` blocks can be had, evicting unused prefixes if needed."""
        return self.free_blocks + self.evictable_blocks >= blocks

    def allocate(self, blocks: int) -> bool:
        """Take `blocks` private blocks, evicting if needed; False (and nothing taken) if they do not fit."""
        if blocks <= 0:
            return True
        if not self.can_allocate(blocks) or not self.make_room(blocks):
            return False
        self.private_blocks += blocks
        return True

    def free(self, blocks: int) -> None:
        """Release blocks a request held privately."""
        if blocks > self.private_blocks:
            raise AssertionError(f"freeing {blocks} private blocks, only {self.private_blocks} held")
        self.private_blocks -= blocks

    def publish_prefix(self, hashes: list[int], blocks_per_segment: int, now_ms: float) -> list[int]:
        """Turn a request's private blocks for fully computed segments into shared entries it references.

        Returns the hashes the request now references. A segment someone else already cached is referenced
        instead and the request's duplicate blocks are freed.
        """
        for h in hashes:
            self.private_blocks -= blocks_per_segment
            entry = self.entries.get(h)
            if entry is None:
                self.entries[h] = PrefixEntry(blocks_per_segment, 1, now_ms)
                self.prefix_blocks += blocks_per_segment
            else:
                if entry.refs == 0:
                    del self._unreferenced[h]
                    self.evictable_blocks -= entry.blocks
                entry.refs += 1
        return hashes

    def clear_unreferenced(self) -> None:
        """Forget every cached segment no request holds (a time-slice swap wiped the cache)."""
        for h in list(self._unreferenced):
            self.prefix_blocks -= self.entries.pop(h).blocks
        self._unreferenced.clear()
        self.evictable_blocks = 0

    def fork(self) -> KVCache:
        """A what-if copy that shares this cache's entries until it changes them (this cache must not change
        while the fork is in use): cheap where `clone` copies every entry."""
        return ForkedKVCache(self)


class ForkedKVCache(KVCache):
    """Copy-on-write view of a `KVCache` for what-if runs (the clairvoyant policy forks every candidate).

    Entries it touches are copied into `_own`; entries it evicts are in `_gone`. Its LRU order of unreferenced
    entries is the base's (skipping those referenced, moved or evicted here) followed by `_tail`, the entries
    that became unreferenced in the fork, oldest first.
    """

    def __init__(self, base: KVCache) -> None:
        super().__init__(base.total_blocks, base.block_size)
        self.private_blocks = base.private_blocks
        self.prefix_blocks = base.prefix_blocks
        self.evictable_blocks = base.evictable_blocks
        self._base = base
        self._base_entries = base.entries
        self._base_order = iter(base._unreferenced)
        self._own: dict[int, PrefixEntry] = {}
        self._gone: set[int] = set()
        self._tail: OrderedDict[int, None] = OrderedDict()

    def _peek(self, h: int) -> PrefixEntry | None:
        entry = self._own.get(h)
        if entry is not None:
            return entry
        if h in self._gone:
            return None
        return self._base_entries.get(h)

    def _mutable(self, h: int) -> PrefixEntry:
        entry = self._own.get(h)
        if entry is None:
            base = self._base_entries[h]
            entry = self._own[h] = PrefixEntry(base.blocks, base.refs, base.cached_at_ms)
        return entry

    def clone(self) -> KVCache:
        other = KVCache(self.total_blocks, self.block_size)
        other.private_blocks = self.private_blocks
        other.prefix_blocks = self.prefix_blocks
        other.evictable_blocks = self.evictable_blocks
        keys = [h for h in self._base_entries if h not in self._gone and h not in self._own] + list(self._own)
        other.entries = {h: PrefixEntry(e.blocks, e.refs, e.cached_at_ms) for h in keys if (e := self._peek(h))}
        order = [h for h in self._base._unreferenced if self._still_base_unreferenced(h)]
        other._unreferenced = OrderedDict.fromkeys([*order, *self._tail])
        return other

    def _still_base_unreferenced(self, h: int) -> bool:
        """A base LRU entry that is still unreferenced here and still in its base position."""
        if h in self._gone or h in self._tail:
            return False
        entry = self._own.get(h)
        return entry is None or entry.refs == 0

    def _next_base_unreferenced(self) -> int | None:
        """The oldest base entry still unreferenced in the fork (advancing past stale ones); None when done."""
        for h in self._base_order:
            if self._still_base_unreferenced(h):
                return h
        return None

    def matched_prefix(self, hashes: tuple[int, ...] | list[int], visible_before_ms: float | None = None) -> int:
        n = 0
        for h in hashes:
            entry = self._peek(h)
            if entry is None or (visible_before_ms is not None and entry.cached_at_ms > visible_before_ms):
                break
            n += 1
        return n

    def acquire_prefix(self, hashes: tuple[int, ...] | list[int]) -> None:
        for h in hashes:
            entry = self._mutable(h)
            if entry.refs == 0:
                self._tail.pop(h, None)
                self.evictable_blocks -= entry.blocks
            entry.refs += 1

    def release_prefix(self, hashes: tuple[int, ...] | list[int]) -> None:
        for h in hashes:
            entry = self._mutable(h)
            entry.refs -= 1
            if entry.refs == 0:
                self._tail[h] = None
                self.evictable_blocks += entry.blocks

    def make_room(self, blocks: int) -> bool:
        while self.free_blocks < blocks:
            h = self._next_base_unreferenced()
            if h is None:
                if not self._tail:
                    break
                h, _ = self._tail.popitem(last=False)
            entry = self._peek(h)
            assert entry is not None
            self._own.pop(h, None)
            self._gone.add(h)
            self.prefix_blocks -= entry.blocks
            self.evictable_blocks -= entry.blocks
        return self.free_blocks >= blocks

    def publish_prefix(self, hashes: list[int], blocks_per_segment: int, now_ms: float) -> list[int]:
        for h in hashes:
            self.private_blocks -= blocks_per_segment
            if self._peek(h) is None:
                self._own[h] = PrefixEntry(blocks_per_segment, 1, now_ms)
                self._gone.discard(h)
                self.prefix_blocks += blocks_per_segment
            else:
                entry = self._mutable(h)
                if entry.refs == 0:
                    self._tail.pop(h, None)
                    self.evictable_blocks -= entry.blocks
                entry.refs += 1
        return hashes

    def clear_unreferenced(self) -> None:
        while (h := self._next_base_unreferenced()) is not None:
            self._evict(h)
        for h in list(self._tail):
            self._evict(h)
        self._tail.clear()
        self.evictable_blocks = 0

    def _evict(self, h: int) -> None:
        entry = self._peek(h)
        assert entry is not None
        self._own.pop(h, None)
        self._gone.add(h)
        self.prefix_blocks -= entry.blocks
