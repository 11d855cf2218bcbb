"""`leadtime bench tls`: what TLS costs a router's call to the predictor, beside the same call in plain text.

Two `leadtime serve` processes on loopback, the same build and settings, one serving TLS from a self-signed
certificate made for the run and one plain. The calls are the ones `leadtime route` makes: a bulk prediction of
`rows` candidates through the gateway's lean HTTP client (`--predictor-url`, one kept-alive connection), and the same
through the gRPC client (`--predictor-grpc`). After a warm-up, blocks of sequential calls alternate between the two
services, so a host that slows down or speeds up during the run touches both alike; the figures are p50 / p99 of
each call and the TLS / plain ratio of each. The handshake is paid once per connection, so it is measured apart: a
new lean client's first call (connect, handshake, call; the client made before the clock starts),
`first_calls` times over.
"""

from __future__ import annotations

import datetime
import ipaddress
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leadtime.bench.procs import Predictor
from leadtime.bench.serving import call_rows, load_entries, percentiles, time_calls
from leadtime.json_text import print_json
from leadtime.predictor.client import GrpcPredictorClient
from leadtime.router_plugin.gateway.predictor_http import LeanHttpPredictorClient

WARMUP_CALLS = 200


@dataclass(frozen=True)
class TlsBenchOptions:
    rows: int = 8
    calls: int = 3000
    block: int = 100
    first_calls: int = 50


def self_signed(directory: Path, expires_in: datetime.timedelta = datetime.timedelta(days=1)) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, valid for `expires_in` (a day; negative: one that expired), and
    its key (PEM files in `directory`).

    Needs the `cryptography` package (installed with Leadtime's test extras, as `make` does)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "leadtime-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(min(now, now + expires_in) - datetime.timedelta(minutes=5))
        .not_valid_after(now + expires_in)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def bench_rows(options: TlsBenchOptions) -> list[dict[str, Any]]:
    """The rows of each prediction, as many as the report says (`call_rows`: past the shipped trace's 3,400, from
    its first again)."""
    return call_rows(load_entries(), options.rows)


def run_tls_bench(
    options: TlsBenchOptions = TlsBenchOptions(), progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Measure both transports side by side; the report as a dict (see the module's docstring)."""
    say = progress or (lambda _message: None)
    rows = bench_rows(options)
    with tempfile.TemporaryDirectory(prefix="leadtime-bench-tls-") as tmp:
        workdir = Path(tmp)
        cert, key = self_signed(workdir)
        services = {
            "plain": Predictor(workdir, "h200-sxm", "qwen3-32b"),
            "tls": Predictor(workdir, "h200-sxm", "qwen3-32b", tls=(cert, key)),
        }
        try:
            for service in services.values():
                service.wait()
            ca = {"plain": None, "tls": cert}
            http = {n: LeanHttpPredictorClient(s.url, deadline_s=5.0, ca_file=ca[n]) for n, s in services.items()}
            grpc = {n: GrpcPredictorClient(s.grpc, deadline_s=5.0, ca_file=ca[n]) for n, s in services.items()}
            callers = {
                "http": {n: _predict_call(c, rows) for n, c in http.items()},
                "grpc": {n: _predict_call(c, rows) for n, c in grpc.items()},
            }
            say("warming up")
            for per_transport in callers.values():
                for call in per_transport.values():
                    time_calls(call, WARMUP_CALLS)
            samples: dict[str, dict[str, list[float]]] = {p: {"plain": [], "tls": []} for p in callers}
            blocks = max(1, options.calls // options.block)
            for b in range(blocks):
                say(f"block {b + 1}/{blocks}")
                order = ("plain", "tls") if b % 2 == 0 else ("tls", "plain")
                for protocol, per_transport in callers.items():
                    for name in order:
                        samples[protocol][name] += time_calls(per_transport[name], options.block)
            first: dict[str, list[float]] = {"plain": [], "tls": []}
            say("first calls")
            for i in range(options.first_calls):
                for name in ("plain", "tls") if i % 2 == 0 else ("tls", "plain"):
                    # Made before the clock starts: building a TLS client loads the CA into a context (~0.3 ms), which
                    # the gateway does once, not per connection. Timed: connect, handshake and the call.
                    client = LeanHttpPredictorClient(services[name].url, deadline_s=5.0, ca_file=ca[name])
                    try:
                        first[name] += time_calls(_predict_call(client, rows), 1)
                    finally:
                        client.close()
            for lean in http.values():
                lean.close()
            for channel in grpc.values():
                channel.close()
        finally:
            for service in services.values():
                service.child.stop()
    report: dict[str, Any] = {"rows": options.rows, "calls_per_transport": blocks * options.block}
    for protocol, by_name in samples.items():
        plain, tls = percentiles(by_name["plain"]), percentiles(by_name["tls"])
        report[protocol] = {"plain": plain, "tls": tls, "tls_over_plain": _ratio(tls, plain)}
    plain, tls = percentiles(first["plain"]), percentiles(first["tls"])
    report["first_call"] = {"plain": plain, "tls": tls, "tls_over_plain": _ratio(tls, plain), "n": options.first_calls}
    return report


def _predict_call(
    client: LeanHttpPredictorClient | GrpcPredictorClient, rows: list[dict[str, Any]]
) -> Callable[[], None]:
    def call() -> None:
        client.predict(rows)

    return call


def _ratio(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """`a` over `b` per percentile, keyed p50/p99: a ratio, not milliseconds (`p50_ms` named it one).

    >>> _ratio({"p50_ms": 3.0, "p99_ms": 9.0}, {"p50_ms": 2.0, "p99_ms": 4.0})
    {'p50': 1.5, 'p99': 2.25}
    """
    return {k.removesuffix("_ms"): round(a[k] / b[k], 2) for k in a}


def print_report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(report, indent=2)
        return
    print(f"a prediction of {report['rows']} rows, {report['calls_per_transport']} calls per client and transport")
    for key, label in (("http", "lean HTTP client"), ("grpc", "gRPC client"), ("first_call", "new connection")):
        part = report[key]
        p, t, r = part["plain"], part["tls"], part["tls_over_plain"]
        plain = f"plain {p['p50_ms']:.3f} / {p['p99_ms']:.3f} ms"
        tls = f"TLS {t['p50_ms']:.3f} / {t['p99_ms']:.3f} ms"
        print(f"  {label:18} {plain}   {tls}   ratio {r['p50']:.2f} / {r['p99']:.2f}  (p50 / p99)")
