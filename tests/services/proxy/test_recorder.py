"""The recorder on the real Kafka broker: what was recorded before a clean stop is on the topic after it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from schemas.topics import TURNS
from services.bus import read_topic
from services.config import KafkaConfig
from services.proxy.recorder import TurnRecorder
from tests.strategies import example_turn

pytestmark = pytest.mark.integration


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
