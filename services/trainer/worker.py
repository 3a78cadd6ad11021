"""``turnstream trainer``: consumes ``samples``, trains the policy, publishes weight versions.

Per step: ``rollout_batch_size`` samples, none of one user beyond ``max_user_share`` of them (``shares.py``; older
than ``max_staleness`` versions are dropped and counted) -> one
optimizer step -> the weights as Hugging Face safetensors in ``versions/v<N>`` (atomic, streamed tensor by
tensor) -> the step's record (its sample ids and ``samples`` offsets) -> every ``checkpoint_every_steps`` steps or
``checkpoint_every_s`` seconds a full checkpoint (model, optimizer, offsets, lineage) -> ``WeightsPublished`` ->
the offsets committed to Kafka. A restart loads the last full checkpoint, seeks ``samples`` to its offsets and
replays the recorded steps after it (the same samples, checked by id; nothing written or announced again), so a
sample is trained exactly once in the lineage of the published weights, whenever the trainer is killed.

Under a gate (``gate.enabled``) the trainer follows ``versions``: it keeps the full checkpoint behind each promoted
version, and after ``gate.restore_after`` failed candidates it rebuilds the promoted version's state the same way a
restart would (that checkpoint, then the recorded steps to the version) and trains on from there (``restore``).

Under torchrun (GPUs; gloo on the CPU in tests) only rank 0 consumes, publishes and commits; it broadcasts each
batch, and every rank trains its share, joins the weight gather and writes its own checkpoint state (``follow``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge, Histogram

from runtime.configuration.config import Config, KafkaConfig, TrainerConfig
from runtime.messaging.bus import (
    EventProducer,
    consumer_group,
    decode_or_dead_letter,
    kafka_consumer,
    read_topic,
    topic_partitions,
)
from runtime.observability.metrics import serve_metrics
from runtime.pipeline.promotion import Promotion, fold
from runtime.security.erasure.sealing import forgotten_session
from schemas import Sample, VersionDecision, WeightsPublished
from schemas.topics import SAMPLES, VERSIONS, WEIGHTS
from services.trainer.checkpoints import (
    BackgroundWriter,
    CheckpointMeta,
    RestoreMark,
    StepRecord,
    TrainerStore,
    VersionFiles,
)
from services.trainer.collective import barrier, broadcast
from services.trainer.lengths import fit_length
from services.trainer.parallel import ParallelLayout
from services.trainer.rank_thread import RankThread
from services.trainer.safetensors_stream import Entry
from services.trainer.shares import choose, user_of
from services.trainer.staleness import ancestors, from_ancestors, steps_apart
from services.trainer.step import StepStats

log = logging.getLogger("turnstream.trainer")

STEPS = Counter("turnstream_trainer_steps_total", "Optimizer steps taken")
SAMPLES_IN = Counter("turnstream_trainer_samples_total", "Samples trained on", ["kind"])
DROPPED = Counter("turnstream_trainer_dropped_total", "Samples not trained on", ["reason"])
RESTORES = Counter(
    "turnstream_trainer_restores_total",
    "Restores of the promoted version after failed candidates (under a gate)",
)
STALENESS = Histogram(
    "turnstream_trainer_staleness_versions",
    "Policy versions between a sample's and the trainer's",
    buckets=range(9),
)
LAST = Gauge("turnstream_trainer_last", "Figures of the last step", ["name"])
REWARD = Gauge("turnstream_trainer_reward_mean", "Mean reward of the last step's samples, by kind", ["kind"])
PENDING = Gauge("turnstream_trainer_pending_samples", "Samples held toward the next batch")
DEFERRED = Gauge(
    "turnstream_trainer_deferred_samples",
    "Samples the last step left for later because their user had given it its share (trainer.max_user_share)",
)
SHARE_LIFTED = Counter(
    "turnstream_trainer_user_share_lifted_total",
    "Steps the user-share cap did not hold for: alone (one user waiting), waited (user_share_wait_s passed)",
    ["reason"],
)
TRUNCATED = Counter(
    "turnstream_trainer_truncated_total",
    "Samples over trainer.max_sample_tokens trained with their prompt cut",
)
VERSION = Gauge("turnstream_trainer_version", "Newest published weight version")
STEP_SECONDS = Histogram("turnstream_trainer_step_seconds", "One optimizer step (forward, backward, update)")
CHECKPOINT_SECONDS = Histogram(
    "turnstream_trainer_checkpoint_seconds",
    "Writing a full checkpoint (model and optimizer state, every rank)",
    buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800),
)


if TYPE_CHECKING:
    from torch import Tensor


class TrainablePolicy(Protocol):
    """What the training loop needs of a policy (``services.trainer.policy.Policy``, imported only when training
    starts: it brings Megatron-core)."""

    layout: ParallelLayout

    def train(self, samples: list[Sample]) -> StepStats: ...

    def entries(self) -> list[Entry]: ...

    def hf_stream(self) -> Iterator[tuple[str, Tensor]]: ...

    def version_files(self) -> VersionFiles: ...

    def state(self) -> tuple[dict[str, Any], Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


class _Pending:
    """Consumed samples not trained yet, and the offsets that are safe to checkpoint around them."""

    def __init__(self, start: dict[int, int]) -> None:
        self.samples: list[tuple[int, int, Sample, float]] = []
        """(partition, offset, sample, when it was consumed: ``time.monotonic()``), in arrival order."""
        self.next_offset = dict(start)
        self.seen: dict[str, float] = {}
        """Each user -> when their newest sample was consumed (``shares.py``: who else is sending)."""

    def processed(self, partition: int, offset: int) -> None:
        self.next_offset[partition] = offset + 1

    def add(self, partition: int, offset: int, sample: Sample) -> None:
        now = time.monotonic()
        self.samples.append((partition, offset, sample, now))
        self.seen[user_of(sample.session_id)] = now
        self.processed(partition, offset)

    def take_step(self, tc: TrainerConfig) -> tuple[list[Sample], set[Place], dict[str, float]] | None:
        """The next step's samples, no user beyond its share (``shares.py``), where they were read, and the step's
        share figures; None while the step must wait for more."""
        now = time.monotonic()
        self.seen = {u: t for u, t in self.seen.items() if now - t < tc.user_share_wait_s}
        users = [user_of(s.session_id) for _, _, s, _ in self.samples]
        waited = now - self.samples[0][3] if self.samples else 0.0
        active = len(self.seen.keys() | set(users))
        choice = choose(users, waited, active, tc.rollout_batch_size, tc.max_user_share, tc.user_share_wait_s)
        if choice is None:
            return None
        if choice.lifted:
            SHARE_LIFTED.labels(choice.lifted).inc()
        DEFERRED.set(choice.deferred)
        picked = set(choice.chosen)
        taken = [self.samples[i][2] for i in choice.chosen]
        places = {(self.samples[i][0], self.samples[i][1]) for i in choice.chosen}
        self.samples = [entry for i, entry in enumerate(self.samples) if i not in picked]
        return taken, places, choice.figures(users)

    def take_ids(self, ids: list[str]) -> list[Sample] | None:
        """The samples of a recorded step, in its order, once all of them have been consumed (None before)."""
        found: dict[str, int] = {}
        for i, (_, _, s, _) in enumerate(self.samples):
            found.setdefault(s.sample_id, i)  # the first copy of a redelivered id, as ``take`` would
        if any(sid not in found for sid in ids):
            return None
        taken = [self.samples[found[sid]][2] for sid in ids]
        chosen = {found[sid] for sid in ids}
        self.samples = [entry for i, entry in enumerate(self.samples) if i not in chosen]
        return taken

    def after_replay(
        self, offsets: dict[int, int], taken: set[Place], fresh: Callable[[Sample], bool]
    ) -> None:
        """After the last recorded step: forget samples below its safe offsets and those past them it took (the
        run that recorded it trained or dropped each of them), and judge the rest's staleness now (a replay takes
        every sample, as the recorded run may have read them at another version)."""
        self.samples = [
            e
            for e in self.samples
            if e[1] >= offsets.get(e[0], 0) and (e[0], e[1]) not in taken and fresh(e[2])
        ]
        for partition, offset in offsets.items():
            self.next_offset[partition] = max(self.next_offset.get(partition, offset), offset)

    def safe_offsets(self) -> dict[int, int]:
        """Per partition: where a restart must resume so that pending samples are read again."""
        safe = dict(self.next_offset)
        for partition, offset, _, _ in self.samples:
            safe[partition] = min(safe.get(partition, offset), offset)
        return safe


Place = tuple[int, int]
"""Where a sample was read: (partition, offset) on ``samples``."""


def _keyed(offsets: dict[int, int]) -> dict[str, int]:
    return {str(p): o for p, o in offsets.items()}


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
        """The newest version number published: the next step publishes ``version + 1``."""
        self.at = 0
        """The version whose weights the policy holds: ``version``, but after a restore the restored one."""
        self.parents: dict[int, int] = {}
        """Each version this trainer knows the lineage of -> the version it was trained from (``staleness``)."""
        self.protected: set[int] = set()
        """Under a gate: the promoted and pinned versions, whose folders a rollback may load again."""
        self.mark: RestoreMark | None = None
        """A restore being replayed: consumption goes on at its offsets once the replay is done."""
        self.step = 0
        self.trained: list[list[str]] = []
        self.samples_trained = 0
        self.offsets: dict[int, int] = {}
        """Where the next step's samples start: the last step's safe offsets (or where consumption began)."""
        self.taken: set[Place] = set()
        """Samples at or past ``offsets`` trained already (or by steps a restore discarded): skipped when read."""
        self.replay: deque[StepRecord] = deque()
        """Steps after the last full checkpoint, to train again from the same samples before going on."""
        self.since_checkpoint = 0
        self.checkpointed_at = time.monotonic()
        self.writer = BackgroundWriter()
        self.format = policy.version_files().format

    def resume(self) -> bool:
        """Load the full checkpoint behind the newest version (or a restore's target) and queue the recorded
        steps from it for replay."""
        plan = self.store.plan()
        found = plan.checkpoint
        broadcast(("resume", str(found[1]) if found else None), self.layout)
        if found is not None:
            meta, folder = found
            self.policy.load_state(self.store.load_state(folder, self.layout.rank))
            self.at, self.step = meta.version, meta.step
            self.parents.update(from_ancestors(meta.version, meta.ancestors))
            self.trained, self.samples_trained = list(meta.trained), meta.samples_trained
            self.offsets = {int(p): o for p, o in meta.offsets.items()}
            self.taken = set(meta.taken)
        else:  # the base weights
            self.at, self.step, self.trained, self.samples_trained = 0, 0, [], 0
            self.taken = set()
            if plan.records:
                self.offsets = {int(p): o for p, o in plan.records[0].offsets_before.items()}
        self.version = max(plan.numbered, self.at)
        self.replay = deque(plan.records)
        self.mark = plan.mark
        if self.mark is not None and not self.replay:
            self.offsets = {int(p): o for p, o in self.mark.offsets.items()}
            self.taken = set(self.mark.taken)
        resumed = found is not None or bool(plan.records)
        if resumed:
            log.info(
                "resumed from checkpoint",
                extra={
                    "version": self.at,
                    "offsets": self.offsets,
                    "replaying_steps": len(plan.records),
                    "restoring_to": plan.mark.to if plan.mark else None,
                },
            )
        return resumed

    def restore(self, to: int, reason: str) -> int:
        """Go back to version ``to``'s weights and optimizer state (under a gate, after ``gate.restore_after``
        failed candidates): the restore is recorded first, then the state is rebuilt as a start would rebuild it
        (the full checkpoint behind ``to`` and the steps from it, replayed). Returns how many trained samples the
        discarded steps held (they are not trained again). The caller seeks ``samples`` to ``self.offsets``."""
        self.writer.wait()
        anchor, path = self.store.path_to(to)
        checkpoints = self.store.checkpoint_versions()
        if path:
            trained_at = path[-1].samples_trained
        elif anchor in checkpoints:
            meta = msgspec.json.decode((checkpoints[anchor] / "meta.json").read_bytes(), type=CheckpointMeta)
            trained_at = meta.samples_trained
        if anchor not in checkpoints:
            raise RuntimeError(
                f"restoring v{to}: no full checkpoint behind it (under a gate the trainer keeps one from its "
                "start; was the gate enabled after this trainer's first steps?)"
            )
        self.store.write_restore(
            RestoreMark(
                to=to,
                after=self.version,
                offsets=_keyed(self.offsets),
                reason=reason,
                decided_at=time.time(),
                taken=sorted(self.taken),
            )
        )
        discarded, was = self.samples_trained - trained_at, self.at
        self.resume()
        self.since_checkpoint = 0
        log.warning(
            "restored a promoted version",
            extra={"to": to, "from": was, "replaying_steps": len(path), "discarded_samples": discarded},
        )
        return discarded

    def steps_ahead_of(self, version: int) -> int:
        """Steps of training between ``version``'s weights and the ones the policy holds."""
        return steps_apart(self.parents, self.at, version)

    def fresh(self, s: Sample) -> bool:
        lag = self.steps_ahead_of(s.weight_version)
        STALENESS.observe(max(lag, 0))
        if lag > self.tc.max_staleness:
            DROPPED.labels("stale").inc()
            return False
        return True

    def checkpoint_due(self) -> bool:
        return (
            self.since_checkpoint + 1 >= self.tc.checkpoint_every_steps
            or time.monotonic() - self.checkpointed_at >= self.tc.checkpoint_every_s
        )

    def train(self, samples: list[Sample], checkpoint: bool = False) -> StepStats:
        """One step (``checkpoint``: the other ranks are to write their state after it, as rank 0's ``persist``
        will); with a replay queued, the step it records, nothing written."""
        replaying = bool(self.replay)
        checkpoint = checkpoint and not replaying
        if checkpoint:  # the previous checkpoint committed (or its error raised) before the ranks are told
            self.writer.wait()
        broadcast(("step", samples, self.version + 1, not replaying, checkpoint), self.layout)
        started = time.perf_counter()
        stats: StepStats = self.policy.train(samples)
        STEP_SECONDS.observe(time.perf_counter() - started)
        return stats

    def replayed(self, samples: list[Sample]) -> None:
        record = self.replay.popleft()
        self.advance(samples, record.version)
        self.offsets = {int(p): o for p, o in record.offsets.items()}
        self.taken = set(record.taken)
        if not self.replay and self.mark is not None:  # a restore: on from where the discarded steps ended
            self.offsets = {int(p): o for p, o in self.mark.offsets.items()}
            self.taken = set(self.mark.taken)
        log.info("replayed step", extra={"version": self.at, "left": len(self.replay)})

    def after_replay_offsets(self) -> dict[int, int]:
        return dict(self.offsets)

    def advance(self, samples: list[Sample], version: int) -> None:
        self.version = max(self.version, version)
        self.parents[version] = self.at
        self.at = version
        self.step += 1
        self.trained.append([s.sample_id for s in samples])
        self.samples_trained += len(samples)
        self.since_checkpoint += 1

    def persist(
        self,
        samples: list[Sample],
        offsets: dict[int, int],
        checkpoint: bool,
        places: set[Place] | None = None,
    ) -> WeightsPublished:
        """After a step: the new version on disk, its step record, and a full checkpoint when due. The loop's
        state moves only once both are written: a failure before leaves it at the last recorded step."""
        version = self.version + 1
        taken = {(p, o) for p, o in self.taken | (places or set()) if o >= offsets.get(p, 0)}
        path, digest = self.store.write_version(
            version, self.policy.entries(), self.policy.hf_stream(), self.base, self.policy.version_files()
        )
        self.store.write_step(
            StepRecord(
                version=version,
                sample_ids=[s.sample_id for s in samples],
                offsets_before=_keyed(self.offsets),
                offsets=_keyed(offsets),
                samples_trained=self.samples_trained + len(samples),
                parent=self.at if self.at != version - 1 else None,
                taken=sorted(taken),
            )
        )
        self.advance(samples, version)
        self.mark = None
        self.offsets, self.taken = dict(offsets), taken
        if checkpoint:
            self.checkpoint()
        self.store.prune_versions(self.tc.keep_versions, protect={self.version, *self.protected})
        return self.announcement(str(path), digest)

    def checkpoint(self) -> None:
        """A full checkpoint of the current state (a collective: the other ranks write their own state). The
        state is copied at this step boundary and written in the background while training goes on
        (``trainer.checkpoint_async``); rank 0 commits it once every rank's file is on disk."""
        self.writer.wait()  # already waited for before the ranks were told, when they were
        meta = CheckpointMeta(
            version=self.at,
            step=self.step,
            offsets=_keyed(self.offsets),
            trained=list(self.trained),
            samples_trained=self.samples_trained,
            taken=sorted(self.taken),
            base_model=self.base,
            ancestors=ancestors(self.parents, self.at),
        )
        tmp = self.store.stage(self.at)
        keep = {a for v in self.protected if (a := self.store.anchor(v)) is not None}
        barrier(self.layout)  # the staging folder exists
        state = self.policy.state()  # host copies of this step boundary's state
        started = time.perf_counter()

        def write() -> None:
            self.store.write_state(tmp, self.layout.rank, *state)
            self.store.wait_for_ranks(tmp, self.layout.world_size)
            self.store.commit(meta, tmp, keep)
            CHECKPOINT_SECONDS.observe(time.perf_counter() - started)
            log.info("checkpoint written", extra={"version": meta.version})

        if self.tc.checkpoint_async:
            self.writer.start(write)
        else:
            write()
        self.since_checkpoint = 0
        self.checkpointed_at = time.monotonic()

    def checkpoint_now(self) -> None:
        """A full checkpoint of the current state, every rank told, committed before this returns."""
        broadcast(("checkpoint", self.at), self.layout)
        self.checkpoint()
        self.writer.wait()

    def stop(self) -> None:
        """A clean stop checkpoints what the last full checkpoint lacks, so the next start replays nothing, and
        waits for it to be committed. (After an error there is no stop: the ranks may be inside a collective,
        and torchrun ends them when rank 0 exits.)"""
        self.writer.wait()
        if self.since_checkpoint and not self.replay:
            broadcast(("checkpoint", self.at), self.layout)
            self.checkpoint()
            self.writer.wait()
        broadcast(("stop",), self.layout)

    def announcement(self, path: str, digest: str | None = None) -> WeightsPublished:
        return WeightsPublished(
            version=self.version,
            path=path,
            base_model=self.base,
            step=self.step,
            created_at=time.time(),
            samples_trained=self.samples_trained,
            format=self.format,
            sha256=digest,
        )

    def newest_announcement(self) -> WeightsPublished | None:
        """The newest version on disk (the last recorded step's, replayed or not), as it would be announced;
        None before the first step."""
        newest = self.replay[-1] if self.replay else None
        if newest is None and self.version == 0:
            return None
        return WeightsPublished(
            version=newest.version if newest else self.version,
            path=str(self.store.versions / f"v{newest.version if newest else self.version}"),
            base_model=self.base,
            step=newest.version if newest else self.step,
            created_at=time.time(),
            samples_trained=newest.samples_trained if newest else self.samples_trained,
            format=self.format,
        )


