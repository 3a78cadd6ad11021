"""The bus against the real Kafka broker: round trips, commits, rebalancing, dead letters, transactions,
replay and graceful shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import (
    EventConsumer,
    EventProducer,
    Record,
    consumer_group,
    kafka_consumer,
    read_topic,
)
from schemas import DeadLetter, Turn, decode, encode, spec_for
from schemas.topics import ALL_TOPICS, DEADLETTER, TURNS, WEIGHTS
from tests.strategies import example_events, example_turn

pytestmark = pytest.mark.integration


async def run_until(
    consumer: EventConsumer,
    handler: Callable[[list[Record[Any]]], Awaitable[None]],
    done: Callable[[], bool],
    within: float = 60.0,
) -> None:
    """Run ``consumer`` until ``done()``; then stop it (committing) and return."""
    task = asyncio.create_task(consumer.run(handler))
    deadline = time.monotonic() + within
    try:
        while not done():
            if task.done():
                task.result()
                raise AssertionError("consumer stopped before the condition held")
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            await asyncio.sleep(0.05)
    finally:
        consumer.request_stop()
        await asyncio.wait_for(task, 30)


async def produce_turns(kafka: KafkaConfig, count: int, sessions: int = 6) -> list[str]:
    async with EventProducer(kafka) as producer:
        futures = []
        ids = []
        for i in range(count):
            sid = f"sess{i % sessions}"
            turn = example_turn(sid, i // sessions + 1)
            ids.append(turn.turn_id)
            futures.append(await producer.send_nowait(TURNS, turn, sid))
        await asyncio.gather(*futures)
    return ids


async def test_every_event_type_round_trips_through_kafka(kafka: KafkaConfig) -> None:
    events = example_events("roundtrip")
    async with EventProducer(kafka) as producer:
        for spec in ALL_TOPICS:
            await producer.send(spec, events[spec.event_type], "roundtrip")
    seen: dict[type, Any] = {}

    async def handler(batch: list[Record[Any]]) -> None:
        for rec in batch:
            assert rec.key == b"roundtrip"
            seen[type(rec.event)] = rec.event

    consumer = EventConsumer(kafka, ALL_TOPICS, "g-roundtrip")
    await consumer.start()
    await run_until(consumer, handler, lambda: len(seen) == len(ALL_TOPICS))
    assert seen == events


async def test_producer_refuses_an_event_on_the_wrong_topic(kafka: KafkaConfig) -> None:
    async with EventProducer(kafka) as producer:
        with pytest.raises(TypeError, match="WeightsPublished"):
            await producer.send(WEIGHTS, example_turn(), "x")


async def test_group_resumes_from_committed_offset_without_loss_or_duplicate(kafka: KafkaConfig) -> None:
    expected = await produce_turns(kafka, 60)
    seen: list[str] = []
    first_run_batches = 0

    async def first(batch: list[Record[Turn]]) -> None:
        nonlocal first_run_batches
        seen.extend(r.event.turn_id for r in batch)
        first_run_batches += 1
        if first_run_batches == 2:
            c1.request_stop()  # this batch still completes and commits

    c1 = EventConsumer(kafka, [TURNS], "g-resume", max_batch=7)
    await c1.start()
    await asyncio.wait_for(c1.run(first), 60)
    after_first = len(seen)
    assert 0 < after_first < len(expected)

    async def second(batch: list[Record[Turn]]) -> None:
        seen.extend(r.event.turn_id for r in batch)

    c2 = EventConsumer(kafka, [TURNS], "g-resume", max_batch=7)
    await c2.start()
    await run_until(c2, second, lambda: len(seen) >= len(expected))
    await asyncio.sleep(0.5)
    assert sorted(seen) == sorted(expected), "every record exactly once across the restart"


async def test_two_consumers_split_partitions_and_one_takes_over(kafka: KafkaConfig) -> None:
    owners: dict[str, set[int]] = {"a": set(), "b": set()}
    seen: list[str] = []

    def handler_for(name: str) -> Callable[[list[Record[Turn]]], Awaitable[None]]:
        async def handler(batch: list[Record[Turn]]) -> None:
            for rec in batch:
                owners[name].add(rec.partition)
                seen.append(rec.event.turn_id)

        return handler

    a = EventConsumer(kafka, [TURNS], "g-split")
    b = EventConsumer(kafka, [TURNS], "g-split")
    await a.start()
    await b.start()
    task_a = asyncio.create_task(a.run(handler_for("a")))
    task_b = asyncio.create_task(b.run(handler_for("b")))
    # Wait until both hold partitions: one group, disjoint assignments covering all three.
    deadline = time.monotonic() + 60
    while not (a.assignment() and b.assignment() and len(a.assignment() | b.assignment()) == 3):
        assert time.monotonic() < deadline, "group never settled on two members"
        await asyncio.sleep(0.1)
    assert not (a.assignment() & b.assignment())

    first = await produce_turns(kafka, 30)
    deadline = time.monotonic() + 60
    while len(seen) < len(first):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert owners["a"] and owners["b"], "both members did work"
    assert not (owners["a"] & owners["b"]), "no partition was read by both"

    b.request_stop()
    await asyncio.wait_for(task_b, 30)
    deadline = time.monotonic() + 60
    while len(a.assignment()) != 3:
        assert time.monotonic() < deadline, "the survivor never took over all partitions"
        await asyncio.sleep(0.1)

    owners["a"].clear()
    second = await produce_turns(kafka, 30, sessions=9)
    deadline = time.monotonic() + 60
    while len(seen) < len(first) + len(second):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    a.request_stop()
    await asyncio.wait_for(task_a, 30)
    assert owners["a"] == {0, 1, 2}
    assert sorted(seen) == sorted(first + second)


async def test_undecodable_record_is_dead_lettered_and_consumer_keeps_going(kafka: KafkaConfig) -> None:
    turns_topic = TURNS.name(kafka.namespace)
    bad_bytes = b"\xc1 definitely not msgpack"
    invalid = dict(__import__("msgspec").msgpack.decode(encode(example_turn("bad", 1))))
    invalid["response_logprobs"] = [-0.1]  # one log-prob for two response tokens
    async with EventProducer(kafka) as producer:
        await producer.send(TURNS, example_turn("good", 1), "good")
        bad_meta = await producer.send_raw(turns_topic, bad_bytes, key=b"bad")
        invalid_meta = await producer.send_raw(
            turns_topic, __import__("msgspec").msgpack.encode(invalid), key=b"bad"
        )
        await producer.send(TURNS, example_turn("good", 2), "good")
    seen: list[str] = []

    async def handler(batch: list[Record[Turn]]) -> None:
        seen.extend(r.event.turn_id for r in batch)

    consumer = EventConsumer(kafka, [TURNS], "g-dlq")
    await consumer.start()
    await run_until(consumer, handler, lambda: len(seen) == 2)
    assert seen == ["good:1", "good:2"]

    letters: list[DeadLetter] = []
    async for rec in read_topic(kafka, DEADLETTER):
        letters.append(rec.event)
    by_offset = {dl.source_offset: dl for dl in letters}
    assert set(by_offset) == {bad_meta.offset, invalid_meta.offset}
    garbage = by_offset[bad_meta.offset]
    assert garbage.source_topic == turns_topic
    assert garbage.source_partition == bad_meta.partition
    assert garbage.error_kind == "decode"
    assert garbage.payload == bad_bytes
    assert garbage.source_key == b"bad"
    assert garbage.consumer_group == "g-dlq"
    wrong = by_offset[invalid_meta.offset]
    assert wrong.error_kind == "validation"
    assert "response_logprobs" in wrong.error


async def test_aborted_transaction_is_invisible_to_read_committed(kafka: KafkaConfig) -> None:
    """turnstream writes no transactions, but its consumers read committed records only: another writer's aborted
    records must never reach them. A transactional producer (test-only) writes some."""
    from aiokafka import AIOKafkaProducer

    from runtime.messaging.bus import producer_options
    from schemas import encode

    topic = TURNS.name(kafka.namespace)
    producer = AIOKafkaProducer(
        **producer_options(kafka, "turnstream-test-tx"), transactional_id=f"tx-{kafka.namespace}"
    )
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send(topic, encode(example_turn("committed", 1)), key=b"committed")
        await producer.begin_transaction()
        await producer.send(topic, encode(example_turn("aborted", 1)), key=b"aborted")
        await producer.flush()
        await producer.abort_transaction()
        async with producer.transaction():
            await producer.send(topic, encode(example_turn("committed", 2)), key=b"committed")
    finally:
        await producer.stop()

    committed = [r.event.turn_id async for r in read_topic(kafka, TURNS)]
    assert sorted(committed) == ["committed:1", "committed:2"]
    uncommitted = [
        r.event.turn_id async for r in read_topic(kafka, TURNS, isolation_level="read_uncommitted")
    ]
    assert "aborted:1" in uncommitted, "the aborted record did reach the log; only read_committed hides it"

    seen: list[str] = []

    async def handler(batch: list[Record[Turn]]) -> None:
        seen.extend(r.event.turn_id for r in batch)

    consumer = EventConsumer(kafka, [TURNS], "g-tx")
    await consumer.start()
    await run_until(consumer, handler, lambda: len(seen) >= 2)
    await asyncio.sleep(0.3)
    assert sorted(seen) == ["committed:1", "committed:2"]


async def test_replay_from_beginning_and_from_timestamp(kafka: KafkaConfig) -> None:
    early = await produce_turns(kafka, 12)
    await asyncio.sleep(0.05)
    cut_ms = int(time.time() * 1000)
    await asyncio.sleep(0.05)
    async with EventProducer(kafka) as producer:
        late = []
        for i in range(9):
            turn = example_turn(f"late{i % 3}", i // 3 + 1)
            late.append(turn.turn_id)
            await producer.send(TURNS, turn, turn.session_id)

    everything = [r async for r in read_topic(kafka, TURNS)]
    assert sorted(r.event.turn_id for r in everything) == sorted(early + late)
    since = [r async for r in read_topic(kafka, TURNS, since_ms=cut_ms)]
    assert sorted(r.event.turn_id for r in since) == sorted(late)
    assert all(r.timestamp_ms >= cut_ms for r in since)
    # Per partition, a replay yields records in log order.
    for p in {r.partition for r in everything}:
        offsets = [r.offset for r in everything if r.partition == p]
        assert offsets == sorted(offsets)
    # A replay that starts after the last record yields nothing (and terminates).
    assert [r async for r in read_topic(kafka, TURNS, since_ms=int(time.time() * 1000) + 60_000)] == []


async def test_replay_of_a_missing_topic_is_a_clear_error(kafka_config: KafkaConfig) -> None:
    with pytest.raises(KeyError, match="does not exist"):
        async for _ in read_topic(kafka_config, spec_for("turns")):
            pass


async def test_sigterm_finishes_the_in_flight_batch_and_commits(kafka: KafkaConfig) -> None:
    expected = await produce_turns(kafka, 20)
    started = asyncio.Event()
    finished: list[str] = []

    async def slow(batch: list[Record[Turn]]) -> None:
        started.set()
        await asyncio.sleep(1.0)  # SIGTERM arrives while this batch is in flight
        finished.extend(r.event.turn_id for r in batch)

    consumer = EventConsumer(kafka, [TURNS], "g-sigterm", max_batch=5)
    await consumer.start()
    consumer.install_signal_handlers()
    try:
        task = asyncio.create_task(consumer.run(slow))
        await asyncio.wait_for(started.wait(), 60)
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(task, 30)
    finally:
        consumer.remove_signal_handlers()
    assert finished, "the in-flight batch completed"
    assert len(finished) < len(expected), "the consumer stopped instead of draining the topic"

    # What finished was committed: a new member of the group starts right after it.
    committed = await committed_offsets(kafka, "g-sigterm")
    assert sum(committed.values()) == len(finished)
    rest: list[str] = []

    async def collect(batch: list[Record[Turn]]) -> None:
        rest.extend(r.event.turn_id for r in batch)

    again = EventConsumer(kafka, [TURNS], "g-sigterm")
    await again.start()
    await run_until(again, collect, lambda: len(finished) + len(rest) >= len(expected))
    assert sorted(finished + rest) == sorted(expected)


async def committed_offsets(kafka: KafkaConfig, group: str) -> dict[int, int]:
    from aiokafka import TopicPartition

    consumer = kafka_consumer(kafka, client_id="turnstream-test", group_id=consumer_group(kafka, group))
    await consumer.start()
    try:
        topic = TURNS.name(kafka.namespace)
        out = {}
        for p in range(3):
            off = await consumer.committed(TopicPartition(topic, p))
            out[p] = off or 0
        return out
    finally:
        await consumer.stop()


async def test_failed_handler_is_retried_from_the_same_offsets(kafka: KafkaConfig) -> None:
    expected = await produce_turns(kafka, 10)
    calls = 0
    delivered: list[str] = []

    async def flaky(batch: list[Record[Turn]]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("downstream unavailable")
        delivered.extend(r.event.turn_id for r in batch)

    consumer = EventConsumer(kafka, [TURNS], "g-retry")
    await consumer.start()
    await run_until(consumer, flaky, lambda: len(set(delivered)) == len(expected))
    assert calls >= 2
    assert sorted(set(delivered)) == sorted(expected)


async def test_handler_can_dead_letter_a_record_it_cannot_process(kafka: KafkaConfig) -> None:
    await produce_turns(kafka, 3, sessions=3)
    handled: list[str] = []

    consumer = EventConsumer(kafka, [TURNS], "g-proc")

    async def handler(batch: list[Record[Turn]]) -> None:
        for rec in batch:
            if rec.event.session_id == "sess1":
                await consumer.dead_letter(rec, "session is quarantined")
            else:
                handled.append(rec.event.turn_id)

    await consumer.start()
    await run_until(consumer, handler, lambda: len(handled) == 2)
    letters = [r.event async for r in read_topic(kafka, DEADLETTER)]
    assert len(letters) == 1
    assert letters[0].error_kind == "processing"
    assert decode(letters[0].payload, Turn).session_id == "sess1"


def test_consumer_groups_live_in_the_namespace() -> None:
    """A replay into namespace ``r.`` runs the same services with the same group ids: they must form groups of
    their own, never join (and rebalance) the live ones."""
    assert consumer_group(KafkaConfig(namespace=""), "turnstream-pairer") == "turnstream-pairer"
    assert consumer_group(KafkaConfig(namespace="r1."), "turnstream-pairer") == "r1.turnstream-pairer"


async def test_clients_wait_for_a_broker_that_comes_up_late(kafka: KafkaConfig) -> None:
    """A service started before the broker (or while it restarts) waits for it instead of exiting: here the
    bootstrap address only starts answering (a TCP forwarder to the real broker) 1.5 s after the clients start."""
    import msgspec

    from runtime.process.ports import free_port

    port = free_port()
    late = msgspec.structs.replace(kafka, bootstrap=f"127.0.0.1:{port}")
    host, broker_port = kafka.bootstrap.rsplit(":", 1)

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(host, int(broker_port))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer), return_exceptions=True)

    async def open_late() -> asyncio.Server:
        await asyncio.sleep(1.5)
        return await asyncio.start_server(forward, "127.0.0.1", port)

    opener = asyncio.create_task(open_late())
    producer = EventProducer(late)
    consumer = EventConsumer(late, [TURNS], "late-group")
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(producer.start(wait_s=60), consumer.start()), 90)
    waited = time.monotonic() - t0
    server = await opener
    try:
        assert waited >= 1.0, "the clients connected before the broker answered"
        await producer.send(TURNS, example_turn("late", 1), "late")
        found = [r.event.turn_id async for r in read_topic(kafka, TURNS)]
        assert found == ["late:1"]
    finally:
        await consumer.stop()
        await producer.stop()
        server.close()


async def test_an_unreachable_broker_fails_the_start_once_the_wait_is_over(kafka: KafkaConfig) -> None:
    import msgspec
    from aiokafka.errors import KafkaConnectionError

    from runtime.process.ports import free_port

    nowhere = msgspec.structs.replace(kafka, bootstrap=f"127.0.0.1:{free_port()}", connect_wait_s=1.0)
    producer = EventProducer(nowhere)
    t0 = time.monotonic()
    with pytest.raises(KafkaConnectionError):
        await producer.start()
    assert 1.0 <= time.monotonic() - t0 < 15
    with pytest.raises(KafkaConnectionError):
        await EventProducer(nowhere).start(wait_s=0)


async def test_a_producer_whose_state_the_broker_lost_is_renewed(kafka: KafkaConfig) -> None:
    """After a broker restart aiokafka's idempotent producer can fail every send with OutOfOrderSequenceNumber
    (seen in the fault tests: the pairer stalled for good). The failure is injected here (a broker restart does
    not reproduce it on demand); the next send goes out through a fresh producer."""
    from aiokafka.errors import OutOfOrderSequenceNumber
    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value("turnstream_bus_producers_renewed_total") or 0.0
    async with EventProducer(kafka) as producer:
        inner = producer._producer
        real_send = inner.send

        async def failing_send(*args: Any, **kwargs: Any) -> asyncio.Future[Any]:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(fut.set_exception, OutOfOrderSequenceNumber())
            inner.send = real_send  # type: ignore[method-assign]
            return fut

        inner.send = failing_send  # type: ignore[method-assign]
        with pytest.raises(OutOfOrderSequenceNumber):
            await producer.send(TURNS, example_turn("renew", 1), "renew")
        await producer.send(TURNS, example_turn("renew", 1), "renew")
        assert producer._producer is not inner, "a fresh producer took over"
    after = REGISTRY.get_sample_value("turnstream_bus_producers_renewed_total") or 0.0
    assert after - before == 1
    assert [r.event.turn_id async for r in read_topic(kafka, TURNS)] == ["renew:1"]


async def test_failing_idle_work_does_not_end_the_consumer(kafka: KafkaConfig) -> None:
    """The pairer's idle sweep raised while Redis restarted and the pairer exited (fault tests, CI): the idle
    callback's failure is counted and logged, the next round runs it again, and records keep being handled."""
    calls = 0

    async def idle() -> None:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise ConnectionError("Redis restarting")

    handled: list[str] = []

    async def handler(batch: list[Record[Any]]) -> None:
        handled.extend(r.event.turn_id for r in batch)

    ids = await produce_turns(kafka, 4)
    consumer = EventConsumer(kafka, [TURNS], "idle-fails")
    await consumer.start()
    task = asyncio.create_task(consumer.run(handler, idle=idle))
    try:
        deadline = time.monotonic() + 60
        while not (calls > 2 and sorted(handled) == sorted(ids)):
            assert not task.done(), f"the consumer ended: {task.exception()!r}"
            assert time.monotonic() < deadline, (calls, handled)
            await asyncio.sleep(0.05)
    finally:
        consumer.request_stop()
        await asyncio.wait_for(task, 30)


