"""Prefix blocks: vLLM-style chained block hashes and a bounded per-endpoint index of cached prefixes.

vLLM caches KV in fixed-size token blocks and identifies a block by a hash of its tokens chained with the hash
of the block before it, so equal hashes mean equal prefixes up to that block. A router cannot see vLLM's
cache; it approximates it by remembering which blocks it sent where (llm-d's approximate prefix scorer does
the same).
"""

from __future__ import annotations

import hashlib
import numbers
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

DEFAULT_BLOCK_SIZE = 16


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block is not cacheable)."""
    if block_size < 1:
        raise ValueError(f"block_size must be ≥ 1, got {block_size}")
    hashes: list[int] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.blake2b(parent, digest_size=8)
        digest.update(b",".join(str(int(t)).encode() for t in block))
        parent = digest.digest()
        hashes.append(int.from_bytes(parent, "big"))
    return hashes


def chain_block_ids(block_ids: Sequence[Hashable]) -> list[int]:
    """Chained hashes for precomputed block ids (e.g. the Mooncake trace's `hash_ids`).

    Mooncake already gives equal ids to equal prefix blocks; chaining makes a block's identity depend on the
    whole prefix before it, as in vLLM, so that a shared id after a different prefix is not a hit.
    """
    hashes: list[int] = []
    parent = b""
    for block in block_ids:
        digest = hashlib.blake2b(parent, digest_size=8)
        # numpy integers repr as "np.int64(5)"; normalise so ids read through numpy hash like plain ints.
        ident = int(block) if isinstance(block, numbers.Integral) and not isinstance(block, bool) else block
        digest.update(repr(ident).encode())
        parent = digest.digest()
        hashes.append(int.from_bytes(parent, "big"))
    return hashes


class PrefixIndex:
    """Which chained blocks each endpoint probably holds, bounded to `capacity_blocks` per endpoint (LRU).

    Parameters
    ----------
    block_size
        Tokens per block, to turn matched blocks into matched tokens.
    capacity_blocks
        Most blocks remembered per endpoint; the least recently used are forgotten first.
    """

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, capacity_blocks: int = 100_000) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be ≥ 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def record(self, endpoint_id: str, hashes: Iterable[int]) -> None:
        """Remember that `endpoint_id` now holds these blocks (most recent use).

        Blocks are touched last to first, so that the request's head is the most recent: under pressure the
        tail goes first (as in vLLM), and what stays is still a usable prefix.
        """
        blocks = self._blocks.setdefault(endpoint_id, OrderedDict())
        for h in reversed(list(hashes)):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def matched_blocks(self, endpoint_id: str, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` held by the endpoint (stops at the first miss, as a prefix must)."""
        blocks = self._blocks.get(endpoint_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def matched_tokens(self, endpoint_id: str, hashes: Sequence[int], input_tokens: int) -> int:
        """Leading tokens of a request of `input_tokens` tokens cached on the endpoint."""
        return min(self.matched_blocks(endpoint_id, hashes) * self.block_size, input_tokens)

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint's blocks (it restarted, or a time-slice swap cleared its cache)."""
        self._blocks.pop(endpoint_id, None)

    def size(self, endpoint_id: str) -> int:
        """Blocks the index holds for an endpoint."""
        return len(self._blocks.get(endpoint_id, ()))
