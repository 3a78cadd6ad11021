"""A sample longer than the trainer is planned for (``lengths.py``): cut at its prompt's head with its response,
log-probs and masks aligned, or dropped; and an agent-length sample through a real Megatron-core step."""

from __future__ import annotations

import warnings
from pathlib import Path

import msgspec
import torch

from runtime.configuration.config import TrainerConfig
from services.trainer.lengths import fit_length
from tests.samples import random_rl_samples

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def test_truncation_keeps_the_response_and_its_figures_aligned() -> None:
    s = random_rl_samples(1, seed=1, prompt=20, response=6)[0]
    s = msgspec.structs.replace(
        s, rollout_logprobs=[-float(i) for i in range(6)], loss_mask=[1, 0, 1, 1, 1, 0]
    )
    assert fit_length(s, 26, "truncate") is s  # fits: unchanged
    cut = fit_length(s, 10, "truncate")
    assert cut is not None and len(cut.tokens) == 10 and cut.prompt_length == 4
    assert cut.tokens[-6:] == s.tokens[-6:] and cut.tokens[:4] == s.tokens[16:20]
    assert (cut.rollout_logprobs, cut.loss_mask, cut.response_length) == (
        s.rollout_logprobs,
        s.loss_mask,
        s.response_length,
    )
    assert fit_length(s, 7, "truncate") is not None  # one prompt token left
    assert fit_length(s, 6, "truncate") is None  # the response alone: nothing to score its first token from
    assert fit_length(s, 10, "drop") is None


def test_an_agent_length_sample_trains_in_one_step_with_memory_linear_in_its_length(tmp_path: Path) -> None:
    """A 4,096-token sample (SmolLM2's architecture, small) over a 512-token micro-batch budget: one micro-batch
    of its own, through Megatron's schedule, Adam and all; with torch's flash kernel the step's saved tensors
    hold nothing sequence x sequence (local attention's probabilities alone would be 4 heads x 4,096^2 x 4 bytes
    = 256 MiB per layer)."""
    from services.trainer.policy import Policy
    from tests.services.trainer.conftest import save_tiny_llama
    from tests.services.trainer.test_step import _step_keeping

    model = save_tiny_llama(tmp_path / "model", max_positions=8192)

    torch.set_num_threads(1)
    long = random_rl_samples(1, seed=4, prompt=4000, response=96)[0]
    policy = Policy.from_hf(model, TrainerConfig(lr=1e-3, micro_batch_tokens=512, recompute="none"))
    stats, kept = _step_keeping(policy, [long])
    assert stats.applied and stats.micro_batches == 1 and stats.tokens == 96 and stats.grad_norm > 0
    spec = policy.spec
    probs_per_layer = spec.num_heads * 4096 * 4096 * 4
    assert kept < probs_per_layer, (kept, probs_per_layer)
