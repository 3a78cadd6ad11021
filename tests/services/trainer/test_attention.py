"""``trainer.layer_spec = sdpa`` (torch's ``scaled_dot_product_attention`` in Megatron's local layer, the
runtime image's attention) against Megatron's own local attention: the same logits and the same gradients of
every parameter, with grouped and ungrouped KV heads, Qwen3's q/k norms, padded rows, fp32 and bf16.

Tolerances: fp32, logits within 1e-5 and each parameter's gradient within 1e-4 of its largest entry (both
attentions sum in another order; measured about 1e-6 and 1e-5); bf16, 2e-2 and 5e-2 (bf16 has 8 bits of
mantissa: one rounding is 4e-3 relative)."""

from __future__ import annotations

import warnings

import pytest
import torch

from services.trainer.model import build_model, forward_logits, init_parallel
from tests.services.trainer.test_memory import _tiny

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@pytest.mark.parametrize(
    ("family", "heads", "kv_heads", "dtype"),
    [
        ("llama", 8, 2, torch.float32),
        ("llama", 4, 4, torch.float32),
        ("qwen3", 8, 2, torch.float32),
        ("qwen3", 8, 2, torch.bfloat16),
    ],
)
def test_sdpa_gives_local_attentions_logits_and_gradients(
    family: str, heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    torch.set_num_threads(1)
    init_parallel()
    s = _tiny(family, 2, heads, kv_heads)
    torch.manual_seed(0)
    local = build_model(s, dtype, layer_spec="local")
    sdpa = build_model(s, dtype, layer_spec="sdpa")
    sdpa.load_state_dict(local.state_dict())
    ids = torch.randint(0, 1000, (2, 96), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 70:] = 0  # a right-padded row, as the trainer's micro-batches have
    weights = torch.randn(2, 96, 1000, generator=torch.Generator().manual_seed(2)) * mask[..., None]
    out = {}
    for name, model in (("local", local), ("sdpa", sdpa)):
        logits = forward_logits(model, ids, mask)
        (logits.float() * weights).sum().backward()
        out[name] = (
            logits.detach().float() * mask[..., None],
            {n: p.grad for n, p in model.named_parameters()},
        )
    logits_tol, grad_tol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    assert (out["local"][0] - out["sdpa"][0]).abs().max() <= logits_tol * max(
        1.0, out["local"][0].abs().max()
    )
    for n, g in out["local"][1].items():
        other = out["sdpa"][1][n]
        assert g is not None and other is not None, n
        scale = g.float().abs().max().clamp(min=1e-6)
        assert ((g.float() - other.float()).abs().max() / scale) <= grad_tol, n
