"""A stub policy engine for benchmarks: answers /v1/chat/completions in SGLang's (and turnstream's engine's)
shapes after a fixed latency, with a fixed number of tokens and their log-probs, streamed or not. It runs in its
own process so that it never shares an event loop with what is measured.

    python bench/stub_engine.py --port 31000 [--latency-ms 20] [--tokens 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json

from stub_http import reply, serve

PROMPT_IDS = list(range(1000, 1030))


def build(tokens: int) -> tuple[bytes, list[bytes]]:
    words = [f" w{i}" for i in range(tokens)]
    ids = [2000 + i for i in range(tokens)]
    lps = [-0.1 - (i % 7) * 0.05 for i in range(tokens)]
    content = [
        {"token": w, "logprob": lp, "bytes": list(w.encode()), "top_logprobs": []}
        for w, lp in zip(words, lps, strict=False)
    ]
    full = {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": "stub",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "".join(words),
                    "reasoning_content": None,
                    "tool_calls": None,
                },
                "logprobs": {"content": content},
                "finish_reason": "length",
                "matched_stop": None,
                "prompt_token_ids": PROMPT_IDS,
                "token_ids": ids,
            }
        ],
        "usage": {
            "prompt_tokens": len(PROMPT_IDS),
            "completion_tokens": tokens,
            "total_tokens": len(PROMPT_IDS) + tokens,
        },
        "metadata": {"weight_version": "0"},
    }

    def chunk(delta: dict, **extra: object) -> bytes:
        body = {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "stub",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}],
        }
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    chunks = [chunk({"role": "assistant", "content": ""}, prompt_token_ids=PROMPT_IDS)]
    for w, i, c in zip(words, ids, content, strict=False):
        chunks.append(chunk({"content": w}, logprobs={"content": [c]}, token_ids=[i]))
    chunks.append(chunk({}, finish_reason="length"))
    tail = {
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "stub",
        "choices": [],
        "metadata": {"weight_version": "0"},
    }
    chunks.append(b"data: " + json.dumps(tail).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    return json.dumps(full).encode(), chunks


async def main(port: int, latency_s: float, tokens: int) -> None:
    full, chunks = build(tokens)
    info = reply(200, b'{"weight_version": "0"}')
    complete = reply(200, full)
    streamed = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks)
        + b"0\r\n\r\n"
    )

    async def respond(path: str, body: bytes) -> bytes:
        if path in ("/health", "/get_model_info"):
            return info
        await asyncio.sleep(latency_s)
        return streamed if b'"stream":true' in body.replace(b" ", b"") else complete

    await serve(port, respond)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=60)
    a = ap.parse_args()
    asyncio.run(main(a.port, a.latency_ms / 1000, a.tokens))
