"""``turnstream proxy``: the OpenAI-compatible front door. Serves every request from the policy engine and
records each main-line turn, after the response completed, without the user ever waiting on the recording."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.configuration.config import Config
from runtime.engine.client import (
    EXACT_NON_STREAMED,
    EXACT_STREAMED,
    EngineClient,
    EngineError,
    EngineTimeout,
    adapter_version,
    close_engine_pool,
    version_number,
)
from runtime.security.erasure.keys import SessionForgotten
from runtime.security.erasure.sealing import session_keys
from runtime.transport.resp import command
from runtime.transport.sse import data_batches
from schemas import SessionEnded
from services.proxy.adapters import Adapters, with_version, without_adapter
from services.proxy.additions import client_wants, strip_response, strip_stream_chunk
from services.proxy.asgi import ChatFirst, EventStream, ThenRecord, openai_error
from services.proxy.continuity import Asked, Continuity, Links, Resolved, SessionWatch, answered, links
from services.proxy.keys import ProxyKeys
from services.proxy.per_key import LIMITED, PerKey
from services.proxy.recorder import TurnRecorder
from services.proxy.sampling import OPENAI_SAMPLING, resolve_sampling_defaults
from services.proxy.session import (
    SessionError,
    SessionInfo,
    new_session_id,
    recorded_id,
    session_info,
    shown_id,
)
from services.proxy.turn_numbers import FENCED, TurnNumbers
from services.proxy.turns import (
    DROPPED,
    REFUSED,
    RESCORED,
    Completion,
    UnrecordableTurn,
    build_turn,
    modified_logits,
)
from services.proxy.validation import (
    HEAVY_VALUES,
    PARSE_IN_THREAD_BYTES,
    BadInput,
    BodyLimits,
    count_values,
    parse_chat,
    read_body,
    too_many_large,
)
from services.proxy.versions import ServedVersions

log = logging.getLogger("turnstream.proxy")

REQUESTS = Counter("turnstream_proxy_requests_total", "Chat requests", ["turn_type", "stream", "status"])
LATENCY = Histogram("turnstream_proxy_request_seconds", "Time to the complete response", ["stream"])
SESSIONS_ENDED = Counter(
    "turnstream_proxy_sessions_ended_total", "Sessions ended by X-Session-Done on a side request"
)

# The hot path's label children, looked up once.
_OK = {turn_type: REQUESTS.labels(turn_type, "false", "200") for turn_type in ("main", "side")}
_LATENCY = {stream: LATENCY.labels(str(stream).lower()) for stream in (True, False)}

_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()


def engine_failure(exc: EngineError, turn_type: str, stream: str, headers: dict[str, str]) -> Response:
    """504 for a timeout, the engine's own 4xx passed through, 502 for anything else."""
    if isinstance(exc, EngineTimeout):
        status, message, err_type = 504, f"the model engine timed out: {exc}", "engine_timeout"
    else:
        status = exc.status if exc.status is not None and 400 <= exc.status < 500 else 502
        message, err_type = f"the model engine failed: {exc}", "engine_error"
    REQUESTS.labels(turn_type, stream, str(status)).inc()
    return openai_error(status, message, err_type, headers=headers)


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


def _answer(data: dict[str, Any]) -> dict[str, Any] | None:
    choices = data.get("choices") or ()
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    return message if isinstance(message, dict) else None


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


@dataclass
class ProxyState:
    config: Config
    engine: EngineClient
    turn_numbers: TurnNumbers
    recorder: TurnRecorder
    versions: ServedVersions = field(default_factory=ServedVersions)
    """What the engine serves (streamed turns are labelled from it; their chunks carry no version)."""
    sampling: dict[str, Any] = field(default_factory=lambda: dict(OPENAI_SAMPLING))
    """Pinned on every main turn where the client gave none, so the recorded values are the effective ones."""
    retokenize: Any = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    reloader: Any = None
    adapters: Adapters | None = None
    """Which LoRA adapter the policy's requests go to (``Config.lora_adapters``); None: the engine's own weights."""
    background: list[asyncio.Task[None]] = field(default_factory=list)
    """The reloader and the version probe: cancelled at shutdown."""
    continuity: Continuity | None = None
    """Which session a main turn without a session id continues (``proxy.session_inference``)."""


