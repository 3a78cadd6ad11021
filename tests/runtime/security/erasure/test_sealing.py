"""Sealing on the real broker: what goes to a topic that holds conversations is sealed under the session's key
(the raw record shows nothing of the conversation), every reader opens it, and once the key is destroyed readers
and consumers skip the session's records, counted, while other sessions' go on."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from prometheus_client import REGISTRY

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import EventConsumer, EventProducer, read_topic
from runtime.security.erasure.envelope import is_sealed
from runtime.security.erasure.sealing import session_keys
from schemas import Message, Turn
from schemas.topics import EVALS, TURNS
from services.forget.topics import raw_records
from tests.strategies import example_turn


def forgotten(kafka: KafkaConfig) -> float:
    labels = {"topic": TURNS.name(kafka.namespace)}
    return REGISTRY.get_sample_value("turnstream_bus_forgotten_total", labels) or 0.0


pytestmark = pytest.mark.integration


async def raw_values(kafka: KafkaConfig, topic: str) -> list[bytes]:
    return [rec.value or b"" async for rec in raw_records(kafka, topic)]


async def test_records_are_sealed_per_session_and_a_forgotten_one_is_skipped_by_every_reader(
    kafka: KafkaConfig,
) -> None:
    secret = "my bank password is hunter2"
    turns = [
        example_turn(s, messages=[Message(role="user", content=f"{secret} ({s})")])
        for s in ("alice-1", "bob-1")
    ]
    async with EventProducer(kafka) as producer:
        for t in turns:
            await producer.send(TURNS, t, t.session_id)
    raw = await raw_values(kafka, TURNS.name(kafka.namespace))
    assert len(raw) == 2 and all(is_sealed(v) and b"hunter2" not in v for v in raw)
    assert sorted([r.event.session_id async for r in read_topic(kafka, TURNS)]) == ["alice-1", "bob-1"]

    store = session_keys(kafka)
    assert store is not None and await store.destroy(["alice-1"]) == 1
    before = forgotten(kafka)
    assert [r.event.session_id async for r in read_topic(kafka, TURNS)] == ["bob-1"]
    seen: list[Turn] = []
    consumer = EventConsumer(kafka, [TURNS], group_id="sealing-test")
    await consumer.start()

    async def handle(records: list) -> None:  # type: ignore[type-arg]
        seen.extend(r.event for r in records)
        consumer.request_stop()

    await asyncio.wait_for(consumer.run(handle), 60)
    assert [t.session_id for t in seen] == ["bob-1"]
    assert forgotten(kafka) == before + 2
    # Topics without conversations stay in the clear; a record without a session key is never sealed.
    unsealed = msgspec.structs.replace(kafka, seal=False)
    async with EventProducer(unsealed) as producer:
        await producer.send(TURNS, example_turn("carol-1"), "carol-1")
    assert not any(
        is_sealed(v) and b"carol" in v for v in await raw_values(kafka, TURNS.name(kafka.namespace))
    )
    assert "carol-1" in [r.event.session_id async for r in read_topic(kafka, TURNS)]  # clear records read too
    assert EVALS.private is False
    # The session begins again after it was forgotten: a new key; its old records stay forgotten (skipped and
    # counted, never taken for altered ones and dead-lettered), the new one reads.
    async with EventProducer(kafka) as producer:
        await producer.send(TURNS, example_turn("alice-1", 2), "alice-1")
    fresh = msgspec.structs.replace(kafka, seal_keys_cache_s=0.1)
    found = sorted([(r.event.session_id, r.event.turn_index) async for r in read_topic(fresh, TURNS)])
    assert found == [("alice-1", 2), ("bob-1", 1), ("carol-1", 1)]
