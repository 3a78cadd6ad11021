"""`kill -9` of the trainer process during and between steps, then restarts: every sample is trained exactly
once in the lineage of the final weights, none skipped."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import read_topic
from runtime.process.launch import ServiceProcess
from runtime.process.ports import free_port
from schemas.topics import WEIGHTS
from services.trainer.checkpoints import TrainerStore
from services.trainer.model import megatron_to_hf, read_hf_weights
from services.trainer.spec import ModelSpec
from tests.services.trainer.conftest import make_sample, publish, trainer_env

pytestmark = pytest.mark.integration

STEPS = 12
KILLS = 4


def version(out: Path) -> int:
    """The newest recorded step (its version is on disk), checkpointed in full or not."""
    return TrainerStore(out).newest_version()


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
    # Full checkpoints every third step, written in the background: most kills land between them or during a
    # write, and the restart replays the rest.
    env = {**trainer_env(kafka, tiny_llama, out), "TURNSTREAM_TRAINER_CHECKPOINT_EVERY_STEPS": "3"}

    def announced() -> int:
        async def newest() -> int:
            return max([r.event.version async for r in read_topic(kafka, WEIGHTS)], default=0)

        return asyncio.run(newest())

    kills = await asyncio.to_thread(kill_and_restart, env, out, tmp_path / "trainer.log", announced, feed)
    found = TrainerStore(out).latest()
    assert found is not None and kills == KILLS
    lineage = TrainerStore(out).lineage()
    trained = [sid for step in lineage for sid in step]
    assert sorted(trained) == sorted(s.sample_id for s in samples), "each sample once, none skipped"
    assert len(lineage) == STEPS and all(len(step) == 4 for step in lineage)
    announced = [rec.event.version async for rec in read_topic(kafka, WEIGHTS)]
    assert sorted(announced) == list(range(1, STEPS + 1)), "each weight version announced once, none missing"


def _run_trainer(env: dict[str, str], log: Path) -> None:
    with open(log, "a") as fh:
        proc = subprocess.run(
            [sys.executable, "-m", "services.cli", "trainer"],
            env={**os.environ, "TURNSTREAM_METRICS_PORT": str(free_port()), **env},
            stdout=fh,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
async def test_a_restart_replays_the_steps_since_the_last_full_checkpoint_exactly(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path, lora: bool
) -> None:
    """Full checkpoints every 3 steps; kill -9 after step 5. The restart loads v3 and replays steps 4 and 5 from
    the samples topic (writing and announcing nothing): the state it reaches is the published v5, bit for bit (a
    clean stop then checkpoints it); a last start trains step 6. Each sample once, each version announced once.
    With LoRA the checkpoint holds the adapters and the version is the PEFT adapter: the same, bit for bit."""
    samples = [make_sample(i) for i in range(24)]
    await publish(kafka, samples[:20])
    env = {
        **trainer_env(kafka, tiny_llama, tmp_path / "weights"),
        "TURNSTREAM_TRAINER_CHECKPOINT_EVERY_STEPS": "3",
        # in the foreground here, so that the kill after step 5 finds v3 committed (the test above kills
        # background writes too)
        "TURNSTREAM_TRAINER_CHECKPOINT_ASYNC": "false",
        "TURNSTREAM_TRAINER_LORA_ENABLED": str(lora).lower(),
    }
    out = tmp_path / "weights"
    log_path = tmp_path / "trainer.log"

    def start() -> ServiceProcess:
        port = free_port()
        with open(log_path, "a") as log:
            return ServiceProcess(
                ["trainer"],
                port=port,
                ready_path="/metrics",
                env={**env, "TURNSTREAM_METRICS_PORT": str(port)},
                log=log,
            )

    def wait_for(done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 180
        while not done():
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)

    def killed_after_step_5() -> None:
        proc = start()
        wait_for(lambda: version(out) >= 5)
        proc.proc.kill()
        proc.proc.wait()

    await asyncio.to_thread(killed_after_step_5)
    store = TrainerStore(out)
    found = store.latest()
    assert found is not None and found[0].version == 3 and store.newest_version() == 5
    v5 = out / "versions" / "v5" / ("adapter_model.safetensors" if lora else "model.safetensors")
    written = v5.stat().st_mtime_ns

    def replayed_then_stopped() -> None:
        proc = start()
        wait_for(lambda: log_path.read_text().count("replayed step") >= 2)
        assert proc.stop() == 0

    await asyncio.to_thread(replayed_then_stopped)
    assert v5.stat().st_mtime_ns == written, "a replay writes no version"
    found = store.latest()
    assert found is not None and found[0].version == 5, "the clean stop checkpointed the replayed state"
    state = store.load_state(found[1], 0)["model"]
    spec = ModelSpec.from_dir(tiny_llama)
    published = read_hf_weights(out / "versions" / "v5")
    if lora:
        from runtime.configuration.config import LoraConfig
        from services.trainer.lora_export import adapter_tensors

        names = adapter_tensors(spec, LoraConfig(enabled=True))
        assert set(state) == {megatron for megatron, _, _ in names}, "the checkpoint holds the adapters alone"
        replayed = {peft: state[megatron] for megatron, peft, _ in names}
        assert any(k.endswith("lora_B.weight") and t.abs().max() > 0 for k, t in published.items())
    else:
        replayed = megatron_to_hf(spec, {k: v for k, v in state.items() if not k.endswith("_extra_state")})
        assert any(not torch.equal(published[k], t) for k, t in read_hf_weights(tiny_llama).items())
    assert replayed.keys() == published.keys()
    for name, w in published.items():
        assert torch.equal(replayed[name], w), name

    await publish(kafka, samples[20:])
    await asyncio.to_thread(_run_trainer, {**env, "TURNSTREAM_TRAINER_MAX_STEPS": "1"}, log_path)
    lineage = store.lineage()
    assert len(lineage) == 6
    assert sorted(sid for step in lineage for sid in step) == sorted(s.sample_id for s in samples)
    announced = [rec.event.version async for rec in read_topic(kafka, WEIGHTS)]
    assert sorted(announced) == [1, 2, 3, 4, 5, 6]
