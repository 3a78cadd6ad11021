"""LoRA in the trainer on the real Megatron-core GPTModel (CPU, one process): the adapters start as the identity,
a step moves only them, the optimizer holds only them, and a published version is exactly what PEFT loads onto
the Hugging Face base model (or, merged, what Hugging Face loads alone)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.configuration.config import LORA_TARGETS, LoraConfig, TrainerConfig
from schemas import Sample
from services.trainer.checkpoints import TrainerStore
from tests.samples import random_rl_samples

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

SUBSET = ["q_proj", "v_proj", "up_proj", "down_proj"]  # leaves a fused part (k, gate) without an adapter


def settings(targets: list[str] | None = None, publish: str = "adapter", **over: Any) -> TrainerConfig:
    lora = LoraConfig(
        enabled=True, rank=4, alpha=8.0, target_modules=targets or list(LORA_TARGETS), publish=publish
    )
    return TrainerConfig(lr=1e-2, rollout_batch_size=4, precision="fp32", lora=lora, **over)


def batch(n: int = 4) -> list[Sample]:
    return random_rl_samples(n, seed=3)


TOKENS = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 8], [9, 2, 301, 44, 6, 0, 0, 0]])
MASK = (TOKENS != 0).long()


def logits(policy: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = policy.logits(policy.model, TOKENS, MASK)
    # the tokens' positions: what padding positions compute is never read (the trainer's attention is causal)
    return out[..., : policy.spec.vocab_size].float() * MASK[..., None]


def test_adapters_at_init_change_nothing(tiny_llama: Path) -> None:
    from services.trainer.lora import adapter_state
    from services.trainer.policy import Policy

    base = Policy.from_hf(tiny_llama, TrainerConfig(precision="fp32"))
    lora = Policy.from_hf(tiny_llama, settings())
    state = adapter_state(lora.module)
    assert len(state) == 2 * 7 * base.spec.num_layers  # A and B for each of the seven projections per layer
    assert all(t.abs().sum() > 0 for k, t in state.items() if k.endswith(".A"))  # A is drawn ...
    assert all(t.abs().sum() == 0 for k, t in state.items() if k.endswith(".B"))  # ... B starts at zero
    assert torch.equal(logits(lora), logits(base))  # exactly, not approximately


def test_a_step_moves_only_the_adapters_and_the_optimizer_holds_only_them(tiny_llama: Path) -> None:
    from services.trainer.lora import adapter_state, is_adapter_name
    from services.trainer.policy import Policy

    policy = Policy.from_hf(tiny_llama, settings())
    before = {
        k: v.detach().clone() for k, v in policy.module.state_dict().items() if not k.endswith("_extra_state")
    }
    stats = policy.train(batch())
    assert stats.grad_norm > 0
    after = policy.module.state_dict()
    for name, old in before.items():
        if is_adapter_name(name):
            continue
        assert torch.equal(after[name], old), f"frozen base weight {name} changed"
    moved = [k for k, t in adapter_state(policy.module).items() if not torch.equal(t, before[k])]
    assert {k for k in moved if k.endswith(".B")} == {
        k for k in before if is_adapter_name(k) and k.endswith(".B")
    }
    trainable = sum(p.numel() for p in policy.module.parameters() if p.requires_grad)
    assert trainable == sum(t.numel() for t in adapter_state(policy.module).values())
    held = sum(p.numel() for group in policy.optimizer.param_groups for p in group["params"])
    assert held == trainable  # Adam's state exists for the adapters only
    assert held < sum(p.numel() for p in policy.module.parameters()) / 10


def _hf_logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=TOKENS, attention_mask=MASK).logits
    return out.float() * MASK[..., None]


@pytest.mark.parametrize("targets", [None, SUBSET], ids=["all", "subset"])
def test_a_published_adapter_is_what_peft_loads(
    tiny_llama: Path, tmp_path: Path, targets: list[str] | None
) -> None:
    """Two steps (B far from zero), then the version as the trainer publishes it: PEFT's ``PeftModel`` on the
    Hugging Face base gives the trainer's logits; so does the merged version loaded alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from services.trainer.policy import Policy

    policy = Policy.from_hf(tiny_llama, settings(targets))
    for _ in range(2):
        policy.train(batch())
    want = logits(policy)
    store = TrainerStore(tmp_path / "weights")
    path, _ = store.write_version(1, policy.entries(), policy.hf_stream(), tiny_llama, policy.version_files())
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert set(config["target_modules"]) == set(targets or LORA_TARGETS)

    base = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    plain = _hf_logits(base)
    peft_model = PeftModel.from_pretrained(base, str(path))
    got = _hf_logits(peft_model)
    assert (want - plain).abs().max() > 1e-3  # the adapter matters: matching it is not matching the base
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    policy.config.lora.publish = "merged"
    merged_path, _ = store.write_version(
        2, policy.entries(), policy.hf_stream(), tiny_llama, policy.version_files()
    )
    assert (merged_path / "model.safetensors").exists() and (merged_path / "config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_path, torch_dtype=torch.float32)
    torch.testing.assert_close(_hf_logits(merged), want, atol=1e-5, rtol=0)


def test_lora_state_resumes_exactly_and_refuses_other_adapters(tiny_llama: Path) -> None:
    """The checkpoint's model part is the adapters alone; restored into a fresh policy, the next step is the
    running policy's, bit for bit."""
    import io

    from services.trainer.lora import adapter_state
    from services.trainer.policy import Policy

    policy = Policy.from_hf(tiny_llama, settings())
    policy.train(batch())
    model_state, optimizer_state = policy.state()
    assert set(model_state) == set(adapter_state(policy.module))
    buffer = io.BytesIO()
    torch.save({"model": model_state, "optimizer": optimizer_state}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    policy.train(batch())
    resumed = Policy.from_hf(tiny_llama, settings())
    resumed.load_state(saved)
    resumed.train(batch())
    for name, t in adapter_state(policy.module).items():
        assert torch.equal(adapter_state(resumed.module)[name], t), name
    other = Policy.from_hf(tiny_llama, settings(SUBSET))
    with pytest.raises(ValueError, match="differ from the configured ones"):
        other.load_state(saved)


def test_under_a_fused_norm_and_linear_the_adapter_reads_the_normalised_input(tiny_llama: Path) -> None:
    """Transformer Engine's layers (GPUs) fuse the norm into linear_qkv and linear_fc1: their input is the
    un-normalised hidden state, and the adapter must see what the linear sees, as PEFT's does on the Hugging Face
    model. A stand-in with TE's ``layer_norm_weight`` checks the hook's arithmetic on the CPU."""
    import torch.nn.functional as F

    from services.trainer.lora import Adapter, Pair, _hook
    from services.trainer.spec import ModelSpec

    spec = ModelSpec.from_dir(tiny_llama)
    h, f, r = spec.hidden_size, spec.ffn_hidden_size, 4
    g = torch.Generator().manual_seed(1)

    class FusedNormLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(2 * f, h, generator=g))
            self.layer_norm_weight = torch.nn.Parameter(torch.rand(h, generator=g) + 0.5)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            return F.rms_norm(x, (h,), self.layer_norm_weight, spec.rms_eps) @ self.weight.t(), None

    layer = FusedNormLinear()
    pairs = {
        p: Pair(torch.randn(r, h, generator=g), torch.randn(f, r, generator=g))
        for p in ("gate_proj", "up_proj")
    }
    config = LoraConfig(enabled=True, rank=r, alpha=8.0)
    layer.lora = Adapter(
        "column", ("gate_proj", "up_proj"), pairs, {"gate_proj": f, "up_proj": f}, config, spec, 1
    )
    layer.register_forward_hook(_hook)
    x = torch.randn(3, 2, h, generator=g) * 5
    normed = F.rms_norm(x, (h,), layer.layer_norm_weight, spec.rms_eps)
    delta = torch.cat([normed @ pairs[p].A.t() @ pairs[p].B.t() for p in ("gate_proj", "up_proj")], dim=-1)
    with torch.no_grad():
        got, _ = layer(x)
        torch.testing.assert_close(got, normed @ layer.weight.t() + 2.0 * delta)


def test_the_kl_reference_under_lora_is_the_base_with_adapters_off(tiny_llama: Path) -> None:
    """No second model for the KL term: the policy with its adapters off is the starting policy. Its steps equal,
    bit for bit, those against a separately loaded copy (``reference_checkpoint``), which the memory plan counts
    and the view does not."""
    from services.trainer.lora import AdaptersOff, disabled
    from services.trainer.memory import for_trainer
    from services.trainer.policy import Policy

    view = Policy.from_hf(tiny_llama, settings(kl_coef=0.5))
    copy = Policy.from_hf(tiny_llama, settings(kl_coef=0.5, reference_checkpoint=str(tiny_llama)))
    assert isinstance(view.reference, AdaptersOff) and view.reference.model is view.module
    assert not isinstance(copy.reference, AdaptersOff)
    first, second = view.train(batch()), view.train(batch())
    assert first.kl == 0.0  # B starts at zero: the policy is its reference
    assert second.kl is not None and second.kl > 1e-6
    for want, got in zip((first, second), (copy.train(batch()), copy.train(batch())), strict=True):
        assert (got.kl, got.loss, got.grad_norm) == (want.kl, want.loss, want.grad_norm)
    base = Policy.from_hf(tiny_llama, TrainerConfig(precision="fp32"))
    with disabled(view.module):
        assert torch.equal(logits(view), logits(base))
    assert not torch.equal(logits(view), logits(base))  # the adapters are back on after the reference's pass

    def planned(config: TrainerConfig) -> bool:
        return for_trainer(config, tp=1, pp=1, dp=1, dtype_bytes=4, recompute="full").reference

    assert (planned(view.config), planned(copy.config)) == (False, True)
