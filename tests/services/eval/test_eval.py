"""``turnstream eval`` against the real SGLang server and broker: one held-out result per version the engine
serves, none twice across a restart, every answer from that version, scores equal to the personas' checks of the
same answers, and answers the engine gives again to the same greedy question."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from runtime.configuration.config import Config, EngineConfig, EvalConfig, KafkaConfig, RedisConfig
from runtime.messaging.bus import read_topic
from runtime.pipeline.personas import PERSONAS, heldout_questions, questions
from schemas import EvalResult
from schemas.topics import EVALS
from services.engine.launch import EngineProcess
from services.eval.heldout import judged, question_set_id
from services.eval.worker import run_eval
from tests.engines import admin

pytestmark = pytest.mark.integration


def test_the_heldout_set_is_disjoint_from_training_traffic() -> None:
    held, training = heldout_questions(), questions()
    assert len(held) >= 12 and len(set(held)) == len(held)
    assert not set(held) & set(training)
    assert question_set_id(held) != question_set_id(held[:-1])


async def results(kafka: KafkaConfig) -> list[EvalResult]:
    return [r.event async for r in read_topic(kafka, EVALS)]


async def wait_for(kafka: KafkaConfig, versions: list[int], within_s: float = 300) -> list[EvalResult]:
    deadline = time.monotonic() + within_s
    while True:
        found = await results(kafka)
        if sorted(r.version for r in found) == versions or time.monotonic() > deadline:
            return found
        await asyncio.sleep(1)


async def test_one_result_per_served_version_scored_by_the_personas(
    kafka: KafkaConfig, redis_config: RedisConfig, own_engine: EngineProcess, smollm2_path: Path
) -> None:
    config = Config(
        kafka=kafka,
        redis=redis_config,
        engine=EngineConfig(url=own_engine.url),
        eval=EvalConfig(poll_s=0.5, max_tokens=24),
    )
    stop = asyncio.Event()
    store = aioredis.from_url(redis_config.url)
    task = asyncio.create_task(run_eval(config, install_signals=False, stop=stop))
    try:
        hold = redis_config.eval_hold_key(0)
        deadline = time.monotonic() + 120
        while not await store.exists(hold):  # reloads are held while version 0 is evaluated
            assert time.monotonic() < deadline and not await results(kafka), "no hold during the evaluation"
            await asyncio.sleep(0.05)
        assert 0 < await store.pttl(hold) <= 300_000
        first = await wait_for(kafka, [0])
        assert [r.version for r in first] == [0], first
        assert not await store.exists(hold), "the hold outlived its evaluation"
        async with httpx.AsyncClient(timeout=600) as http:
            loaded = await http.post(
                own_engine.url + "/update_weights_from_disk",
                json={"model_path": str(smollm2_path), "weight_version": "1"},
                headers=admin(own_engine),
            )
            assert loaded.status_code == 200, loaded.text
        both = await wait_for(kafka, [0, 1])
        assert sorted(r.version for r in both) == [0, 1]
    finally:
        stop.set()
        await asyncio.wait_for(task, 120)
        await store.aclose()
    # A restart evaluates nothing twice: version 1 is still served, and has its result.
    stop = asyncio.Event()
    task = asyncio.create_task(run_eval(config, install_signals=False, stop=stop))
    await asyncio.sleep(5)
    stop.set()
    await asyncio.wait_for(task, 120)
    final = await results(kafka)
    assert sorted(r.version for r in final) == [0, 1], "exactly one result per version"

    held = heldout_questions()
    for r in final:
        assert r.question_set == question_set_id(held) and [a.question for a in r.answers] == held
        for a in r.answers:  # the scores are the personas' own checks of these answers
            assert a == judged(a.question, a.answer, PERSONAS, a.completion_tokens)
        for p in PERSONAS:
            assert r.scores[p.name] == sum(p.satisfied(a.answer) for a in r.answers) / len(r.answers)
    # Greedy answers are the engine's: the same question asked again gives the recorded text.
    v1 = next(r for r in final if r.version == 1)
    async with httpx.AsyncClient(timeout=300) as http:
        again = await http.post(
            own_engine.url + "/v1/chat/completions",
            json={
                "model": v1.model,
                "messages": [{"role": "user", "content": held[0]}],
                "max_tokens": 24,
                "temperature": 0,
            },
        )
    assert again.json()["choices"][0]["message"]["content"].strip() == v1.answers[0].answer
    assert any(a.answer for a in v1.answers) and v1.mean_words > 0
