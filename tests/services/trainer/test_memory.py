"""The trainer's memory plan: its activation model against the bytes autograd really keeps for Megatron-core's
layers on this CPU, its arithmetic against hand-computed figures for Qwen3-0.6B/4B/8B (their real config.json
files, no weights), the layouts it proposes, ``turnstream trainer plan``, and the trainer refusing a layout that
does not fit before it reads a weight."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from runtime.configuration.config import TrainerConfig
from services.trainer.memory import (
    GIB,
    DoesNotFit,
    PlanInput,
    check_fits,
    layer_activations,
    plan,
    propose,
    total_params,
)
from services.trainer.spec import ModelSpec
from tests.services.trainer.test_parallel import spec

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = Path(__file__).parent / "configs"


def qwen3(size: str) -> ModelSpec:
    return ModelSpec.from_dir(CONFIGS / f"qwen3-{size}")


def _tiny(family: str, layers: int, heads: int, kv_heads: int) -> ModelSpec:
    return msgspec.structs.replace(
        spec(family, tie=False, layers=layers, vocab=1000),
        hidden_size=64,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=16,
        ffn_hidden_size=160,
        max_position=512,
    )


def _saved_bytes(
    spec: ModelSpec, dtype: torch.dtype, recompute: str, b: int, s: int, attention: str = "local"
) -> int:
    """Bytes of the distinct storages autograd keeps for backward in one forward (parameters excluded)."""
    from services.trainer.model import build_model, forward_logits, init_parallel

    init_parallel()
    model = build_model(spec, dtype, recompute=recompute, layer_spec=attention)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, spec.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_logits(model, tokens)
    return sum(kept.values())


@pytest.mark.parametrize("attention", ["local", "sdpa"])
@pytest.mark.parametrize(
    ("family", "heads", "kv_heads", "dtype", "recompute"),
    [
        ("llama", 8, 2, torch.float32, "none"),
        ("llama", 8, 2, torch.float32, "selective"),
        ("llama", 8, 2, torch.float32, "full"),
        ("llama", 6, 6, torch.float32, "none"),
        ("llama", 8, 2, torch.bfloat16, "none"),
        ("qwen3", 8, 2, torch.bfloat16, "none"),
        ("qwen3", 8, 2, torch.bfloat16, "selective"),
        ("qwen3", 8, 2, torch.float32, "none"),
        ("qwen3", 4, 4, torch.float32, "selective"),
    ],
)
def test_the_activation_model_is_what_megatron_keeps_per_layer(
    family: str, heads: int, kv_heads: int, dtype: torch.dtype, recompute: str, attention: str
) -> None:
    """One layer's saved bytes (a 2-layer model minus a 1-layer one) equal the plan's, byte for byte, for two
    micro-batch shapes (the sequence x sequence term and the per-token terms move differently), with Megatron's
    local attention and with torch's flash kernel (``sdpa``: nothing sequence x sequence)."""
    torch.set_num_threads(1)
    for b, s in ((2, 48), (1, 80)):
        got = _saved_bytes(
            _tiny(family, 2, heads, kv_heads), dtype, recompute, b, s, attention
        ) - _saved_bytes(_tiny(family, 1, heads, kv_heads), dtype, recompute, b, s, attention)
        lay = PlanInput(
            micro_batch_tokens=b * s,
            seq_len=s,
            recompute=recompute,
            dtype_bytes=torch.tensor([], dtype=dtype).element_size(),
            attention=attention,
        )
        want = layer_activations(_tiny(family, 1, heads, kv_heads), lay)
        # Selective recompute adds Megatron's 4-byte RNG-state tensor per checkpoint.
        assert got - (4 if recompute == "selective" else 0) == want, (b, s)


