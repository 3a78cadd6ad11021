"""The minimal HTTP/1.1 keep-alive server the stub engines share: read a request, hand (path, body) to the stub,
write the raw response it returns. Enough for engine clients on loopback; nothing else."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Respond = Callable[[str, bytes], Awaitable[bytes]]


class Closing(bytes):
    """A reply after which the connection is closed, whether or not the reply was complete (an engine that dies
    mid-response)."""


_REASONS = {200: b"OK", 400: b"Bad Request"}


def reply(status: int, payload: bytes, content_type: bytes = b"application/json") -> bytes:
    reason = _REASONS.get(status, b"Internal Server Error")
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
        % (status, reason, content_type, len(payload))
        + payload
    )


async def serve(port: int, respond: Respond) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                _method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                out = await respond(path, body)
                writer.write(out)
                await writer.drain()
                if isinstance(out, Closing):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()
