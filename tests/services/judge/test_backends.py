"""The engine backend's reading of a judge's answer: a reasoning judge's verdict inside its reasoning counts, and
an answer cut off at judge.max_tokens is counted."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from runtime.engine.client import EngineClient
from services.engine.launch import EngineProcess
from services.judge.backends import EngineBackend, _content
from services.judge.votes import parse_eval_vote, parse_hint_vote


def response(content: str | None, reasoning: str | None = None, finish: str = "stop") -> dict[str, Any]:
    """The shape of SGLang's ChatCompletionResponse (with a reasoning parser: reasoning_content)."""
    message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}]}


def test_a_verdict_given_only_in_the_reasoning_counts() -> None:
    text, _ = _content(response("The step worked.", reasoning="The user thanked it, so \\boxed{1}."))
    assert parse_eval_vote(text) == 1
    text, _ = _content(
        response(None, reasoning="Cut off while thinking... so far \\boxed{-1}", finish="length")
    )
    assert parse_eval_vote(text) == -1


def test_the_answer_wins_over_the_reasoning_when_it_has_a_verdict() -> None:
    text, _ = _content(
        response("\\boxed{1} [HINT_START]Use Celsius.[HINT_END]", reasoning="maybe \\boxed{-1}")
    )
    assert parse_hint_vote(text) == (1, "Use Celsius.")


@pytest.mark.integration
async def test_an_answer_cut_off_by_the_real_engine_is_counted(engine: EngineProcess) -> None:
    def truncated() -> float:
        return REGISTRY.get_sample_value("turnstream_judge_truncated_total", {"kind": "eval"}) or 0.0

    before = truncated()
    client = EngineClient(engine.url)
    backend = EngineBackend(client, model="", temperature=0.0, max_tokens=3, deadline_s=60)
    messages = [{"role": "user", "content": "Explain, at length, why the sky is blue."}]
    text = await backend.vote("eval", None, messages)  # type: ignore[arg-type]
    assert text and parse_eval_vote(text) is None
    assert truncated() - before == 1
