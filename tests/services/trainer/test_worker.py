"""The trainer loop against the real broker: batches of samples become published weight versions, a checkpoint
records offsets and the lineage of trained samples, a restart resumes exactly there, and stale samples are
dropped."""

from __future__ import annotations

import asyncio
import json
import warnings
from pathlib import Path

import msgspec
import pytest
import torch

from runtime.configuration.config import Config, KafkaConfig, TrainerConfig
from runtime.messaging.bus import EventProducer, read_topic
from runtime.messaging.topics import create_topics
from schemas import Sample, WeightsPublished
from schemas.topics import SAMPLES, WEIGHTS
from services.trainer.checkpoints import TrainerStore
from services.trainer.model import read_hf_weights
from services.trainer.spec import ModelSpec
from services.trainer.worker import run_trainer
from tests.services.trainer.conftest import make_sample, publish

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
pytestmark = pytest.mark.integration


def config(kafka: KafkaConfig, model: Path, out: Path, **trainer: object) -> Config:
    tc = msgspec.convert(
        {"hf_checkpoint": str(model), "output_dir": str(out), "rollout_batch_size": 4, "lr": 1e-3, **trainer},
        TrainerConfig,
    )
    return Config(kafka=kafka, trainer=tc)


async def run(cfg: Config, timeout: float = 120) -> None:
    await asyncio.wait_for(run_trainer(cfg, install_signals=False), timeout)


def lineage(out: Path) -> list[str]:
    found = TrainerStore(out).latest()
    assert found is not None
    return [sid for step in found[0].trained for sid in step]


async def test_steps_publish_versions_and_a_restart_resumes_at_the_checkpoint(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    first = [make_sample(i) for i in range(10)]
    await publish(kafka, first)
    out = tmp_path / "weights"
    await run(config(kafka, tiny_llama, out, max_steps=2))
    trained = lineage(out)
    assert len(trained) == 8 and len(set(trained)) == 8
    published = [r.event async for r in read_topic(kafka, WEIGHTS)]
    assert [w.version for w in published] == [1, 2] and all(
        isinstance(w, WeightsPublished) for w in published
    )
    rewards = {s.sample_id: s.reward for s in first}
    for w in published:  # rl: the advantage of each token is the sample's reward, as trained
        assert len(w.sample_ids) == 4 and w.advantages == [rewards[sid] for sid in w.sample_ids]
    v2 = Path(published[-1].path)
    assert v2 == out / "versions" / "v2" and (v2 / "config.json").exists()
    weights = read_hf_weights(v2)
    spec = ModelSpec.from_dir(v2)
    assert spec.num_layers == 2 and weights.keys() == read_hf_weights(tiny_llama).keys()
    assert not torch.equal(weights["model.norm.weight"], read_hf_weights(tiny_llama)["model.norm.weight"])
    import hashlib

    assert hashlib.sha256((v2 / "model.safetensors").read_bytes()).hexdigest() == published[-1].sha256

    # Two samples were consumed but not trained: the restart reads them again, with the new ones.
    await publish(kafka, [make_sample(i) for i in range(10, 16)])
    await run(config(kafka, tiny_llama, out, max_steps=2))
    trained = lineage(out)
    assert sorted(trained) == sorted(s.sample_id for s in first + [make_sample(i) for i in range(10, 16)])
    assert len(trained) == len(set(trained)) == 16
    versions = [r.event.version async for r in read_topic(kafka, WEIGHTS)]
    assert versions == [1, 2, 3, 4], "v2 was announced: the restart does not announce it again"
    meta = json.loads((out / "checkpoints" / "latest.json").read_text())
    assert meta["version"] == 4

    # A checkpoint whose announcement never reached `weights` (a kill in between; here: a fresh namespace):
    # the restart announces it, once, before training on.
    elsewhere = msgspec.structs.replace(kafka, namespace=kafka.namespace.rstrip(".") + "-b.")
    await create_topics(elsewhere, partitions=3)
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_trainer(config(elsewhere, tiny_llama, out), install_signals=False, stop=stop)
    )
    try:
        for _ in range(600):
            if [r.event.version async for r in read_topic(elsewhere, WEIGHTS)] or task.done():
                break
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert [r.event.version async for r in read_topic(elsewhere, WEIGHTS)] == [4]


