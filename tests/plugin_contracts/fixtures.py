"""Plugins for the seams' contract tests: ones that fit, and ones that do not in each way a seam refuses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from runtime.configuration.config import Config, TrainerConfig
from schemas import ModeSpec, PairedTurn, Sample, register_mode
from services.trainer.terms import LossInputs

# trainer.advantages


def constant_advantages(samples: Sequence[Sample], settings: TrainerConfig) -> list[Tensor]:
    return [torch.full((s.response_length,), 0.5) for s in samples]


def one_too_few(samples: Sequence[Sample], settings: TrainerConfig) -> list[Tensor]:
    return constant_advantages(samples, settings)[1:]


def wrong_length(samples: Sequence[Sample], settings: TrainerConfig) -> list[Tensor]:
    return [torch.zeros(s.response_length + 1) for s in samples]


def not_finite(samples: Sequence[Sample], settings: TrainerConfig) -> list[Tensor]:
    return [torch.full((s.response_length,), float("nan")) for s in samples]


def samples_only(samples: Sequence[Sample]) -> list[Tensor]:
    return []


NOT_A_FUNCTION = 42

# trainer.loss_terms


def response_length_penalty(x: LossInputs) -> tuple[float, Tensor]:
    """The mean log-prob of the response tokens, maximised with weight 0.1 (a toy term)."""
    return -0.1, x.mean(x.new)


def full_distribution_entropy(x: LossInputs) -> tuple[float, Tensor]:
    """The entropy from the whole log-softmax (``logp``, computed on demand), reported only."""
    return 0.0, x.mean(-(x.logp.exp() * x.logp).sum(-1))


def off(x: LossInputs) -> None:
    return None


def term_with_two_args(x: LossInputs, y: int) -> tuple[float, Tensor]:
    raise AssertionError("never called")


# dispatcher.decide


def decide_only_positive(
    mode: str, eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool
) -> str | None:
    return "rl" if eval_score == 1 else None


def decide_unknown_kind(
    mode: str, eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool
) -> str | None:
    return "nonsense"


def decide_without_session(mode: str, eval_score: int | None, hint_accepted: bool) -> str | None:
    return None


# judge.backend


class EchoJudge:
    """Votes 1 on every eval, and accepts a fixed hint."""

    def __init__(self, config: Config) -> None:
        self.model = f"echo-{config.judge.judge_id}"

    async def vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, Any]]) -> str:
        return (
            "\\boxed{1}" if kind == "eval" else "\\boxed{1} [HINT_START]Answer in Celsius, please.[HINT_END]"
        )


class NoVoteJudge:
    def __init__(self, config: Config) -> None:
        self.model = "none"


class SyncVoteJudge:
    def __init__(self, config: Config) -> None:
        self.model = "sync"

    def vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, Any]]) -> str:
        return ""


class NoModelJudge:
    def __init__(self, config: Config) -> None:
        pass

    async def vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, Any]]) -> str:
        return ""


class NoConfigJudge:
    model = "x"

    def __init__(self) -> None:
        pass

    async def vote(self, kind: str, paired: PairedTurn, messages: list[dict[str, Any]]) -> str:
        return ""


# judge.vote_parser


def parse_plain_digits(kind: str, text: str) -> tuple[int | None, str]:
    """A judge that answers with a bare number ("1", "-1"), and for hints a number then the hint."""
    head, _, rest = text.strip().partition(" ")
    try:
        score = int(head)
    except ValueError:
        return None, ""
    return score, rest.strip()


def parse_out_of_range(kind: str, text: str) -> tuple[int | None, str]:
    return 7, ""


# A mode, registered as this module is imported (plugins.modules = ["tests.plugin_contracts.fixtures"]).

STRICT_RL = register_mode(
    ModeSpec(
        name="rl-strict",
        kinds=frozenset({"rl-strict"}),
        needs_eval=True,
        needs_hint=False,
        decide="tests.plugin_contracts.fixtures:decide_strict",
        advantage="tests.plugin_contracts.fixtures:doubled_reward",
        defaults={"trainer.eps_clip_high": 0.2},
    )
)
"""rl without the at-least-one rule, and twice the reward as its advantage."""


def decide_strict(
    eval_score: int | None, hint_accepted: bool, session_has_effective_sample: bool
) -> str | None:
    return "rl-strict" if eval_score in (1, -1) else None


def doubled_reward(reward: float, old: Tensor, teacher: Tensor | None, settings: TrainerConfig) -> Tensor:
    return torch.full_like(old, 2.0 * reward)
