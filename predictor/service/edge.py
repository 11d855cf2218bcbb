"""What every route shares at the edge: runtime lookup, auth, JSON bodies and errors, size limit, metrics."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any

import anyio
import orjson
from fastapi import Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leadtime.features.errors import FeatureError, field_path, problem_text
from leadtime.predictor.metrics import UNMATCHED_PATH
from leadtime.predictor.service.hosts import UNCHECKED_PATHS, host_allowed, host_header, host_refusal
from leadtime.predictor.service.runtime import ServiceRuntime
from leadtime.predictor.store.base import StoreClosed


def _runtime(request: Request) -> ServiceRuntime:
    runtime: ServiceRuntime = request.app.state.runtime
    return runtime


# Dependencies are `async def` on purpose: FastAPI runs plain `def` dependencies in a thread pool, which cost
# ~0.3 ms per dependency per request on the hot path (measured with cProfile).
async def runtime_of(request: Request) -> ServiceRuntime:
    """The app's runtime (a dependency)."""
    return _runtime(request)


async def ready_runtime(request: Request) -> ServiceRuntime:
    """The runtime, or 503 while no model can answer (before start-up finished, or after shutdown)."""
    runtime = _runtime(request)
    if not runtime.ready:
        raise HTTPException(503, "the predictor is not ready: the service has not finished starting")
    return runtime


Runtime = Annotated[ServiceRuntime, Depends(runtime_of)]
ReadyRuntime = Annotated[ServiceRuntime, Depends(ready_runtime)]


TOKEN_NEEDED = "this path needs 'Authorization: Bearer <api token>'"


async def require_token(request: Request) -> None:
    """Write paths: with an API token configured, demand `Authorization: Bearer <token>` (the edge refuses a body
    sent without it before reading it: `EdgeMiddleware`)."""
    token = _runtime(request).settings.api_token
    if not token:
        return
    if not bearer_matches(request.headers.get("authorization", ""), token):
        raise HTTPException(401, TOKEN_NEEDED, {"WWW-Authenticate": "Bearer"})


def bearer_matches(header: str, token: str) -> bool:
    """Whether an Authorization header is `Bearer <token>` (compared in constant time)."""
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), token.encode())


NOT_JSON = "is not valid JSON"
"""How a body that does not parse is refused: the one bad input answered 400 (a bad request, not a bad value)."""


