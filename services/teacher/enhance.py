"""The teacher's context: the turn's request with the hindsight hint appended to its last user message.

Pure functions over the contract types, so that the teacher worker and anyone checking it (tests, a replay)
build the very same prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from schemas import Message

HINT_TEMPLATE_FILE = Path(__file__).with_name("hint.txt")
HINT_TEMPLATE = HINT_TEMPLATE_FILE.read_text()
"""OpenClaw-RL's: the hint under a heading, after a blank line (``teacher.hint_template`` names another file)."""
HINT_PREFIX = HINT_TEMPLATE.partition("{hint}")[0]


def load_template(path: str | Path | None) -> str:
    """The text of a hint template file (default: the shipped one); it must hold ``{hint}`` once."""
    text = Path(path).read_text() if path else HINT_TEMPLATE
    if text.count("{hint}") != 1:
        raise ValueError(f"teacher.hint_template: {path} must contain {{hint}} exactly once")
    return text


def _append(content: str | list[dict[str, Any]] | None, text: str) -> str | list[dict[str, Any]]:
    if isinstance(content, list):
        parts = [dict(p) for p in content]
        for p in reversed(parts):
            if p.get("type", "text") == "text":
                p["text"] = str(p.get("text", "")) + text
                return parts
        return [*parts, {"type": "text", "text": text.lstrip("\n")}]
    return (content or "") + text


def enhanced_messages(messages: list[Message], hint: str, template: str = HINT_TEMPLATE) -> list[Message]:
    """``messages`` with ``template`` (``{hint}`` replaced by ``hint``) appended to the last user message (the
    last message if there is no user message). The input is left unchanged."""
    if not messages:
        raise ValueError("a turn without messages cannot be enhanced")
    target = next(
        (i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "user"), len(messages) - 1
    )
    out = list(messages)
    out[target] = msgspec.structs.replace(
        out[target], content=_append(out[target].content, template.replace("{hint}", hint))
    )
    return out


def as_request_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as the chat template receives them from a client (unset fields left out)."""
    return [msgspec.to_builtins(m) for m in messages]