class ChatProxy:
    """The proxy's request handlers around one ``ProxyState`` (built at start-up, unless a test passes one)."""

    def __init__(self, config: Config, state: ProxyState | None = None) -> None:
        self.config = config
        self.pc = config.proxy
        self.keys = ProxyKeys(self.pc.api_key, self.pc.keys_file)
        self._state = state
        self.watch = SessionWatch()
        self.side_models = frozenset(self.pc.side_models)
        self.body_limits = BodyLimits(self.pc.max_messages, self.pc.max_values, self.pc.max_extra_bytes)
        self.in_flight = PerKey(self.pc.max_requests_per_key)
        self.large_bodies = PerKey(self.pc.large_bodies_per_key)

    @property
    def state(self) -> ProxyState:
        assert self._state is not None, "the proxy has not started"
        return self._state

    async def startup(self) -> None:
        if self._state is None:
            self._state = await build_state(self.config)

    async def shutdown(self) -> None:
        state = self._state
        if state is not None:
            # Turns still being labelled or re-scored first: a streamed turn's label waits for the next version
            # probe, which must still be running.
            if self.state.tasks:
                await asyncio.gather(*self.state.tasks, return_exceptions=True)
            # The reloader follows without a consumer group: nothing to commit, so it is cancelled, not awaited.
            for task in self.state.background:
                task.cancel()
            await asyncio.gather(*self.state.background, return_exceptions=True)
            await self.state.recorder.stop()
            await self.state.turn_numbers.aclose()
            await close_engine_pool()

    def authorized(self, request: Request) -> bool:
        return self.keys.user(request.headers.get("authorization")) is not None

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

    async def forgotten(self, fence: Fence) -> Response | None:
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
        return openai_error(
            410,
            f"session {fence.shown!r} was erased (turnstream forget) and cannot be written to again for a while; "
            "start a new session",
            "invalid_request_error",
            "session_forgotten",
        )

    def refusal(self) -> Response:
        return openai_error(401, "invalid or missing bearer token", "authentication_error", "invalid_api_key")

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        """Work after (or beside) a response: held until it finishes, awaited at shutdown."""
        task = asyncio.create_task(work)
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)

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

    def finish_turn(
        self,
        session: SessionInfo,
        index_task: asyncio.Future[int | None] | None,
        body: dict[str, Any],
        completion: Completion,
        created: float,
        version: int,
    ) -> None:
        assert session.session_id is not None
        if index_task is not None and not index_task.done():  # rare: Redis slower than the engine
            index_task.add_done_callback(
                lambda _: self.finish_turn(session, index_task, body, completion, created, version)
            )
            return
        # No number (Redis unreachable, now or when the request came): recorded unnumbered, numbered on publishing.
        index = index_task.result() if index_task is not None else None
        if index == FENCED:  # forgotten, and Redis said so only after the answer went out: never recorded
            DROPPED.labels("session_forgotten").inc()
            return

        def build() -> None:
            assert session.session_id is not None
            try:
                turn = build_turn(
                    session_id=session.session_id,
                    turn_index=index or 1,  # a placeholder when unnumbered
                    body=body,
                    completion=completion,
                    model=body.get("model") or self.pc.served_model_name,
                    created_at=created,
                    session_done=session.done,
                    fallback_version=version,
                    retokenize=self.state.retokenize,
                )
                self.state.recorder.record(turn, unnumbered=index is None)
            except UnrecordableTurn as exc:
                DROPPED.labels(exc.reason).inc()
                log.warning("served turn not recorded", extra={"reason": exc.reason, "error": str(exc)})
                return
            except Exception:  # a bug here must cost one turn (counted), never the worker or the response
                DROPPED.labels("internal_error").inc()
                log.exception("recording a turn failed")

        if completion.token_ids is None or completion.prompt_token_ids is None:
            # Re-tokenizing is slow: never on the event loop.
            self.background(asyncio.to_thread(build))
        else:
            build()

    async def chat(self, request: Request) -> Response:
        created = time.time()
        user = self.keys.user(request.headers.get("authorization"))
        if user is None:
            return self.refusal()
        if not self.in_flight.take(user, request.scope):
            LIMITED.labels("requests").inc()
            return openai_error(
                429,
                f"this key is at its limit of {self.pc.max_requests_per_key} requests in flight; try again when one "
                "has finished",
                "requests",
                "rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )

        def take_large() -> BadInput | None:
            if self.large_bodies.take(user, request.scope):
                return None
            LIMITED.labels("large_bodies").inc()
            return too_many_large(self.pc.large_bodies_per_key, self.pc.large_body_bytes)

        try:
            raw_body = await read_body(request, self.pc.max_body_bytes, self.pc.large_body_bytes, take_large)
            values = count_values(raw_body, self.body_limits)  # before anything is decoded
            if len(raw_body) > PARSE_IN_THREAD_BYTES or values > HEAVY_VALUES:
                if values > HEAVY_VALUES and len(raw_body) <= self.pc.large_body_bytes:
                    if (busy := take_large()) is not None:  # heavy by its values: a large body's slot too
                        raise busy
                body = await asyncio.to_thread(parse_chat, raw_body, self.body_limits, True)
            else:
                body = parse_chat(raw_body, self.body_limits, True)
            untagged = "side" if body.get("model") in self.side_models else self.pc.default_turn_type
            session = session_info(request.headers, body, untagged)
            if session.turn_type == "main" and len(raw_body) > self.pc.max_turn_bytes:
                raise BadInput(
                    413,
                    f"a main turn's request may be at most {self.pc.max_turn_bytes} bytes (this one has "
                    f"{len(raw_body)}): main turns are recorded, and a record must fit the event log's limit. "
                    "Shorten the conversation, or send the request as a side turn (X-Turn-Type: side), which "
                    "is served but not recorded",
                    "turn_too_large",
                )
        except BadInput as exc:
            return openai_error(exc.status, str(exc), exc.err_type, exc.code, headers=exc.headers)
        except SessionError as exc:
            return openai_error(400, str(exc), "invalid_request_error", "invalid_session")
        headers: dict[str, str] = {}
        owner = ""
        if self.keys.per_user:
            body["user"] = user  # recorded as the key's user, whatever the client wrote
            owner = user
        explicit = session.session_id is not None
        if session.session_id is not None:
            if session.turn_type == "main":
                headers["X-Session-Id"] = session.session_id
            session = SessionInfo(recorded_id(owner, session.session_id), session.turn_type, session.done)
        index: asyncio.Future[int | None] | None = None
        if session.turn_type == "side" and session.done and session.session_id is not None:
            self.end_session(session.session_id)
        if session.turn_type == "main" and (body.get("n") or 1) > 1:
            return openai_error(
                400,
                "a main turn is recorded as one response: 'n' must be 1 (send n > 1 as a side turn)",
                "invalid_request_error",
                "invalid_value",
            )
        pending: Pending | None = None
        fence: Fence | None = None
        if session.turn_type == "main":
            if self.pc.spool_full == "refuse" and self.state.recorder.full:
                REFUSED.labels("spool_full").inc()
                return openai_error(
                    503,
                    "turns cannot be recorded right now (the proxy's spool is full until the event log takes "
                    "what it holds); try again shortly, or send the request as a side turn (X-Turn-Type: side)",
                    "server_error",
                    "spool_full",
                    headers={"Retry-After": "5"},
                )
            if session.session_id is None:
                if self.pc.missing_session == "reject":
                    return openai_error(
                        400, "main turns need X-Session-Id", "invalid_request_error", "missing_session"
                    )
                shown = new_session_id()
                fresh = recorded_id(owner, shown)
                continuity = self.state.continuity
                if continuity is not None and not self.state.recorder.deferring:
                    # Which session this continues, resolved beside the engine's work (``settle``).
                    chain = links(request.headers, body)
                    pending = Pending(chain, fresh, continuity.ask(chain.continues, fresh), owner)
                else:
                    self.watch.count("new")
                session = SessionInfo(fresh, session.turn_type, session.done)
                headers["X-Session-Id"] = shown
            else:
                self.watch.count("explicit")
            # Numbered at arrival (a session's turns are numbered in order) but not waited for here: the Redis
            # round trip overlaps the engine's work instead of adding to the user's latency. While turns served
            # without Redis wait to be numbered, new ones queue behind them (see TurnRecorder.deferring).
            if pending is None and not self.state.recorder.deferring:
                index = asyncio.create_task(self.next_turn_index(session.session_id))  # type: ignore[arg-type]
            if explicit:
                fence = self.fence_check(session.session_id, headers["X-Session-Id"], index)  # type: ignore[arg-type]
        stream = bool(body.get("stream"))
        # What the client would get from SGLang itself: the proxy's own additions are taken out again.
        wants = client_wants(body, request.headers)
        forward = dict(body)
        if session.turn_type == "main":
            for (
                name,
                value,
            ) in self.state.sampling.items():  # the engine's defaults made explicit, so recorded
                if forward.get(name) is None:
                    forward[name] = value
            forward.update(EXACT_STREAMED if stream else EXACT_NON_STREAMED)
        elif stream:  # SGLang reads these from the body only when the proxy forwards no headers
            for key in ("input_ids", "output_ids"):
                if wants[key]:
                    forward[f"return_{key}_in_sglext"] = True
        leased = self.route(forward)
        if stream:
            return await self._stream(
                request, session, index, body, forward, wants, headers, created, leased, pending, fence
            )
        main = session.turn_type == "main"
        sent = time.perf_counter()
        try:
            if not main:  # side turns: the engine's bytes go back untouched, never parsed
                raw = await self.state.engine.chat_bytes(forward)
            else:
                data = await self.state.engine.chat_raw(forward)
        except EngineError as exc:
            if pending is not None:
                await self.abandon(pending)
            return engine_failure(exc, session.turn_type, "false", headers)
        finally:
            self.unroute(leased)
        if fence is not None and (refused := await self.forgotten(fence)) is not None:
            return refused
        if pending is not None:
            session, index = await self.settle(session, pending, headers)
            self.link(pending, session, _answer(data))
        # How long the engine took, as the proxy saw it (a standard header, shown by browsers and tracers): what a
        # client measures beyond it is the proxy's own time.
        headers["Server-Timing"] = f"engine;dur={1000 * (time.perf_counter() - sent):.2f}"
        _OK[session.turn_type].inc()
        _LATENCY[False].observe(time.time() - created)
        if not main:
            if leased is not None:  # the engine reports its base's version; the client's is the adapter's
                raw = _json_encoder.encode(with_version(_json_decoder.decode(raw), leased))
            return Response(raw, media_type="application/json", headers=headers)
        # The client's copy drops what the proxy asked for on its own account; recording needs the original.
        payload = dict(data, choices=[dict(c) for c in data.get("choices") or ()])
        strip_response(payload, wants)
        if leased is not None:
            payload = with_version(payload, leased)
        # The turn is built and recorded after the response has gone out: the user never waits for it.
        return ThenRecord(
            _json_encoder.encode(payload),
            headers,
            lambda: self.record_response(session, index, forward, data, created),
        )

    def route(self, forward: dict[str, Any]) -> int | None:
        """Every request through the proxy is the policy's: with adapters, it names the current one (the base
        while there is none). Returns the leased version, for ``unroute`` once the engine has answered."""
        adapters = self.state.adapters
        if adapters is None:
            return None
        version, name = adapters.lease()
        forward.pop("lora_path", None)
        model = forward.get("model")
        if isinstance(model, str):
            forward["model"] = without_adapter(model, adapters.served_model)
        if name is not None:
            forward["lora_path"] = name
        return version

    def unroute(self, leased: int | None) -> None:
        if leased is not None and self.state.adapters is not None:
            self.state.adapters.release(leased)

    def routed_version(self, body: dict[str, Any]) -> int | None:
        """The version a request went to, when the proxy chose its adapter (None: read it from the engine)."""
        if self.state.adapters is None:
            return None
        return adapter_version(str(body.get("lora_path") or "")) or 0

    def record_response(
        self,
        session: SessionInfo,
        index: asyncio.Future[int | None] | None,
        body: dict[str, Any],
        data: dict[str, Any],
        created: float,
    ) -> None:
        try:
            completion = Completion.from_response(data)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            DROPPED.labels("bad_engine_response").inc()
            log.warning("engine response not understood; turn not recorded", extra={"error": repr(exc)})
            return
        version = self.routed_version(body)
        if version is not None:  # the engine reports its base weights' version; the adapter is the policy's
            completion.weight_version = version
        else:
            version = completion.weight_version
        if version is None:
            version = self.state.versions.current
        if modified_logits(body) is None:
            self.finish_turn(session, index, body, completion, created, version)
            return
        self.background(self._rescore_then_finish(session, index, body, completion, created, version))

    async def _rescore_then_finish(
        self,
        session: SessionInfo,
        index: asyncio.Future[int | None] | None,
        body: dict[str, Any],
        completion: Completion,
        created: float,
        version: int,
    ) -> None:
        """The raw log-probs of a turn sampled from modified logits (see ``modified_logits``), from a prefill on
        the weights that produced it; a reload in between drops the turn (counted), it is never mislabelled."""
        reason = modified_logits(body) or "unknown"
        if completion.prompt_token_ids is None or completion.token_ids is None:
            DROPPED.labels("no_token_ids").inc()
            return
        routed = self.routed_version(body)
        if routed is not None and self.state.adapters is not None:  # no unload while it scores on the adapter
            self.state.adapters.hold(routed)
        try:
            scored = await self.state.engine.score(
                completion.prompt_token_ids, completion.token_ids, lora_path=body.get("lora_path")
            )
        except EngineError as exc:
            DROPPED.labels("rescore_failed").inc()
            log.warning("re-scoring a turn failed; not recorded", extra={"error": str(exc)})
            return
        finally:
            self.unroute(routed)
        if routed is None and version_number(scored.weight_version) != version:
            DROPPED.labels("rescore_version_moved").inc()
            return
        completion.logprobs = scored.logprobs
        RESCORED.labels(reason).inc()
        self.finish_turn(session, index, body, completion, created, version)

    async def _stream(
        self,
        request: Request,
        session: SessionInfo,
        index: asyncio.Future[int | None] | None,
        body: dict[str, Any],
        forward: dict[str, Any],
        wants: dict[str, bool],
        headers: dict[str, str],
        created: float,
        leased: int | None = None,
        pending: Pending | None = None,
        fence: Fence | None = None,
    ) -> Response:
        try:
            upstream = await self.state.engine.open_chat_stream(forward)
        except EngineError as exc:
            self.unroute(leased)
            if pending is not None:
                await self.abandon(pending)
            return engine_failure(exc, session.turn_type, "true", headers)
        except BaseException:  # cancelled (shutdown), or a bug: the lease still goes back
            self.unroute(leased)
            raise
        if fence is not None and (refused := await self.forgotten(fence)) is not None:
            self.unroute(leased)
            await upstream.aclose()
            return refused
        try:
            return await self._relay(
                upstream, session, index, forward, wants, headers, created, leased, pending
            )
        except BaseException:  # the lease back and the engine stream closed on every path, bugs included
            self.unroute(leased)
            await upstream.aclose()
            raise

    async def _relay(
        self,
        upstream: Any,
        session: SessionInfo,
        index: asyncio.Future[int | None] | None,
        forward: dict[str, Any],
        wants: dict[str, bool],
        headers: dict[str, str],
        created: float,
        leased: int | None,
        pending: Pending | None,
    ) -> Response:
        """The streamed response relaying an open engine stream (which the response then owns and closes)."""
        if pending is not None:  # the session's id is a response header: known before the first byte
            session, index = await self.settle(session, pending, headers)
        closed = False

        async def close() -> None:
            """The lease back and the engine stream closed, once: at the relay's end, or at the response's end
            when the relay never started."""
            nonlocal closed
            if not closed:
                closed = True
                self.unroute(leased)
                await upstream.aclose()

        main = session.turn_type == "main"
        strip = main and not (wants["logprobs"] and wants["input_ids"] and wants["output_ids"])
        epoch = self.state.versions.epoch  # where in the served-version history this stream began

        async def relay() -> AsyncGenerator[tuple[bytes, bool], None]:
            # The events of one network read go to the client in one write, as soon as the read is split: real
            # streaming (a token-paced engine gives one event per read), and a burst costs one write, not one each.
            completion = Completion()
            complete = ended = False
            # This read's events: those before a failure still go out, ahead of the error event.
            out: list[bytes] = []
            try:
                async for payloads in data_batches(upstream.aiter_bytes()):
                    for payload in payloads:
                        if payload == b"[DONE]":
                            complete = ended = True
                            if pending is not None:  # stored before the client has the last byte
                                self.link(pending, session, completion.answer())
                            out.append(b"data: [DONE]\n\n")
                            break
                        if main:
                            chunk = _json_decoder.decode(payload)
                            if "error" in chunk and "choices" not in chunk:
                                ended = True
                                out.append(b"data: " + payload + b"\n\n")
                                break
                            completion.add_chunk(chunk)
                            if strip:
                                if not strip_stream_chunk(chunk, wants):
                                    continue  # the proxy's own sglext chunk: not the client's
                                payload = _json_encoder.encode(chunk)
                        out.append(b"data: " + payload + b"\n\n")
                    piece, out = b"".join(out), []
                    yield piece, ended
                    if ended:
                        break
            except (
                Exception
            ) as exc:  # the engine broke off mid-stream: tell the client in-band, record nothing
                log.warning("engine stream broke off", extra={"error": repr(exc)})
                err = {
                    "error": {
                        "message": f"the model engine failed mid-stream: {exc}",
                        "type": "engine_error",
                        "param": None,
                        "code": None,
                    }
                }
                out.append(b"data: " + _json_encoder.encode(err) + b"\n\n")
                yield b"".join(out), True
            finally:
                await close()
                REQUESTS.labels(session.turn_type, "true", "200" if complete else "aborted").inc()
                _LATENCY[True].observe(time.time() - created)
                if main:
                    if complete:
                        self.background(
                            self._label_then_finish(session, index, forward, completion, created, epoch)
                        )
                    else:
                        DROPPED.labels("stream_incomplete").inc()
                        if pending is not None:
                            self.background(self.abandon(pending, settled=True))

        return EventStream(relay(), headers, on_close=close)

    async def _label_then_finish(
        self,
        session: SessionInfo,
        index: asyncio.Future[int | None] | None,
        body: dict[str, Any],
        completion: Completion,
        created: float,
        epoch: int,
    ) -> None:
        routed = self.routed_version(body)
        try:
            version = routed if routed is not None else await self.state.versions.label(epoch)
        except asyncio.CancelledError:  # shutting down: the oldest version known so far, never a newer one
            version = self.state.versions.oldest_since(epoch)
        if modified_logits(body) is None:
            self.finish_turn(session, index, body, completion, created, version)
        else:
            await self._rescore_then_finish(session, index, body, completion, created, version)

    async def models(self, request: Request) -> Response:
        if not self.authorized(request):
            return self.refusal()
        try:
            data = await self.state.engine.models()
        except EngineError as exc:
            return openai_error(502, f"the model engine failed: {exc}", "engine_error")
        return JSONResponse({"object": "list", "data": data})

    async def healthz(self, _: Request) -> Response:
        engine_ok = await self.state.engine.health()
        body = {
            "status": "ok" if engine_ok else "degraded",
            "engine": engine_ok,
            "spool_pending": self.state.recorder.pending,
            "weight_version": self.state.versions.current,
        }
        return JSONResponse(body, status_code=200 if engine_ok else 503)

    async def metrics(self, request: Request) -> Response:
        """Behind the keys like the API (Prometheus without them reads ``metrics.port`` instead)."""
        if not self.authorized(request):
            return self.refusal()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def create_app(config: Config, state: ProxyState | None = None) -> Any:
    """A plain Starlette app: the proxy's hot path has no use for FastAPI's validation layer."""
    proxy = ChatProxy(config, state)

    @contextlib.asynccontextmanager
    async def _lifespan(_: Starlette) -> AsyncIterator[None]:
        await proxy.startup()
        try:
            yield
        finally:
            await proxy.shutdown()

    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return openai_error(500, "internal error in the proxy", "internal_error")

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", proxy.chat, methods=["POST"]),
            Route("/v1/models", proxy.models, methods=["GET"]),
            Route("/healthz", proxy.healthz, methods=["GET"]),
            Route("/metrics", proxy.metrics, methods=["GET"]),
        ],
        lifespan=_lifespan,
        exception_handlers={Exception: _unexpected},
    )
    return ChatFirst(app, proxy.chat)


