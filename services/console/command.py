"""``turnstream console``."""

from __future__ import annotations

import argparse

from runtime.configuration.config import Config, ConfigError
from runtime.process.commands import Subparsers, command, override, refuse


def register(sub: Subparsers) -> None:
    con = command(sub, "console", "the web console: pipeline, sessions, turn inspector, versions", run)
    con.add_argument("--host", help="default: console.host (127.0.0.1)")
    con.add_argument("--port", type=int, help="default: console.port (8080)")


def run(config: Config, args: argparse.Namespace) -> int:
    from services.console.worker import run_console

    try:
        config = override(config, "console", {"host": args.host, "port": args.port})
    except ConfigError as exc:
        return refuse("console", exc)
    return run_console(config)
