"""What the trainer needs to know of a model's architecture, read from a Hugging Face ``config.json``. Its own
module so that the model builder and the parallel layout both use it without importing each other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

VOCAB_MULTIPLE = 128

FAMILIES = {"llama": ("LlamaForCausalLM",), "qwen3": ("Qwen3ForCausalLM",)}


class ModelSpec(msgspec.Struct, frozen=True):
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_eps: float
    rope_theta: float
    tie_embeddings: bool
    max_position: int

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelSpec:
        arch = (config.get("architectures") or [""])[0]
        family = next((f for f, archs in FAMILIES.items() if arch in archs), None)
        if family is None and config.get("model_type") in FAMILIES:
            family = str(config["model_type"])
        if family is None:
            raise ValueError(
                f"architecture {arch or config.get('model_type')!r} is not supported (Llama, Qwen3)"
            )
        # transformers >= 5 keeps RoPE settings under rope_parameters; older configs at the top level.
        rope = dict(config.get("rope_parameters") or {})
        if config.get("rope_scaling"):
            rope.update(config["rope_scaling"])
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"RoPE type {rope.get('rope_type')!r} is not supported yet (only default RoPE)")
        rope_theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            family=family,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(config["intermediate_size"]),
            rms_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=int(config.get("max_position_embeddings", 4096)),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelSpec:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """(out, in) of a Hugging Face projection's weight (``q_proj`` ... ``down_proj``)."""
        h, q, kv, f = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.ffn_hidden_size,
        )
        return {
            "q_proj": (q, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, q),
            "gate_proj": (f, h),
            "up_proj": (f, h),
            "down_proj": (h, f),
        }[proj]


ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
"""Projections Megatron splits by input under tensor parallelism (row-parallel); the others by output."""


def lora_split_dim(proj: str, which: str) -> int | None:
    """The dimension tensor parallelism splits of a projection's LoRA matrix (``which``: A, rank x in; B, out x
    rank): A's input columns under a row-parallel projection, B's output rows under a column-parallel one; None
    where every rank holds it whole. Here, not in ``lora.py``, so that the memory plan needs no torch."""
    if proj in ROW_PARALLEL:
        return 1 if which == "A" else None
    return 0 if which == "B" else None


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Vocab rows of the embedding and output layer: unchanged without TP (the exact Hugging Face shapes), else
    padded so each TP rank holds an equal, aligned slice."""
    if tp == 1:
        return vocab_size
    multiple = VOCAB_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple
