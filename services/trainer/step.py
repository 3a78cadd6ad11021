"""One training step on a batch of samples: the batch's advantages (the ``trainer.advantages`` seam), padded
``[B, S]`` micro-batches under a token budget, the loss as the sum of the ``trainer.loss_terms`` (the PPO loss of
``loss.py`` on the response tokens, plus the entropy, reference KL and top-K distillation terms when configured),
gradients accumulated by Megatron's forward-backward schedule, one Megatron optimizer step.

The same code runs for every parallel layout: each data-parallel rank trains its share of the batch, pipeline
stages exchange activations through the schedule (whose micro-batches then all have one fixed shape, padded with
empty rows), and under tensor parallelism each rank's logits are its slice of the vocabulary (``vocab``), the
per-token figures reduced over the tensor-parallel group (``logprobs.py``).

Log-prob alignment: the log-prob of token t comes from the logits at position t - 1, so every per-token tensor
here is ``[B, S - 1]`` and indexed by the position of the token it scores.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
from torch import Tensor

from runtime.configuration.config import TrainerConfig
from schemas import Sample
from schemas.modes import mode_spec
from services.trainer import advantages as batch_advantages
from services.trainer import terms as loss_terms
from services.trainer.batch import Collated
from services.trainer.head import Hidden, Output, output_figures, output_head
from services.trainer.logprobs import VocabShard, shifted
from services.trainer.lora import AdaptersOff, disabled
from services.trainer.loss import low_var_kl, sample_advantages
from services.trainer.parallel import ParallelLayout

Forward = Callable[[Any, Tensor, Tensor], Tensor]
"""(model, ``[B, S]`` tokens, ``[B, S]`` attention mask) -> ``[S, B, H]`` hidden states after the final norm on the
last pipeline stage (``model.forward_hidden``; the step applies the output layer where the loss reads it,
``head.py``), the stage's output before it."""


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
    kl_rollout: float = 0.0
    """k3 KL(new || rollout policy) before the update: how far the trained policy has drifted from the sampler."""
    kl: float | None = None
    """k3 KL(new || reference), when a reference model is configured."""
    topk_loss: float | None = None
    is_weight_mean: float | None = None
    """``trainer.old_logprobs`` recompute or decoupled: the mean over response tokens of exp(old - rollout), the
    importance weight of the recomputed policy against the one that sampled (1 when nothing drifted)."""
    is_weight_max: float | None = None
    is_truncated: float | None = None
    """The share of response tokens whose importance weight exceeds ``trainer.is_cap`` (truncated when
    decoupled)."""
    opd_gap: float | None = None
    """The mean teacher - old log-prob gap over the tokens of samples that carry the teacher's log-probs, against
    the rollout log-probs or the recomputed ones (``trainer.old_logprobs``)."""
    terms: dict[str, float] = msgspec.field(default_factory=dict)
    """The values of loss terms other than the built-in ones (``trainer.loss_terms``)."""
    applied: bool = True
    """False when the optimizer skipped the update (non-finite gradients)."""
    gpu_peak_gib: float | None = None
    """On a GPU: the most memory torch allocated during the step (to compare with ``turnstream trainer plan``)."""
    advantages: dict[str, float] = msgspec.field(default_factory=dict)
    """Each sample's advantage (by sample id), its mean over the response's tokens, as this step used it."""


