"""``turnstream pairer``: pairs every turn with its next state (``turns`` -> ``turns.paired``).

The next state of turn n is everything turn n+1's request adds after turn n's assistant message (a user
message, or one or more tool results, with their roles). If that request's history does not hold turn n's
response where expected, the pairing uses its last message and is flagged ``misaligned``. A session-done turn,
the turn a ``SessionEnded`` names (``sessions.ended``: a client ended the session on a side request, or the proxy
saw the client regenerate the turn's answer), and a
session idle longer than ``pairer.idle_timeout_s``, get a terminal pairing.

State (the last turn of each open session, and session ends that arrived before the turn they name: the two
topics are not ordered with each other) lives in Redis and is rebuilt by replaying both topics. Idle decisions
use event time when a later turn arrives (so a replay pairs exactly as live operation did) and wall-clock time
in the periodic sweep, which waits while the pairer is behind: a backlog (a replay, a restart after downtime)
may still hold the next turn of a session that looks idle by the clock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import cast

import redis.asyncio as aioredis
from prometheus_client import Counter

from runtime.configuration.config import Config
from runtime.messaging.bus import EventConsumer, EventProducer, Record, serve
from runtime.observability.metrics import serve_metrics
from runtime.pipeline.envelopes import conversation, visible_answer
from runtime.transport.redis_urls import redis_client
from schemas import Message, PairedTurn, SessionEnded, Turn, decode, encode
from schemas.topics import SESSIONS_ENDED, TURNS, TURNS_PAIRED

log = logging.getLogger("turnstream.pairer")

PAIRS = Counter("turnstream_pairer_pairs_total", "Paired turns emitted", ["kind"])
SKIPPED = Counter("turnstream_pairer_skipped_total", "Turns not paired again", ["reason"])
ENDS = Counter(
    "turnstream_pairer_session_ends_total",
    "Session ends from side requests, by what they did",
    ["outcome"],
)
UNPAIRED = Counter(
    "turnstream_pairer_unpaired_total",
    "Turns closed without a next state (nothing to judge or learn from), by why: no_session (a session of one "
    "turn that went idle: the client sent no session id and its next request did not continue this one), "
    "idle_timeout, session_done, regenerated",
    ["reason"],
)
ENDED_TTL_S = 7 * 86400
"""How long a session end waits for the turn it names (a turn the proxy dropped never comes)."""

# Delete the session's state only if it is still the turn the sweep looked at (another pairer may have moved on).
_COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 1
end
return 0
"""


