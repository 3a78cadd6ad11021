"""What a judged turn teaches (docs/design.md, "The method, exactly"): a pure function of the mode and the verdicts.

Each mode's rule is its own function, named in its declaration (``schemas/modes.py``); ``decide`` is the
default ``dispatcher.decide`` seam and looks the mode's rule up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from runtime.configuration.plugins import load_function
from schemas.modes import MODES, UnknownMode, mode_spec

Rule = Callable[[int | None, bool, bool], str | None]


def decide_rl(eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool) -> str | None:
    """``"rl"`` when eval is +-1, and when eval is 0 but the session has no effective sample yet (at-least-one,
    reward 0)."""
    return "rl" if (eval_score or 0) != 0 or not session_has_effective_sample else None


def decide_opd(eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool) -> str | None:
    """``"opd"`` when the hint was accepted."""
    return "opd" if hint_accepted else None


def decide_opd_topk(
    eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool
) -> str | None:
    """``"opd-topk"`` when the hint was accepted (the teacher's top-K under it is the whole signal)."""
    return "opd-topk" if hint_accepted else None


def decide_combine(
    eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool
) -> str | None:
    """``"opd+rl"`` (accepted, eval +-1), ``"opd-only"`` (accepted, eval 0), ``"rl-only"`` (rejected, eval +-1),
    None (rejected, eval 0)."""
    score = eval_score or 0
    if hint_accepted:
        return "opd+rl" if score != 0 else "opd-only"
    return "rl-only" if score != 0 else None


def rule(mode: str) -> Rule:
    """The decide function the mode registry names for ``mode``."""
    return cast(
        Rule,
        load_function(f"mode {mode!r} decide", mode_spec(mode).decide, ("eval_score", "hint", "has_sample")),
    )


def decide(
    mode: str, eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool = True
) -> str | None:
    """The sample kind for a turn, or None for no sample. A missing eval counts as 0. The mode's own rule
    (``decide_rl``, ``decide_opd``, ``decide_combine``, or a plugin mode's)."""
    try:
        return rule(mode)(eval_score, hint_accepted, session_has_effective_sample)
    except UnknownMode as exc:
        raise ValueError(f"mode: {exc}") from None


def reward(kind: str, eval_score: int | None) -> float:
    """The scalar reward a sample of ``kind`` carries: the eval score, or 0 for the pure-distillation kinds."""
    zero = any(kind in m.zero_reward_kinds for m in MODES.values())
    return 0.0 if zero else float(eval_score or 0)


def needs(mode: str) -> tuple[bool, bool]:
    """(needs eval judgments, needs hint judgments) before a turn of ``mode`` can be decided."""
    spec = mode_spec(mode)
    return spec.needs_eval, spec.needs_hint
