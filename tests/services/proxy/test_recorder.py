"""The recorder on the real Kafka broker: what was recorded before a clean stop is on the topic after it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.messaging.bus import read_topic
from runtime.process.ports import free_port
from schemas import Message, Turn
from schemas.topics import TURNS
from services.proxy.recorder import TurnRecorder
from services.proxy.turn_numbers import TurnNumbers
from tests.strategies import example_turn

pytestmark = pytest.mark.integration


async def published_and_numbered(recorder: TurnRecorder, within_s: float = 10.0) -> None:
    """Wait until the recorder has published everything and numbered every unnumbered turn."""
    for _ in range(int(within_s * 10)):
        if recorder.pending == 0 and not recorder.deferring:
            return
        await asyncio.sleep(0.1)
    assert recorder.pending == 0 and not recorder.deferring


def answered(session: str, text: str) -> Turn:
    """A turn with a placeholder number (1) and a response that tells it apart."""
    return example_turn(session, 1, response=Message(role="assistant", content=text))


async def test_turns_recorded_just_before_stop_are_published(kafka: KafkaConfig, tmp_path: Path) -> None:
    """Stop while the writer still lets the last turns gather (its linger): the publisher must wait for them to
    be spooled and send them, not leave them in the spool because it found nothing pending a moment earlier."""
    recorder = TurnRecorder(kafka, tmp_path / "spool", linger_s=0.5)
    await recorder.start()
    recorder.record(example_turn("early", 1))
    for _ in range(50):  # the first turn is out: the publisher now idles with nothing pending
        if recorder.pending == 0:
            break
        await asyncio.sleep(0.1)
    assert recorder.pending == 0
    recorder.record(example_turn("late", 1))
    recorder.record(example_turn("late", 2))
    await recorder.stop()
    published = sorted([rec.event.turn_id async for rec in read_topic(kafka, TURNS)])
    assert published == ["early:1", "late:1", "late:2"]


async def test_unnumbered_turns_are_numbered_in_spool_order_when_published(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Turns served while Redis was unreachable carry a placeholder number; the publisher numbers them in spool
    order (after the session's earlier, numbered turns), and while any waits the recorder says ``deferring``."""
    numbers = TurnNumbers(redis_config.url, redis_config.key_prefix)
    assert await numbers.next("s") == 1
    recorder = TurnRecorder(kafka, tmp_path / "spool", linger_s=0.05, number_once=numbers.number_once)
    await recorder.start()
    try:
        recorder.record(example_turn("s", 1))
        assert not recorder.deferring
        recorder.record(answered("s", "served without Redis"), unnumbered=True)
        assert recorder.deferring
        recorder.record(answered("s", "queued behind it"), unnumbered=True)
        await published_and_numbered(recorder)
    finally:
        await recorder.stop()
        await numbers.aclose()
    published = [rec.event async for rec in read_topic(kafka, TURNS)]
    assert [(t.turn_id, t.turn_index) for t in published] == [("s:1", 1), ("s:2", 2), ("s:3", 3)]
    assert [t.response.text for t in published][1:] == ["served without Redis", "queued behind it"]


