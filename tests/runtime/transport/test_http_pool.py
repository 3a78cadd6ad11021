"""The lean connection pool: connections are reused, a server that closes them is handled, errors map to
httpx's exceptions (what the engine client catches)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from runtime.process.ports import free_port
from runtime.transport.http_pool import LeanPool, request_head


async def serve(port: int, close_every: int = 0) -> tuple[asyncio.AbstractServer, list[int]]:
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(h.split(b":")[1])
                        for h in head.split(b"\r\n")
                        if h.lower().startswith(b"content-length")
                    ),
                    0,
                )
                body = await reader.readexactly(length)
                served += 1
                closing = close_every and served % close_every == 0
                extra = b"connection: close\r\n" if closing else b""
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-length: "
                    + str(len(body)).encode()
                    + b"\r\n"
                    + extra
                    + b"\r\n"
                    + body
                )
                await writer.drain()
                if closing:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    return server, accepted


@pytest.fixture(params=["httpx", "fetch"])
def via(request: pytest.FixtureRequest) -> str:
    """Both ways through the pool: httpx's request/response objects, and ``fetch`` (the proxy's hot path)."""
    return str(request.param)


async def post(via: str, pool: LeanPool, url: str, body: bytes, timeout: float = 5.0) -> bytes:
    timeouts = httpx.Timeout(timeout).as_dict()
    if via == "fetch":
        key, head = request_head("POST", httpx.URL(url), {"content-type": "application/octet-stream"})
        status, raw = await pool.fetch(key, head, body, timeouts)
        assert status == 200
        return raw
    resp = await pool.handle_async_request(
        httpx.Request("POST", url, content=body, extensions={"timeout": timeouts})
    )
    try:
        return await resp.aread()
    finally:
        await resp.aclose()


async def test_sequential_requests_reuse_one_connection(via: str) -> None:
    port = free_port()
    server, accepted = await serve(port)
    pool = LeanPool()
    try:
        for i in range(20):
            assert (
                await post(via, pool, f"http://127.0.0.1:{port}/x", f"hello {i}".encode())
                == f"hello {i}".encode()
            )
        assert len(accepted) == 1
        # Concurrent requests open what they need and give them back for reuse.
        bodies = await asyncio.gather(
            *(post(via, pool, f"http://127.0.0.1:{port}/x", b"%d" % i) for i in range(16))
        )
        assert sorted(bodies) == sorted(b"%d" % i for i in range(16))
        opened = len(accepted)
        await asyncio.gather(*(post(via, pool, f"http://127.0.0.1:{port}/x", b"again") for _ in range(16)))
        assert len(accepted) == opened, "the second wave reused the first wave's connections"
    finally:
        await pool.aclose()
        server.close()


async def test_connections_the_server_closes_are_replaced(via: str) -> None:
    port = free_port()
    server, accepted = await serve(port, close_every=3)
    pool = LeanPool()
    try:
        for i in range(10):
            assert await post(via, pool, f"http://127.0.0.1:{port}/x", b"%d" % i) == b"%d" % i
        assert len(accepted) == 4  # requests 1-3, 4-6, 7-9, 10
    finally:
        await pool.aclose()
        server.close()


async def test_unreachable_server_raises_httpx_connect_error(via: str) -> None:
    pool = LeanPool()
    with pytest.raises(httpx.ConnectError):
        await post(via, pool, f"http://127.0.0.1:{free_port()}/x", b"x")
    await pool.aclose()


async def raw_server(port: int, respond: object) -> asyncio.AbstractServer:
    """A server whose handler writes whatever bytes the test wants for each request."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await respond(writer)  # type: ignore[operator]
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", port)


async def test_chunked_body_streams_chunk_by_chunk() -> None:
    port = free_port()
    release = asyncio.Event()

    async def respond(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()

    server = await raw_server(port, respond)
    pool = LeanPool()
    try:
        resp = await pool.handle_async_request(httpx.Request("GET", f"http://127.0.0.1:{port}/s"))
        parts = resp.aiter_raw()
        assert await parts.__anext__() == b"first"  # arrives before the server sent the rest
        release.set()
        assert [p async for p in parts] == [b"second"]
        await resp.aclose()
    finally:
        await pool.aclose()
        server.close()


async def test_body_until_close_and_read_timeout(via: str) -> None:
    port = free_port()

    async def respond(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\nno length, ends with the connection")
        await writer.drain()
        writer.close()

    server = await raw_server(port, respond)
    pool = LeanPool()
    try:
        assert (
            await post(via, pool, f"http://127.0.0.1:{port}/x", b"") == b"no length, ends with the connection"
        )
    finally:
        server.close()

    silent_port = free_port()

    async def never(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    silent = await raw_server(silent_port, never)
    try:
        with pytest.raises(httpx.ReadTimeout):
            await post(via, pool, f"http://127.0.0.1:{silent_port}/", b"", timeout=0.3)
    finally:
        await pool.aclose()
        silent.close()


async def test_malformed_response_and_mid_body_disconnect_raise_httpx_errors(via: str) -> None:
    port = free_port()

    async def garbage(writer: asyncio.StreamWriter) -> None:
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    server = await raw_server(port, garbage)
    pool = LeanPool()
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            await post(via, pool, f"http://127.0.0.1:{port}/x", b"")
    finally:
        server.close()

    cut_port = free_port()

    async def cut(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
        await writer.drain()
        writer.close()

    cut_server = await raw_server(cut_port, cut)
    try:
        with pytest.raises(httpx.ReadError):
            await post(via, pool, f"http://127.0.0.1:{cut_port}/x", b"")
    finally:
        await pool.aclose()
        cut_server.close()


async def test_reused_connection_closed_before_answering_is_retried_on_a_new_one(via: str) -> None:
    """The server closes a kept-alive connection just as the next request goes out (its idle timeout racing the
    client): nothing was answered, so the pool sends the request again on a fresh connection."""
    port = free_port()
    conns: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(1)
        first_connection = len(conns) == 1
        served = 0
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                if first_connection and served == 1:
                    writer.transport.abort()  # the race: the request arrived, the connection dies unanswered
                    return
                served += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    pool = LeanPool()
    try:
        assert await post(via, pool, f"http://127.0.0.1:{port}/x", b"") == b"ok"
        assert await post(via, pool, f"http://127.0.0.1:{port}/x", b"") == b"ok"
        assert len(conns) == 2
    finally:
        await pool.aclose()
        server.close()


async def test_a_body_larger_than_the_backpressure_limit_arrives_whole(via: str) -> None:
    """Reading pauses while more than 1 MiB waits unread; a reader that takes the whole body must not stall."""
    port = free_port()
    server, _ = await serve(port)
    pool = LeanPool()
    big = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB
    try:
        assert await post(via, pool, f"http://127.0.0.1:{port}/x", big) == big
        assert await post(via, pool, f"http://127.0.0.1:{port}/x", b"after") == b"after"
    finally:
        await pool.aclose()
        server.close()


def test_connections_of_an_earlier_event_loop_are_not_reused() -> None:
    """One pool per process, but a CLI may run several event loops one after another (asyncio.run twice): a
    kept-alive connection of the closed loop must be left alone, not handed out. The server lives in a thread of
    its own, so the connection stays open across the two loops."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Echo(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/x"
    pool = LeanPool()
    try:
        assert asyncio.run(post("fetch", pool, url, b"one")) == b"one"
        assert asyncio.run(post("fetch", pool, url, b"two")) == b"two"
    finally:
        server.shutdown()
