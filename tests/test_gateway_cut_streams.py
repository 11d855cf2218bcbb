"""An endpoint that dies in the middle of a stream: the client must learn that its answer was cut off, in the
event vLLM itself sends when a stream fails, not see a stream that looks complete."""

from __future__ import annotations

import asyncio
import json

import pytest
from raw_endpoint import STREAM_HEAD, next_request, post_through

TWO_TOKENS = b'data: {"choices":[{"index":0,"text":" a"}]}\n\ndata: {"choices":[{"index":0,"text":" b"}]}\n\n'
HALF_AN_EVENT = b'data: {"choices":[{"ind'


async def dying_endpoint(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers /metrics; streams two tokens and half an event of a completion, then goes away."""
    if await next_request(reader, writer) is None:
        return  # the gateway closed its scraping connection
    writer.write(STREAM_HEAD)
    piece = TWO_TOKENS + HALF_AN_EVENT
    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.transport.abort()


def through_a_dying_endpoint(body: dict[str, object]) -> str:
    response = post_through(dying_endpoint, body)
    assert response.status_code == 200
    return response.text


@pytest.mark.parametrize("own_options", [False, True])
def test_a_stream_cut_off_by_its_endpoint_ends_with_an_error_event(own_options: bool) -> None:
    body: dict[str, object] = {"prompt": "go on", "max_tokens": 100, "stream": True}
    if own_options:  # the client's own stream_options: its events go on unchanged, the usage is not asked
        body["stream_options"] = {"include_usage": False}
    text = through_a_dying_endpoint(body)
    events = [e for e in text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), text
    payloads = [e[len("data: ") :] for e in events]
    assert payloads[-1] == "[DONE]"
    *tokens, error = [json.loads(p) for p in payloads[:-1]]  # every event is whole: the half one never went on
    assert [t["choices"][0]["text"] for t in tokens] == [" a", " b"]
    assert error["error"]["code"] == 502 and "e-0" in error["error"]["message"]
    assert "mid-stream" in error["error"]["message"]
