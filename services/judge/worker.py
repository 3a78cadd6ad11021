"""``turnstream judge --judge-id ID``: eval votes and hindsight-hint votes for every paired turn.

Consumes ``turns.paired`` in the consumer group ``turnstream-judge-<judge_id>`` (so judges with different ids see
every turn, and replicas of one judge share partitions) and emits one ``Judgment`` per (turn, judge_id, kind) to
``judgments``. All 2m votes of a turn run concurrently, and every turn of a batch at once, under one limit on
concurrent engine calls per worker. Offsets are committed after the batch's judgments are acknowledged.

A vote that fails (after the backend's retries) is recorded as failed and the turn is judged from the rest. If
every vote of a kind failed because the judge engine was unavailable, that is an outage, not a verdict: the
batch is retried from its offsets (with backoff) instead of filling ``judgments`` with zeros.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from prometheus_client import Counter, Gauge, Histogram

from runtime.configuration.config import Config
from runtime.configuration.plugins import load_function
from runtime.messaging.bus import EventConsumer, EventProducer, Record, serve
from runtime.messaging.recent import RecentKeys
from runtime.observability.metrics import serve_metrics
from schemas import Judgment, PairedTurn, Vote
from schemas.modes import mode_spec
from schemas.topics import JUDGMENTS, TURNS_PAIRED
from services.judge.backends import Backend, EngineBackend, VoteFailed, from_config
from services.judge.prompts import PromptSet
from services.judge.votes import majority_vote, parse_vote, select_hint

log = logging.getLogger("turnstream.judge")

VOTES = Counter("turnstream_judge_votes_total", "Judge votes by outcome", ["judge_id", "kind", "outcome"])
TURNS = Counter("turnstream_judge_turns_total", "Paired turns judged", ["judge_id"])
SKIPPED = Counter("turnstream_judge_skipped_total", "Paired turns not judged", ["judge_id", "reason"])
HINTS = Counter("turnstream_judge_hints_total", "Hint judgments by outcome", ["judge_id", "accepted"])
EVAL_SCORES = Counter("turnstream_judge_eval_scores_total", "Eval judgments by score", ["judge_id", "score"])
HELD = Counter(
    "turnstream_judge_batches_held_total", "Batches retried because the judge engine was down", ["judge_id"]
)
CALL_SECONDS = Histogram(
    "turnstream_judge_call_seconds",
    "One vote, retries included",
    ["judge_id", "kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
TURN_SECONDS = Histogram(
    "turnstream_judge_turn_seconds",
    "All votes of one turn",
    ["judge_id"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
IN_FLIGHT = Gauge("turnstream_judge_calls_in_flight", "Engine calls running now", ["judge_id"])


VoteParser = Callable[[str, str], tuple[int | None, str]]
"""The ``judge.vote_parser`` seam: ``(kind, text) -> (score, hint)``; a score that cannot be read is None."""


class JudgeUnavailable(RuntimeError):
    """The judge engine answered none of a record's calls: the infrastructure's fault, so the batch is retried until
    the engine is back, never dead-lettered after the bus's few tries (a 10 s judge outage lost records so)."""

    transient = True


