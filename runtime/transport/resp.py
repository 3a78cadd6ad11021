"""A minimal pipelined Redis client (RESP) for hot paths whose replies are integers, status lines or one string.

Why not redis-py's client there: its command path (connection pool checkout, retry wrapper, response callbacks,
timeout contexts) cost about a fifth of the proxy's CPU per request, for a command whose reply is one integer.
``PipelinedRedis`` keeps one connection: commands are written as they come, replies (which Redis returns in
order) resolve the waiting callers first in, first out. The address comes from the same Redis URL as everywhere
else, parsed by redis-py (``redis://``, ``rediss://`` with TLS, ``unix://``; user, password and db are sent as
``AUTH`` and ``SELECT`` on connect), or, for ``redis+sentinel://`` (``runtime/transport/redis_urls.py``), asked of
the Sentinels at each connect. A lost connection fails the callers that were waiting and the next call connects
again; so does a ``READONLY`` answer (the master it was connected to was demoted in a failover).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Awaitable
from typing import Any

from redis.asyncio.connection import SSLConnection, parse_url
from redis.exceptions import RedisError

from runtime.transport.redis_urls import sentinel_target


class RedisReplyError(Exception):
    """Redis answered with an error (``-ERR ...``)."""


def command(*args: bytes) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


_SKIP_NEXT_REPLY = command(b"CLIENT", b"REPLY", b"SKIP")
"""Redis answers neither this nor the command after it."""


class Replies(asyncio.Protocol):
    """Simple RESP replies (integers, status lines, errors, bulk strings: bytes, or None for nil), matched to the
    waiting futures in order."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.buffer = b""
        self.parts: list[bytes] = []
        """A bulk string still arriving: its pieces so far, joined once it is whole (``buffer`` is then empty).
        Joining on every read instead copied the reply once per read: an 8 MB reply took 0.07 s, 64 MB 6.6 s
        of the event loop (issue 55)."""
        self.have = 0
        self.need = 0
        """Bytes in ``parts``, and how many the reply they begin needs."""
        self.lost = False
        self.can_skip: bool | None = None
        """Whether Redis accepts ``CLIENT REPLY`` (``PipelinedRedis.fire``); None: not asked yet."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.need:
            self.parts.append(data)
            self.have += len(data)
            if self.have < self.need:
                return
            buffer, self.parts, self.have, self.need = b"".join(self.parts), [], 0, 0
        else:
            buffer = self.buffer + data if self.buffer else data
        start = 0
        while (end := buffer.find(b"\r\n", start)) >= 0:
            kind, line = buffer[start : start + 1], buffer[start + 1 : end]
            reply: Any
            if (
                kind == b"$"
            ):  # a bulk string: its length, then that many bytes and CRLF (which may not be here yet)
                size = int(line)
                if size >= 0 and len(buffer) < end + 2 + size + 2:
                    self.parts, self.have = [buffer[start:]], len(buffer) - start
                    self.need, self.buffer = end + 2 + size + 2 - start, b""
                    return
                reply = None if size < 0 else buffer[end + 2 : end + 2 + size]
                start = end + 2 + (size + 2 if size >= 0 else 0)
            elif kind == b":":
                reply = int(line)
                start = end + 2
            elif kind == b"+":
                reply = line.decode()
                start = end + 2
            elif kind == b"-":
                reply = RedisReplyError(line.decode(errors="replace"))
                start = end + 2
            else:  # no command sent here has any other kind of reply
                self._fail(ConnectionError(f"unexpected reply from Redis: {kind + line!r}"))
                return
            if not self.waiting:
                self._fail(ConnectionError("a reply from Redis that nothing asked for"))
                return
            future = self.waiting.popleft()
            if future.done():  # its caller gave up (timeout); the reply still keeps the order
                continue
            if isinstance(reply, RedisReplyError):
                future.set_exception(reply)
                if line.startswith(b"READONLY"):  # a demoted master: the next call connects to the new one
                    self.buffer, self.parts, self.have, self.need = b"", [], 0, 0
                    self._fail(ConnectionError("Redis answered READONLY: its master was demoted"))
                    return
            else:
                future.set_result(reply)
        self.buffer = buffer[start:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(ConnectionError(f"connection to Redis lost ({exc!r})"))

    def _fail(self, exc: Exception) -> None:
        self.lost = True
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def send(self, command: bytes) -> asyncio.Future[Any]:
        if self.lost or self.transport is None:
            raise ConnectionError("not connected to Redis")
        future = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.transport.write(command)
        return future


class PipelinedRedis:
    """One connection, connected on first use and again after it was lost."""

    def __init__(self, url: str, connect_timeout_s: float = 5.0) -> None:
        self.target = sentinel_target(url)
        self.sentinel: Any = self.target.sentinel(connect_timeout_s) if self.target is not None else None
        self.options: dict[str, Any] = dict(parse_url(url)) if self.target is None else {}
        self.connect_timeout_s = connect_timeout_s
        self._conn: Replies | None = None
        self._connecting: asyncio.Lock | None = None

    def send(self, encoded: bytes) -> Awaitable[Any]:
        """Send one encoded command (``command(...)``); await the result for its reply. Connected, this is the
        reply's future itself, with no coroutine around it: it is on the proxy's request path."""
        conn = self._conn
        if conn is None or conn.lost:
            return self._connect_and_send(encoded)
        return conn.send(encoded)

    def fire(self, encoded: bytes) -> Awaitable[Any] | None:
        """Send a command whose reply nobody waits for. Where Redis allows it, it is told not to send one
        (``CLIENT REPLY SKIP``): no reply to read, no wake-up of the event loop for it. Else (or not connected yet)
        the reply's awaitable, as ``send``; None when the command went out without one."""
        conn = self._conn
        if conn is not None and not conn.lost and conn.transport is not None:
            if conn.can_skip:
                conn.transport.write(_SKIP_NEXT_REPLY + encoded)
                return None
            if conn.can_skip is None:  # asked once per connection, beside this command (an ACL may refuse it)
                conn.can_skip = False
                conn.send(command(b"CLIENT", b"REPLY", b"ON")).add_done_callback(
                    lambda asked: setattr(
                        conn,
                        "can_skip",
                        not asked.cancelled() and asked.exception() is None and asked.result() == "OK",
                    )
                )
        return self.send(encoded)

    async def _connect_and_send(self, encoded: bytes) -> Any:
        return await (await self._connect()).send(encoded)

    async def _connect(self) -> Replies:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one connection, however many callers found none
            if self._conn is not None and not self._conn.lost:
                return self._conn
            loop = asyncio.get_running_loop()
            o = self.options
            if self.target is not None:  # the group's master now, and its credentials
                try:
                    host, port = await self.sentinel.discover_master(self.target.master)
                except (
                    RedisError
                ) as exc:  # no Sentinel answers, or none knows a master: like a refused connection
                    raise ConnectionError(f"no Redis master from the Sentinels: {exc}") from exc
                o = {"host": host, "port": port, "db": self.target.db, "password": self.target.password}
                o["username"] = self.target.username
            async with asyncio.timeout(self.connect_timeout_s):
                if "path" in o:
                    _, conn = await loop.create_unix_connection(Replies, o["path"])
                else:
                    tls = ssl.create_default_context() if o.get("connection_class") is SSLConnection else None
                    _, conn = await loop.create_connection(
                        Replies, o.get("host", "localhost"), int(o.get("port", 6379)), ssl=tls
                    )
                try:
                    if o.get("password"):
                        auth = [o["username"].encode()] if o.get("username") else []
                        await conn.send(command(b"AUTH", *auth, o["password"].encode()))
                    if int(o.get("db", 0)):
                        await conn.send(command(b"SELECT", str(int(o["db"])).encode()))
                except BaseException:
                    if conn.transport is not None:
                        conn.transport.close()
                    raise
            self._conn = conn
            return conn

    async def aclose(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None
