"""What a judged turn teaches (docs/design.md, "The method, exactly"): a pure function of the mode and the verdicts."""

from __future__ import annotations

MODES = ("rl", "opd", "combine")


def decide(
    mode: str, eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool = True
) -> str | None:
    """The sample kind for a turn, or None for no sample. A missing eval counts as 0.

    rl: ``"rl"`` when eval is +-1, and when eval is 0 but the session has no effective sample yet (at-least-one,
    reward 0). opd: ``"opd"`` when the hint was accepted. combine: ``"opd+rl"`` (accepted, eval +-1),
    ``"opd-only"`` (accepted, eval 0), ``"rl-only"`` (rejected, eval +-1), None (rejected, eval 0).
    """
    score = eval_score or 0
    if mode == "rl":
        return "rl" if score != 0 or not session_has_effective_sample else None
    if mode == "opd":
        return "opd" if hint_accepted else None
    if mode == "combine":
        if hint_accepted:
            return "opd+rl" if score != 0 else "opd-only"
        return "rl-only" if score != 0 else None
    raise ValueError(f"mode: {mode!r} is not one of {', '.join(MODES)}")


def reward(kind: str, eval_score: int | None) -> float:
    """The scalar reward a sample of ``kind`` carries: the eval score, or 0 for the pure-distillation kinds."""
    return 0.0 if kind in ("opd", "opd-only") else float(eval_score or 0)


def needs(mode: str) -> tuple[bool, bool]:
    """(needs eval judgments, needs hint judgments) before a turn of ``mode`` can be decided."""
    return mode in ("rl", "combine"), mode in ("opd", "combine")
