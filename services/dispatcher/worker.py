"""``turnstream dispatcher --mode <mode>``: joins each turn's judgments and teacher scores and emits at
most one ``Sample`` per turn to ``samples``.

Inputs (``judgments``, ``teacher``) may arrive in any order, duplicated or redelivered; the join lives in Redis
(``join.py``) and survives restarts. Emission is effectively once: the dispatcher claims the turn in Redis, produces
the sample (idempotent producer, acks=all), then records it as emitted, and only then are the inputs' offsets
committed. A dispatcher that dies between claim and record leaves a claim behind; whoever next sees the turn waits
until the claim is ``claim_lease_s`` old, looks for the sample in ``samples``, and emits it only if it is not
there. Turns whose inputs never all arrive are dropped after ``join_timeout_s`` and counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import cast

import msgspec
from prometheus_client import Counter, Gauge, Histogram

from runtime.configuration.config import Config
from runtime.configuration.plugins import load_function
from runtime.messaging.bus import EventConsumer, EventProducer, Record, read_topic, serve
from runtime.observability.metrics import serve_metrics
from runtime.pipeline.majority import majority_vote
from runtime.transport.redis_urls import redis_client
from schemas import Judgment, Sample, TeacherScores, Turn, decode, encode
from schemas.modes import mode_spec
from schemas.topics import JUDGMENTS, SAMPLES, TEACHER
from services.dispatcher.join import JoinStore
from services.dispatcher.rules import reward

log = logging.getLogger("turnstream.dispatcher")

SAMPLES_OUT = Counter("turnstream_dispatcher_samples_total", "Samples emitted", ["kind"])
NO_SAMPLE = Counter("turnstream_dispatcher_no_sample_total", "Turns decided without a sample (no signal)")
DROPS = Counter("turnstream_dispatcher_drops_total", "Turns dropped", ["reason"])
IGNORED = Counter("turnstream_dispatcher_ignored_total", "Inputs not used", ["reason"])
RECOVERED = Counter("turnstream_dispatcher_recovered_total", "Stale claims resolved", ["outcome"])
JOIN_LATENCY = Histogram(
    "turnstream_dispatcher_join_latency_seconds",
    "From a turn's last input to its decision",
    buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300),
)
OPEN_JOINS = Gauge("turnstream_dispatcher_open_joins", "Turns waiting for inputs")

Decide = Callable[[str, int | None, bool, bool], str | None]
"""The ``dispatcher.decide`` seam: ``(mode, eval_score, hint_accepted, session_has_effective_sample)``."""


class TurnTokens(msgspec.Struct, frozen=True):
    """What a sample needs of its turn (the join keeps this, not the whole conversation)."""

    session_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    weight_version: int

    @classmethod
    def of(cls, turn: Turn) -> TurnTokens:
        return cls(
            turn.session_id,
            turn.prompt_token_ids,
            turn.response_token_ids,
            turn.response_logprobs,
            turn.weight_version,
        )


class ClaimPending(RuntimeError):
    """Another dispatcher's claim on a turn is younger than the lease: retry the batch later. Transient, like an
    unreachable broker: the lease always runs out, so the batch is retried until it does, never dead-lettered (a
    dispatcher killed holding a claim cost its turn's sample after three tries: issue 54's note)."""

    transient = True


class Dispatcher:
    def __init__(self, config: Config, store: JoinStore, producer: EventProducer) -> None:
        dc = config.dispatcher
        self.kafka = config.kafka
        self.mode = dc.mode
        self.spec = mode_spec(dc.mode)
        self.decide = cast(
            Decide,
            load_function("dispatcher.decide", dc.decide, ("mode", "eval_score", "hint", "has_sample")),
        )
        self.judge_ids = list(dc.judge_ids)
        self.combine = dc.judge_combine
        # Without eval votes (judge.eval_mode off, OpenClaw's OPENCLAW_EVAL_MODE=0) a mode that also distills
        # waits for none and decides as if every eval were 0: combine degrades to opd-only, as OpenClaw's does.
        self.need_eval = self.spec.needs_eval and config.judge.eval_mode
        self.need_hint = self.spec.needs_hint
        self.timeout_s = dc.join_timeout_s
        self.sweep_interval_s = dc.sweep_interval_s
        self.lease_ms = int(dc.claim_lease_s * 1000)
        self.store = store
        self.producer = producer
        self.owner = uuid.uuid4().hex[:12]
        self._last_sweep = 0.0

    # inputs -----------------------------------------------------------------------------------------------

    async def handle(self, batch: list[Record[Judgment | TeacherScores]]) -> None:
        for rec in batch:
            await self.on_input(rec.event)

    def field(self, ev: Judgment | TeacherScores) -> tuple[str, bytes, bytes | None] | None:
        """(join field, value, turn data) of an input this dispatcher uses, else None (counted)."""
        if ev.judge_id not in self.judge_ids:
            IGNORED.labels("other_judge").inc()
            return None
        if isinstance(ev, TeacherScores):
            if not self.need_hint:
                IGNORED.labels("not_needed").inc()
                return None
            return f"teacher:{ev.judge_id}", encode(ev), None
        if (ev.kind == "eval" and not self.need_eval) or (ev.kind == "hint" and not self.need_hint):
            IGNORED.labels("not_needed").inc()
            return None
        value = str(ev.eval_score) if ev.kind == "eval" else ("1" if ev.accepted else "0")
        return (
            f"{ev.kind}:{ev.judge_id}",
            value.encode(),
            msgspec.msgpack.encode(TurnTokens.of(ev.paired.turn)),
        )

    async def on_input(self, ev: Judgment | TeacherScores) -> None:
        parts = self.field(ev)
        if parts is None:
            return
        field, value, turn_blob = parts
        decided, fields = await self.store.add(ev.turn_id, field, value, turn_blob, time.time())
        if decided is not None:
            if decided.startswith("pending|"):
                await self.resolve_claim(ev.turn_id, decided)
            else:
                IGNORED.labels("already_decided").inc()
            return
        if self.complete(fields):
            await self.finish(ev.turn_id, fields)

    # the join ---------------------------------------------------------------------------------------------

    def eval_score(self, fields: dict[str, bytes]) -> int | None:
        scores = [int(fields[f"eval:{j}"]) for j in self.judge_ids if f"eval:{j}" in fields]
        if not scores:
            return None
        return scores[0] if self.combine == "single" else majority_vote(scores)

    def hint_judge(self, fields: dict[str, bytes]) -> str | None:
        """The judge whose accepted hint the teacher scored: the first configured id that accepted one."""
        return next((j for j in self.judge_ids if fields.get(f"hint:{j}") == b"1"), None)

    def complete(self, fields: dict[str, bytes]) -> bool:
        if "turn" not in fields:
            return False
        if self.need_eval:
            evals = self.judge_ids[:1] if self.combine == "single" else self.judge_ids
            if any(f"eval:{j}" not in fields for j in evals):
                return False
        if self.need_hint:
            if any(f"hint:{j}" not in fields for j in self.judge_ids):
                return False
            chosen = self.hint_judge(fields)
            if chosen is not None and f"teacher:{chosen}" not in fields:
                return False
        return True

    async def plan(self, turn_id: str, fields: dict[str, bytes]) -> tuple[str, Sample | None]:
        """The decision for a complete join: ("emit", sample), ("none", None) or ("dropped:<reason>", None)."""
        tokens = msgspec.msgpack.decode(fields["turn"], type=TurnTokens)
        score = self.eval_score(fields)
        chosen = self.hint_judge(fields) if self.need_hint else None
        has_sample = True
        if self.spec.at_least_one and not score:
            has_sample = await self.store.session_has_sample(tokens.session_id)
        kind = self.decide(self.mode, score, chosen is not None, has_sample)
        if kind is None:
            return "none", None
        if kind not in self.spec.kinds:
            log.error(
                "dispatcher.decide chose a kind the mode does not emit",
                extra={"turn_id": turn_id, "kind": kind, "mode": self.mode},
            )
            return "dropped:invalid_kind", None
        wants_teacher = kind in self.spec.teacher_kinds
        teacher = decode(fields[f"teacher:{chosen}"], TeacherScores) if wants_teacher and chosen else None
        try:
            return "emit", self.sample(turn_id, kind, score, tokens, teacher)
        except _Drop as drop:
            log.warning(
                "turn dropped", extra={"turn_id": turn_id, "reason": drop.reason, "detail": str(drop)}
            )
            return f"dropped:{drop.reason}", None

    async def finish(self, turn_id: str, fields: dict[str, bytes], *, claimed: bool = False) -> None:
        decision, sample = await self.plan(turn_id, fields)
        last = float(fields.get("last", b"0"))
        if sample is None:
            await self.store.close(turn_id, decision)
            if decision == "none":
                NO_SAMPLE.inc()
            else:
                DROPS.labels(decision.split(":", 1)[1]).inc()
            JOIN_LATENCY.observe(max(time.time() - last, 0.0))
            return
        if not claimed:
            ok, current = await self.store.claim(turn_id, self.owner, _ms())
            if not ok:
                if current is not None and current.startswith("pending|"):
                    await self.resolve_claim(turn_id, current)
                return
        await self.emit(sample, last)

    def sample(
        self, turn_id: str, kind: str, score: int | None, t: TurnTokens, teacher: TeacherScores | None
    ) -> Sample:
        n = len(t.response_token_ids)
        if n == 0:
            raise _Drop("empty_response", "the turn has no response tokens")
        if not t.prompt_token_ids:
            raise _Drop("empty_prompt", "the turn has no prompt tokens")
        teacher_lps = topk_ids = topk_lps = None
        if kind in self.spec.teacher_kinds:
            if teacher is None:
                raise _Drop("no_teacher", f"kind {kind!r} needs the teacher's scores of an accepted hint")
            if teacher.response_token_ids != t.response_token_ids:
                raise _Drop("teacher_mismatch", "the teacher scored other tokens than the turn's response")
            teacher_lps, topk_ids, topk_lps = (
                teacher.teacher_logprobs,
                teacher.topk_token_ids,
                teacher.topk_logprobs,
            )
        elif kind in self.spec.rollout_as_teacher_kinds:
            teacher_lps = list(t.response_logprobs)  # the OPD term is exactly zero
        try:
            return Sample(
                sample_id=turn_id,
                session_id=t.session_id,
                mode=self.mode,
                kind=kind,
                tokens=[*t.prompt_token_ids, *t.response_token_ids],
                response_length=n,
                loss_mask=[1] * n,
                rollout_logprobs=list(t.response_logprobs),
                reward=reward(kind, score),
                weight_version=t.weight_version,
                created_at=time.time(),
                teacher_logprobs=teacher_lps,
                topk_token_ids=topk_ids,
                topk_logprobs=topk_lps,
            )
        except ValueError as exc:  # ContractError: inconsistent inputs, never worth retrying
            raise _Drop("invalid", str(exc)) from None

    async def emit(self, sample: Sample, last_input: float) -> None:
        await self.producer.send(SAMPLES, sample, sample.session_id)
        await self.store.close(sample.sample_id, "emitted", session_id=sample.session_id)
        SAMPLES_OUT.labels(sample.kind).inc()
        JOIN_LATENCY.observe(max(time.time() - last_input, 0.0))

    # crash recovery ---------------------------------------------------------------------------------------

    async def resolve_claim(self, turn_id: str, claim: str) -> None:
        """A claim nobody confirmed. Ours (a produce that failed) or older than the lease: find out whether the
        sample reached ``samples``; emit it if not. A younger foreign claim: retry the batch later."""
        _, owner, at_ms = claim.split("|")
        if owner != self.owner and _ms() - int(at_ms) < self.lease_ms:
            raise ClaimPending(f"turn {turn_id} is claimed by dispatcher {owner}; retrying after its lease")
        if not await self.store.take_over(turn_id, claim, self.owner, _ms()):
            return  # someone else resolved it meanwhile
        async for rec in read_topic(self.kafka, SAMPLES, since_ms=int(at_ms) - 60_000):
            if rec.event.sample_id == turn_id:
                await self.store.close(turn_id, "emitted", session_id=rec.event.session_id)
                RECOVERED.labels("found").inc()
                log.info("stale claim resolved: the sample was already emitted", extra={"turn_id": turn_id})
                return
        fields = await self.store.fields(turn_id)
        if not self.complete(fields):
            await self.store.close(turn_id, "dropped:lost_state")
            DROPS.labels("lost_state").inc()
            return
        await self.finish(turn_id, fields, claimed=True)
        RECOVERED.labels("emitted").inc()
        log.info(
            "stale claim resolved: the sample was missing and is now emitted", extra={"turn_id": turn_id}
        )

    # timeouts ---------------------------------------------------------------------------------------------

    async def maybe_sweep(self) -> None:
        now = time.time()
        if now - self._last_sweep < self.sweep_interval_s:
            return
        self._last_sweep = now
        await self.sweep(now)

    async def sweep(self, now: float | None = None) -> int:
        dropped = await self.store.expire(time.time() if now is None else now, self.timeout_s)
        for turn_id, had in dropped:
            DROPS.labels("timeout").inc()
            log.info("incomplete turn dropped after the join timeout", extra={"turn_id": turn_id, "had": had})
        OPEN_JOINS.set(await self.store.open_joins())
        return len(dropped)


class _Drop(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _ms() -> int:
    return int(time.time() * 1000)


async def run_dispatcher(
    config: Config, *, install_signals: bool = True, stop: asyncio.Event | None = None
) -> None:
    """Run until SIGTERM/SIGINT (or ``stop`` is set): the in-flight batch finishes and is committed."""
    dc = config.dispatcher
    serve_metrics(config.metrics.port, config.metrics.host)
    redis = redis_client(config.redis.url)
    store = JoinStore(
        redis,
        config.redis.key_prefix,
        join_ttl_s=max(2 * dc.join_timeout_s, dc.join_timeout_s + 3600),
        dedupe_ttl_s=dc.dedupe_ttl_s,
    )
    producer = EventProducer(config.kafka, client_id=f"{config.kafka.client_id}-dispatcher")
    await producer.start()
    consumer = EventConsumer(config.kafka, [JUDGMENTS, TEACHER], dc.group_id, deadletter=producer)
    dispatcher = Dispatcher(config, store, producer)
    log.info(
        "dispatcher running",
        extra={
            "mode": dc.mode,
            "judge_ids": dc.judge_ids,
            "combine": dc.judge_combine,
            "owner": dispatcher.owner,
        },
    )
    try:
        await serve(
            consumer,
            dispatcher.handle,
            idle=dispatcher.maybe_sweep,
            install_signals=install_signals,
            stop=stop,
        )
    finally:
        await producer.stop()
        await redis.aclose()
