"""FastAPI app speaking the subset of SGLang's HTTP API that turnstream uses (see DESIGN §4 "engine")."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest

from services.chat_template import TemplateError, render_prompt_ids
from services.engine.parsers import StreamSplitter, parse_tool_calls, split_reasoning
from services.engine.protocol import (
    ChatCompletionRequest,
    GenerateRequest,
    GenerateSamplingParams,
    UpdateWeightsRequest,
)
from services.engine.runner import Finished, Job, LoadedModel, Runner, TokenOut
from services.engine.sampling import SamplingConfig

log = logging.getLogger("turnstream.engine")

REQUESTS = Counter("turnstream_engine_requests_total", "Requests served", ["endpoint", "status"])
GENERATED = Counter("turnstream_engine_generated_tokens_total", "Tokens generated")
SCORED = Counter("turnstream_engine_prompt_tokens_total", "Prompt tokens processed (prefill)")
ABANDONED = Counter(
    "turnstream_engine_requests_abandoned_total",
    "Requests whose client left before the end (generation stopped)",
)
QUEUE = Gauge("turnstream_engine_queue_depth", "Requests admitted or waiting in the inference thread")
RELOADS = Counter("turnstream_engine_weight_updates_total", "Weight updates", ["status"])


class BadRequest(Exception):
    pass


def error_response(message: str, status: int = 400, err_type: str = "BadRequestError") -> JSONResponse:
    """SGLang's error shape."""
    return JSONResponse(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status},
        status_code=status,
    )


@dataclass
class EngineSettings:
    model_path: str
    served_model_name: str
    weight_version: str = "0"
    reasoning_parser: bool = False
    tool_call_parser: bool = True


