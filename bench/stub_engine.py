"""A stub SGLang 0.5.23 engine for benchmarks and fault tests: answers the HTTP API turnstream uses, byte for byte
in SGLang's shapes (checked against SGLang's own classes by tests/contract), after a fixed latency, with a fixed
number of tokens and their log-probs. It runs in its own process so that it never shares an event loop with what is
measured, and answers from prebuilt bytes (one variant per combination of the flags a request sets; only the id and
``created`` are written in per request).

What it mimics (an engine started with ``--tool-call-parser qwen --weight-version 0``):

- ``/v1/chat/completions``, non-streamed: ``choices`` (``n``) with ``message``, ``logprobs.content`` (``logprobs``,
  ``top_logprobs``), ``prompt_token_ids`` (``return_prompt_token_ids`` or ``return_token_ids``),
  ``response_token_ids`` (``return_token_ids``), ``meta_info`` with ``[logprob, id, text]`` triples
  (``return_meta_info``); ``usage``; ``metadata`` with the weight version and its spans, always.
- streamed: a role chunk, one chunk per token (``logprobs.content`` when asked), the finish chunk, the ``sglext``
  chunk (``return_input_ids_in_sglext``/``return_output_ids_in_sglext``), the usage chunk
  (``stream_options.include_usage``), ``[DONE]``. ``return_prompt_token_ids``/``return_token_ids``/
  ``return_meta_info`` with ``stream`` are refused with SGLang's 400.
- ``/generate``: prefill scoring (``max_new_tokens`` 0: ``input_token_logprobs`` from ``logprob_start_len``, the first
  entry unscored) and plain generation.
- ``/model_info`` (``/get_model_info``), ``/v1/models``, ``/health``, ``/pause_generation`` (new requests wait),
  ``/continue_generation``, ``/update_weights_from_disk`` (waits for requests in flight unless paused; then reports
  the new ``weight_version`` and ``model_path`` everywhere).

Faults: ``--fail-every N`` answers every Nth chat or generate request with HTTP 500 (an engine error at a fixed
rate); ``--slow-every N`` answers every Nth after ``--slow-ms`` instead (a timeout, for a client that waits less);
``--break-every N`` breaks every Nth stream (alternately a garbled event and a connection closed mid-response).
``--finish stop`` ends every answer with EOS (in ``response_token_ids`` and the log-probs, not in the text) instead of
running into the length limit.

    python bench/stub_engine.py --port 31000 [--latency-ms 20] [--tokens 60] [--fail-every 0] [--slow-every 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stub_http import Closing, reply, serve

PROMPT_IDS = list(range(1000, 1030))
"""The prompt every chat request is said to have (the stub has no tokenizer)."""
EOS_ID, EOS_TEXT = 2, "<|im_end|>"
CONTEXT_LEN = 8192

# Placeholders written into the prebuilt bytes and replaced per response, each by text of exactly its length (so
# chunk sizes of a prebuilt chunked response stay right): a uuid4 hex id as SGLang's, a ten-digit Unix time.
_ID = "@" * 32
_CREATED_TEXT = "@CREATE@"  # with its JSON quotes, as long as ten digits
_CREATED = b'"' + _CREATED_TEXT.encode() + b'"'
_MAX_VARIANTS = 512


def dumps(value: Any) -> bytes:
    """Compact JSON without ASCII escapes, as SGLang's encoders (pydantic, msgspec, orjson) write it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


_PLACEHOLDERS = re.compile(b"(" + re.escape(_ID.encode()) + b"|" + re.escape(_CREATED) + b")")


class Prebuilt:
    """A response's bytes cut at its placeholders once, so that stamping one is a list copy and a join."""

    __slots__ = ("_ids", "_parts", "_times")

    def __init__(self, template: bytes) -> None:
        self._parts = _PLACEHOLDERS.split(template)
        self._ids = [i for i, p in enumerate(self._parts) if i % 2 and p != _CREATED]
        self._times = [i for i, p in enumerate(self._parts) if i % 2 and p == _CREATED]

    def stamp(self) -> bytes:
        """The response with a fresh id (32 hex digits, as SGLang's uuid4 hex) and the current time."""
        parts = self._parts.copy()
        rid, now = os.urandom(16).hex().encode(), b"%d" % int(time.time())
        for i in self._ids:
            parts[i] = rid
        for i in self._times:
            parts[i] = now
        return b"".join(parts)


