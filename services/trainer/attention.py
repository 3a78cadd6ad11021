"""Attention whose memory grows linearly with the sequence, for the image without Transformer Engine.

Megatron-core's local ``DotProductAttention`` multiplies every query by every key into a ``[b, heads, s, s]``
score matrix (a persistent buffer of that size too) and keeps the probabilities for backward: 8 GiB per layer at
8,192 tokens of Qwen3-4B and 32 GiB at 16,384, which an agent's first turn reaches. ``SdpaAttention`` is the same
module with its product done by torch's ``scaled_dot_product_attention``: flash or memory-efficient kernels on a
GPU and the flash kernel on the CPU, which keep q, k, v, the output and one log-sum-exp per head and position.

It is causal by construction and ignores the mask it is handed: the trainer's micro-batches are right-padded
(``step.collate``), so under a causal mask every real position attends only to real positions, exactly as with
the padding mask; what padding positions compute is never read (their loss mask is 0). The forward therefore
passes no ``[b, 1, s, s]`` mask at all (``model.forward_hidden``).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

LINEAR_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
"""On a GPU only the kernels whose memory is linear in the sequence: where none takes the inputs, the step
fails at once instead of torch falling back to the math kernel's ``s x s`` matrix and running out of memory."""
CPU_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


class SdpaAttention(DotProductAttention):  # type: ignore[misc]
    """Megatron's core attention (same constructor, same ``[s, b, heads x head_dim]`` output) on
    ``scaled_dot_product_attention``."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        assert packed_seq_params is None and attention_bias is None, "not used by the trainer"
        s, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if (
            repeat > 1
        ):  # GQA: every kernel takes equal head counts; enable_gqa would fall back to the math one
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        with sdpa_kernel(LINEAR_KERNELS if q.is_cuda else CPU_KERNELS):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


def sdpa_layer_spec(qk_layernorm: bool) -> Any:
    """Megatron-core's local layer spec with ``SdpaAttention`` as its core attention: every parameter is the
    local spec's (same names, same Hugging Face mapping)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec
