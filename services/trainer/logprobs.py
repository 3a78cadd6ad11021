"""Per-token log-probs, entropy and top-K log-probs from ``[B, S, V]`` logits without a log-softmax of their size.

A log-softmax over the vocabulary, kept for backward, costs tokens x vocabulary x 4 bytes (1.6 GB for 8,192
tokens of a 49,152-token vocabulary), and every term that read it (``exp`` for the entropy, ``gather`` for the
top-K, their gradients) added another tensor of that size. Here one autograd function makes every figure the
loss needs in a single pass over the logits, ``chunk`` positions at a time in float32, keeping only the per-position
log-normaliser (logsumexp) for backward; backward recomputes the softmax chunk by chunk and writes the one
gradient the logits need. The logits are read in their own dtype (bf16 on a GPU) and never copied whole. Under
tensor parallelism each rank reads its own slice of the vocabulary (``VocabShard``) and the per-position
maximum, normaliser and gathered logits are all-reduced: nothing vocabulary-sized is ever gathered.

For position ``t`` with logits ``z`` (log-normaliser ``L``, softmax ``p``, log-softmax ``z - L``):
token log-prob ``z[y] - L``; entropy ``H = L - sum(p z)``; top-K log-probs ``z[k] - L``. Their gradients with
respect to ``z``: ``onehot(y) - p``; ``-p (z - L + H)``; ``onehot(k) - p``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ReduceOp

_MAX, _SUM = ReduceOp.MAX, ReduceOp.SUM

CHUNK = 1024
"""Positions per pass: a ``[CHUNK, V]`` float32 block (200 MB at a 49,152-token vocabulary) at a time."""


def _rows(logits: Tensor) -> Tensor:
    """``[..., V]`` as ``[N, V]``: a view for contiguous logits and for logits cut in the vocabulary dimension."""
    return logits.flatten(0, -2)


@dataclass(frozen=True)
class VocabShard:
    """The slice of the vocabulary this rank's logits hold under tensor parallelism (``parallel_output``): columns
    ``start .. start + valid`` of the real vocabulary (the rest is padding), the others on the ranks of
    ``group``. Every figure is then reduced over ``group`` (two all-reduces per chunk of positions) and no rank
    ever holds a whole-vocabulary row."""

    start: int
    valid: int
    group: Any
    total: int
    """The real vocabulary's size (the slices of all ranks hold it and padding)."""

    @classmethod
    def of(cls, vocab_size: int, padded: int, tp: int, tp_rank: int, group: Any) -> VocabShard:
        per = padded // tp
        start = tp_rank * per
        return cls(start, max(0, min(vocab_size - start, per)), group, vocab_size)


def _all_reduce(t: Tensor, op: Any, group: Any) -> None:
    import torch.distributed as dist

    dist.all_reduce(t, op=op, group=group)


