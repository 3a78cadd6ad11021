"""Trainer speed on the CPU, side by side with a plain PyTorch baseline, in one run. Prints JSON.

    .venv/bin/python bench/trainer.py [--batch 16] [--prompt 48] [--response 32] [--steps 3] [--recompute auto]

Both take the same optimizer steps on the same SmolLM2 batch (PPO loss of services/trainer/loss.py): turnstream's
Megatron-core policy (DDP + Megatron's optimizer, the CPU shim) against transformers' model with torch.optim.AdamW.
Then: the time to export a version (HF safetensors, written atomically) and for the CPU engine to load it with
/update_weights_from_disk.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import torch

from schemas import Sample
from services.config import TrainerConfig
from services.engine.launch import EngineProcess
from services.model_store import fetch_smollm2
from services.trainer.checkpoints import TrainerStore
from services.trainer.loss import batch_mean, ppo_clip_loss
from services.trainer.policy import Policy
from services.trainer.step import collate, token_logprobs, train_step


def make_batch(n: int, prompt: int, response: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tokens = torch.randint(10, 40000, (prompt + response,), generator=g).tolist()
        out.append(
            Sample(
                sample_id=f"b:{i + 1}",
                session_id="b",
                mode="rl",
                kind="rl",
                tokens=tokens,
                response_length=response,
                loss_mask=[1] * response,
                rollout_logprobs=[-8.0] * response,
                reward=1.0 if i % 2 else -1.0,
                weight_version=0,
                created_at=time.time(),
            )
        )
    return out


def baseline_step(model: torch.nn.Module, opt: torch.optim.Optimizer, samples: list[Sample]) -> None:
    c = collate(samples)
    opt.zero_grad()
    logits = model(c.tokens, attention_mask=c.attention_mask).logits
    loss, _ = ppo_clip_loss(token_logprobs(logits, c.tokens), c.old_logprobs, c.advantages)
    batch_mean(loss, c.loss_mask).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def run_baseline(path: Path, samples: list[Sample], steps: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").train()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.98), weight_decay=0.1)
    return timed(lambda: baseline_step(hf, opt, samples), steps)


def timed(fn, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", default="auto", choices=["auto", "none", "selective", "full"])
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    path = fetch_smollm2(log=False)
    samples = make_batch(args.batch, args.prompt, args.response)
    tokens = args.batch * (args.prompt + args.response)

    base = run_baseline(path, samples, args.steps)

    policy = Policy.from_hf(path, TrainerConfig(recompute=args.recompute))
    ours = timed(
        lambda: train_step(policy.model, policy.optimizer, samples, forward=policy.forward), args.steps
    )

    with tempfile.TemporaryDirectory() as tmp:
        store = TrainerStore(tmp)
        t0 = time.perf_counter()
        version_path, _ = store.write_version(1, policy.entries(), policy.hf_stream(), path)
        export_s = time.perf_counter() - t0
        engine = EngineProcess(path)
        try:
            t0 = time.perf_counter()
            r = httpx.post(
                engine.url + "/update_weights_from_disk",
                json={"model_path": str(version_path), "weight_version": "1"},
                timeout=300,
            )
            load_s = time.perf_counter() - t0
            assert r.status_code == 200 and r.json().get("success"), r.text
        finally:
            engine.stop()

    b, o = statistics.median(base), statistics.median(ours)
    print(
        json.dumps(
            {
                "batch": {
                    "samples": args.batch,
                    "tokens": tokens,
                    "response_tokens": args.batch * args.response,
                },
                "baseline_transformers_adamw": {"step_s": round(b, 3), "tokens_per_s": round(tokens / b, 1)},
                "turnstream_megatron": {"step_s": round(o, 3), "tokens_per_s": round(tokens / o, 1)},
                "recompute": args.recompute,
                "step_time_ratio_megatron_over_baseline": round(o / b, 3),
                "export_version_s": round(export_s, 3),
                "engine_load_version_s": round(load_s, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
