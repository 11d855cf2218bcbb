"""`leadtime bench load`: the service under a bounded load on loopback, predictions and observations together.

Why `wrk` for the predictions: a Python load generator saturates before the service does on a 2-core machine (an
asyncio httpx client managed 159 of 250 calls/s), while wrk, written in C, drove 2,300 50-row calls/s. wrk (the
original, which Debian ships) has no fixed-rate mode: its connections are paced by a per-request delay (Lua
`delay()`), computed from the target rate and the latency of a short warm-up, so the load is bounded, not
open-loop in the strict sense; the achieved rate is reported beside the target. Observations come from a separate
Python process posting pre-encoded 100-entry batches (fewer when the run holds fewer rows) on a fixed schedule over
one keep-alive connection.

The service is `leadtime serve` in its own process (in-memory store, the default settings). Resident memory is
that process's plus its learner's (VmRSS from /proc), after the warm-up, every 10 s and at the end. Everything
that grows with the rows accepted is bounded: the learner's window (20,000 rows by default) and the in-memory
store's rows (200,000 kept for a restarted learner to read again, a backlog thinned past 50,000), so memory grows
until those are full (~40 s at 5,000 rows/s) and then stays level.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from leadtime.bench.keepalive import KeepAliveClient, request_bytes
from leadtime.bench.procs import Predictor, quietly, said_as_stopped, start, stopped
from leadtime.bench.serving import call_rows, load_entries
from leadtime.json_text import print_json

OBSERVE_BATCH = 100
CONNECTIONS = 16
SAMPLE_EVERY_S = 10.0


class WrkMissing(RuntimeError):
    """wrk is not installed: the benchmark cannot drive the prediction load without it."""


@dataclass(frozen=True)
class LoadOptions:
    """Targets of one run."""

    predict_rps: float = 1_000.0
    rows_per_call: int = 50
    observe_rps: float = 5_000.0
    duration_s: float = 60.0
    warmup_s: float = 3.0


def find_wrk() -> str:
    """wrk's path, or WrkMissing saying how to install it."""
    path = shutil.which("wrk")
    if path is None:
        raise WrkMissing("wrk is not installed: `apt-get install wrk` (Debian/Ubuntu); bench load needs it")
    return path


def _lua(body: bytes, delay_ms: float) -> str:
    """wrk's script: POST the body; wait `delay_ms` before each request; print one JSON line when done."""
    text = body.decode()
    assert "]==]" not in text
    return f"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{text}]==]
