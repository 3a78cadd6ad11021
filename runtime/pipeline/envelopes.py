"""What clients wrap around what a person said, and what they add to one request only.

Shared runtime, so that the proxy (conversation continuity), the pairer (next states), the rules judge and the
simulated users read a conversation the same way:

- an **envelope** is text a client puts around a user's words: stock OpenClaw prefixes each user message with the
  time it was sent (``[Wed 2026-12-02 08:52 UTC] No, answer in one word.``). Checks that read what the user said
  (the rules judge's "No, ..." correction) read it without the envelope; the recorded text keeps it.
- a **volatile section** of a system prompt is one the client rewrites between requests (OpenClaw's dynamic
  section, with today's date), and an answer's **think block** is dropped by clients that keep the history; neither
  makes a request a different conversation.
- a **request-only message** is one a client appends to a single request and leaves out of the history it sends
  later: OpenClaw's ``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>`` block, and the instruction it retries an attempt with
  (``The previous attempt did not produce a user-visible answer. ...`` after an empty answer, which it drops from
  the history too). It is neither part of the conversation a later request continues nor something the user
  said.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from schemas import Message

_TIMESTAMP = re.compile(
    r"\A\s*\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \d{4}-\d{2}-\d{2} \d{2}:\d{2}(?::\d{2})?(?: [^\]\n]{1,40})?\]\s*"
)
"""OpenClaw's envelope: ``[Wed 2026-12-02 08:52 UTC] `` (weekday, date, time, optional zone)."""

REQUEST_ONLY_MARKERS: tuple[str, ...] = (
    "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>",
    # OpenClaw 2026.9.6's internal prompts (``activateInternalPrompt``: sent once, never persisted to its history):
    "The previous attempt did not produce a user-visible answer.",
    "The previous assistant turn recorded reasoning but did not produce a user-visible answer.",
    "The previous assistant turn completed its tool calls but did not produce a user-visible answer.",
    "The previous attempt compacted the conversation context before producing a final user-visible answer.",
    "Before accepting the previous final answer, apply this revision request",
)
"""Text a request-only message starts with (after leading whitespace and a client's envelope)."""

VOLATILE_SECTIONS: tuple[tuple[str, str], ...] = (
    ("<!-- openclaw:attempt:DYNAMIC -->", "<!-- /openclaw:attempt:DYNAMIC -->"),
)
"""(start, end) of a system prompt's part that a client rewrites as it goes: OpenClaw's dynamic section holds the
current date, so without this a conversation would stop continuing at midnight."""


def stable_system(text: str) -> str:
    """A system prompt without its volatile sections (what identifies the conversation across requests)."""
    for start, end in VOLATILE_SECTIONS:
        i = text.find(start)
        if i >= 0:
            j = text.find(end, i)
            text = text[:i] + (text[j + len(end) :] if j >= 0 else "")
    return text


def visible_answer(text: str) -> str:
    """An answer as clients keep it in their history: without a leading ``<think>...</think>`` block (OpenClaw drops
    it when the engine runs without a reasoning parser and the block is in the content)."""
    if text.startswith("<think>"):
        end = text.find("</think>")
        if end >= 0:
            return text[end + len("</think>") :]
    return text


def unwrap(text: str) -> str:
    """What the user wrote, without a client's envelope."""
    match = _TIMESTAMP.match(text)
    return text[match.end() :] if match else text


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def request_only(message: Message | Mapping[str, Any]) -> bool:
    """Whether a message is one a client adds to one request only (never part of a later history)."""
    role: object
    content: object
    if isinstance(message, Message):
        role, content = message.role, message.content
    else:
        role, content = message.get("role"), message.get("content")
    if role != "user":
        return False
    text = (content if isinstance(content, str) else _text(content)).lstrip()
    # An envelope starts with "[": the regex only then (this runs for every user message on the request path).
    if text.startswith("["):
        text = unwrap(text).lstrip()
    return text.startswith(REQUEST_ONLY_MARKERS)


def conversation(messages: list[Message]) -> list[Message]:
    """The messages without request-only ones."""
    return [m for m in messages if not request_only(m)]
