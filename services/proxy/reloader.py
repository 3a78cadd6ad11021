"""The weight reloader: follows ``weights`` and asks the engine to load each newer version.

Runs in the proxy process with a consumer group of its own (every proxy replica sees every version). Only paths
below the configured weights root are loaded; anything else is dead-lettered. The engine keeps serving while it
loads, so users are never refused."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from schemas import WeightsPublished
from schemas.topics import WEIGHTS
from services.bus import EventConsumer, Record
from services.config import KafkaConfig
from services.engine_client import EngineClient, EngineError

log = logging.getLogger("turnstream.proxy.reloader")

RELOADS = Counter(
    "turnstream_proxy_weight_reloads_total", "Weight versions the engine was asked to load", ["status"]
)
VERSION = Gauge("turnstream_proxy_weight_version", "Weight version the engine serves")


def inside(root: Path, path: str) -> bool:
    try:
        Path(os.path.realpath(path)).relative_to(os.path.realpath(root))
        return True
    except ValueError:
        return False


class Reloader:
    def __init__(self, kafka: KafkaConfig, engine: EngineClient, weights_root: Path, state: Any) -> None:
        self.engine = engine
        self.root = weights_root
        self.state = state
        self.consumer = self._follower(kafka)

    @staticmethod
    def _follower(kafka: KafkaConfig) -> EventConsumer:
        # No consumer group: every replica reads every version from the compacted topic's start, and no restart
        # leaves an abandoned group behind on the broker. Versions are minutes apart, so empty fetches wait 5 s
        # (a new version still arrives at once): as a group member with half-second fetches the reloader cost an
        # idle proxy ~20 ms of CPU per second, now ~0.
        return EventConsumer(
            kafka,
            [WEIGHTS],
            f"turnstream-reloader-{uuid.uuid4().hex[:12]}",
            group=False,
            fetch_max_wait_ms=5000,
            poll_timeout_ms=5000,
            background_poll_ms=5000,
        )

    async def handle(self, batch: list[Record[WeightsPublished]]) -> None:
        newest: Record[WeightsPublished] | None = None
        for rec in batch:
            event = rec.event
            if not inside(self.root, event.path):
                RELOADS.labels("refused").inc()
                await self.consumer.dead_letter(rec, f"weights path {event.path} is outside {self.root}")
                continue
            if newest is None or event.version > newest.event.version:
                newest = rec
        if newest is None or newest.event.version <= self.state.weight_version:
            return
        event = newest.event
        try:
            await self.engine.update_weights_from_disk(event.path, str(event.version))
        except EngineError as exc:
            RELOADS.labels("failed").inc()
            log.error("engine refused a weight version", extra={"version": event.version, "error": str(exc)})
            await self.consumer.dead_letter(newest, f"engine could not load version {event.version}: {exc}")
            return
        self.state.weight_version = event.version
        VERSION.set(event.version)
        RELOADS.labels("ok").inc()
        log.info("engine serves a new weight version", extra={"version": event.version, "path": event.path})

    async def run(self) -> None:
        backoff = 0.5
        while True:  # Kafka may not be up yet: serving goes on, the reloader keeps trying
            try:
                await self.consumer.start()
                break
            except Exception as exc:
                log.warning("reloader cannot reach Kafka yet", extra={"error": repr(exc)})
                await self.consumer.stop()
                self.consumer = self._follower(self.consumer.kafka)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
        try:
            await self.consumer.run(self.handle)
        finally:  # also when cancelled at shutdown: nothing to commit without a group, but close the connections
            await self.consumer.stop()
