"""vLLM /metrics text → endpoint state: current and old KV names, clear errors naming the metric."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leadtime.features.errors import FeatureError
from leadtime.features.rows import EndpointState
from leadtime.features.vllm_metrics import (
    CACHE_CONFIG,
    KV_USAGE,
    KV_USAGE_OLD,
    PREFIX_HIT_RATE_OLD,
    PREFIX_HITS,
    PREFIX_QUERIES,
    RUNNING,
    WAITING,
    VllmMetrics,
    parse_samples,
    parse_vllm_metrics,
)

MODEL = 'model_name="Qwen/Qwen3-32B"'

# Shaped like a vLLM ≥ 0.10 scrape (one engine): HELP/TYPE comments, histograms, process metrics, info gauge.
SCRAPE = f"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 1234.0
process_virtual_memory_bytes 1.2e+10
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.4375
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="20480",sliding_window="None"}} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",{MODEL}}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{MODEL}}} 523.0
vllm:time_to_first_token_seconds_sum{{engine="0",{MODEL}}} 61.5
vllm:prompt_tokens_total{{engine="0",{MODEL}}} 123456.0
"""

# Shaped like a vLLM 0.6–0.9 scrape: the KV gauge was called gpu_cache_usage_perc.
OLD_SCRAPE = f"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{MODEL}}} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{MODEL}}} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{{MODEL}}} 0.125
"""


def scrape(waiting: str = "3", running: str = "12", kv: str = "0.5", kv_name: str = KV_USAGE) -> str:
    return f"{WAITING}{{{MODEL}}} {waiting}\n{RUNNING}{{{MODEL}}} {running}\n{kv_name}{{{MODEL}}} {kv}\n"


def test_current_vllm_scrape() -> None:
    m = parse_vllm_metrics(SCRAPE)
    assert m == VllmMetrics(
        num_requests_waiting=3,
        num_requests_running=12,
        kv_cache_usage=0.4375,
        block_size=16,
        num_gpu_blocks=20480,
    )
    assert m.kv_cache_tokens == 327_680  # what the router checks a request's prompt against


@pytest.mark.parametrize(("blocks", "size"), [("-20480", "16"), ("20480", "-16"), (str(2**60), "16")])
def test_a_cache_size_that_is_no_size_is_refused_naming_it(blocks: str, size: str) -> None:
    """A negative size was taken, and every Candidate made from it then refused (`kv_cache_tokens: must be ≥ 0`)
    inside the gateway's routing of every request."""
    text = SCRAPE.replace('num_gpu_blocks="20480"', f'num_gpu_blocks="{blocks}"').replace(
        'block_size="16"', f'block_size="{size}"'
    )
    with pytest.raises(FeatureError) as err:
        parse_vllm_metrics(text)
    assert err.value.field == "vllm:cache_config_info" and "must be counts" in err.value.problem


def test_a_cache_larger_than_any_count_holds_any_request() -> None:
    text = SCRAPE.replace('num_gpu_blocks="20480"', f'num_gpu_blocks="{2**53}"')
    assert parse_vllm_metrics(text).kv_cache_tokens == 2**53  # capped: a count beyond is no count


def test_an_unpublished_cache_size_is_unknown() -> None:
    assert parse_vllm_metrics(OLD_SCRAPE).kv_cache_tokens is None


def test_old_kv_metric_name_is_understood() -> None:
    m = parse_vllm_metrics(OLD_SCRAPE)
    assert (m.num_requests_waiting, m.num_requests_running, m.kv_cache_usage) == (0, 4, 0.125)
    assert m.block_size is None and m.num_gpu_blocks is None


def test_new_kv_name_wins_when_both_are_exported() -> None:
    text = scrape(kv="0.75") + f"{KV_USAGE_OLD}{{{MODEL}}} 0.25\n"
    assert parse_vllm_metrics(text).kv_cache_usage == 0.75


def test_v1_prefix_counters_under_their_earlier_gpu_names_are_read() -> None:
    """Earlier vLLM V1 releases published them as `vllm:gpu_prefix_cache_queries_total` and
    `vllm:gpu_prefix_cache_hits_total`: read as the newer names, which win where a server publishes both."""
    old = (
        scrape()
        + f"vllm:gpu_prefix_cache_queries_total{{{MODEL}}} 900\nvllm:gpu_prefix_cache_hits_total{{{MODEL}}} 300\n"
    )
    m = parse_vllm_metrics(old)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (900, 300)
    both = old + f"{PREFIX_QUERIES}_total{{{MODEL}}} 1000\n{PREFIX_HITS}_total{{{MODEL}}} 400\n"
    assert (parse_vllm_metrics(both).prefix_cache_queries, parse_vllm_metrics(both).prefix_cache_hits) == (1000, 400)


