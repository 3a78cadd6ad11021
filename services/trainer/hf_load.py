"""Each rank's parameters read straight from the Hugging Face safetensors, as slices.

A rank needs its pipeline stage's layers and, of each, its tensor-parallel rows or columns (``parallel.py``).
``safe_open(...).get_slice`` reads exactly those bytes, so a rank's host memory holds its own parameters and one
slice in flight, not the whole model read, then fused into Megatron's layout, then sliced (three copies of an 8B
model per rank before). The model is built without a random initialisation (``build_model(load=True)``), as
every parameter is overwritten here. The result equals ``parallel.shard(model.hf_to_megatron(...))`` exactly
(``tests/services/trainer/test_hf_load.py``)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from services.trainer.lora import is_adapter_name
from services.trainer.model import hf_shapes, local_spec_name
from services.trainer.parallel import ParallelLayout, stage_layers
from services.trainer.spec import ModelSpec, padded_vocab

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_SAME = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


class Source(Protocol):
    """Hugging Face tensors by name, read as row and column ranges."""

    def names(self) -> set[str]: ...

    def read(self, name: str, rows: slice = slice(None), cols: slice | None = None) -> Tensor: ...


class TensorSource:
    """Tensors already in memory (tests, conversions)."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def read(self, name: str, rows: slice = slice(None), cols: slice | None = None) -> Tensor:
        t = self.tensors[name]
        return t[rows] if cols is None else t[rows, cols]


class SafetensorsSource:
    """The ``*.safetensors`` files of a folder, opened lazily (``safe_open``): a read costs its slice only."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self.handles = handles

    def names(self) -> set[str]:
        return set(self.handles)

    def read(self, name: str, rows: slice = slice(None), cols: slice | None = None) -> Tensor:
        part = self.handles[name].get_slice(name)
        out: Tensor = part[rows] if cols is None else part[rows, cols]
        return out


@contextmanager
def safetensors_source(path: str | Path) -> Iterator[SafetensorsSource]:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    opened = [safe_open(str(f), framework="pt") for f in files]
    handles = {name: h for h in opened for name in h.keys()}  # type: ignore[no-untyped-call]
    yield SafetensorsSource(handles)


def _vocab_rows(spec: ModelSpec, lay: ParallelLayout, src: Source, name: str) -> Tensor:
    """This rank's rows of the (padded) vocab: real rows read, padding rows zero."""
    per = padded_vocab(spec.vocab_size, lay.tp) // lay.tp
    start = lay.tp_rank * per
    end = min(start + per, spec.vocab_size)
    real = src.read(name, slice(start, end)) if start < spec.vocab_size else None
    rows = 0 if real is None else real.shape[0]
    if rows == per and real is not None:
        return real
    pad = torch.zeros(per - rows, spec.hidden_size, dtype=real.dtype if real is not None else torch.float32)
    return pad if real is None else torch.cat([real, pad])


def local_tensor(spec: ModelSpec, lay: ParallelLayout, name: str, src: Source) -> Tensor:
    """The tensor this rank's parameter ``name`` (local spec naming) holds, read from ``src``."""
    if name == "embedding.word_embeddings.weight":
        return _vocab_rows(spec, lay, src, "model.embed_tokens.weight")
    if name == "output_layer.weight":
        return _vocab_rows(
            spec, lay, src, "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
        )
    if name == "decoder.final_layernorm.weight":
        return src.read("model.norm.weight")
    match = _LAYER.fullmatch(name)
    if match is None:
        raise ValueError(f"no Hugging Face source for {name}")
    layer = stage_layers(spec.num_layers, lay.pp, lay.pp_rank).start + int(match[1])
    hf, rest = f"model.layers.{layer}.", match[2]
    if rest in _SAME:
        return src.read(hf + _SAME[rest])
    tp, r = lay.tp_rank, lay.tp
    nq, nkv, hd, h = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    groups, per_q = nkv // r, nq // nkv
    if rest == "self_attention.linear_qkv.weight":  # whole KV groups per rank: its queries, key, value
        g0, g1 = tp * groups, (tp + 1) * groups
        q = src.read(hf + "self_attn.q_proj.weight", slice(g0 * per_q * hd, g1 * per_q * hd))
        k = src.read(hf + "self_attn.k_proj.weight", slice(g0 * hd, g1 * hd))
        v = src.read(hf + "self_attn.v_proj.weight", slice(g0 * hd, g1 * hd))
        parts = [q.view(groups, per_q * hd, h), k.view(groups, hd, h), v.view(groups, hd, h)]
        return torch.cat(parts, dim=1).reshape(-1, h)
    if rest == "self_attention.linear_proj.weight":
        width = nq * hd // r
        return src.read(hf + "self_attn.o_proj.weight", slice(None), slice(tp * width, (tp + 1) * width))
    ffn = spec.ffn_hidden_size // r
    if rest == "mlp.linear_fc1.weight":
        rows = slice(tp * ffn, (tp + 1) * ffn)
        return torch.cat(
            [src.read(hf + "mlp.gate_proj.weight", rows), src.read(hf + "mlp.up_proj.weight", rows)]
        )
    if rest == "mlp.linear_fc2.weight":
        return src.read(hf + "mlp.down_proj.weight", slice(None), slice(tp * ffn, (tp + 1) * ffn))
    raise ValueError(f"no Hugging Face source for {name}")


def load_hf_into(
    model: Any, spec: ModelSpec, src: Source | Mapping[str, Tensor], lay: ParallelLayout | None = None
) -> None:
    """Copy this rank's part of the Hugging Face weights into the model, parameter by parameter. The source must
    hold exactly the model's tensors (an attention bias or a missing layer is a mapping mismatch)."""
    source: Source = TensorSource(src) if isinstance(src, Mapping) else src
    lay = lay or ParallelLayout()
    expected = set(hf_shapes(spec))
    present = source.names()
    if present != expected:
        missing, unused = sorted(expected - present), sorted(present - expected)
        raise ValueError(
            f"weight mapping mismatch: the Hugging Face weights lack {missing[:5]}, unused {unused[:5]}"
        )
    state = model.state_dict()
    with torch.no_grad():
        for name, param in state.items():
            if name.endswith("._extra_state") or is_adapter_name(name):
                continue
            tensor = local_tensor(spec, lay, local_spec_name(name), source)
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.copy_(tensor)
