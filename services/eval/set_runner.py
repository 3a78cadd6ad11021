"""Running an evaluation set (``runtime/pipeline/evalsets.py``) against one weight version of the policy engine.

The cases go straight to the engine (never through the proxy: they must not become training traffic), greedy, like
the held-out set. With LoRA adapters any loaded version is addressed by its adapter name, so a candidate can be
evaluated beside the served one; with full weights only the version the engine serves can be. Every answer must
come from the version asked for (the engine reports which version made each token), else the run fails rather than
score a mixture. Rubric checks ask the judge engine (``judge.engine_url``), greedily, for YES or NO; an answer that
is neither fails the check and is counted (``turnstream_eval_rubric_unclear_total``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

from runtime.configuration.config import Config
from runtime.engine.client import EngineClient, EngineError, adapter_name, weight_versions
from runtime.pipeline.evalsets import RUBRIC_PROMPT, EvalCase, EvalSet, Rubric, scored, set_result, verdict
from schemas import EvalAnswer, EvalResult
from services.eval import asking

log = logging.getLogger("turnstream.eval")

UNCLEAR = Counter(
    "turnstream_eval_rubric_unclear_total", "Rubric checks whose judge answered neither YES nor NO (failed)"
)


class SetRunError(RuntimeError):
    """The set could not be scored for the version asked (not loaded, the engine moved on, no answer)."""


Ask = Callable[[EvalCase, int, str], Awaitable[tuple[str, int] | None]]
"""``ask(case, version, model)``: the greedy answer text and its token count, or None when another version
answered."""


def engine_asker(
    engine: EngineClient | Callable[[], EngineClient],
    max_tokens: int,
    adapters: bool,
    concurrency: int,
    thinking: bool = False,
) -> Ask:
    """Asks ``engine`` (or the one it returns when called: the replica the held-out evaluation is on)."""
    limit = asyncio.Semaphore(concurrency)

    async def ask(case: EvalCase, version: int, model: str) -> tuple[str, int] | None:
        body = asking.request(model, case.conversation(), case.max_tokens or max_tokens, thinking)
        if adapters and version:
            body["lora_path"] = adapter_name(version)
        client = engine if isinstance(engine, EngineClient) else engine()
        async with limit:  # greedy: a retried request gets the same answer
            data = await client.chat_raw(body, idempotent=True)
        if weight_versions(data) != ({0} if adapters else {version}):
            return None
        return asking.answer_text(data), int((data.get("usage") or {}).get("completion_tokens", 0))

    return ask


def engine_rubric(judge: EngineClient, model: str) -> Rubric:
    async def rubric(statement: str, question: str, answer: str) -> bool:
        body = {
            "model": model or "default",
            "messages": [
                {
                    "role": "user",
                    "content": RUBRIC_PROMPT.format(rubric=statement, question=question, answer=answer),
                }
            ],
            "max_tokens": 8,
            "temperature": 0,
        }
        data = await judge.chat_raw(body, idempotent=True)
        said = verdict(str(data["choices"][0]["message"].get("content") or ""))
        if said is None:
            UNCLEAR.inc()
            log.warning(
                "a rubric's judge answered neither YES nor NO; the check fails", extra={"rubric": statement}
            )
        return bool(said)

    return rubric


async def run_set(evalset: EvalSet, version: int, model: str, ask: Ask, rubric: Rubric | None) -> EvalResult:
    """Every case of ``evalset`` answered by ``version`` and scored; raises SetRunError if another version
    answered any."""
    started = time.monotonic()

    async def one(case: EvalCase) -> EvalAnswer:
        answered = await ask(case, version, model)
        if answered is None:
            raise SetRunError(f"the engine answered {evalset.name} with another version than {version}")
        text, tokens = answered
        return await scored(case, text, tokens, rubric)

    try:
        answers = await asyncio.gather(*(one(c) for c in evalset.cases))
    except EngineError as exc:
        raise SetRunError(f"the engine failed on {evalset.name}: {exc}") from exc
    return set_result(version, evalset, answers, model, started)


async def pick_version(engine: EngineClient, adapters: bool, wanted: int | None) -> tuple[int, str]:
    """(version, model) to evaluate: ``wanted`` (with adapters: any loaded one; with full weights: only the served
    one), or the served version when None."""
    try:
        info = await engine.model_info()
        model = str(info.get("served_model_name") or info.get("model_path") or "default")
        if adapters:
            loaded = await engine.adapter_versions()
            version = max(loaded, default=0) if wanted is None else wanted
            if version and version not in loaded:
                raise SetRunError(f"version {version} is not loaded on the engine (loaded: {sorted(loaded)})")
            return version, model
    except EngineError as exc:
        raise SetRunError(f"the policy engine does not answer: {exc}") from exc
    served = str(info.get("weight_version", ""))
    if not served.isdigit():
        raise SetRunError(f"the engine reports no integer weight version ({served!r})")
    if wanted is not None and wanted != int(served):
        raise SetRunError(
            f"the engine serves version {served}; with full weights only the served version can be evaluated"
        )
    return int(served), model


def judge_client(config: Config) -> tuple[EngineClient, str]:
    jc = config.judge
    return EngineClient(jc.engine_url, api_key=jc.api_key, timeout_s=config.engine.timeout_s), jc.model


async def evaluate_sets(
    config: Config, sets: list[EvalSet], version: int | None = None, *, publish: bool = True
) -> list[EvalResult]:
    """``turnstream eval --set``: each set scored for one version (default: the served one), each result published
    to ``evals`` (keyed by version, as the held-out results) unless ``publish`` is off."""
    from runtime.engine.client import close_engine_pool
    from runtime.messaging.bus import EventProducer
    from schemas.topics import EVALS

    ec = config.eval
    engine = EngineClient(
        ec.engine_url or config.engine.urls[0],
        api_key=config.engine.api_key,
        timeout_s=config.engine.timeout_s,
    )
    needs_judge = any(c.rubric is not None for s in sets for case in s.cases for c in case.checks)
    judge, judge_model = judge_client(config) if needs_judge else (None, "")
    try:
        picked, model = await pick_version(engine, config.lora_adapters, version)
        ask = engine_asker(engine, ec.max_tokens, config.lora_adapters, ec.concurrency)
        rubric = engine_rubric(judge, judge_model) if judge is not None else None
        results = [await run_set(s, picked, model, ask, rubric) for s in sets]
        if publish:
            async with EventProducer(config.kafka, client_id=f"{config.kafka.client_id}-eval") as producer:
                for r in results:
                    await producer.send(EVALS, r, str(r.version))
        return results
    finally:
        await close_engine_pool()