async def test_unnumbered_turns_wait_for_redis_and_an_earlier_runs_backlog_defers_new_turns(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    """Redis unreachable: the unnumbered turn stays in the spool (nothing published out of order, nothing lost);
    a restarted proxy finds it, defers new turns behind it, and numbers both once Redis answers."""
    nowhere = TurnNumbers(
        f"redis://127.0.0.1:{free_port()}/0", redis_config.key_prefix, connect_timeout_s=0.5
    )
    recorder = TurnRecorder(kafka, tmp_path / "spool", linger_s=0.05, number_once=nowhere.number_once)
    await recorder.start()
    recorder.record(answered("r", "first"), unnumbered=True)
    await asyncio.sleep(1.5)
    assert recorder.pending == 1 and recorder.deferring
    await recorder.stop(drain_timeout_s=1.0)
    numbers = TurnNumbers(redis_config.url, redis_config.key_prefix)
    again = TurnRecorder(kafka, tmp_path / "spool", linger_s=0.05, number_once=numbers.number_once)
    await again.start()
    try:
        assert again.deferring, (
            "a backlog from an earlier run may hold unnumbered turns: new ones queue behind"
        )
        again.record(answered("r", "second"), unnumbered=True)
        await published_and_numbered(again)
    finally:
        await again.stop()
        await numbers.aclose()
    published = [rec.event async for rec in read_topic(kafka, TURNS)]
    assert [(t.turn_id, t.response.text) for t in published] == [("r:1", "first"), ("r:2", "second")]


async def test_a_session_end_survives_a_restart_in_the_spool_and_goes_to_its_own_topic(
    kafka: KafkaConfig, tmp_path: Path
) -> None:
    """A session end is spooled like a turn (a restart with Kafka away keeps it) and published to
    ``sessions.ended``, the turns to ``turns``."""
    from schemas import SessionEnded
    from schemas.topics import SESSIONS_ENDED

    away = msgspec.structs.replace(kafka, bootstrap=f"127.0.0.1:{free_port()}")
    first = TurnRecorder(away, tmp_path / "spool", linger_s=0.0)
    await first.start()
    first.record(example_turn("ends", 1))
    first.record_session_end(SessionEnded(session_id="ends", after_turn_index=1, ended_at=1.0))
    await first.stop(drain_timeout_s=0.5)
    again = TurnRecorder(kafka, tmp_path / "spool")
    await again.start()
    await published_and_numbered(again)
    await again.stop()
    assert [rec.event.turn_id async for rec in read_topic(kafka, TURNS)] == ["ends:1"]
    ends = [rec.event async for rec in read_topic(kafka, SESSIONS_ENDED)]
    assert ends == [SessionEnded(session_id="ends", after_turn_index=1, ended_at=1.0)]


async def test_a_full_spool_serving_unrecorded_counts_each_turn(kafka: KafkaConfig, tmp_path: Path) -> None:
    """``proxy.spool_full = "serve"``: past the cap a turn is served and not recorded; ``record`` says so
    (``UnrecordableTurn("spool_full")``, which the proxy counts), and recording resumes once Kafka took the rest."""
    from services.proxy.turns import UnrecordableTurn

    dead = msgspec.structs.replace(kafka, bootstrap=f"127.0.0.1:{free_port()}")
    recorder = TurnRecorder(dead, tmp_path / "spool", linger_s=0.01, max_bytes=3000, when_full="serve")
    await recorder.start()
    try:
        kept = 0
        with pytest.raises(UnrecordableTurn) as refused:
            for i in range(100):
                recorder.record(answered(f"s{i}", "x" * 500))
                kept += 1
        assert refused.value.reason == "spool_full" and 1 <= kept < 100
        assert recorder.full
    finally:
        await recorder.stop(drain_timeout_s=0.5)


async def test_a_stop_waits_for_turns_only_in_memory_and_counts_any_it_must_give_up(
    kafka: KafkaConfig, tmp_path: Path
) -> None:
    """Issue 32, item 6: turns that could not be written (a full disk) lived only in memory and a stop dropped
    them silently. While the spool cannot be written the recorder is ``full``; a stop keeps trying for
    ``stop_write_timeout_s`` (the turns are written if the disk recovers meanwhile), and any it gives up are
    logged and counted."""
    from services.proxy.turns import DROPPED

    recorder = TurnRecorder(kafka, tmp_path / "spool", linger_s=0.01, stop_write_timeout_s=5.0)
    await recorder.start()
    assert recorder.spool is not None
    write = recorder.spool.write
    disk_full = True

    def failing(payloads: list[bytes]) -> None:
        if disk_full:
            raise OSError(28, "No space left on device")
        write(payloads)

    recorder.spool.write = failing  # type: ignore[method-assign]
    recorder.record(answered("mem", "one"))
    recorder.record(example_turn("mem", 2))
    assert recorder.full and recorder.pending == 2

    async def disk_frees_up() -> None:
        nonlocal disk_full
        await asyncio.sleep(1.5)
        disk_full = False

    freed = asyncio.create_task(disk_frees_up())
    await recorder.stop(drain_timeout_s=0.5)  # shorter than the disk's recovery: the stop waits for it
    await freed
    published = sorted([rec.event.turn_id async for rec in read_topic(kafka, TURNS)])
    assert published == ["mem:1", "mem:2"]

    lost_before = DROPPED.labels("unwritten_at_stop")._value.get()
    again = TurnRecorder(kafka, tmp_path / "spool2", linger_s=0.01, stop_write_timeout_s=1.0)
    await again.start()
    assert again.spool is not None

    def never(payloads: list[bytes]) -> None:
        raise OSError(28, "No space left on device")

    again.spool.write = never  # type: ignore[method-assign]
    again.record(answered("lost", "gone"))
    await again.stop(drain_timeout_s=0.2)
    assert DROPPED.labels("unwritten_at_stop")._value.get() == lost_before + 1
