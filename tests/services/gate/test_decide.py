"""What the gate decides from what it has read (``services/gate/decide.py``): each announced version becomes a
candidate once, the newest is judged against the promoted version when both are evaluated, older undecided ones are
superseded, a failure is a rejection (adapter) or a rollback (serve-then-check), and replaying the same history
decides nothing again."""

from __future__ import annotations

from runtime.configuration.config import GateConfig
from schemas import EvalAnswer, EvalResult, VersionDecision, WeightsPublished
from services.gate.decide import GateState

HELD = "heldout-16-abc"


def weights(v: int, **figures: float) -> WeightsPublished:
    return WeightsPublished(
        version=v, path=f"/w/v{v}", base_model="smollm2", step=v, created_at=0.0, figures=figures
    )


def held(v: int, met: int, of: int = 4) -> EvalResult:
    answers = [EvalAnswer(f"q{i}", "a", {"plain-short": i < met}) for i in range(of)]
    return EvalResult(
        version=v,
        question_set=HELD,
        answers=answers,
        scores={"plain-short": met / of},
        model="m",
        evaluated_at=0.0,
    )


def gate(**config: object) -> GateState:
    return GateState(GateConfig(enabled=True, **config), [HELD], HELD)  # type: ignore[arg-type]


def states(decisions: list[VersionDecision]) -> list[tuple[int, str]]:
    return [(d.version, d.state) for d in decisions]


def test_a_candidate_waits_for_both_evaluations_then_passes() -> None:
    g = gate(margin=0.1)
    g.published(weights(1, kl=0.01))
    first = g.pending(now=1.0)
    assert states(first) == [(1, "candidate")] and first[0].figures == {"kl": 0.01}
    g.evaluated(held(1, 3))
    assert g.pending() == []  # the promoted version (0) has no result yet
    g.evaluated(held(0, 3))
    (promoted,) = g.pending()
    assert (promoted.version, promoted.state, promoted.against) == (1, "promoted", 0)
    assert all(c.passed for c in promoted.checks) and g.promotion.serving == 1


def test_a_worse_candidate_is_rejected_with_adapters_and_rolled_back_when_it_was_served() -> None:
    for mechanism, state in (("adapter", "rejected"), ("serve-then-check", "rolled_back")):
        g = gate(margin=0.1, mechanism=mechanism)
        g.published(weights(1))
        g.evaluated(held(0, 4))
        g.evaluated(held(1, 2))
        decided = g.pending()
        assert states(decided) == [(1, "candidate"), (1, state)]
        assert "plain-short 0.500 < 0.900" in decided[-1].reason
        assert g.promotion.serving == 0 and g.promotion.failed_streak == 1


def test_the_newest_evaluated_candidate_is_judged_and_older_ones_are_superseded() -> None:
    g = gate()
    g.evaluated(held(0, 4))
    g.published(weights(1))
    g.published(weights(2))
    decided = g.pending()
    assert states(decided) == [(1, "candidate"), (2, "candidate")]  # nothing evaluated: both wait
    g.evaluated(held(2, 4))
    decided = g.pending()
    assert states(decided) == [(2, "promoted"), (1, "superseded")]
    assert g.promotion.failed_streak == 0  # never judged: not a failure
    assert g.promotion.serving == 2


def test_a_candidate_evaluated_before_a_newer_one_arrived_is_still_judged() -> None:
    """Steps faster than an evaluation: version 1's result comes after version 2 was announced. Judging only the
    newest announced version superseded every one of them unjudged, and the gate never decided again."""
    g = gate(mechanism="adapter")
    g.evaluated(held(0, 4))
    g.published(weights(1))
    assert states(g.pending()) == [(1, "candidate")]
    g.published(weights(2))
    assert states(g.pending()) == [(2, "candidate")]
    g.evaluated(held(1, 1))  # worse: rejected, though 2 is newer
    decided = g.pending()
    assert states(decided) == [(1, "rejected")] and g.promotion.failed_streak == 1
    g.published(weights(3))
    g.evaluated(held(2, 4))
    g.evaluated(held(3, 4))  # both evaluated by now: the newest is judged, 2 superseded
    assert states(g.pending()) == [(3, "candidate"), (3, "promoted"), (2, "superseded")]
    assert g.promotion.serving == 3 and g.promotion.failed_streak == 0