def _arguments(raw: str) -> object:
    """Tool-call arguments as data: a client that re-serialises the JSON (other spacing, key order) sent the
    same call. Arguments that are not JSON compare as text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _calls(m: Message) -> list[tuple[str, object]]:
    return [(c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls or ()]


def _text(m: Message) -> str:
    return visible_answer(m.text).strip()


def same_response(history: Message, response: Message) -> bool:
    """Whether a history message is the recorded response (clients may drop reasoning or re-serialize)."""
    return (
        history.role == "assistant"
        and _text(history) == _text(response)
        and _calls(history) == _calls(response)
    )


def next_state(prev: Turn, following: Turn) -> tuple[list[Message], bool]:
    """(next state, misaligned) of ``prev`` given the request of the session's following turn.

    Messages a client sends with one request only (OpenClaw's internal-context block, ``runtime/pipeline/envelopes.py``)
    are neither history nor next state: both requests are read without them. Where the response is not at the
    expected place, the newest copy of it in the history still aligns (a client that trimmed old history)."""
    msgs = conversation(following.messages)
    n = len(conversation(prev.messages))
    if len(msgs) > n + 1 and same_response(msgs[n], prev.response):
        return msgs[n + 1 :], False
    for i in range(len(msgs) - 2, -1, -1):
        if same_response(msgs[i], prev.response):
            return msgs[i + 1 :], False
    return [msgs[-1] if msgs else following.messages[-1]], True


def unpaired_reason(p: PairedTurn) -> str | None:
    """Why a pairing has no next state, with a session of one idle turn told apart (``no_session``)."""
    if p.terminal_reason == "idle_timeout" and p.turn.turn_index == 1:
        return "no_session"
    return p.terminal_reason


def _count(p: PairedTurn) -> None:
    if p.terminal_reason:
        PAIRS.labels(p.terminal_reason).inc()
        UNPAIRED.labels(unpaired_reason(p)).inc()
    else:
        PAIRS.labels("misaligned" if p.misaligned else "next_state").inc()


def _ended(raw: bytes | None) -> tuple[int | None, str]:
    """A remembered session end: ``"N reason"`` (or ``"N"``, written before ends had reasons)."""
    if raw is None:
        return None, "session_done"
    n, _, reason = raw.decode().partition(" ")
    return int(n), reason or "session_done"


class Pairer:
    def __init__(
        self,
        config: Config,
        redis: aioredis.Redis,
        producer: EventProducer,
        behind: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.config = config
        self.behind = behind
        self.redis = redis
        self.producer = producer
        self.timeout = config.pairer.idle_timeout_s
        self._state_ttl_ms = int(config.pairer.state_ttl_s * 1000)
        prefix = config.redis.key_prefix
        self._state = prefix + "pairer:s:"
        self._ended = prefix + "pairer:ended:"
        self._idle = config.redis.pairer_idle_key
        self._cad = redis.register_script(_COMPARE_AND_DELETE)
        self._last_sweep = 0.0

    async def handle(self, batch: list[Record[Turn | SessionEnded]]) -> None:
        for rec in batch:
            if isinstance(rec.event, SessionEnded):
                await self.on_session_ended(rec.event)
            else:
                await self.on_turn(rec.event)

    async def on_session_ended(self, ended: SessionEnded) -> None:
        """Close the turn the end names; if it has not arrived yet, remember the end for it."""
        sid, n = ended.session_id, ended.after_turn_index
        raw = cast(bytes | None, await self.redis.get(self._state + sid))
        prev = decode(raw, Turn) if raw else None
        if raw is not None and prev is not None and (n is None or prev.turn_index == n):
            await self._close(sid, raw, prev, ended.reason)
            ENDS.labels("closed").inc()
        elif prev is not None and prev.turn_index > (n or 0):
            # the session went on after the end: its next turn paired the named one
            ENDS.labels("stale").inc()
        elif not n:
            ENDS.labels("no_open_turn").inc()
        else:
            await self.redis.set(self._ended + sid, f"{n} {ended.reason}", ex=ENDED_TTL_S)
            ENDS.labels("waiting").inc()

    async def on_turn(self, turn: Turn) -> None:
        key = self._state + turn.session_id
        # the client does not decode responses
        raw, ended_raw = cast(list[bytes | None], await self.redis.mget(key, self._ended + turn.session_id))
        prev = decode(raw, Turn) if raw else None
        ended_after, end_reason = _ended(ended_raw)
        session_done = turn.session_done or ended_after == turn.turn_index
        out: list[PairedTurn] = []
        if prev is not None:
            if turn.turn_index <= prev.turn_index:
                SKIPPED.labels("duplicate_or_old").inc()
                return
            if turn.created_at - prev.completed_at > self.timeout:
                out.append(self._terminal(prev, "idle_timeout"))
            else:
                state, misaligned = next_state(prev, turn)
                if misaligned:  # counted in turnstream_pairer_pairs_total{kind="misaligned"}
                    log.warning(
                        "the next request's history does not hold the recorded response; paired with its last"
                        " message",
                        extra={"turn_id": prev.turn_id, "next_turn_id": turn.turn_id},
                    )
                out.append(
                    PairedTurn(turn=prev, next_state=state, paired_at=time.time(), misaligned=misaligned)
                )
        if session_done:
            out.append(self._terminal(turn, "session_done" if turn.session_done else end_reason))
            if ended_after == turn.turn_index:
                ENDS.labels("closed").inc()
        for paired in out:
            await self.producer.send(TURNS_PAIRED, paired, turn.session_id)
            _count(paired)
        pipe = self.redis.pipeline(transaction=True)
        if ended_after is not None and ended_after <= turn.turn_index:  # used, or outrun by the session
            pipe.delete(self._ended + turn.session_id)
        if session_done:
            pipe.delete(key)
            pipe.zrem(self._idle, turn.session_id)
        else:
            pipe.set(key, encode(turn), px=self._state_ttl_ms)
            pipe.zadd(self._idle, {turn.session_id: turn.completed_at})
        await pipe.execute()

    def _terminal(self, turn: Turn, reason: str) -> PairedTurn:
        return PairedTurn(turn=turn, next_state=None, paired_at=time.time(), terminal_reason=reason)

    async def sweep(self, now: float | None = None) -> int:
        """Terminal pairings for sessions idle past the timeout. Returns how many were closed."""
        now = time.time() if now is None else now
        closed = 0
        for sid in await self.redis.zrangebyscore(self._idle, "-inf", now - self.timeout, start=0, num=500):
            sid_s = sid.decode() if isinstance(sid, bytes) else str(sid)
            key = self._state + sid_s
            raw = cast(bytes | None, await self.redis.get(key))
            if raw is None:  # expired (pairer.state_ttl_s) before any sweep closed it
                await self.redis.zrem(self._idle, sid_s)
                SKIPPED.labels("state_expired").inc()
                continue
            await self._close(sid_s, raw, decode(raw, Turn), "idle_timeout")
            closed += 1
        return closed

    async def _close(self, sid: str, raw: bytes, turn: Turn, reason: str) -> None:
        """A terminal pairing for the session's open turn, then its state dropped unless another pairer has
        moved the session on meanwhile."""
        paired = self._terminal(turn, reason)
        await self.producer.send(TURNS_PAIRED, paired, sid)
        _count(paired)
        await self._cad(keys=[self._state + sid, self._idle], args=[raw, sid])

    async def maybe_sweep(self) -> None:
        now = time.time()
        if now - self._last_sweep >= self.config.pairer.sweep_interval_s:
            if self.behind is not None and await self.behind():
                SKIPPED.labels("sweep_while_behind").inc()
                return
            self._last_sweep = now
            await self.sweep(now)


async def run_pairer(
    config: Config, *, install_signals: bool = True, stop: asyncio.Event | None = None
) -> None:
    """Run until SIGTERM/SIGINT (or ``stop`` is set): the in-flight batch finishes and is committed."""
    serve_metrics(config.metrics.port, config.metrics.host)
    redis = redis_client(config.redis.url)
    producer = EventProducer(config.kafka, client_id=f"{config.kafka.client_id}-pairer")
    await producer.start()
    consumer = EventConsumer(
        config.kafka, [TURNS, SESSIONS_ENDED], config.pairer.group_id, deadletter=producer
    )
    pairer = Pairer(config, redis, producer, behind=consumer.behind)
    log.info(
        "pairer running",
        extra={"group": config.pairer.group_id, "idle_timeout_s": config.pairer.idle_timeout_s},
    )
    try:
        await serve(
            consumer, pairer.handle, idle=pairer.maybe_sweep, install_signals=install_signals, stop=stop
        )
    finally:
        await producer.stop()
        await redis.aclose()


__all__ = ["Pairer", "next_state", "run_pairer", "same_response"]