def stamp(template: bytes) -> bytes:
    return Prebuilt(template).stamp()


def api_error(status: int, message: str, err_type: str) -> bytes:
    """SGLang's OpenAI-route error (protocol.ErrorResponse, serving_base.create_error_response)."""
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return reply(status, dumps(body))


NOT_FOUND = reply(404, b'{"detail":"Not Found"}')

STREAM_REFUSALS = (
    (
        "return_prompt_token_ids",
        "return_prompt_token_ids is not supported with streaming. "
        "Please set stream=false when using return_prompt_token_ids=true.",
    ),
    (
        "return_token_ids",
        "return_token_ids is not supported with streaming on /v1/chat/completions. "
        "Please set stream=false when using return_token_ids=true.",
    ),
    (
        "return_meta_info",
        "return_meta_info is not supported with streaming. "
        "Please set stream=false when using return_meta_info=true.",
    ),
)
"""serving_chat.py's ``_convert_to_internal_request`` refusals, in its order, answered as HTTP 400 "BadRequest"."""


@dataclass(frozen=True)
class Token:
    text: str
    id: int
    logprob: float


class Ask(NamedTuple):
    """What a chat request asks for that changes the answer's shape: the key of a prebuilt variant."""

    model: str = "default"
    n: int = 1
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_ids: bool = False
    token_ids: bool = False
    meta_info: bool = False
    input_ids_ext: bool = False
    output_ids_ext: bool = False
    include_usage: bool = False


def _on(body: dict[str, Any], name: str) -> bool:
    return body.get(name) is True


def read_ask(body: dict[str, Any]) -> Ask:
    """The shape-changing flags of a chat body, read leniently: a stub answers odd values instead of failing."""
    model = body.get("model")
    top = body.get("top_logprobs")
    options = body.get("stream_options")
    n = body.get("n")
    return Ask(
        model=model if isinstance(model, str) else "default",
        n=n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 128 else 1,
        stream=_on(body, "stream"),
        logprobs=_on(body, "logprobs"),
        top_logprobs=top if isinstance(top, int) and not isinstance(top, bool) and 0 < top <= 20 else 0,
        prompt_ids=_on(body, "return_prompt_token_ids") or _on(body, "return_token_ids"),
        token_ids=_on(body, "return_token_ids"),
        meta_info=_on(body, "return_meta_info"),
        input_ids_ext=_on(body, "return_input_ids_in_sglext"),
        output_ids_ext=_on(body, "return_output_ids_in_sglext"),
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
    )


def stub_tokens(n: int) -> list[Token]:
    """The stub's answer: `` w0 w1 ...``, ids from 2000, log-probs in a fixed cycle."""
    return [Token(f" w{i}", 2000 + i, round(-0.1 - (i % 7) * 0.05, 4)) for i in range(n)]


def text_tokens(text: str, first_id: int = 5000) -> list[Token]:
    """A text cut into word pieces (leading space attached), as a BPE tokenizer would roughly do."""
    pieces = re.findall(r"\s*\S+|\s+", text)
    return [Token(p, first_id + i, round(-0.05 - (i % 5) * 0.1, 4)) for i, p in enumerate(pieces)]


def _top(tok: Token, k: int) -> list[Token]:
    """``k`` alternatives for a position, the sampled token first (as its log-prob is the highest here)."""
    return [tok] + [Token(f" alt{j}", 40000 + j, round(tok.logprob - 0.7 * j, 4)) for j in range(1, k)]


