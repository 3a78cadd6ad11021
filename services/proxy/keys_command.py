"""``turnstream keys``: add, list and revoke the proxy's per-user keys in ``proxy.keys_file``.

A key is shown once, when it is made, and only its SHA-256 is written (``sha256:<hex>``), so the file gives nobody
a key. The file is replaced whole (a temporary file renamed over it, 0600): a proxy reading it sees the old file or
the new one, never half of one, and reads it again within ``proxy.keys_reload_s``. Mount the folder that holds it
in a container, not the file: a file mounted alone keeps showing the one it replaced.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
from pathlib import Path

from runtime.configuration.config import Config
from runtime.process.commands import Subparsers, command, refuse
from schemas import user_id_problem
from services.proxy.keys import HASHED, KeyFileError, hashed, read_keys_file


def register(sub: Subparsers) -> None:
    keys = command(sub, "keys", "add, list or revoke the proxy's per-user keys (proxy.keys_file)", run)
    keys.add_argument("action", choices=["add", "list", "revoke"])
    keys.add_argument("user", nargs="?", help="add, revoke: the user id")
    keys.add_argument("--file", help="the keys file (default: proxy.keys_file)")
    keys.add_argument(
        "--fingerprint", help="revoke: only the key whose fingerprint (from 'list') starts with this"
    )


def run(config: Config, args: argparse.Namespace) -> int:
    path = Path(args.file or config.proxy.keys_file)
    if not str(path) or str(path) == ".":
        return refuse("keys", "no keys file: set proxy.keys_file (TURNSTREAM_PROXY_KEYS_FILE) or pass --file")
    try:
        lines = path.read_text().splitlines() if path.exists() else []
        if lines:
            read_keys_file(path)  # a file the proxy could not use is not changed
    except KeyFileError as exc:
        return refuse("keys", exc)
    if args.action == "list":
        for user, fingerprint in entries(lines):
            print(f"{user} {fingerprint}")
        return 0
    if not args.user or (problem := user_id_problem(args.user)) is not None:
        return refuse(
            "keys", f"{args.action} needs a valid user id: {problem if args.user else 'none given'}"
        )
    if args.action == "add":
        key = "ts-" + secrets.token_urlsafe(32)
        write(path, [*lines, f"{args.user} {hashed(key)}"])
        print(key)  # the only time it is shown
        return 0
    kept = [line for line in lines if not _matches(line, args.user, args.fingerprint or "")]
    if len(kept) == len(lines):
        return refuse("keys", f"no key of {args.user!r} matches")
    write(path, kept)
    return 0


def entries(lines: list[str]) -> list[tuple[str, str]]:
    """(user, fingerprint: the first 12 hex digits of the key's SHA-256) of each key line."""
    out = []
    for line in lines:
        parts = line.split("#", 1)[0].split()
        if len(parts) == 2:
            digest = parts[1].removeprefix(HASHED) if parts[1].startswith(HASHED) else hashed(parts[1])[7:]
            out.append((parts[0], digest[:12]))
    return out


def _matches(line: str, user: str, fingerprint: str) -> bool:
    found = entries([line])
    return bool(found) and found[0][0] == user and found[0][1].startswith(fingerprint)


def write(path: Path, lines: list[str]) -> None:
    """The file replaced whole, 0600, by a rename in its own folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            out.write("".join(f"{line}\n" for line in lines))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
