"""The teacher's context: the turn's request with the hindsight hint appended to its last user message.

Pure functions over the contract types, so that the teacher worker and anyone checking it (tests, a replay)
build the very same prompt.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas import Message

HINT_PREFIX = "\n\n[user's hint / instruction]\n"


def _append(content: str | list[dict[str, Any]] | None, text: str) -> str | list[dict[str, Any]]:
    if isinstance(content, list):
        parts = [dict(p) for p in content]
        for p in reversed(parts):
            if p.get("type", "text") == "text":
                p["text"] = str(p.get("text", "")) + text
                return parts
        return [*parts, {"type": "text", "text": text.lstrip("\n")}]
    return (content or "") + text


def enhanced_messages(messages: list[Message], hint: str) -> list[Message]:
    """``messages`` with ``HINT_PREFIX + hint`` appended to the last user message (the last message if there is
    no user message). The input is left unchanged."""
    if not messages:
        raise ValueError("a turn without messages cannot be enhanced")
    target = next(
        (i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "user"), len(messages) - 1
    )
    out = list(messages)
    out[target] = msgspec.structs.replace(
        out[target], content=_append(out[target].content, HINT_PREFIX + hint)
    )
    return out


def as_request_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as the chat template receives them from a client (unset fields left out)."""
    return [msgspec.to_builtins(m) for m in messages]
