"""Random training samples for tests that need a batch but no particular text."""

from __future__ import annotations

import time

import torch

from schemas import Sample


def random_rl_samples(
    n: int, seed: int, low: int = 1, high: int = 500, prompt: int = 5, response: int = 4
) -> list[Sample]:
    """``n`` rl samples of token ids in [low, high), alternately rewarded -1 and +1, the i-th ``prompt + i``
    and ``response + i`` tokens long, from weights version 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(low, high, (prompt + i,), generator=g).tolist()
        r = torch.randint(low, high, (response + i,), generator=g).tolist()
        out.append(
            Sample(
                sample_id=f"s:{i}",
                session_id="s",
                mode="rl",
                kind="rl",
                tokens=p + r,
                response_length=len(r),
                loss_mask=[1] * len(r),
                rollout_logprobs=[-6.0] * len(r),
                reward=1.0 if i % 2 else -1.0,
                weight_version=0,
                created_at=time.time(),
            )
        )
    return out
