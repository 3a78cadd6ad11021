"""The proxy's ASGI pieces: OpenAI's error shape, a JSON response that records its turn before it is sent, a
streamed response cancelled by its client going away, and the short cut that sends chat requests past Starlette's
router."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from services.proxy.per_key import give_back
from services.proxy.turns import DROPPED

log = logging.getLogger("turnstream.proxy")

_json_encoder = msgspec.json.Encoder()


def openai_error(
    status: int, message: str, err_type: str, code: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return Response(
        _json_encoder.encode(body), status_code=status, media_type="application/json", headers=headers
    )


class RecordedFirst(Response):
    """A main turn's JSON answer, recorded before its bytes go out: ``record`` hands the turn to the spool file (a
    page-cache write, no fsync) on the event loop, so a proxy killed the moment its client has the answer has
    spooled it (the turns that need work beside the answer, a re-score, a re-tokenization or a number Redis has not
    given yet, are spooled when it ends: docs/proxy.md). Without Starlette's BackgroundTask, which inspects its
    callable on every request."""

    def __init__(self, content: bytes, headers: dict[str, str], record: Callable[[], None]) -> None:
        super().__init__(content, media_type="application/json", headers=headers)
        self._record = record

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            self._record()
        except Exception:  # a bug in recording costs the turn (counted), never the user's answer
            DROPPED.labels("internal_error").inc()
            log.exception("recording a turn failed")
        await super().__call__(scope, receive, send)


class EventStream(StreamingResponse):
    """A streamed chat response. Its body iterator yields ``(bytes, last)``: the last piece goes out with the
    chunked terminator in one write. A client that goes away cancels the relay (which closes the engine stream,
    so the engine stops generating) through a plain task, where Starlette's StreamingResponse spends an anyio task
    group (~70 us) per response."""

    def __init__(
        self,
        pieces: AsyncGenerator[tuple[bytes, bool], None],
        headers: dict[str, str],
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__((), media_type="text/event-stream", headers=headers)
        self.pieces = pieces
        self.on_close = on_close
        """Run once the response ends, however it ends: a generator closed before it started never runs its own
        ``finally`` (a client gone before the first byte)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        # The watcher runs only while this task awaits a send or the relay; ``finally`` cancels it before its
        # first await, so a disconnect seen after the last piece cancels nothing.
        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        pieces = self.pieces
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            last = False
            async for piece, last in pieces:
                await send({"type": "http.response.body", "body": piece, "more_body": not last})
                if last:
                    break
            if not last:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
        finally:
            watcher.cancel()
            try:
                await pieces.aclose()
            finally:
                if self.on_close is not None:
                    await self.on_close()


class ChatFirst:
    """The API paths (``POST /v1/chat/completions``, ``/v1/responses``, ``/v1/messages``) straight to their
    handlers, past Starlette's router, its two exception middlewares and their send wrappers (measured: a tenth of
    the proxy's CPU per request). Everything else, the lifespan included, goes through the Starlette app, which
    also routes these (for its 405 and tests)."""

    def __init__(
        self, app: Starlette, routes: dict[str, tuple[Any, Callable[[int, str], Response] | None]]
    ) -> None:
        self.app = app
        self.routes = routes
        """path -> (handler, the API's error for a bug in the proxy; None: OpenAI's)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # What a request took of its key's caps goes back here, once its response has ended, whichever way it was
        # routed: the one place that gives back, so no route can keep what it took (count_tokens, served by the
        # router, kept its in-flight slot: 256 calls locked its key out until a restart).
        try:
            route = (
                self.routes.get(scope["path"])
                if scope["type"] == "http" and scope["method"] == "POST"
                else None
            )
            if route is None:
                await self.app(scope, receive, send)
                return
            handler, internal = route
            try:
                response = await handler(Request(scope, receive))
            except Exception:
                log.exception("unexpected error")
                if internal is None:
                    response = openai_error(500, "internal error in the proxy", "internal_error")
                else:
                    response = internal(500, "internal error in the proxy")
            await response(scope, receive, send)
        finally:
            give_back(scope)
