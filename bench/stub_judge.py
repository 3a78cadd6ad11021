"""A stub judge engine: answers /v1/chat/completions as SGLang 0.5.23 does (bench/stub_engine.py's shapes, checked by
tests/contract) after a fixed latency, with the text an LLM judge writes, so judge workers can be measured and tested
without a GPU. It runs in its own process. The flags SGLang takes (log-probs, token ids, ``meta_info``, ``sglext``
ids, streaming, its refusals) are honoured too; ``/model_info``, ``/v1/models`` and ``/health`` answer as SGLang's.

The verdict is read from the judge prompt: a next state mentioning "wrong" is a correction (eval \\boxed{-1};
hint \\boxed{1} with a hint naming the turn), anything else is fine (eval \\boxed{1}; hint \\boxed{-1}). The answer
ends with EOS, or at ``max_tokens``.
``--fail-every N`` answers every Nth chat request with ``--fail-status`` (500: a flaky engine; 400: an engine
that rejects those requests).

    python bench/stub_judge.py --port 31001 [--latency-ms 50] [--fail-every 0]
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import Any

from stub_engine import (
    EOS_ID,
    EOS_TEXT,
    NOT_FOUND,
    Answer,
    EngineState,
    Token,
    api_error,
    chat_reply,
    parse_json,
    read_ask,
    stamp,
    stream_refusal,
    text_tokens,
)
from stub_http import reply, serve

_STATE = re.compile(
    r"## Next state \(role: [^)]*\)\n(?:<next_state>\n(.*?)\n</next_state>|(.*?)\n\n(?:Did|Does) )", re.S
)
"""The next state in the shipped prompts (between its tags), or in a prompt without them."""


def verdict(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    user = next(
        (
            str(m.get("content") or "")
            for m in reversed(messages if isinstance(messages, list) else [])
            if isinstance(m, dict) and m.get("role") == "user"
        ),
        "",
    )
    m = _STATE.search(user)
    state = (m.group(1) or m.group(2) or "") if m else user
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


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """Stand-in prompt ids, about one per four characters of the messages (the stub has no tokenizer)."""
    messages = body.get("messages")
    size = (
        sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict))
        if isinstance(messages, list)
        else 0
    )
    return [1000 + i for i in range(size // 4 + 1)]


def judge_answer(body: dict[str, Any], version: str) -> Answer:
    """The verdict's tokens then EOS, cut at ``max_tokens`` (``max_completion_tokens``) as SGLang would."""
    tokens = [*text_tokens(verdict(body)), Token(EOS_TEXT, EOS_ID, -0.02)]
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    stopped = True
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < len(tokens):
        tokens, stopped = tokens[:limit], False
    return Answer(tokens, stopped, prompt_ids(body), version)


async def main(port: int, latency_s: float, fail_every: int, fail_status: int) -> None:
    state = EngineState("stub-judge", "stub-judge", "stub-judge")
    failure = api_error(
        fail_status,
        "stub failure" if fail_status < 500 else "Internal server error: stub failure",
        "BadRequest" if fail_status < 500 else "InternalServerError",
    )
    calls = 0

    async def chat(body: bytes) -> bytes:
        nonlocal calls
        req = parse_json(body)
        if isinstance(req, bytes):
            return req
        refusal = stream_refusal(req)
        if refusal is not None:
            return refusal
        calls += 1
        await asyncio.sleep(latency_s)
        if fail_every and calls % fail_every == 0:
            return failure
        return stamp(chat_reply(judge_answer(req, state.version), read_ask(req)))

    async def respond(path: str, body: bytes) -> bytes:
        path = path.partition("?")[0]
        if path == "/v1/chat/completions":
            return await chat(body)
        if path in ("/health", "/health_generate"):
            return reply(200, b"")
        if path in ("/model_info", "/get_model_info"):
            return reply(200, state.model_info())
        if path == "/v1/models":
            return reply(200, state.models())
        return NOT_FOUND

    await serve(port, respond)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--fail-status", type=int, default=500)
    a = ap.parse_args()
    asyncio.run(main(a.port, a.latency_ms / 1000, a.fail_every, a.fail_status))
