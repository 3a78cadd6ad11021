"""uvicorn's HTTP protocols with the limits a server facing strangers needs and uvicorn 0.54 lacks.

uvicorn has no deadline for a request's head or body (its keep-alive timer starts only after a response and is
cancelled by any byte received), no cap on a head's size under httptools, and its ``limit_concurrency`` answers 503
only once a head is complete, so half-sent requests hold connections forever and starve real ones (issue 32: 30
half-sent requests were all still open after 20 s). Here, per connection:

- the whole head (request line and headers) must arrive within ``head_timeout_s`` of the connection opening or of
  the previous response ending (an idle keep-alive connection is closed after it too), else the connection is
  aborted;
- the whole body must arrive within ``body_timeout_s`` of the head, else a 408 in OpenAI's error shape (or, when
  the app already answered, an abort);
- a head over ``max_head_bytes`` (counted across reads, up to the blank line that ends it) is a 431 and the
  connection closes, before the parser sees it;
- connections cannot be hoarded (issue 42: 1,030 idle connections from one address reset 38 of 40 other clients'
  requests): when a new connection would pass ``max_connections`` in all, or ``max_connections_per_address`` from
  its address, the oldest connection still waiting for a request head is closed to make room (of its own address
  at that address's cap, else of the address holding the most), and only when none is waiting is the new one
  refused. A client that sends its requests keeps its connection; one that sits on connections loses them first.

Each is counted in ``turnstream_http_connections_refused_total{reason}``. One timer per request does it all: armed
when a head is awaited, it is not touched when the head arrives (the hot path only notes the time) and, when it
fires, looks at where the request is.
"""

from __future__ import annotations

import asyncio
import re
from typing import cast

import h11
from prometheus_client import Counter
from uvicorn.protocols.http.h11_impl import H11Protocol

REFUSED = Counter(
    "turnstream_http_connections_refused_total",
    "Connections closed before a request was served: head_timeout (the request's head did not arrive in time), "
    "body_timeout, head_too_large, connection_limit (refused: every connection busy), evicted (an idle one closed "
    "to make room)",
    ["reason"],
)


def _response(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
        % (status, len(body), body)
    )


def _error(message: str, code: str) -> bytes:
    return b'{"error":{"message":"%s","type":"invalid_request_error","param":null,"code":"%s"}}' % (
        message.encode(),
        code.encode(),
    )


_HEAD_END = re.compile(rb"\n\r?\n")
"""The blank line that ends a request head (CRLF, or the bare LF a lenient parser takes too)."""


