"""``turnstream proxy``."""

from __future__ import annotations

import argparse

import msgspec

from runtime.configuration.config import Config, EngineConfig
from runtime.process.commands import Subparsers, command, refuse


def register(sub: Subparsers) -> None:
    proxy = command(sub, "proxy", "the OpenAI-compatible proxy that records turns (and reloads weights)", run)
    proxy.add_argument("--host", help="default: proxy.host")
    proxy.add_argument("--port", type=int, help="default: proxy.port")
    proxy.add_argument(
        "--engine-url",
        help="the policy engine, or several replicas comma-separated (default: engine.replicas, else engine.url)",
    )


def engines(engine: EngineConfig, flag: str | None) -> EngineConfig:
    """``--engine-url``: one policy engine, or several replicas comma-separated."""
    urls = [url.strip() for url in (flag or "").split(",") if url.strip()]
    if not urls:
        return engine
    return msgspec.structs.replace(engine, url=urls[0], replicas=urls if len(urls) > 1 else [])


def run(config: Config, args: argparse.Namespace) -> int:
    from runtime.observability.metrics import serve_metrics
    from runtime.transport.http_server import serve
    from services.proxy.app import create_app
    from services.proxy.keys import KeyFileError, ProxyKeys, refuse_without_keys

    proxy = msgspec.structs.replace(
        config.proxy, host=args.host or config.proxy.host, port=args.port or config.proxy.port
    )
    engine = engines(config.engine, args.engine_url)
    config = msgspec.structs.replace(config, proxy=proxy, engine=engine)
    try:
        why = refuse_without_keys(proxy.host, ProxyKeys(proxy.api_key, proxy.keys_file))
    except KeyFileError as exc:
        why = str(exc)
    if why:
        return refuse("proxy", why)
    # For a Prometheus without the proxy's keys (compose): the same registry, on a port of its own.
    serve_metrics(config.metrics.port, config.metrics.host)
    # No X-Forwarded-* rewriting (the proxy never uses the client's address) and no Server header: per-request
    # work the hot path does not need.
    serve(
        create_app(config),
        host=proxy.host,
        port=proxy.port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        server_header=False,
        head_timeout_s=proxy.head_timeout_s,
        body_timeout_s=proxy.body_timeout_s,
        max_head_bytes=proxy.max_head_bytes,
        max_connections=proxy.max_connections,
        max_connections_per_address=proxy.max_connections_per_address,
    )
    return 0
