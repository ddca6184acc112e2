"""The benchmarks' lean HTTP/1.1 response reader, on asyncio streams.

Load generators share the machine's CPUs with the servers they measure, so they parse
as little as they can: the status line, the framing (Content-Length or chunked) and,
only when asked, one header. Invariant: `read_response` consumes exactly one response
from a keep-alive connection, so the next request can be written at once.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple


class Response(NamedTuple):
    status: int
    head: bytes  # the status line and the headers, as received
    body: bytes  # de-chunked

    def header(self, name: bytes) -> bytes | None:
        """The value of header `name` (lower case), or None."""
        lower = self.head.lower()
        index = lower.find(b"\r\n" + name + b":")
        if index < 0:
            return None
        start = index + len(name) + 3
        return self.head[start : lower.index(b"\r\n", start)].strip()


async def read_response(reader: asyncio.StreamReader) -> Response:
    """One response: status, head and body (Content-Length or chunked framing; anything
    else is a ValueError, as the benchmarks' servers always frame their answers)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    index = lower.find(b"\r\ncontent-length:")
    if index >= 0:
        end = lower.index(b"\r\n", index + 2)
        return Response(status, head, await reader.readexactly(int(lower[index + 17 : end])))
    if b"transfer-encoding: chunked" not in lower:
        raise ValueError("response without Content-Length or chunked framing")
    chunks: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        data = await reader.readexactly(size + 2)  # the chunk and its CRLF
        if size == 0:
            return Response(status, head, b"".join(chunks))
        chunks.append(data[:-2])
