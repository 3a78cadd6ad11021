"""How a main turn finds its session and number: explicit ids fenced after ``turnstream forget``, inferred sessions
resolved beside the engine's work (``services/proxy/continuity.py``), numbers from Redis that never hold up the
user, and the links an answer leaves for the client's next request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from runtime.configuration.config import Config, ProxyConfig
from runtime.security.erasure.keys import SessionForgotten
from runtime.security.erasure.sealing import session_keys
from schemas import SessionEnded
from services.proxy.continuity import Asked, Links, Resolved, SessionWatch, answered
from services.proxy.session import SessionInfo, shown_id
from services.proxy.turn_numbers import FENCED
from services.proxy.turns import REFUSED
from services.proxy.validation import BadInput

if TYPE_CHECKING:
    from services.proxy.state import ProxyState

log = logging.getLogger("turnstream.proxy")

SESSIONS_ENDED = Counter(
    "turnstream_proxy_sessions_ended_total", "Sessions ended by X-Session-Done on a side request"
)
REGENERATED = Counter(
    "turnstream_proxy_regenerated_total",
    "Turns superseded by a branch of their conversation (the client edited or regenerated a message)",
)


@dataclass
class Pending:
    """A main turn whose session is being inferred (``services/proxy/continuity.py``)."""

    chain: Links
    fresh: str
    asked: Asked
    owner: str
    """The namespace of the caller's sessions (``recorded_id``): the header shows the id without it."""
    resolved: Resolved | None = None
    done: bool = False
    """``resolved`` is final (None then: Redis did not answer in time)."""