def test_serve_then_check_tries_one_candidate_at_a_time_and_paces_them_after_a_failure() -> None:
    """Users are served each candidate while it is checked: a trainer publishing faster than a check kept them on
    untested weights 83% of the time in a measured bad-signal run. One at a time, the newest next, and after a
    rollback the promoted version for (1/share - 1) times the failed check's length."""
    g = gate(mechanism="serve-then-check", candidate_share=0.25)
    g.evaluated(held(0, 4))
    g.published(weights(1))
    assert states(g.pending(now=100.0)) == [(1, "candidate")]
    g.published(weights(2))
    g.published(weights(3))
    assert g.pending(now=110.0) == []  # 1 is being checked: 2 and 3 wait
    g.evaluated(held(1, 1))
    decided = g.pending(now=160.0)  # a 60 s check failed
    assert states(decided) == [(1, "rolled_back")] and g.promotion.serving == 0
    assert g.next_try_at() == 160.0 + 3 * 60.0
    assert g.pending(now=339.0) == []  # users stay on the promoted version
    decided = g.pending(now=341.0)
    assert states(decided) == [(3, "candidate"), (2, "superseded")]  # the newest, the older untried
    assert "version 3 was tried before" in decided[1].reason and g.promotion.failed_streak == 1
    g.evaluated(held(3, 4))
    assert states(g.pending(now=400.0)) == [(3, "promoted")]
    g.published(weights(4))
    assert states(g.pending(now=401.0)) == [(4, "candidate")]  # after a promotion: at once


def test_serve_then_check_with_a_share_of_one_tries_the_next_at_once() -> None:
    g = gate(mechanism="serve-then-check", candidate_share=1.0)
    g.evaluated(held(0, 4))
    g.published(weights(1))
    g.pending(now=0.0)
    g.published(weights(2))
    g.evaluated(held(1, 0))
    assert states(g.pending(now=50.0)) == [(1, "rolled_back")]
    assert states(g.pending(now=50.0)) == [(2, "candidate")]


def test_a_candidate_never_evaluated_does_not_stall_serve_then_check() -> None:
    """Its weights could not be loaded, say: no evaluation ever comes. Once a newer version waits and the check
    timed out, it is superseded (no failure) and the newer one tried."""
    g = gate(mechanism="serve-then-check", check_timeout_s=600.0)
    g.published(weights(1))
    g.pending(now=0.0)
    g.published(weights(2))
    assert g.pending(now=599.0) == []
    decided = g.pending(now=601.0)
    assert states(decided) == [(2, "candidate"), (1, "superseded")]
    assert "no verdict within 600 s" in decided[1].reason and g.promotion.failed_streak == 0


def test_a_version_announced_older_than_the_promoted_one_is_superseded_untried() -> None:
    g = gate(mechanism="serve-then-check")
    g.decided(VersionDecision(version=5, state="promoted", reason="by hand", by="manual", decided_at=1.0))
    g.published(weights(4))
    decided = g.pending(now=2.0)
    assert states(decided) == [(4, "superseded")] and g.promotion.serving == 5


def test_a_candidate_older_than_a_version_promoted_by_hand_is_never_promoted_after_it() -> None:
    """Candidates wait for their evaluations, so one can still be undecided when a newer version is promoted by
    hand (``turnstream versions promote``): judging it then would take users back to older weights."""
    g = gate()
    g.evaluated(held(0, 2))
    g.published(weights(1))
    g.published(weights(2))
    g.pending()
    g.decided(VersionDecision(version=2, state="promoted", reason="by hand", by="manual", decided_at=1.0))
    g.evaluated(held(1, 4))  # better than version 0, but older than the promoted 2
    g.evaluated(held(2, 2))
    decided = g.pending()
    assert states(decided) == [(1, "superseded")] and "version 2 was promoted" in decided[0].reason
    assert g.promotion.serving == 2


def test_replaying_the_history_decides_nothing_twice() -> None:
    g = gate()
    g.published(weights(1))
    g.evaluated(held(0, 4))
    g.evaluated(held(1, 4))
    history = g.pending()
    again = gate()
    for d in history:
        again.decided(d)
    again.published(weights(1))
    again.evaluated(held(0, 4))
    again.evaluated(held(1, 4))
    assert again.pending() == [] and again.promotion.serving == 1


def test_later_candidates_are_compared_with_the_newest_promoted_version() -> None:
    g = gate(margin=0.0)
    g.evaluated(held(0, 2))
    g.evaluated(held(1, 3))
    g.published(weights(1))
    g.pending()
    assert g.promotion.promoted == 1
    g.published(weights(2))
    g.evaluated(held(2, 2))  # as good as version 0, worse than version 1
    decided = g.pending()
    assert states(decided) == [(2, "candidate"), (2, "rejected")] and decided[-1].against == 1
