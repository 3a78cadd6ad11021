"""Training steps with Megatron's DDP and optimizer on the CPU: alignment, micro-batching that does not change the
update, and learning in the direction of the signal (rl rewards, opd teacher). The step's logic is the point, so
the model is SmolLM2 cut to two random layers (its shapes and vocabulary: tests/conftest.py), a fifteenth of the
real one's cost; tests/services/trainer/test_model.py holds the real SmolLM2 to transformers."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from runtime.configuration.config import TrainerConfig
from runtime.engine.chat_template import render_prompt_ids
from schemas import Sample
from services.trainer.step import collate, micro_batches, token_logprobs, train_step

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def sample(
    prompt: list[int],
    response: list[int],
    old: list[float],
    reward: float,
    mode: str = "rl",
    kind: str = "rl",
    teacher: list[float] | None = None,
) -> Sample:
    return Sample(
        sample_id=f"s:{len(prompt)}:{len(response)}:{reward}:{time.monotonic_ns()}",
        session_id="s",
        mode=mode,
        kind=kind,
        tokens=prompt + response,
        response_length=len(response),
        loss_mask=[1] * len(response),
        rollout_logprobs=old,
        reward=reward,
        weight_version=0,
        created_at=time.time(),
        teacher_logprobs=teacher,
    )


def test_collate_aligns_response_tokens_with_their_logits() -> None:
    s1 = sample([5, 6, 7], [8, 9], [-0.5, -0.25], 1.0)
    s2 = sample([5], [6, 7, 8], [-1.0, -2.0, -3.0], -1.0)
    c = collate([s1, s2])
    assert c.tokens.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 8, 0]]
    assert c.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # token 8 of s1 (position 3) is scored by the logits at position 2 -> index 2 of the shifted tensors
    assert c.loss_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert c.old_logprobs[0].tolist() == [0, 0, -0.5, -0.25] and c.advantages[1].tolist() == [-1, -1, -1, 0]
    logits = torch.full((1, 3, 4), -1e9)
    logits[0, 0, 2] = 0.0  # position 0 predicts token 2
    logits[0, 1, 3] = 0.0  # position 1 predicts token 3
    assert token_logprobs(logits, torch.tensor([[1, 2, 3]])).tolist() == [[0.0, 0.0]]


def test_micro_batches_respect_the_token_budget() -> None:
    samples = [sample([1] * n, [2, 3], [-1.0, -1.0], 1.0) for n in (3, 10, 4, 30, 5)]
    groups = micro_batches(samples, 40)
    assert sorted(len(s.tokens) for g in groups for s in g) == sorted(len(s.tokens) for s in samples)
    assert all(len(g) * max(len(s.tokens) for s in g) <= 40 or len(g) == 1 for g in groups)


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture
def policy(small_smollm2: Path) -> Any:
    from services.trainer.policy import Policy

    torch.set_num_threads(1)
    return Policy.from_hf(small_smollm2, TrainerConfig(lr=5e-5))


def encode(tok: Any, question: str, answer: str) -> tuple[list[int], list[int]]:
    prompt = render_prompt_ids(tok, [{"role": "user", "content": question}])
    return prompt, [*list(tok(answer, add_special_tokens=False).input_ids), tok.eos_token_id]


def mean_logprob(policy: Any, prompt: list[int], response: list[int]) -> float:
    with torch.no_grad():
        policy.model.eval()
        ids = torch.tensor([prompt + response])
        lps = token_logprobs(policy.logits(policy.model, ids, torch.ones_like(ids)), ids)[0]
        return lps[len(prompt) - 1 :].mean().item()


def on_policy(policy: Any, prompt: list[int], response: list[int]) -> list[float]:
    with torch.no_grad():
        policy.model.eval()
        ids = torch.tensor([prompt + response])
        lps = token_logprobs(policy.logits(policy.model, ids, torch.ones_like(ids)), ids)[0]
        return lps[len(prompt) - 1 :].tolist()


class Update(msgspec.Struct):
    """One step's gradients as the optimizer got them, and what it then did to the weights (Megatron's names)."""

    grads: dict[str, torch.Tensor]
    delta: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    grad_norm: float
    eps: float
    """Adam's, as the optimizer has it."""