def _entry(tok: Token, k: int) -> dict[str, Any]:
    """protocol.ChatCompletionTokenLogprob: no token id; ``bytes`` of the token text."""
    return {
        "token": tok.text,
        "bytes": list(tok.text.encode()),
        "logprob": tok.logprob,
        "top_logprobs": [
            {"token": t.text, "bytes": list(t.text.encode()), "logprob": t.logprob} for t in _top(tok, k)
        ]
        if k
        else [],
    }


def _triple(tok: Token, text: bool = True) -> list[Any]:
    """A meta_info log-prob entry, ``[logprob, id, text]`` (text None unless ``return_text_in_logprobs``)."""
    return [tok.logprob, tok.id, tok.text if text else None]


@dataclass
class Answer:
    """One completion: its tokens (EOS last when it stopped), the prompt, the weights that made it."""

    tokens: list[Token]
    stopped: bool
    prompt_ids: list[int]
    version: str

    @property
    def text(self) -> str:
        return "".join(t.text for t in (self.tokens[:-1] if self.stopped else self.tokens))

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped else "length"

    @property
    def matched_stop(self) -> int | None:
        return EOS_ID if self.stopped else None

    def usage(self, choices: int = 1) -> dict[str, Any]:
        """UsageProcessor's: the prompt counted once, the completions of all ``choices`` summed."""
        n, p = len(self.tokens) * choices, len(self.prompt_ids)
        return {
            "prompt_tokens": p,
            "total_tokens": p + n,
            "completion_tokens": n,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    def spans(self) -> list[dict[str, Any]]:
        return [{"version": self.version, "start": 0, "end": len(self.tokens)}]

    def meta_info(self, rid: str, logprobs: bool, top: int, text: bool = True) -> dict[str, Any]:
        """tokenizer_manager.py's meta_info (without ``--enable-metrics`` timings), keys in its order."""
        n = len(self.tokens)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": {"type": "stop", "matched": EOS_ID}
            if self.stopped
            else {"type": "length", "length": n},
            "prompt_tokens": len(self.prompt_ids),
            "weight_version": self.version,
            "num_retractions": 0,
        }
        if logprobs:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [_triple(t, text) for t in self.tokens]
            meta["output_token_logprobs_length"] = n
            if top:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = [[_triple(a, text) for a in _top(t, top)] for t in self.tokens]
        meta.update(
            reasoning_tokens=0,
            completion_tokens=n,
            cached_tokens=0,
            weight_versions=self.spans(),
            cached_tokens_details=None,
            dp_rank=None,
        )
        return meta


def chat_response(answer: Answer, ask: Ask) -> bytes:
    """A non-streamed chat completion, as serving_chat's ``_build_chat_response`` and pydantic write it."""
    choices: list[dict[str, Any]] = []
    for index in range(ask.n):  # ``n`` samples, all the same here
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": answer.text, "reasoning_content": None},
            "logprobs": {"content": [_entry(t, ask.top_logprobs) for t in answer.tokens]}
            if ask.logprobs
            else None,
            "finish_reason": answer.finish_reason,
            "matched_stop": answer.matched_stop,
        }
        if ask.prompt_ids:
            choice["prompt_token_ids"] = answer.prompt_ids
        if ask.token_ids:
            choice["response_token_ids"] = [t.id for t in answer.tokens]
        if ask.meta_info:
            choice["meta_info"] = answer.meta_info(_ID, ask.logprobs, ask.top_logprobs)
        choices.append(choice)
    body = {
        "id": _ID,
        "object": "chat.completion",
        "created": _CREATED_TEXT,
        "model": ask.model,
        "choices": choices,
        "usage": answer.usage(ask.n),
        "metadata": {"weight_version": answer.version, "weight_versions": answer.spans()},
    }
    return dumps(body)