class Limits:
    """The limits one server applies (class attributes of the protocol class ``guarded`` builds)."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_head_bytes: int = 64 * 1024
    max_connections: int = 1024
    max_connections_per_address: int = 256
    """0: no cap per address (behind a load balancer every client has its address)."""


class Registry:
    """The open connections of one server, by peer address."""

    def __init__(self) -> None:
        self.total = 0
        self.by_address: dict[str, set[_Guard]] = {}

    def add(self, conn: _Guard) -> None:
        self.by_address.setdefault(conn.address, set()).add(conn)
        self.total += 1

    def discard(self, conn: _Guard) -> None:
        held = self.by_address.get(conn.address)
        if held is None or conn not in held:
            return
        held.discard(conn)
        self.total -= 1
        if not held:
            del self.by_address[conn.address]

    def room_for(self, address: str, limits: Limits) -> bool:
        """Make room for a new connection from ``address``: True when there is, or an idle one was closed for it."""
        held = self.by_address.get(address, ())
        per_address = limits.max_connections_per_address
        if per_address and len(held) >= per_address:
            return self._evict(held)
        if self.total >= limits.max_connections:
            hoarder = max(self.by_address.values(), key=len)
            return self._evict(hoarder) or self._evict(set().union(*self.by_address.values()))
        return True

    def _evict(self, among: set[_Guard] | tuple[()]) -> bool:
        """Close the connection of ``among`` that has waited longest for a request head; False when none waits."""
        idle = [c for c in among if c._head_at is None and not c.transport.is_closing()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._waiting_since)
        REFUSED.labels("evicted").inc()
        self.discard(oldest)
        oldest.transport.abort()
        return True


class _Guard(Limits):
    """Mixed in before a uvicorn protocol class: head and body deadlines, a head size cap, a connection cap."""

    registry: Registry
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    address = ""
    _timer: asyncio.TimerHandle | None = None
    _head_at: float | None = None
    """When the awaited request's head arrived (None: still awaited)."""
    _waiting_since = 0.0
    """Since when a request head has been awaited (eviction closes the longest waiting first)."""
    _head_bytes = 0
    _tail = b""
    """The last two bytes of the head so far: its end may straddle two reads."""

    def _await_head(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._head_at = None
        self._head_bytes = 0
        self._tail = b""
        self._waiting_since = self.loop.time()
        self._timer = self.loop.call_later(self.head_timeout_s, self._expired)

    def _head_arrived(self) -> None:
        if self._head_at is None:
            self._head_at = self.loop.time()

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._head_at is None:
            REFUSED.labels("head_timeout").inc()
            self.transport.abort()  # nothing to flush, and a peer that does not read must not hold the close
            return
        cycle = getattr(self, "cycle", None)
        if cycle is None or not cycle.more_body or cycle.response_complete:
            return  # the request is whole: its response may take as long as it takes
        due = self._head_at + self.body_timeout_s
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._expired)
            return
        REFUSED.labels("body_timeout").inc()
        if cycle.response_started:
            self.transport.abort()
            return
        cycle.disconnected = True  # to the app, the client went away: its reads end, its answer goes nowhere
        cycle.message_event.set()
        message = f"the request body did not arrive within {self.body_timeout_s:g} s"
        self.transport.write(_response(b"408 Request Timeout", _error(message, "request_timeout")))
        self.transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self.registry.room_for(address, self):
            REFUSED.labels("connection_limit").inc()
            cast(asyncio.Transport, transport).abort()
            return
        self.address = address
        super().connection_made(transport)  # type: ignore[misc]
        self.registry.add(self)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is None:  # refused in connection_made: uvicorn never saw it
            return
        self.registry.discard(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        # A head's size is counted before the parser sees it, across reads and up to its end (a read may hold a
        # head and the start of a large body): a head that completes on a later read counts whole.
        if self._head_at is None and self._timer is not None:
            end = -1
            if self._tail and (m := _HEAD_END.search(self._tail + data[:2])) is not None:
                end = m.end() - len(self._tail)
            elif (m := _HEAD_END.search(data)) is not None:
                end = m.end()
            self._head_bytes += len(data) if end < 0 else end
            if self._head_bytes > self.max_head_bytes:
                self._head_too_large()
                return
            self._tail = data[-2:] if len(data) >= 2 else (self._tail + data)[-2:]
        super().data_received(data)  # type: ignore[misc]

    def _head_too_large(self) -> None:
        if self.transport.is_closing():
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        REFUSED.labels("head_too_large").inc()
        message = f"the request head exceeds {self.max_head_bytes} bytes"
        self.transport.write(
            _response(b"431 Request Header Fields Too Large", _error(message, "request_too_large"))
        )
        self.transport.close()

    def on_response_complete(self) -> None:
        self._await_head()  # before uvicorn's: h11's parses a pipelined head at once, which must count as here
        super().on_response_complete()  # type: ignore[misc]
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            self._head_arrived()  # a pipelined request whose head was already read


class _GuardedH11(_Guard, H11Protocol):
    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's head was taken
            self._head_arrived()


def _httptools_class() -> type | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # uvicorn's "auto" falls back to h11 the same way
        return None

    class _GuardedHttpTools(_Guard, HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            self._head_arrived()
            super().on_headers_complete()

    return _GuardedHttpTools


def guarded(
    *,
    head_timeout_s: float = Limits.head_timeout_s,
    body_timeout_s: float = Limits.body_timeout_s,
    max_head_bytes: int = Limits.max_head_bytes,
    max_connections: int = Limits.max_connections,
    max_connections_per_address: int = Limits.max_connections_per_address,
    impl: str = "auto",
) -> type[asyncio.Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)``: httptools where installed (uvicorn's ``auto``), else h11,
    with these limits (and a registry of its connections: one class per server)."""
    base = _httptools_class() if impl in ("auto", "httptools") else None
    if base is None and impl == "httptools":
        raise ImportError("httptools is not installed")
    base = base or _GuardedH11
    limits = {
        "head_timeout_s": head_timeout_s,
        "body_timeout_s": body_timeout_s,
        "max_head_bytes": max_head_bytes,
        "max_connections": max_connections,
        "max_connections_per_address": max_connections_per_address,
        "registry": Registry(),
    }
    return type(f"Limited{base.__name__}", (base,), limits)