def test_data_parallel_engines_add_queues_and_average_kv() -> None:
    text = (
        f'{WAITING}{{engine="0"}} 2\n{WAITING}{{engine="1"}} 5\n'
        f'{RUNNING}{{engine="0"}} 8\n{RUNNING}{{engine="1"}} 6\n'
        f'{KV_USAGE}{{engine="0"}} 0.2\n{KV_USAGE}{{engine="1"}} 0.6\n'
    )
    m = parse_vllm_metrics(text)
    assert (m.num_requests_waiting, m.num_requests_running) == (7, 14)
    assert m.kv_cache_usage == pytest.approx(0.4)


def test_samples_with_timestamps_and_no_labels() -> None:
    text = f"{WAITING} 1 1700000000000\n{RUNNING} 2\n{KV_USAGE} 0 1700000000000\n"
    m = parse_vllm_metrics(text)
    assert (m.num_requests_waiting, m.num_requests_running, m.kv_cache_usage) == (1, 2, 0.0)


def test_metrics_become_endpoint_state_keeping_identity() -> None:
    base = EndpointState(endpoint_id="pod-1", accelerator="h200-sxm", model="qwen3-32b", role="decode")
    state = parse_vllm_metrics(SCRAPE).endpoint_state(base)
    assert state == EndpointState(
        endpoint_id="pod-1",
        accelerator="h200-sxm",
        model="qwen3-32b",
        role="decode",
        num_request_waiting=3,
        num_request_running=12,
        kv_cache_percentage=0.4375,
    )
    assert parse_vllm_metrics(OLD_SCRAPE).endpoint_state().num_request_running == 4


def test_labels_with_escapes_and_braces() -> None:
    samples = parse_samples('m{path="/a}b",quote="say \\"hi\\"",} 2\n')
    assert samples == {"m": [({"path": "/a}b", "quote": 'say "hi"'}, 2.0)]}


# ------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("missing", [WAITING, RUNNING])
def test_missing_queue_metric_is_named(missing: str) -> None:
    text = "\n".join(line for line in scrape().splitlines() if not line.startswith(missing + "{"))
    with pytest.raises(FeatureError) as err:
        parse_vllm_metrics(text)
    assert err.value.field == missing
    assert "missing" in str(err.value)


def test_missing_kv_metric_names_both_spellings() -> None:
    text = f"{WAITING} 1\n{RUNNING} 2\n"
    with pytest.raises(FeatureError) as err:
        parse_vllm_metrics(text)
    assert err.value.field == KV_USAGE
    assert KV_USAGE_OLD in str(err.value)


def test_empty_scrape_is_refused() -> None:
    with pytest.raises(FeatureError) as err:
        parse_vllm_metrics("")
    assert err.value.field == WAITING


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (scrape(waiting="many"), WAITING),
        (scrape(running="NaN"), RUNNING),
        (scrape(waiting="+Inf"), WAITING),
        (scrape(waiting="-1"), WAITING),
        (scrape(kv="-0.1"), KV_USAGE),
        (scrape(kv="43.7"), KV_USAGE),  # a percentage where a fraction belongs
        (scrape(kv="1.2", kv_name=KV_USAGE_OLD), KV_USAGE_OLD),
        (scrape(kv="NaN"), KV_USAGE),
    ],
)
def test_bad_values_are_named(text: str, field: str) -> None:
    with pytest.raises(FeatureError) as err:
        parse_vllm_metrics(text)
    assert err.value.field == field


def test_line_that_is_not_a_sample_gives_its_number() -> None:
    text = scrape() + "this is not prometheus\n"
    with pytest.raises(FeatureError) as err:
        parse_vllm_metrics(text)
    assert err.value.field == "metrics"
    assert "line 4" in str(err.value)


def test_malformed_labels_are_refused() -> None:
    text = f"{WAITING}{{model_name=qwen}} 3\n{RUNNING} 1\n{KV_USAGE} 0.1\n"
    with pytest.raises(FeatureError) as err:
        parse_vllm_metrics(text)
    assert err.value.field == WAITING
    assert "line 1" in str(err.value)


