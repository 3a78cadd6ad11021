"""``turnstream gate`` against the real broker: announced versions become candidates, a candidate as good as the
promoted version is promoted, a worse one is rolled back (serve-then-check), and a restarted gate decides nothing
again. The evaluations are written here as the eval service writes them (its own tests run it on SGLang)."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime.configuration.config import Config, GateConfig, KafkaConfig
from runtime.messaging.bus import EventProducer, read_topic
from runtime.pipeline.evalsets import question_set_id
from runtime.pipeline.personas import heldout_questions
from runtime.pipeline.promotion import fold
from schemas import EvalAnswer, EvalResult, VersionDecision, WeightsPublished
from schemas.topics import EVALS, VERSIONS, WEIGHTS
from services.gate.worker import run_gate
from tests.kafka_wait import wait_for_events

pytestmark = pytest.mark.integration


def held(version: int, met: int, of: int = 4) -> EvalResult:
    answers = [EvalAnswer(f"q{i}", "a", {"plain-short": i < met, "sign-off": False}) for i in range(of)]
    return EvalResult(
        version=version,
        question_set=question_set_id(heldout_questions()),
        answers=answers,
        scores={"plain-short": met / of, "sign-off": 0.0},
        model="smollm2",
        evaluated_at=time.time(),
    )


def announced(version: int) -> WeightsPublished:
    return WeightsPublished(
        version=version, path=f"/w/v{version}", base_model="smollm2", step=version, created_at=time.time(),
        figures={"kl_rollout": 0.01 * version},
    )  # fmt: skip


async def decisions(kafka: KafkaConfig, count: int) -> list[VersionDecision]:
    return await wait_for_events(kafka, VERSIONS, lambda ds: len(ds) >= count, 60)


async def test_the_gate_promotes_a_good_candidate_and_rolls_back_a_worse_one(kafka: KafkaConfig) -> None:
    config = Config(
        kafka=kafka, gate=GateConfig(enabled=True, mechanism="serve-then-check", margin=0.1, poll_s=0.2)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(run_gate(config, install_signals=False, stop=stop))
    try:
        async with EventProducer(kafka) as producer:
            await producer.send(EVALS, held(0, 2), "0")
            await producer.send(WEIGHTS, announced(1), "policy")
            first = await decisions(kafka, 1)
            assert [(d.version, d.state) for d in first] == [(1, "candidate")]
            assert first[0].figures == {"kl_rollout": 0.01} and first[0].path == "/w/v1"
            await producer.send(EVALS, held(1, 3), "1")  # better than version 0
            promoted = await decisions(kafka, 2)
            assert (promoted[1].version, promoted[1].state, promoted[1].against) == (1, "promoted", 0)
            await producer.send(WEIGHTS, announced(2), "policy")
            await producer.send(EVALS, held(2, 2), "2")  # 0.5 against version 1's 0.75, margin 0.1
            rolled = await decisions(kafka, 4)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert [(d.version, d.state) for d in rolled] == [
        (1, "candidate"),
        (1, "promoted"),
        (2, "candidate"),
        (2, "rolled_back"),
    ]
    assert "plain-short 0.500 < 0.650" in rolled[3].reason and rolled[3].against == 1
    assert fold(rolled).serving == 1 and fold(rolled).failed_streak == 1
    # Restarted, it reads the same history and decides nothing again.
    stop = asyncio.Event()
    task = asyncio.create_task(run_gate(config, install_signals=False, stop=stop))
    await asyncio.sleep(2)
    stop.set()
    await asyncio.wait_for(task, 30)
    assert [r.event async for r in read_topic(kafka, VERSIONS)] == rolled


async def test_the_gate_refuses_to_start_switched_off(kafka: KafkaConfig) -> None:
    with pytest.raises(SystemExit, match=r"gate\.enabled is off"):
        await run_gate(Config(kafka=kafka), install_signals=False)


async def test_a_standby_gate_switched_off_stays_up_and_decides_nothing(kafka: KafkaConfig) -> None:
    """Compose runs ``turnstream gate --standby`` always: with the gate off it must neither exit (a restart loop)
    nor decide anything, whatever is published and evaluated."""
    async with EventProducer(kafka) as producer:
        await producer.send(WEIGHTS, announced(1), "policy")
        await producer.send(EVALS, held(0, 4), "0")
        await producer.send(EVALS, held(1, 0), "1")
    stop = asyncio.Event()
    config = Config(kafka=kafka, gate=GateConfig(poll_s=0.2))
    task = asyncio.create_task(run_gate(config, install_signals=False, stop=stop, standby=True))
    await asyncio.sleep(3)  # fifteen polls of an enabled gate
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 10)
    assert [r async for r in read_topic(kafka, VERSIONS)] == []
