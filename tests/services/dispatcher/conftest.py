from __future__ import annotations

import random
import time
from collections.abc import Callable

import msgspec

from runtime.configuration.config import Config, DispatcherConfig, KafkaConfig, RedisConfig
from runtime.messaging.bus import EventProducer
from schemas import Event, Judgment, Message, PairedTurn, Sample, TeacherScores, Turn, Vote
from schemas.topics import JUDGMENTS, SAMPLES, TEACHER
from tests.kafka_wait import wait_for_events
from tests.strategies import example_turn


def turn(i: int, session: str | None = None) -> Turn:
    sid = session or f"s{i % 5}"
    n = 2 + i % 4
    return example_turn(
        sid,
        i + 1,
        prompt_token_ids=[1, 2, 3, 10 + i],
        response_token_ids=[100 + i + k for k in range(n)],
        response_logprobs=[-0.1 * (k + 1) for k in range(n)],
        weight_version=i % 3,
    )


def paired(t: Turn) -> PairedTurn:
    return PairedTurn(turn=t, next_state=[Message(role="user", content="next")], paired_at=time.time())


def eval_judgment(t: Turn, score: int, judge_id: str = "default") -> Judgment:
    return Judgment(
        turn_id=t.turn_id,
        session_id=t.session_id,
        judge_id=judge_id,
        kind="eval",
        votes=[Vote(raw=f"\\boxed{{{score}}}", score=score)],
        paired=paired(t),
        judge_model="rules",
        created_at=time.time(),
        eval_score=score,
    )


def hint_judgment(t: Turn, accepted: bool, judge_id: str = "default") -> Judgment:
    hint = f"hint for {t.turn_id}" if accepted else None
    return Judgment(
        turn_id=t.turn_id,
        session_id=t.session_id,
        judge_id=judge_id,
        kind="hint",
        votes=[Vote(raw="x", score=1 if accepted else -1, hint=hint or "")],
        paired=paired(t),
        judge_model="rules",
        created_at=time.time(),
        accepted=accepted,
        hint=hint,
    )


def teacher_scores(t: Turn, judge_id: str = "default") -> TeacherScores:
    n = len(t.response_token_ids)
    return TeacherScores(
        turn_id=t.turn_id,
        session_id=t.session_id,
        judge_id=judge_id,
        hint=f"hint for {t.turn_id}",
        teacher_model="teacher",
        response_token_ids=t.response_token_ids,
        teacher_logprobs=[-0.5 - k for k in range(n)],
        created_at=time.time(),
        topk_token_ids=[[7, 8]] * n,
        topk_logprobs=[[-0.5, -1.5]] * n,
    )


def inputs_for(t: Turn, score: int, accepted: bool) -> list[Event]:
    out: list[Event] = [eval_judgment(t, score), hint_judgment(t, accepted)]
    if accepted:
        out.append(teacher_scores(t))
    return out


async def publish(kafka: KafkaConfig, events: list[Event]) -> None:
    async with EventProducer(kafka) as producer:
        for ev in events:
            spec = TEACHER if isinstance(ev, TeacherScores) else JUDGMENTS
            await producer.send(spec, ev, ev.session_id)  # type: ignore[attr-defined]


def shuffled_with_duplicates(events: list[Event], seed: int = 7) -> list[Event]:
    rng = random.Random(seed)
    out = events + rng.sample(events, len(events) // 2)
    rng.shuffle(out)
    return out


def dispatcher_config(kafka: KafkaConfig, redis: RedisConfig, **dispatcher: object) -> Config:
    return Config(
        kafka=kafka,
        redis=redis,
        dispatcher=msgspec.convert({"sweep_interval_s": 0.2, **dispatcher}, DispatcherConfig),
    )


async def wait_for_samples(
    kafka: KafkaConfig, done: Callable[[list[Sample]], bool], timeout: float = 60.0
) -> list[Sample]:
    return await wait_for_events(kafka, SAMPLES, done, timeout)
