"""A collated batch: the padded ``[B, S]`` tensors one micro-batch is trained on. Apart from ``step.py``, which
makes it, so the loss terms (``terms.py``, which ``step.py`` runs) can name it without importing the step."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Collated:
    tokens: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    rows: Tensor
    """``[B]``: 1 for a sample, 0 for an empty row that only pads a pipeline micro-batch to its fixed shape."""
    topk_ids: Tensor | None = None
    """``[B, S - 1, K]`` the teacher's top-K token ids at each response position (K: the smallest in the batch)."""
    topk_logprobs: Tensor | None = None
    topk_mask: Tensor | None = None
    behaviour_logprobs: Tensor | None = None
    """``[B, S - 1]`` the rollout log-probs when ``old_logprobs`` holds recomputed ones (``trainer.old_logprobs``
    ``recompute`` or ``decoupled``): the policy that actually sampled the response."""
    scored: Tensor | None = None
    """``[B, S - 1]`` bool: the positions that score a response token (masked or not), the only ones whose logits
    are computed (``head.py``). None: every position."""

    @property
    def scored_positions(self) -> Tensor:
        return self.scored if self.scored is not None else torch.ones_like(self.loss_mask, dtype=torch.bool)

    def to(self, device: torch.device) -> Collated:
        moved: dict[str, Any] = {f.name: _move(getattr(self, f.name), device) for f in fields(self)}
        return Collated(**moved)


def _move(t: Tensor | None, device: torch.device) -> Tensor | None:
    return None if t is None else t.to(device, non_blocking=True)
