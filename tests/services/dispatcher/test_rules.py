"""``decide`` over the whole dispatch table of docs/design.md, for every mode and every input combination."""

from __future__ import annotations

import itertools

import pytest

from services.dispatcher.rules import decide, needs, reward

SCORES = (-1, 0, 1, None)


def expected(mode: str, score: int | None, accepted: bool, has_sample: bool) -> str | None:
    s = score or 0
    if mode == "rl":
        if s != 0:
            return "rl"
        return None if has_sample else "rl"
    if mode == "opd":
        return "opd" if accepted else None
    table = {
        (True, True): "opd+rl",
        (True, False): "opd-only",
        (False, True): "rl-only",
        (False, False): None,
    }
    return table[(accepted, s != 0)]


@pytest.mark.parametrize(
    ("mode", "score", "accepted", "has_sample"),
    list(itertools.product(("rl", "opd", "combine"), SCORES, (True, False), (True, False))),
)
def test_whole_table(mode: str, score: int | None, accepted: bool, has_sample: bool) -> None:
    assert decide(mode, score, accepted, has_sample) == expected(mode, score, accepted, has_sample)


def test_named_rows() -> None:
    assert decide("rl", 1, False) == "rl" and decide("rl", -1, True) == "rl"
    assert decide("rl", 0, False) is None and decide("rl", None, False) is None
    assert decide("rl", 0, False, session_has_effective_sample=False) == "rl"  # at-least-one
    assert decide("opd", -1, False) is None and decide("opd", None, True) == "opd"
    assert decide("combine", -1, True) == "opd+rl" and decide("combine", None, True) == "opd-only"
    assert decide("combine", 1, False) == "rl-only" and decide("combine", 0, False) is None
    # the at-least-one rule belongs to rl mode only
    assert decide("combine", 0, False, session_has_effective_sample=False) is None


def test_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="mode"):
        decide("ppo", 1, True)


def test_rewards_and_needs() -> None:
    assert reward("rl", -1) == -1.0 and reward("opd+rl", 1) == 1.0 and reward("rl-only", -1) == -1.0
    assert reward("opd", 1) == 0.0 and reward("opd-only", None) == 0.0 and reward("rl", None) == 0.0
    assert needs("rl") == (True, False) and needs("opd") == (False, True) and needs("combine") == (True, True)
