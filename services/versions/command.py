"""``turnstream versions``: list, promote, roll back, pin and unpin weight versions by hand."""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec

from runtime.configuration.config import Config
from runtime.process.commands import Subparsers, command, refuse


def register(sub: Subparsers) -> None:
    versions = command(
        sub,
        "versions",
        "weight versions with their state, gate results and figures; promote, roll back, pin by hand",
        run,
    )
    vsub = versions.add_subparsers(dest="versions_command")
    vlist = vsub.add_parser("list", help="every version (the default)")
    vlist.add_argument("--json", action="store_true", help="the listing as JSON")
    vsub.add_parser("promote", help="serve version N (a manual decision on `versions`)").add_argument(
        "version", type=int
    )
    vsub.add_parser(
        "rollback", help="take back version N (default: the promoted one); the one promoted before is served"
    ).add_argument("version", type=int, nargs="?")
    vsub.add_parser("pin", help="serve version N whatever is promoted, while training goes on").add_argument(
        "version", type=int
    )
    vsub.add_parser("unpin", help="serve the promoted version again")


def run(config: Config, args: argparse.Namespace) -> int:
    from services.versions.main import VersionsError, decide, history, listing, table

    action = args.versions_command or "list"
    if action == "list":
        shown = listing(*asyncio.run(history(config)))
        print(
            msgspec.json.format(msgspec.json.encode(shown).decode())
            if getattr(args, "json", False)
            else table(shown)
        )
        return 0
    try:
        decision = asyncio.run(decide(config, action, getattr(args, "version", None)))
    except VersionsError as exc:
        return refuse(f"versions {action}", exc)
    print(msgspec.json.encode(decision).decode())
    if not config.gate.enabled:
        print(
            "turnstream versions: recorded on `versions`; proxies act on it only with gate.enabled"
            " (docs/evaluation.md)",
            file=sys.stderr,
        )
    return 0