def follow(policy: TrainablePolicy, store: TrainerStore, background: bool = True) -> None:
    """A rank other than 0: resume, train, gather and checkpoint exactly when rank 0 does, until it stops."""
    layout: ParallelLayout = policy.layout
    writer = BackgroundWriter()
    while True:
        command = broadcast(None, layout)
        if command[0] == "stop":
            writer.wait()
            return
        if command[0] == "resume":
            if command[1] is not None:
                policy.load_state(store.load_state(Path(command[1]), layout.rank))
        elif command[0] == "step":
            _, samples, version, publish, checkpoint = command
            policy.train(samples)
            if publish:
                for _ in policy.hf_stream():  # the gather to rank 0
                    pass
            if checkpoint:
                _write_state(policy, store, version, writer, background)
        elif command[0] == "checkpoint":
            _write_state(policy, store, command[1], writer, background)


def _write_state(
    policy: TrainablePolicy, store: TrainerStore, version: int, writer: BackgroundWriter, background: bool
) -> None:
    """This rank's part of a checkpoint: as rank 0's ``TrainerLoop.checkpoint``, without the commit."""
    writer.wait()
    barrier(policy.layout)  # rank 0 has staged the folder
    state = policy.state()
    tmp, rank = store.staged(version), policy.layout.rank
    if background:
        writer.start(lambda: store.write_state(tmp, rank, *state))
    else:
        store.write_state(tmp, rank, *state)


