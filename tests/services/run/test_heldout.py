"""The run's held-out curve: every version's result read back from ``evals`` (the later of two for one version)
into ``heldout.json`` and a PNG, on the real broker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from runtime.configuration.config import Config, KafkaConfig
from runtime.messaging.bus import EventProducer
from runtime.pipeline.personas import PERSONAS
from schemas import EvalAnswer, EvalResult
from schemas.topics import EVALS
from services.eval.heldout import judged
from services.run.heldout import write_heldout

pytestmark = pytest.mark.integration


def result(version: int, answers: list[str]) -> EvalResult:
    judged_answers: list[EvalAnswer] = [judged(f"q{i}", a, PERSONAS) for i, a in enumerate(answers)]
    return EvalResult(
        version=version,
        question_set="heldout-test",
        answers=judged_answers,
        scores={p.name: sum(a.satisfied[p.name] for a in judged_answers) / len(answers) for p in PERSONAS},
        model="policy",
        evaluated_at=time.time(),
        mean_words=sum(len(a.split()) for a in answers) / len(answers),
    )


async def test_the_curve_holds_one_result_per_version_in_order(kafka: KafkaConfig, tmp_path: Path) -> None:
    long = "This answer goes on and on " * 8
    async with EventProducer(kafka) as producer:
        for event in (
            result(1, ["Short. Cheers!", long]),
            result(0, [long, long]),
            result(1, ["Short. Cheers!", "Plain."]),  # the later result for version 1 wins
        ):
            await producer.send(EVALS, event, str(event.version))
    assert await write_heldout(Config(kafka=kafka), tmp_path)
    rows = json.loads((tmp_path / "heldout.json").read_text())
    assert [r["version"] for r in rows] == [0, 1]
    assert rows[0]["scores"] == {"plain-short": 0.0, "sign-off": 0.0}
    assert rows[1]["scores"] == {"plain-short": 1.0, "sign-off": 0.5}
    assert (tmp_path / "heldout.png").read_bytes()[:4] == b"\x89PNG"


async def test_no_results_no_files(kafka: KafkaConfig, tmp_path: Path) -> None:
    assert await write_heldout(Config(kafka=kafka), tmp_path) == []
    assert not (tmp_path / "heldout.json").exists()
