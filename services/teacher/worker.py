"""``turnstream teacher``: teacher log-probs of each turn's exact response under its accepted hindsight hint.

Consumes ``judgments`` (kind ``hint``, accepted; the judgment carries the paired turn), appends the hint to the
turn's last user message, renders the chat template with the turn's tools exactly as the engine does, appends the
turn's response token ids and asks the teacher engine for their input log-probs (``max_new_tokens`` 0). Emits
``TeacherScores`` to ``teacher``. The teacher model is fixed: this worker never reloads weights.

Failures: a request the teacher engine rejects (or a template that cannot render the turn) goes to ``deadletter``
with the reason and is counted; an unavailable engine is retried until ``teacher.deadline_s``, after which the
whole batch is retried from its offsets, so no accepted hint is lost to an outage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Histogram

from runtime.configuration.config import Config
from runtime.engine.chat_template import TemplateError, render_prompt_ids
from runtime.engine.client import DeadlineExceeded, EngineClient, EngineError, ScoreResult, until_deadline
from runtime.messaging.bus import EventConsumer, EventProducer, Record, serve
from runtime.messaging.recent import RecentKeys
from runtime.observability.metrics import serve_metrics
from schemas import Judgment, TeacherScores
from schemas.topics import JUDGMENTS, TEACHER
from services.teacher.enhance import HINT_TEMPLATE, as_request_messages, enhanced_messages, load_template

log = logging.getLogger("turnstream.teacher")

SCORED = Counter("turnstream_teacher_scored_total", "Turns scored by the teacher")
TOKENS = Counter("turnstream_teacher_tokens_total", "Response tokens scored by the teacher")
SKIPPED = Counter("turnstream_teacher_skipped_total", "Judgments not scored", ["reason"])
FAILED = Counter("turnstream_teacher_failed_total", "Accepted hints dead-lettered", ["reason"])
SCORE_SECONDS = Histogram(
    "turnstream_teacher_score_seconds",
    "One teacher scoring call, retries included",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)


class TeacherUnavailable(RuntimeError):
    """The teacher engine answered none of a record's calls: the infrastructure's fault, so the batch is retried until
    the engine is back, never dead-lettered after the bus's few tries (a 10 s judge outage lost records so)."""

    transient = True


class Teacher:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        producer: EventProducer,
        dead_letter: Callable[[Record[Any], str, str], Awaitable[None]],
        *,
        model: str,
        top_k: int = 0,
        max_concurrency: int = 1,
        judge_ids: list[str] | None = None,
        deadline_s: float = 300.0,
        vocab_size: int | None = None,
        hint_template: str = HINT_TEMPLATE,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or len(tokenizer)
        """Token ids at or above this are refused here: SGLang 0.5.23 does not check ``input_ids`` against the
        vocabulary, and one out-of-range id kills its scheduler (IndexError in the embedding: the whole server
        exits, measured). A Turn's ids are only checked to be non-negative by the contract."""
        self.producer = producer
        self.dead_letter = dead_letter
        self.model = model
        self.top_k = top_k
        self.hint_template = hint_template
        self.judge_ids = set(judge_ids or ())
        self.deadline_s = deadline_s
        self._slots = asyncio.Semaphore(max_concurrency)
        self._emitted = RecentKeys()

    async def handle(self, batch: list[Record[Judgment]]) -> None:
        outcomes = await asyncio.gather(*(self.score_record(r) for r in batch))
        down = outcomes.count(False)
        if down:
            raise TeacherUnavailable(
                f"teacher engine unavailable for {down} of {len(batch)} hints; batch retried"
            )

    def wanted(self, j: Judgment) -> str | None:
        """Why a judgment is not for the teacher, or None if it is."""
        if j.kind != "hint":
            return "not_hint"
        if not j.accepted or j.hint is None:
            return "hint_rejected"
        if self.judge_ids and j.judge_id not in self.judge_ids:
            return "other_judge"
        if not j.paired.turn.response_token_ids:
            return "empty_response"
        if j.key in self._emitted:
            return "already_scored"
        return None

    async def score_record(self, rec: Record[Judgment]) -> bool:
        """Score one judgment and emit its TeacherScores. False when the teacher engine stayed unavailable."""
        j = rec.event
        reason = self.wanted(j)
        if reason is not None:
            SKIPPED.labels(reason).inc()
            return True
        assert j.hint is not None
        turn = j.paired.turn
        if max(turn.response_token_ids) >= self.vocab_size:
            FAILED.labels("outside_vocabulary").inc()
            await self.dead_letter(
                rec,
                f"teacher: response token id {max(turn.response_token_ids)} is outside the vocabulary "
                f"({self.vocab_size} ids): not sent, it would crash the engine",
                "processing",
            )
            return True
        try:
            prompt_ids = await asyncio.to_thread(self.prompt_ids, j)
        except TemplateError as exc:
            FAILED.labels("template").inc()
            await self.dead_letter(rec, f"teacher: {exc}", "processing")
            return True
        started = time.perf_counter()
        try:
            async with self._slots:
                result: ScoreResult = await until_deadline(
                    lambda: self.client.score(prompt_ids, turn.response_token_ids, self.top_k),
                    self.deadline_s,
                )
        except DeadlineExceeded as exc:
            log.warning("teacher engine unavailable", extra={"turn_id": j.turn_id, "error": str(exc)})
            return False
        except EngineError as exc:
            FAILED.labels("engine_rejected").inc()
            await self.dead_letter(rec, f"teacher engine rejected the scoring request: {exc}", "processing")
            return True
        finally:
            SCORE_SECONDS.observe(time.perf_counter() - started)
        scores = TeacherScores(
            turn_id=j.turn_id,
            session_id=j.session_id,
            judge_id=j.judge_id,
            hint=j.hint,
            teacher_model=self.model,
            response_token_ids=list(turn.response_token_ids),
            teacher_logprobs=result.logprobs,
            topk_token_ids=result.topk_token_ids,
            topk_logprobs=result.topk_logprobs,
            created_at=time.time(),
        )
        await self.producer.send(TEACHER, scores, j.session_id)
        self._emitted.add(j.key)
        SCORED.inc()
        TOKENS.inc(len(turn.response_token_ids))
        return True

    def prompt_ids(self, j: Judgment) -> list[int]:
        """The enhanced prompt's token ids (a worker thread: long prompts take a while to tokenize)."""
        assert j.hint is not None
        turn = j.paired.turn
        messages = as_request_messages(enhanced_messages(turn.messages, j.hint, self.hint_template))
        # The template options the policy was served with (enable_thinking=False gives its prompt an empty think
        # block): without them the teacher scores the response after another prompt.
        return render_prompt_ids(self.tokenizer, messages, turn.tools or None, turn.chat_template_kwargs)


