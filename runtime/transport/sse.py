"""Server-sent events read as bytes, a network read at a time.

httpx's ``aiter_lines`` decodes to text and yields line by line in Python; a relay that then writes each event on
its own pays one socket write per token. Here each network read becomes one list of ``data:`` payloads (bytes,
which msgspec decodes directly), so a relay writes once per read and a burst of events stays one burst. Nothing
waits for more input: a read's events are handed on as soon as the read is split.
"""

from __future__ import annotations

from collections.abc import AsyncIterator


class DataLines:
    """Splits received bytes into SSE ``data:`` payloads; a line cut off by the end of a read waits for the next."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, piece: bytes) -> list[bytes]:
        data = self._tail + piece if self._tail else piece
        # SSE allows CRLF and bare CR line ends; a CRLF split across two reads adds a blank line (harmless here).
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = data.split(b"\n")
        self._tail = lines.pop()
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]

    def finish(self) -> list[bytes]:
        """The last line, when the stream ended without a line end after it."""
        tail, self._tail = self._tail, b""
        return [tail[5:].strip()] if tail.startswith(b"data:") else []


async def data_batches(stream: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The ``data:`` payloads of each read of ``stream`` (reads that hold none are skipped)."""
    lines = DataLines()
    async for piece in stream:
        if batch := lines.feed(piece):
            yield batch
    if batch := lines.finish():
        yield batch
