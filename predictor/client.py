"""Clients of the predictor service for the router plugin: HTTP (httpx, keep-alive) and gRPC.

Every call carries a deadline (`deadline_s`, overridable per call): a router must fall back to its heuristics
rather than wait, so a slow or absent predictor raises `PredictorUnavailable` quickly and a refused request
raises `PredictorError` with the service's message. Rows and observations may be llm-d/native dicts or
`leadtime.features.rows` objects. Against a service that serves TLS (`leadtime serve --tls-cert`), the HTTP
clients take an `https://` URL and the gRPC client `tls=True`; `ca_file` names the PEM bundle that signed the
service's certificate when it is not one the system trusts (a private CA, a self-signed certificate).
"""

from __future__ import annotations

import functools
import math
import numbers
import ssl
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from leadtime.features.errors import FeatureError
from leadtime.features.rows import (
    ACTUAL_FIELDS,
    LLMD_REQUIRED_FIELDS,
    MAX_PREDICTED_MS,
    NATIVE_OBSERVATION_FIELDS,
    NATIVE_ROW_FIELDS,
    ROLES,
    FeatureRow,
    Observation,
    check_count,
    check_tensor_parallel,
    feature_row_to_llmd,
    observation_to_llmd,
    parse_timestamp,
    refuse_unknown_fields,
)
from leadtime.predictor.service.keys import check_key

DEFAULT_DEADLINE_S = 0.05
RECONNECT_BACKOFF_MS = 1000
"""The longest a gRPC client waits between attempts to reach a predictor that went away. gRPC's own backoff grows
1.6-fold per attempt up to two minutes: a predictor back after a few minutes away went unasked for up to two more,
every decision falling back meanwhile. One attempt a second is about how often a router tries it anyway."""