function delay() return {delay_ms:.3f} end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('LEADTIME {{"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, ' ..
    '"status": %d, "timeout": %d, "p50_us": %.1f, "p99_us": %.1f, "mean_us": %.1f}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


def run_wrk(
    url: str,
    body: bytes,
    rps: float,
    seconds: float,
    mean_latency_ms: float,
    workdir: Path,
    sample: Any = None,
) -> dict[str, Any]:
    """wrk for `seconds` at about `rps` calls/s over CONNECTIONS connections; its summary as a dict. `sample()` is
    called every SAMPLE_EVERY_S seconds while it runs."""
    delay_ms = max(0.0, CONNECTIONS * 1000.0 / rps - mean_latency_ms)
    script = workdir / "predict.lua"
    script.write_text(_lua(body, delay_ms))
    command = [find_wrk(), "-t1", f"-c{CONNECTIONS}", f"-d{max(1, round(seconds))}s", "--timeout", "5s"]
    process: subprocess.Popen[str] = start(
        [*command, "-s", str(script), url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + seconds + 60
    try:
        while process.poll() is None and time.monotonic() < deadline:
            try:
                process.wait(SAMPLE_EVERY_S)
            except subprocess.TimeoutExpired:
                if sample is not None:
                    sample()
    finally:  # a run stopped (SIGTERM, Ctrl-C) stops wrk too: it drove load at a closed port, its parent gone
        if process.poll() is None:
            process.kill()
    stdout, stderr = process.communicate()
    match = re.search(r"^LEADTIME (\{.*\})$", stdout, re.MULTILINE)
    if process.returncode != 0 or match is None:
        raise RuntimeError(f"wrk failed ({process.returncode}): {stderr.strip() or stdout.strip()}")
    result: dict[str, Any] = json.loads(match.group(1))
    result["errors"] = sum(result[k] for k in ("connect", "read", "write", "status", "timeout"))
    result["delay_ms"] = delay_ms
    return result


def served_calls(summary: dict[str, Any]) -> int:
    """The calls of wrk's `summary` answered below 400 within its timeout: its `requests` counts every call that got
    an answer, those answered ≥ 400 (`status`) and those past the timeout (`timeout`) with them, so that a service
    answering every call 503 read as serving the target rate. (A call both late and ≥ 400 is taken off twice.)"""
    return max(0, int(summary["requests"]) - int(summary["status"]) - int(summary["timeout"]))


def batch_rows(rows_per_s: float, seconds: float) -> int:
    """Rows per observation post: OBSERVE_BATCH, or fewer when the whole run holds fewer rows at `rows_per_s`
    (a 100-row batch at 1 row/s for 3 s sent 33 rows/s).

    >>> batch_rows(5_000, 60), batch_rows(1, 3), batch_rows(0.01, 1)
    (100, 3, 1)
    """
    return max(1, min(OBSERVE_BATCH, int(rows_per_s * seconds)))


def observe(port: int, entries: list[dict[str, Any]], rows_per_s: float, seconds: float, out: Any) -> None:
    """Runs in its own process: post batches (`batch_rows`) on schedule for `seconds`; `out` gets
    [rows answered 202, calls that were not 202 or failed, seconds taken]. A post that fails (the service gone, a
    connection refused or cut) is counted, and the next one tries a new connection."""
    batch = batch_rows(rows_per_s, seconds)
    requests = [
        request_bytes(
            "127.0.0.1",
            "/add_training_data_bulk",
            json.dumps({"entries": [entries[(b * batch + i) % len(entries)] for i in range(batch)]}).encode(),
        )
        for b in range(50)
    ]
    client: KeepAliveClient | None = None
    period = batch / rows_per_s
    started = time.monotonic()
    next_at, b, accepted, errors = started, 0, 0, 0
    while time.monotonic() - started < seconds:
        try:
            client = client or KeepAliveClient("127.0.0.1", port)
            status, _ = client.send(requests[b % len(requests)])
        except (OSError, RuntimeError, ValueError):  # refused, cut, timed out, or an answer that is not HTTP
            status = 0
            if client is not None:
                client.close()
                client = None
        if status == 202:
            accepted += batch
        else:
            errors += 1
        b += 1
        next_at += period
        # Until the next batch is due, or the run's end when that comes first (a rate below a batch per run).
        time.sleep(max(0.0, min(next_at, started + seconds) - time.monotonic()))
    out[:] = [accepted, errors, time.monotonic() - started]
    if client is not None:
        client.close()


def feeder_figures(feeder: Any, out: Any) -> tuple[int, int, float]:
    """The observation feeder's (rows answered 202, failed posts, seconds), once it has ended; RuntimeError when
    it failed or is still running: its `out` would still read 0 rows and 0 errors, no load reported as no errors."""
    if feeder.exitcode != 0:
        state = "did not finish" if feeder.exitcode is None else f"failed (exit code {feeder.exitcode})"
        raise RuntimeError(f"the observation feeder {state}")
    accepted, errors, seconds = out
    return int(accepted), int(errors), float(seconds)


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the learner), in MB."""
    total_kb = 0
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        if match:
            total_kb += int(match.group(1))
    return total_kb / 1024.0


def run_load(options: LoadOptions, progress: Any = None) -> dict[str, Any]:
    """Start the service, warm it up, drive both loads for `duration_s`, and report."""
    say = progress or (lambda message: None)
    find_wrk()
    entries = load_entries()
    rows = call_rows(entries, options.rows_per_call)
    body = json.dumps({"requests": rows}).encode()
    with tempfile.TemporaryDirectory(prefix="leadtime-load-") as tmp:
        workdir = Path(tmp)
        service = Predictor(workdir)
        feeder = None
        try:
            service.wait()
            with said_as_stopped(service.child.process):  # what fails once the service has stopped says so
                url = f"{service.url}/predict/bulk/strict"
                say(f"warming up for {options.warmup_s:.0f} s")
                warm = run_wrk(url, body, options.predict_rps, options.warmup_s, 0.0, workdir)
                with httpx.Client(base_url=service.url, timeout=10) as client:
                    for start in range(0, 2_000, OBSERVE_BATCH):
                        client.post("/add_training_data_bulk", json={"entries": entries[start : start + OBSERVE_BATCH]})
                time.sleep(1.0)
                rss_start = rss_mb(service.child.pid)
                say(
                    f"driving {options.predict_rps:,.0f} predictions/s of {len(rows)} rows and "
                    f"{options.observe_rps:,.0f} observations/s for {options.duration_s:.0f} s"
                )
                context = multiprocessing.get_context("spawn")
                out = context.Manager().list([0, 0, 0.0])
                feeder = context.Process(
                    target=quietly,
                    args=(observe, service.port, entries, options.observe_rps, options.duration_s, out),
                )
                feeder.start()
                samples: list[float] = []
                result = run_wrk(
                    url,
                    body,
                    options.predict_rps,
                    options.duration_s,
                    warm["mean_us"] / 1000.0,
                    workdir,
                    sample=lambda: samples.append(round(rss_mb(service.child.pid), 1)),
                )
                feeder.join(options.duration_s + 60)
                if (gone := stopped(service.child.process)) is not None:  # wrk and the feeder only counted errors
                    raise RuntimeError(gone)
                accepted, observe_errors, observe_s = feeder_figures(feeder, out)
                rss_end = rss_mb(service.child.pid)
                with httpx.Client(base_url=service.url, timeout=10) as client:
                    ingestion = client.get("/status").json()["ingestion"]
        finally:
            if feeder is not None and feeder.is_alive():  # stopped first, before the service goes away under it
                feeder.terminate()
                feeder.join(10)
            service.child.stop()
    seconds = result["duration_us"] / 1e6
    return {
        "target_predict_rps": options.predict_rps,
        "achieved_predict_rps": round(served_calls(result) / seconds, 1),  # calls answered < 400 in time
        "rows_per_call": len(rows),  # what each call sent
        "target_observe_rps": options.observe_rps,
        "achieved_observe_rps": round(accepted / observe_s, 1) if observe_s else 0.0,
        "duration_s": round(seconds, 1),
        "p50_ms": round(result["p50_us"] / 1000.0, 3),
        "p99_ms": round(result["p99_us"] / 1000.0, 3),
        "predict_errors": int(result["errors"]),  # calls: wrk's connect, read, write, timeout and status >= 400
        "observe_errors": int(observe_errors),  # posts that failed or were not answered 202
        "errors": int(result["errors"] + observe_errors),  # the two together
        "rss_mb_start": round(rss_start, 1),
        "rss_mb_end": round(rss_end, 1),
        "rss_mb_every_10s": samples,
        "connections": CONNECTIONS,
        "wrk_delay_ms": round(result["delay_ms"], 3),
        "ingestion": ingestion,
        "load_average": os.getloadavg()[0],
    }


def print_report(report: dict[str, Any], as_json: bool) -> None:
    """The report as one JSON object, or as lines for a person."""
    if as_json:
        print_json(report)
        return
    print(
        f"predictions: {report['achieved_predict_rps']:,.0f}/s of {report['rows_per_call']} rows "
        f"(target {report['target_predict_rps']:,.0f}/s), p50 {report['p50_ms']:.2f} ms, p99 {report['p99_ms']:.2f} ms"
    )
    print(
        f"observations: {report['achieved_observe_rps']:,.0f}/s accepted (target {report['target_observe_rps']:,.0f}/s)"
    )
    print(
        f"errors: {report['predict_errors']:,} prediction calls (failed, timed out or answered ≥ 400), "
        f"{report['observe_errors']:,} observation posts (failed or not answered 202)"
    )
    print(f"resident memory: {report['rss_mb_start']:.0f} MB after warm-up, {report['rss_mb_end']:.0f} MB at the end")
