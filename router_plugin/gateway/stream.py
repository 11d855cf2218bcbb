"""TTFT and ITL measured from an OpenAI-style event stream as it passes through the gateway.

The stream is `data: {json}` events separated by blank lines, ending with `data: [DONE]`. An event whose choices
carry text (`text`, or in chat `delta.content`, or a reasoning model's thinking, `delta.reasoning` /
`delta.reasoning_content`: `TEXT_FIELDS`) or a piece of a tool call (`TOOL_FIELDS`) is a token; its arrival time at
the gateway is when the gateway saw the bytes. TTFT is the first token's time less when the request was sent to its
endpoint; ITL is the mean gap between the first and the last token. A final usage event
(`stream_options.include_usage`) gives the exact token counts, which replace the count of token events (an event
may carry more than one token). The gateway asks for that event when the client did not (`requests.parse_request`),
and then keeps it from the client (`hide_usage`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

TEXT_FIELDS = ("text", "content", "reasoning_content", "reasoning")
"""The fields of a choice (in chat, of its delta) that carry a piece of the answer's text: an event with one that is
not empty is a token, and a non-streaming answer's text is each joined in order (`assemble`). A reasoning model's
thinking is tokens too: `reasoning` (newer vLLM) or `reasoning_content`."""
TOOL_FIELDS = ("tool_calls", "function_call")
"""The fields of a chat delta that carry a piece of a tool call (its name, its arguments) rather than text: an answer
that calls a tool streams in them alone, and is generated token by token as any other."""
USAGE_ASKED = {"include_usage": True}
"""The `stream_options` that ask an OpenAI-compatible server for the usage event at the end of a stream."""


class StreamMeter:
    """Feed it the body as it arrives; it keeps the first and last token times and the counts.

    >>> meter = StreamMeter()
    >>> _ = meter.feed(b'data: {"choices":[{"text":" a"}]}\\n\\ndata: {"choi', 10.0)
    >>> _ = meter.feed(b'ces":[{"text":" b"}]}\\n\\ndata: {"choices":[{"text":" c"}]}\\n\\ndata: [DONE]\\n\\n', 30.0)
    >>> meter.tokens, meter.first_ms, meter.last_ms, meter.itl_ms()
    (3, 10.0, 30.0, 10.0)

    With `hide_usage`, `feed` passes on every event but the usage's, which the gateway asked for itself:

    >>> meter = StreamMeter(hide_usage=True)
    >>> meter.feed(b'data: {"choices":[{"text":" a b"}]}\\n\\n'
    ...            b'data: {"choices":[],"usage":{"completion_tokens":2}}\\n\\ndata: [DONE]\\n\\n')
    b'data: {"choices":[{"text":" a b"}]}\\n\\ndata: [DONE]\\n\\n'
    >>> meter.tokens
    2
    """

    def __init__(self, on_event: Callable[[dict[str, Any]], None] | None = None, hide_usage: bool = False) -> None:
        self._on_event = on_event
        """Handed every event's JSON object as it is read (to put a non-streaming answer back together)."""
        self._hide_usage = hide_usage
        self._tail = b""
        self.events = 0
        self.first_ms: float | None = None
        self.last_ms: float | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.error: str | None = None
        """The message of the error event the stream carried (`error_in`), if it carried one."""
        self.error_status: int | None = None
        """That event's status: the endpoint failed the request after answering 200, and this is how it answers."""
        self.done = False
        """Whether `data: [DONE]` was read: the client has its whole answer (it may hang up before the endpoint
        ends the response)."""
        self._choices: set[int] = set()
        """The indices of the choices that carried text."""

    def feed(self, data: bytes, now_ms: float | None = None) -> bytes:
        """Read the next piece of the stream; the bytes to pass on to the client: its complete events (an event
        cut between two pieces goes on with the second, so that a stream that breaks off leaves the client no
        half event), and with `hide_usage` all but the usage's."""
        raw = self._tail + data if self._tail else data
        lf, crlf = raw.rfind(b"\n\n"), raw.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if end == 0:
            self._tail = raw
            return b""
        complete, self._tail = raw[:end], raw[end:]
        text = complete.replace(b"\r\n", b"\n") if b"\r\n" in complete else complete
        events = text.split(b"\n\n")[:-1]
        stamp = now_ms if now_ms is not None else time.monotonic() * 1e3
        if not self._hide_usage:
            for event in events:
                self._event(event, stamp)
            return complete
        return b"".join(event + b"\n\n" for event in events if self._event(event, stamp))

    def rest(self) -> bytes:
        """At the end of the stream, what `feed` still holds to pass on (an unfinished last event)."""
        tail, self._tail = self._tail, b""
        return tail

    def _event(self, event: bytes, now_ms: float) -> bool:
        """Read one event; False for the usage's when it is hidden from the client."""
        payload = b""
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payload += line[5:].lstrip()
        if payload == b"[DONE]":
            self.done = True
            return True
        if not payload:
            return True
        try:
            obj: Any = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return True
        if not isinstance(obj, dict):
            return True
        if self._on_event is not None:
            self._on_event(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
            if self._hide_usage and not obj.get("choices"):
                return False
        failure = error_in(obj)
        if failure is not None:
            self.error_status, self.error = failure
        texts = [c for c in obj.get("choices") or () if _has_token(c)]
        if texts:
            self.events += 1
            self._choices.update(choice_index(c) for c in texts)
            if self.first_ms is None:
                self.first_ms = now_ms
            self.last_ms = now_ms
        return True

    def _usage(self, usage: dict[str, Any]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        if isinstance(completion, int):
            self.completion_tokens = completion

    def feed_json(self, body: bytes) -> None:
        """A non-streaming answer: only its usage counts can be read."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            self._usage(obj["usage"])

    @property
    def tokens(self) -> int:
        """Output tokens: the usage count when reported, else the token events seen."""
        return self.completion_tokens if self.completion_tokens is not None else self.events

    def itl_ms(self) -> float:
        """Mean gap between one choice's output tokens (0 with fewer than two); with several choices (`n`), each
        is taken to have its share of the tokens, decoded side by side."""
        n = self.tokens / max(len(self._choices), 1)
        if n < 2 or self.first_ms is None or self.last_ms is None:
            return 0.0
        return (self.last_ms - self.first_ms) / (n - 1)


def _has_token(choice: Any) -> bool:
    """Whether a choice carries a piece of the answer: text (`TEXT_FIELDS`), itself or in its delta, or a piece of a
    tool call (`TOOL_FIELDS`, in its delta).

    >>> _has_token({"delta": {"reasoning": "hm"}}), _has_token({"text": ""}), _has_token({"delta": {"role": "x"}})
    (True, False, False)
    >>> _has_token({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}})
    True
    """
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    pieces = (choice, delta) if isinstance(delta, dict) else (choice,)
    if any(piece.get(name) for piece in pieces for name in TEXT_FIELDS):
        return True
    return isinstance(delta, dict) and any(delta.get(name) for name in TOOL_FIELDS)


def error_in(event: dict[str, Any]) -> tuple[int, str] | None:
    """The status and message of an error event, which is how vLLM fails a request once it has answered 200 (its
    `{"error": {...}}`, or an older server's `{"object": "error", ...}`); None for any other event. The status is
    the event's code when that is one, else 500.

    >>> error_in({"error": {"message": "too long", "type": "BadRequestError", "code": 400}})
    (400, 'too long')
    >>> error_in({"object": "error", "message": "the engine died", "code": "internal"})
    (500, 'the engine died')
    >>> error_in({"error": "Unauthorized"}), error_in({"choices": [], "error": None})
    ((500, 'Unauthorized'), None)
    """
    if event.get("error") is None and event.get("object") != "error":
        return None
    inner = event["error"] if event.get("error") is not None else event
    if not isinstance(inner, dict):
        return 500, str(inner)[:200]
    code, message = inner.get("code"), inner.get("message")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    return status, str(message if message is not None else inner)[:200]


def choice_index(choice: dict[str, Any]) -> int:
    """Which choice an event's piece belongs to (0 when it does not say, or says it oddly)."""
    index = choice.get("index", 0)
    return index if isinstance(index, int) else 0