def test_parameters_of_the_qwen3_configs() -> None:
    """Hand-computed from each config.json: per layer q, k, v (32 + 2 x 8 heads of 128), o, gate/up/down, two
    RMSNorms and the q/k norms; the embedding once when tied, twice when not."""
    layer_8b = 4096 * (32 + 16) * 128 + 32 * 128 * 4096 + 3 * 12288 * 4096 + 2 * 4096 + 2 * 128
    assert total_params(qwen3("8b")) == 36 * layer_8b + 2 * 151936 * 4096 + 4096 == 8_190_735_360
    layer_4b = 2560 * 48 * 128 + 32 * 128 * 2560 + 3 * 9728 * 2560 + 2 * 2560 + 2 * 128
    assert total_params(qwen3("4b")) == 36 * layer_4b + 151936 * 2560 + 2560 == 4_022_468_096
    layer_06b = 1024 * 32 * 128 + 16 * 128 * 1024 + 3 * 3072 * 1024 + 2 * 1024 + 2 * 128
    assert total_params(qwen3("0.6b")) == 28 * layer_06b + 151936 * 1024 + 1024 == 596_049_920


def test_qwen3_8b_on_tp2_dp3_by_hand() -> None:
    """The issue's layout arithmetic: 2 bytes of bf16 weights, 4 of fp32 gradients, 12 of optimizer state sharded
    over 3 data-parallel ranks, per parameter of one TP rank; activations of 36 layers with selective recompute
    at 8,192 tokens, plus one layer's attention probabilities while they are recomputed."""
    lay = PlanInput(
        tp=2,
        dp=3,
        micro_batch_tokens=8192,
        recompute="selective",
        distributed_optimizer=True,
        attention="local",
    )
    p = plan(qwen3("8b"), lay)
    layer = (4096 * 48 * 128 + 32 * 128 * 4096 + 3 * 12288 * 4096) // 2 + 2 * 4096 + 2 * 128
    vocab_rows = 152064 // 2  # 151,936 padded to a multiple of 128 x 2, split over 2 ranks
    params = 36 * layer + 2 * vocab_rows * 4096 + 4096
    assert p.params == params == 4_096_046_080
    assert (p.weights, p.gradients, p.optimizer) == (2 * params, 4 * params, 12 * params // 3)
    t, h, q, k, f = 8192, 4096, 16 * 128, 4 * 128, 12288 // 2
    per_layer = (
        2 * (10 * t * h + 4 * t)  # two RMSNorms: fp32 internals, bf16 output, rstd
        + 5 * 2 * t * f  # SwiGLU
        + 2 * t * q  # context
        + 4 * 2 * t * 128  # RoPE cos/sin
        + 8 * t * q
        + 8 * t * k
        + 4 * t * (16 + 4)  # q/k norms in fp32
        + 2 * t * (q + k)
        + 2 * t * (q + 2 * k)  # selective: q, k and the fused QKV output
    )
    probs = 16 * t * t * (4 + 2 + 4)  # fp32 softmax, bf16 copy, fp32 gradient of one layer
    assert p.activations == 36 * per_layer + probs
    vocab_slice = 152064 // 2  # each rank's logits are its half of the vocabulary
    # the output layer on 1,024 positions at a time: their bf16 logits and gradient, the loss's fp32 chunk; the
    # gathered hidden states and their gradient, the per-token figures; local attention's [1, 1, s, s] mask
    head = 2 * 2 * 1024 * vocab_slice + 12 * 1024 * vocab_slice + 2 * 2 * t * h + 24 * t
    assert p.logits == head + t * t
    assert p.total == (2 + 4 + 4) * params + p.activations + p.logits + 4 * GIB
    assert p.total / GIB == pytest.approx(103.0, abs=0.1)
    # torch's flash kernel (the runtime image's attention): no probabilities, no mask.
    sdpa = plan(qwen3("8b"), msgspec.structs.replace(lay, attention="sdpa"))
    assert (sdpa.activations, sdpa.logits) == (36 * per_layer, head)
    # Without the distributed optimizer the same layout needs the 12 bytes whole: 33 GiB more.
    unsharded = plan(qwen3("8b"), msgspec.structs.replace(lay, distributed_optimizer=False))
    assert unsharded.optimizer == 12 * params


def test_the_issues_headlines_8b_on_six_gpus_4b_on_one() -> None:
    base = PlanInput(micro_batch_tokens=8192)
    eight = propose(qwen3("8b"), 6, 140.0, base)
    assert eight is not None and eight.total <= 140 * GIB
    four = propose(qwen3("4b"), 1, 140.0, base)
    assert four is not None and four.total <= 140 * GIB
    # 8B on one GPU cannot fit: 18 bytes per parameter is 137 GiB before any activation.
    assert propose(qwen3("8b"), 1, 140.0, base) is None
    # The proposal fits and prefers data parallelism: no fitting layout has less model parallelism.
    assert eight.layout.tp * eight.layout.pp == 1 and eight.layout.distributed_optimizer


def test_recompute_and_model_parallelism_shrink_the_plan() -> None:
    spec = qwen3("4b")
    figures = {r: plan(spec, PlanInput(recompute=r)).activations for r in ("none", "selective", "full")}
    assert figures["none"] > figures["selective"] > figures["full"]
    one, two = plan(spec, PlanInput()), plan(spec, PlanInput(tp=2))
    assert two.params < one.params / 1.9 and two.activations < one.activations
    assert plan(spec, PlanInput(reference=True)).reference == one.weights


def test_a_layout_that_does_not_fit_is_refused_with_its_numbers() -> None:
    # Megatron's local attention keeps 36 layers x 32 heads x 8,192^2 probabilities (6 bytes each) without recompute.
    with pytest.raises(
        DoesNotFit, match=r"needs 575\.2 GiB per GPU.*optimizer 45\.0 GiB.*activations 501\.4 GiB"
    ):
        lay = PlanInput(recompute="none", distributed_optimizer=False, attention="local")
        check_fits(qwen3("4b"), lay, 80.0)
    assert check_fits(qwen3("0.6b"), PlanInput(), 80.0).total < 80 * GIB


def test_the_trainer_refuses_before_reading_weights(tmp_path: Path) -> None:
    """A folder with only a config.json: a refusal that came after loading would fail on the missing weights
    instead."""
    from services.trainer.policy import Policy

    shutil.copy(CONFIGS / "qwen3-4b" / "config.json", tmp_path / "config.json")
    config = TrainerConfig(gpu_memory_gib=24.0, precision="fp32", rollout_batch_size=1)
    with pytest.raises(DoesNotFit, match=r"more than the 24\.0 GiB available"):
        Policy.from_hf(tmp_path, config)


def _plan_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "trainer", "plan", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_turnstream_trainer_plan() -> None:
    proc = _plan_cli("--hf-checkpoint", str(CONFIGS / "qwen3-8b"), "--gpus", "6", "--json")
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    assert out["model"]["params"] == 8_190_735_360
    assert out["plan"]["gib"]["total"] <= 140
    assert all(p["gib"]["total"] <= 140 for p in out["fitting"]) and len(out["fitting"]) > 1
    table = _plan_cli(
        "--hf-checkpoint",
        str(CONFIGS / "qwen3-8b" / "config.json"),
        "--tp",
        "2",
        "--gpus",
        "6",
        "--max-sample-tokens",
        "8192",
    )
    assert table.returncode == 0, table.stderr
    assert "planned: TP 2 x PP 1 x DP 3" in table.stdout and "(fits 140 GiB)" in table.stdout
    assert "optimizer" in table.stdout and "activations" in table.stdout
    none = _plan_cli("--hf-checkpoint", str(CONFIGS / "qwen3-8b"), "--gpus", "1")
    assert none.returncode == 1 and "no layout fits" in none.stdout
    bad = _plan_cli("--hf-checkpoint", str(CONFIGS / "missing"))
    assert bad.returncode == 2 and "missing" in bad.stderr


def test_the_kl_reference_costs_a_model_except_under_lora() -> None:
    """Under LoRA the KL term's reference is the policy with its adapters off (no second copy), unless
    ``trainer.reference_checkpoint`` names another model."""

    def reference_gib(*extra: str, env: dict[str, str] | None = None) -> float:
        args = ("--hf-checkpoint", str(CONFIGS / "qwen3-4b"), "--tp", "1", "--gpus", "1", "--json", *extra)
        proc = _plan_cli(*args, env=env)
        assert proc.returncode in (0, 1), proc.stderr
        return float(json.loads(proc.stdout)["plan"]["gib"]["reference"])

    full = reference_gib("--kl")
    assert full > 7  # Qwen3-4B in bf16, a second time
    assert reference_gib("--kl", "--lora") == 0
    assert reference_gib("--lora") == 0
    other = {"TURNSTREAM_TRAINER_REFERENCE_CHECKPOINT": str(CONFIGS / "qwen3-4b")}
    assert reference_gib("--kl", "--lora", env=other) == full
