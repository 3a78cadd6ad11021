"""A stand-in OpenAI-compatible server that records what a client (OpenClaw) sends.

    .venv/bin/python scripts/openclaw/capture_server.py --port 8011 --out capture.jsonl

POST /v1/chat/completions answers "Answer number N." (N counts requests since start), streamed as
chat.completion.chunk SSE events (with a final usage chunk when stream_options.include_usage is set) or as one
chat.completion. GET /v1/models lists the one model "turnstream". Every chat request is appended to --out as one
JSON line: {"headers": {lowercase name: value}, "body": {...}}, with the Authorization value replaced by
"Bearer REDACTED".

With --mode tools each reply also streams reasoning_content ("Thinking about request N."), its text is padded
with whitespace ("\n\nAnswer number N.  \n"), and a request whose messages hold no role "tool" message is answered
with one tool call instead of text: `ls` {"path": "."} when the request offers `ls`, else `tool_search`
{"query": "session status"}, with id "call_reqN_0". With --mode think the text carries an inline think block
("<think>\nPondering request N.\n</think>\n\nAnswer number N.") and no reasoning_content. With --mode empty
requests 1 and 3 get an empty answer (no text, zero completion tokens), which OpenClaw retries with an instruction.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

MODEL = "turnstream"
EMPTY_ANSWERS = (1, 3)
"""The requests --mode empty answers with nothing."""


TOOL_CHOICES = (("ls", {"path": "."}), ("tool_search", {"query": "session status"}))


def pick_tool_call(body: dict) -> tuple[str, dict] | None:
    """The tool call --mode tools answers with, or None when the request already carries a tool result."""
    messages = body.get("messages") or []
    if any(isinstance(m, dict) and m.get("role") == "tool" for m in messages):
        return None
    offered = {t.get("function", {}).get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
    for name, args in TOOL_CHOICES:
        if name in offered:
            return name, args
    return None


def make_app(out_path: str, mode: str = "text") -> Starlette:
    counter = itertools.count(1)
    lock = threading.Lock()

    def record(headers: dict[str, str], body: object) -> None:
        line = json.dumps({"headers": headers, "body": body}, ensure_ascii=False)
        with lock, open(out_path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    async def models(_: Request) -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "turnstream"}],
            }
        )

    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"_unparsed": raw.decode("utf-8", "replace")}
        headers = {k.lower(): v for k, v in request.headers.items()}
        if "authorization" in headers:
            headers["authorization"] = "Bearer REDACTED"
        record(headers, body)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "body must be a JSON object"}}, status_code=400)

        n = next(counter)
        text = f"Answer number {n}."
        if mode == "tools":
            text = f"\n\n{text}  \n"
        elif mode == "think":
            text = f"<think>\nPondering request {n}.\n</think>\n\n{text}"
        elif mode == "empty" and n in EMPTY_ANSWERS:
            text = ""
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        model = body.get("model") or MODEL
        prompt_tokens = max(1, len(json.dumps(body.get("messages", []))) // 4)
        pieces = [text[:7], text[7:14], text[14:]] if mode == "text" else [text[:10], text[10:30], text[30:]]
        pieces = [p for p in pieces if p]
        reasoning = f"Thinking about request {n}." if mode == "tools" else None
        call = pick_tool_call(body) if mode == "tools" else None
        call_id = f"call_req{n}_0"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(pieces),
            "total_tokens": prompt_tokens + len(pieces),
        }

        if not body.get("stream"):
            message: dict = {"role": "assistant", "content": None if call else text}
            if reasoning:
                message["reasoning_content"] = reasoning
            if call:
                message["tool_calls"] = [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": call[0], "arguments": json.dumps(call[1])},
                    }
                ]
            return JSONResponse(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "logprobs": None,
                            "finish_reason": "tool_calls" if call else "stop",
                        }
                    ],
                    "usage": usage,
                }
            )

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict, finish: str | None, **extra: object) -> str:
            obj = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            if include_usage:
                obj["usage"] = None
            obj.update(extra)
            return f"data: {json.dumps(obj)}\n\n"

        async def events():
            yield chunk({"role": "assistant", "content": ""}, None)
            if reasoning:
                yield chunk({"reasoning_content": reasoning[:9]}, None)
                yield chunk({"reasoning_content": reasoning[9:]}, None)
            if call:
                arguments = json.dumps(call[1])
                yield chunk(
                    {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": call_id,
                                "type": "function",
                                "function": {"name": call[0], "arguments": ""},
                            }
                        ]
                    },
                    None,
                )
                for part in (arguments[:5], arguments[5:]):
                    yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}, None)
                yield chunk({}, "tool_calls")
            else:
                for piece in pieces:
                    yield chunk({"content": piece}, None)
                yield chunk({}, "stop")
            if include_usage:
                final = {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/models", models, methods=["GET"]),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--out", required=True, help="JSONL file each request is appended to")
    parser.add_argument(
        "--mode", choices=("text", "tools", "think", "empty"), default="text", help="see above"
    )
    args = parser.parse_args()
    uvicorn.run(make_app(args.out, args.mode), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