def test_v0_without_prefix_caching_is_routable() -> None:
    """Regression: a vLLM v0 server with prefix caching off (v0's default) publishes
    `vllm:gpu_prefix_cache_hit_rate -1` (its allocator's "no rate"); every scrape of it failed on that one optional
    gauge, so the endpoint was never routed to. The rate now reads as unknown and the load as published."""
    text = OLD_SCRAPE + f"vllm:cpu_prefix_cache_hit_rate{{{MODEL}}} -1.0\n{PREFIX_HIT_RATE_OLD}{{{MODEL}}} -1.0\n"
    m = parse_vllm_metrics(text)
    assert (m.num_requests_running, m.num_requests_waiting, m.kv_cache_usage) == (4, 0, 0.125)
    assert m.prefix_cache_hit_rate is None


@pytest.mark.parametrize("name", [f"{PREFIX_QUERIES}_total", f"{PREFIX_HITS}_total", PREFIX_HIT_RATE_OLD])
@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-1"])
def test_an_unreadable_optional_metric_is_unknown_not_a_failed_scrape(name: str, value: str) -> None:
    """Regression: a NaN (or negative, or infinite) prefix-cache counter or hit rate failed the whole scrape, so
    the endpoint became unroutable over a figure the router can do without; it now reads as unknown."""
    m = parse_vllm_metrics(scrape() + f'{name}{{{MODEL}}} 0.5\n{name}{{{MODEL},engine="1"}} {value}\n')
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.prefix_cache_hit_rate) == (None, None, None)
    assert (m.num_requests_waiting, m.num_requests_running, m.kv_cache_usage) == (3, 12, 0.5)


def test_opposite_infinities_across_engines_are_a_named_error() -> None:
    """Regression: two data-parallel engines publishing +Inf and -Inf for one queue made the sum raise a bare
    ValueError (`-inf + inf in fsum`) instead of a FeatureError naming the metric, escaping the scrape's handling."""
    engines = f'{WAITING}{{engine="0"}} +Inf\n{WAITING}{{engine="1"}} -Inf\n'
    text = scrape().replace(f"{WAITING}{{{MODEL}}} 3\n", engines)
    with pytest.raises(FeatureError) as err:
        parse_vllm_metrics(text)
    assert err.value.field == WAITING


def test_an_unprofiled_cache_size_is_unknown_not_a_failed_scrape() -> None:
    """Regression: early vLLM V1 releases publish `vllm:cache_config_info{..., num_gpu_blocks="None"}` until they
    have profiled memory; that failed every scrape ("not integers"), so the endpoint was unroutable. A label that
    is not an integer now reads as unknown, and so does the cache's size."""
    text = scrape() + f'{CACHE_CONFIG}{{block_size="16",num_gpu_blocks="None",num_gpu_blocks_override="None"}} 1\n'
    m = parse_vllm_metrics(text)
    assert (m.block_size, m.num_gpu_blocks, m.kv_cache_tokens) == (16, None, None)
    assert parse_vllm_metrics(scrape() + f'{CACHE_CONFIG}{{block_size="x",num_gpu_blocks="9"}} 1\n').block_size is None


def test_cache_config_without_block_labels_is_tolerated() -> None:
    m = parse_vllm_metrics(scrape() + f'{CACHE_CONFIG}{{cache_dtype="auto"}} 1\n')
    assert m.block_size is None and m.num_gpu_blocks is None


# ------------------------------------------------------------------------------ property


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 10**6),
    st.integers(0, 10**6),
    st.floats(0.0, 1.0, allow_nan=False),
    st.booleans(),
    st.integers(1, 512),
    st.integers(0, 10**7),
)
def test_rendered_scrape_parses_back(
    waiting: int, running: int, kv: float, old_name: bool, block_size: int, blocks: int
) -> None:
    kv_name = KV_USAGE_OLD if old_name else KV_USAGE
    text = (
        f"# TYPE {WAITING} gauge\n{WAITING}{{{MODEL}}} {float(waiting)!r}\n"
        f"{RUNNING}{{{MODEL}}} {float(running)!r}\n{kv_name}{{{MODEL}}} {kv!r}\n"
        f'{CACHE_CONFIG}{{block_size="{block_size}",num_gpu_blocks="{blocks}"}} 1.0\n'
    )
    assert parse_vllm_metrics(text) == VllmMetrics(waiting, running, kv, block_size, blocks)