def stream_chunks(answer: Answer, ask: Ask) -> list[bytes]:
    """The SSE events of a streamed chat completion, as serving_chat's ``_generate_chat_stream`` writes them."""

    def event(choices: list[dict[str, Any]], **tail: Any) -> bytes:
        head = {"id": _ID, "object": "chat.completion.chunk", "created": _CREATED_TEXT, "model": ask.model}
        return b"data: " + dumps({**head, "choices": choices, **tail}) + b"\n\n"

    def choice(
        index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None, stop: Any = None
    ) -> Any:
        return [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish,
                "matched_stop": stop,
            }
        ]

    chunks = []
    # The ``n`` samples advance together, one token a step each; a sample's first output brings its role chunk.
    for i, tok in enumerate(answer.tokens):
        lps = {"content": [_entry(tok, ask.top_logprobs)]} if ask.logprobs else None
        for index in range(ask.n):
            if i == 0:
                chunks.append(
                    event(choice(index, {"reasoning_content": None, "role": "assistant", "content": ""}))
                )
            if answer.stopped and i == len(answer.tokens) - 1:
                # EOS has no text: its log-probs go out alone (a tool-call parser is configured), or nothing does.
                if lps is not None:
                    chunks.append(event(choice(index, {"reasoning_content": None}, lps)))
                continue
            chunks.append(event(choice(index, {"reasoning_content": None, "content": tok.text}, lps)))
    for index in range(ask.n):
        finish = choice(index, {"reasoning_content": None}, None, answer.finish_reason, answer.matched_stop)
        chunks.append(event(finish))
    if ask.input_ids_ext or ask.output_ids_ext:
        ext: dict[str, Any] = {}
        if ask.input_ids_ext:
            ext["input_ids"] = answer.prompt_ids
        if ask.output_ids_ext:
            ext["output_ids"] = [[t.id for t in answer.tokens] for _ in range(ask.n)]
        chunks.append(event([], usage=None, sglext=ext))
    if ask.include_usage:
        chunks.append(event([], usage=answer.usage(ask.n)))
    chunks.append(b"data: [DONE]\n\n")
    return chunks


def event_stream(chunks: list[bytes], end: bool = True) -> bytes:
    """An SSE response in chunked encoding, one HTTP chunk per event; without its terminator when not ``end``."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks)
    return head + body + (b"0\r\n\r\n" if end else b"")


def chat_reply(answer: Answer, ask: Ask) -> bytes:
    """The whole HTTP response to a chat request, still to be ``stamp``ed."""
    if ask.stream:
        return event_stream(stream_chunks(answer, ask))
    return reply(200, chat_response(answer, ask))


def stream_refusal(body: dict[str, Any]) -> bytes | None:
    """SGLang's 400 for what it cannot stream, or None."""
    if not _on(body, "stream"):
        return None
    for name, message in STREAM_REFUSALS:
        if _on(body, name):
            return api_error(400, message, "BadRequest")
    return None


