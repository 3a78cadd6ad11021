"""The streamed response's end hook runs however the response ends, a relay that never started included: a
generator closed before its first step never runs its own ``finally``, so a lease (or the engine stream) released
only there would leak when a client goes away before the first byte."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from services.proxy.asgi import EventStream


async def respond(send: Callable[[dict[str, Any]], Awaitable[None]]) -> list[str]:
    """One streamed response through ``send``; what ran at its end, in order."""
    ran: list[str] = []

    async def relay() -> AsyncGenerator[tuple[bytes, bool], None]:
        try:
            yield b"data: x\n\n", True
        finally:
            ran.append("relay finally")

    async def on_close() -> None:
        ran.append("on_close")

    async def receive() -> dict[str, Any]:  # a client that stays (until the response ends)
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    try:
        await EventStream(relay(), {}, on_close=on_close)({"type": "http"}, receive, send)
    except OSError:
        ran.append("raised")
    return ran


async def test_on_close_runs_when_the_client_is_gone_before_the_relay_starts() -> None:
    async def gone(message: dict[str, Any]) -> None:
        raise OSError("client gone")  # the very first send: the response start

    assert await respond(gone) == ["on_close", "raised"], "the relay's finally never runs; the hook does"


async def test_on_close_runs_after_a_completed_stream() -> None:
    sent: list[dict[str, Any]] = []

    async def keep(message: dict[str, Any]) -> None:
        sent.append(message)

    assert await respond(keep) == ["relay finally", "on_close"]
    assert sent[-1]["more_body"] is False
