"""Simulated users with a stated preference that a small model can learn, and the way they react: a correction
(which the judges read as a failed turn with a hindsight hint) when the preference is violated, thanks when it is
met. The texts are written so that the deterministic rules judge classifies them the way an LLM judge would.
Shared runtime: the simulated users (``services/simulate``) ask the training questions, the held-out evaluation
asks the held-out ones and scores answers with the same preference checks."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

from runtime.pipeline.envelopes import unwrap

_MARKDOWN = re.compile(r"(\*\*|__|`|^\s{0,3}#|^\s*[-*+]\s|^\s*\d+[.)]\s)", re.M)
SIGN_OFF = "Cheers!"


@dataclass(frozen=True)
class Persona:
    name: str
    preference: str
    correction: str
    thanks: str
    satisfied: Callable[[str], bool]


def _plain_and_short(text: str, max_words: int = 30) -> bool:
    text = unwrap(text)  # a client's envelope is not the model's words
    return len(text.split()) <= max_words and not _MARKDOWN.search(text)


def _signs_off(text: str) -> bool:
    return unwrap(text).rstrip().endswith(SIGN_OFF)


PERSONAS: tuple[Persona, ...] = (
    Persona(
        name="plain-short",
        preference="short plain-text answers (at most 30 words) without markdown",
        correction="No, that is too long. Please answer in one or two short sentences of plain text, no markdown.",
        thanks="Thanks, that is exactly what I wanted.",
        satisfied=_plain_and_short,
    ),
    Persona(
        name="sign-off",
        preference=f"answers that end with the sign-off '{SIGN_OFF}'",
        correction=f"No, you forgot the sign-off. Please end every answer with the word {SIGN_OFF}",
        thanks="Thanks, perfect.",
        satisfied=_signs_off,
    ),
)


def by_name(names: str | None) -> tuple[Persona, ...]:
    """Personas named in a comma-separated list (all of them for None or empty)."""
    if not names:
        return PERSONAS
    known = {p.name: p for p in PERSONAS}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown persona(s) {unknown}; known: {sorted(known)}")
    return tuple(known[n] for n in wanted)


def questions() -> list[str]:
    """The training traffic's question set (one per line): what the simulated users ask."""
    return _lines("questions.txt")


def heldout_questions() -> list[str]:
    """The held-out set: questions training traffic never asks, for the evaluation of each weight version."""
    return _lines("heldout_questions.txt")


def _lines(name: str) -> list[str]:
    text = resources.files("runtime.pipeline").joinpath(name).read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]
