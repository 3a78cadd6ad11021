"""Each rank reads its own slices of the Hugging Face weights: the same tensors as converting the whole model and
slicing it (``parallel.shard``), for every layout, from memory and from safetensors files; and the Transformer
Engine spec's fused norm names map to the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.trainer.hf_load import TensorSource, local_tensor, safetensors_source
from services.trainer.model import build_model, hf_to_megatron, init_parallel, local_spec_name
from services.trainer.parallel import ParallelLayout, shard
from tests.services.trainer.test_parallel import random_hf, spec


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_sliced_reads_equal_convert_then_shard(
    family: str, tie: bool, tp: int, pp: int, tmp_path: Path
) -> None:
    s = spec(family, tie)
    hf = random_hf(s)
    save_file(hf, str(tmp_path / "model.safetensors"))
    full = hf_to_megatron(s, hf)
    for rank in range(tp * pp * 2):  # DP 2: replicas read the same
        lay = ParallelLayout(tp * pp * 2, rank, rank, tp, pp)
        want = shard(full, s, lay)
        with safetensors_source(tmp_path) as files:
            for source in (TensorSource(hf), files):
                got = {name: local_tensor(s, lay, name, source) for name in want}
                for name, w in want.items():
                    assert torch.equal(got[name], w), (rank, name)


def test_te_spec_names_map_to_the_same_weights() -> None:
    """Megatron declares the local spec's norms interchangeable with Transformer Engine's fused ones
    (``sharded_state_dict_keys_map``): the key its distributed checkpoint uses for each local parameter, with the
    layer index put back, is a name ``local_spec_name`` maps back to that parameter. (The TE spec itself needs
    Transformer Engine and a GPU: the GPU smoke script builds it.)"""
    init_parallel()
    for family in ("llama", "qwen3"):
        model = build_model(spec(family, tie=False, layers=2))
        keys = model.sharded_state_dict()
        te_named = 0
        for name in model.state_dict():
            if name.endswith("._extra_state"):
                continue
            key = keys[name].key
            if name.startswith("decoder.layers."):
                index = name.split(".")[2]
                key = key.replace("decoder.layers.", f"decoder.layers.{index}.", 1)
            te_named += key != name
            assert local_spec_name(key) == name, (key, name)
        assert te_named == 4  # two fused norms per layer


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_model_built_for_loading_is_marked_like_an_initialised_one(family: str) -> None:
    """Without Megatron's random initialisation the tensor-parallel marks must still be there (the gradient norm
    and the distributed optimizer read them); the same on every parameter as an initialised build."""
    init_parallel()
    s = spec(family, tie=False, layers=2)

    def marks(model: torch.nn.Module) -> dict[str, tuple[object, ...]]:
        keys = ("tensor_model_parallel", "partition_dim", "partition_stride")
        return {n: tuple(getattr(p, k, None) for k in keys) for n, p in model.named_parameters()}

    initialised, allocated = marks(build_model(s)), marks(build_model(s, initialise=False))
    assert initialised == allocated
    assert sum(1 for m in allocated.values() if m[0]) == 2 + 4 * 2  # embedding, output, 4 linears per layer


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="what a host without Transformer Engine and CUDA resolves"
)
def test_the_layer_spec_resolves_to_sdpa_here_and_te_is_refused() -> None:
    from services.trainer.model import layer_spec_for

    assert layer_spec_for("auto") == "sdpa" and layer_spec_for("local") == "local"
    with pytest.raises(ValueError, match="needs Transformer Engine and CUDA"):
        layer_spec_for("te")


def test_a_bf16_model_exports_one_dtype(tmp_path: Path) -> None:
    """Megatron's local norms keep fp32 weights in a bf16 model: the published version is the model's dtype
    throughout (the streamed writer refuses a tensor of another dtype than its header announced)."""
    from safetensors.torch import load_file

    from services.trainer.checkpoints import TrainerStore
    from services.trainer.export import hf_entries, hf_stream, local_parameters
    from services.trainer.hf_load import load_hf_into

    init_parallel()
    s = spec("qwen3", tie=False, layers=2)
    model = build_model(s, torch.bfloat16, initialise=False)
    load_hf_into(model, s, random_hf(s))
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}, dtypes  # what makes the test bite
    local = local_parameters(model)
    stream = hf_stream(s, ParallelLayout(), local, torch.bfloat16)
    path, _ = TrainerStore(tmp_path).write_version(1, hf_entries(s, torch.bfloat16), stream, tmp_path)
    written = load_file(path / "model.safetensors")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    assert torch.equal(
        written["model.norm.weight"], local["decoder.final_layernorm.weight"].to(torch.bfloat16)
    )