async def test_a_record_that_always_fails_is_dead_lettered_and_the_rest_go_on(kafka: KafkaConfig) -> None:
    """A handler that fails on one record, every time and not for a transient reason: after ``attempts``
    failures the batch is handled one record at a time, that record alone goes to ``deadletter`` and every other
    record is handled (where the consumer used to retry the batch forever)."""
    expected = await produce_turns(kafka, 12, sessions=6)
    poison = expected[4]
    handled: list[str] = []

    async def picky(batch: list[Record[Turn]]) -> None:
        for rec in batch:
            if rec.event.turn_id == poison:
                raise ValueError("this record cannot be handled")
        handled.extend(r.event.turn_id for r in batch)

    consumer = EventConsumer(kafka, [TURNS], "g-poison", attempts=2)
    await consumer.start()
    await run_until(consumer, picky, lambda: set(handled) == set(expected) - {poison})
    letters = await read_dead_letters(kafka, 1)
    assert [decode(d.payload, Turn).turn_id for d in letters] == [poison]
    assert (
        letters[0].error_kind == "processing"
        and "ValueError: this record cannot be handled" in letters[0].error
    )


async def read_dead_letters(kafka: KafkaConfig, count: int) -> list[DeadLetter]:
    deadline = time.monotonic() + 30
    while True:
        letters = [r.event async for r in read_topic(kafka, DEADLETTER)]
        if len(letters) >= count or time.monotonic() > deadline:
            return letters
        await asyncio.sleep(0.2)


