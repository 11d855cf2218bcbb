"""`leadtime bench serving`: latency and ingestion rate of the service, measured from outside its process.

It starts `leadtime serve` (in-memory store) as a separate process on free loopback ports, warms it up, then
times sequential calls exactly as a router makes them: `POST /predict/bulk/strict` with 1, 10 and 100 rows
over one keep-alive HTTP connection (`leadtime.bench.keepalive`, a minimal client: the figures are the service's, not
http.client's), the same rows through gRPC `PredictBulk`, and `/add_training_data_bulk`
in batches of 1,000. Ingesting makes the service learn and retrain behind the answers, so the 100-row
latencies are measured once more while that happens. Request bodies are encoded before the clock starts:
the figures are the service's round trip, not the client's JSON encoder.

Ingestion is reported as what the service did with the rows, not as answers: `accepted_per_s` (rows answered
202) beside `learned_per_s` (rows that reached the model and its window), with what was thinned or dropped, and
the sustained rate: the highest of a series of paced rates (1,000-row batches for `SUSTAIN_SECONDS` each) at
which nothing was thinned or dropped and the backlog did not grow past one second of rows.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import orjson

from leadtime.bench.data import dataset_path, load_llmd_rows
from leadtime.bench.keepalive import KeepAliveClient
from leadtime.bench.procs import free_port, quietly, said_as_stopped, start, terminate
from leadtime.json_text import print_json

ROOT = Path(__file__).resolve().parent.parent
ROW_COUNTS = (1, 10, 100)
INGEST_BATCH = 1_000
INGEST_BATCHES = 60
WARMUP_CALLS = 200

T = TypeVar("T")


def load_entries() -> list[dict[str, Any]]:
    """The training entries of the real H200 trace that ships with Leadtime (sharegpt-h200)."""
    return load_llmd_rows(dataset_path("sharegpt-h200"))


def prediction_rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Training entries without their actuals: prediction rows."""
    return [{k: v for k, v in e.items() if not k.startswith("actual_")} for e in entries]


