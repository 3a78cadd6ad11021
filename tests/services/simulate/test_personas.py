"""Simulated users: what meets each preference, and that the judges read their reactions as intended (a correction
is a failed turn whose hint is what the correction asks for; thanks plus the next question is a successful turn)."""

from __future__ import annotations

import time

import pytest

from runtime.pipeline.personas import PERSONAS, SIGN_OFF, by_name, questions
from schemas import Message, PairedTurn
from services.judge import rules
from services.simulate.driver import Observation, plot, summarize
from tests.strategies import example_turn


def paired(next_user: str) -> PairedTurn:
    return PairedTurn(
        turn=example_turn(), next_state=[Message(role="user", content=next_user)], paired_at=time.time()
    )


def test_preferences() -> None:
    plain, sign = by_name("plain-short,sign-off")
    assert plain.satisfied("Paris is the capital of France.")
    assert not plain.satisfied("**Paris** is the capital.")
    assert not plain.satisfied("Facts:\n- Paris\n- France")
    assert not plain.satisfied("1. Paris")
    assert not plain.satisfied(" ".join(["word"] * 31))
    assert sign.satisfied(f"Paris. {SIGN_OFF}") and sign.satisfied(f"Paris.\n{SIGN_OFF}  ")
    assert not sign.satisfied("Paris.")
    with pytest.raises(ValueError, match="unknown persona"):
        by_name("nobody")


@pytest.mark.parametrize("persona", PERSONAS, ids=lambda p: p.name)
def test_the_rules_judge_reads_every_reaction_as_intended(persona) -> None:  # type: ignore[no-untyped-def]
    correction = paired(persona.correction)
    assert rules.eval_score(correction) == -1
    complaint, ask = persona.correction.split(". ", 1)  # "No, ... . Please ...": the hint is what it asks
    assert complaint.startswith("No,") and rules.hint(correction) == ask
    for q in questions():
        thanks = paired(f"{persona.thanks} Next question: {q}")
        assert rules.eval_score(thanks) == 1, q
        assert rules.hint(thanks) is None, q


def test_summary_per_version_and_plot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def obs(version: int, ok: bool, words: int, persona: str = "plain-short") -> Observation:
        return Observation("s", 1, persona, version, ok, words, 2 * words, time.time())

    observations = [obs(0, False, 40), obs(0, True, 10), obs(0, False, 30, "sign-off"), obs(2, True, 8)]
    summary = summarize(observations, sessions=2, failed=1, wall_s=3.0)
    assert [v.weight_version for v in summary.versions] == [0, 2]
    first = summary.first
    assert first is not None and first.responses == 3 and first.satisfaction == pytest.approx(1 / 3)
    assert first.mean_words == pytest.approx(80 / 3) and first.mean_completion_tokens == pytest.approx(
        160 / 3
    )
    assert first.by_persona == {"plain-short": 0.5, "sign-off": 0.0}
    assert summary.last is not None and summary.last.satisfaction == 1.0 and summary.failed_requests == 1
    plot(summary, tmp_path / "learning.png")
    assert (tmp_path / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
