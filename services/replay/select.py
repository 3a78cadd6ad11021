"""Which recorded turns a replay takes: a namespace's ``turns`` topic, limited by record time and/or offset."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import msgspec

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import EventProducer, Record, read_topic
from schemas import PairedTurn, SessionEnded, Turn
from schemas.topics import SESSIONS_ENDED, TURNS, TURNS_PAIRED


class Range(msgspec.Struct, frozen=True):
    """Record time in ms since the epoch (Kafka's timestamps) and per-partition offsets; None: unbounded."""

    since_ms: int | None = None
    until_ms: int | None = None
    """Exclusive."""
    from_offset: int | None = None
    to_offset: int | None = None
    """Exclusive."""

    def holds(self, rec: Record[Any]) -> bool:
        if self.from_offset is not None and rec.offset < self.from_offset:
            return False
        if self.to_offset is not None and rec.offset >= self.to_offset:
            return False
        return self.until_ms is None or rec.timestamp_ms is None or rec.timestamp_ms < self.until_ms


def parse_time(text: str) -> int:
    """Milliseconds since the epoch from ISO 8601 (``2026-11-29T12:00``, UTC unless it says otherwise) or from
    seconds since the epoch."""
    try:
        return int(float(text) * 1000)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither ISO 8601 nor seconds since the epoch") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp() * 1000)


async def recorded_turns(kafka: KafkaConfig, span: Range) -> AsyncIterator[Record[Turn]]:
    """The turns of ``kafka.namespace`` in ``span``, partition by partition in log order (each session's turns in
    order: sessions are the partitioning key). Reads up to the end as of the call; live topics are only read."""
    async for rec in read_topic(kafka, TURNS, since_ms=span.since_ms, timeout_s=600):
        if span.holds(rec):
            yield rec


async def recorded_session_ends(kafka: KafkaConfig, span: Range) -> AsyncIterator[SessionEnded]:
    """The session ends (``sessions.ended``: ``X-Session-Done`` on side requests) of ``kafka.namespace`` in
    ``span``."""
    async for rec in read_topic(kafka, SESSIONS_ENDED, since_ms=span.since_ms, timeout_s=600):
        if span.holds(rec):
            yield rec.event


async def next_states(kafka: KafkaConfig, turn_ids: set[str]) -> dict[str, PairedTurn]:
    """The pairing of each of ``turn_ids`` on ``turns.paired`` (the last one, if it was paired again)."""
    found: dict[str, PairedTurn] = {}
    async for rec in read_topic(kafka, TURNS_PAIRED, timeout_s=600):
        if rec.event.turn_id in turn_ids:
            found[rec.event.turn_id] = rec.event
    return found


async def publish_turns(
    producer: EventProducer, turns: AsyncIterable[Turn] | Iterable[Turn], window: int = 512
) -> int:
    """Publish turns keyed by session (so each session keeps its order), up to ``window`` awaiting their
    acknowledgement at once; returns how many, all acknowledged."""
    pending: list[asyncio.Future[object]] = []
    count = 0

    async def each() -> AsyncIterator[Turn]:
        if isinstance(turns, AsyncIterable):
            async for t in turns:
                yield t
        else:
            for t in turns:
                yield t

    async for turn in each():
        pending.append(await producer.send_nowait(TURNS, turn, turn.session_id))
        count += 1
        if len(pending) >= window:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    return count
