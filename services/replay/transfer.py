"""``turnstream replay export`` and ``turnstream replay import``: sessions between Kafka and JSONL files."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from runtime.configuration.config import KafkaConfig
from runtime.engine.chat_template import render_prompt_ids
from runtime.engine.client import EngineClient
from runtime.messaging.bus import EventProducer
from runtime.messaging.topics import create_topics
from runtime.security.files import private_opener
from schemas import Message, SamplingParams, Turn
from services.replay.records import (
    BadLine,
    Format,
    OpenClawRecord,
    encode_line,
    read_jsonl,
    to_openclaw,
)
from services.replay.select import Range, next_states, publish_turns, recorded_turns

log = logging.getLogger("turnstream.replay")


class ExportSummary(msgspec.Struct):
    path: str
    format: str
    turns: int
    sessions: int


async def export_sessions(
    kafka: KafkaConfig, span: Range, out: Path, fmt: Format, tokenizer: Any = None
) -> ExportSummary:
    """Write the turns of ``kafka.namespace`` in ``span`` to ``out``, sessions together, turns in order. The
    OpenClaw format also needs the next states (from ``turns.paired``) and a tokenizer for the prompt text."""
    turns = [rec.event async for rec in recorded_turns(kafka, span)]
    turns.sort(key=lambda t: (t.session_id, t.turn_index))
    paired = await next_states(kafka, {t.turn_id for t in turns}) if fmt == "openclaw" else {}

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".partial")
        with open(tmp, "wb", opener=private_opener) as fh:  # people's conversations: the owner's only
            for turn in turns:
                if fmt == "turns":
                    fh.write(encode_line(turn))
                else:
                    prompt = tokenizer.decode(turn.prompt_token_ids) if tokenizer is not None else ""
                    # As the model generated it, end token included, as OpenClaw-RL writes it.
                    response = (
                        tokenizer.decode(turn.response_token_ids)
                        if tokenizer is not None
                        else turn.response.text
                    )
                    record = to_openclaw(turn, paired.get(turn.turn_id), prompt, response)
                    fh.write(encode_line(record))
        tmp.replace(out)  # a reader never sees half a file

    await asyncio.to_thread(write)
    return ExportSummary(str(out), fmt, len(turns), len({t.session_id for t in turns}))


class ImportSummary(msgspec.Struct):
    namespace: str
    turns: int
    sessions: int
    rescored: int
    """OpenClaw records tokenized again and scored by the policy engine."""
    bad_lines: list[str]


class ImportRefused(ValueError):
    pass


async def import_sessions(
    kafka: KafkaConfig,
    path: str,
    *,
    engine_url: str | None = None,
    engine_api_key: str | None = None,
    tokenizer: Any = None,
    skip_bad: bool = False,
) -> ImportSummary:
    """Publish the file's turns to ``turns`` of ``kafka.namespace``. Turn lines go as they are. OpenClaw records
    become turns of the current policy: prompts rendered with its chat template, responses tokenized, and their
    log-probs scored by the engine at ``engine_url`` (``token_source`` "retokenized", the engine's weight
    version); sessions are numbered 1, 2, ... in ``turn`` order and their last turn marks the session done.
    Bad lines refuse the whole import (listed), unless ``skip_bad``: then they are skipped and listed."""
    records, bad = await asyncio.to_thread(read_jsonl, path)
    if bad and not skip_bad:
        raise ImportRefused("; ".join(str(b) for b in bad[:20]) + (" ..." if len(bad) > 20 else ""))
    foreign = [r for r in records if isinstance(r, OpenClawRecord)]
    turns = [r for r in records if isinstance(r, Turn)]
    if foreign:
        if engine_url is None or tokenizer is None:
            raise ImportRefused(
                f"{len(foreign)} OpenClaw records carry no token ids or log-probs: give the policy engine's URL "
                "(--engine-url) so they can be tokenized and scored"
            )
        turns += await _rescore(foreign, EngineClient(engine_url, api_key=engine_api_key), tokenizer)
    await create_topics(kafka)
    async with EventProducer(kafka, client_id=f"{kafka.client_id}-replay-import") as producer:
        await publish_turns(producer, turns)
    return ImportSummary(
        kafka.namespace,
        len(turns),
        len({t.session_id for t in turns}),
        len(foreign),
        [str(b) for b in bad],
    )


def generated_ids(tokenizer: Any, response_text: str, eos: int | None) -> tuple[list[int], str]:
    """(the token ids the model generated, the response's text). OpenClaw-RL writes the response as the template
    renders it, end token included (``Paris.<|im_end|>`` and the template's newline after it): the ids run up to
    and including the first end token, and the text stops before it. A response without one (turnstream's
    export before it wrote the end token) gets it appended: the model stopped there."""
    ids = list(tokenizer(response_text, add_special_tokens=False).input_ids)
    if eos is None:
        return ids, response_text
    if eos in ids:
        end = ids.index(eos)
        return ids[: end + 1], tokenizer.decode(ids[:end])
    return [*ids, int(eos)], response_text


async def _rescore(records: list[OpenClawRecord], engine: EngineClient, tokenizer: Any) -> list[Turn]:
    info = await engine.model_info()
    version = str(info.get("weight_version", ""))
    model = str(info.get("served_model_name") or info.get("model_path") or "policy")
    eos = tokenizer.eos_token_id
    sessions: dict[str, list[OpenClawRecord]] = defaultdict(list)
    for r in records:
        sessions[r.session_id].append(r)
    out: list[Turn] = []
    for sid, rows in sessions.items():
        rows.sort(key=lambda r: r.turn)
        for index, r in enumerate(rows, 1):
            messages = [msgspec.to_builtins(m) for m in r.messages]
            prompt = await asyncio.to_thread(render_prompt_ids, tokenizer, messages, None)
            response, content = generated_ids(tokenizer, r.response_text, eos)
            scored = await engine.score(prompt, response)
            now = time.time()
            out.append(
                Turn(
                    turn_id=f"{sid}:{index}",
                    session_id=sid,
                    turn_index=index,
                    messages=r.messages,
                    response=Message(role="assistant", content=content, tool_calls=r.tool_calls),
                    prompt_token_ids=prompt,
                    response_token_ids=response,
                    response_logprobs=scored.logprobs,
                    finish_reason="tool_calls" if r.tool_calls else "stop",
                    weight_version=int(version) if version.isdigit() else 0,
                    model=model,
                    created_at=now,
                    completed_at=now,
                    sampling=SamplingParams(),
                    session_done=index == len(rows),
                    token_source="retokenized",
                )
            )
    return out


__all__ = [
    "BadLine",
    "ExportSummary",
    "ImportRefused",
    "ImportSummary",
    "export_sessions",
    "generated_ids",
    "import_sessions",
]
