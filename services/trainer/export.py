"""The policy's weights as Hugging Face tensors, gathered one Megatron tensor at a time.

Every rank walks the same list of Megatron parameters (the embedding, then layer by layer, then the final norm and
output layer). For each, the ranks that hold its tensor-parallel shards in data-parallel replica 0 send them to
rank 0 (point to point on the tensor backend, NCCL on GPUs, in a group without a practical timeout), which joins
them (``parallel.join``), converts each finished group (one layer) to Hugging Face tensors and hands them on, so
rank 0 holds one layer of the full model at a time instead of every shard of every rank pickled at once
(``dist.gather_object``, ~66 GB at 8B)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from services.trainer.collective import transfer_group
from services.trainer.lora import is_adapter_name
from services.trainer.model import hf_shapes, hf_to_megatron, local_spec_name, megatron_to_hf
from services.trainer.parallel import ParallelLayout, join, shard, stage_layers
from services.trainer.safetensors_stream import Entry
from services.trainer.spec import ModelSpec


def hf_entries(spec: ModelSpec, dtype: torch.dtype) -> list[Entry]:
    """(name, dtype, shape) of every exported tensor, in the order ``hf_stream`` yields them."""
    return [Entry(name, dtype, shape) for name, shape in hf_shapes(spec).items()]


def _groups(spec: ModelSpec) -> list[list[str]]:
    """Global Megatron names, grouped so that each group converts to Hugging Face tensors on its own."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in hf_shapes(spec).items()}
    names = list(hf_to_megatron(spec, meta))
    groups = [["embedding.word_embeddings.weight"]]
    for i in range(spec.num_layers):
        groups.append([n for n in names if n.startswith(f"decoder.layers.{i}.")])
    groups.append([n for n in names if n in ("decoder.final_layernorm.weight", "output_layer.weight")])
    return groups


def owner(spec: ModelSpec, lay: ParallelLayout, name: str) -> tuple[int, str]:
    """(pipeline stage, name on that stage's ranks) of a global Megatron name."""
    if name.startswith("decoder.layers."):
        index, rest = name[len("decoder.layers.") :].split(".", 1)
        stage = int(index) // (spec.num_layers // lay.pp)
        return (
            stage,
            f"decoder.layers.{int(index) - stage_layers(spec.num_layers, lay.pp, stage).start}.{rest}",
        )
    return (0 if name == "embedding.word_embeddings.weight" else lay.pp - 1), name


def replica_rank(lay: ParallelLayout, tp_rank: int, stage: int) -> int:
    return tp_rank + lay.tp * lay.dp * stage  # data-parallel replica 0


def hf_stream(
    spec: ModelSpec, lay: ParallelLayout, local: dict[str, Tensor], dtype: torch.dtype
) -> Iterator[tuple[str, Tensor]]:
    """A collective: every rank iterates it to the end; rank 0 gets (Hugging Face name, CPU tensor in ``dtype``)
    pairs in ``hf_entries`` order, the others nothing. ``local``: this rank's parameters by local name. Every
    tensor travels and is written in ``dtype`` (the model's): Megatron's local norms keep fp32 weights in a bf16
    model, and a version is one dtype, as the engine loads it."""
    if not lay.distributed:
        for group in _groups(spec):
            part = {n: local[n].detach().to("cpu", dtype) for n in group if n in local}
            yield from megatron_to_hf(spec, part).items()
        return

    shapes = _shard_shapes(spec, lay)
    channel = transfer_group()
    for group in _groups(spec):
        full: dict[str, Tensor] = {}
        for name in group:
            stage, local_name = owner(spec, lay, name)
            sizes = [shapes[tp_rank, stage][local_name] for tp_rank in range(lay.tp)]
            parts = gather_parts(lay, stage, local, local_name, sizes, dtype, channel)
            if lay.rank == 0:
                joined = join(local_name, parts)
                full[name] = joined[: spec.vocab_size] if name.endswith(_VOCAB) else joined
        if lay.rank == 0:
            yield from megatron_to_hf(spec, full).items()


_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def gather_parts(
    lay: ParallelLayout,
    stage: int,
    local: dict[str, Tensor],
    local_name: str,
    sizes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    channel: Any,
    copy: bool = False,
) -> list[Tensor]:
    """A collective over one tensor: rank 0 gets, in ``dtype`` on the CPU, its parts held by the first
    ``len(sizes)`` tensor-parallel ranks of data-parallel replica 0 on ``stage`` (``sizes``: each part's shape),
    its own (``copy``: never the live tensor itself) or received; their holders send them; the others get []."""
    import torch.distributed as dist

    parts: list[Tensor] = []
    for tp_rank, size in enumerate(sizes):
        src = replica_rank(lay, tp_rank, stage)
        if lay.rank == src == 0:
            parts.append(local[local_name].detach().to("cpu", dtype, copy=copy))
        elif lay.rank == src:
            dist.send(local[local_name].detach().to(dtype).contiguous(), dst=0, group=channel)
        elif lay.rank == 0:
            device = next(iter(local.values())).device if local else torch.device("cpu")
            buffer = torch.empty(list(size), dtype=dtype, device=device)
            dist.recv(buffer, src=src, group=channel)
            parts.append(buffer.cpu())
    return parts


def _shard_shapes(spec: ModelSpec, lay: ParallelLayout) -> dict[tuple[int, int], dict[str, tuple[int, ...]]]:
    """The local shapes on each (tp_rank, stage) of replica 0, from the layout alone (meta tensors)."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in hf_shapes(spec).items()}
    full = hf_to_megatron(spec, meta)
    out: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}
    for stage in range(lay.pp):
        for tp_rank in range(lay.tp):
            holder = ParallelLayout(lay.world_size, replica_rank(lay, tp_rank, stage), 0, lay.tp, lay.pp)
            out[tp_rank, stage] = {k: tuple(v.shape) for k, v in shard(full, spec, holder).items()}
    return out


def local_parameters(module: Any) -> dict[str, Tensor]:
    """This rank's parameters of the base model by local name under the local layer spec (references, not copies;
    no Megatron extra state, no LoRA adapter)."""
    return {
        local_spec_name(k): v
        for k, v in module.state_dict().items()
        if not k.endswith("._extra_state") and not is_adapter_name(k)
    }
