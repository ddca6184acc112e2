"""A raw HTTP/1.1 upstream for tests: it answers the i-th request on a connection with
bytes the test scripts, so tests can play a broken upstream byte for byte."""

from __future__ import annotations

import asyncio


class ScriptedServer:
    """Answers the i-th request on a connection with `reply(i)`: bytes, or a list of bytes
    (written in turn), floats (pauses), asyncio.Events (wait until set) and None (close the connection there); a reply
    of None closes the connection without answering."""

    def __init__(self, reply):
        self.reply = reply
        self.connections = 0
        self.requests: list[bytes] = []

    async def start(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader, writer):
        self.connections += 1
        index = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                answer = self.reply(index)
                index += 1
                if answer is None:
                    break
                parts = answer if isinstance(answer, list) else [answer]
                if None in parts:
                    parts = parts[: parts.index(None)]
                for part in parts:
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                    elif isinstance(part, asyncio.Event):
                        await part.wait()
                    else:
                        writer.write(part)
                        await writer.drain()
                if len(parts) < len(answer if isinstance(answer, list) else [answer]):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self):
        self.server.close()
        await self.server.wait_closed()
