"""trainer.advantages and trainer.loss_terms: the defaults reproduce today's formulas exactly; a plugin that fits
changes the step; one that does not is refused, at start-up where it can be and naming the seam where it cannot
(a shape only the data shows)."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import msgspec
import pytest
import torch

from runtime.configuration.config import TrainerConfig
from runtime.configuration.plugins import PluginError
from schemas import Sample
from services.trainer.advantages import by_mode, checked
from services.trainer.step import check_seams, collate, micro_loss
from tests.plugin_contracts import fixtures

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
FIX = "tests.plugin_contracts.fixtures"


def sample(mode: str, kind: str, reward: float, teacher: list[float] | None = None, n: int = 3) -> Sample:
    return Sample(
        sample_id=f"{mode}:{kind}:{reward}:{n}",
        session_id="s",
        mode=mode,
        kind=kind,
        tokens=list(range(1, 4 + n)),
        response_length=n,
        loss_mask=[1] * n,
        rollout_logprobs=[-0.5 - 0.25 * k for k in range(n)],
        reward=reward,
        weight_version=0,
        created_at=time.time(),
        teacher_logprobs=teacher,
    )


BATCH = [
    sample("rl", "rl", 1.0),
    sample("rl", "rl", -1.0, n=2),
    sample("opd", "opd", 0.0, teacher=[-0.1, -0.2, -3.0]),
    sample("combine", "opd+rl", -1.0, teacher=[-0.4, -0.9, -0.1]),
    sample("combine", "rl-only", 1.0, teacher=[-0.5, -0.75, -1.0]),
]


def test_the_default_batch_advantages_equal_each_samples_own_formula() -> None:
    settings = TrainerConfig(w_rl=0.5, w_opd=2.0)
    per_sample = collate(BATCH, settings.w_rl, settings.w_opd)
    batch_level = collate(BATCH, advantages=checked(by_mode, BATCH, settings))
    assert torch.equal(per_sample.advantages, batch_level.advantages)
    # combine: w_opd (teacher - old) + w_rl reward, the response scored from index prompt_length - 1 = 2
    assert per_sample.advantages[3, 2:5].tolist() == pytest.approx(
        [2.0 * 0.1 - 0.5, 2.0 * -0.15 - 0.5, 2.0 * 0.9 - 0.5]
    )


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("one_too_few", r"returned 4 advantages for 5 samples"),
        ("wrong_length", r"sample rl:rl:1\.0:3: advantages of shape \(4,\), expected \(3,\)"),
        ("not_finite", r"sample rl:rl:1\.0:3: advantages are not all finite"),
    ],
)
def test_advantages_of_the_wrong_shape_are_refused_naming_the_seam(name: str, message: str) -> None:
    settings = TrainerConfig(advantages=f"{FIX}:{name}")
    with pytest.raises(PluginError, match=rf"trainer\.advantages \({FIX}:{name}\): {message}"):
        checked(getattr(fixtures, name), BATCH, settings)


def test_seams_that_do_not_load_are_refused_before_the_model_loads() -> None:
    check_seams(TrainerConfig(advantages=f"{FIX}:constant_advantages", loss_terms=["pg", f"{FIX}:off"]))
    with pytest.raises(
        PluginError, match=r"trainer\.advantages: .*samples_only.*calls it with \(samples, settings\)"
    ):
        check_seams(TrainerConfig(advantages=f"{FIX}:samples_only"))
    with pytest.raises(
        PluginError, match=r"trainer\.loss_terms: 'pgx' is neither a built-in term \(pg, entropy, kl, topk\)"
    ):
        check_seams(TrainerConfig(loss_terms=["pgx"]))
    with pytest.raises(
        PluginError, match=r"trainer\.loss_terms: .*term_with_two_args.*calls it with \(inputs\)"
    ):
        check_seams(TrainerConfig(loss_terms=["pg", f"{FIX}:term_with_two_args"]))
    with pytest.raises(PluginError, match=r"two terms share a name"):
        check_seams(TrainerConfig(loss_terms=["pg", f"pg={FIX}:off"]))


def test_a_loss_term_is_added_with_its_coefficient_and_reported_under_its_name() -> None:
    s = sample("rl", "rl", 1.0, n=2)
    s = msgspec.structs.replace(s, rollout_logprobs=[math.log(0.125)] * 2)
    c = collate([s], rows=2, width=s.prompt_length + 2)
    logits = torch.zeros(2, len(s.tokens), 8, requires_grad=True)
    base, base_sums = micro_loss(logits, c, TrainerConfig(), total=1, topk_total=1)
    assert base.item() == pytest.approx(-1.0) and "entropy" in base_sums
    settings = TrainerConfig(
        loss_terms=["pg", "entropy", "kl", "topk", f"{FIX}:response_length_penalty", f"{FIX}:off"]
    )
    loss, sums = micro_loss(logits, c, settings, total=1, topk_total=1)
    mean_logprob = math.log(0.125)  # uniform logits over 8 tokens
    assert sums["response_length_penalty"].item() == pytest.approx(mean_logprob)
    assert "off" not in sums, "a term that does not apply reports nothing"
    assert loss.item() == pytest.approx(-1.0 - 0.1 * mean_logprob)
    only_pg, sums = micro_loss(logits, c, TrainerConfig(loss_terms=["pg"]), total=1, topk_total=1)
    assert "entropy" not in sums and only_pg.item() == pytest.approx(-1.0)


def test_a_step_trains_on_the_plugin_advantages_and_reports_the_plugin_terms(tmp_path: Path) -> None:
    from services.trainer.policy import Policy
    from tests.services.trainer.conftest import save_tiny_llama

    torch.set_num_threads(1)
    model = save_tiny_llama(tmp_path / "tiny")
    batch = [sample("rl", "rl", 0.0, n=3), sample("rl", "rl", 0.0, n=2)]
    zero = Policy.from_hf(model, TrainerConfig(lr=1e-3, weight_decay=0.0, rollout_batch_size=2)).train(batch)
    settings = TrainerConfig(
        lr=1e-3,
        weight_decay=0.0,
        rollout_batch_size=2,
        advantages=f"{FIX}:constant_advantages",
        loss_terms=[
            "pg",
            "entropy",
            f"{FIX}:response_length_penalty",
            f"{FIX}:full_distribution_entropy",
        ],
    )
    moved = Policy.from_hf(model, settings).train(batch)
    assert zero.grad_norm == 0.0, "reward 0 everywhere: the default formula teaches nothing"
    assert moved.grad_norm > 0.0 and moved.pg_loss != zero.pg_loss, "the plugin's advantage 0.5 does"
    assert set(moved.terms) == {"response_length_penalty", "full_distribution_entropy"}
    assert moved.terms["response_length_penalty"] < 0
    # a term may read the whole distribution: its entropy is the built-in one's, computed the chunked way
    assert moved.terms["full_distribution_entropy"] == pytest.approx(moved.entropy, rel=1e-5)


def test_the_top_k_recipe_trains_on_the_distillation_term_alone() -> None:
    s = sample("opd-topk", "opd-topk", 0.0, teacher=[-0.1, -0.2], n=2)
    s = msgspec.structs.replace(
        s, topk_token_ids=[[1, 2], [3, 4]], topk_logprobs=[[-0.3, -2.0], [-0.5, -1.5]]
    )
    c = collate([s])
    logits = torch.randn(1, len(s.tokens), 8, requires_grad=True)
    settings = TrainerConfig(loss_terms=["topk"], topk_coef=1.0)
    loss, sums = micro_loss(logits, c, settings, total=1, topk_total=1)
    assert set(sums) >= {"topk"} and "pg" not in sums and "entropy" not in sums
    assert loss.item() == pytest.approx(sums["topk"].item()) and loss.item() > 0
