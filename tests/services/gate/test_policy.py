"""The gate's arithmetic (``services/gate/policy.py``): a candidate passes only when no score on any required set
falls more than the margin below the promoted version's, and its figures and answer length stay in bounds; a
missing evaluation makes it wait, never pass. And the configuration refuses gates that could never work."""

from __future__ import annotations

import pytest

from runtime.configuration.config import Config, EvalConfig, GateConfig, LoraConfig, TrainerConfig
from schemas import EvalAnswer, EvalResult
from services.gate.policy import verdict

HELD = "heldout-16-abc"
TEAM = "set-team-2-def"


def result(version: int, question_set: str, *outcomes: dict[str, bool], words: int = 3) -> EvalResult:
    answers = [
        EvalAnswer(question=f"q{i}", answer=" ".join(["w"] * words), satisfied=o)
        for i, o in enumerate(outcomes)
    ]
    names = sorted({n for o in outcomes for n in o})
    scores = {n: sum(o[n] for o in outcomes if n in o) / sum(1 for o in outcomes if n in o) for n in names}
    return EvalResult(
        version=version,
        question_set=question_set,
        answers=answers,
        scores=scores,
        model="smollm2",
        evaluated_at=0.0,
        mean_words=float(words),
    )


GOOD = ({"plain-short": True, "sign-off": True},) * 3 + ({"plain-short": True, "sign-off": False},)
PROMOTED = {HELD: result(0, HELD, *GOOD)}  # plain-short 1.0, sign-off 0.75, overall 7/8


def test_a_candidate_as_good_as_the_promoted_version_passes_every_check() -> None:
    v = verdict(GateConfig(margin=0.05), [HELD], {HELD: result(1, HELD, *GOOD)}, PROMOTED, {}, HELD)
    assert v.passed is True
    assert [c.name for c in v.checks] == [f"{HELD}:overall", f"{HELD}:plain-short", f"{HELD}:sign-off"]
    assert v.reason() == "passed 3 checks"


@pytest.mark.parametrize(
    ("margin", "passed"),
    [(0.30, True), (0.25, True), (0.2499, False), (0.05, False), (0.0, False)],
)
def test_one_persona_falling_beyond_the_margin_fails_the_candidate(margin: float, passed: bool) -> None:
    # sign-off falls from 0.75 to 0.5 (0.25 down); plain-short stays at 1.0; overall from 7/8 to 6/8.
    worse = ({"plain-short": True, "sign-off": True},) * 2 + ({"plain-short": True, "sign-off": False},) * 2
    v = verdict(GateConfig(margin=margin), [HELD], {HELD: result(1, HELD, *worse)}, PROMOTED, {}, HELD)
    assert v.passed is passed
    if not passed:
        assert f"{HELD}:sign-off 0.500 < {0.75 - margin:.3f}" in v.reason()


def test_every_required_set_is_compared_and_a_missing_one_makes_the_candidate_wait() -> None:
    team_promoted = result(0, TEAM, {"correct": True}, {"correct": True})
    team_worse = result(1, TEAM, {"correct": True}, {"correct": False})
    promoted = {**PROMOTED, TEAM: team_promoted}
    waiting = verdict(GateConfig(), [HELD, TEAM], {HELD: result(1, HELD, *GOOD)}, promoted, {}, HELD)
    assert waiting.passed is None and waiting.missing == [TEAM] and "waiting for" in waiting.reason()
    failed = verdict(
        GateConfig(margin=0.1),
        [HELD, TEAM],
        {HELD: result(1, HELD, *GOOD), TEAM: team_worse},
        promoted,
        {},
        HELD,
    )
    assert failed.passed is False
    assert {c.name for c in failed.failed} == {f"{TEAM}:correct", f"{TEAM}:overall"}


def test_a_score_the_candidate_lacks_counts_as_nothing_met() -> None:
    only_plain = ({"plain-short": True},) * 4
    v = verdict(GateConfig(margin=0.5), [HELD], {HELD: result(1, HELD, *only_plain)}, PROMOTED, {}, HELD)
    assert v.passed is False and [c.name for c in v.failed] == [f"{HELD}:sign-off"]


def test_figures_and_answer_length_are_bounded() -> None:
    gc = GateConfig(figure_max={"kl": 0.05}, max_mean_words=20)
    ok = verdict(gc, [HELD], {HELD: result(1, HELD, *GOOD, words=12)}, PROMOTED, {"kl": 0.01}, HELD)
    assert ok.passed is True and {c.name for c in ok.checks} >= {"figure:kl", "mean_words"}
    drifted = verdict(gc, [HELD], {HELD: result(1, HELD, *GOOD, words=40)}, PROMOTED, {"kl": 0.2}, HELD)
    assert {c.name for c in drifted.failed} == {"figure:kl", "mean_words"}
    assert "figure:kl 0.200 > 0.050" in drifted.reason()
    unreported = verdict(gc, [HELD], {HELD: result(1, HELD, *GOOD)}, PROMOTED, {}, HELD)
    assert [c.name for c in unreported.failed] == ["figure:kl"]  # a bound on a figure never reported fails


def test_the_configuration_refuses_a_gate_that_could_never_work() -> None:
    with pytest.raises(ValueError, match=r"needs trainer\.lora\.enabled"):
        Config(gate=GateConfig(enabled=True, mechanism="adapter"))
    Config(gate=GateConfig(enabled=True, mechanism="serve-then-check"))
    lora = TrainerConfig(lora=LoraConfig(enabled=True))
    Config(trainer=lora, gate=GateConfig(enabled=True))
    with pytest.raises(ValueError, match=r"add them to eval\.sets"):
        Config(gate=GateConfig(sets=["team.jsonl"]))
    Config(gate=GateConfig(sets=["team.jsonl"]), eval=EvalConfig(sets=["team.jsonl"]))