def collate(
    samples: list[Sample],
    w_rl: float = 1.0,
    w_opd: float = 1.0,
    *,
    rows: int | None = None,
    width: int | None = None,
    advantages: Sequence[Tensor] | None = None,
    behaviour: Sequence[list[float]] | None = None,
) -> Collated:
    """Right-padded tensors of a list of samples, per-token tensors aligned to the token they score; ``rows`` and
    ``width`` pad to a fixed shape (an empty row holds one token, attends to itself and counts nowhere).
    ``advantages``: one per sample, from the batch-level seam (default: each sample's mode's formula);
    ``behaviour``: one per sample, the rollout log-probs when the samples' own are recomputed ones."""
    width = width or max(len(s.tokens) for s in samples)
    b = rows or len(samples)
    tokens = torch.zeros(b, width, dtype=torch.long)
    attention = torch.zeros(b, width, dtype=torch.long)
    attention[:, 0] = 1
    loss_mask = torch.zeros(b, width - 1)
    old = torch.zeros(b, width - 1)
    adv = torch.zeros(b, width - 1)
    real = torch.zeros(b)
    with_topk = [s for s in samples if s.topk_token_ids]
    k = min((len(row) for s in with_topk for row in s.topk_token_ids or []), default=0)
    topk_ids = torch.zeros(b, width - 1, k, dtype=torch.long) if k else None
    topk_lp = torch.zeros(b, width - 1, k) if k else None
    topk_mask = torch.zeros(b, width - 1) if k else None
    behaved = torch.zeros(b, width - 1) if behaviour is not None else None
    scored = torch.zeros(b, width - 1, dtype=torch.bool)
    for i, s in enumerate(samples):
        n, p = len(s.tokens), s.prompt_length
        tokens[i, :n] = torch.tensor(s.tokens)
        attention[i, :n] = 1
        real[i] = 1.0
        # Response token j sits at position p + j and is scored at index p + j - 1 of the shifted tensors.
        span = slice(p - 1, p - 1 + s.response_length)
        old_lp = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        teacher = torch.tensor(s.teacher_logprobs, dtype=torch.float32) if s.teacher_logprobs else None
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        loss_mask[i, span] = mask
        scored[i, span] = True
        old[i, span] = old_lp
        if behaved is not None and behaviour is not None:
            behaved[i, span] = torch.tensor(behaviour[i], dtype=torch.float32)
        if advantages is None:
            adv[i, span] = sample_advantages(s.mode, s.reward, old_lp, teacher, w_rl=w_rl, w_opd=w_opd)
        else:
            adv[i, span] = advantages[i]
        if k and s.topk_token_ids and s.topk_logprobs and topk_ids is not None and topk_lp is not None:
            topk_ids[i, span] = torch.tensor([row[:k] for row in s.topk_token_ids])
            topk_lp[i, span] = torch.tensor([row[:k] for row in s.topk_logprobs], dtype=torch.float32)
            if topk_mask is not None:
                topk_mask[i, span] = mask
    return Collated(
        tokens, attention, loss_mask, old, adv, real, topk_ids, topk_lp, topk_mask, behaved, scored
    )


def check_seams(settings: TrainerConfig) -> None:
    """Load ``trainer.advantages`` and ``trainer.loss_terms`` now: a path that does not load or fit raises
    ``PluginError`` at start-up rather than at the first step."""
    batch_advantages.load(settings)
    loss_terms.resolve(tuple(settings.loss_terms))


def token_logprobs(logits: Tensor, tokens: Tensor, vocab: VocabShard | None = None) -> Tensor:
    """``[B, S, V]`` logits (this rank's vocabulary slice with a ``vocab`` shard), ``[B, S]`` tokens -> ``[B, S - 1]``
    log-prob of each token after the first."""
    return shifted(logits, tokens, with_entropy=False, shard=vocab)[0]


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


