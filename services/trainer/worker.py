"""``turnstream trainer``: consumes ``samples``, trains the policy, publishes weight versions.

Per step: ``rollout_batch_size`` samples (older than ``max_staleness`` versions are dropped and counted) -> one
optimizer step -> the weights as Hugging Face safetensors in ``versions/v<N>`` (atomic) -> a checkpoint holding
model, optimizer, the ``samples`` offsets consumed and the lineage of trained sample ids -> ``WeightsPublished``
-> the offsets committed to Kafka. A restart resumes from the checkpoint, seeking ``samples`` to its offsets, so
a sample is trained exactly once in the lineage of the published weights, whenever the trainer is killed.

Under torchrun (GPUs; gloo on the CPU in tests) only rank 0 consumes, publishes and commits; it broadcasts each
batch, and every rank trains its share, joins the weight gather and writes its own checkpoint state (``follow``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge, Histogram

from schemas import Sample, WeightsPublished
from schemas.topics import SAMPLES, WEIGHTS
from services.bus import (
    EventProducer,
    consumer_group,
    decode_or_dead_letter,
    kafka_consumer,
    read_topic,
    topic_partitions,
)
from services.config import Config, KafkaConfig
from services.metrics import serve_metrics
from services.trainer.checkpoints import CheckpointMeta, TrainerStore
from services.trainer.collective import barrier, broadcast
from services.trainer.parallel import ParallelLayout
from services.trainer.step import StepStats

log = logging.getLogger("turnstream.trainer")

STEPS = Counter("turnstream_trainer_steps_total", "Optimizer steps taken")
SAMPLES_IN = Counter("turnstream_trainer_samples_total", "Samples trained on", ["kind"])
DROPPED = Counter("turnstream_trainer_dropped_total", "Samples not trained on", ["reason"])
STALENESS = Histogram(
    "turnstream_trainer_staleness_versions",
    "Policy versions between a sample's and the trainer's",
    buckets=range(9),
)
LAST = Gauge("turnstream_trainer_last", "Figures of the last step", ["name"])
REWARD = Gauge("turnstream_trainer_reward_mean", "Mean reward of the last step's samples, by kind", ["kind"])
PENDING = Gauge("turnstream_trainer_pending_samples", "Samples held toward the next batch")
VERSION = Gauge("turnstream_trainer_version", "Newest published weight version")
STEP_SECONDS = Histogram("turnstream_trainer_step_seconds", "One optimizer step (forward, backward, update)")


if TYPE_CHECKING:
    from torch import Tensor


class TrainablePolicy(Protocol):
    """What the training loop needs of a policy (``services.trainer.policy.Policy``, imported only when training
    starts: it brings Megatron-core)."""

    layout: ParallelLayout

    def train(self, samples: list[Sample]) -> StepStats: ...

    def export(self) -> dict[str, Tensor]: ...

    def state(self) -> tuple[dict[str, Any], Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


class _Pending:
    """Consumed samples not trained yet, and the offsets that are safe to checkpoint around them."""

    def __init__(self, start: dict[int, int]) -> None:
        self.samples: list[tuple[int, int, Sample]] = []
        self.next_offset = dict(start)

    def processed(self, partition: int, offset: int) -> None:
        self.next_offset[partition] = offset + 1

    def add(self, partition: int, offset: int, sample: Sample) -> None:
        self.samples.append((partition, offset, sample))
        self.processed(partition, offset)

    def take(self, n: int) -> list[Sample]:
        taken, self.samples = self.samples[:n], self.samples[n:]
        return [s for _, _, s in taken]

    def safe_offsets(self) -> dict[int, int]:
        """Per partition: where a restart must resume so that pending samples are read again."""
        safe = dict(self.next_offset)
        for partition, offset, _ in self.samples:
            safe[partition] = min(safe.get(partition, offset), offset)
        return safe


class TrainerLoop:
    """Rank 0's side of training: decides every step and tells the other ranks (``follow``) what to do."""

    def __init__(self, config: Config, policy: TrainablePolicy, store: TrainerStore, base: str) -> None:
        self.config = config
        self.tc = config.trainer
        self.policy = policy
        self.layout: ParallelLayout = policy.layout
        self.store = store
        self.base = base
        self.version = 0
        self.step = 0
        self.trained: list[list[str]] = []
        self.samples_trained = 0
        self.offsets: dict[int, int] = {}

    def resume(self) -> bool:
        found = self.store.latest()
        broadcast(("resume", str(found[1]) if found else None), self.layout)
        if found is None:
            return False
        meta, folder = found
        self.policy.load_state(self.store.load_state(folder, self.layout.rank))
        self.version, self.step = meta.version, meta.step
        self.trained, self.samples_trained = meta.trained, meta.samples_trained
        self.offsets = {int(p): o for p, o in meta.offsets.items()}
        log.info("resumed from checkpoint", extra={"version": self.version, "offsets": self.offsets})
        return True

    def fresh(self, s: Sample) -> bool:
        lag = self.version - s.weight_version
        STALENESS.observe(max(lag, 0))
        if lag > self.tc.max_staleness:
            DROPPED.labels("stale").inc()
            return False
        return True

    def train(self, samples: list[Sample]) -> StepStats:
        broadcast(("step", samples, self.version + 1), self.layout)
        started = time.perf_counter()
        stats: StepStats = self.policy.train(samples)
        STEP_SECONDS.observe(time.perf_counter() - started)
        return stats

    def persist(self, samples: list[Sample], offsets: dict[int, int]) -> WeightsPublished:
        """After a step: the new version on disk, then the checkpoint that makes it the resume point."""
        tensors = self.policy.export()
        self.version += 1
        self.step += 1
        self.trained.append([s.sample_id for s in samples])
        self.samples_trained += len(samples)
        path, digest = self.store.write_version(self.version, tensors, self.base)
        meta = CheckpointMeta(
            version=self.version,
            step=self.step,
            offsets={str(p): o for p, o in offsets.items()},
            trained=self.trained,
            samples_trained=self.samples_trained,
            base_model=self.base,
        )
        tmp = self.store.stage(self.version)
        barrier(self.layout)  # the staging folder exists
        self.store.write_state(tmp, self.layout.rank, *self.policy.state())
        barrier(self.layout)  # every rank's state is on disk
        self.store.commit(meta, tmp)
        self.store.prune_versions(self.tc.keep_versions, protect=self.version)
        self.offsets = dict(offsets)
        return self.announcement(str(path), digest)

    def stop(self) -> None:
        broadcast(("stop",), self.layout)

    def announcement(self, path: str, digest: str | None = None) -> WeightsPublished:
        return WeightsPublished(
            version=self.version,
            path=path,
            base_model=self.base,
            step=self.step,
            created_at=time.time(),
            samples_trained=self.samples_trained,
            sha256=digest,
        )


