"""``turnstream proxy``: the front door. Serves every request from the policy engine and records each main-line
turn, after the response completed, without the user ever waiting on the recording. Chat completions go to the
engine as they are; the Responses and Messages APIs (``services/proxy/apis/``) are translated to the same chat
request on the way in and back to their own shapes on the way out, over this one serving path."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

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
    close_engine_pool,
)
from runtime.transport.sse import data_batches
from services.proxy.adapters import with_version
from services.proxy.additions import client_wants, strip_response, strip_stream_chunk
from services.proxy.apis.base import Api, Events, Exchange
from services.proxy.apis.messages import FIELDS as MESSAGES_FIELDS
from services.proxy.apis.messages import MESSAGES, anthropic_error
from services.proxy.apis.responses import FIELDS as RESPONSES_FIELDS
from services.proxy.apis.responses import RESPONSES
from services.proxy.asgi import ChatFirst, EventStream, RecordedFirst, openai_error
from services.proxy.call import Call
from services.proxy.continuity import SessionWatch, links
from services.proxy.keys import ProxyKeys
from services.proxy.per_key import LIMITED, PerKey
from services.proxy.recording import Recording
from services.proxy.replicas import Replica, cost, opening_key
from services.proxy.session import (
    SessionError,
    SessionInfo,
    new_session_id,
    recorded_id,
    session_info,
    shown_id,
)
from services.proxy.session_flow import Fence, Pending, SessionFlow
from services.proxy.side_calls import chat_side_call
from services.proxy.state import ProxyState, build_state
from services.proxy.turns import DROPPED, REFUSED, Completion
from services.proxy.validation import (
    HEAVY_VALUES,
    PARSE_IN_THREAD_BYTES,
    BadInput,
    BodyLimits,
    check_chat,
    count_values,
    parse_chat,
    parse_object,
    read_body,
    too_many_large,
)

log = logging.getLogger("turnstream.proxy")

REQUESTS = Counter("turnstream_proxy_requests_total", "Chat requests", ["turn_type", "stream", "status"])
KEYS_RELOADS = Counter(
    "turnstream_proxy_keys_reloads_total",
    "Times the keys file changed: ok (its keys in use), refused (unusable: the keys in use stayed)",
    ["outcome"],
)
FAILOVERS = Counter(
    "turnstream_proxy_failovers_total",
    "Requests sent to another policy replica because the one chosen gave no answer",
    ["replica"],
)
T = TypeVar("T")
LATENCY = Histogram("turnstream_proxy_request_seconds", "Time to the complete response", ["stream"])

# The hot path's label children, looked up once.
_OK = {turn_type: REQUESTS.labels(turn_type, "false", "200") for turn_type in ("main", "side")}
_LATENCY = {stream: LATENCY.labels(str(stream).lower()) for stream in (True, False)}

_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()
_FIELDS = {"responses": RESPONSES_FIELDS, "messages": MESSAGES_FIELDS}


def engine_failure(exc: EngineError, turn_type: str, stream: str) -> BadInput:
    """504 for a timeout, the engine's own 4xx passed through, 502 for anything else."""
    if isinstance(exc, EngineTimeout):
        status, message, err_type = 504, f"the model engine timed out: {exc}", "engine_timeout"
    else:
        status = exc.status if exc.status is not None and 400 <= exc.status < 500 else 502
        message, err_type = f"the model engine failed: {exc}", "engine_error"
    REQUESTS.labels(turn_type, stream, str(status)).inc()
    return BadInput(status, message, None, err_type)


def _answer(data: dict[str, Any]) -> dict[str, Any] | None:
    choices = data.get("choices") or ()
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    return message if isinstance(message, dict) else None


