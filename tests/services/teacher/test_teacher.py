"""The teacher worker against the CPU engine and the real broker: its log-probs equal a transformers forward pass
over the enhanced prompt plus the response, position by position; a hint makes an off-hint response less likely;
top-K matches; a request the engine rejects is dead-lettered while the rest are scored."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from runtime.configuration.config import Config, KafkaConfig, TeacherConfig
from runtime.engine.client import EngineClient
from runtime.messaging.bus import EventProducer, read_topic, transient
from schemas import DeadLetter, Judgment, Message, PairedTurn, TeacherScores, Turn, Vote
from schemas.topics import DEADLETTER, JUDGMENTS, TEACHER
from services.engine.launch import EngineProcess
from services.teacher.worker import TeacherUnavailable, run_teacher
from tests.kafka_wait import wait_for_events

pytestmark = pytest.mark.integration

HINT = "Answer in one word."
HINT_BLOCK = "\n\n[user's hint / instruction]\n" + HINT


async def rollout(engine: EngineProcess, session: str, messages: list[Message], max_tokens: int) -> Turn:
    """A real turn: the engine's own prompt ids, response ids and rollout log-probs."""
    client = EngineClient(engine.url)
    body = {
        "messages": [msgspec.to_builtins(m) for m in messages],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    r = await client.chat(body)
    now = time.time()
    assert r.prompt_token_ids and r.token_ids and r.logprobs
    return Turn(
        turn_id=f"{session}:1",
        session_id=session,
        turn_index=1,
        messages=messages,
        response=Message(role="assistant", content=r.message.get("content")),
        prompt_token_ids=r.prompt_token_ids,
        response_token_ids=r.token_ids,
        response_logprobs=r.logprobs,
        finish_reason=r.finish_reason,
        weight_version=0,
        model="smollm2",
        created_at=now,
        completed_at=now,
    )


def hint_judgment(turn: Turn, hint: str | None, judge_id: str = "j") -> Judgment:
    paired = PairedTurn(
        turn=turn, next_state=[Message(role="user", content="shorter!")], paired_at=time.time()
    )
    return Judgment(
        turn_id=turn.turn_id,
        session_id=turn.session_id,
        judge_id=judge_id,
        kind="hint",
        votes=[Vote(raw="x", score=1 if hint else -1, hint=hint or "")],
        paired=paired,
        judge_model="rules",
        created_at=time.time(),
        accepted=hint is not None,
        hint=hint,
    )


def hf_logprobs(hf_model: Any, messages: list[dict[str, Any]], response_ids: list[int], k: int = 0) -> Any:
    """Reference: transformers renders the enhanced prompt itself and runs one forward pass."""
    model, tok = hf_model
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids
    ids = torch.tensor([prompt + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    chosen = lps.gather(1, torch.tensor(response_ids)[:, None])[:, 0]
    top = lps.topk(k, dim=-1) if k else None
    return chosen, top


async def run_until_scores(config: Config, expect: int, timeout: float = 120) -> list[TeacherScores]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_teacher(config, install_signals=False, stop=stop))
    try:
        return await wait_for_events(
            config.kafka, TEACHER, lambda found: len(found) >= expect or task.done(), timeout
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)


async def test_teacher_logprobs_match_transformers_and_hint_lowers_off_hint_response(
    kafka: KafkaConfig, engine: EngineProcess, smollm2_path: Path, hf_model: Any
) -> None:
    question = [
        Message(role="system", content="You are a helpful assistant."),
        Message(role="user", content="Explain in detail how a bicycle works."),
    ]
    long_turn = await rollout(engine, "long", question, 40)
    short_turn = await rollout(engine, "tools", [Message(role="user", content="Name a color.")], 8)
    rejected = hint_judgment(short_turn, None)
    other_judge = hint_judgment(short_turn, HINT, judge_id="ignored")
    async with EventProducer(kafka) as producer:
        for j in (rejected, other_judge, hint_judgment(long_turn, HINT), hint_judgment(short_turn, HINT)):
            await producer.send(JUDGMENTS, j, j.session_id)
    config = Config(
        kafka=kafka,
        teacher=TeacherConfig(engine_url=engine.url, top_k=5, judge_ids=["j"], deadline_s=30),
    )
    found = await run_until_scores(config, 2)
    assert sorted(s.turn_id for s in found) == ["long:1", "tools:1"], (
        "rejected and other judges' hints skipped"
    )
    for scores in found:
        turn = long_turn if scores.turn_id == "long:1" else short_turn
        assert scores.response_token_ids == turn.response_token_ids and scores.hint == HINT
        assert len(scores.teacher_logprobs) == len(turn.response_token_ids)
        enhanced = [msgspec.to_builtins(m) for m in turn.messages]
        enhanced[-1]["content"] += HINT_BLOCK
        ref, top = hf_logprobs(hf_model, enhanced, turn.response_token_ids, k=5)
        assert torch.allclose(torch.tensor(scores.teacher_logprobs), ref, atol=1e-4), (
            (torch.tensor(scores.teacher_logprobs) - ref).abs().max()
        )
        assert scores.topk_token_ids == top.indices.tolist()
        assert torch.allclose(torch.tensor(scores.topk_logprobs), top.values, atol=1e-4)
        assert scores.teacher_model and scores.judge_id == "j"
    long_scores = next(s for s in found if s.turn_id == "long:1")
    assert len(long_turn.response_token_ids) == 40
    teacher_mean = sum(long_scores.teacher_logprobs) / 40
    rollout_mean = sum(long_turn.response_logprobs) / 40
    print(
        f"mean log-prob of the 40-token response: rollout {rollout_mean:.3f}, teacher with hint {teacher_mean:.3f}"
    )
    assert teacher_mean < rollout_mean, (teacher_mean, rollout_mean)


async def test_rejected_request_is_dead_lettered_and_the_rest_scored(
    kafka: KafkaConfig, engine: EngineProcess, smollm2_path: Path
) -> None:
    good = await rollout(engine, "good", [Message(role="user", content="Say hi.")], 4)
    bad = msgspec.structs.replace(
        good, turn_id="bad:1", session_id="bad", response_token_ids=[10**7, *good.response_token_ids[1:]]
    )
    async with EventProducer(kafka) as producer:
        for turn in (bad, good):
            j = hint_judgment(turn, HINT)
            await producer.send(JUDGMENTS, j, j.session_id)
    config = Config(
        kafka=kafka,
        teacher=TeacherConfig(
            engine_url=engine.url, tokenizer=str(smollm2_path), model="smollm2", deadline_s=30
        ),
    )
    found = await run_until_scores(config, 1)
    assert [s.turn_id for s in found] == ["good:1"]
    dead = [r.event async for r in read_topic(kafka, DEADLETTER)]
    assert len(dead) == 1 and isinstance(dead[0], DeadLetter)
    assert (
        dead[0].source_topic == JUDGMENTS.name(kafka.namespace) and "outside the vocabulary" in dead[0].error
    )


def test_an_unavailable_teacher_engine_holds_its_records_never_dead_letters_them() -> None:
    """The bus retries a transient failure until it passes (tests/runtime/messaging/test_bus.py) and dead-letters
    any other after three tries: an outage longer than three of the teacher's deadlines lost hints so (the judge's
    outage test shows it end to end)."""
    assert transient(TeacherUnavailable("teacher engine unavailable for 1 of 1 hints"))
