"""The trainer's loss pieces on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import (
    batch_mean,
    entropy_from_logits,
    low_var_kl,
    ppo_clip_loss,
    sample_advantages,
    topk_distillation_loss,
    total_loss,
)

OLD = torch.tensor([-1.0, -2.0, -0.5])
TEACHER = torch.tensor([-0.5, -2.5, -0.5])


def test_advantages_per_mode() -> None:
    assert torch.equal(sample_advantages("rl", -1.0, OLD, TEACHER), torch.tensor([-1.0, -1.0, -1.0]))
    assert torch.equal(sample_advantages("opd", 1.0, OLD, TEACHER), torch.tensor([0.5, -0.5, 0.0]))
    combine = sample_advantages("combine", 1.0, OLD, TEACHER, w_rl=0.5, w_opd=2.0)
    assert torch.allclose(combine, torch.tensor([1.5, -0.5, 0.5]))  # 2 * gap + 0.5 * 1
    with pytest.raises(ValueError, match="mode"):
        sample_advantages("ppo", 1.0, OLD, TEACHER)


def test_combine_rl_only_equals_pure_rl_and_opd_only_equals_pure_opd() -> None:
    rl_only = sample_advantages("combine", -1.0, OLD, OLD.clone())  # dispatcher: teacher = rollout
    assert torch.equal(rl_only, sample_advantages("rl", -1.0, OLD, None))
    missing_teacher = sample_advantages("combine", 1.0, OLD, None)
    assert torch.equal(missing_teacher, sample_advantages("rl", 1.0, OLD, None))
    opd_only = sample_advantages("combine", 0.0, OLD, TEACHER)
    assert torch.equal(opd_only, sample_advantages("opd", 0.0, OLD, TEACHER))


def test_ppo_clip_values_by_hand() -> None:
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.1, 1.5, 0.9, 0.5]))
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0])
    loss, clipped = ppo_clip_loss(new, old, adv)
    # r=1.1, A=2: -2.2; r=1.5 clipped to 1.28: max(-3.0, -2.56) = -2.56; r=0.9, A=-1: 0.9; r=0.5: max(0.5, 0.8)=0.8
    assert torch.allclose(loss, torch.tensor([-2.2, -2.56, 0.9, 0.8]), atol=1e-6)
    assert clipped.tolist() == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("ratio", "adv", "taken"),
    [
        (1.27, 1.0, 0.0),
        (1.29, 1.0, 1.0),
        (0.5, 1.0, 0.0),  # a positive advantage is never clipped from below
        (0.81, -1.0, 0.0),
        (0.79, -1.0, 1.0),
        (2.0, -1.0, 0.0),  # a negative advantage is never clipped from above
    ],
)
def test_clip_engages_only_on_the_right_side(ratio: float, adv: float, taken: float) -> None:
    _, clipped = ppo_clip_loss(torch.tensor([math.log(ratio)]), torch.zeros(1), torch.tensor([adv]))
    assert clipped.item() == taken


def test_gradients_flow_only_through_new_logprobs() -> None:
    new = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = OLD.clone().requires_grad_(True)
    teacher = TEACHER.clone().requires_grad_(True)
    adv = sample_advantages("combine", 1.0, old, teacher)
    loss, _ = ppo_clip_loss(new, old, adv)
    kl = low_var_kl(new, teacher)
    (loss.mean() + kl.mean()).backward()
    assert new.grad is not None and torch.all(new.grad != 0)
    assert old.grad is None and teacher.grad is None
    # At ratio 1 the surrogate's gradient is -A / n per token.
    new2 = OLD.clone().requires_grad_(True)
    loss2, _ = ppo_clip_loss(new2, OLD, torch.tensor([1.0, -2.0, 0.5]))
    loss2.sum().backward()
    assert torch.allclose(new2.grad, torch.tensor([-1.0, 2.0, -0.5]))  # type: ignore[arg-type]


def test_low_var_kl_by_hand_and_clamped() -> None:
    new = torch.tensor([-1.0, -1.0, 0.0, -30.0])
    ref = torch.tensor([-1.0, -2.0, -1.0, 0.0])
    kl = low_var_kl(new, ref)
    # d = ref - new: 0 -> 0; -1 -> e^-1 + 1 - 1 = 0.3679; -1 -> 0.3679; 30 -> huge, clamped to 10
    assert torch.allclose(kl, torch.tensor([0.0, math.exp(-1), math.exp(-1), 10.0]), atol=1e-6)
    assert torch.all(low_var_kl(torch.randn(100), torch.randn(100)) >= 0)


def test_topk_distillation_with_tail_bin() -> None:
    t = torch.log(torch.tensor([[0.5, 0.3]]))  # tail 0.2
    s = torch.log(torch.tensor([[0.25, 0.25]]))  # tail 0.5
    expected = 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(0.25 / 0.3) + 0.5 * math.log(0.5 / 0.2)
    assert torch.allclose(topk_distillation_loss(s, t), torch.tensor([expected]), atol=1e-6)
    assert torch.allclose(topk_distillation_loss(t, t), torch.zeros(1), atol=1e-7)
    # Top-K covering all mass: the tail bin is floored, not NaN.
    full = torch.log(torch.tensor([[0.5, 0.5]]))
    assert torch.isfinite(topk_distillation_loss(full, full)).all()


def test_batch_mean_weights_samples_equally() -> None:
    values = torch.tensor([[1.0, 3.0, 100.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert batch_mean(values, mask).item() == pytest.approx((2.0 + 4.0) / 2)


def test_entropy_and_total_loss() -> None:
    uniform = torch.zeros(2, 4)
    assert torch.allclose(entropy_from_logits(uniform), torch.full((2,), math.log(4)))
    pg, ent, kl = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(0.5)
    assert total_loss(pg, ent, kl, entropy_coef=0.1, kl_coef=0.2).item() == pytest.approx(1.0 - 0.2 + 0.1)
    assert total_loss(pg, ent, kl).item() == 1.0
