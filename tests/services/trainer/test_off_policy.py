"""trainer.old_logprobs: pi_old from the rollout (default), recomputed with the weights about to be trained (slime's
default, OpenClaw-RL's effective behaviour), or decoupled (recomputed for the clip, the rollout policy corrected
by a truncated importance weight). Hand-computed cases, then whole steps on a small Megatron model."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import pytest
import torch

from runtime.configuration.config import TrainerConfig
from schemas import Sample
from services.trainer.loss import ppo_clip_loss, truncated_importance
from services.trainer.step import collate, micro_loss
from tests.services.trainer.conftest import save_tiny_llama

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def sample(
    i: int, reward: float, old: list[float], mode: str = "rl", kind: str = "rl", **kw: object
) -> Sample:
    n = len(old)
    return Sample(
        sample_id=f"t{i}",
        session_id="s",
        mode=mode,
        kind=kind,
        tokens=[1 + (7 * i + k) % 400 for k in range(3 + n)],
        response_length=n,
        loss_mask=[1] * n,
        rollout_logprobs=old,
        reward=reward,
        weight_version=0,
        created_at=time.time(),
        **kw,  # type: ignore[arg-type]
    )


def test_the_truncated_importance_weight_by_hand_and_without_gradient() -> None:
    proximal = torch.tensor([-1.0, -1.0, -3.0], requires_grad=True)
    behaviour = torch.tensor([-1.0, -2.0, -1.0])
    w = truncated_importance(proximal, behaviour, cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, math.exp(-2.0)])  # e^1 = 2.72 is truncated to 2
    assert not w.requires_grad, "a weight, not a path for gradients"


def test_the_decoupled_loss_weights_each_tokens_clipped_term_by_hand() -> None:
    """Uniform logits over 512 tokens: every new log-prob is log 1/512. Old (proximal) log-probs and the rollout's
    (behaviour) are set so that the ratio and the weight are known exactly."""
    lp8 = math.log(1 / 512)
    prox = [lp8, lp8 + 0.5]  # ratio 1 on token 1, e^-0.5 = 0.61 (clipped at 0.8 with A > 0) on token 2
    behaviour = [lp8 - 2.0, lp8 + 0.5]  # weight e^2 = 7.4 -> capped at 2 on token 1; 1 on token 2
    s = sample(1, 1.0, prox)
    c = collate([s], behaviour=[behaviour])
    logits = torch.zeros(1, len(s.tokens), 512, requires_grad=True)
    settings = TrainerConfig(old_logprobs="decoupled", is_cap=2.0)
    loss, sums = micro_loss(logits, c, settings, total=1, topk_total=1)
    r2 = math.exp(-0.5)
    expected = (-1.0 * 1.0 * 2.0 + max(-r2 * 1.0, -0.8 * 1.0) * 1.0) / 2  # token mean, one sample
    assert sums["pg"].item() == pytest.approx(expected, abs=1e-6)
    plain, _ = micro_loss(logits, c, TrainerConfig(old_logprobs="recompute"), total=1, topk_total=1)
    per_token, _ = ppo_clip_loss(torch.full((2,), lp8), torch.tensor(prox), torch.ones(2))
    assert plain.item() == pytest.approx(per_token.mean().item(), abs=1e-6), "recompute: the ratio, no weight"
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-off-policy"))


def test_recompute_trains_with_ratio_one_and_reports_the_importance_weights(tiny: Path) -> None:
    """Rollout log-probs far from the model's (a stale sampler): against them the ratio clips; recomputed, the
    step starts at ratio exactly 1, so the PPO loss is minus the mean advantage and nothing clips."""
    from services.trainer.policy import Policy

    torch.set_num_threads(1)
    batch = [
        sample(0, 1.0, [-9.0, -9.0, -9.0]),
        sample(1, -1.0, [-9.0, -9.0]),
        sample(2, 0.0, [-0.5, -0.5, -0.5], mode="opd", kind="opd", teacher_logprobs=[-1.0, -2.0, -3.0]),
        sample(3, 1.0, [-9.0, -9.0, -9.0, -9.0]),
    ]

    def step(old_logprobs: str) -> object:
        settings = TrainerConfig(
            lr=1e-3, rollout_batch_size=4, old_logprobs=old_logprobs, micro_batch_tokens=16
        )
        return Policy.from_hf(tiny, settings).train(batch)

    rollout, recompute, decoupled = step("rollout"), step("recompute"), step("decoupled")
    assert rollout.clip_fraction > 0 and rollout.is_weight_mean is None
    assert recompute.clip_fraction == 0.0
    # rl samples' advantage is their reward; the opd sample's is teacher - recomputed old (so its mean over
    # tokens is the opd_gap reported): the loss is minus the mean over samples of each one's mean advantage.
    assert recompute.opd_gap is not None and rollout.opd_gap == pytest.approx(-1.5)
    expected = -(1.0 - 1.0 + recompute.opd_gap + 1.0) / 4
    assert recompute.pg_loss == pytest.approx(expected, abs=1e-5)
    assert recompute.is_weight_mean is not None and recompute.is_weight_max is not None
    assert recompute.is_weight_max > 2.0 and recompute.is_truncated == pytest.approx(9 / 12)
    assert decoupled.is_weight_mean == pytest.approx(recompute.is_weight_mean)
    assert decoupled.pg_loss != pytest.approx(recompute.pg_loss), "the truncated weights change the update"
    assert recompute.kl_rollout == pytest.approx(rollout.kl_rollout), "drift is measured from the sampler"
