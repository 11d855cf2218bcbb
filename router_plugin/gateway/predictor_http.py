"""A lean HTTP client of the predictor's native API, for the gateway's routing path.

`leadtime.predictor.client.HttpPredictorClient` (httpx) spends ~1.5-2 ms of its own per call on this machine, as
much as the service's answer; the gateway's whole budget is 2 ms. This client speaks the same API
(`POST /v1/predict`, `POST /v1/observations`) over one persistent socket: a request is one `sendall`, the answer
is read to its Content-Length, the rows are encoded with orjson. The deadline covers the whole call; a call that
misses it closes the connection (its late answer must not be read as the next call's) and raises
`PredictorUnavailable`, as the httpx client does. Given an `https://` URL it speaks TLS on that socket (the
handshake once per connection, verified against the system's CAs or `ca_file`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

from leadtime.predictor.client import (
    DEFAULT_DEADLINE_S,
    BulkPredictions,
    Obs,
    PredictorError,
    PredictorUnavailable,
    Row,
    answer_field,
    bearer_token,
    call_deadline,
    default_deadline,
    https_context,
    observation_dict,
    parse_answer,
    redirect_refused,
    row_dict,
    scheme_hint,
    time_left,
)


class LeanHttpPredictorClient:
    """`PredictorClient` over HTTP/1.1 keep-alive with a hard deadline per call.

    Parameters
    ----------
    base_url
        e.g. "http://127.0.0.1:8000", or "https://..." for a service over TLS.
    deadline_s
        Default budget of each call, connecting (and the TLS handshake) included.
    api_token
        Sent as a Bearer token (the service's write paths need it when it has one).
    ca_file
        With an `https://` URL: the PEM bundle to verify the service's certificate with (default: the system's).
    """

    def __init__(
        self,
        base_url: str,
        deadline_s: float = DEFAULT_DEADLINE_S,
        api_token: str | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{base_url!r}: expected http://HOST:PORT or https://HOST:PORT")
        self._tls = https_context(base_url, ca_file)
        self.host = parts.hostname
        self.port = parts.port or (443 if self._tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.deadline_s = default_deadline(deadline_s)
        api_token = bearer_token(api_token)
        auth = f"Authorization: Bearer {api_token}\r\n" if api_token else ""
        self._head = f"Host: {self.host}:{self.port}\r\nContent-Type: application/json\r\n{auth}"
        self._sock: socket.socket | None = None
        self._pending = b""

    def _connect(self, until: float) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=time_left(until))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                try:
                    sock = self._tls.wrap_socket(sock, server_hostname=self.host)
                except BaseException:
                    sock.close()
                    raise
            self._sock, self._pending = sock, b""
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._pending = None, b""

    def _recv(self, sock: socket.socket, until: float) -> bytes:
        sock.settimeout(time_left(until))
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the predictor closed the connection")
        return chunk

    def _exchange(self, path: str, body: bytes, until: float) -> tuple[int, bytes, str | None]:
        sock = self._connect(until)
        head = f"POST {self.prefix}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n"
        sock.settimeout(time_left(until))
        sock.sendall(head.encode() + body)
        buf = self._pending
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += self._recv(sock, until)
        lines = buf[:end].decode("latin-1").split("\r\n")
        # What cannot be read as HTTP's head (not a predictor on that port, a proxy gone wrong) is a ConnectionError,
        # an OSError: `_call` closes the socket, whose stream is past reading, and the call is unavailable.
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/") or not (code.isascii() and code.isdigit()):
            raise ConnectionError(f"not an HTTP answer: {lines[0][:80]!r}")
        status = int(code)
        length, location = None, None
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                if not (value.strip().isascii() and value.strip().isdigit()):
                    raise ConnectionError(f"the predictor's answer has a Content-Length of {value.strip()[:40]!r}")
                length = int(value)
            elif name.strip().lower() == "location":
                location = value.strip()
        if length is None:
            raise ConnectionError("the predictor's answer has no Content-Length")
        start = end + 4
        while len(buf) < start + length:
            buf += self._recv(sock, until)
        self._pending = buf[start + length :]
        return status, buf[start : start + length], location

    def _call(self, path: str, payload: Any, deadline_s: float | None) -> Any:
        budget = call_deadline(self.deadline_s, deadline_s)  # 0 has run out, as for the other clients: not "none"
        until = time.monotonic() + budget
        body = orjson.dumps(payload)
        for attempt in (0, 1):
            reused = self._sock is not None
            try:
                status, answer, location = self._exchange(path, body, until)
                break
            except TimeoutError:
                self.close()
                raise PredictorUnavailable("deadline", f"POST {path} exceeded {budget}s") from None
            except OSError as err:
                self.close()
                if reused and attempt == 0 and time.monotonic() < until:
                    continue  # the service closed an idle connection: once more on a new one
                hint = scheme_hint(self._tls is not None, str(err))
                raise PredictorUnavailable("transport", f"POST {path}: {err}{hint}") from None
        if 300 <= status < 400:
            raise redirect_refused(status, location, "POST", path)
        if status >= 400:
            try:
                message = str(orjson.loads(answer).get("error", answer[:200]))
            except orjson.JSONDecodeError:
                message = answer[:200].decode(errors="replace")
            error = PredictorUnavailable if status in (502, 503, 504) else PredictorError
            raise error(status, message)
        return parse_answer(answer, f"POST {path}")

    def predict(self, rows: Sequence[Row], deadline_s: float | None = None) -> BulkPredictions:
        """Mean and upper quantile of TTFT and TPOT per row (POST /v1/predict)."""
        answer = self._call("/v1/predict", {"rows": [row_dict(r) for r in rows]}, deadline_s)
        return BulkPredictions.from_native(answer, len(rows))

    def observe(self, observations: Sequence[Obs], deadline_s: float | None = None) -> int:
        """Report completed requests with what was predicted (POST /v1/observations)."""
        body = {"observations": [observation_dict(o) for o in observations]}
        answer = self._call("/v1/observations", body, deadline_s)
        return int(answer_field(answer, "accepted", "POST /v1/observations"))