async def test_stale_samples_are_dropped(kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path) -> None:
    from prometheus_client import REGISTRY

    before = REGISTRY.get_sample_value("turnstream_trainer_dropped_total", {"reason": "stale"}) or 0.0
    out = tmp_path / "weights"
    await publish(kafka, [make_sample(i) for i in range(4)])
    await run(config(kafka, tiny_llama, out, max_steps=1, max_staleness=0))  # now at version 1
    await publish(kafka, [make_sample(100 + i, weight_version=0) for i in range(3)])  # 1 version behind
    await publish(kafka, [make_sample(200 + i, weight_version=1) for i in range(4)])
    await run(config(kafka, tiny_llama, out, max_steps=1, max_staleness=0))
    after = REGISTRY.get_sample_value("turnstream_trainer_dropped_total", {"reason": "stale"}) or 0.0
    assert after - before == 3
    assert sorted(lineage(out)[4:]) == sorted(make_sample(200 + i).sample_id for i in range(4))


async def test_one_users_flood_gives_each_step_its_share_and_the_rest_is_trained_later_once(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    """Issue 55, row 11: samples were trained in arrival order, so one key could fill whole steps. Now no user
    gives a step more than ``max_user_share`` of it while others wait; theirs beyond it are deferred (safe offsets
    hold them over a restart) and trained once, when they are all that is left."""
    from prometheus_client import REGISTRY

    def owned(user: str, i: int) -> Sample:
        return msgspec.structs.replace(make_sample(i), sample_id=f"{user}/s:{i}", session_id=f"{user}/s")

    flood = [owned("mallory", i) for i in range(8)]
    others = [owned("alice", 100 + i) for i in range(2)] + [owned("bob", 200 + i) for i in range(2)]
    async with EventProducer(kafka) as producer:  # one partition: the flood first, in order
        for sample in flood + others:
            await producer.send(SAMPLES, sample, "one-partition")
    out = tmp_path / "weights"
    lifted = (
        REGISTRY.get_sample_value("turnstream_trainer_user_share_lifted_total", {"reason": "alone"}) or 0.0
    )
    await run(config(kafka, tiny_llama, out, max_steps=2, max_user_share=0.5))
    steps = [r.event async for r in read_topic(kafka, WEIGHTS)]
    mallorys = [sum(sid.startswith("mallory/") for sid in w.sample_ids) for w in steps]
    assert mallorys == [2, 2], [w.sample_ids for w in steps]
    assert (
        all(w.figures["top_user_share"] == 0.5 for w in steps) and steps[0].figures["deferred_by_share"] >= 1
    )
    # A restart: the deferred four are read again (the safe offsets stayed below them) and, alone now, trained;
    # the four past them that the steps took are not trained twice.
    await run(config(kafka, tiny_llama, out, max_steps=1, max_user_share=0.5))
    trained = lineage(out)
    assert sorted(trained) == sorted(s.sample_id for s in flood + others) and len(set(trained)) == 12
    after = (
        REGISTRY.get_sample_value("turnstream_trainer_user_share_lifted_total", {"reason": "alone"}) or 0.0
    )
    assert after - lifted == 1


async def test_records_that_are_not_samples_go_to_deadletter_and_training_goes_on(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    from runtime.messaging.bus import EventProducer
    from schemas import DeadLetter, encode
    from schemas.topics import DEADLETTER, SAMPLES
    from tests.strategies import example_turn

    out = tmp_path / "weights"
    await publish(kafka, [make_sample(i) for i in range(2)])
    garbage, turn = b"\x00not msgpack at all", encode(example_turn("wrong-topic", 1))
    async with EventProducer(kafka) as producer:
        await producer.send_raw(SAMPLES.name(kafka.namespace), garbage, b"k1")
        await producer.send_raw(SAMPLES.name(kafka.namespace), turn, b"k2")
    await publish(kafka, [make_sample(2 + i) for i in range(2)])
    await run(config(kafka, tiny_llama, out, max_steps=1))
    assert sorted(lineage(out)) == sorted(make_sample(i).sample_id for i in range(4))
    letters: list[DeadLetter] = [r.event async for r in read_topic(kafka, DEADLETTER)]
    assert sorted(d.payload for d in letters) == sorted([garbage, turn])  # kept verbatim
    assert {d.source_topic for d in letters} == {SAMPLES.name(kafka.namespace)}
    assert {d.source_key for d in letters} == {b"k1", b"k2"} and all(d.error for d in letters)


async def test_a_step_whose_samples_are_gone_stops_the_replay_with_the_reason(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    """A recorded step after the last checkpoint whose samples the topic no longer holds (retention): the
    trainer refuses to go on rather than train on another history, once it has read the topic to its end."""
    from services.trainer.checkpoints import StepRecord

    out = tmp_path / "weights"
    await publish(kafka, [make_sample(i) for i in range(4)])
    await run(config(kafka, tiny_llama, out, max_steps=1))  # v1, checkpointed at the clean stop
    store = TrainerStore(out)
    found = store.latest()
    assert found is not None and found[0].version == 1
    store.write_step(
        StepRecord(2, ["gone:1", "gone:2", "gone:3", "gone:4"], found[0].offsets, found[0].offsets, 8)
    )
    with pytest.raises(RuntimeError, match="replay of step v2: its samples are no longer on"):
        await run(config(kafka, tiny_llama, out, max_steps=1))


async def test_a_step_whose_session_was_forgotten_is_replayed_without_it(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    """``turnstream forget`` destroys a session's key, so its samples in a step recorded after the last checkpoint
    can never be read again: the restart replays the step without them (counted) instead of refusing to start,
    and trains on."""
    from prometheus_client import REGISTRY

    from runtime.security.erasure.sealing import session_keys
    from services.trainer.checkpoints import StepRecord

    out = tmp_path / "weights"
    await publish(kafka, [make_sample(i) for i in range(4)])
    await run(config(kafka, tiny_llama, out, max_steps=1))  # v1, checkpointed at the clean stop
    store = TrainerStore(out)
    found = store.latest()
    assert found is not None and found[0].version == 1
    step = [make_sample(i) for i in range(4, 8)]  # sessions s1, s2, s0, s1
    await publish(kafka, step)
    store.write_step(StepRecord(2, [s.sample_id for s in step], found[0].offsets, found[0].offsets, 8))
    keys = session_keys(kafka)
    assert keys is not None and await keys.destroy(["s2"]) == 1
    await publish(kafka, [make_sample(i) for i in range(8, 12)])  # s2 again, under a new key: readable
    before = REGISTRY.get_sample_value("turnstream_trainer_dropped_total", {"reason": "forgotten"}) or 0.0
    await run(config(kafka, tiny_llama, out, max_steps=1))  # replays v2, then trains v3
    after = REGISTRY.get_sample_value("turnstream_trainer_dropped_total", {"reason": "forgotten"}) or 0.0
    assert after - before == 1
    steps = TrainerStore(out).latest()
    assert steps is not None and steps[0].version == 3
    assert steps[0].trained[1] == [s.sample_id for s in step if s.session_id != "s2"]
    assert sorted(steps[0].trained[2]) == sorted(make_sample(i).sample_id for i in range(8, 12))


def test_after_a_replay_pending_samples_are_those_the_recorded_run_had_not_resolved() -> None:
    """A replay takes every sample it reads (the recorded run may have read them at another version); after the
    last recorded step, what lies below its safe offsets was resolved then, and the rest is judged stale or
    fresh now. A redelivered id is taken at its first copy, as ``take`` would."""
    from services.trainer.worker import _Pending

    pending = _Pending({0: 0, 1: 0})
    for offset, sample in enumerate([make_sample(0), make_sample(1), make_sample(2, weight_version=0)]):
        pending.add(0, offset, sample)
    pending.add(1, 0, make_sample(3, weight_version=5))
    pending.add(1, 1, make_sample(1))  # a redelivery of sample 1
    taken = pending.take_ids([make_sample(1).sample_id])
    assert taken is not None and [s.sample_id for s in taken] == [make_sample(1).sample_id]
    assert [(p, o) for p, o, _, _ in pending.samples] == [(0, 0), (0, 2), (1, 0), (1, 1)]
    assert pending.take_ids(["never-seen"]) is None
    stale = make_sample(2).sample_id
    pending.add(1, 2, make_sample(4))
    pending.after_replay({0: 1, 1: 1}, {(1, 2)}, lambda s: s.sample_id != stale)
    # (0, 0) and (1, 0) lie below the recorded safe offsets; (0, 2) is stale now; (1, 2), past them, was taken
    # by the recorded run (a user's surplus deferred below it); the redelivery stays
    assert [(p, o) for p, o, _, _ in pending.samples] == [(1, 1)]


def test_a_failed_publish_leaves_the_loop_at_its_last_recorded_step(tmp_path: Path) -> None:
    """The version's file fails halfway (a tensor the header did not announce): no record, no version folder,
    and the loop's version, lineage and offsets unchanged, so nothing a later checkpoint writes claims the step."""
    from services.trainer.parallel import ParallelLayout
    from services.trainer.safetensors_stream import Entry
    from services.trainer.worker import TrainerLoop

    class Failing:
        layout = ParallelLayout()

        def entries(self) -> list[Entry]:
            return [Entry("a", torch.float32, (2,))]

        def hf_stream(self):  # type: ignore[no-untyped-def]
            yield "b", torch.zeros(2)

        def version_files(self):  # type: ignore[no-untyped-def]
            from services.trainer.checkpoints import FULL_WEIGHTS

            return FULL_WEIGHTS

    cfg = Config(trainer=TrainerConfig(hf_checkpoint=str(tmp_path)))
    store = TrainerStore(tmp_path / "weights")
    loop = TrainerLoop(cfg, Failing(), store, str(tmp_path))  # type: ignore[arg-type]
    loop.offsets = {0: 4}
    with pytest.raises(ValueError, match="expected"):
        loop.persist([make_sample(i) for i in range(4)], {0: 8}, checkpoint=False)
    assert (loop.version, loop.trained, loop.offsets, loop.since_checkpoint) == (0, [], {0: 4}, 0)
    assert store.newest_version() == 0 and not (tmp_path / "weights" / "versions" / "v1").exists()


async def test_every_torch_call_of_the_trainer_runs_on_its_rank_thread(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading, resuming, training and publishing all run on the one thread bound to the rank's device (on a GPU,
    a call on any other thread would compute on cuda:0)."""
    import threading

    from services.trainer import rank_thread, worker
    from services.trainer.policy import Policy

    bound: list[int] = []
    monkeypatch.setattr(rank_thread, "bind_device", lambda rank: bound.append(threading.get_ident()))
    ran: dict[str, set[int]] = {}

    def recorded(name: str, fn: object) -> object:
        def call(*args: object, **kwargs: object) -> object:
            ran.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)  # type: ignore[operator]

        return call

    monkeypatch.setattr(Policy, "from_hf", staticmethod(recorded("from_hf", Policy.from_hf)))
    monkeypatch.setattr(Policy, "train", recorded("train", Policy.train))
    for name in ("resume", "persist", "stop"):
        monkeypatch.setattr(worker.TrainerLoop, name, recorded(name, getattr(worker.TrainerLoop, name)))
    await publish(kafka, [make_sample(i) for i in range(4)])
    await run(config(kafka, tiny_llama, tmp_path / "weights", max_steps=1))
    assert len(bound) == 1 and bound[0] != threading.get_ident()
    assert set(ran) == {"from_hf", "resume", "train", "persist", "stop"}
    assert all(threads == {bound[0]} for threads in ran.values()), ran


async def test_samples_longer_than_planned_are_cut_or_dropped_before_any_step(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    """``trainer.max_sample_tokens``: a longer sample never reaches a step. Under ``truncate`` its prompt's head is
    cut (trained, response aligned); a response longer than the limit is dropped and counted; the batch trains."""
    from prometheus_client import REGISTRY

    def count(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    dropped = count("turnstream_trainer_dropped_total", reason="too_long")
    truncated = count("turnstream_trainer_truncated_total")
    fits = [make_sample(i) for i in range(3)]  # 8-11 tokens
    long_prompt = msgspec.structs.replace(
        make_sample(3), sample_id="s0:long", tokens=[7] * 30 + make_sample(3).tokens
    )
    long_response = msgspec.structs.replace(
        make_sample(4),
        sample_id="s1:all-response",
        tokens=[5] * 2 + [9] * 20,
        response_length=20,
        loss_mask=[1] * 20,
        rollout_logprobs=[-6.0] * 20,
    )
    await publish(kafka, [*fits, long_response, long_prompt])
    out = tmp_path / "weights"
    await run(config(kafka, tiny_llama, out, max_steps=1, max_sample_tokens=16))
    assert sorted(lineage(out)) == sorted([*(s.sample_id for s in fits), "s0:long"])
    assert count("turnstream_trainer_dropped_total", reason="too_long") - dropped == 1
    assert count("turnstream_trainer_truncated_total") - truncated == 1
