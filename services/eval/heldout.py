"""The held-out evaluation's arithmetic: a fixed question set that training traffic never asks, and each answer
scored by every persona's own preference check (``runtime/pipeline/personas.py``). Pure: the worker asks the engine."""

from __future__ import annotations

import time
from collections.abc import Sequence

from runtime.pipeline.evalsets import question_set_id
from runtime.pipeline.personas import Persona
from schemas import EvalAnswer, EvalResult

__all__ = ["judged", "question_set_id", "result"]


def judged(question: str, answer: str, personas: Sequence[Persona], completion_tokens: int = 0) -> EvalAnswer:
    return EvalAnswer(
        question=question,
        answer=answer,
        satisfied={p.name: p.satisfied(answer) for p in personas},
        completion_tokens=completion_tokens,
    )


def result(
    version: int,
    questions: Sequence[str],
    answers: Sequence[EvalAnswer],
    personas: Sequence[Persona],
    model: str,
    started: float,
) -> EvalResult:
    """The event for one version: each persona's score is the share of answers meeting its preference."""
    n = len(answers)
    return EvalResult(
        version=version,
        question_set=question_set_id(questions),
        answers=list(answers),
        scores={p.name: sum(a.satisfied[p.name] for a in answers) / n for p in personas},
        model=model,
        evaluated_at=time.time(),
        duration_s=max(0.0, time.monotonic() - started),
        mean_words=sum(len(a.answer.split()) for a in answers) / n,
    )