async def build_state(config: Config) -> ProxyState:
    from pathlib import Path

    from runtime.engine.model_store import cache_dir

    pc = config.proxy
    engine = EngineClient(
        config.engine.url,
        api_key=config.engine.api_key,
        timeout_s=config.engine.timeout_s,
        retries=config.engine.retries,
    )
    spool_dir = Path(pc.spool_dir) if pc.spool_dir else cache_dir() / "spool" / f"proxy-{pc.port}"
    # Where the data keys live in the turn numbers' Redis (the default), numbering also checks the erasure fence.
    same_redis = config.kafka.seal_keys_url and config.kafka.seal_keys_url == config.redis.url
    turn_numbers = TurnNumbers(
        config.redis.url,
        config.redis.key_prefix,
        session_ttl_s=config.redis.session_ttl_s,
        fences=config.kafka.seal_keys_prefix.encode() if same_redis else None,
    )
    recorder = TurnRecorder(
        config.kafka,
        spool_dir,
        linger_s=pc.spool_linger_ms / 1000,
        number_once=turn_numbers.number_once,
        max_bytes=pc.spool_max_bytes,
        when_full=pc.spool_full,
        stop_write_timeout_s=pc.spool_stop_timeout_s,
    )
    await recorder.start()
    state = ProxyState(config=config, engine=engine, turn_numbers=turn_numbers, recorder=recorder)
    if pc.session_inference == "on":  # over the turn numbers' connection: one pipelined connection per proxy
        state.continuity = Continuity(
            turn_numbers.redis,
            config.redis.key_prefix,
            pc.session_link_ttl_s,
            session_ttl_s=config.redis.session_ttl_s,
        )
    if pc.tokenizer_path:
        from services.proxy.retokenize import Retokenizer

        state.retokenize = Retokenizer(pc.tokenizer_path)
    info: dict[str, Any] = {}
    with contextlib.suppress(EngineError, KeyError, ValueError):
        info = await engine.model_info()
    state.versions = ServedVersions(version_number(info.get("weight_version")))
    if config.lora_adapters:  # a restarted proxy finds the adapters the engine already has
        served = info.get("served_model_name")
        state.adapters = Adapters(served if isinstance(served, str) else None)
        # Under a gate the newest adapter may be a candidate no user may see: the base until the reloader has
        # read the decisions.
        with contextlib.suppress(EngineError, KeyError, ValueError):
            if not config.gate.enabled:
                state.adapters.serve(max(await engine.adapter_versions(), default=0))
        state.versions = ServedVersions(state.adapters.current)
    state.sampling = resolve_sampling_defaults(pc.sampling_defaults, info)
    if info and not (info.get("tool_call_parser") or info.get("reasoning_parser")):
        log.warning(
            "the engine runs without a tool-call or reasoning parser: SGLang then drops the log-prob of a streamed "
            "step that has no text (the final EOS), and such streamed turns are not recorded (token_mismatch). "
            "Start it with --tool-call-parser (turnstream engine does)."
        )
    if pc.reload:
        from services.proxy.reloader import Reloader

        root = Path(pc.weights_root) if pc.weights_root else cache_dir() / "weights"
        # Its own client: a load is not retried blindly (it checks /model_info instead) and may take minutes.
        # The only holder of the admin key: weight updates, pauses and adapters take nothing else.
        loader = EngineClient(
            config.engine.url,
            api_key=config.engine.api_key,
            admin_api_key=config.engine.admin_api_key,
            timeout_s=pc.reload_timeout_s,
            retries=0,
        )

        async def held(version: int) -> bool:  # PTTL: -2 no such key, else the milliseconds it has left
            key = config.redis.eval_hold_key(version).encode()
            return int(await turn_numbers.redis.send(command(b"PTTL", key))) > 0

        state.reloader = Reloader(
            config.kafka, loader, root, state.versions, held=held, adapters=state.adapters, gate=config.gate
        )
        state.background.append(asyncio.create_task(state.reloader.run()))
    on_change = state.reloader.engine_changed if state.reloader is not None else None
    probe_client = EngineClient(config.engine.url, api_key=config.engine.api_key, timeout_s=10.0, retries=0)

    async def probe() -> int:
        if state.adapters is not None:  # the newest adapter loaded: 0 after an engine restart lost them
            loaded = await probe_client.adapter_versions()
            if config.gate.enabled:  # the newest may be a candidate beside: the served one, if still loaded
                return state.adapters.current if state.adapters.current in loaded else 0
            return max(loaded, default=0)
        return version_number((await probe_client.model_info()).get("weight_version"))

    state.background.append(
        asyncio.create_task(state.versions.run(probe, pc.version_probe_s, on_change=on_change))
    )
    return state
