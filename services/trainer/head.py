"""The output layer only where the loss reads it.

An agent's turn is mostly prompt: at 32,768 tokens of Qwen3-4B the logits of every position (kept for the loss,
their gradient, and Megatron's ``[b, s, v]`` copy) are over 20 GiB, for a response of a few hundred tokens. The
step therefore runs the model up to its final norm (``forward_hidden``) and applies the output layer to the
positions that score a response token alone, ``CHUNK`` positions at a time; in training each chunk is
checkpointed, so backward recomputes its logits instead of keeping them. Memory for the output layer is one
chunk's, whatever the sample's length. The figures are scattered back into the ``[B, S - 1]`` layout the loss terms
read, zero at positions no term reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from services.trainer.logprobs import CHUNK, VocabShard, token_figures

if TYPE_CHECKING:
    from services.trainer.batch import Collated

Head = Callable[[Tensor], Tensor]
"""``[..., H]`` final hidden states -> ``[..., V]`` logits (this rank's vocabulary slice)."""


def gpt_model(model: Any) -> Any:
    """The Megatron ``GPTModel`` inside wrappers (Megatron's DDP ``.module``, ``lora.AdaptersOff`` ``.model``)."""
    from megatron.core.models.gpt import GPTModel

    while not isinstance(model, GPTModel):
        model = model.module if hasattr(model, "module") else model.model
    return model


def output_head(model: Any) -> Head:
    """The model's output layer as a function (the tied embedding's weight when it has no layer of its own)."""
    gpt = gpt_model(model)

    def head(hidden: Tensor) -> Tensor:
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        logits: Tensor = gpt.output_layer(hidden, weight=weight)[0]
        return logits

    return head


@dataclass(frozen=True)
class Hidden:
    """The last pipeline stage's output as the step hands it to the loss: ``[S, B, H]`` states after the final
    norm, and the head that turns them into logits."""

    states: Tensor
    head: Head

    def logits(self) -> Tensor:
        """``[B, S, V]`` at every position: what a loss term that reads ``LossInputs.logits`` pays for."""
        return self.head(self.states).transpose(0, 1)


def scored_positions(c: Collated) -> tuple[Tensor, Tensor]:
    """(rows, columns) of the ``[B, S - 1]`` positions that score a response token; at least one, so that the
    output layer is in every micro-batch's graph."""
    rows, cols = c.scored_positions.nonzero(as_tuple=True)
    if rows.numel() == 0:
        rows = cols = torch.zeros(1, dtype=torch.long, device=c.tokens.device)
    return rows, cols


def figures(
    out: Hidden,
    c: Collated,
    topk_ids: Tensor | None = None,
    with_entropy: bool = True,
    shard: VocabShard | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``logprobs.shifted``'s figures (``[B, S - 1]`` token log-prob and entropy, ``[B, S - 1, K]`` top-K) at the
    scored positions, from ``CHUNK`` positions' logits at a time; zero elsewhere."""
    rows, cols = scored_positions(c)
    hidden = out.states[cols, rows]  # [N, H]
    targets = c.tokens[rows, cols + 1]
    ids = topk_ids[rows, cols] if topk_ids is not None else None
    train = torch.is_grad_enabled() and hidden.requires_grad
    parts: list[tuple[Tensor, Tensor | None, Tensor | None]] = []
    for i in range(0, hidden.shape[0], CHUNK):
        j = slice(i, i + CHUNK)

        def piece(h: Tensor, t: Tensor, k: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
            return token_figures(out.head(h[:, None]), t[:, None], k, with_entropy=with_entropy, shard=shard)

        args = (hidden[j], targets[j], None if ids is None else ids[j, None])
        parts.append(checkpoint(piece, *args, use_reentrant=False) if train else piece(*args))
    b, s1 = c.loss_mask.shape
    token = _scatter(torch.cat([p[0] for p in parts]).flatten(), rows, cols, (b, s1))
    entropy = (
        _scatter(torch.cat([p[1] for p in parts if p[1] is not None]).flatten(), rows, cols, (b, s1))
        if with_entropy
        else None
    )
    topk = None
    if ids is not None:
        k = ids.shape[-1]
        flat = torch.cat([p[2] for p in parts if p[2] is not None]).reshape(-1, k)
        topk = flat.new_zeros(b, s1, k).index_put((rows, cols), flat)
    return token, entropy, topk


def _scatter(values: Tensor, rows: Tensor, cols: Tensor, shape: tuple[int, int]) -> Tensor:
    return values.new_zeros(shape).index_put((rows, cols), values)


Output = Tensor | Hidden
"""What a loss reads: ``[B, S, V]`` logits, or the final hidden states with their head."""


def output_figures(
    out: Output,
    c: Collated,
    topk_ids: Tensor | None = None,
    with_entropy: bool = True,
    shard: VocabShard | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The loss's per-token figures from either kind of output."""
    if isinstance(out, Hidden):
        return figures(out, c, topk_ids, with_entropy, shard)
    from services.trainer.logprobs import shifted

    return shifted(out, c.tokens, topk_ids, with_entropy=with_entropy, shard=shard)
