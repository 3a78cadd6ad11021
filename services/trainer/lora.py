"""LoRA adapters on the policy's Megatron-core linear layers (``trainer.lora``).

One adapter pair (A: rank x in, B: out x rank) per Hugging Face projection, as PEFT trains it: Megatron fuses
q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``, and each of those projections still gets its own pair,
so an exported adapter is exactly PEFT's (``lora_export.py``) and any subset of the projections can be targeted.
The frozen layer's output gains ``scaling * B(A(dropout(x)))`` (scaling = alpha / rank) through a forward hook,
so the base parameters keep their names, their loaders and their exporters, and nothing of Megatron is patched.

Tensor parallelism follows the layer: under a column-parallel layer (``linear_qkv``, ``linear_fc1``) A is whole
and B holds this rank's output rows (whole KV groups, this rank's gate and up rows); A's product is made whole
again in backward (Megatron's copy-to-region: identity forward, all-reduce backward). Under a row-parallel layer
(``linear_proj``, ``linear_fc2``) A holds this rank's input columns and its product is summed over the group
(reduce-from-region), B is whole. A is drawn as PEFT draws it (Kaiming-uniform, a = sqrt(5)) for the full matrix
from a seed fixed per layer and projection, then sliced, so every layout starts from the same adapter; B starts at
zero, so the first forward equals the base model's exactly.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.configuration.config import LORA_TARGETS, LoraConfig
from services.trainer.parallel import ParallelLayout, stage_layers
from services.trainer.spec import ModelSpec, lora_split_dim

# Megatron linear -> (Hugging Face projections it fuses, in fused order; parallel kind).
FUSED: dict[str, tuple[tuple[str, ...], str]] = {
    "self_attention.linear_qkv": (("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": (("o_proj",), "row"),
    "mlp.linear_fc1": (("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": (("down_proj",), "row"),
}
HF_MODULE = {
    p: ("self_attn." if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + p for p in LORA_TARGETS
}


def initial_a(spec: ModelSpec, layer: int, proj: str, rank: int, seed: int) -> Tensor:
    """The full A of a global layer's projection at the start (fp32), the same in every layout."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{layer}.{proj}".encode()))
    a = torch.empty(rank, spec.projection_shape(proj)[1])
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a


def local_slice(spec: ModelSpec, lay: ParallelLayout, proj: str, which: str, full: Tensor) -> Tensor:
    """This rank's part of a full A or B (``which``) under tensor parallelism."""
    dim = lora_split_dim(proj, which)
    if lay.tp == 1 or dim is None:
        return full
    size = full.shape[dim] // lay.tp
    return full.narrow(dim, lay.tp_rank * size, size)


class Pair(torch.nn.Module):
    def __init__(self, a: Tensor, b: Tensor) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(a)
        self.B = torch.nn.Parameter(b)


class Adapter(torch.nn.Module):
    """The LoRA pairs on one Megatron linear layer, as this rank holds them. ``enabled`` off: the base layer."""

    def __init__(
        self,
        kind: str,
        parts: tuple[str, ...],
        pairs: dict[str, Pair],
        rows: dict[str, int],
        config: LoraConfig,
        spec: ModelSpec,
        tp: int,
    ) -> None:
        super().__init__()
        self.kind, self.parts, self.tp = kind, parts, tp
        self.pairs = torch.nn.ModuleDict(pairs)
        self.rows = rows  # this rank's output rows per projection, for the ones left without a pair
        self.scaling = config.alpha / config.rank
        self.dropout = config.dropout
        self.groups = spec.num_kv_heads // tp
        self.enabled = True
        self.norm_eps = spec.rms_eps

    def delta(self, x: Tensor, norm_weight: Tensor | None) -> Tensor | None:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if (
            norm_weight is not None
        ):  # Transformer Engine's layer fuses the norm: adapt its output, as PEFT does
            x = F.rms_norm(x, (x.shape[-1],), norm_weight.to(x.dtype), self.norm_eps)
        out: dict[str, Tensor] = {}
        for name, pair in self.pairs.items():
            assert isinstance(pair, Pair)
            z = self._dropped(x) @ pair.A.t()
            if self.tp > 1:
                z = (
                    copy_to_tensor_model_parallel_region(z)
                    if self.kind == "column"
                    else reduce_from_tensor_model_parallel_region(z)
                )
            out[name] = (z @ pair.B.t()) * self.scaling
        if not out:
            return None
        if self.kind == "row":
            return out[self.parts[0]]
        lead = x.shape[:-1]
        if (
            self.parts[0] == "q_proj"
        ):  # Megatron's qkv rows: per KV group, its queries, then its key, then its value
            shaped = [self._part(out, p, lead, x).reshape(*lead, self.groups, -1) for p in self.parts]
            return torch.cat(shaped, dim=-1).reshape(*lead, -1)
        return torch.cat([self._part(out, p, lead, x) for p in self.parts], dim=-1)  # gate rows, then up rows

    def _dropped(self, x: Tensor) -> Tensor:
        """PEFT's dropout: a mask of its own per projection. A column-parallel layer's input is the same on every
        tensor-parallel rank, and so is its mask (the default generator, seeded alike); a row-parallel layer's is
        this rank's slice, masked from Megatron's model-parallel generator, which differs per rank."""
        if not self.dropout or not self.training:
            return x
        if self.kind == "row" and self.tp > 1:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return F.dropout(x, self.dropout, True)
        return F.dropout(x, self.dropout, True)

    def _part(self, out: dict[str, Tensor], proj: str, lead: torch.Size, x: Tensor) -> Tensor:
        return out[proj] if proj in out else x.new_zeros(*lead, self.rows[proj])