def _link_stored(sent: asyncio.Future[Any]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("storing a conversation link failed", extra={"error": repr(sent.exception())})


@dataclass(frozen=True)
class Fence:
    """A session's forgotten check in flight (``ChatProxy.fence_check``)."""

    check: asyncio.Future[Any]
    """The session's turn number (``FENCED``), or its data key (``SessionForgotten``)."""
    shown: str
    """The id the client knows the session by."""


def _retrieved(check: asyncio.Future[Any]) -> None:
    """A check nobody waited for still has its outcome read (no 'exception never retrieved')."""
    if not check.cancelled():
        check.exception()


class SessionFlow:
    """The session side of ``ChatProxy`` (``services/proxy/app.py``)."""

    config: Config
    pc: ProxyConfig
    watch: SessionWatch

    if TYPE_CHECKING:  # ChatProxy's

        @property
        def state(self) -> ProxyState: ...

        def background(self, work: Coroutine[Any, Any, None]) -> None: ...

    def fence_check(
        self, session_id: str, shown: str, index: asyncio.Future[int | None] | None
    ) -> Fence | None:
        """Whether a session named by its client was forgotten (``turnstream forget`` fences it), asked beside the
        engine's work: the answer is waited for only before the response goes out. Where the data keys share the
        turn numbers' Redis, the numbering answers it (``FENCED``) at no extra cost; else the session's data key
        is made or fetched, which the recorder needs anyway (then from this process's cache)."""
        if self.state.turn_numbers.fences is not None:
            return Fence(index, shown) if index is not None else None
        store = session_keys(self.config.kafka)
        if store is None:  # sealing off: nothing to forget by
            return None
        check = asyncio.ensure_future(store.for_writing(session_id))
        check.add_done_callback(_retrieved)
        return Fence(check, shown)

    async def forgotten(self, fence: Fence) -> BadInput | None:
        """A 410 when the session is fenced; None when it is not, or when Redis cannot say in time (the recorder
        asks again, and drops the turn, counted, if it is)."""
        check = fence.check
        if not check.done():
            await asyncio.wait((check,), timeout=self.pc.redis_timeout_ms / 1000)
        if not check.done() or check.cancelled():
            return None
        if check.exception() is not None:
            if not isinstance(check.exception(), SessionForgotten):
                return None
        elif check.result() != FENCED:
            return None
        REFUSED.labels("session_forgotten").inc()
        return BadInput(
            410,
            f"session {fence.shown!r} was erased (turnstream forget) and cannot be written to again for a while; "
            "start a new session",
            "session_forgotten",
        )

    async def _turn_number(self, read: Awaitable[int], without: str, session_id: str) -> int | None:
        """A turn number from Redis within ``proxy.redis_timeout_ms``, or None (logged with what happens
        ``without`` it): Redis trouble must not fail the user's request."""
        try:
            async with asyncio.timeout(self.pc.redis_timeout_ms / 1000):  # no extra task, unlike wait_for
                return await read
        except Exception as exc:
            log.warning(
                f"turn numbering unavailable; {without}", extra={"session_id": session_id, "error": repr(exc)}
            )
            return None

    async def next_turn_index(self, session_id: str) -> int | None:
        return await self._turn_number(
            self.state.turn_numbers.next(session_id), "the turn is numbered when published", session_id
        )

    async def resolve(self, pending: Pending) -> Resolved | None:
        """The session a turn without a session id continues, and its number there (once per turn); None when
        Redis did not answer in time (then the turn starts a session of its own, numbered when published)."""
        if pending.done:
            return pending.resolved
        continuity = self.state.continuity
        assert continuity is not None
        try:
            async with asyncio.timeout(self.pc.redis_timeout_ms / 1000):
                pending.resolved = await continuity.resolve(pending.asked)
        except Exception as exc:
            log.warning(
                "session inference unavailable; the turn starts a session of its own",
                extra={"session_id": pending.fresh, "error": repr(exc)},
            )
        pending.done = True
        return pending.resolved

    async def settle(
        self, session: SessionInfo, pending: Pending, headers: dict[str, str]
    ) -> tuple[SessionInfo, asyncio.Future[int | None] | None]:
        """The resolved session and turn number of a turn whose session was inferred; a branch closes the turn it
        supersedes as ``regenerated``."""
        resolved = await self.resolve(pending)
        self.watch.count(resolved.how if resolved is not None else "unresolved")
        if resolved is None:
            return session, None
        if resolved.superseded is not None:
            sid, n = resolved.superseded
            self.state.recorder.record_session_end(
                SessionEnded(session_id=sid, after_turn_index=n, ended_at=time.time(), reason="regenerated")
            )
            REGENERATED.inc()
        headers["X-Session-Id"] = shown_id(pending.owner, resolved.session_id)
        index: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        index.set_result(resolved.turn_index)
        return SessionInfo(resolved.session_id, session.turn_type, session.done), index

    async def abandon(self, pending: Pending, settled: bool = False) -> None:
        """A turn that resolved a session but got no answer: its link and number are given back (the client's
        retry continues the session instead of branching from it)."""
        resolved = pending.resolved if settled else await self.resolve(pending)
        continuity = self.state.continuity
        if resolved is None or continuity is None:
            return
        try:
            async with asyncio.timeout(self.pc.redis_timeout_ms / 1000):
                await continuity.release(pending.chain.continues, resolved)
        except Exception as exc:
            log.warning("giving back an unanswered turn's session failed", extra={"error": repr(exc)})

    def link(
        self,
        pending: Pending,
        session: SessionInfo,
        answer: dict[str, Any] | None,
    ) -> None:
        """Store the link this turn's answer makes, so the client's next request continues the session."""
        continuity = self.state.continuity
        if continuity is None or pending.resolved is None or answer is None or session.done:
            return
        try:
            reply = continuity.link(
                answered(pending.chain.state, answer),
                pending.resolved.session_id,
                pending.resolved.turn_index,
            )
        except Exception as exc:  # never the user's response
            log.warning("storing a conversation link failed", extra={"error": repr(exc)})
            return
        if reply is not None:  # Redis sends a reply (no CLIENT REPLY, or not connected yet): read by nobody
            asyncio.ensure_future(reply).add_done_callback(_link_stored)

    def end_session(self, session_id: str) -> None:
        """A side request ended the session (``X-Session-Done``): spool a ``SessionEnded`` naming the session's
        last main turn, which then gets a terminal pairing, as OpenClaw-RL does. In the background: the user
        never waits on Redis."""

        async def record() -> None:
            index = await self._turn_number(
                self.state.turn_numbers.current(session_id),
                "the session end closes whichever turn is open",
                session_id,
            )
            self.state.recorder.record_session_end(
                SessionEnded(session_id=session_id, after_turn_index=index, ended_at=time.time())
            )
            SESSIONS_ENDED.inc()

        self.background(record())
