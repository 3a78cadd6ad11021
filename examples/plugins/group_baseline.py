"""A group-baseline advantage, as GRPO forms it: each sample's reward is replaced by its z-score within a group
(the samples of one session, or the whole batch), then the sample's own mode formula is applied. Samples whose
kind carries no reward (``opd``, ``opd-only``) keep their teacher term and stay out of the statistics.

With every reward in a group equal there is nothing to prefer, and the advantage is 0: the step leaves the policy
where it was, where the default formula would push every response up (or down) alike.

    [trainer]
    advantages = "examples.plugins.group_baseline:per_batch"     # or :per_session

Written against turnstream's public seams only (docs/extending.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from runtime.configuration.config import TrainerConfig
from schemas import Sample, mode_spec
from services.trainer.loss import mode_advantage

EPS = 1e-6
"""Added to the group's standard deviation, as GRPO does, so a group of equal rewards divides 0 by a small number."""


def _normalised(samples: Sequence[Sample], group_of: Callable[[Sample], Hashable]) -> list[float]:
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        if s.kind not in mode_spec(s.mode).zero_reward_kinds:
            groups[group_of(s)].append(i)
    rewards = [s.reward for s in samples]
    for members in groups.values():
        r = torch.tensor([samples[i].reward for i in members], dtype=torch.float64)
        std = r.std(unbiased=False) if len(members) > 1 else torch.tensor(0.0, dtype=torch.float64)
        z = (r - r.mean()) / (std + EPS)
        for i, value in zip(members, z.tolist(), strict=True):
            rewards[i] = value
    return rewards


def _advantages(
    samples: Sequence[Sample], settings: TrainerConfig, group_of: Callable[[Sample], Hashable]
) -> list[Tensor]:
    out = []
    for s, reward in zip(samples, _normalised(samples, group_of), strict=True):
        old = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        teacher = torch.tensor(s.teacher_logprobs, dtype=torch.float32) if s.teacher_logprobs else None
        out.append(mode_advantage(s.mode)(reward, old, teacher, settings))
    return out


def per_batch(samples: Sequence[Sample], settings: TrainerConfig) -> list[Tensor]:
    """The whole batch is one group."""
    return _advantages(samples, settings, lambda s: 0)


def per_session(samples: Sequence[Sample], settings: TrainerConfig) -> list[Tensor]:
    """Each session's samples are a group (a session with one sample in the batch gets advantage 0)."""
    return _advantages(samples, settings, lambda s: s.session_id)
