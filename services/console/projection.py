"""The console's projection: what its pages need, materialised from the topics into SQLite.

The topics are the source of truth; this is a cache of them that a replay rebuilds. Each record is applied by
its key (``INSERT OR REPLACE``), so a redelivered record changes nothing, and the consumed offsets are stored in
the same transaction as the rows they produced: a restart resumes exactly where the last batch ended, and
deleting the file rebuilds it from the beginning of every topic. SQLite in WAL mode: the pages read while the
consumer writes. Calls are blocking; the async callers run them in a thread.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from runtime.security.files import private_dir, private_file
from schemas import (
    DeadLetter,
    EvalResult,
    Event,
    Judgment,
    PairedTurn,
    Sample,
    TeacherScores,
    Turn,
    VersionDecision,
    WeightsPublished,
)

SCHEMA_VERSION = 5
"""Raised with every change to ``SCHEMA``: a projection written with another is rebuilt from the topics."""
SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    turn_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, turn_index INTEGER NOT NULL, created_at REAL NOT NULL,
    weight_version INTEGER NOT NULL, model TEXT, finish_reason TEXT, messages TEXT NOT NULL, response TEXT NOT NULL,
    response_token_ids TEXT NOT NULL, response_logprobs TEXT NOT NULL, session_done INTEGER NOT NULL,
    user TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS turns_by_session ON turns (session_id, turn_index);
CREATE INDEX IF NOT EXISTS turns_by_time ON turns (created_at);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, user TEXT NOT NULL DEFAULT '', turns INTEGER NOT NULL DEFAULT 0, first_at REAL,
    last_at REAL, version INTEGER, judged_index INTEGER, outcome TEXT NOT NULL DEFAULT 'unjudged'
);
CREATE INDEX IF NOT EXISTS sessions_by_time ON sessions (last_at);
CREATE INDEX IF NOT EXISTS sessions_by_user ON sessions (user, last_at);
CREATE INDEX IF NOT EXISTS sessions_by_outcome ON sessions (outcome, last_at);
CREATE TABLE IF NOT EXISTS pairs (
    turn_id TEXT PRIMARY KEY, next_state TEXT, terminal_reason TEXT, paired_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS judgments (
    turn_id TEXT NOT NULL, judge_id TEXT NOT NULL, kind TEXT NOT NULL, votes TEXT NOT NULL, eval_score INTEGER,
    accepted INTEGER NOT NULL, hint TEXT, judge_model TEXT, created_at REAL NOT NULL,
    PRIMARY KEY (turn_id, judge_id, kind)
);
CREATE TABLE IF NOT EXISTS teacher (
    turn_id TEXT NOT NULL, judge_id TEXT NOT NULL, hint TEXT NOT NULL, teacher_logprobs TEXT NOT NULL,
    teacher_model TEXT, created_at REAL NOT NULL, PRIMARY KEY (turn_id, judge_id)
);
CREATE TABLE IF NOT EXISTS samples (
    sample_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, mode TEXT NOT NULL, kind TEXT NOT NULL,
    reward REAL NOT NULL, weight_version INTEGER NOT NULL, response_length INTEGER NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_by_time ON samples (created_at);
CREATE INDEX IF NOT EXISTS samples_by_version ON samples (weight_version, kind, reward, response_length);
CREATE INDEX IF NOT EXISTS samples_by_kind ON samples (kind);
CREATE TABLE IF NOT EXISTS version_traffic (
    weight_version INTEGER NOT NULL, kind TEXT NOT NULL, samples INTEGER NOT NULL, reward_sum REAL NOT NULL,
    length_sum INTEGER NOT NULL, PRIMARY KEY (weight_version, kind)
);
CREATE INDEX IF NOT EXISTS pairs_by_time ON pairs (paired_at);
CREATE INDEX IF NOT EXISTS judgments_by_time ON judgments (created_at);
CREATE INDEX IF NOT EXISTS teacher_by_time ON teacher (created_at);
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY, step INTEGER NOT NULL, samples_trained INTEGER NOT NULL, path TEXT NOT NULL,
    created_at REAL NOT NULL, figures TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS versions_by_time ON versions (created_at);
CREATE TABLE IF NOT EXISTS trained (sample_id TEXT PRIMARY KEY, version INTEGER NOT NULL, advantage REAL);
CREATE TABLE IF NOT EXISTS evals (
    version INTEGER NOT NULL, question_set TEXT NOT NULL, scores TEXT NOT NULL, answers TEXT NOT NULL,
    mean_words REAL NOT NULL, evaluated_at REAL NOT NULL, PRIMARY KEY (version, question_set)
);
CREATE TABLE IF NOT EXISTS decisions (
    version INTEGER NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL, by TEXT NOT NULL, decided_at REAL NOT NULL,
    against INTEGER, checks TEXT NOT NULL, PRIMARY KEY (version, state, by, decided_at)
);
CREATE INDEX IF NOT EXISTS decisions_by_time ON decisions (decided_at);
CREATE TABLE IF NOT EXISTS dead_letters (
    source_topic TEXT NOT NULL, source_partition INTEGER NOT NULL, source_offset INTEGER NOT NULL,
    consumer_group TEXT NOT NULL, error_kind TEXT NOT NULL, error TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (source_topic, source_partition, source_offset, consumer_group)
);
CREATE TABLE IF NOT EXISTS offsets (
    topic TEXT NOT NULL, partition INTEGER NOT NULL, next_offset INTEGER NOT NULL, PRIMARY KEY (topic, partition)
);
"""