def _decode_body(raw: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _text_of(message: dict[str, Any]) -> dict[str, Any]:
    """Flatten OpenAI text content parts to a string (as SGLang does for templates); reject non-text parts."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise BadRequest(
                    f"content part type {part.get('type')!r} is not supported by this engine (text only)"
                )
            texts.append(part.get("text") or "")
        return {**message, "content": "".join(texts)}
    return message


def create_app(settings: EngineSettings, runner: Runner | None = None) -> FastAPI:
    model = (
        runner.current if runner is not None else LoadedModel(settings.model_path, settings.weight_version)
    )
    runner = runner or Runner(model)
    tokenizer = model.tokenizer
    app = FastAPI(title="turnstream engine", docs_url=None, redoc_url=None)
    app.state.runner = runner
    app.state.settings = settings

    @app.on_event("startup")
    async def _start() -> None:
        runner.start()
        log.info(
            "engine ready", extra={"model": settings.model_path, "weight_version": runner.current.version}
        )

    @app.on_event("shutdown")
    async def _stop() -> None:
        runner.shutdown()

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(str(exc))

    def render(
        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> list[int]:
        try:
            return render_prompt_ids(tokenizer, messages, tools, kwargs)
        except TemplateError as exc:
            raise BadRequest(str(exc)) from None

    async def run_job(job: Job) -> AsyncIterator[TokenOut | Finished]:
        events = runner.submit(job)
        QUEUE.set(runner.queue_depth)
        try:
            while True:
                item = await events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finished):
                    GENERATED.inc(item.completion_tokens)
                    SCORED.inc(item.prompt_tokens)
                    return
        except (GeneratorExit, asyncio.CancelledError):
            ABANDONED.inc()
            raise
        finally:
            job.cancelled.set()  # a client that went away frees the inference thread
            QUEUE.set(runner.queue_depth)

    def check_length(ids: list[int], max_new: int) -> None:
        limit = runner.current.max_context
        if len(ids) + max_new > limit:
            raise BadRequest(
                f"the prompt ({len(ids)} tokens) plus max_new_tokens ({max_new}) exceeds the context length {limit}"
            )

    # --- /v1/chat/completions ------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        raw = await request.body()
        req: ChatCompletionRequest = _decode_body(raw, ChatCompletionRequest)
        for penalty in ("presence_penalty", "frequency_penalty"):
            if getattr(req, penalty):
                raise BadRequest(f"{penalty} is not supported by this engine (only 0)")
        messages = [_text_of(m) for m in msgspec.json.decode(raw)["messages"]]
        tools = req.tools if req.tool_choice != "none" else None
        ids = await asyncio.to_thread(render, messages, tools, req.chat_template_kwargs or {})
        max_new = (
            req.max_completion_tokens
            or req.max_tokens
            or max(1, min(2048, runner.current.max_context - len(ids)))
        )
        check_length(ids, max_new)
        top_k = (req.top_logprobs or 0) if req.logprobs else 0
        job = Job(
            input_ids=ids,
            max_new_tokens=max_new,
            sampling=SamplingConfig(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                seed=req.seed,
            ),
            stop=_stop_list(req.stop),
            stop_token_ids=frozenset(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            top_k=top_k,
            skip_special_tokens=req.skip_special_tokens,
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        name = req.model or settings.served_model_name
        reasoning = settings.reasoning_parser and req.separate_reasoning
        parse_tools = bool(tools) and settings.tool_call_parser
        if req.stream:
            REQUESTS.labels("chat_stream", "200").inc()
            return StreamingResponse(
                _chat_stream(req, job, ids, rid, created, name, reasoning, parse_tools),
                media_type="text/event-stream",
            )
        tokens: list[TokenOut] = []
        texts: list[str] = []
        fin: Finished | None = None
        async for item in run_job(job):
            if isinstance(item, TokenOut):
                tokens.append(item)
                texts.append(item.text)
            else:
                fin = item
                texts.append(item.text)
        assert fin is not None
        text = "".join(texts)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "reasoning_content": None,
            "tool_calls": None,
        }
        finish = fin.reason
        if reasoning:
            message["reasoning_content"], message["content"] = split_reasoning(message["content"])
        if parse_tools:
            content, calls = parse_tool_calls(message["content"])
            if calls:
                message["content"] = content
                message["tool_calls"] = [c.to_openai() for c in calls]
                if finish == "stop":
                    finish = "tool_calls"
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": {"content": [_chat_logprob(tokenizer, t) for t in tokens]} if req.logprobs else None,
            "finish_reason": finish,
            "matched_stop": fin.matched,
        }
        if req.return_prompt_token_ids:
            choice["prompt_token_ids"] = ids
        if req.return_token_ids:
            choice["token_ids"] = [t.token_id for t in tokens]
        if req.return_meta_info:
            choice["meta_info"] = _meta_info(rid, fin, tokens, top_k > 0)
        REQUESTS.labels("chat", "200").inc()
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": name,
                "choices": [choice],
                "usage": _usage(fin),
                "metadata": {"weight_version": fin.weight_version},
            }
        )

    async def _chat_stream(
        req: ChatCompletionRequest,
        job: Job,
        ids: list[int],
        rid: str,
        created: int,
        name: str,
        reasoning: bool,
        parse_tools: bool,
    ) -> AsyncIterator[bytes]:
        def chunk(delta: dict[str, Any], **extra: Any) -> bytes:
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}],
            }
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        first_extra: dict[str, Any] = {}
        if req.return_prompt_token_ids:
            first_extra["prompt_token_ids"] = ids
        yield chunk({"role": "assistant", "content": ""}, **first_extra)
        splitter = StreamSplitter(reasoning, parse_tools)
        full_text: list[str] = []
        fin: Finished | None = None
        try:
            async for item in run_job(job):
                text = item.text
                full_text.append(text)
                if isinstance(item, Finished):
                    fin = item
                r_delta, c_delta = splitter.feed(text, final=fin is not None)
                extra: dict[str, Any] = {}
                if isinstance(item, TokenOut):
                    if req.logprobs:
                        extra["logprobs"] = {"content": [_chat_logprob(tokenizer, item)]}
                    if req.return_token_ids:
                        extra["token_ids"] = [item.token_id]
                delta: dict[str, Any] = {}
                if r_delta:
                    delta["reasoning_content"] = r_delta
                if c_delta:
                    delta["content"] = c_delta
                if delta or extra:
                    yield chunk(delta, **extra)
        except Exception as exc:
            log.exception("streamed generation failed")
            err = {
                "object": "error",
                "message": f"generation failed: {exc}",
                "type": "InternalServerError",
                "code": 500,
            }
            yield b"data: " + json.dumps({"error": err}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        assert fin is not None
        finish = fin.reason
        if parse_tools and splitter.in_tool:
            _, calls = parse_tool_calls(splitter.buffer)
            if calls:
                yield chunk({"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]})
                if finish == "stop":
                    finish = "tool_calls"
            else:
                yield chunk({"content": splitter.buffer})
        yield chunk({}, finish_reason=finish, matched_stop=fin.matched)
        tail = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": name,
            "choices": [],
            "metadata": {"weight_version": fin.weight_version},
        }
        if req.stream_options is not None and req.stream_options.include_usage:
            tail["usage"] = _usage(fin)
        yield b"data: " + json.dumps(tail).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    # --- /generate ------------------------------------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        req: GenerateRequest = _decode_body(await request.body(), GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise BadRequest("give exactly one of text or input_ids")
        if req.input_ids is not None:
            ids = list(req.input_ids)
            vocab = runner.current.vocab_size
            if bad := [i for i in ids if i >= vocab]:
                raise BadRequest(f"input_ids holds ids outside the vocabulary (size {vocab}): {bad[:5]}")
        else:
            ids = await asyncio.to_thread(lambda: list(tokenizer(req.text).input_ids))
        if not ids:
            raise BadRequest("the input is empty")
        sp = req.sampling_params or GenerateSamplingParams()
        check_length(ids, sp.max_new_tokens)
        start: int | None = None
        if req.return_logprob:
            start = len(ids) - 1 if req.logprob_start_len < 0 else req.logprob_start_len
            if start >= len(ids):
                raise BadRequest(
                    f"logprob_start_len {start} must be smaller than the input length {len(ids)}"
                )
        job = Job(
            input_ids=ids,
            max_new_tokens=sp.max_new_tokens,
            sampling=SamplingConfig(sp.temperature, sp.top_p, sp.top_k, sp.sampling_seed),
            stop=_stop_list(sp.stop),
            stop_token_ids=frozenset(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos,
            logprob_start=start,
            top_k=req.top_logprobs_num if req.return_logprob else 0,
            skip_special_tokens=sp.skip_special_tokens,
        )
        rid = req.rid or uuid.uuid4().hex
        tokens: list[TokenOut] = []
        texts: list[str] = []
        fin: Finished | None = None
        t0 = time.perf_counter()
        async for item in run_job(job):
            if isinstance(item, TokenOut):
                tokens.append(item)
            else:
                fin = item
            texts.append(item.text)
        assert fin is not None
        meta = _meta_info(
            rid,
            fin,
            tokens,
            req.return_logprob and req.top_logprobs_num > 0,
            with_logprobs=req.return_logprob,
        )
        meta["e2e_latency"] = time.perf_counter() - t0
        if req.return_logprob:
            names = (lambda i: tokenizer.decode([i])) if req.return_text_in_logprobs else (lambda i: None)
            in_ids = ids[start:]
            meta["input_token_logprobs"] = [
                [lp, tok, names(tok)] for lp, tok in zip(fin.input_logprobs or [], in_ids, strict=True)
            ]
            if req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None if row is None else [[lp, t, names(t)] for lp, t in row]
                    for row in (fin.input_top or [])
                ]
            if req.return_text_in_logprobs:
                for entry in meta["output_token_logprobs"]:
                    entry[2] = names(entry[1])
        REQUESTS.labels("generate", "200").inc()
        return JSONResponse(
            {"text": "".join(texts), "output_ids": [t.token_id for t in tokens], "meta_info": meta}
        )

    # --- weights and info -----------------------------------------------------------------------------------

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request) -> Response:
        req: UpdateWeightsRequest = _decode_body(await request.body(), UpdateWeightsRequest)
        version = str(req.weight_version) if req.weight_version is not None else None
        with_lock = runner.reload_lock
        if not with_lock.acquire(blocking=False):
            return JSONResponse({"success": False, "message": "another weight update is in progress"}, 409)
        try:
            current = runner.current
            new_version = version if version is not None else current.version
            t0 = time.perf_counter()
            try:
                loaded = await asyncio.to_thread(LoadedModel, req.model_path, new_version, current.tokenizer)
            except Exception as exc:
                RELOADS.labels("failed").inc()
                return JSONResponse(
                    {"success": False, "message": f"failed to load weights from {req.model_path}: {exc}"}, 400
                )
            if loaded.vocab_size != current.vocab_size:
                RELOADS.labels("failed").inc()
                return JSONResponse(
                    {"success": False, "message": f"vocab size {loaded.vocab_size} != {current.vocab_size}"},
                    400,
                )
            runner.swap(loaded)
            RELOADS.labels("ok").inc()
            seconds = time.perf_counter() - t0
            log.info(
                "weights updated", extra={"path": req.model_path, "weight_version": new_version, "s": seconds}
            )
            return JSONResponse(
                {
                    "success": True,
                    "message": f"loaded {req.model_path} as weight version {new_version} in {seconds:.2f}s",
                    "num_paused_requests": 0,
                }
            )
        finally:
            with_lock.release()

    @app.get("/get_model_info")
    async def model_info() -> Response:
        cur = runner.current
        return JSONResponse(
            {
                "model_path": cur.path,
                "tokenizer_path": settings.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": cur.version,
                "served_model_name": settings.served_model_name,
                "max_context_length": cur.max_context,
            }
        )

    @app.get("/get_weight_version")
    async def weight_version() -> Response:
        return JSONResponse({"weight_version": runner.current.version})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> Response:
        cur = runner.current
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": settings.served_model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "turnstream",
                        "root": cur.path,
                        "max_model_len": cur.max_context,
                    }
                ],
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def _chat_logprob(tokenizer: Any, t: TokenOut) -> dict[str, Any]:
    text = tokenizer.decode([t.token_id])
    entry: dict[str, Any] = {
        "token": text,
        "logprob": t.logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [],
    }
    for lp, tid in t.top or []:
        s = tokenizer.decode([tid])
        entry["top_logprobs"].append({"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))})
    return entry


def _usage(fin: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }


def _meta_info(
    rid: str, fin: Finished, tokens: list[TokenOut], top: bool, with_logprobs: bool = True
) -> dict[str, Any]:
    if fin.reason == "length":
        finish: dict[str, Any] = {"type": "length", "length": fin.completion_tokens}
    elif fin.reason == "stop":
        finish = {"type": "stop", "matched": fin.matched}
    else:
        finish = {"type": "abort", "message": "request aborted"}
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "cached_tokens": 0,
        "weight_version": fin.weight_version,
    }
    if with_logprobs:
        meta["output_token_logprobs"] = [[t.logprob, t.token_id, None] for t in tokens]
        if top:
            meta["output_top_logprobs"] = [[[lp, i, None] for lp, i in (t.top or [])] for t in tokens]
    return meta
