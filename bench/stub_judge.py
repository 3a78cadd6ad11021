"""A stub judge engine: answers /v1/chat/completions in the OpenAI/SGLang shape after a fixed latency with the text
an LLM judge writes, so judge workers can be measured and tested without a GPU. It runs in its own process.

The verdict is read from the judge prompt: a next state mentioning "wrong" is a correction (eval \\boxed{-1};
hint \\boxed{1} with a hint naming the turn), anything else is fine (eval \\boxed{1}; hint \\boxed{-1}).
``--fail-every N`` answers every Nth chat request with ``--fail-status`` (500: a flaky engine; 400: an engine
that rejects those requests).

    python bench/stub_judge.py --port 31001 [--latency-ms 50] [--fail-every 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re

from stub_http import reply, serve

_STATE = re.compile(r"## Next state \(role: [^)]*\)\n(.*?)\n\n(Did|Does) ", re.S)


def verdict(body: dict) -> str:
    user = next(
        (m.get("content") or "" for m in reversed(body.get("messages", [])) if m["role"] == "user"), ""
    )
    m = _STATE.search(user)
    state = m.group(1) if m else user
    bad = "wrong" in state.lower()
    if "[HINT_START]" not in user:
        return "The next state " + (
            "corrects the step. \\boxed{-1}" if bad else "accepts the step. \\boxed{1}"
        )
    if not bad:
        return "Nothing to learn in hindsight. \\boxed{-1}"
    return (
        "The user corrected the assistant. \\boxed{1}\n"
        f"[HINT_START]Check the request again: {state.strip()[:80]}[HINT_END]"
    )


async def main(port: int, latency_s: float, fail_every: int, fail_status: int) -> None:
    calls = 0

    async def respond(path: str, body: bytes) -> bytes:
        nonlocal calls
        if path in ("/health", "/get_model_info"):
            return reply(200, b'{"model_path": "stub-judge", "weight_version": "0"}')
        if path == "/v1/models":
            return reply(200, b'{"object": "list", "data": [{"id": "stub-judge"}]}')
        calls += 1
        await asyncio.sleep(latency_s)
        if fail_every and calls % fail_every == 0:
            return reply(fail_status, b'{"error": {"message": "stub failure"}}')
        out = {
            "id": f"chatcmpl-{calls}",
            "object": "chat.completion",
            "model": "stub-judge",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": verdict(json.loads(body))},
                    "finish_reason": "stop",
                }
            ],
        }
        return reply(200, json.dumps(out).encode())

    await serve(port, respond)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--fail-status", type=int, default=500)
    a = ap.parse_args()
    asyncio.run(main(a.port, a.latency_ms / 1000, a.fail_every, a.fail_status))