def output_root(output_dir: str) -> Path:
    """Absolute: a version's path is announced to engines that resolve it from working directories of their own."""
    return Path(output_dir).resolve()


async def run_trainer(
    config: Config, *, install_signals: bool = True, stop: asyncio.Event | None = None
) -> None:
    """Run until SIGTERM/SIGINT, ``stop``, or ``trainer.max_steps`` steps; a step in progress completes."""
    from runtime.engine.model_store import cache_dir

    tc = config.trainer
    if not tc.hf_checkpoint:
        raise SystemExit("turnstream trainer: set trainer.hf_checkpoint (the policy's Hugging Face folder)")
    # Before the first CUDA allocation: segments that grow in place, so a long sample's step does not fail on
    # fragmentation under the per-process cap (policy.check_memory).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    layout = ParallelLayout.from_env(tc.tensor_parallel, tc.pipeline_parallel)
    root = output_root(tc.output_dir) if tc.output_dir else cache_dir() / "weights"
    store = TrainerStore(root)
    if layout.rank == 0:
        serve_metrics(config.metrics.port, config.metrics.host)
    torch_thread = RankThread(layout.local_rank)  # every torch call of this rank, on its device
    try:
        await _run_rank(config, layout, store, torch_thread, install_signals=install_signals, stop=stop)
    finally:
        torch_thread.close()


