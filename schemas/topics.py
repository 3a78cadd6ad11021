"""Topic specs: name, event type, partitioning key, retention. Names take an optional namespace prefix so
that a replay can re-derive everything into separate topics without touching live ones."""

from __future__ import annotations

import re
from typing import Final

import msgspec

from schemas.events import (
    DeadLetter,
    EvalResult,
    Event,
    Judgment,
    PairedTurn,
    Sample,
    SessionEnded,
    TeacherScores,
    Turn,
    VersionDecision,
    WeightsPublished,
)

DAY_MS: Final = 24 * 3600 * 1000
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
"""Kafka's limit for one record (``max.message.bytes``): large enough for a 32k-token response with top-20
teacher log-probs."""
RECORD_OVERHEAD_BYTES: Final = 4096
"""Room for a record's key and Kafka's batch framing: a value may hold the rest of ``MAX_MESSAGE_BYTES``."""
MAX_TURN_BYTES: Final = MAX_MESSAGE_BYTES // 4
"""The largest ``Turn`` record. Records downstream embed turns: a pairing holds a turn and its next state (taken
from a later turn's request, so at most another turn), a judgment embeds a pairing, and a dead letter copies
any of these. A quarter of the record limit keeps every one of them under it by construction."""

_NAMESPACE_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,150}\.$")


class TopicSpec(msgspec.Struct, frozen=True):
    base: str
    """Name without namespace, e.g. ``turns``."""
    event_type: type[Event]
    key: str
    """What records are keyed by (documentation; producers pass the key)."""
    partitions: int
    retention_ms: int
    """-1 keeps records forever."""
    compacted: bool = False
    description: str = ""
    private: bool = False
    """Its records hold people's conversations, keyed by session id: sealed under the session's key, so that
    forgetting the session (destroying the key) erases them wherever they are."""

    def name(self, namespace: str = "") -> str:
        return topic_name(self.base, namespace)

    def configs(self, retention_ms: int | None = None) -> dict[str, str]:
        """The topic's Kafka configs; ``retention_ms`` overrides the spec's (``kafka.retention_days``)."""
        cfg = {
            "retention.ms": str(self.retention_ms if retention_ms is None else retention_ms),
            "max.message.bytes": str(MAX_MESSAGE_BYTES),
            "cleanup.policy": "compact" if self.compacted else "delete",
        }
        if self.compacted:
            cfg["min.cleanable.dirty.ratio"] = "0.1"
            cfg["segment.ms"] = str(3600 * 1000)
        return cfg


def normalize_namespace(namespace: str | None) -> str:
    """``""`` for none; otherwise the prefix ending in a dot (``replay-1`` becomes ``replay-1.``)."""
    if not namespace:
        return ""
    ns = namespace if namespace.endswith(".") else namespace + "."
    if not _NAMESPACE_RE.match(ns):
        raise ValueError(f"namespace: {namespace!r} may hold only letters, digits, '.', '_' and '-'")
    return ns


def topic_name(base: str, namespace: str | None = "") -> str:
    return normalize_namespace(namespace) + base


TURNS: Final = TopicSpec(
    "turns",
    Turn,
    "session_id",
    12,
    -1,
    description="every main-line turn; the source of truth, kept forever",
    private=True,
)
SESSIONS_ENDED: Final = TopicSpec(
    "sessions.ended",
    SessionEnded,
    "session_id",
    12,
    -1,
    description="sessions a client ended on a side request; kept forever beside turns (the pairer replays both)",
    private=True,
)
TURNS_PAIRED: Final = TopicSpec(
    "turns.paired",
    PairedTurn,
    "session_id",
    12,
    30 * DAY_MS,
    description="turn + next state, or terminal",
    private=True,
)
JUDGMENTS: Final = TopicSpec(
    "judgments",
    Judgment,
    "session_id",
    12,
    30 * DAY_MS,
    description="one per (turn, judge_id, kind)",
    private=True,
)
TEACHER: Final = TopicSpec(
    "teacher",
    TeacherScores,
    "session_id",
    12,
    30 * DAY_MS,
    description="teacher log-probs per response token",
    private=True,
)
SAMPLES: Final = TopicSpec(
    "samples",
    Sample,
    "session_id",
    12,
    30 * DAY_MS,
    description="training-ready samples; sample_id = turn_id",
    private=True,
)
WEIGHTS: Final = TopicSpec(
    "weights", WeightsPublished, '"policy"', 1, -1, compacted=True, description="latest weight version wins"
)
EVALS: Final = TopicSpec(
    "evals",
    EvalResult,
    "version",
    1,
    -1,
    description="the held-out evaluation of each weight version; kept forever (the learning curve)",
)
VERSIONS: Final = TopicSpec(
    "versions",
    VersionDecision,
    '"policy"',
    1,
    -1,
    description="which weight version is served: each gate, manual and trainer decision; kept forever (replayed)",
)
DEADLETTER: Final = TopicSpec(
    "deadletter",
    DeadLetter,
    "source key",
    3,
    30 * DAY_MS,
    description="records a consumer could not use",
    private=True,
)

ALL_TOPICS: Final[tuple[TopicSpec, ...]] = (
    TURNS,
    SESSIONS_ENDED,
    TURNS_PAIRED,
    JUDGMENTS,
    TEACHER,
    SAMPLES,
    WEIGHTS,
    EVALS,
    VERSIONS,
    DEADLETTER,
)
BY_BASE: Final[dict[str, TopicSpec]] = {t.base: t for t in ALL_TOPICS}


def spec_for(base: str) -> TopicSpec:
    try:
        return BY_BASE[base]
    except KeyError:
        raise KeyError(f"unknown topic {base!r}; known: {', '.join(BY_BASE)}") from None
