"""The GPU path's configuration logic on the CPU: torchrun layouts, what a model or batch refuses, and the split of
Hugging Face weights over tensor and pipeline ranks (exact inverse, the right slices on the right ranks)."""

from __future__ import annotations

import pytest
import torch

from runtime.configuration.config import TrainerConfig, load_config
from services.trainer.model import hf_to_megatron
from services.trainer.parallel import ParallelLayout, dtype_for, padded_vocab, shard, stage_layers, unshard
from services.trainer.spec import ModelSpec


def spec(family: str = "llama", tie: bool = True, layers: int = 4, vocab: int = 300) -> ModelSpec:
    return ModelSpec(
        family=family,
        vocab_size=vocab,
        hidden_size=32,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=4,
        head_dim=4,
        ffn_hidden_size=48,
        rms_eps=1e-6,
        rope_theta=10000.0,
        tie_embeddings=tie,
        max_position=64,
    )


def random_hf(s: ModelSpec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    h, hd = s.hidden_size, s.head_dim
    out = {"model.embed_tokens.weight": r(s.vocab_size, h), "model.norm.weight": r(h)}
    if not s.tie_embeddings:
        out["lm_head.weight"] = r(s.vocab_size, h)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": r(s.num_heads * hd, h),
            p + "self_attn.k_proj.weight": r(s.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": r(s.num_kv_heads * hd, h),
            p + "self_attn.o_proj.weight": r(h, s.num_heads * hd),
            p + "input_layernorm.weight": r(h),
            p + "post_attention_layernorm.weight": r(h),
            p + "mlp.gate_proj.weight": r(s.ffn_hidden_size, h),
            p + "mlp.up_proj.weight": r(s.ffn_hidden_size, h),
            p + "mlp.down_proj.weight": r(h, s.ffn_hidden_size),
        }
        if s.family == "qwen3":
            out |= {p + "self_attn.q_norm.weight": r(hd), p + "self_attn.k_norm.weight": r(hd)}
    return out


def test_layout_follows_megatron_rank_order() -> None:
    # 8 ranks, TP 2, PP 2 -> DP 2; TP varies fastest, then DP, then PP.
    seen = []
    for rank in range(8):
        lay = ParallelLayout.from_env(2, 2, {"WORLD_SIZE": "8", "RANK": str(rank), "LOCAL_RANK": str(rank)})
        seen.append((lay.tp_rank, lay.dp_rank, lay.pp_rank))
        assert lay.dp == 2 and lay.distributed
    assert seen == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    single = ParallelLayout.from_env(1, 1, {})
    assert (single.world_size, single.dp, single.first_stage, single.last_stage) == (1, 1, True, True)


def test_impossible_layouts_are_refused_with_reasons() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        ParallelLayout.from_env(2, 2, {"WORLD_SIZE": "6", "RANK": "0"})
    with pytest.raises(ValueError, match="outside"):
        ParallelLayout.from_env(1, 1, {"WORLD_SIZE": "2", "RANK": "2"})
    lay = ParallelLayout(world_size=16, tp=8, pp=2)
    with pytest.raises(ValueError) as err:
        lay.validate(spec(layers=3), rollout_batch_size=16)
    text = str(err.value)
    assert "KV heads" in text and "3 layers" in text and "attention heads" not in text
    with pytest.raises(ValueError, match="rollout_batch_size 15"):
        ParallelLayout(world_size=4, tp=2).validate(spec(), rollout_batch_size=15)
    ParallelLayout(world_size=8, tp=4, pp=2).validate(spec(), rollout_batch_size=16)


def test_trainer_config_carries_the_parallel_settings() -> None:
    cfg = load_config(
        env={"TURNSTREAM_TRAINER_TENSOR_PARALLEL": "4", "TURNSTREAM_TRAINER_PRECISION": "bf16"}
    ).trainer
    assert (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.precision) == (4, 1, "bf16")
    assert dtype_for("fp32") is torch.float32
    if torch.cuda.is_available():
        assert dtype_for("bf16") is torch.bfloat16
    else:
        with pytest.raises(ValueError, match="bf16 needs CUDA"):
            dtype_for("bf16")
    assert dtype_for(TrainerConfig().precision) is (
        torch.bfloat16 if torch.cuda.is_available() else torch.float32
    )
    with pytest.raises(Exception, match="precision"):
        load_config(env={"TURNSTREAM_TRAINER_PRECISION": "fp8"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the missing-CUDA refusal is what a CPU host can show")
def test_no_silent_cpu_fallback_when_gpus_were_given() -> None:
    """An old driver makes CUDA invisible to torch: a container given GPUs must fail at start, not train in fp32
    on the CPU for days."""
    with pytest.raises(ValueError, match="NVIDIA_VISIBLE_DEVICES=0,1 but torch sees no CUDA device"):
        dtype_for("auto", {"NVIDIA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=2"):
        dtype_for("auto", {"CUDA_VISIBLE_DEVICES": "2"})
    for hidden in ({}, {"CUDA_VISIBLE_DEVICES": ""}, {"NVIDIA_VISIBLE_DEVICES": "void"}):
        assert dtype_for("auto", hidden) is torch.float32  # GPUs hidden on purpose: the CPU is meant
    assert dtype_for("fp32", {"NVIDIA_VISIBLE_DEVICES": "0"}) is torch.float32  # said explicitly


def test_vocab_padding_and_stages() -> None:
    assert padded_vocab(49152, 1) == 49152 and padded_vocab(300, 1) == 300
    assert padded_vocab(300, 2) == 512 and padded_vocab(151936, 8) == 152576
    assert [list(stage_layers(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    ("family", "tie", "tp", "pp"),
    [
        ("llama", True, 2, 1),
        ("llama", True, 4, 2),
        ("llama", False, 2, 2),
        ("qwen3", False, 4, 1),
        ("qwen3", True, 1, 4),
    ],
)
def test_shard_then_unshard_is_exact(family: str, tie: bool, tp: int, pp: int) -> None:
    s = spec(family, tie)
    full = hf_to_megatron(s, random_hf(s))
    parts = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            rank = tp_rank + tp * pp_rank  # DP replica 0
            parts[pp_rank, tp_rank] = shard(
                full, s, ParallelLayout(world_size=tp * pp, rank=rank, tp=tp, pp=pp)
            )
    back = unshard(parts, s, tp, pp)
    assert back.keys() == full.keys()
    for name, t in full.items():
        assert torch.equal(back[name], t), name


def test_each_rank_holds_the_right_slices() -> None:
    s = spec("llama", tie=True, layers=4)
    full = hf_to_megatron(s, random_hf(s))
    last = shard(full, s, ParallelLayout(world_size=4, rank=3, tp=2, pp=2))  # tp_rank 1, pp_rank 1
    first = shard(full, s, ParallelLayout(world_size=4, rank=0, tp=2, pp=2))
    # The last stage holds layers 2-3 renumbered 0-1, the final norm, and its own copy of the tied embedding.
    assert "embedding.word_embeddings.weight" not in last and "decoder.final_layernorm.weight" in last
    assert torch.equal(
        last["decoder.layers.0.input_layernorm.weight"], full["decoder.layers.2.input_layernorm.weight"]
    )
    vocab = padded_vocab(s.vocab_size, 2)
    emb = full["embedding.word_embeddings.weight"]
    assert last["output_layer.weight"].shape == (vocab // 2, s.hidden_size)
    assert torch.equal(last["output_layer.weight"][: s.vocab_size - vocab // 2], emb[vocab // 2 :])
    assert not last["output_layer.weight"][s.vocab_size - vocab // 2 :].any()  # padding rows are zero
    assert "output_layer.weight" not in first and "decoder.final_layernorm.weight" not in first
    # Whole KV groups per TP rank: rank 0 gets groups 0-1 of the grouped QKV, rank 1 groups 2-3.
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(first["decoder.layers.0.self_attention.linear_qkv.weight"], qkv[: qkv.shape[0] // 2])
    # SwiGLU: each rank keeps [its gate rows; its up rows], so silu(gate) * up stays rank-local.
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    mine = first["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(mine, torch.cat([gate[:24], up[:24]]))
    # Row-parallel: input columns split.
    proj = full["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(
        first["decoder.layers.0.self_attention.linear_proj.weight"], proj[:, : proj.shape[1] // 2]
    )
