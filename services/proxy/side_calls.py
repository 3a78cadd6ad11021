"""Housekeeping calls stock clients make beside the conversation, recognised without any header: served, never
recorded (a side turn), so they are neither trained on nor taken for the conversation's next turn. Each API's own
rules are its ``Api.side_call``; these are chat completions'. Documented in docs/clients.md ("Housekeeping calls")."""

from __future__ import annotations

from typing import Any

SIDE_PROMPTS = ("You are a title generator.",)
"""System prompts that open a client's housekeeping request: opencode's session titles (its ``title`` agent, sent
beside the first turn with the same session headers)."""


def chat_side_call(body: dict[str, Any]) -> bool:
    messages = body.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    if not isinstance(first, dict) or first.get("role") != "system":
        return False
    content = first.get("content")
    return isinstance(content, str) and content.startswith(SIDE_PROMPTS)