async def _run_rank(
    config: Config,
    layout: ParallelLayout,
    store: TrainerStore,
    torch_thread: RankThread,
    *,
    install_signals: bool,
    stop: asyncio.Event | None,
) -> None:
    import signal

    from services.trainer.model import shutdown_parallel
    from services.trainer.policy import Policy

    tc = config.trainer
    root = store.root
    policy = await torch_thread.run(Policy.from_hf, tc.hf_checkpoint, tc, layout)
    if layout.rank != 0:  # only rank 0 talks to Kafka; the others follow its commands
        await torch_thread.run(follow, policy, store, tc.checkpoint_async)
        await torch_thread.run(shutdown_parallel, layout)
        return
    stop = stop or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    trainer = TrainerLoop(config, policy, store, tc.hf_checkpoint)
    resumed = await torch_thread.run(trainer.resume)

    kafka = config.kafka
    topic = SAMPLES.name(kafka.namespace)
    consumer = kafka_consumer(
        kafka, client_id=f"{kafka.client_id}-trainer", group_id=consumer_group(kafka, tc.group_id)
    )
    producer = EventProducer(kafka, client_id=f"{kafka.client_id}-trainer")
    await producer.start()
    await consumer.start()
    clean = False  # after an error the other ranks may be inside a collective: no stop protocol then
    try:
        tps = await topic_partitions(consumer, topic)
        consumer.assign(tps)

        async def seek() -> _Pending:
            """Consume from the trainer's offsets (a partition it has none for: the group's committed offset)."""
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
            trainer.offsets = {**start, **trainer.offsets}
            return _Pending(start)

        pending = await seek()
        gate = _GateWatch(config) if config.gate.enabled else None
        if gate is not None and not store.checkpoint_versions():
            # A restore to the starting weights needs their optimizer state too: one full checkpoint, now.
            await torch_thread.run(trainer.checkpoint_now)
        # A kill between a step's record and its announcement leaves the newest version unannounced: announce it
        # now, unless it went out (each version is announced once).
        newest = trainer.newest_announcement()
        if resumed and newest is not None and await _announced_version(kafka) < newest.version:
            await producer.send(WEIGHTS, newest, "policy")
        VERSION.set(newest.version if newest else 0)
        log.info(
            "trainer running", extra={"base": tc.hf_checkpoint, "version": trainer.version, "root": str(root)}
        )
        steps_this_run = 0
        forgotten: set[str] = set()  # sessions whose samples were skipped: their keys are destroyed
        while not stop.is_set():
            batch = await consumer.getmany(
                timeout_ms=kafka.poll_timeout_ms, max_records=tc.rollout_batch_size * 4
            )
            for tp, records in batch.items():
                for rec in records:
                    if (tp.partition, rec.offset) in trainer.taken:
                        pending.processed(tp.partition, rec.offset)  # trained before a restart: read again
                        continue
                    decoded = await decode_or_dead_letter(rec, Sample, producer, tc.group_id)
                    if decoded is None:  # on deadletter before its offset is passed, or forgotten
                        session = await forgotten_session(kafka, rec.key, rec.value or b"")
                        if session is not None:
                            forgotten.add(session)
                            DROPPED.labels("forgotten").inc()
                        else:
                            DROPPED.labels("undecodable").inc()
                            log.warning("undecodable sample dead-lettered", extra={"offset": rec.offset})
                        pending.processed(tp.partition, rec.offset)
                        continue
                    sample = _fitted(decoded.event, tc)
                    if sample is None:
                        pending.processed(tp.partition, rec.offset)
                        continue
                    if trainer.replay or trainer.fresh(sample):  # a replay judges staleness after it
                        pending.add(tp.partition, rec.offset, sample)
                    else:
                        pending.processed(tp.partition, rec.offset)
            PENDING.set(len(pending.samples))
            while trainer.replay and not stop.is_set():  # published before the restart: train again, quietly
                record = trainer.replay[0]
                # Samples of sessions forgotten since (``turnstream forget``) are gone for good: the step is
                # replayed without them, so the state rebuilt differs from the published version's by them.
                kept = [i for i in record.sample_ids if i.rpartition(":")[0] not in forgotten]
                replayed = pending.take_ids(kept)
                if replayed is None:  # not all consumed yet, unless the topic holds them no more
                    if not batch and await _at_end(consumer, tps):
                        raise RuntimeError(
                            f"replay of step v{record.version}: its samples are no longer on {topic} (a retention "
                            "shorter than the checkpoint cadence?), so the state behind the published versions "
                            "after the last full checkpoint cannot be rebuilt"
                        )
                    break
                if len(kept) < len(record.sample_ids):
                    log.warning(
                        "replaying a step without its forgotten samples",
                        extra={"version": record.version, "forgotten": len(record.sample_ids) - len(kept)},
                    )
                if replayed:
                    await torch_thread.run(trainer.train, replayed)
                trainer.replayed(replayed)
                if not trainer.replay:
                    pending.after_replay(trainer.offsets, trainer.taken, trainer.fresh)
            if gate is not None and not trainer.replay:
                promotion = await gate.promotion(force=len(pending.samples) >= tc.rollout_batch_size)
                if promotion is not None:
                    trainer.protected = _served(promotion)
                    if _restore_due(trainer, promotion, config) and gate.may_restore(promotion):
                        if await _restore(trainer, promotion, producer, torch_thread):
                            pending = await seek()
                            gate.forget()
                            continue
            while not trainer.replay and not stop.is_set() and (step := pending.take_step(tc)) is not None:
                samples, places, shares = step
                offsets = pending.safe_offsets()
                checkpoint = trainer.checkpoint_due()
                stats = await torch_thread.run(trainer.train, samples, checkpoint)
                announcement = await torch_thread.run(trainer.persist, samples, offsets, checkpoint, places)
                announcement = msgspec.structs.replace(
                    announcement,
                    sample_ids=[s.sample_id for s in samples],
                    figures={**_figures(stats), **shares},
                    advantages=[stats.advantages[s.sample_id] for s in samples],
                )
                await producer.send(WEIGHTS, announcement, "policy")
                await consumer.commit({TopicPartition(topic, p): o for p, o in offsets.items()})
                PENDING.set(len(pending.samples))
                _report(trainer, stats, samples)
                steps_this_run += 1
                if tc.max_steps and steps_this_run >= tc.max_steps:
                    stop.set()
        clean = True
    finally:
        if clean:
            await torch_thread.run(trainer.stop)
        elif not layout.distributed:  # let a background checkpoint finish; its error is not the one to report
            with contextlib.suppress(Exception):
                await torch_thread.run(trainer.writer.wait)
        await consumer.stop()
        await producer.stop()
        if clean:
            await torch_thread.run(shutdown_parallel, layout)


