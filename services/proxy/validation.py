"""What the proxy checks of a chat request before it reaches the engine, so that bad input is a clear 400 (or
413) in OpenAI's shape, and never a request the engine refuses after a user waited, or one the contract would not
record."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request

from runtime.engine.chat_template import for_engine
from schemas import Message

_json_decoder = msgspec.json.Decoder()

PARSE_IN_THREAD_BYTES = 512 * 1024
"""Bodies larger than this are parsed off the event loop. Text-heavy chats parse at ~3 GB/s (1 ms for 3 MiB), but
a body of tiny objects is ~100 times slower (8 MiB of empty messages: 0.7-0.9 s, every stream stalled meanwhile);
below this size even that is a few milliseconds, and a thread hop costs more than it saves."""


class BadInput(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadInput(
            413, f"request body of {declared} bytes exceeds the limit of {limit}", "request_too_large"
        )
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadInput(413, f"request body exceeds the limit of {limit} bytes", "request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut off by the body deadline (runtime/transport/guard.py)
        raise BadInput(
            400, "the connection closed before the request body arrived", "incomplete_body"
        ) from None
    return b"".join(chunks)


_INT64 = 2**63 - 1
# Sampling settings the proxy checks itself (type and range), so that a bad value is a clear 400 rather than
# whatever an engine makes of it: (lowest, highest, integer?, lowest excluded?). The ranges are OpenAI's, narrowed
# to what SGLang 0.5.23 accepts (``SamplingParams.verify``: top_p in (0, 1], repetition_penalty in (0, 2], top_k
# -1 or at least 1), so a main turn is never answered by the engine's refusal.
_SAMPLING: dict[str, tuple[float, float, bool, bool]] = {
    "max_tokens": (1, 2**31 - 1, True, False),
    "max_completion_tokens": (1, 2**31 - 1, True, False),
    "n": (1, 128, True, False),
    "seed": (-_INT64 - 1, _INT64, True, False),
    "top_logprobs": (0, 20, True, False),
    "top_k": (-1, 2**31 - 1, True, False),
    "temperature": (0.0, 2.0, False, False),
    "top_p": (0.0, 1.0, False, True),
    "min_p": (0.0, 1.0, False, False),
    "presence_penalty": (-2.0, 2.0, False, False),
    "frequency_penalty": (-2.0, 2.0, False, False),
    "repetition_penalty": (0.0, 2.0, False, True),
}


def _check_sampling(name: str, value: object) -> None:
    low, high, integer, open_low = _SAMPLING[name]
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        kind = "an integer" if integer else "a number"
        raise BadInput(400, f"'{name}' must be {kind}", "invalid_value")
    if not low <= value <= high or (open_low and value == low):  # NaN fails this too
        interval = f"{'(' if open_low else '['}{low}, {high}]"
        raise BadInput(400, f"'{name}' must be in {interval}, got {value}", "invalid_value")
    if name == "top_k" and value == 0:
        raise BadInput(400, "'top_k' must be -1 (the whole vocabulary) or at least 1, got 0", "invalid_value")


def parse_chat(raw: bytes, max_messages: int = 10_000) -> dict[str, Any]:
    try:
        body = _json_decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # invalid UTF-8 surfaces as UnicodeDecodeError
        raise BadInput(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadInput(400, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadInput(400, "the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadInput(400, "'messages' must be a non-empty array of messages")
    if len(messages) > max_messages:
        raise BadInput(
            400,
            f"'messages' holds {len(messages)} messages, more than the limit of {max_messages}",
            "too_many_messages",
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadInput(400, f"messages[{i}] must be an object with a string 'role'")
    try:  # the contract's own check (~2 us): a request it refuses would be served and never recorded
        msgspec.convert(messages, list[Message])
    except (msgspec.ValidationError, ValueError) as exc:
        raise BadInput(400, f"'messages' is not a valid chat: {exc}".replace("`$", "`messages")) from None
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadInput(400, "'stream' must be a boolean")
    if not isinstance(body.get("model"), str | None):
        raise BadInput(400, "'model' must be a string")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadInput(400, "'tools' must be an array of objects")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))
    ):
        raise BadInput(400, "'stop' must be a string or an array of strings")
    for name in _SAMPLING.keys() & body.keys():
        if body[name] is not None:
            _check_sampling(name, body[name])
    body["messages"] = for_engine(messages)  # a developer message is a system message to the model
    return body
