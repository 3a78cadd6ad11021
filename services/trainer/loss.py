"""The trainer's objective (docs/design.md, "The method, exactly"), pure torch so it is tested on hand-computed numbers.

One loss, not a weighted sum of two: rl and opd signals mix in advantage space, and one PPO clipped surrogate
with an asymmetric clip optimizes both. ``old`` log-probs are the rollout log-probs the proxy recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from runtime.configuration.config import TrainerConfig
from runtime.configuration.plugins import load_function
from schemas.modes import UnknownMode, mode_spec

_TAIL_FLOOR = 1e-6


def rl_advantage(reward: float, old: Tensor, teacher: Tensor | None, settings: TrainerConfig) -> Tensor:
    """The reward, broadcast over the response."""
    return torch.full_like(old, float(reward))


def opd_advantage(reward: float, old: Tensor, teacher: Tensor | None, settings: TrainerConfig) -> Tensor:
    """``teacher - old``: the teacher's log-prob gap under the hint (a missing teacher counts as equal to old)."""
    return (old if teacher is None else teacher) - old


def combine_advantage(reward: float, old: Tensor, teacher: Tensor | None, settings: TrainerConfig) -> Tensor:
    """``w_opd * (teacher - old) + w_rl * reward``."""
    return settings.w_opd * opd_advantage(reward, old, teacher, settings) + settings.w_rl * float(reward)


def mode_advantage(mode: str) -> Callable[[float, Tensor, Tensor | None, TrainerConfig], Tensor]:
    """The per-sample advantage function the mode registry names for ``mode``."""
    return cast(
        Callable[[float, Tensor, Tensor | None, TrainerConfig], Tensor],
        load_function(
            f"mode {mode!r} advantage", mode_spec(mode).advantage, ("reward", "old", "teacher", "settings")
        ),
    )


def sample_advantages(
    mode: str,
    reward: float,
    old_logprobs: Tensor,
    teacher_logprobs: Tensor | None,
    w_rl: float = 1.0,
    w_opd: float = 1.0,
) -> Tensor:
    """Per-token advantages of one sample. rl: the reward broadcast; opd: ``teacher - old``; combine:
    ``w_opd * (teacher - old) + w_rl * reward``; a plugin's mode: its registered function. A missing teacher
    counts as equal to old. No gradient flows through advantages."""
    try:
        advantage = mode_advantage(mode)
    except UnknownMode as exc:
        raise ValueError(f"mode: {exc}") from None
    teacher = None if teacher_logprobs is None else teacher_logprobs.detach()
    return advantage(reward, old_logprobs.detach(), teacher, TrainerConfig(w_rl=w_rl, w_opd=w_opd))


def ppo_clip_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
) -> tuple[Tensor, Tensor]:
    """Per-token ``max(-r A, -clip(r, 1 - eps_clip, 1 + eps_clip_high) A)`` with ``r = exp(new - old)``, and a
    float tensor that is 1 where the clipped term was the one taken (the clip fraction's numerator)."""
    ratio = torch.exp(new_logprobs - old_logprobs.detach())
    adv = advantages.detach()
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * adv
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def truncated_importance(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> Tensor:
    """Per-token ``min(exp(proximal - behaviour), cap)``, no gradient: how much more (or less) likely the policy
    the update starts from makes each token than the policy that sampled it, truncated so that one token cannot
    dominate (AReaL's decoupled PPO, slime's TIS)."""
    return torch.clamp(torch.exp(proximal_logprobs.detach() - behaviour_logprobs.detach()), max=cap)


def low_var_kl(new_logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """KL(new || ref) per token with the k3 estimator ``exp(ref - new) - (ref - new) - 1``, clamped to [-10, 10]."""
    log_ratio = ref_logprobs.detach() - new_logprobs
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


def _with_tail(topk_logprobs: Tensor) -> Tensor:
    """Log-probs over K tokens plus a last bin holding the remaining mass."""
    mass = torch.exp(topk_logprobs).sum(-1, keepdim=True)
    tail = torch.log(torch.clamp(1.0 - mass, min=_TAIL_FLOOR))
    return torch.cat([topk_logprobs, tail], dim=-1)


def topk_distillation_loss(student_topk_logprobs: Tensor, teacher_topk_logprobs: Tensor) -> Tensor:
    """Per-token reverse KL(student || teacher) over the teacher's K tokens plus one tail bin for the rest of each
    distribution's mass. Inputs are ``[..., K]`` log-probs of the same K token ids under each model."""
    s = _with_tail(student_topk_logprobs)
    t = _with_tail(teacher_topk_logprobs.detach())
    return (torch.exp(s) * (s - t)).sum(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy of the softmax over the last dimension."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(torch.exp(logp) * logp).sum(-1)


def batch_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over samples of each sample's masked token mean (``[B, T]`` values and mask): a long response counts
    as much as a short one."""
    mask = mask.to(values.dtype)
    per_sample = (values * mask).sum(-1) / torch.clamp(mask.sum(-1), min=1.0)
    return per_sample.mean()


def total_loss(
    policy_loss: Tensor,
    entropy: Tensor | None = None,
    kl: Tensor | None = None,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
) -> Tensor:
    """policy loss - entropy_coef x entropy + kl_coef x KL (each already reduced with ``batch_mean``)."""
    loss = policy_loss
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * entropy
    if kl is not None and kl_coef:
        loss = loss + kl_coef * kl
    return loss