def _groups(
    samples: list[Sample], token_budget: int, fixed: bool
) -> list[tuple[list[Sample], dict[str, int]]]:
    """The micro-batches of one rank as (samples in row order, fixed shape). ``fixed`` (pipeline parallel): every
    micro-batch has the same rows and width, as pipeline stages exchange activations of one shape."""
    if not fixed:
        return [(g, {}) for g in micro_batches(samples, token_budget)]
    width = max(len(s.tokens) for s in samples)
    rows = max(1, min(len(samples), token_budget // width))
    ordered = sorted(samples, key=lambda s: len(s.tokens))
    return [(ordered[i : i + rows], {"rows": rows, "width": width}) for i in range(0, len(ordered), rows)]


def plan(
    samples: list[Sample],
    token_budget: int,
    settings: TrainerConfig,
    fixed: bool,
    advantages: dict[int, Tensor] | None = None,
    behaviour: dict[int, list[float]] | None = None,
) -> list[Collated]:
    """The micro-batches of one rank (``_groups``). ``advantages``: by ``id(sample)``, the batch's (default: each
    sample's mode's formula); ``behaviour``: by ``id(sample)``, the rollout log-probs of recomputed samples."""
    out = []
    for group, shape in _groups(samples, token_budget, fixed):
        adv = None if advantages is None else [advantages[id(s)] for s in group]
        behaved = None if behaviour is None else [behaviour[id(s)] for s in group]
        rows, width = shape.get("rows"), shape.get("width")
        out.append(
            collate(
                group,
                settings.w_rl,
                settings.w_opd,
                rows=rows,
                width=width,
                advantages=adv,
                behaviour=behaved,
            )
        )
    return out


def recomputed_logprobs(
    model: Any,
    samples: list[Sample],
    local: list[Sample],
    token_budget: int,
    forward: Forward,
    layout: ParallelLayout,
    vocab: VocabShard | None = None,
) -> list[list[float]]:
    """Each sample's response log-probs under the weights about to be trained (no gradient): pi_old as slime
    computes it by default. Every rank computes its data-parallel share; the last pipeline stages' results are
    gathered so that every rank has the whole batch's (the advantages are formed over the whole batch)."""
    groups = _groups(local, token_budget, layout.pp > 1)
    micro = [collate(g, rows=shape.get("rows"), width=shape.get("width")) for g, shape in groups]
    if torch.cuda.is_available():
        micro = [c.to(torch.device("cuda", torch.cuda.current_device())) for c in micro]
    found: dict[str, list[float]] = {}
    for (group, _), lps in zip(groups, reference_logprobs(model, micro, forward, vocab), strict=False):
        for i, s in enumerate(group):
            p = s.prompt_length
            found[s.sample_id] = lps[i, p - 1 : p - 1 + s.response_length].float().cpu().tolist()
    if layout.distributed:
        import torch.distributed as dist

        shares: list[dict[str, list[float]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(shares, found)
        for share in shares:
            found.update(share or {})
    return [found[s.sample_id] for s in samples]


def micro_loss(
    out: Output,
    c: Collated,
    settings: TrainerConfig,
    total: int,
    topk_total: int,
    ref_logprobs: Tensor | None = None,
    vocab: VocabShard | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the step's loss: the sum of the configured terms (``terms.py``), each a sum of
    per-sample token means divided by the number of samples in the whole (rank-local) batch, so micro-batching
    never changes the update. ``out``: the model's (hidden states and head) or ``[B, S, V]`` logits. Returns the
    loss and detached sums for reporting."""
    topk_ids = c.topk_ids if settings.topk_coef else None
    new, entropy, student = output_figures(out, c, topk_ids, shard=vocab)
    assert entropy is not None  # always reported (no memory: the chunked pass keeps nothing for it)
    x = loss_terms.LossInputs(
        output=out,
        new=new,
        entropy=entropy,
        topk_student=student,
        batch=c,
        settings=settings,
        total=total,
        topk_total=topk_total,
        ref_logprobs=ref_logprobs,
        vocab=vocab,
    )
    loss: Tensor | None = None
    sums: dict[str, Tensor] = {}
    for name, term in loss_terms.resolve(tuple(settings.loss_terms)):
        result = term(x)
        if result is None:
            continue
        coef, value = result
        sums[name] = value.detach()
        if coef:
            part = value if coef == 1.0 else coef * value
            loss = part if loss is None else loss + part
    if loss is None:  # every term off for this micro-batch: a zero that still reaches every parameter
        loss = (new * 0.0).sum()
    sums.update(x.counts)
    sums["tokens"] = c.loss_mask.sum()
    behaviour = c.old_logprobs if c.behaviour_logprobs is None else c.behaviour_logprobs
    sums["kl_rollout"] = x.mean(low_var_kl(new.detach(), behaviour))
    sums["loss"] = loss.detach()
    return loss, sums


def _schedule(
    model: Any,
    micro: list[Collated],
    forward: Forward,
    loss_of: Callable[[int, Collated, Hidden], tuple[Tensor, dict[str, Tensor]]],
    forward_only: bool,
) -> list[dict[str, Tensor]]:
    """Megatron's forward-backward schedule over the micro-batches (pipelined when PP > 1). The schedule divides
    each loss by the number of micro-batches; ``loss_of`` returns shares of a total, so that is undone here. The
    last stage's output reaches ``loss_of`` with the model chunk's output layer (``head.Hidden``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from services.trainer.cpu_shim import cpu_allocations

    n = len(micro)

    def step(data_iterator: Any, chunk: Any) -> tuple[Tensor, Callable[[Tensor], Any]]:
        i = next(data_iterator)
        c = micro[i]
        output = forward(chunk, c.tokens, c.attention_mask)

        def finish(states: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            loss, sums = loss_of(i, c, Hidden(states, output_head(chunk)))
            return loss * n, sums

        return output, finish

    with cpu_allocations():
        stats: list[dict[str, Tensor]] = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(range(n)),
            model=[model],
            num_microbatches=n,
            seq_length=micro[0].tokens.shape[1],
            micro_batch_size=micro[0].tokens.shape[0],
            forward_only=forward_only,
        )
    return stats


def reference_logprobs(
    reference: Any, micro: list[Collated], forward: Forward, vocab: VocabShard | None = None
) -> list[Tensor]:
    """The frozen reference model's log-prob of every token, per micro-batch (on the last pipeline stage; empty
    on the others, which never compute a loss). ``reference`` is a model, or the policy with its LoRA adapters
    off (``lora.AdaptersOff``)."""
    off = isinstance(reference, AdaptersOff)
    model = reference.model if off else reference
    model.eval()
    with torch.no_grad(), disabled(model) if off else contextlib.nullcontext():
        outs = _schedule(
            model,
            micro,
            forward,
            lambda i, c, out: (
                out.states.new_zeros(()),
                {"ref": output_figures(out, c, with_entropy=False, shard=vocab)[0]},
            ),
            forward_only=True,
        )
    return [o["ref"] for o in outs]


_MEANS = ("loss", "pg", "entropy", "kl_rollout", "kl", "topk")
_COUNTS = ("clipped", "tokens", "has_kl", "has_topk")


def _reduce_stats(
    outs: list[dict[str, Tensor]], layout: ParallelLayout, extra: Sequence[str] = ()
) -> dict[str, float]:
    """Sum the last stage's figures over micro-batches, then average over data-parallel ranks (TP ranks hold
    copies); every rank gets the result. ``extra``: the names of plugin loss terms, reported like means."""
    means = _MEANS + tuple(extra)
    keys = means + _COUNTS
    vec = torch.zeros(len(keys), dtype=torch.float64)
    for o in outs:
        for j, key in enumerate(keys):
            if key in o:
                vec[j] += float(o[key])
        vec[keys.index("has_kl")] += 1.0 if "kl" in o else 0.0
        vec[keys.index("has_topk")] += 1.0 if "topk" in o else 0.0
    if layout.distributed:
        import torch.distributed as dist

        device = "cuda" if torch.cuda.is_available() else "cpu"
        moved = vec.to(device)
        dist.all_reduce(moved)
        vec = moved.cpu()
        vec[: len(means)] /= layout.tp * layout.dp
        vec[len(means) :] /= layout.tp
    return dict(zip(keys, vec.tolist(), strict=True))


def _importance(samples: list[Sample], recomputed: list[list[float]], cap: float) -> dict[str, float | None]:
    """Importance weights exp(recomputed - rollout) over the response tokens that train."""
    weights = [
        math.exp(new - old)
        for s, lps in zip(samples, recomputed, strict=True)
        for new, old, m in zip(lps, s.rollout_logprobs, s.loss_mask, strict=True)
        if m
    ]
    if not weights:
        return {"is_weight_mean": None, "is_weight_max": None, "is_truncated": None}
    return {
        "is_weight_mean": sum(weights) / len(weights),
        "is_weight_max": max(weights),
        "is_truncated": sum(w > cap for w in weights) / len(weights),
    }


def _opd_gap(samples: list[Sample]) -> float | None:
    gaps = [
        t - o
        for s in samples
        if s.teacher_logprobs is not None and s.kind in mode_spec(s.mode).teacher_kinds
        for t, o in zip(s.teacher_logprobs, s.rollout_logprobs, strict=True)
    ]
    return sum(gaps) / len(gaps) if gaps else None


def train_step(
    model: Any,
    optimizer: Any,
    samples: list[Sample],
    *,
    forward: Forward,
    settings: TrainerConfig | None = None,
    micro_batch_tokens: int = 8192,
    reference: Any = None,
    layout: ParallelLayout | None = None,
    vocab: VocabShard | None = None,
) -> StepStats:
    """Forward and backward over this rank's micro-batches, then one optimizer step. Every rank is handed the
    whole batch and trains its data-parallel share (``rollout_batch_size`` is a multiple of DP, so shares are
    equal and Megatron's gradient averaging gives the mean over the batch)."""
    from services.trainer.cpu_shim import cpu_allocations

    settings = settings or TrainerConfig()
    layout = layout or ParallelLayout()
    local = sorted(samples, key=lambda s: len(s.tokens))[layout.dp_rank :: layout.dp]
    behaviour: dict[int, list[float]] | None = None
    off_policy: dict[str, float | None] = {
        "is_weight_mean": None,
        "is_weight_max": None,
        "is_truncated": None,
    }
    if settings.old_logprobs != "rollout":
        recomputed = recomputed_logprobs(model, samples, local, micro_batch_tokens, forward, layout, vocab)
        off_policy = _importance(samples, recomputed, settings.is_cap)
        rollout = {s.sample_id: s.rollout_logprobs for s in samples}
        samples = [
            msgspec.structs.replace(s, rollout_logprobs=lp) for s, lp in zip(samples, recomputed, strict=True)
        ]
        local = sorted(samples, key=lambda s: len(s.tokens))[layout.dp_rank :: layout.dp]
        behaviour = {id(s): rollout[s.sample_id] for s in samples}
    advantages = batch_advantages.checked(batch_advantages.load(settings), samples, settings)
    by_sample = {id(s): a for s, a in zip(samples, advantages, strict=True)}
    micro = plan(
        local, micro_batch_tokens, settings, layout.pp > 1, advantages=by_sample, behaviour=behaviour
    )
    if torch.cuda.is_available():
        micro = [c.to(torch.device("cuda", torch.cuda.current_device())) for c in micro]
    total = len(local)
    topk_total = max(1, sum(1 for s in local if s.topk_token_ids))
    refs = reference_logprobs(reference, micro, forward, vocab) if reference is not None else None

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    model.train()
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    optimizer.zero_grad()
    outs = _schedule(
        model,
        micro,
        forward,
        lambda i, c, out: micro_loss(out, c, settings, total, topk_total, refs[i] if refs else None, vocab),
        forward_only=False,
    )
    config = getattr(model, "config", None)
    if getattr(config, "finalize_model_grads_func", None) is None and hasattr(model, "finish_grad_sync"):
        model.finish_grad_sync()
    with cpu_allocations():
        applied, grad_norm, _ = optimizer.step()
    extra = [n for n, _ in loss_terms.resolve(tuple(settings.loss_terms)) if n not in _MEANS]
    figures = _reduce_stats(outs, layout, extra)
    rewards: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        rewards[s.kind].append(s.reward)
    return StepStats(
        loss=figures["loss"],
        pg_loss=figures["pg"],
        clip_fraction=figures["clipped"] / max(figures["tokens"], 1.0),
        entropy=figures["entropy"],
        grad_norm=float(grad_norm or 0.0),
        samples=len(samples),
        tokens=int(figures["tokens"]),
        micro_batches=len(micro),
        reward_mean_by_kind={k: sum(v) / len(v) for k, v in rewards.items()},
        kl_rollout=figures["kl_rollout"],
        kl=figures["kl"] if figures["has_kl"] else None,
        topk_loss=figures["topk"] if figures["has_topk"] else None,
        terms={n: figures[n] for n in extra},
        opd_gap=_opd_gap(samples),
        **off_policy,
        applied=bool(applied),
        gpu_peak_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        advantages={
            s.sample_id: float(a.mean()) if len(a) else 0.0 for s, a in zip(samples, advantages, strict=True)
        },
    )