def parse_json(body: bytes) -> dict[str, Any] | bytes:
    """The JSON object of a request body, or the 400 SGLang's validation handler gives for anything else."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return api_error(400, f"JSON decode error: {exc}", "Bad Request")
    if not isinstance(value, dict):
        return api_error(400, "Input should be a valid dictionary", "Bad Request")
    return value


def generated(req: dict[str, Any], tokens: int, version: str) -> bytes:
    """/generate, as the teacher (prefill scoring: ``max_new_tokens`` 0) and EngineClient.generate call it.

    Scoring gives a log-prob for every input token from ``logprob_start_len`` on, the first entry of that window
    unscored (None), as SGLang's scheduler does (``[None] + logprobs[:-1]``); ``-1`` means no input log-probs."""
    ids = req.get("input_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        text = req.get("text")
        if not isinstance(text, str):
            return reply(
                400, b'{"error":{"message":"Either text, input_ids or input_embeds should be provided."}}'
            )
        ids = [t.id for t in text_tokens(text, 1000)] or [1000]
    params = req.get("sampling_params")
    limit = params.get("max_new_tokens", 128) if isinstance(params, dict) else 128  # SamplingParams' default
    n = min(tokens, limit) if isinstance(limit, int) and limit >= 0 else tokens
    answer = Answer(stub_tokens(n), False, ids, version)
    rid = uuid.uuid4().hex
    logprob = req.get("return_logprob") is True
    k = req.get("top_logprobs_num", 0)
    k = k if isinstance(k, int) and k > 0 else 0
    text_in = req.get("return_text_in_logprobs") is True
    meta = answer.meta_info(rid, logprob, k, text_in)
    if logprob:
        start = req.get("logprob_start_len", -1)
        start = start if isinstance(start, int) and 0 <= start < len(ids) else len(ids)
        scored = [Token("", t, round(-0.2 - (t % 5) * 0.1, 4)) for t in ids[start + 1 :]]
        window = ([[None, ids[start], None]] if start < len(ids) else []) + [
            _triple(t, False) for t in scored
        ]
        meta["input_token_logprobs"] = window
        if k:
            rows = [[_triple(a, False) for a in _top(t, k)] for t in scored]
            meta["input_top_logprobs"] = ([None] if window else []) + rows
            if n == 0:  # SGLang 0.5.23 reports one row for the dummy token of a prefill-only request
                meta["output_top_logprobs"] = [[_triple(a, False) for a in _top(Token("", 3000, -2.6), k)]]
    out: dict[str, Any] = {
        "text": answer.text,
        "output_ids": [t.id for t in answer.tokens],
        "meta_info": meta,
    }
    if req.get("return_prompt_token_ids") is True:
        out["prompt_token_ids"] = ids
    return reply(200, dumps(out))


@dataclass
class EngineState:
    """What SGLang's tokenizer manager keeps and reports: model path, weight version, pause; the requests in flight
    (a weight update waits for them unless paused) and the gate new requests wait at (paused, or an update
    waiting: its writer lock has priority)."""

    model_path: str
    served_model_name: str
    tokenizer_path: str
    version: str = "0"
    load_format: str = "auto"
    paused: bool = False
    updating: bool = False
    in_flight: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.gate.set()
        self.idle.set()

    def _regate(self) -> None:
        if self.paused or self.updating:
            self.gate.clear()
        else:
            self.gate.set()

    async def enter(self) -> None:
        while not self.gate.is_set():
            await self.gate.wait()
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def model_info(self) -> bytes:
        """http_server.py's ``/model_info`` (its ``embedding`` block left out: only embedding-capable models)."""
        return dumps(
            {
                "model_path": self.model_path,
                "served_model_name": self.served_model_name,
                "tokenizer_path": self.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.version,
                "load_format": self.load_format,
                "reasoning_parser": None,
                "tool_call_parser": "qwen",
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    def models(self) -> bytes:
        """``/v1/models``: protocol.ModelList of the one served model."""
        name = self.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": CONTEXT_LEN,
        }
        return dumps({"object": "list", "data": [card]})

    async def pause(self, body: bytes) -> bytes:
        req = parse_json(body or b"{}")
        if isinstance(req, bytes):
            return req
        mode = req.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return api_error(
                400, f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}", "Bad Request"
            )
        self.paused = True
        self._regate()
        if mode == "abort":  # SGLang aborts until nothing is in flight; the stub's requests end by themselves
            await self.idle.wait()
        return reply(200, b'{"message":"Generation paused successfully.","status":"ok"}')

    def resume(self) -> bytes:
        self.paused = False
        self._regate()
        return reply(200, b'{"message":"Generation continued successfully.","status":"ok"}')

    async def update(self, body: bytes, load_s: float, on_change: Callable[[], None]) -> bytes:
        """``/update_weights_from_disk``: behind the writer lock (requests in flight finish, new ones wait) unless
        paused; the version changes only when one is given; ``model_path`` and the served name become the path."""
        req = parse_json(body)
        if isinstance(req, bytes):
            return req
        path, version = req.get("model_path"), req.get("weight_version")
        if not isinstance(path, str) or not isinstance(version, str | None):
            return api_error(
                400,
                "1 validation error: model_path (str) required, weight_version must be a string",
                "Bad Request",
            )
        if not self.paused:
            self.updating = True
            self._regate()
            await self.idle.wait()
        try:
            await asyncio.sleep(load_s)
            self.model_path = self.served_model_name = path
            fmt = req.get("load_format")
            self.load_format = fmt if isinstance(fmt, str) else self.load_format
            message = "Succeeded to update model weights."
            if version is not None:
                self.version = version
                message += f" Weight version updated to {version}."
            on_change()
        finally:
            self.updating = False
            self._regate()
        return reply(200, dumps({"success": True, "message": message, "num_paused_requests": 0}))


async def main(
    port: int,
    latency_s: float,
    tokens: int,
    fail_every: int = 0,
    slow_every: int = 0,
    slow_s: float = 2.0,
    break_every: int = 0,
    finish: str = "length",
    model_path: str = "stub",
) -> None:
    state = EngineState(model_path, model_path, model_path)
    answer_tokens = stub_tokens(tokens) + ([Token(EOS_TEXT, EOS_ID, -0.17)] if finish == "stop" else [])
    variants: dict[Ask, Prebuilt] = {}

    def answer() -> Answer:
        return Answer(answer_tokens, finish == "stop", PROMPT_IDS, state.version)

    def prebuilt(ask: Ask) -> Prebuilt:
        template = variants.get(ask)
        if template is None:
            if len(variants) >= _MAX_VARIANTS:
                variants.clear()
            template = variants[ask] = Prebuilt(chat_reply(answer(), ask))
        return template

    failure = api_error(500, "Internal server error: stub engine failure", "InternalServerError")
    plain = Ask(stream=True, logprobs=True, input_ids_ext=True, output_ids_ext=True)
    # Broken streams, alternately: three events and one that is not JSON, all sent at once; three events and
    # the connection closed with the response unfinished.
    broken_chunks = stream_chunks(answer(), plain)[:3]
    garbled = Prebuilt(event_stream([*broken_chunks, b"data: {not json\n\n"]))
    cut = Prebuilt(event_stream(broken_chunks, end=False))
    health = reply(200, b"")
    calls = broken = 0

    async def work(path: str, body: bytes) -> bytes:
        nonlocal calls, broken
        req = parse_json(body)
        if isinstance(req, bytes):
            return req
        chat = path == "/v1/chat/completions"
        refusal = stream_refusal(req) if chat else None
        if refusal is not None:
            return refusal
        calls += 1
        await asyncio.sleep(slow_s if slow_every and calls % slow_every == 0 else latency_s)
        if fail_every and calls % fail_every == 0:
            return failure
        if not chat:
            return generated(req, tokens, state.version)
        ask = read_ask(req)
        if ask.stream and break_every and calls % break_every == 0:
            broken += 1
            return garbled.stamp() if broken % 2 else Closing(cut.stamp())
        return prebuilt(ask).stamp()

    async def respond(path: str, body: bytes) -> bytes:
        path = path.partition("?")[0]
        if path in ("/v1/chat/completions", "/generate"):
            await state.enter()
            try:
                return await work(path, body)
            finally:
                state.leave()
        if path in ("/health", "/health_generate"):
            return health
        if path in ("/model_info", "/get_model_info"):
            return reply(200, state.model_info())
        if path == "/v1/models":
            return reply(200, state.models())
        if path == "/pause_generation":
            return await state.pause(body)
        if path == "/continue_generation":
            return state.resume()
        if path == "/update_weights_from_disk":
            return await state.update(body, latency_s, variants.clear)
        return NOT_FOUND

    await serve(port, respond)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--slow-every", type=int, default=0)
    ap.add_argument("--slow-ms", type=float, default=2000.0)
    ap.add_argument("--break-every", type=int, default=0, help="break every Nth call's stream (if streamed)")
    ap.add_argument("--finish", choices=["length", "stop"], default="length", help="how every answer ends")
    ap.add_argument("--model-path", default="stub", help="the model_path (and served name) it reports")
    a = ap.parse_args()
    asyncio.run(
        main(
            a.port,
            a.latency_ms / 1000,
            a.tokens,
            a.fail_every,
            a.slow_every,
            a.slow_ms / 1000,
            a.break_every,
            a.finish,
            a.model_path,
        )
    )
