"""`kill -9` of the dispatcher process mid-stream, then a restart: every qualifying turn has exactly one sample."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from schemas import Event
from services.dispatcher.rules import decide
from tests.services.dispatcher.conftest import (
    inputs_for,
    publish,
    shuffled_with_duplicates,
    turn,
    wait_for_samples,
)

pytestmark = pytest.mark.integration


class DispatcherProcess(ServiceProcess):
    def __init__(self, env: dict[str, str], logdir: Path) -> None:
        port = free_port()
        self.logfile = open(logdir / f"dispatcher-{port}.log", "w")
        super().__init__(
            ["dispatcher", "--mode", "combine"],
            port=port,
            ready_path="/metrics",
            env={**env, "TURNSTREAM_METRICS_PORT": str(port)},
            log=self.logfile,
            startup_timeout_s=60,
        )

    def emitted(self) -> float:
        text = httpx.get(self.url + "/metrics", timeout=2).text
        return sum(
            float(v) for v in re.findall(r"^turnstream_dispatcher_samples_total\{[^}]*\} (\S+)$", text, re.M)
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            super().stop()
        self.logfile.close()


async def test_kill9_mid_stream_and_restart_loses_and_duplicates_nothing(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    cases = [((-1, 0, 1)[i % 3], i % 2 == 0) for i in range(400)]
    turns = [turn(i) for i in range(len(cases))]
    events: list[Event] = []
    for t, (score, accepted) in zip(turns, cases, strict=True):
        events += inputs_for(t, score, accepted)
    want = Counter(t.turn_id for t, (s, a) in zip(turns, cases, strict=True) if decide("combine", s, a))
    env = {
        **kafka.client_env(),
        "TURNSTREAM_KAFKA_SESSION_TIMEOUT_MS": "6000",
        "TURNSTREAM_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
        "TURNSTREAM_KAFKA_MAX_BATCH": "32",
        "TURNSTREAM_REDIS_URL": redis_config.url,
        "TURNSTREAM_REDIS_KEY_PREFIX": redis_config.key_prefix,
        "TURNSTREAM_DISPATCHER_CLAIM_LEASE_S": "3",
    }
    await publish(kafka, shuffled_with_duplicates(events))
    first = DispatcherProcess(env, tmp_path)
    procs = [first]
    try:
        deadline = time.monotonic() + 60
        while first.emitted() < 20:
            assert time.monotonic() < deadline, "the dispatcher never emitted"
            await asyncio.sleep(0.05)
        first.proc.kill()
        first.proc.wait()
        partial = await wait_for_samples(kafka, lambda s: True)
        assert len(partial) < len(want), "killed after the stream was over: not mid-stream"
        procs.append(DispatcherProcess(env, tmp_path))
        await wait_for_samples(kafka, lambda s: len(s) >= len(want), timeout=120)
        await asyncio.sleep(3)  # anything duplicated would land now
        samples = await wait_for_samples(kafka, lambda s: True)
    finally:
        for p in procs:
            p.stop()
    got = Counter(s.sample_id for s in samples)
    assert got == want, (
        f"missing {sorted(set(want) - set(got))[:5]}, duplicated {[k for k, n in got.items() if n > 1][:5]}"
    )
