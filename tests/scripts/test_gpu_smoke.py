"""scripts/gpu-smoke.sh's logic on the CPU (CI has no GPU): the service its checks run in knows what the layout
serves, the two-GPU step trains a model that TP 2 accepts, and the engine flags are ones SGLang 0.5.23 runs on a
Hopper GPU."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.configuration.config import load_config
from services.trainer.parallel import ParallelLayout
from services.trainer.spec import ModelSpec
from tests.test_compose import resolve

REPO = Path(__file__).resolve().parents[2]
SMOKE = (REPO / "scripts/gpu-smoke.sh").read_text()


def check_service() -> str:
    line = next(line for line in SMOKE.splitlines() if line.startswith("check() {"))
    words = shlex.split(line.removeprefix("check() {").removesuffix("; }"))
    return words[words.index("/smoke/smoke_check.py") - 1]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_checks_run_where_the_layouts_versions_are_known(lora: bool) -> None:
    """Under SMOKE_LORA the check waits for an adapter, not a weight_version: the container it runs in must
    have the LoRA settings compose.one-gpu.yaml gives the services that meet versions."""
    files = ["compose.yaml", *(["compose.one-gpu.yaml"] if lora else [])]
    out = resolve(*files)
    assert out.returncode == 0, out.stderr
    service = json.loads(out.stdout)["services"][check_service()]
    env = {k: v for k, v in service["environment"].items() if v is not None}
    assert load_config(env=env).lora_adapters == lora


def test_the_two_gpu_step_trains_a_model_tp2_splits_with_the_smoke_models_vocabulary(
    smollm2_path: Path, tmp_path: Path
) -> None:
    assert "/smoke/tp_model.py /models/smoke /weights/tp2-base --tp 2" in SMOKE
    assert "--hf-checkpoint /weights/tp2-base" in SMOKE
    smoke = ModelSpec.from_dir(smollm2_path)
    with pytest.raises(ValueError, match="do not split"):
        ParallelLayout(world_size=2, tp=2).validate(smoke, 2)
    out = tmp_path / "tp2-base"
    subprocess.run(
        [sys.executable, "scripts/gpu/tp_model.py", str(smollm2_path), str(out), "--tp", "2"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=300,
    )
    spec = ModelSpec.from_dir(out)
    ParallelLayout(world_size=2, tp=2).validate(spec, 2)
    assert spec.vocab_size == smoke.vocab_size and spec.tie_embeddings == smoke.tie_embeddings
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    assert tokenizer == json.loads((smollm2_path / "tokenizer.json").read_text())
    from services.trainer.model import hf_shapes, read_hf_weights

    weights = read_hf_weights(out)
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        k: tuple(s) for k, s in hf_shapes(spec).items()
    }


def test_the_engine_flags_run_on_hopper_in_float32() -> None:
    """SGLang 0.5.23 picks FA3 for MHA models on Hopper and FA3 refuses float32: the smoke names a backend that
    accepts it."""
    args = re.search(r'POLICY_SGLANG_ARGS="([^"]*)"', SMOKE)
    assert args
    flags = args.group(1).split()
    assert flags[flags.index("--dtype") + 1] == "float32"
    assert flags[flags.index("--attention-backend") + 1] == "triton"
    assert "files+=(-f scripts/gpu/compose.fp32.yaml)" in SMOKE
    for layout in ([], ["compose.one-gpu.yaml"]):
        out = resolve("compose.yaml", *layout, "scripts/gpu/compose.fp32.yaml")
        assert out.returncode == 0, out.stderr
        env = json.loads(out.stdout)["services"]["sglang-policy"]["environment"]
        # sgl_kernel's RMSNorm has no fp32 kernel; Triton's fp32 dots are TF32 unless told otherwise
        assert env["SGLANG_FORCE_FUSED_OP_BACKEND"] == "torch" and env["TRITON_F32_DEFAULT"] == "ieee"
        assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1", "compose.yaml's own environment is kept"


def test_the_long_step_script_trains_one_long_sample_and_prints_its_figures(tmp_path: Path) -> None:
    """What gpu-smoke.sh runs for check 7, on the CPU with a small model and a shorter sample."""
    from tests.services.trainer.conftest import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", max_positions=4096)
    out = subprocess.run(
        [sys.executable, "scripts/gpu/long_step.py", "--hf-checkpoint", str(model), "--tokens", "3000"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["tokens"] == 3000 and figures["response_tokens"] == 512 and figures["applied"]
    assert figures["attention"] == "sdpa" and figures["plan_gib"] > 0 and figures["gpu_peak_gib"] is None