def _hook(module: Any, args: tuple[Any, ...], output: Any) -> Any:
    adapter: Adapter = module.lora
    if not adapter.enabled:
        return output
    delta = adapter.delta(args[0], getattr(module, "layer_norm_weight", None))
    if delta is None:
        return output
    result, bias = output
    return result + delta.to(result.dtype), bias


def attach(model: Any, spec: ModelSpec, lay: ParallelLayout, config: LoraConfig, dtype: torch.dtype) -> int:
    """Freeze the model and add the configured adapters to this rank's layers; returns the number of adapter
    parameters on this rank. Call before Megatron's DDP and optimizer are built (they take what requires grad)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    model.requires_grad_(False)
    targets = set(config.target_modules)
    first = stage_layers(spec.num_layers, lay.pp, lay.pp_rank).start
    device = next(model.parameters()).device
    count = 0
    for index, layer in enumerate(model.decoder.layers):
        for path, (parts, kind) in FUSED.items():
            linear = layer.get_submodule(path)
            pairs: dict[str, Pair] = {}
            rows: dict[str, int] = {}
            for proj in parts:
                out_rows = spec.projection_shape(proj)[0] // (lay.tp if kind == "column" else 1)
                rows[proj] = out_rows
                if proj not in targets:
                    continue
                a = local_slice(
                    spec, lay, proj, "A", initial_a(spec, first + index, proj, config.rank, config.seed)
                )
                b = torch.zeros(out_rows, config.rank)
                pair = Pair(a.to(device, dtype).contiguous(), b.to(device, dtype))
                if lay.tp > 1:
                    if kind == "column":
                        set_tensor_model_parallel_attributes(pair.B, True, 0, 1)
                    else:
                        set_tensor_model_parallel_attributes(pair.A, True, 1, 1)
                pairs[proj] = pair
                count += pair.A.numel() + pair.B.numel()
            if not pairs:
                continue
            linear.lora = Adapter(kind, parts, pairs, rows, config, spec, lay.tp)
            linear.register_forward_hook(_hook)
    if lay.first_stage and hasattr(model, "embedding"):
        # Full recompute checkpoints each layer with a reentrant autograd function, whose output needs grad only
        # if an input does: with the embedding frozen none would, and no adapter would ever get a gradient.
        model.embedding.register_forward_hook(lambda _m, _a, out: out.requires_grad_(True))
    return count


def adapters(model: Any) -> Iterator[Adapter]:
    for module in model.modules():
        if isinstance(module, Adapter):
            yield module


@contextmanager
def disabled(model: Any) -> Iterator[None]:
    """The base model: every adapter off for the block (the reference of the KL term, the judge's view)."""
    found = list(adapters(model))
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


@dataclass(frozen=True)
class AdaptersOff:
    """The KL term's reference under LoRA: the trained model itself, run with ``disabled`` adapters. Its frozen
    base is the starting policy, so no second copy of the weights is loaded."""

    model: Any


def is_adapter_name(name: str) -> bool:
    return ".lora.pairs." in name


def adapter_state(model: Any) -> dict[str, Tensor]:
    """This rank's adapter parameters by name (references): what a LoRA checkpoint holds of the model."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_name(k)}


def load_adapter_state(model: Any, state: dict[str, Tensor]) -> None:
    """Restore this rank's adapters from ``adapter_state``'s output; a checkpoint of other adapters (another
    rank, target list or full fine-tuning) is refused rather than half applied."""
    own = adapter_state(model)
    if set(state) != set(own):
        missing, unknown = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(
            f"checkpoint adapters differ from the configured ones: missing {missing[:3]}, unknown {unknown[:3]}"
        )
    with torch.no_grad():
        for name, param in own.items():
            if param.shape != state[name].shape:
                raise ValueError(
                    f"checkpoint adapter {name}: shape {tuple(state[name].shape)} != {tuple(param.shape)}"
                )
            param.copy_(state[name])
