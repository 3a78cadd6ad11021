"""The consumer that keeps the console's projection current: every topic the pages read, from the offsets the
projection stored (the beginning for a new file), applied in batches with their offsets in one transaction."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import kafka_consumer, topic_partitions
from runtime.security.erasure.sealing import open_value
from schemas import DecodeError, Event, decode_any
from schemas.topics import (
    DEADLETTER,
    EVALS,
    JUDGMENTS,
    SAMPLES,
    TEACHER,
    TURNS,
    TURNS_PAIRED,
    VERSIONS,
    WEIGHTS,
    TopicSpec,
)
from services.console.projection import apply, stored_offsets

log = logging.getLogger("turnstream.console")

SHOWN: tuple[TopicSpec, ...] = (
    TURNS,
    TURNS_PAIRED,
    JUDGMENTS,
    TEACHER,
    SAMPLES,
    WEIGHTS,
    EVALS,
    VERSIONS,
    DEADLETTER,
)
APPLIED = Counter(
    "turnstream_console_records_total", "Records applied to the console's projection", ["topic"]
)
UNDECODABLE = Counter(
    "turnstream_console_undecodable_total", "Records the console skipped (their consumers dead-letter them)"
)
BEHIND = Gauge("turnstream_console_lag_records", "Records on the topics not yet in the projection", ["topic"])


async def follow(
    kafka: KafkaConfig, db: sqlite3.Connection, stop: asyncio.Event, *, caught_up: asyncio.Event | None = None
) -> None:
    """Apply every new record until ``stop``; ``caught_up`` is set once the projection has reached the end of
    every topic as it was at start (a rebuild from a replay, or a restart)."""
    consumer = kafka_consumer(kafka, client_id=f"{kafka.client_id}-console")
    await consumer.start()
    try:
        tps: list[TopicPartition] = []
        for spec in SHOWN:
            tps += await topic_partitions(consumer, spec.name(kafka.namespace))
        consumer.assign(tps)
        stored = await asyncio.to_thread(stored_offsets, db)
        beginning = await consumer.beginning_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(stored.get((tp.topic, tp.partition), 0), beginning[tp]))
        target = await consumer.end_offsets(tps)
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=kafka.poll_timeout_ms, max_records=kafka.max_batch)
            events: list[Event] = []
            offsets: dict[tuple[str, int], int] = {}
            for tp, records in batch.items():
                for record in records:
                    try:
                        value = await open_value(kafka, tp.topic, record.key, record.value or b"")
                        if value is not None:  # None: a forgotten session's (counted)
                            events.append(decode_any(value))
                            APPLIED.labels(tp.topic).inc()
                    except DecodeError:
                        UNDECODABLE.inc()
                    offsets[(tp.topic, tp.partition)] = record.offset + 1
            if offsets:
                await asyncio.to_thread(apply, db, events, offsets)
            if caught_up is not None and not caught_up.is_set():
                positions = {tp: await consumer.position(tp) for tp in tps}
                if all(positions[tp] >= target[tp] for tp in tps):
                    caught_up.set()
            if not batch:
                ends = await consumer.end_offsets(tps)
                behind: dict[str, int] = {}
                for tp in tps:
                    behind[tp.topic] = behind.get(tp.topic, 0) + max(
                        0, ends[tp] - await consumer.position(tp)
                    )
                for topic, records in behind.items():
                    BEHIND.labels(topic).set(records)
    finally:
        await consumer.stop()
