"""What the gateway reads of an OpenAI-style request to route it: the prompt, the model, streaming, the SLOs.

Only these are taken from the body, which goes on unchanged but for what the gateway asks of the stream: a
non-streaming request may go on as a stream, to be measured (`assemble`), and a stream whose client did not ask
for the usage goes on asking for it (`stream.StreamMeter` keeps it from that client). A completion's prompt is
text, a list of texts, or token ids; a chat's prompt is its messages rendered as `role: content` lines (text parts
of multi-part contents included). The SLOs come from llm-d's headers `x-llm-d-slo-ttft-ms` and
`x-llm-d-slo-tpot-ms`, else from the gateway's defaults.
"""

from __future__ import annotations

import hmac
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from leadtime.router_plugin.gateway.assemble import streamed_body
from leadtime.router_plugin.gateway.stream import USAGE_ASKED
from leadtime.router_plugin.policy import MIN_SLO_MS

SLO_TTFT_HEADER = b"x-llm-d-slo-ttft-ms"
SLO_TPOT_HEADER = b"x-llm-d-slo-tpot-ms"
MAX_TOKEN_ID = 2**31 - 1
"""Token ids are vocabulary indices: the prefix hashes read them as 32-bit integers."""


class BadRequest(ValueError):
    """The request cannot be routed; `field` names what is wrong (a body field or a header)."""

    def __init__(self, status: int, field: str, problem: str) -> None:
        self.status = status
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    stream: bool
    text: str
    token_ids: list[int] | None
    ttft_slo_ms: float | None
    tpot_slo_ms: float | None
    upstream_body: bytes | None = None
    """Sent on in place of the body, asking the endpoint for a stream (a non-streaming request, to be measured:
    `assemble`) or for the stream's usage (`hide_usage`); None when the body goes unchanged."""
    hide_usage: bool = False
    """The usage event of the stream was asked for by the gateway, not the client: it is not passed on."""


SHOWN_CHARS = 40
"""How much of a refused header value an error quotes: a client's value may be kilobytes long (a 20,000-digit
number), and the answer and the log need only enough of it to recognise it."""


def _shown(raw: bytes) -> str:
    """A header value as an error quotes it: whole when short, else its first `SHOWN_CHARS` characters, or how
    many digits it has when it is all digits (as `features.rows` names an `N-digit number`).

    >>> _shown(b"abc"), _shown(b"9" * 20_000), _shown(b"x" * 50)[-4:]
    ("'abc'", 'a 20,000-digit number', "xx'…")
    """
    text = raw.decode(errors="replace")
    if len(text) <= SHOWN_CHARS:
        return repr(text)
    if text.isdigit():
        return f"a {len(text):,}-digit number"
    return f"{text[:SHOWN_CHARS]!r}…"


_DECIMAL = re.compile(rb"\s*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\s*")
"""An SLO header's number as Go's strconv.ParseFloat reads a decimal (llm-d's router is written in Go): Python's
float() also takes `1_000`, which Go refuses, and a header llm-d turns away would route here with an SLO."""


def _slo(headers: Mapping[bytes, bytes], name: bytes, default: float | None) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return default
    value = float(raw) if _DECIMAL.fullmatch(raw) else math.nan
    if not math.isfinite(value) or not value >= MIN_SLO_MS:
        raise BadRequest(
            422, name.decode(), f"must be a number of milliseconds, at least {MIN_SLO_MS}, got {_shown(raw)}"
        )
    return value


def _content_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    raise BadRequest(422, where, "must be a string or a list of content parts")


def _token_ids(ids: list[Any]) -> list[int] | None:
    """The ids, when every one is an integer; BadRequest when one is outside a vocabulary."""
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return None
    if ids and not 0 <= min(ids) <= max(ids) <= MAX_TOKEN_ID:
        raise BadRequest(422, "prompt", f"token ids must be integers from 0 to {MAX_TOKEN_ID}")
    return ids


def _prompt(body: dict[str, Any]) -> tuple[str, list[int] | None]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "".join(prompt), None
        ids = _token_ids(prompt)
        if ids is None and all(isinstance(p, list) for p in prompt):
            ids = _token_ids([t for p in prompt for t in p])
        if ids is not None:
            return "", ids
    if prompt is None:
        raise BadRequest(422, "prompt", "field required")
    raise BadRequest(422, "prompt", "must be a string, a list of strings or token ids")


def _messages(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(422, "messages", "must be a non-empty list of messages")
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(422, f"messages[{i}]", "must be an object with a role and a content")
        lines.append(f"{message.get('role', '')}: {_content_text(message.get('content'), f'messages[{i}].content')}")
    return "\n".join(lines)


def parse_request(
    path: str,
    body: bytes,
    headers: Mapping[bytes, bytes],
    default_ttft_slo_ms: float | None = None,
    default_tpot_slo_ms: float | None = None,
    measure_non_streaming: bool = False,
    ask_usage: bool = False,
) -> ParsedRequest:
    """Read what routing needs; BadRequest (400 for unreadable JSON, 422 for a bad field) otherwise.

    With `measure_non_streaming`, a non-streaming request goes on as a stream (`assemble.streamed_body`); with
    `ask_usage`, a streaming request without `stream_options` goes on asking for the usage, which counts its
    output tokens exactly when an event carries several (and is kept from the client).
    """
    encoding = headers.get(b"content-encoding", b"").strip().lower()
    if encoding not in (b"", b"identity"):  # as vLLM, the gateway reads bodies as sent: this one is compressed
        shown = encoding.decode("latin-1")[:40]
        raise BadRequest(415, "content-encoding", f"{shown!r} bodies are not accepted: send the JSON uncompressed")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as err:
        raise BadRequest(400, "body", f"not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise BadRequest(422, "body", "must be a JSON object")
    model = data.get("model")
    if model is None:
        model = ""
    if not isinstance(model, str):
        raise BadRequest(422, "model", "must be a string")
    stream = data.get("stream")
    if stream is None:  # as vLLM's request models read it
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(422, "stream", "must be true or false")
    if path.endswith("/chat/completions"):
        text, ids = _messages(data), None
    else:
        text, ids = _prompt(data)
    upstream_body, hide_usage = None, False
    if not stream and measure_non_streaming:
        upstream_body = streamed_body(data)
    elif stream and ask_usage and data.get("stream_options") is None:
        upstream_body, hide_usage = orjson.dumps({**data, "stream_options": USAGE_ASKED}), True
    return ParsedRequest(
        model=model,
        stream=stream,
        text=text,
        token_ids=ids,
        ttft_slo_ms=_slo(headers, SLO_TTFT_HEADER, default_ttft_slo_ms),
        tpot_slo_ms=_slo(headers, SLO_TPOT_HEADER, default_tpot_slo_ms),
        upstream_body=upstream_body,
        hide_usage=hide_usage,
    )


def bearer_ok(headers: Iterable[tuple[bytes, bytes]], keys: Iterable[str]) -> bool:
    """Whether the request shows one of `keys` as `Authorization: Bearer KEY` (compared in constant time).

    >>> bearer_ok([(b"authorization", b"Bearer k2")], ["k1", "k2"]), bearer_ok([], ["k1"])
    (True, False)
    """
    shown = b""
    for name, value in headers:
        if name.lower() == b"authorization":
            shown = value
    scheme, _, token = shown.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    token = token.strip()
    return any(hmac.compare_digest(token, key.encode()) for key in keys)
