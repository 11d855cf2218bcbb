"""Pulling a service's serving model over HTTP: `GET /v1/model` with the digest held as `If-None-Match`.

Two clients need it: the gateway predicting with a copy of the service's model (`leadtime route --pull-model`)
and a prediction server taking its models from a training server (`leadtime serve --role prediction
--model-from URL`, llm-d's two sidecars without a shared volume or Redis). What they share lives here: the
request, the checks (the SHA-256 of what arrived against the ETag the service announced; what the caller's `load`
checks besides, the artifact's own checksum first of all), and logging a failure once when it starts and when its
cause changes, not at every pull: a source gone for good would otherwise write a line a second, forever. An
artifact refused is not downloaded again while the source still serves it (its digest goes in If-None-Match).
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar
from urllib.parse import urlsplit

import httpx

from leadtime.predictor.artifact import ArtifactError
from leadtime.predictor.client import https_context, scheme_hint, time_left

PULL_RESULTS = ("new", "unchanged", "error", "refused")
"""What one pull did: a new model taken, the one held still current (304), the source not answering with a
model, or what it sent refused."""

MAX_MODEL_BYTES = 64 << 20
"""The largest model artifact a pull reads (a served model is a few hundred KB to a few MB): a wrong URL streaming
a huge body is not read whole into memory."""
DEFAULT_PULL_TIMEOUT_S = 30.0
"""A pull's whole deadline by default: a model of a few MB over a slow link (about 1 MB/s) takes seconds to
arrive, more than one step's timeout of a prediction call; while a pull lasts, `POST /reload` on a prediction
server waits for it."""
CONNECT_TIMEOUT_S = 5.0
"""The longest a pull waits to connect (at most its whole deadline): a source that is down is found out in
seconds, not at the end of a deadline sized for a download."""
ROLE_HEADER = "x-leadtime-role"
"""Sent with `GET /v1/model`: the serving process's role. A prediction server takes its models from elsewhere, so
pulling from one (or from oneself) would serve its prior for ever."""

T = TypeVar("T")


def check_model_url(url: str) -> str:
    """`url` if a model can be pulled from it (http(s)://HOST[:PORT][/PREFIX], a port in 1-65535), else
    ValueError saying what is wrong in one line: refused at start, not found out at every pull.

    >>> check_model_url("http://trainer:8000")
    'http://trainer:8000'
    >>> check_model_url("trainer:8000")
    Traceback (most recent call last):
    ...
    ValueError: expected http://HOST:PORT or https://HOST:PORT
    """
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise ValueError("expected http://HOST:PORT or https://HOST:PORT")
    if not parts.hostname:
        raise ValueError("names no host: expected http://HOST:PORT or https://HOST:PORT")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"port {parts.netloc.rsplit(':', 1)[-1]!r} is not a port (1-65535)") from None
    if port == 0:
        raise ValueError("port 0 is not a port to connect to (1-65535)")
    if parts.query or parts.fragment:
        raise ValueError("takes no query or fragment: expected http://HOST:PORT")
    return url


class ModelPull(Generic[T]):
    """Pulls of one source's model, each loaded by `load` (which raises ArtifactError to refuse it).

    Parameters
    ----------
    base_url
        The service, e.g. "http://127.0.0.1:8000"; `/v1/model` is asked of it.
    load
        Checks and loads an artifact's bytes; ArtifactError refuses it (the pull counts as "refused").
    log
        Where failures are logged (once per cause) and recoveries.
    meanwhile
        What the caller does while it holds no model, for the log line of a failure ("serving the prior ...").
    timeout_s
        A pull's deadline, the whole download's (on `time.monotonic()`): the answer is read in chunks and given up
        once it passes, as an "error" ("the answer took longer than N s"), so that a source trickling its answer
        holds a pull (and `POST /reload`, which waits for it) no longer. Each step is bounded by it too (connecting
        by `CONNECT_TIMEOUT_S` at most): a read begun just before the deadline may take it up to about twice as
        long. `load` is not bounded by it.
    api_token
        Sent as a Bearer token (the service does not need one to serve its model, but a proxy in front may).
    ca_file
        With an `https://` URL: the PEM bundle to verify the service's certificate with (default: the system's).
    """

    def __init__(
        self,
        base_url: str,
        load: Callable[[bytes], T],
        log: logging.Logger,
        meanwhile: str,
        timeout_s: float = DEFAULT_PULL_TIMEOUT_S,
        api_token: str | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        try:  # a port out of range or a query: refused when made, not found out at every pull
            check_model_url(base_url)
        except ValueError as err:
            raise ValueError(f"{base_url!r}: {err}") from None
        self._verify: ssl.SSLContext | bool = https_context(base_url, ca_file) or True  # True: httpx's default
        self.url = base_url.rstrip("/") + "/v1/model"
        self.load = load
        self.log = log
        self.meanwhile = meanwhile
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self.digest = ""
        """SHA-256 of the last artifact loaded ("" before any was)."""
        self.version: int | None = None
        """The source's version of the last artifact loaded, as it announced it (None: not announced)."""
        self.pulled_at: float | None = None
        """time.monotonic() of the last pull that found the service (a new model or the same one)."""
        self.failure = ""
        """Why pulls fail now, "" since one succeeded: logged when it changes, not at every pull."""
        self._refused: tuple[str, str] | None = None
        """(SHA-256, why) of the last artifact `load` refused, until one is taken: named in If-None-Match beside
        the held one's, so that the source answers 304 while it serves it still, instead of the same artifact
        being downloaded and refused again at every pull (every second, for ever)."""

    def client(self) -> httpx.Client:
        """An HTTP client for the pulls (keep-alive, the TLS settings and token given; each step bounded by the
        pull's deadline, connecting by `CONNECT_TIMEOUT_S` at most)."""
        timeout = httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, CONNECT_TIMEOUT_S))
        return httpx.Client(timeout=timeout, headers=self._headers, verify=self._verify)

    def age_s(self) -> float | None:
        """Seconds since a pull last found the service (None before any did)."""
        return None if self.pulled_at is None else time.monotonic() - self.pulled_at

    def pull_once(self, client: httpx.Client) -> tuple[str, T | None]:
        """One pull: (what it did, one of `PULL_RESULTS`; what `load` made of a new model, else None). Never
        raises for the source's sake, whatever it answers; a failure is logged when it starts and when its cause
        changes."""
        result, failure, loaded = self._pull(client)
        if failure != self.failure:
            if failure:
                kept = "keeping the model held" if self.digest else self.meanwhile
                self.log.warning("pulling the model from %s failed (%s); %s", self.url, failure, kept)
            else:
                self.log.info("pulling the model from %s succeeds again", self.url)
            self.failure = failure
        return result, loaded

    def _pull(self, client: httpx.Client) -> tuple[str, str, T | None]:
        known = [digest for digest in (self.digest, self._refused[0] if self._refused else "") if digest]
        headers = {"Accept-Encoding": "identity"}  # the service sends models as they are (see `_read_at_most`)
        if known:
            headers["If-None-Match"] = ", ".join(f'"{digest}"' for digest in known)
        until = time.monotonic() + self.timeout_s
        try:
            with client.stream("GET", self.url, headers=headers) as response:
                announced = _etag(response)
                if self._refused is not None and announced == self._refused[0]:  # 304, or a source deaf to it
                    return "refused", self._refused[1], None
                if response.status_code == 304:
                    self.pulled_at = time.monotonic()
                    return "unchanged", "", None
                if response.status_code != 200:
                    return "error", f"answered {response.status_code}", None
                if response.headers.get(ROLE_HEADER) == "prediction":  # takes its models from elsewhere
                    return "refused", "refused: the source is a prediction server, with no model of its own", None
                artifact = _read_at_most(response, MAX_MODEL_BYTES, until)
        except _Unreadable as err:
            return "refused", f"refused: {err}", None
        except TimeoutError:
            return "error", f"the answer took longer than {self.timeout_s:g} s", None
        except httpx.HTTPError as err:
            problem = str(err) or type(err).__name__
            return "error", problem + scheme_hint(self.url.lower().startswith("https://"), problem), None
        if artifact is None:
            return "refused", f"refused: the answer is larger than {MAX_MODEL_BYTES >> 20} MiB", None
        digest = hashlib.sha256(artifact).hexdigest()
        if announced and announced != digest:  # not remembered: what arrives next may be whole
            return "refused", "refused: the model does not match the SHA-256 the service announced", None
        try:
            loaded = self.load(artifact)
        except ArtifactError as err:
            return self._refuse(digest, f"refused: {err}")
        except Exception as err:  # noqa: BLE001 - whatever a body does to the decoding, the pulls go on
            return self._refuse(digest, f"refused: not an artifact ({type(err).__name__})")
        self.digest, self.pulled_at, self._refused = digest, time.monotonic(), None
        self._note_version(response.headers.get("x-leadtime-model-version"))
        return "new", "", loaded

    def _refuse(self, digest: str, failure: str) -> tuple[str, str, T | None]:
        """A pull whose artifact `load` refused: the same bytes would be refused again, so they are not asked
        for again while the source's ETag stays theirs."""
        self._refused = digest, failure
        return "refused", failure, None

    def _note_version(self, announced: str | None) -> None:
        """Warn when the source's version goes back: it restarted without keeping its model (no --model-dir or
        --redis), and what is taken now is its prior again, in place of the trained model held. A version that is
        not ASCII digits is not announced (`isdigit` alone takes "²", which `int` refuses)."""
        version = int(announced) if announced is not None and announced.isascii() and announced.isdigit() else None
        if version is not None and self.version is not None and version < self.version:
            self.log.warning(
                "the model at %s went back from version %d to %d (its server restarted without keeping its model? "
                "give it --model-dir or --redis): taking it",
                self.url,
                self.version,
                version,
            )
        self.version = version


