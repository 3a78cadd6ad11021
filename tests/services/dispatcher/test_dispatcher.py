"""The dispatcher against the real broker and Redis: shuffled, duplicated inputs give exactly one sample per
qualifying turn with the right kind, reward and teacher log-probs, in every mode; the rl at-least-one rule; several
judges by majority; incomplete turns time out (counted, never emitted later); stale claims left by a dead
dispatcher are resolved without loss or duplication."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import msgspec
import pytest
from prometheus_client import REGISTRY

from runtime.configuration.config import Config, KafkaConfig, RedisConfig
from runtime.messaging.bus import EventProducer, read_topic
from schemas import Event, Sample
from schemas.topics import DEADLETTER, SAMPLES
from services.dispatcher.join import JoinStore
from services.dispatcher.rules import decide
from services.dispatcher.worker import run_dispatcher
from tests.services.dispatcher.conftest import (
    dispatcher_config,
    eval_judgment,
    hint_judgment,
    inputs_for,
    publish,
    shuffled_with_duplicates,
    teacher_scores,
    turn,
    wait_for_samples,
)

pytestmark = pytest.mark.integration


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def run_for(config: Config, expect: int, settle_s: float = 2.0, timeout: float = 60) -> list[Sample]:
    """Run the dispatcher until ``expect`` samples exist, then a little longer: duplicates would show up."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_dispatcher(config, install_signals=False, stop=stop))
    try:
        await wait_for_samples(config.kafka, lambda s: len(s) >= expect or task.done(), timeout)
        await asyncio.sleep(settle_s)
        return await wait_for_samples(config.kafka, lambda s: True)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