def follow(policy: TrainablePolicy, store: TrainerStore) -> None:
    """A rank other than 0: resume, train, gather and checkpoint exactly when rank 0 does, until it stops."""
    layout: ParallelLayout = policy.layout
    while True:
        command = broadcast(None, layout)
        if command[0] == "stop":
            return
        if command[0] == "resume":
            if command[1] is not None:
                policy.load_state(store.load_state(Path(command[1]), layout.rank))
        elif command[0] == "step":
            _, samples, version = command
            policy.train(samples)
            policy.export()
            barrier(layout)
            store.write_state(store.staged(version), layout.rank, *policy.state())
            barrier(layout)


async def run_trainer(
    config: Config, *, install_signals: bool = True, stop: asyncio.Event | None = None
) -> None:
    """Run until SIGTERM/SIGINT, ``stop``, or ``trainer.max_steps`` steps; a step in progress completes."""
    import signal

    from services.model_store import cache_dir
    from services.trainer.model import shutdown_parallel
    from services.trainer.policy import Policy

    tc = config.trainer
    if not tc.hf_checkpoint:
        raise SystemExit("turnstream trainer: set trainer.hf_checkpoint (the policy's Hugging Face folder)")
    layout = ParallelLayout.from_env(tc.tensor_parallel, tc.pipeline_parallel)
    root = Path(tc.output_dir) if tc.output_dir else cache_dir() / "weights"
    store = TrainerStore(root)
    if layout.rank == 0:
        serve_metrics(config.metrics.port, config.metrics.host)
    policy = await asyncio.to_thread(Policy.from_hf, tc.hf_checkpoint, tc, layout)
    if layout.rank != 0:  # only rank 0 talks to Kafka; the others follow its commands
        await asyncio.to_thread(follow, policy, store)
        await asyncio.to_thread(shutdown_parallel, layout)
        return
    stop = stop or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    trainer = TrainerLoop(config, policy, store, tc.hf_checkpoint)
    resumed = await asyncio.to_thread(trainer.resume)

    kafka = config.kafka
    topic = SAMPLES.name(kafka.namespace)
    consumer = kafka_consumer(
        kafka, client_id=f"{kafka.client_id}-trainer", group_id=consumer_group(kafka, tc.group_id)
    )
    producer = EventProducer(kafka, client_id=f"{kafka.client_id}-trainer")
    await producer.start()
    await consumer.start()
    try:
        tps = await topic_partitions(consumer, topic)
        consumer.assign(tps)
        start: dict[int, int] = {}
        for tp in tps:
            if tp.partition in trainer.offsets:
                start[tp.partition] = trainer.offsets[tp.partition]
            else:
                committed = await consumer.committed(tp)
                start[tp.partition] = (
                    committed if committed is not None else (await consumer.beginning_offsets([tp]))[tp]
                )
            consumer.seek(tp, start[tp.partition])
        pending = _Pending(start)
        # A kill between the checkpoint and the announcement leaves the newest version unannounced: announce it
        # now, unless it went out (each version is announced once).
        if resumed and await _announced_version(kafka) < trainer.version:
            await producer.send(
                WEIGHTS, trainer.announcement(str(store.versions / f"v{trainer.version}")), "policy"
            )
        VERSION.set(trainer.version)
        log.info(
            "trainer running", extra={"base": tc.hf_checkpoint, "version": trainer.version, "root": str(root)}
        )
        steps_this_run = 0
        while not stop.is_set():
            batch = await consumer.getmany(
                timeout_ms=kafka.poll_timeout_ms, max_records=tc.rollout_batch_size * 4
            )
            for tp, records in batch.items():
                for rec in records:
                    decoded = await decode_or_dead_letter(rec, Sample, producer, tc.group_id)
                    if decoded is None:  # on deadletter before its offset is passed
                        DROPPED.labels("undecodable").inc()
                        log.warning("undecodable sample dead-lettered", extra={"offset": rec.offset})
                        pending.processed(tp.partition, rec.offset)
                        continue
                    sample = decoded.event
                    if trainer.fresh(sample):
                        pending.add(tp.partition, rec.offset, sample)
                    else:
                        pending.processed(tp.partition, rec.offset)
            PENDING.set(len(pending.samples))
            while len(pending.samples) >= tc.rollout_batch_size and not stop.is_set():
                samples = pending.take(tc.rollout_batch_size)
                offsets = pending.safe_offsets()
                stats = await asyncio.to_thread(trainer.train, samples)
                announcement = await asyncio.to_thread(trainer.persist, samples, offsets)
                await producer.send(WEIGHTS, announcement, "policy")
                await consumer.commit({TopicPartition(topic, p): o for p, o in offsets.items()})
                PENDING.set(len(pending.samples))
                _report(trainer, stats, samples)
                steps_this_run += 1
                if tc.max_steps and steps_this_run >= tc.max_steps:
                    stop.set()
    finally:
        await asyncio.to_thread(trainer.stop)
        await consumer.stop()
        await producer.stop()
        await asyncio.to_thread(shutdown_parallel, layout)


