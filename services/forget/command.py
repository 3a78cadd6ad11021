"""``turnstream forget``. The console's projection is another service's: ``services/cli.py`` hands in how its
rows are deleted and counted (``Projection``), so this service never imports it."""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import msgspec

from runtime.configuration.config import Config
from runtime.process.commands import Subparsers, command, refuse

SessionRows = Callable[[sqlite3.Connection, set[str]], int]


class Projection(NamedTuple):
    """The console projection's rows of some sessions: deleted (overwritten) and counted."""

    delete_rows: SessionRows
    count_rows: SessionRows


def register(sub: Subparsers, projection: Projection) -> None:
    forget = command(
        sub,
        "forget",
        "erase sessions (or a user's) from every topic, Redis and the console, and prove it",
        partial(run, projection=projection),
    )
    who = forget.add_mutually_exclusive_group(required=True)
    who.add_argument("--session", action="append", help="a session id (repeat for several)")
    who.add_argument("--user", help="every session whose turns name this user (Turn.user)")
    forget.add_argument(
        "--namespace",
        action="append",
        help="search and prove in this namespace only (repeat; '' the live one; default: every namespace)",
    )
    forget.add_argument(
        "--projection",
        action="append",
        help="a console projection to clean (default: console.db_path and those in the cache)",
    )
    forget.add_argument(
        "--wait",
        type=float,
        default=None,
        help="seconds between destroying the keys and the rest (default: kafka.seal_keys_cache_s + 1)",
    )
    forget.add_argument(
        "--fence-days",
        type=float,
        default=30.0,
        help="how long nothing may be written for the sessions again: new turns under their ids are refused "
        "(HTTP 410) and records on their way dropped (default 30; 0: no fence)",
    )


def run(config: Config, args: argparse.Namespace, projection: Projection) -> int:
    from runtime.engine.model_store import cache_dir
    from schemas import normalize_namespace
    from services.forget.main import forget, not_projections, projection_paths, sqlite_rows

    paths = [Path(p) for p in args.projection] if args.projection else projection_paths(config, cache_dir())
    if bad := not_projections(paths):
        return refuse("forget", "; ".join(bad))
    try:
        report = asyncio.run(
            forget(
                config,
                set(args.session or []),
                user=args.user,
                namespaces=[normalize_namespace(n) for n in args.namespace] if args.namespace else None,
                projections=paths,
                delete_rows=sqlite_rows(projection.delete_rows),
                count_rows=sqlite_rows(projection.count_rows),
                wait_s=args.wait,
                fence_s=round(args.fence_days * 86400),
            )
        )
    except ValueError as exc:
        return refuse("forget", exc)
    print(msgspec.json.format(msgspec.json.encode(report).decode()))
    return 0 if report.erased else 1
