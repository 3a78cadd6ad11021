"""Waiting on a topic's contents in integration tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import read_topic
from schemas import TopicSpec


async def wait_for_events(
    kafka: KafkaConfig, spec: TopicSpec, done: Callable[[list[Any]], bool], timeout: float = 60.0
) -> list[Any]:
    """Every event on ``spec`` once ``done(events)`` holds, or whatever is there when ``timeout`` runs out."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r.event async for r in read_topic(kafka, spec)]
        if done(found) or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.3)