class _TokenFigures(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        topk_ids: Tensor | None,
        chunk: int,
        with_entropy: bool,
        shard: VocabShard | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        z = _rows(logits)
        n = z.shape[0]
        start, valid = (shard.start, shard.valid) if shard is not None else (0, z.shape[1])
        y, y_here = _local(targets.reshape(n), start, valid)
        k, k_here = _local(topk_ids.reshape(n, -1), start, valid) if topk_ids is not None else (None, None)
        kk = 0 if k is None else k.shape[1]
        lse = torch.empty(n, dtype=torch.float32, device=z.device)
        token = torch.empty(n, dtype=torch.float32, device=z.device)
        entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=z.device)
        topk = torch.empty(n, kk, dtype=torch.float32, device=z.device)
        for i in range(0, n, chunk):
            j = slice(i, i + chunk)
            zc = z[j, :valid].float()  # padded vocabulary columns never enter the softmax
            rows = zc.shape[0]
            m = zc.max(-1).values if valid else zc.new_full((rows,), float("-inf"))
            if shard is not None:
                _all_reduce(m, _MAX, shard.group)
            e = torch.exp(zc - m[:, None])
            packed = torch.zeros(rows, 3 + kk, dtype=torch.float32, device=z.device)
            packed[:, 0] = e.sum(-1)
            if with_entropy:
                packed[:, 1] = (e * (zc - m[:, None])).sum(-1)
            if valid:  # a target or top-K id counts on the rank whose slice holds it, 0 elsewhere
                packed[:, 2] = zc.gather(-1, y[j, None]).squeeze(-1) * y_here[j]
                if k is not None and k_here is not None:
                    packed[:, 3:] = zc.gather(-1, k[j]) * k_here[j]
            if shard is not None:
                _all_reduce(packed, _SUM, shard.group)
            total = packed[:, 0]
            lc = m + torch.log(total)
            lse[j] = lc
            token[j] = packed[:, 2] - lc
            if with_entropy:
                entropy[j] = torch.log(total) - packed[:, 1] / total
            if k is not None:
                topk[j] = packed[:, 3:] - lc[:, None]
        ctx.set_materialize_grads(False)  # an output no term differentiates gets None, and costs nothing
        ctx.chunk, ctx.shape, ctx.valid, ctx.has_topk = chunk, logits.shape, valid, k is not None
        empty = torch.empty(0)
        ctx.save_for_backward(
            logits,
            y,
            y_here,
            lse,
            entropy,
            k if k is not None else empty,
            k_here if k_here is not None else empty,
        )
        batch = logits.shape[:-1]
        return token.view(batch), entropy.view(batch if with_entropy else (0,)), topk.view(*batch, kk)

    @staticmethod
    def backward(
        ctx: Any, g_token: Tensor | None, g_entropy: Tensor | None, g_topk: Tensor | None
    ) -> tuple[Tensor, None, None, None, None, None]:
        """No collective: L and H are the whole vocabulary's (saved), the upstream gradients are the same on every
        rank of the group, and Megatron's output layer all-reduces the hidden states' gradient in its backward."""
        logits, y, y_here, lse, entropy, k, k_here = ctx.saved_tensors
        z = _rows(logits)
        n, valid = z.shape[0], ctx.valid
        gt = g_token.reshape(n).float() if g_token is not None else None
        gh = g_entropy.reshape(n).float() if g_entropy is not None and entropy.numel() else None
        gk = g_topk.reshape(n, -1).float() if g_topk is not None and ctx.has_topk else None
        grad = torch.zeros_like(z) if valid < z.shape[1] else torch.empty_like(z)
        for i in range(0, n if valid else 0, ctx.chunk):
            j = slice(i, i + ctx.chunk)
            zc = z[j, :valid].float()
            lc = lse[j][:, None]
            p = torch.exp(zc - lc)
            # the softmax's share of every gradient: -p x (sum of the upstream gradients of the z[.] - L outputs)
            through_l = torch.zeros_like(lc)
            if gt is not None:
                through_l += gt[j, None]
            if gk is not None:
                through_l += gk[j].sum(-1, keepdim=True)
            gc = -p * through_l
            if gh is not None:
                gc -= gh[j, None] * p * (zc - lc + entropy[j, None])
            if gt is not None:
                gc.scatter_add_(-1, y[j, None], (gt[j] * y_here[j])[:, None])
            if gk is not None:
                gc.scatter_add_(-1, k[j], gk[j] * k_here[j])
            grad[j, :valid] = gc.to(grad.dtype)
        return grad.view(ctx.shape), None, None, None, None, None


def _local(ids: Tensor, start: int, valid: int) -> tuple[Tensor, Tensor]:
    """Vocabulary ids -> (index into this rank's columns, clamped; 1.0 where this rank holds the id else 0.0)."""
    here = ((ids >= start) & (ids < start + valid)).float()
    return (ids - start).clamp(0, max(valid - 1, 0)), here


def token_figures(
    logits: Tensor,
    targets: Tensor,
    topk_ids: Tensor | None = None,
    chunk: int = CHUNK,
    with_entropy: bool = True,
    shard: VocabShard | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``[B, S, V]`` logits (``V``: this rank's slice with a ``shard``) -> at every position: the log-prob of
    ``targets`` (``[B, S]``), the entropy (None without ``with_entropy``: it costs a multiply-add over each
    chunk, and no memory), and the log-probs of ``topk_ids`` (``[B, S, K]``, or None), all float32 and
    differentiable with respect to the logits."""
    token, entropy, topk = _TokenFigures.apply(logits, targets, topk_ids, chunk, with_entropy, shard)  # type: ignore[no-untyped-call]
    return token, (entropy if with_entropy else None), (topk if topk_ids is not None else None)


def shifted(
    logits: Tensor,
    tokens: Tensor,
    topk_ids: Tensor | None = None,
    with_entropy: bool = True,
    shard: VocabShard | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The training view of ``token_figures``: ``[B, S - 1]`` figures where index ``t`` scores ``tokens[:, t + 1]``
    from the logits at ``t`` (``topk_ids`` is ``[B, S - 1, K]`` in that indexing). The last position, which
    predicts nothing, is computed with placeholder targets and cut off: slicing the logits instead would copy
    them."""
    targets = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    ids = None
    if topk_ids is not None:
        ids = torch.cat([topk_ids, topk_ids[:, :1]], dim=1)
    token, entropy, topk = token_figures(logits, targets, ids, with_entropy=with_entropy, shard=shard)
    return (
        token[:, :-1],
        (entropy[:, :-1] if entropy is not None else None),
        (topk[:, :-1] if topk is not None else None),
    )