async def _announced_version(kafka: KafkaConfig) -> int:
    """The newest version on ``weights`` (0 when none)."""
    return max([rec.event.version async for rec in read_topic(kafka, WEIGHTS)], default=0)


def _report(trainer: TrainerLoop, stats: StepStats, samples: list[Sample]) -> None:
    STEPS.inc()
    VERSION.set(trainer.version)
    for s in samples:
        SAMPLES_IN.labels(s.kind).inc()
    for name in (
        "loss",
        "pg_loss",
        "clip_fraction",
        "entropy",
        "grad_norm",
        "kl_rollout",
        "kl",
        "topk_loss",
        "opd_gap",
        "is_weight_mean",
        "is_weight_max",
        "is_truncated",
    ):
        value = getattr(stats, name)
        if value is not None:
            LAST.labels(name).set(value)
    for kind, mean in stats.reward_mean_by_kind.items():
        REWARD.labels(kind).set(mean)
    log.info(
        "step done",
        extra={
            "version": trainer.version,
            "loss": round(stats.loss, 5),
            "clip_fraction": round(stats.clip_fraction, 4),
            "grad_norm": round(stats.grad_norm, 4),
            "kl_rollout": round(stats.kl_rollout, 5),
            "kl": None if stats.kl is None else round(stats.kl, 5),
            "opd_gap": None if stats.opd_gap is None else round(stats.opd_gap, 5),
            "is_weight_mean": None if stats.is_weight_mean is None else round(stats.is_weight_mean, 5),
            "is_truncated": None if stats.is_truncated is None else round(stats.is_truncated, 5),
            "tokens": stats.tokens,
            "reward_mean_by_kind": stats.reward_mean_by_kind,
        },
    )
