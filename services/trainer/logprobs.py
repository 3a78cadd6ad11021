"""Per-token log-probs, entropy and top-K log-probs from ``[B, S, V]`` logits without a log-softmax of their size.

A log-softmax over the vocabulary, kept for backward, costs tokens x vocabulary x 4 bytes (1.6 GB for 8,192
tokens of a 49,152-token vocabulary), and every term that read it (``exp`` for the entropy, ``gather`` for the
top-K, their gradients) added another tensor of that size. Here one autograd function makes every figure the
loss needs in a single pass over the logits, ``chunk`` positions at a time in float32, keeping only the per-position
log-normaliser (logsumexp) for backward; backward recomputes the softmax chunk by chunk and writes the one
gradient the logits need. The logits are read in their own dtype (bf16 on a GPU) and never copied whole.

For position ``t`` with logits ``z`` (log-normaliser ``L``, softmax ``p``, log-softmax ``z - L``):
token log-prob ``z[y] - L``; entropy ``H = L - sum(p z)``; top-K log-probs ``z[k] - L``. Their gradients with
respect to ``z``: ``onehot(y) - p``; ``-p (z - L + H)``; ``onehot(k) - p``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

CHUNK = 1024
"""Positions per pass: a ``[CHUNK, V]`` float32 block (200 MB at a 49,152-token vocabulary) at a time."""


def _rows(logits: Tensor) -> Tensor:
    """``[..., V]`` as ``[N, V]``: a view for contiguous logits and for logits cut in the vocabulary dimension."""
    return logits.flatten(0, -2)


class _TokenFigures(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, topk_ids: Tensor | None, chunk: int, with_entropy: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        z = _rows(logits)
        n = z.shape[0]
        y = targets.reshape(n)
        k = topk_ids.reshape(n, -1) if topk_ids is not None else None
        lse = torch.empty(n, dtype=torch.float32, device=z.device)
        token = torch.empty(n, dtype=torch.float32, device=z.device)
        entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=z.device)
        topk = torch.empty(n, 0 if k is None else k.shape[1], dtype=torch.float32, device=z.device)
        for i in range(0, n, chunk):
            zc = z[i : i + chunk].float()
            lc = torch.logsumexp(zc, -1)
            lse[i : i + chunk] = lc
            token[i : i + chunk] = zc.gather(-1, y[i : i + chunk, None]).squeeze(-1) - lc
            if with_entropy:
                p = torch.exp(zc - lc[:, None])
                entropy[i : i + chunk] = lc - (p * zc).sum(-1)
            if k is not None:
                topk[i : i + chunk] = zc.gather(-1, k[i : i + chunk]) - lc[:, None]
        ctx.set_materialize_grads(False)  # an output no term differentiates gets None, and costs nothing
        ctx.chunk = chunk
        ctx.shape = logits.shape
        ctx.save_for_backward(logits, y, lse, entropy, k if k is not None else torch.empty(0))
        ctx.has_topk = k is not None
        batch = logits.shape[:-1]
        return (
            token.view(batch),
            entropy.view(batch if with_entropy else (0,)),
            topk.view(*batch, topk.shape[1]),
        )

    @staticmethod
    def backward(
        ctx: Any, g_token: Tensor | None, g_entropy: Tensor | None, g_topk: Tensor | None
    ) -> tuple[Tensor, None, None, None, None]:
        logits, y, lse, entropy, k = ctx.saved_tensors
        z = _rows(logits)
        n = z.shape[0]
        gt = g_token.reshape(n).float() if g_token is not None else None
        gh = g_entropy.reshape(n).float() if g_entropy is not None and entropy.numel() else None
        gk = g_topk.reshape(n, -1).float() if g_topk is not None and ctx.has_topk else None
        grad = torch.empty_like(z)
        for i in range(0, n, ctx.chunk):
            j = slice(i, i + ctx.chunk)
            zc = z[j].float()
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
                gc.scatter_add_(-1, y[j, None], gt[j, None])
            if gk is not None:
                gc.scatter_add_(-1, k[j], gk[j])
            grad[j] = gc.to(grad.dtype)
        return grad.view(ctx.shape), None, None, None, None


def token_figures(
    logits: Tensor,
    targets: Tensor,
    topk_ids: Tensor | None = None,
    chunk: int = CHUNK,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``[B, S, V]`` logits -> at every position: the log-prob of ``targets`` (``[B, S]``), the entropy (None
    without ``with_entropy``: it costs a second pass over each chunk), and the log-probs of ``topk_ids``
    (``[B, S, K]``, or None), all float32 and differentiable with respect to the logits."""
    token, entropy, topk = _TokenFigures.apply(logits, targets, topk_ids, chunk, with_entropy)  # type: ignore[no-untyped-call]
    return token, (entropy if with_entropy else None), (topk if topk_ids is not None else None)


def shifted(
    logits: Tensor, tokens: Tensor, topk_ids: Tensor | None = None, with_entropy: bool = True
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The training view of ``token_figures``: ``[B, S - 1]`` figures where index ``t`` scores ``tokens[:, t + 1]``
    from the logits at ``t`` (``topk_ids`` is ``[B, S - 1, K]`` in that indexing). The last position, which
    predicts nothing, is computed with placeholder targets and cut off: slicing the logits instead would copy
    them."""
    targets = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)
    ids = None
    if topk_ids is not None:
        ids = torch.cat([topk_ids, topk_ids[:, :1]], dim=1)
    token, entropy, topk = token_figures(logits, targets, ids, with_entropy=with_entropy)
    return (
        token[:, :-1],
        (entropy[:, :-1] if entropy is not None else None),
        (topk[:, :-1] if topk is not None else None),
    )
