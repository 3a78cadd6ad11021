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
- a **reminder** is text a client appends to the current user message of one request and takes off again when it
  sends that message back as history: aider repeats its editing rules that way (``system_reminder``, after a blank
  line; a model set to ``reminder: sys`` gets them as a last system message instead, request-only too). The
  conversation and the next state read the message without it; the recorded prompt keeps it (the model saw it).
- a **context pair** is a user message a client re-sends just before the current one in every request, with a
  canned assistant reply (aider's files-in-chat message and "Ok."): it moves down as the conversation grows, so
  both are request-only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

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

CONTEXT_PAIRS: tuple[str, ...] = (
    # aider 0.86.2 (``files_content_prefix``, ``files_no_full_files*`` of aider/coders/*_prompts.py)
    "I have *added these files to the chat*",
    "These files have been *added these files to the chat*",
    "I am not sharing any files that you can edit yet.",
    "I am not sharing the full contents of any files with you yet.",
    "I am not sharing any files with you.",
    "Don't try and edit any existing code without asking me to add the files to the chat!",
    "These are some files we have been discussing that we may want to edit after you answer my questions:",
)
"""Text the user message of a context pair starts with; the assistant message right after it is its reply."""

REMINDERS: tuple[str, ...] = (
    # aider 0.86.2 (aider/coders/*_prompts.py ``system_reminder``): each edit format's rules ...
    "# *SEARCH/REPLACE block* Rules:",
    "# V4A Diff Format Rules:",
    "# File editing rules:",
    "To suggest changes to a file you MUST return the entire content of the updated file.",
    "ONLY return code using the `replace_lines` function.",
    "ONLY return code using the `write_file` function.",
    "NEVER RETURN CODE!",
    # ... and the final reminders some models get (``lazy_prompt``, ``overeager_prompt``).
    "You are diligent and tireless!",
    "Pay careful attention to the scope of the user's request.",
)
"""How a reminder starts: from a blank line followed by one of these, the rest of a user message is the reminder."""

_ASK = r"Reply in [A-Z][a-z]+(?: [A-Z][a-z]+)?\.\n"
"""aider's ask mode reminds of nothing but its final reminders: the language, and the newline it ends with."""
_REMINDER = re.compile(r"\n\n\s*(?:" + "|".join(map(re.escape, REMINDERS)) + ")|\n\n" + _ASK + r"\Z")
_ASK_ALONE = re.compile(_ASK)

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


def without_reminder(text: str) -> str:
    """A user message's text without a reminder a client appended to this request only."""
    match = _REMINDER.search(text) if "\n\n" in text else None
    return text[: match.start()] if match else text


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
    if role == "system":  # aider's reminder as a last system message
        text = content if isinstance(content, str) else _text(content)
        return text.lstrip().startswith(REMINDERS) or _ASK_ALONE.fullmatch(text) is not None
    if role != "user":
        return False
    text = (content if isinstance(content, str) else _text(content)).lstrip()
    # An envelope starts with "[": the regex only then (this runs for every user message on the request path).
    if text.startswith("["):
        text = unwrap(text).lstrip()
    return text.startswith(REQUEST_ONLY_MARKERS) or text.startswith(CONTEXT_PAIRS)


def opens_pair(message: Message | Mapping[str, Any]) -> bool:
    """Whether a request-only message is a context pair's, so the assistant message after it goes too."""
    content = message.content if isinstance(message, Message) else message.get("content")
    return (content if isinstance(content, str) else _text(content)).lstrip().startswith(CONTEXT_PAIRS)


def conversation(messages: list[Message]) -> list[Message]:
    """The messages as a later request sends them back: without request-only ones, and without reminders."""
    kept: list[Message] = []
    reply = False  # the next message is a context pair's reply
    for m in messages:
        if reply and m.role == "assistant":
            reply = False
            continue
        reply = False
        if request_only(m):
            reply = opens_pair(m)
            continue
        kept.append(_as_history(m))
    return kept


def _as_history(message: Message) -> Message:
    if message.role != "user" or not isinstance(message.content, str):
        return message
    text = without_reminder(message.content)
    return message if text is message.content else msgspec.structs.replace(message, content=text)
