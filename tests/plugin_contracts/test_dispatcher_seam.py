"""dispatcher.decide and a plugin's mode, through Kafka and Redis: the seam decides which turns become samples;
a decision outside the mode's kinds is dropped and counted; a decide that does not fit is refused at start."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from runtime.configuration.config import KafkaConfig, RedisConfig
from runtime.configuration.plugins import PluginError
from services.dispatcher.worker import Dispatcher, run_dispatcher
from tests.plugin_contracts import fixtures
from tests.services.dispatcher.conftest import (
    dispatcher_config,
    eval_judgment,
    publish,
    turn,
    wait_for_samples,
)
from tests.services.dispatcher.test_dispatcher import run_for

pytestmark = pytest.mark.integration
FIX = "tests.plugin_contracts.fixtures"
SCORES = [-1, 0, 1, 1, 0, -1, 1, 0, -1]


async def test_a_decide_plugin_chooses_the_samples(kafka: KafkaConfig, redis_config: RedisConfig) -> None:
    turns = [turn(i, session=f"d{i}") for i in range(len(SCORES))]
    await publish(kafka, [eval_judgment(t, s) for t, s in zip(turns, SCORES, strict=True)])
    config = dispatcher_config(kafka, redis_config, mode="rl", decide=f"{FIX}:decide_only_positive")
    samples = await run_for(config, expect=SCORES.count(1))
    # The built-in rule would also emit the -1 turns and, one per session, the 0 turns (at-least-one).
    assert sorted(s.sample_id for s in samples) == sorted(
        t.turn_id for t, s in zip(turns, SCORES, strict=True) if s == 1
    )
    assert {(s.mode, s.kind, s.reward) for s in samples} == {("rl", "rl", 1.0)}


async def test_a_plugin_mode_emits_its_own_kind_with_its_own_rule(
    kafka: KafkaConfig, redis_config: RedisConfig
) -> None:
    assert fixtures.STRICT_RL.name == "rl-strict"
    turns = [turn(i, session=f"m{i}") for i in range(len(SCORES))]
    await publish(kafka, [eval_judgment(t, s) for t, s in zip(turns, SCORES, strict=True)])
    samples = await run_for(dispatcher_config(kafka, redis_config, mode="rl-strict"), expect=6)
    want = {t.turn_id: float(s) for t, s in zip(turns, SCORES, strict=True) if s}
    assert {s.sample_id: s.reward for s in samples} == want, "no at-least-one sample for the eval-0 turns"
    assert {(s.mode, s.kind) for s in samples} == {("rl-strict", "rl-strict")}


async def test_a_decision_the_mode_does_not_emit_is_dropped_and_counted(
    kafka: KafkaConfig, redis_config: RedisConfig
) -> None:
    def dropped() -> float:
        return (
            REGISTRY.get_sample_value("turnstream_dispatcher_drops_total", {"reason": "invalid_kind"}) or 0.0
        )

    before = dropped()
    t = turn(1, session="x1")
    await publish(kafka, [eval_judgment(t, 1)])
    config = dispatcher_config(kafka, redis_config, mode="rl", decide=f"{FIX}:decide_unknown_kind")
    stop = asyncio.Event()
    task = asyncio.create_task(run_dispatcher(config, install_signals=False, stop=stop))
    try:
        deadline = time.monotonic() + 60
        while dropped() - before < 1:
            assert time.monotonic() < deadline and not task.done(), "the turn was never decided"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert dropped() - before == 1
    assert await wait_for_samples(kafka, lambda s: True) == []


def test_a_decide_that_does_not_fit_is_refused_at_start(
    kafka: KafkaConfig, redis_config: RedisConfig
) -> None:
    config = dispatcher_config(kafka, redis_config, decide=f"{FIX}:decide_without_session")
    with pytest.raises(
        PluginError, match=r"dispatcher\.decide: .*calls it with \(mode, eval_score, hint, has_sample\)"
    ):
        Dispatcher(config, None, None)  # type: ignore[arg-type]