async def test_a_transient_failure_is_retried_and_never_dead_lettered(kafka: KafkaConfig) -> None:
    """Redis or a broker away is the infrastructure's failure, not the record's: retried past ``attempts``,
    nothing dead-lettered."""
    import redis.exceptions

    expected = await produce_turns(kafka, 6)
    calls = 0
    handled: list[str] = []

    async def outage(batch: list[Record[Turn]]) -> None:
        nonlocal calls
        calls += 1
        if calls <= 4:
            raise redis.exceptions.ConnectionError("Redis is away")
        handled.extend(r.event.turn_id for r in batch)

    consumer = EventConsumer(kafka, [TURNS], "g-outage", attempts=2)
    await consumer.start()
    await run_until(consumer, outage, lambda: set(handled) == set(expected))
    assert calls > 4
    assert [r async for r in read_topic(kafka, DEADLETTER)] == []


async def test_no_record_over_the_limit_is_sent_and_a_dead_letter_always_fits(kafka: KafkaConfig) -> None:
    """A record Kafka would refuse is refused before sending (aiokafka would retry it); a dead letter of a record
    near the limit keeps the record's size and digest instead of a copy that could not fit."""
    import hashlib

    from runtime.messaging.bus import RecordTooLarge, send_dead_letter
    from schemas.topics import MAX_MESSAGE_BYTES

    async with EventProducer(kafka) as producer:
        with pytest.raises(RecordTooLarge, match="exceeds the limit"):
            await producer.send_raw(TURNS.name(kafka.namespace), b"x" * MAX_MESSAGE_BYTES)
        near = b"y" * (MAX_MESSAGE_BYTES - 5000)
        small = encode(example_turn("small", 1))
        for payload in (near, small):
            await send_dead_letter(producer, "t", 0, 7, b"k", None, payload, "processing", "e" * 10_000, "g")
    letters = await read_dead_letters(kafka, 2)
    by_size = {d.payload_omitted_bytes: d for d in letters}
    assert (
        by_size[len(near)].payload == b""
        and by_size[len(near)].payload_sha256 == hashlib.sha256(near).hexdigest()
    )
    assert by_size[0].payload == small and by_size[0].payload_sha256 == ""
    assert all(len(d.error) <= 4096 for d in letters)
