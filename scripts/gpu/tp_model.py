"""A random-weight model that tensor parallelism can split, with the smoke model's tokenizer and vocabulary.

    python tp_model.py SOURCE_DIR OUT_DIR [--tp 2]

The smoke model, SmolLM2-135M, has 9 attention heads and 3 KV heads: TP 2 refuses it. The two-GPU step of
scripts/gpu-smoke.sh trains this one instead: a Llama of 8 heads and 4 KV heads (head size 64) whose vocabulary,
special tokens and tokenizer files are the source's, so the samples recorded from the smoke model's turns train it
as they are. What that step checks is the parallel machinery (a step over NCCL, the gathered version, every rank's
checkpoint state), not what the weights say.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.trainer.model import hf_shapes
from services.trainer.parallel import ParallelLayout
from services.trainer.spec import ModelSpec

KEPT = (
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "torch_dtype",
)


def write(source: Path, out: Path, tp: int) -> Path:
    original = json.loads((source / "config.json").read_text())
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128 * tp,
        "intermediate_size": 256 * tp,
        "num_hidden_layers": 2,
        "num_attention_heads": 4 * tp,
        "num_key_value_heads": 2 * tp,
        "head_dim": 32,
        **{k: original[k] for k in KEPT if k in original},
    }
    spec = ModelSpec.from_hf(config)
    ParallelLayout(world_size=tp, tp=tp).validate(spec, tp)  # refuses here, not on the GPU host
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():  # the tokenizer and generation settings, not the weights
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model"):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(0)
    weights = {
        k: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16) for k, s in hf_shapes(spec).items()
    }
    save_file(weights, str(out / "model.safetensors"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    print(write(args.source, args.out, args.tp))


if __name__ == "__main__":
    main()
