"""The gate's arithmetic: whether a candidate version may be promoted, from its evaluations against the promoted
version's and from its trainer figures. Pure: the gate service gathers the results and records the decision.

A candidate passes when, on every question set the gate requires, no score (each persona's or check's, and the
overall share of passed outcomes) falls more than ``gate.margin`` below the promoted version's on the same set, and
its figures stay within their bounds. The first promoted version is the starting weights (version 0), evaluated
like any other.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from runtime.configuration.config import GateConfig
from schemas import EvalResult


class GateCheck(msgspec.Struct, frozen=True):
    """One comparison the gate made."""

    name: str
    """``<question set>:<score name>`` (``overall`` for the share of all outcomes), ``figure:<name>`` or
    ``mean_words``."""
    value: float
    bound: float
    """The least (a score) or, with ``at_most``, the most (a figure, a length) ``value`` may be."""
    passed: bool
    at_most: bool = False


class GateVerdict(msgspec.Struct, frozen=True):
    passed: bool | None
    """None while a required evaluation is missing (the candidate waits)."""
    checks: list[GateCheck]
    missing: list[str]
    """The question sets the candidate (or the promoted version) has no result for yet."""

    @property
    def failed(self) -> list[GateCheck]:
        return [c for c in self.checks if not c.passed]

    def reason(self) -> str:
        if self.passed is None:
            return "waiting for " + ", ".join(self.missing)
        if self.passed:
            return f"passed {len(self.checks)} checks"
        return "; ".join(
            f"{c.name} {c.value:.3f} {'>' if c.at_most else '<'} {c.bound:.3f}" for c in self.failed
        )


def _scores(result: EvalResult) -> dict[str, float]:
    return {**result.scores, "overall": result.overall}


def verdict(
    gc: GateConfig,
    required: list[str],
    candidate: Mapping[str, EvalResult],
    promoted: Mapping[str, EvalResult],
    figures: Mapping[str, float],
    heldout: str | None = None,
) -> GateVerdict:
    """The gate's decision on a candidate: ``required`` question set ids, the candidate's and the promoted
    version's results by question set, the candidate's trainer figures, and which set is the held-out one (its
    answers' length is bounded by ``gate.max_mean_words``)."""
    missing = [q for q in required if q not in candidate or q not in promoted]
    if missing:
        return GateVerdict(passed=None, checks=[], missing=missing)
    checks: list[GateCheck] = []
    for q in required:
        mine, theirs = _scores(candidate[q]), _scores(promoted[q])
        for name in sorted(theirs):
            bound = theirs[name] - gc.margin
            value = mine.get(name, 0.0)  # a score the candidate lacks counts as nothing met
            checks.append(GateCheck(f"{q}:{name}", value, bound, value >= bound - 1e-12))
        if gc.max_mean_words > 0 and q == heldout:
            words = candidate[q].mean_words
            checks.append(GateCheck("mean_words", words, gc.max_mean_words, words <= gc.max_mean_words, True))
    for name, most in sorted(gc.figure_max.items()):
        reported = figures.get(name)
        ok = reported is not None and reported <= most
        shown = float("inf") if reported is None else reported
        checks.append(GateCheck(f"figure:{name}", shown, most, ok, True))
    return GateVerdict(passed=all(c.passed for c in checks), checks=checks, missing=[])
