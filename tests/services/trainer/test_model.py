"""The Megatron-core policy against transformers: the same logits from the same weights (SmolLM2's real ones, a
random Qwen3 with q/k norms and untied embeddings), and a bit-exact weight round trip."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.export import hf_stream, local_parameters
from services.trainer.hf_load import load_hf_into
from services.trainer.model import build_model, forward_logits, init_parallel, read_hf_weights
from services.trainer.parallel import ParallelLayout
from services.trainer.spec import ModelSpec

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@pytest.fixture(scope="module", autouse=True)
def megatron() -> None:
    torch.set_num_threads(1)
    init_parallel(None)  # one process: an in-memory store


IDS = torch.tensor([[1, 504, 3458, 314, 260, 1789, 30, 2, 41, 7], [1, 504, 3458, 314, 99, 5, 0, 0, 0, 0]])
MASK = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])


def reference_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def megatron_logits(
    spec: ModelSpec, hf: dict[str, torch.Tensor], layer_spec: str = "local"
) -> tuple[Any, torch.Tensor]:
    """Megatron's local attention by default: the weight mapping is checked against the exact reference."""
    model = build_model(spec, layer_spec=layer_spec).eval()
    load_hf_into(model, spec, hf)
    with torch.no_grad():
        return model, forward_logits(model, IDS, MASK)


def assert_same_logits(ours: torch.Tensor, ref: torch.Tensor, tolerance: float = 1e-5) -> None:
    valid = MASK.bool()
    diff = (ours - ref).abs()[valid]
    assert diff.max().item() <= tolerance, diff.max().item()


def test_smollm2_logits_equal_transformers(smollm2_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = ModelSpec.from_dir(smollm2_path)
    assert (spec.family, spec.num_kv_heads, spec.tie_embeddings, spec.rope_theta) == (
        "llama",
        3,
        True,
        100000.0,
    )
    hf = read_hf_weights(smollm2_path)
    # transformers' eager attention: its SDPA kernel rounds differently (a few 1e-5 over 30 layers).
    ref = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, attn_implementation="eager")
    model, ours = megatron_logits(spec, hf)
    want = reference_logits(ref.eval(), IDS, MASK)
    assert_same_logits(ours, want)
    # The trainer's default attention (torch's flash kernel): other rounding, which depends on how the kernel blocks
    # its sums for the CPU's vector width (4.6e-5 on logits up to 33 on one AMD EPYC): bounded relative to the
    # largest logit, 1e-5 of it, a hundred float32 roundings.
    assert_same_logits(
        megatron_logits(spec, hf, "sdpa")[1], want, 1e-5 * want[MASK.bool()].abs().max().item()
    )
    exported = dict(hf_stream(spec, ParallelLayout(), local_parameters(model), torch.float32))
    assert exported.keys() == hf.keys()
    assert all(torch.equal(exported[k], hf[k]) for k in hf), "export is bit-exact"


def random_qwen3() -> tuple[ModelSpec, Any]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        attn_implementation="eager",
    )
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # norms start at ones: make every one distinct so a swapped mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return ModelSpec.from_hf(config.to_dict()), model


def test_random_qwen3_logits_equal_transformers_and_round_trip() -> None:
    spec, ref = random_qwen3()
    assert (spec.family, spec.tie_embeddings, spec.rope_theta) == ("qwen3", False, 1_000_000.0)
    hf = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    model, ours = megatron_logits(spec, hf)
    assert_same_logits(ours, reference_logits(ref, IDS, MASK))
    exported = dict(hf_stream(spec, ParallelLayout(), local_parameters(model), torch.float32))
    assert exported.keys() == hf.keys() and all(torch.equal(exported[k], hf[k]) for k in hf)
    again = build_model(spec)
    load_hf_into(again, spec, exported)
    a = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    b = {k: v for k, v in again.state_dict().items() if not k.endswith("_extra_state")}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "re-import is bit-exact"


def test_padding_does_not_change_the_valid_positions() -> None:
    spec, ref = random_qwen3()
    for layer_spec in ("local", "sdpa"):  # the padding mask, or causal attention alone
        weights = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        model, padded = megatron_logits(spec, weights, layer_spec)
        with torch.no_grad():
            alone = forward_logits(model, IDS[1:, :6])
        assert torch.allclose(padded[1, :6], alone[0], atol=1e-6), layer_spec


def test_unsupported_configs_are_refused() -> None:
    base = {"num_attention_heads": 4, "hidden_size": 64, "vocab_size": 10, "num_hidden_layers": 1}
    base |= {"intermediate_size": 8}
    with pytest.raises(ValueError, match="not supported"):
        ModelSpec.from_hf({**base, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})
    with pytest.raises(ValueError, match="RoPE type"):
        ModelSpec.from_hf(
            {**base, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        )
    spec = ModelSpec.from_hf({**base, "model_type": "llama", "rope_theta": 5e5})
    assert spec.rope_theta == 5e5 and spec.num_kv_heads == 4 and spec.head_dim == 16
    with pytest.raises(ValueError, match="mapping mismatch"):
        load_hf_into(build_model(spec), spec, {})
