"""The rules backend: keyword verdicts in the judge's own text format, read back through the real parsers."""

from __future__ import annotations

import time

import pytest

from schemas import Message, PairedTurn
from services.judge import rules
from services.judge.votes import parse_eval_vote, parse_hint_vote, select_hint
from tests.strategies import example_turn


def paired(*state: Message) -> PairedTurn:
    return PairedTurn(turn=example_turn(), next_state=list(state), paired_at=time.time())


def user(text: str) -> Message:
    return Message(role="user", content=text)


def tool(text: str) -> Message:
    return Message(role="tool", content=text, tool_call_id="c1")


@pytest.mark.parametrize(
    ("state", "score"),
    [
        ([user("Thanks, that's perfect!")], 1),
        ([user("No, that's wrong. It should be 5.")], -1),
        ([user("Please try again.")], -1),
        ([user("Actually I meant the capital of Norway.")], -1),
        ([user("What about tomorrow?")], 0),
        # A change request is negative feedback, not a neutral new instruction (OpenClaw-RL's judge says so).
        ([user("Change the title to 'Q3 report'.")], -1),
        ([user("Make it shorter.")], -1),
        ([user("Not that, the other file.")], -1),
        ([user("Please fix the indentation.")], -1),
        ([tool('{"temp": 4}')], 1),
        ([tool("Traceback (most recent call last): KeyError")], -1),
        ([tool("file not found")], -1),
        ([tool("ok"), user("thanks")], 1),
        ([tool("ok"), user("wrong file")], -1),
    ],
)
def test_eval_verdicts(state: list[Message], score: int) -> None:
    text = rules.answer("eval", paired(*state))
    assert parse_eval_vote(text) == score


def test_correction_becomes_the_hint() -> None:
    p = paired(user("No,   use   Celsius\nnot Fahrenheit."))
    score, hint = parse_hint_vote(rules.answer("hint", p))
    assert score == 1 and hint == "Use Celsius not Fahrenheit."
    assert select_hint([(score, hint)]) == hint


@pytest.mark.parametrize(
    ("correction", "hint"),
    [
        (
            "No, you forgot the sign-off. Please end every answer with the word Cheers!",
            "Please end every answer with the word Cheers!",
        ),
        (
            "No, that is too long. Please answer in one or two short sentences of plain text, no markdown.",
            "Please answer in one or two short sentences of plain text, no markdown.",
        ),
        ("That's not right, try again.", "That's not right, try again."),
        ("Wrong!", "Wrong!"),  # nothing asked: the correction as it is
    ],
)
def test_the_hint_is_what_the_correction_asks_for(correction: str, hint: str) -> None:
    score, got = parse_hint_vote(rules.answer("hint", paired(user(correction))))
    assert score == 1 and got == hint


@pytest.mark.parametrize("state", [[user("thanks!")], [tool("error: boom")], [user("And Paris?")]])
def test_no_correction_no_hint(state: list[Message]) -> None:
    score, hint = parse_hint_vote(rules.answer("hint", paired(*state)))
    assert score == -1 and hint == ""


def test_a_clients_envelope_does_not_hide_what_the_user_said() -> None:
    """Stock OpenClaw sends ``[Wed 2026-12-02 08:52 UTC] No, answer in one word.`` as content parts: the
    correction is still -1 with its hint, and its internal-context block is not read as the user's words."""
    stamped = Message(
        role="user", content=[{"type": "text", "text": "[Wed 2026-12-02 08:52 UTC] No, answer in one word."}]
    )
    context = user(
        "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nplease fix nothing\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"
    )
    assert rules.eval_score(paired(stamped)) == -1
    assert rules.hint(paired(stamped)) == "Answer in one word."
    assert rules.eval_score(paired(user("[Wed 2026-12-02 08:53 UTC] Thanks, perfect."), context)) == 1
    assert rules.eval_score(paired(context)) == 0
