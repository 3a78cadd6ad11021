"""How the policy is split across processes: tensor (TP), pipeline (PP) and data (DP) parallelism.

One process per GPU, started by torchrun (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``); a plain start is world size 1.
Ranks follow Megatron's default order (TP fastest, then DP, then PP): ``rank = tp_rank + tp * (dp_rank + dp *
pp_rank)``. The split of the Hugging Face weights is pure tensor slicing on the full Megatron-layout state dict
(``model.hf_to_megatron``), so it is tested on the CPU for any layout; ``unshard`` is its exact inverse.

- Column-parallel (output rows split): ``linear_qkv`` (Megatron groups it per KV head, so a contiguous split hands
  each rank whole KV groups), ``linear_fc1`` (gate and up split separately, then stacked again per rank).
- Row-parallel (input columns split): ``linear_proj``, ``linear_fc2``.
- Vocab-parallel: the embedding and output layer; with TP > 1 the vocab is padded with zero rows to a multiple of
  ``128 x tp`` (the padded logits are cut off before any softmax).
- Replicated: every norm (including Qwen3's q/k norms).
- Pipeline stages hold consecutive layers renumbered from 0; the first holds the embedding, the last the final
  norm and output layer (with tied embeddings and PP > 1, the last stage holds its own copy of the embedding as
  ``output_layer.weight``, kept equal by Megatron's embedding-group gradient all-reduce).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec
import torch
from torch import Tensor

from services.trainer.spec import ModelSpec, padded_vocab

_COLUMN = ("self_attention.linear_qkv.weight",)
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_GATED = ("mlp.linear_fc1.weight",)
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


class ParallelLayout(msgspec.Struct, frozen=True):
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    tp: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, tp: int = 1, pp: int = 1, env: Mapping[str, str] | None = None) -> ParallelLayout:
        """The layout of this process from torchrun's variables and the configured TP and PP sizes."""
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        layout = cls(world, rank, int(env.get("LOCAL_RANK", str(rank))), tp, pp)
        if tp < 1 or pp < 1:
            raise ValueError(f"tensor_parallel ({tp}) and pipeline_parallel ({pp}) must be at least 1")
        if world % (tp * pp):
            raise ValueError(
                f"world size {world} is not a multiple of tensor_parallel x pipeline_parallel = {tp * pp}"
            )
        if not 0 <= rank < world:
            raise ValueError(f"RANK {rank} is outside the world of {world} processes")
        return layout

    def validate(self, spec: ModelSpec, rollout_batch_size: int) -> None:
        """Refuse, before any weight is loaded, a layout this model or batch cannot be split into."""
        problems = []
        if spec.num_heads % self.tp:
            problems.append(f"{spec.num_heads} attention heads do not split over tensor_parallel={self.tp}")
        if spec.num_kv_heads % self.tp:
            problems.append(f"{spec.num_kv_heads} KV heads do not split over tensor_parallel={self.tp}")
        if spec.ffn_hidden_size % self.tp:
            problems.append(f"FFN size {spec.ffn_hidden_size} does not split over tensor_parallel={self.tp}")
        if spec.num_layers % self.pp:
            problems.append(f"{spec.num_layers} layers do not split over pipeline_parallel={self.pp}")
        if rollout_batch_size % self.dp:
            problems.append(
                f"rollout_batch_size {rollout_batch_size} does not split over {self.dp} data-parallel ranks"
            )
        if problems:
            raise ValueError("parallel layout refused: " + "; ".join(problems))


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _split(name: str, t: Tensor, tp: int, tp_rank: int) -> Tensor:
    if tp == 1:
        return t
    if name.endswith(_COLUMN) or name.endswith(_VOCAB):
        return t.chunk(tp, dim=0)[tp_rank]
    if name.endswith(_ROW):
        return t.chunk(tp, dim=1)[tp_rank]
    if name.endswith(_GATED):
        gate, up = t.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
    return t


def join(name: str, parts: list[Tensor]) -> Tensor:
    """The tensor-parallel shards of one local name, put back together (``_split``'s inverse)."""
    if len(parts) == 1:
        return parts[0]
    if name.endswith(_COLUMN) or name.endswith(_VOCAB):
        return torch.cat(parts, dim=0)
    if name.endswith(_ROW):
        return torch.cat(parts, dim=1)
    if name.endswith(_GATED):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return parts[0]


