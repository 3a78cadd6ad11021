"""One training step on a batch of samples: padded ``[B, S]`` micro-batches under a token budget, the PPO loss of
``loss.py`` on the response tokens, gradients accumulated, one Megatron optimizer step.

Log-prob alignment: the log-prob of token t comes from the logits at position t - 1, so every per-token tensor
here is ``[B, S - 1]`` and indexed by the position of the token it scores.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from torch import Tensor

from schemas import Sample
from services.trainer.loss import batch_mean, entropy_from_logits, ppo_clip_loss, sample_advantages


class StepStats(msgspec.Struct):
    loss: float
    pg_loss: float
    clip_fraction: float
    entropy: float
    grad_norm: float
    samples: int
    tokens: int
    """Response tokens trained on."""
    micro_batches: int
    reward_mean_by_kind: dict[str, float]
    applied: bool = True
    """False when the optimizer skipped the update (non-finite gradients)."""


@dataclass(frozen=True)
class Collated:
    tokens: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor


def collate(samples: list[Sample], w_rl: float = 1.0, w_opd: float = 1.0) -> Collated:
    """Right-padded tensors of a list of samples, per-token tensors aligned to the token they score."""
    width = max(len(s.tokens) for s in samples)
    b = len(samples)
    tokens = torch.zeros(b, width, dtype=torch.long)
    attention = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width - 1)
    old = torch.zeros(b, width - 1)
    adv = torch.zeros(b, width - 1)
    for i, s in enumerate(samples):
        n, p = len(s.tokens), s.prompt_length
        tokens[i, :n] = torch.tensor(s.tokens)
        attention[i, :n] = 1
        # Response token j sits at position p + j and is scored at index p + j - 1 of the shifted tensors.
        span = slice(p - 1, p - 1 + s.response_length)
        old_lp = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        teacher = torch.tensor(s.teacher_logprobs, dtype=torch.float32) if s.teacher_logprobs else None
        loss_mask[i, span] = torch.tensor(s.loss_mask, dtype=torch.float32)
        old[i, span] = old_lp
        adv[i, span] = sample_advantages(s.mode, s.reward, old_lp, teacher, w_rl=w_rl, w_opd=w_opd)
    return Collated(tokens, attention, loss_mask, old, adv)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``[B, S, V]`` logits, ``[B, S]`` tokens -> ``[B, S - 1]`` log-prob of each token after the first."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def micro_batches(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Consecutive groups whose padded size (count x longest) stays within the budget (at least one each)."""
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    longest = 0
    for s in sorted(samples, key=lambda s: len(s.tokens)):
        longest_if = max(longest, len(s.tokens))
        if current and longest_if * (len(current) + 1) > token_budget:
            groups.append(current)
            current, longest_if = [], len(s.tokens)
        current.append(s)
        longest = longest_if
    if current:
        groups.append(current)
    return groups


def train_step(
    model: Any,
    optimizer: Any,
    samples: list[Sample],
    *,
    forward: Any,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    w_rl: float = 1.0,
    w_opd: float = 1.0,
    entropy_coef: float = 0.0,
    micro_batch_tokens: int = 8192,
) -> StepStats:
    """Forward and backward over micro-batches, then one optimizer step. The loss is the mean over samples of
    each sample's token mean, whatever the micro-batching (each micro-batch's share is scaled by its size)."""
    from services.trainer.cpu_shim import cpu_allocations

    model.train()
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    optimizer.zero_grad()
    total = len(samples)
    sums: dict[str, float] = defaultdict(float)
    groups = micro_batches(samples, micro_batch_tokens)
    for group in groups:
        c = collate(group, w_rl=w_rl, w_opd=w_opd)
        logits = forward(model, c.tokens, c.attention_mask)
        new = token_logprobs(logits, c.tokens)
        per_token, clipped = ppo_clip_loss(new, c.old_logprobs, c.advantages, eps_clip, eps_clip_high)
        share = len(group) / total
        pg = batch_mean(per_token, c.loss_mask)
        loss = pg
        if entropy_coef:
            ent = batch_mean(entropy_from_logits(logits[:, :-1]), c.loss_mask)
            loss = loss - entropy_coef * ent
        else:
            with torch.no_grad():
                ent = batch_mean(entropy_from_logits(logits[:, :-1].detach()), c.loss_mask)
        (loss * share).backward()
        sums["loss"] += loss.item() * share
        sums["pg"] += pg.item() * share
        sums["entropy"] += ent.item() * share
        sums["clipped"] += float((clipped * c.loss_mask).sum())
        sums["tokens"] += float(c.loss_mask.sum())
    if hasattr(model, "finish_grad_sync"):
        model.finish_grad_sync()
    with cpu_allocations():
        applied, grad_norm, _ = optimizer.step()
    rewards: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        rewards[s.kind].append(s.reward)
    return StepStats(
        loss=sums["loss"],
        pg_loss=sums["pg"],
        clip_fraction=sums["clipped"] / max(sums["tokens"], 1.0),
        entropy=sums["entropy"],
        grad_norm=float(grad_norm or 0.0),
        samples=total,
        tokens=int(sums["tokens"]),
        micro_batches=len(groups),
        reward_mean_by_kind={k: sum(v) / len(v) for k, v in rewards.items()},
        applied=bool(applied),
    )
