"""vLLM's Prometheus `/metrics` text → the endpoint state a router needs.

vLLM labels every series with `model_name` (and more); a server hosting one model has one series per metric,
so values are summed across label sets. KV usage is `vllm:kv_cache_usage_perc` since vLLM 0.10 and
`vllm:gpu_cache_usage_perc` before; both are fractions in [0, 1] despite the name. Prefix-cache hits are counted
in tokens by the counters `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (vLLM V1; called
`vllm:gpu_prefix_cache_queries_total` and `vllm:gpu_prefix_cache_hits_total` in earlier V1 releases); older servers
publish a hit-rate gauge, `vllm:gpu_prefix_cache_hit_rate`, instead. Both are optional, and so is the
cache's size (`vllm:cache_config_info`): a value of theirs that cannot be read (negative, NaN, a label that is not an
integer) is unknown, not a failed scrape. The queues and KV usage are required and checked strictly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from leadtime.features.errors import FeatureError
from leadtime.features.rows import MAX_COUNT, EndpointState

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
PREFIX_QUERIES_OLD = "vllm:gpu_prefix_cache_queries"
PREFIX_HITS_OLD = "vllm:gpu_prefix_cache_hits"
PREFIX_HIT_RATE_OLD = "vllm:gpu_prefix_cache_hit_rate"
READ = (
    WAITING,
    RUNNING,
    KV_USAGE,
    KV_USAGE_OLD,
    CACHE_CONFIG,
    PREFIX_QUERIES,
    PREFIX_HITS,
    PREFIX_QUERIES_OLD,
    PREFIX_HITS_OLD,
    PREFIX_HIT_RATE_OLD,
)
"""Every metric `parse_vllm_metrics` reads (a scraper may keep only their lines)."""

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
# The whole label set, written so that whitespace can be matched only one way (no backtracking blow-up).
_LABELS = re.compile(r'\s*(?:[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\]|\\.)*"\s*(?:,\s*)?)*')
_ESCAPE = re.compile(r"\\(.)")


@dataclass(frozen=True)
class VllmMetrics:
    """What a router reads off one vLLM endpoint's /metrics."""

    num_requests_waiting: int
    num_requests_running: int
    kv_cache_usage: float
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    prefix_cache_queries: float | None = None
    """Prompt tokens looked up in the prefix cache since the server started (a counter)."""
    prefix_cache_hits: float | None = None
    """Of those, tokens found cached (a counter)."""
    prefix_cache_hit_rate: float | None = None
    """Older servers' hit-rate gauge, in [0, 1]."""

    @property
    def kv_cache_tokens(self) -> int | None:
        """Tokens the endpoint's whole KV cache holds (`block_size × num_gpu_blocks` of `vllm:cache_config_info`), or
        None when it does not publish them: vLLM refuses a request longer than this, so a router offers it none."""
        if not self.block_size or not self.num_gpu_blocks:
            return None
        return min(self.block_size * self.num_gpu_blocks, MAX_COUNT)  # beyond, no count: it holds any request

    def endpoint_state(self, base: EndpointState | None = None) -> EndpointState:
        """`base` (the endpoint's identity, role, accelerator... from discovery) with this scrape's load."""
        return replace(
            base if base is not None else EndpointState(),
            num_request_waiting=self.num_requests_waiting,
            num_request_running=self.num_requests_running,
            kv_cache_percentage=self.kv_cache_usage,
        )


def parse_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition → {metric name: [(labels, value), ...]}; comments are skipped."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise FeatureError("metrics", f"line {lineno} is not a Prometheus sample: {line[:80]!r}")
        label_text = match.group("labels") or ""
        if not _LABELS.fullmatch(label_text):
            raise FeatureError(match.group("name"), f"line {lineno}: malformed labels {{{label_text[:80]}}}")
        labels = {key: _unescape(value) for key, value in _LABEL.findall(label_text)}
        try:
            value = float(match.group("value"))
        except ValueError:
            raise FeatureError(
                match.group("name"), f"line {lineno}: value {match.group('value')!r} is not a number"
            ) from None
        samples.setdefault(match.group("name"), []).append((labels, value))
    return samples


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    """A metric the router cannot do without, summed over its label sets; FeatureError naming it unless every value
    is finite and ≥ 0."""
    total = _total_or_unknown(samples, name)
    if total is None:
        bad = next((v for _, v in samples[name] if not (math.isfinite(v) and v >= 0)), math.inf)
        raise FeatureError(name, f"must be a finite value ≥ 0, got {bad!r}")
    return total


def _total_or_unknown(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float | None:
    """The metric summed over its label sets, or None (unknown) when a value is negative or not finite. An optional
    metric reads this way rather than failing the scrape: vLLM v0 with prefix caching off (its default) publishes
    a hit rate of -1, its allocator's "no rate"."""
    values = [v for _, v in samples[name]]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    total = math.fsum(values)
    return total if math.isfinite(total) else None


def _count_label(labels: dict[str, str], key: str) -> int | None:
    """An integer label of `vllm:cache_config_info`, or None (unknown) when absent or not an integer: early vLLM V1
    releases publish `num_gpu_blocks="None"` until they have profiled memory."""
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Parse one scrape; a missing or malformed metric raises FeatureError naming it."""
    samples = parse_samples(text)
    for name in (WAITING, RUNNING):
        if name not in samples:
            raise FeatureError(name, "missing from /metrics")
    kv_name = KV_USAGE if KV_USAGE in samples else KV_USAGE_OLD
    if kv_name not in samples:
        raise FeatureError(KV_USAGE, f"missing from /metrics (neither {KV_USAGE} nor {KV_USAGE_OLD})")
    kv = _total(samples, kv_name) / len(samples[kv_name])
    if kv > 1.0:
        raise FeatureError(kv_name, f"must be a fraction in [0, 1], got {kv:g}")
    block_size = num_blocks = None
    if CACHE_CONFIG in samples:
        labels = samples[CACHE_CONFIG][0][0]
        block_size, num_blocks = _count_label(labels, "block_size"), _count_label(labels, "num_gpu_blocks")
        if any(n is not None and not 0 <= n <= MAX_COUNT for n in (block_size, num_blocks)):  # 0: not known
            problem = f"block_size/num_gpu_blocks must be counts, got {block_size} and {num_blocks}"
            raise FeatureError(CACHE_CONFIG, problem)
    queries = _counter(samples, PREFIX_QUERIES, PREFIX_QUERIES_OLD)
    hits = _counter(samples, PREFIX_HITS, PREFIX_HITS_OLD)
    hit_rate = None
    hit_rate_total = _total_or_unknown(samples, PREFIX_HIT_RATE_OLD) if PREFIX_HIT_RATE_OLD in samples else None
    if hit_rate_total is not None:
        hit_rate = hit_rate_total / len(samples[PREFIX_HIT_RATE_OLD])
        if hit_rate > 1.0:
            raise FeatureError(PREFIX_HIT_RATE_OLD, f"must be a fraction in [0, 1], got {hit_rate:g}")
    return VllmMetrics(
        num_requests_waiting=round(_total(samples, WAITING)),
        num_requests_running=round(_total(samples, RUNNING)),
        kv_cache_usage=kv,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        prefix_cache_hit_rate=hit_rate,
    )


def _counter(samples: dict[str, list[tuple[dict[str, str], float]]], *names: str) -> float | None:
    """A counter published as `name_total` (Prometheus' convention) or plain `name`, under the first of `names` the
    scrape has (a newer name before the one it replaced); None when absent or unreadable."""
    for name in names:
        for key in (f"{name}_total", name):
            if key in samples:
                return _total_or_unknown(samples, key)
    return None
