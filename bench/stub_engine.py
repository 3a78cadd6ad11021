"""A stub engine for benchmarks and fault tests: answers /v1/chat/completions in SGLang's (and turnstream's
engine's) shapes after a fixed latency, with a fixed number of tokens and their log-probs, streamed or not, and
/generate's prefill scoring (``max_new_tokens`` 0, ``input_token_logprobs`` from ``logprob_start_len``) the way the
teacher asks for it. It runs in its own process so that it never shares an event loop with what is measured.
``--fail-every N`` answers every Nth chat or generate request with HTTP 500 (an engine error at a fixed rate);
``--slow-every N`` answers every Nth after ``--slow-ms`` instead (a timeout, for a client that waits less).

    python bench/stub_engine.py --port 31000 [--latency-ms 20] [--tokens 60] [--fail-every 0] [--slow-every 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json

from stub_http import Closing, reply, serve

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


def scored(body: bytes) -> bytes:
    """/generate as the teacher calls it: a log-prob for every input token from ``logprob_start_len`` on (SGLang
    leaves the first entry of the window unscored)."""
    req = json.loads(body)
    ids = req["input_ids"]
    start = max(int(req.get("logprob_start_len", 0)), 0)
    window = [[None, ids[start], None]] + [[-0.2 - (t % 5) * 0.1, t, None] for t in ids[start + 1 :]]
    meta = {
        "input_token_logprobs": window,
        "output_token_logprobs": [],
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(ids),
        "weight_version": "0",
    }
    if int(req.get("top_logprobs_num", 0)):
        k = int(req["top_logprobs_num"])
        meta["input_top_logprobs"] = [None] + [[[-0.2, t, None]] * k for t in ids[start + 1 :]]
    return json.dumps({"text": "", "output_ids": [], "meta_info": meta}).encode()


def event_stream(chunks: list[bytes], end: bool = True) -> bytes:
    """An SSE response in chunked encoding, one HTTP chunk per event; without its terminator when not ``end``."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    body = b"".join(f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in chunks)
    return head + body + (b"0\r\n\r\n" if end else b"")


async def main(
    port: int,
    latency_s: float,
    tokens: int,
    fail_every: int = 0,
    slow_every: int = 0,
    slow_s: float = 2.0,
    break_every: int = 0,
) -> None:
    full, chunks = build(tokens)
    info = reply(200, b'{"weight_version": "0", "model_path": "stub"}')
    complete = reply(200, full)
    failure = reply(500, b'{"error": {"message": "stub engine failure", "code": 500}}')
    streamed = event_stream(chunks)
    # Broken streams, alternately: three events and one that is not JSON, all sent at once; three events and
    # the connection closed with the response unfinished.
    garbled = event_stream([*chunks[:3], b"data: {not json\n\n"])
    cut = Closing(event_stream(chunks[:3], end=False))
    calls = broken = 0

    async def respond(path: str, body: bytes) -> bytes:
        nonlocal calls, broken
        if path in ("/health", "/get_model_info"):
            return info
        calls += 1
        await asyncio.sleep(slow_s if slow_every and calls % slow_every == 0 else latency_s)
        if fail_every and calls % fail_every == 0:
            return failure
        if path == "/generate":
            return reply(200, scored(body))
        if b'"stream":true' not in body.replace(b" ", b""):
            return complete
        if break_every and calls % break_every == 0:
            broken += 1
            return garbled if broken % 2 else cut
        return streamed

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
    a = ap.parse_args()
    asyncio.run(
        main(
            a.port, a.latency_ms / 1000, a.tokens, a.fail_every, a.slow_every, a.slow_ms / 1000, a.break_every
        )
    )
