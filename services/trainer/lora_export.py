"""A version of a LoRA-trained policy as PEFT writes it (``adapter_config.json`` + ``adapter_model.safetensors``,
Hugging Face module names: ``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter`` read it as is),
or as full Hugging Face weights with the adapter merged in (``trainer.lora.publish = "merged"``).

Adapters are gathered to rank 0 like the full weights are (``export.py``): the ranks holding a tensor's
tensor-parallel parts in data-parallel replica 0 send them; a part every rank holds whole (A under a
column-parallel layer, B under a row-parallel one) is sent once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from runtime.configuration.config import LoraConfig
from services.trainer.collective import transfer_group
from services.trainer.export import gather_parts, owner
from services.trainer.lora import FUSED, HF_MODULE
from services.trainer.parallel import ParallelLayout
from services.trainer.safetensors_stream import Entry
from services.trainer.spec import ModelSpec, lora_split_dim

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_TARGET = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight")


def adapter_tensors(spec: ModelSpec, config: LoraConfig) -> list[tuple[str, str, tuple[int, int]]]:
    """(global Megatron name, PEFT name, full shape) of every adapter matrix, in the order they are written:
    layer by layer, projection by projection, A then B."""
    out: list[tuple[str, str, tuple[int, int]]] = []
    for layer in range(spec.num_layers):
        for path, (parts, _kind) in FUSED.items():
            for proj in parts:
                if proj not in config.target_modules:
                    continue
                rows, cols = spec.projection_shape(proj)
                for which, shape in (("A", (config.rank, cols)), ("B", (rows, config.rank))):
                    megatron = f"decoder.layers.{layer}.{path}.lora.pairs.{proj}.{which}"
                    peft = f"{PEFT_PREFIX}model.layers.{layer}.{HF_MODULE[proj]}.lora_{which}.weight"
                    out.append((megatron, peft, shape))
    return out


def adapter_entries(spec: ModelSpec, config: LoraConfig, dtype: torch.dtype) -> list[Entry]:
    return [Entry(peft, dtype, shape) for _, peft, shape in adapter_tensors(spec, config)]


def _split_dim(name: str) -> int | None:
    """The dimension a tensor-parallel adapter matrix is split on, None where every rank holds it whole."""
    proj, which = name.rsplit(".", 2)[-2:]
    return lora_split_dim(proj, which)


def adapter_stream(
    spec: ModelSpec, lay: ParallelLayout, local: dict[str, Tensor], config: LoraConfig, dtype: torch.dtype
) -> Iterator[tuple[str, Tensor]]:
    """A collective: every rank iterates it to the end; rank 0 gets (PEFT name, CPU tensor in ``dtype``) in
    ``adapter_entries`` order. ``local``: this rank's adapter parameters by local name."""
    channel = transfer_group() if lay.distributed else None
    for name, peft, shape in adapter_tensors(spec, config):
        stage, local_name = owner(spec, lay, name)
        dim = _split_dim(name)
        size = list(shape)
        if dim is not None:
            size[dim] //= lay.tp
        # A copy of rank 0's own part: the live parameter moves on with the next step.
        sizes = [size] * (lay.tp if dim is not None else 1)
        parts = gather_parts(lay, stage, local, local_name, sizes, dtype, channel, copy=True)
        if lay.rank == 0:
            yield peft, (torch.cat(parts, dim=dim) if dim is not None else parts[0]).contiguous()


def merged_stream(
    base: Iterator[tuple[str, Tensor]], adapter: Iterator[tuple[str, Tensor]], config: LoraConfig
) -> Iterator[tuple[str, Tensor]]:
    """The full Hugging Face weights with ``W + alpha / rank * B @ A`` for every adapted projection (computed in
    fp32, written in the weight's dtype). Both streams are collectives: the adapter is gathered first."""
    pairs = dict(adapter)
    scaling = config.alpha / config.rank
    for name, weight in base:
        match = _TARGET.fullmatch(name)
        a = pairs.get(f"{PEFT_PREFIX}{name[: -len('.weight')]}.lora_A.weight") if match else None
        if a is None:
            yield name, weight
            continue
        b = pairs[f"{PEFT_PREFIX}{name[: -len('.weight')]}.lora_B.weight"]
        yield name, (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def adapter_config(config: LoraConfig, base_model: str) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT's ``LoraConfig`` writes it (the fields a reader needs, defaults elsewhere)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": sorted(config.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def adapter_config_bytes(config: LoraConfig, base_model: str) -> bytes:
    return json.dumps(adapter_config(config, base_model), indent=2).encode()
