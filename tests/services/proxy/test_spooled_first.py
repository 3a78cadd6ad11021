"""A main turn is in the spool file before its answer's last byte goes out: a proxy killed the moment its client
has the answer has spooled the turn (docs/proxy.md, "Durability"). Watched at the ASGI ``send`` of the real app,
the only place where "before" can be checked without a race."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig, load_config
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from services.proxy.app import create_app

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]

Send = Callable[[dict[str, Any]], Awaitable[None]]


def spooled(spool: Path) -> bytes:
    return b"".join(f.read_bytes() for f in sorted(spool.rglob("*")) if f.is_file())


async def call(app: Any, path: str, body: dict[str, Any], session: str, send: Send) -> None:
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
            (b"x-session-id", session.encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return {"type": "http.disconnect"}

    await app(scope, receive, send)


def watched(spool: Path, session: str) -> tuple[list[bool], list[int], Send]:
    """A ``send`` that notes, at each piece of the answer, whether the spool held the session's record (its id is
    in it), and the status it sent."""
    held: list[bool] = []
    status: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            held.append(session.encode() in spooled(spool))

    return held, status, send


async def test_a_main_turn_is_spooled_before_its_answer_goes_out(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    port = free_port()
    stub = ServiceProcess(
        ["--port", str(port), "--latency-ms", "1"],
        port=port,
        ready_path="/health",
        startup_timeout_s=30,
        program=[sys.executable, str(REPO / "bench/stub_engine.py")],
    )
    spool = tmp_path / "spool"
    config = load_config(
        env={
            **kafka.client_env(),
            "TURNSTREAM_REDIS_URL": redis_config.url,
            "TURNSTREAM_REDIS_KEY_PREFIX": redis_config.key_prefix,
            "TURNSTREAM_ENGINE_URL": stub.url,
            "TURNSTREAM_PROXY_SPOOL_DIR": str(spool),
            "TURNSTREAM_PROXY_WEIGHTS_ROOT": str(tmp_path / "weights"),
        }
    )
    app = create_app(config)
    try:
        async with app.app.router.lifespan_context(app.app):
            for path, body, session in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "first-chat"),
                ("/v1/responses", {"input": "hello"}, "first-responses"),
            ):
                held, status, send = watched(spool, session)
                await call(app, path, {**body, "max_tokens": 4}, session, send)
                assert status == [200], path
                assert held and all(held), (path, held)
    finally:
        stub.stop()