def _etag(response: httpx.Response) -> str:
    """The digest a response's ETag names ("" without one); `W/` dropped, as a proxy that compresses adds it."""
    return response.headers.get("etag", "").strip().removeprefix("W/").strip('"')


class _Unreadable(ValueError):
    """A body in an encoding the pull does not take, or that does not inflate."""


_INFLATED_PIECE = 1 << 20
"""Most bytes inflated from compressed input at once: what a piece of a compressed answer may grow to in memory."""


def _read_at_most(response: httpx.Response, limit: int, until: float) -> bytes | None:
    """The body, or None once it passes `limit` bytes (the rest is not read); TimeoutError once `until` (on
    `time.monotonic()`) has passed, checked at each chunk (httpx bounds each read, not the body).

    The pull asks for the body as it is, but a proxy may compress it anyway: gzip and deflate are inflated here,
    piece by piece against `limit`, not by httpx, which inflates a piece whole before handing it over (5 KB of
    `gzip, gzip` grew to 3 GB). Another encoding is `_Unreadable`."""
    if response.is_stream_consumed:  # made whole in memory (a test's transport): httpx has decoded it already
        return response.content if len(response.content) <= limit else None
    encodings = [e.strip().lower() for e in response.headers.get("content-encoding", "").split(",")]
    encodings = [e for e in encodings if e and e != "identity"]
    unknown = [e for e in encodings if e not in ("gzip", "x-gzip", "deflate")]
    if unknown:
        raise _Unreadable(f"the answer is compressed as Content-Encoding {', '.join(unknown)}, which is not taken")
    pieces: Iterator[bytes] = response.iter_raw()
    for _ in reversed(encodings):  # the last encoding applied comes off first; gzip and zlib headers both read
        pieces = _inflated(pieces)
    chunks, size = [], 0
    for chunk in pieces:
        time_left(until)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _inflated(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """`pieces` of gzip or zlib data, inflated `_INFLATED_PIECE` bytes at most at a time."""
    inflater = zlib.decompressobj(wbits=47)  # 32 + 15: a gzip or a zlib header, told apart by the header
    try:
        for piece in pieces:
            data = piece
            while data:
                out = inflater.decompress(data, _INFLATED_PIECE)
                if out:
                    yield out
                data = inflater.unconsumed_tail
        yield inflater.flush()
    except zlib.error as err:
        raise _Unreadable(f"the compressed answer does not inflate ({err})") from None
