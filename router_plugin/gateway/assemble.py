"""Non-streaming requests measured: sent on as streams, answered to their client as one JSON body.

A non-streaming answer arrives whole, so the gateway cannot tell when its first token came: such a request would
teach the predictor nothing, and the count of tokens in flight (`inflight_work`) would hold its prompt as prefill
work until it completed, however long it had been decoding. So a non-streaming request goes on to the endpoint with
`"stream": true` and `stream_options.include_usage` (the rest of its body as the client sent it), the stream is
timed like any other, and its events are put back together into the body a non-streaming call returns: per choice
the text (in chat, the message's content and reasoning) joined in order, the last value of every other field
(finish and stop reasons), the role, and the usage; the response's own fields (id, created, model, ...) from its
first event, its `object` without `.chunk`.

What the events split in ways not rebuilt here — log-probabilities, tool calls, several choices, the prompt echoed,
token ids, KV-transfer parameters — keeps its request unchanged: the endpoint answers it whole and it is not measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from leadtime.router_plugin.gateway.stream import TEXT_FIELDS, USAGE_ASKED, choice_index, error_in

WHOLE_ONLY_FIELDS = (
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "tools",
    "functions",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "stream_options",
    "kv_transfer_params",
)
"""Request fields whose answer is not rebuilt from events, when set (to anything but null, false or empty: a
completion's `logprobs: 0` asks for the chosen tokens' log-probabilities)."""


def streamed_body(request: dict[str, Any]) -> bytes | None:
    """The body to send on in place of a non-streaming request's, asking for a stream; None to send it unchanged.

    >>> streamed_body({"prompt": "hi", "max_tokens": 3})
    b'{"prompt":"hi","max_tokens":3,"stream":true,"stream_options":{"include_usage":true}}'
    >>> streamed_body({"prompt": "hi", "stream": True}), streamed_body({"prompt": "hi", "logprobs": 2})
    (None, None)
    """
    if request.get("stream"):
        return None
    if any(_set(request.get(name)) for name in WHOLE_ONLY_FIELDS):
        return None
    if request.get("n") not in (None, 1) or request.get("best_of") not in (None, 1):
        return None
    return orjson.dumps({**request, "stream": True, "stream_options": USAGE_ASKED})


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}


@dataclass
class _Choice:
    joined: dict[str, list[str]] = field(default_factory=dict)
    message_joined: dict[str, list[str]] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)
    message_fields: dict[str, Any] = field(default_factory=dict)


def _take(piece: dict[str, Any], joined: dict[str, list[str]], fields: dict[str, Any]) -> None:
    for key, value in piece.items():
        if key in TEXT_FIELDS and isinstance(value, str):
            joined.setdefault(key, []).append(value)
        elif key in TEXT_FIELDS and value is None:
            continue  # no piece (a chat message with no text keeps content null)
        elif value is not None or key not in fields:
            fields[key] = value


class Assembler:
    """Feed it each event of the stream (`add`); `body()` is the non-streaming answer they make.

    >>> a = Assembler()
    >>> a.add({"id": "c1", "object": "chat.completion.chunk", "model": "m",
    ...        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    >>> a.add({"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})
    >>> a.add({"id": "c1", "choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": "stop"}]})
    >>> a.add({"id": "c1", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}})
    >>> a.body()["choices"]
    [{'index': 0, 'message': {'role': 'assistant', 'content': 'Hi there'}, 'finish_reason': 'stop'}]
    >>> a.body()["object"], a.body()["usage"]["completion_tokens"]
    ('chat.completion', 2)
    """

    def __init__(self) -> None:
        self._top: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._chat = False
        self._usage: Any = None
        self.error: dict[str, Any] | None = None
        """The event that reported an error (vLLM's `{"error": {...}}`, or an older `{"object": "error", ...}`),
        which is then the answer."""

    def add(self, event: dict[str, Any]) -> None:
        if error_in(event) is not None:
            self.error = event
            return
        if self._top is None:
            self._top = {k: v for k, v in event.items() if k not in ("choices", "usage")}
        if event.get("usage") is not None:
            self._usage = event["usage"]
        for raw in event.get("choices") or ():
            if not isinstance(raw, dict):
                continue
            choice = self._choices.setdefault(choice_index(raw), _Choice())
            piece = dict(raw)
            piece.pop("index", None)
            delta = piece.pop("delta", None)
            if isinstance(delta, dict):
                self._chat = True
                _take(delta, choice.message_joined, choice.message_fields)
            _take(piece, choice.joined, choice.fields)

    @property
    def answered(self) -> bool:
        """Whether an event carried a choice, with text or without (an answer may be empty: EOS at once). With none,
        the body would be `"choices": []`: no answer, called one.

        >>> a = Assembler()
        >>> a.add({"choices": [], "usage": {"completion_tokens": 0}})
        >>> a.answered
        False
        >>> a.add({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]})
        >>> a.answered
        True
        """
        return bool(self._choices)

    def error_status(self) -> int:
        """The HTTP status of the error reported: its code when that is one, else 500.

        >>> a = Assembler()
        >>> a.add({"error": {"message": "too long", "code": 400}})
        >>> a.error_status()
        400
        >>> b = Assembler()
        >>> b.add({"object": "error", "message": "the engine died", "code": "internal"})
        >>> b.error_status()
        500
        """
        failure = error_in(self.error) if self.error is not None else None
        return 500 if failure is None else failure[0]

    def body(self) -> dict[str, Any]:
        out = dict(self._top or {})
        kind = out.get("object")
        if isinstance(kind, str) and kind.endswith(".chunk"):
            out["object"] = kind[: -len(".chunk")]
        elif kind is None:
            out["object"] = "chat.completion" if self._chat else "text_completion"
        out["choices"] = [self._choice(index, self._choices[index]) for index in sorted(self._choices)]
        if self._usage is not None:
            out["usage"] = self._usage
        return out

    def _choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index}
        if self._chat:
            message: dict[str, Any] = {"role": choice.message_fields.get("role") or "assistant"}
            message.update({k: "".join(v) for k, v in choice.message_joined.items()})
            message.setdefault("content", None)
            message.update({k: v for k, v in choice.message_fields.items() if k != "role"})
            out["message"] = message
        out.update({k: "".join(v) for k, v in choice.joined.items()})
        if not self._chat:
            out.setdefault("text", "")
        out.update(choice.fields)
        return out


def whole_answer(
    assembler: Assembler, headers: list[tuple[bytes, bytes]], status: int
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, headers and body a non-streaming client gets: the endpoint's headers but its content type, and
    the answer the events made (or the error one reported, with its status).

    >>> a = Assembler()
    >>> a.add({"choices": [{"index": 0, "text": "hi"}]})
    >>> status, headers, body = whole_answer(a, [(b"content-type", b"text/event-stream"), (b"x-id", b"r1")], 200)
    >>> status, headers[:2]
    (200, [(b'x-id', b'r1'), (b'content-type', b'application/json')])
    >>> body
    b'{"object":"text_completion","choices":[{"index":0,"text":"hi"}]}'
    """
    if assembler.error is not None:
        status, answer = assembler.error_status(), assembler.error
    else:
        answer = assembler.body()
    body = orjson.dumps(answer)
    out = [(k, v) for k, v in headers if k.lower() != b"content-type"]
    out += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return status, out, body
