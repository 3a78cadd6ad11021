"""The mode registry: each mode declared once, and everything that validates or acts on a mode reads it (the
contract's Sample validation, the config, the dispatcher's rules, the trainer's advantages)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import torch

from runtime.configuration.config import TrainerConfig
from schemas import MODES, ContractError, ModeSpec, Sample, mode_spec, register_mode
from services.dispatcher.rules import decide, needs, reward
from services.trainer.loss import sample_advantages
from tests.plugin_contracts import fixtures


def sample(mode: str, kind: str, reward: float = 1.0, teacher: list[float] | None = None) -> Sample:
    return Sample(
        sample_id="t:1",
        session_id="t",
        mode=mode,
        kind=kind,
        tokens=[1, 2, 3, 4],
        response_length=2,
        loss_mask=[1, 1],
        rollout_logprobs=[-0.5, -0.25],
        reward=reward,
        weight_version=0,
        created_at=time.time(),
        teacher_logprobs=teacher,
    )


def test_the_builtin_modes_are_declared_with_what_they_need_and_emit() -> None:
    assert {
        m: (s.needs_eval, s.needs_hint, sorted(s.kinds))
        for m, s in MODES.items()
        if m in ("rl", "opd", "combine")
    } == {
        "rl": (True, False, ["rl"]),
        "opd": (False, True, ["opd"]),
        "combine": (True, True, ["opd+rl", "opd-only", "rl-only"]),
    }
    assert [needs(m) for m in ("rl", "opd", "combine")] == [(True, False), (False, True), (True, True)]


def test_the_contract_validates_kinds_teacher_and_reward_from_the_registry() -> None:
    sample("combine", "rl-only", teacher=[-0.5, -0.25])
    with pytest.raises(ContractError, match=r"^mode: 'grpo-y' is not one of"):
        sample("grpo-y", "rl")
    with pytest.raises(ContractError, match=r"^kind: 'opd' is not one of"):
        sample("rl", "opd")
    with pytest.raises(ContractError, match=r"^teacher_logprobs: is required for kind 'rl-only'"):
        sample("combine", "rl-only")
    with pytest.raises(ContractError, match=r"^reward: must be 0 for kind 'opd-only'"):
        sample("combine", "opd-only", reward=1.0, teacher=[-0.1, -0.1])


def test_a_registered_mode_is_valid_everywhere_at_once() -> None:
    assert mode_spec("rl-strict") is fixtures.STRICT_RL
    s = sample("rl-strict", "rl-strict", reward=-1.0)
    assert decide("rl-strict", 1, False, True) == "rl-strict"
    assert decide("rl-strict", 0, False, False) is None, "no at-least-one rule in this mode"
    assert decide("rl", 0, False, False) == "rl"
    assert reward("rl-strict", -1) == -1.0
    adv = sample_advantages(s.mode, s.reward, torch.tensor(s.rollout_logprobs), None)
    assert adv.tolist() == [-2.0, -2.0]


def test_a_mode_declared_twice_differently_or_inconsistently_is_refused() -> None:
    register_mode(fixtures.STRICT_RL)  # the same declaration again: a module imported twice
    with pytest.raises(ValueError, match="already declared differently"):
        register_mode(msgspec.structs.replace(fixtures.STRICT_RL, at_least_one=True))
    with pytest.raises(ValueError, match=r"teacher_kinds: \['x'\] are not kinds of mode 'm'"):
        declare(needs_hint=True, teacher_kinds=frozenset({"x"}))
    with pytest.raises(ValueError, match=r"teacher_kinds: mode 'm' uses the teacher, so it needs_hint"):
        declare(teacher_kinds=frozenset({"a"}))
    with pytest.raises(ValueError, match=r"decide: 'rules\.decide' is not a 'package\.module:function' path"):
        declare(decide="rules.decide")


def declare(**fields: Any) -> ModeSpec:
    """A mode ``m`` emitting kind ``a``, with ``fields`` changed."""
    base: dict[str, Any] = {"kinds": frozenset({"a"}), "needs_eval": True, "needs_hint": False}
    return ModeSpec(name="m", **{**base, "decide": "a:b", "advantage": "a:b", **fields})


def test_the_builtin_formulas_are_the_documented_ones() -> None:
    """The default advantages, through the registry, equal the formulas of docs/design.md exactly."""
    old = torch.tensor([-0.5, -1.0, -2.0])
    teacher = torch.tensor([-0.25, -1.5, -1.0])
    assert torch.equal(sample_advantages("rl", -1.0, old, teacher), torch.full((3,), -1.0))
    assert torch.equal(sample_advantages("opd", 0.0, old, teacher), teacher - old)
    got = sample_advantages("combine", 1.0, old, teacher, w_rl=0.5, w_opd=2.0)
    assert torch.equal(got, 2.0 * (teacher - old) + 0.5 * 1.0)
    assert TrainerConfig().advantages == "services.trainer.advantages:by_mode"
