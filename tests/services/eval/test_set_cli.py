"""``turnstream eval --set FILE`` as a user runs it, against the real SGLang server (the policy, and the same server
as the rubric's judge) and broker: the shipped example set is scored for the served version, the printed scores
are the checks of the answers the engine gave, the result is on ``evals``, wrong requests are refused, and the eval
service scores its sets for each version beside the held-out set."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.configuration.config import (
    Config,
    EngineConfig,
    EvalConfig,
    JudgeConfig,
    KafkaConfig,
    RedisConfig,
)
from runtime.messaging.bus import read_topic
from runtime.pipeline.evalsets import load_set, passes
from runtime.pipeline.personas import heldout_questions
from schemas import EvalResult
from schemas.topics import EVALS
from services.engine.launch import EngineProcess
from services.eval.heldout import question_set_id
from services.eval.worker import run_eval
from tests.kafka_wait import wait_for_events

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "evalsets" / "personas.jsonl"


def turnstream_eval(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "eval", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TURNSTREAM_LOGGING_FORMAT": "text", **env},
    )


@pytest.fixture
def env(kafka: KafkaConfig, engine: EngineProcess) -> dict[str, str]:
    return {
        **kafka.client_env(),
        "TURNSTREAM_KAFKA_SEAL_KEYS_URL": kafka.seal_keys_url,
        "TURNSTREAM_ENGINE_URL": engine.url,
        "TURNSTREAM_JUDGE_ENGINE_URL": engine.url,
        "TURNSTREAM_EVAL_MAX_TOKENS": "24",
    }


async def test_the_example_set_is_scored_for_the_served_version_and_published(
    env: dict[str, str], kafka: KafkaConfig
) -> None:
    done = turnstream_eval(env, "--set", str(EXAMPLE))
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [json.loads(x) for x in done.stdout.splitlines()]
    evalset = load_set(EXAMPLE)
    assert (line["set"], line["question_set"], line["version"], line["cases"]) == (
        "personas",
        evalset.set_id,
        0,
        8,
    )
    assert set(line["scores"]) == {"correct", "helpful", "plain-short", "sign-off"}
    (published,) = [r.event async for r in read_topic(kafka, EVALS)]
    assert isinstance(published, EvalResult) and published.question_set == evalset.set_id
    assert published.scores == line["scores"]
    # Every outcome is the check of the answer the engine gave (the rubric's is the judge's: not recomputed here).
    for case, answer in zip(evalset.cases, published.answers, strict=True):
        assert answer.question == case.id and answer.answer
        for check in case.checks:
            if check.rubric is None:
                assert answer.satisfied[check.label] == await passes(check, answer.answer, case, None)
        assert answer.completion_tokens <= 24


def test_wrong_requests_are_refused_with_the_reason(env: dict[str, str], tmp_path: Path) -> None:
    moved = turnstream_eval(env, "--set", str(EXAMPLE), "--version", "3", "--no-publish")
    assert moved.returncode == 2
    assert "only the served version can be evaluated" in moved.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "hi", "checks": [{"contains": "x"}]}\n{"prompt": "hi", "checks": [{"regex": "("}]}\n'
    )
    refused = turnstream_eval(env, "--set", str(bad))
    assert refused.returncode == 2
    assert f"{bad}:2" in refused.stderr and "regex" in refused.stderr


async def test_the_eval_service_scores_its_sets_for_each_version_beside_the_heldout_set(
    kafka: KafkaConfig, redis_config: RedisConfig, engine: EngineProcess
) -> None:
    config = Config(
        kafka=kafka,
        redis=redis_config,
        engine=EngineConfig(url=engine.url),
        judge=JudgeConfig(engine_url=engine.url),
        eval=EvalConfig(poll_s=0.5, max_tokens=16, sets=[str(EXAMPLE)], hold_reload_s=0),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(run_eval(config, install_signals=False, stop=stop))
    try:
        found: list[EvalResult] = await wait_for_events(kafka, EVALS, lambda rs: len(rs) >= 2, 300)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert [(r.version, r.question_set) for r in found] == [
        (0, load_set(EXAMPLE).set_id),  # the set first: the held-out result marks the version done
        (0, question_set_id(heldout_questions())),
    ]
    assert found[0].scores.keys() == {"correct", "helpful", "plain-short", "sign-off"}
