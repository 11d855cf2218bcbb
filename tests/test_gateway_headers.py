"""What the gateway passes on of a request's headers: end-to-end ones, not those its connection names."""

from __future__ import annotations

import asyncio

from raw_endpoint import next_request, post_through

ANSWER = b'{"choices":[{"index":0,"text":" a"}]}'


def test_headers_the_client_names_in_connection_are_not_passed_on() -> None:
    """RFC 9110: a header listed in Connection is for that hop alone; `Connection: close, x-keepme` sent x-keepme
    on to the endpoint."""
    heads: list[bytes] = []

    async def endpoint(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (head := await next_request(reader, writer)) is not None:
            heads.append(head)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(ANSWER), ANSWER)
            )
            await writer.drain()

    headers = {"connection": "close, X-Keepme", "x-keepme": "1", "x-other": "2"}
    assert post_through(endpoint, {"prompt": "x"}, headers).status_code == 200
    (head,) = heads
    names = {line.split(b":")[0].lower() for line in head.split(b"\r\n")[1:] if line}
    assert b"x-other" in names
    assert b"x-keepme" not in names and b"connection" not in names
