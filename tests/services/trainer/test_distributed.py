"""The parallel training path for real: torchrun starts two processes (gloo on the CPU) that train with tensor,
pipeline or data parallelism, and the log-probs, losses and exported weights must match one process training the
same samples. Megatron's TP layers, pipeline schedule, embedding-group and data-parallel gradient reductions, and
the distributed optimizer's reduce-scatter and all-gather, run as they do on GPUs; only the backend differs. The
reference is one process with the non-distributed optimizer, so every layout also shows that sharding the
optimizer changes nothing, and each rank resumes exactly from its own checkpoint state."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import read_topic
from runtime.process.ports import free_port
from schemas.topics import WEIGHTS
from services.trainer.checkpoints import TrainerStore
from services.trainer.model import read_hf_weights
from services.trainer.spec import ModelSpec
from tests.services.trainer.conftest import (
    make_sample,
    publish,
    save_random_model,
    save_tiny_llama,
    trainer_env,
)
from tests.services.trainer.dist_check import STEPS, run

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings and a vocab (300) that tensor parallelism must pad."""
    return save_tiny_llama(tmp_path_factory.mktemp("dist-llama"), vocab_size=300, max_positions=128)


@pytest.fixture(scope="module")
def baseline(model: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    result = run(str(model), 1, 1, distributed_optimizer=False)  # the optimizer as it was: the reference
    result["stats"] = [msgspec.to_builtins(s) for s in result["stats"]]
    initial = read_hf_weights(model)
    moved = max((result["weights"][k] - t).abs().max().item() for k, t in initial.items())
    assert moved > 1e-4  # training moved the weights: matching them below is not vacuous
    for name, w in result[
        "continued_weights"
    ].items():  # resuming without the distributed optimizer is exact too
        assert torch.equal(result["resumed_weights"][name], w), name
    return result


LAYOUTS = {"tp2": "2,1", "pp2": "1,2", "dp2": "1,1", "lora-tp2": "2,1,lora"}
"""Each layout's spec for dist_check.py (two processes each: TP 2, PP 2, DP 2, and LoRA under TP 2)."""


def torchrun(model: Path, out: Path, specs: list[str]) -> list[dict[str, Any]]:
    """dist_check.py under torchrun with two processes, every layout of ``specs`` in one launch."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
        str(ROOT / "tests/services/trainer/dist_check.py"), str(model), str(out), *specs,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = []
    for i in range(len(specs)):
        result = torch.load(f"{out}.{i}", weights_only=False)
        result["logprobs"] = torch.load(f"{out}.{i}.logprobs", weights_only=False)
        results.append(result)
    return results


@pytest.fixture(scope="module")
def trained_apart(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every layout's result, from one torchrun launch."""
    out = tmp_path_factory.mktemp("dist") / "result.pt"
    return dict(zip(LAYOUTS, torchrun(model, out, list(LAYOUTS.values())), strict=True))


def assert_matches(got: dict[str, Any], want: dict[str, Any], lr: float = 1e-4) -> None:
    # Forward: the same log-probs (micro-batches may be shaped differently: compare the token log-probs found).
    flat = [t[t != 0] for t in got["logprobs"]]
    ref = [t[t != 0] for t in want["logprobs"]]
    assert torch.allclose(torch.cat(flat).sort().values, torch.cat(ref).sort().values, atol=1e-5)
    # The same losses, KL and top-K terms at every step, and the same gradient norm.
    for g, w in zip(got["stats"], want["stats"], strict=True):
        keys = ("loss", "pg_loss", "entropy", "kl_rollout", "kl", "topk_loss", "tokens", "samples", "opd_gap")
        for key in (*keys, "is_weight_mean", "is_weight_max", "is_truncated"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3)
        plugin = g["terms"]["full_distribution_entropy"]
        assert plugin == pytest.approx(
            g["entropy"], rel=1e-4
        )  # the gathered log-softmax, the sharded entropy
    assert want["stats"][1]["kl"] > 0 and want["stats"][0]["topk_loss"] > 0  # the extra terms were live
    assert want["stats"][0]["is_weight_mean"] != pytest.approx(1.0, abs=0.05), (
        "the importance weights are live"
    )
    # The same updated weights. Adam moves each weight by at most ~lr per step, so no weight may differ by more than
    # 2 lr a step. Where a gradient is within rounding of zero, two layouts' summation orders may flip the sign of
    # that weight's step (a difference of up to 2 lr): isolated elements, a couple per tensor at most on any CPU.
    # A layout bug (a wrong shard, a transposed or misplaced block) moves whole rows, columns or tensors instead.
    assert got["weights"].keys() == want["weights"].keys()
    for name, w in want["weights"].items():
        diff = (got["weights"][name] - w).abs()
        assert diff.max() <= 2 * lr * STEPS, name
        assert (diff > 1e-6).sum().item() <= max(2, 0.01 * diff.numel()), name
    # The streamed export (tensor by tensor to rank 0) is the pickled gather + unshard, bit for bit, in order.
    assert list(got["weights"]) == list(got["unshard_reference"])
    for name, w in got["unshard_reference"].items():
        assert torch.equal(got["weights"][name], w), name
    # A rank resumed from its own checkpoint state takes exactly the step the running one took.
    for name, w in got["continued_weights"].items():
        assert torch.equal(got["resumed_weights"][name], w), name
    assert any(not torch.equal(got["continued_weights"][k], w) for k, w in got["weights"].items())


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_two_processes_train_like_one(
    layout: str, baseline: dict[str, Any], trained_apart: dict[str, dict[str, Any]]
) -> None:
    assert_matches(trained_apart[layout], baseline)


def test_lora_over_two_tensor_parallel_processes_trains_like_one(
    model: Path, trained_apart: dict[str, dict[str, Any]]
) -> None:
    """LoRA under TP 2 (the adapters split as their layers are, A's product made whole across the group): the
    same log-probs, losses, gradient norm and adapter after two steps as one process, the adapter gathered to
    rank 0 as its pickled shards join, and an exact resume from each rank's adapter-only state."""
    torch.set_num_threads(1)
    want = run(str(model), 1, 1, lora=True)
    want["stats"] = [msgspec.to_builtins(s) for s in want["stats"]]
    assert all(k.startswith("base_model.model.") for k in want["weights"])  # the export is the adapter
    assert any(k.endswith("lora_B.weight") and w.abs().max() > 1e-4 for k, w in want["weights"].items())
    assert_matches(trained_apart["lora-tp2"], want)


def torchrun_trainer(env: dict[str, str], log: Path) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
        "-m", "services.cli", "trainer",
    ]  # fmt: skip
    with open(log, "a") as fh:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, log.read_text()[-4000:]