CASES = [((-1, 0, 1)[i % 3], (i // 3) % 2 == 0) for i in range(24)]


@pytest.mark.parametrize("mode", ["combine", "opd", "rl"])
async def test_shuffled_duplicated_inputs_give_one_sample_per_qualifying_turn(
    kafka: KafkaConfig, redis_config: RedisConfig, mode: str
) -> None:
    turns = [turn(i, session=f"s{i}") for i in range(len(CASES))]  # one turn per session
    events: list[Event] = []
    for t, (score, accepted) in zip(turns, CASES, strict=True):
        events += inputs_for(t, score, accepted)
    await publish(kafka, shuffled_with_duplicates(events))
    want = {
        t.turn_id: (kind, score, accepted)
        for t, (score, accepted) in zip(turns, CASES, strict=True)
        # Each session's only turn: in rl mode an eval-0 turn gets the at-least-one sample (reward 0).
        if (kind := decide(mode, score, accepted, session_has_effective_sample=False)) is not None
    }
    samples = await run_for(dispatcher_config(kafka, redis_config, mode=mode), len(want))
    assert Counter(s.sample_id for s in samples) == Counter(want.keys()), (
        "exactly one sample per qualifying turn"
    )
    by_id = {t.turn_id: t for t in turns}
    for s in samples:
        kind, score, accepted = want[s.sample_id]
        t = by_id[s.sample_id]
        assert s.kind == kind and s.mode == mode and s.session_id == t.session_id
        assert s.tokens == t.prompt_token_ids + t.response_token_ids
        assert s.response_length == len(t.response_token_ids) and s.loss_mask == [1] * s.response_length
        assert s.rollout_logprobs == t.response_logprobs and s.weight_version == t.weight_version
        assert s.reward == (0.0 if kind in ("opd", "opd-only") else float(score))
        if kind in ("opd", "opd+rl", "opd-only"):
            ts = teacher_scores(t)
            assert s.teacher_logprobs == ts.teacher_logprobs and s.topk_token_ids == ts.topk_token_ids
        elif kind == "rl-only":
            assert s.teacher_logprobs == t.response_logprobs, "OPD term exactly zero"
        else:
            assert s.teacher_logprobs is None


async def test_rl_at_least_one_sample_per_session(kafka: KafkaConfig, redis_config: RedisConfig) -> None:
    quiet = [turn(i, session="quiet") for i in range(3)]  # every eval 0: one reward-0 sample
    lively = [turn(10 + i, session="lively") for i in range(3)]  # +1 first, then zeros: no zero samples
    await publish(kafka, [eval_judgment(t, 0) for t in quiet])
    await publish(kafka, [eval_judgment(lively[0], 1)] + [eval_judgment(t, 0) for t in lively[1:]])
    samples = await run_for(dispatcher_config(kafka, redis_config, mode="rl"), 2)
    assert sorted((s.session_id, s.reward) for s in samples) == [("lively", 1.0), ("quiet", 0.0)]
    assert next(s for s in samples if s.session_id == "quiet").sample_id == quiet[0].turn_id


async def test_combine_without_eval_votes_is_opd_only(kafka: KafkaConfig, redis_config: RedisConfig) -> None:
    """judge.eval_mode off (OpenClaw's OPENCLAW_EVAL_MODE=0): no eval judgment ever comes, so the dispatcher must
    not wait for one (it used to, and dropped every turn after the join timeout); OpenClaw degrades to OPD."""
    accepted, rejected = turn(1, "e1"), turn(2, "e2")
    await publish(
        kafka, [hint_judgment(accepted, True), teacher_scores(accepted), hint_judgment(rejected, False)]
    )
    config = dispatcher_config(kafka, redis_config, mode="combine", join_timeout_s=3600)
    config = msgspec.structs.replace(config, judge=msgspec.structs.replace(config.judge, eval_mode=False))
    samples = await run_for(config, 1)
    assert [(s.sample_id, s.kind, s.reward) for s in samples] == [(accepted.turn_id, "opd-only", 0.0)]


async def test_the_top_k_mode_emits_distillation_samples_with_the_teachers_top_k(
    kafka: KafkaConfig, redis_config: RedisConfig
) -> None:
    accepted, rejected = turn(1, "k1"), turn(2, "k2")
    await publish(
        kafka, [hint_judgment(accepted, True), teacher_scores(accepted), hint_judgment(rejected, False)]
    )
    samples = await run_for(dispatcher_config(kafka, redis_config, mode="opd-topk"), 1)
    assert [(s.sample_id, s.mode, s.kind, s.reward) for s in samples] == [
        (accepted.turn_id, "opd-topk", "opd-topk", 0.0)
    ]
    assert samples[0].topk_token_ids == teacher_scores(accepted).topk_token_ids


async def test_several_judges_by_majority(kafka: KafkaConfig, redis_config: RedisConfig) -> None:
    # a and b share a session and a comes first, so b's tie (0) is not the session's at-least-one sample.
    a, b, c = turn(1, "m1"), turn(2, "m1"), turn(3, "m3")
    votes = [(a, (1, 1, -1)), (b, (1, -1, 0)), (c, (-1, -1, 1))]  # majority 1, tie -> 0 (no sample), -1
    events: list[Event] = []
    for t, scores in votes:
        events += [eval_judgment(t, s, judge_id=j) for s, j in zip(scores, "xyz", strict=True)]
    events.append(eval_judgment(turn(4, "m4"), 1, judge_id="x"))  # y and z never judge it: stays open
    await publish(kafka, events)
    config = dispatcher_config(
        kafka, redis_config, mode="rl", judge_ids=["x", "y", "z"], judge_combine="majority"
    )
    samples = await run_for(config, 2)
    assert sorted((s.sample_id, s.reward) for s in samples) == [(a.turn_id, 1.0), (c.turn_id, -1.0)]


async def test_incomplete_turn_is_dropped_after_the_timeout_and_never_emitted_late(
    kafka: KafkaConfig, redis_config: RedisConfig
) -> None:
    late, done = turn(1, "late"), turn(2, "done")
    await publish(kafka, [eval_judgment(late, 1), *inputs_for(done, 1, False)])  # late misses its hint
    before = metric("turnstream_dispatcher_drops_total", reason="timeout")
    config = dispatcher_config(kafka, redis_config, mode="combine", join_timeout_s=1.5)
    stop = asyncio.Event()
    task = asyncio.create_task(run_dispatcher(config, install_signals=False, stop=stop))
    try:
        deadline = time.monotonic() + 30
        while metric("turnstream_dispatcher_drops_total", reason="timeout") < before + 1:
            assert time.monotonic() < deadline, "the incomplete turn was never dropped"
            await asyncio.sleep(0.2)
        await publish(kafka, [hint_judgment(late, False)])  # the missing input, too late
        await asyncio.sleep(2)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    samples = await wait_for_samples(kafka, lambda s: True)
    assert [s.sample_id for s in samples] == [done.turn_id]
    assert metric("turnstream_dispatcher_drops_total", reason="timeout") == before + 1


async def test_a_young_claim_of_a_dead_dispatcher_is_waited_out_not_dead_lettered(
    kafka: KafkaConfig, redis_config: RedisConfig, redis_client: object
) -> None:
    """A dispatcher killed right after claiming a turn (the five-kill fault rig): its successor sees a claim younger
    than the lease, retries until the lease runs out (longer than the bus's three tries and their back-off), then
    finds no sample and emits it."""
    lost = turn(1, "y")
    store = JoinStore(redis_client, redis_config.key_prefix, join_ttl_s=3600, dedupe_ttl_s=3600)  # type: ignore[arg-type]
    assert (await store.claim(lost.turn_id, "dead1dispatch", int(time.time() * 1000)))[0]
    config = dispatcher_config(kafka, redis_config, mode="rl", claim_lease_s=8)
    await publish(kafka, [eval_judgment(lost, 1)])
    samples = await run_for(config, 1, timeout=40)
    assert [s.sample_id for s in samples] == [lost.turn_id]
    assert await store.decision(lost.turn_id) == "emitted"
    assert [r.event async for r in read_topic(kafka, DEADLETTER)] == []


async def test_stale_claims_of_a_dead_dispatcher_are_resolved_once(
    kafka: KafkaConfig, redis_config: RedisConfig, redis_client: object
) -> None:
    """A dispatcher died after claiming two turns: it had produced the sample of one and not of the other."""
    produced, lost = turn(1, "p"), turn(2, "l")
    store = JoinStore(redis_client, redis_config.key_prefix, join_ttl_s=3600, dedupe_ttl_s=3600)  # type: ignore[arg-type]
    stale_ms = int(time.time() * 1000) - 120_000
    for t in (produced, lost):
        assert (await store.claim(t.turn_id, "dead0dispatch", stale_ms))[0]
    config = dispatcher_config(kafka, redis_config, mode="rl", claim_lease_s=30)
    # The dead dispatcher's sample of `produced` did reach the topic.
    async with EventProducer(kafka) as producer:
        first = Sample(
            sample_id=produced.turn_id,
            session_id="p",
            mode="rl",
            kind="rl",
            tokens=produced.prompt_token_ids + produced.response_token_ids,
            response_length=len(produced.response_token_ids),
            loss_mask=[1] * len(produced.response_token_ids),
            rollout_logprobs=produced.response_logprobs,
            reward=1.0,
            weight_version=produced.weight_version,
            created_at=time.time(),
        )
        await producer.send(SAMPLES, first, "p")
    # Their inputs are redelivered (the dead dispatcher never committed them).
    await publish(kafka, [eval_judgment(produced, 1), eval_judgment(lost, -1)])
    samples = await run_for(config, 2)
    assert Counter(s.sample_id for s in samples) == {produced.turn_id: 1, lost.turn_id: 1}
    assert next(s for s in samples if s.sample_id == lost.turn_id).reward == -1.0
    assert (
        await store.decision(produced.turn_id) == "emitted"
        and await store.decision(lost.turn_id) == "emitted"
    )
