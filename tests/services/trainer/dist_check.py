"""Run under torchrun (gloo on the CPU) by test_distributed.py, or in-process for the single-process baseline:
the policy's token log-probs on a fixed batch, then training steps on fixed samples (decoupled PPO, pi_old
recomputed and gathered across ranks, + reference KL + top-K distillation), then the exported Hugging Face
weights. Rank 0 writes ``<out>``; the last pipeline stage's first rank writes ``<out>.logprobs``."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from schemas import Sample
from services.config import TrainerConfig
from services.trainer.model import shutdown_parallel
from services.trainer.parallel import ParallelLayout

STEPS = 2


def samples() -> list[Sample]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(4):
        prompt = torch.randint(1, 300, (4 + i,), generator=g).tolist()
        response = torch.randint(1, 300, (3 + 2 * i,), generator=g).tolist()
        n = len(response)
        old = (-torch.rand(n, generator=g) * 4 - 0.5).tolist()
        teacher = (-torch.rand(n, generator=g) * 4 - 0.1).tolist()
        topk_ids = [torch.randperm(300, generator=g)[:3].tolist() for _ in range(n)]
        topk_lp = [sorted((-torch.rand(3, generator=g) * 3 - 1.2).tolist(), reverse=True) for _ in range(n)]
        out.append(
            Sample(
                sample_id=f"s:{i}",
                session_id="s",
                mode="combine",
                kind="opd+rl",
                tokens=prompt + response,
                response_length=n,
                loss_mask=[1] * n,
                rollout_logprobs=old,
                reward=1.0 if i % 2 else -1.0,
                weight_version=0,
                created_at=time.time(),
                teacher_logprobs=teacher,
                topk_token_ids=topk_ids,
                topk_logprobs=topk_lp,
            )
        )
    return out


def config(tp: int, pp: int) -> TrainerConfig:
    return TrainerConfig(
        lr=1e-4,
        rollout_batch_size=4,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        micro_batch_tokens=24,  # several micro-batches per rank
        kl_coef=0.1,
        topk_coef=0.5,
        precision="fp32",
        # pi_old recomputed on each rank's share and gathered over every layout, the rollout's as the behaviour.
        old_logprobs="decoupled",
    )


def run(model: str, tp: int, pp: int, layout: ParallelLayout | None = None) -> dict[str, Any]:
    from services.trainer.policy import Policy
    from services.trainer.step import plan, reference_logprobs

    torch.manual_seed(0)
    policy = Policy.from_hf(model, config(tp, pp), layout)
    batch = samples()
    micro = plan(batch, 10_000, policy.settings, fixed=policy.layout.pp > 1)
    before = reference_logprobs(policy.model, micro, policy.forward)
    stats = [policy.train(batch) for _ in range(STEPS)]
    return {
        "logprobs": [t.detach().cpu() for t in before],
        "stats": stats,
        "weights": policy.export(),
        "layout": policy.layout,
    }


def main() -> None:
    model, tp, pp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    layout = ParallelLayout.from_env(tp, pp)
    result = run(model, tp, pp, layout)
    lay = result["layout"]
    if lay.rank == 0:
        torch.save(
            {"stats": [msgspec.to_builtins(s) for s in result["stats"]], "weights": result["weights"]}, out
        )
    if lay.last_stage and lay.tp_rank == 0 and lay.dp_rank == 0:
        torch.save(result["logprobs"], f"{out}.logprobs")
    shutdown_parallel(lay)


if __name__ == "__main__":
    main()