def _fitted(sample: Sample, tc: TrainerConfig) -> Sample | None:
    """The sample as the trainer is planned to take it (``lengths.py``), counted and logged when it is not."""
    fitted = fit_length(sample, tc.max_sample_tokens, tc.long_samples)
    if fitted is None:
        DROPPED.labels("too_long").inc()
        log.warning(
            "sample longer than trainer.max_sample_tokens dropped: raise it (the memory plan must allow it: "
            "`turnstream trainer plan`), or set trainer.long_samples = truncate",
            extra={
                "sample_id": sample.sample_id,
                "tokens": len(sample.tokens),
                "response_tokens": sample.response_length,
                "max_sample_tokens": tc.max_sample_tokens,
            },
        )
    elif fitted is not sample:
        TRUNCATED.inc()
    return fitted


async def _at_end(consumer: Any, tps: list[TopicPartition]) -> bool:
    """Whether the consumer has read every partition to its end."""
    ends = await consumer.end_offsets(tps)
    for tp in tps:
        if await consumer.position(tp) < ends[tp]:
            return False
    return True


class _GateWatch:
    """The gate's decisions (``versions``), read again before each step and every ``gate.poll_s`` while idle."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.read_at = -math.inf

        self.failed_at: int | None = None
        """The decision count when a restore failed: not tried again until another decision."""

    def forget(self) -> None:
        self.read_at = -math.inf

    def may_restore(self, promotion: Promotion) -> bool:
        if self.failed_at == promotion.decisions:
            return False
        self.failed_at = promotion.decisions  # cleared by the restore's own decision when it succeeds
        return True

    async def promotion(self, force: bool) -> Promotion | None:
        """The fold of every decision, or None when read less than ``gate.poll_s`` ago and not ``force``d."""
        if not force and time.monotonic() - self.read_at < self.config.gate.poll_s:
            return None
        self.read_at = time.monotonic()
        return fold([rec.event async for rec in read_topic(self.config.kafka, VERSIONS)])


def _starved(trainer: TrainerLoop, promotion: Promotion, max_staleness: int) -> bool:
    """Users are served the promoted version while the gate turns candidates down, so once the trainer is more
    than ``trainer.max_staleness`` steps past it every new sample is stale: with its newest version failed too,
    no step and no candidate would come again, and no further failure would reach ``gate.restore_after``."""
    return (
        promotion.state(trainer.version) in ("rejected", "rolled_back")
        and trainer.steps_ahead_of(promotion.promoted) > max_staleness
    )


def _restore_due(trainer: TrainerLoop, promotion: Promotion, config: Config) -> bool:
    return promotion.failed_streak >= config.gate.restore_after or _starved(
        trainer, promotion, config.trainer.max_staleness
    )


def _served(promotion: Promotion) -> set[int]:
    """The versions a gated proxy may serve again (promoted, or pinned): kept on disk, with the checkpoint a
    restore to them starts from."""
    return set(promotion.history) | ({promotion.pinned} if promotion.pinned is not None else set())


async def _restore(
    trainer: TrainerLoop, promotion: Promotion, producer: EventProducer, torch_thread: RankThread
) -> bool:
    """``gate.restore_after`` candidates failed in a row, or the trainer starved (``_starved``): training goes on
    from the promoted version's weights and optimizer state, and ``versions`` says so (which ends the streak)."""
    failed = sorted(v for v, state in promotion.states.items() if state in ("rejected", "rolled_back"))
    to = promotion.promoted
    why = (
        f"{promotion.failed_streak} candidates failed the gate in a row (latest: "
        f"{', '.join(f'v{v}' for v in failed[-promotion.failed_streak :])})"
        if promotion.failed_streak >= trainer.config.gate.restore_after
        else f"v{trainer.version} failed the gate and the trainer is {trainer.steps_ahead_of(to)} steps past "
        f"v{to}, which users are served: every new sample is staler than trainer.max_staleness"
    )
    reason = (
        f"{why}; training goes on from v{to}'s weights and optimizer state, and the samples of the steps after "
        f"v{to} are not trained again"
    )
    discarded = 0
    if trainer.at != to:  # else restored already (a restart between the restore and its decision)
        try:
            discarded = await torch_thread.run(trainer.restore, to, reason)
        except RuntimeError as exc:  # nothing changed: training goes on, and the gate keeps rejecting
            log.error("cannot restore the promoted version", extra={"to": to, "error": str(exc)})
            return False
        DROPPED.labels("restored_away").inc(discarded)
    RESTORES.inc()
    await producer.send(
        VERSIONS,
        VersionDecision(
            version=to,
            state="restored",
            reason=f"{reason} ({discarded} samples)",
            by="trainer",
            decided_at=time.time(),
            against=trainer.version,
        ),
        "policy",
    )
    return True


