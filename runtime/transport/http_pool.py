"""A lean HTTP/1.1 client transport for engine calls: asyncio protocols with httptools' C parser behind httpx's
request and response types (what ``EngineClient`` speaks).

Why not httpx's own transport: httpcore parses HTTP in pure Python (h11) behind anyio's stream layers, which cost
the proxy more CPU per request than everything else it does; and its pool polls every pooled connection on every
request, which took half the proxy's CPU at 64 concurrent requests. Replacing it cut the proxy's CPU per 1,000 requests
from 1.38 s to 0.87-1.0 s at 16 concurrent requests and from 1.23 s to 0.80 s at 64, and raised throughput at 64 from
0.43x to 0.71x of direct (``bench/proxy.py``, bench/RESULTS.md). Idle connections are kept per origin in a LIFO list and
only the one handed out is checked.

What it does: keep-alive reuse; ``Content-Length``, chunked and read-until-close bodies; streamed bodies with
backpressure (reading pauses while more than 1 MiB waits unread); connect and read timeouts from the request's
``timeout`` extension; one transparent retry when a *reused* connection turns out to have been closed by the
server before any response byte arrived; errors as httpx's exceptions (``ConnectError``, ``ConnectTimeout``,
``ReadTimeout``, ``ReadError``, ``RemoteProtocolError``), which is what the engine client handles.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httptools
import httpx

_HIGH_WATER = 1 << 20
_Key = tuple[str, str, int]


class _StaleConnection(Exception):
    """A reused connection was closed by the server before it answered: safe to send again on a new one."""


class _Connection(asyncio.Protocol):
    def __init__(self, key: _Key) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = time.monotonic()
        self.loop = asyncio.get_running_loop()
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.received_any = False
        self.error: Exception | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self._delimited = False
        self._wake: asyncio.Future[None] | None = None

    # asyncio.Protocol ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response from the server: {exc}"))
            self.close()

    def eof_received(self) -> bool | None:
        if self.headers_done and not self.complete and not self._delimited:
            self.complete = True  # a body that ends when the connection does
            self._notify()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            if not self.received_any and self.reused:
                self._fail(_StaleConnection())
            else:
                self._fail(httpx.ReadError(f"the server closed the connection mid-response ({exc!r})"))

    # httptools callbacks ------------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
            self._delimited = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        # Asked now: llhttp forgets it once the message is complete.
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._notify()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._notify()

    def on_message_complete(self) -> None:
        self.complete = True
        self._notify()

    # the client side ----------------------------------------------------------------------------------------

    def _notify(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _fail(self, exc: Exception) -> None:
        self.error = exc
        self._notify()

    async def wait(self, read_timeout: float | None) -> None:
        # A timer on the loop instead of wait_for, which costs a task and a timeout context on every wait.
        loop = asyncio.get_running_loop()
        self._wake = wake = loop.create_future()
        timer = None if read_timeout is None else loop.call_later(read_timeout, _expire, wake, read_timeout)
        try:
            await wake
        finally:
            self._wake = None
            if timer is not None:
                timer.cancel()

    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self._reset()
        self.transport.write(head + body)  # one write, one syscall on the hot path

    def take_chunk(self) -> bytes | None:
        """Everything received and not yet taken, as one piece: a reader that wakes once per network read (an
        engine's burst of SSE events in one chunked-encoding read) handles it once, not once per chunk."""
        chunks = self.chunks
        if not chunks:
            return None
        if len(chunks) == 1:
            chunk = chunks.popleft()
        else:
            chunk = b"".join(chunks)
            chunks.clear()
        self.buffered -= len(chunk)
        if self.paused and self.buffered <= _HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    @property
    def reusable(self) -> bool:
        return (
            self.complete
            and self.error is None
            and not self.closed
            and self.keep_alive
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(wake: asyncio.Future[None], read_timeout: float) -> None:
    if not wake.done():
        wake.set_exception(httpx.ReadTimeout(f"no data from the server within {read_timeout} s"))


def request_head(method: str, url: httpx.URL, headers: dict[str, str]) -> tuple[_Key, bytes]:
    """The pool key and the request head up to (not including) Content-Length, for ``LeanPool.fetch``: built
    once per endpoint by its callers."""
    key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
    lines = [f"{method} ".encode() + url.raw_path + b" HTTP/1.1\r\n", b"host: " + url.netloc + b"\r\n"]
    lines += [f"{name}: {value}\r\n".encode("latin-1") for name, value in headers.items()]
    return key, b"".join(lines)


class _Body(httpx.AsyncByteStream):
    def __init__(self, pool: LeanPool, conn: _Connection, read_timeout: float | None) -> None:
        self._pool, self._conn, self._timeout = pool, conn, read_timeout
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            chunk = conn.take_chunk()
            if chunk is not None:
                yield chunk
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait(self._timeout)

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self._conn)


class LeanPool(httpx.AsyncBaseTransport):
    def __init__(self, max_idle_per_origin: int = 256, keepalive_expiry_s: float = 30.0) -> None:
        self.max_idle = max_idle_per_origin
        self.keepalive_expiry_s = keepalive_expiry_s
        self._idle: dict[_Key, list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _take(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        while idle:
            conn = idle.pop()
            # A connection of an earlier event loop of this process (asyncio.run twice) is unusable; closing it
            # would need that loop, so it is left to the collector.
            if conn.loop is not loop:
                continue
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self.keepalive_expiry_s:
                conn.close()
                continue
            conn.reused = True
            return conn
        return None

    def _release(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if conn.reusable and len(idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, key: _Key, connect_timeout: float | None) -> _Connection:
        scheme, host, port = key
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(key), host, port, ssl=context), connect_timeout
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} took over {connect_timeout} s") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        body = await request.aread()
        head = b"".join(
            [
                request.method.encode(),
                b" ",
                url.raw_path,
                b" HTTP/1.1\r\n",
                *(name + b": " + value + b"\r\n" for name, value in request.headers.raw),
                b"\r\n",
            ]
        )
        for _ in range(2):
            conn = self._take(key) or await self._connect(key, timeouts.get("connect"))
            conn.send(head, body)
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait(timeouts.get("read"))
            except _StaleConnection:
                continue
            except BaseException:
                conn.close()
                raise
            return httpx.Response(
                status_code=conn.status,
                headers=conn.headers,
                stream=_Body(self, conn, timeouts.get("read")),
                extensions={"http_version": b"HTTP/1.1"},
            )
        raise httpx.RemoteProtocolError("the server closed two connections in a row without answering")

    async def fetch(self, key: _Key, head: bytes, body: bytes, timeouts: dict[str, Any]) -> tuple[int, bytes]:
        """Status and whole body of one request (``head`` from ``request_head``), without httpx's request and
        response objects, whose construction and body iteration cost more CPU than the exchange itself. Same
        connections, retry of a stale reused one, timeouts and httpx exceptions as ``handle_async_request``."""
        head += b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
        read_timeout = timeouts.get("read")
        for _ in range(2):
            conn = self._take(key) or await self._connect(key, timeouts.get("connect"))
            conn.send(head, body)
            parts: list[bytes] = []
            try:
                while True:
                    chunk = (
                        conn.take_chunk()
                    )  # taken as it comes: a large body must not stall on backpressure
                    if chunk is not None:
                        parts.append(chunk)
                    elif conn.complete:
                        break
                    elif conn.error is not None:
                        raise conn.error
                    else:
                        await conn.wait(read_timeout)
            except _StaleConnection:
                continue
            except BaseException:
                conn.close()
                raise
            status = conn.status
            self._release(conn)
            return status, b"".join(parts)
        raise httpx.RemoteProtocolError("the server closed two connections in a row without answering")

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
