"""The ``trainer.advantages`` seam: per-token advantages for a whole batch at once, so a formula may use the
batch (a group baseline over a session's or the batch's samples, as GRPO does); docs/extending.md.

A function of ``(samples, settings)`` returning one 1-D float tensor per sample, in order, each as long as the
sample's response. The trainer checks the shapes every step and calls it on the whole batch before it is split
over data-parallel ranks, so every rank sees the same advantages. No gradient flows through advantages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import Tensor

from runtime.configuration.config import TrainerConfig
from runtime.configuration.plugins import PluginError, load_function
from schemas import Sample
from services.trainer.loss import mode_advantage

Advantages = Callable[[Sequence[Sample], TrainerConfig], list[Tensor]]
PARAMS = ("samples", "settings")


def by_mode(samples: Sequence[Sample], settings: TrainerConfig) -> list[Tensor]:
    """Each sample's own mode's formula (``rl``: the reward; ``opd``: teacher - old; ``combine``: their
    weighted sum; a plugin mode's registered function)."""
    out = []
    for s in samples:
        old = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        teacher = torch.tensor(s.teacher_logprobs, dtype=torch.float32) if s.teacher_logprobs else None
        out.append(mode_advantage(s.mode)(s.reward, old, teacher, settings))
    return out


def load(settings: TrainerConfig) -> Advantages:
    return cast(Advantages, load_function("trainer.advantages", settings.advantages, PARAMS))


def checked(fn: Advantages, samples: Sequence[Sample], settings: TrainerConfig) -> list[Tensor]:
    """``fn``'s advantages, refused (naming the seam) unless there is one finite tensor per sample, each as long
    as its response."""
    advantages = fn(samples, settings)
    name = f"trainer.advantages ({settings.advantages})"
    if not isinstance(advantages, Sequence) or len(advantages) != len(samples):
        got = len(advantages) if isinstance(advantages, Sequence) else type(advantages).__name__
        raise PluginError(f"{name}: returned {got} advantages for {len(samples)} samples")
    for s, a in zip(samples, advantages, strict=True):
        if not isinstance(a, Tensor) or a.shape != (s.response_length,):
            shape = tuple(a.shape) if isinstance(a, Tensor) else type(a).__name__
            raise PluginError(
                f"{name}: sample {s.sample_id}: advantages of shape {shape}, expected ({s.response_length},)"
            )
        if not torch.isfinite(a).all():
            raise PluginError(f"{name}: sample {s.sample_id}: advantages are not all finite")
    return [a.detach().float() for a in advantages]
