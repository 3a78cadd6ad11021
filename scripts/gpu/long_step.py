"""One training step on one agent-length sample, measured against the memory plan: the figure the first person
with a GPU settles with `bash scripts/gpu-smoke.sh` (SMOKE_LONG_TOKENS, default 32768). Prints one JSON line:
the sample's tokens, the step's peak GPU memory (torch's max_memory_allocated), the plan's total for the same
settings, and the step's seconds. Runs on the CPU too (no peak then), which is how tests check it.

    python scripts/gpu/long_step.py --hf-checkpoint /models/Qwen3-4B --tokens 32768 --lora --recompute full
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from runtime.configuration.config import LoraConfig, TrainerConfig
from schemas import Sample
from services.trainer.memory import GIB, for_trainer, plan
from services.trainer.model import layer_spec_for, recompute_for
from services.trainer.policy import Policy
from services.trainer.spec import ModelSpec


def sample(tokens: int, response: int, vocab: int) -> Sample:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (tokens,), generator=g).tolist()
    return Sample(
        sample_id="long:1",
        session_id="long",
        mode="rl",
        kind="rl",
        tokens=ids,
        response_length=response,
        loss_mask=[1] * response,
        rollout_logprobs=[-3.0] * response,
        reward=1.0,
        weight_version=0,
        created_at=time.time(),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf-checkpoint", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--recompute", default="full")
    ap.add_argument("--lora", action="store_true")
    args = ap.parse_args()
    config = TrainerConfig(
        hf_checkpoint=args.hf_checkpoint,
        rollout_batch_size=1,
        micro_batch_tokens=args.micro_batch_tokens,
        max_sample_tokens=args.tokens,
        recompute=args.recompute,
        lora=LoraConfig(enabled=args.lora),
    )
    spec = ModelSpec.from_dir(args.hf_checkpoint)
    policy = Policy.from_hf(args.hf_checkpoint, config)
    bf16 = policy.dtype == torch.bfloat16
    lay = for_trainer(
        config,
        tp=1,
        pp=1,
        dp=1,
        dtype_bytes=2 if bf16 else 4,
        recompute=recompute_for(config.recompute),
        attention=layer_spec_for(config.layer_spec),
    )
    started = time.perf_counter()
    stats = policy.train([sample(args.tokens, args.response, spec.vocab_size)])
    seconds = time.perf_counter() - started
    figures = {
        "tokens": args.tokens,
        "response_tokens": stats.tokens,
        "attention": lay.attention,
        "recompute": lay.recompute,
        "applied": stats.applied,
        "step_s": round(seconds, 2),
        "gpu_peak_gib": None if stats.gpu_peak_gib is None else round(stats.gpu_peak_gib, 2),
        "plan_gib": round(plan(spec, lay).total / GIB, 2),
    }
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
