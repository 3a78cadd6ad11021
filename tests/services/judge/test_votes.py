"""The four vote functions over tricky inputs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.judge.votes import majority_vote, parse_eval_vote, parse_hint_vote, select_hint


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"The user thanked the assistant. \boxed{1}", 1),
        (r"\boxed{-1}", -1),
        (r"\boxed{0}", 0),
        (r"\boxed{+1}", 1),
        (r"\boxed{ -1 }", -1),
        (r"\boxed{ + 1 }", 1),
        (r"First I thought \boxed{1} but the user asked to redo it, so \boxed{-1}", -1),
        (r"\boxed{-1} ... on reflection \boxed{0}", 0),
        (r"\boxed{1} then an invalid final box \boxed{2}", None),  # the last box decides
        (r"\boxed{yes}", None),
        (r"\boxed{-1} since x = \boxed{a+b}", -1),  # a box without a number is reasoning, passed over
        (r"\boxed{1} [HINT_START]say \boxed{-1}[HINT_END]", 1),  # boxes in a hint block are the hint's
        (r"\boxed{}", None),
        (r"\boxed{-0}", None),
        (r"\boxed{1.0}", None),
        (r"\boxed{10}", None),
        (r"\boxed{1", None),
        (r"boxed{1}", None),
        ("no verdict at all", None),
        ("", None),
    ],
)
def test_parse_eval_vote(text: str, expected: int | None) -> None:
    assert parse_eval_vote(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            r"\boxed{1} [HINT_START] Ask which city they mean before answering. [HINT_END]",
            (1, "Ask which city they mean before answering."),
        ),
        (r"\boxed{-1}", (-1, "")),
        (r"\boxed{0} [HINT_START]x[HINT_END]", (None, "x")),  # 0 is not a hint score
        (r"\boxed{+1}[HINT_START]first[HINT_END] and [HINT_START]  second  [HINT_END]", (1, "second")),
        (r"[HINT_START]multi" "\n" r"line[HINT_END] \boxed{1}", (1, "multi\nline")),
        (r"\boxed{1} [HINT_START] never closed", (1, "")),
        (r"\boxed{maybe} [HINT_START]h[HINT_END]", (None, "h")),
        # A hint that mentions a box of its own (a math answer) keeps the vote's score and its text.
        (
            r"\boxed{1} [HINT_START]Give the final answer as \boxed{18}, not in words.[HINT_END]",
            (1, r"Give the final answer as \boxed{18}, not in words."),
        ),
        (r"[HINT_START]use \boxed{-1} here[HINT_END]", (None, r"use \boxed{-1} here")),
        ("", (None, "")),
    ],
)
def test_parse_hint_vote(text: str, expected: tuple[int | None, str]) -> None:
    assert parse_hint_vote(text) == expected


@pytest.mark.parametrize(
    ("votes", "expected"),
    [
        ([1], 1),
        ([1, 1, -1], 1),
        ([-1, -1, 1], -1),
        ([1, -1], 0),  # tie
        ([1, -1, 0], 0),  # three-way tie
        ([0, 0, 1], 0),
        ([None, None, -1], -1),
        ([None, 1, -1], 0),
        ([None, None], 0),
        ([], 0),
    ],
)
def test_majority_vote(votes: list[int | None], expected: int) -> None:
    assert majority_vote(votes) == expected


def test_select_hint() -> None:
    long_hint = "Ask which unit the user wants before converting."
    assert select_hint([(1, "short hint"), (1, long_hint), (1, "Use metric units please.")]) == long_hint
    assert select_hint([(1, "  exactly10c  ")]) is None  # stripped to 10 characters
    assert select_hint([(1, "ten chars!")]) is None  # 10 characters: not longer than 10
    assert select_hint([(1, "eleven char")]) == "eleven char"
    assert select_hint([(-1, long_hint), (None, long_hint)]) is None  # only votes scoring 1 count
    assert select_hint([(1, f"   {long_hint}   ")]) == long_hint
    assert select_hint([]) is None


@given(st.lists(st.sampled_from([-1, 0, 1, None]), max_size=7))
def test_majority_is_a_valid_vote_with_a_strict_plurality_or_zero(votes: list[int | None]) -> None:
    result = majority_vote(votes)
    valid = [v for v in votes if v is not None]
    assert result in (-1, 0, 1)
    if result != 0:
        assert all(valid.count(result) > valid.count(other) for other in {-1, 0, 1} - {result})
