"""The ``trainer.loss_terms`` seam: the loss is a sum of named terms, each computed on one micro-batch.

A term is a function of a ``LossInputs`` returning ``(coefficient, value)`` or None (the term does not apply to
this micro-batch): the step adds ``coefficient x value`` to the loss (nothing when the coefficient is 0) and
reports ``value`` under the term's name. A value is a scalar already reduced with ``LossInputs.mean`` (each
sample's token mean, summed over the micro-batch and divided by the samples of the whole rank-local batch), so
micro-batching never changes the update. Built in: ``pg``, ``entropy``, ``kl``, ``topk`` (docs/design.md);
docs/extending.md shows how to add one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from runtime.configuration.config import TrainerConfig
from runtime.configuration.plugins import PluginError, load_function
from services.trainer.head import Hidden, Output
from services.trainer.logprobs import VocabShard
from services.trainer.loss import low_var_kl, ppo_clip_loss, topk_distillation_loss, truncated_importance

if TYPE_CHECKING:
    from services.trainer.batch import Collated


@dataclass
class LossInputs:
    """One micro-batch as the loss terms see it. Per-token tensors are ``[B, S - 1]``, indexed by the position of
    the token they score (the log-prob of token t comes from the logits at t - 1). The built-in terms read only
    per-token figures (``logprobs.py`` makes them in one chunked pass without a vocabulary-sized log-softmax);
    ``logp`` is there for a term that needs the whole distribution, at the cost of that tensor."""

    output: Output
    """The model's output: its final hidden states and output layer (``head.Hidden``), or logits."""
    new: Tensor
    """``[B, S - 1]`` the policy's log-prob of each token (with gradient)."""
    entropy: Tensor
    """``[B, S - 1]`` the policy's entropy at each position (with gradient)."""
    topk_student: Tensor | None
    """``[B, S - 1, K]`` the policy's log-probs of the teacher's top-K ids (with gradient), when the batch has them."""
    batch: Collated
    """Tokens, masks, rollout log-probs, advantages and the teacher's top-K of the micro-batch."""
    settings: TrainerConfig
    total: int
    """Samples in the rank-local batch: ``mean`` divides by it."""
    topk_total: int
    """Samples carrying the teacher's top-K in the rank-local batch."""
    ref_logprobs: Tensor | None = None
    """``[B, S - 1]`` the frozen reference's log-probs, when ``kl_coef`` > 0."""
    counts: dict[str, Tensor] = field(default_factory=dict)
    """Detached sums a term reports beside its value (``pg`` puts the clipped-token count here)."""
    vocab: VocabShard | None = None
    """The vocabulary slice ``logits`` hold under tensor parallelism (None: the whole vocabulary)."""

    @functools.cached_property
    def logits(self) -> Tensor:
        """``[B, S, V]`` the policy's logits at every position (with gradient); under tensor parallelism, this
        rank's slice of the vocabulary (``vocab``). The step computes logits only where a response token is
        scored (``head.py``): a term that reads these pays for every position's, kept for backward."""
        return self.output.logits() if isinstance(self.output, Hidden) else self.output

    @functools.cached_property
    def logp(self) -> Tensor:
        """``[B, S - 1, V]`` the policy's log-softmax over the whole vocabulary at every position (with gradient):
        computed on first use (gathering the vocabulary over tensor-parallel ranks), and tokens x vocabulary x 4
        bytes kept for backward."""
        logits = self.logits
        if self.vocab is not None:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
            logits = logits[..., : self.vocab.total]
        return torch.log_softmax(logits[:, :-1].float(), dim=-1)

    def mean(self, values: Tensor, mask: Tensor | None = None, n: int | None = None) -> Tensor:
        """Each sample's masked token mean, summed over the micro-batch's real rows and divided by ``n`` (default:
        the rank-local batch's samples)."""
        m = self.batch.loss_mask if mask is None else mask
        per_sample = (values * m).sum(-1) / torch.clamp(m.sum(-1), min=1.0)
        return (per_sample * self.batch.rows).sum() / (self.total if n is None else n)


Term = Callable[[LossInputs], "tuple[float, Tensor] | None"]


def pg(x: LossInputs) -> tuple[float, Tensor]:
    """The PPO clipped surrogate with the asymmetric clip (``loss.ppo_clip_loss``) over the advantages, the ratio
    taken against ``old_logprobs`` (the rollout's, or recomputed ones: ``trainer.old_logprobs``). Decoupled: each
    token's term is weighted by the truncated importance weight of the recomputed (proximal) policy against the
    rollout (behaviour) policy, min(exp(old - rollout), ``is_cap``), as in AReaL's decoupled PPO."""
    s, c = x.settings, x.batch
    per_token, clipped = ppo_clip_loss(x.new, c.old_logprobs, c.advantages, s.eps_clip, s.eps_clip_high)
    if s.old_logprobs == "decoupled" and c.behaviour_logprobs is not None:
        per_token = per_token * truncated_importance(c.old_logprobs, c.behaviour_logprobs, s.is_cap)
    x.counts["clipped"] = (clipped * c.loss_mask).sum()
    return 1.0, x.mean(per_token)


def entropy(x: LossInputs) -> tuple[float, Tensor]:
    """The policy's entropy, maximised with ``entropy_coef`` (always reported)."""
    coef = x.settings.entropy_coef
    if coef:
        return -coef, x.mean(x.entropy)
    return 0.0, x.mean(x.entropy.detach())


def kl(x: LossInputs) -> tuple[float, Tensor] | None:
    """k3 KL(policy || reference) with ``kl_coef``, when a reference is loaded."""
    if x.ref_logprobs is None:
        return None
    return x.settings.kl_coef, x.mean(low_var_kl(x.new, x.ref_logprobs))


def topk(x: LossInputs) -> tuple[float, Tensor] | None:
    """Reverse KL to the teacher's top-K (plus a tail bin) with ``topk_coef``, on samples that carry it."""
    c = x.batch
    if not x.settings.topk_coef or c.topk_ids is None or c.topk_logprobs is None or c.topk_mask is None:
        return None
    if x.topk_student is None:
        return None
    return x.settings.topk_coef, x.mean(
        topk_distillation_loss(x.topk_student, c.topk_logprobs), c.topk_mask, x.topk_total
    )


BUILTIN: dict[str, Term] = {"pg": pg, "entropy": entropy, "kl": kl, "topk": topk}


@functools.cache
def resolve(entries: tuple[str, ...]) -> tuple[tuple[str, Term], ...]:
    """``trainer.loss_terms`` as (name, function): a built-in name, ``package.module:function`` (named after the
    function) or ``name=package.module:function``."""
    out: list[tuple[str, Term]] = []
    for entry in entries:
        name, _, path = entry.rpartition("=") if "=" in entry else ("", "", entry)
        if path in BUILTIN and not name:
            out.append((path, BUILTIN[path]))
            continue
        if ":" not in path:
            raise PluginError(
                f"trainer.loss_terms: {entry!r} is neither a built-in term ({', '.join(BUILTIN)}) nor a"
                " 'package.module:function' path"
            )
        fn = cast(Term, load_function("trainer.loss_terms", path, ("inputs",)))
        out.append((name or path.rpartition(":")[2].rpartition(".")[2], fn))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise PluginError(f"trainer.loss_terms: two terms share a name: {names}")
    return tuple(out)
