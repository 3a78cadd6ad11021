"""The policy as a Megatron-core ``GPTModel``, built from a Hugging Face ``config.json``, with weights mapped
exactly from and to Hugging Face safetensors.

Families: Llama (SmolLM2, Llama 3; tied or untied embeddings) and Qwen3 dense (RMSNorm on q and k per head).
Megatron fuses what Hugging Face keeps apart: ``linear_qkv`` holds, per KV group, that group's query heads, then
its key head, then its value head; ``linear_fc1`` holds the gate projection above the up projection (SwiGLU takes
``silu(first half) * second half``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from services.trainer.spec import ModelSpec

if TYPE_CHECKING:
    from services.trainer.parallel import ParallelLayout


def init_parallel(
    layout: ParallelLayout | None = None, seed: int = 1234, timeout_s: float = 600.0
) -> ParallelLayout:
    """The process group (NCCL on GPUs, gloo on the CPU; ``timeout_s`` for its collectives), the control group
    (``collective.py``), Megatron's TP/PP groups and the model-parallel RNG. Idempotent. Without a layout: world
    size 1, enough for a GPTModel in one CPU process."""
    from datetime import timedelta

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from services.trainer.collective import init_control
    from services.trainer.cpu_shim import apply_cpu_shim
    from services.trainer.parallel import ParallelLayout

    layout = layout or ParallelLayout()
    cpu = apply_cpu_shim()
    if not dist.is_initialized():
        if not cpu:
            torch.cuda.set_device(layout.local_rank)
        backend = "gloo" if cpu else "nccl"
        timeout = timedelta(seconds=timeout_s)
        if layout.distributed:  # torchrun's rendezvous (MASTER_ADDR, MASTER_PORT)
            dist.init_process_group(backend, rank=layout.rank, world_size=layout.world_size, timeout=timeout)
        else:  # one process: an in-memory store, no port to pick or race for
            # torch's stubs do not re-export HashStore from torch.distributed, where it is documented.
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        init_control()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(layout.tp, layout.pp)
    if cpu:
        tracker = mrandom.get_cuda_rng_tracker()
        if mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME not in tracker.get_states():
            tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed)
    else:
        mrandom.model_parallel_cuda_manual_seed(seed)
    return layout


def shutdown_parallel(layout: ParallelLayout) -> None:
    """Take the process group down before a torchrun rank exits. A rank that exits with gloo's threads still
    alive can abort ("terminate called without an active exception", SIGABRT) and torchrun then fails the whole
    run, though the work was done. One process keeps its group: tests run many policies in one interpreter."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from services.trainer.collective import barrier, drop_control

    if not layout.distributed or not dist.is_initialized():
        return
    barrier(layout)  # no rank tears down while another still talks to it
    parallel_state.destroy_model_parallel()
    drop_control()
    dist.destroy_process_group()