@pytest.mark.integration
async def test_torchrun_trainer_service_steps_checkpoints_per_rank_and_resumes(
    kafka: KafkaConfig, tiny_llama: Path, tmp_path: Path
) -> None:
    """``turnstream trainer`` under torchrun with two data-parallel ranks: rank 0 consumes Kafka and publishes,
    both ranks train and write their own checkpoint state; a second launch resumes on both ranks."""
    samples = [make_sample(i) for i in range(12)]
    await publish(kafka, samples[:8])
    out = tmp_path / "weights"
    env = {
        **os.environ,
        **trainer_env(kafka, tiny_llama, out),
        "PYTHONPATH": str(ROOT),
        "TURNSTREAM_TRAINER_MAX_STEPS": "2",
        "TURNSTREAM_METRICS_PORT": str(free_port()),
    }
    env.pop("MASTER_PORT", None)
    await asyncio.to_thread(torchrun_trainer, env, tmp_path / "trainer.log")
    found = TrainerStore(out).latest()
    assert found is not None and found[0].version == 2
    assert sorted(p.name for p in found[1].glob("state-rank*.pt")) == ["state-rank0.pt", "state-rank1.pt"]

    await publish(kafka, samples[8:])
    await asyncio.to_thread(
        torchrun_trainer, {**env, "TURNSTREAM_TRAINER_MAX_STEPS": "1"}, tmp_path / "trainer.log"
    )
    found = TrainerStore(out).latest()
    assert found is not None and found[0].version == 3
    assert sorted(s for step in found[0].trained for s in step) == sorted(s.sample_id for s in samples)
    announced = [r.event.version async for r in read_topic(kafka, WEIGHTS)]
    assert sorted(set(announced)) == [1, 2, 3]
    assert ModelSpec.from_dir(out / "versions" / "v3") == ModelSpec.from_dir(tiny_llama)
    weights = read_hf_weights(out / "versions" / "v3")
    assert weights.keys() == read_hf_weights(tiny_llama).keys()


def _idle(where: str, timeout: float, gap: float, folder: Path) -> subprocess.CompletedProcess[str]:
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("MASTER_PORT", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
        str(ROOT / "tests/services/trainer/idle_check.py"), str(timeout), str(gap), where, str(folder),
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ranks_survive_an_idle_gap_longer_than_the_collective_timeout(tmp_path: Path) -> None:
    """A quiet night: rank 0 has no batch for longer than the collective timeout (NCCL's is 10 minutes; here 3 s
    against a 10 s gap). Waiting on the control group survives it; waiting on the tensor group, as the trainer
    once did, does not."""
    survived = _idle("control", 3, 10, tmp_path / "control")
    assert survived.returncode == 0, survived.stderr[-3000:]
    assert "rank 1 survived 10 s idle" in survived.stdout
    failed = _idle("default", 3, 10, tmp_path / "default")
    assert failed.returncode != 0
    assert "timed out" in failed.stderr.lower() or "timeout" in failed.stderr.lower(), failed.stderr[-3000:]


def test_each_rank_reads_only_its_slices(tmp_path: Path) -> None:
    """TP 2 over a 64M-parameter model (256 MB of fp32 safetensors): a rank's load adds at most its own
    parameters plus one slice in flight (its half of an embedding) and 16 MiB, in anonymous memory (the mapped
    file is page cache). Loading as before (whole file read, whole model converted, random init) exceeds it."""
    model = save_random_model(tmp_path / "model")
    found: dict[str, list[dict[str, int]]] = {}
    for how in ("sliced", "whole"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        env.pop("MASTER_PORT", None)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
            str(ROOT / "tests/services/trainer/load_check.py"), str(model), how, str(tmp_path),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[how] = [json.loads((tmp_path / f"{how}-rank{r}.json").read_text()) for r in range(2)]
        assert len(found[how]) == 2
    embedding_half = 32000 // 2 * 512 * 4
    for rank in found["sliced"]:
        bound = rank["param_bytes"] + embedding_half + 16 * 2**20
        assert rank["peak_added"] <= bound, rank
    assert all(r["peak_added"] > r["param_bytes"] + embedding_half + 16 * 2**20 for r in found["whole"]), (
        found
    )