class Judge:
    def __init__(
        self,
        judge_id: str,
        backend: Backend,
        prompts: PromptSet,
        producer: EventProducer,
        *,
        m: int = 1,
        max_concurrency: int = 8,
        kinds: Sequence[str] = ("eval", "hint"),
        parse: VoteParser = parse_vote,
    ) -> None:
        self.judge_id = judge_id
        self.backend = backend
        self.prompts = prompts
        self.producer = producer
        self.m = m
        self.parse = parse
        self.kinds = tuple(kinds)
        """The judgment kinds this judge emits: what the dispatch mode waits for (``judgment_kinds``)."""
        self._slots = asyncio.Semaphore(max_concurrency)
        self._emitted = RecentKeys()
        """Judgment keys this process already emitted: a retried batch does not judge those turns again."""

    async def handle(self, batch: list[Record[PairedTurn]]) -> None:
        outcomes = await asyncio.gather(*(self.judge_turn(r.event) for r in batch))
        down = sum(1 for ok in outcomes if not ok)
        if down:
            HELD.labels(self.judge_id).inc()
            raise JudgeUnavailable(
                f"judge engine unavailable for {down} of {len(batch)} turns; batch retried"
            )

    async def judge_turn(self, paired: PairedTurn) -> bool:
        """Judge one turn and emit its judgments. False when all votes of a kind failed for lack of an engine."""
        if paired.next_state is None:
            SKIPPED.labels(self.judge_id, "terminal").inc()
            return True
        kinds = [k for k in self.kinds if self._key(paired, k) not in self._emitted]
        if not kinds:
            SKIPPED.labels(self.judge_id, "already_judged").inc()
            return True
        started = time.perf_counter()
        messages = {k: self.prompts.render(k, paired) for k in kinds}
        calls = [(k, self._vote(k, paired, messages[k])) for k in kinds for _ in range(self.m)]
        results = await asyncio.gather(*(c for _, c in calls))
        for kind in kinds:
            mine = [r for (k, _), r in zip(calls, results, strict=True) if k == kind]
            if all(isinstance(r, VoteFailed) and r.transient for r in mine):
                return False  # nothing but outage for this kind: hold rather than emit an empty verdict
        by_kind: dict[str, list[Vote]] = {k: [] for k in kinds}
        for (kind, _), result in zip(calls, results, strict=True):
            by_kind[kind].append(self._to_vote(kind, result))
        for kind in kinds:
            judgment = self._judgment(kind, paired, by_kind[kind])
            await self.producer.send(JUDGMENTS, judgment, paired.turn.session_id)
            self._emitted.add(judgment.key)
        TURNS.labels(self.judge_id).inc()
        TURN_SECONDS.labels(self.judge_id).observe(time.perf_counter() - started)
        return True

    async def _vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, str]]) -> str | VoteFailed:
        async with self._slots:
            IN_FLIGHT.labels(self.judge_id).inc()
            started = time.perf_counter()
            try:
                return await self.backend.vote(kind, paired, messages)
            except VoteFailed as exc:
                log.warning(
                    "vote failed",
                    extra={
                        "judge_id": self.judge_id,
                        "turn_id": paired.turn_id,
                        "kind": kind,
                        "error": str(exc),
                    },
                )
                return exc
            finally:
                IN_FLIGHT.labels(self.judge_id).dec()
                CALL_SECONDS.labels(self.judge_id, kind).observe(time.perf_counter() - started)

    def _to_vote(self, kind: str, result: str | VoteFailed) -> Vote:
        if isinstance(result, VoteFailed):
            VOTES.labels(self.judge_id, kind, "failed").inc()
            return Vote(raw="", error=str(result))
        score, hint = self.parse(kind, result)
        if score not in (None, -1, 0, 1) or (kind == "hint" and score == 0) or not isinstance(hint, str):
            VOTES.labels(self.judge_id, kind, "invalid").inc()
            return Vote(
                raw=result, error=f"judge.vote_parser returned ({score!r}, {hint!r}): not a {kind} vote"
            )
        VOTES.labels(self.judge_id, kind, "valid" if score is not None else "invalid").inc()
        return Vote(raw=result, score=score, hint=hint)

    def _judgment(self, kind: str, paired: PairedTurn, votes: list[Vote]) -> Judgment:
        common = {
            "turn_id": paired.turn_id,
            "session_id": paired.turn.session_id,
            "judge_id": self.judge_id,
            "kind": kind,
            "votes": votes,
            "paired": paired,
            "judge_model": self.backend.model,
            "created_at": time.time(),
        }
        if kind == "eval":
            score = majority_vote([v.score for v in votes])
            EVAL_SCORES.labels(self.judge_id, str(score)).inc()
            return Judgment(**common, eval_score=score)  # type: ignore[arg-type]
        hint = select_hint([(v.score, v.hint) for v in votes])
        HINTS.labels(self.judge_id, str(hint is not None).lower()).inc()
        return Judgment(**common, accepted=hint is not None, hint=hint)  # type: ignore[arg-type]

    def _key(self, paired: PairedTurn, kind: str) -> str:
        return f"{paired.turn_id}/{self.judge_id}/{kind}"


def judgment_kinds(config: Config) -> tuple[str, ...]:
    """The kinds the dispatch mode needs: eval when it needs a reward (and ``judge.eval_mode`` is on), hint when
    it distills (rl never pays for hint votes, opd never for eval votes)."""
    spec = mode_spec(config.dispatcher.mode)
    wanted = (("eval", spec.needs_eval and config.judge.eval_mode), ("hint", spec.needs_hint))
    return tuple(kind for kind, needed in wanted if needed)


async def run_judge(
    config: Config, *, install_signals: bool = True, stop: asyncio.Event | None = None
) -> None:
    """Run until SIGTERM/SIGINT (or ``stop`` is set): the in-flight batch finishes and is committed."""
    jc = config.judge
    serve_metrics(config.metrics.port, config.metrics.host)
    backend = from_config(config)
    parser = load_function("judge.vote_parser", jc.vote_parser, ("kind", "text"))
    if isinstance(backend, EngineBackend) and not backend.model:
        backend.model = await _served_model(backend) or jc.engine_url
    prompts = PromptSet.load(jc.prompts_dir or None, jc.max_state_chars)
    producer = EventProducer(config.kafka, client_id=f"{config.kafka.client_id}-judge-{jc.judge_id}")
    await producer.start()
    consumer = EventConsumer(
        config.kafka, [TURNS_PAIRED], jc.group_id, deadletter=producer, max_batch=jc.max_batch
    )
    judge = Judge(
        jc.judge_id,
        backend,
        prompts,
        producer,
        m=jc.m,
        max_concurrency=jc.max_concurrency,
        kinds=judgment_kinds(config),
        parse=parser,
    )
    log.info(
        "judge running",
        extra={
            "judge_id": jc.judge_id,
            "backend": jc.backend,
            "model": backend.model,
            "m": jc.m,
            "kinds": judge.kinds,
        },
    )
    try:
        await serve(consumer, judge.handle, install_signals=install_signals, stop=stop)
    finally:
        await producer.stop()


async def _served_model(backend: EngineBackend) -> str | None:
    try:
        models = await backend.client.models()
    except Exception:  # the engine may come up later; the id only labels judgments
        return None
    return str(models[0]["id"]) if models else None
