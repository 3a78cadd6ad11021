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

from schemas import (
    DeadLetter,
    EvalResult,
    Event,
    Judgment,
    PairedTurn,
    Sample,
    TeacherScores,
    Turn,
    WeightsPublished,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    turn_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, turn_index INTEGER NOT NULL, created_at REAL NOT NULL,
    weight_version INTEGER NOT NULL, model TEXT, finish_reason TEXT, messages TEXT NOT NULL, response TEXT NOT NULL,
    response_token_ids TEXT NOT NULL, response_logprobs TEXT NOT NULL, session_done INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS turns_by_session ON turns (session_id, turn_index);
CREATE INDEX IF NOT EXISTS turns_by_time ON turns (created_at);
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
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY, step INTEGER NOT NULL, samples_trained INTEGER NOT NULL, path TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS trained (sample_id TEXT PRIMARY KEY, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS evals (
    version INTEGER NOT NULL, question_set TEXT NOT NULL, scores TEXT NOT NULL, answers TEXT NOT NULL,
    mean_words REAL NOT NULL, evaluated_at REAL NOT NULL, PRIMARY KEY (version, question_set)
);
CREATE TABLE IF NOT EXISTS dead_letters (
    source_topic TEXT NOT NULL, source_partition INTEGER NOT NULL, source_offset INTEGER NOT NULL,
    consumer_group TEXT NOT NULL, error_kind TEXT NOT NULL, error TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (source_topic, source_partition, source_offset, consumer_group)
);
CREATE TABLE IF NOT EXISTS offsets (
    topic TEXT NOT NULL, partition INTEGER NOT NULL, next_offset INTEGER NOT NULL, PRIMARY KEY (topic, partition)
);
"""

TABLES = ("turns", "pairs", "judgments", "teacher", "samples", "versions", "trained", "evals", "dead_letters")


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def connect(path: str | Path, *, readonly: bool = False) -> sqlite3.Connection:
    """A connection to the projection (created with its schema when written). Readers open their own."""
    if readonly:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    else:
        db = sqlite3.connect(str(path), check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
    db.row_factory = sqlite3.Row
    return db


def _rows(event: Event) -> list[tuple[str, tuple[Any, ...]]]:
    """(table, row) for one event; an event the console does not show gives none."""
    if isinstance(event, Turn):
        return [
            (
                "turns",
                (
                    event.turn_id,
                    event.session_id,
                    event.turn_index,
                    event.created_at,
                    event.weight_version,
                    event.model,
                    event.finish_reason,
                    _json(event.messages),
                    _json(event.response),
                    _json(event.response_token_ids),
                    _json(event.response_logprobs),
                    int(event.session_done),
                ),
            )
        ]
    if isinstance(event, PairedTurn):
        return [
            (
                "pairs",
                (
                    event.turn.turn_id,
                    None if event.next_state is None else _json(event.next_state),
                    event.terminal_reason,
                    event.paired_at,
                ),
            )
        ]
    row: tuple[Any, ...]
    if isinstance(event, Judgment):
        row = (
            event.turn_id,
            event.judge_id,
            event.kind,
            _json(event.votes),
            event.eval_score,
            int(event.accepted),
            event.hint,
            event.judge_model,
            event.created_at,
        )
        return [("judgments", row)]
    if isinstance(event, TeacherScores):
        row = (
            event.turn_id,
            event.judge_id,
            event.hint,
            _json(event.teacher_logprobs),
            event.teacher_model,
            event.created_at,
        )
        return [("teacher", row)]
    if isinstance(event, Sample):
        row = (
            event.sample_id,
            event.session_id,
            event.mode,
            event.kind,
            event.reward,
            event.weight_version,
            event.response_length,
            event.created_at,
        )
        return [("samples", row)]
    if isinstance(event, WeightsPublished):
        version = (
            "versions",
            (event.version, event.step, event.samples_trained, event.path, event.created_at),
        )
        return [version, *(("trained", (sid, event.version)) for sid in event.sample_ids)]
    if isinstance(event, EvalResult):
        row = (
            event.version,
            event.question_set,
            _json(event.scores),
            _json(event.answers),
            event.mean_words,
            event.evaluated_at,
        )
        return [("evals", row)]
    if isinstance(event, DeadLetter):
        row = (
            event.source_topic,
            event.source_partition,
            event.source_offset,
            event.consumer_group,
            event.error_kind,
            event.error,
            event.created_at,
        )
        return [("dead_letters", row)]
    return []


def apply(
    db: sqlite3.Connection, events: Iterable[Event], offsets: dict[tuple[str, int], int] | None = None
) -> int:
    """Write a batch and the offsets it was read up to, in one transaction. Returns the rows written."""
    written = 0
    with db:
        for event in events:
            for table, row in _rows(event):
                marks = ", ".join("?" * len(row))
                db.execute(f"INSERT OR REPLACE INTO {table} VALUES ({marks})", row)
                written += 1
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
