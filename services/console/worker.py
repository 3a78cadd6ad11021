"""Starting the console: the projection file, the feed that keeps it current (in the app's lifespan), the web
server. ``turnstream console``; ``turnstream run`` starts it and prints its URL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from runtime.configuration.config import Config
from runtime.engine.model_store import cache_dir
from runtime.messaging.topics import group_lag, pipeline_groups
from runtime.observability.metrics import serve_metrics
from runtime.security.tokens import console_login_url, console_token
from services.console.access import Access, allowed_hosts
from services.console.app import create_app, token_texts
from services.console.feed import follow
from services.console.projection import connect

log = logging.getLogger("turnstream.console")


def projection_path(config: Config) -> Path:
    """``console.db_path``, else one file per Kafka namespace in the cache (a replay's namespace is its own)."""
    if config.console.db_path:
        return Path(config.console.db_path)
    name = (config.kafka.namespace.rstrip(".") or "live") + ".sqlite3"
    return cache_dir() / "console" / name


async def measure_lag(
    config: Config, live: dict[str, Any], stop: asyncio.Event, every_s: float = 10.0
) -> None:
    """The pipeline's consumer lag per group, every ``every_s``, into ``live["lag"]`` (the last good figures
    stay shown while the broker does not answer)."""
    groups = pipeline_groups(config)
    while not stop.is_set():
        try:
            live["lag"] = await group_lag(config.kafka, groups)
        except (KafkaError, OSError) as exc:
            log.warning("could not measure consumer lag", extra={"error": str(exc)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


def console_app(config: Config) -> Any:
    """The app, with the feed running for as long as it serves."""
    path = projection_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = connect(path)  # creates the file and its schema before the first page is read
    tokenizer = config.console.tokenizer or config.trainer.hf_checkpoint or None
    live: dict[str, Any] = {}
    texts = token_texts(tokenizer)
    app = create_app(path, texts, live)
    token = console_token(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(follow(config.kafka, writer, stop)),
            asyncio.create_task(measure_lag(config, live, stop)),
            # The tokenizer loads with transformers (seconds, more on a busy CPU): now, not on the first turn page.
            asyncio.create_task(asyncio.to_thread(texts, [])),
        ]
        try:
            yield
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            writer.close()

    app.router.lifespan_context = lifespan
    return Access(app, token, allowed_hosts(config.console.allowed_hosts, config.console.host))


def announce_login(config: Config) -> None:
    """Where to log in, with the token left out of the log (logs are collected and kept: issue 55); the whole link
    on the terminal of a person who started the console by hand."""
    link = console_login_url(config)
    log.info(f"console: open {link.split('?token=')[0]}?token=<console.token> (TURNSTREAM_CONSOLE_TOKEN)")
    if sys.stderr.isatty():
        print(f"console: open {link}", file=sys.stderr)


def run_console(config: Config) -> int:
    from runtime.transport.http_server import serve

    app = console_app(config)
    # For a Prometheus without the console's token (compose): the same registry, on a port of its own.
    serve_metrics(config.metrics.port, config.metrics.host)
    announce_login(config)
    serve(app, host=config.console.host, port=config.console.port, log_level="warning")
    return 0
