"""Under a gate, after ``gate.restore_after`` failed candidates the trainer goes back to the promoted version's
weights and optimizer state and trains on from there (docs/evaluation.md), against the real broker and real
Megatron-core steps: the state it trains on is exactly the promoted version's, the samples of the discarded steps
are not trained again, and ``versions`` records why. A trainer that the gate leaves too far ahead of what users
are served (every new sample stale) restores before ``gate.restore_after``, and counts staleness along its
lineage, not by version number."""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import torch

from runtime.configuration.config import Config, GateConfig, KafkaConfig, TrainerConfig
from runtime.messaging.bus import EventProducer, read_topic
from runtime.messaging.topics import create_topics
from runtime.pipeline.promotion import fold
from schemas import Sample, VersionDecision
from schemas.topics import SAMPLES, VERSIONS, WEIGHTS
from services.trainer.checkpoints import TrainerStore
from services.trainer.model import read_hf_weights
from services.trainer.worker import run_trainer
from tests.services.trainer.conftest import make_sample

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
pytestmark = pytest.mark.integration


def config(
    kafka: KafkaConfig, model: Path, out: Path, gate: bool, restore_after: int = 2, **trainer: object
) -> Config:
    tc = msgspec.convert(
        {
            "hf_checkpoint": str(model),
            "output_dir": str(out),
            "rollout_batch_size": 4,
            "lr": 1e-3,
            "max_staleness": 100,
            **trainer,
        },
        TrainerConfig,
    )
    return Config(
        kafka=kafka,
        trainer=tc,
        gate=GateConfig(enabled=gate, mechanism="serve-then-check", restore_after=restore_after, poll_s=0.2),
    )


async def publish(kafka: KafkaConfig, samples: list[Sample]) -> None:
    """One key, so one partition: batches come in the order published, in this run and in the reference one."""
    async with EventProducer(kafka) as producer:
        for s in samples:
            await producer.send(SAMPLES, s, "one")


async def decide(kafka: KafkaConfig, *decisions: tuple[int, str]) -> None:
    async with EventProducer(kafka) as producer:
        for version, state in decisions:
            await producer.send(
                VERSIONS,
                VersionDecision(
                    version=version, state=state, reason="test", by="gate", decided_at=time.time()
                ),
                "policy",
            )


async def test_after_failed_candidates_the_trainer_trains_on_from_the_promoted_versions_state(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    samples = [make_sample(i) for i in range(16)]
    out = tmp_path / "weights"
    await publish(kafka, samples[:12])
    await asyncio.wait_for(
        run_trainer(
            config(kafka, tiny_llama, out, True, max_steps=3, checkpoint_every_steps=2), install_signals=False
        ),
        180,
    )
    store = TrainerStore(out)
    assert 0 in store.checkpoint_versions(), "under a gate the starting state is checkpointed"

    # v1 promoted, v2 and v3 rejected: two failures, the restore threshold.
    await decide(kafka, (1, "promoted"), (2, "rejected"), (3, "rejected"))
    await publish(kafka, samples[12:])
    await asyncio.wait_for(
        run_trainer(config(kafka, tiny_llama, out, True, max_steps=1), install_signals=False), 180
    )

    versions = [r.event.version async for r in read_topic(kafka, WEIGHTS)]
    assert versions == [1, 2, 3, 4], "version numbers go on after the discarded ones"
    decisions = [r.event async for r in read_topic(kafka, VERSIONS)]
    restored = [d for d in decisions if d.state == "restored"]
    assert len(restored) == 1 and restored[0].version == 1 and restored[0].by == "trainer"
    assert "(8 samples)" in restored[0].reason, restored[0].reason
    assert fold(decisions).failed_streak == 0
    step = msgspec.json.decode((out / "checkpoints" / "steps" / "v4.json").read_bytes())
    assert step["parent"] == 1
    ids = [s.sample_id for s in samples]
    assert store.lineage() == [ids[:4], ids[12:]], "v2's and v3's samples are not in v4's lineage"

    # The reference: a fresh trainer fed only v1's samples and the new ones reaches the same weights, so the
    # restored state was v1's weights and optimizer state exactly.
    ref_kafka = msgspec.structs.replace(kafka, namespace=kafka.namespace.rstrip(".") + "-ref.")
    await create_topics(ref_kafka, partitions=3)
    await publish(ref_kafka, samples[:4] + samples[12:])
    ref = tmp_path / "ref"
    await asyncio.wait_for(
        run_trainer(config(ref_kafka, tiny_llama, ref, False, max_steps=2), install_signals=False), 180
    )
    restored_weights, reference = (
        read_hf_weights(out / "versions" / "v4"),
        read_hf_weights(ref / "versions" / "v2"),
    )
    assert restored_weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(restored_weights[name], tensor), name
    v3 = read_hf_weights(out / "versions" / "v3")
    assert any(not torch.equal(v3[k], t) for k, t in reference.items())

    # Started again, it rebuilds v4's state (through v1's path, not the discarded steps) and restores no more.
    await decide(kafka, (4, "promoted"))
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_trainer(config(kafka, tiny_llama, out, True), install_signals=False, stop=stop)
    )
    await asyncio.sleep(10)
    stop.set()
    await asyncio.wait_for(task, 60)
    assert [d.state async for d in read_events(kafka)].count("restored") == 1
    assert TrainerStore(out).plan().target == 4


async def read_events(kafka: KafkaConfig) -> AsyncIterator[VersionDecision]:
    async for r in read_topic(kafka, VERSIONS):
        yield r.event


async def test_a_trainer_the_gate_leaves_without_fresh_samples_restores_and_counts_staleness_by_lineage(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    """Users stay on v0 while the gate turns v1 and v2 down, one short of ``restore_after`` 3. With
    ``max_staleness`` 1 every new sample (from v0) is two steps behind the trainer's v2: no step would come again,
    so no candidate and no third failure. The trainer restores v0 and trains v3 from it; v0's samples are then one
    step from v3's weights (not three by number), after a restart from v3's checkpoint too."""
    samples = [make_sample(i) for i in range(16)]  # all answered by v0, the promoted version
    out = tmp_path / "weights"

    def starving(**trainer: object) -> Config:
        return config(kafka, tiny_llama, out, True, restore_after=3, max_staleness=1, **trainer)

    await publish(kafka, samples[:8])
    await asyncio.wait_for(run_trainer(starving(max_steps=2), install_signals=False), 180)
    await decide(kafka, (1, "rejected"), (2, "rejected"))
    await publish(kafka, samples[8:12])
    await asyncio.wait_for(
        run_trainer(starving(max_steps=1, checkpoint_every_steps=1), install_signals=False), 180
    )
    restored = [d async for d in read_events(kafka) if d.state == "restored"]
    assert len(restored) == 1 and restored[0].version == 0, restored
    assert "2 steps past v0" in restored[0].reason, restored[0].reason
    assert 3 in TrainerStore(out).checkpoint_versions()

    await publish(kafka, samples[12:])
    await asyncio.wait_for(run_trainer(starving(max_steps=1), install_signals=False), 180)
    assert [r.event.version async for r in read_topic(kafka, WEIGHTS)] == [1, 2, 3, 4]
    ids = [s.sample_id for s in samples]
    assert TrainerStore(out).lineage() == [ids[8:12], ids[12:]]
    assert [d.state async for d in read_events(kafka)].count("restored") == 1
