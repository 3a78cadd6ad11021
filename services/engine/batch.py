"""Batched decoding: the running requests of one weight version advance together, one forward pass per token
for all of them.

Each request is prefilled alone; its KV cache then joins the batch cache, left-padded to a common length, with
an attention mask that hides the padding and per-row position ids, so every row computes exactly what it would
compute alone. A finished row is dropped and any all-padding prefix trimmed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if n == 0 else F.pad(t, (0, 0, n, 0))  # [B, H, L, D]: pad the sequence dimension on the left


class DecodeBatch:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.jobs: list[Any] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 = real token, 0 = padding

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, job: Any, cache: Any) -> None:
        """Join a prefilled request (its cache holds its whole prompt)."""
        length = cache.get_seq_length()
        job_mask = torch.ones(1, length, dtype=torch.long)
        if self.cache is None or self.mask is None:
            self.cache, self.mask = cache, job_mask
        else:
            width = max(self.mask.shape[1], length)
            grow, pad = width - self.mask.shape[1], width - length
            merged = [
                (
                    torch.cat([_pad_left(k0, grow), _pad_left(k1, pad)]),
                    torch.cat([_pad_left(v0, grow), _pad_left(v1, pad)]),
                )
                for (k0, v0), (k1, v1) in zip(_layers(self.cache), _layers(cache), strict=True)
            ]
            self.cache = DynamicCache(ddp_cache_data=merged)
            self.mask = torch.cat([F.pad(self.mask, (grow, 0)), F.pad(job_mask, (pad, 0))])
        self.jobs.append(job)

    def remove(self, jobs: list[Any]) -> None:
        keep = [i for i, j in enumerate(self.jobs) if j not in jobs]
        if len(keep) == len(self.jobs):
            return
        self.jobs = [self.jobs[i] for i in keep]
        if not keep:
            self.cache, self.mask = None, None
            return
        assert self.cache is not None and self.mask is not None
        mask = self.mask[keep]
        start = int(
            (mask.sum(0) == 0).long().cumprod(0).sum()
        )  # leading columns that are padding in every row
        idx = torch.tensor(keep)
        self.cache = DynamicCache(
            ddp_cache_data=[(k[idx, :, start:], v[idx, :, start:]) for k, v in _layers(self.cache)]
        )
        self.mask = mask[:, start:]

    def step(self, last_tokens: list[int]) -> torch.Tensor:
        """Feed each row its last token; returns next-token logits [B, vocab]."""
        assert self.cache is not None and self.mask is not None
        positions = self.mask.sum(1, keepdim=True)  # real tokens so far = the new token's position
        mask = torch.cat([self.mask, torch.ones(len(self.jobs), 1, dtype=torch.long)], dim=1)
        out = self.model(
            input_ids=torch.tensor(last_tokens, dtype=torch.long)[:, None],
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        self.mask = mask
        return out.logits[:, -1]