def model_vocab_size(path: str) -> int | None:
    """The embedding's rows (``vocab_size`` in the model's config.json, padding included), when readable."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and size > 0 else None


async def _teacher_identity(client: EngineClient, config: Config) -> tuple[str, str]:
    """(model name, tokenizer path): from the config, else from the teacher engine (waiting until it is up)."""
    tc = config.teacher
    if tc.model and tc.tokenizer:
        return tc.model, tc.tokenizer
    info: dict[str, Any] = await until_deadline(client.model_info, tc.deadline_s)
    model = tc.model or str(info.get("served_model_name") or info.get("model_path") or tc.engine_url)
    tokenizer = tc.tokenizer or str(info.get("tokenizer_path") or info.get("model_path") or "")
    if not tokenizer:
        raise SystemExit(
            "turnstream teacher: set teacher.tokenizer (the engine did not report its tokenizer)"
        )
    return model, tokenizer


async def run_teacher(
    config: Config, *, install_signals: bool = True, stop: asyncio.Event | None = None
) -> None:
    """Run until SIGTERM/SIGINT (or ``stop`` is set): the in-flight batch finishes and is committed."""
    from transformers import AutoTokenizer

    tc = config.teacher
    serve_metrics(config.metrics.port, config.metrics.host)
    client = EngineClient(tc.engine_url, api_key=tc.api_key, timeout_s=tc.deadline_s, retries=0)
    model, tokenizer_path = await _teacher_identity(client, config)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, tokenizer_path)
    producer = EventProducer(config.kafka, client_id=f"{config.kafka.client_id}-teacher")
    await producer.start()
    consumer = EventConsumer(
        config.kafka, [JUDGMENTS], tc.group_id, deadletter=producer, max_batch=tc.max_batch
    )
    teacher = Teacher(
        client,
        tokenizer,
        producer,
        consumer.dead_letter,
        model=model,
        top_k=tc.top_k,
        max_concurrency=tc.max_concurrency,
        judge_ids=tc.judge_ids,
        deadline_s=tc.deadline_s,
        vocab_size=model_vocab_size(tokenizer_path),
        hint_template=load_template(tc.hint_template or None),
    )
    log.info("teacher running", extra={"model": model, "tokenizer": tokenizer_path, "top_k": tc.top_k})
    try:
        await serve(consumer, teacher.handle, install_signals=install_signals, stop=stop)
    finally:
        await producer.stop()
