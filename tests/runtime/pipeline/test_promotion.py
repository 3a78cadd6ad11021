"""The served version is the fold of the decisions on ``versions`` (``runtime/pipeline/promotion.py``):
promotions move it forward, rollbacks serve the version promoted before, pins freeze it, and the gate's consecutive
failures are counted until a promotion or the trainer's restore."""

from __future__ import annotations

from runtime.pipeline.promotion import fold
from schemas import VersionDecision


def d(version: int, state: str, by: str = "gate") -> VersionDecision:
    return VersionDecision(version=version, state=state, reason="test", by=by, decided_at=0.0)


def test_the_starting_weights_are_served_until_a_promotion() -> None:
    p = fold([d(1, "candidate"), d(2, "candidate")])
    assert (p.promoted, p.serving, p.state(0), p.state(1), p.state(9)) == (
        0,
        0,
        "promoted",
        "candidate",
        "unknown",
    )
    p.apply(d(2, "promoted"))
    assert (p.promoted, p.serving, p.state(2)) == (2, 2, "promoted")


def test_a_rollback_serves_the_version_promoted_before_it() -> None:
    p = fold([d(1, "promoted"), d(3, "promoted"), d(5, "promoted"), d(5, "rolled_back")])
    assert p.serving == 3 and p.state(5) == "rolled_back"
    p.apply(d(3, "rolled_back", by="manual"))
    assert p.serving == 1
    p.apply(d(1, "rolled_back", by="manual"))
    assert p.serving == 0  # back to the starting weights
    p.apply(d(5, "promoted", by="manual"))  # promoted again by hand
    assert p.serving == 5 and p.history == [0, 5]


def test_a_pin_freezes_serving_while_promotions_go_on() -> None:
    p = fold([d(2, "promoted"), d(2, "pinned", by="manual"), d(4, "promoted")])
    assert (p.promoted, p.serving) == (4, 2)
    p.apply(d(2, "unpinned", by="manual"))
    assert p.serving == 4


def test_the_gates_consecutive_failures_are_counted_until_a_promotion_or_a_restore() -> None:
    p = fold([d(1, "rejected"), d(2, "rejected"), d(3, "rejected", by="manual")])
    assert p.failed_streak == 2  # a manual rejection is not the gate's
    p.apply(d(4, "promoted"))
    p.apply(d(5, "promoted"))
    p.apply(d(5, "rolled_back"))
    assert p.failed_streak == 1
    p.apply(d(4, "restored", by="trainer"))
    assert p.failed_streak == 0 and p.serving == 4
    assert p.decisions == 7
