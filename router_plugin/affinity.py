"""Prefix affinity without a tokenizer, as llm-d's approximate prefix scorer does it.

The router cannot see an endpoint's cache and has no tokenizer; it remembers which prompts it sent where. A
prompt is cut into fixed-size chunks of its UTF-8 text (64 bytes: vLLM's 16-token block at ~4 bytes a token),
each identified by a hash of everything up to its end (`features.prefix.text_chunk_hashes`); an index per
endpoint holds the chunks routed there, least recently used forgotten first, bounded to about what the
endpoint's KV cache holds (its `vllm:cache_config_info`, converted to chunks). A request's hit on an endpoint is
the leading chunks that endpoint holds, turned into tokens with the bytes-per-token ratio; the same ratio
estimates the prompt's length in tokens.

The ratio is learned: every response that reports `usage.prompt_tokens` (non-streaming ones always do, streams
when the client asks `stream_options.include_usage`) adds its prompt's bytes and tokens to running sums that
slowly forget. Prompts given as token ids need no estimate: their length is exact, and they are hashed as
4-byte ids, 16 to a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from leadtime.features.prefix import DEFAULT_CHUNK_BYTES, PrefixIndex, chunk_hashes, text_chunk_hashes

DEFAULT_BYTES_PER_TOKEN = 4.0
DEFAULT_CAPACITY_CHUNKS = 31_250
"""Per endpoint until its cache size is scraped: ~500k tokens, an 8B model's cache on an 80 GB accelerator."""


@dataclass(frozen=True)
class PromptKey:
    """What the router derives from one prompt."""

    hashes: list[int]
    input_tokens: int
    prompt_bytes: int
    bytes_per_token: float
    """The ratio this prompt's hit lengths are converted with (exact for token ids)."""


class PrefixAffinity:
    """Per-endpoint index of routed prompt chunks, and the tokens a new prompt would find cached on each.

    Parameters
    ----------
    chunk_bytes
        Bytes of UTF-8 text per chunk (a multiple of 8).
    capacity_chunks
        Chunks remembered per endpoint until its cache size is known.
    bytes_per_token
        Prior for the text-to-tokens ratio, until responses report prompt lengths.
    memory_tokens
        How many reported prompt tokens the learned ratio remembers (older ones fade out).

    >>> affinity = PrefixAffinity()
    >>> key = affinity.key("a shared system prompt " * 20 + "then a question", model="m")
    >>> affinity.record("e1", key)
    >>> other = affinity.key("a shared system prompt " * 20 + "and another one", model="m")
    >>> affinity.hit_tokens("e1", other), affinity.hit_tokens("e2", other)
    (112, 0)
    """

    def __init__(
        self,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        capacity_chunks: int = DEFAULT_CAPACITY_CHUNKS,
        bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN,
        memory_tokens: float = 2_000_000.0,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.index = PrefixIndex(block_size=1, capacity_blocks=capacity_chunks)
        self.memory_tokens = memory_tokens
        self._bytes = bytes_per_token * 1000.0  # the prior weighs as much as 1,000 tokens
        self._tokens = 1000.0

    @property
    def bytes_per_token(self) -> float:
        return self._bytes / self._tokens

    def key(self, text: str, model: str = "") -> PromptKey:
        """Hashes and estimated length of a text prompt."""
        size = len(text.encode())
        ratio = self.bytes_per_token
        hashes = text_chunk_hashes(text, self.chunk_bytes, seed=model)
        return PromptKey(hashes, max(1, round(size / ratio)), size, ratio)

    def key_for_ids(self, token_ids: Sequence[int], model: str = "") -> PromptKey:
        """Hashes and exact length of a prompt given as token ids."""
        # Raw bytes: a chunk of `chunk_bytes` holds exactly `chunk_bytes / 4` ids, as `hit_tokens` counts them.
        hashes = chunk_hashes(np.asarray(token_ids, dtype="<i4").tobytes(), self.chunk_bytes, seed=model)
        return PromptKey(hashes, max(1, len(token_ids)), 0, 4.0)

    def hit_tokens(self, endpoint_id: str, key: PromptKey) -> int:
        """Estimated leading tokens of the prompt cached on the endpoint."""
        chunks = self.index.longest_prefix(endpoint_id, key.hashes)
        if not chunks:
            return 0
        return min(round(chunks * self.chunk_bytes / key.bytes_per_token), key.input_tokens)

    def record(self, endpoint_id: str, key: PromptKey) -> None:
        """The prompt was sent to the endpoint: it will hold these chunks."""
        if key.hashes:
            self.index.record(endpoint_id, key.hashes)

    def learn_length(self, prompt_bytes: int, prompt_tokens: int) -> None:
        """A response reported the prompt's length in tokens."""
        if prompt_bytes <= 0 or prompt_tokens <= 0:
            return
        keep = max(0.0, 1.0 - prompt_tokens / self.memory_tokens)
        self._bytes = self._bytes * keep + prompt_bytes
        self._tokens = self._tokens * keep + prompt_tokens

    def set_cache_tokens(self, endpoint_id: str, tokens: int) -> None:
        """Bound the endpoint's index to about what its KV cache holds."""
        chunks = int(tokens * self.bytes_per_token / self.chunk_bytes)
        if chunks >= 1:
            self.index.set_capacity(endpoint_id, chunks)

    def forget(self, endpoint_id: str) -> None:
        """The endpoint's cache was lost (restart, time-slice swap), or the endpoint left the fleet."""
        self.index.forget(endpoint_id)
