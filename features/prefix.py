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

import numpy as np

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CHUNK_BYTES = 64
"""Bytes per prompt chunk when the router has no tokenizer: vLLM's 16-token block at ~4 bytes of text a token."""


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


MAX_TEXT_CHUNKS = 8192
_CHUNK_MIX = np.random.default_rng(0x1EAD71E).integers(1, 2**63, size=64, dtype=np.uint64) | np.uint64(1)
_CHUNK_POWERS = np.cumprod(np.full(MAX_TEXT_CHUNKS, 0x9E3779B97F4A7C15, dtype=np.uint64), dtype=np.uint64)
_CHUNK_POWERS.setflags(write=False)


def text_chunk_hashes(
    text: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, seed: str = "", max_chunks: int = MAX_TEXT_CHUNKS
) -> list[int]:
    """Prefix hashes of the full `chunk_bytes`-byte chunks of `text`'s UTF-8 bytes, for a router without a
    tokenizer (`chunk_hashes`).

    >>> a = text_chunk_hashes("x" * 64 + "y" * 64 + "tail", 64)
    >>> b = text_chunk_hashes("x" * 64 + "z" * 64, 64)
    >>> len(a), a[0] == b[0], a[1] == b[1]
    (2, True, False)
    """
    return chunk_hashes(text.encode(), chunk_bytes, seed, max_chunks)


def chunk_hashes(
    data: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES, seed: str = "", max_chunks: int = MAX_TEXT_CHUNKS
) -> list[int]:
    """Prefix hashes of the full `chunk_bytes`-byte chunks of `data` (a prompt's text or its packed token ids).

    Hash i identifies the whole prompt up to the end of chunk i (and the `seed`, the model name: different models
    share no cache), so equal hashes mean equal bytes from the start, as chained block hashes do; a trailing
    partial chunk is not hashed, and at most `max_chunks` are (prompts equal that far are then indistinguishable).
    Each chunk is mixed into 64 bits and the prefix hash is a polynomial sum of the chunks' mixes, computed for
    all chunks at once with numpy: a routing hint, fast, not a cryptographic identity.

    >>> len(chunk_hashes(bytes(range(256)) * 2, 64))
    8
    """
    if chunk_bytes < 8 or chunk_bytes % 8 or chunk_bytes > 8 * len(_CHUNK_MIX):
        raise ValueError(f"chunk_bytes must be a multiple of 8 between 8 and {8 * len(_CHUNK_MIX)}, got {chunk_bytes}")
    n = min(len(data) // chunk_bytes, max_chunks, MAX_TEXT_CHUNKS)
    if n <= 0:
        return []
    words = np.frombuffer(data, dtype="<u8", count=n * chunk_bytes // 8).reshape(n, chunk_bytes // 8)
    mixed = (words * _CHUNK_MIX[: chunk_bytes // 8]).sum(axis=1, dtype=np.uint64)
    mixed ^= mixed >> np.uint64(31)
    mixed *= np.uint64(0xBF58476D1CE4E5B9)
    mixed ^= mixed >> np.uint64(29)
    start = np.uint64(int.from_bytes(hashlib.blake2b(seed.encode(), digest_size=8).digest(), "big"))
    prefix = np.cumsum(mixed * _CHUNK_POWERS[:n], dtype=np.uint64) + start
    hashes: list[int] = prefix.tolist()
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
        self._capacity: dict[str, int] = {}

    def set_capacity(self, endpoint_id: str, capacity_blocks: int) -> None:
        """Bound one endpoint's blocks differently (e.g. to the size of its own KV cache)."""
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be ≥ 1")
        self._capacity[endpoint_id] = capacity_blocks
        blocks = self._blocks.get(endpoint_id)
        while blocks and len(blocks) > capacity_blocks:
            blocks.popitem(last=False)

    def record(self, endpoint_id: str, hashes: Iterable[int]) -> None:
        """Remember that `endpoint_id` now holds these blocks (most recent use).

        Blocks are touched last to first, so that the request's head is the most recent: under pressure the
        tail goes first (as in vLLM), and what stays is still a usable prefix.
        """
        blocks = self._blocks.setdefault(endpoint_id, OrderedDict())
        for h in reversed(list(hashes)):
            blocks[h] = None
            blocks.move_to_end(h)
        capacity = self._capacity.get(endpoint_id, self.capacity_blocks)
        while len(blocks) > capacity:
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

    def longest_prefix(self, endpoint_id: str, hashes: Sequence[int]) -> int:
        """`matched_blocks` by bisection, in O(log n) lookups.

        Exact for chained hashes recorded with `record`: a request's blocks are touched head last, so a block's
        predecessors are always more recent than it and leave the index after it; whenever block i is held, so
        is every block before it.

        >>> index = PrefixIndex()
        >>> index.record("e", [1, 2, 3, 4])
        >>> index.longest_prefix("e", [1, 2, 3, 9, 10]), index.matched_blocks("e", [1, 2, 3, 9, 10])
        (3, 3)
        """
        blocks = self._blocks.get(endpoint_id)
        if not blocks or not hashes or hashes[0] not in blocks:
            return 0
        low, high = 1, len(hashes)  # hashes[:low] are held; hashes[high:] are not known to be
        while low < high:
            mid = (low + high + 1) // 2
            if hashes[mid - 1] in blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def matched_tokens(self, endpoint_id: str, hashes: Sequence[int], input_tokens: int) -> int:
        """Leading tokens of a request of `input_tokens` tokens cached on the endpoint."""
        return min(self.matched_blocks(endpoint_id, hashes) * self.block_size, input_tokens)

    def forget(self, endpoint_id: str) -> None:
        """Drop an endpoint's blocks and its bound (it restarted, a time-slice swap cleared its cache, or it left:
        pod names change at every rollout). A router sets the bound again from the endpoint's next scrape."""
        self._blocks.pop(endpoint_id, None)
        self._capacity.pop(endpoint_id, None)

    def endpoints(self) -> list[str]:
        """Endpoints the index holds blocks for (to drop those that left the fleet)."""
        return list(self._blocks)

    def size(self, endpoint_id: str) -> int:
        """Blocks the index holds for an endpoint."""
        return len(self._blocks.get(endpoint_id, ()))