async def json_body(request: Request) -> Any:
    """The body parsed once as JSON (`loads_json`); 400 if it is not JSON."""
    raw = await request.body()
    try:
        return loads_json(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise FeatureError("body", f"{NOT_JSON} ({err})") from None


_OVERFLOW = "number is infinity"  # how orjson refuses a number beyond a double's range


def loads_json(raw: bytes) -> Any:
    """A JSON body as llm-d's server reads it, by orjson (~4x faster than json.loads on the router's bodies,
    measured); ValueError if it is not JSON.

    A number beyond a double's range (`1e400`, 400 digits) is valid JSON that orjson refuses: llm-d's server
    (Python's json) reads it as infinite, and ignores it in a key it does not know. So does this, through Python's
    json for that rare body: the checks of a field that holds one refuse it with 422 naming the field (as any
    value out of range), and an unknown key holding one no longer fails the whole body with 400. NaN and
    Infinity, which Python's json would take, stay refused: they are not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        if _OVERFLOW not in str(err):
            raise
    try:
        value = json.loads(raw.decode(), parse_int=_json_int, parse_constant=_not_json)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    try:  # what orjson refuses that Python's json takes, beside overflows: lone surrogates (\ud800)
        orjson.dumps(value)
    except orjson.JSONEncodeError as err:
        raise ValueError(str(err)) from None
    return value


def _json_int(text: str) -> int | float:
    """An integer as orjson reads it: an int within 64 bits, else a float (infinite beyond a double's range;
    `float` reads any length, where `int` refuses more than 4,300 digits)."""
    if len(text) <= 20:
        value = int(text)
        if -(2**63) <= value < 2**64:
            return value
    return float(text)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def list_field(body: Any, name: str, low: int, high: int) -> list[Any]:
    """`body[name]` as a list of low..high items, or FeatureError naming it."""
    if not isinstance(body, dict):
        raise FeatureError("body", f"must be a JSON object with a {name!r} list")
    items = body.get(name)
    if items is None:
        raise FeatureError(name, "is required")
    if not isinstance(items, list):
        raise FeatureError(name, f"must be a list, got {type(items).__name__}")
    if not low <= len(items) <= high:
        raise FeatureError(name, f"must hold {low} to {high:,} items, got {len(items):,}")
    return items


def _loc_text(loc: Any) -> str:
    return field_path(p for p in loc if p != "body") or "body"


def _loc(field: str) -> list[Any]:
    """FastAPI's `loc` of a field path; an index is an int (only ASCII digits: a key "²" is a digit to Python).

    >>> _loc("rows[2].role"), _loc("²")
    (['body', 'rows', 2, 'role'], ['body', '²'])
    """
    loc: list[Any] = ["body"]
    for part in field.replace("]", "").replace("[", ".").split("."):
        if part and not (part == "body" and len(loc) == 1):  # the body itself is ["body"], not ["body", "body"]
            loc.append(int(part) if part.isascii() and part.isdigit() else part)
    return loc


async def feature_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """A FeatureError as 422 (400 for a body that is not JSON; JSON of the wrong shape is a bad value, 422) naming
    the field."""
    assert isinstance(exc, FeatureError)
    status = 400 if exc.field == "body" and exc.problem.startswith(NOT_JSON) else 422
    return JSONResponse(
        {
            "error": str(exc),
            "field": exc.field,
            "detail": [{"loc": _loc(exc.field), "msg": exc.problem, "type": "value_error"}],
        },
        status_code=status,
    )


async def validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """A pydantic validation error as 422 naming the first bad field; a body that is not JSON as 400, as the
    service's own reader (`json_body`) answers it."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
    if first.get("type") == "json_invalid":  # FastAPI's "[0]: JSON decode error": named as json_body names it
        context = first.get("ctx")
        reason = context.get("error") if isinstance(context, dict) else first.get("msg", "")
        return await feature_error_handler(request, FeatureError("body", f"{NOT_JSON} ({reason})"))
    field = _loc_text(first.get("loc", ()))
    detail = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in errors]
    problem = problem_text(first.get("msg", "invalid"))
    return JSONResponse({"error": f"{field}: {problem}", "field": field, "detail": detail}, 422)


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """An HTTPException in the service's JSON shape."""
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
    return JSONResponse({"error": detail, "detail": exc.detail}, exc.status_code, headers=exc.headers)


STORE_CLOSED_RETRY_AFTER_S = 1


async def store_closed_handler(request: Request, exc: Exception) -> JSONResponse:
    """Observations offered once the store has closed (the service is stopping) as 503: none was kept, and the
    caller sends them again, to another replica or after the restart."""
    assert isinstance(exc, StoreClosed)
    return JSONResponse({"error": str(exc)}, 503, headers={"Retry-After": str(STORE_CLOSED_RETRY_AFTER_S)})


