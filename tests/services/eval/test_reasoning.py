"""The evaluation behind a reasoning parser: with SGLang's ``--reasoning-parser qwen3`` (what the GPU recipes run
for Qwen3) a request that does not turn thinking off gets every word in ``reasoning_content`` and an empty
``content`` (SGLang 0.5.23 forces reasoning for qwen3 unless ``enable_thinking`` is false), so an evaluation
reading ``content`` scored empty answers for every version. Against a real SGLang server with the parser on."""

from __future__ import annotations

import httpx

from runtime.engine.client import EngineClient
from runtime.pipeline.personas import by_name
from services.engine.launch import EngineProcess
from services.eval import asking
from services.eval.set_runner import engine_asker
from services.eval.worker import Evaluator

QUESTION = "Name three colours."


async def test_eval_answers_behind_a_reasoning_parser_are_the_models_answers(
    reasoning_engine: EngineProcess,
) -> None:
    model = str(httpx.get(reasoning_engine.url + "/model_info", timeout=30).json()["model_path"])
    # What the evaluation sent before: the parser takes the whole answer as unfinished thinking.
    before = httpx.post(
        reasoning_engine.url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24,
            "temperature": 0,
        },
        timeout=120,
    ).json()
    message = before["choices"][0]["message"]
    assert asking.answer_text(before) == "" and message["reasoning_content"], message
    # The evaluation's request now: the same words, as the answer.
    evaluator = Evaluator(EngineClient(reasoning_engine.url), by_name(None), [QUESTION], 24, 1)
    served = await evaluator.served()
    assert served is not None and served[0] == 0
    result = await evaluator.evaluate(*served)
    assert result is not None
    answer = result.answers[0]
    assert answer.answer and answer.answer == message["reasoning_content"].strip()
    assert answer.completion_tokens > 0 and set(answer.satisfied) == {p.name for p in by_name(None)}
    # The evaluation sets' path asks the same way.
    from runtime.pipeline.evalsets import EvalCase

    ask = engine_asker(EngineClient(reasoning_engine.url), 24, False, 1)
    asked = await ask(EvalCase(checks=[], id="c", prompt=QUESTION), 0, model)
    assert asked is not None and asked[0] == answer.answer