def call_rows(entries: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The `n` rows of one prediction call: the shipped trace's rows in order, from the first again when `n` is
    more than it holds (a call may then hold the same row more than once)."""
    rows = prediction_rows(entries)
    return [rows[i % len(rows)] for i in range(n)]


class ServiceProcess:
    """`leadtime serve` (or, with `floor=True`, the bare stack of `leadtime.bench.stack_floor`, busy `work_us` per
    call) in a child process on free loopback ports."""

    def __init__(self, floor: bool = False, work_us: float = 0.0, settings: dict[str, str] | None = None) -> None:
        self.http_port = free_port()
        self.grpc_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LEADTIME_")}
        env["LEADTIME_ACCELERATOR"] = "h200-sxm"
        env["LEADTIME_MODEL"] = "qwen3-32b"
        env.update({f"LEADTIME_{name.upper()}": value for name, value in (settings or {}).items()})
        ports = ["--port", str(self.http_port), "--grpc-port", str(self.grpc_port)]
        if floor:
            command = [sys.executable, "-m", "leadtime.bench.stack_floor", *ports, "--work-us", str(work_us)]
        else:
            command = [sys.executable, "-m", "leadtime", "serve", "--host", "127.0.0.1", *ports]
        self.process: subprocess.Popen[bytes] = start(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until /readyz answers 200; RuntimeError if the process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"leadtime serve exited with {self.process.returncode}: {stderr[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"leadtime serve was not ready within {timeout_s:.0f} s")

    def stop(self) -> None:
        """Terminate the service (SIGKILL after 15 s)."""
        terminate(self.process)


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """p50 and p99 in milliseconds of samples in seconds."""
    ms = np.asarray(samples_s) * 1e3
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
    }


def time_calls(call: Callable[[], None], n: int) -> list[float]:
    """Seconds taken by each of `n` sequential calls."""
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def http_caller(client: KeepAliveClient, rows: list[dict[str, Any]]) -> Callable[[], None]:
    """One POST on a persistent connection, request encoded beforehand."""
    body = json.dumps({"requests": rows}, separators=(",", ":")).encode()
    request = client.request_bytes("/predict/bulk/strict", body)

    def call() -> None:
        status, answer = client.send(request)
        if status != 200:
            raise RuntimeError(f"/predict/bulk/strict answered {status}: {answer[:300]!r}")

    return call


def grpc_caller(stub: Any, rows: list[dict[str, Any]]) -> Callable[[], None]:
    """One PredictBulk with the rows as columns, as `leadtime.predictor.client` sends them."""
    from leadtime.predictor.client import row_columns
    from leadtime.predictor.grpc import leadtime_pb2 as pb

    request = pb.PredictBulkRequest(columns=row_columns(rows))

    def call() -> None:
        stub.PredictBulk(request, timeout=5.0)

    return call


FEED_BATCH = 200
FEED_PERIOD_S = 0.1  # 2,000 observations a second: the learner keeps learning and retraining throughout
WHY_BYTES = 300


def feeding(why: Any, target: Callable[..., None], *args: object) -> None:
    """The entry of a process that posts observations (`feed_observations`, `post_at_rate`): `target(*args)`, as
    `quietly` runs it. A post that fails (the service gone, or answering other than 202) ends it with exit code 1
    and the reason in `why` (a shared `c` array), not with a traceback of its own on the benchmark's stderr: the
    benchmark says what happened in one line, as the service stopping when that is the cause (`said_as_stopped`)."""
    try:
        quietly(target, *args)
    except (OSError, RuntimeError, ValueError) as err:
        why.value = str(err).encode()[: WHY_BYTES - 1]
        sys.exit(1)


def ended(process: Any, why: Any) -> str:
    """How a `feeding` process ended: the reason it gave, else its exit code."""
    return why.value.decode(errors="replace") if why is not None and why.value else f"exit code {process.exitcode}"


def feed_observations(port: int, entries: list[dict[str, Any]], stop: Any, posted: Any) -> None:
    """Runs in its own process (so that it shares no GIL with the timed client): posts a batch of training
    data every FEED_PERIOD_S until `stop` is set, counting what it posted in `posted`. The batches are encoded
    before the first post, so the feeder's own JSON encoding does not compete for the CPUs while calls are timed."""
    client = KeepAliveClient("127.0.0.1", port)
    batches = len(entries) // FEED_BATCH
    requests = [
        client.request_bytes(
            "/add_training_data_bulk", json.dumps({"entries": entries[b * FEED_BATCH : (b + 1) * FEED_BATCH]}).encode()
        )
        for b in range(batches)
    ]
    b = 0
    next_at = time.monotonic()
    while not stop.is_set():
        status, _ = client.send(requests[b % batches])
        if status != 202:
            raise RuntimeError(f"/add_training_data_bulk answered {status}")
        posted.value += FEED_BATCH
        b += 1
        next_at += FEED_PERIOD_S
        time.sleep(max(0.0, next_at - time.monotonic()))
    client.close()


def wait_until_feeding(feeder: Any, posted: Any, timeout_s: float = 60.0, why: Any = None) -> None:
    """Return once the feeder process has posted its first batch. A spawned process takes a second or two to
    import before it sends anything; timed from its start, a short run of calls could end before the first
    observation arrived (0 observations/s fed while learning, seen on a quick run of 30 calls). `why`: where a
    `feeding` process leaves its reason to stop."""
    deadline = time.monotonic() + timeout_s
    while posted.value == 0:
        if not feeder.is_alive():
            raise RuntimeError(f"the observation feeder stopped before feeding ({ended(feeder, why)})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the observation feeder posted nothing in {timeout_s:.0f} s")
        time.sleep(0.01)


def timed_while_feeding(timed: Callable[[], T], posted: Any, retrains: Callable[[], int]) -> tuple[T, dict[str, Any]]:
    """`timed()`'s result, and what happened while it ran, between the clock's start and stop only: the rows the
    feeder posted (`posted`, its running count: the batch posted before the clock started and any posted after
    it stopped are not the cell's) and the retrains completed (`retrains()`, the service's count so far)."""
    retrains_before, posted_before = retrains(), posted.value
    started = time.perf_counter()
    result = timed()
    elapsed = time.perf_counter() - started
    fed = posted.value - posted_before
    retrained = retrains() - retrains_before
    return result, {
        "retrains_completed": retrained,
        "retrained_while_timed": retrained > 0,
        "observations_fed": fed,
        "observations_fed_per_s": round(fed / elapsed),
        "seconds": round(elapsed, 3),
    }


def no_retrain_warning(cell: dict[str, Any], calls: int) -> str | None:
    """What to say of a "while learning" cell that saw no retrain complete, or None when it saw one."""
    if cell["retrained_while_timed"]:
        return None
    return (
        f"no retrain completed during the {calls} + {calls} calls timed while learning (HTTP, then gRPC): that "
        "cell measured the service taking in and learning rows, not retraining (more --calls give it the time)"
    )


SUSTAIN_RATES = (2_000, 5_000, 10_000, 20_000, 30_000, 40_000, 60_000)
SUSTAIN_SECONDS = 10.0


def post_at_rate(
    port: int, entries: list[dict[str, Any]], rows_per_s: float, seconds: float, posted: Any, took: Any
) -> None:
    """Runs in its own process: posts 1,000-row batches to /add_training_data_bulk at `rows_per_s` for `seconds`
    (as fast as the answers allow when that is slower), counting the rows answered 202 in `posted` and the time
    from the first post to the last answer in `took`."""
    client = KeepAliveClient("127.0.0.1", port)
    batches = [
        client.request_bytes(
            "/add_training_data_bulk",
            json.dumps(
                {"entries": [entries[(b * INGEST_BATCH + i) % len(entries)] for i in range(INGEST_BATCH)]}
            ).encode(),
        )
        for b in range(20)
    ]
    period = INGEST_BATCH / rows_per_s
    started = time.monotonic()
    next_at, b = started, 0
    while time.monotonic() - started < seconds:
        status, _ = client.send(batches[b % len(batches)])
        if status != 202:
            raise RuntimeError(f"/add_training_data_bulk answered {status}")
        posted.value += INGEST_BATCH
        b += 1
        next_at += period
        # Until the next batch is due (or now, when the answers are slower than the schedule).
        took.value = max(time.monotonic(), next_at) - started
        if time.monotonic() - started < seconds:
            time.sleep(max(0.0, next_at - time.monotonic()))
    client.close()


def ingestion_state(client: httpx.Client) -> dict[str, Any]:
    state: dict[str, Any] = client.get("/status").json()["ingestion"]
    return state


def lost(state: dict[str, Any]) -> int:
    """Rows thinned or dropped, for any reason."""
    return int(sum(state["thinned"].values()) + sum(state["dropped"].values()))


def wait_settled(client: httpx.Client, timeout_s: float = 120.0) -> tuple[dict[str, Any], bool]:
    """Wait until every accepted row is learned, thinned or dropped (nothing pending, nothing in the learner)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = ingestion_state(client)
        if state["pending"] == 0 and state["learned"] + lost(state) >= state["accepted"]:
            return state, True
        if time.monotonic() > deadline:
            return state, False
        time.sleep(0.1)


def sustained_ingestion(
    client: httpx.Client,
    port: int,
    entries: list[dict[str, Any]],
    rates: tuple[int, ...] = SUSTAIN_RATES,
    seconds: float = SUSTAIN_SECONDS,
) -> dict[str, Any]:
    """Paced rates, lowest first, until one is not sustained (something thinned or dropped, or a backlog of
    more than a second of rows at the end of the step)."""
    context = multiprocessing.get_context("spawn")
    steps = []
    sustained = 0
    for rate in rates:
        before, _ = wait_settled(client)
        posted, took, why = context.Value("q", 0), context.Value("d", 0.0), context.Array("c", WHY_BYTES)
        poster = context.Process(target=feeding, args=(why, post_at_rate, port, entries, rate, seconds, posted, took))
        poster.start()
        try:
            poster.join(seconds + 60)
        finally:  # a run stopped (SIGTERM, Ctrl-C) stops the poster before the service goes away under it
            if poster.is_alive():
                poster.terminate()
                poster.join(10)
        elapsed = max(took.value, 1e-3)
        if poster.exitcode != 0:
            raise RuntimeError(f"the paced poster failed ({ended(poster, why)})")
        end = ingestion_state(client)
        settled, ok = wait_settled(client)
        step = {
            "target_per_s": rate,
            "accepted_per_s": round(posted.value / elapsed),
            "learned_per_s_during": round((end["learned"] - before["learned"]) / elapsed),
            "pending_at_end": end["pending"],
            "thinned_or_dropped": lost(settled) - lost(before),
            "settled": ok,
        }
        step["sustained"] = bool(
            ok
            and step["thinned_or_dropped"] == 0
            and end["pending"] < step["accepted_per_s"]
            and step["accepted_per_s"] >= 0.95 * rate
        )
        steps.append(step)
        if not step["sustained"]:
            break
        sustained = step["accepted_per_s"]
    return {"sustained_per_s": sustained, "seconds_per_step": seconds, "steps": steps}


def retrain_count(client: httpx.Client) -> int:
    """Retrains the service has run, from its /metrics."""
    text = client.get("/metrics").text
    total = 0
    for line in text.splitlines():
        if line.startswith("leadtime_retrain_duration_seconds_count"):
            total += int(float(line.split()[-1]))
    return total


def run_serving(
    calls: int = 2_000,
    progress: bool = True,
    settings: dict[str, str] | None = None,
    sustain_rates: tuple[int, ...] = SUSTAIN_RATES,
    sustain_seconds: float = SUSTAIN_SECONDS,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """`settings`: service settings (name → value) for the measured service; everything else runs on defaults,
    whatever LEADTIME_* variables the caller's environment holds. `sustain_rates`, `sustain_seconds`: the paced
    ingestion steps. `warn` gets what makes a figure other than it looks (a "while learning" cell without a
    retrain)."""
    import grpc

    from leadtime.predictor.grpc import leadtime_pb2_grpc

    def say(message: str) -> None:
        if progress:
            print(message, file=sys.stderr, flush=True)

    entries = load_entries()
    rows = prediction_rows(entries)
    service = ServiceProcess(settings=settings)
    try:
        service.wait_ready()
        say(f"service up on :{service.http_port} (gRPC :{service.grpc_port})")
        report: dict[str, Any] = {
            "calls": calls,
            "settings": dict(settings or {}),
            "cpus": os.cpu_count(),
            "load_average_1m_before": round(os.getloadavg()[0], 2),
            "http": {},
            "grpc": {},
        }
        with (
            said_as_stopped(service.process),  # what fails once the service has stopped says so, in one line
            httpx.Client(base_url=service.base_url, timeout=10.0) as client,
            grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel,
        ):
            stub = leadtime_pb2_grpc.PredictorStub(channel)
            connection = KeepAliveClient("127.0.0.1", service.http_port)
            for n in ROW_COUNTS:
                http_call, grpc_call = http_caller(connection, rows[:n]), grpc_caller(stub, rows[:n])
                time_calls(http_call, WARMUP_CALLS)
                time_calls(grpc_call, WARMUP_CALLS)
                report["http"][f"rows_{n}"] = percentiles(time_calls(http_call, calls))
                report["grpc"][f"rows_{n}"] = percentiles(time_calls(grpc_call, calls))
                http_n, grpc_n = report["http"][f"rows_{n}"], report["grpc"][f"rows_{n}"]
                say(f"{n} rows: HTTP {_p50_p99(http_n)}, gRPC {_p50_p99(grpc_n)}")
            report["handler_rows_100_ms"] = handler_times(connection, rows[:100])

            batches = []
            for b in range(INGEST_BATCHES):
                batch = [entries[(b * INGEST_BATCH + i) % len(entries)] for i in range(INGEST_BATCH)]
                batches.append(json.dumps({"entries": batch}, separators=(",", ":")).encode())
            headers = {"content-type": "application/json"}
            before = ingestion_state(client)
            started = time.perf_counter()
            for body in batches:
                response = client.post("/add_training_data_bulk", content=body, headers=headers)
                if response.status_code != 202:
                    raise RuntimeError(f"/add_training_data_bulk answered {response.status_code}: {response.text}")
            elapsed = time.perf_counter() - started
            report["ingest_samples_per_s"] = round(INGEST_BATCH * INGEST_BATCHES / elapsed)
            after = ingestion_state(client)
            report["burst"] = {
                "rows": INGEST_BATCH * INGEST_BATCHES,
                "accepted_per_s": report["ingest_samples_per_s"],
                "learned_per_s": round((after["learned"] - before["learned"]) / elapsed),
            }
            say(f"accepted {INGEST_BATCH * INGEST_BATCHES} samples at {report['ingest_samples_per_s']}/s")

            # The service now learns the backlog and retrains behind the answers, and a feeder process keeps
            # sending observations while 100-row calls are timed again.
            connection.close()
            connection = KeepAliveClient("127.0.0.1", service.http_port)
            http_call, grpc_call = http_caller(connection, rows[:100]), grpc_caller(stub, rows[:100])
            context = multiprocessing.get_context("spawn")
            stop, posted, why = context.Event(), context.Value("q", 0), context.Array("c", WHY_BYTES)
            feed = (why, feed_observations, service.http_port, entries, stop, posted)
            feeder = context.Process(target=feeding, args=feed)
            feeder.start()
            try:
                wait_until_feeding(feeder, posted, why=why)
                (during_http, during_grpc), window = timed_while_feeding(
                    lambda: (time_calls(http_call, calls), time_calls(grpc_call, calls)),
                    posted,
                    lambda: retrain_count(client),
                )
            finally:
                stop.set()
                feeder.join(30)
            if feeder.exitcode != 0:
                raise RuntimeError(f"the observation feeder failed ({ended(feeder, why)})")
            report["while_learning"] = {
                "http_rows_100": percentiles(during_http),
                "grpc_rows_100": percentiles(during_grpc),
                **window,
            }
            retrains = window["retrains_completed"]
            if warn is not None and (message := no_retrain_warning(window, calls)) is not None:
                warn(message)
            stop.clear()
            feeder = context.Process(target=feeding, args=feed)
            feeder.start()
            try:
                report["while_learning"]["handler_rows_100_ms"] = handler_times(connection, rows[:100])
            finally:
                stop.set()
                feeder.join(30)
            if feeder.exitcode != 0:
                raise RuntimeError(f"the observation feeder failed ({ended(feeder, why)})")
            connection.close()
            w = report["while_learning"]
            say(f"while learning ({retrains} retrains), 100 rows: HTTP {_p50_p99(w['http_rows_100'])}")
            settled, _ = wait_settled(client)
            report["burst"].update(
                accepted_total=settled["accepted"] - before["accepted"],
                learned_total=settled["learned"] - before["learned"],
                thinned_total=sum(settled["thinned"].values()) - sum(before["thinned"].values()),
                dropped_total=sum(settled["dropped"].values()) - sum(before["dropped"].values()),
            )
            report["ingestion"] = sustained_ingestion(
                client, service.http_port, entries, sustain_rates, sustain_seconds
            )
            say(f"ingestion sustained: {report['ingestion']['sustained_per_s']:,} rows/s")
    finally:
        service.stop()
    work_us = report["while_learning"]["handler_rows_100_ms"]["p50_ms"] * 1e3
    for key, work, beside_busy_cpu in (
        ("stack_floor", None, False),
        ("stack_floor_with_equal_work", work_us, False),
        ("stack_floor_beside_busy_cpu", None, True),
        ("stack_floor_with_equal_work_beside_busy_cpu", work_us, True),
    ):
        report[key] = measure_floor(rows[:100], calls, work or 0.0, beside_busy_cpu)
        if work is not None:
            report[key]["work_us"] = round(work)
        say(f"{key}, 100 rows: HTTP {_p50_p99(report[key]['http_rows_100'])}")
    report["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    return report


def handler_times(client: KeepAliveClient, rows: list[dict[str, Any]], calls: int = 300) -> dict[str, float]:
    """The service's own time per 100-row call (its `processing_time_ms`, from receiving the body to encoding the
    answer), read after the timed calls so that decoding answers costs the timed calls nothing."""
    request = client.request_bytes("/predict/bulk/strict", json.dumps({"requests": rows}).encode())
    times = [orjson.loads(client.send(request)[1])["processing_time_ms"] / 1e3 for _ in range(calls)]
    return percentiles(times)


# A process that only burns CPU, at the learner's default priority (nice 10): what the learner is to the serving
# threads while it retrains, with nothing else of the service behind it.
BUSY_CPU = "import os\nos.nice(10)\nwhile True:\n    pass\n"


def measure_floor(
    rows: list[dict[str, Any]], calls: int, work_us: float = 0.0, beside_busy_cpu: bool = False
) -> dict[str, Any]:
    """The same 100-row calls against the serving stack with nothing behind it (`leadtime.bench.stack_floor`), answering
    at once or after `work_us` of busy CPU; with `beside_busy_cpu`, while a CPU-bound process (`BUSY_CPU`) runs."""
    import grpc

    from leadtime.predictor.grpc import leadtime_pb2_grpc

    floor = ServiceProcess(floor=True, work_us=work_us)
    neighbour = None
    try:
        floor.wait_ready()
        if beside_busy_cpu:
            neighbour = start([sys.executable, "-c", BUSY_CPU])  # stopped at exit at the latest, however this ends
        connection = KeepAliveClient("127.0.0.1", floor.http_port)
        with grpc.insecure_channel(f"127.0.0.1:{floor.grpc_port}") as channel:
            http_call = http_caller(connection, rows)
            grpc_call = grpc_caller(leadtime_pb2_grpc.PredictorStub(channel), rows)
            time_calls(http_call, WARMUP_CALLS)
            time_calls(grpc_call, WARMUP_CALLS)
            out = {
                "http_rows_100": percentiles(time_calls(http_call, calls)),
                "grpc_rows_100": percentiles(time_calls(grpc_call, calls)),
            }
        connection.close()
        return out
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
        floor.stop()


def _p50_p99(latency: dict[str, Any]) -> str:
    """A progress line's latency: "p50 0.412 / p99 1.020 ms"."""
    return f"p50 {latency['p50_ms']:.3f} / p99 {latency['p99_ms']:.3f} ms"


