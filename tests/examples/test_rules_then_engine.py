"""examples/plugins/rules_then_engine.py through the judge and dispatcher services, Kafka, Redis and the real
SGLang engine: where the rules fire their verdict stands, elsewhere the engine's, and that changes what is trained.

The engine judge here is SmolLM2-135M, led by a few-shot prompt to approve everything (an over-lenient LLM judge,
deterministic at temperature 0). Judged by it alone every turn becomes a +1 sample, a user's correction
included; judged by the plugin the corrections become -1 samples and the rest stay the engine's +1."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from runtime.configuration.config import Config, DispatcherConfig, JudgeConfig, KafkaConfig, RedisConfig
from runtime.messaging.topics import create_topics
from schemas import Judgment
from services.engine.launch import EngineProcess
from services.judge.worker import run_judge
from tests.services.dispatcher.test_dispatcher import run_for
from tests.services.judge.conftest import expected_keys, make_pairs, publish, wait_for_judgments

pytestmark = pytest.mark.integration
PLUGIN = "examples.plugins.rules_then_engine:RulesThenEngine"
APPROVE_EVERYTHING = (
    "Example answer: \\boxed{1}\nExample answer: \\boxed{1}\nExample answer: \\boxed{1}\nExample answer:"
)


async def judge(config: Config, done: Callable[[list[Judgment]], bool]) -> list[Judgment]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_judge(config, install_signals=False, stop=stop))
    try:
        return await wait_for_judgments(config.kafka, lambda js: done(js) or task.done(), 300)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def test_the_rules_overrule_a_lenient_engine_where_they_fire(
    kafka: KafkaConfig, redis_config: RedisConfig, engine: EngineProcess, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "eval.user.txt").write_text(APPROVE_EVERYTHING)
    (prompts / "eval.system.txt").write_text("You are a judge.")
    pairs = make_pairs(6)  # a correction, thanks, a neutral follow-up; twice
    said = {p.turn_id: str(p.next_state[0].content) for p in pairs if p.next_state}
    common = {
        "engine_url": engine.url,
        "prompts_dir": str(prompts),
        "temperature": 0.0,
        "max_tokens": 24,
        "m": 1,
    }
    verdicts: dict[str, dict[str, int | None]] = {}
    trained: dict[str, dict[str, float]] = {}
    for judge_id, backend in (("llm", "engine"), ("combo", PLUGIN)):
        # Each judge in a namespace of its own: its judgments, its samples.
        ns = msgspec.structs.replace(kafka, namespace=f"{kafka.namespace.rstrip('.')}-{judge_id}.")
        await create_topics(ns, partitions=3)
        await publish(ns, pairs)
        jc = msgspec.convert({"judge_id": judge_id, "backend": backend, **common}, JudgeConfig)
        want = expected_keys(pairs, [judge_id])
        found = await judge(Config(kafka=ns, judge=jc), lambda js, w=want: {j.key for j in js} >= w)
        verdicts[judge_id] = {j.turn_id: j.eval_score for j in found if j.kind == "eval"}
        dc = msgspec.convert(
            {"mode": "rl", "judge_ids": [judge_id], "sweep_interval_s": 0.2}, DispatcherConfig
        )
        redis = msgspec.structs.replace(redis_config, key_prefix=f"{redis_config.key_prefix}{judge_id}:")
        samples = await run_for(Config(kafka=ns, redis=redis, dispatcher=dc), expect=len(said))
        trained[judge_id] = {s.sample_id: s.reward for s in samples}

    assert set(verdicts["llm"].values()) == {1}, "the few-shot engine judge approves everything"
    rules = {t: -1 if text.startswith("No,") else 1 for t, text in said.items()}  # neutral: the rules abstain
    assert verdicts["combo"] == rules, "the rules' -1 and +1 where they fire, the engine's +1 elsewhere"
    assert trained["llm"] == dict.fromkeys(said, 1.0), "the engine alone trains every turn up"
    assert trained["combo"] == {t: float(r) for t, r in rules.items()}, "the corrections are trained down"
    assert -1.0 in trained["combo"].values()
