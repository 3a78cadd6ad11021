"""Majority of {-1, 0, 1} votes, shared by the judge (votes of one judge) and the dispatcher (verdicts of several
judges) so that both break ties the same way."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def majority_vote(votes: Sequence[int | None]) -> int:
    """The most common valid vote; 0 when there is none or the top count is tied."""
    counts = Counter(v for v in votes if v is not None)
    if not counts:
        return 0
    ranked = counts.most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return 0
    return ranked[0][0]
