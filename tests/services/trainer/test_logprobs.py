"""The chunked per-token figures equal the log-softmax they replace, in value and in gradient."""

from __future__ import annotations

import pytest
import torch

from services.trainer.logprobs import shifted, token_figures


def _reference(logits: torch.Tensor, targets: torch.Tensor, topk: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logp = torch.log_softmax(logits.float(), dim=-1)
    token = logp.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token, entropy, logp.gather(-1, topk)


def _case(dtype: torch.dtype, vocab_cut: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(3, 7, 53, generator=g) * 4).to(dtype)
    logits = (
        full[..., :50] if vocab_cut else full
    )  # tensor parallelism pads the vocabulary; the model cuts it
    targets = torch.randint(0, 50, (3, 7), generator=g)
    topk = torch.randint(0, 50, (3, 7, 4), generator=g)
    return logits, targets, topk


@pytest.mark.parametrize("chunk", [1, 5, 1024])
@pytest.mark.parametrize("vocab_cut", [False, True])
def test_values_and_gradients_match_the_log_softmax(chunk: int, vocab_cut: bool) -> None:
    logits, targets, topk = _case(torch.float32, vocab_cut)
    weights = [torch.randn(3, 7), torch.randn(3, 7), torch.randn(3, 7, 4)]

    ours = logits.detach().clone().requires_grad_(True)
    got = token_figures(ours, targets, topk, chunk=chunk)
    sum(w.mul(x).sum() for w, x in zip(weights, got, strict=True) if x is not None).backward()

    ref = logits.detach().clone().requires_grad_(True)
    want = _reference(ref, targets, topk)
    sum(w.mul(x).sum() for w, x in zip(weights, want, strict=True)).backward()

    for g, w in zip(got, want, strict=True):
        assert g is not None
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert ours.grad is not None and ref.grad is not None
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-5, atol=1e-5)


def test_each_output_alone_gets_only_its_own_gradient() -> None:
    """An output no term uses contributes nothing (the entropy with a zero coefficient)."""
    logits, targets, topk = _case(torch.float32, False)
    for which in range(3):
        ours = logits.detach().clone().requires_grad_(True)
        out = token_figures(ours, targets, topk, chunk=4)[which]
        assert out is not None
        out.sum().backward()
        ref = logits.detach().clone().requires_grad_(True)
        _reference(ref, targets, topk)[which].sum().backward()
        assert ours.grad is not None and ref.grad is not None
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-5, atol=1e-5)


def test_bf16_logits_give_float32_figures_and_a_bf16_gradient() -> None:
    logits, targets, topk = _case(torch.bfloat16, False)
    ours = logits.detach().clone().requires_grad_(True)
    token, entropy, student = token_figures(ours, targets, topk, chunk=4)
    assert entropy is not None and student is not None
    assert token.dtype == entropy.dtype == torch.float32
    token.sum().backward()
    assert ours.grad is not None and ours.grad.dtype == torch.bfloat16
    ref = logits.detach().clone().requires_grad_(True)
    _reference(ref, targets, topk)[0].sum().backward()
    assert ref.grad is not None
    torch.testing.assert_close(ours.grad.float(), ref.grad.float(), rtol=2e-2, atol=2e-2)


def test_without_the_entropy_the_log_probs_and_their_gradient_are_the_same() -> None:
    """The no-grad forwards (reference, recomputed pi_old) skip the entropy's pass over each chunk."""
    logits, targets, topk = _case(torch.float32, False)
    grads = []
    for with_entropy in (True, False):
        x = logits.detach().clone().requires_grad_(True)
        token, entropy, student = token_figures(x, targets, topk, chunk=4, with_entropy=with_entropy)
        assert (entropy is None) == (not with_entropy) and student is not None
        (token.sum() + student.sum()).backward()
        grads.append((token.detach(), x.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)


def test_shifted_scores_each_token_from_the_position_before_it() -> None:
    logits, tokens, _ = _case(torch.float32, False)
    topk = torch.randint(0, 50, (3, 6, 2))
    token, entropy, student = shifted(logits, tokens, topk)
    want = _reference(logits[:, :-1], tokens[:, 1:], topk)
    assert entropy is not None and student is not None
    assert token.shape == entropy.shape == (3, 6) and student.shape == (3, 6, 2)
    torch.testing.assert_close(token, want[0])
    torch.testing.assert_close(entropy, want[1])
    torch.testing.assert_close(student, want[2])


def test_the_loss_keeps_no_vocabulary_sized_tensor_for_backward() -> None:
    """Every built-in term on (pg, entropy with a coefficient, top-K): backward needs the logits and per-position
    figures, nothing of the logits' size besides them (a log-softmax kept for backward was 1.6 GB at 8,192
    tokens of a 49k vocabulary)."""
    import time

    from runtime.configuration.config import TrainerConfig
    from schemas import Sample
    from services.trainer.step import collate, micro_loss

    g = torch.Generator().manual_seed(0)
    vocab, n = 4000, 40
    samples = [
        Sample(
            sample_id=f"m:{i}",
            session_id="m",
            mode="opd-topk",
            kind="opd-topk",
            tokens=torch.randint(0, vocab, (10 + n,), generator=g).tolist(),
            response_length=n,
            loss_mask=[1] * n,
            rollout_logprobs=[-1.0] * n,
            reward=0.0,
            weight_version=0,
            created_at=time.time(),
            teacher_logprobs=[-0.5] * n,
            topk_token_ids=torch.randint(0, vocab, (n, 8), generator=g).tolist(),
            topk_logprobs=[[-0.1 * (k + 1) for k in range(8)]] * n,
        )
        for i in range(3)
    ]
    c = collate(samples)
    logits = torch.randn(3, 10 + n, vocab, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    settings = TrainerConfig(entropy_coef=0.01, topk_coef=1.0, loss_terms=["pg", "entropy", "topk"])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, sums = micro_loss(logits, c, settings, total=3, topk_total=3)
    assert {"pg", "entropy", "topk"} <= set(sums)
    others = sum(b for ptr, b in kept.items() if ptr != logits.untyped_storage().data_ptr())
    assert others < 0.05 * logits.untyped_storage().nbytes(), (others, logits.untyped_storage().nbytes())
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
