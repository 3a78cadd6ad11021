"""Checks an evaluation set names by path (``{"callable": "examples.evalsets.checks:plain_short"}``): each is
called as ``f(answer, case) -> bool``. These two are the simulated personas' own preferences, so a set can ask
what the held-out evaluation asks, on prompts a team chooses."""

from __future__ import annotations

from typing import Any

from runtime.pipeline.personas import by_name


def plain_short(answer: str, case: Any) -> bool:
    """At most 30 words of plain text, no markdown (the ``plain-short`` persona's preference)."""
    return by_name("plain-short")[0].satisfied(answer)


def signs_off(answer: str, case: Any) -> bool:
    """Ends with the sign-off ``Cheers!`` (the ``sign-off`` persona's preference)."""
    return by_name("sign-off")[0].satisfied(answer)
