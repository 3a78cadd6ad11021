"""Publishing a weight version from a tensor-parallel trainer: the streamed export (``services/trainer/export.py``:
tensor by tensor to rank 0, written and hashed as it arrives) against the way it was done before (every rank's
whole state pickled to rank 0 with ``gather_object``, unsharded, converted, saved, then read back for its sha256),
on the same loaded model in one run. Prints JSON: seconds and rank 0's peak added anonymous memory per method.

    .venv/bin/python bench/trainer_export.py [--model smollm2|qwen3-1b|both] [--tp N]

``qwen3-1b`` is a random-weight Qwen3 of ~1.1B parameters (bf16 safetensors written to a temporary folder).
Without ``--tp``, each model's smallest tensor-parallel size above 1 (SmolLM2's 9 heads and 3 KV heads: 3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QWEN3_1B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000,
}

RANK = r"""
import hashlib, json, os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from pathlib import Path
from services.trainer.checkpoints import TrainerStore
from services.trainer.export import hf_entries, hf_stream, local_parameters
from services.trainer.hf_load import load_hf_into, safetensors_source
from services.trainer.model import build_model, init_parallel, megatron_to_hf, shutdown_parallel
from services.trainer.parallel import ParallelLayout, unshard
from services.trainer.spec import ModelSpec
from tests.services.trainer.load_check import PeakAnonymous, anonymous

path, out, tp, method = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
layout = init_parallel(ParallelLayout.from_env(tp) if tp > 1 else None)
spec = ModelSpec.from_dir(path)
stored = json.loads((Path(path) / "config.json").read_text()).get("torch_dtype")
dtype = torch.bfloat16 if stored == "bfloat16" else torch.float32
model = build_model(spec, dtype, layout, initialise=False)
with safetensors_source(path) as source:
    load_hf_into(model, spec, source, layout)
local = local_parameters(model)

def streamed(target):
    stream = hf_stream(spec, layout, local, dtype)
    if layout.rank != 0:  # the other ranks send their shards, as the trainer's followers do
        for _ in stream:
            pass
        return None
    return TrainerStore(target).write_version(1, hf_entries(spec, dtype), stream, path)[1]

def gathered(target):
    from safetensors.torch import save_file
    import torch.distributed as dist
    mine = {k: v.detach().cpu() for k, v in local.items()}
    if layout.distributed:
        box = ((layout.pp_rank, layout.tp_rank), mine) if layout.dp_rank == 0 else (None, None)
        parts = [None] * layout.world_size if layout.rank == 0 else None
        dist.gather_object(box, parts, dst=0)
        if parts is None:
            return None
        tensors = megatron_to_hf(spec, unshard({k: p for k, p in parts if k is not None}, spec, layout.tp, layout.pp))
    else:
        tensors = megatron_to_hf(spec, mine)
    os.makedirs(target, exist_ok=True)
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    return hashlib.sha256(open(os.path.join(target, "model.safetensors"), "rb").read()).hexdigest()

figures = {}
for name, fn in ((method, {"gathered": gathered, "streamed": streamed}[method]),):
    if layout.distributed:
        torch.distributed.barrier()
    before = anonymous()
    peak = PeakAnonymous(); peak.start()
    t0 = time.perf_counter()
    digest = fn(str(out / name))
    seconds = time.perf_counter() - t0
    peak.done.set(); peak.join()
    added = (max(peak.peak, anonymous()) - before) / 2**30
    figures[name] = {"seconds": round(seconds, 2), "peak_added_gib": round(added, 3)}
    if layout.rank == 0:
        folder = out / name if name == "gathered" else out / name / "versions" / "v1"
        figures[name]["file_gib"] = round((folder / "model.safetensors").stat().st_size / 2**30, 3)
        figures[name]["sha256"] = digest
    if layout.distributed:
        torch.distributed.barrier()
if layout.rank == 0:
    (out / f"{method}.json").write_text(json.dumps(figures[method]))
shutdown_parallel(layout)
"""


def qwen3_1b(folder: Path) -> Path:
    sys.path.insert(0, str(REPO))
    import torch

    from tests.services.trainer.conftest import save_random_model

    save_random_model(folder, **QWEN3_1B, torch_dtype="bfloat16")
    # save_random_model writes fp32: store bf16, as a real checkpoint of this size would be
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


def smallest_tp(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    heads, kv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    return next(t for t in range(2, heads + 1) if heads % t == 0 and kv % t == 0)


def run(model: Path, tp: int | None, work: Path) -> dict[str, object]:
    """Each method in a process of its own (memory one method freed would otherwise serve the other)."""
    tp = tp or smallest_tp(model)
    script = work / "rank.py"
    script.write_text(RANK)
    out = work / f"out-{model.name}"
    out.mkdir()
    launcher = [sys.executable]
    if tp > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc-per-node={tp}", "--master-port=29631"]
    figures: dict[str, object] = {"tp": tp}
    for method in ("gathered", "streamed"):
        proc = subprocess.run(
            [*launcher, str(script), str(model), str(out), str(tp), method],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-4000:])
        figures[method] = json.loads((out / f"{method}.json").read_text())
    import torch
    from safetensors.torch import load_file

    a = load_file(out / "gathered" / "model.safetensors")
    b = load_file(out / "streamed" / "versions" / "v1" / "model.safetensors")
    figures["same_tensors"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    g, s = figures["gathered"], figures["streamed"]
    assert isinstance(g, dict) and isinstance(s, dict)
    figures["time_ratio_streamed_over_gathered"] = round(s["seconds"] / g["seconds"], 3)
    figures["peak_ratio_streamed_over_gathered"] = round(
        s["peak_added_gib"] / max(g["peak_added_gib"], 1e-9), 3
    )
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["smollm2", "qwen3-1b", "both"], default="both")
    ap.add_argument("--tp", type=int, default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from runtime.engine.model_store import fetch_smollm2

    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model in ("smollm2", "both"):
            results["smollm2"] = run(Path(fetch_smollm2(log=False)), args.tp, work)
        if args.model in ("qwen3-1b", "both"):
            results["qwen3-1b"] = run(qwen3_1b(work / "qwen3-1b"), args.tp, work)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