async def _announced_version(kafka: KafkaConfig) -> int:
    """The newest version on ``weights`` (0 when none)."""
    return max([rec.event.version async for rec in read_topic(kafka, WEIGHTS)], default=0)


_FIGURES = (
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
    "gpu_peak_gib",
)


def _figures(stats: StepStats) -> dict[str, float]:
    """The step's figures that have a value (for ``WeightsPublished.figures`` and the metrics)."""
    out = {name: float(v) for name in _FIGURES if (v := getattr(stats, name)) is not None}
    out["tokens"] = float(stats.tokens)
    return out


def _report(trainer: TrainerLoop, stats: StepStats, samples: list[Sample]) -> None:
    STEPS.inc()
    VERSION.set(trainer.version)
    for s in samples:
        SAMPLES_IN.labels(s.kind).inc()
    for name, value in _figures(stats).items():
        if name != "tokens":
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
            "topk_loss": None if stats.topk_loss is None else round(stats.topk_loss, 5),
            "is_weight_mean": None if stats.is_weight_mean is None else round(stats.is_weight_mean, 5),
            "is_truncated": None if stats.is_truncated is None else round(stats.is_truncated, 5),
            "tokens": stats.tokens,
            "gpu_peak_gib": None if stats.gpu_peak_gib is None else round(stats.gpu_peak_gib, 2),
            "reward_mean_by_kind": stats.reward_mean_by_kind,
        },
    )