def _kept(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer as a stored conversation keeps it: what the client would send back."""
    kept = {"role": "assistant", "content": answer.get("content")}
    if answer.get("tool_calls"):
        kept["tool_calls"] = answer["tool_calls"]
    return kept


class ChatProxy(SessionFlow, Recording):
    """The proxy's request handlers around one ``ProxyState`` (built at start-up, unless a test passes one)."""

    def __init__(self, config: Config, state: ProxyState | None = None) -> None:
        self.config = config
        self.pc = config.proxy
        self.keys = ProxyKeys(self.pc.api_key, self.pc.keys_file)
        self._state = state
        self.watch = SessionWatch()
        self.side_models = frozenset(self.pc.side_models)
        self.body_limits = BodyLimits(
            self.pc.max_messages,
            self.pc.max_values,
            self.pc.max_extra_bytes,
            tuple(self.pc.media_url_prefixes),
        )
        self.in_flight = PerKey(self.pc.max_requests_per_key)
        self.large_bodies = PerKey(self.pc.large_bodies_per_key)

    @property
    def state(self) -> ProxyState:
        assert self._state is not None, "the proxy has not started"
        return self._state

    async def startup(self) -> None:
        if self._state is None:
            self._state = await build_state(self.config)
            if self.keys.path is not None:
                self._state.background.append(asyncio.create_task(self.follow_keys()))

    async def follow_keys(self) -> None:
        """The keys file read again when it changes (``ProxyKeys.reload``): keys added or revoked (``turnstream
        keys``, a Secret updated) take effect within ``proxy.keys_reload_s``, without a restart."""
        while True:
            await asyncio.sleep(self.pc.keys_reload_s)
            outcome = await asyncio.to_thread(self.keys.reload)
            if outcome is not None:
                KEYS_RELOADS.labels("ok" if outcome else "refused").inc()

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

    def refusal(self) -> Response:
        return openai_error(401, "invalid or missing bearer token", "authentication_error", "invalid_api_key")

    async def chat(self, request: Request) -> Response:
        return await self.serve(request, None)

    async def responses(self, request: Request) -> Response:
        return await self.serve(request, RESPONSES)

    async def messages(self, request: Request) -> Response:
        return await self.serve(request, MESSAGES)

    async def serve(self, request: Request, api: Api | None) -> Response:
        """One request of any API: chat completions as they are (``api`` None), the others translated."""
        created = time.time()
        fail = openai_error if api is None else api.error
        headers_in = request.headers
        user = self.keys.user(headers_in.get("authorization") if api is None else api.credential(headers_in))
        if user is None:
            return fail(401, "invalid or missing API key", "authentication_error", "invalid_api_key")
        if not self.in_flight.take(user, request.scope):
            LIMITED.labels("requests").inc()
            return fail(
                429,
                f"this key is at its limit of {self.pc.max_requests_per_key} requests in flight; try again when one "
                "has finished",
                "requests",
                "rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )

        owner = user if self.keys.per_user else ""
        exchange: Exchange | None = None
        try:
            raw_body, body = await self.read(request, user, api)
            hint: str | None = None
            side = chat_side_call(body) if api is None else False
            if api is not None:
                exchange = api.translate(body)
                exchange.model = exchange.model or self.pc.served_model_name
                side = api.side_call(body)
                hint = api.session_hint(headers_in, body)
                if exchange.previous_id is not None:
                    hint = await self.carry(exchange, owner, len(raw_body)) or hint
                body = check_chat(exchange.body, self.body_limits)
            untagged = "side" if side or body.get("model") in self.side_models else self.pc.default_turn_type
            session = session_info(headers_in, body, untagged, hint)
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
            return fail(exc.status, str(exc), exc.err_type, exc.code, headers=exc.headers)
        except SessionError as exc:
            return fail(400, str(exc), "invalid_request_error", "invalid_session")
        headers: dict[str, str] = {}
        if self.keys.per_user:
            body["user"] = user  # recorded as the key's user, whatever the client wrote
        explicit = session.session_id is not None
        if session.session_id is not None:
            if session.turn_type == "main":
                headers["X-Session-Id"] = session.session_id
            session = SessionInfo(recorded_id(owner, session.session_id), session.turn_type, session.done)
        index: asyncio.Future[int | None] | None = None
        if session.turn_type == "side" and session.done and session.session_id is not None:
            self.end_session(session.session_id)
        if session.turn_type == "main" and (body.get("n") or 1) > 1:
            return fail(
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
                return fail(
                    503,
                    "turns cannot be recorded right now (the proxy's spool is full until the event log takes "
                    "what it holds); try again shortly, or send the request as a side turn (X-Turn-Type: side)",
                    "server_error",
                    "spool_full",
                    headers={"Retry-After": "5"},
                )
            if session.session_id is None:
                if self.pc.missing_session == "reject":
                    return fail(
                        400, "main turns need X-Session-Id", "invalid_request_error", "missing_session"
                    )
                shown = new_session_id()
                fresh = recorded_id(owner, shown)
                continuity = self.state.continuity
                if continuity is not None and not self.state.recorder.deferring:
                    # Which session this continues, resolved beside the engine's work (``settle``).
                    chain = links(headers_in, body)
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
        wants = client_wants(body, headers_in) if api is None else None
        forward = self.forward(body, session.turn_type == "main", stream, wants, api is not None)
        # A session's turns go where its prefix is cached: keyed by its id, else by the conversation's opening.
        key = session.session_id if explicit else opening_key(body) if session.turn_type == "main" else None
        replica = self.state.router.pick(key)
        assert replica is not None  # nothing excluded: some replica is always offered
        call = Call(
            session,
            body,
            forward,
            created,
            owner,
            index,
            wants,
            headers,
            self.route(forward, replica),
            pending,
            fence,
            api,
            exchange,
            replica,
            key,
            cost(len(raw_body), forward),
        )
        return await (self._stream(call) if stream else self._whole(call))

    async def dispatch(
        self, call: Call, ask: Callable[[EngineClient], Awaitable[T]], *, keep: bool = False
    ) -> T:
        """``ask`` the call's replica; when it gives no answer (down, or its connection broke before one: nothing
        has reached the client) it is skipped for a moment and the request goes to the next replica the router
        picks, until one answers or none is left. The replica that answered stays counted in flight when ``keep``
        (a stream, until it closes)."""
        tried: list[Replica] = []
        while True:
            replica = call.replica
            assert replica is not None
            replica.begin(call.cost)
            answered = False
            try:
                result = await ask(replica.engine)
                answered = True
                return result
            except EngineError as exc:
                if not exc.unanswered:
                    raise
                replica.refused()
                tried.append(replica)
                other = self.state.router.pick(call.key, exclude=tried)
                if other is None:
                    raise
                FAILOVERS.labels(replica.name).inc()
                log.warning(
                    "policy replica gave no answer; the request goes to another",
                    extra={"replica": replica.name, "to": other.name, "error": str(exc)},
                )
                self.unroute(call.leased, replica)
                call.leased, call.replica = self.route(call.forward, other), other
            finally:
                if not (keep and answered):
                    replica.end(call.cost)

    def forward(
        self, body: dict[str, Any], main: bool, stream: bool, wants: dict[str, bool] | None, translated: bool
    ) -> dict[str, Any]:
        """What the engine is sent for ``body``: a main turn with the engine's sampling defaults made explicit (so
        they are recorded) and the exact ids and log-probs asked for; a side chat turn with what its client asked
        of SGLang's extras; ``proxy.default_max_tokens`` where the client set no length."""
        forward = dict(body)
        if main:
            for name, value in self.state.sampling.items():
                if forward.get(name) is None:
                    forward[name] = value
            forward.update(EXACT_STREAMED if stream else EXACT_NON_STREAMED)
        elif (
            stream and wants is not None
        ):  # SGLang reads these from the body only when the proxy forwards no headers
            for key in ("input_ids", "output_ids"):
                if wants[key]:
                    forward[f"return_{key}_in_sglext"] = True
        if (
            self.pc.default_max_tokens
            and forward.get("max_tokens") is None
            and not forward.get("max_completion_tokens")
        ):
            forward["max_tokens"] = self.pc.default_max_tokens
        if stream and translated:  # the API's closing event carries the usage
            forward["stream_options"] = {"include_usage": True}
        return forward

    async def _whole(self, call: Call) -> Response:
        """A non-streamed answer: the engine's (a side chat turn's bytes untouched), then the turn recorded."""
        fail = openai_error if call.api is None else call.api.error
        session, index, forward, headers, created = (
            call.session,
            call.index,
            call.forward,
            call.headers,
            call.created,
        )
        main = call.main
        sent = time.perf_counter()
        try:
            if (
                not main and call.api is None
            ):  # side chat turns: the engine's bytes go back untouched, never parsed
                raw = await self.dispatch(call, lambda engine: engine.chat_bytes(call.forward))
            else:
                data = await self.dispatch(call, lambda engine: engine.chat_raw(call.forward))
        except EngineError as exc:
            if call.pending is not None:
                await self.abandon(call.pending)
            failure = engine_failure(exc, session.turn_type, "false")
            return fail(failure.status, str(failure), failure.err_type, failure.code, headers)
        finally:
            self.unroute(call.leased, call.replica)  # type: ignore[arg-type]
        forward, replica = call.forward, call.replica
        assert replica is not None
        if call.fence is not None and (refused := await self.forgotten(call.fence)) is not None:
            return fail(refused.status, str(refused), refused.err_type, refused.code)
        if call.pending is not None:
            session, index = await self.settle(session, call.pending, headers)
            self.link(call.pending, session, _answer(data))
        # How long the engine took, as the proxy saw it (a standard header, shown by browsers and tracers): what a
        # client measures beyond it is the proxy's own time.
        headers["Server-Timing"] = f"engine;dur={1000 * (time.perf_counter() - sent):.2f}"
        _OK[session.turn_type].inc()
        _LATENCY[False].observe(time.time() - created)
        api, exchange, leased = call.api, call.exchange, call.leased
        if api is not None:
            assert exchange is not None
            if exchange.store and (answer := _answer(data)) is not None:
                await self.keep(exchange, call.owner, session, answer)
            rendered = api.render(exchange, data)
            if not main:
                return Response(rendered, media_type="application/json", headers=headers)
            return RecordedFirst(
                rendered,
                headers,
                lambda: self.record_response(session, index, forward, data, created, replica, api.name),
            )
        if not main:
            if leased is not None:  # the engine reports its base's version; the client's is the adapter's
                raw = _json_encoder.encode(with_version(_json_decoder.decode(raw), leased))
            return Response(raw, media_type="application/json", headers=headers)
        assert call.wants is not None
        # The client's copy drops what the proxy asked for on its own account; recording needs the original.
        payload = dict(data, choices=[dict(c) for c in data.get("choices") or ()])
        strip_response(payload, call.wants)
        if leased is not None:
            payload = with_version(payload, leased)
        # The turn is spooled before the answer goes out (a page-cache write): a kill -9 that follows loses nothing.
        return RecordedFirst(
            _json_encoder.encode(payload),
            headers,
            lambda: self.record_response(session, index, forward, data, created, replica),
        )

    async def read(self, request: Request, user: str, api: Api | None) -> tuple[bytes, dict[str, Any]]:
        """The body, bounded and decoded: a large body (or one heavy by its values) takes one of its key's
        large-body slots and is decoded in a thread. Raises ``BadInput``."""

        def take_large() -> BadInput | None:
            if self.large_bodies.take(user, request.scope):
                return None
            LIMITED.labels("large_bodies").inc()
            return too_many_large(self.pc.large_bodies_per_key, self.pc.large_body_bytes)

        raw_body = await read_body(request, self.pc.max_body_bytes, self.pc.large_body_bytes, take_large)
        values = count_values(raw_body, self.body_limits)  # before anything is decoded
        if api is None:
            parse: Any = parse_chat
            args: tuple[Any, ...] = (raw_body, self.body_limits, True)
        else:
            parse, args = parse_object, (raw_body, self.body_limits, True, _FIELDS[api.name])
        if len(raw_body) > PARSE_IN_THREAD_BYTES or values > HEAVY_VALUES:
            if values > HEAVY_VALUES and len(raw_body) <= self.pc.large_body_bytes:
                if (busy := take_large()) is not None:  # heavy by its values: a large body's slot too
                    raise busy
            return raw_body, await asyncio.to_thread(parse, *args)
        return raw_body, parse(*args)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's ``POST /v1/messages/count_tokens`` (Claude Code sizes tool results and its context with it):
        the request translated as a message would be, and the engine's own count of its prompt (chat template and
        tools included) from a one-token answer that is never recorded."""
        user = self.keys.user(MESSAGES.credential(request.headers))
        if user is None:
            return MESSAGES.error(
                401, "invalid or missing API key", "authentication_error", "invalid_api_key"
            )
        if not self.in_flight.take(user, request.scope):
            LIMITED.labels("requests").inc()
            return MESSAGES.error(
                429, "this key is at its limit of requests in flight", "requests", "rate_limit_exceeded"
            )
        try:
            raw, body = await self.read(request, user, MESSAGES)
            exchange = MESSAGES.translate({**body, "max_tokens": 1, "stream": False})
            forward = check_chat(exchange.body, self.body_limits)
            forward["model"] = forward.get("model") or self.pc.served_model_name
            data = await self.any_replica(lambda engine: engine.chat_raw(forward), cost(len(raw), forward))
            counted = (data.get("usage") or {}).get("prompt_tokens")
            if not isinstance(counted, int):
                raise EngineError("the engine reported no prompt token count")
        except BadInput as exc:
            return MESSAGES.error(exc.status, str(exc), exc.err_type, exc.code, headers=exc.headers)
        except EngineError as exc:
            failure = engine_failure(exc, "side", "false")
            return MESSAGES.error(failure.status, str(failure), failure.err_type, failure.code)
        return JSONResponse({"input_tokens": counted})

    async def carry(self, exchange: Exchange, owner: str, own_bytes: int) -> str | None:
        """Put the stored conversation a request continues (``previous_response_id``) before its own messages;
        the id the client knows its session by, if it had one. A 404 for an id this key never made; a 400 when
        the conversation and the request's own ``own_bytes`` are more than one request may carry, so a chain of
        continuations can never store more than that (three chained 7.5 MiB requests stored 22.5 MiB under
        one id, issue 55)."""
        stored = self.state.stored
        found = None
        if stored is not None:
            try:
                async with asyncio.timeout(self.pc.redis_timeout_ms / 1000):
                    found = await stored.load(exchange.previous_id or "", owner)
            except Exception as exc:
                log.warning("stored responses unavailable", extra={"error": repr(exc)})
                raise BadInput(
                    503, "stored responses cannot be read right now; try again shortly", "server_error"
                ) from None
        if found is None:
            raise BadInput(
                404,
                f"Previous response with id '{exchange.previous_id}' not found.",
                "previous_response_not_found",
            )
        if found.size + own_bytes > self.pc.max_body_bytes:
            raise BadInput(
                400,
                f"the conversation of '{exchange.previous_id}' ({found.size} bytes) and this request "
                f"({own_bytes} bytes) are more than one request may carry ({self.pc.max_body_bytes} bytes): start "
                "a new conversation, or send a shorter one without previous_response_id",
                "conversation_too_large",
            )
        session, messages = found.session, found.messages
        exchange.carried_session = session
        own = exchange.body["messages"]
        lead = 1 if own and exchange.request.get("instructions") else 0
        exchange.body["messages"] = own[:lead] + messages + own[lead:]
        exchange.carried = len(messages)
        return shown_id(owner, session) if session is not None else None

    async def keep(
        self, exchange: Exchange, owner: str, session: SessionInfo, answer: dict[str, Any]
    ) -> None:
        """Store the conversation this answer ends under its response id (``services/proxy/stored.py``), with a
        session: a main turn's own; a side turn's, the one of the conversation it continues (it copies it), else
        the one it names. So it is sealed and erased with that session (issue 55 found side copies of sealed
        conversations in the clear, out of ``forget``'s reach)."""
        stored = self.state.stored
        if stored is None:
            return
        messages = exchange.body["messages"]
        lead = 1 if messages and exchange.request.get("instructions") else 0
        main = session.turn_type == "main"
        sid = session.session_id if main else exchange.carried_session or session.session_id
        try:
            await stored.keep(exchange.id, owner, sid, [*messages[lead:], _kept(answer)])
        except Exception as exc:  # never the user's response: the continuation will be a 404
            log.warning("storing a response failed", extra={"error": repr(exc)})

    async def _stream(self, call: Call) -> Response:
        """A streamed answer: the engine's stream opened here, relayed by ``_relay``."""
        api = call.api
        fail = openai_error if api is None else api.error
        try:
            upstream = await self.dispatch(
                call, lambda engine: engine.open_chat_stream(call.forward), keep=True
            )
        except EngineError as exc:
            self.unroute(call.leased, call.replica)  # type: ignore[arg-type]
            if call.pending is not None:
                await self.abandon(call.pending)
            failure = engine_failure(exc, call.session.turn_type, "true")
            return fail(failure.status, str(failure), failure.err_type, failure.code, call.headers)
        except BaseException:  # cancelled (shutdown), or a bug: the lease still goes back
            self.unroute(call.leased, call.replica)  # type: ignore[arg-type]
            raise
        leased, replica = call.leased, call.replica
        assert replica is not None
        if call.fence is not None and (refused := await self.forgotten(call.fence)) is not None:
            self.unroute(leased, replica)
            replica.end(call.cost)
            await upstream.aclose()
            return fail(refused.status, str(refused), refused.err_type, refused.code)
        events = api.events(call.exchange) if api is not None and call.exchange is not None else None
        try:
            return await self._relay(upstream, call, events)
        except BaseException:  # the lease back and the engine stream closed on every path, bugs included
            self.unroute(leased, replica)
            replica.end(call.cost)
            await upstream.aclose()
            raise

    async def _relay(self, upstream: Any, call: Call, events: Events | None) -> Response:
        """The streamed response relaying an open engine stream (which the response then owns and closes): the
        engine's chunks as they are for chat, else each turned into the API's ``events``."""
        session, index, forward, headers, created = (
            call.session,
            call.index,
            call.forward,
            call.headers,
            call.created,
        )
        wants, leased, pending, exchange, owner, replica = (
            call.wants,
            call.leased,
            call.pending,
            call.exchange,
            call.owner,
            call.replica,
        )
        assert replica is not None
        if pending is not None:  # the session's id is a response header: known before the first byte
            session, index = await self.settle(session, pending, headers)
        closed = False

        async def close() -> None:
            """The lease back and the engine stream closed, once: at the relay's end, or at the response's end
            when the relay never started."""
            nonlocal closed
            if not closed:
                closed = True
                self.unroute(leased, replica)
                replica.end(call.cost)
                await upstream.aclose()

        main = session.turn_type == "main"
        strip = (
            main
            and wants is not None
            and not (wants["logprobs"] and wants["input_ids"] and wants["output_ids"])
        )
        decode = main or events is not None
        epoch = replica.versions.epoch  # where in its replica's served-version history this stream began
        api_name = exchange.api if exchange is not None else "chat"

        async def relay() -> AsyncGenerator[tuple[bytes, bool], None]:
            # The events of one network read go to the client in one write, as soon as the read is split: real
            # streaming (a token-paced engine gives one event per read), and a burst costs one write, not one each.
            completion = Completion()
            complete = ended = False
            # This read's events: those before a failure still go out, ahead of the error event.
            out: list[bytes] = [events.start()] if events is not None else []
            try:
                async for payloads in data_batches(upstream.aiter_bytes()):
                    for payload in payloads:
                        if payload == b"[DONE]":
                            complete = ended = True
                            if pending is not None:  # stored before the client has the last byte
                                self.link(pending, session, completion.answer())
                            if events is None:
                                out.append(b"data: [DONE]\n\n")
                                break
                            assert exchange is not None
                            if exchange.store:
                                await self.keep(exchange, owner, session, completion.answer())
                            out.append(events.end())
                            break
                        if not decode:
                            out.append(b"data: " + payload + b"\n\n")
                            continue
                        chunk = _json_decoder.decode(payload)
                        if "error" in chunk and "choices" not in chunk:
                            ended = True
                            if events is None:
                                out.append(b"data: " + payload + b"\n\n")
                            else:
                                error = chunk["error"]
                                message = error.get("message") if isinstance(error, dict) else str(error)
                                out.append(events.fail(f"the model engine failed: {message}"))
                            break
                        completion.add_chunk(chunk)
                        if events is not None:
                            out.append(events.chunk(chunk))
                            continue
                        if strip:
                            assert wants is not None
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
                message = f"the model engine failed mid-stream: {exc}"
                if events is not None:
                    out.append(events.fail(message))
                else:
                    err = {"error": {"message": message, "type": "engine_error", "param": None, "code": None}}
                    out.append(b"data: " + _json_encoder.encode(err) + b"\n\n")
                yield b"".join(out), True
            finally:
                await close()
                REQUESTS.labels(session.turn_type, "true", "200" if complete else "aborted").inc()
                _LATENCY[True].observe(time.time() - created)
                if main:
                    if complete:
                        self.background(
                            self._label_then_finish(
                                session, index, forward, completion, created, epoch, replica, api_name
                            )
                        )
                    else:
                        DROPPED.labels("stream_incomplete").inc()
                        if pending is not None:
                            self.background(self.abandon(pending, settled=True))

        return EventStream(relay(), headers, on_close=close)

    async def models(self, request: Request) -> Response:
        if not self.authorized(request):
            return self.refusal()
        try:
            data = await self.any_replica(lambda engine: engine.models())
        except EngineError as exc:
            return openai_error(502, f"the model engine failed: {exc}", "engine_error")
        return JSONResponse({"object": "list", "data": data})

    async def any_replica(self, ask: Callable[[EngineClient], Awaitable[T]], tokens: int = 0) -> T:
        """A request that is nobody's turn (a model list, a token count of ``tokens``): the replica the router
        offers, the next when it gives no answer; counted in its load while it asks (a token count is a prefill)."""
        tried: list[Replica] = []
        while True:
            replica = self.state.router.pick(None, exclude=tried)
            if replica is None:
                raise EngineError("no policy replica answers", unanswered=True)
            replica.begin(tokens)
            try:
                return await ask(replica.engine)
            except EngineError as exc:
                if not exc.unanswered:
                    raise
                replica.refused()
                tried.append(replica)
                if len(tried) == len(self.state.replicas):
                    raise
            finally:
                replica.end(tokens)

    async def healthz(self, request: Request) -> Response:
        """Ok while some replica answers (the status is the probe's answer: no key needed); with a key (or none
        configured), each replica's state besides (``ready``: answering, on the version it should serve). Without
        one nothing internal: replica addresses, versions and the spool are not for whoever reaches the port."""
        replicas = self.state.replicas
        answers = await asyncio.gather(*(r.engine.health() for r in replicas))
        engine_ok = any(answers)
        status = 200 if engine_ok else 503
        if not self.authorized(request):
            return JSONResponse({"status": "ok" if engine_ok else "degraded"}, status_code=status)
        body = {
            "status": "ok" if engine_ok else "degraded",
            "engine": engine_ok,
            "spool_pending": self.state.recorder.pending,
            "weight_version": min(r.versions.current for r in replicas),
            "replicas": {
                r.name: {"answers": ok, "ready": ok and r.ready, "weight_version": r.versions.current}
                for r, ok in zip(replicas, answers, strict=True)
            },
        }
        return JSONResponse(body, status_code=status)

    async def metrics(self, request: Request) -> Response:
        """Behind the keys like the API (Prometheus without them reads ``metrics.port`` instead)."""
        if not self.authorized(request):
            return self.refusal()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def hello(self, _: Request) -> Response:
        """Claude Code's reachability probe (``HEAD /api/hello``)."""
        return Response(b"", status_code=200)

    async def no_websocket(self, _: Request) -> Response:
        """Codex tries a websocket (``GET /v1/responses``) when told the server has one: refused at once, so it
        falls back to HTTP without waiting."""
        return openai_error(
            426,
            "the Responses API is served over HTTP POST only, not websockets",
            "invalid_request_error",
            "websocket_not_served",
            headers={"Connection": "close"},
        )


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
            Route("/v1/responses", proxy.responses, methods=["POST"]),
            Route("/v1/responses", proxy.no_websocket, methods=["GET"]),
            Route("/v1/messages", proxy.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", proxy.count_tokens, methods=["POST"]),
            Route("/api/hello", proxy.hello, methods=["HEAD", "GET"]),
            Route("/v1/models", proxy.models, methods=["GET"]),
            Route("/healthz", proxy.healthz, methods=["GET"]),
            Route("/metrics", proxy.metrics, methods=["GET"]),
        ],
        lifespan=_lifespan,
        exception_handlers={Exception: _unexpected},
    )
    internal = lambda status, message: anthropic_error(status, message)  # noqa: E731
    return ChatFirst(
        app,
        {
            "/v1/chat/completions": (proxy.chat, None),
            "/v1/responses": (proxy.responses, None),
            "/v1/messages": (proxy.messages, internal),
        },
    )
