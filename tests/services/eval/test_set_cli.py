"""``turnstream eval --set FILE`` as a user runs it, against the real SGLang server (the policy, and the same server
as the rubric's judge) and broker: the shipped example set is scored for the served version, the printed scores
are the checks of the answers the engine gave, the result is on ``evals``, and wrong requests are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas import EvalResult
from schemas.topics import EVALS
from services.bus import read_topic
from services.config import KafkaConfig
from services.engine.launch import EngineProcess
from services.evalsets import load_set, passes

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
        "TURNSTREAM_KAFKA_BOOTSTRAP": kafka.bootstrap,
        "TURNSTREAM_KAFKA_NAMESPACE": kafka.namespace,
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
