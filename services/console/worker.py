"""Starting the console: the projection file, the feed that keeps it current (in the app's lifespan), the web
server. ``turnstream console``; ``turnstream run`` starts it and prints its URL."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from services.config import Config
from services.console.app import create_app, token_texts
from services.console.feed import follow
from services.console.projection import connect
from services.model_store import cache_dir


def projection_path(config: Config) -> Path:
    """``console.db_path``, else one file per Kafka namespace in the cache (a replay's namespace is its own)."""
    if config.console.db_path:
        return Path(config.console.db_path)
    name = (config.kafka.namespace.rstrip(".") or "live") + ".sqlite3"
    return cache_dir() / "console" / name


def console_app(config: Config) -> Any:
    """The app, with the feed running for as long as it serves."""
    path = projection_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = connect(path)  # creates the file and its schema before the first page is read
    tokenizer = config.console.tokenizer or config.trainer.hf_checkpoint or None
    app = create_app(path, token_texts(tokenizer))

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = asyncio.create_task(follow(config.kafka, writer, stop))
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)
            writer.close()

    app.router.lifespan_context = lifespan
    return app


def run_console(config: Config) -> int:
    from services.transport.http_server import serve

    serve(console_app(config), host=config.console.host, port=config.console.port, log_level="warning")
    return 0