TABLES = (
    "turns",
    "sessions",
    "version_traffic",
    "pairs",
    "judgments",
    "teacher",
    "samples",
    "versions",
    "trained",
    "evals",
    "decisions",
    "dead_letters",
)


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def connect(path: str | Path, *, readonly: bool = False) -> sqlite3.Connection:
    """A connection to the projection (created with its schema when written). Readers open their own."""
    if readonly:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    else:
        private_dir(Path(path).parent)  # whole conversations: the owner's only, its WAL and journal too
        db = sqlite3.connect(str(private_file(Path(path))), check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        if db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
            # A projection of another layout: it is a cache of the topics, so it is emptied (offsets too) and the
            # feed rebuilds it from the beginning.
            for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                db.execute(f"DROP TABLE IF EXISTS {name}")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.executescript(SCHEMA)
    db.row_factory = sqlite3.Row
    return db


Row = dict[str, Any]


def _rows(event: Event) -> list[tuple[str, Row]]:
    """(table, row by column) for one event; an event the console does not show gives none."""
    if isinstance(event, Turn):
        row: Row = {
            "turn_id": event.turn_id,
            "session_id": event.session_id,
            "turn_index": event.turn_index,
            "created_at": event.created_at,
            "weight_version": event.weight_version,
            "model": event.model,
            "finish_reason": event.finish_reason,
            "messages": _json(event.messages),
            "response": _json(event.response),
            "response_token_ids": _json(event.response_token_ids),
            "response_logprobs": _json(event.response_logprobs),
            "session_done": int(event.session_done),
            "user": event.user,
        }
        return [("turns", row)]
    if isinstance(event, PairedTurn):
        row = {
            "turn_id": event.turn.turn_id,
            "next_state": None if event.next_state is None else _json(event.next_state),
            "terminal_reason": event.terminal_reason,
            "paired_at": event.paired_at,
        }
        return [("pairs", row)]
    if isinstance(event, Judgment):
        row = {
            "turn_id": event.turn_id,
            "judge_id": event.judge_id,
            "kind": event.kind,
            "votes": _json(event.votes),
            "eval_score": event.eval_score,
            "accepted": int(event.accepted),
            "hint": event.hint,
            "judge_model": event.judge_model,
            "created_at": event.created_at,
        }
        return [("judgments", row)]
    if isinstance(event, TeacherScores):
        row = {
            "turn_id": event.turn_id,
            "judge_id": event.judge_id,
            "hint": event.hint,
            "teacher_logprobs": _json(event.teacher_logprobs),
            "teacher_model": event.teacher_model,
            "created_at": event.created_at,
        }
        return [("teacher", row)]
    if isinstance(event, Sample):
        row = {
            "sample_id": event.sample_id,
            "session_id": event.session_id,
            "mode": event.mode,
            "kind": event.kind,
            "reward": event.reward,
            "weight_version": event.weight_version,
            "response_length": event.response_length,
            "created_at": event.created_at,
        }
        return [("samples", row)]
    if isinstance(event, WeightsPublished):
        version: Row = {
            "version": event.version,
            "step": event.step,
            "samples_trained": event.samples_trained,
            "path": event.path,
            "created_at": event.created_at,
            "figures": _json(event.figures),
        }
        advantages: list[float | None] = list(event.advantages) or [None] * len(event.sample_ids)
        trained = [
            ("trained", {"sample_id": sid, "version": event.version, "advantage": adv})
            for sid, adv in zip(event.sample_ids, advantages, strict=True)
        ]
        return [("versions", version), *trained]
    if isinstance(event, EvalResult):
        row = {
            "version": event.version,
            "question_set": event.question_set,
            "scores": _json(event.scores),
            "answers": _json(event.answers),
            "mean_words": event.mean_words,
            "evaluated_at": event.evaluated_at,
        }
        return [("evals", row)]
    if isinstance(event, VersionDecision):
        row = {
            "version": event.version,
            "state": event.state,
            "reason": event.reason,
            "by": event.by,
            "decided_at": event.decided_at,
            "against": event.against,
            "checks": _json(event.checks),
        }
        return [("decisions", row)]
    if isinstance(event, DeadLetter):
        row = {
            "source_topic": event.source_topic,
            "source_partition": event.source_partition,
            "source_offset": event.source_offset,
            "consumer_group": event.consumer_group,
            "error_kind": event.error_kind,
            "error": event.error,
            "created_at": event.created_at,
        }
        return [("dead_letters", row)]
    return []


_SESSION_TURN = """
INSERT INTO sessions (session_id, user, turns, first_at, last_at, version) VALUES (?, ?, 1, ?, ?, ?)
ON CONFLICT (session_id) DO UPDATE SET
    user = CASE WHEN excluded.user != '' THEN excluded.user ELSE sessions.user END,
    turns = (SELECT COUNT(*) FROM turns WHERE turns.session_id = excluded.session_id),
    first_at = MIN(COALESCE(sessions.first_at, excluded.first_at), excluded.first_at),
    last_at = MAX(COALESCE(sessions.last_at, excluded.last_at), excluded.last_at),
    version = MAX(COALESCE(sessions.version, excluded.version), excluded.version)
"""
_SESSION_JUDGED = """
UPDATE sessions SET judged_index = ?, outcome = ? WHERE session_id = ? AND COALESCE(judged_index, 0) <= ?
"""
_VERSION_TRAFFIC = """
INSERT OR REPLACE INTO version_traffic
SELECT ?, ?, COUNT(*), SUM(reward), SUM(response_length) FROM samples WHERE weight_version = ? AND kind = ?
"""
OUTCOMES = {1: "good", -1: "bad", 0: "neutral"}
"""A session's outcome: the eval score of its last judged turn (the first judge's, by id, when several voted)."""


def _derive(db: sqlite3.Connection, event: Event) -> None:
    """The summaries that keep pages fast at 100,000 turns (``sessions``; ``version_traffic``, samples per version
    and kind). Each is recomputed from the stored rows it sums, not from arrival order, so a redelivery or a replay
    derives the same rows."""
    if isinstance(event, Turn):
        db.execute(
            _SESSION_TURN,
            (event.session_id, event.user, event.created_at, event.created_at, event.weight_version),
        )
    elif isinstance(
        event, Sample
    ):  # the samples a version's traffic made, by kind: the versions page's figures
        db.execute(_VERSION_TRAFFIC, (event.weight_version, event.kind, event.weight_version, event.kind))
    elif isinstance(event, Judgment) and event.kind == "eval" and event.eval_score is not None:
        session_id, _, index = event.turn_id.rpartition(":")
        if not index.isdigit():
            return
        score = db.execute(
            "SELECT eval_score FROM judgments WHERE turn_id = ? AND kind = 'eval' AND eval_score IS NOT NULL "
            "ORDER BY judge_id LIMIT 1",
            (event.turn_id,),
        ).fetchone()[0]
        db.execute("INSERT OR IGNORE INTO sessions (session_id) VALUES (?)", (session_id,))
        db.execute(_SESSION_JUDGED, (int(index), OUTCOMES.get(int(score), "neutral"), session_id, int(index)))


def apply(
    db: sqlite3.Connection, events: Iterable[Event], offsets: dict[tuple[str, int], int] | None = None
) -> int:
    """Write a batch and the offsets it was read up to, in one transaction. Returns the rows written."""
    written = 0
    with db:
        for event in events:
            for table, row in _rows(event):
                columns = ", ".join(row)
                marks = ", ".join(f":{c}" for c in row)
                db.execute(f"INSERT OR REPLACE INTO {table} ({columns}) VALUES ({marks})", row)
                written += 1
            _derive(db, event)
        for (topic, partition), offset in (offsets or {}).items():
            db.execute("INSERT OR REPLACE INTO offsets VALUES (?, ?, ?)", (topic, partition, offset))
    return written


def stored_offsets(db: sqlite3.Connection) -> dict[tuple[str, int], int]:
    return {(r["topic"], r["partition"]): r["next_offset"] for r in db.execute("SELECT * FROM offsets")}


def dump(db: sqlite3.Connection, tables: Sequence[str] = TABLES) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the projection's tables, sorted: two projections of the same records dump equal."""
    return {t: sorted(tuple(r) for r in db.execute(f"SELECT * FROM {t}")) for t in tables}


def loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


_BY_SESSION = ("turns", "sessions", "samples")
"""Tables with a ``session_id`` column."""
_BY_TURN = (("pairs", "turn_id"), ("judgments", "turn_id"), ("teacher", "turn_id"), ("trained", "sample_id"))
"""Tables keyed by a turn id (``<session id>:<n>``) alone."""


def _of_sessions(turn_id: str, sessions: set[str]) -> bool:
    session, _, index = turn_id.rpartition(":")
    return index.isdigit() and session in sessions


def _turn_rows(db: sqlite3.Connection, sessions: set[str]) -> dict[str, list[str]]:
    """Per table keyed by turn id, the ids of the sessions' rows (session ids may hold ``:`` or SQL wildcards, so
    the match is made here, not by LIKE)."""
    out: dict[str, list[str]] = {}
    for table, column in _BY_TURN:
        ids = [r[0] for r in db.execute(f"SELECT {column} FROM {table}")]
        out[table] = [i for i in ids if _of_sessions(i, sessions)]
    return out


def session_rows(db: sqlite3.Connection, sessions: Iterable[str]) -> int:
    """How many rows of the projection belong to the sessions."""
    wanted = set(sessions)
    marks = ", ".join("?" * len(wanted))
    count = sum(
        int(
            db.execute(f"SELECT COUNT(*) FROM {t} WHERE session_id IN ({marks})", tuple(wanted)).fetchone()[0]
        )
        for t in _BY_SESSION
    )
    return count + sum(len(ids) for ids in _turn_rows(db, wanted).values())


def forget_sessions(db: sqlite3.Connection, sessions: Iterable[str]) -> int:
    """Delete every row of the sessions, overwriting what they held (``secure_delete``), and leave nothing of
    them in the WAL or free pages either. Returns the rows deleted. The records they came from must be unreadable
    first (their keys destroyed), or the feed writes them again."""
    wanted = set(sessions)
    if not wanted:
        return 0
    marks = ", ".join("?" * len(wanted))
    db.execute("PRAGMA secure_delete = ON")
    deleted = 0
    with db:
        for table, ids in _turn_rows(db, wanted).items():
            column = dict(_BY_TURN)[table]
            deleted += sum(db.execute(f"DELETE FROM {table} WHERE {column} = ?", (i,)).rowcount for i in ids)
        for table in _BY_SESSION:
            deleted += db.execute(
                f"DELETE FROM {table} WHERE session_id IN ({marks})", tuple(wanted)
            ).rowcount
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.execute("VACUUM")
    return deleted