def print_report(report: dict[str, Any], as_json: bool) -> None:
    """The report as JSON, or as a table of p50/p99 per row count and protocol."""
    if as_json:
        print_json(report)
        return
    print(f"{'':10} {'HTTP p50':>9} {'HTTP p99':>9} {'gRPC p50':>9} {'gRPC p99':>9}  ms")
    for n in ROW_COUNTS:
        h, g = report["http"][f"rows_{n}"], report["grpc"][f"rows_{n}"]
        print(f"{n:>4} rows  {h['p50_ms']:>9.3f} {h['p99_ms']:>9.3f} {g['p50_ms']:>9.3f} {g['p99_ms']:>9.3f}")
    w = report["while_learning"]
    print(
        f"100 rows while learning ({w['retrains_completed']} retrains during the timed calls, "
        f"{w['observations_fed_per_s']:,} observations/s fed): "
        f"HTTP p99 {w['http_rows_100']['p99_ms']:.3f} ms, gRPC p99 {w['grpc_rows_100']['p99_ms']:.3f} ms"
    )
    h, hw = report["handler_rows_100_ms"], w["handler_rows_100_ms"]
    print(
        f"the service's own time per 100-row call (processing_time_ms): p50 {h['p50_ms']:.3f} / p99 "
        f"{h['p99_ms']:.3f} ms idle, p50 {hw['p50_ms']:.3f} / p99 {hw['p99_ms']:.3f} ms while learning"
    )
    busy = f"busy {report['stack_floor_with_equal_work']['work_us']} µs"
    for key, label in (
        ("stack_floor", "the bare stack (same servers, no work)"),
        ("stack_floor_with_equal_work", f"the bare stack {busy}"),
        ("stack_floor_beside_busy_cpu", "the bare stack beside a CPU-bound process"),
        ("stack_floor_with_equal_work_beside_busy_cpu", f"the bare stack {busy} beside a CPU-bound process"),
    ):
        f = report[key]
        print(
            f"{label}, 100 rows: HTTP p50 {f['http_rows_100']['p50_ms']:.3f} / "
            f"p99 {f['http_rows_100']['p99_ms']:.3f} ms, gRPC p50 {f['grpc_rows_100']['p50_ms']:.3f} / "
            f"p99 {f['grpc_rows_100']['p99_ms']:.3f} ms"
        )
    b = report["burst"]
    print(
        f"a burst of {b['rows']:,} rows: accepted at {b['accepted_per_s']:,}/s, learned at {b['learned_per_s']:,}/s "
        f"meanwhile; of everything accepted until it "
        f"was learned (the burst and the feeder's rows): {b['learned_total']:,} learned, {b['thinned_total']:,} "
        f"thinned, {b['dropped_total']:,} dropped"
    )
    i = report["ingestion"]
    for step in i["steps"]:
        print(
            f"  paced {step['target_per_s']:,}/s: accepted {step['accepted_per_s']:,}/s, learned "
            f"{step['learned_per_s_during']:,}/s meanwhile, {step['pending_at_end']:,} pending at the end, "
            f"{step['thinned_or_dropped']:,} thinned or dropped -> {'sustained' if step['sustained'] else 'not'}"
        )
    print(f"ingestion sustained with nothing thinned or dropped: {i['sustained_per_s']:,} rows/s")
    print(
        f"machine: {report['cpus']} CPUs, 1-minute load average {report['load_average_1m_before']} before, "
        f"{report['load_average_1m_after']} after (other processes share these CPUs)"
    )