class PredictorError(Exception):
    """A call that failed: the service refused it (bad input, unauthorised, too large), and retrying it as it is
    will not help; or, as the subclass `PredictorUnavailable`, the service could not be reached in time."""

    def __init__(self, status: int | str, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(f"{status}: {message}")


class PredictorUnavailable(PredictorError):
    """Deadline exceeded, connection refused, or the service is not ready: fall back and retry later."""


INVALID_ANSWER = "invalid_answer"
"""The status of the `PredictorError` for an answer that cannot be used: not JSON, a field missing, a row's
prediction missing or not finite. The caller falls back to its heuristics, as for a predictor that failed.
(Defined here, with the errors, so that the clients and the router plugin share it.)"""


def parse_answer(content: bytes, where: str) -> Any:
    """A 2xx answer's JSON body (None for an empty one). A body that is not JSON (a proxy's HTML page) is a
    PredictorError(INVALID_ANSWER) naming the call, not orjson's error: callers handle PredictorError only."""
    if not content:
        return None
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        shown = content[:80].decode("utf-8", errors="replace")
        raise PredictorError(INVALID_ANSWER, f"{where}: the answer is not JSON: {shown!r}") from None


def answer_field(answer: Any, name: str, where: str) -> Any:
    """`answer[name]`, or PredictorError(INVALID_ANSWER) when the answer is not an object holding it (a KeyError
    or TypeError would reach the caller as a client bug)."""
    if not isinstance(answer, dict) or name not in answer:
        raise PredictorError(INVALID_ANSWER, f"{where}: the answer has no {name!r}")
    return answer[name]


def served(values: Any) -> np.ndarray:
    """Predicted milliseconds as a predictor serves them: negatives and NaN become 0, an overflow (infinities
    included) `MAX_PREDICTED_MS`. The service answers so over every wire (`service.runtime.served_ms`), and so does
    an in-process learner (`router_plugin.client.predict_in_process`), so that a policy routes alike on either.

    >>> served([-1.0, float("nan"), 12.5, float("inf")]).tolist()
    [0.0, 0.0, 12.5, 1000000000000.0]
    """
    values = np.asarray(values, dtype=np.float64)
    return np.where(values > 0.0, np.minimum(values, MAX_PREDICTED_MS), 0.0)  # NaN > 0 is False


PREDICTED_FIELDS = ("ttft_mean_ms", "ttft_quantile_ms", "tpot_mean_ms", "tpot_quantile_ms")
"""The arrays of an answer, one prediction per row each (`BulkPredictions`, the native API's answer)."""


@dataclass
class BulkPredictions:
    """Milliseconds per row, in row order."""

    ttft_mean_ms: np.ndarray
    ttft_quantile_ms: np.ndarray
    tpot_mean_ms: np.ndarray
    tpot_quantile_ms: np.ndarray
    model_version: int
    quantile: float

    @classmethod
    def from_native(cls, answer: Any, rows: int) -> BulkPredictions:
        """The native API's answer (POST /v1/predict) to `rows` rows as arrays. One that is not that answer (a
        field missing, a value that is not a number, not one prediction per row) is PredictorError(INVALID_ANSWER):
        a router falls back on PredictorError."""
        where = "POST /v1/predict"
        fields = (*PREDICTED_FIELDS, "model_version", "quantile")
        values = [answer_field(answer, name, where) for name in fields]
        try:
            bulk = cls(
                np.asarray(values[0], dtype=float),
                np.asarray(values[1], dtype=float),
                np.asarray(values[2], dtype=float),
                np.asarray(values[3], dtype=float),
                int(values[4]),
                float(values[5]),
            )
        except (TypeError, ValueError) as err:  # None (a native null) reads as nan, not as an error
            raise PredictorError(INVALID_ANSWER, f"{where}: the answer's values are not numbers: {err}") from None
        return bulk.check_rows(rows, where)

    def check_rows(self, rows: int, where: str) -> BulkPredictions:
        """Self, when each array holds one prediction per row sent; else PredictorError(INVALID_ANSWER) naming the
        array: a caller reads predictions by row index, and a short or long array would pair rows with another
        row's prediction, or none."""
        for name in PREDICTED_FIELDS:
            values: np.ndarray = getattr(self, name)
            if values.ndim != 1 or len(values) != rows:
                got = len(values) if values.ndim == 1 else f"an array of shape {values.shape} of"
                raise PredictorError(INVALID_ANSWER, f"{where}: {name}: {got} predictions for {rows} rows")
        return self

    def check_finite(self, where: str) -> BulkPredictions:
        """Self, when every prediction is a finite number of at most `MAX_PREDICTED_MS`; else
        PredictorError(INVALID_ANSWER): a native answer's null reads as NaN and gRPC carries NaN and inf, and one of
        them would make a comparison pick wrongly. One beyond the bound was never a prediction of the service (it
        serves an overflow as the bound), and the `Observation` reporting it would be refused after the request
        completed, its outcome lost."""
        for name in PREDICTED_FIELDS:
            values = getattr(self, name)
            if not np.isfinite(values).all():
                raise PredictorError(INVALID_ANSWER, f"{where}: {name}: not a finite number")
            if (values > MAX_PREDICTED_MS).any():
                raise PredictorError(INVALID_ANSWER, f"{where}: {name}: above {MAX_PREDICTED_MS:g} ms")
        return self


def tls_client_context(ca_file: str | Path | None = None) -> ssl.SSLContext:
    """What a client verifies the service's certificate (and its host name) with: the CA bundle given, else the
    system's trusted CAs. A bundle that cannot be read or holds no certificate is refused here, by its name, rather
    than at the first call, where it would only show as a predictor that cannot be reached.

    >>> tls_client_context().verify_mode == ssl.CERT_REQUIRED
    True
    >>> tls_client_context("/nonexistent/ca.pem")
    Traceback (most recent call last):
    ...
    ValueError: CA file '/nonexistent/ca.pem': No such file or directory
    """
    try:
        return ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    except ssl.SSLError as err:
        raise ValueError(f"CA file {str(ca_file)!r} holds no PEM certificate ({err.reason})") from None
    except OSError as err:
        raise ValueError(f"CA file {str(ca_file)!r}: {err.strerror}") from None


def https_context(base_url: str, ca_file: str | Path | None = None) -> ssl.SSLContext | None:
    """The TLS context of a client of `base_url`: None for a plain `http://` service, whose `ca_file` must then be
    None too (a CA file given to a plain URL is a mistake that would otherwise pass unnoticed). ValueError for a
    URL that is neither (an address without its scheme).

    >>> https_context("http://127.0.0.1:8000") is None
    True
    >>> https_context("https://predictor:8443").check_hostname
    True
    >>> https_context("HTTPS://predictor:8443").check_hostname  # a scheme is case-blind
    True
    """
    if not base_url.lower().startswith(("http://", "https://")):  # httpx took it, and every call then failed
        raise ValueError(f"{base_url!r}: expected http://HOST:PORT or https://HOST:PORT")
    if base_url.lower().startswith("https://"):
        return tls_client_context(ca_file)
    if ca_file is not None:
        raise ValueError(f"{base_url!r}: a CA file is for a service over TLS (https://)")
    return None


Row = Mapping[str, Any] | FeatureRow
Obs = Mapping[str, Any] | Observation


def row_dict(row: Row, where: str = "row") -> dict[str, Any]:
    """A row as the llm-d-shaped dict the service takes."""
    if isinstance(row, FeatureRow):
        return feature_row_to_llmd(row)
    return _mapping(row, "a FeatureRow", where)


def observation_dict(obs: Obs, where: str = "observation") -> dict[str, Any]:
    """An observation as the llm-d-shaped training entry the service takes."""
    if isinstance(obs, Observation):
        return observation_to_llmd(obs)
    return _mapping(obs, "an Observation", where)


def _mapping(item: object, kind: str, where: str) -> dict[str, Any]:
    if not isinstance(item, Mapping):
        problem = f"must be {kind} or a mapping of its fields, got {type(item).__name__}"
        raise PredictorError("invalid", f"{where}: {problem}")
    return dict(item)


def row_dicts(rows: Sequence[Row], name: str = "rows") -> list[dict[str, Any]]:
    """`row_dict` of each row, named `name[i]` in errors."""
    return [row_dict(r, f"{name}[{i}]") for i, r in enumerate(rows)]


def observation_dicts(observations: Sequence[Obs], name: str = "observations") -> list[dict[str, Any]]:
    """`observation_dict` of each observation, named `name[i]` in errors."""
    return [observation_dict(o, f"{name}[{i}]") for i, o in enumerate(observations)]


def default_deadline(deadline_s: Any) -> float:
    """A client's default deadline, checked when the client is made: a positive, finite number of seconds. None
    would make a gRPC call wait for ever on a stalled service, and the other refusals fail at the first call,
    deep inside the transport.

    >>> default_deadline(0.05)
    0.05
    >>> default_deadline(None)
    Traceback (most recent call last):
    ...
    ValueError: deadline_s: must be a number of seconds > 0, got None
    """
    seconds = float(deadline_s) if isinstance(deadline_s, numbers.Real) and not isinstance(deadline_s, bool) else 0.0
    if not 0 < seconds < math.inf:
        raise ValueError(f"deadline_s: must be a number of seconds > 0, got {deadline_s!r}")
    return seconds


def bearer_token(api_token: str | None) -> str | None:
    """A client's API token, None for none (as for ""); ValueError naming it when no header or gRPC metadata can
    carry it (a line break pasted with it, a character beyond ASCII): taken, it failed every call, each client its
    own way, where the service and the gateway refuse such a token at start.

    >>> bearer_token("s3cret"), bearer_token(None)
    ('s3cret', None)
    >>> bearer_token("s3cret\\n")
    Traceback (most recent call last):
    ...
    ValueError: api_token: must be printable ASCII, without spaces, commas, line breaks or control characters, not empty
    """
    if not api_token:
        return None
    try:
        return check_key(api_token)
    except ValueError as err:
        raise ValueError(f"api_token: {err}") from None


def scheme_hint(over_tls: bool, problem: str) -> str:
    """What to change when a failure says a URL's scheme is the wrong one: a service over TLS ends a plain-text
    request's connection unanswered at its handshake, and a plain one answers a TLS hello with no TLS record.

    >>> scheme_hint(False, "Server disconnected without sending a response.")
    ' (if it serves HTTPS, give its https:// URL)'
    >>> scheme_hint(True, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1000)")
    ' (if it serves plain HTTP, give its http:// URL)'
    """
    unanswered = ("closed the connection", "disconnected without sending a response")
    if not over_tls and any(words in problem for words in unanswered):
        return " (if it serves HTTPS, give its https:// URL)"
    if over_tls and "WRONG_VERSION_NUMBER" in problem:
        return " (if it serves plain HTTP, give its http:// URL)"
    return ""


def redirect_refused(status: int, location: str | None, method: str, path: str) -> PredictorError:
    """The error for an answer that is a redirect: not followed (a token would go where the caller did not send
    it), and not an answer either (read as one, its empty body made a TypeError of every call).

    >>> redirect_refused(308, "https://p:8443/v1/predict", "POST", "/v1/predict").message
    'POST /v1/predict was redirected to https://p:8443/v1/predict: give that URL (redirects are not followed)'
    """
    where = f"redirected to {location[:200]}" if location else "redirected"
    return PredictorError(status, f"{method} {path} was {where}: give that URL (redirects are not followed)")


def call_deadline(default_s: float, deadline_s: float | None) -> float:
    """The time budget of one call: the client's default when none is given; one of 0 or less has run out before
    the call (PredictorUnavailable, as any deadline missed; gRPC would read 0 as no deadline at all)."""
    if deadline_s is None:
        return default_s
    if not deadline_s > 0:
        raise PredictorUnavailable("deadline", f"a deadline of {deadline_s} s leaves no time for the call")
    return deadline_s


def time_left(until: float) -> float:
    """Seconds left before `until`, a call's deadline on `time.monotonic()`: the budget of the call's next step
    (connecting, sending, each read), so that the deadline covers the whole call and not each step anew.
    TimeoutError once it has passed."""
    left = until - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def require_rows(rows: Sequence[Any], name: str = "rows") -> None:
    """PredictorError for a prediction call with no rows. The service refuses one (llm-d's API does); every
    client refuses it alike before sending, the in-process one too, so that swapping clients changes nothing.

    >>> require_rows([])
    Traceback (most recent call last):
    leadtime.predictor.client.PredictorError: invalid: rows: must hold at least 1 row, got 0
    """
    if not rows:
        raise PredictorError("invalid", f"{name}: must hold at least 1 row, got 0")


def sendable(items: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """`items` unchanged, or PredictorError naming the first value JSON cannot carry (NaN, an infinity): the
    service would refuse it by name, but the encoder fails first with no name at all.

    >>> sendable([{"a": 1.0}, {"a": float("nan")}], "rows")
    Traceback (most recent call last):
    leadtime.predictor.client.PredictorError: invalid: rows[1].a: must be a finite number, got nan
    """
    for i, item in enumerate(items):
        for key, value in item.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise PredictorError("invalid", f"{name}[{i}].{key}: must be a finite number, got {value}")
    return items


class HttpPredictorClient:
    """Talks to the native `/v1` API (and llm-d's paths) over one keep-alive connection pool.

    Parameters
    ----------
    base_url
        e.g. "http://127.0.0.1:8000".
    deadline_s
        Default time budget of each call. Connecting, sending and waiting for the answer's first bytes are each
        bounded by it (httpx's timeouts are per step), and the answer is read against it as a whole: one that
        trickles in is given up at the deadline. A service that stalls just short of it at every step can hold a
        call up to about three times it (`LeanHttpPredictorClient`, the gateway's, holds one deadline throughout).
    api_token
        Sent as a Bearer token (needed on write paths when the service has one).
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
        import httpx

        self.deadline_s = default_deadline(deadline_s)
        verify: ssl.SSLContext | bool = https_context(base_url, ca_file) or True  # True: httpx's default
        self._httpx = httpx
        api_token = bearer_token(api_token)
        headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self._client = httpx.Client(base_url=base_url, headers=headers, timeout=deadline_s, verify=verify)

    def _deadline(self, deadline_s: float | None) -> float:
        return call_deadline(self.deadline_s, deadline_s)

    def _call(self, method: str, path: str, body: Any = None, deadline_s: float | None = None) -> Any:
        httpx = self._httpx
        budget = self._deadline(deadline_s)
        until = time.monotonic() + budget
        content, headers = None, None
        if body is not None:
            try:  # numpy's scalars as numbers: rows are often built from arrays (the gRPC client takes them)
                content = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
            except TypeError as err:
                raise PredictorError("invalid", f"{method} {path}: the body cannot be sent as JSON: {err}") from None
            headers = {"Content-Type": "application/json"}
        try:
            # httpx's timeout bounds each step (connect, send, each read) anew: the answer is read chunk by chunk,
            # against the call's deadline. (Each step may still take up to the whole budget: see the class.)
            with self._client.stream(method, path, content=content, headers=headers, timeout=budget) as response:
                chunks = []
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    time_left(until)
        except (httpx.TimeoutException, TimeoutError) as err:
            raise PredictorUnavailable("deadline", f"{method} {path} exceeded {budget}s") from err
        except (httpx.TransportError, httpx.DecodingError) as err:  # a body delivered corrupt (gzip) is transport's
            raise PredictorUnavailable("transport", f"{method} {path}: {err}") from err
        except RuntimeError as err:  # httpx: "the client has been closed" (a router falls back on the heuristics)
            raise PredictorUnavailable("closed", f"{method} {path}: {err}") from err
        content = b"".join(chunks)
        if 300 <= response.status_code < 400:
            raise redirect_refused(response.status_code, response.headers.get("location"), method, path)
        if response.status_code >= 400:
            text = content.decode(response.encoding or "utf-8", errors="replace")
            try:
                answer = orjson.loads(content)
                message = str(answer.get("error", text)) if isinstance(answer, dict) else text
            except ValueError:
                message = text
            error = PredictorUnavailable if response.status_code in (502, 503, 504) else PredictorError
            raise error(response.status_code, message)
        return parse_answer(content, f"{method} {path}")

    def predict(self, rows: Sequence[Row], deadline_s: float | None = None) -> BulkPredictions:
        """Mean and upper quantile of TTFT and TPOT per row (POST /v1/predict)."""
        require_rows(rows)
        answer = self._call("POST", "/v1/predict", {"rows": sendable(row_dicts(rows), "rows")}, deadline_s)
        return BulkPredictions.from_native(answer, len(rows))

    def predict_llmd(self, rows: Sequence[Row], deadline_s: float | None = None) -> list[dict[str, Any]]:
        """llm-d's answers (POST /predict/bulk/strict), as llm-d's router would receive them."""
        require_rows(rows, "requests")
        body = {"requests": sendable(row_dicts(rows, "requests"), "requests")}
        answer = self._call("POST", "/predict/bulk/strict", body, deadline_s)
        predictions: list[dict[str, Any]] = answer_field(answer, "predictions", "POST /predict/bulk/strict")
        return predictions

    def observe(self, observations: Sequence[Obs], deadline_s: float | None = None) -> int:
        """Report completed requests with what was predicted (POST /v1/observations); returns how many."""
        body = {"observations": sendable(observation_dicts(observations), "observations")}
        answer = self._call("POST", "/v1/observations", body, deadline_s)
        return int(answer_field(answer, "accepted", "POST /v1/observations"))

    def add_training_data(self, entries: Sequence[Obs], deadline_s: float | None = None) -> str:
        """llm-d's training call (POST /add_training_data_bulk, 202)."""
        body = {"entries": sendable(observation_dicts(entries, "entries"), "entries")}
        answer = self._call("POST", "/add_training_data_bulk", body, deadline_s)
        return str(answer_field(answer, "message", "POST /add_training_data_bulk"))

    def status(self, deadline_s: float | None = None) -> dict[str, Any]:
        """The service's /v1/status answer."""
        answer: dict[str, Any] = self._call("GET", "/v1/status", None, deadline_s)
        return answer

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> HttpPredictorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@functools.cache
def _wire() -> tuple[tuple[str, ...], tuple[str, ...], frozenset[str], frozenset[str], frozenset[str]]:
    """(Row fields, Observation fields but the row, Row text fields, Row count fields, Row real fields), read off
    the proto descriptor once."""
    from leadtime.predictor.grpc import leadtime_pb2 as pb

    row = pb.Row.DESCRIPTOR.fields
    observation = tuple(f.name for f in pb.Observation.DESCRIPTOR.fields if f.name != "row")
    text = frozenset(f.name for f in row if f.type == f.TYPE_STRING)
    counts = frozenset(f.name for f in row if f.type in (f.TYPE_UINT64, f.TYPE_UINT32))
    reals = frozenset(f.name for f in row if f.type in (f.TYPE_DOUBLE, f.TYPE_FLOAT))
    return tuple(f.name for f in row), observation, text, counts, reals


def _wire_fields(row: Row, where: str = "row") -> dict[str, Any]:
    """A row's fields as the wire carries them: only leadtime.v1.Row's, a native `role` as `pod_type`, and
    timeslice_state "none" left unset. What the wire would misread is refused as the service refuses it: a role
    it does not carry (dropped, the row predicted as unified), a tensor-parallel size below 1 (0 reads as 1)."""
    d = row_dict(row, where)
    role = d.get("role")
    if role is not None and role not in ROLES:
        choices = ", ".join(repr(r) for r in ROLES)
        raise PredictorError("invalid", f"{where}.role: must be one of {choices}, got {role!r}")
    if not d.get("pod_type") and role in ("prefill", "decode"):
        d["pod_type"] = role
    fields = {k: d[k] for k in _wire()[0] if d.get(k) is not None}
    for name in _wire()[3] & fields.keys():
        # Checked as the service checks counts, in its words (protobuf's are "Value out of range"), and given as
        # the integers the wire carries: 900.0 and numpy integers are counts over HTTP too.
        try:
            value = fields[name]
            fields[name] = check_tensor_parallel(value) if name == "tensor_parallel" else check_count(name, value)
        except FeatureError as err:
            raise PredictorError("invalid", f"{where}.{err.field}: {err.problem}") from None
    for name in _wire()[4] & fields.keys():  # in the service's words too (protobuf's: "must be real number")
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise PredictorError("invalid", f"{where}.{name}: must be a number, got {value!r}")
    if fields.get("timeslice_state") == "none":
        del fields["timeslice_state"]
    return fields


def row_message(row: Row, where: str = "row") -> Any:
    """A row dict → leadtime.v1.Row (native `role` mapped to `pod_type`; a key the wire lacks is dropped: the
    clients' calls refuse unknown keys first, `native_fields`)."""
    from leadtime.predictor.grpc import leadtime_pb2 as pb

    fields = _wire_fields(row, where)
    try:
        return pb.Row(**fields)
    except (TypeError, ValueError):
        raise PredictorError("invalid", _bad_value(pb.Row, fields, where) or f"{where}: cannot be encoded") from None


def _required(wire: Sequence[Mapping[str, Any]], name: str, fields: Sequence[str] = LLMD_REQUIRED_FIELDS) -> None:
    """PredictorError naming the first item without one of `fields` (llm-d's required ones): on the wire a field
    left out reads as 0, and the row would be predicted or learned as if it had sent 0."""
    for i, item in enumerate(wire):
        for field in fields:
            if field not in item:
                raise PredictorError("invalid", f"{name}[{i}].{field}: is required")


def _bad_value(message: Any, fields: Mapping[str, Any], where: str) -> str | None:
    """Which field a message type refuses (tried one value at a time), for the error to name it; None if none."""
    for name, value in fields.items():
        try:
            message(**{name: value})
        except (TypeError, ValueError) as err:
            return f"{where}.{name}: {err}"
    return None


def row_columns(rows: Sequence[Row]) -> Any:
    """Rows → leadtime.v1.RowColumns, the form the service decodes fastest; None when the rows cannot travel as
    columns (some give `prefix_hit_tokens` and others not), for the caller to send Row messages instead."""
    return _columns([_wire_fields(r, f"rows[{i}]") for i, r in enumerate(rows)])


def _columns(wire: Sequence[Mapping[str, Any]]) -> Any:
    """`row_columns` of rows already in their wire form."""
    from leadtime.predictor.grpc import leadtime_pb2 as pb

    names = set().union(*wire)
    if "prefix_hit_tokens" in names and not all("prefix_hit_tokens" in f for f in wire):
        return None
    lists = {}
    row_fields, _, text_fields, _, _ = _wire()
    for name in row_fields:
        if name in names:
            zero = "" if name in text_fields else 0
            lists[name] = [f.get(name, zero) for f in wire]
    try:
        return pb.RowColumns(**lists)
    except (TypeError, ValueError):
        problems = (_bad_value(pb.Row, f, f"rows[{i}]") for i, f in enumerate(wire))
        raise PredictorError("invalid", next((p for p in problems if p), "rows: cannot be encoded")) from None


def observation_message(obs: Obs, where: str = "observation") -> Any:
    """An observation (dict or Observation) → leadtime.v1.Observation; a timestamp given as text, a datetime or
    milliseconds is sent as the seconds since the epoch it names (read as the service reads one over HTTP)."""
    from leadtime.predictor.grpc import leadtime_pb2 as pb

    d = observation_dict(obs, where)
    if d.get("timestamp") is not None:
        try:
            d["timestamp"] = parse_timestamp(d["timestamp"])
        except FeatureError as err:
            raise PredictorError("invalid", f"{where}.{err.field}: {err.problem}") from None
    fields = {k: d[k] for k in _wire()[1] if d.get(k) is not None}
    row = row_message(d, where)
    try:
        return pb.Observation(row=row, **fields)
    except (TypeError, ValueError):
        problem = _bad_value(pb.Observation, fields, where) or f"{where}: cannot be encoded"
        raise PredictorError("invalid", problem) from None


def native_fields(items: Sequence[Any], where: str, known: frozenset[str]) -> None:
    """PredictorError naming the first key of a dict row or observation that the native API does not have, as the
    service's `/v1` paths refuse it: on the wire an unknown key would be dropped unseen, and a misspelled class
    (`acelerator`) predicted and learned as the default one."""
    try:
        refuse_unknown_fields(items, where, known)
    except FeatureError as err:
        raise PredictorError("invalid", str(err)) from None


def observation_messages(observations: Sequence[Obs]) -> list[Any]:
    """Observations → leadtime.v1.Observation messages, each with every field the service requires (left out,
    it would read as 0 on the wire and be learned so)."""
    native_fields(observations, "observations", NATIVE_OBSERVATION_FIELDS)
    dicts = observation_dicts(observations)
    _required(dicts, "observations", (*LLMD_REQUIRED_FIELDS, *ACTUAL_FIELDS))
    return [observation_message(d, f"observations[{i}]") for i, d in enumerate(dicts)]


class GrpcPredictorClient:
    """Talks to `leadtime.v1.Predictor` over one channel; every call has a deadline.

    Parameters
    ----------
    target
        "host:port" of the gRPC server.
    deadline_s
        Default deadline of each call.
    api_token
        Sent as `authorization: Bearer <token>` metadata (needed by Observe when the service has one).
    tls
        Speak TLS (the service runs with `--tls-cert`); implied by `ca_file`.
    ca_file
        The PEM bundle to verify the service's certificate with (default: the system's trusted CAs).
    """

    def __init__(
        self,
        target: str,
        deadline_s: float = DEFAULT_DEADLINE_S,
        api_token: str | None = None,
        tls: bool = False,
        ca_file: str | Path | None = None,
    ) -> None:
        import grpc

        from leadtime.predictor.grpc import leadtime_pb2_grpc

        self.deadline_s = default_deadline(deadline_s)
        if "://" in target and target.split("://", 1)[0].lower() in ("http", "https", "grpc", "grpcs"):
            # gRPC took it, and every call then failed as UNAVAILABLE: an outage to wait out, for ever.
            raise ValueError(f"{target!r}: expected HOST:PORT (a gRPC target, not a URL)")
        self._grpc = grpc
        options = [
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS),
            # An answer is as large as the rows sent, which the service bounds (LEADTIME_MAX_ROWS); gRPC's default
            # 4 MiB threw away the answer to ~130,000 rows once the service had computed it.
            ("grpc.max_receive_message_length", -1),
        ]
        if ca_file is not None:
            tls_client_context(ca_file)  # refused here by name; gRPC itself would only fail at the first call
            roots = Path(ca_file).read_bytes()
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
            self._channel = grpc.secure_channel(target, credentials, options)
        elif tls:
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(), options)
        else:
            self._channel = grpc.insecure_channel(target, options)
        self._stub = leadtime_pb2_grpc.PredictorStub(self._channel)
        api_token = bearer_token(api_token)
        self._metadata = (("authorization", f"Bearer {api_token}"),) if api_token else ()

    def _deadline(self, deadline_s: float | None) -> float:
        return call_deadline(self.deadline_s, deadline_s)

    def _call(self, method: Any, request: Any, deadline_s: float | None) -> Any:
        grpc = self._grpc
        try:
            return method(request, timeout=self._deadline(deadline_s), metadata=self._metadata)
        except ValueError as err:  # gRPC: "Cannot invoke RPC on closed channel!"
            raise PredictorUnavailable("closed", str(err)) from err
        except grpc.RpcError as err:
            code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
            details = err.details() if hasattr(err, "details") else str(err)
            transient = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            error = PredictorUnavailable if code in transient else PredictorError
            raise error(code.name, details or code.name) from None

    def predict(self, rows: Sequence[Row], deadline_s: float | None = None) -> BulkPredictions:
        """Predictions for every row (sent as columns when they can travel so)."""
        from leadtime.predictor.grpc import leadtime_pb2 as pb

        require_rows(rows)
        native_fields(rows, "rows", NATIVE_ROW_FIELDS)
        # once per call: this is the gateway's path with --predictor-grpc
        wire = [_wire_fields(r, f"rows[{i}]") for i, r in enumerate(rows)]
        _required(wire, "rows")  # on the wire a field left out would read as 0
        columns = _columns(wire)
        if columns is not None:
            request = pb.PredictBulkRequest(columns=columns)
        else:
            request = pb.PredictBulkRequest(rows=[row_message(r, f"rows[{i}]") for i, r in enumerate(rows)])
        try:
            answer = self._call(self._stub.PredictBulk, request, deadline_s)
        except PredictorError as err:
            if columns is None or not err.message.startswith(("columns[", "columns:")):
                raise
            # The service names a column entry by its row's index, and the columns' length as theirs: the caller
            # gave rows, and reads them so.
            raise type(err)(err.status, "rows" + err.message.removeprefix("columns")) from None
        return BulkPredictions(
            np.asarray(answer.ttft_mean_ms, dtype=float),
            np.asarray(answer.ttft_quantile_ms, dtype=float),
            np.asarray(answer.tpot_mean_ms, dtype=float),
            np.asarray(answer.tpot_quantile_ms, dtype=float),
            int(answer.model_version),
            float(answer.quantile),
        ).check_rows(len(rows), "PredictBulk")

    def observe(self, observations: Sequence[Obs], deadline_s: float | None = None) -> int:
        """Send observations in one call; returns how many were accepted."""
        from leadtime.predictor.grpc import leadtime_pb2 as pb

        request = pb.ObserveRequest(observations=observation_messages(observations))
        return int(self._call(self._stub.Observe, request, deadline_s).accepted)

    def observe_stream(self, batches: Iterable[Sequence[Obs]], deadline_s: float | None = None) -> int:
        """Send batches on one client stream; the deadline covers the whole stream.

        A batch that cannot be sent (or `batches` itself failing) ends the stream there: the service answers for
        the batches before it, and the error says how many of their observations it accepted."""
        from leadtime.predictor.grpc import leadtime_pb2 as pb

        failed: list[tuple[int, Exception]] = []

        def requests() -> Iterator[Any]:
            k = 0
            try:
                for k, batch in enumerate(batches):  # noqa: B007 (k names the batch that failed)
                    yield pb.ObserveRequest(observations=observation_messages(batch))
            except Exception as err:  # raised into gRPC's sending thread it would read "Exception iterating"
                failed.append((k, err))

        accepted = int(self._call(self._stub.ObserveStream, requests(), deadline_s).accepted)
        if failed:
            k, err = failed[0]
            kept = f"{accepted:,} observations of the batches before it were accepted"
            if isinstance(err, PredictorError):
                raise PredictorError(err.status, f"batches[{k}].{err.message} ({kept})") from None
            err.add_note(kept)
            raise err
        return accepted

    def status(self, deadline_s: float | None = None) -> dict[str, Any]:
        """The service's Status answer as a dict."""
        from leadtime.predictor.grpc import leadtime_pb2 as pb

        answer = self._call(self._stub.Status, pb.StatusRequest(), deadline_s)
        return {
            "is_ready": answer.is_ready,
            "model_version": answer.model_version,
            "objective_type": answer.objective_type,
            "quantile": answer.quantile,
            "last_model_load": answer.last_model_load or None,
            "role": answer.role,
            "holds_training_lease": answer.holds_training_lease,
            "components": dict(answer.components),
            "observations": dict(answer.observations),
        }

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> GrpcPredictorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
