"""A deliberately bad learning signal: every eval vote's score turned around (+1 <-> -1), so a turn the user
corrected is rewarded and one they thanked is punished. For trying the gate (docs/evaluation.md): a run that
learns from it drifts away from what the simulated users want, and the gate must keep those versions from them.

    [judge]
    vote_parser = "examples.plugins.inverted_votes:parse_vote"

With ``dispatcher.mode = "rl"`` the reward is all the step learns from; in the other modes the teacher's hint
still pulls the other way. Written against turnstream's public seams only (docs/extending.md).
"""

from __future__ import annotations

from services.judge.votes import parse_vote as read


def parse_vote(kind: str, text: str) -> tuple[int | None, str]:
    """The default reading, an eval score negated (0 and unreadable votes stay as they are)."""
    score, hint = read(kind, text)
    if kind == "eval" and score is not None:
        score = -score
    return score, hint
