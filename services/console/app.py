"""``turnstream console``: the place people look. A FastAPI application over the projection (``projection.py``)
that ``feed.py`` keeps current: the pipeline as a flow, sessions, the turn inspector with the teacher's per-token
heat map, and the versions' learning curves; each page also as JSON under ``/api``. Unknown ids are 404 pages."""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from services.console import pages, queries

log = logging.getLogger("turnstream.console")

TokenText = Callable[[list[int]], list[str]]


def token_texts(tokenizer_path: str | None) -> TokenText:
    """Each token id as its text (the tokenizer of the policy, loaded on first use); ids when there is none."""
    if not tokenizer_path:
        return lambda ids: [f"[{i}]" for i in ids]

    @functools.cache
    def tokenizer() -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_path)

    def decode(ids: list[int]) -> list[str]:
        tok = tokenizer()
        return [tok.decode([i]) for i in ids]

    return decode


def create_app(
    db_path: str | Path, token_text: TokenText | None = None, live: dict[str, Any] | None = None
) -> FastAPI:
    """``live``: figures that are not in the topics' records (consumer lag per group), kept current by the
    caller (``worker.py``) and shown on the overview as they are."""
    app = FastAPI(title="turnstream console", docs_url=None, redoc_url=None)
    texts = token_text or token_texts(None)
    now = live if live is not None else {}

    async def overview_data() -> dict[str, Any]:
        return {**await read(queries.overview), "lag": now.get("lag")}

    @contextmanager
    def reading() -> Iterator[sqlite3.Connection]:
        from services.console.projection import connect

        db = connect(db_path, readonly=True)
        try:
            yield db
        finally:
            db.close()

    async def read(fn: Callable[..., Any], *args: Any) -> Any:
        def run() -> Any:
            with reading() as db:
                return fn(db, *args)

        return await asyncio.to_thread(run)

    def html(text: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(text, status_code=status)

    @app.exception_handler(404)
    async def missing(request: Request, exc: Exception) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse(
                {"error": {"message": f"{request.url.path} not found", "type": "not_found"}}, 404
            )
        return html(pages.not_found(f"No page at {request.url.path}."), 404)

    @app.get("/", response_class=HTMLResponse)
    async def overview() -> HTMLResponse:
        return html(pages.overview(await overview_data()))

    @app.get("/sessions", response_class=HTMLResponse)
    async def sessions(q: str = "", outcome: str = "", user: str = "") -> HTMLResponse:
        rows = await read(queries.sessions, q, outcome, user)
        return html(pages.sessions(rows, await read(queries.users), q, outcome, user))

    # ``:path``: an id may hold ``/`` (``alice/s1`` under per-user keys), which the server has decoded from %2F;
    # an empty one is a dot-only id sent as ``?id=`` (``pages.link``).
    @app.get("/sessions/{session_id:path}", response_class=HTMLResponse)
    async def session(session_id: str, id: str = "") -> HTMLResponse:
        session_id = session_id or id
        turns = await read(queries.session, session_id)
        if turns is None:
            return html(pages.not_found(f"No session {session_id!r} is recorded."), 404)
        return html(pages.session(session_id, turns))

    @app.get("/turns/{turn_id:path}", response_class=HTMLResponse)
    async def turn(turn_id: str, id: str = "") -> HTMLResponse:
        turn_id = turn_id or id
        data = await read(queries.turn, turn_id)
        if data is None:
            return html(pages.not_found(f"No turn {turn_id!r} is recorded."), 404)
        return html(await asyncio.to_thread(pages.turn, data, texts))

    @app.get("/versions", response_class=HTMLResponse)
    async def versions() -> HTMLResponse:
        rows = await read(queries.versions, pages.VERSIONS_SHOWN)
        gate = await read(queries.decisions)
        return html(pages.versions(rows, await read(queries.heldout_curve), gate))

    @app.get("/api/overview")
    async def api_overview() -> Any:
        return await overview_data()

    @app.get("/api/sessions")
    async def api_sessions(q: str = "", outcome: str = "", user: str = "") -> Any:
        return await read(queries.sessions, q, outcome, user)

    @app.get("/api/turns/{turn_id:path}")
    async def api_turn(turn_id: str, id: str = "") -> Any:
        turn_id = turn_id or id
        data = await read(queries.turn, turn_id)
        if data is None:
            return JSONResponse({"error": {"message": f"no turn {turn_id!r}", "type": "not_found"}}, 404)
        return data

    @app.get("/api/versions")
    async def api_versions(last: int | None = None) -> Any:
        return await read(queries.versions, last)

    @app.get("/api/decisions")
    async def api_decisions(last: int = 50) -> Any:
        return await read(queries.decisions, last)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
