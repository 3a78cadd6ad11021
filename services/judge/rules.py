"""The deterministic ``rules`` judge backend (tests, CPU demos): keyword rules over the next state, answered in
the same text format an LLM judge uses, so that parsing and voting are exercised exactly as in production.

- eval: a tool result that looks like an error, or a user message asking for a redo, correcting the assistant or
  asking it to change what it did (a change request is negative feedback, never a neutral new instruction), is
  -1; thanks or a successful tool result is +1; anything else 0.
- hint: a user correction is +1 with a hint made of what the correction asks for (its requests, without the
  complaint around them, as the hint prompt asks an LLM judge for "a concrete, actionable hint"); anything else -1.
"""

from __future__ import annotations

import re

from runtime.pipeline.envelopes import request_only, unwrap
from schemas import Message, PairedTurn
from services.judge.prompts import message_text

_THANKS = re.compile(
    r"\b(thanks|thank you|thx|perfect|great|awesome|exactly|works now|that works|looks good|nice)\b", re.I
)
_REDO = re.compile(
    r"\b(try again|redo|do it again|once more|again,? please|not what i (asked|wanted)|doesn'?t work|"
    r"didn'?t work|still (wrong|broken|failing))\b",
    re.I,
)
_CORRECTION = re.compile(
    r"(^\s*no\b|\bwrong\b|\bincorrect\b|\bthat'?s not\b|\bactually\b|\binstead\b|\bi (said|meant|asked)\b|"
    r"\bshould (have|be|use|not)\b|\bdon'?t\b|\bplease (use|make|keep|write|answer|change|fix)\b|"
    r"\bchange\b.{0,60}\bto\b|\bnot that\b|\bmake it (shorter|longer|simpler|clearer)\b)",
    re.I,
)
_TOOL_ERROR = re.compile(
    r"\b(error|exception|traceback|failed|failure|not found|no such|permission denied|invalid|timed out)\b",
    re.I,
)

MODEL_NAME = "rules"


def _user_text(state: list[Message]) -> str:
    """What the user wrote: without request-only messages and without the client's envelope (a timestamp
    prefix would hide an opening "No, ...")."""
    return "\n".join(
        unwrap(message_text(m)) for m in state if m.role == "user" and not request_only(m)
    ).strip()


def _tool_texts(state: list[Message]) -> list[str]:
    return [message_text(m) for m in state if m.role == "tool"]


def eval_score(paired: PairedTurn) -> int:
    state = paired.next_state or []
    user = _user_text(state)
    if user:
        if _REDO.search(user) or _CORRECTION.search(user):
            return -1
        if _THANKS.search(user):
            return 1
        return 0
    tools = _tool_texts(state)
    if tools:
        return -1 if any(_TOOL_ERROR.search(t) for t in tools) else 1
    return 0


_SENTENCES = re.compile(r"(?<=[.!?])\s+")
_COMPLAINT_LEAD = re.compile(r"^(no|nope|wrong|incorrect)\b[,.!:;]?\s*", re.I)
_ASKS = re.compile(
    r"\b(please|should|must|always|never|use|make|keep|write|answer|end|start|add|remove|avoid|try|give)\b",
    re.I,
)


def actionable(text: str) -> str:
    """The sentences of a correction that ask for something, without the complaint ("No, that is too long."):
    verbatim, a complaint in the teacher's context teaches it to apologise rather than to do what was asked."""
    asks = []
    for sentence in _SENTENCES.split(" ".join(text.split())):
        rest = _COMPLAINT_LEAD.sub("", sentence).strip()
        if rest and _ASKS.search(rest):
            asks.append(rest[0].upper() + rest[1:])
    return " ".join(asks) if asks else " ".join(text.split())


def hint(paired: PairedTurn) -> str | None:
    user = _user_text(paired.next_state or [])
    if user and (_CORRECTION.search(user) or _REDO.search(user)):
        return actionable(user)
    return None


def answer(kind: str, paired: PairedTurn) -> str:
    """The rules' verdict as judge text: a reason, then ``\\boxed{...}`` (and a hint block when there is one)."""
    if kind == "eval":
        score = eval_score(paired)
        return f"Rules judge: keyword evidence gives {score}. \\boxed{{{score}}}"
    h = hint(paired)
    if h is None:
        return "Rules judge: no correction in the next state. \\boxed{-1}"
    return f"Rules judge: the user corrected the response. \\boxed{{1}}\n[HINT_START]{h}[HINT_END]"
