"""`kill -9` of the trainer process during and between steps, then restarts: every sample is trained exactly
once in the lineage of the final weights, none skipped."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from schemas.topics import WEIGHTS
from services.bus import read_topic
from services.config import KafkaConfig
from services.launch import ServiceProcess, free_port
from services.trainer.checkpoints import TrainerStore
from tests.services.trainer.conftest import make_sample, publish, trainer_env

pytestmark = pytest.mark.integration

STEPS = 12
KILLS = 4


def version(out: Path) -> int:
    found = TrainerStore(out).latest()
    return found[0].version if found else 0


def kill_and_restart(
    env: dict[str, str],
    out: Path,
    log_path: Path,
    announced: Callable[[], int],
    feed: Callable[[int], None],
) -> int:
    """Start the trainer, let it finish a step, kill -9 it at a random moment (mid-step or between steps); four
    times; then let a last run train to the end and announce the last version (``announced()`` is the newest
    version on ``weights``): a kill right after the last checkpoint leaves that to the next start. Returns the
    kills. ``feed(steps)`` publishes the samples of the first ``steps`` steps: while kills remain, the trainer
    gets two steps beyond its checkpoint, so that on a fast machine it cannot train all twelve before the fourth
    kill (it did, in CI)."""
    rng = random.Random(5)
    kills = 0
    give_up = time.monotonic() + 400
    with open(log_path, "w") as log:
        while version(out) < STEPS or announced() < STEPS:
            assert time.monotonic() < give_up, f"stuck at version {version(out)}; see {log_path}"
            feed(min(version(out) + 2, STEPS) if kills < KILLS else STEPS)
            port = free_port()
            proc = ServiceProcess(
                ["trainer"],
                port=port,
                ready_path="/metrics",
                env={**env, "TURNSTREAM_METRICS_PORT": str(port)},
                log=log,
                startup_timeout_s=120,
            )
            start = version(out)
            deadline = time.monotonic() + 120
            if kills < KILLS and version(out) < STEPS:
                while version(out) <= start and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 0.15))
                proc.proc.kill()
                proc.proc.wait()
                kills += 1
            else:
                while (version(out) < STEPS or announced() < STEPS) and time.monotonic() < deadline:
                    time.sleep(0.2)
                proc.stop()
    return kills


async def test_kill9_during_and_between_steps_trains_each_sample_once(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    samples = [make_sample(i) for i in range(4 * STEPS)]
    published = 0

    def feed(steps: int) -> None:
        nonlocal published
        if 4 * steps > published:
            asyncio.run(publish(kafka, samples[published : 4 * steps]))
            published = 4 * steps

    out = tmp_path / "weights"
    env = trainer_env(kafka, tiny_llama, out)

    def announced() -> int:
        async def newest() -> int:
            return max([r.event.version async for r in read_topic(kafka, WEIGHTS)], default=0)

        return asyncio.run(newest())

    kills = await asyncio.to_thread(kill_and_restart, env, out, tmp_path / "trainer.log", announced, feed)
    found = TrainerStore(out).latest()
    assert found is not None and kills == KILLS
    trained = [sid for step in found[0].trained for sid in step]
    assert sorted(trained) == sorted(s.sample_id for s in samples), "each sample once, none skipped"
    assert len(found[0].trained) == STEPS and all(len(step) == 4 for step in found[0].trained)
    announced = [rec.event.version async for rec in read_topic(kafka, WEIGHTS)]
    assert sorted(announced) == list(range(1, STEPS + 1)), "each weight version announced once, none missing"