def shard(full: dict[str, Tensor], spec: ModelSpec, layout: ParallelLayout) -> dict[str, Tensor]:
    """The full Megatron-layout state dict -> this rank's part, under the local names its GPTModel uses."""
    vocab = padded_vocab(spec.vocab_size, layout.tp)
    layers = stage_layers(spec.num_layers, layout.pp, layout.pp_rank)
    out: dict[str, Tensor] = {}
    for name, t in full.items():
        if name.startswith("decoder.layers."):
            index, rest = name[len("decoder.layers.") :].split(".", 1)
            if int(index) not in layers:
                continue
            local = f"decoder.layers.{int(index) - layers.start}.{rest}"
        elif name == "embedding.word_embeddings.weight":
            if layout.first_stage:
                out[name] = _split(name, _pad_rows(t, vocab), layout.tp, layout.tp_rank)
            if spec.tie_embeddings and layout.pp > 1 and layout.last_stage:
                out["output_layer.weight"] = _split(name, _pad_rows(t, vocab), layout.tp, layout.tp_rank)
            continue
        elif name == "output_layer.weight":
            if layout.last_stage:
                out[name] = _split(name, _pad_rows(t, vocab), layout.tp, layout.tp_rank)
            continue
        elif name == "decoder.final_layernorm.weight":
            if not layout.last_stage:
                continue
            local = name
        else:
            raise ValueError(f"no parallel rule for {name}")
        out[local] = _split(name, t, layout.tp, layout.tp_rank)
    return out


def unshard(
    parts: Mapping[tuple[int, int], dict[str, Tensor]], spec: ModelSpec, tp: int, pp: int
) -> dict[str, Tensor]:
    """The inverse of ``shard``: the parts of one data-parallel replica, keyed by ``(pp_rank, tp_rank)`` -> the
    full Megatron-layout state dict, vocab padding removed."""
    full: dict[str, Tensor] = {}
    for pp_rank in range(pp):
        layers = stage_layers(spec.num_layers, pp, pp_rank)
        ranks = [parts[pp_rank, tp_rank] for tp_rank in range(tp)]
        for name in ranks[0]:
            if name.startswith("decoder.layers."):
                index, rest = name[len("decoder.layers.") :].split(".", 1)
                global_name = f"decoder.layers.{int(index) + layers.start}.{rest}"
            elif name == "output_layer.weight" and spec.tie_embeddings:
                continue  # the last stage's copy of the embedding
            else:
                global_name = name
            joined = join(name, [r[name] for r in ranks])
            if name in _VOCAB:
                joined = joined[: spec.vocab_size]
            full[global_name] = joined
    return full


def gpus_expected(env: Mapping[str, str] | None = None) -> str | None:
    """The variable that says this process was given GPUs (the NVIDIA container runtime's, or CUDA's), if any:
    a container started with GPUs that torch cannot see has a driver problem, not a CPU job."""
    env = os.environ if env is None else env
    for name in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        value = env.get(name, "").strip().lower()
        if value and value not in ("void", "none", "-1"):
            return f"{name}={env[name]}"
    return None


def dtype_for(precision: str, env: Mapping[str, str] | None = None) -> torch.dtype:
    """``auto``: bf16 where CUDA is present (the GPU path), fp32 on the CPU; but never a silent CPU fallback
    when the process was given GPUs that torch cannot use."""
    cuda = torch.cuda.is_available()
    if precision == "auto":
        expected = None if cuda else gpus_expected(env)
        if expected:
            raise ValueError(
                f"{expected} but torch sees no CUDA device (driver too old for torch's CUDA build, or the GPUs "
                "are not passed through): refusing to train on the CPU; set trainer.precision = fp32 to mean it"
            )
        return torch.bfloat16 if cuda else torch.float32
    if precision == "bf16" and not cuda:
        raise ValueError(
            "trainer.precision bf16 needs CUDA (Megatron's mixed-precision optimizer keeps CUDA tensors only); "
            "use fp32 or auto on the CPU"
        )
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
