"""Token sampling and log-prob bookkeeping.

Every log-prob the engine reports is taken from the model's unprocessed distribution (``log_softmax`` of the
raw logits, temperature 1), whatever the sampling parameters: that is the distribution the trainer recomputes,
so rollout log-probs, scoring log-probs and training log-probs are comparable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: no top-k filter (SGLang's convention)."""
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample_token(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator) -> int:
    """Sample one token id from a [vocab] logits row."""
    if cfg.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float() / cfg.temperature
    if 0 < cfg.top_k < scores.numel():
        kth = torch.topk(scores, cfg.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        cumulative = torch.cumsum(probs, dim=-1)
        drop = cumulative - probs > cfg.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The k most likely (log-prob, token id) pairs of a [vocab] log-prob row, most likely first."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return [(float(v), int(i)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
