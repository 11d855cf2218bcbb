"""One llm-d prediction row, as the service tests send it (the six fields llm-d's router always fills)."""

from __future__ import annotations

from typing import Any

LLMD_ROW: dict[str, Any] = {
    "kv_cache_percentage": 0.3,
    "input_token_length": 800,
    "num_request_waiting": 2,
    "num_request_running": 8,
    "num_tokens_generated": 0,
    "prefix_cache_score": 0.25,
}


def llmd_row(**overrides: Any) -> dict[str, Any]:
    """`LLMD_ROW` with some fields changed (a fresh dict each call)."""
    return {**LLMD_ROW, **overrides}
