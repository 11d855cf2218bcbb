"""`leadtime bench gateway`'s pieces that need no process: what its report says of the replicas' overhead."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from leadtime.bench.gateway import replica_events, replica_overhead
from leadtime.features.vllm_metrics import parse_samples
from leadtime.router_plugin.gateway.metrics import REPLICA_EVENT_DIRECTIONS, GatewayMetrics

SILENT = {"sent": 0.0, "received": 0.0, "dropped": 0.0, "replicas_heard": 0.0}


def test_no_figure_for_replicas_that_never_heard_each_other() -> None:
    """The figure was filled though sent, received and replicas_heard were all 0: it measured a lone gateway."""
    warnings: list[str] = []
    assert replica_overhead([1.0, 2.0, 3.0], SILENT, warnings.append) is None
    assert len(warnings) == 1 and "no replica was heard" in warnings[0], warnings


def test_the_figure_of_replicas_that_heard_each_other() -> None:
    warnings: list[str] = []
    heard = {**SILENT, "sent": 10.0, "received": 10.0, "replicas_heard": 1.0}
    assert replica_overhead([1.0, 2.0, 3.0], heard, warnings.append) == {"p50": 2.0, "p99": 2.98}
    assert warnings == []


def test_the_replica_events_reported_are_every_direction_the_gateway_counts() -> None:
    """The report listed sent, received and dropped only: a replica that let go of missed completions, or refused a
    stranger's message, showed nothing of it beside its overhead."""
    metrics = GatewayMetrics()
    metrics.replica_events.labels("missed").inc(2)
    metrics.replica_events.labels("refused").inc()
    metrics.replicas_heard.set(1)
    samples = parse_samples(generate_latest(metrics.registry).decode())

    def metric(name: str, **labels: str) -> float:
        return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))

    events = replica_events(metric)
    assert set(events) == {*REPLICA_EVENT_DIRECTIONS, "replicas_heard"}
    assert (events["missed"], events["refused"], events["sent"], events["replicas_heard"]) == (2.0, 1.0, 0.0, 1.0)


def test_a_gateway_that_stopped_is_said_in_one_line_when_its_metrics_are_read(tmp_path: Path) -> None:
    """`kill -9` of the gateway being measured ended `bench gateway` in a 270-line traceback of httpx's
    ConnectError (not an OSError, so not said in one line) when its fallbacks were read after the probes."""
    from leadtime.bench.procs import Route

    route = Route(tmp_path, ["--help"])  # a `leadtime route ...` that has ended by the time it is read
    route.child.process.wait(60)
    with pytest.raises(RuntimeError, match=r"^the gateway \(leadtime route\) stopped during the run \(exit code 0\)$"):
        route.metric("leadtime_router_fallbacks_total")
    route.child.stop()


def test_a_run_without_a_streaming_request_has_no_goodput_or_slo_figure() -> None:
    """With `--non-streaming-share 1` no client sees a first token, yet goodput and SLO attainment read 0 (every SLO
    missed) where the report's other figures of nothing measured are null."""
    import math

    from leadtime.bench.gateway import _summary
    from leadtime.bench.loadgen import Result, Shot

    shots = [Shot(i, float(i), (i,), 100, 4, 2000.0, 100.0, stream=False) for i in range(4)]
    results = [Result(i, 200, 50.0, 0.0, 0.0, 4, 4, "h100-0", 1.0, "", False) for i in range(4)]
    summary = _summary(results, shots)
    assert math.isnan(summary["goodput_rps"]) and math.isnan(summary["slo_attainment"]), summary
    assert summary["whole_ms"] == {"p50": 50.0, "p99": 50.0} and summary["non_streaming"] == 4
    streaming = [Shot(i, float(i), (i,), 100, 4, 2000.0, 100.0) for i in range(4)]
    answered = [Result(i, 200, 50.0, 60.0, 10.0, 4, 4, "h100-0", 1.0) for i in range(4)]
    assert _summary(answered, streaming)["slo_attainment"] == 1.0