async def unexpected_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Anything else as 500 with its type and message (no traceback to the client)."""
    return JSONResponse({"error": f"internal error: {type(exc).__name__}: {exc}"}, 500)


class EdgeMiddleware:
    """Pure ASGI: refuse a Host not among `allowed_hosts` (when any are given) with 400, oversize bodies with 413
    (declared or streamed), answer the hot paths, and record per-route metrics.

    The body is read here, at most `max_body_bytes` of it, and replayed to the app, so a chunked upload
    cannot slip past the limit. `hot_paths` maps a POST path to a handler that answers a body itself ((status,
    whole JSON answer), given the body and the Authorization header) or returns None to leave it to the app.
    Requests under one of `mounts` (static files) are counted under the mount's path, requests that match no route
    as "unmatched". A body refused here (413, 415) is counted under the one of `body_routes` it was sent to: the app
    has not routed it. A body sent to one of `observation_paths` whose sender has hung up by the time it would be
    accepted is not (`_sender_gone`). The Host is checked first, on every path but the probes and /metrics
    (`hosts.UNCHECKED_PATHS`): a page rebound to the service's address learns nothing of the service (not even
    whether it needs a token) and has no body read.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        runtime: ServiceRuntime,
        hot_paths: Mapping[str, Callable[[bytes, str], tuple[int, bytes] | None]] | None = None,
        mounts: Sequence[str] = (),
        body_routes: Sequence[BaseRoute] = (),
        writes: frozenset[str] = frozenset(),
        observation_paths: frozenset[str] = frozenset(),
        allowed_hosts: Sequence[str] = (),
    ) -> None:
        self.app = app
        self.allowed_hosts = tuple(allowed_hosts)
        self.writes = writes
        self.observation_paths = observation_paths
        self.max_body_bytes = max_body_bytes
        self.runtime = runtime
        self.hot_paths = dict(hot_paths or {})
        self.mounts = tuple(mounts)
        self.body_routes = tuple(body_routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status_holder = [500]

        async def send_recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_holder[0] = message["status"]
            await send(message)

        # An exception escaping the app (or a hot path) is answered 500 by Starlette's error middleware outside
        # this one: recorded only on a normal return, every such 500 was missing from the request metrics. Recorded
        # with the status sent, if the answer had started; else as the 500 the client gets.
        try:
            path = await self._answer(scope, receive, send_recording)
        except Exception:
            self._record(scope, None, status_holder[0], started)
            raise
        self._record(scope, path, status_holder[0], started)

    async def _answer(self, scope: Scope, receive: Receive, send_recording: Send) -> str | None:
        """Answer an HTTP request: refused at the edge, by a hot path or by the app. The path to record it under
        when the route the app matched cannot tell (None: it can)."""
        path: str | None = None
        if self._foreign_host(scope):
            await _send_json(send_recording, 400, error_body(host_refusal(host_header(scope["headers"])), "host"))
        elif scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send_recording)
        elif (refusal := self._refusal(scope)) is not None and not _wrong_method(scope):
            status, refused, headers = refusal
            if status == 401:
                path = self._body_route_of(scope) or scope["path"]
            await _send_json(send_recording, status, refused, headers)
        elif refusal is not None:  # the app answers 405 naming the methods the path takes, as llm-d's server does
            await self.app(scope, receive, send_recording)
        else:
            body = await self._read_limited(scope, receive)
            if body is not None and scope["path"] in self.observation_paths and await _sender_gone(receive):
                path = self._body_route_of(scope) or scope["path"]
                await _send_json(send_recording, CLIENT_GONE, _gone_body())
            else:
                hot = self.hot_paths.get(scope["path"]) if scope["method"] == "POST" else None
                answer = hot(body, _header(scope, b"authorization")) if hot is not None and body is not None else None
                if answer is not None:
                    path = scope["path"]
                    await _send_json(send_recording, *answer)
                elif body is None and _wrong_method(scope):
                    await self.app(scope, receive, send_recording)  # 405: the app reads none of the body
                elif body is None:
                    await self._too_large(send_recording)
                else:
                    await self.app(scope, _replay(body, receive), send_recording)
        return path

    def _refusal(self, scope: Scope) -> tuple[int, bytes, Sequence[tuple[bytes, bytes]]] | None:
        """(status, body, headers) of a request refused before its body is read: a Content-Type that is not JSON
        (or none, on a write path) or a compressed body 415, a write without the token 401 (before the body, not
        after 16 MiB); None when the body may be read."""
        content_type = _header(scope, b"content-type")
        if not json_content_type(content_type, required=scope["path"] in self.writes):
            return 415, _unsupported_type(content_type), ()
        encoding = _header(scope, b"content-encoding")
        if encoding.strip().lower() not in ("", "identity"):
            return 415, _unsupported_encoding(encoding), ()
        if scope["path"] in self.writes and not self._authorized(scope):
            return 401, _TOKEN_NEEDED, [(b"www-authenticate", b"Bearer")]
        return None

    def _record(self, scope: Scope, path: str | None, status: int, started: float) -> None:
        """Count and time a request under `path`, else its route, mount or body route, else "unmatched"."""
        if path is None:
            path = (
                getattr(scope.get("route"), "path", None) or self._mount_of(scope["path"]) or self._body_route_of(scope)
            )
            if path is None:  # /openapi.json is the one plain route (fixed path) beside the API's routes
                path = scope["path"] if scope.get("endpoint") is not None else UNMATCHED_PATH
        self.runtime.metrics.observe_request(path, scope.get("method", ""), status, time.perf_counter() - started)

    def _foreign_host(self, scope: Scope) -> bool:
        """Whether hosts are listed and the request's Host is none of them (the probes and /metrics pass)."""
        return (
            bool(self.allowed_hosts)
            and scope["path"] not in UNCHECKED_PATHS
            and not host_allowed(host_header(scope["headers"]), self.allowed_hosts)
        )

    def _authorized(self, scope: Scope) -> bool:
        """Whether a write may proceed: no token is configured, or the request shows it (`require_token`'s rule,
        checked again by the route)."""
        token = self.runtime.settings.api_token
        return not token or bearer_matches(_header(scope, b"authorization"), token)

    def _body_route_of(self, scope: Scope) -> str | None:
        for route in self.body_routes:
            if isinstance(route, Route) and route.matches(scope)[0] == Match.FULL:
                return route.path
        return None

    def _mount_of(self, path: str) -> str | None:
        for mount in self.mounts:
            if path.startswith(mount + "/"):
                return mount
        return None

    async def _read_limited(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None if it exceeds the limit."""
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    if int(value) > self.max_body_bytes:
                        return None
                except ValueError:
                    return None
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _too_large(self, send: Send) -> None:
        body = error_body(f"request body exceeds the limit of {self.max_body_bytes:,} bytes", "body")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _wrong_method(scope: Scope) -> bool:
    """Whether the request's path is one of the app's but none of its routes takes the request's method.

    Why it matters: such a request is answered 405 by the app (with `Allow`, as llm-d's server answers it), not
    refused for its body or token by the edge, which would name a problem the caller does not have (`curl -X
    DELETE /flush` was told its Content-Type was missing). It changes nothing, so it needs no token. Looked at only
    when the edge would refuse a request: the routes are not walked on the hot paths."""
    routes = scope["app"].router.routes
    partial = False
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return False
        partial = partial or match is Match.PARTIAL
    return partial


def error_body(message: str, field: str) -> bytes:
    """A refusal made before FastAPI sees the request, in the shape of its others: `error` and `field`, and
    FastAPI's `detail` (here the message).

    >>> error_body("content-type: must be JSON", "content-type")
    b'{"error":"content-type: must be JSON","field":"content-type","detail":"content-type: must be JSON"}'
    """
    return orjson.dumps({"error": message, "field": field, "detail": message})


def json_content_type(header: str, required: bool = False) -> bool:
    """Whether a request's Content-Type lets its body be read as JSON: `application/json` or a `+json` type, or,
    unless `required` (the paths that change what the service learns), absent.

    Why refuse the rest (415): a web page can make a browser POST `text/plain`, form or multipart bodies, and a Blob,
    an ArrayBuffer or no body at all with no Content-Type, to any address without asking the server first (a
    "simple" cross-origin request), and this service reads JSON from the body whatever the header says. Without an
    API token that would let any page a user on the fleet's network opens feed training data or flush it; a JSON
    Content-Type makes the browser ask first (CORS preflight), which this service never grants.

    >>> json_content_type(""), json_content_type("", required=True), json_content_type("application/json", True)
    (True, False, True)
    """
    media = header.split(";", 1)[0].strip().lower()
    if not media:
        return not required
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _unsupported_type(header: str) -> bytes:
    got = f"got {header[:100]!r}" if header.strip() else "got none (a write path needs it, even with no body)"
    problem = f"Content-Type must be application/json, {got}"
    return error_body(f"content-type: {problem}", "content-type")


def _unsupported_encoding(header: str) -> bytes:
    problem = f"{header.strip()[:40]!r} bodies are not accepted: send the JSON uncompressed"
    return error_body(f"content-encoding: {problem}", "content-encoding")


CLIENT_GONE = 499
"""The status recorded for a request whose sender hung up before it was answered (nginx's; nobody reads it)."""


async def _sender_gone(receive: Receive) -> bool:
    """Whether the sender of a request whose body was read has hung up since: its observations are then not kept,
    as gRPC drops a batch whose caller gave up. Why: a sender that gave up at its deadline (a paused or overloaded
    service) sends the batch again, and a service that kept both learned each observation twice.

    One turn of the event loop first: a hang-up that arrived with the body is read by the server's next read of
    the connection. Then a disconnect already queued is taken without waiting for one (the receive is cancelled
    before it could wait, as Starlette's `Request.is_disconnected` does)."""
    await asyncio.sleep(0)
    message: Message = {}
    with anyio.CancelScope() as scope:
        scope.cancel()
        message = await receive()
    return message.get("type") == "http.disconnect"


def _gone_body() -> bytes:
    return error_body("the sender gave up before its observations were accepted: none of them were kept", "body")


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the already-read body first, then whatever the connection says next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return ""


_TOKEN_NEEDED = json.dumps({"error": TOKEN_NEEDED, "detail": TOKEN_NEEDED}).encode()
"""The edge's 401, as the route's (`http_error_handler`) says it."""


async def _send_json(send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})
