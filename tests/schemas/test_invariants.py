"""Each violated invariant is rejected at decode time with an error that names the field."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import (
    SCHEMA_VERSION,
    ContractError,
    DeadLetter,
    DecodeError,
    EvalResult,
    Judgment,
    PairedTurn,
    Sample,
    TeacherScores,
    Turn,
    VersionDecision,
    WeightsPublished,
    decode,
    encode,
)
from schemas.events import _require_logprobs, _require_token_ids
from tests.strategies import example_events

EVENTS = example_events()


def _mutated_wire(event: msgspec.Struct, **changes: Any) -> bytes:
    raw = msgspec.msgpack.decode(encode(event))
    raw.update(changes)
    return msgspec.msgpack.encode(raw)


CASES: list[tuple[type, dict[str, Any], str]] = [
    # Turn
    (Turn, {"response_logprobs": [-0.1]}, "response_logprobs"),
    (Turn, {"response_logprobs": [-0.1, float("nan")]}, "response_logprobs"),
    (Turn, {"response_logprobs": [-0.1, 0.5]}, "response_logprobs"),
    (Turn, {"response_logprobs": [float("-inf"), -0.1]}, "response_logprobs"),
    (Turn, {"response_logprobs": [-0.1, float("inf")]}, "response_logprobs"),
    (Turn, {"response_logprobs": [float("-inf"), float("inf")]}, "response_logprobs"),
    (Turn, {"session_id": ""}, "session_id"),
    (Turn, {"turn_id": "other:1"}, "turn_id"),
    (Turn, {"turn_index": 0}, "turn_index"),
    (Turn, {"messages": []}, "messages"),
    (Turn, {"finish_reason": "exploded"}, "finish_reason"),
    (Turn, {"token_source": "guessed"}, "token_source"),
    (Turn, {"prompt_token_ids": []}, "prompt_token_ids"),
    (Turn, {"response_token_ids": [4, -5]}, "response_token_ids"),
    (Turn, {"weight_version": -1}, "weight_version"),
    (Turn, {"response": {"role": "user", "content": "x"}}, "response.role"),
    (Turn, {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    (Turn, {"schema_version": SCHEMA_VERSION + 1}, "schema_version"),
    (Turn, {"turn_index": "one"}, "turn_index"),
    (Turn, {"completed_at": 0.0}, "completed_at"),
    # PairedTurn
    (PairedTurn, {"next_state": []}, "next_state"),
    (PairedTurn, {"next_state": None}, "terminal_reason"),
    (PairedTurn, {"terminal_reason": "idle_timeout"}, "terminal_reason"),
    # Judgment
    (Judgment, {"kind": "vibes"}, "kind"),
    (Judgment, {"judge_id": ""}, "judge_id"),
    (Judgment, {"turn_id": ""}, "turn_id"),
    (Judgment, {"turn_id": "s1:2"}, "paired"),
    (Judgment, {"eval_score": 2}, "eval_score"),
    (Judgment, {"eval_score": None}, "eval_score"),
    (Judgment, {"votes": []}, "votes"),
    (Judgment, {"votes": [{"raw": "x", "score": 5}]}, "votes[0].score"),
    (Judgment, {"hint": "a hint"}, "accepted"),
    # TeacherScores
    (TeacherScores, {"teacher_logprobs": [-0.1]}, "teacher_logprobs"),
    (TeacherScores, {"topk_logprobs": None}, "topk_token_ids"),
    (TeacherScores, {"topk_token_ids": [[4, 7]]}, "topk_token_ids"),
    (TeacherScores, {"topk_token_ids": [[4, 7], [5]]}, "topk_token_ids"),
    (TeacherScores, {"topk_logprobs": [[-0.05, -3.0], [-0.3]]}, "topk_logprobs"),
    (TeacherScores, {"hint": "  "}, "hint"),
    # Sample
    (Sample, {"mode": "sft"}, "mode"),
    (Sample, {"kind": "rl"}, "kind"),
    (Sample, {"response_length": 5}, "response_length"),
    (Sample, {"response_length": 0}, "response_length"),
    (Sample, {"loss_mask": [1]}, "loss_mask"),
    (Sample, {"loss_mask": [1, 2]}, "loss_mask"),
    (Sample, {"rollout_logprobs": [-0.1]}, "rollout_logprobs"),
    (Sample, {"teacher_logprobs": None}, "teacher_logprobs"),
    (Sample, {"teacher_logprobs": [-0.1, -0.2, -0.3]}, "teacher_logprobs"),
    (Sample, {"reward": 3.0}, "reward"),
    (Sample, {"sample_id": ""}, "sample_id"),
    # WeightsPublished
    (WeightsPublished, {"version": 0}, "version"),
    (WeightsPublished, {"path": ""}, "path"),
    (WeightsPublished, {"format": "pickle"}, "format"),
    (WeightsPublished, {"sample_ids": ["a", "b"], "advantages": [0.5]}, "advantages"),
    (WeightsPublished, {"sample_ids": ["a"], "advantages": [float("nan")]}, "advantages"),
    # EvalResult
    (EvalResult, {"version": -1}, "version"),
    (EvalResult, {"answers": []}, "answers"),
    (EvalResult, {"scores": {}}, "scores"),
    (EvalResult, {"scores": {"plain-short": 1.0, "sign-off": 0.5}}, "scores"),  # not what the answers say
    (EvalResult, {"scores": {"plain-short": 0.5}}, "answers"),  # answers judged for a persona not scored
    (EvalResult, {"question_set": ""}, "question_set"),
    # VersionDecision
    (VersionDecision, {"state": "approved"}, "state"),
    (VersionDecision, {"by": "someone"}, "by"),
    (VersionDecision, {"version": -1}, "version"),
    (VersionDecision, {"reason": ""}, "reason"),
    # DeadLetter
    (DeadLetter, {"error_kind": "oops"}, "error_kind"),
    (DeadLetter, {"source_offset": -1}, "source_offset"),
    (DeadLetter, {"source_topic": ""}, "source_topic"),
]


@pytest.mark.parametrize(
    ("event_type", "changes", "field"),
    CASES,
    ids=[f"{t.__name__}-{f}-{i}" for i, (t, _, f) in enumerate(CASES)],
)
def test_violation_is_rejected_naming_the_field(
    event_type: type, changes: dict[str, Any], field: str
) -> None:
    wire = _mutated_wire(EVENTS[event_type], **changes)
    with pytest.raises(DecodeError) as info:
        decode(wire, event_type)
    assert info.value.kind == "validation"
    assert field in str(info.value)


def test_unmutated_examples_are_valid() -> None:
    for event_type, event in EVENTS.items():
        assert decode(encode(event), event_type) == event


def test_invariants_also_hold_when_building_in_code() -> None:
    with pytest.raises(ContractError, match="response_logprobs"):
        msgspec.structs.replace(EVENTS[Turn], response_logprobs=[])


def test_opd_samples_require_zero_reward() -> None:
    sample = EVENTS[Sample]
    wire = _mutated_wire(sample, kind="opd-only", reward=1.0)
    with pytest.raises(DecodeError, match="reward"):
        decode(wire, Sample)


def test_rl_only_sample_with_teacher_equal_rollout_is_valid() -> None:
    sample = msgspec.structs.replace(
        EVENTS[Sample], kind="rl-only", teacher_logprobs=list(EVENTS[Sample].rollout_logprobs)
    )
    assert decode(encode(sample), Sample) == sample


def test_terminal_pairing_is_valid_without_next_state() -> None:
    paired = PairedTurn(turn=EVENTS[Turn], next_state=None, paired_at=1.7e9, terminal_reason="session_done")
    assert decode(encode(paired), PairedTurn).terminal


def test_unknown_fields_from_a_compatible_producer_are_ignored() -> None:
    wire = _mutated_wire(EVENTS[WeightsPublished], added_by_a_newer_minor="x")
    assert decode(wire, WeightsPublished) == EVENTS[WeightsPublished]


def _is_logprob(x: float) -> bool:
    return not math.isnan(x) and x != -math.inf and x <= 1e-3


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=40))
def test_the_logprob_check_accepts_exactly_finite_log_probabilities(values: list[float]) -> None:
    """The check sums in C first (NaN and -inf survive a sum); it must agree with the per-entry definition, also
    when a sum of finite values overflows."""
    try:
        _require_logprobs("lp", values, len(values), "ids")
        accepted = True
    except ContractError:
        accepted = False
    assert accepted == all(_is_logprob(v) for v in values)


def test_finite_logprobs_whose_sum_overflows_are_accepted() -> None:
    _require_logprobs("lp", [-1e308, -1e308, -0.5], 3, "ids")


@given(st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=40))
def test_the_token_id_check_refuses_exactly_negative_ids(ids: list[int]) -> None:
    try:
        _require_token_ids("ids", ids)
        accepted = True
    except ContractError:
        accepted = False
    assert accepted == all(i >= 0 for i in ids)
