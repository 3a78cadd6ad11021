"""``turnstream forget --session ID | --user ID``: destroy the sessions' keys, delete what holds them in the clear,
then read everything back and report what is left.

In order: the data keys go first (every sealed record of the sessions, in every topic, namespace, dead letter and
copy of the log, is unreadable from then on), each session fenced in the same step for ``fence_s`` (no writer can
make it a new key: a turn on its way is dropped, a new turn under its id refused, rather than written again
readable); then, once every process's cached copy of those keys has expired
(``kafka.seal_keys_cache_s``), the Redis state and the console projections, which a process holding a key could
otherwise have written again; then the proof. Redis is asked to rewrite its append-only file, so the deleted
values leave its disk too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import msgspec

from runtime.configuration.config import Config
from runtime.security.erasure.sealing import session_keys
from runtime.transport.redis_urls import redis_client
from services.forget.redis_state import forget_state, leftovers
from services.forget.topics import TopicProof, sessions_of_user, what_is_left

log = logging.getLogger("turnstream.forget")

Rows = Callable[[Path, set[str]], int]
"""A projection's rows of the sessions: counted, or deleted (``services/console/projection.py``)."""

BEYOND_REACH = (
    "weights already trained on these sessions (and checkpoints' optimizer state) keep what they learned",
    "files exported with `turnstream replay export`, and backups of Kafka or Redis taken before the keys were "
    "destroyed, hold what they held (a backup of the log alone is unreadable without the keys)",
    "turns still in a proxy's spool (written, 0600, on the proxy's disk until published) and service logs",
    "Kafka keeps the records' keys (the session ids) and their sealed values until each topic's retention ends",
)


class Report(msgspec.Struct):
    sessions: list[str]
    keys_destroyed: int
    redis_removed: int
    projection_rows_deleted: int
    topics: list[TopicProof]
    redis_left: list[str]
    projection_rows_left: int
    erased: bool
    """Nothing of the sessions can be read anywhere turnstream looked (and nothing was written in the clear)."""
    beyond_reach: tuple[str, ...] = BEYOND_REACH


async def forget(
    config: Config,
    sessions: set[str],
    *,
    user: str | None = None,
    namespaces: list[str] | None = None,
    projections: list[Path],
    delete_rows: Rows,
    count_rows: Rows,
    wait_s: float | None = None,
    fence_s: int = 30 * 86400,
) -> Report:
    if user:
        sessions = sessions | await sessions_of_user(config.kafka, user, namespaces)
    keys = session_keys(config.kafka)
    if keys is None:
        raise ValueError(
            "kafka.seal is off: records are not sealed, so they cannot be erased by destroying keys"
        )
    destroyed = await keys.destroy(sorted(sessions), fence_s)
    log.info("keys destroyed", extra={"sessions": len(sessions), "destroyed": destroyed})
    await asyncio.sleep(config.kafka.seal_keys_cache_s + 1 if wait_s is None else wait_s)
    r = redis_client(config.redis.url)
    try:
        removed = await forget_state(r, sessions)
        with contextlib.suppress(Exception):  # one may be running already; the next keeps the deletions too
            await r.bgrewriteaof()
        deleted = sum([await asyncio.to_thread(delete_rows, p, sessions) for p in projections])
        topics = await what_is_left(config.kafka, sessions, namespaces)
        left = await leftovers(r, sessions)
    finally:
        await r.aclose()
    rows_left = sum([await asyncio.to_thread(count_rows, p, sessions) for p in projections])
    erased = not left and not rows_left and not any(t.readable or t.clear for t in topics)
    return Report(sorted(sessions), destroyed, removed, deleted, topics, left, rows_left, erased)


def projection_paths(config: Config, cache: Path) -> list[Path]:
    """The console projections on this machine: ``console.db_path``, and every one in the cache (one per
    namespace)."""
    found = [Path(config.console.db_path)] if config.console.db_path else []
    found += sorted((cache / "console").glob("*.sqlite3"))
    return [p for p in dict.fromkeys(found) if p.is_file()]


def not_projections(paths: list[Path]) -> list[str]:
    """The paths that are not console projections (missing, not SQLite, or without its tables), each with why:
    checked before anything is destroyed, so that a mistyped path cannot leave an erasure half done."""
    bad = []
    for path in paths:
        if not path.is_file():
            bad.append(f"{path}: no such file")
            continue
        try:
            db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            finally:
                db.close()
        except sqlite3.DatabaseError as exc:
            bad.append(f"{path}: {exc}")
            continue
        if not {"turns", "pairs"} <= tables:
            bad.append(f"{path}: not a console projection (no turns and pairs tables)")
    return bad


def sqlite_rows(work: Callable[[sqlite3.Connection, set[str]], int]) -> Rows:
    """``work`` on the projection at a path."""

    def run(path: Path, sessions: set[str]) -> int:
        db = sqlite3.connect(str(path))
        try:
            return work(db, sessions)
        finally:
            db.close()

    return run