def mark_tensor_parallel(model: Any) -> None:
    """Mark each tensor-parallel weight as Megatron's initialisation does (which ``perform_initialization=False``
    skips along with the random draw): unmarked, the gradient norm and the distributed optimizer would treat the
    shards as replicas. Column-parallel and vocab rows split on dim 0 (the fused SwiGLU ``linear_fc1`` with
    stride 2, as Megatron's MLP declares it), row-parallel on dim 1."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            set_tensor_model_parallel_attributes(weight, True, 0, 2 if name.endswith("linear_fc1") else 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)


def recompute_for(setting: str) -> str:
    """``trainer.recompute`` with ``auto`` resolved on this machine (``memory.resolve_recompute``)."""
    from services.trainer.memory import resolve_recompute

    return resolve_recompute(setting, cuda=torch.cuda.is_available())


def layer_spec_for(setting: str) -> str:
    """``trainer.layer_spec`` with ``auto`` resolved on this machine (``memory.resolve_layer_spec``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from services.trainer.memory import resolve_layer_spec

    usable = bool(getattr(gpt_layer_specs, "HAVE_TE", False)) and torch.cuda.is_available()
    return resolve_layer_spec(setting, te_usable=usable)


def build_model(
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    layout: ParallelLayout | None = None,
    recompute: str = "none",
    initialise: bool = True,
    layer_spec: str = "auto",
) -> Any:
    """This rank's part of the GPTModel: its pipeline stage's layers, its tensor-parallel slices. Logits stay
    split over the vocabulary (``parallel_output``): the loss reduces over the tensor-parallel group instead of
    gathering a whole-vocabulary row per token on every rank (``logprobs.VocabShard``).
    ``recompute``: ``trainer.recompute`` (``full``: every layer's activations recomputed in backward, one layer
    per checkpoint). ``layer_spec``: ``trainer.layer_spec``. ``initialise=False``: parameters allocated, not drawn
    (weights are loaded next), and on a GPU allocated there directly."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from services.trainer.cpu_shim import cpu_allocations
    from services.trainer.parallel import ParallelLayout
    from services.trainer.spec import padded_vocab

    layout = layout or ParallelLayout()
    granularity = recompute_for(recompute)
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=spec.family == "qwen3",
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=initialise or not torch.cuda.is_available(),
        perform_initialization=initialise,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        pipeline_dtype=dtype,
        recompute_granularity=None if granularity == "none" else granularity,
        recompute_method="uniform" if granularity == "full" else None,
        recompute_num_layers=1 if granularity == "full" else None,
    )
    attention = layer_spec_for(layer_spec)
    if attention == "te":  # fused attention and norm+linear; names: local_spec_name
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        layers = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.family == "qwen3")
    elif attention == "sdpa":  # the local layer, attention linear in the sequence (attention.py)
        from services.trainer.attention import sdpa_layer_spec

        layers = sdpa_layer_spec(qk_layernorm=spec.family == "qwen3")
    else:
        layers = get_gpt_layer_local_spec(qk_layernorm=spec.family == "qwen3", normalization="RMSNorm")
    with cpu_allocations():  # tied embeddings under PP: Megatron moves the shared copy with .cuda()
        model = GPTModel(
            config,
            layers,
            vocab_size=padded_vocab(spec.vocab_size, layout.tp),
            max_sequence_length=spec.max_position,
            pre_process=layout.first_stage,
            post_process=layout.last_stage,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta),
        )
    if not initialise:
        mark_tensor_parallel(model)
    model.turnstream_mask_free = attention == "sdpa"  # causal by construction: no [b, 1, s, s] mask to build
    return model


def hf_to_megatron(spec: ModelSpec, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face tensors -> the GPTModel's state dict names and layouts."""
    nq, nkv, hd, h = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    out: dict[str, Tensor] = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(spec.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hf[src + "self_attn.q_proj.weight"].view(nkv, (nq // nkv) * hd, h)
        k = hf[src + "self_attn.k_proj.weight"].view(nkv, hd, h)
        v = hf[src + "self_attn.v_proj.weight"].view(nkv, hd, h)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        out[dst + "self_attention.linear_proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0
        )
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
        if spec.family == "qwen3":
            out[dst + "self_attention.q_layernorm.weight"] = hf[src + "self_attn.q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[src + "self_attn.k_norm.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not spec.tie_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(spec: ModelSpec, mc: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of ``hf_to_megatron`` (contiguous tensors, ready for safetensors), in ``hf_entries``' order.
    ``mc`` may hold part of the model (``export.py`` converts one layer at a time): what it holds is converted."""
    nq, nkv, hd, h = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    r = nq // nkv
    out: dict[str, Tensor] = {}
    if "embedding.word_embeddings.weight" in mc:
        out["model.embed_tokens.weight"] = mc["embedding.word_embeddings.weight"]
    for i in range(spec.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        if src + "self_attention.linear_qkv.weight" not in mc:
            continue
        qkv = mc[src + "self_attention.linear_qkv.weight"].view(nkv, (r + 2) * hd, h)
        q, k, v = torch.split(qkv, [r * hd, hd, hd], dim=1)
        out[dst + "self_attn.q_proj.weight"] = q.reshape(nq * hd, h)
        out[dst + "self_attn.k_proj.weight"] = k.reshape(nkv * hd, h)
        out[dst + "self_attn.v_proj.weight"] = v.reshape(nkv * hd, h)
        out[dst + "self_attn.o_proj.weight"] = mc[src + "self_attention.linear_proj.weight"]
        out[dst + "input_layernorm.weight"] = mc[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = mc[src + "pre_mlp_layernorm.weight"]
        gate, up = torch.chunk(mc[src + "mlp.linear_fc1.weight"], 2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
        out[dst + "mlp.down_proj.weight"] = mc[src + "mlp.linear_fc2.weight"]
        if spec.family == "qwen3":
            out[dst + "self_attn.q_norm.weight"] = mc[src + "self_attention.q_layernorm.weight"]
            out[dst + "self_attn.k_norm.weight"] = mc[src + "self_attention.k_layernorm.weight"]
    if "decoder.final_layernorm.weight" in mc:
        out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    if not spec.tie_embeddings and "output_layer.weight" in mc:
        out["lm_head.weight"] = mc["output_layer.weight"]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor's shape, in the order ``megatron_to_hf`` produces them."""
    nq, nkv, hd, h, f = (
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.hidden_size,
        spec.ffn_hidden_size,
    )
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        dst = f"model.layers.{i}."
        out |= {
            dst + "self_attn.q_proj.weight": (nq * hd, h),
            dst + "self_attn.k_proj.weight": (nkv * hd, h),
            dst + "self_attn.v_proj.weight": (nkv * hd, h),
            dst + "self_attn.o_proj.weight": (h, nq * hd),
            dst + "input_layernorm.weight": (h,),
            dst + "post_attention_layernorm.weight": (h,),
            dst + "mlp.gate_proj.weight": (f, h),
            dst + "mlp.up_proj.weight": (f, h),
            dst + "mlp.down_proj.weight": (h, f),
        }
        if spec.family == "qwen3":
            out |= {dst + "self_attn.q_norm.weight": (hd,), dst + "self_attn.k_norm.weight": (hd,)}
    out["model.norm.weight"] = (h,)
    if not spec.tie_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    return out


def read_hf_weights(path: str | Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(f))
    if not tensors:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return tensors


_TE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def local_spec_name(name: str) -> str:
    """A parameter's name under the local layer spec. Transformer Engine's spec fuses each RMSNorm into the
    linear after it (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); everything else is
    named and laid out the same (Megatron's own ``sharded_state_dict_keys_map`` says as much)."""
    for te, local in _TE_NAMES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name


def causal_padding_mask(attention_mask: Tensor) -> Tensor:
    """``[B, S]`` 1 = token, 0 = padding -> Megatron's ``[B, 1, S, S]`` boolean mask (True = may not attend)."""
    s = attention_mask.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=attention_mask.device), diagonal=1)
    pad = ~attention_mask.bool()[:, None, None, :]
    return causal[None, None] | pad


def _mask(model: Any, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    from services.trainer.head import gpt_model

    if getattr(gpt_model(model), "turnstream_mask_free", False):
        return None
    return causal_padding_mask(torch.ones_like(input_ids) if attention_mask is None else attention_mask)


def _positions(input_ids: Tensor) -> Tensor:
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device)[None].expand(b, s)


def forward_logits(model: Any, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """``[B, S]`` ids (right-padded) -> ``[B, S, V]`` logits (``V``: this rank's vocabulary slice under tensor
    parallelism, padding columns included; ``logprobs.VocabShard`` says which). On a pipeline stage other than the
    last: that stage's ``[S, B, H]`` hidden states."""
    out: torch.Tensor = model(input_ids, _positions(input_ids), _mask(model, input_ids, attention_mask))
    return out


def forward_hidden(model: Any, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """``[B, S]`` ids (right-padded) -> ``[S, B, H]`` hidden states after the final norm, without the output
    layer (``head.py`` applies it where the loss reads it); on a stage before the last, that stage's output.
    Megatron's ``GPTModel`` returns its decoder's output when it is not the last stage (``post_process``), so the
    flag is lowered for the call: the decoder keeps its own and still applies the final norm."""
    from services.trainer.head import gpt_model

    gpt = gpt_model(model)
    last = gpt.post_process
    gpt.post_process = False
    try:
        out: torch.Tensor = model(input_ids, _positions(input_ids), _mask(model, input_ids, attention_mask))
    finally:
        gpt.post_process = last
    return out
