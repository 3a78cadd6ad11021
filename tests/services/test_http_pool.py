"""The lean connection pool: connections are reused, a server that closes them is handled, errors map to
httpx's exceptions (what the engine client catches)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.engine.launch import free_port
from services.http_pool import LeanPool


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


async def post(pool: LeanPool, url: str, body: bytes) -> bytes:
    resp = await pool.handle_async_request(httpx.Request("POST", url, content=body))
    try:
        return await resp.aread()
    finally:
        await resp.aclose()


async def test_sequential_requests_reuse_one_connection() -> None:
    port = free_port()
    server, accepted = await serve(port)
    pool = LeanPool()
    try:
        for i in range(20):
            assert (
                await post(pool, f"http://127.0.0.1:{port}/x", f"hello {i}".encode()) == f"hello {i}".encode()
            )
        assert len(accepted) == 1
        # Concurrent requests open what they need and give them back for reuse.
        bodies = await asyncio.gather(
            *(post(pool, f"http://127.0.0.1:{port}/x", b"%d" % i) for i in range(16))
        )
        assert sorted(bodies) == sorted(b"%d" % i for i in range(16))
        opened = len(accepted)
        await asyncio.gather(*(post(pool, f"http://127.0.0.1:{port}/x", b"again") for _ in range(16)))
        assert len(accepted) == opened, "the second wave reused the first wave's connections"
    finally:
        await pool.aclose()
        server.close()


async def test_connections_the_server_closes_are_replaced() -> None:
    port = free_port()
    server, accepted = await serve(port, close_every=3)
    pool = LeanPool()
    try:
        for i in range(10):
            assert await post(pool, f"http://127.0.0.1:{port}/x", b"%d" % i) == b"%d" % i
        assert len(accepted) == 4  # requests 1-3, 4-6, 7-9, 10
    finally:
        await pool.aclose()
        server.close()


async def test_unreachable_server_raises_httpx_connect_error() -> None:
    pool = LeanPool()
    with pytest.raises(httpx.ConnectError):
        await post(pool, f"http://127.0.0.1:{free_port()}/x", b"x")
    await pool.aclose()
