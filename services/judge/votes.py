"""Parsing and voting: pure functions with OpenClaw-RL's semantics (docs/design.md, "The method, exactly").

A vote's score is the *last* ``\\boxed{...}`` holding a whole number in the judge's text outside its
``[HINT_START]...[HINT_END]`` blocks, so a model that reasons through several candidates and then commits is read
by its final answer, and a hint that itself mentions a box ("put the answer in \\boxed{18}") does not void the
vote. Boxes holding no number (``\\boxed{x+1}``) are passed over, as OpenClaw-RL's ``\\boxed{[-+]?\\d}``
pattern passes them over.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from runtime.pipeline.majority import majority_vote

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_INTEGER = re.compile(r"^\s*([+-]?)\s*(\d+)\s*$")
_HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.S)
MIN_HINT_CHARS = 10
"""A hint must be longer than this (stripped) to be accepted."""


def _last_boxed_score(text: str) -> int | None:
    outside_hints = _HINT.sub(" ", text)
    for box in reversed(_BOXED.findall(outside_hints)):
        m = _INTEGER.match(box)
        if m is None:
            continue  # not a number: reasoning, not a verdict
        sign, digits = m.groups()
        value = int(digits)
        if value > 1 or (sign == "-" and value == 0):  # the final number is no score ("-0" neither)
            return None
        return -value if sign == "-" else value
    return None


def parse_eval_vote(text: str) -> int | None:
    """The last ``\\boxed{...}`` holding a whole number, outside hint blocks, when it is -1, 0 or 1 (an optional
    ``+`` allowed); anything else is None."""
    return _last_boxed_score(text)


def parse_hint_vote(text: str) -> tuple[int | None, str]:
    """(score, hint): the score from the last ``\\boxed{...}`` if it is 1 or -1 (else None), and the stripped text
    of the last ``[HINT_START]...[HINT_END]`` block ("" if none)."""
    score = _last_boxed_score(text)
    if score == 0:
        score = None
    hints = _HINT.findall(text)
    return score, hints[-1].strip() if hints else ""


def parse_vote(kind: str, text: str) -> tuple[int | None, str]:
    """The default ``judge.vote_parser``: (score, hint) of one vote's text; an eval vote has no hint."""
    if kind == "eval":
        return parse_eval_vote(text), ""
    return parse_hint_vote(text)


def select_hint(votes: Sequence[tuple[int | None, str]]) -> str | None:
    """The longest stripped hint among votes scoring 1 whose hint is longer than 10 characters; else None."""
    candidates = [hint.strip() for score, hint in votes if score == 1 and len(hint.strip()) > MIN_HINT_CHARS]
    return max(candidates, key=len) if candidates else None


__all__ = [
    "MIN_HINT_CHARS",
    "majority_vote",
    "parse_eval_vote",
    "parse_hint_vote",
    "parse_vote",
    "select_hint",
]