def one_step(model: Path, tok: Any, budget: int, bug: str | None = None) -> Update:
    """A step on two samples with ``budget`` tokens per micro-batch; ``bug``: ``half`` weighs the second
    micro-batch half, ``twice`` runs the optimizer twice (what the criterion below must catch)."""
    from services.trainer import step
    from services.trainer.policy import Policy

    torch.set_num_threads(1)
    policy = Policy.from_hf(model, TrainerConfig(lr=LR))
    params = dict(policy.module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    grads: dict[str, torch.Tensor] = {}
    optimizer_step = policy.optimizer.step

    def captured() -> Any:
        grads.update({n: p.main_grad.detach().clone() for n, p in params.items()})
        if bug == "twice":
            optimizer_step()
        return optimizer_step()

    policy.optimizer.step = captured
    calls = iter(range(1, 100))
    micro_loss = step.micro_loss

    def weighed(*args: Any, **kwargs: Any) -> Any:
        loss, sums = micro_loss(*args, **kwargs)
        return (loss * 0.5 if bug == "half" and next(calls) == 2 else loss), sums

    (p, r), (p2, r2) = (encode(tok, *pair) for pair in PAIRS)
    batch = [sample(p, r, on_policy(policy, p, r), 1.0), sample(p2, r2, on_policy(policy, p2, r2), -1.0)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step, "micro_loss", weighed)
        stats = train_step(
            policy.model, policy.optimizer, batch, forward=policy.forward, micro_batch_tokens=budget
        )
    assert stats.micro_batches == (1 if budget > 1000 else 2)
    delta = {n: p.detach() - before[n] for n, p in params.items()}
    eps = float(policy.optimizer.optimizer.param_groups[0]["eps"])
    return Update(grads, delta, before, stats.grad_norm, eps)


LR, CLIP = 1e-4, TrainerConfig().clip_grad
PAIRS = (
    ("Name a fruit.", "An apple."),
    ("Say something longer, please.", "Here is a somewhat longer answer."),
)


def differs(a: Update, b: Update) -> str | None:
    """Why ``b`` is not the step ``a`` is, by a criterion that holds whatever order a float sum is taken in.

    The gradients first: two orders of accumulation differ by float32 rounding, which is a few units of 6e-8 of
    the terms summed; no element may differ by 1e-4 of its tensor's largest gradient. Then the update: Adam's first
    step moves a weight by lr * g / (|g| + eps) (g clipped to the norm ``clip_grad``) plus the same weight decay in
    both, so where g is near zero a rounding-sized difference in g may flip a whole step; each weight's two updates
    may differ by lr times the difference of that function at its two gradients, and by rounding (1e-6 of lr)."""
    for name, g in a.grads.items():
        scale = g.abs().max().item()
        if (g - b.grads[name]).abs().max().item() > 1e-4 * scale:
            return (
                f"gradient of {name}: {(g - b.grads[name]).abs().max().item():.3g} apart, largest {scale:.3g}"
            )
    for name, da in a.delta.items():
        ga = a.grads[name] * min(1.0, CLIP / (a.grad_norm + 1e-6))
        gb = b.grads[name] * min(1.0, CLIP / (b.grad_norm + 1e-6))
        allowed = LR * ((ga / (ga.abs() + a.eps) - gb / (gb.abs() + b.eps)).abs() + 1e-6)
        allowed += 4 * torch.finfo(torch.float32).eps * a.weights[name].abs()
        if ((da - b.delta[name]).abs() > allowed).any():
            return f"update of {name}: {(da - b.delta[name]).abs().max().item() / LR:.3g} lr apart"
    return None


def test_micro_batching_gives_the_same_update(small_smollm2: Path, tok: Any) -> None:
    """One micro-batch and one per sample make the same step; the criterion tells apart the bugs this test is
    for: the second micro-batch weighed half (its gradient share), and an optimizer step per micro-batch."""
    one = one_step(small_smollm2, tok, 10_000)
    assert differs(one, one_step(small_smollm2, tok, 40)) is None
    assert (half := differs(one, one_step(small_smollm2, tok, 40, bug="half"))) and "gradient" in half
    assert (twice := differs(one, one_step(small_smollm2, tok, 40, bug="twice"))) and "update" in twice


def test_rl_steps_favour_rewarded_responses(policy: Any, tok: Any) -> None:
    q = "Tell me about the weather."
    short = encode(tok, q, "It is sunny.")
    long = encode(
        tok, q, "Well, the weather is something people talk about a lot, and today it is rather mixed."
    )
    before = mean_logprob(policy, *short) - mean_logprob(policy, *long)
    for _ in range(3):
        batch = [
            sample(*short, on_policy(policy, *short), 1.0),
            sample(*long, on_policy(policy, *long), -1.0),
        ]
        stats = train_step(policy.model, policy.optimizer, batch, forward=policy.forward)
        assert stats.applied and stats.grad_norm > 0 and stats.reward_mean_by_kind == {"rl": 0.0}
    after = mean_logprob(policy, *short) - mean_logprob(policy, *long)
    print(f"rl: mean log-prob gap rewarded - penalized {before:.3f} -> {after:.3f} after 3 steps")
    assert after > before + 0.05, (before, after)


def test_opd_steps_move_toward_the_teacher(policy: Any, tok: Any) -> None:
    q = "What is your favourite animal?"
    liked = encode(tok, q, "The owl, for its quiet flight.")
    disliked = encode(tok, q, "I do not have one, I am a program.")
    before = mean_logprob(policy, *liked) - mean_logprob(policy, *disliked)
    for _ in range(3):
        old_l, old_d = on_policy(policy, *liked), on_policy(policy, *disliked)
        batch = [
            sample(*liked, old_l, 0.0, mode="opd", kind="opd", teacher=[0.5 * x for x in old_l]),
            sample(*disliked, old_d, 0.0, mode="opd", kind="opd", teacher=[2.0 * x - 1.0 for x in old_d]),
        ]
        train_step(policy.model, policy.optimizer, batch, forward=policy.forward)
    after = mean_logprob(policy, *liked) - mean_logprob(policy, *disliked)
    print(f"opd: mean log-prob gap teacher-favoured - disfavoured {before:.3f} -> {after:.3f} after 3 steps")
    assert after > before + 0.05, (before, after)


def test_micro_loss_weights_rows_and_adds_the_kl_and_topk_terms() -> None:
    """Hand-checkable: uniform logits over 4 tokens (every log-prob is log 1/4), one real row and one padding row."""
    import math

    from services.trainer.loss import low_var_kl, topk_distillation_loss
    from services.trainer.step import micro_loss

    s = sample([1], [2, 3], [math.log(0.25)] * 2, reward=1.0)
    s = msgspec.structs.replace(
        s, topk_token_ids=[[2, 0], [3, 1]], topk_logprobs=[[-0.2, -2.5], [-0.3, -2.0]]
    )
    c = collate([s], rows=2, width=4)
    assert c.rows.tolist() == [1.0, 0.0] and c.attention_mask[1].tolist() == [1, 0, 0, 0]
    logits = torch.zeros(2, 4, 4, requires_grad=True)
    ref = torch.full((2, 3), math.log(0.5))
    plain, _ = micro_loss(logits, c, TrainerConfig(), total=1, topk_total=1)
    assert plain.item() == pytest.approx(-1.0)  # ratio 1, advantage +1: -1 per token, one sample
    settings = TrainerConfig(kl_coef=0.5, topk_coef=2.0)
    loss, sums = micro_loss(logits, c, settings, total=2, topk_total=1, ref_logprobs=ref)
    kl = low_var_kl(torch.tensor(math.log(0.25)), torch.tensor(math.log(0.5))).item()
    student = torch.full((2,), math.log(0.25))
    distill = (
        sum(topk_distillation_loss(student, torch.tensor(t)).item() for t in ([-0.2, -2.5], [-0.3, -2.0])) / 2
    )
    assert sums["kl"].item() == pytest.approx(
        kl / 2
    )  # the padding row counts for nothing; total is 2 samples
    assert sums["topk"].item() == pytest.approx(distill)  # over the one sample carrying top-K
    assert loss.item() == pytest.approx(-0.5 + 0.5 * kl / 2 + 2.0 * distill)
    loss.backward()
    assert logits.grad is not None and not logits.grad[1].any()  # nothing flows from the padding row


def test_reference_kl_starts_at_zero_and_grows_as_the_policy_moves(small_smollm2: Path, tok: Any) -> None:
    from services.trainer.policy import Policy

    torch.set_num_threads(1)
    policy = Policy.from_hf(small_smollm2, TrainerConfig(lr=1e-4, kl_coef=0.1))
    assert policy.reference is not None and not any(p.requires_grad for p in policy.reference.parameters())
    prompt = render_prompt_ids(tok, [{"role": "user", "content": "Say hi."}])
    batch = [
        sample(prompt, tok.encode(t), [-2.0] * len(tok.encode(t)), r)
        for t, r in (("Hi!", 1.0), ("No.", -1.0))
    ]
    first = policy.train(batch)
    second = policy.train(batch)
    assert first.kl == pytest.approx(0.0, abs=1e-6)  # the policy is the reference before its first update
    assert second.kl is not None and second.kl > 1e-6
    assert first.kl_rollout > 0  # rollout log-probs (-2.0) are not the model's


def _step_keeping(policy: Any, batch: list[Sample]) -> tuple[Any, int]:
    """One step, and the bytes the model's training forward kept for backward (by storage; not what backward's
    recomputation keeps)."""
    kept: dict[int, int] = {}
    counting = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if counting[0]:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def forward(model: Any, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        counting[0] = torch.is_grad_enabled()
        try:
            return policy.forward(model, tokens, mask)  # type: ignore[no-any-return]
        finally:
            counting[0] = False

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = train_step(policy.model, policy.optimizer, batch, forward=forward, settings=policy.settings)
    return stats, sum(kept.values())


@pytest.mark.parametrize("layer_spec", ["local", "sdpa"])
def test_activation_recompute_gives_the_same_step(tiny_llama: Path, layer_spec: str) -> None:
    """``trainer.recompute`` trades compute for memory and nothing else: the same loss, gradient norm and update
    under each setting (the CPU shim's generator states are what the recomputed forward restores), with either
    attention."""
    from services.trainer.policy import Policy

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    batch = [
        sample(
            torch.randint(1, 500, (60,), generator=g).tolist(),
            torch.randint(1, 500, (20 + i,), generator=g).tolist(),
            (-torch.rand(20 + i, generator=g) * 3).tolist(),
            1.0 if i % 2 else -1.0,
        )
        for i in range(4)
    ]
    results, saved = {}, {}
    for recompute in ("none", "selective", "full"):
        settings = TrainerConfig(lr=1e-3, recompute=recompute, entropy_coef=0.01, layer_spec=layer_spec)
        policy = Policy.from_hf(tiny_llama, settings)
        stats, kept = _step_keeping(policy, batch)
        results[recompute], saved[recompute] = (stats, policy.export()), kept
    # what each setting is for: selective drops the attention probabilities, full all but the layers' inputs
    # (sdpa keeps no probabilities: selective recompute only reruns its attention)
    if layer_spec == "local":
        assert saved["none"] > saved["selective"] > saved["full"]
    assert saved["none"] > saved["full"] and saved["selective"] > saved["full"]
    stats_none, weights_none = results["none"]
    assert stats_none.grad_norm > 0
    for recompute in ("selective", "full"):
        stats, weights = results[recompute]
        assert stats.loss == pytest.approx(stats_none.loss, abs=1e-6)
        assert stats.grad_norm == pytest.approx(stats_none.grad_norm, rel=1e-5)
        for k in weights_none:
            torch.testing.assert_close(weights[k], weights_none[k], rtol=0, atol=1e-6)


def test_the_entropy_term_keeps_nothing_for_backward(tiny_llama: Path) -> None:
    """The entropy is reported every step, yet turning its term on adds no saved tensor: the chunked pass keeps
    only the per-position normaliser and entropy, and recomputes the rest in backward (a log-softmax kept for it
    was tokens x vocabulary x 4 bytes: ~17 GB at 8,192 tokens of a 150k vocabulary)."""
    from services.trainer.policy import Policy

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(9)
    batch = [
        sample(
            torch.randint(1, 500, (30,), generator=g).tolist(),
            torch.randint(1, 500, (10,), generator=g).tolist(),
            (-torch.rand(10, generator=g) * 3).tolist(),
            1.0,
        )
        for _ in range(2)
    ]
    kept = {}
    for coef in (0.0, 0.01):
        policy = Policy.from_hf(tiny_llama, TrainerConfig(lr=1e-3, recompute="none", entropy_coef=coef))
        stats, kept[coef] = _step_keeping(policy, batch)
        assert stats.entropy > 0
    assert kept[0.0] == kept[0.01]
